// optimizer_rate: the optimizer kernels (SGD with momentum, AdamW) over one model's whole flat
// parameter buffer, each timed alone (CUDA events, median of 20 after 5), against the card's copy
// rate at the same size: per kernel its time, the bytes it must move (each buffer read or written
// once), the floor those bytes make at the copy rate, and its time over that floor. The numbers to
// hold against `vit_train --timing`'s optimizer line.
// Usage: optimizer_rate [--model NAME]   (default vit_h16)
#include <cuda_bf16.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/event_timing.h"
#include "kernels/optimizer.h"
#include "kernels/random.h"
#include "model/config.h"
#include "model/params.h"
#include "tools/device_alloc.h"

int main(int argc, char** argv) {
  ViTConfig cfg;
  if (argc == 3 && std::strcmp(argv[1], "--model") == 0) {
    if (!vit_preset(argv[2], &cfg)) {
      std::fprintf(stderr, "optimizer_rate: unknown model '%s'; one of %s\n", argv[2], vit_preset_names());
      return 2;
    }
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: optimizer_rate [--model NAME]\n");
    return 2;
  }
  try {
    const ParamLayout layout(cfg);
    const size_t n = layout.total();
    float* p = device_alloc<float>(n);
    float* m = device_alloc<float>(n);
    float* v = device_alloc<float>(n);
    float* g = device_alloc<float>(n);
    float* copy_dst = device_alloc<float>(n);
    __nv_bfloat16* pb = device_alloc<__nv_bfloat16>(n);
    uint8_t* flags = device_alloc<uint8_t>(n / ParamLayout::kParamAlign);
    AdamWScalars* scalars = device_alloc<AdamWScalars>(1);
    fill_normal(p, n, 7, 1, 0, 0.02f, -1e30f, 1e30f, 0);
    fill_normal(g, n, 7, 2, 0, 1e-3f, -1e30f, 1e30f, 0);
    CUDA_CHECK(cudaMemset(m, 0, n * sizeof(float)));
    CUDA_CHECK(cudaMemset(v, 0, n * sizeof(float)));
    CUDA_CHECK(cudaMemset(flags, 1, n / ParamLayout::kParamAlign));
    const AdamWScalars start{0, 0.0f, 1.0f, 1.0f};
    CUDA_CHECK(cudaMemcpy(scalars, &start, sizeof start, cudaMemcpyHostToDevice));
    const AdamWHyper adamw{0.9, 0.999, 1e-8, 0.05};
    const SgdHyper sgd{1e-3f, 0.9f, 0.0f, false};
    adamw_begin_step(scalars, 1e-3, adamw, nullptr, 0);

    // The copy rate: the fp32 buffer copied device to device (read + write).
    const double copy_ms =
        median_event_ms([&] { CUDA_CHECK(cudaMemcpyAsync(copy_dst, p, n * sizeof(float), cudaMemcpyDeviceToDevice, 0)); });
    const double copy_rate = 2.0 * n * sizeof(float) / (copy_ms * 1e-3);
    std::printf("%s: %zu parameters (%zu with padding); copy of %.2f GB: %.3f ms, %.0f GB/s (read + write)\n\n",
                cfg.name.c_str(), layout.count(), n, n * 4 / 1e9, copy_ms, copy_rate / 1e9);
    struct Kernel {
      const char *id, *name;
      double bytes_per_element;  // read and written at least
      std::function<void()> launch;
    };
    const std::vector<Kernel> kernels = {
        {"sgd", "SGD (p, m, g read; p, m, bf16 written)", 22,
         [&] { sgd_momentum_step(p, m, g, pb, n, sgd, false, 0); }},
        {"adamw", "AdamW (p, m, v, g read; p, m, v, bf16 written)", 30,
         [&] { adamw_step(p, m, v, g, pb, n, DecayFlags{flags, 7, 0}, adamw, scalars, 0); }},
    };
    std::printf("%-48s %9s %9s %9s %9s\n", "kernel", "ms", "GB", "floor ms", "x floor");
    for (const Kernel& k : kernels) {
      const double ms = median_event_ms(k.launch), bytes = k.bytes_per_element * n;
      const double floor_ms = bytes / copy_rate * 1e3;
      std::printf("%-48s %9.3f %9.2f %9.3f %9.3f\n", k.name, ms, bytes / 1e9, floor_ms, ms / floor_ms);
      std::printf("RESULT optimizer_rate kernel=%s ms=%.3f floor_ms=%.3f ratio=%.3f\n", k.id, ms, floor_ms,
                  ms / floor_ms);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optimizer_rate: error: %s\n", e.what());
    return 1;
  }
}
