#!/usr/bin/env python3
"""Summarise a trace written by `vit_train --trace FILE`: per step (the trace's NVTX "step"
ranges), each stream's busy time, its kernels by kind and the gaps between them; how long two
streams ran at once; and how long the GPU ran kernels with no GEMM among them, the time the
tensor cores idle that overlap could fill. With --gaps N: each stream's N costliest kinds of
gap of 20 us or more, by the kernels either side, and how much of them another stream was busy
(a wait on that stream, likely) or none was (the host, or launch latency).

Usage: python3 tools/trace_summary.py TRACE.json [--gaps N]
"""
import argparse
import json
import re
import signal
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


def short_name(name):
    """A kernel's name without its namespace, template arguments and parameters; GEMMs as such."""
    if kind_of(name)[0] == "GEMM":
        return "GEMM"
    base = re.split(r"[<(]", name.replace("void ", "", 1))[0]
    return base.split("::")[-1].strip()[:36]


def gap_table(name, es, others, steps, top):
    """The top kinds of gap of 20 us or more on one stream, by the kernels either side."""
    rows = {}
    for a, b in zip(es, es[1:]):
        start, end = a["ts"] + a["dur"], b["ts"]
        if end - start < 20:
            continue
        row = rows.setdefault((short_name(a["name"]), short_name(b["name"])), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += end - start
        row[2] += intersect_ms([(start, end)], others) * 1e3
    print(f"\n{name}: gaps of 20 us or more, the {top} costliest kinds (ms a step)")
    print(f"{'after':<37} {'before':<37} {'count':>6} {'ms':>7} {'other stream busy':>18}")
    for (after, before), (count, total, busy) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{after:<37} {before:<37} {count / steps:>6.1f} {total / 1e3 / steps:>7.3f} "
              f"{busy / 1e3 / steps:>18.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--gaps", type=int, default=0, help="each stream's N costliest kinds of gap")
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    lane_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                  if e.get("ph") == "M" and e["name"] == "thread_name"}
    device = [e for e in events if e.get("ph") == "X" and e["cat"] != "nvtx"]
    steps = sum(1 for e in events if e.get("ph") == "X" and e["cat"] == "nvtx" and e["name"] == "step") or 1
    if not device:
        sys.exit(f"{args.trace} holds no device events")
    lo = min(e["ts"] for e in device)
    hi = max(e["ts"] + e["dur"] for e in device)
    print(f"{args.trace}: {steps} step(s), {(hi - lo) / 1e3:.2f} ms from the first kernel to the last; "
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
    if args.gaps > 0:
        for lane, es in sorted(lanes.items()):
            others = [(e["ts"], e["ts"] + e["dur"]) for other, oes in lanes.items() if other != lane for e in oes]
            gap_table(lane_names.get(lane, str(lane)), es, others, steps, args.gaps)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    main()
