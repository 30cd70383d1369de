// Proves the float64 oracle right: every gradient against central finite differences of the
// forward, the forward against an independent loop-by-loop ViT, and the small ops against
// hand-computed values. All of it on tiny shapes, so the file runs in well under a second.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>

#include "tests/reference/reference.h"

namespace {
using ref::Vec;

constexpr double kStep = 1e-5;    // finite-difference step
constexpr double kRelTol = 1e-6;  // |fd - an| / max(1e-6, |fd| + |an|)
constexpr double kAbsTol = 1e-9;  // or |fd - an| below this (both near zero)
constexpr size_t kSample = 64;    // elements checked per tensor at most

Vec random_vec(size_t n, std::mt19937_64& rng, double stddev = 1.0, double mean = 0.0) {
  std::normal_distribution<double> dist(mean, stddev);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
}

// All of [0, n) if n <= kSample, else a fixed random sample of kSample of them, plus `base`.
std::vector<size_t> sample(size_t n, size_t base, std::mt19937_64& rng) {
  std::vector<size_t> idx(n);
  std::iota(idx.begin(), idx.end(), base);
  if (n > kSample) {
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(kSample);
    std::sort(idx.begin(), idx.end());
  }
  return idx;
}

// Central differences of f() with respect to x[i], i in idx, against analytic[i]. Checks every
// element, reports the worst errors, restores x.
void fd_check(const std::string& name, Vec& x, const std::vector<size_t>& idx, const Vec& analytic,
              const std::function<double()>& f) {
  REQUIRE(analytic.size() == x.size());
  double worst_rel = 0, worst_abs = 0;
  int bad = 0;
  std::ostringstream first_bad;
  for (size_t i : idx) {
    const double x0 = x[i];
    x[i] = x0 + kStep;
    const double lp = f();
    x[i] = x0 - kStep;
    const double lm = f();
    x[i] = x0;
    const double fd = (lp - lm) / (2 * kStep), an = analytic[i];
    const double abs_err = std::fabs(fd - an);
    const double rel = abs_err / std::max(1e-6, std::fabs(fd) + std::fabs(an));
    worst_rel = std::max(worst_rel, rel);
    worst_abs = std::max(worst_abs, abs_err);
    if (rel > kRelTol && abs_err > kAbsTol && bad++ == 0)
      first_bad << " first bad: element " << i << " fd " << fd << " analytic " << an;
  }
  MESSAGE(name << ": " << idx.size() << " elements, worst rel " << worst_rel << ", worst abs "
               << worst_abs);
  CHECK_MESSAGE(bad == 0, name << ": " << bad << " elements off." << first_bad.str());
}

// The tiny model of the whole-model tests (does not pass validate(): the head dim is 4).
ViTConfig tiny_config() {
  ViTConfig c;
  c.name = "tiny";
  c.img = 8, c.patch = 4, c.channels = 2, c.classes = 5;
  c.dim = 8, c.depth = 2, c.heads = 2, c.mlp_ratio = 2.0;
  return c;
}

// Every parameter random and far from the degenerate init: matrices ~ N(0, 1/fan_in), LayerNorm
// weights 1 + N(0, 0.2^2), biases, cls_token and pos_embed ~ N(0, 0.5^2). Padding stays zero.
Vec random_params(const ParamLayout& layout, std::mt19937_64& rng) {
  Vec p(layout.total(), 0.0);
  for (const ParamTensor& t : layout.tensors()) {
    Vec v;
    const bool matrix = t.shape.size() >= 2 && t.name.size() > 7 &&
                        t.name.compare(t.name.size() - 7, 7, ".weight") == 0;
    if (matrix)
      v = random_vec(t.numel, rng, 1.0 / std::sqrt(double(t.numel / t.shape[0])));
    else if (t.init == ParamInit::One)
      v = random_vec(t.numel, rng, 0.2, 1.0);
    else
      v = random_vec(t.numel, rng, 0.5);
    std::copy(v.begin(), v.end(), p.begin() + t.offset);
  }
  return p;
}

// ----- An independent forward: plain loops on [B][T][D] arrays, the conv as a convolution, the
// attention on timm's (B, N, 3, H, hd) reshape. Shares nothing with reference.cpp.
using Tokens = std::vector<std::vector<Vec>>;  // [B][T] -> D values

Vec naive_linear(const Vec& x, const double* W, const double* b, int out) {
  const size_t in = x.size();
  Vec y(out);
  for (int o = 0; o < out; ++o) {
    double s = b[o];
    for (size_t i = 0; i < in; ++i) s += W[o * in + i] * x[i];
    y[o] = s;
  }
  return y;
}

Vec naive_layernorm(const Vec& x, const double* w, const double* b) {
  const double n = double(x.size());
  double mu = 0, var = 0;
  for (double v : x) mu += v / n;
  for (double v : x) var += (v - mu) * (v - mu) / n;
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = (x[i] - mu) / std::sqrt(var + 1e-6) * w[i] + b[i];
  return y;
}

Vec naive_logits(const ViTConfig& c, const ParamLayout& L, const Vec& params, int B,
                 const Vec& images) {
  auto P = [&](int i) { return params.data() + L.at(i).offset; };
  const int D = c.dim, T = c.tokens(), G = c.grid(), p = c.patch, S = c.img, H = c.heads;
  const int hd = D / H;
  Tokens x(B, std::vector<Vec>(T, Vec(D)));
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int o = 0; o < D; ++o) {
        double v;
        if (t == 0) {
          v = P(L.cls_token)[o];
        } else {  // Conv2d(k = s = p) output channel o at (gh, gw), flattened row-major
          const int gh = (t - 1) / G, gw = (t - 1) % G;
          v = P(L.patch_b)[o];
          for (int ch = 0; ch < c.channels; ++ch)
            for (int kh = 0; kh < p; ++kh)
              for (int kw = 0; kw < p; ++kw)
                v += P(L.patch_w)[((o * c.channels + ch) * p + kh) * p + kw] *
                     images[((b * c.channels + ch) * S + gh * p + kh) * S + gw * p + kw];
        }
        x[b][t][o] = v + P(L.pos_embed)[t * D + o];
      }
  for (const BlockParams& bp : L.blocks) {
    for (int b = 0; b < B; ++b) {
      std::vector<Vec> qkv(T);
      for (int t = 0; t < T; ++t)
        qkv[t] = naive_linear(naive_layernorm(x[b][t], P(bp.norm1_w), P(bp.norm1_b)), P(bp.qkv_w),
                              P(bp.qkv_b), 3 * D);
      auto at = [&](int t, int which, int h, int e) { return qkv[t][(which * H + h) * hd + e]; };
      std::vector<Vec> att(T, Vec(D));
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < T; ++i) {
          Vec w(T);
          double z = 0;
          for (int j = 0; j < T; ++j) {
            double s = 0;
            for (int e = 0; e < hd; ++e) s += at(i, 0, h, e) * at(j, 1, h, e);
            w[j] = std::exp(s * std::pow(double(hd), -0.5));
            z += w[j];
          }
          for (int e = 0; e < hd; ++e) {
            double o = 0;
            for (int j = 0; j < T; ++j) o += w[j] / z * at(j, 2, h, e);
            att[i][h * hd + e] = o;
          }
        }
      for (int t = 0; t < T; ++t) {
        const Vec pr = naive_linear(att[t], P(bp.proj_w), P(bp.proj_b), D);
        for (int d = 0; d < D; ++d) x[b][t][d] += pr[d];
        Vec hdn = naive_linear(naive_layernorm(x[b][t], P(bp.norm2_w), P(bp.norm2_b)), P(bp.fc1_w),
                               P(bp.fc1_b), c.hidden());
        for (double& v : hdn) v = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
        const Vec m = naive_linear(hdn, P(bp.fc2_w), P(bp.fc2_b), D);
        for (int d = 0; d < D; ++d) x[b][t][d] += m[d];
      }
    }
  }
  Vec logits;
  for (int b = 0; b < B; ++b) {
    const Vec y = naive_linear(naive_layernorm(x[b][0], P(L.norm_w), P(L.norm_b)), P(L.head_w),
                               P(L.head_b), c.classes);
    logits.insert(logits.end(), y.begin(), y.end());
  }
  return logits;
}

}  // namespace

