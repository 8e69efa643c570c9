"""Helpers shared by the Pallas Mosaic-GPU (Hopper, sm_90a) kernels of pallas-norm.

* :class:`TileConfig`: the tiling of a warp-specialized GEMM kernel (CTA tile, K step, pipeline
  depth, epilogue tile, grid order, where the row statistics are reduced).
* :func:`interpret_params`, :func:`races_found`, :func:`reset_interpret_state`: GPU interpret
  mode (the kernels run on the CPU, with a race detector and NaN-filled uninitialized memory).
* :func:`num_sms`, :func:`swizzle_transforms`, :data:`SMEM_BYTES`: device facts and the SMEM
  layout every WGMMA operand needs.
* :func:`lane_partial_zeros`, :func:`lane_partial_sum` (:func:`lane_slices`, :func:`tree_sum`):
  per-thread partial row sums of tiles in the WGMMA register layout, with no cross-lane traffic
  (the in-loop row reductions of the pre-norm forward and of the dx kernel).

The structure of the kernels follows JAX's ``pallas/ops/gpu/hopper_matmul_mgpu.py`` (persistent
grid over the SMs, a TMA producer warpgroup, two WGMMA consumer warpgroups).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
from jax import lax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = [
    "SMEM_BYTES",
    "INTERPRET_NUM_CTAS",
    "TileConfig",
    "interpret_params",
    "races_found",
    "reset_interpret_state",
    "num_sms",
    "swizzle_transforms",
    "pad_rows",
    "SUPPORTED_DTYPES",
    "LANE_COLS",
    "lane_slices",
    "tree_sum",
    "lane_partial_zeros",
    "lane_partial_sum",
    "consumer_pipeline",
    "pipeline_stages",
    "delay_release_for",
    "plan_delay_release",
    "stages_for",
    "reject_unused_options",
    "tile_pipeline_state",
    "drain_single_tile_pipeline",
    "run_tile_pipeline",
    "resident_clusters",
    "persistent_clusters",
    "warp_specialize",
    "SharedRing",
    "shared_ring_allocs",
    "ring_produce",
    "ring_drain",
    "ring_k_loop",
]

SMEM_BYTES = 227 * 1024
"""Shared memory one CTA may allocate on Hopper (sm_90a), in bytes."""

INTERPRET_NUM_CTAS = 2
"""Persistent CTAs in interpret mode: >1 so the tile loop and its carries are exercised, small so
the CPU run stays short (interpret mode runs the CTAs one after the other)."""

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Operand dtypes of the WGMMA kernels."""


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tiling of a warp-specialized GEMM kernel with two consumer warpgroups.

  The two consumer warpgroups split the CTA tile along M: each owns ``tile_m // 2`` rows and all
  ``tile_n`` columns, so the per-row statistics of a row are computed by exactly one warpgroup.

  Attributes:
    tile_m: rows of a CTA tile, 128 or 256 (64 or 128 per consumer warpgroup).
    tile_n: columns of a CTA tile, a multiple of 64 up to 256 (the WGMMA N of one instruction).
    tile_k: K step of the pipeline, a multiple of 32 (64: the 128-byte swizzle of a bf16 row).
    max_concurrent_steps: pipeline stages in SMEM (the kernel lowers it when SMEM is short or
      K has fewer steps).
    epi_tile_m, epi_tile_n: the epilogue stores the output through SMEM in tiles of this size;
      must divide (tile_m // 2, tile_n).
    grid_minor_dim: the output-tile dimension that varies fastest over the persistent loop.
      "n" sweeps the N tiles of a row block (strips of ``grid_tile_width`` row blocks) before the
      next one: CTAs running at the same time share x tiles, so x is read from HBM about once and
      w stays in L2 (right for M ≫ N). "m" sweeps M first (JAX's Hopper matmul default).
    grid_tile_width: strip width of :func:`plgpu.planar_snake` over the tile grid.
    stats_once: (pre-norm forward) a CTA computes all N tiles of a row block in turn,
      accumulating the row statistics only in the K loop of the first one (later ones read them
      back from SMEM), so the statistics cost once per row instead of once per N tile. Needs the
      row block of x (tile_m × K) of every CTA to stay in L2 while its N tiles run.
    delay_release: WGMMA groups a consumer leaves in flight across K steps, 0 or 1. With 1 (as
      in JAX's ``hopper_matmul_mgpu.py``) the tensor cores keep working on step s while the
      consumer waits for step s + 1's stage, and each stage is released one step later. Pallas's
      pipeline cannot chain such K loops across tiles; a K loop with one step runs with 0
      (:func:`delay_release_for`).
    pipeline: how the K loops are fed. "pallas": ``plgpu.emit_pipeline_warp_specialized``
      (chained across a CTA's tiles when the stages divide the K steps and ``delay_release`` is
      0). "ring": one hand-written ring both consumers read (:class:`SharedRing`), numbered
      across the CTA's tiles, so it is always chained, takes any stage count, and can keep a
      WGMMA in flight (``delay_release`` = 1), as cuBLAS's cooperative 128×256 kernel does.

  A kernel refuses a non-default value of an option it does not implement, with a ValueError
  from :func:`reject_unused_options`.
  """

  tile_m: int = 128
  tile_n: int = 256
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  grid_minor_dim: Literal["m", "n"] = "n"
  grid_tile_width: int = 1
  stats_once: bool = False
  delay_release: int = 0
  pipeline: Literal["pallas", "ring"] = "pallas"

  def __post_init__(self):
    if self.tile_m not in (128, 256):
      raise ValueError(f"tile_m must be 128 or 256, got {self.tile_m}")
    if self.tile_n % 64 or not 64 <= self.tile_n <= 256:
      raise ValueError(f"tile_n must be a multiple of 64 in [64, 256], got {self.tile_n}")
    if self.tile_k % 32 or self.tile_k <= 0:
      raise ValueError(f"tile_k must be a positive multiple of 32, got {self.tile_k}")
    if isinstance(self.delay_release, bool) or self.delay_release not in (0, 1):
      raise ValueError(f"delay_release must be 0 or 1, got {self.delay_release}")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
    if self.wg_tile_m % self.epi_tile_m or self.epi_tile_m % 64:
      raise ValueError(f"epi_tile_m={self.epi_tile_m} must be a multiple of 64 dividing "
                       f"tile_m // 2 = {self.wg_tile_m}")
    if self.tile_n % self.epi_tile_n or self.epi_tile_n % 8:
      raise ValueError(f"epi_tile_n={self.epi_tile_n} must be a multiple of 8 dividing "
                       f"tile_n = {self.tile_n}")
    if self.grid_minor_dim not in ("m", "n"):
      raise ValueError(f"grid_minor_dim must be 'm' or 'n', got {self.grid_minor_dim!r}")
    if self.grid_tile_width < 1:
      raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")
    if self.pipeline not in ("pallas", "ring"):
      raise ValueError(f"pipeline must be 'pallas' or 'ring', got {self.pipeline!r}")

  @property
  def wg_tile_m(self) -> int:
    """Rows owned by one consumer warpgroup."""
    return self.tile_m // 2


def interpret_params(*, detect_races: bool = True) -> plgpu.InterpretGPUParams:
  """GPU interpret-mode parameters used by the tests: race detection, NaN-filled SMEM/outputs.

  Out-of-bounds *reads* by TMA are filled with zeros (as the hardware does); any other
  out-of-bounds read raises.
  """
  return plgpu.InterpretGPUParams(detect_races=detect_races, uninitialized_memory="nan")


def races_found() -> bool:
  """Whether the race detector found a race in the last kernel run in interpret mode.

  The interpreter keeps one race-detection state per kernel run (a new one at each run), so call
  this after the outputs of the kernel are ready (``jax.block_until_ready``).
  """
  # Not re-exported by jax.experimental.pallas.mosaic_gpu in jax 0.11.2.
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  races = gpu_callbacks._races  # pylint: disable=protected-access
  return bool(races is not None and races.races_found)


def reset_interpret_state() -> None:
  """Clears the interpreter's global state (needed after a kernel raised in interpret mode)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  interpret_pallas_call.reset_gpu_interpret_mode_state()


def num_sms(interpret: bool) -> int:
  """Persistent CTAs to launch: the SM count of the default GPU (132 when the default device
  is not a GPU), or :data:`INTERPRET_NUM_CTAS` in interpret mode."""
  if interpret:
    return INTERPRET_NUM_CTAS
  if abstract_device := jax.sharding.get_abstract_mesh().abstract_device:
    return abstract_device.num_cores
  # Without a GPU (e.g. jax.export for "cuda" on a CPU host) assume an H100/H200 (132 SMs).
  return getattr(jax.devices()[0], "core_count", None) or 132


RESIDENT_SHARE = {4: 120 / 132, 8: 120 / 132}
"""Share of the SMs that clusters of 4 and 8 CTAs can fill at once: a cluster must sit in one
GPC, and GPCs have uneven SM counts (some are harvested). Measured on the H200 (132 SMs,
2026-11-30, ``gpu_matmul_norm_check.py --grid-sweep``, post-norm 262144×512×N): clusters of 4:
33 launched → 1683 µs, 32 → 1718, 30 → 1022, 29 → 1039; clusters of 8: 16 → 3648, 15 → 2167,
14 → 2260. So 30 clusters of 4 and 15 of 8 fit at once, and one more runs as a second wave.
Other chips may differ."""


def resident_clusters(cluster: int, interpret: bool) -> int:
  """Persistent clusters of ``cluster`` CTAs to launch: those that fit on the GPU at once.

  One CTA per SM (the GEMM kernels take most of the SMEM). Clusters of 1 or 2 fill every SM;
  larger ones fill :data:`RESIDENT_SHARE` of them. Launching more makes the surplus clusters
  run after the others finish, which nearly doubled the post-norm kernel's time.
  """
  sms = num_sms(interpret)
  if interpret or cluster <= 2:
    return max(1, sms // cluster)
  return max(1, int(sms * RESIDENT_SHARE.get(cluster, RESIDENT_SHARE[8]) + 1e-9) // cluster)


def persistent_clusters(cluster: int, units: int, interpret: bool) -> int:
  """Clusters the persistent grid launches for ``units`` work units (row blocks or tiles)."""
  return max(1, min(resident_clusters(cluster, interpret), units))


def pad_rows(a, pad: int):
  """``a`` (M, N) with ``pad`` zero rows appended (a copy; ``a`` itself when ``pad`` is 0): whole
  8-row groups for Mosaic's tiled TMA."""
  return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def swizzle_transforms(minor_elems: int, dtype, *, tiled: bool = True) -> tuple:
  """SMEM transforms for a tile whose minor dim has ``minor_elems`` elements: the widest swizzle,
  with the 8-row tiling that WGMMA operands in SMEM need when ``tiled``.

  Untiled (swizzle only) needs ``minor_elems * itemsize <= 128`` bytes (one swizzle span per
  row); its TMA is a plain 2-D box, so the GMEM array may have any number of rows, whereas
  Mosaic's tiled TMA needs the row count to be a multiple of 8 (or below 8).
  """
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  if not tiled:
    if minor_elems * itemsize > swizzle:
      raise ValueError(f"an untiled swizzled tile needs rows of <= {swizzle} bytes, got "
                       f"{minor_elems} x {itemsize}")
    return (plgpu.SwizzleTransform(swizzle),)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


# ------------------------------------------------------------------------------------------------
# Per-thread partial row sums in the WGMMA register layout.

LANE_COLS = 8
"""WGMMA register layout: a thread holds 2 adjacent columns of every 8 (4 threads per row), so
the 8-column slices of a tile can be summed elementwise without crossing lanes."""


def lane_slices(x):
  """The 8-column slices of a (rows, cols) tile: summing them never crosses lanes."""
  return [x[:, j:j + LANE_COLS] for j in range(0, x.shape[1], LANE_COLS)]


def tree_sum(values):
  """Pairwise sum of a list of same-shape arrays (a shallower dependency chain than a fold)."""
  while len(values) > 1:
    values = [a + b if b is not None else a
              for a, b in zip(values[::2], values[1::2] + [None] * (len(values) % 2))]
  return values[0]


def lane_partial_zeros(rows: int):
  """Zero f32 partial row sums (rows, :data:`LANE_COLS`) in the WGMMA layout."""
  return plgpu.layout_cast(jnp.zeros((rows, LANE_COLS), jnp.float32), plgpu.Layout.WGMMA)


def lane_partial_sum(x):
  """Per-thread partial row sums (rows, :data:`LANE_COLS`) of a (rows, cols) tile in the WGMMA
  layout, cols a multiple of 8: the sum of its 8-column slices. ``jnp.sum(axis=1)`` of the
  result (once per tile, across lanes) is the row sum."""
  return tree_sum(lane_slices(x))


def reject_unused_options(cfg: TileConfig, kernel: str, fields: tuple[str, ...]) -> None:
  """ValueError naming the ``fields`` of ``cfg`` that ``kernel`` does not implement but were set
  away from their defaults: a config must not silently do less than it says."""
  defaults = TileConfig()
  changed = [f for f in fields if getattr(cfg, f) != getattr(defaults, f)]
  if changed:
    raise ValueError(f"the {kernel} kernel does not implement TileConfig."
                     f"{', '.join(changed)} (set to "
                     f"{', '.join(repr(getattr(cfg, f)) for f in changed)}): leave the default")


def pipeline_stages(steps: int, max_stages: int, delay_release: int = 0) -> tuple[int, bool]:
  """(stages, chained across tiles) for Pallas's pipeline over a K loop of ``steps`` steps with
  room for ``max_stages`` stages: as many stages as fit, chained across a CTA's tiles when that
  count divides ``steps`` (a pipeline of pipelines needs it) and no WGMMA stays in flight across
  steps (``delay_release`` 0: Pallas cannot chain the others). Chaining never costs a stage: on
  the H200 at 262144×512×512, 2 chained stages ran 249 µs, 3 per-tile ones 226 and 4 chained
  ones 217 (per-tile: 233)."""
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
  registers; session 7's full GPU run); on the ring ``cfg.delay_release`` with 2+ stages; else
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
  """Consumer: ``steps`` K steps from global step ``first_step`` of a hand-written ring (any
  object with ``stage(step) -> (x_ref, w_ref, produced_barrier, consumed_barrier)``): waits
  for each stage, runs ``body(idxs, x_stage, w_stage, carry) -> carry`` (the signature of a
  pipeline body; default: one WGMMA into the accumulator ref ``carry``, then
  ``plgpu.wgmma_wait(delay_release)``), then releases the stage. The body must leave at most
  ``delay_release`` (0 or 1) WGMMA groups in flight: with 1, step s releases the stage of step
  s − 1 (whose WGMMA the body's wait retired), and the loop ends with ``wgmma_wait(0)`` and the
  last stage's release, so no WGMMA is in flight on return. Returns the carry."""
  if body is None:
    def body(idxs, x_stage, w_stage, acc):
      del idxs
      plgpu.wgmma(acc, x_stage, w_stage)
      plgpu.wgmma_wait(delay_release)
      return acc

  def step_body(k, carry):
    step = first_step + k
    x_stage, w_stage, produced, consumed = ring.stage(step)
    plgpu.barrier_wait(produced)
    carry = body((k,), x_stage, w_stage, carry)
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


def ring_produce(ring, step, x_window, w_window) -> None:
  """Producer: loads global step ``step`` (x and w windows in GMEM) into its stage of ``ring``
  (as for :func:`ring_k_loop`, plus a ``stages`` count) once the stage's previous use was
  released."""
  x_ref, w_ref, produced, consumed = ring.stage(step)
  pl.when(step >= ring.stages)(lambda: plgpu.barrier_wait(consumed))
  plgpu.copy_gmem_to_smem(x_window, x_ref, produced)
  plgpu.copy_gmem_to_smem(w_window, w_ref, produced)


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
  """``x[s]`` (tile_m, tile_k) and ``w[s]`` (tile_k, tile_n) of stage s; ``produced[s]``
  completes when both TMA copies landed, ``consumed[s]`` when both consumer warpgroups released
  it. Steps are numbered across the CTA's tiles (its i-th tile's K step k is global step
  i · k_steps + k, in stage step mod stages), so the producer fills the next tile's stages while
  the consumers run the current one's epilogue. Every waiter waits for every phase of a barrier
  in order, so the parities Mosaic tracks stay right."""
  x: object
  w: object
  produced: object
  consumed: object
  stages: int

  def stage(self, step):
    """(x_ref, w_ref, produced, consumed) of global step ``step`` (:func:`ring_k_loop`)."""
    slot = lax.rem(step, self.stages)
    return self.x.at[slot], self.w.at[slot], self.produced.at[slot], self.consumed.at[slot]


def shared_ring_allocs(tile_m: int, tile_k: int, tile_n: int, dtype, stages: int, *,
                       x_transforms: tuple, w_transforms: tuple) -> dict:
  """``pl.run_scoped`` allocations of a :class:`SharedRing` (pass them as its fields)."""
  return dict(
      x=plgpu.SMEM((stages, tile_m, tile_k), dtype, transforms=x_transforms),
      w=plgpu.SMEM((stages, tile_k, tile_n), dtype, transforms=w_transforms),
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # one per TMA copy
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages))  # one per consumer
