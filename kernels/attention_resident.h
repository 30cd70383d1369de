// The attention forward and backward with their operands resident in shared memory, on wgmma
// (sm_90a): one CTA per (image, head). Backward: hd 64 or 80, T <= 256 (up to 1024 tokens in key
// blocks, below; hd 128 always in key blocks). Forward: hd 64, 80 or 128,
// T as far as K and V fit in shared memory (832, 656, 384 tokens; kernels/attention_resident_forward.cu).
// Reached through attention_forward and attention_backward (kernels/attention.h,
// AttentionForward::Resident, AttentionBackward::Resident), which validate the arguments; the same
// contracts. Up to 256 tokens at hd 64 and 80 the backward computes rowsum(dout * out) itself (no
// delta workspace).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

// Whether (T, hd) runs on these kernels on device dev (sm_90a, enough shared memory).
bool attention_resident_fits(int T, int hd, int dev);
bool attention_forward_resident_fits(int T, int hd, int dev);
// Whether it is the faster forward there: from two 64-query tiles on, not at one (where the
// streamed kernel, which starts sooner, is).
bool attention_forward_resident_preferred(int T, int hd, int dev);

void attention_forward_resident(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse, int B, int T, int H, int hd,
                                int dev, cudaStream_t stream);

// Past 256 tokens (and at hd 128 from 1) the backward runs in key blocks (up to 1024 tokens): a
// CTA per (image, head, 4 key tiles; 2 at hd 128), every query tile streamed through it; delta (rowsum(dout * out), [B, H, T]) comes
// computed, and each key block writes its part of dQ into its own fp32 plane of dq_planes
// (attention_resident_dq_plane_floats), summed in order after it (deterministic). Up to 256
// tokens at hd 64 and 80 both are unused (nullptr).
// From 257 to 272 tokens at hd 64 and 80 one CTA holds every key (the 1-16 past 256 as a
// 16-row tile), so dQ needs no planes; delta still comes computed.
bool attention_resident_takes_delta(int T, int hd);
size_t attention_resident_dq_plane_floats(int B, int T, int H, int hd);
void attention_backward_resident(const __nv_bfloat16* qkv, const __nv_bfloat16* out, const __nv_bfloat16* dout,
                                 const float* lse, const float* delta, float* dq_planes, __nv_bfloat16* dqkv, int B,
                                 int T, int H, int hd, int dev, cudaStream_t stream);
