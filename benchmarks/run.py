"""Runs the benchmark suite: ``python -m benchmarks.run [--quick] [--only RE] [--interpret]``.

Writes ``benchmarks/results/<gpu-slug>[-suffixes].{json,md,png}`` (and copies them to ``$OUT``
when set) after every case, so a run stopped by a time limit still leaves its results. Method
and column definitions: ``benchmarks/NOTES.md``. ``--only RE`` matches the case names that
``--list`` prints with the same flags (tiny shapes under ``--tiny``/``--interpret``).

Exit status: 0 when the run finished and no output failed its check; 3 when some
implementation's output was wrong (rel. error vs the f32 oracle >= --tolerance, or a non-finite
train step), after every output file is written and a one-line summary naming the wrong cases
is printed on stderr; 2 for a rejected flag; 1 when --only selects no case. A listing cut short
by its reader (``--list | head``) ends quietly.
"""

from __future__ import annotations

import os

# Ten timed outputs of the largest cases stay alive at once (profiler.measure keeps them):
# let the allocator use most of the GPU. Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
# GPU interpret mode runs each warpgroup as its own CPU computation that blocks in barrier
# callbacks until the others progress; XLA's CPU client runs at most PJRT_NPROC computations at
# once (default: the core count): with fewer than 8, kernels deadlock on small machines.
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import benchmarks  # noqa: E402
from benchmarks import cases as C  # noqa: E402
from benchmarks import e2e, report, timing  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
TOLERANCE = 2e-2  # rel. Frobenius error of a bf16 output vs the f32 oracle
ROTATE_BYTES = 256 << 20  # rotate input sets until one pass reads >= ~4x the 60 MB L2
COPY_ELEMENTS, GEMM_SIZE = 1 << 31, 8192  # ceilings: 4 GB bf16 copy, 8192^3 bf16 GEMM


@dataclasses.dataclass
class Context:
  timer: str
  iterations: int
  kernel: str  # "mosaic" or "interpret"
  tiny: bool
  max_sets: int
  deadline: float  # time.monotonic() after which no new case starts
  impls: frozenset[str] | None = None  # implementations to run besides "xla" (None: all)
  tolerance: float = TOLERANCE
  ceilings: dict = dataclasses.field(default_factory=dict)


def log(msg: str) -> None:
  print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Helpers on pytrees of arrays.

def _is_float(a) -> bool:
  return jnp.issubdtype(a.dtype, jnp.floating)


def _upcast(args):
  return tuple(a.astype(jnp.float32) if _is_float(a) else a for a in args)


def nbytes(tree) -> int:
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def free(tree) -> None:
  """Releases device buffers now instead of at the next garbage collection."""
  for a in jax.tree.leaves(tree):
    if isinstance(a, jax.Array) and not a.is_deleted():
      a.delete()


def _err_parts(outs, refs):
  """(‖out − ref‖², ‖ref‖²) per leaf, in f32."""
  if jax.tree.structure(outs) != jax.tree.structure(refs):
    raise ValueError("output and reference have different structures: "
                     f"{jax.tree.structure(outs)} vs {jax.tree.structure(refs)}")
  parts = []
  for o, r in zip(jax.tree.leaves(outs), jax.tree.leaves(refs)):
    o, r = o.astype(jnp.float32), r.astype(jnp.float32)
    parts.append((jnp.sum(jnp.square(o - r)), jnp.sum(jnp.square(r))))
  return parts


def rel_err(parts) -> float:
  """Largest relative Frobenius error over the leaves (absolute where ‖ref‖ = 0)."""
  errs = [math.sqrt(num / den) if den > 0 else math.sqrt(num)
          for num, den in jax.device_get(parts)]
  return max(errs)


# The oracle's speed does not matter: skip XLA's GEMM autotuning when compiling it (seconds per
# GEMM shape on a GPU). The timed programs keep XLA's default options.
ORACLE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}
E2E_NAME = "train_step/kunlun"  # what --list prints for the end-to-end case; --only matches it
EXIT_WRONG = 3  # exit status of a run in which some implementation's output was wrong


class checker:
  """``check(outs, *inputs)`` -> error parts of outs against ``ref_fn(*inputs)``, compiled once
  per output signature (every implementation of a case shares it); the f32 oracle's outputs
  never outlive the check. :meth:`compile_for` compiles it ahead, from shapes alone."""

  def __init__(self, ref_fn):
    self._jitted = jax.jit(lambda outs, *inputs: _err_parts(outs, ref_fn(*inputs)))
    self._compiled = {}

  def compile_for(self, outs, *inputs):
    sig = tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves((outs, inputs)))
    if sig not in self._compiled:
      options = ORACLE_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
      self._compiled[sig] = self._jitted.lower(outs, *inputs).compile(compiler_options=options)
    return self._compiled[sig]

  def __call__(self, outs, *inputs):
    return self.compile_for(outs, *inputs)(outs, *inputs)


