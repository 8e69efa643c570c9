"""A/B of branch gdpa9 (GDPA backward: K/V SMEM tiles through an opaque zero index, so their
WGMMA descriptors are not hoisted and spilled) against main's tree.

  python3 .devcarry/gdpa9_ab/ab.py --out $OUT [--control .devcarry/b/main] [--ptxas]
  PJRT_NPROC=8 python .devcarry/gdpa9_ab/ab.py --tiny --out /tmp/x   (CPU, interpret mode)

Each tree runs in its own worker subprocess (its pallas_norm first on sys.path); both compile
and check their cases against the f32 oracle (pallas_norm.reference) in parallel, then the
main process interleaves the timings (CUPTI per-kernel lists, inputs rotated past L2) over
--rounds rounds. Parts, in priority order: bwd_h4 (the backward kernel alone, fast_gelu, B768
H4 L512 D128 KV128), gdpa_h4 (GDPA op fwd+bwd), fna_h4 (FlashNormAttention op fwd+bwd,
implementation="mosaic", whose backward calls the GDPA backward with add_do_to_dq), gdpa_h2,
bwd_h2. --ptxas: ptxas's report (registers, spills, C7519/C7512) of every Mosaic kernel, and
the PTX dumps as one tar.gz under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
CAND = HERE.parents[1]
_WORKERS = []
PARTS = ("bwd_h4", "gdpa_h4", "fna_h4", "gdpa_h2", "bwd_h2")
TOL = 1e-2
ROTATE_BYTES = 200 << 20  # input sets rotated past the 60 MB L2


# ------------------------------------------------------------------------------------------
# Worker: one tree.

def worker(args):
  tree = pathlib.Path(args.tree).resolve()
  sys.path[:0] = [str(tree), str(CAND)]
  if args.tiny:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pallas_norm as pn
  from pallas_norm import reference
  from pallas_norm.ops.gdpa import mosaic_bwd as gb
  from benchmarks import cases as C
  from benchmarks import run as R
  assert pathlib.Path(pn.__file__).resolve().is_relative_to(tree), pn.__file__
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)  # library prints go to stderr; stdout carries the protocol only

  def send(obj):
    out.write(json.dumps(obj) + "\n")

  kernel = "interpret" if args.tiny else "mosaic"

  def attn_case(op, h):
    case = C.Case(op, "", C._attn(h, 512), "fwd+bwd")
    return C.tiny(case) if args.tiny else case

  def build(part):
    """(jitted fn, oracle error fn, make(seed) -> input set) of a part."""
    kind, h = part.split("_")
    h = int(h[1:])
    op = {"gdpa": "gdpa", "fna": "flash_norm_attention", "bwd": "gdpa"}[kind]
    case = attn_case(op, h)
    prob = C.build(case, kernel)
    if kind != "bwd":
      fn = jax.jit(R.with_mode(prob.impl_fn(kernel), prob.diff, case.mode))
      ref = R.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True)
      make = (lambda seed: R.make_inputs(prob, case.mode, C.HostRandom(seed))) if args.tiny \
          else (lambda seed, g=jax.jit(lambda key: R.make_inputs(prob, case.mode,
                                                                  C.DeviceRandom(key))):
                g(jax.random.key(seed)))
      return fn, ref, make
    # The backward kernel alone: (q, k, v, q_offsets, do) -> (dq, dk, dv).
    lmax = case.dim("L")

    def bwd(q, k, v, q_offsets, do):
      return gb.gdpa_bwd(q, k, v, q_offsets, None, do, activation="fast_gelu",
                         interpret=args.tiny)[:3]

    def ref(q, k, v, q_offsets, do):
      f32 = lambda x: x.astype(jnp.float32)
      _, pull = jax.vjp(lambda q, k, v: reference.gdpa(q, k, v, q_offsets, max_seq_len=lmax),
                        f32(q), f32(k), f32(v))
      return pull(f32(do))

    def make_set(rand):
      q, k, v, offs = prob.make_set(rand)[:4]
      return q, k, v, offs, rand(q.shape)

    make = (lambda seed: make_set(C.HostRandom(seed))) if args.tiny \
        else (lambda seed, g=jax.jit(lambda key: make_set(C.DeviceRandom(key))):
              g(jax.random.key(seed)))
    return jax.jit(bwd), ref, make

  state = {}

  def compile_part(part):
    """(fn, compiled fn, compiled oracle check, make) of a part, compiled from shapes alone
    (threads: the parts' Mosaic and oracle compiles overlap)."""
    fn, ref, make = build(part)
    avals = jax.eval_shape(lambda: make(0)) if not args.tiny else None
    if avals is None:  # host inputs: shapes from one set
      avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make(0))
    compiled = fn.lower(*avals).compile()
    check = R.checker(ref)
    check.compile_for(jax.eval_shape(fn, *avals), *avals)
    return compiled, check, make

  def setup(parts):
    from concurrent.futures import ThreadPoolExecutor
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
      futures = {p: pool.submit(compile_part, p) for p in parts}
      results = []
      for part in parts:  # priority order
        try:
          compiled, check, make = futures[part].result()
          compile_s = time.time() - t0
          sets = [make(1000)]
          outs = jax.block_until_ready(compiled(*sets[0]))
          err = R.rel_err(check(outs, *sets[0]))
          R.free(outs)
          n_sets = 1 if args.tiny else min(8, max(2, math.ceil(ROTATE_BYTES / R.nbytes(sets[0]))))
          sets += [make(1000 + i) for i in range(1, n_sets)]
          ok = err < TOL
          if ok:
            state[part] = (compiled, sets)
          results.append(dict(part=part, rel_err=err, ok=ok, sets=len(sets),
                              compiled_at_s=compile_s, setup_s=time.time() - t0))
        except Exception as e:  # reported, not timed
          import traceback
          traceback.print_exc()
          results.append(dict(part=part, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                              setup_s=time.time() - t0))
    return results

  def time_part(part, iterations):
    fn, sets = state[part]
    if args.tiny:
      from benchmarks import timing
      t = timing.measure_us(fn, sets, iterations, "wall")
      return dict(part=part, total_us=t, kernels={})
    from jax.experimental.mosaic.gpu import profiler
    from benchmarks.timing import Rotating
    _, per_iter = profiler.measure(Rotating(fn, sets), aggregate=False,
                                   iterations=iterations)()
    totals = [1e3 * sum(ms for _, ms in it) for it in per_iter]
    kernels = {}
    for i, (name, _) in enumerate(per_iter[0]):
      kernels[f"{i:02d} {name[:60]}"] = statistics.median(1e3 * it[i][1] for it in per_iter)
    return dict(part=part, total_us=totals, kernels=kernels)

  for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "setup":
      send(dict(tree=str(tree), file=pn.__file__,
                results=setup(cmd["parts"])))
    elif cmd["op"] == "time":
      try:
        send(time_part(cmd["part"], cmd["iterations"]))
      except Exception as e:
        send(dict(part=cmd["part"], error=f"{type(e).__name__}: {str(e)[:300]}"))
    else:
      send(dict(bye=True))
      return


