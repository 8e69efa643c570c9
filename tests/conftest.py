"""Shared pytest setup: the `gpu` marker skips unless a Hopper GPU is the default device."""

import gc
import os
import pathlib

# GPU interpret mode runs each warpgroup of a kernel as a concurrent CPU computation that blocks
# on the others; XLA's CPU client runs at most PJRT_NPROC of them at once (default: one per
# core), so on a 2-core CI machine interpret kernels would deadlock. Set before jax starts.
os.environ.setdefault("PJRT_NPROC", "8")

# The suite's programs are tiny and most run once, so XLA:CPU's LLVM optimization costs more
# than it saves: at level 0 (XLA's HLO passes still run; no fast-math at either level) the Kunlun
# model tests and norm_matmul's dx interpret tests took 72 instead of 97 CPU-seconds. Only where
# JAX runs on the CPU alone (the flag would also lower the GPU backend's LLVM level): no NVIDIA
# device node, or JAX_PLATFORMS=cpu. Set before JAX starts; the subprocesses the tests start
# (benchmarks, tests/sharding_checks.py) inherit it.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
_PLATFORMS = os.environ.get("JAX_PLATFORMS")
_CPU_ONLY = _PLATFORMS == "cpu" or (not _PLATFORMS and not os.path.exists("/dev/nvidiactl"))
if _CPU_ONLY and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()

import pytest  # noqa: E402

from pallas_norm import _dispatch  # noqa: E402

# The public ads samples in ../shared/data beside the checkout; PALLAS_NORM_DATA overrides it
# (the tests that read them skip without them).
DATA_DIR = pathlib.Path(os.environ.get(
    "PALLAS_NORM_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))


def pytest_sessionfinish(session, exitstatus):
  """Frees JAX's compiled programs and arrays while the session still runs. Under pytest-xdist a
  worker still busy 5 s after the controller's shutdown message gets a SIGINT from execnet; the
  worker's teardown spent that time collecting JAX garbage, so the SIGINT landed in JAX's
  garbage-collection callback and printed a KeyboardInterrupt traceback after a passing run."""
  del session, exitstatus
  import jax  # noqa: PLC0415
  jax.clear_caches()
  gc.collect()


# Seconds the longest case of each GPU test took on the H200 with 6 workers (pytest's
# --durations of benchmarks/results/logs/2026-12-02_s17_gpu_tests.log; the cluster FNA tests,
# new since, estimated from their compiles). Only an order: the GPU suite's time is mostly
# compiling, so scripts/gpu_tests.sh hands the tests out one by one (--dist load
# --maxschedchunk 1) longest first, and the short ones fill the gaps at the end. Tests not
# listed go after these.
GPU_TEST_SECONDS = {
    "test_gpu_gradients_at_issue_shape": 126,
    "test_gpu_cluster_gradients_at_issue_shape": 100,
    "test_gpu_default_runs_each_use_on_its_path": 72,
    "test_gpu_row_kernel_matches_oracle": 57,
    "test_forward_gpu": 53,
    "test_gpu_benchmark_shape_dense": 52,
    "test_forward_gpu_ring": 50,
    "test_gpu_public_api_gradients": 50,
    "test_push_exchange_gives_pull_bits_gpu": 50,
    "test_backward_gpu": 47,
    "test_gpu_forward_at_issue_shape": 45,
    "test_gpu_cluster_training_form_and_switches": 40,
    "test_gpu_cluster_forward_at_issue_shape": 30,
}


def _gpu_seconds(item) -> float:
  if "gpu" not in item.keywords:
    return 0.0
  return GPU_TEST_SECONDS.get(getattr(item, "originalname", item.name), 0.0)


def pytest_collection_modifyitems(config, items):
  # The `slow` tests (tens of CPU-seconds each) first, and the GPU tests longest first:
  # pytest-xdist hands tests out in this order, so the long ones start early and the short
  # ones fill the gaps, instead of one worker finishing a long test alone at the end. Stable:
  # files keep their order otherwise.
  items.sort(key=lambda item: ("slow" not in item.keywords, -_gpu_seconds(item)))
  if _dispatch.on_hopper_gpu():
    return
  skip_gpu = pytest.mark.skip(reason="needs a Hopper GPU (sm_90a); run `pytest -m gpu` on one")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
  """With PALLAS_NORM_TEST_TIMES set (scripts/gpu_tests.sh sets it), the controller appends each
  test's duration as it finishes ("seconds<TAB>outcome<TAB>test id"), so a run that a time
  limit cuts still says what each finished test cost (pytest's --durations prints only at the
  end). Under pytest-xdist the workers' reports reach the controller's hook too: only the
  controller (no PYTEST_XDIST_WORKER) writes."""
  path = os.environ.get("PALLAS_NORM_TEST_TIMES")
  if not path or "PYTEST_XDIST_WORKER" in os.environ or report.when != "call":
    return
  with open(path, "a") as f:
    f.write(f"{report.duration:.1f}\t{report.outcome}\t{report.nodeid}\n")


@pytest.fixture(scope="session")
def data_dir():
  """The shared ads samples; tests that need them skip when they are absent."""
  if not (DATA_DIR / "taobao_ad_sample").is_dir():
    pytest.skip(f"ads data samples not found under {DATA_DIR}")
  return DATA_DIR
