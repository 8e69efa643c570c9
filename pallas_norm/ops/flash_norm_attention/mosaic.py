"""The FlashNormAttention forward as one Pallas Mosaic-GPU kernel for Hopper (sm_90a).

Per token over all H·D features (DESIGN.md, op 4; :func:`pallas_norm.reference.flash_norm_attention`)::

    u   = LayerNorm(q)·γ1 + β1              (pre_layer_norm; else u = q)
    z   = u + post·act(pre·u_h K_hᵀ) V_h    (inner_residual; else z = the attention alone)
    out = RMSNorm(z)·γ2 + q                 (outer_residual; else without + q)

Design: one CTA owns every head of a q block, so both norms reduce inside the CTA (no cluster
exchange). Work items are the GDPA kernel's (:func:`pallas_norm.ops.gdpa.mosaic.work_items`: one
per sample, longest first, then chunks of padding rows); a CTA walks its sample's q blocks of
``BLOCK_Q`` rows. Three warpgroups, as the reference megakernel splits MMA warps from norm
warps, and SMEM laid out so that the attention warpgroup never waits for a block boundary:

* the producer (:data:`PRODUCER_WG`, TMA): each head's K_h/V_h in ``block_kv``-row blocks
  through a ring of ``kv_stages`` slots, and q tiles (one head of one q block) through a ring
  of ``q_stages`` slots, in the order the norm warpgroup reads them (:func:`_q_stream`): q is
  streamed, never held for a whole block (each tile is read three times per block, from L2 but
  the first).
* the norm warpgroup (:data:`NORM_WG`): per q block b, while the attention runs: the LayerNorm
  statistics (μ1, r1) of block b + 1 (per-head mean and centred sum of squares merged across
  heads, Chan's formula: exact for rows with a large mean); per head, once z_h of block b is
  back (``z_ready``), its Σz² term, and the next u tile (u_h = LN(q_h) into a ring of
  :data:`U_SLOTS` tiles, ``u_ready``: of block b, or of block b + 1 for the last heads); then
  r2 and out_h = z_h·r2·γ2 + q_h per head, each stored with the row-exact TMA store
  (:func:`pallas_norm.mgpu.store.store_rows`), each z tile handed back (``z_free``), and the
  statistics (μ1, r1, r2) (float32, columns 0-2 of a (T, :data:`STATS_COLS`) array).
* the attention warpgroup (:data:`ATTENTION_WG`): per head, S = u_h K_hᵀ, act in registers,
  P through SMEM, O = P V_h per key block (each step's WGMMAs run to completion), then
  z_h = u_h + post·O rounded once to q's dtype into the head's z tile (one per head: the
  RMSNorm needs every head's z before any output).

The loops over the heads are dynamic (``lax.fori_loop``/``pl.loop``): unrolled statically, the
H = 4 kernel ran about 4× slower on the H200. The single-consumer schedule, an overlapped
WGMMA order (next scores issued before the P·V) and a kernel holding the q block twice in SMEM
(whose attention warpgroup waited at every block boundary for the epilogue, the next q block's
load and its statistics) were measured slower (benchmarks/EXPERIMENTS.md).

z = u + attn is rounded once to q's dtype (u as the attention read it, in q's dtype), so the
RMSNorm and its backward see the same z; the statistics and the residual sums are float32.
With ``save_residuals`` the kernel also writes, in q's dtype, z (the RMSNorm backward's input:
recomputing attn would cost a second attention pass) and u (the GDPA backward's q; with the
LayerNorm only), both from registers the norm warpgroup holds anyway.

Dense K/V only (Lkv a multiple of 64); rows of a q block outside its sample are computed (their
statistics are per row) but never stored. WGMMA reads P from SMEM, as the GDPA kernel does
(GPU interpret mode has no register-A WGMMA).
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

from pallas_norm import mgpu
from pallas_norm.mgpu import store
from pallas_norm.ops.gdpa import configs as gdpa_configs
from pallas_norm.ops.gdpa import mosaic as gdpa_mosaic

_F32 = jnp.float32
BLOCK_Q = 64
"""Query rows of a q block: the M of one WGMMA (one consumer warpgroup)."""
STATS_COLS = 32
"""Columns of the statistics output (T, 32): μ1, r1, r2, then zeros. A row of 128 bytes: the
row-exact store starts TMA stores at any row of the SMEM tile, and TMA needs SMEM addresses
aligned to 128 bytes (32-byte rows gave CUDA_ERROR_MISALIGNED_ADDRESS on the H200)."""
U_SLOTS = 2
"""Tiles of the u ring (fewer when H is smaller): u of the next head is written while the
attention reads the current one."""

NORM_WG, ATTENTION_WG, PRODUCER_WG = 0, 1, 2
"""The warpgroups of the kernel (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling: ``block_kv`` keys per WGMMA step (64; P is BLOCK_Q × block_kv), ``kv_stages``
  slots of the K/V ring (>= 2), ``q_stages`` slots of the q ring (>= 2)."""

  block_kv: int = 64
  kv_stages: int = 2
  q_stages: int = 2

  def __post_init__(self):
    gdpa_configs.check_block_kv(self.block_kv)
    if self.kv_stages < 2:
      raise ValueError(f"kv_stages must be >= 2, got {self.kv_stages}")
    if self.q_stages < 2:
      raise ValueError(f"q_stages must be >= 2, got {self.q_stages}")


def smem_bytes(num_heads: int, head_dim: int, dtype, out_dtype, cfg: Config) -> int:
  """SMEM of one CTA: a z tile per head, the u ring, the q ring, the K/V ring, P, one store
  tile (out, z, u and the statistics take turns in it: a RefUnion) and γ1/β1/γ2. Every
  allocation is rounded up to 1 KB (Pallas's SMEM alignment)."""
  item, out_item = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
  tiles = (num_heads + min(U_SLOTS, num_heads) + cfg.q_stages) * BLOCK_Q * head_dim * item
  kv = 2 * cfg.kv_stages * cfg.block_kv * head_dim * item
  p = BLOCK_Q * cfg.block_kv * item
  # z's and u's tile is the union's, never larger than out's or the statistics'
  tile = max(BLOCK_Q * head_dim * max(out_item, item), BLOCK_Q * STATS_COLS * 4)
  vecs = -(-3 * num_heads * head_dim * 4 // 1024) * 1024
  reduction = 2048  # Pallas's cross-warp reduction scratch (the row sums)
  return tiles + kv + p + tile + vecs + reduction + 1024  # + the barriers


def pick_config(num_heads: int, head_dim: int, dtype, out_dtype, kv_len: int) -> Config | None:
  """The deepest K/V ring (4, 3 or 2 slots of 64 keys, at most the key blocks of a q block),
  then the deepest q ring (3 or 2 slots), that fit in SMEM; None when none does."""
  blocks = num_heads * kv_len // 64
  for stages in (4, 3, 2):
    for q_stages in (3, 2):
      cfg = Config(block_kv=64, kv_stages=max(2, min(stages, blocks)), q_stages=q_stages)
      if smem_bytes(num_heads, head_dim, dtype, out_dtype, cfg) <= mgpu.SMEM_BYTES:
        return cfg
  return None


def unsupported_reason(q, k, kv_offsets, out_dtype) -> str | None:
  """None when the fused kernel can run these (validated) arguments, else why not."""
  reason = gdpa_mosaic.operand_reason(q, out_dtype)
  if reason is not None:
    return reason
  dtype = jnp.dtype(q.dtype)
  out_dtype = jnp.dtype(out_dtype or dtype)
  t, heads, head_dim = q.shape
  if t == 0:
    return "zero token capacity: no q block for the fused kernel"
  if kv_offsets is not None:
    return "jagged K/V: the fused kernel takes dense K/V only"
  if k.shape[1] == 0 or k.shape[1] % 64:
    return f"dense K/V length Lkv = {k.shape[1]} is not a positive multiple of 64"
  if t % gdpa_mosaic.ALIGN:
    return f"the token capacity T = {t} must be a multiple of {gdpa_mosaic.ALIGN}"
  if pick_config(heads, head_dim, dtype, out_dtype, k.shape[1]) is None:
    return (f"H·D = {heads}·{head_dim}: a z tile per head, the u and q rings and the K/V ring "
            "do not fit in SMEM")
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one kernel build."""

  num_heads: int
  head_dim: int
  kv_steps: int
  block_kv: int
  kv_stages: int
  q_stages: int
  act: Callable
  eps: float
  pre_layer_norm: bool
  inner_residual: bool
  outer_residual: bool
  save_residuals: bool

  @property
  def uses_per_block(self) -> int:
    """K/V ring slots one q block consumes: every head's key blocks."""
    return self.num_heads * self.kv_steps

  @property
  def u_slots(self) -> int:
    return min(U_SLOTS, self.num_heads)

  def next_u(self, head):
    """The u tile written once ``head``'s z is back (its u slot is free): (blocks ahead 0 or
    1, head), ``u_slots`` heads further on."""
    ahead = head + self.u_slots
    return ahead // self.num_heads, ahead % self.num_heads
def flash_norm_attention_fwd(q, k, v, q_offsets, affine, pre_scale, post_scale, *,
                             activation: str, eps: float, pre_layer_norm: bool = True,
                             inner_residual: bool = True, outer_residual: bool = True,
                             out_dtype=None, save_residuals: bool = False,
                             config: Config | None = None, interpret: bool = False):
  """The fused forward (arguments validated by the op; see :func:`unsupported_reason`).

  Args:
    q: (T, H, D) bf16/f16 packed tokens; k, v: dense (B, Lkv, H, D), q's dtype.
    q_offsets: int32 (B+1,) offsets of q.
    affine: float32 (3, H, D): γ1, β1, γ2 (ones/zeros where the op has none).
    pre_scale, post_scale: f32 scalars (0-d arrays, traced or not).
    activation: a key of :data:`pallas_norm.reference.ACTIVATIONS`.
    eps: the norms' epsilon (static).
    pre_layer_norm, inner_residual, outer_residual: the block's switches (static).
    out_dtype: bf16, f16 or f32 (default q's dtype).
    save_residuals: also return, in q's dtype, z = u + attn (or attn without the inner
      residual; attn = post·act(pre·u Kᵀ) V rounded to q's dtype) and, with the LayerNorm, u
      (for the backward).
    config: tiling (default :func:`pick_config`).
    interpret: run in Pallas GPU interpret mode (any backend).

  Returns:
    ``(out, stats)`` or ``(out, stats, z, u)``: out (T, H, D) in out_dtype; stats
    (T, :data:`STATS_COLS`) float32 with μ1, r1, r2 in columns 0-2 (μ1, r1 zeros without the
    LayerNorm; the row kernels of the backward read the columns in place, no slice pass);
    z, u (T, H, D) (u None without the LayerNorm). Padding rows (past
    ``q_offsets[-1]``) are zeros in every output.
  """
  capacity, num_heads, head_dim = q.shape
  out_dtype = jnp.dtype(out_dtype or q.dtype)
  kv_len = k.shape[1]
  cfg = config or pick_config(num_heads, head_dim, q.dtype, out_dtype, kv_len)
  if kv_len % cfg.block_kv:
    raise ValueError(f"block_kv = {cfg.block_kv} does not divide Lkv = {kv_len}")
  plan = _Plan(num_heads=num_heads, head_dim=head_dim, kv_steps=kv_len // cfg.block_kv,
               block_kv=cfg.block_kv, kv_stages=cfg.kv_stages, q_stages=cfg.q_stages,
               act=gdpa_mosaic.KERNEL_ACTIVATIONS[activation], eps=float(eps),
               pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
               outer_residual=outer_residual, save_residuals=save_residuals)
  table = _work_table(q_offsets, capacity, k.shape[0], kv_len)
  scales = jnp.stack([jnp.asarray(pre_scale, _F32), jnp.asarray(post_scale, _F32)])
  out_type = [jax.ShapeDtypeStruct((capacity, num_heads, head_dim), out_dtype),
              jax.ShapeDtypeStruct((capacity, STATS_COLS), _F32)]
  residual = jax.ShapeDtypeStruct((capacity, num_heads, head_dim), q.dtype)
  if save_residuals:  # z, then u with the LayerNorm
    out_type += [residual] * (2 if pre_layer_norm else 1)
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=tuple(out_type),
      grid=(table.shape[0],),
      grid_names=("item",),
      num_threads=3,
      thread_name="wg",
      kernel_name=_kernel_name(cfg),
      scratch_types=_scratch(plan, q.dtype, out_dtype),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=mgpu.interpret_params() if interpret else None,
  )
  out, stats, *saved = call(table, scales, affine.astype(_F32), q, k, v)
  if not save_residuals:
    return out, stats
  return out, stats, saved[0], saved[1] if pre_layer_norm else None


def _kernel_name(cfg: Config) -> str:
  """The kernel's name in profiles and Mosaic's dumps: ``fna_fwd`` and the config's fields that
  differ from the defaults (so an A/B's ptxas reports can be told apart)."""
  default = Config()
  tags = [f"{f.name}_{getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
          if getattr(cfg, f.name) != getattr(default, f.name)]
  return "_".join(["fna_fwd", *tags]).lower()


PADDING = 7
"""Column of the work table appended to the GDPA kernel's: 1 for a chunk of padding rows."""


def _work_table(q_offsets, capacity: int, batch: int, kv_len: int):
  """The GDPA kernel's work items (one per sample, longest first, then the padding chunks),
  with a :data:`PADDING` column: such items have no keys and store zeros."""
  table = gdpa_mosaic.work_items(q_offsets, None, capacity, batch, kv_len)
  end = jnp.clip(q_offsets[-1].astype(jnp.int32), 0, capacity)
  first_row = table[:, gdpa_mosaic.Q_WIN] + table[:, gdpa_mosaic.Q_LO]
  padding = (first_row >= end).astype(jnp.int32)
  return jnp.concatenate([table, padding[:, None]], axis=1)


def _scratch(plan: _Plan, dtype, out_dtype) -> dict:
  heads, d = plan.num_heads, plan.head_dim
  tile = mgpu.swizzle_transforms(d, dtype)
  # The stores of out, z, u and the statistics take turns (each store_rows first waits for the
  # previous stores to have read SMEM), so they share one tile.
  store_tiles = [store.row_store_smem(BLOCK_Q, d, out_dtype),
                 store.row_store_smem(BLOCK_Q, STATS_COLS, _F32)]
  if plan.save_residuals:
    store_tiles.append(store.row_store_smem(BLOCK_Q, d, dtype))
  return dict(
      store_tiles=plgpu.RefUnion(*store_tiles),
      z_smem=plgpu.SMEM((heads, BLOCK_Q, d), dtype, transforms=tile),
      u_smem=plgpu.SMEM((plan.u_slots, BLOCK_Q, d), dtype, transforms=tile),
      q_smem=plgpu.SMEM((plan.q_stages, BLOCK_Q, d), dtype, transforms=tile),
      k_smem=plgpu.SMEM((plan.kv_stages, plan.block_kv, d), dtype, transforms=tile),
      v_smem=plgpu.SMEM((plan.kv_stages, plan.block_kv, d), dtype, transforms=tile),
      p_smem=plgpu.SMEM((BLOCK_Q, plan.block_kv), dtype,
                        transforms=mgpu.swizzle_transforms(plan.block_kv, dtype)),
      vec_smem=plgpu.SMEM((3, heads, d), _F32),
      vec_ready=plgpu.Barrier(),
      q_ready=plgpu.Barrier(num_barriers=plan.q_stages),
      q_free=plgpu.Barrier(num_barriers=plan.q_stages),
      k_ready=plgpu.Barrier(num_barriers=plan.kv_stages),
      v_ready=plgpu.Barrier(num_barriers=plan.kv_stages),
      kv_free=plgpu.Barrier(num_barriers=plan.kv_stages),
      u_ready=plgpu.Barrier(num_barriers=heads),
      z_ready=plgpu.Barrier(num_barriers=heads),
      z_free=plgpu.Barrier(num_barriers=heads),
  )


@dataclasses.dataclass(frozen=True)
class _Item:
  """One CTA's work item: a sample's q rows ``[q_win + q_lo, q_win + q_hi)`` in ``q_blocks``
  blocks from ``q_win``, its K/V index, and whether it is a padding chunk."""

  q_win: jax.Array
  q_lo: jax.Array
  q_hi: jax.Array
  q_blocks: jax.Array
  sample: jax.Array
  padding: jax.Array

  @classmethod
  def read(cls, table_ref):
    col = lambda c: table_ref[lax.axis_index("item"), c]  # noqa: E731
    return cls(q_win=pl.multiple_of(col(gdpa_mosaic.Q_WIN), gdpa_mosaic.ALIGN),
               q_lo=col(gdpa_mosaic.Q_LO), q_hi=col(gdpa_mosaic.Q_HI),
               q_blocks=col(gdpa_mosaic.Q_BLOCKS), sample=col(gdpa_mosaic.KV_WIN),
               padding=col(PADDING) != 0)

  @property
  def has_blocks(self):
    return jnp.logical_and(jnp.logical_not(self.padding), self.q_blocks > 0)

  def rows(self, block):
    """(first GMEM row of q block ``block``, the sample's rows in it as [lo, lo + count))."""
    lo = jnp.maximum(self.q_lo - block * BLOCK_Q, 0)
    hi = jnp.minimum(self.q_hi - block * BLOCK_Q, BLOCK_Q)
    return self.q_win + block * BLOCK_Q, lo, hi - lo


@dataclasses.dataclass(frozen=True)
class _QStream:
  """The order of the q ring's uses, which the producer loads and the norm warpgroup reads:
  first the item's statistics pass over block 0 (H tiles, with the LayerNorm only) and its
  first ``u_slots`` u tiles; then per q block b, ``per_block`` uses from :meth:`base`:

  * per head h < H − u_slots, the q tile of the u written once z_h of block b is back
    (:meth:`_Plan.next_u`: u_{h + u_slots} of block b),
  * the H tiles of block b + 1 for its statistics (with the LayerNorm only): late, so that
    the u tiles of block b are not queued behind them, early enough for
  * per head h >= H − u_slots, the q tile of the next u: of block b + 1,
  * the H tiles of block b for the outer residual of the epilogue.

  In the item's last block the uses of block b + 1 load block b again and are read by nobody
  (released at once), so that every block has the same uses."""

  plan: _Plan

  @property
  def stats_uses(self) -> int:
    return self.plan.num_heads if self.plan.pre_layer_norm else 0

  @property
  def prologue(self) -> int:
    return self.stats_uses + self.plan.u_slots

  @property
  def per_block(self) -> int:
    return self.stats_uses + 2 * self.plan.num_heads

  def base(self, block):
    return self.prologue + block * self.per_block

  def stats_use(self, block):
    """The first of the statistics pass's uses."""
    return self.base(block) + self.plan.num_heads - self.plan.u_slots

  def u_use(self, block, head, ahead: int):
    """The use of the u tile written once z_h is back (``ahead``: that u is of block b + 1)."""
    return self.base(block) + head + (self.stats_uses if ahead else 0)

  def epilogue_use(self, block, head):
    return self.base(block) + self.stats_uses + self.plan.num_heads + head

  def total(self, blocks):
    return self.base(blocks)

  def slot(self, use):
    return lax.rem(use, self.plan.q_stages)

  def load(self, use, q_ref, item: _Item, block, head, smem) -> None:
    """Producer: q tile (``block``, ``head``) into the slot of ``use``, once its previous
    use was released."""
    slot = self.slot(use)

    @pl.when(use >= self.plan.q_stages)
    def _():
      plgpu.barrier_wait(smem["q_free"].at[slot])

    rows = pl.ds(pl.multiple_of(item.q_win + block * BLOCK_Q, gdpa_mosaic.ALIGN), BLOCK_Q)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, head], smem["q_smem"].at[slot],
                            smem["q_ready"].at[slot])

  def take(self, use, smem):
    """Norm warpgroup: waits for the tile of ``use``; returns its SMEM ref."""
    slot = self.slot(use)
    plgpu.barrier_wait(smem["q_ready"].at[slot])
    return smem["q_smem"].at[slot]

  def read(self, use, smem):
    """Norm warpgroup: the tile of ``use`` in float32 registers; its slot released."""
    x = _load_f32(self.take(use, smem))
    self.release(use, smem)
    return x

  def release(self, use, smem) -> None:
    """The slot was read by the generic proxy: a proxy fence before the producer's TMA (async
    proxy) may overwrite it, as the PTX memory model asks."""
    plgpu.commit_smem()
    plgpu.barrier_arrive(smem["q_free"].at[self.slot(use)])


