// A worker's NCCL communicator and the gradient all-reduce in buckets.
#pragma once
#include <cuda_bf16.h>
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

enum class ReduceDType { F32, BF16 };

// Gradients averaged over the ranks in buckets of the flat fp32 gradient buffer. The backward
// fills it from the end towards the start (head first, patch embedding last), so buckets are
// cut from the end; ready_from(offset) tells that every gradient at or past offset is final, and
// each bucket wholly inside that range starts its all-reduce on the communication stream at
// once, while the backward goes on with earlier blocks. finish() starts what is left and makes
// the compute stream wait for all of it.
class GradSync {
 public:
  // Sums the ranks' gradients (the loss gradient is divided by the ranks already, so the sum is
  // the average). overlap: ready_from() starts the buckets it completes at once, during the
  // backward; without it every bucket starts in finish(). window: the buffer all-reduced (grads,
  // or staging for bf16) came from ncclMemAlloc and is registered as a symmetric window.
  GradSync(Comm& comm, float* grads, size_t count, size_t bucket_floats, ReduceDType dtype, __nv_bfloat16* staging,
           cudaStream_t compute, bool overlap = true, bool window = false);
  // Empty if the window asked for is registered (or none was asked for), else why not.
  const std::string& window_failure() const { return window_failure_; }
  bool windowed() const { return window_ != nullptr; }
  static size_t staging_elements(size_t count, ReduceDType dtype) { return dtype == ReduceDType::BF16 ? count : 0; }

  void begin_step();
  void ready_from(size_t offset);
  void finish();
  int buckets() const { return static_cast<int>(buckets_.size()); }

  // --timing: events around each bucket on the communication stream; collect() (after the step
  // has finished) adds the step's busy time, and busy_ms() is the total.
  void enable_timing();
  void collect();
  double busy_ms() const { return busy_ms_; }
  ~GradSync();

 private:
  struct Bucket {
    size_t begin, end;
    bool launched = false;
    cudaEvent_t start = nullptr, stop = nullptr;
  };
  void launch(Bucket& b);
  void launch_from(size_t offset);
  Comm& comm_;
  float* grads_;
  ReduceDType dtype_;
  __nv_bfloat16* staging_;
  cudaStream_t compute_;
  bool overlap_;
  ncclWindow_t window_ = nullptr;
  std::string window_failure_;
  std::vector<Bucket> buckets_;  // from the end of the buffer to its start
  bool timing_ = false;
  double busy_ms_ = 0;
};
