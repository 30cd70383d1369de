#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/optimizer.h"
#include "kernels/preload.h"

namespace {
constexpr int kThreads = 256;

__global__ void sgd_kernel(float4* __restrict__ p, float4* __restrict__ buf, const float4* __restrict__ g,
                           __nv_bfloat162* __restrict__ p_bf16, size_t n4, SgdHyper h, bool first_step,
                           const int* __restrict__ skip, const float* __restrict__ grad_norm) {
  if (skip && *skip) return;
  // torch.nn.utils.clip_grad_norm_: gradients scaled by max_norm / (norm + 1e-6) when above.
  const float clip = grad_norm ? fminf(1.0f, h.max_grad_norm / (*grad_norm + 1e-6f)) : 1.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float pv[4], bv[4], gv[4];
    *reinterpret_cast<float4*>(pv) = p[i];
    *reinterpret_cast<float4*>(bv) = buf[i];
    *reinterpret_cast<float4*>(gv) = g[i];
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
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(sgd_kernel);

void sgd_momentum_step(float* params, float* momentum, const float* grads, bf16* params_bf16, size_t n,
                       SgdHyper h, bool first_step, cudaStream_t stream, const int* skip, const float* grad_norm) {
  NvtxRange range("sgd_momentum_step");
  ENSURE(n % 4 == 0 && is_aligned16(params) && is_aligned16(momentum) && is_aligned16(grads) &&
              is_aligned16(params_bf16),
          "sgd_momentum_step: n % 4 and 16-byte alignment");
  sgd_kernel<<<grid_stride_blocks(n / 4, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<float4*>(params), reinterpret_cast<float4*>(momentum),
      reinterpret_cast<const float4*>(grads), reinterpret_cast<__nv_bfloat162*>(params_bf16), n / 4, h,
      first_step, skip, grad_norm);
  LAUNCH_CHECK();
}
