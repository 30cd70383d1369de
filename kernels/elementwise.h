// Elementwise kernels on bf16 tensors: exact (erf) GELU and its gradient, casts.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

// a = gelu(h), n elements (n % 8 == 0, 16-byte aligned).
void gelu_forward(const __nv_bfloat16* h, __nv_bfloat16* a, size_t n, cudaStream_t stream);
// dh = da * gelu'(h); dh may alias da. With a non-null a, also recomputes a = gelu(h) in the
// same pass, so the forward need not keep the GELU output for the backward.
void gelu_backward(const __nv_bfloat16* da, const __nv_bfloat16* h, __nv_bfloat16* dh,
                   __nv_bfloat16* a, size_t n, cudaStream_t stream);
// out[i] = value, any n.
void fill_constant(float* out, size_t n, float value, cudaStream_t stream);
// out = bf16(in), any n.
void cast_to_bf16(const float* in, __nv_bfloat16* out, size_t n, cudaStream_t stream);
