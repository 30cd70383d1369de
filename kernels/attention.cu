// Fused attention on the tensor cores through WMMA (bf16 16x16x16 fragments, fp32 accumulators).
//
// Each block owns a 64-row tile of one (image, head) and holds the whole key (forward, dQ) or
// query (dKdV) range of that (image, head) in shared memory, padded to Tp = T rounded up to 16.
// Matrix products go fragment -> fp32 shared memory; the softmax and the elementwise gradient
// steps run there, warp per row, and write bf16 operands for the next product. Padding rows of
// every bf16 operand are zero-filled and padding score columns are forced to probability 0, so
// nothing outside [0, T) contributes and no uninitialised shared memory is ever read.
#include "kernels/attention.h"

#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

#include "engine/check.h"
#include "engine/nvtx.h"

namespace {
namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;  // query rows (forward, dQ) or key rows (dKdV) per block
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxT = 4096;  // far beyond what fits; only keeps the size arithmetic in range
constexpr int kDeltaGroup = 16;  // lanes per (token, head) row in the delta kernel

__host__ __device__ constexpr int round_up16(int x) { return (x + 15) / 16 * 16; }

// Row strides in elements. bf16 rows are padded by 8 elements (16 bytes) and fp32 rows by 4, so
// that successive rows start in different banks; both keep WMMA's ldm rules (a multiple of 8 for
// 16-bit, of 4 for fp32 elements), and with hd and Tp multiples of 16 every 16x16 fragment
// pointer stays 32-byte aligned.
struct Strides {
  int hd_ld;  // bf16 rows of hd elements: Q, K, V, dO
  int p_ld;   // bf16 rows of Tp elements: P, dS
  int s_ld;   // fp32 rows of max(Tp, hd) elements: S, dP, and the fp32 outputs that reuse them
  __host__ __device__ Strides(int hd, int Tp)
      : hd_ld(hd + 8), p_ld(Tp + 8), s_ld((Tp > hd ? Tp : hd) + 4) {}
};

// Hands out byte offsets into dynamic shared memory, each region 128-byte aligned. The same code
// sizes the launch on the host and places the pointers on the device, so they cannot disagree.
struct SmemCarver {
  size_t bytes = 0;
  __host__ __device__ size_t take(size_t n) {
    const size_t at = bytes;
    bytes += (n + 127) / 128 * 128;
    return at;
  }
};

struct ForwardSmem {
  Strides ld;
  size_t q, k, v, s, p, bytes;
  __host__ __device__ ForwardSmem(int hd, int Tp) : ld(hd, Tp) {
    SmemCarver c;
    q = c.take(sizeof(bf16) * kTile * ld.hd_ld);
    k = c.take(sizeof(bf16) * Tp * ld.hd_ld);
    v = c.take(sizeof(bf16) * Tp * ld.hd_ld);
    s = c.take(sizeof(float) * kTile * ld.s_ld);
    p = c.take(sizeof(bf16) * kTile * ld.p_ld);
    bytes = c.bytes;
  }
};

struct DkdvSmem {
  Strides ld;
  size_t k, v, q, dout, lse, delta, s, p, bytes;
  __host__ __device__ DkdvSmem(int hd, int Tp) : ld(hd, Tp) {
    SmemCarver c;
    k = c.take(sizeof(bf16) * kTile * ld.hd_ld);
    v = c.take(sizeof(bf16) * kTile * ld.hd_ld);
    q = c.take(sizeof(bf16) * Tp * ld.hd_ld);
    dout = c.take(sizeof(bf16) * Tp * ld.hd_ld);
    lse = c.take(sizeof(float) * Tp);
    delta = c.take(sizeof(float) * Tp);
    s = c.take(sizeof(float) * kTile * ld.s_ld);
    p = c.take(sizeof(bf16) * kTile * ld.p_ld);
    bytes = c.bytes;
  }
};

struct DqSmem {
  Strides ld;
  size_t q, dout, k, v, s, p, bytes;
  __host__ __device__ DqSmem(int hd, int Tp) : ld(hd, Tp) {
    SmemCarver c;
    q = c.take(sizeof(bf16) * kTile * ld.hd_ld);
    dout = c.take(sizeof(bf16) * kTile * ld.hd_ld);
    k = c.take(sizeof(bf16) * Tp * ld.hd_ld);
    v = c.take(sizeof(bf16) * Tp * ld.hd_ld);
    s = c.take(sizeof(float) * kTile * ld.s_ld);
    p = c.take(sizeof(bf16) * kTile * ld.p_ld);
    bytes = c.bytes;
  }
};

// bf16 bits of (lo, hi) in one word, lo first: the memory order of two consecutive elements.
__device__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
}

