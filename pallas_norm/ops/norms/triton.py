"""``layer_norm`` and ``rms_norm`` for training: one-pass Pallas backward kernel after XLA's
forward or after the forward kernel of :mod:`pallas_norm.ops.norms.triton_fwd`.

Two forwards (:func:`pallas_norm.ops.norms.api.forward_path`, by
:data:`pallas_norm.ops.norms.routing.KERNEL_DOMAINS`): XLA's (one fused pass near copy
bandwidth) returns nothing but the outputs, since handing the per-row statistics to the
backward split it into three passes (measured: benchmarks/NOTES.md, "Standalone norms"), and
the backward recomputes them; the forward kernel returns them (float32, a few bytes a row) and
the backward reads them (``given_stats``: x̂ costs no row reduction). Rows wider than
:data:`MAX_N` take the forward kernel and a backward that walks them in chunks
(:func:`_chunked_backward_kernel`). The backward is one Pallas kernel with the Triton
lowering (any NVIDIA GPU that Pallas' Triton backend supports, not only Hopper;
``interpret=True`` runs it on the CPU). Program p of P loops over the row blocks p, p + P,
... (``block_m`` full rows each: the programs running at once read adjacent rows); per block
it loads ``x`` (and ``residual``), ``dy`` (and the cotangent of the residual stream ``s``),
recomputes the row statistics and ``x̂`` from the rows it holds in registers, forms the two row
sums and writes ``ds`` once. ``dγ``/``dβ`` partials stay in registers over the program's rows
and are written once per program to a ``(programs, N)`` float32 buffer that XLA sums
afterwards (deterministic). The chunked kernel of wider rows (a slab of rows per program) keeps
them in registers too (RMSNorm) or leaves them to a second kernel over column blocks × row
splits (:func:`_column_sums_call`; the row kernel then runs a program per row block: LayerNorm).

The math (DESIGN.md, op 5), with ``g = dy · γ`` (``γ`` the applied scale, ``1 + scale`` when
zero-centered) and ``r`` the rstd::

    ds = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))          (RMSNorm: no mean(g))
    ds += cotangent of s (with a residual);  dx = d residual = ds
    dscale = Σ_rows dy ⊙ x̂,  dbias = Σ_rows dy

The statistics are recomputed from the row shifted by its first element, as
:func:`pallas_norm.reference.layer_norm` shifts it: the mean of the shifted values (``dmean``)
and, for bfloat16, beside it their mean square (the variance as their difference, one
dependent row reduction fewer than the reference's two passes: up to n·2⁻²⁴ relative error in
the variance, below bfloat16's rounding, :func:`_normalized_block`; float16 and float32 centre
the shifted row first and sum its squares, the reference's two passes),
``x̂ = ((s − shift) − dmean) · r``: rows whose mean is large next to their spread keep their
precision in the gradients too (a mean rounded to one float32 would cost up to ulp(mean)/std).
RMSNorm's are the mean square, ``x̂ = s · r``. An earlier RMSNorm form that
read rstd saved by the forward (splitting XLA's forward) was 0.73× of XLA's autodiff and was
removed (benchmarks/EXPERIMENTS.md); this one recomputes rstd like LayerNorm's (after XLA's
forward). After the forward kernel the statistics come from it (``shift``, ``dmean``,
``rstd``; the reference's two-pass values for float16/float32, the shifted moments for
bfloat16, :func:`pallas_norm.ops.norms.triton_fwd.full_row_stats`): the forward is one kernel
there, not XLA's split fusion, and that path trains fastest where the kernels beat XLA
(LayerNorm at N = 128-32768, RMSNorm at N = 128-2048: ``routing.KERNEL_DOMAINS``).

The same kernel also runs given x̂ and rstd instead of x (:func:`norm_backward`, for either
norm): the post-norm GEMM's backward (:mod:`pallas_norm.ops.matmul_norm`), whose forward saved
them, with Σ dh as a third column sum.

This module holds the kernels, their tilings and their launch functions (:func:`row_backward`,
:func:`norm_backward`); the kernel path's ``custom_vjp`` (``row_norm``), which calls the launch
through ``_op.first_order_only``, and the dispatch questions are in
:mod:`pallas_norm.ops.norms.api`. Forward-mode autodiff (``jax.jvp``) is not defined for that
path; the "xla" path (:mod:`pallas_norm.ops.norms.xla`) has it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from pallas_norm.ops.norms import triton_fwd, xla
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
"""Dtypes of x (and residual) the kernel takes; float64 stays on XLA."""

MAX_N = 8192
"""Widest row the kernel holds in registers (one block of ``block_m`` full rows)."""

MAX_ELEMENTS = 2**31 - 1
"""The kernel indexes x with int32 element offsets."""

_RMS_TILINGS = ((512, 4096, 12, False), (2048, 2048, 12, True), (8192, 4096, 12, False))
TILINGS = {"layer": ((8192, 2048, 8, False),), "rms": _RMS_TILINGS,
           "layer_given": ((128, 4096, 12, False), (8192, 2048, 8, False)),
           "rms_given": _RMS_TILINGS}
"""Rows of (widest padded N, elements per loop step, programs per SM, prefetch) of
:func:`pick_config`, the first whose N holds the call, per norm, with the statistics
recomputed, given by the forward kernel (``_given``) or saved (:func:`norm_backward`, the
recomputing kinds' tilings). LayerNorm takes half the elements per step of RMSNorm (more live
values per element: the shift, the centered rows) except given the statistics at N = 128, where
32-row steps over 12 programs per SM won; RMSNorm's lighter body keeps 12 programs per SM busy.
RMSNorm at N = 1024-2048 (given the statistics or saved) loads the next step's tiles ahead
(with the row blocks in strided order that beat every other tiling swept at N = 2048, and the
saved-statistics kind was slower at 2048 without it; LayerNorm's prefetch was slower).
Measured: ``benchmarks/NOTES.md`` ("Tilings and RMSNorm through the kernel", "Standalone
norms", the post-norm backward) and ``benchmarks/EXPERIMENTS.md``."""

INTERPRET_PROGRAMS = 3
"""Programs in interpret mode: several, so the strided row loop (and the chunked kernel's
slabs) and the partial sums are exercised (and rows that do not fill the last block)."""


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiling of the backward kernel.

  Attributes:
    block_m: rows per loop step (a power of 2); one step holds ``block_m × n_pad`` elements of
      each operand in registers.
    programs: grid size (at most the row blocks); program p takes row blocks p, p + programs,
      ... and writes one row of the dγ/dβ partial buffers.
    num_warps: warps per program (Triton).
    num_stages: Triton's software-pipelining depth of the row loop (None: Triton's default).
    prefetch: each step loads the next step's tiles before its own math (carried in
      registers: more loads in flight, more live registers).
  """

  block_m: int
  programs: int
  num_warps: int
  num_stages: int | None = None
  prefetch: bool = False


def _gpu_core_count() -> int:
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def pick_config(m: int, n: int, interpret: bool, norm: str) -> BackwardConfig:
  """Full rows (padded to a power of 2) over 4 warps, the step's elements, the programs per SM
  and prefetch from :data:`TILINGS` by ``norm`` ("layer" or "rms", whether the kernel
  recomputes the statistics or is given them: ``_given``) and N; no more programs than row
  blocks. Rows wider than 4096 (one row per step) keep the earlier tiling, the one measured
  there: 16 warps, 4 programs per SM (faster than XLA at 65536×8192; ``benchmarks/NOTES.md``,
  "Tilings and RMSNorm through the kernel"). Several programs per SM keep loads in flight (the
  kernel is bandwidth-bound); the winners were measured, not derived
  (``benchmarks/EXPERIMENTS.md``).
  """
  n_pad = pl.next_power_of_2(n)
  elements, per_sm, prefetch = next(
      (e, p, pf) for max_n, e, p, pf in TILINGS[norm] if n_pad <= max_n)
  block_m = max(1, min(64, elements // n_pad))
  wide = n_pad > 4096
  blocks = pl.cdiv(m, block_m)
  programs = INTERPRET_PROGRAMS if interpret else (4 if wide else per_sm) * _gpu_core_count()
  return BackwardConfig(block_m=block_m, programs=max(1, min(programs, blocks)),
                        num_warps=16 if wide else 4, prefetch=prefetch)


CHUNKED_TILING = {"rms": (4096, 1, 1, 16, "registers"),
                  "layer": (4096, 1, None, 8, "apart", True, True)}
"""(columns per chunk, rows per step, programs per SM, warps, column sums[, L2 hints, float32
γ: ``triton_fwd.RowTiling.l2_hints``, ``f32_vectors``]), per norm, of the backward of rows of at
least
``triton_fwd.CHUNKED_MIN_N`` (:func:`pick_chunked_config`, :func:`_chunked_backward_kernel`).
Each program's rows of the step are read twice (the second time from L2). RMSNorm keeps its one
column partial in registers (N / threads registers each) over a slab, one program per SM (the
rows × N × 4 bytes of all programs should stay in L2); LayerNorm's two are summed "apart" by
:func:`_column_sums_call`, the row kernel a program per row block (programs per SM None) with
L2 hints (the first pass keeps its lines, the second drops them). The fastest measured on the
H200 (``benchmarks/NOTES.md``, "Standalone norms"; ``benchmarks/EXPERIMENTS.md``): LayerNorm's
trains faster than XLA at 16384×32768 (``routing.KERNEL_DOMAINS``), RMSNorm's slower. The row
norms' backward (:func:`row_backward`) reads γ in its own dtype (on an H100: RMSNorm's chunked one
5.7% faster at 16384×32768 than with float32, the full rows of 8192 1.5-2.4%) except LayerNorm's
chunked one, 4% slower with it; the post-norm GEMM's (:func:`norm_backward`) keeps float32."""