def with_mode(fn, diff, mode: str, upcast: bool = False):
  """``fn`` as timed in ``mode``: "fwd" returns fn(*inputs); "fwd+bwd" takes a cotangent as
  the last input and returns (out, *grads wrt inputs[diff]), like a training step does."""
  if mode == "fwd":
    return (lambda *a: fn(*_upcast(a))) if upcast else fn

  def fwd_bwd(*args_ct):
    *args, ct = _upcast(args_ct) if upcast else args_ct

    def of_diff(*d):
      full = list(args)
      for i, x in zip(diff, d):
        full[i] = x
      return fn(*full)

    out, pull = jax.vjp(of_diff, *(args[i] for i in diff))
    return (out, *pull(ct.astype(out.dtype)))

  return fwd_bwd


def _seed(name: str, i: int) -> int:
  return (zlib.crc32(name.encode()) + 1009 * i) % (1 << 31)


# ---------------------------------------------------------------------------------------------
# Ceilings.

def _xor_words(a):
  """Flips one bit of every 32-bit word: one read and one write of every byte, in 4-byte
  elements that XLA vectorizes, and no arithmetic it could fold away (an identity jit would
  alias or become a memcpy, which CUPTI's kernel timer does not see)."""
  words = lax.bitcast_convert_type(a.reshape(-1, 2), jnp.uint32)
  return lax.bitcast_convert_type(words ^ jnp.uint32(1), a.dtype).reshape(a.shape)


# Device-to-device copies the copy ceiling takes the fastest of (bf16 vector in, same out).
COPY_KERNELS = {"xor_u32": _xor_words, "add_bf16": lambda a: a + jnp.asarray(1, a.dtype)}


def measure_ceilings(ctx: Context) -> dict:
  """Copy bandwidth (bytes read + written) and bf16 GEMM rate, timed like every case."""
  n_copy = (1 << 21) if ctx.tiny else COPY_ELEMENTS
  g = 256 if ctx.tiny else GEMM_SIZE
  rand = C.HostRandom(1) if ctx.tiny else jax.jit(
      lambda key, shape: C.DeviceRandom(key)(shape), static_argnums=1)
  x = rand((n_copy,)) if ctx.tiny else rand(jax.random.key(1), (n_copy,))
  copy_times = {name: timing.median(timing.measure_us(jax.jit(fn), [(x,)], ctx.iterations,
                                                      ctx.timer))
                for name, fn in COPY_KERNELS.items()}
  copy_us = min(copy_times.values())
  free(x)
  a, b = ((rand((g, g)), rand((g, g))) if ctx.tiny else
          (rand(jax.random.key(2), (g, g)), rand(jax.random.key(3), (g, g))))
  gemm_us = timing.median(timing.measure_us(jax.jit(jnp.dot), [(a, b)], ctx.iterations,
                                            ctx.timer))
  free((a, b))
  copy_bytes = 2 * n_copy * 2
  return {
      "copy_bytes": copy_bytes, "copy_us": copy_us, "copy_GBps": copy_bytes / (copy_us * 1e3),
      "copy_us_by_kernel": copy_times,
      "gemm_shape": [g, g, g], "gemm_us": gemm_us,
      "gemm_TFLOPs": 2.0 * g ** 3 / (gemm_us * 1e6),
  }


def floor_us(flops: float, bytes_: int, ceilings: dict) -> float:
  """max(FLOPs / GEMM rate, bytes / copy bandwidth), in µs."""
  return max(flops / (ceilings["gemm_TFLOPs"] * 1e6), bytes_ / (ceilings["copy_GBps"] * 1e3))


# ---------------------------------------------------------------------------------------------
# Cases.

def _base_row(case: C.Case, impl: str, **extra) -> dict:
  limit = C.limit_of(case)
  row = {"case": case.name, "key": case.key, "op": case.op, "variant": case.variant,
         "shape": case.shape, "dims": dict(case.dims), "mode": case.mode, "impl": impl,
         "limit_case": limit.name if limit else None, "status": "skipped", "time_us": None,
         "times_us": [], "rel_err": None, "message": ""}
  row.update(extra)
  return row


