// The gradient exchange between ranks: buckets of the flat gradient buffer, each summed over
// the ranks (NCCL's all-reduce, or the copy engines between GPUs of one process) as soon as the
// backward has finished it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/options.h"
#include "comm/peer_group.h"
#include "kernels/peer_copy.h"

// Gradients averaged over the ranks in buckets of the flat fp32 gradient buffer. The backward
// fills it from the end towards the start (head first, patch embedding last), so buckets are
// cut from the end; ready_from(offset) tells that every gradient at or past offset is final, and
// each bucket wholly inside that range starts its all-reduce on the communication stream at
// once, while the backward goes on with earlier blocks. finish() starts what is left and makes
// the compute stream wait for all of it. With a PeerGroup (every rank a GPU of this process) the
// sums go through the copy engines instead of NCCL (peer_group.h): a bucket's pushes start
// when it is ready, its owner's sum and the pushes back as soon as every peer's pushes are queued.
class GradSync {
 public:
  // Sums the ranks' gradients (the loss gradient is divided by the ranks already, so the sum is
  // the average). overlap: ready_from() starts the buckets it completes at once, during the
  // backward; without it every bucket starts in finish(). window: the buffer all-reduced (grads,
  // or staging for bf16) came from ncclMemAlloc and is registered as a symmetric window.
  // peers: exchange through the copy engines (fp32 only; no window); this rank is comm.rank().
  // shard (with peers): the optimizer is sharded over this rank's training state (shard->grads is
  // grads): the backward only scatters the shares; the optimizer updates this rank's own (own_shares).
  GradSync(Comm& comm, float* grads, size_t count, size_t bucket_floats, ReduceDType dtype, __nv_bfloat16* staging,
           cudaStream_t compute, bool overlap = true, bool window = false, PeerGroup* peers = nullptr,
           const PeerGroup::State* shard = nullptr);
  // Empty if the window asked for is registered (or none was asked for), else why not.
  const std::string& window_failure() const { return window_failure_; }
  bool windowed() const { return window_ != nullptr; }
  static size_t staging_elements(size_t count, ReduceDType dtype) { return dtype == ReduceDType::BF16 ? count : 0; }
  // The floats of the receive buffer the copy-engine exchange allocates on each rank.
  static size_t receive_floats(size_t count, size_t bucket_floats, int ranks);
  bool copy_engines() const { return peers_ != nullptr; }
  bool sharded() const { return sharded_; }
  // Where this rank's exchange is, call by call (a stalled run's --comm-timeout message).
  void set_activity(std::atomic<const char*>* activity) { activity_ = activity; }

  void begin_step();
  void ready_from(size_t offset);
  void finish();
  int buckets() const { return static_cast<int>(buckets_.size()); }

  // Sharded: this rank's share of every bucket, in the order the next forward reads the weights
  // (the last bucket holds the first ones): [begin, begin + count) of the flat buffers, and the
  // peers' copies of its gradient, sources arrays `stride` floats apart in rank order (as
  // sum_into adds them). After finish(), the optimizer updates each share and hands it to
  // send_weights(), then calls finish_update().
  struct Share {
    size_t begin, count;
    const float* received;
    size_t stride;
    int sources;
  };
  const std::vector<Share>& own_shares() const { return shares_; }
  // Before an update's first share: checks that the exchange is sharded, the fp32-read ranges
  // are set, and the update runs on the compute stream (send_weights orders its copies after it).
  void begin_update(cudaStream_t stream) const;
  // The share's new bf16 weights, once the compute stream has written them, copied into every
  // peer's bf16 weights (the copy engines, while the SMs update the next share).
  void send_weights(const Share& share);
  // After every share: the fp32 weights the kernels read directly copied from this rank's shares
  // to every peer; then the compute stream waits for every peer's update, so the next forward
  // reads whole weights. The fp32 weights and optimizer state outside this rank's shares go stale
  // until gather_state().
  void finish_update();
  // Sharded, before the first update: the [offset, offset + count) ranges of the fp32 weights
  // the model's kernels read directly (ViT::freeze_fp32_reads); finish_update() copies this
  // rank's shares of them into every peer's fp32 weights.
  void set_fp32_read_ranges(const std::vector<std::pair<size_t, size_t>>& ranges);
  // Sharded: copies this rank's shares of the fp32 weights and optimizer state to every peer and
  // makes the compute stream wait for the peers' copies, so that every rank holds the whole state (for
  // a checksum or a checkpoint). Every rank calls it; without sharding, or with no step since
  // the last call, it does nothing.
  void gather_state();

  // --timing: events around each bucket on the communication stream; collect() (after the step
  // has finished) adds the step's busy time, and busy_ms() is the total.
  void enable_timing();
  void collect();
  double busy_ms() const { return busy_ms_; }
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

 private:
  struct Bucket {
    size_t begin, end;
    size_t share = 0;  // copy engines: each rank owns [begin + r * share, ...) of it, cut at end
    size_t slot = 0;   // where its shares lie in a receive slot
    bool launched = false;
    cudaEvent_t start = nullptr, stop = nullptr;
    cudaEvent_t sum_start = nullptr, sum_stop = nullptr;  // copy engines: the second phase
  };
  void launch(Bucket& b);
  void launch_from(size_t offset);
  // Copy engines: [first, last) of rank r's share of bucket b.
  size_t share_begin(const Bucket& b, int r) const { return std::min(b.end, b.begin + r * b.share); }
  size_t share_end(const Bucket& b, int r) const { return std::min(b.end, b.begin + (r + 1) * b.share); }
  void push_shares(int index);
  // Sums and pushes back the buckets, in order, whose peers' pushes are queued; with wait, all of them.
  void sum_ready(bool wait);
  Comm& comm_;
  float* grads_;
  ReduceDType dtype_;
  __nv_bfloat16* staging_;
  cudaStream_t compute_;
  bool overlap_;
  ncclWindow_t window_ = nullptr;
  std::string window_failure_;
  std::vector<Bucket> buckets_;  // from the end of the buffer to its start
  // Copy engines: the group, this rank's side of it, the two streams (pushes; sums and pushes
  // back, which wait on the peers).
  PeerGroup* peers_ = nullptr;
  bool sharded_ = false;
  std::atomic<const char*>* activity_ = nullptr;
  void note(const char* what) {
    if (activity_) activity_->store(what);
  }
  long gathered_at_ = -1;  // step_ at the last gather: at most one a step, so it sequences kShared
  FloatRange* fp32_read_ = nullptr;  // device: this rank's shares of the fp32-read ranges
  int fp32_read_count_ = -1;         // -1: not set yet
  std::vector<Share> shares_;        // sharded: own_shares()
  const PeerGroup::Member* self_ = nullptr;
  cudaStream_t push_stream_ = nullptr, sum_stream_ = nullptr;
  size_t slot_floats_ = 0;  // a receive slot: every bucket's share
  size_t next_sum_ = 0;     // the first bucket not summed yet
  long step_ = 0;
  bool timing_ = false;
  double busy_ms_ = 0;
};
