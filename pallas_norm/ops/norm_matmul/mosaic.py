"""Lazy pre-norm GEMM forward as a Pallas Mosaic-GPU kernel for Hopper (sm_90a).

Computes, for x (M, K) and a weight with the norm's affine already folded in
(``w_gamma = diag(scale) w``, ``col_sum = 1ᵀ w_gamma``, ``out_bias = biasᵀ w``)::

    rms:   y = rstd ⊙_rows (x @ w_gamma) + out_bias
    layer: y = rstd ⊙_rows (x @ w_gamma − mean ⊗ col_sum) + out_bias

without ever writing norm(x) (DESIGN.md, op 1). The row statistics come from the A tiles that
the K loop already holds in shared memory; the epilogue applies them to the f32 accumulator.

Kernel structure: the GEMM body of :mod:`pallas_norm.mgpu.gemm` (persistent grid over the (M, N)
output tiles, a TMA producer warpgroup, two WGMMA consumer warpgroups that split a tile along M,
so each row's statistics are accumulated by exactly one warpgroup) with the hooks of
:class:`_LazyNormHooks`: after issuing a K step's WGMMA, a consumer loads its rows of the A tile
from SMEM into registers (the WGMMA layout) and accumulates the statistics while the tensor core
runs; the epilogue computes mean/rstd, applies them and the column vectors (col_sum, out_bias,
fetched by TMA while the K loop runs) and stores y through SMEM with TMA; the statistics of a
row block are written by the CTA that computes its first N tile. The K loop runs on the shared
ring (:class:`pallas_norm.mgpu.SharedRing`) with one WGMMA in flight (:func:`pick_config`).

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
A row of one constant has var exactly 0 (the shifted sums are exact) and the ratio is infinite:
there the epilogue multiplies by 0 instead of rstd (:func:`_epilogue_rstd`), so y = out_bias.

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
from pallas_norm.mgpu import gemm as gemm_core

__all__ = ["TileConfig", "unsupported_reason", "pick_config", "norm_matmul_fwd", "gemm", "launch",
           "NORMS"]

NORMS = ("rms", "layer")
"""``norm`` values: RMSNorm, LayerNorm."""


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
  128-byte swizzle row of bf16), as many pipeline stages as fit in SMEM (at most 4), all from
  the shared ring with one WGMMA in flight (``pipeline="ring"``, ``delay_release=1``), which
  lets the statistics overlap the tensor core where they run in every K loop (faster for
  RMSNorm, noise level for LayerNorm) and is 1-2% faster than Pallas's pipeline with
  ``stats_once`` (measured: ``benchmarks/NOTES.md``, "Pre-norm forward";
  ``benchmarks/EXPERIMENTS.md``, Pallas's pipeline). ``stats_once`` when N has several tiles, M
  at least :data:`STATS_ONCE_MIN_ROW_BLOCKS` row blocks, and the row blocks in flight fit
  :data:`STATS_ONCE_MAX_X_BYTES`. Epilogue tiles 64×64, or 64×32 when that leaves room for a
  stage count that divides the K steps where 64×64 does not (at 128×256 tiles and K = 512,
  64×64 slots leave 3 stages, 64×32 ones 4): the rule of Pallas's chained pipelines, kept
  because these are the tilings measured on the ring.
  """
  tile_n = _pick_tile_n(n)
  tile_m = 256 if tile_n <= 128 else 128
  # Several N tiles and many row blocks: a CTA sweeps its row block's N tiles and computes the
  # statistics once (faster at K = 512 and 1024); with few row blocks sweeping would leave SMs
  # idle, and when the row blocks in flight outgrow L2 their re-reads go to HBM (slower at
  # K = 2048). Measured: benchmarks/NOTES.md, "Pre-norm forward".
  stats_once = (-(-n // tile_n) > 1 and -(-m // tile_m) >= STATS_ONCE_MIN_ROW_BLOCKS
                and 132 * tile_m * k * 2 <= STATS_ONCE_MAX_X_BYTES)
  base = TileConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                    epi_tile_m=64, epi_tile_n=64, stats_once=stats_once, pipeline="ring",
                    delay_release=1)
  narrow = dataclasses.replace(base, epi_tile_n=32)
  return narrow if _chained_stages(narrow, k) > _chained_stages(base, k) else base


