#!/usr/bin/env bash
# Data-parallel scaling on one machine, in one call: the engine on 1 GPU (each of the N cards
# alone, in turn) and on N GPUs in each precision, and PyTorch (timm ViT-H/16, bf16 autocast, batch
# on the GPU) eager on 1 GPU and DistributedDataParallel on N, all at batch 64 per GPU. Scaling
# efficiency = 1-GPU step time / N-GPU step time (the same work per GPU), against card 0 (where a
# 1-GPU run lands by default) and against the slowest card: the cards of one machine differ
# by a few percent at the power cap, and a synchronous step waits for its slowest card every
# step. The N-GPU runs go once with the default exchange (the copy engines) and
# once with --allreduce nccl. ROUNDS > 1 repeats the engine's runs in turn (cards alone, N GPUs,
# N GPUs over NCCL; again) and reports each configuration's median: step times drift by ~1%
# within a call. Then one N-GPU --timing run per precision: the all-reduce summary (how much of
# the communication the backward hides) and every rank's phases.
#
# Usage: tools/bench_scaling.sh [N]   (default 2)
# Environment: STEPS (timed, default 30), WARMUP (default 10), PRECISIONS (default "bf16 fp8"),
#              ROUNDS (default 1), OUT (log folder, default /tmp), COMPARE_FLAGS (e.g.
#              "--second-stream off": each round also runs card 0 alone and N GPUs with these
#              flags, and the table gets a row for them, its scaling against card 0 with them).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
PRECISIONS=${PRECISIONS:-bf16 fp8}
ROUNDS=${ROUNDS:-1}
read -ra COMPARE <<< "${COMPARE_FLAGS:-}"
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
[[ "$N" =~ ^[1-9][0-9]*$ && "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "bench_scaling.sh: N and ROUNDS must be positive integers" >&2; exit 1; }

field() {  # field LOG NAME KEY: KEY=... on the last "RESULT NAME" line of LOG
  awk -v name="$2" -v key="$3" '$1 == "RESULT" && $2 == name {
      for (i = 3; i <= NF; i++) { eq = index($i, "="); if (substr($i, 1, eq - 1) == key) v = substr($i, eq + 1) } }
    END { if (v == "") exit 1; print v }' "$1" || { echo "bench_scaling.sh: no $3 in 'RESULT $2' of $1" >&2; exit 1; }
}
median_of() {  # median_of CONFIG KEY: the median over the rounds of the engine's KEY in scaling_engine_CONFIG_r*.log
  for r in $(seq 1 "$ROUNDS"); do field "$LOG_DIR/scaling_engine_${1}_r$r.log" engine "$2"; done |
    sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

read -ra CARDS <<< "$(echo "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((N - 1)))}" | tr , ' ')"
[ "${#CARDS[@]}" -ge "$N" ] || { echo "bench_scaling.sh: CUDA_VISIBLE_DEVICES names fewer than $N cards" >&2; exit 1; }
VISIBLE_ALL=$(IFS=,; echo "${CARDS[*]:0:$N}")

