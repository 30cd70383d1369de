// launch_gap: what a kernel boundary costs on this GPU, launched on a stream and inside a CUDA
// graph. N dependent kernels that each keep every SM busy for D us are timed with events behind a
// lead (the host enqueues all N while the GPU waits on it); the gap is (total - N D) / N. With
// hundreds of launches on a ViT-H step's critical path, the difference between the two is what
// capturing the step in a graph could save.
// Usage: launch_gap
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <exception>

#include "kernels/check.h"
#include "kernels/spin.h"

namespace {
// Every thread of the block waits ns on the global timer (busy, no sleep: the SM stays occupied).
__global__ void busy(unsigned long long ns, int* sink) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  while (t - t0 < ns);
  if (t == 0) *sink = 1;  // never: keeps the loop
}
}  // namespace

int main() {
  try {
    constexpr int kLaunches = 1000;
    int* sink;
    CUDA_CHECK(cudaMalloc(&sink, sizeof(int)));
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("%d dependent launches a row, each kernel busy on every SM for the time given; median of 3\n", kLaunches);
    std::printf("%10s %8s %12s %10s %12s %10s\n", "kernel us", "blocks", "stream ms", "gap us", "graph ms", "gap us");
    for (const unsigned long long ns : {5000ull, 20000ull, 50000ull}) {
      for (const int blocks : {sms, 4 * sms}) {
        const auto issue = [&] {
          for (int i = 0; i < kLaunches; ++i) busy<<<blocks, 128, 0, s>>>(ns, sink);
          LAUNCH_CHECK();
        };
        // times[0]: plain launches; times[1]: the same captured in a graph. Each behind a lead
        // long enough for the host to enqueue them all.
        float times[2][3];
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        issue();
        CUDA_CHECK(cudaStreamEndCapture(s, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_CHECK(cudaGraphLaunch(exec, s));  // uploaded and warm
        for (int rep = 0; rep < 3; ++rep)
          for (int way = 0; way < 2; ++way) {
            spin(20'000'000, s);
            CUDA_CHECK(cudaEventRecord(a, s));
            if (way == 0) issue();
            else CUDA_CHECK(cudaGraphLaunch(exec, s));
            CUDA_CHECK(cudaEventRecord(b, s));
            CUDA_CHECK(cudaEventSynchronize(b));
            CUDA_CHECK(cudaEventElapsedTime(&times[way][rep], a, b));
          }
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
        float med[2];
        for (int way = 0; way < 2; ++way) {
          float* t = times[way];
          med[way] = std::max(std::min(t[0], t[1]), std::min(std::max(t[0], t[1]), t[2]));
        }
        const double work_us = kLaunches * ns / 1e3;
        std::printf("%10.1f %8d %12.3f %10.2f %12.3f %10.2f\n", ns / 1e3, blocks, med[0], (med[0] * 1e3 - work_us) / kLaunches,
                    med[1], (med[1] * 1e3 - work_us) / kLaunches);
        std::printf("RESULT launch_gap kernel_us=%.1f blocks=%d stream_gap_us=%.3f graph_gap_us=%.3f\n", ns / 1e3, blocks,
                    (med[0] * 1e3 - work_us) / kLaunches, (med[1] * 1e3 - work_us) / kLaunches);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch_gap: %s\n", e.what());
    return 1;
  }
}
