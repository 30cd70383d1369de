// Softmax cross-entropy, mean over the batch, fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// logits [B, ld] fp32 (C classes used); loss = mean_b of the cross-entropy of softmax(logits_b)
// against the target (1 - smoothing) onehot(label_b) + smoothing / C (PyTorch's CrossEntropyLoss
// with label_smoothing); dlogits [B, ld] bf16 = (softmax - target) / (B * ranks), its padding
// columns zeroed (ranks: data-parallel ranks whose gradients are summed, so that the sum is the
// global batch's mean); row_loss [B] scratch.
void softmax_xent(const float* logits, const int* labels, int B, int C, int ld, float* row_loss,
                  float* loss, __nv_bfloat16* dlogits, cudaStream_t stream, float smoothing = 0.0f,
                  int ranks = 1);
