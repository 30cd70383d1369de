#include <algorithm>

#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/fp8_tile.cuh"
#include "kernels/layernorm.h"
#include "kernels/reduce.h"

namespace {
constexpr int kWarps = 8;
constexpr int kRowsPerChunk = 32;  // rows summed into one partial row of the weight gradients
constexpr int kParamThreads = 64;  // threads of a block of layernorm_params_kernel (256 columns)
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

// The normalised, scaled and shifted value, rounded the same way wherever it is computed (no
// contraction left to the compiler): the FP8 backward recomputes the forward's codes from it.
__device__ __forceinline__ float ln_value(float x, float mean, float rstd, float g, float b) {
  return __fmaf_rn(__fmul_rn(__fsub_rn(x, mean), rstd), g, b);
}

// The output goes to bf16 y, or (kFp8) to FP8 E4M3 through o: the GEMM's row-major operand.
// FP8: four blocks an SM (64 registers, no spill) keep more rows in flight.
template <int CHUNKS, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, kFp8 ? 4 : 1)
    layernorm_forward_kernel(const float* __restrict__ x, int x_row_stride, const float* __restrict__ w,
                             const float* __restrict__ b, bf16* __restrict__ y, Fp8Out o,
                             float* __restrict__ mean_out, float* __restrict__ rstd_out, int M, int D, float eps) {
  __shared__ fp8tile::BlockScratch scratch;
  fp8tile::Quantizer<__NV_E4M3> q(o);
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32, D4 = D / 4;
  if (row < M) {  // no early return: the FP8 amax is a block reduction
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
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int i = lane + 32 * j;
      if (i >= D4) continue;
      const float4 g = reinterpret_cast<const float4*>(w)[i], bb = reinterpret_cast<const float4*>(b)[i];
      const float4 n = make_float4(ln_value(v[j].x, mean, rstd, g.x, bb.x), ln_value(v[j].y, mean, rstd, g.y, bb.y),
                                   ln_value(v[j].z, mean, rstd, g.z, bb.z), ln_value(v[j].w, mean, rstd, g.w, bb.w));
      if constexpr (kFp8) {
        const uint32_t codes = q.pack4(n.x, n.y, n.z, n.w);
        if (q.write && o.out) reinterpret_cast<uint32_t*>(o.out + static_cast<size_t>(row) * D)[i] = codes;
      } else {
        __nv_bfloat162 lo = __floats2bfloat162_rn(n.x, n.y), hi = __floats2bfloat162_rn(n.z, n.w);
        reinterpret_cast<uint2*>(y + static_cast<size_t>(row) * D)[i] =
            make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
      }
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
  if constexpr (kFp8) fp8tile::block_record(q, o, scratch);
}

// The FP8 recompute of a forward output from its saved statistics, for the tiled producer.
struct LayerNormSource {
  const float *x, *w, *b, *mean, *rstd;
  int stride;
  __device__ void load(int r, int c, float* v) const {
    const float4* xr = reinterpret_cast<const float4*>(x + static_cast<size_t>(r) * stride + c);
    const float4* g = reinterpret_cast<const float4*>(w + c);
    const float4* bb = reinterpret_cast<const float4*>(b + c);
    const float mu = mean[r], rs = rstd[r];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 xv = xr[h], gv = g[h], bv = bb[h];
      v[4 * h + 0] = ln_value(xv.x, mu, rs, gv.x, bv.x);
      v[4 * h + 1] = ln_value(xv.y, mu, rs, gv.y, bv.y);
      v[4 * h + 2] = ln_value(xv.z, mu, rs, gv.z, bv.z);
      v[4 * h + 3] = ln_value(xv.w, mu, rs, gv.w, bv.w);
    }
  }
};

__device__ __forceinline__ float4 load_bf16x4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, c.x, c.y);
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w; g += dx.
// A warp per row in two sweeps: the first sums, the second (re-reading x and dy from L1) writes
// g. The weight and bias gradients are left to layernorm_params_kernel: accumulating them here
// took 80 more registers a thread and halved the warps in flight (141 us against a 60 us floor
// at ViT-H's shape).
template <int CHUNKS>
__global__ void __launch_bounds__(kWarps * 32)
    layernorm_backward_kernel(const bf16* __restrict__ dy, const float* __restrict__ x, int row_stride,
                              const float* __restrict__ w, const float* __restrict__ mean,
                              const float* __restrict__ rstd, float* __restrict__ g, bf16* __restrict__ g_bf16,
                              int M, int D) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32, D4 = D / 4;
  if (row >= M) return;
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
    float4 gv = gr[i];
    gv.x += rs * (d.x * wv.x - m1 - (xv.x - mu) * rs * m2);
    gv.y += rs * (d.y * wv.y - m1 - (xv.y - mu) * rs * m2);
    gv.z += rs * (d.z * wv.z - m1 - (xv.z - mu) * rs * m2);
    gv.w += rs * (d.w * wv.w - m1 - (xv.w - mu) * rs * m2);
    gr[i] = gv;
    __nv_bfloat162 lo = __floats2bfloat162_rn(gv.x, gv.y), hi = __floats2bfloat162_rn(gv.z, gv.w);
    gbr[i] = make_uint2(*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi));
  }
}

