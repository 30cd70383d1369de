#include <cmath>

#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/augment.h"

namespace {
__host__ __device__ inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// The k-th uniform number in [0, 1) of a draw.
__host__ __device__ inline double uniform(uint64_t seed, uint64_t draw, int k) {
  return double(mix(mix(seed ^ 0x5851f42d4c957f2dull) ^ mix(draw * 64 + k)) >> 11) * (1.0 / 9007199254740992.0);
}

__constant__ float c_mean[3] = {0.485f, 0.456f, 0.406f};
__constant__ float c_inv_std[3] = {1.0f / 0.229f, 1.0f / 0.224f, 1.0f / 0.225f};

// One thread per output pixel (x, y) of image blockIdx.z: its three channels.
__global__ void augment_kernel(const uint8_t* __restrict__ src, int size, float* __restrict__ out, int H, int W,
                               bool train, uint64_t seed, uint64_t first_draw) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y, b = blockIdx.z;
  if (x >= W || y >= H) return;
  const CropBox box = train ? random_resized_crop(size, seed, first_draw + b)
                            : CropBox{(size - W) / 2, (size - H) / 2, W, H, false};
  const int ox = box.flip ? W - 1 - x : x;
  // Bilinear, pixel centres aligned (align_corners=False), the crop's own edges replicated (as
  // torchvision's crop, then resize).
  const float sx = box.x0 + (ox + 0.5f) * box.w / W - 0.5f, sy = box.y0 + (y + 0.5f) * box.h / H - 0.5f;
  const float fx = floorf(sx), fy = floorf(sy), ax = sx - fx, ay = sy - fy;
  const int xl = box.x0, xh = box.x0 + box.w - 1, yl = box.y0, yh = box.y0 + box.h - 1;
  const int x0 = min(max(int(fx), xl), xh), x1 = min(max(int(fx) + 1, xl), xh);
  const int y0 = min(max(int(fy), yl), yh), y1 = min(max(int(fy) + 1, yl), yh);
  const uint8_t* img = src + size_t(b) * size * size * 3;
  const size_t plane = size_t(H) * W;
  float* o = out + size_t(b) * 3 * plane + size_t(y) * W + x;
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const float v00 = img[(size_t(y0) * size + x0) * 3 + c], v01 = img[(size_t(y0) * size + x1) * 3 + c];
    const float v10 = img[(size_t(y1) * size + x0) * 3 + c], v11 = img[(size_t(y1) * size + x1) * 3 + c];
    const float v = (1 - ay) * ((1 - ax) * v00 + ax * v01) + ay * ((1 - ax) * v10 + ax * v11);
    o[c * plane] = (v * (1.0f / 255.0f) - c_mean[c]) * c_inv_std[c];
  }
}
}  // namespace

__host__ __device__ CropBox random_resized_crop(int size, uint64_t seed, uint64_t draw) {
  const double area = double(size) * size, log_lo = log(3.0 / 4.0), log_hi = log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {  // torchvision's RandomResizedCrop.get_params
    const double target = area * (0.08 + (1.0 - 0.08) * uniform(seed, draw, 4 * attempt));
    const double ratio = exp(log_lo + (log_hi - log_lo) * uniform(seed, draw, 4 * attempt + 1));
    const int w = int(lround(sqrt(target * ratio))), h = int(lround(sqrt(target / ratio)));
    if (w > 0 && w <= size && h > 0 && h <= size) {
      const int y0 = int(uniform(seed, draw, 4 * attempt + 2) * (size - h + 1));
      const int x0 = int(uniform(seed, draw, 4 * attempt + 3) * (size - w + 1));
      return {x0, y0, w, h, uniform(seed, draw, 63) < 0.5};
    }
  }
  return {0, 0, size, size, uniform(seed, draw, 63) < 0.5};  // a square image: the whole of it
}

void augment_images(const uint8_t* src, int B, int size, float* out, int H, int W, bool train, uint64_t seed,
                    uint64_t first_draw, cudaStream_t stream) {
  NvtxRange range("augment_images");
  ENSURE(B > 0 && B <= 65535 && (train || (size >= H && size >= W)), "augment_images: bad batch or crop");
  const dim3 block(32, 8), grid((W + 31) / 32, (H + 7) / 8, B);
  augment_kernel<<<grid, block, 0, stream>>>(src, size, out, H, W, train, seed, first_draw);
  LAUNCH_CHECK();
}
