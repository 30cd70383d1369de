#include "comm/grad_sync.h"

#include <algorithm>

#include "comm/peer_group.h"
#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/nvtx.h"
#include "kernels/reduce.h"

namespace {
constexpr size_t kShareAlign = 64;  // floats: shares start 256-byte aligned in a slot (and in the
                                    // gradients, whose tensors start at multiples of 128 floats)

size_t share_of(size_t bucket, int ranks) {
  const size_t even = (bucket + ranks - 1) / ranks;
  return (even + kShareAlign - 1) / kShareAlign * kShareAlign;
}

// Buckets cut from the end of [0, count).
template <class F>
void for_each_bucket(size_t count, size_t bucket_floats, F f) {
  for (size_t end = count; end > 0;) {
    const size_t begin = end > bucket_floats ? end - bucket_floats : 0;
    f(begin, end);
    end = begin;
  }
}
}  // namespace

size_t GradSync::receive_floats(size_t count, size_t bucket_floats, int ranks) {
  size_t slot = 0;
  for_each_bucket(count, bucket_floats, [&](size_t begin, size_t end) { slot += share_of(end - begin, ranks); });
  return slot * (ranks - 1);
}

GradSync::GradSync(Comm& comm, float* grads, size_t count, size_t bucket_floats, ReduceDType dtype,
                   __nv_bfloat16* staging, cudaStream_t compute, bool overlap, bool window, PeerGroup* peers,
                   const PeerGroup::State* shard)
    : comm_(comm), grads_(grads), dtype_(dtype), staging_(staging), compute_(compute), overlap_(overlap), peers_(peers),
      sharded_(peers && shard) {
  ENSURE(count > 0 && bucket_floats > 0 && (dtype == ReduceDType::F32 || staging), "GradSync: no gradient, empty buckets or no staging");
  ENSURE(!peers || (dtype == ReduceDType::F32 && !window && peers->ranks() == comm.world()),
         "GradSync: the copy-engine exchange sums fp32 gradients of every rank, outside NCCL's window");
  ENSURE(!shard || (peers && shard->grads == grads && shard->params && !shard->optimizer_state.empty() &&
                    shard->params_bf16 && comm.world() <= kMaxPeerCopies + 1),
         "GradSync: a sharded optimizer needs the copy-engine exchange, the whole state and at most 9 ranks (8 peers)");
  if (window) {
    window_ = dtype == ReduceDType::F32 ? comm.register_window(grads, count * sizeof(float), &window_failure_)
                                         : comm.register_window(staging, count * sizeof(__nv_bfloat16), &window_failure_);
  }
  for_each_bucket(count, bucket_floats, [&](size_t begin, size_t end) {
    Bucket b{begin, end};
    if (peers) {
      b.share = share_of(end - begin, comm.world());
      b.slot = slot_floats_;
      slot_floats_ += b.share;
    }
    buckets_.push_back(b);
  });
  if (peers) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&push_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&sum_stream_, cudaStreamNonBlocking));
    PeerGroup::State state;
    state.grads = grads;
    self_ = &peers->join(comm.rank(), shard ? *shard : state, slot_floats_, static_cast<int>(buckets_.size()), comm);
  }
  if (sharded_) {  // in the order the next forward reads the weights: the last bucket holds the first ones
    for (auto b = buckets_.rbegin(); b != buckets_.rend(); ++b) {
      const size_t begin = share_begin(*b, comm.rank()), n = share_end(*b, comm.rank()) - begin;
      if (n) shares_.push_back({begin, n, self_->receive + b->slot, slot_floats_, comm.world() - 1});
    }
  }
}

GradSync::~GradSync() {
  comm_.deregister_window(window_);
  for (Bucket& b : buckets_)
    for (cudaEvent_t e : {b.start, b.stop, b.sum_start, b.sum_stop})
      if (e) cudaEventDestroy(e);
  cudaFree(fp32_read_);
  if (push_stream_) cudaStreamDestroy(push_stream_);
  if (sum_stream_) cudaStreamDestroy(sum_stream_);
}

void GradSync::enable_timing() {
  timing_ = true;
  for (Bucket& b : buckets_) {
    CUDA_CHECK(cudaEventCreate(&b.start));
    CUDA_CHECK(cudaEventCreate(&b.stop));
    if (peers_ && !sharded_) {
      CUDA_CHECK(cudaEventCreate(&b.sum_start));
      CUDA_CHECK(cudaEventCreate(&b.sum_stop));
    }
  }
}

