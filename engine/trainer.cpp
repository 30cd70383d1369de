#include "engine/trainer.h"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/attention.h"
#include "kernels/optimizer.h"
#include "kernels/random.h"

namespace {
constexpr size_t kGemmWorkspace = 32u << 20;  // what cuBLASLt asks for on Hopper
constexpr uint64_t kDataStream = 1ull << 40;  // random streams of the data, apart from the weights'

double gib(size_t bytes) { return bytes / double(1ull << 30); }

// Bytes a model of this batch needs on the device, by summing its arenas (nothing allocated).
size_t bytes_for_batch(const ViTConfig& cfg, int batch) {
  ModelArenas a;
  ViT probe(cfg, batch, a);
  return a.bytes();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

double known_peak_tflops(const cudaDeviceProp& props) {
  const std::string name = props.name;
  // Dense bf16 tensor-core peaks from the vendors' datasheets.
  if (name.find("H100 PCIe") != std::string::npos) return 756.0;
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos ||
      name.find("H800") != std::string::npos || name.find("GH200") != std::string::npos)
    return 989.4;
  if (name.find("A100") != std::string::npos) return 312.0;
  return 0;
}

Trainer::Trainer(const TrainOptions& opts) : opts_(opts) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw RuntimeError(std::string("no CUDA GPU is available (") +
                       (e != cudaSuccess ? cudaGetErrorString(e) : "no device found") + ")");
  }
  if (opts_.gpus > count)
    throw UsageError("--gpus " + std::to_string(opts_.gpus) + " asks for more GPUs than the " + std::to_string(count) +
                     " present");
  if (opts_.gpus > 1)
    throw UsageError("--gpus " + std::to_string(opts_.gpus) +
                     ": data-parallel training is not built yet; this version trains on one GPU (--gpus 1)");
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaGetDeviceProperties(&props_, 0));
  if (props_.major != 9 || props_.minor != 0)
    throw RuntimeError(std::string(props_.name) + " has compute capability " + std::to_string(props_.major) + "." +
                       std::to_string(props_.minor) + "; this engine is built for Hopper (sm_90a) and needs it");
  peak_tflops_ = opts_.peak_tflops > 0 ? opts_.peak_tflops : known_peak_tflops(props_);

  const ViTConfig& cfg = opts_.model;
  const std::string why = attention_unsupported_reason(cfg.tokens(), cfg.head_dim());
  if (!why.empty()) throw UsageError("this model's attention shape is not supported: " + why);

  // Everything the run needs, checked against free memory before anything is allocated.
  gemm_workspace_ = kGemmWorkspace;
  const size_t need = bytes_for_batch(cfg, opts_.batch) + gemm_workspace_;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t usable = free_b - std::min(free_b, size_t(512) << 20);  // room for the CUDA libraries
  if (need > usable) {
    const size_t per_image = bytes_for_batch(cfg, 2) - bytes_for_batch(cfg, 1);
    const size_t fixed = bytes_for_batch(cfg, 1) - per_image + gemm_workspace_;
    const long fits = usable > fixed ? static_cast<long>((usable - fixed) / per_image) : 0;
    char msg[400];
    std::snprintf(msg, sizeof msg,
                  "batch %d does not fit: it needs %.1f GiB of device memory and %s has %.1f GiB free; "
                  "the largest batch that fits is about %ld",
                  opts_.batch, gib(need), props_.name, gib(free_b), fits);
    throw RuntimeError(msg);
  }

  model_ = std::make_unique<ViT>(cfg, opts_.batch, arenas_);
  arenas_.commit();
  gemm_ = std::make_unique<Gemm>(gemm_workspace_, opts_.gemm_autotune);
  timer_ = std::make_unique<OpTimer>(opts_.timing, 64 + 20 * cfg.depth);  // ~16 scopes a block
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  model_->init_params(opts_.seed, stream_);
  prepare();
}

