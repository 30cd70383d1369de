// Fused attention, FlashAttention-2 style: register-resident tiles on mma.sync (m16n8k16, bf16 in,
// fp32 accumulate), operands staged in shared memory by cp.async and read into fragments with
// ldmatrix.
//
// Every kernel runs 4 warps per block on a 64-row tile of one (image, head): 64 queries (forward,
// dQ) or 64 keys (dKdV), 16 rows per warp. The other side (keys, or queries for dKdV) streams
// through shared memory in chunks of 64 rows, double-buffered, so shared memory does not depend
// on T. A warp holds its 16-row slice of the scores (16 x 64, or 16 x kSub in the backward, see
// Tuning) in fp32 registers, and the probabilities (or dS) go back into the tensor cores as bf16
// A fragments straight from the accumulator layout. The backward is deterministic (no atomics):
// dK and dV come from one kernel over key tiles, dQ from another over query tiles, each
// recomputing the scores.
//
// Padding: staged rows at or past T are zero-filled (cp.async with source size 0), so every
// product over them is finite; padding keys get probability 0 through an explicit mask (forward,
// dQ) and padding queries through lse = +inf (dKdV). 16-row groups that lie wholly past T are not
// computed at all: a warp whose 16 rows are all padding skips its work, and the last, partial
// chunk skips its 16-column groups past T (a separate instantiation of the chunk code, so that
// full chunks run without run-time guards).
#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/attention_common.cuh"
#include "kernels/attention_resident.h"
#include "kernels/common.cuh"

namespace {
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;   // rows per block and rows per streamed chunk
constexpr int kWarps = 4;   // 16 rows each
constexpr int kThreads = kWarps * 32;
constexpr int kMaxT = 65536;  // no shared-memory bound; keeps every index comfortably in range
constexpr float kLog2e = 1.4426950408889634f;

constexpr int kDeltaThreads = 256;
constexpr int kDeltaGroup = 16;  // lanes per (token, head) row in the delta kernel

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
// 2. These kernels are latency-bound (Nsight Compute: tensor and shared-memory pipes ~30% busy),
// so warps per SM count for more than the width of a register block: up to hd 80 (padded) the
// backward runs 32-wide blocks at 168 registers, 3 blocks per SM, without spills (against
// 64-wide blocks at 255 registers, 2 blocks: dKdV 163 -> 157 us, dQ 128 -> 120 us at
// (64, 16, 197, 80), and faster at hd 64 too; BENCHMARKS.md, 17). Above hd 80 shared memory
// allows 2 blocks only; hd 96 (and 88, padded to it) runs 32-wide there too, tested but not
// timed against its earlier 64-wide blocks; at hd 128 dKdV's 16 x hd dK + dV leave room for
// 16-wide blocks only. The forward at 128 registers (4 blocks) spills and is slower. Building with -DATT_SWEEP and the ATT_* values below makes
// one variant of a sweep (tools/attention_sweep.sh).
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
// Forward. Grid (ceil(T/64), H, B). Warp w owns queries q0 + 16w .. q0 + 16w + 15: Q fragments in
// registers, the running max m (of the unscaled scores), the running sum l (this lane's columns
// only; the quad's partial sums are added at the end) and O, all per row, for rows g and g+8.
template <int HD>
__global__ void __launch_bounds__(kThreads, Tuning<HD>::kFwdMinBlocks)
    attention_forward_kernel(const bf16* __restrict__ qkv, bf16* __restrict__ out,
                             float* __restrict__ lse, int T, int H, float scale) {
  constexpr int HP = pad16(HD);  // the fragments' head dim
  constexpr int LD = HP + 8;
  constexpr int kTileBytes = tile_bytes(HD);
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = smem_addr(smem);
  const auto s_k = [&](int buf) { return s_q + uint32_t((1 + 2 * buf) * kTileBytes); };
  const auto s_v = [&](int buf) { return s_q + uint32_t((2 + 2 * buf) * kTileBytes); };

  const int q0 = blockIdx.x * kTile;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;  // token 0 of this (image, head)
  const bf16* k_src = q_src + D;
  const bf16* v_src = q_src + 2 * D;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int t = lane & 3;
  const int w_row0 = q0 + warp * 16;  // first query of this warp
  const bool live = w_row0 < T;       // warp-uniform
  const uint32_t off_a = lane_offset_a<LD>(lane);
  const uint32_t off_bt = lane_offset_bt<LD>(lane);
  const float scale_log2 = scale * kLog2e;
  const int n_chunks = (T + kTile - 1) / kTile;

  load_tile_async<HD>(s_q, q_src, qkv_ld, q0, T);
  load_tile_async<HD>(s_k(0), k_src, qkv_ld, 0, T);
  load_tile_async<HD>(s_v(0), v_src, qkv_ld, 0, T);
  cp_async_commit();
  zero_padding_columns<HD>(smem, 5);

  uint32_t qf[HP / 16][4];  // A fragments of the warp's 16 x HD query block
  float o[HP / 8][4];       // O accumulator, n-tiles of 8 columns
#pragma unroll
  for (int n = 0; n < HP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY;  // rows g, g+8
  float l_lo = 0.0f, l_hi = 0.0f;

  // One chunk of 64 keys (staged in buffer buf), kv_valid of them real. kFull: all 64 are, so
  // no group is skipped and nothing is masked; the other instantiation runs only for the last,
  // partial chunk, so the common path has no run-time guards between its matrix products.
  const auto chunk = [&](int buf, int kv_valid, auto full) {
    constexpr bool kFull = decltype(full)::value;
    const int groups = kFull ? 4 : (kv_valid + 15) / 16;  // 16-key groups with any real key

    // S = Q K^T (unscaled), 16 x 64: n-tile n holds keys 8n..8n+7 of the chunk. B fragments
    // from K stored [key][hd] = B^T.
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    const auto q_frag = [&](int kk, uint32_t(&a)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = qf[kk][e];
    };
    mma_rows_bt<HP, 4, kFull>(s, q_frag, s_k, buf, 0, groups, off_bt);
    if (!kFull) {  // keys at or past T (skipped groups included) get score -inf: probability 0
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int col = n * 8 + 2 * t;
        if (col >= kv_valid) s[n][0] = s[n][2] = -INFINITY;
        if (col + 1 >= kv_valid) s[n][1] = s[n][3] = -INFINITY;
      }
    }

    // Online softmax. Every chunk has a real key, so the new maxima are finite; the correction
    // of the first chunk is exp2(-inf) = 0, against O = l = 0.
    float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
    }
    mx_lo = quad_max(mx_lo);
    mx_hi = quad_max(mx_hi);
    const float corr_lo = exp2_approx((m_lo - mx_lo) * scale_log2);
    const float corr_hi = exp2_approx((m_hi - mx_hi) * scale_log2);
    m_lo = mx_lo;
    m_hi = mx_hi;
    const float neg_lo = -mx_lo * scale_log2;
    const float neg_hi = -mx_hi * scale_log2;
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      s[n][0] = exp2_approx(fmaf(s[n][0], scale_log2, neg_lo));
      s[n][1] = exp2_approx(fmaf(s[n][1], scale_log2, neg_lo));
      s[n][2] = exp2_approx(fmaf(s[n][2], scale_log2, neg_hi));
      s[n][3] = exp2_approx(fmaf(s[n][3], scale_log2, neg_hi));
      sum_lo += s[n][0] + s[n][1];
      sum_hi += s[n][2] + s[n][3];
    }
    l_lo = fmaf(l_lo, corr_lo, sum_lo);
    l_hi = fmaf(l_hi, corr_hi, sum_hi);
#pragma unroll
    for (int n = 0; n < HP / 8; ++n) {
      o[n][0] *= corr_lo;
      o[n][1] *= corr_lo;
      o[n][2] *= corr_hi;
      o[n][3] *= corr_hi;
    }

