#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/optimizer.h"
#include "kernels/preload.h"

namespace {
constexpr int kThreads = 256;

// received: `peers` arrays of the peers' copies of this share (stride4 apart), added to the
// gradient in order.
__global__ void sgd_kernel(float4* __restrict__ p, float4* __restrict__ buf, const float4* __restrict__ g,
                           const float4* __restrict__ received, size_t stride4, int peers,
                           __nv_bfloat162* __restrict__ p_bf16, size_t n4, SgdHyper h, bool first_step, const int* __restrict__ skip,
                           const float* __restrict__ grad_norm) {
  if (skip && *skip) return;
  // torch.nn.utils.clip_grad_norm_: gradients scaled by max_norm / (norm + 1e-6) when above.
  const float clip = grad_norm ? fminf(1.0f, h.max_grad_norm / (*grad_norm + 1e-6f)) : 1.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float pv[4], bv[4], gv[4];
    *reinterpret_cast<float4*>(pv) = p[i];
    *reinterpret_cast<float4*>(bv) = buf[i];
    *reinterpret_cast<float4*>(gv) = g[i];
    for (int s = 0; s < peers; ++s) {  // sum_into's order: the own share first, then each peer's
      const float4 r = received[s * stride4 + i];
      gv[0] += r.x;
      gv[1] += r.y;
      gv[2] += r.z;
      gv[3] += r.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float d = clip * gv[j] + h.weight_decay * pv[j];
      bv[j] = first_step ? d : h.momentum * bv[j] + d;
      pv[j] -= h.lr * (h.nesterov ? d + h.momentum * bv[j] : bv[j]);
    }
    p[i] = *reinterpret_cast<float4*>(pv);
    buf[i] = *reinterpret_cast<float4*>(bv);
    p_bf16[2 * i] = __floats2bfloat162_rn(pv[0], pv[1]);
    p_bf16[2 * i + 1] = __floats2bfloat162_rn(pv[2], pv[3]);
  }
}

void launch_sgd(float* params, float* momentum, const float* grads, const float* received, size_t stride, int peers,
                bf16* params_bf16, size_t n, SgdHyper h, bool first_step, cudaStream_t stream, const int* skip,
                const float* grad_norm) {
  ENSURE(n % 4 == 0 && stride % 4 == 0 && is_aligned16(params) && is_aligned16(momentum) && is_aligned16(grads) &&
             is_aligned16(params_bf16) && (peers == 0 || is_aligned16(received)),
         "sgd_momentum_step: n % 4 and 16-byte alignment");
  if (n == 0) return;
  sgd_kernel<<<grid_stride_blocks(n / 4, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<float4*>(params), reinterpret_cast<float4*>(momentum), reinterpret_cast<const float4*>(grads),
      reinterpret_cast<const float4*>(received), stride / 4, peers, reinterpret_cast<__nv_bfloat162*>(params_bf16),
      n / 4, h, first_step, skip, grad_norm);
  LAUNCH_CHECK();
}
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(sgd_kernel);

void sgd_momentum_step(float* params, float* momentum, const float* grads, bf16* params_bf16, size_t n,
                       SgdHyper h, bool first_step, cudaStream_t stream, const int* skip, const float* grad_norm) {
  NvtxRange range("sgd_momentum_step");
  launch_sgd(params, momentum, grads, nullptr, 0, 0, params_bf16, n, h, first_step, stream, skip, grad_norm);
}

void sgd_momentum_shard(float* params, float* momentum, const float* grads, const float* received, size_t stride,
                        int peers, bf16* params_bf16, size_t n, SgdHyper h, bool first_step, cudaStream_t stream,
                        const int* skip) {
  NvtxRange range("sgd_momentum_shard");
  launch_sgd(params, momentum, grads, received, stride, peers, params_bf16, n, h, first_step, stream, skip, nullptr);
}
