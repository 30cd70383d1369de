#!/usr/bin/env python3
"""Fine-tuning's loading against timm's: a timm model saved at one image size with 1,000 classes
(and one saved headless, num_classes=0), loaded by the engine at another size with another
class count (--init-from FILE --reset-head), must hold the position embedding timm's own loading
makes of it (timm.models.vision_transformer.checkpoint_filter_fn: resample_abs_pos_embed,
bicubic, antialiased), and the engine's logits on that model must be timm's (the reference
tier's step-0 check, tools/timm_reference.py, on the engine's dump).

Usage: python3 tools/finetune_check.py [--model small|vit_h16] [--tol X]
Runs ./vit_train (built beforehand). The last line is `FINETUNE: PASS` (exit 0) or
`FINETUNE: FAIL (reasons)` (exit 1).
"""
import argparse
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

SHAPES = {  # saved at img_from, loaded at img_to (small_down: a finer grid resampled to a coarser,
           # where the antialiasing filter widens)
    "small": dict(patch=8, dim=64, depth=2, heads=4, img_from=32, img_to=48, batch=8),
    "small_down": dict(patch=8, dim=64, depth=2, heads=4, img_from=56, img_to=32, batch=8),
    "vit_h16": dict(patch=16, dim=1280, depth=32, heads=16, img_from=224, img_to=384, batch=8),
}


def log(*args):
    print(*args, flush=True)


def timm_model(s, img, classes):
    return VisionTransformer(img_size=img, patch_size=s["patch"], num_classes=classes, embed_dim=s["dim"],
                             depth=s["depth"], num_heads=s["heads"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    parser.add_argument("--tol", type=float, default=1e-5,
                        help="relative error allowed between the two resampled position embeddings")
    args = parser.parse_args()
    s = SHAPES[args.model]
    work = f"/tmp/finetune_{args.model}"
    os.makedirs(work, exist_ok=True)
    reasons = []
    torch.manual_seed(0)
    for variant, saved_classes in (("head", 1000), ("headless", 0)):
        src = os.path.join(work, f"{variant}.safetensors")
        saved = timm_model(s, s["img_from"], saved_classes)
        save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, src)
        dump = os.path.join(work, f"dump_{variant}")
        subprocess.run(["rm", "-rf", dump], check=True)
        cmd = ["./vit_train", "--img", str(s["img_to"]), "--patch", str(s["patch"]), "--channels", "3",
               "--classes", "10", "--dim", str(s["dim"]), "--depth", str(s["depth"]), "--heads", str(s["heads"]),
               "--batch", str(s["batch"]), "--steps", "1", "--init-from", src, "--reset-head",
               "--dump-reference", dump]
        log("$ " + " ".join(cmd))
        run = subprocess.run(cmd, capture_output=True, text=True)
        log(run.stderr.strip())
        if run.returncode != 0:
            log(run.stdout[-2000:])
            reasons.append(f"{variant}: vit_train exit {run.returncode}")
            continue
        engine = load_file(os.path.join(dump, "init.safetensors"))
        # timm's own loading of the saved state into the new model (the head left out: the
        # engine's new head is random, so the comparison takes the engine's).
        target = timm_model(s, s["img_to"], 10)
        state = {k: v for k, v in load_file(src).items() if not k.startswith("head.")}
        adapted = checkpoint_filter_fn(state, target)
        want, got = adapted["pos_embed"].double(), engine["pos_embed"].double()
        err = ((got - want).norm() / want.norm()).item() if got.shape == want.shape else float("inf")
        log(f"{variant}: pos_embed {tuple(got.shape)} against timm's {tuple(want.shape)}: relative error {err:.3e}")
        if not err <= args.tol:
            reasons.append(f"{variant}: pos_embed differs from timm's ({err:.3e})")
        others = [k for k in adapted if k != "pos_embed" and not torch.equal(adapted[k], engine[k])]
        if others:
            reasons.append(f"{variant}: {len(others)} tensors differ from the saved ones, e.g. {others[0]}")
        ref = subprocess.run([sys.executable, "tools/timm_reference.py", dump], capture_output=True, text=True)
        last = ref.stdout.strip().splitlines()[-1] if ref.stdout.strip() else ""
        log(f"{variant}: tools/timm_reference.py: {last}")
        if ref.returncode != 0:
            log(ref.stdout[-3000:])
            reasons.append(f"{variant}: the reference tier fails on the fine-tuned model")
    if reasons:
        log(f"FINETUNE: FAIL ({'; '.join(reasons)})")
        return 1
    log("FINETUNE: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
