"""dx of the lazy pre-norm GEMM as one Pallas Mosaic-GPU kernel for Hopper (sm_90a).

The backward of ``y = norm(x) @ w_gamma (+ out_bias)`` (DESIGN.md, op 1) needs no reduction over
a full row of K: with ``G = dy @ w_gammaᵀ`` (M, K) and two per-row scalars that XLA computes in
one pass over dy and y,

    c_term_i = rstd_i · (dy_i · col_sum) / K               (LayerNorm only)
    y_term_i = rstd_i² · rowsum(dy_i ⊙ (y_i − out_bias)) / K

the input gradient is the GEMM ``G`` with a per-row epilogue::

    rms:   dx = rstd ⊙ G − y_term ⊙ x
    layer: dx = rstd ⊙ G − y_term ⊙ (x − mean) − c_term

This module computes exactly that in one kernel: dy (M, N) is the A operand, w_gamma (K, N) is
read untransposed from GMEM and handed to WGMMA as a transposed SMEM view (the B operand
``w_gammaᵀ`` (N, K); WGMMA transposes 16-bit B tiles for free), and the epilogue reads the x tile
(TMA-prefetched into SMEM during the K loop) and the row vectors, then writes dx in x's dtype.

With ``TileConfig.pingpong`` (:func:`pingpong_config`; opt-in, not yet timed) the consumers
take alternate (one warpgroup's rows, column tile) units instead, each with its own K-loop ring
(:class:`pallas_norm.mgpu_common.PingPongRing`), so one's epilogue overlaps the other's WGMMAs.

Kernel structure: the forward's (:mod:`pallas_norm.ops.norm_matmul_mgpu`), i.e. JAX's
``hopper_matmul_mgpu.py``: a persistent grid walks the (M, K) output tiles; a TMA producer
warpgroup streams (tile_m, tile_k) tiles of dy and (tile_n, tile_k) tiles of w_gamma (the
reduction runs over N in steps of tile_k) to two WGMMA consumer warpgroups that split the tile
along M. Each consumer owns an SMEM buffer of its (tile_m/2, tile_n) slice of x, cut into
epilogue tiles: the x tile of the *next* output tile is fetched at K step ``x_prefetch_step``
(after the previous epilogue's TMA stores have read the buffer), the epilogue overwrites each x
epilogue tile in place with dx and stores it with TMA. The epilogue never waits for a store;
every epilogue tile has its own SMEM slot.

Shapes: the forward's (any M ≥ 1; N and K multiples of 64; bfloat16 or float16). The x and dx
tiles go through untiled swizzled SMEM (plain 2-D TMA boxes: rows past M read as zeros and are
never written). For M % 8 != 0 on the GPU the dy stages are untiled too and WGMMA takes A from
registers (``TileConfig.a_operand``), as in the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm import mgpu_common
from pallas_norm.mgpu_common import TileConfig
from pallas_norm.ops import norm_matmul_mgpu

__all__ = ["pick_config", "unsupported_reason", "norm_matmul_dx"]

_SMEM_SLACK = 4096  # barriers + the scratch Mosaic reserves


def unsupported_reason(m: int, n: int, k: int, dtype) -> str | None:
  """None if the kernel can compute dx for dy: (m, n), w_gamma: (k, n), else why not.

  The same shapes as the forward kernel (N and K multiples of 64, bfloat16/float16).
  """
  return norm_matmul_mgpu.unsupported_reason(m, k, n, dtype)


def pick_config(m: int, n: int, k: int) -> TileConfig:
  """Tiling for dx (m, k) = dy (m, n) @ w_gammaᵀ: the forward's tile shape for the output width
  K in place of N (tile_n over K, tile_k over the reduction N), without its forward-only options.
  """
  fwd = norm_matmul_mgpu.pick_config(m, n, k)
  return TileConfig(tile_m=fwd.tile_m, tile_n=fwd.tile_n, tile_k=fwd.tile_k,
                    max_concurrent_steps=fwd.max_concurrent_steps, epi_tile_m=fwd.epi_tile_m,
                    epi_tile_n=fwd.epi_tile_n)


def pingpong_config(m: int, n: int, k: int) -> TileConfig:
  """:func:`pick_config` with ping-pong consumers (``TileConfig.pingpong``; opt-in, not yet
  timed on a GPU) and 32-wide reduction steps, so each consumer's ring gets several stages."""
  base = pick_config(m, n, k)
  return dataclasses.replace(base, pingpong=True, tile_k=32 if n % 32 == 0 else base.tile_k)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one kernel instance (reduction over n, output (m, k))."""
  m: int
  n: int
  k: int
  dtype: jnp.dtype
  layer: bool
  cfg: TileConfig
  stages: int
  chained: bool  # a CTA's tiles run as one K-loop pipeline (TileConfig.pipeline_across_tiles)
  num_clusters: int  # persistent clusters of cfg.cluster_m CTAs
  a_in_registers: bool
  epi_n: int
  x_prefetch_step: int

  @property
  def delay_release(self) -> int:  # WGMMA groups left in flight across K steps (TileConfig)
    return mgpu_common.plan_delay_release(self.cfg, self.stages)

  @property
  def n_rows(self) -> int:  # row vectors: rstd, y_term (+ mean, c_term)
    return 4 if self.layer else 2

  @property
  def m_iters(self) -> int:  # row blocks: of tile_m rows, or of one warpgroup's with pingpong
    return -(-self.m // (self.cfg.wg_tile_m if self.cfg.pingpong else self.cfg.tile_m))

  @property
  def m_units(self) -> int:  # row-block groups, one per cluster
    return -(-self.m_iters // self.cfg.cluster_m)

  @property
  def k_iters(self) -> int:  # output column tiles
    return -(-self.k // self.cfg.tile_n)

  @property
  def red_iters(self) -> int:  # pipeline steps over the reduction dim N
    return self.n // self.cfg.tile_k

  @property
  def chunks(self) -> tuple[int, int]:  # epilogue tiles per warpgroup (along M, along K)
    return self.cfg.wg_tile_m // self.cfg.epi_tile_m, self.cfg.tile_n // self.epi_n


def _fixed_smem_bytes(cfg: TileConfig, dtype, n_rows: int) -> int:
  x_tile = cfg.tile_m * cfg.tile_n * jnp.dtype(dtype).itemsize  # both warpgroups' x/dx slices
  rows = 2 * n_rows * cfg.wg_tile_m * 4
  return x_tile + rows + _SMEM_SLACK


def _make_plan(m, n, k, dtype, layer, cfg, interpret, x_prefetch_step) -> _Plan:
  itemsize = jnp.dtype(dtype).itemsize
  n_rows = 4 if layer else 2
  if cfg.stats_once:
    raise ValueError("stats_once is a forward option: the dx kernel has no statistics")
  mgpu_common.reject_unused_options(cfg, "dx", ("stats", "epi_slots"))
  if cfg.pingpong:
    norm_matmul_mgpu._check_pingpong(cfg, m, interpret)  # pylint: disable=protected-access
    stage_bytes = mgpu_common.pingpong_stage_bytes(cfg.wg_tile_m, cfg.tile_k, cfg.tile_n, dtype)
  else:
    stage_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * itemsize
  free = mgpu_common.SMEM_BYTES - _fixed_smem_bytes(cfg, dtype, n_rows)
  if min(cfg.max_concurrent_steps, free // stage_bytes) < 1:
    raise ValueError(f"{cfg} does not fit in {mgpu_common.SMEM_BYTES} bytes of SMEM next to the "
                     f"x tile of the epilogue")
  stages, chained = mgpu_common.stages_for(
      cfg, n // cfg.tile_k, min(cfg.max_concurrent_steps, free // stage_bytes))
  block_rows = cfg.wg_tile_m if cfg.pingpong else cfg.tile_m
  units = -(-(-(-m // block_rows)) // cfg.cluster_m) * -(-k // cfg.tile_n)
  num_clusters = mgpu_common.persistent_clusters(cfg, cfg.cluster_m, units, interpret)
  if cfg.a_operand == "auto":
    a_in_registers = not interpret and m % 8 != 0
  else:
    a_in_registers = cfg.a_operand == "registers"
  if a_in_registers and interpret:
    raise NotImplementedError("a_operand='registers' does not run in GPU interpret mode (jax "
                              "0.11.2 interprets WGMMA with both operands in SMEM only)")
  epi_n = norm_matmul_mgpu._epi_tile_n(cfg, dtype)  # pylint: disable=protected-access
  red_iters = n // cfg.tile_k
  return _Plan(m=m, n=n, k=k, dtype=jnp.dtype(dtype), layer=layer, cfg=cfg,
               stages=stages, chained=chained, num_clusters=num_clusters,
               a_in_registers=a_in_registers,
               epi_n=epi_n, x_prefetch_step=min(max(x_prefetch_step, 0), red_iters - 1))


def _kernel(dy_gmem, w_gmem, x_gmem, *refs, plan: _Plan):
  *row_gmems, dx_gmem = refs
  cfg = plan.cfg
  wg_m, tile_n, tile_k = cfg.wg_tile_m, cfg.tile_n, cfg.tile_k
  epi_m, epi_n = cfg.epi_tile_m, plan.epi_n
  chunks_m, chunks_n = plan.chunks
  dy_transforms = mgpu_common.swizzle_transforms(tile_k, plan.dtype,
                                                 tiled=not plan.a_in_registers)
  w_transforms = mgpu_common.swizzle_transforms(tile_k, plan.dtype)
  x_transforms = mgpu_common.swizzle_transforms(epi_n, plan.dtype, tiled=False)

  def make_pipeline(body, compute_context, state=None):
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
    # The CTAs of a cluster share the column tile: each w tile reaches all by one multicast.
    w_axes = ("cluster",) if cfg.cluster_m > 1 else ()
    return mgpu_common.consumer_pipeline(
        body, compute_context, steps=plan.red_iters, stages=plan.stages, pipeline_state=state,
        delay_release=plan.delay_release,
        in_specs=[spec((cfg.tile_m, tile_k), lambda kk: (0, kk), transforms=dy_transforms),
                  spec((tile_n, tile_k), lambda kk: (0, kk), transforms=w_transforms,
                       collective_axes=w_axes)])

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=(
          mgpu_common.pingpong_ring_allocs(wg_m, tile_k, tile_n, plan.dtype, plan.stages,
                                           w_transposed=True)
          if cfg.pingpong else make_pipeline(ignore, ignore).get_allocations(dy_gmem, w_gmem)),
      x_smem=plgpu.SMEM((2, chunks_m * chunks_n, epi_m, epi_n), plan.dtype,
                        transforms=x_transforms),
      row_smem=plgpu.SMEM((2, plan.n_rows, wg_m), jnp.float32),
      # One arrival per TMA copy: the x epilogue tiles and the row vectors of a warpgroup.
      in_barrier=plgpu.Barrier(num_arrivals=chunks_m * chunks_n + plan.n_rows, num_barriers=2),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, x_smem, row_smem, in_barrier):
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cluster") if cfg.cluster_m > 1 else 0

    def unit_tile(lin_idx):  # (row-block unit, output column tile) of a linear unit index
      return plgpu.planar_snake(
          lin_idx, (plan.m_units, plan.k_iters), 0 if cfg.grid_minor_dim == "n" else 1,
          cfg.grid_tile_width)

    def tile(m_idx, n_idx, first, last, pingpong_step=None):
      """One output tile: this warpgroup's rows of row block m_idx (with pingpong: the
      warpgroup's own block of wg_m rows, K loop on its ring from ``pingpong_step``)."""
      if cfg.pingpong:
        row0 = m_idx * wg_m
      else:
        row0 = m_idx * cfg.tile_m + wg * wg_m  # first row of this warpgroup
      col0 = n_idx * tile_n  # first column of x / dx

      def chunk_window(ref, ci, cj):
        return ref.at[pl.ds(row0 + ci * epi_m, epi_m), pl.ds(col0 + cj * epi_n, epi_n)]

      def prefetch_epilogue_inputs():
        # The previous tile's dx stores read x_smem: they must be done before it is refilled.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for ci in range(chunks_m):
          for cj in range(chunks_n):
            plgpu.copy_gmem_to_smem(chunk_window(x_gmem, ci, cj),
                                    x_smem.at[wg, ci * chunks_n + cj], in_barrier.at[wg])
        for i, r_gmem in enumerate(row_gmems):
          plgpu.copy_gmem_to_smem(r_gmem.at[pl.ds(row0, wg_m)], row_smem.at[wg, i],
                                  in_barrier.at[wg])

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          acc_ref = eval_pipeline(acc_ref)
          if plan.delay_release:
            plgpu.wgmma_wait(0)  # the last step's WGMMA is still in flight
          _epilogue(acc_ref[...])

      def _epilogue(acc):
        plgpu.barrier_wait(in_barrier.at[wg])
        rows = [plgpu.load(row_smem.at[wg, i], layout=plgpu.Layout.WGMMA.reduce(1))
                for i in range(plan.n_rows)]
        bcast = lambda v: lax.broadcast_in_dim(v, acc.shape, [0])
        rstd, y_term = bcast(rows[0]), bcast(rows[1])
        if plan.layer:
          mean, c_term = bcast(rows[2]), bcast(rows[3])
        for ci in range(chunks_m):
          for cj in range(chunks_n):
            ms, ns = slice(ci * epi_m, (ci + 1) * epi_m), slice(cj * epi_n, (cj + 1) * epi_n)
            slot = x_smem.at[wg, ci * chunks_n + cj]
            xv = plgpu.load(slot, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            if plan.layer:
              xv = xv - mean[ms, ns]
            dx = acc[ms, ns] * rstd[ms, ns] - y_term[ms, ns] * xv
            if plan.layer:
              dx = dx - c_term[ms, ns]
            slot[...] = dx.astype(plan.dtype)  # in place: each thread rewrites what it read
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slot, chunk_window(dx_gmem, ci, cj))

      def mma_body(idxs, a_smem, b_smem, acc_ref):
        (k_idx,) = idxs
        pl.when(k_idx == plan.x_prefetch_step)(prefetch_epilogue_inputs)
        a_rows = a_smem if cfg.pingpong else a_smem.at[pl.ds(wg * wg_m, wg_m)]
        b = b_smem.transpose((1, 0))  # (tile_k, tile_n) view of the (tile_n, tile_k) w tile
        if plan.a_in_registers:
          plgpu.wgmma(acc_ref, plgpu.load(a_rows, layout=plgpu.Layout.WGMMA), b)
          if cfg.fence_reads:  # generic-proxy reads, then the TMA refill of the stage
            plgpu.commit_smem()
        else:
          plgpu.wgmma(acc_ref, a_rows, b)
        plgpu.wgmma_wait(plan.delay_release)
        return acc_ref

      if cfg.pingpong:
        compute_context(lambda acc: mgpu_common.pingpong_k_loop(
            ring, wg, pingpong_step, plan.red_iters, acc, mma_body))
        return
      mgpu_common.run_tile_pipeline(
          functools.partial(make_pipeline, mma_body, compute_context),
          dy_gmem.at[pl.ds(m_idx * cfg.tile_m, cfg.tile_m), :],
          w_gmem.at[pl.ds(col0, tile_n), :],
          allocations=pipeline_allocs, stages=plan.stages, chained=plan.chained,
          first=first, last=last)

    units = plan.m_units * plan.k_iters
    if cfg.pingpong:
      ring = mgpu_common.PingPongRing(**pipeline_allocs, stages=plan.stages)

      def windows(index, k):
        m_idx, n_idx = unit_tile(index[0])
        ks = pl.ds(k * tile_k, tile_k)
        return (dy_gmem.at[pl.ds(m_idx * wg_m, wg_m), ks],
                w_gmem.at[pl.ds(n_idx * tile_n, tile_n), ks])

      def unit(index, own_index):
        m_idx, n_idx = unit_tile(index[0])
        tile(m_idx, n_idx, None, None, pingpong_step=own_index * plan.red_iters)

      pl.when(wg == 2)(lambda: mgpu_common.pingpong_producer(
          ring, units, "sm", plan.red_iters, windows))
      pl.when(wg < 2)(lambda: mgpu_common.pingpong_consumer(units, "sm", unit))
    else:
      @plgpu.nd_loop((units,), collective_axes="sm")
      def _tile_loop(loop_info: plgpu.NDLoopInfo):
        m_unit, n_idx = unit_tile(loop_info.index[0])
        tile(m_unit * cfg.cluster_m + cta, n_idx, first=loop_info.local_index == 0,
             last=loop_info.local_index == loop_info.num_local_steps - 1)

  # All TMA stores must land before the kernel exits.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check_args(dy, w_gamma, x, rstd, y_term, mean, c_term):
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
  if (reason := unsupported_reason(m, n, k, x.dtype)) is not None:
    raise ValueError(f"norm_matmul dx kernel cannot run this call: {reason}")
  if (mean is None) != (c_term is None):
    raise ValueError("mean and c_term are both given (LayerNorm) or both None (RMSNorm)")
  for name, v in (("rstd", rstd), ("y_term", y_term), ("mean", mean), ("c_term", c_term)):
    if v is not None and (v.shape != (m,) or v.dtype != jnp.float32):
      raise ValueError(f"{name} must be float32 of shape ({m},), got {v.dtype}{v.shape}")


