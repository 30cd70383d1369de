#!/usr/bin/env bash
# The headline run (issue 6) in one call on a machine of several GPUs, binaries built beforehand:
#   1. ./vit_tests (the CPU tier and the GPU tier, the multi-GPU tests included)
#   2. ViT-H/16 at batch 64 per GPU in bf16 and fp8 on 1, 2, 4, ... GPUs up to N (--gpus K),
#      each run checking that every rank ends with the same weights (the trainer compares the
#      ranks' checksums and prints "identical on all K ranks"); on N GPUs also with
#      --allreduce nccl (the default between GPUs of one process is the copy-engine exchange)
#   3. each card alone in each precision (a K-GPU step waits for the slowest of its K cards),
#      and an N-GPU --timing run per precision (every rank's phases and wait)
#   4. PyTorch DDP (timm's model, bf16 autocast, batch on the GPU) on N GPUs, and eager on 1
#   5. a failure injected into the last rank at step 5 of an N-GPU run: the run must stop with
#      exit 1 and a message naming that rank, within 60 s
# then a table: step time, images/s in total, scaling against 1 GPU (card 0) and against the
# slowest card of the run, ratio to PyTorch DDP.
# Every part runs even if an earlier one fails; logs go to $OUT (default /tmp/headline).
#
# Usage: tools/headline_round.sh [N]   (default: every GPU nvidia-smi lists)
# Environment: STEPS (timed, default 30), WARMUP (default 10), PRECISIONS (default "bf16 fp8"),
#              SKIP_TESTS=1 (skip part 1), ENGINE_FLAGS (added to every engine run).
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-$(nvidia-smi -L | wc -l)}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
PRECISIONS=${PRECISIONS:-bf16 fp8}
LOG_DIR=${OUT:-/tmp/headline}
mkdir -p "$LOG_DIR"
status=0
counts=""
for ((k = 1; k <= N; k *= 2)); do counts="$counts $k"; done
[ "${counts##* }" = "$N" ] || counts="$counts $N"  # N itself when it is not a power of two

field() {  # field LOG NAME KEY: KEY=... on the last "RESULT NAME" line of LOG, or "-"
  awk -v name="$2" -v key="$3" '$1 == "RESULT" && $2 == name {
      for (i = 3; i <= NF; i++) { eq = index($i, "="); if (substr($i, 1, eq - 1) == key) v = substr($i, eq + 1) } }
    END { print (v == "" ? "-" : v) }' "$1" 2>/dev/null || echo "-"
}

nvidia-smi --query-gpu=index,name,memory.total,power.limit --format=csv | tee "$LOG_DIR/gpus.csv"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== ./vit_tests"
  ./vit_tests > "$LOG_DIR/tests.log" 2>&1 || status=1
  tail -1 "$LOG_DIR/tests.log"
fi

for p in $PRECISIONS; do
  for k in $counts; do
    log="$LOG_DIR/engine_${p}_$k.log"
    echo "== engine $p on $k GPU(s)"
    # shellcheck disable=SC2086
    ./vit_train --batch 64 --precision "$p" --gpus "$k" --steps $((STEPS + WARMUP)) --warmup "$WARMUP" \
      ${ENGINE_FLAGS:-} > "$log" 2>&1 || status=1
    grep -E "^RESULT|identical on all" "$log"
    if [ "$k" -gt 1 ] && ! grep -q "identical on all $k ranks" "$log"; then
      echo "   the ranks' weights were not reported identical"; status=1
    fi
  done
done

for p in $PRECISIONS; do
  log="$LOG_DIR/engine_${p}_${N}_nccl.log"
  echo "== engine $p on $N GPUs, --allreduce nccl"
  # shellcheck disable=SC2086
  ./vit_train --batch 64 --precision "$p" --gpus "$N" --steps $((STEPS + WARMUP)) --warmup "$WARMUP" --allreduce nccl \
    ${ENGINE_FLAGS:-} > "$log" 2>&1 || status=1
  grep -E "^RESULT|identical on all" "$log"
done

