#include "comm/peer_group.h"

#include <algorithm>
#include <chrono>

#include "kernels/check.h"
#include "comm/communicator.h"

namespace {
constexpr auto kPoll = std::chrono::milliseconds(50);  // how often a host wait looks for an abort
}

PeerGroup::PeerGroup(int ranks) : ranks_(ranks), members_(ranks) {}

PeerGroup::~PeerGroup() {
  for (Member& m : members_) {
    if (m.device < 0) continue;
    cudaSetDevice(m.device);
    for (auto& stage : m.events)
      for (cudaEvent_t e : stage) cudaEventDestroy(e);
    cudaFree(m.receive);
  }
}

bool PeerGroup::reachable(const std::vector<int>& devices, std::string* why) {
  for (int a : devices)
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) {
        *why = "GPU " + std::to_string(a) + " cannot access GPU " + std::to_string(b) + "'s memory (no peer access)";
        return false;
      }
    }
  return true;
}

long& PeerGroup::published(int rank, Stage stage, int bucket) {
  return published_[(static_cast<size_t>(rank) * kStages + stage) * buckets_ + bucket];
}

const PeerGroup::Member& PeerGroup::join(int rank, const State& state, size_t slot_floats, int buckets, Comm& comm) {
  ENSURE(rank >= 0 && rank < ranks_ && buckets > 0, "PeerGroup::join: bad rank or no bucket");
  int device = -1;
  CUDA_CHECK(cudaGetDevice(&device));
  {
    std::unique_lock<std::mutex> lock(mutex_);  // filled in under the lock: the destructor frees what is there
    if (buckets_ < 0) {
      buckets_ = buckets;
      published_.assign(static_cast<size_t>(ranks_) * kStages * buckets_, -1);
    }
    ENSURE(buckets == buckets_, "PeerGroup::join: the ranks cut different buckets");
    Member& m = members_[rank];
    m.device = device;
    m.state = state;
    CUDA_CHECK(cudaMalloc(&m.receive, std::max<size_t>(1, slot_floats * (ranks_ - 1)) * sizeof(float)));
    for (auto& stage : m.events) {
      stage.assign(buckets, nullptr);
      for (cudaEvent_t& e : stage) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    ++joined_;
    changed_.notify_all();
    while (joined_ < ranks_) {
      comm.throw_if_aborted();  // once the supervisor aborted the run
      changed_.wait_for(lock, kPoll);
    }
  }
  for (int p = 0; p < ranks_; ++p) {
    if (members_[p].device == device) continue;
    const cudaError_t e = cudaDeviceEnablePeerAccess(members_[p].device, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // another rank's trainer in this process enabled it before: fine
    } else {
      CUDA_CHECK(e);
    }
  }
  return members_[rank];
}

void PeerGroup::publish(int rank, Stage stage, int bucket, long step) {
  std::lock_guard<std::mutex> lock(mutex_);
  published(rank, stage, bucket) = step;
  changed_.notify_all();
}

bool PeerGroup::published_for(int rank, Stage stage, int bucket, long step) {
  std::lock_guard<std::mutex> lock(mutex_);
  return published(rank, stage, bucket) >= step;
}

void PeerGroup::await(int rank, Stage stage, int bucket, long step, Comm& comm) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (published(rank, stage, bucket) < step) {
    comm.throw_if_aborted();
    changed_.wait_for(lock, kPoll);
  }
}