    // O += P V: P's 16-key groups as A fragments from the registers, V (stored [key][hd] =
    // B[k][n]) through ldmatrix .trans, two 8-column n-tiles of O per load.
    mma_acc_b<HP, 4, kFull>(o, s, s_v, buf, 0, groups, off_a);
  };

  for (int c = 0; c < n_chunks; ++c) {
    const int buf = c & 1;
    if (c + 1 < n_chunks) {  // prefetch the next chunk into the buffer freed at the end of c-1
      load_tile_async<HD>(s_k(buf ^ 1), k_src, qkv_ld, (c + 1) * kTile, T);
      load_tile_async<HD>(s_v(buf ^ 1), v_src, qkv_ld, (c + 1) * kTile, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (live) {
      if (c == 0) {
#pragma unroll
        for (int kk = 0; kk < HP / 16; ++kk)
          ldmatrix_x4(qf[kk], s_q + at<LD>(warp * 16, kk * 16) + off_a);
      }
      const int kv_valid = min(kTile, T - c * kTile);  // keys of this chunk that exist, >= 1
      if (kv_valid == kTile)
        chunk(buf, kv_valid, std::true_type{});
      else
        chunk(buf, kv_valid, std::false_type{});
    }
    __syncthreads();  // the buffer of chunk c is overwritten by the prefetch of iteration c+1
  }

  if (live) {
    l_lo = quad_sum(l_lo);
    l_hi = quad_sum(l_hi);
    const int g = lane >> 2;
    float* lse_bh = lse + (size_t(b) * H + h) * T;
    if (t == 0) {
      if (w_row0 + g < T) lse_bh[w_row0 + g] = m_lo * scale + logf(l_lo);
      if (w_row0 + g + 8 < T) lse_bh[w_row0 + g + 8] = m_hi * scale + logf(l_hi);
    }
    // Stage through the warp's own Q rows (their fragments are in registers already).
    store_warp_tile<HD>(smem + at<LD>(warp * 16, 0), o, 1.0f / l_lo, 1.0f / l_hi,
                        out + (size_t(b) * T + w_row0) * D + h * HD, size_t(D),
                        min(16, T - w_row0), lane);
  }
}

// delta[b, h, t] = sum_c dout[b*T + t, h*hd + c] * out[b*T + t, h*hd + c]. A group of 16 lanes per
// (token, head), one 8-element vector each (hd <= 128), then a shuffle reduction that stays inside
// the group (xor offsets below 16). No early exit: every lane of the warp joins the shuffles.
__device__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__global__ void __launch_bounds__(kDeltaThreads)
    attention_delta_kernel(const bf16* __restrict__ out, const bf16* __restrict__ dout,
                           float* __restrict__ delta, int T, int H, int hd, long long pairs) {
  const long long pair = static_cast<long long>(blockIdx.x) * (kDeltaThreads / kDeltaGroup) +
                         threadIdx.x / kDeltaGroup;
  const int g = threadIdx.x % kDeltaGroup;
  const long long row = pair / H;  // b * T + t
  const int h = static_cast<int>(pair % H);
  float acc = 0.0f;
  if (pair < pairs && g < hd / 8) {
    const size_t idx = size_t(row) * H * hd + size_t(h) * hd + g * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(out + idx);
    const uint4 d = *reinterpret_cast<const uint4*>(dout + idx);
    for (const uint2 w : {uint2{o.x, d.x}, uint2{o.y, d.y}, uint2{o.z, d.z}, uint2{o.w, d.w}}) {
      acc = fmaf(bf16_lo(w.x), bf16_lo(w.y), acc);
      acc = fmaf(bf16_hi(w.x), bf16_hi(w.y), acc);
    }
  }
  for (int off = kDeltaGroup / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (pair < pairs && g == 0) {
    const long long b = row / T;
    const int t = static_cast<int>(row % T);
    delta[(b * H + h) * T + t] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// dK, dV. Grid (ceil(T/64), H, B): one 64-key tile against all queries, streamed in chunks of 64.
// Transposed orientation (rows = keys, columns = queries), so that P^T and dS^T come out of the
// accumulators as A fragments for dV = P^T dO and dK = dS^T Q. Warp w owns keys k0 + 16w .. +15
// and accumulates dK, dV (16 x HD fp32 each) in registers.
template <int HD>
__global__ void __launch_bounds__(kThreads, Tuning<HD>::kDkdvMinBlocks)
    attention_dkdv_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ dout,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          bf16* __restrict__ dqkv, int T, int H, float scale) {
  constexpr int HP = pad16(HD);  // the fragments' head dim
  constexpr int LD = HP + 8;
  constexpr int kTileBytes = tile_bytes(HD);
  constexpr int kSub = Tuning<HD>::kDkdvSub;  // queries per register block
  constexpr int kGroups = kSub / 16;
  constexpr int kN = kSub / 8;  // n-tiles of S^T, dP^T
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_k = smem_addr(smem);
  const uint32_t s_v = s_k + kTileBytes;
  const auto s_q = [&](int buf) { return s_k + uint32_t((2 + 2 * buf) * kTileBytes); };
  const auto s_do = [&](int buf) { return s_k + uint32_t((3 + 2 * buf) * kTileBytes); };
  float* lse_s = reinterpret_cast<float*>(smem + 6 * kTileBytes);  // [2][64], natural-log lse
  float* delta_s = lse_s + 2 * kTile;                              // [2][64]

  const int k0 = blockIdx.x * kTile;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;
  const bf16* do_src = dout + size_t(b) * T * D + h * HD;
  const float* lse_bh = lse + (size_t(b) * H + h) * T;
  const float* delta_bh = delta + (size_t(b) * H + h) * T;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int t = lane & 3;
  const int w_row0 = k0 + warp * 16;  // first key of this warp
  const bool live = w_row0 < T;
  const uint32_t off_a = lane_offset_a<LD>(lane);
  const uint32_t off_bt = lane_offset_bt<LD>(lane);
  const float scale_log2 = scale * kLog2e;
  const int n_chunks = (T + kTile - 1) / kTile;

  // Chunk c of the queries: Q and dO rows (zero past T), lse (+inf past T, so that P^T = 0
  // there) and delta (0 past T). Warps 0-1 stage lse, warps 2-3 delta.
  const auto load_chunk = [&](int c, int buf) {
    load_tile_async<HD>(s_q(buf), q_src, qkv_ld, c * kTile, T);
    load_tile_async<HD>(s_do(buf), do_src, size_t(D), c * kTile, T);
    const int j = threadIdx.x % kTile;
    const int q = c * kTile + j;
    const bool is_lse = threadIdx.x < kTile;
    float* dst = (is_lse ? lse_s : delta_s) + buf * kTile + j;
    if (q < T)
      cp_async_4(smem_addr(dst), (is_lse ? lse_bh : delta_bh) + q);
    else
      *dst = is_lse ? INFINITY : 0.0f;
  };

  load_tile_async<HD>(s_k, q_src + D, qkv_ld, k0, T);
  load_tile_async<HD>(s_v, q_src + 2 * D, qkv_ld, k0, T);
  load_chunk(0, 0);
  cp_async_commit();
  zero_padding_columns<HD>(smem, 6);

  float dk[HP / 8][4], dv[HP / 8][4];
#pragma unroll
  for (int n = 0; n < HP / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  // One register block: queries [c0, c0 + kSub) of the chunk in buffer buf, groups of its 16-query
  // groups holding any real query. kFull: the whole chunk is real (no guards between products);
  // the other instantiation runs only for the last, partial chunk.
  const auto sub_block = [&](int buf, int c0, int groups, auto full) {
    constexpr bool kFull = decltype(full)::value;
    const float* lse_c = lse_s + buf * kTile + c0;
    const float* delta_c = delta_s + buf * kTile + c0;

    // S^T = K Q^T (unscaled), 16 keys x kSub queries: A = K rows, B from Q stored
    // [query][hd] (= B^T).
    float s[kN][4];
#pragma unroll
    for (int n = 0; n < kN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    const auto k_frag = [&](int kk, uint32_t(&a)[4]) { ldmatrix_x4(a, s_k + at<LD>(warp * 16, kk * 16) + off_a); };
    mma_rows_bt<HP, kGroups, kFull>(s, k_frag, s_q, buf, c0, groups, off_bt);

    // P^T = exp(scale S^T - lse[query]); columns 2t, 2t+1 of n-tile n are queries
    // c0 + 8n + 2t, +1. Padding queries have lse = +inf, hence P^T = 0 (and skipped groups
    // hold S^T = 0, so they too give 0).
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float2 l2 = *reinterpret_cast<const float2*>(lse_c + n * 8 + 2 * t);
      const float nl0 = -l2.x * kLog2e;
      const float nl1 = -l2.y * kLog2e;
      s[n][0] = exp2_approx(fmaf(s[n][0], scale_log2, nl0));
      s[n][1] = exp2_approx(fmaf(s[n][1], scale_log2, nl1));
      s[n][2] = exp2_approx(fmaf(s[n][2], scale_log2, nl0));
      s[n][3] = exp2_approx(fmaf(s[n][3], scale_log2, nl1));
    }

    // dV += P^T dO: B from dO stored [query][hd] = B[k][n], through .trans.
    mma_acc_b<HP, kGroups, kFull>(dv, s, s_do, buf, c0, groups, off_a);

    // dP^T = V dO^T: A = V rows, B from dO stored [query][hd] = B^T.
    float dp[kN][4];
#pragma unroll
    for (int n = 0; n < kN; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
    const auto v_frag = [&](int kk, uint32_t(&a)[4]) { ldmatrix_x4(a, s_v + at<LD>(warp * 16, kk * 16) + off_a); };
    mma_rows_bt<HP, kGroups, kFull>(dp, v_frag, s_do, buf, c0, groups, off_bt);

    // dS^T = P^T * (dP^T - delta[query]), in place over dP^T. Zero wherever P^T is (dP^T is
    // finite: padding rows of V and dO are zero).
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float2 d2 = *reinterpret_cast<const float2*>(delta_c + n * 8 + 2 * t);
      dp[n][0] = s[n][0] * (dp[n][0] - d2.x);
      dp[n][1] = s[n][1] * (dp[n][1] - d2.y);
      dp[n][2] = s[n][2] * (dp[n][2] - d2.x);
      dp[n][3] = s[n][3] * (dp[n][3] - d2.y);
    }

    // dK += dS^T Q: B from Q stored [query][hd] = B[k][n], through .trans.
    mma_acc_b<HP, kGroups, kFull>(dk, dp, s_q, buf, c0, groups, off_a);
  };

  for (int c = 0; c < n_chunks; ++c) {
    const int buf = c & 1;
    if (c + 1 < n_chunks) {
      load_chunk(c + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (live) {
      const int q_valid = min(kTile, T - c * kTile);  // real queries in this chunk, >= 1
      if (q_valid == kTile) {
#pragma unroll 1  // one register block at a time: overlapping two spills at hd >= 112
        for (int sb = 0; sb < kTile / kSub; ++sb)
          sub_block(buf, sb * kSub, kGroups, std::true_type{});
      } else {
        for (int c0 = 0; c0 < q_valid; c0 += kSub)
          sub_block(buf, c0, min(kGroups, (q_valid - c0 + 15) / 16), std::false_type{});
      }
    }
    __syncthreads();
  }

  if (live) {
    // dK = scale * dS^T Q, dV as is; staged through the warp's own K and V rows.
    bf16* dk_dst = dqkv + (size_t(b) * T + w_row0) * qkv_ld + D + h * HD;
    const int rows = min(16, T - w_row0);
    store_warp_tile<HD>(smem + at<LD>(warp * 16, 0), dk, scale, scale, dk_dst, qkv_ld, rows, lane);
    store_warp_tile<HD>(smem + kTileBytes + at<LD>(warp * 16, 0), dv, 1.0f, 1.0f, dk_dst + D,
                        qkv_ld, rows, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// dQ. Grid (ceil(T/64), H, B): one 64-query tile against all keys, streamed in chunks of 64.
// Warp w owns queries q0 + 16w .. +15: Q and dO fragments in registers, lse and delta per row,
// dQ (16 x HD fp32) accumulated in registers.
template <int HD>
__global__ void __launch_bounds__(kThreads, Tuning<HD>::kDqMinBlocks)
    attention_dq_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        bf16* __restrict__ dqkv, int T, int H, float scale) {
  constexpr int HP = pad16(HD);  // the fragments' head dim
  constexpr int LD = HP + 8;
  constexpr int kTileBytes = tile_bytes(HD);
  constexpr int kSub = Tuning<HD>::kDqSub;  // keys per register block
  constexpr int kGroups = kSub / 16;
  constexpr int kN = kSub / 8;  // n-tiles of S, dP
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = smem_addr(smem);
  const uint32_t s_do = s_q + kTileBytes;
  const auto s_k = [&](int buf) { return s_q + uint32_t((2 + 2 * buf) * kTileBytes); };
  const auto s_v = [&](int buf) { return s_q + uint32_t((3 + 2 * buf) * kTileBytes); };

  const int q0 = blockIdx.x * kTile;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;
  const bf16* k_src = q_src + D;
  const bf16* v_src = q_src + 2 * D;
  const bf16* do_src = dout + size_t(b) * T * D + h * HD;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int w_row0 = q0 + warp * 16;
  const bool live = w_row0 < T;
  const uint32_t off_a = lane_offset_a<LD>(lane);
  const uint32_t off_bt = lane_offset_bt<LD>(lane);
  const float scale_log2 = scale * kLog2e;
  const int n_chunks = (T + kTile - 1) / kTile;

  load_tile_async<HD>(s_q, q_src, qkv_ld, q0, T);
  load_tile_async<HD>(s_do, do_src, size_t(D), q0, T);
  load_tile_async<HD>(s_k(0), k_src, qkv_ld, 0, T);
  load_tile_async<HD>(s_v(0), v_src, qkv_ld, 0, T);
  cp_async_commit();
  zero_padding_columns<HD>(smem, 6);

  // Rows g and g+8 of the warp: -lse * log2(e) and delta; padding rows get 0 for both (their Q
  // and dO are zero, so everything stays finite, and they are never written).
  const size_t bh = (size_t(b) * H + h) * T;
  const int row_lo = w_row0 + g;
  const int row_hi = w_row0 + g + 8;
  const float nlse_lo = row_lo < T ? -lse[bh + row_lo] * kLog2e : 0.0f;
  const float nlse_hi = row_hi < T ? -lse[bh + row_hi] * kLog2e : 0.0f;
  const float delta_lo = row_lo < T ? delta[bh + row_lo] : 0.0f;
  const float delta_hi = row_hi < T ? delta[bh + row_hi] : 0.0f;

  uint32_t qf[HP / 16][4], dof[HP / 16][4];
  float dq[HP / 8][4];
#pragma unroll
  for (int n = 0; n < HP / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  // One register block: keys [c0, c0 + kSub) of the chunk in buffer buf, sub_valid of them real
  // (may exceed kSub), groups of its 16-key groups holding any real key. kFull: the whole chunk is
  // real (no guards between products, no mask); the other instantiation runs only for the last,
  // partial chunk.
  const auto sub_block = [&](int buf, int c0, int sub_valid, int groups, auto full) {
    constexpr bool kFull = decltype(full)::value;

    // S = Q K^T and dP = dO V^T (16 queries x kSub keys), B from K and V stored
    // [key][hd] (= B^T).
    float s[kN][4], dp[kN][4];
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
    const auto q_frag = [&](int kk, uint32_t(&a)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = qf[kk][e];
    };
    const auto do_frag = [&](int kk, uint32_t(&a)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = dof[kk][e];
    };
    mma_rows_bt<HP, kGroups, kFull>(s, q_frag, s_k, buf, c0, groups, off_bt);
    mma_rows_bt<HP, kGroups, kFull>(dp, do_frag, s_v, buf, c0, groups, off_bt);

    // P = exp(scale S - lse[row]), 0 for keys at or past T (columns 2t, 2t+1 of n-tile n
    // are keys c0 + 8n + 2t, +1); dS = P * (dP - delta[row]), in place over dP.
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const int col = n * 8 + 2 * t;
      float p0 = exp2_approx(fmaf(s[n][0], scale_log2, nlse_lo));
      float p1 = exp2_approx(fmaf(s[n][1], scale_log2, nlse_lo));
      float p2 = exp2_approx(fmaf(s[n][2], scale_log2, nlse_hi));
      float p3 = exp2_approx(fmaf(s[n][3], scale_log2, nlse_hi));
      if (!kFull) {
        if (col >= sub_valid) p0 = p2 = 0.0f;
        if (col + 1 >= sub_valid) p1 = p3 = 0.0f;
      }
      dp[n][0] = p0 * (dp[n][0] - delta_lo);
      dp[n][1] = p1 * (dp[n][1] - delta_lo);
      dp[n][2] = p2 * (dp[n][2] - delta_hi);
      dp[n][3] = p3 * (dp[n][3] - delta_hi);
    }

    // dQ += dS K: B from K stored [key][hd] = B[k][n], through .trans.
    mma_acc_b<HP, kGroups, kFull>(dq, dp, s_k, buf, c0, groups, off_a);
  };

  for (int c = 0; c < n_chunks; ++c) {
    const int buf = c & 1;
    if (c + 1 < n_chunks) {
      load_tile_async<HD>(s_k(buf ^ 1), k_src, qkv_ld, (c + 1) * kTile, T);
      load_tile_async<HD>(s_v(buf ^ 1), v_src, qkv_ld, (c + 1) * kTile, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (live) {
      if (c == 0) {
#pragma unroll
        for (int kk = 0; kk < HP / 16; ++kk) {
          ldmatrix_x4(qf[kk], s_q + at<LD>(warp * 16, kk * 16) + off_a);
          ldmatrix_x4(dof[kk], s_do + at<LD>(warp * 16, kk * 16) + off_a);
        }
      }
      const int kv_valid = min(kTile, T - c * kTile);  // real keys in this chunk, >= 1
      if (kv_valid == kTile) {
#pragma unroll 1  // one register block at a time: overlapping two spills at hd >= 112
        for (int sb = 0; sb < kTile / kSub; ++sb)
          sub_block(buf, sb * kSub, kSub, kGroups, std::true_type{});
      } else {
        for (int c0 = 0; c0 < kv_valid; c0 += kSub)
          sub_block(buf, c0, kv_valid - c0, min(kGroups, (kv_valid - c0 + 15) / 16),
                    std::false_type{});
      }
    }
    __syncthreads();
  }

  if (live) {
    // dQ = scale * dS K, staged through the warp's own Q rows.
    store_warp_tile<HD>(smem + at<LD>(warp * 16, 0), dq, scale, scale,
                        dqkv + (size_t(b) * T + w_row0) * qkv_ld + h * HD, qkv_ld,
                        min(16, T - w_row0), lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Single-pass backward for short sequences (T <= 96, hd 16/32/64/80). Grid (H, B), one block
// of ceil(T/16) warps per (image, head) with all of K, V, Q and dO in shared memory. Phase 1: warp
// w owns keys 16w..16w+15 (dK and dV accumulated in registers) and walks the queries two 16-query
// groups at a time as the dKdV kernel does (S^T, P^T, dV, dP^T, dS^T, dK), writing dS^T (bf16)
// into shared memory. Phase 2: warp w owns queries 16w..16w+15 and computes dQ = dS K from
// shared memory. Five products where the two-kernel path needs seven, delta = rowsum(dO * O)
// computed in the block (no delta kernel), every input read once. Padding keys get P^T = 0
// explicitly (their dS feeds dQ), padding queries through lse = +inf. Measured against the
// streamed kernels (BENCHMARKS.md, 21): the backward 25-46% faster at T 50-96 (hd 32, 64, 80);
// a version for T <= 208 (thirteen warps at 128 registers, one block an SM) was 27% slower at
// ViT-H's 197, hence the bound.
constexpr int kSingleMaxT = 96;
constexpr int kSingleMaxWarps = kSingleMaxT / 16;
constexpr int kSingleThreads = kSingleMaxWarps * 32;
// Two blocks an SM (168 registers; K, V, Q, dO and dS^T take at most 88 KB a block at hd 80) and
// two 16-query groups a step: measured faster than one block an SM or one group a step
// (BENCHMARKS.md, 21).
constexpr int kSingleMinBlocks = 2;

__host__ __device__ constexpr bool single_pass_hd(int hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 80; }
// K, V, Q, dO tiles of `rows` padded rows, dS^T (rows x rows, row stride rows + 8), lse and delta.
__host__ __device__ constexpr int single_pass_smem_bytes(int hd, int rows) {
  return 4 * rows * row_stride(hd) * 2 + rows * (rows + 8) * 2 + 2 * rows * 4;
}

// cp.async rows [r0, r1) of a [T, HD] slice (row stride src_ld) into a tile of row stride
// pad16(HD) + 8 at dst (row 0's address), over the whole block; rows at or past T are zero-filled.
template <int HD>
__device__ __forceinline__ void load_rows_async(uint32_t dst, const bf16* src, size_t src_ld, int r0, int r1, int T) {
  constexpr int kVecs = HD / 8;
  for (int idx = int(threadIdx.x); idx < (r1 - r0) * kVecs; idx += int(blockDim.x)) {
    const int r = r0 + idx / kVecs, v = idx % kVecs;
    const bool valid = r < T;
    cp_async_16(dst + at<pad16(HD) + 8>(r, v * 8), valid ? src + size_t(r) * src_ld + v * 8 : src, valid);
  }
}

template <int HD>
__global__ void __launch_bounds__(kSingleThreads, kSingleMinBlocks)
    attention_backward_single_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ out,
                                     const bf16* __restrict__ dout, const float* __restrict__ lse,
                                     bf16* __restrict__ dqkv, int T, int H, float scale) {
  static_assert(pad16(HD) == HD, "no padding columns here");
  constexpr int LD = HD + 8;
  constexpr int kTileRowBytes = LD * 2;
  const int groups = int(blockDim.x) / 32;  // 16-row groups of keys, and of queries
  const int R = groups * 16;
  const int LDS = R + 8;                    // dS^T's row stride (elements)
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t tile = uint32_t(R * kTileRowBytes);  // [K | V | Q | dO | dS^T | lse | delta]
  const uint32_t q_off = 2 * tile, do_off = 3 * tile;
  const uint32_t s_k = smem_addr(smem), s_v = s_k + tile, s_q = s_k + q_off, s_do = s_k + do_off, s_ds = s_k + 4 * tile;
  float* lse_s = reinterpret_cast<float*>(smem + 4 * tile + R * LDS * 2);
  float* delta_s = lse_s + R;

  const int h = blockIdx.x, b = blockIdx.y;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;
  const bf16* do_src = dout + size_t(b) * T * D + h * HD;
  const bf16* o_src = out + size_t(b) * T * D + h * HD;
  const float* lse_bh = lse + (size_t(b) * H + h) * T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int row0 = warp * 16;  // this warp's keys in phase 1, its queries in phase 2 and delta

  // Two groups: K, V and the first kFirstQueries queries' Q and dO, then the rest, which arrives
  // while phase 1 works on the first ones.
  constexpr int kFirstQueries = 64;
  const int first = min(R, kFirstQueries);
  load_rows_async<HD>(s_k, q_src + D, qkv_ld, 0, R, T);
  load_rows_async<HD>(s_v, q_src + 2 * D, qkv_ld, 0, R, T);
  load_rows_async<HD>(s_q, q_src, qkv_ld, 0, first, T);
  load_rows_async<HD>(s_do, do_src, size_t(D), 0, first, T);
  cp_async_commit();
  load_rows_async<HD>(s_q, q_src, qkv_ld, first, R, T);
  load_rows_async<HD>(s_do, do_src, size_t(D), first, R, T);
  cp_async_commit();
  for (int j = int(threadIdx.x); j < R; j += int(blockDim.x)) lse_s[j] = j < T ? lse_bh[j] : INFINITY;
  // delta for this warp's 16 queries: two lanes a row, each over half its 8-element vectors
  // (all loads issued before any sum), then the pair's sum.
  {
    constexpr int kHalf = HD / 16;  // vectors per lane
    const int q = row0 + lane / 2;
    float acc = 0.0f;
    if (q < T) {
      const bf16* o_row = o_src + size_t(q) * D + (lane & 1) * kHalf * 8;
      const bf16* d_row = do_src + size_t(q) * D + (lane & 1) * kHalf * 8;
      uint4 o[kHalf], d[kHalf];
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        o[i] = *reinterpret_cast<const uint4*>(o_row + i * 8);
        d[i] = *reinterpret_cast<const uint4*>(d_row + i * 8);
      }
#pragma unroll
      for (int i = 0; i < kHalf; ++i)
        for (const uint2 w : {uint2{o[i].x, d[i].x}, uint2{o[i].y, d[i].y}, uint2{o[i].z, d[i].z}, uint2{o[i].w, d[i].w}}) {
          acc = fmaf(bf16_lo(w.x), bf16_lo(w.y), acc);
          acc = fmaf(bf16_hi(w.x), bf16_hi(w.y), acc);
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if ((lane & 1) == 0) delta_s[q] = acc;  // 0 past T
  }
  cp_async_wait<1>();
  __syncthreads();

  // Phase 1: this warp's keys against every 16-query group.
  const uint32_t off_a = lane_offset_a<LD>(lane), off_bt = lane_offset_bt<LD>(lane);
  const float scale_log2 = scale * kLog2e;
  const bool lo_key = row0 + g < T, hi_key = row0 + g + 8 < T;
  const auto tile_q = [&](int) { return s_q; };
  const auto tile_do = [&](int) { return s_do; };
  const auto k_frag = [&](int kk, uint32_t(&a)[4]) { ldmatrix_x4(a, s_k + at<LD>(row0, kk * 16) + off_a); };
  const auto v_frag = [&](int kk, uint32_t(&a)[4]) { ldmatrix_x4(a, s_v + at<LD>(row0, kk * 16) + off_a); };
  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  // Two 16-query groups a step (one in the last step when the group count is odd): two
  // independent product chains per warp.
  constexpr int kStep = 2;
  const auto step = [&](int q0, int step_groups, auto full) {
    constexpr bool kFull = decltype(full)::value;
    float s[2 * kStep][4] = {};
    mma_rows_bt<HD, kStep, kFull>(s, k_frag, tile_q, 0, q0, step_groups, off_bt);
    // P^T = exp(scale S^T - lse[query]); columns 2t, 2t+1 of n-tile n are queries q0 + 8n + 2t, +1.
#pragma unroll
    for (int n = 0; n < 2 * kStep; ++n) {
      if (!kFull && n >= 2 * step_groups) break;  // past R: nothing of lse to read
      const float2 l2 = *reinterpret_cast<const float2*>(lse_s + q0 + n * 8 + 2 * t);
      const float nl0 = -l2.x * kLog2e, nl1 = -l2.y * kLog2e;
      s[n][0] = lo_key ? exp2_approx(fmaf(s[n][0], scale_log2, nl0)) : 0.0f;
      s[n][1] = lo_key ? exp2_approx(fmaf(s[n][1], scale_log2, nl1)) : 0.0f;
      s[n][2] = hi_key ? exp2_approx(fmaf(s[n][2], scale_log2, nl0)) : 0.0f;
      s[n][3] = hi_key ? exp2_approx(fmaf(s[n][3], scale_log2, nl1)) : 0.0f;
    }
    mma_acc_b<HD, kStep, kFull>(dv, s, tile_do, 0, q0, step_groups, off_a);  // dV += P^T dO
    float dp[2 * kStep][4] = {};
    mma_rows_bt<HD, kStep, kFull>(dp, v_frag, tile_do, 0, q0, step_groups, off_bt);  // dP^T = V dO^T
#pragma unroll
    for (int n = 0; n < 2 * kStep; ++n) {  // dS^T = P^T (dP^T - delta[query]), into shared memory
      if (kFull || n < 2 * step_groups) {
        const float2 d2 = *reinterpret_cast<const float2*>(delta_s + q0 + n * 8 + 2 * t);
        dp[n][0] = s[n][0] * (dp[n][0] - d2.x);
        dp[n][1] = s[n][1] * (dp[n][1] - d2.y);
        dp[n][2] = s[n][2] * (dp[n][2] - d2.x);
        dp[n][3] = s[n][3] * (dp[n][3] - d2.y);
        const uint32_t at_lo = s_ds + uint32_t(((row0 + g) * LDS + q0 + n * 8 + 2 * t) * 2);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at_lo), "r"(pack_bf16x2(dp[n][0], dp[n][1])) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at_lo + uint32_t(8 * LDS * 2)),
                     "r"(pack_bf16x2(dp[n][2], dp[n][3]))
                     : "memory");
      }
    }
    mma_acc_b<HD, kStep, kFull>(dk, dp, tile_q, 0, q0, step_groups, off_a);  // dK += dS^T Q
  };
  constexpr int kStepRows = 16 * kStep;
  static_assert(kFirstQueries % kStepRows == 0, "the second load group starts at a step");
  const auto steps = [&](int from, int to) {  // query rows [from, to); only the last step may be partial
#pragma unroll 1
    for (int q0 = from; q0 < to; q0 += kStepRows) {
      if (kStep == 1 || q0 + kStepRows <= R)
        step(q0, kStep, std::true_type{});
      else if constexpr (kStep > 1)
        step(q0, (R - q0) / 16, std::false_type{});
    }
  };
  steps(0, first);
  if (first < R) {  // the rest of Q and dO (block-uniform)
    cp_async_wait<0>();
    __syncthreads();
    steps(first, R);
  }
  __syncthreads();  // dS^T complete; Q and dO free for staging

  const int rows = min(16, T - row0);
  bf16* dk_dst = dqkv + (size_t(b) * T + row0) * qkv_ld + D + h * HD;
  store_warp_tile<HD>(smem + q_off + at<LD>(row0, 0), dk, scale, scale, dk_dst, qkv_ld, rows, lane);
  store_warp_tile<HD>(smem + do_off + at<LD>(row0, 0), dv, 1.0f, 1.0f, dk_dst + D, qkv_ld, rows, lane);

  // Phase 2: dQ (this warp's 16 queries) = dS K over every 16-key group. dS's A fragment comes
  // from dS^T [key][query] through .trans (matrices keys 0-7/8-15 x queries 0-7/8-15 in the
  // order lane_offset_bt gives), K [key][hd] = B[k][n] through .trans as in mma_acc_b.
  float dq[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  const uint32_t off_ds = uint32_t((((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8) * 2);
#pragma unroll 1
  for (int k0 = 0; k0 < R; k0 += 16) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, s_ds + uint32_t((k0 * LDS + row0) * 2) + off_ds);
#pragma unroll
    for (int nn = 0; nn < HD / 16; ++nn) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, s_k + at<LD>(k0, nn * 16) + off_a);
      mma_bf16(dq[2 * nn], a, bf[0], bf[1]);
      mma_bf16(dq[2 * nn + 1], a, bf[2], bf[3]);
    }
  }
  __syncwarp();  // the dK staging reads are done before the rows are reused
  store_warp_tile<HD>(smem + q_off + at<LD>(row0, 0), dq, scale, scale,
                      dqkv + (size_t(b) * T + row0) * qkv_ld + h * HD, qkv_ld, rows, lane);
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

// Preconditions common to both launchers; returns the current device.
int require_shape(const char* who, int B, int T, int H, int hd) {
  const std::string reason = attention_unsupported_reason(T, hd);
  ENSURE(reason.empty(), std::string(who) + ": " + reason);
  ENSURE(B >= 1 && H >= 1, std::string(who) + ": B and H must be positive");
  ENSURE(H <= 65535 && B <= 65535, std::string(who) + ": H and B must be at most 65535 (grid)");
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}
}  // namespace

std::string attention_unsupported_reason(int T, int hd) {
  if (hd < 8 || hd > 128 || hd % 8 != 0)
    return "attention head dim " + std::to_string(hd) +
           " unsupported (needs a multiple of 8 in [8, 128])";
  if (T < 1 || T > kMaxT)
    return "attention sequence length " + std::to_string(T) + " unsupported (needs 1 <= T <= " +
           std::to_string(kMaxT) + ")";
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const DeviceInfo info = device_info(dev);
  if (info.major != 9 || info.minor != 0)
    return "attention kernels are built for sm_90a only; device " + std::to_string(dev) +
           " is sm_" + std::to_string(info.major) + std::to_string(info.minor);
  // Shared memory does not depend on T (keys or queries stream through in chunks).
  const int need =
      std::max(forward_smem_bytes(hd), std::max(dkdv_smem_bytes(hd), dq_smem_bytes(hd)));
  if (need > info.smem_optin)
    return "attention with hd=" + std::to_string(hd) + " needs " + std::to_string(need) +
           " bytes of shared memory per block; the device allows " +
           std::to_string(info.smem_optin);
  return {};
}

namespace {
// The single pass's own bounds, for a shape the streamed kernels support on device dev.
bool single_pass_fits(int T, int hd, int dev) {
  return single_pass_hd(hd) && T <= kSingleMaxT &&
         single_pass_smem_bytes(hd, (T + 15) / 16 * 16) <= device_info(dev).smem_optin;
}

// The kernel a call runs, for a shape the streamed kernels support on device dev: the one asked
// for (refused where it does not apply), or Auto's choice (the fastest that applies, as measured:
// BENCHMARKS.md 21, 24, 25, 27, 28).
AttentionForward resolve_forward(AttentionForward kind, int T, int hd, int dev) {
  ENSURE(kind != AttentionForward::Resident || attention_forward_resident_fits(T, hd, dev),
         "attention_forward: the resident kernel takes hd 64 (T <= 832), 80 (T <= 656) or 128 (T <= 384) on sm_90a; T " + std::to_string(T) +
             ", hd " + std::to_string(hd));
  if (kind != AttentionForward::Auto) return kind;
  return attention_forward_resident_preferred(T, hd, dev) ? AttentionForward::Resident : AttentionForward::Streamed;
}

AttentionBackward resolve_backward(AttentionBackward kind, int T, int hd, int dev) {
  const bool single = single_pass_fits(T, hd, dev), resident = attention_resident_fits(T, hd, dev);
  ENSURE(single || kind != AttentionBackward::SinglePass,
         "attention_backward: the single-pass kernel takes T <= 96 and hd 16, 32, 64 or 80");
  ENSURE(resident || kind != AttentionBackward::Resident,
         "attention_backward: the resident kernel takes hd 64, 80 or 128 (T <= 1024), on sm_90a");
  if (kind != AttentionBackward::Auto) return kind;
  return single ? AttentionBackward::SinglePass : resident ? AttentionBackward::Resident : AttentionBackward::Streamed;
}

// The current device, where the streamed kernels support (T, hd) on it; else -1.
int supporting_device(int T, int hd) {
  if (!attention_unsupported_reason(T, hd).empty()) return -1;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}
}  // namespace

void attention_forward(const bf16* qkv, bf16* out, float* lse, int B, int T, int H, int hd,
                       cudaStream_t stream, AttentionForward kind) {
  const int dev = require_shape("attention_forward", B, T, H, hd);
  ENSURE(qkv && out && lse, "attention_forward: null pointer");
  ENSURE(is_aligned16(qkv) && is_aligned16(out), "attention_forward: qkv/out must be 16-byte aligned");
  NvtxRange range("attention_forward");
  if (resolve_forward(kind, T, hd, dev) == AttentionForward::Resident) {
    attention_forward_resident(qkv, out, lse, B, T, H, hd, dev, stream);
    return;
  }
  const dim3 grid((T + kTile - 1) / kTile, H, B);
  dispatch_hd(hd, [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    constexpr int kSmem = forward_smem_bytes(HD);
    prepare_kernel<&attention_forward_kernel<HD>>(dev, kSmem);
    attention_forward_kernel<HD><<<grid, kThreads, kSmem, stream>>>(qkv, out, lse, T, H,
                                                                    softmax_scale(HD));
    LAUNCH_CHECK();
  });
}


bool attention_single_pass_supported(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 && single_pass_fits(T, hd, dev);
}

bool attention_forward_resident_supported(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 && attention_forward_resident_fits(T, hd, dev);
}

bool attention_resident_supported(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 && attention_resident_fits(T, hd, dev);
}

AttentionForward attention_forward_auto_choice(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 ? resolve_forward(AttentionForward::Auto, T, hd, dev) : AttentionForward::Streamed;
}

namespace {
// delta's floats, rounded up to 256 bytes: the dQ planes follow (attention_backward_workspace_floats).
size_t delta_floats_padded(int B, int T, int H) { return (size_t(B) * H * T + 63) / 64 * 64; }
}  // namespace

size_t attention_backward_workspace_floats(int B, int T, int H, int hd) {
  return delta_floats_padded(B, T, H) + attention_resident_dq_plane_floats(B, T, H, hd);
}

AttentionBackward attention_backward_auto_choice(int T, int hd) {
  const int dev = supporting_device(T, hd);
  return dev >= 0 ? resolve_backward(AttentionBackward::Auto, T, hd, dev) : AttentionBackward::Streamed;
}

void attention_backward(const bf16* qkv, const bf16* out, const bf16* dout, const float* lse,
                        float* delta, bf16* dqkv, int B, int T, int H, int hd,
                        cudaStream_t stream, AttentionBackward kind) {
  const int dev = require_shape("attention_backward", B, T, H, hd);
  ENSURE(qkv && out && dout && lse && delta && dqkv, "attention_backward: null pointer");
  ENSURE(is_aligned16(qkv) && is_aligned16(out) && is_aligned16(dout) && is_aligned16(dqkv),
         "attention_backward: qkv/out/dout/dqkv must be 16-byte aligned");
  NvtxRange range("attention_backward");

  const AttentionBackward chosen = resolve_backward(kind, T, hd, dev);  // require_shape checked the rest
  const auto compute_delta = [&] {  // delta = rowsum(dout * out), [B, H, T]
    const long long pairs = static_cast<long long>(B) * T * H;
    const long long pairs_per_block = kDeltaThreads / kDeltaGroup;
    const long long delta_blocks = (pairs + pairs_per_block - 1) / pairs_per_block;
    ENSURE(delta_blocks <= 0x7fffffffLL, "attention_backward: B*T*H too large for the delta grid");
    attention_delta_kernel<<<static_cast<unsigned>(delta_blocks), kDeltaThreads, 0, stream>>>(out, dout, delta, T, H, hd,
                                                                                               pairs);
    LAUNCH_CHECK();
  };
  if (chosen == AttentionBackward::Resident) {
    // Past 256 tokens in key blocks: delta computed first, the dQ planes after it in the workspace.
    const bool blocks = attention_resident_takes_delta(T, hd), planes = attention_resident_dq_plane_floats(B, T, H, hd) > 0;
    if (blocks) compute_delta();
    attention_backward_resident(qkv, out, dout, lse, blocks ? delta : nullptr,
                                planes ? delta + delta_floats_padded(B, T, H) : nullptr, dqkv, B, T, H, hd, dev, stream);
    return;
  }
  if (chosen == AttentionBackward::SinglePass) {
    const int groups = (T + 15) / 16;
    const auto launch = [&](auto hd_c) {
      constexpr int HD = decltype(hd_c)::value;
      // The attribute is set once, for the largest block; smaller ones launch under it.
      prepare_kernel<&attention_backward_single_kernel<HD>>(dev, std::min(single_pass_smem_bytes(HD, kSingleMaxT),
                                                                          device_info(dev).smem_optin));
      attention_backward_single_kernel<HD><<<dim3(H, B), groups * 32, single_pass_smem_bytes(HD, groups * 16), stream>>>(
          qkv, out, dout, lse, dqkv, T, H, softmax_scale(HD));
      LAUNCH_CHECK();
    };
    switch (hd) {
      case 16: launch(std::integral_constant<int, 16>{}); break;
      case 32: launch(std::integral_constant<int, 32>{}); break;
      case 64: launch(std::integral_constant<int, 64>{}); break;
      default: launch(std::integral_constant<int, 80>{}); break;
    }
    return;
  }

  compute_delta();

  const dim3 grid((T + kTile - 1) / kTile, H, B);
  dispatch_hd(hd, [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    const float scale = softmax_scale(HD);
    constexpr int kDkdvSmem = dkdv_smem_bytes(HD);
    prepare_kernel<&attention_dkdv_kernel<HD>>(dev, kDkdvSmem);
    attention_dkdv_kernel<HD><<<grid, kThreads, kDkdvSmem, stream>>>(qkv, dout, lse, delta, dqkv,
                                                                     T, H, scale);
    LAUNCH_CHECK();
    constexpr int kDqSmem = dq_smem_bytes(HD);
    prepare_kernel<&attention_dq_kernel<HD>>(dev, kDqSmem);
    attention_dq_kernel<HD><<<grid, kThreads, kDqSmem, stream>>>(qkv, dout, lse, delta, dqkv, T,
                                                                 H, scale);
    LAUNCH_CHECK();
  });
}
