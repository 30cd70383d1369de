// The attention backward (and, further down, the forward) for short sequences on Hopper's
// warpgroup MMAs (wgmma, sm_90a), every operand resident in shared memory: one CTA per (image,
// head), T <= 256, hd 64 or 80 (past 256, and at hd 128, in key blocks, below; the forward also
// hd 128, and longer T: see there). Backward: Q, K, V and dO are loaded once (n = ceil(T/64) tiles of 64 rows each)
// and S and dP are computed once: the streamed kernels (attention.cu) read the other side 4 times
// over and compute both twice.
// Three warpgroups:
//   WG 0 (rows): per query tile i and key tile c: S = Q_i K_c^T, dP = dO_i V_c^T, P, and
//     dS = P (dP - delta) into staging slot c (bf16); then dQ_i = dS_i K over the slots, staged in
//     Q_i's tile once the key warpgroups are done with it, and stored by TMA.
//   WG 1, WG 2 (keys): WG 1 + j owns key tiles 2j and 2j + 1 (at hd 128 tile j) and accumulates
//     dV_c += P^T dO_i and dK_c += dS^T Q_i from slot c (A = P^T, dS^T: the slot read MN-major).
//     That is 160 fp32 registers a thread at hd 80, which they take from WG 0 (setmaxnreg). Before
//     that WG 1 issues every load (key blocks: the first query buffers'), so that WG 0 starts as soon as the first
//     tile lands, and WG 2 computes
//     delta = rowsum(dO * O) tile by tile (no separate kernel), O's tile t loaded with the others
//     into slot t, which WG 0 fills only after DELTA_t. After the last query tile they stage dV in
//     their V tiles and store it, then dK in their K tiles once WG 0's last dQ has read them.
// A last, partial tile is computed only as far as its rows reach, rounded up to 16 (at ViT's 197
// tokens 5 of its 64 rows are real): S and dP 16 or 32 keys wide instead of 64, and dK and dV
// contract over that many of its queries. dQ contracts over all 64 of its keys, the slot's
// unwritten columns zeroed at the start (a guard on dQ's last steps makes ptxas serialize the
// wgmmas). As a query tile, one of 16 real rows or fewer is computed transposed (S^T = K Q^T over
// its first 16 queries, every key tile in one pass: few_rows).
// Hand-overs: the loads land on one mbarrier per tile (TMA bytes, lse by cp.async); slot c goes
// from WG 0 to its owner through named barriers FULL_c and back through EMPTY_c; tile t's delta
// (and slot t) through DELTA_t; the K tiles, after WG 0's last dQ, through DQ_DONE.
// Key blocks (hd 64 or 80, 257 to 1024 tokens; hd 128, 1 to 1024; kKeyBlocks): a CTA per (head,
// image, 4 key tiles; at hd 128 2, one a key warpgroup: dV and dK of a 128-column tile are 128
// registers a thread) with the same warpgroups and layouts, its K and V loaded once, the query
// tiles through 4 buffers (WG 0 loads tile i + 4 once every warpgroup is done with tile i: the key
// warpgroups have no registers to spare; 3 buffers beside extra keys, kExtraKeys below). delta
// comes computed (attention.cu's kernel), no O is loaded, and dQ_i's part over this block's keys
// goes, fp32, to the block's own plane of a workspace; dq_planes_sum_kernel adds the planes in
// order (deterministic). A CTA's key-tile count
// is a template argument (the whole blocks in one launch, the last in another): worked out at run
// time, it made ptxas serialize the wgmmas. The last query tile takes the key_tile path even where
// few_rows would apply (few_rows faulted under compute-sanitizer memcheck while the count was a
// run-time value; BENCHMARKS.md 33).
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
#include "kernels/attention_resident.h"

#include <cmath>
#include <string>
#include <utility>

#include "kernels/check.h"
#include "kernels/attention_common.cuh"
#include "kernels/attention_trace.h"
#include "kernels/common.cuh"
#include "kernels/tma.cuh"
#include "kernels/wgmma.cuh"

