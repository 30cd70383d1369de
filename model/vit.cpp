#include "model/vit.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/check.h"
#include "kernels/cudnn_attention.h"
#include "kernels/nvtx.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "kernels/embed.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
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

ViT::ViT(const ViTConfig& cfg, int batch, ModelArenas& a, Precision precision, Fp8Options fp8)
    : cfg_(cfg), layout_(cfg), B_(batch), T_(cfg.tokens()), M_(batch * cfg.tokens()),
      classes_ld_((cfg.classes + 7) / 8 * 8), precision_(precision), fp8_(fp8) {
  const size_t D = cfg.dim, H = cfg.hidden(), M = M_, B = B_, P = cfg.patches();
  const size_t n = layout_.total();
  fp32_read_.assign(layout_.tensors().size(), 0);
  a.params.add(&params_, n);
  a.params.add(&params_bf16_, n);
  a.grads.add(&grads_, n);
  a.optimizer.add(&momentum_, n);

  a.workspace.add(&images_, B * cfg.channels * cfg.img * cfg.img);
  a.workspace.add(&labels_, B);

  Arena& s = a.activations;
  s.add(&patches_, B * P * cfg.patch_dim_padded());
  s.add(&patch_out_, B * P * D);
  s.add(&resid_, (2 * cfg.depth + 1) * M * D);
  acts_.resize(cfg.depth);
  for (int l = 0; l < cfg.depth; ++l) {
    nvtx_forward_.push_back("block " + std::to_string(l) + " forward");
    nvtx_backward_.push_back("block " + std::to_string(l) + " backward");
  }
  for (BlockActs& b : acts_) {
    if (precision_ == Precision::BF16) s.add(&b.ln1, M * D);  // FP8 keeps its FP8 codes instead (ln1_8)
    s.add(&b.ln1_mean, M);
    s.add(&b.ln1_rstd, M);
    s.add(&b.qkv, M * 3 * D);
    s.add(&b.attn, M * D);
    s.add(&b.lse, M * cfg.heads);
    if (precision_ == Precision::BF16) s.add(&b.ln2, M * D);
    s.add(&b.ln2_mean, M);
    s.add(&b.ln2_rstd, M);
    s.add(&b.fc1, M * H);
    if (precision_ == Precision::FP8) {
      s.add(&b.ln1_8, M * D);
      s.add(&b.ln2_8, M * D);
      s.add(&b.attn8t, M * D);
    }
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
  w.add(&dmid_bf16_, M * D);
  w.add(&dhidden_, M * H);
  if (precision_ == Precision::BF16) w.add(&gelu_, M * H);
  w.add(&dln_, M * D);
  w.add(&dattn_, M * D);
  w.add(&dqkv_, M * 3 * D);
  w.add(&delta_, attention_backward_workspace_floats(B, T_, cfg.heads, cfg.head_dim()));
  w.add(&dlogits_, B * classes_ld_);
  w.add(&dfeat_, B * D);
  w.add(&dpatch_, B * P * D);
  if (cfg.patch_dim_padded() != cfg.patch_dim()) {  // the patch embedding's weight and gradient, padded rows
    w.add(&patch_w_padded_, D * cfg.patch_dim_padded());
    w.add(&patch_grad_padded_, D * cfg.patch_dim_padded());
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
        a.params.add(&l.w8, size_t(l.n) * l.k);
        a.params.add(&l.w8t, size_t(l.n) * l.k);
      }
    a.optimizer.add(&fp8_metas_, linears_.size() * 12);
    a.optimizer.add(&fp8_stats_, linears_.size() * 12 * 3);
    a.optimizer.add(&fp8_step_non_finite_, 1);
    a.optimizer.add(&fp8_skipped_, 2);  // skipped steps, and in a row
    a.optimizer.add(&fp8_amax_scratch_, 1);
    a.optimizer.add(&fp8_amax_reduce_, linears_.size() * 12 + 1);
    // The weight gradients' transposed inputs: the LayerNorm outputs' kept codes transposed, the
    // attention output's kept as such, the GELU output's recomputed (from the pre-GELU activation,
    // in the pass that computes fc1's output gradient). Recomputing LayerNorm's from the
    // statistics (fp32 rows) took 33 us a call against the transpose's 13, and the attention
    // output's 21 us: 1.5 GiB of activations at ViT-H for 1.3 ms a step (BENCHMARKS 35).
    w.add(&x8_, M * widest);
    w.add(&xt8_, M * D);
    for (int i = 0; i < 2; ++i) w.add(&dy8_[i], M * widest);
    w.add(&dy8t_[kQkv], M * 3 * D);
    w.add(&dy8t_[kProj], M * D);
    w.add(&dy8t_[kFc1], M * H);
    w.add(&dy8t_[kFc2], M * D);
    partial = std::max(partial, fp8_cast_partial_floats(M_, static_cast<int>(widest)));
  }
  w.add(&partial_, partial);
}

