"""The GDPA forward as a Pallas Mosaic-GPU kernel for Hopper (sm_90a).

``o_h = post_scale · act(pre_scale · q_h k_hᵀ) v_h`` per sample and head (DESIGN.md, op 3), no
softmax, keys past a sample's length masked to exactly zero.

Work schedule (built in XLA from the offsets, traced or not, before the launch): one work item
per (segment, head), where a segment is a sample (its q rows and its K/V) or a chunk of the
padding rows past ``q_offsets[-1]`` (no keys: the kernel stores zeros there from one staged
tile, loading nothing; so does a jagged sample with no keys). Items are
ordered by q length, longest first. So the work scales with the real tokens, not with
B · max_seq_len.

The grid is persistent: one CTA per SM walks the items in rounds, round r taking item
``r · CTAs + c`` for CTA c on even rounds and ``r · CTAs + (CTAs - 1 - c)`` on odd ones (a
zig-zag, so with the items longest first every CTA gets a similar sum of lengths). A CTA has
three warpgroups in the layout of JAX's ``attention_mgpu.py``; the ring positions of its
barriers carry across the items, so one item's tail overlaps the next one's start:

* warpgroup 2, the TMA producer: per item, streams the q blocks, ``BLOCK_Q`` rows each, through
  a ring of ``q_stages`` slots per consumer, and loads the *next* item's K and V into the other
  of two SMEM buffers once the current item's first pair of q blocks is issued (they stay
  resident for all of that sample's q blocks; a buffer is reloaded when both consumers have
  released it). With one buffer (``Config.kv_buffers``) the next load follows the item's last q
  block. Mosaic's tiled TMA (the layout WGMMA reads from SMEM) needs GMEM row starts on the
  8-row grid, so a sample's rows are read through a window that starts at the aligned row at or
  before its first row (:data:`ALIGN`); the rows of the window outside the sample belong to
  other samples or to padding and are never stored;
* warpgroups 0 and 1, the consumers, take the q blocks in turn (block i goes to i % 2). Per
  block and per ``block_kv`` keys: S = Q Kᵀ with WGMMA (f32 accumulator), ``act(pre_scale · S)``
  in registers, keys past the sample's length set to 0 with a select, P in q's dtype,
  O += P V with WGMMA; ``post_scale · O`` in the epilogue, whose TMA stores run while the
  consumer starts its next block or item.

The epilogue writes only the rows that belong to the item's segment (a q block may straddle
other samples or the end of the array): the tile goes to SMEM in 128-byte column chunks with the
128-byte swizzle and no 8-row tiling, so a TMA store may start at any row, and leaves by TMA
stores of static power-of-two row counts, one per set bit of the row count (the store ladder of
JAX's ``ragged_dot_mgpu.py``).

Jagged K/V (``kv_offsets``): the K/V window of a sample is loaded as whole ``block_kv``-row
boxes, so its first and last boxes may hold rows of other samples or of the K/V padding, which
may be anything (NaN included). Their scores are masked (``jnp.where`` on the activation); their
V rows are overwritten with zeros in SMEM by consumer 0 before any P·V (0 · NaN would be NaN),
and consumer 1 waits for that.

WGMMA reads P from SMEM, not registers: Pallas's GPU interpret mode has no register-A WGMMA,
and this keeps the path the CPU tests run the one the GPU runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_norm import mgpu, reference
from pallas_norm.mgpu import store
from pallas_norm.ops.gdpa import configs
from pallas_norm.ops.gdpa.configs import BLOCK_Q

_F32 = jnp.float32
_SQRT_HALF = 0.7071067811865476



def _erf(x):
  """erf by Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7, far below the bf16/f16
  rounding of P): Mosaic GPU has no layout rule for math.erf in warpgroup kernels."""
  ax = jnp.abs(x)
  t = 1.0 / (1.0 + 0.3275911 * ax)
  poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t
          + 0.254829592) * t
  y = 1.0 - poly * jnp.exp(-ax * ax)
  return jnp.where(x >= 0, y, -y)


_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


def _fast_gelu(z):
  """jax.nn.gelu(z, approximate=True) = ½ z (1 + tanh(c (z + a z³))) written around z² with
  the constants folded (one multiply or multiply-add per line, 5 operations and the tanh; the
  jax form takes 8): it runs on every score."""
  t = jnp.tanh(z * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * _GELU_CUBIC) * (z * z)))
  return z * (0.5 + 0.5 * t)


KERNEL_ACTIVATIONS = {
    **reference.ACTIVATIONS,
    "fast_gelu": _fast_gelu,
    # Same functions written with what Mosaic GPU lowers: jax.nn.gelu(approximate=False) uses
    # erfc, and jax.nn.relu is a custom_jvp (neither lowers inside a warpgroup kernel).
    "gelu": lambda s: 0.5 * s * (1.0 + _erf(s * _SQRT_HALF)),
    "relu": lambda s: jnp.maximum(s, 0.0),
    "relu2": lambda s: jnp.square(jnp.maximum(s, 0.0)),
}
"""The kernel's elementwise activations: :data:`pallas_norm.reference.ACTIVATIONS`, except where
the jax.nn function does not lower in Mosaic GPU."""
_HEAD_DIMS = (64, 128)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def kv_rows(k, kv_offsets, max_kv_len) -> int:
  """Rows of the K/V window of a (sample, head): dense Lkv; jagged: max_kv_len (default Tkv)
  rows starting up to ``ALIGN - 1`` rows early, rounded up to 64."""
  if kv_offsets is None:
    return k.shape[1]
  return configs.resident_kv_len((max_kv_len or k.shape[0]) + ALIGN - 1)


def operand_reason(q, out_dtype) -> str | None:
  """Why an attention kernel (this one or the fused flash_norm_attention kernel) cannot take
  q's dtype, the output dtype or q's head dim, or None."""
  dtype = jnp.dtype(q.dtype)
  if dtype not in mgpu.SUPPORTED_DTYPES:
    return f"q dtype {dtype.name} is not bfloat16 or float16"
  out_dtype = jnp.dtype(out_dtype or dtype)
  if out_dtype not in _OUT_DTYPES:
    return f"out_dtype {out_dtype.name} is not bfloat16, float16 or float32"
  if q.shape[2] not in _HEAD_DIMS:
    return f"head dim D = {q.shape[2]} is not one of {_HEAD_DIMS}"
  return None


def unsupported_reason(q, k, kv_offsets, max_kv_len, out_dtype) -> str | None:
  """None when the kernel can run these (validated) arguments, else why not."""
  return tiling_or_reason(q, k, kv_offsets, max_kv_len, out_dtype)[1]


def tiling_or_reason(q, k, kv_offsets, max_kv_len, out_dtype):
  """``(config, None)``: the tiling the kernel runs these (validated) arguments with
  (:func:`configs.pick_config`); ``(None, why)`` when it cannot run them. The op asks this once,
  for the dispatch, and hands the config down to :func:`gdpa_fwd`."""
  reason = operand_reason(q, out_dtype)
  if reason is not None:
    return None, reason
  dtype = jnp.dtype(q.dtype)
  out_dtype = jnp.dtype(out_dtype or dtype)
  head_dim = q.shape[2]
  if q.shape[0] == 0:  # a block of 0 rows: the kernel's buffers and TMA windows need >= 1
    return None, "zero token capacity T = 0 (no q rows: XLA returns the empty output)"
  if kv_offsets is None and k.shape[1] == 0:
    return None, "dense K/V length Lkv = 0 (no keys: XLA returns the zeros)"
  if kv_offsets is None and k.shape[1] % 64:
    return None, f"dense K/V length Lkv = {k.shape[1]} is not a multiple of 64"
  if q.shape[0] % ALIGN or (kv_offsets is not None and k.shape[0] % ALIGN):
    return None, (f"the token capacities T = {q.shape[0]}" + ("" if kv_offsets is None else
                  f", Tkv = {k.shape[0]}") + f" must be multiples of {ALIGN} (Mosaic's tiled TMA)")
  cfg = configs.pick_config(kv_rows(k, kv_offsets, max_kv_len), head_dim, dtype, out_dtype)
  if cfg is None:  # f32 out, D 128, > 128 K/V rows
    return None, f"no tiling fits in SMEM with D = {head_dim}"
  return cfg, None


def streams_kv(q, k, kv_offsets, max_kv_len, out_dtype) -> bool:
  """Whether the default tiling streams K/V per q block (the K/V window does not fit in SMEM)
  instead of keeping it resident, for arguments the kernel supports."""
  return tiling_or_reason(q, k, kv_offsets, max_kv_len, out_dtype)[0].kv_stages is not None


ALIGN = 8
"""Row alignment of every TMA window: Mosaic's tiled TMA (WGMMA operands in SMEM) starts at a
multiple of the 8-row tile in GMEM. A sample's q rows and K/V rows are read through windows
that start at the 8-aligned row at or before the sample's first row; ``lo`` says where the
sample starts in its window."""

# Columns of the work-item table.
Q_WIN, Q_LO, Q_HI, Q_BLOCKS, KV_WIN, KV_LO, KV_HI = range(7)


def window(start, end):
  """(8-aligned window start, lo, hi) of rows [start, end); lo = hi = 0 when empty."""
  win = start - start % ALIGN
  empty = end <= start
  return win, jnp.where(empty, 0, start - win), jnp.where(empty, 0, end - win)


def work_items(q_offsets, kv_offsets, capacity: int, kv_capacity: int, num_kv_rows: int):
  """The (items, 7) int32 work table; columns :data:`Q_WIN` ... :data:`KV_HI`.

  Rows: the B samples, longest q first (ties in sample order), then the padding chunks of
  :data:`configs.PAD_CHUNK_BLOCKS` q blocks covering ``[q_offsets[-1], capacity)`` in row
  order, which have no keys (the kernel writes zeros; cheaper than a sample of their length,
  so they come last). Row i < B is a sample: the backward's dense tile order reads it
  (:func:`pallas_norm.ops.gdpa.mosaic_bwd.gdpa_bwd`'s ``work_table``). A
  sample's q rows are ``[Q_WIN + Q_LO, Q_WIN + Q_HI)``, read in ``Q_BLOCKS`` blocks of
  ``BLOCK_Q`` rows from ``Q_WIN``. Dense K/V: ``KV_WIN`` is the sample index, keys
  ``[0, Lkv)``; jagged: keys ``[KV_WIN + KV_LO, KV_WIN + KV_HI)``. Offsets are clamped into
  range, so invalid traced offsets cannot make the kernel touch memory outside its arrays (the
  op poisons such outputs with NaN anyway).
  """
  q_offsets = q_offsets.astype(jnp.int32)
  batch = q_offsets.shape[0] - 1
  chunk = configs.PAD_CHUNK_BLOCKS * BLOCK_Q
  end = jnp.clip(q_offsets[-1], 0, capacity)
  pad_start = jnp.minimum(end + chunk * jnp.arange(-(-capacity // chunk), dtype=jnp.int32),
                          capacity)
  starts = jnp.concatenate([jnp.clip(q_offsets[:-1], 0, capacity), pad_start])
  ends = jnp.concatenate([jnp.clip(q_offsets[1:], 0, capacity),
                          jnp.minimum(pad_start + chunk, capacity)])
  q_win, q_lo, q_hi = window(starts, ends)
  q_blocks = pl.cdiv(q_hi, BLOCK_Q)
  no_keys = jnp.zeros((pad_start.shape[0],), jnp.int32)
  if kv_offsets is None:
    kv_win, kv_lo = jnp.arange(batch, dtype=jnp.int32), jnp.zeros((batch,), jnp.int32)
    kv_hi = jnp.full((batch,), num_kv_rows, jnp.int32)
  else:
    kv_offsets = jnp.clip(kv_offsets.astype(jnp.int32), 0, kv_capacity)
    kv_end = jnp.clip(kv_offsets[1:], kv_offsets[:-1], kv_offsets[:-1] + num_kv_rows - ALIGN + 1)
    kv_win, kv_lo, kv_hi = window(kv_offsets[:-1], kv_end)
  kv = [jnp.concatenate([col, no_keys]) for col in (kv_win, kv_lo, kv_hi)]
  table = jnp.stack([q_win, q_lo, q_hi, q_blocks, *kv], axis=1)
  samples = sort_rows_descending(table[:batch], (q_hi - q_lo)[:batch])
  return jnp.concatenate([samples, table[batch:]])


RANK_BY_COMPARISON_MAX = 4096
"""Most rows that :func:`sort_rows_descending` orders by comparing all pairs of keys (fusions
over N² pairs, N² ≤ 16.8M); above it, a sort."""


def cumsum_small(values):
  """Inclusive cumulative sum of a short int32 vector (N,), as one fusion over the N² pairs
  where N ≤ :data:`RANK_BY_COMPARISON_MAX` (XLA's cumulative sum is a reduce-window of several
  small kernels on the GPU), else ``jnp.cumsum``."""
  n = values.shape[0]
  if n > RANK_BY_COMPARISON_MAX:
    return jnp.cumsum(values, dtype=jnp.int32)
  index = jnp.arange(n, dtype=jnp.int32)
  return jnp.sum(jnp.where(index[None, :] <= index[:, None], values[None, :], 0), axis=1,
                 dtype=jnp.int32)


def count_at_most(sorted_values, points):
  """For each of ``points`` (M,), the count of ``sorted_values`` (N,) (ascending) that are
  ≤ it: one fusion over the M·N pairs where N ≤ :data:`RANK_BY_COMPARISON_MAX`, else a binary
  search."""
  if sorted_values.shape[0] > RANK_BY_COMPARISON_MAX:
    return jnp.searchsorted(sorted_values, points, side="right").astype(jnp.int32)
  return jnp.sum(sorted_values[None, :] <= points[:, None], axis=1, dtype=jnp.int32)


def sort_rows_descending(table, keys):
  """``table[argsort(-keys, stable=True)]``: the rows of a small table (N,) or (N, C), largest
  key first, ties in index order.

  For the work tables (a few thousand rows at most) without a sort: XLA's sort of ~800 keys is
  several small kernels on the GPU. Instead each row's rank is the count of the keys ahead of
  it (one fusion over the pairs), the order a sum over the one-hot (position, row) pairs (one
  fusion), and the table gathered in that order. (A one-hot sum over (position, row, column)
  in place of the gather was itself a slow kernel: XLA reduces the middle of three axes poorly;
  ``benchmarks/EXPERIMENTS.md``, GDPA forward.)"""
  n = keys.shape[0]
  if n > RANK_BY_COMPARISON_MAX:
    return table[jnp.argsort(-keys, stable=True)]
  index = jnp.arange(n, dtype=jnp.int32)
  mine, other = keys[:, None], keys[None, :]
  ahead = (other > mine) | ((other == mine) & (index[None, :] < index[:, None]))
  rank = jnp.sum(ahead, axis=1, dtype=jnp.int32)
  order = jnp.sum(jnp.where(rank[None, :] == index[:, None], index[None, :], 0), axis=1,
                  dtype=jnp.int32)  # [position] -> source row
  return table[order]


def gdpa_fwd(q, k, v, q_offsets, kv_offsets, pre_scale, post_scale, *, activation: str,
             max_kv_len: int | None, out_dtype=None, config: configs.Config | None = None,
             work_table=None, interpret: bool = False):
  """GDPA forward by the kernel (arguments validated by the op; see :func:`unsupported_reason`).

  Args:
    q: (T, H, D) bf16/f16 packed queries; k, v: dense (B, Lkv, H, D) or packed (Tkv, H, D).
    q_offsets, kv_offsets: int32 (B+1,) offsets (kv_offsets None for dense K/V).
    pre_scale, post_scale: f32 scalars (0-d arrays, traced or not).
    activation: a key of :data:`pallas_norm.reference.ACTIVATIONS`.
    max_kv_len: static bound on jagged K/V lengths (default Tkv).
    out_dtype: bf16, f16 or f32 (default q's dtype).
    config: tiling (the op hands down :func:`tiling_or_reason`'s; default
      :func:`configs.pick_config`).
    work_table: :func:`work_items` of these arguments, if the caller built it (the op keeps
      it for the backward); default: built here.
    interpret: run in Pallas GPU interpret mode (any backend).

  Returns:
    (T, H, D) in out_dtype; rows past ``q_offsets[-1]`` are zeros.

  Raises:
    ValueError: a ``config`` whose block_kv does not divide the K/V window.
  """
  capacity, num_heads, head_dim = q.shape
  out_dtype = jnp.dtype(out_dtype or q.dtype)
  rows = kv_rows(k, kv_offsets, max_kv_len)
  cfg = config or configs.pick_config(rows, head_dim, q.dtype, out_dtype)
  if rows % cfg.block_kv:
    raise ValueError(f"block_kv = {cfg.block_kv} does not divide the K/V window of {rows} rows")
  table = (work_items(q_offsets, kv_offsets, capacity, k.shape[0], rows) if work_table is None
           else work_table)
  num_items = table.shape[0] * num_heads
  num_ctas = max(1, min(mgpu.num_sms(interpret), num_items))
  plan = Plan(num_heads=num_heads, num_segments=table.shape[0], num_ctas=num_ctas,
              rounds=-(-num_items // num_ctas), block_kv=cfg.block_kv, q_stages=cfg.q_stages,
              kv_stages=cfg.kv_stages, kv_buffers=cfg.kv_buffers,
              kv_chunks=rows // cfg.block_kv, jagged_kv=kv_offsets is not None,
              act=KERNEL_ACTIVATIONS[activation])
  scales = jnp.stack([jnp.asarray(pre_scale, _F32), jnp.asarray(post_scale, _F32)])
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=jax.ShapeDtypeStruct((capacity, num_heads, head_dim), out_dtype),
      grid=(num_ctas,),
      grid_names=("cta",),
      num_threads=3,
      thread_name="wg",
      scratch_types=scratch(plan, head_dim, q.dtype, out_dtype),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=mgpu.interpret_params() if interpret else None,
  )
  return call(table, scales, q, k, v)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static facts of one kernel build. ``num_ctas`` persistent CTAs walk the
  ``num_segments · num_heads`` work items in ``rounds`` rounds. ``kv_stages`` None: a (sample,
  head)'s K/V are resident in ``kv_chunks`` blocks of ``block_kv`` rows, in one of
  ``kv_buffers`` buffers; else they stream per q block through a ring of that many slots per
  consumer."""

  num_heads: int
  num_segments: int
  num_ctas: int
  rounds: int
  block_kv: int
  q_stages: int
  kv_stages: int | None
  kv_buffers: int
  kv_chunks: int
  jagged_kv: bool
  act: Callable


def scratch(plan: Plan, head_dim: int, dtype, out_dtype) -> dict:
  transforms = mgpu.swizzle_transforms(head_dim, dtype)
  if plan.kv_stages is None:
    kv_shape = (plan.kv_buffers, plan.kv_chunks)
    kv_free = plgpu.Barrier(num_arrivals=2, num_barriers=plan.kv_buffers)  # both consumers
  else:
    kv_shape = (2, plan.kv_stages)
    kv_free = plgpu.Barrier(num_barriers=2 * plan.kv_stages)
  kv_smem = lambda: plgpu.SMEM(kv_shape + (plan.block_kv, head_dim), dtype,  # noqa: E731
                               transforms=transforms)
  kv_barriers = kv_shape[0] * kv_shape[1]
  return dict(
      q_smem=plgpu.SMEM((2, plan.q_stages, BLOCK_Q, head_dim), dtype, transforms=transforms),
      k_smem=kv_smem(),
      v_smem=kv_smem(),
      p_smem=plgpu.SMEM((2, BLOCK_Q, plan.block_kv), dtype,
                        transforms=mgpu.swizzle_transforms(plan.block_kv, dtype)),
      o_smem=store.row_store_smem(BLOCK_Q, head_dim, out_dtype, count=2),
      q_ready=plgpu.Barrier(num_barriers=2 * plan.q_stages),
      q_free=plgpu.Barrier(num_barriers=2 * plan.q_stages),
      k_ready=plgpu.Barrier(num_barriers=kv_barriers),
      v_ready=plgpu.Barrier(num_barriers=kv_barriers),
      kv_free=kv_free,
      # One per K/V buffer: with two, consumer 0 may zero (and arrive for) the next item's
      # buffer before consumer 1 has waited for this item's, which one barrier cannot tell apart.
      v_edges_zeroed=plgpu.Barrier(num_barriers=max(1, plan.kv_buffers)),
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Item:
  """A work item, read from the table: a segment's rows and keys, and the head. Past the last
  item (the final round of some CTAs) every count is 0. ``q_blocks`` counts the q blocks that
  attend (the item has keys); ``zero_blocks`` those of an item without keys (a padding chunk, a
  jagged sample with no keys), whose rows get 0·post_scale: nothing is loaded for them."""

  head: jax.Array
  q_win: jax.Array
  q_lo: jax.Array
  q_hi: jax.Array
  q_blocks: jax.Array
  zero_blocks: jax.Array
  kv_win: jax.Array
  kv_lo: jax.Array
  kv_hi: jax.Array
  kv_steps: jax.Array

  @classmethod
  def read(cls, table_ref, plan: Plan, round_):
    """The item of this CTA in round ``round_``: rounds alternate direction over the CTAs
    (zig-zag), so with the items sorted longest first every CTA gets a similar sum."""
    cta = lax.axis_index("cta")
    column = jnp.where(lax.rem(round_, 2) == 0, cta, plan.num_ctas - 1 - cta)
    index = round_ * plan.num_ctas + column
    valid = index < plan.num_segments * plan.num_heads
    segment = jnp.minimum(lax.div(index, plan.num_heads), plan.num_segments - 1)
    col = lambda c: table_ref[segment, c]  # noqa: E731
    blocks = jnp.where(valid, col(Q_BLOCKS), 0)
    kv_steps = pl.cdiv(col(KV_HI), plan.block_kv)
    return cls(head=lax.rem(index, plan.num_heads), q_win=pl.multiple_of(col(Q_WIN), ALIGN),
               q_lo=col(Q_LO), q_hi=col(Q_HI), q_blocks=jnp.where(kv_steps > 0, blocks, 0),
               zero_blocks=jnp.where(kv_steps > 0, 0, blocks), kv_win=col(KV_WIN),
               kv_lo=col(KV_LO), kv_hi=col(KV_HI), kv_steps=kv_steps)

  def blocks_of(self, wg):
    """q blocks of consumer ``wg``: blocks wg, wg + 2, ... (its turns)."""
    return lax.div(self.q_blocks - wg + 1, 2)

  def zero_blocks_of(self, wg):
    """Blocks of zeros of consumer ``wg`` (an item without keys): blocks wg, wg + 2, ..."""
    return lax.div(self.zero_blocks - wg + 1, 2)

  @property
  def loads_kv(self):
    """Whether the item has q blocks that attend (``q_blocks`` counts only items with keys;
    else no K/V load)."""
    return self.q_blocks > 0


def _kernel(table_ref, scales_ref, q_ref, k_ref, v_ref, o_ref, *, plan: Plan, **smem):
  item_at = functools.partial(Item.read, table_ref, plan)
  kv = kv_pipeline(plan, k_ref, v_ref, smem)
  mgpu.warp_specialize(
      lambda: producer(plan, item_at, kv, q_ref, smem),
      lambda: consumer(plan, item_at, kv, scales_ref,
                       functools.partial(OutputStore, o_ref, smem["o_smem"]), smem))


def kv_pipeline(plan: Plan, k_ref, v_ref, smem):
  """The K/V loads and waits of the plan: resident (:class:`_ResidentKV`) or streamed."""
  return (_ResidentKV if plan.kv_stages is None else _StreamedKV)(plan, k_ref, v_ref, smem)


def zero_tile(cols: int, post_scale, dtype):
  """A (BLOCK_Q, ``cols``) register tile of 0·post_scale in ``dtype`` (WGMMA layout): the rows
  of an item without keys (NaN where the op poisoned the scales)."""
  zero = plgpu.layout_cast(jnp.zeros((BLOCK_Q, cols), _F32), plgpu.Layout.WGMMA)
  return (zero * post_scale).astype(dtype)


def block_rows(item: Item, block):
  """(first GMEM row of q block ``block`` of the item, the segment's rows in it as
  [lo, lo + count)): what an epilogue may store."""
  lo = jnp.maximum(item.q_lo - block * BLOCK_Q, 0)
  hi = jnp.minimum(item.q_hi - block * BLOCK_Q, BLOCK_Q)
  return item.q_win + block * BLOCK_Q, lo, hi - lo


class OutputStore:
  """The GDPA consumer's block epilogue: post · O of the segment's rows, stored row-exactly
  through the consumer's tile of ``o_smem`` (:func:`pallas_norm.mgpu.store.store_rows`).

  The hooks a :func:`consumer` calls, which a fused kernel may replace (the flash_norm_attention
  kernel normalizes q before the attention and O after it): ``before_attention(item, block,
  q_tile, wg, count)`` once the q block is in SMEM (its result is handed to the next hook),
  ``after_attention(item, block, o, before, wg, count)`` with O (f32, not yet scaled) once its
  WGMMAs are done, ``without_keys(item, wg)`` for an item without keys (its ``zero_blocks``:
  no q load, no attention, no other hook), ``finish(wg, count)`` after the last block;
  ``count`` is the number of q blocks with keys the warpgroup ran before (``finish``: in
  all)."""

  def __init__(self, o_ref, o_smem, post_scale):
    self.o_ref, self.o_smem, self.post_scale = o_ref, o_smem, post_scale

  def before_attention(self, item, block, q_tile, wg, count):
    del item, block, q_tile, wg, count

  def after_attention(self, item, block, o, before, wg, count):
    del before, count
    store.store_rows((o * self.post_scale).astype(self.o_smem.dtype), self.o_smem.at[wg],
                     lambda rows, cols: self.o_ref.at[rows, item.head, cols],
                     *block_rows(item, block))

  def without_keys(self, item, wg):
    """The rows of consumer ``wg``'s blocks of an item without keys: 0·post_scale (NaN where
    the op poisoned the scales), from one staged tile, with no q load or attention."""
    tile = self.o_smem.at[wg]
    store.stage(zero_tile(tile.shape[0] * tile.shape[2], self.post_scale, tile.dtype), tile)

    @pl.loop(0, item.zero_blocks_of(wg))
    def _(turn):
      store.copy_rows(tile, lambda rows, cols: self.o_ref.at[rows, item.head, cols],
                      *block_rows(item, wg + 2 * turn))

  def finish(self, wg, count):
    del wg, count
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads


def producer(plan: Plan, item_at, kv, q_ref, smem) -> None:
  """TMA warpgroup, round by round: the q blocks of the item in pairs (block 2t + wg goes to
  consumer wg, through its own ring of ``q_stages`` slots) and K/V (the next item's resident
  K/V once the first pair is issued, or each pair's streamed blocks). Ring positions carry
  across the items."""
  q_smem, q_ready, q_free = smem["q_smem"], smem["q_ready"], smem["q_free"]

  def round_(r, carry):
    q_uses, kv_uses, item = carry
    upcoming = item_at(r + 1)

    @pl.loop(0, item.blocks_of(0))
    def _pair(turn):
      for wg in range(2):
        @pl.when(2 * turn + wg < item.q_blocks)
        def _(wg=wg):
          use = q_uses[wg] + turn
          slot = wg * plan.q_stages + lax.rem(use, plan.q_stages)

          @pl.when(use >= plan.q_stages)
          def _():
            plgpu.barrier_wait(q_free.at[slot])

          rows = pl.ds(pl.multiple_of(item.q_win + (2 * turn + wg) * BLOCK_Q, ALIGN), BLOCK_Q)
          plgpu.copy_gmem_to_smem(q_ref.at[rows, item.head],
                                  q_smem.at[wg, lax.rem(use, plan.q_stages)], q_ready.at[slot])
      kv.produce_pair(item, turn, kv_uses)
      kv.prefetch_after_first_pair(upcoming, turn, kv_uses)

    kv.prefetch_after_item(item, upcoming, kv_uses)
    q_uses = tuple(q_uses[wg] + item.blocks_of(wg) for wg in range(2))
    return q_uses, kv.producer_uses_after(item, upcoming, kv_uses), upcoming

  zero, first = jnp.int32(0), item_at(0)
  q_uses, kv_uses, _ = pl.loop(0, plan.rounds, init_carry=(
      (zero, zero), kv.producer_start(first), first))(round_)
  # Observe the releases no load waited for (the last use of each slot), so that every barrier
  # phase is consumed before the CTA ends (the interpreter checks it).
  for wg in range(2):
    _drain_ring(q_free, wg * plan.q_stages, plan.q_stages, q_uses[wg])
  kv.drain(kv_uses)


def _drain_ring(free, first: int, stages: int, uses) -> None:
  """Waits for the last ``min(stages, uses)`` releases of the ring ``free[first:first +
  stages]``."""
  @pl.loop(jnp.maximum(uses - stages, 0), uses)
  def _(use):
    plgpu.barrier_wait(free.at[first + lax.rem(use, stages)])


def consumer(plan: Plan, item_at, kv, scales_ref, epilogue_for, smem) -> None:
  """WGMMA warpgroup ``wg``, round by round: its q blocks of the item, each Σ_k act(pre·Q Kᵀ) V
  between the hooks of ``epilogue_for(post_scale)`` (:class:`OutputStore`: post · O stored).
  The store of an item's last block overlaps the next item's start."""
  wg = lax.axis_index("wg")
  q_smem, q_ready, q_free = smem["q_smem"], smem["q_ready"], smem["q_free"]
  pre_scale, post_scale = scales_ref[0], scales_ref[1]
  epilogue = epilogue_for(post_scale)

  def round_(r, carry):
    q_use, kv_use, item = carry
    upcoming = item_at(r + 1)  # read now: the table's latency hides behind this item
    blocks = item.blocks_of(wg)
    kv.acquire(item, wg, kv_use)

    @pl.loop(0, blocks)
    def _block(turn):
      i = wg + 2 * turn
      slot = lax.rem(q_use + turn, plan.q_stages)
      plgpu.barrier_wait(q_ready.at[wg * plan.q_stages + slot])
      before = epilogue.before_attention(item, i, q_smem.at[wg, slot], wg, q_use + turn)
      out = _attend(plan, item, kv, wg, kv_use, turn, (q_smem.at[wg], slot), smem["p_smem"],
                    pre_scale, functools.partial(plgpu.barrier_arrive,
                                                 q_free.at[wg * plan.q_stages + slot]))

      @pl.when(turn == blocks - 1)
      def _():
        kv.release_item(item, kv_use)

      epilogue.after_attention(item, i, out, before, wg, q_use + turn)

    @pl.when(blocks == 0)
    def _():
      kv.release_item(item, kv_use)

    @pl.when(item.zero_blocks_of(wg) > 0)
    def _():
      epilogue.without_keys(item, wg)

    return q_use + blocks, kv.consumer_use_after(item, wg, kv_use), upcoming

  zero = jnp.int32(0)
  q_uses, _, _ = pl.loop(0, plan.rounds, init_carry=(zero, zero, item_at(0)))(round_)
  epilogue.finish(wg, q_uses)


def _attend(plan: Plan, item: Item, kv, wg, kv_use, turn, q_slot, p_smem, pre_scale,
            release_q):
  """Σ over the key blocks of act(pre_scale · Q Kᵀ) V for one q block of an item with keys
  (``kv_steps`` ≥ 1; items without keys never load q: :meth:`OutputStore.without_keys`):
  (BLOCK_Q, D) f32.
  ``q_slot``: (the consumer's q ring (stages, BLOCK_Q, D), the block's slot in it); ``p_smem``:
  both consumers' P tiles. Calls ``release_q()`` once the q tile is no longer read (after the
  last score WGMMA), so the producer can load the consumer's next q block during the activation
  and P·V."""
  q_ring, slot = q_slot

  def accumulate(o_acc):
    @pl.loop(0, item.kv_steps)
    def _step(step):
      zero = mgpu.opaque_zero(step)
      q_tile, p_tile = q_ring.at[slot + zero], p_smem.at[wg + zero]
      k_tile, v_tile = kv.tiles(item, wg, kv_use, turn, step)

      def scores(s_acc):
        plgpu.wgmma(s_acc, q_tile, k_tile.transpose((1, 0)))
        return s_acc[...]  # waits for this WGMMA (and the previous step's P·V)

      s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, plan.block_kv), _F32))
      pl.when(step == item.kv_steps - 1)(release_q)
      p = plan.act(s * pre_scale)
      if plan.jagged_kv:  # keys outside the sample: exactly 0, whatever act(s) is there
        key = plgpu.broadcasted_iota(jnp.int32, p.shape, 1,
                                     layout=plgpu.Layout.WGMMA) + step * plan.block_kv
        p = jnp.where((key >= item.kv_lo) & (key < item.kv_hi), p, 0.0)
      # P goes through SMEM: the previous step's P·V has finished reading it (the score read
      # above waited for every WGMMA in flight). Interpret mode has no register-A WGMMA.
      p_tile[...] = p.astype(p_tile.dtype)
      plgpu.commit_smem()
      plgpu.wgmma(o_acc, p_tile, v_tile)
      kv.release(item, wg, kv_use, turn, step)

    return o_acc[...]

  return pl.run_scoped(accumulate, plgpu.ACC((BLOCK_Q, q_ring.shape[-1]), _F32))


