// Fused multi-head self-attention core (no mask, scale 1/sqrt(hd), softmax in fp32) on timm's
// qkv layout, forward and backward, bf16 tensor-core kernels (mma.sync, FlashAttention-2 style:
// scores and probabilities live in registers, never in device memory). Keys (or queries) stream
// through shared memory in chunks of 64, so T is bounded only by attention_unsupported_reason.
//
// Layouts (row-major): qkv [B*T, 3*D] with columns [0, D) Q, [D, 2D) K, [2D, 3D) V, head h at
// columns h*hd .. h*hd+hd-1 within each; D = H*hd. out/dout [B*T, D], heads joined the same way.
// lse/delta [B, H, T] fp32. Every bf16 pointer must be 16-byte aligned (cudaMalloc's are).
// hd must be a multiple of 8 in [8, 128] (one that is not a multiple of 16 runs padded to the next
// one, e.g. ViT-g/14's 88 as 96).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

// The forward's kernels. Streamed: mma.sync, one block per 64-query tile with the keys streamed
// through shared memory, any T. Resident: wgmma (sm_90a), one CTA per (image, head) with K and V
// resident, for hd 64 (T <= 832), 80 (T <= 656) or 128 (T <= 384) (attention_forward_resident_supported;
// kernels/attention_resident_forward.cu). Auto: Resident wherever it applies from 65 tokens on,
// where it is the faster, else Streamed.
enum class AttentionForward { Auto, Streamed, Resident };
bool attention_forward_resident_supported(int T, int hd);
// The forward Auto takes at (T, hd) on the current device.
AttentionForward attention_forward_auto_choice(int T, int hd);

// out = softmax(Q K^T / sqrt(hd)) V per (image, head); lse = natural-log-sum-exp of each query
// row's scaled scores (kept for the backward).
void attention_forward(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse, int B, int T,
                       int H, int hd, cudaStream_t stream, AttentionForward kind = AttentionForward::Auto);

// The backward's kernels. Streamed: dK/dV over key tiles and dQ over query tiles, each
// recomputing the scores, any T. SinglePass: one block per (image, head) holding K, V, Q and dO
// in shared memory, dS kept there for dQ (five products instead of seven), for T <= 96 and hd 16,
// 32, 64 or 80 (attention_single_pass_supported). Resident: the same on Hopper's warpgroup MMAs
// with three specialised warpgroups, for hd 64 or 80 on sm_90a, T <= 256 in one CTA per (image,
// head) (to 272: the keys past 256 as a narrow tile of the same CTA), up to 1024 tokens in blocks
// of 256 keys a CTA, and for hd 128 in blocks of 128 keys up to 1024 tokens
// (attention_resident_supported; kernels/attention_resident_backward.cu). Auto: the fastest that
// applies, SinglePass, then Resident, then Streamed.
enum class AttentionBackward { Auto, Streamed, SinglePass, Resident };
bool attention_single_pass_supported(int T, int hd);
bool attention_resident_supported(int T, int hd);
// The backward Auto takes at (T, hd) on the current device.
AttentionBackward attention_backward_auto_choice(int T, int hd);

// dqkv from dout, given the forward's qkv, out and lse. delta is an fp32 workspace of
// attention_backward_workspace_floats(B, T, H, hd) floats (its first B H T: rowsum(dout * out),
// then, past 256 tokens, the resident backward's dQ planes). Every element of dqkv is written;
// deterministic (no atomics).
size_t attention_backward_workspace_floats(int B, int T, int H, int hd);
void attention_backward(const __nv_bfloat16* qkv, const __nv_bfloat16* out,
                        const __nv_bfloat16* dout, const float* lse, float* delta,
                        __nv_bfloat16* dqkv, int B, int T, int H, int hd, cudaStream_t stream,
                        AttentionBackward kind = AttentionBackward::Auto);

// Empty when (T, hd) is supported on the current device, else a one-line reason.
std::string attention_unsupported_reason(int T, int hd);
