// Device side of the FP8 producers (fp8.h): the quantiser with its statistics, and the 64 x 128
// tiles through which a producer writes both FP8 copies. A block of 256 threads converts a tile
// at a time; each thread computes 8 consecutive values of a row at a time (four such vectors,
// all loaded before any is stored), the row-major copy leaves straight from registers in 8-byte
// words and the transposed copy through shared memory, 8 bytes of a column per store.
#pragma once
#include <cuda_fp8.h>

#include "kernels/common.cuh"
#include "kernels/fp8_out.h"

namespace fp8tile {
constexpr int kTileRows = 64, kTileCols = 128, kThreads = 256, kVec = 8;
constexpr int kRowVectors = kTileCols / kVec;              // 16 vectors a tile row
constexpr int kVectors = kTileRows * kRowVectors;          // 1024
constexpr int kPerThread = kVectors / kThreads;            // 4, all at the same 8 columns

// One thread's side of a producer's FP8 output: the codes, and the amax and statistics so far.
// The amax is kept as the maximum of |v|'s bit patterns: non-negative floats order like their
// bits, and a NaN's bits sort above infinity's, so a NaN survives (one integer max a value).
template <__nv_fp8_interpretation_t kKind>
struct Quantizer {
  static constexpr float kMax = kKind == __NV_E4M3 ? 448.0f : 57344.0f;
  float scale;
  bool write, count, track;
  unsigned amax_bits = 0, under = 0, saturated = 0, seen = 0;

  __device__ explicit Quantizer(const Fp8Out& o)
      : scale(o.scale ? *o.scale : 0.0f), write(o.scale), count(o.stats && o.scale), track(o.amax) {}

  __device__ __forceinline__ void see(float v) {
    if (track) amax_bits = max(amax_bits, __float_as_uint(v) & 0x7fffffffu);
  }
  // Two values to two codes (one instruction), a's in the low byte.
  __device__ __forceinline__ uint32_t code2(float a, float b) {
    see(a);
    see(b);
    if (!write) return 0;
    const float sa = a * scale, sb = b * scale;
    const uint32_t c = __nv_cvt_float2_to_fp8x2(make_float2(sa, sb), __NV_SATFINITE, kKind);
    if (count) {  // +-0 are the codes 0x00 and 0x80 in both formats
      under += (a != 0.0f && (c & 0x7f) == 0) + (b != 0.0f && (c & 0x7f00) == 0);
      saturated += (fabsf(sa) > kMax) + (fabsf(sb) > kMax);
      seen += 2;
    }
    return c;
  }
  // Eight values to eight codes, lowest address in the lowest byte.
  __device__ __forceinline__ uint2 pack8(const float* x) {
    return make_uint2(pack4(x[0], x[1], x[2], x[3]), pack4(x[4], x[5], x[6], x[7]));
  }
  __device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d) {
    return code2(a, b) | code2(c, d) << 16;
  }
};

// The block's amax and statistics into the output's: one atomic each per block. Every thread of
// the block calls it (it synchronises); scratch holds a float and three counters per warp.
struct BlockScratch {
  unsigned amax[kThreads / 32];
  unsigned under[kThreads / 32], saturated[kThreads / 32], seen[kThreads / 32];
};
template <class Q>
__device__ void block_record(const Q& q, const Fp8Out& o, BlockScratch& s) {
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const unsigned m = __reduce_max_sync(0xffffffffu, q.amax_bits);
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
    unsigned b = s.amax[0];
    unsigned long long bu = s.under[0], bs = s.saturated[0], bn = s.seen[0];
    for (int i = 1; i < warps; ++i) {
      b = max(b, s.amax[i]);
      bu += s.under[i];
      bs += s.saturated[i];
      bn += s.seen[i];
    }
    if (o.amax) atomicMax(reinterpret_cast<unsigned*>(o.amax), b);
    if (q.count) {
      if (bu) atomicAdd(o.stats, bu);
      if (bs) atomicAdd(o.stats + 1, bs);
      atomicAdd(o.stats + 2, bn);
    }
  }
}

// A tile's codes in shared memory, for the transposed copy (rows padded: no bank conflicts on
// the column reads).
struct alignas(16) Tile {
  uint8_t code[kTileRows][kTileCols + 8];
};

