"""GPU check of the post-norm GEMM kernel (``matmul_norm``): correctness at real sizes, then
CUPTI timing against XLA. Run on the H200 from the repository root (< 3 minutes)::

    PYTHONPATH=$PWD python3 benchmarks/gpu_matmul_norm_check.py [--iterations 10] [--quick]

Per shape (M, K, N), with bf16 x, w, residual and f32 dense_bias / scale / bias:

1. correctness of the kernel (LayerNorm with everything on, and RMSNorm with no residual)
   against :func:`pallas_norm.reference.matmul_norm` on float32-upcast inputs: max error
   relative to max |value| of y and h, max relative error of mean/rstd; plus rows of h with
   mean 1e3 and γ with zeros at the first shape;
2. CUPTI kernel times (median of ``--iterations`` runs):
   ``xla_gemm`` (``x @ w`` alone: the limit), ``xla_ln_res`` (XLA's jit of the unfused
   reference: GEMM + dense bias + residual + LayerNorm + affine), ``ours_ln_res`` (the kernel,
   y only), ``ours_ln_res_train`` (the kernel as the custom_vjp forward runs it: y, x̂, stats),
   ``ours_ln_res_mc`` (TMA multicast of x across the cluster, when N needs one), ``xla_rms`` /
   ``ours_rms`` (no residual, no vectors), and, for ``--train`` shapes, ``jax.grad`` through
   the public op with ``implementation="mosaic"`` vs ``"xla"``.

Printed ratios: vs XLA's GEMM, vs the unfused XLA op, and the share of the norm's cost hidden,
(T_xla − T_ours) / (T_xla − T_gemm). Each case is guarded: an exception is printed and the
script moves on. Results go to $OUT/matmul_norm_check.json when OUT is set. ``--smoke`` runs the
same code paths on the CPU (tiny shapes, interpret mode, wall-clock times that mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm import reference
from pallas_norm.ops import matmul_norm as mn
from pallas_norm.ops import matmul_norm_mgpu as mk

EPS = 1e-6
SHAPES = [(262144, 512, 512), (262144, 512, 2048), (262144, 128, 128), (65536, 2048, 2048),
          (16384, 8192, 8192),  # 8 CTAs × 4 N tiles: the two-pass epilogue
          (131072 + 77, 512, 1024)]  # an M tail (padded to 8 rows by the op)
QUICK_SHAPES = SHAPES[:2]
TRAIN_SHAPES = [(262144, 512, 512), (65536, 2048, 2048)]
SMOKE_SHAPES = [(256, 64, 256), (77, 64, 512)]
TIME_BUDGET_S = 160  # stop starting new cases past this
_SMOKE = False


def _inputs(seed, m, k, n, mean_offset=0.0, zero_every=0):
  ks = jax.random.split(jax.random.key(seed), 7)
  bf = jnp.bfloat16
  x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(bf)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / np.sqrt(k)).astype(bf)
  dense_bias = 0.5 * jax.random.normal(ks[2], (n,), jnp.float32) + mean_offset
  residual = jax.random.normal(ks[3], (m, n), jnp.float32).astype(bf)
  scale = 1.0 + 0.3 * jax.random.normal(ks[4], (n,), jnp.float32)
  if zero_every:
    scale = scale.at[::zero_every].set(0.0)
  bias = 0.3 * jax.random.normal(ks[5], (n,), jnp.float32)
  ct = jax.random.normal(ks[6], (m, n), jnp.float32).astype(bf)
  return x, w, dense_bias, residual, scale, bias, ct


def _kernel(x, w, dense_bias=None, residual=None, scale=None, bias=None, *, norm, **flags):
  return mk.matmul_norm_fwd(x, w, dense_bias, residual, scale, bias, norm=norm, eps=EPS,
                            interpret=_SMOKE, **flags)


def _rel(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def check_accuracy(m, k, n, *, mean_offset=0.0, zero_every=0):
  """Errors of the kernel against the f32 reference, LayerNorm (all inputs) and RMSNorm."""
  x, w, db, res, scale, bias, _ = _inputs(m + n, m, k, n, mean_offset, zero_every)
  out = {}
  for norm, use_res in (("layer", True), ("rms", False)):
    r = res if use_res else None
    vecs = (db, scale, bias) if use_res else (None, None, None)
    y, h, xhat, mean, rstd = jax.jit(functools.partial(
        _kernel, norm=norm, return_h=True, return_xhat=True, return_stats=True))(
            x, w, vecs[0], r, vecs[1], vecs[2])
    f = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
    y_ref, h_ref, st = jax.jit(functools.partial(
        reference.matmul_norm, norm=norm, eps=EPS, return_h=True, return_stats=True))(
            f(x), f(w), f(vecs[0]), f(r), f(vecs[1]), f(vecs[2]))
    centered = h_ref if st.mean is None else h_ref - st.mean[:, None]
    errs = {"y": _rel(y, y_ref), "h": _rel(h, h_ref),
            "xhat": _rel(xhat, centered * st.rstd[:, None]),
            "rstd": float(jnp.max(jnp.abs(rstd / st.rstd - 1)))}
    if mean is not None:
      errs["mean"] = float(jnp.max(jnp.abs(mean - st.mean)) / (jnp.max(jnp.abs(st.mean)) + 1e-9))
    errs["finite"] = bool(jnp.all(jnp.isfinite(jnp.asarray(y, jnp.float32))))
    errs["ok"] = errs["finite"] and errs["y"] < 8e-3 and errs["h"] < 8e-3 and errs["rstd"] < 1e-3
    out[norm] = errs
  return out


def _time(fn, *args, iterations):
  """Median kernel time in µs of the jitted ``fn(*args)`` (CUPTI; wall clock with --smoke)."""
  if _SMOKE:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(2):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append((time.perf_counter() - t0) * 1e3)
  else:
    from jax.experimental.mosaic.gpu import profiler
    _, times = profiler.measure(fn, iterations=iterations)(*args)
    if times is None:
      raise RuntimeError("no kernel launched")
  return statistics.median(times) * 1e3


def time_shape(m, k, n, iterations, train):
  x, w, db, res, scale, bias, ct = _inputs(m * 3 + n, m, k, n)
  times, errors = {}, {}
  split = mk._tiles_per_cta(n, mk.pick_config(m, k, n).tile_n, interpret=_SMOKE)
  fns = {
      "xla_gemm": (jax.jit(lambda x, w: x @ w), (x, w)),
      "xla_ln_res": (jax.jit(functools.partial(reference.matmul_norm, norm="layer", eps=EPS)),
                     (x, w, db, res, scale, bias)),
      "ours_ln_res": (jax.jit(lambda *a: _kernel(*a, norm="layer")[0]),
                      (x, w, db, res, scale, bias)),
      "ours_ln_res_train": (jax.jit(lambda *a: _kernel(*a, norm="layer", return_xhat=True,
                                                        return_stats=True)),
                            (x, w, db, res, scale, bias)),
      "xla_rms": (jax.jit(functools.partial(reference.matmul_norm, norm="rms", eps=EPS)),
                  (x, w)),
      "ours_rms": (jax.jit(lambda x, w: _kernel(x, w, norm="rms")[0]), (x, w)),
  }
  if split[0] > 1:
    fns["ours_ln_res_mc"] = (jax.jit(lambda *a: _kernel(*a, norm="layer", multicast_x=True)[0]),
                             (x, w, db, res, scale, bias))
  if train:
    for impl in ("xla", "mosaic"):
      if _SMOKE and impl == "mosaic":
        impl = "interpret"

      def loss(x, w, db, res, scale, bias, impl=impl):
        y = mn.matmul_norm(x, w, db, res, scale, bias, norm="layer", eps=EPS,
                           implementation=impl)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

      label = "grad_xla" if impl == "xla" else "grad_ours"
      fns[label] = (jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))),
                    (x, w, db, res, scale, bias))
  for name, (fn, args) in fns.items():
    try:
      times[name] = round(_time(fn, *args, iterations=iterations), 1)
      print(f"  {name:<20} {times[name]:>9.1f} us", flush=True)
    except Exception as e:  # keep going: one failing variant must not hide the others
      errors[name] = f"{type(e).__name__}: {str(e)[:400]}"
      print(f"  {name:<20} FAILED {errors[name]}", flush=True)
  return times, errors, split


GRID_SWEEP_SHAPES = [(262144, 512, 256), (262144, 512, 512), (262144, 512, 1024),
                     (262144, 512, 2048)]


def grid_sweep(m, k, n, iterations):
  """The forward kernel (LayerNorm + residual, y only) in variants that time the parts of the
  cluster exchange, with 32-wide K steps, with one WGMMA in flight across K steps, and with
  ping-pong consumers. Each variant's y is checked against XLA's before
  it is timed, except the diagnostics (``_DIAG``) that skip part of the exchange."""
  import dataclasses
  x, w, db, res, scale, bias, _ = _inputs(m * 5 + n, m, k, n)
  base = mk.pick_config(m, k, n)
  cluster = mk._tiles_per_cta(n, base.tile_n, interpret=_SMOKE)[0]
  want = jax.jit(functools.partial(reference.matmul_norm, norm="layer", eps=EPS))(
      x, w, db, res, scale, bias)
  out = {"cluster": cluster, "us": {}, "err": {}}
  variants = [("pull", base, False, "pull")]
  if cluster > 1:
    # The push exchange, and what each step of pull costs: without its cluster fences, without
    # its peer reads (barriers and fences only), and no exchange at all (the _DIAG variants give
    # a wrong y and are timed anyway). Then 32-wide K steps, which fit twice the stages.
    k32 = dataclasses.replace(base, tile_k=32, max_concurrent_steps=8)
    variants += [("push", base, False, "push"), ("pull_nofence", base, False, "pull_nofence"),
                 ("barrier_only_DIAG", base, False, "barrier_only"),
                 ("local_DIAG", base, False, "local"),
                 ("pull_k32", k32, False, "pull"), ("local_k32_DIAG", k32, False, "local")]
  # One WGMMA left in flight across K steps (TileConfig.delay_release), and ping-pong consumers
  # (TileConfig.pingpong: one warpgroup's epilogue and exchange overlap the other's WGMMAs).
  variants += [("inflight", dataclasses.replace(base, delay_release=1), False, "pull"),
               ("pingpong", mk.pingpong_config(m, k, n), False, "pull")]
  if cluster > 1:
    variants += [("pingpong_push", mk.pingpong_config(m, k, n), False, "push")]
  for label, cfg, mc, exchange in variants:
    try:
      fn = jax.jit(lambda *a, cfg=cfg, mc=mc, ex=exchange: _kernel(
          *a, norm="layer", config=cfg, multicast_x=mc, exchange=ex)[0])
      err = _rel(fn(x, w, db, res, scale, bias), want)
      out["err"][label] = err
      if err > 2e-2 and not label.endswith("_DIAG"):
        print(f"  {label:<16} WRONG (rel. error {err:.3g}): not timed", flush=True)
        continue
      out["us"][label] = round(_time(fn, x, w, db, res, scale, bias, iterations=iterations), 1)
      print(f"  {label:<16} {out['us'][label]:>9.1f} us  (cluster {cluster}, err {err:.1e})",
            flush=True)
    except Exception as e:  # noqa: BLE001
      out["err"][label] = f"{type(e).__name__}: {str(e)[:300]}"
      print(f"  {label:<16} FAILED {out['err'][label]}", flush=True)
  return out


OPERAND_AB_SHAPES = [(262144, 512, 512), (262144, 512, 1024)]


def operand_ab(m, k, n, iterations):
  """The forward kernel (LayerNorm, y only, default exchange) with each optional operand on and
  off: what the dense bias, the residual and the affine vectors cost in the epilogue. Session 5:
  the grid sweep (dense bias on) timed 262144x512x512 at ~500 µs, the suite (no dense bias) at
  ~380 µs; this isolates the operand."""
  x, w, db, res, scale, bias, _ = _inputs(m * 5 + n, m, k, n)
  variants = {"all": (db, res, scale, bias), "no_dense_bias": (None, res, scale, bias),
              "no_residual": (db, None, scale, bias), "no_affine": (db, res, None, None),
              "dense_bias_only": (db, None, None, None), "none": (None, None, None, None)}
  out = {"us": {}, "err": {}}
  for label, ops in variants.items():
    try:
      fn = jax.jit(lambda x, w, *a: _kernel(x, w, *a, norm="layer")[0])
      want = reference.matmul_norm(x, w, *ops, norm="layer", eps=EPS)
      err = _rel(fn(x, w, *ops), want)
      out["err"][label] = err
      if err > 2e-2:
        print(f"  {label:<16} WRONG (rel. error {err:.3g}): not timed", flush=True)
        continue
      out["us"][label] = round(_time(fn, x, w, *ops, iterations=iterations), 1)
      print(f"  {label:<16} {out['us'][label]:>9.1f} us  (err {err:.1e})", flush=True)
    except Exception as e:  # noqa: BLE001
      out["err"][label] = f"{type(e).__name__}: {str(e)[:300]}"
      print(f"  {label:<16} FAILED {out['err'][label]}", flush=True)
  return out


def _ratios(t):
  r = {}
  gemm, xla, ours = t.get("xla_gemm"), t.get("xla_ln_res"), t.get("ours_ln_res")
  if gemm and ours:
    r["ours_ln_res/xla_gemm"] = round(ours / gemm, 3)
  if xla and ours:
    r["xla_ln_res/ours_ln_res"] = round(xla / ours, 3)
  if gemm and xla and ours and xla > gemm:
    r["hidden_share"] = round((xla - ours) / (xla - gemm), 3)
  if t.get("ours_ln_res_train") and gemm:
    r["ours_ln_res_train/xla_gemm"] = round(t["ours_ln_res_train"] / gemm, 3)
  if t.get("xla_rms") and t.get("ours_rms"):
    r["xla_rms/ours_rms"] = round(t["xla_rms"] / t["ours_rms"], 3)
  if t.get("grad_xla") and t.get("grad_ours"):
    r["grad_xla/grad_ours"] = round(t["grad_xla"] / t["grad_ours"], 3)
  return r


def _sweep(key, title, shapes, time_one, iterations):
  """Runs ``time_one(m, k, n, iterations)`` per shape; JSON to $OUT/matmul_norm_<key>.json."""
  report = {"device": str(jax.devices()[0]), key: {}}
  for m, k, n in (SMOKE_SHAPES if _SMOKE else shapes):
    print(f"{title} {m}x{k}x{n}:", flush=True)
    report[key][f"{m}x{k}x{n}"] = time_one(m, k, n, iterations)
  if out_dir := os.environ.get("OUT"):
    with open(os.path.join(out_dir, f"matmul_norm_{key}.json"), "w") as f:
      json.dump(report, f, indent=1)
  return 0


def main(argv=None):
  global _SMOKE
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--quick", action="store_true", help="only the first two shapes")
  parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpret mode")
  parser.add_argument("--grid-sweep", action="store_true",
                      help="only time the exchange diagnostics and 32-wide K steps of the "
                      "kernel, at GRID_SWEEP_SHAPES")
  parser.add_argument("--operand-ab", action="store_true",
                      help="only time the kernel with each optional operand on and off, at "
                      "OPERAND_AB_SHAPES")
  args = parser.parse_args(argv)
  _SMOKE = args.smoke
  if args.operand_ab:
    return _sweep("operand_ab", "operand A/B", OPERAND_AB_SHAPES, operand_ab, args.iterations)
  if args.grid_sweep:
    return _sweep("grid_sweep", "grid sweep", GRID_SWEEP_SHAPES, grid_sweep, args.iterations)
  shapes = SMOKE_SHAPES if _SMOKE else (QUICK_SHAPES if args.quick else SHAPES)
  train_shapes = SMOKE_SHAPES[:1] if _SMOKE else TRAIN_SHAPES
  start = time.time()
  report = {"device": str(jax.devices()[0]), "jax": jax.__version__,
            "iterations": args.iterations, "accuracy": {}, "timing": {}}
  print(f"device: {report['device']}", flush=True)

  acc_cases = [(shapes[0], {}), (shapes[0], {"mean_offset": 1e3, "zero_every": 7})]
  acc_cases += [(s, {}) for s in shapes[1:]]
  if not _SMOKE:  # rows with a large mean through the two-pass epilogue too
    acc_cases.append(((16384, 512, 8192), {"mean_offset": 1e3, "zero_every": 7}))
  for (m, k, n), kw in acc_cases:
    label = f"{m}x{k}x{n}" + ("_mean1e3_zero_gamma" if kw else "")
    try:
      report["accuracy"][label] = res = check_accuracy(m, k, n, **kw)
      print(f"accuracy {label}: {json.dumps(res)}", flush=True)
    except Exception as e:
      report["accuracy"][label] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
      print(f"accuracy {label}: FAILED", flush=True)
      traceback.print_exc()

  for m, k, n in shapes:
    if time.time() - start > TIME_BUDGET_S:
      print(f"time budget of {TIME_BUDGET_S} s spent: skipping {m}x{k}x{n}", flush=True)
      continue
    label = f"{m}x{k}x{n}"
    print(f"timing {label}:", flush=True)
    try:
      times, errors, split = time_shape(m, k, n, args.iterations, (m, k, n) in train_shapes)
      ratios = _ratios(times)
      report["timing"][label] = {"cluster": split[0], "n_tiles": split[1], "us": times,
                                 "ratios": ratios,
                                 "errors": errors}
      print(f"  ratios: {json.dumps(ratios)}", flush=True)
    except Exception as e:
      report["timing"][label] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
      traceback.print_exc()

  report["wall_s"] = round(time.time() - start, 1)
  out_dir = os.environ.get("OUT")
  if out_dir:
    path = os.path.join(out_dir, "matmul_norm_check.json")
    with open(path, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
