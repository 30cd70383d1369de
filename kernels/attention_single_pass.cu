// The single-pass attention backward for short sequences (mma.sync, kernels/attention_mma.cuh):
// one block per (image, head) holding K, V, Q and dO in shared memory, dS kept there for dQ.
#include <algorithm>
#include <cmath>

#include "kernels/attention_mma.cuh"
#include "kernels/attention_streamed.h"

namespace {
// ---------------------------------------------------------------------------------------------
// Single-pass backward for short sequences (T <= 96, hd 16/32/64/80). Grid (H, B), one block
// of ceil(T/16) warps per (image, head) with all of K, V, Q and dO in shared memory. Phase 1: warp
// w owns keys 16w..16w+15 (dK and dV accumulated in registers) and walks the queries two 16-query
// groups at a time as the dKdV kernel does (S^T, P^T, dV, dP^T, dS^T, dK), writing dS^T (bf16)
// into shared memory. Phase 2: warp w owns queries 16w..16w+15 and computes dQ = dS K from
// shared memory. Five products where the two-kernel path needs seven, delta = rowsum(dO * O)
// computed in the block (no delta kernel), every input read once. Padding keys get P^T = 0
// explicitly (their dS feeds dQ), padding queries through lse = +inf. Bounded at 96 tokens: past
// that one block of the warps it needs holds an SM alone, and the streamed kernels win.
constexpr int kSingleMaxT = 96;
constexpr int kSingleMaxWarps = kSingleMaxT / 16;
constexpr int kSingleThreads = kSingleMaxWarps * 32;
// Two blocks an SM (168 registers; K, V, Q, dO and dS^T take at most 88 KB a block at hd 80) and
// two 16-query groups a step.
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
}  // namespace

bool attention_single_pass_fits(int T, int hd, int dev) {
  return single_pass_hd(hd) && T <= kSingleMaxT &&
         single_pass_smem_bytes(hd, (T + 15) / 16 * 16) <= device_info(dev).smem_optin;
}

void attention_backward_single_pass(const bf16* qkv, const bf16* out, const bf16* dout, const float* lse, bf16* dqkv,
                                    int B, int T, int H, int hd, int dev, cudaStream_t stream) {
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
}
