// Files a user names (weights, checkpoints, datasets) read without trusting them: only regular
// files are opened (a FIFO or a device never blocks the run), and a file larger than its reader's
// limit is refused before any memory is taken for it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

// A regular file mapped read-only, unmapped by the destructor. Throws RuntimeError naming the
// path when it is missing, not a regular file, larger than max_bytes or cannot be mapped. An
// empty file maps to no memory: data() is then a valid pointer to zero bytes. (A file truncated
// by another process while mapped ends this one with SIGBUS when the lost pages are read: the
// engine's own files are replaced by rename, never truncated in place.)
class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(const std::string& path, size_t max_bytes);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return map_ ? static_cast<const uint8_t*>(map_) : &empty_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  uint8_t empty_ = 0;
};

// A small regular file (run.txt, classes.txt) read whole, refused above max_bytes.
std::string read_text_file(const std::string& path, size_t max_bytes);

// A regular file's descriptor, opened without blocking on a FIFO and checked to be a regular
// file no larger than max_bytes; its size in *bytes. The caller closes it. Throws as MappedFile.
int open_regular_file(const std::string& path, size_t max_bytes, size_t* bytes);

// Whether path names a regular file (symbolic links followed), without opening it.
bool is_regular_file(const std::string& path);
