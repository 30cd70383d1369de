// Test-tier plumbing: GPU tests skip themselves (and are counted as skipped) where no GPU is
// present, so one test binary serves CI (no GPU) and the device machine.
#pragma once

bool gpu_available();
void mark_skipped();

#define SKIP_WITHOUT_GPU()   \
  do {                       \
    if (!gpu_available()) {  \
      mark_skipped();        \
      return;                \
    }                        \
  } while (0)
