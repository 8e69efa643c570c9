"""The persistent warp-specialized GEMM body that the fused GEMM kernels share, and its hooks.

The body follows JAX's ``pallas/ops/gpu/hopper_matmul_mgpu.py``: a persistent grid (one CTA per
SM, or one cluster per group of SMs) walks work units from a *schedule*; each output tile of
``tile_m`` × ``tile_n`` is accumulated in f32 registers by two WGMMA consumer warpgroups that split
it along M (``tile_m // 2`` rows each, so every row belongs to exactly one warpgroup) while a TMA
producer warpgroup streams the K loop's operands through SMEM stages: on the shared ring
(:class:`pallas_norm.mgpu.pipeline.SharedRing`, ``TileConfig.pipeline="ring"``, steps numbered
across the CTA's tiles: every default K loop but one) or through Pallas's
``emit_pipeline_warp_specialized`` (``pipeline="pallas"``, chained across the CTA's tiles when the
stages divide the steps: the post-norm forward with several N tiles per CTA, where the ring
measured slower, ``pallas_norm.ops.matmul_norm.mosaic``).

A kernel adds its work through :class:`Hooks`:

* extra input streams: any :class:`Stream` after A and B goes through the same stages (the dx
  kernel's y tile and column vectors);
* ``before_k_loop``: TMA loads of what the epilogue needs, issued while the K loop runs;
* ``k_step_start`` / ``k_step``: work of each K step before the WGMMA is issued, and after it
  while the tensor core runs (the pre-norm row statistics of the A tile, the dx row terms);
* ``epilogue``: the f32 accumulator and the K loop's carry, once per tile;
* ``end_unit`` (called by the schedule) and ``finish``: after a work unit and at the end.

Each kernel declares its SMEM besides the stages as a dict of ``pl.run_scoped`` allocations;
:func:`plan_k_loop` sums their bytes (:func:`smem_bytes`) to fit the stages, and :func:`run`
allocates the same dict, so the SMEM check and the kernel cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm.mgpu import pipeline
from pallas_norm.mgpu.config import SMEM_BYTES, TileConfig
from pallas_norm.mgpu.device import interpret_params

SMEM_SLACK = 4096
"""SMEM bytes kept free for the barriers and the allocations' alignment. No GEMM body reduces
across warps, so :func:`kernel` reserves no reduction scratch (Mosaic's default is 2 KiB)."""


@dataclasses.dataclass(frozen=True)
class Stream:
  """An operand of the K loop: one ``block`` per K step, through the pipeline's stages.

  ``k_axis``: the axis of ``block`` (and of the GMEM array) that advances with the K step. A
  (stream 0) is (rows, tile_k); B (stream 1) is (tile_k, tile_n), or (tile_n, tile_k) with
  ``k_axis`` 1, which WGMMA reads transposed (free for 16-bit types).
  """
  block: tuple[int, int]
  dtype: object
  k_axis: int
  transforms: tuple = ()

  @property
  def nbytes(self) -> int:
    return math.prod(self.block) * jnp.dtype(self.dtype).itemsize

  def index_map(self, kk):
    return (kk, 0) if self.k_axis == 0 else (0, kk)

  def window(self, gmem, other, ks):
    """The GMEM ref of K window ``ks`` (None: all of K) and ``other`` along the other axis
    (None: all of it)."""
    if other is None and ks is None:
      return gmem
    index = [slice(None) if other is None else other]
    index.insert(self.k_axis, slice(None) if ks is None else ks)
    return gmem.at[tuple(index)]


def smem_bytes(allocs) -> int:
  """Bytes of the SMEM buffers in a pytree of ``pl.run_scoped`` allocations (barriers are in
  :data:`SMEM_SLACK`)."""
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
             for a in jax.tree.leaves(allocs) if hasattr(a, "shape") and hasattr(a, "dtype"))


@dataclasses.dataclass(frozen=True)
class KLoop:
  """Static facts of a kernel's K loop: the tiling, the streams, the steps of one tile, the
  stages that fit, whether Pallas's pipeline chains the CTA's tiles, the WGMMA groups left in
  flight across steps, and whether WGMMA reads A from registers (A stages untiled: any M)."""
  cfg: TileConfig
  streams: tuple[Stream, ...]
  steps: int
  stages: int
  chained: bool
  delay_release: int
  a_in_registers: bool

  @property
  def ring(self) -> bool:
    return self.cfg.pipeline == "ring"


def fit_stages(cfg: TileConfig, streams, hook_smem) -> int:
  """Pipeline stages of ``streams`` that fit next to the allocations ``hook_smem`` (not capped
  by ``cfg.max_concurrent_steps``)."""
  free = SMEM_BYTES - smem_bytes(hook_smem) - SMEM_SLACK
  return free // sum(s.nbytes for s in streams)


