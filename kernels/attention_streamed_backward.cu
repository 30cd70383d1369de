// The streamed attention backward (mma.sync, kernels/attention_mma.cuh), deterministic (no
// atomics): delta = rowsum(dO * O) by a kernel of its own; dK and dV from one kernel over key
// tiles, dQ from another over query tiles, each recomputing the scores, the other side streamed
// through shared memory; any T.
#include <algorithm>
#include <cmath>

#include "kernels/attention_mma.cuh"
#include "kernels/attention_streamed.h"

namespace {
constexpr int kDeltaThreads = 256;
constexpr int kDeltaGroup = 16;  // lanes per (token, head) row in the delta kernel

// delta[b, h, t] = sum_c dout[b*T + t, h*hd + c] * out[b*T + t, h*hd + c]. A group of 16 lanes per
// (token, head), one 8-element vector each (hd <= 128), then a shuffle reduction that stays inside
// the group (xor offsets below 16). No early exit: every lane of the warp joins the shuffles.

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

  stream_chunks(n_chunks, load_chunk, [&](int c, int buf) {
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
  });

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
  load_kv_chunk<HD>(s_k, s_v, k_src, v_src, qkv_ld, 0, 0, T);
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

  const auto issue = [&](int c, int buf) { load_kv_chunk<HD>(s_k, s_v, k_src, v_src, qkv_ld, c, buf, T); };
  stream_chunks(n_chunks, issue, [&](int c, int buf) {
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
  });

  if (live) {
    // dQ = scale * dS K, staged through the warp's own Q rows.
    store_warp_tile<HD>(smem + at<LD>(warp * 16, 0), dq, scale, scale,
                        dqkv + (size_t(b) * T + w_row0) * qkv_ld + h * HD, qkv_ld,
                        min(16, T - w_row0), lane);
  }
}
}  // namespace

void attention_delta(const bf16* out, const bf16* dout, float* delta, int B, int T, int H, int hd,
                     cudaStream_t stream) {
  const long long pairs = static_cast<long long>(B) * T * H;
  const long long pairs_per_block = kDeltaThreads / kDeltaGroup;
  const long long delta_blocks = (pairs + pairs_per_block - 1) / pairs_per_block;
  ENSURE(delta_blocks <= 0x7fffffffLL, "attention_backward: B*T*H too large for the delta grid");
  attention_delta_kernel<<<static_cast<unsigned>(delta_blocks), kDeltaThreads, 0, stream>>>(out, dout, delta, T, H, hd,
                                                                                             pairs);
  LAUNCH_CHECK();
}

void attention_backward_streamed(const bf16* qkv, const bf16* dout, const float* lse, const float* delta, bf16* dqkv,
                                 int B, int T, int H, int hd, int dev, cudaStream_t stream) {
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
