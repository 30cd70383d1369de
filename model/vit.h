// The ViT's training step, written out: forward, loss and backward over the kernels and the
// GEMM entry point. The only place that knows the architecture. Memory comes from the engine's
// arenas; nothing is allocated and nothing synchronises inside forward() and backward().
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/arena.h"
#include "kernels/gemm.h"
#include "kernels/op_timer.h"
#include "kernels/attention.h"
#include "kernels/fp8.h"
#include "kernels/fp8_scaling.h"
#include "kernels/optimizer.h"
#include "model/config.h"
#include "model/params.h"

class CudnnAttention;  // kernels/cudnn_attention.h

using bf16 = __nv_bfloat16;

// bf16: bf16 GEMMs. fp8: the four Linear layers of every block run all three of their GEMMs in
// FP8 (E4M3 weights and activations, E5M2 output gradients, per-tensor scales on the device);
// everything else as in bf16.
enum class Precision { BF16, FP8 };

struct Fp8Options {
  bool current = false;  // scale from the tensor's own amax (else delayed: the amax history's)
  int history = 16;      // delayed: amaxes remembered
  int margin = 0;        // scale = fp8_max / amax / 2^margin
};

struct ModelArenas {
  Arena params{"parameters (fp32 master, bf16 and fp8 copies)"};
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
  ViT(const ViTConfig& cfg, int batch, ModelArenas& arenas, Precision precision = Precision::BF16,
      Fp8Options fp8 = {});
  ~ViT();
  // Empty if this batch and shape can run in FP8, else the reason (token count and features
  // must be multiples of 16: Hopper's FP8 GEMMs).
  static std::string fp8_unsupported_reason(const ViTConfig& cfg, int batch);

  const ViTConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  // [offset, offset + numel) of every tensor the kernels have read as fp32 master weights (not
  // through the bf16 copy) so far; after one forward and backward, all of them. A sharded
  // optimizer keeps these whole on every rank (biases, LayerNorm weights, embeddings: ~0.1%).
  // From then on a kernel reading any other tensor in fp32 is an error (it would read weights
  // that are stale outside this rank's shares), not a silent wrong result.
  std::vector<std::pair<size_t, size_t>> freeze_fp32_reads();
  int batch() const { return B_; }

  // timm's initialisation, drawn on the device from the seed; also writes the bf16 copy and
  // zeroes gradients and momentum.
  void init_params(uint64_t seed, cudaStream_t stream);
  // After the fp32 master weights were written from outside (tests, loading): refresh their bf16
  // copy and, in FP8, their FP8 copies.
  void refresh_weight_copies(cudaStream_t stream);

