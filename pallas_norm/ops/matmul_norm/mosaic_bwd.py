"""The post-norm GEMM's whole backward at K = N = 128 as one Mosaic-GPU kernel (sm_90a).

For ``h = x @ w (+ dense_bias) (+ residual)``, ``y = norm(h)·scale + bias`` (no returned h) the
backward needs dh = rstd ⊙ (g − x̂ ⊙ mean_N(g ⊙ x̂) − mean_N(g)) with g = scale ⊙ dy (RMSNorm
without the last term; DESIGN.md, op 2), dx = dh wᵀ, dw = xᵀ dh, dscale = Σ_i dy ⊙ x̂ and dbias
= Σ_i dy (and d(dense_bias) = Σ_i dh). Where a 128-row block's whole rows fit one CTA (N = 128)
this kernel does all of it from x, dy (a residual) and the forward's statistics, so the forward
saves no x̂ and the backward moves x, dy → dx: 3 tensors of M × 128 instead of 7 (the
norm-backward row kernel, then cuBLAS's dx and dw; ``benchmarks/NOTES.md``, "Open questions");
with a residual x, residual, dy → dx, d(residual) = dh: 5 instead of 8.

Per row block (a persistent CTA walks them; a TMA producer streams the block's x and dy and its
rstd (and mean) through a ring of stages; w and scale stay in SMEM), each of the two consumer
warpgroups, on its 64 rows:

1. h = x w by WGMMA (the forward's product, recomputed; + the residual, TMA'd into its dh rows,
   for the CTA's next block at the end of the one before), x̂ = (h − mean) ⊙ rstd;
2. g = scale ⊙ dy and the two row sums over N, dh in f32, written in x's dtype into a shared
   (128, 128) dh tile (and stored by TMA as d(residual));
3. Σ dy ⊙ x̂ and Σ dy over its rows, from dy (the stage) and x̂ (staged in its rows of the dh
   tile) read transposed, added in f32 to per-consumer rows in SMEM;
4. after both consumers' dh rows are in SMEM (barrier ``ready``): dx = dh wᵀ (its rows; B is w
   read transposed) and dw[64w : 64w + 64] += x[:, 64w : 64w + 64]ᵀ dh (A: its 64 columns of
   the x stage read transposed, B: the whole dh tile), into an accumulator that lives across
   the CTA's blocks;
5. after both consumers' WGMMAs are done (barrier ``done``): dx written over its dh rows and
   stored by TMA.

At the end each consumer stores its rows of the CTA's dw partial and its column sums; XLA adds
the CTAs' partials. x̂ is rounded to x's dtype as the row-kernel path's saved x̂ is, but from the
recomputed h (the same product, summed in another order), so the gradients differ from that
path's in the last bits. The fixed tiles (w, dh, the column sums) are indexed through
:func:`mgpu.opaque_zero` of the block: hoisted out of the block loop, their addresses made ptxas
spill 116 / 132 B (0 with the index; ptxas on the CPU, "How to A/B" in ``benchmarks/NOTES.md``).
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
from pallas_norm.mgpu import gemm as gemm_core

__all__ = ["WIDTH", "unsupported_reason", "backward"]

WIDTH = 128
"""K = N of the shapes the kernel takes: a row block's whole rows (N) and the x block (K) in one
stage, and dw's (K, N) partial in 64 registers a consumer thread."""

TILE_M = 128
STORE_N = 32  # f32 columns of dw per TMA store of the partial (16 KiB of SMEM)
CHUNK = 64  # columns of a row's f32 work at a time (one swizzle tile of the dh tile)


