// One GPU's part of a training run: built from the run plan (trainer_build.cpp: device checks,
// memory, the model and its step, the gradient exchange, the start-up pass), the loop with its
// evaluations and checkpoints (trainer.cpp), and what it prints (trainer_report.cpp). In a
// data-parallel run each worker (one GPU) has its own Trainer; they meet in the gradient
// exchange, the FP8 amax reduce, and the reduced losses and evaluations; rank 0 prints.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "comm/peer_group.h"
#include "engine/data_loader.h"
#include "engine/device_memory.h"
#include "engine/fp8_recipe.h"
#include "engine/optimizer.h"
#include "engine/run_plan.h"
#include "engine/schedule.h"
#include "engine/training_step.h"
#include "kernels/activity_trace.h"
#include "kernels/attention_choice.h"
#include "kernels/cudnn_attention.h"
#include "kernels/gemm.h"
#include "kernels/op_timer.h"
#include "model/memory_request.h"
#include "model/vit.h"

// A worker's place in a data-parallel run (the defaults: alone, on device 0).
struct WorkerContext {
  int rank = 0, world = 1, device = 0;
  std::string layout;          // how the ranks are spread, for the start-up summary
  Comm* comm = nullptr;        // null when alone
  PeerGroup* peers = nullptr;  // set: gradients summed through the copy engines (--allreduce)
  std::atomic<long>* progress = nullptr;  // steps finished, for the supervisor's timeout
  // What the worker is doing now (a string literal): a run that times out names it for each rank.
  std::atomic<const char*>* activity = nullptr;
  bool logs() const { return rank == 0; }
};