TEST_CASE("reference: whole model forward matches an independent loop implementation") {
  const ViTConfig cfg = tiny_config();
  const ParamLayout layout(cfg);
  std::mt19937_64 rng(7);
  const int B = 3;
  const Vec params = random_params(layout, rng);
  const Vec images = random_vec(size_t(B) * cfg.channels * cfg.img * cfg.img, rng);
  const std::vector<int> labels = {4, 0, 2};
  Vec logits;
  const double loss = ref::model_loss(cfg, layout, params, B, images, labels, &logits);
  const Vec expect = naive_logits(cfg, layout, params, B, images);
  REQUIRE(logits.size() == expect.size());
  for (size_t i = 0; i < logits.size(); ++i)
    CHECK(logits[i] == doctest::Approx(expect[i]).epsilon(1e-12));
  double expect_loss = 0;  // -log softmax at the label, averaged
  for (int b = 0; b < B; ++b) {
    double z = 0;
    for (int k = 0; k < cfg.classes; ++k) z += std::exp(expect[b * cfg.classes + k]);
    expect_loss += (std::log(z) - expect[b * cfg.classes + labels[b]]) / B;
  }
  CHECK(loss == doctest::Approx(expect_loss).epsilon(1e-12));
}

TEST_CASE("reference: whole model gradients match finite differences") {
  const ViTConfig cfg = tiny_config();
  const ParamLayout layout(cfg);
  std::mt19937_64 rng(12345);
  const int B = 3;
  Vec params = random_params(layout, rng);
  Vec images = random_vec(size_t(B) * cfg.channels * cfg.img * cfg.img, rng);
  std::vector<int> labels(B);
  for (int& l : labels) l = int(rng() % cfg.classes);

  const ref::ModelResult r = ref::model_forward_backward(cfg, layout, params, B, images, labels);
  REQUIRE(r.grads.size() == layout.total());
  REQUIRE(r.dimages.size() == images.size());

  // Forward-only agrees with the forward inside forward+backward.
  Vec logits;
  CHECK(ref::model_loss(cfg, layout, params, B, images, labels, &logits) ==
        doctest::Approx(r.loss).epsilon(1e-14));
  REQUIRE(logits.size() == size_t(B) * cfg.classes);
  REQUIRE(r.logits.size() == logits.size());
  for (size_t i = 0; i < logits.size(); ++i)
    CHECK(r.logits[i] == doctest::Approx(logits[i]).epsilon(1e-14));

  // Padding between tensors carries no gradient.
  std::vector<bool> real(layout.total(), false);
  for (const ParamTensor& t : layout.tensors())
    std::fill(real.begin() + t.offset, real.begin() + t.offset + t.numel, true);
  for (size_t i = 0; i < real.size(); ++i)
    if (!real[i]) REQUIRE(r.grads[i] == 0.0);

  // Softmax ignores a per-row shift of the scores, so the K third of attn.qkv.bias gets exactly
  // no gradient (finite differences there are pure rounding, covered by kAbsTol).
  for (const BlockParams& bp : layout.blocks)
    for (int d = 0; d < cfg.dim; ++d)
      CHECK(std::fabs(r.grads[layout.at(bp.qkv_b).offset + cfg.dim + d]) < 1e-13);

  auto loss = [&] { return ref::model_loss(cfg, layout, params, B, images, labels); };
  for (const ParamTensor& t : layout.tensors())
    fd_check(t.name, params, sample(t.numel, t.offset, rng), r.grads, loss);
  fd_check("images", images, sample(images.size(), 0, rng), r.dimages, loss);
}

