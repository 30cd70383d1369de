// Counter-based random numbers on the device (a hash of seed, stream and index), so that the
// initial weights and the synthetic batches depend on the seed alone, not on launch shapes.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// out[i] = mean + std * N(0, 1), truncated to [lo, hi] by redrawing (lo < hi): element
// first_index + i of the stream's sequence (so a slice of a batch can be drawn on its own).
void fill_normal(float* out, size_t n, uint64_t seed, uint64_t stream_id, float mean, float std,
                 float lo, float hi, cudaStream_t stream, size_t first_index = 0);
// out[i] uniform in [lo, hi).
void fill_uniform(float* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi,
                  cudaStream_t stream);
// labels[i] = (first_index + i) % classes.
void fill_labels(int* labels, int n, int64_t first_index, int classes, cudaStream_t stream);
