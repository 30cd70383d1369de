// GPU tier: every kernel against the float64 CPU reference, on fresh random inputs, with the
// outputs poisoned first.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "kernels/cudnn_attention.h"
#include "kernels/drop_path.h"
#include "kernels/attention.h"
#include "kernels/elementwise.h"
#include "kernels/embed.h"
#include "kernels/layernorm.h"
#include "kernels/loss.h"
#include "kernels/normal_cdf.h"
#include "kernels/optimizer.h"
#include "kernels/peer_copy.h"
#include "kernels/preload.h"
#include "kernels/random.h"
#include "kernels/reduce.h"
#include "tests/gpu_util.h"
#include "tests/harness.h"
#include "tests/reference/reference.h"

using bf16 = __nv_bfloat16;

namespace {
// Tolerances on ||gpu - ref|| / ||ref||: fp32 arithmetic on identical inputs lands far below
// 1e-5; a bf16 output carries a rounding of 2^-9 relative per element.
constexpr double kF32Tol = 1e-5;
constexpr double kBf16OutTol = 5e-3;

template <class T>
std::vector<double> slice(const std::vector<T>& v, size_t begin, size_t n) {
  return std::vector<double>(v.begin() + begin, v.begin() + begin + n);
}

// One attention shape: random bf16 inputs (qkv in [-2, 2], dout in [-1, 1]), the float64
// reference's out, lse and dqkv, and device buffers for the inputs, the outputs (poisoned) and
// the backward's delta workspace. far_below: every score about -120 (Q's column 0 set to 1, K's
// to -120 sqrt(hd)), so that every log-sum-exp is below -88.7 (exp of it underflows fp32) while
// the probabilities are ordinary.
struct AttentionCase {
  int B, T, H, hd, D;
  size_t rows;
  std::vector<double> qkv_h, dout_h, out_ref, lse_ref, dqkv_ref;
  DeviceBuffer<bf16> qkv, out, dout, dqkv;
  DeviceBuffer<float> lse, delta;
  AttentionCase(std::mt19937_64& rng, int B_, int T_, int H_, int hd_, bool far_below = false)
      : B(B_), T(T_), H(H_), hd(hd_), D(H_ * hd_), rows(size_t(B_) * T_),
        qkv_h(inputs(rng, rows, D, H, hd, far_below)), dout_h(round_bf16(random_vec(rng, rows * D))),
        qkv(to_bf16(qkv_h)), out(rows * D), dout(to_bf16(dout_h)), dqkv(rows * 3 * D), lse(rows * H),
        delta(attention_backward_workspace_floats(B, T, H, hd)) {
    ref::attention_forward(B, T, H, hd, qkv_h, &out_ref, &lse_ref);
    ref::attention_backward(B, T, H, hd, qkv_h, dout_h, &dqkv_ref);
  }
  static std::vector<double> inputs(std::mt19937_64& rng, size_t rows, int D, int H, int hd, bool far_below) {
    auto v = round_bf16(random_vec(rng, rows * 3 * D, -2, 2));
    if (far_below)
      for (size_t r = 0; r < rows; ++r)
        for (int h = 0; h < H; ++h) {
          v[r * 3 * D + h * hd] = 1.0;                                              // Q
          v[r * 3 * D + D + h * hd] = round_bf16({-120.0 * std::sqrt(double(hd))})[0];  // K
        }
    return v;
  }
  // Part 0, 1 or 2 (dQ, dK, dV) of a dqkv, and of the reference's.
  std::vector<double> part(const std::vector<double>& v, int p) const {
    std::vector<double> out_part;
    for (size_t r = 0; r < rows; ++r) {
      const auto row = v.begin() + r * 3 * D + p * D;
      out_part.insert(out_part.end(), row, row + D);
    }
    return out_part;
  }
};
}  // namespace

TEST_CASE("gpu: layernorm forward and backward against the reference") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  // A partial float4 chunk (264), ViT-H's 1280 (g read early) and 1536 (g read late); row
  // counts that leave blocks of 8 rows partial, and past the fixed grids (2112 rows backward,
  // 3168 forward in fp8, 2112 in bf16) so that a warp walks several rows.
  const struct { int M, D, stride_mult; } shapes[] = {
      {37, 264, 1}, {37, 264, 3}, {150, 1280, 1}, {21, 1536, 2}, {4001, 264, 1}, {3300, 1280, 1}};
  for (const auto& shape : shapes) {
    const int M = shape.M, D = shape.D, stride = D * shape.stride_mult;
    CAPTURE(M);
    CAPTURE(D);
    CAPTURE(stride);
    // Rows spaced by stride (the final LayerNorm reads class-token rows only); the rest unused.
    const auto x_all = round_f32(random_vec(rng, static_cast<size_t>(M) * stride, -3, 3));
    const auto w = round_f32(random_vec(rng, D, 0.5, 1.5)), b = round_f32(random_vec(rng, D));
    std::vector<double> x(static_cast<size_t>(M) * D);
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < D; ++c) x[r * D + c] = x_all[static_cast<size_t>(r) * stride + c];
    std::vector<double> y_ref, mean_ref, rstd_ref;
    ref::layernorm_forward(M, D, x, w.data(), b.data(), 1e-6, &y_ref, &mean_ref, &rstd_ref);

    DeviceBuffer<float> dx_all(to_f32(x_all)), dw(to_f32(w)), db(to_f32(b)), dmean(M), drstd(M);
    DeviceBuffer<bf16> dy_out(static_cast<size_t>(M) * D);
    layernorm_forward(dx_all.get(), stride, dw.get(), db.get(), dy_out.get(), dmean.get(), drstd.get(), M, D, 1e-6f, 0);
    CHECK(rel_error(to_f64(dy_out.download()), y_ref) < kBf16OutTol);
    CHECK(rel_error(to_f64(dmean.download()), mean_ref) < kF32Tol);
    CHECK(rel_error(to_f64(drstd.download()), rstd_ref) < kF32Tol);

    // Backward fused with the residual: g += dx, g_bf16 = bf16(g).
    const auto dy = round_bf16(random_vec(rng, static_cast<size_t>(M) * D));
    const auto g0 = round_f32(random_vec(rng, static_cast<size_t>(M) * stride));
    std::vector<double> dx_ref, dw_ref(D), db_ref(D);
    ref::layernorm_backward(M, D, x, w.data(), to_f64(dmean.download()), to_f64(drstd.download()), dy, &dx_ref,
                            dw_ref.data(), db_ref.data());
    std::vector<double> g_ref = g0;
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < D; ++c) g_ref[static_cast<size_t>(r) * stride + c] += dx_ref[r * D + c];
    DeviceBuffer<bf16> ddy(to_bf16(dy)), dg_bf16(static_cast<size_t>(M) * stride);
    DeviceBuffer<float> dg(to_f32(g0)), ddw(D), ddb(D), partial(layernorm_partial_floats(M, D));
    layernorm_backward(ddy.get(), dx_all.get(), stride, dw.get(), dmean.get(), drstd.get(), dg.get(), dg_bf16.get(),
                       ddw.get(), ddb.get(), partial.get(), M, D, 0);
    const auto g_out = to_f64(dg.download());
    const auto gb_out = to_f64(dg_bf16.download());
    std::vector<double> g_rows, g_ref_rows, gb_rows;
    for (int r = 0; r < M; ++r) {
      const size_t o = static_cast<size_t>(r) * stride;
      for (int c = 0; c < D; ++c) {
        g_rows.push_back(g_out[o + c]);
        gb_rows.push_back(gb_out[o + c]);
        g_ref_rows.push_back(g_ref[o + c]);
      }
    }
    CHECK(rel_error(g_rows, g_ref_rows) < 1e-5);
    CHECK(rel_error(gb_rows, g_ref_rows) < kBf16OutTol);
    CHECK(rel_error(to_f64(ddw.download()), dw_ref) < 1e-5);
    CHECK(rel_error(to_f64(ddb.download()), db_ref) < 1e-5);

    // Again, accumulating the weight gradients into those just written, with per-sample branch
    // scales on the bf16 copy (3 rows a sample; stochastic depth's 0 and 1 / keep).
    const int rows_per_sample = 3, samples = (M + rows_per_sample - 1) / rows_per_sample;
    std::vector<float> scales(samples);
    for (int i = 0; i < samples; ++i) scales[i] = i % 3 == 0 ? 0.0f : 1.0f / 0.7f;
    DeviceBuffer<float> dscales(scales);
    layernorm_backward(ddy.get(), dx_all.get(), stride, dw.get(), dmean.get(), drstd.get(), dg.get(), dg_bf16.get(),
                       ddw.get(), ddb.get(), partial.get(), M, D, 0, GradWrite::Accumulate,
                       SampleScale{dscales.get(), rows_per_sample});
    const auto g2 = dg.download();
    const auto gb2 = dg_bf16.download();
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < D; ++c) {
        const size_t o = static_cast<size_t>(r) * stride + c;
        REQUIRE(__bfloat162float(gb2[o]) == __bfloat162float(__float2bfloat16_rn(g2[o] * scales[r / rows_per_sample])));
      }
    std::vector<double> dw2(D), db2(D);
    for (int c = 0; c < D; ++c) {
      dw2[c] = 2 * dw_ref[c];
      db2[c] = 2 * db_ref[c];
    }
    CHECK(rel_error(to_f64(ddw.download()), dw2) < 1e-5);
    CHECK(rel_error(to_f64(ddb.download()), db2) < 1e-5);
  }
}

