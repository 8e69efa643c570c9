"""The two norm backwards of the fused block's custom_vjp, one pass over the rows each.

Pallas kernels with the Triton lowering (``interpret=True`` runs them on the CPU). Rows are the
block's tokens with all H·D features (the norms reduce across heads), so a row block holds full
rows and both per-token row sums are register reductions; the weight gradients are per-program
float32 partial column sums, summed by XLA afterwards (deterministic, no atomics). Nothing
recomputes a statistic: the forward's (μ1, r1, r2) are read (DESIGN.md, op 4; the formulas of
:func:`_rms_backward_rows` and :func:`_ln_backward_rows`).

Passes and bytes (16-bit tensors of T × H·D, f32 statistics and partials aside):

* :func:`rms_backward`, before the GDPA backward: reads dout and z (saved by the forward kernel,
  as is u, the GDPA backward's q); writes dz: 3 tensors, dγ2 in the same pass.
* :func:`ln_backward`, after it: reads du (the GDPA backward's dq, which adds dz for the inner
  residual), dout (outer residual), q; writes dq: 4 tensors, dγ1 and dβ1 in the same pass.

Work scales with the tokens, not with the capacity T: each kernel splits the row blocks below
``end`` (the last offset) over a fixed grid of programs, program p taking blocks p, p + P, p + 2P,
... (the P programs running at once stream adjacent rows, which the H200 serves faster than P
separate slabs; the split, and so the partial sums' order, depend only on ``end`` and P, which
:func:`pick_config` fixes per SM count above a few thousand rows of capacity), and rows at or
past ``end`` (padding) are neither read nor written: dz's padding rows are left unwritten (the
GDPA backward never reads dO there: its q blocks that reach past the last offset read a
zero-padded copy), dq is written over du (an aliased buffer), whose padding rows the GDPA
backward wrote as ``0 · pre · post`` (zeros; NaN where the op poisoned bad traced offsets).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_norm import mgpu

_F32 = jnp.float32
MAX_ELEMENTS = 2**31 - 1
"""The kernels index the (T, H·D) tensors with int32 element offsets."""
MAX_FEATURES = 4096
"""Widest row (H·D) a row block holds in registers."""
MEAN1, RSTD1, RSTD2 = 0, 1, 2
"""Columns of the forward's statistics array (T, C): μ1, r1, r2 (C >= 3; the forward kernel
writes C = 32, read in place)."""


def unsupported_reason(shape) -> str | None:
  """Why the row kernels cannot take q of ``shape`` (T, H, D), or None."""
  t, heads, head_dim = shape
  if heads * head_dim > MAX_FEATURES:
    return f"H·D = {heads * head_dim}: the norm backward holds rows of at most {MAX_FEATURES}"
  if t * max(heads * head_dim, 32) > MAX_ELEMENTS:  # q, and the forward's (T, 32) statistics
    return f"q has {t * heads * head_dim} elements, past the norm backward's int32 offsets"
  return None


@dataclasses.dataclass(frozen=True)
class RowConfig:
  """``block_m`` rows per loop step (a power of 2), ``programs`` programs (the grid; each
  loops over every ``programs``-th row block below ``end`` and writes one row of
  weight-gradient partials), ``num_warps`` warps per program, ``num_stages`` Triton's
  software-pipelining depth (None: Triton's default), ``prefetch``: each step loads the next
  step's tiles before its own math (carried in registers: more loads in flight, more live
  registers)."""

  block_m: int
  programs: int
  num_warps: int
  num_stages: int | None = None
  prefetch: bool = False

  def __post_init__(self):
    if self.block_m < 1 or self.block_m & (self.block_m - 1):
      raise ValueError(f"block_m must be a power of 2, got {self.block_m}")
    if self.programs < 1 or self.num_warps < 1:
      raise ValueError(f"programs and num_warps must be positive, got {self.programs}, "
                       f"{self.num_warps}")


TILINGS = {"rms": (1024, 8, True), "ln": (2048, 4, False)}
"""(elements per loop step, programs per SM, prefetch) of :func:`pick_config`, per kernel: full
rows padded to a power of 2 over 4 warps. At H·D = 512 that is 2 rows a step, the next step's
tiles loaded ahead, for the RMSNorm backward, and 4 rows for the LayerNorm one, whose body holds
more live values per element (three input tiles, two row sums); its 4 programs per SM measured
faster than 6 and 8 (likely one full wave against a half-full second one). Each the fastest of
the tilings measured on the H200 at the issue's rows (benchmarks/NOTES.md,
"flash_norm_attention"; the others are rows of benchmarks/EXPERIMENTS.md)."""


def pick_config(features: int, interpret: bool, capacity: int, kernel: str) -> RowConfig:
  """The tiling of ``kernel`` ("rms" or "ln"): :data:`TILINGS`' elements per step and programs
  per SM (no more programs than row blocks in ``capacity``; one row of weight-gradient partials
  per program, so the partials stay small), 4 warps, Triton's default pipelining; in interpret
  mode a program per 2 row blocks of the capacity, so that small tests cover several programs
  (and, with fewer tokens, programs with nothing to do)."""
  elements, per_sm, prefetch = TILINGS[kernel]
  n_pad = pl.next_power_of_2(features)
  block_m = max(1, min(16, elements // n_pad))
  blocks = max(1, pl.cdiv(capacity, block_m))
  if interpret:
    return RowConfig(block_m=block_m, programs=pl.cdiv(blocks, 2), num_warps=4, num_stages=1,
                     prefetch=prefetch)
  return RowConfig(block_m=block_m, programs=min(blocks, per_sm * mgpu.num_sms(False)),
                   num_warps=4, prefetch=prefetch)


@dataclasses.dataclass(frozen=True)
class _Rows:
  """One step's row block: loaders of full-row tiles and per-row values (zeros past ``end``)
  and the store of a tile (rows below ``end`` only)."""

  rows: jax.Array
  cols: jax.Array
  live: jax.Array  # rows < end: the tokens (end <= T)
  col_mask: jax.Array | None

  @classmethod
  def at(cls, first_row, block_m, n, n_pad, end):
    rows = first_row + jnp.arange(block_m)
    cols = jnp.arange(n_pad)
    return cls(rows=rows, cols=cols, live=rows < end, col_mask=None if n == n_pad else cols < n)

  def _mask(self, row_mask):
    mask = jnp.broadcast_to(row_mask[:, None], (self.rows.shape[0], self.cols.shape[0]))
    return mask if self.col_mask is None else mask & self.col_mask[None, :]

  def tile(self, ref):
    return pltriton.load(ref.at[self.rows[:, None], self.cols[None, :]],
                         mask=self._mask(self.live), other=0.0).astype(_F32)

  def column(self, ref, col: int, cols: int):
    """Column ``col`` of a row-major (T, ``cols``) array given flat (``ref``), per row:
    (block_m, 1), read in place (one 32-byte sector per row)."""
    return pltriton.load(ref.at[self.rows * cols + col], mask=self.live, other=0.0)[:, None]

  def store(self, ref, value):
    pltriton.store(ref.at[self.rows[:, None], self.cols[None, :]], value.astype(ref.dtype),
                   mask=self._mask(self.live))


def _col(ref, n, n_pad):
  cols = jnp.arange(n_pad)
  return pltriton.load(ref.at[cols], mask=cols < n, other=0.0)[None, :]


def _rms_tiles(r, blk: _Rows, stats_cols: int):
  """The RMSNorm backward's loads of one row block: g, z and r2 (zeros past ``end``)."""
  return blk.tile(r["g"]), blk.tile(r["z"]), blk.column(r["stats"], RSTD2, stats_cols)


