#include "kernels/device.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

int cuda_gpu_count(std::string* why_none) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess && count > 0) return count;
  cudaGetLastError();
  std::string why = "no CUDA device found";
  if (e == cudaErrorInsufficientDriver) {
    // The runtime says this both where no driver is installed and where it is too old.
    void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!driver) driver = dlopen("libcuda.so.1", RTLD_LAZY);
    why = driver ? "the NVIDIA driver is older than this build's CUDA needs" : "no NVIDIA driver is installed";
    if (driver) dlclose(driver);
  } else if (e != cudaSuccess && e != cudaErrorNoDevice) {
    why = cudaGetErrorString(e);
  }
  if (why_none) *why_none = why;
  return 0;
}
