"""A/B of the standalone norms (issue 22) at every suite shape, one GPU process.

    PYTHONPATH=$PWD python3 .devcarry/norms22_ab/ab.py [--budget-s 240] [--only RE] [--no-variants]
        [--variants RE]
    e.g. LayerNorm alone: --only '^layer_norm/' 
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/norms22_ab/ab.py --tiny   # CPU smoke (interpret)

Cases: benchmarks.cases' rms_norm / layer_norm at x of 1 GB (M = 2^29 / N, N in NORM_NS), bf16,
"fwd" and "fwd+bwd" (grads of x, scale, bias), the suite's inputs (benchmarks.run.make_inputs).
Implementations (one process, interleaved rounds A,B,C,A,B,C,...; CUPTI kernel sums,
benchmarks.timing; two input sets rotated):

  main     main's implementation=None: the backward kernel after XLA's forward where main's
           domains (MAIN_DOMAINS) hold, else XLA (fwd+bwd only: main's forward is XLA's)
  xla      implementation="xla"
  kernel   this branch's forward kernel + the backward kernel reading its statistics
           (triton.row_norm(forward="kernel"); rows >= 8193 in chunks)
  xfwd     XLA's forward + the recomputing backward kernel, where "main" is XLA (N <= 8192)
  <variant> "kernel" under other tilings (VARIANTS), unless --no-variants

Every output and gradient is checked against the f32 reference (benchmarks.run.checker) before
timing; a wrong one is reported and not timed. Lines are printed as they come and $OUT/ab.json
(default .) is rewritten after each case; the summary table at the end (also $OUT/ab.md), with
the fastest path per case. The torch anchors at the same shapes join it:
  bash .devcarry/norms22_ab/anchors_norms.sh --join $OUT/ab.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import cases as C
from benchmarks import run as R
from benchmarks import timing
import pallas_norm as pn
from pallas_norm.ops.norms import triton as T
from pallas_norm.ops.norms import triton_fwd as TF

MAIN_DOMAINS = {"layer": (128, 8192, 65536), "rms": (128, 2048, 262144)}
ROUNDS, ITERS = 3, 5

# name: (applies to (norm, n, mode), patches {(module, attribute): value}). Forward tilings are
# timed in "fwd", backward tilings in "fwd+bwd". The defaults are norms22b's winners (full rows
# up to 4096 a program per 4096-element block, LayerNorm's chunked rows a program per row with
# L2 hints and the column sums apart); the variants left are the open questions: 2048-element
# blocks at N = 128 (LayerNorm's forward-alone winner there, untimed in training) and RMSNorm's
# chunked rows in LayerNorm's winning forms (untimed for RMSNorm).
FWD, BWD = "fwd", "fwd+bwd"


def _fwd(**tilings):
  return {(TF, "TILINGS"): {**TF.TILINGS, **tilings}}


def _chunked_fwd(norm, tiling):
  return _fwd(chunked={**TF.TILINGS["chunked"], norm: tiling})


VARIANTS = {
    # full rows at N = 128: a program per 2048-element row block, both uses
    "grid_2k": (lambda norm, n, mode: n <= 128, _fwd(full=(2048, None, 4))),
    # RMSNorm's chunked rows: a program per row (+ L2 hints), forward alone and in training
    # with the column sums apart (LayerNorm's winners)
    "rms_f_grid_c8k_w16": (lambda norm, n, mode: mode == FWD and n > 8192 and norm == "rms",
                           _chunked_fwd("rms", (8192, None, 16))),
    "rms_f_grid_c8k_w16_hints": (
        lambda norm, n, mode: mode == FWD and n > 8192 and norm == "rms",
        _chunked_fwd("rms", (8192, None, 16, True))),
    "rms_fb_grid_apart_hints": (
        lambda norm, n, mode: mode == BWD and n > 8192 and norm == "rms",
        {**_chunked_fwd("rms", (8192, None, 16, True)),
         (T, "CHUNKED_TILING"): {**T.CHUNKED_TILING, "rms": (4096, 1, None, 8, "apart", True)}}),
}


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


def main_takes_kernel(norm, m, n):
  lo, hi, rows = MAIN_DOMAINS[norm]
  return lo <= n <= hi and m >= rows


def op_fn(case, impl, interpret):
  """fn(x, scale[, bias]) of one implementation."""
  norm = "rms" if case.op == "rms_norm" else "layer"
  m, n = case.dim("M"), case.dim("N")
  public = pn.rms_norm if norm == "rms" else pn.layer_norm

  def path(forward):
    def f(x, scale, bias=None):
      return T.row_norm(x, scale, bias, norm=norm, eps=1e-6, interpret=interpret,
                        forward=forward)
    return f

  if impl == "xla":
    return lambda *a: public(*a, implementation="xla")
  if impl == "main":
    if main_takes_kernel(norm, m, n) or (interpret and n < TF.CHUNKED_MIN_N):
      return path("xla")
    return lambda *a: public(*a, implementation="xla")
  if impl == "xfwd":
    return path("xla")
  return path("kernel")


def impls_of(case, variants, interpret: bool):
  """The baselines and, with ``variants`` (True or a regex on names), the variants that apply."""
  norm = "rms" if case.op == "rms_norm" else "layer"
  m, n = case.dim("M"), case.dim("N")
  out = ["main", "xla", "kernel"] if case.mode == "fwd+bwd" else ["xla", "kernel"]  # main's
  # forward is XLA's
  if n < TF.CHUNKED_MIN_N and not main_takes_kernel(norm, m, n) and case.mode == "fwd+bwd":
    out.append("xfwd")
  if variants:
    out += [v for v, (ok, _) in VARIANTS.items() if ok(norm, n, case.mode)
            and (variants is True or re.search(variants, v))]
  return out


def suite_cases(tiny: bool):
  out = []
  for mode in ("fwd+bwd", "fwd"):
    for n in (32768, 8192, 512, 128, 2048):
      for op in ("rms_norm", "layer_norm"):
        c = C.Case(op, "", (("M", C.NORM_BYTES // (2 * n)), ("N", n)), mode)
        out.append(C.tiny(c) if tiny else c)
  return out


def lower(case, impl, prob, args, interpret):
  """The lowered program; a variant's tilings are module globals read while tracing, so JAX's
  trace caches are cleared around it (a cached trace would keep the default tiling)."""
  patches = VARIANTS[impl][1] if impl in VARIANTS else {}
  if patches:
    jax.clear_caches()
  try:
    with patched(patches):
      fn = jax.jit(R.with_mode(op_fn(case, impl, interpret), prob.diff, case.mode))
      return fn.lower(*args)
  finally:
    if patches:
      jax.clear_caches()


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--budget-s", type=float, default=240.0)
  p.add_argument("--only", default=None, help="regex on case names")
  p.add_argument("--no-variants", action="store_true")
  p.add_argument("--variants", default=None, help="regex on variant names (default: all)")
  p.add_argument("--tiny", action="store_true", help="CPU-sized shapes, interpret mode, wall")
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  args = p.parse_args(argv)
  t_end = time.monotonic() + args.budget_s
  interpret = args.tiny
  timer = "wall" if args.tiny else timing.default_timer()
  if args.tiny:  # reach the chunked paths at tiny widths
    TF.CHUNKED_MIN_N = 1024
    TF.TILINGS = {**TF.TILINGS, "chunked": {"layer": (256, None, 4, True), "rms": (256, 2, 4)}}
    T.CHUNKED_TILING = {"layer": (256, 1, None, 4, "apart", True),
                        "rms": (256, 2, 2, 4, "registers")}
  cases = [c for c in suite_cases(args.tiny) if not args.only or re.search(args.only, c.name)]
  dev = jax.devices()[0]
  results = {"device": dev.device_kind, "jax": jax.__version__, "timer": timer,
             "rounds": ROUNDS, "iterations": ITERS, "rows": []}
  os.makedirs(args.out, exist_ok=True)
  print(f"ab: {dev.device_kind} jax {jax.__version__} timer {timer}: {len(cases)} cases",
        flush=True)

  # Lower everything first (Python, sequential: the variants patch module globals while
  # tracing), compile in threads.
  t0 = time.monotonic()
  plan = []
  for case in cases:
    prob = C.build(case, "mosaic")
    make, _ = R.input_maker(prob, case.mode, host=args.tiny)
    abstract = jax.eval_shape(lambda: R.make_inputs(prob, case.mode,
                                                    C.DeviceRandom(jax.random.key(0))))
    lowered = {}
    variants = False if args.no_variants else (args.variants or True)
    for impl in impls_of(case, variants, interpret):
      try:
        lowered[impl] = lower(case, impl, prob, abstract, interpret)
      except Exception as e:  # noqa: BLE001
        lowered[impl] = e
    if "kernel" in lowered and not isinstance(lowered["kernel"], Exception):
      base = lowered["kernel"].as_text()
      for impl, low in lowered.items():  # a variant that lowers to the default tested nothing
        if impl in VARIANTS and not isinstance(low, Exception) and low.as_text() == base:
          print(f"{case.name} {impl}: same program as 'kernel' (the patch did not apply)",
                flush=True)
    check = R.checker(R.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True))
    outs = jax.eval_shape(R.with_mode(prob.impl_fn("xla"), prob.diff, case.mode), *abstract)
    plan.append((case, prob, make, lowered, check, (outs, abstract)))
  with cf.ThreadPoolExecutor(max(1, min(16, (os.cpu_count() or 2)))) as pool:
    futs = {}
    for ci, (_, _, _, lowered, check, (outs, abstract)) in enumerate(plan):
      for impl, low in lowered.items():
        if not isinstance(low, Exception):
          futs[(ci, impl)] = pool.submit(low.compile)
      futs[(ci, "check")] = pool.submit(check.compile_for, outs, *abstract)
    compiled = {}
    for key, fut in futs.items():
      try:
        compiled[key] = fut.result()
      except Exception as e:  # noqa: BLE001
        compiled[key] = e
  print(f"ab: lowered and compiled {len(futs)} programs (checks included) in "
        f"{time.monotonic() - t0:.0f}s", flush=True)
  print(f"ab: programs that failed to lower or compile: "
        f"{[k for k, v in compiled.items() if isinstance(v, Exception)]}",
        flush=True)

  for ci, (case, prob, make, lowered, check, _) in enumerate(plan):
    if time.monotonic() > t_end:
      print(f"{case.name}: skipped (budget)", flush=True)
      continue
    run_case(case, make, lowered, compiled, ci, timer, results, check)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
      json.dump(results, f, indent=1)
  table = summary(results)
  print(table, flush=True)
  with open(os.path.join(args.out, "ab.md"), "w") as f:
    f.write(table)


def run_case(case, make, lowered, compiled, ci, timer, results, check):
  sets = [make(R._seed(case.name, i)) for i in range(2)]
  fns, rows = {}, {}
  for impl in lowered:
    row = {"case": case.name, "impl": impl}
    fn = compiled.get((ci, impl), lowered[impl])
    if isinstance(fn, Exception):
      row.update(status="error", message=R._short(fn))
    else:
      try:
        out = fn(*sets[0])
        err = R.rel_err(check(out, *sets[0]))
        del out
        row.update(rel_err=err, status="ok" if err < R.TOLERANCE else "wrong")
        if err < R.TOLERANCE:
          fns[impl] = fn
      except Exception as e:  # noqa: BLE001
        row.update(status="error", message=R._short(e))
    rows[impl] = row
  times = {impl: [] for impl in fns}
  for _ in range(ROUNDS):  # interleaved: A, B, C, A, B, C, ...
    for impl, fn in fns.items():
      try:
        times[impl] += timing.measure_us(fn, sets, ITERS, timer)
      except Exception as e:  # noqa: BLE001
        rows[impl].update(status="error", message=R._short(e))
  for impl, ts in times.items():
    if ts and rows[impl]["status"] == "ok":
      rows[impl].update(us=round(timing.median(ts), 1), us_min=round(min(ts), 1),
                        time_us=round(timing.median(ts), 1))  # the anchors' summary joins on it
  base = rows.get("main", {}).get("us")
  for impl, row in rows.items():
    if base and row.get("us"):
      row["vs_main"] = round(row["us"] / base, 3)
    results["rows"].append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def summary(results):
  by_case = {}
  for row in results["rows"]:
    by_case.setdefault(row["case"], []).append(row)
  lines = ["| case | " + " | ".join(["main", "xla", "kernel", "xfwd", "best variant"]) + " |",
           "|---|---:|---:|---:|---:|---|"]
  for case, rows in by_case.items():
    cell = {r["impl"]: (f"{r['us']:.1f}" if r.get("us") else r["status"]) for r in rows}
    variants = [r for r in rows if r["impl"] in VARIANTS and r.get("us")]
    best = min(variants, key=lambda r: r["us"]) if variants else None
    lines.append(f"| {case} | " + " | ".join(cell.get(i, "") for i in
                                             ("main", "xla", "kernel", "xfwd"))
                 + f" | {best['impl'] + ' ' + format(best['us'], '.1f') if best else ''} |")
  return "\n".join(lines) + "\n\n" + proposals(by_case) + "\n"


def proposals(by_case):
  """Per case, the fastest correct path and what the dispatch tables would say: fwd+bwd ->
  triton.KERNEL_DOMAINS (forward "kernel" for kernel/variants, "xla" for xfwd/main's kernel),
  fwd -> triton.FORWARD_DOMAINS; a variant winning names the tiling to adopt."""
  out = ["Fastest per case (vs XLA; a KERNEL_DOMAINS / FORWARD_DOMAINS row where a kernel wins):"]
  for case, rows in by_case.items():
    timed = {r["impl"]: r["us"] for r in rows if r.get("us")}
    if not timed or "xla" not in timed:
      out.append(f"  {case}: no XLA time")
      continue
    best = min(timed, key=timed.get)
    ratio = timed[best] / timed["xla"]
    kind = {"xla": "xla", "main": "main's path (keep the table)",
            "xfwd": "the kernel after XLA's forward"}.get(best, "forward-kernel path")
    out.append(f"  {case}: {best} {timed[best]:.1f} us ({ratio:.3f}x XLA) -> {kind}")
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(main())