TEST_CASE("gpu: GELU forward, and backward with recompute and bias gradient, against the reference") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int M = 77, N = 8 * 301;  // a partial row chunk and a partial block of columns
  const size_t n = static_cast<size_t>(M) * N;
  const auto h = round_bf16(random_vec(rng, n, -5, 5)), da = round_bf16(random_vec(rng, n));
  std::vector<double> a_ref(n), dh_ref(n), db_ref(N, 0.0);
  for (size_t i = 0; i < n; ++i) {
    a_ref[i] = ref::gelu(h[i]);
    dh_ref[i] = da[i] * ref::gelu_grad(h[i]);
    db_ref[i % N] += dh_ref[i];
  }
  DeviceBuffer<bf16> dh_in(to_bf16(h)), da_in(to_bf16(da)), a(n), dh(n);
  DeviceBuffer<float> db(N), partial(gelu_backward_partial_floats(M, N));
  gelu_forward(dh_in.get(), a.get(), n, 0);
  CHECK(rel_error(to_f64(a.download()), a_ref) < kBf16OutTol);
  a.poison();
  gelu_backward(da_in.get(), dh_in.get(), dh.get(), a.get(), db.get(), partial.get(), M, N, 0);
  CHECK(rel_error(to_f64(dh.download()), dh_ref) < kBf16OutTol);
  CHECK(rel_error(to_f64(a.download()), a_ref) < kBf16OutTol);
  CHECK(rel_error(to_f64(db.download()), db_ref) < 1e-5);
  a.poison();
  db.poison();
  gelu_backward(da_in.get(), dh_in.get(), da_in.get(), a.get(), db.get(), partial.get(), M, N, 0);  // in place
  CHECK(rel_error(to_f64(da_in.download()), dh_ref) < kBf16OutTol);
  CHECK(rel_error(to_f64(db.download()), db_ref) < 1e-5);
}

// The formula of kernels/normal_cdf.h (host arithmetic: exact reciprocal and exp2, where the
// GPU's add ~1 ulp each; the GELU tests below check the kernels) over every bf16 value below 64
// in magnitude, against the exact CDF: the bounds tools/fit_normal_cdf.py reports.
TEST_CASE("normal_cdf: Phi(x) and exp(-x^2 / 2) over every bf16 value below 64 in magnitude") {
  double near = 0, tail = 0, upper = 0, gauss = 0;  // largest relative errors
  for (const double x : every_bf16_below_pow2(6)) {
    const NormalCdf n = normal_cdf(static_cast<float>(x));
    const double phi = ref::normal_cdf(x), g = std::exp(-0.5 * x * x);
    const double err = std::fabs(n.cdf - phi) / phi;
    if (std::fabs(x) < 4) near = std::max(near, err);
    else if (x > 0) upper = std::max(upper, err);
    else if (phi > 1e-37) tail = std::max(tail, err);
    else REQUIRE(n.cdf <= 1e-37);
    if (g > 1e-37) gauss = std::max(gauss, std::fabs(n.gauss - g) / g);
  }
  MESSAGE("normal_cdf's largest relative errors: |x| < 4 ", near, ", x <= -4 ", tail, ", x >= 4 ", upper,
          "; exp(-x^2 / 2) ", gauss);
  CHECK(near < 6e-7);
  CHECK(tail < 4e-6);
  CHECK(upper < 1e-7);
  CHECK(gauss < 4e-6);
  CHECK(normal_cdf(0.0f).cdf == 0.5f);
  CHECK(normal_cdf(-0.0f).cdf == 0.5f);
  CHECK(normal_cdf(INFINITY).cdf == 1.0f);
  CHECK(normal_cdf(-INFINITY).cdf == 0.0f);
  CHECK(std::isnan(normal_cdf(NAN).cdf));
}

namespace {
// got is the bf16 rounding of some value within slack of truth: rounding is monotone, so it lies
// between the roundings of truth - slack and truth + slack.
bool within_bf16_rounding(double got, double truth, double slack) {
  auto round = [](double v) { return static_cast<double>(__bfloat162float(__float2bfloat16_rn(static_cast<float>(v)))); };
  return round(truth - slack) <= got && got <= round(truth + slack);
}
}  // namespace

