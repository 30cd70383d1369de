// Data parallel. CPU tier: the launcher environment and the control channel (rendezvous,
// failure reports, a lost process) over loopback. GPU tier, on a machine with two GPUs or more:
// 2 GPUs x batch B train like 1 GPU x batch 2B (bf16 and fp8) with bit-identical weights on both
// ranks; two processes under a launcher's environment train like --gpus 2; a failing rank, or a
// killed process, stops the others with a message naming it, in bounded time.
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/check.h"
#include "comm/rendezvous.h"
#include "tests/harness.h"
#include "tests/idx_files.h"
#include "tests/shell.h"

namespace {
std::function<const char*(const char*)> env(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

std::string usage_error(std::map<std::string, std::string> vars) {
  try {
    process_group_from_env(env(std::move(vars)));
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// A port nobody listens on now (the kernel's pick for an ephemeral bind).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

ProcessGroup loopback(int rank, int size, int port) {
  ProcessGroup g;
  g.rank = rank;
  g.size = size;
  g.master_addr = "127.0.0.1";
  g.master_port = port;
  return g;
}

bool wait_for(const std::function<bool()>& cond, int seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}
}  // namespace

TEST_CASE("distributed: the launcher's environment, torchrun's and Slurm's, and every bad one named") {
  const ProcessGroup alone = process_group_from_env(env({}));
  CHECK(alone.size == 1);
  CHECK(alone.rank == 0);
  const ProcessGroup t = process_group_from_env(
      env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29500"}}));
  CHECK(t.rank == 3);
  CHECK(t.size == 4);
  CHECK(t.local_rank == 1);
  CHECK(t.master_addr == "node7");
  CHECK(t.master_port == 29500);
  const ProcessGroup s = process_group_from_env(env({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                                                     {"MASTER_ADDR", "n0"}, {"MASTER_PORT", "1234"}}));
  CHECK(s.rank == 9);
  CHECK(s.size == 16);
  CHECK(s.local_rank == 1);
  CHECK(s.source.find("Slurm") != std::string::npos);
  // A one-task Slurm job (srun -n 1) needs no rendezvous.
  CHECK(process_group_from_env(env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}})).size == 1);
  CHECK(usage_error({{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}).find("RANK is not set") != std::string::npos);
  CHECK(usage_error({{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"LOCAL_RANK", "0"}}).find("RANK='2' must be") !=
        std::string::npos);
  CHECK(usage_error({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}})
            .find("MASTER_ADDR is not set") != std::string::npos);
  CHECK(usage_error({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "x"}})
            .find("MASTER_PORT='x'") != std::string::npos);
  CHECK(usage_error({{"WORLD_SIZE", "two"}}).find("WORLD_SIZE='two'") != std::string::npos);
  // Half a launcher's environment: refused, not a lone run on every process.
  CHECK(usage_error({{"RANK", "1"}}).find("RANK is set but WORLD_SIZE is not") != std::string::npos);
  CHECK(usage_error({{"LOCAL_RANK", "0"}}).find("LOCAL_RANK is set but WORLD_SIZE is not") != std::string::npos);
  // Inside an allocation (salloc) but not in an srun task.
  CHECK(usage_error({{"SLURM_NTASKS", "8"}}).find("SLURM_NTASKS is set but SLURM_PROCID is not: launch the tasks with srun") !=
        std::string::npos);
}

TEST_CASE("distributed: rendezvous over loopback hands every process the id; failures reach every process") {
  const int port = free_port(), n = 3;
  const std::vector<char> id = {'n', 'c', 'c', 'l', '-', 'i', 'd', '!'};
  // What the failure callbacks write: declared before the channels, so that it outlives their
  // watcher threads (a callback still running after the test's last check once wrote into a
  // vector already destroyed: a crash one run in ~15).
  std::vector<std::string> heard(n);
  std::mutex m;
  std::vector<std::unique_ptr<ControlChannel>> ch(n);
  std::vector<std::thread> t;
  for (int r = n - 1; r >= 0; --r)  // the others first: they retry until process 0 listens
    t.emplace_back([&, r] { ch[r] = std::make_unique<ControlChannel>(loopback(r, n, port), r == 0 ? id : std::vector<char>{}, id.size(), 20); });
  for (std::thread& x : t) x.join();
  for (int r = 0; r < n; ++r) CHECK(ch[r]->payload() == id);

  // Process 2 fails: process 0 passes it on, process 1 hears of it.
  for (int r = 0; r < n; ++r)
    ch[r]->on_failure([&, r](const std::string& f) {
      std::lock_guard<std::mutex> lock(m);
      heard[r] = f;
    });
  ch[2]->report_failure("out of memory");
  CHECK(wait_for([&] { return !ch[1]->failure().empty() && !ch[0]->failure().empty(); }, 10));
  CHECK(ch[1]->failure() == "process 2: out of memory");
  CHECK(ch[0]->failure() == "process 2: out of memory");
  // The callbacks run after failure() changes: wait for them too.
  CHECK(wait_for([&] {
    std::lock_guard<std::mutex> lock(m);
    return !heard[0].empty() && !heard[1].empty();
  }, 10));
  std::lock_guard<std::mutex> lock(m);
  CHECK(heard[0] == "process 2: out of memory");
  CHECK(heard[1] == "process 2: out of memory");
  CHECK(heard[2].empty());  // the failing process knows already
}