TEST_CASE("reference: attention forward and backward") {
  const int B = 2, T = 5, H = 2, hd = 4, D = H * hd;
  std::mt19937_64 rng(3);
  Vec qkv = random_vec(size_t(B) * T * 3 * D, rng, 1.5);
  const Vec w = random_vec(size_t(B) * T * D, rng);  // loss = <out, w>, so dout = w
  Vec out, lse;
  ref::attention_forward(B, T, H, hd, qkv, &out, &lse);
  REQUIRE(lse.size() == size_t(B) * H * T);

  // Independent forward on the (B, T, 3, H, hd) view.
  auto at = [&](int b, int t, int which, int h, int e) {
    return qkv[(size_t(b) * T + t) * 3 * D + which * D + h * hd + e];
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        Vec s(T);
        for (int j = 0; j < T; ++j) {
          for (int e = 0; e < hd; ++e) s[j] += at(b, i, 0, h, e) * at(b, j, 1, h, e);
          s[j] /= std::sqrt(double(hd));
        }
        double z = 0;
        for (double v : s) z += std::exp(v);
        CHECK(lse[(size_t(b) * H + h) * T + i] == doctest::Approx(std::log(z)).epsilon(1e-13));
        for (int e = 0; e < hd; ++e) {
          double o = 0;
          for (int j = 0; j < T; ++j) o += std::exp(s[j]) / z * at(b, j, 2, h, e);
          CHECK(out[(size_t(b) * T + i) * D + h * hd + e] == doctest::Approx(o).epsilon(1e-13));
        }
      }

  Vec dqkv;
  ref::attention_backward(B, T, H, hd, qkv, w, &dqkv);
  std::vector<size_t> all(qkv.size());
  std::iota(all.begin(), all.end(), 0);
  fd_check("attention dqkv", qkv, all, dqkv, [&] {
    Vec o;
    ref::attention_forward(B, T, H, hd, qkv, &o, nullptr);
    return dot(o, w);
  });
}