// Value by value, not a norm: every bf16 input below 64 in magnitude through the bf16 GELU
// kernels; each output the bf16 rounding of the truth up to fp32's errors (normal_cdf's relative
// 4e-6 at most, its underflow past |x| = 13, the products' roundings).
TEST_CASE("gpu: GELU over every bf16 value below 64 in magnitude, value by value") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  auto h = every_bf16_below_pow2(6);
  std::shuffle(h.begin(), h.end(), rng);
  const int N = 128, M = static_cast<int>(h.size() / N);
  REQUIRE(static_cast<size_t>(M) * N == h.size());
  const auto da = round_bf16(random_vec(rng, h.size()));
  DeviceBuffer<bf16> h_in(to_bf16(h)), da_in(to_bf16(da)), a(h.size()), dh(h.size());
  DeviceBuffer<float> db(N), partial(gelu_backward_partial_floats(M, N));
  gelu_forward(h_in.get(), a.get(), h.size(), 0);
  const auto a_fwd = to_f64(a.download());
  a.poison();
  gelu_backward(da_in.get(), h_in.get(), dh.get(), a.get(), db.get(), partial.get(), M, N, 0);
  const auto a_bwd = to_f64(a.download()), dh_got = to_f64(dh.download());
  int off_forward = 0, off_recompute = 0, off_gradient = 0;
  for (size_t i = 0; i < h.size(); ++i) {
    const double x = h[i], phi = ref::normal_cdf(x), x_pdf = std::fabs(x) * 0.3989422804014327 * std::exp(-0.5 * x * x);
    const double a_slack = 5e-6 * std::fabs(ref::gelu(x)) + 1e-36;
    off_forward += !within_bf16_rounding(a_fwd[i], ref::gelu(x), a_slack);
    off_recompute += a_bwd[i] != a_fwd[i];
    // gelu' = Phi + x phi crosses zero near x = -0.75: its error is relative to the terms' size.
    off_gradient += !within_bf16_rounding(dh_got[i], da[i] * ref::gelu_grad(x), 5e-6 * std::fabs(da[i]) * (phi + x_pdf) + 1e-36);
  }
  CHECK(off_forward == 0);
  CHECK(off_recompute == 0);
  CHECK(off_gradient == 0);
}

TEST_CASE("gpu: column sums") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  for (int M : {333, 3333}) {  // fewer and more second-stage rows than its warps
    CAPTURE(M);
    const int N = 300, ld = 312;
    const auto x = round_bf16(random_vec(rng, static_cast<size_t>(M) * ld));
    std::vector<double> ref_sum(N, 0.0);
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < N; ++c) ref_sum[c] += x[static_cast<size_t>(r) * ld + c];
    DeviceBuffer<float> xf(to_f32(x)), out(N), partial(colsum_partial_floats(M, N));
    DeviceBuffer<bf16> xb(to_bf16(x));
    colsum(xf.get(), M, N, ld, out.get(), partial.get(), 0);
    CHECK(rel_error(to_f64(out.download()), ref_sum) < 1e-5);
    out.poison();
    colsum(xb.get(), M, N, ld, out.get(), partial.get(), 0);
    CHECK(rel_error(to_f64(out.download()), ref_sum) < 1e-5);
    // Accumulating: added to what out holds.
    const auto before = random_vec(rng, N);
    out.upload(to_f32(before));
    colsum(xb.get(), M, N, ld, out.get(), partial.get(), 0, GradWrite::Accumulate);
    std::vector<double> want(N);
    for (int c = 0; c < N; ++c) want[c] = static_cast<float>(before[c]) + ref_sum[c];
    CHECK(rel_error(to_f64(out.download()), want) < 1e-5);
  }
}

TEST_CASE("gpu: stochastic depth: timm's linear rates, 0 or 1 / keep per sample, drawn alike in slices; dropped rows restored") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int blocks = 5, B = 4000;
  const float rate = 0.4f;
  const uint64_t seed = rng();
  DeviceBuffer<float> whole(2 * blocks * B), part(2 * blocks * (B / 4));
  draw_drop_path(whole.get(), blocks, B, rate, seed, 7, 0, 0);
  const std::vector<float> w = whole.download();
  for (int l = 0; l < blocks; ++l) {
    CAPTURE(l);
    const float keep = drop_path_keep(rate, l, blocks);
    CHECK(keep == doctest::Approx(1.0 - 0.4 * l / 4).epsilon(1e-6));
    for (int branch = 0; branch < 2; ++branch) {
      int kept = 0;
      for (int b = 0; b < B; ++b) {
        const float v = w[static_cast<size_t>(2 * l + branch) * B + b];
        REQUIRE((v == 0.0f || v == 1.0f / keep));
        kept += v != 0.0f;
      }
      // Binomial(4000, keep): within 5 standard deviations.
      CHECK(std::abs(kept - keep * B) <= 5 * std::sqrt(B * keep * (1 - keep)) + 1e-9);
    }
  }
  // A slice of the batch (a micro-batch or a rank's share) draws its samples' masks.
  draw_drop_path(part.get(), blocks, B / 4, rate, seed, 7, 2 * (B / 4), 0);
  const std::vector<float> p = part.download();
  for (int i = 0; i < 2 * blocks; ++i)
    for (int b = 0; b < B / 4; ++b)
      REQUIRE(p[static_cast<size_t>(i) * (B / 4) + b] == w[static_cast<size_t>(i) * B + 2 * (B / 4) + b]);
  // Another stream (the next step) draws other masks.
  draw_drop_path(part.get(), blocks, B / 4, rate, seed, 8, 2 * (B / 4), 0);
  CHECK(part.download() != p);

  // restore_dropped_rows: the dropped samples' rows back from x, the others untouched.
  const int T = 5, D = 12, S = 7;
  const std::vector<float> sample_scales = {0.0f, 2.0f, 0.0f, 0.0f, 1.25f, 2.0f, 0.0f};
  const auto x = to_f32(random_vec(rng, static_cast<size_t>(S) * T * D));
  const auto y0 = to_f32(random_vec(rng, static_cast<size_t>(S) * T * D));
  DeviceBuffer<float> dx(x), dy(y0), ds(sample_scales);
  restore_dropped_rows(dx.get(), dy.get(), ds.get(), S * T, T, D, 0);
  const std::vector<float> y = dy.download();
  for (int r = 0; r < S * T; ++r)
    for (int c = 0; c < D; ++c) {
      const size_t i = static_cast<size_t>(r) * D + c;
      REQUIRE(y[i] == (sample_scales[r / T] == 0.0f ? x[i] : y0[i]));
    }
  // scale_vector, fp32 and bf16.
  const auto v = to_f32(random_vec(rng, 100));
  DeviceBuffer<float> vin(v), vout(100);
  scale_vector(vin.get(), 1.5f, vout.get(), 100, 0);
  const std::vector<float> vo = vout.download();
  for (int i = 0; i < 100; ++i) REQUIRE(vo[i] == v[i] * 1.5f);
  DeviceBuffer<bf16> bin(to_bf16(to_f64(v))), bout(100);
  scale_vector(bin.get(), 1.5f, bout.get(), 100, 0);
  const std::vector<bf16> bi = bin.download(), bo = bout.download();
  for (int i = 0; i < 100; ++i) REQUIRE(__bfloat162float(bo[i]) == __bfloat162float(__float2bfloat16_rn(__bfloat162float(bi[i]) * 1.5f)));
}