TEST_CASE("distributed: a process that vanishes without a goodbye is reported lost; a goodbye is not a failure") {
  const int port = free_port(), n = 3;
  const std::vector<char> id(16, 'x');
  std::vector<std::unique_ptr<ControlChannel>> ch(n);
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r)
    t.emplace_back([&, r] { ch[r] = std::make_unique<ControlChannel>(loopback(r, n, port), r == 0 ? id : std::vector<char>{}, id.size(), 20); });
  for (std::thread& x : t) x.join();
  ch[2]->goodbye();
  ch[2].reset();  // a clean end
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(ch[0]->failure().empty());
  ch[1].reset();  // gone without a goodbye: killed
  CHECK(wait_for([&] { return !ch[0]->failure().empty(); }, 10));
  CHECK(ch[0]->failure().find("process 1 was lost") != std::string::npos);
}

TEST_CASE("distributed: nobody at the rendezvous is a clear error in bounded time") {
  const auto t0 = std::chrono::steady_clock::now();
  std::string err;
  try {
    ControlChannel c(loopback(1, 2, free_port()), {}, 8, 2);
  } catch (const RuntimeError& e) {
    err = e.what();
  }
  CHECK(err.find("could not reach process 0") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

// ---- GPU tier: two GPUs ----
namespace {
int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : (cudaGetLastError(), 0);
}
}  // namespace

// The two-GPU tests' guard: skipped (not passed) on a machine with fewer.
#define SKIP_WITHOUT_TWO_GPUS() \
  do {                          \
    SKIP_WITHOUT_GPU();         \
    if (gpu_count() < 2) {      \
      mark_skipped();           \
      return;                   \
    }                           \
  } while (0)

namespace {

using Run = CommandResult;
Run shell(const std::string& cmd) { return run_command(cmd); }

// The loss column of vit_train's progress lines.
std::vector<double> losses(const std::string& out) {
  std::vector<double> v;
  for (const auto& [step, loss] : progress_losses(out)) v.push_back(loss);
  return v;
}

const std::string kSmall = "./vit_train --img 32 --patch 8 --channels 3 --classes 10 --dim 64 --depth 2 --heads 4 "
                           "--lr 0.05 --steps 10 --warmup 2 --log-every 1 --bucket-mb 1 --comm-timeout 60 "
                           "--attention engine";  // runs compared bit for bit: no kernel chosen by timing

// The 16 hex digits of the run's "weights: checksum" line (empty without one).
std::string weights_checksum(const std::string& out) {
  const std::string key = "weights: checksum ";
  const size_t at = out.find(key);
  return at == std::string::npos ? std::string() : out.substr(at + key.size(), 16);
}

void check_same_losses(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == 10);
  REQUIRE(b.size() == 10);
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    // The same images and weights; only summation orders differ (half batches, GEMM tilings).
    CHECK(std::fabs(a[i] - b[i]) <= 1e-2 * std::fabs(a[i]) + 1e-3);
  }
}
}  // namespace

TEST_CASE("gpu: --attention single-pass and streamed train alike; single-pass is refused where it does not apply") {
  SKIP_WITHOUT_GPU();
  const Run streamed = shell(kSmall + " --attention streamed");
  const Run single = shell(kSmall + " --attention single-pass");  // 17 tokens, head dim 16
  CAPTURE(streamed.out);
  CAPTURE(single.out);
  REQUIRE(streamed.code == 0);
  REQUIRE(single.code == 0);
  CHECK(streamed.out.find("streamed backward (--attention streamed)") != std::string::npos);
  CHECK(single.out.find("single-pass backward (--attention single-pass)") != std::string::npos);
  check_same_losses(losses(streamed.out), losses(single.out));  // the same sums in other orders
  const Run too_long = shell(kSmall + " --img 96 --attention single-pass");  // 145 tokens
  CAPTURE(too_long.out);
  CHECK(too_long.code == 2);
  CHECK(too_long.out.find("--attention single-pass takes at most 96 tokens") != std::string::npos);
}

