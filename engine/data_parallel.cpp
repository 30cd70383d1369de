#include "engine/data_parallel.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/peer_group.h"
#include "comm/rendezvous.h"
#include "engine/trainer.h"
#include "kernels/check.h"
#include "kernels/device.h"

namespace {
using Clock = std::chrono::steady_clock;
constexpr int kRendezvousTimeoutS = 300;  // processes a launcher starts arrive within this
constexpr int kExitGraceS = 30;           // after a failure, workers get this long to stop

// What the workers of this process share: their communicators (for aborting them), the first
// failure, and how many have finished.
struct Supervisor {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Comm*> comms;
  std::string aborting;      // non-empty once abort_all ran: a communicator registered later is aborted at once
  std::string failure;       // the first: "rank R: cause" or from another process
  bool usage_error = false;  // that failure was bad input (exit 2)
  int finished = 0;

  // Holds the lock throughout: a worker frees its communicator only after clearing its slot
  // under the same lock, so none is freed while being aborted.
  void abort_all(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex);
    aborting = why;
    for (Comm* c : comms)
      if (c) c->abort(why);
  }
  // Returns true for the first failure (whose message is the one printed).
  bool fail(const std::string& what, bool usage) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!failure.empty()) return false;
    failure = what;
    usage_error = usage;
    changed.notify_all();
    return true;
  }
};
}  // namespace

namespace {
// What process 0 hands the others at the rendezvous: the NCCL id (empty on the others).
std::vector<char> nccl_id_payload(const ProcessGroup& group) {
  std::vector<char> bytes;
  if (group.rank == 0) {
    ncclUniqueId id;
    NCCL_CHECK(ncclGetUniqueId(&id));
    bytes.assign(id.internal, id.internal + sizeof id.internal);
  }
  return bytes;
}
}  // namespace

void report_failure_to_job(const ProcessGroup& group, const std::string& what) {
  try {  // a real id: the others may start NCCL with it before the failure reaches them
    ControlChannel channel(group, nccl_id_payload(group), sizeof(ncclUniqueId), kRendezvousTimeoutS);
    channel.report_failure(what);
  } catch (const std::exception&) {  // no rendezvous: the failure's own message is printed anyway
  }
}

