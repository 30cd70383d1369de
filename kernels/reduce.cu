#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/reduce.h"

namespace {
constexpr int kThreads = 256;
constexpr int kRowsPerChunk = 64;

// Stage one: partial[chunk, col] = sum of kRowsPerChunk rows; consecutive threads read
// consecutive columns, so each row's read is coalesced.
__global__ void colsum_partial_kernel(const float* __restrict__ x, int M, int N, int ld,
                                      float* __restrict__ partial) {
  const int col = blockIdx.x * kThreads + threadIdx.x;
  if (col >= N) return;
  const int r0 = blockIdx.y * kRowsPerChunk, r1 = min(M, r0 + kRowsPerChunk);
  float s = 0;
  for (int r = r0; r < r1; ++r) s += x[static_cast<size_t>(r) * ld + col];
  partial[static_cast<size_t>(blockIdx.y) * N + col] = s;
}

__global__ void sum_rows_kernel(const float* __restrict__ partial, int R, int N, int ld,
                                float* __restrict__ out) {
  const int col = blockIdx.x * kThreads + threadIdx.x;
  if (col >= N) return;
  float s = 0;
  for (int r = 0; r < R; ++r) s += partial[static_cast<size_t>(r) * ld + col];
  out[col] = s;
}
}  // namespace

size_t colsum_partial_floats(int M, int N) {
  return static_cast<size_t>((M + kRowsPerChunk - 1) / kRowsPerChunk) * N;
}

void colsum(const float* x, int M, int N, int ld, float* out, float* partial, cudaStream_t stream) {
  NvtxRange range("colsum");
  ENSURE(M > 0 && N > 0 && ld >= N, "colsum: bad shape");
  const int chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  ENSURE(chunks <= 65535, "colsum: too many rows");
  colsum_partial_kernel<<<dim3(grid_for(N, kThreads), chunks), kThreads, 0, stream>>>(x, M, N, ld, partial);
  LAUNCH_CHECK();
  sum_rows(partial, chunks, N, N, out, stream);
}

void sum_rows(const float* partial, int R, int N, int ld, float* out, cudaStream_t stream) {
  sum_rows_kernel<<<grid_for(N, kThreads), kThreads, 0, stream>>>(partial, R, N, ld, out);
  LAUNCH_CHECK();
}