TEST_CASE("reference: layernorm forward and backward") {
  const int M = 3, D = 7;
  std::mt19937_64 rng(4);
  Vec x = random_vec(size_t(M) * D, rng, 2.0, 0.5);
  Vec wt = random_vec(D, rng, 0.3, 1.0), bs = random_vec(D, rng, 0.5);
  const Vec r = random_vec(size_t(M) * D, rng);
  auto loss = [&] {
    Vec y, mean, rstd;
    ref::layernorm_forward(M, D, x, wt.data(), bs.data(), ref::kLayerNormEps, &y, &mean, &rstd);
    return dot(y, r);
  };
  Vec y, mean, rstd, dx, dw(D), db(D);
  ref::layernorm_forward(M, D, x, wt.data(), bs.data(), ref::kLayerNormEps, &y, &mean, &rstd);
  for (int i = 0; i < M; ++i) {  // statistics: mean and 1 / sqrt(biased variance + eps)
    double mu = 0, var = 0;
    for (int d = 0; d < D; ++d) mu += x[i * D + d] / D;
    for (int d = 0; d < D; ++d) var += (x[i * D + d] - mu) * (x[i * D + d] - mu) / D;
    CHECK(mean[i] == doctest::Approx(mu).epsilon(1e-14));
    CHECK(rstd[i] == doctest::Approx(1 / std::sqrt(var + 1e-6)).epsilon(1e-14));
  }
  ref::layernorm_backward(M, D, x, wt.data(), mean, rstd, r, &dx, dw.data(), db.data());
  std::vector<size_t> ix(x.size()), iw(D);
  std::iota(ix.begin(), ix.end(), 0);
  std::iota(iw.begin(), iw.end(), 0);
  fd_check("layernorm dx", x, ix, dx, loss);
  fd_check("layernorm dw", wt, iw, dw, loss);
  fd_check("layernorm db", bs, iw, db, loss);
}

TEST_CASE("reference: linear forward and backward") {
  const int M = 4, N = 3, K = 5;
  std::mt19937_64 rng(5);
  Vec x = random_vec(size_t(M) * K, rng), W = random_vec(size_t(N) * K, rng),
      b = random_vec(N, rng);
  const Vec r = random_vec(size_t(M) * N, rng);
  Vec y;
  ref::linear_forward(M, N, K, x, W.data(), b.data(), &y);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = b[n];
      for (int k = 0; k < K; ++k) s += x[m * K + k] * W[n * K + k];
      CHECK(y[m * N + n] == doctest::Approx(s).epsilon(1e-14));
    }
  auto loss = [&] {
    Vec o;
    ref::linear_forward(M, N, K, x, W.data(), b.data(), &o);
    return dot(o, r);
  };
  Vec dx, dW(W.size(), 7.0), db(N, 7.0);  // stale values must be overwritten
  ref::linear_backward(M, N, K, x, W.data(), r, &dx, dW.data(), db.data());
  std::vector<size_t> ix(x.size()), iw(W.size()), ib(N);
  std::iota(ix.begin(), ix.end(), 0);
  std::iota(iw.begin(), iw.end(), 0);
  std::iota(ib.begin(), ib.end(), 0);
  fd_check("linear dx", x, ix, dx, loss);
  fd_check("linear dW", W, iw, dW, loss);
  fd_check("linear db", b, ib, db, loss);
  Vec dx_only;  // null outputs are skipped
  ref::linear_backward(M, N, K, x, W.data(), r, &dx_only, nullptr, nullptr);
  CHECK(dx_only == dx);
}

