"""The FlashNormAttention forward as one Pallas Mosaic-GPU kernel for Hopper (sm_90a).

Per token over all H·D features (DESIGN.md, op 4; :func:`pallas_norm.reference.flash_norm_attention`)::

    u   = LayerNorm(q)·γ1 + β1              (pre_layer_norm; else u = q)
    z   = u + post·act(pre·u_h K_hᵀ) V_h    (inner_residual; else z = the attention alone)
    out = RMSNorm(z)·γ2 + q                 (outer_residual; else without + q)

Design: one CTA owns every head of a q block, so both norms reduce inside the CTA (no cluster
exchange). The grid is persistent: one CTA per SM walks a list of q blocks of ``BLOCK_Q`` rows
(:func:`cta_schedule`). The samples' blocks, in row order, form one flat list cut into equal
runs (:func:`cta_run`), one per group of ``Config.cta_group`` CTAs, whose CTAs take the run's
blocks in turn, so the CTAs of a group work on the same sample at once and its K/V is read from
DRAM about once (at H·D = 512 the K/V of 132 samples in flight, 33 MB, miss L2 enough to cost
the forward ~10%: benchmarks/NOTES.md, "flash_norm_attention"). A CTA's pipeline (the K/V ring,
the q buffers) runs on across the blocks of its list, sample boundaries included. The padding
rows (past ``q_offsets[-1]``) come in blocks of ``BLOCK_Q`` rows (:func:`padding_block`), dealt
to the CTAs in turn after their blocks. The list is three small XLA fusions (the cumulative
block counts, each block's sample, the list); each CTA computes its run and the padding blocks
itself.
Three warpgroups, as the reference megakernel splits MMA warps from norm warps:

* the producer (:data:`PRODUCER_WG`, TMA): per q block, the H tiles of q twice (a working copy
  and, with the outer residual and ``Config.residual_copy``, the residual copy), and each head's
  K_h/V_h in ``block_kv``-row blocks through a ring of ``kv_stages`` slots. The first ring slots
  of the next block load while the consumers finish the current one; the next block's q tiles of
  a head load as soon as the epilogue has read them (one ``q_free`` barrier per head).
* the norm warpgroup (:data:`NORM_WG`): the LayerNorm statistics (μ1, r1) of the block by one
  pass over the H tiles in SMEM (sums of x − s and its square, s a per-row shift: no
  cancellation for rows with a large mean), then every u_h = LN(q_h) written over the working
  copy of q_h (the attention reads u from SMEM; it goes to GMEM only as a residual for the
  backward), each handed to the attention warpgroup (``u_ready``); per head, once z_h is back
  (``attn_ready``), Σz² across heads. After the last head: r2, then per head out_h = z_h·r2·γ2 +
  q_h (q_h from the residual copy, or loaded again over z_h's tile without it), stored with the
  row-exact TMA store (:func:`pallas_norm.mgpu.store.store_rows`), the head's q tiles released,
  and the statistics (μ1, r1, r2) (float32, columns 0-2 of a (T, :data:`STATS_COLS`) array).
* the attention warpgroup (:data:`ATTENTION_WG`): per head, S = u_h K_hᵀ, act in registers,
  P through SMEM, O = P V_h per key block (each step's WGMMAs run to completion), then
  attn_h = post·O rounded to q's dtype and z_h = u_h + attn_h (the inner residual, u_h read
  back from its tile) written over u_h in q's dtype. The norm warpgroup paces the block (its
  elementwise work per element exceeds the attention's time per element at H·D = 512: the
  profile in benchmarks/NOTES.md), so the residual sum is done here, once, and the norm
  warpgroup neither recomputes u_h nor reads q_h for it.

With two q buffers (:class:`Config` ``q_buffers``, where the SMEM allows: H·D ≤ 256 at
D = 128, with a 2-slot K/V ring) the producer loads block b + 1's q tiles first, during block
b, and the norm warpgroup makes block b + 1's statistics and u tiles as soon as block b's Σz²
is complete, before block b's epilogue and stores (:func:`_pipelined_blocks`), so the attention
warpgroup goes from block b's last head to block b + 1's first without waiting for them.
At H·D = 512 two q buffers fit only without the residual copy (``Config.residual_copy``, the
inference form's default there): the epilogue then loads each q_h again from GMEM (L2, a block
after the producer's load) into the head's working tile once it has read z_h from it.

The loops over the heads are dynamic (``lax.fori_loop`` with per-thread partial row sums as
the carry): unrolled statically, the H = 4 kernel ran about 4× slower on the H200. The
single-consumer schedule, an overlapped WGMMA order (next scores issued before the P·V) and q
streamed through a ring instead of held twice (the next block's statistics and first u tiles
made during the current block's attention: faster forward-only, slower in training) were
measured slower than this one (benchmarks/EXPERIMENTS.md).

attn_h is rounded to q's dtype before the inner residual, as the unfused chain (GDPA kernel,
then the norms in XLA) does; z_h = u_h + attn_h is summed in float32 from u_h as the attention
read it (q's dtype) and held in q's dtype, the z that the backward reads; the statistics are
float32. With
``save_residuals`` the kernel also writes, in q's dtype, z (the RMSNorm backward's input:
recomputing attn would cost a second attention pass) and u (the GDPA backward's q; with the
LayerNorm only), both from registers the norm warpgroup holds anyway: u_h while the attention
warpgroup runs head 0, z_h with its Σz² term.

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
from pallas_norm.ops.norms import xla as norms_xla

_F32 = jnp.float32
BLOCK_Q = 64
"""Query rows of a q block: the M of one WGMMA (one consumer warpgroup)."""
STATS_COLS = 32
"""Columns of the statistics output (T, 32): μ1, r1, r2, then zeros. A row of 128 bytes: the
row-exact store starts TMA stores at any row of the SMEM tile, and TMA needs SMEM addresses
aligned to 128 bytes (32-byte rows gave CUDA_ERROR_MISALIGNED_ADDRESS on the H200)."""


NORM_WG, ATTENTION_WG, PRODUCER_WG = 0, 1, 2
"""The warpgroups of the kernel (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling: ``block_kv`` keys per WGMMA step (64; P is BLOCK_Q × block_kv), ``kv_stages``
  slots of the K/V ring (>= 2), ``q_buffers`` q blocks held at once (1 or 2). With 2 the
  producer loads block b + 1's q tiles while block b runs, and the norm warpgroup makes block
  b + 1's statistics and u tiles before block b's epilogue, so the attention warpgroup does not
  wait at block boundaries for the epilogue, the q loads and the statistics (twice the q SMEM:
  H·D ≤ 256 at D = 128). ``residual_copy``: the producer loads each q tile twice, a working
  copy (overwritten by u_h, then z_h) and the residual copy the epilogue adds; without it the
  epilogue loads each q_h again from GMEM (L2) into the working tile once z_h was read from
  it, so two q buffers fit at H·D = 512. ``cta_group``: CTAs that take one run of the block
  list in turn (they share its samples' K/V in L2; :func:`cta_schedule`)."""

  block_kv: int = 64
  kv_stages: int = 2
  q_buffers: int = 1
  residual_copy: bool = True
  cta_group: int = 2

  def __post_init__(self):
    gdpa_configs.check_block_kv(self.block_kv)
    if self.kv_stages < 2:
      raise ValueError(f"kv_stages must be >= 2, got {self.kv_stages}")
    if self.q_buffers not in (1, 2):
      raise ValueError(f"q_buffers must be 1 or 2, got {self.q_buffers}")
    if self.cta_group < 1:
      raise ValueError(f"cta_group must be >= 1, got {self.cta_group}")


def smem_bytes(num_heads: int, head_dim: int, dtype, out_dtype, cfg: Config) -> int:
  """SMEM of one CTA: q twice (working and residual copies of the H tiles; once without the
  residual copy), the K/V ring, P, one store tile (out, z, u and the statistics take turns in
  it: a RefUnion) and γ1/β1/γ2.
  Every allocation is rounded up to 1 KB (Pallas's SMEM alignment)."""
  item, out_item = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
  q = (1 + cfg.residual_copy) * cfg.q_buffers * num_heads * BLOCK_Q * head_dim * item
  kv = 2 * cfg.kv_stages * cfg.block_kv * head_dim * item
  p = BLOCK_Q * cfg.block_kv * item
  # z's and u's tile is the union's, never larger than out's or the statistics'
  tile = max(BLOCK_Q * head_dim * max(out_item, item), BLOCK_Q * STATS_COLS * 4)
  vecs = -(-3 * num_heads * head_dim * 4 // 1024) * 1024
  reduction = 2048  # Pallas's cross-warp reduction scratch (the row sums)
  stats = 1024 * (cfg.q_buffers > 1)  # (μ1, r1) of the held blocks
  return q + kv + p + tile + vecs + reduction + stats + 1024  # + the barriers


def pick_config(num_heads: int, head_dim: int, dtype, out_dtype, kv_len: int,
                save_residuals: bool = False) -> Config | None:
  """Two q buffers with a 2-slot K/V ring where they fit in SMEM (H·D ≤ 256 at D = 128; measured
  faster on the H200 in both forms: benchmarks/NOTES.md, "flash_norm_attention"); for the
  inference form (``save_residuals`` False) then the same without the residual copy (measured
  at H·D = 512, D = 128, bf16: faster there, slower in the training form, whose saves keep the
  norm warpgroup busy enough that the epilogue's q reloads set the pace; taken wherever only it
  fits, e.g. H·D = 384 or 640, or H·D = 256 with a float32 output). Otherwise the deepest K/V
  ring (4, 3 or 2 slots of 64 keys, at most the key blocks of a q block) that fits; None when
  none does. CTA pairs (``cta_group`` 2) where the K/V of one sample per SM pass half of L2,
  else one CTA per run (measured at H·D = 512 and 256, D = 128, Lkv = 128: pairs 10% faster
  in the H = 4 forward, where that K/V is 35 MB; at H = 2, 17 MB, 3% slower in training)."""
  group = 2 if (mgpu.num_sms(False) * 2 * kv_len * num_heads * head_dim
                * jnp.dtype(dtype).itemsize > mgpu.L2_BYTES // 2) else 1
  two_buffers = [Config(block_kv=64, kv_stages=2, q_buffers=2, cta_group=group)]
  if not save_residuals:
    two_buffers.append(Config(block_kv=64, kv_stages=2, q_buffers=2, residual_copy=False,
                              cta_group=group))
  for cfg in two_buffers:
    if smem_bytes(num_heads, head_dim, dtype, out_dtype, cfg) <= mgpu.SMEM_BYTES:
      return cfg
  blocks = num_heads * kv_len // 64
  for stages in (4, 3, 2):
    cfg = Config(block_kv=64, kv_stages=max(2, min(stages, blocks)), cta_group=group)
    if smem_bytes(num_heads, head_dim, dtype, out_dtype, cfg) <= mgpu.SMEM_BYTES:
      return cfg
  return None


def unsupported_reason(q, k, kv_offsets, out_dtype) -> str | None:
  """None when the fused kernel can run these (validated) arguments, else why not."""
  reason = dense_kv_reason(q, k, kv_offsets, out_dtype)
  if reason is not None:
    return reason
  if jnp.dtype(q.dtype) == jnp.float16:
    return ("float16 q: this kernel holds z = u + attn in q's dtype, which overflows float16 "
            "where the sum passes 65504 though u and attn do not (the cluster kernel and the "
            "chain add in float32)")
  heads, head_dim = q.shape[1:]
  if pick_config(heads, head_dim, q.dtype, jnp.dtype(out_dtype or q.dtype), k.shape[1]) is None:
    return (f"H·D = {heads}·{head_dim}: the q block of all heads (twice) and the K/V ring do "
            "not fit in SMEM")
  return None


def dense_kv_reason(q, k, kv_offsets, out_dtype) -> str | None:
  """Why a fused forward kernel (this one or :mod:`.cluster`) cannot take these operands (q's
  and the output's dtypes, D, dense K/V, the capacity), SMEM aside; or None."""
  reason = gdpa_mosaic.operand_reason(q, out_dtype)
  if reason is not None:
    return reason
  t = q.shape[0]
  if t == 0:
    return "zero token capacity: no q block for the fused kernel"
  if kv_offsets is not None:
    return "jagged K/V: the fused kernel takes dense K/V only"
  if k.shape[1] == 0 or k.shape[1] % 64:
    return f"dense K/V length Lkv = {k.shape[1]} is not a positive multiple of 64"
  if t % gdpa_mosaic.ALIGN:
    return f"the token capacity T = {t} must be a multiple of {gdpa_mosaic.ALIGN}"
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one kernel build."""

  num_heads: int
  head_dim: int
  kv_steps: int
  block_kv: int
  kv_stages: int
  q_buffers: int
  act: Callable
  eps: float
  pre_layer_norm: bool
  inner_residual: bool
  outer_residual: bool
  save_residuals: bool
  residual_copy: bool
  cta_group: int
  ctas: int
  stats: bool

  @property
  def uses_per_block(self) -> int:
    """K/V ring slots one q block consumes: every head's key blocks."""
    return self.num_heads * self.kv_steps

  @property
  def q_copies(self) -> tuple:
    """The SMEM copies of each q tile the producer loads: the working copy, and the residual
    copy when the outer residual reads it (the only reader since z_h comes from the attention
    warpgroup)."""
    return ("x_smem", "res_smem") if self.reads_residual_copy else ("x_smem",)

  @property
  def reads_residual_copy(self) -> bool:
    """The epilogue adds q_h from the residual copy (else, with the outer residual, from GMEM)."""
    return self.outer_residual and self.residual_copy

  @property
  def q_loads(self) -> list:
    """(head, copy) in the producer's load order of a q block's tiles. One q buffer: every
    head's working copy first, since the statistics sum each as it lands (the next block's
    tiles load late, after the epilogue released them; the residual copies wait for the
    next epilogue). Two: head by head (the tiles load a block ahead)."""
    loads = [(h, c) for h in range(self.num_heads) for c in range(len(self.q_copies))]
    return sorted(loads, key=lambda hc: hc[1]) if self.q_buffers == 1 else loads

  def tile(self, block, head):
    """Index of q block ``block``'s tile of ``head`` in x_smem/res_smem (and of its per-tile
    barriers): buffer ``block % q_buffers``."""
    if self.q_buffers == 1:
      return head
    return lax.rem(block, self.q_buffers) * self.num_heads + head


def flash_norm_attention_fwd(q, k, v, q_offsets, affine, pre_scale, post_scale, *,
                             activation: str, eps: float, pre_layer_norm: bool = True,
                             inner_residual: bool = True, outer_residual: bool = True,
                             out_dtype=None, save_residuals: bool = False,
                             return_stats: bool = True, config: Config | None = None,
                             interpret: bool = False):
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
    return_stats: write the statistics (always with ``save_residuals``); without them the
      forward stores 8 KB a q block fewer (an eighth of out's bytes at H·D = 512, bf16) and
      returns None in their place.
    config: tiling (default :func:`pick_config`).
    interpret: run in Pallas GPU interpret mode (any backend).

  Returns:
    ``(out, stats)`` or ``(out, stats, z, u)``: out (T, H, D) in out_dtype; stats
    (T, :data:`STATS_COLS`) float32 with μ1, r1, r2 in columns 0-2 (μ1, r1 zeros without the
    LayerNorm; the row kernels of the backward read the columns in place, no slice pass), None
    without ``return_stats`` or ``save_residuals``;
    z, u (T, H, D) (u None without the LayerNorm). Padding rows (past
    ``q_offsets[-1]``) are zeros in out and stats and unwritten in z and u (the backward
    never reads them).
  """
  capacity, num_heads, head_dim = q.shape
  out_dtype = jnp.dtype(out_dtype or q.dtype)
  kv_len = k.shape[1]
  cfg = checked_config(config or pick_config(num_heads, head_dim, q.dtype, out_dtype, kv_len,
                                             save_residuals), kv_len)
  ctas = max(cfg.cta_group, mgpu.num_sms(interpret) // cfg.cta_group * cfg.cta_group)
  plan = _Plan(num_heads=num_heads, head_dim=head_dim, kv_steps=kv_len // cfg.block_kv,
               block_kv=cfg.block_kv, kv_stages=cfg.kv_stages, q_buffers=cfg.q_buffers,
               act=gdpa_mosaic.KERNEL_ACTIVATIONS[activation], eps=float(eps),
               pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
               outer_residual=outer_residual, save_residuals=save_residuals,
               residual_copy=cfg.residual_copy, cta_group=cfg.cta_group, ctas=ctas,
               stats=return_stats or save_residuals)
  blocks, block_ends = cta_schedule(q_offsets, capacity)
  scales = jnp.stack([jnp.asarray(pre_scale, _F32), jnp.asarray(post_scale, _F32)])
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=output_types(q, out_dtype, pre_layer_norm, save_residuals, plan.stats),
      grid=(ctas,),
      grid_names=("cta",),
      num_threads=3,
      thread_name="wg",
      kernel_name=_kernel_name(cfg),
      scratch_types=_scratch(plan, q.dtype, out_dtype),
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=mgpu.interpret_params() if interpret else None,
  )
  return forward_outputs(call(blocks, block_ends, q_offsets.astype(jnp.int32), scales,
                              affine.astype(_F32), q, k, v),
                         pre_layer_norm, save_residuals, plan.stats)


BLOCK_ROW, BLOCK_LO, BLOCK_COUNT, BLOCK_SAMPLE = range(4)
"""Columns of :func:`cta_schedule`'s block list: the block's first GMEM row, its sample's rows
in it as [lo, lo + count), and the sample (its K/V index)."""


def cta_schedule(q_offsets, capacity: int):
  """The persistent grid's block list: ``(blocks, block_ends)``.

  ``blocks`` (capacity // BLOCK_Q + 2·B, 4) int32: the q blocks of the B samples in sample
  order, each sample's from its first row rounded down to ``ALIGN`` (GDPA's windows), one row
  each (columns :data:`BLOCK_ROW` ... :data:`BLOCK_SAMPLE`); rows past the N blocks are never
  read. ``block_ends`` (B,) int32: the cumulative block counts, N = ``block_ends[-1]``. The
  kernel cuts the list into runs (:func:`cta_run`). Samples in row order, not longest first:
  the runs are equal whatever the order, and the sort's kernels cost more than they ordered.
  Invalid traced offsets cannot make the kernel touch memory outside its arrays (the op poisons
  such outputs with NaN anyway): offsets are clamped into [0, capacity], and the cumulative
  block counts are capped at the list's size, which overlapping samples (decreasing offsets)
  would pass."""
  q_offsets = jnp.clip(q_offsets.astype(jnp.int32), 0, capacity)
  batch = q_offsets.shape[0] - 1
  win, lo, hi = gdpa_mosaic.window(q_offsets[:-1], q_offsets[1:])
  counts = pl.cdiv(hi, BLOCK_Q)
  # ≥ N for valid offsets: a sample of n rows has ≤ n / BLOCK_Q + 2 blocks
  size = capacity // BLOCK_Q + 2 * batch
  ends = jnp.minimum(gdpa_mosaic.cumsum_small(counts), size)
  flat = jnp.arange(size, dtype=jnp.int32)
  owner = jnp.minimum(gdpa_mosaic.count_at_most(ends, flat), batch - 1)
  offset = (flat - (ends - counts)[owner]) * BLOCK_Q
  block_lo = jnp.maximum(lo[owner] - offset, 0)
  block_hi = jnp.minimum(hi[owner] - offset, BLOCK_Q)
  blocks = jnp.stack([win[owner] + offset, block_lo, jnp.maximum(block_hi - block_lo, 0), owner],
                     axis=1)
  return blocks, ends


def cta_run(cta, total, ctas: int, group: int):
  """(first block, block count) of CTA ``cta`` of ``ctas`` in a list of ``total``
  blocks: the list is cut into ``ctas // group`` equal runs; CTA ``group·p + g`` takes blocks
  first + g, first + g + group, ... of run p, so the ``group`` CTAs of a run work on one sample
  at once and read its K/V from DRAM about once. Integer arithmetic only (kernel or host)."""
  num_runs = ctas // group
  run, member = lax.div(cta, group), lax.rem(cta, group)
  start = lax.div(run * total, num_runs)
  end = lax.div((run + 1) * total, num_runs)
  count = lax.div(jnp.maximum(end - start - member + group - 1, 0), group)
  return start + member, count


def padding_block(end, capacity: int, index):
  """Rows (first GMEM row, lo, count) of padding block ``index`` of rows [end, capacity): the
  blocks run from ``end`` rounded down to ``ALIGN``; there are :func:`padding_blocks` of them."""
  row = end - lax.rem(end, gdpa_mosaic.ALIGN) + index * BLOCK_Q
  lo = jnp.maximum(end - row, 0)
  return row, lo, jnp.minimum(capacity - row, BLOCK_Q) - lo


def padding_blocks(end, capacity: int):
  """Blocks of :func:`padding_block` that cover rows [end, capacity) (0 when end = capacity)."""
  win = end - lax.rem(end, gdpa_mosaic.ALIGN)
  return lax.div(capacity - win + BLOCK_Q - 1, BLOCK_Q) * (end < capacity).astype(jnp.int32)


def checked_config(cfg, kv_len: int):
  """``cfg`` (a tiling with ``block_kv``), if its key step divides Lkv = ``kv_len``.

  Raises:
    ValueError: it does not.
  """
  if kv_len % cfg.block_kv:
    raise ValueError(f"block_kv = {cfg.block_kv} does not divide Lkv = {kv_len}")
  return cfg


def output_types(q, out_dtype, pre_layer_norm: bool, save_residuals: bool,
                 stats: bool = True) -> tuple:
  """The forward kernels' outputs: out, the statistics (when ``stats``), then z and (with the
  LayerNorm) u when the residuals are saved."""
  types = [jax.ShapeDtypeStruct(q.shape, out_dtype)]
  if stats:
    types.append(jax.ShapeDtypeStruct((q.shape[0], STATS_COLS), _F32))
  if save_residuals:  # z, then u with the LayerNorm
    types += [jax.ShapeDtypeStruct(q.shape, q.dtype)] * (2 if pre_layer_norm else 1)
  return tuple(types)


def forward_outputs(results, pre_layer_norm: bool, save_residuals: bool, stats: bool = True):
  """A forward kernel's results (:func:`output_types`) as :func:`flash_norm_attention_fwd`
  returns them."""
  out, *rest = results
  stats, saved = (rest[0], rest[1:]) if stats else (None, rest)
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


def _scratch(plan: _Plan, dtype, out_dtype) -> dict:
  heads, d = plan.num_heads, plan.head_dim
  tile = mgpu.swizzle_transforms(d, dtype)
  # The stores of out, z, u and the statistics take turns (each store_rows first waits for the
  # previous stores to have read SMEM), so they share one tile.
  store_tiles = [store.row_store_smem(BLOCK_Q, d, out_dtype),
                 store.row_store_smem(BLOCK_Q, STATS_COLS, _F32)]
  if plan.save_residuals:
    store_tiles.append(store.row_store_smem(BLOCK_Q, d, dtype))
  tiles = plan.q_buffers * heads
  extra = {} if plan.q_buffers == 1 else dict(
      stats_smem=plgpu.SMEM((plan.q_buffers, 2, BLOCK_Q), _F32))
  if plan.residual_copy:
    extra["res_smem"] = plgpu.SMEM((tiles, BLOCK_Q, d), dtype, transforms=tile)
  else:  # q_h reloaded for the epilogue into its working tile, once z_h was read from it
    extra["res_ready"] = plgpu.Barrier(num_barriers=2)
  return dict(
      store_tiles=plgpu.RefUnion(*store_tiles),
      x_smem=plgpu.SMEM((tiles, BLOCK_Q, d), dtype, transforms=tile),
      k_smem=plgpu.SMEM((plan.kv_stages, plan.block_kv, d), dtype, transforms=tile),
      v_smem=plgpu.SMEM((plan.kv_stages, plan.block_kv, d), dtype, transforms=tile),
      p_smem=plgpu.SMEM((BLOCK_Q, plan.block_kv), dtype,
                        transforms=mgpu.swizzle_transforms(plan.block_kv, dtype)),
      vec_smem=plgpu.SMEM((3, heads, d), _F32),
      vec_ready=plgpu.Barrier(),
      q_ready=plgpu.Barrier(num_barriers=2 * tiles),
      q_free=plgpu.Barrier(num_barriers=tiles),
      k_ready=plgpu.Barrier(num_barriers=plan.kv_stages),
      v_ready=plgpu.Barrier(num_barriers=plan.kv_stages),
      kv_free=plgpu.Barrier(num_barriers=plan.kv_stages),
      u_ready=plgpu.Barrier(num_barriers=tiles),
      attn_ready=plgpu.Barrier(num_barriers=tiles),
      **extra,
  )


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """This CTA's q blocks (:func:`cta_run`): ``count`` of them, its ``block``-th (counted in
  the CTA; the pipeline's barriers and buffers go by that count) at row
  ``first + block·stride`` of the block list."""

  blocks_ref: object
  first: jax.Array
  count: jax.Array
  stride: int

  @classmethod
  def read(cls, blocks_ref, block_ends_ref, plan: _Plan):
    total = block_ends_ref[block_ends_ref.shape[0] - 1]
    first, count = cta_run(lax.axis_index("cta"), total, plan.ctas, plan.cta_group)
    return cls(blocks_ref, first, count, plan.cta_group)

  def _col(self, block, column):
    return self.blocks_ref[self.first + block * self.stride, column]

  def rows(self, block):
    """(first GMEM row of q block ``block``, its sample's rows in it as [lo, lo + count))."""
    return (pl.multiple_of(self._col(block, BLOCK_ROW), gdpa_mosaic.ALIGN),
            self._col(block, BLOCK_LO), self._col(block, BLOCK_COUNT))

  def sample(self, block):
    """The K/V index of q block ``block``."""
    return self._col(block, BLOCK_SAMPLE)


def _padding_rows(plan: _Plan, offsets_ref, capacity: int, store_block) -> None:
  """``store_block(rows)`` for this CTA's padding blocks (:func:`padding_block`, dealt to the
  CTAs in turn): rows as :meth:`_Schedule.rows` gives them."""
  end = jnp.clip(offsets_ref[offsets_ref.shape[0] - 1], 0, capacity)
  cta = lax.axis_index("cta")
  turns = lax.div(padding_blocks(end, capacity) - cta + plan.ctas - 1, plan.ctas)

  @pl.loop(0, turns)
  def _(turn):
    row, lo, count = padding_block(end, capacity, cta + turn * plan.ctas)
    store_block((pl.multiple_of(row, gdpa_mosaic.ALIGN), lo, count))


def _kernel(blocks_ref, block_ends_ref, offsets_ref, scales_ref, affine_ref, q_ref, k_ref, v_ref,
            out_ref, *more_refs, plan: _Plan, **smem):
  stats_ref, saved_refs = (more_refs[0], more_refs[1:]) if plan.stats else (None, more_refs)
  sched = _Schedule.read(blocks_ref, block_ends_ref, plan)
  wg = lax.axis_index("wg")

  @pl.when(wg == PRODUCER_WG)
  def _producer():
    plgpu.set_max_registers(mgpu.PRODUCER_REGISTERS, action="decrease")
    _produce(plan, sched, affine_ref, q_ref, k_ref, v_ref, smem)

  @pl.when(wg == NORM_WG)
  def _norms():
    plgpu.set_max_registers(mgpu.CONSUMER_REGISTERS, action="increase")
    _consume(plan, sched, offsets_ref, scales_ref, q_ref, out_ref, stats_ref, saved_refs, smem)

  @pl.when(wg == ATTENTION_WG)
  def _attention():
    plgpu.set_max_registers(mgpu.CONSUMER_REGISTERS, action="increase")
    _consume_attention(plan, sched, scales_ref, smem)


def _produce(plan: _Plan, sched: _Schedule, affine_ref, q_ref, k_ref, v_ref, smem) -> None:
  """TMA warpgroup: γ1/β1/γ2 once; per q block, the first K/V ring slots, then (once the
  epilogue released that head's tiles of the previous block) the H q tiles' copies in
  :attr:`_Plan.q_loads` order, then the remaining K/V blocks."""
  plgpu.copy_gmem_to_smem(affine_ref, smem["vec_smem"], smem["vec_ready"])
  per_block, stages = plan.uses_per_block, plan.kv_stages
  prefetch = min(stages, per_block)

  def load_kv(block, use, sample):  # ring use block·per_block + use: head, key block static
    head, step = divmod(use, plan.kv_steps)
    ring_use = block * per_block + use
    slot = lax.rem(ring_use, stages)

    @pl.when(ring_use >= stages)
    def _():
      plgpu.barrier_wait(smem["kv_free"].at[slot])

    keys = pl.ds(step * plan.block_kv, plan.block_kv)
    plgpu.copy_gmem_to_smem(k_ref.at[sample, keys, head], smem["k_smem"].at[slot],
                            smem["k_ready"].at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[sample, keys, head], smem["v_smem"].at[slot],
                            smem["v_ready"].at[slot])

  def load_q(block):
    rows = pl.ds(sched.rows(block)[0], BLOCK_Q)
    for head, copy in plan.q_loads:
      tile = plan.tile(block, head)
      if copy == 0:
        @pl.when(block > plan.q_buffers - 1)
        def _(tile=tile):  # the epilogue of the block before in this buffer read its copies
          plgpu.barrier_wait(smem["q_free"].at[tile])

      plgpu.copy_gmem_to_smem(q_ref.at[rows, head], smem[plan.q_copies[copy]].at[tile],
                              smem["q_ready"].at[2 * tile + copy])

  @pl.loop(0, sched.count)
  def _block(block):
    sample = sched.sample(block)
    if plan.q_buffers > 1:  # the q tiles first: they load during the previous block
      load_q(block)
    for use in range(prefetch):
      load_kv(block, use, sample)
    if plan.q_buffers == 1:  # after the first K/V slots: the epilogue frees the q tiles late
      load_q(block)
    for use in range(prefetch, per_block):
      load_kv(block, use, sample)

  # Observe the releases no load waited for (the last block of each buffer), so every
  # barrier phase is consumed.
  if plan.q_buffers == 1:
    @pl.when(sched.count > 0)
    def _():
      for head in range(plan.num_heads):
        plgpu.barrier_wait(smem["q_free"].at[head])
  else:
    @pl.loop(jnp.maximum(sched.count - plan.q_buffers, 0), sched.count)
    def _(block):
      for head in range(plan.num_heads):
        plgpu.barrier_wait(smem["q_free"].at[plan.tile(block, head)])

  uses = sched.count * per_block

  @pl.loop(jnp.maximum(uses - stages, 0), uses)
  def _(use):
    plgpu.barrier_wait(smem["kv_free"].at[lax.rem(use, stages)])


def _consume(plan: _Plan, sched: _Schedule, offsets_ref, scales_ref, q_ref, out_ref, stats_ref,
             saved_refs, smem) -> None:
  """The norm warpgroup: every q block of the CTA's list, then zeros for its padding blocks."""
  plgpu.barrier_wait(smem["vec_ready"])
  o_tile, stats_tile, *more_tiles = smem["store_tiles"]
  saved_tile = more_tiles[0].at[0] if plan.save_residuals else None
  z_ref, u_ref = (*saved_refs, None, None)[:2]
  stores = _Stores(out_ref, stats_ref, z_ref, u_ref, o_tile.at[0], stats_tile.at[0],
                   saved_tile)
  if not plan.residual_copy:
    smem = dict(smem, q_ref=q_ref)  # the epilogue loads q_h again

  if plan.q_buffers == 1:
    @pl.loop(0, sched.count)
    def _block(block):
      _block_forward(plan, sched, block, stores, smem)
  else:
    _pipelined_blocks(plan, sched, stores, smem)

  stores.zeros(plan, functools.partial(_padding_rows, plan, offsets_ref, q_ref.shape[0]),
               scales_ref[1])

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

  def stats(self, columns: dict, rows):
    """``columns``: {column: row vector (layout WGMMA.reduce(1))}; the other columns are 0.
    Nothing without the statistics output."""
    if self.stats_ref is None:
      return
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, STATS_COLS), 1, layout=plgpu.Layout.WGMMA)
    tile = plgpu.layout_cast(jnp.zeros((BLOCK_Q, STATS_COLS), _F32), plgpu.Layout.WGMMA)
    for j, vec in columns.items():
      tile = jnp.where(col == j, lax.broadcast_in_dim(vec, tile.shape, [0]), tile)
    store.store_rows(tile, self.stats_tile, lambda r, c: self.stats_ref.at[r, c], *rows)

  def zeros(self, plan: _Plan, each_padding_block, post_scale):
    """The CTA's padding rows of out and the statistics (``each_padding_block(store_block)``
    calls ``store_block(rows)`` per padding block): 0 · post_scale, so a NaN post_scale (the
    op's answer to bad traced offsets) reaches them, each from a tile staged once (the tiles
    share SMEM: out's stores first). The saved z and u keep their padding rows unwritten: the
    backward reads rows below ``q_offsets[-1]`` only (the row kernels stop there; the GDPA
    backward's q blocks that reach past it read a zero-padded copy), and zeroing them was 2/3
    of the training form's padding stores (2·T_pad·H·D elements)."""
    store.stage(gdpa_mosaic.zero_tile(plan.head_dim, post_scale, self.out_ref.dtype),
                self.o_tile)

    def out_rows(rows):
      @pl.loop(0, plan.num_heads)
      def _(head):
        store.copy_rows(self.o_tile, lambda r, c: self.out_ref.at[r, head, c], *rows)

    each_padding_block(out_rows)
    if self.stats_ref is not None:
      store.stage(gdpa_mosaic.zero_tile(STATS_COLS, post_scale, _F32), self.stats_tile)
      each_padding_block(lambda rows: store.copy_rows(
          self.stats_tile, lambda r, c: self.stats_ref.at[r, c], *rows))


def _rowvec(v, shape):
  """A row vector (layout WGMMA.reduce(1)) broadcast over the columns of ``shape``."""
  return lax.broadcast_in_dim(v, shape, [0])


def _colvec(vec_smem, which: int, head: int, shape):
  """γ1 (0), β1 (1) or γ2 (2) of ``head``, broadcast over the rows of ``shape``."""
  v = plgpu.load(vec_smem.at[which, head], layout=plgpu.Layout.WGMMA.reduce(0))
  return lax.broadcast_in_dim(v, shape, [1])


def _load_f32(tile):
  return plgpu.load(tile, layout=plgpu.Layout.WGMMA).astype(_F32)


def _sum_over_heads(plan: _Plan, tile_fn):
  """Row sums over the H heads of ``tile_fn(head)`` (BLOCK_Q, D) f32: per-thread partial sums
  in a dynamic loop over the heads (one copy of the code whatever H, nothing hoisted across
  heads), reduced across lanes once."""
  def add(head, partial):
    return partial + mgpu.lane_partial_sum(tile_fn(head))
  partial = lax.fori_loop(0, plan.num_heads, add, mgpu.lane_partial_zeros(BLOCK_Q))
  return jnp.sum(partial, axis=1)


def _layer_norm_stats(plan: _Plan, tile_of, wait_for=None):
  """(μ1, r1) row vectors over the H tiles ``tile_of(head)`` of the q block, in one pass over
  them: the sums of d = x − s and d² with a per-row shift s, the mean of the row's first
  :data:`mgpu.LANE_COLS` values, so var = E[d²] − E[d]² does not cancel for rows with a large
  mean (|E[d]| = |μ − s| ≤ √(n/8) standard deviations over n = H·D features, since the 8
  values averaged into s are among the row's: 6 bits of cancellation at most at n = 512).
  E[d²] ≤ (1 + n/8)·var overflows float32 for |x| ≳ 1e17, up to that factor before the variance
  would (r1 = 0 there). The statistics sit on the block's critical path (the attention waits for
  them), so one pass over SMEM instead of two. With ``wait_for(head)`` (waits for a tile's load)
  each tile is summed as it lands, so only the last load's latency is on that path, under the
  sums of the others."""
  n = plan.num_heads * plan.head_dim
  shape = (BLOCK_Q, plan.head_dim)
  if wait_for is not None:
    wait_for(0)
  first = mgpu.lane_slices(_load_f32(tile_of(0)))[0]
  shift = jnp.sum(first, axis=1) * (1.0 / mgpu.LANE_COLS)

  def add(head, sums):
    d = _load_f32(tile_of(head)) - _rowvec(shift, shape)
    return sums[0] + mgpu.lane_partial_sum(d), sums[1] + mgpu.lane_partial_sum(d * d)

  zeros = mgpu.lane_partial_zeros(BLOCK_Q)
  if wait_for is None:
    s1, s2 = lax.fori_loop(0, plan.num_heads, add, (zeros, zeros))
  else:  # tile 0 was waited for above
    def wait_and_add(head, sums):
      wait_for(head)
      return add(head, sums)

    s1, s2 = lax.fori_loop(1, plan.num_heads, wait_and_add, add(0, (zeros, zeros)))
  mean_d = jnp.sum(s1, axis=1) * (1.0 / n)
  mean_sq = jnp.sum(s2, axis=1) * (1.0 / n)
  # E[d²] past float32's range (|x − s| ≳ 1e17): the variance is +inf (r1 = 0, u = β1)
  var = norms_xla.shifted_variance(mean_sq, mean_d)
  return shift + mean_d, lax.rsqrt(var + plan.eps)


def _pre_norm(plan: _Plan, x, stats, vec_smem, head):
  """u_h in f32 from q_h (f32): LayerNorm with the block's (μ1, r1), γ1, β1; or q_h itself."""
  if not plan.pre_layer_norm:
    return x
  mean, rstd = stats
  # The difference first. Written x·r + (−μ·r) (one FMA an element), u kept the rounding of
  # μ·r where x = μ: on an exactly constant row ~|μ|·r·2⁻²⁴ instead of 0, O(1) at eps 3e-7,
  # which RMSNorm(z) then scales up (ptxas contracts the pair; XLA:CPU at the tests'
  # optimization level does not: test_constant_rows_match_reference_with_fma_contraction).
  u = (x - _rowvec(mean, x.shape)) * _rowvec(rstd, x.shape)
  return u * _colvec(vec_smem, 0, head, x.shape) + _colvec(vec_smem, 1, head, x.shape)


def _block_forward(plan: _Plan, sched: _Schedule, block, stores: _Stores, smem) -> None:
  """The norm warpgroup's q block: statistics, every u_h handed to the attention warpgroup,
  per head z_h back → Σz², then r2, the epilogue and the stores."""
  rows = sched.rows(block)
  stats = _block_prologue(plan, block, rows, stores, smem)
  rms_rstd = _block_rms_rstd(plan, block, rows, stores, smem)
  _block_epilogue(plan, block, rows, stats, rms_rstd, stores, smem)


def _pipelined_blocks(plan: _Plan, sched: _Schedule, stores: _Stores, smem) -> None:
  """The norm warpgroup's q blocks with two q buffers: block b + 1's statistics and u tiles
  are made as soon as block b's Σz² is complete, before block b's epilogue, so the attention
  warpgroup goes on to block b + 1 without waiting for that epilogue. The statistics (μ1, r1)
  of a held block wait in ``stats_smem`` (values do not leave a conditional)."""
  def prologue(block):
    stats = _block_prologue(plan, block, sched.rows(block), stores, smem)
    if stats is not None:
      for j, vec in enumerate(stats):
        smem["stats_smem"][lax.rem(block, plan.q_buffers), j] = vec
      plgpu.commit_smem()  # warpgroup barrier: every thread's write precedes the reads

  def held_stats(block):
    if not plan.pre_layer_norm:
      return None
    return tuple(plgpu.load(smem["stats_smem"].at[lax.rem(block, plan.q_buffers), j],
                            layout=plgpu.Layout.WGMMA.reduce(1)) for j in range(2))

  @pl.when(sched.count > 0)
  def _():
    prologue(0)

  @pl.loop(0, sched.count)
  def _block(block):
    rows = sched.rows(block)
    rms_rstd = _block_rms_rstd(plan, block, rows, stores, smem)

    @pl.when(block + 1 < sched.count)
    def _():
      prologue(block + 1)

    _block_epilogue(plan, block, rows, held_stats(block), rms_rstd, stores, smem)


def _block_prologue(plan: _Plan, block, rows, stores: _Stores, smem):
  """Waits for the block's q tiles, makes the LayerNorm statistics (μ1, r1) (None without the
  LayerNorm) and hands every u_h to the attention warpgroup (over q_h), saving u."""
  x_smem, vec_smem = smem["x_smem"], smem["vec_smem"]

  # One q buffer: the working copies are waited for one by one as the statistics sum them,
  # the residual copies in the epilogue (the tiles land late, on the block's critical path).
  # Two: every copy here (they landed during the block before).
  streamed = plan.q_buffers == 1

  def wait_for(head):
    copies = (0,) if streamed else range(len(plan.q_copies))
    for copy in copies:
      plgpu.barrier_wait(smem["q_ready"].at[2 * plan.tile(block, head) + copy])

  if plan.pre_layer_norm and streamed:
    stats = _layer_norm_stats(plan, lambda h: x_smem.at[plan.tile(block, h)], wait_for)
  else:
    for head in range(plan.num_heads):
      wait_for(head)
    stats = (_layer_norm_stats(plan, lambda h: x_smem.at[plan.tile(block, h)])
             if plan.pre_layer_norm else None)

  @pl.loop(0, plan.num_heads)
  def _publish(head):  # every u_h at once (over q_h): the attention warpgroup takes them in turn
    tile = plan.tile(block, head)
    if plan.pre_layer_norm:
      u = _pre_norm(plan, _load_f32(x_smem.at[tile]), stats, vec_smem, head)
      u = u.astype(x_smem.dtype)
      x_smem.at[tile][...] = u
      plgpu.commit_smem()  # generic-proxy writes, before WGMMA (async proxy) reads them
    plgpu.barrier_arrive(smem["u_ready"].at[tile])
    if plan.pre_layer_norm:  # while the attention warpgroup runs: the norm one would wait
      stores.saved(stores.u_ref, u, rows, head)

  return stats


def _block_rms_rstd(plan: _Plan, block, rows, stores: _Stores, smem):
  """Per head, once z_h is back (over u_h): z saved and Σz²; returns r2."""
  x_smem = smem["x_smem"]

  def attend(head):  # returns z_h² for Σz²
    tile = plan.tile(block, head)
    plgpu.barrier_wait(smem["attn_ready"].at[tile])
    z = _load_f32(x_smem.at[tile])
    stores.saved(stores.z_ref, z, rows, head)
    return z * z

  return lax.rsqrt(_sum_over_heads(plan, attend) * (1.0 / (plan.num_heads * plan.head_dim))
                   + plan.eps)


def _block_epilogue(plan: _Plan, block, rows, stats, rms_rstd, stores: _Stores, smem) -> None:
  """out_h = z_h·r2·γ2 (+ q_h) per head, each head's q tiles released after it, and the
  statistics (μ1, r1 from ``stats``, r2) stored."""
  x_smem, vec_smem = smem["x_smem"], smem["vec_smem"]

  def scaled(z, head):  # z_h·r2·γ2 in f32
    return z * _rowvec(rms_rstd, z.shape) * _colvec(vec_smem, 2, head, z.shape)

  if plan.outer_residual and not plan.residual_copy:
    _epilogue_reloading(plan, block, rows, scaled, stores, smem)
  else:
    @pl.loop(0, plan.num_heads)
    def _epilogue(head):
      tile = plan.tile(block, head)
      out = scaled(_load_f32(x_smem.at[tile]), head)
      if plan.reads_residual_copy:
        if plan.q_buffers == 1:  # see _block_prologue: landed long ago, waited for here
          plgpu.barrier_wait(smem["q_ready"].at[2 * tile + 1])
        out = out + _load_f32(smem["res_smem"].at[tile])
      _release_q(smem, tile)  # the head's tiles are read: the next block's may load over them
      stores.out(out, rows, head)

  stores.stats({**(dict(enumerate(stats)) if stats else {}), 2: rms_rstd}, rows)


def _epilogue_reloading(plan: _Plan, block, rows, scaled, stores: _Stores, smem) -> None:
  """The epilogue without the residual copy: q_h is loaded again from GMEM (L2: the producer
  loaded it a block ago) into its working tile once z_h was read from it (z_h kept in
  registers in q's dtype), one head ahead of its use, so each load's latency hides under the
  previous head's out; ``res_ready`` alternates between two barriers by head parity."""
  x_smem = smem["x_smem"]
  q_rows = pl.ds(pl.multiple_of(rows[0], gdpa_mosaic.ALIGN), BLOCK_Q)

  def take_z(head):  # z_h to registers, then q_h's load over its tile
    tile = plan.tile(block, head)
    z = plgpu.load(x_smem.at[tile], layout=plgpu.Layout.WGMMA)
    plgpu.commit_smem()  # every thread's generic read of z_h before the TMA write
    plgpu.copy_gmem_to_smem(smem["q_ref"].at[q_rows, head], x_smem.at[tile],
                            smem["res_ready"].at[lax.rem(head, 2)])
    return z

  def finish(head, z):
    tile = plan.tile(block, head)
    plgpu.barrier_wait(smem["res_ready"].at[lax.rem(head, 2)])
    out = scaled(z.astype(_F32), head) + _load_f32(x_smem.at[tile])
    _release_q(smem, tile)
    stores.out(out, rows, head)

  def step(head, z):
    z_next = take_z(head + 1)
    finish(head, z)
    return z_next

  z = lax.fori_loop(0, plan.num_heads - 1, step, take_z(0))
  finish(plan.num_heads - 1, z)


def _release_q(smem, tile) -> None:
  """Hands a head's q tiles (``tile``) back to the producer. x_smem and res_smem were read (and x_smem
  written) by the generic proxy: a proxy fence before the producer's TMA (async proxy) may
  overwrite them, as the PTX memory model asks."""
  plgpu.commit_smem()
  plgpu.barrier_arrive(smem["q_free"].at[tile])


def _consume_attention(plan: _Plan, sched: _Schedule, scales_ref, smem) -> None:
  """The attention warpgroup: per q block and head, waits for u_h from the norm warpgroup,
  runs the head's attention and hands attn_h back in u_h's tile."""
  @pl.loop(0, sched.count)
  def _block(block):
    @pl.loop(0, plan.num_heads)
    def _head(head):
      tile = plan.tile(block, head)
      plgpu.barrier_wait(smem["u_ready"].at[tile])
      if not plan.pre_layer_norm:  # WGMMA reads q_h as TMA wrote it: observe that load too
        plgpu.barrier_wait(smem["q_ready"].at[2 * tile])
      x_tile = smem["x_smem"].at[tile]
      o = _attend_head(plan, x_tile, smem, block * plan.uses_per_block + head * plan.kv_steps,
                       scales_ref[0])
      # z_h over u_h: the WGMMAs reading u_h are done (their result was read).
      x_tile[...] = _inner_residual(plan, o * scales_ref[1], x_tile)
      plgpu.commit_smem()  # before WGMMA or the producer's TMA (async proxy) use the tile
      plgpu.barrier_arrive(smem["attn_ready"].at[tile])


def _inner_residual(plan: _Plan, attn, u_tile):
  """z_h in q's dtype from attn_h (f32, rounded to q's dtype first, as the unfused chain's GDPA
  output is) and u_h as the WGMMAs read it (q's dtype): here, so that the norm warpgroup, which
  paces the block, reads z_h once per use and never recomputes u_h."""
  attn = attn.astype(u_tile.dtype)
  if not plan.inner_residual:
    return attn
  return (_load_f32(u_tile) + attn.astype(_F32)).astype(u_tile.dtype)


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
