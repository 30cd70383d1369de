#include "engine/data_loader.h"

#include <algorithm>
#include <cstring>

#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/data.h"

DataLoader::DataLoader(const ImageSet& set, int batch, float mean, float std, bool shuffle, uint64_t seed, int rank,
                       int world)
    : set_(set), batch_(batch), pixels_(set.rows * set.cols), rank_(rank), world_(world), mean_(mean), std_(std),
      shuffle_(shuffle), seed_(seed) {
  batches_ = shuffle ? set.count / (batch * world) : (set.count + batch - 1) / batch;
  for (int s = 0; s < kSlots; ++s) {
    CUDA_CHECK(cudaMallocHost(&staged_pixels_[s], static_cast<size_t>(batch) * pixels_));
    CUDA_CHECK(cudaMallocHost(&staged_labels_[s], static_cast<size_t>(batch) * sizeof(int)));
    CUDA_CHECK(cudaEventCreateWithFlags(&copied_[s], cudaEventDisableTiming));
  }
  CUDA_CHECK(cudaMalloc(&device_pixels_, static_cast<size_t>(batch) * pixels_));
}

DataLoader::~DataLoader() {
  for (int s = 0; s < kSlots; ++s) {
    if (copied_[s]) cudaEventSynchronize(copied_[s]);
    cudaFreeHost(staged_pixels_[s]);
    cudaFreeHost(staged_labels_[s]);
    if (copied_[s]) cudaEventDestroy(copied_[s]);
  }
  cudaFree(device_pixels_);
}

int DataLoader::load(int epoch, int index, float* images, int* labels, cudaStream_t stream) {
  NvtxRange range("dataset batch");
  ENSURE(index >= 0 && index < batches_, "DataLoader: batch index out of range");
  if (shuffle_ && order_epoch_ != epoch) {
    order_ = epoch_order(set_.count, seed_, epoch);
    order_epoch_ = epoch;
  }
  const int s = next_slot_;
  next_slot_ = (next_slot_ + 1) % kSlots;
  CUDA_CHECK(cudaEventSynchronize(copied_[s]));  // the copy that last read this slot (kSlots steps ago)
  const int first = (shuffle_ ? index * world_ + rank_ : index) * batch_, real = std::min(batch_, set_.count - first);
  for (int b = 0; b < batch_; ++b) {
    const int i = b < real ? (shuffle_ ? order_[first + b] : first + b) : (shuffle_ ? order_[first + real - 1] : first + real - 1);
    std::memcpy(staged_pixels_[s] + static_cast<size_t>(b) * pixels_, set_.pixels.data() + static_cast<size_t>(i) * pixels_,
                pixels_);
    staged_labels_[s][b] = b < real ? set_.labels[i] : 0;
  }
  CUDA_CHECK(cudaMemcpyAsync(device_pixels_, staged_pixels_[s], static_cast<size_t>(batch_) * pixels_,
                             cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(labels, staged_labels_[s], batch_ * sizeof(int), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaEventRecord(copied_[s], stream));
  normalize_pixels(device_pixels_, images, static_cast<size_t>(batch_) * pixels_, mean_, std_, stream);
  return real;
}
