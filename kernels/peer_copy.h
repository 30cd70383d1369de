// Device-to-device copies for the sharded optimizer's exchange (comm/grad_sync.h).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

// After a sharded step: the fp32 master weights the kernels read directly (biases, LayerNorm
// weights, embeddings) copied from this rank's shares to the same place in every peer's buffer
// (NVLink stores): src[r.begin, r.begin + r.count) for each range r (device memory).
struct FloatRange {
  size_t begin, count;
};
constexpr int kMaxPeerCopies = 8;
struct Fp32Copies {
  float* at[kMaxPeerCopies];
  int count;
};
void copy_ranges(const float* src, const FloatRange* ranges, int n_ranges, const Fp32Copies& dsts, cudaStream_t stream);
