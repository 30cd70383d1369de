// What every attention file shares (the mma.sync kernels', the resident ones', the dispatch):
// PTX wrappers and the device's limits (queried once per device); exp2_approx (approx_math.h) and
// pack_bf16x2 (common.cuh) come from the shared headers. Everything in an anonymous namespace:
// each including file gets its own copy.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "kernels/check.h"
#include "kernels/approx_math.h"
#include "kernels/common.cuh"

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

constexpr float kLog2e = 1.4426950408889634f;

struct DeviceInfo {
  int major = 0, minor = 0, smem_optin = 0;
  int smem_per_sm = 0, smem_reserved = 0;  // an SM's shared memory, and what each block takes beside its own
};

// Per-device properties, queried once per device (cudaDeviceGetAttribute, never the slow
// cudaGetDeviceProperties).
DeviceInfo device_info(int dev) {
  static std::mutex mutex;
  static std::vector<std::pair<bool, DeviceInfo>> cache;  // by ordinal
  std::lock_guard<std::mutex> lock(mutex);
  if (dev < static_cast<int>(cache.size()) && cache[dev].first) return cache[dev].second;
  DeviceInfo info;
  CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, dev));
  CUDA_CHECK(
      cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  if (dev >= static_cast<int>(cache.size())) cache.resize(dev + 1);
  cache[dev] = {true, info};
  return info;
}

}  // namespace
