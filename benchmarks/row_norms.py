"""layer_norm in training on one GPU: XLA's autodiff vs the Pallas backward kernel.

    PYTHONPATH=$PWD python3 -m benchmarks.row_norms [--out DIR] [--budget-s S] [--variants]

At the shapes of benchmarks/NOTES.md "Standalone norms" (bf16, grads of x, γ, β), checks the
kernel path's output and gradients against the float32 reference, then times fwd+bwd of both
paths with CUPTI (:func:`benchmarks.timing.measure_us`, median of 10 calls; the forward alone is
XLA's on both paths). ``--variants`` then also times other tilings of the kernel
(``pallas_norm.ops.norms.triton.pick_config`` replaced for the run) at two shapes, within ``--budget-s``. A measurement that fails
is reported and the next one runs. Prints one line per measurement and writes ``row_norms.json`` to ``--out``
(default ``$OUT`` or the working directory) after each one. Only LayerNorm is timed here;
rms_norm's kernel path (recomputed rstd) was measured with session 16's A/B (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_norm as pn
from benchmarks import timing
from pallas_norm import reference
from pallas_norm.ops.norms import triton as row_norm_pallas

SHAPES = [(262144, 2048), (65536, 2048), (262144, 1024), (262144, 512), (262144, 128)]
VARIANT_SHAPES = [(262144, 2048), (262144, 128)]
ITERATIONS = 10
TOLERANCE = 1e-2  # bf16 outputs and gradients vs the float32 reference (norm-relative)


def _op(impl):
  if impl == "reference":
    return reference.layer_norm
  return lambda x, s, b: pn.layer_norm(x, s, b, implementation=impl)


def _fwd_bwd(f):
  def run(*args_ct):
    *args, ct = args_ct
    out, pull = jax.vjp(f, *args)
    return (out, *pull(ct.astype(out.dtype)))
  return run


def _inputs(m, n, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (m, n), jnp.float32).astype(jnp.bfloat16)
  scale = (1 + 0.1 * jax.random.normal(k[1], (n,))).astype(jnp.bfloat16)
  bias = (0.1 * jax.random.normal(k[2], (n,))).astype(jnp.bfloat16)
  ct = jax.random.normal(k[3], (m, n), jnp.float32).astype(jnp.bfloat16)
  return (x, scale, bias), ct


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_and_time(m, n, impl) -> tuple[float, float]:
  """(max norm-relative error of (y, grads) vs the float32 reference, or None when unchecked
  (XLA), median fwd+bwd µs); nothing is timed when the error is over :data:`TOLERANCE`."""
  args, ct = _inputs(m, n)
  fn = jax.jit(_fwd_bwd(_op(impl)))
  err = None
  if impl != "xla":
    got = fn(*args, ct)
    up = [a.astype(jnp.float32) for a in args]
    want = jax.jit(_fwd_bwd(_op("reference")))(*up, ct.astype(jnp.float32))
    err = max(_rel_err(g, w) for g, w in zip(got, want))
    del got, want
    if err > TOLERANCE:
      return err, float("nan")
  return err, timing.median(timing.measure_us(fn, [args + (ct,)], ITERATIONS, "cupti"))


VARIANTS = {
    # name: (elements per step, programs per SM, warps for rows of >= 1024 elements)
    "4k_x8": (4096, 8, 4),
    "16k_x2": (16384, 2, 8),
}


def _variant_config(elements, per_sm, warps):
  def pick(m, n, interpret, kind="layer"):
    cfg = DEFAULT_PICK(m, n, interpret, kind)
    n_pad = 1 << (n - 1).bit_length()
    block_m = max(1, min(64, elements // n_pad))
    programs = per_sm * int(getattr(jax.devices()[0], "core_count", 132))
    programs = max(1, min(programs, -(-m // block_m)))
    num_warps = warps if n_pad >= 1024 else max(4, warps // 2)
    return dataclasses.replace(cfg, block_m=block_m, programs=programs, num_warps=num_warps)
  return pick


DEFAULT_PICK = row_norm_pallas.pick_config


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--budget-s", type=float, default=240.0)
  p.add_argument("--variants", action="store_true")
  args = p.parse_args(argv)
  t_end = time.monotonic() + args.budget_s
  dev = jax.devices()[0]
  results = {"jax": jax.__version__, "device": dev.device_kind, "rows": []}
  path = os.path.join(args.out, "row_norms.json")
  print(f"jax {jax.__version__} {dev.device_kind}", flush=True)

  def attempt(fn, **row):
    try:
      err, us = fn()
    except Exception as e:  # noqa: BLE001  (a kernel that fails to lower or run: keep going)
      return record(**row, status=f"FAILED {type(e).__name__}: {str(e)[:1500]}")
    record(**row, err=None if err is None else f"{err:.2e}", fwd_bwd_us=round(us, 1),
           status="ok" if us == us else "WRONG")

  def record(**row):
    results["rows"].append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(path, "w") as fh:
      json.dump(results, fh, indent=1)

  for m, n in SHAPES:
    if time.monotonic() > t_end:
      break
    for impl in ("triton", "xla"):
      attempt(lambda: check_and_time(m, n, impl), norm="layer", m=m, n=n, impl=impl)
  if args.variants:
    for name, spec in VARIANTS.items():
      row_norm_pallas.pick_config = _variant_config(*spec)
      try:
        for m, n in VARIANT_SHAPES:
          if time.monotonic() > t_end:
            break
          attempt(lambda: check_and_time(m, n, "triton"), norm="layer", m=m, n=n,
                  impl=f"triton[{name}]")
      finally:
        row_norm_pallas.pick_config = DEFAULT_PICK


if __name__ == "__main__":
  main()