def _short(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
  return text if len(text) <= 300 else text[:297] + "..."


def _time_rows(rows: dict, fns: dict, sets: list, ctx: Context) -> None:
  for impl, fn in fns.items():
    note = ""
    try:
      try:
        times = timing.measure_us(fn, sets, ctx.iterations, ctx.timer, warmup=False)
      except timing.KernelOrderError:
        times = timing.batched_wall_us(fn, sets, ctx.iterations)
        note = ("wall clock of back-to-back calls (an upper bound: launch gaps count): CUPTI "
                "cannot attribute this program's kernels (a lax.cond)")
    except Exception as e:  # e.g. out of memory: report it, keep going
      rows[impl].update(status="error", message=f"timing: {_short(e)}")
      continue
    rows[impl].update(times_us=times, time_us=timing.median(times))
    if note:
      rows[impl].update(message=note, timer="wall")


def make_inputs(prob: C.Problem, mode: str, rand) -> tuple:
  """One input set, plus a random cotangent of the output in fwd+bwd."""
  inputs = prob.make_set(rand)
  if mode == "fwd+bwd":
    out = jax.eval_shape(prob.impl_fn("xla"), *inputs)
    inputs += (rand(out.shape),)
  return inputs


def input_maker(prob: C.Problem, mode: str, host: bool):
  """(seed -> :func:`make_inputs`, the jitted generator or None): inputs drawn on the device by
  one jitted function (GPU-sized inputs), or by numpy when ``host`` (tiny shapes: nothing to
  compile)."""
  if host:
    return (lambda seed: make_inputs(prob, mode, C.HostRandom(seed))), None
  on_device = jax.jit(lambda key: make_inputs(prob, mode, C.DeviceRandom(key)))
  return (lambda seed: on_device(jax.random.key(seed))), on_device


def abstract_io(prob: C.Problem, mode: str):
  """(inputs, outputs) of the "xla" implementation as shapes and dtypes; allocates nothing."""
  args = jax.eval_shape(lambda: make_inputs(prob, mode, C.DeviceRandom(jax.random.key(0))))
  return args, jax.eval_shape(with_mode(prob.impl_fn("xla"), prob.diff, mode), *args)


def selected_impls(prob: C.Problem, ctx: Context) -> list[str]:
  return [i for i in prob.impls if i == "xla" or ctx.impls is None or i in ctx.impls]


@dataclasses.dataclass
class Prepared:
  """A case's programs, built once: compiled ahead by :func:`precompile` (from shapes alone,
  in threads) or at their first call."""
  case: C.Case
  prob: C.Problem
  make: Callable  # seed -> one input set
  generator: Callable | None  # the jitted input generator (None: drawn on the host)
  fns: dict  # impl -> jitted timed function, or the NotImplementedError that rules it out
  check: checker


def prepare(case: C.Case, ctx: Context) -> Prepared:
  prob = C.build(case, ctx.kernel)
  make, generator = input_maker(prob, case.mode, host=ctx.tiny)
  fns = {}
  for impl in selected_impls(prob, ctx):
    try:
      fns[impl] = jax.jit(with_mode(prob.impl_fn(impl), prob.diff, case.mode))
    except NotImplementedError as e:
      fns[impl] = e
  check = checker(with_mode(prob.ref_fn, prob.diff, case.mode, upcast=True))
  return Prepared(case, prob, make, generator, fns, check)


def _ignore_errors(fn, deadline: float):
  """A compile-ahead task: a program that fails to compile fails again at its first call,
  where the case reports it; past ``deadline`` it is left to that call (or to the budget)."""
  def task() -> bool:  # whether it compiled
    if time.monotonic() > deadline:
      return False
    try:
      fn()
    except Exception:  # noqa: BLE001
      return False
    return True
  return task


def precompile(preps: list[Prepared], workers: int, deadline: float = math.inf,
               timed_workers: int = 1, extra_timed: tuple = ()) -> tuple[float, int, int]:
  """Compiles every program of ``preps`` from shapes, without running any: the timed programs
  (XLA's, which autotune their GEMMs on the GPU, and the kernels; plus ``extra_timed``, jitted
  functions with their arguments) in ``timed_workers`` threads (1: no autotuning measurement
  overlaps another); the oracles and input generators (no GPU work: the oracle is compiled
  without autotuning) in ``workers`` other threads. The programs keep their compiled
  executables, so the timing phase compiles nothing. No task starts after ``deadline``
  (time.monotonic()). Returns (seconds, programs compiled, programs in all)."""
  import concurrent.futures as cf
  t0 = time.monotonic()
  timed_tasks, other_tasks = [], []
  # A concrete key: making it compiles JAX's eager seeding programs, which the input makers
  # run per set (jax.random.key(seed)); else the first timed case compiled them.
  key = jax.random.key(0)
  for p in preps:
    try:
      args, outs = abstract_io(p.prob, p.case.mode)
    except Exception:  # noqa: BLE001  (the case reports it when it runs)
      continue
    for fn in p.fns.values():
      if not isinstance(fn, BaseException):
        timed_tasks.append(_ignore_errors(lambda fn=fn, args=args: fn.lower(*args).compile(),
                                          deadline))
    other_tasks.append(_ignore_errors(lambda p=p, outs=outs, args=args:
                                      p.check.compile_for(outs, *args), deadline))
    if p.generator is not None:
      other_tasks.append(_ignore_errors(lambda g=p.generator: g.lower(key).compile(), deadline))
  for fn, args in extra_timed:
    timed_tasks.insert(0, _ignore_errors(lambda fn=fn, args=args: fn.lower(*args).compile(),
                                         deadline))
  with cf.ThreadPoolExecutor(max(1, timed_workers)) as timed, \
       cf.ThreadPoolExecutor(max(1, workers)) as other:
    futures = [timed.submit(t) for t in timed_tasks] + [other.submit(t) for t in other_tasks]
    cf.wait(futures)
  return time.monotonic() - t0, sum(f.result() for f in futures), len(futures)


def run_case(prep: Prepared, ctx: Context) -> list[dict]:
  """Checks every implementation of a case against the oracle, then times the correct ones."""
  sets = [prep.make(_seed(prep.case.name, 0))]
  try:
    return _check_and_time(prep, sets, ctx)
  finally:
    free(sets)


def _check_and_time(prep: Prepared, sets: list, ctx: Context) -> list[dict]:
  case, prob, make, check = prep.case, prep.prob, prep.make, prep.check
  in_bytes = nbytes(sets[0])
  out_bytes = nbytes(jax.eval_shape(with_mode(prob.impl_fn("xla"), prob.diff, case.mode),
                                    *sets[0]))
  flops = prob.flops_fwd + (prob.flops_bwd if case.mode == "fwd+bwd" else 0)
  common = {"flops": flops, "bytes": in_bytes + out_bytes,
            "floor_us": floor_us(flops, in_bytes + out_bytes, ctx.ceilings)}
  impls = list(prep.fns)
  rows = {impl: _base_row(case, impl, **common) for impl in impls}

  fns = {}
  for impl in impls:
    try:
      fn = prep.fns[impl]
      if isinstance(fn, BaseException):
        raise fn
      out = jax.block_until_ready(fn(*sets[0]))  # compiled ahead, or compiles now
    except NotImplementedError as e:
      rows[impl].update(status="n/a", message=_short(e))
      continue
    except Exception as e:  # a kernel that fails to lower or run: report it, keep going
      rows[impl].update(status="error", message=_short(e))
      log(traceback.format_exc(limit=-3))
      continue
    try:
      err = rel_err(check(out, *sets[0]))
    except Exception as e:
      rows[impl].update(status="error", message=f"oracle check: {_short(e)}")
      continue
    finally:
      free(out)
    if err < ctx.tolerance:  # NaN is not: reported wrong
      rows[impl].update(rel_err=err, status="ok")
      fns[impl] = fn
    elif impl == "xla" and math.isfinite(err):
      # The baseline is the op's math in bf16 as XLA runs it: its own rounding error is what
      # plain JAX code gets, so it is still timed, and flagged.
      rows[impl].update(rel_err=err, status="imprecise",
                        message=f"XLA's own bf16 error {err:.3g} >= {ctx.tolerance}; timed "
                        "as the baseline")
      fns[impl] = fn
    else:
      rows[impl].update(rel_err=err, status="wrong",
                        message=f"rel. error {err:.3g} >= {ctx.tolerance}: not timed")

  n_sets = min(ctx.max_sets, max(1, math.ceil(ROTATE_BYTES / max(in_bytes, 1))))
  sets += [make(_seed(case.name, i)) for i in range(1, n_sets if fns else 1)]
  for r in rows.values():
    r["input_sets"] = len(sets)
  _time_rows(rows, fns, sets, ctx)
  return list(rows.values())


def _all_finite(tree) -> bool:
  leaves = [a for a in jax.tree.leaves(tree) if hasattr(a, "dtype") and _is_float(a)]
  return all(bool(jnp.all(jnp.isfinite(a))) for a in leaves)


# name -> (jitted step, args) built (and compiled) ahead by _prepare_all.
_E2E_STEPS: dict[str, tuple] = {}


def e2e_step(config: dict, implementation):
  step, args = e2e.make_step(config, implementation)
  return (step if isinstance(step, jax.stages.Wrapped) else jax.jit(step)), args


def run_e2e(ctx: Context) -> list[dict]:
  """One train step of the Kunlun-style model, XLA vs the kernels (see benchmarks/e2e.py)."""
  config = e2e.build_config(ctx.tiny)
  case = C.Case("train_step", "kunlun", e2e.dims(config), "train")
  # "auto" is the model's default (implementation=None): Mosaic kernels where they support the
  # call on a Hopper GPU, XLA elsewhere. Interpret mode is too slow for a whole model.
  impls = {"xla": "xla", "auto": None}
  rows = {name: _base_row(case, name, config=config) for name in impls}
  fns, args_of = {}, {}
  for name, impl in impls.items():
    try:
      fn, args = _E2E_STEPS.pop(name, None) or e2e_step(config, impl)
      out = jax.block_until_ready(fn(*args))
    except e2e.Unavailable as e:
      for r in rows.values():
        r.update(status="skipped", message=f"end-to-end case skipped: {e}")
      log(f"  train_step skipped: {e}")
      return list(rows.values())
    except Exception as e:
      rows[name].update(status="error", message=_short(e))
      log(traceback.format_exc(limit=-3))
      continue
    finite = _all_finite(out)
    free([a for a in jax.tree.leaves(out) if not any(a is b for b in jax.tree.leaves(args))])
    rows[name].update(status="ok" if finite else "wrong",
                      message="no oracle: outputs checked finite" if finite else "non-finite")
    if finite:
      fns[name], args_of[name] = fn, args
  for name, fn in fns.items():
    _time_rows({name: rows[name]}, {name: fn}, [args_of[name]], ctx)
  return list(rows.values())


# ---------------------------------------------------------------------------------------------
# Results.

def _git_commit() -> tuple[str, bool | None]:
  """(commit, has uncommitted changes): $GIT_COMMIT when set (a copy without .git), else git."""
  if os.environ.get("GIT_COMMIT"):
    return os.environ["GIT_COMMIT"], None
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, timeout=10).stdout.strip() != ""
    return head, dirty
  except (OSError, subprocess.SubprocessError):
    return "unknown", None