// The two bf16 of a word as floats (exact: a bf16 is the high half of a float).
__device__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ float warp_max(float x) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// dst[r][0, HD) = src row r for r < valid_rows, zeros for valid_rows <= r < nrows: padding rows
// must be real zeros because they enter the matrix products (0 * garbage could be NaN).
template <int HD>
__device__ void load_rows(bf16* dst, int dst_ld, const bf16* __restrict__ src, size_t src_ld,
                          int nrows, int valid_rows) {
  constexpr int kChunks = HD / 8;  // 16-byte vectors per row
  for (int i = threadIdx.x; i < nrows * kChunks; i += kThreads) {
    const int r = i / kChunks;
    const int c = i % kChunks * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < valid_rows) v = *reinterpret_cast<const uint4*>(src + r * src_ld + c);
    *reinterpret_cast<uint4*>(dst + r * dst_ld + c) = v;
  }
}

// dst row r = bf16(mult * src[r][0, HD)) for r < nrows.
template <int HD>
__device__ void store_rows(bf16* __restrict__ dst, size_t dst_ld, const float* src, int src_ld,
                           int nrows, float mult) {
  constexpr int kChunks = HD / 8;
  for (int i = threadIdx.x; i < nrows * kChunks; i += kThreads) {
    const int r = i / kChunks;
    const int c = i % kChunks * 8;
    const float4 lo = *reinterpret_cast<const float4*>(src + r * src_ld + c);
    const float4 hi = *reinterpret_cast<const float4*>(src + r * src_ld + c + 4);
    // __stwb is the ordinary write-back store, spelled so that it stays one 16-byte store: the
    // plain assignment was split into four 4-byte stores in the dQ kernel.
    const uint4 packed =
        make_uint4(pack_bf16x2(mult * lo.x, mult * lo.y), pack_bf16x2(mult * lo.z, mult * lo.w),
                   pack_bf16x2(mult * hi.x, mult * hi.y), pack_bf16x2(mult * hi.z, mult * hi.w));
    __stwb(reinterpret_cast<uint4*>(dst + r * dst_ld + c), packed);
  }
}

// C[16*m_tiles, 16*n_tiles] (fp32, shared) = A[., 16*k_tiles] (bf16 row-major) * Bmat, the 16x16
// output tiles spread over the warps. Bmat is [16*k_tiles, 16*n_tiles]: with LayoutB row_major
// element (k, n) is at B[k * ldb + n]; with col_major at B[n * ldb + k], i.e. B holds Bmat's
// transpose row-major, which is how "times K^T" reads the row-major K tile directly.
template <typename LayoutB>
__device__ void mma_tiles(const bf16* A, int lda, const bf16* B, int ldb, float* C, int ldc,
                          int m_tiles, int n_tiles, int k_tiles) {
  constexpr bool kRowMajorB = std::is_same<LayoutB, wmma::row_major>::value;
  for (int t = threadIdx.x / 32; t < m_tiles * n_tiles; t += kWarps) {
    const int mt = t / n_tiles;
    const int nt = t % n_tiles;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kt = 0; kt < k_tiles; ++kt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LayoutB> b;
      wmma::load_matrix_sync(a, A + mt * 16 * lda + kt * 16, lda);
      const bf16* b_tile = kRowMajorB ? B + kt * 16 * ldb + nt * 16 : B + nt * 16 * ldb + kt * 16;
      wmma::load_matrix_sync(b, b_tile, ldb);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(C + mt * 16 * ldc + nt * 16, acc, ldc, wmma::mem_row_major);
  }
}

