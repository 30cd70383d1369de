// The runtime of one training run on one GPU: device checks, memory, the model, the step and
// the loop with its progress lines and summary.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "engine/cli.h"
#include "engine/gemm.h"
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

  // The whole run: progress lines, the summary and the final RESULT line.
  void train();

  // One step's pieces, in order (also used by the reference dump).
  void load_batch(int step);        // synthetic batch of this step into model().images()/labels()
  void forward_backward();
  void optimizer_step(int step);
  void end_step(int step);          // --timing: collects the step's event times

  ViT& model() { return *model_; }
  cudaStream_t stream() const { return stream_; }

 private:
  void print_summary() const;
  void prepare();

  TrainOptions opts_;
  cudaDeviceProp props_{};
  double peak_tflops_ = 0;
  ModelArenas arenas_;
  std::unique_ptr<ViT> model_;
  std::unique_ptr<Gemm> gemm_;
  std::unique_ptr<OpTimer> timer_;
  cudaStream_t stream_ = nullptr;
  size_t gemm_workspace_ = 0;
};

// Returns the dense bf16 peak in TFLOP/s of a known GPU, or 0.
double known_peak_tflops(const cudaDeviceProp& props);