def _kernel(table_ref, scales_ref, affine_ref, q_ref, k_ref, v_ref, out_ref, stats_ref,
            *saved_refs, plan: _Plan, **smem):
  item = _Item.read(table_ref)
  wg = lax.axis_index("wg")

  @pl.when(wg == PRODUCER_WG)
  def _producer():
    plgpu.set_max_registers(mgpu.PRODUCER_REGISTERS, action="decrease")
    _produce(plan, item, affine_ref, q_ref, k_ref, v_ref, smem)

  @pl.when(wg == NORM_WG)
  def _norms():
    plgpu.set_max_registers(mgpu.CONSUMER_REGISTERS, action="increase")
    _consume(plan, item, scales_ref, out_ref, stats_ref, saved_refs, smem)

  @pl.when(wg == ATTENTION_WG)
  def _attention():
    plgpu.set_max_registers(mgpu.CONSUMER_REGISTERS, action="increase")
    _consume_attention(plan, item, scales_ref, smem)


def _produce(plan: _Plan, item: _Item, affine_ref, q_ref, k_ref, v_ref, smem) -> None:
  """TMA warpgroup: γ1/β1/γ2 once; then the q tiles in :class:`_QStream`'s order with each
  head's K/V blocks between them: head h + 1's after the q tile of the u that head h's z
  frees, so that no load waits for a release that needs a load queued behind it (a K/V load
  may wait for the attention to have read the slot: the u tile that head needs was queued
  before it)."""
  plgpu.copy_gmem_to_smem(affine_ref, smem["vec_smem"], smem["vec_ready"])
  heads, per_block, stages = plan.num_heads, plan.uses_per_block, plan.kv_stages
  stream = _QStream(plan)
  last = item.q_blocks - 1

  def load_kv(block, head):  # ring use number block·per_block + head·kv_steps + step
    for step in range(plan.kv_steps):
      ring_use = block * per_block + head * plan.kv_steps + step
      slot = lax.rem(ring_use, stages)

      @pl.when(ring_use >= stages)
      def _():
        plgpu.barrier_wait(smem["kv_free"].at[slot])

      keys = pl.ds(step * plan.block_kv, plan.block_kv)
      plgpu.copy_gmem_to_smem(k_ref.at[item.sample, keys, head], smem["k_smem"].at[slot],
                              smem["k_ready"].at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[item.sample, keys, head], smem["v_smem"].at[slot],
                              smem["v_ready"].at[slot])

  def load_q(use, block, head):
    stream.load(use, q_ref, item, block, head, smem)

  @pl.when(item.has_blocks)
  def _():
    for head in range(stream.stats_uses):
      load_q(head, 0, head)
    for head in range(plan.u_slots):
      load_q(stream.stats_uses + head, 0, head)
    load_kv(0, 0)  # after the q tiles u_0 needs: its later key blocks wait for the attention

    @pl.loop(0, item.q_blocks)
    def _block(block):
      following = jnp.minimum(block + 1, last)  # the last block loads itself again
      for head in range(heads):
        ahead, u_head = plan.next_u(head)
        if head == heads - plan.u_slots:  # before the first u of block b + 1
          for j in range(stream.stats_uses):
            load_q(stream.stats_use(block) + j, following, j)
        load_q(stream.u_use(block, head, ahead), jnp.minimum(block + ahead, last), u_head)
        if head + 1 < heads:
          load_kv(block, head + 1)
        else:
          @pl.when(block < last)
          def _():
            load_kv(block + 1, 0)
      for head in range(heads):
        load_q(stream.epilogue_use(block, head), block, head)

    # Observe the releases no load waited for, so every barrier phase is consumed.
    q_uses = stream.total(item.q_blocks)

    @pl.loop(jnp.maximum(q_uses - plan.q_stages, 0), q_uses)
    def _(use):
      plgpu.barrier_wait(smem["q_free"].at[stream.slot(use)])

    uses = item.q_blocks * per_block

    @pl.loop(jnp.maximum(uses - stages, 0), uses)
    def _(use):
      plgpu.barrier_wait(smem["kv_free"].at[lax.rem(use, stages)])


