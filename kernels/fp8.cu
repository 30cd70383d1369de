#include <cuda_fp8.h>

#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/fp8.h"

namespace {
// A block casts a 64 x 64 tile: each thread converts 8 consecutive elements of a row (one 16-byte
// load, one 8-byte store), and the transposed copy leaves through shared memory, 8 bytes of a
// column per thread, so both outputs are written in whole 8-byte words.
constexpr int kTile = 64, kThreads = 256, kVec = 8;

// Non-negative floats order like their bit patterns, so an integer atomicMax serves; NaN's bits
// sort above infinity's, so a NaN survives.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

template <__nv_fp8_interpretation_t kKind>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const bf16* __restrict__ in, int rows, int cols, const float* __restrict__ scale_ptr,
                uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* __restrict__ amax) {
  __shared__ uint8_t tile[kTile][kTile + 8];
  __shared__ float warp_max[kThreads / 32];
  const float scale = out ? *scale_ptr : 0.0f;
  const int r0 = blockIdx.y * kTile, c0 = blockIdx.x * kTile;
  float m = 0.0f;
  // 64 rows x 8 vectors = 512 vectors, two per thread.
  for (int v = threadIdx.x; v < kTile * kTile / kVec; v += kThreads) {
    const int tr = v / (kTile / kVec), tc = (v % (kTile / kVec)) * kVec;
    const int r = r0 + tr, c = c0 + tc;
    if (r >= rows || c >= cols) continue;  // cols % 8 == 0: a vector is all in or all out
    float x[8];
    reinterpret_cast<const Bf16x8*>(in + static_cast<size_t>(r) * cols + c)->to_float(x);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      m = max_nan(m, fabsf(x[j]));
      const uint32_t code = out ? __nv_cvt_float_to_fp8(x[j] * scale, __NV_SATFINITE, kKind) : 0u;
      (j < 4 ? lo : hi) |= code << (8 * (j % 4));
    }
    if (out) {
      *reinterpret_cast<uint2*>(out + static_cast<size_t>(r) * cols + c) = make_uint2(lo, hi);
      *reinterpret_cast<uint2*>(&tile[tr][tc]) = make_uint2(lo, hi);
    }
  }
  m = warp_max_nan(m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = warp_max[0];
    for (int i = 1; i < kThreads / 32; ++i) b = max_nan(b, warp_max[i]);
    atomic_max_nonneg(amax, b);
  }
  if (!out_t) return;
  // The transposed copy: 64 columns x 8 vectors of 8 rows, two per thread.
  for (int v = threadIdx.x; v < kTile * kTile / kVec; v += kThreads) {
    const int tc = v / (kTile / kVec), tr = (v % (kTile / kVec)) * kVec;
    const int c = c0 + tc, r = r0 + tr;
    if (c >= cols || r >= rows) continue;  // rows % 8 == 0 as well
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) (j < 4 ? lo : hi) |= uint32_t(tile[tr + j][tc]) << (8 * (j % 4));
    *reinterpret_cast<uint2*>(out_t + static_cast<size_t>(c) * rows + r) = make_uint2(lo, hi);
  }
}
}  // namespace

void cast_to_fp8(const bf16* in, int rows, int cols, const float* scale, Fp8Kind kind, uint8_t* out, uint8_t* out_t,
                 float* amax, cudaStream_t stream) {
  NvtxRange range("cast_to_fp8");
  ENSURE(rows > 0 && cols > 0 && rows % 8 == 0 && cols % 8 == 0 && (rows + kTile - 1) / kTile <= 65535 &&
             is_aligned16(in) && (!out || reinterpret_cast<uintptr_t>(out) % 8 == 0) &&
             (!out_t || reinterpret_cast<uintptr_t>(out_t) % 8 == 0),
         "cast_to_fp8: rows and cols must be multiples of 8, the tensors 16/8-byte aligned");
  const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile), block(kThreads);
  if (kind == Fp8Kind::E4M3)
    cast_kernel<__NV_E4M3><<<grid, block, 0, stream>>>(in, rows, cols, scale, out, out_t, amax);
  else
    cast_kernel<__NV_E5M2><<<grid, block, 0, stream>>>(in, rows, cols, scale, out, out_t, amax);
  LAUNCH_CHECK();
}
