#include "engine/trainer.h"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "engine/checkpoint.h"
#include "kernels/nvtx.h"
#include "kernels/attention.h"
#include "kernels/data.h"
#include "kernels/optimizer.h"
#include "kernels/preload.h"
#include "kernels/random.h"
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
constexpr int kMaxSkippedInARow = 10;            // FP8 numerics guard: then the run stops
constexpr uint64_t kDataStream = 1ull << 40;  // random streams of the data, apart from the weights'

double gib(size_t bytes) { return bytes / double(1ull << 30); }

// Bytes a model of this batch needs on the device, by summing its arenas (nothing allocated).
size_t bytes_for_batch(const ViTConfig& cfg, int batch, Precision precision) {
  ModelArenas a;
  ViT probe(cfg, batch, a, precision);
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

Trainer::Trainer(const TrainOptions& opts, WorkerContext ctx) : opts_(opts), ctx_(ctx) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw RuntimeError(std::string("no CUDA GPU is available (") +
                       (e != cudaSuccess ? cudaGetErrorString(e) : "no device found") + ")");
  }
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
  const std::string why = attention_unsupported_reason(cfg.tokens(), cfg.head_dim());
  if (!why.empty()) throw UsageError("this model's attention shape is not supported: " + why);
  if (opts_.attention == "single-pass" && !attention_single_pass_supported(cfg.tokens(), cfg.head_dim()))
    throw UsageError("--attention single-pass takes at most 96 tokens and head dim 16, 32, 64 or 80; this model has " +
                     std::to_string(cfg.tokens()) + " tokens and head dim " + std::to_string(cfg.head_dim()) +
                     " (use --attention auto or streamed)");
  if (opts_.attention == "resident" && !attention_resident_supported(cfg.tokens(), cfg.head_dim()))
    throw UsageError("--attention resident takes at most 1024 tokens and head dim 64, 80 or 128, on an sm_90 GPU; this model "
                     "has " + std::to_string(cfg.tokens()) + " tokens and head dim " + std::to_string(cfg.head_dim()) +
                     " (use --attention auto or streamed)");
  const Precision precision = opts_.precision == "fp8" ? Precision::FP8 : Precision::BF16;
  if (precision == Precision::FP8) {
    const std::string fp8_why = ViT::fp8_unsupported_reason(cfg, opts_.batch);
    if (!fp8_why.empty()) throw UsageError("--precision fp8: " + fp8_why);
  }
  Fp8Options fp8;
  fp8.current = opts_.fp8_recipe == "current";
  fp8.history = opts_.amax_history;
  fp8.margin = opts_.fp8_margin;
  if (opts_.data == "fashion-mnist") {
    fashion_ = std::make_unique<FashionMnist>(opts_.data_dir);
    train_count_ = fashion_->train.count;
    test_count_ = fashion_->test.count;
    data_summary_ = "Fashion-MNIST from " + opts_.data_dir;
  } else if (opts_.data == "packed") {
    packed_train_ = std::make_unique<PackedSet>(opts_.data_dir + "/train");
    if (std::filesystem::is_directory(opts_.data_dir + "/val")) packed_val_ = std::make_unique<PackedSet>(opts_.data_dir + "/val");
    const ViTConfig& m = opts_.model;
    if (packed_train_->classes() != m.classes)
      throw UsageError("--data packed:" + opts_.data_dir + " has " + std::to_string(packed_train_->classes()) +
                       " classes and the model's head " + std::to_string(m.classes) + " (--classes)");
    if (packed_val_ && packed_val_->class_names() != packed_train_->class_names())
      throw UsageError("--data packed:" + opts_.data_dir + ": val's classes.txt differs from train's (the labels would not match)");
    if (packed_val_ && (packed_val_->classes() != m.classes || packed_val_->size() < m.img))
      throw UsageError("--data packed:" + opts_.data_dir + "/val: " + std::to_string(packed_val_->classes()) + " classes of " +
                       std::to_string(packed_val_->size()) + "-pixel images; the model needs " +
                       std::to_string(m.classes) + " classes and at least " + std::to_string(m.img) + " pixels for its centre crop");
    train_count_ = packed_train_->count();
    test_count_ = packed_val_ ? packed_val_->count() : 0;
    data_summary_ = "packed " + opts_.data_dir + " (" + std::to_string(packed_train_->size()) + " px, random resized crops and flips)";
  }
  if (ctx_.comm) {  // every rank must see the same data: the collectives of evaluation depend on it
    int counts[4] = {train_count_, test_count_, -train_count_, -test_count_};
    all_reduce_host(*ctx_.comm, counts, 4, ncclInt32, ncclMax);
    if (counts[0] != -counts[2] || counts[1] != -counts[3])
      throw RuntimeError("the ranks see different datasets (training images " + std::to_string(-counts[2]) + ".." +
                         std::to_string(counts[0]) + ", test images " + std::to_string(-counts[3]) + ".." +
                         std::to_string(counts[1]) + "): every process must read the same files");
  }
  if (train_count_ > 0) {
    if (int64_t(opts_.batch) * ctx_.world > train_count_)
      throw UsageError("the global batch (" + std::to_string(ctx_.world) + " x " + std::to_string(opts_.batch) +
                       ") is larger than the " + std::to_string(train_count_) + " training images");
    if (opts_.epochs > 0) {
      const int64_t steps = int64_t(opts_.epochs) * (train_count_ / (int64_t(opts_.batch) * ctx_.world));
      if (steps > (1 << 30)) throw UsageError("--epochs " + std::to_string(opts_.epochs) + " makes more than 2^30 steps");
      set_total_steps(opts_, static_cast<int>(steps));
    }
  }
  schedule_.kind = opts_.lr_schedule == "cosine" ? LrSchedule::Kind::Cosine : LrSchedule::Kind::Constant;
  schedule_.base = opts_.lr;
  schedule_.warmup_steps = opts_.warmup_steps;
  schedule_.total_steps = opts_.steps;

  // Everything the run needs, checked against free memory before anything is allocated.
  gemm_workspace_ = kGemmWorkspace;
  // The second stream, but not under --timing, whose breakdown times each op alone (with two
  // streams the ops overlap, and each slows the other).
  second_stream_ = opts_.second_stream && !opts_.timing;
  const ReduceDType reduce_dtype = opts_.reduce_dtype == "bf16" ? ReduceDType::BF16 : ReduceDType::F32;
  const size_t param_floats = ParamLayout(cfg).total();
  const size_t staging = ctx_.comm ? GradSync::staging_elements(param_floats, reduce_dtype) : 0;
  const size_t bucket_floats = std::max<size_t>(1, (size_t(opts_.bucket_mb) << 20) / sizeof(float));
  const size_t receive = ctx_.peers ? GradSync::receive_floats(param_floats, bucket_floats, ctx_.world) : 0;
  const size_t need = bytes_for_batch(cfg, opts_.batch, precision) + gemm_workspaces() + staging * sizeof(__nv_bfloat16) +
                      receive * sizeof(float);
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t usable = free_b - std::min(free_b, size_t(512) << 20);  // room for the CUDA libraries
  if (need > usable) {
    const int unit = precision == Precision::FP8 ? 16 : 1;  // FP8 batches come in multiples of 16 at most
    const size_t per_image = (bytes_for_batch(cfg, 2 * unit, precision) - bytes_for_batch(cfg, unit, precision)) / unit;
    const size_t fixed = bytes_for_batch(cfg, unit, precision) - unit * per_image + gemm_workspaces();
    const long fits = usable > fixed ? static_cast<long>((usable - fixed) / per_image) : 0;
    char msg[400];
    std::snprintf(msg, sizeof msg,
                  "batch %d does not fit: it needs %.1f GiB of device memory and %s has %.1f GiB free; "
                  "the largest batch that fits is about %ld",
                  opts_.batch, gib(need), props_.name, gib(free_b), fits);
    throw RuntimeError(msg);
  }

  model_ = std::make_unique<ViT>(cfg, opts_.batch, arenas_, precision, fp8);
  // --nccl-window (experimental): the buffer the gradients are all-reduced in comes from
  // ncclMemAlloc and is registered as a symmetric window, so that NCCL can run its symmetric
  // kernels on it, which slow the overlapped backward less (BENCHMARKS.md, 19).
  const bool window = ctx_.comm && opts_.nccl_window;
  if (window && reduce_dtype == ReduceDType::F32) arenas_.grads.set_allocator(nccl_alloc, nccl_free);
  arenas_.commit();
  gemm_ = std::make_unique<Gemm>(gemm_workspace_, opts_.gemm_autotune);
  model_->set_second_stream(second_stream_, gemm_workspace_, opts_.gemm_autotune);
  timer_ = std::make_unique<OpTimer>(opts_.timing, 64 + 40 * cfg.depth);  // ~16 scopes a block, ~31 in fp8
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(&scalar_, sizeof(float)));
  if (opts_.clip_grad > 0) {  // the gradients' global norm, for clipping
    CUDA_CHECK(cudaMalloc(&grad_norm_, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&norm_partial_, l2_norm_partial_floats() * sizeof(float)));
  }
  model_->set_label_smoothing(static_cast<float>(opts_.label_smoothing));
  // --attention streamed and resident name a family: its forward runs too (single-pass has none).
  model_->set_attention_forward(opts_.attention == "resident"   ? AttentionForward::Resident
                                : opts_.attention == "streamed" ? AttentionForward::Streamed
                                                                : AttentionForward::Auto);
  model_->set_attention_backward(opts_.attention == "single-pass" ? AttentionBackward::SinglePass
                                 : opts_.attention == "resident"  ? AttentionBackward::Resident
                                 : opts_.attention == "streamed"  ? AttentionBackward::Streamed
                                                                  : AttentionBackward::Auto);
  setup_cudnn_attention();
  CUDA_CHECK(cudaMalloc(&checksums_, 2 * ctx_.world * sizeof(unsigned long long)));
  if (opts_.timing && ctx_.world > 1) CUDA_CHECK(cudaMalloc(&rank_timings_, 4 * ctx_.world * sizeof(float)));
  if (ctx_.comm) {
    if (staging && window) {
      reduce_staging_ = static_cast<__nv_bfloat16*>(nccl_alloc(staging * sizeof(__nv_bfloat16)));
    } else if (staging) {
      CUDA_CHECK(cudaMalloc(&reduce_staging_, staging * sizeof(__nv_bfloat16)));
    }
    model_->set_gradient_ranks(ctx_.world);
    // The optimizer sharded where the copy engines sum the gradients (--shard-optimizer auto): each
    // rank updates only its share of every bucket, which halves the exchange's traffic and splits the
    // optimizer's. Clipping needs the whole gradient's norm on every rank: not sharded then; nor
    // beyond the peers one SGD launch copies its fp32-read weights to (auto: replicated then).
    const bool shard = ctx_.peers && opts_.shard_optimizer != "off" && opts_.clip_grad == 0 &&
                       ctx_.world <= kMaxPeerCopies + 1;
    PeerGroup::State state;
    state.grads = model_->grads();
    state.params = model_->params();
    state.momentum = model_->momentum();
    state.params_bf16 = model_->params_bf16();
    sync_ = std::make_unique<GradSync>(*ctx_.comm, model_->grads(), model_->layout().total(), bucket_floats,
                                       reduce_dtype, reduce_staging_, stream_, opts_.comm_overlap, window, ctx_.peers,
                                       shard ? &state : nullptr);
    if (!sync_->window_failure().empty() && ctx_.rank == 0)
      std::printf("note: NCCL could not register the gradient buffer as a window (%s); all-reducing without\n",
                  sync_->window_failure().c_str());
    if (opts_.timing) sync_->enable_timing();
    sync_->set_activity(ctx_.activity);
    Comm* comm = ctx_.comm;
    model_->set_amax_reducer([comm](float* data, int n, cudaStream_t s) { comm->all_reduce(data, n, ncclFloat32, ncclMax, s, s); });
  }
  if (opts_.shard_optimizer == "on" && !(sync_ && sync_->sharded()))
    throw UsageError("--shard-optimizer on needs the copy-engine exchange: two to " + std::to_string(kMaxPeerCopies + 1) +
                     " GPUs of this process that reach each other's memory");

  if (fashion_) {
    train_loader_ = std::make_unique<DataLoader>(fashion_->train, opts_.batch, FashionMnist::kMean, FashionMnist::kStd,
                                                 true, opts_.seed, ctx_.rank, ctx_.world);
    test_loader_ = std::make_unique<DataLoader>(fashion_->test, opts_.batch, FashionMnist::kMean, FashionMnist::kStd,
                                                false, opts_.seed);
  } else if (packed_train_) {
    train_loader_ = std::make_unique<PackedLoader>(*packed_train_, opts_.batch, cfg.img, true, opts_.seed, ctx_.rank,
                                                   ctx_.world);
    if (packed_val_)
      test_loader_ = std::make_unique<PackedLoader>(*packed_val_, opts_.batch, cfg.img, false, opts_.seed, ctx_.rank,
                                                    ctx_.world);
  }
  if (train_loader_) {
    CUDA_CHECK(cudaMalloc(&loss_sum_, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&correct_, 2 * sizeof(int)));
    CUDA_CHECK(cudaMemset(loss_sum_, 0, sizeof(float)));
  }
  model_->init_params(opts_.seed, stream_);
  if (!opts_.init_from.empty()) load_timm_weights(opts_.init_from, *model_, stream_);
  if (!opts_.resume.empty()) {
    resumed_from_ = latest_checkpoint(opts_.resume);
    const CheckpointState st = load_checkpoint(resumed_from_, *model_, opts_, ctx_.world, stream_);
    if (st.step >= opts_.steps)
      throw UsageError("--resume " + resumed_from_ + ": the checkpoint is at step " + std::to_string(st.step) +
                       " and this run ends at step " + std::to_string(opts_.steps) + ": nothing is left to run");
    start_step_ = st.step;
    if (loss_sum_) CUDA_CHECK(cudaMemcpy(loss_sum_, &st.epoch_loss_sum, sizeof(float), cudaMemcpyHostToDevice));
  }
  if (!opts_.save_dir.empty() && ctx_.logs()) check_writable_dir(opts_.save_dir, "--save");  // now, not after the run
  if (!opts_.log_file.empty() && ctx_.logs()) {
    log_ = std::fopen(opts_.log_file.c_str(), "a");  // appended: a resumed run continues its log
    if (!log_) throw RuntimeError("--log " + opts_.log_file + ": " + std::strerror(errno));
  }
  prepare();
}

