// What a run prints (rank 0): the start-up summary, the progress lines (and their JSON lines
// under --log), the epoch table, and the final summary ending with the RESULT line.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/trainer.h"
#include "kernels/check.h"
#include "kernels/event_timing.h"

void Trainer::log_json(const std::string& fields) {
  if (!log_) return;
  std::fprintf(log_, "{%s}\n", fields.c_str());
  std::fflush(log_);
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
  if (fp8_)
    std::printf("  precision   fp8: qkv/proj/fc1/fc2 GEMMs (forward, input and weight gradients) in FP8, E4M3 weights\n"
                "              and activations, E5M2 output gradients, per-tensor %s scaling (%s, margin %d);\n"
                "              patch embedding, head and attention in bf16; LayerNorm, softmax, loss, residual\n"
                "              stream, master weights, gradients and the optimizer's state in fp32\n",
                choice_name(opts_.fp8_scaling),
                opts_.fp8_scaling == Fp8Scaling::Delayed ? ("amax history " + std::to_string(opts_.amax_history)).c_str()
                                                         : "the tensor's own amax",
                opts_.fp8_margin);
  else
    std::printf("  precision   bf16: bf16 GEMMs and attention with fp32 accumulation; fp32 LayerNorm, softmax, loss,\n"
                "              residual stream, master weights, gradients and the optimizer's state\n");
  // Which kernels run: the ones asked for, or auto's choice (kernels/attention.h).
  const AttentionKernels kind = opts_.attention;
  const AttentionBackward auto_backward = attention_backward_auto_choice(cfg.tokens(), cfg.head_dim());
  const bool engine_auto = kind == AttentionKernels::Auto || kind == AttentionKernels::Engine;
  const char* backward = !engine_auto                                      ? choice_name(kind)
                         : auto_backward == AttentionBackward::SinglePass ? "single-pass"
                         : auto_backward == AttentionBackward::Resident   ? "resident"
                                                                          : "streamed";
  const char* forward = kind == AttentionKernels::Resident || kind == AttentionKernels::Streamed ? choice_name(kind)
                        : attention_forward_auto_choice(cfg.tokens(), cfg.head_dim()) == AttentionForward::Resident
                            ? "resident"
                            : "streamed";
  const AttentionChoice& ac = attention_choice_;
  if (kind == AttentionKernels::Cudnn) {
    std::printf("  attention   cuDNN %s's fused attention, forward and backward (backward %sdeterministic; --attention cudnn)\n",
                CudnnAttention::version_string().c_str(),
                cudnn_attention_->backward_deterministic(opts_.batch, cfg.tokens(), cfg.heads, cfg.head_dim()) ? ""
                                                                                                               : "not ");
  } else if (kind == AttentionKernels::Auto && cudnn_note_.empty()) {  // timed against cuDNN's
    std::printf("  attention   auto, timed at start-up against cuDNN %s%s, ms: forward %s %.3f, cuDNN %.3f: %s;\n"
                "              backward %s %.3f, cuDNN %.3f: %s\n",
                CudnnAttention::version_string().c_str(), ctx_.world > 1 ? " (summed over the ranks)" : "", forward,
                ac.engine_forward_ms, ac.cudnn_forward_ms, ac.cudnn_forward ? "cuDNN" : forward, backward,
                ac.engine_backward_ms, ac.cudnn_backward_ms, ac.cudnn_backward ? "cuDNN" : backward);
  } else {
    std::printf("  attention   fused, %s forward, %s backward (--attention %s)\n", forward, backward, choice_name(kind));
    if (kind == AttentionKernels::Auto) std::printf("              cuDNN not considered: %s\n", cudnn_note_.c_str());
  }
  const bool sharded = sync_ && sync_->sharded();  // the sharded optimizer keeps its own pipeline
  std::printf("  streams     %s%s\n",
              second_stream_        ? "two: the weight gradients beside the input gradients"
              : opts_.second_stream ? "one (--timing times each op alone)"
                                    : "one (--second-stream off)",
              second_stream_ && !sharded ? ", the optimizer beside the next forward" : "");
  if (train_loader_)
    std::printf("  data        %s: %d training images (%d steps an epoch, shuffled), %d test\n",
                plan_.data_summary.c_str(), plan_.train_count, steps_per_epoch(), plan_.test_count);
  else
    std::printf("  data        synthetic: N(0, 1) images, label = sample index %% classes, made on the GPU\n");
  if (ctx_.comm)
    std::printf("  parallel    %d ranks (%s), global batch %d; gradients averaged in %s %s, %d buckets of %d MB\n"
                "              on a communication stream, %s%s\n",
                ctx_.world, ctx_.layout.c_str(), opts_.accum_steps * ctx_.world * opts_.batch, choice_name(opts_.reduce_dtype),
                sync_->copy_engines() ? "through the copy engines (peer to peer)" : "over NCCL", sync_->buckets(),
                opts_.bucket_mb, opts_.comm_overlap ? "overlapping the backward" : "after the backward (--comm-overlap off)",
                sync_->windowed() ? ", in a registered NCCL window" : "");
  if (sharded)
    std::printf("  optimizer   sharded (--shard-optimizer %s): each rank sums and updates its share of every bucket\n"
                "              and copies its new bf16 weights to every rank through the copy engines\n",
                choice_name(opts_.shard_optimizer));
  char optimizer[160];
  if (opts_.optimizer == OptimizerKind::Sgd)
    std::snprintf(optimizer, sizeof optimizer, "SGD %s, momentum %g, weight decay %g%s", schedule_.describe().c_str(),
                  opts_.momentum, opts_.weight_decay, opts_.nesterov ? " nesterov" : "");
  else
    std::snprintf(optimizer, sizeof optimizer, "AdamW %s, betas %g,%g, eps %g, weight decay %g (not on norms, biases, "
                  "pos_embed, cls_token)", schedule_.describe().c_str(), opts_.beta1, opts_.beta2, opts_.eps,
                  opts_.weight_decay);
  if (opts_.eval_only)
    std::printf("  evaluation  of %s, batch %d%s, no training\n",
                resumed_from_.empty() ? opts_.init_from.c_str() : resumed_from_.c_str(), opts_.batch,
                ctx_.world > 1 ? " per rank" : "");
  else
    std::printf("  training    batch %d%s%s, %d steps (%d warm-up), seed %llu\n              %s\n", opts_.batch,
                ctx_.world > 1 ? " per rank" : "",
                opts_.accum_steps > 1 ? (" x " + std::to_string(opts_.accum_steps) +
                                         " micro-batches a step (gradients accumulated)").c_str() : "",
                opts_.steps, opts_.warmup, static_cast<unsigned long long>(opts_.seed), optimizer);
  if (!opts_.eval_only && (opts_.drop_path > 0 || opts_.label_smoothing > 0))
    std::printf("              stochastic depth %g (timm's drop_path_rate, per sample), label smoothing %g\n",
                opts_.drop_path, opts_.label_smoothing);
  std::printf("  model FLOPs %.1f GFLOP per image per training step\n", cfg.train_flops_per_image() / 1e9);
  std::printf("  memory      (allocated once, at start-up)\n");
  size_t total = gemm_workspaces();
  for (int c = 0; c < kMemoryCategories; ++c) {
    const auto category = static_cast<MemoryCategory>(c);
    std::printf("    %-46s %9.2f GiB\n", DeviceMemory::name(category), gib(memory_.bytes(category)));
    total += memory_.bytes(category);
  }
  std::printf("    %-46s %9.2f GiB\n", second_stream_ ? "cuBLASLt workspaces (two streams)" : "cuBLASLt workspace",
              gib(gemm_workspaces()));
  if (cudnn_attention_) {
    std::printf("    %-46s %9.2f GiB\n", "cuDNN attention (workspace, plans' buffers)",
                gib(cudnn_attention_->device_bytes()));
    total += cudnn_attention_->device_bytes();
  }
  std::printf("    %-46s %9.2f GiB\n", "total", gib(total));
  std::fflush(stdout);
}