// Grid (ceil(T/64), H, B). Rows handled are [0, rows_pad): the tile's valid rows rounded up to 16,
// so the last, partial tile does no work on 16-row blocks that are pure padding.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_forward_kernel(const bf16* __restrict__ qkv, bf16* __restrict__ out,
                             float* __restrict__ lse, int T, int H, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Tp = round_up16(T);
  const ForwardSmem L(HD, Tp);
  bf16* Qs = reinterpret_cast<bf16*>(smem + L.q);
  bf16* Ks = reinterpret_cast<bf16*>(smem + L.k);
  bf16* Vs = reinterpret_cast<bf16*>(smem + L.v);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  bf16* Ps = reinterpret_cast<bf16*>(smem + L.p);

  const int q0 = blockIdx.x * kTile;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;  // token 0 of this (image, head)
  const int rows = min(kTile, T - q0);
  const int rows_pad = round_up16(rows);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  load_rows<HD>(Qs, L.ld.hd_ld, q_src + q0 * qkv_ld, qkv_ld, rows_pad, rows);
  load_rows<HD>(Ks, L.ld.hd_ld, q_src + D, qkv_ld, Tp, T);
  load_rows<HD>(Vs, L.ld.hd_ld, q_src + 2 * D, qkv_ld, Tp, T);
  __syncthreads();

  // S = Q K^T (unscaled).
  mma_tiles<wmma::col_major>(Qs, L.ld.hd_ld, Ks, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, Tp / 16,
                             HD / 16);
  __syncthreads();

  // P = exp(scale * S - lse), normalised, over the T real keys; padding keys and padding query
  // rows get P = 0. scale > 0, so the row maximum of S gives that of scale * S.
  float* lse_rows = lse + (size_t(b) * H + h) * T + q0;
  for (int r = warp; r < rows_pad; r += kWarps) {
    const float* s_row = Ss + r * L.ld.s_ld;
    bf16* p_row = Ps + r * L.ld.p_ld;
    if (r >= rows) {
      for (int j = lane; j < Tp; j += 32) p_row[j] = __float2bfloat16(0.0f);
      continue;
    }
    float m = -INFINITY;
    for (int j = lane; j < T; j += 32) m = fmaxf(m, s_row[j]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = lane; j < T; j += 32) sum += expf((s_row[j] - m) * scale);
    sum = warp_sum(sum);
    const float row_lse = m * scale + logf(sum);
    for (int j = lane; j < Tp; j += 32)
      p_row[j] = __float2bfloat16(j < T ? expf(fmaf(s_row[j], scale, -row_lse)) : 0.0f);
    if (lane == 0) lse_rows[r] = row_lse;
  }
  __syncthreads();

  // O = P V, into the score buffer (its last reader was the softmax above).
  mma_tiles<wmma::row_major>(Ps, L.ld.p_ld, Vs, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, HD / 16,
                             Tp / 16);
  __syncthreads();

  store_rows<HD>(out + (size_t(b) * T + q0) * D + h * HD, D, Ss, L.ld.s_ld, rows, 1.0f);
}

