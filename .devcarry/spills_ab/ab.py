"""spills A/B: the FNA cluster forward kernel (H·D = 1024) and the post-norm forward at
262144x512x2048 (3 ring stages), main vs this branch.

    PYTHONPATH=$PWD python3 .devcarry/spills_ab/ab.py --out $OUT [--control .devcarry/b/main]
        [--budget-s 200] [--rounds 3] [--cases fna8,fna8t,mn2048] [--ptxas]
    PYTHONPATH=$PWD PJRT_NPROC=8 python3 .devcarry/spills_ab/ab.py --tiny --out /tmp/x   # CPU

The branch: the kernel's cluster exchange names its peers through opaque_zero (exchange.Spec.
peer_addresses_in_loop: the 32 peer addresses are no longer hoisted to the kernel's start and
spilled) and u_h's recomputation after the attention no longer reuses the f32 u_h of before it
(kept live across the attention). ptxas (on the CPU, ptxas_all.py), H=8: 292/356 -> 56/56 B
(inference form), 288/368 -> 96/116 B (training form). And the GEMM producer's ring step made
opaque when the stage count is not a power of two (pallas_norm/mgpu/gemm.py: no 64-bit
induction variables per unrolled K step in the producer's 40 registers): the post-norm forward
layer+res 262144x512x2048 76/140 -> 0/0 B (training form 76/144 -> 40/104).

Trees, not switches: the control is main's tree (``--control``, default ``.devcarry/b/main``
relative to the tree root; ``--tiny`` makes it from ``git archive main`` when absent), the
candidate is the tree this script sits in. Each tree runs in its own worker subprocess
(PYTHONPATH = that tree); both compile their programs at once (threads inside each), check
every output against the f32 oracle (pallas_norm.reference: the FNA block on the first 48
samples, out and the statistics, padding rows must be 0; the post-norm GEMM on the first 4096
rows; samples and rows are independent) and hash
their outputs (main's and the branch's should match bit for bit), then the parent times the
cases interleaved over ``--rounds`` rounds (A,B then B,A), CUPTI per-kernel lists (wall clock
in --tiny), inputs rotated over two sets.

Cases (bf16; the kernel pallas_norm.ops.flash_norm_attention.cluster.flash_norm_attention_fwd,
what the op runs at H = 8, D = 128; fast_gelu, pre/post scale 1, eps 1e-6):
  fna8:   inference form: B=768, H=8, Lmax=512 (lengths uniform on [1, 512], the suite's
          draw), D=128, dense K/V Lkv=128.
  fna8t:  the training form (save_residuals: z and u written too), same shapes.
  mn2048: pallas_norm.matmul_norm layer+res (LayerNorm with residual) forward, 262144x512x2048
          (its tiling: 3 ring stages, a cluster of 8 CTAs per row block); oracle on 4096 rows.
--tiny: H=1 (interpret mode runs the cluster kernel only as a cluster of one), B=4, Lmax=130;
matmul_norm at 256x128x256.

Output: lines as they come ($OUT/ab.log), $OUT/ab.json. ``--ptxas`` dumps each worker's Mosaic
kernels' ptxas reports into a temp folder and prints registers, spills and the C7519/C7512
warnings per kernel; the candidate's PTX goes to $OUT.
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
ROOT = os.path.dirname(os.path.dirname(HERE))  # .devcarry/spills_ab/ab.py -> tree root
PREFIX = "@@ "
CASES = ("fna8", "fna8t", "mn2048")
TOL = 2e-2


# ------------------------------------------------------------------------------------------------
# Worker: one tree, its programs compiled and checked, then timing on request.


def _worker(args):
  import numpy as np
  import jax
  import jax.numpy as jnp

  import pallas_norm as pn
  from pallas_norm import jagged, reference
  from pallas_norm.ops.flash_norm_attention import cluster

  tree = os.path.abspath(args.tree)
  assert os.path.abspath(pn.__file__).startswith(tree), (pn.__file__, tree)
  tiny = args.tiny
  f32, bf = jnp.float32, jnp.bfloat16
  say = lambda kind, obj: print(PREFIX + kind + " " + json.dumps(obj), flush=True)  # noqa: E731

  def normal(r, shape, scale=1.0, offset=0.0):
    return jnp.asarray((scale * r.standard_normal(shape, np.float32) + offset).astype(bf))

  # --- FNA cluster forward ---------------------------------------------------------------------
  if tiny:
    batch, heads, lmax, d, lkv, fna_samples = 4, 1, 130, 128, 128, 4
    fna_lens = np.array([70, 0, 130, 9])
  else:
    batch, heads, lmax, d, lkv, fna_samples = 768, 8, 512, 128, 128, 48
    fna_lens = np.random.default_rng(batch * 7919 + lmax).integers(1, lmax + 1, size=batch)
  fna_total = int(fna_lens.sum())
  fna_cap = -(-max(fna_total, 1) // 128) * 128
  fna_offsets = jnp.asarray(np.asarray(jagged.offsets_from_lengths(fna_lens)))

  def fna_set(seed):
    r = np.random.default_rng(seed)
    q = normal(r, (fna_cap, heads, d), 1.0, 0.3)
    k = normal(r, (batch, lkv, heads, d), d ** -0.5)
    v = normal(r, (batch, lkv, heads, d))
    affine = jnp.stack([normal(r, (heads, d), 0.1, 1.0), normal(r, (heads, d), 0.1),
                        normal(r, (heads, d), 0.1, 1.0)]).astype(f32)
    return tuple(jax.device_put(x) for x in (q, k, v, fna_offsets, affine))

  def fna_fn(save):
    def f(q, k, v, qo, affine):
      return cluster.flash_norm_attention_fwd(
          q, k, v, qo, affine, jnp.float32(1.0), jnp.float32(1.0), activation="fast_gelu",
          eps=1e-6, save_residuals=save, interpret=tiny)
    return jax.jit(f)

  def fna_check(out, args_):
    q, k, v, qo, affine = args_
    ns = fna_samples
    rows = int(qo[ns])
    ref, (ln, rms) = jax.jit(lambda q, k, v, a: reference.flash_norm_attention(
        q.astype(f32), k.astype(f32), v.astype(f32), jnp.asarray(qo[:ns + 1]),
        ln_scale=a[0].reshape(-1), ln_bias=a[1].reshape(-1), rms_scale=a[2].reshape(-1),
        max_seq_len=lmax, return_stats=True))(q[:rows], k[:ns], v[:ns], affine)
    o, stats = out[0], out[1]
    errs = [rel(o[:rows], ref), rel(stats[:rows, 0], ln.mean), rel(stats[:rows, 1], ln.rstd),
            rel(stats[:rows, 2], rms.rstd)]
    pad_zero = not bool(jnp.any(o[fna_total:] != 0))
    return errs, pad_zero, bool(jnp.all(jnp.isfinite(o)))

  # --- post-norm forward (matmul_norm layer+res) -----------------------------------------------
  mm, mk, mn_ = (256, 128, 256) if tiny else (262144, 512, 2048)
  mn_rows = mm if tiny else 4096

  def mn_set(seed):
    r = np.random.default_rng(seed)
    return tuple(jax.device_put(x) for x in (
        normal(r, (mm, mk)), normal(r, (mk, mn_), mk ** -0.5), normal(r, (mm, mn_)),
        normal(r, (mn_,), 0.1, 1.0), normal(r, (mn_,), 0.1)))

  def mn_fn(x, w, res, scale, bias):
    return pn.matmul_norm(x, w, residual=res, scale=scale, norm_bias=bias, norm="layer",
                          implementation="interpret" if tiny else "mosaic")

  def mn_check(out, args_):
    x, w, res, scale, bias = args_
    n = mn_rows
    ref = jax.jit(lambda x, w, res, s, b: reference.matmul_norm(
        x.astype(f32), w.astype(f32), None, res.astype(f32), s.astype(f32), b.astype(f32),
        norm="layer"))(x[:n], w, res[:n], scale, bias)
    return [rel(out[:n], ref)], True, bool(jnp.all(jnp.isfinite(out)))

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

  specs = {"fna8": (fna_fn(False), fna_set, fna_check),
           "fna8t": (fna_fn(True), fna_set, fna_check),
           "mn2048": (jax.jit(mn_fn), mn_set, mn_check)}
  cases = args.cases.split(",")
  sets = {c: [specs[c][1](10 * i + 1) for i in range(2)] for c in cases}
  fns = {c: specs[c][0] for c in cases}
  t0 = time.time()
  compiled, errors = {}, {}

  def compile_one(case):
    return fns[case].lower(*sets[case][0]).compile()

  with cf.ThreadPoolExecutor(len(fns)) as pool:
    futs = {c: pool.submit(compile_one, c) for c in fns}
    for c, fu in futs.items():
      try:
        compiled[c] = fu.result()
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
    try:
      out = jax.block_until_ready(exe(*sets[case][0]))
      errs, pad_zero, finite = specs[case][2](out, sets[case][0])
      info = {"digest": digest(out), "rel_err": [round(e, 5) for e in errs], "finite": finite,
              "padding_zero": pad_zero}
      info["ok"] = finite and pad_zero and max(errs) < TOL
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
      per_call, kernels = kernel_times(compiled[case], sets[case], iters)
      say("TIMES", {"case": case, "us": [round(t, 1) for t in per_call], "kernels": kernels})
    except Exception as e:  # noqa: BLE001
      say("TIMES", {"case": case, "error": f"{type(e).__name__}: {str(e)[:400]}"})


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
    for i, path in enumerate(sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))[:3]):
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
  log(f"spills A/B: control {control}, candidate {ROOT}, cases {args.cases}, "
      f"budget {args.budget_s} s, tiny={args.tiny}")
  for tag, tree in (("main", control), ("cand", ROOT)):
    dumps[tag] = tempfile.mkdtemp(prefix=f"spills_{tag}_") if args.ptxas else None
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
      log(f"  {tag} {case:8s} {'ok ' if info.get('ok') else 'BAD'} {info}")
      ok.setdefault(case, []).append(bool(info.get("ok")))
  flush()
  for case in ok:
    same = result["checks"]["main"][case].get("digest") == result["checks"]["cand"][case].get(
        "digest")
    log(f"{case}: candidate outputs bit-identical to main's: {same}")
  if args.ptxas:
    for tag in workers:
      _ptxas_summary(tag, dumps[tag], args.out, copy_ptx=tag == "cand")

  cases = [c for c in args.cases.split(",") if all(ok.get(c, [False]))]
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
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/spills_ab"))
  p.add_argument("--budget-s", type=float, default=200)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--cases", default=",".join(CASES))
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
