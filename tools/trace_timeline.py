#!/usr/bin/env python3
"""Draw a trace written by `vit_train --trace FILE` as a PNG timeline: a lane per GPU stream (its
kernels, copies and memsets) and per host thread (its NVTX ranges, nested ranges stacked), each
kind of kernel in its own colour, with the busy time of every lane in its label.

Usage: python3 tools/trace_timeline.py TRACE.json OUT.png [--from-ms A] [--to-ms B] [--title T]
Needs matplotlib.
"""
import argparse
import json
import sys

# Kernel kinds by name, first match wins; the colours of the legend.
KINDS = [
    ("GEMM", ("gemm", "xmma", "nvjet", "cutlass", "sm90_", "matmul"), "#4c72b0"),
    ("attention", ("attention", "flash", "fmha", "sdpa"), "#dd8452"),
    ("LayerNorm", ("layernorm",), "#55a868"),
    ("GELU", ("gelu",), "#c44e52"),
    ("FP8 casts", ("fp8", "cast", "transpose"), "#8172b3"),
    ("optimizer", ("sgd", "adamw"), "#937860"),
    ("reductions", ("sum_rows", "colsum", "reduce", "l2_norm", "sum_into"), "#da8bc3"),
    ("communication", ("nccl", "peer"), "#8c8c8c"),
    ("copies", ("memcpy", "memset"), "#ccb974"),
]
OTHER = ("other", "#64b5cd")
HOST = "#b0b0b0"


def kind_of(name):
    low = name.lower()
    for label, keys, colour in KINDS:
        if any(k in low for k in keys):
            return label, colour
    return OTHER


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("png")
    parser.add_argument("--from-ms", type=float, default=None, help="start of the window drawn")
    parser.add_argument("--to-ms", type=float, default=None, help="end of the window drawn")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        sys.exit("trace_timeline.py needs matplotlib (pip install matplotlib)")

    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    process_names, lane_names = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e["name"] == "process_name":
            process_names[e["pid"]] = e["args"]["name"]
        elif e["name"] == "thread_name":
            lane_names[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        sys.exit(f"{args.trace} holds no events")
    lo = args.from_ms if args.from_ms is not None else min(e["ts"] for e in spans) / 1e3
    hi = args.to_ms if args.to_ms is not None else max(e["ts"] + e["dur"] for e in spans) / 1e3

    # Lanes: the GPUs' streams first (in the trace's order), then the host threads, whose nested
    # ranges get a row per depth.
    lanes = []  # (label, [(start_ms, dur_ms, colour)])
    by_lane = {}
    for e in spans:
        by_lane.setdefault((e["pid"], e["tid"], e["cat"] == "nvtx"), []).append(e)
    legend = {}
    for (pid, tid, host), es in sorted(by_lane.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        es.sort(key=lambda e: e["ts"])
        name = f"{process_names.get(pid, pid)} {lane_names.get((pid, tid), tid)}"
        if not host:
            bars, busy, end = [], 0.0, -1.0
            for e in es:
                s, d = e["ts"] / 1e3, e["dur"] / 1e3
                if s + d < lo or s > hi:
                    continue
                label, colour = kind_of(e["name"])
                legend[label] = colour
                bars.append((s, d, colour))
                # Busy time: the union of the spans (kernels on one stream do not overlap).
                busy += max(0.0, s + d - max(s, end))
                end = max(end, s + d)
            lanes.append((f"{name}\nbusy {busy:.1f} of {hi - lo:.1f} ms", bars))
            continue
        rows = []  # per depth: the end of its last range
        placed = []
        for e in es:
            s, d = e["ts"] / 1e3, e["dur"] / 1e3
            depth = next((i for i, r in enumerate(rows) if r <= s), len(rows))
            if depth == len(rows):
                rows.append(0.0)
            rows[depth] = s + d
            placed.append((depth, s, d, e["name"]))
        for depth in range(len(rows)):
            bars = [(s, d, HOST, n) for dd, s, d, n in placed if dd == depth and s + d >= lo and s <= hi]
            lanes.append((f"{name} (NVTX depth {depth})", bars))

    height = 0.6 * len(lanes) + 1.5
    fig, ax = plt.subplots(figsize=(18, height))
    for i, (label, bars) in enumerate(lanes):
        y = len(lanes) - 1 - i
        if bars:
            ax.broken_barh([(b[0], b[1]) for b in bars], (y - 0.4, 0.8), facecolors=[b[2] for b in bars],
                           edgecolors="white", linewidth=0.3)
        for b in bars:  # the host ranges' names, where they fit
            if len(b) == 4 and b[1] > 0.03 * (hi - lo):
                ax.text(max(b[0], lo) + min(b[1], hi - max(b[0], lo)) / 2, y, b[3], ha="center", va="center",
                        fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _ in reversed(lanes)], fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_xlabel("ms from the first recorded event")
    ax.set_title(args.title or args.trace)
    ax.legend(handles=[Patch(color=c, label=l) for l, c in legend.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.08 * 8 / height), ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"{args.png}: {len(lanes)} lanes, {hi - lo:.2f} ms")


if __name__ == "__main__":
    main()