// delta[b, h, t] = sum_c dout[b*T + t, h*hd + c] * out[b*T + t, h*hd + c]. A group of 16 lanes per
// (token, head), one 8-element vector each (hd <= 128), then a shuffle reduction that stays inside
// the group (xor offsets below 16). No early exit: every lane of the warp joins the shuffles.
__global__ void __launch_bounds__(kThreads)
    attention_delta_kernel(const bf16* __restrict__ out, const bf16* __restrict__ dout,
                           float* __restrict__ delta, int T, int H, int hd, long long pairs) {
  const long long pair = static_cast<long long>(blockIdx.x) * (kThreads / kDeltaGroup) +
                         threadIdx.x / kDeltaGroup;
  const int g = threadIdx.x % kDeltaGroup;
  const long long row = pair / H;  // b * T + t
  const int h = static_cast<int>(pair % H);
  float acc = 0.0f;
  if (pair < pairs && g < hd / 8) {
    const size_t at = size_t(row) * H * hd + size_t(h) * hd + g * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(out + at);
    const uint4 d = *reinterpret_cast<const uint4*>(dout + at);
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

// Grid (ceil(T/64), H, B): one 64-key tile against all queries of the (image, head). Works in the
// transposed orientation (rows = keys, columns = queries) so that dV = P^T dO and dK = dS^T Q are
// plain row-major products. Rows: [0, rows_pad) keys; columns: [0, Tp) queries.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_dkdv_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ dout,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          bf16* __restrict__ dqkv, int T, int H, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Tp = round_up16(T);
  const DkdvSmem L(HD, Tp);
  bf16* Ks = reinterpret_cast<bf16*>(smem + L.k);
  bf16* Vs = reinterpret_cast<bf16*>(smem + L.v);
  bf16* Qs = reinterpret_cast<bf16*>(smem + L.q);
  bf16* dOs = reinterpret_cast<bf16*>(smem + L.dout);
  float* lse_s = reinterpret_cast<float*>(smem + L.lse);
  float* delta_s = reinterpret_cast<float*>(smem + L.delta);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  bf16* Ps = reinterpret_cast<bf16*>(smem + L.p);

  const int k0 = blockIdx.x * kTile;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;
  const bf16* do_src = dout + size_t(b) * T * D + h * HD;
  const float* lse_bh = lse + (size_t(b) * H + h) * T;
  const float* delta_bh = delta + (size_t(b) * H + h) * T;
  const int rows = min(kTile, T - k0);
  const int rows_pad = round_up16(rows);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  load_rows<HD>(Ks, L.ld.hd_ld, q_src + D + k0 * qkv_ld, qkv_ld, rows_pad, rows);
  load_rows<HD>(Vs, L.ld.hd_ld, q_src + 2 * D + k0 * qkv_ld, qkv_ld, rows_pad, rows);
  load_rows<HD>(Qs, L.ld.hd_ld, q_src, qkv_ld, Tp, T);
  load_rows<HD>(dOs, L.ld.hd_ld, do_src, D, Tp, T);
  for (int j = threadIdx.x; j < Tp; j += kThreads) {
    lse_s[j] = j < T ? lse_bh[j] : 0.0f;
    delta_s[j] = j < T ? delta_bh[j] : 0.0f;
  }
  __syncthreads();

  // S^T = K Q^T (unscaled).
  mma_tiles<wmma::col_major>(Ks, L.ld.hd_ld, Qs, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, Tp / 16,
                             HD / 16);
  __syncthreads();

  // P^T[i][j] = exp(scale * S^T[i][j] - lse[j]); 0 for padding keys i and padding queries j.
  for (int r = warp; r < rows_pad; r += kWarps) {
    const float* s_row = Ss + r * L.ld.s_ld;
    bf16* p_row = Ps + r * L.ld.p_ld;
    for (int j = lane; j < Tp; j += 32) {
      const bool live = r < rows && j < T;
      p_row[j] = __float2bfloat16(live ? expf(fmaf(s_row[j], scale, -lse_s[j])) : 0.0f);
    }
  }
  __syncthreads();

  // dV = P^T dO, through the score buffer, which is free again.
  mma_tiles<wmma::row_major>(Ps, L.ld.p_ld, dOs, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, HD / 16,
                             Tp / 16);
  __syncthreads();
  bf16* dk_dst = dqkv + (size_t(b) * T + k0) * qkv_ld + D + h * HD;
  store_rows<HD>(dk_dst + D, qkv_ld, Ss, L.ld.s_ld, rows, 1.0f);
  __syncthreads();  // dV is read out of Ss before dP^T overwrites it

  // dP^T = V dO^T.
  mma_tiles<wmma::col_major>(Vs, L.ld.hd_ld, dOs, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, Tp / 16,
                             HD / 16);
  __syncthreads();

  // dS^T = P^T * (dP^T - delta[j]), in place over P^T (its product dV is done). Masked entries
  // stay 0: P^T is 0 there and dP^T is finite (padding rows of V and dO are zero).
  for (int r = warp; r < rows_pad; r += kWarps) {
    const float* dp_row = Ss + r * L.ld.s_ld;
    bf16* p_row = Ps + r * L.ld.p_ld;
    for (int j = lane; j < Tp; j += 32)
      p_row[j] = __float2bfloat16(__bfloat162float(p_row[j]) * (dp_row[j] - delta_s[j]));
  }
  __syncthreads();

  // dK = scale * dS^T Q.
  mma_tiles<wmma::row_major>(Ps, L.ld.p_ld, Qs, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, HD / 16,
                             Tp / 16);
  __syncthreads();
  store_rows<HD>(dk_dst, qkv_ld, Ss, L.ld.s_ld, rows, scale);
}

// Grid (ceil(T/64), H, B): one 64-query tile against all keys of the (image, head).
// Rows: [0, rows_pad) queries; columns: [0, Tp) keys.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1)
    attention_dq_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        bf16* __restrict__ dqkv, int T, int H, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Tp = round_up16(T);
  const DqSmem L(HD, Tp);
  bf16* Qs = reinterpret_cast<bf16*>(smem + L.q);
  bf16* dOs = reinterpret_cast<bf16*>(smem + L.dout);
  bf16* Ks = reinterpret_cast<bf16*>(smem + L.k);
  bf16* Vs = reinterpret_cast<bf16*>(smem + L.v);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  bf16* Ps = reinterpret_cast<bf16*>(smem + L.p);

  const int q0 = blockIdx.x * kTile;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int D = H * HD;
  const size_t qkv_ld = 3 * size_t(D);
  const bf16* q_src = qkv + size_t(b) * T * qkv_ld + h * HD;
  const bf16* do_src = dout + size_t(b) * T * D + h * HD;
  const float* lse_rows = lse + (size_t(b) * H + h) * T + q0;
  const float* delta_rows = delta + (size_t(b) * H + h) * T + q0;
  const int rows = min(kTile, T - q0);
  const int rows_pad = round_up16(rows);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  load_rows<HD>(Qs, L.ld.hd_ld, q_src + q0 * qkv_ld, qkv_ld, rows_pad, rows);
  load_rows<HD>(dOs, L.ld.hd_ld, do_src + size_t(q0) * D, D, rows_pad, rows);
  load_rows<HD>(Ks, L.ld.hd_ld, q_src + D, qkv_ld, Tp, T);
  load_rows<HD>(Vs, L.ld.hd_ld, q_src + 2 * D, qkv_ld, Tp, T);
  __syncthreads();

  // S = Q K^T (unscaled).
  mma_tiles<wmma::col_major>(Qs, L.ld.hd_ld, Ks, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, Tp / 16,
                             HD / 16);
  __syncthreads();

  // P = exp(scale * S - lse[row]); 0 for padding keys and padding query rows.
  for (int r = warp; r < rows_pad; r += kWarps) {
    const float* s_row = Ss + r * L.ld.s_ld;
    bf16* p_row = Ps + r * L.ld.p_ld;
    const float row_lse = r < rows ? lse_rows[r] : 0.0f;
    for (int j = lane; j < Tp; j += 32) {
      const bool live = r < rows && j < T;
      p_row[j] = __float2bfloat16(live ? expf(fmaf(s_row[j], scale, -row_lse)) : 0.0f);
    }
  }
  __syncthreads();

  // dP = dO V^T.
  mma_tiles<wmma::col_major>(dOs, L.ld.hd_ld, Vs, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, Tp / 16,
                             HD / 16);
  __syncthreads();

  // dS = P * (dP - delta[row]), in place over P; masked entries stay 0 as in dKdV.
  for (int r = warp; r < rows_pad; r += kWarps) {
    const float* dp_row = Ss + r * L.ld.s_ld;
    bf16* p_row = Ps + r * L.ld.p_ld;
    const float row_delta = r < rows ? delta_rows[r] : 0.0f;
    for (int j = lane; j < Tp; j += 32)
      p_row[j] = __float2bfloat16(__bfloat162float(p_row[j]) * (dp_row[j] - row_delta));
  }
  __syncthreads();

  // dQ = scale * dS K.
  mma_tiles<wmma::row_major>(Ps, L.ld.p_ld, Ks, L.ld.hd_ld, Ss, L.ld.s_ld, rows_pad / 16, HD / 16,
                             Tp / 16);
  __syncthreads();
  store_rows<HD>(dqkv + (size_t(b) * T + q0) * qkv_ld + h * HD, qkv_ld, Ss, L.ld.s_ld, rows, scale);
}

