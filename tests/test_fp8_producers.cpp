// GPU tier: the kernels that write FP8 GEMM operands as they compute them (kernels/fp8.h):
// the cast with its bias sums and statistics, GELU forward and backward, LayerNorm forward, and
// the transpose of kept codes. Codes are checked against the oracle's encoding of the float64
// truth; the GELU backward's recompute against the forward's codes, bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/layernorm.h"
#include "tests/gpu_util.h"
#include "tests/harness.h"
#include "tests/reference/fp8.h"
#include "tests/reference/reference.h"

using bf16 = __nv_bfloat16;

namespace {
ref::Fp8 oracle_kind(Fp8Kind k) { return k == Fp8Kind::E4M3 ? ref::Fp8::E4M3 : ref::Fp8::E5M2; }

// A code the device computed from fp32 arithmetic: the oracle's encoding of the truth t (already
// scaled), or of a value within e of it (the fp32 rounding of what led to t).
bool within_rounding(uint8_t got, double t, double e, ref::Fp8 f) {
  const float lo = ref::fp8_decode(ref::fp8_encode(static_cast<float>(t - e), f), f);
  const float hi = ref::fp8_decode(ref::fp8_encode(static_cast<float>(t + e), f), f);
  const float v = ref::fp8_decode(got, f);
  return v >= lo && v <= hi;
}

double amax_of(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Codes of a tensor against the truth (unscaled) times scale, allowing fp32's rounding: 1e-5
// relative, and 1e-6 of the tensor's largest value absolute (cancellations in LN's shift).
int codes_off(const std::vector<uint8_t>& got, const std::vector<double>& truth, double scale, Fp8Kind kind) {
  const double floor = 1e-6 * amax_of(truth) * scale;
  int off = 0;
  for (size_t i = 0; i < truth.size(); ++i) {
    const double t = truth[i] * scale;
    off += !within_rounding(got[i], t, 1e-5 * std::fabs(t) + floor, oracle_kind(kind));
  }
  return off;
}

std::vector<uint8_t> transposed(const std::vector<uint8_t>& a, int rows, int cols) {
  std::vector<uint8_t> t(a.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) t[static_cast<size_t>(c) * rows + r] = a[static_cast<size_t>(r) * cols + c];
  return t;
}
// GELU's FP8 forward and backward on h [M, N] with the output gradient da, against the oracle;
// the backward's recomputed input against the forward's codes, bit for bit.
void check_gelu_fp8(const std::vector<double>& h, const std::vector<double>& da, int M, int N, float a_scale,
                    float dh_scale) {
  const size_t n = static_cast<size_t>(M) * N;
  std::vector<double> a_ref(n), dh_ref(n), db_ref(N, 0.0);
  for (size_t i = 0; i < n; ++i) {
    a_ref[i] = ref::gelu(h[i]);
    dh_ref[i] = da[i] * ref::gelu_grad(h[i]);
    db_ref[i % N] += dh_ref[i];
  }
  DeviceBuffer<bf16> h_in(to_bf16(h)), da_in(to_bf16(da));
  DeviceBuffer<float> as(std::vector<float>{a_scale}), ds(std::vector<float>{dh_scale});
  DeviceBuffer<float> a_amax(std::vector<float>{0.0f}), dh_amax(std::vector<float>{0.0f}), db(N),
      partial(fp8_cast_partial_floats(M, N));
  DeviceBuffer<uint8_t> a8(n), a8t(n), dh8(n), dh8t(n);

  gelu_forward_fp8(h_in.get(), M, N, Fp8Out{Fp8Kind::E4M3, as.get(), a8.get(), nullptr, a_amax.get()}, 0);
  const auto a_codes = a8.download();
  CHECK(codes_off(a_codes, a_ref, a_scale, Fp8Kind::E4M3) == 0);
  CHECK(std::fabs(a_amax.download()[0] - amax_of(a_ref)) <= 1e-6 * amax_of(a_ref));

  gelu_backward_fp8(da_in.get(), h_in.get(), M, N, Fp8Out{Fp8Kind::E5M2, ds.get(), dh8.get(), dh8t.get(), dh_amax.get()},
                    Fp8Out{Fp8Kind::E4M3, as.get(), nullptr, a8t.get()}, db.get(), partial.get(), 0);
  const auto dh_codes = dh8.download();
  CHECK(codes_off(dh_codes, dh_ref, dh_scale, Fp8Kind::E5M2) == 0);
  CHECK(dh8t.download() == transposed(dh_codes, M, N));
  CHECK(std::fabs(dh_amax.download()[0] - amax_of(dh_ref)) <= 1e-5 * amax_of(dh_ref));
  CHECK(rel_error(to_f64(db.download()), db_ref) < 1e-4);
  // fc2's input for its weight gradient: the forward's very codes, transposed.
  CHECK(a8t.download() == transposed(a_codes, M, N));
  // The current recipe's amax pass: the amax alone; the bias sums untouched (added once, by the
  // writing pass, under accumulation).
  const auto db_before = db.download();
  dh8.poison();
  dh_amax.upload(std::vector<float>{0.0f});
  gelu_backward_fp8(da_in.get(), h_in.get(), M, N, Fp8Out{Fp8Kind::E5M2, nullptr, dh8.get(), nullptr, dh_amax.get()},
                    Fp8Out{Fp8Kind::E4M3, as.get(), nullptr, a8t.get()}, db.get(), partial.get(), 0,
                    GradWrite::Accumulate);
  CHECK(std::fabs(dh_amax.download()[0] - amax_of(dh_ref)) <= 1e-5 * amax_of(dh_ref));
  CHECK(db.download() == db_before);
  for (uint8_t c : dh8.download()) REQUIRE(c == 0xFF);

  // With statistics (--fp8-stats), at a scale that saturates the largest values: every value
  // seen, the saturated counted, and the underflowed (nonzero values whose code is zero).
  const float big_scale = a_scale * 1.3f;
  DeviceBuffer<float> bs(std::vector<float>{big_scale});
  DeviceBuffer<unsigned long long> stats(std::vector<unsigned long long>{0, 0, 0});
  a8.poison();
  gelu_forward_fp8(h_in.get(), M, N, Fp8Out{Fp8Kind::E4M3, bs.get(), a8.get(), nullptr, a_amax.get(), stats.get()}, 0);
  const auto big_codes = a8.download();
  CHECK(codes_off(big_codes, a_ref, big_scale, Fp8Kind::E4M3) == 0);
  // An underflow is a nonzero value with a zero code; past |h| = 13 the GPU's GELU may itself be
  // zero (normal_cdf.h), so those values may count or not.
  unsigned long long under = 0, maybe_under = 0, saturated = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool zero_code = a_ref[i] != 0 && (big_codes[i] & 0x7f) == 0;
    under += zero_code && std::fabs(h[i]) < 13;
    maybe_under += zero_code && std::fabs(h[i]) >= 13;
    saturated += std::fabs(a_ref[i] * big_scale) > 448;
  }
  const auto st = stats.download();
  CHECK(st[0] >= under);
  CHECK(st[0] <= under + maybe_under);
  CHECK(st[1] == saturated);
  CHECK(saturated > 0);
  CHECK(st[2] == n);
  // The current recipe's first pass: no scale, nothing written, nothing counted, the amax measured.
  a8.poison();
  a_amax.upload(std::vector<float>{0.0f});
  gelu_forward_fp8(h_in.get(), M, N, Fp8Out{Fp8Kind::E4M3, nullptr, a8.get(), nullptr, a_amax.get(), stats.get()}, 0);
  CHECK(std::fabs(a_amax.download()[0] - amax_of(a_ref)) <= 1e-6 * amax_of(a_ref));
  for (uint8_t c : a8.download()) REQUIRE(c == 0xFF);
  CHECK(stats.download()[2] == n);
}

}  // namespace

