"""Lazy pre-norm GEMM forward as a Pallas Mosaic-GPU kernel for Hopper (sm_90a).

Computes, for x (M, K) and a weight with the norm's affine already folded in
(``w_gamma = diag(scale) w``, ``col_sum = 1ᵀ w_gamma``, ``out_bias = biasᵀ w``)::

    rms:   y = rstd ⊙_rows (x @ w_gamma) + out_bias
    layer: y = rstd ⊙_rows (x @ w_gamma − mean ⊗ col_sum) + out_bias

without ever writing norm(x) (DESIGN.md, op 1). The row statistics come from the A tiles that
the K loop already holds in shared memory; the epilogue applies them to the f32 accumulator.

Kernel structure (after JAX's ``pallas/ops/gpu/hopper_matmul_mgpu.py``): a persistent grid of one
CTA per SM walks the (M, N) output tiles; in each CTA a TMA producer warpgroup streams
(tile_m, tile_k) tiles of x and (tile_k, tile_n) tiles of w through a multi-stage SMEM pipeline
(``plgpu.emit_pipeline_warp_specialized``, or the hand-written shared ring of
``TileConfig.pipeline="ring"``, the default where the statistics run in every K loop) to two
WGMMA consumer warpgroups. The consumers split
the CTA tile along M, so each row's statistics are accumulated by exactly one warpgroup: after
issuing the WGMMA of a step, a consumer loads its rows of the A tile from SMEM into registers (the
WGMMA register layout) and accumulates the statistics while the tensor core runs, then waits for
the WGMMA (``wgmma_wait(0)``: no WGMMA is left in flight across pipeline steps, unless
``TileConfig.delay_release`` = 1 leaves one). The epilogue
computes mean/rstd, applies them and the column vectors (col_sum, out_bias, fetched by TMA while
the K loop runs) and stores y through SMEM with TMA; the statistics of a row block are written by
the CTA that computes its first N tile.

Statistics: in the WGMMA layout each thread holds 2 adjacent columns of every 8, so the A tile,
cut into 8-column slices and summed, gives per-thread partial sums of shape (rows, 8) with no
cross-lane traffic in the K loop; lanes are reduced once per tile. LayerNorm keeps, for each of
those 8 "lane columns", sums of ``x − shift`` and ``(x − shift)²`` where ``shift`` is that lane
column's value in the first K tile, and merges the 8 (mean, M2) pairs with Chan's formula in the
epilogue.

Accuracy domain (LayerNorm): the statistics are shifted sums, so a large row mean does not
cancel in the variance (rstd and mean match the two-pass f32 reference to ~1e-7 at any mean).
The lazy form itself subtracts ``mean ⊗ col_sum`` from an f32 accumulator that holds
``x @ w_gamma``, so its error relative to the result grows linearly with ``|mean| / std``.
Measured in interpret mode (f32 accumulation and output, K = 256, rows ``mu + N(0, 1)``, see
``tests/test_norm_matmul_kernel.py::test_layer_accuracy_domain``): relative Frobenius error of y
vs the two-pass f32 reference ≈ 1.4e-7 · |mean|/std: 1.3e-5 at 1e2, 1.4e-4 at 1e3, so ~1e-3 at
7e3 and the bf16 output tolerance (1e-2) near 7e4. That is beyond what the inputs can carry:
bf16 data resolve |mean|/std up to ~2.6e2 (8-bit mantissa), f16 up to ~2e3; past that the
deviations from the mean round away and the data themselves (not the kernel) lose the variance.
On the GPU the WGMMA accumulation order differs; the GPU tests re-check 1e3 + N(0, 1) rows.

Shapes: any M ≥ 1 (the last row tile is partial: TMA zero-fills out-of-bounds reads and drops
out-of-bounds writes, so rows past M are never written), K and N multiples of 64, x and w_gamma
both bfloat16 or both float16. Mosaic's tiled TMA (the SMEM layout WGMMA reads) needs the row
count of the GMEM array to be a multiple of 8; for other M the x stages are written by a plain
2-D swizzled TMA and WGMMA takes its A operand from the registers the statistics load anyway,
and y always leaves through an untiled swizzled SMEM tile. The f32
statistics leave through 1-D bulk copies that Mosaic clamps to the end of the array, in sizes
that must be multiples of 16 bytes: for M % 4 != 0 they are written with up to 3 rows of padding
and sliced.

After the consumers read an x stage into registers (generic proxy), a proxy fence
(``plgpu.commit_smem``) precedes the release of the stage to the TMA producer (async proxy), as
the PTX memory model asks (the interpreter's race detector flags its absence).

``TileConfig.stats_once`` (:func:`pick_config` sets it for many row blocks and several N tiles):
the persistent loop hands out whole row blocks; a CTA sweeps the N tiles of its row block in
turn, accumulating the statistics only in the first K loop, which leaves them in SMEM for the
other N tiles' epilogues (their K loops are plain GEMMs). The statistics then cost once per row
instead of once per N tile; x's row block is re-read from L2 for every N tile (tile_m × K bytes
per CTA must stay resident).

:func:`gemm` runs the same kernel without statistics: our plain GEMM, the benchmarks' baseline.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm import mgpu
from pallas_norm.mgpu import TileConfig

__all__ = ["TileConfig", "unsupported_reason", "pick_config", "norm_matmul_fwd", "gemm", "launch",
           "NORMS"]

NORMS = ("rms", "layer")
"""``norm`` values: RMSNorm, LayerNorm."""

_SMEM_SLACK = 4096  # barriers + the reduction scratch Mosaic reserves (2 KiB by default).


def unsupported_reason(m: int, k: int, n: int, dtype) -> str | None:
  """None if the kernel can run x: (m, k) @ w: (k, n) in ``dtype``, else why not."""
  if jnp.dtype(dtype) not in mgpu.SUPPORTED_DTYPES:
    return f"x dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
  if m < 1:
    return f"M = {m} rows: need at least 1"
  if k % 64 or k < 64:
    return f"K = {k} is not a positive multiple of 64"
  if n % 64 or n < 64:
    return f"N = {n} is not a positive multiple of 64"
  return None


def _pick_tile_n(n: int) -> int:
  # Padded width of the last N tile, plus a fixed cost per tile worth ~32 columns.
  return min((256, 192, 128, 64), key=lambda t: (-(-n // t) * (t + 32), -t))


STATS_ONCE_MIN_ROW_BLOCKS = 8 * 132
"""Row blocks from which the heuristic computes the statistics once per row block: 8 waves of
132 SMs, so sweeping N inside a CTA leaves no SM idle for long."""
STATS_ONCE_MAX_X_BYTES = 40 << 20
"""Largest footprint of the x row blocks of 132 CTAs (bf16) with which the heuristic sweeps N
inside a CTA: they must stay in L2 (60 MB on the H200, 50 MB on the H100) while their N tiles
run."""


def pick_config(m: int, k: int, n: int) -> TileConfig:
  """Heuristic tiling for x (m, k) @ w (k, n).

  tile_n: the widest WGMMA N in {256, 192, 128, 64} that wastes the least padding on N (so
  N = 64/128/192 get one N tile). tile_m: 128 rows (64 per consumer warpgroup), 256 when the N
  tile is at most 128 wide (keeps the accumulator at 128 registers per thread). tile_k 64 (one
  128-byte swizzle row of bf16), as many pipeline stages as fit in SMEM (at most 4). When the
  statistics run in every K loop (not ``stats_once``) the stages come from the shared ring
  with one WGMMA in flight (``pipeline="ring"``, ``delay_release=1``), which lets the
  statistics overlap the tensor core. H200, session 8 (suite, ring vs Pallas's chained
  pipeline): RMSNorm 2994 vs 3185 µs at 262144×2048², 759 vs 801 at 65536×2048², 1528 vs
  1612 at 32768×4096²; LayerNorm from -1% (the check script's A/B) to +3% (the suite), noise
  level. With ``stats_once`` (and for the plain GEMM, :func:`gemm`) the two were within ±3%, so
  those keep Pallas's pipeline.
  ``stats_once`` when N has several tiles, M at least :data:`STATS_ONCE_MIN_ROW_BLOCKS` row
  blocks, and the row blocks in flight fit :data:`STATS_ONCE_MAX_X_BYTES`. Epilogue tiles 64×64, or 64×32 when that leaves room for a stage count that divides the K
  steps where 64×64 does not (chained pipelines need one: at 128×256 tiles and K = 512,
  64×64 slots leave 3 stages, which chain only as 2; 64×32 ones leave 4).
  """
  tile_n = _pick_tile_n(n)
  tile_m = 256 if tile_n <= 128 else 128
  # Several N tiles and many row blocks: a CTA sweeps its row block's N tiles and computes the
  # statistics once (H200, 262144×K×K, rms: 230 vs 239 µs at K = 512, 820 vs 840 at 1024);
  # with few row blocks sweeping would leave SMs idle, and when the row blocks in flight
  # outgrow L2 their re-reads go to HBM (K = 2048: 3365 vs 3177 µs).
  stats_once = (-(-n // tile_n) > 1 and -(-m // tile_m) >= STATS_ONCE_MIN_ROW_BLOCKS
                and 132 * tile_m * k * 2 <= STATS_ONCE_MAX_X_BYTES)
  # Statistics in every K loop: the shared ring with a WGMMA in flight, so the statistics'
  # loads and sums overlap the tensor core (see the docstring for the measurements).
  ring = dict(pipeline="ring", delay_release=1) if not stats_once else {}
  base = TileConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                    epi_tile_m=64, epi_tile_n=64, stats_once=stats_once, **ring)
  narrow = dataclasses.replace(base, epi_tile_n=32)
  return narrow if _chained_stages(narrow, k) > _chained_stages(base, k) else base


def _chained_stages(cfg: TileConfig, k: int) -> int:
  """Stages of a chained pipeline for cfg, with the most SMEM any call takes besides the
  stages (LayerNorm, bias, bf16 output)."""
  stage_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * 2
  free = mgpu.SMEM_BYTES - _fixed_smem_bytes(cfg, jnp.bfloat16, 2, 2)
  stages, chained = mgpu.pipeline_stages(max(k // cfg.tile_k, 1),
                                                min(cfg.max_concurrent_steps, free // stage_bytes))
  return stages if chained else 0


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static facts of one kernel instance."""
  m: int
  k: int
  n: int
  dtype: jnp.dtype
  out_dtype: jnp.dtype
  norm: str | None  # None: the plain GEMM (:func:`gemm`)
  eps: float
  has_bias: bool
  cfg: TileConfig
  stages: int
  chained: bool  # a CTA's tiles run as one K-loop pipeline (Pallas's pipeline)
  num_ctas: int  # persistent CTAs
  a_in_registers: bool  # WGMMA reads x from registers (x stage TMA'd untiled: any M)
  epi_n: int  # epilogue tile width: one 128-byte swizzle span of out_dtype at most
  out_slots: int  # epilogue output slots per consumer warpgroup

  @property
  def delay_release(self) -> int:  # WGMMA groups left in flight across K steps (TileConfig)
    return mgpu.plan_delay_release(self.cfg, self.stages, self.a_in_registers)

  @property
  def n_vecs(self) -> int:  # col_sum and/or out_bias rows in the per-warpgroup vector buffer
    return int(self.norm == "layer") + int(self.has_bias)

  @property
  def n_stats(self) -> int:  # rstd (and mean) written per row
    return _n_stats(self.norm)

  @property
  def m_iters(self) -> int:  # row blocks of tile_m rows
    return -(-self.m // self.cfg.tile_m)

  @property
  def n_iters(self) -> int:
    return -(-self.n // self.cfg.tile_n)

  @property
  def k_iters(self) -> int:
    return self.k // self.cfg.tile_k


def _n_stats(norm) -> int:
  return {"rms": 1, "layer": 2, None: 0}[norm]


def _epi_tile_n(cfg: TileConfig, out_dtype) -> int:
  # The output stage is swizzled but untiled: one row must fit in a 128-byte swizzle span.
  return min(cfg.epi_tile_n, 128 // jnp.dtype(out_dtype).itemsize)


OUT_SLOTS = 2
"""SMEM slots per consumer warpgroup for the epilogue's output tiles (JAX's Hopper matmul): an
epilogue tile waits until the TMA store of the tile two before it has read its slot."""


def _out_slots(cfg: TileConfig, out_dtype) -> int:
  chunks = (cfg.wg_tile_m * cfg.tile_n) // (cfg.epi_tile_m * _epi_tile_n(cfg, out_dtype))
  return min(OUT_SLOTS, chunks)


def _fixed_smem_bytes(cfg: TileConfig, out_dtype, n_vecs: int, n_stats: int) -> int:
  epi_n = _epi_tile_n(cfg, out_dtype)
  out = 2 * _out_slots(cfg, out_dtype) * cfg.epi_tile_m * epi_n * jnp.dtype(out_dtype).itemsize
  vecs = 2 * n_vecs * cfg.tile_n * 4
  stats = 2 * n_stats * cfg.wg_tile_m * 4
  return out + vecs + stats + _SMEM_SLACK


def _make_plan(m, k, n, dtype, out_dtype, norm, eps, has_bias, cfg, interpret) -> _Plan:
  if norm is None and cfg.stats_once:
    raise ValueError("stats_once needs statistics: the plain GEMM has none")
  n_vecs = int(norm == "layer") + int(has_bias)
  stage_bytes = (cfg.tile_m * cfg.tile_k + cfg.tile_k * cfg.tile_n) * jnp.dtype(dtype).itemsize
  free = mgpu.SMEM_BYTES - _fixed_smem_bytes(cfg, out_dtype, n_vecs, _n_stats(norm))
  if min(cfg.max_concurrent_steps, free // stage_bytes) < 1:
    raise ValueError(f"{cfg} does not fit in {mgpu.SMEM_BYTES} bytes of SMEM")
  stages, chained = mgpu.stages_for(
      cfg, k // cfg.tile_k, min(cfg.max_concurrent_steps, free // stage_bytes))
  # Work units of the persistent loop: (row block, N tile), or row blocks alone when a CTA
  # sweeps all N tiles of its row block (stats_once).
  m_iters = -(-m // cfg.tile_m)
  units = m_iters if cfg.stats_once else m_iters * -(-n // cfg.tile_n)
  # Mosaic's tiled TMA (the SMEM layout WGMMA reads A from) needs M % 8 == 0 on the GPU; other M
  # stream x untiled and give WGMMA the registers the statistics load anyway. Interpret mode has
  # no tiled-TMA restriction (and cannot run register-A WGMMA).
  a_in_registers = not interpret and m % 8 != 0
  return _Plan(m=m, k=k, n=n, dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(out_dtype), norm=norm,
               eps=float(eps), has_bias=has_bias, cfg=cfg, stages=stages, chained=chained,
               num_ctas=mgpu.persistent_clusters(1, units, interpret),
               a_in_registers=a_in_registers, epi_n=_epi_tile_n(cfg, out_dtype),
               out_slots=_out_slots(cfg, out_dtype))


# ------------------------------------------------------------------------------------------------
# Row statistics. Values live in the WGMMA register layout as per-thread partial sums; only the
# finalize step reduces across lanes.


def _rowvec(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


def _init_stats(plan: _Plan):
  zeros = mgpu.lane_partial_zeros(plan.cfg.wg_tile_m)
  return (zeros,) if plan.norm == "rms" else (zeros, zeros, zeros)


def _update_stats(plan: _Plan, stats, x, k_idx):
  """Adds the f32 A tile ``x`` (rows, tile_k) of K step ``k_idx`` to the running statistics.

  rms: (Σx²,). layer: (shift, Σ(x − shift), Σ(x − shift)²), shift fixed at K step 0.
  """
  # The statistics restart at zero for every output tile, so "shift += first · value" sets the
  # shift at K step 0 and keeps it afterwards (select with a scalar predicate does not lower
  # with warpgroup semantics).
  first = jnp.asarray(k_idx == 0).astype(jnp.float32)  # k_idx is a Python int under disable_jit
  cols = mgpu.lane_slices(x)
  if plan.norm == "rms":
    (s2,) = stats
    return (s2 + mgpu.tree_sum([c * c for c in cols]),)
  shift, s1, s2 = stats
  shift = shift + first * cols[0]
  d = [c - shift for c in cols]
  return (shift, s1 + mgpu.tree_sum(d), s2 + mgpu.tree_sum([v * v for v in d]))


def _finalize_stats(plan: _Plan, stats):
  """(mean or None, rstd) row vectors (layout WGMMA.reduce(1)) from the accumulated sums."""
  k, eps = plan.k, plan.eps
  if plan.norm == "rms":
    (s2,) = stats
    return None, lax.rsqrt(jnp.sum(s2, axis=1) * (1.0 / k) + eps)
  shift, s1, s2 = stats
  # Chan et al.: merge the (count, mean, M2) of the 8 lane columns, count = K / 8 each.
  cnt = k // mgpu.LANE_COLS
  lane_mean = shift + s1 * (1.0 / cnt)
  # s1 · (s1 / cnt), not s1² / cnt: s1² overflows float32 for rows of ~3e17 (K = 512) while
  # s2 and the result are still finite (a fresh-eyes review, session 8).
  lane_m2 = s2 - s1 * (s1 * (1.0 / cnt))
  mean = jnp.sum(lane_mean, axis=1) * (1.0 / mgpu.LANE_COLS)
  dev = lane_mean - _rowvec(mean, lane_mean.shape)
  m2 = jnp.sum(lane_m2, axis=1) + jnp.sum(dev * dev, axis=1) * float(cnt)
  var = jnp.maximum(m2 * (1.0 / k), 0.0)
  return mean, lax.rsqrt(var + eps)


# ------------------------------------------------------------------------------------------------
# The kernel.


def _for_each_tile(plan: _Plan, visit):
  """Calls ``visit(m_idx, n_idx, compute_stats, local_tile, first, last)`` for this CTA's
  output tiles in order (``local_tile``: tiles it ran before; first/last: its first/last
  tile). With stats_once a CTA sweeps all N tiles of its row blocks and only the first K
  loop of a row block reads x for the statistics."""
  cfg = plan.cfg
  if cfg.stats_once:
    @plgpu.nd_loop((plan.m_iters,), collective_axes="sm")
    def _row_block_loop(loop_info: plgpu.NDLoopInfo):
      (m_idx,) = loop_info.index
      before = loop_info.local_index * plan.n_iters
      first_block = loop_info.local_index == 0
      last_block = loop_info.local_index == loop_info.num_local_steps - 1
      visit(m_idx, 0, True, before, first_block, last_block & (plan.n_iters == 1))
      if plan.n_iters > 1:
        pl.loop(1, plan.n_iters)(lambda n_idx: visit(
            m_idx, n_idx, False, before + n_idx, False,
            last_block & (n_idx == plan.n_iters - 1)))
  else:
    @plgpu.nd_loop((plan.m_iters * plan.n_iters,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (lin_idx,) = loop_info.index
      # planar_snake cuts its `minor_dim` into strips and walks the other dim inside a
      # strip, so N varies fastest when M is the strip dimension (0).
      m_idx, n_idx = plgpu.planar_snake(
          lin_idx, (plan.m_iters, plan.n_iters), 0 if cfg.grid_minor_dim == "n" else 1,
          cfg.grid_tile_width)
      visit(m_idx, n_idx, True, loop_info.local_index, loop_info.local_index == 0,
            loop_info.local_index == loop_info.num_local_steps - 1)


def _kernel(*refs, plan: _Plan):
  cfg = plan.cfg
  it = iter(refs)
  x_gmem, w_gmem = next(it), next(it)
  c_gmem = next(it) if plan.norm == "layer" else None
  b_gmem = next(it) if plan.has_bias else None
  y_gmem = next(it)
  rstd_gmem = next(it) if plan.norm is not None else None
  mean_gmem = next(it) if plan.norm == "layer" else None
  vec_gmems = [r for r in (c_gmem, b_gmem) if r is not None]

  wg_m, tile_n, tile_k = cfg.wg_tile_m, cfg.tile_n, cfg.tile_k
  epi_m, epi_n = cfg.epi_tile_m, plan.epi_n
  out_slots, chunks = plan.out_slots, (wg_m // epi_m) * (tile_n // epi_n)
  # x stages: tiled for WGMMA, or swizzle-only (2-D TMA, any M) when WGMMA reads registers.
  x_transforms = mgpu.swizzle_transforms(tile_k, plan.dtype,
                                                tiled=not plan.a_in_registers)
  w_transforms = mgpu.swizzle_transforms(tile_k, plan.dtype)
  # y goes out untiled too: a tiled TMA store would need M % 8 == 0.
  out_transforms = mgpu.swizzle_transforms(epi_n, plan.out_dtype, tiled=False)

  def make_pipeline(body, compute_context, state=None):
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
    return mgpu.consumer_pipeline(
        body, compute_context, steps=plan.k_iters, stages=plan.stages, pipeline_state=state,
        delay_release=plan.delay_release,
        in_specs=[spec((cfg.tile_m, tile_k), lambda kk: (0, kk), transforms=x_transforms),
                  spec((tile_k, tile_n), lambda kk: (kk, 0), transforms=w_transforms)])

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=(
          mgpu.shared_ring_allocs(cfg.tile_m, tile_k, tile_n, plan.dtype, plan.stages,
                                         x_transforms=x_transforms, w_transforms=w_transforms)
          if cfg.pipeline == "ring" else
          make_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem)),
      out_smem=plgpu.SMEM((2, out_slots, epi_m, epi_n), plan.out_dtype,
                          transforms=out_transforms),
      vec_smem=plgpu.SMEM((2, plan.n_vecs, tile_n), jnp.float32) if plan.n_vecs else None,
      vec_barrier=(plgpu.Barrier(num_arrivals=plan.n_vecs, num_barriers=2)
                   if plan.n_vecs else None),  # one arrival per vector copy
      stat_smem=plgpu.SMEM((2, plan.n_stats, wg_m), jnp.float32) if plan.n_stats else None,
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem, vec_smem, vec_barrier, stat_smem):
    wg = lax.axis_index("wg")

    def tile(m_idx, n_idx, compute_stats: bool, first, last, ring_step=None):
      """One (tile_m, tile_n) output tile. Without ``compute_stats`` the K loop is a plain GEMM
      and the epilogue reads the statistics that the row block's first N tile left in SMEM.
      ``first``/``last``: whether it is this CTA's first/last tile (chained pipelines). With
      ``pipeline="ring"`` the K loop runs on the shared ring from global step ``ring_step``."""
      row0 = m_idx * cfg.tile_m + wg * wg_m  # first row of this warpgroup
      col0 = n_idx * tile_n
      with_stats = compute_stats and plan.norm is not None

      def compute_context(eval_pipeline):
        # The column vectors of this N tile arrive while the K loop runs.
        if plan.n_vecs:
          for i, v_gmem in enumerate(vec_gmems):
            plgpu.copy_gmem_to_smem(v_gmem.at[pl.ds(col0, tile_n)], vec_smem.at[wg, i],
                                    vec_barrier.at[wg])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          init = _init_stats(plan) if with_stats else ()
          acc_ref, *stats = eval_pipeline((acc_ref, *init))
          if plan.delay_release:
            plgpu.wgmma_wait(0)  # the last step's WGMMA is still in flight
          _epilogue(acc_ref[...], stats)

      def _row_stats(stats):
        """(rstd, mean or None) of this warpgroup's rows; stat_smem holds them afterwards."""
        if not with_stats:
          load = lambda i: plgpu.load(stat_smem.at[wg, i], layout=plgpu.Layout.WGMMA.reduce(1))
          return load(0), (load(1) if plan.norm == "layer" else None)
        mean, rstd = _finalize_stats(plan, stats)
        row_vecs = [rstd] if mean is None else [rstd, mean]
        for i, v in enumerate(row_vecs):
          stat_smem[wg, i] = v
        plgpu.commit_smem()

        # Every N tile has the statistics; the first one writes them (unless all its rows
        # are past M: a bulk copy clamped to 0 bytes is best not issued).
        @pl.when((n_idx == 0) & (row0 < plan.m))
        def _store_stats():
          for i, dst in enumerate((rstd_gmem, mean_gmem)[:len(row_vecs)]):
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, i], dst.at[pl.ds(row0, wg_m)])

        return rstd, mean

      def _epilogue(acc, stats):
        # Earlier TMA stores from out_smem / stat_smem must have read them before we overwrite.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if plan.norm is not None:
          rstd, mean = _row_stats(stats)
          acc = acc * _rowvec(rstd, acc.shape)
          if mean is not None:
            neg_mean_rstd = _rowvec(-mean * rstd, acc.shape)
        if plan.n_vecs:
          plgpu.barrier_wait(vec_barrier.at[wg])
        for ei in range(wg_m // epi_m):
          for ej in range(tile_n // epi_n):
            ms, ns = slice(ei * epi_m, (ei + 1) * epi_m), slice(ej * epi_n, (ej + 1) * epi_n)
            y = acc[ms, ns]
            vec_i = 0
            if plan.norm == "layer":
              c = plgpu.load(vec_smem.at[wg, vec_i, ns], layout=plgpu.Layout.WGMMA.reduce(0))
              y = y + neg_mean_rstd[ms, ns] * lax.broadcast_in_dim(c, y.shape, [1])
              vec_i += 1
            if plan.has_bias:
              b = plgpu.load(vec_smem.at[wg, vec_i, ns], layout=plgpu.Layout.WGMMA.reduce(0))
              y = y + lax.broadcast_in_dim(b, y.shape, [1])
            slot = (ei * (tile_n // epi_n) + ej) % out_slots
            if out_slots < chunks:  # else every slot was freed by the wait above
              plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
            out_smem[wg, slot] = y.astype(plan.out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                y_gmem.at[pl.ds(row0 + ei * epi_m, epi_m), pl.ds(col0 + ej * epi_n, epi_n)])

      def mma_body(idxs, a_smem, b_smem, carry):
        (k_idx,) = idxs
        acc_ref, *stats = carry
        a_rows = a_smem.at[pl.ds(wg * wg_m, wg_m)]
        if plan.a_in_registers:
          x = plgpu.load(a_rows, layout=plgpu.Layout.WGMMA)
          plgpu.wgmma(acc_ref, x, b_smem)
        else:
          plgpu.wgmma(acc_ref, a_rows, b_smem)
          # Loads while the tensor core works on the WGMMA just issued (both only read a_rows).
          x = plgpu.load(a_rows, layout=plgpu.Layout.WGMMA) if with_stats else None
        if with_stats:
          stats = _update_stats(plan, stats, x.astype(jnp.float32), k_idx)
        if x is not None:
          # Orders these generic-proxy reads before the TMA (async proxy) that will refill the
          # stage once the pipeline releases it (PTX memory model: WAR across proxies).
          plgpu.commit_smem()
        plgpu.wgmma_wait(plan.delay_release)
        return (acc_ref, *stats)

      if cfg.pipeline == "ring":
        compute_context(lambda carry: mgpu.ring_k_loop(
            ring, ring_step, plan.k_iters, carry, mma_body,
            delay_release=plan.delay_release))
        return
      mgpu.run_tile_pipeline(
          functools.partial(make_pipeline, mma_body, compute_context),
          x_gmem.at[pl.ds(m_idx * cfg.tile_m, cfg.tile_m), :],
          w_gmem.at[:, pl.ds(col0, tile_n)],
          allocations=pipeline_allocs, stages=plan.stages, chained=plan.chained,
          first=first, last=last)

    if cfg.pipeline == "ring":
      ring = mgpu.SharedRing(**pipeline_allocs, stages=plan.stages)

      def produce_tile(m_idx, n_idx, compute_stats, local_tile, first, last):
        del compute_stats, first
        rows, cols = pl.ds(m_idx * cfg.tile_m, cfg.tile_m), pl.ds(n_idx * tile_n, tile_n)

        @pl.loop(0, plan.k_iters)
        def _(kk):
          ks = pl.ds(kk * tile_k, tile_k)
          mgpu.ring_produce(ring, local_tile * plan.k_iters + kk, x_gmem.at[rows, ks],
                                   w_gmem.at[ks, cols])
        pl.when(last)(lambda: mgpu.ring_drain(ring, (local_tile + 1) * plan.k_iters))

      mgpu.warp_specialize(
          lambda: _for_each_tile(plan, produce_tile),
          lambda: _for_each_tile(plan, lambda m_idx, n_idx, stats, local_tile, first, last: tile(
              m_idx, n_idx, compute_stats=stats, first=first, last=last,
              ring_step=local_tile * plan.k_iters)))
    else:
      _for_each_tile(plan, lambda m_idx, n_idx, stats, local_tile, first, last: tile(
          m_idx, n_idx, compute_stats=stats, first=first, last=last))

  # All TMA stores must land before the kernel exits.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check_args(x, w_gamma, col_sum, out_bias, norm, eps, out_dtype):
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
  if x.ndim != 2 or w_gamma.ndim != 2 or x.shape[1] != w_gamma.shape[0]:
    raise ValueError(f"x must be (M, K) and w_gamma (K, N), got {x.shape} and {w_gamma.shape}")
  if x.dtype != w_gamma.dtype:
    raise TypeError(f"x and w_gamma must have the same dtype, got {x.dtype}, {w_gamma.dtype}")
  m, k = x.shape
  n = w_gamma.shape[1]
  if (reason := unsupported_reason(m, k, n, x.dtype)) is not None:
    raise ValueError(f"norm_matmul kernel cannot run this call: {reason}")
  if (norm == "layer") != (col_sum is not None):
    raise ValueError("col_sum is required for norm='layer' and must be None otherwise")
  for name, v in (("col_sum", col_sum), ("out_bias", out_bias)):
    if v is not None and (v.shape != (n,) or v.dtype != jnp.float32):
      raise ValueError(f"{name} must be float32 of shape ({n},), got {v.dtype}{v.shape}")
  if jnp.dtype(out_dtype) not in (*mgpu.SUPPORTED_DTYPES, jnp.dtype(jnp.float32)):
    raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
  if not (isinstance(eps, (int, float)) and eps > 0):
    raise ValueError(f"eps must be a positive float, got {eps!r}")


def norm_matmul_fwd(x, w_gamma, col_sum, out_bias, *, norm: str, eps: float, out_dtype,
                    interpret: bool = False, config: TileConfig | None = None):
  """Forward of the lazy pre-norm GEMM as one Mosaic-GPU kernel (Hopper).

  Args:
    x: (M, K) bfloat16/float16 activations; M ≥ 1, K a multiple of 64.
    w_gamma: (K, N) weight in x's dtype with the norm's scale folded in (``diag(scale) w``);
      N a multiple of 64.
    col_sum: (N,) float32 ``1ᵀ w_gamma`` (summed in f32) for ``norm="layer"``; None otherwise.
    out_bias: (N,) float32 ``norm_biasᵀ w`` or None.
    norm: "rms" or "layer".
    eps: positive float added to the variance (mean square for RMS).
    out_dtype: dtype of y: bfloat16, float16 or float32.
    interpret: run in Pallas GPU interpret mode on any backend (race detection on,
      uninitialized memory NaN: :func:`pallas_norm.mgpu.interpret_params`).
    config: tiling; default :func:`pick_config`.

  Returns:
    ``(y, mean, rstd)``: y (M, N) out_dtype; mean (M,) float32 (None unless "layer"); rstd (M,)
    float32, where
    rms: ``y = rstd ⊙_rows (x @ w_gamma) + out_bias``, rstd = rsqrt(mean(x²) + eps);
    layer: ``y = rstd ⊙_rows (x @ w_gamma − mean ⊗ col_sum) + out_bias``,
    rstd = rsqrt(var(x) + eps). Accuracy domain: see the module docstring.

  Raises:
    ValueError: shapes/dtypes the kernel does not support (see :func:`unsupported_reason`),
      col_sum given or missing inconsistently with ``norm``, bad eps or norm, or a config that
      does not fit in SMEM. TypeError: x and w_gamma dtypes differ, or an unsupported
      out_dtype.
  """
  _check_args(x, w_gamma, col_sum, out_bias, norm, eps, out_dtype)
  m, k = x.shape
  return launch(x, w_gamma, col_sum, out_bias, norm=norm, eps=eps, out_dtype=out_dtype,
                interpret=interpret, config=config or pick_config(m, k, w_gamma.shape[1]))


def gemm(x, w, *, out_dtype=None, interpret: bool = False, config: TileConfig | None = None):
  """``x @ w`` by the pre-norm kernel without its statistics: our plain GEMM, what the fused
  kernels are measured against (the benchmarks' GEMM baseline). x (M, K), w (K, N) bfloat16 or
  float16 (K, N multiples of 64); y in ``out_dtype`` (default x's), f32 accumulation. Default
  tiling: :func:`pick_config`'s tiles on Pallas's pipeline, in the GEMM's plain tile order.

  Raises:
    ValueError / TypeError: as :func:`norm_matmul_fwd`.
  """
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  m, k = x.shape
  n = w.shape[1]
  _check_args(x, w, None, None, "rms", 1.0, out_dtype)
  if config is None:
    config = dataclasses.replace(pick_config(m, k, n), stats_once=False, pipeline="pallas",
                                 delay_release=0)
  return launch(x, w, None, None, norm=None, eps=1.0, out_dtype=out_dtype, interpret=interpret,
                config=config)[0]


def launch(x, w_gamma, col_sum, out_bias, *, norm: str | None, eps: float, out_dtype,
           interpret: bool, config: TileConfig):
  """:func:`norm_matmul_fwd` on arguments its caller validated, with the ``config`` it picked
  (``norm=None``: the plain GEMM of :func:`gemm`): the public op checks its arguments and the
  kernel's :func:`unsupported_reason` once and computes the config once, then calls this.
  Same outputs; ValueError only from the plan (a config that does not fit, or K not a multiple
  of its tile_k)."""
  cfg = config
  m, k = x.shape
  n = w_gamma.shape[1]
  if k % cfg.tile_k:
    raise ValueError(f"K = {k} is not a multiple of tile_k = {cfg.tile_k}")
  plan = _make_plan(m, k, n, x.dtype, out_dtype, norm, eps, out_bias is not None, cfg,
                    interpret)
  # The row statistics leave through 1-D bulk copies, which Mosaic clamps to the array's end:
  # that clamped size must stay a multiple of 16 bytes, so the vectors get ceil(M / 4) * 4 rows.
  m_stats = -(-m // 4) * 4
  out_type = [jax.ShapeDtypeStruct((m, n), plan.out_dtype)]
  out_type += [jax.ShapeDtypeStruct((m_stats,), jnp.float32)] * plan.n_stats
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=tuple(out_type),
      grid=(plan.num_ctas,),
      grid_names=("sm",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=mgpu.interpret_params() if interpret else None,
  )
  args = [a for a in (x, w_gamma, col_sum, out_bias) if a is not None]
  outs = call(*args)
  y = outs[0]
  rstd = outs[1][:m] if norm is not None else None
  mean = outs[2][:m] if norm == "layer" else None
  return y, mean, rstd
