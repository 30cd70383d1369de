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

// An empty directory of this test process's own under the system's temporary one.
inline std::filesystem::path fresh_temp_dir(const std::string& tag) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("vit_test_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p;
}
