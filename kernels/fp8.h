// FP8 casts: bf16 tensors to E4M3/E5M2 with a per-tensor scale, the transposed copy Hopper's
// FP8 GEMMs need when the contraction runs along rows, and the tensor's amax for the scaling
// recipes, all in one pass.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

enum class Fp8Kind { E4M3, E5M2 };

// out[r, c] = fp8(*scale * in[r, c]) (nearest-even, saturating to the largest finite value);
// out_t (may be null) [cols, rows] = the same codes transposed; *amax = max(*amax, max |in|)
// (a NaN input makes it NaN, so a non-finite tensor is seen). in: rows x cols, row-major, both
// multiples of 8 (FP8 GEMM operands are multiples of 16 anyway).
// With out and out_t null it only measures the amax (the current scaling recipe's first pass).
void cast_to_fp8(const __nv_bfloat16* in, int rows, int cols, const float* scale, Fp8Kind kind, uint8_t* out,
                 uint8_t* out_t, float* amax, cudaStream_t stream);
