// The fused attention's operands at one shape, for the tools (attention_rate, attention_trace) and
// --attention auto's timing at start-up:
// qkv and dout drawn from N(0, 1) as bf16, out, dqkv, lse and delta allocated; freed with the
// object.
#pragma once
#include <cuda_bf16.h>

#include "kernels/check.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "kernels/random.h"

struct AttentionOperands {
  __nv_bfloat16 *qkv = nullptr, *out = nullptr, *dout = nullptr, *dqkv = nullptr;
  float *lse = nullptr, *delta = nullptr;

  // Throws RuntimeError (out of memory, say) with nothing left allocated.
  AttentionOperands(int B, int T, int H, int hd) {
    const size_t rows = size_t(B) * T, D = size_t(H) * hd;
    float* tmp = nullptr;
    try {
      CUDA_CHECK(cudaMalloc(&tmp, rows * 3 * D * sizeof(float)));
      CUDA_CHECK(cudaMalloc(&qkv, rows * 3 * D * 2));
      CUDA_CHECK(cudaMalloc(&dqkv, rows * 3 * D * 2));
      CUDA_CHECK(cudaMalloc(&out, rows * D * 2));
      CUDA_CHECK(cudaMalloc(&dout, rows * D * 2));
      CUDA_CHECK(cudaMalloc(&lse, size_t(B) * H * T * 4));
      CUDA_CHECK(cudaMalloc(&delta, attention_backward_workspace_floats(B, T, H, hd) * 4));
      fill_normal(tmp, rows * 3 * D, 1, 1, 0, 1, -1e30f, 1e30f, 0);
      cast_to_bf16(tmp, qkv, rows * 3 * D, 0);
      cast_to_bf16(tmp, dout, rows * D, 0);
      CUDA_CHECK(cudaDeviceSynchronize());
    } catch (...) {
      cudaFree(tmp);
      release();
      throw;
    }
    CUDA_CHECK(cudaFree(tmp));
  }
  ~AttentionOperands() { release(); }
  AttentionOperands(const AttentionOperands&) = delete;
  AttentionOperands& operator=(const AttentionOperands&) = delete;

 private:
  void release() {
    for (void* p : {static_cast<void*>(qkv), static_cast<void*>(out), static_cast<void*>(dout), static_cast<void*>(dqkv),
                    static_cast<void*>(lse), static_cast<void*>(delta)})
      cudaFree(p);
  }
};