def slugify(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _stem(args, device_kind: str) -> str:
  if args.tag:
    return slugify(args.tag)
  parts = [slugify(device_kind)]
  parts += [flag for flag in ("tiny", "interpret", "quick") if getattr(args, flag)]
  if args.only:  # runs of different --only patterns must not overwrite each other
    parts.append(f"only-{zlib.crc32(args.only.encode()):08x}")
  return "-".join(parts)


def _write(results: dict, stem: str, out_dirs: list[pathlib.Path], plot: bool) -> list[str]:
  report.derive(results["rows"])
  written = []
  out_dirs = list(dict.fromkeys(d.resolve() for d in out_dirs))  # --results-dir may be $OUT
  for d in out_dirs:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (d / f"{stem}.md").write_text(report.markdown(results))
    written += [str(d / f"{stem}.json"), str(d / f"{stem}.md")]
  if plot:
    png = out_dirs[0] / f"{stem}.png"
    if report.plot(results, png):
      written.append(str(png))
      for d in out_dirs[1:]:
        shutil.copy(png, d / png.name)
  return written


def wrong_cases(results: dict) -> dict[str, list[str]]:
  """case -> its implementations whose output failed the check (status "wrong"), in row order;
  cases without one are left out."""
  wrong: dict[str, list[str]] = {}
  for r in results.get("rows", []):
    if r["status"] == "wrong":
      wrong.setdefault(r["case"], []).append(r["impl"])
  return wrong


def exit_status(results: dict, shown: int = 5) -> int:
  """The command's exit status for ``results``: 0, or :data:`EXIT_WRONG` after printing on
  stderr one line that counts the wrong cases and names the first ``shown`` of them."""
  wrong = wrong_cases(results)
  if not wrong:
    return 0
  total = len({r["case"] for r in results["rows"]})
  names = [f"{case} [{', '.join(impls)}]" for case, impls in wrong.items()]
  more = f", and {len(names) - shown} more" if len(names) > shown else ""
  print(f"python -m benchmarks.run: {len(wrong)} of {total} cases wrong (rel. error >= "
        f"{results.get('tolerance')} vs the f32 oracle, or non-finite): "
        f"{', '.join(names[:shown])}{more}; exit status {EXIT_WRONG}", file=sys.stderr,
        flush=True)
  return EXIT_WRONG


def _print_lines(lines: list[str]) -> None:
  """Prints ``lines`` to stdout; a reader that stops early (``--list | head``) ends the
  listing quietly instead of with a BrokenPipeError."""
  try:
    print("\n".join(lines), flush=True)
  except BrokenPipeError:
    # Python flushes stdout again at exit and would report the broken pipe there.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _exit_status_help() -> str:
  """The module docstring's "Exit status" paragraph, for --help."""
  return next(par for par in __doc__.split("\n\n") if par.startswith("Exit status"))


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0],
                              epilog=_exit_status_help())
  p.add_argument("--quick", action="store_true", help="headline cases only (~2 min on an H200)")
  p.add_argument("--only", metavar="RE", help="only cases whose name, as --list prints it "
                 "with the same flags, matches this regex (e.g. 'norm_matmul/rms', "
                 "'262144x512x512/fwd$', or '256x128x128/fwd$' under --tiny); limits they "
                 "need run too")
  p.add_argument("--interpret", action="store_true",
                 help="kernels in Pallas GPU interpret mode on the CPU; implies --tiny")
  p.add_argument("--tiny", action="store_true", help="every case at a CPU-sized shape")
  p.add_argument("--impls", metavar="A,B",
                 help="implementations to run besides 'xla' (default: all; e.g. 'mosaic'; "
                 "'none': XLA alone)")
  p.add_argument("--tolerance", type=float, default=TOLERANCE,
                 help="largest rel. Frobenius error vs the f32 oracle (default 2e-2)")
  p.add_argument("--iterations", type=int, default=10, help="timed calls per implementation")
  p.add_argument("--budget-s", type=float, default=None,
                 help="start no case after this many seconds (default 500, --quick 150; "
                 "none with --tiny/--interpret)")
  p.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
  p.add_argument("--tag", help="file stem of the results (default: the device slug + flags)")
  p.add_argument("--cache-dir", type=pathlib.Path, default=None,
                 help="JAX persistent compilation cache (default on a GPU: build/jax_cache, "
                 "which a warm device machine keeps between runs; 'none' disables it)")
  p.add_argument("--resume", action="store_true",
                 help="keep the cases (and ceilings) that the previous run with the same file "
                 "stem finished, run the rest: a suite cut by --budget-s continues")
  p.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                 help="threads that compile the oracles and input generators ahead, next to "
                 "those of --compile-timed-workers (default min(8, cores); 0: no compile-ahead "
                 "phase, each case compiles when it runs)")
  p.add_argument("--compile-timed-workers", type=int, default=4,
                 help="threads that compile the timed programs ahead (default 4; 1 keeps XLA's "
                 "GEMM autotuning measurements from overlapping each other)")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end train step")
  p.add_argument("--list", action="store_true", help="print the selected case names and exit")
  args = p.parse_args(argv)
  args.tiny = args.tiny or args.interpret
  if args.iterations < 1:
    p.error("--iterations must be >= 1")
  if not args.tolerance > 0:
    p.error(f"--tolerance must be > 0, got {args.tolerance}")
  if args.budget_s is not None and not args.budget_s >= 0:
    p.error(f"--budget-s must be >= 0, got {args.budget_s}")
  if args.compile_workers < 0 or args.compile_timed_workers < 1:
    p.error("--compile-workers must be >= 0 and --compile-timed-workers >= 1")
  if args.only:
    try:
      re.compile(args.only)
    except re.error as e:
      p.error(f"--only: invalid regular expression {args.only!r}: {e}")
  if args.impls is not None:
    known = set(C.known_impls()) | {"none"}  # "none": XLA alone
    names = {"interpret" if args.interpret and i == "mosaic" else i
             for i in args.impls.split(",") if i}
    if unknown := sorted(names - known):
      p.error(f"--impls: unknown implementation(s) {unknown}; known: {sorted(known)} "
              "('mosaic' stands for the kernel, 'interpret' under --interpret)")
    if not names:  # "--impls ," ran every implementation, as if no --impls were given
      p.error(f"--impls: no implementation in {args.impls!r} ('none' runs XLA alone)")
    args.impls = ",".join(sorted(names))
  return args


