// One rank's NCCL communicator, and NCCL_CHECK.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* call, const char* file, int line);
#define NCCL_CHECK(call)                                                    \
  do {                                                                      \
    ncclResult_t r_ = (call);                                               \
    if (r_ != ncclSuccess) throw_nccl_error(r_, #call, __FILE__, __LINE__); \
  } while (0)

// One rank's communicator, with the stream its collectives run on. abort() may be called from
// another thread (the supervisor, when another rank failed): it unblocks collectives in flight,
// and every later call here throws instead of touching the aborted communicator.
class Comm {
 public:
  // max_ctas > 0: NCCL may use at most that many thread blocks (SMs) for its collectives, the
  // rest stay with the backward's kernels the all-reduce overlaps.
  Comm(const ncclUniqueId& id, int world, int rank, int max_ctas = 0);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  cudaStream_t stream() const { return stream_; }

  // In-place all-reduce on the communication stream, after everything `after` has queued so
  // far; `before` waits for it (either stream may be the communication stream itself).
  void all_reduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op, cudaStream_t after,
                  cudaStream_t before);
  // The same without stream ordering: on the communication stream, in its order.
  void all_reduce(void* data, size_t count, ncclDataType_t type, ncclRedOp_t op);
  void all_gather(const void* send, void* recv, size_t count, ncclDataType_t type);
  // Registers [buffer, buffer + bytes), which ncclMemAlloc returned, as a symmetric window
  // (NCCL_WIN_COLL_SYMMETRIC): collectives on it at the same offset on every rank may then run
  // NCCL's symmetric kernels, which read the peers' memory directly. Collective over the ranks.
  // Null, with the reason in *why, where NCCL cannot.
  ncclWindow_t register_window(void* buffer, size_t bytes, std::string* why);
  void deregister_window(ncclWindow_t window);  // nothing after an abort
  // Makes `waiter` wait for everything queued on `signaller` so far.
  void order(cudaStream_t signaller, cudaStream_t waiter);

  void abort(const std::string& why);
  // Throws if aborted; else the communicator's asynchronous error, if any.
  void check();
  // Throws if aborted, without calling into NCCL: safe from any thread at any moment.
  void throw_if_aborted();

 private:
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;  // a ring, for order()
  size_t next_event_ = 0;
  int world_, rank_;
  std::timed_mutex mutex_;   // held by each call into NCCL
  std::mutex abort_mutex_;   // abort() once; guards abort_reason_
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;
};
