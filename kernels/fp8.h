// FP8 outputs of the kernels that produce GEMM operands. A producer computes each value v in
// fp32 and writes fp8(*scale * v) (nearest-even, saturating to the largest finite value),
// row-major and/or as the transposed copy Hopper's "TN"-only FP8 GEMMs need when the
// contraction runs along rows, and folds max |v| into the tensor's amax, all in the pass that
// computes v: no bf16 round trip, no separate cast over the tensor.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fp8_out.h"
#include "kernels/grad_write.h"

// The cast of a bf16 tensor [rows, cols] (both multiples of 8). db (may be null): the column
// sums of in, the bias gradient of the layer whose output gradient in is (written or added to, as
// `write` says), through partial (fp8_cast_partial_floats(rows, cols)); untouched by a pass
// without a scale (the current recipe's amax pass, which the writing pass follows).
void cast_to_fp8(const __nv_bfloat16* in, int rows, int cols, const Fp8Out& o, cudaStream_t stream,
                 float* db = nullptr, float* partial = nullptr, GradWrite write = GradWrite::Overwrite);
size_t fp8_cast_partial_floats(int rows, int cols);

// out_t [cols, rows] = the FP8 codes in [rows, cols] transposed (both multiples of 8): a kept
// row-major copy turned into the one a weight gradient needs.
void transpose_fp8(const uint8_t* in, int rows, int cols, uint8_t* out_t, cudaStream_t stream);

// The casts of count same-shaped tensors in one launch: tensor z reads in + z * in_stride and
// writes through first's pointers advanced by z times strides. For many small tensors (the
// weights) one launch fills the GPU where one launch a tensor does not.
void cast_to_fp8_batched(const __nv_bfloat16* in, size_t in_stride, int rows, int cols, const Fp8Out& first,
                         const Fp8Strides& strides, int count, cudaStream_t stream);
