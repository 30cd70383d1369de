#include "tests/reference/fp8.h"

#include <cmath>

namespace ref {
Fp8Format fp8_format(Fp8 f) {
  return f == Fp8::E4M3 ? Fp8Format{4, 3, 7, 448.0} : Fp8Format{5, 2, 15, 57344.0};
}

float fp8_decode(uint8_t code, Fp8 f) {
  const Fp8Format F = fp8_format(f);
  const int sign = code >> 7, exp = (code >> F.mantissa_bits) & ((1 << F.exponent_bits) - 1);
  const int mant = code & ((1 << F.mantissa_bits) - 1);
  const int exp_all_ones = (1 << F.exponent_bits) - 1;
  if (f == Fp8::E4M3 && exp == exp_all_ones && mant == (1 << F.mantissa_bits) - 1) return NAN;
  if (f == Fp8::E5M2 && exp == exp_all_ones) return mant == 0 ? (sign ? -INFINITY : INFINITY) : NAN;
  const double m = exp == 0 ? mant / double(1 << F.mantissa_bits) : 1.0 + mant / double(1 << F.mantissa_bits);
  const double v = std::ldexp(m, (exp == 0 ? 1 : exp) - F.bias);
  return static_cast<float>(sign ? -v : v);
}

uint8_t fp8_encode(float x, Fp8 f) {
  const Fp8Format F = fp8_format(f);
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return sign | fp8_encode(static_cast<float>(F.max), f);  // saturate
  const double a = std::fabs(static_cast<double>(x));  // exact
  const int emin = 1 - F.bias;                            // exponent of the smallest normal
  // The spacing of representable values around a: 2^(e - mantissa_bits), e >= emin.
  const int e = a > 0 ? std::max(static_cast<int>(std::floor(std::log2(a))), emin) : emin;
  const double quantum = std::ldexp(1.0, e - F.mantissa_bits);
  const double r = std::nearbyint(a / quantum) * quantum;  // round half to even (default mode)
  if (r > F.max) return sign | fp8_encode(static_cast<float>(F.max), f);  // saturate
  if (r < std::ldexp(1.0, emin))                                          // subnormal or zero
    return sign | static_cast<uint8_t>(r / std::ldexp(1.0, emin - F.mantissa_bits));
  const int re = static_cast<int>(std::floor(std::log2(r)));  // rounding may carry into the next binade
  const int mant = static_cast<int>((r / std::ldexp(1.0, re) - 1.0) * (1 << F.mantissa_bits));
  return sign | static_cast<uint8_t>((re + F.bias) << F.mantissa_bits) | static_cast<uint8_t>(mant);
}
}  // namespace ref
