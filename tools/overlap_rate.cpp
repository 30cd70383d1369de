// overlap_rate: how much of the step's memory-bound half two concurrent halves of the batch can
// hide behind each other's GEMMs (issue 33's first lever), measured before building it. Three
// ways to train B images a step, each a forward, backward and update (second streams on, as
// vit_train runs), timed with CUDA events, median of --steps after --warmup:
//   whole:      one model at batch B;
//   halves:     two models at B / 2, one after the other on one stream;
//   concurrent: the same two models, each on its own stream, at once (the second one's update
//               left out, as one update would serve both halves of a real step).
// The halves are independent models (their own weights): an upper bound on what interleaving the
// halves of one model's step can gain, whose halves also share weights and gradients.
// Usage: overlap_rate [--model NAME] [--precision bf16|fp8] [--batch B] [--steps N] [--warmup W]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/device_memory.h"
#include "engine/fp8_recipe.h"
#include "engine/optimizer.h"
#include "engine/training_step.h"
#include "kernels/check.h"
#include "kernels/event_timing.h"
#include "kernels/gemm.h"
#include "kernels/op_timer.h"
#include "kernels/random.h"
#include "model/config.h"
#include "model/memory_request.h"
#include "model/vit.h"

namespace {
constexpr size_t kGemmWorkspace = 32u << 20;

// One model's step with everything it needs, at one batch, on its own stream.
struct Half {
  MemoryRequest memory;
  std::unique_ptr<ViT> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<Fp8Recipe> fp8;
  std::unique_ptr<DeviceMemory> device;
  std::unique_ptr<TrainingStep> step;
  std::unique_ptr<Gemm> gemm;
  OpTimer timer{false};
  cudaStream_t stream = nullptr;

  Half(const ViTConfig& cfg, int batch, Precision precision, uint64_t seed) {
    model = std::make_unique<ViT>(cfg, batch, memory, precision);
    optimizer = std::make_unique<Optimizer>(*model, OptimizerSettings{}, memory);
    if (precision == Precision::FP8) fp8 = std::make_unique<Fp8Recipe>(*model, Fp8Options{}, memory);
    device = std::make_unique<DeviceMemory>(memory);
    step = std::make_unique<TrainingStep>(*model, *optimizer, fp8.get());
    step->set_second_stream(true, kGemmWorkspace, true);
    gemm = std::make_unique<Gemm>(kGemmWorkspace, true);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    step->init(seed, stream);
    const size_t n = size_t(batch) * cfg.channels * cfg.img * cfg.img;
    fill_normal(model->images(), n, seed, 1, 0.0f, 1.0f, -1e30f, 1e30f, stream);
    fill_labels(model->labels(), batch, 0, cfg.classes, stream);
    step->prime_fp8_scales(stream, *gemm, timer);
  }
  ~Half() {
    if (stream) {
      cudaStreamSynchronize(stream);
      step.reset();  // its second stream waits for its work
      cudaStreamDestroy(stream);
    }
  }
  void train_step(bool update) {
    step->begin(stream);
    step->forward(stream, *gemm, timer);
    step->backward(stream, *gemm, timer);
    step->end(stream);
    if (update) step->update(OptimizerStep{1e-4, false}, nullptr, stream);
    step->await_update(stream);  // the step ends when its weights are written
  }
};

// Median ms of `steps` calls of f after `warmup`, each timed between events on `timing`; f's
// streams are ordered after the start event and before the end event.
template <class F>
double median_ms(int warmup, int steps, cudaStream_t timing, const std::vector<Half*>& halves, F&& f) {
  cudaEvent_t start, end;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&end));
  std::vector<cudaEvent_t> done(halves.size());
  for (cudaEvent_t& e : done) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::vector<float> ms;
  for (int i = 0; i < warmup + steps; ++i) {
    CUDA_CHECK(cudaEventRecord(start, timing));
    for (Half* h : halves) CUDA_CHECK(cudaStreamWaitEvent(h->stream, start));
    f();
    for (size_t k = 0; k < halves.size(); ++k) {
      CUDA_CHECK(cudaEventRecord(done[k], halves[k]->stream));
      CUDA_CHECK(cudaStreamWaitEvent(timing, done[k]));
    }
    CUDA_CHECK(cudaEventRecord(end, timing));
    CUDA_CHECK(cudaEventSynchronize(end));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, start, end));
    if (i >= warmup) ms.push_back(t);
  }
  for (cudaEvent_t e : done) cudaEventDestroy(e);
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return median(ms);
}
}  // namespace

