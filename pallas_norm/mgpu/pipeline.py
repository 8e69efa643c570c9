"""The K-loop pipelines of the GEMM kernels: the hand-written shared ring (every default K loop
but one) and Pallas's warp-specialized pipeline (chained across a CTA's tiles; the post-norm
forward with several N tiles per CTA, where the ring measured slower), both fed by one TMA
producer warpgroup."""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm.mgpu.config import TileConfig


def pipeline_stages(steps: int, max_stages: int, delay_release: int = 0) -> tuple[int, bool]:
  """(stages, chained across tiles) for Pallas's pipeline over a K loop of ``steps`` steps with
  room for ``max_stages`` stages: as many stages as fit, chained across a CTA's tiles when that
  count divides ``steps`` (a pipeline of pipelines needs it) and no WGMMA stays in flight across
  steps (``delay_release`` 0: Pallas cannot chain the others). Chaining never costs a stage:
  pipeline depth mattered more than chaining (measured: ``benchmarks/EXPERIMENTS.md``, pre-norm
  GEMM, chaining at the cost of a stage)."""
  stages = min(max_stages, steps)
  chained = steps % stages == 0
  return stages, chained and not delay_release_for(delay_release, stages)


def stages_for(cfg: TileConfig, steps: int, max_stages: int) -> tuple[int, bool]:
  """(stages, chained) of a kernel's K loop under ``cfg``: :func:`pipeline_stages`, or on the
  shared ring (``pipeline="ring"``) as many stages as fit and ``chained`` False (the ring runs
  across tiles by construction, so its stages need not divide the steps)."""
  if cfg.pipeline == "ring":
    return max_stages, False
  return pipeline_stages(steps, max_stages, cfg.delay_release)


def delay_release_for(delay_release: int, stages: int) -> int:
  """The ``delay_release`` a pipeline of ``stages`` stages can run: Pallas needs more stages
  than steps of delay, so a one-stage (one-step) K loop runs with 0."""
  return delay_release if stages > delay_release else 0


def plan_delay_release(cfg: TileConfig, stages: int, a_in_registers: bool = False) -> int:
  """The WGMMA groups a kernel's consumers leave in flight across K steps under ``cfg``: 0 with
  an A operand in registers (a WGMMA left in flight still reads its A registers while the next
  step loads new ones: wrong results on the H200 for M % 8 ≠ 0, where the A operand comes from
  registers; ``benchmarks/EXPERIMENTS.md``, ``a_operand``); on the ring ``cfg.delay_release`` with 2+ stages; else
  :func:`delay_release_for`."""
  if a_in_registers:
    return 0
  if cfg.pipeline == "ring":  # the ring runs across tiles: 2+ stages can delay
    return cfg.delay_release if stages > 1 else 0
  return delay_release_for(cfg.delay_release, stages)


def tile_pipeline_state(first, last):
  """The ``pipeline_state`` of one output tile's K loop when a CTA's tiles run as one pipeline:
  START at its first tile (the producer issues the prologue), STOP at its last (it waits for
  the last stages to be consumed), STEADY between. A CTA with a single tile gets START, which
  skips that final wait: call :func:`drain_single_tile_pipeline` after the tile loop."""
  state = jnp.where(first, plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY)
  return jnp.where(last & jnp.logical_not(first), plgpu.PipelinePipeline.STOP, state)


def drain_single_tile_pipeline(pipeline_allocs, stages: int, single_tile):
  """The producer's final wait that a START pipeline skips, for a CTA whose only tile ran with
  state START (``single_tile``): the consumers' releases of the last ``stages`` steps (slots
  0..stages-1, as the stage count divides the steps). Without it the barriers are left a
  phase ahead of the producer, which the interpreter reports at deallocation."""
  @pl.when(single_tile & (lax.axis_index("wg") == 2))  # the producer warpgroup
  def _drain():
    for barrier in pipeline_allocs["flat_consumed_barrier_refs"]:
      for slot in range(stages):
        plgpu.barrier_wait(barrier.at[slot])