// One untimed forward and backward before the first step: each GEMM shape gets its algorithm
// (timed once, synchronising) and every kernel is loaded, so no step pays for either. It changes
// nothing: the first step recomputes the same batch, activations and gradients.
void Trainer::prepare() {
  load_batch(0);
  forward_backward();
  timer_->finish_step(false);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void Trainer::end_step(int step) { timer_->finish_step(step >= opts_.warmup); }

Trainer::~Trainer() {
  if (stream_) cudaStreamDestroy(stream_);
}

void Trainer::print_summary() const {
  const ViTConfig& cfg = opts_.model;
  const ParamLayout& layout = model_->layout();
  std::printf("vit_train: %s\n", cfg.describe().c_str());
  std::printf("  parameters  %zu in %zu tensors\n", layout.count(), layout.tensors().size());
  std::printf("  device      %s, %d SMs, %.1f GiB, compute capability %d.%d, dense bf16 peak %s\n", props_.name,
              props_.multiProcessorCount, gib(props_.totalGlobalMem), props_.major, props_.minor,
              peak_tflops_ > 0 ? (std::to_string(static_cast<int>(peak_tflops_)) + " TFLOP/s").c_str()
                               : "unknown (give --peak-tflops for MFU)");
  std::printf("  precision   %s: bf16 GEMMs and attention with fp32 accumulation; fp32 LayerNorm, softmax, loss,\n"
              "              residual stream, master weights, gradients and momentum\n",
              opts_.precision.c_str());
  std::printf("  training    batch %d, %d steps (%d warm-up), SGD lr %g momentum %g weight decay %g%s, seed %llu\n",
              opts_.batch, opts_.steps, opts_.warmup, opts_.lr, opts_.momentum, opts_.weight_decay,
              opts_.nesterov ? " nesterov" : "", static_cast<unsigned long long>(opts_.seed));
  std::printf("  model FLOPs %.1f GFLOP per image per training step\n", cfg.train_flops_per_image() / 1e9);
  std::printf("  memory      (allocated once, at start-up)\n");
  size_t total = gemm_workspace_;
  for (const Arena* a : arenas_.all()) {
    std::printf("    %-42s %9.2f GiB\n", a->name().c_str(), gib(a->bytes()));
    total += a->bytes();
  }
  std::printf("    %-42s %9.2f GiB\n", "cuBLASLt workspace", gib(gemm_workspace_));
  std::printf("    %-42s %9.2f GiB\n", "total", gib(total));
  std::fflush(stdout);
}

void Trainer::load_batch(int step) {
  NvtxRange range("synthetic batch");
  auto t = timer_->op(OpKind::Data, stream_);
  const ViTConfig& cfg = opts_.model;
  const size_t n = static_cast<size_t>(opts_.batch) * cfg.channels * cfg.img * cfg.img;
  // The seed's synthetic data: N(0, 1) images, label = global sample index % classes.
  fill_normal(model_->images(), n, opts_.seed, kDataStream + step, 0.0f, 1.0f, -INFINITY, INFINITY, stream_);
  fill_labels(model_->labels(), opts_.batch, static_cast<int64_t>(step) * opts_.batch, cfg.classes, stream_);
}

void Trainer::forward_backward() {
  model_->forward(stream_, *gemm_, *timer_);
  model_->backward(stream_, *gemm_, *timer_);
}

void Trainer::optimizer_step(int step) {
  NvtxRange range("optimizer");
  auto phase = timer_->phase(Phase::Optimizer, stream_);
  auto t = timer_->op(OpKind::Optimizer, stream_);
  const SgdHyper h{static_cast<float>(opts_.lr), static_cast<float>(opts_.momentum),
                   static_cast<float>(opts_.weight_decay), opts_.nesterov};
  sgd_momentum_step(model_->params(), model_->momentum(), model_->grads(), model_->params_bf16(),
                    model_->layout().total(), h, step == 0, stream_);
}

void Trainer::train() {
  print_summary();
  const double flops_per_step = opts_.model.train_flops_per_image() * opts_.batch;
  const int window = std::min(opts_.log_every, opts_.steps);  // steps between two log points
  std::vector<cudaEvent_t> begin(window), end(window);
  for (int i = 0; i < window; ++i) {
    CUDA_CHECK(cudaEventCreate(&begin[i]));
    CUDA_CHECK(cudaEventCreate(&end[i]));
  }
  std::vector<double> step_ms;  // every step's time, warm-up included
  float* loss_host = nullptr;
  CUDA_CHECK(cudaMallocHost(&loss_host, sizeof(float)));
  std::printf("\n%11s %10s %10s %10s %10s %7s\n", "step", "loss", "ms/step", "images/s", "TFLOP/s", "MFU");

  int window_start = 0;
  for (int step = 0; step < opts_.steps; ++step) {
    if (step == opts_.profile_first) CUDA_CHECK(cudaProfilerStart());
    const int slot = step - window_start;
    {
      NvtxRange range("step");
      CUDA_CHECK(cudaEventRecord(begin[slot], stream_));
      load_batch(step);
      forward_backward();
      optimizer_step(step);
      CUDA_CHECK(cudaEventRecord(end[slot], stream_));
    }
    end_step(step);
    if (step == opts_.profile_last) CUDA_CHECK(cudaProfilerStop());

    const bool last = step + 1 == opts_.steps;
    if (slot + 1 == opts_.log_every || last) {  // the only host synchronisation of a plain run
      CUDA_CHECK(cudaMemcpyAsync(loss_host, model_->loss(), sizeof(float), cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      double window_ms = 0;
      for (int i = 0; i <= slot; ++i) {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, begin[i], end[i]));
        step_ms.push_back(ms);
        window_ms += ms;
      }
      const double ms = window_ms / (slot + 1);
      const double tflops = flops_per_step / (ms * 1e-3) / 1e12;
      char mfu[16] = "-";
      if (peak_tflops_ > 0) std::snprintf(mfu, sizeof mfu, "%.1f%%", 100 * tflops / peak_tflops_);
      std::printf("%5d/%-5d %10.4f %10.2f %10.1f %10.1f %7s%s\n", step + 1, opts_.steps, *loss_host, ms,
                  opts_.batch / (ms * 1e-3), tflops, mfu, step < opts_.warmup ? "  (warm-up)" : "");
      std::fflush(stdout);
      if (!std::isfinite(*loss_host))
        throw RuntimeError("the loss is not finite (" + std::to_string(*loss_host) + ") at step " +
                           std::to_string(step + 1) + "; stopping");
      window_start = step + 1;
    }
  }
  CUDA_CHECK(cudaFreeHost(loss_host));
  for (int i = 0; i < window; ++i) {
    cudaEventDestroy(begin[i]);
    cudaEventDestroy(end[i]);
  }

  const std::vector<double> timed(step_ms.begin() + opts_.warmup, step_ms.end());
  const double med = median(timed);
  double mean = 0;
  for (double v : timed) mean += v / timed.size();
  const double tflops = flops_per_step / (med * 1e-3) / 1e12;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double used_gib = gib(total_b - free_b);
  std::printf("%s", timer_->report().c_str());
  std::printf("\nsummary over %zu timed steps (after %d warm-up): median %.2f ms/step (mean %.2f), %.1f images/s, "
              "%.1f TFLOP/s",
              timed.size(), opts_.warmup, med, mean, opts_.batch / (med * 1e-3), tflops);
  if (peak_tflops_ > 0) std::printf(", MFU %.1f%%", 100 * tflops / peak_tflops_);
  std::printf("; device memory in use %.2f GiB\n", used_gib);
  std::printf("RESULT engine step_ms=%.2f mean_ms=%.2f img_s=%.1f tflops=%.1f mfu=%.3f peak_mem_gib=%.2f\n", med, mean,
              opts_.batch / (med * 1e-3), tflops, peak_tflops_ > 0 ? tflops / peak_tflops_ : 0.0, used_gib);
  std::fflush(stdout);
}
