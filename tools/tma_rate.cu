// tma_rate: how fast the TMA unit moves the resident attention kernels' operand tiles, by box
// geometry. Each CTA (grid H x B, as the resident backward; 160 KB of shared memory, so one an
// SM) takes one (image, head): one thread issues the loads of 16 tiles of 64 rows x hd (Q, K, V
// from a [B, T, 3 H hd] tensor, dO from [B, T, H hd]: the backward's operands) and waits for all
// of them, then stores 4 tiles (as the backward's dK or dV) to a third tensor and waits until the
// stores have read shared memory. Geometries (the shared-memory layouts they write):
//   sw16   {8, 64, hd / 8} boxes, 16-byte rows, no swizzle (the kernels' layout before a223759)
//   sw32   {16, 64, hd / 16} boxes, 32-byte rows, SWIZZLE_32B (the kernels' layout since)
//   sw32x4 {16, 256, hd / 16}: the same rows, one box a tensor (4 tiles): a quarter of the boxes
//   sw128  {64, 64} boxes, 128-byte rows, SWIZZLE_128B, and at hd 80 a {16, 64} SWIZZLE_32B box
//          for the last 16 columns
//   rows   {hd, 64} boxes, whole rows of hd * 2 bytes, no swizzle (no wgmma layout: a bound)
// Prints per geometry the kernel's time (CUDA events, median of 20 after 5), the bytes moved
// over it, and per CTA (median over the CTAs of the last launch) the microseconds from the
// first load's issue to the last tile landed, and from the first store's issue to its reads done.
// Usage: tma_rate [B H T HD ...]   (default 64 16 197 80 and 2 16 197 80: DRAM, and L2-resident)
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/tma.cuh"
#include "kernels/event_timing.h"
#include "tools/shape_args.h"

namespace {
enum Geometry { kSw16, kSw32, kSw32Whole, kSw128, kRows };
const char* const kNames[] = {"sw16", "sw32", "sw32x4", "sw128", "rows"};
constexpr int kRowsPerTile = 64, kTilesPerTensor = 4, kStores = 4;

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Maps: [0] Q, K, V's tensor, [1] dO's, [2] the stores' ([3..5] the same for sw128's 16-column part).
struct Maps {
  CUtensorMap m[6];
};

__global__ void __launch_bounds__(128, 1) tma_kernel(const __grid_constant__ Maps maps, int geometry, int H, int hd,
                                                     unsigned long long* ns) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bar_storage;
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem)), bar = uint32_t(__cvta_generic_to_shared(&bar_storage));
  const int h = blockIdx.x, b = blockIdx.y, tile_bytes = kRowsPerTile * hd * 2;
  if (threadIdx.x != 0) return;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  const int dims = geometry == kSw16 || geometry == kSw32 || geometry == kSw32Whole ? 4 : 3;
  const int per_box = geometry == kSw32Whole ? kTilesPerTensor : 1;  // tiles a box holds
  const int chunk = geometry == kSw16 ? 8 : 16;  // columns a box row holds in the 4-D maps
  // One box (or sw128's two) of tile t of tensor `which` (0 Q, 1 K, 2 V, 3 dO) of this (image, head).
  const auto issue = [&](bool is_store, int which, int t, uint32_t dst) {
    const int map = is_store ? 2 : which == 3 ? 1 : 0;
    const int col = ((is_store || which == 3) ? h : which * H + h) * hd;  // first column of the head's part
    const int row = t * kRowsPerTile;
    const auto one = [&](const CUtensorMap* m, uint32_t at, int c) {
      if (dims == 4) {
        if (is_store) tma::store_4d(m, at, 0, row, c / chunk, b);
        else tma::load_4d(at, m, 0, row, c / chunk, b, bar);
      } else {
        if (is_store) tma::store_3d(m, at, c, row, b);
        else tma::load_3d(at, m, c, row, b, bar);
      }
    };
    one(&maps.m[map], dst, col);
    if (geometry == kSw128 && hd > 64) one(&maps.m[3 + map], dst + kRowsPerTile * 128, col + 64);
  };
  const unsigned long long t0 = now_ns();
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(4 * kTilesPerTensor * tile_bytes)
               : "memory");
  for (int t = 0; t < kTilesPerTensor; t += per_box)
    for (int which = 0; which < 4; ++which) issue(false, which, t, base + (t * 4 + which * per_box) * tile_bytes);
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar)
                 : "memory");
  const unsigned long long t1 = now_ns();
  for (int s = 0; s < kStores; s += per_box) issue(true, 0, s, base + s * tile_bytes);
  tma::commit();  // the stores as one bulk group
  tma::wait_read();
  const unsigned long long t2 = now_ns();
  unsigned long long* row = ns + 2 * (size_t(b) * gridDim.x + h);
  row[0] = t1 - t0, row[1] = t2 - t1;
}

