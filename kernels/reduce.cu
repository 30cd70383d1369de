#include <algorithm>

#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/reduce.h"
#include "kernels/preload.h"

namespace {
constexpr int kThreads = 256;
// Long chunks keep partial small: ViT-H's bias gradients (12608 rows) take 50 rows of partial
// sums, not 197.
constexpr int kRowsPerChunk = 256;
constexpr int kSumWarps = 8;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }

// Stage one: partial[chunk, col] = sum of kRowsPerChunk rows; consecutive threads read
// consecutive columns, so each row's read is coalesced.
template <class T>
__global__ void colsum_partial_kernel(const T* __restrict__ x, int M, int N, int ld, float* __restrict__ partial) {
  const int col = blockIdx.x * kThreads + threadIdx.x;
  if (col >= N) return;
  const int r0 = blockIdx.y * kRowsPerChunk, r1 = min(M, r0 + kRowsPerChunk);
  float s = 0;
  for (int r = r0; r < r1; ++r) s += to_f32(x[static_cast<size_t>(r) * ld + col]);
  partial[static_cast<size_t>(blockIdx.y) * N + col] = s;
}

// Stage two: a block owns 32 columns and its 8 warps split the R rows (a lane per column, so
// each row's read is one coalesced 128-byte access), then add their sums in a fixed order:
// a thread per column summing all R rows alone would be a chain of dependent loads.
__global__ void sum_rows_kernel(const float* __restrict__ partial, int R, int N, int ld,
                                float* __restrict__ out, bool accumulate) {
  __shared__ float sums[kSumWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, col = blockIdx.x * 32 + lane;
  float s = 0;
  if (col < N)
    for (int r = warp; r < R; r += kSumWarps) s += partial[static_cast<size_t>(r) * ld + col];
  sums[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && col < N) {
    float total = 0;
    for (int w = 0; w < kSumWarps; ++w) total += sums[w][lane];
    out[col] = accumulate ? out[col] + total : total;
  }
}

template <class T>
void colsum_impl(const T* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream, GradWrite write) {
  NvtxRange range("colsum");
  ENSURE(M > 0 && N > 0 && ld >= N, "colsum: bad shape");
  const int chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  ENSURE(chunks <= 65535, "colsum: too many rows");
  colsum_partial_kernel<<<dim3(grid_for(N, kThreads), chunks), kThreads, 0, stream>>>(x, M, N, ld, partial);
  LAUNCH_CHECK();
  sum_rows(partial, chunks, N, N, out, stream, write);
}
}  // namespace

size_t colsum_partial_floats(int M, int N) {
  return static_cast<size_t>((M + kRowsPerChunk - 1) / kRowsPerChunk) * N;
}

void colsum(const float* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream,
            GradWrite write) {
  colsum_impl(x, M, N, ld, out, partial, stream, write);
}

void colsum(const bf16* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream,
            GradWrite write) {
  colsum_impl(x, M, N, ld, out, partial, stream, write);
}

void sum_rows(const float* partial, int R, int N, int ld, float* out, cudaStream_t stream, GradWrite write) {
  sum_rows_kernel<<<grid_for(N, 32), kSumWarps * 32, 0, stream>>>(partial, R, N, ld, out,
                                                                  write == GradWrite::Accumulate);
  LAUNCH_CHECK();
}

namespace {
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__global__ void checksum_kernel(const float* __restrict__ x, size_t n, unsigned long long* out) {
  unsigned long long h = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    h += mix64(__float_as_uint(x[i]) ^ mix64(i));
  for (int o = 16; o > 0; o >>= 1) h += __shfl_xor_sync(0xffffffffu, h, o);
  if (threadIdx.x % 32 == 0) atomicAdd(out, h);
}
}  // namespace

void checksum(const float* x, size_t n, unsigned long long* out, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(unsigned long long), stream));
  if (n == 0) return;
  checksum_kernel<<<grid_stride_blocks(n, 256), 256, 0, stream>>>(x, n, out);
  LAUNCH_CHECK();
}

namespace {
constexpr int kNormBlocks = 1024, kNormThreads = 256;
// The sum of the block's s, valid in thread 0 (a fixed order: deterministic).
__device__ float block_sum(float s) {
  __shared__ float w[kNormThreads / 32];
  s = warp_sum(s);
  if (threadIdx.x % 32 == 0) w[threadIdx.x / 32] = s;
  __syncthreads();
  float t = 0;
  if (threadIdx.x == 0)
    for (int i = 0; i < kNormThreads / 32; ++i) t += w[i];
  return t;
}
__global__ void sum_squares_kernel(const float* __restrict__ x, size_t n, float* __restrict__ partial) {
  float s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    s = fmaf(x[i], x[i], s);
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void sqrt_sum_kernel(const float* __restrict__ partial, int n, float* __restrict__ out) {
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = sqrtf(s);
}
}  // namespace

size_t l2_norm_partial_floats() { return kNormBlocks; }

void l2_norm(const float* x, size_t n, float* partial, float* out, cudaStream_t stream) {
  sum_squares_kernel<<<kNormBlocks, kNormThreads, 0, stream>>>(x, n, partial);
  LAUNCH_CHECK();
  sqrt_sum_kernel<<<1, kNormThreads, 0, stream>>>(partial, kNormBlocks, out);
  LAUNCH_CHECK();
}

namespace {
__global__ void sum_into_kernel(float* __restrict__ dst, const float* __restrict__ src, size_t stride, int sources,
                                size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float acc = dst[i];
    for (int s = 0; s < sources; ++s) acc += src[s * stride + i];
    dst[i] = acc;
  }
}

__global__ void sum_into_vec_kernel(float4* __restrict__ dst, const float4* __restrict__ src, size_t stride4,
                                    int sources, size_t n4) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float4 acc = dst[i];
    for (int s = 0; s < sources; ++s) {
      const float4 v = src[s * stride4 + i];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    dst[i] = acc;
  }
}
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(checksum_kernel);
PRELOAD_AT_START_UP(sum_squares_kernel);
PRELOAD_AT_START_UP(sqrt_sum_kernel);
PRELOAD_AT_START_UP(sum_into_kernel);
PRELOAD_AT_START_UP(sum_into_vec_kernel);

void sum_into(float* dst, const float* src, size_t stride, int sources, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  NvtxRange range("sum_into");
  // A few blocks an SM at most: this runs beside the backward's kernels, which should keep the GPU.
  constexpr unsigned kMaxBlocks = 264;
  if (is_aligned16(dst) && is_aligned16(src) && stride % 4 == 0 && n % 4 == 0) {
    const unsigned blocks = std::min(grid_stride_blocks(n / 4, 256), kMaxBlocks);
    sum_into_vec_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<float4*>(dst),
                                                    reinterpret_cast<const float4*>(src), stride / 4, sources, n / 4);
  } else {
    sum_into_kernel<<<std::min(grid_stride_blocks(n, 256), kMaxBlocks), 256, 0, stream>>>(dst, src, stride, sources, n);
  }
  LAUNCH_CHECK();
}
