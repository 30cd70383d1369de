#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention at ViT shapes, per backend: forward, backward, both.

Usage: python3 tools/attention_bench.py [B H T HD ...]   (default: the shapes of ./attention_rate)

bf16 inputs in the layout timm uses (batch, heads, tokens, head dim), no mask, each backend
forced with torch.nn.attention.sdpa_kernel (cuDNN, flash, memory-efficient); CUDA events, median
of 20 after 5 untimed. FLOPs as FlashAttention counts them: forward 4 B H T^2 hd, backward 2.5x.
One line per (shape, backend): RESULT sdpa backend=... shape=B,H,T,HD fwd_ms=.. bwd_ms=.. both_ms=..
"""
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(64, 16, 197, 80), (64, 16, 257, 80), (32, 16, 577, 64), (256, 12, 197, 64), (256, 6, 197, 64)]
BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def median_ms(fn):
    for _ in range(5):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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