namespace {
using bf16 = __nv_bfloat16;

constexpr int kQTile = 64;
constexpr float kLog2e = 1.4426950408889634f;
__host__ __device__ constexpr int q_bytes(int hd) { return kQTile * hd * 2; }
__host__ __device__ constexpr int tiles(int T) { return (T + kQTile - 1) / kQTile; }  // 64-row tiles

// The forward's V tiles at hd 80 stay in the 32-byte swizzle, 16-column chunks of `rows` rows
// (32-byte rows): one m64n80 MMA reads them MN-major (LBO the chunk stride), where the wide
// layout's two (64 + 16 columns) would make ptxas serialize the forward's MMAs (C7512). k16 step j
// is rows 16j .. 16j + 15.
__device__ __forceinline__ uint64_t chunks_mn_desc(uint32_t tile, int rows) {
  return wgmma::descriptor_sw32(tile, rows * 32, 256);
}
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
// columns 64-127 as 128-byte rows again. TMA moves 128-byte rows 1.5-2.4x as fast as 32-byte ones
// (tools/tma_rate.cu; BENCHMARKS.md 28).
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
// acc (+)= A B over k16 step j of the tile's rows, B the tile as an MN-major operand (K = its
// rows, N = its HD columns): at hd 80 two MMAs, 64 and 16 columns wide (one descriptor cannot
// span two swizzles) into acc's first 32 and last 8 floats; at hd 128 two 64 wide, into its two
// halves. A K-major (kTransA false) or MN-major.
template <int HD, bool kTransA>
__device__ __forceinline__ void wide_mma(float (&acc)[HD / 2], uint64_t a, uint32_t tile, int j, int accumulate) {
  const uint64_t b64 = desc_step(wgmma::descriptor_sw128(tile, kWideBytes, 1024), j * 2048);
  if constexpr (kTransA) wgmma::Mma<64>::ss_tt(acc, a, b64, accumulate);
  else wgmma::Mma<64>::ss_bt(acc, a, b64, accumulate);
  if constexpr (HD == 80) {
    const uint64_t b16 = desc_step(wgmma::descriptor_sw32(tile + kWideBytes, 2048, 256), j * 512);
    if constexpr (kTransA) wgmma::Mma<16>::ss_tt<32>(acc, a, b16, accumulate);
    else wgmma::Mma<16>::ss_bt<32>(acc, a, b16, accumulate);
  } else if constexpr (HD == 128) {
    const uint64_t b_hi = desc_step(wgmma::descriptor_sw128(tile + kWideBytes, kWideBytes, 1024), j * 2048);
    if constexpr (kTransA) wgmma::Mma<64>::ss_tt<32>(acc, a, b_hi, accumulate);
    else wgmma::Mma<64>::ss_bt<32>(acc, a, b_hi, accumulate);
  }
}
// A wide tile of R rows by TMA, from column col and row `row` of image b: columns 0-63 through
// map, those past 64 (hd 80, 128) through tail, R * 128 bytes on; its bytes counted on bar.
template <int HD>
__device__ __forceinline__ void load_wide(uint32_t dst, int R, const CUtensorMap* map, const CUtensorMap* tail, int col,
                                          int row, int b, uint32_t bar) {
  tma::load_3d(dst, map, col, row, b, bar);
  if (HD > 64) tma::load_3d(dst + R * 128, tail, col + 64, row, b, bar);
}
// A staged 64-row wide tile out by TMA, one bulk group (tma::wait_read before src is reused).
template <int HD>
__device__ __forceinline__ void store_wide(uint32_t src, const CUtensorMap* map, const CUtensorMap* tail, int col, int row,
                                           int b) {
  tma::store_3d(map, src, col, row, b);
  if (HD > 64) tma::store_3d(tail, src + kWideBytes, col + 64, row, b);
  tma::commit();
}

constexpr int kThreads = 384, kLseLoaders = kQTile;
constexpr int kSlotBytes = 2 * 64 * 64 * 2;  // P, then dS
// Key tiles a key warpgroup owns (their dV and dK in its registers): two at hd 64 and 80 (160
// accumulators a thread at hd 80), one at hd 128 (128). A key block holds twice that.
__host__ __device__ constexpr int key_wg_tiles(int hd) { return hd == 128 ? 1 : 2; }
__host__ __device__ constexpr int block_tiles(int hd) { return 2 * key_wg_tiles(hd); }
// Query-tile buffers in key blocks: 4, or 3 beside the extra keys' tiles (kExtraKeys, below).
__host__ __device__ constexpr int query_buffers(bool extra_keys) { return extra_keys ? 3 : 4; }
// The extra keys' K (or V) tile: 16 rows in the wide layout, its TMA bytes and its room (1024-byte
// aligned, as the 128-byte swizzle wants).
__host__ __device__ constexpr int narrow_tile_bytes(int hd) { return 16 * hd * 2; }
__host__ __device__ constexpr int narrow_bytes(int hd) { return (narrow_tile_bytes(hd) + 1023) / 1024 * 1024; }
constexpr int kExtraSlotBytes = 64 * 16 * 2;  // P (or dS) of a query tile over the extra keys
// dV^T (or dK^T) of the extra keys, m64n16 fragments of WG 0: 8 floats a thread, at hd 80 8 more
// for columns 64-79 (warp 0's rows only).
__host__ __device__ constexpr int extra_acc_floats(int hd) { return 8 * 128 + (hd > 64 ? 8 * 32 : 0); }
// setmaxnreg moves registers within the CTA's own pool (SASS: CTAPOOL), 168 a thread at launch
// (__launch_bounds__(384, 1)): the three warpgroups' counts may sum to 3 x 168 = 504, no more (an
// increase beyond the pool waits forever).
constexpr int kWg0Regs = 120, kKeyRegs = 192;  // 120 + 2 * 192 = 504
static_assert(kWg0Regs + 2 * kKeyRegs <= 3 * (65536 / kThreads / 8 * 8), "more registers than the CTA's pool");
// kFull + c, kEmpty + c, kDelta + t, kKeys + j (key warpgroup j's own); 0 is __syncthreads. kDqDone
// reuses DELTA_0, whose one use ends at query tile 0.
enum Barrier { kFull = 1, kEmpty = 5, kRows = 9, kDelta = 10, kDqDone = kDelta, kKeys = 14 };

// Per 64-row tile: Q, dO, K, V, a slot, lse and delta (64 floats each); then the 4 mbarriers.
__host__ __device__ constexpr int smem_bytes(int n, int hd) { return n * (4 * q_bytes(hd) + kSlotBytes + 512) + 8 * 4; }

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives on bar once all of this thread's earlier cp.async have landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
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
template <int R>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
// A warpgroup's 64 x HD fp32 accumulator (rows g and g + 8 of warp w's 16 scaled by mult_lo and
// mult_hi) as bf16 into a 64-row tile in shared memory (wide_offset's layout, conflict-free), made
// visible to the async proxy: after a barrier, TMA stores write it out (from the fragments
// directly each 32-byte sector would be written half, and the warps' own copies were slow).
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
// This CTA's row, read once (a load of g_trace at every stamp slowed the stamping thread).
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


__device__ __forceinline__ uint32_t slot_offset(int r, int k) {  // byte of (query r, key k), k even
  return uint32_t((r >> 3) * 1024 + (k >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2);
}

// kKeyTiles 0: one CTA per (head, image), T <= 256. Else key blocks: this CTA's key tiles,
// block_tiles (4; 2 at hd 128) or (the last block) fewer, fixed at compile time (a count worked out at run time made ptxas
// serialize the wgmmas, C7512), and whether it holds the last key tile; blockIdx.z + first_block
// is the block.
// kExtraKeys (hd 64 and 80, 257 to 272 tokens: 4 whole key tiles and 1 to 16 keys past them): the
// one block holds all the keys, the extra ones as a 16-row tile (narrow_map) whose S, dP and dS
// warpgroup 0 computes beside the slots', dS kept in registers as the A operand of dQ's last
// product; so dQ is whole here and goes out as bf16 (no planes, no sum). Their dV and dK WG 0
// accumulates too, transposed (dV^T += dO_i^T P: m64n16, 8 or 16 registers each), and writes at
// the end (to dqkv directly). 3 query buffers (the extra tiles take the fourth's room), each
// reloaded once its dQ store has read it.
template <int HD, int kKeyTiles, bool kLastKeys, bool kExtraKeys = false>
__global__ void __launch_bounds__(kThreads, 1)
    attention_backward_resident_kernel(const __grid_constant__ CUtensorMap qkv_map, const __grid_constant__ CUtensorMap do_map,
                                       const __grid_constant__ CUtensorMap dqkv_map, const __grid_constant__ CUtensorMap qkv_tail,
                                       const __grid_constant__ CUtensorMap do_tail, const __grid_constant__ CUtensorMap dqkv_tail,
                                       const __grid_constant__ CUtensorMap out_map, const __grid_constant__ CUtensorMap out_tail,
                                       const __grid_constant__ CUtensorMap narrow_map, const __grid_constant__ CUtensorMap narrow_tail,
                                       const float* __restrict__ lse, const float* __restrict__ delta,
                                       float* __restrict__ dq_planes, bf16* __restrict__ dqkv, int first_block, int T, int H,
                                       float scale) {
  constexpr bool kKeyBlocks = kKeyTiles > 0;
  static_assert(!kExtraKeys || (kKeyTiles == 4 && !kLastKeys && HD != 128), "extra keys: 4 whole key tiles");
  static_assert((HD != 128 || kKeyBlocks) && kKeyTiles <= block_tiles(HD), "hd 128 runs in key blocks only, of 2 tiles");
  constexpr int kPer = key_wg_tiles(HD);  // key tiles a key warpgroup owns
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned long long* const tr = kKeyBlocks ? nullptr : trace_row();  // (the stamps' slots count 4 tiles)
  constexpr int kTile = q_bytes(HD);
  const int n = tiles(T);
  // Key blocks (past 256 tokens; hd 128 always): this CTA's key tiles kt0 .. kt0 + nk - 1 (room for
  // nkv = block_tiles), every query tile through nb = 4 buffers (3 beside extra keys), tile i in
  // buffer i % nb. Else nk = nkv = nb = n and kt0 = 0.
  const int kb = kKeyBlocks ? first_block + int(blockIdx.z) : 0, kt0 = block_tiles(HD) * kb;
  const int nk = kKeyBlocks ? kKeyTiles : n, nb = kKeyBlocks ? query_buffers(kExtraKeys) : n,
            nkv = kKeyBlocks ? block_tiles(HD) : n;
  const uint32_t s_q = smem_addr(smem), s_do = s_q + nb * kTile, s_k = s_do + nb * kTile, s_v = s_k + nkv * kTile;
  const uint32_t s_slot = s_v + nkv * kTile, s_extra_k = s_slot + nkv * kSlotBytes;  // extra keys: K, V (16 rows)
  const uint32_t s_extra_v = s_extra_k + (kExtraKeys ? narrow_bytes(HD) : 0);
  // Extra keys: this query tile's P and dS over them, [64 queries][16 keys] bf16 each (2 KB):
  // 8-key vector k of query r at (r / 8) * 256 + k * 128 + (r % 8) * 16.
  const uint32_t s_extra_p = s_extra_v + (kExtraKeys ? narrow_bytes(HD) : 0);
  // and their dV^T, dK^T sums (extra_acc_floats each), fp32, each WG 0 thread's own.
  const uint32_t s_extra_acc = s_extra_p + (kExtraKeys ? 2 * kExtraSlotBytes : 0);
  const uint32_t s_stats = s_extra_acc + (kExtraKeys ? 2 * 4 * extra_acc_floats(HD) : 0), s_bar = s_stats + nb * 512;
  // Key blocks: K_c and V_c's own mbarriers (s_bar + 8 s: buffer s), the extra keys' at c = nk.
  const uint32_t s_kvbar = s_bar + 8 * nb;
  const int h = blockIdx.x, b = blockIdx.y;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2,
            q = lane & 3;
  // k16 steps that cover the last tile's rows (as keys of dQ, as queries of dK and dV): the rest
  // contribute nothing (P and dS are 0 on padding keys, dO and Q on padding queries).
  const int last_k16 = (T - (n - 1) * kQTile + 15) / 16;
  constexpr bool holds_last_keys = !kKeyBlocks || kLastKeys;  // this CTA holds the last key tile
  // Query tile i's buffer and the parity of its mbarrier's phase.
  const auto buf = [&](int i) { return kKeyBlocks ? i % nb : i; };
  const auto phase = [&](int i) { return kKeyBlocks ? (i / nb) & 1 : 0; };

  if (threadIdx.x == 0) trace_start(tr);
  if (threadIdx.x == 0) {
    for (int t = 0; t < nb; ++t) mbar_init(s_bar + 8 * t, kLseLoaders + 1);  // + the TMA issuer's arrival
    if (kKeyBlocks)
      for (int c = 0; c < nk + kExtraKeys; ++c) mbar_init(s_kvbar + 8 * c, 1);
  }
  // The last slot's columns that WG 0 leaves unwritten, past the bytes O's tile takes (below): zero.
  // Those it takes keep O where WG 0 does not write (rows of O past T are zeros; its real rows
  // are finite wherever the gradients are, since delta carries them into dS): dQ multiplies them
  // by K's rows past T, zeros; dV and dK's rows for those keys are past T, never stored. Key
  // blocks load no O (delta comes computed): the whole slot.
  if (holds_last_keys && last_k16 <= 2) {
    for (int v = int(threadIdx.x) + (kKeyBlocks ? 0 : kTile / 16); v < kSlotBytes / 16; v += kThreads)
      *reinterpret_cast<uint4*>(smem + (s_slot - s_q) + (nk - 1) * kSlotBytes + 16 * v) = make_uint4(0, 0, 0, 0);
    wgmma::fence_proxy_async();
  }
  __syncthreads();
  // WG 1 (idle until WG 0 fills a slot) issues the loads, so that WG 0 starts on tile 0 as soon as
  // it lands: tile t (rows 64t .. 64t + 63 of Q, dO, K, V and lse) on mbarrier t. Q, dO, K and V
  // come by TMA, issued by its first thread; rows at or past T arrive as zeros (the tensor maps end
  // at T). lse by cp.async from its last 64 threads, 0 past T (P = 1 against zero Q and dO rows,
  // which adds nothing).
  // Key blocks: this CTA's K and V tiles, then query tiles 0 .. nb - 1 (tile i + nb issued by WG 0
  // once every warpgroup is done with tile i, below; with extra keys one tile later). A query tile's Q and dO by TMA from thread
  // `issuer`, its lse and delta by cp.async from threads first .. first + 63.
  const auto load_query = [&](int i, int issuer, int first) {
    // At hd 80 (head, image) read afresh: from h and b, ptxas hoists the lse and delta addresses
    // out of WG 0's loop into registers, and spills. (At hd 64 the re-read cost 3-5%: BENCHMARKS 34.)
    // The grid is (H, B, key blocks), as h and b above read it.
    int hh = h, bb = b;
    if constexpr (HD == 80) {
      asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(hh));
      asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(bb));
    }
    const uint32_t bar = s_bar + 8 * buf(i);
    if (int(threadIdx.x) == issuer) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(2 * kTile) : "memory");
      load_wide<HD>(s_q + buf(i) * kTile, kQTile, &qkv_map, &qkv_tail, hh * HD, i * kQTile, bb, bar);
      load_wide<HD>(s_do + buf(i) * kTile, kQTile, &do_map, &do_tail, hh * HD, i * kQTile, bb, bar);
    } else {
      const int x = int(threadIdx.x) - first, r = i * kQTile + x;
      const size_t bh = (size_t(bb) * H + hh) * T;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s_stats + buf(i) * 512 + x * 4),
                   "l"(__cvta_generic_to_global(lse + bh + (r < T ? r : 0))), "r"(r < T ? 4 : 0)
                   : "memory");
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s_stats + buf(i) * 512 + 256 + x * 4),
                   "l"(__cvta_generic_to_global(delta + bh + (r < T ? r : 0))), "r"(r < T ? 4 : 0)
                   : "memory");
      cp_async_arrive(bar);
    }
  };
  if (kKeyBlocks) {
    // K_0, V_0, then Q_0, dO_0 (all WG 0's first step needs), then the other key tiles, then
    // query tiles 1-3.
    const auto load_keys = [&](int c) {
      const uint32_t bar = s_kvbar + 8 * c;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(2 * kTile) : "memory");
      load_wide<HD>(s_k + c * kTile, kQTile, &qkv_map, &qkv_tail, (H + h) * HD, (kt0 + c) * kQTile, b, bar);
      load_wide<HD>(s_v + c * kTile, kQTile, &qkv_map, &qkv_tail, (2 * H + h) * HD, (kt0 + c) * kQTile, b, bar);
    };
    if (threadIdx.x == 128) load_keys(0);
    if (threadIdx.x == 128 || (threadIdx.x >= 256 - kLseLoaders && threadIdx.x < 256)) load_query(0, 128, 256 - kLseLoaders);
    if (threadIdx.x == 128)
      for (int c = 1; c < nk; ++c) load_keys(c);
    if (kExtraKeys && threadIdx.x == 128) {  // the extra keys' K and V, 16 rows each
      const uint32_t bar = s_kvbar + 8 * nk;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(2 * narrow_tile_bytes(HD)) : "memory");
      load_wide<HD>(s_extra_k, 16, &narrow_map, &narrow_tail, (H + h) * HD, nk * kQTile, b, bar);
      load_wide<HD>(s_extra_v, 16, &narrow_map, &narrow_tail, (2 * H + h) * HD, nk * kQTile, b, bar);
    }
    if (threadIdx.x == 128 || (threadIdx.x >= 256 - kLseLoaders && threadIdx.x < 256))
      for (int i = 1; i < min(nb, n); ++i) load_query(i, 128, 256 - kLseLoaders);
  } else if (threadIdx.x == 128) {
    trace(tr, kBwdIssueBegins);
    for (int t = 0; t < n; ++t) {
      const uint32_t bar = s_bar + 8 * t;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(5 * kTile) : "memory");
      for (int which = 0; which < 4; ++which) {  // Q, dO, K, V
        const int col = ((which < 2 ? 0 : (which - 1) * H) + h) * HD;
        const uint32_t dst = s_q + which * n * kTile + t * kTile;
        load_wide<HD>(dst, kQTile, which == 1 ? &do_map : &qkv_map, which == 1 ? &do_tail : &qkv_tail, col, t * kQTile, b,
                      bar);
      }
      // O's tile into slot t, for WG 2's delta before WG 0 first fills the slot (by the LSU, its
      // loads queued behind these and came ~2-3 us after dO's: WG 2 began its products late)
      load_wide<HD>(s_slot + t * kSlotBytes, kQTile, &out_map, &out_tail, h * HD, t * kQTile, b, bar);
    }
    trace(tr, kBwdIssued);
  }
  if (!kKeyBlocks && threadIdx.x >= 256 - kLseLoaders && threadIdx.x < 256) {
    const int x = int(threadIdx.x) - (256 - kLseLoaders);
    const float* lse_bh = lse + (size_t(b) * H + h) * T;
    for (int t = 0; t < n; ++t) {
      const int r = t * kQTile + x;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s_stats + t * 512 + x * 4),
                   "l"(__cvta_generic_to_global(r < T ? lse_bh + r : lse_bh)), "r"(r < T ? 4 : 0)
                   : "memory");
      cp_async_arrive(s_bar + 8 * t);
    }
  }

  if (wg == 0) {  // rows: S, dP, P, dS, dQ
    regs_dec<kWg0Regs>();
    const float scale_log2 = scale * kLog2e;
    const float* stats = reinterpret_cast<const float*>(smem + (s_stats - s_q));
    // Extra keys: their dV^T and dK^T (hd x 16 keys: at hd 80 two m64n16 chunks, the second's rows
    // past 80 unused), summed over the query tiles in shared memory (in registers they made ptxas
    // spill at hd 80): this thread's float e of a chunk-0 fragment at e * 128 + thread, of a
    // chunk-1 one (warp 0) at 1024 + e * 32 + lane; dK^T's extra_acc_floats on.
    constexpr int kExtraAcc = HD > 64 ? 16 : 8;
    float* const extra_acc = reinterpret_cast<float*>(smem + (s_extra_acc - s_q));
    const auto extra_slot = [&](int e) { return e < 8 ? e * 128 + int(threadIdx.x) : 1024 + (e - 8) * 32 + lane; };
    if constexpr (kExtraKeys)
      for (int e = 0; e < kExtraAcc; ++e)
        if (e < 8 || warp == 0) extra_acc[extra_slot(e)] = extra_acc[extra_acc_floats(HD) + extra_slot(e)] = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int sb = buf(i);
      const uint32_t q_i = s_q + sb * kTile, do_i = s_do + sb * kTile;
      float l_lo = 0.0f, l_hi = 0.0f, d_lo = 0.0f, d_hi = 0.0f;
      // Key tile c, its first W columns: 64, or in the last tile the 16 or 32 that cover its keys.
      const auto key_tile = [&](int c, auto width) {
        constexpr int W = decltype(width)::value;
        if (kKeyBlocks) {
          if (c == 0) mbar_wait(s_bar + 8 * sb, phase(i));  // Q_i, dO_i, lse, delta
          if (i == 0) mbar_wait(s_kvbar + 8 * c, 0);        // K_c, V_c
        } else if (i == 0) {
          mbar_wait(s_bar + 8 * c, 0);  // tile c's K, V (and at c = 0 Q_0, dO_0)
        } else if (c == 0) {
          mbar_wait(s_bar + 8 * i, 0);
        }
        if (i == 0 && threadIdx.x == 0) trace(tr, kBwdLanded + c);
        if (c == 0) l_lo = stats[sb * 128 + warp * 16 + g] * kLog2e, l_hi = stats[sb * 128 + warp * 16 + g + 8] * kLog2e;
        wgmma::fence_proxy_async();
        float sc[W / 2], dp[W / 2];
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          wgmma::Mma<W>::ss(sc, wide_kdesc<HD>(q_i, kQTile, kk), wide_kdesc<HD>(s_k + c * kTile, kQTile, kk), kk > 0);
        wgmma::commit();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          wgmma::Mma<W>::ss(dp, wide_kdesc<HD>(do_i, kQTile, kk), wide_kdesc<HD>(s_v + c * kTile, kQTile, kk), kk > 0);
        wgmma::commit();
        wgmma::wait<1>();  // S: P = exp(S scale - lse) while dP is in flight; 0 for keys at or past T
#pragma unroll
        for (int j = 0; j < W / 8; ++j) {
          sc[4 * j] = exp2_approx(fmaf(sc[4 * j], scale_log2, -l_lo));
          sc[4 * j + 1] = exp2_approx(fmaf(sc[4 * j + 1], scale_log2, -l_lo));
          sc[4 * j + 2] = exp2_approx(fmaf(sc[4 * j + 2], scale_log2, -l_hi));
          sc[4 * j + 3] = exp2_approx(fmaf(sc[4 * j + 3], scale_log2, -l_hi));
          const int key = (kt0 + c) * kQTile + 8 * j + 2 * q;
          if (key >= T) sc[4 * j] = sc[4 * j + 2] = 0.0f;
          if (key + 1 >= T) sc[4 * j + 1] = sc[4 * j + 3] = 0.0f;
        }
        wgmma::wait<0>();
        if (!kKeyBlocks && i == 0) bar_sync(kDelta + c, 256);  // WG 2 has written tile c's delta and is done with slot c's O
        if (c == 0) d_lo = stats[sb * 128 + 64 + warp * 16 + g], d_hi = stats[sb * 128 + 64 + warp * 16 + g + 8];
        // P and dS = P (dP - delta) into the slot's first W columns as bf16 pairs.
        const uint32_t slot = s_slot + c * kSlotBytes;
        const int row = warp * 16 + g;
#pragma unroll
        for (int j = 0; j < W / 8; ++j) {
          const int col = 8 * j + 2 * q;
          const float p0 = sc[4 * j], p1 = sc[4 * j + 1], p2 = sc[4 * j + 2], p3 = sc[4 * j + 3];
          const uint32_t lo = slot + slot_offset(row, col), hi = slot + slot_offset(row + 8, col);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(lo), "r"(pack_bf16x2(p0, p1)) : "memory");
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(hi), "r"(pack_bf16x2(p2, p3)) : "memory");
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(lo + 8192),
                       "r"(pack_bf16x2(p0 * (dp[4 * j] - d_lo), p1 * (dp[4 * j + 1] - d_lo)))
                       : "memory");
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(hi + 8192),
                       "r"(pack_bf16x2(p2 * (dp[4 * j + 2] - d_hi), p3 * (dp[4 * j + 3] - d_hi)))
                       : "memory");
        }
        wgmma::fence_proxy_async();
        bar_arrive(kFull + c, 256);
        if (threadIdx.x == 0) trace(tr, kBwdSlotFull + 4 * i + c);
      };
      // The last query tile when 16 of its rows or fewer are real (ViT's 197 tokens: 5 of 64),
      // transposed: S^T = K_c Q_i^T and dP^T = V_c dO_i^T over its first 16 queries (m64n16, 8
      // floats a thread a key tile), every key tile in one pass, instead of N passes of 64 x 64 of
      // which 16 rows or fewer are real. P^T and dS^T go to the slots' first 16 queries: all that
      // the key warpgroups (one k16 step) and dQ (rows past T are not stored) read.
      const auto few_rows = [&](auto tiles_c) {
        constexpr int N = decltype(tiles_c)::value;  // n (not taken in key blocks)
        for (int c = 0; c < N; ++c) mbar_wait(s_bar + 8 * c, 0);  // only waits at n = 1
        wgmma::fence_proxy_async();
        float st[N][8], dpt[N][8];  // (key 16 warp + g + 8h, query 8j + 2q + e) at [4j + 2h + e]
        wgmma::fence();
#pragma unroll
        for (int c = 0; c < N; ++c)
#pragma unroll
          for (int kk = 0; kk < HD / 16; ++kk)
            wgmma::Mma<16>::ss(st[c], wide_kdesc<HD>(s_k + c * kTile, kQTile, kk), wide_kdesc<HD>(q_i, kQTile, kk), kk > 0);
        wgmma::commit();
#pragma unroll
        for (int c = 0; c < N; ++c)
#pragma unroll
          for (int kk = 0; kk < HD / 16; ++kk)
            wgmma::Mma<16>::ss(dpt[c], wide_kdesc<HD>(s_v + c * kTile, kQTile, kk), wide_kdesc<HD>(do_i, kQTile, kk), kk > 0);
        wgmma::commit();
        if (i == 0)
          for (int c = 0; c < N; ++c) bar_sync(kDelta + c, 256);  // WG 2 has written the deltas, is done with the slots' O
        float lq[4], dq4[4];  // lse (times log2 e) and delta of queries 8j + 2q + e, at [2j + e]
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          lq[x] = stats[i * 128 + 8 * (x / 2) + 2 * q + x % 2] * kLog2e;
          dq4[x] = stats[i * 128 + 64 + 8 * (x / 2) + 2 * q + x % 2];
        }
        wgmma::wait<1>();  // S^T: P^T while dP^T is in flight; 0 for keys at or past T
