// Elementwise kernels on bf16 tensors: exact (erf) GELU and its gradient, casts.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

// a = gelu(h), n elements (n % 8 == 0, 16-byte aligned).
void gelu_forward(const __nv_bfloat16* h, __nv_bfloat16* a, size_t n, cudaStream_t stream);
// The backward through GELU of h [M, N] (N % 8 == 0), one pass: dh = da * gelu'(h) (dh may
// alias da); a = gelu(h) recomputed (unless a is null), so the forward need not keep it; db[N] = column sums of dh,
// the bias gradient of the layer that produced h, through partial
// (gelu_backward_partial_floats(M, N)).
void gelu_backward(const __nv_bfloat16* da, const __nv_bfloat16* h, __nv_bfloat16* dh,
                   __nv_bfloat16* a, float* db, float* partial, int M, int N, cudaStream_t stream);
size_t gelu_backward_partial_floats(int M, int N);
// out[i] = value, any n.
void fill_constant(float* out, size_t n, float value, cudaStream_t stream);
// out = bf16(in), any n.
void cast_to_bf16(const float* in, __nv_bfloat16* out, size_t n, cudaStream_t stream);
