"""GPU check of the lazy pre-norm GEMM kernels: correctness at real sizes, then CUPTI timing.

Run on the H200 from the repository root (each command stays under ~9 minutes)::

    PYTHONPATH=$PWD python3 benchmarks/gpu_norm_matmul_check.py --sections accuracy,fwd,train
    PYTHONPATH=$PWD python3 benchmarks/gpu_norm_matmul_check.py --sections variants,dx
    # or all sections at once, within --budget-s seconds:
    PYTHONPATH=$PWD python3 benchmarks/gpu_norm_matmul_check.py [--quick] [--iterations 10]

Sections (in this order):

* ``accuracy``: LayerNorm rows 1e3 + N(0, 1), bf16 and f16 (correctness only).
* ``fwd``: per shape, XLA's baselines and our kernel's default config (below).
* ``train``: the op through the public API, ``implementation="mosaic"`` vs ``"xla"``, forward
  alone (including the affine fold) and ``jax.grad`` of ``sum(y · ct)`` with respect to
  (x, w, scale, bias), jitted; gradients checked against the f32 reference; the same fwd+bwd
  with ``norm_matmul.DX_WRITES_DY_SCALED`` on (``api_fwd+bwd/mosaic_dys``); then a breakdown of
  our backward: the affine fold, the row-terms pass over dy and y, the dx kernel (and the same
  dx math in XLA), the weight gradients in XLA; and the A/B of where ``rstd ⊙ dy`` comes from:
  (a) ``bwd_dx_kernel`` + ``bwd_weights_xla`` (XLA's pass forms it, today) against (b)
  ``bwd_dx_kernel_dys`` (the dx kernel also writes it) + ``bwd_weights_xla_given_dys`` (no
  scaling pass), and the whole backward as the op runs it, ``bwd_all/xla_dys`` vs
  ``bwd_all/kernel_dys``. ``--dx-writes-dy-scaled`` turns the switch on for the whole run
  (every public-API row then uses it).
* ``dx``: tile-config variants of the dx kernel (row terms given), then the row terms' two
  paths end to end: the XLA pass over dy and y followed by the dx kernel (today's backward,
  ``xla_rows+ours_dx_*``, two kernels summed) against the dx kernel computing them in its own K
  loop from y (``ours_dx_*/fused*``, ``norm_matmul.FUSED_ROW_TERMS``), and all-XLA
  (``xla_rows+xla_dx_*``); each kernel path also with ``return_dy_scaled`` (``*+dys*``: the
  kernel also writes rstd ⊙ dy; the default 32-wide steps and 64-wide ones).
* ``variants``: tile-config variants of the forward kernel (tuning data for ``pick_config``).

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
printed and the script moves on. Results go to $OUT/norm_matmul_check.json when OUT is set
(``--json-name`` changes the file name).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_norm
from benchmarks import timing
from pallas_norm import reference
from pallas_norm.mgpu_common import TileConfig
from pallas_norm.ops import norm_matmul as nm
from pallas_norm.ops import norm_matmul_bwd_mgpu as nmb
from pallas_norm.ops import norm_matmul_mgpu as nmk

EPS = 1e-6
SHAPES = [(262144, 512, 512), (262144, 128, 128), (262144, 1024, 1024), (65536, 2048, 2048),
          (262144 + 77, 512, 512)]
QUICK_SHAPES = [(262144, 512, 512), (262144 + 77, 512, 512)]
TRAIN_SHAPES = [(262144, 512, 512), (65536, 2048, 2048)]
VARIANT_SHAPES = SHAPES[:4]
SECTIONS = ("accuracy", "fwd", "train", "dx", "variants")
TIME_BUDGET_S = 500  # stop starting new cases past this (one command must stay < 10 min)
# --smoke (CPU): tiny shapes, kernels in GPU interpret mode, wall-clock timer. It only checks
# that every code path of this script runs; its times mean nothing.
SMOKE_SHAPES = [(256, 128, 256), (77, 128, 128)]
_SMOKE = False
NAMES = {"rms": "ours_rms", "layer": "ours_ln", "none": "ours_gemm"}


def _variants(m, k, n):
  """(label, config) pairs to try per norm: the heuristic first, then tuning alternatives.

  The first runs (2026-11-30) found no option (no_fence, stats="reduce", A from registers,
  256×128 tiles, grid_m) that beat the default; these isolate the chained pipelines:

  These A/Bs run Pallas's pipeline (``pipeline="pallas"``) even where the default is the
  shared ring (``benchmarks/dev/pipeline_ab.py --set ring`` compares the two):

  * ``unchained``: per-tile pipelines (``pipeline_across_tiles=False``) with the default's
    tiles; ``unchained_epi64``: the same with 64×64 epilogue tiles, the config before chaining
    (3 stages at 128×256); ``chained_epi64``: chained with 64×64 epilogue tiles (2 stages).
  * ``slots0``: one SMEM slot per epilogue tile (``epi_slots=0``).
  * ``bpm_128x128`` / ``bpm_256x128`` (GEMM only): 4/3 and 1× the default's operand bytes per
    MAC; if our GEMM is bound by L2 → SMEM traffic the first is ~4/3 slower, the second equal.
  * ``cl2``: clusters of 2 CTAs along M receive each w tile by one multicast.
  * ``once``: statistics once per row block (``stats_once``).
  * ``inflight``: one WGMMA left in flight across K steps (``delay_release=1``, as JAX's
    hopper_matmul_mgpu does; Pallas cannot chain those pipelines, so it is per-tile), with the
    default's tiles and with 64×64 epilogue tiles (3 stages). ``pingpong``: ping-pong consumers
    (``TileConfig.pingpong``), each with its own ring, so one's epilogue overlaps the other's
    WGMMAs.
  """
  base = nmk.pick_config(m, k, n)
  rep = functools.partial(dataclasses.replace, base)
  # The chaining and in-flight A/Bs are about Pallas's pipeline, whatever the default is.
  pallas = functools.partial(dataclasses.replace, base, pipeline="pallas", delay_release=0)
  ab = [("unchained", pallas(pipeline_across_tiles=False)),
        ("unchained_epi64", pallas(pipeline_across_tiles=False, epi_tile_n=64)),
        ("chained_epi64", pallas(epi_tile_n=64))]
  inflight = [("inflight", pallas(delay_release=1)),
              ("inflight_epi64", pallas(delay_release=1, epi_tile_n=64))]
  if m % 8 == 0:  # ping-pong reads x tiled
    inflight.append(("pingpong", nmk.pingpong_config(m, k, n)))
  # Bytes per MAC (benchmarks/NOTES.md, session 4: is our GEMM bound by L2 -> SMEM traffic?):
  # 128x128 tiles stream 4/3 the operand bytes of 128x256 for the same MACs, 256x128 the same.
  bytes_per_mac = [("bpm_128x128", rep(tile_m=128, tile_n=128)),
                   ("bpm_256x128", rep(tile_m=256, tile_n=128))]
  gemm = ([("default", base)] + inflight + ab + bytes_per_mac
          + [("slots0", rep(epi_slots=0)), ("cl2", rep(cluster_m=2))])
  fused = [("default", base)] + inflight + ab + [("once", rep(stats_once=True))]
  return {"none": gemm, "rms": fused, "layer": fused[:1 + len(inflight)]}


def _dx_variants(m, k, n):
  """(label, config, x_prefetch_step) of the dx kernel (output (m, k), reduction over n)."""
  base = nmb.pick_config(m, n, k)
  alt_tile = (TileConfig(tile_m=128, tile_n=min(256, k), epi_tile_n=32)
              if base.tile_m == 256 else TileConfig(tile_m=256, tile_n=128))
  return [("default", base, 1), ("inflight", dataclasses.replace(base, delay_release=1), 1),
          ("prefetch0", base, 0), ("prefetch3", base, 3),
          ("cl2", dataclasses.replace(base, cluster_m=2), 1), ("alt_tile", alt_tile, 1),
          ("alt_tile_cl2", dataclasses.replace(alt_tile, cluster_m=2), 1)] + (
              [("pingpong", nmb.pingpong_config(m, n, k), 1)] if m % 8 == 0 else [])


def _fused_dx_variants(m, k, n):
  """(label, config) of the dx kernel with fused row terms: its default (``pick_config(...,
  fused_row_terms=True)``: the row-terms-given default's tiles with 32-wide reduction steps, 4
  chained stages at 128×256, K = N = 512), the same with 64-wide steps (2 chained stages), and
  the other tile shape with 32-wide steps."""
  base = nmb.pick_config(m, n, k, fused_row_terms=True)
  alt_tile = (TileConfig(tile_m=128, tile_n=min(256, k), epi_tile_n=32, tile_k=32)
              if base.tile_m == 256 else TileConfig(tile_m=256, tile_n=128, tile_k=32))
  return [("fused", base), ("fused_k64", dataclasses.replace(base, tile_k=64)),
          ("fused_alt_k32", alt_tile)]


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
      x, wg, cs, ob, norm=norm, eps=EPS, out_dtype=out_dtype, config=config,
      interpret=_SMOKE))


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
  return timing.median(timing.measure_us(fn, arg_sets, iterations,
                                         "wall" if _SMOKE else "cupti"))


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
  m, k = (77, 128) if _SMOKE else (16384 + 77, 512)
  print(f"\n=== LayerNorm rows 1e3 + N(0,1), M={m} K=N={k} ===", flush=True)
  for dtype in (jnp.bfloat16, jnp.float16):
    def one(dtype=dtype):
      x, w, scale, bias = _inputs(5, m, k, k, mu=1e3, dtype=dtype)
      folded = _fold(w, scale, bias, "layer")
      rec = {"case": f"large_mean/{jnp.dtype(dtype).name}"}
      rec.update(_check("layer", _kernel_fn("layer", None, dtype), x, w, scale, bias, folded))
      print(f"  {rec['case']:<22} err_y {rec['err_y']:.1e} err_rstd {rec['err_rstd']:.1e} "
            f"err_mean {rec['err_mean']:.1e} {'ok' if rec['ok'] else '<-- WRONG'}", flush=True)
      records.append(rec)
    _guard(records, f"large_mean/{jnp.dtype(dtype).name}", one)


# ------------------------------------------------------------------------------------------------
# Training: the public op, forward and forward+backward, and the parts of our backward.


def _train_inputs(seed, m, k, n, norm):
  x, w, scale, bias = _inputs(seed, m, k, n)
  ct = jax.random.normal(jax.random.key(seed + 7), (m, n), jnp.float32).astype(jnp.bfloat16)
  return x, w, scale, (bias if norm == "layer" else None), ct


@contextlib.contextmanager
def _dy_scaled_switch(on):
  """norm_matmul.DX_WRITES_DY_SCALED = ``on`` while a function is traced (None: unchanged)."""
  old = nm.DX_WRITES_DY_SCALED
  nm.DX_WRITES_DY_SCALED = old if on is None else on
  try:
    yield
  finally:
    nm.DX_WRITES_DY_SCALED = old


def _traced_with_dy_scaled(fn, on):
  """``fn`` jitted, traced (forward and backward) with DX_WRITES_DY_SCALED = ``on``."""
  def traced(*args):
    with _dy_scaled_switch(on):
      return fn(*args)
  return jax.jit(traced)


def _api_fns(norm, implementation, dy_scaled=None):
  """(forward, grad) of the public op, jitted; grad of sum(y · ct) wrt (x, w, scale, bias).
  ``dy_scaled``: DX_WRITES_DY_SCALED while they are traced (None: the module's value)."""
  if _SMOKE and implementation == "mosaic":
    implementation = "interpret"
  op = functools.partial(pallas_norm.norm_matmul, norm=norm, eps=EPS,
                         implementation=implementation)

  def loss(x, w, scale, bias, ct):
    return jnp.sum(op(x, w, scale, bias).astype(jnp.float32) * ct.astype(jnp.float32))

  fwd = jax.jit(lambda x, w, scale, bias, ct: op(x, w, scale, bias))
  return fwd, _traced_with_dy_scaled(jax.grad(loss, argnums=(0, 1, 2, 3)), dy_scaled)


def _grad_errors(grads, x, w, scale, bias, ct, norm) -> dict:
  """Relative Frobenius errors of (dx, dw, dscale, dbias) vs the f32 reference's gradients."""
  f32 = lambda a: a.astype(jnp.float32)
  _, vjp = jax.vjp(lambda *a: reference.norm_matmul(*a, norm=norm, eps=EPS), f32(x), f32(w),
                   scale, bias)
  errs = {}
  for name, g, r in zip(("dx", "dw", "dscale", "dbias"), grads, vjp(f32(ct))):
    if r is not None:
      errs[f"err_{name}"] = _rel(g, r)
  errs["ok"] = all(v < 2e-2 for v in errs.values())
  return errs


def run_train(m, k, n, norm, iterations, records):
  """fwd and fwd+bwd through the public API (mosaic vs xla), then our backward's parts."""
  name = f"{m}x{k}x{n}/{norm}"
  print(f"\n=== train step pieces, M={m} K={k} N={n} {norm} (bf16) ===", flush=True)
  sets = [_train_inputs(s, m, k, n, norm) for s in (0, 1)]
  times = {}

  def timed(label, fn, arg_sets, extra=None):
    def one():
      rec = {"shape": f"{m}x{k}x{n}", "norm": norm, "impl": label, **(extra or {})}
      rec["us"] = times[label] = _time(fn, arg_sets, iterations)
      line = f"  {label:<26} {rec['us']:9.1f} us"
      for key in ("err_dx", "err_dw", "err_dscale", "err_dbias", "err"):
        if key in rec:
          line += f"  {key} {rec[key]:.1e}"
      if "dys_mismatches" in rec:  # dy_scaled elements that differ from XLA's
        line += f"  dys_mismatches {rec['dys_mismatches']}"
      if rec.get("ok") is False:
        line += "  <-- WRONG"
      print(line, flush=True)
      records.append(rec)
    _guard(records, f"{name}/{label}", one)

  switch = {"dx_writes_dy_scaled": nm.DX_WRITES_DY_SCALED}
  for impl in ("xla", "mosaic"):
    fwd, grad = _api_fns(norm, impl)
    timed(f"api_fwd/{impl}", fwd, sets, switch)
    errs = _guard(records, f"{name}/grad_check/{impl}",
                  lambda grad=grad: _grad_errors(grad(*sets[0]), *sets[0], norm))
    timed(f"api_fwd+bwd/{impl}", grad, sets, {**(errs or {}), **switch})
  # The A/B of DX_WRITES_DY_SCALED in the same run (the row above has the module's value).
  _, grad = _api_fns(norm, "mosaic", dy_scaled=True)
  errs = _guard(records, f"{name}/grad_check/mosaic_dys",
                lambda: _grad_errors(grad(*sets[0]), *sets[0], norm))
  timed("api_fwd+bwd/mosaic_dys", grad, sets, {**(errs or {}), "dx_writes_dy_scaled": True})
  for what, ours_label in (("api_fwd", "mosaic"), ("api_fwd+bwd", "mosaic"),
                           ("api_fwd+bwd", "mosaic_dys")):
    xla, ours = times.get(f"{what}/xla"), times.get(f"{what}/{ours_label}")
    if xla and ours:
      records.append({"shape": f"{m}x{k}x{n}", "norm": norm, "speedup": f"{what}/{ours_label}",
                      "x": xla / ours})
      print(f"  {what}: {ours_label} {xla / ours:.2f}x faster than xla", flush=True)
  _guard(records, f"{name}/bwd_parts",
         lambda: _run_bwd_parts(m, k, n, norm, sets, timed))
  a = [times.get(key) for key in ("bwd_dx_kernel", "bwd_weights_xla")]
  b = [times.get(key) for key in ("bwd_dx_kernel_dys", "bwd_weights_xla_given_dys")]
  if all(a) and all(b):
    records.append({"shape": f"{m}x{k}x{n}", "norm": norm, "ab": "dy_scaled_parts",
                    "xla_dys_us": sum(a), "kernel_dys_us": sum(b)})
    print(f"  dy_scaled A/B (dx kernel + weight grads): XLA pass {sum(a):.1f} us, kernel "
          f"writes it {sum(b):.1f} us ({sum(b) / sum(a):.2f}x)", flush=True)
  if (off := times.get("bwd_all/xla_dys")) and (on := times.get("bwd_all/kernel_dys")):
    print(f"  dy_scaled A/B (whole backward): {off:.1f} vs {on:.1f} us ({on / off:.2f}x)",
          flush=True)


def _run_bwd_parts(m, k, n, norm, sets, timed):
  """Times each part of our backward on the forward kernel's real outputs."""
  del m, n
  parts = []
  for x, w, scale, bias, ct in sets:
    w_gamma, col_sum, out_bias = nm.fold_affine(w, scale, bias, norm)
    y, mean, rstd = nmk.norm_matmul_fwd(x, w_gamma, col_sum, out_bias, norm=norm, eps=EPS,
                                        out_dtype=jnp.bfloat16, interpret=_SMOKE)
    y_term, c_term = nm._row_terms(ct, y, col_sum, out_bias, rstd, k)
    parts.append(dict(x=x, w=w, scale=scale, bias=bias, dy=ct, w_gamma=w_gamma, col_sum=col_sum,
                      out_bias=out_bias, y=y, mean=mean, rstd=rstd, y_term=y_term,
                      c_term=c_term))
  pick = lambda *keys: [tuple(p[key] for key in keys) for p in parts]
  timed("fold_affine", jax.jit(lambda w, s, b: nm.fold_affine(w, s, b, norm)),
        pick("w", "scale", "bias"))
  timed("bwd_row_terms", jax.jit(lambda dy, y, cs, ob, r: nm._row_terms(dy, y, cs, ob, r, k)),
        pick("dy", "y", "col_sum", "out_bias", "rstd"))
  dx_args = pick("dy", "w_gamma", "x", "rstd", "y_term", "mean", "c_term")
  dx_xla = jax.jit(nm._input_grad_xla)
  dx_kernel = jax.jit(functools.partial(nmb.norm_matmul_dx, interpret=_SMOKE))
  err = _rel(dx_kernel(*dx_args[0]), dx_xla(*dx_args[0]))
  timed("bwd_dx_kernel", dx_kernel, dx_args, {"err": err, "ok": err < 1e-2})
  timed("bwd_dx_xla", dx_xla, dx_args)
  timed("bwd_weights_xla", jax.jit(nm._weight_grads),
        pick("dy", "x", "w", "scale", "bias", "mean", "rstd"))
  _run_dy_scaled_parts(norm, parts, pick, dx_args, dx_xla, timed)


def _run_dy_scaled_parts(norm, parts, pick, dx_args, dx_xla, timed):
  """The A/B of DX_WRITES_DY_SCALED: (a) bwd_dx_kernel + bwd_weights_xla above against (b) the
  dx kernel writing dy_scaled + the weight gradients reading it, then the whole backward of the
  op (row terms on its default path, dx kernel, weight gradients) with the switch off and on."""
  dx_dys = jax.jit(functools.partial(nmb.norm_matmul_dx, return_dy_scaled=True,
                                     interpret=_SMOKE))
  dx, dys = dx_dys(*dx_args[0])
  p0 = parts[0]
  want = (p0["rstd"][:, None] * p0["dy"].astype(jnp.float32)).astype(p0["x"].dtype)
  bad = int(jnp.sum(dys != want))
  err = _rel(dx, dx_xla(*dx_args[0]))
  timed("bwd_dx_kernel_dys", dx_dys, dx_args, {"err": err, "dys_mismatches": bad,
                                               "ok": err < 1e-2 and bad == 0})
  weights_args = [(*a, dx_dys(*d)[1]) for a, d in zip(
      pick("dy", "x", "w", "scale", "bias", "mean", "rstd"), dx_args)]
  timed("bwd_weights_xla_given_dys", jax.jit(nm._weight_grads), weights_args)
  saved_keys = ("x", "w", "scale", "bias", "w_gamma", "col_sum", "out_bias", "y", "mean", "rstd")
  implementation = "interpret" if _SMOKE else "mosaic"

  def bwd(dy, *saved):
    return nm._fused_bwd(norm, EPS, jnp.bfloat16, implementation, saved, (dy, None, None))

  bwd_args = pick("dy", *saved_keys)
  for label, on in (("bwd_all/xla_dys", False), ("bwd_all/kernel_dys", True)):
    timed(label, _traced_with_dy_scaled(bwd, on), bwd_args, {"dx_writes_dy_scaled": on})


# ------------------------------------------------------------------------------------------------
# dx kernel variants.


def run_dx_variants(m, k, n, iterations, records, deadline):
  print(f"\n=== dx kernel variants, M={m} K={k} N={n} (bf16, dx (M, K) = dy (M, N) @ W_γᵀ) ===",
        flush=True)
  sets = []
  for seed in (0, 1):
    ks = jax.random.split(jax.random.key(seed), 6)
    dy = jax.random.normal(ks[0], (m, n), jnp.float32).astype(jnp.bfloat16)
    w_gamma = (jax.random.normal(ks[1], (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    x = jax.random.normal(ks[2], (m, k), jnp.float32).astype(jnp.bfloat16)
    rows = [1.0 + 0.1 * jax.random.uniform(ks[3], (m,))] + [
        0.1 * jax.random.normal(kk, (m,)) for kk in ks[4:]]
    sets.append((dy, w_gamma, x, *rows))
  xla = jax.jit(nm._input_grad_xla)
  layer_args = [(*s[:3], s[3], s[4], s[5], s[3] * 0.01) for s in sets]  # rstd, y_term, mean, c
  rms_args = [(*s[:5], None, None) for s in sets]
  for norm, arg_sets in (("layer", layer_args), ("rms", rms_args)):
    variants = _dx_variants(m, k, n) if norm == "layer" else _dx_variants(m, k, n)[:1]
    base = _guard(records, f"dx/{m}x{k}x{n}/xla",
                  lambda arg_sets=arg_sets: _time(xla, arg_sets, iterations))
    if base is not None:
      print(f"  xla_dx_{norm:<20} {base:9.1f} us", flush=True)
      records.append({"shape": f"{m}x{k}x{n}", "impl": f"xla_dx_{norm}", "us": base})
    want = _guard(records, f"dx/{m}x{k}x{n}/xla_value",
                  lambda arg_sets=arg_sets: xla(*arg_sets[0]))
    if want is None:
      continue
    for label, cfg, step in variants:
      if time.monotonic() > deadline:
        print(f"  (time budget reached: skipping dx_{norm}/{label})", flush=True)
        continue

      def one(cfg=cfg, step=step, label=label, arg_sets=arg_sets, norm=norm):
        fn = jax.jit(functools.partial(nmb.norm_matmul_dx, config=cfg, x_prefetch_step=step,
                                       interpret=_SMOKE))
        rec = {"shape": f"{m}x{k}x{n}", "impl": f"ours_dx_{norm}", "config_label": label,
               "config": dataclasses.asdict(cfg), "x_prefetch_step": step}
        rec["err"] = _rel(fn(*arg_sets[0]), want)
        rec["ok"] = rec["err"] < 1e-2
        rec["us"] = _time(fn, arg_sets, iterations)
        line = f"  ours_dx_{norm}/{label:<16} {rec['us']:9.1f} us"
        if base:
          rec["vs_xla_dx"] = rec["us"] / base
          line += f"  {rec['vs_xla_dx']:.2f}x xla_dx"
        print(line + f"  err {rec['err']:.1e}{'' if rec['ok'] else '  <-- WRONG'}", flush=True)
        records.append(rec)
      _guard(records, f"dx/{m}x{k}x{n}/{norm}/{label}", one)


def run_dx_row_terms(m, k, n, iterations, records, deadline):
  """End-to-end dx including the row terms: XLA pass + dx kernel vs the fused kernel."""
  print(f"\n=== dx with its row terms, M={m} K={k} N={n} (bf16; LayerNorm with out_bias, "
        "RMSNorm without) ===", flush=True)
  sets = []
  for seed in (0, 1):
    ks = jax.random.split(jax.random.key(seed + 10), 8)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
    sets.append(dict(
        dy=normal(ks[0], (m, n)).astype(jnp.bfloat16),
        w_gamma=(normal(ks[1], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16),
        x=normal(ks[2], (m, k)).astype(jnp.bfloat16),
        rstd=1.0 + 0.1 * jax.random.uniform(ks[3], (m,)), mean=0.1 * normal(ks[4], (m,)),
        y=normal(ks[5], (m, n)).astype(jnp.bfloat16), out_bias=0.1 * normal(ks[6], (n,)),
        col_sum=normal(ks[7], (n,))))
  keys = ("dy", "w_gamma", "x", "rstd", "mean", "y", "out_bias", "col_sum")

  def unfused(dx_fn):
    def fn(dy, w_gamma, x, rstd, mean, y, out_bias, col_sum):
      y_term, c_term = nm._row_terms(dy, y, col_sum, out_bias, rstd, k)
      return dx_fn(dy, w_gamma, x, rstd, y_term, mean, c_term)
    return jax.jit(fn)

  def fused(cfg, dys=False):
    return jax.jit(lambda dy, w_gamma, x, rstd, mean, y, out_bias, col_sum: nmb.norm_matmul_dx(
        dy, w_gamma, x, rstd, mean=mean, y=y, out_bias=out_bias, col_sum=col_sum, config=cfg,
        return_dy_scaled=dys, interpret=_SMOKE))

  def dys_configs(fused_rows):  # return_dy_scaled: pick_config's (32-wide steps), 64-wide
    cfg = nmb.pick_config(m, n, k, fused_row_terms=fused_rows, dy_scaled=True)
    return [("dys", cfg), ("dys_k64", dataclasses.replace(cfg, tile_k=64))]

  for norm in ("layer", "rms"):
    drop = () if norm == "layer" else ("mean", "out_bias", "col_sum")
    arg_sets = [tuple(None if key in drop else st[key] for key in keys) for st in sets]
    reference_fn = unfused(nm._input_grad_xla)
    want = _guard(records, f"dx_rows/{m}x{k}x{n}/{norm}/xla_value",
                  lambda arg_sets=arg_sets: reference_fn(*arg_sets[0]))
    if want is None:
      continue
    times = {}
    cases = [(f"xla_rows+xla_dx_{norm}", None, reference_fn),
             (f"xla_rows+ours_dx_{norm}", None,
              unfused(functools.partial(nmb.norm_matmul_dx, interpret=_SMOKE)))]
    cases += [(f"ours_dx_{norm}", (label, cfg), fused(cfg))
              for label, cfg in _fused_dx_variants(m, k, n)]
    # The same two paths with the kernel also writing dy_scaled (return_dy_scaled).
    cases += [(f"xla_rows+ours_dx_{norm}+dys", (label, cfg), unfused(functools.partial(
        nmb.norm_matmul_dx, config=cfg, return_dy_scaled=True, interpret=_SMOKE)))
              for label, cfg in dys_configs(False)]
    cases += [(f"ours_dx_{norm}+dys", (f"fused_{label}", cfg), fused(cfg, dys=True))
              for label, cfg in dys_configs(True)[:1]]
    for impl, variant, fn in cases:
      name = impl if variant is None else f"{impl}/{variant[0]}"
      if time.monotonic() > deadline:
        print(f"  (time budget reached: skipping {name})", flush=True)
        continue

      def one(impl=impl, variant=variant, fn=fn, name=name, arg_sets=arg_sets):
        rec = {"shape": f"{m}x{k}x{n}", "impl": impl, "row_terms": "in-kernel"
               if variant and not impl.startswith("xla_rows") else "xla"}
        if variant is not None:
          rec.update(config_label=variant[0], config=dataclasses.asdict(variant[1]))
        out = fn(*arg_sets[0])
        if isinstance(out, tuple):  # (dx, dy_scaled): dy_scaled must be XLA's, bit for bit
          dy, rstd = arg_sets[0][0], arg_sets[0][3]
          want_dys = (rstd[:, None] * dy.astype(jnp.float32)).astype(dy.dtype)
          rec["dys_mismatches"] = int(jnp.sum(out[1] != want_dys))
          out = out[0]
        rec["err"] = _rel(out, want)
        rec["ok"] = rec["err"] < 1e-2 and not rec.get("dys_mismatches")
        rec["us"] = times[name] = _time(fn, arg_sets, iterations)
        line = f"  {name:<34} {rec['us']:9.1f} us"
        if (today := times.get(f"xla_rows+ours_dx_{norm}")) and variant is not None:
          rec["vs_xla_rows+ours_dx"] = rec["us"] / today
          line += f"  {rec['vs_xla_rows+ours_dx']:.2f}x xla_rows+ours_dx"
        if "dys_mismatches" in rec:
          line += f"  dys_mismatches {rec['dys_mismatches']}"
        print(line + f"  err {rec['err']:.1e}{'' if rec['ok'] else '  <-- WRONG'}", flush=True)
        records.append(rec)
      _guard(records, f"dx_rows/{m}x{k}x{n}/{name}", one)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="only the seed shape and its tail case")
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--sections", default=",".join(SECTIONS),
                 help=f"comma-separated subset of {SECTIONS} (run in that order)")
  p.add_argument("--budget-s", type=float, default=TIME_BUDGET_S,
                 help="start no new case after this many seconds")
  p.add_argument("--json-name", default="norm_matmul_check.json")
  p.add_argument("--smoke", action="store_true",
                 help="CPU check of this script: tiny shapes, interpret mode, wall clock")
  p.add_argument("--dx-writes-dy-scaled", action="store_true",
                 help="norm_matmul.DX_WRITES_DY_SCALED on for the whole run (the public-API "
                      "rows of the train section then have the dx kernel write rstd ⊙ dy)")
  args = p.parse_args(argv)
  if args.dx_writes_dy_scaled:
    nm.DX_WRITES_DY_SCALED = True
  global _SMOKE, SHAPES, QUICK_SHAPES, TRAIN_SHAPES, VARIANT_SHAPES
  if args.smoke:
    _SMOKE = True
    SHAPES = QUICK_SHAPES = SMOKE_SHAPES
    TRAIN_SHAPES = VARIANT_SHAPES = SMOKE_SHAPES[:1]
    args.iterations = 1
  sections = [sec for sec in args.sections.split(",") if sec]
  if bad := [sec for sec in sections if sec not in SECTIONS]:
    p.error(f"unknown sections {bad}; choose from {SECTIONS}")
  print(f"devices: {jax.devices()}  sections: {sections}  DX_WRITES_DY_SCALED: "
        f"{nm.DX_WRITES_DY_SCALED}", flush=True)
  start = time.monotonic()
  deadline = start + args.budget_s
  records: list[dict] = []

  def late(what) -> bool:
    if time.monotonic() <= deadline:
      return False
    print(f"time budget reached: skipping {what}", flush=True)
    return True

  if "accuracy" in sections:
    run_accuracy(records)
  shapes: dict[tuple, _Shape] = {}

  def shape_pass1(m, k, n):
    """XLA's baselines and our default configs for one shape (needed by the variants)."""
    print(f"\n=== M={m} K={k} N={n} (bf16) ===", flush=True)
    sh = _guard(records, f"{m}x{k}x{n}/inputs", lambda: _Shape(m, k, n, args.iterations,
                                                                 records))
    if sh is None:
      return
    shapes[(m, k, n)] = sh
    sh.time_xla()
    for norm in ("none", "rms", "layer"):
      label, cfg = _variants(m, k, n)[norm][0]
      sh.run_kernel(norm, label, cfg)

  if "fwd" in sections:
    for mkn in (QUICK_SHAPES if args.quick else SHAPES):
      if not late(f"fwd {mkn}"):
        shape_pass1(*mkn)
  if "train" in sections:
    for m, k, n in TRAIN_SHAPES[:1] if args.quick else TRAIN_SHAPES:
      for norm in ("rms", "layer"):
        if not late(f"train {m}x{k}x{n}/{norm}"):
          run_train(m, k, n, norm, args.iterations, records)
  if "dx" in sections:
    for m, k, n in TRAIN_SHAPES[:1] if args.quick else TRAIN_SHAPES:
      if not late(f"dx {m}x{k}x{n}"):
        run_dx_variants(m, k, n, args.iterations, records, deadline)
      if not late(f"dx row terms {m}x{k}x{n}"):
        run_dx_row_terms(m, k, n, args.iterations, records, deadline)
  if "variants" in sections:
    for mkn in (VARIANT_SHAPES[:1] if args.quick else VARIANT_SHAPES):
      if mkn not in shapes and not late(f"fwd {mkn}"):
        shape_pass1(*mkn)
      if (sh := shapes.get(mkn)) is None:
        continue
      print(f"\n=== variants, M={sh.m} K={sh.k} N={sh.n} ===", flush=True)
      for norm in ("none", "rms", "layer"):
        for label, cfg in _variants(sh.m, sh.k, sh.n)[norm][1:]:
          if not late(f"{NAMES[norm]}/{label}"):
            sh.run_kernel(norm, label, cfg)
  wrong = [r for r in records if r.get("ok") is False]
  failed = [r for r in records if "error" in r]
  print(f"\n{len(records)} records, {len(wrong)} wrong, {len(failed)} failed, "
        f"{time.monotonic() - start:.0f} s", flush=True)
  if out := os.environ.get("OUT"):
    path = os.path.join(out, args.json_name)
    with open(path, "w") as f:
      json.dump({"device": str(jax.devices()[0]), "sections": sections,
                 "dx_writes_dy_scaled": nm.DX_WRITES_DY_SCALED, "records": records}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
