#include "engine/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "engine/check.h"

namespace {
[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw RuntimeError("cannot " + what + " " + path + ": " + std::strerror(errno));
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail("write", path);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Write, fsync, rename: either the old file or the complete new one exists, never half of one.
void write_atomically(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) io_fail("create", tmp);
  try {
    for (const auto& [data, bytes] : pieces) write_all(fd, data, bytes, tmp);
    if (::fsync(fd) != 0) io_fail("flush", tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) { ::unlink(tmp.c_str()); io_fail("close", tmp); }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) { ::unlink(tmp.c_str()); io_fail("rename into", path); }
}
}  // namespace

void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors) {
  std::string header = "{";
  size_t offset = 0;
  for (const StTensor& t : tensors) {
    if (header.size() > 1) header += ",";
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.bytes) + "]}";
    offset += t.bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  std::vector<std::pair<const void*, size_t>> pieces = {{len, 8}, {header.data(), header.size()}};
  for (const StTensor& t : tensors) pieces.emplace_back(t.data, t.bytes);
  write_atomically(path, pieces);
}

void write_text_file(const std::string& path, const std::string& text) {
  write_atomically(path, {{text.data(), text.size()}});
}
