// The FP8 oracle and the FP8 building blocks.
// CPU tier: the oracle against CUDA's own host conversions, bit for bit: every code's
// decoding, and the encoding of every code's value, of the midpoints between neighbouring codes
// (ties to even) and of values just off them, of values past the largest one (saturation), of
// values below the smallest subnormal, infinities and NaN.
#include <cuda_fp8.h>
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/gemm.h"
#include "kernels/fp8.h"
#include "kernels/fp8_scaling.h"
#include "tests/gpu_util.h"
#include "tests/harness.h"
#include "tests/reference/fp8.h"

using bf16 = __nv_bfloat16;

namespace {
__nv_fp8_interpretation_t cuda_kind(ref::Fp8 f) { return f == ref::Fp8::E4M3 ? __NV_E4M3 : __NV_E5M2; }
uint8_t cuda_encode(float x, ref::Fp8 f) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, cuda_kind(f)); }
float cuda_decode(uint8_t c, ref::Fp8 f) {
  return static_cast<float>(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), cuda_kind(f))));
}
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }
}  // namespace

TEST_CASE("fp8: E4M3 and E5M2 decoding and encoding equal CUDA's, bit for bit") {
  for (ref::Fp8 f : {ref::Fp8::E4M3, ref::Fp8::E5M2}) {
    CAPTURE(static_cast<int>(f));
    std::vector<float> values;  // finite, non-negative code values in increasing order
    for (int c = 0; c < 256; ++c) {
      CAPTURE(c);
      const float mine = ref::fp8_decode(static_cast<uint8_t>(c), f);
      REQUIRE(same(mine, cuda_decode(static_cast<uint8_t>(c), f)));
      if (c < 128 && std::isfinite(mine)) values.push_back(mine);
    }
    std::vector<float> probes = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e30f, -1e30f, 1e-30f, -1e-30f};
    for (size_t i = 0; i < values.size(); ++i) {
      probes.push_back(values[i]);
      if (i + 1 < values.size()) {
        const float mid = 0.5f * (values[i] + values[i + 1]);  // exact: few mantissa bits
        probes.insert(probes.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)});
      }
    }
    const float max = values.back();
    probes.insert(probes.end(), {std::nextafter(max, INFINITY), max * 1.03f, max * 1.07f, max * 2, values[1] * 0.5f,
                                 std::nextafter(values[1] * 0.5f, INFINITY), values[1] * 0.25f});
    const size_t n = probes.size();
    for (size_t i = 0; i < n; ++i) probes.push_back(-probes[i]);
    int checked = 0;
    for (float x : probes) {
      CAPTURE(x);
      REQUIRE(ref::fp8_encode(x, f) == cuda_encode(x, f));
      ++checked;
    }
    MESSAGE(checked << " encodings and 256 decodings agree with CUDA");
    CHECK(max == static_cast<float>(ref::fp8_format(f).max));
  }
}

TEST_CASE("fp8 scaling: delayed recipe, history roll, margin, zero and non-finite amax") {
  Fp8Meta m;
  m.fp8_max = 448;
  // The first step: amax 2 gives 448 / 2; with margin 1, half of that.
  m.amax = 2;
  CHECK(fp8_update(m, 4, 0));
  CHECK(m.scale == 224.0f);
  CHECK(m.scale_inv == 1.0f / 224.0f);
  CHECK(m.amax == 0.0f);  // reset for the next step's casts
  CHECK(m.history[0] == 2.0f);
  // A smaller amax: the history's maximum (2) still decides, for history_len steps.
  for (int step = 0; step < 3; ++step) {
    m.amax = 0.5f;
    CHECK(fp8_update(m, 4, 0));
    CHECK(m.scale == 224.0f);
  }
  m.amax = 0.5f;  // the 2 has rolled out of a history of 4
  CHECK(fp8_update(m, 4, 0));
  CHECK(m.scale == 896.0f);
  CHECK(m.history[0] == 0.5f);
  CHECK(m.history[3] == 0.5f);
  m.amax = 0.5f;
  CHECK(fp8_update(m, 4, 2));  // margin 2: a quarter
  CHECK(m.scale == 224.0f);
  // Non-finite amaxes stay out of the history and halve the scale; the update reports them.
  float expect = 224.0f;
  for (float bad : {NAN, INFINITY}) {
    m.amax = bad;
    CHECK_FALSE(fp8_update(m, 4, 2));
    expect *= 0.5f;
    CHECK(m.scale == expect);
    CHECK(m.scale_inv == 1.0f / expect);
    CHECK(m.history[0] == 0.5f);
  }
  m.amax = 0.5f;  // a finite amax again: the history decides
  CHECK(fp8_update(m, 4, 2));
  CHECK(m.scale == 224.0f);
  // All-zero history (a tensor that was zero so far) keeps the scale too.
  Fp8Meta z;
  z.scale = 3.0f;
  z.amax = 0.0f;
  CHECK(fp8_update(z, 8, 0));
  CHECK(z.scale == 3.0f);
  // The current recipe: history 1, the step's own amax alone.
  Fp8Meta c;
  c.fp8_max = 57344;
  c.amax = 4;
  CHECK(fp8_update(c, 1, 0));
  CHECK(c.scale == 14336.0f);
  c.amax = 0.25f;
  CHECK(fp8_update(c, 1, 0));
  CHECK(c.scale == 229376.0f);
}

