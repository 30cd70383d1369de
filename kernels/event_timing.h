// The timing of the rate tools and of --attention auto's choice at start-up: a launch on the
// default stream timed with CUDA events, the median of 20 after 5 untimed (clocks ramped up,
// algorithms picked, kernels loaded); before each, untimed, an optional `before` (memory_rate
// flushes L2 there), then a lead: a kernel that keeps the GPU busy while the host records the
// first event and enqueues the launch. Without it the GPU, idle after the last synchronisation,
// records the first event at once and the interval holds the host's launch latency too (the
// attention launcher encodes its tensor maps first); with it the events time the GPU's work
// alone, as in a training step whose launches run ahead of the GPU. tools/attention_bench.py
// leads PyTorch's the same way.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/check.h"
#include "kernels/spin.h"

// Long enough for the slowest enqueue timed here (an attention forward and backward with their
// tensor maps, or cuBLASLt's first lookups: tens of us).
constexpr uint64_t kTimingLeadNs = 300'000;

template <class T>
double median(std::vector<T> v) {
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
  double enqueue_ns = 0;  // the longest the host took to enqueue a timed launch
  for (float& t : ms) {
    before();
    spin(kTimingLeadNs, 0);
    const auto t0 = std::chrono::steady_clock::now();
    CUDA_CHECK(cudaEventRecord(e0));
    launch();
    CUDA_CHECK(cudaEventRecord(e1));
    enqueue_ns = std::max(enqueue_ns, double(std::chrono::nanoseconds(std::chrono::steady_clock::now() - t0).count()));
    CUDA_CHECK(cudaEventSynchronize(e1));
    CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (enqueue_ns > 0.8 * kTimingLeadNs)
    std::fprintf(stderr, "warning: enqueueing a timed launch took up to %.0f us against a lead of %.0f us: the time may include launch latency\n",
                 enqueue_ns / 1e3, kTimingLeadNs / 1e3);
  return median(ms);
}