def _consume(plan: _Plan, item: _Item, scales_ref, out_ref, stats_ref, saved_refs,
             smem) -> None:
  """The norm warpgroup: every q block of the item (or zeros for a padding chunk)."""
  plgpu.barrier_wait(smem["vec_ready"])
  o_tile, stats_tile, *saved_tile = smem["store_tiles"]
  z_ref, u_ref = (*saved_refs, None, None)[:2]
  stores = _Stores(out_ref, stats_ref, z_ref, u_ref, o_tile.at[0], stats_tile.at[0],
                   saved_tile[0].at[0] if saved_tile else None)

  @pl.when(item.padding)
  def _():
    @pl.loop(0, item.q_blocks)
    def _block(block):
      stores.zeros(plan, item.rows(block), scales_ref[1])

  @pl.when(item.has_blocks)
  def _():
    _norm_item(plan, item, stores, smem)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the stores' reads


@dataclasses.dataclass(frozen=True)
class _Stores:
  """The norm warpgroup's row-exact stores of one q block: out, z and u per head (z and u, the
  backward's residuals, only when saved; u only with the LayerNorm), the statistics."""

  out_ref: object
  stats_ref: object
  z_ref: object
  u_ref: object
  o_tile: object
  stats_tile: object
  saved_tile: object

  def out(self, tile, rows, head):
    store.store_rows(tile.astype(self.out_ref.dtype), self.o_tile,
                     lambda r, c: self.out_ref.at[r, head, c], *rows)

  def saved(self, ref, tile, rows, head):
    """z or u (``ref``; nothing when None) of ``head``, in q's dtype."""
    if ref is not None:
      store.store_rows(tile.astype(ref.dtype), self.saved_tile,
                       lambda r, c: ref.at[r, head, c], *rows)

  def saved_from_smem(self, ref, tile, smem_tile, rows, head):
    """As :meth:`saved`, but a block whose 64 rows are all the sample's is one TMA store
    straight from ``smem_tile`` (its z tile or u slot, holding ``tile`` in q's dtype), with no
    register pass through the shared store tile. The caller waits for its SMEM read
    (``wait_smem_to_gmem``) before that SMEM is written again."""
    if ref is None:
      return
    row0, lo, count = rows
    full = jnp.logical_and(lo == 0, count == BLOCK_Q)

    @pl.when(full)
    def _():
      block_rows = pl.ds(pl.multiple_of(row0, gdpa_mosaic.ALIGN), BLOCK_Q)
      plgpu.copy_smem_to_gmem(smem_tile, ref.at[block_rows, head])

    @pl.when(jnp.logical_not(full))
    def _():
      self.saved(ref, tile, rows, head)

  def stats(self, columns: dict, rows, scale=None):
    """``columns``: {column: row vector (layout WGMMA.reduce(1))}; the other columns are
    0 (times ``scale`` when given)."""
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, STATS_COLS), 1, layout=plgpu.Layout.WGMMA)
    tile = plgpu.layout_cast(jnp.zeros((BLOCK_Q, STATS_COLS), _F32), plgpu.Layout.WGMMA)
    if scale is not None:
      tile = tile * scale
    for j, vec in columns.items():
      tile = jnp.where(col == j, lax.broadcast_in_dim(vec, tile.shape, [0]), tile)
    store.store_rows(tile, self.stats_tile, lambda r, c: self.stats_ref.at[r, c], *rows)

  def zeros(self, plan: _Plan, rows, post_scale):
    """Padding rows: 0 · post_scale, so a NaN post_scale (the op's answer to bad traced offsets)
    reaches every output."""
    zero = plgpu.layout_cast(jnp.zeros((BLOCK_Q, plan.head_dim), _F32), plgpu.Layout.WGMMA)
    zero = zero * post_scale

    @pl.loop(0, plan.num_heads)
    def _(head):
      self.out(zero, rows, head)
      self.saved(self.z_ref, zero, rows, head)
      self.saved(self.u_ref, zero, rows, head)
    self.stats({}, rows, post_scale)