TEST_CASE("gpu: FP8 cast with bias sums, statistics, and an amax-only pass") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  // Partial 64 x 128 tiles both ways; 80 rows: one block walks both row tiles, 1160: three
  // blocks a column walk 19 (7, 6 and 6 of them), the bias sums crossing blocks.
  for (const int rows : {80, 1160}) {
    for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
      const int cols = 136;
      const size_t n = static_cast<size_t>(rows) * cols;
      CAPTURE(rows);
      CAPTURE(int(kind));
      const ref::Fp8 f = oracle_kind(kind);
      const float scale = kind == Fp8Kind::E4M3 ? 100.0f : 3000.0f;
      const double fmax = ref::fp8_format(f).max;
      auto x = round_bf16(random_vec(rng, n, -3, 3));
      for (size_t i = 0; i < n; i += 97) x[i] = 1e-9;  // underflow to zero after scaling
      x[5] = 8192;                                     // saturates
      x[6] = 0;                                        // zero is not an underflow
      std::vector<double> db_ref(cols, 0.0);
      unsigned long long under = 0, sat = 0;
      for (size_t i = 0; i < n; ++i) {
        db_ref[i % cols] += x[i];
        const uint8_t code = ref::fp8_encode(static_cast<float>(x[i]) * scale, f);
        under += x[i] != 0 && (code & 0x7f) == 0;
        sat += std::fabs(static_cast<float>(x[i]) * scale) > fmax;
      }
      x = round_bf16(x);
      DeviceBuffer<bf16> in(to_bf16(x));
      DeviceBuffer<float> s(std::vector<float>{scale}), amax(std::vector<float>{0.5f}), db(cols),
          partial(fp8_cast_partial_floats(rows, cols));
      DeviceBuffer<uint8_t> out(n), out_t(n);
      DeviceBuffer<unsigned long long> stats(std::vector<unsigned long long>{0, 0, 0});
      cast_to_fp8(in.get(), rows, cols, Fp8Out{kind, s.get(), out.get(), out_t.get(), amax.get(), stats.get()}, 0,
                  db.get(), partial.get());
      const auto o = out.download();
      int mismatches = 0;
      for (size_t i = 0; i < n; ++i) mismatches += o[i] != ref::fp8_encode(static_cast<float>(x[i]) * scale, f);
      CHECK(mismatches == 0);
      CHECK(out_t.download() == transposed(o, rows, cols));
      CHECK(amax.download()[0] == static_cast<float>(amax_of(x)));
      CHECK(rel_error(to_f64(db.download()), db_ref) < 1e-5);
      const auto st = stats.download();
      CHECK(st[0] == under);
      CHECK(under >= n / 97 - 1);
      CHECK(st[1] == sat);
      CHECK(sat >= 1);
      CHECK(st[2] == n);

      // The current recipe's first pass: no scale, nothing written, only the amax measured; the
      // bias sums neither, which the writing pass adds under accumulation.
      out.poison();
      amax.upload(std::vector<float>{0.0f});
      const auto db_before = db.download();
      cast_to_fp8(in.get(), rows, cols, Fp8Out{kind, nullptr, out.get(), nullptr, amax.get(), stats.get()}, 0,
                  db.get(), partial.get(), GradWrite::Accumulate);
      CHECK(amax.download()[0] == static_cast<float>(amax_of(x)));
      for (uint8_t c : out.download()) REQUIRE(c == 0xFF);
      CHECK(stats.download()[2] == n);  // nothing written, nothing counted
      CHECK(db.download() == db_before);
    }
  }
}

