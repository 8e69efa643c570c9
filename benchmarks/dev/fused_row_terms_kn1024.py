"""Dev A/B (session 7): the pre-norm backward's fused dx row terms at K = N = 1024 (LayerNorm),
which ``norm_matmul.FUSED_ROW_TERMS_MAX_KN`` = 512 leaves unmeasured: the public op's fwd+bwd
(``jax.vjp``, y returned) with the threshold at 512 (XLA row-terms pass) and at 1024 (the dx
kernel sums them in its K loop), at 262144×{512², 1024²} bf16, next to XLA's.

CUPTI per kernel without a bias (no bias guard); with a bias (the guard's ``lax.cond``) the wall
clock of back-to-back calls (``timing.batched_wall_us``).

    PYTHONPATH=$PWD python3 benchmarks/dev/fused_row_terms_kn1024.py
"""
import statistics

import jax
import jax.numpy as jnp

import pallas_norm as pn
from benchmarks import timing
from benchmarks.breakdown import per_kernel_us
from pallas_norm.ops import norm_matmul as nm

M = 262144
BF16, F32 = jnp.bfloat16, jnp.float32


def step(impl, with_bias):
  def f(x, w, scale, bias, dy):
    y, vjp = jax.vjp(lambda x, w, s, b: pn.norm_matmul(x, w, s, b if with_bias else None,
                                                       norm="layer", implementation=impl),
                     x, w, scale, bias)
    return y, vjp(dy)
  return f


def main():
  print(jax.devices(), flush=True)
  for kn in (512, 1024):
    ks = jax.random.split(jax.random.key(kn), 5)
    x = jax.random.normal(ks[0], (M, kn), F32).astype(BF16)
    w = (jax.random.normal(ks[1], (kn, kn), F32) / kn ** 0.5).astype(BF16)
    scale = jax.random.uniform(ks[2], (kn,), F32, 0.5, 1.5)
    bias = 0.1 * jax.random.normal(ks[3], (kn,), F32)
    dy = jax.random.normal(ks[4], (M, kn), F32).astype(BF16)
    args = (x, w, scale, bias, dy)
    for with_bias in (False, True):
      row = []
      for label, impl, limit in (("xla", "xla", 512), ("unfused", "mosaic", 512),
                                 ("fused", "mosaic", 1024)):
        nm.FUSED_ROW_TERMS_MAX_KN = limit
        fn = jax.jit(step(impl, with_bias))
        if with_bias:
          us = statistics.median(timing.batched_wall_us(fn, [args], iterations=20))
          timer = "wall"
        else:
          us = sum(t for _, t in per_kernel_us(fn, args, iterations=10))
          timer = "cupti"
        row.append(f"{label} {us:7.1f}")
      nm.FUSED_ROW_TERMS_MAX_KN = 512
      print(f"layer {M}x{kn}x{kn} fwd+bwd bias={with_bias} ({timer} us): " + "  ".join(row),
            flush=True)


if __name__ == "__main__":
  main()
