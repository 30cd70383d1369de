// Feeds the model's batch buffers from a dataset split in host memory: the batch's pixels are
// gathered into a pinned staging buffer, copied asynchronously, and normalised on the GPU.
// Staging buffers rotate, so the host fills one while earlier copies are still in flight.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "engine/dataset.h"

// What the trainer asks of a data source.
class BatchLoader {
 public:
  virtual ~BatchLoader() = default;
  virtual int batches_per_epoch() const = 0;
  // Batch `index` of `epoch` into images [B, C, H, W] fp32 and labels [B] on the device;
  // returns how many of the B rows are real images (evaluation pads its last batch).
  virtual int load(int epoch, int index, float* images, int* labels, cudaStream_t stream) = 0;
};

class DataLoader : public BatchLoader {
 public:
  // shuffle: a fresh permutation every epoch (training; the last partial global batch is
  // dropped); rank r of `world` takes slice r of each global batch of world x batch images, so
  // its batch index i is global batch i. Otherwise the split in order (evaluation; the last
  // batch is padded; the caller spreads the batch indices over the ranks).
  DataLoader(const ImageSet& set, int batch, float mean, float std, bool shuffle, uint64_t seed, int rank = 0,
             int world = 1);
  ~DataLoader() override;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  int batches_per_epoch() const override { return batches_; }
  // Batch `index` of `epoch` into images [B, 1, rows, cols] fp32 and labels [B] on the device;
  // returns how many of the B rows are real images (the rest repeat the last one, label 0).
  int load(int epoch, int index, float* images, int* labels, cudaStream_t stream) override;

 private:
  static constexpr int kSlots = 3;
  const ImageSet& set_;
  int batch_, batches_, pixels_, rank_, world_;
  float mean_, std_;
  bool shuffle_;
  uint64_t seed_;
  int order_epoch_ = -1;
  std::vector<int> order_;
  uint8_t* staged_pixels_[kSlots] = {};
  int* staged_labels_[kSlots] = {};
  cudaEvent_t copied_[kSlots] = {};
  int next_slot_ = 0;
  uint8_t* device_pixels_ = nullptr;
};
