#!/usr/bin/env bash
# The mma.sync attention kernels' tuning (kernels/attention_mma.cuh, struct Tuning) swept: one
# attention_rate per setting, built here, run on the GPU machine.
#
#   tools/attention_sweep.sh build DIR SETTING...   SETTING = FWD_MINB,DKDV_SUB,DKDV_MINB,DQ_SUB,DQ_MINB
#                                                   (e.g. 3,64,2,64,2); prints ptxas's registers
#                                                   and spills of every kernel per setting
#   tools/attention_sweep.sh run DIR [B H T HD...]  runs every attention_rate_* of DIR
#
# A setting applies to every head dim of its build; make must have built the library first.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: attention_sweep.sh build|run DIR ...}
dir=${2:?usage: attention_sweep.sh build|run DIR ...}
shift 2
case $mode in
  build)
    mkdir -p "$dir"
    cuda=${CUDA:-/usr/local/cuda}
    units="attention_streamed_forward attention_streamed_backward attention_single_pass"  # what Tuning builds
    lib=$(make -p -n 2>/dev/null | sed -n 's/^LIB_OBJ := //p' | head -1)
    for u in $units; do lib=${lib//build\/kernels\/$u.o/}; done
    [ -n "$lib" ] && [ -f build/tools/attention_rate.o ] || { echo "attention_sweep.sh: run make first" >&2; exit 1; }
    for setting in "$@"; do
      IFS=, read -r fwd dkdv_sub dkdv_minb dq_sub dq_minb <<<"$setting"
      name="attention_rate_${fwd}_${dkdv_sub}_${dkdv_minb}_${dq_sub}_${dq_minb}"
      objs=()
      for u in $units; do
        "$cuda/bin/nvcc" -std=c++17 -O3 -lineinfo -gencode arch=compute_90a,code=sm_90a -I. -DATT_SWEEP \
          -DATT_FWD_MINB="$fwd" -DATT_DKDV_SUB="$dkdv_sub" -DATT_DKDV_MINB="$dkdv_minb" -DATT_DQ_SUB="$dq_sub" \
          -DATT_DQ_MINB="$dq_minb" -Xptxas -v -c "kernels/$u.cu" -o "$dir/$name.$u.o" >> "$dir/$name.ptxas" 2>&1 ||
          { cat "$dir/$name.ptxas" >&2; exit 1; }
        objs+=("$dir/$name.$u.o")
      done
      # registers and spills per kernel and head dim
      awk -v n="$name" '/Compiling entry/ { match($0, /attention_[a-z]+_kernelILi[0-9]+/); k = substr($0, RSTART, RLENGTH) }
        /spill stores/ { s = $0 } /Used [0-9]+ registers/ && k != "" { print n ": " k ": " $5 " registers, " s; k = "" }' \
        "$dir/$name.ptxas"
      # shellcheck disable=SC2086
      "$cuda/bin/nvcc" -o "$dir/$name" "${objs[@]}" $lib build/tools/attention_rate.o -gencode arch=compute_90a,code=sm_90a \
        -L"$cuda/lib64" -lcublasLt -lnccl -lz -lpthread -Xlinker -rpath,"$cuda/lib64"
      rm "${objs[@]}" "$dir/$name.ptxas"
    done ;;
  run)
    for exe in "$dir"/attention_rate_*; do
      echo "== ${exe##*/attention_rate_} (fwd min blocks, dKdV sub, min blocks, dQ sub, min blocks)"
      "$exe" "$@"
    done ;;
  *) echo "attention_sweep.sh: unknown mode $mode (build or run)" >&2; exit 2 ;;
esac
