// Device side of real datasets: pixel normalisation and top-1 counting.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// out[i] = (in[i] / 255 - mean) / std
void normalize_pixels(const uint8_t* in, float* out, size_t n, float mean, float std, cudaStream_t stream);
// *correct += number of rows b < n_valid whose argmax over logits[b, 0..C) equals labels[b]
// (ties go to the lowest class, as torch.argmax). logits rows at stride ld.
void count_correct(const float* logits, int ld, int C, const int* labels, int n_valid, int* correct,
                   cudaStream_t stream);
// *sum += *value (a device-side running sum, read at epoch ends).
void accumulate(const float* value, float* sum, cudaStream_t stream);
