// The meeting point of the ranks of one process for the copy-engine gradient exchange
// (--allreduce copy-engine): each rank's device, gradient and receive buffers, its per-bucket
// events, and which step each event was last recorded for.
//
// Why: NCCL's all-reduce kernels occupy SMs for as long as they run, and the backward's GEMMs,
// which they run beside, lose more than that. Between GPUs of one process the
// same sums need no kernel on the wire: every rank pushes each peer's share of a bucket into that
// peer's receive buffer with cudaMemcpyPeerAsync (the copy engines, over NVLink), the owner of a
// share adds what it received (a short memory-bound kernel), and pushes the sum back to every
// peer. Each share is summed once, by its owner, so every rank ends with the same bits.
//
// A wait on another device's event must be queued after that event's record (a CUDA stream waits
// for the record made before the wait call), so a rank publishes (event, step) once recorded and
// a peer awaits that step on the host before queueing the wait. Those host waits give way to a
// failure: they poll the rank's communicator, which the supervisor aborts.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

class Comm;

class PeerGroup {
 public:
  // Events each rank records, per bucket: its pushes of that bucket done; its sums of its shares
  // pushed back to every peer. With the optimizer sharded (bucket 0's event only): its shares
  // updated and their bf16 weights written into every peer's copy; its shares' fp32 weights and
  // optimizer state copied to every peer (gather_state).
  enum Stage { kPushed = 0, kGathered = 1, kUpdated = 2, kShared = 3, kStages = 4 };
  // The rank's training state, whole (its model's buffers).
  struct State {
    float* grads = nullptr;
    float* params = nullptr;
    std::vector<float*> optimizer_state;  // buffers as long as params
    __nv_bfloat16* params_bf16 = nullptr;
  };
  // A rank's side, allocated on its device by join() and owned here: freed only once every worker
  // has stopped, so no rank ever copies into or waits on what another already released.
  struct Member {
    int device = -1;
    State state;
    float* receive = nullptr;  // (ranks - 1) slots: the peers' copies of this rank's shares
    std::vector<cudaEvent_t> events[kStages];  // per bucket, by Stage
  };

  explicit PeerGroup(int ranks);
  ~PeerGroup();
  PeerGroup(const PeerGroup&) = delete;
  PeerGroup& operator=(const PeerGroup&) = delete;
  int ranks() const { return ranks_; }

  // Whether every pair of the devices can reach each other's memory; else why not.
  static bool reachable(const std::vector<int>& devices, std::string* why);

  // On the rank's device (current): allocates its receive buffer ((ranks - 1) x slot_floats) and
  // events, blocks until every rank has joined, then lets the device reach the others'. Throws
  // if comm is aborted meanwhile.
  const Member& join(int rank, const State& state, size_t slot_floats, int buckets, Comm& comm);
  const Member& member(int rank) const { return members_[rank]; }

  // rank recorded its `stage` event of `bucket` for step `step`.
  void publish(int rank, Stage stage, int bucket, long step);
  // Whether `rank` has published (stage, bucket) for step `step` or later.
  bool published_for(int rank, Stage stage, int bucket, long step);
  // Blocks until `rank` has published (stage, bucket) for step `step` or later; throws if comm is aborted.
  void await(int rank, Stage stage, int bucket, long step, Comm& comm);

 private:
  long& published(int rank, Stage stage, int bucket);
  int ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Member> members_;
  int joined_ = 0;
  int buckets_ = -1;
  std::vector<long> published_;  // [rank][stage][bucket]
};
