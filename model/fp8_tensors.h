// What the model asks of the FP8 scaling recipe (engine/fp8_recipe.h implements it). The model
// numbers its FP8 tensors (each Linear layer's input, weight and output gradient, block by
// block) and writes each one with a producer kernel; the recipe owns the tensors' scaling
// records (kernels/fp8_scaling.h) and decides how a producer runs: once, with a scale known
// beforehand (delayed scaling), or after a pass that measures the tensor's own amax (current
// scaling).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "kernels/fp8_out.h"
#include "kernels/fp8_scaling.h"

class Fp8Tensors {
 public:
  virtual ~Fp8Tensors() = default;
  // The tensor's scaling record on the device; a GEMM dequantises the tensor by its scale_inv.
  virtual Fp8Meta* meta(int tensor) const = 0;
  // Runs launch (once or more) so that it writes the tensor in format kind to out and/or out_t.
  using Producer = std::function<void(const Fp8Out&)>;
  virtual void produce(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t, cudaStream_t stream,
                       const Producer& launch) = 0;
  // Whether produce() runs its producer once, with the scale the record holds: then one launch
  // may write several tensors, each through one_pass_out() of its own.
  virtual bool one_pass() const = 0;
  virtual Fp8Out one_pass_out(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t) const = 0;
};
