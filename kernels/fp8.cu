#include "kernels/check.h"
#include "kernels/nvtx.h"
#include "kernels/fp8.h"
#include "kernels/fp8_tile.cuh"
#include "kernels/reduce.h"

namespace {
struct Bf16Source {
  const bf16* in;
  int cols;
  size_t batch_stride = 0;  // elements from one tensor of a batched launch to the next
  using Raw = Bf16x8;
  __device__ Raw fetch(int r, int c) const {
    return *reinterpret_cast<const Bf16x8*>(in + blockIdx.z * batch_stride + static_cast<size_t>(r) * cols + c);
  }
  __device__ void convert(const Raw& raw, int, int, float* x) const { raw.to_float(x); }
};

// A 64 x 128 tile of codes a block: into shared memory as they lie, out a column at a time.
__global__ void __launch_bounds__(fp8tile::kThreads)
    transpose_kernel(const uint8_t* __restrict__ in, int rows, int cols, uint8_t* __restrict__ out_t) {
  using namespace fp8tile;
  __shared__ Tile tile;
  const int r0 = blockIdx.y * kTileRows, c0 = blockIdx.x * kTileCols;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int v = threadIdx.x + k * kThreads, tr = vec_row(v), tc = vec_col(v), r = r0 + tr, c = c0 + tc;
    if (r < rows && c < cols)
      *reinterpret_cast<uint2*>(&tile.code[tr][tc]) = *reinterpret_cast<const uint2*>(in + static_cast<size_t>(r) * cols + c);
  }
  __syncthreads();
  store_transposed(tile, out_t, r0, c0, rows, cols);
}
}  // namespace

size_t fp8_cast_partial_floats(int rows, int cols) {  // enough for gelu_backward_fp8's one tile a block too
  return static_cast<size_t>(fp8tile::tile_rows(rows)) * cols;
}

void cast_to_fp8(const bf16* in, int rows, int cols, const Fp8Out& o, cudaStream_t stream, float* db,
                 float* partial, GradWrite write) {
  NvtxRange range("cast_to_fp8");
  ENSURE(fp8tile::valid(o, rows, cols) && is_aligned16(in) && (!db || partial),
         "cast_to_fp8: rows and cols must be multiples of 8, the tensors 16/8-byte aligned");
  const bool sums = db && o.scale;  // the amax pass (no scale) writes nothing, the sums neither
  fp8tile::launch_tile(Bf16Source{in, cols}, rows, cols, o, sums ? partial : nullptr, stream);
  LAUNCH_CHECK();
  if (sums) sum_rows(partial, fp8tile::partial_rows(rows), cols, cols, db, stream, write);
}

void transpose_fp8(const uint8_t* in, int rows, int cols, uint8_t* out_t, cudaStream_t stream) {
  NvtxRange range("transpose_fp8");
  ENSURE(rows > 0 && cols > 0 && rows % 8 == 0 && cols % 8 == 0 && fp8tile::tile_rows(rows) <= 65535 &&
             fp8tile::aligned8(in) && fp8tile::aligned8(out_t),
         "transpose_fp8: rows and cols must be multiples of 8, the tensors 8-byte aligned");
  transpose_kernel<<<fp8tile::grid(rows, cols), fp8tile::kThreads, 0, stream>>>(in, rows, cols, out_t);
  LAUNCH_CHECK();
}

void cast_to_fp8_batched(const bf16* in, size_t in_stride, int rows, int cols, const Fp8Out& first,
                         const Fp8Strides& strides, int count, cudaStream_t stream) {
  NvtxRange range("cast_to_fp8_batched");
  ENSURE(fp8tile::valid(first, rows, cols) && is_aligned16(in) && in_stride % 8 == 0 && strides.out % 8 == 0 &&
             strides.out_t % 8 == 0 && strides.meta % 4 == 0 && strides.stats % 8 == 0 && count >= 1 &&
             count <= 65535,
         "cast_to_fp8_batched: rows and cols multiples of 8, tensors and strides aligned");
  fp8tile::launch_tile(Bf16Source{in, cols, in_stride}, rows, cols, first, nullptr, stream, count, strides);
  LAUNCH_CHECK();
}
