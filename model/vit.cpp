#include "model/vit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "kernels/attention.h"
#include "kernels/check.h"
#include "kernels/cudnn_attention.h"
#include "kernels/drop_path.h"
#include "kernels/elementwise.h"
#include "kernels/embed.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/nvtx.h"
#include "kernels/random.h"
#include "kernels/reduce.h"
#include "kernels/spin.h"

namespace {
constexpr float kLayerNormEps = 1e-6f;
}

std::string ViT::fp8_unsupported_reason(const ViTConfig& cfg, int batch) {
  const int64_t rows = int64_t(batch) * cfg.tokens();
  if (rows % 16 != 0) {
    int step = 1;  // the smallest batch multiple whose token rows are a multiple of 16
    while ((int64_t(step) * cfg.tokens()) % 16 != 0) ++step;
    return "FP8 GEMMs contract over the batch's token rows, which must be a multiple of 16: with " +
           std::to_string(cfg.tokens()) + " tokens per image the batch must be a multiple of " + std::to_string(step) +
           " (got " + std::to_string(batch) + ")";
  }
  if (cfg.dim % 16 != 0 || cfg.hidden() % 16 != 0)
    return "FP8 GEMMs need dim and the MLP hidden size to be multiples of 16 (got " + std::to_string(cfg.dim) + ", " +
           std::to_string(cfg.hidden()) + ")";
  return "";
}

ViT::ViT(const ViTConfig& cfg, int batch, MemoryRequest& memory, Precision precision)
    : cfg_(cfg), layout_(cfg), B_(batch), T_(cfg.tokens()), M_(batch * cfg.tokens()),
      classes_ld_((cfg.classes + 7) / 8 * 8), precision_(precision) {
  const size_t D = cfg.dim, H = cfg.hidden(), M = M_, B = B_, P = cfg.patches();
  const size_t n = layout_.total();
  fp32_read_.assign(layout_.tensors().size(), 0);
  auto param = [&](auto** slot, size_t count) { memory.add(MemoryCategory::Parameters, slot, count); };
  auto saved = [&](auto** slot, size_t count) { memory.add(MemoryCategory::Activations, slot, count); };
  auto work = [&](auto** slot, size_t count) { memory.add(MemoryCategory::Workspace, slot, count); };
  param(&params_, n);
  param(&params_bf16_, n);
  memory.add(MemoryCategory::Gradients, &grads_, n);

  work(&images_, B * cfg.channels * cfg.img * cfg.img);
  work(&labels_, B);

  saved(&patches_, B * P * cfg.patch_dim_padded());
  saved(&patch_out_, B * P * D);
  saved(&resid_, (2 * cfg.depth + 1) * M * D);
  acts_.resize(cfg.depth);
  for (int l = 0; l < cfg.depth; ++l) {
    nvtx_forward_.push_back("block " + std::to_string(l) + " forward");
    nvtx_backward_.push_back("block " + std::to_string(l) + " backward");
  }
  for (BlockActs& b : acts_) {
    if (precision_ == Precision::BF16) saved(&b.ln1, M * D);  // FP8 keeps its FP8 codes instead (ln1_8)
    saved(&b.ln1_mean, M);
    saved(&b.ln1_rstd, M);
    saved(&b.qkv, M * 3 * D);
    saved(&b.attn, M * D);
    saved(&b.lse, M * cfg.heads);
    if (precision_ == Precision::BF16) saved(&b.ln2, M * D);
    saved(&b.ln2_mean, M);
    saved(&b.ln2_rstd, M);
    saved(&b.fc1, M * H);
    if (precision_ == Precision::FP8) {
      saved(&b.ln1_8, M * D);
      saved(&b.ln2_8, M * D);
      saved(&b.attn8t, M * D);
    }
  }
  saved(&lnf_, B * D);
  saved(&lnf_mean_, B);
  saved(&lnf_rstd_, B);
  saved(&logits_, B * classes_ld_);
  saved(&row_loss_, B);
  saved(&loss_, 1);

  work(&dresid_, M * D);
  work(&dresid_bf16_, M * D);
  work(&dmid_bf16_, M * D);
  work(&dhidden_, M * H);
  if (precision_ == Precision::BF16) work(&gelu_, M * H);
  work(&dln_, M * D);
  work(&dattn_, M * D);
  work(&dqkv_, M * 3 * D);
  work(&delta_, attention_backward_workspace_floats(B, T_, cfg.heads, cfg.head_dim()));
  work(&dlogits_, B * classes_ld_);
  work(&dfeat_, B * D);
  work(&dpatch_, B * P * D);
  work(&bias_partial_, std::max(colsum_partial_floats(M_, 3 * cfg.dim), colsum_partial_floats(B_, classes_ld_)));
  work(&drop_scales_, 2 * cfg.depth * B);
  work(&branch_bias_, D);
  work(&branch_bias_bf16_, D);
  if (cfg.patch_dim_padded() != cfg.patch_dim()) {  // the patch embedding's weight and gradient, padded rows
    work(&patch_w_padded_, D * cfg.patch_dim_padded());
    work(&patch_grad_padded_, D * cfg.patch_dim_padded());
  }
  size_t partial = std::max({colsum_partial_floats(B_, T_ * cfg.dim), layernorm_partial_floats(M_, cfg.dim),
                             gelu_backward_partial_floats(M_, cfg.hidden())});

  for (const BlockParams& b : layout_.blocks) {
    std::array<Linear, 4> lin;
    lin[kQkv] = {b.qkv_w, b.qkv_b, 3 * cfg.dim, cfg.dim};
    lin[kProj] = {b.proj_w, b.proj_b, cfg.dim, cfg.dim};
    lin[kFc1] = {b.fc1_w, b.fc1_b, cfg.hidden(), cfg.dim};
    lin[kFc2] = {b.fc2_w, b.fc2_b, cfg.dim, cfg.hidden()};
    linears_.push_back(lin);
  }
  if (precision_ == Precision::FP8) {
    ENSURE(fp8_unsupported_reason(cfg, batch).empty(), fp8_unsupported_reason(cfg, batch));
    const size_t widest = std::max(3 * D, H);
    for (auto& block : linears_)
      for (Linear& l : block) {
        param(&l.w8, size_t(l.n) * l.k);
        param(&l.w8t, size_t(l.n) * l.k);
      }
    // The weight gradients' transposed inputs: the LayerNorm outputs' kept codes transposed (a
    // transpose costs less than recomputing them from the statistics), the attention output's
    // kept as such, the GELU output's recomputed (from the pre-GELU activation, in the pass that
    // computes fc1's output gradient).
    work(&x8_, M * widest);
    work(&xt8_, M * D);
    for (int i = 0; i < 2; ++i) work(&dy8_[i], M * widest);
    work(&dy8t_[kQkv], M * 3 * D);
    work(&dy8t_[kProj], M * D);
    work(&dy8t_[kFc1], M * H);
    work(&dy8t_[kFc2], M * D);
    partial = std::max(partial, fp8_cast_partial_floats(M_, static_cast<int>(widest)));
  }
  work(&partial_, partial);
}