def _kv_block(plan: Plan, item: Item, ref, step):
  """The GMEM box of key block ``step`` of the item's K/V window."""
  if plan.jagged_kv:
    rows = pl.ds(pl.multiple_of(item.kv_win + step * plan.block_kv, ALIGN), plan.block_kv)
    return ref.at[rows, item.head]
  return ref.at[item.kv_win, pl.ds(step * plan.block_kv, plan.block_kv), item.head]


def zero_rows_outside(tile, first_row, lo, hi) -> None:
  """Zeroes the rows of an SMEM ``tile`` (rows, cols) whose index ``first_row + i`` is not in
  [lo, hi): rows of other samples or of the padding in a block a WGMMA multiplies by a masked
  (zero) operand, which may be NaN, and 0 · NaN = NaN. A load, a select and a store of the tile
  by one warpgroup; the caller commits (``plgpu.commit_smem``) before a WGMMA reads it."""
  rows = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=plgpu.Layout.WGMMA) + first_row
  values = plgpu.load(tile, layout=plgpu.Layout.WGMMA)
  tile[...] = jnp.where((rows >= lo) & (rows < hi), values, jnp.zeros_like(values))


def _zero_v_rows_outside(plan: Plan, item: Item, tile, step) -> None:
  """Zeroes the rows of V block ``step`` that are not the sample's keys [kv_lo, kv_hi)."""
  zero_rows_outside(tile, step * plan.block_kv, item.kv_lo, item.kv_hi)


