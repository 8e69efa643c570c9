#!/usr/bin/env bash
# Runs the GPU tests (`pytest -m gpu`: tests/test_gpu_smoke.py and every other gpu-marked test)
# on a Hopper GPU and keeps a log: $OUT/gpu_tests.log when OUT is set, else
# benchmarks/results/gpu_tests.log. Extra arguments go to pytest (e.g. -k norm_matmul, -x).
# Compiling the kernels is most of the time, so the tests run in GPU_TEST_WORKERS pytest-xdist
# processes (default 6; 4 on a GPU of less than 100 GB) sharing the one GPU, each allowed an
# equal slice of 84% of its memory
# and no preallocation, handed out one by one longest first (--dist load --maxschedchunk 1:
# pyproject's addopts say --dist worksteal, under which --maxschedchunk did nothing; and
# tests/conftest.py's order): xdist's default queues a batch of consecutive tests per worker,
# which left the FNA file's long compiles to one worker at the end. XLA's GEMM autotuning is
# off (--xla_gpu_autotune_level=0): the tests check values, not speed, and autotuning
# compiles and times candidate GEMMs of every oracle and XLA program. Verbose (-v): each
# test's result is logged as it finishes, and its duration appended to gpu_test_times.tsv
# beside the log, so a run cut by a time limit still shows which tests passed and what they
# cost. Exit status: pytest's.
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
# 6 workers on an H200 (141 GB); 4 on an H100 (80 GB), where two tests (the GDPA backward at
# its benchmark shape, the FNA cluster forward at H = 8) ran out of a sixth of its memory.
gpu_mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null |
  head -1)"
default_workers=6
if [ -n "$gpu_mib" ] && [ "$gpu_mib" -lt 100000 ]; then default_workers=4; fi
workers="${GPU_TEST_WORKERS:-$default_workers}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(
  python3 -c "print(round(0.84 / max(1, $workers), 3))")}"
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0"
export PALLAS_NORM_TEST_TIMES="$log_dir/gpu_test_times.tsv"
: > "$PALLAS_NORM_TEST_TIMES"
python3 -m pytest -m gpu -v -p no:cacheprovider -n "$workers" --dist load --maxschedchunk 1 \
  --durations=30 "$@" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
echo "# pytest exit status $status" | tee -a "$log"
exit "$status"
