// The float64 CPU oracle of the ViT engine: timm's VisionTransformer forward and backward, op by
// op. Matmuls go through Eigen maps of the row-major buffers; everything else is plain loops.
#include "tests/reference/reference.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <utility>

namespace ref {
namespace {

using MatR = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMap = Eigen::Map<const MatR>;
using MMap = Eigen::Map<MatR>;
// A [rows, cols] block inside a wider row-major buffer (one head's Q, K or V inside qkv).
using CStrided = Eigen::Map<const MatR, 0, Eigen::OuterStride<>>;
using MStrided = Eigen::Map<MatR, 0, Eigen::OuterStride<>>;
using CRow = Eigen::Map<const Eigen::RowVectorXd>;
using MRow = Eigen::Map<Eigen::RowVectorXd>;

// Row-wise softmax of S in place; the log-sum-exp of each row goes to lse unless it is null.
void softmax_rows(MatR* S, double* lse) {
  for (Eigen::Index i = 0; i < S->rows(); ++i) {
    auto row = S->row(i);
    const double m = row.maxCoeff();
    row = (row.array() - m).exp().matrix();
    const double sum = row.sum();
    row /= sum;
    if (lse) lse[i] = m + std::log(sum);
  }
}

// Where head h of image b starts in qkv for Q, K and V (row stride 3D).
struct HeadView {
  const double* q;
  const double* k;
  const double* v;
};
HeadView head_view(const Vec& qkv, int b, int h, int T, int H, int hd) {
  const int D = H * hd;
  const double* base = qkv.data() + static_cast<size_t>(b) * T * 3 * D + h * hd;
  return {base, base + D, base + 2 * D};
}

// Pointers into the flat parameter (or gradient) buffer by tensor index.
template <typename T>
struct Flat {
  const ParamLayout& layout;
  T* base;
  T* operator()(int index) const { return base + layout.at(index).offset; }
};

// Everything one block's backward needs from its forward.
struct BlockCache {
  Vec x;                       // block input (residual stream) [M, D]
  Vec ln1, mean1, rstd1, qkv;  // norm1 output, its statistics, qkv [M, 3D]
  Vec att;                     // attention output before proj [M, D]
  Vec x_mid;                   // x + proj(att) [M, D]
  Vec ln2, mean2, rstd2;       // norm2 output and statistics
  Vec h, a;                    // fc1 output (pre-GELU) and GELU(h) [M, hidden]
};

struct ForwardState {
  Vec patches;                     // [B*P, C*p*p]
  std::vector<BlockCache> blocks;  // empty unless the caches are kept
  Vec x_final;                     // residual stream after the last block [M, D]
  Vec lnf, meanf, rstdf;           // final norm output and statistics
  Vec cls;                         // lnf's token-0 rows [B, D], the head's input
  Vec logits;                      // [B, classes]
};

Vec add(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

// v [B * T, D] with each sample's T rows times its scale (stochastic depth); v itself where
// scales is null.
Vec scale_samples(Vec v, const double* scales, int T, int D) {
  if (!scales) return v;
  const size_t per_sample = static_cast<size_t>(T) * D;
  for (size_t i = 0; i < v.size(); ++i) v[i] *= scales[i / per_sample];
  return v;
}

// The per-sample scales of block l's branch (0 attention, 1 MLP), or null without stochastic depth.
const double* branch_scales(const Vec* drop_scales, int l, int branch, int B) {
  return drop_scales ? drop_scales->data() + static_cast<size_t>(2 * l + branch) * B : nullptr;
}

// x_out = x + proj(attn(norm1(x))); x_out += fc2(gelu(fc1(norm2(x_out)))), each branch times its
// sample's scale (attn_scales, mlp_scales; null: 1). Fills c.
void block_forward(const ViTConfig& cfg, const BlockParams& bp, const Flat<const double>& P, int B,
                   Vec x, BlockCache* c, Vec* x_out, const double* attn_scales, const double* mlp_scales) {
  const int T = cfg.tokens(), M = B * T, D = cfg.dim, Hd = cfg.hidden();
  c->x = std::move(x);
  layernorm_forward(M, D, c->x, P(bp.norm1_w), P(bp.norm1_b), kLayerNormEps, &c->ln1, &c->mean1,
                    &c->rstd1);
  linear_forward(M, 3 * D, D, c->ln1, P(bp.qkv_w), P(bp.qkv_b), &c->qkv);
  attention_forward(B, T, cfg.heads, cfg.head_dim(), c->qkv, &c->att, nullptr);
  Vec proj;
  linear_forward(M, D, D, c->att, P(bp.proj_w), P(bp.proj_b), &proj);
  c->x_mid = add(c->x, scale_samples(std::move(proj), attn_scales, T, D));
  layernorm_forward(M, D, c->x_mid, P(bp.norm2_w), P(bp.norm2_b), kLayerNormEps, &c->ln2, &c->mean2,
                    &c->rstd2);
  linear_forward(M, Hd, D, c->ln2, P(bp.fc1_w), P(bp.fc1_b), &c->h);
  c->a.resize(c->h.size());
  for (size_t i = 0; i < c->h.size(); ++i) c->a[i] = gelu(c->h[i]);
  Vec mlp;
  linear_forward(M, D, Hd, c->a, P(bp.fc2_w), P(bp.fc2_b), &mlp);
  *x_out = add(c->x_mid, scale_samples(std::move(mlp), mlp_scales, T, D));
}

// The reverse of block_forward: dx (gradient w.r.t. x_out on entry) becomes the gradient w.r.t.
// the block input; parameter gradients are written into G.
void block_backward(const ViTConfig& cfg, const BlockParams& bp, const Flat<const double>& P,
                    const Flat<double>& G, int B, const BlockCache& c, Vec* dx, const double* attn_scales,
                    const double* mlp_scales) {
  const int T = cfg.tokens(), M = B * T, D = cfg.dim, Hd = cfg.hidden();
  // MLP branch; the residual passes dx through unchanged.
  Vec da, dln;
  linear_backward(M, D, Hd, c.a, P(bp.fc2_w), scale_samples(*dx, mlp_scales, T, D), &da, G(bp.fc2_w), G(bp.fc2_b));
  for (size_t i = 0; i < da.size(); ++i) da[i] *= gelu_grad(c.h[i]);
  linear_backward(M, Hd, D, c.ln2, P(bp.fc1_w), da, &dln, G(bp.fc1_w), G(bp.fc1_b));
  Vec dbranch;
  layernorm_backward(M, D, c.x_mid, P(bp.norm2_w), c.mean2, c.rstd2, dln, &dbranch, G(bp.norm2_w),
                     G(bp.norm2_b));
  *dx = add(*dx, dbranch);  // now d x_mid
  // Attention branch.
  Vec datt, dqkv;
  linear_backward(M, D, D, c.att, P(bp.proj_w), scale_samples(*dx, attn_scales, T, D), &datt, G(bp.proj_w),
                  G(bp.proj_b));
  attention_backward(B, T, cfg.heads, cfg.head_dim(), c.qkv, datt, &dqkv);
  linear_backward(M, 3 * D, D, c.ln1, P(bp.qkv_w), dqkv, &dln, G(bp.qkv_w), G(bp.qkv_b));
  layernorm_backward(M, D, c.x, P(bp.norm1_w), c.mean1, c.rstd1, dln, &dbranch, G(bp.norm1_w),
                     G(bp.norm1_b));
  *dx = add(*dx, dbranch);
}

// The whole forward up to the logits; keeps the per-block caches only when keep_caches is set.
ForwardState forward(const ViTConfig& cfg, const ParamLayout& layout, const Vec& params, int B,
                     const Vec& images, bool keep_caches, const Vec* drop_scales = nullptr) {
  const Flat<const double> P{layout, params.data()};
  const int D = cfg.dim, T = cfg.tokens(), Np = cfg.patches(), M = B * T;
  ForwardState s;
  s.patches = patchify(cfg, B, images);
  Vec emb;
  linear_forward(B * Np, D, cfg.patch_dim(), s.patches, P(layout.patch_w), P(layout.patch_b), &emb);
  // Tokens: [cls, patch 0, ..., patch Np-1] per image, plus pos_embed (which covers token 0 too).
  Vec x(static_cast<size_t>(M) * D);
  const double* cls = P(layout.cls_token);
  const double* pos = P(layout.pos_embed);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const double* src = t == 0 ? cls : &emb[(static_cast<size_t>(b) * Np + t - 1) * D];
      double* dst = &x[(static_cast<size_t>(b) * T + t) * D];
      for (int d = 0; d < D; ++d) dst[d] = src[d] + pos[t * D + d];
    }
  for (int l = 0; l < cfg.depth; ++l) {
    const BlockParams& bp = layout.blocks[l];
    BlockCache c;
    block_forward(cfg, bp, P, B, std::move(x), &c, &x, branch_scales(drop_scales, l, 0, B),
                  branch_scales(drop_scales, l, 1, B));
    if (keep_caches) s.blocks.push_back(std::move(c));
  }
  s.x_final = std::move(x);
  layernorm_forward(M, D, s.x_final, P(layout.norm_w), P(layout.norm_b), kLayerNormEps, &s.lnf,
                    &s.meanf, &s.rstdf);
  s.cls.resize(static_cast<size_t>(B) * D);
  for (int b = 0; b < B; ++b)
    std::copy_n(&s.lnf[static_cast<size_t>(b) * T * D], D, &s.cls[static_cast<size_t>(b) * D]);
  linear_forward(B, cfg.classes, D, s.cls, P(layout.head_w), P(layout.head_b), &s.logits);
  return s;
}

// Visits every (image element, patch element) pair once: f(image index, patch index).
template <typename F>
void for_each_patch_element(const ViTConfig& cfg, int B, F f) {
  const int C = cfg.channels, p = cfg.patch, G = cfg.grid(), S = cfg.img, K = cfg.patch_dim();
  for (int b = 0; b < B; ++b)
    for (int gh = 0; gh < G; ++gh)
      for (int gw = 0; gw < G; ++gw) {
        const size_t row = (static_cast<size_t>(b) * G + gh) * G + gw;
        for (int c = 0; c < C; ++c)
          for (int kh = 0; kh < p; ++kh)
            for (int kw = 0; kw < p; ++kw) {
              const size_t img =
                  ((static_cast<size_t>(b) * C + c) * S + gh * p + kh) * S + gw * p + kw;
              f(img, row * K + (c * p + kh) * p + kw);
            }
      }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Patch embedding layout.

Vec patchify(const ViTConfig& cfg, int B, const Vec& images) {
  Vec out(static_cast<size_t>(B) * cfg.patches() * cfg.patch_dim());
  for_each_patch_element(cfg, B, [&](size_t i, size_t j) { out[j] = images[i]; });
  return out;
}

Vec unpatchify(const ViTConfig& cfg, int B, const Vec& dpatches) {
  // Patches do not overlap (stride = kernel) and tile the image, so this is a pure permutation.
  Vec out(static_cast<size_t>(B) * cfg.channels * cfg.img * cfg.img);
  for_each_patch_element(cfg, B, [&](size_t i, size_t j) { out[i] = dpatches[j]; });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Linear, LayerNorm, GELU.

void linear_forward(int M, int N, int K, const Vec& x, const double* W, const double* b, Vec* y) {
  y->resize(static_cast<size_t>(M) * N);
  MMap Y(y->data(), M, N);
  Y.noalias() = CMap(x.data(), M, K) * CMap(W, N, K).transpose();
  if (b) Y.rowwise() += CRow(b, N);
}

void linear_backward(int M, int N, int K, const Vec& x, const double* W, const Vec& dy, Vec* dx,
                     double* dW, double* db) {
  const CMap dY(dy.data(), M, N);
  if (dx) {
    dx->resize(static_cast<size_t>(M) * K);
    MMap(dx->data(), M, K).noalias() = dY * CMap(W, N, K);
  }
  if (dW) MMap(dW, N, K).noalias() = dY.transpose() * CMap(x.data(), M, K);
  if (db) MRow(db, N) = dY.colwise().sum();
}

void layernorm_forward(int M, int D, const Vec& x, const double* w, const double* b, double eps,
                       Vec* y, Vec* mean, Vec* rstd) {
  y->resize(static_cast<size_t>(M) * D);
  mean->resize(M);
  rstd->resize(M);
  for (int i = 0; i < M; ++i) {
    const double* xi = &x[static_cast<size_t>(i) * D];
    double mu = 0, var = 0;
    for (int d = 0; d < D; ++d) mu += xi[d];
    mu /= D;
    for (int d = 0; d < D; ++d) var += (xi[d] - mu) * (xi[d] - mu);
    const double rs = 1.0 / std::sqrt(var / D + eps);  // biased variance, as torch
    for (int d = 0; d < D; ++d)
      (*y)[static_cast<size_t>(i) * D + d] = (xi[d] - mu) * rs * w[d] + b[d];
    (*mean)[i] = mu;
    (*rstd)[i] = rs;
  }
}

void layernorm_backward(int M, int D, const Vec& x, const double* w, const Vec& mean,
                        const Vec& rstd, const Vec& dy, Vec* dx, double* dw, double* db) {
  // With xhat = (x - mean) * rstd and g = dy * w:
  //   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
  dx->resize(static_cast<size_t>(M) * D);
  if (dw) std::fill_n(dw, D, 0.0);
  if (db) std::fill_n(db, D, 0.0);
  Vec xhat(D);
  for (int i = 0; i < M; ++i) {
    const size_t r = static_cast<size_t>(i) * D;
    double mg = 0, mgx = 0;
    for (int d = 0; d < D; ++d) {
      xhat[d] = (x[r + d] - mean[i]) * rstd[i];
      const double g = dy[r + d] * w[d];
      mg += g;
      mgx += g * xhat[d];
      if (dw) dw[d] += dy[r + d] * xhat[d];
      if (db) db[d] += dy[r + d];
    }
    mg /= D;
    mgx /= D;
    for (int d = 0; d < D; ++d) (*dx)[r + d] = rstd[i] * (dy[r + d] * w[d] - mg - xhat[d] * mgx);
  }
}

constexpr double kSqrtHalf = 0.70710678118654752440;    // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)

// Phi(x) = (1 + erf(x / sqrt 2)) / 2, written with erfc: the same function, without the
// cancellation that leaves 1 + erf no digits as x goes below -8 (the kernels' normal_cdf keeps
// ~4e-6 relative there).
double normal_cdf(double x) { return 0.5 * std::erfc(-x * kSqrtHalf); }

double gelu(double x) { return x * normal_cdf(x); }

double gelu_grad(double x) {
  // Phi(x) + x * phi(x), with Phi, phi the standard normal CDF and density.
  return normal_cdf(x) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

// ---------------------------------------------------------------------------------------------
// Attention: per (image, head), S = Q K^T * scale, P = softmax(S), O = P V.

void attention_forward(int B, int T, int H, int hd, const Vec& qkv, Vec* out, Vec* lse) {
  const int D = H * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  out->resize(static_cast<size_t>(B) * T * D);
  if (lse) lse->resize(static_cast<size_t>(B) * H * T);
  const Eigen::OuterStride<> in_stride(3 * D), out_stride(D);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const HeadView v = head_view(qkv, b, h, T, H, hd);
      const CStrided Q(v.q, T, hd, in_stride), K(v.k, T, hd, in_stride), V(v.v, T, hd, in_stride);
      MatR S = scale * (Q * K.transpose());
      softmax_rows(&S, lse ? lse->data() + (static_cast<size_t>(b) * H + h) * T : nullptr);
      MStrided O(out->data() + static_cast<size_t>(b) * T * D + h * hd, T, hd, out_stride);
      O.noalias() = S * V;
    }
}

void attention_backward(int B, int T, int H, int hd, const Vec& qkv, const Vec& dout, Vec* dqkv) {
  const int D = H * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  dqkv->assign(static_cast<size_t>(B) * T * 3 * D, 0.0);
  const Eigen::OuterStride<> in_stride(3 * D), out_stride(D);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const HeadView v = head_view(qkv, b, h, T, H, hd);
      const CStrided Q(v.q, T, hd, in_stride), K(v.k, T, hd, in_stride), V(v.v, T, hd, in_stride);
      const CStrided dO(dout.data() + static_cast<size_t>(b) * T * D + h * hd, T, hd, out_stride);
      double* base = dqkv->data() + static_cast<size_t>(b) * T * 3 * D + h * hd;
      MStrided dQ(base, T, hd, in_stride), dK(base + D, T, hd, in_stride),
          dV(base + 2 * D, T, hd, in_stride);
      MatR Pm = scale * (Q * K.transpose());
      softmax_rows(&Pm, nullptr);
      dV.noalias() = Pm.transpose() * dO;
      const MatR dP = dO * V.transpose();
      // Softmax backward: dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik).
      const Eigen::VectorXd rowdot = Pm.cwiseProduct(dP).rowwise().sum();
      const MatR dS = Pm.cwiseProduct(dP - rowdot.replicate(1, T));
      dQ.noalias() = scale * (dS * K);
      dK.noalias() = scale * (dS.transpose() * Q);
    }
}

// ---------------------------------------------------------------------------------------------
// Loss and optimizer.

double softmax_xent(int B, int C, const Vec& logits, const std::vector<int>& labels, Vec* dlogits) {
  if (dlogits) dlogits->resize(static_cast<size_t>(B) * C);
  double loss = 0;
  for (int b = 0; b < B; ++b) {
    const double* z = &logits[static_cast<size_t>(b) * C];
    const double m = *std::max_element(z, z + C);
    double sum = 0;
    for (int c = 0; c < C; ++c) sum += std::exp(z[c] - m);
    const double lse = m + std::log(sum);
    loss += lse - z[labels[b]];
    if (dlogits)
      for (int c = 0; c < C; ++c)
        (*dlogits)[static_cast<size_t>(b) * C + c] = (std::exp(z[c] - lse) - (c == labels[b])) / B;
  }
  return loss / B;
}

void sgd_step(Vec& p, Vec& buf, const Vec& g, double lr, double momentum, double wd, bool nesterov,
              bool first_step) {
  if (buf.size() != p.size()) buf.assign(p.size(), 0.0);
  for (size_t i = 0; i < p.size(); ++i) {
    const double gi = g[i] + wd * p[i];
    buf[i] = first_step ? gi : momentum * buf[i] + gi;
    p[i] -= lr * (nesterov ? gi + momentum * buf[i] : buf[i]);
  }
}

void adamw_step(Vec& p, Vec& m, Vec& v, const Vec& g, double lr, double beta1, double beta2, double eps, double wd,
                const std::vector<bool>& decay, int t) {
  if (m.size() != p.size()) m.assign(p.size(), 0.0);
  if (v.size() != p.size()) v.assign(p.size(), 0.0);
  const double bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
  for (size_t i = 0; i < p.size(); ++i) {
    if (decay[i]) p[i] *= 1 - lr * wd;
    m[i] = beta1 * m[i] + (1 - beta1) * g[i];
    v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
    p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
  }
}

// ---------------------------------------------------------------------------------------------
// The whole model.

double model_loss(const ViTConfig& cfg, const ParamLayout& layout, const Vec& params, int B,
                  const Vec& images, const std::vector<int>& labels, Vec* logits) {
  ForwardState s = forward(cfg, layout, params, B, images, /*keep_caches=*/false);
  const double loss = softmax_xent(B, cfg.classes, s.logits, labels, nullptr);
  if (logits) *logits = std::move(s.logits);
  return loss;
}

ModelResult model_forward_backward(const ViTConfig& cfg, const ParamLayout& layout,
                                   const Vec& params, int B, const Vec& images,
                                   const std::vector<int>& labels, const Vec* drop_scales) {
  const ForwardState s = forward(cfg, layout, params, B, images, /*keep_caches=*/true, drop_scales);
  const Flat<const double> P{layout, params.data()};
  ModelResult r;
  r.grads.assign(layout.total(), 0.0);
  const Flat<double> G{layout, r.grads.data()};
  const int D = cfg.dim, T = cfg.tokens(), Np = cfg.patches(), M = B * T;

  Vec dlogits, dcls;
  r.loss = softmax_xent(B, cfg.classes, s.logits, labels, &dlogits);
  r.logits = s.logits;
  linear_backward(B, cfg.classes, D, s.cls, P(layout.head_w), dlogits, &dcls, G(layout.head_w),
                  G(layout.head_b));
  // Only token 0 of the final norm's output reaches the head.
  Vec dlnf(static_cast<size_t>(M) * D, 0.0), dx;
  for (int b = 0; b < B; ++b)
    std::copy_n(&dcls[static_cast<size_t>(b) * D], D, &dlnf[static_cast<size_t>(b) * T * D]);
  layernorm_backward(M, D, s.x_final, P(layout.norm_w), s.meanf, s.rstdf, dlnf, &dx,
                     G(layout.norm_w), G(layout.norm_b));
  for (int i = cfg.depth - 1; i >= 0; --i)
    block_backward(cfg, layout.blocks[i], P, G, B, s.blocks[i], &dx, branch_scales(drop_scales, i, 0, B),
                   branch_scales(drop_scales, i, 1, B));

  // Token assembly: pos_embed and cls_token sum over the batch; patch tokens go to the embedding.
  double* dpos = G(layout.pos_embed);
  double* dclst = G(layout.cls_token);
  Vec demb(static_cast<size_t>(B) * Np * D);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const double* src = &dx[(static_cast<size_t>(b) * T + t) * D];
      for (int d = 0; d < D; ++d) dpos[t * D + d] += src[d];
      if (t == 0)
        for (int d = 0; d < D; ++d) dclst[d] += src[d];
      else
        std::copy_n(src, D, &demb[(static_cast<size_t>(b) * Np + t - 1) * D]);
    }
  Vec dpatches;
  linear_backward(B * Np, D, cfg.patch_dim(), s.patches, P(layout.patch_w), demb, &dpatches,
                  G(layout.patch_w), G(layout.patch_b));
  r.dimages = unpatchify(cfg, B, dpatches);
  return r;
}

}  // namespace ref
