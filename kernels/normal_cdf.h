// The standard normal CDF Phi(x), with exp(-x^2 / 2) (the density times sqrt(2 pi)) from the same
// exponential: what GELU (x Phi(x)) and its derivative (Phi(x) + x phi(x)) need. Written once for
// host and device, so that the CPU tests check the very formula the kernels run.
//
// Phi(-|x|) = exp(-x^2 / 2) t P(t), t = 1 / (1 + 0.4 |x|), P a degree-9 polynomial fitted on
// t in [0, 1] (tools/fit_normal_cdf.py); Phi(x) = 1 - Phi(-x) for x >= 0. One reciprocal, one
// exp2, ten fmas and multiplies, one select: about half the instructions of erff's two-branch
// polynomial, in GELU kernels that instruction issue bounds. Over every bf16 x below 64 in
// magnitude (host arithmetic; the test's bounds in brackets) the tail's relative error is at most
// 5.2e-7 for |x| < 4 [6e-7] and 3.5e-6 beyond [4e-6] (the exponent's rounding), where the usual
// 0.5 (1 + erf(x / sqrt 2)) loses Phi(x)'s digits to cancellation as x goes negative (all of them
// by x = -6). On the GPU, whose exp2 flushes denormals, Phi is exactly 0 or 1 past |x| ~ 13.2.
#pragma once
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/approx_math.h"

struct NormalCdf {
  float cdf;    // Phi(x)
  float gauss;  // exp(-x^2 / 2)
};

namespace normal_cdf_detail {
// A product never fused into the sum that follows (tail, then 1 - tail): the GELU backward
// recomputes the forward's FP8 codes, which must not depend on how each kernel was contracted.
__host__ __device__ inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
}  // namespace normal_cdf_detail

__host__ __device__ inline NormalCdf normal_cdf(float x) {
  using namespace normal_cdf_detail;
  const float t = reciprocal_approx(fmaf(0.4f, fabsf(x), 1.0f));
  // P(t), highest degree first (tools/fit_normal_cdf.py 0.4 10).
  float p = 2.878087945e-02f;
  p = fmaf(p, t, -1.594553143e-01f);
  p = fmaf(p, t, 3.450418413e-01f);
  p = fmaf(p, t, -3.298165202e-01f);
  p = fmaf(p, t, 8.787584305e-02f);
  p = fmaf(p, t, -1.292390563e-02f);
  p = fmaf(p, t, 8.764062822e-02f);
  p = fmaf(p, t, 1.336923242e-01f);
  p = fmaf(p, t, 1.595873833e-01f);
  p = fmaf(p, t, 1.595768631e-01f);
  // x * x is exact for a bf16 x; exp(-x^2 / 2) = exp2(x^2 * -log2(e) / 2).
  const float gauss = exp2_approx((x * x) * -0.72134752044448170f);
  const float tail = mul_rn(gauss, t * p);  // Phi(-|x|)
  return {x < 0.0f ? tail : 1.0f - tail, gauss};
}
