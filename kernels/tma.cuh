// The Tensor Memory Accelerator (sm_90) as the resident attention kernels and tools/tma_rate use
// it: a bf16 tensor map's encoding on the host (the driver's encoder through the runtime's entry
// point query: no link against libcuda) and the bulk tensor copies in device code.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "kernels/check.h"

namespace tma {

inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    ENSURE(found == cudaDriverEntryPointSuccess && fn, "the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A map of a bf16 tensor: `rank` dims innermost first, the byte strides of dims 1 .. rank - 1, a
// box, unit element steps, L2 promotion to 128 bytes, zeros for a box's part past the dims.
// `who` names the caller in the error.
inline CUtensorMap encode(const void* data, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                          const cuuint32_t* box, CUtensorMapSwizzle swizzle, const char* who) {
  const cuuint32_t steps[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank), const_cast<void*>(data), dims,
                               strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  ENSURE(r == CUDA_SUCCESS, std::string(who) + ": cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return map;
}

// The box of a 3-D or 4-D map at coordinates c0, c1, ... (innermost first) into shared memory at
// dst, its bytes counted on the mbarrier at bar.
__device__ __forceinline__ void load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// Shared memory at src to the box of a map at coordinates c0, ..., into the current bulk group:
// commit() closes it, and the issuing thread must wait_read() before src is written again or the
// CTA exits. Rows past the map's dims are not written.
__device__ __forceinline__ void store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(src)
               : "memory");
}
__device__ __forceinline__ void store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Every committed bulk group of this thread has read its shared memory.
// (wait_read<N>: all but the N most recent groups.)
template <int N = 0>
__device__ __forceinline__ void wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }

}  // namespace tma
