#!/usr/bin/env bash
# The GPU runs prepared in session 3 for the opt-in kernel options (TileConfig.pingpong,
# TileConfig.delay_release, matmul_norm's exchange="push"), in two device calls of < 10 min:
#
#   scripts/gpu_experiments.sh tests    # their GPU tests (correctness first), ~3 min
#   scripts/gpu_experiments.sh timing   # post-norm grid sweep + pre-norm/dx variants, ~8 min
#   scripts/gpu_experiments.sh rows     # session 4: fused dx row terms on/off, suite subset
#   scripts/gpu_experiments.sh dys      # norm_matmul.DX_WRITES_DY_SCALED (session 5: slower)
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
  rows)
    # Session 4: the public API's fwd+bwd with dx's row terms fused (the default up to K, N <=
    # 512) against the XLA row-terms pass, same run, seed shape; then the suite's cases that
    # the session's defaults change (push exchange at clusters of 2, fused row terms) and the
    # Kunlun train step.
    for fused in True False; do
      OUT="$out" timeout 150 python3 -c "import sys, runpy
import pallas_norm.ops.norm_matmul as nm
nm.FUSED_ROW_TERMS = $fused
sys.argv = ['gpu_norm_matmul_check.py', '--sections', 'train', '--quick',
            '--json-name', 'train_fused_rows_$fused.json']
runpy.run_path('benchmarks/gpu_norm_matmul_check.py', run_name='__main__')" \
        2>&1 | grep -v "Delay kernel" | tee "$out/train_fused_rows_$fused.log" || status=$?
    done
    timeout 330 python3 -m benchmarks.run --budget-s 240 --tag nvidia-h200-s4-subset \
      --only "(norm_matmul|matmul_norm)/[a-z+]+/262144x(128x128|512x512)/|train_step" \
      2>&1 | grep -v "Delay kernel" | tee "$out/suite_subset.log" || status=$?
    ;;
  dys)
    # The dx kernel writing dy_scaled = rstd ⊙ dy for the weight gradients (return_dy_scaled,
    # norm_matmul.DX_WRITES_DY_SCALED, off by default): its GPU tests (bit-exact dy_scaled and
    # dx), then the A/B at the seed shape: the train section's public-API fwd+bwd with the
    # switch off and on and the backward's parts, then the dx section's *+dys* rows.
    GPU_TEST_WORKERS="${GPU_TEST_WORKERS:-8}" OUT="$out" timeout 300 \
      scripts/gpu_tests.sh -k "dy_scaled" || status=$?
    for section in train dx; do
      OUT="$out" timeout 280 python3 benchmarks/gpu_norm_matmul_check.py --sections "$section" \
        --quick --budget-s 240 --json-name "norm_matmul_dys_$section.json" \
        2>&1 | grep -v "Delay kernel" | tee "$out/norm_matmul_dys_$section.log" || status=$?
    done
    ;;
  *)
    echo "usage: $0 tests|timing|rows|dys" >&2
    exit 2
    ;;
esac
exit "$status"
