#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "kernels/check.h"

namespace {
using Clock = std::chrono::steady_clock;

int parse_env_int(const std::function<const char*(const char*)>& getenv, const char* name, int lo, int hi,
                  const std::string& source) {
  const char* v = getenv(name);
  if (!v || !*v) throw UsageError(source + ": " + name + " is not set");
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno || *end || x < lo || x > hi)
    throw UsageError(source + ": " + name + "='" + v + "' must be an integer from " + std::to_string(lo) + " to " +
                     std::to_string(hi));
  return static_cast<int>(x);
}

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

// Writes all of buf, or throws.
void write_all(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw RuntimeError(sys_error("control channel: send"));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Reads exactly n bytes before the deadline, or throws.
void read_all(int fd, void* buf, size_t n, Clock::time_point deadline, const std::string& what) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (left <= 0) throw RuntimeError("control channel: timed out waiting for " + what);
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw RuntimeError(sys_error("control channel: poll"));
    if (r == 0) continue;
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) throw RuntimeError("control channel: the connection closed while waiting for " + what);
    p += got;
    n -= static_cast<size_t>(got);
  }
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
}  // namespace

ProcessGroup process_group_from_env(const std::function<const char*(const char*)>& getenv) {
  ProcessGroup g;
  const bool torch_style = getenv("WORLD_SIZE") && *getenv("WORLD_SIZE");
  const bool slurm = !torch_style && getenv("SLURM_NTASKS") && *getenv("SLURM_NTASKS");
  if (!torch_style && !slurm) {
    // A rank without a world: every process would train alone, all on the same GPU.
    for (const char* name : {"RANK", "LOCAL_RANK"})
      if (getenv(name) && *getenv(name))
        throw UsageError(std::string(name) + " is set but WORLD_SIZE is not: a launcher sets RANK, LOCAL_RANK and "
                         "WORLD_SIZE together (unset " + name + " to run as one process)");
    return g;
  }
  if (torch_style) {
    g.source = "launcher environment (RANK/WORLD_SIZE)";
    g.size = parse_env_int(getenv, "WORLD_SIZE", 1, 1 << 20, g.source);
    g.rank = parse_env_int(getenv, "RANK", 0, g.size - 1, g.source);
    g.local_rank = parse_env_int(getenv, "LOCAL_RANK", 0, 1 << 20, g.source);
  } else {
    g.source = "Slurm environment (SLURM_PROCID/SLURM_NTASKS)";
    if (!getenv("SLURM_PROCID") || !*getenv("SLURM_PROCID"))  // (salloc's shell: an allocation, no task)
      throw UsageError("SLURM_NTASKS is set but SLURM_PROCID is not: launch the tasks with srun (one a GPU, or one a "
                       "node with --gpus N), or unset SLURM_NTASKS to run as one process");
    g.size = parse_env_int(getenv, "SLURM_NTASKS", 1, 1 << 20, g.source);
    g.rank = parse_env_int(getenv, "SLURM_PROCID", 0, g.size - 1, g.source);
    g.local_rank = parse_env_int(getenv, "SLURM_LOCALID", 0, 1 << 20, g.source);
  }
  if (g.size == 1) return g;
  const char* addr = getenv("MASTER_ADDR");
  if (!addr || !*addr) throw UsageError(g.source + ": MASTER_ADDR is not set (the host of process 0)");
  g.master_addr = addr;
  g.master_port = parse_env_int(getenv, "MASTER_PORT", 1, 65535, g.source);
  return g;
}

