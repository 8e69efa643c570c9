"""The tiling of the warp-specialized GEMM kernels: :class:`TileConfig` (tiling knobs only), and
:func:`cluster_split`, how the CTAs of a cluster share a row of output columns."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

SMEM_BYTES = 227 * 1024
"""Shared memory one CTA may allocate on Hopper (sm_90a), in bytes."""

L2_BYTES = 50 * 1024 * 1024
"""L2 cache of the H100/H200 (GH100), in bytes."""

INTERPRET_NUM_CTAS = 2
"""Persistent CTAs in interpret mode: >1 so the tile loop and its carries are exercised, small so
the CPU run stays short (interpret mode runs the CTAs one after the other)."""

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Operand dtypes of the WGMMA kernels."""

CLUSTER_SIZES = (1, 2, 4, 8)
"""CTAs that may share a row block (8 is the portable cluster limit on Hopper)."""

MAX_TILE_N = 256
"""Widest N tile of one CTA (the largest WGMMA N; the accumulator lives in registers)."""

MAX_N_TILES = 4
"""N tiles one CTA loops over when a cluster of 8 is not wide enough (so N ≤ 8192)."""


def cluster_split(n: int) -> tuple[int, int, int] | None:
  """(cluster, tile_n, n_tiles): how the CTAs of a cluster share a row of ``n`` output columns
  (the post-norm forward's N; the pre-norm dx kernel's K): the smallest cluster whose CTAs get
  one 64-multiple N tile of ≤ 256 columns; past 8 · 256 columns, 8 CTAs of up to 4 N tiles each
  (the widest tile). None where ``n`` does not split so."""
  for c in CLUSTER_SIZES:
    if n % c == 0 and (n // c) % 64 == 0 and n // c <= MAX_TILE_N:
      return c, n // c, 1
  c = max(CLUSTER_SIZES)
  for tile_n in (256, 192, 128):
    if n % (c * tile_n) == 0 and n // (c * tile_n) <= MAX_N_TILES:
      return c, tile_n, n // (c * tile_n)
  return None


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
    stats_once: (pre-norm forward) a CTA computes all N tiles of a row block in turn,
      accumulating the row statistics only in the K loop of the first one (later ones read them
      back from SMEM), so the statistics cost once per row instead of once per N tile. Needs the
      row block of x (tile_m × K) of every CTA to stay in L2 while its N tiles run.
    delay_release: WGMMA groups a consumer leaves in flight across K steps, 0 or 1. With 1 (as
      in JAX's ``hopper_matmul_mgpu.py``) the tensor cores keep working on step s while the
      consumer waits for step s + 1's stage, and each stage is released one step later. Pallas's
      pipeline cannot chain such K loops across tiles; a K loop with one step runs with 0
      (:func:`pallas_norm.mgpu.pipeline.delay_release_for`).
    pipeline: how the K loops are fed. "ring": one hand-written ring both consumers read
      (:class:`pallas_norm.mgpu.pipeline.SharedRing`), numbered across the CTA's tiles, so it is always chained, takes
      any stage count, and can keep a WGMMA in flight (``delay_release`` = 1), as cuBLAS's
      cooperative 128×256 kernel does: what every kernel's ``pick_config`` takes, but for one
      exception. "pallas": ``plgpu.emit_pipeline_warp_specialized`` (chained across a CTA's
      tiles when the stages divide the K steps and ``delay_release`` is 0): the post-norm
      forward with several N tiles per CTA, where the ring measured slower (not understood;
      ``benchmarks/EXPERIMENTS.md``).

  A kernel refuses a non-default value of an option it does not implement, with a ValueError
  from :func:`reject_unused_options`.
  """

  tile_m: int = 128
  tile_n: int = 256
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
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
    if self.pipeline not in ("pallas", "ring"):
      raise ValueError(f"pipeline must be 'pallas' or 'ring', got {self.pipeline!r}")

  @property
  def wg_tile_m(self) -> int:
    """Rows owned by one consumer warpgroup."""
    return self.tile_m // 2


def reject_unused_options(cfg: TileConfig, kernel: str, fields: tuple[str, ...]) -> None:
  """ValueError naming the ``fields`` of ``cfg`` that ``kernel`` does not implement but were set
  away from their defaults: a config must not silently do less than it says."""
  defaults = TileConfig()
  changed = [f for f in fields if getattr(cfg, f) != getattr(defaults, f)]
  if changed:
    raise ValueError(f"the {kernel} kernel does not implement TileConfig."
                     f"{', '.join(changed)} (set to "
                     f"{', '.join(repr(getattr(cfg, f)) for f in changed)}): leave the default")