// Where one backward's weight gradients run: on the critical path's stream (side null; every
// hand-over a no-op) or on the second stream. fork(): the weight gradients enqueued next wait for
// all the critical path has enqueued so far. read(lin), after lin's weight gradient, and
// before_writing(lin), before the critical path writes that gradient's operands again, order
// the streams the other way (a waited event that was never recorded is passed at once).
struct ViT::WgradLane {
  cudaStream_t main, stream;
  Gemm& gemm;
  const WeightGradStream* side;
  void fork() const {
    if (!side) return;
    CUDA_CHECK(cudaEventRecord(side->forked, main));
    CUDA_CHECK(cudaStreamWaitEvent(stream, side->forked));
    if (side->lag_ns) spin(side->lag_ns, stream);
  }
  void read(Lin lin) const {
    if (side) CUDA_CHECK(cudaEventRecord(side->read[lin], stream));
  }
  void before_writing(Lin lin) const {
    if (side) CUDA_CHECK(cudaStreamWaitEvent(main, side->read[lin]));
  }
};

size_t ViT::parameter_part_begin(int part) const {
  if (part == 0) return 0;
  if (part <= cfg_.depth) return layout_.at(layout_.blocks[part - 1].norm1_w).offset;
  if (part == cfg_.depth + 1) return layout_.at(layout_.norm_w).offset;
  return layout_.total();
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
  refresh_weight_copies(stream);
}

void ViT::refresh_weight_copies(cudaStream_t stream) {
  cast_to_bf16(params_, params_bf16_, layout_.total(), stream);
  cast_fp8_weights(stream);
}

// ---- FP8 products ----

void ViT::fp8_forward(Gemm& gemm, int l, Lin lin, const uint8_t* x8, const float* residual, void* y, DType y_type,
                      cudaStream_t st, float alpha) {
  const Linear& L = linears_[l][lin];
  // Fast accumulation in the forward products only, as Transformer Engine does: the gradients'
  // products keep cuBLASLt's periodic promotion to fp32 (E5M2 carries less precision already).
  gemm.linear_fp8(x8, DType::E4M3, &meta(l, lin, kInput)->scale_inv, L.w8, DType::E4M3,
                  &meta(l, lin, kWeight)->scale_inv, branch_bias(pb(L.b), alpha, st), residual, y, y_type, M_, L.n,
                  L.k, st, 0, /*fast_accum=*/true, alpha);
}

