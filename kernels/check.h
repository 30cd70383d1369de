// Error checks for every CUDA, cuBLASLt and NCCL call: failures become exceptions carrying the
// call site and the library's own message; main() prints them and exits non-zero.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

// A run-time failure (exit code 1).
struct RuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A usage error: bad flag or value (exit code 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(int status, const char* call, const char* file, int line);

#define CUDA_CHECK(call)                                                          \
  do {                                                                            \
    cudaError_t e_ = (call);                                                      \
    if (e_ != cudaSuccess) throw_cuda_error(e_, #call, __FILE__, __LINE__);       \
  } while (0)

#define CUBLAS_CHECK(call)                                                        \
  do {                                                                            \
    int s_ = static_cast<int>(call);                                              \
    if (s_ != 0) throw_cublas_error(s_, #call, __FILE__, __LINE__);               \
  } while (0)

// After a kernel launch: catches bad launch configurations at the launch site.
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// Precondition of a launcher or a GEMM: a failed one is a bug in the caller, reported clearly.
#define ENSURE(cond, msg)                                                                     \
  do {                                                                                         \
    if (!(cond))                                                                               \
      throw RuntimeError(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " + (msg)); \
  } while (0)
