// The CPU oracle of the FP8 formats (OCP FP8, as Hopper implements them): E4M3 (max 448, no
// infinities, NaN 0x7f/0xff) and E5M2 (max 57344, IEEE-like infinities and NaNs). Encoding
// rounds to nearest-even and saturates to the largest finite value (CUDA's __NV_SATFINITE);
// NaN encodes as 0x7f.
#pragma once
#include <cstdint>

namespace ref {
enum class Fp8 { E4M3, E5M2 };

struct Fp8Format {
  int exponent_bits, mantissa_bits, bias;
  double max;  // largest finite value
};
Fp8Format fp8_format(Fp8 f);

uint8_t fp8_encode(float x, Fp8 f);
float fp8_decode(uint8_t code, Fp8 f);
}  // namespace ref
