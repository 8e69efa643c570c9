"""dx of the lazy pre-norm GEMM as one Pallas Mosaic-GPU kernel for Hopper (sm_90a).

The backward of ``y = norm(x) @ w_gamma (+ out_bias)`` (DESIGN.md, op 1) needs no reduction over
a full row of K: with ``G = dy @ w_gammaᵀ`` (M, K) and two per-row scalars,

    c_term_i = rstd_i · (dy_i · col_sum) / K               (LayerNorm only)
    y_term_i = rstd_i² · rowsum(dy_i ⊙ (y_i − out_bias)) / K

the input gradient is the GEMM ``G`` with a per-row epilogue::

    rms:   dx = rstd ⊙ G − y_term ⊙ x
    layer: dx = rstd ⊙ G − y_term ⊙ (x − mean) − c_term

This module computes exactly that in one kernel: dy (M, N) is the A operand, w_gamma (K, N) is
read untransposed from GMEM and handed to WGMMA as a transposed SMEM view (the B operand
``w_gammaᵀ`` (N, K); WGMMA transposes 16-bit B tiles for free), and the epilogue reads the x tile
(TMA-prefetched into SMEM during the K loop) and the row vectors, then writes dx in x's dtype.

Where the row scalars come from (:func:`norm_matmul_dx`):

* the row sums in the epilogue (``row_sums_in_epilogue=True``; ``norm_matmul``'s backward for
  both norms wherever K splits into one column tile per CTA of a cluster, K ≤ 2048:
  :func:`row_sums_unsupported_reason`): no row scalars are given; the epilogue sums
  ``G ⊙ x̂`` (and, for LayerNorm, ``G``) over K across the cluster (see :func:`norm_matmul_dx`).
* given (``y_term``, ``c_term``; ``norm_matmul``'s backward where K does not split so,
  except in the fused case below): XLA computes them in one pass over dy and y
  (``pallas_norm.ops.norm_matmul.xla.row_terms``) before the kernel.
* fused (``y``, ``out_bias``, ``col_sum``; where K does not split so, for LayerNorm up to
  K, N ≤ 512, :func:`pallas_norm.ops.norm_matmul.routing.fused_row_terms_pay`): the kernel
  computes them itself, inside its K loop. The
  reduction runs over N, the same dimension as the row sums, so each K step's (tile_m, tile_k)
  dy tile, already in SMEM as the WGMMA A operand, is all the row sums need next to the
  matching y tile. y streams through
  the pipeline as a third input (the dy tile's blocks and SMEM layout), and the column vectors
  as a fourth: ``[col_sum; out_bias]`` packed into one (n_vecs, N) f32 array, one (n_vecs,
  tile_k) block per step (tile_k·4 bytes per vector and stage: SMEM that does not grow with N,
  for one more TMA per step; whole vectors resident in SMEM, 8·N bytes, would cost a stage of
  the default tiles from N ≈ 4096 on). After issuing a step's WGMMA, each consumer warpgroup
  loads its rows of the dy and y tiles into registers (WGMMA layout; for M % 8 ≠ 0 on the GPU
  the dy registers WGMMA reads) and adds, in f32, per-thread partial
  row sums (rows, 8) (:func:`pallas_norm.mgpu.lane_partial_sum`, the pre-norm forward's
  in-loop statistics technique) of ``dy ⊙ (y − out_bias)`` and, for LayerNorm, ``dy ⊙
  col_sum``, while the tensor core runs. The epilogue reduces them across lanes once per tile
  and forms ``y_term = rstd² · s_y / K`` and ``c_term = rstd · s_c / K`` from the saved rstd.
  Elementwise this is the XLA pass's math (dy and y upcast to f32, ``y − out_bias``, product,
  sum); only the summation order differs. The subtraction is done per element, as XLA does,
  rather than as ``rowsum(dy ⊙ y) − dy·out_bias``: that costs the same (a subtract and an FMA
  per element, one accumulator fewer) and does not cancel two large sums when |out_bias| ≫
  the spread of y. An output tile spans tile_n columns of K, so when K > tile_n every column
  tile of a row block recomputes the same row sums and re-reads y (mostly from L2 with the
  default N-minor grid order); computing them once per row block (the forward's
  ``stats_once``) would need a second pipeline without the y input for the other column tiles
  (stage buffers shared, barriers of its own), which is not written.

  SMEM: one (tile_m, tile_k) y stage per pipeline stage. At the default 128×256 tiles, bf16,
  64-wide steps take 64.5 KiB per stage instead of 48 (K = N = 512: 2 stages instead of 3),
  32-wide ones 32.25 KiB (4 stages); 256×128 tiles would keep a single 64-wide stage. :func:`pick_config` takes 32-wide steps for the fused row terms.

  On the H200 the fused terms win where a row block has 2 column tiles (262144×512²) and lose
  with 8 (65536×2048²): ``benchmarks/NOTES.md``, pre-norm backward. Needs y in dy's dtype
  (``norm_matmul`` otherwise keeps the XLA pass).

x̂ as a second output (``return_x_hat``; ``norm_matmul``'s backward for LayerNorm, and RMSNorm
with K < N): the epilogue has each x tile in registers with rstd and mean, so it also writes
x̂ = (x − mean) ⊙ rstd, and the weight gradients are the plain GEMM dW_γ = x̂ᵀ dy instead of a
GEMM of ``rstd ⊙ dy`` scaled by an XLA pass (M × N written and read again) with a rank-1
correction (a column sum over M × N). x̂ goes through :data:`X_HAT_SLOTS` SMEM slots per
warpgroup (one where two would cost a pipeline stage) and TMA stores, interleaved with dx's.
``x_hat_ones`` appends a block of ones columns, so the same GEMM's last row is Σ_i dy_i (the
column sums of a norm bias's gradients). With the row sums in the epilogue the kernel can give
those sums itself instead (``return_dy_col_sums``), keeping x̂ K wide: each CTA keeps one column
tile, so it streams the same reduction steps for every row block; CTA c of the cluster sums the
whole 128-row dy stage of steps c, c + cluster, ... (its consumers alternate), read transposed
so the rows add up within each warp, into per-CTA f32 rows in SMEM that are stored once at the
end; XLA adds the CTAs' partials. It reads each dy stage from SMEM once more, next to WGMMA's
reads.

dW_γ in the kernel (``return_dw_gamma``; ``norm_matmul``'s backward at K = 128, N ≤ 128): with
the row sums in the epilogue on one CTA, the epilogue writes x̂ into a WGMMA A tile in SMEM
instead of GMEM, and each consumer adds x̂[:, its 64 columns]ᵀ dy (dy's row block TMA'd again,
from L2, with the x tile) to a (64, N) f32 accumulator that lives across the CTA's row blocks
(:meth:`_DxHooks.consumer_scope`); the partials are stored once and XLA adds them. No GEMM reads
x̂ and dy again.

Kernel structure: the GEMM body of :mod:`pallas_norm.mgpu.gemm` over the (M, K) output tiles
(A: dy (tile_m, tile_k); B: w_gamma (tile_n, tile_k), read transposed; the reduction runs over N
in steps of tile_k) with the hooks of :class:`_DxHooks`. Each consumer owns an SMEM buffer of
its (tile_m/2, tile_n) slice of x, cut into epilogue tiles and fetched at K step
:data:`X_PREFETCH_STEP` (after the previous epilogue's TMA stores have read the buffer); the
epilogue overwrites each x epilogue tile in place with dx and stores it with TMA. The epilogue
never waits for a store; every epilogue tile has its own SMEM slot. The K loop runs on the
shared ring (:class:`pallas_norm.mgpu.SharedRing`), its steps numbered across the CTA's tiles.

Shapes: the forward's (any M ≥ 1; N and K multiples of 64; bfloat16 or float16). The x and dx
tiles go through untiled swizzled SMEM (plain 2-D TMA boxes: rows past M read as zeros and are
never written). For M % 8 != 0 on the GPU the dy stages (and y stages) are untiled too and WGMMA
takes A from registers, as in the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm import _validate, mgpu
from pallas_norm.mgpu import TileConfig
from pallas_norm.mgpu import exchange as cluster_exchange
from pallas_norm.mgpu import gemm as gemm_core
from pallas_norm.ops.norm_matmul import routing
from pallas_norm.ops.norm_matmul import mosaic as forward

__all__ = ["pick_config", "unsupported_reason", "row_sums_unsupported_reason",
           "dy_col_sums_unsupported_reason", "dw_gamma_unsupported_reason", "norm_matmul_dx",
           "launch"]

X_PREFETCH_STEP = 1
"""The K step (over N) at which a consumer fetches the x tile and row vectors of its epilogue
(clamped to the number of steps): late enough that the previous tile's dx stores have left the
shared buffer, early enough to land before the epilogue."""


def unsupported_reason(m: int, n: int, k: int, dtype) -> str | None:
  """None if the kernel can compute dx for dy: (m, n), w_gamma: (k, n), else why not.

  The same shapes as the forward kernel (N and K multiples of 64, bfloat16/float16).
  """
  return forward.unsupported_reason(m, k, n, dtype)


def row_sums_unsupported_reason(m: int, n: int, k: int, dtype, interpret: bool = False
                                ) -> str | None:
  """None if the kernel can compute dx with the row sums in its epilogue
  (``norm_matmul_dx(..., row_sums_in_epilogue=True)``), else why not: the kernel's shapes, and
  K split over a cluster of 1, 2, 4 or 8 CTAs of one column tile (a multiple of 64 up to 256)
  each, so K ≤ 2048; in interpret mode K ≤ 256 (one CTA: it cannot read a peer's SMEM)."""
  if (reason := unsupported_reason(m, n, k, dtype)) is not None:
    return reason
  if routing.k_split(k, interpret) is None:
    return (f"K = {k} does not split into one column tile (a multiple of 64 up to 256) per CTA "
            "of a cluster of 1, 2, 4 or 8" + (" (interpret mode: a cluster of 1, K ≤ 256)"
                                              if interpret else ""))
  return None


def dy_col_sums_unsupported_reason(m: int, n: int, k: int, dtype, config: TileConfig, *,
                                   layer: bool, x_hat: bool, interpret: bool = False,
                                   dw: bool = False) -> str | None:
  """None if the kernel with the row sums in the epilogue and ``config`` (:func:`pick_config`'s
  for that route) can also return Σ_i dy_i (``return_dy_col_sums``) at no cost of a pipeline
  stage; else why not (``norm_matmul``'s backward then takes x̂'s ones block for them).
  ``layer``: LayerNorm (mean given); ``x_hat``: x̂ returned too; ``dw``: dW_γ summed too.

  Raises: ValueError from the plan where ``config`` does not run the row sums' route even
  without the sums (the error the launch would give: not a reason of the sums')."""
  plan = functools.partial(_make_plan, m, n, k, dtype, layer, config, interpret, x_hat=x_hat,
                           row_sums=True, dw=dw)
  without = _pick_exchange(plan)
  try:
    with_sums = _pick_exchange(functools.partial(plan, col_sums=True))
  except ValueError as e:
    return str(e)
  if with_sums.stages < without.stages:
    return (f"SMEM for the column sums of N = {n} ({with_sums.col_sum_rows} rows per consumer) "
            "next to the pipeline costs a stage")
  return None


def dw_gamma_unsupported_reason(m: int, n: int, k: int, dtype, config: TileConfig, *,
                                layer: bool, interpret: bool = False) -> str | None:
  """None if the kernel with the row sums in the epilogue and ``config`` (:func:`pick_config`'s
  for that route, without x̂) can also sum dW_γ = x̂ᵀ dy over its row blocks
  (``return_dw_gamma``), else why not: K = 128 on one CTA, N ≤ :data:`DW_MAX_N`, M a multiple
  of 8 on the GPU, and its SMEM beside the pipeline (:func:`_dw_unsupported_reason`)."""
  if (reason := unsupported_reason(m, n, k, dtype)) is not None:
    return reason
  try:
    _make_plan(m, n, k, dtype, layer, config, interpret, row_sums=True, dw=True)
  except ValueError as e:
    return str(e)
  return None


def pick_config(m: int, n: int, k: int, *, fused_row_terms: bool = False,
                x_hat: bool = False, row_sums: bool = False,
                interpret: bool = False) -> TileConfig:
  """Tiling for dx (m, k) = dy (m, n) @ w_gammaᵀ: the forward's tile shape for the output width
  K in place of N (tile_n over K, tile_k over the reduction N), without its forward-only options,
  on the shared ring without a WGMMA in flight (faster than Pallas's pipeline, tied with it for
  the fused row terms, and faster than the ring with one in flight: ``benchmarks/EXPERIMENTS.md``,
  Pallas's pipeline).

  ``fused_row_terms`` (y streams through the pipeline too): the same tiles, with 32-wide
  reduction steps where the extra SMEM leaves room for fewer than 3 64-wide stages (every
  default tile shape): a deeper pipeline of narrower steps tied or won against 2 stages of 64
  (measured: ``benchmarks/EXPERIMENTS.md``, pre-norm GEMM). With a single 64-wide stage
  (256×128 tiles) no load would overlap a WGMMA at all. ``x_hat`` (the epilogue also writes
  x̂): the same rule with one x̂ slot's SMEM counted (at the default tiles of 262144×512×512 and
  ×2048 it changes nothing).
  ``row_sums`` (the row sums in the epilogue): the column tile is K's share of one CTA of the
  cluster (:func:`row_sums_unsupported_reason`), 128 rows per CTA (one 64-row epilogue tile per
  warpgroup, whose row vectors the exchange sends whole), the same rule for tile_k, and the
  shared ring (its steps numbered across the CTA's row blocks, so the next row block's stages
  load while the epilogue and the exchange run; Pallas's pipeline with 32-wide steps measured
  slower, EXPERIMENTS.md).
  """
  fwd = forward.pick_config(m, n, k)
  cfg = TileConfig(tile_m=fwd.tile_m, tile_n=fwd.tile_n, tile_k=fwd.tile_k,
                   max_concurrent_steps=fwd.max_concurrent_steps, epi_tile_m=fwd.epi_tile_m,
                   epi_tile_n=fwd.epi_tile_n, pipeline="ring")
  if row_sums:
    split = routing.k_split(k, interpret)
    if split is None:
      raise ValueError(row_sums_unsupported_reason(m, n, k, jnp.bfloat16, interpret))
    cfg = dataclasses.replace(cfg, tile_m=128, tile_n=split[1], epi_tile_m=64)
  # The most SMEM any such call takes besides the stages: LayerNorm (with out_bias), 16-bit.
  n_vecs = _n_vecs(True, fused_row_terms, True)
  if ((fused_row_terms or x_hat)
      and _stages_that_fit(cfg, jnp.bfloat16, True, fused_row_terms, n_vecs, x_hat) < 3):
    cfg = dataclasses.replace(cfg, tile_k=32)
  return cfg


@dataclasses.dataclass(frozen=True)
class _Plan(gemm_core.KLoopFacts):
  """Static facts of one kernel instance (reduction over n, output (m, k))."""
  m: int
  n: int
  k: int
  dtype: jnp.dtype
  layer: bool
  fused: bool  # the kernel computes y_term / c_term from y (fused row terms)
  has_bias: bool  # fused: out_bias is subtracted from y
  x_hat: bool  # the epilogue also writes x̂ = (x − mean) ⊙ rstd, the weight gradients' operand
  x_hat_ones: bool  # x̂ has a block of ones columns after its k_iters · tile_n columns
  x_hat_slots: int  # x̂ staging slots per consumer warpgroup (0 without x̂)
  cfg: TileConfig
  kloop: gemm_core.KLoop
  num_ctas: int  # persistent CTAs (row sums: clusters)
  epi_n: int
  x_prefetch_step: int
  row_sums: bool = False  # the row sums over K in the epilogue (no y, y_term, c_term)
  cluster: int = 1  # row sums: CTAs sharing a row block, one column tile each
  exchange: str = "pull"  # row sums: how the cluster's CTAs share them (mgpu.exchange)
  col_sums: bool = False  # row sums: the kernel also sums dy over its rows, Σ_i dy_i (N,)
  dw: bool = False  # row sums: the kernel also sums dW_γ = x̂ᵀ dy over its rows (no x̂ output)

  @property
  def dw_n(self) -> int:  # dW_γ's columns that the kernel sums (0 without)
    return self.n if self.dw else 0

  @property
  def n_rows(self) -> int:  # row vectors read by TMA: rstd, y_term (+ mean, c_term) or, fused
    return _n_rows(self.layer, self.fused or self.row_sums)  # or row sums, rstd (+ mean)

  @property
  def exchange_spec(self) -> cluster_exchange.Spec:  # row sums: rowsum(G) (LayerNorm), rowsum(G ⊙ x̂)
    return cluster_exchange.Spec(cluster=self.cluster, rows=self.cfg.wg_tile_m,
                                 n_partials=1 + int(self.layer), exchange=self.exchange)

  @property
  def n_vecs(self) -> int:  # fused: column vectors streamed per step, col_sum (+ out_bias)
    return _n_vecs(self.layer, self.fused, self.has_bias)

  @property
  def m_iters(self) -> int:  # row blocks of tile_m rows
    return -(-self.m // self.cfg.tile_m)

  @property
  def k_iters(self) -> int:  # output column tiles
    return -(-self.k // self.cfg.tile_n)

  @property
  def red_iters(self) -> int:  # pipeline steps over the reduction dim N
    return self.n // self.cfg.tile_k

  @property
  def chunks(self) -> tuple[int, int]:  # epilogue tiles per warpgroup (along M, along K)
    return self.cfg.wg_tile_m // self.cfg.epi_tile_m, self.cfg.tile_n // self.epi_n

  @property
  def col_sum_rows(self) -> int:  # col sums: steps a consumer sums per CTA (0 without)
    return _col_sum_rows(self.red_iters, self.cluster) if self.col_sums else 0

  @property
  def x_hat_width(self) -> int:  # x̂'s columns: K, or K padded to whole tiles + the ones block
    return self.k_iters * self.cfg.tile_n + self.epi_n if self.x_hat_ones else self.k


def _col_sum_rows(red_iters: int, cluster: int) -> int:
  """Reduction steps whose column sums one consumer warpgroup of a CTA keeps: CTA c of the
  cluster sums steps c, c + cluster, ... (its j-th), and consumer j % 2 of them (the whole
  128-row stage, :meth:`pallas_norm.mgpu.gemm.KStep.a_column_sums`)."""
  steps_per_cta = -(-red_iters // cluster)
  return -(-steps_per_cta // 2)


def _n_rows(layer: bool, fused: bool) -> int:
  return (1 if fused else 2) * (2 if layer else 1)


def _n_vecs(layer: bool, fused: bool, has_bias: bool) -> int:
  return int(fused) * (int(layer) + int(has_bias))


def _streams(cfg: TileConfig, dtype, a_in_registers: bool, fused: bool,
             n_vecs: int) -> list[gemm_core.Stream]:
  """Per reduction step: dy (tile_m, tile_k) and w_gamma (tile_n, tile_k) (WGMMA reads it
  transposed); with the fused row terms y in dy's blocks and layout, and the step's (n_vecs,
  tile_k) f32 block of [col_sum; out_bias]. dy (and y) stages are untiled when WGMMA reads A
  from registers."""
  dy = gemm_core.Stream((cfg.tile_m, cfg.tile_k), dtype, 1, mgpu.swizzle_transforms(
      cfg.tile_k, dtype, tiled=not a_in_registers))
  streams = [dy, gemm_core.Stream((cfg.tile_n, cfg.tile_k), dtype, 1,
                                  mgpu.swizzle_transforms(cfg.tile_k, dtype))]
  if fused:
    streams.append(dy)
    if n_vecs:
      streams.append(gemm_core.Stream((n_vecs, cfg.tile_k), jnp.float32, 1))
  return streams


def _smem(cfg: TileConfig, dtype, n_rows: int, x_hat_slots: int = 0,
          exchange_allocs: dict | None = None, col_sum_rows: int = 0, dw_n: int = 0) -> dict:
  """SMEM besides the stages, per consumer warpgroup: its (tile_m/2, tile_n) slice of x as
  untiled epilogue tiles (dx overwrites them in place), the row vectors, the barrier their
  TMA copies arrive on (one arrival per copy) and ``x_hat_slots`` epilogue tiles' slots for
  x̂ (their TMA stores read them while the next epilogue tiles are computed); with the row
  sums in the epilogue, the cluster exchange's (:func:`pallas_norm.mgpu.exchange.allocs`);
  with the column sums of dy, ``col_sum_rows`` f32 rows of tile_k (:func:`_col_sum_rows`);
  with dW_γ summed in the kernel (``dw_n`` = N), :func:`_dw_smem`'s."""
  epi_n = forward._epi_tile_n(cfg, dtype)  # pylint: disable=protected-access
  chunks = (cfg.wg_tile_m // cfg.epi_tile_m) * (cfg.tile_n // epi_n)
  tile_transforms = mgpu.swizzle_transforms(epi_n, dtype, tiled=False)
  return dict(
      x_smem=plgpu.SMEM((2, chunks, cfg.epi_tile_m, epi_n), dtype, transforms=tile_transforms),
      x_hat_smem=(plgpu.SMEM((2, x_hat_slots, cfg.epi_tile_m, epi_n), dtype,
                             transforms=tile_transforms) if x_hat_slots else None),
      row_smem=plgpu.SMEM((2, n_rows, cfg.wg_tile_m), jnp.float32),
      in_barrier=plgpu.Barrier(num_arrivals=chunks + n_rows + int(dw_n > 0), num_barriers=2),
      exchange_allocs=exchange_allocs,
      col_sum_smem=(plgpu.SMEM((2, col_sum_rows, cfg.tile_k), jnp.float32) if col_sum_rows
                    else None),
      dw_allocs=_dw_smem(cfg, dtype, dw_n) if dw_n else None)


DW_STORE_N = 32
"""Columns of dW_γ per TMA store of a CTA's partial (once, at its end): an f32 (64, 32) slot per
consumer, so the partial's store costs 16 KiB of SMEM, not the 64 KiB of whole rows."""


def _dw_smem(cfg: TileConfig, dtype, n: int) -> dict:
  """SMEM of dW_γ = x̂ᵀ dy summed in the kernel: the row block's x̂ in WGMMA's A layout (one
  (tile_m, 64) block per 64 columns of the CTA's K tile; consumer w writes its rows of each and
  reads block w transposed: it owns dW_γ's rows [64w, 64w + 64)), the row block's whole dy
  (tile_m, N) as the B operand (each consumer loads its rows with the x tile: the ring's stages
  are released during the K loop), the f32 slots the CTA's partial is stored through, and two
  2-arrival barriers: both consumers' x̂ (and dy rows) written, both consumers' dW WGMMA done
  (x̂ and dy may be overwritten)."""
  return dict(
      x_hat=plgpu.SMEM((cfg.tile_n // 64, cfg.tile_m, 64), dtype,
                       transforms=mgpu.swizzle_transforms(64, dtype)),
      dy=plgpu.SMEM((cfg.tile_m, n), dtype, transforms=mgpu.swizzle_transforms(n, dtype)),
      out=plgpu.SMEM((2, cfg.wg_tile_m, DW_STORE_N), jnp.float32),
      ready=plgpu.Barrier(num_arrivals=2),
      free=plgpu.Barrier(num_arrivals=2))


def _stages_that_fit(cfg: TileConfig, dtype, layer: bool, fused: bool, n_vecs: int,
                     x_hat: bool = False) -> int:
  """Pipeline stages that fit in SMEM next to the epilogue's buffers (not capped)."""
  return gemm_core.fit_stages(cfg, _streams(cfg, dtype, False, fused, n_vecs),
                              _smem(cfg, dtype, _n_rows(layer, fused), int(x_hat)))


X_HAT_SLOTS = 2
"""x̂ slots per consumer warpgroup where they cost no pipeline stage (else 1): an epilogue tile
waits, before it writes its x̂, for the store of the x̂ written ``X_HAT_SLOTS`` tiles before
(with one slot, the store issued just before: its read-out is not hidden by the little work of
one epilogue tile)."""


def _x_hat_slots(cfg: TileConfig, dtype, streams, n_rows: int) -> int:
  """:data:`X_HAT_SLOTS` when the stages that fit next to them are as many as next to one."""
  def stages(slots):
    return min(cfg.max_concurrent_steps,
               gemm_core.fit_stages(cfg, streams, _smem(cfg, dtype, n_rows, slots)))
  return X_HAT_SLOTS if stages(X_HAT_SLOTS) >= stages(1) else 1


def _make_plan(m, n, k, dtype, layer, cfg, interpret, *, fused=False, has_bias=False,
               x_hat=False, x_hat_ones=False, row_sums=False, col_sums=False, dw=False,
               exchange="pull") -> _Plan:
  # stats_once is the pre-norm forward's alone.
  mgpu.reject_unused_options(cfg, "dx", ("stats_once",))
  has_bias = fused and has_bias
  # As in the forward: A from registers for M % 8 ≠ 0 on the GPU.
  a_in_registers = not interpret and m % 8 != 0
  red_iters = n // cfg.tile_k
  k_tiles = -(-k // cfg.tile_n)
  if row_sums and (k_tiles * cfg.tile_n != k or k_tiles not in mgpu.CLUSTER_SIZES
                   or cfg.epi_tile_m != cfg.wg_tile_m or (interpret and k_tiles != 1)):
    raise ValueError(f"row sums in the epilogue need K = {k} split into 1, 2, 4 or 8 column tiles "
                     f"of tile_n = {cfg.tile_n} (one per CTA of the cluster; 1 in interpret "
                     f"mode) and epi_tile_m = tile_m / 2, got {cfg}")
  cluster = k_tiles if row_sums else 1
  if col_sums and (reason := _col_sums_unsupported_reason(cfg, row_sums, a_in_registers)):
    raise ValueError(f"the column sums of dy in the dx kernel need {reason}, got {cfg}")
  col_sum_rows = _col_sum_rows(red_iters, cluster) if col_sums else 0
  if dw and (reason := _dw_unsupported_reason(cfg, dtype, n, cluster, row_sums, x_hat,
                                               a_in_registers)):
    raise ValueError(f"dW_γ in the dx kernel needs {reason}, got {cfg}")
  dw_n = n if dw else 0
  spec = cluster_exchange.Spec(cluster=cluster, rows=cfg.wg_tile_m, n_partials=1 + int(layer),
                               exchange=exchange)
  n_rows = _n_rows(layer, fused or row_sums)
  streams = _streams(cfg, dtype, a_in_registers, fused, _n_vecs(layer, fused, has_bias))
  x_hat_slots = _x_hat_slots(cfg, dtype, streams, n_rows) if x_hat else 0
  kloop = gemm_core.plan_k_loop(
      cfg, streams, red_iters,
      _smem(cfg, dtype, n_rows, x_hat_slots, cluster_exchange.allocs(spec), col_sum_rows, dw_n),
      a_in_registers=a_in_registers, what=" next to the x tile of the epilogue"
      + (" (with the y stage of the fused row terms)" if fused else "")
      + (" (with the x̂ slot)" if x_hat else ""))
  m_iters = -(-m // cfg.tile_m)
  return _Plan(m=m, n=n, k=k, dtype=jnp.dtype(dtype), layer=layer, fused=fused,
               has_bias=has_bias, x_hat=x_hat, x_hat_ones=x_hat and x_hat_ones,
               x_hat_slots=x_hat_slots, cfg=cfg, kloop=kloop,
               num_ctas=mgpu.persistent_clusters(cluster, m_iters * (1 if row_sums else k_tiles),
                                                 interpret),
               epi_n=forward._epi_tile_n(cfg, dtype),  # pylint: disable=protected-access
               x_prefetch_step=min(X_PREFETCH_STEP, red_iters - 1), row_sums=row_sums,
               cluster=cluster, exchange=exchange, col_sums=col_sums, dw=dw)


DW_K = 128
"""The only K whose dW_γ the dx kernel sums: one 128-column tile on one CTA, 64 of dW_γ's rows
per consumer (WGMMA's M)."""

DW_MAX_N = 128
"""The widest N whose dW_γ rows a consumer accumulates in registers beside dx's: (64, N) f32 is
N / 2 registers a thread, next to the (64, 128) dx accumulator's 64."""


def _dw_unsupported_reason(cfg: TileConfig, dtype, n: int, cluster: int, row_sums: bool,
                           x_hat: bool, a_in_registers: bool) -> str | None:
  """None if the kernel can sum dW_γ = x̂ᵀ dy itself (:meth:`_DxHooks._issue_dw`): with the row
  sums in the epilogue on one CTA per row block (its K tile is all of K), K = tile_n = 128 (each
  consumer owns 64 of dW_γ's rows), 64-column epilogue tiles (one per block of x̂'s WGMMA tile),
  N ≤ :data:`DW_MAX_N`, 128-row blocks, tiled dy (M a multiple of 8 on the GPU), on the shared
  ring and without x̂ as an output."""
  if not row_sums or cluster != 1:
    return "the row sums in the epilogue on one CTA (K ≤ 256)"
  if cfg.tile_n != DW_K or cfg.tile_m != 128:
    return f"K = tile_n = {DW_K} and tile_m = 128"
  if n > DW_MAX_N:
    return f"N ≤ {DW_MAX_N} (its accumulator lives in registers)"
  if forward._epi_tile_n(cfg, dtype) != 64:  # pylint: disable=protected-access
    return "64-column epilogue tiles (epi_tile_n ≥ 64)"
  if a_in_registers:
    return "tiled dy stages (M a multiple of 8 on the GPU)"
  if x_hat:
    return "no x̂ output (dW_γ replaces its GEMM)"
  if cfg.pipeline != "ring":
    return "the shared ring"
  return None


def _col_sums_unsupported_reason(cfg: TileConfig, row_sums: bool, a_in_registers: bool
                                 ) -> str | None:
  """None if the kernel can sum dy's columns (:meth:`_DxHooks._add_column_sums`): only with the
  row sums in the epilogue (a CTA keeps one column tile, so the same steps, across its row
  blocks), from tiled dy stages read transposed in 64-row blocks of tile_k a multiple of 64."""
  if not row_sums:
    return "the row sums in the epilogue (row_sums_in_epilogue=True)"
  if a_in_registers:
    return "tiled dy stages (M a multiple of 8 on the GPU)"
  if cfg.tile_k % 64 or cfg.tile_m % 64:
    return "tile_k and tile_m multiples of 64"
  return None


def _pick_exchange(make_plan) -> _Plan:
  """The row sums' exchange, by the post-norm forward's rule
  (:func:`pallas_norm.ops.matmul_norm.mosaic._pick_exchange`): "push" for clusters of 2 where
  its inbox costs no pipeline stage, else "pull"."""
  pull = make_plan(exchange="pull")
  if pull.cluster != 2:
    return pull
  try:
    push = make_plan(exchange="push")
  except ValueError:  # the inbox does not fit in SMEM next to this config: pull still does
    return pull
  return push if push.stages >= pull.stages else pull


# ------------------------------------------------------------------------------------------------
# Fused row terms: per-thread partial row sums in the WGMMA layout (see the module docstring).


def _init_row_sums(plan: _Plan) -> tuple:
  """Zero partials of rowsum(dy ⊙ (y − out_bias)) (+ rowsum(dy ⊙ col_sum) for LayerNorm)."""
  if not plan.fused:
    return ()
  zeros = mgpu.lane_partial_zeros(plan.cfg.wg_tile_m)
  return (zeros, zeros) if plan.layer else (zeros,)


def _update_row_sums(plan: _Plan, sums: tuple, dy, y, vec_stage) -> tuple:
  """Adds one K step's f32 tiles dy, y (rows, tile_k) to the partial row sums; ``vec_stage`` is
  the step's (n_vecs, tile_k) SMEM block of [col_sum; out_bias] (None when n_vecs is 0)."""
  def col_vec(i):  # row i of the block, broadcast over the tile's rows
    v = plgpu.load(vec_stage.at[i], layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(v, dy.shape, [1])

  # y − out_bias per element, as XLA's pass: no cancellation of two large sums.
  y_gemm = y - col_vec(int(plan.layer)) if plan.has_bias else y
  out = [sums[0] + mgpu.lane_partial_sum(dy * y_gemm)]
  if plan.layer:
    out.append(sums[1] + mgpu.lane_partial_sum(dy * col_vec(0)))
  return tuple(out)


def _epilogue_rows(plan: _Plan, rows: list, sums: tuple):
  """(rstd, y_term, mean, c_term) row vectors (layout WGMMA.reduce(1); mean and c_term None for
  RMSNorm) from the TMA'd row vectors and, fused, the K loop's partial row sums (reduced across
  lanes here, once per tile): y_term = rstd² · s_y / K, c_term = rstd · s_c / K."""
  if not plan.fused:
    rstd, y_term = rows[:2]
    mean, c_term = rows[2:] if plan.layer else (None, None)
    return rstd, y_term, mean, c_term
  inv_k = 1.0 / plan.k
  rstd = rows[0]
  y_term = rstd * rstd * (jnp.sum(sums[0], axis=1) * inv_k)
  if not plan.layer:
    return rstd, y_term, None, None
  return rstd, y_term, rows[1], rstd * (jnp.sum(sums[1], axis=1) * inv_k)


# ------------------------------------------------------------------------------------------------
# The kernel: the GEMM body of pallas_norm.mgpu.gemm with the row-term and dx epilogue hooks.


class _DxHooks(gemm_core.Hooks):
  """dx on the GEMM body: the x tile and row vectors of the epilogue fetched at reduction step
  :data:`X_PREFETCH_STEP`, the fused row terms' partial sums of each step's dy and y tiles,
  and the epilogue ``rstd ⊙ acc − y_term ⊙ (x − mean) − c_term`` written over the x tile in
  SMEM and stored by TMA; with ``plan.dw`` the epilogue also adds x̂ᵀ dy to dW_γ's accumulator
  (:meth:`_issue_dw`). SMEM: :func:`_smem`."""

  def __init__(self, plan: _Plan, wg, refs, x_gmem, row_gmems, dx_gmem, x_hat_gmem,
               col_sum_gmem, dy_gmem=None, dw_gmem=None):
    self.plan, self.wg, self.x_gmem, self.row_gmems, self.dx_gmem = (plan, wg, x_gmem,
                                                                     row_gmems, dx_gmem)
    self.x_hat_gmem, self.col_sum_gmem = x_hat_gmem, col_sum_gmem
    self.col_sum_smem = refs["col_sum_smem"]
    self.x_smem, self.row_smem, self.in_barrier = (refs["x_smem"], refs["row_smem"],
                                                   refs["in_barrier"])
    self.x_hat_smem = refs["x_hat_smem"]
    self.dy_gmem, self.dw_gmem, self.dw_smem = dy_gmem, dw_gmem, refs["dw_allocs"]
    self.dw_acc = None  # dW_γ's accumulator ref, while consumer_scope runs
    self.ex = (None if refs["exchange_allocs"] is None
               else cluster_exchange.Exchange(**refs["exchange_allocs"]))

  def _chunk_window(self, ref, tile, ci, cj):
    cfg, epi_m, epi_n = self.plan.cfg, self.plan.cfg.epi_tile_m, self.plan.epi_n
    row0 = tile.m_idx * cfg.tile_m + self.wg * cfg.wg_tile_m  # first row of this warpgroup
    col0 = tile.n_idx * cfg.tile_n  # first column of x / dx
    return ref.at[pl.ds(row0 + ci * epi_m, epi_m), pl.ds(col0 + cj * epi_n, epi_n)]

  def _prefetch_epilogue_inputs(self, tile):
    plan, wg = self.plan, self.wg
    chunks_m, chunks_n = plan.chunks
    # The previous tile's dx stores read x_smem: they must be done before it is refilled.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for ci in range(chunks_m):
      for cj in range(chunks_n):
        plgpu.copy_gmem_to_smem(self._chunk_window(self.x_gmem, tile, ci, cj),
                                self.x_smem.at[wg, ci * chunks_n + cj], self.in_barrier.at[wg])
    row0 = tile.m_idx * plan.cfg.tile_m + wg * plan.cfg.wg_tile_m
    for i, r_gmem in enumerate(self.row_gmems):
      plgpu.copy_gmem_to_smem(r_gmem.at[pl.ds(row0, plan.cfg.wg_tile_m)],
                              self.row_smem.at[wg, i], self.in_barrier.at[wg])
    if plan.dw:
      # The previous block's dW WGMMAs (both consumers') read the x̂ and dy tiles refilled now.
      pl.when(tile.index > 0)(lambda: plgpu.barrier_wait(self.dw_smem["free"]))
      rows = pl.ds(row0, plan.cfg.wg_tile_m)
      plgpu.copy_gmem_to_smem(self.dy_gmem.at[rows],
                              self.dw_smem["dy"].at[pl.ds(wg * plan.cfg.wg_tile_m,
                                                          plan.cfg.wg_tile_m)],
                              self.in_barrier.at[wg])

  def k_step_start(self, tile, k_idx):
    pl.when(k_idx == self.plan.x_prefetch_step)(lambda: self._prefetch_epilogue_inputs(tile))

  def init_carry(self, tile):
    return _init_row_sums(self.plan)

  def start(self):
    if self.plan.col_sums:
      pl.when(self.wg < 2)(self._zero_column_sums)

  def _zero_column_sums(self):
    """Zeros this consumer's column-sum rows, in the layout that adds to them (each thread
    then reads back only what it wrote); the barrier in commit_smem orders the stores before
    any warp's first add."""
    zeros = plgpu.layout_cast(jnp.zeros((self.plan.cfg.tile_k,), jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
    for i in range(self.plan.col_sum_rows):
      self.col_sum_smem.at[self.wg, i][...] = zeros
    plgpu.commit_smem()

  def _add_column_sums(self, tile, step):
    """Adds this step's Σ over the stage's rows of dy to the CTA's column sums, if the step is
    this consumer's: CTA c of the cluster (column tile c) sums its row blocks' steps c,
    c + cluster, ... and of those its consumer j % 2 the j-th (no row of the SMEM sums has
    two writers). The sums run while the tensor core works on the step's WGMMA."""
    cluster = self.plan.cluster
    j = step.k_idx // cluster
    mine = lax.rem(j, 2) == self.wg
    if cluster > 1:
      mine = mine & (lax.rem(step.k_idx, cluster) == tile.n_idx)

    @pl.when(mine)
    def _add():
      row = self.col_sum_smem.at[self.wg, j // 2]
      total = plgpu.load(row, layout=plgpu.Layout.WGMMA.reduce(1)) + step.a_column_sums()
      row[...] = total

  def k_step(self, tile, step, sums):
    if self.plan.col_sums:
      self._add_column_sums(tile, step)
    # With the fused row terms, every column tile of a row block recomputes the same row sums
    # from the same dy and y tiles (y re-read, mostly from L2 with the N-minor grid). It is
    # what makes the fused path lose at K = 2048 (8 column tiles; routing.py); reusing the sums
    # across column tiles would need a second pipeline without y (module docstring).
    if not self.plan.fused:
      return sums
    y_smem, *vec_smem = step.stages[2:]
    dy = step.a()  # loads while the tensor core works on the WGMMA just issued
    y = step.load(y_smem)
    return _update_row_sums(self.plan, sums, dy.astype(jnp.float32), y.astype(jnp.float32),
                            vec_smem[0] if vec_smem else None)

  def _store_ones_block(self, tile):
    """The last column tile of a row block also stores x̂'s ones block (all ones, one epilogue
    tile wide, after the padded K columns) for its rows, from x̂ slot 0: no store is pending
    here (the x prefetch waited for the previous tile's), and the first x̂ of this epilogue
    (slot 0 too) waits for these."""
    plan, wg = self.plan, self.wg
    epi_m, epi_n = plan.cfg.epi_tile_m, plan.epi_n
    cols = lax.broadcasted_iota(jnp.int32, (epi_m, epi_n), 1)
    self.x_hat_smem.at[wg, 0][...] = plgpu.layout_cast(
        jnp.where(cols >= 0, 1.0, 0.0).astype(plan.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    row0 = tile.m_idx * plan.cfg.tile_m + wg * plan.cfg.wg_tile_m
    for ci in range(plan.chunks[0]):
      plgpu.copy_smem_to_gmem(self.x_hat_smem.at[wg, 0], self.x_hat_gmem.at[
          pl.ds(row0 + ci * epi_m, epi_m), pl.ds(plan.x_hat_width - epi_n, epi_n)])

  def _wait_rows(self):
    """The epilogue's row vectors (TMA'd with the x tile), layout WGMMA.reduce(1)."""
    plgpu.barrier_wait(self.in_barrier.at[self.wg])
    return [plgpu.load(self.row_smem.at[self.wg, i], layout=plgpu.Layout.WGMMA.reduce(1))
            for i in range(self.plan.n_rows)]

  def _store(self, tile, ci, cj, dx, x_hat):
    """Writes epilogue tile (ci, cj)'s dx over its x slot (each thread rewrites what it read)
    and x̂ (when asked) into an x̂ slot, and stores both by TMA."""
    plan, wg = self.plan, self.wg
    slot = self.x_smem.at[wg, ci * plan.chunks[1] + cj]
    if plan.x_hat:
      # Two stores per epilogue tile (x̂, then dx): x̂ slot c % slots is free once the x̂
      # store of tile c − slots has read it, i.e. when at most the 2·slots − 1 stores
      # issued after it are pending; in the first tile, once the ones block's stores have
      # (all that is pending then: the x prefetch waited for the previous tile's).
      c = ci * plan.chunks[1] + cj
      x_hat_slot = self.x_hat_smem.at[wg, c % plan.x_hat_slots]
      plgpu.wait_smem_to_gmem(0 if c == 0 and plan.x_hat_ones else 2 * plan.x_hat_slots - 1,
                              wait_read_only=True)
      x_hat_slot[...] = x_hat.astype(plan.dtype)
    slot[...] = dx.astype(plan.dtype)
    plgpu.commit_smem()
    if plan.x_hat:
      plgpu.copy_smem_to_gmem(x_hat_slot, self._chunk_window(self.x_hat_gmem, tile, ci, cj))
    plgpu.copy_smem_to_gmem(slot, self._chunk_window(self.dx_gmem, tile, ci, cj))

  def epilogue(self, tile, acc, sums):
    plan, wg = self.plan, self.wg
    if plan.x_hat_ones:
      pl.when(tile.n_idx == plan.k_iters - 1)(lambda: self._store_ones_block(tile))
    if plan.row_sums:
      self._row_sums_epilogue(tile, acc)
      return
    epi_m, epi_n = plan.cfg.epi_tile_m, plan.epi_n
    chunks_m, chunks_n = plan.chunks
    bcast = lambda v: None if v is None else lax.broadcast_in_dim(v, acc.shape, [0])
    rstd, y_term, mean, c_term = map(bcast, _epilogue_rows(plan, self._wait_rows(), sums))
    for ci in range(chunks_m):
      for cj in range(chunks_n):
        ms, ns = slice(ci * epi_m, (ci + 1) * epi_m), slice(cj * epi_n, (cj + 1) * epi_n)
        xv = plgpu.load(self.x_smem.at[wg, ci * chunks_n + cj],
                        layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        if plan.layer:
          xv = xv - mean[ms, ns]
        dx = acc[ms, ns] * rstd[ms, ns] - y_term[ms, ns] * xv
        if plan.layer:
          dx = dx - c_term[ms, ns]
        self._store(tile, ci, cj, dx, xv * rstd[ms, ns] if plan.x_hat else None)

  def _row_sums_epilogue(self, tile, acc):
    """dx = rstd ⊙ (G − mean_K(G) − x̂ ⊙ mean_K(G ⊙ x̂)) (RMSNorm: no mean_K(G) term), G the
    accumulator: the CTA's partial row sums over its column tile, summed with its cluster
    peers' (:func:`pallas_norm.mgpu.exchange.cluster_row_sums`, every CTA adds them in CTA
    order), x̂ = (x − mean) ⊙ rstd in f32 from the x tile (the pre-norm backward of DESIGN.md
    written as the post-norm one's: nothing reads y, so no rounded y' cancels)."""
    plan, wg, epi_n = self.plan, self.wg, self.plan.epi_n
    rows = self._wait_rows()
    shape = (plan.cfg.wg_tile_m, epi_n)
    bcast = lambda v: lax.broadcast_in_dim(v, shape, [0])
    rstd = bcast(rows[0])
    mean = bcast(rows[1]) if plan.layer else None

    def chunk(cj):  # (x̂, G) of column chunk cj, f32
      xv = plgpu.load(self.x_smem.at[wg, cj], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      return (xv - mean if plan.layer else xv) * rstd, acc[:, cj * epi_n:(cj + 1) * epi_n]

    s_g = s_gx = None
    for cj in range(plan.chunks[1]):  # elementwise first: one cross-lane sum per row sum
      x_hat, g = chunk(cj)
      s_gx = g * x_hat if s_gx is None else s_gx + g * x_hat
      s_g = g if s_g is None else s_g + g
      if plan.dw:
        self.dw_smem["x_hat"].at[cj, pl.ds(wg * plan.cfg.wg_tile_m, plan.cfg.wg_tile_m)][
            ...] = x_hat.astype(plan.dtype)
    if plan.dw:
      self._issue_dw()
    partials = (jnp.sum(s_gx, axis=1),) + ((jnp.sum(s_g, axis=1),) if plan.layer else ())
    sums = cluster_exchange.cluster_row_sums(plan.exchange_spec, partials, self.ex, wg,
                                             tile.index, _sum_in_cta_order)
    gx_mean = bcast(sums[0] * (1.0 / plan.k))
    g_mean = bcast(sums[1] * (1.0 / plan.k)) if plan.layer else None
    for cj in range(plan.chunks[1]):
      x_hat, g = chunk(cj)
      d = g - x_hat * gx_mean
      self._store(tile, 0, cj, (d - g_mean if plan.layer else d) * rstd, x_hat)
    if plan.dw:
      plgpu.wgmma_wait(0)
      # The next block's prefetch waits for this (none after the CTA's last block).
      pl.when(jnp.logical_not(tile.last))(
          lambda: plgpu.barrier_arrive(self.dw_smem["free"]))

  def _issue_dw(self):
    """dW_γ[64w : 64w + 64] += x̂[:, 64w : 64w + 64]ᵀ dy over the row block, once both consumers
    wrote their rows of x̂ (and had their rows of dy land): consumer w reads x̂'s column block w
    transposed (WGMMA takes 16-bit A transposed) and the whole dy tile; the WGMMA runs while
    this consumer computes and stores dx (the epilogue waits for it at its end)."""
    plgpu.commit_smem()  # x̂'s stores, visible to the other consumer's WGMMA (async proxy)
    plgpu.barrier_arrive(self.dw_smem["ready"])
    plgpu.barrier_wait(self.dw_smem["ready"])
    plgpu.wgmma(self.dw_acc, self.dw_smem["x_hat"].at[self.wg].transpose((1, 0)),
                self.dw_smem["dy"])

  def consumer_scope(self, consume_all):
    if not self.plan.dw:
      consume_all()
      return

    @functools.partial(pl.run_scoped,
                       acc=plgpu.ACC((self.plan.cfg.wg_tile_m, self.plan.n), jnp.float32))
    def _dw_scope(acc):
      self.dw_acc = acc
      consume_all()
      self._store_dw(acc[...])

  def _store_dw(self, dw):
    """This consumer's rows of the CTA's dW_γ partial (64, N) f32, through its SMEM slot in
    :data:`DW_STORE_N`-column pieces (each waits for the previous piece's store to read the
    slot)."""
    cta = _cta_index(self.plan)
    slot, wg_m = self.dw_smem["out"].at[self.wg], self.plan.cfg.wg_tile_m
    for c in range(0, self.plan.n, DW_STORE_N):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      slot[...] = dw[:, c:c + DW_STORE_N]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(slot, self.dw_gmem.at[cta, pl.ds(self.wg * wg_m, wg_m),
                                                    pl.ds(c, DW_STORE_N)])

  def finish(self):
    if self.plan.row_sums:
      cluster_exchange.final_sync(self.plan.exchange_spec, self.ex, self.wg)
    if self.plan.col_sums:
      pl.when(self.wg < 2)(self._store_column_sums)

  def _store_column_sums(self):
    """This consumer's column-sum rows to its CTA's slot of the partials (after the
    schedule: the last add's stores fenced for the TMA)."""
    plgpu.commit_smem()
    cta = _cta_index(self.plan)
    plgpu.copy_smem_to_gmem(self.col_sum_smem.at[self.wg], self.col_sum_gmem.at[cta, self.wg])


def _cta_index(plan: _Plan):
  """This CTA's index in the grid of clusters (the row of its per-CTA partial outputs)."""
  return lax.axis_index("cluster_grid") * plan.cluster + lax.axis_index("cluster")


def _sum_in_cta_order(per_cta) -> tuple:
  """The CTAs' partial row sums added in CTA order (the same bits in every CTA)."""
  out = list(per_cta[0])
  for part in per_cta[1:]:
    out = [a + b for a, b in zip(out, part)]
  return tuple(out)


def _row_block_schedule(m_iters: int, cta) -> gemm_core.Schedule:
  """The row sums' schedule: each cluster walks row blocks, CTA ``cta`` of the cluster taking
  column tile ``cta`` of each (one tile per work unit)."""
  def schedule(visit, end_unit):
    del end_unit

    @plgpu.nd_loop((m_iters,), collective_axes="cluster_grid")
    def _row_block_loop(loop_info: plgpu.NDLoopInfo):
      (m_idx,) = loop_info.index
      i = loop_info.local_index
      visit(gemm_core.Tile(m_idx, cta, i, i == 0, i == loop_info.num_local_steps - 1))
  return schedule


def _kernel(*refs, plan: _Plan):
  it = iter(refs)
  dy_gmem, w_gmem, x_gmem = next(it), next(it), next(it)
  y_gmem = next(it) if plan.fused else None
  vec_gmem = next(it) if plan.n_vecs else None  # fused: [col_sum; out_bias] (n_vecs, N) f32
  row_gmems = [next(it) for _ in range(plan.n_rows)]  # rstd first, padded to whole row tiles
  dx_gmem = next(it)
  x_hat_gmem = next(it) if plan.x_hat else None
  col_sum_gmem = next(it) if plan.col_sums else None  # (CTAs, 2, col_sum_rows, tile_k) f32
  dw_gmem = next(it) if plan.dw else None  # (CTAs, K, N) f32: each CTA's Σ x̂ᵀ dy
  cfg = plan.cfg
  # The streams' GMEM operands beyond dy and w: all of y's columns, all of the vectors'.
  gmems = [r for r in (dy_gmem, w_gmem, y_gmem, vec_gmem) if r is not None]
  block = lambda t: pl.ds(t.m_idx * cfg.tile_m, cfg.tile_m)
  schedule = (_row_block_schedule(plan.m_iters, lax.axis_index("cluster")) if plan.row_sums
              else gemm_core.tile_grid(plan.m_iters, plan.k_iters))
  gemm_core.run(
      plan.kloop, gmems=gmems,
      windows=lambda t: [block(t), pl.ds(t.n_idx * cfg.tile_n, cfg.tile_n), block(t), None][
          :len(gmems)],
      schedule=schedule,
      smem=_smem(cfg, plan.dtype, plan.n_rows, plan.x_hat_slots,
                 cluster_exchange.allocs(plan.exchange_spec), plan.col_sum_rows, plan.dw_n),
      hooks_for=lambda wg, refs: _DxHooks(plan, wg, refs, x_gmem, row_gmems, dx_gmem,
                                          x_hat_gmem, col_sum_gmem, dy_gmem, dw_gmem))


def _check_vector(name, v, size) -> None:
  """ValueError unless ``v`` (when given) is float32 of shape (size,); TypeError for a non-array."""
  if v is None:
    return
  if not (hasattr(v, "shape") and hasattr(v, "dtype")):
    raise TypeError(f"{name} must be an array, got {type(v).__name__}")
  if v.shape != (size,) or v.dtype != jnp.float32:
    raise ValueError(f"{name} must be float32 of shape ({size},), got {v.dtype}{v.shape}")


def _check_row_terms(dy, y_term, mean, c_term, y, out_bias, col_sum, row_sums=False) -> None:
  """The three ways to give the row scalars: y_term (+ mean, c_term), y (+ out_bias, mean,
  col_sum) for the fused row terms, or none of them with the row sums in the epilogue; never a
  mix."""
  if row_sums:
    for name, v in (("y_term", y_term), ("c_term", c_term), ("y", y), ("out_bias", out_bias),
                    ("col_sum", col_sum)):
      if v is not None:
        raise ValueError(f"{name} must be None with row_sums_in_epilogue=True: the epilogue "
                         "sums the rows of dy @ w_gammaᵀ itself")
    return
  if y is None:
    for name, v in (("out_bias", out_bias), ("col_sum", col_sum)):
      if v is not None:
        raise ValueError(f"{name} is an input of the fused row terms: pass it together with y "
                         "(and without y_term, c_term)")
    if y_term is None:
      raise ValueError("y_term is required unless y is given (the kernel then computes y_term "
                       "and c_term itself)")
    if (mean is None) != (c_term is None):
      raise ValueError("mean and c_term are both given (LayerNorm) or both None (RMSNorm)")
    return
  for name, v in (("y_term", y_term), ("c_term", c_term)):
    if v is not None:
      raise ValueError(f"{name} must be None when y is given: the kernel computes it from y")
  if not (hasattr(y, "shape") and hasattr(y, "dtype")):
    raise TypeError(f"y must be an array, got {type(y).__name__}")
  if y.shape != dy.shape:
    raise ValueError(f"y must have dy's shape (M, N) = {dy.shape}, got {y.shape}")
  if y.dtype != dy.dtype:
    raise TypeError(f"y must have dy's dtype {dy.dtype}, got {y.dtype}")
  if (mean is None) != (col_sum is None):
    raise ValueError("with y, mean and col_sum are both given (LayerNorm) or both None "
                     "(RMSNorm)")


def _check_args(dy, w_gamma, x, rstd, y_term, mean, c_term, y=None, out_bias=None,
                col_sum=None, row_sums=False, interpret=False):
  if dy.ndim != 2 or w_gamma.ndim != 2 or x.ndim != 2:
    raise ValueError(f"dy (M, N), w_gamma (K, N) and x (M, K) must be 2-D, got {dy.shape}, "
                     f"{w_gamma.shape}, {x.shape}")
  m, n = dy.shape
  k = w_gamma.shape[0]
  if w_gamma.shape[1] != n or x.shape != (m, k):
    raise ValueError(f"expected dy (M, N), w_gamma (K, N), x (M, K); got {dy.shape}, "
                     f"{w_gamma.shape}, {x.shape}")
  if not dy.dtype == w_gamma.dtype == x.dtype:
    raise TypeError(f"dy, w_gamma and x must share a dtype, got {dy.dtype}, {w_gamma.dtype}, "
                    f"{x.dtype}")
  reason = (row_sums_unsupported_reason(m, n, k, x.dtype, interpret) if row_sums
            else unsupported_reason(m, n, k, x.dtype))
  if reason is not None:
    raise ValueError(f"norm_matmul dx kernel cannot run this call: {reason}")
  if rstd is None:
    raise ValueError("rstd is required (the forward's saved rstd, float32 (M,))")
  _check_row_terms(dy, y_term, mean, c_term, y, out_bias, col_sum, row_sums)
  for name, v in (("rstd", rstd), ("y_term", y_term), ("mean", mean), ("c_term", c_term)):
    _check_vector(name, v, m)
  for name, v in (("out_bias", out_bias), ("col_sum", col_sum)):
    _check_vector(name, v, n)


def norm_matmul_dx(dy, w_gamma, x, rstd, y_term=None, mean=None, c_term=None, *, y=None,
                   out_bias=None, col_sum=None, return_x_hat: bool = False,
                   x_hat_ones: bool = False, row_sums_in_epilogue: bool = False,
                   return_dy_col_sums: bool = False, return_dw_gamma: bool = False,
                   interpret: bool = False, config: TileConfig | None = None):
  """dx of the lazy pre-norm GEMM: ``rstd ⊙ (dy @ w_gammaᵀ) − y_term ⊙ (x − mean) − c_term``.

  With ``row_sums_in_epilogue`` the kernel needs no row scalars: with G = dy @ w_gammaᵀ and
  x̂ = (x − mean) ⊙ rstd, ``dx = rstd ⊙ (G − mean_K(G) − x̂ ⊙ mean_K(G ⊙ x̂))`` (RMSNorm:
  without mean_K(G)), the same value (``y_term = rstd · mean_K(G ⊙ x̂)``, ``c_term = rstd ·
  mean_K(G)``), its two row sums over K taken in the epilogue from the accumulator and the x
  tile, across the CTAs of a cluster that share the rows (K = cluster × tile_n, the post-norm
  forward's split and exchange); nothing reads y, so nothing cancels however large the norm
  bias's part of y.

  The row scalars come either precomputed (``y_term``, ``c_term``) or, with ``y`` given, from
  the kernel's own K loop (fused row terms: ``norm_matmul``'s default for LayerNorm up to K, N ≤
  512; faster than the XLA pass plus this kernel at 262144×512², slower at 65536×2048² on the
  H200; see the module docstring)::

    y_term = rstd² · rowsum(dy ⊙ (y − out_bias)) / K,   c_term = rstd · (dy · col_sum) / K

  accumulated in float32 from the 16-bit dy and y, as the XLA pass of ``norm_matmul``'s
  backward does (same elementwise math; the summation order differs).

  Args:
    dy: (M, N) output cotangent, in x's dtype (bfloat16/float16).
    w_gamma: (K, N) the forward's folded weight ``diag(scale) w``, x's dtype.
    x: (M, K) the forward's input.
    rstd: (M,) float32, the forward's saved rstd.
    y_term: (M,) float32, ``rstd² · rowsum(dy ⊙ (y − out_bias)) / K``; None when y is given.
    mean: (M,) float32 saved mean (LayerNorm) or None (RMSNorm: x is not centered).
    c_term: (M,) float32 ``rstd · (dy · col_sum) / K`` (LayerNorm) or None; None when y is
      given.
    y: (M, N) the forward's output in dy's dtype, or None. Given: the kernel computes y_term
      (and c_term) itself; then y_term and c_term must be None.
    out_bias: (N,) float32 ``norm_biasᵀ w`` that the forward added to y, or None (no bias);
      only with y.
    col_sum: (N,) float32 ``1ᵀ w_gamma`` (LayerNorm: given exactly when mean is); only with y.
    return_x_hat: also return the normalized input ``x̂ = (x − mean) ⊙ rstd`` (RMSNorm:
      ``x ⊙ rstd``), written by the same epilogue from the x tile it already holds, so the
      weight gradients become the plain GEMM ``dW_γ = x̂ᵀ dy`` (DESIGN.md, op 1) with no pass
      of their own over dy.
    row_sums_in_epilogue: the row sums in the epilogue (above); then y_term, c_term, y,
      out_bias and col_sum must be None (mean is still given for LayerNorm). Needs K split
      into one column tile per CTA of a cluster of 1, 2, 4 or 8 (K ≤ 2048; K ≤ 256 in
      interpret mode): :func:`row_sums_unsupported_reason`.
    x_hat_ones: with ``return_x_hat``, x̂ gets one more block of columns, all ones (one
      epilogue tile wide), after K padded to whole column tiles (columns past K up to there
      hold the normalized zero padding, finite): then the last row of ``x̂ᵀ dy`` is
      ``Σ_i dy_i`` (the column sums a norm bias's gradient needs), from the same GEMM.
    return_dy_col_sums: also return ``Σ_i dy_i`` (N,) float32, summed by the kernel from the
      dy stages it streams anyway (each CTA sums its share of the steps over its row blocks;
      XLA adds the CTAs' partials in a fixed order): the column sums without x̂'s ones block,
      which makes the weight gradients' GEMM leave its best tiles. Needs
      ``row_sums_in_epilogue`` and :func:`dy_col_sums_unsupported_reason` None.
    return_dw_gamma: also return the weight gradients' product ``dW_γ = x̂ᵀ dy`` (K, N)
      float32, summed by the kernel: each CTA accumulates x̂ᵀ dy of its row blocks in
      registers (x̂ rounded to x's dtype, as the x̂ output is; products summed in float32)
      and stores it once; XLA adds the CTAs' partials. x̂ then never goes to GMEM and dy is
      not read again by a GEMM of its own. Needs ``row_sums_in_epilogue``, no
      ``return_x_hat`` and :func:`dw_gamma_unsupported_reason` None (K = 128, N ≤ 128).
    interpret: run in GPU interpret mode (race detection, NaN-filled uninitialized memory).
    config: tiling (:func:`pick_config` by default, with ``fused_row_terms`` when y is given);
      tile_n runs over K, tile_k over N.

  Returns:
    dx (M, K) in x's dtype; the products and sums run in float32. With ``return_x_hat``,
    ``(dx, x̂)``, x̂ (M, K) in x's dtype (rounded once from float32); with ``x_hat_ones`` too,
    x̂ (M, K') whose first K columns are x̂ and last column is ones. With
    ``return_dy_col_sums``, Σ_i dy_i (N,) float32 follows; with ``return_dw_gamma``, dW_γ
    (K, N) float32 is the last output.

  Raises:
    ValueError: shapes the kernel does not support; rstd missing; a mix of the row-term
      inputs (y_term/c_term with y, out_bias/col_sum without y, any of them with
      row_sums_in_epilogue), y_term missing without y or row_sums_in_epilogue,
      mean inconsistent with c_term (or, with y, with col_sum); return_dy_col_sums where the
      kernel cannot (:func:`dy_col_sums_unsupported_reason`); return_dw_gamma without
      row_sums_in_epilogue, with return_x_hat, or where the kernel cannot
      (:func:`dw_gamma_unsupported_reason`); row vectors not float32 (M,),
      out_bias/col_sum not float32 (N,), y not (M, N); a config that does not fit in SMEM.
      TypeError: mixed dtypes (dy, w_gamma, x; y not in dy's dtype), a vector or y that is not
      an array.
  """
  _validate.flag("row_sums_in_epilogue", row_sums_in_epilogue)
  row_sums = bool(row_sums_in_epilogue)
  _validate.flag("return_dw_gamma", return_dw_gamma)
  if return_dw_gamma and (not row_sums or return_x_hat):
    raise ValueError("return_dw_gamma needs row_sums_in_epilogue=True and return_x_hat=False "
                     "(the kernel sums x̂ᵀ dy instead of writing x̂)")
  _check_args(dy, w_gamma, x, rstd, y_term, mean, c_term, y, out_bias, col_sum, row_sums,
              interpret)
  _validate.flag("return_x_hat", return_x_hat)
  _validate.flag("x_hat_ones", x_hat_ones)
  if x_hat_ones and not return_x_hat:
    raise ValueError("x_hat_ones needs return_x_hat=True (it shapes the returned x̂)")
  _validate.flag("return_dy_col_sums", return_dy_col_sums)
  m, n = dy.shape
  if return_dy_col_sums and not row_sums:
    raise ValueError("return_dy_col_sums needs row_sums_in_epilogue=True (a CTA then keeps "
                     "its column tile, so it sums the same steps over its row blocks)")
  cfg = config or pick_config(m, n, w_gamma.shape[0], fused_row_terms=y is not None,
                              x_hat=bool(return_x_hat), row_sums=row_sums, interpret=interpret)
  if return_dy_col_sums and (reason := dy_col_sums_unsupported_reason(
      m, n, w_gamma.shape[0], x.dtype, cfg, layer=mean is not None, x_hat=bool(return_x_hat),
      interpret=interpret)) is not None:
    raise ValueError(f"return_dy_col_sums: {reason}")
  if return_dw_gamma and (reason := dw_gamma_unsupported_reason(
      m, n, w_gamma.shape[0], x.dtype, cfg, layer=mean is not None,
      interpret=interpret)) is not None:
    raise ValueError(f"return_dw_gamma: {reason}")
  return launch(dy, w_gamma, x, rstd, y_term=y_term, mean=mean, c_term=c_term, y=y,
                out_bias=out_bias, col_sum=col_sum, x_hat=bool(return_x_hat),
                x_hat_ones=bool(x_hat_ones), row_sums=row_sums, interpret=interpret, config=cfg,
                dy_col_sums=bool(return_dy_col_sums), dw_gamma=bool(return_dw_gamma))


def launch(dy, w_gamma, x, rstd, *, y_term=None, mean=None, c_term=None, y=None, out_bias=None,
           col_sum=None, x_hat: bool, x_hat_ones: bool, row_sums: bool, interpret: bool,
           config: TileConfig, dy_col_sums: bool = False, dw_gamma: bool = False):
  """:func:`norm_matmul_dx` on arguments its caller validated, with the ``config`` it picked
  (:func:`pick_config` for the route it chose: ``row_sums``, the fused row terms (``y`` given)
  or given row terms; ``x_hat`` is ``return_x_hat``, ``dy_col_sums`` is
  ``return_dy_col_sums``): ``norm_matmul``'s backward decides the route and the tiling once,
  then calls this. Same outputs; ValueError only from the plan (a config that does not fit,
  N not a multiple of its tile_k, column sums where :func:`dy_col_sums_unsupported_reason`
  says why not)."""
  cfg = config
  m, n = dy.shape
  k = w_gamma.shape[0]
  fused = y is not None
  if n % cfg.tile_k:
    raise ValueError(f"N = {n} is not a multiple of tile_k = {cfg.tile_k}")
  plan = _pick_exchange(functools.partial(
      _make_plan, m, n, k, x.dtype, mean is not None, cfg, interpret, fused=fused,
      has_bias=out_bias is not None, x_hat=x_hat, x_hat_ones=x_hat_ones, row_sums=row_sums,
      col_sums=dy_col_sums, dw=dw_gamma))
  # Row vectors padded to whole row tiles: their 1-D copies never leave the arrays.
  m_pad = plan.m_iters * cfg.tile_m
  rows = [v for v in (rstd, y_term, mean, c_term) if v is not None]
  rows = [jnp.pad(v, (0, m_pad - m)) for v in rows]
  # Fused: y, then the column vectors packed into one array (one TMA per step for both).
  fused_args = [y] if fused else []
  if plan.n_vecs:
    fused_args.append(jnp.stack([v for v in (col_sum, out_bias) if v is not None]))
  out_types = [jax.ShapeDtypeStruct((m, k), plan.dtype)]
  if x_hat:
    out_types.append(jax.ShapeDtypeStruct((m, plan.x_hat_width), plan.dtype))
  if plan.col_sums:
    out_types.append(jax.ShapeDtypeStruct(
        (plan.num_ctas * plan.cluster, 2, plan.col_sum_rows, cfg.tile_k), jnp.float32))
  if plan.dw:
    out_types.append(jax.ShapeDtypeStruct((plan.num_ctas * plan.cluster, k, n), jnp.float32))
  call = gemm_core.kernel(functools.partial(_kernel, plan=plan),
                          tuple(out_types) if len(out_types) > 1 else out_types[0],
                          num_ctas=plan.num_ctas, interpret=interpret,
                          cluster=plan.cluster if row_sums else None)
  out = call(dy, w_gamma, x, *fused_args, *rows)
  if not (plan.col_sums or plan.dw):
    return out
  out = list(out)
  if plan.dw:  # the CTAs' partials, added by one XLA reduction (the same order every call)
    out[-1] = out[-1].sum(axis=0)
  if plan.col_sums:
    i = len(out) - 1 - int(plan.dw)
    out[i] = _column_sums_from_partials(plan, out[i])
  return tuple(out)


def _column_sums_from_partials(plan: _Plan, partials):
  """Σ_i dy_i (N,) f32 from the CTAs' partials (CTAs, 2, rows, tile_k): CTA c of a cluster
  holds steps s = c + cluster · j, consumer j % 2 at row j // 2. The clusters' partials are
  added in CTA order (deterministic), then laid out by step."""
  per_cta = partials.reshape(plan.num_ctas, plan.cluster, *partials.shape[1:]).sum(axis=0)
  by_step = per_cta.transpose(2, 1, 0, 3)  # [j // 2, j % 2, c]: step (c + cluster · j)
  return by_step.reshape(-1)[:plan.n]

