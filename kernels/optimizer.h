// SGD with momentum over the whole flat parameter buffer in one pass (torch.optim.SGD
// semantics, dampening 0), writing the bf16 copy the next forward's GEMMs read.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

struct SgdHyper {
  float lr, momentum, weight_decay;
  bool nesterov;
  float max_grad_norm = 0;  // with grad_norm below: the clipping threshold
};

// n % 4 == 0, all pointers 16-byte aligned. first_step: momentum buffer = gradient.
// skip (device, may be null): when *skip is non-zero the step changes nothing (FP8's numerics
// guard skips a step whose gradients saw a non-finite value, without a host round trip).
// grad_norm (device, may be null): the gradients' global L2 norm; they are clipped to
// h.max_grad_norm first (torch.nn.utils.clip_grad_norm_ before the step).
void sgd_momentum_step(float* params, float* momentum, const float* grads, __nv_bfloat16* params_bf16,
                       size_t n, SgdHyper h, bool first_step, cudaStream_t stream, const int* skip = nullptr,
                       const float* grad_norm = nullptr);

// One rank's share of a sharded step (--shard-optimizer): the gradient is grads[i] plus what the
// peers sent, received[0 * stride + i] + received[1 * stride + i] + ... added in that order (as
// sum_into adds them, so the update has the replicated step's bits). No clipping. The same
// alignment rules as above, stride % 4 == 0.
void sgd_momentum_shard(float* params, float* momentum, const float* grads, const float* received, size_t stride,
                        int peers, __nv_bfloat16* params_bf16, size_t n, SgdHyper h, bool first_step,
                        cudaStream_t stream, const int* skip = nullptr);
