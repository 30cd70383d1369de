#include "engine/dataset.h"

#include <zlib.h>

#include <algorithm>
#include <numeric>

#include "engine/regular_file.h"
#include "kernels/check.h"

namespace {
uint32_t be32(const uint8_t* b) { return uint32_t(b[0]) << 24 | uint32_t(b[1]) << 16 | uint32_t(b[2]) << 8 | b[3]; }

// The header's length and the array's element count, once the header's bytes are in hand.
struct IdxHeader {
  size_t bytes;
  std::vector<uint32_t> dims;
  uint64_t elements = 1;
};
IdxHeader check_header(const uint8_t* h, int rank, const std::string& name, uint64_t max_elements) {
  IdxHeader out{4 + 4 * size_t(rank), {}};
  if (be32(h) != (0x00000800u | uint32_t(rank)))
    throw RuntimeError(name + " is not an IDX file of " + std::to_string(rank) + "-dimensional uint8 data (magic 0x0000080" +
                       std::to_string(rank) + ")");
  for (int d = 0; d < rank; ++d) {
    const uint32_t n = be32(h + 4 + 4 * d);
    out.dims.push_back(n);
    if (n == 0 || n > max_elements / out.elements) {
      std::string dims;
      for (int k = 0; k < rank; ++k) dims += (k ? " x " : "") + std::to_string(be32(h + 4 + 4 * k));
      throw RuntimeError(name + ": implausible sizes " + dims + " (at most " + std::to_string(max_elements) +
                         " elements, none zero)");
    }
    out.elements *= n;
  }
  return out;
}

[[noreturn]] void wrong_length(const std::string& name, uint64_t have, const char* more, uint64_t expected) {
  throw RuntimeError(name + ": " + more + std::to_string(have) + " bytes, its header says " + std::to_string(expected) +
                     (have < expected ? " (truncated?)" : " (corrupted?)"));
}

// The gzip stream inflated into out, never past `limit` bytes (the header's length, and then the
// header and its array). Concatenated gzip members are one stream, as gzip reads them.
class Inflater {
 public:
  Inflater(const uint8_t* bytes, size_t size, const std::string& name) : name_(name) {
    if (inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK) throw RuntimeError("cannot start zlib to read " + name);
    z_.next_in = const_cast<uint8_t*>(bytes);
    z_.avail_in = 0;
    left_ = size;
  }
  ~Inflater() { inflateEnd(&z_); }
  // Appends up to limit - out.size() bytes; returns false once the stream has ended.
  bool fill(std::vector<uint8_t>& out, size_t limit) {
    uint8_t chunk[1 << 16];
    while (out.size() < limit && !ended_) {
      refill();
      z_.next_out = chunk;
      z_.avail_out = static_cast<uInt>(std::min<size_t>(sizeof chunk, limit - out.size()));
      const int r = inflate(&z_, Z_NO_FLUSH);
      out.insert(out.end(), chunk, z_.next_out);
      if (r == Z_STREAM_END) {
        refill();
        if (z_.avail_in >= 2 && z_.next_in[0] == 0x1f && z_.next_in[1] == 0x8b) {  // another member
          if (inflateReset(&z_) != Z_OK) throw RuntimeError("cannot restart zlib to read " + name_);
        } else {
          ended_ = true;
        }
      } else if (r == Z_BUF_ERROR && z_.avail_in == 0 && left_ == 0) {
        throw RuntimeError("cannot read " + name_ + ": the gzip stream ends early (truncated?)");
      } else if (r != Z_OK && r != Z_BUF_ERROR) {
        throw RuntimeError("cannot read " + name_ + ": " + (z_.msg ? z_.msg : "zlib error " + std::to_string(r)) +
                           " (corrupted?)");
      }
    }
    return !ended_;
  }
  // Whether anything of the stream or the file is left after what was read.
  bool more_output() {
    std::vector<uint8_t> one;
    fill(one, 1);
    return !one.empty();
  }
  bool trailing_input() const { return z_.avail_in > 0 || left_ > 0; }

