"""A/B of the pre-norm backward's routes in one process (issue 22).

``norm_matmul``'s kernel backward takes its decisions from :mod:`pallas_norm.ops.norm_matmul.configs`:
where dW_γ's operand comes from (``x_hat_pays``: x̂ written by the dx kernel, or ``rstd ⊙ dy``
scaled by XLA; the latter for RMSNorm only), where dx's row terms come from
(``fused_row_terms_pay``: the dx kernel's K loop, or an XLA pass over dy and y) and, with a
norm bias, where Σ_i dy_i comes from (``ones_column_pays``: x̂'s ones column in dW_γ's GEMM, or
an XLA column reduction). This times the
public fwd+bwd (the suite's wrapper, inputs and cotangent, ``implementation="mosaic"``) under
each route, same process, same inputs, and checks every route's outputs against the first
route's (relative Frobenius < 2e-2). Wall clock of back-to-back calls (the LayerNorm cases have
a bias, whose guard's ``lax.cond`` CUPTI cannot attribute): median of 3 batches. Run on a GPU
from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.prenorm_bwd_routes [--tiny]

``--tiny``: CPU-sized shapes in interpret mode (a smoke test of the code path). JSON to
``$OUT/prenorm_bwd_routes.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import cases as C
from benchmarks import run
from benchmarks import timing
from pallas_norm.ops.norm_matmul import configs

_DEFAULTS = (configs.x_hat_pays, configs.fused_row_terms_pay, configs.ones_column_pays)

# route name -> (x_hat_pays, fused_row_terms_pay, ones_column_pays) replacements (None: the
# default rule)
ROUTES = {
    "default": (None, None, None),
    # RMSNorm's weight gradients from XLA's scaled dy (main's route at K = N)
    "scaled_dy": (lambda k, n, norm: norm == "layer", None, None),
    # the row terms in the dx kernel wherever a row block has at most 2 column tiles (K <= 512),
    # for both norms: the fused path measured faster at 512² with 2 column tiles, slower with 8
    "fused_k512": (None, lambda k, n, norm: k <= 512, None),
    # Σ_i dy_i (norm bias) from XLA's column reduction instead of x̂'s ones column in the GEMM
    "no_ones_column": (None, None, lambda k, n: False),
}

# (norm, M, K, N, routes): the routes that differ from the default at that shape
CASES = (
    ("layer", 262144, 512, 512, ("default", "no_ones_column")),
    ("rms", 262144, 512, 512, ("default", "scaled_dy", "fused_k512")),
    ("layer", 262144, 512, 2048, ("default", "fused_k512", "no_ones_column")),
)
TINY_CASES = (("rms", 256, 128, 128, ("default", "scaled_dy", "fused_k512")),
              ("layer", 256, 128, 256, ("default", "fused_k512", "no_ones_column")))


def _set_route(route: str) -> None:
  rules = [rule or default for rule, default in zip(ROUTES[route], _DEFAULTS)]
  configs.x_hat_pays, configs.fused_row_terms_pay, configs.ones_column_pays = rules


def _rel(a, b) -> float:
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def time_case(norm, m, k, n, routes, tiny: bool, iterations: int) -> dict:
  case = C.Case("norm_matmul", norm, (("M", m), ("K", k), ("N", n)), "fwd+bwd")
  kernel = "interpret" if tiny else "mosaic"
  prob = C.build(case, kernel)
  inputs = (run.make_inputs(prob, case.mode, C.HostRandom(1)) if tiny else
            jax.jit(lambda key: run.make_inputs(prob, case.mode, C.DeviceRandom(key)))(
                jax.random.key(1)))
  out, first = {}, None
  for route in routes:
    _set_route(route)  # read when the backward is traced, so each route gets its own jit
    try:
      fn = jax.jit(run.with_mode(prob.impl_fn(kernel), prob.diff, case.mode))
      t0 = time.perf_counter()
      got = jax.block_until_ready(fn(*inputs))
      compile_s = time.perf_counter() - t0
      first = got if first is None else first
      err = max(_rel(g, f) for g, f in zip(jax.tree.leaves(got), jax.tree.leaves(first)))
      us = (timing.batched_wall_us(fn, [inputs], 1 if tiny else iterations, 1 if tiny else 3))
      out[route] = dict(us=statistics.median(us), runs=us, rel_err_vs_first=err,
                        compile_s=compile_s, ok=err < 2e-2)
    except Exception as e:  # noqa: BLE001  one failing route must not hide the others
      out[route] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
      _set_route("default")
    print(f"{case.name} {route}: {out[route]}", flush=True)
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--iterations", type=int, default=20)
  args = parser.parse_args()
  print(f"{jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
  results = {f"{norm}/{m}x{k}x{n}": time_case(norm, m, k, n, routes, args.tiny, args.iterations)
             for norm, m, k, n, routes in (TINY_CASES if args.tiny else CASES)}
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "prenorm_bwd_routes.json"), "w") as f:
      json.dump(results, f, indent=1)
  bad = [f"{c}/{r}" for c, by_route in results.items() for r, v in by_route.items()
         if not v.get("ok")]
  if bad:
    print("FAILED or wrong:", ", ".join(bad), flush=True)
  return 3 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
