// pack_images: an ImageFolder tree (one folder per class, JPEG or PNG files) into the packed
// format of engine/packed_format.h: every image decoded, its shorter side resized to SIZE
// (antialiased: a triangle filter as wide as the downscale), centre-cropped to SIZE x SIZE, RGB.
// Unreadable images are skipped, counted and listed, never fatal. Shards are written whole or
// not at all (temporary file, fsync, rename); an existing packed directory is not overwritten.
//
// Usage: pack_images SRC_DIR OUT_DIR [--size 256] [--shard-images 1024] [--threads N]
#include <fcntl.h>
#include <png.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "engine/packed_format.h"

namespace fs = std::filesystem;

namespace {
struct Image {
  int w = 0, h = 0;
  std::vector<uint8_t> rgb;  // h x w x 3
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
bool is_image_file(const fs::path& p) {
  const std::string e = lower(p.extension().string());
  return e == ".jpg" || e == ".jpeg" || e == ".png";
}

std::vector<uint8_t> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open");
  const std::streamoff n = in.tellg();
  in.seekg(0);
  std::vector<uint8_t> b(static_cast<size_t>(n));
  if (n > 0 && !in.read(reinterpret_cast<char*>(b.data()), n)) throw std::runtime_error("cannot read");
  return b;
}

// JPEG (by its magic bytes) through libturbojpeg, anything else through libpng's simplified API.
Image decode(const std::vector<uint8_t>& b) {
  Image img;
  if (b.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) {
    tjhandle tj = tjInitDecompress();
    if (!tj) throw std::runtime_error("libturbojpeg cannot start");
    int w, h, sub, cs;
    if (tjDecompressHeader3(tj, b.data(), b.size(), &w, &h, &sub, &cs) != 0 || w <= 0 || h <= 0) {
      const std::string e = tjGetErrorStr2(tj);
      tjDestroy(tj);
      throw std::runtime_error("not a readable JPEG (" + e + ")");
    }
    img.w = w;
    img.h = h;
    img.rgb.resize(size_t(w) * h * 3);
    const bool cmyk = cs == TJCS_CMYK || cs == TJCS_YCCK;  // libturbojpeg decodes these to CMYK only
    std::vector<uint8_t> ink(cmyk ? size_t(w) * h * 4 : 0);
    const int r = cmyk ? tjDecompress2(tj, b.data(), b.size(), ink.data(), w, 0, h, TJPF_CMYK, TJFLAG_ACCURATEDCT)
                       : tjDecompress2(tj, b.data(), b.size(), img.rgb.data(), w, 0, h, TJPF_RGB, TJFLAG_ACCURATEDCT);
    const bool fatal = r != 0 && tjGetErrorCode(tj) == TJERR_FATAL;
    const std::string e = tjGetErrorStr2(tj);
    tjDestroy(tj);
    if (fatal) throw std::runtime_error("corrupted JPEG (" + e + ")");
    // CMYK JPEGs come from Adobe software, which stores the inks inverted (255: no ink); RGB as
    // PIL converts it: R = 255 - min(255, C + K) with C = 255 - stored c.
    for (size_t i = 0; cmyk && i < size_t(w) * h; ++i) {
      const int k = ink[4 * i + 3];
      for (int c = 0; c < 3; ++c) img.rgb[3 * i + c] = uint8_t(std::max(0, ink[4 * i + c] + k - 255));
    }
    return img;
  }
  png_image p;
  std::memset(&p, 0, sizeof p);
  p.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&p, b.data(), b.size()))
    throw std::runtime_error(std::string("neither JPEG nor a readable PNG (") + p.message + ")");
  p.format = PNG_FORMAT_RGB;
  img.w = static_cast<int>(p.width);
  img.h = static_cast<int>(p.height);
  img.rgb.resize(PNG_IMAGE_SIZE(p));
  if (!png_image_finish_read(&p, nullptr, img.rgb.data(), 0, nullptr)) {
    const std::string e = p.message;
    png_image_free(&p);
    throw std::runtime_error("corrupted PNG (" + e + ")");
  }
  return img;
}

// Weights of a 1-D resample of n source samples to `out` samples starting at output offset
// `off` of a full resize to `full` samples: a triangle filter as wide as the scale when
// shrinking (antialiasing, like PIL's bilinear), plain linear interpolation when growing.
struct Taps {
  std::vector<int> first;
  std::vector<std::vector<float>> w;
};
Taps taps(int n, int full, int off, int out) {
  Taps t;
  const double scale = double(n) / full, support = std::max(1.0, scale);
  for (int x = 0; x < out; ++x) {
    const double center = (x + off + 0.5) * scale;
    const int lo = std::max(0, int(std::floor(center - support))), hi = std::min(n - 1, int(std::ceil(center + support)));
    std::vector<float> w;
    double sum = 0;
    for (int i = lo; i <= hi; ++i) {
      const double v = std::max(0.0, 1.0 - std::abs((i + 0.5 - center) / support));
      w.push_back(float(v));
      sum += v;
    }
    if (sum <= 0) {  // a tap-less edge: the nearest sample
      w.assign(1, 1.0f);
      t.first.push_back(std::min(n - 1, std::max(0, int(center))));
    } else {
      for (float& v : w) v = float(v / sum);
      t.first.push_back(lo);
    }
    t.w.push_back(std::move(w));
  }
  return t;
}

// Shorter side to size, then the centred size x size square.
std::vector<uint8_t> resize_crop(const Image& img, int size) {
  const bool wide = img.w >= img.h;
  const int full_w = wide ? int(std::lround(double(img.w) * size / img.h)) : size;
  const int full_h = wide ? size : int(std::lround(double(img.h) * size / img.w));
  const Taps tx = taps(img.w, std::max(full_w, size), (std::max(full_w, size) - size) / 2, size);
  const Taps ty = taps(img.h, std::max(full_h, size), (std::max(full_h, size) - size) / 2, size);
  std::vector<float> rows(size_t(img.h) * size * 3);  // horizontal pass
  for (int y = 0; y < img.h; ++y)
    for (int x = 0; x < size; ++x)
      for (int c = 0; c < 3; ++c) {
        float s = 0;
        for (size_t k = 0; k < tx.w[x].size(); ++k) s += tx.w[x][k] * img.rgb[(size_t(y) * img.w + tx.first[x] + k) * 3 + c];
        rows[(size_t(y) * size + x) * 3 + c] = s;
      }
  std::vector<uint8_t> out(size_t(size) * size * 3);
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x)
      for (int c = 0; c < 3; ++c) {
        float s = 0;
        for (size_t k = 0; k < ty.w[y].size(); ++k) s += ty.w[y][k] * rows[((ty.first[y] + k) * size + x) * 3 + c];
        out[(size_t(y) * size + x) * 3 + c] = uint8_t(std::min(255.0f, std::max(0.0f, std::round(s))));
      }
  return out;
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
              "  --size N          the square images' side (default 256)\n"
              "  --shard-images N  images per shard file (default 1024)\n"
              "  --threads N       decoding threads (default: every core)\n",
              kUsage);
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
      if (a == "--size") size = int_arg(a, v, 2, 4096);
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
            pixels[i] = resize_crop(decode(read_file(p)), size);
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
