"""What the pre-norm backward's bias-cancellation guard costs on the GPU (session 6).

``norm_matmul``'s backward recomputes y' with one XLA GEMM under ``lax.cond`` when the norm
bias's part of y dwarfs the normalized part (``norm_matmul.BIAS_CANCELLATION_LIMIT``). XLA may
run a conditional on the device or read its predicate on the host (a stream sync per backward),
which CUPTI's kernel sums would not show. So each case is timed twice: the CUPTI sum of its
kernels (median of 10 calls; n/a where CUPTI cannot attribute the conditional's kernels to
calls, ``timing.KernelOrderError``) and the wall clock of 50 back-to-back calls of the jitted
fwd+bwd.

Cases at 262144×512² bf16, RMSNorm and LayerNorm, both with a bias:
  guard      default code, guard not firing (β ~ 0.1, γ ~ U(0.1, 1))
  no_guard   ``norm_matmul.BIAS_GUARD = False`` (no conditional at all), same inputs
  firing     γ = 1e-3, β ~ 1: the guard fires and the exact GEMM runs

    PYTHONPATH=$PWD python3 benchmarks/gpu_guard_cost.py
"""

import time

import jax
import jax.numpy as jnp

import pallas_norm as pn
from benchmarks.breakdown import per_kernel_us
from benchmarks.timing import KernelOrderError
from pallas_norm.ops import norm_matmul as nm

M, K, N = 262144, 512, 512
BF16, F32 = jnp.bfloat16, jnp.float32


def inputs(norm: str, firing: bool):
  kx, kw, ks, kb, kd = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(kx, (M, K), F32).astype(BF16)
  w = (jax.random.normal(kw, (K, N), F32) / K**0.5).astype(BF16)
  if firing:
    scale = jnp.full((K,), 1e-3, BF16)
    bias = jax.random.normal(kb, (K,), F32).astype(BF16)
  else:
    scale = jax.random.uniform(ks, (K,), F32, 0.1, 1.0).astype(BF16)
    bias = (0.1 * jax.random.normal(kb, (K,), F32)).astype(BF16)
  dy = jax.random.normal(kd, (M, N), F32).astype(BF16)
  return x, w, scale, bias, dy


def fwd_bwd(norm: str):
  def step(x, w, scale, bias, dy):
    y, vjp = jax.vjp(lambda *a: pn.norm_matmul(*a, norm=norm, implementation="mosaic"),
                     x, w, scale, bias)
    return y, vjp(dy)
  return jax.jit(step)


def wall_us(fn, args, calls: int = 50) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / calls * 1e6)
  return best


def main():
  print(jax.devices(), flush=True)
  for norm in ("rms", "layer"):
    for name, guard, firing in (("guard", True, False), ("no_guard", False, False),
                                ("firing", True, True)):
      nm.BIAS_GUARD = guard
      args = inputs(norm, firing)
      fn = fwd_bwd(norm)
      hlo = fn.lower(*args).compile().as_text()
      try:
        kernels = per_kernel_us(fn, args, iterations=10)
        cupti = f"{sum(us for _, us in kernels):7.1f} us"
      except KernelOrderError:  # a conditional: CUPTI's per-call sums are not trustworthy
        kernels, cupti = [], "    n/a"
      print(f"{norm:<5} {name:<8} cupti {cupti}  wall {wall_us(fn, args):7.1f} us  "
            f"conditionals {hlo.count(' conditional(')}  "
            f"ratio {float(nm.bias_cancellation(args[2][:, None] * args[1], args[3] @ args[1])):.1f}",
            flush=True)
      print("   " + ", ".join(f"{k[:40]} {us:.0f}" for k, us in kernels), flush=True)
  nm.BIAS_GUARD = True


if __name__ == "__main__":
  main()
