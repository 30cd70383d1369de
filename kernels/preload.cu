#include <vector>

#include "kernels/check.h"
#include "kernels/preload.h"

namespace {
std::vector<const void*>& late_kernels() {  // filled by static initialisers: constructed on first use
  static std::vector<const void*> kernels;
  return kernels;
}
}  // namespace

void register_late_kernel(const void* kernel) { late_kernels().push_back(kernel); }

void preload_late_kernels() {
  for (const void* kernel : late_kernels()) {
    cudaFuncAttributes attributes;
    CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  }
}

size_t late_kernels_registered() { return late_kernels().size(); }
