#!/usr/bin/env bash
# The whole GPU round in one call on the device machine (binaries built beforehand):
#   1. the GPU test tier (./vit_tests)
#   2. the reference tier on a small config: engine vs timm (tools/timm_reference.py), SGD and AdamW
#   3. the speed round: engine vs PyTorch eager on ViT-H, batch 64 (tools/bench.sh; COMPILE=1 in
#      the environment: also PyTorch under torch.compile), then the engine's per-phase breakdown
#      (--timing)
#   4. the reference tier on ViT-H itself
# and, on request, fashion (the Fashion-MNIST recipe of the FP8 issue, once per entry of
# $FASHION_RUNS, PRECISION:SEED with PRECISION bf16, fp8 or fp8-current, default "bf16:0 fp8:0";
# the IDX files from $FASHION_MNIST, default /usr/share/datasets/fashion-mnist), fp8_stats (ViT-H
# in fp8 with --fp8-stats), timing_heuristic (the breakdown with cuBLASLt's heuristic GEMM choices) and
# ncu (Nsight Compute's speed-of-light of each non-GEMM kernel and each GEMM of one block), and
# ref_ckpt (a checkpoint loaded by timm strictly, and through --init-from checked against timm),
# ref_timm_init (weights timm initialised, through --init-from, against timm), attention (the
# fused attention next to PyTorch's cuDNN and flash backends), packed
# (Fashion-MNIST through the packed data path end to end, and the loader's images/s).
# Every part runs even if an earlier one fails; logs go to $OUT (default /tmp/gpu_round).
# ref_h_adamw is the reference tier on ViT-H with AdamW; finetune and finetune_h check --init-from
# with --reset-head and another image size against timm's own loading (tools/finetune_check.py);
# ref_small_droppath and ref_h_droppath run the reference tier under stochastic depth (timm applies
# the engine's masks); accum times ViT-H with --accum-steps 4 against the same batch without (64,
# and 16), two rounds alternated; fashion_adamw is the AdamW recipe on Fashion-MNIST (issue 32's real run) in
# each precision of $FASHION_PRECISIONS (default "bf16 fp8"), its checkpoint then evaluated alone;
# trace records three ViT-H steps in each precision with --trace and draws them
# (tools/trace_timeline.py): $OUT/trace_{bf16,fp8}.json and .png, the whole window and one step;
# batches runs tools/bench.sh at each batch of $BATCHES (default "32 128 256"; 15 steps after 5);
# overlap runs ./overlap_rate (a step as two concurrent halves of the batch) in both precisions.
# Usage: tools/gpu_round.sh [parts...]   (default: tests ref_small ref_small_adamw bench timing ref_h)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_round}
mkdir -p "$OUT"
parts=${*:-tests ref_small ref_small_adamw bench timing ref_h}
status=0
run() {  # run NAME COMMAND...: tee the output into $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}
SMALL="--img 32 --patch 8 --channels 3 --classes 10 --dim 64 --depth 2 --heads 4 --batch 8"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
for part in $parts; do
  case $part in
    tests) run tests ./vit_tests ;;
    ref_small)
      rm -rf /tmp/ref_small
      run ref_small_dump ./vit_train $SMALL --lr 0.05 --steps 10 --dump-reference /tmp/ref_small
      run ref_small python3 tools/timm_reference.py /tmp/ref_small ;;
    ref_small_adamw)
      rm -rf /tmp/ref_small_adamw
      run ref_small_adamw_dump ./vit_train $SMALL --optimizer adamw --lr 0.001 --weight-decay 0.05 --steps 10 \
        --dump-reference /tmp/ref_small_adamw
      run ref_small_adamw python3 tools/timm_reference.py /tmp/ref_small_adamw ;;
    bench) OUT=$OUT run bench tools/bench.sh
      run gemm_rate ./gemm_rate ;;
    timing) run timing ./vit_train --steps 15 --warmup 5 --timing
      run timing_fp8 ./vit_train --precision fp8 --steps 15 --warmup 5 --timing ;;
    fashion)
      for entry in ${FASHION_RUNS:-bf16:0 fp8:0}; do
        prec=${entry%%:*} seed=${entry##*:}
        case $prec in
          bf16) flags="--precision bf16" ;;
          fp8) flags="--precision fp8" ;;
          fp8-current) flags="--precision fp8 --fp8-recipe current" ;;
          *) echo "unknown FASHION_RUNS precision $prec"; status=1; continue ;;
        esac
        run "fashion_${prec}_seed$seed" ./vit_train --data "fashion-mnist:${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}" \
          --img 28 --patch 4 --channels 1 --classes 10 --dim 192 --depth 6 --heads 3 --batch 128 --epochs 10 \
          --lr 0.1 --momentum 0.9 --lr-schedule cosine --warmup-steps 468 --log-every 468 $flags --seed "$seed"
      done ;;
    fp8_stats) run fp8_stats ./vit_train --precision fp8 --steps 20 --warmup 5 --log-every 10 --fp8-stats ;;
    timing_heuristic) run timing_heuristic ./vit_train --steps 15 --warmup 5 --timing --no-gemm-autotune ;;
    ncu)  # ViT-H shapes at depth 2: every kernel kind once, GEMMs with the heuristic's choice
      run ncu ncu --clock-control none --section SpeedOfLight --launch-count 40 \
        -k regex:'layernorm|gelu|attention|sgd|sum_rows|gemm|sm90|cutlass|xmma' \
        ./vit_train --depth 2 --steps 1 --warmup 0 --no-gemm-autotune ;;
    ref_ckpt)  # a checkpoint loads into timm (strict) and, through --init-from, gives timm's logits
      rm -rf /tmp/ckpt /tmp/ref_ckpt
      run ckpt_save ./vit_train $SMALL --lr 0.05 --steps 10 --save /tmp/ckpt
      run ckpt_timm_load python3 -c "