void GradSync::collect() {
  if (!timing_) return;
  for (Bucket& b : buckets_) {
    float ms = 0;
    CUDA_CHECK(cudaEventSynchronize(b.stop));
    CUDA_CHECK(cudaEventElapsedTime(&ms, b.start, b.stop));
    busy_ms_ += ms;
    if (b.sum_stop) {
      CUDA_CHECK(cudaEventElapsedTime(&ms, b.sum_start, b.sum_stop));
      busy_ms_ += ms;
    }
  }
}

void GradSync::begin_step() {
  for (Bucket& b : buckets_) b.launched = false;
  next_sum_ = 0;
  ++step_;
}

void GradSync::push_shares(int index) {
  const Bucket& b = buckets_[index];
  const int me = comm_.rank();
  for (int p = 0; p < comm_.world(); ++p) {
    if (p == me) continue;
    const PeerGroup::Member& peer = peers_->member(p);
    const size_t begin = share_begin(b, p), n = share_end(b, p) - begin;
    float* slot = peer.receive + static_cast<size_t>(me < p ? me : me - 1) * slot_floats_ + b.slot;
    note("push: cudaMemcpyPeerAsync(gradient share)");
    if (n) CUDA_CHECK(cudaMemcpyPeerAsync(slot, peer.device, grads_ + begin, self_->device, n * sizeof(float), push_stream_));
  }
  note("push: cudaEventRecord(kPushed)");
  CUDA_CHECK(cudaEventRecord(self_->events[PeerGroup::kPushed][index], push_stream_));
  peers_->publish(me, PeerGroup::kPushed, index, step_);
  note("push: published");
}

void GradSync::sum_ready(bool wait) {
  const int me = comm_.rank(), world = comm_.world();
  for (; next_sum_ < buckets_.size(); ++next_sum_) {
    const int index = static_cast<int>(next_sum_);
    Bucket& b = buckets_[index];
    if (!b.launched) return;  // its pushes come first, from launch()
    for (int p = 0; p < world; ++p) {
      if (p == me) continue;
      if (wait) {
        peers_->await(p, PeerGroup::kPushed, index, step_, comm_);
      } else if (!peers_->published_for(p, PeerGroup::kPushed, index, step_)) {
        return;
      }
    }
    NvtxRange range("gradient sum and push-back (copy engines)");
    // After this rank's own pushes of the bucket (which followed the backward's writes of it) and
    // the peers' pushes into the receive buffer.
    CUDA_CHECK(cudaStreamWaitEvent(sum_stream_, self_->events[PeerGroup::kPushed][index], 0));
    for (int p = 0; p < world; ++p)
      if (p != me) CUDA_CHECK(cudaStreamWaitEvent(sum_stream_, peers_->member(p).events[PeerGroup::kPushed][index], 0));
    if (timing_) CUDA_CHECK(cudaEventRecord(b.sum_start, sum_stream_));
    const size_t begin = share_begin(b, me), n = share_end(b, me) - begin;
    sum_into(grads_ + begin, self_->receive + b.slot, slot_floats_, world - 1, n, sum_stream_);
    for (int p = 0; p < world; ++p) {
      if (p == me || n == 0) continue;
      const PeerGroup::Member& peer = peers_->member(p);
      CUDA_CHECK(cudaMemcpyPeerAsync(peer.state.grads + begin, peer.device, grads_ + begin, self_->device, n * sizeof(float),
                                     sum_stream_));
    }
    if (timing_) CUDA_CHECK(cudaEventRecord(b.sum_stop, sum_stream_));
    CUDA_CHECK(cudaEventRecord(self_->events[PeerGroup::kGathered][index], sum_stream_));
    peers_->publish(me, PeerGroup::kGathered, index, step_);
  }
}

