// Building a Trainer: the device and the plan checked against it, the memory sized and
// allocated, the model, its step and the gradient exchange made, the data loaders started, the
// weights initialised or loaded, and the untimed start-up pass.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "engine/checkpoint.h"
#include "engine/trainer.h"
#include "kernels/attention.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/preload.h"
#include "kernels/reduce.h"

namespace {
// Device memory from NCCL's allocator (what NCCL can register as a window).
void* nccl_alloc(size_t bytes) {
  void* p = nullptr;
  const ncclResult_t r = ncclMemAlloc(&p, bytes);
  if (r != ncclSuccess)
    throw RuntimeError("NCCL could not allocate " + std::to_string(bytes >> 20) + " MiB for the gradient window (" +
                       ncclGetErrorString(r) + "); run with --nccl-window off");
  return p;
}
void nccl_free(void* p) {
  if (p) ncclMemFree(p);
}

// A few host values reduced over the ranks in place, at start-up (through a device buffer).
template <class T>
void all_reduce_host(Comm& comm, T* values, int n, ncclDataType_t type, ncclRedOp_t op) {
  T* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, n * sizeof(T)));
  CUDA_CHECK(cudaMemcpy(d, values, n * sizeof(T), cudaMemcpyHostToDevice));
  comm.all_reduce(d, n, type, op);
  CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
  CUDA_CHECK(cudaMemcpy(values, d, n * sizeof(T), cudaMemcpyDeviceToHost));
  cudaFree(d);
}

constexpr size_t kGemmWorkspace = 32u << 20;  // what cuBLASLt asks for on Hopper

// Everything one step of this model, batch and precision asks for (model, optimizer, FP8
// recipe), declared but not allocated.
void request_step_memory(const ViTConfig& cfg, int batch, Precision precision,
                         const OptimizerSettings& optimizer_settings, MemoryRequest& memory,
                         std::unique_ptr<ViT>& model, std::unique_ptr<Optimizer>& optimizer,
                         std::unique_ptr<Fp8Recipe>& fp8, const Fp8Options& fp8_options) {
  model = std::make_unique<ViT>(cfg, batch, memory, precision);
  optimizer = std::make_unique<Optimizer>(*model, optimizer_settings, memory);
  if (precision == Precision::FP8) fp8 = std::make_unique<Fp8Recipe>(*model, fp8_options, memory);
}

// Bytes a step of this batch needs on the device (nothing allocated).
size_t bytes_for_batch(const ViTConfig& cfg, int batch, Precision precision, const OptimizerSettings& settings) {
  MemoryRequest memory;
  std::unique_ptr<ViT> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<Fp8Recipe> fp8;
  request_step_memory(cfg, batch, precision, settings, memory, model, optimizer, fp8, Fp8Options{});
  return memory.bytes();
}