TEST_CASE("reference: softmax cross-entropy") {
  const int B = 3, C = 5;
  std::mt19937_64 rng(6);
  Vec z = random_vec(size_t(B) * C, rng, 2.0);
  const std::vector<int> labels = {1, 4, 0};
  Vec dz;
  const double loss = ref::softmax_xent(B, C, z, labels, &dz);
  double expect = 0;
  for (int b = 0; b < B; ++b) {
    double s = 0;
    for (int c = 0; c < C; ++c) s += std::exp(z[b * C + c]);
    expect -= std::log(std::exp(z[b * C + labels[b]]) / s) / B;
  }
  CHECK(loss == doctest::Approx(expect).epsilon(1e-13));
  std::vector<size_t> iz(z.size());
  std::iota(iz.begin(), iz.end(), 0);
  fd_check("softmax_xent dlogits", z, iz, dz,
           [&] { return ref::softmax_xent(B, C, z, labels, nullptr); });
  Vec shifted = z;  // stable for large logits: a shift per row changes nothing
  for (double& v : shifted) v += 1000;
  CHECK(ref::softmax_xent(B, C, shifted, labels, nullptr) == doctest::Approx(loss).epsilon(1e-12));
}

TEST_CASE("reference: gelu and its derivative") {
  // 0.5 x (1 + erf(x / sqrt 2)) = x Phi(x): Phi(1) = 0.841344746068543, Phi(2) = 0.977249868051821.
  CHECK(ref::gelu(1.0) == doctest::Approx(0.841344746068543).epsilon(1e-14));
  CHECK(ref::gelu(-1.0) == doctest::Approx(-(1 - 0.841344746068543)).epsilon(1e-13));
  CHECK(ref::gelu(2.0) == doctest::Approx(2 * 0.977249868051821).epsilon(1e-14));
  CHECK(ref::gelu(0.0) == 0.0);
  CHECK(ref::gelu_grad(0.0) == doctest::Approx(0.5).epsilon(1e-15));
  // The lower tail keeps its digits: Phi(-10) = 7.619853024160526e-24.
  CHECK(ref::gelu(-10.0) == doctest::Approx(-7.619853024160526e-23).epsilon(1e-13));
  Vec x = {-4.0, -2.5, -1.0, -0.3, 0.0, 0.2, 0.7, 1.5, 3.0, 6.0}, g(x.size());
  for (size_t i = 0; i < x.size(); ++i) g[i] = ref::gelu_grad(x[i]);
  for (size_t i = 0; i < x.size(); ++i) {
    std::vector<size_t> one = {i};
    fd_check("gelu_grad at " + std::to_string(x[i]), x, one, g, [&] { return ref::gelu(x[i]); });
  }
}

TEST_CASE("reference: patchify layout and unpatchify adjoint") {
  ViTConfig cfg = tiny_config();
  cfg.img = 12, cfg.patch = 4, cfg.channels = 3;  // a 3x3 grid, 3 channels
  const int B = 2, p = cfg.patch, G = cfg.grid(), S = cfg.img, C = cfg.channels,
            K = cfg.patch_dim();
  // Each pixel holds a code of its (b, c, h, w); each patch element must find its own.
  Vec img(size_t(B) * C * S * S);
  auto code = [&](int b, int c, int h, int w) { return ((b * 10.0 + c) * 100 + h) * 100 + w; };
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < S; ++h)
        for (int w = 0; w < S; ++w) img[((b * C + c) * S + h) * S + w] = code(b, c, h, w);
  const Vec patches = ref::patchify(cfg, B, img);
  REQUIRE(patches.size() == size_t(B) * G * G * K);
  int wrong = 0;
  for (int b = 0; b < B; ++b)
    for (int gh = 0; gh < G; ++gh)
      for (int gw = 0; gw < G; ++gw)
        for (int c = 0; c < C; ++c)
          for (int kh = 0; kh < p; ++kh)
            for (int kw = 0; kw < p; ++kw) {
              const size_t row = (size_t(b) * G + gh) * G + gw;
              wrong +=
                  patches[row * K + (c * p + kh) * p + kw] != code(b, c, gh * p + kh, gw * p + kw);
            }
  CHECK(wrong == 0);

  std::mt19937_64 rng(8);
  const Vec x = random_vec(img.size(), rng), y = random_vec(patches.size(), rng);
  CHECK(dot(ref::patchify(cfg, B, x), y) ==
        doctest::Approx(dot(x, ref::unpatchify(cfg, B, y))).epsilon(1e-13));
  CHECK(ref::unpatchify(cfg, B, ref::patchify(cfg, B, x)) == x);  // a permutation: exact
}

