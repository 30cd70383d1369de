#!/usr/bin/env python3
"""Reference tier: check the engine against timm on the same weights and batches.

Usage: python3 tools/timm_reference.py DUMP_DIR [--tol-grad X] [--tol-loss X] [--truth-chunk N]

DUMP_DIR is written by the engine:
  config.json          img, patch, channels, classes, dim, depth, heads, mlp_ratio, batch,
                       optimizer (sgd or adamw), lr, momentum, weight_decay, nesterov, betas, eps,
                       drop_path, steps
  init.safetensors     initial weights, F32, timm state_dict names and shapes
  batches.safetensors  "images.{s}" F32 [B,C,H,W] and "labels.{s}" I64 [B], s = 0..steps-1; with
                       stochastic depth (drop_path > 0) "drop_path.{s}" F32 [depth,2,B]: the
                       engine's per-sample scale (0 or 1/keep) of each block's attention and MLP
                       branch, which timm's blocks then apply in place of their own draws
  step0.safetensors    the engine's "logits" [B,classes], "loss" [1] and "grad.{name}" on batch 0
  losses.json          {"losses": [...]}: the engine's loss of each step, taken before its update
  final.safetensors    the engine's weights after the last step

Part 1 (batch 0, no update): the engine's logits, loss and every parameter gradient against the
float64 truth, next to PyTorch's own bf16 autocast run of the same model as the yardstick of what
bf16 rounding costs. A tensor passes if engine_err <= max(3 * autocast_err, tol_grad) and all its
values are finite.
Part 2 (training): `steps` steps of timm under bf16 autocast on the same batches, with the
engine's optimizer (torch.optim.SGD, or AdamW with timm's parameter groups from
timm.optim.create_optimizer_v2); each step's loss must agree with the engine's within a bound
printed with the table. Then the update (final - init) of all weights together against the same
training in fp32 (no autocast): the engine's relative L2 error must stay within max(3 *
autocast's own error, --tol-update), autocast's run being the yardstick of what bf16 rounding
does to the updates. Each tensor's errors are listed too, the worst first; they are not a
criterion: AdamW normalises each gradient, so where a gradient is mostly rounding noise (the
attention's key bias has none at all) its weight moves by about lr either way, and a small
tensor's error swings from seed to seed in autocast's run and the engine's alike.

The last line is `REFERENCE: PASS` (exit 0) or `REFERENCE: FAIL (reasons)` (exit 1).
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer

# How many tensors the summary lists as the worst.
WORST_SHOWN = 5


def log(*args):
    print(*args, flush=True)


def gib(nbytes):
    return nbytes / 2**30


class GivenDropPath(nn.Module):
    """timm's DropPath with the engine's draw: x times its sample's scale (0 or 1/keep), the scale
    in x's dtype as timm's random tensor is (bf16 under autocast)."""

    def __init__(self):
        super().__init__()
        self.scale = None  # [B] for the next forward

    def forward(self, x):
        return x * self.scale.to(x.dtype).view(-1, *([1] * (x.dim() - 1)))


def build_model(cfg, state):
    """timm's ViT for cfg on the GPU in fp32, holding `state`; with stochastic depth, its blocks'
    DropPath modules replaced by GivenDropPath (set_masks gives them the engine's draw).

    load_state_dict(strict=True) raises RuntimeError on a missing, unexpected or misshapen tensor.
    """
    rate = cfg.get("drop_path", 0.0)
    with torch.device("cuda"):  # initialise on the GPU: fast even for ViT-H, and overwritten anyway
        model = VisionTransformer(
            img_size=cfg["img"], patch_size=cfg["patch"], in_chans=cfg["channels"],
            num_classes=cfg["classes"], embed_dim=cfg["dim"], depth=cfg["depth"],
            num_heads=cfg["heads"], mlp_ratio=cfg["mlp_ratio"], drop_path_rate=rate)
    model.load_state_dict(state, strict=True)
    if rate > 0:
        for block in model.blocks:
            # A timm whose blocks name them otherwise would keep drawing its own masks.
            if not (hasattr(block, "drop_path1") and hasattr(block, "drop_path2")):
                raise RuntimeError("this timm's Block has no drop_path1/drop_path2 to give the engine's masks to")
            block.drop_path1, block.drop_path2 = GivenDropPath(), GivenDropPath()
    return model.train()  # dropout rates are 0; stochastic depth draws nothing of its own


def set_masks(model, batches, step, start=0, end=None):
    """The engine's drop-path scales of `step` for samples [start, end) (a no-op without)."""
    masks = batches.get(f"drop_path.{step}")
    if masks is None:
        return
    masks = masks.cuda()
    for l, block in enumerate(model.blocks):
        block.drop_path1.scale = masks[l, 0, start:end]
        block.drop_path2.scale = masks[l, 1, start:end]


def autocast_step(model, images, labels):
    """PyTorch's bf16 autocast forward and backward on the fp32 model: logits, loss, gradients."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(images)
        loss = F.cross_entropy(logits, labels)  # autocast runs the loss in fp32
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)  # the model lets go; `grads` keeps them
    return logits.detach().float(), loss.detach(), grads


def truth_step(model, images, labels, chunk, batches):
    """The float64 forward and backward, `chunk` images at a time to bound activation memory.

    Converts `model` to float64 in place. Images are independent in a ViT, so only the loss couples
    the chunks: it is the mean over all B images, so each chunk contributes its summed loss / B and
    backward() accumulates the exact full-batch gradient.
    """
    model.double()
    batch = images.shape[0]
    logits, loss = [], torch.zeros((), dtype=torch.float64, device="cuda")
    for start in range(0, batch, chunk):
        x = images[start:start + chunk].double()
        y = labels[start:start + chunk]
        set_masks(model, batches, 0, start, start + chunk)
        out = model(x)
        chunk_loss = F.cross_entropy(out, y, reduction="sum") / batch
        chunk_loss.backward()
        logits.append(out.detach())
        loss += chunk_loss.detach()
        log(f"  float64 truth: images {start}..{start + x.shape[0] - 1} of {batch} done, "
            f"peak GPU memory {gib(torch.cuda.max_memory_allocated()):.1f} GiB")
    grads = {name: p.grad.detach() for name, p in model.named_parameters()}
    return torch.cat(logits), loss, grads


def rel_err(x, truth):
    """||x - truth|| / ||truth||, in float64; the absolute error where the truth is all zeros."""
    tnorm = truth.norm().item()
    return (x - truth).norm().item() / (tnorm if tnorm > 0 else 1.0)


def cosine(x, truth):
    xn, tn = x.norm().item(), truth.norm().item()
    if xn == 0 or tn == 0:
        return 1.0 if xn == tn else 0.0
    return (x * truth).sum().item() / (xn * tn)


def compare(name, engine, autocast, truth, tol):
    """One table row: the engine's and autocast's errors against the float64 truth.

    `engine` is None when the dump lacks the tensor. A row fails on a missing tensor, a shape
    mismatch, a non-finite value, or engine_err > limit = max(3 * autocast_err, tol).
    """
    nan = float("nan")
    autocast_err = rel_err(autocast.to(torch.float64), truth)
    row = {"name": name, "shape": list(truth.shape), "engine_err": nan,
           "autocast_err": autocast_err, "limit": max(3 * autocast_err, tol),
           "cos": nan, "status": "ok"}
    if engine is None:
        row["status"] = "FAIL missing from step0.safetensors"
    elif tuple(engine.shape) != tuple(truth.shape):
        row["status"] = f"FAIL shape {list(engine.shape)}"
    else:
        e = engine.to("cuda", torch.float64)
        row["engine_err"] = rel_err(e, truth)
        row["cos"] = cosine(e, truth)
        if not bool(torch.isfinite(e).all()):
            row["status"] = "FAIL non-finite"
        elif not row["engine_err"] <= row["limit"]:
            row["status"] = "FAIL"
    return row


def format_row(row):
    return (f"{row['name']:<30} {str(row['shape']):<20} {row['engine_err']:>11.3e} "
            f"{row['autocast_err']:>12.3e} {row['limit']:>10.3e} {row['cos']:>12.8f}  "
            f"{row['status']}")


def check_step0(model, batches, step0, tol, chunk):
    """Part 1 on `model` (fp32, holding the initial weights; left in float64).

    Returns the list of failure reasons (empty on success).
    """
    images = batches["images.0"].cuda()
    labels = batches["labels.0"].cuda().long()

    log("step 0: bf16 autocast forward/backward (fp32 parameters)")
    set_masks(model, batches, 0)
    auto_logits, auto_loss, auto_grads = autocast_step(model, images, labels)
    log(f"  done, peak GPU memory {gib(torch.cuda.max_memory_allocated()):.1f} GiB")
    torch.cuda.empty_cache()

    log(f"step 0: float64 truth forward/backward in chunks of {chunk} images")
    truth_logits, truth_loss, truth_grads = truth_step(model, images, labels, chunk, batches)

    rows = [compare("logits", step0.get("logits"), auto_logits, truth_logits, tol),
            compare("loss", step0["loss"].reshape(-1) if "loss" in step0 else None,
                    auto_loss.reshape(-1), truth_loss.reshape(-1), tol)]
    for name in truth_grads:  # named_parameters order, which is the state_dict order
        rows.append(compare(name, step0.get(f"grad.{name}"), auto_grads[name],
                            truth_grads[name], tol))
    log("")
    log("rel err = ||x - truth|| / ||truth|| against float64; limit = max(3 * autocast_err, "
        f"{tol:g}); cos = cosine(engine, truth)")
    log(f"{'tensor':<30} {'shape':<20} {'engine_err':>11} {'autocast_err':>12} {'limit':>10} "
        f"{'cos':>12}  status")
    for row in rows:
        log(format_row(row))

    failing = [r for r in rows if r["status"] != "ok"]
    # Closeness to the limit; NaN (missing, misshapen, non-finite) sorts as the worst.
    def badness(r):
        ratio = r["engine_err"] / r["limit"] if r["limit"] > 0 else math.inf
        return math.inf if math.isnan(ratio) else ratio
    log("")
    log(f"step 0 summary: {len(rows)} tensors, {len(failing)} failing; "
        "worst by engine_err / limit:")
    for row in sorted(rows, key=badness, reverse=True)[:WORST_SHOWN]:
        log(f"  {row['name']:<30} engine_err {row['engine_err']:.3e}  limit {row['limit']:.3e}  "
            f"ratio {badness(row):.3f}  {row['status']}")

    reasons = []
    if failing:
        reasons.append(f"{len(failing)} of {len(rows)} step-0 tensors out of bounds "
                       f"(first: {failing[0]['name']})")
    params = set(truth_grads)
    unknown = sorted(k for k in step0 if k.startswith("grad.") and k[len("grad."):] not in params)
    if unknown:
        log(f"step0.safetensors has gradients of no timm parameter: {unknown}")
        reasons.append(f"{len(unknown)} unknown gradients in step0.safetensors")
    return reasons


def make_optimizer(cfg, model):
    """The engine's optimizer: torch.optim.SGD, or timm's AdamW (no decay on 1-D tensors,
    pos_embed and cls_token)."""
    if cfg.get("optimizer", "sgd") == "adamw":
        from timm.optim import create_optimizer_v2
        return create_optimizer_v2(model, "adamw", lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                                   betas=tuple(cfg["betas"]), eps=cfg["eps"])
    return torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                           weight_decay=cfg["weight_decay"], nesterov=bool(cfg["nesterov"]))


def timm_training(cfg, init, batches, steps, autocast=True):
    """Part 2: timm trained (under bf16 autocast, or in fp32); each step's loss taken before its
    update. Returns the losses and the weights after the last step."""
    model = build_model(cfg, init)
    opt = make_optimizer(cfg, model)
    losses = []
    for s in range(steps):
        images = batches[f"images.{s}"].cuda()
        labels = batches[f"labels.{s}"].cuda().long()
        set_masks(model, batches, s)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if autocast:
            log(f"  timm step {s}: loss {losses[-1]:.6f}")
    final = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    del model, opt
    torch.cuda.empty_cache()
    return losses, final


def update_error(init, final, truth):
    """The relative L2 error of the update (final - init) against truth's."""
    want = truth.double() - init.double()
    got = final.double() - init.double()
    denom = want.norm().item()
    err = (got - want).norm().item() / denom if denom > 0 else (got - want).norm().item()
    return err if math.isfinite(err) else float("inf")


def check_updates(init, engine_final, autocast_final, truth_final, tol_update):
    """The update of all weights against fp32 training's: the engine's relative L2 error within
    max(3 * autocast's, tol_update). Each tensor's, the worst by engine / autocast, listed."""
    missing = [name for name in truth_final if name not in engine_final]
    if missing:
        return [f"final.safetensors lacks {len(missing)} tensors, e.g. {missing[0]}"]
    rows = []
    sums = [0.0, 0.0, 0.0]  # |engine - truth|^2, |autocast - truth|^2, |truth update|^2
    for name, truth in truth_final.items():
        want = truth.double() - init[name].double()
        e_diff = (engine_final[name].double() - truth.double()).norm().item() ** 2
        a_diff = (autocast_final[name].double() - truth.double()).norm().item() ** 2
        sums[0] += e_diff
        sums[1] += a_diff
        sums[2] += want.norm().item() ** 2
        e = update_error(init[name], engine_final[name], truth)
        a = update_error(init[name], autocast_final[name], truth)
        rows.append((e / max(a, 1e-12), name, e, a))
    rows.sort(key=lambda r: -r[0])
    log(f"updates (final - init) against fp32 training's, relative L2 error; {WORST_SHOWN} of {len(rows)} "
        "tensors, the worst by engine / autocast first:")
    log(f"  {'tensor':<40} {'engine':>10} {'autocast':>10}")
    for _, name, e, a in rows[:WORST_SHOWN]:
        log(f"  {name:<40} {e:>10.3e} {a:>10.3e}")
    total = math.sqrt(sums[2])
    engine = math.sqrt(sums[0]) / total if total > 0 else float("inf")
    autocast = math.sqrt(sums[1]) / total if total > 0 else float("inf")
    limit = max(3 * autocast, tol_update)
    ok = engine <= limit  # False for NaN
    log(f"all weights' update: engine {engine:.3e}, autocast {autocast:.3e}, limit {limit:.3e}  "
        f"{'ok' if ok else 'FAIL'}")
    return [] if ok else [f"the weights' update differs from fp32 training's by {engine:.3e} (limit {limit:.3e})"]


def check_training(cfg, init, batches, engine_losses, engine_loss0, engine_final, tol_loss, tol_update):
    """Part 2. Returns the list of failure reasons (empty on success).

    The bound: both runs start from the same weights and see the same batches, and differ only by
    bf16 rounding (operand rounding, accumulation order, kernel choice). bf16 keeps 8 significant
    bits (epsilon 2^-8 = 3.9e-3), so tol_loss = 0.02 allows about five bf16 epsilons of relative
    difference: margin for rounding correlated across 2 * depth residual branches and for the small
    drift that rounding-level gradient differences cause over a few steps at these learning rates,
    while an error as large as the loss's own movement over the run still shows (a note is printed
    when the loss moves less than the bound). The 1e-3 floor covers losses near zero.
    """
    steps = cfg["steps"]
    reasons = []
    if len(engine_losses) != steps:
        reasons.append(f"losses.json has {len(engine_losses)} losses, config.json says {steps} steps")
    steps = min(steps, len(engine_losses))

    if cfg.get("optimizer", "sgd") == "adamw":
        log(f"training: {steps} AdamW steps of timm under bf16 autocast (lr {cfg['lr']}, betas "
            f"{cfg['betas']}, eps {cfg['eps']}, weight_decay {cfg['weight_decay']}, timm's groups)")
    else:
        log(f"training: {steps} SGD steps of timm under bf16 autocast (lr {cfg['lr']}, momentum "
            f"{cfg['momentum']}, weight_decay {cfg['weight_decay']}, nesterov {bool(cfg['nesterov'])})")
    ref, timm_final = timm_training(cfg, init, batches, steps)

    def bound(loss):
        return tol_loss * max(1.0, abs(loss)) + 1e-3

    log("")
    log(f"bound per step: |engine - timm| <= {tol_loss:g} * max(1, |timm loss|) + 1e-3")
    log(f"{'step':>4} {'engine loss':>12} {'timm autocast':>14} {'abs diff':>10} {'bound':>10}  status")
    bad_steps = []
    for s in range(steps):
        diff = abs(engine_losses[s] - ref[s])
        ok = diff <= bound(ref[s])  # False for NaN
        if not ok:
            bad_steps.append(s)
        log(f"{s:>4} {engine_losses[s]:>12.6f} {ref[s]:>14.6f} {diff:>10.3e} "
            f"{bound(ref[s]):>10.3e}  {'ok' if ok else 'FAIL'}")
    if bad_steps:
        reasons.append(f"loss differs from timm's at steps {bad_steps}")

    # The engine's training loop and its step-0 dump see the same weights and batch.
    if steps > 0:
        diff0 = abs(engine_losses[0] - engine_loss0)
        ok0 = diff0 <= bound(engine_loss0)
        log(f"engine consistency: losses.json step 0 {engine_losses[0]:.6f} vs step0.safetensors "
            f"loss {engine_loss0:.6f}: diff {diff0:.3e}  {'ok' if ok0 else 'FAIL'}")
        if not ok0:
            reasons.append("losses.json step 0 disagrees with step0.safetensors loss")

    # A check whose bound exceeds the loss's own movement cannot tell a wrong update from rounding.
    if steps > 1:
        moved = max(abs(loss - ref[0]) for loss in ref)
        if moved <= bound(ref[0]):
            log(f"note: timm's loss moved by at most {moved:.3e} over the run, within the bound: "
                "this check cannot detect an error in the update; use more steps or a larger lr")
    if engine_final is not None and steps == cfg["steps"]:
        log(f"training: the same {steps} steps in fp32 (no autocast), the updates' truth")
        _, truth_final = timm_training(cfg, init, batches, steps, autocast=False)
        reasons += check_updates(init, engine_final, timm_final, truth_final, tol_update)
    return reasons


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump_dir", help="directory written by the engine")
    parser.add_argument("--tol-grad", type=float, default=2e-2,
                        help="floor of the relative-error limit of every tensor (default 2e-2)")
    parser.add_argument("--tol-loss", type=float, default=2e-2,
                        help="relative bound on the per-step loss difference (default 2e-2)")
    parser.add_argument("--tol-update", type=float, default=2e-2,
                        help="floor of the limit on the relative L2 error of all weights' update (default 2e-2)")
    parser.add_argument("--truth-chunk", type=int, default=16,
                        help="images per float64 forward/backward (default 16; ~30 GiB for ViT-H)")
    args = parser.parse_args()

    # fp32 matmuls and convolutions outside autocast stay true fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def path(name):
        return os.path.join(args.dump_dir, name)

    with open(path("config.json")) as f:
        cfg = json.load(f)
    with open(path("losses.json")) as f:
        # null (an engine's way to write a non-finite loss) becomes NaN and fails its step
        engine_losses = [float("nan") if v is None else float(v) for v in json.load(f)["losses"]]
    init = load_file(path("init.safetensors"))
    batches = load_file(path("batches.safetensors"))
    step0 = load_file(path("step0.safetensors"))
    engine_final = load_file(path("final.safetensors")) if os.path.exists(path("final.safetensors")) else None
    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")
    log(f"config: {json.dumps(cfg)}")
    log(f"init: {len(init)} tensors, {sum(t.numel() for t in init.values()):,} values")

    reasons = []
    not_f32 = [name for name, t in init.items() if t.dtype != torch.float32]
    if not_f32:
        log(f"init.safetensors tensors not F32: {not_f32}")
        reasons.append(f"{len(not_f32)} init tensors not F32")

    # Strict loading into timm is the first check: names, shapes and completeness.
    try:
        model = build_model(cfg, init)
    except RuntimeError as exc:
        log(f"init.safetensors does not load into timm with strict=True:\n{exc}")
        log("REFERENCE: FAIL (init.safetensors does not load into timm with strict=True)")
        return 1
    log("init.safetensors loads into timm with strict=True")

    reasons += check_step0(model, batches, step0, args.tol_grad, args.truth_chunk)
    del model  # the float64 copy; training starts again from init.safetensors
    torch.cuda.empty_cache()
    log("")
    engine_loss0 = step0["loss"].item() if "loss" in step0 else float("nan")
    reasons += check_training(cfg, init, batches, engine_losses, engine_loss0, engine_final, args.tol_loss,
                              args.tol_update)
    log(f"peak GPU memory {gib(torch.cuda.max_memory_allocated()):.1f} GiB")

    if reasons:
        log(f"REFERENCE: FAIL ({'; '.join(reasons)})")
        return 1
    log("REFERENCE: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
