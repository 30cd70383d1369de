#!/usr/bin/env python3
"""The fused attention next to PyTorch's SDPA backends, one table (issue 7's yardstick).

Reads the RESULT lines of ./attention_rate and of tools/attention_bench.py, run in the same call on
the same card (tools/gpu_round.sh attention does both), and prints per shape the engine's forward,
backward and forward + backward times, each backend's, and the engine's forward + backward as a
fraction of each backend's. ./attention_rate's own cuDNN lines (cuDNN's fused attention on the
engine's layout, kernels/cudnn_attention.h, where libcudnn.so.9 loads) are the backend
"cudnn@engine". Usage: tools/attention_table.py RATE_LOG BENCH_LOG
"""
import re
import sys

RESULT = re.compile(r"^RESULT (\S+) (.*)$")


def results(path):
    """(kind, fields) for each RESULT line of the log."""
    with open(path) as f:
        for line in f:
            m = RESULT.match(line.strip())
            if m:
                yield m.group(1), dict(kv.split("=", 1) for kv in m.group(2).split())


def main(argv):
    if len(argv) != 3:
        print("usage: tools/attention_table.py RATE_LOG BENCH_LOG", file=sys.stderr)
        return 2
    ours, theirs = {}, {}
    try:
        for kind, f in results(argv[1]):
            if kind == "attention":  # the default choices' line; the per-kernel lines are other kinds
                ours[f["shape"]] = f
            elif kind == "attention_cudnn":
                theirs.setdefault(f["shape"], {})["cudnn@engine"] = f
        for kind, f in results(argv[2]):
            if kind == "sdpa":
                theirs.setdefault(f["shape"], {})[f["backend"]] = f
    except OSError as e:
        print(f"attention_table: {e}", file=sys.stderr)
        return 1
    if not ours or not theirs:
        print("attention_table: no RESULT lines in " + (argv[1] if not ours else argv[2]), file=sys.stderr)
        return 1
    backends = sorted({b for s in theirs.values() for b in s})
    head = f"{'B,H,T,hd':<16} {'fwd':>7} {'bwd':>7} {'both':>7}"
    for b in backends:
        head += f" {b + ' both':>15} {'ratio':>6}"
    print(head + "   (ms; ratio = engine's forward + backward / the backend's)")
    for shape, f in ours.items():
        row = f"{shape:<16} {float(f['fwd_ms']):7.3f} {float(f['bwd_ms']):7.3f} {float(f['both_ms']):7.3f}"
        for b in backends:
            t = theirs.get(shape, {}).get(b)
            if t:
                row += f" {float(t['both_ms']):15.3f} {float(f['both_ms']) / float(t['both_ms']):6.2f}"
            else:
                row += f" {'-':>15} {'-':>6}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
