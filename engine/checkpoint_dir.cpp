#include "engine/checkpoint_dir.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "kernels/check.h"

namespace fs = std::filesystem;

bool is_checkpoint_dir(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::is_regular_file(p / "model.safetensors", ec) &&
         fs::is_regular_file(p / "state.safetensors", ec);
}

long long checkpoint_step(const std::string& path) {
  const std::string n = fs::path(path).filename().string();
  if (n.rfind(kCheckpointPrefix, 0) != 0 || n.size() == std::strlen(kCheckpointPrefix)) return -1;
  long long step = 0;
  for (size_t i = std::strlen(kCheckpointPrefix); i < n.size(); ++i) {
    if (n[i] < '0' || n[i] > '9') return -1;
    step = step * 10 + (n[i] - '0');
    if (step > kMaxCheckpointStep) return -1;  // no save of this engine: another program's name
  }
  return step;
}

std::vector<std::string> checkpoints_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (checkpoint_step(e.path().string()) >= 0 && is_checkpoint_dir(e.path().string())) out.push_back(e.path().string());
  std::sort(out.begin(), out.end(),
            [](const std::string& a, const std::string& b) { return checkpoint_step(a) < checkpoint_step(b); });
  return out;
}

std::string newest_checkpoint_in(const std::string& dir) {
  const std::vector<std::string> all = checkpoints_in(dir);
  return all.empty() ? "" : all.back();
}

std::string latest_checkpoint(const std::string& dir) {
  if (is_checkpoint_dir(dir)) return dir;
  if (!fs::is_directory(dir)) throw RuntimeError("--resume " + dir + ": no such directory");
  const std::string newest = newest_checkpoint_in(dir);
  if (newest.empty()) throw RuntimeError("--resume " + dir + ": no checkpoint (" + kCheckpointPrefix + "* with model.safetensors and state.safetensors) in it");
  return newest;
}

void check_writable_dir(const std::string& dir, const std::string& flag) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec)) throw RuntimeError(flag + " " + dir + ": not a directory");
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
      throw RuntimeError(flag + " " + dir + ": cannot write in it: " + std::strerror(errno));
    return;
  }
  // Not there yet: the first save creates it, under its nearest existing ancestor.
  fs::path ancestor = fs::absolute(dir, ec).parent_path();
  while (ancestor.has_parent_path() && ancestor != ancestor.root_path() && !fs::exists(ancestor, ec))
    ancestor = ancestor.parent_path();
  if (!fs::is_directory(ancestor, ec))
    throw RuntimeError(flag + " " + dir + ": cannot create checkpoint directory " + dir + ": " + ancestor.string() +
                       " is not a directory");
  if (::access(ancestor.c_str(), W_OK | X_OK) != 0)
    throw RuntimeError(flag + " " + dir + ": cannot create checkpoint directory " + dir + ": " + ancestor.string() +
                       ": " + std::strerror(errno));
}