COLUMN_SUM_TILING = (256, 16, 8)
"""(columns per program, rows per step, programs per SM) of :func:`_column_sums_call`: each
program sums a column block over a split of the rows (its registers hold rows × columns
partials), the splits' rows summed by XLA. Not yet measured against others."""


def pick_chunked_config(m: int, n: int, interpret: bool, norm: str) -> triton_fwd.RowTiling:
  """:data:`CHUNKED_TILING` [norm], the chunk at most the padded row."""
  chunk, block_m, per_sm, warps, sums, *flags = CHUNKED_TILING[norm]
  hints, f32_vectors = triton_fwd.tiling_flags(flags)
  if sums not in ("registers", "apart") or (per_sm is None) != (sums == "apart"):
    raise ValueError(f"chunked tiling {CHUNKED_TILING[norm]}: column sums 'registers' with "
                     "programs per SM, or 'apart' with None")
  if per_sm is None:  # a program per row block
    programs = pl.cdiv(m, block_m)
  else:
    programs = INTERPRET_PROGRAMS if interpret else per_sm * _gpu_core_count()
  return triton_fwd.RowTiling(block_m=block_m, chunk=min(chunk, pl.next_power_of_2(n)),
                              programs=max(1, min(programs, pl.cdiv(m, block_m))),
                              num_warps=warps, column_sums=sums, l2_hints=hints,
                              f32_vectors=f32_vectors)