def plan_k_loop(cfg: TileConfig, streams, steps: int, hook_smem, *,
                a_in_registers: bool = False, what: str = "") -> KLoop:
  """The :class:`KLoop` of ``steps`` K steps of ``streams`` next to the kernel's other SMEM
  allocations ``hook_smem``: as many stages as fit (at most ``cfg.max_concurrent_steps``; see
  :func:`pallas_norm.mgpu.pipeline.stages_for`). ValueError when not one stage fits (``what``
  ends the message)."""
  fit = min(cfg.max_concurrent_steps, fit_stages(cfg, streams, hook_smem))
  if fit < 1:
    raise ValueError(f"{cfg} does not fit in {SMEM_BYTES} bytes of SMEM{what}")
  stages, chained = pipeline.stages_for(cfg, steps, fit)
  return KLoop(cfg=cfg, streams=tuple(streams), steps=steps, stages=stages, chained=chained,
               delay_release=pipeline.plan_delay_release(cfg, stages, a_in_registers),
               a_in_registers=a_in_registers)


class KLoopFacts:
  """For a kernel's plan with a ``kloop`` field: the K loop's stages, chaining, WGMMA groups in
  flight across steps and register A operand as plan attributes."""
  kloop: KLoop

  @property
  def stages(self) -> int:
    return self.kloop.stages

  @property
  def chained(self) -> bool:  # a CTA's tiles run as one K-loop pipeline (Pallas's pipeline)
    return self.kloop.chained

  @property
  def delay_release(self) -> int:  # WGMMA groups left in flight across K steps (TileConfig)
    return self.kloop.delay_release

  @property
  def a_in_registers(self) -> bool:  # WGMMA reads A from registers (A stages untiled: any M)
    return self.kloop.a_in_registers


