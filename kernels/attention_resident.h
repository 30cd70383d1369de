// The attention backward with Q, K, V and dO resident in shared memory, on wgmma (sm_90a): one
// CTA per (image, head), T <= 256, hd 64 or 80 (kernels/attention_resident.cu). Reached through
// attention_backward (kernels/attention.h, AttentionBackward::Resident), which validates the
// arguments; same contract (every element of dqkv written, deterministic), and it computes
// rowsum(dout * out) itself (no delta workspace).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// Whether (T, hd) runs on this kernel on device dev (sm_90a, enough shared memory).
bool attention_resident_fits(int T, int hd, int dev);

void attention_backward_resident(const __nv_bfloat16* qkv, const __nv_bfloat16* out, const __nv_bfloat16* dout,
                                 const float* lse, __nv_bfloat16* dqkv, int B, int T, int H, int hd, int dev,
                                 cudaStream_t stream);
