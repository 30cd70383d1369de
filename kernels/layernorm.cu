#include <algorithm>

#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/layernorm.h"
#include "kernels/reduce.h"

namespace {
constexpr int kWarps = 8;
constexpr int kRowsPerBlock = 32;  // backward: rows sharing one block's weight-gradient partials
constexpr int kMaxChunks = 12;     // a lane holds up to 12 float4 of a row: D <= 1536 (more spills)

// A warp owns a row; lane l holds its float4 columns l, l + 32, ... in registers (CHUNKS of
// them, compile-time so they stay in registers), so the row is read from memory once.
template <int CHUNKS>
__device__ __forceinline__ void load_row(const float* row, int D4, float4 (&v)[CHUNKS]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int i = lane + 32 * j;
    v[j] = i < D4 ? reinterpret_cast<const float4*>(row)[i] : make_float4(0, 0, 0, 0);
  }
}

template <int CHUNKS>
__global__ void __launch_bounds__(kWarps * 32)
    layernorm_forward_kernel(const float* __restrict__ x, int x_row_stride, const float* __restrict__ w,
                             const float* __restrict__ b, bf16* __restrict__ y, float* __restrict__ mean_out,
                             float* __restrict__ rstd_out, int M, int D, float eps) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32, D4 = D / 4;
  if (row >= M) return;
  float4 v[CHUNKS];
  load_row(x + static_cast<size_t>(row) * x_row_stride, D4, v);
  float s = 0;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) s += v[j].x + v[j].y + v[j].z + v[j].w;
  const float mean = warp_sum(s) / D;
  float ss = 0;  // centred second pass over registers: an exact variance
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    if (lane + 32 * j >= D4) continue;
    const float a = v[j].x - mean, c = v[j].y - mean, d = v[j].z - mean, e = v[j].w - mean;
    ss += a * a + c * c + d * d + e * e;
  }
  const float rstd = rsqrtf(warp_sum(ss) / D + eps);
  uint2* yr = reinterpret_cast<uint2*>(y + static_cast<size_t>(row) * D);
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int i = lane + 32 * j;
    if (i >= D4) continue;
    const float4 g = reinterpret_cast<const float4*>(w)[i], bb = reinterpret_cast<const float4*>(b)[i];
    __nv_bfloat162 lo = __floats2bfloat162_rn((v[j].x - mean) * rstd * g.x + bb.x, (v[j].y - mean) * rstd * g.y + bb.y);
    __nv_bfloat162 hi = __floats2bfloat162_rn((v[j].z - mean) * rstd * g.z + bb.z, (v[j].w - mean) * rstd * g.w + bb.w);
    yr[i] = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

