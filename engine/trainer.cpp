// The training loop: each step's batch, forward and backward, gradient exchange and update; the
// progress lines, the numerics guard, evaluations and checkpoints at their points; at the end,
// the ranks' weights checked identical and the summary.
#include "engine/trainer.h"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/safetensors.h"
#include "kernels/check.h"
#include "kernels/data.h"
#include "kernels/nvtx.h"
#include "kernels/random.h"
#include "kernels/reduce.h"

namespace {
// Random streams apart from the weights': the data's and the drop-path masks', one a step each.
constexpr uint64_t kDataStream = 1ull << 40, kDropPathStream = 2ull << 40;

// A test aid: VIT_TRAIN_TEST_FAIL=RANK:STEP makes that rank fail at that step, so the tests can
// check that the other ranks stop cleanly. Returns the step for this rank, or -1.
int injected_failure_step(int rank) {
  const char* v = std::getenv("VIT_TRAIN_TEST_FAIL");
  int r = -1, step = -1;
  if (!v || std::sscanf(v, "%d:%d", &r, &step) != 2 || r != rank) return -1;
  return step;
}
}  // namespace

void Trainer::train() {
  const bool logs = ctx_.logs();
  if (logs) print_summary();
  const int fail_at = injected_failure_step(ctx_.rank);
  const int window = std::min(opts_.log_every, opts_.steps);  // steps between two log points
  std::vector<cudaEvent_t> begin(window), end(window);
  for (int i = 0; i < window; ++i) {
    CUDA_CHECK(cudaEventCreate(&begin[i]));
    CUDA_CHECK(cudaEventCreate(&end[i]));
  }
  std::vector<double> step_ms;  // every step's time, warm-up included
  std::vector<EpochResult> epochs;
  if (logs) print_progress_header();
  log_json("\"event\": \"start\", \"step\": " + std::to_string(start_step_) + ", \"steps\": " +
           std::to_string(opts_.steps) + ", \"global_batch\": " +
           std::to_string(opts_.accum_steps * opts_.batch * ctx_.world) + ", \"accum_steps\": " +
           std::to_string(opts_.accum_steps) + ", \"drop_path\": " + std::to_string(opts_.drop_path) +
           ", \"precision\": \"" + choice_name(opts_.precision) + "\"");
  const auto wall_start = std::chrono::steady_clock::now();
  int window_start = start_step_, skipped_reported = 0;
  const int trace_from = std::max(opts_.trace_first, start_step_);  // a resumed run traces what is left
  for (int step = start_step_; step < opts_.steps; ++step) {
    if (step == fail_at) throw RuntimeError("failure injected by VIT_TRAIN_TEST_FAIL at step " + std::to_string(step));
    if (step == opts_.profile_first) CUDA_CHECK(cudaProfilerStart());
    if (trace_ && step == trace_from && step <= opts_.trace_last) trace_->start();
    const int slot = step - window_start;
    const bool last = step + 1 == opts_.steps, log_point = slot + 1 == opts_.log_every || last;
    step_->set_fp8_counting(opts_.fp8_stats && log_point, stream_);  // --fp8-stats: the logged step
    {
      NvtxRange range("step");
      CUDA_CHECK(cudaEventRecord(begin[slot], stream_));
      for (int micro = 0; micro < opts_.accum_steps; ++micro) {
        load_batch(step, micro);
        forward_backward(micro);
        if (loss_sum_) accumulate(model_->loss(), loss_sum_, stream_);
      }
      optimizer_step(step);
      CUDA_CHECK(cudaEventRecord(end[slot], stream_));
    }
    end_step(step);
    if (ctx_.progress) ctx_.progress->fetch_add(1);  // the supervisor's heartbeat (the host stalls when a collective hangs)
    if (step == opts_.profile_last) CUDA_CHECK(cudaProfilerStop());
    if (trace_ && step == opts_.trace_last && step >= trace_from) finish_trace(trace_from);

    if (log_point) {  // the only host synchronisation of a plain run
      const float loss = step_loss_over_ranks();  // the global batch's mean loss
      if (ctx_.comm) ctx_.comm->check();  // an asynchronous NCCL error, or an abort, surfaces here
      double window_ms = 0;
      for (int i = 0; i <= slot; ++i) {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, begin[i], end[i]));
        step_ms.push_back(ms);
        window_ms += ms;
      }
      if (logs) {
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
        print_progress(step, loss, window_ms / (slot + 1), elapsed);
      }
      if (fp8_) {
        // The numerics guard: steps whose FP8 tensors saw a non-finite amax were skipped on the
        // device (on every rank alike); a whole window of them in a row stops the run.
        const Fp8Recipe::Skipped skipped = fp8_->skipped_steps();
        if (skipped.total > skipped_reported && logs) {
          std::printf("  fp8: %d step(s) skipped for non-finite values so far (the offending tensors' scales "
                      "halved for the next step)\n", skipped.total);
          log_json("\"step\": " + std::to_string(step + 1) + ", \"fp8_skipped_total\": " +
                   std::to_string(skipped.total));
        }
        skipped_reported = skipped.total;
        Fp8Recipe::check_guard(skipped);
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
  if (trace_ && logs)
    std::printf("  trace: steps %d..%d come before this resumed run's first step %d: nothing traced\n",
                opts_.trace_first + 1, opts_.trace_last + 1, start_step_ + 1);
  if (!epochs.empty() && logs) print_epochs(epochs);
  for (int i = 0; i < window; ++i) {
    cudaEventDestroy(begin[i]);
    cudaEventDestroy(end[i]);
  }
  const WeightChecksums sums = weight_checksums();
  check_ranks_agree_on(sums);
  const std::vector<float> per_rank = rank_timings_ && ctx_.comm ? rank_timings() : std::vector<float>();
  if (logs) print_final(step_ms, sums, per_rank);
}

// Every rank must hold the same weights, master and bf16 copy.
void Trainer::check_ranks_agree_on(const WeightChecksums& checksums) {
  for (const auto* sums : {&checksums.master, &checksums.bf16}) {
    if (std::all_of(sums->begin(), sums->end(), [&](unsigned long long c) { return c == (*sums)[0]; })) continue;
    std::string list;
    for (size_t r = 0; r < sums->size(); ++r) {
      char b[48];
      std::snprintf(b, sizeof b, "%s%zu: %016llx", r ? ", " : "", r, (*sums)[r]);
      list += b;
    }
    throw RuntimeError(std::string("the ranks hold different ") +
                       (sums == &checksums.master ? "weights" : "bf16 weight copies") + " after the run (checksums " +
                       list + ")");
  }
}

void Trainer::load_batch(int step, int micro) {
  auto t = timer_->op(OpKind::Data, stream_);
  const int K = opts_.accum_steps;
  // This rank's slice of the step's global batch, micro-batch by micro-batch.
  const int64_t slice = int64_t(micro) * ctx_.world + ctx_.rank;
  model_->draw_drop_path(opts_.seed, kDropPathStream + step, slice * opts_.batch, stream_);
  if (train_loader_) {
    const int per_epoch = steps_per_epoch();
    train_loader_->load(step / per_epoch, step % per_epoch * K + micro, model_->images(), model_->labels(), stream_);
    return;
  }
  NvtxRange range("synthetic batch");
  const ViTConfig& cfg = opts_.model;
  const size_t n = static_cast<size_t>(opts_.batch) * cfg.channels * cfg.img * cfg.img;
  // The seed's synthetic data: N(0, 1) images, label = global sample index % classes. A rank
  // draws its slice of the global batch, so that N ranks x K micro-batches x B see what one
  // GPU x one batch of N K B would.
  fill_normal(model_->images(), n, opts_.seed, kDataStream + step, 0.0f, 1.0f, -INFINITY, INFINITY, stream_,
              slice * n);
  fill_labels(model_->labels(), opts_.batch, (static_cast<int64_t>(step) * K * ctx_.world + slice) * opts_.batch,
              cfg.classes, stream_);
}

void Trainer::forward_backward(int micro, bool sync_gradients) {
  doing("forward and backward");
  const bool first = micro == 0, last = micro + 1 == opts_.accum_steps;
  if (first) step_->begin(stream_);
  step_->forward(stream_, *gemm_, *timer_);
  const GradWrite write = first ? GradWrite::Overwrite : GradWrite::Accumulate;
  if (sync_ && sync_gradients && last) {  // one exchange a step, beside the last micro-batch's backward
    sync_->begin_step();
    step_->backward(stream_, *gemm_, *timer_, [this](size_t offset) { sync_->ready_from(offset); }, write);
    auto t = timer_->op(OpKind::CommWait, stream_);
    doing("end of the backward: waiting for the peers' gradients");
    sync_->finish();
  } else {
    step_->backward(stream_, *gemm_, *timer_, {}, write);
  }
  doing("end of the step (in fp8: the amax all-reduce)");
  step_->end(stream_, last);
  if (step_loss_) {
    if (first) CUDA_CHECK(cudaMemsetAsync(step_loss_, 0, sizeof(float), stream_));
    accumulate(model_->loss(), step_loss_, stream_);
  }
}

void Trainer::optimizer_step(int step) {
  doing("optimizer step (sharded: then waiting for the peers' weights)");
  NvtxRange range("optimizer");
  auto phase = timer_->phase(Phase::Optimizer, stream_);
  const OptimizerStep update{schedule_.at(step), step == 0};
  if (sync_ && sync_->sharded()) {
    step_->update_sharded(*sync_, update, stream_, timer_.get());
    return;
  }
  if (grad_norm_) {
    auto t = timer_->op(OpKind::Optimizer, stream_);
    l2_norm(model_->grads(), model_->layout().total(), norm_partial_, grad_norm_, stream_);
  }
  step_->update(update, grad_norm_, stream_, timer_.get());  // and the next forward's FP8 weights
}

void Trainer::end_step(int step) {
  const bool timed = step >= start_step_ + opts_.warmup;
  timer_->finish_step(timed);
  if (sync_ && opts_.timing && timed) sync_->collect();
}

void Trainer::evaluate_only() {
  if (ctx_.logs()) print_summary();
  const auto t0 = std::chrono::steady_clock::now();
  const Accuracy acc = evaluate();  // (synchronises)
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double images_s = plan_.test_count / seconds;
  if (!ctx_.logs()) return;
  std::printf("\n  eval: test top-1 %.2f%%, top-5 %.2f%% of %d images, %.0f images/s (%s, one pass, %.2f s)\n",
              100 * acc.top1, 100 * acc.top5, plan_.test_count, images_s, choice_name(opts_.precision), seconds);
  char j[200];
  std::snprintf(j, sizeof j, "\"event\": \"eval_only\", \"eval_top1\": %.6f, \"eval_top5\": %.6f, \"images_s\": %.1f",
                acc.top1, acc.top5, images_s);
  log_json(j);
  std::printf("RESULT eval top1=%.6f top5=%.6f img_s=%.1f precision=%s ranks=%d\n", acc.top1, acc.top5, images_s,
              choice_name(opts_.precision), ctx_.world);
  std::fflush(stdout);
}

Trainer::Accuracy Trainer::evaluate() {
  doing("evaluation");
  NvtxRange range("evaluation");
  OpTimer untimed(false);
  if (fp8_) fp8_->set_recording(false);
  model_->clear_drop_path();  // evaluation drops nothing; the next training batch draws again
  CUDA_CHECK(cudaMemsetAsync(correct_, 0, 2 * sizeof(int), stream_));
  for (int i = ctx_.rank; i < test_loader_->batches_per_epoch(); i += ctx_.world) {  // this rank's share
    const int real = test_loader_->load(0, i, model_->images(), model_->labels(), stream_);
    if (ctx_.progress) ctx_.progress->fetch_add(1);
    step_->forward(stream_, *gemm_, untimed);
    count_top_k(model_->logits(), model_->logits_ld(), opts_.model.classes, model_->labels(), real, 1, 5, correct_,
                stream_);
  }
  if (fp8_) fp8_->set_recording(true);
  if (ctx_.comm) ctx_.comm->all_reduce(correct_, 2, ncclInt32, ncclSum, stream_, stream_);
  int correct[2] = {0, 0};
  CUDA_CHECK(cudaMemcpyAsync(correct, correct_, sizeof correct, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  const int test_count = plan_.test_count;
  return {static_cast<double>(correct[0]) / test_count, static_cast<double>(correct[1]) / test_count};
}

// After a step on real data: at an epoch's end (or the run's, inside an epoch), the epoch's
// mean training loss; at an evaluation point (--eval-every, else each epoch's end, and the last
// step), the test top-1.
void Trainer::record_epoch_and_evaluate(int step, std::vector<EpochResult>& epochs) {
  const int per_epoch = steps_per_epoch();
  const bool last = step + 1 == opts_.steps, epoch_end = (step + 1) % per_epoch == 0 || last;
  const int steps_in_epoch = (step + 1) % per_epoch == 0 ? per_epoch : (step + 1) % per_epoch;
  const bool eval_now =
      test_loader_ && (opts_.eval_every > 0 ? ((step + 1) % opts_.eval_every == 0 || last) : epoch_end);
  double train_loss = NAN;
  Accuracy acc{NAN, NAN};
  if (epoch_end) {
    const float sum = mean_over_ranks(loss_sum_);  // each rank's sum of its micro-batches' mean losses
    CUDA_CHECK(cudaMemsetAsync(loss_sum_, 0, sizeof(float), stream_));
    train_loss = sum / (double(steps_in_epoch) * opts_.accum_steps);
  }
  if (eval_now) {
    acc = evaluate();
    if (ctx_.logs())
      std::printf("  eval after step %d (epoch %.2f): test top-1 %.2f%%, top-5 %.2f%% of %d images, lr %.4g\n",
                  step + 1, (step + 1) / static_cast<double>(per_epoch), 100 * acc.top1, 100 * acc.top5,
                  plan_.test_count, schedule_.at(step));
    char j[200];
    std::snprintf(j, sizeof j, "\"step\": %d, \"epoch\": %.4f, \"eval_top1\": %.6f, \"eval_top5\": %.6f", step + 1,
                  (step + 1) / static_cast<double>(per_epoch), acc.top1, acc.top5);
    log_json(j);
  }
  if (epoch_end) {
    epochs.push_back({step / per_epoch + 1, steps_in_epoch, train_loss, acc.top1, acc.top5});
    if (ctx_.logs())
      std::printf("  epoch %d done (%d steps): mean training loss %.4f\n", epochs.back().epoch, steps_in_epoch,
                  train_loss);
  }
  std::fflush(stdout);
}

void Trainer::finish_trace(int first_step) {
  doing("writing the trace");
  trace_->stop();  // (waits for the devices)
  size_t kernels = 0;
  for (const TraceEvent& e : trace_->events()) kernels += e.kind == TraceEvent::Kind::Kernel;
  write_text_file(opts_.trace_file, trace_->chrome_json());
  std::printf("  trace: steps %d..%d, %zu kernels and %zu other events, written to %s (ui.perfetto.dev opens it; "
              "tools/trace_timeline.py draws it)\n", first_step + 1, opts_.trace_last + 1, kernels,
              trace_->events().size() - kernels, opts_.trace_file.c_str());
  if (trace_->dropped() > 0)
    std::printf("  trace: CUPTI dropped %llu records (its buffers were full): the trace misses them\n",
                static_cast<unsigned long long>(trace_->dropped()));
  log_json("\"trace\": \"" + opts_.trace_file + "\"");
  trace_.reset();
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
  const std::string path = save_checkpoint(opts_.save_dir, opts_.keep, st, *step_, opts_, ctx_.world, stream_);
  std::printf("  checkpoint: %s (the newest %d kept)\n", path.c_str(), opts_.keep);
  log_json("\"step\": " + std::to_string(steps_done) + ", \"checkpoint\": \"" + path + "\"");
  if (ctx_.progress) ctx_.progress->fetch_add(1);
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
  step_->await_update(stream_);
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
