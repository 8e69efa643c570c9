"""GPU smoke tests, selected by ``pytest -m gpu`` (``scripts/gpu_tests.sh``); skipped on the CPU.

At real sizes on the H200, each public op, forward and forward+backward, with the default
``implementation=None`` and with ``"mosaic"`` where a kernel exists, matches the float32 oracle
(:mod:`pallas_norm.reference` on upcast inputs) within a relative Frobenius error of 2e-2 (bf16
inputs and outputs). Interpret mode runs kernels synchronously, so it cannot catch asynchrony
hazards: these tests can. They reuse the benchmark's inputs (random normal, never zeros) and
oracle check. The last tests run the CUPTI timer and the benchmark pipeline at tiny shapes, so a
broken timer shows up before the (longer) benchmark run.
"""

import jax
import pytest

from benchmarks import cases, run, timing  # pytest's pythonpath has the repo root

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-2


def _mkn(m, k, n):
  return (("M", m), ("K", k), ("N", n))


_ATTN = (("B", 64), ("H", 4), ("L", 512), ("D", 128), ("KV", 128))
_SHAPES = [
    ("norm_matmul", "rms", _mkn(8192, 1024, 1024)),
    ("norm_matmul", "layer", _mkn(8192, 1024, 1024)),
    ("matmul_norm", "layer+res", _mkn(8192, 1024, 1024)),
    ("matmul_norm", "rms", _mkn(8192, 1024, 1024)),
    ("matmul_norm", "layer+res", _mkn(8192, 512, 4096)),  # N beyond one CTA tile row
    ("gdpa", "", _ATTN),
    ("flash_norm_attention", "", _ATTN),
    ("rms_norm", "", (("M", 8192), ("N", 4096))),
    ("layer_norm", "", (("M", 8192), ("N", 4096))),
]
SMOKE_CASES = [cases.Case(op, variant, dims, mode)
               for mode in cases.MODES for op, variant, dims in _SHAPES]


def _error_vs_oracle(case, impl):
  prob = cases.build(case)
  make, _ = run.input_maker(prob, case.mode, host=False)
  inputs = make(1234)
  fn = jax.jit(run.with_mode(prob.impl_fn(impl), prob.diff, case.mode))
  check = run.checker(run.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True))
  return run.rel_err(check(fn(*inputs), *inputs))


@pytest.mark.parametrize("case", SMOKE_CASES, ids=lambda c: c.name)
def test_default_implementation_matches_oracle(case):
  err = _error_vs_oracle(case, "auto")
  assert 0 < err < TOLERANCE, f"{case.name}: rel. error {err:.3g}"


@pytest.mark.parametrize("case", SMOKE_CASES, ids=lambda c: c.name)
def test_mosaic_kernel_matches_oracle(case):
  try:
    err = _error_vs_oracle(case, "mosaic")
  except NotImplementedError as e:
    pytest.skip(f"no Mosaic kernel for this call: {e}")
  assert 0 < err < TOLERANCE, f"{case.name}: rel. error {err:.3g}"


def test_cupti_timer_measures_kernel_time():
  assert timing.default_timer() == "cupti"
  rand = cases.HostRandom(0)
  sets = [(rand((4096, 4096)),), (rand((4096, 4096)),)]
  fn = jax.jit(lambda a: a * 2)
  times = timing.measure_us(fn, sets, 5, "cupti")
  # A 32 MB read + 32 MB write takes microseconds, not the milliseconds of a host round trip.
  assert len(times) == 5 and all(0 < t < 1000 for t in times), times


def test_benchmark_pipeline_runs_with_cupti(tmp_path):
  results = run.main(["--tiny", "--quick", "--only", r"norm_matmul/rms/.*/fwd$", "--no-e2e",
                      "--no-plot", "--results-dir", str(tmp_path), "--iterations", "3"])
  assert results["timer"] == "cupti"
  assert results["ceilings"]["copy_GBps"] > 0 and results["ceilings"]["gemm_TFLOPs"] > 0
  xla = next(r for r in results["rows"] if r["op"] == "norm_matmul" and r["impl"] == "xla")
  assert xla["status"] == "ok" and xla["time_us"] > 0 and len(xla["times_us"]) == 3
  assert xla["ratio_limit"] is not None
  assert all(r["status"] != "error" for r in results["rows"]), results["rows"]
