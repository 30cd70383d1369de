#include <algorithm>

#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/fp8_tile.cuh"
#include "kernels/layernorm.h"
#include "kernels/reduce.h"

namespace {
constexpr int kWarps = 8;
// Blocks of the row-walking kernels: one wave on a 132-SM H100 or H200 (three blocks an SM for
// the FP8 forward, two for the bf16 forward and the backward, as many as their registers allow
// without a spill). Fixed, not read from the card: the backward's weight-gradient sums go
// through a partial row a block, so their order, and the result, must not depend on the card.
constexpr int kSMs = 132;
constexpr int forward_blocks_per_sm(bool fp8) { return fp8 ? 3 : 2; }
constexpr int kBackwardBlocks = 2 * kSMs;
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

// The normalised, scaled and shifted value, rounded the same way in every build (no contraction
// left to the compiler).
__device__ __forceinline__ float ln_value(float x, float mean, float rstd, float g, float b) {
  return __fmaf_rn(__fmul_rn(__fsub_rn(x, mean), rstd), g, b);
}

// The output goes to bf16 y, or (kFp8) to FP8 E4M3 through o: the GEMM's row-major operand.
// A warp takes a row at a time, every (gridDim.x * kWarps)-th: one wave of blocks walks all the
// rows (no tail of partial waves). FP8: three blocks an SM, bf16: two, the most at which the row
// loop keeps its registers at every supported D.
template <int CHUNKS, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, forward_blocks_per_sm(kFp8))
    layernorm_forward_kernel(const float* __restrict__ x, int x_row_stride, const float* __restrict__ w,
                             const float* __restrict__ b, bf16* __restrict__ y, Fp8Out o,
                             float* __restrict__ mean_out, float* __restrict__ rstd_out, int M, int D, float eps) {
  __shared__ fp8tile::BlockScratch scratch;
  fp8tile::Quantizer<__NV_E4M3> q(o);
  const int lane = threadIdx.x % 32, D4 = D / 4;
  // No early return: the FP8 amax is a block reduction.
  for (int row = blockIdx.x * kWarps + threadIdx.x / 32; row < M; row += gridDim.x * kWarps) {
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
        reinterpret_cast<uint2*>(y + static_cast<size_t>(row) * D)[i] =
            make_uint2(pack_bf16x2(n.x, n.y), pack_bf16x2(n.z, n.w));
      }
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
  if constexpr (kFp8) fp8tile::block_record(q, o, scratch);
}

__device__ __forceinline__ float4 bf16x4_to_float4(uint2 u) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, c.x, c.y);
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w; g += dx; and
// the weight and bias gradients' partial sums, all in one pass over x, dy and g.
// A warp owns a row at a time, every (gridDim.x * kWarps)-th: lane l holds its float4 columns of
// x, dy and g in registers, all loaded before the row's sums need them (one round trip a row;
// past D = 1280, g is read after the sums: its registers would spill at two blocks an SM).
// The column sums dy * xhat and dy go into the warp's own slice of shared memory, each lane
// owning its columns there (no atomics, no barrier), and the block adds its warps' slices into
// one partial row at the end: in registers they would cost a thread 80 more registers (half the
// occupancy), and a second kernel would read x and dy from memory again.
template <int CHUNKS>
__global__ void __launch_bounds__(kWarps * 32, 2)
    layernorm_backward_kernel(const bf16* __restrict__ dy, const float* __restrict__ x, int row_stride,
                              const float* __restrict__ w, const float* __restrict__ mean,
                              const float* __restrict__ rstd, float* __restrict__ g, bf16* __restrict__ g_bf16,
                              SampleScale branch_scale, float* __restrict__ partial, int M, int D) {
  extern __shared__ float4 column_sums[];  // [kWarps][dw, db][D / 4]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D4 = D / 4;
  float4* dw_sum = column_sums + warp * 2 * D4;
  float4* db_sum = dw_sum + D4;
  const float4* w4 = reinterpret_cast<const float4*>(w);
  const float4 zero = make_float4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int i = lane + 32 * j;
    if (i < D4) dw_sum[i] = db_sum[i] = zero;
  }
  constexpr bool kGEarly = CHUNKS <= 10;
  for (int row = blockIdx.x * kWarps + warp; row < M; row += gridDim.x * kWarps) {
    const float mu = mean[row], rs = rstd[row];
    const float4* xr = reinterpret_cast<const float4*>(x + static_cast<size_t>(row) * row_stride);
    const uint2* dyr = reinterpret_cast<const uint2*>(dy + static_cast<size_t>(row) * D);
    float4* gr = reinterpret_cast<float4*>(g + static_cast<size_t>(row) * row_stride);
    float4 xv[CHUNKS], gv[CHUNKS];
    uint2 dyv[CHUNKS];
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int i = lane + 32 * j;
      xv[j] = i < D4 ? xr[i] : zero;
      dyv[j] = i < D4 ? dyr[i] : make_uint2(0, 0);
      if (kGEarly) gv[j] = i < D4 ? gr[i] : zero;
    }
    float s1 = 0, s2 = 0;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int i = lane + 32 * j;
      if (i >= D4) continue;
      const float4 d = bf16x4_to_float4(dyv[j]), wv = w4[i];
      const float a = d.x * wv.x, b = d.y * wv.y, c = d.z * wv.z, e = d.w * wv.w;
      s1 += a + b + c + e;
      s2 += a * (xv[j].x - mu) + b * (xv[j].y - mu) + c * (xv[j].z - mu) + e * (xv[j].w - mu);
    }
    const float m1 = warp_sum(s1) / D, m2 = warp_sum(s2) * rs / D;
    const float bs = branch_scale.scale ? branch_scale.scale[row / branch_scale.rows_per_sample] : 1.0f;
    uint2* gbr = reinterpret_cast<uint2*>(g_bf16 + static_cast<size_t>(row) * row_stride);
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int i = lane + 32 * j;
      if (i >= D4) continue;
      const float4 d = bf16x4_to_float4(dyv[j]), wv = w4[i];
      const float4 xh = make_float4((xv[j].x - mu) * rs, (xv[j].y - mu) * rs, (xv[j].z - mu) * rs,
                                    (xv[j].w - mu) * rs);
      float4 gn = kGEarly ? gv[j] : gr[i];
      gn.x += rs * (d.x * wv.x - m1 - xh.x * m2);
      gn.y += rs * (d.y * wv.y - m1 - xh.y * m2);
      gn.z += rs * (d.z * wv.z - m1 - xh.z * m2);
      gn.w += rs * (d.w * wv.w - m1 - xh.w * m2);
      gr[i] = gn;
      gbr[i] = make_uint2(pack_bf16x2(gn.x * bs, gn.y * bs), pack_bf16x2(gn.z * bs, gn.w * bs));
      float4 sw = dw_sum[i], sb = db_sum[i];
      sw.x += d.x * xh.x; sw.y += d.y * xh.y; sw.z += d.z * xh.z; sw.w += d.w * xh.w;
      sb.x += d.x; sb.y += d.y; sb.z += d.z; sb.w += d.w;
      dw_sum[i] = sw;
      db_sum[i] = sb;
    }
  }
  __syncthreads();
  // partial[block] = (dw, db) summed over the block's warps, in warp order.
  float4* out = reinterpret_cast<float4*>(partial + static_cast<size_t>(blockIdx.x) * 2 * D);
  for (int i = threadIdx.x; i < 2 * D4; i += blockDim.x) {
    float4 t = column_sums[i];
    for (int k = 1; k < kWarps; ++k) {
      const float4 v = column_sums[k * 2 * D4 + i];
      t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
    }
    out[i] = t;
  }
}

