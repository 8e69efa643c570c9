"""The row norms' forward as one Pallas kernel (Triton lowering) that also returns the float32
row statistics, for the backward kernel of :mod:`pallas_norm.ops.norms.triton` to read.

XLA's forward is one fused pass only while nothing but ``y`` leaves it: handing the statistics
over split it into three passes (``benchmarks/NOTES.md``, "Standalone norms"). This kernel reads
x once (rows up to :data:`CHUNKED_MIN_N` held in registers) and writes y and, per row, ``rstd``
(RMSNorm) or ``(shift, dmean, rstd)`` (LayerNorm, the pair of
:class:`pallas_norm.ops.norms.xla.RowStats`: the row's first element and the mean of the row
shifted by it, so rows with a large mean keep their precision in the backward): 12 bytes a row
at most, next to 2N for x.

Two bodies, chosen by the tiling's ``chunk`` (:func:`pick_config`):

* full rows (``chunk >= n_pad``): each step loads ``block_m`` full rows, computes the statistics
  in registers, writes y: float16/float32 with the reference's operations (the shifted two-pass
  variance), bfloat16 with the shifted moments side by side (:func:`full_row_stats`).
* chunked rows (wider rows, which do not fit in registers): per row block, pass 1 walks the row
  in chunks of ``chunk`` columns (:func:`chunked_row_stats`: elementwise moments for bfloat16
  and RMSNorm, Chan's merge of the chunks' two-pass moments for LayerNorm of float16/float32);
  pass 2 reads
  the chunks again, last first (from L2: the block was just read, its last chunk most
  recently) and writes y.

No residual: a call with a residual keeps XLA's forward (the ops' dispatch).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_norm.ops.norms import xla

CHUNKED_MIN_N = 8193
"""Rows at least this wide are walked in chunks (forward and backward); narrower rows are held
whole in registers (the backward kernel's ``MAX_N``)."""

TILINGS = {"full": (4096, None, 4), "wide": (8192, 4, 8),
           "chunked": {"layer": (8192, None, 16, True, False),
                       "rms": (8192, None, 16, True, True)}}
"""Forward tilings, each (elements per step, programs per SM, warps[, L2 hints, float32 vectors
(chunked rows: :class:`RowTiling` ``l2_hints``, ``f32_vectors``)]): full rows up to 4096
elements (both norms), full rows wider than 4096 (one a step), and chunked rows per norm (the
chunk's columns; one row a step).
Programs per SM None: one program per row block (a grid over the blocks, no row loop: the GPU
keeps as many in flight as fit, as XLA's and inductor's row kernels do; the forward has no
column partials to hold per program). The same tilings serve the forward alone and training.
Each the fastest measured on the H200 (``benchmarks/NOTES.md``, "Standalone norms";
``benchmarks/EXPERIMENTS.md``): "full" in training for both norms at N = 128-2048 and for
LayerNorm's forward alone at N = 512 (within 0.6% of the winner at 2048; 3% behind 2048-element
steps at N = 128), "wide" at 8192 (a program per row block lost), the chunked rows a program
per row with L2 hints at 32768: LayerNorm's in both uses, RMSNorm's for its forward alone (its
only default use: RMSNorm trains through XLA there; the slab of 2 per SM was 12% slower).
γ and β reach the kernel in their own dtype (every row block reads them again from L2; with
16-bit vectors every suite shape ran the same, within 0.35%, or up to 17% faster on an H100,
LayerNorm's chunked rows the most), except for RMSNorm's chunked rows, whose forward was 10%
slower with them (not understood)."""

INTERPRET_PROGRAMS = 3
"""Programs in interpret mode: several, so slabs and rows short of a full block are exercised."""


@dataclasses.dataclass(frozen=True)
class RowTiling:
  """Tiling of a row kernel over slabs of full rows.

  Attributes:
    block_m: rows per step (a power of 2).
    chunk: columns per load (a power of 2); ``>= n_pad``: the rows are held whole.
    programs: grid size; program ``p`` owns rows ``[p·R, (p+1)·R)``, R a multiple of block_m.
    num_warps: warps per program (Triton).
    column_sums: where the chunked backward keeps its column sums (dγ, dβ;
      ``triton._chunked_backward_kernel``): "registers" (over the program's rows, chunk loops
      unrolled) or "apart" (a second kernel, ``triton._column_sums_call``: the row kernel then
      needs no partials and runs a program per row block); None for the forward (none).
    l2_hints: chunked rows' loads tell L2 to keep the first pass's lines (``evict_last``) and
      drop the second pass's (``evict_first``), as inductor's looped reductions do, so the
      second pass finds the row in L2.
    f32_vectors: γ (and the forward's β) widened to float32 by XLA before the kernel instead of
      read in their own dtype (the same values: the kernel widens them exactly); set by the
      forward's :data:`TILINGS` and the chunked backward's ``triton.CHUNKED_TILING``.
  """

  block_m: int
  chunk: int
  programs: int
  num_warps: int
  column_sums: str | None = None
  l2_hints: bool = False
  f32_vectors: bool = False


def tiling_flags(flags) -> tuple[bool, bool]:
  """(l2_hints, f32_vectors) from a tiling tuple's optional trailing entries (absent: False)."""
  hints, f32_vectors = (list(flags) + [False, False])[:2]
  return bool(hints), bool(f32_vectors)


def gpu_core_count() -> int:
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def pick_config(m: int, n: int, interpret: bool, norm: str) -> RowTiling:
  """Full rows over :data:`TILINGS` ["full"] (["wide"] past 4096) below :data:`CHUNKED_MIN_N`,
  else one row per step in chunks (:data:`TILINGS` ["chunked"][norm]). Programs per SM None: a
  program per row block, in interpret mode too."""
  n_pad = pl.next_power_of_2(n)
  if n >= CHUNKED_MIN_N:
    chunk, per_sm, warps, *flags = TILINGS["chunked"][norm]
    block_m = 1
  else:
    elements, per_sm, warps, *flags = TILINGS["full" if n_pad <= 4096 else "wide"]
    chunk, block_m = n_pad, max(1, min(64, elements // n_pad))
  hints, f32_vectors = tiling_flags(flags)
  if per_sm is None:  # a program per row block
    programs = pl.cdiv(m, block_m)
  else:
    programs = INTERPRET_PROGRAMS if interpret else per_sm * gpu_core_count()
  return RowTiling(block_m=block_m, chunk=min(chunk, n_pad),
                   programs=max(1, min(programs, pl.cdiv(m, block_m))), num_warps=warps,
                   l2_hints=hints, f32_vectors=f32_vectors)


def slab_rows(m: int, cfg: RowTiling) -> tuple[int, int]:
  """(rows per program, programs): slabs of whole row blocks covering M."""
  rows_per_program = pl.cdiv(pl.cdiv(m, cfg.programs), cfg.block_m) * cfg.block_m
  return rows_per_program, pl.cdiv(m, rows_per_program)


MAX_UNROLLED_CHUNKS = 16
"""Chunk walks of at most this many chunks are unrolled (:func:`chunk_loop`)."""


def chunk_loop(count: int, body, init, unrolled: bool | None = None):
  """``body(k, carry)`` for k = 0..count-1: a Python loop when ``unrolled`` (default: count at
  most :data:`MAX_UNROLLED_CHUNKS`), else ``lax.fori_loop``. Unrolled, k is static and the
  loads of later chunks can be issued before earlier chunks' arithmetic (a loop keeps one chunk
  in flight per warp); values per chunk may live in registers."""
  if unrolled is None:
    unrolled = count <= MAX_UNROLLED_CHUNKS
  if not unrolled:
    return lax.fori_loop(0, count, body, init)
  carry = init
  for k in range(count):
    carry = body(k, carry)
  return carry


# ----------------------------------------------------------------------------------------------
# Statistics of a block of full rows (masked entries are 0).


def tile_mask(row_mask, cols, n: int):
  """The mask of a (rows, cols) tile: by rows alone where no chunk reaches past N (constant
  along the row: the loads and stores stay vectorized), else also by columns."""
  mask = jnp.broadcast_to(row_mask[:, None], (row_mask.shape[0], cols.shape[0]))
  return mask if n % cols.shape[0] == 0 else mask & (cols < n)[None, :]


def _inside(cols, n: int, value):
  """``value`` with the columns past N zeroed (as is, where no chunk reaches past N)."""
  return value if n % cols.shape[0] == 0 else jnp.where(cols[None, :] < n, value, 0.0)


def full_row_stats(s, cols, n: int, eps: float, norm: str, shift=None, two_pass: bool = True):
  """(x̂, (shift, dmean, rstd) each (block_m,), shift = dmean = None for RMSNorm) of full rows
  ``s`` (block_m, n_pad). LayerNorm: ``shift`` (block_m,) is the rows' first elements (loaded
  apart: a row reduction fewer); ``two_pass`` the reference's operations
  (:func:`pallas_norm.ops.norms.xla.row_stats`), else the shifted moments Σd and Σd² side by
  side, var = Σd²/n − dmean² (one dependent row reduction fewer; its cancellation, up to
  n·2^-24 relative in var for a first element far from the mean, is below bfloat16's rounding:
  the backward kernel's argument, ``triton._normalized_block``)."""
  if norm == "rms":
    rstd = lax.rsqrt(jnp.sum(s * s, axis=1) / n + eps)
    return s * rstd[:, None], (None, None, rstd)
  d = _inside(cols, n, s - shift[:, None])
  dmean = jnp.sum(d, axis=1) / n
  centered = _inside(cols, n, d - dmean[:, None])
  if two_pass:
    var = jnp.sum(centered * centered, axis=1) / n
  else:
    var = xla.shifted_variance(jnp.sum(d * d, axis=1) / n, dmean)
  rstd = lax.rsqrt(var + eps)
  return centered * rstd[:, None], (shift, dmean, rstd)


def normalized_with(s, cols, n: int, stats):
  """x̂ of a tile of rows from its statistics (masked columns 0), as
  :func:`pallas_norm.ops.norms.xla.normalized` rounds it."""
  shift, dmean, rstd = stats
  if shift is None:
    return s * rstd[:, None]
  return _inside(cols, n, (s - shift[:, None]) - dmean[:, None]) * rstd[:, None]


def chunked_row_stats(load_chunk, n: int, chunk: int, eps: float, norm: str, block_m: int,
                      shift=None, two_pass: bool = True):
  """(shift, dmean, rstd), each (block_m,), of rows read in chunks by ``load_chunk(k)`` ->
  (tile (block_m, chunk) in float32, its column indices). RMSNorm, and LayerNorm without
  ``two_pass``: elementwise sums over the chunks (Σs², or the moments Σd, Σd² of the rows
  shifted by ``shift``, their first elements), reduced once after the walk (no reduction, so no
  barrier, inside it). LayerNorm with ``two_pass`` merges the chunks' (count, mean, M2) of the
  shifted rows by Chan's formula (each chunk's M2 centred in registers: no cancellation)."""
  chunks = pl.cdiv(n, chunk)
  tile = jnp.zeros((block_m, chunk), jnp.float32)
  if norm == "rms":
    def add_squares(k, acc):
      s, _ = load_chunk(k)
      return acc + s * s
    ssq = jnp.sum(chunk_loop(chunks, add_squares, tile), axis=1)
    return None, None, lax.rsqrt(ssq / n + eps)
  if not two_pass:
    def add_moments(k, acc):
      s, cols = load_chunk(k)
      d = _inside(cols, n, s - shift[:, None])
      return acc[0] + d, acc[1] + d * d
    d1, d2 = chunk_loop(chunks, add_moments, (tile, tile))
    dmean = jnp.sum(d1, axis=1) / n
    var = xla.shifted_variance(jnp.sum(d2, axis=1) / n, dmean)
    return shift, dmean, lax.rsqrt(var + eps)
  zero = jnp.zeros((block_m,), jnp.float32)

  def merge(k, carry):
    count, mean, m2 = carry
    s, cols = load_chunk(k)
    inside = cols[None, :] < n
    count_k = jnp.minimum(chunk, n - k * chunk).astype(jnp.float32)
    d = jnp.where(inside, s - shift[:, None], 0.0)
    mean_k = jnp.sum(d, axis=1) / count_k
    centered = jnp.where(inside, d - mean_k[:, None], 0.0)
    m2_k = jnp.sum(centered * centered, axis=1)
    total = count + count_k
    delta = mean_k - mean
    return (total, mean + delta * (count_k / total),
            m2 + m2_k + delta * delta * (count * count_k / total))

  _, dmean, m2 = lax.fori_loop(0, chunks, merge, (jnp.float32(0.0), zero, zero))
  return shift, dmean, lax.rsqrt(m2 / n + eps)


# ----------------------------------------------------------------------------------------------
# The kernel.


def _forward_kernel(*refs, norm: str, has_gamma: bool, has_beta: bool, m: int, n: int,
                    cfg: RowTiling, rows_per_program: int, eps: float, two_pass: bool):
  names = (["x"] + ["gamma"] * has_gamma + ["beta"] * has_beta + ["y", "rstd"]
           + ["shift", "dmean"] * (norm == "layer"))
  r = dict(zip(names, refs, strict=True))
  pid = pl.program_id(0)
  block_m, chunk = cfg.block_m, cfg.chunk
  base_cols = jnp.arange(chunk)

  def load_vec(name, cols):
    return pltriton.load(r[name].at[cols], mask=cols < n, other=0.0).astype(jnp.float32)

  full = chunk >= n
  vecs = {}
  if full:  # γ and β once per program
    vecs = {q: load_vec(q, base_cols) for q in ("gamma", "beta") if q in r}

  def step(i, _):
    rows = pid * rows_per_program + i * block_m + jnp.arange(block_m)
    row_mask = rows < m

    def at(k):
      cols = k * chunk + base_cols
      return (rows[:, None], cols[None, :]), tile_mask(row_mask, cols, n), cols

    def load_chunk(k, evict=None):
      idx, mask, cols = at(k)
      x = pltriton.load(r["x"].at[idx], mask=mask, other=0.0,
                        eviction_policy=evict if cfg.l2_hints else None)
      return x.astype(jnp.float32), cols

    def store_y(k, xhat, cols):
      idx, mask, _ = at(k)
      vec = lambda q: vecs[q] if full else load_vec(q, cols)  # noqa: E731
      y = xhat * vec("gamma")[None, :] if has_gamma else xhat
      if has_beta:
        y = y + vec("beta")[None, :]
      pltriton.store(r["y"].at[idx], y.astype(r["y"].dtype), mask=mask)

    shift = None
    if norm == "layer":  # the rows' first elements
      shift = pltriton.load(r["x"].at[rows, jnp.zeros_like(rows)], mask=row_mask,
                            other=0.0).astype(jnp.float32)
    if full:  # full rows: one load
      s, cols = load_chunk(0)
      xhat, stats = full_row_stats(s, cols, n, eps, norm, shift, two_pass)
      store_y(0, xhat, cols)
    else:
      stats = chunked_row_stats(functools.partial(load_chunk, evict="evict_last"), n, chunk,
                                eps, norm, block_m, shift, two_pass)

      def write(j, carry):  # last chunk first: the most recently read, likeliest in L2
        k = pl.cdiv(n, chunk) - 1 - j
        s, cols = load_chunk(k, "evict_first")
        store_y(k, normalized_with(s, cols, n, stats), cols)
        return carry
      chunk_loop(pl.cdiv(n, chunk), write, 0)
    for name, value in zip(("shift", "dmean", "rstd"), stats):
      if value is not None:
        pltriton.store(r[name].at[rows], value, mask=row_mask)
    return 0

  lax.fori_loop(0, rows_per_program // block_m, step, 0)


def forward(x, scale=None, bias=None, *, norm: str, eps: float, zero_centered_scale: bool,
            out_dtype=None, interpret: bool = False):
  """``(y, stats)``: y as :func:`pallas_norm.reference.layer_norm` / ``rms_norm`` (no residual),
  and :class:`pallas_norm.ops.norms.xla.RowStats` in float32, of shape x.shape[:-1].

  No validation: the public ops validate and check ``triton.unsupported_reason`` first.
  """
  n = x.shape[-1]
  lead = x.shape[:-1]
  m = x.size // n
  cfg = pick_config(m, n, interpret, norm)
  rows_per_program, programs = slab_rows(m, cfg)
  # γ and β as given (the kernel widens them to float32 exactly, as XLA's path does): every row
  # block reads them again from L2, so 16-bit vectors halve that traffic (TILINGS). A
  # zero-centered scale's 1 + scale is not exact in its own dtype: float32 then.
  wide = jnp.float32 if cfg.f32_vectors or zero_centered_scale else None
  gamma = xla.applied_scale(scale, zero_centered_scale, wide)
  if bias is not None and wide is not None:
    bias = bias.astype(wide)
  vecs = [v for v in (gamma, bias) if v is not None]
  row = jax.ShapeDtypeStruct((m,), jnp.float32)
  out_shape = ([jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype or x.dtype)), row]
               + [row, row] * (norm == "layer"))
  kernel = functools.partial(_forward_kernel, norm=norm, has_gamma=gamma is not None,
                             has_beta=bias is not None, m=m, n=n, cfg=cfg,
                             rows_per_program=rows_per_program, eps=eps,
                             two_pass=jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16))
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(programs,), interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps),
      name=f"{norm}_norm_forward")(x.reshape(m, n), *vecs)
  y, rstd = outs[0].reshape(x.shape), outs[1].reshape(lead)
  if norm == "rms":
    return y, xla.RowStats(None, None, rstd)
  return y, xla.RowStats(outs[2].reshape(lead), outs[3].reshape(lead), rstd)
