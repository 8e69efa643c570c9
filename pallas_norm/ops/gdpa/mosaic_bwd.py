"""Backward of jagged GDPA as Pallas Mosaic-GPU kernels (Hopper, sm_90a).

The math (DESIGN.md, op 3; oracle: ``jax.vjp`` of :func:`pallas_norm.reference.gdpa`): per
sample b and head h, with ``Su = q kᵀ`` (the unscaled scores), ``S = pre·Su``, ``A = act(S)``
(keys past the sample's KV length masked to exactly 0), ``o = post·A v``, and a cotangent dO:

* ``dV = post·Aᵀ dO``; ``dAu = dO vᵀ`` (so ``dA = post·dAu``); ``dS = dA ⊙ act'(S)``;
* ``dQ = pre·dS k``, ``dK = pre·dSᵀ q`` (scores recomputed: no softmax, no row statistics);
* ``d post = Σ A ⊙ dAu`` (= Σ o_unscaled ⊙ dO) and ``d pre = Σ dS ⊙ Su``.

Deterministic kernels (no atomics) in the shape of JAX's ``pallas/ops/gpu/attention_mgpu.py``
backward (one TMA producer warpgroup, two WGMMA consumer warpgroups, a ring of SMEM stages):

* **dK/dV** (:func:`_dkv_kernel`): an item is a kv tile of 128 rows of one head (64 per consumer
  warpgroup, K and V resident in SMEM); its consumers loop over the q blocks (64 packed rows)
  of the samples that own those kv rows, accumulating dKᵀ-side products in registers
  (``Sᵀ = K Qᵀ``, ``dAuᵀ = V dOᵀ``, ``dV += Aᵀ dO``, ``dK += dSᵀ Q``). Dense k/v: one tile per
  (sample, tile of Lkv); jagged k/v: the packed rows are cut into aligned tiles and a tile loops
  over every sample it overlaps. The scale gradients' sums come from the same accumulators,
  once per item (:func:`_scale_grad_rows`).
  The grid is persistent, as the forward's: one CTA per SM walks the items (most q blocks
  first) in zig-zag rounds; the ring's steps count across a CTA's items, so the producer loads
  the next item's first q/dO blocks during the current item's last steps, and its K/V as soon
  as both consumers release theirs at the start of their epilogues (dK and dV leave through
  the consumers' operand tiles, not through the K/V tiles).
* **dQ fused** (:func:`_fused_dq`), for dense k/v with Lkv ≤ 128 and D = 128 (the Kunlun PFFN
  shape): the dK/dV CTA of a (sample, head) holds every kv row, so dQ of a q block = dS K is
  complete there: both consumers put their dSᵀ tile in SMEM (for their dK WGMMA anyway);
  consumer 0 hands its tile over through a barrier and goes on, consumer 1 computes and stores
  all of dQ's columns for the sample's rows (so the consumers do not meet every step). The
  producer warpgroup writes dq's padding rows (no item owns them), a share per CTA spread over
  its rounds, by TMA stores of one SMEM tile holding the padding value.
* **dQ** (:func:`_dq_kernel`) otherwise: a CTA owns an aligned block of 128 packed q rows of one
  head (64 per consumer) and loops over the kv blocks (64 rows) of every sample with q rows in
  the block, into an accumulator of that sample's own, of which it stores the sample's rows.
  Each dq row is written once; rows of no sample (padding) are written as 0 · pre · post
  (zeros; NaN when the op poisoned the scales, as the forward's 0 · post_scale).

Mosaic's tiled TMA, which the swizzled WGMMA operands need, addresses rows in groups of 8, so
a block's first row must be a multiple of 8. The dK/dV loop reads a sample's q rows [lo, hi) in
blocks of 64 from lo rounded down to 8 (``_q_window``, as the forward's windows; rounding to 64
costs ~9% more q-block steps at lengths uniform on [1, 512]); the kv tiles and the dQ kernel's
blocks are aligned to their size (block i covers packed rows [64·i, 64·i + 64)). Rows of a
block that belong to another sample are masked out of every product with selects. A select
cannot stop ``0 · NaN`` inside a WGMMA, so a non-finite K or V token must not meet another
sample's rows in a product: the q blocks that reach past the last offset (padding rows, never
data) are read from a small zero-padded copy that the wrapper gathers (``_q_tail``; for packed
k, ``k_tail``); the dQ kernel zeroes packed K's rows outside the sample in SMEM before dS·K,
and keeps one accumulator per sample (dS's zero rows of the other samples times a NaN key fill
those rows with NaN, which are never stored). Not so for q and dO: a non-finite q or dO token
of one sample turns NaN the dK/dV of every kv tile that a q block holding its row is
multiplied with (the dK/dV loop's products Aᵀ dO and dSᵀ Q, whose masked zeros times the NaN
row fill the tile's whole accumulator): dense k/v, the tiles of the samples whose q blocks
include the row (the up to 7 rows before a sample's first and the up to 63 after its last);
packed k/v, also every other sample's rows and the padding rows in those 128-row tiles
(samples without queries included). With fused dQ and ``add_do_to_dq`` (dO added by a
WGMMA, :attr:`_Plan.prescaled_ds`) a non-finite dO row also turns NaN the dq rows of its
whole q block, up to 7 rows of the sample before and 63 after. Always as a NaN, never a
silently wrong value.

Work scales with Σ lengths (plus one partial block per sample and kv tile), not with the
capacity T, except for writing dq's padding rows. The dK/dV items run longest first, dealt
to the CTAs in zig-zag rounds, so the CTAs' sums of q blocks stay close.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm import mgpu, reference
from pallas_norm.mgpu.store import row_store_smem, store_rows
from pallas_norm.ops.gdpa.mosaic import (KV_WIN, sort_rows_descending, work_items,
                                         zero_rows_outside)

__all__ = ["gdpa_bwd", "unsupported_reason", "act_and_grad", "BLOCK"]

BLOCK = 64
"""Rows of one WGMMA tile of a consumer warpgroup: a q block of the dK/dV loop, a kv block of
the dQ loop, and each consumer's share of a CTA's kv tile (dK/dV) or q block (dQ)."""

TILE = 2 * BLOCK
"""Rows a CTA owns: kv rows in the dK/dV kernel, q rows in the dQ kernel (two consumers)."""

STAGES = 2
"""SMEM stages of each kernel's ring (two BLOCK × D tiles each). On the H200 a third stage
never helped (``benchmarks/EXPERIMENTS.md``, GDPA backward): the consumers, not the loads, set
the pace, and the fused dK/dV/dQ kernel needs the SMEM."""

HEAD_DIMS = (64, 128)
"""Head dims the kernels support: the two (BLOCK, D) float32 accumulators of a dK/dV consumer
take D/2 registers per thread each, so D = 256 would not fit beside the score tiles."""

ROW_ALIGN = 8
"""Mosaic's tiled TMA addresses rows in groups of 8: the row count of every (packed or
per-sample) GMEM operand must be a multiple of it."""


# ------------------------------------------------------------------------------------------------
# Activations and their derivatives, elementwise in float32 with ops Mosaic GPU lowers.

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_CUBIC = 0.044715
_LEAKY_SLOPE = 0.01


_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def erf_f32(x):
  """erf of a float32 array as a rational function of x on [-4, 4] (XLA's and Eigen's float32
  approximation, a few ulp): Mosaic GPU has no layout rule for ``math.erf``."""
  x = jnp.minimum(jnp.maximum(x, -4.0), 4.0)
  x2 = x * x
  p = jnp.full_like(x, _ERF_P[0])
  for c in _ERF_P[1:]:
    p = p * x2 + c
  q = jnp.full_like(x, _ERF_Q[0])
  for c in _ERF_Q[1:]:
    q = q * x2 + c
  return x * p / q


def act_and_grad(activation: str, z, *, need_value: bool = True):
  """``(act(z), act'(z))`` of :data:`pallas_norm.reference.ACTIVATIONS` for a float32 array
  (``act(z)`` is None when not ``need_value``). The derivatives are those of the jnp functions
  there (``jax.grad`` agrees: relu'(0) = 0, leaky_relu'(0) = 1)."""
  if activation == "fast_gelu":  # 0.5 z (1 + tanh(u)), u = c (z + a z³), u' = c (1 + 3a z²)
    # act' = ½(1 + t) + z (1 − t²) · ½u'. Written around z² with the constants folded, so
    # each line is one multiply or multiply-add: this runs on every score of every backward
    # step, on the consumers' critical path.
    z2 = z * z
    t = jnp.tanh(z * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * _GELU_CUBIC) * z2))
    half_one_t = 0.5 + 0.5 * t
    half_du = (0.5 * _SQRT_2_OVER_PI) + (1.5 * _SQRT_2_OVER_PI * _GELU_CUBIC) * z2
    grad = half_one_t + (z * (1.0 - t * t)) * half_du
    return (z * half_one_t if need_value else None), grad
  if activation == "gelu":  # 0.5 z (1 + erf(z / √2))
    cdf = 0.5 + 0.5 * erf_f32(z * _INV_SQRT_2)
    grad = cdf + _INV_SQRT_2PI * z * jnp.exp(-0.5 * z * z)
    return (z * cdf if need_value else None), grad
  if activation == "silu":  # z σ(z)
    sig = 1.0 / (1.0 + jnp.exp(-z))
    grad = sig * (1.0 + z * (1.0 - sig))
    return (z * sig if need_value else None), grad
  if activation == "relu":
    pos = z > 0
    return (jnp.where(pos, z, 0.0) if need_value else None), jnp.where(pos, 1.0, 0.0)
  if activation == "relu2":
    r = jnp.where(z > 0, z, 0.0)
    return (r * r if need_value else None), 2.0 * r
  if activation == "leaky_relu":  # jax.nn.leaky_relu: where(z >= 0, z, slope z)
    nonneg = z >= 0
    value = jnp.where(nonneg, z, _LEAKY_SLOPE * z) if need_value else None
    return value, jnp.where(nonneg, 1.0, _LEAKY_SLOPE)
  if activation == "identity":
    return (z if need_value else None), jnp.ones_like(z)
  raise ValueError(f"activation must be one of {sorted(reference.ACTIVATIONS)}, "
                   f"got {activation!r}")


# ------------------------------------------------------------------------------------------------
# Eligibility and the static plan.


def unsupported_reason(q, k, v, kv_offsets, max_seq_len=None, max_kv_len=None) -> str | None:
  """None if the kernels can run the backward of this call, else why not (for dispatch).

  Needs bfloat16/float16 q, k, v; head dim 64 or 128; a capacity T (and Tkv for jagged k/v, or
  Lkv for dense k/v) that is a multiple of 8 (Mosaic's tiled TMA). ``max_seq_len`` and
  ``max_kv_len`` do not limit the kernels (they loop over whatever lengths the offsets give).
  """
  del max_seq_len, max_kv_len, v
  dtype = jnp.dtype(q.dtype)
  if dtype not in mgpu.SUPPORTED_DTYPES:
    return f"q dtype {dtype} is not bfloat16 or float16"
  t, _, d = q.shape
  if d not in HEAD_DIMS:
    return f"head dim D = {d} is not one of {HEAD_DIMS}"
  if t % ROW_ALIGN:
    return f"q capacity T = {t} is not a multiple of {ROW_ALIGN}"
  kv_rows = k.shape[0] if kv_offsets is not None else k.shape[1]
  if kv_rows % ROW_ALIGN:
    name = "Tkv" if kv_offsets is not None else "Lkv"
    return f"k/v rows {name} = {kv_rows} is not a multiple of {ROW_ALIGN}"
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one backward call."""
  batch: int          # B
  heads: int          # H
  head_dim: int       # D
  dtype: jnp.dtype
  dense: bool         # k/v (B, Lkv, H, D), else packed (Tkv, H, D)
  kv_rows: int        # Lkv (dense) or Tkv (jagged)
  kv_tiles: int       # dense: kv tiles per sample; jagged: kv tiles of the packed rows
  activation: str
  scale_grads: bool   # write the partial sums of d pre_scale and d post_scale
  add_do_to_dq: bool = False  # write dq + dO (gdpa_bwd's keyword)
  dkv_ctas: int = 1   # persistent dK/dV CTAs, walking the items in ``dkv_rounds`` rounds
  dkv_rounds: int = 0

  @property
  def fuse_dq(self) -> bool:
    """dQ inside the dK/dV kernel: a CTA holds every kv row of its (sample, head)."""
    return self.dense and self.kv_rows <= TILE and self.head_dim == 2 * BLOCK

  @property
  def prescaled_ds(self) -> bool:
    """The fused dQ adds dO through the tensor cores (an identity A tile times the ring's dO
    stage, in the dQ accumulator) instead of loading, unpacking and adding it on consumer 1's
    serial chain; for that the dSᵀ tiles are staged times pre·post, so dQ = (pre·post·dS) K + dO
    needs no scale after the accumulator, and dK none either. Not with ``scale_grads``: the
    identity tile's 8 KB does not fit beside the scale partials' SMEM there (232552 of 232448
    bytes). A non-finite dO row then reaches its whole q block's dq (the identity WGMMA's
    0 · NaN), the rows of a neighbouring sample in the block included."""
    return self.fuse_dq and self.add_do_to_dq and not self.scale_grads

  @property
  def dkv_items(self) -> int:
    """kv tiles of the dK/dV kernel (each run once per head: :attr:`dkv_work_items`)."""
    return self.batch * self.kv_tiles if self.dense else self.kv_tiles

  @property
  def dkv_work_items(self) -> int:
    return self.dkv_items * self.heads

  @property
  def dkv_chunks(self) -> int:
    """128-byte column chunks of a (BLOCK, D) dK or dV tile staged for its store."""
    return self.head_dim * jnp.dtype(self.dtype).itemsize // 128


def _tiled(d: int, dtype):
  return mgpu.swizzle_transforms(d, dtype)


def _cdiv(a, b):
  return (a + b - 1) // b


def _block_span(lo, hi):
  """(first aligned BLOCK index, number of blocks) covering rows [lo, hi); 0 blocks if empty."""
  first = lo // BLOCK
  return first, jnp.where(hi > lo, _cdiv(hi, BLOCK) - first, 0)


def _q_window(lo, hi):
  """(first row, number of BLOCK-row blocks) of the q window of rows [lo, hi): it starts at lo
  rounded down to :data:`ROW_ALIGN` (the tiled TMA's row granule), not to BLOCK, so a sample
  pays for at most 7 rows before its first (as the forward's windows); 0 blocks if empty."""
  win = lo - lax.rem(lo, ROW_ALIGN)
  return win, jnp.where(hi > lo, _cdiv(hi - win, BLOCK), 0)


def _q_tail_base(end):
  """First row of the zero-padded copy of q and dO (2·BLOCK rows, :func:`_q_tail`) that the
  q blocks reaching past row ``end`` (the last offset) read instead: such a block starts at a
  multiple of ROW_ALIGN in (end − BLOCK, end), so within [base, base + BLOCK]."""
  return jnp.maximum(end - lax.rem(end, ROW_ALIGN) - BLOCK, 0)


def _ids(layout):
  """0 .. BLOCK - 1 as a vector in ``layout``."""
  return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (BLOCK,), 0), layout)