import timm, torch
from safetensors.torch import load_file
m = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, in_chans=3, num_classes=10,
    embed_dim=64, depth=2, num_heads=4)
m.load_state_dict(load_file('/tmp/ckpt/step-00000010/model.safetensors'), strict=True)
print('timm loaded the checkpoint strictly:', sum(p.numel() for p in m.parameters()), 'parameters')"
      run ref_ckpt_dump ./vit_train $SMALL --lr 0.05 --steps 10 --init-from /tmp/ckpt/step-00000010/model.safetensors \
        --dump-reference /tmp/ref_ckpt
      run ref_ckpt python3 tools/timm_reference.py /tmp/ref_ckpt ;;
    attention)  # the fused attention alone next to PyTorch's SDPA backends (issue 7's yardstick)
      run attention_rate ./attention_rate
      run attention_bench python3 tools/attention_bench.py
      run attention_table python3 tools/attention_table.py "$OUT/attention_rate.log" "$OUT/attention_bench.log" ;;
    ref_timm_init)  # a model timm itself initialised and saved, loaded with --init-from: timm's logits
      rm -rf /tmp/timm_init /tmp/ref_timm_init
      mkdir -p /tmp/timm_init
      run timm_init_save python3 -c "
import timm, torch
from safetensors.torch import save_file
torch.manual_seed(0)
m = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, in_chans=3, num_classes=10,
    embed_dim=64, depth=2, num_heads=4)
