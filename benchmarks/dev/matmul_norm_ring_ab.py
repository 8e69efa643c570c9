"""Dev A/B (session 8): the post-norm forward's K loop on the shared ring vs Pallas's pipeline.

``matmul_norm_fwd`` with its default config (Pallas's ``emit_pipeline``: 3 per-tile stages for
y only, 2 chained ones with a residual and h at tile_n = 256) against ``pipeline="ring"``
(chained across row blocks at any stage count), with and without one WGMMA in flight. Each
variant's outputs must equal the default's bit for bit (same WGMMA order, same epilogue); then
CUPTI times at 262144 × K × N, bf16.

    PYTHONPATH=$PWD python3 benchmarks/dev/matmul_norm_ring_ab.py
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_norm.ops import matmul_norm_mgpu as mk

M = 262144
SHAPES = [(512, 256), (512, 512), (512, 1024), (512, 2048), (1024, 1024)]


def inputs(seed, k, n):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (M, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
  res = jax.random.normal(ks[2], (M, n), jnp.float32).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks[3], (n,), jnp.float32)
  bias = 0.1 * jax.random.normal(ks[4], (n,), jnp.float32)
  return x, w, res, scale, bias


def fn_for(norm, with_res, cfg):
  def f(x, w, res, scale, bias):
    return mk.matmul_norm_fwd(x, w, residual=res if with_res else None, scale=scale,
                              bias=bias if norm == "layer" else None, norm=norm, eps=1e-6,
                              return_h=with_res, config=cfg)[:2]
  return jax.jit(f)


def main():
  print(jax.devices(), flush=True)
  records = []
  for k, n in SHAPES:
    sets = [inputs(s, k, n) for s in (0, 1)]
    for norm, with_res in (("layer", True), ("layer", False), ("rms", False)):
      base = mk.pick_config(M, k, n)
      variants = [("default", base),
                  ("ring_dr1", dataclasses.replace(base, pipeline="ring", delay_release=1)),
                  ("ring_dr0", dataclasses.replace(base, pipeline="ring"))]
      ref = None
      for label, cfg in variants:
        case = f"{M}x{k}x{n} {norm}{'+res+h' if with_res else ''} {label}"
        try:
          fn = fn_for(norm, with_res, cfg)
          y, h = fn(*sets[0])
          if ref is None:
            ref = (np.asarray(y.astype(jnp.float32)),
                   None if h is None else np.asarray(h.astype(jnp.float32)))
            same = True
          else:
            same = bool(np.array_equal(ref[0], np.asarray(y.astype(jnp.float32))) and (
                h is None or np.array_equal(ref[1], np.asarray(h.astype(jnp.float32)))))
          us = timing.median(timing.measure_us(fn, sets, 10, "cupti"))
        except Exception as e:  # noqa: BLE001
          print(f"{case}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          records.append({"case": case, "error": str(e)[:300]})
          continue
        print(f"{case:<44} {us:8.1f} us  same bits as default: {same}", flush=True)
        records.append({"case": case, "us": us, "same_bits": same,
                        "config": dataclasses.asdict(cfg)})
  if out := os.environ.get("OUT"):
    with open(os.path.join(out, "matmul_norm_ring_ab.json"), "w") as f:
      json.dump({"device": str(jax.devices()[0]), "commit": os.environ.get("GIT_COMMIT"),
                 "records": records}, f, indent=1)


if __name__ == "__main__":
  main()
