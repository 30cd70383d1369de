#include "kernels/activity_trace.h"

#include <cupti_activity.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kernels/check.h"

namespace {
// CUPTI's entry points, resolved from the library loaded by prepare().
struct Cupti {
  void* library = nullptr;
  std::string path;
  CUptiResult (*activity_enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*activity_disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult (*dropped)(CUcontext, uint32_t, size_t*) = nullptr;
  CUptiResult (*result_string)(CUptiResult, const char**) = nullptr;
};
Cupti cupti;

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                     CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_MARKER};

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = "unknown error";
  if (cupti.result_string) cupti.result_string(r, &text);
  throw RuntimeError(std::string("--trace: CUPTI's ") + what + " failed: " + text);
}

template <class F>
void resolve(F*& f, const char* name) {
  f = reinterpret_cast<F*>(dlsym(cupti.library, name));
  if (!f) throw RuntimeError("--trace: " + cupti.path + " has no " + name + " (a CUPTI of another CUDA version?)");
}

// A kernel's name as a person reads it: demangled, without its return type, parameter list and
// anonymous namespace; template arguments kept (cuBLASLt's and CUTLASS's kernels are told apart by
// them), the whole at most 160 characters.
std::string readable_kernel_name(const char* mangled) {
  if (!mangled) return "kernel";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && d ? d : mangled;
  std::free(d);
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at; (at = name.find(anonymous)) != std::string::npos;) name.erase(at, anonymous.size());
  int depth = 0;
  size_t cut = name.size(), last_space = std::string::npos;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (c == '<') ++depth;
    if (c == '>' && depth > 0) --depth;
    if (depth == 0 && c == ' ') last_space = i;
    if (depth == 0 && c == '(' && i > 0) {
      cut = i;
      break;
    }
  }
  std::string out = name.substr(0, cut);
  if (last_space != std::string::npos && last_space < cut) out = out.substr(last_space + 1);
  if (out.size() > 160) out = out.substr(0, 157) + "...";
  return out.empty() ? name : out;
}

std::string json_escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

const char* copy_kind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
    default: return "other";
  }
}
}  // namespace

// The records CUPTI hands back, and host ranges' starts waiting for their ends.
struct ActivityTrace::Impl {
  std::mutex mutex;
  std::vector<TraceEvent> events;
  std::map<uint32_t, std::pair<uint64_t, std::string>> open_ranges;  // marker id -> start, name
  std::map<uint64_t, uint32_t> threads;                              // thread id -> its index
  uint64_t dropped = 0;

  void add(const CUpti_Activity* record) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        char grid[96];
        std::snprintf(grid, sizeof grid, "grid %d,%d,%d block %d,%d,%d", k->gridX, k->gridY, k->gridZ, k->blockX,
                      k->blockY, k->blockZ);
        events.push_back({TraceEvent::Kind::Kernel, readable_kernel_name(k->name), k->start, k->end, k->deviceId,
                          k->streamId, 0, grid});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        events.push_back({TraceEvent::Kind::Memcpy, std::string("memcpy ") + copy_kind(m->copyKind), m->start, m->end,
                          m->deviceId, m->streamId, 0, std::to_string(m->bytes) + " bytes"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        events.push_back({TraceEvent::Kind::Memset, "memset", m->start, m->end, m->deviceId, m->streamId, 0,
                          std::to_string(m->bytes) + " bytes"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MARKER: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMarker2*>(record);
        if (m->flags & CUPTI_ACTIVITY_FLAG_MARKER_START) {
          open_ranges[m->id] = {m->timestamp, m->name ? m->name : "range"};
        } else if (m->flags & CUPTI_ACTIVITY_FLAG_MARKER_END) {
          const auto it = open_ranges.find(m->id);
          if (it == open_ranges.end()) break;  // begun before the recording
          const uint64_t tid = m->objectId.pt.threadId;
          const uint32_t lane = threads.emplace(tid, static_cast<uint32_t>(threads.size())).first->second;
          events.push_back({TraceEvent::Kind::HostRange, it->second.second, it->second.first, m->timestamp, 0, 0, lane,
                            ""});
          open_ranges.erase(it);
        }
        break;
      }
      default: break;
    }
  }
};

namespace {
ActivityTrace::Impl* active = nullptr;  // the trace CUPTI's callbacks fill
constexpr size_t kBufferBytes = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream_id, uint8_t* buffer, size_t, size_t valid) {
  if (active) {
    std::lock_guard<std::mutex> lock(active->mutex);
    CUpti_Activity* record = nullptr;
    while (cupti.next_record(buffer, valid, &record) == CUPTI_SUCCESS) active->add(record);
    size_t dropped = 0;
    if (cupti.dropped(context, stream_id, &dropped) == CUPTI_SUCCESS) active->dropped += dropped;
  }
  std::free(buffer);
}
}  // namespace

