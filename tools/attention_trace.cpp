// attention_trace: where the resident attention kernels' time goes, CTA by CTA (the forward, and
// the backward up to 256 tokens: its key blocks, past that, stamp nothing). Linked against
// kernels/attention_resident_{forward,backward}.cu compiled with -DATTENTION_TRACE (make
// attention_trace), whose
// kernels stamp clock64 at their phases (kernels/attention_trace.h); one stamped launch of each
// after three unstamped. Prints, per phase, the time from the CTA's start (median, 10th and 90th
// percentile over the CTAs, microseconds) and, per kernel, the CTA durations and how many CTAs an
// SM held on average. The stamps cost a few percent: the kernel's span is printed to compare with
// attention_rate's.
// Usage: attention_trace [B H T HD]   (default 64 16 197 80)
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/attention.h"
#include "kernels/attention_trace.h"
#include "kernels/attention_operands.h"
#include "tools/shape_args.h"

namespace {
using namespace attention_trace;

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * (v.size() - 1) + 0.5))];
}

template <class Launch>
void trace(const char* kernel, const std::vector<std::pair<int, std::string>>& slots, int ctas, unsigned long long* buf,
           const Launch& launch) {
  for (int i = 0; i < 3; ++i) launch();
  set_buffer(buf);
  CUDA_CHECK(cudaMemset(buf, 0, size_t(ctas) * kSlots * 8));
  launch();
  CUDA_CHECK(cudaDeviceSynchronize());
  set_buffer(nullptr);
  std::vector<unsigned long long> h(size_t(ctas) * kSlots);
  CUDA_CHECK(cudaMemcpy(h.data(), buf, h.size() * 8, cudaMemcpyDeviceToHost));

  std::vector<double> ns_per_clock, duration;
  unsigned long long first = ~0ull, last = 0;
  std::map<int, std::vector<std::pair<double, double>>> by_sm;  // SM -> (start, end) ns
  for (int c = 0; c < ctas; ++c) {
    const unsigned long long* r = &h[size_t(c) * kSlots];
    if (r[kEndClock] <= r[kStartClock] || r[kEndNs] <= r[kStartNs]) continue;
    ns_per_clock.push_back(double(r[kEndNs] - r[kStartNs]) / double(r[kEndClock] - r[kStartClock]));
    first = std::min(first, r[kStartNs]), last = std::max(last, r[kEndNs]);
  }
  const double npc = pct(ns_per_clock, 0.5);
  for (int c = 0; c < ctas; ++c) {
    const unsigned long long* r = &h[size_t(c) * kSlots];
    if (r[kEndClock] <= r[kStartClock]) continue;
    duration.push_back((r[kEndClock] - r[kStartClock]) * npc * 1e-3);
    by_sm[int(r[kSm])].push_back({double(r[kStartNs] - first), double(r[kEndNs] - first)});
  }
  const double span = double(last - first);
  double resident_ns = 0;  // CTA-ns summed over SMs
  size_t most = 0;
  for (auto& [sm, v] : by_sm) {
    for (auto& [s, e] : v) resident_ns += e - s;
    most = std::max(most, v.size());
  }
  std::printf("\n%s: %d CTAs on %zu SMs (up to %zu an SM), kernel %.2f us, %.3f ns a clock\n", kernel, ctas, by_sm.size(),
              most, span * 1e-3, npc);
  std::printf("  CTA duration us: median %.2f, p10 %.2f, p90 %.2f; CTAs resident an SM on average %.2f\n",
              pct(duration, 0.5), pct(duration, 0.1), pct(duration, 0.9), resident_ns / (span * by_sm.size()));
  std::printf("  %-36s %8s %8s %8s %6s\n", "phase (us from the CTA's start)", "median", "p10", "p90", "CTAs");
  for (const auto& [slot, name] : slots) {
    std::vector<double> at;
    for (int c = 0; c < ctas; ++c) {
      const unsigned long long* r = &h[size_t(c) * kSlots];
      if (r[slot] > r[kStartClock]) at.push_back((r[slot] - r[kStartClock]) * npc * 1e-3);
    }
    if (!at.empty())
      std::printf("  %-36s %8.2f %8.2f %8.2f %6zu\n", name.c_str(), pct(at, 0.5), pct(at, 0.1), pct(at, 0.9), at.size());
  }
  std::vector<double> end;
  for (int c = 0; c < ctas; ++c) {
    const unsigned long long* r = &h[size_t(c) * kSlots];
    if (r[kEndClock] > r[kStartClock]) end.push_back((r[kEndClock] - r[kStartClock]) * npc * 1e-3);
  }
  std::printf("  %-36s %8.2f %8.2f %8.2f %6zu\n", "end", pct(end, 0.5), pct(end, 0.1), pct(end, 0.9), end.size());
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<AttentionShape> shapes;
  if (!parse_shapes(argc, argv, "attention_trace", {{64, 16, 197, 80}}, &shapes)) return 2;
  if (shapes.size() != 1) {
    std::fprintf(stderr, "attention_trace: %zu shapes; it traces one (usage: attention_trace [B H T HD])\n", shapes.size());
    return 2;
  }
  const int B = shapes[0].B, H = shapes[0].H, T = shapes[0].T, hd = shapes[0].hd;
  try {
    if (!attention_forward_resident_supported(T, hd)) {
      std::fprintf(stderr, "attention_trace: T %d, hd %d is not the resident kernels' shape\n", T, hd);
      return 2;
    }
    const int ctas = B * H;
    const AttentionOperands ops(B, T, H, hd);
    __nv_bfloat16 *qkv = ops.qkv, *out = ops.out, *dout = ops.dout, *dqkv = ops.dqkv;
    float *lse = ops.lse, *delta = ops.delta;
    unsigned long long* buf;
    CUDA_CHECK(cudaMalloc(&buf, size_t(ctas) * kSlots * 8));
    std::printf("attention_trace %d %d %d %d\n", B, H, T, hd);

    const auto str = [](int k) { return std::to_string(k); };
    std::vector<std::pair<int, std::string>> fwd = {{kFwdIssueBegins, "TMA issue begins (thread 0)"},
                                                    {kFwdIssued, "TMA issued"}};
    for (int w = 0; w < 2; ++w)
      for (int c = 0; c < 4; ++c) fwd.push_back({kFwdLanded + 4 * w + c, "WG" + str(w) + " finds tile " + str(c) + " landed"});
    for (int i = 0; i < 4; ++i) {
      for (int c = 0; c < 4; ++c) fwd.push_back({kFwdChunk + 4 * i + c, "q tile " + str(i) + ": chunk " + str(c) + " issued"});
      fwd.push_back({kFwdComplete + i, "q tile " + str(i) + ": O complete"});
      fwd.push_back({kFwdStaged + i, "q tile " + str(i) + ": O staged"});
      fwd.push_back({kFwdStored + i, "q tile " + str(i) + ": O store issued"});
    }
    trace("forward (resident)", fwd, ctas, buf,
          [&] { attention_forward(qkv, out, lse, B, T, H, hd, 0, AttentionForward::Resident); });
    if (!attention_resident_supported(T, hd) || T > 256 || hd == 128) {
      std::printf("\nbackward: T %d, hd %d is not traced (the resident backward's one-CTA shape: T <= 256, hd 64 or 80)\n",
                  T, hd);
      CUDA_CHECK(cudaFree(buf));
      return 0;
    }

    std::vector<std::pair<int, std::string>> bwd = {{kBwdIssueBegins, "TMA issue begins (thread 128)"},
                                                    {kBwdIssued, "TMA issued"}};
    for (int c = 0; c < 4; ++c) bwd.push_back({kBwdLanded + c, "WG0 finds tile " + str(c) + " landed"});
    for (int t = 0; t < 4; ++t) bwd.push_back({kBwdDelta + t, "WG2 delta of tile " + str(t)});
    for (int i = 0; i < 4; ++i) {
      for (int c = 0; c < 4; ++c) bwd.push_back({kBwdSlotFull + 4 * i + c, "WG0 q " + str(i) + " k " + str(c) + ": slot full"});
      bwd.push_back({kBwdDqComplete + i, "WG0 q " + str(i) + ": dQ complete"});
      bwd.push_back({kBwdDqStored + i, "WG0 q " + str(i) + ": dQ written"});
      for (int j = 0; j < 2; ++j) bwd.push_back({kBwdProducts + 4 * j + i, "WG" + str(j + 1) + " q " + str(i) + ": products done"});
    }
    for (int j = 0; j < 2; ++j)
      for (int part = 0; part < 2; ++part) {
        const std::string what = "WG" + str(j + 1) + (part ? " dK" : " dV");
        bwd.push_back({kBwdStaged + 2 * part + j, what + " staged"});
        bwd.push_back({kBwdWritten + 2 * part + j, what + " stores issued"});
      }
    trace("backward (resident)", bwd, ctas, buf,
          [&] { attention_backward(qkv, out, dout, lse, delta, dqkv, B, T, H, hd, 0, AttentionBackward::Resident); });
    CUDA_CHECK(cudaFree(buf));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_trace: error: %s\n", e.what());
    return 1;
  }
}
