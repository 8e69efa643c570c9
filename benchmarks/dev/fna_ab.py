"""One GPU call's A/B for issue 21 (flash_norm_attention), a one-off script: the forward
kernel's variants (``mosaic.Config.schedule`` × ``early_q_release``), the norm backward's row
tilings (``norm_bwd.RowConfig``), then the op's forward+backward with the defaults and with the
fastest of each.

    PYTHONPATH=$PWD python3 -m benchmarks.dev.fna_ab [--out DIR] [--budget-s 100] [--tiny]

Shape: B = 768, q lengths uniform on [1, 512] (the suite's ``attention_lengths``), D = 128,
dense K/V Lkv = 128, fast_gelu, bf16; H = 4 (variants) and H = 2 (the H = 4 winners). Every
variant's outputs are checked before it is timed: forward variants against the serial
schedule's (bit-identical expected; the serial one against the float32 oracle), row tilings
against the default tiling's outputs, the op's gradients against the float32 XLA reference's.
CUPTI median of 10 calls over 3 rotated input sets. Prints one line per measurement and the
winners; writes ``fna_ab.json`` to ``--out`` (default ``$OUT`` or ``.``) after every line.
A measurement that fails is logged and the next one runs; nothing new starts past the budget.
``--tiny`` runs the same steps on the CPU in interpret mode at a small shape (wall clock).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))
os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")  # ptxas reports (spills, C7519) per variant
os.environ.setdefault("MOSAIC_GPU_DUMP_TO", "/tmp/fna_ab_mosaic_dump")

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_norm as pn  # noqa: E402
from benchmarks import timing  # noqa: E402
from pallas_norm import jagged, reference  # noqa: E402
from pallas_norm.ops.flash_norm_attention import mosaic, norm_bwd  # noqa: E402

F32 = jnp.float32
TOL = 2e-2  # bf16 outputs vs the float32 oracle (the suite's tolerance)
SAME = 1e-3  # a variant against the default's outputs (same math, another order of sums)
ROW_VARIANTS = [  # (elements per step, steps per program, warps, Triton stages; None: 3)
    (8192, 8, 8, None),  # the default (pick_config)
    (8192, 8, 8, 1), (8192, 4, 8, None), (8192, 16, 8, None), (8192, 1, 8, None),
    (8192, 8, 4, None), (4096, 8, 4, None), (4096, 16, 4, 1), (16384, 4, 8, None),
    (16384, 4, 16, None),
]


FWD_VARIANTS = ("serial", "chained", "overlapped", "serial+early", "overlapped+early", "nwg",
                "nwg+early", "nwg+overlapped+early")
"""Forward configs by name: the schedule (serial, chained, overlapped), "early" for
early_q_release, "nwg" for norm_warpgroup (mosaic.Config)."""


def _variant(base, name):
  parts = name.split("+")
  schedule = next((p for p in parts if p in mosaic.SCHEDULES), "serial")
  return dataclasses.replace(base, schedule=schedule, early_q_release="early" in parts,
                             norm_warpgroup="nwg" in parts)


class Log:
  def __init__(self, path):
    self.path, self.rows = path, []

  def __call__(self, **row):
    self.rows.append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(self.path, "w") as fh:
      json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "rows": self.rows}, fh, indent=1)


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not np.all(np.isfinite(a)):
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _problem(heads, tiny, seed):
  batch, lmax, lkv, d = (4, 96, 128, 64) if tiny else (768, 512, 128, 128)
  rng = np.random.default_rng(batch * 7919 + lmax)  # the suite's attention_lengths
  lens = rng.integers(1, lmax + 1, size=batch)
  t = -(-int(lens.sum()) // 128) * 128
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (t, heads, d), F32).astype(jnp.bfloat16)
  k = (d ** -0.5 * jax.random.normal(ks[1], (batch, lkv, heads, d), F32)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (batch, lkv, heads, d), F32).astype(jnp.bfloat16)
  f = heads * d
  affine = (1 + 0.2 * jax.random.normal(ks[3], (f,)), 0.2 * jax.random.normal(ks[4], (f,)),
            1 + 0.2 * jax.random.normal(ks[5], (f,)))
  ct = jax.random.normal(jax.random.key(seed + 100), (t, heads, d), F32).astype(jnp.bfloat16)
  offsets = jnp.asarray(jagged.offsets_from_lengths(lens))
  return dict(q=q, k=k, v=v, offsets=offsets, affine=affine, ct=ct, lmax=lmax)


class Runner:
  def __init__(self, args, log):
    self.tiny, self.log = args.tiny, log
    self.deadline = time.monotonic() + args.budget_s
    self.timer = "wall" if args.tiny else "cupti"

  def left(self):
    return self.deadline - time.monotonic()

  def compile_all(self, fns: dict, args: tuple) -> dict:
    """Compiles every jitted fn on ``args`` in parallel threads; {name: compiled or exception}."""
    def build(fn):
      try:
        return fn.lower(*args).compile()
      except Exception as e:  # noqa: BLE001  (a variant that fails to lower: report it)
        return e
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(fns)))) as pool:
      return dict(zip(fns, pool.map(build, fns.values())))

  def time_us(self, fn, sets):
    return timing.median(timing.measure_us(fn, sets, 3 if self.tiny else 10, self.timer))


def _dumped() -> set:
  d = os.environ["MOSAIC_GPU_DUMP_TO"]
  return {os.path.join(d, f) for f in os.listdir(d)} if os.path.isdir(d) else set()


def _ptxas_summary(paths) -> str:
  """Registers, spills and injected warpgroup.arrive (C7519) of the ptxas reports in paths."""
  lines = []
  for path in sorted(p for p in paths if p.endswith(".ptxas")):
    with open(path, errors="replace") as fh:
      text = fh.read()
    keep = [ln.strip() for ln in text.splitlines()
            if "spill" in ln or "Used" in ln or "C7519" in ln]
    lines.append(f"{os.path.basename(path)}: C7519 x{text.count('C7519')}; "
                 + " | ".join(dict.fromkeys(keep))[:400])
  return " ;; ".join(lines) or "no ptxas report"


def _fwd_fn(cfg, interpret):
  def run(q, k, v, offsets, affine):
    a = jnp.stack(affine).reshape(3, q.shape[1], q.shape[2])
    return mosaic.flash_norm_attention_fwd(q, k, v, offsets, a, 1.0, 1.0,
                                           activation="fast_gelu", eps=1e-6, save_attn=True,
                                           config=cfg, interpret=interpret)
  return jax.jit(run)


def forward_variants(r: Runner, heads: int, configs: dict, sets: list) -> str | None:
  """Checks and times the forward kernel (with attn saved) per config; returns the fastest."""
  p = sets[0]
  args = (p["q"], p["k"], p["v"], p["offsets"], p["affine"])
  compiled = {}
  for name, cfg in configs.items():  # one at a time: each variant's ptxas report is its own
    t0, seen = time.monotonic(), _dumped()
    compiled[name] = r.compile_all({name: _fwd_fn(cfg, r.tiny)}, args)[name]
    r.log(step="fwd_compile", heads=heads, variant=name, s=round(time.monotonic() - t0, 1),
          ptxas=_ptxas_summary(_dumped() - seen))
  base_name = next(iter(configs))
  base = compiled[base_name](*args) if not isinstance(compiled[base_name], Exception) else None
  if base is not None:
    ref = jax.jit(lambda q, k, v, o, a: reference.flash_norm_attention(
        jnp.where(jagged.valid_mask(o, q.shape[0])[:, None, None], q, 0).astype(F32),
        k.astype(F32), v.astype(F32), o, ln_scale=a[0], ln_bias=a[1], rms_scale=a[2],
        max_seq_len=p["lmax"]))(*args)
    total = int(p["offsets"][-1])
    r.log(step="fwd_oracle", heads=heads, variant=base_name,
          err=f"{_rel_err(base[0][:total], ref[:total]):.2e}")
    del ref
  times = {}
  for name, fn in compiled.items():
    if r.left() < 0:
      break
    if isinstance(fn, Exception):
      r.log(step="fwd", heads=heads, variant=name, status=f"FAILED {fn!r}"[:800])
      continue
    try:
      got = fn(*args)
      errs = [_rel_err(g, b) for g, b in zip((got[0], got[2]), (base[0], base[2]))]
      del got
      if max(errs) > SAME:
        r.log(step="fwd", heads=heads, variant=name, status="WRONG", err=f"{max(errs):.2e}")
        continue
      times[name] = r.time_us(fn, [(s["q"], s["k"], s["v"], s["offsets"], s["affine"])
                                   for s in sets])
      r.log(step="fwd", heads=heads, variant=name, us=round(times[name], 1),
            err=f"{max(errs):.1e}")
    except Exception as e:  # noqa: BLE001
      r.log(step="fwd", heads=heads, variant=name, status=f"FAILED {e!r}"[:800])
      traceback.print_exc()
  return min(times, key=times.get) if times else None


def _row_config(spec, n, interpret):
  elements, steps, warps, stages = spec
  if interpret:
    return norm_bwd.pick_config(n, True)
  block_m = max(1, elements // pl_next_pow2(n))
  return norm_bwd.RowConfig(block_m=block_m, steps=steps, num_warps=warps, num_stages=stages)


def pl_next_pow2(n):
  return 1 << (n - 1).bit_length()


def row_variants(r: Runner, sets: list) -> dict:
  """Checks and times both row kernels per tiling in ROW_VARIANTS; {kernel: fastest spec}."""
  p = sets[0]
  t, heads, d = p["q"].shape
  n = heads * d
  end = p["offsets"][-1]
  rows = lambda a: a.reshape(t, n)  # noqa: E731
  rng = jax.random.split(jax.random.key(9), 3)
  stats = jnp.stack([jax.random.normal(rng[0], (t,)), 1 + jax.random.uniform(rng[1], (t,)),
                     0.5 + jax.random.uniform(rng[2], (t,))], axis=1)
  affine = tuple(jnp.asarray(a, F32) for a in p["affine"])
  row_sets = [(rows(s["ct"]), rows(s["q"]), rows(s["q"][::-1]), stats, affine, end)
              for s in sets]

  def rms(spec):
    cfg = _row_config(spec, n, r.tiny)
    return jax.jit(lambda g, q, attn, st, aff, e: norm_bwd.rms_backward(
        g, q, attn, st, aff, e, pre_layer_norm=True, inner_residual=True, interpret=r.tiny,
        config=cfg))

  def ln(spec):
    cfg = _row_config(spec, n, r.tiny)
    return jax.jit(lambda du, dz, g, q, st, e: norm_bwd.ln_backward(
        du, dz, g, q, st, affine[0], e, 0.0, inner_residual=True, outer_residual=True,
        interpret=r.tiny, config=cfg))

  specs = ROW_VARIANTS[:2] if r.tiny else ROW_VARIANTS
  best = {}
  for kernel, make in (("rms_backward", rms), ("ln_backward", ln)):
    fns = {spec: make(spec) for spec in specs}
    if kernel == "rms_backward":
      args_sets = row_sets
    else:
      args_sets = [(g, q, g, q, st, e) for g, q, _, st, _, e in row_sets]
    t0 = time.monotonic()
    compiled = r.compile_all(fns, args_sets[0])
    r.log(step="rows_compile", kernel=kernel, s=round(time.monotonic() - t0, 1))
    base = None
    times = {}
    for spec, fn in compiled.items():
      if r.left() < 0:
        break
      name = "x".join(map(str, spec))
      if isinstance(fn, Exception):
        r.log(step="rows", kernel=kernel, variant=name, status=f"FAILED {fn!r}"[:800])
        continue
      try:
        got = [o for o in fn(*args_sets[0]) if o is not None]
        if base is None:
          base = got
        err = max(_rel_err(g, b) for g, b in zip(got, base))
        del got
        if err > SAME:
          r.log(step="rows", kernel=kernel, variant=name, status="WRONG", err=f"{err:.2e}")
          continue
        times[spec] = r.time_us(fn, args_sets)
        r.log(step="rows", kernel=kernel, variant=name, us=round(times[spec], 1),
              err=f"{err:.1e}")
      except Exception as e:  # noqa: BLE001
        r.log(step="rows", kernel=kernel, variant=name, status=f"FAILED {e!r}"[:800])
    if times:
      best[kernel] = min(times, key=times.get)
  return best


def _op_fwd_bwd(p, impl):

  def run(q, k, v, offsets, affine, ct):
    def block(q, k, v, g1, b1, g2):
      return pn.flash_norm_attention(q, k, v, offsets, ln_scale=g1, ln_bias=b1, rms_scale=g2,
                                     max_seq_len=p["lmax"], implementation=impl)
    out, pull = jax.vjp(block, q, k, v, *affine)
    return (out, *pull(ct))
  return jax.jit(run)


def op_runs(r: Runner, heads: int, sets: list, variants: dict) -> None:
  """The op's forward+backward per {name: (forward Config or None, {kernel: row spec})}
  ("chain": the default dispatch), checked against the float32 XLA reference's gradients."""
  p = sets[0]
  args = (p["q"], p["k"], p["v"], p["offsets"], p["affine"], p["ct"])
  total = int(p["offsets"][-1])
  ref = None
  for name, (fwd_cfg, rows) in variants.items():
    if r.left() < 0:
      break
    saved = mosaic.pick_config, norm_bwd.rms_backward, norm_bwd.ln_backward
    try:
      if fwd_cfg is not None:
        mosaic.pick_config = lambda *a, cfg=fwd_cfg, **k: cfg
      for kernel, spec in rows.items():  # the op calls norm_bwd.<kernel> through the module
        cfg = _row_config(spec, heads * p["q"].shape[2], r.tiny)
        setattr(norm_bwd, kernel, functools.partial(getattr(norm_bwd, kernel), config=cfg))
      # "chain": implementation=None, which at H·D outside FUSED_DEFAULT_DOMAIN (H = 2) runs
      # the norms in XLA around the GDPA kernel (on the CPU: XLA).
      fn = _op_fwd_bwd(p, None if name == "chain" else "interpret" if r.tiny else "mosaic")
      t0 = time.monotonic()
      got = jax.block_until_ready(fn(*args))
      compile_s = time.monotonic() - t0
      if ref is None:
        up = tuple(a.astype(F32) if a.dtype == jnp.bfloat16 else a for a in args[:3])
        ref_fn = jax.jit(lambda q, k, v, o, aff, ct: jax.vjp(
            lambda q, k, v, g1, b1, g2: reference.flash_norm_attention(
                q, k, v, o, ln_scale=g1, ln_bias=b1, rms_scale=g2, max_seq_len=p["lmax"]),
            q, k, v, *aff)[1](ct))
        ref = ref_fn(*up, p["offsets"], p["affine"], p["ct"].astype(F32))
      errs = [_rel_err(got[1][:total], ref[0][:total])]
      errs += [_rel_err(g, w) for g, w in zip(got[2:], ref[1:])]
      del got
      err = max(errs)
      if err > TOL:
        r.log(step="op_fwd_bwd", heads=heads, variant=name, status="WRONG", err=f"{err:.2e}")
        continue
      us = r.time_us(fn, [(s["q"], s["k"], s["v"], s["offsets"], s["affine"], s["ct"])
                          for s in sets])
      r.log(step="op_fwd_bwd", heads=heads, variant=name, us=round(us, 1), err=f"{err:.1e}",
            compile_s=round(compile_s, 1))
    except Exception as e:  # noqa: BLE001
      r.log(step="op_fwd_bwd", heads=heads, variant=name, status=f"FAILED {e!r}"[:800])
      traceback.print_exc()
    finally:
      mosaic.pick_config, norm_bwd.rms_backward, norm_bwd.ln_backward = saved


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--budget-s", type=float, default=100.0)
  ap.add_argument("--tiny", action="store_true")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  log = Log(os.path.join(args.out, "fna_ab.json"))
  r = Runner(args, log)
  log(step="start", jax=jax.__version__, device=jax.devices()[0].device_kind)
  winners = {}
  for heads in (4, 2):
    sets = [_problem(heads, args.tiny, seed) for seed in range(3)]
    p = sets[0]
    base = mosaic.pick_config(heads, p["q"].shape[2], p["q"].dtype, p["q"].dtype, True,
                              p["k"].shape[1])
    if heads == 4:
      configs = {name: _variant(base, name) for name in FWD_VARIANTS}
    else:  # the default and the H = 4 winner
      configs = {"serial": base}
      if winners.get("fwd") not in (None, "serial"):
        configs[winners["fwd"]] = _variant(base, winners["fwd"])
    best_fwd = forward_variants(r, heads, configs, sets)
    if heads == 4:
      winners["fwd"] = best_fwd
      winners["rows"] = row_variants(r, sets)
      log(step="winners", fwd=best_fwd, rows={k: "x".join(map(str, v))
                                              for k, v in winners["rows"].items()})
    op_variants = {"default": (None, {})}
    rows = {k: v for k, v in winners.get("rows", {}).items() if v != ROW_VARIANTS[0]}
    if best_fwd not in (None, "serial") or rows:
      op_variants["winners"] = (configs.get(best_fwd), rows)
    if heads == 2:  # decides FUSED_DEFAULT_DOMAIN at H·D = 256
      op_variants["chain"] = (None, {})
    op_runs(r, heads, sets, op_variants)
    del sets
  log(step="end", left_s=round(r.left(), 1))


if __name__ == "__main__":
  main()