int main(int argc, char** argv) {
  ViTConfig cfg;
  Precision precision = Precision::BF16;
  int batch = 64, steps = 20, warmup = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (!v) {
      std::fprintf(stderr, "overlap_rate: %s needs a value\n", a.c_str());
      return 2;
    }
    ++i;
    if (a == "--model" && vit_preset(v, &cfg)) continue;
    if (a == "--precision" && (std::strcmp(v, "bf16") == 0 || std::strcmp(v, "fp8") == 0)) {
      precision = std::strcmp(v, "fp8") == 0 ? Precision::FP8 : Precision::BF16;
      continue;
    }
    const int n = std::atoi(v);
    if (a == "--batch" && n >= 2 && n % 2 == 0) batch = n;
    else if (a == "--steps" && n >= 1) steps = n;
    else if (a == "--warmup" && n >= 1) warmup = n;
    else {
      std::fprintf(stderr, "usage: overlap_rate [--model NAME] [--precision bf16|fp8] [--batch B (even)] "
                   "[--steps N] [--warmup W]\n");
      return 2;
    }
  }
  try {
    cudaStream_t timing;
    CUDA_CHECK(cudaStreamCreateWithFlags(&timing, cudaStreamNonBlocking));
    const char* prec = precision == Precision::FP8 ? "fp8" : "bf16";
    std::printf("%s, %s, batch %d (halves of %d), median of %d steps after %d; each step a forward, backward "
                "and update\n", cfg.describe().c_str(), prec, batch, batch / 2, steps, warmup);
    double whole_ms = 0;
    {
      Half whole(cfg, batch, precision, 1);
      whole_ms = median_ms(warmup, steps, timing, {&whole}, [&] { whole.train_step(true); });
    }
    Half a(cfg, batch / 2, precision, 2), b(cfg, batch / 2, precision, 3);
    cudaEvent_t a_done;
    CUDA_CHECK(cudaEventCreateWithFlags(&a_done, cudaEventDisableTiming));
    const double halves_ms = median_ms(warmup, steps, timing, {&a, &b}, [&] {
      a.train_step(true);
      CUDA_CHECK(cudaEventRecord(a_done, a.stream));  // one after the other
      CUDA_CHECK(cudaStreamWaitEvent(b.stream, a_done));
      b.train_step(false);
    });
    // One host thread enqueues a's step, then b's: b starts once a's launches are enqueued, a few
    // ms into a's ~half-step of GPU work.
    const double concurrent_ms = median_ms(warmup, steps, timing, {&a, &b}, [&] {
      a.train_step(true);
      b.train_step(false);
    });
    cudaEventDestroy(a_done);
    std::printf("%-12s %10s %10s %12s\n", "", "step ms", "images/s", "vs whole");
    for (const auto& [name, ms] : {std::pair<const char*, double>{"whole", whole_ms}, {"halves", halves_ms},
                                   {"concurrent", concurrent_ms}})
      std::printf("%-12s %10.2f %10.1f %12.3f\n", name, ms, batch / (ms * 1e-3), ms / whole_ms);
    std::printf("RESULT overlap precision=%s batch=%d whole_ms=%.2f halves_ms=%.2f concurrent_ms=%.2f\n", prec, batch,
                whole_ms, halves_ms, concurrent_ms);
    cudaStreamDestroy(timing);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "overlap_rate: %s\n", e.what());
    return 1;
  }
  return 0;
}
