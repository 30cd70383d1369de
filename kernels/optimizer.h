// The optimizers over the flat parameter buffer, each in one pass that also writes the bf16 copy
// the next forward's GEMMs read: SGD with momentum (torch.optim.SGD, dampening 0) and AdamW
// (torch.optim.AdamW: decoupled weight decay, bias correction, no amsgrad).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

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

// In double, as torch holds them: 1 - beta is formed in double before it is rounded to float.
struct AdamWHyper {
  double beta1, beta2, eps, weight_decay;
  float max_grad_norm = 0;  // with grad_norm: the clipping threshold
};
// A step's scalars, kept on the device so that a step FP8's guard skips (decided on the device)
// does not count: the updates made so far and, for this step's learning rate, what the bias
// corrections make of it.
struct AdamWScalars {
  int64_t steps;                 // updates made (torch's state["step"])
  float step_size;               // lr / (1 - beta1^steps)
  float bias_correction2_sqrt;   // sqrt(1 - beta2^steps)
  float decay_factor;            // 1 - lr * weight_decay
};
// Before a step's adamw_step / adamw_shard launches: counts the update unless *skip (device, may
// be null) is set, and sets the scalars for lr (computed in double, as torch does on the host).
void adamw_begin_step(AdamWScalars* scalars, double lr, AdamWHyper h, const int* skip, cudaStream_t stream);

// Which elements are decayed (timm's parameter groups: not the norms, biases and embeddings):
// element e of the flat buffer is decayed iff flags[e >> chunk_shift] is non-zero. first: the
// flat index of the range's element 0, first % 4 == 0, and 4 <= 1 << chunk_shift.
struct DecayFlags {
  const uint8_t* flags;
  int chunk_shift;
  size_t first;
};

// AdamW over n elements: exp_avg and exp_avg_sq the moments, the rules of sgd_momentum_step for
// alignment, skip and grad_norm.
void adamw_step(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, __nv_bfloat16* params_bf16,
                size_t n, DecayFlags decay, AdamWHyper h, const AdamWScalars* scalars, cudaStream_t stream,
                const int* skip = nullptr, const float* grad_norm = nullptr);
// One rank's share of a sharded AdamW step, the peers' gradients added as in sgd_momentum_shard.
void adamw_shard(float* params, float* exp_avg, float* exp_avg_sq, const float* grads, const float* received,
                 size_t stride, int peers, __nv_bfloat16* params_bf16, size_t n, DecayFlags decay, AdamWHyper h,
                 const AdamWScalars* scalars, cudaStream_t stream, const int* skip = nullptr);
