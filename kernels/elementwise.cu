#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/elementwise.h"
#include "kernels/fp8_tile.cuh"
#include "kernels/normal_cdf.h"
#include "kernels/preload.h"
#include "kernels/reduce.h"

namespace {
constexpr int kThreads = 256;
constexpr int kBackwardRows = 32;      // rows of one thread in gelu_backward, and of one partial row
constexpr int kBackwardThreads = 128;  // 5 full blocks across ViT-H's 5120 columns (640 x 8)

__device__ __forceinline__ float gelu(float x) { return x * normal_cdf(x).cdf; }
// gelu'(x) = Phi(x) + x phi(x): the backward shares one normal_cdf between the derivative and
// the recomputed output.
__device__ __forceinline__ float gelu_grad(float x, const NormalCdf& n) {
  return n.cdf + x * 0.39894228040143268f * n.gauss;
}

__global__ void gelu_forward_kernel(const Bf16x8* __restrict__ h, Bf16x8* __restrict__ a, size_t n8) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n8; i += size_t(gridDim.x) * blockDim.x) {
    float v[8];
    h[i].to_float(v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = gelu(v[j]);
    a[i] = Bf16x8::from_float(v);
  }
}

// A thread owns 8 consecutive columns over kBackwardRows rows (coalesced 16-byte accesses across
// the warp) and sums its dh there: the bias gradient comes out of the same pass, one partial
// row per row chunk, cheaper than cuBLASLt's BGRADB epilogue on fc1's weight gradient.
__global__ void gelu_backward_kernel(const Bf16x8* da, const Bf16x8* __restrict__ h, Bf16x8* dh,
                                     Bf16x8* __restrict__ a, float* __restrict__ partial, int M, int N8) {
  const int c = blockIdx.x * kBackwardThreads + threadIdx.x;
  if (c >= N8) return;
  const int r0 = blockIdx.y * kBackwardRows, r1 = min(M, r0 + kBackwardRows);
  float sum[8] = {};
  // kInFlight rows' loads are issued before any store: dh may alias da, so the compiler could
  // not hoist them itself, and one row at a time left each thread waiting on memory.
  constexpr int kInFlight = 4;
  for (int r = r0; r < r1; r += kInFlight) {
    Bf16x8 dav[kInFlight], hv[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (r + k >= r1) break;
      const size_t i = static_cast<size_t>(r + k) * N8 + c;
      dav[k] = da[i];
      hv[k] = h[i];
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (r + k >= r1) break;
      const size_t i = static_cast<size_t>(r + k) * N8 + c;
      float d[8], x[8];
      dav[k].to_float(d);
      hv[k].to_float(x);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const NormalCdf n = normal_cdf(x[j]);
        d[j] *= gelu_grad(x[j], n);
        sum[j] += d[j];
        x[j] *= n.cdf;  // gelu(x)
      }
      dh[i] = Bf16x8::from_float(d);
      if (a) a[i] = Bf16x8::from_float(x);
    }
  }
  float4* out = reinterpret_cast<float4*>(partial + (static_cast<size_t>(blockIdx.y) * N8 + c) * 8);
  out[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
  out[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
}

// FP8 forward: the GELU output goes straight to FP8 (fc2's input), never to bf16. Row-major
// only (the backward recomputes the transposed copy), so a flat grid-stride pass like the bf16
// one, which streams faster than the tiled producer (fp8_tile.cuh) a transposed copy needs.
__global__ void __launch_bounds__(fp8tile::kThreads)
    gelu_forward_fp8_kernel(const Bf16x8* __restrict__ h, size_t n8, Fp8Out o) {
  __shared__ fp8tile::BlockScratch scratch;
  fp8tile::Quantizer<__NV_E4M3> q(o);
  uint2* __restrict__ out = q.write ? reinterpret_cast<uint2*>(o.out) : nullptr;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n8; i += size_t(gridDim.x) * blockDim.x) {
    float x[8];
    h[i].to_float(x);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = gelu(x[j]);
    const uint2 codes = q.pack8(x);
    if (out) out[i] = codes;
  }
  fp8tile::block_record(q, o, scratch);
}