void GradSync::launch(Bucket& b) {
  NvtxRange range(peers_ ? "gradient bucket pushed to the peers (copy engines)" : "gradient all-reduce bucket");
  const size_t n = b.end - b.begin;
  cudaStream_t stream = peers_ ? push_stream_ : comm_.stream();
  if (timing_) CUDA_CHECK(cudaEventRecord(b.start, stream));
  if (peers_) {
    push_shares(static_cast<int>(&b - buckets_.data()));
  } else if (dtype_ == ReduceDType::F32) {
    comm_.all_reduce(grads_ + b.begin, n, ncclFloat32, ncclSum);
  } else {  // half the bytes on the wire; the sum rounds to bf16 once
    cast_to_bf16(grads_ + b.begin, staging_ + b.begin, n, stream);
    comm_.all_reduce(staging_ + b.begin, n, ncclBfloat16, ncclSum);
    cast_to_f32(staging_ + b.begin, grads_ + b.begin, n, stream);
  }
  if (timing_) CUDA_CHECK(cudaEventRecord(b.stop, stream));
  b.launched = true;
}

void GradSync::ready_from(size_t offset) {
  if (overlap_) launch_from(offset);
}

void GradSync::launch_from(size_t offset) {
  bool ordered = false;
  for (Bucket& b : buckets_) {
    if (b.launched || b.begin < offset) continue;
    if (!ordered) comm_.order(compute_, peers_ ? push_stream_ : comm_.stream());  // the gradients so far
    ordered = true;
    launch(b);
  }
  if (peers_ && !sharded_) sum_ready(false);
}

void GradSync::finish() {
  note("finish: launch_from(0)");
  launch_from(0);
  const int last = static_cast<int>(buckets_.size()) - 1;
  if (sharded_) {
    // Each rank pushes its buckets in order on one stream: the last bucket's event covers them
    // all. The optimizer reads what the peers pushed here; the next backward overwrites the
    // gradients this rank's own pushes read.
    for (int p = 0; p < comm_.world(); ++p) {
      if (p == comm_.rank()) continue;
      note("finish: PeerGroup::await(peer kPushed)");
      peers_->await(p, PeerGroup::kPushed, last, step_, comm_);
      note("finish: cudaStreamWaitEvent(compute, peer kPushed)");
      CUDA_CHECK(cudaStreamWaitEvent(compute_, peers_->member(p).events[PeerGroup::kPushed][last], 0));
    }
    note("finish: cudaStreamWaitEvent(compute, own kPushed)");
    CUDA_CHECK(cudaStreamWaitEvent(compute_, self_->events[PeerGroup::kPushed][last], 0));
    note("finish: returned");
  } else if (peers_) {
    // Every peer pushes its sums back in bucket order on one stream: the last bucket's event
    // covers them all; this rank's own sums are on its sum stream.
    sum_ready(true);
    for (int p = 0; p < comm_.world(); ++p) {
      if (p == comm_.rank()) continue;
      peers_->await(p, PeerGroup::kGathered, last, step_, comm_);
      CUDA_CHECK(cudaStreamWaitEvent(compute_, peers_->member(p).events[PeerGroup::kGathered][last], 0));
    }
    CUDA_CHECK(cudaStreamWaitEvent(compute_, self_->events[PeerGroup::kGathered][last], 0));
  } else {
    comm_.order(comm_.stream(), compute_);
  }
}

void GradSync::set_fp32_read_ranges(const std::vector<std::pair<size_t, size_t>>& ranges) {
  if (!sharded_) return;
  const int me = comm_.rank();
  std::vector<FloatRange> own;
  for (const Bucket& b : buckets_) {
    const size_t lo = share_begin(b, me), hi = share_end(b, me);
    for (const auto& [offset, count] : ranges) {
      const size_t begin = std::max(lo, offset), end = std::min(hi, offset + count);
      if (begin < end) own.push_back({begin, end - begin});
    }
  }
  cudaFree(fp32_read_);
  fp32_read_ = nullptr;
  if (!own.empty()) {
    CUDA_CHECK(cudaMalloc(&fp32_read_, own.size() * sizeof(FloatRange)));
    CUDA_CHECK(cudaMemcpy(fp32_read_, own.data(), own.size() * sizeof(FloatRange), cudaMemcpyHostToDevice));
  }
  fp32_read_count_ = static_cast<int>(own.size());
}

