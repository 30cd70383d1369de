#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/data.h"
#include "kernels/preload.h"

namespace {
constexpr int kThreads = 256;

__global__ void normalize_kernel(const uint8_t* __restrict__ in, float* __restrict__ out, size_t n, float mean,
                                 float inv_std) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = (in[i] * (1.0f / 255.0f) - mean) * inv_std;
}

// A warp per row: the label's rank = the classes ranked above it (a larger logit, or an equal
// one at a lower index: torch.argmax's tie rule); correct for each k of ks with rank < k.
__global__ void count_top_k_kernel(const float* __restrict__ logits, int ld, int C, const int* __restrict__ labels,
                                   int n_valid, int k0, int k1, int* correct) {
  const int row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n_valid) return;
  const float* z = logits + static_cast<size_t>(row) * ld;
  const int label = labels[row];
  const float zl = z[label];
  int above = 0;
  for (int c = lane; c < C; c += 32) above += z[c] > zl || (z[c] == zl && c < label);
  for (int o = 16; o > 0; o >>= 1) above += __shfl_xor_sync(0xffffffffu, above, o);
  if (lane == 0) {
    if (above < k0) atomicAdd(correct, 1);
    if (above < k1) atomicAdd(correct + 1, 1);
  }
}

__global__ void accumulate_kernel(const float* value, float* sum) { *sum += *value; }
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(normalize_kernel);
PRELOAD_AT_START_UP(count_top_k_kernel);
PRELOAD_AT_START_UP(accumulate_kernel);

void normalize_pixels(const uint8_t* in, float* out, size_t n, float mean, float std, cudaStream_t stream) {
  if (n == 0) return;
  normalize_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, n, mean, 1.0f / std);
  LAUNCH_CHECK();
}

void count_top_k(const float* logits, int ld, int C, const int* labels, int n_valid, int k0, int k1, int* correct,
                 cudaStream_t stream) {
  if (n_valid == 0) return;
  count_top_k_kernel<<<grid_for(n_valid, kThreads / 32), kThreads, 0, stream>>>(logits, ld, C, labels, n_valid, k0,
                                                                                k1, correct);
  LAUNCH_CHECK();
}

void accumulate(const float* value, float* sum, cudaStream_t stream) {
  accumulate_kernel<<<1, 1, 0, stream>>>(value, sum);
  LAUNCH_CHECK();
}