Fp8Options fp8_options(const TrainOptions& o) {
  Fp8Options f;
  f.current = o.fp8_scaling == Fp8Scaling::Current;
  f.history = o.amax_history;
  f.margin = o.fp8_margin;
  return f;
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

Trainer::Trainer(const RunPlan& plan, WorkerContext ctx) : plan_(plan), opts_(plan.opts), ctx_(ctx) {
  check_device();
  check_data_across_ranks();
  schedule_.kind = opts_.lr_schedule;
  schedule_.base = opts_.lr;
  schedule_.warmup_steps = opts_.warmup_steps;
  schedule_.total_steps = opts_.steps;
  // The second stream, but not under --timing, whose breakdown times each op alone (with two
  // streams the ops overlap, and each slows the other).
  gemm_workspace_ = kGemmWorkspace;
  second_stream_ = opts_.second_stream && !opts_.timing;
  check_memory();
  build_model();
  build_exchange();
  build_loaders();
  step_->init(opts_.seed, stream_);
  if (plan_.initial) {
    upload(*plan_.initial, *step_, stream_);
    if (plan_.initial->resumed) {
      start_step_ = plan_.initial->state.step;
      resumed_from_ = plan_.initial->source;
      if (loss_sum_)
        CUDA_CHECK(cudaMemcpy(loss_sum_, &plan_.initial->state.epoch_loss_sum, sizeof(float), cudaMemcpyHostToDevice));
    }
  }
  if (ctx_.logs() && !opts_.trace_file.empty()) {  // CUPTI was loaded by main (ActivityTrace::prepare)
    trace_ = std::make_unique<ActivityTrace>();
    trace_->name_stream(stream_, ctx_.device, "critical path");
    if (step_->second_stream()) trace_->name_stream(step_->second_stream(), ctx_.device, "second stream");
    if (ctx_.comm) trace_->name_stream(ctx_.comm->stream(), ctx_.device, "communication");
  }
  if (ctx_.logs() && !opts_.log_file.empty()) {  // checked by the plan; opened now
    log_ = std::fopen(opts_.log_file.c_str(), "a");  // appended: a resumed run continues its log
    if (!log_) throw RuntimeError("--log " + opts_.log_file + ": " + std::strerror(errno));
  }
  prepare();
}

void Trainer::check_device() {
  std::string why;
  const int count = cuda_gpu_count(&why);
  if (count == 0) throw RuntimeError("no CUDA GPU was found on this machine (" + why + "); vit_train needs one");
  if (ctx_.device >= count)
    throw UsageError("rank " + std::to_string(ctx_.rank) + " needs device " + std::to_string(ctx_.device) +
                     " but this machine has " + std::to_string(count) + " GPU(s)");
  CUDA_CHECK(cudaSetDevice(ctx_.device));
  CUDA_CHECK(cudaGetDeviceProperties(&props_, ctx_.device));
  if (props_.major != 9 || props_.minor != 0)
    throw RuntimeError(std::string(props_.name) + " has compute capability " + std::to_string(props_.major) + "." +
                       std::to_string(props_.minor) + "; this engine is built for Hopper (sm_90a) and needs it");
  peak_tflops_ = opts_.peak_tflops > 0 ? opts_.peak_tflops : known_peak_tflops(props_);

  const ViTConfig& cfg = opts_.model;
  const std::string why_attention = attention_unsupported_reason(cfg.tokens(), cfg.head_dim());
  if (!why_attention.empty()) throw UsageError("this model's attention shape is not supported: " + why_attention);
  if (opts_.attention == AttentionKernels::SinglePass && !attention_single_pass_supported(cfg.tokens(), cfg.head_dim()))
    throw UsageError("--attention single-pass takes at most 96 tokens and head dim 16, 32, 64 or 80; this model has " +
                     std::to_string(cfg.tokens()) + " tokens and head dim " + std::to_string(cfg.head_dim()) +
                     " (use --attention auto or streamed)");
  if (opts_.attention == AttentionKernels::Resident && !attention_resident_supported(cfg.tokens(), cfg.head_dim()))
    throw UsageError("--attention resident takes at most 1024 tokens and head dim 64, 80 or 128, on an sm_90 GPU; this "
                     "model has " + std::to_string(cfg.tokens()) + " tokens and head dim " +
                     std::to_string(cfg.head_dim()) + " (use --attention auto or streamed)");
}

// Every rank must see the same data: the collectives of evaluation depend on it.
void Trainer::check_data_across_ranks() {
  if (!ctx_.comm) return;
  const int train = plan_.train_count, test = plan_.test_count;
  int counts[4] = {train, test, -train, -test};
  all_reduce_host(*ctx_.comm, counts, 4, ncclInt32, ncclMax);
  if (counts[0] != -counts[2] || counts[1] != -counts[3])
    throw RuntimeError("the ranks see different datasets (training images " + std::to_string(-counts[2]) + ".." +
                       std::to_string(counts[0]) + ", test images " + std::to_string(-counts[3]) + ".." +
                       std::to_string(counts[1]) + "): every process must read the same files");
}

// Everything the run needs, checked against free memory before anything is allocated.
void Trainer::check_memory() {
  const ViTConfig& cfg = opts_.model;
  const Precision precision = opts_.precision;
  const OptimizerSettings optimizer = OptimizerSettings::from(opts_);
  const size_t param_floats = ParamLayout(cfg).total();
  const size_t staging = ctx_.comm ? GradSync::staging_elements(param_floats, opts_.reduce_dtype) : 0;
  const size_t receive = ctx_.peers ? GradSync::receive_floats(param_floats, bucket_floats(), ctx_.world) : 0;
  const size_t need = bytes_for_batch(cfg, opts_.batch, precision, optimizer) + gemm_workspaces() +
                      staging * sizeof(__nv_bfloat16) + receive * sizeof(float);
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t usable = free_b - std::min(free_b, size_t(512) << 20);  // room for the CUDA libraries
  if (need <= usable) return;
  const int unit = precision == Precision::FP8 ? 16 : 1;  // FP8 batches come in multiples of 16 at most
  const size_t per_image =
      (bytes_for_batch(cfg, 2 * unit, precision, optimizer) - bytes_for_batch(cfg, unit, precision, optimizer)) / unit;
  const size_t fixed = bytes_for_batch(cfg, unit, precision, optimizer) - unit * per_image + gemm_workspaces();
  const long fits = usable > fixed ? static_cast<long>((usable - fixed) / per_image) : 0;
  char msg[400];
  std::snprintf(msg, sizeof msg,
                "batch %d does not fit: it needs %.1f GiB of device memory and %s has %.1f GiB free; "
                "the largest batch that fits is about %ld",
                opts_.batch, gib(need), props_.name, gib(free_b), fits);
  throw RuntimeError(msg);
}

void Trainer::build_model() {
  const ViTConfig& cfg = opts_.model;
  request_step_memory(cfg, opts_.batch, opts_.precision, OptimizerSettings::from(opts_), memory_, model_, optimizer_,
                      fp8_, fp8_options(opts_));
  // --nccl-window (experimental): the buffer the gradients are all-reduced in comes from
  // ncclMemAlloc and is registered as a symmetric window, so that NCCL can run its symmetric
  // kernels on it.
  const bool window = ctx_.comm && opts_.nccl_window && opts_.reduce_dtype == ReduceDType::F32;
  device_memory_ = std::make_unique<DeviceMemory>(memory_, window ? nccl_alloc : nullptr, window ? nccl_free : nullptr);
  gemm_ = std::make_unique<Gemm>(gemm_workspace_, opts_.gemm_autotune);
  step_ = std::make_unique<TrainingStep>(*model_, *optimizer_, fp8_.get());
  step_->set_second_stream(second_stream_, gemm_workspace_, opts_.gemm_autotune);
  // ~16 scopes a block, ~31 in fp8, a forward and backward per micro-batch.
  timer_ = std::make_unique<OpTimer>(opts_.timing, 64 + 40 * cfg.depth * opts_.accum_steps);
  model_->set_batches_summed(ctx_.world * opts_.accum_steps);
  model_->set_drop_path(static_cast<float>(opts_.drop_path));
  if (opts_.accum_steps > 1) CUDA_CHECK(cudaMalloc(&step_loss_, sizeof(float)));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(&scalar_, sizeof(float)));
  if (opts_.clip_grad > 0) {  // the gradients' global norm, for clipping
    CUDA_CHECK(cudaMalloc(&grad_norm_, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&norm_partial_, l2_norm_partial_floats() * sizeof(float)));
  }
  model_->set_label_smoothing(static_cast<float>(opts_.label_smoothing));
  setup_attention();
  CUDA_CHECK(cudaMalloc(&checksums_, 2 * ctx_.world * sizeof(unsigned long long)));
  if (opts_.timing && ctx_.world > 1) CUDA_CHECK(cudaMalloc(&rank_timings_, 4 * ctx_.world * sizeof(float)));
}

