// What the mma.sync attention kernels share (the streamed forward and backward, the single-pass
// backward): FlashAttention-2-style register-resident tiles on mma.sync (m16n8k16, bf16 in, fp32
// accumulate), operands staged in shared memory by cp.async and read into fragments with
// ldmatrix; the padded tile geometry, the per-head-dim tuning, the PTX wrappers, the two products
// every kernel is made of, the staging and write-back helpers, and the chunk pipeline through
// which the streamed kernels stream the other side. Everything in an anonymous namespace: each
// including file gets its own copy.
//
// A streamed kernel runs 4 warps per block on a 64-row tile of one (image, head): 64 queries
// (forward, dQ) or 64 keys (dKdV), 16 rows per warp. The other side (keys, or queries for dKdV)
// streams through shared memory in chunks of 64 rows, double-buffered (stream_chunks), so shared
// memory does not depend on T. A warp holds its 16-row slice of the scores (16 x 64, or 16 x kSub
// in the backward, see Tuning) in fp32 registers, and the probabilities (or dS) go back into the
// tensor cores as bf16 A fragments straight from the accumulator layout.
//
// Padding: staged rows at or past T are zero-filled (cp.async with source size 0), so every
// product over them is finite; padding keys get probability 0 through an explicit mask (forward,
// dQ) and padding queries through lse = +inf (dKdV). 16-row groups that lie wholly past T are not
// computed at all: a warp whose 16 rows are all padding skips its work, and the last, partial
// chunk skips its 16-column groups past T (a separate instantiation of the chunk code, so that
// full chunks run without run-time guards).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/attention_common.cuh"
#include "kernels/check.h"
#include "kernels/common.cuh"