def main(argv=None) -> dict:
  """Runs (or with --list prints) the selected cases and returns the results ({} for --list);
  the command line then exits with :func:`exit_status` of them."""
  args = parse_args(argv)
  selected = C.select(C.all_cases(), quick=args.quick, only=args.only, tiny_shapes=args.tiny)
  run_e2e_case = not args.no_e2e and (not args.only or re.search(args.only, E2E_NAME))
  if not selected and not run_e2e_case:
    hint = ""
    if args.tiny and C.select(C.all_cases(), quick=args.quick, only=args.only,
                              tiny_shapes=False):
      hint = "; it matches full-size names, but --tiny/--interpret cases have tiny shapes"
    raise SystemExit(f"python -m benchmarks.run: --only {args.only!r} selects no case "
                     f"(--list prints the names){hint}")
  if args.list:
    _print_lines([c.name for c in selected] + ([E2E_NAME] if run_e2e_case else []))
    return {}
  if not args.tiny and jax.default_backend() != "gpu":
    raise SystemExit("python -m benchmarks.run: full-size cases need a GPU (the default JAX "
                     f"backend is {jax.default_backend()!r}); on a CPU run --interpret (tiny "
                     "shapes, the kernels in interpret mode) or --tiny")
  # Before anything runs: an unwritable folder failed in a traceback after the first case.
  folders = {"--results-dir": args.results_dir, "$OUT": os.environ.get("OUT")}
  for what, folder in folders.items():
    if folder and (reason := benchmarks.unwritable_reason(folder)):
      raise SystemExit(f"python -m benchmarks.run: {what}: {reason}")
  return _run(args, selected, run_e2e_case)