run_engine() {  # run_engine PRECISION GPUS CARDS CONFIG ROUND [FLAGS...]
  local p=$1 g=$2 cards=$3 config=$4 round=$5; shift 5
  echo "== engine $p, $g GPU(s) ($cards), round $round: ./vit_train --batch 64 --precision $p --gpus $g --steps $((STEPS + WARMUP)) --warmup $WARMUP $*"
  CUDA_VISIBLE_DEVICES=$cards ./vit_train --batch 64 --precision "$p" --gpus "$g" --steps $((STEPS + WARMUP)) --warmup "$WARMUP" "$@" 2>&1 \
    | tee "$LOG_DIR/scaling_engine_${config}_r$round.log" | grep -E "RESULT|weights|parallel"
}
for p in $PRECISIONS; do
  for r in $(seq 1 "$ROUNDS"); do
    for i in $(seq 0 $((N - 1))); do run_engine "$p" 1 "${CARDS[$i]}" "${p}_1_card$i" "$r"; done
    run_engine "$p" "$N" "$VISIBLE_ALL" "${p}_$N" "$r"
    run_engine "$p" "$N" "$VISIBLE_ALL" "${p}_${N}_nccl" "$r" --allreduce nccl
    if [ ${#COMPARE[@]} -gt 0 ]; then
      run_engine "$p" 1 "${CARDS[0]}" "${p}_1_card0_compare" "$r" "${COMPARE[@]}"
      run_engine "$p" "$N" "$VISIBLE_ALL" "${p}_${N}_compare" "$r" "${COMPARE[@]}"
    fi
  done
done
export CUDA_VISIBLE_DEVICES=$VISIBLE_ALL
echo "== pytorch eager, 1 GPU"
python3 tools/pytorch_baseline.py --batch 64 --steps "$STEPS" --warmup "$WARMUP" 2>&1 | tee "$LOG_DIR/scaling_pytorch_1.log" | grep RESULT
echo "== pytorch DDP, $N GPUs"
python3 -m torch.distributed.run --nproc_per_node "$N" tools/pytorch_baseline.py --batch 64 --steps "$STEPS" \
  --warmup "$WARMUP" 2>&1 | tee "$LOG_DIR/scaling_pytorch_$N.log" | grep RESULT

printf "\n== ViT-H/16, batch 64 per GPU, median of %d steps after %d warm-up" "$STEPS" "$WARMUP"
[ "$ROUNDS" -gt 1 ] && printf "; the engine's figures: the median of %d rounds" "$ROUNDS"
echo
for p in $PRECISIONS; do
  printf "1-GPU ms, engine %s, card by card:" "$p"
  slowest=0
  for i in $(seq 0 $((N - 1))); do
    ms=$(median_of "${p}_1_card$i" step_ms)
    printf " %.2f" "$ms"
    slowest=$(awk -v a="$ms" -v b="$slowest" 'BEGIN { print (a > b) ? a : b }')
  done
  echo
  eval "slowest_$p=$slowest"
done
printf "%-14s %12s %12s %14s %14s %10s %12s\n" "" "1-GPU ms" "$N-GPU ms" "1-GPU img/s" "$N-GPU img/s" "scaling" "vs slowest"
for p in $PRECISIONS; do
  slowest_var="slowest_$p"
  for config in "$N" "${N}_nccl"; do
    a=$(median_of "${p}_1_card0" step_ms); b=$(median_of "${p}_$config" step_ms)
    printf "%-14s %12.2f %12.2f %14.1f %14.1f %10.3f %12.3f\n" "engine $p${config#$N}" "$a" "$b" \
      "$(median_of "${p}_1_card0" img_s)" "$(median_of "${p}_$config" img_s)" \
      "$(awk -v a="$a" -v b="$b" 'BEGIN { print a / b }')" "$(awk -v a="${!slowest_var}" -v b="$b" 'BEGIN { print a / b }')"
  done
  if [ ${#COMPARE[@]} -gt 0 ]; then
    a=$(median_of "${p}_1_card0_compare" step_ms); b=$(median_of "${p}_${N}_compare" step_ms)
    printf "%-14s %12.2f %12.2f %14.1f %14.1f %10.3f %12s   (%s, card 0 with them too)\n" "engine $p" "$a" "$b" \
      "$(median_of "${p}_1_card0_compare" img_s)" "$(median_of "${p}_${N}_compare" img_s)" \
      "$(awk -v a="$a" -v b="$b" 'BEGIN { print a / b }')" "-" "${COMPARE[*]}"
  fi
done
a=$(field "$LOG_DIR/scaling_pytorch_1.log" pytorch_eager step_ms); b=$(field "$LOG_DIR/scaling_pytorch_$N.log" pytorch_ddp step_ms)
printf "%-14s %12.2f %12.2f %14.1f %14.1f %10.3f\n" "pytorch" "$a" "$b" \
  "$(field "$LOG_DIR/scaling_pytorch_1.log" pytorch_eager img_s)" "$(field "$LOG_DIR/scaling_pytorch_$N.log" pytorch_ddp img_s)" \
  "$(awk -v a="$a" -v b="$b" 'BEGIN { print a / b }')"

for p in $PRECISIONS; do
  echo "== engine $p, $N GPUs, --timing"
  ./vit_train --batch 64 --precision "$p" --gpus "$N" --steps 15 --warmup 5 --timing 2>&1 \
    | tee "$LOG_DIR/scaling_timing_${p}_$N.log" | grep -E "all-reduce|GEMM|attention|summary|per rank|^  rank "
done
