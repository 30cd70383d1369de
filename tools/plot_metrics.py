#!/usr/bin/env python3
"""Plot vit_train's --log files: training loss and test accuracy against the step, one line per file.

Usage: python3 tools/plot_metrics.py OUT.png RUN.jsonl [RUN2.jsonl ...]

Each input is a JSON-lines file written by `vit_train --log FILE` (one object per line: progress
lines carry "step" and "loss", evaluations "eval_top1" and "eval_top5"). Needs matplotlib
(Debian: apt-get install python3-matplotlib).
"""
import json
import os
import sys


def read_run(path):
    loss, top1, top5 = [], [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_metrics: {path}:{n}: not a JSON line ({e})")
            if "loss" in row:
                loss.append((row["step"], row["loss"]))
            if "eval_top1" in row:
                top1.append((row["step"], 100 * row["eval_top1"]))
                if "eval_top5" in row:
                    top5.append((row["step"], 100 * row["eval_top5"]))
    return loss, top1, top5


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__.strip())
    out, runs = sys.argv[1], sys.argv[2:]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics: needs matplotlib (Debian: apt-get install python3-matplotlib)")
    data = {}
    for path in runs:
        if not os.path.isfile(path):
            sys.exit(f"plot_metrics: no such file {path}")
        data[path] = read_run(path)
    has_eval = any(top1 for _, top1, _ in data.values())
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(12 if has_eval else 6, 4.5), squeeze=False)
    for path, (loss, top1, top5) in data.items():
        name = os.path.basename(path)
        if loss:
            axes[0][0].plot(*zip(*loss), label=name)
        if has_eval and top1:
            line, = axes[0][1].plot(*zip(*top1), marker="o", label=f"{name} top-1")
            if top5:
                axes[0][1].plot(*zip(*top5), marker=".", linestyle="--", color=line.get_color(), label=f"{name} top-5")
    axes[0][0].set(xlabel="step", ylabel="training loss", title="loss")
    axes[0][0].legend()
    if has_eval:
        axes[0][1].set(xlabel="step", ylabel="test accuracy (%)", title="evaluation")
        axes[0][1].legend()
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)  # never a half-written plot
    print(f"plot_metrics: wrote {out} ({len(runs)} run(s))")


if __name__ == "__main__":
    main()
