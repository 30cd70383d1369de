#include "engine/regular_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "kernels/check.h"

namespace {
std::string size_text(size_t bytes) {
  return bytes >= (size_t(1) << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes) + " bytes";
}
}  // namespace

int open_regular_file(const std::string& path, size_t max_bytes, size_t* bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw RuntimeError("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw RuntimeError("cannot read " + path + ": " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw RuntimeError("cannot read " + path + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    throw RuntimeError("cannot read " + path + ": " + size_text(size) + ", more than the " + size_text(max_bytes) +
                       " such a file may hold");
  }
  *bytes = size;
  return fd;
}

MappedFile::MappedFile(const std::string& path, size_t max_bytes) : path_(path) {
  const int fd = open_regular_file(path, max_bytes, &size_);
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      const int e = errno;
      map_ = nullptr;
      ::close(fd);
      throw RuntimeError("cannot map " + path + ": " + std::strerror(e));
    }
  }
  ::close(fd);
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(map_, size_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
}

std::string read_text_file(const std::string& path, size_t max_bytes) {
  size_t size = 0;
  const int fd = open_regular_file(path, max_bytes, &size);
  std::string text(size, '\0');
  size_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(fd, &text[got], size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : 0;
      ::close(fd);
      throw RuntimeError("cannot read " + path + ": " + (e ? std::strerror(e) : "it shrank while being read"));
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  return text;
}

bool is_regular_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
