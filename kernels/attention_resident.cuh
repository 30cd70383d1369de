// What the resident attention kernels share (attention_resident_forward.cu,
// attention_resident_backward.cu): Hopper's warpgroup MMAs (wgmma, sm_90a) on operands resident in
// shared memory, loaded and stored by TMA. The tile constants, the wgmma descriptors of the "wide"
// operand layout, the K/V tile pipeline (load_wide onto a tile's mbarrier, mbar_wait before the
// products), the staging of accumulators for TMA stores, the phase stamps of the traced build,
// and the tensor maps. Everything in an anonymous namespace: each including file gets its own copy.
//
// Shared-memory layouts:
//   Operand tiles "wide" (wide_offset): columns 0-63 in the 128-byte swizzle (128-byte rows), then
//     at hd 80 columns 64-79 in the 32-byte swizzle, at hd 128 columns 64-127 in the 128-byte one.
//     The backward's Q, dO, K, V, O tiles and the forward's Q, K (and V at hd 64, 128) are so. TMA
//     writes them (the maps end at T: zeros past it), and no warp copies anything; wide_kdesc
//     reads a tile K-major (as A or B over hd), wide_mma MN-major (as B with K = the rows: dO, Q
//     for dV, dK; K for dQ), at hd 80 as two MMAs 64 and 16 columns wide. The forward's V at hd 80
//     stays in 32-byte-swizzle chunks of 16 columns (chunks_mn_desc), read by one m64n80 MMA.
//   Slot, 64 queries x 64 keys (P, then dS; written by the threads, no swizzle): vector k (keys
//     8k..8k+7) of query r at (r/8) * 1024 + k*128 + (r%8)*16: K-major for dS as A of dQ (LBO 128,
//     SBO 1024), MN-major for P^T and dS^T as A of dV and dK (M = keys; LBO 1024 along the
//     queries, SBO 128).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <utility>

#include "kernels/attention_common.cuh"
#include "kernels/attention_trace.h"
#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace {
using bf16 = __nv_bfloat16;

constexpr int kQTile = 64;
__host__ __device__ constexpr int q_bytes(int hd) { return kQTile * hd * 2; }
__host__ __device__ constexpr int tiles(int T) { return (T + kQTile - 1) / kQTile; }  // 64-row tiles

// desc advanced by bytes (a multiple of 16) at the point of use: volatile, so that the compiler does
// not hoist every step's descriptor out of a loop and hold them in registers (the forward spills).
__device__ __forceinline__ uint64_t desc_step(uint64_t desc, uint32_t bytes) {
  uint64_t out;
  asm volatile("add.s64 %0, %1, %2;\n" : "=l"(out) : "l"(desc), "l"(uint64_t(bytes >> 4)));
  return out;
}

// Operand tiles in the 128-byte swizzle ("wide"): a tile of R rows (64; 16 for the forward's
// narrow last K, V tile) holds columns 0-63 as 128-byte rows (R x 128 bytes; TMA writes them with
// SWIZZLE_128B), then at hd 80 columns 64-79 as 32-byte rows (R x 32, SWIZZLE_32B), at hd 128
// columns 64-127 as 128-byte rows again. The TMA unit moves 128-byte rows faster than 32-byte
// ones (tools/tma_rate.cu).
constexpr int kWideBytes = kQTile * 128;  // the 64-column part of a 64-row tile
// Byte of 16-byte vector c (columns 8c .. 8c + 7) of row r. A warp's 8-row strips of one vector
// fall in 8 different bank quads.
template <int HD>
__device__ __forceinline__ uint32_t wide_offset(int R, int r, int c) {
  if (c < 8) return uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
  if (HD == 128) return uint32_t(R * 128 + r * 128 + (((c - 8) ^ (r & 7)) << 4));
  return uint32_t(R * 128 + r * 32 + ((((c - 8) & 1) ^ ((r >> 2) & 1)) << 4));
}
// The columns past 64 as a descriptor's base: K-major (lbo unused) or MN-major (lbo unused: one
// group along N an MMA).
template <int HD>
__device__ __forceinline__ uint64_t wide_upper_desc(uint32_t tile, int R) {
  return HD == 128 ? wgmma::descriptor_sw128(tile + R * 128, 16, 1024) : wgmma::descriptor_sw32(tile + R * 128, 16, 256);
}
// The tile as a K-major operand (K = its columns): k16 step kk.
template <int HD>
__device__ __forceinline__ uint64_t wide_kdesc(uint32_t tile, int R, int kk) {
  if (kk < 4) return wgmma::descriptor_sw128(tile + kk * 32, 16, 1024);
  const uint64_t upper = wide_upper_desc<HD>(tile, R);
  return kk == 4 ? upper : desc_step(upper, (kk - 4) * 32);
}
// A wide tile of R rows by TMA, from column col and row `row` of image b: columns 0-63 through
// map, those past 64 (hd 80, 128) through tail, R * 128 bytes on; its bytes counted on bar.
template <int HD>
__device__ __forceinline__ void load_wide(uint32_t dst, int R, const CUtensorMap* map, const CUtensorMap* tail, int col,
                                          int row, int b, uint32_t bar) {
  tma::load_3d(dst, map, col, row, b, bar);
  if (HD > 64) tma::load_3d(dst + R * 128, tail, col + 64, row, b, bar);
}
// The K and V tiles of head h, R rows from row `row` of image b, into k_dst and v_dst by TMA
// (qkv's K and V columns), their bytes counted on bar.
template <int HD>
__device__ __forceinline__ void load_kv_wide(uint32_t k_dst, uint32_t v_dst, int R, const CUtensorMap* map,
                                             const CUtensorMap* tail, int H, int h, int row, int b, uint32_t bar) {
  load_wide<HD>(k_dst, R, map, tail, (H + h) * HD, row, b, bar);
  load_wide<HD>(v_dst, R, map, tail, (2 * H + h) * HD, row, b, bar);
}
// A staged 64-row wide tile out by TMA, one bulk group (tma::wait_read before src is reused).
template <int HD>
__device__ __forceinline__ void store_wide(uint32_t src, const CUtensorMap* map, const CUtensorMap* tail, int col, int row,
                                           int b) {
  tma::store_3d(map, src, col, row, b);
  if (HD > 64) tma::store_3d(tail, src + kWideBytes, col + 64, row, b);
  tma::commit();
}

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// bar expects `bytes` more of the TMA loads issued next (this thread's arrival with them).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
}
// A warpgroup's 64 x HD fp32 accumulator (rows g and g + 8 of warp w's 16 scaled by mult_lo and
// mult_hi) as bf16 into a 64-row tile in shared memory (wide_offset's layout, conflict-free), made
// visible to the async proxy: after a barrier, TMA stores write it out (from the fragments
// directly each 32-byte sector would be written half).
template <int HD>
__device__ __forceinline__ void stage_fragments(unsigned char* tile, const float (&acc)[HD / 2], float mult_lo,
                                                float mult_hi, int warp, int g, int q) {
  const int row = warp * 16 + g;
#pragma unroll
  for (int m = 0; m < HD / 8; ++m) {
    *reinterpret_cast<uint32_t*>(tile + wide_offset<HD>(kQTile, row, m) + 4 * q) =
        pack_bf16x2(acc[4 * m] * mult_lo, acc[4 * m + 1] * mult_lo);
    *reinterpret_cast<uint32_t*>(tile + wide_offset<HD>(kQTile, row + 8, m) + 4 * q) =
        pack_bf16x2(acc[4 * m + 2] * mult_hi, acc[4 * m + 3] * mult_hi);
  }
  wgmma::fence_proxy_async();
}