__device__ __forceinline__ float4 load_bf16x4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, c.x, c.y);
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w; g += dx.
// A warp per row in two sweeps: the first sums, the second (re-reading the row from L1) writes
// g and accumulates dw, db in registers across the warp's rows. Keeping the row in registers
// instead would cost 226 registers and half the occupancy. The block's partials are reduced in
// shared memory and written as one partial row per block, summed deterministically after.
template <int CHUNKS>
__global__ void __launch_bounds__(kWarps * 32)
    layernorm_backward_kernel(const bf16* __restrict__ dy, const float* __restrict__ x, int row_stride,
                              const float* __restrict__ w, const float* __restrict__ mean,
                              const float* __restrict__ rstd, float* __restrict__ g, bf16* __restrict__ g_bf16,
                              float* __restrict__ partial, int M, int D) {
  extern __shared__ float acc[];  // [2 * D]: dw then db
  for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) acc[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32, D4 = D / 4;
  float4 dw[CHUNKS], db[CHUNKS];
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) dw[j] = db[j] = make_float4(0, 0, 0, 0);
  for (int r = threadIdx.x / 32; r < kRowsPerBlock; r += kWarps) {
    const int row = blockIdx.x * kRowsPerBlock + r;
    if (row >= M) break;
    const float mu = mean[row], rs = rstd[row];
    const float4* xr = reinterpret_cast<const float4*>(x + static_cast<size_t>(row) * row_stride);
    const bf16* dyr = dy + static_cast<size_t>(row) * D;
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float s1 = 0, s2 = 0;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int i = lane + 32 * j;
      if (i >= D4) continue;
      const float4 xv = xr[i], d = load_bf16x4(dyr + 4 * i), wv = w4[i];
      const float a = d.x * wv.x, b = d.y * wv.y, c = d.z * wv.z, e = d.w * wv.w;
      s1 += a + b + c + e;
      s2 += a * (xv.x - mu) + b * (xv.y - mu) + c * (xv.z - mu) + e * (xv.w - mu);
    }
    const float m1 = warp_sum(s1) / D, m2 = warp_sum(s2) * rs / D;
    float4* gr = reinterpret_cast<float4*>(g + static_cast<size_t>(row) * row_stride);
    uint2* gbr = reinterpret_cast<uint2*>(g_bf16 + static_cast<size_t>(row) * row_stride);
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int i = lane + 32 * j;
      if (i >= D4) continue;
      const float4 xv = xr[i], d = load_bf16x4(dyr + 4 * i), wv = w4[i];
      const float4 xh = make_float4((xv.x - mu) * rs, (xv.y - mu) * rs, (xv.z - mu) * rs, (xv.w - mu) * rs);
      float4 gv = gr[i];
      gv.x += rs * (d.x * wv.x - m1 - xh.x * m2);
      gv.y += rs * (d.y * wv.y - m1 - xh.y * m2);
      gv.z += rs * (d.z * wv.z - m1 - xh.z * m2);
      gv.w += rs * (d.w * wv.w - m1 - xh.w * m2);
      gr[i] = gv;
      __nv_bfloat162 lo = __floats2bfloat162_rn(gv.x, gv.y), hi = __floats2bfloat162_rn(gv.z, gv.w);
      gbr[i] = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
      dw[j].x += d.x * xh.x; dw[j].y += d.y * xh.y; dw[j].z += d.z * xh.z; dw[j].w += d.w * xh.w;
      db[j].x += d.x; db[j].y += d.y; db[j].z += d.z; db[j].w += d.w;
    }
  }
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int i = lane + 32 * j;
    if (i >= D4) continue;
    atomicAdd(&acc[4 * i], dw[j].x); atomicAdd(&acc[4 * i + 1], dw[j].y);
    atomicAdd(&acc[4 * i + 2], dw[j].z); atomicAdd(&acc[4 * i + 3], dw[j].w);
    atomicAdd(&acc[D + 4 * i], db[j].x); atomicAdd(&acc[D + 4 * i + 1], db[j].y);
    atomicAdd(&acc[D + 4 * i + 2], db[j].z); atomicAdd(&acc[D + 4 * i + 3], db[j].w);
  }
  __syncthreads();
  float* out = partial + static_cast<size_t>(blockIdx.x) * 2 * D;
  for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) out[i] = acc[i];
}

// Calls f.template operator()<CHUNKS>() with CHUNKS = ceil(D / 128), a compile-time constant.
template <class F, int C = 1>
void dispatch_chunks(int D, F&& f) {
  if constexpr (C <= kMaxChunks) {
    if ((D + 127) / 128 == C) return f(std::integral_constant<int, C>{});
    return dispatch_chunks<F, C + 1>(D, std::forward<F>(f));
  }
}
}  // namespace

void layernorm_forward(const float* x, int x_row_stride, const float* w, const float* b, bf16* y, float* mean,
                       float* rstd, int M, int D, float eps, cudaStream_t stream) {
  NvtxRange range("layernorm_forward");
  ENSURE(D % 8 == 0 && D <= 128 * kMaxChunks && x_row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(w) &&
             is_aligned16(b) && is_aligned16(y),
         "layernorm_forward: D must be a multiple of 8 up to 1536, rows 16-byte aligned");
  dispatch_chunks(D, [&](auto chunks) {
    layernorm_forward_kernel<decltype(chunks)::value>
        <<<grid_for(M, kWarps), kWarps * 32, 0, stream>>>(x, x_row_stride, w, b, y, mean, rstd, M, D, eps);
  });
  LAUNCH_CHECK();
}

size_t layernorm_partial_floats(int M, int D) { return static_cast<size_t>(grid_for(M, kRowsPerBlock)) * 2 * D; }

void layernorm_backward(const bf16* dy, const float* x, int row_stride, const float* w, const float* mean,
                        const float* rstd, float* g, bf16* g_bf16, float* dw, float* db, float* partial, int M, int D,
                        cudaStream_t stream) {
  NvtxRange range("layernorm_backward");
  ENSURE(D % 8 == 0 && D <= 128 * kMaxChunks && row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(g) &&
             is_aligned16(dy) && is_aligned16(g_bf16) && is_aligned16(w),
         "layernorm_backward: D must be a multiple of 8 up to 1536, rows 16-byte aligned");
  const unsigned blocks = grid_for(M, kRowsPerBlock);
  const size_t smem = 2 * D * sizeof(float);  // at most 16 KB
  dispatch_chunks(D, [&](auto chunks) {
    layernorm_backward_kernel<decltype(chunks)::value>
        <<<blocks, kWarps * 32, smem, stream>>>(dy, x, row_stride, w, mean, rstd, g, g_bf16, partial, M, D);
  });
  LAUNCH_CHECK();
  sum_rows(partial, blocks, D, 2 * D, dw, stream);
  sum_rows(partial + D, blocks, D, 2 * D, db, stream);
}
