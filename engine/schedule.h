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

  // Constant: base after the warm-up. Cosine: from base at the end of the warm-up towards 0,
  // which it would reach at step total_steps, one past the last (PyTorch's CosineAnnealingLR
  // with T_max = total_steps - warmup_steps and eta_min 0, after a linear warm-up).
  double at(int step) const;
  std::string describe() const;
};