 private:
  void refill() {
    if (z_.avail_in > 0 || left_ == 0) return;
    const size_t take = std::min<size_t>(left_, 1u << 30);
    z_.avail_in = static_cast<uInt>(take);
    left_ -= take;
  }
  z_stream z_{};
  size_t left_;
  bool ended_ = false;
  const std::string& name_;
};
}  // namespace

IdxArray decode_idx(const uint8_t* bytes, size_t size, int rank, const std::string& name, uint64_t max_elements) {
  IdxArray out;
  const size_t header_bytes = 4 + 4 * size_t(rank);
  const bool gzip = size >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
  if (!gzip) {
    if (size < header_bytes) throw RuntimeError(name + " is not an IDX file: shorter than its header");
    const IdxHeader h = check_header(bytes, rank, name, max_elements);
    if (size - header_bytes != h.elements) wrong_length(name, size, "", header_bytes + h.elements);
    out.dims = h.dims;
    out.data.assign(bytes + header_bytes, bytes + size);
    return out;
  }
  Inflater z(bytes, size, name);
  std::vector<uint8_t> head;
  z.fill(head, header_bytes);
  if (head.size() < header_bytes) throw RuntimeError(name + " is not an IDX file: shorter than its header");
  const IdxHeader h = check_header(head.data(), rank, name, max_elements);
  out.dims = h.dims;
  z.fill(out.data, h.elements);
  if (out.data.size() < h.elements) wrong_length(name, header_bytes + out.data.size(), "inflates to ", header_bytes + h.elements);
  if (z.more_output()) throw RuntimeError(name + ": inflates to more bytes than its header says (corrupted?)");
  if (z.trailing_input()) throw RuntimeError(name + ": bytes after the end of its gzip stream (corrupted?)");
  return out;
}

namespace {
// The most an IDX file may hold on disk (its largest array, uncompressed).
constexpr size_t kMaxIdxFileBytes = kMaxIdxElements + 64;

// name or name.gz in dir, whichever exists.
std::string find_file(const std::string& dir, const std::string& name) {
  for (const std::string& p : {dir + "/" + name, dir + "/" + name + ".gz"})
    if (is_regular_file(p)) return p;
  throw RuntimeError("Fashion-MNIST: no " + name + "[.gz] in " + dir +
                     " (on Debian: apt-get install dataset-fashion-mnist, or give --data fashion-mnist:DIR)");
}
}  // namespace

ImageSet decode_idx_pair(const uint8_t* images, size_t images_size, const std::string& images_name,
                         const uint8_t* labels, size_t labels_size, const std::string& labels_name, int classes) {
  IdxArray img = decode_idx(images, images_size, 3, images_name);
  IdxArray lab = decode_idx(labels, labels_size, 1, labels_name, img.dims[0]);  // no more labels than images
  const uint64_t count = img.dims[0], rows = img.dims[1], cols = img.dims[2];
  if (count > (1u << 30) || rows * cols > (1u << 24))
    throw RuntimeError(images_name + ": implausible sizes " + std::to_string(count) + " x " + std::to_string(rows) +
                       " x " + std::to_string(cols));
  if (lab.dims[0] != count)
    throw RuntimeError(labels_name + " holds " + std::to_string(lab.dims[0]) + " labels but " + images_name +
                       " holds " + std::to_string(count) + " images");
  ImageSet s;
  s.count = static_cast<int>(count);
  s.rows = static_cast<int>(rows);
  s.cols = static_cast<int>(cols);
  s.pixels = std::move(img.data);
  s.labels = std::move(lab.data);
  for (size_t i = 0; i < s.labels.size(); ++i)
    if (s.labels[i] >= classes)
      throw RuntimeError(labels_name + ": label " + std::to_string(s.labels[i]) + " of item " + std::to_string(i) +
                         " is not below the " + std::to_string(classes) + " classes");
  return s;
}

ImageSet read_idx(const std::string& images_path, const std::string& labels_path, int classes) {
  const MappedFile images(images_path, kMaxIdxFileBytes), labels(labels_path, kMaxIdxFileBytes);
  return decode_idx_pair(images.data(), images.size(), images_path, labels.data(), labels.size(), labels_path, classes);
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