def _rms_backward_rows(tiles, gamma2, n: int):
  """dz of one row block and dγ2's summand ``g · ẑ``, with ẑ = z·r2 (z as the forward saved
  it: u + attn, or attn without the inner residual)::

      dz = r2 · (g·γ2 − ẑ · mean(g·γ2·ẑ))
  """
  g, z, rstd2 = tiles
  z_hat = z * rstd2
  gz = g * gamma2  # zero on masked rows and columns: they add nothing to the sums
  dz = rstd2 * (gz - z_hat * (jnp.sum(gz * z_hat, axis=1, keepdims=True) / n))
  return dz, g * z_hat


def _ln_tiles(r, blk: _Rows, outer_residual: bool, stats_cols: int):
  """The LayerNorm backward's loads of one row block: du, q, μ1, r1 and g (with the outer
  residual)."""
  tiles = (blk.tile(r["du"]), blk.tile(r["q"]), blk.column(r["stats"], MEAN1, stats_cols),
           blk.column(r["stats"], RSTD1, stats_cols))
  return tiles + ((blk.tile(r["g"]),) if outer_residual else ())


def _ln_backward_rows(tiles, gamma1, n: int):
  """dq of one row block and the summands of dγ1 (``du · x̂``) and dβ1 (``du``)::

      x̂ = (q − μ1)·r1,   gu = du·γ1
      dq = r1 · (gu − mean(gu) − x̂ · mean(gu·x̂)) + g (outer residual)
  """
  du, q, mean1, rstd1, *residual = tiles
  x_hat = (q - mean1) * rstd1
  gu = du * gamma1
  dq = rstd1 * (gu - jnp.sum(gu, axis=1, keepdims=True) / n
                - x_hat * (jnp.sum(gu * x_hat, axis=1, keepdims=True) / n))
  if residual:
    dq = dq + residual[0]
  return dq, du * x_hat, du


