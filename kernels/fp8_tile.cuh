// Device side of the FP8 producers (fp8.h): the quantiser with its statistics, and the 64 x 64
// tile through which a producer writes both FP8 copies. A block of 256 threads owns a tile;
// each thread computes 8 consecutive values of a row at a time (two such vectors), the row-major
// copy leaves straight from registers in 8-byte words and the transposed copy through shared
// memory, 8 bytes of a column per thread.
#pragma once
#include <cuda_fp8.h>

#include "kernels/common.cuh"
#include "kernels/fp8.h"

namespace fp8tile {
constexpr int kTile = 64, kThreads = 256, kVec = 8;
constexpr int kVectors = kTile * kTile / kVec;  // 512: two per thread

// Non-negative floats order like their bit patterns, so an integer atomicMax serves; NaN's bits
// sort above infinity's, so a NaN survives.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

// One thread's side of a producer's FP8 output: the codes, and the amax and statistics so far.
template <__nv_fp8_interpretation_t kKind>
struct Quantizer {
  static constexpr float kMax = kKind == __NV_E4M3 ? 448.0f : 57344.0f;
  float scale;
  bool write, count;
  float amax = 0.0f;
  unsigned under = 0, saturated = 0, seen = 0;

  __device__ explicit Quantizer(const Fp8Out& o) : scale(o.scale ? *o.scale : 0.0f), write(o.scale), count(o.stats && o.scale) {}

  __device__ __forceinline__ uint32_t code(float v) {
    amax = max_nan(amax, fabsf(v));
    if (!write) return 0;
    const float s = v * scale;
    const uint32_t c = __nv_cvt_float_to_fp8(s, __NV_SATFINITE, kKind);
    if (count) {
      under += v != 0.0f && (c & 0x7f) == 0;  // +-0 are the codes 0x00 and 0x80 in both formats
      saturated += fabsf(s) > kMax;
      ++seen;
    }
    return c;
  }
  // Eight values to eight codes, lowest address in the lowest byte.
  __device__ __forceinline__ uint2 pack8(const float* x) {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) lo |= code(x[j]) << (8 * j);
#pragma unroll
    for (int j = 0; j < 4; ++j) hi |= code(x[4 + j]) << (8 * j);
    return make_uint2(lo, hi);
  }
  __device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d) {
    return code(a) | code(b) << 8 | code(c) << 16 | code(d) << 24;
  }
};

// The block's amax and statistics into the output's: one atomic each per block. Every thread of
// the block calls it (it synchronises); scratch holds a float and three counters per warp.
struct BlockScratch {
  float amax[kThreads / 32];
  unsigned under[kThreads / 32], saturated[kThreads / 32], seen[kThreads / 32];
};
template <class Q>
__device__ void block_record(const Q& q, const Fp8Out& o, BlockScratch& s) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const float m = warp_max_nan(q.amax);
  unsigned u = q.under, sat = q.saturated, n = q.seen;
  if (q.count) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      u += __shfl_xor_sync(0xffffffffu, u, off);
      sat += __shfl_xor_sync(0xffffffffu, sat, off);
      n += __shfl_xor_sync(0xffffffffu, n, off);
    }
  }
  if (threadIdx.x % 32 == 0) {
    s.amax[warp] = m;
    s.under[warp] = u;
    s.saturated[warp] = sat;
    s.seen[warp] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = s.amax[0];
    unsigned long long bu = s.under[0], bs = s.saturated[0], bn = s.seen[0];
    for (int i = 1; i < warps; ++i) {
      b = max_nan(b, s.amax[i]);
      bu += s.under[i];
      bs += s.saturated[i];
      bn += s.seen[i];
    }
    if (o.amax) atomic_max_nonneg(o.amax, b);
    if (q.count) {
      if (bu) atomicAdd(o.stats, bu);
      if (bs) atomicAdd(o.stats + 1, bs);
      atomicAdd(o.stats + 2, bn);
    }
  }
}

// A tile's codes in shared memory, for the transposed copy (rows padded: no bank conflicts on
// the column reads).
struct Tile {
  uint8_t code[kTile][kTile + 8];
};

// Vector v (0..511) of the tile: its row and first column (row-major order).
__device__ __forceinline__ int vec_row(int v) { return v / (kTile / kVec); }
__device__ __forceinline__ int vec_col(int v) { return (v % (kTile / kVec)) * kVec; }