TEST_CASE("gpu: sum_into adds the sources in order, vectorised and not") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  // n % 4 == 0 with an aligned stride takes the float4 path; the others the scalar one.
  struct Case {
    size_t n, stride;
    int sources;
  };
  for (const Case& c : {Case{4096, 4160, 1}, Case{1 << 20, 1 << 20, 3}, Case{1001, 1003, 2}, Case{12, 16, 7}}) {
    const size_t n = c.n, stride = c.stride;
    const int sources = c.sources;
    CAPTURE(n);
    CAPTURE(sources);
    const auto dst0 = round_f32(random_vec(rng, n, -4, 4));
    const auto src = round_f32(random_vec(rng, stride * sources, -4, 4));
    std::vector<float> ref(n);
    for (size_t i = 0; i < n; ++i) {
      float acc = static_cast<float>(dst0[i]);  // the same fp32 additions in the same order: equal bits
      for (int s = 0; s < sources; ++s) acc += static_cast<float>(src[s * stride + i]);
      ref[i] = acc;
    }
    DeviceBuffer<float> dst(to_f32(dst0)), srcs(to_f32(src));
    sum_into(dst.get(), srcs.get(), stride, sources, n, 0);
    CHECK(dst.download() == ref);
  }
}
TEST_CASE("gpu: patchify and the class-token/position embedding") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  ViTConfig c;
  c.img = 24; c.patch = 8; c.channels = 3; c.dim = 16;
  const int B = 3, P = c.patches(), T = c.tokens(), D = c.dim;
  const auto images = round_bf16(random_vec(rng, static_cast<size_t>(B) * 3 * 24 * 24));
  DeviceBuffer<float> dimg(to_f32(images));
  DeviceBuffer<bf16> patches(static_cast<size_t>(B) * P * c.patch_dim());
  patchify(dimg.get(), patches.get(), B, c.channels, c.img, c.patch, c.patch_dim(), 0);
  CHECK(rel_error(to_f64(patches.download()), ref::patchify(c, B, images)) == 0.0);
  {  // a patch dim that is not a multiple of 8 (3 x 7 x 7 = 147, like ViT-H/14's 588): rows padded to 152 with zeros
    ViTConfig c7 = c;
    c7.img = 21, c7.patch = 7;
    const int K = c7.patch_dim(), K8 = c7.patch_dim_padded(), rows = B * c7.patches();
    REQUIRE(K8 == 152);
    const auto images7 = round_bf16(random_vec(rng, static_cast<size_t>(B) * 3 * 21 * 21));
    DeviceBuffer<float> dimg7(to_f32(images7));
    DeviceBuffer<bf16> padded(static_cast<size_t>(rows) * K8);
    padded.poison();
    patchify(dimg7.get(), padded.get(), B, c7.channels, c7.img, c7.patch, K8, 0);
    const auto got = to_f64(padded.download());
    const auto want = ref::patchify(c7, B, images7);
    std::vector<double> real, pad;
    for (int r = 0; r < rows; ++r)
      for (int k = 0; k < K8; ++k) (k < K ? real : pad).push_back(got[static_cast<size_t>(r) * K8 + k]);
    CHECK(rel_error(real, want) == 0.0);
    CHECK(pad == std::vector<double>(pad.size(), 0.0));
  }

  const auto po = round_f32(random_vec(rng, static_cast<size_t>(B) * P * D));
  const auto cls = round_f32(random_vec(rng, D)), pos = round_f32(random_vec(rng, static_cast<size_t>(T) * D));
  std::vector<double> x_ref(static_cast<size_t>(B) * T * D);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < D; ++d)
        x_ref[(static_cast<size_t>(b) * T + t) * D + d] =
            static_cast<float>((t == 0 ? cls[d] : po[(static_cast<size_t>(b) * P + t - 1) * D + d]) + pos[t * D + d]);
  DeviceBuffer<float> dpo(to_f32(po)), dcls(to_f32(cls)), dpos(to_f32(pos)), x(x_ref.size());
  embed_forward(dpo.get(), dcls.get(), dpos.get(), x.get(), B, T, D, 0);
  CHECK(rel_error(to_f64(x.download()), x_ref) == 0.0);

  const auto g = round_bf16(random_vec(rng, x_ref.size()));
  DeviceBuffer<float> dg(to_f32(g));
  DeviceBuffer<bf16> dpatch(static_cast<size_t>(B) * P * D);
  embed_backward(dg.get(), dpatch.get(), B, T, D, 0);
  std::vector<double> dpatch_ref;
  for (int b = 0; b < B; ++b)
    for (int t = 1; t < T; ++t)
      for (int d = 0; d < D; ++d) dpatch_ref.push_back(g[(static_cast<size_t>(b) * T + t) * D + d]);
  CHECK(rel_error(to_f64(dpatch.download()), dpatch_ref) == 0.0);
}

TEST_CASE("gpu: softmax cross-entropy") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int B = 19, C = 1000, ld = 1000 + 8;
  const auto z = round_f32(random_vec(rng, static_cast<size_t>(B) * ld, -8, 8));
  std::vector<int> labels(B);
  for (int b = 0; b < B; ++b) labels[b] = static_cast<int>(rng() % C);
  std::vector<double> z_dense, dz_ref;
  for (int b = 0; b < B; ++b) z_dense.insert(z_dense.end(), z.begin() + b * ld, z.begin() + b * ld + C);
  const double loss_ref = ref::softmax_xent(B, C, z_dense, labels, &dz_ref);
  DeviceBuffer<float> dz_in(to_f32(z)), row_loss(B), loss(1);
  DeviceBuffer<int> dl(labels);
  DeviceBuffer<bf16> dz(static_cast<size_t>(B) * ld);
  softmax_xent(dz_in.get(), dl.get(), B, C, ld, row_loss.get(), loss.get(), dz.get(), 0);
  CHECK(std::abs(loss.download()[0] - loss_ref) / loss_ref < 1e-5);
  const auto dz_out = to_f64(dz.download());
  std::vector<double> dz_dense, padding;
  for (int b = 0; b < B; ++b) {
    dz_dense.insert(dz_dense.end(), dz_out.begin() + b * ld, dz_out.begin() + b * ld + C);
    padding.insert(padding.end(), dz_out.begin() + b * ld + C, dz_out.begin() + (b + 1) * ld);
  }
  CHECK(rel_error(dz_dense, dz_ref) < kBf16OutTol);
  CHECK(rel_error(padding, std::vector<double>(padding.size(), 0.0)) == 0.0);

  // Label smoothing e: loss = (1 - e) CE + e mean_c(-log p_c); gradient (p - target) / B with
  // target (1 - e) onehot + e / C (PyTorch's CrossEntropyLoss(label_smoothing=e)).
  const double e = 0.1;
  double loss_s = 0;
  std::vector<double> dz_s(static_cast<size_t>(B) * C);
  for (int b = 0; b < B; ++b) {
    const double* zb = z_dense.data() + static_cast<size_t>(b) * C;
    double m = -1e300, sum = 0, mean_z = 0;
    for (int c = 0; c < C; ++c) m = std::max(m, zb[c]);
    for (int c = 0; c < C; ++c) { sum += std::exp(zb[c] - m); mean_z += zb[c] / C; }
    const double lse = m + std::log(sum);
    loss_s += ((1 - e) * (lse - zb[labels[b]]) + e * (lse - mean_z)) / B;
    for (int c = 0; c < C; ++c)
      dz_s[static_cast<size_t>(b) * C + c] = (std::exp(zb[c] - lse) - ((c == labels[b] ? 1 - e : 0) + e / C)) / B;
  }
  dz.poison();
  softmax_xent(dz_in.get(), dl.get(), B, C, ld, row_loss.get(), loss.get(), dz.get(), 0, static_cast<float>(e));
  CHECK(std::abs(loss.download()[0] - loss_s) / loss_s < 1e-5);
  const auto dz_s_out = to_f64(dz.download());
  std::vector<double> dz_s_dense;
  for (int b = 0; b < B; ++b) dz_s_dense.insert(dz_s_dense.end(), dz_s_out.begin() + b * ld, dz_s_out.begin() + b * ld + C);
  CHECK(rel_error(dz_s_dense, dz_s) < kBf16OutTol);

  // Two data-parallel ranks whose gradients are summed: each rank's gradient is half the
  // one-rank gradient, exactly (a power of two), and the loss itself is unchanged.
  dz.poison();
  softmax_xent(dz_in.get(), dl.get(), B, C, ld, row_loss.get(), loss.get(), dz.get(), 0, static_cast<float>(e), 2);
  CHECK(std::abs(loss.download()[0] - loss_s) / loss_s < 1e-5);
  const auto dz_half = to_f64(dz.download());
  for (size_t i = 0; i < dz_half.size(); ++i) {
    if (dz_half[i] != 0.5 * dz_s_out[i]) {
      CAPTURE(i);
      CHECK(dz_half[i] == 0.5 * dz_s_out[i]);
      break;
    }
  }
}