// ---- GPU tier: the FP8 GEMMs, casts and scale updates against the oracle ----
namespace {
// Random FP8 codes spread over the format's range (finite ones), and their values.
std::vector<uint8_t> random_codes(std::mt19937_64& rng, size_t n, ref::Fp8 f) {
  std::vector<uint8_t> c(n);
  for (uint8_t& x : c) {
    do {
      x = static_cast<uint8_t>(rng() % 256);
    } while (!std::isfinite(ref::fp8_decode(x, f)) || std::fabs(ref::fp8_decode(x, f)) > 64);
  }
  return c;
}
}  // namespace

TEST_CASE("gpu: FP8 GEMMs (E4M3 x E4M3, E5M2 x E4M3) against a float64 product of the dequantised inputs") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  Gemm gemm(32u << 20);
  const int M = 208, N = 96, K = 128;
  struct Case { DType a, b, y; ref::Fp8 fa, fb; bool bias; };
  for (Case c : {Case{DType::E4M3, DType::E4M3, DType::BF16, ref::Fp8::E4M3, ref::Fp8::E4M3, true},
                 Case{DType::E5M2, DType::E4M3, DType::BF16, ref::Fp8::E5M2, ref::Fp8::E4M3, false},
                 Case{DType::E5M2, DType::E4M3, DType::F32, ref::Fp8::E5M2, ref::Fp8::E4M3, false},
                 Case{DType::E4M3, DType::E4M3, DType::F32, ref::Fp8::E4M3, ref::Fp8::E4M3, true}}) {
    CAPTURE(static_cast<int>(c.a));
    CAPTURE(static_cast<int>(c.y));
    const auto a = random_codes(rng, static_cast<size_t>(M) * K, c.fa), b = random_codes(rng, static_cast<size_t>(N) * K, c.fb);
    const float sa = 0.0625f, sb = 0.5f;  // dequantisation factors
    const auto bias = round_bf16(random_vec(rng, N));
    std::vector<double> want(static_cast<size_t>(M) * N);
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) {
        double s = c.bias ? bias[j] : 0.0;
        for (int k = 0; k < K; ++k)
          s += double(sa) * ref::fp8_decode(a[i * K + k], c.fa) * double(sb) * ref::fp8_decode(b[j * K + k], c.fb);
        want[static_cast<size_t>(i) * N + j] = s;
      }
    DeviceBuffer<uint8_t> da(a), db(b);
    DeviceBuffer<float> dsa(std::vector<float>{sa}), dsb(std::vector<float>{sb});
    DeviceBuffer<bf16> dbias(to_bf16(bias));
    if (c.y == DType::BF16) {
      DeviceBuffer<bf16> y(static_cast<size_t>(M) * N);
      gemm.linear_fp8(da.get(), c.a, dsa.get(), db.get(), c.b, dsb.get(), c.bias ? dbias.get() : nullptr, nullptr,
                      y.get(), c.y, M, N, K, 0);
      CHECK(rel_error(to_f64(y.download()), want) < 5e-3);
    } else {  // fp32 out, as the residual stream: with a bf16 bias, the residual added through C
      const auto resid = round_f32(random_vec(rng, static_cast<size_t>(M) * N));
      for (size_t i = 0; i < want.size(); ++i) want[i] += c.bias ? resid[i] : 0.0;
      DeviceBuffer<float> y(static_cast<size_t>(M) * N), r(to_f32(resid));
      gemm.linear_fp8(da.get(), c.a, dsa.get(), db.get(), c.b, dsb.get(), c.bias ? dbias.get() : nullptr,
                      c.bias ? r.get() : nullptr, y.get(), c.y, M, N, K, 0);
      // Hopper's FP8 tensor cores keep fewer mantissa bits than fp32 between their promotions
      // to the fp32 accumulator: errors near 2e-4, where bf16 inputs give ~1e-7.
      CHECK(rel_error(to_f64(y.download()), want) < 1e-3);
    }
  }
}

