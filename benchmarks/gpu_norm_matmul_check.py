"""GPU check of the lazy pre-norm GEMM kernel: correctness at real sizes, then CUPTI timing.

Run on the H200 from the repository root::

    PYTHONPATH=$PWD python3 benchmarks/gpu_norm_matmul_check.py [--quick] [--iterations 10]

For every shape it checks each kernel variant against :func:`pallas_norm.reference.norm_matmul`
on float32-upcast inputs, then times (median of CUPTI kernel times, two input sets rotated so L2
never serves a whole input):

* ``xla_gemm``: XLA's ``x @ w`` (the limit a fused kernel aims at),
* ``xla_rms+gemm`` / ``xla_ln+gemm``: the unfused reference under XLA,
* ``ours_gemm``: our kernel with ``norm="none"`` (our GEMM alone),
* ``ours_rms`` / ``ours_ln``: the fused kernel, for a few tile configs (tuning data).

The affine fold (``diag(scale)·w``, ``col_sum``, ``out_bias``) is done once outside the timed
function: it is a K×N pass that the op pays per call but amortizes over M. Ratios printed:
vs XLA's GEMM, vs our GEMM, vs the unfused XLA op, and the share of the norm's cost hidden,
(T_xla_unfused − T_ours) / (T_xla_unfused − T_xla_gemm). Every case is guarded: an exception is
printed and the script moves on. Results go to $OUT/norm_matmul_check.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_norm import reference
from pallas_norm.mgpu_common import TileConfig
from pallas_norm.ops import norm_matmul_mgpu as nmk

EPS = 1e-6
SHAPES = [(262144, 512, 512), (262144, 128, 128), (262144, 1024, 1024), (65536, 2048, 2048),
          (262144 + 77, 512, 512)]
QUICK_SHAPES = [(262144, 512, 512), (262144 + 77, 512, 512)]
TIME_BUDGET_S = 210  # stop starting new cases past this (the whole run must stay < 4 min)
NAMES = {"rms": "ours_rms", "layer": "ours_ln", "none": "ours_gemm"}


def _variants(m, k, n):
  """(label, config) pairs to try per norm: the heuristic first, then tuning alternatives."""
  base = nmk.pick_config(m, k, n)
  alt_tile = (TileConfig(tile_m=128, tile_n=min(256, n), epi_tile_n=32)
              if base.tile_m == 256 else TileConfig(tile_m=256, tile_n=128))
  rms = [("default", base), ("no_fence", dataclasses.replace(base, fence_reads=False)),
         ("reduce", dataclasses.replace(base, stats="reduce")), ("alt_tile", alt_tile)]
  if base.tile_n == 256:  # 4 stages fit once the epilogue tiles shrink
    rms.append(("epi32_4st", dataclasses.replace(base, epi_tile_n=32)))
  if m % 8 == 0 and (m, k, n) == (262144, 512, 512):
    rms.append(("a_regs", dataclasses.replace(base, a_operand="registers")))
    rms.append(("grid_m", dataclasses.replace(base, grid_minor_dim="m")))
  return {"rms": rms, "layer": [("default", base), ("alt_tile", alt_tile)],
          "none": [("default", base), ("alt_tile", alt_tile)]}


def _inputs(seed, m, k, n, mu=0.0, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 4)
  x = (mu + jax.random.normal(ks[0], (m, k), jnp.float32)).astype(dtype)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  scale = 1.0 + 0.2 * jax.random.normal(ks[2], (k,), jnp.float32)
  bias = 0.2 * jax.random.normal(ks[3], (k,), jnp.float32)
  return x, w, scale, bias


def _fold(w, scale, bias, norm):
  wf = w.astype(jnp.float32)
  w_gamma = (scale[:, None] * wf).astype(w.dtype) if norm != "none" else w
  col_sum = jnp.sum(w_gamma.astype(jnp.float32), axis=0) if norm == "layer" else None
  out_bias = bias @ wf if norm == "layer" else None
  return w_gamma, col_sum, out_bias


def _kernel_fn(norm, config, out_dtype):
  return jax.jit(lambda x, wg, cs, ob: nmk.norm_matmul_fwd(
      x, wg, cs, ob, norm=norm, eps=EPS, out_dtype=out_dtype, config=config))


def _rel(a, b) -> float:
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _check(norm, fn, x, w, scale, bias, folded) -> dict:
  """Errors of one kernel variant vs the f32 reference; ok = within the test tolerances."""
  y, mean, rstd = fn(x, *folded)
  xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
  if norm == "none":
    err = {"err_y": _rel(y, jnp.matmul(xf, wf, precision="highest"))}
    return {**err, "ok": err["err_y"] < 1e-2}
  y_ref, st = reference.norm_matmul(xf, wf, scale, bias if norm == "layer" else None, norm=norm,
                                    eps=EPS, return_stats=True)
  err = {"err_y": _rel(y, y_ref),
         "err_rstd": float(jnp.max(jnp.abs(rstd - st.rstd) / st.rstd)),
         "nonfinite": int(jnp.sum(~jnp.isfinite(y.astype(jnp.float32))))}
  ok = err["err_y"] < 1e-2 and err["err_rstd"] < 1e-4 and err["nonfinite"] == 0
  if norm == "layer":
    err["err_mean"] = float(jnp.max(jnp.abs(mean - st.mean) * st.rstd / (1 + jnp.abs(st.mean)
                                                                       * st.rstd)))
    ok = ok and err["err_mean"] < 1e-4
  return {**err, "ok": bool(ok)}


def _time(fn, arg_sets, iterations) -> float:
  return timing.median(timing.measure_us(fn, arg_sets, iterations, "cupti"))


def _guard(records, label, thunk):
  """Runs one case; prints and records the exception instead of stopping."""
  try:
    return thunk()
  except Exception as e:  # noqa: BLE001  (a bad config must not end the run)
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    print(f"  FAILED {label}: {msg}", flush=True)
    traceback.print_exc(limit=3, file=sys.stdout)
    records.append({"case": label, "error": msg})
    return None


class _Shape:
  """One shape's inputs (two rotated sets), its XLA baselines and our GEMM times."""

  def __init__(self, m, k, n, iterations, records):
    self.m, self.k, self.n = m, k, n
    self.name = f"{m}x{k}x{n}"
    self.iterations, self.records = iterations, records
    self.sets = [_inputs(s, m, k, n) for s in (0, 1)]
    self.xla: dict[str, float] = {}
    self.ours_gemm: dict[str, float] = {}
    self.folded = {norm: [(s[0], *_fold(s[1], s[2], s[3], norm)) for s in self.sets]
                   for norm in ("none", "rms", "layer")}

  def time_xla(self):
    fns = {"xla_gemm": lambda x, w, s, b: x @ w,
           "xla_rms+gemm": lambda x, w, s, b: reference.norm_matmul(x, w, s, norm="rms", eps=EPS),
           "xla_ln+gemm": lambda x, w, s, b: reference.norm_matmul(x, w, s, b, norm="layer",
                                                                   eps=EPS)}
    for name, f in fns.items():
      def one(name=name, f=f):
        self.xla[name] = _time(jax.jit(f), [s[:4] for s in self.sets], self.iterations)
        self.records.append({"shape": self.name, "impl": name, "us": self.xla[name]})
        print(f"  {name:<22} {self.xla[name]:9.1f} us", flush=True)
      _guard(self.records, f"{self.name}/{name}", one)

  def run_kernel(self, norm, label, cfg):
    def one():
      fn = _kernel_fn(norm, cfg, jnp.bfloat16)
      x0, w0, scale0, bias0 = self.sets[0]
      rec = {"shape": self.name, "impl": NAMES[norm], "config_label": label,
             "config": dataclasses.asdict(cfg)}
      rec.update(_check(norm, fn, x0, w0, scale0, bias0, self.folded[norm][0][1:]))
      rec["us"] = _time(fn, self.folded[norm], self.iterations)
      if norm == "none":
        self.ours_gemm[label] = rec["us"]
      print(self._line(norm, label, rec), flush=True)
      self.records.append(rec)
    _guard(self.records, f"{self.name}/{NAMES[norm]}/{label}", one)

  def _line(self, norm, label, rec) -> str:
    xla = self.xla
    base = xla.get("xla_rms+gemm" if norm == "rms" else "xla_ln+gemm")
    line = f"  {NAMES[norm] + '/' + label:<22} {rec['us']:9.1f} us"
    if "xla_gemm" in xla:
      rec["vs_xla_gemm"] = rec["us"] / xla["xla_gemm"]
      line += f"  {rec['vs_xla_gemm']:.2f}x xla_gemm"
    if norm != "none" and self.ours_gemm:
      rec["vs_ours_gemm"] = rec["us"] / min(self.ours_gemm.values())
      line += f"  {rec['vs_ours_gemm']:.2f}x ours_gemm"
    if norm != "none" and base is not None:
      rec["vs_xla_unfused"] = rec["us"] / base
      line += f"  {rec['vs_xla_unfused']:.2f}x xla_unfused"
      if "xla_gemm" in xla and base > xla["xla_gemm"]:
        rec["hidden"] = (base - rec["us"]) / (base - xla["xla_gemm"])
        line += f"  hidden {100 * rec['hidden']:.0f}%"
    return line + f"  err_y {rec['err_y']:.1e}{'' if rec['ok'] else '  <-- WRONG'}"


