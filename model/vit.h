// The ViT's training step, written out: forward, loss and backward over the kernels and the
// GEMM entry point. The only place that knows the architecture. Memory comes from the engine's
// arenas; nothing is allocated and nothing synchronises inside forward() and backward().
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/arena.h"
#include "engine/gemm.h"
#include "engine/timing.h"
#include "model/config.h"
#include "model/params.h"

using bf16 = __nv_bfloat16;

struct ModelArenas {
  Arena params{"parameters (fp32 master + bf16 copy)"};
  Arena grads{"gradients (fp32)"};
  Arena optimizer{"optimizer state (fp32 momentum)"};
  Arena activations{"activations saved for backward"};
  Arena workspace{"workspace (backward temporaries, batch)"};

  std::vector<Arena*> all() { return {&params, &grads, &optimizer, &activations, &workspace}; }
  std::vector<const Arena*> all() const { return {&params, &grads, &optimizer, &activations, &workspace}; }
  size_t bytes() const {
    size_t n = 0;
    for (const Arena* a : all()) n += a->bytes();
    return n;
  }
  void commit() {
    for (Arena* a : all()) a->commit();
  }
};

class ViT {
 public:
  // Declares every buffer in the arenas; pointers are valid after the arenas are committed.
  ViT(const ViTConfig& cfg, int batch, ModelArenas& arenas);

  const ViTConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  int batch() const { return B_; }

  // timm's initialisation, drawn on the device from the seed; also writes the bf16 copy and
  // zeroes gradients and momentum.
  void init_params(uint64_t seed, cudaStream_t stream);
  // After the fp32 master weights were written from outside (tests, loading): refresh the copy.
  void sync_bf16_params(cudaStream_t stream);

  // Forward and loss on images [B, C, H, W] fp32 and labels [B]; leaves loss() and logits().
  void forward(cudaStream_t stream, Gemm& gemm, OpTimer& timer);
  // Backward of the last forward: every parameter gradient into grads() (overwritten).
  void backward(cudaStream_t stream, Gemm& gemm, OpTimer& timer);

  // The batch the next forward reads.
  float* images() const { return images_; }
  int* labels() const { return labels_; }
  // Flat buffers in layout() order (layout().total() elements).
  float* params() const { return params_; }
  bf16* params_bf16() const { return params_bf16_; }
  float* grads() const { return grads_; }
  float* momentum() const { return momentum_; }
  const float* loss() const { return loss_; }      // device scalar
  const float* logits() const { return logits_; }  // [B, logits_ld()]
  int logits_ld() const { return classes_ld_; }

 private:
  struct BlockActs {
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *lse;
    bf16 *ln1, *qkv, *attn, *ln2, *fc1;  // fc1: the pre-GELU activation; GELU is recomputed
  };
  const float* p(int t) const { return params_ + layout_.at(t).offset; }
  const bf16* pb(int t) const { return params_bf16_ + layout_.at(t).offset; }
  float* g(int t) const { return grads_ + layout_.at(t).offset; }
  float* resid(int i) const { return resid_ + static_cast<size_t>(i) * M_ * cfg_.dim; }

  ViTConfig cfg_;
  ParamLayout layout_;
  int B_, T_, M_, classes_ld_;

  float *params_, *grads_, *momentum_;
  bf16* params_bf16_;
  float *images_;
  int* labels_;
  // forward, saved for backward
  bf16* patches_;
  float* patch_out_;
  float* resid_;  // 2 * depth + 1 residual-stream states [M, D] fp32
  std::vector<BlockActs> acts_;
  std::vector<std::string> nvtx_forward_, nvtx_backward_;  // "block i forward/backward", made once
  float *lnf_mean_, *lnf_rstd_, *logits_, *row_loss_, *loss_;
  bf16* lnf_;
  // backward temporaries, reused block after block
  float *dresid_, *partial_, *delta_;
  bf16 *dresid_bf16_, *dhidden_, *dln_, *dattn_, *dqkv_, *dlogits_, *dfeat_, *dpatch_;
  bf16* gelu_;  // the current block's GELU output, forward and (recomputed) backward
};
