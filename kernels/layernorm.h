// LayerNorm over the last dimension (fp32 statistics), for the pre-norm residual stream:
// the input is the fp32 residual stream, the output the bf16 GEMM input.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/fp8_out.h"
#include "kernels/grad_write.h"

// y[M, D] (bf16, contiguous) = LN(x), x rows at x_row_stride elements; saves mean, rstd [M].
void layernorm_forward(const float* x, int x_row_stride, const float* w, const float* b,
                       __nv_bfloat16* y, float* mean, float* rstd, int M, int D, float eps,
                       cudaStream_t stream);
// FP8 (fp8.h): the same, with y written straight to FP8 E4M3 through o, row-major only (the
// forward GEMM's operand; out_t must be null: a row per warp has no transposed tile).
void layernorm_forward_fp8(const float* x, int x_row_stride, const float* w, const float* b, const Fp8Out& o,
                           float* mean, float* rstd, int M, int D, float eps, cudaStream_t stream);
// Stochastic depth: the gradient of a residual branch's output is the residual gradient times
// its sample's drop-path scale; scale[r / rows_per_sample] is row r's (null: 1).
struct SampleScale {
  const float* scale = nullptr;
  int rows_per_sample = 1;
};
// Backward, fused with the residual: g[r] += dLN/dx (rows at g_row_stride, fp32, in place) and
// g_bf16[r] = bf16(g[r] * branch_scale of r) for the next GEMM (the branch below, whose output
// gradient it is); dy [M, D] bf16 contiguous. The weight and bias
// gradients go to dw, db (written or added to, as `write` says) through per-block partial sums in
// partial (layernorm_partial_floats(M, D) floats).
void layernorm_backward(const __nv_bfloat16* dy, const float* x, int row_stride, const float* w,
                        const float* mean, const float* rstd, float* g, __nv_bfloat16* g_bf16,
                        float* dw, float* db, float* partial, int M, int D, cudaStream_t stream,
                        GradWrite write = GradWrite::Overwrite, SampleScale branch_scale = {});
size_t layernorm_partial_floats(int M, int D);
