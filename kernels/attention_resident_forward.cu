// The resident attention forward on Hopper's warpgroup MMAs (wgmma, sm_90a), K and V resident in
// shared memory (kernels/attention_resident.cuh).
// One CTA of W = 2 or 4 warpgroups per (image, head) (forward_shape). K and V (rows up
// to kv_rows(T): the last tile only as far as its rows reach, rounded to 16 or 64) are loaded
// once, tile t on mbarrier t, by TMA (one thread issues them, so the warps spend no time on
// loads). Warpgroup w takes query tiles w, w + W, ...; Q tile i lands in buffer i % q_slots
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
#include <cmath>
#include <string>
#include <utility>

#include "kernels/attention_resident.cuh"
#include "kernels/attention_resident.h"

namespace {
// The forward's V tiles at hd 80 stay in the 32-byte swizzle, 16-column chunks of `rows` rows
// (32-byte rows): one m64n80 MMA reads them MN-major (LBO the chunk stride), where the wide
// layout's two (64 + 16 columns) would make ptxas serialize the forward's MMAs (C7512). k16 step j
// is rows 16j .. 16j + 15.
__device__ __forceinline__ uint64_t chunks_mn_desc(uint32_t tile, int rows) {
  return wgmma::descriptor_sw32(tile, rows * 32, 256);
}

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
    mbar_expect_tx(bar, kTile);
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
      mbar_expect_tx(bar, 2 * (narrow ? last_rows : kQTile) * HD * 2);
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
      // The narrow last chunk chosen inside the loop: with the two after each other ptxas spills
      // here. At hd 80 the other form is the faster, and neither spills.
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
// The forward's warpgroups and Q buffers at (T, hd); q_slots 0 where it does not fit. Two
// warpgroups where two CTAs share an SM (one loads while the other computes: at hd 64 up to 272
// tokens, at hd 80 up to 208); else, at hd 64 and 80, four where they fit (16 warps on the SM
// instead of 8, more latency hidden). hd 128 takes 178 registers a thread: two warpgroups only.
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
}  // namespace

#ifdef ATTENTION_TRACE
void attention_trace::set_forward_buffer(unsigned long long* buffer) {
  CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &buffer, sizeof buffer));
}
#endif

bool attention_forward_resident_fits(int T, int hd, int dev) {
  const DeviceInfo info = device_info(dev);
  return (hd == 64 || hd == 80 || hd == 128) && T >= 1 && sm90a(info) && forward_shape(T, hd, info).q_slots > 0;
}

bool attention_forward_resident_preferred(int T, int hd, int dev) {
  // The faster from two query tiles on, at every head dim it takes; at one tile the streamed
  // kernel, which starts sooner, is.
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
