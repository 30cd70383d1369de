// The mma.sync attention kernels' launchers, for the dispatch (kernels/attention.h,
// attention_dispatch.cu), which checks the arguments first: the streamed forward and backward
// (attention_streamed_forward.cu, attention_streamed_backward.cu; any T up to 65536, hd a
// multiple of 8 up to 128) and the single-pass backward (attention_single_pass.cu; T <= 96, hd
// 16, 32, 64 or 80). The contracts are attention.h's.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

constexpr int kAttentionMaxT = 65536;  // no shared-memory bound; keeps every index comfortably in range

// The most shared memory a streamed kernel of head dim hd takes a block (it does not depend on T).
int attention_streamed_smem_bytes(int hd);
void attention_forward_streamed(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse, int B, int T, int H, int hd,
                                int dev, cudaStream_t stream);
// delta = rowsum(dout * out), [B, H, T].
void attention_delta(const __nv_bfloat16* out, const __nv_bfloat16* dout, float* delta, int B, int T, int H, int hd,
                     cudaStream_t stream);
void attention_backward_streamed(const __nv_bfloat16* qkv, const __nv_bfloat16* dout, const float* lse,
                                 const float* delta, __nv_bfloat16* dqkv, int B, int T, int H, int hd, int dev,
                                 cudaStream_t stream);
// Whether (T, hd) fits the single-pass kernel on device dev.
bool attention_single_pass_fits(int T, int hd, int dev);
void attention_backward_single_pass(const __nv_bfloat16* qkv, const __nv_bfloat16* out, const __nv_bfloat16* dout,
                                    const float* lse, __nv_bfloat16* dqkv, int B, int T, int H, int hd, int dev,
                                    cudaStream_t stream);