ControlChannel::ControlChannel(const ProcessGroup& group, std::vector<char> payload, size_t payload_size,
                               int timeout_s)
    : group_(group), payload_(std::move(payload)) {
  if (group_.size == 1) return;
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  const std::string where = group_.master_addr + ":" + std::to_string(group_.master_port);
  if (group_.rank == 0) {
    ENSURE(payload_.size() == payload_size, "control channel: process 0 has no payload to send");
    const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0) throw RuntimeError(sys_error("control channel: socket"));
    const int one = 1;
    ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(group_.master_port));
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(lfd, 1024) != 0) {
      const std::string e = sys_error("control channel: cannot listen on port " + std::to_string(group_.master_port));
      ::close(lfd);
      throw RuntimeError(e + " (MASTER_PORT in use?)");
    }
    try {
      while (static_cast<int>(peers_.size()) < group_.size - 1) {
        const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
        if (left <= 0)
          throw RuntimeError("control channel: only " + std::to_string(peers_.size() + 1) + " of " +
                             std::to_string(group_.size) + " processes arrived at " + where + " within " +
                             std::to_string(timeout_s) + " s");
        pollfd pfd{lfd, POLLIN, 0};
        if (::poll(&pfd, 1, std::min(left, 1000)) <= 0) continue;
        const int fd = ::accept(lfd, nullptr, nullptr);
        if (fd < 0) continue;
        set_nodelay(fd);
        int32_t rank = -1;
        try {  // a stray connection that says nothing is dropped, not waited on
          read_all(fd, &rank, sizeof rank, std::min(deadline, Clock::now() + std::chrono::seconds(10)),
                   "a process's rank");
        } catch (const RuntimeError&) {
          ::close(fd);
          continue;
        }
        const bool taken = std::find(peer_rank_.begin(), peer_rank_.end(), rank) != peer_rank_.end();
        if (rank <= 0 || rank >= group_.size || taken) {
          ::close(fd);
          throw RuntimeError("control channel: a process announced rank " + std::to_string(rank) + " of " +
                             std::to_string(group_.size) + (taken ? ", which another process has (RANK set twice?)" : ""));
        }
        peers_.push_back(fd);
        peer_rank_.push_back(rank);
      }
      for (int fd : peers_) write_all(fd, payload_.data(), payload_size);
    } catch (...) {
      ::close(lfd);
      for (int fd : peers_) ::close(fd);
      throw;
    }
    ::close(lfd);
  } else {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    const int gai = ::getaddrinfo(group_.master_addr.c_str(), std::to_string(group_.master_port).c_str(), &hints, &res);
    if (gai != 0)
      throw RuntimeError("control channel: cannot resolve MASTER_ADDR " + group_.master_addr + ": " + gai_strerror(gai));
    int fd = -1;
    while (fd < 0) {  // process 0 may not listen yet
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) break;
      if (fd >= 0) ::close(fd);
      fd = -1;
      if (Clock::now() > deadline) {
        ::freeaddrinfo(res);
        throw RuntimeError("control channel: could not reach process 0 at " + where + " within " +
                           std::to_string(timeout_s) + " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::freeaddrinfo(res);
    set_nodelay(fd);
    const int32_t rank = group_.rank;
    try {
      write_all(fd, &rank, sizeof rank);
      payload_.resize(payload_size);
      read_all(fd, payload_.data(), payload_size, deadline, "the NCCL id from process 0");
    } catch (...) {
      ::close(fd);
      throw;
    }
    peers_.push_back(fd);
    peer_rank_.push_back(0);
  }
  inbox_.resize(peers_.size());
  said_goodbye_.assign(peers_.size(), false);
  watcher_ = std::thread([this] { watch(); });
}

ControlChannel::~ControlChannel() {
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
  for (int fd : peers_) ::close(fd);
}

std::string ControlChannel::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void ControlChannel::on_failure(std::function<void(const std::string&)> f) {
  std::string pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    on_failure_ = std::move(f);
    if (!failure_.empty() && !notified_) {
      notified_ = true;
      pending = failure_;
    }
  }
  if (!pending.empty()) on_failure_(pending);
}

void ControlChannel::send_all(const std::string& line, int except_fd) {
  std::lock_guard<std::mutex> lock(send_mutex_);  // the watcher and the workers both send: whole lines
  for (int fd : peers_)
    if (fd != except_fd) {
      try {
        write_all(fd, line.data(), line.size());
      } catch (const std::exception&) {  // that peer is gone; the watcher reports it
      }
    }
}

void ControlChannel::fail(const std::string& what, int from_fd) {
  std::function<void(const std::string&)> notify;
  std::string msg;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = what;
    if (!notified_ && on_failure_) {
      notified_ = true;
      notify = on_failure_;
      msg = failure_;
    }
  }
  if (group_.rank == 0) send_all("FAIL " + what + "\n", from_fd);  // process 0 passes it on
  if (notify) notify(msg);
}

void ControlChannel::report_failure(const std::string& what) {
  if (group_.size == 1) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = what;
    return;
  }
  std::string line = "process " + std::to_string(group_.rank) + ": " + what;
  for (char& c : line)
    if (c == '\n') c = ' ';
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = line;
    notified_ = true;  // this process knows already
  }
  send_all("FAIL " + line + "\n", -1);
}

void ControlChannel::goodbye() {
  if (group_.size == 1) return;
  send_all("BYE\n", -1);
  stop_ = true;
}

void ControlChannel::watch() {
  std::vector<bool> open(peers_.size(), true);
  while (!stop_) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < peers_.size(); ++i)
      if (open[i]) {
        fds.push_back({peers_[i], POLLIN, 0});
        which.push_back(i);
      }
    if (fds.empty()) return;
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const size_t i = which[k];
      char buf[1024];
      const ssize_t got = ::recv(peers_[i], buf, sizeof buf, 0);
      if (got <= 0) {
        open[i] = false;
        if (!said_goodbye_[i] && !stop_)
          fail("process " + std::to_string(peer_rank_[i]) +
                   " was lost (its control connection closed without a goodbye: killed, crashed, or its node is gone)",
               peers_[i]);
        continue;
      }
      inbox_[i].append(buf, static_cast<size_t>(got));
      size_t nl;
      while ((nl = inbox_[i].find('\n')) != std::string::npos) {
        const std::string line = inbox_[i].substr(0, nl);
        inbox_[i].erase(0, nl + 1);
        if (line == "BYE") said_goodbye_[i] = true;
        else if (line.rfind("FAIL ", 0) == 0) fail(line.substr(5), peers_[i]);
      }
    }
  }
}