#pragma unroll
        for (int c = 0; c < N; ++c)
#pragma unroll
          for (int x = 0; x < 8; ++x) {
            const int key = c * kQTile + warp * 16 + g + 8 * ((x >> 1) & 1);
            st[c][x] = key < T ? exp2_approx(fmaf(st[c][x], scale_log2, -lq[2 * (x >> 2) + (x & 1)])) : 0.0f;
          }
        wgmma::wait<0>();
#pragma unroll
        for (int c = 0; c < N; ++c) {
#pragma unroll
          for (int x = 0; x < 8; ++x) {  // (query r, key k) at slot_offset(r, k)
            const int jq = x >> 2, h8 = (x >> 1) & 1, e = x & 1;
            const uint32_t at = s_slot + c * kSlotBytes + jq * 1024 + (2 * warp + h8) * 128 + (2 * q + e) * 16 + g * 2;
            const float p = st[c][x];
            asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(at), "h"(__bfloat16_as_ushort(__float2bfloat16_rn(p))) : "memory");
            asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(at + 8192),
                         "h"(__bfloat16_as_ushort(__float2bfloat16_rn(p * (dpt[c][x] - dq4[2 * jq + e]))))
                         : "memory");
          }
        }
        wgmma::fence_proxy_async();
        for (int c = 0; c < N; ++c) {
          bar_arrive(kFull + c, 256);
          if (threadIdx.x == 0) trace(tr, kBwdSlotFull + 4 * i + c);
        }
      };
      if (!kKeyBlocks && i + 1 == n && last_k16 == 1) {  // (key blocks: under memcheck this path faulted)
        if (n == 1) few_rows(std::integral_constant<int, 1>{});
        else if (n == 2) few_rows(std::integral_constant<int, 2>{});
        else if (n == 3) few_rows(std::integral_constant<int, 3>{});
        else few_rows(std::integral_constant<int, 4>{});
      } else {
        for (int c = 0; c + 1 < nk; ++c) key_tile(c, std::integral_constant<int, 64>{});
        if (!holds_last_keys || last_k16 > 2) key_tile(nk - 1, std::integral_constant<int, 64>{});
        else if (last_k16 == 2) key_tile(nk - 1, std::integral_constant<int, 32>{});
        else key_tile(nk - 1, std::integral_constant<int, 16>{});
      }
      // Extra keys: S, dP over their 16-row tile (m64n16), P (0 at or past T), and dS as bf16
      // pairs in the A layout of dQ's last product (a0 row g, keys 2q, 2q + 1; a1 row g + 8; a2,
      // a3 keys 8 on). No key warpgroup takes them: WG 0 accumulates their dV and dK transposed.
      uint32_t extra_ds[4] = {0, 0, 0, 0};
      if constexpr (kExtraKeys) {
        if (i == 0) mbar_wait(s_kvbar + 8 * nk, 0);
        wgmma::fence_proxy_async();
        float sc[8], dp[8];
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          wgmma::Mma<16>::ss(sc, wide_kdesc<HD>(q_i, kQTile, kk), wide_kdesc<HD>(s_extra_k, 16, kk), kk > 0);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
          wgmma::Mma<16>::ss(dp, wide_kdesc<HD>(do_i, kQTile, kk), wide_kdesc<HD>(s_extra_v, 16, kk), kk > 0);
        wgmma::commit();
        wgmma::wait<0>();
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = nk * kQTile + 8 * j + 2 * q;
          float p[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            p[e] = key + (e & 1) < T ? exp2_approx(fmaf(sc[4 * j + e], scale_log2, e < 2 ? -l_lo : -l_hi)) : 0.0f;
          extra_ds[2 * j] = pack_bf16x2(p[0] * (dp[4 * j] - d_lo), p[1] * (dp[4 * j + 1] - d_lo));
          extra_ds[2 * j + 1] = pack_bf16x2(p[2] * (dp[4 * j + 2] - d_hi), p[3] * (dp[4 * j + 3] - d_hi));
          // P and dS also to shared memory: B operands of dV^T += dO_i^T P and dK^T += Q_i^T dS.
          const uint32_t at = 2 * warp * 256 + j * 128 + g * 16 + 4 * q;  // rows g and g + 8 (256 on)
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_extra_p + at), "r"(pack_bf16x2(p[0], p[1])) : "memory");
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_extra_p + at + 256), "r"(pack_bf16x2(p[2], p[3])) : "memory");
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_extra_p + kExtraSlotBytes + at), "r"(extra_ds[2 * j]) : "memory");
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_extra_p + kExtraSlotBytes + at + 256), "r"(extra_ds[2 * j + 1])
                       : "memory");
        }
        wgmma::fence_proxy_async();
        bar_sync(kRows, 128);  // every thread's P and dS stored
        // dV^T += dO_i^T P and dK^T += Q_i^T dS over this tile's queries, in a group of their own
        // (before dQ: its staging overwrites Q_i). A: the tile MN-major, M = its columns; at hd
        // 80 columns 64-79 as a second chunk whose four 16-row groups all read them (LBO 0).
        // Rows past T: P and dS meet zero dO and Q rows there.
        float dv_t[kExtraAcc], dk_t[kExtraAcc];
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t bp = wgmma::descriptor(s_extra_p + kk * 512, 256, 128);
          const uint64_t bds = wgmma::descriptor(s_extra_p + kExtraSlotBytes + kk * 512, 256, 128);
          wgmma::Mma<16>::ss_tt(dv_t, desc_step(wgmma::descriptor_sw128(do_i, kWideBytes, 1024), kk * 2048), bp, kk > 0);
          wgmma::Mma<16>::ss_tt(dk_t, desc_step(wgmma::descriptor_sw128(q_i, kWideBytes, 1024), kk * 2048), bds, kk > 0);
          if constexpr (HD == 80) {
            wgmma::Mma<16>::ss_tt<8>(dv_t, desc_step(wgmma::descriptor_sw32(do_i + kWideBytes, 0, 256), kk * 512), bp, kk > 0);
            wgmma::Mma<16>::ss_tt<8>(dk_t, desc_step(wgmma::descriptor_sw32(q_i + kWideBytes, 0, 256), kk * 512), bds, kk > 0);
          }
        }
        wgmma::commit();
        wgmma::wait<0>();