# ------------------------------------------------------------------------------------------
# Driver.

def ptxas_report(dump_dir: pathlib.Path) -> list[str]:
  lines = []
  for f in sorted(dump_dir.rglob("*")):
    if not f.is_file() or f.suffix != ".ptxas":
      continue
    text = f.read_text(errors="replace")
    keep = [l.strip() for l in text.splitlines()
            if any(s in l for s in ("registers", "spill", "C7519", "C7512", "Compiling entry",
                                    "Function properties"))]
    if keep:
      lines.append(f"[{f.name}]")
      lines += keep
  return lines


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--control", default=".devcarry/b/main")
  ap.add_argument("--out")
  ap.add_argument("--budget-s", type=float, default=200)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--parts", default=",".join(PARTS))
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--ptxas", action="store_true")
  ap.add_argument("--worker", action="store_true")
  ap.add_argument("--tree")
  args = ap.parse_args()
  if args.worker:
    return worker(args)
  if not args.out:
    ap.error("--out is required")

  t_start = time.time()
  deadline = t_start + args.budget_s
  watchdog = threading.Timer(args.budget_s + 20, lambda: os._exit(124))
  watchdog.daemon = True
  watchdog.start()
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  log_f = open(out_dir / "gdpa9_ab.log", "w")
  results = []

  def log(msg):
    line = f"[{time.time() - t_start:6.1f}s] {msg}"
    print(line, flush=True)
    log_f.write(line + "\n")
    log_f.flush()

  def record(obj):
    results.append(obj)
    (out_dir / "gdpa9_ab.json").write_text(json.dumps(results, indent=1))

  parts = [p for p in args.parts.split(",") if p]
  trees = {"control": pathlib.Path(args.control).resolve(), "candidate": CAND}
  if not (trees["control"] / "pallas_norm").is_dir():
    sys.exit(f"no pallas_norm under --control {trees['control']}")
  workers, dumps = {}, {}
  for name, tree in trees.items():
    env = dict(os.environ, PYTHONPATH=str(tree), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if args.ptxas:
      dumps[name] = pathlib.Path(f"/tmp/gdpa9_dump_{name}_{os.getpid()}")
      dumps[name].mkdir(parents=True, exist_ok=True)
      env.update(MOSAIC_GPU_DUMP_TO=str(dumps[name]), MOSAIC_GPU_DUMP_PTXAS="1",
                 MOSAIC_GPU_DUMP_PTX="1")
    cmd = [sys.executable, str(HERE / "ab.py"), "--worker", "--tree", str(tree)]
    if args.tiny:
      cmd.append("--tiny")
    workers[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=str(tree))
    _WORKERS.append(workers[name])
    log(f"{name}: {tree}")

  def ask(name, obj):
    w = workers[name]
    w.stdin.write(json.dumps(obj) + "\n")
    w.stdin.flush()
    line = w.stdout.readline()
    if not line:
      raise RuntimeError(f"worker {name} died (rc {w.poll()})")
    return json.loads(line)

  # Setup (compile, oracle check, input sets) of both trees in parallel.
  setups = {}
  def do_setup(name):
    try:
      setups[name] = ask(name, dict(op="setup", parts=parts))
    except Exception as e:
      setups[name] = dict(error=str(e), results=[])
  threads = [threading.Thread(target=do_setup, args=(n,)) for n in workers]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  ok = {}
  for name, s in setups.items():
    log(f"{name}: pallas_norm from {s.get('file')} {s.get('error', '')}")
    for r in s["results"]:
      log(f"  check {name:9s} {r['part']:8s} ok={r['ok']} rel_err={r.get('rel_err', float('nan')):.3g} "
          f"sets={r.get('sets')} setup {r['setup_s']:.1f}s {r.get('error', '')}")
      ok[(name, r["part"])] = r["ok"]
    record(dict(kind="setup", tree_name=name, **s))

  if args.ptxas:
    for name, d in dumps.items():
      log(f"ptxas {name}:")
      for l in ptxas_report(d):
        log("  " + l)
    # MOSAIC_GPU_DUMP_TO dumps everything (~90 MB of MLIR pass logs per kernel): keep the PTX
    # and ptxas reports only.
    with tarfile.open(out_dir / "gdpa9_dumps.tar.gz", "w:gz") as tar:
      for name, d in dumps.items():
        for f in sorted(d.iterdir()):
          if f.suffix in (".ptx", ".ptxas"):
            tar.add(f, arcname=f"{name}/{f.name}")

  # Interleaved timing rounds.
  times = {}
  for rnd in range(args.rounds):
    for part in parts:
      for name in (("control", "candidate") if rnd % 2 == 0 else ("candidate", "control")):
        if not ok.get((name, part)):
          continue
        if time.time() > deadline - 5:
          log(f"budget: round {rnd} {part} {name} skipped")
          continue
        r = ask(name, dict(op="time", part=part, iterations=args.iterations))
        if "error" in r:
          log(f"  time {name} {part}: {r['error']}")
          continue
        med = statistics.median(r["total_us"])
        times.setdefault((part, name), []).append(med)
        record(dict(kind="time", round=rnd, tree=name, **r))
        log(f"round {rnd} {part:8s} {name:9s} median {med:9.1f} us (min {min(r['total_us']):.1f})")
        if rnd == 0:
          for k, v in r["kernels"].items():
            log(f"      {v:9.1f}  {k}")
  log("summary (median over rounds of per-round medians; candidate - control):")
  for part in parts:
    c, n = times.get((part, "control")), times.get((part, "candidate"))
    if c and n:
      mc, mn = statistics.median(c), statistics.median(n)
      log(f"  {part:8s} control {mc:9.1f}  candidate {mn:9.1f}  diff {mn - mc:+8.1f} us "
          f"({100 * (mn - mc) / mc:+.2f}%)  rounds c={['%.1f' % x for x in c]} "
          f"n={['%.1f' % x for x in n]}")
  for name in workers:
    try:
      ask(name, dict(op="quit"))
    except Exception:
      pass
  log(f"done in {time.time() - t_start:.1f}s")


if __name__ == "__main__":
  try:
    main()
  finally:  # never leave a worker behind
    for p in list(_WORKERS):
      if p.poll() is None:
        p.kill()
