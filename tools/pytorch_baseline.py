#!/usr/bin/env python3
"""PyTorch baseline for the benchmarks: timm's ViT trained with bf16 autocast and SGD.

Usage: python3 tools/pytorch_baseline.py [--dim 1280 --depth 32 --heads 16 --img 224 --patch 16
           --classes 1000 --batch 64 --warmup 5 --steps 20] [--compile]
       python3 -m torch.distributed.run --nproc_per_node N tools/pytorch_baseline.py [...]
           (DistributedDataParallel over NCCL, --batch per GPU, PyTorch's default 25 MB buckets)

The training step of docs/MODEL.md's baseline, with the batch already on the GPU, so that only
the step is timed: zero_grad(set_to_none=True); forward and loss under bf16 autocast; backward; step.
Each step is timed with CUDA events; the first --warmup steps are run but not counted, then --steps
steps are. Prints a table and, last, one line:
RESULT pytorch_eager|pytorch_compile|pytorch_ddp step_ms=.. mean_ms=.. img_s=.. tflops=.. peak_alloc_gib=..
peak_reserved_gib=..
"""
import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
from timm.models.vision_transformer import VisionTransformer

CHANNELS = 3    # timm's default in_chans
MLP_RATIO = 4   # timm's default mlp_ratio


def train_flops_per_image(img, patch, channels, dim, depth, hidden, classes):
    """Model FLOPs of one training step per image: 3x the forward's matmul FLOPs.

    Per block and token: qkv 2*D*3D, proj 2*D*D, fc1 + fc2 2*2*D*H, and attention 4*T*D (q k^T and
    attn v, each 2*T*D per token); plus the patch embedding 2*P*(C*p*p)*D and the head 2*D*classes
    (class token only). ViT-H/16 at 224 px: about 763.9e9.
    """
    patches = (img // patch) ** 2
    tokens = patches + 1
    per_block_token = 2 * dim * 3 * dim + 2 * dim * dim + 2 * 2 * dim * hidden + 4 * tokens * dim
    forward = (per_block_token * tokens * depth
               + 2 * patches * channels * patch * patch * dim
               + 2 * dim * classes)
    return 3 * forward


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--img", type=int, default=224)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    parser.add_argument("--compile", action="store_true", help="run the model under torch.compile")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("need --steps >= 1 and --warmup >= 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # under torchrun: one process per GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    name = "pytorch_ddp" if world > 1 else "pytorch_compile" if args.compile else "pytorch_eager"

    # Built directly on the GPU: the same model as VisionTransformer(...).cuda(), without the
    # slow CPU initialisation of ViT-H.
    with torch.device("cuda"):
        model = VisionTransformer(img_size=args.img, patch_size=args.patch,
                                  num_classes=args.classes, embed_dim=args.dim,
                                  depth=args.depth, num_heads=args.heads)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    forward = torch.compile(model) if args.compile else model
    n_params = sum(p.numel() for p in model.parameters())
    flops = train_flops_per_image(args.img, args.patch, CHANNELS, args.dim, args.depth,
                                  MLP_RATIO * args.dim, args.classes)

    torch.manual_seed(rank)  # each rank its own batch
    images = torch.randn(args.batch, CHANNELS, args.img, args.img, device="cuda")
    labels = torch.arange(args.batch, device="cuda") % args.classes

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{name}: torch {torch.__version__}, {torch.cuda.get_device_name()}"
        f"{f', {world} GPUs' if world > 1 else ''}", flush=True)
    say(f"ViT dim {args.dim} depth {args.depth} heads {args.heads} img {args.img} "
        f"patch {args.patch} classes {args.classes}: {n_params:,} parameters, "
        f"{flops / 1e9:.1f} GFLOP per image per training step", flush=True)
    say(f"batch {args.batch}{' per GPU' if world > 1 else ''}: {args.warmup} warm-up steps"
        f"{' (including compilation)' if args.compile else ''}, then {args.steps} timed",
        flush=True)

    total = args.warmup + args.steps
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    torch.cuda.reset_peak_memory_stats()
    for i in range(total):
        starts[i].record()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(forward(images), labels)
        loss.backward()
        optimizer.step()
        ends[i].record()
    torch.cuda.synchronize()

    times = [s.elapsed_time(e) for s, e in zip(starts, ends)][args.warmup:]
    median_ms = statistics.median(times)
    mean_ms = statistics.mean(times)
    img_s = world * args.batch / (median_ms / 1e3)
    tflops = flops * img_s / world / 1e12  # per GPU
    peak_alloc = torch.cuda.max_memory_allocated() / 2**30
    peak_reserved = torch.cuda.max_memory_reserved() / 2**30

    say(f"  step ms     median {median_ms:.2f}  mean {mean_ms:.2f}  "
        f"min {min(times):.2f}  max {max(times):.2f}")
    say(f"  images/s    {img_s:.1f}")
    say(f"  TFLOP/s     {tflops:.1f}  (model FLOPs at the median step time{', per GPU' if world > 1 else ''})")
    say(f"  peak memory {peak_alloc:.2f} GiB allocated, {peak_reserved:.2f} GiB reserved")
    say(f"  last loss   {loss.item():.4f}")
    say(f"RESULT {name} step_ms={median_ms:.2f} mean_ms={mean_ms:.2f} img_s={img_s:.1f} "
        f"tflops={tflops:.1f} peak_alloc_gib={peak_alloc:.2f} "
        f"peak_reserved_gib={peak_reserved:.2f}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