TEST_CASE("gpu: --attention resident trains like streamed, is the engine's choice at 197 tokens and head dim 80, "
          "and is refused where it does not apply; auto says what it timed") {
  SKIP_WITHOUT_GPU();
  const std::string shape = kSmall + " --img 112 --dim 160 --heads 2";  // 197 tokens, head dim 80 (ViT-H's)
  const Run streamed = shell(shape + " --attention streamed");
  // The heuristic's GEMM algorithms where the two runs are compared bit for bit.
  const Run resident = shell(shape + " --attention resident --no-gemm-autotune");
  const Run engine = shell(shape + " --attention engine --no-gemm-autotune");
  const Run automatic = shell(shape + " --attention auto --no-gemm-autotune");
  CAPTURE(streamed.out);
  CAPTURE(resident.out);
  REQUIRE(streamed.code == 0);
  REQUIRE(resident.code == 0);
  REQUIRE(engine.code == 0);
  REQUIRE(automatic.code == 0);
  CHECK(streamed.out.find("streamed forward, streamed backward (--attention streamed)") != std::string::npos);
  CHECK(resident.out.find("resident forward, resident backward (--attention resident)") != std::string::npos);
  CHECK(engine.out.find("resident forward, resident backward (--attention engine)") != std::string::npos);
  check_same_losses(losses(streamed.out), losses(resident.out));  // the same sums in other orders
  CHECK(losses(engine.out) == losses(resident.out));             // deterministic: the same kernel, bit for bit
  // auto: timed against cuDNN where it loads (either may win at this small shape), each choice
  // by the 5% rule (away from its edge: the times print rounded); else the engine's, saying why.
  CAPTURE(automatic.out);
  const std::regex timed(R"(forward (\w+) ([0-9.]+), cuDNN ([0-9.]+): (\w+);\s+backward (\w+) ([0-9.]+), )"
                         R"(cuDNN ([0-9.]+): (\w+))");
  std::smatch m;
  if (std::regex_search(automatic.out, m, timed)) {
    const auto check_choice = [](double engine, double cudnn, const std::string& chose) {
      if (std::abs(cudnn / engine - 0.95) > 0.01) CHECK((chose == "cuDNN") == (cudnn < 0.95 * engine));
    };
    CHECK(m[1] == "resident");
    CHECK(m[5] == "resident");
    check_choice(std::stod(m[2]), std::stod(m[3]), m[4]);
    check_choice(std::stod(m[6]), std::stod(m[7]), m[8]);
    if (m[4] == "resident" && m[8] == "resident") CHECK(losses(automatic.out) == losses(resident.out));
  } else {
    CHECK(automatic.out.find("resident forward, resident backward (--attention auto)\n"
                             "              cuDNN not considered: ") != std::string::npos);
    CHECK(losses(automatic.out) == losses(resident.out));
  }
  const Run small_head = shell(kSmall + " --attention resident");  // head dim 16
  CAPTURE(small_head.out);
  CHECK(small_head.code == 2);
  CHECK(small_head.out.find("--attention resident takes at most 1024 tokens and head dim 64, 80 or 128") != std::string::npos);
}

TEST_CASE("gpu: the data-parallel machinery on one rank trains exactly like the plain path; a failure stops it") {
  SKIP_WITHOUT_GPU();
  for (const char* precision : {"bf16", "fp8"}) {
    CAPTURE(precision);
    // The heuristic's GEMM algorithms (the autotuner's pick by timing could differ between runs).
    const std::string args = " --precision " + std::string(precision) + " --batch 32 --no-gemm-autotune";
    const Run plain = shell(kSmall + args);
    const Run dp = shell("VIT_TRAIN_DATA_PARALLEL=1 " + kSmall + args);
    CAPTURE(plain.out);
    CAPTURE(dp.out);
    REQUIRE(plain.code == 0);
    REQUIRE(dp.code == 0);
    CHECK(dp.out.find("1 GPUs of one process") != std::string::npos);
    CHECK(losses(plain.out) == losses(dp.out));  // an average over one rank changes nothing
    REQUIRE(!weights_checksum(plain.out).empty());
    CHECK(weights_checksum(plain.out) == weights_checksum(dp.out));
  }
  const Run failed = shell("VIT_TRAIN_DATA_PARALLEL=1 VIT_TRAIN_TEST_FAIL=0:3 " + kSmall);
  CAPTURE(failed.out);
  CHECK(failed.code == 1);
  CHECK(failed.out.find("rank 0: failure injected by VIT_TRAIN_TEST_FAIL at step 3") != std::string::npos);
}