def run_tile_pipeline(pipeline_for, *gmem_refs, allocations, stages: int, chained: bool,
                      first, last) -> None:
  """Runs one output tile's K loop, ``pipeline_for(state)(*gmem_refs, allocations=...)``, as
  part of the CTA's chain of tiles when ``chained`` (:func:`tile_pipeline_state`, then
  :func:`drain_single_tile_pipeline` for a CTA whose only tile this is), else on its own."""
  state = tile_pipeline_state(first, last) if chained else None
  pipeline_for(state)(*gmem_refs, allocations=allocations)
  if chained:
    drain_single_tile_pipeline(allocations, stages, first & last)


def consumer_pipeline(body, compute_context, *, steps: int, in_specs, stages: int,
                      pipeline_state=None, delay_release: int = 0):
  """The K-loop pipeline every GEMM kernel here uses: a TMA producer warpgroup feeding
  ``in_specs`` stages to two WGMMA consumer warpgroups (axis "wg"), ``stages`` deep, with the
  producer's registers cut to 40 so the consumers get the rest. ``pipeline_state`` (see
  :func:`tile_pipeline_state`) chains the pipelines of consecutive tiles; None: each one
  starts and drains on its own. ``delay_release`` (see :class:`TileConfig`) is set on every
  input spec; the body must then leave that many WGMMA groups in flight
  (``plgpu.wgmma_wait(delay_release)``) and the caller wait for all before reading the
  accumulator."""
  if delay_release:
    in_specs = [dataclasses.replace(s, delay_release=delay_release) for s in in_specs]
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(steps,),
      memory_registers=40,
      in_specs=in_specs,
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=stages,
      compute_context=compute_context,
      pipeline_state=pipeline_state,
  )


# ------------------------------------------------------------------------------------------------
# The hand-written shared ring, fed by one TMA producer warpgroup (wg 2) in a branch of its own.

CONSUMER_REGISTERS = 232  # (512 − 40) / 2 rounded down to 8, as the pipelines above
PRODUCER_REGISTERS = 40


def opaque_zero(count):
  """0 for any ``count`` (a non-negative int32 loop count) below 2**30, which LLVM cannot prove.

  An SMEM tile whose address is fixed in a loop (GDPA's P tile; the q tile of a one-slot
  ring; the backward's resident K/V tiles), indexed at a constant, has its WGMMA descriptors and
  per-thread store addresses (8 to 16 64-bit values each) hoisted by LLVM out of every loop;
  they then live across the activation, the consumer's register peak, and ptxas spilled the
  round's state (the next item, ring phases) around them. Indexed through this inside the
  loop that uses it, the tile's addresses are recomputed there from one base, as the K/V
  ring slots' are."""
  return lax.shift_right_logical(count, 30)


def warp_specialize(producer, consumers) -> None:
  """Runs ``producer()`` in the producer warpgroup (wg 2, registers cut to
  :data:`PRODUCER_REGISTERS`) and ``consumers()`` in the two consumer warpgroups (raised to
  :data:`CONSUMER_REGISTERS`): the split ``consumer_pipeline`` makes for Pallas's pipeline."""
  wg = lax.axis_index("wg")

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    producer()

  @pl.when(wg < 2)
  def _consumers():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    consumers()


def ring_k_loop(ring, first_step, steps: int, carry, body=None, *, delay_release: int = 0):
  """Consumer: ``steps`` K steps from global step ``first_step`` of a hand-written ring (a
  :class:`SharedRing`): waits for each stage, runs ``body(idxs, *stage_buffers, carry) ->
  carry`` (the signature of a pipeline body; default: one WGMMA of
  the x and w stages into the accumulator ref ``carry``, then ``plgpu.wgmma_wait(delay_release)``),
  then releases the stage. The body must leave at most ``delay_release`` (0 or 1) WGMMA groups
  in flight: with 1, step s releases the stage of step s − 1 (whose WGMMA the body's wait
  retired), and the loop ends with ``wgmma_wait(0)`` and the last stage's release, so no WGMMA
  is in flight on return. Returns the carry."""
  if body is None:
    def body(idxs, x_stage, w_stage, acc):
      del idxs
      plgpu.wgmma(acc, x_stage, w_stage)
      plgpu.wgmma_wait(delay_release)
      return acc

  def step_body(k, carry):
    step = first_step + k
    buffers, produced, consumed = ring.stage_buffers(step)
    plgpu.barrier_wait(produced)
    carry = body((k,), *buffers, carry)
    if not delay_release:
      plgpu.barrier_arrive(consumed)
    else:  # the WGMMA of step k - 1 has completed: its stage is free
      pl.when(k > 0)(lambda: plgpu.barrier_arrive(ring.stage(step - 1)[3]))
    return carry

  carry = lax.fori_loop(0, steps, step_body, carry)
  if delay_release:
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(ring.stage(first_step + steps - 1)[3])
  return carry


