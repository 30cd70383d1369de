// The tools' timing: a launch on the default stream timed with CUDA events, the median of 20
// after 5 untimed (clocks ramped up, algorithms picked, kernels loaded); before each, untimed,
// an optional `before` (memory_rate flushes L2 there).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "engine/check.h"

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class Launch, class Before = void (*)()>
double median_event_ms(const Launch& launch, const Before& before = [] {}) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) {
    before();
    launch();
  }
  std::vector<float> ms(20);
  for (float& t : ms) {
    before();
    CUDA_CHECK(cudaEventRecord(e0));
    launch();
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(ms);
}
