#include "model/vit.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/check.h"
#include "engine/nvtx.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "kernels/embed.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/random.h"
#include "kernels/reduce.h"

namespace {
constexpr float kLayerNormEps = 1e-6f;
}

ViT::ViT(const ViTConfig& cfg, int batch, ModelArenas& a)
    : cfg_(cfg), layout_(cfg), B_(batch), T_(cfg.tokens()), M_(batch * cfg.tokens()),
      classes_ld_((cfg.classes + 7) / 8 * 8) {
  const size_t D = cfg.dim, H = cfg.hidden(), M = M_, B = B_, P = cfg.patches();
  const size_t n = layout_.total();
  a.params.add(&params_, n);
  a.params.add(&params_bf16_, n);
  a.grads.add(&grads_, n);
  a.optimizer.add(&momentum_, n);

  a.workspace.add(&images_, B * cfg.channels * cfg.img * cfg.img);
  a.workspace.add(&labels_, B);

  Arena& s = a.activations;
  s.add(&patches_, B * P * cfg.patch_dim());
  s.add(&patch_out_, B * P * D);
  s.add(&resid_, (2 * cfg.depth + 1) * M * D);
  acts_.resize(cfg.depth);
  for (int l = 0; l < cfg.depth; ++l) {
    nvtx_forward_.push_back("block " + std::to_string(l) + " forward");
    nvtx_backward_.push_back("block " + std::to_string(l) + " backward");
  }
  for (BlockActs& b : acts_) {
    s.add(&b.ln1, M * D);
    s.add(&b.ln1_mean, M);
    s.add(&b.ln1_rstd, M);
    s.add(&b.qkv, M * 3 * D);
    s.add(&b.attn, M * D);
    s.add(&b.lse, M * cfg.heads);
    s.add(&b.ln2, M * D);
    s.add(&b.ln2_mean, M);
    s.add(&b.ln2_rstd, M);
    s.add(&b.fc1, M * H);
  }
  s.add(&lnf_, B * D);
  s.add(&lnf_mean_, B);
  s.add(&lnf_rstd_, B);
  s.add(&logits_, B * classes_ld_);
  s.add(&row_loss_, B);
  s.add(&loss_, 1);

  Arena& w = a.workspace;
  w.add(&dresid_, M * D);
  w.add(&dresid_bf16_, M * D);
  w.add(&dhidden_, M * H);
  w.add(&gelu_, M * H);
  w.add(&dln_, M * D);
  w.add(&dattn_, M * D);
  w.add(&dqkv_, M * 3 * D);
  w.add(&delta_, M * cfg.heads);
  w.add(&dlogits_, B * classes_ld_);
  w.add(&dfeat_, B * D);
  w.add(&dpatch_, B * P * D);
  const size_t partial = std::max({colsum_partial_floats(B_, T_ * cfg.dim), layernorm_partial_floats(M_, cfg.dim),
                                   gelu_backward_partial_floats(M_, cfg.hidden())});
  w.add(&partial_, partial);
}

void ViT::init_params(uint64_t seed, cudaStream_t stream) {
  const float conv_bound = 1.0f / std::sqrt(static_cast<float>(cfg_.patch_dim()));
  CUDA_CHECK(cudaMemsetAsync(params_, 0, layout_.total() * sizeof(float), stream));  // padding too
  for (size_t i = 0; i < layout_.tensors().size(); ++i) {
    const ParamTensor& t = layout_.at(static_cast<int>(i));
    float* dst = params_ + t.offset;
    switch (t.init) {
      case ParamInit::Zero: break;
      case ParamInit::One: fill_constant(dst, t.numel, 1.0f, stream); break;
      case ParamInit::TruncNormal002: fill_normal(dst, t.numel, seed, i, 0.0f, 0.02f, -2.0f, 2.0f, stream); break;
      case ParamInit::Normal1e6: fill_normal(dst, t.numel, seed, i, 0.0f, 1e-6f, -INFINITY, INFINITY, stream); break;
      case ParamInit::ConvUniform: fill_uniform(dst, t.numel, seed, i, -conv_bound, conv_bound, stream); break;
    }
  }
  CUDA_CHECK(cudaMemsetAsync(grads_, 0, layout_.total() * sizeof(float), stream));
  CUDA_CHECK(cudaMemsetAsync(momentum_, 0, layout_.total() * sizeof(float), stream));
  sync_bf16_params(stream);
}

