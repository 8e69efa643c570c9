"""gdpabwdp A/B: the GDPA backward's dK/dV(+fused dQ) kernel on a persistent grid (this branch)
against main's non-persistent one (one CTA per (sample's kv tile, head)).

    PYTHONPATH=$PWD python3 .devcarry/gdpabwdp_ab/ab.py --out $OUT [--control .devcarry/b/main]
        [--budget-s 200] [--rounds 3] [--cases h4,h2,full4,fna4] [--ptxas]
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/gdpabwdp_ab/ab.py --tiny --out /tmp/x  # CPU

Trees, not switches: the control is main's tree (``--control``, default ``.devcarry/b/main``
relative to the tree root; ``--tiny`` makes it from ``git archive main`` when absent), the
candidate the tree this script sits in. Each tree runs in its own worker subprocess (PYTHONPATH
= that tree); each compiles its programs at once (threads), checks every output against the f32
oracle (pallas_norm.reference) and hashes it (bit-identity with main is reported: the
persistent grid changes no arithmetic of the dense path), then the parent times the cases
interleaved over ``--rounds`` rounds (A,B then B,A), CUPTI per-kernel lists (wall clock under
--tiny), inputs rotated over sets past the 60 MB L2.

Cases (bf16, B=768, Lmax=512, D=128, dense K/V Lkv=128, fast_gelu; lengths uniform on [1, 512]
(benchmarks.cases.attention_lengths), T = their sum rounded up to 128):
  h4: ``gdpa_bwd`` alone (the kernel and its glue), H=4 (the issue shape); h2: H=2;
  full4: density 1.0 (every length 512), H=4;
  fna4: the FlashNormAttention op fwd+bwd at H=4 (implementation="mosaic"; its backward calls
  the GDPA backward with add_do_to_dq) through benchmarks.cases, checked against its full f32
  oracle;
  op4 (not in the default list): the GDPA op fwd+bwd at H=4 (the backward reuses the
  forward's work table).
The bwd cases are checked against ``jax.vjp`` of ``reference.gdpa`` in f32 on two windows of
samples (the first and the last ``check_samples``: a sample's dk/dv depend on its own q rows
only, its dq rows on its own K/V only), every output finite, dq's padding rows exactly 0.

Output: lines as they come ($OUT/ab.log), $OUT/ab.json (RESULT rows with per-kernel medians).
``--ptxas``: each worker's Mosaic kernels' ptxas reports (registers, spills, C7519/C7512).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # .devcarry/gdpabwdp_ab/ab.py -> tree root
PREFIX = "@@ "
CASES = ("h4", "h2", "full4", "fna4")
ALL_CASES = CASES + ("op4",)
TOL = 1e-2
ROTATE_BYTES = 200 << 20


# ------------------------------------------------------------------------------------------------
# Worker: one tree, its programs compiled and checked, then timing on request.


def _worker(args):
  tree = os.path.abspath(args.tree)
  # The tree's pallas_norm first; benchmarks/ from the tree when it has one, else the candidate's.
  sys.path[:0] = [tree, ROOT]
  import numpy as np
  import jax
  import jax.numpy as jnp

  import pallas_norm as pn
  from pallas_norm import reference
  from pallas_norm.ops.gdpa import mosaic_bwd as gb
  from benchmarks import cases as C
  from benchmarks import run as R

  assert os.path.abspath(pn.__file__).startswith(tree), (pn.__file__, tree)
  tiny = args.tiny
  f32 = jnp.float32
  say = lambda kind, obj: print(PREFIX + kind + " " + json.dumps(obj), flush=True)  # noqa: E731
  kernel = "interpret" if tiny else "mosaic"
  if tiny:
    batch, lmax, d, lkv, check_samples = 5, 130, 128, 128, 2
  else:
    batch, lmax, d, lkv, check_samples = 768, 512, 128, 128, 24

  def lengths(density):
    if tiny:
      return np.array([70, 0, 130, 9, 64]) if density < 1 else np.full(batch, lmax)
    case = C.Case("gdpa", "full" if density >= 1 else "", C._attn(4, lmax), "fwd+bwd")
    return C.attention_lengths(case)

  def bwd_problem(heads, density):
    """(fn, make(seed) -> input set, check(outs, inputs) -> info) of gdpa_bwd alone."""
    lens = lengths(density)
    total = int(lens.sum())
    capacity = -(-max(total, 1) // 128) * 128
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))

    @jax.jit
    def make_jit(key):
      ks = jax.random.split(key, 4)
      n = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape, f32)).astype(jnp.bfloat16)  # noqa: E731
      q = n(ks[0], (capacity, heads, d))
      k = n(ks[1], (batch, lkv, heads, d), d ** -0.5)
      v = n(ks[2], (batch, lkv, heads, d))
      do = n(ks[3], (capacity, heads, d))
      return q, k, v, do

    def make(seed):
      q, k, v, do = make_jit(jax.random.key(seed))
      return q, k, v, offsets, do

    def bwd(q, k, v, qo, do):
      return gb.gdpa_bwd(q, k, v, qo, None, do, activation="fast_gelu", interpret=tiny)[:3]

    def check(outs, inputs):
      q, k, v, qo, do = inputs
      dq, dk, dv = outs
      qo_np = np.asarray(qo)
      errs = []
      for lo_s in sorted({0, batch - check_samples}):
        hi_s = lo_s + check_samples
        r0, r1 = int(qo_np[lo_s]), int(qo_np[hi_s])
        sub = jnp.asarray(qo_np[lo_s:hi_s + 1] - r0)
        up = lambda x: x.astype(f32)  # noqa: E731
        _, pull = jax.vjp(lambda q_, k_, v_: reference.gdpa(
            q_, k_, v_, sub, activation="fast_gelu", max_seq_len=lmax),
            up(q[r0:r1]), up(k[lo_s:hi_s]), up(v[lo_s:hi_s]))
        want = pull(up(do[r0:r1]))
        for got, ref in zip((dq[r0:r1], dk[lo_s:hi_s], dv[lo_s:hi_s]), want):
          errs.append(_rel(got, ref))
      return {"rel_err": [round(e, 5) for e in errs],
              "finite": all(bool(jnp.all(jnp.isfinite(x))) for x in outs),
              "padding_zero": not bool(jnp.any(dq[total:] != 0)),
              "ok_fn": max(errs) < TOL}

    return jax.jit(bwd), make, check

  def op_problem(op, heads):
    """(fn, make, check) of an op's fwd+bwd through benchmarks.cases (full f32 oracle)."""
    case = C.Case(op, "", C._attn(heads, 512), "fwd+bwd")
    if tiny:
      case = C.tiny(case)
    prob = C.build(case, kernel)
    fn = jax.jit(R.with_mode(prob.impl_fn(kernel), prob.diff, case.mode))
    ref = R.with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True)
    gen = None if tiny else jax.jit(
        lambda key: R.make_inputs(prob, case.mode, C.DeviceRandom(key)))

    def make(seed):
      if tiny:
        return R.make_inputs(prob, case.mode, C.HostRandom(seed))
      return gen(jax.random.key(seed))

    checker = R.checker(ref)

    def check(outs, inputs):
      err = R.rel_err(checker(outs, *inputs))
      finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(outs))
      return {"rel_err": [round(err, 5)], "finite": finite, "padding_zero": True,
              "ok_fn": err < TOL}

    return fn, make, check

  specs = {"h4": lambda: bwd_problem(4, 0.5), "h2": lambda: bwd_problem(2, 0.5),
           "full4": lambda: bwd_problem(4, 1.0),
           "fna4": lambda: op_problem("flash_norm_attention", 4),
           "op4": lambda: op_problem("gdpa", 4)}
  cases = args.cases.split(",")
  problems = {c: specs[c]() for c in cases}
  t0 = time.time()
  compiled, errors, sets = {}, {}, {}

  def compile_one(case):
    fn, make, _ = problems[case]
    first = make(1000)
    return fn.lower(*first).compile(), first

  with cf.ThreadPoolExecutor(len(cases)) as pool:
    futs = {c: pool.submit(compile_one, c) for c in cases}
    for c, fu in futs.items():
      try:
        compiled[c], first = fu.result()
        sets[c] = [first]
      except Exception as e:  # noqa: BLE001
        errors[c] = f"{type(e).__name__}: {str(e)[:400]}"
  say("COMPILED", {"seconds": round(time.time() - t0, 1), "errors": errors})

  def digest(xs):
    h = hashlib.sha256()
    for x in jax.tree.leaves(xs):
      h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]

  checks = {}
  for case, exe in compiled.items():
    _, make, check = problems[case]
    try:
      inputs = sets[case][0]
      out = jax.block_until_ready(exe(*inputs))
      info = check(out, inputs)
      info["digest"] = digest(out)
      info["ok"] = bool(info.pop("ok_fn") and info["finite"] and info["padding_zero"])
      del out
      per_set = max(1, R.nbytes(inputs))
      n_sets = 1 if tiny else min(4, max(2, -(-ROTATE_BYTES // per_set)))
      sets[case] += [make(1000 + i) for i in range(1, n_sets)]
      info["sets"] = len(sets[case])
    except Exception as e:  # noqa: BLE001
      info = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    checks[case] = info
  say("READY", {"checks": checks, "seconds": round(time.time() - t0, 1), "tree": tree,
                "jax": jax.__version__})

  def kernel_times(exe, arg_sets, iters):
    if tiny:
      out = []
      for i in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(exe(*arg_sets[i % len(arg_sets)]))
        out.append(1e6 * (time.perf_counter() - t))
      return out, []
    from jax.experimental.mosaic.gpu import profiler
    from benchmarks.timing import Rotating
    _, runs = profiler.measure(Rotating(exe, arg_sets), aggregate=False, iterations=iters)()
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

  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    case, iters = cmd[1], int(cmd[2])
    try:
      per_call, kernels = kernel_times(compiled[case], sets[case], iters)
      say("TIMES", {"case": case, "us": [round(t, 1) for t in per_call], "kernels": kernels})
    except Exception as e:  # noqa: BLE001
      say("TIMES", {"case": case, "error": f"{type(e).__name__}: {str(e)[:400]}"})


def _rel(a, b):
  import numpy as np
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ------------------------------------------------------------------------------------------------
# Parent: two workers, interleaved timing, summary.


class Worker:
  def __init__(self, tag, tree, args, dump_dir):
    env = dict(os.environ, PYTHONPATH=tree, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.45")
    if dump_dir:
      env.update(MOSAIC_GPU_DUMP_TO=dump_dir, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree,
           "--cases", args.cases] + (["--tiny"] if args.tiny else [])
    self.tag = tag
    self.proc = subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 bufsize=1)

  def read(self, kind):
    for line in self.proc.stdout:
      if line.startswith(PREFIX):
        k, _, body = line[len(PREFIX):].partition(" ")
        if k == kind:
          return json.loads(body)
      elif line.strip() and not _noise(line):
        log(f"  [{self.tag}] {line.rstrip()[:300]}")
    raise RuntimeError(f"worker {self.tag} exited (rc={self.proc.wait()})")

  def send(self, msg):
    self.proc.stdin.write(msg + "\n")
    self.proc.stdin.flush()


def _noise(line):
  return any(s in line for s in ("W0000", "I0000", "absl::InitializeLog", "UserWarning",
                                 "warnings.warn", "RuntimeWarning", "res = acc + np.matmul"))


_LOG = None


def log(msg):
  line = f"[{time.strftime('%H:%M:%S')}] {msg}"
  print(line, flush=True)
  if _LOG:
    _LOG.write(line + "\n")
    _LOG.flush()


def _ptxas_summary(tag, dump_dir):
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptxas"))):
    text = open(path, errors="replace").read()
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    warns = sorted(set(re.findall(r"C75\d\d", text)))
    counts = {w: text.count(w) for w in warns}
    log(f"  ptxas [{tag}] {os.path.basename(path)}: registers {regs}, spills (st, ld) "
        f"{spills[:1]}, warnings {counts}")


def _parent(args):
  global _LOG
  t_start = time.time()
  os.makedirs(args.out, exist_ok=True)
  _LOG = open(os.path.join(args.out, "ab.log"), "a")
  control = os.path.abspath(os.path.join(ROOT, args.control))
  if args.tiny and not os.path.isdir(os.path.join(control, "pallas_norm")):
    os.makedirs(control, exist_ok=True)
    arch = subprocess.run(["git", "-C", ROOT, "archive", "main", "pallas_norm"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", control], input=arch, check=True)
  if not os.path.isdir(os.path.join(control, "pallas_norm")):
    log(f"no control tree at {control}")
    sys.exit(2)

  workers, dumps = {}, {}
  result = {"args": vars(args), "checks": {}, "rows": []}

  def flush():
    with open(os.path.join(args.out, "ab.json"), "w") as f:
      json.dump(result, f, indent=1)

  def watchdog():
    time.sleep(args.budget_s + 20)
    log("watchdog: budget + 20 s passed, exiting")
    flush()
    for w in workers.values():
      w.proc.kill()
    os._exit(3)

  threading.Thread(target=watchdog, daemon=True).start()
  log(f"gdpabwdp A/B: control {control}, candidate {ROOT}, cases {args.cases}, "
      f"budget {args.budget_s} s, tiny={args.tiny}")
  for tag, tree in (("main", control), ("cand", ROOT)):
    dumps[tag] = tempfile.mkdtemp(prefix=f"gdpabwdp_{tag}_") if args.ptxas else None
    workers[tag] = Worker(tag, tree, args, dumps[tag])
  for tag, w in workers.items():
    c = w.read("COMPILED")
    log(f"{tag}: compiled in {c['seconds']} s, errors {c['errors']}")
  ok = {}
  for tag, w in workers.items():
    r = w.read("READY")
    result["checks"][tag] = r["checks"]
    log(f"{tag}: checked ({r['seconds']} s since start, jax {r['jax']}, tree {r['tree']})")
    for case, info in r["checks"].items():
      log(f"  {tag} {case:6s} {'ok ' if info.get('ok') else 'BAD'} {info}")
      ok.setdefault(case, []).append(bool(info.get("ok")))
  flush()
  for case in ok:
    same = result["checks"]["main"].get(case, {}).get("digest") == \
        result["checks"]["cand"].get(case, {}).get("digest")
    log(f"{case}: candidate outputs bit-identical to main's: {same}")
  if args.ptxas:
    for tag in workers:
      _ptxas_summary(tag, dumps[tag])

  cases = [c for c in args.cases.split(",") if all(ok.get(c, [False])) and len(ok[c]) == 2]
  skipped = [c for c in args.cases.split(",") if c not in cases]
  if skipped:
    log(f"not timed (a check failed or did not run): {skipped}")
  per = {(c, t): [] for c in cases for t in workers}
  rounds = {(c, t): [] for c in cases for t in workers}
  kernels = {}
  round_s = None
  for rnd in range(args.rounds):
    left = args.budget_s - (time.time() - t_start)
    if round_s is not None and left < round_s * 1.2:
      log(f"round {rnd}: {left:.0f} s left, a round takes {round_s:.0f}: stopping")
      break
    t0 = time.time()
    order = list(workers) if rnd % 2 == 0 else list(workers)[::-1]
    for case in cases:
      for tag in order:
        if args.budget_s - (time.time() - t_start) < 15:
          log(f"round {rnd} {case} {tag}: under 15 s of budget left, not timed")
          continue
        workers[tag].send(f"time {case} {args.iters}")
        r = workers[tag].read("TIMES")
        if "error" in r:
          log(f"  {tag} {case}: {r['error']}")
          continue
        per[case, tag] += r["us"]
        rounds[case, tag].append(round(statistics.median(r["us"]), 1))
        kernels[case, tag] = r["kernels"]
        log(f"round {rnd} {case:6s} {tag:4s} median {statistics.median(r['us']):9.1f} us")
    round_s = time.time() - t0
    log(f"round {rnd} done in {round_s:.0f} s")

  for case in cases:
    med = {}
    for tag in workers:
      v = per[case, tag]
      if not v:
        continue
      med[tag] = statistics.median(v)
      row = {"case": case, "tree": tag, "median_us": round(med[tag], 1),
             "min_us": round(min(v), 1), "rounds": rounds[case, tag], "n": len(v),
             "kernels": kernels.get((case, tag), [])}
      result["rows"].append(row)
      log(f"RESULT {json.dumps(row)}")
    if len(med) == 2:
      log(f"{case}: cand / main = {med['cand'] / med['main']:.3f} "
          f"({med['main']:.1f} -> {med['cand']:.1f} us)")
  flush()
  for w in workers.values():
    try:
      w.send("quit")
      w.proc.wait(timeout=30)
    except Exception:  # noqa: BLE001
      w.proc.kill()
  log(f"done in {time.time() - t_start:.0f} s")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--control", default=".devcarry/b/main")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gdpabwdp_ab"))
  p.add_argument("--budget-s", type=float, default=200)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--cases", default=",".join(CASES), help=f"any of {','.join(ALL_CASES)}")
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--ptxas", action="store_true")
  p.add_argument("--worker", action="store_true")
  p.add_argument("--tree")
  args = p.parse_args()
  if args.tiny:  # interpret mode on the CPU: a call of a case takes seconds
    args.iters = min(args.iters, 1)
    args.rounds = min(args.rounds, 2)
    args.budget_s = max(args.budget_s, 900)
  if args.worker:
    _worker(args)
  else:
    _parent(args)


if __name__ == "__main__":
  main()
