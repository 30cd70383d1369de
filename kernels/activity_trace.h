// A timeline of a stretch of the run without Nsight Systems: the GPU's kernels, copies and
// memsets on every stream, and the host's NVTX ranges, recorded by CUPTI's activity API (part of
// the CUDA toolkit) and written as a Chrome trace (JSON), which ui.perfetto.dev and
// chrome://tracing open; tools/trace_timeline.py draws it as a PNG, a lane per stream.
// CUPTI is loaded (dlopen) only when a trace is asked for: a run without one neither loads it
// nor pays for it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// One interval of the timeline. Device work lies on its device's stream; a host range on its
// thread.
struct TraceEvent {
  enum class Kind { Kernel, Memcpy, Memset, HostRange };
  Kind kind;
  std::string name;
  uint64_t start_ns, end_ns;
  uint32_t device = 0, stream = 0;  // device work
  uint32_t thread = 0;              // host ranges: the thread's index in the order first seen
  std::string detail;               // e.g. a kernel's grid, a copy's bytes
};
// The lanes' names, by (device, stream); lanes not named are called "stream N".
using TraceLaneNames = std::map<std::pair<uint32_t, uint32_t>, std::string>;

// The Chrome trace of events: a process per device ("GPU d") with a thread per stream, and one
// for the host's ranges; times in microseconds from the earliest event.
std::string chrome_trace_json(const std::vector<TraceEvent>& events, const TraceLaneNames& lanes);

class ActivityTrace {
 public:
  // Loads CUPTI and has NVTX report its ranges to it. Must run before the process's first NVTX
  // range and before any CUDA call. Throws RuntimeError naming what is missing.
  static void prepare();
  // After prepare(); one at a time in a process (CUPTI's activity API is process-wide).
  ActivityTrace();
  ~ActivityTrace();
  ActivityTrace(const ActivityTrace&) = delete;
  ActivityTrace& operator=(const ActivityTrace&) = delete;

  // A lane's name: the stream's work is shown under it.
  void name_stream(cudaStream_t stream, int device, const std::string& name);
  // Recording on and off. stop() waits for the devices' work and collects every record; the
  // recorded events are then those of the whole stretch.
  void start();
  void stop();
  const std::vector<TraceEvent>& events() const { return events_; }
  // Records CUPTI could not keep (its buffers full): the trace misses that many.
  uint64_t dropped() const { return dropped_; }
  // The Chrome trace of what was recorded.
  std::string chrome_json() const { return chrome_trace_json(events_, lanes_); }

  struct Impl;  // CUPTI's buffers and records (activity_trace.cpp)

 private:
  std::unique_ptr<Impl> impl_;
  std::vector<TraceEvent> events_;
  TraceLaneNames lanes_;
  uint64_t dropped_ = 0;
  bool running_ = false;
};
