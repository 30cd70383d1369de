#include "engine/dataset.h"

#include <sys/stat.h>
#include <zlib.h>

#include <numeric>

#include "kernels/check.h"

namespace {
// Reads the whole file; gzread passes an uncompressed file through unchanged.
std::vector<uint8_t> read_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw RuntimeError("cannot open " + path);
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  int err = 0;
  const char* msg = gzerror(f, &err);
  const std::string why = (n < 0 || (err != Z_OK && err != Z_STREAM_END)) ? msg : "";
  gzclose(f);
  if (!why.empty()) throw RuntimeError("cannot read " + path + ": " + why + " (truncated or corrupt?)");
  return out;
}

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return uint32_t(b[at]) << 24 | uint32_t(b[at + 1]) << 16 | uint32_t(b[at + 2]) << 8 | b[at + 3];
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// name or name.gz in dir, whichever exists.
std::string find_file(const std::string& dir, const std::string& name) {
  for (const std::string& p : {dir + "/" + name, dir + "/" + name + ".gz"})
    if (exists(p)) return p;
  throw RuntimeError("Fashion-MNIST: no " + name + "[.gz] in " + dir +
                     " (on Debian: apt-get install dataset-fashion-mnist, or give --data fashion-mnist:DIR)");
}
}  // namespace

ImageSet read_idx(const std::string& images_path, const std::string& labels_path, int classes) {
  const std::vector<uint8_t> img = read_file(images_path), lab = read_file(labels_path);
  // IDX: a 4-byte magic (0, 0, type 0x08 = uint8, number of dimensions), big-endian sizes, data.
  if (img.size() < 16 || be32(img, 0) != 0x00000803)
    throw RuntimeError(images_path + " is not an IDX file of uint8 images (magic 0x00000803)");
  if (lab.size() < 8 || be32(lab, 0) != 0x00000801)
    throw RuntimeError(labels_path + " is not an IDX file of uint8 labels (magic 0x00000801)");
  ImageSet s;
  const uint64_t count = be32(img, 4), rows = be32(img, 8), cols = be32(img, 12);
  if (count == 0 || rows == 0 || cols == 0 || count > (1u << 30) || rows * cols > (1u << 24))
    throw RuntimeError(images_path + ": implausible sizes " + std::to_string(count) + " x " + std::to_string(rows) +
                       " x " + std::to_string(cols));
  if (img.size() != 16 + count * rows * cols)
    throw RuntimeError(images_path + ": " + std::to_string(img.size()) + " bytes, expected " +
                       std::to_string(16 + count * rows * cols) + " for " + std::to_string(count) + " images (truncated?)");
  if (be32(lab, 4) != count)
    throw RuntimeError(labels_path + " holds " + std::to_string(be32(lab, 4)) + " labels but " + images_path +
                       " holds " + std::to_string(count) + " images");
  if (lab.size() != 8 + count)
    throw RuntimeError(labels_path + ": " + std::to_string(lab.size()) + " bytes, expected " +
                       std::to_string(8 + count) + " (truncated?)");
  s.count = static_cast<int>(count);
  s.rows = static_cast<int>(rows);
  s.cols = static_cast<int>(cols);
  s.pixels.assign(img.begin() + 16, img.end());
  s.labels.assign(lab.begin() + 8, lab.end());
  for (size_t i = 0; i < s.labels.size(); ++i)
    if (s.labels[i] >= classes)
      throw RuntimeError(labels_path + ": label " + std::to_string(s.labels[i]) + " of item " + std::to_string(i) +
                         " is not below the " + std::to_string(classes) + " classes");
  return s;
}

FashionMnist::FashionMnist(const std::string& dir)
    : train(read_idx(find_file(dir, "train-images-idx3-ubyte"), find_file(dir, "train-labels-idx1-ubyte"), kClasses)),
      test(read_idx(find_file(dir, "t10k-images-idx3-ubyte"), find_file(dir, "t10k-labels-idx1-ubyte"), kClasses)) {
  for (const ImageSet* s : {&train, &test})
    if (s->rows != kSide || s->cols != kSide)
      throw RuntimeError("Fashion-MNIST in " + dir + " has " + std::to_string(s->rows) + "x" + std::to_string(s->cols) +
                         " images, not 28x28");
}

std::vector<int> epoch_order(int count, uint64_t seed, int epoch) {
  std::vector<int> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(epoch) + 1);
  for (int i = count - 1; i > 0; --i) {  // Fisher-Yates, spelled out: std::shuffle's order is library-defined
    const int j = static_cast<int>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}
