// The rate tools' device arrays: cudaMalloc'd, checked, never freed (the tool exits).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/check.h"

template <class T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}