def unsupported_reason(norm: str, x_shape, x_dtype, has_residual: bool = False) -> str | None:
  """Why the kernels cannot run a call with these operands, or None.

  Args:
    norm: "layer" or "rms".
    x_shape: shape of x, (..., N).
    x_dtype: dtype of x (a residual has it too: the ops' validation).
    has_residual: whether a residual is added (rows wider than :data:`MAX_N` run through the
      forward kernel, which takes none).
  """
  if norm not in ("layer", "rms"):
    return f"norm {norm!r} (the kernel computes LayerNorm's and RMSNorm's backward)"
  n = x_shape[-1]
  if jnp.dtype(x_dtype) not in KERNEL_DTYPES:
    return f"the kernel takes bfloat16/float16/float32 x, got {jnp.dtype(x_dtype)}"
  if math.prod(x_shape[:-1]) == 0:  # a grid of 0 row blocks: interpret mode divides by it
    return "x has no rows (XLA returns the empty gradient)"
  if n > MAX_N and has_residual:
    return (f"N = {n} with a residual: rows wider than {MAX_N} run through the forward kernel "
            "(in chunks), which adds no residual")
  if math.prod(x_shape) > MAX_ELEMENTS:
    return f"x has {math.prod(x_shape)} elements, past the kernel's int32 offsets"
  return None


# ----------------------------------------------------------------------------------------------
# The backward kernel.


@dataclasses.dataclass(frozen=True)
class _Operands:
  """Which optional operands a kernel instance has (static). With ``gamma`` (a scale) the
  kernel also returns dscale partials, with ``dbias`` dbias partials, with ``ddense`` partials
  of Σ ds. ``saved_stats``: the first input is x̂ itself and the rows' rstd is an input (the
  post-norm GEMM's backward, whose forward saved them), instead of x whose statistics the
  kernel recomputes. ``given_stats``: the first input is x and the rows' statistics are
  inputs (``rstd``, and LayerNorm's ``shift`` and ``dmean``: the forward kernel's,
  :mod:`pallas_norm.ops.norms.triton_fwd`), so x̂ costs no row reduction. ``norm``: "layer" or
  "rms".
  ``two_pass``: LayerNorm's variance by the centered rows' second pass (see
  :func:`_normalized_block`)."""

  residual: bool
  ds_out: bool
  gamma: bool
  dbias: bool
  saved_stats: bool = False
  norm: str = "layer"
  ddense: bool = False
  two_pass: bool = False
  given_stats: bool = False

  def input_names(self):
    names = ["x"] + ["residual"] * self.residual
    names += ["rstd"] * (self.saved_stats or self.given_stats)
    names += ["shift", "dmean"] * (self.given_stats and self.norm == "layer") + ["dy"]
    names += ["ds_out"] * self.ds_out + ["gamma"] * self.gamma
    return names

  def partial_names(self):
    return (["dscale_part"] * self.gamma + ["dbias_part"] * self.dbias
            + ["ddense_part"] * self.ddense)

  def output_names(self):
    return ["ds"] + self.partial_names()


