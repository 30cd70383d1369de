// Stochastic depth (timm's DropPath with scale_by_keep): each residual branch of each block keeps
// a sample's output with probability keep, scaled by 1 / keep, or drops it. A branch's per-sample
// scales (0 or 1 / keep) are drawn on the device. The forward applies them through the branch
// GEMM's alpha and a scaled bias, then gives the dropped samples their input rows back; the
// backward scales the branch's output gradient (layernorm.h's SampleScale).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

// timm's rates rise linearly over the blocks, from 0 at the first to `rate` at the last
// (torch.linspace(0, rate, blocks)): the keep probability of block l.
__host__ __device__ inline float drop_path_keep(float rate, int block, int blocks) {
  return blocks > 1 ? 1.0f - rate * static_cast<float>(block) / static_cast<float>(blocks - 1) : 1.0f;
}

// scales[(2 * l + branch) * batch + b] for the blocks' two branches (0 the attention's, 1 the
// MLP's) and the batch's samples: 1 / keep(l) with probability keep(l), else 0. Sample b is the
// step's sample first_sample + b: its draw depends on (seed, stream_id), its index in the step
// and the branch alone, so a data-parallel or accumulated step draws what one batch would.
void draw_drop_path(float* scales, int blocks, int batch, float rate, uint64_t seed, uint64_t stream_id,
                    int64_t first_sample, cudaStream_t stream);

// y [rows, D] fp32, rows_per_sample rows a sample: the rows of each dropped sample (scale 0) set
// back to x's (the residual add of a dropped branch: y = x + 0). D % 4 == 0, rows 16-byte aligned.
void restore_dropped_rows(const float* x, float* y, const float* sample_scales, int rows, int rows_per_sample, int D,
                          cudaStream_t stream);

// out[i] = in[i] * s: a branch's bias scaled as its product is (alpha applies to the product only).
void scale_vector(const float* in, float s, float* out, int n, cudaStream_t stream);
void scale_vector(const __nv_bfloat16* in, float s, __nv_bfloat16* out, int n, cudaStream_t stream);
