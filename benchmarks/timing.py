"""Kernel timing: CUPTI on a GPU, wall clock elsewhere (never used for claims).

On a GPU, :func:`jax.experimental.mosaic.gpu.profiler.measure` records the CUPTI time of every
kernel the function launches and, with ``aggregate=True`` (its default), returns the per-call sum
over those kernels: gaps between kernels and host overhead are not counted. It runs one warm-up
call, then ``iterations`` calls, and keeps every call's outputs alive until the end (memory:
``iterations`` × the output size).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax

TIMERS = ("cupti", "wall")


def default_timer() -> str:
  """"cupti" when the default device is a GPU and the Mosaic GPU bindings load, else "wall"."""
  if jax.default_backend() != "gpu":
    return "wall"
  try:
    from jax._src.lib import mosaic_gpu  # noqa: F401  (fails without the CUDA plugin)
  except ImportError:
    return "wall"
  return "cupti"


class Rotating:
  """Calls a jitted ``fn`` on the next input set at every call, ignoring its own arguments.

  ``profiler.measure`` jits any callable that does not look like a jitted function (the
  ``jax.stages.Wrapped`` protocol: ``__call__``, ``trace``, ``lower``), which would bake one input
  set into the program as constants. This object follows that protocol, so ``measure`` calls it
  as is and each timed call reads a different set: inputs smaller than L2 are not served from it.
  """

  def __init__(self, fn, arg_sets: Sequence[tuple]):
    if not arg_sets:
      raise ValueError("arg_sets must hold at least one input set")
    self.fn = fn
    self.arg_sets = list(arg_sets)
    self.calls = 0

  def __call__(self, *args, **kwargs):
    del args, kwargs  # the inputs come from the rotation
    s = self.arg_sets[self.calls % len(self.arg_sets)]
    self.calls += 1
    return self.fn(*s)

  def trace(self, *args, **kwargs):
    del args, kwargs
    return self.fn.trace(*self.arg_sets[0])

  def lower(self, *args, **kwargs):
    del args, kwargs
    return self.fn.lower(*self.arg_sets[0])


class KernelOrderError(RuntimeError):
  """CUPTI cannot attribute a program's kernels to calls: their names or order differ between
  calls (``profiler.measure``'s "not consistent" error). Seen for programs with a ``lax.cond``
  on the H200 (session 6), whose kernels also read 0 µs when each call was measured alone, so
  no per-call kernel sum of such a program is trusted. Callers fall back to the wall clock.
  Not detected: a program whose kernels keep their order but are under-reported."""


def _cupti_us(fn, arg_sets, iterations: int) -> list[float]:
  from jax.experimental.mosaic.gpu import profiler
  try:
    _, runtimes_ms = profiler.measure(Rotating(fn, arg_sets), iterations=iterations)()
  except RuntimeError as e:
    if "not consistent" in str(e):
      raise KernelOrderError(str(e)) from e
    raise
  if runtimes_ms is None:
    raise RuntimeError("CUPTI recorded no kernel: the function launches nothing")
  if iterations == 1:  # measure returns a bare float for one iteration
    runtimes_ms = [runtimes_ms]
  return [1e3 * t for t in runtimes_ms]


def _wall_us(fn, arg_sets, iterations: int, warmup: bool) -> list[float]:
  if warmup:  # one warm-up call, as profiler.measure does
    jax.block_until_ready(fn(*arg_sets[0]))
  times = []
  for i in range(iterations):
    s = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*s))
    times.append(1e6 * (time.perf_counter() - t0))
  return times


def measure_us(fn: Callable, arg_sets: Sequence[tuple], iterations: int, timer: str,
               warmup: bool = True) -> list[float]:
  """Per-call times in µs of ``fn`` (a jitted function), rotating over ``arg_sets``.

  ``warmup=False`` skips the wall timer's warm-up call when ``fn`` already ran (compiled) on
  these shapes; CUPTI's measure always makes one.

  Raises:
    ValueError: unknown timer or iterations < 1.
    RuntimeError: CUPTI saw no kernel.
    KernelOrderError: CUPTI cannot attribute the kernels to calls (time with "wall").
  """
  if timer not in TIMERS:
    raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
  if iterations < 1:
    raise ValueError(f"iterations must be >= 1, got {iterations}")
  if timer == "cupti":
    return _cupti_us(fn, arg_sets, iterations)
  return _wall_us(fn, arg_sets, iterations, warmup)


def batched_wall_us(fn, arg_sets: Sequence[tuple], iterations: int, batches: int = 3) -> list[float]:
  """Per-call wall-clock µs of ``fn`` averaged over ``iterations`` back-to-back calls (one sync
  per batch, so the host round trip of each call does not count), for ``batches`` batches; one
  warm-up call first. For programs CUPTI cannot time (:class:`KernelOrderError`); an upper bound
  of the kernel time (launch gaps count).

  Raises:
    ValueError: iterations or batches < 1.
  """
  if iterations < 1 or batches < 1:
    raise ValueError(f"iterations and batches must be >= 1, got {iterations}, {batches}")
  jax.block_until_ready(fn(*arg_sets[0]))
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for i in range(iterations):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append(1e6 * (time.perf_counter() - t0) / iterations)
  return times


def median(times: Sequence[float]) -> float:
  return float(statistics.median(times))
