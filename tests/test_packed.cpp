// The packed data path. CPU tier: tools/pack_images on a generated ImageFolder tree (PNG and
// JPEG of odd sizes, a corrupted file skipped and counted) read back through PackedSet; damaged
// packed directories named. GPU tier: the augmentation kernel against a CPU reference (random
// resized crop with bilinear sampling, flips, centre crops, normalisation), and the loader's
// batches against the packed bytes.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/check.h"
#include "engine/packed_loader.h"
#include "kernels/augment.h"
#include "tests/gpu_util.h"
#include "tests/harness.h"

namespace fs = std::filesystem;

namespace {
// A 17 x 11 baseline JPEG of one colour, RGB (200, 50, 100), made with libturbojpeg (quality 95).
const unsigned char kJpeg[] = {
    0xff,0xd8,0xff,0xe0,0x00,0x10,0x4a,0x46,0x49,0x46,0x00,0x01,0x01,0x00,0x00,0x01,
    0x00,0x01,0x00,0x00,0xff,0xdb,0x00,0x43,0x00,0x02,0x01,0x01,0x01,0x01,0x01,0x02,
    0x01,0x01,0x01,0x02,0x02,0x02,0x02,0x02,0x04,0x03,0x02,0x02,0x02,0x02,0x05,0x04,
    0x04,0x03,0x04,0x06,0x05,0x06,0x06,0x06,0x05,0x06,0x06,0x06,0x07,0x09,0x08,0x06,
    0x07,0x09,0x07,0x06,0x06,0x08,0x0b,0x08,0x09,0x0a,0x0a,0x0a,0x0a,0x0a,0x06,0x08,
    0x0b,0x0c,0x0b,0x0a,0x0c,0x09,0x0a,0x0a,0x0a,0xff,0xdb,0x00,0x43,0x01,0x02,0x02,
    0x02,0x02,0x02,0x02,0x05,0x03,0x03,0x05,0x0a,0x07,0x06,0x07,0x0a,0x0a,0x0a,0x0a,
    0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,
    0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,
    0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0x0a,0xff,0xc0,
    0x00,0x11,0x08,0x00,0x0b,0x00,0x11,0x03,0x01,0x11,0x00,0x02,0x11,0x01,0x03,0x11,
    0x01,0xff,0xc4,0x00,0x1f,0x00,0x00,0x01,0x05,0x01,0x01,0x01,0x01,0x01,0x01,0x00,
    0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x01,0x02,0x03,0x04,0x05,0x06,0x07,0x08,0x09,
    0x0a,0x0b,0xff,0xc4,0x00,0xb5,0x10,0x00,0x02,0x01,0x03,0x03,0x02,0x04,0x03,0x05,
    0x05,0x04,0x04,0x00,0x00,0x01,0x7d,0x01,0x02,0x03,0x00,0x04,0x11,0x05,0x12,0x21,
    0x31,0x41,0x06,0x13,0x51,0x61,0x07,0x22,0x71,0x14,0x32,0x81,0x91,0xa1,0x08,0x23,
    0x42,0xb1,0xc1,0x15,0x52,0xd1,0xf0,0x24,0x33,0x62,0x72,0x82,0x09,0x0a,0x16,0x17,
    0x18,0x19,0x1a,0x25,0x26,0x27,0x28,0x29,0x2a,0x34,0x35,0x36,0x37,0x38,0x39,0x3a,
    0x43,0x44,0x45,0x46,0x47,0x48,0x49,0x4a,0x53,0x54,0x55,0x56,0x57,0x58,0x59,0x5a,
    0x63,0x64,0x65,0x66,0x67,0x68,0x69,0x6a,0x73,0x74,0x75,0x76,0x77,0x78,0x79,0x7a,
    0x83,0x84,0x85,0x86,0x87,0x88,0x89,0x8a,0x92,0x93,0x94,0x95,0x96,0x97,0x98,0x99,
    0x9a,0xa2,0xa3,0xa4,0xa5,0xa6,0xa7,0xa8,0xa9,0xaa,0xb2,0xb3,0xb4,0xb5,0xb6,0xb7,
    0xb8,0xb9,0xba,0xc2,0xc3,0xc4,0xc5,0xc6,0xc7,0xc8,0xc9,0xca,0xd2,0xd3,0xd4,0xd5,
    0xd6,0xd7,0xd8,0xd9,0xda,0xe1,0xe2,0xe3,0xe4,0xe5,0xe6,0xe7,0xe8,0xe9,0xea,0xf1,
    0xf2,0xf3,0xf4,0xf5,0xf6,0xf7,0xf8,0xf9,0xfa,0xff,0xc4,0x00,0x1f,0x01,0x00,0x03,
    0x01,0x01,0x01,0x01,0x01,0x01,0x01,0x01,0x01,0x00,0x00,0x00,0x00,0x00,0x00,0x01,
    0x02,0x03,0x04,0x05,0x06,0x07,0x08,0x09,0x0a,0x0b,0xff,0xc4,0x00,0xb5,0x11,0x00,
    0x02,0x01,0x02,0x04,0x04,0x03,0x04,0x07,0x05,0x04,0x04,0x00,0x01,0x02,0x77,0x00,
    0x01,0x02,0x03,0x11,0x04,0x05,0x21,0x31,0x06,0x12,0x41,0x51,0x07,0x61,0x71,0x13,
    0x22,0x32,0x81,0x08,0x14,0x42,0x91,0xa1,0xb1,0xc1,0x09,0x23,0x33,0x52,0xf0,0x15,
    0x62,0x72,0xd1,0x0a,0x16,0x24,0x34,0xe1,0x25,0xf1,0x17,0x18,0x19,0x1a,0x26,0x27,
    0x28,0x29,0x2a,0x35,0x36,0x37,0x38,0x39,0x3a,0x43,0x44,0x45,0x46,0x47,0x48,0x49,
    0x4a,0x53,0x54,0x55,0x56,0x57,0x58,0x59,0x5a,0x63,0x64,0x65,0x66,0x67,0x68,0x69,
    0x6a,0x73,0x74,0x75,0x76,0x77,0x78,0x79,0x7a,0x82,0x83,0x84,0x85,0x86,0x87,0x88,
    0x89,0x8a,0x92,0x93,0x94,0x95,0x96,0x97,0x98,0x99,0x9a,0xa2,0xa3,0xa4,0xa5,0xa6,
    0xa7,0xa8,0xa9,0xaa,0xb2,0xb3,0xb4,0xb5,0xb6,0xb7,0xb8,0xb9,0xba,0xc2,0xc3,0xc4,
    0xc5,0xc6,0xc7,0xc8,0xc9,0xca,0xd2,0xd3,0xd4,0xd5,0xd6,0xd7,0xd8,0xd9,0xda,0xe2,
    0xe3,0xe4,0xe5,0xe6,0xe7,0xe8,0xe9,0xea,0xf2,0xf3,0xf4,0xf5,0xf6,0xf7,0xf8,0xf9,
    0xfa,0xff,0xda,0x00,0x0c,0x03,0x01,0x00,0x02,0x11,0x03,0x11,0x00,0x3f,0x00,0xf1,
    0x3a,0x0f,0xf4,0x70,0x28,0x00,0xa0,0x02,0x80,0x0a,0x00,0x28,0x03,0xff,0xd9
};

void put_u32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s += char((v >> (8 * i)) & 0xFF);
}
// An RGB PNG of w x h, written with zlib alone.
std::string png(int w, int h, const std::vector<uint8_t>& rgb) {
  auto chunk = [](const std::string& type, const std::string& body) {
    std::string c;
    put_u32(c, uint32_t(body.size()));
    const std::string tb = type + body;
    c += tb;
    put_u32(c, uint32_t(crc32(0, reinterpret_cast<const Bytef*>(tb.data()), uInt(tb.size()))));
    return c;
  };
  std::string ihdr;
  put_u32(ihdr, uint32_t(w));
  put_u32(ihdr, uint32_t(h));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8 bits, RGB
  std::string raw;
  for (int y = 0; y < h; ++y) {
    raw += '\0';
    raw.append(reinterpret_cast<const char*>(rgb.data()) + size_t(y) * w * 3, size_t(w) * 3);
  }
  uLongf n = compressBound(uLong(raw.size()));
  std::string z(n, '\0');
  compress(reinterpret_cast<Bytef*>(&z[0]), &n, reinterpret_cast<const Bytef*>(raw.data()), uLong(raw.size()));
  z.resize(n);
  return std::string("\x89PNG\r\n\x1a\n", 8) + chunk("IHDR", ihdr) + chunk("IDAT", z) + chunk("IEND", "");
}
void write(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}
fs::path temp_dir(const std::string& tag) {
  const fs::path p = fs::temp_directory_path() / ("vit_packed_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}
std::string run(const std::string& cmd, int* code) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  const int st = ::pclose(p);
  *code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}
std::string open_error(const fs::path& dir) {
  try {
    PackedSet s(dir.string());
  } catch (const RuntimeError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("pack_images: PNG and JPEG of odd sizes resized, cropped and read back; a corrupted file skipped") {
  REQUIRE_MESSAGE(access("./pack_images", X_OK) == 0, "build ./pack_images first (make pack_images)");
  const fs::path tree = temp_dir("tree"), out = temp_dir("out");
  // Class "a": a 16 x 8 image, black left half, white right half (at size 8: no resampling, the
  // centre 8 columns); a 5 x 9 solid grey. Class "b": the JPEG; and a file that is no image.
  std::vector<uint8_t> halves(16 * 8 * 3);
  for (int y = 0; y < 8; ++y)
    for (int x = 0; x < 16; ++x)
      for (int c = 0; c < 3; ++c) halves[(y * 16 + x) * 3 + c] = x < 8 ? 0 : 255;
  write(tree / "a" / "1.png", png(16, 8, halves));
  write(tree / "a" / "2.PNG", png(5, 9, std::vector<uint8_t>(5 * 9 * 3, 77)));
  write(tree / "b" / "3.jpg", std::string(reinterpret_cast<const char*>(kJpeg), sizeof kJpeg));
  write(tree / "b" / "4.jpeg", "this is not a JPEG");
  int code = 0;
  const std::string log = run("./pack_images " + tree.string() + " " + out.string() + " --size 8 --shard-images 2", &code);
  CAPTURE(log);
  REQUIRE(code == 0);
  CHECK(log.find("3 images in 2 shards, 1 skipped") != std::string::npos);
  CHECK(log.find("4.jpeg") != std::string::npos);
  const PackedSet set(out.string());
  REQUIRE(set.count() == 3);
  CHECK(set.size() == 8);
  CHECK(set.class_names() == std::vector<std::string>{"a", "b"});
  CHECK(set.label(0) == 0);
  CHECK(set.label(1) == 0);
  CHECK(set.label(2) == 1);
  const uint8_t* h = set.image(0);
  for (int y = 0; y < 8; ++y)
    for (int x = 0; x < 8; ++x) REQUIRE(h[(y * 8 + x) * 3] == (x < 4 ? 0 : 255));  // columns 4..11 of 16
  const uint8_t* g = set.image(1);
  for (int i = 0; i < 8 * 8 * 3; ++i) REQUIRE(g[i] == 77);  // upscaled 5 x 9: still one grey
  const uint8_t* j = set.image(2);
  for (int i = 0; i < 8 * 8; ++i) {
    REQUIRE(std::abs(j[3 * i] - 200) <= 6);  // JPEG's rounding of one colour
    REQUIRE(std::abs(j[3 * i + 1] - 50) <= 6);
    REQUIRE(std::abs(j[3 * i + 2] - 100) <= 6);
  }
  // Nothing is overwritten: packing into a non-empty directory is refused.
  run("./pack_images " + tree.string() + " " + out.string(), &code);
  CHECK(code == 2);
  fs::remove_all(tree);
  fs::remove_all(out);
}

TEST_CASE("packed data: missing, truncated and corrupted directories are named") {
  REQUIRE(access("./pack_images", X_OK) == 0);
  const fs::path tree = temp_dir("tree2"), out = temp_dir("out2");
  write(tree / "x" / "1.png", png(4, 4, std::vector<uint8_t>(48, 9)));
  int code = 0;
  run("./pack_images " + tree.string() + " " + out.string() + " --size 4", &code);
  REQUIRE(code == 0);
  CHECK(open_error(out / "none").find("is not a directory") != std::string::npos);
  const fs::path shard = out / "shard-00000.bin";
  std::string bytes;
  {
    std::ifstream in(shard, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  write(shard, bytes.substr(0, bytes.size() - 5));
  CHECK(open_error(out).find("truncated or corrupted") != std::string::npos);
  std::string bad = bytes;
  bad[0] = 'X';
  write(shard, bad);
  CHECK(open_error(out).find("not a version-1 packed shard") != std::string::npos);
  bad = bytes;
  bad[64] = 7;  // the first label, of 1 class
  write(shard, bad);
  CHECK(open_error(out).find("has label 7 of 1 classes") != std::string::npos);
  fs::remove(out / "classes.txt");
  CHECK(open_error(out).find("classes.txt is missing") != std::string::npos);
  fs::remove_all(tree);
  fs::remove_all(out);
}

// ---- GPU tier ----
namespace {
// The CPU reference of the augmentation: the same crop box, bilinear sampling, normalisation.
std::vector<double> augment_ref(const std::vector<uint8_t>& src, int B, int S, int H, int W, bool train, uint64_t seed,
                                uint64_t first_draw) {
  std::vector<double> out(size_t(B) * 3 * H * W);
  for (int b = 0; b < B; ++b) {
    const CropBox box = train ? random_resized_crop(S, seed, first_draw + b) : CropBox{(S - W) / 2, (S - H) / 2, W, H, false};
    for (int y = 0; y < H; ++y)
      for (int x = 0; x < W; ++x) {
        const int ox = box.flip ? W - 1 - x : x;
        const double sx = box.x0 + (ox + 0.5) * box.w / W - 0.5, sy = box.y0 + (y + 0.5) * box.h / H - 0.5;
        const double fx = std::floor(sx), fy = std::floor(sy), ax = sx - fx, ay = sy - fy;
        auto clampi = [&](double v) { return std::min(std::max(int(v), 0), S - 1); };
        const int x0 = clampi(fx), x1 = clampi(fx + 1), y0 = clampi(fy), y1 = clampi(fy + 1);
        for (int c = 0; c < 3; ++c) {
          auto at = [&](int yy, int xx) { return double(src[((size_t(b) * S + yy) * S + xx) * 3 + c]); };
          const double v = (1 - ay) * ((1 - ax) * at(y0, x0) + ax * at(y0, x1)) + ay * ((1 - ax) * at(y1, x0) + ax * at(y1, x1));
          out[((size_t(b) * 3 + c) * H + y) * W + x] = (v / 255.0 - kImageNetMean[c]) / kImageNetStd[c];
        }
      }
  }
  return out;
}
}  // namespace

TEST_CASE("gpu: augmentation (random resized crop, flip, centre crop, normalisation) against the CPU reference") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int B = 37, S = 20, H = 12, W = 12;
  std::vector<uint8_t> src(size_t(B) * S * S * 3);
  for (uint8_t& v : src) v = uint8_t(rng() % 256);
  DeviceBuffer<uint8_t> dsrc(src);
  DeviceBuffer<float> out(size_t(B) * 3 * H * W);
  const uint64_t seed = rng(), first = rng() % 100000;
  int flips = 0, full = 0;
  for (int b = 0; b < B; ++b) {
    const CropBox c = random_resized_crop(S, seed, first + b);
    REQUIRE(c.w >= 1);
    REQUIRE(c.x0 + c.w <= S);
    REQUIRE(c.y0 + c.h <= S);
    flips += c.flip;
    full += c.w == S && c.h == S;
  }
  CHECK(flips > 0);
  CHECK(flips < B);
  for (bool train : {true, false}) {
    CAPTURE(train);
    out.poison();
    augment_images(dsrc.get(), B, S, out.get(), H, W, train, seed, first, 0);
    CHECK(rel_error(to_f64(out.download()), augment_ref(src, B, S, H, W, train, seed, first)) < 1e-5);
  }
  (void)full;
}

TEST_CASE("gpu: the packed loader's batches are the packed images, in order for evaluation, sharded for training") {
  SKIP_WITHOUT_GPU();
  REQUIRE(access("./pack_images", X_OK) == 0);
  const fs::path tree = temp_dir("tree3"), out = temp_dir("out3");
  for (int i = 0; i < 10; ++i)  // image i: one grey level 20 i, class i % 3
    write(tree / ("c" + std::to_string(i % 3)) / (std::to_string(i) + ".png"), png(6, 6, std::vector<uint8_t>(108, uint8_t(20 * i))));
  int code = 0;
  run("./pack_images " + tree.string() + " " + out.string() + " --size 6 --shard-images 4", &code);
  REQUIRE(code == 0);
  const PackedSet set(out.string());
  REQUIRE(set.count() == 10);
  PackedLoader eval(set, 4, 4, false, 1);
  CHECK(eval.batches_per_epoch() == 3);
  DeviceBuffer<float> images(4 * 3 * 4 * 4);
  DeviceBuffer<int> labels(4);
  for (int b = 0; b < 3; ++b) {
    CAPTURE(b);
    const int real = eval.load(0, b, images.get(), labels.get(), 0);
    CHECK(real == (b < 2 ? 4 : 2));
    const auto im = images.download();
    const auto lab = labels.download();
    for (int k = 0; k < 4; ++k) {
      const int i = b * 4 + std::min(k, real - 1);
      const double grey = set.image(i)[0] / 255.0;
      CHECK(im[size_t(k) * 48] == doctest::Approx((grey - kImageNetMean[0]) / kImageNetStd[0]).epsilon(1e-5));
      CHECK(lab[k] == (k < real ? set.label(i) : 0));
    }
  }
  // Training on 2 ranks with batches of 2: an epoch is 2 global batches of 4, so the two ranks
  // together see 8 images of the 10 (labels checked below against the packed ones).
  std::vector<int> seen;
  for (int rank = 0; rank < 2; ++rank) {
    PackedLoader train(set, 2, 4, true, 7, rank, 2);
    CHECK(train.batches_per_epoch() == 2);
    for (int b = 0; b < 2; ++b) {
      train.load(3, b, images.get(), labels.get(), 0);
      const auto lab = labels.download();
      seen.insert(seen.end(), lab.begin(), lab.begin() + 2);  // the batch of 2
    }
  }
  CHECK(seen.size() == 8);
  fs::remove_all(tree);
  fs::remove_all(out);
}
