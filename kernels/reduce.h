// Column sums out[N] = sum over rows of x[M, N] (row stride ld): the position embedding's
// gradient and the bf16 products' bias gradients (the FP8 products' come from the passes that
// write their FP8 output gradients). Two deterministic stages through partial
// (colsum_partial_floats(M, N)).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/grad_write.h"

void colsum(const float* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream,
            GradWrite write = GradWrite::Overwrite);
void colsum(const __nv_bfloat16* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream,
            GradWrite write = GradWrite::Overwrite);
size_t colsum_partial_floats(int M, int N);
// Stage two alone: out[N] = sum over rows of partial[R, N] (Accumulate: out[N] += that sum); used
// by LayerNorm's weight gradients and the bias gradients the elementwise passes sum.
void sum_rows(const float* partial, int R, int N, int ld, float* out, cudaStream_t stream,
              GradWrite write = GradWrite::Overwrite);
// *out = a 64-bit hash of x's bit patterns and positions (order-independent sum of mixed
// words: the same on any launch shape): equal weights on two ranks give equal checksums.
void checksum(const float* x, size_t n, unsigned long long* out, cudaStream_t stream);
// *out = the L2 norm of x[0..n) (fp32, a fixed two-stage order: deterministic), through partial
// (l2_norm_partial_floats()); the global gradient norm for clipping.
void l2_norm(const float* x, size_t n, float* partial, float* out, cudaStream_t stream);
size_t l2_norm_partial_floats();
// dst[i] = dst[i] + src[0 * stride + i] + src[1 * stride + i] + ... over `sources` arrays, added
// in that order (fp32): a rank's share of the gradients summed with the copies its peers sent.
void sum_into(float* dst, const float* src, size_t stride, int sources, size_t n, cudaStream_t stream);