def _chained_stages(cfg: TileConfig, k: int) -> int:
  """Stages of a chained pipeline for cfg (Pallas's rule: a count that divides the K steps), with
  the most SMEM any call takes besides the stages (LayerNorm, bias, bf16 output)."""
  fit = gemm_core.fit_stages(cfg, _streams(cfg, jnp.bfloat16, False),
                             _smem(cfg, jnp.bfloat16, 2, _n_stat_slots("layer")))
  stages, chained = mgpu.pipeline_stages(max(k // cfg.tile_k, 1),
                                         min(cfg.max_concurrent_steps, fit))
  return stages if chained else 0


@dataclasses.dataclass(frozen=True)
class _Plan(gemm_core.NormGemmPlan):
  """Static facts of one kernel instance (``norm`` None: the plain GEMM, :func:`gemm`)."""
  has_bias: bool
  kloop: gemm_core.KLoop
  num_ctas: int  # persistent CTAs
  epi_n: int  # epilogue tile width: one 128-byte swizzle span of out_dtype at most
  out_slots: int  # epilogue output slots per consumer warpgroup

  @property
  def n_vecs(self) -> int:  # col_sum and/or out_bias rows in the per-warpgroup vector buffer
    return int(self.norm == "layer") + int(self.has_bias)

  @property
  def n_stats(self) -> int:  # rstd (and mean) written per row
    return _n_stats(self.norm)

  @property
  def n_iters(self) -> int:
    return -(-self.n // self.cfg.tile_n)


def _n_stats(norm) -> int:
  return {"rms": 1, "layer": 2, None: 0}[norm]


def _n_stat_slots(norm) -> int:
  # LayerNorm keeps a third row vector in SMEM, the epilogue's rstd (:func:`_finalize_stats`).
  return {"rms": 1, "layer": 3, None: 0}[norm]


def _epi_tile_n(cfg: TileConfig, out_dtype) -> int:
  # The output stage is swizzled but untiled: one row must fit in a 128-byte swizzle span.
  return min(cfg.epi_tile_n, 128 // jnp.dtype(out_dtype).itemsize)


OUT_SLOTS = 2
"""SMEM slots per consumer warpgroup for the epilogue's output tiles (JAX's Hopper matmul): an
epilogue tile waits until the TMA store of the tile two before it has read its slot."""


def _out_slots(cfg: TileConfig, out_dtype) -> int:
  chunks = (cfg.wg_tile_m * cfg.tile_n) // (cfg.epi_tile_m * _epi_tile_n(cfg, out_dtype))
  return min(OUT_SLOTS, chunks)


def _streams(cfg: TileConfig, dtype, a_in_registers: bool) -> list[gemm_core.Stream]:
  """x (tile_m, tile_k) and w (tile_k, tile_n) per K step. The x stages are tiled for WGMMA,
  or swizzle-only (a plain 2-D TMA box: any M) when WGMMA reads x from registers."""
  return [gemm_core.Stream((cfg.tile_m, cfg.tile_k), dtype, 1, mgpu.swizzle_transforms(
              cfg.tile_k, dtype, tiled=not a_in_registers)),
          gemm_core.Stream((cfg.tile_k, cfg.tile_n), dtype, 0,
                           mgpu.swizzle_transforms(cfg.tile_k, dtype))]


def _smem(cfg: TileConfig, out_dtype, n_vecs: int, n_stat_slots: int) -> dict:
  """SMEM besides the stages, per consumer warpgroup: the epilogue's output slots (untiled, so
  a TMA store needs no M % 8 == 0), the N tile's column vectors and their barrier (one
  arrival per vector copy), the row statistics of the row block (:func:`_n_stat_slots`)."""
  epi_n = _epi_tile_n(cfg, out_dtype)
  return dict(
      out_smem=plgpu.SMEM((2, _out_slots(cfg, out_dtype), cfg.epi_tile_m, epi_n), out_dtype,
                          transforms=mgpu.swizzle_transforms(epi_n, out_dtype, tiled=False)),
      vec_smem=plgpu.SMEM((2, n_vecs, cfg.tile_n), jnp.float32) if n_vecs else None,
      vec_barrier=plgpu.Barrier(num_arrivals=n_vecs, num_barriers=2) if n_vecs else None,
      stat_smem=(plgpu.SMEM((2, n_stat_slots, cfg.wg_tile_m), jnp.float32) if n_stat_slots
                 else None))


def _make_plan(m, k, n, dtype, out_dtype, norm, eps, has_bias, cfg, interpret) -> _Plan:
  if norm is None and cfg.stats_once:
    raise ValueError("stats_once needs statistics: the plain GEMM has none")
  n_vecs = int(norm == "layer") + int(has_bias)
  # Mosaic's tiled TMA (the SMEM layout WGMMA reads A from) needs M % 8 == 0 on the GPU; other M
  # stream x untiled and give WGMMA the registers the statistics load anyway. Interpret mode has
  # no tiled-TMA restriction (and cannot run register-A WGMMA).
  a_in_registers = not interpret and m % 8 != 0
  kloop = gemm_core.plan_k_loop(cfg, _streams(cfg, dtype, a_in_registers), k // cfg.tile_k,
                                _smem(cfg, jnp.dtype(out_dtype), n_vecs, _n_stat_slots(norm)),
                                a_in_registers=a_in_registers)
  # Work units of the persistent loop: (row block, N tile), or row blocks alone when a CTA
  # sweeps all N tiles of its row block (stats_once).
  m_iters = -(-m // cfg.tile_m)
  units = m_iters if cfg.stats_once else m_iters * -(-n // cfg.tile_n)
  return _Plan(m=m, k=k, n=n, dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(out_dtype), norm=norm,
               eps=float(eps), has_bias=has_bias, cfg=cfg, kloop=kloop,
               num_ctas=mgpu.persistent_clusters(1, units, interpret),
               epi_n=_epi_tile_n(cfg, out_dtype), out_slots=_out_slots(cfg, out_dtype))


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
  """(mean or None, rstd, var or None) row vectors (layout WGMMA.reduce(1)) from the accumulated
  sums."""
  k, eps = plan.k, plan.eps
  if plan.norm == "rms":
    (s2,) = stats
    return None, lax.rsqrt(jnp.sum(s2, axis=1) * (1.0 / k) + eps), None
  shift, s1, s2 = stats
  # Chan et al.: merge the (count, mean, M2) of the 8 lane columns, count = K / 8 each.
  cnt = k // mgpu.LANE_COLS
  lane_mean = shift + s1 * (1.0 / cnt)
  # s1 · (s1 / cnt), not s1² / cnt: s1² overflows float32 for rows of ~3e17 (K = 512) while
  # s2 and the result are still finite. Where s2 itself overflows (|x − shift| ≳ 1e19) the
  # product may too: M2 is +inf there (rstd = 0, y = out_bias, as the reference's centred
  # squares give), not inf − inf = NaN.
  lane_m2 = jnp.where(s2 < jnp.inf, s2 - s1 * (s1 * (1.0 / cnt)), s2)
  mean = jnp.sum(lane_mean, axis=1) * (1.0 / mgpu.LANE_COLS)
  dev = lane_mean - _rowvec(mean, lane_mean.shape)
  m2 = jnp.sum(lane_m2, axis=1) + jnp.sum(dev * dev, axis=1) * float(cnt)
  var = jnp.maximum(m2 * (1.0 / k), 0.0)
  return mean, lax.rsqrt(var + eps), var


def _epilogue_rstd(rstd, var):
  """The rstd the lazy form multiplies by: 0 on a constant row (var exactly 0: every x − shift
  is 0, so the shifted sums are exact), whose true x̂ is 0 and y = out_bias. There the lazy
  form's acc − mean·col_sum is f32 rounding of |mean|·|col_sum| scaled by rsqrt(eps), an error
  that grew with the constant (0.24 at 1e3 on outputs of 0.34, eps 1e-6); bf16 rows of a large
  constant plus small noise round to such rows."""
  return jnp.where(var == 0.0, 0.0, rstd)  # a NaN variance keeps its NaN rstd


# ------------------------------------------------------------------------------------------------
# The kernel: the GEMM body of pallas_norm.mgpu.gemm with the statistics and lazy-norm hooks.


def _row_block_schedule(plan: _Plan) -> gemm_core.Schedule:
  """stats_once: a CTA sweeps all N tiles of its row blocks; only the first N tile's K loop
  reads x for the statistics (``Tile.kind`` True), the others read them back from SMEM."""
  def schedule(visit, end_unit):
    del end_unit

    @plgpu.nd_loop((plan.m_iters,), collective_axes="sm")
    def _row_block_loop(loop_info: plgpu.NDLoopInfo):
      (m_idx,) = loop_info.index
      before = loop_info.local_index * plan.n_iters
      first_block = loop_info.local_index == 0
      last_block = loop_info.local_index == loop_info.num_local_steps - 1
      visit(gemm_core.Tile(m_idx, 0, before, first_block, last_block & (plan.n_iters == 1),
                           kind=True))
      if plan.n_iters > 1:
        pl.loop(1, plan.n_iters)(lambda n_idx: visit(gemm_core.Tile(
            m_idx, n_idx, before + n_idx, False, last_block & (n_idx == plan.n_iters - 1),
            kind=False)))
  return schedule


class _LazyNormHooks(gemm_core.Hooks):
  """The pre-norm forward on the GEMM body: the row statistics of each K step's A tile (tiles
  of kind True), the column vectors loaded while the K loop runs, and the lazy-norm epilogue
  (``rstd ⊙ acc − mean·rstd ⊗ col_sum + out_bias``, stored through SMEM slots by TMA). SMEM:
  :func:`_smem`."""

  def __init__(self, plan: _Plan, wg, refs, y_gmem, stat_gmems, vec_gmems):
    self.plan, self.wg, self.y_gmem, self.vec_gmems = plan, wg, y_gmem, vec_gmems
    self.stat_gmems = stat_gmems  # rstd, mean (None: not written)
    self.out_smem, self.vec_smem = refs["out_smem"], refs["vec_smem"]
    self.vec_barrier, self.stat_smem = refs["vec_barrier"], refs["stat_smem"]

  def _with_stats(self, tile) -> bool:
    return tile.kind and self.plan.norm is not None

  def _row0(self, tile):  # first row of this warpgroup
    return tile.m_idx * self.plan.cfg.tile_m + self.wg * self.plan.cfg.wg_tile_m

  def before_k_loop(self, tile):
    # The column vectors of this N tile arrive while the K loop runs.
    tile_n = self.plan.cfg.tile_n
    for i, v_gmem in enumerate(self.vec_gmems):
      plgpu.copy_gmem_to_smem(v_gmem.at[pl.ds(tile.n_idx * tile_n, tile_n)],
                              self.vec_smem.at[self.wg, i], self.vec_barrier.at[self.wg])

  def init_carry(self, tile):
    return _init_stats(self.plan) if self._with_stats(tile) else ()

  def k_step(self, tile, step, carry):
    if not self._with_stats(tile):
      return carry
    return _update_stats(self.plan, carry, step.a().astype(jnp.float32), step.k_idx)

  def _row_stats(self, tile, stats):
    """(the epilogue's rstd, mean or None) of this warpgroup's rows; stat_smem holds rstd (and
    mean, and the epilogue's rstd) afterwards."""
    plan, wg, stat_smem = self.plan, self.wg, self.stat_smem
    if not self._with_stats(tile):
      load = lambda i: plgpu.load(stat_smem.at[wg, i], layout=plgpu.Layout.WGMMA.reduce(1))
      return (load(0), None) if plan.norm == "rms" else (load(2), load(1))
    mean, rstd, var = _finalize_stats(plan, stats)
    row_vecs = [rstd] if mean is None else [rstd, mean, _epilogue_rstd(rstd, var)]
    for i, v in enumerate(row_vecs):
      stat_smem[wg, i] = v
    plgpu.commit_smem()
    row0 = self._row0(tile)

    # Every N tile has the statistics; the first one writes them (unless all its rows are
    # past M: a bulk copy clamped to 0 bytes is best not issued).
    @pl.when((tile.n_idx == 0) & (row0 < plan.m))
    def _store_stats():
      for i, dst in enumerate(self.stat_gmems[:plan.n_stats]):
        plgpu.copy_smem_to_gmem(stat_smem.at[wg, i], dst.at[pl.ds(row0, plan.cfg.wg_tile_m)])

    return row_vecs[-1], mean

  def epilogue(self, tile, acc, stats):
    plan, wg, cfg = self.plan, self.wg, self.plan.cfg
    wg_m, tile_n, epi_m, epi_n = cfg.wg_tile_m, cfg.tile_n, cfg.epi_tile_m, plan.epi_n
    out_slots, chunks = plan.out_slots, (wg_m // epi_m) * (tile_n // epi_n)
    row0, col0 = self._row0(tile), tile.n_idx * tile_n
    # Earlier TMA stores from out_smem / stat_smem must have read them before we overwrite.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if plan.norm is not None:
      row_rstd, mean = self._row_stats(tile, stats)
      rstd = _rowvec(row_rstd, acc.shape)
      if mean is not None:
        neg_mean_rstd = _rowvec(-mean * row_rstd, acc.shape)
    if plan.n_vecs:
      plgpu.barrier_wait(self.vec_barrier.at[wg])
    col_vec = lambda i, ns: lax.broadcast_in_dim(plgpu.load(
        self.vec_smem.at[wg, i, ns], layout=plgpu.Layout.WGMMA.reduce(0)), (epi_m, epi_n), [1])
    for ei in range(wg_m // epi_m):
      for ej in range(tile_n // epi_n):
        ms, ns = slice(ei * epi_m, (ei + 1) * epi_m), slice(ej * epi_n, (ej + 1) * epi_n)
        # The column terms first, then one multiply-add with the accumulator: two FMAs an
        # element for LayerNorm with a bias (−mean·rstd·col_sum + out_bias, then acc·rstd +
        # that), one for RMSNorm with a bias; one operation fewer than scaling acc first.
        terms = None
        if plan.norm == "layer":  # vector 0: col_sum
          terms = neg_mean_rstd[ms, ns] * col_vec(0, ns)
        if plan.has_bias:  # the last vector: out_bias
          bias = col_vec(plan.n_vecs - 1, ns)
          terms = bias if terms is None else terms + bias
        y = acc[ms, ns] if plan.norm is None else acc[ms, ns] * rstd[ms, ns]
        if terms is not None:
          y = y + terms
        slot = (ei * (tile_n // epi_n) + ej) % out_slots
        if out_slots < chunks:  # else every slot was freed by the wait above
          plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
        self.out_smem[wg, slot] = y.astype(plan.out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            self.out_smem.at[wg, slot],
            self.y_gmem.at[pl.ds(row0 + ei * epi_m, epi_m), pl.ds(col0 + ej * epi_n, epi_n)])


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
  gemm_core.run(
      plan.kloop, gmems=(x_gmem, w_gmem),
      windows=lambda t: [pl.ds(t.m_idx * cfg.tile_m, cfg.tile_m),
                         pl.ds(t.n_idx * cfg.tile_n, cfg.tile_n)],
      schedule=(_row_block_schedule(plan) if cfg.stats_once
                else gemm_core.tile_grid(plan.m_iters, plan.n_iters, kind=True)),
      smem=_smem(cfg, plan.out_dtype, plan.n_vecs, _n_stat_slots(plan.norm)),
      hooks_for=lambda wg, refs: _LazyNormHooks(plan, wg, refs, y_gmem, (rstd_gmem, mean_gmem),
                                                vec_gmems))


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
  tiling: :func:`gemm_config`.

  Raises:
    ValueError / TypeError: as :func:`norm_matmul_fwd`.
  """
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  m, k = x.shape
  n = w.shape[1]
  _check_args(x, w, None, None, "rms", 1.0, out_dtype)
  return launch(x, w, None, None, norm=None, eps=1.0, out_dtype=out_dtype, interpret=interpret,
                config=config or gemm_config(m, k, n))[0]


def gemm_config(m: int, k: int, n: int) -> TileConfig:
  """:func:`pick_config`'s tiles without the statistics, on the shared ring without a WGMMA in
  flight: with nothing to overlap in the K loop, one WGMMA in flight was slightly slower than
  none on the H200, and none tied Pallas's pipeline (``benchmarks/NOTES.md``, "Our GEMM
  alone")."""
  return dataclasses.replace(pick_config(m, k, n), stats_once=False, delay_release=0)


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
  call = gemm_core.kernel(functools.partial(_kernel, plan=plan), tuple(out_type),
                          num_ctas=plan.num_ctas, interpret=interpret)
  args = [a for a in (x, w_gamma, col_sum, out_bias) if a is not None]
  outs = call(*args)
  y = outs[0]
  rstd = outs[1][:m] if norm is not None else None
  mean = outs[2][:m] if norm == "layer" else None
  return y, mean, rstd
