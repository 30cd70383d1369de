// What the model asks of the FP8 scaling recipe (engine/fp8_recipe.h implements it). The model
// numbers its FP8 tensors (each Linear layer's input, weight and output gradient, block by
// block) and writes each one with a producer kernel; the recipe owns the tensors' scaling
// records (kernels/fp8_scaling.h) and decides how a producer runs: once, with a scale known
// beforehand (delayed scaling), or after a pass that measures the tensor's own amax (current
// scaling).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/fp8_out.h"
#include "kernels/fp8_scaling.h"

// The producer kernel's launch, called with where to write: a reference to a callable that
// lives for the call (the lambdas at the call sites), so nothing is allocated per tensor.
class Fp8Producer {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, Fp8Producer>>>
  Fp8Producer(const F& f)  // NOLINT: converts from any callable, as std::function does
      : callable_(&f), call_([](const void* c, const Fp8Out& o) { (*static_cast<const F*>(c))(o); }) {}
  void operator()(const Fp8Out& o) const { call_(callable_, o); }

 private:
  const void* callable_;
  void (*call_)(const void*, const Fp8Out&);
};

class Fp8Tensors {
 public:
  virtual ~Fp8Tensors() = default;
  // The tensor's scaling record on the device; a GEMM dequantises the tensor by its scale_inv.
  virtual Fp8Meta* meta(int tensor) const = 0;
  // Runs launch (once or more) so that it writes the tensor in format kind to out and/or out_t.
  virtual void produce(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t, cudaStream_t stream,
                       Fp8Producer launch) = 0;
  // Whether produce() runs its producer once, with the scale the record holds: then one launch
  // may write several tensors, each through one_pass_out() of its own.
  virtual bool one_pass() const = 0;
  virtual Fp8Out one_pass_out(int tensor, Fp8Kind kind, uint8_t* out, uint8_t* out_t) const = 0;
};
