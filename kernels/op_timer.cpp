#include "kernels/op_timer.h"

#include <cstdio>

#include "kernels/check.h"

namespace {
const char* kOpNames[] = {"GEMM (cuBLASLt)", "FP8 casts", "bias grads", "attention", "LayerNorm", "GELU",
                          "patch/pos embed", "drop path", "loss", "optimizer", "data", "all-reduce wait"};
const char* kPhaseNames[] = {"forward", "backward", "optimizer"};
}  // namespace

OpTimer::OpTimer(bool enabled, int max_scopes_per_step) : enabled_(enabled) {
  if (!enabled_) return;
  events_.resize(2 * static_cast<size_t>(max_scopes_per_step));
  for (cudaEvent_t& e : events_) CUDA_CHECK(cudaEventCreate(&e));
}

OpTimer::~OpTimer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

OpTimer::Scope::Scope(OpTimer* t, int kind, bool phase, cudaStream_t s) : t_(t), slot_(-1), s_(s) {
  if (!t_ || !t_->enabled_) return;
  slot_ = static_cast<int>(t_->records_.size());
  ENSURE(2 * static_cast<size_t>(slot_) + 1 < t_->events_.size(), "OpTimer: too many scopes in one step");
  t_->records_.push_back({kind, phase});
  CUDA_CHECK(cudaEventRecord(t_->events_[2 * slot_], s_));
}

OpTimer::Scope::~Scope() {
  if (slot_ >= 0) cudaEventRecord(t_->events_[2 * slot_ + 1], s_);  // a failure shows at the next sync
}

void OpTimer::finish_step(bool count_it) {
  if (!enabled_) return;
  if (count_it) {
    CUDA_CHECK(cudaEventSynchronize(events_[2 * records_.size() - 1]));
    for (size_t i = 0; i < records_.size(); ++i) {
      float ms = 0;
      CUDA_CHECK(cudaEventSynchronize(events_[2 * i + 1]));
      CUDA_CHECK(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]));
      if (records_[i].phase) {
        phase_ms_[records_[i].kind] += ms;
      } else {
        op_ms_[records_[i].kind] += ms;
        ++op_calls_[records_[i].kind];
      }
    }
    ++steps_;
  } else {
    CUDA_CHECK(cudaDeviceSynchronize());  // events are reused next step
  }
  records_.clear();
}

std::string OpTimer::report() const {
  if (!enabled_ || steps_ == 0) return "";
  std::string out;
  char line[160];
  double op_total = 0, phase_total = 0;
  for (double v : op_ms_) op_total += v;
  for (double v : phase_ms_) phase_total += v;
  std::snprintf(line, sizeof line, "\nper-step breakdown over %d timed steps (CUDA events, --timing)\n", steps_);
  out += line;
  std::snprintf(line, sizeof line, "  %-18s %10s %8s %10s\n", "phase", "ms/step", "share", "");
  out += line;
  for (int i = 0; i < static_cast<int>(Phase::Count); ++i) {
    std::snprintf(line, sizeof line, "  %-18s %10.3f %7.1f%%\n", kPhaseNames[i], phase_ms_[i] / steps_,
                  100.0 * phase_ms_[i] / phase_total);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-18s %10s %8s %10s\n", "op kind", "ms/step", "share", "calls/step");
  out += line;
  for (int i = 0; i < static_cast<int>(OpKind::Count); ++i) {
    if (op_calls_[i] == 0) continue;
    std::snprintf(line, sizeof line, "  %-18s %10.3f %7.1f%% %10ld\n", kOpNames[i], op_ms_[i] / steps_,
                  100.0 * op_ms_[i] / op_total, op_calls_[i] / steps_);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-18s %10.3f (sum of op scopes; the phases include launch gaps)\n", "all ops",
                op_total / steps_);
  out += line;
  return out;
}
