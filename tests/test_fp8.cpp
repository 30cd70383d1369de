// CPU tier: the FP8 oracle against CUDA's own host conversions, bit for bit: every code's
// decoding, and the encoding of every code's value, of the midpoints between neighbouring codes
// (ties to even) and of values just off them, of values past the largest one (saturation), of
// values below the smallest subnormal, infinities and NaN.
#include <cuda_fp8.h>
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "tests/reference/fp8.h"

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