def _normalized_block(s, cols, n: int, eps: float, norm: str, two_pass: bool = False):
  """(x̂, rstd (block_m, 1)) of a block of full rows (masked entries 0). LayerNorm: the row
  shifted by its first element (as :func:`pallas_norm.ops.norms.xla.row_stats` shifts it), then
  the shifted moments Σd and Σd² side by side, var = Σd²/n − dmean²: one dependent row
  reduction fewer than the forward's two-pass variance (faster; ``benchmarks/NOTES.md``,
  "Tilings and RMSNorm through the kernel"). The difference cancels ~dmean²/var ulps, and
  the shift (the row's first element) can lie up to sqrt(n - 1) spreads from the mean (an
  outlier first element): up to n·2^-24 relative error in var (2.3e-4 in the gradients at
  n = 2048), below bfloat16's rounding of ds but not float16's or float32's, so
  those (``two_pass``) centre the rows before the second sum, as the forward does. RMSNorm: the
  mean square. The rows are in registers: the statistics cost row sums,
  no memory traffic."""
  if norm == "rms":  # masked entries are 0: they add nothing to the mean square
    rstd = lax.rsqrt(jnp.sum(s * s, axis=1, keepdims=True) / n + eps)
    return s * rstd, rstd
  shift = jnp.sum(jnp.where(cols[None, :] == 0, s, 0.0), axis=1, keepdims=True)
  inside = cols[None, :] < n  # padded columns stay 0 through the centering
  d = jnp.where(inside, s - shift, 0.0)
  dmean = jnp.sum(d, axis=1, keepdims=True) / n
  centered = jnp.where(inside, d - dmean, 0.0)
  if two_pass:
    var = jnp.sum(centered * centered, axis=1, keepdims=True) / n
  else:
    var = xla.shifted_variance(jnp.sum(d * d, axis=1, keepdims=True) / n, dmean)
  rstd = lax.rsqrt(var + eps)
  return centered * rstd, rstd


def _row_block_grads(load_tile, load_row, cols, gamma, ops: _Operands, n: int, eps: float):
  """One block of rows: (ds, x̂, dy) in float32, from the loaded tiles (masked entries 0)."""
  if ops.saved_stats:
    xhat, rstd = load_tile("x"), load_row("rstd")[:, None]
  elif ops.given_stats:
    stats = tuple(load_row(q) if q in ops.input_names() else None
                  for q in ("shift", "dmean", "rstd"))
    xhat, rstd = triton_fwd.normalized_with(load_tile("x"), cols, n, stats), stats[2][:, None]
  else:
    s = load_tile("x")
    if ops.residual:
      s = s + load_tile("residual")
    xhat, rstd = _normalized_block(s, cols, n, eps, ops.norm, ops.two_pass)
  dy = load_tile("dy")
  g = dy if gamma is None else dy * gamma[None, :]
  # Padded columns and rows have dy = 0, so g = 0 there: they add nothing to either row sum
  # or to the column partials, whatever x̂ holds there.
  inner = g - xhat * (jnp.sum(g * xhat, axis=1, keepdims=True) / n)
  if ops.norm == "layer":
    inner = inner - jnp.sum(g, axis=1, keepdims=True) / n
  ds = inner * rstd
  if ops.ds_out:
    ds = ds + load_tile("ds_out")
  return ds, xhat, dy


_ROW_INPUTS = ("rstd", "shift", "dmean")
"""Inputs of :func:`_backward_kernel` with one value per row; the others are (M, N) tiles."""


