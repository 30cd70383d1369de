// The ViT's training step, written out: forward, loss and backward over the kernels and the
// GEMM entry point. The only place that knows the architecture. It declares its buffers in a
// MemoryRequest (the caller allocates them), runs on the streams and events it is handed, and
// asks the FP8 recipe (model/fp8_tensors.h) how each FP8 tensor is written: it creates no
// stream, allocates nothing and never synchronises.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "kernels/fp8.h"
#include "kernels/fp8_scaling.h"
#include "kernels/gemm.h"
#include "kernels/op_timer.h"
#include "model/config.h"
#include "model/fp8_tensors.h"
#include "model/memory_request.h"
#include "model/params.h"

class CudnnAttention;  // kernels/cudnn_attention.h

using bf16 = __nv_bfloat16;

// Where the backward's weight-gradient products run: with their own Gemm (its own workspace),
// in line on the critical path's stream (stream null), or on a second stream, beside the
// memory-bound kernels that follow each input gradient on the critical path. The stream and the
// events that order the two streams both ways are made and owned by the caller
// (engine/second_stream.h).
struct WeightGradStream {
  Gemm* gemm = nullptr;
  cudaStream_t stream = nullptr;
  // forked: recorded on the critical path before weight gradients are enqueued; read[lin]:
  // lin's weight gradient has read its operands; block_done[parity]: a block's weight gradients
  // are written.
  cudaEvent_t forked = nullptr, read[4] = {}, block_done[2] = {};
  // Tests: at each hand-over the second stream (lag_ns) or the critical path (critical_lag_ns)
  // spins this long, so that a missing wait shows as a wrong result.
  uint64_t lag_ns = 0, critical_lag_ns = 0;
};

class ViT {
 public:
  // Declares every buffer in memory; the pointers are valid once the caller has placed it.
  ViT(const ViTConfig& cfg, int batch, MemoryRequest& memory, Precision precision = Precision::BF16);
  // Empty if this batch and shape can run in FP8, else the reason (token count and features
  // must be multiples of 16: Hopper's FP8 GEMMs).
  static std::string fp8_unsupported_reason(const ViTConfig& cfg, int batch);

  const ViTConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  int batch() const { return B_; }
  Precision precision() const { return precision_; }
  // [offset, offset + numel) of every tensor the kernels have read as fp32 master weights (not
  // through the bf16 copy) so far; after one forward and backward, all of them. A sharded
  // optimizer keeps these whole on every rank (biases, LayerNorm weights, embeddings: ~0.1%).
  // From then on a kernel reading any other tensor in fp32 is an error (it would read weights
  // that are stale outside this rank's shares), not a silent wrong result.
  std::vector<std::pair<size_t, size_t>> freeze_fp32_reads();

  // The FP8 tensors, numbered for the recipe: each block's four Linear layers' input, weight
  // and output gradient (the last in E5M2, the others in E4M3).
  int fp8_tensor_count() const { return precision_ == Precision::FP8 ? fp8_tensors_of(cfg_) : 0; }
  static int fp8_tensors_of(const ViTConfig& cfg) { return cfg.depth * 12; }
  Fp8Kind fp8_tensor_kind(int tensor) const { return tensor % 3 == kOutputGrad ? Fp8Kind::E5M2 : Fp8Kind::E4M3; }
  bool fp8_tensor_is_weight(int tensor) const { return tensor % 3 == kWeight; }
  // For reports: the tensors of one Linear layer kind and role over the blocks, under a name.
  struct Fp8TensorGroup {
    std::string name;
    std::vector<int> tensors;
  };
  std::vector<Fp8TensorGroup> fp8_tensor_groups() const;
  // The recipe the FP8 tensors are written under; set before anything runs in FP8 (not owned).
  void set_fp8(Fp8Tensors* fp8) { fp8_ = fp8; }

  // The parameters in the parts an optimizer may update one by one, in the order the forward
  // reads them: the embeddings (part 0), each block, the final norm and head.
  int parameter_parts() const { return cfg_.depth + 2; }
  size_t parameter_part_begin(int part) const;