save_file({k: v.contiguous() for k, v in m.state_dict().items()}, '/tmp/timm_init/model.safetensors')"
      run ref_timm_init_dump ./vit_train $SMALL --lr 0.05 --steps 10 --init-from /tmp/timm_init/model.safetensors \
        --dump-reference /tmp/ref_timm_init
      run ref_timm_init python3 tools/timm_reference.py /tmp/ref_timm_init ;;
    packed)  # the packed data path end to end: Fashion-MNIST as a PNG tree, packed, trained in fp8
      rm -rf /tmp/fm_tree /tmp/fm_packed
      run fm_tree_train python3 tools/idx_to_imagefolder.py "${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}/train-images-idx3-ubyte.gz" \
        "${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}/train-labels-idx1-ubyte.gz" /tmp/fm_tree/train
      run fm_tree_val python3 tools/idx_to_imagefolder.py "${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}/t10k-images-idx3-ubyte.gz" \
        "${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}/t10k-labels-idx1-ubyte.gz" /tmp/fm_tree/val
      run fm_pack_train ./pack_images /tmp/fm_tree/train /tmp/fm_packed/train --size 32
      run fm_pack_val ./pack_images /tmp/fm_tree/val /tmp/fm_packed/val --size 32
      run packed_fp8 ./vit_train --data packed:/tmp/fm_packed --img 28 --patch 4 --channels 3 --classes 10 --dim 192 \
        --depth 6 --heads 3 --batch 128 --epochs 10 --lr 0.1 --momentum 0.9 --lr-schedule cosine --warmup-steps 468 \
        --precision fp8 --log-every 468 --log "$OUT/packed_fp8.jsonl"
      run loader_rate_4 ./loader_rate --threads 4
      run loader_rate_8 ./loader_rate --threads 8 ;;
    ref_h)
      rm -rf /tmp/ref_h
      run ref_h_dump ./vit_train --steps 10 --dump-reference /tmp/ref_h
      run ref_h python3 tools/timm_reference.py /tmp/ref_h ;;
    finetune) run finetune python3 tools/finetune_check.py --model small
      run finetune_down python3 tools/finetune_check.py --model small_down ;;
    finetune_h) run finetune_h python3 tools/finetune_check.py --model vit_h16 ;;
    ref_small_droppath)
      rm -rf /tmp/ref_small_dp
      run ref_small_droppath_dump ./vit_train $SMALL --depth 4 --drop-path 0.5 --optimizer adamw --lr 0.001 \
        --weight-decay 0.05 --steps 10 --dump-reference /tmp/ref_small_dp
      run ref_small_droppath python3 tools/timm_reference.py /tmp/ref_small_dp ;;
    ref_h_droppath)
      rm -rf /tmp/ref_h_dp
      run ref_h_droppath_dump ./vit_train --steps 10 --drop-path 0.4 --optimizer adamw --lr 1e-4 --weight-decay 0.05 \
        --dump-reference /tmp/ref_h_dp
      run ref_h_droppath python3 tools/timm_reference.py /tmp/ref_h_dp ;;
    accum)
      for round in 1 2; do
        for prec in bf16 fp8; do
          for batch in 64 16; do
            run "accum_${prec}_b${batch}_r$round" ./vit_train --precision $prec --batch $batch --steps 40 --warmup 10 \
              --log-every 40
            run "accum_${prec}_b${batch}x4_r$round" ./vit_train --precision $prec --batch $batch --accum-steps 4 \
              --steps 40 --warmup 10 --log-every 40
          done
        done
      done ;;
    fashion_adamw)
      for prec in ${FASHION_PRECISIONS:-bf16 fp8}; do
        rm -rf "/tmp/fm_adamw_$prec"
        fm="--data fashion-mnist:${FASHION_MNIST:-/usr/share/datasets/fashion-mnist} --img 28 --patch 4 --channels 1 \
          --classes 10 --dim 192 --depth 6 --heads 3 --batch 128 --precision $prec"
        run "fashion_adamw_$prec" ./vit_train $fm --epochs 10 --optimizer adamw --lr 1e-3 --weight-decay 0.05 \
          --lr-schedule cosine --warmup-steps 468 --log-every 468 --save "/tmp/fm_adamw_$prec" \
          --log "$OUT/fashion_adamw_$prec.jsonl"
        run "fashion_adamw_${prec}_eval" ./vit_train $fm --eval-only --resume "/tmp/fm_adamw_$prec"
      done ;;
    batches)
      for b in ${BATCHES:-32 128 256}; do
        mkdir -p "$OUT/batch_$b"
        OUT=$OUT/batch_$b BATCH=$b STEPS=15 WARMUP=5 run "bench_batch_$b" tools/bench.sh
      done ;;
    overlap)
      for prec in bf16 fp8; do run "overlap_$prec" ./overlap_rate --precision $prec --batch 64; done ;;
    trace)
      for prec in bf16 fp8; do
        run "trace_$prec" ./vit_train --precision $prec --steps 14 --warmup 10 --log-every 14 \
          --trace "$OUT/trace_$prec.json"
        run "trace_${prec}_png" python3 tools/trace_timeline.py "$OUT/trace_$prec.json" "$OUT/trace_$prec.png" \
          --title "vit_train ViT-H/16 $prec, batch 64: steps 11-13"
        # One step: the window from the second traced step's first kernel, a step long.
        window=$(python3 -c "
import json, sys
t = json.load(open('$OUT/trace_$prec.json'))['traceEvents']
steps = sorted(e['ts'] for e in t if e.get('ph') == 'X' and e['name'] == 'step')
print(f'--from-ms {steps[1] / 1e3:.3f} --to-ms {steps[2] / 1e3:.3f}' if len(steps) > 2 else '')")
        run "trace_${prec}_step_png" python3 tools/trace_timeline.py "$OUT/trace_$prec.json" \
          "$OUT/trace_${prec}_step.png" $window --title "vit_train ViT-H/16 $prec, batch 64: step 12"
      done ;;
    ref_h_adamw)
      rm -rf /tmp/ref_h_adamw
      run ref_h_adamw_dump ./vit_train --steps 10 --optimizer adamw --lr 1e-4 --weight-decay 0.05 \
        --dump-reference /tmp/ref_h_adamw
      run ref_h_adamw python3 tools/timm_reference.py /tmp/ref_h_adamw ;;
    *) echo "unknown part $part"; status=1 ;;
  esac
done
exit $status