def _backward_kernel(*refs, ops: _Operands, m: int, n: int, n_pad: int, cfg: BackwardConfig,
                     eps: float):
  """One program: the row blocks p, p + P, ... (P = ``cfg.programs``; the programs running at
  once stream adjacent rows), each loaded whole (with ``cfg.prefetch`` the next block's loads
  are issued before the current block's math), its ds stored and its column summands added to
  the program's partials, written once after the loop."""
  r = dict(zip(ops.input_names() + ops.output_names(), refs, strict=True))
  pid = pl.program_id(0)
  block_m, programs = cfg.block_m, cfg.programs
  cols = jnp.arange(n_pad)
  col_mask = cols < n
  gamma = None
  if ops.gamma:
    gamma = pltriton.load(r["gamma"].at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  loaded = [q for q in ops.input_names() if q != "gamma"]

  def block(i):
    """(rows, mask, tile index) of the program's i-th row block."""
    rows = (pid + i * programs) * block_m + jnp.arange(block_m)
    # Full rows (N a power of 2) need no column mask: a mask constant along the row keeps the
    # loads and stores vectorized.
    mask = jnp.broadcast_to((rows < m)[:, None], (block_m, n_pad))
    if n != n_pad:
      mask = mask & col_mask[None, :]
    return rows, mask, (rows[:, None], cols[None, :])

  def load(i):
    rows, mask, tile_at = block(i)
    # Rows past M read 1 as their statistics (their x̂ and dy are 0 anyway).
    return tuple(
        pltriton.load(r[q].at[rows], mask=rows < m, other=1.0) if q in _ROW_INPUTS else
        pltriton.load(r[q].at[tile_at], mask=mask, other=0.0).astype(jnp.float32)
        for q in loaded)

  def finish(i, tiles, partials):
    at = dict(zip(loaded, tiles))
    ds, xhat, dy = _row_block_grads(at.__getitem__, at.__getitem__, cols, gamma, ops, n, eps)
    _, mask, tile_at = block(i)
    pltriton.store(r["ds"].at[tile_at], ds.astype(r["ds"].dtype), mask=mask)
    summands = {"dscale_part": lambda: dy * xhat, "dbias_part": lambda: dy,
                "ddense_part": lambda: ds}
    return tuple(acc + summands[name]() for name, acc in zip(ops.partial_names(), partials))

  steps = (pl.cdiv(m, block_m) - pid + programs - 1) // programs
  zeros = (jnp.zeros((block_m, n_pad), jnp.float32),) * len(ops.partial_names())
  if cfg.prefetch:
    def step(i, carry):
      partials, tiles = carry
      ahead = load(i + 1)  # past the last block: masked, nothing read
      return finish(i, tiles, partials), ahead
    partials, _ = lax.fori_loop(0, steps, step, (zeros, load(0)))
  else:
    partials = lax.fori_loop(0, steps, lambda i, acc: finish(i, load(i), acc), zeros)
  # One row of partials per program, reduced over its block rows once, after the loop.
  part_at = pid * n_pad + cols
  for name, acc in zip(ops.partial_names(), partials):
    pltriton.store(r[name].at[part_at], jnp.sum(acc, axis=0), mask=col_mask)


def _chunked_backward_kernel(*refs, ops: _Operands, m: int, n: int, cfg: triton_fwd.RowTiling,
                             rows_per_program: int):
  """The backward of rows too wide for registers, given the forward kernel's statistics.

  Per block of rows, pass 1 walks the rows in chunks accumulating g ⊙ x̂ (and g) elementwise
  (no reduction, so no barrier, inside the walk) for the row sums; pass 2 reads the chunks
  again, last first (from L2), writes ds and accumulates the chunk's column sums (dγ, dβ):

  * ``cfg.column_sums == "registers"``: the chunk walk is unrolled and every chunk's column sums
    stay in registers over the program's rows (N / threads floats per partial per thread),
    stored once per program to its row of the partial buffers (deterministic);
  * "apart": none here (:func:`_column_sums_call` sums them).

  The partial rows are ``chunks · chunk`` wide (padded columns add zeros)."""
  unrolled = cfg.column_sums == "registers"
  names = ops.partial_names() if unrolled else []
  r = dict(zip(ops.input_names() + ["ds"] + names, refs, strict=True))
  pid = pl.program_id(0)
  block_m, chunk = cfg.block_m, cfg.chunk
  chunks = pl.cdiv(n, chunk)
  base = jnp.arange(chunk)

  def part_at(k):
    return pl.ds(pid * chunks * chunk + k * chunk, chunk)

  def step(i, partials):
    rows = pid * rows_per_program + i * block_m + jnp.arange(block_m)
    row_mask = rows < m
    stats = tuple(pltriton.load(r[q].at[rows], mask=row_mask, other=1.0)
                  if q in r else None for q in ("shift", "dmean", "rstd"))

    def tiles(k, evict):
      cols = k * chunk + base
      mask = triton_fwd.tile_mask(row_mask, cols, n)
      at = (rows[:, None], cols[None, :])
      policy = evict if cfg.l2_hints else None
      load = lambda q: pltriton.load(r[q].at[at], mask=mask, other=0.0,  # noqa: E731
                                     eviction_policy=policy).astype(jnp.float32)
      xhat = triton_fwd.normalized_with(load("x"), cols, n, stats)
      dy = load("dy")
      g = dy
      if ops.gamma:
        g = dy * pltriton.load(r["gamma"].at[cols], mask=cols < n,
                               other=0.0).astype(jnp.float32)[None, :]
      return at, mask, xhat, dy, g

    def accumulate(k, acc):
      _, _, xhat, _, g = tiles(k, "evict_last")  # read again by the second pass
      return acc[0] + g * xhat, acc[1] + g

    zeros = jnp.zeros((block_m, chunk), jnp.float32)
    gx, gs = triton_fwd.chunk_loop(chunks, accumulate, (zeros, zeros))
    rstd = stats[2][:, None]
    gx = (jnp.sum(gx, axis=1) / n)[:, None]
    gs = (jnp.sum(gs, axis=1) / n)[:, None] if ops.norm == "layer" else 0.0

    def write(j, partials):  # last chunk first: the most recently read, likeliest in L2
      k = chunks - 1 - j
      at, mask, xhat, dy, g = tiles(k, "evict_first")
      ds = (g - xhat * gx - gs) * rstd
      pltriton.store(r["ds"].at[at], ds.astype(r["ds"].dtype), mask=mask)
      sums = {"dscale_part": lambda: jnp.sum(dy * xhat, axis=0),
              "dbias_part": lambda: jnp.sum(dy, axis=0)}
      return tuple(tuple(acc + sums[name]() if c == k else acc for c, acc in enumerate(accs))
                   for name, accs in zip(names, partials))

    return triton_fwd.chunk_loop(chunks, write, partials, unrolled or None)

  init = tuple(tuple(jnp.zeros((chunk,), jnp.float32) for _ in range(chunks)) for _ in names)
  partials = lax.fori_loop(0, rows_per_program // block_m, step, init)
  for name, accs in zip(names, partials):
    for k, acc in enumerate(accs):
      pltriton.store(r[name].at[part_at(k)], acc)


def _chunked_backward_call(ops: _Operands, m: int, n: int, ds_dtype, interpret: bool, inputs):
  """(ds (M, N), [column sums]) by :func:`_chunked_backward_kernel` (and
  :func:`_column_sums_call` where the tiling sums the columns apart)."""
  cfg = pick_chunked_config(m, n, interpret, ops.norm)
  apart = cfg.column_sums == "apart"
  rows_per_program, programs = triton_fwd.slab_rows(m, cfg)
  width = pl.cdiv(n, cfg.chunk) * cfg.chunk
  part = jax.ShapeDtypeStruct((programs * width,), jnp.float32)
  partials = 0 if apart else len(ops.partial_names())
  out_shape = [jax.ShapeDtypeStruct((m, n), ds_dtype)] + [part] * partials
  kernel = functools.partial(_chunked_backward_kernel, ops=ops, m=m, n=n, cfg=cfg,
                             rows_per_program=rows_per_program)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(programs,), interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps),
      name=f"{ops.norm}_norm_backward_chunked")(*inputs)
  if apart:
    return outs[0], _column_sums_call(ops, m, n, interpret, dict(zip(ops.input_names(), inputs)))
  return outs[0], [jnp.sum(buf.reshape(programs, width)[:, :n], axis=0) for buf in outs[1:]]