void ViT::fp8_input_grad(Gemm& gemm, int l, Lin lin, const uint8_t* dy8, bf16* dx, cudaStream_t st) {
  // dx[M, k] = dy[M, n] W[n, k]: the K-contiguous operands are dy and W^T.
  const Linear& L = linears_[l][lin];
  gemm.linear_fp8(dy8, DType::E5M2, &meta(l, lin, kOutputGrad)->scale_inv, L.w8t, DType::E4M3,
                  &meta(l, lin, kWeight)->scale_inv, nullptr, nullptr, dx, DType::BF16, M_, L.k, L.n, st);
}

void ViT::fp8_weight_grad(Gemm& gemm, int l, Lin lin, const uint8_t* dy8t, const uint8_t* x8t, cudaStream_t st) {
  // dW[n, k] = dy^T x, contracting over the token rows: dy^T and x^T are the K-contiguous copies.
  const Linear& L = linears_[l][lin];
  float* dW = g(L.w);
  gemm.linear_fp8(dy8t, DType::E5M2, &meta(l, lin, kOutputGrad)->scale_inv, x8t, DType::E4M3,
                  &meta(l, lin, kInput)->scale_inv, nullptr, write_ == GradWrite::Accumulate ? dW : nullptr, dW,
                  DType::F32, L.n, L.k, M_, st);
}

void ViT::bf16_weight_grad(Gemm& gemm, OpTimer& timer, const bf16* dy, const bf16* x, float* dW, float* db, int M,
                           int N, int K, cudaStream_t st, int lddy) {
  { auto t = timer.op(OpKind::Gemm, st); gemm.linear_backward_weight(dy, x, dW, nullptr, M, N, K, st, lddy, write_); }
  if (!db) return;
  // One stream at a time uses bias_partial_: the head's and the patch embedding's run on the
  // critical path before the blocks' weight gradients fork off it and after they join it.
  auto t = timer.op(OpKind::BiasGrad, st);
  colsum(dy, M, N, lddy ? lddy : N, db, bias_partial_, st, write_);
}

// ---- stochastic depth ----

void ViT::draw_drop_path(uint64_t seed, uint64_t stream_id, int64_t first_sample, cudaStream_t st) {
  if (drop_path_ <= 0.0f) return;
  NvtxRange range("drop path masks");
  ::draw_drop_path(drop_scales_, cfg_.depth, B_, drop_path_, seed, stream_id, first_sample, st);
  drop_path_drawn_ = true;
}

const float* ViT::branch_scales(int l, int branch) const {
  if (!drop_path_drawn_ || drop_path_keep(drop_path_, l, cfg_.depth) >= 1.0f) return nullptr;
  return drop_scales_ + static_cast<size_t>(2 * l + branch) * B_;
}

float ViT::branch_alpha(int l, int branch) const {
  return branch_scales(l, branch) ? 1.0f / drop_path_keep(drop_path_, l, cfg_.depth) : 1.0f;
}

const float* ViT::branch_bias(const float* bias, float alpha, cudaStream_t st) {
  if (alpha == 1.0f) return bias;
  scale_vector(bias, alpha, branch_bias_, cfg_.dim, st);
  return branch_bias_;
}

const bf16* ViT::branch_bias(const bf16* bias, float alpha, cudaStream_t st) {
  if (alpha == 1.0f) return bias;
  scale_vector(bias, alpha, branch_bias_bf16_, cfg_.dim, st);
  return branch_bias_bf16_;
}

void ViT::restore_dropped(int l, int branch, const float* before, float* after, cudaStream_t st, OpTimer& timer) {
  const float* scales = branch_scales(l, branch);
  if (!scales) return;
  auto t = timer.op(OpKind::DropPath, st);
  restore_dropped_rows(before, after, scales, M_, T_, cfg_.dim, st);
}

void ViT::unexpected_fp32_read(int t) const {
  throw RuntimeError("internal: " + layout_.at(t).name +
                     " is read as fp32 weights after start-up, which a sharded optimizer does not keep whole "
                     "(run with --shard-optimizer off)");
}

std::vector<std::pair<size_t, size_t>> ViT::freeze_fp32_reads() {
  fp32_reads_frozen_ = true;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t t = 0; t < fp32_read_.size(); ++t)
    if (fp32_read_[t]) ranges.emplace_back(layout_.at(static_cast<int>(t)).offset, layout_.at(static_cast<int>(t)).numel);
  return ranges;
}

void ViT::require_fp8_recipe() const {
  ENSURE(precision_ != Precision::FP8 || fp8_, "ViT: in FP8 the model runs under a recipe (set_fp8), none was set");
}

