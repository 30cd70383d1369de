// memory_rate: the memory-bound kernels around the GEMMs (LayerNorm, GELU, the FP8 casts) at one
// ViT's FP8 training shapes, each timed alone (CUDA events, median of 20 after 5, the L2 cache
// flushed before each), against the card's copy rate. Per kernel: its time, the bytes it must
// move at least (each input read once, each output written once), the rate that makes, the
// fraction of the copy rate, and its calls and milliseconds a training step (ViT blocks x its
// calls a block), to compare with `vit_train --precision fp8 --timing`. The bf16 step's GELU
// kernels follow, outside the FP8 step's sum.
// Usage: memory_rate [--dim D] [--hidden H] [--tokens M] [--depth L]   (default: ViT-H/16 at batch 64)
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/layernorm.h"
#include "kernels/random.h"
#include "tools/block_shape_args.h"
#include "kernels/event_timing.h"
#include "tools/device_alloc.h"

using bf16 = __nv_bfloat16;

int main(int argc, char** argv) {
  BlockShape shape;
  if (!parse_block_shape(argc, argv, "memory_rate", true, &shape)) return 2;
  const int D = shape.D, H = shape.H, M = shape.M, L = shape.L;
  if (D > 1536) { std::fprintf(stderr, "memory_rate: --dim at most 1536 (the LayerNorm kernels' reach)\n"); return 2; }
  try {
    const size_t MD = size_t(M) * D, MH = size_t(M) * H, widest = std::max(MH, 3 * MD);
    // Inputs: random, in the ranges training sees (|x| of a few units; scale 1 keeps FP8 finite).
    float* x32 = device_alloc<float>(MD);
    float* g32 = device_alloc<float>(MD);
    float* w = device_alloc<float>(D);
    float* b = device_alloc<float>(D);
    float* mean = device_alloc<float>(M);
    float* rstd = device_alloc<float>(M);
    float* scratch32 = device_alloc<float>(widest);
    bf16* in_a = device_alloc<bf16>(widest);
    bf16* in_b = device_alloc<bf16>(widest);
    bf16* out_bf16 = device_alloc<bf16>(MD);
    bf16* out_wide = device_alloc<bf16>(MH);
    bf16* out_wide_b = device_alloc<bf16>(MH);
    uint8_t* out8 = device_alloc<uint8_t>(widest);
    uint8_t* out8t = device_alloc<uint8_t>(widest);
    uint8_t* out8t_b = device_alloc<uint8_t>(widest);
    float* meta = device_alloc<float>(4);  // scale, amax
    unsigned long long* stats = device_alloc<unsigned long long>(3);
    const size_t partial_floats = std::max({layernorm_partial_floats(M, D), fp8_cast_partial_floats(M, 3 * D),
                                            fp8_cast_partial_floats(M, H), gelu_backward_partial_floats(M, H)});
    float* partial = device_alloc<float>(partial_floats);
    float* db = device_alloc<float>(std::max(3 * D, H));
    float* dw = device_alloc<float>(D);
    const size_t flush_bytes = 256u << 20;  // larger than L2: no launch finds its inputs left there
    void* flush = device_alloc<uint8_t>(flush_bytes);
    auto flush_l2 = [&] { CUDA_CHECK(cudaMemsetAsync(flush, 0, flush_bytes)); };

    fill_normal(x32, MD, 7, 1, 0, 1, -1e30f, 1e30f, 0);
    fill_normal(g32, MD, 7, 2, 0, 1, -1e30f, 1e30f, 0);
    fill_normal(w, D, 7, 3, 1, 0.1f, -1e30f, 1e30f, 0);
    fill_normal(b, D, 7, 4, 0, 0.1f, -1e30f, 1e30f, 0);
    fill_normal(scratch32, widest, 7, 5, 0, 1, -1e30f, 1e30f, 0);
    cast_to_bf16(scratch32, in_a, widest, 0);
    fill_normal(scratch32, widest, 7, 6, 0, 1, -1e30f, 1e30f, 0);
    cast_to_bf16(scratch32, in_b, widest, 0);
    fill_constant(meta, 4, 1.0f, 0);
    CUDA_CHECK(cudaMemset(stats, 0, 3 * sizeof(unsigned long long)));
    // The statistics LayerNorm's backward reads: a forward's.
    layernorm_forward(x32, D, w, b, out_bf16, mean, rstd, M, D, 1e-6f, 0);
    CUDA_CHECK(cudaDeviceSynchronize());

    const Fp8Out e4_row{Fp8Kind::E4M3, meta, out8, nullptr, meta + 1, nullptr};
    const Fp8Out e4_t{Fp8Kind::E4M3, meta, nullptr, out8t_b, nullptr, nullptr};
    const Fp8Out e4_both{Fp8Kind::E4M3, meta, out8, out8t_b, meta + 1, nullptr};
    const Fp8Out e5_both{Fp8Kind::E5M2, meta, out8, out8t, meta + 1, nullptr};
    struct Kernel {
      std::string name;
      double bytes;  // the least it must move
      int per_block;  // calls a ViT block in a training step
      bool fp8_step;  // the FP8 step's (else the bf16 step's, outside the sum)
      std::function<void()> launch;
    };
    const std::vector<Kernel> kernels = {
        {"LN forward -> fp8", MD * 5.0, 2, true,
         [&] { layernorm_forward_fp8(x32, D, w, b, e4_row, mean, rstd, M, D, 1e-6f, 0); }},
        {"transpose fp8 (D)", MD * 2.0, 2, true,  // the kept LayerNorm codes, for the weight gradients
         [&] { transpose_fp8(out8, M, D, out8t_b, 0); }},
        {"LN backward (+ residual)", MD * 16.0, 2, true,  // dy, x, g read; g, g bf16 written
         [&] { layernorm_backward(in_a, x32, D, w, mean, rstd, g32, out_bf16, dw, db, partial, M, D, 0); }},
        {"GELU forward -> fp8", MH * 3.0, 1, true, [&] { gelu_forward_fp8(in_a, M, H, e4_row, 0); }},
        {"GELU backward -> fp8 x3", MH * 7.0, 1, true,  // da, h read; dh, dh^T, a^T written
         [&] { gelu_backward_fp8(in_a, in_b, M, H, e5_both, e4_t, db, partial, 0); }},
        {"cast dy (D) -> fp8 x2, db", MD * 4.0, 2, true,  // fc2's and proj's output gradients
         [&] { cast_to_fp8(in_a, M, D, e5_both, 0, db, partial); }},
        {"cast dy (3D) -> fp8 x2, db", MD * 12.0, 1, true,  // qkv's
         [&] { cast_to_fp8(in_a, M, 3 * D, e5_both, 0, db, partial); }},
        {"cast attn -> fp8 x2", MD * 4.0, 1, true, [&] { cast_to_fp8(in_a, M, D, e4_both, 0); }},
        {"bf16: GELU forward", MH * 4.0, 1, false, [&] { gelu_forward(in_a, out_wide, MH, 0); }},
        {"bf16: GELU backward", MH * 8.0, 1, false,  // da, h read; dh, a written
         [&] { gelu_backward(in_a, in_b, out_wide, out_wide_b, db, partial, M, H, 0); }},
    };

    // The card's copy rate: a device-to-device copy as large as the largest tensor here.
    const size_t copy_bytes = widest * sizeof(bf16);
    const double copy_ms = median_event_ms(
        [&] { CUDA_CHECK(cudaMemcpyAsync(in_b, in_a, copy_bytes, cudaMemcpyDeviceToDevice, 0)); }, flush_l2);
    const double copy_rate = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
    std::printf("M %d, D %d, H %d, %d blocks; copy of %.0f MB: %.3f ms, %.0f GB/s (read + write)\n\n", M, D, H, L,
                copy_bytes / 1e6, copy_ms, copy_rate);
    std::printf("%-28s %9s %9s %8s %7s %7s %9s\n", "kernel", "us", "MB", "GB/s", "of copy", "calls", "ms a step");
    double step_ms = 0;
    for (const Kernel& k : kernels) {
      const double ms = median_event_ms(k.launch, flush_l2), rate = k.bytes / (ms * 1e-3) / 1e9;
      const int calls = k.per_block * L;
      if (k.fp8_step) step_ms += ms * calls;
      std::printf("%-28s %9.1f %9.1f %8.0f %7.2f %7d %9.2f\n", k.name.c_str(), ms * 1e3, k.bytes / 1e6, rate,
                  rate / copy_rate, calls, ms * calls);
    }
    std::printf("%-28s %9s %9s %8s %7s %7s %9.2f\n", "all (an fp8 step)", "", "", "", "", "", step_ms);
    CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_rate: error: %s\n", e.what());
    return 1;
  }
}
