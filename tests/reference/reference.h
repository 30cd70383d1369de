// The CPU oracle: the whole ViT forward and backward in float64 (Eigen inside), op by op, with
// the same layouts as the GPU engine. Every GPU kernel test and the whole-model gradient test
// compare against these functions; the finite-difference test proves these functions right.
//
// Conventions: all matrices are row-major std::vector<double>; "x[M, D]" means M rows of D.
#pragma once
#include <vector>

#include "model/config.h"
#include "model/params.h"

namespace ref {
using Vec = std::vector<double>;

// images [B, C, H, W] -> patches [B * P, C * p * p]; patch rows in row-major (gh, gw) order per
// image, each patch flattened in (c, kh, kw) order (the Conv2d weight viewed as [D, C*p*p]).
Vec patchify(const ViTConfig& cfg, int B, const Vec& images);
// The inverse scatter of patchify, for the input gradient: dpatches -> dimages [B, C, H, W].
Vec unpatchify(const ViTConfig& cfg, int B, const Vec& dpatches);

// y[M, N] = x[M, K] * W[N, K]^T + b[N]  (b may be nullptr)
void linear_forward(int M, int N, int K, const Vec& x, const double* W, const double* b, Vec* y);
// dx[M, K] = dy * W;  dW[N, K] = dy^T * x;  db[N] = sum over rows of dy. Outputs are overwritten;
// any output pointer may be nullptr to skip it.
void linear_backward(int M, int N, int K, const Vec& x, const double* W, const Vec& dy, Vec* dx,
                     double* dW, double* db);

// LayerNorm over the last dimension, biased variance, y = (x - mean) * rstd * w + b.
void layernorm_forward(int M, int D, const Vec& x, const double* w, const double* b, double eps,
                       Vec* y, Vec* mean, Vec* rstd);
// dx[M, D], dw[D], db[D] (overwritten; dw/db may be nullptr).
void layernorm_backward(int M, int D, const Vec& x, const double* w, const Vec& mean,
                        const Vec& rstd, const Vec& dy, Vec* dx, double* dw, double* db);

double normal_cdf(double x);  // Phi(x), the standard normal CDF
double gelu(double x);        // exact: x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
double gelu_grad(double x);   // d gelu / dx

// Multi-head self-attention core on timm's qkv layout: qkv [B*T, 3*D], columns [0, D) Q,
// [D, 2D) K, [2D, 3D) V, head h at columns h*hd .. h*hd+hd-1 within each; no mask, scale
// 1/sqrt(hd). out [B*T, D] with heads re-joined the same way; lse [B, H, T] = log sum_j exp(s_ij)
// of the scaled scores s (natural log).
void attention_forward(int B, int T, int H, int hd, const Vec& qkv, Vec* out, Vec* lse);
// dqkv [B*T, 3*D] from dout [B*T, D].
void attention_backward(int B, int T, int H, int hd, const Vec& qkv, const Vec& dout, Vec* dqkv);

// Mean cross-entropy over the batch; dlogits = (softmax - onehot) / B (may be nullptr).
double softmax_xent(int B, int C, const Vec& logits, const std::vector<int>& labels, Vec* dlogits);

// torch.optim.SGD semantics, in place on p and buf: g' = g + wd * p; buf = g' on the first step,
// else buf = momentum * buf + g'; step = nesterov ? g' + momentum * buf : buf; p -= lr * step.
void sgd_step(Vec& p, Vec& buf, const Vec& g, double lr, double momentum, double wd, bool nesterov,
              bool first_step);
// torch.optim.AdamW's step t (from 1) in float64: decoupled decay where decay[i], bias correction.
void adamw_step(Vec& p, Vec& m, Vec& v, const Vec& g, double lr, double beta1, double beta2, double eps, double wd,
                const std::vector<bool>& decay, int t);

// The whole model, timm's VisionTransformer: params in ParamLayout's flat layout (padding
// ignored), images [B, C, H, W], labels in [0, classes). drop_scales (optional, [depth][2][B]):
// stochastic depth's per-sample scale of each block's attention and MLP branch.
struct ModelResult {
  double loss = 0;
  Vec logits;   // [B, classes]
  Vec grads;    // ParamLayout's flat layout (padding zero)
  Vec dimages;  // [B, C, H, W]
};
ModelResult model_forward_backward(const ViTConfig& cfg, const ParamLayout& layout,
                                   const Vec& params, int B, const Vec& images,
                                   const std::vector<int>& labels, const Vec* drop_scales = nullptr);
// Forward only (for finite differences).
double model_loss(const ViTConfig& cfg, const ParamLayout& layout, const Vec& params, int B,
                  const Vec& images, const std::vector<int>& labels, Vec* logits = nullptr);

constexpr double kLayerNormEps = 1e-6;
}  // namespace ref