TEST_CASE("gpu: FP8 GELU forward, and the backward's gradient, bias sums and recomputed input") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int M = 80, N = 200;
  const size_t n = static_cast<size_t>(M) * N;
  check_gelu_fp8(round_bf16(random_vec(rng, n, -5, 5)), round_bf16(random_vec(rng, n, -1e-3, 1e-3)), M, N,
                 448.0f / 5.0f, 57344.0f / 1e-3f);
}

// More values than the FP8 GELU forward's grid covers in one pass (8192 blocks x 256 threads x
// 8), so that its grid-stride loop goes round again: the backward still recomputes its codes.
TEST_CASE("gpu: FP8 GELU forward past one pass of its grid, against the backward's recompute") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int M = 4104, N = 4104;
  const size_t n = static_cast<size_t>(M) * N;
  REQUIRE(n > size_t(8192) * 256 * 8);
  DeviceBuffer<bf16> h(to_bf16(random_vec(rng, n, -5, 5))), da(to_bf16(random_vec(rng, n, -1e-3, 1e-3)));
  DeviceBuffer<float> as(std::vector<float>{448.0f / 5.0f}), ds(std::vector<float>{57344.0f / 1e-3f}), db(N),
      partial(fp8_cast_partial_floats(M, N));
  DeviceBuffer<uint8_t> a8(n), a8t(n), dh8(n);
  gelu_forward_fp8(h.get(), M, N, Fp8Out{Fp8Kind::E4M3, as.get(), a8.get(), nullptr, nullptr}, 0);
  gelu_backward_fp8(da.get(), h.get(), M, N, Fp8Out{Fp8Kind::E5M2, ds.get(), dh8.get(), nullptr, nullptr},
                    Fp8Out{Fp8Kind::E4M3, as.get(), nullptr, a8t.get()}, db.get(), partial.get(), 0);
  CHECK(a8t.download() == transposed(a8.download(), M, N));
}