void ViT::sync_bf16_params(cudaStream_t stream) { cast_to_bf16(params_, params_bf16_, layout_.total(), stream); }

void ViT::forward(cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  NvtxRange range("forward");
  auto phase = timer.phase(Phase::Forward, st);
  const int D = cfg_.dim, Hd = cfg_.hidden(), P = cfg_.patches(), BP = B_ * P;
  {
    NvtxRange r("patch_embed");
    { auto t = timer.op(OpKind::Embed, st); patchify(images_, patches_, B_, cfg_.channels, cfg_.img, cfg_.patch, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(patches_, pb(layout_.patch_w), p(layout_.patch_b), nullptr, patch_out_, DType::F32, BP, D,
                          cfg_.patch_dim(), st); }
    { auto t = timer.op(OpKind::Embed, st);
      embed_forward(patch_out_, p(layout_.cls_token), p(layout_.pos_embed), resid(0), B_, T_, D, st); }
  }
  for (int l = 0; l < cfg_.depth; ++l) {
    NvtxRange r(nvtx_forward_[l].c_str());
    const BlockParams& w = layout_.blocks[l];
    const BlockActs& a = acts_[l];
    const float *x = resid(2 * l), *x_mid = resid(2 * l + 1);
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_forward(x, D, p(w.norm1_w), p(w.norm1_b), a.ln1, a.ln1_mean, a.ln1_rstd, M_, D, kLayerNormEps, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(a.ln1, pb(w.qkv_w), pb(w.qkv_b), nullptr, a.qkv, DType::BF16, M_, 3 * D, D, st); }
    { auto t = timer.op(OpKind::Attention, st);
      attention_forward(a.qkv, a.attn, a.lse, B_, T_, cfg_.heads, cfg_.head_dim(), st); }
    { auto t = timer.op(OpKind::Gemm, st);  // x_mid = x + proj(attn), the residual through C
      gemm.linear_forward(a.attn, pb(w.proj_w), p(w.proj_b), x, resid(2 * l + 1), DType::F32, M_, D, D, st); }
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_forward(x_mid, D, p(w.norm2_w), p(w.norm2_b), a.ln2, a.ln2_mean, a.ln2_rstd, M_, D, kLayerNormEps, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(a.ln2, pb(w.fc1_w), pb(w.fc1_b), nullptr, a.fc1, DType::BF16, M_, Hd, D, st); }
    { auto t = timer.op(OpKind::Gelu, st); gelu_forward(a.fc1, gelu_, static_cast<size_t>(M_) * Hd, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(gelu_, pb(w.fc2_w), p(w.fc2_b), x_mid, resid(2 * l + 2), DType::F32, M_, D, Hd, st); }
  }
  {
    NvtxRange r("head and loss");
    // Only the class token reaches the head, so the final LayerNorm runs on those B rows alone.
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_forward(resid(2 * cfg_.depth), T_ * D, p(layout_.norm_w), p(layout_.norm_b), lnf_, lnf_mean_,
                        lnf_rstd_, B_, D, kLayerNormEps, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(lnf_, pb(layout_.head_w), p(layout_.head_b), nullptr, logits_, DType::F32, B_,
                          cfg_.classes, D, st, classes_ld_); }
    { auto t = timer.op(OpKind::Loss, st);
      softmax_xent(logits_, labels_, B_, cfg_.classes, classes_ld_, row_loss_, loss_, dlogits_, st); }
  }
}

void ViT::backward(cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  NvtxRange range("backward");
  auto phase = timer.phase(Phase::Backward, st);
  const int D = cfg_.dim, Hd = cfg_.hidden(), BP = B_ * cfg_.patches();
  {
    NvtxRange r("head backward");
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_weight(dlogits_, lnf_, g(layout_.head_w), g(layout_.head_b), B_, cfg_.classes, D, st,
                                  classes_ld_);
      gemm.linear_backward_input(dlogits_, pb(layout_.head_w), dfeat_, B_, cfg_.classes, D, st, classes_ld_); }
    // The residual gradient is zero but on the class-token rows.
    CUDA_CHECK(cudaMemsetAsync(dresid_, 0, static_cast<size_t>(M_) * D * sizeof(float), st));
    CUDA_CHECK(cudaMemsetAsync(dresid_bf16_, 0, static_cast<size_t>(M_) * D * sizeof(bf16), st));
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_backward(dfeat_, resid(2 * cfg_.depth), T_ * D, p(layout_.norm_w), lnf_mean_, lnf_rstd_, dresid_,
                         dresid_bf16_, g(layout_.norm_w), g(layout_.norm_b), partial_, B_, D, st); }
  }
  for (int l = cfg_.depth - 1; l >= 0; --l) {
    NvtxRange r(nvtx_backward_[l].c_str());
    const BlockParams& w = layout_.blocks[l];
    const BlockActs& a = acts_[l];
    // MLP: dresid is the gradient of this block's output, and of fc2's output. The GELU output
    // is recomputed in the pass that applies GELU's derivative (4 GiB less for ViT-H at batch 64).
    { auto t = timer.op(OpKind::Gemm, st); gemm.linear_backward_input(dresid_bf16_, pb(w.fc2_w), dhidden_, M_, D, Hd, st); }
    { auto t = timer.op(OpKind::Gelu, st);
      gelu_backward(dhidden_, a.fc1, dhidden_, gelu_, g(w.fc1_b), partial_, M_, Hd, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_weight(dresid_bf16_, gelu_, g(w.fc2_w), g(w.fc2_b), M_, D, Hd, st);
      gemm.linear_backward_weight(dhidden_, a.ln2, g(w.fc1_w), nullptr, M_, Hd, D, st);
      gemm.linear_backward_input(dhidden_, pb(w.fc1_w), dln_, M_, Hd, D, st); }
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_backward(dln_, resid(2 * l + 1), D, p(w.norm2_w), a.ln2_mean, a.ln2_rstd, dresid_, dresid_bf16_,
                         g(w.norm2_w), g(w.norm2_b), partial_, M_, D, st); }
    // Attention: dresid is now the gradient of the block's middle state, and of proj's output.
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_weight(dresid_bf16_, a.attn, g(w.proj_w), g(w.proj_b), M_, D, D, st);
      gemm.linear_backward_input(dresid_bf16_, pb(w.proj_w), dattn_, M_, D, D, st); }
    { auto t = timer.op(OpKind::Attention, st);
      attention_backward(a.qkv, a.attn, dattn_, a.lse, delta_, dqkv_, B_, T_, cfg_.heads, cfg_.head_dim(), st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_weight(dqkv_, a.ln1, g(w.qkv_w), g(w.qkv_b), M_, 3 * D, D, st);
      gemm.linear_backward_input(dqkv_, pb(w.qkv_w), dln_, M_, 3 * D, D, st); }
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_backward(dln_, resid(2 * l), D, p(w.norm1_w), a.ln1_mean, a.ln1_rstd, dresid_, dresid_bf16_,
                         g(w.norm1_w), g(w.norm1_b), partial_, M_, D, st); }
  }
  {
    NvtxRange r("patch_embed backward");
    // x[b, t] = (t == 0 ? cls : patch_out[b, t - 1]) + pos[t]: pos gets the batch sum of dresid,
    // cls its token-0 row.
    { auto t = timer.op(OpKind::Embed, st);
      colsum(dresid_, B_, T_ * D, T_ * D, g(layout_.pos_embed), partial_, st);
      CUDA_CHECK(cudaMemcpyAsync(g(layout_.cls_token), g(layout_.pos_embed), D * sizeof(float),
                                 cudaMemcpyDeviceToDevice, st)); }
    { auto t = timer.op(OpKind::Embed, st); embed_backward(dresid_, dpatch_, B_, T_, D, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_weight(dpatch_, patches_, g(layout_.patch_w), g(layout_.patch_b), BP, D,
                                  cfg_.patch_dim(), st); }
  }
}
