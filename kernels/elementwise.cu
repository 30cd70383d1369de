#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/elementwise.h"
#include "kernels/reduce.h"

namespace {
constexpr int kThreads = 256;
constexpr int kBackwardRows = 32;      // rows of one thread in gelu_backward, and of one partial row
constexpr int kBackwardThreads = 128;  // 5 full blocks across ViT-H's 5120 columns (640 x 8)

__device__ __forceinline__ float normal_cdf(float x) { return 0.5f * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu(float x) { return x * normal_cdf(x); }
// gelu'(x) = cdf(x) + x pdf(x), given cdf(x): the backward shares one erf between the
// derivative and the recomputed output (the pass is bound by that arithmetic, not by memory).
__device__ __forceinline__ float gelu_grad(float x, float cdf) {
  return cdf + x * 0.39894228040143268f * __expf(-0.5f * x * x);
}

__global__ void gelu_forward_kernel(const Bf16x8* __restrict__ h, Bf16x8* __restrict__ a, size_t n8) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n8; i += size_t(gridDim.x) * blockDim.x) {
    float v[8];
    h[i].to_float(v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = gelu(v[j]);
    a[i] = Bf16x8::from_float(v);
  }
}

// A thread owns 8 consecutive columns over kBackwardRows rows (coalesced 16-byte accesses across
// the warp) and sums its dh there: the bias gradient comes out of the same pass, one partial
// row per row chunk. (cuBLASLt's BGRADB epilogue on fc1's weight gradient cost 60 us a block.)
__global__ void gelu_backward_kernel(const Bf16x8* da, const Bf16x8* __restrict__ h, Bf16x8* dh,
                                     Bf16x8* __restrict__ a, float* __restrict__ partial, int M, int N8) {
  const int c = blockIdx.x * kBackwardThreads + threadIdx.x;
  if (c >= N8) return;
  const int r0 = blockIdx.y * kBackwardRows, r1 = min(M, r0 + kBackwardRows);
  float sum[8] = {};
  // kInFlight rows' loads are issued before any store: dh may alias da, so the compiler could
  // not hoist them itself, and one row at a time left each thread waiting on memory.
  constexpr int kInFlight = 4;
  for (int r = r0; r < r1; r += kInFlight) {
    Bf16x8 dav[kInFlight], hv[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (r + k >= r1) break;
      const size_t i = static_cast<size_t>(r + k) * N8 + c;
      dav[k] = da[i];
      hv[k] = h[i];
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (r + k >= r1) break;
      const size_t i = static_cast<size_t>(r + k) * N8 + c;
      float d[8], x[8];
      dav[k].to_float(d);
      hv[k].to_float(x);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float cdf = normal_cdf(x[j]);
        d[j] *= gelu_grad(x[j], cdf);
        sum[j] += d[j];
        x[j] *= cdf;  // gelu(x)
      }
      dh[i] = Bf16x8::from_float(d);
      if (a) a[i] = Bf16x8::from_float(x);
    }
  }
  float4* out = reinterpret_cast<float4*>(partial + (static_cast<size_t>(blockIdx.y) * N8 + c) * 8);
  out[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
  out[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
}

__global__ void fill_kernel(float* __restrict__ out, size_t n, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = value;
}

__global__ void cast_to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

// Grid-stride launches: enough blocks to fill the GPU several times over, no more.
}  // namespace

void gelu_forward(const bf16* h, bf16* a, size_t n, cudaStream_t stream) {
  NvtxRange range("gelu_forward");
  ENSURE(n % 8 == 0 && is_aligned16(h) && is_aligned16(a), "gelu_forward: n % 8 and 16-byte alignment");
  gelu_forward_kernel<<<grid_stride_blocks(n / 8, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const Bf16x8*>(h), reinterpret_cast<Bf16x8*>(a), n / 8);
  LAUNCH_CHECK();
}

size_t gelu_backward_partial_floats(int M, int N) { return static_cast<size_t>(grid_for(M, kBackwardRows)) * N; }

void gelu_backward(const bf16* da, const bf16* h, bf16* dh, bf16* a, float* db, float* partial, int M, int N,
                   cudaStream_t stream) {
  NvtxRange range("gelu_backward");
  ENSURE(N % 8 == 0 && is_aligned16(da) && is_aligned16(h) && is_aligned16(dh) && is_aligned16(a) &&
             is_aligned16(partial),
         "gelu_backward: N % 8 and 16-byte alignment");
  const unsigned chunks = grid_for(M, kBackwardRows);
  ENSURE(chunks <= 65535, "gelu_backward: too many rows");
  gelu_backward_kernel<<<dim3(grid_for(N / 8, kBackwardThreads), chunks), kBackwardThreads, 0, stream>>>(
      reinterpret_cast<const Bf16x8*>(da), reinterpret_cast<const Bf16x8*>(h), reinterpret_cast<Bf16x8*>(dh),
      reinterpret_cast<Bf16x8*>(a), partial, M, N / 8);
  LAUNCH_CHECK();
  sum_rows(partial, chunks, N, N, db, stream);
}

void fill_constant(float* out, size_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(out, n, value);
  LAUNCH_CHECK();
}

void cast_to_bf16(const float* in, bf16* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  cast_to_bf16_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, n);
  LAUNCH_CHECK();
}
