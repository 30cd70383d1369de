#include "engine/second_stream.h"

#include "kernels/check.h"
#include "kernels/spin.h"

SecondStream::SecondStream(size_t gemm_workspace, bool autotune, int update_parts)
    : gemm_(gemm_workspace, autotune), updated_(update_parts) {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : events()) CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  CUDA_CHECK(cudaMalloc(&skip_, sizeof(int)));
}

SecondStream::~SecondStream() {
  cudaStreamSynchronize(stream_);  // nothing of it may still run on what is freed next
  cudaFree(skip_);
  for (cudaEvent_t* e : events()) cudaEventDestroy(*e);
  cudaStreamDestroy(stream_);
}

std::vector<cudaEvent_t*> SecondStream::events() {
  std::vector<cudaEvent_t*> e{&forked_, &read_[0], &read_[1], &read_[2], &read_[3], &block_done_[0], &block_done_[1]};
  for (cudaEvent_t& u : updated_) e.push_back(&u);
  return e;
}

WeightGradStream SecondStream::weight_grads() {
  WeightGradStream w;
  w.gemm = &gemm_;
  w.stream = gemm_.plans_cached() > 0 ? stream_ : nullptr;
  w.forked = forked_;
  for (int i = 0; i < 4; ++i) w.read[i] = read_[i];
  for (int i = 0; i < 2; ++i) w.block_done[i] = block_done_[i];
  w.lag_ns = lag_ns;
  w.critical_lag_ns = critical_lag_ns;
  return w;
}

void SecondStream::fork(cudaStream_t from) {
  CUDA_CHECK(cudaEventRecord(forked_, from));
  CUDA_CHECK(cudaStreamWaitEvent(stream_, forked_));
  if (lag_ns) spin(lag_ns, stream_);
}
