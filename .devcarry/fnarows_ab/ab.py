"""fnarows A/B (issue 21): FlashNormAttention fwd+bwd, main's tree vs this tree, one device call.

    PYTHONPATH=$PWD python3 .devcarry/fnarows_ab/ab.py [--control .devcarry/b/main] \
        [--budget-s 180] [--heads 4,2] --out $OUT
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/fnarows_ab/ab.py --tiny --control /work/main \
        --out /tmp/fnarows_tiny   # CPU smoke (interpret mode, tiny shapes, wall clock)

What differs: the backward's row kernels (norm_bwd) work on the rows below the last offset only:
the RMSNorm backward leaves dz's padding rows unwritten, the LayerNorm backward writes dq over
du (aliased; padding rows keep the GDPA backward's 0·pre·post), and the grid splits the live
rows instead of the capacity.

Each tree runs in its own worker process (PYTHONPATH = tree first, then this tree for the
benchmarks package), with half the GPU's memory. A worker builds the suite's case
flash_norm_attention/B768 H L512 D128 KV128/fwd+bwd (jax.vjp of the op under jit,
implementation="mosaic"), compiles it (the H values in threads), checks its outputs (out and
every gradient, dq's padding rows included) against the f32 oracle, then answers "time H"
requests: CUPTI per-kernel lists (profiler.measure aggregate=False) over 2 rotated input sets
(~1 GB each at H = 4: past L2). The driver interleaves control/candidate over ROUNDS rounds
(the order alternates per round) and prints each kernel's median per tree.

Output: RESULT lines on stdout, $OUT/ab.log (a copy of everything printed) and $OUT/ab.json.
"""

from __future__ import annotations

import argparse
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
  heads = [int(h) for h in args.heads.split(",")]
  probs = {}
  t0 = time.monotonic()

  def prepare(h):
    case = C.Case("flash_norm_attention", "", C._attn(h, 512), "fwd+bwd")
    if args.tiny:
      case = C.tiny(case)
    prob = C.build(case, kernel)
    make, _ = R.input_maker(prob, case.mode, host=args.tiny)
    abstract = jax.eval_shape(lambda: R.make_inputs(prob, case.mode,
                                                    C.DeviceRandom(jax.random.key(0))))
    fn = jax.jit(R.with_mode(prob.impl_fn(kernel), prob.diff, case.mode))
    compiled = fn.lower(*abstract).compile()
    return case, prob, make, abstract, compiled

  with cf.ThreadPoolExecutor(len(heads)) as pool:
    futs = {h: pool.submit(prepare, h) for h in heads}
    for h, f in futs.items():
      try:
        probs[h] = f.result()
      except Exception as e:  # noqa: BLE001
        say("error", h=h, stage="compile", message=f"{type(e).__name__}: {str(e)[:400]}")
  say("compiled", seconds=round(time.monotonic() - t0, 1))
  ready = {}
  for h, (case, prob, make, abstract, compiled) in probs.items():
    try:
      sets = [make(R._seed(case.name, i)) for i in range(2)]
      check = R.checker(R.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True))
      outs = compiled(*sets[0])
      parts = check(outs, *sets[0])
      errs = [float(f"{R.rel_err([p]):.2e}") for p in parts]
      leaves = jax.tree.leaves(outs)
      dq = leaves[1]  # (out, dq, dk, dv, dγ1, dβ1, dγ2)
      total = int(sets[0][3][-1])
      pad_ok = bool(jax.device_get((dq[total:] == 0).all()))
      ok = max(errs) < R.TOLERANCE and pad_ok
      del outs
      say("check", h=h, case=case.name, errs=errs, dq_padding_zero=pad_ok, ok=ok,
          live_rows=total, capacity=int(sets[0][0].shape[0]))
      if ok:
        ready[h] = (compiled, sets)
    except Exception as e:  # noqa: BLE001
      say("error", h=h, stage="check", message=f"{type(e).__name__}: {str(e)[:400]}")
  say("ready", heads=sorted(ready))
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    h = int(cmd[1])
    fn, sets = ready[h]
    try:
      if timer == "wall":
        per_call, kernels = timing.measure_us(fn, sets, ITERS, "wall"), []
      else:
        from jax.experimental.mosaic.gpu import profiler
        _, runs = profiler.measure(timing.Rotating(fn, sets), aggregate=False,
                                   iterations=ITERS)()
        runs = [runs] if ITERS == 1 else runs
        per_call = [1e3 * sum(ms for _, ms in r) for r in runs]
        by = {}
        for r in runs:
          seen = {}
          for name, ms in r:
            key = f"{name}#{seen[name]}" if name in seen else name
            seen[name] = seen.get(name, 0) + 1
            by.setdefault(key, []).append(1e3 * ms)
        kernels = [(k, round(statistics.median(v), 2)) for k, v in by.items()]
      say("time", h=h, per_call=[round(x, 1) for x in per_call], kernels=kernels)
    except Exception as e:  # noqa: BLE001
      say("time", h=h, error=f"{type(e).__name__}: {str(e)[:400]}")


