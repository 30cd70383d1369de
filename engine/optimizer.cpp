#include "engine/optimizer.h"

#include <algorithm>

#include "comm/grad_sync.h"
#include "kernels/check.h"
#include "kernels/nvtx.h"

namespace {
constexpr int kDecayChunkShift = 7;
static_assert(ParamLayout::kParamAlign == size_t(1) << kDecayChunkShift, "a decay flag per aligned chunk");
}  // namespace

OptimizerSettings OptimizerSettings::from(const TrainOptions& o) {
  OptimizerSettings s;
  s.kind = o.optimizer;
  s.weight_decay = o.weight_decay;
  s.momentum = o.momentum;
  s.nesterov = o.nesterov;
  s.beta1 = o.beta1;
  s.beta2 = o.beta2;
  s.eps = o.eps;
  s.max_grad_norm = o.clip_grad;
  return s;
}

bool decays_weight(const ParamTensor& t) {
  return t.shape.size() >= 2 && t.name != "pos_embed" && t.name != "cls_token";
}

Optimizer::Optimizer(const ViT& model, const OptimizerSettings& settings, MemoryRequest& memory)
    : model_(model), settings_(settings) {
  const size_t n = model.layout().total();
  if (settings.kind == OptimizerKind::Sgd) {
    memory.add(MemoryCategory::OptimizerState, &momentum_, n);
  } else {
    memory.add(MemoryCategory::OptimizerState, &exp_avg_, n);
    memory.add(MemoryCategory::OptimizerState, &exp_avg_sq_, n);
    memory.add(MemoryCategory::OptimizerState, &decay_flags_, n >> kDecayChunkShift);
    memory.add(MemoryCategory::OptimizerState, &scalars_, 1);
  }
}

std::vector<Optimizer::StateBuffer> Optimizer::state() const {
  const std::vector<std::string> names = optimizer_state_names(settings_.kind);
  if (settings_.kind == OptimizerKind::Sgd) return {{names[0], momentum_}};
  return {{names[0], exp_avg_}, {names[1], exp_avg_sq_}};
}

int64_t Optimizer::steps(cudaStream_t st) const {
  if (!scalars_) return 0;
  AdamWScalars s;
  CUDA_CHECK(cudaMemcpyAsync(&s, scalars_, sizeof s, cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaStreamSynchronize(st));
  return s.steps;
}

void Optimizer::set_steps(int64_t steps, cudaStream_t st) {
  if (!scalars_) return;
  const AdamWScalars s{steps, 0.0f, 1.0f, 1.0f};
  CUDA_CHECK(cudaMemcpyAsync(scalars_, &s, sizeof s, cudaMemcpyHostToDevice, st));
  CUDA_CHECK(cudaStreamSynchronize(st));  // (s lives on this stack)
}

void Optimizer::reset(cudaStream_t st) {
  const size_t n = model_.layout().total();
  for (const StateBuffer& b : state()) CUDA_CHECK(cudaMemsetAsync(b.data, 0, n * sizeof(float), st));
  if (!decay_flags_) return;
  std::vector<uint8_t> flags(n >> kDecayChunkShift, 0);
  for (const ParamTensor& t : model_.layout().tensors()) {
    if (!decays_weight(t)) continue;
    const size_t first = t.offset >> kDecayChunkShift;
    const size_t end = (t.offset + t.numel + ParamLayout::kParamAlign - 1) >> kDecayChunkShift;
    std::fill(flags.begin() + first, flags.begin() + end, 1);
  }
  CUDA_CHECK(cudaMemcpyAsync(decay_flags_, flags.data(), flags.size(), cudaMemcpyHostToDevice, st));
  set_steps(0, st);  // (synchronises: flags lives on this stack)
}

SgdHyper Optimizer::sgd_hyper(const OptimizerStep& step) const {
  SgdHyper h{static_cast<float>(step.lr), static_cast<float>(settings_.momentum),
             static_cast<float>(settings_.weight_decay), settings_.nesterov};
  h.max_grad_norm = static_cast<float>(settings_.max_grad_norm);
  return h;
}

AdamWHyper Optimizer::adamw_hyper() const {
  AdamWHyper h{settings_.beta1, settings_.beta2, settings_.eps, settings_.weight_decay};
  h.max_grad_norm = static_cast<float>(settings_.max_grad_norm);
  return h;
}

DecayFlags Optimizer::decay_from(size_t first) const { return {decay_flags_, kDecayChunkShift, first}; }

void Optimizer::begin_step(const OptimizerStep& step, const int* skip, cudaStream_t st) {
  if (settings_.kind == OptimizerKind::AdamW) adamw_begin_step(scalars_, step.lr, adamw_hyper(), skip, st);
}

void Optimizer::update(size_t begin, size_t end, const OptimizerStep& step, const int* skip, const float* grad_norm,
                       cudaStream_t st) {
  float* p = model_.params() + begin;
  const float* g = model_.grads() + begin;
  __nv_bfloat16* pb = model_.params_bf16() + begin;
  if (settings_.kind == OptimizerKind::Sgd)
    sgd_momentum_step(p, momentum_ + begin, g, pb, end - begin, sgd_hyper(step), step.first_step, st, skip, grad_norm);
  else
    adamw_step(p, exp_avg_ + begin, exp_avg_sq_ + begin, g, pb, end - begin, decay_from(begin), adamw_hyper(),
               scalars_, st, skip, grad_norm);
}

void Optimizer::update_sharded(GradSync& sync, const OptimizerStep& step, const int* skip, cudaStream_t st) {
  sync.begin_update(st);
  begin_step(step, skip, st);
  NvtxRange range("sharded optimizer: own shares, bf16 weights copied to every rank");
  for (const GradSync::Share& s : sync.own_shares()) {
    float* p = model_.params() + s.begin;
    const float* g = model_.grads() + s.begin;
    __nv_bfloat16* pb = model_.params_bf16() + s.begin;
    if (settings_.kind == OptimizerKind::Sgd)
      sgd_momentum_shard(p, momentum_ + s.begin, g, s.received, s.stride, s.sources, pb, s.count, sgd_hyper(step),
                         step.first_step, st, skip);
    else
      adamw_shard(p, exp_avg_ + s.begin, exp_avg_sq_ + s.begin, g, s.received, s.stride, s.sources, pb, s.count,
                  decay_from(s.begin), adamw_hyper(), scalars_, st, skip);
    sync.send_weights(s);
  }
  sync.finish_update();
}