  // FP8 bookkeeping around a step (no-ops in bf16): begin_step clears the step's non-finite
  // flag; end_step updates the delayed recipe's scales from the step's amaxes and counts a
  // skipped step; after the optimizer, cast_fp8_weights makes the next forward's weight copies.
  // The optimizer skips the update when *fp8_step_non_finite() is set. prime_fp8_scales runs one
  // forward and backward with current scaling to start the delayed recipe from real amaxes, and
  // returns false (doing nothing) where there is no delayed recipe to start.
  void begin_fp8_step(cudaStream_t stream);
  void end_fp8_step(cudaStream_t stream);
  void cast_fp8_weights(cudaStream_t stream, OpTimer* timer = nullptr);
  bool prime_fp8_scales(cudaStream_t stream, Gemm& gemm, OpTimer& timer);
  const int* fp8_step_non_finite() const { return fp8_step_non_finite_; }
  const int* fp8_skipped_steps() const { return fp8_skipped_; }  // [total, in a row]
  // The FP8 scaling state as it lives on the device (checkpoints): the metas, and the counters.
  Fp8Meta* fp8_metas() const { return fp8_metas_; }
  int fp8_meta_count() const { return precision_ == Precision::FP8 ? static_cast<int>(linears_.size()) * 12 : 0; }
  int* fp8_skip_counters() const { return fp8_skipped_; }
  void reset_fp8_counters(cudaStream_t stream);
  // Data parallel: reduce(data, count, stream) takes the maximum over the ranks in place. With
  // it, every rank's scales come from the amaxes of the whole global batch (the current
  // recipe's per tensor, the delayed recipe's once a step in end_fp8_step), and every rank
  // skips the same steps.
  void set_amax_reducer(std::function<void(float*, int, cudaStream_t)> reduce) { amax_reduce_ = std::move(reduce); }
  // The loss's label smoothing (PyTorch's CrossEntropyLoss(label_smoothing=...)).
  void set_label_smoothing(float s) { label_smoothing_ = s; }
  // Which attention kernels run (kernels/attention.h; Auto by default).
  void set_attention_forward(AttentionForward kind) { attention_forward_ = kind; }
  void set_attention_backward(AttentionBackward kind) { attention_backward_ = kind; }
  // cuDNN's fused attention instead of the engine's kernels in the forward, the backward or both
  // (each side's statistics serve the other's backward); not owned, prepared for this model's
  // shape by the caller.
  void set_cudnn_attention(CudnnAttention* cudnn, bool forward, bool backward) {
    cudnn_forward_ = forward ? cudnn : nullptr;
    cudnn_backward_ = backward ? cudnn : nullptr;
  }
  // Data-parallel ranks whose gradients are summed: the loss gradient is divided by them too, so
  // the sum is the global batch's mean gradient.
  void set_gradient_ranks(int ranks) { gradient_ranks_ = ranks; }
  // A second stream (on; off by default here, vit_train's --second-stream), for the work off the
  // critical path; the same results bit for bit, given the same GEMM algorithms. The backward's
  // weight gradients run on it (in FP8 with the transposes of the kept LayerNorm codes they
  // read): each block's input gradients and the memory-bound kernels between them are the
  // backward's critical path, and the weight gradients only feed the optimizer, so their GEMMs
  // can run while LayerNorm, GELU and attention wait on memory. They get a Gemm of their own (a
  // workspace of gemm_workspace bytes), tuned in the first backward after this, which still runs
  // them in line so that they are timed alone. And update() runs on it, beside the next forward.
  // Every call of forward, backward, update and the rest takes the same stream, the critical path.
  void set_second_stream(bool on, size_t gemm_workspace, bool autotune);
  // Tests: one stream falls behind the other by ns nanoseconds (a spinning kernel), so that a
  // missing wait between them shows as a wrong result. The second stream: at each fork to it and
  // each update (against a missing wait of the critical path for it); the critical path: at each
  // block of the backward and at the embeddings' (against a missing wait of the second stream).
  enum class Lagging { SecondStream, CriticalPath };
  void set_second_stream_lag(uint64_t ns, Lagging which);
  // The optimizer step (SGD with momentum; clipped by grad_norm, skipped in FP8 when the step was
  // bad) over every parameter, then in FP8 the next forward's weight copies. With the second
  // stream it runs there, part by part in the order the next forward reads them (the embeddings,
  // each block, the final norm and head), and the forward waits for each part before it reads it
  // (in line with the FP8 current recipe, whose weight casts reduce their amaxes and flag a bad
  // step on the critical path). await_update makes st wait for all of it: before anything but the
  // next forward reads or writes the weights, the gradients or the FP8 state.
  void update(const SgdHyper& h, bool first_step, const float* grad_norm, cudaStream_t st, OpTimer* timer = nullptr);
  void await_update(cudaStream_t st) const;
  // Off for evaluation: FP8 casts use the training scales and record no amax.
  void set_fp8_recording(bool on) { fp8_recording_ = on; }
  // --fp8-stats: while on, the FP8 producers count the values that underflow to zero and that
  // saturate (a little slower); the counts start from zero when it is switched on.
  void set_fp8_counting(bool on, cudaStream_t stream);
  // One line per tensor kind (qkv/proj/fc1/fc2 x input/weight/output gradient) over the blocks:
  // scale, last amax, and the underflow and saturation fractions counted since counting began.
  // Synchronises the stream.
  std::string fp8_stats_table(cudaStream_t stream) const;
  Precision precision() const { return precision_; }

