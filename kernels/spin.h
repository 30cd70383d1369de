// A kernel that only waits: for tests that make one stream lag behind another, so that a
// missing cross-stream wait shows as a wrong result instead of hiding behind fast kernels; and
// for the rate tools' timing lead (kernels/event_timing.h), which keeps the GPU busy while the
// host enqueues the timed launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

// One thread spins on the global timer for about ns nanoseconds.
void spin(uint64_t ns, cudaStream_t stream);
