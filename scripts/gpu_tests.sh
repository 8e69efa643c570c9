#!/usr/bin/env bash
# Runs the GPU tests (`pytest -m gpu`: tests/test_gpu_smoke.py and every other gpu-marked test)
# on a Hopper GPU and keeps a log: $OUT/gpu_tests.log when OUT is set, else
# benchmarks/results/gpu_tests.log. Extra arguments go to pytest (e.g. -k norm_matmul, -x).
# Compiling the kernels is most of the time, so the tests run in GPU_TEST_WORKERS pytest-xdist
# processes (default 6) sharing the one GPU, each allowed a slice of its memory and no
# preallocation. Verbose (-v): each test's result is logged as it finishes, so a run cut by a
# time limit still shows which tests passed. Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log_dir="${OUT:-benchmarks/results}"
mkdir -p "$log_dir"
log="$log_dir/gpu_tests.log"
commit="${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
{
  echo "# $(date -u +%FT%TZ) commit $commit"
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
} 2>&1 | tee "$log"
workers="${GPU_TEST_WORKERS:-6}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.14}"
python3 -m pytest -m gpu -v -p no:cacheprovider -n "$workers" --durations=15 "$@" 2>&1 \
  | tee -a "$log"
status=${PIPESTATUS[0]}
echo "# pytest exit status $status" | tee -a "$log"
exit "$status"
