#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/elementwise.h"

namespace {
constexpr int kThreads = 256;

__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_grad(float x) {
  const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
  const float pdf = 0.39894228040143268f * __expf(-0.5f * x * x);
  return cdf + x * pdf;
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

template <bool kRecompute>
__global__ void gelu_backward_kernel(const Bf16x8* da, const Bf16x8* __restrict__ h, Bf16x8* dh,
                                     Bf16x8* __restrict__ a, size_t n8) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n8; i += size_t(gridDim.x) * blockDim.x) {
    float d[8], x[8];
    da[i].to_float(d);
    h[i].to_float(x);
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] *= gelu_grad(x[j]);
    dh[i] = Bf16x8::from_float(d);
    if constexpr (kRecompute) {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = gelu(x[j]);
      a[i] = Bf16x8::from_float(x);
    }
  }
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

void gelu_backward(const bf16* da, const bf16* h, bf16* dh, bf16* a, size_t n, cudaStream_t stream) {
  NvtxRange range("gelu_backward");
  ENSURE(n % 8 == 0 && is_aligned16(da) && is_aligned16(h) && is_aligned16(dh) && is_aligned16(a),
         "gelu_backward: n % 8 and 16-byte alignment");
  const auto kernel = a ? gelu_backward_kernel<true> : gelu_backward_kernel<false>;
  kernel<<<grid_stride_blocks(n / 8, kThreads), kThreads, 0, stream>>>(reinterpret_cast<const Bf16x8*>(da),
                                                      reinterpret_cast<const Bf16x8*>(h), reinterpret_cast<Bf16x8*>(dh),
                                                      reinterpret_cast<Bf16x8*>(a), n / 8);
  LAUNCH_CHECK();
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