void Trainer::print_progress_header() const {
  std::printf("\n%11s %10s %10s %10s %10s %7s %9s\n", "step", "loss", "ms/step", "images/s",
              ctx_.world > 1 ? "TFLOP/s/GPU" : "TFLOP/s", "MFU", "ETA");
  if (!resumed_from_.empty())
    std::printf("  resumed from %s: steps %d..%d\n", resumed_from_.c_str(), start_step_ + 1, opts_.steps);
}

void Trainer::print_progress(int step, float loss, double ms, double elapsed_s) {
  const double flops_per_step = opts_.model.train_flops_per_image() * opts_.batch * opts_.accum_steps;  // per GPU
  const int global_batch = opts_.accum_steps * opts_.batch * ctx_.world;
  const double tflops = flops_per_step / (ms * 1e-3) / 1e12;
  char mfu[16] = "-";
  if (peak_tflops_ > 0) std::snprintf(mfu, sizeof mfu, "%.1f%%", 100 * tflops / peak_tflops_);
  // ETA from this process's wall clock so far (evaluations and checkpoints included).
  const int done = step + 1 - start_step_, left = opts_.steps - step - 1;
  const long eta = std::lround(elapsed_s / done * left);
  char eta_text[32];
  std::snprintf(eta_text, sizeof eta_text, "%ld:%02ld:%02ld", eta / 3600, eta / 60 % 60, eta % 60);
  std::printf("%5d/%-5d %10.4f %10.2f %10.1f %10.1f %7s %9s%s\n", step + 1, opts_.steps, loss, ms,
              global_batch / (ms * 1e-3), tflops, mfu, eta_text, step < start_step_ + opts_.warmup ? "  (warm-up)" : "");
  char j[256];
  std::snprintf(j, sizeof j,
                "\"step\": %d, \"loss\": %.6g, \"lr\": %.6g, \"ms_per_step\": %.4f, "
                "\"images_per_s\": %.2f, \"tflops_per_gpu\": %.2f",
                step + 1, loss, schedule_.at(step), ms, global_batch / (ms * 1e-3), tflops);
  std::string fields = j;
  if (grad_norm_) {
    float norm = 0;
    CUDA_CHECK(cudaMemcpy(&norm, grad_norm_, sizeof norm, cudaMemcpyDeviceToHost));
    fields += ", \"grad_norm\": " + std::to_string(norm);
  }
  log_json(fields);
  if (opts_.fp8_stats) std::printf("%s", step_->fp8_stats_table(stream_).c_str());
  std::fflush(stdout);
}