// FP8 backward over a 64 x 128 tile (fp8_tile.cuh): dh = da * gelu'(h) to FP8 E5M2, both copies
// (fc1's output gradient), with its column sums (fc1's bias gradient); and a = gelu(h)
// recomputed to FP8 E4M3, transposed (fc2's input for its weight gradient: the forward kept
// none). a is computed as in gelu_forward_fp8_kernel, so with the forward's scale it gets the same
// codes.
__global__ void __launch_bounds__(fp8tile::kThreads, 3)  // 80 registers, no spill (4 blocks an SM spilled)
    gelu_backward_fp8_kernel(const bf16* __restrict__ da, const bf16* __restrict__ h, int rows, int cols,
                             Fp8Out dh_out, Fp8Out a_out, float* __restrict__ partial) {
  using namespace fp8tile;
  __shared__ Tile dh_tile, a_tile;
  __shared__ BlockScratch scratch;
  __shared__ float sums[kThreads / 32][kTileCols];
  Quantizer<__NV_E5M2> qd(dh_out);
  Quantizer<__NV_E4M3> qa(a_out);
  const bool dh_row_major = qd.write && dh_out.out, dh_transposed = qd.write && dh_out.out_t;
  const bool a_transposed = qa.write && a_out.out_t;
  const int r0 = blockIdx.y * kTileRows, c0 = blockIdx.x * kTileCols;
  float sum[kVec] = {};
  Bf16x8 dav[kPerThread], hv[kPerThread];  // all loads in flight before any arithmetic
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int v = threadIdx.x + k * kThreads, r = r0 + vec_row(v), c = c0 + vec_col(v);
    if (r >= rows || c >= cols) continue;
    const size_t i = static_cast<size_t>(r) * cols + c;
    dav[k] = *reinterpret_cast<const Bf16x8*>(da + i);
    hv[k] = *reinterpret_cast<const Bf16x8*>(h + i);
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int v = threadIdx.x + k * kThreads, tr = vec_row(v), tc = vec_col(v), r = r0 + tr, c = c0 + tc;
    if (r >= rows || c >= cols) continue;
    const size_t i = static_cast<size_t>(r) * cols + c;
    float d[kVec], x[kVec];
    dav[k].to_float(d);
    hv[k].to_float(x);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const NormalCdf n = normal_cdf(x[j]);
      d[j] *= gelu_grad(x[j], n);
      sum[j] += d[j];
      x[j] *= n.cdf;  // gelu(x), as the forward computes it: one normal_cdf for both
    }
    const uint2 dc = qd.pack8(d);
    if (dh_row_major) *reinterpret_cast<uint2*>(dh_out.out + i) = dc;
    if (dh_transposed) *reinterpret_cast<uint2*>(&dh_tile.code[tr][tc]) = dc;
    if (a_transposed) *reinterpret_cast<uint2*>(&a_tile.code[tr][tc]) = qa.pack8(x);
  }
  tile_column_sums(sum, sums, partial + static_cast<size_t>(blockIdx.y) * cols, c0, cols);
  block_record(qd, dh_out, scratch);  // synchronises: the tiles are complete
  if (dh_transposed) store_transposed(dh_tile, dh_out.out_t, r0, c0, rows, cols);
  if (a_transposed) store_transposed(a_tile, a_out.out_t, r0, c0, rows, cols);
}

__global__ void fill_kernel(float* __restrict__ out, size_t n, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = value;
}