TEST_CASE("gpu: FP8 transpose of kept codes, over partial tiles") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  for (const auto& [rows, cols] : {std::pair{72, 200}, std::pair{64, 128}, std::pair{8, 8}, std::pair{200, 1288}}) {
    CAPTURE(rows);
    CAPTURE(cols);
    std::vector<uint8_t> codes(static_cast<size_t>(rows) * cols);
    std::uniform_int_distribution<int> byte(0, 255);
    for (uint8_t& c : codes) c = static_cast<uint8_t>(byte(rng));
    DeviceBuffer<uint8_t> in(codes), out_t(codes.size());  // out_t poisoned
    transpose_fp8(in.get(), rows, cols, out_t.get(), 0);
    CHECK(out_t.download() == transposed(codes, rows, cols));
  }
}

// Every bf16 input below 64 in magnitude (zero and the subnormals included), through the FP8
// GELU forward and backward, against the oracle: the whole range normal_cdf's polynomial and the
// exponential's underflow meet in training, not a random sample of it.
TEST_CASE("gpu: FP8 GELU over every bf16 value below 64 in magnitude") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  std::vector<double> h = every_bf16_below_pow2(6);
  const int N = 128, M = static_cast<int>((h.size() + 8 * N - 1) / (8 * N) * 8);  // rows a multiple of 8
  const size_t n = static_cast<size_t>(M) * N;
  for (size_t i = h.size(); i < n; ++i) h.push_back(h[i % 1000]);
  std::shuffle(h.begin(), h.end(), rng);
  check_gelu_fp8(h, round_bf16(random_vec(rng, n, -1e-3, 1e-3)), M, N, 448.0f / 64.0f, 57344.0f / 1.2e-3f);
}