TEST_CASE("gpu: SGD with momentum, torch.optim.SGD semantics, two steps") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const size_t n = 4 * 777;
  for (bool nesterov : {false, true}) {
    for (double wd : {0.0, 0.05}) {
      CAPTURE(nesterov);
      CAPTURE(wd);
      auto p = round_f32(random_vec(rng, n)), buf = std::vector<double>(n, 0.0);
      DeviceBuffer<float> dp(to_f32(p)), dbuf(n), dg(n);
      DeviceBuffer<bf16> dpb(n);
      const SgdHyper h{0.1f, 0.9f, static_cast<float>(wd), nesterov};
      for (int step = 0; step < 2; ++step) {
        const auto g = round_f32(random_vec(rng, n));
        dg.upload(to_f32(g));
        ref::sgd_step(p, buf, g, 0.1, 0.9, wd, nesterov, step == 0);
        sgd_momentum_step(dp.get(), dbuf.get(), dg.get(), dpb.get(), n, h, step == 0, 0);
      }
      CHECK(rel_error(to_f64(dp.download()), p) < 1e-6);
      CHECK(rel_error(to_f64(dbuf.download()), buf) < 1e-6);
      CHECK(rel_error(to_f64(dpb.download()), p) < kBf16OutTol);
    }
  }
  {  // clipping: the gradient scaled by max_norm / (norm + 1e-6) before the step, when above
    auto p = round_f32(random_vec(rng, n)), buf = std::vector<double>(n, 0.0);
    const auto g = round_f32(random_vec(rng, n));
    double norm = 0;
    for (double v : g) norm += v * v;
    norm = std::sqrt(norm);
    const double max_norm = norm / 4;
    std::vector<double> clipped(g);
    for (double& v : clipped) v *= max_norm / (norm + 1e-6);
    DeviceBuffer<float> dp(to_f32(p)), dbuf(n), dg(to_f32(g)), dnorm(1), partial(l2_norm_partial_floats());
    DeviceBuffer<bf16> dpb(n);
    l2_norm(dg.get(), n, partial.get(), dnorm.get(), 0);
    CHECK(std::abs(dnorm.download()[0] - norm) / norm < 1e-5);
    SgdHyper h{0.1f, 0.9f, 0.0f, false};
    h.max_grad_norm = static_cast<float>(max_norm);
    ref::sgd_step(p, buf, clipped, 0.1, 0.9, 0.0, false, true);
    sgd_momentum_step(dp.get(), dbuf.get(), dg.get(), dpb.get(), n, h, true, 0, nullptr, dnorm.get());
    CHECK(rel_error(to_f64(dp.download()), p) < 1e-6);
  }
}

TEST_CASE("gpu: AdamW, torch.optim.AdamW semantics with timm's decay groups, three steps; a skip counts none") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const size_t n = 128 * 37;  // 37 chunks of the flags' 128 elements, about half of them decayed
  const AdamWHyper h{0.9, 0.999, 1e-8, 0.05};
  std::vector<uint8_t> flags(n / 128);
  for (uint8_t& f : flags) f = rng() % 2;
  std::vector<bool> decay(n);
  for (size_t i = 0; i < n; ++i) decay[i] = flags[i / 128] != 0;
  const DeviceBuffer<uint8_t> dflags(flags);
  auto p = round_f32(random_vec(rng, n));
  std::vector<double> m, v;
  DeviceBuffer<float> dp(to_f32(p)), dm(std::vector<float>(n, 0.0f)), dv(std::vector<float>(n, 0.0f)), dg(n);
  DeviceBuffer<bf16> dpb(n);
  DeviceBuffer<AdamWScalars> scalars(std::vector<AdamWScalars>{{0, 0.0f, 1.0f, 1.0f}});
  DeviceBuffer<int> skip(std::vector<int>{0});
  int t = 0;
  for (int step = 0; step < 4; ++step) {
    const bool skipped = step == 2;  // FP8's guard: nothing changes, the step is not counted
    skip.upload(std::vector<int>{skipped ? 1 : 0});
    const auto g = round_f32(random_vec(rng, n, -2.0, 2.0));
    dg.upload(to_f32(g));
    const double lr = 0.01 * (step + 1);
    adamw_begin_step(scalars.get(), lr, h, skip.get(), 0);
    // Two launches over halves of the range, as the parts of an update run.
    adamw_step(dp.get(), dm.get(), dv.get(), dg.get(), dpb.get(), n / 2, DecayFlags{dflags.get(), 7, 0}, h,
               scalars.get(), 0, skip.get());
    adamw_step(dp.get() + n / 2, dm.get() + n / 2, dv.get() + n / 2, dg.get() + n / 2, dpb.get() + n / 2, n / 2,
               DecayFlags{dflags.get(), 7, n / 2}, h, scalars.get(), 0, skip.get());
    if (!skipped) ref::adamw_step(p, m, v, g, lr, 0.9, 0.999, 1e-8, 0.05, decay, ++t);
  }
  CHECK(scalars.download()[0].steps == 3);
  CHECK(rel_error(to_f64(dp.download()), p) < 1e-6);
  CHECK(rel_error(to_f64(dm.download()), m) < 1e-6);
  CHECK(rel_error(to_f64(dv.download()), v) < 1e-6);
  CHECK(rel_error(to_f64(dpb.download()), p) < kBf16OutTol);
  {  // clipping: the gradient scaled by max_norm / (norm + 1e-6) before the step, when above
    const auto g = round_f32(random_vec(rng, n));
    double norm = 0;
    for (double x : g) norm += x * x;
    norm = std::sqrt(norm);
    AdamWHyper hc = h;
    hc.max_grad_norm = static_cast<float>(norm / 4);
    std::vector<double> clipped(g);
    for (double& x : clipped) x *= hc.max_grad_norm / (norm + 1e-6);
    DeviceBuffer<float> dnorm(std::vector<float>{static_cast<float>(norm)});
    dg.upload(to_f32(g));
    adamw_begin_step(scalars.get(), 0.01, hc, nullptr, 0);
    adamw_step(dp.get(), dm.get(), dv.get(), dg.get(), dpb.get(), n, DecayFlags{dflags.get(), 7, 0}, hc, scalars.get(),
               0, nullptr, dnorm.get());
    ref::adamw_step(p, m, v, clipped, 0.01, 0.9, 0.999, 1e-8, 0.05, decay, ++t);
    CHECK(rel_error(to_f64(dp.download()), p) < 1e-6);
  }
}