// Writes the tile's codes, held in t, transposed into out_t [cols, rows] (after a __syncthreads).
__device__ __forceinline__ void store_transposed(const Tile& t, uint8_t* out_t, int r0, int c0, int rows,
                                                 int cols) {
  for (int v = threadIdx.x; v < kVectors; v += kThreads) {
    const int tc = v / (kTile / kVec), tr = (v % (kTile / kVec)) * kVec;
    const int c = c0 + tc, r = r0 + tr;
    if (c >= cols || r >= rows) continue;  // rows % 8 == 0: a vector is all in or all out
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) lo |= uint32_t(t.code[tr + j][tc]) << (8 * j);
#pragma unroll
    for (int j = 0; j < 4; ++j) hi |= uint32_t(t.code[tr + 4 + j][tc]) << (8 * j);
    *reinterpret_cast<uint2*>(out_t + static_cast<size_t>(c) * rows + r) = make_uint2(lo, hi);
  }
}

// Column sums of a tile's values (a bias gradient's partial row): sum[8] is this thread's over
// its vectors, all at the same 8 columns (256 threads step over 8 vectors a row). Lanes l, l^8,
// l^16, l^24 share columns; then the 8 warps meet in shared memory. Every thread calls it.
__device__ inline void tile_column_sums(const float (&sum)[kVec], float (&s)[kThreads / 32][kTile], float* partial_row,
                                 int c0, int cols) {
  float v[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    v[j] = sum[j];
    v[j] += __shfl_xor_sync(0xffffffffu, v[j], 8);
    v[j] += __shfl_xor_sync(0xffffffffu, v[j], 16);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < 8) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) s[warp][lane * kVec + j] = v[j];
  }
  __syncthreads();
  if (threadIdx.x < kTile && c0 + threadIdx.x < cols) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) t += s[w][threadIdx.x];
    partial_row[c0 + threadIdx.x] = t;
  }
}

inline dim3 grid(int rows, int cols) { return dim3((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile); }
inline bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }
// What every tiled producer needs of its output.
inline bool valid(const Fp8Out& o, int rows, int cols) {
  return rows > 0 && cols > 0 && rows % 8 == 0 && cols % 8 == 0 && (rows + kTile - 1) / kTile <= 65535 &&
         aligned8(o.out) && aligned8(o.out_t);
}

// The generic producer: src.load(r, c, x) computes the 8 values at row r, columns c..c+7;
// with kColSums their column sums go to partial's row blockIdx.y.
template <__nv_fp8_interpretation_t kKind, bool kColSums, class Source>
__global__ void __launch_bounds__(kThreads)
    tile_kernel(Source src, int rows, int cols, Fp8Out o, float* __restrict__ partial) {
  __shared__ Tile tile;
  __shared__ BlockScratch scratch;
  __shared__ float sums[kColSums ? kThreads / 32 : 1][kTile];
  Quantizer<kKind> q(o);
  const bool row_major = q.write && o.out, transposed = q.write && o.out_t;
  const int r0 = blockIdx.y * kTile, c0 = blockIdx.x * kTile;
  float sum[kVec] = {};
  for (int v = threadIdx.x; v < kVectors; v += kThreads) {
    const int tr = vec_row(v), tc = vec_col(v), r = r0 + tr, c = c0 + tc;
    if (r >= rows || c >= cols) continue;  // cols % 8 == 0: a vector is all in or all out
    float x[kVec];
    src.load(r, c, x);
    if (kColSums) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum[j] += x[j];
    }
    const uint2 codes = q.pack8(x);
    if (row_major) *reinterpret_cast<uint2*>(o.out + static_cast<size_t>(r) * cols + c) = codes;
    if (transposed) *reinterpret_cast<uint2*>(&tile.code[tr][tc]) = codes;
  }
  if constexpr (kColSums) {
    tile_column_sums(sum, sums, partial + static_cast<size_t>(blockIdx.y) * cols, c0, cols);
  }
  block_record(q, o, scratch);  // synchronises: the tile is complete
  if (transposed) store_transposed(tile, o.out_t, r0, c0, rows, cols);
}

// Rows of partial a tiled producer with column sums fills.
inline int tile_rows(int rows) { return (rows + kTile - 1) / kTile; }

template <class Source>
void launch_tile(const Source& src, int rows, int cols, const Fp8Out& o, float* partial, cudaStream_t stream) {
  const dim3 g = grid(rows, cols);
  if (o.kind == Fp8Kind::E4M3) {
    if (partial) tile_kernel<__NV_E4M3, true><<<g, kThreads, 0, stream>>>(src, rows, cols, o, partial);
    else tile_kernel<__NV_E4M3, false><<<g, kThreads, 0, stream>>>(src, rows, cols, o, partial);
  } else {
    if (partial) tile_kernel<__NV_E5M2, true><<<g, kThreads, 0, stream>>>(src, rows, cols, o, partial);
    else tile_kernel<__NV_E5M2, false><<<g, kThreads, 0, stream>>>(src, rows, cols, o, partial);
  }
}
}  // namespace fp8tile
