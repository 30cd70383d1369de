#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/random.h"
#include "kernels/random.cuh"

namespace {
constexpr int kThreads = 256;

__global__ void normal_kernel(float* __restrict__ out, size_t n, uint64_t key, float mean, float std, float lo,
                              float hi, size_t first) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float v = mean;
    for (uint64_t attempt = 0; attempt < 64; ++attempt) {  // redraws are vanishingly rare for +-2 at 0.02
      const uint64_t c = ((first + i) * 64 + attempt) * 2;
      const float u1 = uniform01(key, c), u2 = uniform01(key, c + 1);
      v = mean + std * sqrtf(-2.0f * __logf(u1)) * __cosf(6.283185307179586f * u2);
      if (v >= lo && v <= hi) break;
    }
    out[i] = fminf(fmaxf(v, lo), hi);
  }
}

__global__ void uniform_kernel(float* __restrict__ out, size_t n, uint64_t key, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = lo + (hi - lo) * uniform01(key, i);
}

__global__ void labels_kernel(int* labels, int n, int64_t first, int classes) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) labels[i] = static_cast<int>((first + i) % classes);
}
}  // namespace

void fill_normal(float* out, size_t n, uint64_t seed, uint64_t stream_id, float mean, float std, float lo,
                 float hi, cudaStream_t stream, size_t first_index) {
  ENSURE(lo < hi, "fill_normal: empty truncation interval");
  if (n == 0) return;
  normal_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(out, n, random_key(seed, stream_id), mean, std,
                                                                           lo, hi, first_index);
  LAUNCH_CHECK();
}

void fill_uniform(float* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi,
                  cudaStream_t stream) {
  if (n == 0) return;
  uniform_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(out, n, random_key(seed, stream_id), lo, hi);
  LAUNCH_CHECK();
}

void fill_labels(int* labels, int n, int64_t first_index, int classes, cudaStream_t stream) {
  ENSURE(classes > 0, "fill_labels: no classes");
  labels_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(labels, n, first_index, classes);
  LAUNCH_CHECK();
}
