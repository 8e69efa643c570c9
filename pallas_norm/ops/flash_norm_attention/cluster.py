"""The FlashNormAttention forward as a cluster of H CTAs, one Pallas Mosaic-GPU kernel for Hopper
(sm_90a): the alternative to :mod:`.mosaic` (one CTA owns every head of a q block), with the
same arguments and outputs. The op runs it where that kernel does not fit (H·D = 1024: H = 8,
D = 128, where ``implementation=None`` takes it: measured faster than the unfused chain,
forward and forward+backward). Where both fit the one-CTA kernel runs: at H = 4 this one
measured 1.7× slower (benchmarks/NOTES.md, "flash_norm_attention": the two cluster exchanges
per q block, about half of the difference to the GDPA kernel alone, and the norms' elementwise
work, both on the two attention consumers, which the one-CTA kernel gives to a warpgroup of its
own). Interpret-tested at H = 1, lowering-checked at H = 2, 4, 8, GPU-tested at H = 2, 4, 8.

Per token over all H·D features (DESIGN.md, op 4; :func:`pallas_norm.reference.flash_norm_attention`)::

    u   = LayerNorm(q)·γ1 + β1              (pre_layer_norm; else u = q)
    z   = u + post·act(pre·u_h K_hᵀ) V_h    (inner_residual; else z = the attention alone)
    out = RMSNorm(z)·γ2 + q                 (outer_residual; else without + q)

Design: a cluster of H CTAs per group of SMs, CTA h of the cluster owning head h of the same q
rows (H ∈ :data:`CLUSTER_SIZES`). Each CTA runs the GDPA kernel's schedule
(:mod:`pallas_norm.ops.gdpa.mosaic`): a persistent walk over the work items (one per sample,
longest first, then chunks of padding rows; every CTA of a cluster walks the same items, the
cluster index on the grid picks them, the CTA's place in the cluster is the head), a TMA
producer warpgroup (q blocks through a ring per consumer, K_h/V_h resident for the sample's
q blocks, the next sample's loaded during the current one), and two consumer warpgroups that
take the q blocks in turn, so one's norms and exchange waits overlap the other's WGMMAs. The
norms hook into the GDPA consumer around its attention step (:class:`_BlockNorms`), per q block:

1. q_h from the ring slot into registers; per row, the head's mean and centred sum of squares
   (exact for rows with a large mean), exchanged with the cluster's other heads through
   distributed shared memory (:func:`pallas_norm.mgpu.exchange.cluster_row_sums`) and merged
   with Chan's formula into (μ1, r1); u_h = (q_h − μ1)·r1·γ1_h + β1_h written over q_h's slot in
   q's dtype (the score WGMMA's A operand; u never goes to GMEM except as the backward's
   residual). q_h stays in registers for the residuals.
2. GDPA's attention on u_h: S = u_h K_hᵀ, act, P·V, per key block.
3. attn_h = post·O rounded to q's dtype (as the unfused chain rounds it), z_h = u_h + attn_h
   (u_h recomputed in f32 from q_h), per-row Σz_h² exchanged → r2; out_h = z_h·r2·γ2_h + q_h
   stored for the segment's rows by the row-exact TMA store
   (:func:`pallas_norm.mgpu.store.store_rows`), the statistics (μ1, r1, r2) by one CTA, in turn
   (every CTA holds the same bits: each merges the same partials in the same order).

With ``save_residuals`` the kernel also writes, in q's dtype, z (the RMSNorm backward's input)
and u (the GDPA backward's q; with the LayerNorm only). Padding rows (past ``q_offsets[-1]``,
the padding chunks, which have no keys) get 0·post_scale in out and the statistics (NaN where
the op poisoned bad traced offsets with NaN scales) and stay unwritten in z and u (the backward
never reads them): a padding chunk is no q load, no norm and no exchange, only stores from a
staged tile (:meth:`_BlockNorms.without_keys`). Rows of a q block outside its sample are
computed (their statistics are per row) but never stored.

Dense K/V only. GPU interpret mode cannot read a peer CTA's shared memory, so it runs only
H = 1 (a cluster of one CTA, no exchange); the exchange at H = 2, 4, 8 runs on the GPU, and its
sm_90a lowering is checked with ``jax.export`` on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_norm import mgpu
from pallas_norm.mgpu import exchange as cluster_exchange
from pallas_norm.mgpu import store
from pallas_norm.ops.flash_norm_attention import mosaic
from pallas_norm.ops.gdpa import configs as gdpa_configs
from pallas_norm.ops.gdpa import mosaic as gdpa_mosaic

_F32 = jnp.float32
BLOCK_Q = gdpa_configs.BLOCK_Q
"""Query rows of a q block: the M of one WGMMA (one consumer warpgroup)."""
STATS_COLS = mosaic.STATS_COLS
CLUSTER_SIZES = (1, 2, 4, 8)
"""Heads H the kernel takes: one CTA per head in a cluster (8 is Hopper's portable limit)."""
Config = gdpa_configs.Config
"""The tiling: the GDPA kernel's (key step, q ring depth, resident or streamed K/V)."""


def _extra_smem_bytes(num_heads: int, head_dim: int) -> int:
  """SMEM of the norms on top of the GDPA kernel's: γ1/β1/γ2 of the head, Pallas's scratch for
  the row reductions, and with H > 1 the exchange's buffers (partials and merged rows) and
  barriers (each allocation rounded up to 1 KB).
  The store tiles of out, z, u and the statistics share the GDPA kernel's output tiles (a
  RefUnion no larger than them)."""
  vecs = -(-3 * head_dim * 4 // 1024) * 1024
  exchange = 0 if num_heads == 1 else 2 * 2 * 1024 + 1024 + 1024
  return vecs + 2048 + exchange + 1024


def pick_config(num_heads: int, head_dim: int, dtype, out_dtype, kv_len: int) -> Config | None:
  """The GDPA kernel's tiling rule (:func:`pallas_norm.ops.gdpa.configs.pick_config`) with the
  norms' SMEM added; None when nothing fits."""
  return gdpa_configs.pick_config(kv_len, head_dim, dtype, out_dtype,
                                  extra_bytes=_extra_smem_bytes(num_heads, head_dim))


def unsupported_reason(q, k, kv_offsets, out_dtype, *, interpret: bool = False) -> str | None:
  """None when the fused kernel can run these (validated) arguments, else why not."""
  reason = mosaic.dense_kv_reason(q, k, kv_offsets, out_dtype)
  if reason is not None:
    return reason
  heads, head_dim = q.shape[1:]
  if heads not in CLUSTER_SIZES:
    return f"H = {heads} heads: the kernel runs a cluster of H CTAs, H in {CLUSTER_SIZES}"
  if interpret and heads > 1:
    return (f"H = {heads}: interpret mode cannot read a peer CTA's shared memory, so it runs "
            "only H = 1 (a cluster of one CTA)")
  if pick_config(heads, head_dim, q.dtype, jnp.dtype(out_dtype or q.dtype), k.shape[1]) is None:
    return f"no tiling fits in SMEM with D = {head_dim}"  # unreachable for D <= 128
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one kernel build: the GDPA schedule of one head (``attention``: its items
  are the segments, its CTAs the clusters) and the norms'."""

  attention: gdpa_mosaic.Plan
  num_heads: int
  head_dim: int
  eps: float
  save_residuals: bool
  pre_layer_norm: bool
  inner_residual: bool
  outer_residual: bool
  stats: bool

  @property
  def exchanges_per_block(self) -> int:
    """Cluster exchanges per q block: the LayerNorm's (mean, M2), then Σz²."""
    return 2 if self.pre_layer_norm else 1

  def exchange_spec(self, n_partials: int) -> cluster_exchange.Spec:
    # "pull": "push" needs an inbox of H packets per consumer, which at H = 4 costs the second
    # K/V buffer (``benchmarks/EXPERIMENTS.md``, FNA cluster exchange).
    # Peer addresses recomputed at each read: hoisted, ptxas spilled them (exchange.py).
    return cluster_exchange.Spec(cluster=self.num_heads, rows=BLOCK_Q, n_partials=n_partials,
                                 exchange="pull", peer_addresses_in_loop=True)


def flash_norm_attention_fwd(q, k, v, q_offsets, affine, pre_scale, post_scale, *,
                             activation: str, eps: float, pre_layer_norm: bool = True,
                             inner_residual: bool = True, outer_residual: bool = True,
                             out_dtype=None, save_residuals: bool = False,
                             return_stats: bool = True,
                             config: Config | None = None, interpret: bool = False):
  """The fused forward as a cluster of H CTAs (arguments validated by the op; see
  :func:`unsupported_reason`): the arguments, outputs and errors of
  :func:`.mosaic.flash_norm_attention_fwd`, with H in :data:`CLUSTER_SIZES` (1 in interpret
  mode) and ``config`` a GDPA kernel tiling (default :func:`pick_config`)."""
  capacity, num_heads, head_dim = q.shape
  out_dtype = jnp.dtype(out_dtype or q.dtype)
  kv_len = k.shape[1]
  cfg = mosaic.checked_config(
      config or pick_config(num_heads, head_dim, q.dtype, out_dtype, kv_len), kv_len)
  table = gdpa_mosaic.work_items(q_offsets, None, capacity, k.shape[0], kv_len)
  num_clusters = mgpu.persistent_clusters(num_heads, table.shape[0], interpret)
  attention = gdpa_mosaic.Plan(
      num_heads=1, num_segments=table.shape[0], num_ctas=num_clusters,
      rounds=-(-table.shape[0] // num_clusters), block_kv=cfg.block_kv, q_stages=cfg.q_stages,
      kv_stages=cfg.kv_stages, kv_buffers=cfg.kv_buffers, kv_chunks=kv_len // cfg.block_kv,
      jagged_kv=False, act=gdpa_mosaic.KERNEL_ACTIVATIONS[activation])
  plan = _Plan(attention=attention, num_heads=num_heads, head_dim=head_dim, eps=float(eps),
               pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
               outer_residual=outer_residual, save_residuals=save_residuals,
               stats=return_stats or save_residuals)
  scales = jnp.stack([jnp.asarray(pre_scale, _F32), jnp.asarray(post_scale, _F32)])
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=mosaic.output_types(q, out_dtype, pre_layer_norm, save_residuals, plan.stats),
      grid=(num_clusters,),
      grid_names=("cta",),  # the GDPA schedule's CTA index: here the cluster's
      cluster=(num_heads,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      kernel_name="fna_fwd",
      scratch_types=_scratch(plan, q.dtype, out_dtype),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=mgpu.interpret_params() if interpret else None,
  )
  # (H, 3, D): one head's γ1, β1, γ2 are one TMA box
  head_affine = jnp.swapaxes(affine.astype(_F32), 0, 1)
  return mosaic.forward_outputs(call(table, scales, head_affine, q, k, v), pre_layer_norm,
                                save_residuals, plan.stats)


def _scratch(plan: _Plan, dtype, out_dtype) -> dict:
  smem = gdpa_mosaic.scratch(plan.attention, plan.head_dim, dtype, out_dtype)
  del smem["o_smem"]  # the stores' tiles below take its place
  d = plan.head_dim
  # A consumer's stores of out, the statistics, z and u take turns (each store_rows first waits
  # for the previous stores to have read SMEM), so they share one tile per consumer: a RefUnion
  # each (one union for both would alias the two consumers' tiles).
  kinds = [(d, out_dtype), (STATS_COLS, _F32)] + [(d, dtype)] * plan.save_residuals
  store_tiles = tuple(plgpu.RefUnion(*(store.row_store_smem(BLOCK_Q, cols, kind_dtype)
                                       for cols, kind_dtype in kinds)) for _ in range(2))
  smem.update(store_tiles=store_tiles,
              vec_smem=plgpu.SMEM((3, d), _F32), vec_ready=plgpu.Barrier())
  exchange = cluster_exchange.allocs(plan.exchange_spec(plan.exchanges_per_block))
  if exchange is not None:
    smem["exchange"] = exchange
  return smem


def _kernel(table_ref, scales_ref, affine_ref, q_ref, k_ref, v_ref, out_ref, *more_refs,
            plan: _Plan, **smem):
  stats_ref, saved_refs = (more_refs[0], more_refs[1:]) if plan.stats else (None, more_refs)
  head = lax.axis_index("cluster")
  attention = plan.attention

  def item_at(round_):  # the cluster's item; this CTA's head
    return dataclasses.replace(gdpa_mosaic.Item.read(table_ref, attention, round_), head=head)

  kv = gdpa_mosaic.kv_pipeline(attention, k_ref, v_ref, smem)

  def produce():
    plgpu.copy_gmem_to_smem(affine_ref.at[head], smem["vec_smem"], smem["vec_ready"])
    gdpa_mosaic.producer(attention, item_at, kv, q_ref, smem)

  def consume():
    plgpu.barrier_wait(smem["vec_ready"])
    norms_for = functools.partial(_BlockNorms, plan, (out_ref, stats_ref, *saved_refs), smem,
                                  q_ref.dtype)
    gdpa_mosaic.consumer(attention, item_at, kv, scales_ref, norms_for, smem)

  mgpu.warp_specialize(produce, consume)


def merge_layer_norm(per_cta, head_dim: int, eps: float):
  """(μ1, r1) of the rows from each head's partials (mean, centred sum of squares) over its
  ``head_dim`` features, in CTA order: Chan's parallel variance (every head has the same count),
  exact for rows with a large mean."""
  heads = len(per_cta)
  mean = mgpu.tree_sum([m for m, _ in per_cta]) * (1.0 / heads)
  m2 = mgpu.tree_sum([m2 + head_dim * jnp.square(m - mean) for m, m2 in per_cta])
  return mean, lax.rsqrt(m2 * (1.0 / (heads * head_dim)) + eps)


def merge_rms(per_cta, head_dim: int, eps: float):
  """(r2,) of the rows from each head's partial sum of squares (the first partial), in CTA
  order."""
  squares = mgpu.tree_sum([s for s, *_ in per_cta])
  return (lax.rsqrt(squares * (1.0 / (len(per_cta) * head_dim)) + eps),)


def _recomputed(stats, count):
  """The LayerNorm's row statistics ``stats`` (or None) as the same bits, ORed with
  ``opaque_zero(count)``, for u_h's recomputation after the attention.

  Before the attention u_h = (q_h − μ1)·r1 is computed in f32 from q_h and (μ1, r1) in
  registers; after it the inner residual computes the same expression from the same values, so
  LLVM kept the first result, 64 f32 registers per thread next to q_h's 32, live across the
  attention (the consumer's register peak), and ptxas spilled around the key loop in every q
  block. Statistics LLVM cannot prove equal make the second a computation of its own."""
  if stats is None:
    return None
  zero = mgpu.opaque_zero(count)
  return tuple(lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.int32) | zero, _F32)
               for v in stats)


def _rowvec(v, shape):
  """A row vector (layout WGMMA.reduce(1)) broadcast over the columns of ``shape``."""
  return lax.broadcast_in_dim(v, shape, [0])


def _row_sum(x):
  """Row sums of a (BLOCK_Q, D) f32 tile in the WGMMA layout: per-thread partial sums of the
  8-column slices, then one reduction across lanes."""
  return jnp.sum(mgpu.lane_partial_sum(x), axis=1)


class _BlockNorms:
  """The norms around the GDPA consumer's attention step (the hooks of
  :class:`pallas_norm.ops.gdpa.mosaic.OutputStore`), for consumer warpgroup ``wg``."""

  def __init__(self, plan: _Plan, out_refs, smem, dtype, post_scale):
    self.plan, self.dtype, self.post_scale = plan, dtype, post_scale
    self.out_ref, self.stats_ref, *saved = out_refs
    self.z_ref, self.u_ref = (*saved, None, None)[:2]
    self.store_tiles = smem["store_tiles"]
    self.vec_smem = smem["vec_smem"]
    self.ex = (cluster_exchange.Exchange(**smem["exchange"]) if "exchange" in smem else None)
    self._merge_layer_norm = functools.partial(merge_layer_norm, head_dim=plan.head_dim,
                                               eps=plan.eps)
    self._merge_rms = functools.partial(merge_rms, head_dim=plan.head_dim, eps=plan.eps)

  def _exchange(self, partials: tuple, wg, index, merge):
    """``merge`` of the cluster's per-row partials (exchange ``index`` of the warpgroup)."""
    ex = self.ex
    if ex is not None and ex.part is not None and len(ex.part[0]) > len(partials):
      ex = dataclasses.replace(ex, part=tuple(part[:len(partials)] for part in ex.part))
    return cluster_exchange.cluster_row_sums(self.plan.exchange_spec(len(partials)), partials,
                                             ex, wg, index, merge)

  def _colvec(self, which: int, shape):
    """γ1 (0), β1 (1) or γ2 (2) of the head, broadcast over the rows of ``shape``."""
    v = plgpu.load(self.vec_smem.at[which], layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(v, shape, [1])

  def _pre_norm(self, x, stats):
    """u_h in f32 from q_h (f32): the LayerNorm with the row's (μ1, r1), γ1, β1; or q_h."""
    if stats is None:
      return x
    mean, rstd = stats
    u = (x - _rowvec(mean, x.shape)) * _rowvec(rstd, x.shape)
    return u * self._colvec(0, x.shape) + self._colvec(1, x.shape)

  def _store_rows(self, kind: int, tile, dst_at, item, block, wg):
    """:func:`store.store_rows` of the segment's rows of ``tile`` through consumer ``wg``'s
    store tile of ``kind`` (0: out, 1: statistics, 2: z and u)."""
    for w, tiles in enumerate(self.store_tiles):
      @pl.when(wg == w)
      def _(tiles=tiles):
        store.store_rows(tile, tiles[kind].at[0], dst_at, *gdpa_mosaic.block_rows(item, block))

  def _store(self, ref, kind: int, value, item, block, wg):
    self._store_rows(kind, value.astype(ref.dtype),
                     lambda rows, cols: ref.at[rows, item.head, cols], item, block, wg)

  def without_keys(self, item, wg):
    """A padding chunk's blocks of consumer ``wg`` (no keys, no q load): 0·post_scale in out
    and the statistics (NaN where the op poisoned the scales), each from a tile staged once,
    the statistics' blocks shared out over the cluster's CTAs; no exchange (every CTA of the
    cluster skips the same items) and z, u unwritten (the backward never reads them)."""
    plan = self.plan
    blocks = item.zero_blocks_of(wg)
    for w, tiles in enumerate(self.store_tiles):
      @pl.when(wg == w)
      def _(w=w, tiles=tiles):
        out_tile = tiles[0].at[0]
        store.stage(gdpa_mosaic.zero_tile(plan.head_dim, self.post_scale, self.out_ref.dtype),
                    out_tile)

        @pl.loop(0, blocks)
        def _(turn):
          store.copy_rows(out_tile, lambda rows, cols: self.out_ref.at[rows, item.head, cols],
                          *gdpa_mosaic.block_rows(item, w + 2 * turn))

        if self.stats_ref is not None:
          stats_tile = tiles[1].at[0]  # the union's: staged once out's stores have read it
          store.stage(gdpa_mosaic.zero_tile(STATS_COLS, self.post_scale, _F32), stats_tile)

          @pl.loop(0, blocks)
          def _(turn):
            block = w + 2 * turn

            @pl.when(item.head == lax.rem(block, plan.num_heads))
            def _():
              store.copy_rows(stats_tile, lambda rows, cols: self.stats_ref.at[rows, cols],
                              *gdpa_mosaic.block_rows(item, block))

  def before_attention(self, item, block, q_tile, wg, count):
    """q_h into registers (kept for the residuals), the LayerNorm statistics by the cluster
    exchange, u_h over q_h's slot (and saved for the backward). Returns (q_h, (μ1, r1))."""
    plan = self.plan
    if not (plan.pre_layer_norm or plan.inner_residual or plan.outer_residual):
      return None, None
    x = plgpu.load(q_tile, layout=plgpu.Layout.WGMMA)
    if not plan.pre_layer_norm:  # the WGMMA reads q_h as TMA wrote it
      # Our generic-proxy reads of the slot, ordered before the producer's TMA (async proxy)
      # overwrites it once the attention releases the slot (GPU interpret mode's race detector
      # caught the unordered pair with one key block per head).
      plgpu.commit_smem()
      return x, None
    xf = x.astype(_F32)
    head_mean = _row_sum(xf) * (1.0 / plan.head_dim)
    centred = xf - _rowvec(head_mean, xf.shape)
    stats = self._exchange((head_mean, _row_sum(centred * centred)), wg,
                           count * plan.exchanges_per_block, self._merge_layer_norm)
    u = self._pre_norm(xf, stats).astype(q_tile.dtype)
    q_tile[...] = u
    plgpu.commit_smem()  # generic-proxy writes, before WGMMA (async proxy) reads them
    if self.u_ref is not None:
      self._store(self.u_ref, 2, u, item, block, wg)
    keep = x if (plan.inner_residual or plan.outer_residual) else None
    return keep, stats

  def after_attention(self, item, block, o, before, wg, count):
    """z_h = u_h + attn_h, r2 by the cluster exchange, out_h = z_h·r2·γ2 + q_h; the stores."""
    plan = self.plan
    x, ln_stats = before
    z = (o * self.post_scale).astype(self.dtype).astype(_F32)  # attn, rounded as the chain's
    if plan.inner_residual:
      z = z + self._pre_norm(x.astype(_F32), _recomputed(ln_stats, count))
    squares = _row_sum(z * z)
    if self.z_ref is not None:  # its TMA store runs during the exchange
      self._store(self.z_ref, 2, z, item, block, wg)
    (rms_rstd,) = self._exchange((squares,), wg, (count + 1) * plan.exchanges_per_block - 1,
                                 self._merge_rms)
    out = z * _rowvec(rms_rstd, z.shape) * self._colvec(2, z.shape)
    if plan.outer_residual:
      out = out + x.astype(_F32)
    self._store(self.out_ref, 0, out, item, block, wg)
    columns = {2: rms_rstd, **(dict(enumerate(ln_stats)) if ln_stats is not None else {})}

    # Every CTA of the cluster holds the same statistics: the CTAs take turns storing them, so
    # no one CTA is always the last to reach the next exchange.
    if self.stats_ref is not None:
      @pl.when(item.head == lax.rem(count, plan.num_heads))
      def _():
        self._store_stats(columns, item, block, wg)

  def _store_stats(self, columns: dict, item, block, wg):
    """``columns``: {column: row vector}; the other columns 0."""
    shape = (BLOCK_Q, STATS_COLS)
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    tile = plgpu.layout_cast(jnp.zeros(shape, _F32), plgpu.Layout.WGMMA)
    for j, vec in columns.items():
      tile = jnp.where(col == j, _rowvec(vec, shape), tile)
    self._store_rows(1, tile,
                     lambda rows, cols: self.stats_ref.at[rows, cols], item, block, wg)

  def finish(self, wg, count):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads
    if self.ex is not None:
      @pl.when(count > 0)  # no CTA exits while its peers may still read its partials
      def _():
        cluster_exchange.final_sync(self.plan.exchange_spec(1), self.ex, wg)