def unsupported_reason(m: int, k: int, n: int, dtype) -> str | None:
  """None if :func:`backward` runs for x (m, k), w (k, n) in ``dtype``, else why not: K = N =
  :data:`WIDTH`, bfloat16/float16, M a multiple of 8 (Mosaic's tiled TMA of the x and dy
  blocks)."""
  if k != WIDTH or n != WIDTH:
    return f"K = N = {WIDTH} only, got K = {k}, N = {n}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"bfloat16 or float16 only, got {jnp.dtype(dtype).name}"
  if m % 8:
    return f"M = {m} is not a multiple of 8"
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  m: int
  dtype: jnp.dtype
  layer: bool
  has_scale: bool
  has_residual: bool
  has_dense_bias: bool
  stages: int
  num_ctas: int

  @property
  def n_cols(self) -> int:  # column sums: Σ dy ⊙ x̂, Σ dy (+ Σ dh for the dense bias)
    return 2 + int(self.has_dense_bias)

  @property
  def m_iters(self) -> int:
    return -(-self.m // TILE_M)


def _smem(plan: _Plan) -> dict:
  """SMEM besides the ring: w (and scale) resident, the dh tile (dx is staged over it), the
  column sums (per consumer: Σ dy ⊙ x̂, Σ dy), the dw partial's store slots, the barriers."""
  tf = mgpu.swizzle_transforms(64, plan.dtype)
  return dict(
      w=plgpu.SMEM((1, WIDTH, WIDTH), plan.dtype, transforms=tf),
      scale=plgpu.SMEM((WIDTH,), jnp.float32) if plan.has_scale else None,
      dense_bias=plgpu.SMEM((WIDTH,), jnp.float32) if plan.has_dense_bias else None,
      w_ready=plgpu.Barrier(num_arrivals=1 + int(plan.has_scale) + int(plan.has_dense_bias)),
      dh=plgpu.SMEM((1, TILE_M, WIDTH), plan.dtype, transforms=tf),
      cols=plgpu.SMEM((1, 2, plan.n_cols, WIDTH), jnp.float32),
      out=plgpu.SMEM((2, TILE_M // 2, STORE_N), jnp.float32),
      ready=plgpu.Barrier(num_arrivals=2),
      done=plgpu.Barrier(num_arrivals=2),
      # per consumer: its rows of the block's residual landed in its dh rows
      res_ready=plgpu.Barrier(num_barriers=2) if plan.has_residual else None)


def _ring_allocs(plan: _Plan, stages: int) -> dict:
  tf = mgpu.swizzle_transforms(64, plan.dtype)
  rows = [((TILE_M,), jnp.float32, ())] * (1 + int(plan.layer))  # rstd (, mean)
  return mgpu.pipeline.shared_ring_allocs(stages, ((TILE_M, WIDTH), plan.dtype, tf),
                                          ((TILE_M, WIDTH), plan.dtype, tf), *rows)


class _Consumer:
  """One consumer warpgroup's work on the CTA's row blocks (module docstring)."""

  def __init__(self, plan: _Plan, wg, smem, ring, dx_gmem, res_gmem=None, dres_gmem=None):
    self.plan, self.wg, self.ring, self.dx_gmem = plan, wg, ring, dx_gmem
    self.res_gmem, self.dres_gmem = res_gmem, dres_gmem
    self.rows = pl.ds(wg * (TILE_M // 2), TILE_M // 2)
    self.smem = self._tiles(smem, 0)
    self._allocs = smem

  @staticmethod
  def _tiles(smem, index):
    """The fixed tiles (w, dh, the column sums) at ``index`` of their one-element leading
    axis, the rest as allocated. Indexed by :func:`mgpu.opaque_zero` of the block inside the
    block loop, their addresses and WGMMA descriptors are recomputed there instead of hoisted
    out of it by LLVM, where they lived across the whole block (ptxas spilled them)."""
    return {**smem, **{name: smem[name].at[index] for name in ("w", "dh", "cols")}}

  def _row0(self, m_idx):
    return m_idx * TILE_M + self.wg * (TILE_M // 2)

  def _load_residual(self, m_idx):
    """TMA of this consumer's rows of block ``m_idx``'s residual into its dh rows (free: the
    previous dx store read them), for h = x w + residual."""
    plgpu.copy_gmem_to_smem(self.res_gmem.at[pl.ds(self._row0(m_idx), TILE_M // 2)],
                            self.smem["dh"].at[self.rows], self.smem["res_ready"].at[self.wg])

  def _row_vector(self, ref):
    v = plgpu.load(ref.at[self.rows], layout=plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(v, (TILE_M // 2, WIDTH), [0])

  def _x_hat(self, x_stage, rows_stages):
    """(x̂ (64, N) of this consumer's rows in x's dtype, rstd (64,)): h = x w recomputed, then
    (h − mean) ⊙ rstd."""
    def product(acc):
      plgpu.wgmma(acc, x_stage.at[self.rows], self.smem["w"])
      plgpu.wgmma_wait(0)
      return acc[...]
    h = pl.run_scoped(product, plgpu.ACC((TILE_M // 2, WIDTH), jnp.float32))
    if self.plan.has_dense_bias:
      b = plgpu.load(self.smem["dense_bias"], layout=plgpu.Layout.WGMMA.reduce(0))
      h = h + lax.broadcast_in_dim(b, h.shape, [1])
    if self.plan.has_residual:  # each thread reads the elements it overwrites with x̂ later
      plgpu.barrier_wait(self.smem["res_ready"].at[self.wg])
      h = h + plgpu.load(self.smem["dh"].at[self.rows],
                         layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    rstd = plgpu.load(rows_stages[0].at[self.rows], layout=plgpu.Layout.WGMMA.reduce(1))
    if self.plan.layer:
      h = h - self._row_vector(rows_stages[1])
    # In x's dtype, as the forward's saved x̂ of the row-kernel path: 32 registers, not 64.
    return (h * lax.broadcast_in_dim(rstd, h.shape, [0])).astype(self.plan.dtype), rstd

  def _chunks(self, dy16, x_hat):
    """(columns, g, x̂) of each :data:`CHUNK`-column chunk in f32, g = scale ⊙ dy: the row's
    f32 tiles go chunk by chunk, so only the 16-bit x̂ and dy and dw's accumulator stay whole
    in registers (232 a thread)."""
    for c in range(0, WIDTH, CHUNK):
      cols = slice(c, c + CHUNK)
      g = dy16[:, cols].astype(jnp.float32)
      if self.plan.has_scale:
        v = plgpu.load(self.smem["scale"].at[pl.ds(c, CHUNK)],
                       layout=plgpu.Layout.WGMMA.reduce(0))
        g = g * lax.broadcast_in_dim(v, g.shape, [1])
      yield pl.ds(c, CHUNK), g, x_hat[:, cols].astype(jnp.float32)

  def _write_dh(self, dy16, x_hat, rstd):
    """dh = rstd ⊙ (g − x̂ ⊙ mean_N(g ⊙ x̂) − mean_N(g)) (RMSNorm without the last term) into
    this consumer's rows of the dh tile, in x's dtype."""
    s_gx = s_g = None
    for _, g, xh in self._chunks(dy16, x_hat):
      part = jnp.sum(g * xh, axis=1)
      s_gx = part if s_gx is None else s_gx + part
      if self.plan.layer:
        part = jnp.sum(g, axis=1)
        s_g = part if s_g is None else s_g + part
    bcast = lambda v: lax.broadcast_in_dim(v * (1.0 / WIDTH), (TILE_M // 2, CHUNK), [0])
    for cols, g, xh in self._chunks(dy16, x_hat):
      d = g - xh * bcast(s_gx)
      if self.plan.layer:
        d = d - bcast(s_g)
      r = lax.broadcast_in_dim(rstd, d.shape, [0])
      self.smem["dh"].at[self.rows, cols][...] = (d * r).astype(self.plan.dtype)

  def _add_column_sums(self, dy_stage, x_hat):
    """Σ over this consumer's rows of dy ⊙ x̂ and of dy, from dy (the stage) and x̂ (written
    first into its rows of the dh tile, in x's dtype: |x̂| ≤ √N fits any 16-bit type, where the
    product rounded to float16 overflowed for |dy| ≳ 2e4, a review's NaN dscale), each read
    transposed so the rows add within a warp, multiplied and added in f32 into its rows in SMEM,
    a CHUNK-column piece at a time."""
    self.smem["dh"].at[self.rows][...] = x_hat
    plgpu.commit_smem()
    for c in range(0, WIDTH, CHUNK):
      def transposed(tile):
        return plgpu.load(tile.at[self.rows, pl.ds(c, CHUNK)].transpose((1, 0)),
                          layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      dy_t = transposed(dy_stage)
      for i, part in ((0, dy_t * transposed(self.smem["dh"])), (1, dy_t)):
        row = self.smem["cols"].at[self.wg, i, pl.ds(c, CHUNK)]
        row[...] = (plgpu.load(row, layout=plgpu.Layout.WGMMA.reduce(1))
                    + jnp.sum(part, axis=1))
    plgpu.commit_smem()  # every warp's reads of x̂, before dh overwrites it

  def _add_dh_column_sums(self):
    """Σ over this consumer's rows of dh (the dense bias's gradient), as it is in the dh tile
    (in x's dtype, the values the GEMMs read), read transposed, added in f32 to its third row."""
    for c in range(0, WIDTH, CHUNK):
      t = plgpu.load(self.smem["dh"].at[self.rows, pl.ds(c, CHUNK)].transpose((1, 0)),
                     layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      row = self.smem["cols"].at[self.wg, 2, pl.ds(c, CHUNK)]
      row[...] = plgpu.load(row, layout=plgpu.Layout.WGMMA.reduce(1)) + jnp.sum(t, axis=1)

  def block(self, dw_acc, step, m_idx, first, last):
    self.smem = smem = self._tiles(self._allocs, mgpu.opaque_zero(step))
    plan = self.plan
    if plan.has_residual:  # later blocks' residuals are loaded at the end of the one before
      pl.when(first)(lambda: self._load_residual(m_idx))
    (x_stage, dy_stage, *rows_stages), produced, consumed = self.ring.stage_buffers(step)
    plgpu.barrier_wait(produced)
    x_hat, rstd = self._x_hat(x_stage, rows_stages)
    dy16 = plgpu.load(dy_stage.at[self.rows], layout=plgpu.Layout.WGMMA)
    # The previous block's dx store (staged over these dh rows) must have read them.
    pl.when(jnp.logical_not(first))(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
    self._add_column_sums(dy_stage, x_hat)
    self._write_dh(dy16, x_hat, rstd)
    plgpu.commit_smem()  # dh's stores, for the WGMMAs (async proxy) of both consumers
    if plan.has_dense_bias:
      self._add_dh_column_sums()
    row0 = self._row0(m_idx)
    if plan.has_residual:  # d(residual) = dh
      plgpu.copy_smem_to_gmem(smem["dh"].at[self.rows],
                              self.dres_gmem.at[pl.ds(row0, TILE_M // 2)])
    plgpu.barrier_arrive(smem["ready"])
    plgpu.barrier_wait(smem["ready"])

    def gemms(dx_acc):
      plgpu.wgmma(dx_acc, smem["dh"].at[self.rows], smem["w"].transpose((1, 0)))
      x_cols = x_stage.at[:, pl.ds(self.wg * (TILE_M // 2), TILE_M // 2)]
      plgpu.wgmma(dw_acc, x_cols.transpose((1, 0)), smem["dh"])
      plgpu.wgmma_wait(0)
      return dx_acc[...]
    dx = pl.run_scoped(gemms, plgpu.ACC((TILE_M // 2, WIDTH), jnp.float32))
    plgpu.barrier_arrive(consumed)  # x, dy, the row vectors: read (the stage's writes fenced)
    plgpu.barrier_arrive(smem["done"])  # both consumers' dw WGMMAs read all dh rows
    plgpu.barrier_wait(smem["done"])
    if plan.has_residual:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # d(residual)'s store read the dh rows
    smem["dh"].at[self.rows][...] = dx.astype(plan.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["dh"].at[self.rows],
                            self.dx_gmem.at[pl.ds(row0, TILE_M // 2)])
    if plan.has_residual:
      # The CTA's next block (nd_loop deals blocks c, c + CTAs, ...): its residual loads into
      # the dh rows once dx's store has read them, under that block's wait for its stage.
      @pl.when(jnp.logical_not(last))
      def _prefetch():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        self._load_residual(m_idx + plan.num_ctas)

  def finish(self, dw, dw_gmem, cols_gmem):
    """This consumer's rows of the CTA's dw partial and its column sums, stored by TMA."""
    cta = lax.axis_index("sm")
    slot = self.smem["out"].at[self.wg]
    for c in range(0, WIDTH, STORE_N):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      slot[...] = dw[:, c:c + STORE_N]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(slot, dw_gmem.at[cta, self.rows, pl.ds(c, STORE_N)])
    plgpu.copy_smem_to_gmem(self.smem["cols"].at[self.wg], cols_gmem.at[cta, self.wg])


def _kernel(*refs, plan: _Plan):
  it = iter(refs)
  x_gmem, w_gmem, dy_gmem = next(it), next(it), next(it)
  row_gmems = [next(it) for _ in range(1 + int(plan.layer))]  # rstd (, mean), padded
  scale_gmem = next(it) if plan.has_scale else None
  dense_bias_gmem = next(it) if plan.has_dense_bias else None
  res_gmem = next(it) if plan.has_residual else None
  dx_gmem, dw_gmem, cols_gmem = next(it), next(it), next(it)
  dres_gmem = next(it) if plan.has_residual else None

  @functools.partial(pl.run_scoped, ring_allocs=_ring_allocs(plan, plan.stages), **_smem(plan),
                     collective_axes="wg")
  def _scope(ring_allocs, **smem):
    wg = lax.axis_index("wg")
    ring = mgpu.SharedRing(**ring_allocs, stages=plan.stages)

    def schedule(visit):
      @plgpu.nd_loop((plan.m_iters,), collective_axes="sm")
      def _loop(info: plgpu.NDLoopInfo):
        (m_idx,) = info.index
        visit(m_idx, info.local_index, info.local_index == info.num_local_steps - 1)

    def produce():
      plgpu.copy_gmem_to_smem(w_gmem, smem["w"].at[0], smem["w_ready"])
      if plan.has_scale:
        plgpu.copy_gmem_to_smem(scale_gmem, smem["scale"], smem["w_ready"])
      if plan.has_dense_bias:
        plgpu.copy_gmem_to_smem(dense_bias_gmem, smem["dense_bias"], smem["w_ready"])

      def visit(m_idx, i, last):
        block = pl.ds(m_idx * TILE_M, TILE_M)
        mgpu.ring_produce(ring, i, x_gmem.at[block], dy_gmem.at[block],
                          *(r.at[block] for r in row_gmems))
        pl.when(last)(lambda: mgpu.ring_drain(ring, i + 1))
      schedule(visit)

    def consume():
      consumer = _Consumer(plan, wg, smem, ring, dx_gmem, res_gmem, dres_gmem)
      zeros = plgpu.layout_cast(jnp.zeros((WIDTH,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      for i in range(plan.n_cols):
        smem["cols"].at[0, wg, i][...] = zeros
      plgpu.commit_smem()
      plgpu.barrier_wait(smem["w_ready"])

      def with_dw(dw_acc):
        schedule(lambda m_idx, i, last: consumer.block(dw_acc, i, m_idx, i == 0, last))
        plgpu.wgmma_wait(0)
        consumer.smem = consumer._tiles(smem, 0)  # pylint: disable=protected-access
        consumer.finish(dw_acc[...], dw_gmem, cols_gmem)
      pl.run_scoped(with_dw, plgpu.ACC((TILE_M // 2, WIDTH), jnp.float32))

    mgpu.warp_specialize(produce, consume)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def backward(x, w, dy, rstd, mean=None, scale=None, residual=None, dense_bias=None, *,
             interpret: bool = False):
  """(dx, dw, dscale_sums, dbias_sums, d_residual, d_dense_bias) of the post-norm GEMM at
  K = N = 128 in one kernel.

  Args:
    x: (M, 128) the forward's input; w: (128, 128); dy: (M, 128) the output's cotangent, all in
      one 16-bit dtype; rstd, mean: (M,) float32, the forward's statistics (mean None for
      RMSNorm); scale: (128,) the norm's scale or None; residual: (M, 128) in x's dtype, added
      to h in the forward (h = x w + dense_bias + residual), or None; dense_bias: (128,) or None.
    interpret: GPU interpret mode.

  Returns:
    dx (M, 128) in x's dtype; dw (128, 128) float32; Σ_i dy ⊙ x̂ and Σ_i dy, (128,) float32 each
    (the scale's and the norm bias's gradients); d(residual) = dh (M, 128) in x's dtype, or None
    without a residual; Σ_i dh (128,) float32 (the dense bias's gradient; dh as the GEMMs read
    it, in x's dtype), or None without a dense bias.

  Raises:
    ValueError: shapes or dtypes the kernel does not take (:func:`unsupported_reason`).
  """
  m, k = x.shape
  n = w.shape[1]
  if (reason := unsupported_reason(m, k, n, x.dtype)) is not None:
    raise ValueError(f"matmul_norm backward kernel: {reason}")
  if not (w.dtype == dy.dtype == x.dtype and dy.shape == (m, n)):
    raise ValueError(f"dy (M, N) and w (K, N) in x's dtype; got {dy.dtype}{dy.shape}, "
                     f"{w.dtype}{w.shape}")
  if residual is not None and (residual.dtype != x.dtype or residual.shape != (m, n)):
    raise ValueError(f"residual (M, N) in x's dtype; got {residual.dtype}{residual.shape}")
  if dense_bias is not None and dense_bias.shape != (n,):
    raise ValueError(f"dense_bias must have shape ({n},), got {dense_bias.shape}")
  m_iters = -(-m // TILE_M)
  plan = _Plan(m=m, dtype=jnp.dtype(x.dtype), layer=mean is not None,
               has_scale=scale is not None, has_residual=residual is not None,
               has_dense_bias=dense_bias is not None, stages=2,
               num_ctas=max(1, min(mgpu.num_sms(interpret), m_iters)))
  pad = m_iters * TILE_M - m
  rows = [jnp.pad(v, (0, pad)) for v in (rstd, mean) if v is not None]
  vecs = [v.astype(jnp.float32) for v in (scale, dense_bias) if v is not None]
  out_types = (jax.ShapeDtypeStruct((m, k), x.dtype),
               jax.ShapeDtypeStruct((plan.num_ctas, k, n), jnp.float32),
               jax.ShapeDtypeStruct((plan.num_ctas, 2, plan.n_cols, n), jnp.float32))
  if residual is not None:
    out_types += (jax.ShapeDtypeStruct((m, n), x.dtype),)
  call = gemm_core.kernel(functools.partial(_kernel, plan=plan), out_types,
                          num_ctas=plan.num_ctas, interpret=interpret)
  dx, dw, cols, *dres = call(x, w, dy, *rows, *vecs, *([] if residual is None else [residual]))
  cols = cols.sum(axis=(0, 1))
  return (dx, dw.sum(axis=0), cols[0], cols[1], (dres[0] if dres else None),
          (cols[2] if dense_bias is not None else None))
