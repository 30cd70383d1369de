// Test-tier plumbing: GPU tests skip themselves (and are counted as skipped) where no GPU is
// present, so one test binary serves CI (no GPU) and the device machine.
#pragma once
#include <cstdint>
#include <random>

bool gpu_available();
void mark_skipped();

// A generator with a fresh seed for each run, the seed shown with any failure so that it can be
// reproduced.
#define FRESH_RNG(name)                                 \
  const uint64_t name##_seed = std::random_device{}(); \
  CAPTURE(name##_seed);                                 \
  std::mt19937_64 name(name##_seed)

#define SKIP_WITHOUT_GPU()   \
  do {                       \
    if (!gpu_available()) {  \
      mark_skipped();        \
      return;                \
    }                        \
  } while (0)