TEST_CASE("gpu: --accum-steps 2 x batch 16 trains like batch 32, in bf16 and fp8, also through the data-parallel machinery") {
  SKIP_WITHOUT_GPU();
  for (const char* precision : {"bf16", "fp8"}) {
    CAPTURE(precision);
    const std::string args = " --precision " + std::string(precision) + " --no-gemm-autotune";
    const Run whole = shell(kSmall + args + " --batch 32");
    const Run accumulated = shell(kSmall + args + " --batch 16 --accum-steps 2");
    // The exchange once a step, beside the last micro-batch's backward (one rank: the machinery alone).
    const Run dp = shell("VIT_TRAIN_DATA_PARALLEL=1 " + kSmall + args + " --batch 16 --accum-steps 2");
    CAPTURE(whole.out);
    CAPTURE(accumulated.out);
    CAPTURE(dp.out);
    REQUIRE(whole.code == 0);
    REQUIRE(accumulated.code == 0);
    REQUIRE(dp.code == 0);
    CHECK(accumulated.out.find("batch 16 x 2 micro-batches a step") != std::string::npos);
    check_same_losses(losses(whole.out), losses(accumulated.out));
    CHECK(losses(dp.out) == losses(accumulated.out));
    REQUIRE(!weights_checksum(dp.out).empty());
    CHECK(weights_checksum(dp.out) == weights_checksum(accumulated.out));
  }
}

TEST_CASE("gpu: 2 GPUs x batch B train like 1 GPU x batch 2B, in bf16 and fp8, with identical weights") {
  SKIP_WITHOUT_TWO_GPUS();
  for (const char* precision : {"bf16", "fp8"}) {
    CAPTURE(precision);
    // fp8: token rows (17 a 32x32 image at patch 8) must be a multiple of 16 on each rank.
    const Run one = shell(kSmall + " --precision " + precision + " --gpus 1 --batch 32");
    // The heuristic's GEMMs (no timing-based choice), so that runs compared bit for bit below
    // use the same algorithms.
    const Run two = shell(kSmall + " --precision " + precision + " --gpus 2 --batch 16 --no-gemm-autotune");
    CAPTURE(one.out);
    CAPTURE(two.out);
    REQUIRE(one.code == 0);
    REQUIRE(two.code == 0);
    check_same_losses(losses(one.out), losses(two.out));
    CHECK(two.out.find("identical on all 2 ranks") != std::string::npos);  // the trainer checks the checksums
    // The default there shards the optimizer; the replicated step must give the same bits.
    CHECK(two.out.find("optimizer   sharded (--shard-optimizer auto)") != std::string::npos);
    const Run replicated =
        shell(kSmall + " --precision " + precision + " --gpus 2 --batch 16 --no-gemm-autotune --shard-optimizer off");
    CAPTURE(replicated.out);
    REQUIRE(replicated.code == 0);
    CHECK(replicated.out.find("optimizer   sharded") == std::string::npos);
    CHECK(losses(replicated.out) == losses(two.out));
    REQUIRE(!weights_checksum(replicated.out).empty());
    CHECK(weights_checksum(replicated.out) == weights_checksum(two.out));
    // With clipping (the norm of the summed gradients scales the update) the same.
    const Run one_clip = shell(kSmall + " --precision " + precision + " --gpus 1 --batch 32 --clip-grad 0.05");
    const Run two_clip = shell(kSmall + " --precision " + precision + " --gpus 2 --batch 16 --clip-grad 0.05");
    CAPTURE(two_clip.out);
    REQUIRE(one_clip.code == 0);
    REQUIRE(two_clip.code == 0);
    check_same_losses(losses(one_clip.out), losses(two_clip.out));
    CHECK(two_clip.out.find("optimizer   sharded") == std::string::npos);  // the norm needs every gradient
    CHECK(losses(two_clip.out) != losses(two.out));  // the threshold bites
    const Run bf16_reduce = shell(kSmall + " --precision " + precision + " --gpus 2 --batch 16 --reduce-dtype bf16");
    CAPTURE(bf16_reduce.out);
    REQUIRE(bf16_reduce.code == 0);
    check_same_losses(losses(one.out), losses(bf16_reduce.out));
    // The all-reduce after the backward instead of during it: the same sums, the same weights.
    const Run after =
        shell(kSmall + " --precision " + precision + " --gpus 2 --batch 16 --no-gemm-autotune --comm-overlap off");
    CAPTURE(after.out);
    REQUIRE(after.code == 0);
    CHECK(losses(after.out) == losses(two.out));
    CHECK(after.out.find("after the backward") != std::string::npos);
    REQUIRE(!weights_checksum(after.out).empty());
    CHECK(weights_checksum(after.out) == weights_checksum(two.out));
    // The default on one machine is the copy-engine exchange; NCCL's all-reduce, in plain memory
    // and in its registered window, must give the same sums (two ranks: a + b either way).
    CHECK(two.out.find("through the copy engines") != std::string::npos);
    CHECK(two.out.find("in a registered NCCL window") == std::string::npos);
    for (const char* nccl : {"--allreduce nccl", "--nccl-window on"}) {
      CAPTURE(nccl);
      const Run other = shell(kSmall + " --precision " + precision + " --gpus 2 --batch 16 --no-gemm-autotune " + nccl);
      CAPTURE(other.out);
      REQUIRE(other.code == 0);
      CHECK(other.out.find("over NCCL") != std::string::npos);
      CHECK((other.out.find("in a registered NCCL window") != std::string::npos) == (std::string(nccl) == "--nccl-window on"));
      CHECK(losses(other.out) == losses(two.out));
      REQUIRE(!weights_checksum(other.out).empty());
      CHECK(weights_checksum(other.out) == weights_checksum(two.out));
    }
  }
}