// set_second_stream's stream and Gemm, and its events. The backward's: forked (the weight
// gradients enqueued next wait for the critical path so far), read[lin] (lin's weight gradient
// has read its operands), block_done by the block's parity (its weight gradients are written).
// update()'s: updated[part], and a copy of the step's skip flag.
struct ViT::SecondStream {
  SecondStream(size_t workspace, bool autotune, int parts) : gemm(workspace, autotune), updated(parts) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (cudaEvent_t* e : events()) CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    CUDA_CHECK(cudaMalloc(&skip, sizeof(int)));
  }
  ~SecondStream() {
    cudaStreamSynchronize(stream);  // nothing of it may still run on what is freed next
    cudaFree(skip);
    for (cudaEvent_t* e : events()) cudaEventDestroy(*e);
    cudaStreamDestroy(stream);
  }
  SecondStream(const SecondStream&) = delete;
  SecondStream& operator=(const SecondStream&) = delete;
  std::vector<cudaEvent_t*> events() {
    std::vector<cudaEvent_t*> e{&forked, &read[0], &read[1], &read[2], &read[3], &block_done[0], &block_done[1]};
    for (cudaEvent_t& u : updated) e.push_back(&u);
    return e;
  }
  Gemm gemm;
  cudaStream_t stream = nullptr;
  cudaEvent_t forked = nullptr, read[4] = {}, block_done[2] = {};
  std::vector<cudaEvent_t> updated;
  int* skip = nullptr;
  uint64_t lag_ns = 0, critical_lag_ns = 0;  // set_second_stream_lag
  bool update_pending = false;               // an update() not yet waited for in full
  // Its GEMMs were planned (and tuned, alone) in a backward that ran them in line.
  bool tuned() const { return gemm.plans_cached() > 0; }
  // What this stream enqueues next waits for all that `from` has enqueued so far (and, in the
  // tests, lags lag_ns behind it).
  void fork(cudaStream_t from) {
    CUDA_CHECK(cudaEventRecord(forked, from));
    CUDA_CHECK(cudaStreamWaitEvent(stream, forked));
    if (lag_ns) spin(lag_ns, stream);
  }
};

// Where one backward's weight gradients run: on the critical path's stream (side null; every
// hand-over a no-op) or on the second stream. fork(): the weight gradients enqueued next wait for
// all the critical path has enqueued so far. read(lin), after lin's weight gradient, and
// before_writing(lin), before the critical path writes that gradient's operands again, order
// the streams the other way (a waited event that was never recorded is passed at once).
struct ViT::WgradLane {
  cudaStream_t main, stream;
  Gemm& gemm;
  SecondStream* side;
  void fork() const {
    if (side) side->fork(main);
  }
  void read(Lin lin) const {
    if (side) CUDA_CHECK(cudaEventRecord(side->read[lin], stream));
  }
  void before_writing(Lin lin) const {
    if (side) CUDA_CHECK(cudaStreamWaitEvent(main, side->read[lin]));
  }
};