// Calls f.template operator()<CHUNKS>() with CHUNKS = ceil(D / 128), a compile-time constant.
template <class F, int C = 1>
void dispatch_chunks(int D, F&& f) {
  if constexpr (C <= kMaxChunks) {
    if ((D + 127) / 128 == C) return f(std::integral_constant<int, C>{});
    return dispatch_chunks<F, C + 1>(D, std::forward<F>(f));
  }
}

// The row-walking kernels' grids (kSMs above): no more blocks than row groups.
unsigned forward_blocks(int M, bool fp8) {
  return std::min<unsigned>(grid_for(M, kWarps), forward_blocks_per_sm(fp8) * kSMs);
}
unsigned backward_blocks(int M) { return std::min<unsigned>(grid_for(M, kWarps), kBackwardBlocks); }
}  // namespace

void layernorm_forward(const float* x, int x_row_stride, const float* w, const float* b, bf16* y, float* mean,
                       float* rstd, int M, int D, float eps, cudaStream_t stream) {
  NvtxRange range("layernorm_forward");
  ENSURE(D % 8 == 0 && D <= 128 * kMaxChunks && x_row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(w) &&
             is_aligned16(b) && is_aligned16(y),
         "layernorm_forward: D must be a multiple of 8 up to 1536, rows 16-byte aligned");
  dispatch_chunks(D, [&](auto chunks) {
    layernorm_forward_kernel<decltype(chunks)::value, false>
        <<<forward_blocks(M, false), kWarps * 32, 0, stream>>>(x, x_row_stride, w, b, y, Fp8Out{}, mean, rstd, M, D, eps);
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
        <<<forward_blocks(M, true), kWarps * 32, 0, stream>>>(x, x_row_stride, w, b, nullptr, o, mean, rstd, M, D, eps);
  });
  LAUNCH_CHECK();
}

size_t layernorm_partial_floats(int M, int D) { return static_cast<size_t>(backward_blocks(M)) * 2 * D; }

void layernorm_backward(const bf16* dy, const float* x, int row_stride, const float* w, const float* mean,
                        const float* rstd, float* g, bf16* g_bf16, float* dw, float* db, float* partial, int M, int D,
                        cudaStream_t stream, GradWrite write, SampleScale branch_scale) {
  NvtxRange range("layernorm_backward");
  ENSURE(D % 8 == 0 && D <= 128 * kMaxChunks && row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(g) &&
             is_aligned16(dy) && is_aligned16(g_bf16) && is_aligned16(w) && is_aligned16(partial) &&
             branch_scale.rows_per_sample > 0,
         "layernorm_backward: D must be a multiple of 8 up to 1536, rows 16-byte aligned");
  const unsigned blocks = backward_blocks(M);
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  dispatch_chunks(D, [&](auto chunks) {
    constexpr int kChunks = decltype(chunks)::value;
    // The warps' column sums: D floats twice a warp, at most 128 * kChunks columns.
    prepare_kernel<&layernorm_backward_kernel<kChunks>>(dev, kWarps * 2 * 128 * kChunks * sizeof(float),
                                                        cudaSharedmemCarveoutDefault);
    layernorm_backward_kernel<kChunks><<<blocks, kWarps * 32, static_cast<size_t>(kWarps) * 2 * D * sizeof(float),
                                          stream>>>(dy, x, row_stride, w, mean, rstd, g, g_bf16, branch_scale, partial, M, D);
  });
  LAUNCH_CHECK();
  sum_rows(partial, blocks, D, 2 * D, dw, stream, write);
  sum_rows(partial + D, blocks, D, 2 * D, db, stream, write);
}
