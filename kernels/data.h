// Device side of real datasets: pixel normalisation and top-1 counting.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// out[i] = (in[i] / 255 - mean) / std
void normalize_pixels(const uint8_t* in, float* out, size_t n, float mean, float std, cudaStream_t stream);
// correct[0] += rows b < n_valid whose label is among the k0 largest of logits[b, 0..C),
// correct[1] the same for k1 (top-1 and top-5 accuracy). Ties rank the lower class first, as
// torch.argmax does. logits rows at stride ld.
void count_top_k(const float* logits, int ld, int C, const int* labels, int n_valid, int k0, int k1, int* correct,
                 cudaStream_t stream);
// *sum += *value (a device-side running sum, read at epoch ends).
void accumulate(const float* value, float* sum, cudaStream_t stream);