void ViT::cast_fp8_weights(int first, int count, cudaStream_t st, OpTimer* timer) {
  if (precision_ != Precision::FP8) return;
  require_fp8_recipe();
  NvtxRange range("fp8 weight casts");
  OpTimer untimed(false);
  auto t = (timer ? *timer : untimed).op(OpKind::Fp8Cast, st);
  for (int lin = 0; lin < 4; ++lin) {
    // Where the recipe writes in one pass, one launch casts this layer's weights in every block
    // (the blocks' tensors sit at one stride from each other in every buffer); otherwise each
    // tensor is produced on its own (the current recipe measures its amax first).
    const int l1 = first + std::min(1, count - 1);
    const Linear &L0 = linears_[first][lin], &L1 = linears_[l1][lin];
    const size_t in_stride = pb(L1.w) - pb(L0.w), out_stride = L1.w8 - L0.w8, out_t_stride = L1.w8t - L0.w8t;
    bool uniform = fp8_->one_pass();
    for (int l = 0; l < count && uniform; ++l) {
      const Linear& L = linears_[first + l][lin];
      uniform = size_t(pb(L.w) - pb(L0.w)) == l * in_stride && size_t(L.w8 - L0.w8) == l * out_stride &&
                size_t(L.w8t - L0.w8t) == l * out_t_stride;
    }
    if (uniform) {
      const Fp8Out o0 = fp8_->one_pass_out(fp8_tensor(first, Lin(lin), kWeight), Fp8Kind::E4M3, L0.w8, L0.w8t);
      const Fp8Out o1 = fp8_->one_pass_out(fp8_tensor(l1, Lin(lin), kWeight), Fp8Kind::E4M3, L1.w8, L1.w8t);
      const auto bytes = [](const void* from, const void* to) {
        return static_cast<size_t>(static_cast<const char*>(to) - static_cast<const char*>(from));
      };
      const Fp8Strides strides{out_stride, out_t_stride, bytes(o0.scale, o1.scale),
                               o0.stats ? bytes(o0.stats, o1.stats) : 0};
      cast_to_fp8_batched(pb(L0.w), in_stride, L0.n, L0.k, o0, strides, count, st);
      continue;
    }
    for (int l = first; l < first + count; ++l) {
      const Linear& L = linears_[l][lin];
      produce_fp8(l, Lin(lin), kWeight, L.w8, L.w8t, st, [&](const Fp8Out& o) { cast_to_fp8(pb(L.w), L.n, L.k, o, st); });
    }
  }
}

std::vector<ViT::Fp8TensorGroup> ViT::fp8_tensor_groups() const {
  static const char* kLin[] = {"qkv", "proj", "fc1", "fc2"};
  static const char* kRole[] = {"input  E4M3", "weight E4M3", "grad   E5M2"};
  std::vector<Fp8TensorGroup> groups;
  if (precision_ != Precision::FP8) return groups;
  for (int lin = 0; lin < 4; ++lin)
    for (int role = 0; role < 3; ++role) {
      char name[32];
      std::snprintf(name, sizeof name, "%-4s %s", kLin[lin], kRole[role]);
      Fp8TensorGroup g{name, {}};
      for (int l = 0; l < cfg_.depth; ++l) g.tensors.push_back(fp8_tensor(l, Lin(lin), Role(role)));
      groups.push_back(std::move(g));
    }
  return groups;
}

void ViT::forward(cudaStream_t st, Gemm& gemm, OpTimer& timer, const cudaEvent_t* part_updated) {
  require_fp8_recipe();
  auto await_part = [&](int part) {
    if (part_updated) CUDA_CHECK(cudaStreamWaitEvent(st, part_updated[part]));
  };
  NvtxRange range("forward");
  auto phase = timer.phase(Phase::Forward, st);
  const int D = cfg_.dim, P = cfg_.patches(), BP = B_ * P;
  {
    NvtxRange r("patch_embed");
    const int K = cfg_.patch_dim(), K8 = cfg_.patch_dim_padded();
    { auto t = timer.op(OpKind::Embed, st);
      patchify(images_, patches_, B_, cfg_.channels, cfg_.img, cfg_.patch, K8, st);
      await_part(0);  // an update still running elsewhere: each part before it is read
      if (K8 != K) {  // the weight's rows padded with zeros like the patches' (its bf16 copy changes every step)
        CUDA_CHECK(cudaMemsetAsync(patch_w_padded_, 0, size_t(D) * K8 * sizeof(bf16), st));
        CUDA_CHECK(cudaMemcpy2DAsync(patch_w_padded_, K8 * sizeof(bf16), pb(layout_.patch_w), K * sizeof(bf16),
                                     K * sizeof(bf16), D, cudaMemcpyDeviceToDevice, st));
      } }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(patches_, K8 != K ? patch_w_padded_ : pb(layout_.patch_w), p(layout_.patch_b), nullptr,
                          patch_out_, DType::F32, BP, D, K8, st); }
    { auto t = timer.op(OpKind::Embed, st);
      embed_forward(patch_out_, p(layout_.cls_token), p(layout_.pos_embed), resid(0), B_, T_, D, st); }
  }
  for (int l = 0; l < cfg_.depth; ++l) {
    NvtxRange r(nvtx_forward_[l].c_str());
    await_part(l + 1);
    if (precision_ == Precision::FP8) forward_block_fp8(l, st, gemm, timer);
    else forward_block_bf16(l, st, gemm, timer);
  }
  {
    NvtxRange r("head and loss");
    await_part(cfg_.depth + 1);
    // Only the class token reaches the head, so the final LayerNorm runs on those B rows alone.
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_forward(resid(2 * cfg_.depth), T_ * D, p(layout_.norm_w), p(layout_.norm_b), lnf_, lnf_mean_,
                        lnf_rstd_, B_, D, kLayerNormEps, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(lnf_, pb(layout_.head_w), p(layout_.head_b), nullptr, logits_, DType::F32, B_,
                          cfg_.classes, D, st, classes_ld_); }
    { auto t = timer.op(OpKind::Loss, st);
      softmax_xent(logits_, labels_, B_, cfg_.classes, classes_ld_, row_loss_, loss_, dlogits_, st, label_smoothing_,
                   batches_summed_); }
  }
}

