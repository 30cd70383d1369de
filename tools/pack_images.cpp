// pack_images: an ImageFolder tree (one folder per class, JPEG or PNG files) into the packed
// format of engine/packed_format.h: every image decoded, its shorter side resized to SIZE
// (antialiased: a triangle filter as wide as the downscale), centre-cropped to SIZE x SIZE, RGB.
// Unreadable images are skipped, counted and listed, never fatal; so are images above the
// decoder's limits (tools/image_decode.h), refused from their header before any pixel memory is
// taken, and the threads together hold at most kDecodeBudget bytes of decoded images. Shards are
// written whole or not at all (temporary file, fsync, rename); an existing packed directory is
// not overwritten.
//
// Usage: pack_images SRC_DIR OUT_DIR [--size 256] [--shard-images 1024] [--threads N]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine/packed_format.h"
#include "engine/regular_file.h"
#include "tools/image_decode.h"

namespace fs = std::filesystem;

namespace {
// An image file larger than this is not read (the largest image the limits allow, compressed,
// is far smaller).
constexpr size_t kMaxImageFileBytes = size_t(256) << 20;
// The decoded images (and their resize buffers) all threads hold at once; one image larger
// than this is decoded alone.
constexpr size_t kDecodeBudget = size_t(4) << 30;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
bool is_image_file(const fs::path& p) {
  const std::string e = lower(p.extension().string());
  return e == ".jpg" || e == ".jpeg" || e == ".png";
}

// Bytes in flight across the decoding threads: a thread waits until its image fits beside the
// others (or runs alone).
class MemoryBudget {
 public:
  explicit MemoryBudget(size_t bytes) : limit_(bytes) {}
  void acquire(size_t bytes) {
    std::unique_lock<std::mutex> lock(mutex_);
    freed_.wait(lock, [&] { return used_ == 0 || used_ + bytes <= limit_; });
    used_ += bytes;
  }
  void release(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      used_ -= bytes;
    }
    freed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable freed_;
  size_t limit_, used_ = 0;
};

// One image file decoded, resized and cropped, within the budget.
std::vector<uint8_t> pack_one(const fs::path& path, int size, MemoryBudget& budget) {
  const MappedFile file(path.string(), kMaxImageFileBytes);
  const ImageInfo info = probe_image(file.data(), file.size(), kImageLimits);
  const size_t bytes = decode_peak_bytes(info, size);
  budget.acquire(bytes);
  try {
    std::vector<uint8_t> out = resize_crop(decode_image(file.data(), file.size(), info), size);
    budget.release(bytes);
    return out;
  } catch (...) {
    budget.release(bytes);
    throw;
  }
}

void write_whole(const fs::path& path, const std::vector<std::pair<const void*, size_t>>& pieces) {
  const std::string tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + tmp + ": " + std::strerror(errno));
  for (const auto& [data, n] : pieces) {
    const char* p = static_cast<const char*>(data);
    size_t left = n;
    while (left > 0) {
      const ssize_t w = ::write(fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const std::string e = std::strerror(errno);
        ::close(fd);
        ::unlink(tmp.c_str());
        throw std::runtime_error("cannot write " + tmp + ": " + e);
      }
      p += w;
      left -= size_t(w);
    }
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot flush " + tmp + ": " + std::strerror(errno));
  }
  fs::rename(tmp, path);
}

constexpr const char* kUsage = "usage: pack_images SRC_DIR OUT_DIR [--size 256] [--shard-images 1024] [--threads N]\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "pack_images: %s\n%s", why.c_str(), kUsage);
  std::exit(2);
}