def run_accuracy(records):
  """LayerNorm rows 1e3 + N(0, 1) at a real size, bf16 and f16 (correctness only)."""
  print("\n=== LayerNorm rows 1e3 + N(0,1), M=16384+77 K=N=512 ===", flush=True)
  for dtype in (jnp.bfloat16, jnp.float16):
    def one(dtype=dtype):
      x, w, scale, bias = _inputs(5, 16384 + 77, 512, 512, mu=1e3, dtype=dtype)
      folded = _fold(w, scale, bias, "layer")
      rec = {"case": f"large_mean/{jnp.dtype(dtype).name}"}
      rec.update(_check("layer", _kernel_fn("layer", None, dtype), x, w, scale, bias, folded))
      print(f"  {rec['case']:<22} err_y {rec['err_y']:.1e} err_rstd {rec['err_rstd']:.1e} "
            f"err_mean {rec['err_mean']:.1e} {'ok' if rec['ok'] else '<-- WRONG'}", flush=True)
      records.append(rec)
    _guard(records, f"large_mean/{jnp.dtype(dtype).name}", one)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="only the seed shape and its tail case")
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args(argv)
  print(f"devices: {jax.devices()}", flush=True)
  start = time.monotonic()
  deadline = start + TIME_BUDGET_S
  records: list[dict] = []
  run_accuracy(records)
  shapes = []
  # Pass 1: every shape with the heuristic config; pass 2: the tuning variants, while time lasts.
  for m, k, n in (QUICK_SHAPES if args.quick else SHAPES):
    if time.monotonic() > deadline:
      print(f"time budget reached: skipping {m}x{k}x{n}", flush=True)
      continue
    print(f"\n=== M={m} K={k} N={n} (bf16) ===", flush=True)
    sh = _guard(records, f"{m}x{k}x{n}/inputs", lambda: _Shape(m, k, n, args.iterations,
                                                                 records))
    if sh is None:
      continue
    shapes.append(sh)
    sh.time_xla()
    for norm in ("none", "rms", "layer"):
      label, cfg = _variants(m, k, n)[norm][0]
      sh.run_kernel(norm, label, cfg)
  for sh in shapes:
    print(f"\n=== variants, M={sh.m} K={sh.k} N={sh.n} ===", flush=True)
    for norm in ("none", "rms", "layer"):
      for label, cfg in _variants(sh.m, sh.k, sh.n)[norm][1:]:
        if time.monotonic() > deadline:
          print(f"  (time budget reached: skipping {NAMES[norm]}/{label})", flush=True)
          continue
        sh.run_kernel(norm, label, cfg)
  wrong = [r for r in records if r.get("ok") is False]
  failed = [r for r in records if "error" in r]
  print(f"\n{len(records)} records, {len(wrong)} wrong, {len(failed)} failed, "
        f"{time.monotonic() - start:.0f} s", flush=True)
  if out := os.environ.get("OUT"):
    path = os.path.join(out, "norm_matmul_check.json")
    with open(path, "w") as f:
      json.dump({"device": str(jax.devices()[0]), "records": records}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
