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

// Reads an IDX3 image file and its IDX1 label file; throws RuntimeError naming the file and the
// problem (missing, truncated, wrong magic number, counts that disagree, label >= classes).
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