TEST_CASE("gpu: 2 GPUs with a sharded optimizer: a run resumed from its checkpoint gives the uninterrupted run's losses") {
  SKIP_WITHOUT_TWO_GPUS();
  // Each rank updates only its shares; the checkpoint must hold every rank's (weights and momentum).
  for (const char* precision : {"bf16", "fp8"}) {
    CAPTURE(precision);
    const std::filesystem::path d = fresh_temp_dir(std::string("shard_resume_") + precision);
    const std::string args = kSmall + " --steps 20 --gpus 2 --batch 16 --no-gemm-autotune --precision " + precision;
    const InterruptedRun r = run_interrupted_and_resumed(args, d.string(), 10, "--save-every 10");
    REQUIRE_INTERRUPTED_AND_RESUMED(r);
    CHECK(r.whole.out.find("optimizer   sharded") != std::string::npos);
    CHECK(resumed_losses_mismatch(r, 20, 10) == "");
    REQUIRE(!weights_checksum(r.whole.out).empty());
    CHECK(weights_checksum(r.rest.out) == weights_checksum(r.whole.out));
    std::filesystem::remove_all(d);
  }
}

TEST_CASE("gpu: a sharded optimizer over many buckets, with evaluations between steps, gives the replicated weights") {
  SKIP_WITHOUT_TWO_GPUS();
  // Each rank's shares lie in every bucket: a model of 4 blocks in 1 MB buckets spreads the
  // weights over 4, and the evaluations between steps read the weights the peers updated.
  const std::filesystem::path d = fresh_temp_dir("shard_eval");
  std::filesystem::create_directories(d);
  auto write_set = [&](const std::string& stem, int n) {  // 28 x 28 pseudo-random pixels, labels 0-9 in turn
    std::vector<uint8_t> labels;
    for (int i = 0; i < n; ++i) labels.push_back(static_cast<uint8_t>(i % 10));
    uint32_t x = 12345;
    write_idx((d / (stem + "-images-idx3-ubyte")).string(), (d / (stem + "-labels-idx1-ubyte")).string(), n, 28, 28,
              labels, false, [&x](int) { return static_cast<uint8_t>((x = x * 1664525u + 1013904223u) >> 24); });
  };
  write_set("train", 320);
  write_set("t10k", 64);
  for (const char* precision : {"bf16", "fp8"}) {
    CAPTURE(precision);
    const std::string args = "./vit_train --data fashion-mnist:" + d.string() +
                             " --img 28 --patch 4 --channels 1 --classes 10 --dim 128 --depth 4 --heads 4 --lr 0.05"
                             " --steps 10 --warmup 2 --log-every 1 --eval-every 3 --bucket-mb 1 --comm-timeout 60"
                             " --gpus 2 --batch 16 --no-gemm-autotune --attention engine --precision " +
                             std::string(precision);
    const Run sharded = shell(args);
    const Run replicated = shell(args + " --shard-optimizer off");
    CAPTURE(sharded.out);
    CAPTURE(replicated.out);
    REQUIRE(sharded.code == 0);
    REQUIRE(replicated.code == 0);
    CHECK(sharded.out.find("optimizer   sharded") != std::string::npos);
    CHECK(replicated.out.find("optimizer   sharded") == std::string::npos);
    CHECK(sharded.out.find(" 4 buckets of 1 MB") != std::string::npos);
    auto evals = [](const std::string& out) {
      std::vector<std::string> v;
      std::istringstream in(out);
      for (std::string line; std::getline(in, line);)
        if (line.find("  eval after step") == 0) v.push_back(line);
      return v;
    };
    CHECK(evals(sharded.out).size() == 4);  // after steps 3, 6, 9 and the last
    CHECK(evals(sharded.out) == evals(replicated.out));
    CHECK(losses(sharded.out) == losses(replicated.out));
    REQUIRE(!weights_checksum(sharded.out).empty());
    CHECK(weights_checksum(sharded.out) == weights_checksum(replicated.out));
    CHECK(sharded.out.find("identical on all 2 ranks") != std::string::npos);
    // --timing on two ranks: each rank's phases, gathered.
    const Run timed = shell(args + " --timing");
    CAPTURE(timed.out);
    REQUIRE(timed.code == 0);
    CHECK(timed.out.find("per rank (ms/step)") != std::string::npos);
    CHECK(timed.out.find("  rank 0 ") != std::string::npos);
    CHECK(timed.out.find("  rank 1 ") != std::string::npos);
  }
  std::filesystem::remove_all(d);
}