void ViT::attention_fwd(const BlockActs& a, cudaStream_t st) {
  if (cudnn_forward_) cudnn_forward_->forward(a.qkv, a.attn, a.lse, B_, T_, cfg_.heads, cfg_.head_dim(), st);
  else attention_forward(a.qkv, a.attn, a.lse, B_, T_, cfg_.heads, cfg_.head_dim(), st, attention_forward_);
}

void ViT::attention_bwd(const BlockActs& a, cudaStream_t st) {
  if (cudnn_backward_)
    cudnn_backward_->backward(a.qkv, a.attn, dattn_, a.lse, dqkv_, B_, T_, cfg_.heads, cfg_.head_dim(), st);
  else
    attention_backward(a.qkv, a.attn, dattn_, a.lse, delta_, dqkv_, B_, T_, cfg_.heads, cfg_.head_dim(), st,
                       attention_backward_);
}

// x_mid = x + proj(attn(LN1(x))), x_out = x_mid + fc2(gelu(fc1(LN2(x_mid)))); the residual adds
// ride in the GEMMs' epilogues, the residual stream is fp32. Under stochastic depth each branch is
// scaled per sample (kernels/drop_path.h).
void ViT::forward_block_bf16(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  const int D = cfg_.dim, Hd = cfg_.hidden();
  const BlockParams& w = layout_.blocks[l];
  const BlockActs& a = acts_[l];
  const std::array<Linear, 4>& L = linears_[l];
  const float *x = resid(2 * l), *x_mid = resid(2 * l + 1);
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_forward(x, D, p(w.norm1_w), p(w.norm1_b), a.ln1, a.ln1_mean, a.ln1_rstd, M_, D, kLayerNormEps, st); }
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(a.ln1, pb(L[kQkv].w), pb(L[kQkv].b), nullptr, a.qkv, DType::BF16, M_, 3 * D, D, st); }
  { auto t = timer.op(OpKind::Attention, st);
    attention_fwd(a, st); }
  const float attn_alpha = branch_alpha(l, 0), mlp_alpha = branch_alpha(l, 1);
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(a.attn, pb(L[kProj].w), branch_bias(p(L[kProj].b), attn_alpha, st), x, resid(2 * l + 1),
                        DType::F32, M_, D, D, st, 0, attn_alpha); }
  restore_dropped(l, 0, x, resid(2 * l + 1), st, timer);
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_forward(x_mid, D, p(w.norm2_w), p(w.norm2_b), a.ln2, a.ln2_mean, a.ln2_rstd, M_, D, kLayerNormEps, st); }
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(a.ln2, pb(L[kFc1].w), pb(L[kFc1].b), nullptr, a.fc1, DType::BF16, M_, Hd, D, st); }
  { auto t = timer.op(OpKind::Gelu, st); gelu_forward(a.fc1, gelu_, static_cast<size_t>(M_) * Hd, st); }
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(gelu_, pb(L[kFc2].w), branch_bias(p(L[kFc2].b), mlp_alpha, st), x_mid, resid(2 * l + 2),
                        DType::F32, M_, D, Hd, st, 0, mlp_alpha); }
  restore_dropped(l, 1, x_mid, resid(2 * l + 2), st, timer);
}