TEST_CASE("gpu: the sharded AdamW step gives the replicated step's bits") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const size_t n = 4 * 1234, stride = n + 64;
  const int peers = 2;
  const AdamWHyper h{0.9, 0.95, 1e-6, 0.1};
  std::vector<uint8_t> flags((n + 127) / 128 + 1);
  for (uint8_t& f : flags) f = rng() % 2;
  const DeviceBuffer<uint8_t> dflags(flags);
  const auto p = to_f32(round_f32(random_vec(rng, n))), m = to_f32(round_f32(random_vec(rng, n)));
  auto v = to_f32(round_f32(random_vec(rng, n)));
  for (float& x : v) x = x * x;
  const auto g = to_f32(round_f32(random_vec(rng, n))), received = to_f32(round_f32(random_vec(rng, stride * peers)));
  DeviceBuffer<AdamWScalars> scalars(std::vector<AdamWScalars>{{41, 0.0f, 1.0f, 1.0f}});
  adamw_begin_step(scalars.get(), 0.003, h, nullptr, 0);
  const DecayFlags decay{dflags.get(), 7, 64};  // a share starting 64 elements into its chunk
  // Replicated: the sum first (sum_into), then the step.
  DeviceBuffer<float> rp(p), rm(m), rv(v), rg(g), rrecv(received);
  DeviceBuffer<bf16> rpb(n);
  sum_into(rg.get(), rrecv.get(), stride, peers, n, 0);
  adamw_step(rp.get(), rm.get(), rv.get(), rg.get(), rpb.get(), n, decay, h, scalars.get(), 0);
  // Sharded: the sum inside the step.
  DeviceBuffer<float> sp(p), sm(m), sv(v), sg(g), srecv(received);
  DeviceBuffer<bf16> spb(n);
  adamw_shard(sp.get(), sm.get(), sv.get(), sg.get(), srecv.get(), stride, peers, spb.get(), n, decay, h,
              scalars.get(), 0);
  CHECK(sp.download() == rp.download());
  CHECK(sm.download() == rm.download());
  CHECK(sv.download() == rv.download());
  const auto want = rpb.download(), got = spb.download();
  CHECK(std::memcmp(got.data(), want.data(), n * sizeof(bf16)) == 0);
  CHECK(scalars.download()[0].steps == 42);
  // The FP8 guard's skip: nothing changes.
  DeviceBuffer<int> skip(std::vector<int>{1});
  adamw_shard(sp.get(), sm.get(), sv.get(), sg.get(), srecv.get(), stride, peers, spb.get(), n, decay, h,
              scalars.get(), 0, skip.get());
  CHECK(sp.download() == rp.download());
}

TEST_CASE("preload: the kernels first launched after start-up are registered") {
  CHECK(late_kernels_registered() == 20);  // optimizer 4, reduce 5, fp8 scaling 5, data 3, elementwise 3
}

