#!/usr/bin/env bash
# One benchmark round on the GPU machine: the engine in each precision and the PyTorch baseline,
# on the same card in one call.
#
# Usage: tools/bench.sh [extra vit_train arguments, e.g. --timing]
# Environment: STEPS (timed steps, default 30), WARMUP (untimed steps first, default 10),
#              PRECISIONS (engine precisions, default "bf16 fp8"), OUT (log folder, default /tmp).
# Builds nothing: ./vit_train must already be built. Runs ViT-H/16 at batch 64 through
# ./vit_train and tools/pytorch_baseline.py with the same step counts, keeps each full log in
# $OUT/bench_engine_<precision>.log and $OUT/bench_pytorch.log, and prints a table made from
# their RESULT lines.
set -euo pipefail

cd "$(dirname "$0")/.."
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
PRECISIONS=${PRECISIONS:-bf16 fp8}
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
PYTORCH_LOG=$LOG_DIR/bench_pytorch.log

# vit_train counts its warm-up inside --steps; the baseline times --steps after --warmup.
for p in $PRECISIONS; do
  echo "== engine: ./vit_train --model vit_h16 --batch 64 --precision $p --steps $((STEPS + WARMUP)) --warmup $WARMUP $*"
  ./vit_train --model vit_h16 --batch 64 --precision "$p" --steps "$((STEPS + WARMUP))" --warmup "$WARMUP" "$@" 2>&1 \
    | tee "$LOG_DIR/bench_engine_$p.log"
done
echo "== pytorch: python3 tools/pytorch_baseline.py --batch 64 --steps $STEPS --warmup $WARMUP"
python3 tools/pytorch_baseline.py --batch 64 --steps "$STEPS" --warmup "$WARMUP" 2>&1 | tee "$PYTORCH_LOG"

# result_field LOG NAME KEY: the value of KEY=... on the last "RESULT NAME ..." line of LOG.
result_field() {
  awk -v name="$2" -v key="$3" '
    $1 == "RESULT" && $2 == name {
      for (i = 3; i <= NF; i++) {
        eq = index($i, "=")
        if (substr($i, 1, eq - 1) == key) value = substr($i, eq + 1)
      }
    }
    END { if (value == "") exit 1; print value }' "$1" \
  || { echo "bench.sh: no $3 in a 'RESULT $2' line of $1" >&2; return 1; }
}

printf "\n== ViT-H/16, batch 64, median of %d steps after %d warm-up\n" "$STEPS" "$WARMUP"
printf "%-16s %10s %10s %10s %8s %10s %12s\n" "" "step ms" "mean ms" "images/s" "TFLOP/s" "memory GiB" "vs pytorch"
p_ms=$(result_field "$PYTORCH_LOG" pytorch_eager step_ms)
for p in $PRECISIONS; do
  log=$LOG_DIR/bench_engine_$p.log
  ms=$(result_field "$log" engine step_ms)
  printf "%-16s %10.2f %10.2f %10.1f %8.1f %10.2f %12.3f\n" "engine $p" "$ms" "$(result_field "$log" engine mean_ms)" \
    "$(result_field "$log" engine img_s)" "$(result_field "$log" engine tflops)" \
    "$(result_field "$log" engine peak_mem_gib)" "$(awk -v a="$ms" -v b="$p_ms" 'BEGIN { print a / b }')"
  echo "BENCH precision=$p engine_step_ms=$ms pytorch_step_ms=$p_ms step_ratio=$(awk -v a="$ms" -v b="$p_ms" 'BEGIN { printf "%.3f", a / b }')"
done
printf "%-16s %10.2f %10.2f %10.1f %8.1f %10.2f %12s\n" "pytorch eager" "$p_ms" \
  "$(result_field "$PYTORCH_LOG" pytorch_eager mean_ms)" "$(result_field "$PYTORCH_LOG" pytorch_eager img_s)" \
  "$(result_field "$PYTORCH_LOG" pytorch_eager tflops)" "$(result_field "$PYTORCH_LOG" pytorch_eager peak_reserved_gib)" "1.000"
echo "(engine memory: device memory in use; pytorch: max_memory_reserved)"
