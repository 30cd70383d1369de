#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/peer_copy.h"
#include "kernels/preload.h"

namespace {
// dsts is __grid_constant__: indexed at run time, a by-value parameter would be copied to local memory.
__global__ void copy_ranges_kernel(const float* __restrict__ src, const FloatRange* __restrict__ ranges,
                                   const __grid_constant__ Fp32Copies dsts) {
  const FloatRange r = ranges[blockIdx.y];
  for (size_t i = r.begin + blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < r.begin + r.count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = src[i];
    for (int c = 0; c < dsts.count; ++c) dsts.at[c][i] = v;
  }
  __threadfence_system();  // read by the peers' kernels once an event tells them this grid is done
}
}  // namespace

PRELOAD_AT_START_UP(copy_ranges_kernel);

void copy_ranges(const float* src, const FloatRange* ranges, int n_ranges, const Fp32Copies& dsts, cudaStream_t stream) {
  ENSURE(n_ranges >= 0 && n_ranges <= 65535 && dsts.count >= 0 && dsts.count <= kMaxPeerCopies,
         "copy_ranges: bad range or copy count");
  if (n_ranges == 0 || dsts.count == 0) return;
  NvtxRange range("copy_ranges");
  copy_ranges_kernel<<<dim3(8, n_ranges), 256, 0, stream>>>(src, ranges, dsts);
  LAUNCH_CHECK();
}