  // Forward and loss on images [B, C, H, W] fp32 and labels [B]; leaves loss() and logits().
  void forward(cudaStream_t stream, Gemm& gemm, OpTimer& timer);
  // Backward of the last forward: every parameter gradient into grads() (overwritten). The
  // gradients are finished from the end of the layout towards its start (head, blocks from the
  // last, patch embedding); grads_ready_from(offset), if given, is called (in stream order) each
  // time every gradient at or past offset is final: a data-parallel run starts its all-reduces.
  void backward(cudaStream_t stream, Gemm& gemm, OpTimer& timer,
                const std::function<void(size_t)>& grads_ready_from = {});

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
    // FP8 keeps ln1 and ln2 as the FP8 codes its GEMMs read (ln1_8, ln2_8: the backward transposes
    // them for the weight gradients), and the attention output's transposed codes (attn8t).
    uint8_t *ln1_8 = nullptr, *ln2_8 = nullptr, *attn8t = nullptr;
  };
  // One Linear layer of a block: its parameter tensors and, in FP8, its weight's two copies.
  enum Lin { kQkv, kProj, kFc1, kFc2 };
  enum Role { kInput, kWeight, kOutputGrad };  // the three FP8 tensors of a Linear layer
  struct Linear {
    int w, b, n, k;  // weight [n, k] and bias [n] tensor indices
    uint8_t *w8 = nullptr, *w8t = nullptr;
  };
  // A block's attention, forward (qkv -> attn, lse) and backward (dattn_ -> dqkv_): the engine's
  // kernels or cuDNN's (set_cudnn_attention).
  void attention_fwd(const BlockActs& a, cudaStream_t st);
  void attention_bwd(const BlockActs& a, cudaStream_t st);
  void forward_block_bf16(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer);
  void forward_block_fp8(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer);
  struct SecondStream;  // set_second_stream's stream, Gemm and events (vit.cpp)
  struct WgradLane;    // where one backward's weight gradients run, and its hand-overs (vit.cpp)
  void backward_block_bf16(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer, const WgradLane& wl);
  void backward_block_fp8(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer, const WgradLane& wl);

  // FP8: each tensor is made by the kernel that computes it. produce_fp8 runs such a producer,
  // launch(const Fp8Out&), under the recipe: delayed = one pass with the scale from past amaxes,
  // recording this one; current = an amax-only pass, the scale update, then the writing pass.
  template <class Launch>
  void produce_fp8(Fp8Meta* m, Fp8Kind kind, uint8_t* out, uint8_t* out_t, cudaStream_t st, Launch&& launch);
  // The backward's recompute of a forward input's transposed copy: the forward's scale, so the
  // forward's codes; nothing recorded.
  Fp8Out recompute_fp8(Fp8Meta* m, uint8_t* out_t) const { return {Fp8Kind::E4M3, &m->scale, nullptr, out_t}; }
  // The three FP8 products of a Linear layer. x8 [M, k] and w8 make y [M, n]; dy8 [M, n] and w8t
  // make dx [M, k]; dy8t [n, M] and x8t [k, M] make dW [n, k] (fp32).
  void fp8_forward(Gemm& gemm, int l, Lin lin, const uint8_t* x8, const float* residual, void* y, DType y_type,
                   cudaStream_t st);
  void fp8_input_grad(Gemm& gemm, int l, Lin lin, const uint8_t* dy8, bf16* dx, cudaStream_t st);
  void fp8_weight_grad(Gemm& gemm, int l, Lin lin, const uint8_t* dy8t, const uint8_t* x8t, cudaStream_t st);
  Fp8Meta* meta(int l, Lin lin, Role role) const { return fp8_metas_ + (l * 4 + lin) * 3 + role; }
  unsigned long long* stats(const Fp8Meta* m) const {
    return fp8_counting_ ? fp8_stats_ + 3 * (m - fp8_metas_) : nullptr;
  }

  // Marks tensor t as read in fp32 (see freeze_fp32_reads).
  const float* p(int t) const {
    if (fp32_reads_frozen_ && !fp32_read_[t]) unexpected_fp32_read(t);
    fp32_read_[t] = 1;
    return params_ + layout_.at(t).offset;
  }
  [[noreturn]] void unexpected_fp32_read(int t) const;
  const bf16* pb(int t) const { return params_bf16_ + layout_.at(t).offset; }
  float* g(int t) const { return grads_ + layout_.at(t).offset; }
  float* resid(int i) const { return resid_ + static_cast<size_t>(i) * M_ * cfg_.dim; }

  ViTConfig cfg_;
  ParamLayout layout_;
  int B_, T_, M_, classes_ld_;
  Precision precision_;
  Fp8Options fp8_;
  std::vector<std::array<Linear, 4>> linears_;
  Fp8Meta* fp8_metas_ = nullptr;
  int *fp8_step_non_finite_ = nullptr, *fp8_skipped_ = nullptr;
  float* fp8_amax_scratch_ = nullptr;
  bool fp8_recording_ = true, fp8_counting_ = false;
  float label_smoothing_ = 0.0f;
  AttentionForward attention_forward_ = AttentionForward::Auto;
  AttentionBackward attention_backward_ = AttentionBackward::Auto;
  CudnnAttention *cudnn_forward_ = nullptr, *cudnn_backward_ = nullptr;
  int gradient_ranks_ = 1;
  unsigned long long* fp8_stats_ = nullptr;  // [underflow, saturated, values] per meta, while counting
  std::function<void(float*, int, cudaStream_t)> amax_reduce_;
  float* fp8_amax_reduce_ = nullptr;  // the step's amaxes and a bad-step flag, gathered for the reduce
  // FP8 operands of the products at hand: a forward input (in the backward, the GELU output
  // recomputed), the kept LayerNorm codes transposed (xt8_), two output gradients (fc2's lives
  // on while fc1's is made), and each Linear's output gradient transposed (dy8t_, by Lin: a
  // weight gradient on its own stream may read it while the next ones are made).
  uint8_t *x8_ = nullptr, *xt8_ = nullptr, *dy8_[2] = {}, *dy8t_[4] = {};
  std::unique_ptr<SecondStream> second_;
  // The first parameter of part `part` of update(): the embeddings (0), block part - 1, the head.
  size_t update_part_begin(int part) const;
  void await_update_part(int part, cudaStream_t st) const;
  // The FP8 weight copies of blocks [first, first + count).
  void cast_block_fp8_weights(int first, int count, cudaStream_t st, OpTimer* timer);

  float *params_, *grads_, *momentum_;
  bf16* params_bf16_;
  mutable std::vector<char> fp32_read_;  // per tensor: read by p()
  bool fp32_reads_frozen_ = false;
  float *images_;
  int* labels_;
  // forward, saved for backward
  bf16* patches_;  // [B * P, patch_dim_padded]
  // Where the patch dim is not a multiple of 8: the patch embedding's bf16 weight and fp32 gradient
  // with rows padded like the patches' (the parameter itself keeps timm's [D, C, p, p])
  bf16* patch_w_padded_ = nullptr;
  float* patch_grad_padded_ = nullptr;
  float* patch_out_;
  float* resid_;  // 2 * depth + 1 residual-stream states [M, D] fp32
  std::vector<BlockActs> acts_;
  std::vector<std::string> nvtx_forward_, nvtx_backward_;  // "block i forward/backward", made once
  float *lnf_mean_, *lnf_rstd_, *logits_, *row_loss_, *loss_;
  bf16* lnf_;
  // backward temporaries, reused block after block
  float *dresid_, *partial_, *delta_;
  // dresid_'s bf16 copy: of a block's output (dresid_bf16_), of its middle state (dmid_bf16_)
  bf16 *dresid_bf16_, *dmid_bf16_, *dhidden_, *dln_, *dattn_, *dqkv_, *dlogits_, *dfeat_, *dpatch_;
  bf16* gelu_;  // bf16: the current block's GELU output, forward and (recomputed) backward
};