// Vector v (0..511) of the tile: its row and first column (row-major order).
__device__ __forceinline__ int vec_row(int v) { return v / kRowVectors; }
__device__ __forceinline__ int vec_col(int v) { return (v % kRowVectors) * kVec; }

// Writes the tile's codes, held in t, transposed into out_t [cols, rows] (after a __syncthreads).
// A thread takes 8 rows x 4 columns: eight 4-byte shared loads, byte permutes, four 8-byte
// stores (threads of a warp step along rows first: 64 contiguous bytes of each column).
__device__ __forceinline__ void store_transposed(const Tile& t, uint8_t* out_t, int r0, int c0, int rows,
                                                 int cols) {
  constexpr int kRowGroups = kTileRows / 8, kColGroups = kTileCols / 4;
  for (int item = threadIdx.x; item < kRowGroups * kColGroups; item += blockDim.x) {
    const int tr = (item % kRowGroups) * 8, tc = (item / kRowGroups) * 4;
    if (r0 + tr >= rows || c0 + tc >= cols) continue;  // rows % 8, cols % 8 == 0: all in or all out
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = *reinterpret_cast<const uint32_t*>(&t.code[tr + i][tc]);
    uint32_t col[2][4];  // [row half][column]: 4 rows' bytes of one column
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t *v = w + 4 * h;
      const uint32_t lo01 = __byte_perm(v[0], v[1], 0x5140), lo23 = __byte_perm(v[2], v[3], 0x5140);
      const uint32_t hi01 = __byte_perm(v[0], v[1], 0x7362), hi23 = __byte_perm(v[2], v[3], 0x7362);
      col[h][0] = __byte_perm(lo01, lo23, 0x5410);
      col[h][1] = __byte_perm(lo01, lo23, 0x7632);
      col[h][2] = __byte_perm(hi01, hi23, 0x5410);
      col[h][3] = __byte_perm(hi01, hi23, 0x7632);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<uint2*>(out_t + static_cast<size_t>(c0 + tc + j) * rows + r0 + tr) =
          make_uint2(col[0][j], col[1][j]);
  }
}

// Column sums of a tile's values (a bias gradient's partial row): sum[8] is this thread's over
// its vectors, all at the same 8 columns (256 threads step over 16 vectors a row). Lanes l and
// l^16 share columns; then the 8 warps meet in shared memory. Every thread calls it.
__device__ inline void tile_column_sums(const float (&sum)[kVec], float (&s)[kThreads / 32][kTileCols],
                                        float* partial_row, int c0, int cols) {
  float v[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = sum[j] + __shfl_xor_sync(0xffffffffu, sum[j], 16);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < 16) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) s[warp][lane * kVec + j] = v[j];
  }
  __syncthreads();
  if (threadIdx.x < kTileCols && c0 + threadIdx.x < cols) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) t += s[w][threadIdx.x];
    partial_row[c0 + threadIdx.x] = t;
  }
}

inline dim3 grid(int rows, int cols) {
  return dim3((cols + kTileCols - 1) / kTileCols, (rows + kTileRows - 1) / kTileRows);
}
inline bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }
// What every tiled producer needs of its output.
inline bool valid(const Fp8Out& o, int rows, int cols) {
  return rows > 0 && cols > 0 && rows % 8 == 0 && cols % 8 == 0 && (rows + kTileRows - 1) / kTileRows <= 65535 &&
         aligned8(o.out) && aligned8(o.out_t);
}

// Tensor z of a batched launch (fp8.h): first's pointers advanced by the strides.
__device__ __forceinline__ Fp8Out batch_member(Fp8Out o, const Fp8Strides& s, size_t z) {
  auto at = [z](auto* p, size_t stride) {
    using T = decltype(p);
    return p ? reinterpret_cast<T>(reinterpret_cast<uintptr_t>(p) + z * stride) : p;
  };
  o.scale = at(o.scale, s.meta);
  o.amax = at(o.amax, s.meta);
  o.out = at(o.out, s.out);
  o.out_t = at(o.out_t, s.out_t);
  o.stats = at(o.stats, s.stats);
  return o;
}

