// Learning-rate schedules: the rate of each step, computed on the host and passed to the
// optimizer kernel (nothing to synchronise).
#pragma once
#include <string>

struct LrSchedule {
  enum class Kind { Constant, Cosine };
  Kind kind = Kind::Constant;
  double base = 0.001;
  int warmup_steps = 0;  // linear from base/warmup_steps up to base
  int total_steps = 1;

  // Constant: base after the warm-up. Cosine: from base down to 0 at total_steps, over the
  // steps after the warm-up (PyTorch's CosineAnnealingLR with eta_min 0, after a linear warm-up).
  double at(int step) const;
  std::string describe() const;
};