def _rowvec(v, shape):
  """A row vector (layout WGMMA.reduce(1)) broadcast over the columns of ``shape``."""
  return lax.broadcast_in_dim(v, shape, [0])


def _colvec(vec_smem, which: int, head, shape):
  """γ1 (0), β1 (1) or γ2 (2) of ``head``, broadcast over the rows of ``shape``."""
  v = plgpu.load(vec_smem.at[which, head], layout=plgpu.Layout.WGMMA.reduce(0))
  return lax.broadcast_in_dim(v, shape, [1])


def _load_f32(tile):
  return plgpu.load(tile, layout=plgpu.Layout.WGMMA).astype(_F32)


def _row_sum(x):
  """Row sums of a (BLOCK_Q, D) f32 tile: per-thread partial sums, then across lanes once."""
  return jnp.sum(mgpu.lane_partial_sum(x), axis=1)


def _layer_norm_stats(plan: _Plan, stream: _QStream, first_use, smem):
  """(μ1, r1) row vectors of a q block from its H tiles (ring uses ``first_use + h``): per
  head the mean and the centred sum of squares M2 of the tile, merged across heads with Chan's
  formula (equal counts D): exact for rows with a large mean, one read of each tile."""
  d = plan.head_dim

  def head_moments(use):
    x = stream.read(use, smem)
    mean = _row_sum(x) * (1.0 / d)
    centred = x - _rowvec(mean, x.shape)
    return mean, _row_sum(centred * centred)

  def merge(head, carry):  # the first `head` heads (count head·D) with this one (count D)
    mean, m2 = carry
    mean_h, m2_h = head_moments(first_use + head)
    before = head.astype(_F32)
    delta = mean_h - mean
    mean = mean + delta * (1.0 / (before + 1.0))
    m2 = m2 + m2_h + delta * delta * (d * before / (before + 1.0))
    return mean, m2

  mean, m2 = lax.fori_loop(1, plan.num_heads, merge, head_moments(first_use))
  return mean, lax.rsqrt(m2 * (1.0 / (plan.num_heads * d)) + plan.eps)


