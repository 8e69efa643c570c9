"""gemm22 A/B (issue 22): the fused GEMMs' training at 262144×1024² (and 512²), one GPU process.

    PYTHONPATH=$PWD python3 .devcarry/gemm22_ab/ab.py [--budget-s 170] [--parts op,nmfwd,dx,nb,mnfwd,route]
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/gemm22_ab/ab.py --tiny   # CPU smoke (interpret)

One tree (this branch), main's behaviour by configuration: this branch changes no kernel and no
tiling, only ``implementation=None``'s domain (``configs.kernel_slower_reason``), so main's
default at a re-routed shape is the "xla" row and the branch's the "mosaic" row (the script
logs the route the branch's configs take for each case).

Parts, run in this order (a part starts only with budget left; each lowers its programs, then
compiles them in threads; every output is checked against the f32 reference before timing;
variants interleaved A,B,A,B over ROUNDS rounds; CUPTI per-kernel lists, benchmarks.timing's
rotation over 2 input sets):

  op     fwd+bwd at 262144×1024² (matmul_norm rms, layer+res; norm_matmul layer) and
         262144×512² (matmul_norm layer+res): "mosaic" (main's kernels = the branch's) and
         "xla"; the per-kernel list of each (where the time goes); the path the branch's
         implementation=None trains on is logged (main: XLA for matmul_norm rms 1024²).
  nmfwd  norm_matmul's forward kernel alone at 262144×1024²: default (stats_once on the ring,
         one WGMMA in flight), pallas (stats_once on Pallas's pipeline: main's kernel before
         the ring), and for LayerNorm no_once (statistics in every K loop), delay0; and
         LayerNorm's dW_γ GEMM with the ones block (x̂ (M, K+32)ᵀ dy) vs without it plus XLA's
         Σ dy column sum.
  dx     norm_matmul's dx kernel alone (row sums in the epilogue, x̂ out; LayerNorm's with its
         ones block) at 262144×1024², both norms: default, k32 (32-wide N steps, up to 6
         stages), epi64 (64-wide output chunks), delay1 (one WGMMA in flight); LayerNorm also
         without the ones block (its time includes XLA's concatenation, as an upper bound).
  nb     matmul_norm's norm backward alone (norms.triton.norm_backward, x̂ and rstd given) at
         262144×1024, both norms with the suite's sums, under (elements per step, programs per
         SM, warps) tilings; "main" is TILINGS' (layer 2048×8, rms 4096×12, 4 warps).
  mnfwd  matmul_norm's training forward kernel alone (y, x̂, stats) at 262144×1024², rms and
         layer+res: default (cluster 4 × 256 columns), c8 (cluster 8 × 128 columns, 256 rows),
         delay1 (one WGMMA in flight), epi32 (32-wide output chunks: y's store of a chunk has
         longer to leave SMEM before x̂ reuses it), k32 (32-wide K steps, up to 6 stages).
  route  the re-routed / bounding shapes, "xla" vs "mosaic": norm_matmul rms M×2048² at
         M = 65536, 131072, 262144 (the new rule takes M <= 65536), matmul_norm rms
         65536×1024² (the new rule takes M >= 262144).

Output: lines as they come, $OUT/ab.json (rewritten after each part), $OUT/ab.log is the
caller's tee.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import cases as C
from benchmarks import run as R
from benchmarks import timing
from pallas_norm import reference
from pallas_norm.mgpu import TileConfig
from pallas_norm.ops.matmul_norm import mosaic as mn_mosaic
from pallas_norm.ops.norm_matmul import mosaic as nm_mosaic
from pallas_norm.ops.norm_matmul import mosaic_bwd as nm_bwd
from pallas_norm.ops.norm_matmul import xla as nm_xla
from pallas_norm.ops.norms import triton as T

ROUNDS, ITERS = 3, 5
F32 = jnp.float32


def log(msg):
  print(msg, flush=True)


class Results:
  def __init__(self, out_dir, meta):
    self.out_dir, self.data = out_dir, {**meta, "rows": []}
    os.makedirs(out_dir, exist_ok=True)

  def add(self, row):
    self.data["rows"].append(row)
    log("RESULT " + json.dumps(row))

  def flush(self):
    with open(os.path.join(self.out_dir, "ab.json"), "w") as f:
      json.dump(self.data, f, indent=1)


# ------------------------------------------------------------------------------------------------
# Timing: CUPTI per-kernel lists (wall clock in --tiny), interleaved variants.


def kernel_times(fn, sets, iters, timer):
  """(per-call µs list, [(kernel, median µs)]) of a compiled fn rotating over sets."""
  if timer == "wall":
    return timing.measure_us(fn, sets, iters, "wall"), []
  from jax.experimental.mosaic.gpu import profiler
  _, runs = profiler.measure(timing.Rotating(fn, sets), aggregate=False, iterations=iters)()
  if iters == 1:
    runs = [runs]
  per_call = [1e3 * sum(ms for _, ms in r) for r in runs]
  by = {}
  for r in runs:
    seen = {}
    for name, ms in r:
      key = f"{name}#{seen[name]}" if name in seen else name
      seen[name] = seen.get(name, 0) + 1
      by.setdefault(key, []).append(1e3 * ms)
  return per_call, [(k, round(statistics.median(v), 1)) for k, v in by.items()]


def time_interleaved(fns: dict, sets, timer):
  """{name: (median µs, min µs, per-round medians, kernels)} over ROUNDS rounds A,B,A,B."""
  per = {k: [] for k in fns}
  rounds = {k: [] for k in fns}
  kernels = {}
  for _ in range(ROUNDS):
    for name, fn in fns.items():
      ts, ks = kernel_times(fn, sets, ITERS, timer)
      per[name] += ts
      rounds[name].append(round(statistics.median(ts), 1))
      kernels[name] = ks
  return {k: (round(statistics.median(v), 1), round(min(v), 1), rounds[k], kernels[k])
          for k, v in per.items() if v}


def compile_all(lowered: dict, workers: int):
  """{key: compiled or Exception} from {key: lowered or Exception}, in threads."""
  out = {}
  with cf.ThreadPoolExecutor(max(1, min(workers, os.cpu_count() or 2))) as pool:
    futs = {k: pool.submit(v.compile) for k, v in lowered.items() if not isinstance(v, Exception)}
    for k, v in lowered.items():
      if isinstance(v, Exception):
        out[k] = v
    for k, f in futs.items():
      try:
        out[k] = f.result()
      except Exception as e:  # noqa: BLE001
        out[k] = e
  return out


def short(e):
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


@contextlib.contextmanager
def patched(patches):
  old = {k: getattr(*k) for k in patches}
  try:
    for (mod, attr), v in patches.items():
      setattr(mod, attr, v)
    yield
  finally:
    for (mod, attr), v in old.items():
      setattr(mod, attr, v)


# ------------------------------------------------------------------------------------------------
# Part "op" and "route": the suite's cases, public functions.


def suite_case(op, variant, mkn, tiny):
  c = C.Case(op, variant, (("M", mkn[0]), ("K", mkn[1]), ("N", mkn[2])), "fwd+bwd")
  return C.tiny(c) if tiny else c


def run_cases(part, specs, args, res, t_end):
  """specs: [(op, variant, (m, k, n), impls)]."""
  kernel = "interpret" if args.tiny else "mosaic"
  plan = []
  t0 = time.monotonic()
  lowered = {}
  for ci, (op, variant, mkn, impls) in enumerate(specs):
    case = suite_case(op, variant, mkn, args.tiny)
    prob = C.build(case, kernel)
    make, _ = R.input_maker(prob, case.mode, host=args.tiny)
    abstract = jax.eval_shape(lambda: R.make_inputs(prob, case.mode,
                                                    C.DeviceRandom(jax.random.key(0))))
    check = R.checker(R.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True))
    outs = jax.eval_shape(R.with_mode(prob.impl_fn("xla"), prob.diff, case.mode), *abstract)
    for impl in impls:
      name = kernel if impl == "mosaic" else impl
      try:
        fn = jax.jit(R.with_mode(prob.impl_fn(name), prob.diff, case.mode))
        lowered[(ci, impl)] = fn.lower(*abstract)
      except Exception as e:  # noqa: BLE001
        lowered[(ci, impl)] = e
    plan.append((case, make, check, outs, abstract, impls))
    log(f"part={part} {case.name}: implementation=None trains on {route(op, variant, mkn)} "
        "on this branch")
  # Few threads: XLA autotunes the cuBLAS GEMMs of these programs on the GPU while compiling,
  # and concurrent autotuning could hand the variants different GEMM algorithms.
  compiled = compile_all(lowered, workers=2)
  for case, make, check, outs, abstract, _ in plan:  # the oracles, in the main thread
    check.compile_for(outs, *abstract)
  log(f"part={part} lowered+compiled {len(lowered)} programs in {time.monotonic() - t0:.0f}s")
  for ci, (case, make, check, _, _, impls) in enumerate(plan):
    if time.monotonic() > t_end:
      log(f"part={part} {case.name}: skipped (budget)")
      continue
    sets = [make(R._seed(case.name, i)) for i in range(2)]
    fns, rows = {}, {}
    for impl in impls:
      row = {"part": part, "case": case.name, "impl": impl}
      fn = compiled[(ci, impl)]
      if isinstance(fn, Exception):
        row.update(status="error", message=short(fn))
      else:
        try:
          err = R.rel_err(check(fn(*sets[0]), *sets[0]))
          row.update(err=float(f"{err:.2e}"), status="ok" if err < R.TOLERANCE else "wrong")
          if err < R.TOLERANCE:
            fns[impl] = fn
        except Exception as e:  # noqa: BLE001
          row.update(status="error", message=short(e))
      rows[impl] = row
    try:
      for impl, (med, mn, rnd, ks) in time_interleaved(fns, sets, args.timer).items():
        rows[impl].update(us=med, us_min=mn, rounds=rnd, kernels=ks)
    except Exception as e:  # noqa: BLE001
      for impl in fns:
        rows[impl].update(status="error", message=short(e))
    base = rows.get("xla", {}).get("us")
    for row in rows.values():
      if base and row.get("us"):
        row["vs_xla"] = round(row["us"] / base, 3)
      res.add(row)
    del sets
  res.flush()


def route(op, variant, mkn):
  """The path implementation=None takes to train at this shape on a Hopper GPU (this branch's
  configs; main's: "xla" at the shapes this branch re-routed)."""
  from pallas_norm.ops.matmul_norm import configs as mn_configs
  from pallas_norm.ops.norm_matmul import configs as nm_configs
  configs = mn_configs if op == "matmul_norm" else nm_configs
  norm = "rms" if variant == "rms" else "layer"
  return "xla" if configs.kernel_slower_reason(*mkn, norm) else "mosaic"


OP_SPECS = [
    ("matmul_norm", "rms", (262144, 1024, 1024), ("mosaic", "xla")),
    ("matmul_norm", "layer+res", (262144, 1024, 1024), ("mosaic", "xla")),
    ("norm_matmul", "layer", (262144, 1024, 1024), ("mosaic", "xla")),
    ("matmul_norm", "layer+res", (262144, 512, 512), ("mosaic", "xla")),
]
ROUTE_SPECS = [
    ("norm_matmul", "rms", (65536, 2048, 2048), ("mosaic", "xla")),
    ("matmul_norm", "rms", (65536, 1024, 1024), ("mosaic", "xla")),
    ("norm_matmul", "rms", (131072, 2048, 2048), ("mosaic", "xla")),
    ("norm_matmul", "rms", (262144, 2048, 2048), ("mosaic", "xla")),
]


# ------------------------------------------------------------------------------------------------
# Kernel-level parts: variants of one kernel, checked against an f32 reference of its outputs.


@dataclasses.dataclass
class Variant:
  name: str
  fn: object  # (inputs...) -> outputs, traced under ``patches``
  patches: dict = dataclasses.field(default_factory=dict)
  view: object = None  # outputs -> what the check compares with the reference (not timed)


def run_variants(part, case, variants, make_sets, ref_fn, args, res, tol=R.TOLERANCE,
                 workers=8):
  """Lowers each variant (sequentially: patches are module globals read while tracing), compiles
  in threads, checks every output against ``ref_fn`` (f32) and times them interleaved."""
  sets = make_sets()
  lowered = {}
  for v in variants:
    jax.clear_caches()
    try:
      with patched(v.patches):
        lowered[v.name] = jax.jit(v.fn).lower(*sets[0])
    except Exception as e:  # noqa: BLE001
      lowered[v.name] = e
  jax.clear_caches()
  compiled = compile_all(lowered, workers)
  ref = jax.jit(lambda *a: ref_fn(*[x.astype(F32) if jnp.issubdtype(x.dtype, jnp.floating)
                                    else x for x in a]))(*sets[0])
  fns, rows = {}, {}
  for v in variants:
    row = {"part": part, "case": case, "impl": v.name}
    fn = compiled[v.name]
    if isinstance(fn, Exception):
      row.update(status="error", message=short(fn))
    else:
      try:
        out = fn(*sets[0])
        if v.view is not None:
          out = v.view(out)
        err = R.rel_err(R._err_parts(tuple(out), tuple(ref)))
        row.update(err=float(f"{err:.2e}"), status="ok" if err < tol else "wrong")
        if err < tol:
          fns[v.name] = fn
        del out
      except Exception as e:  # noqa: BLE001
        row.update(status="error", message=short(e))
    rows[v.name] = row
  del ref
  try:
    for name, (med, mn, rnd, ks) in time_interleaved(fns, sets, args.timer).items():
      rows[name].update(us=med, us_min=mn, rounds=rnd, kernels=ks)
  except Exception as e:  # noqa: BLE001
    for name in fns:
      rows[name].update(status="error", message=short(e))
  base = next(iter(rows.values())).get("us")
  for row in rows.values():
    if base and row.get("us"):
      row["vs_first"] = round(row["us"] / base, 3)
    res.add(row)
  res.flush()


def randn(key, shape, scale=1.0, offset=0.0, dtype=jnp.bfloat16):
  return (jax.random.normal(key, shape, F32) * scale + offset).astype(dtype)


# --- nb: the post-norm op's norm backward ---


NB_TILINGS = [(2048, 8, 4), (4096, 12, 4), (4096, 8, 4), (2048, 12, 4), (2048, 16, 4),
              (8192, 8, 8), (8192, 12, 8), (1024, 16, 4), (4096, 8, 8)]


def nb_config(elements, per_sm, warps):
  def pick(m, n, interpret, norm):
    n_pad = 1 << (n - 1).bit_length()
    block_m = max(1, min(64, elements // n_pad))
    programs = T.INTERPRET_PROGRAMS if interpret else per_sm * T._gpu_core_count()
    return T.BackwardConfig(block_m=block_m, programs=max(1, min(programs, -(-m // block_m))),
                            num_warps=warps)
  return pick


def nb_ref(norm, sums):
  def ref(dy, xhat, rstd, scale):
    g = dy * scale
    n = dy.shape[1]
    inner = g - xhat * (jnp.sum(g * xhat, axis=1, keepdims=True) / n)
    if norm == "layer":
      inner = inner - jnp.sum(g, axis=1, keepdims=True) / n
    dh = inner * rstd[:, None]
    col = {"dscale": jnp.sum(dy * xhat, axis=0), "dbias": jnp.sum(dy, axis=0)}
    return (dh, *[col[s] for s in sums])
  return ref


def part_nb(args, res, t_end):
  m, n = (256, 128) if args.tiny else (262144, 1024)
  main = {"layer": (2048, 8, 4), "rms": (4096, 12, 4)}
  for norm, sums in (("rms", ("dscale",)), ("layer", ("dscale", "dbias"))):
    if time.monotonic() > t_end:
      log(f"part=nb {norm}: skipped (budget)")
      continue
    tilings = [main[norm]] + [t for t in NB_TILINGS if t != main[norm]]
    if args.tiny:
      tilings = tilings[:3]

    def fn(dy, xhat, rstd, scale, norm=norm, sums=sums):
      dh, col = T.norm_backward(dy, xhat, rstd, scale, norm=norm, sums=sums,
                                interpret=args.tiny)
      return (dh, *[col[s] for s in sums])

    variants = [Variant(("main " if i == 0 else "") + "x".join(map(str, t)), fn,
                        {(T, "pick_config"): nb_config(*t)}) for i, t in enumerate(tilings)]

    def make_sets():
      out = []
      for i in range(2):
        k = jax.random.split(jax.random.key(100 + i), 3)
        x = jax.random.normal(k[0], (m, n), F32)
        if norm == "layer":
          x = x - jnp.mean(x, axis=1, keepdims=True)
        rstd = lax.rsqrt(jnp.mean(x * x, axis=1) + 1e-6)
        out.append((randn(k[1], (m, n)), (x * rstd[:, None]).astype(jnp.bfloat16), rstd,
                    jax.random.uniform(k[2], (n,), F32, 0.1, 1.1)))
      return out

    run_variants("nb", f"norm_bwd/{norm}/{m}x{n}", variants, make_sets, nb_ref(norm, sums),
                 args, res)


# --- mnfwd: the post-norm training forward ---


def mn_fwd_variants(m, k, n, tiny):
  base = mn_mosaic.pick_config(m, k, n)
  out = {"default": base,
         "c8": dataclasses.replace(base, tile_m=256, tile_n=128),
         "delay1": dataclasses.replace(base, delay_release=1),
         "epi32": dataclasses.replace(base, epi_tile_n=32),
         "k32": dataclasses.replace(base, tile_k=32, max_concurrent_steps=6)}
  if tiny:
    out.pop("c8")  # interpret mode runs clusters of 1
  return out


def part_mnfwd(args, res, t_end):
  m, k, n = (256, 128, 128) if args.tiny else (262144, 1024, 1024)
  for variant in ("rms", "layer+res"):
    if time.monotonic() > t_end:
      log(f"part=mnfwd {variant}: skipped (budget)")
      continue
    norm = "rms" if variant == "rms" else "layer"
    res_on = variant == "layer+res"

    def make_fn(cfg):
      def fn(x, w, r, scale, bias):
        y, _, xhat, mean, rstd = mn_mosaic.launch(
            x, w, None, r if res_on else None, scale, bias if norm == "layer" else None,
            norm=norm, eps=1e-6, out_dtype=jnp.bfloat16, return_h=False, return_xhat=True,
            return_stats=True, interpret=args.tiny, config=cfg)
        return y, xhat
      return fn

    def ref(x, w, r, scale, bias):
      h = x @ w + (r if res_on else 0.0)
      y = reference.matmul_norm(x, w, None, r if res_on else None, scale,
                                bias if norm == "layer" else None, norm=norm)
      if norm == "layer":
        hc = h - jnp.mean(h, axis=1, keepdims=True)
      else:
        hc = h
      xhat = hc * lax.rsqrt(jnp.mean(hc * hc, axis=1, keepdims=True) + 1e-6)
      return y, xhat

    def make_sets():
      out = []
      for i in range(2):
        kk = jax.random.split(jax.random.key(200 + i), 5)
        out.append((randn(kk[0], (m, k)), randn(kk[1], (k, n), k ** -0.5),
                    randn(kk[2], (m, n)), jax.random.uniform(kk[3], (n,), F32, 0.1, 1.1),
                    jax.random.normal(kk[4], (n,), F32) * 0.1))
      return out

    variants = [Variant(name, make_fn(cfg)) for name, cfg in
                mn_fwd_variants(m, k, n, args.tiny).items()]
    run_variants("mnfwd", f"matmul_norm_fwd_train/{variant}/{m}x{k}x{n}", variants, make_sets,
                 ref, args, res)


# --- nmfwd: the pre-norm LayerNorm forward, and its dW_γ GEMM with / without the ones block ---


def part_nmfwd(args, res, t_end):
  m, k, n = (256, 128, 128) if args.tiny else (262144, 1024, 1024)
  base = nm_mosaic.pick_config(m, k, n)
  # "pallas": the statistics-once forward on Pallas's pipeline, none in flight: the kernel of
  # main before the ring became its default (1e9eefb, where LayerNorm 1024² trained in 2833.8 µs
  # against the suite's 3000.5 today; the dx kernel and XLA's glue export identically).
  pallas = dataclasses.replace(base, pipeline="pallas", delay_release=0)
  variants = {"layer": {"default": base, "pallas": pallas,
                        "no_once": dataclasses.replace(base, stats_once=False),
                        "delay0": dataclasses.replace(base, delay_release=0)},
              "rms": {"default": base, "pallas": pallas}}
  for norm, cfgs in variants.items():
    if time.monotonic() > t_end:
      log(f"part=nmfwd {norm}: skipped (budget)")
      continue

    def make_fn(cfg, norm=norm):
      def fn(x, w, scale, bias):
        w_gamma, col_sum, out_bias = nm_xla.fold_affine(w, scale, bias if norm == "layer"
                                                        else None, norm)
        y, _, _ = nm_mosaic.launch(x, w_gamma, col_sum, out_bias, norm=norm, eps=1e-6,
                                   out_dtype=jnp.bfloat16, interpret=args.tiny, config=cfg)
        return (y,)
      return fn

    def ref(x, w, scale, bias, norm=norm):
      return (reference.norm_matmul(x, w, scale, bias if norm == "layer" else None, norm=norm),)

    def make_sets():
      out = []
      for i in range(2):
        kk = jax.random.split(jax.random.key(300 + i), 4)
        out.append((randn(kk[0], (m, k)), randn(kk[1], (k, n), k ** -0.5),
                    jax.random.uniform(kk[2], (k,), F32, 0.1, 1.1),
                    jax.random.normal(kk[3], (k,), F32) * 0.1))
      return out

    run_variants("nmfwd", f"norm_matmul_fwd/{norm}/{m}x{k}x{n}",
                 [Variant(name, make_fn(cfg)) for name, cfg in cfgs.items()], make_sets, ref,
                 args, res)
  if time.monotonic() > t_end:
    log("part=nmfwd dW: skipped (budget)")
    return

  # dW_γ = x̂ᵀ dy and Σ_i dy_i: the ones block (main: as wide as the dx kernel's epilogue
  # chunk) vs a K-wide x̂ and XLA's column sum.
  ones_w = nm_bwd.pick_config(m, n, k, x_hat=True, row_sums=True,
                              interpret=args.tiny).epi_tile_n
  def ones_block(xhat_ones, dy):
    p = nm_xla._transposed_product(xhat_ones, dy)
    return p[:k], p[-1]

  def colsum(xhat_ones, dy):
    return nm_xla._transposed_product(xhat_ones[:, :k], dy), jnp.sum(dy.astype(F32), axis=0)

  def ref_dw(xhat_ones, dy):
    return xhat_ones[:, :k].T @ dy, jnp.sum(dy, axis=0)

  def make_dw_sets():
    out = []
    for i in range(2):
      kk = jax.random.split(jax.random.key(400 + i), 2)
      xh = randn(kk[0], (m, k))
      out.append((jnp.concatenate([xh, jnp.ones((m, ones_w), xh.dtype)], axis=1),
                  randn(kk[1], (m, n))))
    return out

  # "colsum" slices x̂ inside the program (XLA may copy it: its kernel list says so); without
  # the ones block the dx kernel would write a K-wide x̂ and the slice would not exist.
  run_variants("nmfwd", f"dW_gamma/layer/{m}x{k}x{n}",
               [Variant("ones_block (main)", ones_block), Variant("colsum", colsum)],
               make_dw_sets, ref_dw, args, res, workers=1)


# --- dx: the pre-norm op's dx kernel (row sums in the epilogue, x̂ with its ones block) ---


def part_dx(args, res, t_end):
  m, k, n = (256, 128, 128) if args.tiny else (262144, 1024, 1024)
  base = nm_bwd.pick_config(m, n, k, x_hat=True, row_sums=True, interpret=args.tiny)
  cfgs = {"default": base, "k32": dataclasses.replace(base, tile_k=32, max_concurrent_steps=6),
          "epi64": dataclasses.replace(base, epi_tile_n=64),
          "delay1": dataclasses.replace(base, delay_release=1)}
  for norm in ("layer", "rms"):
    if time.monotonic() > t_end:
      log(f"part=dx {norm}: skipped (budget)")
      continue

    def make_fn(cfg, norm=norm):
      def fn(dy, w_gamma, x, rstd, mean):
        return nm_bwd.norm_matmul_dx(dy, w_gamma, x, rstd, mean=mean if norm == "layer" else None,
                                     return_x_hat=True, x_hat_ones=norm == "layer",
                                     row_sums_in_epilogue=True, interpret=args.tiny, config=cfg)
      return fn

    def ref(dy, w_gamma, x, rstd, mean, norm=norm):
      xc = x - mean[:, None] if norm == "layer" else x
      xhat = xc * rstd[:, None]
      g = dy @ w_gamma.T
      inner = g - xhat * jnp.mean(g * xhat, axis=1, keepdims=True)
      if norm == "layer":
        inner = inner - jnp.mean(g, axis=1, keepdims=True)
      # The third leaf: the ones block's largest distance from 1 (0; LayerNorm only).
      return inner * rstd[:, None], xhat, jnp.zeros((), F32)

    def make_sets(norm=norm):
      out = []
      for i in range(2):
        kk = jax.random.split(jax.random.key(500 + i), 3)
        x = randn(kk[0], (m, k), 1.0, 0.3)
        xf = x.astype(F32)
        mean = jnp.mean(xf, axis=1) if norm == "layer" else jnp.zeros((m,), F32)
        xc = xf - mean[:, None] if norm == "layer" else xf
        rstd = lax.rsqrt(jnp.mean(xc * xc, axis=1) + 1e-6)
        out.append((randn(kk[1], (m, n)), randn(kk[2], (k, n), k ** -0.5), x, rstd, mean))
      return out

    def view(out):  # x̂'s K columns, and how far its ones block is from 1
      dx, xhat = out
      ones = (jnp.max(jnp.abs(xhat[:, k:].astype(F32) - 1.0)) if xhat.shape[1] > k
              else jnp.zeros((), F32))
      return dx, xhat[:, :k], ones

    variants = [Variant(name, make_fn(cfg), view=view) for name, cfg in cfgs.items()]
    if norm == "layer":
      def no_ones(dy, w_gamma, x, rstd, mean):
        dx, xhat = nm_bwd.norm_matmul_dx(dy, w_gamma, x, rstd, mean=mean, return_x_hat=True,
                                         row_sums_in_epilogue=True, interpret=args.tiny,
                                         config=base)
        return dx, jnp.concatenate([xhat, jnp.ones((m, base.epi_tile_n), xhat.dtype)], axis=1)
      variants.append(Variant("no_ones (+concat)", no_ones, view=view))
    run_variants("dx", f"norm_matmul_dx/{norm}/{m}x{k}x{n}", variants, make_sets, ref, args, res)


PARTS = {"op": lambda a, r, t: run_cases("op", OP_SPECS, a, r, t),
         "nmfwd": part_nmfwd, "dx": part_dx, "nb": part_nb, "mnfwd": part_mnfwd,
         "route": lambda a, r, t: run_cases("route", ROUTE_SPECS, a, r, t)}


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--budget-s", type=float, default=170.0)
  p.add_argument("--parts", default=",".join(PARTS))
  p.add_argument("--tiny", action="store_true", help="CPU-sized shapes, interpret mode, wall")
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  args = p.parse_args(argv)
  start = time.monotonic()
  t_end = start + args.budget_s
  # A watchdog: whatever hangs, the process ends 20 s past the budget with what it flushed.
  threading.Timer(args.budget_s + 20, lambda: os._exit(124)).start()
  args.timer = "wall" if args.tiny else timing.default_timer()
  dev = jax.devices()[0]
  res = Results(args.out, {"device": dev.device_kind, "jax": jax.__version__,
                           "timer": args.timer, "rounds": ROUNDS, "iterations": ITERS})
  log(f"gemm22 ab: {dev.device_kind} jax {jax.__version__} timer {args.timer} "
      f"parts {args.parts} budget {args.budget_s:.0f}s")
  for part in args.parts.split(","):
    if time.monotonic() > t_end:
      log(f"part={part}: skipped (budget)")
      continue
    t0 = time.monotonic()
    try:
      PARTS[part](args, res, t_end)
    except Exception as e:  # noqa: BLE001  one failing part must not hide the others
      log(f"part={part} FAILED {short(e)}")
    log(f"part={part} done in {time.monotonic() - t0:.0f}s")
  res.flush()
  log(f"end elapsed_s={time.monotonic() - start:.0f}")
  os._exit(0)  # the watchdog thread must not keep the process alive


if __name__ == "__main__":
  sys.exit(main())
