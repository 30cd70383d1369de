#!/usr/bin/env bash
# One benchmark round on the GPU machine: the engine in each precision and the PyTorch baseline,
# on the same card in one call.
#
# Usage: tools/bench.sh [extra vit_train arguments, e.g. --timing]
# Environment: BATCH (images a step, default 64), STEPS (timed steps, default 30), WARMUP
#              (untimed steps first, default 10),
#              PRECISIONS (engine precisions, default "bf16 fp8"), OUT (log folder, default /tmp),
#              COMPILE=1 (also PyTorch under torch.compile: compiles in its warm-up, ~1 minute more).
# Builds nothing: ./vit_train must already be built. Runs ViT-H/16 at batch $BATCH through
# ./vit_train and tools/pytorch_baseline.py with the same step counts, keeps each full log in
# $OUT/bench_engine_<precision>.log and $OUT/bench_pytorch.log, and prints a table made from
# their RESULT lines (and $OUT/bench_pytorch_compile.log with COMPILE=1).
set -euo pipefail

cd "$(dirname "$0")/.."
BATCH=${BATCH:-64}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
PRECISIONS=${PRECISIONS:-bf16 fp8}
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
PYTORCH_LOG=$LOG_DIR/bench_pytorch.log
COMPILE_LOG=$LOG_DIR/bench_pytorch_compile.log

# vit_train counts its warm-up inside --steps; the baseline times --steps after --warmup.
for p in $PRECISIONS; do
  echo "== engine: ./vit_train --model vit_h16 --batch $BATCH --precision $p --steps $((STEPS + WARMUP)) --warmup $WARMUP $*"
  ./vit_train --model vit_h16 --batch "$BATCH" --precision "$p" --steps "$((STEPS + WARMUP))" --warmup "$WARMUP" "$@" 2>&1 \
    | tee "$LOG_DIR/bench_engine_$p.log"
done
echo "== pytorch: python3 tools/pytorch_baseline.py --batch $BATCH --steps $STEPS --warmup $WARMUP"
python3 tools/pytorch_baseline.py --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP" 2>&1 | tee "$PYTORCH_LOG"
if [ "${COMPILE:-0}" = 1 ]; then
  echo "== pytorch: python3 tools/pytorch_baseline.py --batch $BATCH --steps $STEPS --warmup $WARMUP --compile"
  python3 tools/pytorch_baseline.py --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP" --compile 2>&1 | tee "$COMPILE_LOG"
fi

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

printf "\n== ViT-H/16, batch %d, median of %d steps after %d warm-up\n" "$BATCH" "$STEPS" "$WARMUP"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
p_ms=$(result_field "$PYTORCH_LOG" pytorch_eager step_ms)
compiled=0 c_ms=
if [ "${COMPILE:-0}" = 1 ]; then compiled=1 c_ms=$(result_field "$COMPILE_LOG" pytorch_compile step_ms); fi
# against_compiled MS: the ratio column to the compiled baseline, when it ran.
against_compiled() { if [ $compiled = 1 ]; then printf " %12.3f" "$(ratio "$1" "$c_ms")"; fi; }
printf "%-16s %10s %10s %10s %8s %10s %12s" "" "step ms" "mean ms" "images/s" "TFLOP/s" "memory GiB" "vs pytorch"
if [ $compiled = 1 ]; then printf " %12s" "vs compiled"; fi
printf "\n"
for p in $PRECISIONS; do
  log=$LOG_DIR/bench_engine_$p.log
  ms=$(result_field "$log" engine step_ms)
  printf "%-16s %10.2f %10.2f %10.1f %8.1f %10.2f %12.3f" "engine $p" "$ms" "$(result_field "$log" engine mean_ms)" \
    "$(result_field "$log" engine img_s)" "$(result_field "$log" engine tflops)" \
    "$(result_field "$log" engine peak_mem_gib)" "$(ratio "$ms" "$p_ms")"
  against_compiled "$ms"
  printf "\n"
  bench="BENCH precision=$p engine_step_ms=$ms pytorch_step_ms=$p_ms step_ratio=$(ratio "$ms" "$p_ms")"
  if [ $compiled = 1 ]; then bench="$bench compiled_step_ms=$c_ms compiled_ratio=$(ratio "$ms" "$c_ms")"; fi
  echo "$bench"
done
# pytorch_row LOG NAME LABEL: a PyTorch baseline's row.
pytorch_row() {
  local ms
  ms=$(result_field "$1" "$2" step_ms)
  printf "%-16s %10.2f %10.2f %10.1f %8.1f %10.2f %12.3f" "$3" "$ms" "$(result_field "$1" "$2" mean_ms)" \
    "$(result_field "$1" "$2" img_s)" "$(result_field "$1" "$2" tflops)" "$(result_field "$1" "$2" peak_reserved_gib)" \
    "$(ratio "$ms" "$p_ms")"
  against_compiled "$ms"
  printf "\n"
}
pytorch_row "$PYTORCH_LOG" pytorch_eager "pytorch eager"
if [ $compiled = 1 ]; then pytorch_row "$COMPILE_LOG" pytorch_compile "pytorch compile"; fi
echo "(engine memory: device memory in use; pytorch: max_memory_reserved)"
