"""Dev A/B (session 8): the post-norm forward's K loop on the shared ring vs Pallas's pipeline.

``matmul_norm_fwd`` with its default config (Pallas's ``emit_pipeline``: 3 per-tile stages for
y only, 2 chained ones with a residual and h at tile_n = 256) against ``pipeline="ring"``
(chained across row blocks at any stage count), with and without one WGMMA in flight. Each
variant's outputs must equal the default's bit for bit (same WGMMA order, same epilogue); then
CUPTI times at 262144 × K × N, bf16.

    PYTHONPATH=$PWD python3 benchmarks/dev/matmul_norm_ring_ab.py [--shapes MxKxN,...]
        [--cases layer+res+h,layer,rms] [--stages 2,3,4]

``--stages`` adds ring variants with at most that many stages (the multi-tile diagnosis);
``--overlap`` compares the default with ``TileConfig.overlap_norm`` (session 10).
"""
import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_norm.ops import matmul_norm_mgpu as mk

SHAPES = "262144x512x256,262144x512x512,262144x512x1024,262144x512x2048,262144x1024x1024"


def inputs(seed, m, k, n):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
  res = jax.random.normal(ks[2], (m, n), jnp.float32).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks[3], (n,), jnp.float32)
  bias = 0.1 * jax.random.normal(ks[4], (n,), jnp.float32)
  return x, w, res, scale, bias


def fn_for(norm, with_res, outputs, cfg, exchange=None):
  """The kernel's forward; ``outputs``: which of "h", "xhat", "stats" it also writes (the
  training forward writes x̂ and the statistics)."""
  def f(x, w, res, scale, bias):
    y, h, xhat, mean, rstd = mk.matmul_norm_fwd(
        x, w, residual=res if with_res else None, scale=scale,
        bias=bias if norm == "layer" else None, norm=norm, eps=1e-6,
        return_h="h" in outputs, return_xhat="xhat" in outputs,
        return_stats="stats" in outputs, config=cfg, exchange=exchange)
    return y, (h if h is not None else xhat)
  return jax.jit(f)


# name -> (norm, residual?, extra outputs)
CASES = {"layer+res+h": ("layer", True, ("h",)), "layer+res": ("layer", True, ()),
         "layer": ("layer", False, ()), "rms": ("rms", False, ()),
         "layer+res+train": ("layer", True, ("xhat", "stats")),
         "rms+train": ("rms", False, ("xhat", "stats")),
         "layer+res+stats": ("layer", True, ("stats",)), "rms+stats": ("rms", False, ("stats",))}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default=SHAPES)
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--stages", default="", help="extra ring variants: at most this many stages")
  p.add_argument("--exchanges", default="",
                 help="only the default config with these exchanges (e.g. pull,local: what the "
                      "exchange costs; 'local'/'barrier_only' give a wrong y for clusters > 1)")
  p.add_argument("--store-waits", action="store_true",
                 help="only the default config with session 8's store waits, the exact waits "
                      "for the h/x̂ slots, and those plus the residual loads in the K loop")
  p.add_argument("--deferred", action="store_true",
                 help="only the default, 32-wide K steps, and deferred normalization "
                      "(TileConfig.deferred_norm) with and without a WGMMA in flight")
  p.add_argument("--overlap", action="store_true",
                 help="only the default and TileConfig.overlap_norm (session 10; not the same "
                      "bits: y from the centered block in bf16, so the max |difference| is "
                      "printed)")
  args = p.parse_args()
  print(jax.devices(), flush=True)
  records = []
  for shape in args.shapes.split(","):
    M, k, n = map(int, shape.split("x"))
    sets = [inputs(s, M, k, n) for s in (0, 1)]
    for case_name in args.cases.split(","):
      norm, with_res, outputs = CASES[case_name]
      base = mk.pick_config(M, k, n)
      variants = [("default", base),
                  ("ring_dr1", dataclasses.replace(base, pipeline="ring", delay_release=1)),
                  ("ring_dr0", dataclasses.replace(base, pipeline="ring"))]
      variants += [(f"ring_dr0_s{st}", dataclasses.replace(base, pipeline="ring",
                                                           max_concurrent_steps=int(st)))
                   for st in args.stages.split(",") if st]
      if args.exchanges:
        variants = [(f"default_{ex}", base, ex) for ex in args.exchanges.split(",")]
      if args.deferred:  # session 9: TileConfig.deferred_norm (needs 32-wide K steps to fit)
        variants = [("default", base), ("ring_k32", dataclasses.replace(base, tile_k=32)),
                    ("deferred_k32", dataclasses.replace(base, tile_k=32, deferred_norm=True)),
                    ("deferred_k32_dr1", dataclasses.replace(base, tile_k=32, deferred_norm=True,
                                                             delay_release=1))]
      if args.overlap:  # session 10: normalization between the next K loop's WGMMAs
        variants = [("default", base),
                    ("overlap", dataclasses.replace(base, overlap_norm=True))]
      if args.store_waits:  # session 9: session 8's store waits first, then the new ones
        variants = [("s8_waits", base, None, (False, False)),
                    ("exact_extra_waits", base, None, (True, False)),
                    ("both", base, None, (True, True))]
      ref = None
      for label, cfg, *rest in variants:
        exchange = rest[:1]
        exact, in_loop = rest[1] if len(rest) > 1 else (True, True)
        mk._StoreGroups.exact, mk.RESIDUAL_IN_K_LOOP = exact, in_loop
        case = f"{M}x{k}x{n} {case_name} {label}"
        try:
          fn = fn_for(norm, with_res, outputs, cfg, *exchange)
          y, h = fn(*sets[0])
          if ref is None:
            ref = (np.asarray(y.astype(jnp.float32)),
                   None if h is None else np.asarray(h.astype(jnp.float32)))
            same = True
          else:
            y32 = np.asarray(y.astype(jnp.float32))
            same = bool(np.array_equal(ref[0], y32) and (
                h is None or np.array_equal(ref[1], np.asarray(h.astype(jnp.float32)))))
            if not same:
              print(f"{case}: max |y - default y| = {np.max(np.abs(y32 - ref[0])):.3g}",
                    flush=True)
          us = timing.median(timing.measure_us(fn, sets, 10, "cupti"))
        except Exception as e:  # noqa: BLE001
          print(f"{case}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          records.append({"case": case, "error": str(e)[:300]})
          continue
        vecs = ("scale", "bias") if norm == "layer" else ("scale",)
        plan = mk._make_plan((M, k), n, jnp.bfloat16, jnp.bfloat16, norm, 1e-6, vecs, with_res,
                             "h" in outputs, "xhat" in outputs, "stats" in outputs, cfg, False,
                             False, *exchange)
        print(f"{case:<44} {us:8.1f} us  same bits as default: {same}  stages {plan.stages}"
              f" chained {plan.chained} n_tiles {plan.n_tiles}", flush=True)
        records.append({"case": case, "us": us, "same_bits": same, "stages": plan.stages,
                        "config": dataclasses.asdict(cfg)})
  if out := os.environ.get("OUT"):
    with open(os.path.join(out, "matmul_norm_ring_ab.json"), "w") as f:
      json.dump({"device": str(jax.devices()[0]), "commit": os.environ.get("GIT_COMMIT"),
                 "records": records}, f, indent=1)


if __name__ == "__main__":
  main()