// partial[chunk] = (sum of dy * xhat, sum of dy) over the chunk's kRowsPerChunk rows, per
// column: a thread owns four columns, so each row's read is a coalesced 16-byte one per lane.
__global__ void __launch_bounds__(kParamThreads)
    layernorm_params_kernel(const bf16* __restrict__ dy, const float* __restrict__ x, int row_stride,
                            const float* __restrict__ mean, const float* __restrict__ rstd,
                            float* __restrict__ partial, int M, int D) {
  const int i = blockIdx.x * kParamThreads + threadIdx.x, D4 = D / 4;
  if (i >= D4) return;
  const int r0 = blockIdx.y * kRowsPerChunk, r1 = min(M, r0 + kRowsPerChunk);
  float4 dw = make_float4(0, 0, 0, 0), db = make_float4(0, 0, 0, 0);
  for (int r = r0; r < r1; ++r) {
    const float mu = mean[r], rs = rstd[r];
    const float4 xv = reinterpret_cast<const float4*>(x + static_cast<size_t>(r) * row_stride)[i];
    const float4 d = load_bf16x4(dy + static_cast<size_t>(r) * D + 4 * i);
    dw.x += d.x * (xv.x - mu) * rs; dw.y += d.y * (xv.y - mu) * rs;
    dw.z += d.z * (xv.z - mu) * rs; dw.w += d.w * (xv.w - mu) * rs;
    db.x += d.x; db.y += d.y; db.z += d.z; db.w += d.w;
  }
  float4* out = reinterpret_cast<float4*>(partial + static_cast<size_t>(blockIdx.y) * 2 * D);
  out[i] = dw;
  out[D4 + i] = db;
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
    layernorm_forward_kernel<decltype(chunks)::value, false>
        <<<grid_for(M, kWarps), kWarps * 32, 0, stream>>>(x, x_row_stride, w, b, y, Fp8Out{}, mean, rstd, M, D, eps);
  });
  LAUNCH_CHECK();
}

void layernorm_forward_fp8(const float* x, int x_row_stride, const float* w, const float* b, const Fp8Out& o,
                           float* mean, float* rstd, int M, int D, float eps, cudaStream_t stream) {
  NvtxRange range("layernorm_forward_fp8");
  ENSURE(D % 8 == 0 && D <= 128 * kMaxChunks && x_row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(w) &&
             is_aligned16(b) && o.kind == Fp8Kind::E4M3 && !o.out_t && fp8tile::aligned8(o.out),
         "layernorm_forward_fp8: D a multiple of 8 up to 1536, rows 16-byte aligned, a row-major E4M3 output");
  dispatch_chunks(D, [&](auto chunks) {
    layernorm_forward_kernel<decltype(chunks)::value, true>
        <<<grid_for(M, kWarps), kWarps * 32, 0, stream>>>(x, x_row_stride, w, b, nullptr, o, mean, rstd, M, D, eps);
  });
  LAUNCH_CHECK();
}

void layernorm_apply_fp8(const float* x, int x_row_stride, const float* w, const float* b, const float* mean,
                         const float* rstd, int M, int D, const Fp8Out& o, cudaStream_t stream) {
  NvtxRange range("layernorm_apply_fp8");
  ENSURE(fp8tile::valid(o, M, D) && o.kind == Fp8Kind::E4M3 && x_row_stride % 4 == 0 && is_aligned16(x) &&
             is_aligned16(w) && is_aligned16(b),
         "layernorm_apply_fp8: M and D multiples of 8, rows 16-byte aligned, an E4M3 output");
  fp8tile::launch_tile(LayerNormSource{x, w, b, mean, rstd, x_row_stride}, M, D, o, nullptr, stream);
  LAUNCH_CHECK();
}

size_t layernorm_partial_floats(int M, int D) { return static_cast<size_t>(grid_for(M, kRowsPerChunk)) * 2 * D; }

void layernorm_backward(const bf16* dy, const float* x, int row_stride, const float* w, const float* mean,
                        const float* rstd, float* g, bf16* g_bf16, float* dw, float* db, float* partial, int M, int D,
                        cudaStream_t stream) {
  NvtxRange range("layernorm_backward");
  ENSURE(D % 8 == 0 && D <= 128 * kMaxChunks && row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(g) &&
             is_aligned16(dy) && is_aligned16(g_bf16) && is_aligned16(w) && is_aligned16(partial),
         "layernorm_backward: D must be a multiple of 8 up to 1536, rows 16-byte aligned");
  dispatch_chunks(D, [&](auto chunks) {
    layernorm_backward_kernel<decltype(chunks)::value>
        <<<grid_for(M, kWarps), kWarps * 32, 0, stream>>>(dy, x, row_stride, w, mean, rstd, g, g_bf16, M, D);
  });
  LAUNCH_CHECK();
  const unsigned chunks = grid_for(M, kRowsPerChunk);
  ENSURE(chunks <= 65535, "layernorm_backward: too many rows");
  layernorm_params_kernel<<<dim3(grid_for(D / 4, kParamThreads), chunks), kParamThreads, 0, stream>>>(
      dy, x, row_stride, mean, rstd, partial, M, D);
  LAUNCH_CHECK();
  sum_rows(partial, chunks, D, 2 * D, dw, stream);
  sum_rows(partial + D, chunks, D, 2 * D, db, stream);
}
