// Shared device helpers: bf16 packing, 16-byte vectors of bf16, warp reductions; and the
// once-per-device kernel attributes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "kernels/check.h"

using bf16 = __nv_bfloat16;

// bf16x2 of (lo, hi), round to nearest: lo in the lower half (the lower index in memory and in
// fragments).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Eight bf16 values moved as one 16-byte access: held as a uint4, which the compiler copies with
// one vector load or store (as four __nv_bfloat162 members, every copy from global memory would
// be four 4-byte loads).
struct alignas(16) Bf16x8 {
  uint4 u;  // value 2i in u's word i's low half, value 2i + 1 in its high half
  __device__ void to_float(float* f) const {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);  // a bf16 is a float's upper half
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static Bf16x8 from_float(const float* f) {
    return Bf16x8{make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                             pack_bf16x2(f[6], f[7]))};
  }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Maxima that keep a NaN (fmaxf drops it): for amaxes, where a non-finite tensor must show.
__device__ __forceinline__ float max_nan(float a, float b) { return (a != a || b != b) ? NAN : fmaxf(a, b); }
__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

inline unsigned grid_for(size_t n, unsigned threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Blocks for a grid-stride loop over n elements: enough to fill any current GPU many times over,
// never more than the work needs.
inline unsigned grid_stride_blocks(size_t n, unsigned threads) {
  return static_cast<unsigned>(grid_for(n, threads) < 8192u ? grid_for(n, threads) : 8192u);
}

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

namespace {  // each including file instantiates its own kernels' copies
// Kernel attributes are per (kernel, device context): once per instantiation and device, allow
// the kernel's dynamic shared memory (past the default 48 KB) and set its preferred carveout:
// by default the largest shared memory, so that several blocks share an SM; a kernel that leans
// on L1 (LayerNorm's backward re-reads its weights there) passes cudaSharedmemCarveoutDefault.
template <auto Kernel>
void prepare_kernel(int dev, int smem_bytes, int carveout = cudaSharedmemCarveoutMaxShared) {
  static std::mutex mutex;
  static std::vector<bool> done;  // by device ordinal
  std::lock_guard<std::mutex> lock(mutex);
  if (dev < static_cast<int>(done.size()) && done[dev]) return;
  CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(Kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(Kernel),
                                  cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
  if (dev >= static_cast<int>(done.size())) done.resize(dev + 1, false);
  done[dev] = true;
}
}  // namespace