def _column_sums_kernel(*refs, names, sums, m: int, n: int, width: int, block_m: int,
                        rows_per_split: int):
  """Σ_rows dy ⊙ x̂ and/or Σ_rows dy of one column block over one split of the rows, x̂ from
  the given statistics; rows × columns partials in registers, reduced over the rows once."""
  r = dict(zip(names + sums, refs, strict=True))
  cols = pl.program_id(0) * width + jnp.arange(width)
  first = pl.program_id(1) * rows_per_split

  def step(i, acc):
    rows = first + i * block_m + jnp.arange(block_m)
    row_mask = rows < m
    mask = triton_fwd.tile_mask(row_mask, cols, n)
    at = (rows[:, None], cols[None, :])
    stats = tuple(pltriton.load(r[q].at[rows], mask=row_mask, other=1.0) if q in r else None
                  for q in ("shift", "dmean", "rstd"))
    x = pltriton.load(r["x"].at[at], mask=mask, other=0.0).astype(jnp.float32)
    dy = pltriton.load(r["dy"].at[at], mask=mask, other=0.0).astype(jnp.float32)
    # dy is 0 outside the mask, so x̂ there adds nothing.
    summand = {"dscale_part": lambda: dy * triton_fwd.normalized_with(x, cols, n, stats),
               "dbias_part": lambda: dy}
    return tuple(a + summand[q]() for q, a in zip(sums, acc))

  zeros = jnp.zeros((block_m, width), jnp.float32)
  acc = lax.fori_loop(0, rows_per_split // block_m, step, (zeros,) * len(sums))
  at = pl.program_id(1) * pl.num_programs(0) * width + cols
  for q, a in zip(sums, acc):
    pltriton.store(r[q].at[at], jnp.sum(a, axis=0))


def _column_sums_call(ops: _Operands, m: int, n: int, interpret: bool, arrays):
  """[Σ dy ⊙ x̂ (with a scale), Σ dy (with a bias)] over the rows, (N,) float32, from x, dy and
  the forward kernel's statistics (``arrays`` by :meth:`_Operands.input_names`): a grid of
  column blocks × row splits (:data:`COLUMN_SUM_TILING`), the splits summed by XLA."""
  sums = ops.partial_names()
  if not sums:
    return []
  width, block_m, per_sm = COLUMN_SUM_TILING
  width = min(width, pl.next_power_of_2(n))
  blocks = pl.cdiv(n, width)
  programs = INTERPRET_PROGRAMS if interpret else per_sm * _gpu_core_count()
  splits = max(1, min(pl.cdiv(programs, blocks), pl.cdiv(m, block_m)))
  rows_per_split = pl.cdiv(pl.cdiv(m, splits), block_m) * block_m
  splits = pl.cdiv(m, rows_per_split)
  names = [q for q in ("x", "rstd", "shift", "dmean", "dy") if q in arrays]
  part = jax.ShapeDtypeStruct((splits * blocks * width,), jnp.float32)
  kernel = functools.partial(_column_sums_kernel, names=names, sums=sums, m=m, n=n,
                             width=width, block_m=block_m, rows_per_split=rows_per_split)
  outs = pl.pallas_call(
      kernel, out_shape=[part] * len(sums), grid=(blocks, splits), interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=4),
      name=f"{ops.norm}_norm_column_sums")(*[arrays[q] for q in names])
  return [jnp.sum(buf.reshape(splits, blocks * width)[:, :n], axis=0) for buf in outs]


