// `--data packed:DIR`: datasets in the packed format (engine/packed_format.h, written by
// tools/pack_images) read at full speed. DIR/train and DIR/val are packed directories (val is
// optional: without it there is no evaluation). Shards are memory-mapped; worker threads gather
// each batch's images into pinned buffers a few steps ahead; the copy to the GPU is
// asynchronous and the augmentation runs there (kernels/augment.h).
#pragma once
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/data_loader.h"
#include "engine/packed_format.h"
#include "engine/regular_file.h"

// One packed directory, mapped and checked: classes.txt, and every shard's header, size and
// labels (engine/packed_format.h); only regular files are opened.
class PackedSet {
 public:
  // Throws RuntimeError naming the file and the problem (missing, truncated, corrupted,
  // inconsistent with the other shards or with classes.txt).
  explicit PackedSet(const std::string& dir);
  PackedSet(const PackedSet&) = delete;
  PackedSet& operator=(const PackedSet&) = delete;

  int count() const { return count_; }
  int size() const { return size_; }
  int classes() const { return static_cast<int>(class_names_.size()); }
  const std::vector<std::string>& class_names() const { return class_names_; }
  const std::string& dir() const { return dir_; }
  const uint8_t* image(int i) const;
  int label(int i) const;

 private:
  struct Shard {
    MappedFile file;
    int first = 0, count = 0;
    const int32_t* labels = nullptr;
    const uint8_t* pixels = nullptr;
  };
  const Shard& shard_of(int i) const;
  std::string dir_;
  std::vector<std::string> class_names_;
  std::vector<Shard> shards_;
  int count_ = 0, size_ = 0;
};

class PackedLoader : public BatchLoader {
 public:
  // train: each epoch a fresh order from (seed, epoch), rank r's slice of every global batch,
  // random crops and flips; otherwise the set in order (the last batch padded), centre crops,
  // and rank r of `world` is expected to load batches r, r + world, ... (what it gathers ahead).
  // img: the model's image side.
  PackedLoader(const PackedSet& set, int batch, int img, bool train, uint64_t seed, int rank = 0, int world = 1,
               int threads = 4);
  ~PackedLoader() override;

  int batches_per_epoch() const override { return batches_; }
  int load(int epoch, int index, float* images, int* labels, cudaStream_t stream) override;

 private:
  static constexpr int kSlots = 4;  // batches gathered ahead
  struct Job {
    int epoch, index, slot;
    std::shared_ptr<const std::vector<int>> order;  // training: the epoch's permutation
  };
  void work();
  // Makes sure batch (epoch, index) is gathered or being gathered; returns its slot.
  int schedule(int epoch, int index);
  void gather(const Job& j);

  const PackedSet& set_;
  int batch_, img_, batches_, rank_, world_;
  bool train_;
  uint64_t seed_;
  size_t image_bytes_;
  std::shared_ptr<const std::vector<int>> order_;
  int order_epoch_ = -1;
  uint8_t* staged_[kSlots] = {};
  int* staged_labels_[kSlots] = {};
  int staged_real_[kSlots] = {};
  long slot_job_[kSlots];    // epoch * batches + index the slot holds or is gathering; -1 none
  int next_slot_ = 0;        // slots are taken round robin, in the order batches are needed
  bool slot_ready_[kSlots] = {};
  cudaEvent_t copied_[kSlots] = {};
  uint8_t* device_pixels_ = nullptr;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> jobs_;
  std::string error_;  // a worker's failure, rethrown by load
  bool stop_ = false;
  std::vector<std::thread> workers_;
};
