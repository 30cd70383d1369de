#!/usr/bin/env bash
# Runs every fuzz target (`make fuzz` builds them) for SECONDS each on a fresh corpus: a copy of
# its seeds, beside its regression inputs (tests/fuzz/regressions/TARGET). Exits non-zero on any
# finding (a crash, a sanitizer report, a leak, an input slower than 10 s, a single allocation
# above 1 GiB or 2 GiB resident) and copies the input that found it to build/fuzz/findings/.
# Prints, per target, the inputs run and the corpus it grew.
# Usage: tests/fuzz/run.sh [SECONDS_PER_TARGET (default 20)] [more libFuzzer flags, e.g. -runs=1000000]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-20}
shift || true
build=${BUILD:-build}
work=$(mktemp -d /tmp/vit_fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
declare -A max_len=([safetensors]=4096 [checkpoint_state]=65536 [idx]=4096 [packed_shard]=4096 [image_decode]=8192)
status=0
for target in safetensors checkpoint_state idx packed_shard image_decode; do
  bin=$build/fuzz/fuzz_$target
  [ -x "$bin" ] || { echo "$bin is missing: run make fuzz first" >&2; exit 2; }
  mkdir -p "$work/$target/corpus" "$work/$target/findings"
  cp "$build/fuzz/seeds/$target"/* "$work/$target/corpus/"
  dirs=("$work/$target/corpus")
  log=$work/$target/log
  # The regression inputs whole (a corpus is cut to -max_len), then the fuzzing from them too.
  if [ -d "tests/fuzz/regressions/$target" ]; then
    dirs+=("tests/fuzz/regressions/$target")
    if ! "$bin" -rss_limit_mb=2048 -malloc_limit_mb=1024 tests/fuzz/regressions/"$target"/* >"$log" 2>&1; then
      status=1
      echo "fuzz_$target: a regression input fails again" >&2
      grep -v '^#' "$log" | tail -40 >&2
      continue
    fi
  fi
  if "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
      -max_len="${max_len[$target]}" -artifact_prefix="$work/$target/findings/" -print_final_stats=1 \
      "$@" "${dirs[@]}" >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    corpus=$(ls "$work/$target/corpus" | wc -l)
    printf 'fuzz_%-17s %9s inputs, corpus %5s files, no finding\n' "$target" "$runs" "$corpus"
  else
    status=1
    echo "fuzz_$target: FINDING" >&2
    grep -v '^#' "$log" | tail -60 >&2
    mkdir -p "$build/fuzz/findings"
    cp "$work/$target/findings"/* "$build/fuzz/findings/" 2>/dev/null || true
    echo "the input that found it: $build/fuzz/findings/ (run it again: $bin FILE)" >&2
  fi
done
exit $status
