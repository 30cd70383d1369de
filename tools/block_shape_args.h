// The block-shape tools' arguments (gemm_rate, memory_rate): --dim D, --hidden H, --tokens M
// (positive multiples of 8) and, for a tool that sums over the blocks, --depth L (positive).
// Defaults: ViT-H/16 at batch 64.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

struct BlockShape {
  int D = 1280, H = 5120, M = 64 * 197, L = 32;
};

// The shape argv[1..] gives; false, with one line on stderr naming the problem, on a bad argument.
inline bool parse_block_shape(int argc, char** argv, const char* tool, bool with_depth, BlockShape* s) {
  const auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "%s: %s (usage: %s [--dim D] [--hidden H] [--tokens M]%s)\n", tool, why.c_str(), tool,
                 with_depth ? " [--depth L]" : "");
    return false;
  };
  if (argc % 2 == 0) return fail("options come with a value each");
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    int* field = a == "--dim" ? &s->D : a == "--hidden" ? &s->H : a == "--tokens" ? &s->M
               : a == "--depth" && with_depth ? &s->L : nullptr;
    if (!field) return fail("unknown option " + a);
    if (field == &s->L ? v <= 0 : v <= 0 || v % 8 != 0)
      return fail(a + (field == &s->L ? " must be positive" : " must be a positive multiple of 8"));
    *field = v;
  }
  return true;
}
