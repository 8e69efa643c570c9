"""Times the GDPA backward kernels at the issue's shape on a Hopper GPU (CUPTI), after checking
them against the float32 reference. Prints; commits nothing.

Shape: B=768, H=4, q lengths uniform on [1, 512] (density ~0.5), D=128, dense k/v Lkv=128,
fast_gelu, bfloat16; three input sets rotated (each ~600 MB, far above the 60 MB L2).

    PYTHONPATH=$PWD python benchmarks/dev/gdpa_bwd_gpu.py [--iterations 20]
"""

from __future__ import annotations

import argparse

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks import timing
from pallas_norm import reference
from pallas_norm.ops import gdpa_bwd_mgpu as gb

B, H, D, LKV, LMAX = 768, 4, 128, 128, 512


def inputs(seed, lengths, capacity, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (capacity, H, D), dtype)
  do = jax.random.normal(ks[1], (capacity, H, D), dtype)
  k = (jax.random.normal(ks[2], (B, LKV, H, D), jnp.float32) / np.sqrt(D)).astype(dtype)
  v = jax.random.normal(ks[3], (B, LKV, H, D), dtype)
  return q, k, v, do


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--iterations", type=int, default=20)
  args = parser.parse_args()
  lengths = np.random.default_rng(0).integers(1, LMAX + 1, size=B)
  total = int(lengths.sum())
  capacity = -(-total // 128) * 128
  q_offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
  sets = [inputs(s, lengths, capacity) for s in range(3)]
  print(f"B={B} H={H} D={D} Lkv={LKV} tokens={total} capacity={capacity} "
        f"jax={jax.__version__} device={jax.devices()[0].device_kind}", flush=True)

  def bwd(scales):
    def fn(q, k, v, do, pre, post):
      if not scales:
        pre, post = 1.0, 1.0
      return gb.gdpa_bwd(q, k, v, q_offsets, None, do, activation="fast_gelu",
                         pre_scale=pre, post_scale=post)
    return jax.jit(fn)

  pre, post = jnp.float32(0.8), jnp.float32(1.2)
  # Correctness first: against jax.vjp of the float32 reference (padded formulation).
  q, k, v, do = sets[0]
  got = bwd(True)(q, k, v, do, pre, post)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  _, vjp = jax.vjp(lambda q, k, v, a, b: reference.gdpa(
      q, k, v, q_offsets, activation="fast_gelu", pre_scale=a, post_scale=b,
      max_seq_len=LMAX), f32(q), f32(k), f32(v), pre, post)
  want = vjp(f32(do))
  errs = [rel_err(g, w) for g, w in zip(got, want)]
  print("rel err dq dk dv dpre dpost:", " ".join(f"{e:.2e}" for e in errs), flush=True)
  assert max(errs) < 1e-2 and all(bool(jnp.all(jnp.isfinite(g))) for g in got[:3])
  del want, vjp

  from jax.experimental.mosaic.gpu import profiler
  for scales, stages in ((False, gb.STAGES), (True, gb.STAGES), (False, 2)):
    gb.STAGES = stages  # a dev-only sweep of the ring depth
    fn = bwd(scales)
    arg_sets = [(q, k, v, do, pre, post) for q, k, v, do in sets]
    times = timing.measure_us(fn, arg_sets, args.iterations, "cupti")
    print(f"backward scale_grads={scales} stages={stages}: median {timing.median(times):.1f} us "
          f"(min {min(times):.1f}, max {max(times):.1f}) over {len(times)} calls", flush=True)
    _, per_kernel = profiler.measure(timing.Rotating(fn, arg_sets), aggregate=False,
                                     iterations=3)()
    for name, ms in per_kernel[-1] if isinstance(per_kernel[0], list) else per_kernel:
      print(f"  {1e3 * ms:9.1f} us  {name[:90]}")
  # Useful-work floor: 5 GEMMs of 2·Σlen·Lkv·D flops per head; bytes: q, do, dq + k, v, dk, dv.
  flops = 5 * 2 * total * H * LKV * D
  nbytes = 2 * (3 * total * H * D + 4 * B * LKV * H * D)
  print(f"floor: {flops / 1e9:.1f} GFLOP ({flops / 800e12 * 1e6:.0f} us at 800 TFLOP/s), "
        f"{nbytes / 1e6:.0f} MB ({nbytes / 4.3e12 * 1e6:.0f} us at 4.3 TB/s)")


if __name__ == "__main__":
  main()