TEST_CASE("gpu: FP8 cast with transposed copy and amax, bit for bit against the oracle") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  const int rows = 80, cols = 136;  // partial 64 x 64 tiles both ways
  for (Fp8Kind kind : {Fp8Kind::E4M3, Fp8Kind::E5M2}) {
    const ref::Fp8 f = kind == Fp8Kind::E4M3 ? ref::Fp8::E4M3 : ref::Fp8::E5M2;
    auto x = round_bf16(random_vec(rng, static_cast<size_t>(rows) * cols, -3, 3));
    x[5] = 8192;  // saturates after scaling (exact in bf16, so the amax is exact too)
    const float scale = kind == Fp8Kind::E4M3 ? 100.0f : 3000.0f;
    double amax_ref = 0;
    for (double v : x) amax_ref = std::max(amax_ref, std::fabs(v));
    DeviceBuffer<bf16> in(to_bf16(x));
    DeviceBuffer<float> s(std::vector<float>{scale}), amax(std::vector<float>{0.5f});
    DeviceBuffer<uint8_t> out(static_cast<size_t>(rows) * cols), out_t(static_cast<size_t>(rows) * cols);
    cast_to_fp8(in.get(), rows, cols, Fp8Out{kind, s.get(), out.get(), out_t.get(), amax.get()}, 0);
    const auto o = out.download(), ot = out_t.download();
    int mismatches = 0;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const uint8_t want = ref::fp8_encode(static_cast<float>(x[r * cols + c]) * scale, f);
        mismatches += o[r * cols + c] != want;
        mismatches += ot[c * rows + r] != want;
      }
    CHECK(mismatches == 0);
    CHECK(amax.download()[0] == static_cast<float>(amax_ref));
    amax.upload(std::vector<float>{1e6f});  // a larger running amax survives the cast
    cast_to_fp8(in.get(), rows, cols, Fp8Out{kind, s.get(), out.get(), nullptr, amax.get()}, 0);
    CHECK(amax.download()[0] == 1e6f);
    x[17] = NAN;  // a non-finite tensor shows in its amax
    in.upload(to_bf16(x));
    cast_to_fp8(in.get(), rows, cols, Fp8Out{kind, s.get(), out.get(), nullptr, amax.get()}, 0);
    CHECK(std::isnan(amax.download()[0]));
  }
}

TEST_CASE("gpu: FP8 scale updates on the device equal the host recipe") {
  SKIP_WITHOUT_GPU();
  FRESH_RNG(rng);
  std::uniform_real_distribution<float> u(0.0f, 10.0f);
  const int count = 37, history = 16, margin = 1;
  std::vector<Fp8Meta> host(count);
  for (int i = 0; i < count; ++i) {
    host[i].fp8_max = i % 2 ? 448.0f : 57344.0f;
    host[i].scale = u(rng);
    for (int h = 0; h < history; ++h) host[i].history[h] = u(rng);
    host[i].amax = i == 5 ? NAN : i == 6 ? INFINITY : i == 7 ? 0.0f : u(rng);
  }
  DeviceBuffer<Fp8Meta> dev(host);
  DeviceBuffer<int> non_finite(std::vector<int>{0});
  fp8_update_scales(dev.get(), count, history, margin, non_finite.get(), 0);
  const auto got = dev.download();
  int bad = 0;
  for (Fp8Meta& m : host) bad += !fp8_update(m, history, margin);
  CHECK(non_finite.download()[0] == bad);
  CHECK(bad == 2);
  for (int i = 0; i < count; ++i) {
    CAPTURE(i);
    CHECK(got[i].scale == host[i].scale);
    CHECK(got[i].scale_inv == host[i].scale_inv);
    CHECK(got[i].amax == 0.0f);
    for (int h = 0; h < history; ++h) REQUIRE(got[i].history[h] == host[i].history[h]);
  }
}