def _chunked_rows(given_stats: bool, n: int) -> bool:
  """Whether the backward walks rows in chunks: given the forward kernel's statistics, rows of
  at least ``triton_fwd.CHUNKED_MIN_N``."""
  return given_stats and n >= triton_fwd.CHUNKED_MIN_N


def _backward_call(ops: _Operands, m: int, n: int, eps: float, ds_dtype, interpret: bool,
                   inputs):
  """Runs the kernel; returns (ds (M, N), [column sum of each of ``ops.partial_names()``])."""
  if _chunked_rows(ops.given_stats, n):
    return _chunked_backward_call(ops, m, n, ds_dtype, interpret, inputs)
  cfg = pick_config(m, n, interpret, ops.norm + "_given" * ops.given_stats)
  n_pad = pl.next_power_of_2(n)
  programs = cfg.programs
  part = jax.ShapeDtypeStruct((programs * n_pad,), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((m, n), ds_dtype)] + [part] * len(ops.partial_names())
  kernel = functools.partial(_backward_kernel, ops=ops, m=m, n=n, n_pad=n_pad, cfg=cfg, eps=eps)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(programs,), interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      name="norm_backward" if ops.saved_stats else "layer_norm_backward")(*inputs)
  # The programs' partial rows, summed by XLA (a fixed reduction: no atomics).
  sums = [jnp.sum(buf.reshape(programs, n_pad)[:, :n], axis=0) for buf in outs[1:]]
  return outs[0], sums


# ----------------------------------------------------------------------------------------------
# The row norms' backward (the custom_vjp of :mod:`pallas_norm.ops.norms.api` launches it).


def row_backward(x, scale, bias, residual, stats, dy, ds_out, *, norm: str, eps: float,
                 zero_centered_scale: bool, interpret: bool):
  """The backward of ``layer_norm``/``rms_norm``'s kernel path as ``(launch, inputs)``.

  ``launch(*inputs)`` runs the kernel (or the chunked kernels of rows wider than
  :data:`MAX_N`) and returns ``(ds (M, N) in x's dtype, [Σ dy ⊙ x̂ with a scale, Σ dy with a
  bias])``, the column sums (N,) float32. ``inputs``: x (and ``residual``) as (M, N) rows,
  the forward kernel's statistics (``stats``: its ``rstd``, and LayerNorm's ``shift`` and
  ``dmean``; None: the kernel recomputes them from x) as (M,), ``dy`` (and ``ds_out``, the
  cotangent of s) as (M, N), and the applied scale in its own dtype (float32 where zero-centered
  or where the chunked tiling asks for it: :data:`CHUNKED_TILING`; the kernels widen it
  exactly). The two come apart so that the
  caller wraps the launch alone in ``_op.first_order_only`` over exactly these inputs. No
  validation (the public ops check :func:`unsupported_reason` first).
  """
  n = x.shape[-1]
  m = math.prod(x.shape[:-1])
  ops = _Operands(residual=residual is not None, ds_out=ds_out is not None,
                  gamma=scale is not None, dbias=bias is not None, norm=norm,
                  two_pass=jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16),
                  given_stats=stats is not None)
  f32 = zero_centered_scale or (_chunked_rows(stats is not None, n)
                                and pick_chunked_config(m, n, interpret, norm).f32_vectors)
  gamma = xla.applied_scale(scale, zero_centered_scale, jnp.float32 if f32 else None)
  rows = []
  if stats is not None:
    rows = [stats.rstd] + ([stats.shift, stats.dmean] if norm == "layer" else [])
  tiles = ([t.reshape(m, n) for t in (x, residual) if t is not None]
           + [t.reshape(m) for t in rows]
           + [t.reshape(m, n) for t in (dy, ds_out) if t is not None])
  inputs = tiles + ([gamma] if ops.gamma else [])

  def launch(*inputs):
    return _backward_call(ops, m, n, eps, x.dtype, interpret, list(inputs))

  return launch, inputs