def ring_produce(ring, step, *windows) -> None:
  """Producer: loads global step ``step`` (the GMEM ``windows`` of x, w and the ring's extra
  streams, in that order) into its stage of ``ring`` (as for :func:`ring_k_loop`, plus a
  ``stages`` count) once the stage's previous use was released."""
  buffers, produced, consumed = ring.stage_buffers(step)
  pl.when(step >= ring.stages)(lambda: plgpu.barrier_wait(consumed))
  for window, buffer in zip(windows, buffers, strict=True):
    plgpu.copy_gmem_to_smem(window, buffer, produced)


def ring_drain(ring, total_steps) -> None:
  """Producer, after its last load: waits for the releases of the last ``stages`` of its
  ``total_steps`` steps, so no barrier is left a phase ahead (and no stage is still being read
  when the kernel's SMEM is reused)."""
  @pl.loop(lax.max(total_steps - ring.stages, 0), total_steps)
  def _(step):
    plgpu.barrier_wait(ring.stage(step)[3])


# ------------------------------------------------------------------------------------------------
# Shared ring (TileConfig.pipeline = "ring"): the cooperative schedule (both consumer warpgroups
# work on one CTA tile, each on its rows) fed by a hand-written ring instead of Pallas's
# emit_pipeline, so the K loops of a CTA's tiles form one pipeline whatever the stage count and
# with a WGMMA left in flight across steps (cuBLAS's nvjet 128x256x64, 4 stages, does both).


@dataclasses.dataclass(frozen=True)
class SharedRing:
  """``x[s]`` (tile_m, tile_k) and ``w[s]`` (tile_k, tile_n) of stage s, and the stage's block
  of each ``extra`` stream; ``produced[s]`` completes when every TMA copy of the stage landed,
  ``consumed[s]`` when both consumer warpgroups released it. Steps are numbered across the
  CTA's tiles (its i-th tile's K step k is global step i · k_steps + k, in stage step mod
  stages), so the producer fills the next tile's stages while the consumers run the current
  one's epilogue. Every waiter waits for every phase of a barrier in order, so the parities
  Mosaic tracks stay right."""
  x: object
  w: object
  produced: object
  consumed: object
  stages: int
  extra: tuple = ()

  def stage(self, step):
    """(x_ref, w_ref, produced, consumed) of global step ``step``."""
    (x, w, *_), produced, consumed = self.stage_buffers(step)
    return x, w, produced, consumed

  def stage_buffers(self, step):
    """(buffers, produced, consumed) of global step ``step``: the buffers of x, w, then of the
    extra streams (:func:`ring_k_loop`, :func:`ring_produce`)."""
    slot = lax.rem(step, self.stages)
    buffers = (self.x.at[slot], self.w.at[slot], *(e.at[slot] for e in self.extra))
    return buffers, self.produced.at[slot], self.consumed.at[slot]


def shared_ring_allocs(stages: int, x: tuple, w: tuple, *extra: tuple) -> dict:
  """``pl.run_scoped`` allocations of a :class:`SharedRing` of ``stages`` stages (pass them as
  its fields): ``x``, ``w`` and each ``extra`` stream given as (block shape, dtype, transforms)
  of one stage."""
  stage = lambda block, dtype, transforms: plgpu.SMEM((stages, *block), dtype,
                                                      transforms=transforms)
  allocs = dict(
      x=stage(*x),
      w=stage(*w),
      # one arrival per TMA copy of a stage, one per consumer
      produced=plgpu.Barrier(num_arrivals=2 + len(extra), num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages))
  if extra:
    allocs["extra"] = tuple(stage(*e) for e in extra)
  return allocs