void print_help() {
  std::printf("%s"
              "Packs an ImageFolder tree (SRC_DIR/CLASS/IMAGE, JPEG or PNG) for vit_train --data packed:DIR:\n"
              "every image decoded, its shorter side resized to SIZE, centre-cropped to SIZE x SIZE, RGB,\n"
              "written to OUT_DIR (new or empty) as shards with a classes.txt. Unreadable images are\n"
              "skipped and listed. Pack DIR/train and DIR/val for training with evaluation.\n"
              "  --size N          the square images' side, 2 to %u (default 256)\n"
              "  --shard-images N  images per shard file (default 1024)\n"
              "  --threads N       decoding threads (default: every core)\n"
              "Images are untrusted input. A file above %zu MiB, or an image with a side above %d\n"
              "pixels or more than %llu pixels in all, is skipped (and listed) before its pixels\n"
              "are decoded; a truncated JPEG is skipped too. The threads hold at most %zu GiB of\n"
              "decoded images at once.\n",
              kUsage, kMaxPackedSide, kMaxImageFileBytes >> 20, kImageLimits.max_side,
              static_cast<unsigned long long>(kImageLimits.max_pixels), kDecodeBudget >> 30);
}
int int_arg(const std::string& flag, const char* v, int lo, int hi) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end || x < lo || x > hi) usage(flag + " must be an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
  return int(x);
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  int size = 256, shard_images = 1024, threads = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      print_help();
      return 0;
    }
    if (a == "--size" || a == "--shard-images" || a == "--threads") {
      if (i + 1 >= argc) usage(a + " needs a value");
      const char* v = argv[++i];
      if (a == "--size") size = int_arg(a, v, 2, int(kMaxPackedSide));
      else if (a == "--shard-images") shard_images = int_arg(a, v, 1, 1 << 20);
      else threads = int_arg(a, v, 1, 1024);
    } else if (a.rfind("--", 0) == 0) {
      usage("unknown option " + a);
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 2) usage("needs SRC_DIR and OUT_DIR");
  const fs::path src = pos[0], out = pos[1];
  try {
    if (!fs::is_directory(src)) usage(src.string() + " is not a directory");
    std::vector<std::string> classes;
    for (const auto& e : fs::directory_iterator(src))
      if (e.is_directory()) classes.push_back(e.path().filename().string());
    std::sort(classes.begin(), classes.end());
    if (classes.empty()) usage(src.string() + " has no class folders (ImageFolder: SRC/CLASS/IMAGE)");
    std::vector<std::pair<fs::path, int>> files;
    for (size_t c = 0; c < classes.size(); ++c) {
      std::vector<fs::path> f;
      for (const auto& e : fs::recursive_directory_iterator(src / classes[c]))
        if (e.is_regular_file() && is_image_file(e.path())) f.push_back(e.path());
      std::sort(f.begin(), f.end());
      for (const fs::path& p : f) files.emplace_back(p, int(c));
    }
    if (files.empty()) usage(src.string() + " has no .jpg, .jpeg or .png files");
    if (fs::exists(out) && !fs::is_empty(out))
      usage(out.string() + " exists and is not empty: choose a new directory (nothing is overwritten)");
    fs::create_directories(out);

    std::printf("pack_images: %zu files in %zu classes from %s -> %s, %dx%d RGB, %d a shard, %d threads\n", files.size(),
                classes.size(), src.c_str(), out.c_str(), size, size, shard_images, threads);
    std::vector<std::string> skipped;
    std::mutex skipped_mutex;
    MemoryBudget budget(kDecodeBudget);
    size_t written = 0;
    int shard = 0;
    for (size_t first = 0; first < files.size(); first += size_t(shard_images)) {
      const size_t n = std::min(files.size() - first, size_t(shard_images));
      std::vector<std::vector<uint8_t>> pixels(n);
      std::vector<char> ok(n, 0);  // not vector<bool>: threads set neighbouring entries
      std::atomic<size_t> next{0};
      auto work = [&] {
        for (size_t i; (i = next++) < n;) {
          const fs::path& p = files[first + i].first;
          try {
            pixels[i] = pack_one(p, size, budget);
            ok[i] = 1;
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(skipped_mutex);
            skipped.push_back(p.string() + ": " + e.what());
          }
        }
      };
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) pool.emplace_back(work);
      for (std::thread& t : pool) t.join();
      std::vector<int32_t> labels;
      std::vector<uint8_t> data;
      for (size_t i = 0; i < n; ++i)
        if (ok[i]) {
          labels.push_back(files[first + i].second);
          data.insert(data.end(), pixels[i].begin(), pixels[i].end());
        }
      if (labels.empty()) continue;
      PackedShardHeader h{};
      std::memcpy(h.magic, "VITPACK1", 8);
      h.version = kPackedVersion;
      h.count = uint32_t(labels.size());
      h.size = uint32_t(size);
      h.channels = 3;
      h.classes = uint32_t(classes.size());
      char name[32];
      std::snprintf(name, sizeof name, "shard-%05d.bin", shard++);
      write_whole(out / name, {{&h, sizeof h}, {labels.data(), labels.size() * 4}, {data.data(), data.size()}});
      written += labels.size();
      std::printf("  %s: %zu images; %zu of %zu done, %zu skipped\n", name, labels.size(), first + n, files.size(),
                  skipped.size());
      std::fflush(stdout);
    }
    if (written + skipped.size() != files.size())  // every file is either packed or reported
      throw std::runtime_error("internal error: " + std::to_string(written) + " packed + " +
                               std::to_string(skipped.size()) + " skipped != " + std::to_string(files.size()) + " files");
    std::string list;
    for (const std::string& c : classes) list += c + "\n";
    write_whole(out / "classes.txt", {{list.data(), list.size()}});
    std::printf("pack_images: %zu images in %d shards, %zu skipped\n", written, shard, skipped.size());
    for (size_t i = 0; i < skipped.size() && i < 20; ++i) std::printf("  skipped %s\n", skipped[i].c_str());
    if (skipped.size() > 20) std::printf("  ... and %zu more\n", skipped.size() - 20);
    return written > 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pack_images: error: %s\n", e.what());
    return 1;
  }
}