#pragma unroll
        for (int e = 0; e < kExtraAcc; ++e)
          if (e < 8 || warp == 0) {
            extra_acc[extra_slot(e)] += dv_t[e];
            extra_acc[extra_acc_floats(HD) + extra_slot(e)] += dk_t[e];
          }
      }
      // dQ_i = dS_i K over the n slots (K-major dS as A, K MN-major as B).
      bar_sync(kRows, 128);  // every thread of WG 0 has stored (and fenced) its part of the slots
      float dq[HD / 2];
      wgmma::fence();
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (c < nk) {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wide_mma<HD, false>(dq, wgmma::descriptor(s_slot + c * kSlotBytes + 8192 + kk * 256, 128, 1024),
                                s_k + c * kTile, kk, c > 0 || kk > 0);
        }
      }
      if constexpr (kExtraKeys) {  // + dS K over the extra keys: one k16 step, A from registers
        wgmma::Mma<64>::rs_bt(dq, extra_ds, wgmma::descriptor_sw128(s_extra_k, 16, 1024), 1);
        if constexpr (HD == 80) wgmma::Mma<16>::rs_bt<32>(dq, extra_ds, wgmma::descriptor_sw32(s_extra_k + 16 * 128, 2048, 256), 1);
      }
      wgmma::commit();
      wgmma::wait<0>();
      if (threadIdx.x == 0) trace(tr, kBwdDqComplete + i);
      if (i + 1 == n) bar_arrive(kDqDone, nk > kPer ? 384 : 256);  // the K tiles are free: to the key warpgroups with tiles
      // Both key warpgroups done with query tile i (EMPTY_c: its slots, Q_i and dO_i are free; the
      // key warpgroups arrive after their products' wgmma wait). Up to 256 tokens dQ (times the
      // scale) is staged as bf16 in Q_i's tile and stored by TMA (from the fragments each warp's
      // stores touch 8 rows' 16-byte pieces: ~0.6 us a tile); key blocks write it to their plane
      // and load query tile i + nb into Q_i's buffer (extra keys: stage it, and reload the buffer
      // before). By now the key warpgroups are mostly done:
      // their products of the last slot take less than the dQ MMAs above.
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (c < nk) bar_sync(kEmpty + c, 256);
      // Key blocks: Q_i, dO_i and their stats are read by now: query tile i + nb into their buffer
      // (from WG 0: the key warpgroups have no registers to spare), three tiles ahead of its use.
      if (kKeyBlocks && !kExtraKeys && i + nb < n && (threadIdx.x == 0 || threadIdx.x >= 128 - kLseLoaders))
        load_query(i + nb, 0, 128 - kLseLoaders);
      if constexpr (kKeyBlocks && !kExtraKeys) {
        // This key block's part of dQ_i (times the scale), fp32 into its own plane of dq_planes
        // ([key block][B, T, H, hd]); dq_planes_sum_kernel, after the launches, adds them in order.
        const int r_lo = i * kQTile + warp * 16 + g;
        float2* lo = reinterpret_cast<float2*>(dq_planes + ((size_t(kb) * gridDim.y * T + size_t(b) * T + r_lo) * H + h) * HD) + q;
        float2* hi = lo + 4 * H * HD;  // 8 rows on
        if (r_lo < T)
#pragma unroll
          for (int m = 0; m < HD / 8; ++m) lo[4 * m] = make_float2(dq[4 * m] * scale, dq[4 * m + 1] * scale);
        if (r_lo + 8 < T)
#pragma unroll
          for (int m = 0; m < HD / 8; ++m) hi[4 * m] = make_float2(dq[4 * m + 2] * scale, dq[4 * m + 3] * scale);
      } else {
        stage_fragments<HD>(smem + sb * kTile, dq, scale, scale, warp, g, q);
        bar_sync(kRows, 128);
        if (threadIdx.x == 0) {
          store_wide<HD>(q_i, &dqkv_map, &dqkv_tail, h * HD, i * kQTile, b);
        }
        // Extra keys: query tile i - 1 + nb into the previous tile's buffer, whose dQ store has
        // had this tile's time to read it (waiting on this tile's would hold WG 0).
        if (kExtraKeys && i >= 1 && i - 1 + nb < n && (threadIdx.x == 0 || threadIdx.x >= 128 - kLseLoaders)) {
          if (threadIdx.x == 0) tma::wait_read<1>();
          load_query(i - 1 + nb, 0, 128 - kLseLoaders);
        }
      }
      if (threadIdx.x == 0) trace(tr, kBwdDqStored + i);
    }
    if constexpr (kExtraKeys) {  // the extra keys' dV and dK (times the scale), from their transposes
      const int extra = T - nk * kQTile;  // 1 .. 16
      bf16* const rows = dqkv + (size_t(b) * T + nk * kQTile) * 3 * H * HD;
#pragma unroll
      for (int chunk = 0; chunk < kExtraAcc / 8; ++chunk)
#pragma unroll
        for (int v = 0; v < 8; ++v) {  // accumulator v: column (hd) m, key 8 (v / 4) + 2q + v % 2
          const int m = 64 * chunk + 16 * warp + g + 8 * ((v >> 1) & 1), key = 8 * (v >> 2) + 2 * q + (v & 1);
          if (m < HD && key < extra) {
            const int at = extra_slot(8 * chunk + v);
            rows[size_t(key) * 3 * H * HD + (2 * H + h) * HD + m] = __float2bfloat16_rn(extra_acc[at]);
            rows[size_t(key) * 3 * H * HD + (H + h) * HD + m] = __float2bfloat16_rn(extra_acc[extra_acc_floats(HD) + at] * scale);
          }
        }
    }
    if (threadIdx.x == 0) tma::wait_read();  // before the CTA exits
    trace_end(tr);
  } else {  // keys: dV, dK for key tiles kPer j .. kPer j + kPer - 1
    regs_inc<kKeyRegs>();
    const int j = wg - 1;
    if (!kKeyBlocks && j == 1) {  // first, delta = rowsum(dO * O) (0 past T) tile by tile for WG 0, O from slot t:
                   // two threads a row, on alternate 16-byte vectors
      float* stats_w = reinterpret_cast<float*>(smem + (s_stats - s_q));
      const int x = int(threadIdx.x) - 256, half = x & 1;
      for (int t = 0; t < n; ++t) {
        const int r = t * kQTile + x / 2;
        float sum = 0.0f;
        mbar_wait(s_bar + 8 * t, 0);  // dO's tile, O's in slot t
        const unsigned char* do_tile = smem + (s_do - s_q) + t * kTile;
        const unsigned char* o_tile = smem + (s_slot - s_q) + t * kSlotBytes;
        if (r < T) {
#pragma unroll
          for (int c = 0; c < HD / 16; ++c) {
            const uint4 d = *reinterpret_cast<const uint4*>(do_tile + wide_offset<HD>(kQTile, x / 2, 2 * c + half));
            const uint4 o = *reinterpret_cast<const uint4*>(o_tile + wide_offset<HD>(kQTile, x / 2, 2 * c + half));
            const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 of = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ow[e]));
              const float2 df = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dw[e]));
              sum = fmaf(of.x, df.x, fmaf(of.y, df.y, sum));
            }
          }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        if (half == 0) stats_w[t * 128 + 64 + x / 2] = sum;
        bar_arrive(kDelta + t, 256);
        if (x == 0) trace(tr, kBwdDelta + t);
      }
    }
    float dv[kPer][HD / 2], dk[kPer][HD / 2];