  // timm's initialisation, drawn on the device from the seed; zeroes the gradients and writes
  // the weight copies.
  void init_params(uint64_t seed, cudaStream_t stream);
  // After the fp32 master weights were written from outside (tests, loading): refresh their bf16
  // copy and, in FP8, their FP8 copies.
  void refresh_weight_copies(cudaStream_t stream);
  // FP8: the next forward's weight copies, of every block or of blocks [first, first + count).
  void cast_fp8_weights(cudaStream_t stream, OpTimer* timer = nullptr) { cast_fp8_weights(0, cfg_.depth, stream, timer); }
  void cast_fp8_weights(int first, int count, cudaStream_t stream, OpTimer* timer = nullptr);

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
  // The batches whose gradients are summed into one optimizer step (data-parallel ranks x
  // accumulated micro-batches): the loss gradient is divided by their count too, so that the sum
  // is the global batch's mean gradient.
  void set_batches_summed(int batches) { batches_summed_ = batches; }

  // Stochastic depth (timm's drop_path_rate; 0, the default, is off): see kernels/drop_path.h.
  void set_drop_path(float rate) { drop_path_ = rate; }
  float drop_path() const { return drop_path_; }
  // The per-sample masks of the training forwards and backwards that follow, drawn on the device
  // (draw_drop_path: the same seed, stream and first sample draw the same masks, so a resumed run
  // draws what the uninterrupted one drew). After clear_drop_path() (an evaluation), no branch is
  // dropped until the next draw.
  void draw_drop_path(uint64_t seed, uint64_t stream_id, int64_t first_sample, cudaStream_t stream);
  void clear_drop_path() { drop_path_drawn_ = false; }
  // [depth][2][batch]: the last draw's scales (0 or 1 / keep) of each block's attention and MLP
  // branch, per sample.
  const float* drop_path_scales() const { return drop_scales_; }

  // Forward and loss on images [B, C, H, W] fp32 and labels [B]; leaves loss() and logits().
  // part_updated (optional): an update of the parameters still running elsewhere; the forward
  // waits for part_updated[p] before it reads part p.
  void forward(cudaStream_t stream, Gemm& gemm, OpTimer& timer, const cudaEvent_t* part_updated = nullptr);
  // Backward of the last forward: every parameter gradient into grads(), written over what is
  // there or, for the micro-batches after an optimizer step's first, added to it (write). The
  // gradients are finished from the end of the layout towards its start (head, blocks from the
  // last, patch embedding); grads_ready_from(offset), if given, is called (in stream order) each
  // time every gradient at or past offset is final: a data-parallel run starts its all-reduces.
  // wgrad: where the weight gradients run (by default in line, with gemm).
  void backward(cudaStream_t stream, Gemm& gemm, OpTimer& timer,
                const std::function<void(size_t)>& grads_ready_from = {}, const WeightGradStream* wgrad = nullptr,
                GradWrite write = GradWrite::Overwrite);

  // The batch the next forward reads.
  float* images() const { return images_; }
  int* labels() const { return labels_; }
  // Flat buffers in layout() order (layout().total() elements).
  float* params() const { return params_; }
  bf16* params_bf16() const { return params_bf16_; }
  float* grads() const { return grads_; }
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
  struct WgradLane;  // where one backward's weight gradients run, and its hand-overs (vit.cpp)
  // A block's attention, forward (qkv -> attn, lse) and backward (dattn_ -> dqkv_): the engine's
  // kernels or cuDNN's (set_cudnn_attention).
  void attention_fwd(const BlockActs& a, cudaStream_t st);
  void attention_bwd(const BlockActs& a, cudaStream_t st);
  void forward_block_bf16(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer);
  void forward_block_fp8(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer);
  void backward_block_bf16(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer, const WgradLane& wl);
  void backward_block_fp8(int l, cudaStream_t st, Gemm& gemm, OpTimer& timer, const WgradLane& wl);

