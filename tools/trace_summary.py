#!/usr/bin/env python3
"""Summarise a trace written by `vit_train --trace FILE`: per step (the trace's NVTX "step"
ranges), each stream's busy time, its kernels by kind and the gaps between them; how long two
streams ran at once; and how long the GPU ran kernels with no GEMM among them, the time the
tensor cores idle that overlap could fill.

Usage: python3 tools/trace_summary.py TRACE.json
"""
import json
import sys

from trace_timeline import kind_of


def union_ms(intervals):
    """The total length of the union of (start, end) intervals, in ms (input in us)."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def intersect_ms(a, b):
    """The length of the intersection of two unions of intervals, in ms (input in us)."""
    return union_ms(a) + union_ms(b) - union_ms(a + b)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        events = json.load(f)["traceEvents"]
    lane_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                  if e.get("ph") == "M" and e["name"] == "thread_name"}
    device = [e for e in events if e.get("ph") == "X" and e["cat"] != "nvtx"]
    steps = sum(1 for e in events if e.get("ph") == "X" and e["cat"] == "nvtx" and e["name"] == "step") or 1
    if not device:
        sys.exit(f"{sys.argv[1]} holds no device events")
    lo = min(e["ts"] for e in device)
    hi = max(e["ts"] + e["dur"] for e in device)
    print(f"{sys.argv[1]}: {steps} step(s), {(hi - lo) / 1e3:.2f} ms from the first kernel to the last; "
          f"per step:")

    lanes = {}
    for e in device:
        lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    kinds = sorted({kind_of(e["name"])[0] for e in device})
    print(f"\n{'stream':<34} {'kernels':>8} {'busy ms':>8} {'gaps ms':>8} {'gaps<20us':>9}  " +
          " ".join(f"{k[:11]:>11}" for k in kinds))
    for lane, es in sorted(lanes.items()):
        es.sort(key=lambda e: e["ts"])
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in es]
        gaps = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
        by_kind = {k: 0.0 for k in kinds}
        for e in es:
            by_kind[kind_of(e["name"])[0]] += e["dur"] / 1e3
        print(f"{lane_names.get(lane, str(lane))[:34]:<34} {len(es) / steps:>8.0f} {union_ms(spans) / steps:>8.2f} "
              f"{sum(gaps) / 1e3 / steps:>8.2f} {sum(g for g in gaps if g < 20) / 1e3 / steps:>9.2f}  " +
              " ".join(f"{by_kind[k] / steps:>11.2f}" for k in kinds))

    all_spans = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    gemm = [(e["ts"], e["ts"] + e["dur"]) for e in device if kind_of(e["name"])[0] == "GEMM"]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in device if kind_of(e["name"])[0] != "GEMM"]
    lane_spans = [[(e["ts"], e["ts"] + e["dur"]) for e in es] for es in lanes.values()]
    two = 0.0
    for i in range(len(lane_spans)):
        for j in range(i + 1, len(lane_spans)):
            two += intersect_ms(lane_spans[i], lane_spans[j])
    busy, gemm_busy = union_ms(all_spans), union_ms(gemm)
    print(f"\nany stream busy {busy / steps:.2f} ms; two streams at once {two / steps:.2f} ms")
    print(f"GEMMs running {gemm_busy / steps:.2f} ms; other kernels with no GEMM beside them "
          f"{(busy - gemm_busy) / steps:.2f} ms (the tensor cores idle); other kernels beside a GEMM "
          f"{intersect_ms(gemm, other) / steps:.2f} ms; nothing running {((hi - lo) / 1e3 - busy) / steps:.2f} ms")


if __name__ == "__main__":
    main()