TEST_CASE("gpu: the kernels first launched after start-up load at start-up") {
  SKIP_WITHOUT_GPU();
  preload_late_kernels();  // throws if one cannot be loaded
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("gpu: the sharded SGD step gives the replicated step's bits; copy_ranges copies only its ranges") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const size_t n = 4 * 1234, stride = n + 64;
  const int peers = 2;
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    const auto p = to_f32(round_f32(random_vec(rng, n))), buf = to_f32(round_f32(random_vec(rng, n)));
    const auto g = to_f32(round_f32(random_vec(rng, n))), received = to_f32(round_f32(random_vec(rng, stride * peers)));
    const SgdHyper h{0.1f, 0.9f, 0.05f, nesterov};
    // Replicated: the sum first (sum_into), then the step.
    DeviceBuffer<float> rp(p), rbuf(buf), rg(g), rrecv(received);
    DeviceBuffer<bf16> rpb(n);
    sum_into(rg.get(), rrecv.get(), stride, peers, n, 0);
    sgd_momentum_step(rp.get(), rbuf.get(), rg.get(), rpb.get(), n, h, false, 0);
    // Sharded: the sum inside the step (the bf16 copy poisoned first).
    DeviceBuffer<float> sp(p), sbuf(buf), sg(g), srecv(received);
    DeviceBuffer<bf16> spb(n);
    sgd_momentum_shard(sp.get(), sbuf.get(), sg.get(), srecv.get(), stride, peers, spb.get(), n, h, false, 0);
    CHECK(sp.download() == rp.download());
    CHECK(sbuf.download() == rbuf.download());
    const auto want = rpb.download(), got = spb.download();
    CHECK(std::memcmp(got.data(), want.data(), n * sizeof(bf16)) == 0);
    // The FP8 guard's skip: nothing changes.
    DeviceBuffer<int> skip(std::vector<int>{1});
    sgd_momentum_shard(sp.get(), sbuf.get(), sg.get(), srecv.get(), stride, peers, spb.get(), n, h, false, 0, skip.get());
    CHECK(sp.download() == rp.download());
  }
  // copy_ranges: two destinations get src over the ranges, nothing elsewhere (still poisoned).
  const size_t m = 300000;
  const auto src = to_f32(random_vec(rng, m));
  DeviceBuffer<float> dsrc(src), d0(m), d1(m);
  const std::vector<FloatRange> ranges{{0, 3}, {1000, 1280}, {40000, 252160}, {299999, 1}};
  DeviceBuffer<FloatRange> dranges(ranges);
  Fp32Copies dsts{{d0.get(), d1.get()}, 2};
  copy_ranges(dsrc.get(), dranges.get(), static_cast<int>(ranges.size()), dsts, 0);
  for (const DeviceBuffer<float>* d : {&d0, &d1}) {
    const auto out = d->download();
    size_t wrong = 0;
    for (size_t i = 0; i < m; ++i) {
      bool inside = false;
      for (const FloatRange& r : ranges) inside = inside || (i >= r.begin && i < r.begin + r.count);
      float poison;
      const unsigned bits = 0xFFFFFFFFu;
      std::memcpy(&poison, &bits, sizeof poison);
      const float expect = inside ? src[i] : poison;
      wrong += std::memcmp(&out[i], &expect, sizeof(float)) != 0;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("gpu: random fills are deterministic and have the asked distribution") {
  SKIP_WITHOUT_GPU();
  const size_t n = 1 << 20;
  DeviceBuffer<float> a(n), b(n);
  fill_normal(a.get(), n, 7, 3, 0.5f, 2.0f, -INFINITY, INFINITY, 0);
  fill_normal(b.get(), n, 7, 3, 0.5f, 2.0f, -INFINITY, INFINITY, 0);
  const auto va = a.download(), vb = b.download();
  CHECK(va == vb);
  double mean = 0, var = 0;
  for (float v : va) mean += v / n;
  for (float v : va) var += (v - mean) * (v - mean) / n;
  CHECK(std::abs(mean - 0.5) < 0.01);
  CHECK(std::abs(std::sqrt(var) - 2.0) < 0.01);
  fill_normal(b.get(), n, 8, 3, 0.5f, 2.0f, -INFINITY, INFINITY, 0);
  CHECK(b.download() != va);
  fill_normal(a.get(), n, 7, 4, 0.0f, 1.0f, -0.5f, 0.5f, 0);  // truncation
  for (float v : a.download()) REQUIRE((v >= -0.5f && v <= 0.5f));
  fill_uniform(a.get(), n, 7, 5, -0.25f, 0.25f, 0);
  double lo = 1, hi = -1;
  for (float v : a.download()) { lo = std::min<double>(lo, v); hi = std::max<double>(hi, v); }
  CHECK(lo >= -0.25);
  CHECK(hi < 0.25);
  CHECK(lo < -0.249);
  CHECK(hi > 0.249);
  DeviceBuffer<int> labels(100);
  fill_labels(labels.get(), 100, 250, 7, 0);
  const auto l = labels.download();
  for (int i = 0; i < 100; ++i) REQUIRE(l[i] == (250 + i) % 7);
}

TEST_CASE("gpu: fused attention forward and backward against the reference") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  struct Shape { int B, T, H, hd; };
  for (Shape s : {Shape{2, 197, 2, 80}, Shape{1, 17, 4, 16}, Shape{2, 50, 1, 64}, Shape{1, 65, 2, 128},
                  Shape{1, 257, 1, 64}, Shape{3, 5, 2, 32}, Shape{1, 200, 1, 48}, Shape{1, 577, 1, 96},
                  Shape{2, 2, 1, 112},
                  // head dims that are multiples of 8 only, run padded to 16 (ViT-g/14's 88 among them)
                  Shape{2, 197, 2, 88}, Shape{1, 50, 3, 40}, Shape{1, 65, 2, 120}, Shape{2, 17, 2, 8},
                  Shape{1, 257, 1, 72},
                  // the single-pass backward's edges: T = 96 (its largest, 6 whole groups), 16 (one
                  // group), 81 (6 groups, the last partly padding), 65 (5: a one-group step after
                  // the second load group), 33 (3: a one-group step at 32), 1, and 97 (the first T past it)
                  Shape{1, 96, 2, 64}, Shape{2, 16, 1, 32}, Shape{2, 81, 1, 80}, Shape{2, 65, 1, 64},
                  Shape{1, 33, 1, 80}, Shape{2, 1, 2, 64}, Shape{1, 97, 1, 16},
                  // the resident backward's: four whole tiles, three with a partial one, T = 128
                  // (two tiles: WG 2 owns none), 193 (a fourth tile of one row), 236 (a fourth
                  // of 44 rows: three k16 steps; the shapes above have one, two and four)
                  Shape{1, 256, 1, 80}, Shape{3, 130, 2, 64}, Shape{1, 128, 2, 64}, Shape{2, 193, 1, 64},
                  Shape{1, 236, 2, 80},
                  // the resident forward at hd 128 (one CTA an SM): four tiles with a narrow last
                  // one, four whole ones (the streamed backward)
                  Shape{2, 197, 1, 128}, Shape{1, 256, 2, 128},
                  // the resident forward past 256 tokens: four warpgroups, every Q tile its buffer
                  // (ViT-H/14's 257), eight or four buffers reused (ViT-L/16 at 384 px's 577); two
                  // warpgroups, four buffers (hd 128's 300) or two (641, 832)
                  Shape{2, 257, 2, 80}, Shape{1, 577, 2, 64}, Shape{1, 577, 1, 80}, Shape{1, 300, 1, 128},
                  Shape{1, 641, 1, 80}, Shape{1, 832, 1, 64},
                  // the resident backward past 256 tokens: 1 to 16 keys past four tiles in one CTA
                  // (257 above, 270, 272), 17 in a key block of their own (273: two dQ planes);
                  // key blocks with 8 keys after two whole blocks (three planes); a last block of
                  // four tiles, the most key blocks (4) and query tiles (16)
                  Shape{2, 270, 1, 80}, Shape{1, 272, 2, 64}, Shape{2, 273, 1, 80}, Shape{1, 520, 2, 64},
                  Shape{1, 1024, 1, 80},
                  // hd 128's key blocks of two tiles (the hd-128 shapes above too): one tile (key
                  // warpgroup 2 owns none), a last block of one key, the most planes (8; 16
                  // query tiles), and ViT shapes' 577 (five blocks, the last of two tiles)
                  Shape{2, 17, 2, 128}, Shape{1, 129, 2, 128}, Shape{1, 1024, 1, 128}, Shape{1, 577, 1, 128},
                  // 257 at hd 128: key blocks 2, 2 and one of one key
                  Shape{2, 257, 1, 128}}) {
    CAPTURE(s.T);
    CAPTURE(s.hd);
    if (!attention_unsupported_reason(s.T, s.hd).empty()) {
      FAIL_CHECK("unsupported: " << attention_unsupported_reason(s.T, s.hd));
      continue;
    }
    AttentionCase c(rng, s.B, s.T, s.H, s.hd);
    // Every forward that applies, poisoned outputs each; the backward then runs on Auto's.
    const bool resident_fwd = attention_forward_resident_supported(s.T, s.hd);
    // where K and V fit in shared memory beside two Q tiles
    CHECK(resident_fwd == ((s.hd == 64 && s.T <= 832) || (s.hd == 80 && s.T <= 656) || (s.hd == 128 && s.T <= 384)));
    std::vector<AttentionForward> forwards = {AttentionForward::Streamed};
    if (resident_fwd) forwards.push_back(AttentionForward::Resident);
    forwards.push_back(AttentionForward::Auto);
    for (const AttentionForward kind : forwards) {
      CAPTURE(static_cast<int>(kind));
      c.out.poison();
      c.lse.poison();
      attention_forward(c.qkv.get(), c.out.get(), c.lse.get(), s.B, s.T, s.H, s.hd, 0, kind);
      CHECK(rel_error(to_f64(c.out.download()), c.out_ref) < 1e-2);
      CHECK(rel_error(to_f64(c.lse.download()), c.lse_ref) < 1e-4);
    }
    // Every backward that applies (the streamed one everywhere). The resident one needs sm_90a:
    // the test machines are Hopper, and anywhere else it must say so.
    std::vector<AttentionBackward> kinds = {AttentionBackward::Streamed};
    const bool single = attention_single_pass_supported(s.T, s.hd);
    CHECK(single == (s.T <= 96 && (s.hd == 16 || s.hd == 32 || s.hd == 64 || s.hd == 80)));
    if (single) kinds.push_back(AttentionBackward::SinglePass);
    const bool resident = attention_resident_supported(s.T, s.hd);
    CHECK(resident == (s.T <= 1024 && (s.hd == 64 || s.hd == 80 || s.hd == 128)));  // key blocks past 256, at hd 128 always
    if (resident) kinds.push_back(AttentionBackward::Resident);
    for (const AttentionBackward kind : kinds) {
      CAPTURE(static_cast<int>(kind));
      c.dqkv.poison();
      attention_backward(c.qkv.get(), c.out.get(), c.dout.get(), c.lse.get(), c.delta.get(), c.dqkv.get(), s.B, s.T, s.H,
                         s.hd, 0, kind);
      const auto got = to_f64(c.dqkv.download());
      // dQ, dK, dV separately: each is bf16 products of bf16-rounded P and dS. dQ and dK also
      // carry delta = rowsum(dO * O) taken from the bf16 output (as FlashAttention does); where a
      // row has very few keys, dS = P (dP - delta) is a difference of near-equal terms and that
      // rounding weighs more (2.03e-2 seen once at T = 2, against ~5e-3 at ViT lengths).
      const double tol = s.T < 8 ? 4e-2 : 2e-2;
      std::vector<double> a[3], b[3];  // dQ, dK, dV
      for (int part = 0; part < 3; ++part) a[part] = c.part(got, part), b[part] = c.part(c.dqkv_ref, part);
      for (int part = 0; part < 3; ++part) {
        CAPTURE(part);
        if (s.T == 1 && part < 2) {
          // One key: P = 1 and dS = dP - delta = 0 exactly, so dQ and dK are zero and only the
          // rounding of delta is left: small against dV's scale (a relative error means nothing).
          double err = 0, dv = 0;
          for (size_t i = 0; i < a[part].size(); ++i) err += (a[part][i] - b[part][i]) * (a[part][i] - b[part][i]);
          for (double x : b[2]) dv += x * x;
          CHECK(std::isfinite(err));
          CHECK(std::sqrt(err) < tol * std::sqrt(dv));
        } else {
          CHECK(rel_error(a[part], b[part]) < tol);
        }
      }
    }
  }
}

// cuDNN's fused attention (kernels/cudnn_attention.h) on the engine's layouts: where the library
// loads, the same checks as the engine's kernels, and each side's forward statistics feeding the
// other's backward (both are the natural-log-sum-exp of the scaled scores).
TEST_CASE("gpu: cuDNN's fused attention against the reference") {
  SKIP_WITHOUT_GPU();
  const std::string why = cudnn_attention_unavailable_reason();
  if (!why.empty()) {
    MESSAGE("skipped: " << why);
    mark_skipped();
    return;
  }
  FRESH_RNG(rng);
  CudnnAttention cudnn, summed(false);  // the deterministic backward graph, and the one summing dQ in fp32
  struct Shape { int B, T, H, hd; };
  for (Shape s : {Shape{2, 197, 2, 80}, Shape{1, 65, 2, 128}, Shape{2, 257, 1, 64}, Shape{3, 50, 1, 64},
                  Shape{1, 577, 1, 128}, Shape{1, 17, 2, 80}}) {
    CAPTURE(s.T);
    CAPTURE(s.hd);
    AttentionCase c(rng, s.B, s.T, s.H, s.hd);
    cudnn.prepare(s.B, s.T, s.H, s.hd);
    summed.prepare(s.B, s.T, s.H, s.hd);
    // dQ, dK, dV from a cuDNN backward (or the engine's: nullptr) after the forward of either.
    const auto check_dqkv = [&](const std::string& forward, CudnnAttention* backward) {
      CAPTURE(forward);
      CAPTURE(backward == &summed);
      c.dqkv.poison();
      if (backward)
        backward->backward(c.qkv.get(), c.out.get(), c.dout.get(), c.lse.get(), c.dqkv.get(), s.B, s.T, s.H, s.hd, 0);
      else
        attention_backward(c.qkv.get(), c.out.get(), c.dout.get(), c.lse.get(), c.delta.get(), c.dqkv.get(), s.B, s.T,
                           s.H, s.hd, 0);
      const auto got = to_f64(c.dqkv.download());
      for (int part = 0; part < 3; ++part) {  // dQ, dK, dV
        CAPTURE(part);
        CHECK(rel_error(c.part(got, part), c.part(c.dqkv_ref, part)) < 2e-2);
      }
    };
    c.out.poison();
    c.lse.poison();
    cudnn.forward(c.qkv.get(), c.out.get(), c.lse.get(), s.B, s.T, s.H, s.hd, 0);
    CHECK(rel_error(to_f64(c.out.download()), c.out_ref) < 1e-2);
    CHECK(rel_error(to_f64(c.lse.download()), c.lse_ref) < 1e-4);
    check_dqkv("cuDNN's", &cudnn);
    check_dqkv("cuDNN's", &summed);
    check_dqkv("cuDNN's", nullptr);
    c.out.poison();
    c.lse.poison();
    attention_forward(c.qkv.get(), c.out.get(), c.lse.get(), s.B, s.T, s.H, s.hd, 0);
    check_dqkv("the engine's", &cudnn);
    CHECK(cudnn.backward_deterministic(s.B, s.T, s.H, s.hd));  // the deterministic graph has an engine
    const std::string determinism = summed.backward_deterministic(s.B, s.T, s.H, s.hd) ? "deterministic" : "not deterministic";
    MESSAGE("cuDNN " << CudnnAttention::version_string() << " at T " << s.T << ", hd " << s.hd << ": the summing backward "
                     << determinism);
  }
}

// Every score of a row far below zero (log-sum-exp about -115): the engine's kernels subtract the
// log-sum-exp before exponentiating, so nothing overflows. cuDNN's fused backward is reported to
// return NaN here where its last key tile runs past T; the padding mask in its graph
// (kernels/cudnn_attention.cpp) is the remedy, and both must give finite, correct gradients.
TEST_CASE("gpu: attention where every score is far below zero, the engine's and cuDNN's") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const bool cudnn_loads = cudnn_attention_unavailable_reason().empty();
  std::unique_ptr<CudnnAttention> cudnn = cudnn_loads ? std::make_unique<CudnnAttention>() : nullptr;
  struct Shape { int B, T, H, hd; };
  for (Shape s : {Shape{2, 197, 2, 80}, Shape{2, 192, 1, 64}, Shape{1, 257, 2, 64}, Shape{2, 65, 1, 128}}) {
    CAPTURE(s.T);
    CAPTURE(s.hd);
    AttentionCase c(rng, s.B, s.T, s.H, s.hd, true);
    for (double l : c.lse_ref) REQUIRE(l < -88.8);
    // dQ's column 0 of each head is -120 sqrt(hd) times sum_j dS_ij, which is 0: what any bf16
    // backward leaves there is the rounding of dS times 1073 (0.29 of dQ's norm, the engine's
    // and cuDNN's alike). It is checked for finiteness only; the rest against the reference.
    const auto without_column_0 = [&](std::vector<double> dq) {
      for (size_t i = 0; i < dq.size(); i += s.hd) dq[i] = 0;
      return dq;
    };
    const auto check = [&](const std::string& who) {
      CAPTURE(who);
      CHECK(rel_error(to_f64(c.out.download()), c.out_ref) < 1e-2);
      const auto got = to_f64(c.dqkv.download());
      CHECK(std::all_of(got.begin(), got.end(), [](double x) { return std::isfinite(x); }));
      CHECK(rel_error(without_column_0(c.part(got, 0)), without_column_0(c.part(c.dqkv_ref, 0))) < 2e-2);
      for (int part = 1; part < 3; ++part) {
        CAPTURE(part);
        CHECK(rel_error(c.part(got, part), c.part(c.dqkv_ref, part)) < 2e-2);
      }
    };
    c.out.poison(), c.lse.poison(), c.dqkv.poison();
    attention_forward(c.qkv.get(), c.out.get(), c.lse.get(), s.B, s.T, s.H, s.hd, 0);
    CHECK(rel_error(to_f64(c.lse.download()), c.lse_ref) < 1e-4);
    attention_backward(c.qkv.get(), c.out.get(), c.dout.get(), c.lse.get(), c.delta.get(), c.dqkv.get(), s.B, s.T, s.H,
                       s.hd, 0);
    check("the engine's");
    if (!cudnn) continue;
    cudnn->prepare(s.B, s.T, s.H, s.hd);
    c.out.poison(), c.lse.poison(), c.dqkv.poison();
    cudnn->forward(c.qkv.get(), c.out.get(), c.lse.get(), s.B, s.T, s.H, s.hd, 0);
    cudnn->backward(c.qkv.get(), c.out.get(), c.dout.get(), c.lse.get(), c.dqkv.get(), s.B, s.T, s.H, s.hd, 0);
    check("cuDNN " + CudnnAttention::version_string() + "'s");
  }
}