def _tile_ids():
  """(row ids, column ids) of a (BLOCK, BLOCK) WGMMA tile as vectors in the accumulator's row
  and column layouts: 2 + 16 registers a thread keeps across the loop, where two int32 tiles
  would take 64."""
  return _ids(plgpu.Layout.WGMMA.reduce(1)), _ids(plgpu.Layout.WGMMA.reduce(0))


def _box(ids, row_lo, row_hi, col_lo, col_hi):
  """Bool (BLOCK, BLOCK) mask of rows in [row_lo, row_hi) and cols in [col_lo, col_hi), the
  bounds relative to the tile's first row/col; ``ids`` from :func:`_tile_ids`."""
  rows, cols = ids
  shape = (BLOCK, BLOCK)
  row_ok = jnp.where((rows >= row_lo) & (rows < row_hi), 1.0, 0.0)
  col_ok = jnp.where((cols >= col_lo) & (cols < col_hi), 1.0, 0.0)
  return (lax.broadcast_in_dim(row_ok, shape, [0]) * lax.broadcast_in_dim(col_ok, shape, [1])
          > 0.5)


def _operand_smem(per_consumer: int, dtype):
  """(2, per_consumer, BLOCK, BLOCK) SMEM tiles: WGMMA A operands each consumer computed."""
  return plgpu.SMEM((2, per_consumer, BLOCK, BLOCK), dtype, transforms=_tiled(BLOCK, dtype))


