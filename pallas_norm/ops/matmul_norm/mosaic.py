"""Post-norm GEMM forward as a Pallas Mosaic-GPU kernel for Hopper (sm_90a) (DESIGN.md, op 2).

For x (M, K) and w (K, N) it computes, with every statistic in f32 from the f32 accumulator::

    h = x @ w (+ dense_bias) (+ residual)
    y = norm(h) · scale (+ bias),   norm = RMSNorm or LayerNorm over the N columns of a row

and optionally writes h (the pre-norm residual stream), x̂ = norm(h) before the affine (what the
backward needs) and the row statistics (mean, rstd).

Kernel structure: the GEMM body of :mod:`pallas_norm.mgpu.gemm` (a TMA producer warpgroup, two
WGMMA consumer warpgroups that split a CTA tile of ``tile_m`` rows × ``tile_n`` columns along M,
so every row of a CTA belongs to exactly one warpgroup) with the hooks of :class:`_RowNormHooks`.
A full row spans N, so when ``N > tile_n`` a *cluster* of ``c = N / tile_n`` CTAs (c ∈ {1, 2, 4,
8}) owns the same rows, CTA i the columns ``[i·tile_n, (i+1)·tile_n)``. The grid is persistent:
each cluster walks row blocks. With one N tile per CTA the K loop runs on the shared ring, its
steps numbered across the CTA's row blocks, so the producer fills the next row block's stages
while the consumers run the epilogue and the exchange. With several N tiles per CTA it runs on
Pallas's pipeline (``TileConfig.pipeline="pallas"``): the one exception to the ring, which
measured 1.1-3.6× slower there, not understood (``benchmarks/EXPERIMENTS.md``).

Epilogue of one warpgroup (rows r, its CTA's N slice):

1. ``h = acc + dense_bias + residual``; the residual tile was fetched by TMA into SMEM while the
   K loop ran, h is recomputed chunk by chunk (64 columns) from the accumulator registers and
   SMEM instead of being kept whole in registers.
2. Per-row partials over the slice: LayerNorm the slice mean and ``M2 = Σ (h − mean_slice)²``
   (two passes over registers), RMSNorm ``Σ h²``.
3. :func:`_cluster_row_stats` exchanges the partials between the CTAs of the cluster through
   distributed shared memory (the only code that differs between c = 1 and c > 1), and every CTA
   merges the c partials in the same order (Chan et al. for LayerNorm: the variance stays exact
   for rows with a large mean, and the bits are identical in every CTA). The normalization
   subtracts the merged mean rounded to float32, so y's error grows as ~5e-8·|mean|/std: within
   2 bf16 ulps of XLA's up to |mean|/std = 1e4 (tested), ~0.05 at 1e6 (the stated domain).
4. Each CTA normalizes its own slice and stores y, then h and x̂, chunk j of each through
   chunk j's slot of the residual tile in SMEM (every residual chunk is in registers by then),
   and CTA 0 of the cluster the statistics. No SMEM besides the tile: staging slots for h / x̂
   cost the K loop one of its three pipeline stages at tile_n = 256 (benchmarks/NOTES.md).

Past N = 8 · 256 a CTA owns ``n_tiles`` ≤ 4 N tiles (N ≤ 8192). Hopper keeps the accumulator in
registers and SMEM cannot hold several finished tiles next to the pipeline, so the epilogue
splits in two passes. First pass, after each tile's K loop: the tile's partials go to SMEM and
``h − tile mean`` (LayerNorm; RMSNorm: h) goes to y's place in global memory in the output
dtype (centered, so a row with a large mean keeps its precision), plus h if asked. Second pass,
after the last tile: merge the tiles' partials (Chan), exchange in the cluster, then reload each
tile from global memory (L2) by TMA and normalize it in place
(``h − mean = centered + (tile mean − mean)``). The second pass costs one more write and read of
y per element; interpret mode runs it with one CTA looping over all N tiles.

On the shared ring with one N tile per CTA the residual tile's TMA loads are issued during the
K loop, each chunk once the previous row block's y chunk has left SMEM (faster than waiting for
every store before the K loop: ``benchmarks/NOTES.md``, "Post-norm forward").

GPU interpret mode cannot read a peer CTA's shared memory, so the c > 1 exchange runs only on a
GPU; everything else is the same code for c = 1, which interpret mode runs on the CPU. What was
checked on the CPU for c > 1: the kernel lowers for sm_90a through Mosaic's Python passes
(layout inference, TMA and SMEM-size checks) with the CUDA plugin's bindings; Mosaic lowers a
peer reference only for a whole SMEM allocation (not a slice of one), hence one allocation per
(warpgroup, partial) and a branch on the static warpgroup index in the exchange.

Shapes: any M ≥ 1 (TMA zero-fills rows past M and drops their stores; M is padded to a multiple
of 8 rows first, a copy, because a TMA copy of an 8-row-tiled SMEM tile needs it), K a multiple
of 64, N = c · n_tiles · tile_n with tile_n a multiple of 64 up to 256 (N ≤ 2048 in one tile
per CTA, up to 8192 in 4); x and w bfloat16 or
float16; y/h/x̂ bfloat16 or float16; a residual must have the output dtype. Other calls get a
reason from :func:`unsupported_reason` and the public op falls back to XLA.
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
from pallas_norm.mgpu import exchange as cluster_exchange
from pallas_norm.mgpu import gemm as gemm_core
from pallas_norm.mgpu.config import CLUSTER_SIZES, MAX_N_TILES, MAX_TILE_N, cluster_split

__all__ = ["TileConfig", "CLUSTER_SIZES", "MAX_TILE_N", "unsupported_reason", "pick_config",
           "matmul_norm_fwd", "launch"]

MAX_N = max(CLUSTER_SIZES) * MAX_N_TILES * MAX_TILE_N

_EXTRA_SLOTS = 2  # two-pass epilogue's staging slots for h / x̂: one written while one is stored
# A TMA copy into an 8-row-tiled SMEM tile needs the global row count to be a multiple of 8; the
# rows past M in the last row tile are then zero-filled on load and dropped on store by TMA.
_ROW_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class _Plan(gemm_core.NormGemmPlan):
  """Static facts of one kernel instance."""
  vecs: tuple[str, ...]  # which of "dense_bias", "scale", "bias" are given (in that order)
  has_residual: bool
  return_h: bool
  return_xhat: bool
  return_stats: bool
  cluster: int
  n_tiles: int  # N tiles per CTA: the CTA's columns are n_tiles · tile_n
  num_clusters: int
  exchange: str = "pull"  # see matmul_norm_fwd's ``exchange``
  kloop: gemm_core.KLoop | None = None  # set by _make_plan once the SMEM is known

  @property
  def n_partials(self) -> int:  # per-row partial statistics exchanged in the cluster
    return 2 if self.norm == "layer" else 1

  @property
  def n_stats(self) -> int:  # rstd (and mean) rows written
    return (2 if self.norm == "layer" else 1) if self.return_stats else 0

  @property
  def extras(self) -> tuple[str, ...]:  # the optional M × N outputs besides y
    return tuple(e for e, on in (("h", self.return_h), ("xhat", self.return_xhat)) if on)

  @property
  def n_loads(self) -> int:
    """TMA copies per tile besides the K loop: the vectors and the residual's chunks."""
    return len(self.vecs) + (self.cfg.tile_n // self.cfg.epi_tile_n) * self.has_residual

  @property
  def n_reloads(self) -> int:  # TMA copies per N tile in the second pass (n_tiles > 1)
    return len(self.vecs) + self.cfg.tile_n // self.cfg.epi_tile_n

  @property
  def cta_cols(self) -> int:  # columns of a row that one CTA owns
    return self.n_tiles * self.cfg.tile_n

  def vec_index(self, name: str) -> int:
    return self.vecs.index(name)


def _tiles_per_cta(n: int, tile_n: int, interpret: bool) -> tuple[int, int]:
  """(cluster, n_tiles) for N tiles of ``tile_n``: the largest cluster that leaves at most
  :data:`MAX_N_TILES` tiles per CTA, or one CTA in interpret mode (which cannot read a peer's
  shared memory)."""
  tiles = n // tile_n
  if interpret:
    return 1, tiles
  fits = [c for c in CLUSTER_SIZES if tiles % c == 0 and tiles // c <= MAX_N_TILES]
  c = min((c for c in fits if tiles // c == 1), default=max(fits, default=0))
  return c, (tiles // c if c else 0)


def unsupported_reason(m: int, k: int, n: int, dtype, out_dtype=None,
                       residual_dtype=None, interpret: bool = False) -> str | None:
  """None if the kernel can run x: (m, k) @ w: (k, n), else a sentence saying why not.

  ``out_dtype`` defaults to ``dtype``; ``residual_dtype`` is None when there is no residual.
  ``interpret``: in interpret mode, which runs a cluster of 1 (:func:`_tiles_per_cta`).
  """
  dtype = jnp.dtype(dtype)
  out_dtype = jnp.dtype(out_dtype or dtype)
  if dtype not in mgpu.SUPPORTED_DTYPES:
    return f"x dtype {dtype.name} is not bfloat16 or float16"
  if out_dtype not in mgpu.SUPPORTED_DTYPES:
    return f"out_dtype {out_dtype.name} is not bfloat16 or float16"
  if residual_dtype is not None and jnp.dtype(residual_dtype) != out_dtype:
    return (f"residual dtype {jnp.dtype(residual_dtype).name} differs from the output dtype "
            f"{out_dtype.name} (the kernel writes y in place of the residual tile)")
  if m < 1:
    return f"M = {m} rows: need at least 1"
  if k % 64 or k < 64:
    return f"K = {k} is not a positive multiple of 64"
  if n % 64 or n < 64:
    return f"N = {n} is not a positive multiple of 64"
  if cluster_split(n) is None:
    return (f"N = {n} does not split into a cluster of {list(CLUSTER_SIZES)} CTAs with at most "
            f"{MAX_N_TILES} N tiles of a 64-multiple ≤ {MAX_TILE_N} columns each (N ≤ {MAX_N}; "
            "past 2048 a multiple of 1024)")
  if interpret and (tiles := n // cluster_split(n)[1]) > MAX_N_TILES:
    return (f"N = {n} needs {tiles} N tiles of one CTA in interpret mode (it cannot read a "
            f"peer CTA's shared memory, so it runs a cluster of 1), at most {MAX_N_TILES}")
  return None


def pick_config(m: int, k: int, n: int) -> TileConfig:
  """Tiling for x (m, k) @ w (k, n): the CTA's N tile ``tile_n = N / cluster`` with the smallest
  cluster in :data:`CLUSTER_SIZES` (past N = 2048: clusters of 8 CTAs looping over up to 4 N
  tiles, :func:`cluster_split`); 128 rows per CTA (64 per consumer warpgroup), 256 when the
  tile is at most 128 wide (both keep the accumulator at 128 registers per thread); tile_k 64;
  as many pipeline stages as SMEM holds (at most 4). With one N tile per CTA (N ≤ 2048) the
  K loops run on the shared ring (``pipeline="ring"``, no WGMMA in flight: one in flight was
  slower with a residual); with several N tiles per CTA on Pallas's pipeline, where the ring
  measured 1.1-3.6× slower (``benchmarks/NOTES.md``, post-norm forward)."""
  del m, k
  split = cluster_split(n)
  if split is None:
    raise ValueError(f"N = {n}: {unsupported_reason(1, 64, n, jnp.bfloat16)}")
  _, tile_n, n_tiles = split
  return TileConfig(tile_m=256 if tile_n <= 128 else 128, tile_n=tile_n, tile_k=64,
                    max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
                    pipeline="ring" if n_tiles == 1 else "pallas")


def _streams(cfg: TileConfig, dtype) -> list[gemm_core.Stream]:
  """x (tile_m, tile_k) and w (tile_k, tile_n) per K step (M is padded to whole 8-row groups,
  so both are tiled for WGMMA)."""
  transforms = mgpu.swizzle_transforms(cfg.tile_k, dtype)
  return [gemm_core.Stream((cfg.tile_m, cfg.tile_k), dtype, 1, transforms),
          gemm_core.Stream((cfg.tile_k, cfg.tile_n), dtype, 0, transforms)]


def _smem(plan: _Plan) -> dict:
  """SMEM besides the stages, per consumer warpgroup: the residual-in / y-out tile as column
  chunks (a TMA copy needs a contiguous SMEM window; with one N tile per CTA h and x̂ go out
  through its chunks too), the column vectors, the statistics, the cluster exchange, and with
  several N tiles per CTA the h / x̂ staging slots, each tile's partials and the barrier of the
  second pass's reloads. Load barriers: one arrival per TMA copy (each copy arrives with its
  byte count)."""
  cfg = plan.cfg
  wg_m, epi_m, epi_n = cfg.wg_tile_m, cfg.epi_tile_m, cfg.epi_tile_n
  out_transforms = mgpu.swizzle_transforms(epi_n, plan.out_dtype)
  multi = plan.n_tiles > 1
  return dict(
      io_smem=plgpu.SMEM((2, cfg.tile_n // epi_n, wg_m, epi_n), plan.out_dtype,
                         transforms=out_transforms),
      extra_smem=(plgpu.SMEM((2, _EXTRA_SLOTS, epi_m, epi_n), plan.out_dtype,
                             transforms=out_transforms) if plan.extras and multi else None),
      vec_smem=plgpu.SMEM((2, len(plan.vecs), cfg.tile_n), jnp.float32) if plan.vecs else None,
      load_barrier=(plgpu.Barrier(num_arrivals=plan.n_loads, num_barriers=2)
                    if plan.n_loads else None),
      stat_smem=plgpu.SMEM((2, 2, wg_m), jnp.float32) if plan.n_stats else None,
      ex_allocs=_exchange_allocs(plan),
      tile_stats=(plgpu.SMEM((2, plan.n_tiles, plan.n_partials, wg_m), jnp.float32)
                  if multi else None),
      reload_barrier=(plgpu.Barrier(num_arrivals=plan.n_reloads, num_barriers=2)
                      if multi else None))


_UNUSED_OPTIONS = ("stats_once",)
"""TileConfig options of the pre-norm kernels that this kernel does not implement (its grid
walks row blocks, each cluster owning whole rows)."""


def _make_plan(x_shape, n, dtype, out_dtype, norm, eps, vecs, has_residual, return_h,
               return_xhat, return_stats, cfg, interpret, exchange="pull") -> _Plan:
  m, k = x_shape
  mgpu.reject_unused_options(cfg, "matmul_norm", _UNUSED_OPTIONS)
  cluster, n_tiles = _tiles_per_cta(n, cfg.tile_n, interpret)
  if n % cfg.tile_n or not cluster or n_tiles > MAX_N_TILES:
    raise ValueError(f"N = {n} must be tile_n = {cfg.tile_n} times a cluster size in "
                     f"{CLUSTER_SIZES} times at most {MAX_N_TILES} N tiles per CTA"
                     + (" (interpret mode: a cluster of 1, it cannot read a peer CTA's shared "
                        "memory)" if interpret else ""))
  if k % cfg.tile_k:
    raise ValueError(f"K = {k} is not a multiple of tile_k = {cfg.tile_k}")
  if cfg.tile_n % cfg.epi_tile_n:
    raise ValueError(f"epi_tile_n = {cfg.epi_tile_n} must divide tile_n = {cfg.tile_n}")
  plan = _Plan(m=m, k=k, n=n, dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(out_dtype), norm=norm,
               eps=float(eps), vecs=vecs, has_residual=has_residual, return_h=return_h,
               return_xhat=return_xhat, return_stats=return_stats, cfg=cfg, cluster=cluster,
               n_tiles=n_tiles, num_clusters=0, exchange=exchange)
  kloop = gemm_core.plan_k_loop(cfg, _streams(cfg, plan.dtype), plan.k_iters, _smem(plan))
  num_clusters = mgpu.persistent_clusters(cluster, plan.m_iters, interpret)
  return dataclasses.replace(plan, kloop=kloop, num_clusters=num_clusters)


# ------------------------------------------------------------------------------------------------
# Row statistics. Row vectors have the layout WGMMA.reduce(1) (one value per accumulator row).


def _rowvec(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


def _colvec(v, shape):
  return lax.broadcast_in_dim(v, shape, [1])


def _slice_partials(plan: _Plan, h_chunk):
  """Per-row partial statistics of this CTA's N slice, from ``h_chunk(j)`` (rows, epi_tile_n).

  LayerNorm: (slice mean, Σ (h − slice mean)²), two passes over the chunks so a large row mean
  never cancels. RMSNorm: (Σ h²,). Chunks are summed elementwise first: one cross-lane
  reduction per statistic instead of one per chunk.
  """
  chunks = plan.cfg.tile_n // plan.cfg.epi_tile_n
  if plan.norm == "rms":
    s2 = None
    for j in range(chunks):
      h = h_chunk(j)
      s2 = h * h if s2 is None else s2 + h * h
    return (jnp.sum(s2, axis=1),)
  s1 = None
  for j in range(chunks):
    h = h_chunk(j)
    s1 = h if s1 is None else s1 + h
  mean = jnp.sum(s1, axis=1) * (1.0 / plan.cfg.tile_n)
  s2 = None
  for j in range(chunks):
    d = h_chunk(j) - _rowvec(mean, s1.shape)
    s2 = d * d if s2 is None else s2 + d * d
  return mean, jnp.sum(s2, axis=1)


def _combine(plan: _Plan, parts, count: int):
  """Partials of equal column counts ``count``, combined in list order into one partial.

  RMSNorm: (Σ h²,) add up. LayerNorm: (mean_j, M2_j) merge with Chan et al.:
  mean = Σ mean_j / p, M2 = Σ M2_j + count · Σ (mean_j − mean)².
  """
  if plan.norm == "rms":
    ss = parts[0][0]
    for (s,) in parts[1:]:
      ss = ss + s
    return (ss,)
  mean = parts[0][0]
  for mj, _ in parts[1:]:
    mean = mean + mj
  mean = mean * (1.0 / len(parts))
  m2 = parts[0][1]
  for _, m2j in parts[1:]:
    m2 = m2 + m2j
  if len(parts) > 1:
    dev = None
    for mj, _ in parts:
      d2 = (mj - mean) * (mj - mean)
      dev = d2 if dev is None else dev + d2
    m2 = m2 + dev * float(count)
  return mean, m2


def _merge_partials(plan: _Plan, per_cta):
  """(mean or None, rstd) of full rows from the partials of the c CTAs, merged in CTA order."""
  merged = _combine(plan, per_cta, plan.cta_cols)
  if plan.norm == "rms":
    return None, lax.rsqrt(merged[0] * (1.0 / plan.n) + plan.eps)
  mean, m2 = merged
  var = jnp.maximum(m2 * (1.0 / plan.n), 0.0)
  return mean, lax.rsqrt(var + plan.eps)


def _exchange_spec(plan: _Plan) -> cluster_exchange.Spec:
  return cluster_exchange.Spec(cluster=plan.cluster, rows=plan.cfg.wg_tile_m,
                               n_partials=plan.n_partials, exchange=plan.exchange)


def _exchange_allocs(plan: _Plan):
  return cluster_exchange.allocs(_exchange_spec(plan))


def _cluster_row_stats(plan: _Plan, partials, ex, wg, tile_index):
  """(mean or None, rstd) of full rows from this CTA's partials and those of its cluster peers
  (:func:`pallas_norm.mgpu.exchange.cluster_row_sums`), merged by :func:`_merge_partials` in
  CTA order: every CTA holds the same bits."""
  def merge(per_cta):  # (rstd,) or (rstd, mean): the order the pull exchange leaves them in
    mean, rstd = _merge_partials(plan, per_cta)
    return (rstd,) if mean is None else (rstd, mean)

  merged = cluster_exchange.cluster_row_sums(_exchange_spec(plan), partials, ex, wg,
                                             tile_index, merge)
  return (merged[1] if len(merged) == 2 else None), merged[0]


def _cluster_final_sync(plan: _Plan, ex, wg):
  """Waits until the peers read the last tile's partials: no CTA exits while they may."""
  cluster_exchange.final_sync(_exchange_spec(plan), ex, wg)


class _StoreGroups:
  """The TMA store groups one consumer warpgroup commits in one epilogue, in order.

  Bulk store groups complete in commit order, so before refilling a staging buffer it is enough
  to wait until the groups committed *after* the last store that read it are the only ones
  pending: ``wait_smem_to_gmem(n)`` with n = those groups. Waiting for all but the newest one
  would also wait for every y chunk stored in between.
  A buffer this epilogue has not stored from was last read by an earlier epilogue's store, which
  is older than all ``count`` groups committed here, so n = count is a safe bound for it.
  """

  def __init__(self):
    self.count = 0
    self._last = {}
    self._extra_uses = 0

  def committed(self, *buffers) -> None:
    """One group committed; it holds the last stores from ``buffers``."""
    for buffer in buffers:
      self._last[buffer] = self.count
    self.count += 1

  def next_extra_slot(self) -> int:
    slot = self._extra_uses % _EXTRA_SLOTS
    self._extra_uses += 1
    return slot

  def wait_until_read(self, buffer) -> None:
    newer = self.count - self._last[buffer] - 1 if buffer in self._last else self.count
    plgpu.wait_smem_to_gmem(newer, wait_read_only=True)


# ------------------------------------------------------------------------------------------------
# The kernel.


def _row_block_schedule(plan: _Plan) -> gemm_core.Schedule:
  """Each cluster walks row blocks; a CTA runs its ``n_tiles`` N tiles of a row block in turn
  (``Tile.kind``: the tile's index t in the CTA), then ``end_unit((m_idx, row blocks before))``."""
  def schedule(visit, end_unit):
    @plgpu.nd_loop((plan.m_iters,), collective_axes="cluster_grid")
    def _row_block_loop(loop_info: plgpu.NDLoopInfo):
      (m_idx,) = loop_info.index
      tile_index = loop_info.local_index  # row blocks this cluster did before
      for t in range(plan.n_tiles):
        visit(gemm_core.Tile(
            m_idx, t, tile_index if plan.n_tiles == 1 else tile_index * plan.n_tiles + t,
            (tile_index == 0) & (t == 0),
            (tile_index == loop_info.num_local_steps - 1) & (t == plan.n_tiles - 1), kind=t))
      end_unit((m_idx, tile_index))
  return schedule


class _RowTileIO:
  """A consumer warpgroup's loads and stores of the post-norm epilogue: h from the
  accumulator, the residual tile and column vectors by TMA (before or during the K loop), the
  statistics and the y / h / x̂ chunks through SMEM. SMEM: :func:`_smem`."""

  def __init__(self, plan: _Plan, wg, cta, refs, gmems):
    cfg = self.cfg = plan.cfg
    self.plan, self.wg, self.cta = plan, wg, cta
    self.wg_m, self.tile_n, self.epi_m, self.epi_n = (cfg.wg_tile_m, cfg.tile_n, cfg.epi_tile_m,
                                                      cfg.epi_tile_n)
    self.chunks = cfg.tile_n // cfg.epi_tile_n
    self.ex = (None if refs["ex_allocs"] is None
               else cluster_exchange.Exchange(**refs["ex_allocs"]))
    for name in ("io_smem", "extra_smem", "vec_smem", "load_barrier", "stat_smem", "tile_stats",
                 "reload_barrier"):
      setattr(self, name, refs[name])
    (self.y_gmem, self.extra_gmems, self.stat_gmems, self.res_gmem, self.vec_gmems) = gmems
    # On the ring with one N tile per CTA every row block ends in _epilogue, whose store groups
    # _residual_during_k_loop counts; elsewhere the residual waits for all stores.
    self.residual_in_k_loop = plan.has_residual and cfg.pipeline == "ring" and plan.n_tiles == 1

  def tile_col0(self, t):  # first column of this CTA's N tile t (fixed for the whole kernel)
    return (self.cta * self.plan.n_tiles + t) * self.tile_n

  def _chunk(self, gmem, row0, col0, j):  # the warpgroup's rows of column chunk j of a tile
    return gmem.at[pl.ds(row0, self.wg_m), pl.ds(col0 + j * self.epi_n, self.epi_n)]

  def _vec(self, name, ns):
    v = plgpu.load(self.vec_smem.at[self.wg, self.plan.vec_index(name), ns],
                   layout=plgpu.Layout.WGMMA.reduce(0))
    return _colvec(v, (self.wg_m, self.epi_n))

  def _h_chunk_fn(self, acc):
    """``h_chunk(j)``: h of columns [j·epi_n, (j+1)·epi_n) of the tile, f32.

    Each chunk is built once, replacing the accumulator (same registers): the statistics'
    passes and the normalization then read registers only. Recomputing it on each use (3
    uses for LayerNorm) re-read the dense bias and the residual from SMEM each time, a fifth
    of the kernel's time with both (benchmarks/NOTES.md, "Post-norm forward")."""
    def build(j):
      ns = pl.ds(j * self.epi_n, self.epi_n)
      h = acc[:, j * self.epi_n:(j + 1) * self.epi_n]
      if "dense_bias" in self.plan.vecs:
        h = h + self._vec("dense_bias", ns)
      if self.plan.has_residual:
        r = plgpu.load(self.io_smem.at[self.wg, j], layout=plgpu.Layout.WGMMA)
        h = h + r.astype(jnp.float32)
      return h
    return [build(j) for j in range(self.chunks)].__getitem__

  def _store_stats(self, mean, rstd, row0):
    """rstd (and mean) of the warpgroup's rows through ``stat_smem``. The copies join the next
    committed store group (the y chunk stores that always follow), so the groups
    :class:`_StoreGroups` counts are the same in every CTA."""
    if not self.plan.n_stats:
      return
    stats = [rstd] if mean is None else [rstd, mean]
    for i, v in enumerate(stats):
      self.stat_smem[self.wg, i] = v
    plgpu.commit_smem()

    @pl.when(self.cta == 0)  # every CTA of the cluster holds the same bits: one writes them
    def _():
      for i in range(len(stats)):
        plgpu.copy_smem_to_gmem(self.stat_smem.at[self.wg, i],
                                self.stat_gmems[i].at[pl.ds(row0, self.wg_m)],
                                commit_group=False)

  def _store_chunk(self, value, j, row0, col0, groups):
    """y chunk j through io_smem, in place: each thread overwrites elements it has read."""
    self.io_smem[self.wg, j] = value.astype(self.plan.out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(self.io_smem.at[self.wg, j], self._chunk(self.y_gmem, row0, col0, j))
    groups.committed(("io", j))

  def _store_extras(self, values, j, row0, col0, groups):
    """h / x̂ chunk j through the small slots, in turn; ``groups``: this epilogue's stores."""
    for e in self.plan.extras:
      if e not in values:
        continue
      for i in range(self.wg_m // self.epi_m):
        s = groups.next_extra_slot()
        groups.wait_until_read(("extra", s))
        rows = slice(i * self.epi_m, (i + 1) * self.epi_m)
        self.extra_smem[self.wg, s] = values[e][rows].astype(self.plan.out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            self.extra_smem.at[self.wg, s],
            self.extra_gmems[e].at[pl.ds(row0 + i * self.epi_m, self.epi_m),
                                   pl.ds(col0 + j * self.epi_n, self.epi_n)])
        groups.committed(("extra", s))

  def _normalize_chunk(self, h_minus_mean, rstd_b, ns):
    xhat = h_minus_mean * rstd_b
    y = xhat
    if "scale" in self.plan.vecs:
      y = y * self._vec("scale", ns)
    if "bias" in self.plan.vecs:
      y = y + self._vec("bias", ns)
    return xhat, y

  def _wait_loads(self):
    if not self.plan.has_residual:
      # Earlier TMA stores from the staging buffers must have read them before we overwrite.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if self.plan.n_loads:
      plgpu.barrier_wait(self.load_barrier.at[self.wg])

  def _prefetch_residual_chunk(self, j, row0, col0):
    plgpu.copy_gmem_to_smem(self._chunk(self.res_gmem, row0, col0, j),
                            self.io_smem.at[self.wg, j], self.load_barrier.at[self.wg])

  def _prefetch_epilogue_inputs(self, row0, col0, residual=True):
    """The residual tile (unless ``residual`` is False: :meth:`_residual_during_k_loop` loads
    it) and the column vectors of a tile, by TMA while its K loop runs."""
    if self.plan.has_residual and residual:
      # The previous tile's stores read self.io_smem: they must finish before TMA refills it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      for j in range(self.chunks):
        self._prefetch_residual_chunk(j, row0, col0)
    for i, v_gmem in enumerate(self.vec_gmems):
      plgpu.copy_gmem_to_smem(v_gmem.at[pl.ds(col0, self.tile_n)], self.vec_smem.at[self.wg, i],
                              self.load_barrier.at[self.wg])

  def _residual_during_k_loop(self, k_step, row0, col0):
    """Issues residual chunk j at K step min(j, last step), each once the last store from
    slot j has left SMEM, so the wait for those stores overlaps the WGMMAs just issued instead
    of holding the K loop's start. That store was the last row block's last output's chunk j
    (:meth:`_RowNormHooks._epilogue`: one group per chunk, output after output), so the groups committed
    after it are that output's chunks after j."""
    for j in range(self.chunks):
      newer = self.chunks - 1 - j

      @pl.when(k_step == min(j, self.plan.k_iters - 1))
      def _(j=j, newer=newer):
        plgpu.wait_smem_to_gmem(newer, wait_read_only=True)
        self._prefetch_residual_chunk(j, row0, col0)


class _RowNormHooks(_RowTileIO, gemm_core.Hooks):
  """The post-norm forward on the GEMM body: the epilogue inputs (residual tile, column
  vectors) loaded by TMA while the K loop runs (on the ring with one N tile per CTA the
  residual chunks during it), and the row-norm epilogue (with the cluster exchange; with
  several N tiles per CTA the first pass per tile and the second pass per row block). SMEM:
  :func:`_smem`."""

  def _epilogue(self, acc, row0, col0, tile_index):
    """One N tile per CTA: statistics, exchange, normalization, all from the accumulator."""
    self._wait_loads()
    h_chunk = self._h_chunk_fn(acc)
    partials = _slice_partials(self.plan, h_chunk)
    mean, rstd = _cluster_row_stats(self.plan, partials, self.ex, self.wg, tile_index)
    self._store_stats(mean, rstd, row0)
    shape = (self.wg_m, self.epi_n)
    rstd_b = _rowvec(rstd, shape)
    shift_b = None if mean is None else _rowvec(mean, shape)

    def value(name, j):
      h = h_chunk(j)
      if name == "h":
        return h
      xhat, y = self._normalize_chunk(h if shift_b is None else h - shift_b, rstd_b,
                                      pl.ds(j * self.epi_n, self.epi_n))
      return y if name == "y" else xhat

    # Output after output, chunk j of each through slot j of io_smem: y in place of the residual
    # (each thread overwrites elements it has read), the next output's chunk j once the store
    # that read slot j left it, with the other chunks' stores (chunks − 1 groups) still going.
    for o, name in enumerate(("y",) + self.plan.extras):
      gmem = self.y_gmem if name == "y" else self.extra_gmems[name]
      for j in range(self.chunks):
        if o:
          plgpu.wait_smem_to_gmem(self.chunks - 1, wait_read_only=True)
        self.io_smem[self.wg, j] = value(name, j).astype(self.plan.out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(self.io_smem.at[self.wg, j], self._chunk(gmem, row0, col0, j))

  def _first_pass(self, acc, row0, col0, t):
    """N tile t of several: its partials go to SMEM and ``h − tile mean`` (LayerNorm; RMS: h)
    goes to y's place in global memory, in the output dtype: centered values keep their
    precision for rows with a large mean. :meth:`_second_pass` normalizes it."""
    self._wait_loads()
    h_chunk = self._h_chunk_fn(acc)
    partials = _slice_partials(self.plan, h_chunk)
    for q, v in enumerate(partials):
      self.tile_stats[self.wg, t, q] = v
    shift_b = None if self.plan.norm == "rms" else _rowvec(partials[0], (self.wg_m, self.epi_n))
    groups = _StoreGroups()
    for j in range(self.chunks):
      h = h_chunk(j)
      self._store_chunk(h if shift_b is None else h - shift_b, j, row0, col0, groups)
      self._store_extras({"h": h}, j, row0, col0, groups)

  def _second_pass(self, row0, tile_index):
    """Merges the N tiles' partials, exchanges them in the cluster, then reloads each tile's
    centered h from global memory and normalizes it in place."""
    per_tile = [tuple(plgpu.load(self.tile_stats.at[self.wg, t, q],
                                 layout=plgpu.Layout.WGMMA.reduce(1))
                      for q in range(self.plan.n_partials)) for t in range(self.plan.n_tiles)]
    partials = _combine(self.plan, per_tile, self.tile_n)
    mean, rstd = _cluster_row_stats(self.plan, partials, self.ex, self.wg, tile_index)
    self._store_stats(mean, rstd, row0)
    shape = (self.wg_m, self.epi_n)
    rstd_b = _rowvec(rstd, shape)
    # The first pass's stores must have landed in global memory, not only left SMEM.
    plgpu.wait_smem_to_gmem(0)
    groups = _StoreGroups()
    for t in range(self.plan.n_tiles):
      col0 = self.tile_col0(t)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile t − 1's stores read self.io_smem
      for j in range(self.chunks):
        plgpu.copy_gmem_to_smem(self._chunk(self.y_gmem, row0, col0, j),
                                self.io_smem.at[self.wg, j], self.reload_barrier.at[self.wg])
      for i, v_gmem in enumerate(self.vec_gmems):
        plgpu.copy_gmem_to_smem(v_gmem.at[pl.ds(col0, self.tile_n)], self.vec_smem.at[self.wg, i],
                                self.reload_barrier.at[self.wg])
      plgpu.barrier_wait(self.reload_barrier.at[self.wg])
      # centered = h − tile mean, so h − mean = centered + (tile mean − mean).
      offset_b = None if mean is None else _rowvec(per_tile[t][0] - mean, shape)
      for j in range(self.chunks):
        centered = plgpu.load(self.io_smem.at[self.wg, j], layout=plgpu.Layout.WGMMA)
        centered = centered.astype(jnp.float32)
        xhat, y = self._normalize_chunk(centered if offset_b is None else centered + offset_b,
                                        rstd_b, pl.ds(j * self.epi_n, self.epi_n))
        self._store_chunk(y, j, row0, col0, groups)
        self._store_extras({"xhat": xhat}, j, row0, col0, groups)

  def _row0(self, m_idx):  # first row of this warpgroup
    return m_idx * self.plan.cfg.tile_m + self.wg * self.plan.cfg.wg_tile_m

  def before_k_loop(self, tile):
    self._prefetch_epilogue_inputs(self._row0(tile.m_idx), self.tile_col0(tile.kind),
                                      residual=not self.residual_in_k_loop)

  def k_step(self, tile, step, carry):
    if self.residual_in_k_loop:
      self._residual_during_k_loop(step.k_idx, self._row0(tile.m_idx), self.tile_col0(0))
    return carry

  def epilogue(self, tile, acc, carry):
    row0, col0 = self._row0(tile.m_idx), self.tile_col0(tile.kind)
    if self.plan.n_tiles == 1:
      self._epilogue(acc, row0, col0, tile.index)
    else:
      self._first_pass(acc, row0, col0, tile.kind)

  def end_unit(self, unit):
    m_idx, tile_index = unit
    if self.plan.n_tiles > 1:
      # The consumer warpgroups; the producer moves on to the next row block.
      pl.when(self.wg < 2)(lambda: self._second_pass(self._row0(m_idx), tile_index))

  def finish(self):
    _cluster_final_sync(self.plan, self.ex, self.wg)


def _kernel(*refs, plan: _Plan):
  cfg = plan.cfg
  it = iter(refs)
  x_gmem, w_gmem = next(it), next(it)
  vec_gmems = [next(it) for _ in plan.vecs]
  res_gmem = next(it) if plan.has_residual else None
  y_gmem = next(it)
  extra_gmems = {e: next(it) for e in plan.extras}
  stat_gmems = [next(it) for _ in range(plan.n_stats)]  # rstd, then mean (LayerNorm)
  cta = lax.axis_index("cluster")
  gemm_core.run(
      plan.kloop, gmems=(x_gmem, w_gmem),
      windows=lambda t: [pl.ds(t.m_idx * cfg.tile_m, cfg.tile_m),
                         pl.ds((cta * plan.n_tiles + t.kind) * cfg.tile_n, cfg.tile_n)],
      schedule=_row_block_schedule(plan), smem=_smem(plan),
      hooks_for=lambda wg, refs: _RowNormHooks(
          plan, wg, cta, refs, (y_gmem, extra_gmems, stat_gmems, res_gmem, vec_gmems)))


def _check_args(x, w, vectors, residual, norm, eps, out_dtype):
  if norm not in ("rms", "layer"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"x must be (M, K) and w (K, N), got {x.shape} and {w.shape}")
  if x.dtype != w.dtype:
    raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
  m, k = x.shape
  n = w.shape[1]
  reason = unsupported_reason(m, k, n, x.dtype, out_dtype,
                              None if residual is None else residual.dtype)
  if reason is not None:
    raise ValueError(f"matmul_norm kernel cannot run this call: {reason}")
  if residual is not None and residual.shape != (m, n):
    raise ValueError(f"residual must have shape {(m, n)}, got {residual.shape}")
  for name, v in vectors.items():
    if v is not None and v.shape != (n,):
      raise ValueError(f"{name} must have shape ({n},), got {v.shape}")
  if not (isinstance(eps, (int, float)) and eps > 0):
    raise ValueError(f"eps must be a positive float, got {eps!r}")


EXCHANGES = cluster_exchange.EXCHANGES


def _pick_exchange(make_plan) -> _Plan:
  """The plan with the faster exchange measured on the H200 (benchmarks/NOTES.md, "Post-norm
  forward"): "push" for clusters of 2 where its inbox costs no pipeline stage, else "pull" (with
  clusters of 4 and 8 push loses a stage and is slower), also when the push inbox does not fit
  next to a caller's config.
  ``make_plan(exchange)`` builds one plan."""
  pull = make_plan("pull")
  if pull.cluster != 2:
    return pull
  try:
    push = make_plan("push")
  except ValueError:  # the inbox does not fit in SMEM next to this config: pull still does
    return pull
  return push if push.stages >= pull.stages else pull


def matmul_norm_fwd(x, w, dense_bias=None, residual=None, scale=None, bias=None, *, norm: str,
                    eps: float, out_dtype=None, return_h: bool = False,
                    return_xhat: bool = False, return_stats: bool = False,
                    interpret: bool = False, config: TileConfig | None = None,
                    exchange: str | None = None):
  """Forward of the post-norm GEMM as one Mosaic-GPU kernel (Hopper).

  Args:
    x: (M, K) bfloat16/float16; M ≥ 1, K a multiple of 64.
    w: (K, N) in x's dtype; N = c · n_tiles · tile_n with c ∈ {1, 2, 4, 8}, n_tiles ≤ 4
      (see :func:`pick_config`).
    dense_bias, scale, bias: optional (N,) vectors (float dtypes; used in float32).
    residual: optional (M, N) in the output dtype, added to h before the statistics.
    norm: "rms" or "layer". eps: positive float.
    out_dtype: dtype of y, h and x̂ (default x.dtype), bfloat16 or float16.
    return_h, return_xhat, return_stats: which optional outputs to write.
    interpret: run in Pallas GPU interpret mode on any backend (race detection on, NaN-filled
      uninitialized memory: :func:`pallas_norm.mgpu.interpret_params`). It runs one CTA
      per row block (it cannot read a peer CTA's shared memory), looping over up to 4 N tiles.
    config: tiling (``tile_n`` is the N slice of one CTA); default :func:`pick_config`.
    exchange: how a cluster's CTAs share their partial row statistics. None (the default):
      "push" for clusters of 2 when it costs no pipeline stage, else "pull"
      (:func:`_pick_exchange`). "pull": each reads its peers' partials through distributed
      shared memory, ordered by cluster barriers that release and acquire at cluster scope
      (:mod:`pallas_norm.mgpu.cluster_barrier`). "push": each
      sends its partials into every peer's shared memory with ``st.async`` stores that complete
      the peer's barrier; on the H200 it gives the same bits as pull (GPU tests, clusters of
      2-8, RMS and LayerNorm), 7% faster with clusters of 2 in the grid sweep, but its inbox
      (4 KB per CTA of the cluster) costs a pipeline stage with clusters of 4 and 8, where it
      is 3-10% slower (benchmarks/NOTES.md).

  Returns:
    ``(y, h, xhat, mean, rstd)``: y (M, N); h (the pre-norm stream) and xhat = (h − mean)·rstd
    (RMS: h·rstd) in out_dtype or None; mean (LayerNorm only) and rstd (M,) float32 or None.

  Raises:
    ValueError: shapes/dtypes the kernel does not support (:func:`unsupported_reason`), bad
      norm/eps, a config that does not fit in SMEM, or more than 4 N tiles per CTA.
    TypeError: x and w dtypes differ.
  """
  if exchange is not None and exchange not in EXCHANGES:
    raise ValueError(f"exchange must be None or one of {EXCHANGES}, got {exchange!r}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  _check_args(x, w, {"dense_bias": dense_bias, "scale": scale, "bias": bias}, residual, norm,
              eps, out_dtype)
  return launch(x, w, dense_bias, residual, scale, bias, norm=norm, eps=eps,
                out_dtype=out_dtype, return_h=return_h, return_xhat=return_xhat,
                return_stats=return_stats, interpret=interpret,
                config=config or pick_config(x.shape[0], x.shape[1], w.shape[1]),
                exchange=exchange)


def launch(x, w, dense_bias, residual, scale, bias, *, norm: str, eps: float, out_dtype,
           return_h: bool, return_xhat: bool, return_stats: bool, interpret: bool,
           config: TileConfig, exchange: str | None = None):
  """:func:`matmul_norm_fwd` on arguments its caller validated, with the ``config`` it picked:
  the public op checks its arguments and the kernel's :func:`unsupported_reason` once and
  computes the config once, then calls this. Same arguments and outputs (``out_dtype`` a
  dtype); ValueError only from the plan (a config that does not fit)."""
  m, k = x.shape
  n = w.shape[1]
  vectors = {"dense_bias": dense_bias, "scale": scale, "bias": bias}
  vecs = tuple(name for name, v in vectors.items() if v is not None)
  padded_m = m + (-m % _ROW_ALIGN)
  make_plan = functools.partial(_make_plan, (padded_m, k), n, x.dtype, out_dtype, norm, eps, vecs,
                                residual is not None, return_h, return_xhat, return_stats, config,
                                interpret)
  plan = (make_plan(exchange) if exchange is not None
          else _pick_exchange(make_plan))
  out_type = [jax.ShapeDtypeStruct((padded_m, n), out_dtype)]
  out_type += [jax.ShapeDtypeStruct((padded_m, n), out_dtype) for _ in plan.extras]
  out_type += [jax.ShapeDtypeStruct((padded_m,), jnp.float32) for _ in range(plan.n_stats)]
  call = gemm_core.kernel(functools.partial(_kernel, plan=plan), tuple(out_type),
                          num_ctas=plan.num_clusters, interpret=interpret, cluster=plan.cluster)
  pad = -m % _ROW_ALIGN
  args = [mgpu.pad_rows(x, pad), w]
  args += [vectors[name].astype(jnp.float32) for name in vecs]
  if residual is not None:
    args.append(mgpu.pad_rows(residual, pad))
  outs = [o[:m] if pad else o for o in call(*args)]
  y = outs.pop(0)
  extras = {e: outs.pop(0) for e in plan.extras}
  rstd = outs.pop(0) if plan.n_stats else None
  mean = outs.pop(0) if plan.n_stats == 2 else None
  return y, extras.get("h"), extras.get("xhat"), mean, rstd