void Trainer::log_json(const std::string& fields) {
  if (!log_) return;
  std::fprintf(log_, "{%s}\n", fields.c_str());
  std::fflush(log_);
}

void Trainer::save(int steps_done) {
  doing("saving a checkpoint");
  CheckpointState st;
  st.step = steps_done;
  if (sync_) sync_->gather_state();  // a sharded optimizer's stale shares first
  st.epoch_loss_sum = loss_sum_ ? mean_over_ranks(loss_sum_) : 0.0f;  // a collective: every rank
  if (!ctx_.logs()) return;  // the ranks hold the same state; rank 0 writes it
  // Never a checkpoint of a step whose collectives were cut short by an abort.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (ctx_.comm) ctx_.comm->check();
  const std::string path = save_checkpoint(opts_.save_dir, opts_.keep, st, *model_, opts_, ctx_.world, stream_);
  std::printf("  checkpoint: %s (the newest %d kept)\n", path.c_str(), opts_.keep);
  log_json("\"step\": " + std::to_string(steps_done) + ", \"checkpoint\": \"" + path + "\"");
  if (ctx_.progress) ctx_.progress->fetch_add(1);
}

// One untimed forward and backward before the first step: each GEMM shape gets its algorithm
// (timed once, synchronising) and every kernel is loaded, so no step pays for either. It changes
// nothing: the first step recomputes the same batch, activations and gradients.
void Trainer::prepare() {
  doing("start-up: the untimed first forward and backward");
  load_batch(0);
  if (!resumed_from_.empty()) {  // the checkpoint's FP8 state stays as it is: nothing primed, nothing recorded
    model_->set_fp8_recording(false);
    model_->forward(stream_, *gemm_, *timer_);
    model_->backward(stream_, *gemm_, *timer_);
    model_->set_fp8_recording(true);
  } else {
    if (!model_->prime_fp8_scales(stream_, *gemm_, *timer_))  // fp8 delayed: the priming pass is that pass
      forward_backward(false);
    model_->reset_fp8_counters(stream_);  // the start-up pass is not a training step
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

void Trainer::end_step(int step) {
  const bool timed = step >= start_step_ + opts_.warmup;
  timer_->finish_step(timed);
  if (sync_ && opts_.timing && timed) sync_->collect();
}

// --attention cudnn: cuDNN's fused attention both ways. auto: timed here against the engine's own
// choice, direction by direction (kernels/attention_choice.h), where cuDNN loads; every rank
// decides on the times summed over the ranks (one without cuDNN counts it infinitely slow), so
// all run the same kernels. Plans, workspace and timing now, not in the first step.
void Trainer::setup_cudnn_attention() {
  const ViTConfig& cfg = opts_.model;
  const int B = opts_.batch, T = cfg.tokens(), H = cfg.heads, hd = cfg.head_dim();
  if (opts_.attention == "cudnn") {
    cudnn_attention_ = std::make_unique<CudnnAttention>();
    cudnn_attention_->prepare(B, T, H, hd);
    model_->set_cudnn_attention(cudnn_attention_.get(), true, true);
    return;
  }
  if (opts_.attention != "auto") return;
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

Trainer::~Trainer() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (log_) std::fclose(log_);
  sync_.reset();
  cudaFree(loss_sum_);
  cudaFree(correct_);
  cudaFree(scalar_);
  cudaFree(grad_norm_);
  cudaFree(norm_partial_);
  cudaFree(checksums_);
  cudaFree(rank_timings_);
  if (ctx_.comm && opts_.nccl_window)  // allocated as the constructor chose
    nccl_free(reduce_staging_);
  else
    cudaFree(reduce_staging_);
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
  if (model_->precision() == Precision::FP8)
    std::printf("  precision   fp8: qkv/proj/fc1/fc2 GEMMs (forward, input and weight gradients) in FP8, E4M3 weights\n"
                "              and activations, E5M2 output gradients, per-tensor %s scaling (%s, margin %d);\n"
                "              patch embedding, head and attention in bf16; LayerNorm, softmax, loss, residual\n"
                "              stream, master weights, gradients and momentum in fp32\n",
                opts_.fp8_recipe.c_str(),
                opts_.fp8_recipe == "delayed" ? ("amax history " + std::to_string(opts_.amax_history)).c_str()
                                              : "the tensor's own amax",
                opts_.fp8_margin);
  else
    std::printf("  precision   bf16: bf16 GEMMs and attention with fp32 accumulation; fp32 LayerNorm, softmax, loss,\n"
                "              residual stream, master weights, gradients and momentum\n");
  // Which kernels run: the ones asked for, or auto's choice (attention.h).
  const AttentionBackward auto_backward = attention_backward_auto_choice(cfg.tokens(), cfg.head_dim());
  const bool engine_auto = opts_.attention == "auto" || opts_.attention == "engine";
  const char* backward = !engine_auto                                      ? opts_.attention.c_str()
                         : auto_backward == AttentionBackward::SinglePass ? "single-pass"
                         : auto_backward == AttentionBackward::Resident   ? "resident"
                                                                          : "streamed";
  const char* forward = opts_.attention == "resident" || opts_.attention == "streamed" ? opts_.attention.c_str()
                        : attention_forward_auto_choice(cfg.tokens(), cfg.head_dim()) == AttentionForward::Resident
                            ? "resident"
                            : "streamed";
  const AttentionChoice& ac = attention_choice_;
  if (opts_.attention == "cudnn") {
    std::printf("  attention   cuDNN %s's fused attention, forward and backward (backward %sdeterministic; --attention cudnn)\n",
                CudnnAttention::version_string().c_str(),
                cudnn_attention_->backward_deterministic(opts_.batch, cfg.tokens(), cfg.heads, cfg.head_dim()) ? ""
                                                                                                               : "not ");
  } else if (opts_.attention == "auto" && cudnn_note_.empty()) {  // timed against cuDNN's
    std::printf("  attention   auto, timed at start-up against cuDNN %s%s, ms: forward %s %.3f, cuDNN %.3f: %s;\n"
                "              backward %s %.3f, cuDNN %.3f: %s\n",
                CudnnAttention::version_string().c_str(), ctx_.world > 1 ? " (summed over the ranks)" : "", forward,
                ac.engine_forward_ms, ac.cudnn_forward_ms, ac.cudnn_forward ? "cuDNN" : forward, backward,
                ac.engine_backward_ms, ac.cudnn_backward_ms, ac.cudnn_backward ? "cuDNN" : backward);
  } else {
    std::printf("  attention   fused, %s forward, %s backward (--attention %s)\n", forward, backward,
                opts_.attention.c_str());
    if (opts_.attention == "auto") std::printf("              cuDNN not considered: %s\n", cudnn_note_.c_str());
  }
  const bool sharded = sync_ && sync_->sharded();  // the sharded optimizer keeps its own pipeline
  std::printf("  streams     %s%s\n",
              second_stream_ ? "two: the weight gradients beside the input gradients"
              : opts_.second_stream ? "one (--timing times each op alone)"
                                    : "one (--second-stream off)",
              second_stream_ && !sharded ? ", the optimizer beside the next forward" : "");
  if (train_loader_)
    std::printf("  data        %s: %d training images (%d batches an epoch, shuffled), %d test\n",
                data_summary_.c_str(), train_count_, train_loader_->batches_per_epoch(), test_count_);
  else
    std::printf("  data        synthetic: N(0, 1) images, label = sample index %% classes, made on the GPU\n");
  if (ctx_.comm)
    std::printf("  parallel    %d ranks (%s), global batch %d; gradients averaged in %s %s, %d buckets of %d MB\n"
                "              on a communication stream, %s%s\n",
                ctx_.world, ctx_.layout.c_str(), ctx_.world * opts_.batch, opts_.reduce_dtype.c_str(),
                sync_->copy_engines() ? "through the copy engines (peer to peer)" : "over NCCL", sync_->buckets(),
                opts_.bucket_mb, opts_.comm_overlap ? "overlapping the backward" : "after the backward (--comm-overlap off)",
                sync_->windowed() ? ", in a registered NCCL window" : "");
  if (sync_ && sync_->sharded())
    std::printf("  optimizer   sharded (--shard-optimizer %s): each rank sums and updates its share of every bucket\n"
                "              and copies its new bf16 weights to every rank through the copy engines\n",
                opts_.shard_optimizer.c_str());
  std::printf("  training    batch %d%s, %d steps (%d warm-up), SGD %s, momentum %g, weight decay %g%s, seed %llu\n",
              opts_.batch, ctx_.world > 1 ? " per rank" : "", opts_.steps, opts_.warmup, schedule_.describe().c_str(), opts_.momentum, opts_.weight_decay,
              opts_.nesterov ? " nesterov" : "", static_cast<unsigned long long>(opts_.seed));
  std::printf("  model FLOPs %.1f GFLOP per image per training step\n", cfg.train_flops_per_image() / 1e9);
  std::printf("  memory      (allocated once, at start-up)\n");
  size_t total = gemm_workspaces();
  for (const Arena* a : arenas_.all()) {
    std::printf("    %-42s %9.2f GiB\n", a->name().c_str(), gib(a->bytes()));
    total += a->bytes();
  }
  std::printf("    %-42s %9.2f GiB\n", second_stream_ ? "cuBLASLt workspaces (two streams)" : "cuBLASLt workspace",
              gib(gemm_workspaces()));
  if (cudnn_attention_) {
    std::printf("    %-42s %9.2f GiB\n", "cuDNN attention (workspace, plans' buffers)", gib(cudnn_attention_->device_bytes()));
    total += cudnn_attention_->device_bytes();
  }
  std::printf("    %-42s %9.2f GiB\n", "total", gib(total));
  std::fflush(stdout);
}

void Trainer::load_batch(int step) {
  auto t = timer_->op(OpKind::Data, stream_);
  if (train_loader_) {
    const int per_epoch = train_loader_->batches_per_epoch();
    train_loader_->load(step / per_epoch, step % per_epoch, model_->images(), model_->labels(), stream_);
    return;
  }
  NvtxRange range("synthetic batch");
  const ViTConfig& cfg = opts_.model;
  const size_t n = static_cast<size_t>(opts_.batch) * cfg.channels * cfg.img * cfg.img;
  // The seed's synthetic data: N(0, 1) images, label = global sample index % classes. A rank
  // draws its slice of the global batch, so N ranks x B see what one GPU x N B would.
  fill_normal(model_->images(), n, opts_.seed, kDataStream + step, 0.0f, 1.0f, -INFINITY, INFINITY, stream_,
              ctx_.rank * n);
  fill_labels(model_->labels(), opts_.batch, (static_cast<int64_t>(step) * ctx_.world + ctx_.rank) * opts_.batch,
              cfg.classes, stream_);
}

void Trainer::forward_backward(bool sync_gradients) {
  doing("forward and backward");
  model_->begin_fp8_step(stream_);
  model_->forward(stream_, *gemm_, *timer_);
  if (sync_ && sync_gradients) {
    sync_->begin_step();
    model_->backward(stream_, *gemm_, *timer_, [this](size_t offset) { sync_->ready_from(offset); });
    auto t = timer_->op(OpKind::CommWait, stream_);
    doing("end of the backward: waiting for the peers' gradients");
    sync_->finish();
  } else {
    model_->backward(stream_, *gemm_, *timer_);
  }
  doing("end of the step (in fp8: the amax all-reduce)");
  model_->end_fp8_step(stream_);
}

float Trainer::mean_over_ranks(const float* device_value) {
  doing("an all-reduce of the loss, then waiting for the GPU");
  float host = 0;
  if (ctx_.comm) {
    CUDA_CHECK(cudaMemcpyAsync(scalar_, device_value, sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    ctx_.comm->all_reduce(scalar_, 1, ncclFloat32, ncclAvg, stream_, stream_);
    device_value = scalar_;
  }
  CUDA_CHECK(cudaMemcpyAsync(&host, device_value, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return host;
}

template <typename T>
std::vector<T> Trainer::gather_rows(T* rows, int k, ncclDataType_t type) {
  if (ctx_.comm) {
    ctx_.comm->order(stream_, ctx_.comm->stream());
    ctx_.comm->all_gather(rows + size_t(k) * ctx_.rank, rows, k, type);
    ctx_.comm->order(ctx_.comm->stream(), stream_);
  }
  std::vector<T> all(size_t(k) * ctx_.world);
  CUDA_CHECK(cudaMemcpyAsync(all.data(), rows, all.size() * sizeof(T), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return all;
}

std::vector<float> Trainer::rank_timings() {
  doing("gathering the ranks' phase times");
  const float mine[4] = {static_cast<float>(timer_->mean_ms(Phase::Forward)),
                         static_cast<float>(timer_->mean_ms(Phase::Backward)),
                         static_cast<float>(timer_->mean_ms(Phase::Optimizer)),
                         static_cast<float>(timer_->mean_ms(OpKind::CommWait))};
  CUDA_CHECK(cudaMemcpyAsync(rank_timings_ + 4 * ctx_.rank, mine, sizeof mine, cudaMemcpyHostToDevice, stream_));
  return gather_rows(rank_timings_, 4, ncclFloat32);
}

Trainer::WeightChecksums Trainer::weight_checksums() {
  doing("gathering the weights' checksums");
  model_->await_update(stream_);
  if (sync_) sync_->gather_state();  // a sharded optimizer's stale shares first
  const size_t n = model_->layout().total();  // a multiple of 4: the bf16 copy is n / 2 words
  unsigned long long* mine = checksums_ + 2 * ctx_.rank;
  checksum(model_->params(), n, mine, stream_);
  checksum(reinterpret_cast<const float*>(model_->params_bf16()), n / 2, mine + 1, stream_);
  const std::vector<unsigned long long> all = gather_rows(checksums_, 2, ncclUint64);
  WeightChecksums sums;
  for (int r = 0; r < ctx_.world; ++r) {
    sums.master.push_back(all[2 * r]);
    sums.bf16.push_back(all[2 * r + 1]);
  }
  return sums;
}

void Trainer::optimizer_step(int step) {
  doing("optimizer step (sharded: then waiting for the peers' weights)");
  NvtxRange range("optimizer");
  auto phase = timer_->phase(Phase::Optimizer, stream_);
  SgdHyper h{static_cast<float>(schedule_.at(step)), static_cast<float>(opts_.momentum),
             static_cast<float>(opts_.weight_decay), opts_.nesterov};
  h.max_grad_norm = static_cast<float>(opts_.clip_grad);
  if (sync_ && sync_->sharded()) {
    { auto t = timer_->op(OpKind::Optimizer, stream_);
      sync_->optimizer_step(h, step == 0, model_->fp8_step_non_finite()); }
    model_->cast_fp8_weights(stream_, timer_.get());  // the next forward's FP8 weights
    return;
  }
  if (grad_norm_) {
    auto t = timer_->op(OpKind::Optimizer, stream_);
    l2_norm(model_->grads(), model_->layout().total(), norm_partial_, grad_norm_, stream_);
  }
  model_->update(h, step == 0, grad_norm_, stream_, timer_.get());  // and the next forward's FP8 weights
}

Trainer::Accuracy Trainer::evaluate() {
  doing("evaluation");
  NvtxRange range("evaluation");
  OpTimer untimed(false);
  model_->set_fp8_recording(false);
  CUDA_CHECK(cudaMemsetAsync(correct_, 0, 2 * sizeof(int), stream_));
  for (int i = ctx_.rank; i < test_loader_->batches_per_epoch(); i += ctx_.world) {  // this rank's share
    const int real = test_loader_->load(0, i, model_->images(), model_->labels(), stream_);
    if (ctx_.progress) ctx_.progress->fetch_add(1);
    model_->forward(stream_, *gemm_, untimed);
    count_top_k(model_->logits(), model_->logits_ld(), opts_.model.classes, model_->labels(), real, 1, 5, correct_,
                stream_);
  }
  model_->set_fp8_recording(true);
  if (ctx_.comm) ctx_.comm->all_reduce(correct_, 2, ncclInt32, ncclSum, stream_, stream_);
  int correct[2] = {0, 0};
  CUDA_CHECK(cudaMemcpyAsync(correct, correct_, sizeof correct, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return {static_cast<double>(correct[0]) / test_count_, static_cast<double>(correct[1]) / test_count_};
}

// After a step on real data: at an epoch's end (or the run's, inside an epoch), the epoch's
// mean training loss; at an evaluation point (--eval-every, else each epoch's end, and the last
// step), the test top-1.
void Trainer::record_epoch_and_evaluate(int step, std::vector<EpochResult>& epochs) {
  const int per_epoch = train_loader_->batches_per_epoch();
  const bool last = step + 1 == opts_.steps, epoch_end = (step + 1) % per_epoch == 0 || last;
  const int steps_in_epoch = (step + 1) % per_epoch == 0 ? per_epoch : (step + 1) % per_epoch;
  const bool eval_now = test_loader_ && (opts_.eval_every > 0 ? ((step + 1) % opts_.eval_every == 0 || last) : epoch_end);
  double train_loss = NAN;
  Accuracy acc{NAN, NAN};
  if (epoch_end) {
    const float sum = mean_over_ranks(loss_sum_);  // each rank's sum of its batches' mean losses
    CUDA_CHECK(cudaMemsetAsync(loss_sum_, 0, sizeof(float), stream_));
    train_loss = sum / steps_in_epoch;
  }
  if (eval_now) {
    acc = evaluate();
    if (ctx_.logs())
      std::printf("  eval after step %d (epoch %.2f): test top-1 %.2f%%, top-5 %.2f%% of %d images, lr %.4g\n", step + 1,
                  (step + 1) / static_cast<double>(per_epoch), 100 * acc.top1, 100 * acc.top5, test_count_,
                  schedule_.at(step));
    char j[200];
    std::snprintf(j, sizeof j, "\"step\": %d, \"epoch\": %.4f, \"eval_top1\": %.6f, \"eval_top5\": %.6f", step + 1,
                  (step + 1) / static_cast<double>(per_epoch), acc.top1, acc.top5);
    log_json(j);
  }
  if (epoch_end) {
    epochs.push_back({step / per_epoch + 1, steps_in_epoch, train_loss, acc.top1, acc.top5});
    if (ctx_.logs()) std::printf("  epoch %d done (%d steps): mean training loss %.4f\n", epochs.back().epoch, steps_in_epoch,
                train_loss);
  }
  std::fflush(stdout);
}

// A test aid: VIT_TRAIN_TEST_FAIL=RANK:STEP makes that rank fail at that step, so the tests can
// check that the other ranks stop cleanly. Returns the step for this rank, or -1.
static int injected_failure_step(int rank) {
  const char* v = std::getenv("VIT_TRAIN_TEST_FAIL");
  int r = -1, step = -1;
  if (!v || std::sscanf(v, "%d:%d", &r, &step) != 2 || r != rank) return -1;
  return step;
}

void Trainer::train() {
  const bool logs = ctx_.logs();
  if (logs) print_summary();
  const double flops_per_step = opts_.model.train_flops_per_image() * opts_.batch;  // per GPU
  const int global_batch = opts_.batch * ctx_.world;
  const int fail_at = injected_failure_step(ctx_.rank);
  const int window = std::min(opts_.log_every, opts_.steps);  // steps between two log points
  std::vector<cudaEvent_t> begin(window), end(window);
  for (int i = 0; i < window; ++i) {
    CUDA_CHECK(cudaEventCreate(&begin[i]));
    CUDA_CHECK(cudaEventCreate(&end[i]));
  }
  std::vector<double> step_ms;  // every step's time, warm-up included
  std::vector<EpochResult> epochs;
  if (logs)
    std::printf("\n%11s %10s %10s %10s %10s %7s %9s\n", "step", "loss", "ms/step", "images/s",
                ctx_.world > 1 ? "TFLOP/s/GPU" : "TFLOP/s", "MFU", "ETA");

  if (!resumed_from_.empty() && logs)
    std::printf("  resumed from %s: steps %d..%d\n", resumed_from_.c_str(), start_step_ + 1, opts_.steps);
  log_json("\"event\": \"start\", \"step\": " + std::to_string(start_step_) + ", \"steps\": " +
           std::to_string(opts_.steps) + ", \"global_batch\": " + std::to_string(global_batch) + ", \"precision\": \"" +
           opts_.precision + "\"");
  const auto wall_start = std::chrono::steady_clock::now();
  int window_start = start_step_, skipped_reported = 0;
  for (int step = start_step_; step < opts_.steps; ++step) {
    if (step == fail_at) throw RuntimeError("failure injected by VIT_TRAIN_TEST_FAIL at step " + std::to_string(step));
    if (step == opts_.profile_first) CUDA_CHECK(cudaProfilerStart());
    const int slot = step - window_start;
    const bool last = step + 1 == opts_.steps, log_point = slot + 1 == opts_.log_every || last;
    model_->set_fp8_counting(opts_.fp8_stats && log_point, stream_);  // --fp8-stats: the logged step
    {
      NvtxRange range("step");
      CUDA_CHECK(cudaEventRecord(begin[slot], stream_));
      load_batch(step);
      forward_backward();
      optimizer_step(step);
      if (loss_sum_) accumulate(model_->loss(), loss_sum_, stream_);
      CUDA_CHECK(cudaEventRecord(end[slot], stream_));
    }
    end_step(step);
    if (ctx_.progress) ctx_.progress->fetch_add(1);  // the supervisor's heartbeat (the host stalls when a collective hangs)
    if (step == opts_.profile_last) CUDA_CHECK(cudaProfilerStop());

    if (log_point) {  // the only host synchronisation of a plain run
      const float loss = mean_over_ranks(model_->loss());  // the global batch's mean loss
      if (ctx_.comm) ctx_.comm->check();  // an asynchronous NCCL error, or an abort, surfaces here
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
      if (logs) {
        // ETA from this process's wall clock so far (evaluations and checkpoints included).
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
        const int done = step + 1 - start_step_, left = opts_.steps - step - 1;
        const long eta = std::lround(elapsed / done * left);
        char eta_text[32];
        std::snprintf(eta_text, sizeof eta_text, "%ld:%02ld:%02ld", eta / 3600, eta / 60 % 60, eta % 60);
        std::printf("%5d/%-5d %10.4f %10.2f %10.1f %10.1f %7s %9s%s\n", step + 1, opts_.steps, loss, ms,
                    global_batch / (ms * 1e-3), tflops, mfu, eta_text,
                    step < start_step_ + opts_.warmup ? "  (warm-up)" : "");
        char j[256];
        std::snprintf(j, sizeof j, "\"step\": %d, \"loss\": %.6g, \"lr\": %.6g, \"ms_per_step\": %.4f, "
                      "\"images_per_s\": %.2f, \"tflops_per_gpu\": %.2f", step + 1, loss, schedule_.at(step), ms,
                      global_batch / (ms * 1e-3), tflops);
        std::string fields = j;
        if (grad_norm_) {
          float norm = 0;
          CUDA_CHECK(cudaMemcpy(&norm, grad_norm_, sizeof norm, cudaMemcpyDeviceToHost));
          fields += ", \"grad_norm\": " + std::to_string(norm);
        }
        log_json(fields);
        if (opts_.fp8_stats) std::printf("%s", model_->fp8_stats_table(stream_).c_str());
        std::fflush(stdout);
      }
      if (model_->precision() == Precision::FP8) {
        // The numerics guard: steps whose FP8 tensors saw a non-finite amax were skipped on the
        // device (on every rank alike); a whole window of them means training cannot go on.
        int counters[2] = {0, 0};  // skipped steps, in a row
        CUDA_CHECK(cudaMemcpy(counters, model_->fp8_skipped_steps(), sizeof counters, cudaMemcpyDeviceToHost));
        if (counters[0] > skipped_reported && logs) {
          std::printf("  fp8: %d step(s) skipped for non-finite values so far (the offending tensors' scales "
                      "halved for the next step)\n", counters[0]);
          log_json("\"step\": " + std::to_string(step + 1) + ", \"fp8_skipped_total\": " + std::to_string(counters[0]));
        }
        skipped_reported = counters[0];
        if (counters[1] >= kMaxSkippedInARow)
          throw RuntimeError(std::to_string(counters[1]) +
                             " steps in a row saw non-finite values (loss or FP8 tensors) and were skipped; stopping");
      } else if (!std::isfinite(loss)) {
        throw RuntimeError("the loss is not finite (" + std::to_string(loss) + ") at step " +
                           std::to_string(step + 1) + "; stopping");
      }
      window_start = step + 1;
    }
    if (train_loader_) record_epoch_and_evaluate(step, epochs);
    if (!opts_.save_dir.empty() && (last || (opts_.save_every > 0 && (step + 1) % opts_.save_every == 0)))
      save(step + 1);
  }
  if (!epochs.empty() && logs) {
    std::printf("\n%7s %7s %12s %12s %12s\n", "epoch", "steps", "train loss", "test top-1", "test top-5");
    for (const EpochResult& e : epochs) {
      if (std::isnan(e.top1))
        std::printf("%7d %7d %12.4f %12s %12s\n", e.epoch, e.steps, e.train_loss, "-", "-");
      else
        std::printf("%7d %7d %12.4f %11.2f%% %11.2f%%\n", e.epoch, e.steps, e.train_loss, 100 * e.top1, 100 * e.top5);
    }
  }
  for (int i = 0; i < window; ++i) {
    cudaEventDestroy(begin[i]);
    cudaEventDestroy(end[i]);
  }

  // Every rank must hold the same weights, master and bf16 copy: their checksums, gathered.
  const WeightChecksums checksums = weight_checksums();
  for (const auto* sums : {&checksums.master, &checksums.bf16}) {
    if (std::all_of(sums->begin(), sums->end(), [&](unsigned long long c) { return c == (*sums)[0]; })) continue;
    std::string list;
    for (size_t r = 0; r < sums->size(); ++r) {
      char b[48];
      std::snprintf(b, sizeof b, "%s%zu: %016llx", r ? ", " : "", r, (*sums)[r]);
      list += b;
    }
    throw RuntimeError(std::string("the ranks hold different ") + (sums == &checksums.master ? "weights" : "bf16 weight copies") +
                       " after the run (checksums " + list + ")");
  }
  const std::vector<unsigned long long>& sums = checksums.master;
  const std::vector<float> per_rank = rank_timings_ && ctx_.comm ? rank_timings() : std::vector<float>();
  if (!logs) return;

  // A resumed run may have fewer steps left than the warm-up: then its last step is timed.
  const size_t warm = std::min<size_t>(opts_.warmup, step_ms.size() - 1);
  const std::vector<double> timed(step_ms.begin() + warm, step_ms.end());
  const double med = median(timed);
  double mean = 0;
  for (double v : timed) mean += v / timed.size();
  const double tflops = flops_per_step / (med * 1e-3) / 1e12;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double used_gib = gib(total_b - free_b);
  std::printf("%s", timer_->report().c_str());
  if (sync_ && opts_.timing && !timed.empty()) {
    const double busy = sync_->busy_ms() / timed.size(), exposed = timer_->mean_ms(OpKind::CommWait);
    std::printf("  gradient all-reduce: %.3f ms/step on the communication stream, %.3f ms of it exposed (the compute "
                "stream waiting): %.1f%% hidden behind the backward\n",
                busy, exposed, busy > 0 ? 100.0 * std::max(0.0, busy - exposed) / busy : 0.0);
  }
  if (!per_rank.empty()) {  // a rank that waits long at the end of its backward waits for a slower one
    std::printf("  per rank (ms/step)    forward   backward  optimizer   waiting for the peers' gradients\n");
    for (int r = 0; r < ctx_.world; ++r)
      std::printf("  rank %-14d %9.3f %10.3f %10.3f %10.3f\n", r, per_rank[4 * r], per_rank[4 * r + 1], per_rank[4 * r + 2],
                  per_rank[4 * r + 3]);
  }
  std::printf("\nweights: checksum %016llx%s\n", sums[0],
              ctx_.world > 1 ? (", identical on all " + std::to_string(ctx_.world) + " ranks").c_str() : "");
  std::printf("\nsummary over %zu timed steps (after %d warm-up): median %.2f ms/step (mean %.2f), %.1f images/s, "
              "%.1f TFLOP/s%s",
              timed.size(), static_cast<int>(warm), med, mean, global_batch / (med * 1e-3), tflops, ctx_.world > 1 ? " per GPU" : "");
  if (peak_tflops_ > 0) std::printf(", MFU %.1f%%", 100 * tflops / peak_tflops_);
  std::printf("; device memory in use %.2f GiB%s\n", used_gib, ctx_.world > 1 ? " (rank 0's GPU)" : "");
  std::printf("RESULT engine step_ms=%.2f mean_ms=%.2f img_s=%.1f tflops=%.1f mfu=%.3f peak_mem_gib=%.2f ranks=%d\n", med,
              mean, global_batch / (med * 1e-3), tflops, peak_tflops_ > 0 ? tflops / peak_tflops_ : 0.0, used_gib,
              ctx_.world);
  std::fflush(stdout);
}