// The same block with the four Linear layers in FP8: each GEMM input is written in FP8 by the
// kernel that computes it (LayerNorm, GELU; the attention output is cast). The LayerNorm codes
// are kept for the backward, which transposes them; the attention output's cast also writes the
// transposed copy, kept; the GELU output's transposed copy is recomputed in the backward.
void ViT::forward_block_fp8(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  const int D = cfg_.dim, Hd = cfg_.hidden();
  const BlockParams& w = layout_.blocks[l];
  const BlockActs& a = acts_[l];
  const float *x = resid(2 * l), *x_mid = resid(2 * l + 1);
  { auto t = timer.op(OpKind::LayerNorm, st);
    produce_fp8(l, kQkv, kInput, a.ln1_8, nullptr, st, [&](const Fp8Out& o) {
      layernorm_forward_fp8(x, D, p(w.norm1_w), p(w.norm1_b), o, a.ln1_mean, a.ln1_rstd, M_, D, kLayerNormEps, st);
    }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_forward(gemm, l, kQkv, a.ln1_8, nullptr, a.qkv, DType::BF16, st); }
  { auto t = timer.op(OpKind::Attention, st);
    attention_fwd(a, st); }
  { auto t = timer.op(OpKind::Fp8Cast, st);  // the attention output stays in bf16 for its own backward
    produce_fp8(l, kProj, kInput, x8_, a.attn8t, st,
                [&](const Fp8Out& o) { cast_to_fp8(a.attn, M_, D, o, st); }); }
  { auto t = timer.op(OpKind::Gemm, st);
    fp8_forward(gemm, l, kProj, x8_, x, resid(2 * l + 1), DType::F32, st, branch_alpha(l, 0)); }
  restore_dropped(l, 0, x, resid(2 * l + 1), st, timer);
  { auto t = timer.op(OpKind::LayerNorm, st);
    produce_fp8(l, kFc1, kInput, a.ln2_8, nullptr, st, [&](const Fp8Out& o) {
      layernorm_forward_fp8(x_mid, D, p(w.norm2_w), p(w.norm2_b), o, a.ln2_mean, a.ln2_rstd, M_, D, kLayerNormEps,
                            st);
    }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_forward(gemm, l, kFc1, a.ln2_8, nullptr, a.fc1, DType::BF16, st); }
  { auto t = timer.op(OpKind::Gelu, st);
    produce_fp8(l, kFc2, kInput, x8_, nullptr, st,
                [&](const Fp8Out& o) { gelu_forward_fp8(a.fc1, M_, Hd, o, st); }); }
  { auto t = timer.op(OpKind::Gemm, st);
    fp8_forward(gemm, l, kFc2, x8_, x_mid, resid(2 * l + 2), DType::F32, st, branch_alpha(l, 1)); }
  restore_dropped(l, 1, x_mid, resid(2 * l + 2), st, timer);
}

void ViT::backward(cudaStream_t st, Gemm& gemm, OpTimer& timer, const std::function<void(size_t)>& grads_ready_from,
                   const WeightGradStream* wgrad, GradWrite write) {
  require_fp8_recipe();
  write_ = write;
  auto ready_from = [&](int tensor) {
    if (grads_ready_from) grads_ready_from(tensor < 0 ? 0 : layout_.at(tensor).offset);
  };
  NvtxRange range("backward");
  auto phase = timer.phase(Phase::Backward, st);
  const int D = cfg_.dim, BP = B_ * cfg_.patches();
  {
    NvtxRange r("head backward");
    bf16_weight_grad(gemm, timer, dlogits_, lnf_, g(layout_.head_w), g(layout_.head_b), B_, cfg_.classes, D, st,
                     classes_ld_);
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_input(dlogits_, pb(layout_.head_w), dfeat_, B_, cfg_.classes, D, st, classes_ld_); }
    // The residual gradient is zero but on the class-token rows.
    CUDA_CHECK(cudaMemsetAsync(dresid_, 0, static_cast<size_t>(M_) * D * sizeof(float), st));
    CUDA_CHECK(cudaMemsetAsync(dresid_bf16_, 0, static_cast<size_t>(M_) * D * sizeof(bf16), st));
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_backward(dfeat_, resid(2 * cfg_.depth), T_ * D, p(layout_.norm_w), lnf_mean_, lnf_rstd_, dresid_,
                         dresid_bf16_, g(layout_.norm_w), g(layout_.norm_b), partial_, B_, D, st, write_,
                         SampleScale{branch_scales(cfg_.depth - 1, 1), 1}); }
  }
  ready_from(layout_.norm_w);
  const WeightGradStream* side = wgrad && wgrad->stream ? wgrad : nullptr;
  const WgradLane wl{st, side ? side->stream : st, wgrad && wgrad->gemm ? *wgrad->gemm : gemm, side};
  auto lag = [&] {
    if (side && side->critical_lag_ns) spin(side->critical_lag_ns, st);
  };
  for (int l = cfg_.depth - 1; l >= 0; --l) {
    NvtxRange r(nvtx_backward_[l].c_str());
    lag();
    if (precision_ == Precision::FP8) backward_block_fp8(l, st, gemm, timer, wl);
    else backward_block_bf16(l, st, gemm, timer, wl);
    if (!side) {
      ready_from(layout_.blocks[l].norm1_w);
    } else if (grads_ready_from) {
      // A block's gradients are handed on a block later, once their stream has written them (by
      // then it has, unless it fell a block behind). The critical path's waits before it writes
      // the last block's operands again imply this one; it is kept so that the hand-over does not
      // rest on which buffers the blocks happen to share.
      CUDA_CHECK(cudaEventRecord(side->block_done[l & 1], side->stream));
      if (l + 1 < cfg_.depth) {
        CUDA_CHECK(cudaStreamWaitEvent(st, side->block_done[(l + 1) & 1]));
        ready_from(layout_.blocks[l + 1].norm1_w);
      }
    }
  }
  if (side) {  // the first block's: the two streams join
    CUDA_CHECK(cudaEventRecord(side->block_done[0], side->stream));
    CUDA_CHECK(cudaStreamWaitEvent(st, side->block_done[0]));
    ready_from(layout_.blocks[0].norm1_w);
  }
  {
    NvtxRange r("patch_embed backward");
    lag();
    // x[b, t] = (t == 0 ? cls : patch_out[b, t - 1]) + pos[t]: pos gets the batch sum of dresid,
    // cls its token-0 row (also under accumulation: the sums' row 0).
    { auto t = timer.op(OpKind::Embed, st);
      colsum(dresid_, B_, T_ * D, T_ * D, g(layout_.pos_embed), partial_, st, write_);
      CUDA_CHECK(cudaMemcpyAsync(g(layout_.cls_token), g(layout_.pos_embed), D * sizeof(float),
                                 cudaMemcpyDeviceToDevice, st)); }
    { auto t = timer.op(OpKind::Embed, st); embed_backward(dresid_, dpatch_, B_, T_, D, st); }
    const int K = cfg_.patch_dim(), K8 = cfg_.patch_dim_padded();
    // The padded gradient is this product's alone, so it accumulates as the gradient itself.
    bf16_weight_grad(gemm, timer, dpatch_, patches_, K8 != K ? patch_grad_padded_ : g(layout_.patch_w),
                     g(layout_.patch_b), BP, D, K8, st);
    if (K8 != K) {  // the padding's columns (zero) left behind
      auto t = timer.op(OpKind::Embed, st);
      CUDA_CHECK(cudaMemcpy2DAsync(g(layout_.patch_w), K * sizeof(float), patch_grad_padded_, K8 * sizeof(float),
                                   K * sizeof(float), D, cudaMemcpyDeviceToDevice, st));
    }
  }
  ready_from(-1);
}