class _ResidentKV:
  """K/V of an item loaded once into ``kv_chunks`` blocks of one of ``kv_buffers`` buffers and
  kept for all its q blocks. With two buffers the producer loads the next item's K/V while the
  consumers run the current one. The position ("use") of an item's buffer is the count of
  K/V-loading items before it; the buffer is freed when both consumers are done with it (one
  arrival each, also from a consumer without q blocks in the item, which still waits for the
  load so that it cannot arrive twice on one phase). Jagged: consumer 0 zeroes the V rows
  outside the sample in the first and last blocks, consumer 1 waits for it."""

  def __init__(self, plan, k_ref, v_ref, smem):
    self.plan, self.k_ref, self.v_ref, self.smem = plan, k_ref, v_ref, smem

  def _barrier(self, use, step):
    return lax.rem(use, self.plan.kv_buffers) * self.plan.kv_chunks + step

  def _load(self, item, use):
    """Loads ``item``'s K/V (if it has any) into buffer ``use``; returns the next use."""
    plan, smem = self.plan, self.smem
    buffer = lax.rem(use, plan.kv_buffers)

    @pl.when(item.loads_kv)
    def _():
      @pl.when(use >= plan.kv_buffers)
      def _():
        plgpu.barrier_wait(smem["kv_free"].at[buffer])

      for step in range(plan.kv_chunks):  # static: the resident K/V, only the item's blocks
        @pl.when(step < item.kv_steps)
        def _(step=step):
          for ref, name in ((self.k_ref, "k"), (self.v_ref, "v")):
            plgpu.copy_gmem_to_smem(_kv_block(plan, item, ref, step),
                                    smem[f"{name}_smem"].at[buffer, step],
                                    smem[f"{name}_ready"].at[self._barrier(use, step)])

    return use + item.loads_kv.astype(jnp.int32)

  def producer_start(self, first):
    """The first item's K/V; returns the producer's use count (loads issued)."""
    return self._load(first, jnp.int32(0))

  def produce_pair(self, item, turn, uses):
    del item, turn, uses

  def prefetch_after_first_pair(self, upcoming, turn, uses):
    if self.plan.kv_buffers == 2:
      @pl.when(turn == 0)
      def _():
        self._load(upcoming, uses)

  def prefetch_after_item(self, item, upcoming, uses):
    # One buffer: the next load waits for this item's release, so it must follow all of its
    # q loads. Two: when the item had no pair, the load is still due.
    if self.plan.kv_buffers == 1:
      self._load(upcoming, uses)
    else:
      @pl.when(item.q_blocks == 0)
      def _():
        self._load(upcoming, uses)

  def producer_uses_after(self, item, upcoming, uses):
    del item
    return uses + upcoming.loads_kv.astype(jnp.int32)

  def drain(self, uses):
    _drain_ring(self.smem["kv_free"], 0, self.plan.kv_buffers, uses)

  def acquire(self, item, wg, use):
    plan, smem = self.plan, self.smem

    @pl.when(item.loads_kv)
    def _():
      for step in range(plan.kv_chunks):
        @pl.when(step < item.kv_steps)
        def _(step=step):
          plgpu.barrier_wait(smem["k_ready"].at[self._barrier(use, step)])
          plgpu.barrier_wait(smem["v_ready"].at[self._barrier(use, step)])
      if plan.jagged_kv:
        self._zero_v_edges(item, wg, lax.rem(use, plan.kv_buffers))

  def _zero_v_edges(self, item, wg, buffer):
    plan, smem = self.plan, self.smem

    @pl.when(wg == 0)
    def _zero():
      last = item.kv_steps - 1
      _zero_v_rows_outside(plan, item, smem["v_smem"].at[buffer, 0], 0)

      @pl.when(last > 0)
      def _():
        _zero_v_rows_outside(plan, item, smem["v_smem"].at[buffer, last], last)
      plgpu.commit_smem()  # the generic-proxy writes, before WGMMA (async proxy) reads them
      plgpu.barrier_arrive(smem["v_edges_zeroed"].at[buffer])

    @pl.when(wg == 1)
    def _wait():
      plgpu.barrier_wait(smem["v_edges_zeroed"].at[buffer])

  def tiles(self, item, wg, use, turn, step):
    del item, wg, turn
    buffer = lax.rem(use, self.plan.kv_buffers)
    return self.smem["k_smem"].at[buffer, step], self.smem["v_smem"].at[buffer, step]

  def release(self, item, wg, use, turn, step):
    del item, wg, use, turn, step

  def release_item(self, item, use):
    """A consumer is done with the item's K/V (its WGMMAs have completed)."""
    @pl.when(item.loads_kv)
    def _():
      plgpu.barrier_arrive(self.smem["kv_free"].at[lax.rem(use, self.plan.kv_buffers)])

  def consumer_use_after(self, item, wg, use):
    del wg
    return use + item.loads_kv.astype(jnp.int32)


