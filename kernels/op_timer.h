// The built-in breakdown (--timing): CUDA-event times per op kind and per phase. Disabled, every
// scope is a no-op; enabled, each scope records two events and finish_step() synchronises to
// read them (so --timing runs a little slower than a plain run; the breakdown says where time
// goes, the plain run says how fast).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <string>
#include <vector>

// CommWait: the compute stream waiting for the gradient all-reduce (the part not hidden behind
// the backward) and for the FP8 amax reduce.
enum class OpKind { Gemm, Fp8Cast, BiasGrad, Attention, LayerNorm, Gelu, Embed, DropPath, Loss, Optimizer, Data, CommWait, Count };
enum class Phase { Forward, Backward, Optimizer, Count };

class OpTimer {
 public:
  OpTimer(bool enabled, int max_scopes_per_step = 4096);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  class Scope {
   public:
    Scope(OpTimer* t, int kind, bool phase, cudaStream_t s);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
   private:
    OpTimer* t_;
    int slot_;
    cudaStream_t s_;
  };
  Scope op(OpKind k, cudaStream_t s) { return Scope(this, static_cast<int>(k), false, s); }
  Scope phase(Phase p, cudaStream_t s) { return Scope(this, static_cast<int>(p), true, s); }

  bool enabled() const { return enabled_; }
  // Waits for the step's events and adds their times to the totals (timed steps only).
  void finish_step(bool count_it);
  // Table of mean ms per step by op kind and by phase over the counted steps.
  std::string report() const;
  double mean_ms(OpKind k) const { return steps_ ? op_ms_[static_cast<int>(k)] / steps_ : 0.0; }
  double mean_ms(Phase p) const { return steps_ ? phase_ms_[static_cast<int>(p)] / steps_ : 0.0; }

 private:
  friend class Scope;
  struct Record { int kind; bool phase; };
  bool enabled_;
  std::vector<cudaEvent_t> events_;
  std::vector<Record> records_;
  std::array<double, static_cast<int>(OpKind::Count)> op_ms_{};
  std::array<double, static_cast<int>(Phase::Count)> phase_ms_{};
  std::array<long, static_cast<int>(OpKind::Count)> op_calls_{};
  int steps_ = 0;
};