def _pre_norm(plan: _Plan, x, stats, vec_smem, head):
  """u_h in f32 from q_h (f32): LayerNorm with the block's (μ1, r1), γ1, β1; or q_h itself."""
  if not plan.pre_layer_norm:
    return x
  mean, rstd = stats
  u = (x - _rowvec(mean, x.shape)) * _rowvec(rstd, x.shape)
  return u * _colvec(vec_smem, 0, head, x.shape) + _colvec(vec_smem, 1, head, x.shape)


def _u_slot(plan: _Plan, block, head):
  """The u ring slot of (``block``, ``head``): the attention reads u tiles in this order."""
  return lax.rem(block * plan.num_heads + head, plan.u_slots)


def _publish_u(plan: _Plan, item: _Item, stream: _QStream, stores: _Stores, use, block, head,
               stats, smem, then=lambda: None) -> None:
  """u_h of ``block`` from the q tile of ring use ``use`` into its u slot, handed to the
  attention warpgroup (``u_ready``); then ``then()`` (the caller's stores) and u saved (with
  the LayerNorm) for the backward: stores wait for the previous stores' SMEM reads, so none
  runs before the attention has its u."""
  u = _pre_norm(plan, stream.read(use, smem), stats, smem["vec_smem"], head)
  u = u.astype(smem["u_smem"].dtype)
  u_tile = smem["u_smem"].at[_u_slot(plan, block, head)]
  if plan.save_residuals and plan.pre_layer_norm:  # a TMA store of the slot's last u done
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  u_tile[...] = u
  plgpu.commit_smem()  # generic-proxy writes, before WGMMA or TMA (async proxy) read them
  plgpu.barrier_arrive(smem["u_ready"].at[head])
  then()
  if plan.pre_layer_norm:  # off the attention's path: it has this u already
    stores.saved_from_smem(stores.u_ref, u, u_tile, item.rows(block), head)


