// Patch embedding glue around its GEMM: patchify, class token and position embedding.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// images [B, C, img, img] fp32 -> patches [B * P, ld] bf16, each patch in (c, kh, kw) order in
// its row's first C * p * p columns, zeros in the rest (ld >= C * p * p: padding to 16-byte rows),
// patches in row-major (gh, gw) order: the Conv2d(k = p, s = p) as a GEMM operand.
void patchify(const float* images, __nv_bfloat16* patches, int B, int C, int img, int p, int ld,
              cudaStream_t stream);
// x[b, 0] = cls + pos[0]; x[b, 1 + i] = patch_out[b * P + i] + pos[1 + i]; x is [B, T, D] fp32.
void embed_forward(const float* patch_out, const float* cls, const float* pos, float* x, int B,
                   int T, int D, cudaStream_t stream);
// dpatch_out[b * P + i] = bf16(g[b, 1 + i]) (the position and class gradients are column sums
// of g, done by the caller).
void embed_backward(const float* g, __nv_bfloat16* dpatch_out, int B, int T, int D,
                    cudaStream_t stream);
