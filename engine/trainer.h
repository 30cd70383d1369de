// The runtime of one training run on one GPU: device checks, memory, the model, the step and
// the loop with its progress lines and summary.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/cli.h"
#include "engine/data_loader.h"
#include "engine/dataset.h"
#include "engine/gemm.h"
#include "engine/schedule.h"
#include "engine/timing.h"
#include "model/vit.h"

class Trainer {
 public:
  // Checks the device and the options against it, sizes and allocates everything, initialises
  // the weights. Throws UsageError or RuntimeError with a message naming the problem.
  explicit Trainer(const TrainOptions& opts);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole run: progress lines, evaluations, the summary and the final RESULT line.
  void train();
  // Top-1 accuracy on the dataset's test split, in the training precision.
  double evaluate();

  // One step's pieces, in order (also used by the reference dump).
  void load_batch(int step);        // the step's batch into model().images()/labels()
  void forward_backward();
  void optimizer_step(int step);
  void end_step(int step);          // --timing: collects the step's event times

  ViT& model() { return *model_; }
  cudaStream_t stream() const { return stream_; }

 private:
  struct EpochResult {
    int epoch, steps;         // steps < an epoch's for a run that ends inside one
    double train_loss, top1;  // top1 NaN where no evaluation fell on the epoch's end
  };
  void print_summary() const;
  void prepare();
  void record_epoch_and_evaluate(int step, std::vector<EpochResult>& epochs);

  TrainOptions opts_;
  cudaDeviceProp props_{};
  double peak_tflops_ = 0;
  ModelArenas arenas_;
  std::unique_ptr<ViT> model_;
  std::unique_ptr<Gemm> gemm_;
  std::unique_ptr<OpTimer> timer_;
  cudaStream_t stream_ = nullptr;
  size_t gemm_workspace_ = 0;
  LrSchedule schedule_;
  // Real data (--data fashion-mnist); null for the synthetic set.
  std::unique_ptr<FashionMnist> dataset_;
  std::unique_ptr<DataLoader> train_loader_, test_loader_;
  float* loss_sum_ = nullptr;  // device: the epoch's summed training loss
  int* correct_ = nullptr;     // device: an evaluation's correct count
};

// Returns the dense bf16 peak in TFLOP/s of a known GPU, or 0.
double known_peak_tflops(const cudaDeviceProp& props);