__global__ void cast_to_f32_kernel(const bf16* __restrict__ in, float* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

__global__ void cast_to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

// Grid-stride launches: enough blocks to fill the GPU several times over, no more.
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(fill_kernel);
PRELOAD_AT_START_UP(cast_to_f32_kernel);
PRELOAD_AT_START_UP(cast_to_bf16_kernel);

void gelu_forward(const bf16* h, bf16* a, size_t n, cudaStream_t stream) {
  NvtxRange range("gelu_forward");
  ENSURE(n % 8 == 0 && is_aligned16(h) && is_aligned16(a), "gelu_forward: n % 8 and 16-byte alignment");
  gelu_forward_kernel<<<grid_stride_blocks(n / 8, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const Bf16x8*>(h), reinterpret_cast<Bf16x8*>(a), n / 8);
  LAUNCH_CHECK();
}

size_t gelu_backward_partial_floats(int M, int N) { return static_cast<size_t>(grid_for(M, kBackwardRows)) * N; }

void gelu_backward(const bf16* da, const bf16* h, bf16* dh, bf16* a, float* db, float* partial, int M, int N,
                   cudaStream_t stream, GradWrite write) {
  NvtxRange range("gelu_backward");
  ENSURE(N % 8 == 0 && is_aligned16(da) && is_aligned16(h) && is_aligned16(dh) && is_aligned16(a) &&
             is_aligned16(partial),
         "gelu_backward: N % 8 and 16-byte alignment");
  const unsigned chunks = grid_for(M, kBackwardRows);
  ENSURE(chunks <= 65535, "gelu_backward: too many rows");
  gelu_backward_kernel<<<dim3(grid_for(N / 8, kBackwardThreads), chunks), kBackwardThreads, 0, stream>>>(
      reinterpret_cast<const Bf16x8*>(da), reinterpret_cast<const Bf16x8*>(h), reinterpret_cast<Bf16x8*>(dh),
      reinterpret_cast<Bf16x8*>(a), partial, M, N / 8);
  LAUNCH_CHECK();
  sum_rows(partial, chunks, N, N, db, stream, write);
}

void gelu_forward_fp8(const bf16* h, int M, int N, const Fp8Out& o, cudaStream_t stream) {
  NvtxRange range("gelu_forward_fp8");
  ENSURE(M > 0 && N > 0 && N % 8 == 0 && o.kind == Fp8Kind::E4M3 && !o.out_t && is_aligned16(h) && fp8tile::aligned8(o.out),
         "gelu_forward_fp8: N % 8, alignment, and an E4M3 row-major output");
  const size_t n8 = static_cast<size_t>(M) * N / 8;
  gelu_forward_fp8_kernel<<<grid_stride_blocks(n8, fp8tile::kThreads), fp8tile::kThreads, 0, stream>>>(
      reinterpret_cast<const Bf16x8*>(h), n8, o);
  LAUNCH_CHECK();
}

void gelu_backward_fp8(const bf16* da, const bf16* h, int M, int N, const Fp8Out& dh_out, const Fp8Out& a_out,
                       float* db, float* partial, cudaStream_t stream, GradWrite write) {
  NvtxRange range("gelu_backward_fp8");
  ENSURE(fp8tile::valid(dh_out, M, N) && fp8tile::valid(a_out, M, N) && dh_out.kind == Fp8Kind::E5M2 &&
             a_out.kind == Fp8Kind::E4M3 && !a_out.out && is_aligned16(da) && is_aligned16(h),
         "gelu_backward_fp8: M, N % 8, alignment, E5M2 gradient and a transposed E4M3 output");
  gelu_backward_fp8_kernel<<<fp8tile::grid(M, N), fp8tile::kThreads, 0, stream>>>(da, h, M, N, dh_out, a_out,
                                                                                   partial);
  LAUNCH_CHECK();
  if (dh_out.scale) sum_rows(partial, fp8tile::tile_rows(M), N, N, db, stream, write);  // not in the amax pass
}

void fill_constant(float* out, size_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(out, n, value);
  LAUNCH_CHECK();
}

void cast_to_bf16(const float* in, bf16* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  cast_to_bf16_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, n);
  LAUNCH_CHECK();
}

void cast_to_f32(const bf16* in, float* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  cast_to_f32_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, n);
  LAUNCH_CHECK();
}
