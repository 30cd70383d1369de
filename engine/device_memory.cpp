#include "engine/device_memory.h"

#include <cuda_runtime.h>

#include <string>

#include "kernels/check.h"

const char* DeviceMemory::name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::Parameters: return "parameters (fp32 master, bf16 and fp8 copies)";
    case MemoryCategory::Gradients: return "gradients (fp32)";
    case MemoryCategory::OptimizerState: return "optimizer state (fp32)";
    case MemoryCategory::Activations: return "activations saved for backward";
    case MemoryCategory::Workspace: return "workspace (backward temporaries, batch)";
    case MemoryCategory::Count: break;
  }
  return "?";
}

DeviceMemory::DeviceMemory(MemoryRequest& request, Alloc gradients_alloc, Release gradients_release) {
  try {
    for (int c = 0; c < kMemoryCategories; ++c) {
      const auto category = static_cast<MemoryCategory>(c);
      const size_t bytes = request.bytes(category);
      if (bytes == 0) continue;
      if (category == MemoryCategory::Gradients && gradients_alloc) {
        base_[c] = gradients_alloc(bytes);  // throws on failure
        gradients_release_ = gradients_release;
      } else {
        const cudaError_t e = cudaMalloc(&base_[c], bytes);
        if (e != cudaSuccess) {
          cudaGetLastError();  // an allocation's error is not sticky
          base_[c] = nullptr;
          throw RuntimeError("could not allocate " + std::to_string(bytes >> 20) + " MiB for " + name(category) +
                             ": " + cudaGetErrorString(e));
        }
      }
      request.place(category, base_[c]);
    }
  } catch (...) {
    release();
    throw;
  }
}

DeviceMemory::~DeviceMemory() { release(); }

void DeviceMemory::release() {
  for (int c = 0; c < kMemoryCategories; ++c) {
    if (!base_[c]) continue;
    if (static_cast<MemoryCategory>(c) == MemoryCategory::Gradients && gradients_release_)
      gradients_release_(base_[c]);
    else
      cudaFree(base_[c]);
    base_[c] = nullptr;
  }
}