ViT::~ViT() = default;

void ViT::set_second_stream(bool on, size_t gemm_workspace, bool autotune) {
  second_.reset();  // its destructor waits for its stream
  if (on) second_ = std::make_unique<SecondStream>(gemm_workspace, autotune, cfg_.depth + 2);
}

void ViT::set_second_stream_lag(uint64_t ns, Lagging which) {
  if (second_) (which == Lagging::SecondStream ? second_->lag_ns : second_->critical_lag_ns) = ns;
}

size_t ViT::update_part_begin(int part) const {
  if (part == 0) return 0;
  if (part <= cfg_.depth) return layout_.at(layout_.blocks[part - 1].norm1_w).offset;
  if (part == cfg_.depth + 1) return layout_.at(layout_.norm_w).offset;
  return layout_.total();
}

void ViT::await_update_part(int part, cudaStream_t st) const {
  if (second_ && second_->update_pending) CUDA_CHECK(cudaStreamWaitEvent(st, second_->updated[part]));
}

void ViT::await_update(cudaStream_t st) const {
  await_update_part(cfg_.depth + 1, st);  // the last part: the stream runs them in order
  if (second_) second_->update_pending = false;
}

void ViT::update(const SgdHyper& h, bool first_step, const float* grad_norm, cudaStream_t st, OpTimer* timer) {
  OpTimer untimed(false);
  OpTimer& tm = timer ? *timer : untimed;
  const bool fp8 = precision_ == Precision::FP8;
  await_update(st);  // a previous update not yet waited for (none, between training steps)
  if (!second_ || (fp8 && fp8_.current)) {
    { auto t = tm.op(OpKind::Optimizer, st);
      sgd_momentum_step(params_, momentum_, grads_, params_bf16_, layout_.total(), h, first_step, st,
                        fp8_step_non_finite_, grad_norm); }
    cast_fp8_weights(st, timer);
    return;
  }
  // The next step's begin_fp8_step clears the skip flag while this update may still read it: a
  // copy. (grad_norm is written again only after the next forward, which waits for the update.)
  if (fp8) CUDA_CHECK(cudaMemcpyAsync(second_->skip, fp8_step_non_finite_, sizeof(int), cudaMemcpyDeviceToDevice, st));
  second_->fork(st);
  const cudaStream_t ss = second_->stream;
  for (int part = 0; part < cfg_.depth + 2; ++part) {
    const size_t begin = update_part_begin(part), n = update_part_begin(part + 1) - begin;
    { auto t = tm.op(OpKind::Optimizer, ss);
      sgd_momentum_step(params_ + begin, momentum_ + begin, grads_ + begin, params_bf16_ + begin, n, h, first_step, ss,
                        fp8 ? second_->skip : nullptr, grad_norm); }
    if (fp8 && part >= 1 && part <= cfg_.depth) cast_block_fp8_weights(part - 1, 1, ss, timer);
    CUDA_CHECK(cudaEventRecord(second_->updated[part], ss));
  }
  second_->update_pending = true;
}