def _ring_allocs(d: int, dtype) -> dict:
  """A :class:`mgpu.SharedRing` of two (BLOCK, D) tiles per stage."""
  tile = plgpu.SMEM((STAGES, BLOCK, d), dtype, transforms=_tiled(d, dtype))
  return dict(x=tile, w=tile,
              produced=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # one per TMA copy
              consumed=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES))  # one per consumer


def _produce_block(ring, step, is_tail, main, tail) -> None:
  """Producer: loads the two (BLOCK, D) GMEM windows ``main`` into global step ``step``'s stage
  (:func:`mgpu.ring_produce`), or the zero-padded ``tail`` ones for the block that
  reaches past the last offset."""
  pl.when(is_tail)(lambda: mgpu.ring_produce(ring, step, *tail))
  pl.when(jnp.logical_not(is_tail))(lambda: mgpu.ring_produce(ring, step, *main))


def _sample_loop(first, count, body, carry):
  """``carry = body(sample, carry)`` for samples first .. first + count - 1 (``count``
  dynamic, or the Python int 1: then one call, no loop)."""
  if isinstance(count, int) and count == 1:
    return body(first, carry)
  return lax.fori_loop(0, count, lambda i, c: body(first + i, c), carry)


# ------------------------------------------------------------------------------------------------
# dK / dV (and the scale-gradient partial sums).


@dataclasses.dataclass(frozen=True)
class _DkvItem:
  """A work item of the persistent dK/dV grid: one head of a kv tile (dense: of one sample's
  keys; packed: of the packed rows, shared by the samples it overlaps)."""
  head: jax.Array
  position: jax.Array  # the kv tile's position in the work order: its scale partials' slot
  first: jax.Array     # first sample whose keys the tile holds (dense: its sample)
  count: object        # samples from ``first`` (dense: the Python int 1)
  kv_base: jax.Array   # first kv row of the tile (dense: relative to the sample)


def _item_index(plan: _Plan, round_):
  """(position, head, exists) of this CTA's item in round ``round_``: work item ``i = round ·
  CTAs + column`` is head ``i mod H`` of the kv tile at position ``i div H`` of the work order
  (most q blocks first); the column runs over the CTAs forward in even rounds and backward in
  odd ones (zig-zag, as the forward's rounds), so the CTAs get similar sums of q blocks.
  ``exists`` is False past the last item (the last round may have fewer items than CTAs)."""
  cta = lax.axis_index("cta")
  column = jnp.where(lax.rem(round_, 2) == 0, cta, plan.dkv_ctas - 1 - cta)
  index = round_ * plan.dkv_ctas + column
  return lax.div(index, plan.heads), lax.rem(index, plan.heads), index < plan.dkv_work_items


def _read_item(plan: _Plan, order_ref, first_ref, count_ref, round_) -> _DkvItem:
  """This CTA's item in round ``round_`` (:func:`_item_index`)."""
  position, head, _ = _item_index(plan, round_)
  if plan.dense:
    # order_ref is the forward's work table: rows 0 .. B-1 are the samples, longest first,
    # each sample's kv tiles at consecutive positions. kv_base is traced also for one tile:
    # consumer 1's rows lie past an Lkv of 64 (TMA reads zeros, drops the stores).
    row = position if plan.kv_tiles == 1 else lax.div(position, plan.kv_tiles)
    return _DkvItem(head, position, order_ref[row, KV_WIN], 1,
                    lax.rem(position, plan.kv_tiles) * TILE)
  tile = order_ref[position]
  return _DkvItem(head, position, first_ref[tile], count_ref[tile], tile * TILE)


def _item_rounds(plan: _Plan, body, carry):
  """``carry = body(round, carry)`` for each round in which this CTA has an item: a loop of a
  static count (no bound held in a register across the items)."""
  def round_(r, carry):
    return lax.cond(_item_index(plan, r)[2], functools.partial(body, r), lambda c: c, carry)
  return lax.fori_loop(0, plan.dkv_rounds, round_, carry)


@dataclasses.dataclass(frozen=True)
class _DkvRefs:
  """The dK/dV kernel's GMEM refs, and what its warpgroups read of them."""
  plan: _Plan
  order_ref: object
  first_ref: object
  count_ref: object
  q_off_ref: object
  kv_off_ref: object
  scales_ref: object
  q_ref: object
  do_ref: object
  k_ref: object
  v_ref: object
  q_tail_ref: object
  do_tail_ref: object
  dk_ref: object
  dv_ref: object
  dq_ref: object        # None unless dQ is fused
  partial_ref: object   # None unless the scales get gradients
  q_end: jax.Array      # blocks reaching past it read the zero-padded tail copy
  tail_base: jax.Array

  def item_at(self, r) -> _DkvItem:
    return _read_item(self.plan, self.order_ref, self.first_ref, self.count_ref, r)

  def q_span(self, s):
    """(valid q rows [lo, hi), first row of its q window, blocks) of sample s."""
    lo, hi = self.q_off_ref[s], self.q_off_ref[s + 1]
    return (lo, hi, *_q_window(lo, hi))

  def kv_range(self, s):
    if self.plan.dense:
      return 0, self.plan.kv_rows
    return self.kv_off_ref[s], self.kv_off_ref[s + 1]

  def rows_of(self, ref, item):
    """The (kv rows, D) view of k, v, dk or dv for the item's head (dense: its sample's)."""
    return ref.at[item.first, :, item.head, :] if self.plan.dense else ref.at[:, item.head, :]


@dataclasses.dataclass(frozen=True)
class _DkvSmem:
  """The dK/dV kernel's SMEM and barriers (:func:`_dkv_smem` says what each holds)."""
  ring: mgpu.SharedRing
  kv_smem: object
  kv_barrier: object
  kv_free: object
  op_smem: object
  partial_smem: object
  ds_ready: object
  ds_free: object
  dq_smem: object = None
  fill_smem: object = None
  kv_done: object = None
  eye_smem: object = None


def _dkv_kernel(order_ref, first_ref, count_ref, q_off_ref, kv_off_ref, scales_ref, q_ref,
                do_ref, k_ref, v_ref, q_tail_ref, do_tail_ref, *out_refs, plan: _Plan):
  """Persistent: CTA ``cta`` runs its items (:func:`_read_item`) one after the other. The
  ring's steps count across the items, so the producer loads the next item's first q/dO
  blocks while the consumers finish the current one, then its K/V as soon as the consumers
  release theirs (``kv_free``, after the item's last WGMMAs: dK/dV leave through the operand
  tiles), so that load runs during their epilogue. The producer has read the next item's
  table row long before: no dependent load delays the K/V."""
  q_end = q_off_ref[plan.batch]
  g = _DkvRefs(plan, order_ref, first_ref, count_ref, q_off_ref, kv_off_ref, scales_ref, q_ref,
               do_ref, k_ref, v_ref, q_tail_ref, do_tail_ref, out_refs[0], out_refs[1],
               out_refs[2] if plan.fuse_dq else None,
               out_refs[-1] if plan.scale_grads else None, q_end, _q_tail_base(q_end))

  def scoped(ring, **smem):
    s = _DkvSmem(ring=mgpu.SharedRing(stages=STAGES, **ring), **smem)

    def consumer():
      wg = lax.axis_index("wg")
      for w in range(2):  # one copy of the loop per consumer, each with its static index
        pl.when(wg == w)(functools.partial(_dkv_consume, g, s, w))

    mgpu.warp_specialize(functools.partial(_dkv_produce, g, s), consumer)

  pl.run_scoped(scoped, **_dkv_smem(plan), collective_axes="wg")


