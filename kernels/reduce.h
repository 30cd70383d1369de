// Column sums out[N] = sum over rows of x[M, N] (row stride ld), for the position embedding's
// gradient. Two deterministic stages through partial (colsum_partial_floats(M, N)).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

void colsum(const float* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream);
size_t colsum_partial_floats(int M, int N);
// Stage two alone: out[N] = sum over rows of partial[R, N]; used by LayerNorm's weight gradients.
void sum_rows(const float* partial, int R, int N, int ld, float* out, cudaStream_t stream);
