// The GPU's one-instruction approximations (about 1 ulp, denormal results flushed to zero), for
// host and device: on the host they compute exactly, so that the CPU tests can check a formula
// built on them (kernels/normal_cdf.h).
#pragma once
#include <cuda_runtime.h>

#include <cmath>

// 1 / v.
__host__ __device__ inline float reciprocal_approx(float v) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
#else
  return 1.0f / v;
#endif
}

// 2^v; -inf gives +0 (the attention kernels' masking relies on it).
__host__ __device__ inline float exp2_approx(float v) {
#ifdef __CUDA_ARCH__
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
#else
  return std::exp2(v);
#endif
}