def _dkv_smem(plan: _Plan) -> dict:
  d, dtype = plan.head_dim, plan.dtype
  smem = dict(
      ring=_ring_allocs(d, dtype),
      kv_smem=plgpu.SMEM((2, 2, BLOCK, d), dtype, transforms=_tiled(d, dtype)),
      kv_barrier=plgpu.Barrier(num_arrivals=2, num_barriers=2),  # per consumer: K, V copies
      kv_free=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # per consumer: done with K, V
      # Per consumer: Aᵀ and dSᵀ (two slots: the other consumer reads it), and at the end of an
      # item dK and dV in 128-byte column chunks (the K/V tiles are being reloaded).
      op_smem=_operand_smem(max(3, 2 * plan.dkv_chunks), dtype),
      partial_smem=plgpu.SMEM((2, 2, BLOCK), jnp.float32),
      ds_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # consumer 0's dSᵀ of a slot
      ds_free=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # consumer 1's dQ read it
  )
  if plan.fuse_dq:
    smem.update(
        # Consumer 1's dq tile: swizzled column chunks (an unswizzled tile of 256-byte rows
        # took 8-way SMEM bank conflicts on every register store), any TMA row start.
        dq_smem=row_store_smem(BLOCK, d, dtype),
        # dq's padding value, for the producer's stores (untiled: any TMA row start).
        fill_smem=plgpu.SMEM((BLOCK, BLOCK), dtype,
                             transforms=mgpu.swizzle_transforms(BLOCK, dtype, tiled=False)),
        kv_done=plgpu.Barrier(num_arrivals=1, num_barriers=1),  # consumer 1 is done with an item's K tiles
    )
  if plan.prescaled_ds:  # the identity A tile of the dQ's + dO WGMMA
    smem.update(eye_smem=plgpu.SMEM((1, BLOCK, BLOCK), dtype, transforms=_tiled(BLOCK, dtype)))
  return smem


