#!/usr/bin/env bash
# Runs a small two-GPU training (one process, one thread per GPU) again and again and reports the
# runs that stall: each run stops itself after --comm-timeout seconds without a step, and its
# message names what every rank was doing. For rare start-up or first-step hangs of the
# data-parallel path.
# Usage: tools/stall_loop.sh [RUNS=40] [extra vit_train flags...]   (needs 2 GPUs and ./vit_train)
set -uo pipefail
runs=${1:-40}
shift || true
small="--img 32 --patch 8 --channels 3 --classes 10 --dim 64 --depth 2 --heads 4 --lr 0.05 --steps 20 --warmup 2
       --log-every 1 --bucket-mb 1 --gpus 2 --batch 16 --no-gemm-autotune --comm-timeout 8"
log=$(mktemp)
stalled=0
for i in $(seq 1 "$runs"); do
  precision=fp8
  [ $((i % 3)) -eq 0 ] && precision=bf16
  # shellcheck disable=SC2086
  timeout 60 ./vit_train $small --precision $precision "$@" > "$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    stalled=$((stalled + 1))
    echo "run $i ($precision) exit $rc: $(grep -m1 -oE 'comm-timeout.*|error: .*' "$log")"
  fi
done
rm -f "$log"
echo "stall_loop: $stalled of $runs runs failed"
[ $stalled -eq 0 ]