// On entry dresid holds the gradient of the block's output (fp32, and its bf16 copy); on exit,
// of its input. The LayerNorm backwards add their input gradients into it. Each weight gradient
// is enqueued on wl's stream after the input gradient that shares its output gradient, so that
// on a stream of its own it runs beside the memory-bound kernels that follow on the critical path.
void ViT::backward_block_bf16(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer, const WgradLane& wl) {
  const int D = cfg_.dim, Hd = cfg_.hidden();
  const BlockParams& w = layout_.blocks[l];
  const BlockActs& a = acts_[l];
  const std::array<Linear, 4>& L = linears_[l];
  auto weight_grad = [&](Lin lin, const bf16* dy, const bf16* x, bool with_bias) {
    bf16_weight_grad(wl.gemm, timer, dy, x, g(L[lin].w), with_bias ? g(L[lin].b) : nullptr, M_, L[lin].n, L[lin].k,
                     wl.stream);
    wl.read(lin);
  };
  // MLP: dresid is the gradient of fc2's output. The GELU output is recomputed in the pass that
  // applies GELU's derivative rather than kept (one activation of [M, hidden] less).
  wl.before_writing(kFc1);  // dhidden_
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_backward_input(dresid_bf16_, pb(L[kFc2].w), dhidden_, M_, D, Hd, st); }
  wl.before_writing(kFc2);  // gelu_
  { auto t = timer.op(OpKind::Gelu, st);
    gelu_backward(dhidden_, a.fc1, dhidden_, gelu_, g(L[kFc1].b), partial_, M_, Hd, st, write_); }
  { auto t = timer.op(OpKind::Gemm, st); gemm.linear_backward_input(dhidden_, pb(L[kFc1].w), dln_, M_, Hd, D, st); }
  wl.fork();
  weight_grad(kFc2, dresid_bf16_, gelu_, true);
  weight_grad(kFc1, dhidden_, a.ln2, false);  // fc1's bias: above
  wl.before_writing(kProj);  // dmid_bf16_
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_backward(dln_, resid(2 * l + 1), D, p(w.norm2_w), a.ln2_mean, a.ln2_rstd, dresid_, dmid_bf16_,
                       g(w.norm2_w), g(w.norm2_b), partial_, M_, D, st, write_, SampleScale{branch_scales(l, 0), T_}); }
  // Attention: dresid is now the gradient of the block's middle state, and of proj's output.
  { auto t = timer.op(OpKind::Gemm, st); gemm.linear_backward_input(dmid_bf16_, pb(L[kProj].w), dattn_, M_, D, D, st); }
  wl.fork();
  weight_grad(kProj, dmid_bf16_, a.attn, true);
  wl.before_writing(kQkv);  // dqkv_
  { auto t = timer.op(OpKind::Attention, st);
    attention_bwd(a, st); }
  { auto t = timer.op(OpKind::Gemm, st); gemm.linear_backward_input(dqkv_, pb(L[kQkv].w), dln_, M_, 3 * D, D, st); }
  wl.fork();
  weight_grad(kQkv, dqkv_, a.ln1, true);
  wl.before_writing(kFc2);  // dresid_bf16_, read by this block's fc2 weight gradient
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_backward(dln_, resid(2 * l), D, p(w.norm1_w), a.ln1_mean, a.ln1_rstd, dresid_, dresid_bf16_,
                       g(w.norm1_w), g(w.norm1_b), partial_, M_, D, st, write_,
                       SampleScale{l > 0 ? branch_scales(l - 1, 1) : nullptr, T_}); }
}