// A [B, T, columns] bf16 tensor's map for geometry g; part 1: sw128's 16-column box.
CUtensorMap make_map(Geometry g, void* data, int B, int T, int columns, int hd, int part) {
  const std::string who = std::string("tma_rate (") + kNames[g] + ")";
  const cuuint64_t cols = cuuint64_t(columns);
  if (g == kSw16 || g == kSw32 || g == kSw32Whole) {
    const int chunk = g == kSw16 ? 8 : 16;
    const int rows = g == kSw32Whole ? kTilesPerTensor * kRowsPerTile : kRowsPerTile;
    const cuuint64_t dims[4] = {cuuint64_t(chunk), cuuint64_t(T), cols / chunk, cuuint64_t(B)};
    const cuuint64_t strides[3] = {cols * 2, cuuint64_t(chunk) * 2, cuuint64_t(T) * cols * 2};
    const cuuint32_t box[4] = {cuuint32_t(chunk), cuuint32_t(rows), cuuint32_t(hd / chunk), 1};
    return tma::encode(data, 4, dims, strides, box, g == kSw16 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_32B,
                       who.c_str());
  }
  const cuuint64_t dims[3] = {cols, cuuint64_t(T), cuuint64_t(B)};
  const cuuint64_t strides[2] = {cols * 2, cuuint64_t(T) * cols * 2};
  const int width = g == kRows ? hd : part == 0 ? 64 : 16;
  const cuuint32_t box[3] = {cuuint32_t(width), kRowsPerTile, 1};
  return tma::encode(data, 3, dims, strides, box,
                     g == kRows ? CU_TENSOR_MAP_SWIZZLE_NONE : part == 0 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_32B,
                     who.c_str());
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<AttentionShape> shapes;
  if (!parse_shapes(argc, argv, "tma_rate", {{64, 16, 197, 80}, {2, 16, 197, 80}}, &shapes)) return 2;
  for (const AttentionShape& s : shapes)
    if (s.hd != 64 && s.hd != 80) {
      std::fprintf(stderr, "tma_rate: hd %d; it times the tiles at hd 64 or 80\n", s.hd);
      return 2;
    }
  try {
    std::printf("%-16s %-6s %9s %9s %13s %13s\n", "B H T hd", "boxes", "kernel us", "GB/s", "CTA load us", "CTA store us");
    for (const auto& s : shapes) {
      const int B = s.B, H = s.H, T = s.T, hd = s.hd;
      const size_t qkv_elems = size_t(B) * T * 3 * H * hd, do_elems = size_t(B) * T * H * hd;
      void *qkv, *dout, *dst;
      unsigned long long* ns;
      CUDA_CHECK(cudaMalloc(&qkv, qkv_elems * 2));
      CUDA_CHECK(cudaMalloc(&dout, do_elems * 2));
      CUDA_CHECK(cudaMalloc(&dst, do_elems * 2));
      CUDA_CHECK(cudaMalloc(&ns, size_t(B) * H * 2 * 8));
      CUDA_CHECK(cudaMemset(qkv, 0, qkv_elems * 2));
      CUDA_CHECK(cudaMemset(dout, 0, do_elems * 2));
      const int smem = 4 * kTilesPerTensor * kRowsPerTile * hd * 2;
      CUDA_CHECK(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      for (const Geometry g : {kSw16, kSw32, kSw32Whole, kSw128, kRows}) {
        Maps maps;
        for (int part = 0; part < 2; ++part) {
          maps.m[3 * part + 0] = make_map(g, qkv, B, T, 3 * H * hd, hd, part);
          maps.m[3 * part + 1] = make_map(g, dout, B, T, H * hd, hd, part);
          maps.m[3 * part + 2] = make_map(g, dst, B, T, H * hd, hd, part);
        }
        const auto launch = [&] {
          tma_kernel<<<dim3(H, B), 128, smem>>>(maps, int(g), H, hd, ns);
          LAUNCH_CHECK();
        };
        const double ms = median_event_ms(launch);
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<unsigned long long> c(size_t(B) * H * 2);
        CUDA_CHECK(cudaMemcpy(c.data(), ns, c.size() * 8, cudaMemcpyDeviceToHost));
        std::vector<double> ld, st;
        for (size_t i = 0; i < c.size(); i += 2) ld.push_back(c[i] * 1e-3), st.push_back(c[i + 1] * 1e-3);
        const double bytes = double(B) * H * (4 * kTilesPerTensor + kStores) * kRowsPerTile * hd * 2;
        std::printf("%-16s %-6s %9.1f %9.0f %13.2f %13.2f\n",
                    (std::to_string(B) + " " + std::to_string(H) + " " + std::to_string(T) + " " + std::to_string(hd)).c_str(),
                    kNames[g], ms * 1e3, bytes / (ms * 1e-3) / 1e9, median_of(ld), median_of(st));
        std::printf("RESULT tma shape=%d,%d,%d,%d boxes=%s kernel_us=%.2f cta_load_us=%.3f cta_store_us=%.3f\n", B, H, T, hd,
                    kNames[g], ms * 1e3, median_of(ld), median_of(st));
      }
      CUDA_CHECK(cudaFree(qkv));
      CUDA_CHECK(cudaFree(dout));
      CUDA_CHECK(cudaFree(dst));
      CUDA_CHECK(cudaFree(ns));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tma_rate: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
