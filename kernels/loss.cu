#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/loss.h"

namespace {
constexpr int kThreads = 256;

__device__ float block_reduce(float v, bool is_max) {
  __shared__ float s[kThreads / 32];
  v = is_max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // s may still be read by a previous call
  if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = v;
  __syncthreads();
  float r = s[0];
  for (int i = 1; i < kThreads / 32; ++i) r = is_max ? fmaxf(r, s[i]) : r + s[i];
  return r;
}

// One block per row.
__global__ void softmax_xent_kernel(const float* __restrict__ logits, const int* __restrict__ labels, int C,
                                    int ld, float smoothing, float grad_divisor, float* __restrict__ row_loss,
                                    bf16* __restrict__ dlogits) {
  const float* z = logits + static_cast<size_t>(blockIdx.x) * ld;
  float m = -INFINITY;
  for (int c = threadIdx.x; c < C; c += kThreads) m = fmaxf(m, z[c]);
  m = block_reduce(m, true);
  float s = 0;
  float zsum = 0;  // for label smoothing: the mean logit
  for (int c = threadIdx.x; c < C; c += kThreads) {
    s += __expf(z[c] - m);
    zsum += z[c];
  }
  s = block_reduce(s, false);
  zsum = smoothing > 0 ? block_reduce(zsum, false) : 0.0f;
  const float log_s = __logf(s), lse = log_s + m;
  const int label = labels[blockIdx.x];
  // The target: 1 - smoothing on the label, smoothing spread evenly over all C classes.
  const float on = 1.0f - smoothing + smoothing / C, off = smoothing / C;
  bf16* dz = dlogits + static_cast<size_t>(blockIdx.x) * ld;
  for (int c = threadIdx.x; c < ld; c += kThreads) {
    const float p = c < C ? __expf(z[c] - m - log_s) : 0.0f;
    dz[c] = __float2bfloat16_rn(c < C ? (p - (c == label ? on : off)) / grad_divisor : 0.0f);
  }
  if (threadIdx.x == 0) row_loss[blockIdx.x] = (1.0f - smoothing) * (lse - z[label]) + smoothing * (lse - zsum / C);
}

__global__ void mean_kernel(const float* __restrict__ v, int n, float* __restrict__ out) {
  float s = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) s += v[i];
  s = block_reduce(s, false);
  if (threadIdx.x == 0) *out = s / n;
}
}  // namespace

void softmax_xent(const float* logits, const int* labels, int B, int C, int ld, float* row_loss, float* loss,
                  bf16* dlogits, cudaStream_t stream, float smoothing, int ranks) {
  NvtxRange range("softmax_xent");
  ENSURE(B > 0 && C > 0 && ld >= C && smoothing >= 0 && smoothing < 1 && ranks >= 1,
         "softmax_xent: bad shape, smoothing or ranks");
  const float grad_divisor = static_cast<float>(static_cast<double>(B) * ranks);
  softmax_xent_kernel<<<B, kThreads, 0, stream>>>(logits, labels, C, ld, smoothing, grad_divisor, row_loss, dlogits);
  LAUNCH_CHECK();
  mean_kernel<<<1, kThreads, 0, stream>>>(row_loss, B, loss);
  LAUNCH_CHECK();
}
