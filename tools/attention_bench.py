#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention at ViT shapes, per backend: forward, backward, both.

Usage: python3 tools/attention_bench.py [B H T HD ...]   (default: the shapes of ./attention_rate)

bf16 inputs in the layout timm uses (batch, heads, tokens, head dim), no mask, each backend
forced with torch.nn.attention.sdpa_kernel (cuDNN, flash, memory-efficient); CUDA events, median
of 20 after 5 untimed, each timed call behind a lead (torch.cuda._sleep) that keeps the GPU busy
while Python enqueues it, so that the events time the GPU's work and not the interpreter's and
autograd's launch latency (tools/event_timing.h leads ./attention_rate's the same way). FLOPs as
FlashAttention counts them: forward 4 B H T^2 hd, backward 2.5x.
One line per (shape, backend): RESULT sdpa backend=... shape=B,H,T,HD fwd_ms=.. bwd_ms=.. both_ms=..
"""
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(64, 16, 197, 80), (64, 16, 257, 80), (32, 16, 577, 64), (256, 12, 197, 64), (256, 6, 197, 64)]
BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


LEAD_CYCLES = 4_000_000  # ~2 ms of the GPU's clock; Python took up to 0.9 ms to enqueue SDPA and its backward


def median_ms(fn):
    for _ in range(5):
        fn()
    times, enqueue_s = [], []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(LEAD_CYCLES)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        enqueue_s.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    enqueue_ms = 1e3 * max(enqueue_s)
    if enqueue_ms > 0.8 * lead_ms():
        print(f"warning: enqueueing a call took up to {enqueue_ms:.3f} ms against a lead of {lead_ms():.3f} ms: "
              "these times may include launch latency", flush=True)
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def lead_ms():
    """The lead's own duration on this GPU (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(LEAD_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main():
    args = [int(a) for a in sys.argv[1:]]
    if len(args) % 4:
        sys.exit(__doc__.strip())
    shapes = [tuple(args[i:i + 4]) for i in range(0, len(args), 4)] or SHAPES
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'B H T hd':22s} {'backend':10s} {'fwd ms':>9s} {'bwd ms':>9s} {'both ms':>9s} {'both TFLOP/s':>13s}")
    for b, h, t, d in shapes:
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
        flop = 4.0 * b * h * t * t * d
        for name, backend in BACKENDS:
            try:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v)
                    fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v))
                    bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
                    both = median_ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad))
            except RuntimeError as e:
                print(f"{f'{b} {h} {t} {d}':22s} {name:10s} not available ({str(e).splitlines()[0][:60]})")
                continue
            print(f"{f'{b} {h} {t} {d}':22s} {name:10s} {fwd:9.3f} {bwd:9.3f} {both:9.3f} {3.5 * flop / (both * 1e-3) / 1e12:13.1f}")
            print(f"RESULT sdpa backend={name} shape={b},{h},{t},{d} fwd_ms={fwd:.4f} bwd_ms={bwd:.4f} both_ms={both:.4f}")


if __name__ == "__main__":
    main()