def _row_kernel(*refs, names, load, compute, vectors, partials: int, n: int, cfg: RowConfig):
  """One program: the row blocks p, p + P, ... below ``end`` (P programs; some have one block
  fewer, or none where fewer than P blocks lie below ``end``). ``load(refs, block) -> tiles``
  reads a block, ``compute(tiles, vecs) -> ({output name: tile}, summands)`` is its math,
  ``vecs`` the (1, n_pad) rows of the ``vectors`` inputs (γ), loaded once before the loop; with
  ``cfg.prefetch`` the next block's loads are issued before the current block's math (a block
  past ``end`` loads zeros). The summands' column sums are accumulated over the steps and
  written once."""
  r = dict(zip(names, refs, strict=True))
  pid = pl.program_id(0)
  n_pad = pl.next_power_of_2(n)
  end = r["end"][0]
  vecs = tuple(_col(r[name], n, n_pad) for name in vectors)
  blocks = (end + cfg.block_m - 1) // cfg.block_m
  programs = cfg.programs
  steps = jnp.maximum(blocks - pid + programs - 1, 0) // programs
  block_at = lambda i: _Rows.at((pid + i * programs) * cfg.block_m, cfg.block_m, n, n_pad, end)

  def finish(blk, tiles, accs):
    stores, summands = compute(tiles, vecs)
    for name, value in stores.items():
      blk.store(r[name], value)
    return tuple(a + s for a, s in zip(accs, summands))

  def step(i, accs):
    blk = block_at(i)
    return finish(blk, load(r, blk), accs)

  def step_ahead(i, carry):
    accs, tiles = carry
    ahead = load(r, block_at(i + 1))
    return finish(block_at(i), tiles, accs), ahead

  zeros = (jnp.zeros((cfg.block_m, n_pad), _F32),) * partials
  if cfg.prefetch:
    accs, _ = lax.fori_loop(0, steps, step_ahead, (zeros, load(r, block_at(0))))
  else:
    accs = lax.fori_loop(0, steps, step, zeros)
  cols = jnp.arange(n_pad)
  # One (partials, n_pad, programs) buffer: XLA sums its contiguous rows (one warp per
  # feature, not the columns of a (programs, n_pad) array, which it did slowly:
  # benchmarks/NOTES.md), every partial in one reduction kernel.
  for j, acc in enumerate(accs):
    pltriton.store(r["partials"].at[(j * n_pad + cols) * programs + pid], jnp.sum(acc, axis=0),
                   mask=cols < n)


def _call(name, load, compute, vectors, inputs: dict, outputs: dict, partials: int, n: int,
          interpret: bool, cfg: RowConfig, aliases=None):
  """Runs :func:`_row_kernel` over the rows below ``end``; returns the outputs and the column
  sums. ``aliases``: {input name: output name} written in place of that input (rows the kernel
  does not write keep the input's values)."""
  programs = cfg.programs
  n_pad = pl.next_power_of_2(n)
  out_shape = list(outputs.values()) + [
      jax.ShapeDtypeStruct((partials * n_pad * programs,), _F32)]
  names = list(inputs) + list(outputs) + ["partials"]
  kernel = functools.partial(_row_kernel, names=names, load=load, compute=compute,
                             vectors=vectors, partials=partials, n=n, cfg=cfg)
  aliases = {list(inputs).index(i): list(outputs).index(o) for i, o in (aliases or {}).items()}
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(programs,), interpret=interpret, name=name,
      input_output_aliases=aliases,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages))(*inputs.values())
  sums = jnp.sum(outs[-1].reshape(partials, n_pad, programs)[:, :n], axis=2)
  return list(outs[:-1]), list(sums)


