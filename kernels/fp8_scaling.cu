#include "kernels/check.h"
#include "kernels/common.cuh"
#include "kernels/fp8_scaling.h"
#include "kernels/preload.h"

namespace {
__global__ void update_kernel(Fp8Meta* metas, int count, int history_len, int margin, int* non_finite,
                              const unsigned char* keep) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count && !(keep && keep[i]) && !fp8_update(metas[i], history_len, margin)) atomicAdd(non_finite, 1);
}
__global__ void tally_kernel(const float* loss, int* non_finite, int* counters) {
  if (!isfinite(*loss)) *non_finite = 1;
  if (!counters) return;
  if (*non_finite) {
    ++counters[0];
    ++counters[1];
  } else {
    counters[1] = 0;
  }
}
__global__ void gather_amax_kernel(const Fp8Meta* metas, int count, const int* non_finite, const float* loss,
                                   float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) out[i] = isfinite(metas[i].amax) ? metas[i].amax : INFINITY;
  if (i == count) out[i] = (*non_finite || !isfinite(*loss)) ? 1.0f : 0.0f;
}
__global__ void nonfinite_to_inf_kernel(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && !isfinite(x[i])) x[i] = INFINITY;
}
__global__ void scatter_amax_kernel(const float* in, Fp8Meta* metas, int count, int* non_finite) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) metas[i].amax = in[i];
  if (i == count) *non_finite = in[i] > 0.0f;
}
}  // namespace

// First launched after the start-up pass (kernels/preload.h).
PRELOAD_AT_START_UP(update_kernel);
PRELOAD_AT_START_UP(tally_kernel);
PRELOAD_AT_START_UP(gather_amax_kernel);
PRELOAD_AT_START_UP(nonfinite_to_inf_kernel);
PRELOAD_AT_START_UP(scatter_amax_kernel);

void fp8_gather_amax(const Fp8Meta* metas, int count, const int* non_finite, const float* loss, float* out,
                     cudaStream_t stream) {
  gather_amax_kernel<<<grid_for(count + 1, 128), 128, 0, stream>>>(metas, count, non_finite, loss, out);
  LAUNCH_CHECK();
}

void fp8_scatter_amax(const float* in, Fp8Meta* metas, int count, int* non_finite, cudaStream_t stream) {
  scatter_amax_kernel<<<grid_for(count + 1, 128), 128, 0, stream>>>(in, metas, count, non_finite);
  LAUNCH_CHECK();
}

void fp8_tally_skip(const float* loss, int* non_finite, int* counters, cudaStream_t stream) {
  tally_kernel<<<1, 1, 0, stream>>>(loss, non_finite, counters);
  LAUNCH_CHECK();
}

void fp8_update_scales(Fp8Meta* metas, int count, int history_len, int margin, int* non_finite, cudaStream_t stream,
                       const unsigned char* keep) {
  ENSURE(history_len >= 1 && history_len <= kMaxAmaxHistory, "fp8_update_scales: history length out of range");
  if (count == 0) return;
  update_kernel<<<grid_for(count, 128), 128, 0, stream>>>(metas, count, history_len, margin, non_finite, keep);
  LAUNCH_CHECK();
}

void fp8_nonfinite_to_inf(float* x, int n, cudaStream_t stream) {
  nonfinite_to_inf_kernel<<<grid_for(n, 128), 128, 0, stream>>>(x, n);
  LAUNCH_CHECK();
}
