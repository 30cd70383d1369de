// Kernels that a run launches for the first time only after its start-up pass (the optimizer,
// the gradient exchange's sums, FP8 scale updates, evaluation, checksums) are loaded into the
// context at start-up instead. Under CUDA's lazy loading (the default) a kernel's first launch
// loads it, which can synchronize the context; in a data-parallel run whose ranks are threads of
// one process that can stall two ranks: one inside the loading launch, its queue holding a
// collective the other has not queued yet, the other inside a cross-device cudaStreamWaitEvent
// on the first one's event.
#pragma once
#include <cstddef>

void register_late_kernel(const void* kernel);
// Loads every registered kernel into the current device's context (cudaFuncGetAttributes).
void preload_late_kernels();
size_t late_kernels_registered();

// In a kernel's .cu file, after its definition: PRELOAD_AT_START_UP(name).
#define PRELOAD_AT_START_UP(kernel) \
  [[maybe_unused]] static const bool preload_##kernel = (register_late_kernel(reinterpret_cast<const void*>(&kernel)), true)