// The dynamic shared-memory limit is an attribute of a kernel in one device's context. Raise it to
// that device's opt-in maximum once per (kernel, device), so every T that fits can launch; the
// static state is per instantiation of this template, i.e. per kernel.
template <auto Kernel>
void raise_smem_limit() {
  static std::mutex mutex;
  static std::vector<bool> raised;  // by device ordinal
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mutex);
  if (dev < static_cast<int>(raised.size()) && raised[dev]) return;
  int optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(Kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  if (dev >= static_cast<int>(raised.size())) raised.resize(dev + 1, false);
  raised[dev] = true;
}

// Calls f(std::integral_constant<int, hd>) for the supported head dims.
template <typename F>
void dispatch_hd(int hd, F&& f) {
  switch (hd) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 48: f(std::integral_constant<int, 48>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 80: f(std::integral_constant<int, 80>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 112: f(std::integral_constant<int, 112>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: ENSURE(false, "attention: unsupported head dim " + std::to_string(hd));
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

float softmax_scale(int hd) { return 1.0f / std::sqrt(static_cast<float>(hd)); }

// Preconditions common to both launchers.
void require_shape(const char* who, int B, int T, int H, int hd) {
  const std::string reason = attention_unsupported_reason(T, hd);
  ENSURE(reason.empty(), std::string(who) + ": " + reason);
  ENSURE(B >= 1 && H >= 1, std::string(who) + ": B and H must be positive");
  // The grid is (ceil(T/64), H, B); T is bounded far below the x limit by the shared memory.
  ENSURE(H <= 65535 && B <= 65535, std::string(who) + ": H and B must be at most 65535 (grid)");
}
}  // namespace

std::string attention_unsupported_reason(int T, int hd) {
  if (hd < 16 || hd > 128 || hd % 16 != 0)
    return "attention head dim " + std::to_string(hd) +
           " unsupported (needs a multiple of 16 in [16, 128])";
  if (T < 1 || T > kMaxT) return "attention sequence length " + std::to_string(T) + " unsupported";
  int dev = 0, major = 0, minor = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (major != 9 || minor != 0)
    return "attention kernels are built for sm_90a only; device " + std::to_string(dev) +
           " is sm_" + std::to_string(major) + std::to_string(minor);
  const int Tp = round_up16(T);
  size_t need = ForwardSmem(hd, Tp).bytes;
  need = std::max(need, DkdvSmem(hd, Tp).bytes);
  need = std::max(need, DqSmem(hd, Tp).bytes);
  if (need > static_cast<size_t>(optin))
    return "attention with T=" + std::to_string(T) + ", hd=" + std::to_string(hd) + " needs " +
           std::to_string(need) + " bytes of shared memory per block; the device allows " +
           std::to_string(optin);
  return {};
}

void attention_forward(const bf16* qkv, bf16* out, float* lse, int B, int T, int H, int hd,
                       cudaStream_t stream) {
  require_shape("attention_forward", B, T, H, hd);
  ENSURE(qkv && out && lse, "attention_forward: null pointer");
  ENSURE(aligned16(qkv) && aligned16(out), "attention_forward: qkv/out must be 16-byte aligned");
  NvtxRange range("attention_forward");
  const int Tp = round_up16(T);
  const dim3 grid((T + kTile - 1) / kTile, H, B);
  dispatch_hd(hd, [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    raise_smem_limit<&attention_forward_kernel<HD>>();
    attention_forward_kernel<HD><<<grid, kThreads, ForwardSmem(HD, Tp).bytes, stream>>>(
        qkv, out, lse, T, H, softmax_scale(HD));
    LAUNCH_CHECK();
  });
}

void attention_backward(const bf16* qkv, const bf16* out, const bf16* dout, const float* lse,
                        float* delta, bf16* dqkv, int B, int T, int H, int hd,
                        cudaStream_t stream) {
  require_shape("attention_backward", B, T, H, hd);
  ENSURE(qkv && out && dout && lse && delta && dqkv, "attention_backward: null pointer");
  ENSURE(aligned16(qkv) && aligned16(out) && aligned16(dout) && aligned16(dqkv),
          "attention_backward: qkv/out/dout/dqkv must be 16-byte aligned");
  NvtxRange range("attention_backward");

  const long long pairs = static_cast<long long>(B) * T * H;
  const long long pairs_per_block = kThreads / kDeltaGroup;
  const long long delta_blocks = (pairs + pairs_per_block - 1) / pairs_per_block;
  ENSURE(delta_blocks <= 0x7fffffffLL, "attention_backward: B*T*H too large for the delta grid");
  attention_delta_kernel<<<static_cast<unsigned>(delta_blocks), kThreads, 0, stream>>>(
      out, dout, delta, T, H, hd, pairs);
  LAUNCH_CHECK();

  const int Tp = round_up16(T);
  const dim3 grid((T + kTile - 1) / kTile, H, B);
  dispatch_hd(hd, [&](auto hd_c) {
    constexpr int HD = decltype(hd_c)::value;
    const float scale = softmax_scale(HD);
    raise_smem_limit<&attention_dkdv_kernel<HD>>();
    attention_dkdv_kernel<HD><<<grid, kThreads, DkdvSmem(HD, Tp).bytes, stream>>>(
        qkv, dout, lse, delta, dqkv, T, H, scale);
    LAUNCH_CHECK();
    raise_smem_limit<&attention_dq_kernel<HD>>();
    attention_dq_kernel<HD><<<grid, kThreads, DqSmem(HD, Tp).bytes, stream>>>(
        qkv, dout, lse, delta, dqkv, T, H, scale);
    LAUNCH_CHECK();
  });
}
