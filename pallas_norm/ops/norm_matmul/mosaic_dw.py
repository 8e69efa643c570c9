"""The pre-norm GEMM's weight gradient dW_γ = x̂ᵀ dy from x and dy as one Mosaic-GPU kernel
(sm_90a), x̂ made in registers as WGMMA's A operand.

The backward of ``y = (norm(x)·scale) @ w`` needs dW_γ = x̂ᵀ dy with x̂ = (x − mean) ⊙ rstd
(RMSNorm: x ⊙ rstd; DESIGN.md, op 1). Given x̂ in memory it is one cuBLAS GEMM, but x̂ then
exists only for it: the dx kernel writes it (a tensor of M × K) and the GEMM reads it back.
This kernel reads x instead and makes each x̂ block on its way to the tensor core, so the
backward moves one tensor of M × K less (``benchmarks/NOTES.md``, "Pre-norm backward").

The reduction runs over M (the rows of x and dy), so a CTA's output tile is small (TILE_K rows
of dW_γ by ``tile_n`` columns) and M is cut into ``groups`` ranges: work item (group, tile) sums
that tile over that range, its f32 partial is stored once, and XLA adds the groups' partials
(the same order every call). Per item, a TMA producer streams 64-row blocks of x (the tile's
TILE_K columns), dy (its ``tile_n`` columns) and rstd (and mean) through a ring; each of the two
consumer warpgroups owns 64 of the tile's rows of dW_γ and, per block:

1. loads its 64 columns of the x block transposed from SMEM into registers (WGMMA's layout:
   row = a column k of x, column = a row i of the block);
2. x̂ᵀ = x ⊙ rstd_i (− mean_i ⊙ rstd_i), in float32, rounded to x's dtype as the dx kernel's
   x̂ output is;
3. acc += x̂ᵀ dy (A from registers, B the dy block in SMEM), waited before the stage is
   released (a WGMMA in flight still reads its A registers).

GPU interpret mode has no WGMMA with A in registers: there step 3 writes x̂ᵀ into a (64, 64)
SMEM tile per consumer first and WGMMA reads it from there (the same values; the register path
itself is covered by the GPU tests).

Rows past M arrive as TMA's zeros with rstd padded by zeros, so they add nothing.
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

__all__ = ["TILE_K", "Config", "pick_config", "unsupported_reason", "weight_grad"]

TILE_K = 128
"""Rows of dW_γ (columns of x) per CTA tile: 64 per consumer warpgroup (WGMMA's M)."""

STEP_M = 64
"""Rows of x and dy per reduction step (WGMMA's K for this product: four k16 instructions)."""

STORE_N = 32  # f32 columns of the partial per TMA store (8 KiB of SMEM per consumer)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of :func:`weight_grad`: ``tile_n`` columns of dW_γ per CTA tile (64, 128 or 256,
  dividing N) and ``stages`` of the ring (each a block of x, dy and the row statistics)."""
  tile_n: int = 256
  stages: int = 4


def _stage_bytes(tile_n: int, itemsize: int, layer: bool) -> int:
  return STEP_M * (TILE_K + tile_n) * itemsize + STEP_M * 4 * (1 + int(layer))


def _fixed_bytes() -> int:
  return 2 * STEP_M * STORE_N * 4 + 1024  # the partial's store slots, barriers and slack


def pick_config(m: int, k: int, n: int, *, layer: bool = True, itemsize: int = 2) -> Config:
  """The widest ``tile_n`` dividing N, at most 128 for N ≤ 256 and 256 above, and as many stages
  (≤ 4) as fit the SMEM. Measured alone on an H100 (``benchmarks/NOTES.md``, "Pre-norm
  backward"): at N = 256 (K = 128 and 256), where the product is bound by memory, 128-wide
  tiles (twice the column tiles, half the M groups) beat 256-wide ones; at 512², bound by the
  tensor core, 256."""
  del m, k
  widest = 128 if n <= 256 else 256
  tile_n = next(t for t in (256, 128, 64) if t <= widest and n % t == 0)
  room = mgpu.SMEM_BYTES - _fixed_bytes()
  stages = min(4, room // _stage_bytes(tile_n, itemsize, layer))
  return Config(tile_n=tile_n, stages=stages)


def unsupported_reason(m: int, k: int, n: int, dtype, dy_dtype=None,
                       config: Config | None = None) -> str | None:
  """None if :func:`weight_grad` runs for x (m, k), dy (m, n), else why not: x and dy in one
  16-bit dtype, K a multiple of :data:`TILE_K`, N of 64, M a multiple of 8 (Mosaic's tiled TMA
  of the blocks), and ``config`` (default :func:`pick_config`) dividing N with 2+ stages that
  fit the SMEM."""
  dtype = jnp.dtype(dtype)
  if dtype not in mgpu.SUPPORTED_DTYPES:
    return f"bfloat16 or float16 only, got {dtype.name}"
  if dy_dtype is not None and jnp.dtype(dy_dtype) != dtype:
    return f"dy must have x's dtype {dtype.name}, got {jnp.dtype(dy_dtype).name}"
  if k % TILE_K:
    return f"K = {k} is not a multiple of {TILE_K}"
  if n % 64:
    return f"N = {n} is not a multiple of 64"
  if m % 8:
    return f"M = {m} is not a multiple of 8"
  config = config or pick_config(m, k, n, itemsize=dtype.itemsize)
  if config.tile_n not in (64, 128, 256) or n % config.tile_n:
    return f"tile_n = {config.tile_n} must be 64, 128 or 256 and divide N = {n}"
  if config.stages < 2:
    return f"{config.stages} stage(s); the ring needs 2+"
  smem = config.stages * _stage_bytes(config.tile_n, dtype.itemsize, True) + _fixed_bytes()
  if smem > mgpu.SMEM_BYTES:
    return f"{config} takes {smem} bytes of SMEM, more than {mgpu.SMEM_BYTES}"
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  m: int
  k: int
  n: int
  dtype: jnp.dtype
  layer: bool
  cfg: Config
  num_ctas: int
  groups: int
  a_in_smem: bool  # interpret mode: x̂ᵀ goes through an SMEM tile (module docstring)

  @property
  def steps(self) -> int:  # reduction steps over all of M
    return -(-self.m // STEP_M)

  @property
  def tiles(self) -> int:  # output tiles of dW_γ
    return (self.k // TILE_K) * (self.n // self.cfg.tile_n)

  @property
  def items(self) -> int:
    return self.tiles * self.groups

  def item(self, index):
    """(group, tile row, tile column, first step, steps) of work item ``index``: items of one
    group are adjacent, so CTAs running at once share its x and dy blocks in L2."""
    group, tile = index // self.tiles, index % self.tiles
    n_tiles = self.n // self.cfg.tile_n
    first = group * self.steps // self.groups
    last = (group + 1) * self.steps // self.groups
    return group, tile // n_tiles, tile % n_tiles, first, last - first


def _make_plan(m, k, n, dtype, layer, cfg, interpret) -> _Plan:
  sms = mgpu.num_sms(interpret)
  tiles = (k // TILE_K) * (n // cfg.tile_n)
  # As many M ranges as keep every SM busy, each at least a few ring-lengths long.
  groups = max(1, min(sms // tiles, -(-m // STEP_M) // (2 * cfg.stages)))
  return _Plan(m=m, k=k, n=n, dtype=jnp.dtype(dtype), layer=layer, cfg=cfg,
               num_ctas=min(sms, tiles * groups), groups=groups, a_in_smem=interpret)


def _ring_allocs(plan: _Plan) -> dict:
  tf = mgpu.swizzle_transforms(64, plan.dtype)
  rows = [((STEP_M,), jnp.float32, ())] * (1 + int(plan.layer))  # rstd (, mean)
  return mgpu.pipeline.shared_ring_allocs(
      plan.cfg.stages, ((STEP_M, TILE_K), plan.dtype, tf),
      ((STEP_M, plan.cfg.tile_n), plan.dtype, tf), *rows)


def _items(plan: _Plan, visit):
  """Runs ``visit(index, first_global_step)`` for each of this CTA's work items (items c,
  c + CTAs, ...), carrying the ring's global step count across them; returns the CTA's total
  steps."""
  cta = lax.axis_index("sm")
  count = (plan.items - cta + plan.num_ctas - 1) // plan.num_ctas

  def body(j, step0):
    index = cta + j * plan.num_ctas
    visit(index, step0)
    return step0 + plan.item(index)[4]
  return lax.fori_loop(0, count, body, jnp.int32(0))


def _produce(plan: _Plan, ring, x_gmem, dy_gmem, row_gmems) -> None:
  def visit(index, step0):
    _, kt, nt, first, steps = plan.item(index)
    x_cols = pl.ds(kt * TILE_K, TILE_K)
    dy_cols = pl.ds(nt * plan.cfg.tile_n, plan.cfg.tile_n)

    @pl.loop(0, steps)
    def _(s):
      rows = pl.ds((first + s) * STEP_M, STEP_M)
      mgpu.ring_produce(ring, step0 + s, x_gmem.at[rows, x_cols], dy_gmem.at[rows, dy_cols],
                        *(r.at[rows] for r in row_gmems))
  mgpu.ring_drain(ring, _items(plan, visit))


def _x_hat_t(plan: _Plan, wg, x_stage, rows_stages):
  """x̂ᵀ of this consumer's 64 columns of the x block, (64, STEP_M) in x's dtype in WGMMA's
  register layout: x ⊙ rstd (− mean ⊙ rstd) per column (a row of the block), in float32."""
  cols = pl.ds(wg * 64, 64)
  xt = plgpu.load(x_stage.at[:, cols].transpose((1, 0)),
                  layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  column = lambda ref: lax.broadcast_in_dim(
      plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0)), xt.shape, [1])
  rstd = column(rows_stages[0])
  if plan.layer:
    xt = xt - column(rows_stages[1])
  return (xt * rstd).astype(plan.dtype)


def _consume(plan: _Plan, ring, out_slots, a_tiles, partial_gmem) -> None:
  wg = lax.axis_index("wg")
  tile_n = plan.cfg.tile_n

  def issue(acc, a, dy_stage):
    if a_tiles is None:
      plgpu.wgmma(acc, a, dy_stage)
    else:
      a_tiles.at[wg][...] = a
      plgpu.commit_smem()
      plgpu.wgmma(acc, a_tiles.at[wg], dy_stage)

  def visit(index, step0):
    group, kt, nt, _, steps = plan.item(index)

    def with_acc(acc):
      @pl.loop(0, steps)
      def _(s):
        (x_stage, dy_stage, *rows_stages), produced, consumed = ring.stage_buffers(step0 + s)
        plgpu.barrier_wait(produced)
        issue(acc, _x_hat_t(plan, wg, x_stage, rows_stages), dy_stage)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(consumed)
      return acc[...]
    dw = pl.run_scoped(with_acc, plgpu.ACC((64, tile_n), jnp.float32))
    rows = pl.ds(kt * TILE_K + wg * 64, 64)
    slot = out_slots.at[wg]
    for c in range(0, tile_n, STORE_N):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's previous store read it
      slot[...] = dw[:, c:c + STORE_N]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(slot, partial_gmem.at[group, rows,
                                                    pl.ds(nt * tile_n + c, STORE_N)])
  _items(plan, visit)


def _kernel(*refs, plan: _Plan):
  x_gmem, dy_gmem, *row_gmems, partial_gmem = refs

  a_tiles = (plgpu.SMEM((2, 64, STEP_M), plan.dtype,
                        transforms=mgpu.swizzle_transforms(64, plan.dtype))
             if plan.a_in_smem else None)

  @functools.partial(pl.run_scoped, ring_allocs=_ring_allocs(plan),
                     out_slots=plgpu.SMEM((2, 64, STORE_N), jnp.float32), a_tiles=a_tiles,
                     collective_axes="wg")
  def _scope(ring_allocs, out_slots, a_tiles):
    ring = mgpu.SharedRing(**ring_allocs, stages=plan.cfg.stages)
    mgpu.warp_specialize(lambda: _produce(plan, ring, x_gmem, dy_gmem, row_gmems),
                         lambda: _consume(plan, ring, out_slots, a_tiles, partial_gmem))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def weight_grad(x, dy, rstd, mean=None, *, config: Config | None = None,
                interpret: bool = False):
  """dW_γ = x̂ᵀ dy (K, N) float32, x̂ = (x − mean) ⊙ rstd (RMSNorm: ``mean`` None, x ⊙ rstd).

  Args:
    x: (M, K) bfloat16 or float16, the pre-norm op's input; dy: (M, N) in x's dtype, the
      output's cotangent; rstd, mean: (M,) float32, the forward's statistics.
    config: the tiling (default :func:`pick_config`).
    interpret: GPU interpret mode.

  Returns:
    (K, N) float32: x̂ rounded to x's dtype (as the dx kernel's x̂ output), products summed in
    float32, the groups' partials added by XLA.

  Raises:
    ValueError: x or dy not 2-D, rows that do not match, rstd (mean) not of shape (M,), or
      shapes and dtypes the kernel does not take (:func:`unsupported_reason`), each before any
      tiling is picked or kernel traced.
  """
  for name, v in (("x", x), ("dy", dy)):
    if getattr(v, "ndim", None) != 2:
      raise ValueError(f"{name} must be a 2-D array, got {getattr(v, 'shape', type(v))}")
  (m, k), n = x.shape, dy.shape[1]
  if dy.shape[0] != m:
    raise ValueError(f"dy must have x's {m} rows, got {dy.shape}")
  for name, v in (("rstd", rstd), ("mean", mean)):
    if v is None and name == "mean":
      continue
    if getattr(v, "shape", None) != (m,):
      raise ValueError(f"{name} must be an array of shape ({m},), got "
                       f"{getattr(v, 'shape', type(v))}")
  if (reason := unsupported_reason(m, k, n, x.dtype, dy.dtype, config)) is not None:
    raise ValueError(f"norm_matmul weight-gradient kernel: {reason}")
  cfg = config or pick_config(m, k, n, layer=mean is not None,
                              itemsize=jnp.dtype(x.dtype).itemsize)
  plan = _make_plan(m, k, n, x.dtype, mean is not None, cfg, interpret)
  pad = plan.steps * STEP_M - m
  rows = [jnp.pad(v.astype(jnp.float32), (0, pad)) for v in (rstd, mean) if v is not None]
  call = gemm_core.kernel(functools.partial(_kernel, plan=plan),
                          jax.ShapeDtypeStruct((plan.groups, k, n), jnp.float32),
                          num_ctas=plan.num_ctas, interpret=interpret)
  return call(x, dy, *rows).sum(axis=0)
