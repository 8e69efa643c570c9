"""Shared pytest setup: the `gpu` marker skips unless a Hopper GPU is the default device."""

import gc
import os
import pathlib

# GPU interpret mode runs each warpgroup of a kernel as a concurrent CPU computation that blocks
# on the others; XLA's CPU client runs at most PJRT_NPROC of them at once (default: one per
# core), so on a 2-core CI machine interpret kernels would deadlock. Set before jax starts.
os.environ.setdefault("PJRT_NPROC", "8")

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


def pytest_collection_modifyitems(config, items):
  if _dispatch.on_hopper_gpu():
    return
  skip_gpu = pytest.mark.skip(reason="needs a Hopper GPU (sm_90a); run `pytest -m gpu` on one")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def data_dir():
  """The shared ads samples; tests that need them skip when they are absent."""
  if not (DATA_DIR / "taobao_ad_sample").is_dir():
    pytest.skip(f"ads data samples not found under {DATA_DIR}")
  return DATA_DIR
