"""Times the GDPA backward kernels at the issue's shape on a Hopper GPU (CUPTI), each variant
checked against the float32 reference first. Prints; commits nothing.

Shape: B=768, H=4, q lengths uniform on [1, 512] (density ~0.5), D=128, dense k/v Lkv=128,
fast_gelu, bfloat16; three input sets rotated (each ~600 MB, far above the 60 MB L2).
Variants: the default (dQ fused into the dK/dV kernel at this shape) with Python-float and with
traced array scales, and the two-kernel path (dK/dV, then dQ) forced by patching the plan.

    PYTHONPATH=$PWD python benchmarks/dev/gdpa_bwd_gpu.py [--iterations 20] [--ptxas]

``--ptxas``: also prints ptxas's register / spill lines of every Mosaic kernel compiled (Mosaic
GPU's dumps, ``MOSAIC_GPU_DUMP_TO=$OUT/mgpu_dump``, set before JAX loads).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

if "--ptxas" in sys.argv:
  DUMP = os.path.join(os.environ.get("OUT", "/tmp"), "mgpu_dump")
  os.makedirs(DUMP, exist_ok=True)
  os.environ["MOSAIC_GPU_DUMP_TO"] = DUMP

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import timing  # noqa: E402
from pallas_norm import reference  # noqa: E402
from pallas_norm.ops import gdpa_bwd_mgpu as gb  # noqa: E402

B, H, D, LKV, LMAX = 768, 4, 128, 128, 512
FUSED = gb._Plan.fuse_dq  # pylint: disable=protected-access


def inputs(seed, capacity, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (capacity, H, D), dtype)
  do = jax.random.normal(ks[1], (capacity, H, D), dtype)
  k = (jax.random.normal(ks[2], (B, LKV, H, D), jnp.float32) / np.sqrt(D)).astype(dtype)
  v = jax.random.normal(ks[3], (B, LKV, H, D), dtype)
  return q, k, v, do


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def print_ptxas(before: set) -> set:
  if "--ptxas" not in sys.argv:
    return before
  now = set(os.listdir(DUMP))
  for name in sorted(now - before):
    text = open(os.path.join(DUMP, name), errors="replace").read()
    lines = [l.strip() for l in text.splitlines()
             if re.search(r"spill|registers|stack frame|Used \d+", l, re.I)]
    if lines:
      print(f"  ptxas {name}: " + " | ".join(lines[:6]), flush=True)
  return now


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--ptxas", action="store_true")
  args = parser.parse_args()
  lengths = np.random.default_rng(0).integers(1, LMAX + 1, size=B)
  total = int(lengths.sum())
  capacity = -(-total // 128) * 128
  q_offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
  sets = [inputs(s, capacity) for s in range(3)]
  print(f"B={B} H={H} D={D} Lkv={LKV} tokens={total} capacity={capacity} "
        f"jax={jax.__version__} device={jax.devices()[0].device_kind}", flush=True)
  pre, post = jnp.float32(0.8), jnp.float32(1.2)
  q, k, v, do = sets[0]
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(lambda q, k, v, a, b: reference.gdpa(
      q, k, v, q_offsets, activation="fast_gelu", pre_scale=a, post_scale=b,
      max_seq_len=LMAX), f32(q), f32(k), f32(v), pre, post)
  want = vjp(f32(do))
  dumps = set(os.listdir(DUMP)) if args.ptxas else set()

  from jax.experimental.mosaic.gpu import profiler
  for label, fused, scales in (("fused", True, False), ("fused", True, True),
                               ("two kernels", False, False)):
    gb._Plan.fuse_dq = FUSED if fused else property(lambda self: False)  # dev-only A/B

    def fn(q, k, v, do, a, b, scales=scales):
      if not scales:
        a, b = 0.8, 1.2
      return gb.gdpa_bwd(q, k, v, q_offsets, None, do, activation="fast_gelu",
                         pre_scale=a, post_scale=b)

    fn = jax.jit(fn)
    got = fn(q, k, v, do, pre, post)
    errs = [rel_err(g, w) for g, w in zip(got[:3], want[:3])]
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in got[:3])
    padding_zero = not np.any(np.asarray(got[0][total:], np.float32))
    print(f"{label} scale_grads={scales}: rel err dq dk dv "
          + " ".join(f"{e:.2e}" for e in errs)
          + (f" d_pre {rel_err(got[3], want[3]):.2e} d_post {rel_err(got[4], want[4]):.2e}"
             if scales else "") + f" finite={finite} dq_padding_zero={padding_zero}",
          flush=True)
    dumps = print_ptxas(dumps)
    if max(errs) > 1e-2 or not finite or not padding_zero:
      print("  WRONG: not timed", flush=True)
      continue
    arg_sets = [(q_, k_, v_, do_, pre, post) for q_, k_, v_, do_ in sets]
    times = timing.measure_us(fn, arg_sets, args.iterations, "cupti")
    print(f"  median {timing.median(times):.1f} us (min {min(times):.1f}, max {max(times):.1f})"
          f" over {len(times)} calls", flush=True)
    _, per_kernel = profiler.measure(timing.Rotating(fn, arg_sets), aggregate=False,
                                     iterations=3)()
    mosaic = [(n, t) for n, t in per_kernel[-1] if "mosaic" in n]
    rest = sum(t for n, t in per_kernel[-1] if "mosaic" not in n)
    print("  kernels: " + ", ".join(f"{1e3 * t:.1f}" for _, t in mosaic)
          + f" us; XLA glue {1e3 * rest:.1f} us", flush=True)
  gb._Plan.fuse_dq = FUSED
  # Useful-work floor: 5 GEMMs of 2·Σlen·Lkv·D flops per head; bytes: q, do, dq + k, v, dk, dv.
  flops = 5 * 2 * total * H * LKV * D
  nbytes = 2 * (3 * total * H * D + 4 * B * LKV * H * D)
  print(f"floor: {flops / 1e9:.1f} GFLOP ({flops / 800e12 * 1e6:.0f} us at 800 TFLOP/s), "
        f"{nbytes / 1e6:.0f} MB ({nbytes / 4.3e12 * 1e6:.0f} us at 4.3 TB/s)")


if __name__ == "__main__":
  main()