def norm_matmul_dx(dy, w_gamma, x, rstd, y_term, mean=None, c_term=None, *,
                   interpret: bool = False, config: TileConfig | None = None,
                   x_prefetch_step: int = 1):
  """dx of the lazy pre-norm GEMM: ``rstd ⊙ (dy @ w_gammaᵀ) − y_term ⊙ (x − mean) − c_term``.

  Args:
    dy: (M, N) output cotangent, in x's dtype (bfloat16/float16).
    w_gamma: (K, N) the forward's folded weight ``diag(scale) w``, x's dtype.
    x: (M, K) the forward's input.
    rstd: (M,) float32, the forward's saved rstd.
    y_term: (M,) float32, ``rstd² · rowsum(dy ⊙ (y − out_bias)) / K``.
    mean: (M,) float32 saved mean (LayerNorm) or None (RMSNorm: x is not centered).
    c_term: (M,) float32 ``rstd · (dy · col_sum) / K`` (LayerNorm) or None.
    interpret: run in GPU interpret mode (race detection, NaN-filled uninitialized memory).
    config: tiling (:func:`pick_config` by default); tile_n runs over K, tile_k over N.
    x_prefetch_step: the K step (over N) at which a consumer fetches the x tile and row vectors
      of its epilogue (clamped to the number of steps); later steps give the previous tile's
      dx stores more time to leave the shared buffer.

  Returns:
    dx (M, K) in x's dtype; the products and sums run in float32.

  Raises:
    ValueError: shapes the kernel does not support, inconsistent mean/c_term, row vectors not
      float32 (M,), a config that does not fit in SMEM. TypeError: mixed dtypes.
    NotImplementedError: ``config.a_operand="registers"`` with ``interpret``.
  """
  _check_args(dy, w_gamma, x, rstd, y_term, mean, c_term)
  m, n = dy.shape
  k = w_gamma.shape[0]
  cfg = config or pick_config(m, n, k)
  if n % cfg.tile_k:
    raise ValueError(f"N = {n} is not a multiple of tile_k = {cfg.tile_k}")
  plan = _make_plan(m, n, k, x.dtype, mean is not None, cfg, interpret, x_prefetch_step)
  # Row vectors padded to whole row tiles (of whole clusters): their 1-D copies never leave the
  # arrays.
  m_pad = plan.m_units * cfg.cluster_m * cfg.tile_m
  rows = [v for v in (rstd, y_term, mean, c_term) if v is not None]
  rows = [jnp.pad(v, (0, m_pad - m)) for v in rows]
  cluster = (dict(cluster=(cfg.cluster_m,), cluster_names=("cluster",))
             if cfg.cluster_m > 1 else {})
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=jax.ShapeDtypeStruct((m, k), plan.dtype),
      grid=(plan.num_clusters,),
      grid_names=("sm",),
      **cluster,
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=mgpu_common.interpret_params() if interpret else None,
  )
  return call(dy, w_gamma, x, *rows)
