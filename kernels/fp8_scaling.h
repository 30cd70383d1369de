// Per-tensor FP8 scaling, kept on the device: each FP8 tensor has a scale (applied before the
// cast), its inverse (the GEMM's dequantisation factor), the step's amax (accumulated by the
// casts) and a history of past amaxes. The recipe logic is written once, for host and device,
// so the CPU tests check the very code the kernel runs.
//   delayed: the next step's scale comes from the maximum over the last history_len amaxes
//   current: history_len 1, updated after the tensor's own amax is known and before its cast
// scale = fp8_max / amax / 2^margin. A zero amax keeps the previous scale. A non-finite one stays
// out of the history and halves the scale (the back-off of the numerics guard, which also skips
// the step).
#pragma once
#include <cuda_runtime.h>

#include <math.h>  // isfinite for host code, as device code has it

#include <cmath>

constexpr int kMaxAmaxHistory = 1024;

// scale and scale_inv each start a 16-byte boundary: the GEMMs read scale_inv through
// cuBLASLt's scale pointers.
struct alignas(16) Fp8Meta {
  alignas(16) float scale = 1.0f;
  alignas(16) float scale_inv = 1.0f;
  float amax = 0.0f;     // this step's, from the casts; reset by the update
  float fp8_max = 448.0f;  // 448 for E4M3, 57344 for E5M2
  float history[kMaxAmaxHistory] = {};  // newest first
};

__host__ __device__ inline float fp8_scale_for(float amax, float fp8_max, int margin, float previous) {
  if (!(amax > 0.0f) || !isfinite(amax)) return previous;
  const float scale = ldexpf(fp8_max / amax, -margin);
  return isfinite(scale) ? scale : previous;  // an amax so tiny that the scale overflows
}

// One step of the recipe for one tensor: the step's amax joins the history if finite (a zero
// joins too: it is a real observation, and the history's maximum decides), the scale for the
// next step is chosen, the step's amax is reset. Returns false if the step's amax was not finite.
__host__ __device__ inline bool fp8_update(Fp8Meta& m, int history_len, int margin) {
  const float amax = m.amax;
  m.amax = 0.0f;
  if (!isfinite(amax)) {
    m.scale *= 0.5f;
    m.scale_inv = 1.0f / m.scale;
    return false;
  }
  for (int i = history_len - 1; i > 0; --i) m.history[i] = m.history[i - 1];
  m.history[0] = amax;
  float hmax = 0.0f;
  for (int i = 0; i < history_len; ++i) hmax = fmaxf(hmax, m.history[i]);
  m.scale = fp8_scale_for(hmax, m.fp8_max, margin, m.scale);
  m.scale_inv = 1.0f / m.scale;
  return true;
}

// fp8_update on count metas (one thread each); *non_finite += the number whose amax was not.
// keep (optional, count flags): the metas flagged are left as they are.
void fp8_update_scales(Fp8Meta* metas, int count, int history_len, int margin, int* non_finite, cudaStream_t stream,
                       const unsigned char* keep = nullptr);
// The numerics guard's bookkeeping at a step's end: a non-finite loss also marks the step;
// counters[0] counts skipped steps, counters[1] the skipped steps in a row. counters null (a
// micro-batch before the optimizer step's last): the loss marks the step, nothing is counted.
void fp8_tally_skip(const float* loss, int* non_finite, int* counters, cudaStream_t stream);

// Data parallel: the step's amaxes of count metas into out[0..count) (a non-finite one as
// +infinity, so a maximum over ranks keeps it) and out[count] = 1 if this rank's step is bad (a
// non-finite amax flagged or a non-finite loss), for an all-reduce (max); scatter puts the
// reduced values back and sets *non_finite from the flag, so every rank skips the same steps.
void fp8_gather_amax(const Fp8Meta* metas, int count, const int* non_finite, const float* loss, float* out,
                     cudaStream_t stream);
void fp8_scatter_amax(const float* in, Fp8Meta* metas, int count, int* non_finite, cudaStream_t stream);
// x[i] = +infinity where it is not finite: a NaN amax survives an all-reduce (max), which drops NaNs.
void fp8_nonfinite_to_inf(float* x, int n, cudaStream_t stream);