void GradSync::send_weights(const Share& share) {
  const int me = comm_.rank();
  note("optimizer: order(compute, push)");
  comm_.order(compute_, push_stream_);
  for (int p = 0; p < comm_.world(); ++p) {
    if (p == me) continue;
    const PeerGroup::Member& peer = peers_->member(p);
    note("optimizer: cudaMemcpyPeerAsync(bf16 share)");
    CUDA_CHECK(cudaMemcpyPeerAsync(peer.state.params_bf16 + share.begin, peer.device,
                                   self_->state.params_bf16 + share.begin, self_->device,
                                   share.count * sizeof(__nv_bfloat16), push_stream_));
  }
}

void GradSync::begin_update(cudaStream_t stream) const {
  ENSURE(sharded_ && fp32_read_count_ >= 0 && stream == compute_,
         "GradSync: a sharded update needs the fp32-read ranges set and runs on the compute stream");
}

void GradSync::finish_update() {
  const int me = comm_.rank(), world = comm_.world();
  // Outside its shares a rank's fp32 weights go stale, but some kernels read those (biases,
  // LayerNorm weights, embeddings): the owner's copies keep them whole everywhere.
  Fp32Copies fp32_copies{};
  for (int p = 0; p < world; ++p)
    if (p != me) fp32_copies.at[fp32_copies.count++] = peers_->member(p).state.params;
  note("optimizer: copy_ranges launch");
  copy_ranges(self_->state.params, fp32_read_, fp32_read_count_, fp32_copies, compute_);
  note("optimizer: order(compute, push) 2");
  comm_.order(compute_, push_stream_);
  note("optimizer: cudaEventRecord(kUpdated)");
  // The peers' next forward reads what this rank wrote into their weights; this rank's next
  // forward reads theirs, and its next pushes overwrite what their optimizers read just now.
  CUDA_CHECK(cudaEventRecord(self_->events[PeerGroup::kUpdated][0], push_stream_));
  peers_->publish(me, PeerGroup::kUpdated, 0, step_);
  for (int p = 0; p < world; ++p) {
    if (p == me) continue;
    note("optimizer: PeerGroup::await(peer kUpdated)");
    peers_->await(p, PeerGroup::kUpdated, 0, step_, comm_);
    note("optimizer: cudaStreamWaitEvent(compute, peer kUpdated)");
    CUDA_CHECK(cudaStreamWaitEvent(compute_, peers_->member(p).events[PeerGroup::kUpdated][0], 0));
  }
  note("optimizer: returned");
}

void GradSync::gather_state() {
  if (!sharded_) return;
  // Whole already if no step updated the shares since the last gather (a checkpoint, then the
  // checksums): nothing to copy, and no second round of copies into what the first is still read from.
  if (gathered_at_ == step_) return;
  gathered_at_ = step_;
  NvtxRange range("sharded optimizer: state gathered on every rank");
  const int me = comm_.rank(), world = comm_.world();
  const PeerGroup::State& own = self_->state;
  comm_.order(compute_, push_stream_);  // after the last step's update of the shares
  for (const Bucket& b : buckets_) {
    const size_t begin = share_begin(b, me), n = share_end(b, me) - begin;
    for (int p = 0; p < world && n; ++p) {
      if (p == me) continue;
      const PeerGroup::Member& peer = peers_->member(p);
      CUDA_CHECK(cudaMemcpyPeerAsync(peer.state.params + begin, peer.device, own.params + begin, self_->device,
                                     n * sizeof(float), push_stream_));
      for (size_t k = 0; k < own.optimizer_state.size(); ++k)
        CUDA_CHECK(cudaMemcpyPeerAsync(peer.state.optimizer_state[k] + begin, peer.device,
                                       own.optimizer_state[k] + begin, self_->device, n * sizeof(float), push_stream_));
    }
  }
  CUDA_CHECK(cudaEventRecord(self_->events[PeerGroup::kShared][0], push_stream_));
  peers_->publish(me, PeerGroup::kShared, 0, gathered_at_);
  // The next update of this rank's shares waits for its copies to have read them.
  CUDA_CHECK(cudaStreamWaitEvent(compute_, self_->events[PeerGroup::kShared][0], 0));
  for (int p = 0; p < world; ++p) {
    if (p == me) continue;
    peers_->await(p, PeerGroup::kShared, 0, gathered_at_, comm_);
    CUDA_CHECK(cudaStreamWaitEvent(compute_, peers_->member(p).events[PeerGroup::kShared][0], 0));
  }
}