class Trainer {
 public:
  // Checks the device and the plan against it, sizes and allocates everything, initialises the
  // weights (or loads the plan's initial state, which is not read again after this) and runs the
  // untimed start-up pass. Throws UsageError or RuntimeError with a message naming the problem.
  // The plan outlives the trainer.
  explicit Trainer(const RunPlan& plan, WorkerContext ctx = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole run: progress lines, evaluations, checkpoints, the summary and the RESULT line.
  void train();
  // Top-1 and top-5 accuracy on the dataset's test split, in the training precision (each rank
  // takes a share of the batches; the counts are summed).
  struct Accuracy {
    double top1, top5;
  };
  Accuracy evaluate();
  // --eval-only: the start-up summary, one pass over the test split timed, its top-1 and top-5,
  // the images/s, and the RESULT line.
  void evaluate_only();
  // Per rank (rank order), gathered from every rank: checksums of the fp32 master weights and
  // of the bf16 copies the GEMMs read (with a sharded optimizer each rank's copy is written by
  // the shares' owners, so it is checked too).
  struct WeightChecksums {
    std::vector<unsigned long long> master, bf16;
  };
  WeightChecksums weight_checksums();
  // --timing on several ranks: every rank's mean phase times and exposed wait, [rank][4] (every
  // rank calls it: a collective).
  std::vector<float> rank_timings();

  // One step's pieces, in order (also used by the reference dump): for each of the step's
  // micro-batches (--accum-steps; one by default) its batch and its forward and backward, then
  // the update.
  // Into model().images()/labels(), and the micro-batch's drop-path masks drawn.
  void load_batch(int step, int micro_batch = 0);
  void forward_backward(int micro_batch = 0, bool sync_gradients = true);
  void optimizer_step(int step);
  void end_step(int step);  // --timing: collects the step's event times

  ViT& model() { return *model_; }
  TrainingStep& training_step() { return *step_; }
  cudaStream_t stream() const { return stream_; }

 private:
  void doing(const char* what) {
    if (ctx_.activity) ctx_.activity->store(what);
  }
  struct EpochResult {
    int epoch, steps;               // steps < an epoch's for a run that ends inside one
    double train_loss, top1, top5;  // NaN where no evaluation fell on the epoch's end
  };

  // Building (trainer_build.cpp).
  void check_device();
  void check_data_across_ranks();
  void check_memory();
  void build_model();
  void build_exchange();
  void build_loaders();
  void setup_attention();
  void prepare();
  size_t gemm_workspaces() const { return gemm_workspace_ * (second_stream_ ? 2 : 1); }
  size_t bucket_floats() const { return std::max<size_t>(1, (size_t(opts_.bucket_mb) << 20) / sizeof(float)); }
  static double gib(size_t bytes) { return bytes / double(1ull << 30); }

  // The loop (trainer.cpp).
  void record_epoch_and_evaluate(int step, std::vector<EpochResult>& epochs);
  void check_ranks_agree_on(const WeightChecksums& sums);
  // --save: a checkpoint after `steps_done` steps (every rank takes part; rank 0 writes).
  void save(int steps_done);
  // The mean over the ranks of a device scalar (itself when alone), read on the host.
  float mean_over_ranks(const float* device_value);
  // The last step's loss on this rank: the mean of its micro-batches' (device), and on the host
  // that mean over the ranks.
  const float* step_loss_sum() const { return step_loss_ ? step_loss_ : model_->loss(); }
  float step_loss_over_ranks() { return mean_over_ranks(step_loss_sum()) / opts_.accum_steps; }
  // Optimizer steps in an epoch of the training set (its batches, less any short of a whole step).
  int steps_per_epoch() const { return train_loader_->batches_per_epoch() / opts_.accum_steps; }
  // rows: device [world][k], this rank's row written on stream_; every rank's row, on the host
  // (with one rank, its own). A collective where there are several.
  template <typename T>
  std::vector<T> gather_rows(T* rows, int k, ncclDataType_t type);

  // Reporting (trainer_report.cpp), rank 0.
  void print_summary() const;
  void print_progress_header() const;
  // A progress line for the steps of a log window: their mean time, and the global batch's loss.
  void print_progress(int step, float loss, double window_ms, double elapsed_s);
  void print_epochs(const std::vector<EpochResult>& epochs) const;
  void print_final(const std::vector<double>& step_ms, const WeightChecksums& sums, const std::vector<float>& per_rank);
  // --log: one JSON line, flushed.
  void log_json(const std::string& fields);
  // --trace: the recorded steps (first_step..the window's last) written, what the file holds printed.
  void finish_trace(int first_step);

  const RunPlan& plan_;
  const TrainOptions& opts_;  // plan_.opts
  WorkerContext ctx_;
  int start_step_ = 0;        // --resume: the checkpoint's step
  std::string resumed_from_;  // --resume: the checkpoint
  std::FILE* log_ = nullptr;  // --log, rank 0
  __nv_bfloat16* reduce_staging_ = nullptr;  // ncclMemAlloc'd under --nccl-window, else cudaMalloc'd
  float* scalar_ = nullptr;                   // device scratch for reduced scalars
  unsigned long long* checksums_ = nullptr;   // device: [world][2] (master, bf16)
  float* rank_timings_ = nullptr;             // device: [world][4] (--timing, several ranks)
  cudaDeviceProp props_{};
  double peak_tflops_ = 0;
  // What the step is made of, in the order they are built (and destroyed in reverse): the
  // memory they ask for, the model, its optimizer and FP8 recipe, the memory itself, the step.
  MemoryRequest memory_;
  std::unique_ptr<ViT> model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Fp8Recipe> fp8_;  // null in bf16
  std::unique_ptr<DeviceMemory> device_memory_;
  std::unique_ptr<TrainingStep> step_;
  // After the memory: destroyed before it (its window must be deregistered before the memory
  // under it is freed, also when the constructor throws).
  std::unique_ptr<GradSync> sync_;
  std::unique_ptr<Gemm> gemm_;
  // cuDNN's fused attention where it runs (--attention cudnn, or where auto timed it faster), and
  // auto's timing, or why cuDNN was not considered.
  std::unique_ptr<CudnnAttention> cudnn_attention_;
  AttentionChoice attention_choice_;
  std::string cudnn_note_;
  std::unique_ptr<OpTimer> timer_;
  std::unique_ptr<ActivityTrace> trace_;  // --trace, on the rank that logs
  cudaStream_t stream_ = nullptr;
  size_t gemm_workspace_ = 0;   // each Gemm's
  bool second_stream_ = false;  // --second-stream, less under --timing: a second Gemm (workspace)
  LrSchedule schedule_;
  std::unique_ptr<BatchLoader> train_loader_, test_loader_;  // null: synthetic data; test_loader_ null: no evaluation
  float* loss_sum_ = nullptr;  // device: the epoch's summed training loss (of every micro-batch)
  float* step_loss_ = nullptr;  // device, with --accum-steps: the step's micro-batches' losses summed
  int* correct_ = nullptr;     // device: an evaluation's top-1 and top-5 counts
  float *grad_norm_ = nullptr, *norm_partial_ = nullptr;  // --clip-grad
};

// Returns the dense bf16 peak in TFLOP/s of a known GPU, or 0.
double known_peak_tflops(const cudaDeviceProp& props);