#pragma unroll
    for (int t = 0; t < kPer; ++t)
#pragma unroll
      for (int e = 0; e < HD / 2; ++e) dv[t][e] = dk[t][e] = 0.0f;
    if (kPer * j >= nk) {
      trace_end(tr);
      return;
    }
    for (int i = 0; i < n; ++i) {
      mbar_wait(s_bar + 8 * buf(i), phase(i));  // Q_i, dO_i
      wgmma::fence_proxy_async();
      const uint32_t q_i = s_q + buf(i) * kTile, do_i = s_do + buf(i) * kTile;
      // Over the tile's queries: 4 k16 steps, in a last, partial tile the 1 or 2 that cover them.
      const auto products = [&](auto steps) {
        constexpr int kSteps = decltype(steps)::value;
#pragma unroll
        for (int t = 0; t < kPer; ++t) {
          const int c = kPer * j + t;
          if (c < nk) {
            bar_sync(kFull + c, 256);
            const uint32_t slot = s_slot + c * kSlotBytes;
            wgmma::fence();
#pragma unroll
            for (int kk = 0; kk < kSteps; ++kk)
              wide_mma<HD, true>(dv[t], wgmma::descriptor(slot + kk * 2048, 1024, 128), do_i, kk, 1);
#pragma unroll
            for (int kk = 0; kk < kSteps; ++kk)
              wide_mma<HD, true>(dk[t], wgmma::descriptor(slot + 8192 + kk * 2048, 1024, 128), q_i, kk, 1);
            wgmma::commit();
          }
        }
      };
      if (i + 1 < n || last_k16 > 2) products(std::integral_constant<int, 4>{});
      else if (last_k16 == 2) products(std::integral_constant<int, 2>{});
      else products(std::integral_constant<int, 1>{});
      wgmma::wait<0>();
      // (Not at hd 80: there this stamp made the traced build spill, slowing the key warpgroups.)
      if (HD != 80 && threadIdx.x % 128 == 0) trace(tr, kBwdProducts + 4 * j + i);
      if (i + 1 < n)  // (after the last query tile: below, once dV is staged)
#pragma unroll
        for (int t = 0; t < kPer; ++t)
          if (kPer * j + t < nk) bar_arrive(kEmpty + kPer * j + t, 256);
    }
    // dV, then dK (times the scale), as bf16 through this warpgroup's own V tiles (WG 0 read them
    // last for dP of the last query tile, before it filled that tile's slot) and K tiles (after
    // WG 0's last dQ), each stored by TMA as soon as staged.
    const int key_wg_bar = kKeys + j;
    const bool issuer = threadIdx.x % 128 == 0;
#pragma unroll
    for (int part = 0; part < 2; ++part) {  // dV through the V tiles, then dK through the K tiles
      const uint32_t tiles = part == 0 ? s_v : s_k;
      if (part == 1) bar_sync(kDqDone, nk > kPer ? 384 : 256);  // WG 0's last dQ has read the K tiles
#pragma unroll
      for (int t = 0; t < kPer; ++t) {
        const float mult = part == 0 ? 1.0f : scale;
        if (kPer * j + t < nk)
          stage_fragments<HD>(smem + (tiles - s_q) + (kPer * j + t) * kTile, part == 0 ? dv[t] : dk[t], mult, mult, warp, g, q);
      }
      bar_sync(key_wg_bar, 128);
      if (part == 0)  // done with the last query tile's Q: WG 0 stages its dQ there
        for (int t = 0; t < kPer; ++t)
          if (kPer * j + t < nk) bar_arrive(kEmpty + kPer * j + t, 256);
      if (issuer) {
        trace(tr, kBwdStaged + 2 * part + j);
        for (int c = kPer * j; c < min(kPer * j + kPer, nk); ++c)
          store_wide<HD>(tiles + c * kTile, &dqkv_map, &dqkv_tail, ((part == 0 ? 2 : 1) * H + h) * HD,
                         (kt0 + c) * kQTile, b);
        trace(tr, kBwdWritten + 2 * part + j);
      }
    }
    if (issuer) tma::wait_read();
    trace_end(tr);
  }
}