def _dkv_produce(g: _DkvRefs, s: _DkvSmem) -> None:
  """The producer warpgroup: each round's item's q/dO blocks through the ring and its K/V into
  the consumers' tiles; with fused dQ also dq's padding rows, a share per round."""
  plan, ring = g.plan, s.ring
  if plan.fuse_dq:
    _fill_tile(s.fill_smem, _padding_value(g.scales_ref))

  def load_kv(item, r):
    """Both consumers' BLOCK kv rows of the item into their K and V tiles, once they are
    done with the previous item's (``kv_free``; the CTA's first item has none)."""
    @pl.when(r > 0)
    def _():
      for w in range(2):
        plgpu.barrier_wait(s.kv_free.at[w])

    for w in range(2):
      rows = pl.ds(item.kv_base + w * BLOCK, BLOCK)
      for ref, tile in ((g.k_ref, s.kv_smem.at[w, 0]), (g.v_ref, s.kv_smem.at[w, 1])):
        plgpu.copy_gmem_to_smem(g.rows_of(ref, item).at[rows], tile, s.kv_barrier.at[w])

  def produce_item(r, first_step):
    """The item's q/dO blocks from ring step ``first_step``, and its K/V after the first
    STAGES blocks: those load during the previous item's last steps, the K/V (which
    waits for the previous item's end) as soon as the consumers release it."""
    item = g.item_at(r)

    def sample(smp, step):
      _, _, win, blocks = g.q_span(smp)

      @pl.loop(0, blocks)
      def _(j):
        pl.when(step + j == first_step + STAGES)(lambda: load_kv(item, r))
        row = win + j * BLOCK
        rows = pl.ds(pl.multiple_of(row, ROW_ALIGN), BLOCK)
        main = (g.q_ref.at[rows, item.head, :], g.do_ref.at[rows, item.head, :])
        tail_rows = pl.ds(pl.multiple_of(row - g.tail_base, ROW_ALIGN), BLOCK)
        tail = (g.q_tail_ref.at[tail_rows, item.head, :],
                g.do_tail_ref.at[tail_rows, item.head, :])
        _produce_block(ring, step + j, row + BLOCK > g.q_end, main, tail)
      return step + blocks

    end_step = _sample_loop(item.first, item.count, sample, first_step)
    pl.when(end_step - first_step <= STAGES)(lambda: load_kv(item, r))
    return end_step

  def round_(r, step):
    step = lax.cond(_item_index(plan, r)[2], functools.partial(produce_item, r),
                    lambda step: step, step)
    if plan.fuse_dq:  # this round's share of dq's padding rows, after its loads
      per_round = _dq_padding_per_round(plan, g.dq_ref.shape[0], g.q_end)
      _store_dq_padding(plan, g.dq_ref, s.fill_smem, g.q_end, r * per_round,
                        (r + 1) * per_round)
    return step

  total = lax.fori_loop(0, plan.dkv_rounds, round_, jnp.int32(0))
  mgpu.ring_drain(ring, total)

  @pl.when(_item_index(plan, 0)[2])
  def _():
    for w in range(2):  # the releases of the CTA's last item (every phase is waited)
      plgpu.barrier_wait(s.kv_free.at[w])

  if plan.fuse_dq:  # (all stored in the rounds, unless there are none)
    per_round = _dq_padding_per_round(plan, g.dq_ref.shape[0], g.q_end)
    _store_dq_padding(plan, g.dq_ref, s.fill_smem, g.q_end, plan.dkv_rounds * per_round, None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads


def _dkv_consume(g: _DkvRefs, s: _DkvSmem, wg: int) -> None:
  """Consumer ``wg`` (static: SMEM addresses known at compile time). With fused dQ the
  roles differ: consumer 0 hands its dSᵀ tile of each step to consumer 1 (``ds_ready``)
  and goes on; consumer 1 computes all of dQ's columns from both tiles and frees consumer
  0's slot (``ds_free``), so neither waits for the other within a step and the consumer
  ahead runs its elementwise work while the other's WGMMAs use the tensor cores."""
  plan = g.plan
  computes_dq = plan.fuse_dq and wg == 1
  pre, post = g.scales_ref[0], g.scales_ref[1]
  ids = _tile_ids()

  if computes_dq:  # both dSᵀ slots start free (consumer 0 waits for every phase)
    for slot in range(2):
      plgpu.barrier_arrive(s.ds_free.at[slot])
    if plan.prescaled_ds:
      _fill_identity(s.eye_smem.at[0], ids, plan.dtype)

  def round_(r, first_step):
    item = g.item_at(r)
    row0 = item.kv_base + wg * BLOCK
    # The barriers of the item loop through an opaque index (of the step count: LLVM
    # bounds the round by the static round count): their addresses, hoisted out of the
    # loop by LLVM, were spilled.
    zero = mgpu.opaque_zero(first_step)
    # Fused dQ reads the other consumer's K tile too: wait for both loads.
    for w in range(2) if computes_dq else (wg,):
      plgpu.barrier_wait(s.kv_barrier.at[w + zero])
    # The previous item's dK/dV left through the operand tiles: its stores must have read
    # them before this item's first step writes them.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def with_accs(dk_acc, dv_acc):
      def sample(smp, step):
        q_lo, q_hi, win, blocks = g.q_span(smp)
        kv_lo, kv_hi = g.kv_range(smp)

        def body(idxs, q_stage, do_stage, gstep):
          # The global step carried (not step + j): the loop's end value is then the
          # carry, and the item's first step is not held across the loop for the sum.
          (j,) = idxs
          col0 = win + j * BLOCK
          slot = lax.rem(gstep, 2)
          # The resident K/V tiles through an opaque 0: at static addresses their WGMMA
          # descriptors were hoisted out of the loop and spilled (mgpu.opaque_zero).
          kv_tiles = s.kv_smem.at[pl.ds(mgpu.opaque_zero(gstep), 2)]
          valid = _box(ids, kv_lo - row0, kv_hi - row0, q_lo - col0, q_hi - col0)
          hand_off = ((s.ds_free.at[slot], s.ds_ready.at[slot]) if plan.fuse_dq and wg == 0
                      else None)
          _dkv_step(plan, pre, valid, kv_tiles.at[wg, 0], kv_tiles.at[wg, 1],
                    q_stage, do_stage, (dk_acc, dv_acc),
                    (s.op_smem.at[wg, 0], s.op_smem.at[wg, 1 + slot]),
                    hand_off, in_flight=computes_dq,
                    ds_scale=pre * post if plan.prescaled_ds else None)
          if computes_dq:
            # The head recomputed in the step, not held across it.
            head_in_step = lambda: _item_index(plan, r + mgpu.opaque_zero(gstep))[1]
            # The dq tile too (its per-thread store addresses were hoisted and spilled).
            _fused_dq(plan, pre * post, s.op_smem.at[:, 1 + slot], kv_tiles,
                      (s.ds_ready.at[slot], s.ds_free.at[slot]),
                      s.dq_smem.at[mgpu.opaque_zero(gstep)],
                      lambda rows, cols: g.dq_ref.at[rows, head_in_step(), cols], col0, q_lo,
                      q_hi, do_stage,
                      s.eye_smem.at[mgpu.opaque_zero(gstep)] if plan.prescaled_ds else None)
          return gstep + 1

        return mgpu.ring_k_loop(s.ring, step, blocks, step, body)

      end_step = _sample_loop(item.first, item.count, sample, first_step)
      _dkv_item_end(g, s, wg, r, zero, end_step, (dk_acc, dv_acc), pre, post)
      return end_step

    return pl.run_scoped(with_accs, plgpu.ACC((BLOCK, plan.head_dim)),
                         plgpu.ACC((BLOCK, plan.head_dim)))

  total = _item_rounds(plan, round_, jnp.int32(0))
  if plan.fuse_dq and wg == 0:
    for slot in range(2):  # the last phase of each slot (every waiter sees every phase)
      plgpu.barrier_wait(s.ds_free.at[slot + mgpu.opaque_zero(total)])
  # Only SMEM must outlive the stores: waiting for their reads, not their writes, lets
  # the CTA retire ~the HBM write latency earlier (CUTLASS's epilogues end the same way;
  # the grid's end makes the writes visible).
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dkv_item_end(g: _DkvRefs, s: _DkvSmem, wg: int, r, zero, end_step, accs, pre,
                  post) -> None:
  """Consumer ``wg``'s end of the item of round ``r``: releases its K/V tiles and stores dK,
  dV (and the scale gradients' row sums) through its operand tiles."""
  plan = g.plan
  dk_acc, dv_acc = accs
  if plan.fuse_dq:
    # Consumer 1's dQ WGMMAs read consumer 0's K and dSᵀ tiles: consumer 0 reloads
    # and overwrites them once consumer 1 is done with the item (its last dQ waited
    # for them). One phase per item, also for an item without steps.
    if wg == 1:
      plgpu.barrier_arrive(s.kv_done.at[zero])
    else:
      plgpu.barrier_wait(s.kv_done.at[zero])
  if plan.scale_grads:  # before the producer may overwrite this consumer's K and V
    item = g.item_at(r + mgpu.opaque_zero(end_step))
    met = _met_rows(g, item, item.kv_base + wg * BLOCK)
    _scale_grad_rows(s.kv_smem.at[wg], accs, s.partial_smem.at[wg], met)
    # The proxy fence between these generic reads of K, V and the next item's TMA writes.
    plgpu.commit_smem()
  # This consumer's K and V are no longer read: the producer loads the next item's
  # while the epilogue stores dK and dV.
  plgpu.barrier_arrive(s.kv_free.at[wg + zero])
  # The item read again (an opaque round): its fields are not kept across the loop.
  done = g.item_at(r + mgpu.opaque_zero(end_step))
  done_row0 = done.kv_base + wg * BLOCK
  staged = s.op_smem.at[wg]
  # With prescaled dSᵀ tiles dK is complete; 0·pre·post keeps it NaN for poisoned scales
  # also where the item had no q block.
  dk = dk_acc[...] + 0.0 * (pre * post) if plan.prescaled_ds else dk_acc[...] * (pre * post)
  _stage_chunks(staged, 0, dk.astype(plan.dtype))
  _stage_chunks(staged, plan.dkv_chunks, (dv_acc[...] * post).astype(plan.dtype))
  plgpu.commit_smem()
  for i, ref in enumerate((g.dk_ref, g.dv_ref)):
    _store_chunks(staged, i * plan.dkv_chunks, g.rows_of(ref, done), done_row0)
  if plan.scale_grads:
    plgpu.copy_smem_to_gmem(s.partial_smem.at[wg],
                            g.partial_ref.at[done.head, done.position, wg])


def _stage_chunks(tiles, first: int, x) -> None:
  """Writes the (BLOCK, D) register tile ``x`` into ``tiles[first], tiles[first + 1], ...``, one
  (BLOCK, 128 bytes) column chunk each."""
  cols = tiles.shape[-1]
  for c in range(x.shape[1] // cols):
    tiles.at[first + c][...] = x[:, c * cols:(c + 1) * cols]


def _store_chunks(tiles, first: int, dst, row0) -> None:
  """TMA stores of the chunks :func:`_stage_chunks` wrote to rows [row0, row0 + BLOCK) of
  ``dst`` (rows, D)."""
  cols = tiles.shape[-1]
  for c in range(dst.shape[1] // cols):
    plgpu.copy_smem_to_gmem(tiles.at[first + c],
                            dst.at[pl.ds(row0, BLOCK), pl.ds(c * cols, cols)])


def _padding_value(scales_ref):
  """dq's value on padding rows: 0 · pre · post, as the forward writes 0 · post_scale there.
  Zero for finite scales; NaN when the op poisoned the scales (bad traced offsets: every
  sample is then empty, and every row of dq must come out NaN)."""
  return 0.0 * jnp.abs(scales_ref[0] * scales_ref[1])


def _fill_tile(tile, value) -> None:
  """Writes ``value`` into every element of the SMEM ``tile`` (rows, cols) and commits it for
  TMA reads."""
  tile[...] = plgpu.layout_cast(jnp.full(tile.shape, value, jnp.float32),
                                plgpu.Layout.WGMMA).astype(tile.dtype)
  plgpu.commit_smem()


def _dq_padding_units(plan: _Plan, capacity: int, q_end):
  """dq's padding rows [q_end, T) of every head as units of BLOCK rows of one head: their
  count, and this CTA's (units ``cta``, ``cta + CTAs``, ...)."""
  units = _cdiv(capacity - q_end, BLOCK) * plan.heads
  cta = lax.axis_index("cta")
  return units, jnp.maximum(units - cta + plan.dkv_ctas - 1, 0) // plan.dkv_ctas


def _dq_padding_per_round(plan: _Plan, capacity: int, q_end):
  """Padding units a CTA stores per round: its share spread over the rounds, so the stores
  run beside the work rather than after it."""
  units, _ = _dq_padding_units(plan, capacity, q_end)
  return _cdiv(_cdiv(units, plan.dkv_ctas), max(plan.dkv_rounds, 1))


def _store_dq_padding(plan: _Plan, dq_ref, fill, q_end, first, stop) -> None:
  """Producer (fused dQ): TMA stores of this CTA's padding units [first, stop) (stop None: to
  its last; :func:`_dq_padding_units`) from ``fill`` (BLOCK, BLOCK), which holds the padding
  value (:func:`_padding_value`): no item owns those rows of dq. Stores are clipped at T."""
  capacity = dq_ref.shape[0]
  _, mine = _dq_padding_units(plan, capacity, q_end)
  stop = mine if stop is None else jnp.minimum(stop, mine)
  cta = lax.axis_index("cta")

  @pl.loop(first, stop)
  def _(k):
    unit = cta + k * plan.dkv_ctas
    rows = pl.ds(q_end + lax.div(unit, plan.heads) * BLOCK, BLOCK)
    for c in range(plan.head_dim // BLOCK):
      plgpu.copy_smem_to_gmem(fill, dq_ref.at[rows, lax.rem(unit, plan.heads),
                                              pl.ds(c * BLOCK, BLOCK)])


def _fill_identity(tile, ids, dtype) -> None:
  """Writes the (BLOCK, BLOCK) identity into the SMEM ``tile`` and commits it for WGMMA."""
  rows, cols = ids
  shape = (BLOCK, BLOCK)
  diagonal = (lax.broadcast_in_dim(rows.astype(jnp.float32), shape, [0])
              == lax.broadcast_in_dim(cols.astype(jnp.float32), shape, [1]))
  tile[...] = jnp.where(diagonal, 1.0, 0.0).astype(dtype)
  plgpu.commit_smem()


def _fused_dq(plan: _Plan, scale, ds_tiles, kv_smem, slot_barriers, dq_chunks, dq_at, col0,
              q_lo, q_hi, do_stage, eye_smem=None) -> None:
  """dQ of a q block inside the dK/dV kernel (dense k/v, Lkv ≤ TILE, D = 2·BLOCK), run by
  consumer 1 after issuing its dV/dK WGMMAs: once consumer 0's dSᵀ tile is in SMEM (the
  ``ready`` barrier of ``slot_barriers = (ready, free)``), dQ = Σ_w dSᵀ[w]ᵀ K[w] over both
  consumers' tiles (``ds_tiles[w]``: BLOCK kv × BLOCK q rows; every kv row is in the CTA),
  all D columns, stored for the rows of the sample, [q_lo, q_hi) ∩ the block, through
  ``dq_chunks`` (a tile of :func:`mgpu.store.row_store_smem`) to ``dq_at(rows, cols)``, dq's
  GMEM view of the head. Reading the dQ accumulator waits for every WGMMA of the step; then
  ``free`` lets consumer 0 rewrite its slot (two steps later: the dSᵀ tiles alternate between
  two slots). With ``plan.add_do_to_dq``, dQ + dO (``do_stage``, the step's ring stage): with
  :attr:`_Plan.prescaled_ds` by one more WGMMA, the identity ``eye_smem`` times ``do_stage``, into
  the same accumulator (the tiles already hold pre·post·dSᵀ)."""
  ready, free = slot_barriers
  plgpu.barrier_wait(ready)

  def issue(acc):
    for w in range(2):
      plgpu.wgmma(acc, ds_tiles.at[w].transpose((1, 0)), kv_smem.at[w, 0])
    if plan.prescaled_ds:
      plgpu.wgmma(acc, eye_smem, do_stage)
    return acc[...]

  dq = pl.run_scoped(issue, plgpu.ACC((BLOCK, plan.head_dim)))
  plgpu.barrier_arrive(free)
  if not plan.prescaled_ds:
    dq = dq * scale
    if plan.add_do_to_dq:
      dq = dq + plgpu.load(do_stage, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  lo = jnp.maximum(q_lo - col0, 0)
  # store_rows first waits for the previous block's stores to have read the chunks.
  store_rows(dq.astype(plan.dtype), dq_chunks, dq_at, col0, lo,
             jnp.minimum(q_hi - col0, BLOCK) - lo)


def _scores(a_smem, b_stage, da_smem, db_stage):
  """``(a bᵀ, da dbᵀ)``, two (BLOCK, BLOCK) float32 products issued before one wait."""
  def issue(s_ref, da_ref):
    plgpu.wgmma(s_ref, a_smem, b_stage.transpose((1, 0)))
    plgpu.wgmma(da_ref, da_smem, db_stage.transpose((1, 0)))
    return s_ref[...], da_ref[...]
  return pl.run_scoped(issue, plgpu.ACC((BLOCK, BLOCK)), plgpu.ACC((BLOCK, BLOCK)))


def _met_rows(g: _DkvRefs, item: _DkvItem, row0):
  """Bool (BLOCK,) in the accumulators' row layout: which of the consumer's kv rows (from
  ``row0``) some q row met, i.e. belong to a sample of the item with q rows. Every query of a
  sample meets every key of it, so these are the rows whose K and V the scale gradients'
  terms read; the others (padding rows of packed k, samples without queries, dense rows past
  Lkv) add nothing, whatever they hold."""
  rows = _ids(plgpu.Layout.WGMMA.reduce(1))

  def sample(smp, met):
    kv_lo, kv_hi = g.kv_range(smp)
    kv_hi = jnp.where(g.q_off_ref[smp + 1] > g.q_off_ref[smp], kv_hi, kv_lo)
    return jnp.where((rows >= kv_lo - row0) & (rows < kv_hi - row0), 1.0, met)

  none = plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  return _sample_loop(item.first, item.count, sample, none) > 0.5


def _scale_grad_rows(kv_tiles, accs, rows_smem, met) -> None:
  """The item's row sums of the scale gradients into ``rows_smem`` (2, BLOCK), from the
  unscaled accumulators: d pre = post Σ (dAu ⊙ act') ⊙ Su = post Σ K ⊙ dK_acc and d post =
  Σ A ⊙ dAu = Σ V ⊙ dV_acc (dK_acc = Σ dS Q, dV_acc = Σ A dO over the item's steps; Su = K Qᵀ,
  dAu = V dOᵀ), over the rows ``met`` (:func:`_met_rows`): a NaN or inf in a met row's K or V
  reaches the sums even where its accumulator entries are 0, as it reaches the output.

  Once per item, after its steps: summed in the step loop (per-thread partials carried across
  the steps, or added into SMEM) the terms took registers from consumers already at their
  limit, and ptxas spilled and serialized the WGMMAs (``benchmarks/NOTES.md``, "gdpa
  backward", has the timings). The sums so carry dS and A as the WGMMAs read them, rounded to
  the input dtype: an error of ~2⁻⁹ of the terms' root sum of squares, a larger share of the
  sum where the terms cancel."""
  for i, acc in enumerate(accs):
    tile = plgpu.load(kv_tiles.at[i], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    sums = jnp.sum(mgpu.lane_partial_sum(tile * acc[...]), axis=1)
    rows_smem.at[i][...] = jnp.where(met, sums, 0.0)


def _dkv_step(plan: _Plan, pre, valid, k_smem, v_smem, q_stage, do_stage, acc_refs,
              operand_smem, hand_off=None, *, in_flight=False, ds_scale=None):
  """One q block of a dK/dV consumer: the transposed scores ``Sᵀ = K Qᵀ`` and ``dAuᵀ = V dOᵀ``
  (BLOCK kv rows × BLOCK q rows), then ``dV += Aᵀ dO`` and ``dK += (dAu ⊙ act')ᵀ Q`` into the
  accumulator refs (the scales are applied once, at the store, or dK's already on dS:
  ``ds_scale``). ``hand_off = (free, ready)`` (fused dQ, consumer 0): waits on ``free``
  before writing its dSᵀ tile, arrives on ``ready`` once it is in SMEM. Returns once the stage
  is no longer read, or with the WGMMAs ``in_flight`` (:func:`_fused_dq` waits for them). The
  dSᵀ tile is staged times ``ds_scale`` where given (:attr:`_Plan.prescaled_ds`)."""
  dk_ref, dv_ref = acc_refs
  s_t, da_t = _scores(k_smem, q_stage, v_smem, do_stage)
  act, grad = act_and_grad(plan.activation, pre * s_t)
  a_t = jnp.where(valid, act, 0.0).astype(plan.dtype)
  ds_t = jnp.where(valid, da_t * grad, 0.0)
  # WGMMA's A operand from SMEM (the interpreter has no register A; FA3's backward stages P
  # and dS in SMEM too).
  a_smem, ds_smem = operand_smem
  a_smem[...] = a_t
  if hand_off is not None:
    plgpu.barrier_wait(hand_off[0])
  ds_smem[...] = (ds_t if ds_scale is None else ds_t * ds_scale).astype(plan.dtype)
  plgpu.commit_smem()
  if hand_off is not None:
    plgpu.barrier_arrive(hand_off[1])
  plgpu.wgmma(dv_ref, a_smem, do_stage)
  plgpu.wgmma(dk_ref, ds_smem, q_stage)
  if not in_flight:
    plgpu.wgmma_wait(0)


# ------------------------------------------------------------------------------------------------
# dQ.


def _dq_kernel(first_ref, count_ref, q_off_ref, kv_off_ref, scales_ref, q_ref, do_ref, k_ref,
               v_ref, k_tail_ref, dq_ref, *, plan: _Plan):
  d, dtype = plan.head_dim, plan.dtype
  h = lax.axis_index("h")
  block = lax.axis_index("item")
  first, count = first_ref[block], count_ref[block]
  tail_block = None if plan.dense else kv_off_ref[plan.batch] // BLOCK

  def kv_span(s):
    """(views of k and v, first kv block, blocks, valid rows [lo, hi)) of sample s; no blocks
    for a sample without q rows (its keys meet no row of dq)."""
    has_q = q_off_ref[s + 1] > q_off_ref[s]
    if plan.dense:
      views = (k_ref.at[s, :, h, :], v_ref.at[s, :, h, :])
      blocks = jnp.where(has_q, _cdiv(plan.kv_rows, BLOCK), 0)
      return views, 0, blocks, 0, plan.kv_rows
    lo, hi = kv_off_ref[s], kv_off_ref[s + 1]
    block0, blocks = _block_span(lo, hi)
    return (k_ref.at[:, h, :], v_ref.at[:, h, :]), block0, jnp.where(has_q, blocks, 0), lo, hi

  def scoped(ring_allocs, qdo_smem, qdo_barrier, op_smem, dq_smem, k_edges_zeroed):
    ring = mgpu.SharedRing(stages=STAGES, **ring_allocs)

    def producer():
      def sample(s, step):
        (k_view, v_view), block0, blocks, _, _ = kv_span(s)

        @pl.loop(0, blocks)
        def _(j):
          rows = pl.ds((block0 + j) * BLOCK, BLOCK)
          main = (k_view.at[rows], v_view.at[rows])
          if plan.dense:
            mgpu.ring_produce(ring, step + j, *main)
          else:
            tail = (k_tail_ref.at[:, h, :], v_view.at[rows])
            _produce_block(ring, step + j, block0 + j == tail_block, main, tail)
        return step + blocks

      total = _sample_loop(first, count, sample, jnp.int32(0))
      mgpu.ring_drain(ring, total)

    def consumer():
      wg = lax.axis_index("wg")
      q_smem, do_smem = qdo_smem.at[wg, 0], qdo_smem.at[wg, 1]
      row0 = block * TILE + wg * BLOCK
      plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, BLOCK), h, :], q_smem, qdo_barrier.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[pl.ds(row0, BLOCK), h, :], do_smem, qdo_barrier.at[wg])
      plgpu.barrier_wait(qdo_barrier.at[wg])
      pre = scales_ref[0]
      ids = _tile_ids()

      def store(tile, lo, hi):
        """dq rows [row0 + lo, row0 + hi) from rows [lo, hi) of the (BLOCK, D) tile."""
        store_rows(tile.astype(dtype), dq_smem.at[wg], lambda rows, cols: dq_ref.at[rows, h, cols],
                   row0, lo, hi - lo)

      def sample(s, step):
        """dQ of the rows of sample s in this consumer's block, in an accumulator of its own:
        the WGMMA also fills the rows of other samples (dS rows of 0 times K), NaN where K
        is, and those rows are not stored."""
        q_lo, q_hi = q_off_ref[s], q_off_ref[s + 1]
        _, block0, blocks, kv_lo, kv_hi = kv_span(s)

        def with_acc(dq_acc):
          def body(idxs, k_stage, v_stage, carry):
            (j,) = idxs
            col0 = (block0 + j) * BLOCK
            if not plan.dense:
              _zero_k_edges(k_stage, k_edges_zeroed.at[lax.rem(step + j, STAGES)], col0,
                            kv_lo, kv_hi)
            valid = _box(ids, q_lo - row0, q_hi - row0, kv_lo - col0, kv_hi - col0)
            _dq_step(plan, pre, valid, q_smem, do_smem, k_stage, v_stage, dq_acc,
                     op_smem.at[wg, 0])
            return carry

          mgpu.ring_k_loop(ring, step, blocks, (), body)
          lo = jnp.clip(q_lo - row0, 0, BLOCK)
          hi = jnp.clip(q_hi - row0, 0, BLOCK)
          def store_dq():
            dq = dq_acc[...] * (pre * scales_ref[1])
            if plan.add_do_to_dq:
              dq = dq + plgpu.load(do_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            store(dq, lo, hi)

          pl.when(hi > lo)(store_dq)

        pl.run_scoped(with_acc, plgpu.ACC((BLOCK, d)))
        return step + blocks

      _sample_loop(first, count, sample, jnp.int32(0))
      # Rows past the last offset belong to no sample (:func:`_padding_value`).
      lo = jnp.clip(q_off_ref[plan.batch] - row0, 0, BLOCK)
      fill = plgpu.layout_cast(jnp.full((BLOCK, d), _padding_value(scales_ref), jnp.float32),
                               plgpu.Layout.WGMMA)
      pl.when(lo < BLOCK)(lambda: store(fill, lo, BLOCK))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    mgpu.warp_specialize(producer, consumer)

  pl.run_scoped(
      scoped,
      _ring_allocs(d, dtype),
      plgpu.SMEM((2, 2, BLOCK, d), dtype, transforms=_tiled(d, dtype)),
      plgpu.Barrier(num_arrivals=2, num_barriers=2),  # per consumer: its Q and dO copies
      _operand_smem(1, dtype),  # per consumer: dS
      row_store_smem(BLOCK, d, dtype, count=2),  # per consumer: its dq rows on the way out
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # per stage: K's edge rows zeroed
      collective_axes="wg",
  )


def _zero_k_edges(k_stage, zeroed, col0, kv_lo, kv_hi) -> None:
  """Packed k: a kv block that reaches outside the sample's keys [kv_lo, kv_hi) holds rows of
  other samples (real tokens, maybe NaN); dS is 0 there but 0 · NaN = NaN in dS·K, so consumer
  0 zeroes those rows of the (shared) K stage and arrives on ``zeroed``, consumer 1 waits for
  it. Both run before their first read of the stage; the forward does the same to V."""
  wg = lax.axis_index("wg")

  @pl.when((col0 < kv_lo) | (col0 + BLOCK > kv_hi))
  def _():
    @pl.when(wg == 0)
    def _zero():
      zero_rows_outside(k_stage, col0, kv_lo, kv_hi)
      plgpu.commit_smem()  # the generic-proxy writes, before WGMMA (async proxy) reads them
      plgpu.barrier_arrive(zeroed)

    pl.when(wg == 1)(lambda: plgpu.barrier_wait(zeroed))


def _dq_step(plan: _Plan, pre, valid, q_smem, do_smem, k_stage, v_stage, dq_ref,
             ds_smem) -> None:
  """One kv block of a dQ consumer: ``S = Q Kᵀ``, ``dAu = dO Vᵀ``, then
  ``dQ += (dAu ⊙ act'(pre·S)) K`` into the accumulator ref (the scales are applied once, at
  the store); returns once the stage is no longer read."""
  s, da = _scores(q_smem, k_stage, do_smem, v_stage)
  _, grad = act_and_grad(plan.activation, pre * s, need_value=False)
  ds_smem[...] = jnp.where(valid, da * grad, 0.0).astype(plan.dtype)
  plgpu.commit_smem()
  plgpu.wgmma(dq_ref, ds_smem, k_stage)
  plgpu.wgmma_wait(0)


# ------------------------------------------------------------------------------------------------
# The wrapper.


def _overlaps(offsets, block_rows: int, n_blocks: int):
  """(first sample, sample count) of each aligned block of ``block_rows`` packed rows: the
  samples whose rows [offsets[s], offsets[s+1]) meet the block (empty samples between them are
  counted too; their loops are empty)."""
  starts = jnp.arange(n_blocks, dtype=jnp.int32) * block_rows
  # "compare_all": one fusion. The default binary search ("scan") is a loop of ~2·log2(B)
  # tiny kernels on the GPU.
  search = functools.partial(jnp.searchsorted, method="compare_all")
  first = search(offsets[1:], starts, side="right").astype(jnp.int32)
  stop = search(offsets[:-1], starts + block_rows, side="left").astype(jnp.int32)
  return first, jnp.maximum(stop - first, 0)


def _tail_block(x, offsets, first=None, count=BLOCK):
  """Rows [first, first + count) of ``x`` (default: the aligned BLOCK that holds row
  ``offsets[-1]``), rows at or past ``offsets[-1]`` zeroed (a gather, not a pass over ``x``)."""
  if first is None:
    first = offsets[-1] // BLOCK * BLOCK
  rows = first + jnp.arange(count, dtype=jnp.int32)
  block = jnp.take(x, jnp.minimum(rows, x.shape[0] - 1), axis=0)
  return jnp.where((rows < offsets[-1])[:, None, None], block, jnp.zeros((), x.dtype))


def _q_tail(x, q_offsets):
  """The zero-padded 2·BLOCK rows of q or dO from :func:`_q_tail_base` (dK/dV kernel)."""
  return _tail_block(x, q_offsets, _q_tail_base(q_offsets[-1]), 2 * BLOCK)


def _scale_array(pre_scale, post_scale):
  return jnp.stack([jnp.asarray(pre_scale, jnp.float32), jnp.asarray(post_scale, jnp.float32)])


def _jagged_dkv_order(q_offsets, first, count):
  """Packed k/v: the dK/dV tiles, most q blocks first (ties keep their order); ``first``,
  ``count``: each tile's samples (:func:`_overlaps`). (Dense k/v read theirs from the forward's
  work table.)"""
  _, q_blocks = _q_window(q_offsets[:-1], q_offsets[1:])
  per_sample = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                           q_blocks.astype(jnp.int32)]))
  work = per_sample[first + count] - per_sample[first]
  tiles = jnp.arange(work.shape[0], dtype=jnp.int32)
  return sort_rows_descending(tiles, work)


def _call(kernel, plan: _Plan, grid: dict, out_type, interpret: bool):
  """The kernel over the grid ``{axis name: size}``."""
  return plgpu.kernel(
      functools.partial(kernel, plan=plan),
      out_type=out_type,
      grid=tuple(grid.values()),
      grid_names=tuple(grid),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=mgpu.interpret_params() if interpret else None,
  )


def gdpa_bwd(q, k, v, q_offsets, kv_offsets, do, *, activation: str = "fast_gelu",
             pre_scale=1.0, post_scale=1.0, max_seq_len=None, max_kv_len=None,
             interpret: bool = False, scale_grads: bool | None = None,
             add_do_to_dq: bool = False, work_table=None):
  """Gradients of :func:`pallas_norm.reference.gdpa` with respect to q, k, v and the scales.

  Args:
    q: (T, H, D) packed query tokens, bfloat16 or float16, D in (64, 128), T % 8 == 0.
    k, v: dense (B, Lkv, H, D) (Lkv % 8 == 0), or packed (Tkv, H, D) (Tkv % 8 == 0) with
      ``kv_offsets``; q's dtype.
    q_offsets: int32 (B+1,) offsets of q; kv_offsets: int32 (B+1,) offsets of packed k/v, or
      None for dense k/v. The caller has validated them (:func:`pallas_norm.ops.gdpa.check_args`).
    do: (T, H, D) cotangent of the output (cast to q's dtype). Its padding rows and those of q
      (and of packed k/v) may hold anything. A non-finite k/v token reaches only
      its sample's gradients; a non-finite q or dO token also makes dk/dv NaN in the kv tiles
      its q blocks are multiplied with (module docstring: the samples whose q blocks read its
      row; with packed k/v every row of their 128-row tiles, other samples' and padding's).
    activation: a key of :data:`pallas_norm.reference.ACTIVATIONS`.
    pre_scale, post_scale: real scalars: Python numbers or 0-d arrays (traced ones included).
    max_seq_len, max_kv_len: accepted for the common interface; the kernels do not need them.
    interpret: run in GPU interpret mode (race detection, NaN-filled uninitialized memory).
    scale_grads: whether to compute the scale gradients; None: when a scale is not a Python
      number (the op passes False for scales its caller gave as numbers, even as arrays).
    add_do_to_dq: return ``dq + do`` in place of dq (the gradient of ``u + gdpa(u, k, v)``
      with respect to u, for FlashNormAttention's inner residual: dO is in SMEM at every dq
      step, so the sum costs no pass over the tensors; rounded to q's dtype once).
    work_table: dense k/v: the forward's work table of the same offsets
      (:func:`pallas_norm.ops.gdpa.mosaic.work_items`), whose sample rows, longest first, are
      the dK/dV tiles' order; default (and for packed k/v, which do not read it): built here.

  Returns:
    ``(dq, dk, dv, d_pre_scale, d_post_scale)``: dq like q (on padding rows 0 · pre · post:
    zeros for finite scales, NaN for NaN ones; with ``add_do_to_dq``, dq + do on the sample
    rows), dk and dv like k (zeros on padded rows of packed k/v, also 0 · the scales), the
    products accumulated in float32. The scale
    gradients are float32 0-d arrays, or both None without ``scale_grads`` (then the kernels
    skip their partial sums).

  Raises:
    NotImplementedError: what :func:`unsupported_reason` names.
    ValueError: an unknown activation; do not shaped like q.
  """
  if activation not in reference.ACTIVATIONS:
    raise ValueError(f"activation must be one of {sorted(reference.ACTIVATIONS)}, "
                     f"got {activation!r}")
  if tuple(do.shape) != tuple(q.shape):
    raise ValueError(f"do must have q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
  if reason := unsupported_reason(q, k, v, kv_offsets, max_seq_len, max_kv_len):
    raise NotImplementedError(f"gdpa backward kernel: {reason}")
  t, heads, d = q.shape
  dtype = jnp.dtype(q.dtype)
  do = do.astype(dtype)
  batch = q_offsets.shape[0] - 1
  dense = kv_offsets is None
  kv_rows = k.shape[1] if dense else k.shape[0]
  if scale_grads is None:
    scale_grads = not all(isinstance(x, (int, float)) for x in (pre_scale, post_scale))
  plan = _Plan(batch=batch, heads=heads, head_dim=d, dtype=dtype, dense=dense, kv_rows=kv_rows,
               kv_tiles=_cdiv(kv_rows, TILE), activation=activation, scale_grads=scale_grads,
               add_do_to_dq=add_do_to_dq)
  q_offsets = jnp.asarray(q_offsets, jnp.int32)
  # Dense k/v: no kv offsets; q_offsets stands in for the kernels' unread kv_offsets input (a
  # placeholder array of its own would be one more XLA kernel per call).
  kv_off = q_offsets if dense else jnp.asarray(kv_offsets, jnp.int32)
  scales = _scale_array(pre_scale, post_scale)

  # dK / dV.
  if dense:  # the samples' rows of the forward's work table, longest first
    order = (work_items(q_offsets, None, t, batch, kv_rows) if work_table is None
             else work_table)
    kv_first = kv_count = q_offsets  # placeholders, not read
  else:
    kv_first, kv_count = _overlaps(kv_off, TILE, plan.dkv_items)
    order = _jagged_dkv_order(q_offsets, kv_first, kv_count)
  out_type = [jax.ShapeDtypeStruct(k.shape, dtype)] * 2
  if plan.fuse_dq:
    out_type.append(jax.ShapeDtypeStruct(q.shape, dtype))
  if scale_grads:
    out_type.append(jax.ShapeDtypeStruct((heads, plan.dkv_items, 2, 2, BLOCK), jnp.float32))
  # Persistent: at most one CTA per SM (the kernel takes most of an SM's SMEM).
  ctas = max(1, min(mgpu.num_sms(interpret), plan.dkv_work_items))
  plan = dataclasses.replace(plan, dkv_ctas=ctas,
                             dkv_rounds=_cdiv(plan.dkv_work_items, ctas))
  dkv_outs = _call(_dkv_kernel, plan, {"cta": ctas}, out_type, interpret)(
      order, kv_first, kv_count, q_offsets, kv_off, scales, q, do, k, v,
      _q_tail(q, q_offsets), _q_tail(do, q_offsets))
  dk, dv = dkv_outs[:2]

  if plan.fuse_dq:
    dq = dkv_outs[2]
  else:
    q_blocks = _cdiv(t, TILE)
    q_first, q_count = _overlaps(q_offsets, TILE, q_blocks)
    # Dense k/v have no padding rows: a placeholder takes the tail's place.
    k_tail = jnp.zeros((BLOCK, heads, d), dtype) if dense else _tail_block(k, kv_off)
    dq = _call(_dq_kernel, plan, {"h": heads, "item": q_blocks},
               jax.ShapeDtypeStruct(q.shape, dtype), interpret)(
        q_first, q_count, q_offsets, kv_off, scales, q, do, k, v, k_tail)

  if not scale_grads:
    return dq, dk, dv, None, None
  partial = jnp.sum(dkv_outs[-1], axis=(0, 1, 2, 4))  # (d pre / post, d post)
  return dq, dk, dv, partial[0] * scales[1], partial[1]