int run_data_parallel(RunPlan& plan) {
  const TrainOptions& opts = plan.opts;
  const ProcessGroup& group = plan.group;
  // The devices and the exchange, checked before this process joins the job's rendezvous: a
  // failure here is passed on to the other processes, which stop too.
  const int world = plan.world;
  int first_device = 0;
  std::unique_ptr<PeerGroup> peers;
  try {
    std::string why_none;
    const int count = cuda_gpu_count(&why_none);
    if (count == 0) throw RuntimeError("no CUDA GPU was found on this machine (" + why_none + "); vit_train needs one");
    first_device = group.local_rank * opts.gpus;
    if (first_device + opts.gpus > count)
      throw UsageError("--gpus " + std::to_string(opts.gpus) + (group.size > 1 ? " with local rank " + std::to_string(group.local_rank) : "") +
                       " needs devices " + std::to_string(first_device) + ".." + std::to_string(first_device + opts.gpus - 1) +
                       " but this machine has " + std::to_string(count) + " GPU(s)");
    // The copy-engine exchange needs every rank in this process, peer access between their GPUs,
    // fp32 sums outside NCCL's window; auto takes it where it applies, and says so when it does not.
    if (opts.allreduce != AllReduceMethod::Nccl && opts.reduce_dtype == ReduceDType::F32 && !opts.nccl_window &&
        (world > 1 || opts.allreduce != AllReduceMethod::Auto)) {
      std::vector<int> devices;
      for (int w = 0; w < opts.gpus; ++w) devices.push_back(first_device + w);
      std::string why;
      if (group.size > 1)
        why = "the ranks are spread over " + std::to_string(group.size) + " processes (a launcher's job)";
      else
        PeerGroup::reachable(devices, &why);
      if (why.empty()) {
        peers = std::make_unique<PeerGroup>(world);
      } else if (opts.allreduce == AllReduceMethod::CopyEngine) {
        throw UsageError("--allreduce copy-engine needs every rank's GPU in this process, each reaching the others' "
                         "memory: " + why + "; use --allreduce nccl");
      } else if (group.rank == 0 && opts.gpus > 1) {
        std::printf("note: gradients summed over NCCL (--allreduce auto): %s\n", why.c_str());
      }
    }
  } catch (const std::exception& e) {
    if (group.size > 1) report_failure_to_job(group, e.what());
    throw;
  }

  // The NCCL id travels from process 0 to the others over the control channel.
  const std::vector<char> id_bytes = nccl_id_payload(group);
  Supervisor sup;  // before the channel: its watcher thread may call into sup until the channel is gone
  sup.comms.assign(opts.gpus, nullptr);
  ControlChannel channel(group, id_bytes, sizeof(ncclUniqueId), kRendezvousTimeoutS);
  ncclUniqueId id;
  std::memcpy(id.internal, channel.payload().data(), sizeof id.internal);
  channel.on_failure([&](const std::string& f) {  // another process failed
    if (sup.fail("stopping: " + f, false)) sup.abort_all(f);
  });
  std::vector<std::atomic<long>> progress(opts.gpus);
  std::vector<std::atomic<const char*>> activity(opts.gpus);
  for (auto& a : activity) a = "starting";
  const std::string layout = group.size > 1 ? std::to_string(group.size) + " processes x " + std::to_string(opts.gpus) +
                                                  " GPU(s), " + group.source
                                            : std::to_string(opts.gpus) + " GPUs of one process";
  std::atomic<int> built{0};  // trainers constructed
  std::vector<std::thread> workers;
  for (int w = 0; w < opts.gpus; ++w) {
    workers.emplace_back([&, w] {
      const int rank = group.rank * opts.gpus + w;
      // Both outlive the try block: after a failure the communicators are aborted first, so
      // that the trainer's stream (which may wait on a collective) can drain when it is freed.
      std::unique_ptr<Comm> comm;
      std::unique_ptr<Trainer> trainer;
      try {
        WorkerContext ctx;
        ctx.rank = rank;
        ctx.world = world;
        ctx.device = first_device + w;
        ctx.layout = layout;
        ctx.progress = &progress[w];
        ctx.activity = &activity[w];
        CUDA_CHECK(cudaSetDevice(ctx.device));
        comm = std::make_unique<Comm>(id, world, rank, opts.comm_ctas);
        {
          std::lock_guard<std::mutex> lock(sup.mutex);
          sup.comms[w] = comm.get();
          if (!sup.aborting.empty()) comm->abort(sup.aborting);  // the failure came during its init
        }
        ctx.comm = comm.get();
        ctx.peers = peers.get();
        trainer = std::make_unique<Trainer>(plan, ctx);
        if (++built == opts.gpus) plan.initial.reset();  // uploaded by every rank: not needed again
        if (plan.opts.eval_only)
          trainer->evaluate_only();
        else
          trainer->train();
      } catch (const std::exception& e) {
        const bool usage = dynamic_cast<const UsageError*>(&e) != nullptr;
        const std::string what = "rank " + std::to_string(rank) + ": " + e.what();
        if (sup.fail(what, usage)) {
          sup.abort_all(what);  // first the local ranks, then the other processes (a blocking send)
          channel.report_failure(what);
        }
      }
      bool failed;
      {
        std::lock_guard<std::mutex> lock(sup.mutex);
        failed = !sup.failure.empty();
      }
      try {
        // After a failure the process exits next; with the copy-engine exchange a peer's copies
        // may still be in flight towards this rank's gradients, so they are not freed under them.
        if (failed && peers)
          (void)trainer.release();
        else
          trainer.reset();
      } catch (...) {
      }
      {
        std::lock_guard<std::mutex> lock(sup.mutex);
        sup.comms[w] = nullptr;
      }
      comm.reset();
      std::lock_guard<std::mutex> lock(sup.mutex);
      ++sup.finished;
      sup.changed.notify_all();
    });
  }

  // Supervise: a run in which no worker finishes a step for --comm-timeout seconds (a hung
  // collective, a silent peer) is stopped; after a failure, the workers get a grace period.
  std::vector<long> last(opts.gpus, -1);
  auto last_change = Clock::now();
  Clock::time_point failed_at{};
  for (;;) {
    std::unique_lock<std::mutex> lock(sup.mutex);
    sup.changed.wait_for(lock, std::chrono::milliseconds(200));
    if (sup.finished == opts.gpus) break;
    if (!sup.failure.empty()) {
      if (failed_at == Clock::time_point{}) failed_at = Clock::now();
      if (Clock::now() - failed_at > std::chrono::seconds(kExitGraceS)) {
        std::fprintf(stderr, "vit_train: error: %s\n(the workers did not stop within %d s; exiting)\n",
                     sup.failure.c_str(), kExitGraceS);
        std::fflush(stderr);
        std::_Exit(1);
      }
      continue;
    }
    bool moved = false;
    for (int w = 0; w < opts.gpus; ++w) {
      const long p = progress[w].load();
      if (p != last[w]) moved = true;
      last[w] = p;
    }
    if (moved) last_change = Clock::now();
    // Start-up (NCCL init, autotuning, loading data) counts as a step: it too must end in time.
    if (Clock::now() - last_change > std::chrono::seconds(opts.comm_timeout)) {
      lock.unlock();
      std::string what = "no step finished for " + std::to_string(opts.comm_timeout) +
                         " s (--comm-timeout): a collective is hung or a peer stopped answering (";
      for (int w = 0; w < opts.gpus; ++w)
        what += (w ? "; rank " : "rank ") + std::to_string(group.rank * opts.gpus + w) + ": " + activity[w].load();
      what += ")";
      if (sup.fail("process " + std::to_string(group.rank) + ": " + what, false)) {
        sup.abort_all(what);
        channel.report_failure(what);
      }
    }
  }
  for (std::thread& t : workers) t.join();
  if (!sup.failure.empty()) {
    // Out at once: after an abort, library teardown at exit (NCCL's proxy threads, the CUDA
    // context) is not worth waiting on.
    std::fprintf(stderr, "vit_train: %s%s\n", sup.usage_error ? "" : "error: ", sup.failure.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(sup.usage_error ? 2 : 1);
  }
  channel.goodbye();
  return 0;
}