read -ra CARDS <<< "$(echo "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((N - 1)))}" | tr , ' ')"
for p in $PRECISIONS; do
  printf "== engine %s, each card alone:" "$p"
  for i in $(seq 0 $((N - 1))); do
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=${CARDS[$i]} ./vit_train --batch 64 --precision "$p" --steps $((STEPS + WARMUP)) \
      --warmup "$WARMUP" ${ENGINE_FLAGS:-} > "$LOG_DIR/card_${p}_$i.log" 2>&1 || status=1
    printf " %s" "$(field "$LOG_DIR/card_${p}_$i.log" engine step_ms)"
  done
  echo
  echo "== engine $p on $N GPUs, --timing"
  # shellcheck disable=SC2086
  ./vit_train --batch 64 --precision "$p" --gpus "$N" --steps 15 --warmup 5 --timing ${ENGINE_FLAGS:-} \
    > "$LOG_DIR/timing_${p}_$N.log" 2>&1 || status=1
  grep -E "gradient all-reduce|per rank|^  rank " "$LOG_DIR/timing_${p}_$N.log"
done

echo "== PyTorch eager, 1 GPU"
python3 tools/pytorch_baseline.py --batch 64 --steps "$STEPS" --warmup "$WARMUP" > "$LOG_DIR/pytorch_1.log" 2>&1 ||
  status=1
grep RESULT "$LOG_DIR/pytorch_1.log"
echo "== PyTorch DDP, $N GPUs"
python3 -m torch.distributed.run --nproc_per_node "$N" tools/pytorch_baseline.py --batch 64 --steps "$STEPS" \
  --warmup "$WARMUP" > "$LOG_DIR/pytorch_$N.log" 2>&1 || status=1
grep RESULT "$LOG_DIR/pytorch_$N.log"

echo "== a failure injected into rank $((N - 1)) at step 5 of $N GPUs"
t0=$SECONDS
VIT_TRAIN_TEST_FAIL=$((N - 1)):5 timeout 300 ./vit_train --img 32 --patch 8 --channels 3 --classes 10 --dim 64 \
  --depth 2 --heads 4 --batch 16 --steps 100000 --log-every 10 --gpus "$N" > "$LOG_DIR/failure.log" 2>&1
rc=$?
took=$((SECONDS - t0))
if [ "$rc" -eq 1 ] && grep -q "rank $((N - 1)): failure injected" "$LOG_DIR/failure.log" && [ "$took" -lt 60 ]; then
  echo "   stopped cleanly: exit 1 after $took s, rank $((N - 1)) named"
else
  echo "   NOT clean: exit $rc after $took s"; status=1
fi

ddp=$(field "$LOG_DIR/pytorch_$N.log" pytorch_ddp step_ms)
printf "\n== ViT-H/16, batch 64 per GPU, median of %d steps after %d warm-up (PyTorch DDP on %d GPUs: %s ms)\n" \
  "$STEPS" "$WARMUP" "$N" "$ddp"
printf "%-9s %5s %10s %14s %9s %11s %14s\n" "" "GPUs" "step ms" "images/s" "scaling" "vs slowest" "vs DDP (step)"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-" || a == "" || b == "") print "-"; else printf "%.3f", a / b }'; }
slowest() {  # slowest PRECISION K: the largest step time of cards 0..K-1 alone
  for i in $(seq 0 $(($2 - 1))); do field "$LOG_DIR/card_${1}_$i.log" engine step_ms; done | grep -v '^-$' | sort -g | tail -1
}
for p in $PRECISIONS; do
  one=$(field "$LOG_DIR/engine_${p}_1.log" engine step_ms)
  for k in $counts; do
    ms=$(field "$LOG_DIR/engine_${p}_$k.log" engine step_ms)
    vs=$(awk -v a="$ms" -v b="$ddp" -v k="$k" -v n="$N" 'BEGIN { if (k != n || a == "-" || b == "-") print ""; else printf "%.3fx", a / b }')
    printf "%-9s %5d %10s %14s %9s %11s %14s\n" "$p" "$k" "$ms" "$(field "$LOG_DIR/engine_${p}_$k.log" engine img_s)" \
      "$(ratio "$one" "$ms")" "$(ratio "$(slowest "$p" "$k")" "$ms")" "$vs"
  done
  ms=$(field "$LOG_DIR/engine_${p}_${N}_nccl.log" engine step_ms)
  printf "%-9s %5d %10s %14s %9s %11s %14s\n" "$p nccl" "$N" "$ms" "$(field "$LOG_DIR/engine_${p}_${N}_nccl.log" engine img_s)" \
    "$(ratio "$one" "$ms")" "$(ratio "$(slowest "$p" "$N")" "$ms")" "$(ratio "$ms" "$ddp" | sed 's/[0-9]$/&x/')"
done
exit $status