void Trainer::build_exchange() {
  if (ctx_.comm) {
    const size_t param_floats = model_->layout().total();
    const size_t staging = GradSync::staging_elements(param_floats, opts_.reduce_dtype);
    const bool window = opts_.nccl_window;
    if (staging && window) {
      reduce_staging_ = static_cast<__nv_bfloat16*>(nccl_alloc(staging * sizeof(__nv_bfloat16)));
    } else if (staging) {
      CUDA_CHECK(cudaMalloc(&reduce_staging_, staging * sizeof(__nv_bfloat16)));
    }
    // The optimizer sharded where the copy engines sum the gradients (--shard-optimizer auto): each
    // rank updates only its share of every bucket, which halves the exchange's traffic and splits the
    // optimizer's. Clipping needs the whole gradient's norm on every rank: not sharded then; nor
    // beyond the peers one SGD launch copies its fp32-read weights to (auto: replicated then).
    const bool shard = ctx_.peers && opts_.shard_optimizer != ShardOptimizer::Off && opts_.clip_grad == 0 &&
                       ctx_.world <= kMaxPeerCopies + 1;
    PeerGroup::State state;
    state.grads = model_->grads();
    state.params = model_->params();
    for (const Optimizer::StateBuffer& b : optimizer_->state()) state.optimizer_state.push_back(b.data);
    state.params_bf16 = model_->params_bf16();
    sync_ = std::make_unique<GradSync>(*ctx_.comm, model_->grads(), param_floats, bucket_floats(), opts_.reduce_dtype,
                                       reduce_staging_, stream_, opts_.comm_overlap, window, ctx_.peers,
                                       shard ? &state : nullptr);
    if (!sync_->window_failure().empty() && ctx_.rank == 0)
      std::printf("note: NCCL could not register the gradient buffer as a window (%s); all-reducing without\n",
                  sync_->window_failure().c_str());
    if (opts_.timing) sync_->enable_timing();
    sync_->set_activity(ctx_.activity);
    if (fp8_) fp8_->set_comm(ctx_.comm);
  }
  if (opts_.shard_optimizer == ShardOptimizer::On && !(sync_ && sync_->sharded()))
    throw UsageError("--shard-optimizer on needs the copy-engine exchange: two to " +
                     std::to_string(kMaxPeerCopies + 1) + " GPUs of this process that reach each other's memory");
}

