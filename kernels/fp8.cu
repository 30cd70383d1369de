#include <cuda_fp8.h>

#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/fp8.h"

namespace {
constexpr int kTile = 32, kRowsPerThread = 4;  // a 32 x 32 tile per block of 32 x 8 threads

// Non-negative floats order like their bit patterns, so an integer atomicMax serves; NaN's bits
// sort above infinity's, so a NaN survives.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

template <__nv_fp8_interpretation_t kKind>
__global__ void cast_kernel(const bf16* __restrict__ in, int rows, int cols, const float* __restrict__ scale_ptr,
                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ amax) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  __shared__ float warp_max[kTile * kTile / (32 * kRowsPerThread)];
  const float scale = out ? *scale_ptr : 0.0f;
  const int c = blockIdx.x * kTile + threadIdx.x;
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int tr = threadIdx.y + k * (kTile / kRowsPerThread), r = blockIdx.y * kTile + tr;
    if (r < rows && c < cols) {
      const float v = __bfloat162float(in[static_cast<size_t>(r) * cols + c]);
      m = max_nan(m, fabsf(v));
      if (out) {
        const uint8_t code = __nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, kKind);
        out[static_cast<size_t>(r) * cols + c] = code;
        tile[tr][threadIdx.x] = code;
      }
    }
  }
  m = warp_max_nan(m);
  if (threadIdx.x == 0) warp_max[threadIdx.y] = m;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    float b = warp_max[0];
    for (int i = 1; i < kTile / kRowsPerThread; ++i) b = max_nan(b, warp_max[i]);
    atomic_max_nonneg(amax, b);
  }
  if (out_t) {  // the tile's codes written column by column: coalesced along the original rows
    const int tr = blockIdx.y * kTile + threadIdx.x;
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int tc = threadIdx.y + k * (kTile / kRowsPerThread), cc = blockIdx.x * kTile + tc;
      if (tr < rows && cc < cols) out_t[static_cast<size_t>(cc) * rows + tr] = tile[threadIdx.x][tc];
    }
  }
}
}  // namespace

void cast_to_fp8(const bf16* in, int rows, int cols, const float* scale, Fp8Kind kind, uint8_t* out, uint8_t* out_t,
                 float* amax, cudaStream_t stream) {
  NvtxRange range("cast_to_fp8");
  ENSURE(rows > 0 && cols > 0 && (rows + kTile - 1) / kTile <= 65535, "cast_to_fp8: bad shape");
  const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile), block(kTile, kTile / kRowsPerThread);
  if (kind == Fp8Kind::E4M3)
    cast_kernel<__NV_E4M3><<<grid, block, 0, stream>>>(in, rows, cols, scale, out, out_t, amax);
  else
    cast_kernel<__NV_E5M2><<<grid, block, 0, stream>>>(in, rows, cols, scale, out, out_t, amax);
  LAUNCH_CHECK();
}