def rms_backward(g, z, stats, gamma2, end, *, interpret: bool = False,
                 config: RowConfig | None = None):
  """The RMSNorm backward, one pass: dz = r2 · (g·γ2 − ẑ · mean(g·γ2·ẑ)), ẑ = z·r2.

  Args:
    g: (T, N) cotangent of the output (N = H·D), 16-bit; z: (T, N) the RMSNorm's input as the
      forward kernel saved it (q's dtype).
    stats: (T, C) float32, C >= 3, the forward's statistics: r2 in column :data:`RSTD2`.
    gamma2: (N,) float32 γ2.
    end: int32 scalar, the first padding row (clipped to [0, T]).
    interpret: run in Pallas interpret mode; config: tiling (default :func:`pick_config`).

  Returns:
    ``(dz, dγ2)``: dz (T, N) in z's dtype, its padding rows (at or past ``end``) not written
    (undefined: the GDPA backward never reads them), dγ2 (N,) float32.

  Raises:
    ValueError: stats is not float32 of shape (T, >= 3).
  """
  capacity, n = z.shape
  stats_cols = _check_stats(stats, capacity)
  inputs = dict(end=_end(end, capacity), g=g, z=z,
                stats=stats.reshape(-1), gamma2=gamma2)
  outputs = dict(dz=jax.ShapeDtypeStruct((capacity, n), z.dtype))

  def compute(tiles, vecs):
    dz, summand = _rms_backward_rows(tiles, vecs[0], n)
    return dict(dz=dz), (summand,)

  cfg = config or pick_config(n, interpret, capacity, "rms")
  load = functools.partial(_rms_tiles, stats_cols=stats_cols)
  (dz,), (d_gamma2,) = _call("fna_rms_backward", load, compute, ("gamma2",), inputs, outputs,
                             1, n, interpret, cfg)
  return dz, d_gamma2


def _end(end, capacity: int):
  """``end`` clipped to [0, T] as the kernels' (1,) int32 input: rows past T are never
  touched."""
  return jnp.clip(jnp.reshape(end, (1,)).astype(jnp.int32), 0, capacity)


def _check_stats(stats, capacity: int) -> int:
  """The column count of the statistics array (T, C); ValueError unless float32 (T, >= 3)."""
  if stats.ndim != 2 or stats.shape[0] != capacity or stats.shape[1] < 3 or (
      stats.dtype != _F32):
    raise ValueError(f"stats must be float32 (T={capacity}, >= 3), got {stats.dtype} "
                     f"{stats.shape}")
  return stats.shape[1]


def ln_backward(du, g, q, stats, gamma1, end, *, outer_residual: bool,
                interpret: bool = False, config: RowConfig | None = None):
  """The LayerNorm backward with the outer residual, one pass.

  Args:
    du: (T, N) gradient of u in q's dtype: the GDPA backward's dq (with dz added for the inner
      residual); dq is written over it (an aliased buffer: under jit, pass a du nothing else
      reads, or XLA copies it first), so dq's padding rows are du's.
    g: (T, N) cotangent of the output (read with the outer residual; else may be None).
    q: (T, N); stats: (T, C) float32, C >= 3: μ1, r1 in columns :data:`MEAN1`,
      :data:`RSTD1`; gamma1: (N,) float32.
    end: int32 scalar, the first padding row (clipped to [0, T]).
    interpret, config: as :func:`rms_backward`.

  Returns:
    ``(dq, dγ1, dβ1)``: dq (T, N) in q's dtype (rows at or past ``end``: du's, untouched),
    dγ1 and dβ1 (N,) float32.

  Raises:
    ValueError: stats is not float32 of shape (T, >= 3).
  """
  capacity, n = q.shape
  stats_cols = _check_stats(stats, capacity)
  if du.dtype != q.dtype:
    raise ValueError(f"du must have q's dtype {q.dtype} (dq is written over it), got {du.dtype}")
  inputs = dict(end=_end(end, capacity), du=du,
                **(dict(g=g) if outer_residual else {}),
                q=q, stats=stats.reshape(-1), gamma1=gamma1)
  outputs = dict(dq=jax.ShapeDtypeStruct((capacity, n), q.dtype))

  def compute(tiles, vecs):
    dq, d_scale, d_bias = _ln_backward_rows(tiles, vecs[0], n)
    return dict(dq=dq), (d_scale, d_bias)

  cfg = config or pick_config(n, interpret, capacity, "ln")
  load = functools.partial(_ln_tiles, outer_residual=outer_residual, stats_cols=stats_cols)
  (dq,), (d_gamma1, d_beta1) = _call("fna_ln_backward", load, compute, ("gamma1",), inputs,
                                     outputs, 2, n, interpret, cfg, aliases=dict(du="dq"))
  return dq, d_gamma1, d_beta1
