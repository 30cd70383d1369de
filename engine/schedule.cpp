#include "engine/schedule.h"

#include <cmath>
#include <cstdio>

double LrSchedule::at(int step) const {
  if (step < warmup_steps) return base * (step + 1) / warmup_steps;
  if (kind == Kind::Constant) return base;
  const int span = total_steps - warmup_steps;
  const double progress = span > 0 ? static_cast<double>(step - warmup_steps) / span : 1.0;
  return base * 0.5 * (1.0 + std::cos(M_PI * std::min(progress, 1.0)));
}

std::string LrSchedule::describe() const {
  char s[160];
  std::snprintf(s, sizeof s, "%s lr %g%s", kind == Kind::Cosine ? "cosine" : "constant", base,
                warmup_steps > 0 ? (", " + std::to_string(warmup_steps) + " warm-up steps").c_str() : "");
  return s;
}
