// The runtime of one training run on one GPU: device checks, memory, the model, the step and
// the loop with its progress lines and summary. In a data-parallel run each worker (one GPU) has
// its own Trainer; they meet in the gradient all-reduce, the FP8 amax reduce, and the reduced
// losses and evaluations; rank 0 prints.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kernels/attention_choice.h"
#include "engine/cli.h"
#include "comm/grad_sync.h"
#include "kernels/cudnn_attention.h"
#include "engine/data_loader.h"
#include "engine/dataset.h"
#include "engine/packed_loader.h"
#include "kernels/gemm.h"
#include "engine/schedule.h"
#include "kernels/op_timer.h"
#include "model/vit.h"

// A worker's place in a data-parallel run (the defaults: alone, on device 0).
struct WorkerContext {
  int rank = 0, world = 1, device = 0;
  std::string layout;        // how the ranks are spread, for the start-up summary
  Comm* comm = nullptr;      // null when alone
  PeerGroup* peers = nullptr;  // set: gradients summed through the copy engines (--allreduce)
  std::atomic<long>* progress = nullptr;  // steps finished, for the supervisor's timeout
  // What the worker is doing now (a string literal): a run that times out names it for each rank.
  std::atomic<const char*>* activity = nullptr;
  bool logs() const { return rank == 0; }
};

class Trainer {
 public:
  // Checks the device and the options against it, sizes and allocates everything, initialises
  // the weights. Throws UsageError or RuntimeError with a message naming the problem.
  explicit Trainer(const TrainOptions& opts, WorkerContext ctx = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole run: progress lines, evaluations, the summary and the final RESULT line.
  void train();
  // Top-1 and top-5 accuracy on the dataset's test split, in the training precision (each rank
  // takes a share of the batches; the counts are summed).
  struct Accuracy {
    double top1, top5;
  };
  Accuracy evaluate();
  // The master weights' checksum, gathered from every rank (rank order).
  // Per rank: checksums of the fp32 master weights and of the bf16 copies the GEMMs read (with a
  // sharded optimizer each rank's copy is written by the shares' owners, so it is checked too).
  struct WeightChecksums {
    std::vector<unsigned long long> master, bf16;
  };
  WeightChecksums weight_checksums();
  // --timing on several ranks: every rank's mean phase times and exposed wait, [rank][4] (every
  // rank calls it: a collective).
  std::vector<float> rank_timings();

  // One step's pieces, in order (also used by the reference dump).
  void load_batch(int step);        // the step's batch into model().images()/labels()
  void forward_backward(bool sync_gradients = true);
  void optimizer_step(int step);
  void end_step(int step);          // --timing: collects the step's event times

  ViT& model() { return *model_; }
  cudaStream_t stream() const { return stream_; }

 private:
  void doing(const char* what) {
    if (ctx_.activity) ctx_.activity->store(what);
  }
  struct EpochResult {
    int epoch, steps;         // steps < an epoch's for a run that ends inside one
    double train_loss, top1, top5;  // NaN where no evaluation fell on the epoch's end
  };
  void print_summary() const;
  // --save: a checkpoint after `steps_done` steps (every rank takes part; rank 0 writes).
  void save(int steps_done);
  // --log: one JSON line (rank 0), flushed.
  void log_json(const std::string& fields);
  // The mean over the ranks of a device scalar (itself when alone), read on the host.
  float mean_over_ranks(const float* device_value);
  // rows: device [world][k], this rank's row written on stream_; every rank's row, on the host
  // (with one rank, its own). A collective where there are several.
  template <typename T>
  std::vector<T> gather_rows(T* rows, int k, ncclDataType_t type);
  void prepare();
  void record_epoch_and_evaluate(int step, std::vector<EpochResult>& epochs);

  TrainOptions opts_;
  WorkerContext ctx_;
  int start_step_ = 0;        // --resume: the checkpoint's step
  std::string resumed_from_;
  std::FILE* log_ = nullptr;  // --log, rank 0
  __nv_bfloat16* reduce_staging_ = nullptr;  // ncclMemAlloc'd under --nccl-window, else cudaMalloc'd
  float* scalar_ = nullptr;                   // device scratch for reduced scalars
  unsigned long long* checksums_ = nullptr;   // device: [world][2] (master, bf16)
  float* rank_timings_ = nullptr;             // device: [world][4] (--timing, several ranks)
  cudaDeviceProp props_{};
  double peak_tflops_ = 0;
  ModelArenas arenas_;
  std::unique_ptr<ViT> model_;
  // After arenas_: destroyed before them (its window must be deregistered before the memory under
  // it is freed, also when the constructor throws).
  std::unique_ptr<GradSync> sync_;
  std::unique_ptr<Gemm> gemm_;
  // cuDNN's fused attention where it runs (--attention cudnn, or where auto timed it faster), and
  // auto's timing, or why cuDNN was not considered.
  std::unique_ptr<CudnnAttention> cudnn_attention_;
  AttentionChoice attention_choice_;
  std::string cudnn_note_;
  void setup_cudnn_attention();
  std::unique_ptr<OpTimer> timer_;
  cudaStream_t stream_ = nullptr;
  size_t gemm_workspace_ = 0;  // each Gemm's
  bool second_stream_ = false;  // --second-stream, less under --timing: a second Gemm (workspace)
  size_t gemm_workspaces() const { return gemm_workspace_ * (second_stream_ ? 2 : 1); }
  LrSchedule schedule_;
  // Real data (--data fashion-mnist or packed); null for the synthetic set.
  std::unique_ptr<FashionMnist> fashion_;
  std::unique_ptr<PackedSet> packed_train_, packed_val_;
  std::unique_ptr<BatchLoader> train_loader_, test_loader_;  // test_loader_ null: no evaluation
  int train_count_ = 0, test_count_ = 0;
  std::string data_summary_;
  float* loss_sum_ = nullptr;  // device: the epoch's summed training loss
  int* correct_ = nullptr;     // device: an evaluation's top-1 and top-5 counts
  float *grad_norm_ = nullptr, *norm_partial_ = nullptr;  // --clip-grad
};

// Returns the dense bf16 peak in TFLOP/s of a known GPU, or 0.
double known_peak_tflops(const cudaDeviceProp& props);