TEST_CASE("gpu: two processes under a launcher's environment train like --gpus 2") {
  SKIP_WITHOUT_TWO_GPUS();
  const std::string port = std::to_string(free_port());
  const std::string envs = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port;
  const Run threads = shell(kSmall + " --gpus 2 --batch 16");
  const Run procs = shell("(RANK=1 LOCAL_RANK=1 " + envs + " " + kSmall + " --batch 16 > /tmp/vit_rank1.log 2>&1 &); " +
                          "RANK=0 LOCAL_RANK=0 " + envs + " " + kSmall + " --batch 16; s=$?; sleep 1; exit $s");
  CAPTURE(threads.out);
  CAPTURE(procs.out);
  REQUIRE(threads.code == 0);
  REQUIRE(procs.code == 0);
  check_same_losses(losses(threads.out), losses(procs.out));
  CHECK(procs.out.find("2 processes x 1 GPU(s)") != std::string::npos);
  CHECK(procs.out.find("identical on all 2 ranks") != std::string::npos);
}

TEST_CASE("gpu: a failing rank or a killed process stops the others with a message naming it, in bounded time") {
  SKIP_WITHOUT_TWO_GPUS();
  const std::string long_run = "./vit_train --img 32 --patch 8 --channels 3 --classes 10 --dim 64 --depth 2 --heads 4 "
                               "--batch 16 --steps 100000 --log-every 10";
  // A worker thread fails at step 5: the run stops with exit 1 and names rank 1, whichever way
  // the gradients travel (the copy-engine exchange's host waits give way to the abort).
  for (const char* allreduce : {"copy-engine", "nccl"}) {
    CAPTURE(allreduce);
    const Run injected = shell("VIT_TRAIN_TEST_FAIL=1:5 " + long_run + " --gpus 2 --allreduce " + allreduce);
    CAPTURE(injected.out);
    CHECK(injected.code == 1);
    CHECK(injected.out.find("rank 1: failure injected") != std::string::npos);
    CHECK(injected.seconds < 60);
  }

  // One process of two is killed: the other learns of it from the control channel and stops.
  const std::string port = std::to_string(free_port());
  const std::string envs = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port;
  const Run killed = shell("(RANK=1 LOCAL_RANK=1 " + envs + " " + long_run + " > /tmp/vit_rank1.log 2>&1 & echo $! > /tmp/vit_rank1.pid); " +
                           "(sleep 20; kill -9 $(cat /tmp/vit_rank1.pid)) & RANK=0 LOCAL_RANK=0 " + envs + " " + long_run);
  CAPTURE(killed.out);
  CHECK(killed.code == 1);
  CHECK(killed.out.find("process 1 was lost") != std::string::npos);
  CHECK(killed.seconds < 20 + 60);
}