def _enable_compilation_cache(args) -> str | None:
  """Repeated runs (--quick, then the full suite) skip XLA's compiles and autotuning."""
  path = args.cache_dir
  if path is None and jax.default_backend() == "gpu" and not args.tiny:
    path = REPO / "build" / "jax_cache"
  if path is None or str(path) == "none":
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  return str(path)


def _resumed(args, stem: str, results: dict) -> dict[str, list[dict]]:
  """Rows and ceilings of the previous run with the same file stem, for the cases it finished
  (a case with a row skipped for the time budget runs again)."""
  path = args.results_dir / f"{stem}.json"
  if not path.is_file():
    log(f"--resume: no {path}, starting afresh")
    return {}
  try:
    prev = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise SystemExit(f"python -m benchmarks.run: --resume: cannot read {path}: {e}") from None
  if problem := report.not_results_reason(prev):
    raise SystemExit(f"python -m benchmarks.run: --resume: {path} is not a results JSON of "
                     f"benchmarks.run ({problem})")
  by_case: dict[str, list[dict]] = {}
  for r in prev["rows"]:
    by_case.setdefault(r["case"], []).append(r)
  done = {name: rows for name, rows in by_case.items()
          if not any("time budget" in r.get("message", "") for r in rows)}
  results["rows"] = [r for rows in done.values() for r in rows]
  # Ceilings from before the copy ceiling took the fastest of COPY_KERNELS are measured again.
  prev_ceilings = prev.get("ceilings") or {}
  results["ceilings"] = prev_ceilings if "copy_us_by_kernel" in prev_ceilings else {}
  results["resumed_from"] = {k: prev.get(k) for k in ("date", "git_commit", "wall_s")}
  log(f"--resume: {len(done)} cases kept from {path}")
  return done