void Trainer::build_loaders() {
  const ViTConfig& cfg = opts_.model;
  if (plan_.fashion) {
    const FashionMnist& f = *plan_.fashion;
    train_loader_ = std::make_unique<DataLoader>(f.train, opts_.batch, FashionMnist::kMean, FashionMnist::kStd, true,
                                                 opts_.seed, ctx_.rank, ctx_.world);
    test_loader_ = std::make_unique<DataLoader>(f.test, opts_.batch, FashionMnist::kMean, FashionMnist::kStd, false,
                                                opts_.seed);
  } else if (plan_.packed_train) {
    train_loader_ = std::make_unique<PackedLoader>(*plan_.packed_train, opts_.batch, cfg.img, true, opts_.seed,
                                                   ctx_.rank, ctx_.world);
    if (plan_.packed_val)
      test_loader_ = std::make_unique<PackedLoader>(*plan_.packed_val, opts_.batch, cfg.img, false, opts_.seed,
                                                    ctx_.rank, ctx_.world);
  }
  if (train_loader_) {
    CUDA_CHECK(cudaMalloc(&loss_sum_, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&correct_, 2 * sizeof(int)));
    CUDA_CHECK(cudaMemset(loss_sum_, 0, sizeof(float)));
  }
}

// The attention kernels: the family --attention names, or auto's choice. --attention cudnn:
// cuDNN's fused attention both ways. auto: timed here against the engine's own choice, direction
// by direction (kernels/attention_choice.h), where cuDNN loads; every rank decides on the times
// summed over the ranks (one without cuDNN counts it infinitely slow), so all run the same
// kernels. Plans, workspace and timing now, not in the first step.
void Trainer::setup_attention() {
  const ViTConfig& cfg = opts_.model;
  const AttentionKernels kind = opts_.attention;
  // --attention streamed and resident name a family: its forward runs too (single-pass has none).
  model_->set_attention_forward(kind == AttentionKernels::Resident   ? AttentionForward::Resident
                                : kind == AttentionKernels::Streamed ? AttentionForward::Streamed
                                                                     : AttentionForward::Auto);
  model_->set_attention_backward(kind == AttentionKernels::SinglePass ? AttentionBackward::SinglePass
                                 : kind == AttentionKernels::Resident ? AttentionBackward::Resident
                                 : kind == AttentionKernels::Streamed ? AttentionBackward::Streamed
                                                                      : AttentionBackward::Auto);
  const int B = opts_.batch, T = cfg.tokens(), H = cfg.heads, hd = cfg.head_dim();
  if (kind == AttentionKernels::Cudnn) {
    cudnn_attention_ = std::make_unique<CudnnAttention>();
    cudnn_attention_->prepare(B, T, H, hd);
    model_->set_cudnn_attention(cudnn_attention_.get(), true, true);
    return;
  }
  if (kind != AttentionKernels::Auto) return;
  cudnn_note_ = cudnn_attention_unavailable_reason();
  AttentionChoice& c = attention_choice_;
  if (cudnn_note_.empty()) try {
      cudnn_attention_ = std::make_unique<CudnnAttention>();
      cudnn_attention_->prepare(B, T, H, hd);
      c = time_attention(*cudnn_attention_, B, T, H, hd);
    } catch (const RuntimeError& e) {  // no plan for the shape, or no memory for the timing's operands
      cudnn_note_ = e.what();
      cudaGetLastError();  // a failed allocation's error, not sticky
    }
  if (!cudnn_note_.empty()) {
    cudnn_attention_.reset();
    c = AttentionChoice{};
    c.cudnn_forward_ms = c.cudnn_backward_ms = INFINITY;
  }
  if (ctx_.comm) {
    float t[4] = {float(c.engine_forward_ms), float(c.cudnn_forward_ms), float(c.engine_backward_ms),
                  float(c.cudnn_backward_ms)};
    all_reduce_host(*ctx_.comm, t, 4, ncclFloat32, ncclSum);
    c.engine_forward_ms = t[0], c.cudnn_forward_ms = t[1], c.engine_backward_ms = t[2], c.cudnn_backward_ms = t[3];
    if (!std::isfinite(t[1]) && cudnn_note_.empty()) cudnn_note_ = "another rank cannot run it";
  }
  c.decide();
  if (c.cudnn_forward || c.cudnn_backward)
    model_->set_cudnn_attention(cudnn_attention_.get(), c.cudnn_forward, c.cudnn_backward);
  else
    cudnn_attention_.reset();
}

