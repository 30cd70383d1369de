#include "engine/training_step.h"

#include "kernels/check.h"

void TrainingStep::set_second_stream(bool on, size_t gemm_workspace, bool autotune) {
  second_.reset();  // its destructor waits for its stream
  if (on) second_ = std::make_unique<SecondStream>(gemm_workspace, autotune, model_.parameter_parts());
}

cudaStream_t TrainingStep::second_stream() const { return second_ ? second_->stream() : nullptr; }

void TrainingStep::set_second_stream_lag(uint64_t ns, Lagging which) {
  if (second_) (which == Lagging::SecondStream ? second_->lag_ns : second_->critical_lag_ns) = ns;
}

void TrainingStep::init(uint64_t seed, cudaStream_t st) {
  await_update(st);
  if (fp8_) fp8_->init(st);
  model_.init_params(seed, st);
  optimizer_.reset(st);
}

void TrainingStep::refresh_weight_copies(cudaStream_t st) {
  await_update(st);
  model_.refresh_weight_copies(st);
}

bool TrainingStep::prime_fp8_scales(cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  await_update(st);
  if (!fp8_ || fp8_->options().current) return false;
  fp8_->set_current(true);
  model_.cast_fp8_weights(st);
  forward(st, gemm, timer);
  backward(st, gemm, timer);
  fp8_->set_current(false);
  fp8_->clear_step_flag(st);
  model_.cast_fp8_weights(st);  // with the primed scales, recording the weights' amaxes for step 0's update
  return true;
}

void TrainingStep::begin(cudaStream_t st) {
  if (fp8_) fp8_->begin_step(st);
}

void TrainingStep::forward(cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  const bool pending = second_ && second_->update_pending;
  model_.forward(st, gemm, timer, pending ? second_->updated() : nullptr);
  if (second_) second_->update_pending = false;  // the forward waited for the last part
}

void TrainingStep::backward(cudaStream_t st, Gemm& gemm, OpTimer& timer,
                            const std::function<void(size_t)>& grads_ready_from, GradWrite write) {
  if (!second_) {
    model_.backward(st, gemm, timer, grads_ready_from, nullptr, write);
    return;
  }
  const WeightGradStream lane = second_->weight_grads();
  model_.backward(st, gemm, timer, grads_ready_from, &lane, write);
}

void TrainingStep::end(cudaStream_t st, bool last_micro_batch) {
  if (fp8_) fp8_->end_step(model_.loss(), st, last_micro_batch);
}

void TrainingStep::await_update(cudaStream_t st) {
  if (!second_) return;
  if (second_->update_pending)  // the last part: the stream runs them in order
    CUDA_CHECK(cudaStreamWaitEvent(st, second_->updated(model_.parameter_parts() - 1)));
  second_->update_pending = false;
}

void TrainingStep::update(const OptimizerStep& step, const float* grad_norm, cudaStream_t st, OpTimer* timer) {
  OpTimer untimed(false);
  OpTimer& tm = timer ? *timer : untimed;
  const int* skip = fp8_ ? fp8_->step_non_finite() : nullptr;
  await_update(st);  // a previous update not yet waited for (none, between training steps)
  if (!second_ || (fp8_ && fp8_->options().current)) {
    { auto t = tm.op(OpKind::Optimizer, st);
      optimizer_.begin_step(step, skip, st);
      optimizer_.update(0, model_.layout().total(), step, skip, grad_norm, st); }
    model_.cast_fp8_weights(st, timer);
    return;
  }
  // The next step's begin() clears the skip flag while this update may still read it: a copy.
  // (grad_norm is written again only after the next forward, which waits for the update.)
  if (fp8_) CUDA_CHECK(cudaMemcpyAsync(second_->skip_copy(), skip, sizeof(int), cudaMemcpyDeviceToDevice, st));
  second_->fork(st);
  const cudaStream_t ss = second_->stream();
  const int depth = model_.config().depth;
  const int* skip_copy = fp8_ ? second_->skip_copy() : nullptr;
  optimizer_.begin_step(step, skip_copy, ss);
  for (int part = 0; part < model_.parameter_parts(); ++part) {
    { auto t = tm.op(OpKind::Optimizer, ss);
      optimizer_.update(model_.parameter_part_begin(part), model_.parameter_part_begin(part + 1), step, skip_copy,
                        grad_norm, ss); }
    if (fp8_ && part >= 1 && part <= depth) model_.cast_fp8_weights(part - 1, 1, ss, timer);
    CUDA_CHECK(cudaEventRecord(second_->updated(part), ss));
  }
  second_->update_pending = true;
}

void TrainingStep::update_sharded(GradSync& sync, const OptimizerStep& step, cudaStream_t st, OpTimer* timer) {
  OpTimer untimed(false);
  { auto t = (timer ? *timer : untimed).op(OpKind::Optimizer, st);
    optimizer_.update_sharded(sync, step, fp8_ ? fp8_->step_non_finite() : nullptr, st); }
  model_.cast_fp8_weights(st, timer);  // the next forward's FP8 weights
}

void TrainingStep::set_fp8_counting(bool on, cudaStream_t st) {
  if (!fp8_) return;
  if (on && !fp8_->counting()) await_update(st);  // its weight casts may be counting
  fp8_->set_counting(on, st);
}

std::string TrainingStep::fp8_stats_table(cudaStream_t st) {
  if (!fp8_) return "";
  await_update(st);  // its weight casts write their amaxes and counts
  return fp8_->stats_table(model_.fp8_tensor_groups(), st);
}
