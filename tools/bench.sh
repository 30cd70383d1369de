#!/usr/bin/env bash
# One benchmark round on the GPU machine, engine and PyTorch baseline on the same card in one run.
#
# Usage: tools/bench.sh [extra vit_train arguments, e.g. --timing]
# Environment: STEPS (timed steps, default 30), WARMUP (untimed steps first, default 10),
#              OUT (log folder, default /tmp).
# Builds nothing: ./vit_train must already be built. Runs ViT-H/16 at batch 64 through
# ./vit_train and tools/pytorch_baseline.py with the same step counts, keeps each full log in
# $OUT/bench_engine.log and $OUT/bench_pytorch.log, and prints a table made from their RESULT lines.
set -euo pipefail

cd "$(dirname "$0")/.."
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
ENGINE_LOG=$LOG_DIR/bench_engine.log
PYTORCH_LOG=$LOG_DIR/bench_pytorch.log

# vit_train counts its warm-up inside --steps; the baseline times --steps after --warmup.
echo "== engine: ./vit_train --model vit_h16 --batch 64 --steps $((STEPS + WARMUP)) --warmup $WARMUP $*"
./vit_train --model vit_h16 --batch 64 --steps "$((STEPS + WARMUP))" --warmup "$WARMUP" "$@" 2>&1 \
  | tee "$ENGINE_LOG"
echo "== pytorch: python3 tools/pytorch_baseline.py --batch 64 --steps $STEPS --warmup $WARMUP"
python3 tools/pytorch_baseline.py --batch 64 --steps "$STEPS" --warmup "$WARMUP" 2>&1 \
  | tee "$PYTORCH_LOG"

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

e_ms=$(result_field "$ENGINE_LOG" engine step_ms)
e_mean=$(result_field "$ENGINE_LOG" engine mean_ms)
e_img=$(result_field "$ENGINE_LOG" engine img_s)
e_tflops=$(result_field "$ENGINE_LOG" engine tflops)
e_mfu=$(result_field "$ENGINE_LOG" engine mfu)
e_mem=$(result_field "$ENGINE_LOG" engine peak_mem_gib)
p_ms=$(result_field "$PYTORCH_LOG" pytorch_eager step_ms)
p_mean=$(result_field "$PYTORCH_LOG" pytorch_eager mean_ms)
p_img=$(result_field "$PYTORCH_LOG" pytorch_eager img_s)
p_tflops=$(result_field "$PYTORCH_LOG" pytorch_eager tflops)
p_alloc=$(result_field "$PYTORCH_LOG" pytorch_eager peak_alloc_gib)
p_reserved=$(result_field "$PYTORCH_LOG" pytorch_eager peak_reserved_gib)

awk -v e_ms="$e_ms" -v e_mean="$e_mean" -v e_img="$e_img" -v e_tflops="$e_tflops" \
    -v e_mfu="$e_mfu" -v e_mem="$e_mem" -v p_ms="$p_ms" -v p_mean="$p_mean" -v p_img="$p_img" \
    -v p_tflops="$p_tflops" -v p_alloc="$p_alloc" -v p_reserved="$p_reserved" \
    -v steps="$STEPS" -v warmup="$WARMUP" 'BEGIN {
  printf "\n== ViT-H/16, batch 64, median of %d steps after %d warm-up\n", steps, warmup
  printf "%-22s %12s %12s\n", "", "engine", "pytorch"
  printf "%-22s %12.2f %12.2f\n", "step ms (median)", e_ms, p_ms
  printf "%-22s %12.2f %12.2f\n", "step ms (mean)", e_mean, p_mean
  printf "%-22s %12.1f %12.1f\n", "images/s", e_img, p_img
  printf "%-22s %12.1f %12.1f\n", "TFLOP/s", e_tflops, p_tflops
  printf "%-22s %12s %12s\n", "MFU", e_mfu, "-"
  printf "%-22s %12.2f %12.2f\n", "peak memory GiB", e_mem, p_reserved  # pytorch: reserved
  printf "%-22s %12s %12.2f\n", "  of which allocated", "", p_alloc
  printf "engine_step / pytorch_step   = %.3f\n", e_ms / p_ms
  printf "engine_img_s / pytorch_img_s = %.3f\n", e_img / p_img
  printf "BENCH engine_step_ms=%s pytorch_step_ms=%s step_ratio=%.3f img_s_ratio=%.3f\n", \
    e_ms, p_ms, e_ms / p_ms, e_img / p_img
}'
