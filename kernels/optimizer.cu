#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/optimizer.h"
#include "kernels/preload.h"

namespace {
constexpr int kThreads = 256;

// The gradient's four elements at i: the own, plus `peers` arrays of the peers' copies of this
// share (stride4 apart) added in sum_into's order, the own share first, then each peer's.
__device__ __forceinline__ void load_gradient(float (&gv)[4], const float4* __restrict__ g,
                                              const float4* __restrict__ received, size_t stride4, int peers,
                                              size_t i) {
  *reinterpret_cast<float4*>(gv) = g[i];
  for (int s = 0; s < peers; ++s) {
    const float4 r = received[s * stride4 + i];
    gv[0] += r.x;
    gv[1] += r.y;
    gv[2] += r.z;
    gv[3] += r.w;
  }
}

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
    load_gradient(gv, g, received, stride4, peers, i);
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

namespace {
__global__ void adamw_begin_kernel(AdamWScalars* s, double lr, AdamWHyper h, const int* __restrict__ skip) {
  if (!(skip && *skip)) ++s->steps;
  const double t = static_cast<double>(s->steps);
  s->step_size = static_cast<float>(lr / (1.0 - pow(h.beta1, t)));
  s->bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(h.beta2, t)));
  s->decay_factor = static_cast<float>(1.0 - lr * h.weight_decay);
}

// torch's AdamW in its order of operations: the decay, the first moment by lerp, the second by
// multiply-add, then p += -step_size * m / (sqrt(v) / sqrt(bc2) + eps).
__global__ void adamw_kernel(float4* __restrict__ p, float4* __restrict__ m, float4* __restrict__ v,
                             const float4* __restrict__ g, const float4* __restrict__ received, size_t stride4,
                             int peers, __nv_bfloat162* __restrict__ p_bf16, size_t n4, DecayFlags decay,
                             AdamWHyper h, const AdamWScalars* __restrict__ scalars, const int* __restrict__ skip,
                             const float* __restrict__ grad_norm) {
  if (skip && *skip) return;
  const float clip = grad_norm ? fminf(1.0f, h.max_grad_norm / (*grad_norm + 1e-6f)) : 1.0f;
  const float step_size = scalars->step_size, bc2_sqrt = scalars->bias_correction2_sqrt;
  const float decay_factor = scalars->decay_factor;
  const float beta2 = static_cast<float>(h.beta2), eps = static_cast<float>(h.eps);
  const float w1 = static_cast<float>(1.0 - h.beta1), w2 = static_cast<float>(1.0 - h.beta2);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float pv[4], mv[4], vv[4], gv[4];
    *reinterpret_cast<float4*>(pv) = p[i];
    *reinterpret_cast<float4*>(mv) = m[i];
    *reinterpret_cast<float4*>(vv) = v[i];
    load_gradient(gv, g, received, stride4, peers, i);
    const bool decayed = decay.flags[(decay.first + 4 * i) >> decay.chunk_shift] != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float grad = clip * gv[j];
      if (decayed) pv[j] *= decay_factor;
      mv[j] = mv[j] + w1 * (grad - mv[j]);  // torch.lerp with a weight below 0.5
      vv[j] = __fmul_rn(vv[j], beta2) + w2 * (grad * grad);  // torch's mul_, then its foreach addcmul_
      const float denom = sqrtf(vv[j]) / bc2_sqrt + eps;
      pv[j] += -step_size * (mv[j] / denom);
    }
    p[i] = *reinterpret_cast<float4*>(pv);
    m[i] = *reinterpret_cast<float4*>(mv);
    v[i] = *reinterpret_cast<float4*>(vv);
    p_bf16[2 * i] = __floats2bfloat162_rn(pv[0], pv[1]);
    p_bf16[2 * i + 1] = __floats2bfloat162_rn(pv[2], pv[3]);
  }
}

void launch_adamw(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, const float* received,
                  size_t stride, int peers, bf16* params_bf16, size_t n, DecayFlags decay, AdamWHyper h,
                  const AdamWScalars* scalars, cudaStream_t stream, const int* skip, const float* grad_norm) {
  ENSURE(n % 4 == 0 && stride % 4 == 0 && is_aligned16(params) && is_aligned16(exp_avg) &&
             is_aligned16(exp_avg_sq) && is_aligned16(grads) && is_aligned16(params_bf16) &&
             (peers == 0 || is_aligned16(received)),
         "adamw_step: n % 4 and 16-byte alignment");
  ENSURE(decay.flags && decay.first % 4 == 0 && decay.chunk_shift >= 2 && scalars, "adamw_step: decay flags");
  if (n == 0) return;
  adamw_kernel<<<grid_stride_blocks(n / 4, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<float4*>(params), reinterpret_cast<float4*>(exp_avg), reinterpret_cast<float4*>(exp_avg_sq),
      reinterpret_cast<const float4*>(grads), reinterpret_cast<const float4*>(received), stride / 4, peers,
      reinterpret_cast<__nv_bfloat162*>(params_bf16), n / 4, decay, h, scalars, skip, grad_norm);
  LAUNCH_CHECK();
}
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(sgd_kernel);
PRELOAD_AT_START_UP(adamw_kernel);
PRELOAD_AT_START_UP(adamw_begin_kernel);

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

void adamw_begin_step(AdamWScalars* scalars, double lr, AdamWHyper h, const int* skip, cudaStream_t stream) {
  adamw_begin_kernel<<<1, 1, 0, stream>>>(scalars, lr, h, skip);
  LAUNCH_CHECK();
}

void adamw_step(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, bf16* params_bf16, size_t n,
                DecayFlags decay, AdamWHyper h, const AdamWScalars* scalars, cudaStream_t stream, const int* skip,
                const float* grad_norm) {
  NvtxRange range("adamw_step");
  launch_adamw(params, exp_avg, exp_avg_sq, grads, nullptr, 0, 0, params_bf16, n, decay, h, scalars, stream, skip,
               grad_norm);
}

void adamw_shard(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, const float* received,
                 size_t stride, int peers, bf16* params_bf16, size_t n, DecayFlags decay, AdamWHyper h,
                 const AdamWScalars* scalars, cudaStream_t stream, const int* skip) {
  NvtxRange range("adamw_shard");
  launch_adamw(params, exp_avg, exp_avg_sq, grads, received, stride, peers, params_bf16, n, decay, h, scalars,
               stream, skip, nullptr);
}