# ------------------------------------------------------------------------------------------------
# Driver.

class Worker:
  def __init__(self, name, tree, args, log):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), CAND_ROOT])
    if not args.tiny:
      env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--heads", args.heads]
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
  p.add_argument("--budget-s", type=float, default=180)
  p.add_argument("--heads", default="4,2")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fnarows_ab"))
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--worker", action="store_true")
  args = p.parse_args()
  if args.worker:
    return worker(args)
  global ROUNDS
  if args.tiny:  # interpret mode: two rounds (the order swaps), one H
    ROUNDS, args.heads = 2, args.heads.split(",")[-1]
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
  log(f"control={os.path.abspath(args.control)} candidate={CAND_ROOT} heads={args.heads} "
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
  heads = [int(h) for h in args.heads.split(",")]
  both = [h for h in heads if all(r and h in r["heads"] for r in readies.values())]
  log(f"ready: {readies}; timing H in {both}")
  results = {"heads": both, "rounds": {}}
  per_round = 2 * ITERS * 0.004 + 1.0  # a generous guess of one round's wall per H
  for rnd in range(ROUNDS):
    for h in both:
      if time.monotonic() - t_start > args.budget_s - per_round:
        log(f"round {rnd} H{h}: skipped (budget)")
        continue
      order = ["control", "candidate"] if rnd % 2 == 0 else ["candidate", "control"]
      for name in order:
        msg = workers[name].ask(f"time {h}", "time")
        results["rounds"].setdefault(f"H{h}/{name}", []).append(msg)
  summary = {}
  for h in both:
    for name in workers:
      msgs = [m for m in results["rounds"].get(f"H{h}/{name}", []) if m and "per_call" in m]
      if not msgs:
        continue
      calls = [x for m in msgs for x in m["per_call"]]
      by = {}
      for m in msgs:
        for k, us in m["kernels"]:
          by.setdefault(k, []).append(us)
      summary[f"H{h}/{name}"] = dict(
          us=round(statistics.median(calls), 1), us_min=round(min(calls), 1),
          rounds=[round(statistics.median(m["per_call"]), 1) for m in msgs],
          kernels={k: round(statistics.median(v), 1) for k, v in by.items()})
      row = dict(h=h, tree=name, **summary[f"H{h}/{name}"])
      log("RESULT " + json.dumps(row))
    c, d = summary.get(f"H{h}/control"), summary.get(f"H{h}/candidate")
    if c and d:
      log(f"H{h}: fwd+bwd control {c['us']} -> candidate {d['us']} "
          f"({d['us'] - c['us']:+.1f} us); rounds {c['rounds']} vs {d['rounds']}")
      for k in sorted(set(c["kernels"]) | set(d["kernels"]),
                      key=lambda k: -max(c["kernels"].get(k, 0), d["kernels"].get(k, 0))):
        a, b = c["kernels"].get(k), d["kernels"].get(k)
        log(f"   {k[:70]:70s} {a!s:>8} {b!s:>8}")
  for w in workers.values():
    w.close()
  with open(os.path.join(args.out, "ab.json"), "w") as f:
    json.dump(dict(summary=summary, ready=readies, raw=results), f, indent=1)
  log(f"done in {time.monotonic() - t_start:.0f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
