// Where an FP8 producer writes: a kernel that computes a GEMM operand writes it straight to FP8
// through an Fp8Out (kernels/fp8.h, layernorm.h, elementwise.h), the format and pointers here.
#pragma once
#include <cstddef>
#include <cstdint>

enum class Fp8Kind { E4M3, E5M2 };

// Where a producer writes its FP8 tensor [rows, cols] and what it records.
//   scale null: nothing is written, only the amax measured (the current recipe's first pass).
//   out [rows, cols] and out_t [cols, rows]: either may be null.
//   amax: *amax = max(*amax, max |v|); a NaN makes it NaN, so a non-finite tensor is seen.
//   stats (may be null): stats[0] += values that are not zero but encode to zero (underflow),
//   stats[1] += values whose scaled magnitude exceeds the format's largest (saturation),
//   stats[2] += values written.
struct Fp8Out {
  Fp8Kind kind = Fp8Kind::E4M3;
  const float* scale = nullptr;
  uint8_t* out = nullptr;
  uint8_t* out_t = nullptr;
  float* amax = nullptr;
  unsigned long long* stats = nullptr;
};

// A batched producer's tensor z writes through first's pointers advanced by z times these byte
// strides (scale and amax share one: they live in one record).
struct Fp8Strides {
  size_t out = 0, out_t = 0, meta = 0, stats = 0;
};