TEST_CASE("gpu: FP8 LayerNorm forward") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  // 3400 rows: past the fixed grid's 3168, so that a warp walks two rows.
  for (const int M : {80, 3400}) {
    CAPTURE(M);
    const int D = 200;
    const size_t n = static_cast<size_t>(M) * D;
    const auto x = round_f32(random_vec(rng, n, -3, 3));
    const auto w = round_f32(random_vec(rng, D, 0.5, 1.5)), b = round_f32(random_vec(rng, D));
    std::vector<double> y_ref, mean_ref, rstd_ref;
    ref::layernorm_forward(M, D, x, w.data(), b.data(), 1e-6, &y_ref, &mean_ref, &rstd_ref);
    const float scale = 448.0f / 4.0f;
    DeviceBuffer<float> dx(to_f32(x)), dw(to_f32(w)), db(to_f32(b)), mean(M), rstd(M), s(std::vector<float>{scale}),
        amax(std::vector<float>{0.0f});
    DeviceBuffer<uint8_t> y8(n);
    layernorm_forward_fp8(dx.get(), D, dw.get(), db.get(), Fp8Out{Fp8Kind::E4M3, s.get(), y8.get(), nullptr, amax.get()},
                          mean.get(), rstd.get(), M, D, 1e-6f, 0);
    const auto codes = y8.download();
    CHECK(codes_off(codes, y_ref, scale, Fp8Kind::E4M3) == 0);
    CHECK(rel_error(to_f64(mean.download()), mean_ref) < 1e-5);
    CHECK(rel_error(to_f64(rstd.download()), rstd_ref) < 1e-5);
    CHECK(std::fabs(amax.download()[0] - amax_of(y_ref)) <= 1e-5 * amax_of(y_ref));

    // The current recipe's first pass writes nothing and measures the amax.
    y8.poison();
    amax.upload(std::vector<float>{0.0f});
    layernorm_forward_fp8(dx.get(), D, dw.get(), db.get(), Fp8Out{Fp8Kind::E4M3, nullptr, y8.get(), nullptr, amax.get()},
                          mean.get(), rstd.get(), M, D, 1e-6f, 0);
    CHECK(std::fabs(amax.download()[0] - amax_of(y_ref)) <= 1e-5 * amax_of(y_ref));
    for (uint8_t c : y8.download()) REQUIRE(c == 0xFF);
  }
}

TEST_CASE("gpu: FP8 batched cast equals one cast a tensor, with each tensor's own scale and amax") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int rows = 72, cols = 136, count = 3;
  const size_t n = static_cast<size_t>(rows) * cols, in_stride = n + 64, out_stride = n + 256;
  struct Meta {  // scale and amax in one record, as in Fp8Meta
    float scale, amax, pad[2];
  };
  auto x = round_bf16(random_vec(rng, in_stride * count, -3, 3));
  std::vector<Meta> metas(count);
  for (int z = 0; z < count; ++z) metas[z] = {10.0f * (z + 1), 0.0f, {0, 0}};
  DeviceBuffer<bf16> in(to_bf16(x));
  DeviceBuffer<Meta> dm(metas);
  DeviceBuffer<uint8_t> out(out_stride * count), out_t(out_stride * count), want(n), want_t(n);
  DeviceBuffer<unsigned long long> stats(std::vector<unsigned long long>(3 * count, 0));
  cast_to_fp8_batched(in.get(), in_stride, rows, cols,
                      Fp8Out{Fp8Kind::E4M3, &dm.get()->scale, out.get(), out_t.get(), &dm.get()->amax, stats.get()},
                      Fp8Strides{out_stride, out_stride, sizeof(Meta), 3 * sizeof(unsigned long long)}, count, 0);
  const auto o = out.download(), ot = out_t.download();
  const auto m = dm.download();
  const auto st = stats.download();
  for (int z = 0; z < count; ++z) {
    CAPTURE(z);
    DeviceBuffer<float> s(std::vector<float>{metas[z].scale}), amax(std::vector<float>{0.0f});
    cast_to_fp8(in.get() + z * in_stride, rows, cols, Fp8Out{Fp8Kind::E4M3, s.get(), want.get(), want_t.get(), amax.get()},
                0);
    const auto w = want.download(), wt = want_t.download();
    CHECK(std::equal(w.begin(), w.end(), o.begin() + z * out_stride));
    CHECK(std::equal(wt.begin(), wt.end(), ot.begin() + z * out_stride));
    CHECK(m[z].amax == amax.download()[0]);
    CHECK(m[z].scale == metas[z].scale);
    CHECK(st[3 * z + 2] == n);
  }
}
