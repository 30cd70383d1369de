#include "engine/check.h"
#include "kernels/common.cuh"
#include "kernels/data.h"

namespace {
constexpr int kThreads = 256;

__global__ void normalize_kernel(const uint8_t* __restrict__ in, float* __restrict__ out, size_t n, float mean,
                                 float inv_std) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = (in[i] * (1.0f / 255.0f) - mean) * inv_std;
}

// A warp per row: arg max with the lowest index on ties.
__global__ void count_correct_kernel(const float* __restrict__ logits, int ld, int C, const int* __restrict__ labels,
                                     int n_valid, int* correct) {
  const int row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n_valid) return;
  float best = -INFINITY;
  int arg = C;
  for (int c = lane; c < C; c += 32) {
    const float v = logits[static_cast<size_t>(row) * ld + c];
    if (v > best) { best = v; arg = c; }  // c rises within a lane: the first maximum stays
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
  }
  if (lane == 0 && arg == labels[row]) atomicAdd(correct, 1);
}

__global__ void accumulate_kernel(const float* value, float* sum) { *sum += *value; }
}  // namespace

void normalize_pixels(const uint8_t* in, float* out, size_t n, float mean, float std, cudaStream_t stream) {
  if (n == 0) return;
  normalize_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, n, mean, 1.0f / std);
  LAUNCH_CHECK();
}

void count_correct(const float* logits, int ld, int C, const int* labels, int n_valid, int* correct,
                   cudaStream_t stream) {
  if (n_valid == 0) return;
  count_correct_kernel<<<grid_for(n_valid, kThreads / 32), kThreads, 0, stream>>>(logits, ld, C, labels, n_valid,
                                                                                  correct);
  LAUNCH_CHECK();
}

void accumulate(const float* value, float* sum, cudaStream_t stream) {
  accumulate_kernel<<<1, 1, 0, stream>>>(value, sum);
  LAUNCH_CHECK();
}
