// Running a command from a test (vit_train, pack_images): its exit code, its output (stdout and
// stderr together) and how long it took.
#pragma once
#include <sys/wait.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

struct CommandResult {
  int code = -1;  // the exit status, -1 if it did not exit (a signal)
  std::string out;
  double seconds = 0;
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, got);
  const int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// (step, loss) of each vit_train progress line ("  3/10      2.3012 ...").
inline std::vector<std::pair<int, double>> progress_losses(const std::string& out) {
  std::vector<std::pair<int, double>> v;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    int step = 0, steps = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), " %d/%d %lf", &step, &steps, &loss) == 3) v.emplace_back(step, loss);
  }
  return v;
}

// A run of vit_train `args` stopped by a failure injected at the start of step `stop` + 1, after
// its checkpoints (`save_flags`) into dir; the same run resumed from there; and the run whole.
struct InterruptedRun {
  CommandResult whole, first, rest;
};
inline InterruptedRun run_interrupted_and_resumed(const std::string& args, const std::string& dir, int stop,
                                                  const std::string& save_flags) {
  return {run_command(args),
          run_command("VIT_TRAIN_TEST_FAIL=0:" + std::to_string(stop) + " " + args + " --save " + dir + " " + save_flags),
          run_command(args + " --resume " + dir)};
}

// In a doctest test: the three runs' outputs shown with any failure; the whole and the resumed
// run exit 0, the interrupted one 1.
#define REQUIRE_INTERRUPTED_AND_RESUMED(r) \
  CAPTURE((r).whole.out);                  \
  CAPTURE((r).first.out);                  \
  CAPTURE((r).rest.out);                   \
  REQUIRE((r).whole.code == 0);            \
  REQUIRE((r).first.code == 1);            \
  REQUIRE((r).rest.code == 0)

// Where the resumed run's progress lines (step, loss) part from the whole run's after `stop`
// steps of `steps`, bit for bit; empty if nowhere.
inline std::string resumed_losses_mismatch(const InterruptedRun& r, int steps, int stop) {
  const auto a = progress_losses(r.whole.out), b = progress_losses(r.rest.out);
  if (a.size() != size_t(steps) || b.size() != size_t(steps - stop))
    return std::to_string(a.size()) + " progress lines whole and " + std::to_string(b.size()) + " resumed";
  for (size_t i = 0; i < b.size(); ++i)
    if (b[i] != a[stop + i]) return "step " + std::to_string(a[stop + i].first) + " differs";
  return "";
}

// A path of this test process's own under the system's temporary directory, removed if it
// existed (not created: pack_images and --save create theirs).
inline std::filesystem::path fresh_temp_dir(const std::string& tag) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("vit_test_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p;
}