// The same in FP8. Each output gradient is cast once into both FP8 copies (dy for the input
// gradient, dy^T for the weight gradient) with its column sums, the bias gradient, in the same
// pass; fc1's comes straight out of the GELU backward. The weight gradients' transposed inputs
// are the forward's own codes: LayerNorm's transposed into xt8_ (on wl's stream), the attention
// output's kept transposed, fc2's input recomputed into x8_ by the GELU backward with the
// forward's scale.
void ViT::backward_block_fp8(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer, const WgradLane& wl) {
  const int D = cfg_.dim, Hd = cfg_.hidden();
  const BlockParams& w = layout_.blocks[l];
  const BlockActs& a = acts_[l];
  const std::array<Linear, 4>& L = linears_[l];
  auto output_grad = [&](Lin lin, const bf16* dy, int n) {
    wl.before_writing(lin);  // dy8t_[lin] (fc2's: and x8_, which the GELU backward writes)
    auto t = timer.op(OpKind::Fp8Cast, st);
    produce_fp8(l, lin, kOutputGrad, dy8_[0], dy8t_[lin], st,
                [&](const Fp8Out& o) { cast_to_fp8(dy, M_, n, o, st, g(L[lin].b), partial_, write_); });
  };
  auto weight_grad = [&](Lin lin, const uint8_t* x8t) {
    { auto t = timer.op(OpKind::Gemm, wl.stream); fp8_weight_grad(wl.gemm, l, lin, dy8t_[lin], x8t, wl.stream); }
    wl.read(lin);
  };
  auto transpose = [&](const uint8_t* x8) {
    auto t = timer.op(OpKind::Fp8Cast, wl.stream);
    transpose_fp8(x8, M_, D, xt8_, wl.stream);
  };
  // MLP: dresid is the gradient of fc2's output.
  output_grad(kFc2, dresid_bf16_, D);
  { auto t = timer.op(OpKind::Gemm, st); fp8_input_grad(gemm, l, kFc2, dy8_[0], dhidden_, st); }
  wl.before_writing(kFc1);
  { auto t = timer.op(OpKind::Gelu, st);  // fc1's output gradient, and fc2's input recomputed
    produce_fp8(l, kFc1, kOutputGrad, dy8_[1], dy8t_[kFc1], st, [&](const Fp8Out& o) {
      gelu_backward_fp8(dhidden_, a.fc1, M_, Hd, o, recompute_fp8(l, kFc2, x8_), g(L[kFc1].b),
                        partial_, st, write_);
    }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_input_grad(gemm, l, kFc1, dy8_[1], dln_, st); }
  wl.fork();
  weight_grad(kFc2, x8_);
  transpose(a.ln2_8);
  weight_grad(kFc1, xt8_);
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_backward(dln_, resid(2 * l + 1), D, p(w.norm2_w), a.ln2_mean, a.ln2_rstd, dresid_, dmid_bf16_,
                       g(w.norm2_w), g(w.norm2_b), partial_, M_, D, st, write_, SampleScale{branch_scales(l, 0), T_}); }
  // Attention: dresid is now the gradient of the block's middle state, and of proj's output.
  output_grad(kProj, dmid_bf16_, D);
  { auto t = timer.op(OpKind::Gemm, st); fp8_input_grad(gemm, l, kProj, dy8_[0], dattn_, st); }
  wl.fork();
  weight_grad(kProj, a.attn8t);
  { auto t = timer.op(OpKind::Attention, st);
    attention_bwd(a, st); }
  output_grad(kQkv, dqkv_, 3 * D);
  { auto t = timer.op(OpKind::Gemm, st); fp8_input_grad(gemm, l, kQkv, dy8_[0], dln_, st); }
  wl.fork();
  transpose(a.ln1_8);
  weight_grad(kQkv, xt8_);
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_backward(dln_, resid(2 * l), D, p(w.norm1_w), a.ln1_mean, a.ln1_rstd, dresid_, dresid_bf16_,
                       g(w.norm1_w), g(w.norm1_b), partial_, M_, D, st, write_,
                       SampleScale{l > 0 ? branch_scales(l - 1, 1) : nullptr, T_}); }
}