def _prepare_all(selected: list[C.Case], done: dict, ctx: Context, workers: int,
                 timed_workers: int, with_e2e: bool) -> dict[str, Prepared]:
  """Builds the cases still to run (and the limits they need) and, with ``workers`` > 0,
  compiles all their programs ahead in parallel (:func:`precompile`): on a GPU, compiling is
  most of the suite's wall time and the timing loop is sequential."""
  if workers <= 0:
    return {}
  todo: dict[str, C.Case] = {}
  for case in selected:
    for c in (C.limit_of(case), case):
      if c is not None and c.name not in done and c.name not in todo:
        todo[c.name] = c
  prepared = {}
  for name, case in todo.items():
    try:
      prepared[name] = prepare(case, ctx)
    except Exception:  # noqa: BLE001  (run_one builds it again and reports the error)
      pass
  if with_e2e and not ctx.tiny:  # the tiny (CPU) step compiles in seconds when it runs
    config = e2e.build_config(ctx.tiny)
    for name, impl in (("xla", "xla"), ("auto", None)):
      try:
        _E2E_STEPS[name] = e2e_step(config, impl)
      except Exception:  # noqa: BLE001  (run_e2e reports it)
        pass
  # Compiling ahead leaves a quarter of the remaining budget to the timing loop; cases not
  # compiled by then compile when they run (while the budget lasts).
  now = time.monotonic()
  seconds, compiled, total = precompile(list(prepared.values()), workers,
                                        now + 0.75 * (ctx.deadline - now), timed_workers,
                                        tuple(_E2E_STEPS.values()))
  log(f"compiled {compiled} of the {total} programs of {len(prepared)} cases ahead in "
      f"{seconds:.1f}s ({timed_workers} threads for the timed programs, {workers} for the "
      "oracles and inputs; the rest compile when their case runs)")
  return prepared