void ViT::init_params(uint64_t seed, cudaStream_t stream) {
  await_update(stream);
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
  if (precision_ == Precision::FP8) {
    std::vector<Fp8Meta> metas(linears_.size() * 12);
    for (size_t i = 0; i < metas.size(); ++i) metas[i].fp8_max = i % 3 == 2 ? 57344.0f : 448.0f;  // dy: E5M2
    CUDA_CHECK(cudaMemcpyAsync(fp8_metas_, metas.data(), metas.size() * sizeof(Fp8Meta), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemsetAsync(fp8_step_non_finite_, 0, sizeof(int), stream));
    CUDA_CHECK(cudaMemsetAsync(fp8_skipped_, 0, 2 * sizeof(int), stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));  // metas goes out of scope
  }
  refresh_weight_copies(stream);
}

void ViT::refresh_weight_copies(cudaStream_t stream) {
  await_update(stream);
  cast_to_bf16(params_, params_bf16_, layout_.total(), stream);
  cast_fp8_weights(stream);
}

// ---- FP8 producers and products ----

template <class Launch>
void ViT::produce_fp8(Fp8Meta* m, Fp8Kind kind, uint8_t* out, uint8_t* out_t, cudaStream_t st, Launch&& launch) {
  if (!fp8_recording_) {  // evaluation: the training scales, and nothing recorded
    launch(Fp8Out{kind, &m->scale, out, out_t, fp8_amax_scratch_});
    return;
  }
  if (fp8_.current) {  // the tensor's own amax first (from zero), its scale from that alone
    CUDA_CHECK(cudaMemsetAsync(&m->amax, 0, sizeof(float), st));
    launch(Fp8Out{kind, nullptr, nullptr, nullptr, &m->amax});
    if (amax_reduce_) {  // the global batch's amax; a NaN as +inf, which a maximum keeps
      fp8_nonfinite_to_inf(&m->amax, 1, st);
      amax_reduce_(&m->amax, 1, st);
    }
    fp8_update_scales(m, 1, 1, fp8_.margin, fp8_step_non_finite_, st);
    launch(Fp8Out{kind, &m->scale, out, out_t, fp8_amax_scratch_, stats(m)});
    return;
  }
  launch(Fp8Out{kind, &m->scale, out, out_t, &m->amax, stats(m)});  // recorded for end_fp8_step
}

void ViT::fp8_forward(Gemm& gemm, int l, Lin lin, const uint8_t* x8, const float* residual, void* y, DType y_type,
                      cudaStream_t st) {
  const Linear& L = linears_[l][lin];
  // Fast accumulation in the forward products only, as Transformer Engine does: the gradients'
  // products keep cuBLASLt's periodic promotion to fp32 (E5M2 carries less precision already).
  gemm.linear_fp8(x8, DType::E4M3, &meta(l, lin, kInput)->scale_inv, L.w8, DType::E4M3,
                  &meta(l, lin, kWeight)->scale_inv, pb(L.b), residual, y, y_type, M_, L.n, L.k, st, 0,
                  /*fast_accum=*/true);
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
  gemm.linear_fp8(dy8t, DType::E5M2, &meta(l, lin, kOutputGrad)->scale_inv, x8t, DType::E4M3,
                  &meta(l, lin, kInput)->scale_inv, nullptr, nullptr, g(L.w), DType::F32, L.n, L.k, M_, st);
}

// ---- FP8 bookkeeping of a step ----

void ViT::reset_fp8_counters(cudaStream_t st) {
  if (precision_ != Precision::FP8) return;
  CUDA_CHECK(cudaMemsetAsync(fp8_step_non_finite_, 0, sizeof(int), st));
  CUDA_CHECK(cudaMemsetAsync(fp8_skipped_, 0, 2 * sizeof(int), st));
}

void ViT::begin_fp8_step(cudaStream_t st) {
  if (precision_ == Precision::FP8) CUDA_CHECK(cudaMemsetAsync(fp8_step_non_finite_, 0, sizeof(int), st));
}

void ViT::end_fp8_step(cudaStream_t st) {
  if (precision_ != Precision::FP8) return;
  if (amax_reduce_) {  // one all-reduce a step: the amaxes of the global batch, and whether any rank's step is bad
    const int n = static_cast<int>(linears_.size()) * 12;
    fp8_gather_amax(fp8_metas_, n, fp8_step_non_finite_, loss_, fp8_amax_reduce_, st);
    amax_reduce_(fp8_amax_reduce_, n + 1, st);
    fp8_scatter_amax(fp8_amax_reduce_, fp8_metas_, n, fp8_step_non_finite_, st);
  }
  if (!fp8_.current)
    fp8_update_scales(fp8_metas_, static_cast<int>(linears_.size()) * 12, fp8_.history, fp8_.margin,
                      fp8_step_non_finite_, st);
  fp8_tally_skip(loss_, fp8_step_non_finite_, fp8_skipped_, st);
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

void ViT::cast_fp8_weights(cudaStream_t st, OpTimer* timer) { cast_block_fp8_weights(0, cfg_.depth, st, timer); }

void ViT::cast_block_fp8_weights(int first, int count, cudaStream_t st, OpTimer* timer) {
  if (precision_ != Precision::FP8) return;
  NvtxRange range("fp8 weight casts");
  OpTimer untimed(false);
  auto t = (timer ? *timer : untimed).op(OpKind::Fp8Cast, st);
  for (int lin = 0; lin < 4; ++lin) {
    // Delayed: one launch casts this layer's weights in every block (the blocks' tensors sit at
    // one stride from each other in every buffer); current needs each tensor's amax first.
    const Linear &L0 = linears_[first][lin], &L1 = linears_[first + std::min(1, count - 1)][lin];
    const size_t in_stride = pb(L1.w) - pb(L0.w), out_stride = L1.w8 - L0.w8, out_t_stride = L1.w8t - L0.w8t;
    bool uniform = fp8_recording_ && !fp8_.current;
    for (int l = 0; l < count && uniform; ++l) {
      const Linear& L = linears_[first + l][lin];
      uniform = size_t(pb(L.w) - pb(L0.w)) == l * in_stride && size_t(L.w8 - L0.w8) == l * out_stride &&
                size_t(L.w8t - L0.w8t) == l * out_t_stride;
    }
    if (uniform) {
      Fp8Meta* m = meta(first, Lin(lin), kWeight);
      const Fp8Strides strides{out_stride, out_t_stride, 12 * sizeof(Fp8Meta), 12 * 3 * sizeof(unsigned long long)};
      cast_to_fp8_batched(pb(L0.w), in_stride, L0.n, L0.k,
                          Fp8Out{Fp8Kind::E4M3, &m->scale, L0.w8, L0.w8t, &m->amax, stats(m)}, strides, count, st);
      continue;
    }
    for (int l = first; l < first + count; ++l) {
      const Linear& L = linears_[l][lin];
      produce_fp8(meta(l, Lin(lin), kWeight), Fp8Kind::E4M3, L.w8, L.w8t, st,
                  [&](const Fp8Out& o) { cast_to_fp8(pb(L.w), L.n, L.k, o, st); });
    }
  }
}

void ViT::set_fp8_counting(bool on, cudaStream_t st) {
  if (precision_ != Precision::FP8) return;
  if (on && !fp8_counting_) {
    await_update(st);  // its weight casts may be counting
    CUDA_CHECK(cudaMemsetAsync(fp8_stats_, 0, linears_.size() * 12 * 3 * sizeof(unsigned long long), st));
  }
  fp8_counting_ = on;
}

std::string ViT::fp8_stats_table(cudaStream_t st) const {
  if (precision_ != Precision::FP8) return "";
  const size_t n = linears_.size() * 12;
  std::vector<Fp8Meta> metas(n);
  std::vector<unsigned long long> counts(3 * n);
  await_update(st);  // its weight casts write their amaxes and counts
  CUDA_CHECK(cudaMemcpyAsync(metas.data(), fp8_metas_, n * sizeof(Fp8Meta), cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaMemcpyAsync(counts.data(), fp8_stats_, counts.size() * sizeof(counts[0]), cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaStreamSynchronize(st));
  static const char* kLin[] = {"qkv", "proj", "fc1", "fc2"};
  static const char* kRole[] = {"input  E4M3", "weight E4M3", "grad   E5M2"};
  char line[256];
  std::string out = "  fp8 tensor        blocks  scale min..max         last amax max  underflow  saturated\n";
  for (int lin = 0; lin < 4; ++lin)
    for (int role = 0; role < 3; ++role) {
      float smin = INFINITY, smax = 0, amax = 0;
      double under = 0, sat = 0, seen = 0;
      for (int l = 0; l < cfg_.depth; ++l) {
        const size_t i = meta(l, Lin(lin), Role(role)) - fp8_metas_;
        smin = std::min(smin, metas[i].scale);
        smax = std::max(smax, metas[i].scale);
        amax = std::max(amax, metas[i].history[0]);
        under += counts[3 * i];
        sat += counts[3 * i + 1];
        seen += counts[3 * i + 2];
      }
      const double u = seen > 0 ? under / seen : NAN, z = seen > 0 ? sat / seen : NAN;
      std::snprintf(line, sizeof line, "  %-4s %s  %6d  %9.3g..%-9.3g  %13.4g  %8.4f%%  %8.4f%%\n", kLin[lin],
                    kRole[role], cfg_.depth, smin, smax, amax, 100 * u, 100 * z);
      out += line;
    }
  return out;
}

bool ViT::prime_fp8_scales(cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  await_update(st);
  if (precision_ != Precision::FP8 || fp8_.current) return false;
  // Delayed scaling needs past amaxes; at the start there are none (scale 1 would flush most
  // gradients to zero). One forward and backward with current scaling fills every history.
  fp8_.current = true;
  cast_fp8_weights(st);
  forward(st, gemm, timer);
  backward(st, gemm, timer);
  fp8_.current = false;
  CUDA_CHECK(cudaMemsetAsync(fp8_step_non_finite_, 0, sizeof(int), st));
  cast_fp8_weights(st);  // with the primed scales, recording the weights' amaxes for step 0's update
  return true;
}

void ViT::forward(cudaStream_t st, Gemm& gemm, OpTimer& timer) {
  NvtxRange range("forward");
  auto phase = timer.phase(Phase::Forward, st);
  const int D = cfg_.dim, P = cfg_.patches(), BP = B_ * P;
  {
    NvtxRange r("patch_embed");
    const int K = cfg_.patch_dim(), K8 = cfg_.patch_dim_padded();
    { auto t = timer.op(OpKind::Embed, st);
      patchify(images_, patches_, B_, cfg_.channels, cfg_.img, cfg_.patch, K8, st);
      await_update_part(0, st);  // a pending update() on the second stream: each part before it is read
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
    await_update_part(l + 1, st);
    if (precision_ == Precision::FP8) forward_block_fp8(l, st, gemm, timer);
    else forward_block_bf16(l, st, gemm, timer);
  }
  {
    NvtxRange r("head and loss");
    await_update(st);
    // Only the class token reaches the head, so the final LayerNorm runs on those B rows alone.
    { auto t = timer.op(OpKind::LayerNorm, st);
      layernorm_forward(resid(2 * cfg_.depth), T_ * D, p(layout_.norm_w), p(layout_.norm_b), lnf_, lnf_mean_,
                        lnf_rstd_, B_, D, kLayerNormEps, st); }
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_forward(lnf_, pb(layout_.head_w), p(layout_.head_b), nullptr, logits_, DType::F32, B_,
                          cfg_.classes, D, st, classes_ld_); }
    { auto t = timer.op(OpKind::Loss, st);
      softmax_xent(logits_, labels_, B_, cfg_.classes, classes_ld_, row_loss_, loss_, dlogits_, st, label_smoothing_,
                   gradient_ranks_); }
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
// ride in the GEMMs' epilogues, the residual stream is fp32.
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
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(a.attn, pb(L[kProj].w), p(L[kProj].b), x, resid(2 * l + 1), DType::F32, M_, D, D, st); }
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_forward(x_mid, D, p(w.norm2_w), p(w.norm2_b), a.ln2, a.ln2_mean, a.ln2_rstd, M_, D, kLayerNormEps, st); }
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(a.ln2, pb(L[kFc1].w), pb(L[kFc1].b), nullptr, a.fc1, DType::BF16, M_, Hd, D, st); }
  { auto t = timer.op(OpKind::Gelu, st); gelu_forward(a.fc1, gelu_, static_cast<size_t>(M_) * Hd, st); }
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_forward(gelu_, pb(L[kFc2].w), p(L[kFc2].b), x_mid, resid(2 * l + 2), DType::F32, M_, D, Hd, st); }
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
    produce_fp8(meta(l, kQkv, kInput), Fp8Kind::E4M3, a.ln1_8, nullptr, st, [&](const Fp8Out& o) {
      layernorm_forward_fp8(x, D, p(w.norm1_w), p(w.norm1_b), o, a.ln1_mean, a.ln1_rstd, M_, D, kLayerNormEps, st);
    }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_forward(gemm, l, kQkv, a.ln1_8, nullptr, a.qkv, DType::BF16, st); }
  { auto t = timer.op(OpKind::Attention, st);
    attention_fwd(a, st); }
  { auto t = timer.op(OpKind::Fp8Cast, st);  // the attention output stays in bf16 for its own backward
    produce_fp8(meta(l, kProj, kInput), Fp8Kind::E4M3, x8_, a.attn8t, st,
                [&](const Fp8Out& o) { cast_to_fp8(a.attn, M_, D, o, st); }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_forward(gemm, l, kProj, x8_, x, resid(2 * l + 1), DType::F32, st); }
  { auto t = timer.op(OpKind::LayerNorm, st);
    produce_fp8(meta(l, kFc1, kInput), Fp8Kind::E4M3, a.ln2_8, nullptr, st, [&](const Fp8Out& o) {
      layernorm_forward_fp8(x_mid, D, p(w.norm2_w), p(w.norm2_b), o, a.ln2_mean, a.ln2_rstd, M_, D, kLayerNormEps,
                            st);
    }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_forward(gemm, l, kFc1, a.ln2_8, nullptr, a.fc1, DType::BF16, st); }
  { auto t = timer.op(OpKind::Gelu, st);
    produce_fp8(meta(l, kFc2, kInput), Fp8Kind::E4M3, x8_, nullptr, st,
                [&](const Fp8Out& o) { gelu_forward_fp8(a.fc1, M_, Hd, o, st); }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_forward(gemm, l, kFc2, x8_, x_mid, resid(2 * l + 2), DType::F32, st); }
}

void ViT::backward(cudaStream_t st, Gemm& gemm, OpTimer& timer, const std::function<void(size_t)>& grads_ready_from) {
  auto ready_from = [&](int tensor) {
    if (grads_ready_from) grads_ready_from(tensor < 0 ? 0 : layout_.at(tensor).offset);
  };
  NvtxRange range("backward");
  auto phase = timer.phase(Phase::Backward, st);
  const int D = cfg_.dim, BP = B_ * cfg_.patches();
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
  ready_from(layout_.norm_w);
  SecondStream* side = second_ && second_->tuned() ? second_.get() : nullptr;
  const WgradLane wl{st, side ? side->stream : st, second_ ? second_->gemm : gemm, side};
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
      // then it has, unless it fell a block behind). Today the critical path's waits before it
      // writes the last block's operands again already imply this one (a test with the wait
      // removed passed, BENCHMARKS.md 38); it is kept so that the hand-over does not rest on which
      // buffers the blocks happen to share.
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
    // cls its token-0 row.
    { auto t = timer.op(OpKind::Embed, st);
      colsum(dresid_, B_, T_ * D, T_ * D, g(layout_.pos_embed), partial_, st);
      CUDA_CHECK(cudaMemcpyAsync(g(layout_.cls_token), g(layout_.pos_embed), D * sizeof(float),
                                 cudaMemcpyDeviceToDevice, st)); }
    { auto t = timer.op(OpKind::Embed, st); embed_backward(dresid_, dpatch_, B_, T_, D, st); }
    const int K = cfg_.patch_dim(), K8 = cfg_.patch_dim_padded();
    { auto t = timer.op(OpKind::Gemm, st);
      gemm.linear_backward_weight(dpatch_, patches_, K8 != K ? patch_grad_padded_ : g(layout_.patch_w),
                                  g(layout_.patch_b), BP, D, K8, st);
      if (K8 != K)  // the padding's columns (zero) left behind
        CUDA_CHECK(cudaMemcpy2DAsync(g(layout_.patch_w), K * sizeof(float), patch_grad_padded_, K8 * sizeof(float),
                                     K * sizeof(float), D, cudaMemcpyDeviceToDevice, st)); }
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
    { auto t = timer.op(OpKind::Gemm, wl.stream);
      wl.gemm.linear_backward_weight(dy, x, g(L[lin].w), with_bias ? g(L[lin].b) : nullptr, M_, L[lin].n, L[lin].k,
                                     wl.stream); }
    wl.read(lin);
  };
  // MLP: dresid is the gradient of fc2's output. The GELU output is recomputed in the pass that
  // applies GELU's derivative (4 GiB less for ViT-H at batch 64).
  wl.before_writing(kFc1);  // dhidden_
  { auto t = timer.op(OpKind::Gemm, st);
    gemm.linear_backward_input(dresid_bf16_, pb(L[kFc2].w), dhidden_, M_, D, Hd, st); }
  wl.before_writing(kFc2);  // gelu_
  { auto t = timer.op(OpKind::Gelu, st);
    gelu_backward(dhidden_, a.fc1, dhidden_, gelu_, g(L[kFc1].b), partial_, M_, Hd, st); }
  { auto t = timer.op(OpKind::Gemm, st); gemm.linear_backward_input(dhidden_, pb(L[kFc1].w), dln_, M_, Hd, D, st); }
  wl.fork();
  weight_grad(kFc2, dresid_bf16_, gelu_, true);
  weight_grad(kFc1, dhidden_, a.ln2, false);  // fc1's bias: above
  wl.before_writing(kProj);  // dmid_bf16_
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_backward(dln_, resid(2 * l + 1), D, p(w.norm2_w), a.ln2_mean, a.ln2_rstd, dresid_, dmid_bf16_,
                       g(w.norm2_w), g(w.norm2_b), partial_, M_, D, st); }
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
                       g(w.norm1_w), g(w.norm1_b), partial_, M_, D, st); }
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
    produce_fp8(meta(l, lin, kOutputGrad), Fp8Kind::E5M2, dy8_[0], dy8t_[lin], st,
                [&](const Fp8Out& o) { cast_to_fp8(dy, M_, n, o, st, g(L[lin].b), partial_); });
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
    produce_fp8(meta(l, kFc1, kOutputGrad), Fp8Kind::E5M2, dy8_[1], dy8t_[kFc1], st, [&](const Fp8Out& o) {
      gelu_backward_fp8(dhidden_, a.fc1, M_, Hd, o, recompute_fp8(meta(l, kFc2, kInput), x8_), g(L[kFc1].b),
                        partial_, st);
    }); }
  { auto t = timer.op(OpKind::Gemm, st); fp8_input_grad(gemm, l, kFc1, dy8_[1], dln_, st); }
  wl.fork();
  weight_grad(kFc2, x8_);
  transpose(a.ln2_8);
  weight_grad(kFc1, xt8_);
  { auto t = timer.op(OpKind::LayerNorm, st);
    layernorm_backward(dln_, resid(2 * l + 1), D, p(w.norm2_w), a.ln2_mean, a.ln2_rstd, dresid_, dmid_bf16_,
                       g(w.norm2_w), g(w.norm2_b), partial_, M_, D, st); }
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
                       g(w.norm1_w), g(w.norm1_b), partial_, M_, D, st); }
}
