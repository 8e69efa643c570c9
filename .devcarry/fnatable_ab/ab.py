"""fnatable A/B (issue 21): the FlashNormAttention forward (and op4: the op fwd+bwd), main vs this branch (the work table's PADDING column computed before the sort).

    PYTHONPATH=$PWD python3 .devcarry/fnatable_ab/ab.py --ptxas --out $OUT \
        --cases fwd4,train4,fwd2,train2 --extra a=.devcarry/fnatable_ab/a:fwd4,train4 \
        --extra ov=.devcarry/fnatable_ab/ov:fwd4,train4 [--control .devcarry/b/main]
        [--budget-s 220] [--rounds 3]
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/fnatable_ab/ab.py --tiny --out /tmp/x \
        --cases fwd4,train4,fwd2,train2 --extra a=.devcarry/fnatable_ab/a:fwd4,train4 \
        --extra ov=.devcarry/fnatable_ab/ov:fwd4,train4 --budget-s 900          # CPU, slow

(op4 compares the whole op: this branch's backward predates main's fnarows/gdpa9 merges, so
leave it out of a main vs branch call.)

Trees, not switches: the control is main's tree (``--control``, default ``.devcarry/b/main``
relative to the tree root; ``--tiny`` makes it from ``git archive main`` when absent), the
candidate ("cand") is the tree this script sits in: branch fnapipe2, fnapipe's pipelined
attention warpgroup with (1) its SMEM tiles indexed through an opaque zero (no hoisted WGMMA
descriptors: spills 96-120 B -> 0), (2) the barrier waits before the score accumulator is made
(C7519 5 -> 1; main 4), (3) per-thread partial sums of P stored (1 KB, never read) before the
P·V's wait, so ptxas keeps the activation under the P·V (without it, in fnapipe and in tree
``a``, the SASS has only 0-14 of a step's 32 MUFU.TANH before the P·V's WARPGROUP.DEPBAR; with
it all 32). ``--extra NAME=PATH[:cases]`` adds trees committed under this folder:
  a:  cand without (3) (the branch's first commit, dd0da77): what the fence is worth;
  ov: (1) and (2) plus the next P written before the P·V's wait into a second buffer (the
      head's last P in u_h's tile through a RefUnion view, the next head's first in the P
      tile): the activation and the P store under the P·V, no fence. Interpret outputs
      bit-identical, but interpret mode's race detector flags the union (it compares alias
      groups at whole-union granularity): measured, not mergeable as is.

Each tree runs in its own worker subprocess (PYTHONPATH = that tree); all compile their
programs at once (threads inside each), check every output against the f32 oracle
(pallas_norm.reference on the first samples: per-sample rows and K/V do not depend on the
others) and hash their outputs (== main's bit for bit is reported), then the parent times the
cases interleaved over ``--rounds`` rounds (A,B,.. then ..,B,A), CUPTI per-kernel lists (wall
clock in --tiny), inputs rotated over two sets.

Cases (issue shape: bf16, B=768, H=4 / 2, Lmax=512 density 0.5 (uniform lengths, fixed seed),
D=128, dense K/V Lkv=128, fast_gelu, all switches on):
  fwd4, train4, fwd2, train2: the forward kernel as the op calls it
      (mosaic.flash_norm_attention_fwd, inference form / save_residuals=True), pick_config's
      tiling of each tree (H = 2: two q buffers);
  op4: the op pallas_norm.flash_norm_attention fwd+bwd under jit (implementation="mosaic"),
      gradients of q, k, v checked against jax.grad of the oracle on the first samples.

Output: lines as they come ($OUT/ab.log: the script tees itself), $OUT/ab.json. ``--ptxas``
dumps each worker's Mosaic kernels' ptxas reports into a temp folder and prints registers,
spills and the C7519/C7512 warnings per kernel; the candidate's forward PTX goes to $OUT.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # .devcarry/fnatable_ab/ab.py -> tree root
PREFIX = "@@ "
CASES = ("fwd4", "train4", "fwd2", "train2", "op4")
TOL = 2e-2


# ------------------------------------------------------------------------------------------------
# Worker: one tree, its programs compiled and checked, then timing on request.


def _worker(args):
  import numpy as np
  import jax
  import jax.numpy as jnp

  import pallas_norm as pn
  from pallas_norm import jagged, reference
  from pallas_norm.ops.flash_norm_attention import mosaic

  tree = os.path.abspath(args.tree)
  assert os.path.abspath(pn.__file__).startswith(tree), (pn.__file__, tree)
  tiny = args.tiny
  f32 = jnp.float32
  say = lambda kind, obj: print(PREFIX + kind + " " + json.dumps(obj), flush=True)  # noqa: E731

  if tiny:
    batch, lmax, d, lkv, check_samples = 4, 130, 64, 128, 4
  else:
    batch, lmax, d, lkv, check_samples = 768, 512, 128, 128, 48

  rng = np.random.default_rng(768 * 7919 + 512)
  lens = rng.integers(1, lmax + 1, size=batch)
  if tiny:
    lens = np.array([70, 0, 130, 9])
  total = int(lens.sum())
  capacity = -(-total // 128) * 128
  offsets = np.asarray(jagged.offsets_from_lengths(lens))

  def problem(heads, seed):
    r = np.random.default_rng(seed)
    n = lambda shape, s=1.0, m=0.0: (m + s * r.standard_normal(shape, np.float32))  # noqa: E731
    q = n((capacity, heads, d)).astype(jnp.bfloat16)
    k = n((batch, lkv, heads, d), d ** -0.5).astype(jnp.bfloat16)
    v = n((batch, lkv, heads, d)).astype(jnp.bfloat16)
    f = heads * d
    aff = (n((f,), 0.1, 1.0), n((f,), 0.1), n((f,), 0.1, 1.0))
    return tuple(jax.device_put(x) for x in (q, k, v, offsets, *aff))

  sets = {h: [problem(h, 10 * h + i) for i in range(2)] for h in (4, 2)}
  kernel_kw = dict(activation="fast_gelu", eps=1e-6, interpret=tiny)
  impl = "interpret" if tiny else "mosaic"

  def fwd_fn(save):
    def f(q, k, v, qo, g1, b1, g2):
      heads = q.shape[1]
      affine = jnp.stack([g1, b1, g2]).reshape(3, heads, d)
      return mosaic.flash_norm_attention_fwd(q, k, v, qo, affine, 1.0, 1.0,
                                             save_residuals=save, **kernel_kw)
    return jax.jit(f)

  def op_grad_fn():
    def loss(q, k, v, qo, g1, b1, g2, w):
      out = pn.flash_norm_attention(q, k, v, qo, ln_scale=g1, ln_bias=b1, rms_scale=g2,
                                    max_seq_len=lmax, implementation=impl)
      return jnp.sum(out.astype(f32) * w)
    g = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(lambda q, k, v, qo, g1, b1, g2: g(q, k, v, qo, g1, b1, g2, _weights(q)))

  def _weights(q):  # a fixed cotangent, deterministic in the row and column
    t, h, dd = q.shape
    i = jnp.arange(t * h * dd, dtype=jnp.uint32).reshape(t, h, dd)
    return ((i * jnp.uint32(2654435761)) >> jnp.uint32(20)).astype(f32) / 4096.0 - 0.5

  fns = {"fwd4": (fwd_fn(False), 4), "train4": (fwd_fn(True), 4), "fwd2": (fwd_fn(False), 2),
         "train2": (fwd_fn(True), 2), "op4": (op_grad_fn(), 4)}
  fns = {c: fns[c] for c in args.cases.split(",")}
  t0 = time.time()
  compiled, errors = {}, {}

  def compile_one(case):
    fn, h = fns[case]
    return fn.lower(*sets[h][0]).compile()

  with cf.ThreadPoolExecutor(len(fns)) as pool:
    futs = {c: pool.submit(compile_one, c) for c in fns}
    for c, fu in futs.items():
      try:
        compiled[c] = fu.result()
      except Exception as e:  # noqa: BLE001
        errors[c] = f"{type(e).__name__}: {str(e)[:400]}"
  say("COMPILED", {"seconds": round(time.time() - t0, 1), "errors": errors})

  # The oracle on the first samples (their rows come first in q).
  ns = check_samples
  rows = int(offsets[ns])

  def oracle_fwd(h):
    q, k, v, qo, g1, b1, g2 = sets[h][0]
    return jax.jit(lambda q, k, v: reference.flash_norm_attention(
        q.astype(f32), k.astype(f32), v.astype(f32), jnp.asarray(offsets[:ns + 1]),
        ln_scale=g1, ln_bias=b1, rms_scale=g2, max_seq_len=lmax))(q[:rows], k[:ns], v[:ns])

  def oracle_grads():
    q, k, v, qo, g1, b1, g2 = sets[4][0]

    def loss(q, k, v):
      out = reference.flash_norm_attention(q, k, v, jnp.asarray(offsets[:ns + 1]), ln_scale=g1,
                                           ln_bias=b1, rms_scale=g2, max_seq_len=lmax)
      return jnp.sum(out * _weights(q))  # the same cotangent rows (row-major from row 0)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        q[:rows].astype(f32), k[:ns].astype(f32), v[:ns].astype(f32))

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

  def digest(xs):
    h = hashlib.sha256()
    for x in jax.tree.leaves(xs):
      h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]

  checks = {}
  oracles = {}
  for case, exe in compiled.items():
    _, h = fns[case]
    try:
      res = jax.block_until_ready(exe(*sets[h][0]))
      info = {"digest": digest(res)}
      if case == "op4":
        want = oracles.setdefault("grads", oracle_grads())
        got = (res[0][:rows], res[1][:ns], res[2][:ns])
        info["rel_err"] = [round(rel(g, w), 5) for g, w in zip(got, want)]
        info["finite"] = all(bool(jnp.all(jnp.isfinite(x))) for x in res)
      else:
        want = oracles.setdefault(h, oracle_fwd(h))
        out = res[0]
        info["rel_err"] = [round(rel(out[:rows], want[:rows]), 5)]
        info["finite"] = bool(jnp.all(jnp.isfinite(out)))
        info["padding_zero"] = not bool(jnp.any(out[total:] != 0))
      info["ok"] = (info["finite"] and info.get("padding_zero", True)
                    and max(info["rel_err"]) < TOL)
    except Exception as e:  # noqa: BLE001
      info = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    checks[case] = info
  say("READY", {"checks": checks, "seconds": round(time.time() - t0, 1),
                "tree": tree, "jax": jax.__version__})

  def kernel_times(exe, arg_sets, iters):
    if tiny:
      out = []
      for i in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(exe(*arg_sets[i % len(arg_sets)]))
        out.append(1e6 * (time.perf_counter() - t))
      return out, []
    from jax.experimental.mosaic.gpu import profiler
    calls = {"n": 0}

    class Rotating:  # a jitted-looking callable: measure must not bake one input set in
      def __call__(self, *a, **k):
        s = arg_sets[calls["n"] % len(arg_sets)]
        calls["n"] += 1
        return exe(*s)

      def trace(self, *a, **k):
        raise NotImplementedError

      def lower(self, *a, **k):
        raise NotImplementedError

    _, runs = profiler.measure(Rotating(), aggregate=False, iterations=iters)()
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
      per_call, kernels = kernel_times(compiled[case], sets[fns[case][1]], iters)
      say("TIMES", {"case": case, "us": [round(t, 1) for t in per_call], "kernels": kernels})
    except Exception as e:  # noqa: BLE001
      say("TIMES", {"case": case, "error": f"{type(e).__name__}: {str(e)[:400]}"})


# ------------------------------------------------------------------------------------------------
# Parent: two workers, interleaved timing, summary.


class Worker:
  def __init__(self, tag, tree, args, dump_dir, cases):
    env = dict(os.environ, PYTHONPATH=tree, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / (2 + len(args.extra)):.2f}")
    if dump_dir:
      env.update(MOSAIC_GPU_DUMP_TO=dump_dir, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree,
           "--cases", cases] + (["--tiny"] if args.tiny else [])
    self.tag = tag
    self.races = 0
    self.proc = subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 bufsize=1)

  def read(self, kind):
    for line in self.proc.stdout:
      if line.startswith(PREFIX):
        k, _, body = line[len(PREFIX):].partition(" ")
        if k == kind:
          return json.loads(body)
      elif "RACE DETECTED" in line:  # interpret mode's race detector (ov's union): counted
        self.races += 1
      elif line.strip().startswith(("write of", "read of", "clock:")):
        continue
      elif line.strip() and not _noise(line):
        log(f"  [{self.tag}] {line.rstrip()[:300]}")
    raise RuntimeError(f"worker {self.tag} exited (rc={self.proc.wait()})")

  def send(self, msg):
    self.proc.stdin.write(msg + "\n")
    self.proc.stdin.flush()


def _noise(line):
  return any(s in line for s in ("W0000", "I0000", "absl::InitializeLog", "UserWarning",
                                 "warnings.warn"))


_LOG = None


def log(msg):
  line = f"[{time.strftime('%H:%M:%S')}] {msg}"
  print(line, flush=True)
  if _LOG:
    _LOG.write(line + "\n")
    _LOG.flush()


def _ptxas_summary(tag, dump_dir, out_dir, copy_ptx):
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptxas"))):
    text = open(path, errors="replace").read()
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    warns = sorted(set(re.findall(r"C75\d\d", text)))
    counts = {w: text.count(w) for w in warns}
    log(f"  ptxas [{tag}] {os.path.basename(path)}: registers {regs}, spills (st, ld) "
        f"{spills[:1]}, warnings {counts}")
  if copy_ptx:
    for i, path in enumerate(sorted(glob.glob(os.path.join(dump_dir, "fna_fwd*.ptx")))[:2]):
      shutil.copy(path, os.path.join(out_dir, f"cand_{i}_{os.path.basename(path)}"))


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
  log(f"fnatable A/B: control {control}, candidate {ROOT}, cases {args.cases}, "
      f"budget {args.budget_s} s, tiny={args.tiny}")
  trees = [("main", control, args.cases), ("cand", ROOT, args.cases)]
  for spec in args.extra:  # NAME=PATH[:case,case]
    name, _, rest = spec.partition("=")
    path, _, cases = rest.partition(":")
    trees.append((name, os.path.abspath(os.path.join(ROOT, path)), cases or args.cases))
  tree_cases = {tag: cases.split(",") for tag, _, cases in trees}
  for tag, tree, cases in trees:
    dumps[tag] = tempfile.mkdtemp(prefix=f"fnapipe2_{tag}_") if args.ptxas else None
    workers[tag] = Worker(tag, tree, args, dumps[tag], cases)
  for tag, w in workers.items():
    c = w.read("COMPILED")
    log(f"{tag}: compiled in {c['seconds']} s, errors {c['errors']}")
  ok = {}
  for tag, w in workers.items():
    r = w.read("READY")
    result["checks"][tag] = r["checks"]
    log(f"{tag}: checked ({r['seconds']} s since start, jax {r['jax']}, tree {r['tree']})"
        + (f", {w.races} races reported by the interpret race detector" if w.races else ""))
    for case, info in r["checks"].items():
      log(f"  {tag} {case:7s} {'ok ' if info.get('ok') else 'BAD'} {info}")
      ok[case, tag] = bool(info.get("ok"))
  flush()
  for case in dict.fromkeys(c for c, _ in ok):
    for tag in workers:
      if tag != "main" and case in result["checks"][tag]:
        same = (result["checks"]["main"][case].get("digest")
                == result["checks"][tag][case].get("digest"))
        log(f"{case}: {tag} outputs bit-identical to main's: {same}")
  if args.ptxas:
    for tag in workers:
      _ptxas_summary(tag, dumps[tag], args.out, copy_ptx=tag == "cand")

  cases = args.cases.split(",")
  skipped = [(c, t) for t in workers for c in tree_cases[t] if not ok.get((c, t))]
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
        if not ok.get((case, tag)):
          continue
        workers[tag].send(f"time {case} {args.iters}")
        r = workers[tag].read("TIMES")
        if "error" in r:
          log(f"  {tag} {case}: {r['error']}")
          continue
        per[case, tag] += r["us"]
        rounds[case, tag].append(round(statistics.median(r["us"]), 1))
        kernels[case, tag] = r["kernels"]
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
    for tag in med:
      if tag != "main" and "main" in med:
        log(f"{case}: {tag} / main = {med[tag] / med['main']:.3f} "
            f"({med['main']:.1f} -> {med[tag]:.1f} us)")
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
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fnatable_ab"))
  p.add_argument("--budget-s", type=float, default=220)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--extra", action="append", default=[],
                 help="NAME=PATH[:case,case]: another tree (relative to the root) to time")
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--ptxas", action="store_true")
  p.add_argument("--worker", action="store_true")
  p.add_argument("--tree")
  args = p.parse_args()
  if args.tiny:
    args.iters = min(args.iters, 2)
  if args.worker:
    _worker(args)
  else:
    _parent(args)


if __name__ == "__main__":
  main()
