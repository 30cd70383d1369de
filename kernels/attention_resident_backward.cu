// The resident attention backward on Hopper's warpgroup MMAs (wgmma, sm_90a), every operand
// resident in shared memory (kernels/attention_resident.cuh): one CTA per (image, head), T <= 256,
// hd 64 or 80 (past 256, and at hd 128, in key blocks, below). Q, K, V and dO are loaded once
// (n = ceil(T/64) tiles of 64 rows each) and S and dP are computed once, where the streamed
// kernels (attention_streamed_backward.cu) read the other side 4 times over and compute both twice.
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
// time, it makes ptxas serialize the wgmmas. The last query tile takes the key_tile path even where
// few_rows would apply (few_rows is for a lone partial tile, not a key block's last).
#include <cmath>
#include <string>
#include <utility>

#include "kernels/attention_resident.cuh"
#include "kernels/attention_resident.h"

namespace {
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

__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrives on bar once all of this thread's earlier cp.async have landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
template <int R>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

__device__ __forceinline__ uint32_t slot_offset(int r, int k) {  // byte of (query r, key k), k even
  return uint32_t((r >> 3) * 1024 + (k >> 3) * 128 + (r & 7) * 16 + (k & 7) * 2);
}

// kKeyTiles 0: one CTA per (head, image), T <= 256. Else key blocks: this CTA's key tiles,
// block_tiles (4; 2 at hd 128) or (the last block) fewer, fixed at compile time (a count worked out at run time makes ptxas
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
    // out of WG 0's loop into registers, and spills. (At hd 64 the re-read would cost time.)
    // The grid is (H, B, key blocks), as h and b above read it.
    int hh = h, bb = b;
    if constexpr (HD == 80) {
      asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(hh));
      asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(bb));
    }
    const uint32_t bar = s_bar + 8 * buf(i);
    if (int(threadIdx.x) == issuer) {
      mbar_expect_tx(bar, 2 * kTile);
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
      mbar_expect_tx(bar, 2 * kTile);
      load_kv_wide<HD>(s_k + c * kTile, s_v + c * kTile, kQTile, &qkv_map, &qkv_tail, H, h, (kt0 + c) * kQTile, b, bar);
    };
    if (threadIdx.x == 128) load_keys(0);
    if (threadIdx.x == 128 || (threadIdx.x >= 256 - kLseLoaders && threadIdx.x < 256)) load_query(0, 128, 256 - kLseLoaders);
    if (threadIdx.x == 128)
      for (int c = 1; c < nk; ++c) load_keys(c);
    if (kExtraKeys && threadIdx.x == 128) {  // the extra keys' K and V, 16 rows each
      const uint32_t bar = s_kvbar + 8 * nk;
      mbar_expect_tx(bar, 2 * narrow_tile_bytes(HD));
      load_kv_wide<HD>(s_extra_k, s_extra_v, 16, &narrow_map, &narrow_tail, H, h, nk * kQTile, b, bar);
    }
    if (threadIdx.x == 128 || (threadIdx.x >= 256 - kLseLoaders && threadIdx.x < 256))
      for (int i = 1; i < min(nb, n); ++i) load_query(i, 128, 256 - kLseLoaders);
  } else if (threadIdx.x == 128) {
    trace(tr, kBwdIssueBegins);
    for (int t = 0; t < n; ++t) {
      const uint32_t bar = s_bar + 8 * t;
      mbar_expect_tx(bar, 5 * kTile);
      for (int which = 0; which < 4; ++which) {  // Q, dO, K, V
        const int col = ((which < 2 ? 0 : (which - 1) * H) + h) * HD;
        const uint32_t dst = s_q + which * n * kTile + t * kTile;
        load_wide<HD>(dst, kQTile, which == 1 ? &do_map : &qkv_map, which == 1 ? &do_tail : &qkv_tail, col, t * kQTile, b,
                      bar);
      }
      // O's tile into slot t, for WG 2's delta before WG 0 first fills the slot (by TMA: loads by
      // the LSU would queue behind these, and WG 2 would begin its products late)
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
    // past 80 unused), summed over the query tiles in shared memory (in registers they would make ptxas
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
      if (!kKeyBlocks && i + 1 == n && last_k16 == 1) {  // (key blocks always take key_tile)
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
      // stores would touch 8 rows' 16-byte pieces); key blocks write it to their plane
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
}  // namespace

#ifdef ATTENTION_TRACE
void attention_trace::set_backward_buffer(unsigned long long* buffer) {
  CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &buffer, sizeof buffer));
}

void attention_trace::set_buffer(unsigned long long* buffer) {
  set_backward_buffer(buffer);
  set_forward_buffer(buffer);
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
