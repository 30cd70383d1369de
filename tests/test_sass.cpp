// The machine code of the hand-written tensor-core kernels, read back from this test binary with
// cuobjdump: the resident attention kernels must hold warpgroup MMAs (HGMMA, wgmma), the streamed
// and single-pass ones mma.sync (HMMA), and no kernel may touch local memory (LDL, STL: spilled
// registers or a stack array). The build already refuses spills (Makefile, NO_SPILLS, -Werror) and
// serialized wgmmas (the Makefile's .cu rule reads ptxas's output); this reads what was emitted. cuobjdump comes
// with CUDA's full toolkit (the GPU machine's); where it is missing the check is skipped.
#include <doctest/doctest.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/harness.h"
#include "tests/shell.h"

namespace {
struct KernelSass {
  int hgmma = 0, hmma = 0, local = 0, instructions = 0;
};

// cuobjdump -sass output: each "Function : <mangled name>" line starts a kernel, whose
// instructions follow as "/*0a30*/  @P0 HGMMA.64x64x16.F32.BF16 ... ;". Counted by opcode (the
// mnemonic before its first '.').
std::map<std::string, KernelSass> parse_sass(const std::string& text) {
  std::map<std::string, KernelSass> kernels;
  KernelSass* current = nullptr;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t fn = line.find("Function : ");
    if (fn != std::string::npos) {
      std::string name = line.substr(fn + 11);
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
      current = &kernels[name];
      continue;
    }
    const size_t addr = line.find("*/");
    if (!current || line.find("/*") == std::string::npos || addr == std::string::npos) continue;
    std::istringstream words(line.substr(addr + 2));
    std::string op;
    words >> op;
    if (!op.empty() && op[0] == '@') words >> op;  // a predicate
    op = op.substr(0, op.find('.'));
    if (op.empty() || op == ";" || op.rfind("/*", 0) == 0) continue;  // an encoding-only line
    ++current->instructions;
    if (op == "HGMMA") ++current->hgmma;
    if (op == "HMMA") ++current->hmma;
    if (op == "LDL" || op == "STL") ++current->local;
  }
  return kernels;
}

// The cuobjdump beside CUDA's nvcc, else on the PATH; empty where there is none.
std::string find_cuobjdump() {
  std::vector<std::string> roots;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* root = std::getenv(var)) roots.emplace_back(root);
  roots.emplace_back("/usr/local/cuda");
  for (const std::string& root : roots)
    if (run_command("test -x '" + root + "/bin/cuobjdump'").code == 0) return root + "/bin/cuobjdump";
  return run_command("command -v cuobjdump").code == 0 ? "cuobjdump" : "";
}
}  // namespace

TEST_CASE("sass parser: kernels, opcodes after a predicate, local memory") {
  const std::string text =
      "\tcode for sm_90a\n"
      "\t\tFunction : _Z33attention_forward_resident_kernelILi80ELi2EEv\n"
      "\t.headerflags\t@\"EF_CUDA_SM90\"\n"
      "        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */\n"
      "                                                                              /* 0x000fe40000000800 */\n"
      "        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ; /* 0x0 */\n"
      "        /*0020*/              @!P0 HGMMA.64x16x16.F32.BF16 R88, gdesc[UR8], R88 ; /* 0x0 */\n"
      "\t\tFunction : _Z21attention_dq_kernelILi64EEv\n"
      "        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0 */\n"
      "        /*0010*/               @P1 STL [R1], R2 ;                         /* 0x0 */\n"
      "        /*0020*/                   EXIT ;                                  /* 0x0 */\n";
  const auto k = parse_sass(text);
  REQUIRE(k.size() == 2);
  const KernelSass& fwd = k.at("_Z33attention_forward_resident_kernelILi80ELi2EEv");
  CHECK(fwd.instructions == 3);
  CHECK(fwd.hgmma == 2);
  CHECK(fwd.hmma == 0);
  CHECK(fwd.local == 0);
  const KernelSass& dq = k.at("_Z21attention_dq_kernelILi64EEv");
  CHECK(dq.instructions == 3);
  CHECK(dq.hmma == 1);
  CHECK(dq.local == 1);
}

TEST_CASE("sass: the attention kernels hold their matrix instructions, no kernel uses local memory") {
  const std::string cuobjdump = find_cuobjdump();
  if (cuobjdump.empty()) {
    mark_skipped();
    return;
  }
  // This binary's own path: /proc/self/exe in the shell that runs cuobjdump would be the shell.
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const CommandResult dump = run_command("'" + cuobjdump + "' -sass '" + self + "'");
  INFO(dump.out.substr(0, 2000));
  REQUIRE(dump.code == 0);
  const auto kernels = parse_sass(dump.out);
  REQUIRE(kernels.size() > 20);

  // Each family: the instruction it was written for, in every instantiation, and at least one
  // instantiation found (a renamed kernel must not make the check vacuous).
  struct Family {
    const char* name;
    bool wgmma;
  };
  for (const Family f : {Family{"attention_forward_resident_kernel", true}, Family{"attention_backward_resident_kernel", true},
                         Family{"attention_forward_kernel", false}, Family{"attention_dkdv_kernel", false},
                         Family{"attention_dq_kernel", false}, Family{"attention_backward_single_kernel", false}}) {
    int found = 0;
    for (const auto& [name, sass] : kernels) {
      if (name.find(f.name) == std::string::npos) continue;
      ++found;
      CAPTURE(name);
      CHECK((f.wgmma ? sass.hgmma : sass.hmma) > 0);
      if (f.wgmma) CHECK(sass.hmma == 0);  // no fallback to mma.sync in a wgmma kernel
    }
    CAPTURE(f.name);
    CHECK(found > 0);
  }
  for (const auto& [name, sass] : kernels) {
    CAPTURE(name);
    CHECK(sass.instructions > 0);
    CHECK(sass.local == 0);
  }
}
