// Elementwise kernels on bf16 tensors: exact GELU (x Phi(x), not the tanh approximation) and its
// gradient, casts.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/fp8_out.h"
#include "kernels/grad_write.h"

// a = gelu(h), n elements (n % 8 == 0, 16-byte aligned).
void gelu_forward(const __nv_bfloat16* h, __nv_bfloat16* a, size_t n, cudaStream_t stream);
// The backward through GELU of h [M, N] (N % 8 == 0), one pass: dh = da * gelu'(h) (dh may
// alias da); a = gelu(h) recomputed (unless a is null), so the forward need not keep it; db[N] = column sums of dh,
// the bias gradient of the layer that produced h (written or added to, as `write` says), through
// partial (gelu_backward_partial_floats(M, N)).
void gelu_backward(const __nv_bfloat16* da, const __nv_bfloat16* h, __nv_bfloat16* dh,
                   __nv_bfloat16* a, float* db, float* partial, int M, int N, cudaStream_t stream,
                   GradWrite write = GradWrite::Overwrite);
size_t gelu_backward_partial_floats(int M, int N);
// FP8 (fp8.h): a = gelu(h) [M, N] (N % 8 == 0) straight to FP8 E4M3 through o, row-major only
// (fc2's input in the forward).
void gelu_forward_fp8(const __nv_bfloat16* h, int M, int N, const Fp8Out& o, cudaStream_t stream);
// FP8 backward, one pass: dh = da * gelu'(h) to FP8 E5M2 through dh_out (fc1's output gradient),
// db[N] = its column sums (fc1's bias gradient; partial: fp8_cast_partial_floats(M, N); untouched
// where dh_out has no scale, as cast_to_fp8's); and
// a = gelu(h) recomputed to E4M3 through a_out, transposed only (fc2's input for its weight
// gradient; its amax is not recorded again): with the forward's scale, the very codes the forward wrote.
void gelu_backward_fp8(const __nv_bfloat16* da, const __nv_bfloat16* h, int M, int N, const Fp8Out& dh_out,
                       const Fp8Out& a_out, float* db, float* partial, cudaStream_t stream,
                       GradWrite write = GradWrite::Overwrite);
// out[i] = value, any n.
void fill_constant(float* out, size_t n, float value, cudaStream_t stream);
// out = bf16(in), any n.
void cast_to_bf16(const float* in, __nv_bfloat16* out, size_t n, cudaStream_t stream);
// out = float(in), any n.
void cast_to_f32(const __nv_bfloat16* in, float* out, size_t n, cudaStream_t stream);