def _norm_item(plan: _Plan, item: _Item, stores: _Stores, smem) -> None:
  """The norm warpgroup's item: block 0's statistics and first u tiles, then per q block: per
  head Σz² and the next u tile, with the next block's statistics before its first u; r2, the
  epilogue, the statistics' store (:class:`_QStream` is the order of the q tiles it reads)."""
  stream = _QStream(plan)
  heads, scale = plan.num_heads, 1.0 / (plan.num_heads * plan.head_dim)
  z_smem, vec_smem = smem["z_smem"], smem["vec_smem"]
  last = item.q_blocks - 1
  stats0 = _layer_norm_stats(plan, stream, 0, smem) if plan.pre_layer_norm else None
  for head in range(plan.u_slots):
    _publish_u(plan, item, stream, stores, stream.stats_uses + head, 0, head, stats0, smem)

  def block_body(block, stats):
    rows = item.rows(block)

    def head_body(head, partial, ahead: int, u_stats):
      """z_h back: the u tile its u slot takes next (of block b + ``ahead``, ``u_slots``
      heads further on), then z_h's save; its Σz² term."""
      plgpu.barrier_wait(smem["z_ready"].at[head])
      z = _load_f32(z_smem.at[head])
      use = stream.u_use(block, head, ahead)
      u_head = head + plan.u_slots - ahead * heads
      save_z = lambda: stores.saved_from_smem(  # noqa: E731
          stores.z_ref, z, z_smem.at[head], rows, head)
      if not ahead:
        _publish_u(plan, item, stream, stores, use, block, u_head, u_stats, smem, save_z)
      else:
        @pl.when(block < last)
        def _():
          _publish_u(plan, item, stream, stores, use, block + 1, u_head, u_stats, smem, save_z)

        @pl.when(block == last)
        def _():  # the stream's use of a block past the item: nobody reads it
          stream.take(use, smem)
          stream.release(use, smem)
          save_z()

      return partial + mgpu.lane_partial_sum(z * z)

    # Heads whose next u is of this block; the next block's statistics (of block b itself in
    # the last block: unused); the heads whose next u is of the next block.
    split = heads - plan.u_slots
    partial = lax.fori_loop(0, split, functools.partial(head_body, ahead=0, u_stats=stats),
                            mgpu.lane_partial_zeros(BLOCK_Q))
    stats_next = (_layer_norm_stats(plan, stream, stream.stats_use(block), smem)
                  if plan.pre_layer_norm else None)
    partial = lax.fori_loop(split, heads,
                            functools.partial(head_body, ahead=1, u_stats=stats_next), partial)
    rms_rstd = lax.rsqrt(jnp.sum(partial, axis=1) * scale + plan.eps)

    @pl.loop(0, heads)
    def _epilogue(head):
      q = stream.read(stream.epilogue_use(block, head), smem)
      z = _load_f32(z_smem.at[head])
      out = z * _rowvec(rms_rstd, z.shape) * _colvec(vec_smem, 2, head, z.shape)
      if plan.outer_residual:
        out = out + q
      stores.out(out, rows, head)  # first waits for the earlier stores' reads: z_h's TMA too

      @pl.when(block < last)
      def _():  # z_h is read: the attention may write the next block's over it
        plgpu.barrier_arrive(smem["z_free"].at[head])

    stores.stats({**(dict(enumerate(stats)) if stats else {}), 2: rms_rstd}, rows)
    return stats_next

  lax.fori_loop(0, item.q_blocks, block_body, stats0)


