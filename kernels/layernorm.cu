#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/layernorm.h"
#include "kernels/reduce.h"

namespace {
constexpr int kWarps = 8;
constexpr int kRowsPerBlock = 32;  // backward: rows sharing one block's weight-gradient partials

// One warp per row; the row is read twice (mean, then centred variance) for an exact variance,
// the second read coming from L1/L2.
__global__ void layernorm_forward_kernel(const float* __restrict__ x, int x_row_stride,
                                         const float* __restrict__ w, const float* __restrict__ b,
                                         bf16* __restrict__ y, float* __restrict__ mean_out,
                                         float* __restrict__ rstd_out, int M, int D, float eps) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const float4* xr = reinterpret_cast<const float4*>(x + static_cast<size_t>(row) * x_row_stride);
  const int D4 = D / 4;
  float s = 0;
  for (int i = lane; i < D4; i += 32) {
    const float4 v = xr[i];
    s += v.x + v.y + v.z + v.w;
  }
  const float mean = warp_sum(s) / D;
  float ss = 0;
  for (int i = lane; i < D4; i += 32) {
    const float4 v = xr[i];
    const float a = v.x - mean, c = v.y - mean, d = v.z - mean, e = v.w - mean;
    ss += a * a + c * c + d * d + e * e;
  }
  const float rstd = rsqrtf(warp_sum(ss) / D + eps);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  const float4* b4 = reinterpret_cast<const float4*>(b);
  __nv_bfloat162* yr = reinterpret_cast<__nv_bfloat162*>(y + static_cast<size_t>(row) * D);
  for (int i = lane; i < D4; i += 32) {
    const float4 v = xr[i], g = w4[i], bb = b4[i];
    yr[2 * i] = __floats2bfloat162_rn((v.x - mean) * rstd * g.x + bb.x, (v.y - mean) * rstd * g.y + bb.y);
    yr[2 * i + 1] = __floats2bfloat162_rn((v.z - mean) * rstd * g.z + bb.z, (v.w - mean) * rstd * g.w + bb.w);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w.
// One warp per row; the block's rows accumulate dw and db in shared memory, written out as one
// partial row per block for a deterministic second-stage sum.
__global__ void layernorm_backward_kernel(const bf16* __restrict__ dy, const float* __restrict__ x,
                                          int row_stride, const float* __restrict__ w,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd, float* __restrict__ g,
                                          bf16* __restrict__ g_bf16, float* __restrict__ partial,
                                          int M, int D) {
  extern __shared__ float acc[];  // [2 * D]: dw then db
  for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) acc[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < kRowsPerBlock; r += kWarps) {
    const int row = blockIdx.x * kRowsPerBlock + r;
    if (row >= M) break;
    const float mu = mean[row], rs = rstd[row];
    const float* xr = x + static_cast<size_t>(row) * row_stride;
    const __nv_bfloat162* dyr = reinterpret_cast<const __nv_bfloat162*>(dy + static_cast<size_t>(row) * D);
    float sum_dxhat = 0, sum_dxhat_xhat = 0;
    for (int i = lane; i < D / 2; i += 32) {
      const float2 d = __bfloat1622float2(dyr[i]);
      const float2 xv = reinterpret_cast<const float2*>(xr)[i];
      const float xh0 = (xv.x - mu) * rs, xh1 = (xv.y - mu) * rs;
      const float dxh0 = d.x * w[2 * i], dxh1 = d.y * w[2 * i + 1];
      sum_dxhat += dxh0 + dxh1;
      sum_dxhat_xhat += dxh0 * xh0 + dxh1 * xh1;
      atomicAdd(&acc[2 * i], d.x * xh0);
      atomicAdd(&acc[2 * i + 1], d.y * xh1);
      atomicAdd(&acc[D + 2 * i], d.x);
      atomicAdd(&acc[D + 2 * i + 1], d.y);
    }
    const float m1 = warp_sum(sum_dxhat) / D, m2 = warp_sum(sum_dxhat_xhat) / D;
    float* gr = g + static_cast<size_t>(row) * row_stride;
    __nv_bfloat162* gbr = reinterpret_cast<__nv_bfloat162*>(g_bf16 + static_cast<size_t>(row) * row_stride);
    for (int i = lane; i < D / 2; i += 32) {
      const float2 d = __bfloat1622float2(dyr[i]);
      const float2 xv = reinterpret_cast<const float2*>(xr)[i];
      float2 gv = reinterpret_cast<float2*>(gr)[i];
      gv.x += rs * (d.x * w[2 * i] - m1 - (xv.x - mu) * rs * m2);
      gv.y += rs * (d.y * w[2 * i + 1] - m1 - (xv.y - mu) * rs * m2);
      reinterpret_cast<float2*>(gr)[i] = gv;
      gbr[i] = __floats2bfloat162_rn(gv.x, gv.y);
    }
  }
  __syncthreads();
  float* out = partial + static_cast<size_t>(blockIdx.x) * 2 * D;
  for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) out[i] = acc[i];
}
}  // namespace

void layernorm_forward(const float* x, int x_row_stride, const float* w, const float* b, bf16* y,
                       float* mean, float* rstd, int M, int D, float eps, cudaStream_t stream) {
  NvtxRange range("layernorm_forward");
  ENSURE(D % 8 == 0 && x_row_stride % 4 == 0 && is_aligned16(x) && is_aligned16(w) &&
              is_aligned16(b) && is_aligned16(y),
          "layernorm_forward: D must be a multiple of 8 and rows 16-byte aligned");
  layernorm_forward_kernel<<<grid_for(M, kWarps), kWarps * 32, 0, stream>>>(x, x_row_stride, w, b, y,
                                                                             mean, rstd, M, D, eps);
  LAUNCH_CHECK();
}

size_t layernorm_partial_floats(int M, int D) {
  return static_cast<size_t>(grid_for(M, kRowsPerBlock)) * 2 * D;
}

void layernorm_backward(const bf16* dy, const float* x, int row_stride, const float* w,
                        const float* mean, const float* rstd, float* g, bf16* g_bf16, float* dw,
                        float* db, float* partial, int M, int D, cudaStream_t stream) {
  NvtxRange range("layernorm_backward");
  ENSURE(D % 8 == 0 && row_stride % 2 == 0 && is_aligned16(x) && is_aligned16(g) &&
              is_aligned16(dy) && is_aligned16(g_bf16),
          "layernorm_backward: D must be a multiple of 8 and rows aligned");
  const size_t smem = 2 * D * sizeof(float);
  ENSURE(smem <= 48 * 1024, "layernorm_backward: D too large for the shared-memory partials");
  const unsigned blocks = grid_for(M, kRowsPerBlock);
  layernorm_backward_kernel<<<blocks, kWarps * 32, smem, stream>>>(dy, x, row_stride, w, mean, rstd,
                                                                   g, g_bf16, partial, M, D);
  LAUNCH_CHECK();
  sum_rows(partial, blocks, D, 2 * D, dw, stream);
  sum_rows(partial + D, blocks, D, 2 * D, db, stream);
}
