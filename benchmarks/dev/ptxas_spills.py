"""Dev diagnostic (session 8): registers and spills of the forward kernels as ptxas reports them.

Compiles (and runs once) the pre-norm forward (GEMM, RMSNorm, LayerNorm; default config and
LayerNorm with statistics in every K loop) and the post-norm forward at 262144×512², with
Mosaic GPU's dumps on (``MOSAIC_GPU_DUMP_TO``, set by this script before JAX loads), then
prints each kernel's ptxas lines about registers, spills and stack. Question: does LayerNorm's
extra cost over RMSNorm (~10% of the pre-norm forward) come from spilled registers?

    PYTHONPATH=$PWD python3 benchmarks/dev/ptxas_spills.py [--multi-tile]  # $OUT/mgpu_dump

``--multi-tile``: instead, the post-norm forward with 2 N tiles per CTA (32768×4096×4096,
LayerNorm y only and RMSNorm) on Pallas's pipeline and on the shared ring with 3 and 2 stages,
with and without a WGMMA in flight: session 8 measured the 3-stage ring 3-4× slower there with
the same bits, and a reviewer's hypothesis is spills in the ring's consumer K loop.
``--overlap``: the post-norm forward with and without ``TileConfig.overlap_norm`` (session 10).
"""
import os
import re
import sys

DUMP = os.path.join(os.environ.get("OUT", "/tmp"), "mgpu_dump")
os.makedirs(DUMP, exist_ok=True)
os.environ["MOSAIC_GPU_DUMP_TO"] = DUMP

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_norm.ops import matmul_norm_mgpu as mnk  # noqa: E402
from pallas_norm.ops import norm_matmul_mgpu as nmk  # noqa: E402

M, K, N = 262144, 512, 512


def cases():
  base = nmk.pick_config(M, K, N)
  every_loop = dataclasses.replace(base, stats_once=False)
  for label, norm, cfg in (("pre_gemm", "none", base), ("pre_rms", "rms", base),
                           ("pre_ln", "layer", base), ("pre_ln_every_loop", "layer", every_loop),
                           ("pre_ln_pallas", "layer", dataclasses.replace(
                               base, pipeline="pallas", delay_release=0))):
    def fn(x, w, c, norm=norm, cfg=cfg):
      return nmk.norm_matmul_fwd(x, w, c if norm == "layer" else None, None, norm=norm,
                                 eps=1e-6, out_dtype=jnp.bfloat16, config=cfg)
    yield label, fn
  for n in (512, 1024):
    yield f"post_ln_{n}", lambda x, w, c, n=n: mnk.matmul_norm_fwd(
        x, w[:, :1] * jnp.ones((1, n), w.dtype), norm="layer", eps=1e-6)


def multi_tile_cases():
  m, k, n = MULTI_TILE_SHAPE
  base = mnk.pick_config(m, k, n)
  for norm in ("layer", "rms"):
    for label, cfg in (("pallas", base),
                       ("ring3_d0", dataclasses.replace(base, pipeline="ring")),
                       ("ring3_d1", dataclasses.replace(base, pipeline="ring", delay_release=1)),
                       ("ring2_d0", dataclasses.replace(base, pipeline="ring",
                                                        max_concurrent_steps=2))):
      yield f"post_{norm}_2tiles_{label}", lambda x, w, c, norm=norm, cfg=cfg: (
          mnk.matmul_norm_fwd(x, w, scale=c, bias=c if norm == "layer" else None, norm=norm,
                              eps=1e-6, config=cfg))


MULTI_TILE_SHAPE = (32768, 4096, 4096)


def overlap_cases():
  """Session 10: the post-norm forward (LayerNorm + residual, N = 2048, clusters of 8) with the
  default epilogue and with ``TileConfig.overlap_norm``, whose consumers hold the accumulator
  and the waiting block (64 more registers) during the K loop."""
  m, k, n = OVERLAP_SHAPE
  base = mnk.pick_config(m, k, n)
  for label, cfg in (("default", base),
                     ("overlap", dataclasses.replace(base, overlap_norm=True))):
    for norm in ("layer", "rms"):
      yield f"post_{norm}_res_{label}", lambda x, w, c, norm=norm, cfg=cfg: mnk.matmul_norm_fwd(
          x, w, residual=jnp.ones((m, n), jnp.bfloat16), scale=c,
          bias=c if norm == "layer" else None, norm=norm, eps=1e-6, config=cfg)


OVERLAP_SHAPE = (262144, 512, 2048)


def main():
  multi = "--multi-tile" in sys.argv[1:]
  overlap = "--overlap" in sys.argv[1:]
  m, k, n = MULTI_TILE_SHAPE if multi else OVERLAP_SHAPE if overlap else (M, K, N)
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16) / k
  c = jnp.ones((n,), jnp.float32)
  for label, fn in (multi_tile_cases() if multi else overlap_cases() if overlap else cases()):
    before = set(os.listdir(DUMP))
    try:
      jax.block_until_ready(jax.jit(fn)(x, w, c))
    except Exception as e:  # noqa: BLE001
      print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    new = sorted(set(os.listdir(DUMP)) - before)
    print(f"\n== {label}: {len(new)} new dump files", flush=True)
    for name in new:
      path = os.path.join(DUMP, name)
      if not os.path.isfile(path):
        continue
      text = open(path, errors="replace").read()
      lines = [l for l in text.splitlines()
               if re.search(r"spill|registers|stack frame|Used \d+", l, re.I)]
      sass = name.endswith(".sass") or "sass" in name
      stl = len(re.findall(r"\bSTL\b", text)) if sass else None
      ldl = len(re.findall(r"\bLDL\b", text)) if sass else None
      if lines or stl:
        print(f"  {name}: " + " | ".join(l.strip() for l in lines[:6])
              + (f"  [SASS: {stl} STL, {ldl} LDL]" if sass else ""), flush=True)
  print("\ndump files:", sorted(os.listdir(DUMP))[:40], file=sys.stderr)


if __name__ == "__main__":
  main()