def _run(args, selected: list[C.Case], run_e2e_case: bool) -> dict:
  t0 = time.monotonic()
  cache = _enable_compilation_cache(args)
  # On a CPU the suite only proves that every path runs: no default budget cuts it there.
  default_budget = math.inf if args.tiny else (150 if args.quick else 500)
  budget = args.budget_s if args.budget_s is not None else default_budget
  dev = jax.devices()[0]
  ctx = Context(timer=timing.default_timer(), iterations=args.iterations,
                kernel="interpret" if args.interpret else "mosaic", tiny=args.tiny,
                max_sets=2 if args.tiny else 8, deadline=t0 + budget,
                impls=frozenset(args.impls.split(",")) if args.impls else None,
                tolerance=args.tolerance)
  commit, dirty = _git_commit()
  results = {
      "schema": 1, "jax_version": jax.__version__, "backend": jax.default_backend(),
      "device": dev.device_kind, "device_count": jax.device_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "git_commit": commit, "git_dirty": dirty, "timer": ctx.timer,
      "iterations": ctx.iterations, "tolerance": ctx.tolerance, "compilation_cache": cache,
      "flags": {"quick": args.quick, "only": args.only, "interpret": args.interpret,
                "tiny": args.tiny, "impls": args.impls,
                "compile_workers": args.compile_workers,
                "compile_timed_workers": args.compile_timed_workers,
                "budget_s": None if math.isinf(budget) else budget},
      "ceilings": {}, "rows": [], "wall_s": None,
  }
  stem = _stem(args, dev.device_kind)
  out_dirs = [args.results_dir] + ([pathlib.Path(os.environ["OUT"])]
                                   if os.environ.get("OUT") else [])
  log(f"{dev.device_kind} jax {jax.__version__} timer={ctx.timer} cases={len(selected)} "
      f"budget={budget:.0f}s -> {args.results_dir / stem}.*")
  done = _resumed(args, stem, results) if args.resume else {}
  if not results["ceilings"]:
    results["ceilings"] = measure_ceilings(ctx)
  ctx.ceilings = results["ceilings"]
  log(f"ceilings: copy {ctx.ceilings['copy_GBps']:.0f} GB/s, "
      f"GEMM {ctx.ceilings['gemm_TFLOPs']:.1f} TFLOP/s ({time.monotonic() - t0:.1f}s)")

  prepared = _prepare_all(selected, done, ctx, args.compile_workers,
                          args.compile_timed_workers,
                          run_e2e_case and not any(r["op"] == "train_step"
                                                   for r in results["rows"]))

  def run_one(case: C.Case) -> None:
    limit = C.limit_of(case)
    if limit is not None and limit.name not in done:
      run_one(limit)
    if case.name in done:
      return
    if time.monotonic() > ctx.deadline:
      rows = [_base_row(case, i, message=f"skipped: time budget of {budget:.0f}s spent")
              for i in selected_impls(C.build(case, ctx.kernel), ctx)]
    else:
      t = time.monotonic()
      try:
        rows = run_case(prepared.pop(case.name, None) or prepare(case, ctx), ctx)
      except Exception as e:  # inputs or shapes failed (e.g. out of memory): keep going
        log(traceback.format_exc(limit=-3))
        rows = [_base_row(case, i, status="error", message=f"case: {_short(e)}")
                for i in selected_impls(C.build(case, ctx.kernel), ctx)]
      for r in rows:
        r["case_wall_s"] = round(time.monotonic() - t, 2)
      log(f"[{time.monotonic() - t0:6.1f}s] {case.name}: " + ", ".join(
          f"{r['impl']} " + (f"{r['time_us']:.1f}us" if r["time_us"] is not None
                             else r["status"]) for r in rows))
    done[case.name] = rows
    results["rows"] += rows
    results["wall_s"] = round(time.monotonic() - t0, 1)
    _write(results, stem, out_dirs, plot=False)

  def run_train_step() -> None:
    if any(r["op"] == "train_step" for r in results["rows"]):  # resumed: measured already
      return
    if time.monotonic() <= ctx.deadline:
      rows = run_e2e(ctx)
    else:
      case = C.Case("train_step", "kunlun", e2e.dims(e2e.build_config(ctx.tiny)), "train")
      rows = [_base_row(case, i, message=f"skipped: time budget of {budget:.0f}s spent")
              for i in ("xla", "auto")]
    results["rows"] += rows
    log(f"[{time.monotonic() - t0:6.1f}s] train_step: " + ", ".join(
        f"{r['impl']} " + (f"{r['time_us']:.1f}us" if r["time_us"] is not None else r["status"])
        for r in rows))
    _write(results, stem, out_dirs, plot=False)

  for case in selected:
    if run_e2e_case and not case.quick:  # the train step belongs to the headline (quick) set
      run_train_step()
      run_e2e_case = False
    run_one(case)
  if run_e2e_case:
    run_train_step()
  results["wall_s"] = round(time.monotonic() - t0, 1)
  written = _write(results, stem, out_dirs, plot=not args.no_plot)
  log(f"done in {results['wall_s']}s: " + " ".join(written))
  return results


if __name__ == "__main__":
  sys.exit(exit_status(main(sys.argv[1:])))
