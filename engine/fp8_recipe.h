// The FP8 scaling recipe (--fp8-recipe, --amax-history, --fp8-margin): each FP8 tensor's scale,
// kept on the device in its scaling record (kernels/fp8_scaling.h), and how the tensor's
// producer runs; the numerics guard; and --fp8-stats.
//   delayed (default): a tensor is written with the scale from the maximum of its last N amaxes,
//     and its amax is recorded; at the step's end every scale is updated at once.
//   current: an amax-only pass first, the scale from that amax alone, then the writing pass.
// scale = fp8_max / amax / 2^margin. Across ranks the amaxes are reduced (max) over the
// communicator, so every rank scales alike. The numerics guard: a step whose loss or FP8 amaxes
// are not finite is skipped on the device (the optimizer reads the flag), the offending scales
// halved; kMaxSkippedInARow such steps in a row stop the run.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "model/fp8_tensors.h"
#include "model/memory_request.h"
#include "model/vit.h"

class Comm;  // comm/communicator.h

struct Fp8Options {
  bool current = false;  // current scaling (else delayed)
  int history = 16;      // delayed: amaxes remembered
  int margin = 0;
};

class Fp8Recipe : public Fp8Tensors {
 public:
  static constexpr int kMaxSkippedInARow = 10;

  // Declares the scaling records of the model's FP8 tensors (optimizer state) and becomes the
  // model's recipe.
  Fp8Recipe(ViT& model, Fp8Options options, MemoryRequest& memory);
  // Data parallel: the amaxes are reduced over comm (not owned).
  void set_comm(Comm* comm) { comm_ = comm; }
  const Fp8Options& options() const { return options_; }

  // Every record at scale 1 with an empty history, the guard's counters at zero. Synchronises.
  void init(cudaStream_t stream);
  // A step's bookkeeping: begin_step clears its non-finite flag; end_step (after the backward)
  // reduces the amaxes over the ranks, updates the delayed recipe's scales, and counts the step
  // as skipped if it saw a non-finite loss or amax.
  // Under gradient accumulation end_step runs after each micro-batch's backward: the amaxes of
  // the inputs and gradients join their histories after every micro-batch (each is scaled from
  // the micro-batches before it, as a step of its own would be); the weights' only after the
  // last (last_micro_batch), since their FP8 copies are cast once per optimizer step and their
  // scale must stay the one they were cast with. A non-finite value in any micro-batch skips the
  // optimizer step, which is counted once.
  void begin_step(cudaStream_t stream);
  void end_step(const float* loss, cudaStream_t stream, bool last_micro_batch = true);
  // The optimizer skips the update while *step_non_finite() is set.
  const int* step_non_finite() const { return non_finite_; }
  // The guard's counters back at zero, and the step's flag cleared (after the start-up pass).
  void reset_counters(cudaStream_t stream);
  void clear_step_flag(cudaStream_t stream);
  // The guard's counters, read on the host (after the stream's work); check_guard throws
  // RuntimeError once kMaxSkippedInARow steps in a row were skipped.
  struct Skipped {
    int total, in_a_row;
  };
  Skipped skipped_steps() const;
  static void check_guard(const Skipped& skipped);

  // Off for evaluation: producers use the training scales and record nothing.
  void set_recording(bool on) { recording_ = on; }
  // Current scaling for a while (the start-up pass that primes the delayed recipe's histories).
  void set_current(bool on) { options_.current = on; }
  // --fp8-stats: while on, producers count the values that underflow to zero and that saturate
  // (a little slower); the counts start from zero when it is switched on.
  void set_counting(bool on, cudaStream_t stream);
  bool counting() const { return counting_; }
  // One line per group (model: ViT::fp8_tensor_groups): scales, the last amax, and the fractions
  // counted since counting began. Synchronises the stream.
  std::string stats_table(const std::vector<ViT::Fp8TensorGroup>& groups, cudaStream_t stream) const;

  // The state as it lives on the device (checkpoints): the records, and the guard's counters
  // [skipped, in a row].
  Fp8Meta* metas() const { return metas_; }
  int count() const { return static_cast<int>(kinds_.size()); }
  int* skip_counters() const { return skipped_; }

  // Fp8Tensors
  Fp8Meta* meta(int tensor) const override { return metas_ + tensor; }
  void produce(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t, cudaStream_t stream,
               Fp8Producer launch) override;
  bool one_pass() const override { return recording_ && !options_.current; }
  Fp8Out one_pass_out(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t) const override;

 private:
  unsigned long long* stats(int tensor) const { return counting_ ? stats_ + 3 * tensor : nullptr; }
  std::vector<Fp8Kind> kinds_;
  std::vector<unsigned char> is_weight_;  // per tensor; on the device: weights_
  Fp8Options options_;
  Comm* comm_ = nullptr;
  bool recording_ = true, counting_ = false;
  Fp8Meta* metas_ = nullptr;
  unsigned long long* stats_ = nullptr;  // [underflow, saturated, values] per tensor, while counting
  int *non_finite_ = nullptr, *skipped_ = nullptr;
  unsigned char* weights_ = nullptr;  // per tensor: a weight (kept between micro-batches)
  float* amax_scratch_ = nullptr;  // where producers that record nothing put their amax
  float* amax_reduce_ = nullptr;   // the step's amaxes and a bad-step flag, gathered for the reduce
};
