"""FlashNormAttention's parts at the issue's shape: the fused forward kernel alone (with and
without the attention output the backward needs) and the backward's two row kernels
(``pallas_norm.ops.flash_norm_attention.norm_bwd``) at several tilings.

    PYTHONPATH=$PWD python3 -m benchmarks.fna_parts [--heads 4] [--budget-s 90] [--no-forward]

B = 768, lengths uniform on [1, 512] (the suite's ``attention_lengths``), D = 128, dense K/V of
128 keys, bf16, CUPTI median of 10 calls over three rotated input sets. Each row-kernel tiling's
outputs are first compared with the default tiling's (which the suite's oracle check covers);
a tiling that fails or disagrees is reported and the next one runs. Prints one line per
measurement and writes ``fna_parts.json`` to ``$OUT`` (or the working directory). Starts no
measurement past ``--budget-s``. Prints, commits nothing: a winning tiling goes into
``norm_bwd.pick_config`` with its numbers in benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cases as C
from benchmarks import timing
from pallas_norm import jagged
from pallas_norm.ops.flash_norm_attention import mosaic, norm_bwd

TILINGS = (  # (block_m, steps, num_warps, num_stages); the default pick first
    None, (8, 16, 4, None), (16, 4, 8, None), (16, 16, 8, None), (32, 4, 8, None),
    (16, 8, 4, None), (16, 8, 8, 1))
KV_LEN, HEAD_DIM = 128, 128


def _inputs(heads: int, seed: int):
  case = C.Case("flash_norm_attention", "", (("B", 768), ("H", heads), ("L", 512),
                                             ("D", HEAD_DIM), ("KV", KV_LEN)), "fwd")
  lens = C.attention_lengths(case)
  capacity = -(-int(lens.sum()) // 128) * 128
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (capacity, heads, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
  kv_shape = (len(lens), KV_LEN, heads, HEAD_DIM)
  k = (jax.random.normal(ks[1], kv_shape) / np.sqrt(HEAD_DIM)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], kv_shape, jnp.float32).astype(jnp.bfloat16)
  affine = (1 + 0.1 * jax.random.normal(ks[3], (3, heads, HEAD_DIM))).at[1].add(-1.0)
  return q, k, v, jnp.asarray(jagged.offsets_from_lengths(lens)), affine


def _rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30))


def _forward(q, k, v, offsets, affine, save_attn: bool):
  return mosaic.flash_norm_attention_fwd(q, k, v, offsets, affine, 1.0, 1.0,
                                         activation="fast_gelu", eps=1e-6, save_attn=save_attn)


def _row_kernels(cfg, saved, end, affine):
  """The two row kernels as the backward calls them (du_attn := dz: same bytes)."""
  g, q, attn, stats = saved
  rms = jax.jit(lambda g, q, attn, stats: norm_bwd.rms_backward(
      g, q, attn, stats, affine, end, pre_layer_norm=True, inner_residual=True, config=cfg))
  ln = jax.jit(lambda du, dz, g, q, stats: norm_bwd.ln_backward(
      du, dz, g, q, stats, affine[0], end, 0.0, inner_residual=True, outer_residual=True,
      config=cfg))
  return rms, ln


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--budget-s", type=float, default=90.0)
  p.add_argument("--no-forward", action="store_true")
  args = p.parse_args(argv)
  start, report = time.time(), {"device": str(jax.devices()[0]), "heads": args.heads, "rows": []}
  out_path = os.path.join(os.environ.get("OUT", "."), "fna_parts.json")

  def record(**row):
    report["rows"].append(row)
    print(f"[{time.time() - start:5.0f}s] {row}", flush=True)
    with open(out_path, "w") as f:
      json.dump(report, f, indent=1)

  sets = [_inputs(args.heads, seed) for seed in range(3)]
  if not args.no_forward:
    for save_attn in (False, True):
      fwd = jax.jit(lambda *a, s=save_attn: _forward(*a, s))
      record(part="forward", save_attn=save_attn,
             us=round(timing.median(timing.measure_us(fwd, sets, 10, "cupti")), 1))
  q, _, _, offsets, affine = sets[0]
  t, n = q.shape[0], q.shape[1] * q.shape[2]
  _, stats, attn = jax.jit(lambda *a: _forward(*a, True))(*sets[0])
  g = jax.random.normal(jax.random.key(9), (t, n), jnp.float32).astype(jnp.bfloat16)
  saved = (g, q.reshape(t, n), attn.reshape(t, n), stats)
  affine = tuple(affine.reshape(3, n))
  end = offsets[-1]
  want = None
  for tiling in TILINGS:
    if time.time() - start > args.budget_s:
      print(f"budget of {args.budget_s} s spent: stopping before {tiling}", flush=True)
      break
    cfg = norm_bwd.RowConfig(*tiling) if tiling else norm_bwd.pick_config(n, False)
    try:
      rms, ln = _row_kernels(cfg, saved, end, affine)
      dz, u, d_gamma2 = rms(*saved)
      ln_args = (dz, dz, g, saved[1], stats)
      outs = (dz, u, d_gamma2, *ln(*ln_args))
      want = want or outs
      err = max(_rel_err(a, b) for a, b in zip(outs, want))
      times = [timing.median(timing.measure_us(fn, [fn_args], 10, "cupti"))
               for fn, fn_args in ((rms, saved), (ln, ln_args))]
      record(part="row kernels", config=dataclasses.asdict(cfg), rms_us=round(times[0], 1),
             ln_us=round(times[1], 1), err_vs_default=f"{err:.1e}")
    except Exception as e:  # noqa: BLE001  one failing tiling must not hide the others
      record(part="row kernels", config=dataclasses.asdict(cfg),
             error=f"{type(e).__name__}: {str(e)[:200]}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
