"""Dev A/B (session 8): K-loop pipelines of the pre-norm forward and our GEMM.

``--set ring``: the default tiles (cooperative 128 × 256, both consumer warpgroups on one
tile) fed by the hand-written shared ring (``TileConfig.pipeline="ring"``: always chained
across tiles, any stage count, optionally one WGMMA in flight across steps), as cuBLAS's
nvjet 128x256x64 4-stage kernel runs, against Pallas's ``emit_pipeline`` (the default).

``--set pingpong128``: session 4's ping-pong gave each consumer warpgroup 64-row tiles (``tile_m = 128``) and measured
1.5-1.7× slower. Here each warpgroup owns 128 × 128 output tiles (``tile_m = 256``,
``tile_n = 128``: CUTLASS's ping-pong tile, 128 accumulator registers), with its own ring of
32- or 64-wide K steps, and optionally one WGMMA left in flight across steps
(``delay_release = 1``, now supported by ``mgpu_common.pingpong_k_loop``). Each variant is
checked against the f32 reference before it is timed (CUPTI), next to the default config and
XLA's GEMM, for norm "none" (our GEMM), "rms" and "layer".

    PYTHONPATH=$PWD python3 benchmarks/dev/pipeline_ab.py --set ring [--shapes 262144x512x512,...]
"""
import argparse
import dataclasses
import functools
import json
import os
import time

import jax

from benchmarks import gpu_norm_matmul_check as chk
from pallas_norm.ops import norm_matmul_mgpu as nmk

SHAPES = "262144x512x512,262144x1024x1024,65536x2048x2048,262144x128x128,262221x512x512"


def ring_variants(m, k, n):
  base = nmk.pick_config(m, k, n)
  rep = functools.partial(dataclasses.replace, base, pipeline="ring")
  return [("default", base), ("ring_dr1", rep(delay_release=1)), ("ring_dr0", rep()),
          ("ring_dr1_epi64", rep(delay_release=1, epi_tile_n=64))]


def pingpong128_variants(m, k, n):
  base = nmk.pick_config(m, k, n)
  pp = dataclasses.replace(base, pingpong=True, stats_once=False, cluster_m=1, tile_m=256,
                           tile_n=128, epi_tile_n=64, max_concurrent_steps=8)
  out = [("default", base)]
  for tk, dr in ((32, 1), (32, 0), (64, 1), (64, 0)):
    out.append((f"pp128_k{tk}_dr{dr}", dataclasses.replace(pp, tile_k=tk, delay_release=dr)))
  out.append(("pp64_k32_dr1", dataclasses.replace(nmk.pingpong_config(m, k, n), delay_release=1)))
  return out


SETS = {"ring": ring_variants, "pingpong128": pingpong128_variants}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--set", choices=sorted(SETS), default="ring")
  p.add_argument("--shapes", default=SHAPES)
  p.add_argument("--norms", default="none,rms,layer")
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--budget-s", type=float, default=500)
  args = p.parse_args()
  print(jax.devices(), flush=True)
  start = time.monotonic()
  records = []
  for shape in args.shapes.split(","):
    m, k, n = map(int, shape.split("x"))
    print(f"\n=== {shape} ===", flush=True)
    sh = chk._Shape(m, k, n, args.iterations, records)
    sh.time_xla()
    for norm in args.norms.split(","):
      for label, cfg in SETS[args.set](m, k, n):
        if time.monotonic() - start > args.budget_s:
          print(f"budget reached: skip {shape}/{norm}/{label}", flush=True)
          continue
        sh.run_kernel(norm, label, cfg)
  if out := os.environ.get("OUT"):
    with open(os.path.join(out, f"pipeline_ab_{args.set}.json"), "w") as f:
      json.dump({"device": str(jax.devices()[0]), "commit": os.environ.get("GIT_COMMIT"),
                 "records": records}, f, indent=1)


if __name__ == "__main__":
  main()