TEST_CASE("reference: adamw_step against hand-computed values") {
  // Step 1: m = 0.1 g, v = 0.001 g^2, so m / bc1 = g and sqrt(v / bc2) = |g|: p -= lr g / (|g| + eps).
  ref::Vec p = {1.0, -2.0}, m, v;
  ref::adamw_step(p, m, v, {0.5, -0.25}, 0.1, 0.9, 0.999, 1e-8, 0.5, {true, false}, 1);
  CHECK(p[0] == doctest::Approx(1.0 * (1 - 0.05) - 0.1 * 0.5 / (0.5 + 1e-8)).epsilon(1e-14));
  CHECK(p[1] == doctest::Approx(-2.0 + 0.1 * 0.25 / (0.25 + 1e-8)).epsilon(1e-14));  // not decayed
  CHECK(m[0] == doctest::Approx(0.05).epsilon(1e-14));
  CHECK(v[1] == doctest::Approx(0.001 * 0.0625).epsilon(1e-14));
  // Step 2 with gradient 0: m halves towards 0 by beta1, the update m / bc1 / (sqrt(v / bc2) + eps).
  const double m2 = 0.9 * 0.05, v2 = 0.999 * 0.001 * 0.25, bc1 = 1 - 0.81, bc2 = 1 - 0.999 * 0.999;
  const double p0 = p[0];
  ref::adamw_step(p, m, v, {0.0, 0.0}, 0.1, 0.9, 0.999, 1e-8, 0.5, {true, false}, 2);
  CHECK(p[0] == doctest::Approx(p0 * 0.95 - 0.1 / bc1 * m2 / (std::sqrt(v2) / std::sqrt(bc2) + 1e-8)).epsilon(1e-13));
}

TEST_CASE("reference: sgd_step two steps against hand-computed values") {
  // lr 0.1, momentum 0.9, p0 = (1, -2), g1 = (0.5, 0.25), g2 = (-1, 2).
  struct Case {
    bool nesterov;
    double wd;
    double p1[2], p2[2], buf2[2];
  };
  const Case cases[] = {
      // buf1 = g1, p1 = p0 - 0.1 g1; buf2 = 0.9 g1 + g2, p2 = p1 - 0.1 buf2
      {false, 0.0, {0.95, -2.025}, {1.005, -2.2475}, {-0.55, 2.225}},
      // g' = g + 0.01 p: g1' = (0.51, 0.23), p1 = (0.949, -2.023); g2' = (-0.99051, 1.97977)
      {false, 0.01, {0.949, -2.023}, {1.002151, -2.241677}, {-0.53151, 2.18677}},
      // step = g' + 0.9 buf: step1 = 1.9 g1' = (0.969, 0.437); buf2 = (-0.531969, 2.186563)
      {true, 0.01, {0.9031, -2.0437}, {1.05007411, -2.43844697}, {-0.531969, 2.186563}},
      {true, 0.0, {0.905, -2.0475}, {1.0545, -2.44775}, {-0.55, 2.225}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.nesterov);
    CAPTURE(c.wd);
    Vec p = {1.0, -2.0}, buf = {123.0, -456.0};  // the first step must ignore buf's contents
    ref::sgd_step(p, buf, {0.5, 0.25}, 0.1, 0.9, c.wd, c.nesterov, true);
    for (int i = 0; i < 2; ++i) CHECK(p[i] == doctest::Approx(c.p1[i]).epsilon(1e-14));
    ref::sgd_step(p, buf, {-1.0, 2.0}, 0.1, 0.9, c.wd, c.nesterov, false);
    for (int i = 0; i < 2; ++i) {
      CHECK(p[i] == doctest::Approx(c.p2[i]).epsilon(1e-14));
      CHECK(buf[i] == doctest::Approx(c.buf2[i]).epsilon(1e-14));
    }
  }
}