// ---------------------------------------------------------------------------------------------
// Forward: one CTA of W = 2 or 4 warpgroups per (image, head) (forward_shape). K and V (rows up
// to kv_rows(T): the last tile only as far as its rows reach, rounded to 16 or 64) are loaded
// once, tile t on mbarrier t, by TMA (one thread issues them; the warps' own cp.async took ~30% of
// their time). Warpgroup w takes query tiles w, w + W, ...; Q tile i lands in buffer i % q_slots
// on the buffer's own mbarrier. Every Q tile has its buffer (q_slots = n) where they all fit
// beside K and V (up to 256 tokens, and longer at hd 64 and 80); else 2 W or W buffers are
// reused: once tile i's output has left its buffer, the warpgroup loads its tile i + q_slots
// there. Per query tile, an online softmax over key chunks of 64 (the last as wide as kv_rows
// leaves it):
//   S = Q_i K_c^T (A, B K-major in shared memory), P = exp(S scale - m) in registers, packed to
//   bf16 as the A operand of O += P V_c (V MN-major as B), which runs while the next chunk's S
//   is issued. O / l goes out through the tile's Q buffer by a TMA store.
// 128 registers a thread and, at T <= 208 and hd 80 (272 at hd 64), under half the shared memory:
// two CTAs an SM, so that one loads while the other computes.
__host__ __device__ constexpr int last_width(int T) {  // key columns computed in the last chunk
  // 16 or 64 (a third width, 32, makes ptxas spill at hd 80)
  return T - (tiles(T) - 1) * kQTile <= 16 ? 16 : 64;
}
// Bytes of the K (or V) tiles: whole ones, the last 16 rows where that covers it, padded to 1024
// bytes (the 128-byte swizzle's alignment, for V's first tile).
__host__ __device__ constexpr int kv_bytes(int T, int hd) {
  return (tiles(T) - 1) * q_bytes(hd) + (last_width(T) == kQTile ? q_bytes(hd) : (16 * hd * 2 + 1023) / 1024 * 1024);
}
// Q buffers (q_slots of them), K, V, then n + q_slots mbarriers (K_t and V_t on t, Q buffer s on n + s).
__host__ __device__ constexpr int fwd_smem_bytes(int T, int hd, int q_slots) {
  return q_slots * q_bytes(hd) + 2 * kv_bytes(T, hd) + 8 * (tiles(T) + q_slots);
}
// Q buffers for (T, hd) and W warpgroups in smem bytes: one a tile where all fit, else 2 W or W
// (a warpgroup's tiles take every W-th buffer), else 0: the shape does not fit.
__host__ __device__ constexpr int fwd_q_slots(int T, int hd, int W, int smem) {
  return fwd_smem_bytes(T, hd, tiles(T)) <= smem  ? tiles(T)
         : fwd_smem_bytes(T, hd, 2 * W) <= smem   ? 2 * W
         : fwd_smem_bytes(T, hd, W) <= smem       ? W
                                                  : 0;
}

