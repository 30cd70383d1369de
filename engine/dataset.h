// IDX datasets (Fashion-MNIST's format), read whole into host memory: its IDX files
// (gzip-compressed or not), 60,000 training and 10,000 test images of 28x28 uint8 pixels, 10
// classes. (Any ImageFolder set goes through the packed format: engine/packed_loader.h.)
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

// One split of an IDX dataset, in host memory.
struct ImageSet {
  int count = 0, rows = 0, cols = 0;
  std::vector<uint8_t> pixels;  // [count, rows, cols]
  std::vector<uint8_t> labels;  // [count]
};

// One IDX array of uint8 elements: its dimensions (outermost first) and its elements.
struct IdxArray {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> data;
};
// The most elements an IDX file may claim (4 GiB of pixels).
constexpr uint64_t kMaxIdxElements = uint64_t(1) << 32;

// Decodes an IDX file's bytes, gzip-compressed (one gzip stream) or not, holding `rank`
// dimensions of uint8. The header is checked before anything else is taken: its magic number, no
// dimension zero, at most max_elements in all; a gzip stream is inflated no further than the
// header's sizes allow, and nothing may follow the array or the stream. Throws RuntimeError
// naming `name` and the problem (wrong magic number, truncated, longer than its header says,
// corrupted).
IdxArray decode_idx(const uint8_t* bytes, size_t size, int rank, const std::string& name,
                    uint64_t max_elements = kMaxIdxElements);

// An IDX3 image file's and its IDX1 label file's bytes decoded and checked against each other:
// as decode_idx, at most 2^30 images of at most 2^24 pixels, as many labels as images, every
// label below `classes`.
ImageSet decode_idx_pair(const uint8_t* images, size_t images_size, const std::string& images_name,
                         const uint8_t* labels, size_t labels_size, const std::string& labels_name, int classes);
// The same read from files (regular files only); throws RuntimeError naming the file and the
// problem (missing, not a regular file, as decode_idx_pair).
ImageSet read_idx(const std::string& images_path, const std::string& labels_path, int classes);

struct FashionMnist {
  static constexpr const char* kDefaultDir = "/usr/share/datasets/fashion-mnist";
  static constexpr int kClasses = 10, kSide = 28;
  static constexpr float kMean = 0.2860f, kStd = 0.3530f;  // of the training pixels, /255
  ImageSet train, test;
  // Looks for train-images-idx3-ubyte[.gz] and the three other files in dir.
  explicit FashionMnist(const std::string& dir);
};

// The order in which an epoch visits the training set: a permutation drawn from (seed, epoch),
// so every run with the same seed sees the same batches, and every epoch a fresh order.
std::vector<int> epoch_order(int count, uint64_t seed, int epoch);
