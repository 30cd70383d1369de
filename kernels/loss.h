// Softmax cross-entropy, mean over the batch, fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// logits [B, ld] fp32 (C classes used); loss = mean_b -log softmax(logits_b)[label_b];
// dlogits [B, ld] bf16 = (softmax - onehot) / B, its padding columns zeroed; row_loss [B] scratch.
void softmax_xent(const float* logits, const int* labels, int B, int C, int ld, float* row_loss,
                  float* loss, __nv_bfloat16* dlogits, cudaStream_t stream);
