#!/usr/bin/env bash
# Issue 19's train-step measurement (python -m benchmarks.e2e, the production config) on one GPU,
# with a log: $OUT/train_step.log and $OUT/train_step.json when OUT is set, else under
# benchmarks/results/. Extra arguments go to benchmarks.e2e (e.g. --samples 30 --no-step).
#
# Compiling is most of the call (152 s for four whole-step programs on the H200), and
# XLA's GEMM autotuning is the suspect. XLA_AUTOTUNE_CACHE=DIR keeps XLA's per-fusion autotuning
# results in DIR (read and written), and AUTOTUNE_TAR=FILE packs DIR into FILE at the end (and
# unpacks FILE into DIR first, when it exists), so a second call on the same code can reuse the
# first's autotuning: carry the tar file back in. Untried so far. Exit status: the harness's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
log="$out_dir/train_step.log"
cache="${XLA_AUTOTUNE_CACHE:-}"
tar_file="${AUTOTUNE_TAR:-}"
if [[ -n "$cache" ]]; then
  mkdir -p "$cache"
  [[ -n "$tar_file" && -f "$tar_file" ]] && tar -xf "$tar_file" -C "$cache"
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$cache"
fi
{
  echo "# $(date -u +%FT%TZ) commit ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
} 2>&1 | tee "$log"
python3 -m benchmarks.e2e --out "$out_dir/train_step.json" "$@" 2>&1 \
  | grep --line-buffered -v '^WARNING\|^[IW]0000' | tee -a "$log"
status=${PIPESTATUS[0]}
if [[ -n "$cache" && -n "$tar_file" ]]; then
  tar -cf "$tar_file" -C "$cache" . && echo "# autotune cache: $(du -h "$tar_file" | cut -f1)" | tee -a "$log"
fi
echo "# exit status $status" | tee -a "$log"
exit "$status"
