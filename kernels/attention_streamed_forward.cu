// The streamed attention forward (mma.sync, kernels/attention_mma.cuh): a block per 64-query
// tile of one (image, head), the keys and values streamed through shared memory in chunks of 64,
// an online softmax in registers; any T.
#include <algorithm>
#include <cmath>

#include "kernels/attention_mma.cuh"
#include "kernels/attention_streamed.h"

namespace {
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
  load_kv_chunk<HD>(s_k, s_v, k_src, v_src, qkv_ld, 0, 0, T);
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

  const auto issue = [&](int c, int buf) { load_kv_chunk<HD>(s_k, s_v, k_src, v_src, qkv_ld, c, buf, T); };
  stream_chunks(n_chunks, issue, [&](int c, int buf) {
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
  });

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
}  // namespace

int attention_streamed_smem_bytes(int hd) {
  return std::max(forward_smem_bytes(hd), std::max(dkdv_smem_bytes(hd), dq_smem_bytes(hd)));
}

void attention_forward_streamed(const bf16* qkv, bf16* out, float* lse, int B, int T, int H, int hd, int dev,
                                cudaStream_t stream) {
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
