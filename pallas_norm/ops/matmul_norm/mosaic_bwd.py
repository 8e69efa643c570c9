"""The post-norm backward's norm backward fused into its dx GEMM: one Pallas Mosaic-GPU kernel
for Hopper (sm_90a), issue 22.

The backward of ``y = norm(h)·γ + β``, ``h = x @ w (+ residual)`` (DESIGN.md, op 2) with
``g = γ ⊙ dy`` and means over the N columns of a row,

    dh = rstd ⊙ (g − x̂ ⊙ mean_N(g ⊙ x̂) − mean_N(g))     (RMSNorm: no mean_N(g) term)
    dx = dh @ wᵀ,   dγ = Σ_i dy ⊙ x̂,   dβ = Σ_i dy,

is computed here as the GEMM ``dx = dh @ wᵀ`` whose A operand dh is built in registers, one K
step (a tile_k-wide slice of N) at a time, from the step's dy and x̂ tiles (the GEMM body's
``a_operand`` hook): dh never makes a round trip through HBM before the GEMM, and the separate
norm-backward pass (dy and x̂ read, dh written) is gone. The two row sums need whole rows of dy
and x̂ before the first dh tile, so the first column tile of each row block runs a *pre-pass*
over the same K steps first (``Tile.pre_pass``: the ring loads dy, x̂ and γ but not w): per-thread
partial row sums of ``g ⊙ x̂`` and ``g`` (:func:`pallas_norm.mgpu.lane_partial_sum`), reduced
across lanes once per row block. The second pass re-reads dy and x̂, mostly from L2 (a row block
of 128 rows × N = 512 is 256 KB of dy and x̂). The row terms go to SMEM for the row block's other
column tiles (K > tile_n), which skip the pre-pass.

The first column tile also writes dh (the operand of ``dw = xᵀ dh`` and the residual's
gradient) through one SMEM slot per warpgroup by TMA, and its pre-pass computes the column sums
on the tensor core, where nothing else runs during that pass: the product ``dy ⊙ x̂`` as two
bfloat16 parts (hi, lo = the rounding error of hi, so their sum keeps ~16 bits), written into
the pre-pass step's unused w stage buffer, and a one-hot A operand whose row t (t the K step)
is all ones, so ``acc[t] += Σ_rows(part)``: a (64, 64) float32 accumulator per warpgroup holds
the column sums of every K step of the row block (rows [0, R) for dγ, [R, 2R) for dβ = Σ dy
from the dy stage itself, R = N / tile_k). It is written per row block (hi and lo bfloat16
parts again) and summed by XLA (:func:`column_sums`).

Kernel structure: the GEMM body of :mod:`pallas_norm.mgpu.gemm` on the shared ring (steps
numbered across the CTA's tiles), persistent CTAs walking row blocks, each row block's column
tiles in turn (:func:`_schedule`); A from registers (no WGMMA left in flight across steps).

Shapes: bfloat16; N a multiple of 64 up to 2048 (the one-hot rows); K a multiple of 256 (a
column tile of 256: the w stage holds both warpgroups' product parts); on the GPU M a multiple
of 8 (tiled TMA of dy and x̂, which the column sums read as WGMMA's B operand).
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

__all__ = ["unsupported_reason", "dh_dx", "column_sums"]

_F32 = jnp.float32
TILE = TileConfig(tile_m=128, tile_n=256, tile_k=64, max_concurrent_steps=4, pipeline="ring")
"""The tiling: 128 rows (64 per consumer warpgroup), 256 columns of dx per tile, 64-wide steps
over N (one (64, 64) dh tile per warpgroup and step), as many ring stages as fit (3)."""
ONE_HOT_ROWS = 64
"""Rows of the column-sum accumulator (WGMMA's M): 2 · N / tile_k of them hold dγ and dβ."""


def unsupported_reason(m: int, n: int, k: int, dtype, interpret: bool = False) -> str | None:
  """None if :func:`dh_dx` can run dy (m, n), w (k, n), else why not."""
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return f"dtype {jnp.dtype(dtype)}: the fused backward is bfloat16 only"
  if n % TILE.tile_k or n // TILE.tile_k > ONE_HOT_ROWS:
    return f"N = {n}: the fused backward needs N a multiple of {TILE.tile_k} up to 4096"
  if k % TILE.tile_n:
    return f"K = {k}: the fused backward needs K a multiple of {TILE.tile_n}"
  if not interpret and m % 8:
    return f"M = {m}: the fused backward needs M a multiple of 8 on the GPU (tiled TMA)"
  return None


@dataclasses.dataclass(frozen=True)
class _Plan(gemm_core.KLoopFacts):
  m: int
  n: int
  k: int
  layer: bool  # the mean_N(g) term
  has_bias: bool  # dβ's column sums
  kloop: gemm_core.KLoop
  num_ctas: int

  @property
  def cfg(self) -> TileConfig:
    return self.kloop.cfg

  @property
  def m_iters(self) -> int:  # row blocks
    return -(-self.m // self.cfg.tile_m)

  @property
  def k_iters(self) -> int:  # column tiles of dx per row block
    return self.k // self.cfg.tile_n

  @property
  def red_iters(self) -> int:  # K steps over N
    return self.n // self.cfg.tile_k

  @property
  def n_sums(self) -> int:  # column sums: dγ (+ dβ)
    return 1 + int(self.has_bias)

  @property
  def col_rows(self) -> int:  # rows of a column-sum accumulator written per row block
    return -(-self.red_iters // 8) * 8


def _streams(cfg: TileConfig):
  """dy (tile_m, tile_k), w (tile_n, tile_k) read transposed, x̂ as dy, γ (1, tile_k) f32."""
  rows = gemm_core.Stream((cfg.tile_m, cfg.tile_k), jnp.bfloat16, 1,
                          mgpu.swizzle_transforms(cfg.tile_k, jnp.bfloat16))
  w = gemm_core.Stream((cfg.tile_n, cfg.tile_k), jnp.bfloat16, 1,
                       mgpu.swizzle_transforms(cfg.tile_k, jnp.bfloat16))
  return [rows, w, rows, gemm_core.Stream((1, cfg.tile_k), _F32, 1)]


def _smem(cfg: TileConfig) -> dict:
  """Per consumer warpgroup: one (64, 64) slot the dh, column-sum and dx stores go through (each
  use waits for the previous store to have read it), rstd of its rows (TMA) and its barrier, and
  the row terms (rstd, mean_N(g ⊙ x̂), mean_N(g)) the row block's later column tiles read."""
  wg_m = cfg.wg_tile_m
  return dict(
      slot=plgpu.SMEM((2, wg_m, cfg.tile_k), jnp.bfloat16,
                      transforms=mgpu.swizzle_transforms(cfg.tile_k, jnp.bfloat16)),
      rstd_smem=plgpu.SMEM((2, wg_m), _F32),
      rstd_barrier=plgpu.Barrier(num_arrivals=1, num_barriers=2),
      term_smem=plgpu.SMEM((2, 3, wg_m), _F32))


def _make_plan(m, n, k, layer, has_bias, interpret) -> _Plan:
  cfg = TILE
  kloop = gemm_core.plan_k_loop(cfg, _streams(cfg), n // cfg.tile_k, _smem(cfg),
                                pre_pass=True,
                                what=" next to the fused backward's slots")
  return _Plan(m=m, n=n, k=k, layer=layer, has_bias=has_bias, kloop=kloop,
               num_ctas=mgpu.persistent_clusters(1, -(-m // cfg.tile_m), interpret))


def _schedule(plan: _Plan) -> gemm_core.Schedule:
  """Each CTA walks row blocks; a row block's first column tile runs the pre-pass (row sums,
  column sums) and writes dh, its other column tiles read the row terms back from SMEM. Ring
  steps per row block: the pre-pass's, then each column tile's."""
  steps, k_iters = plan.red_iters, plan.k_iters

  def schedule(visit, end_unit):
    del end_unit

    @plgpu.nd_loop((plan.m_iters,), collective_axes="sm")
    def _row_block_loop(loop_info: plgpu.NDLoopInfo):
      (m_idx,) = loop_info.index
      i = loop_info.local_index
      last_block = i == loop_info.num_local_steps - 1
      base = i * steps * (1 + k_iters) + steps  # the first column tile's first K step
      visit(gemm_core.Tile(m_idx, 0, i * k_iters, i == 0, last_block & (k_iters == 1),
                           kind="first", pre_pass=True, first_step=base))
      if k_iters > 1:
        pl.loop(1, k_iters)(lambda j: visit(gemm_core.Tile(
            m_idx, j, i * k_iters + j, False, last_block & (j == k_iters - 1), kind="rest",
            first_step=base + j * steps)))
  return schedule


def _rows_bcast(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


class _Hooks(gemm_core.Hooks):
  """The fused backward on the GEMM body (module docstring). SMEM: :func:`_smem`."""

  def __init__(self, plan: _Plan, wg, refs, rstd_gmem, dx_gmem, dh_gmem, col_gmem):
    self.plan, self.wg = plan, wg
    self.rstd_gmem, self.dx_gmem, self.dh_gmem, self.col_gmem = (rstd_gmem, dx_gmem, dh_gmem,
                                                                 col_gmem)
    self.slot, self.rstd_smem = refs["slot"], refs["rstd_smem"]
    self.rstd_barrier, self.term_smem = refs["rstd_barrier"], refs["term_smem"]
    self._terms = None

  def _row0(self, tile):
    return tile.m_idx * self.plan.cfg.tile_m + self.wg * self.plan.cfg.wg_tile_m

  def _store_slot(self, value, dst, rows=None, when=True):
    """value (64, 64) through this warpgroup's slot to ``dst`` by TMA (``rows``: only the
    slot's first rows; ``when``: traced, whether to issue the store), once the previous store
    has read the slot."""
    slot = self._slot_operand(value)
    plgpu.commit_smem()
    pl.when(when)(lambda: plgpu.copy_smem_to_gmem(
        slot if rows is None else slot.at[pl.ds(0, rows)], dst))

  def _tiles(self, step):
    """This warpgroup's dy and x̂ tiles of the step (f32) and γ broadcast over its rows."""
    dy_stage, _, xh_stage, gamma_stage = step.stages
    dy = step.load(dy_stage).astype(_F32)
    xh = step.load(xh_stage).astype(_F32)
    gamma = plgpu.load(gamma_stage.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
    return dy, xh, lax.broadcast_in_dim(gamma, dy.shape, [1])

  def before_k_loop(self, tile):
    if tile.kind == "first":  # this row block's rstd, read at the end of the pre-pass
      rows = self.plan.cfg.wg_tile_m
      plgpu.copy_gmem_to_smem(self.rstd_gmem.at[pl.ds(self._row0(tile), rows)],
                              self.rstd_smem.at[self.wg], self.rstd_barrier.at[self.wg])

  # -- the pre-pass: row sums and column sums --------------------------------------------------

  def _slot_operand(self, value):
    """This warpgroup's slot holding ``value`` (64, 64), as a WGMMA operand: written once the
    previous TMA store has read the slot (the WGMMAs that read it completed in their step)."""
    slot = self.slot.at[self.wg]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    slot[...] = value
    return slot

  def _pre_step(self, step, carry):
    plan, wg, wg_m = self.plan, self.wg, self.plan.cfg.wg_tile_m
    col_accs, s_gx, s_g = carry[:plan.n_sums], carry[plan.n_sums], carry[plan.n_sums + 1:]
    dy, xh, gamma = self._tiles(step)
    g = dy * gamma
    s_gx = s_gx + mgpu.lane_partial_sum(g * xh)
    if plan.layer:
      s_g = (s_g[0] + mgpu.lane_partial_sum(g),)
    # Σ_rows dy ⊙ x̂ on the tensor core, from two bf16 parts in the (unloaded) w stage buffer:
    # rows [128·wg, 128·wg + 64) hold hi, the next 64 lo.
    prod = dy * xh
    hi = prod.astype(jnp.bfloat16)
    lo = (prod - hi.astype(_F32)).astype(jnp.bfloat16)
    w_stage = step.stages[1]
    parts = [w_stage.at[pl.ds(wg * 2 * wg_m + p * wg_m, wg_m)] for p in range(2)]
    parts[0][...] = hi
    parts[1][...] = lo
    # A: the one-hot (row k_idx all ones) in the slot (WGMMA's A from registers does not run
    # in interpret mode).
    rows = lax.broadcasted_iota(jnp.int32, (ONE_HOT_ROWS, wg_m), 0)
    one_hot = self._slot_operand(plgpu.layout_cast(
        jnp.where(rows == step.k_idx, 1.0, 0.0).astype(jnp.bfloat16), plgpu.Layout.WGMMA))
    plgpu.commit_smem()  # the parts and the one-hot are visible to WGMMA (async proxy)
    for part in parts:
      plgpu.wgmma(col_accs[0], one_hot, part)
    if plan.has_bias:  # Σ_rows dy from the dy stage itself
      plgpu.wgmma(col_accs[1], one_hot, step.stages[0].at[step.rows])
    plgpu.wgmma_wait(0)  # the stage and the slot are free after this step
    return (*col_accs, s_gx, *s_g)

  def pre_pass(self, tile, run_steps):
    plan, wg = self.plan, self.wg
    wg_m = plan.cfg.wg_tile_m

    def scoped(*col_accs):
      zeros = mgpu.lane_partial_zeros(wg_m)
      out = run_steps(self._pre_step, (*col_accs, zeros) + ((zeros,) if plan.layer else ()))
      col_accs, s_gx, *s_g = out[:plan.n_sums], out[plan.n_sums], *out[plan.n_sums + 1:]
      for i, col_acc in enumerate(col_accs):
        cols = col_acc[...]
        hi = cols.astype(jnp.bfloat16)
        lo = (cols - hi.astype(_F32)).astype(jnp.bfloat16)
        for p, part in enumerate((hi, lo)):
          self._store_slot(part, self.col_gmem.at[tile.m_idx, wg, 2 * i + p],
                           rows=plan.col_rows)
      inv_n = 1.0 / plan.n
      gx_mean = jnp.sum(s_gx, axis=1) * inv_n
      return (gx_mean, jnp.sum(s_g[0], axis=1) * inv_n) if plan.layer else (gx_mean,)

    means = pl.run_scoped(
        scoped, *[plgpu.ACC((ONE_HOT_ROWS, plan.cfg.tile_k), _F32)] * plan.n_sums)
    plgpu.barrier_wait(self.rstd_barrier.at[wg])
    rstd = plgpu.load(self.rstd_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    terms = (rstd, *means)
    for i, v in enumerate(terms):
      self.term_smem[wg, i] = v
    plgpu.commit_smem()
    self._terms = terms

  # -- the GEMM: dh built as the A operand ----------------------------------------------------

  def init_carry(self, tile):
    if tile.kind == "first":
      return self._terms
    load = lambda i: plgpu.load(self.term_smem.at[self.wg, i],
                                layout=plgpu.Layout.WGMMA.reduce(1))
    return tuple(load(i) for i in range(2 + int(self.plan.layer)))

  def a_operand(self, tile, step, carry):
    rstd, gx_mean, *g_mean = carry
    dy, xh, gamma = self._tiles(step)
    d = dy * gamma - xh * _rows_bcast(gx_mean, dy.shape)
    if self.plan.layer:
      d = d - _rows_bcast(g_mean[0], dy.shape)
    dh = self._slot_operand((d * _rows_bcast(rstd, dy.shape)).astype(jnp.bfloat16))
    plgpu.commit_smem()
    return dh

  def k_step(self, tile, step, carry):
    if tile.kind == "first":  # dh for dw = xᵀ dh, stored from the slot while the WGMMA runs
      cfg = self.plan.cfg
      row0 = self._row0(tile)
      pl.when(row0 < self.plan.m)(lambda: plgpu.copy_smem_to_gmem(  # none wholly past M
          self.slot.at[self.wg], self.dh_gmem.at[pl.ds(row0, cfg.wg_tile_m),
                                                 pl.ds(step.k_idx * cfg.tile_k, cfg.tile_k)]))
    return carry

  def epilogue(self, tile, acc, carry):
    cfg = self.plan.cfg
    row0, chunk = self._row0(tile), cfg.tile_k
    for c in range(cfg.tile_n // chunk):
      self._store_slot(acc[:, c * chunk:(c + 1) * chunk].astype(jnp.bfloat16),
                       self.dx_gmem.at[pl.ds(row0, cfg.wg_tile_m),
                                       pl.ds(tile.n_idx * cfg.tile_n + c * chunk, chunk)],
                       when=row0 < self.plan.m)


def _kernel(dy_gmem, w_gmem, xh_gmem, gamma_gmem, rstd_gmem, dx_gmem, dh_gmem, col_gmem, *,
            plan: _Plan):
  cfg = plan.cfg
  block = lambda t: pl.ds(t.m_idx * cfg.tile_m, cfg.tile_m)
  gemm_core.run(
      plan.kloop, gmems=(dy_gmem, w_gmem, xh_gmem, gamma_gmem),
      windows=lambda t: [block(t), pl.ds(t.n_idx * cfg.tile_n, cfg.tile_n), block(t), None],
      schedule=_schedule(plan), smem=_smem(cfg),
      hooks_for=lambda wg, refs: _Hooks(plan, wg, refs, rstd_gmem, dx_gmem, dh_gmem, col_gmem))


def dh_dx(dy, xhat, w, rstd, scale=None, *, norm: str, norm_bias: bool,
          interpret: bool = False):
  """The post-norm backward's dh, dx and column-sum partials in one kernel (module docstring).

  Args:
    dy: (M, N) bfloat16 cotangent of y. xhat: (M, N) bfloat16, the forward's saved x̂.
    w: (K, N) bfloat16, the forward's weight (dx = dh @ wᵀ).
    rstd: (M,) float32 saved rstd. scale: (N,) γ or None (ones).
    norm: "layer" or "rms". norm_bias: whether to compute dβ's column sums.
    interpret: GPU interpret mode.

  Returns:
    (dx (M, K), dh (M, N)) bfloat16 and the column-sum partials for :func:`column_sums`.

  Raises:
    ValueError: a call :func:`unsupported_reason` refuses, or mismatched shapes/dtypes.
  """
  m, n = dy.shape
  k = w.shape[0]
  if xhat.shape != (m, n) or w.shape != (k, n) or rstd.shape != (m,):
    raise ValueError(f"expected dy, x̂ (M, N), w (K, N), rstd (M,); got {dy.shape}, "
                     f"{xhat.shape}, {w.shape}, {rstd.shape}")
  if not dy.dtype == xhat.dtype == w.dtype:
    raise ValueError(f"dy, x̂ and w must share a dtype, got {dy.dtype}, {xhat.dtype}, {w.dtype}")
  if (reason := unsupported_reason(m, n, k, dy.dtype, interpret)) is not None:
    raise ValueError(f"the fused post-norm backward cannot run this call: {reason}")
  plan = _make_plan(m, n, k, norm == "layer", norm_bias, interpret)
  m_pad = plan.m_iters * plan.cfg.tile_m
  rstd = jnp.pad(rstd.astype(_F32), (0, m_pad - m))
  gamma = (jnp.ones((n,), _F32) if scale is None else scale.astype(_F32)).reshape(1, n)
  out = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
         jax.ShapeDtypeStruct((plan.m_iters, 2, 2 * plan.n_sums, plan.col_rows, plan.cfg.tile_k),
                              jnp.bfloat16))
  call = gemm_core.kernel(functools.partial(_kernel, plan=plan), out, num_ctas=plan.num_ctas,
                          interpret=interpret)
  return call(dy, w, xhat, gamma, rstd)


def column_sums(partials, n: int, norm_bias: bool) -> dict:
  """{"dscale": Σ_i dy ⊙ x̂ (+ "dbias": Σ_i dy)} (N,) float32 from :func:`dh_dx`'s partials:
  per row block and warpgroup, two bfloat16 parts of a float32 (rows, tile_k) block whose row t
  holds K step t's columns."""
  steps = n // TILE.tile_k
  parts = partials.astype(_F32)
  total = lambda i: jnp.sum(parts[:, :, 2 * i:2 * i + 2], axis=(0, 1, 2))[:steps].reshape(n)
  out = {"dscale": total(0)}
  if norm_bias:
    out["dbias"] = total(1)
  return out