namespace {
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;   // rows per block and rows per streamed chunk
constexpr int kWarps = 4;   // 16 rows each
constexpr int kThreads = kWarps * 32;

// ---------------------------------------------------------------------------------------------
// Shared-memory geometry. A tile is kTile rows of pad16(hd) bf16, each row padded by 8 elements
// (16 bytes): the row stride is then an odd multiple of 16 bytes (hd padded to 16), so the
// eight 16-byte row segments one ldmatrix 8x8 matrix reads fall in distinct bank groups, and the
// 4-byte accumulator stores of the epilogue are conflict-free too. A tile is
// 128 * (pad16(hd) + 8) bytes, a multiple of 128, so every tile starts 128-byte aligned.

// hd that is a multiple of 8 but not of 16 is padded to the next multiple of 16 in shared memory
// (zero columns, which add nothing to any product) and in the fragments; global memory holds hd.
__host__ __device__ constexpr int pad16(int hd) { return (hd + 15) / 16 * 16; }
__host__ __device__ constexpr int row_stride(int hd) { return pad16(hd) + 8; }  // elements
__host__ __device__ constexpr int tile_bytes(int hd) { return kTile * row_stride(hd) * 2; }

// Forward and dQ: [Q | K0 | V0 | K1 | V1] (forward) or [Q | dO | K0 | V0 | K1 | V1] (dQ).
__host__ __device__ constexpr int forward_smem_bytes(int hd) { return 5 * tile_bytes(hd); }
__host__ __device__ constexpr int dq_smem_bytes(int hd) { return 6 * tile_bytes(hd); }
// dKdV: [K | V | Q0 | dO0 | Q1 | dO1 | lse[2][64] | delta[2][64]].
__host__ __device__ constexpr int dkdv_smem_bytes(int hd) {
  return 6 * tile_bytes(hd) + 2 * 2 * kTile * int(sizeof(float));
}

// Per-head-dim tuning. kSub: the width of the column block (queries in dKdV, keys in dQ) a warp
// holds in registers at once (S and dP are 16 x kSub fp32 each). *MinBlocks: the blocks per SM
// asked of __launch_bounds__, which caps registers at 65536 / (128 * blocks): 168 for 3, 255 for
// 2. These kernels are latency-bound, so warps per SM count for more than the width of a
// register block: up to hd 80 (padded) the backward runs 32-wide blocks at 168 registers, 3
// blocks per SM, without spills. Above hd 80 shared memory allows 2 blocks only; at hd 128
// dKdV's 16 x hd dK + dV leave room for 16-wide blocks only. The forward keeps the registers it
// needs without spilling. Building with -DATT_SWEEP and the ATT_* values below makes one variant
// of a sweep (tools/attention_sweep.sh).
#ifndef ATT_SWEEP
template <int HD>
struct Tuning {
  static constexpr int P = pad16(HD);
  static constexpr int kFwdMinBlocks = P <= 32 ? 4 : (P <= 96 ? 3 : 2);
  static constexpr int kDkdvSub = P <= 112 ? 32 : 16;
  static constexpr int kDkdvMinBlocks = P <= 80 ? 3 : 2;
  static constexpr int kDqSub = 32;
  static constexpr int kDqMinBlocks = P <= 80 ? 3 : 2;
};
#else
template <int HD>
struct Tuning {
  static constexpr int kFwdMinBlocks = ATT_FWD_MINB;
  static constexpr int kDkdvSub = ATT_DKDV_SUB;
  static constexpr int kDkdvMinBlocks = ATT_DKDV_MINB;
  static constexpr int kDqSub = ATT_DQ_SUB;
  static constexpr int kDqMinBlocks = ATT_DQ_MINB;
};
#endif

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

// 16-byte global -> shared copy that bypasses L1; with valid == false nothing is read and the 16
// destination bytes are zero-filled (source size 0). src must still be a valid address.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(src))
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane l supplies the address of row l % 8 of matrix l / 8. Without .trans
// lane (g = l/4, t = l%4) receives, in register m, row g, columns 2t and 2t+1 of matrix m; with
// .trans it receives rows 2t and 2t+1 of column g (i.e. the transposed matrix's row g).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b for one m16n8k16 tile, g = lane / 4, t = lane % 4:
//   A (16x16, row-major), 4 regs of bf16x2: a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..2t+1),
//                                           a2 (row g, k 2t+8..2t+9), a3 (row g+8, k 2t+8..2t+9)
//   B (16x8, "col"), 2 regs of bf16x2:      b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g)
//   C (16x8 fp32), 4 regs:                  c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same)
// The lower 16 bits of a bf16x2 register hold the lower index.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The two bf16 values of a bf16x2 word as floats (the lower index in the lower half).
__device__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Reductions over the 4 lanes of a quad (lanes 4g..4g+3 hold one accumulator row between them).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------------
// Fragment loads from a padded row-major tile (row stride LD elements). Each returns the byte
// offset, relative to the tile's address of element (r0, c0) of a 16x16 block, of the row
// pointer that this lane hands to ldmatrix_x4; the four 8x8 matrices are noted as
// (row range, column range) of that block.

// Matrices (0-7, 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15): lanes 0-15 point at rows 0-15 of
// column 0, lanes 16-31 at rows 0-15 of column 8.
//  * ldmatrix_x4: the A fragment of the block read as A[row][k] (a0..a3 in order).
//  * ldmatrix_x4_trans: B fragments of two n-tiles of a block stored as B[k][n] (k = row):
//    r0, r1 = b0, b1 of n-tile 0 (columns 0-7), r2, r3 = b0, b1 of n-tile 1 (columns 8-15).
template <int LD>
__device__ __forceinline__ uint32_t lane_offset_a(int lane) {
  return uint32_t(((lane & 15) * LD + (lane >> 4) * 8) * 2);
}

// Matrices (0-7, 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
//  * ldmatrix_x4: B fragments of two n-tiles of a block stored as B^T, i.e. M[n][k] (n = row,
//    e.g. a K tile in Q K^T): r0, r1 = b0, b1 of n-tile 0 (rows 0-7), r2, r3 of n-tile 1 (8-15).
template <int LD>
__device__ __forceinline__ uint32_t lane_offset_bt(int lane) {
  return uint32_t((((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2);
}

// Byte offset of element (r, c) in a tile of row stride LD.
template <int LD>
__device__ __forceinline__ constexpr uint32_t at(int r, int c) {
  return uint32_t((r * LD + c) * 2);
}

// The A fragment of a 16x16 block (k = 16 columns 16j..16j+15) from the fp32 accumulators of the
// n-tiles 2j (lo) and 2j+1 (hi) of a 16-row product. The C layout (c0,c1: row g, cols 2t,2t+1;
// c2,c3: row g+8) is exactly the A layout's (a0: row g, k 2t..; a1: row g+8, k 2t..; a2/a3 the
// same at k + 8), so no data moves between lanes.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                         const float (&hi)[4]) {
  a[0] = pack_bf16x2(lo[0], lo[1]);
  a[1] = pack_bf16x2(lo[2], lo[3]);
  a[2] = pack_bf16x2(hi[0], hi[1]);
  a[3] = pack_bf16x2(hi[2], hi[3]);
}

// The two products every kernel is made of, over a chunk's 16-row groups j < groups (all
// kGroups of them when kFull), B read from the padded tile b_tile(buf) (the chunk's buffer),
// stored [row][hd], whose group j starts at row row0 + 16 j:
// acc (16 x 16 kGroups) += A B^T, contracting over hd: A's fragment for k-step kk from
// a_frag(kk, a) (registers, or an ldmatrix), B^T fragments through ldmatrix.
template <int HP, int kGroups, bool kFull, typename AFrag, typename BTile>
__device__ __forceinline__ void mma_rows_bt(float (&acc)[2 * kGroups][4], AFrag a_frag, BTile b_tile, int buf,
                                            int row0, int groups, uint32_t off_bt) {
  constexpr int LD = HP + 8;
#pragma unroll
  for (int kk = 0; kk < HP / 16; ++kk) {
    uint32_t a[4];
    a_frag(kk, a);
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      if (kFull || j < groups) {
        uint32_t bf[4];
        ldmatrix_x4(bf, b_tile(buf) + at<LD>(row0 + j * 16, kk * 16) + off_bt);
        mma_bf16(acc[2 * j], a, bf[0], bf[1]);
        mma_bf16(acc[2 * j + 1], a, bf[2], bf[3]);
      }
    }
  }
}

// out (16 x HP) += P B, contracting over the chunk's rows: P's 16-column groups as A fragments
// straight from the accumulators p, B (stored [k][n]) through ldmatrix .trans, two 8-column
// n-tiles of out per load.
template <int HP, int kGroups, bool kFull, typename BTile>
__device__ __forceinline__ void mma_acc_b(float (&out)[HP / 8][4], const float (&p)[2 * kGroups][4], BTile b_tile,
                                          int buf, int row0, int groups, uint32_t off_a) {
  constexpr int LD = HP + 8;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    if (kFull || j < groups) {
      uint32_t pa[4];
      acc_to_a(pa, p[2 * j], p[2 * j + 1]);
#pragma unroll
      for (int nn = 0; nn < HP / 16; ++nn) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, b_tile(buf) + at<LD>(row0 + j * 16, nn * 16) + off_a);
        mma_bf16(out[2 * nn], pa, bf[0], bf[1]);
        mma_bf16(out[2 * nn + 1], pa, bf[2], bf[3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Block-wide staging and warp-wide write-back.

// cp.async rows [row0, row0 + 64) of a [T, HD] slice (row stride src_ld elements) into the tile
// at dst; rows at or past T are zero-filled. 64 * HD / 8 16-byte vectors over 128 threads (HD/16
// each when HD is a multiple of 16). The padding columns [HD, HP) are not written: they stay as
// zero_padding_columns left them.
template <int HD>
__device__ __forceinline__ void load_tile_async(uint32_t dst, const bf16* src, size_t src_ld,
                                                int row0, int T) {
  constexpr int kVecs = HD / 8;  // per row
  constexpr int kTotal = kTile * kVecs;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int idx = i * kThreads + int(threadIdx.x);
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int r = idx / kVecs;
      const int v = idx % kVecs;
      const int row = row0 + r;
      const bool valid = row < T;
      const bf16* p = valid ? src + size_t(row) * src_ld + v * 8 : src;
      cp_async_16(dst + at<pad16(HD) + 8>(r, v * 8), p, valid);
    }
  }
}

// Zeroes the padding columns [HD, HP) (one 16-byte vector a row) of `tiles` consecutive tiles
// from smem, once, before the first barrier; nothing writes them again before the epilogue.
template <int HD>
__device__ __forceinline__ void zero_padding_columns(unsigned char* smem, int tiles) {
  if constexpr (pad16(HD) != HD) {
    for (int r = int(threadIdx.x); r < tiles * kTile; r += kThreads)
      *reinterpret_cast<uint4*>(smem + at<pad16(HD) + 8>(r, HD)) = make_uint4(0, 0, 0, 0);
  }
}

// A warp's 16 x HD fp32 accumulator, rows g times mult_lo and rows g+8 times mult_hi, rounded to
// bf16 into rows [0, 16) of its own staging rows in shared memory (stage: element (0, 0)), then
// rows [0, valid_rows) copied out with 16-byte stores to dst (row stride dst_ld elements). The
// staging rows must be read by no other warp.
template <int HD, int HP = pad16(HD)>
__device__ __forceinline__ void store_warp_tile(unsigned char* stage, const float (&acc)[HP / 8][4],
                                                float mult_lo, float mult_hi, bf16* dst,
                                                size_t dst_ld, int valid_rows, int lane) {
  constexpr int LD = HP + 8;
  const int g = lane >> 2;
  const int t = lane & 3;
#pragma unroll
  for (int n = 0; n < HP / 8; ++n) {
    *reinterpret_cast<uint32_t*>(stage + at<LD>(g, n * 8 + 2 * t)) =
        pack_bf16x2(acc[n][0] * mult_lo, acc[n][1] * mult_lo);
    *reinterpret_cast<uint32_t*>(stage + at<LD>(g + 8, n * 8 + 2 * t)) =
        pack_bf16x2(acc[n][2] * mult_hi, acc[n][3] * mult_hi);
  }
  __syncwarp();
  constexpr int kVecs = HD / 8;  // the padding columns stay behind
  constexpr int kTotal = 16 * kVecs;
#pragma unroll
  for (int i = 0; i < (kTotal + 31) / 32; ++i) {  // kTotal vectors over 32 lanes
    const int idx = i * 32 + lane;
    const int r = idx / kVecs;
    const int v = idx % kVecs;
    if ((kTotal % 32 == 0 || idx < kTotal) && r < valid_rows) {
      const uint4 val = *reinterpret_cast<const uint4*>(stage + at<LD>(r, v * 8));
      __stwb(reinterpret_cast<uint4*>(dst + size_t(r) * dst_ld + v * 8), val);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The chunk pipeline. The other side streams through two buffers 64 rows at a time: before chunk
// c is computed, the next chunk's loads are issued, issue(c + 1, buffer), into the buffer chunk
// c - 1 used, and chunk c's are awaited; compute(c, buffer) runs between two barriers, the second
// keeping the buffer until every warp is done with it. Chunk 0's loads are issued by the caller
// (with whatever else it loads first) and committed.
template <class Issue, class Compute>
__device__ __forceinline__ void stream_chunks(int n_chunks, const Issue& issue, const Compute& compute) {
  for (int c = 0; c < n_chunks; ++c) {
    const int buf = c & 1;
    if (c + 1 < n_chunks) {
      issue(c + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    compute(c, buf);
    __syncthreads();
  }
}

// The keys and values of chunk c into buffer buf (the forward's and dQ's streamed side).
template <int HD, class KTile, class VTile>
__device__ __forceinline__ void load_kv_chunk(const KTile& s_k, const VTile& s_v, const bf16* k_src, const bf16* v_src,
                                              size_t ld, int c, int buf, int T) {
  load_tile_async<HD>(s_k(buf), k_src, ld, c * kTile, T);
  load_tile_async<HD>(s_v(buf), v_src, ld, c * kTile, T);
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Calls f(std::integral_constant<int, hd>) for the supported head dims.
template <typename F>
void dispatch_hd(int hd, F&& f) {
  switch (hd) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 24: f(std::integral_constant<int, 24>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 40: f(std::integral_constant<int, 40>{}); break;
    case 48: f(std::integral_constant<int, 48>{}); break;
    case 56: f(std::integral_constant<int, 56>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 72: f(std::integral_constant<int, 72>{}); break;
    case 80: f(std::integral_constant<int, 80>{}); break;
    case 88: f(std::integral_constant<int, 88>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 104: f(std::integral_constant<int, 104>{}); break;
    case 112: f(std::integral_constant<int, 112>{}); break;
    case 120: f(std::integral_constant<int, 120>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: ENSURE(false, "attention: unsupported head dim " + std::to_string(hd));
  }
}

float softmax_scale(int hd) { return 1.0f / std::sqrt(static_cast<float>(hd)); }

}  // namespace