// Phase stamps (kernels/attention_trace.h): code only in the traced build.
using namespace attention_trace;
#ifdef ATTENTION_TRACE
__device__ unsigned long long* g_trace;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// This CTA's row, read once (a load of g_trace at every stamp would slow the stamping thread).
__device__ __forceinline__ unsigned long long* trace_row() {
  return g_trace ? g_trace + (size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kSlots : nullptr;
}
__device__ __forceinline__ void trace_start(unsigned long long* r) {
  if (r) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    r[kStartNs] = global_ns(), r[kStartClock] = clock64(), r[kSm] = smid;
  }
}
__device__ __forceinline__ void trace(unsigned long long* r, int slot) {
  if (r) r[slot] = clock64();
}
__device__ __forceinline__ void trace_end(unsigned long long* r) {  // the max over the callers
  if (r && threadIdx.x % 32 == 0) {
    atomicMax(r + kEndNs, global_ns());
    atomicMax(r + kEndClock, (unsigned long long)clock64());
  }
}
#else
__device__ __forceinline__ unsigned long long* trace_row() { return nullptr; }
__device__ __forceinline__ void trace_start(unsigned long long*) {}
__device__ __forceinline__ void trace(unsigned long long*, int) {}
__device__ __forceinline__ void trace_end(unsigned long long*) {}
#endif

// ---------------------------------------------------------------------------------------------
// Host side.

bool sm90a(const DeviceInfo& info) { return info.major == 9 && info.minor == 0; }  // wgmma, setmaxnreg


// A [B, T, columns] bf16 tensor (qkv: 3 H hd columns, out, dout: H hd) seen as wide tiles
// (wide_offset) of `rows` rows of one head's Q, K, V, O or dO: dims (column, row, image), box
// 64 columns (part 0: SWIZZLE_128B) or the columns past 64 (part 1: 16 at hd 80, SWIZZLE_32B; 64
// at hd 128, SWIZZLE_128B) x rows. Rows end at T: a box past them is filled with zeros.
CUtensorMap wide_map(const bf16* data, int B, int T, int columns, int hd, int rows, int part) {
  const cuuint64_t cols = cuuint64_t(columns);
  const cuuint64_t dims[3] = {cols, cuuint64_t(T), cuuint64_t(B)};
  const cuuint64_t strides[2] = {cols * 2, cuuint64_t(T) * cols * 2};  // bytes, dims 1..2
  const bool swizzle128 = part == 0 || hd == 128;
  const cuuint32_t box[3] = {swizzle128 ? 64u : 16u, cuuint32_t(rows), 1};
  return tma::encode(data, 3, dims, strides, box, swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_32B,
                     "attention resident kernels");
}
// A tensor's two wide maps of `rows`-row tiles: columns 0-63, and those past 64 (at hd 64, where
// the kernels read none, the first again: not encoded).
std::pair<CUtensorMap, CUtensorMap> wide_maps(const bf16* data, int B, int T, int columns, int hd, int rows) {
  const CUtensorMap first = wide_map(data, B, T, columns, hd, rows, 0);
  return {first, hd > 64 ? wide_map(data, B, T, columns, hd, rows, 1) : first};
}
}  // namespace