void ActivityTrace::prepare() {
  if (cupti.library) return;
  for (const char* name : {"libcupti.so.13", "/usr/local/cuda/lib64/libcupti.so.13",
                           "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13"}) {
    cupti.library = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (cupti.library) break;
  }
  if (!cupti.library)
    throw RuntimeError("--trace needs CUPTI, the CUDA toolkit's profiling library (libcupti.so.13), which was not "
                       "found: add its directory to LD_LIBRARY_PATH");
  link_map* map = nullptr;
  cupti.path = dlinfo(cupti.library, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name ? map->l_name : "libcupti.so.13";
  resolve(cupti.activity_enable, "cuptiActivityEnable");
  resolve(cupti.activity_disable, "cuptiActivityDisable");
  resolve(cupti.register_callbacks, "cuptiActivityRegisterCallbacks");
  resolve(cupti.flush_all, "cuptiActivityFlushAll");
  resolve(cupti.next_record, "cuptiActivityGetNextRecord");
  resolve(cupti.dropped, "cuptiActivityGetNumDroppedRecords");
  resolve(cupti.result_string, "cuptiGetResultString");
  // NVTX hands its ranges to the library this names when the process's first range is pushed.
  setenv("NVTX_INJECTION64_PATH", cupti.path.c_str(), 1);
}

ActivityTrace::ActivityTrace() : impl_(std::make_unique<Impl>()) {
  ENSURE(cupti.library, "ActivityTrace: ActivityTrace::prepare() first");
  ENSURE(!active, "ActivityTrace: one trace at a time");
  active = impl_.get();
  check(cupti.register_callbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
}

ActivityTrace::~ActivityTrace() {
  if (running_) {
    for (CUpti_ActivityKind kind : kKinds) cupti.activity_disable(kind);
    cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  }
  active = nullptr;
}

void ActivityTrace::name_stream(cudaStream_t stream, int device, const std::string& name) {
  unsigned long long id = 0;
  CUDA_CHECK(cudaStreamGetId(stream, &id));
  lanes_[{static_cast<uint32_t>(device), static_cast<uint32_t>(id)}] = name;
}

void ActivityTrace::start() {
  ENSURE(!running_, "ActivityTrace: started twice");
  for (CUpti_ActivityKind kind : kKinds) check(cupti.activity_enable(kind), "cuptiActivityEnable");
  running_ = true;
}

void ActivityTrace::stop() {
  ENSURE(running_, "ActivityTrace: stopped before it started");
  CUDA_CHECK(cudaDeviceSynchronize());
  for (CUpti_ActivityKind kind : kKinds) check(cupti.activity_disable(kind), "cuptiActivityDisable");
  check(cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  running_ = false;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  events_ = std::move(impl_->events);
  impl_->events.clear();
  dropped_ = impl_->dropped;
}

std::string chrome_trace_json(const std::vector<TraceEvent>& events, const TraceLaneNames& lanes) {
  uint64_t t0 = UINT64_MAX;
  for (const TraceEvent& e : events) t0 = std::min(t0, e.start_ns);
  // Processes: one per device (pid = device), the host after them; a thread per stream or host thread.
  uint32_t host_pid = 0;
  std::map<std::pair<uint32_t, uint32_t>, bool> device_lanes;
  std::map<uint32_t, bool> host_lanes;
  for (const TraceEvent& e : events) {
    if (e.kind == TraceEvent::Kind::HostRange) {
      host_lanes[e.thread] = true;
    } else {
      device_lanes[{e.device, e.stream}] = true;
      host_pid = std::max(host_pid, e.device + 1);
    }
  }
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  auto emit = [&](const std::string& line) {
    out += (first ? "" : ",\n") + line;
    first = false;
  };
  char b[512];
  std::map<uint32_t, bool> devices;
  for (const auto& [lane, unused] : device_lanes) devices[lane.first] = true;
  for (const auto& [device, unused] : devices) {
    std::snprintf(b, sizeof b, "{\"ph\": \"M\", \"pid\": %u, \"name\": \"process_name\", \"args\": {\"name\": \"GPU %u\"}}",
                  device, device);
    emit(b);
  }
  int sort = 0;
  for (const auto& [lane, unused] : device_lanes) {
    const auto it = lanes.find(lane);
    const std::string name = "stream " + std::to_string(lane.second) + (it != lanes.end() ? ": " + it->second : "");
    std::snprintf(b, sizeof b, "{\"ph\": \"M\", \"pid\": %u, \"tid\": %u, \"name\": \"thread_name\", \"args\": {\"name\": \"%s\"}}",
                  lane.first, lane.second, json_escaped(name).c_str());
    emit(b);
    std::snprintf(b, sizeof b, "{\"ph\": \"M\", \"pid\": %u, \"tid\": %u, \"name\": \"thread_sort_index\", \"args\": {\"sort_index\": %d}}",
                  lane.first, lane.second, sort++);
    emit(b);
  }
  if (!host_lanes.empty()) {
    std::snprintf(b, sizeof b, "{\"ph\": \"M\", \"pid\": %u, \"name\": \"process_name\", \"args\": {\"name\": \"host (NVTX ranges)\"}}",
                  host_pid);
    emit(b);
    for (const auto& [thread, unused] : host_lanes) {
      std::snprintf(b, sizeof b, "{\"ph\": \"M\", \"pid\": %u, \"tid\": %u, \"name\": \"thread_name\", \"args\": {\"name\": \"thread %u\"}}",
                    host_pid, thread, thread);
      emit(b);
    }
  }
  static const char* kCategory[] = {"kernel", "memcpy", "memset", "nvtx"};
  for (const TraceEvent& e : events) {
    const bool host = e.kind == TraceEvent::Kind::HostRange;
    const double ts = (e.start_ns - t0) / 1e3, dur = (e.end_ns >= e.start_ns ? e.end_ns - e.start_ns : 0) / 1e3;
    std::string line = "{\"ph\": \"X\", \"cat\": \"" + std::string(kCategory[static_cast<int>(e.kind)]) +
                       "\", \"name\": \"" + json_escaped(e.name) + "\", ";
    std::snprintf(b, sizeof b, "\"pid\": %u, \"tid\": %u, \"ts\": %.3f, \"dur\": %.3f", host ? host_pid : e.device,
                  host ? e.thread : e.stream, ts, dur);
    line += b;
    if (!e.detail.empty()) line += ", \"args\": {\"detail\": \"" + json_escaped(e.detail) + "\"}";
    emit(line + "}");
  }
  return out + "\n]}\n";
}
