#!/usr/bin/env bash
# The GPU runs prepared in session 3 for the opt-in kernel options (TileConfig.pingpong,
# TileConfig.delay_release, matmul_norm's exchange="push"), in two device calls of < 10 min:
#
#   scripts/gpu_experiments.sh tests    # their GPU tests (correctness first), ~3 min
#   scripts/gpu_experiments.sh timing   # post-norm grid sweep + pre-norm/dx variants, ~8 min
#
# Logs and JSON go to $OUT when set (else benchmarks/results/dev/). What the results decide is
# in benchmarks/NOTES.md ("Next measurements"). Exit status: the last failing step's, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results/dev}"
mkdir -p "$out"
status=0
case "${1:-}" in
  tests)
    GPU_TEST_WORKERS="${GPU_TEST_WORKERS:-8}" OUT="$out" timeout 420 \
      scripts/gpu_tests.sh -k "pingpong or delay_release or push" || status=$?
    ;;
  timing)
    OUT="$out" timeout 260 python3 benchmarks/gpu_matmul_norm_check.py --grid-sweep \
      2>&1 | grep -v "Delay kernel" | tee "$out/matmul_norm_options.log" || status=$?
    OUT="$out" timeout 280 python3 benchmarks/gpu_norm_matmul_check.py --sections variants,dx \
      --quick --budget-s 240 --json-name norm_matmul_options.json \
      2>&1 | grep -v "Delay kernel" | tee "$out/norm_matmul_options.log" || status=$?
    ;;
  *)
    echo "usage: $0 tests|timing" >&2
    exit 2
    ;;
esac
exit "$status"