@dataclasses.dataclass(frozen=True)
class NormGemmPlan(KLoopFacts):
  """The static facts a fused GEMM kernel's plan starts with (subclasses add theirs and a
  ``kloop``): x (m, k) @ w (k, n) in ``dtype``, the output dtype, the norm and its eps, the
  tiling."""
  m: int
  k: int
  n: int
  dtype: jnp.dtype
  out_dtype: jnp.dtype
  norm: str | None
  eps: float
  cfg: TileConfig

  @property
  def m_iters(self) -> int:  # row blocks of tile_m rows
    return -(-self.m // self.cfg.tile_m)

  @property
  def k_iters(self) -> int:  # K steps of one tile
    return self.k // self.cfg.tile_k


@dataclasses.dataclass(frozen=True)
class Tile:
  """One output tile of a schedule: row block ``m_idx``, column tile ``n_idx``; ``index``: the
  tiles this CTA ran before (its ring steps start at ``index · steps``); ``first``/``last``:
  whether it is the CTA's first/last tile; ``kind``: the kernel's static tag for it."""
  m_idx: object
  n_idx: object
  index: object
  first: object
  last: object
  kind: object = None


class KStep:
  """What ``Hooks.k_step`` sees of one K step: its index, its stage buffers (A, B, extras), and
  loads of this warpgroup's rows of them into registers (WGMMA layout). A hook that loads marks
  the step, and the body then fences those generic-proxy reads before the stage is released
  to the TMA producer (async proxy; PTX memory model: WAR across proxies)."""

  def __init__(self, k_idx, stages, rows):
    self.k_idx = k_idx
    self.stages = stages
    self.rows = rows
    self.read_smem = False
    self._a = None

  def load(self, ref):
    """This warpgroup's rows of a stage buffer, in registers."""
    self.read_smem = True
    return plgpu.load(ref.at[self.rows], layout=plgpu.Layout.WGMMA)

  def a(self):
    """This warpgroup's rows of the A tile in registers (loaded once per step)."""
    if self._a is None:
      self._a = self.load(self.stages[0])
    return self._a

  def a_column_sums(self):
    """Σ over all the A stage's rows (both consumers' rows), per column: (tile_k,) float32 in
    the layout ``WGMMA.reduce(1)``. Each 64-row block is read transposed, so that its rows
    sum within each warp (adds in the thread, then 2 lane shuffles) and no warp waits for
    another; tile_k a multiple of 64. Fences its reads itself (:func:`plgpu.commit_smem`,
    also a warpgroup barrier), so it may run under a ``pl.when`` that the warpgroup takes as
    one."""
    a = self.stages[0]
    total = None
    for r in range(0, a.shape[0], 64):
      block_t = plgpu.load(a.at[pl.ds(r, 64)].transpose((1, 0)), layout=plgpu.Layout.WGMMA)
      part = jnp.sum(block_t.astype(jnp.float32), axis=1)
      total = part if total is None else total + part
    plgpu.commit_smem()
    return total


class Hooks:
  """A fused kernel's additions to the GEMM body (every method is optional but ``epilogue``)."""

  def start(self) -> None:
    """Every warpgroup, before the schedule (e.g. zeroing per-CTA accumulators in SMEM that
    the tiles add to)."""

  def before_k_loop(self, tile: Tile) -> None:
    """Consumer, before the tile's K loop (e.g. TMA loads of the epilogue's inputs)."""

  def init_carry(self, tile: Tile) -> tuple:
    """Values the K steps carry besides the accumulator (e.g. partial row sums)."""
    del tile
    return ()

  def k_step_start(self, tile: Tile, k_idx) -> None:
    """Consumer, at the start of K step ``k_idx``, before its WGMMA is issued."""

  def k_step(self, tile: Tile, step: KStep, carry: tuple) -> tuple:
    """Consumer, after K step ``step``'s WGMMA was issued, while the tensor core runs."""
    del tile, step
    return carry

  def epilogue(self, tile: Tile, acc, carry: tuple) -> None:
    """Consumer, after the tile's K loop: ``acc`` the f32 accumulator (rows, tile_n)."""
    raise NotImplementedError

  def end_unit(self, unit) -> None:
    """Consumer, after a work unit's tiles (the schedule calls it)."""

  def consumer_scope(self, consume_all: Callable[[], None]) -> None:
    """Consumer: runs ``consume_all()`` (the whole schedule), e.g. inside a ``pl.run_scoped``
    of an accumulator that lives across the CTA's tiles."""
    consume_all()

  def finish(self) -> None:
    """Every warpgroup, after the schedule."""


Schedule = Callable[[Callable[[Tile], None], Callable[[object], None]], None]
"""``schedule(visit, end_unit)``: calls ``visit(tile)`` for this CTA's tiles in order, and
``end_unit(unit)`` after each work unit's tiles where the kernel has work there."""


def tile_grid(m_iters: int, n_iters: int, kind=None) -> Schedule:
  """The schedule of a persistent grid over the (m_iters, n_iters) output tiles in
  :func:`plgpu.planar_snake` order, the N tiles of a row block first (M first measured slower:
  ``benchmarks/EXPERIMENTS.md``); one tile per work unit."""
  def schedule(visit, end_unit):
    del end_unit

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (lin_idx,) = loop_info.index
      # planar_snake cuts its `minor_dim` into strips and walks the other dim inside a
      # strip; M the strip dimension (0), strips one row block wide: N varies fastest,
      m_idx, n_idx = plgpu.planar_snake(lin_idx, (m_iters, n_iters), 0, 1)
      # so CTAs running at once share x tiles and w stays in L2 (M first, JAX's Hopper
      # matmul default, measured slower: benchmarks/EXPERIMENTS.md).
      visit(Tile(m_idx, n_idx, loop_info.local_index, loop_info.local_index == 0,
                 loop_info.local_index == loop_info.num_local_steps - 1, kind))
  return schedule


def run(kloop: KLoop, *, gmems, windows: Callable[[Tile], list], schedule: Schedule, smem: dict,
        hooks_for: Callable[[object, dict], Hooks]) -> None:
  """The GEMM body inside a kernel launched by :func:`kernel`.

  Args:
    kloop: the K loop (:func:`plan_k_loop`).
    gmems: the GMEM refs of ``kloop.streams``, in order.
    windows: ``windows(tile)``: per stream, the tile's index along the stream's non-K axis
      (None: all of it), e.g. ``[rows, cols]`` for x (M, K) and w (K, N).
    schedule: the CTA's tiles (:data:`Schedule`, e.g. :func:`tile_grid`).
    smem: the kernel's ``pl.run_scoped`` allocations besides the stages (collective over the
      warpgroups), by name.
    hooks_for: ``hooks_for(wg, refs)``: the kernel's :class:`Hooks` for consumer warpgroup
      ``wg`` (traced) and the allocated ``smem`` (a dict of refs by name).
  """
  cfg = kloop.cfg
  wg_m, tile_k = cfg.wg_tile_m, cfg.tile_k
  b_stream = kloop.streams[1]

  def make_pipeline(body, compute_context, state=None):
    specs = [plgpu.BlockSpec(s.block, s.index_map, transforms=s.transforms,
                             memory_space=plgpu.SMEM) for s in kloop.streams]
    return pipeline.consumer_pipeline(
        body, compute_context, steps=kloop.steps, stages=kloop.stages, pipeline_state=state,
        delay_release=kloop.delay_release, in_specs=specs)

  if kloop.ring:
    pipeline_allocs = pipeline.shared_ring_allocs(
        kloop.stages, *((s.block, s.dtype, s.transforms) for s in kloop.streams))
  else:
    ignore = lambda *_, **__: None
    pipeline_allocs = make_pipeline(ignore, ignore).get_allocations(*gmems)

  @functools.partial(pl.run_scoped, pipeline_allocs=pipeline_allocs, **smem,
                     collective_axes="wg")
  def _scope(pipeline_allocs, **refs):
    wg = lax.axis_index("wg")
    hooks = hooks_for(wg, refs)
    hooks.start()
    ring = (pipeline.SharedRing(**pipeline_allocs, stages=kloop.stages) if kloop.ring
            else None)

    def mma_body(tile):
      def body(idxs, *stages_and_carry):
        *stages, (acc_ref, *carry) = stages_and_carry
        (k_idx,) = idxs
        hooks.k_step_start(tile, k_idx)
        step = KStep(k_idx, stages, pl.ds(wg * wg_m, wg_m))
        b = stages[1] if b_stream.k_axis == 0 else stages[1].transpose((1, 0))
        plgpu.wgmma(acc_ref, step.a() if kloop.a_in_registers else stages[0].at[step.rows], b)
        carry = hooks.k_step(tile, step, tuple(carry))
        if step.read_smem:
          plgpu.commit_smem()  # fence the stage reads before the producer refills the stage
        plgpu.wgmma_wait(kloop.delay_release)
        return (acc_ref, *carry)
      return body

    def compute_context(tile, eval_pipeline):
      hooks.before_k_loop(tile)

      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, cfg.tile_n), jnp.float32))
      def _acc_scope(acc_ref):
        acc_ref, *carry = eval_pipeline((acc_ref, *hooks.init_carry(tile)))
        if kloop.delay_release:
          plgpu.wgmma_wait(0)  # the last step's WGMMA is still in flight
        hooks.epilogue(tile, acc_ref[...], tuple(carry))

    def consume(tile):
      if ring is not None:
        compute_context(tile, lambda carry: pipeline.ring_k_loop(
            ring, tile.index * kloop.steps, kloop.steps, carry, mma_body(tile),
            delay_release=kloop.delay_release))
        return
      tile_refs = [s.window(g, o, None) for s, g, o in zip(kloop.streams, gmems, windows(tile))]
      pipeline.run_tile_pipeline(
          functools.partial(make_pipeline, mma_body(tile), functools.partial(compute_context,
                                                                             tile)),
          *tile_refs, allocations=pipeline_allocs, stages=kloop.stages,
          chained=kloop.chained, first=tile.first, last=tile.last)

    def produce(tile):
      others = windows(tile)

      @pl.loop(0, kloop.steps)
      def _(kk):
        ks = pl.ds(kk * tile_k, tile_k)
        step = tile.index * kloop.steps + kk
        if kloop.stages & (kloop.stages - 1):
          # step mod stages is a multiply for 3 stages: on the affine step LLVM unrolled the
          # loop into one 64-bit induction variable per step (its rem in 64 bits), which the
          # producer's 40 registers could not hold (the post-norm forward at 262144x512x2048
          # spilled 76/140 B). An opaque step leaves one 32-bit rem per step.
          step = step | pipeline.opaque_zero(step)
        pipeline.ring_produce(ring, step,
                              *(s.window(g, o, ks)
                                for s, g, o in zip(kloop.streams, gmems, others)))
      pl.when(tile.last)(lambda: pipeline.ring_drain(ring, (tile.index + 1) * kloop.steps))

    consume_all = lambda: hooks.consumer_scope(lambda: schedule(consume, hooks.end_unit))
    if ring is None:
      consume_all()
    else:
      pipeline.warp_specialize(lambda: schedule(produce, lambda unit: None), consume_all)
    hooks.finish()

  # All TMA stores must land before the kernel exits.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def kernel(body, out_type, *, num_ctas: int, interpret: bool, cluster: int | None = None):
  """``plgpu.kernel`` of a GEMM body: ``num_ctas`` persistent CTAs (grid axis "sm"), or with
  ``cluster`` that many clusters (grid axis "cluster_grid", cluster axis "cluster"), each of
  three warpgroups (axis "wg": two consumers, the producer), warpgroup lowering semantics."""
  grid = dict(grid=(num_ctas,), grid_names=("sm",))
  if cluster is not None:
    grid = dict(grid=(num_ctas,), grid_names=("cluster_grid",), cluster=(cluster,),
                cluster_names=("cluster",))
  return plgpu.kernel(
      body,
      out_type=out_type,
      **grid,
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           reduction_scratch_bytes=0),
      interpret=interpret_params() if interpret else None,
  )
