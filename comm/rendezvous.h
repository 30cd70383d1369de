// Where this process sits in a data-parallel job, and the host-side plumbing between processes:
// the launcher's environment, the rendezvous that hands every process the NCCL unique id, and a
// control channel that stops every process when one fails.
//
// One process drives G GPUs with one worker thread each (--gpus G); a job is P such processes
// (one per node, or one per GPU with --gpus 1) started by a launcher. Worker w of process p is
// rank p * G + w of P * G, on device local_rank * G + w of its machine.
#pragma once
#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct ProcessGroup {
  int rank = 0, size = 1;  // this process among the job's processes
  int local_rank = 0;      // among the job's processes on this machine
  std::string master_addr;  // rendezvous: process 0 listens on master_port
  int master_port = 0;
  std::string source = "single process";  // which environment said so, for messages
};

// The launcher's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun,
// mpirun wrappers, a shell loop), else Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID with
// MASTER_ADDR and MASTER_PORT; none of them: one process. Throws UsageError naming the variable
// that is missing or wrong. getenv is a parameter for the tests.
ProcessGroup process_group_from_env(const std::function<const char*(const char*)>& getenv);

// The job's control channel: process 0 listens on MASTER_PORT, the others connect (retrying
// until timeout_s), process 0 sends them `payload` (the NCCL unique id) and every process gets
// it. The connections stay open: a process that fails reports it (report_failure), process 0
// passes it on, and every process learns of it; a connection that drops without a goodbye
// (a killed process, a lost node) counts as that process's failure.
class ControlChannel {
 public:
  ControlChannel(const ProcessGroup& group, std::vector<char> payload, size_t payload_size, int timeout_s);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  const std::vector<char>& payload() const { return payload_; }
  // Non-empty once any process has failed: "process P: cause".
  std::string failure() const;
  // This process failed: tell the others (and remember it).
  void report_failure(const std::string& what);
  // A clean end: tell the others that this connection's close is not a failure.
  void goodbye();
  // Calls on_failure(failure()) once, from the channel's thread, when a failure arrives.
  void on_failure(std::function<void(const std::string&)> f);

 private:
  void watch();
  void fail(const std::string& what, int from_fd);
  void send_all(const std::string& line, int except_fd);

  ProcessGroup group_;
  std::vector<char> payload_;
  std::vector<int> peers_;         // process 0: one socket per other process; others: the one to 0
  std::vector<int> peer_rank_;     // the process rank at each socket
  std::vector<std::string> inbox_;  // partial lines per socket
  std::vector<bool> said_goodbye_;
  mutable std::mutex mutex_;
  std::mutex send_mutex_;
  std::string failure_;
  std::function<void(const std::string&)> on_failure_;
  bool notified_ = false;
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};
