// Running a command from a test (vit_train, pack_images): its exit code, its output (stdout and
// stderr together) and how long it took.
#pragma once
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

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