void Trainer::print_epochs(const std::vector<EpochResult>& epochs) const {
  std::printf("\n%7s %7s %12s %12s %12s\n", "epoch", "steps", "train loss", "test top-1", "test top-5");
  for (const EpochResult& e : epochs) {
    if (std::isnan(e.top1))
      std::printf("%7d %7d %12.4f %12s %12s\n", e.epoch, e.steps, e.train_loss, "-", "-");
    else
      std::printf("%7d %7d %12.4f %11.2f%% %11.2f%%\n", e.epoch, e.steps, e.train_loss, 100 * e.top1, 100 * e.top5);
  }
}

void Trainer::print_final(const std::vector<double>& step_ms, const WeightChecksums& checksums,
                          const std::vector<float>& per_rank) {
  const double flops_per_step = opts_.model.train_flops_per_image() * opts_.batch * opts_.accum_steps;  // per GPU
  const int global_batch = opts_.accum_steps * opts_.batch * ctx_.world;
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
      std::printf("  rank %-14d %9.3f %10.3f %10.3f %10.3f\n", r, per_rank[4 * r], per_rank[4 * r + 1],
                  per_rank[4 * r + 2], per_rank[4 * r + 3]);
  }
  std::printf("\nweights: checksum %016llx%s\n", checksums.master[0],
              ctx_.world > 1 ? (", identical on all " + std::to_string(ctx_.world) + " ranks").c_str() : "");
  std::printf("\nsummary over %zu timed steps (after %d warm-up): median %.2f ms/step (mean %.2f), %.1f images/s, "
              "%.1f TFLOP/s%s",
              timed.size(), static_cast<int>(warm), med, mean, global_batch / (med * 1e-3), tflops,
              ctx_.world > 1 ? " per GPU" : "");
  if (peak_tflops_ > 0) std::printf(", MFU %.1f%%", 100 * tflops / peak_tflops_);
  std::printf("; device memory in use %.2f GiB%s\n", used_gib, ctx_.world > 1 ? " (rank 0's GPU)" : "");
  std::printf("RESULT engine step_ms=%.2f mean_ms=%.2f img_s=%.1f tflops=%.1f mfu=%.3f peak_mem_gib=%.2f ranks=%d\n",
              med, mean, global_batch / (med * 1e-3), tflops, peak_tflops_ > 0 ? tflops / peak_tflops_ : 0.0, used_gib,
              ctx_.world);
  std::fflush(stdout);
}
