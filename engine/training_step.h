// One GPU's training step, composed from its parts: the model's forward and backward, the FP8
// recipe's bookkeeping around them, the optimizer, and the streams they run on (the critical
// path's, and with --second-stream a second one for the weight gradients and the optimizer).
// Every call takes the critical path's stream; the second stream joins it where needed, so that
// the weights are those of one stream bit for bit given the same GEMM algorithms.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/fp8_recipe.h"
#include "engine/optimizer.h"
#include "engine/second_stream.h"
#include "kernels/gemm.h"
#include "kernels/op_timer.h"
#include "model/vit.h"

class GradSync;  // comm/grad_sync.h

class TrainingStep {
 public:
  // fp8: the recipe in FP8, null in bf16 (none of these is owned).
  TrainingStep(ViT& model, Optimizer& optimizer, Fp8Recipe* fp8) : model_(model), optimizer_(optimizer), fp8_(fp8) {}

  ViT& model() { return model_; }
  Optimizer& optimizer() { return optimizer_; }
  Fp8Recipe* fp8() { return fp8_; }

  // A second stream (on; off by default here, vit_train's --second-stream), for the work off
  // the critical path; its Gemm (a workspace of gemm_workspace bytes) is tuned in the first
  // backward after this, which still runs the weight gradients in line so that they are timed
  // alone.
  void set_second_stream(bool on, size_t gemm_workspace, bool autotune);
  bool has_second_stream() const { return second_ != nullptr; }
  cudaStream_t second_stream() const;  // null without one
  // Tests: one stream falls behind the other by ns nanoseconds (a spinning kernel), so that a
  // missing wait between them shows as a wrong result. The second stream: at each fork to it and
  // each update (against a missing wait of the critical path for it); the critical path: at each
  // block of the backward and at the embeddings' (against a missing wait of the second stream).
  enum class Lagging { SecondStream, CriticalPath };
  void set_second_stream_lag(uint64_t ns, Lagging which);

  // timm's initialisation from the seed, the optimizer's state zero, the FP8 scaling state fresh.
  void init(uint64_t seed, cudaStream_t stream);
  // After the fp32 master weights were written from outside (loading, tests): their copies.
  void refresh_weight_copies(cudaStream_t stream);
  // Delayed scaling needs past amaxes; at the start there are none (scale 1 would flush most
  // gradients to zero). One forward and backward with current scaling fills every history.
  // Returns false (doing nothing) where there is no delayed recipe to start.
  bool prime_fp8_scales(cudaStream_t stream, Gemm& gemm, OpTimer& timer);

  // The step: begin, then forward, backward and end for each micro-batch (one without gradient
  // accumulation; the first backward writes the gradients, the others add to them), update.
  void begin(cudaStream_t stream);
  // The forward waits, part by part, for an update still running on the second stream.
  void forward(cudaStream_t stream, Gemm& gemm, OpTimer& timer);
  void backward(cudaStream_t stream, Gemm& gemm, OpTimer& timer,
                const std::function<void(size_t)>& grads_ready_from = {}, GradWrite write = GradWrite::Overwrite);
  // After each micro-batch's backward; last_micro_batch: the optimizer step's last (FP8: see
  // Fp8Recipe::end_step).
  void end(cudaStream_t stream, bool last_micro_batch = true);
  // The optimizer over every weight (clipped by grad_norm, skipped in FP8 when the step was bad),
  // then in FP8 the next forward's weight copies. With the second stream it runs there, part by
  // part in the order the next forward reads the weights (in line with the FP8 current recipe,
  // whose weight casts reduce their amaxes and flag a bad step on the critical path).
  void update(const OptimizerStep& step, const float* grad_norm, cudaStream_t stream, OpTimer* timer = nullptr);
  // The sharded update (comm/grad_sync.h), in line, then the FP8 weight copies.
  void update_sharded(GradSync& sync, const OptimizerStep& step, cudaStream_t stream, OpTimer* timer = nullptr);
  // Makes stream wait for all of the last update: before anything but the next forward reads or
  // writes the weights, the gradients or the FP8 state.
  void await_update(cudaStream_t stream);

  // --fp8-stats (no-ops in bf16).
  void set_fp8_counting(bool on, cudaStream_t stream);
  std::string fp8_stats_table(cudaStream_t stream);

 private:
  ViT& model_;
  Optimizer& optimizer_;
  Fp8Recipe* fp8_;
  std::unique_ptr<SecondStream> second_;
};
