"""The post-norm backward's norm kernel against XLA's passes (session 6).

Two sections, CUPTI (median of 10 calls, every kernel a call launches):

* ``alone``: dh and the column sums of the suite's matmul_norm cases (scale and bias: sums
  dscale and dbias; no returned h), ``matmul_norm_bwd_mgpu.norm_backward`` at both step widths
  vs the XLA code it replaces (``matmul_norm._norm_backward_xla``), with the bytes floor (read
  dy and x̂, write dh), for each of ``matmul_norm_bwd_mgpu.SPLITS``.
* ``api``: the public op's fwd+bwd (``implementation="mosaic"``) with
  ``matmul_norm.NORM_BACKWARD_KERNEL`` on and off, next to XLA's.

    PYTHONPATH=$PWD python3 benchmarks/gpu_norm_backward.py [--sections alone,api] [--n 512,1024]
"""

import argparse

import jax
import jax.numpy as jnp

import pallas_norm as pn
from benchmarks.breakdown import per_kernel_us
from pallas_norm.ops import matmul_norm as mn
from pallas_norm.ops import matmul_norm_bwd_mgpu as mb

M, K = 262144, 512
BF16, F32 = jnp.bfloat16, jnp.float32
HBM_GBS = 4300.0  # the suite's measured copy bandwidth on the H200 (GB/s)


def _us(fn, args):
  kernels = per_kernel_us(jax.jit(fn), args, iterations=10)
  return sum(us for _, us in kernels), kernels


def alone(n: int, norm: str):
  ks = jax.random.split(jax.random.key(n), 4)
  dy = jax.random.normal(ks[0], (M, n), F32).astype(BF16)
  xhat = jax.random.normal(ks[1], (M, n), F32).astype(BF16)
  rstd = jax.random.uniform(ks[2], (M,), F32, 0.5, 2.0)
  scale = jax.random.uniform(ks[3], (n,), F32, 0.1, 1.0)
  sums = ("dscale", "dbias") if norm == "layer" else ("dscale",)
  floor = 3 * M * n * 2 / HBM_GBS / 1e3
  xla, xk = _us(lambda *a: (lambda dh, c: (dh.astype(BF16), c))(
      *mn._norm_backward_xla(norm, a[0], None, a[1], a[2], a[3], sums)), (dy, xhat, rstd, scale))
  print(f"alone {norm:<5} {M}x{n}: xla {xla:7.1f} us  floor {floor:6.1f} us", flush=True)
  print("   xla: " + ", ".join(f"{k[:40]} {us:.0f}" for k, us in xk), flush=True)
  for split in mb.SPLITS:
    kernel, kk = _us(lambda *a: mb.norm_backward(a[0], a[1], a[2], a[3], norm=norm, sums=sums,
                                                 split=split), (dy, xhat, rstd, scale))
    stages = mb._make_plan(M, n, BF16, norm, True, False, sums, False, split).stages
    print(f"   kernel split {split}: {kernel:7.1f} us ({stages} stages); " +
          ", ".join(f"{k[:32]} {us:.0f}" for k, us in kk), flush=True)


def api(n: int, variant: str):
  norm = "rms" if variant == "rms" else "layer"
  ks = jax.random.split(jax.random.key(n + 1), 6)
  x = jax.random.normal(ks[0], (M, K), F32).astype(BF16)
  w = (jax.random.normal(ks[1], (K, n), F32) / K**0.5).astype(BF16)
  res = jax.random.normal(ks[2], (M, n), F32).astype(BF16) if variant == "layer+res" else None
  scale = jax.random.uniform(ks[3], (n,), F32, 0.1, 1.0).astype(BF16)
  bias = (0.1 * jax.random.normal(ks[4], (n,), F32)).astype(BF16) if norm == "layer" else None
  dy = jax.random.normal(ks[5], (M, n), F32).astype(BF16)

  def step(impl):
    def f(x, w, res, scale, bias, dy):
      y, vjp = jax.vjp(lambda *a: pn.matmul_norm(a[0], a[1], None, a[2], a[3], a[4], norm=norm,
                                                 implementation=impl), x, w, res, scale, bias)
      return y, vjp(dy)
    return f

  args = (x, w, res, scale, bias, dy)
  times = {}
  for name, impl, flag in (("kernel_bwd", "mosaic", True), ("xla_bwd", "mosaic", False),
                           ("xla", "xla", True)):
    mn.NORM_BACKWARD_KERNEL = flag
    times[name], kernels = _us(step(impl), args)
    if name == "kernel_bwd":
      detail = ", ".join(f"{k[:32]} {us:.0f}" for k, us in kernels)
  mn.NORM_BACKWARD_KERNEL = True
  print(f"api {variant:<9} {M}x{K}x{n} fwd+bwd: " +
        "  ".join(f"{k} {v:7.1f} us" for k, v in times.items()), flush=True)
  print("   kernel_bwd: " + detail, flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sections", default="alone,api")
  parser.add_argument("--n", default="512,1024,2048")
  args = parser.parse_args()
  print(jax.devices(), flush=True)
  ns = [int(v) for v in args.n.split(",")]
  sections = args.sections.split(",")
  for n in ns:
    if "alone" in sections:
      for norm in ("layer", "rms"):
        alone(n, norm)
    if "api" in sections:
      for variant in ("layer+res", "rms"):
        api(n, variant)


if __name__ == "__main__":
  main()