template <int HD, int kWgs>
__global__ void __launch_bounds__(128 * kWgs, kWgs == 2 && HD <= 80 ? 2 : 1)  // hd 128: O alone is 64 registers
    attention_forward_resident_kernel(const __grid_constant__ CUtensorMap qkv_map, const __grid_constant__ CUtensorMap qkv_upper,
                                      const __grid_constant__ CUtensorMap narrow_map, const __grid_constant__ CUtensorMap narrow_upper,
                                      const __grid_constant__ CUtensorMap v_chunks, const __grid_constant__ CUtensorMap v_chunks_narrow,
                                      const __grid_constant__ CUtensorMap out_map, const __grid_constant__ CUtensorMap out_upper,
                                      float* __restrict__ lse, int T, int H, float scale, int q_slots) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned long long* const tr = trace_row();
  constexpr int kTile = q_bytes(HD);
  const int n = tiles(T);
  const uint32_t s_q = smem_addr(smem), s_k = s_q + q_slots * kTile, s_v = s_k + kv_bytes(T, HD),
                 s_bar = s_v + kv_bytes(T, HD), s_qbar = s_bar + 8 * n;
  const int h = blockIdx.x, b = blockIdx.y;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2,
            q = lane & 3;
  const int last_rows = last_width(T);  // rows of the last K and V tiles (16 or 64)
  // Q tile i into its buffer, on the buffer's mbarrier (issued by one thread).
  const auto load_q = [&](int i) {
    const uint32_t bar = s_qbar + 8 * (i % q_slots);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kTile) : "memory");
    load_wide<HD>(s_q + (i % q_slots) * kTile, kQTile, &qkv_map, &qkv_upper, h * HD, i * kQTile, b, bar);
  };

  // Every tile comes by TMA, issued by thread 0 (later Q tiles, into reused buffers, by their
  // warpgroup's first thread), K_t and V_t on mbarrier t, in the wide layout (columns 0-63, then
  // 64-HD through the *_upper maps); rows at or past T arrive as zeros (the tensor maps end at T:
  // K's then get probability 0 by the mask, and V's add nothing). The last K and V tiles, if 16
  // rows, through the narrow maps.
  if (threadIdx.x == 0)
    for (int t = 0; t < n + q_slots; ++t) mbar_init(s_bar + 8 * t, 1);
  if (threadIdx.x == 0) trace_start(tr);
  __syncthreads();
  if (threadIdx.x == 0) {
    trace(tr, kFwdIssueBegins);
    for (int t = 0; t < n; ++t) {
      if (t < q_slots) load_q(t);
      const uint32_t bar = s_bar + 8 * t;
      const bool narrow = t + 1 == n && last_rows < kQTile;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                   "r"(2 * (narrow ? last_rows : kQTile) * HD * 2)
                   : "memory");
      for (int part = 1; part < 3; ++part) {  // K, V
        const uint32_t dst = (part == 1 ? s_k : s_v) + t * kTile;
        const int col = (part * H + h) * HD;
        if (HD == 80 && part == 2) {  // V at hd 80: 32-byte-swizzle chunks (chunks_mn_desc)
          tma::load_4d(dst, narrow ? &v_chunks_narrow : &v_chunks, 0, t * kQTile, col / 16, b, bar);
          continue;
        }
        load_wide<HD>(dst, narrow ? 16 : kQTile, narrow ? &narrow_map : &qkv_map, narrow ? &narrow_upper : &qkv_upper, col,
                      t * kQTile, b, bar);
      }
    }
    trace(tr, kFwdIssued);
  }

  const float scale_log2 = scale * kLog2e;
  for (int i = wg; i < n; i += kWgs) {
    const uint32_t q_i = s_q + (i % q_slots) * kTile;
    float o[HD / 2];
    uint32_t pa[4][4];  // P as bf16 A fragments, one k16 step (16 keys) each
#pragma unroll
    for (int e = 0; e < HD / 2; ++e) o[e] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;  // rows g and g + 8 of the warp
    mbar_wait(s_qbar + 8 * (i % q_slots), (i / q_slots) & 1);  // Q_i

    // Key chunk c, its first W columns: S = Q_i K_c^T while the previous chunk's O += P V may
    // still run, then the softmax, then O += P V_c, left running.
    const auto chunk = [&](int c, auto width) {
      constexpr int W = decltype(width)::value;
      float sc[W / 2];
      mbar_wait(s_bar + 8 * c, 0);  // K_c, V_c
      if (threadIdx.x % 128 == 0 && i == wg && wg < 2 && c < 4) trace(tr, kFwdLanded + 4 * wg + c);
      wgmma::fence_proxy_async();
      wgmma::fence();
      // K_c and V_c have W rows (64, or 16 in a narrow last tile): their columns past 64 start at W * 128.
      const uint32_t k_c = s_k + c * kTile;
      const uint64_t q_desc = wgmma::descriptor_sw128(q_i, 16, 1024), k_desc = wgmma::descriptor_sw128(k_c, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk)
        wgmma::Mma<W>::ss(sc, kk < 4 ? desc_step(q_desc, kk * 32) : wide_kdesc<HD>(q_i, kQTile, kk),
                          kk < 4 ? desc_step(k_desc, kk * 32) : wide_kdesc<HD>(k_c, W, kk), kk > 0);
      wgmma::commit();
      wgmma::wait<0>();  // S, and O += P V of chunk c - 1 (o and pa are free)
      if (c + 1 == n) {  // keys at or past T: score -inf, probability 0
#pragma unroll
        for (int j = 0; j < W / 8; ++j) {
          const int key = c * kQTile + 8 * j + 2 * q;
          if (key >= T) sc[4 * j] = sc[4 * j + 2] = -INFINITY;
          if (key + 1 >= T) sc[4 * j + 1] = sc[4 * j + 3] = -INFINITY;
        }
      }
      float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
      for (int j = 0; j < W / 8; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(sc[4 * j], sc[4 * j + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      // Every chunk has a real key, so the maxima are finite; the first correction is exp2(-inf) = 0.
      const float corr_lo = exp2_approx((m_lo - mx_lo) * scale_log2), corr_hi = exp2_approx((m_hi - mx_hi) * scale_log2);
      m_lo = mx_lo, m_hi = mx_hi;
      const float neg_lo = -mx_lo * scale_log2, neg_hi = -mx_hi * scale_log2;
      float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
      for (int j = 0; j < W / 8; ++j) {
        const float p0 = exp2_approx(fmaf(sc[4 * j], scale_log2, neg_lo));
        const float p1 = exp2_approx(fmaf(sc[4 * j + 1], scale_log2, neg_lo));
        const float p2 = exp2_approx(fmaf(sc[4 * j + 2], scale_log2, neg_hi));
        const float p3 = exp2_approx(fmaf(sc[4 * j + 3], scale_log2, neg_hi));
        sum_lo += p0 + p1;
        sum_hi += p2 + p3;
        pa[j / 2][(j % 2) * 2] = pack_bf16x2(p0, p1);      // a0 / a2: row g, keys 16 (j/2) + 8 (j%2) + 2q
        pa[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(p2, p3);  // a1 / a3: row g + 8
      }
      l_lo = fmaf(l_lo, corr_lo, sum_lo);
      l_hi = fmaf(l_hi, corr_hi, sum_hi);
#pragma unroll
      for (int e = 0; e < HD / 8; ++e) {
        o[4 * e] *= corr_lo, o[4 * e + 1] *= corr_lo;
        o[4 * e + 2] *= corr_hi, o[4 * e + 3] *= corr_hi;
      }
      wgmma::fence();  // o and pa written before the wgmmas read them
      // V_c as B MN-major: at hd 80 its chunks in one MMA; else wide, columns 0-63 in one MMA and
      // at hd 128 columns 64-127 in another.
      const uint32_t v_c = s_v + c * kTile;
#pragma unroll
      for (int kk = 0; kk < W / 16; ++kk) {
        if constexpr (HD == 80) {
          wgmma::Mma<80>::rs_bt(o, pa[kk], desc_step(chunks_mn_desc(v_c, W), kk * 512), 1);
        } else {
          wgmma::Mma<64>::rs_bt(o, pa[kk], desc_step(wgmma::descriptor_sw128(v_c, 16, 1024), kk * 2048), 1);
          if constexpr (HD == 128)
            wgmma::Mma<64>::rs_bt<32>(o, pa[kk], desc_step(wide_upper_desc<HD>(v_c, W), kk * 2048), 1);
        }
      }
      wgmma::commit();
      if (threadIdx.x % 128 == 0 && i < 4 && c < 4) trace(tr, kFwdChunk + 4 * i + c);
    };
    const int last_w = last_width(T);
    if constexpr (HD == 64) {
      // The narrow last chunk chosen inside the loop: with the two after each other ptxas spilled
      // 52 bytes here (ten reloads a chunk). At hd 80 this form was 2% slower, and neither spills.
      for (int c = 0; c < n; ++c) {
        if (c + 1 == n && last_w == 16) chunk(c, std::integral_constant<int, 16>{});
        else chunk(c, std::integral_constant<int, 64>{});
      }
    } else {
      for (int c = 0; c + 1 < n; ++c) chunk(c, std::integral_constant<int, 64>{});
      if (last_w == 16) chunk(n - 1, std::integral_constant<int, 16>{});
      else chunk(n - 1, std::integral_constant<int, 64>{});
    }
    wgmma::wait<0>();
    if (threadIdx.x % 128 == 0 && i < 4) trace(tr, kFwdComplete + i);

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const int r_lo = i * kQTile + warp * 16 + g, r_hi = r_lo + 8;
    float* lse_bh = lse + (size_t(b) * H + h) * T;
    if (q == 0) {
      if (r_lo < T) lse_bh[r_lo] = m_lo * scale + logf(l_lo);
      if (r_hi < T) lse_bh[r_hi] = m_hi * scale + logf(l_hi);
    }
    // O / l as bf16 through this warpgroup's Q_i tile (its last reader, S, has completed), stored by TMA.
    bar_sync(1 + wg, 128);  // every warp of the warpgroup is past its S products
    stage_fragments<HD>(smem + (i % q_slots) * kTile, o, 1.0f / l_lo, 1.0f / l_hi, warp, g, q);
    bar_sync(1 + wg, 128);
    if (threadIdx.x % 128 == 0) {
      if (i < 4) trace(tr, kFwdStaged + i);
      store_wide<HD>(q_i, &out_map, &out_upper, h * HD, i * kQTile, b);
      if (i < 4) trace(tr, kFwdStored + i);
      if (i + q_slots < n) {  // the buffer's next tile, once the store has read it
        tma::wait_read();
        load_q(i + q_slots);
      }
    }
  }
  if (threadIdx.x % 128 == 0) tma::wait_read();  // the stores have read this warpgroup's tiles
  trace_end(tr);
}

}  // namespace

namespace {
bool sm90a(const DeviceInfo& info) { return info.major == 9 && info.minor == 0; }  // wgmma, setmaxnreg

// The forward's warpgroups and Q buffers at (T, hd); q_slots 0 where it does not fit. Two
// warpgroups where two CTAs share an SM (one loads while the other computes: at hd 64 up to 272
// tokens, at hd 80 up to 208); else, at hd 64 and 80, four where they fit (16 warps on the SM
// instead of 8: 11-15% faster at 236, 256, 257 and 577 tokens, BENCHMARKS.md 31). hd 128 takes
// 178 registers a thread: two warpgroups only.
struct ForwardShape {
  int warpgroups, q_slots;
};
ForwardShape forward_shape(int T, int hd, const DeviceInfo& info) {
  const int two = fwd_q_slots(T, hd, 2, info.smem_optin);
  const bool two_an_sm = 2 * (fwd_smem_bytes(T, hd, two) + info.smem_reserved) <= info.smem_per_sm;
  if (hd <= 80 && two > 0 && !two_an_sm) {
    const int four = fwd_q_slots(T, hd, 4, info.smem_optin);
    if (four > 0) return {4, four};
  }
  return {2, two};
}

// A [B, T, columns] bf16 tensor seen as tiles of `rows` rows of one head's V in 32-byte-swizzle
// chunks (chunks_mn_desc): dims (element of a 16-column chunk, row, chunk, image), box {16, rows,
// hd / 16, 1}. Rows end at T: a box past them is filled with zeros.
CUtensorMap chunks_map(const bf16* data, int B, int T, int columns, int hd, int rows) {
  const cuuint64_t cols = cuuint64_t(columns);
  const cuuint64_t dims[4] = {16, cuuint64_t(T), cols / 16, cuuint64_t(B)};
  const cuuint64_t strides[3] = {cols * 2, 32, cuuint64_t(T) * cols * 2};  // bytes, dims 1..3
  const cuuint32_t box[4] = {16, cuuint32_t(rows), cuuint32_t(hd / 16), 1};
  return tma::encode(data, 4, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_32B, "attention resident forward");
}
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

#ifdef ATTENTION_TRACE
void attention_trace::set_buffer(unsigned long long* buffer) {
  CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &buffer, sizeof buffer));
}
#endif

namespace {
constexpr int kKeyBlockMaxT = 1024;  // key blocks: the dQ planes' workspace grows as T^2
int key_blocks(int T, int hd) { return (tiles(T) + block_tiles(hd) - 1) / block_tiles(hd); }
// Key blocks' shared memory: 4 query tiles' Q, dO, lse and delta with their mbarriers, and a
// block's K, V, slots and K_c, V_c mbarriers (at hd 64 and 80 what 256 tokens take, and 4 more
// mbarriers; at hd 128 226 KB of the 227).
constexpr int key_block_smem_bytes(int hd) {
  return 4 * (2 * q_bytes(hd) + 512 + 8) + block_tiles(hd) * (2 * q_bytes(hd) + kSlotBytes + 8);
}
static_assert(key_block_smem_bytes(64) == smem_bytes(4, 64) + 8 * 4 && key_block_smem_bytes(128) <= 227 * 1024,
              "key blocks' shared memory");
// Extra keys (257 to 272 tokens at hd 64 and 80): 3 query buffers, 4 key tiles, the extra keys' K,
// V, P, dS, the sums of their dV and dK, and their mbarrier (226 KB at hd 80).
constexpr int kExtraKeysMax = 16;
constexpr int extra_keys_smem_bytes(int hd) {
  return query_buffers(true) * (2 * q_bytes(hd) + 512 + 8) + 4 * (2 * q_bytes(hd) + kSlotBytes + 8) + 2 * narrow_bytes(hd) +
         2 * kExtraSlotBytes + 2 * 4 * extra_acc_floats(hd) + 8;
}
// (attention_resident_fits checks key_block_smem_bytes, which must cover it.)
static_assert(extra_keys_smem_bytes(64) <= key_block_smem_bytes(64) && extra_keys_smem_bytes(80) <= key_block_smem_bytes(80),
              "extra keys' shared memory");
bool extra_keys_apply(int T, int hd) { return (hd == 64 || hd == 80) && T > 4 * kQTile && T <= 4 * kQTile + kExtraKeysMax; }

// dqkv's Q columns = the sum of the key blocks' dQ planes ([planes][B * T, H * hd] fp32), in
// plane order (deterministic), as bf16. Four columns a thread, every plane's load issued before
// the first add (count <= kMax: 4 at hd 64 and 80, 8 at hd 128, whose blocks are half as wide).
constexpr int kMaxPlanes = 8;  // key blocks up to kKeyBlockMaxT = 1024 tokens (hd 128: 2 tiles a block)
template <int kMax>
__global__ void dq_planes_sum_kernel(const float4* __restrict__ planes, int count, size_t plane_quads, bf16* __restrict__ dqkv,
                                     int row_quads) {
  for (size_t p = blockIdx.x * size_t(blockDim.x) + threadIdx.x; p < plane_quads; p += size_t(gridDim.x) * blockDim.x) {
    float4 v[kMax];
#pragma unroll
    for (int k = 0; k < kMax; ++k)
      if (k < count) v[k] = planes[k * plane_quads + p];
    float4 sum = v[0];
#pragma unroll
    for (int k = 1; k < kMax; ++k)
      if (k < count) sum.x += v[k].x, sum.y += v[k].y, sum.z += v[k].z, sum.w += v[k].w;
    const size_t row = p / row_quads, quad = p % row_quads;  // dqkv rows are 3 H hd wide: Q first
    const __nv_bfloat162 lo = __floats2bfloat162_rn(sum.x, sum.y), hi = __floats2bfloat162_rn(sum.z, sum.w);
    reinterpret_cast<uint2*>(dqkv)[row * 3 * row_quads + quad] =
        make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }
}

// hd 64 and 80 past 256 tokens (up to there one CTA holds every tile), hd 128 at every length.
bool key_blocks_apply(int T, int hd) {
  return T >= 1 && T <= kKeyBlockMaxT && ((hd == 128) || ((hd == 64 || hd == 80) && T > 4 * kQTile));
}
}  // namespace

bool attention_resident_fits(int T, int hd, int dev) {
  const DeviceInfo info = device_info(dev);
  const bool blocks = key_blocks_apply(T, hd);
  const int smem = blocks ? key_block_smem_bytes(hd) : smem_bytes(tiles(T), hd);
  return (hd == 64 || hd == 80 || hd == 128) && T >= 1 && (T <= 4 * kQTile || blocks) && sm90a(info) &&
         smem <= info.smem_optin;
}

bool attention_resident_takes_delta(int T, int hd) { return key_blocks_apply(T, hd); }

size_t attention_resident_dq_plane_floats(int B, int T, int H, int hd) {
  return key_blocks_apply(T, hd) && !extra_keys_apply(T, hd) ? size_t(key_blocks(T, hd)) * B * T * H * hd : 0;
}

void attention_backward_resident(const bf16* qkv, const bf16* out, const bf16* dout, const float* lse, const float* delta,
                                 float* dq_planes, bf16* dqkv, int B, int T, int H, int hd, int dev, cudaStream_t stream) {
  ENSURE(attention_resident_fits(T, hd, dev), "attention_backward_resident: T " + std::to_string(T) + ", hd " +
                                                  std::to_string(hd) + " is not its shape (hd 64, 80 or 128, up to 1024 tokens; sm_90a)");
  const bool blocks = key_blocks_apply(T, hd), extra = extra_keys_apply(T, hd);
  ENSURE(!blocks || (delta && (dq_planes || extra)),
         "attention_backward_resident: in key blocks it takes delta and the dQ planes");
  // The maps once, for every launch below (the 16-row ones for the extra keys' K and V).
  const auto qkv_maps = wide_maps(qkv, B, T, 3 * H * hd, hd, kQTile), dqkv_maps = wide_maps(dqkv, B, T, 3 * H * hd, hd, kQTile);
  const auto do_maps = wide_maps(dout, B, T, H * hd, hd, kQTile), out_maps = wide_maps(out, B, T, H * hd, hd, kQTile);
  const auto narrow_maps = extra ? wide_maps(qkv, B, T, 3 * H * hd, hd, 16) : qkv_maps;
  // kTiles key tiles a CTA (0: T <= 256), blocks first .. first + count - 1, their dQ into planes.
  const auto launch = [&](auto hd_c, auto tiles_c, auto last_c, auto extra_c, int first, int count) {
    constexpr int HD = decltype(hd_c)::value, kTiles = decltype(tiles_c)::value;
    constexpr bool kLast = decltype(last_c)::value, kExtra = decltype(extra_c)::value;
    constexpr auto kernel = &attention_backward_resident_kernel<HD, kTiles, kLast, kExtra>;
    // The attribute is set once, for the largest (key blocks'; the static_asserts above); smaller
    // launch under it.
    const int smem = kExtra ? extra_keys_smem_bytes(HD) : kTiles ? key_block_smem_bytes(HD) : smem_bytes(tiles(T), HD);
    prepare_kernel<kernel>(dev, key_block_smem_bytes(HD));
    kernel<<<dim3(H, B, count), kThreads, smem, stream>>>(
        qkv_maps.first, do_maps.first, dqkv_maps.first, qkv_maps.second, do_maps.second, dqkv_maps.second, out_maps.first,
        out_maps.second, narrow_maps.first, narrow_maps.second, lse, delta, dq_planes, dqkv, first, T, H,
        1.0f / std::sqrt(static_cast<float>(HD)));
    LAUNCH_CHECK();
  };
  using Zero = std::integral_constant<int, 0>;
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  using Plain = std::false_type;
  if (extra) {  // 257 to 272 tokens: one CTA with every key
    if (hd == 64) launch(std::integral_constant<int, 64>{}, Four{}, std::false_type{}, std::true_type{}, 0, 1);
    else launch(std::integral_constant<int, 80>{}, Four{}, std::false_type{}, std::true_type{}, 0, 1);
    return;
  }
  if (!blocks) {
    if (hd == 64) launch(std::integral_constant<int, 64>{}, Zero{}, std::true_type{}, Plain{}, 0, 1);
    else launch(std::integral_constant<int, 80>{}, Zero{}, std::true_type{}, Plain{}, 0, 1);
    return;
  }
  // Key blocks: the whole ones, then the last with its 1 to block_tiles tiles.
  const int count = key_blocks(T, hd), last_tiles = tiles(T) - block_tiles(hd) * (count - 1);
  const auto launch_blocks = [&](auto hd_c) {
    constexpr int kWhole = block_tiles(decltype(hd_c)::value);
    if (count > 1) launch(hd_c, std::integral_constant<int, kWhole>{}, std::false_type{}, Plain{}, 0, count - 1);
    if (last_tiles == 1) launch(hd_c, One{}, std::true_type{}, Plain{}, count - 1, 1);
    else if (last_tiles == 2) launch(hd_c, Two{}, std::true_type{}, Plain{}, count - 1, 1);
    else if constexpr (kWhole == 4) {
      if (last_tiles == 3) launch(hd_c, std::integral_constant<int, 3>{}, std::true_type{}, Plain{}, count - 1, 1);
      else launch(hd_c, Four{}, std::true_type{}, Plain{}, count - 1, 1);
    }
  };
  if (hd == 64) launch_blocks(std::integral_constant<int, 64>{});
  else if (hd == 80) launch_blocks(std::integral_constant<int, 80>{});
  else launch_blocks(std::integral_constant<int, 128>{});
  static_assert((kKeyBlockMaxT + kQTile - 1) / kQTile <= block_tiles(128) * kMaxPlanes, "more planes than the sum takes");
  const size_t plane_quads = size_t(B) * T * H * hd / 4;
  const int planes = key_blocks(T, hd);
  (planes <= kMaxPlanes / 2 ? dq_planes_sum_kernel<kMaxPlanes / 2> : dq_planes_sum_kernel<kMaxPlanes>)
      <<<grid_stride_blocks(plane_quads, 256), 256, 0, stream>>>(reinterpret_cast<const float4*>(dq_planes), planes,
                                                                 plane_quads, dqkv, H * hd / 4);
  LAUNCH_CHECK();
}

bool attention_forward_resident_fits(int T, int hd, int dev) {
  const DeviceInfo info = device_info(dev);
  return (hd == 64 || hd == 80 || hd == 128) && T >= 1 && sm90a(info) && forward_shape(T, hd, info).q_slots > 0;
}

bool attention_forward_resident_preferred(int T, int hd, int dev) {
  // Faster from two tiles: at hd 64 and 80 (BENCHMARKS.md 27), and at hd 128 since its kernels'
  // later changes (11-21% at 65-128 tokens, BENCHMARKS.md 41; in 28 the streamed one tied or won
  // there). Past 256 tokens 23-39% faster at ViT's batches (257 and 577 tokens, BENCHMARKS.md 31).
  return tiles(T) >= 2 && attention_forward_resident_fits(T, hd, dev);
}


void attention_forward_resident(const bf16* qkv, bf16* out, float* lse, int B, int T, int H, int hd, int dev,
                                cudaStream_t stream) {
  ENSURE(attention_forward_resident_fits(T, hd, dev), "attention_forward_resident: T " + std::to_string(T) + ", hd " +
                                                          std::to_string(hd) + " is not its shape (hd 64, 80 or 128, K and V in shared memory, sm_90a)");
  const DeviceInfo info = device_info(dev);
  const ForwardShape shape = forward_shape(T, hd, info);
  const int W = shape.warpgroups, q_slots = shape.q_slots;
  const auto launch = [&](auto hd_c, auto w_c) {
    constexpr int HD = decltype(hd_c)::value, kW = decltype(w_c)::value;
    prepare_kernel<&attention_forward_resident_kernel<HD, kW>>(dev, info.smem_optin);  // the largest
    // The 16-row tiles' maps (and hd 80's V chunks) only where the shape has a narrow last tile.
    const bool narrow = last_width(T) < kQTile;
    const auto qkv64 = wide_maps(qkv, B, T, 3 * H * HD, HD, kQTile), out64 = wide_maps(out, B, T, H * HD, HD, kQTile);
    const auto qkv16 = narrow ? wide_maps(qkv, B, T, 3 * H * HD, HD, 16) : qkv64;
    const CUtensorMap v64 = HD == 80 ? chunks_map(qkv, B, T, 3 * H * HD, HD, kQTile) : qkv64.first;
    attention_forward_resident_kernel<HD, kW><<<dim3(H, B), 128 * kW, fwd_smem_bytes(T, HD, q_slots), stream>>>(
        qkv64.first, qkv64.second, qkv16.first, qkv16.second, v64,
        HD == 80 && narrow ? chunks_map(qkv, B, T, 3 * H * HD, HD, 16) : v64, out64.first, out64.second, lse, T, H,
        1.0f / std::sqrt(static_cast<float>(HD)), q_slots);
    LAUNCH_CHECK();
  };
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  if (hd == 64) W == 4 ? launch(std::integral_constant<int, 64>{}, Four{}) : launch(std::integral_constant<int, 64>{}, Two{});
  else if (hd == 80) W == 4 ? launch(std::integral_constant<int, 80>{}, Four{}) : launch(std::integral_constant<int, 80>{}, Two{});
  else launch(std::integral_constant<int, 128>{}, Two{});
}
