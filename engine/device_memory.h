// The step's device memory: what the model and the engine asked for (model/memory_request.h),
// one allocation per category. Every size is known, and checked against the free memory,
// before anything is allocated; nothing is allocated inside the step.
#pragma once
#include <array>
#include <cstddef>

#include "model/memory_request.h"

class DeviceMemory {
 public:
  using Alloc = void* (*)(size_t bytes);
  using Release = void (*)(void* p);
  // Allocates every category of request and places it. gradients_alloc/release: another
  // allocator for the gradients (NCCL's, for memory NCCL registers as a window), or null. Throws
  // RuntimeError naming the category that did not fit.
  explicit DeviceMemory(MemoryRequest& request, Alloc gradients_alloc = nullptr,
                        Release gradients_release = nullptr);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  static const char* name(MemoryCategory category);  // for the start-up summary

 private:
  void release();
  std::array<void*, kMemoryCategories> base_{};
  Release gradients_release_ = nullptr;
};
