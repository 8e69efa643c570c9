"""Per-kernel CUPTI breakdown of suite cases: which kernels a case launches and what each costs.

The suite (:mod:`benchmarks.run`) times a case's whole program; this lists its kernels, the
median time of each over ``--iterations`` runs, and their sum, for each implementation, with
the same inputs and the same fwd / fwd+bwd wrapper as the suite. It answers "where does our
forward+backward lose to XLA's?" without a profiler GUI. Run on a GPU from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.breakdown --only "matmul_norm/rms/262144x512x512/fwd\\+bwd"

Kernel names are XLA's fusion names (``loop_multiply_fusion``, ``input_reduce_fusion``...),
cuBLAS's (``sm90_xmma_gemm_...``) and ours (``mosaic_gpu_...``). JSON to
``$OUT/breakdown.json`` when OUT is set. ``--tiny`` runs CPU-sized shapes with the wall clock
(a smoke test of the code path: there is no per-kernel time on the CPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys

import jax

import benchmarks
from benchmarks import cases as C
from benchmarks import run
from benchmarks import timing


def per_kernel_us(fn, args, iterations: int) -> list[tuple[str, float]]:
  """(kernel name, median µs) in launch order; a name launched k times per call appears as
  ``name#i`` for its i-th launch."""
  from jax.experimental.mosaic.gpu import profiler
  try:
    _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
  except RuntimeError as e:
    if "not consistent" in str(e):
      raise timing.KernelOrderError(str(e)) from e
    raise
  if runs is None:
    raise RuntimeError("no kernel launched")
  if iterations == 1:
    runs = [runs]
  per_launch = collections.defaultdict(list)
  order = []
  for kernels in runs:
    seen = collections.Counter()
    for name, ms in kernels:
      key = f"{name}#{seen[name]}" if seen[name] else name
      seen[name] += 1
      if key not in per_launch:
        order.append(key)
      per_launch[key].append(ms * 1e3)
  return [(k, statistics.median(per_launch[k])) for k in order]


def breakdown(case: C.Case, impls: list[str], iterations: int, tiny: bool) -> dict:
  prob = C.build(case, "interpret" if tiny else "mosaic")
  rand = C.HostRandom(1) if tiny else None
  inputs = (run.make_inputs(prob, case.mode, rand) if tiny else
            jax.jit(lambda key: run.make_inputs(prob, case.mode, C.DeviceRandom(key)))(
                jax.random.key(1)))
  out = {}
  for impl in impls:
    try:
      fn = jax.jit(run.with_mode(prob.impl_fn(impl), prob.diff, case.mode))
      if tiny:
        jax.block_until_ready(fn(*inputs))
        kernels = [("(wall clock, whole program)", 0.0)]
      else:
        kernels = per_kernel_us(fn, inputs, iterations)
    except Exception as e:  # noqa: BLE001  keep going: one failing impl must not hide the other
      print(f"  {impl}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      out[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      continue
    total = sum(us for _, us in kernels)
    print(f"  {impl}: {len(kernels)} kernels, {total:.1f} µs", flush=True)
    for name, us in kernels:
      print(f"    {us:9.1f}  {name[:110]}", flush=True)
    out[impl] = {"total_us": round(total, 1),
                 "kernels": [[name, round(us, 2)] for name, us in kernels]}
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.breakdown",
                              description=__doc__.split("\n")[0])
  p.add_argument("--only", required=True, metavar="RE", help="cases, as benchmarks.run --list")
  p.add_argument("--impls", default="xla,mosaic", metavar="A,B")
  p.add_argument("--iterations", type=int, default=5)
  p.add_argument("--tiny", action="store_true", help="CPU-sized shapes, interpret mode")
  args = p.parse_args(argv)
  # Checked before anything runs: a bad regex and an unknown implementation raised tracebacks,
  # and full-size cases on a CPU allocated their inputs and exited 0 with every
  # implementation FAILED (CUPTI is GPU-only).
  try:
    re.compile(args.only)
  except re.error as e:
    p.error(f"--only: invalid regular expression {args.only!r}: {e}")
  if args.iterations < 1:
    p.error(f"--iterations must be >= 1, got {args.iterations}")
  impls = [i for i in args.impls.split(",") if i]
  if args.tiny:
    impls = ["interpret" if i == "mosaic" else i for i in impls]
  if unknown := sorted(set(impls) - set(C.known_impls())) or ([] if impls else ["(none)"]):
    p.error(f"--impls: unknown implementation(s) {unknown}; known: {list(C.known_impls())}")
  if not args.tiny and jax.default_backend() != "gpu":
    p.error("full-size cases need a GPU for their CUPTI times (the default JAX backend is "
            f"{jax.default_backend()!r}); on a CPU pass --tiny")
  if (out_dir := os.environ.get("OUT")) and (reason := benchmarks.unwritable_reason(out_dir)):
    p.error(f"$OUT: {reason}")
  selected = C.select(C.all_cases(), quick=False, only=args.only, tiny_shapes=args.tiny)
  if not selected:
    p.error(f"--only {args.only!r} selects no case")
  report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "cases": {}}
  for case in selected:
    print(f"{case.name}:", flush=True)
    report["cases"][case.name] = breakdown(case, impls, args.iterations, args.tiny)
  if out_dir := os.environ.get("OUT"):
    with open(os.path.join(out_dir, "breakdown.json"), "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
