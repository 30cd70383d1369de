// The optimizer over the model's flat fp32 master weights, writing the bf16 copy the next
// forward's GEMMs read: SGD with momentum (torch.optim.SGD: dampening 0, L2 weight decay,
// optional Nesterov) or AdamW (torch.optim.AdamW with timm's parameter groups: no weight decay
// on 1-D tensors, pos_embed and cls_token). Replicated (every rank updates every weight, on any
// range of the flat buffers) or sharded over the ranks (each updates its share of every gradient
// bucket, comm/grad_sync.h).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/cli.h"
#include "kernels/optimizer.h"
#include "model/memory_request.h"
#include "model/params.h"
#include "model/vit.h"

class GradSync;  // comm/grad_sync.h

struct OptimizerSettings {
  OptimizerKind kind = OptimizerKind::Sgd;
  double weight_decay = 0;
  double momentum = 0.9;  // SGD
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  double max_grad_norm = 0;  // the clipping threshold, where a norm is given
  static OptimizerSettings from(const TrainOptions& opts);
};

// The optimizer's state buffers by the names checkpoints give them ("<name>.<tensor>").
inline std::vector<std::string> optimizer_state_names(OptimizerKind kind) {
  if (kind == OptimizerKind::Sgd) return {"momentum"};
  return {"exp_avg", "exp_avg_sq"};  // torch.optim.AdamW's
}

// Whether timm's AdamW parameter groups decay a tensor: not the 1-D ones (norms, biases), nor
// pos_embed and cls_token (VisionTransformer.no_weight_decay()).
bool decays_weight(const ParamTensor& t);

// One step's: its learning rate, and whether it is the run's first (SGD's momentum starts as the
// gradient there).
struct OptimizerStep {
  double lr;
  bool first_step;
};

class Optimizer {
 public:
  // Declares the state (SGD: the momentum; AdamW: both moments, the decay flags and the step's
  // scalars), one float per element of the model's layout for each buffer.
  Optimizer(const ViT& model, const OptimizerSettings& settings, MemoryRequest& memory);
  const OptimizerSettings& settings() const { return settings_; }

  // The state buffers (optimizer_state_names), each of the layout's length.
  struct StateBuffer {
    std::string name;
    float* data;
  };
  std::vector<StateBuffer> state() const;
  // AdamW's updates made so far (torch's state["step"], the bias correction's t); 0 for SGD.
  int64_t steps(cudaStream_t stream) const;
  void set_steps(int64_t steps, cudaStream_t stream);
  // Zeroes the state and writes the decay flags (before the first step).
  void reset(cudaStream_t stream);

  // Before a step's updates: AdamW counts the step (unless *skip) and sets its scalars.
  void begin_step(const OptimizerStep& step, const int* skip, cudaStream_t stream);
  // [begin, end) of the flat buffers. skip (device, may be null): FP8's numerics guard, the step
  // changes nothing while *skip is set. grad_norm (device, may be null): the gradients' global
  // norm, clipped to settings().max_grad_norm first.
  void update(size_t begin, size_t end, const OptimizerStep& step, const int* skip, const float* grad_norm,
              cudaStream_t stream);
  // Sharded, after the gradient exchange has finished: this rank's share of every bucket (the
  // peers' copies of its gradient added in rank order: the replicated step's bits), each share's
  // new bf16 weights sent to every rank while the next share is updated. No clipping. Calls
  // begin_step itself.
  void update_sharded(GradSync& sync, const OptimizerStep& step, const int* skip, cudaStream_t stream);

 private:
  SgdHyper sgd_hyper(const OptimizerStep& step) const;
  AdamWHyper adamw_hyper() const;
  DecayFlags decay_from(size_t first) const;

  const ViT& model_;  // its flat buffers, read at each update (placed after construction)
  OptimizerSettings settings_;
  float *momentum_ = nullptr, *exp_avg_ = nullptr, *exp_avg_sq_ = nullptr;
  uint8_t* decay_flags_ = nullptr;  // one per ParamLayout::kParamAlign elements
  AdamWScalars* scalars_ = nullptr;
};
