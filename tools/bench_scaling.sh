#!/usr/bin/env bash
# Data-parallel scaling on one machine, in one call: the engine on 1 GPU (each of the N cards alone,
# in turn) and on N GPUs in each precision, and PyTorch (timm ViT-H/16, bf16 autocast, batch on the GPU) eager on 1 GPU and
# DistributedDataParallel on N, all at batch 64 per GPU. Scaling efficiency = 1-GPU step time /
# N-GPU step time (the same work per GPU), against card 0 (where a 1-GPU run lands by default) and
# against the slowest card: cards of one machine differ by up to ~2.5% at the power cap
# (BENCHMARKS.md 20, 23), and a synchronous step cannot be faster than its slowest card. The N-GPU runs go once with the default exchange (the
# copy engines) and once with --allreduce nccl. Then one N-GPU --timing run per precision for the
# all-reduce summary (how much of the communication the backward hides).
#
# Usage: tools/bench_scaling.sh [N]   (default 2)
# Environment: STEPS (timed, default 30), WARMUP (default 10), PRECISIONS (default "bf16 fp8"),
#              OUT (log folder, default /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
PRECISIONS=${PRECISIONS:-bf16 fp8}
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"

field() {  # field LOG NAME KEY: KEY=... on the last "RESULT NAME" line of LOG
  awk -v name="$2" -v key="$3" '$1 == "RESULT" && $2 == name {
      for (i = 3; i <= NF; i++) { eq = index($i, "="); if (substr($i, 1, eq - 1) == key) v = substr($i, eq + 1) } }
    END { if (v == "") exit 1; print v }' "$1" || { echo "bench_scaling.sh: no $3 in 'RESULT $2' of $1" >&2; exit 1; }
}

read -ra CARDS <<< "$(echo "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((N - 1)))}" | tr , ' ')"
[ "${#CARDS[@]}" -ge "$N" ] || { echo "bench_scaling.sh: CUDA_VISIBLE_DEVICES names fewer than $N cards" >&2; exit 1; }

run_engine() {  # run_engine PRECISION GPUS LOG_SUFFIX [FLAGS...]; the cards are $VISIBLE
  local p=$1 g=$2 suffix=$3; shift 3
  echo "== engine $p, $g GPU(s) ($VISIBLE): ./vit_train --batch 64 --precision $p --gpus $g --steps $((STEPS + WARMUP)) --warmup $WARMUP $*"
  CUDA_VISIBLE_DEVICES=$VISIBLE ./vit_train --batch 64 --precision "$p" --gpus "$g" --steps $((STEPS + WARMUP)) --warmup "$WARMUP" "$@" 2>&1 \
    | tee "$LOG_DIR/scaling_engine_${p}_$suffix.log" | grep -E "RESULT|weights|parallel"
}
VISIBLE_ALL=$(IFS=,; echo "${CARDS[*]:0:$N}")
for p in $PRECISIONS; do
  for i in $(seq 0 $((N - 1))); do VISIBLE=${CARDS[$i]} run_engine "$p" 1 "1_card$i"; done
  cp "$LOG_DIR/scaling_engine_${p}_1_card0.log" "$LOG_DIR/scaling_engine_${p}_1.log"
  VISIBLE=$VISIBLE_ALL
  run_engine "$p" "$N" "$N"
  run_engine "$p" "$N" "${N}_nccl" --allreduce nccl
done
export CUDA_VISIBLE_DEVICES=$VISIBLE_ALL
echo "== pytorch eager, 1 GPU"
python3 tools/pytorch_baseline.py --batch 64 --steps "$STEPS" --warmup "$WARMUP" 2>&1 | tee "$LOG_DIR/scaling_pytorch_1.log" | grep RESULT
echo "== pytorch DDP, $N GPUs"
python3 -m torch.distributed.run --nproc_per_node "$N" tools/pytorch_baseline.py --batch 64 --steps "$STEPS" \
  --warmup "$WARMUP" 2>&1 | tee "$LOG_DIR/scaling_pytorch_$N.log" | grep RESULT

slowest() {  # slowest PRECISION: the largest 1-GPU step time over the cards
  for i in $(seq 0 $((N - 1))); do field "$LOG_DIR/scaling_engine_${1}_1_card$i.log" engine step_ms; done | sort -g | tail -1
}
printf "\n== ViT-H/16, batch 64 per GPU, median of %d steps after %d warm-up\n" "$STEPS" "$WARMUP"
for p in $PRECISIONS; do
  printf "1-GPU ms, engine %s, card by card:" "$p"
  for i in $(seq 0 $((N - 1))); do printf " %.2f" "$(field "$LOG_DIR/scaling_engine_${p}_1_card$i.log" engine step_ms)"; done
  echo
done
printf "%-14s %12s %12s %14s %14s %10s %12s\n" "" "1-GPU ms" "$N-GPU ms" "1-GPU img/s" "$N-GPU img/s" "scaling" "vs slowest"
for p in $PRECISIONS; do
  for suffix in "$N" "${N}_nccl"; do
    a=$(field "$LOG_DIR/scaling_engine_${p}_1.log" engine step_ms); b=$(field "$LOG_DIR/scaling_engine_${p}_$suffix.log" engine step_ms)
    printf "%-14s %12.2f %12.2f %14.1f %14.1f %10.3f %12.3f\n" "engine $p${suffix#$N}" "$a" "$b" \
      "$(field "$LOG_DIR/scaling_engine_${p}_1.log" engine img_s)" "$(field "$LOG_DIR/scaling_engine_${p}_$suffix.log" engine img_s)" \
      "$(awk -v a="$a" -v b="$b" 'BEGIN { print a / b }')" "$(awk -v a="$(slowest "$p")" -v b="$b" 'BEGIN { print a / b }')"
  done
done
a=$(field "$LOG_DIR/scaling_pytorch_1.log" pytorch_eager step_ms); b=$(field "$LOG_DIR/scaling_pytorch_$N.log" pytorch_ddp step_ms)
printf "%-14s %12.2f %12.2f %14.1f %14.1f %10.3f\n" "pytorch" "$a" "$b" \
  "$(field "$LOG_DIR/scaling_pytorch_1.log" pytorch_eager img_s)" "$(field "$LOG_DIR/scaling_pytorch_$N.log" pytorch_ddp img_s)" \
  "$(awk -v a="$a" -v b="$b" 'BEGIN { print a / b }')"

for p in $PRECISIONS; do
  echo "== engine $p, $N GPUs, --timing"
  ./vit_train --batch 64 --precision "$p" --gpus "$N" --steps 15 --warmup 5 --timing 2>&1 \
    | tee "$LOG_DIR/scaling_timing_${p}_$N.log" | grep -E "all-reduce|GEMM|attention|summary"
done
