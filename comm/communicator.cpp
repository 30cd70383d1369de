#include "comm/communicator.h"

#include <algorithm>
#include <chrono>

#include "kernels/check.h"
#include "kernels/nvtx.h"

void throw_nccl_error(ncclResult_t r, const char* call, const char* file, int line) {
  std::string msg = std::string("NCCL error ") + ncclGetErrorString(r) + " in " + call + " at " + file + ":" +
                    std::to_string(line);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) msg += " (" + std::string(last) + ")";
  throw RuntimeError(msg);
}

Comm::Comm(const ncclUniqueId& id, int world, int rank, int max_ctas) : world_(world), rank_(rank) {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  events_.resize(1);
  CUDA_CHECK(cudaEventCreateWithFlags(&events_[0], cudaEventDisableTiming));
  NvtxRange range("nccl init");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  if (max_ctas > 0) {
    config.maxCTAs = max_ctas;
    config.minCTAs = std::min(max_ctas, 2);
  }
  NCCL_CHECK(ncclCommInitRankConfig(&comm_, world, id, rank, &config));
}

Comm::~Comm() {
  if (comm_ && !aborted_) {
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
  }
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
}

void Comm::abort(const std::string& why) {
  std::lock_guard<std::mutex> once(abort_mutex_);
  if (aborted_) return;
  abort_reason_ = why;  // before the flag: check() reads it once the flag is up
  // The call lock is taken with a timeout: a call blocked inside NCCL (a connection to a dead
  // peer) holds it, and aborting is what unblocks that call.
  const bool locked = mutex_.try_lock_for(std::chrono::seconds(2));
  aborted_ = true;
  if (comm_) ncclCommAbort(comm_);
  if (locked) mutex_.unlock();
}

void Comm::throw_if_aborted() {
  if (aborted_) {
    std::lock_guard<std::mutex> once(abort_mutex_);
    throw RuntimeError("stopping: " + abort_reason_);
  }
}

void Comm::check() {
  throw_if_aborted();
  ncclResult_t async = ncclSuccess;
  NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
  if (async != ncclSuccess) throw_nccl_error(async, "a collective in flight", __FILE__, __LINE__);
}

void Comm::order(cudaStream_t signaller, cudaStream_t waiter) {
  if (signaller == waiter) return;
  CUDA_CHECK(cudaEventRecord(events_[0], signaller));  // a wait takes the record of its moment
  CUDA_CHECK(cudaStreamWaitEvent(waiter, events_[0], 0));
}

void Comm::all_reduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op) {
  std::lock_guard<std::timed_mutex> lock(mutex_);
  check();
  NCCL_CHECK(ncclAllReduce(data, data, count, type, op, comm_, stream_));
}

void Comm::all_reduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op, cudaStream_t after,
                      cudaStream_t before) {
  order(after, stream_);
  all_reduce(data, count, type, op);
  order(stream_, before);
}

ncclWindow_t Comm::register_window(void* buffer, size_t bytes, std::string* why) {
  std::lock_guard<std::timed_mutex> lock(mutex_);
  check();
  ncclWindow_t window = nullptr;
  const ncclResult_t r = ncclCommWindowRegister(comm_, buffer, bytes, &window, NCCL_WIN_COLL_SYMMETRIC);
  if (r != ncclSuccess) {
    const char* last = ncclGetLastError(comm_);
    *why = std::string(ncclGetErrorString(r)) + (last && *last ? std::string(": ") + last : std::string());
    return nullptr;
  }
  if (!window) *why = "NCCL returned no window (registration disabled or unsupported here)";
  return window;
}

void Comm::deregister_window(ncclWindow_t window) {
  if (!window) return;
  std::lock_guard<std::timed_mutex> lock(mutex_);  // abort() sets the flag under it
  if (aborted_) return;
  ncclCommWindowDeregister(comm_, window);  // from a destructor: a failure here changes nothing
}

void Comm::all_gather(const void* send, void* recv, size_t count, ncclDataType_t type) {
  std::lock_guard<std::timed_mutex> lock(mutex_);
  check();
  NCCL_CHECK(ncclAllGather(send, recv, count, type, comm_, stream_));
}

