#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/drop_path.h"
#include "kernels/random.cuh"

namespace {
constexpr int kThreads = 256;

__global__ void draw_kernel(float* __restrict__ scales, int blocks, int batch, float rate, uint64_t key,
                            int64_t first_sample) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 2 * blocks * batch) return;
  const int branch = i / batch, b = i % batch;
  const float keep = drop_path_keep(rate, branch / 2, blocks);
  const uint64_t counter = static_cast<uint64_t>(first_sample + b) * (2 * blocks) + branch;
  scales[i] = uniform01(key, counter) < keep ? 1.0f / keep : 0.0f;
}

// A warp a row: only the dropped samples' rows move.
__global__ void restore_kernel(const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ scales,
                               int rows, int rows_per_sample, int D4) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= rows || scales[warp / rows_per_sample] != 0.0f) return;
  const float4* xr = reinterpret_cast<const float4*>(x) + static_cast<size_t>(warp) * D4;
  float4* yr = reinterpret_cast<float4*>(y) + static_cast<size_t>(warp) * D4;
  for (int i = lane; i < D4; i += 32) yr[i] = xr[i];
}

template <class T>
__global__ void scale_kernel(const T* __restrict__ in, float s, T* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<T>(static_cast<float>(in[i]) * s);
}
}  // namespace

void draw_drop_path(float* scales, int blocks, int batch, float rate, uint64_t seed, uint64_t stream_id,
                    int64_t first_sample, cudaStream_t stream) {
  ENSURE(blocks > 0 && batch > 0 && rate >= 0.0f && rate < 1.0f && first_sample >= 0,
         "draw_drop_path: blocks, batch, a rate in [0, 1)");
  draw_kernel<<<grid_for(2 * blocks * batch, kThreads), kThreads, 0, stream>>>(scales, blocks, batch, rate,
                                                                               random_key(seed, stream_id), first_sample);
  LAUNCH_CHECK();
}

void restore_dropped_rows(const float* x, float* y, const float* sample_scales, int rows, int rows_per_sample, int D,
                          cudaStream_t stream) {
  ENSURE(D % 4 == 0 && rows_per_sample > 0 && is_aligned16(x) && is_aligned16(y),
         "restore_dropped_rows: D % 4 and 16-byte aligned rows");
  restore_kernel<<<grid_for(size_t(rows) * 32, kThreads), kThreads, 0, stream>>>(x, y, sample_scales, rows,
                                                                                 rows_per_sample, D / 4);
  LAUNCH_CHECK();
}

void scale_vector(const float* in, float s, float* out, int n, cudaStream_t stream) {
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(in, s, out, n);
  LAUNCH_CHECK();
}

void scale_vector(const bf16* in, float s, bf16* out, int n, cudaStream_t stream) {
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(in, s, out, n);
  LAUNCH_CHECK();
}