  // FP8: each tensor is made by the kernel that computes it, launch(const Fp8Out&), run under
  // the recipe.
  int fp8_tensor(int l, Lin lin, Role role) const { return (l * 4 + lin) * 3 + role; }
  void require_fp8_recipe() const;
  Fp8Meta* meta(int l, Lin lin, Role role) const { return fp8_->meta(fp8_tensor(l, lin, role)); }
  template <class Launch>
  void produce_fp8(int l, Lin lin, Role role, uint8_t* out, uint8_t* out_t, cudaStream_t st, Launch&& launch) {
    const int t = fp8_tensor(l, lin, role);
    fp8_->produce(t, fp8_tensor_kind(t), out, out_t, st, launch);
  }
  // The backward's recompute of a forward input's transposed copy: the forward's scale, so the
  // forward's codes; nothing recorded.
  Fp8Out recompute_fp8(int l, Lin lin, uint8_t* out_t) const {
    return {Fp8Kind::E4M3, &meta(l, lin, kInput)->scale, nullptr, out_t};
  }
  // The three FP8 products of a Linear layer. x8 [M, k] and w8 make y [M, n]; dy8 [M, n] and w8t
  // make dx [M, k]; dy8t [n, M] and x8t [k, M] make dW [n, k] (fp32).
  // alpha (stochastic depth: 1 / keep) scales the product and its bias.
  void fp8_forward(Gemm& gemm, int l, Lin lin, const uint8_t* x8, const float* residual, void* y, DType y_type,
                   cudaStream_t st, float alpha = 1.0f);
  void fp8_input_grad(Gemm& gemm, int l, Lin lin, const uint8_t* dy8, bf16* dx, cudaStream_t st);
  void fp8_weight_grad(Gemm& gemm, int l, Lin lin, const uint8_t* dy8t, const uint8_t* x8t, cudaStream_t st);
  // A bf16 weight gradient dW = dy^T x and its bias gradient db = dy's column sums (db may be
  // null), written or added as the backward's write_ says. The column sums are the engine's own
  // pass (kernels/reduce.h), not cuBLASLt's bias-gradient epilogue, which runs as a slower kernel
  // of its own.
  void bf16_weight_grad(Gemm& gemm, OpTimer& timer, const bf16* dy, const bf16* x, float* dW, float* db, int M, int N,
                        int K, cudaStream_t st, int lddy = 0);

  // Stochastic depth of block l's branch (0 the attention's, 1 the MLP's): its per-sample scales,
  // or null where no sample can be dropped (off, not drawn, or keep 1: the first block).
  const float* branch_scales(int l, int branch) const;
  float branch_alpha(int l, int branch) const;  // 1 / keep where branch_scales is not null, else 1
  // The bias of a branch product run with alpha: bias * alpha in scratch (alpha scales the
  // product alone), or bias itself where alpha is 1.
  const float* branch_bias(const float* bias, float alpha, cudaStream_t st);
  const bf16* branch_bias(const bf16* bias, float alpha, cudaStream_t st);
  // A branch's residual add for its dropped samples: the block's state before it, restored.
  void restore_dropped(int l, int branch, const float* before, float* after, cudaStream_t st, OpTimer& timer);

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
  std::vector<std::array<Linear, 4>> linears_;
  Fp8Tensors* fp8_ = nullptr;
  float label_smoothing_ = 0.0f;
  AttentionForward attention_forward_ = AttentionForward::Auto;
  AttentionBackward attention_backward_ = AttentionBackward::Auto;
  CudnnAttention *cudnn_forward_ = nullptr, *cudnn_backward_ = nullptr;
  int batches_summed_ = 1;
  float drop_path_ = 0.0f;
  bool drop_path_drawn_ = false;
  GradWrite write_ = GradWrite::Overwrite;  // the running backward's
  // FP8 operands of the products at hand: a forward input (in the backward, the GELU output
  // recomputed), the kept LayerNorm codes transposed (xt8_), two output gradients (fc2's lives
  // on while fc1's is made), and each Linear's output gradient transposed (dy8t_, by Lin: a
  // weight gradient on its own stream may read it while the next ones are made).
  uint8_t *x8_ = nullptr, *xt8_ = nullptr, *dy8_[2] = {}, *dy8t_[4] = {};

  float *params_, *grads_;
  bf16* params_bf16_;
  mutable std::vector<char> fp32_read_;  // per tensor: read by p()
  bool fp32_reads_frozen_ = false;
  float* images_;
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
  float* bias_partial_;  // the bf16 bias gradients' column sums' first stage
  float* drop_scales_;  // [depth][2][B] (drop_path_scales)
  float* branch_bias_;  // [dim]: a branch's bias * alpha (bf16 products: branch_bias_bf16_)
  bf16* branch_bias_bf16_;
  // dresid_'s bf16 copy: of a block's output (dresid_bf16_), of its middle state (dmid_bf16_)
  bf16 *dresid_bf16_, *dmid_bf16_, *dhidden_, *dln_, *dattn_, *dqkv_, *dlogits_, *dfeat_, *dpatch_;
  bf16* gelu_;  // bf16: the current block's GELU output, forward and (recomputed) backward
};
