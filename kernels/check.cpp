#include "kernels/check.h"

#include <cublasLt.h>

void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  throw RuntimeError(std::string("CUDA error ") + cudaGetErrorName(e) + " (" +
                     cudaGetErrorString(e) + ") in " + call + " at " + file + ":" +
                     std::to_string(line));
}

void throw_cublas_error(int status, const char* call, const char* file, int line) {
  const auto s = static_cast<cublasStatus_t>(status);
  throw RuntimeError(std::string("cuBLASLt error ") + cublasLtGetStatusName(s) + " (" +
                     cublasLtGetStatusString(s) + ") in " + call + " at " + file + ":" +
                     std::to_string(line));
}