# ----------------------------------------------------------------------------------------------
# The same kernel given x̂ and rstd: the norm backward of the post-norm GEMM (matmul_norm).

SAVED_STATS_SUMS = ("dscale", "dbias", "ddense")
"""Column sums :func:`norm_backward` can return: Σ dy ⊙ x̂, Σ dy, Σ dh (float32)."""


def saved_stats_unsupported_reason(m: int, n: int, dtype) -> str | None:
  """Why :func:`norm_backward` cannot take (M, N) operands of ``dtype``, or None."""
  if jnp.dtype(dtype) not in KERNEL_DTYPES:
    return f"the kernel takes bfloat16/float16/float32, got {jnp.dtype(dtype)}"
  if m < 1:
    return f"M = {m} (needs at least one row)"
  if n > MAX_N:
    return f"N = {n}: the kernel holds full rows in registers, at most N = {MAX_N}"
  if m * n > MAX_ELEMENTS:
    return f"{m} x {n} elements, past the kernel's int32 offsets"
  return None


def norm_backward(dy, xhat, rstd, scale=None, dh_out=None, *, norm: str,
                  sums: tuple[str, ...] = (), interpret: bool = False):
  """dh and column sums of ``y = x̂·scale (+ bias)`` given the forward's x̂ and rstd, one pass.

  With ``g = scale ⊙ dy`` and means over the N columns of a row (DESIGN.md, op 2)::

      dh = rstd ⊙ (g − x̂ ⊙ mean_N(g ⊙ x̂) − mean_N(g)) (+ dh_out)      (RMS: no mean_N(g))

  Each program takes every P-th block of rows (P programs), reads dy, x̂ (and dh_out) once,
  writes dh once and keeps the column sums' partials in registers (as
  :func:`pallas_norm.layer_norm`'s backward does).

  Args:
    dy: (M, N) cotangent of y; xhat: (M, N) x̂ in dy's dtype; rstd: (M,) float32.
    scale: optional (N,) γ (used in float32). dh_out: optional (M, N), added to dh.
    norm: "layer" or "rms".
    sums: a sub-sequence of :data:`SAVED_STATS_SUMS`.
    interpret: Pallas interpret mode (any backend).

  Returns:
    ``(dh in dy's dtype, {sum name: (N,) float32 column sum})``.

  Raises:
    ValueError: an unknown norm or sum name, or operands :func:`saved_stats_unsupported_reason`
      refuses. The caller (:mod:`pallas_norm.ops.matmul_norm.api`) checks shapes and dtypes.
  """
  if norm not in ("layer", "rms"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
  if any(q not in SAVED_STATS_SUMS for q in sums) or len(set(sums)) != len(sums):
    raise ValueError(f"sums must be distinct names from {SAVED_STATS_SUMS}, got {sums!r}")
  m, n = dy.shape
  if reason := saved_stats_unsupported_reason(m, n, dy.dtype):
    raise ValueError(f"norm_backward kernel: {reason}")
  ops = _Operands(residual=False, ds_out=dh_out is not None, gamma="dscale" in sums,
                  dbias="dbias" in sums, saved_stats=True, norm=norm, ddense="ddense" in sums)
  # γ enters g whether or not dscale is asked for: without the sum, the kernel's "gamma" input
  # is still needed, so the dscale partial comes along (and is dropped) when a scale is given.
  if scale is not None and not ops.gamma:
    ops = dataclasses.replace(ops, gamma=True)
  inputs = [xhat, rstd.astype(jnp.float32), dy] + ([dh_out] if dh_out is not None else [])
  if ops.gamma:
    inputs.append(jnp.ones((n,), jnp.float32) if scale is None else scale.astype(jnp.float32))
  dh, partials = _backward_call(ops, m, n, 0.0, dy.dtype, interpret, inputs)
  by_name = dict(zip(("dscale", "dbias", "ddense"),
                     [partials.pop(0) if flag else None
                      for flag in (ops.gamma, ops.dbias, ops.ddense)]))
  return dh, {q: by_name[q] for q in sums}