def _consume_attention(plan: _Plan, item: _Item, scales_ref, smem) -> None:
  """The attention warpgroup: per q block and head, waits for u_h from the norm warpgroup,
  runs the head's attention and writes z_h = u_h + attn_h into the head's z tile."""
  @pl.when(item.has_blocks)
  def _():
    @pl.loop(0, item.q_blocks)
    def _block(block):
      @pl.loop(0, plan.num_heads)
      def _head(head):
        plgpu.barrier_wait(smem["u_ready"].at[head])
        u_tile = smem["u_smem"].at[_u_slot(plan, block, head)]
        o = _attend_head(plan, u_tile, smem, block * plan.uses_per_block + head * plan.kv_steps,
                         scales_ref[0])
        z = o * scales_ref[1]
        if plan.inner_residual:  # the WGMMAs reading u_h are done (their result was read)
          z = z + _load_f32(u_tile)
        z_tile = smem["z_smem"].at[head]

        @pl.when(block > 0)
        def _():  # the epilogue has read the previous block's z_h
          plgpu.barrier_wait(smem["z_free"].at[head])

        z_tile[...] = z.astype(z_tile.dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(smem["z_ready"].at[head])


def _attend_head(plan: _Plan, u_tile, smem, first_use, pre_scale):
  """Σ over the key blocks of act(pre_scale · u_h K_hᵀ) V_h: (BLOCK_Q, D) f32. Key block
  ``step`` sits in ring slot ``(first_use + step) % kv_stages``; each step's score WGMMA, act
  and P·V WGMMA run to completion before the slot is released."""
  p_tile = smem["p_smem"]

  def body(o_acc):
    for step in range(plan.kv_steps):
      slot = lax.rem(first_use + step, plan.kv_stages)

      def scores(s_acc, slot=slot):
        plgpu.barrier_wait(smem["k_ready"].at[slot])
        plgpu.wgmma(s_acc, u_tile, smem["k_smem"].at[slot].transpose((1, 0)))
        return s_acc[...]

      s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, plan.block_kv), _F32))
      # P goes through SMEM: the previous P·V has finished reading it (waited for).
      p_tile[...] = plan.act(s * pre_scale).astype(p_tile.dtype)
      plgpu.commit_smem()
      plgpu.barrier_wait(smem["v_ready"].at[slot])
      plgpu.wgmma(o_acc, p_tile, smem["v_smem"].at[slot])
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(smem["kv_free"].at[slot])  # the P·V reading the slot is done
    return o_acc[...]

  return pl.run_scoped(body, plgpu.ACC((BLOCK_Q, plan.head_dim), _F32))
