// SGD with momentum (torch.optim.SGD: dampening 0, L2 weight decay, optional Nesterov) over the
// model's flat fp32 master weights, writing the bf16 copy the next forward's GEMMs read.
// Replicated (every rank updates every weight, on any range of the flat buffers) or sharded
// over the ranks (each updates its share of every gradient bucket, comm/grad_sync.h).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/optimizer.h"
#include "model/memory_request.h"
#include "model/vit.h"

class GradSync;  // comm/grad_sync.h

class Sgd {
 public:
  // Declares the momentum buffer (optimizer state), one float per element of the model's layout.
  Sgd(const ViT& model, MemoryRequest& memory);
  float* momentum() const { return momentum_; }
  void zero_momentum(cudaStream_t stream);

  // [begin, end) of the flat buffers. skip (device, may be null): FP8's numerics guard, the step
  // changes nothing while *skip is set. grad_norm (device, may be null): the gradients' global
  // norm, clipped to h.max_grad_norm first.
  void update(size_t begin, size_t end, const SgdHyper& h, bool first_step, const int* skip, const float* grad_norm,
              cudaStream_t stream);
  // Sharded, after the gradient exchange has finished: this rank's share of every bucket (the
  // peers' copies of its gradient added in rank order: the replicated step's bits), each share's
  // new bf16 weights sent to every rank while the next share is updated. No clipping.
  void update_sharded(GradSync& sync, const SgdHyper& h, bool first_step, const int* skip, cudaStream_t stream);

 private:
  const ViT& model_;  // its flat buffers, read at each update (placed after construction)
  float* momentum_ = nullptr;
};
