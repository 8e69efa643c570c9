"""fnarows A/B (issue 21): FlashNormAttention fwd+bwd, main's tree vs this tree, one device call.

    PYTHONPATH=$PWD python3 .devcarry/fnarows_ab/ab.py [--control .devcarry/b/main] \
        [--budget-s 175] [--cases H4,H4pad,H2] [--no-rows] --out $OUT
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/fnarows_ab/ab.py --tiny --control /work/main \
        --out /tmp/fnarows_tiny   # CPU smoke (interpret mode, tiny shapes, wall clock)

What differs: the backward's row kernels (norm_bwd) work on the rows below the last offset only:
the RMSNorm backward leaves dz's padding rows unwritten, the LayerNorm backward writes dq over
du (aliased; padding rows keep the GDPA backward's 0·pre·post), and the grid splits the live
rows instead of the capacity; the backward runs on the forward's offsets (no made-valid offsets:
the validity's N² fusions gone).

Each tree runs in its own worker process (PYTHONPATH = tree first, then this tree for the
benchmarks package), with ~45% of the GPU's memory. Cases (priority order; ``--cases``):

  H4, H2     the suite's flash_norm_attention/B768 H L512 D128 KV128/fwd+bwd: capacity T = the
             lengths' sum rounded up to 128 (193152 rows at H4: almost no padding rows)
  H4pad      the same lengths in a capacity of B·Lmax = 393216 rows (half padding, as a caller
             with a fixed capacity has): where skipping the padding rows pays

A worker compiles each case's jax.vjp of the op under jit (implementation="mosaic"; in
threads), checks its outputs (out and every gradient, dq's padding rows exactly 0) against the
f32 oracle, then answers "time CASE" requests: CUPTI per-kernel lists (profiler.measure
aggregate=False) over 2 rotated input sets (~1-1.6 GB each: past L2). The driver interleaves
control/candidate over ROUNDS rounds (the order alternates per round) and prints each kernel's
median per tree. Then (part "rows", candidate only, if budget is left) the two row kernels
alone at the H4 case's rows under norm_bwd.TILINGS variants (the tiling rule, lever 3),
interleaved over 3 rounds (the LayerNorm kernel's time is its own kernel's: under jit XLA copies
the non-donated du it writes over, a separate kernel in the list).

Output: RESULT lines on stdout, $OUT/ab.log (a copy of everything printed) and $OUT/ab.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROUNDS, ITERS = 3, 6
HERE = os.path.dirname(os.path.abspath(__file__))
CAND_ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


# ------------------------------------------------------------------------------------------------
# Worker: one tree.

def worker(args):
  global ITERS
  if args.tiny:  # interpret mode: one call per request
    ITERS = 1
  import concurrent.futures as cf
  import jax
  from benchmarks import cases as C
  from benchmarks import run as R
  from benchmarks import timing
  import pallas_norm

  def say(kind, **kw):
    print(json.dumps(dict(kind=kind, **kw)), flush=True)

  say("info", pallas_norm=os.path.dirname(pallas_norm.__file__), backend=jax.default_backend())
  kernel = "interpret" if args.tiny else "mosaic"
  timer = "wall" if args.tiny else "cupti"
  names = args.cases.split(",")
  probs = {}
  t0 = time.monotonic()

  def prepare(name):
    h, padded = int(name[1]), name.endswith("pad")
    case = C.Case("flash_norm_attention", "", C._attn(h, 512), "fwd+bwd")
    if args.tiny:
      case = C.tiny(case)
    prob = C.build(case, kernel)
    if padded:  # same lengths, capacity B·Lmax
      prob = dataclasses.replace(prob, make_set=_padded_make_set(prob.make_set, case))
    make, _ = R.input_maker(prob, case.mode, host=args.tiny)
    abstract = jax.eval_shape(lambda: R.make_inputs(prob, case.mode,
                                                    C.DeviceRandom(jax.random.key(0))))
    fn = jax.jit(R.with_mode(prob.impl_fn(kernel), prob.diff, case.mode))
    compiled = fn.lower(*abstract).compile()
    return case, prob, make, abstract, compiled

  ready = {}

  def check(h, case, prob, make, compiled):
    sets = [make(R._seed(case.name, i)) for i in range(2)]
    checker = R.checker(R.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True))
    outs = compiled(*sets[0])
    errs = [float(f"{R.rel_err([p]):.2e}") for p in checker(outs, *sets[0])]
    dq = jax.tree.leaves(outs)[1]  # (out, dq, dk, dv, dγ1, dβ1, dγ2)
    total = int(sets[0][3][-1])
    pad_ok = bool(jax.device_get((dq[total:] == 0).all()))
    ok = max(errs) < R.TOLERANCE and pad_ok
    del outs, dq
    say("check", h=h, case=case.name + ("/padded" if h.endswith("pad") else ""), errs=errs,
        dq_padding_zero=pad_ok, ok=ok, live_rows=total, capacity=int(sets[0][0].shape[0]),
        seconds=round(time.monotonic() - t0, 1))
    if ok:
      ready[h] = (compiled, sets)

  # Compiles in threads; each program is checked (main thread) as soon as it is compiled.
  with cf.ThreadPoolExecutor(len(names)) as pool:
    futs = {pool.submit(prepare, h): h for h in names}
    for f in cf.as_completed(futs):
      h = futs[f]
      try:
        case, prob, make, _, compiled = f.result()
        say("compiled", h=h, seconds=round(time.monotonic() - t0, 1))
        check(h, case, prob, make, compiled)
      except Exception as e:  # noqa: BLE001
        say("error", h=h, message=f"{type(e).__name__}: {str(e)[:400]}")
  say("ready", cases=sorted(ready))

  def kernel_times(fn, sets):
    if timer == "wall":
      return timing.measure_us(fn, sets, ITERS, "wall"), []
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(timing.Rotating(fn, sets), aggregate=False, iterations=ITERS)()
    runs = [runs] if ITERS == 1 else runs
    per_call = [1e3 * sum(ms for _, ms in r) for r in runs]
    by = {}
    for r in runs:
      seen = {}
      for name, ms in r:
        key = f"{name}#{seen[name]}" if name in seen else name
        seen[name] = seen.get(name, 0) + 1
        by.setdefault(key, []).append(1e3 * ms)
    return per_call, [(k, round(statistics.median(v), 2)) for k, v in by.items()]

  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    if cmd[0] == "rows":
      probs.clear()
      ready.clear()
      try:
        rows_part(say, kernel_times, args.tiny)
      except Exception as e:  # noqa: BLE001
        say("rows", error=f"{type(e).__name__}: {str(e)[:400]}")
      continue
    h = cmd[1]
    fn, sets = ready[h]
    try:
      per_call, kernels = kernel_times(fn, sets)
      say("time", h=h, per_call=[round(x, 1) for x in per_call], kernels=kernels)
    except Exception as e:  # noqa: BLE001
      say("time", h=h, error=f"{type(e).__name__}: {str(e)[:400]}")


def _padded_make_set(make_set, case):
  """``make_set`` with q (and so the cotangent) in a capacity of B·Lmax rows: the suite's
  lengths and offsets, the rest of the rows padding."""
  import jax.numpy as jnp
  capacity = case.dim("B") * case.dim("L")

  def make(rand):
    q, *rest = make_set(rand)
    extra = rand((capacity - q.shape[0],) + q.shape[1:])
    return (jnp.concatenate([q, extra]), *rest)

  return make


RMS_VARIANTS = ((4096, 8), (4096, 12), (2048, 8))
LN_VARIANTS = ((2048, 8), (2048, 12), (1024, 8))


def rows_part(say, kernel_times, tiny):
  """The candidate's two row kernels alone at the H4 case's rows (T = 193152, end = its
  tokens; tiny: 128 × 256) under TILINGS variants (elements per step, programs per SM)."""
  import functools
  import jax
  import jax.numpy as jnp
  from benchmarks import cases as C
  from pallas_norm.ops.flash_norm_attention import norm_bwd
  case = C.Case("flash_norm_attention", "", C._attn(4, 512), "fwd+bwd")
  lens = C.attention_lengths(case)
  end = int(lens.sum())
  t, n = -(-end // 128) * 128, 512
  if tiny:
    t, n, end = 128, 256, 100

  @jax.jit
  def make(key):
    ks = jax.random.split(key, 6)
    g, z, du, q = (jax.random.normal(k, (t, n), jnp.float32).astype(jnp.bfloat16)
                   for k in ks[:4])
    stats = jnp.concatenate([jax.random.normal(ks[4], (t, 1)),
                             1 + jax.random.uniform(ks[5], (t, 2)),
                             jnp.zeros((t, 29))], axis=1)
    return g, z, du, q, stats, jnp.ones((n,), jnp.float32)

  sets = [make(jax.random.key(i)) for i in range(2)]
  fns = {}
  for kind, variants in (("rms", RMS_VARIANTS), ("ln", LN_VARIANTS)):
    for tiling in variants:
      old = dict(norm_bwd.TILINGS)
      norm_bwd.TILINGS[kind] = tiling
      cfg = norm_bwd.pick_config(n, tiny, t, kind)
      norm_bwd.TILINGS.clear()
      norm_bwd.TILINGS.update(old)
      if kind == "rms":
        f = jax.jit(lambda g, z, du, q, s, gm, cfg=cfg: norm_bwd.rms_backward(
            g, z, s, gm, end, interpret=tiny, config=cfg))
      else:
        f = jax.jit(lambda g, z, du, q, s, gm, cfg=cfg: norm_bwd.ln_backward(
            du, g, q, s, gm, end, outer_residual=True, interpret=tiny, config=cfg))
      fns[(kind, tiling)] = f
  for f in fns.values():
    jax.block_until_ready(f(*sets[0]))
  for rnd in range(2 if tiny else 3):
    for (kind, tiling), f in fns.items():
      per_call, kernels = kernel_times(f, sets)
      own = [us for k, us in kernels if f"fna_{kind}_backward" in k]
      say("rows_time", round=rnd, kernel=kind, tiling=list(tiling),
          us=round(statistics.median(per_call), 1), kernel_us=own[0] if own else None,
          kernels=kernels)
  say("rows", done=True)


# ------------------------------------------------------------------------------------------------
# Driver.

class Worker:
  def __init__(self, name, tree, args, log):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), CAND_ROOT])
    if not args.tiny:
      env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--cases", args.cases]
    if args.tiny:
      cmd.append("--tiny")
    self.name, self.log = name, log
    self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 cwd=os.path.abspath(tree))

  def until(self, kind):
    """Messages up to and including the first of ``kind`` (None if the worker ended)."""
    for line in self.proc.stdout:
      line = line.rstrip("\n")
      try:
        msg = json.loads(line)
      except ValueError:
        if line.strip():
          self.log(f"[{self.name}] {line[:300]}")
        continue
      self.log(f"[{self.name}] {json.dumps(msg)[:2000]}")
      if msg.get("kind") == kind:
        return msg
    return None

  def ask(self, cmd, kind):
    self.proc.stdin.write(cmd + "\n")
    self.proc.stdin.flush()
    return self.until(kind)

  def close(self):
    try:
      self.proc.stdin.write("quit\n")
      self.proc.stdin.flush()
      self.proc.wait(timeout=20)
    except Exception:  # noqa: BLE001
      self.proc.kill()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--control", default=".devcarry/b/main")
  p.add_argument("--budget-s", type=float, default=175)
  p.add_argument("--cases", default="H4,H4pad,H2")
  p.add_argument("--no-rows", action="store_true", help="skip the row kernels' tiling part")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fnarows_ab"))
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--worker", action="store_true")
  args = p.parse_args()
  if args.worker:
    return worker(args)
  global ROUNDS
  if args.tiny:  # interpret mode: two rounds (the order swaps), two cases
    ROUNDS, args.cases = 2, "H2,H2pad"
  t_start = time.monotonic()
  os.makedirs(args.out, exist_ok=True)
  logf = open(os.path.join(args.out, "ab.log"), "w")
  lock = threading.Lock()

  def log(msg):
    with lock:
      line = f"{time.monotonic() - t_start:6.1f}s {msg}"
      print(line, flush=True)
      logf.write(line + "\n")
      logf.flush()

  workers = {}

  def watchdog():
    time.sleep(args.budget_s + 20)
    log("WATCHDOG: budget + 20 s passed, killing workers")
    for w in workers.values():
      w.proc.kill()
    os._exit(2)

  threading.Thread(target=watchdog, daemon=True).start()
  if not os.path.isdir(os.path.join(args.control, "pallas_norm")):
    log(f"no control tree at {args.control}")
    return 1
  log(f"control={os.path.abspath(args.control)} candidate={CAND_ROOT} cases={args.cases} "
      f"tiny={args.tiny}")
  workers = {"control": Worker("control", args.control, args, log),
             "candidate": Worker("candidate", CAND_ROOT, args, log)}
  readies = {}
  threads = [threading.Thread(target=lambda n=n, w=w: readies.__setitem__(n, w.until("ready")))
             for n, w in workers.items()]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  names = args.cases.split(",")
  both = [h for h in names if all(r and h in r["cases"] for r in readies.values())]
  log(f"ready: {readies}; timing {both}")
  results = {"cases": both, "rounds": {}}
  per_round = 2 * ITERS * 0.004 + 2.0  # a generous guess of one round's wall per case
  for rnd in range(ROUNDS):
    for h in both:
      if time.monotonic() - t_start > args.budget_s - per_round:
        log(f"round {rnd} H{h}: skipped (budget)")
        continue
      order = ["control", "candidate"] if rnd % 2 == 0 else ["candidate", "control"]
      for name in order:
        msg = workers[name].ask(f"time {h}", "time")
        results["rounds"].setdefault(f"{h}/{name}", []).append(msg)
  summary = {}
  for h in both:
    for name in workers:
      msgs = [m for m in results["rounds"].get(f"{h}/{name}", []) if m and "per_call" in m]
      if not msgs:
        continue
      calls = [x for m in msgs for x in m["per_call"]]
      by = {}
      for m in msgs:
        for k, us in m["kernels"]:
          by.setdefault(k, []).append(us)
      summary[f"{h}/{name}"] = dict(
          us=round(statistics.median(calls), 1), us_min=round(min(calls), 1),
          rounds=[round(statistics.median(m["per_call"]), 1) for m in msgs],
          kernels={k: round(statistics.median(v), 1) for k, v in by.items()})
      row = dict(case=h, tree=name, **summary[f"{h}/{name}"])
      log("RESULT " + json.dumps(row))
    c, d = summary.get(f"{h}/control"), summary.get(f"{h}/candidate")
    if c and d:
      log(f"{h}: fwd+bwd control {c['us']} -> candidate {d['us']} "
          f"({d['us'] - c['us']:+.1f} us); rounds {c['rounds']} vs {d['rounds']}")
      for k in sorted(set(c["kernels"]) | set(d["kernels"]),
                      key=lambda k: -max(c["kernels"].get(k, 0), d["kernels"].get(k, 0))):
        a, b = c["kernels"].get(k), d["kernels"].get(k)
        log(f"   {k[:70]:70s} {a!s:>8} {b!s:>8}")
  workers["control"].close()
  rows = []
  if not args.no_rows and time.monotonic() - t_start < args.budget_s - 25:
    workers["candidate"].proc.stdin.write("rows\n")
    workers["candidate"].proc.stdin.flush()
    for line in workers["candidate"].proc.stdout:
      try:
        msg = json.loads(line)
      except ValueError:
        log(f"[candidate] {line.rstrip()[:300]}")
        continue
      if msg.get("kind") == "rows_time":
        rows.append(msg)
        log(f"rows round {msg['round']} {msg['kernel']} {msg['tiling']}: kernel "
            f"{msg['kernel_us']} us (call {msg['us']})")
      elif msg.get("kind") == "rows":
        log(f"[candidate] {json.dumps(msg)[:400]}")
        break
    by = {}
    for m in rows:
      by.setdefault((m["kernel"], tuple(m["tiling"])), []).append(m["kernel_us"])
    for (kind, tiling), v in by.items():
      v = [x for x in v if x is not None]
      if v:
        log("RESULT " + json.dumps(dict(part="rows", kernel=kind, tiling=tiling,
                                        kernel_us=round(statistics.median(v), 1),
                                        rounds=v)))
  else:
    log("rows part skipped")
  workers["candidate"].close()
  with open(os.path.join(args.out, "ab.json"), "w") as f:
    json.dump(dict(summary=summary, ready=readies, raw=results, rows=rows), f, indent=1)
  log(f"done in {time.monotonic() - t_start:.0f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
