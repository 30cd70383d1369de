#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/common.cuh"
#include "kernels/embed.h"

namespace {
constexpr int kThreads = 256;

__global__ void patchify_kernel(const float* __restrict__ images, bf16* __restrict__ patches, int B,
                                int C, int img, int p, int ld) {
  const int G = img / p, P = G * G, cols = C * p * p;
  const size_t n = static_cast<size_t>(B) * P * ld;
  for (size_t o = blockIdx.x * size_t(blockDim.x) + threadIdx.x; o < n; o += size_t(gridDim.x) * blockDim.x) {
    const int col = static_cast<int>(o % ld);
    if (col >= cols) {
      patches[o] = __float2bfloat16_rn(0.0f);
      continue;
    }
    const size_t row = o / ld;
    const int b = static_cast<int>(row / P), i = static_cast<int>(row % P);
    const int gh = i / G, gw = i % G;
    const int c = col / (p * p), kh = (col / p) % p, kw = col % p;
    const size_t in = ((static_cast<size_t>(b) * C + c) * img + gh * p + kh) * img + gw * p + kw;
    patches[o] = __float2bfloat16_rn(images[in]);
  }
}

__global__ void embed_forward_kernel(const float4* __restrict__ patch_out, const float4* __restrict__ cls,
                                     const float4* __restrict__ pos, float4* __restrict__ x, int B, int T,
                                     int D4) {
  const size_t n = static_cast<size_t>(B) * T * D4;
  for (size_t o = blockIdx.x * size_t(blockDim.x) + threadIdx.x; o < n; o += size_t(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(o % D4);
    const int t = static_cast<int>((o / D4) % T);
    const int b = static_cast<int>(o / (static_cast<size_t>(D4) * T));
    const float4 src = t == 0 ? cls[d] : patch_out[(static_cast<size_t>(b) * (T - 1) + t - 1) * D4 + d];
    const float4 pe = pos[static_cast<size_t>(t) * D4 + d];
    x[o] = make_float4(src.x + pe.x, src.y + pe.y, src.z + pe.z, src.w + pe.w);
  }
}

__global__ void embed_backward_kernel(const float* __restrict__ g, bf16* __restrict__ dpatch, int B,
                                      int T, int D) {
  const size_t n = static_cast<size_t>(B) * (T - 1) * D;
  for (size_t o = blockIdx.x * size_t(blockDim.x) + threadIdx.x; o < n; o += size_t(gridDim.x) * blockDim.x) {
    const size_t row = o / D;  // b * P + i  ->  token row b * T + 1 + i
    const size_t b = row / (T - 1), i = row % (T - 1);
    dpatch[o] = __float2bfloat16_rn(g[(b * T + 1 + i) * D + o % D]);
  }
}

}  // namespace

void patchify(const float* images, bf16* patches, int B, int C, int img, int p, int ld, cudaStream_t stream) {
  NvtxRange range("patchify");
  ENSURE(img % p == 0, "patchify: image size not divisible by patch size");
  ENSURE(ld >= C * p * p, "patchify: row stride below the patch size");
  const size_t n = static_cast<size_t>(B) * (img / p) * (img / p) * ld;
  patchify_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(images, patches, B, C, img, p, ld);
  LAUNCH_CHECK();
}

void embed_forward(const float* patch_out, const float* cls, const float* pos, float* x, int B, int T,
                   int D, cudaStream_t stream) {
  NvtxRange range("embed_forward");
  ENSURE(D % 4 == 0 && is_aligned16(patch_out) && is_aligned16(cls) && is_aligned16(pos) && is_aligned16(x),
          "embed_forward: D % 4 and 16-byte alignment");
  const size_t n = static_cast<size_t>(B) * T * D / 4;
  embed_forward_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(patch_out), reinterpret_cast<const float4*>(cls),
      reinterpret_cast<const float4*>(pos), reinterpret_cast<float4*>(x), B, T, D / 4);
  LAUNCH_CHECK();
}

void embed_backward(const float* g, bf16* dpatch_out, int B, int T, int D, cudaStream_t stream) {
  NvtxRange range("embed_backward");
  const size_t n = static_cast<size_t>(B) * (T - 1) * D;
  embed_backward_kernel<<<grid_stride_blocks(n, kThreads), kThreads, 0, stream>>>(g, dpatch_out, B, T, D);
  LAUNCH_CHECK();
}