// One untimed forward and backward before the first step: each GEMM shape gets its algorithm
// (timed once, synchronising) and every kernel is loaded, so no step pays for either. It changes
// nothing: the first step recomputes the same batch, activations and gradients.
void Trainer::prepare() {
  doing("start-up: the untimed first forward and backward");
  load_batch(0);
  if (!resumed_from_.empty()) {  // the checkpoint's FP8 state stays as it is: nothing primed, nothing recorded
    if (fp8_) fp8_->set_recording(false);
    step_->forward(stream_, *gemm_, *timer_);
    step_->backward(stream_, *gemm_, *timer_);
    if (fp8_) fp8_->set_recording(true);
  } else {
    if (!step_->prime_fp8_scales(stream_, *gemm_, *timer_))  // fp8 delayed: the priming pass is that pass
      forward_backward(0, false);
    if (fp8_) fp8_->reset_counters(stream_);  // the start-up pass is not a training step
  }
  if (opts_.accum_steps > 1) {  // the accumulating backward's GEMM plans too (FP8: nothing recorded)
    if (fp8_) fp8_->set_recording(false);
    step_->forward(stream_, *gemm_, *timer_);
    step_->backward(stream_, *gemm_, *timer_, {}, GradWrite::Accumulate);
    if (fp8_) fp8_->set_recording(true);
  }
  timer_->finish_step(false);
  preload_late_kernels();  // the rest of a run's kernels, before the ranks wait on each other (kernels/preload.h)
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  // That pass read every fp32 weight the kernels read directly: a sharded optimizer keeps them whole.
  if (sync_ && sync_->sharded()) sync_->set_fp32_read_ranges(model_->freeze_fp32_reads());
  if (ctx_.comm) {
    // Every rank done with start-up (allocations, kernel loads) before any copies into another's
    // memory or waits on another's events: a barrier.
    doing("start-up: waiting for the other ranks");
    CUDA_CHECK(cudaMemsetAsync(scalar_, 0, sizeof(float), stream_));
    ctx_.comm->all_reduce(scalar_, 1, ncclFloat32, ncclSum, stream_, stream_);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
}

Trainer::~Trainer() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (log_) std::fclose(log_);
  sync_.reset();
  cudaFree(loss_sum_);
  cudaFree(step_loss_);
  cudaFree(correct_);
  cudaFree(scalar_);
  cudaFree(grad_norm_);
  cudaFree(norm_partial_);
  cudaFree(checksums_);
  cudaFree(rank_timings_);
  if (ctx_.comm && opts_.nccl_window)  // allocated as build_exchange chose
    nccl_free(reduce_staging_);
  else
    cudaFree(reduce_staging_);
  if (stream_) cudaStreamDestroy(stream_);
}
