// The step's second stream (--second-stream): the work off the critical path runs there. In the
// backward, the weight-gradient products (each forked after the input gradient that shares its
// output gradient, with a Gemm and cuBLASLt workspace of its own); after it, the optimizer, part
// by part in the order the next forward reads the weights, each part's completion an event the
// forward waits for. Owns the stream, its Gemm and the events that order the two streams.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/gemm.h"
#include "model/vit.h"

class SecondStream {
 public:
  SecondStream(size_t gemm_workspace, bool autotune, int update_parts);
  ~SecondStream();
  SecondStream(const SecondStream&) = delete;
  SecondStream& operator=(const SecondStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  // Where the model's backward runs its weight gradients: in line with this stream's Gemm until
  // that Gemm has planned (and tuned, alone) its products, on this stream after that.
  WeightGradStream weight_grads();
  // What this stream enqueues next waits for all that `from` has enqueued so far (and, in the
  // tests, lags lag_ns behind it).
  void fork(cudaStream_t from);
  // The optimizer's parts: updated[part] is recorded once the part is written; the step's
  // skip flag copied here (the next step clears the original while the update may still read it).
  cudaEvent_t updated(int part) const { return updated_[part]; }
  const cudaEvent_t* updated() const { return updated_.data(); }
  int* skip_copy() const { return skip_; }

  uint64_t lag_ns = 0, critical_lag_ns = 0;  // tests: see WeightGradStream
  bool update_pending = false;               // an update not yet waited for in full

 private:
  std::vector<cudaEvent_t*> events();
  Gemm gemm_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t forked_ = nullptr, read_[4] = {}, block_done_[2] = {};
  std::vector<cudaEvent_t> updated_;
  int* skip_ = nullptr;
};