class _StreamedKV:
  """K/V streamed per q block: each consumer has a ring of ``kv_stages`` slots that the
  producer fills with key blocks 0..kv_steps-1 of each of its q blocks, the two consumers'
  blocks of a pair interleaved; the ring positions ("uses", one per consumer) carry across the
  items. A consumer zeroes the V rows outside the sample in its own first and last block, and
  releases a slot once its P·V has read it."""

  def __init__(self, plan, k_ref, v_ref, smem):
    self.plan, self.k_ref, self.v_ref, self.smem = plan, k_ref, v_ref, smem

  def _slot(self, wg, use):
    return wg * self.plan.kv_stages + lax.rem(use, self.plan.kv_stages)

  def producer_start(self, first):
    del first
    return (jnp.int32(0), jnp.int32(0))

  def produce_pair(self, item, turn, uses):
    plan, smem = self.plan, self.smem

    @pl.loop(0, item.kv_steps)
    def _step(step):
      for wg in range(2):
        @pl.when(2 * turn + wg < item.q_blocks)
        def _(wg=wg):
          use = uses[wg] + turn * item.kv_steps + step
          slot = self._slot(wg, use)

          @pl.when(use >= plan.kv_stages)
          def _():
            plgpu.barrier_wait(smem["kv_free"].at[slot])

          local = lax.rem(use, plan.kv_stages)
          for ref, name in ((self.k_ref, "k"), (self.v_ref, "v")):
            plgpu.copy_gmem_to_smem(_kv_block(plan, item, ref, step),
                                    smem[f"{name}_smem"].at[wg, local],
                                    smem[f"{name}_ready"].at[slot])

  def prefetch_after_first_pair(self, upcoming, turn, uses):
    del upcoming, turn, uses

  def prefetch_after_item(self, item, upcoming, uses):
    del item, upcoming, uses

  def producer_uses_after(self, item, upcoming, uses):
    del upcoming
    return tuple(self.consumer_use_after(item, wg, uses[wg]) for wg in range(2))

  def drain(self, uses):
    for wg in range(2):
      _drain_ring(self.smem["kv_free"], wg * self.plan.kv_stages, self.plan.kv_stages, uses[wg])

  def acquire(self, item, wg, use):
    del item, wg, use

  def tiles(self, item, wg, use, turn, step):
    plan, smem = self.plan, self.smem
    use = use + turn * item.kv_steps + step
    slot, local = self._slot(wg, use), lax.rem(use, plan.kv_stages)
    plgpu.barrier_wait(smem["k_ready"].at[slot])
    plgpu.barrier_wait(smem["v_ready"].at[slot])
    v_tile = smem["v_smem"].at[wg, local]
    if plan.jagged_kv:
      @pl.when((step == 0) | (step == item.kv_steps - 1))
      def _():
        _zero_v_rows_outside(plan, item, v_tile, step)
        plgpu.commit_smem()  # the generic-proxy writes, before WGMMA (async proxy) reads them
    return smem["k_smem"].at[wg, local], v_tile

  def release(self, item, wg, use, turn, step):
    plgpu.wgmma_wait(0)  # the P·V reading the slot is done
    use = use + turn * item.kv_steps + step
    plgpu.barrier_arrive(self.smem["kv_free"].at[self._slot(wg, use)])

  def release_item(self, item, use):
    del item, use

  def consumer_use_after(self, item, wg, use):
    return use + item.blocks_of(wg) * item.kv_steps