// The generic producer. A Source has a Raw type (what one vector's loads bring), fetch(r, c) (the
// loads of the 8 values at row r, columns c..c+7, of tensor blockIdx.z for a source that
// batches) and convert(raw, r, c, x) (the 8 values from them). With kColSums the values' column
// sums go to partial's row blockIdx.y.
// A block walks the column of tiles blockIdx.x, every gridDim.y-th row tile from blockIdx.y: a
// fixed number of tiles (kTilesPerBlock, so the partial sums, and the results, do not depend on
// the card), issuing the next tile's loads before it converts the current one, so that its reads
// stay in flight through its arithmetic and stores (with one tile a block, a block's successor's
// loads would wait behind its whole life).
constexpr int kTilesPerBlock = 8;
__host__ __device__ inline int tile_rows(int rows) { return (rows + kTileRows - 1) / kTileRows; }
// Row blocks of a producer's grid; so also the rows of partial a producer with column sums fills.
inline int partial_rows(int rows) { return (tile_rows(rows) + kTilesPerBlock - 1) / kTilesPerBlock; }

template <__nv_fp8_interpretation_t kKind, bool kColSums, class Source>
__global__ void __launch_bounds__(kThreads, 2)
    tile_kernel(Source src, int rows, int cols, Fp8Out o, Fp8Strides strides, float* __restrict__ partial) {
  if (gridDim.z > 1) o = batch_member(o, strides, blockIdx.z);
  __shared__ Tile tile;
  __shared__ BlockScratch scratch;
  __shared__ float sums[kColSums ? kThreads / 32 : 1][kTileCols];
  Quantizer<kKind> q(o);
  const bool row_major = q.write && o.out, transposed = q.write && o.out_t;
  const int c0 = blockIdx.x * kTileCols, row_tiles = tile_rows(rows);
  float sum[kVec] = {};
  typename Source::Raw raw[kPerThread], next[kPerThread];
  bool in[kPerThread], next_in[kPerThread];
  auto fetch = [&](int t) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int v = threadIdx.x + k * kThreads, r = t * kTileRows + vec_row(v), c = c0 + vec_col(v);
      next_in[k] = r < rows && c < cols;  // cols % 8 == 0: a vector is all in or all out
      if (next_in[k]) next[k] = src.fetch(r, c);
    }
  };
  fetch(blockIdx.y);
  for (int t = blockIdx.y; t < row_tiles; t += gridDim.y) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      raw[k] = next[k];
      in[k] = next_in[k];
    }
    if (t + gridDim.y < row_tiles) fetch(t + gridDim.y);
    const int r0 = t * kTileRows;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if (!in[k]) continue;
      const int v = threadIdx.x + k * kThreads, tr = vec_row(v), tc = vec_col(v), r = r0 + tr, c = c0 + tc;
      float x[kVec];
      src.convert(raw[k], r, c, x);
      if (kColSums) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum[j] += x[j];
      }
      const uint2 codes = q.pack8(x);
      if (row_major) *reinterpret_cast<uint2*>(o.out + static_cast<size_t>(r) * cols + c) = codes;
      if (transposed) *reinterpret_cast<uint2*>(&tile.code[tr][tc]) = codes;
    }
    if (transposed) {
      __syncthreads();  // the tile is complete
      store_transposed(tile, o.out_t, r0, c0, rows, cols);
      __syncthreads();  // and read, before the next tile's codes go in
    }
  }
  if constexpr (kColSums) {
    tile_column_sums(sum, sums, partial + static_cast<size_t>(blockIdx.y) * cols, c0, cols);
  }
  block_record(q, o, scratch);
}

template <class Source>
void launch_tile(const Source& src, int rows, int cols, const Fp8Out& o, float* partial, cudaStream_t stream,
                 int count = 1, const Fp8Strides& strides = {}) {
  const dim3 g(grid(rows, cols).x, partial_rows(rows), count);
  if (o.kind == Fp8Kind::E4M3) {
    if (partial) tile_kernel<__NV_E4M3, true><<<g, kThreads, 0, stream>>>(src, rows, cols, o, strides, partial);
    else tile_kernel<__NV_E4M3, false><<<g, kThreads, 0, stream>>>(src, rows, cols, o, strides, partial);
  } else {
    if (partial) tile_kernel<__NV_E5M2, true><<<g, kThreads, 0, stream>>>(src, rows, cols, o, strides, partial);
    else tile_kernel<__NV_E5M2, false><<<g, kThreads, 0, stream>>>(src, rows, cols, o, strides, partial);
  }
}
}  // namespace fp8tile
