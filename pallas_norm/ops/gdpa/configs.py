"""Tiling of the GDPA forward kernel (:mod:`pallas_norm.ops.gdpa.mosaic`): knobs only."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_norm import mgpu

BLOCK_Q = 64
"""Query rows per consumer warpgroup step: the M of one WGMMA (one warpgroup owns 64 rows)."""

PAD_CHUNK_BLOCKS = 8
"""Padding rows (past ``q_offsets[-1]``) are zeroed in chunks of this many q blocks, one work
item each, so a large spare capacity is spread over many CTAs instead of one."""


def check_block_kv(block_kv: int) -> None:
  """Keys per WGMMA step of the attention kernels: a multiple of 64 (the 128-byte swizzle of a
  bf16 row) up to 256 (the largest WGMMA N)."""
  if block_kv % 64 or not 64 <= block_kv <= 256:
    raise ValueError(f"block_kv must be a multiple of 64 in [64, 256], got {block_kv}")


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of the GDPA forward kernel.

  Attributes:
    block_kv: keys per WGMMA step (the N of the score product, the K of the P·V product); a
      multiple of 64 that divides the resident K/V length.
    q_stages: q blocks each consumer warpgroup may hold in SMEM (the TMA producer fills the
      next while the current one is computed), at least 1.
    kv_stages: None: a (sample, head)'s K/V window stays resident in SMEM for all its q blocks
      (loaded once). An int (>= 2): K/V are streamed per q block through a ring of that many
      key blocks per consumer (any K/V length; each q block re-reads them, mostly from L2).
    kv_buffers: resident K/V buffers, 1 or 2: with 2 the producer loads the next work item's
      K/V while the consumers run the current one. Ignored when K/V are streamed.
  """

  block_kv: int = 64
  q_stages: int = 2
  kv_stages: int | None = None
  kv_buffers: int = 2

  def __post_init__(self):
    check_block_kv(self.block_kv)
    if self.q_stages < 1:
      raise ValueError(f"q_stages must be >= 1, got {self.q_stages}")
    if self.kv_stages is not None and self.kv_stages < 2:
      raise ValueError(f"kv_stages must be None or >= 2, got {self.kv_stages}")
    if self.kv_buffers not in (1, 2):
      raise ValueError(f"kv_buffers must be 1 or 2, got {self.kv_buffers}")


def resident_kv_len(kv_len_bound: int) -> int:
  """Rows of K (and of V) the kernel keeps in SMEM per (sample, head): the bound rounded up to
  64 (the WGMMA operand tile)."""
  return -(-kv_len_bound // 64) * 64


def smem_bytes(kv_rows: int, head_dim: int, dtype, out_dtype, cfg: Config) -> int:
  """SMEM of one CTA: K and V (``kv_buffers`` resident windows, or each consumer's ring), each
  consumer's q ring, P tile and output tile."""
  item = jnp.dtype(dtype).itemsize
  kv_blocks = (cfg.kv_buffers * kv_rows if cfg.kv_stages is None
               else 2 * cfg.kv_stages * cfg.block_kv)
  kv = 2 * kv_blocks * head_dim * item
  q = 2 * cfg.q_stages * BLOCK_Q * head_dim * item
  p = 2 * BLOCK_Q * cfg.block_kv * item
  o = 2 * BLOCK_Q * head_dim * jnp.dtype(out_dtype).itemsize
  return kv + q + p + o + 1024  # barriers and alignment


def pick_config(kv_rows: int, head_dim: int, dtype, out_dtype,
                extra_bytes: int = 0) -> Config | None:
  """Resident K/V when they fit, double-buffered if possible: two K/V buffers with the widest
  key step that divides the window and 2 q stages, then 1, then key steps of 64 (a smaller P
  tile); else one K/V buffer (2, then 1 q stages). Otherwise K/V streamed through 2-slot rings
  of 64-key blocks. None when nothing fits. ``extra_bytes``: SMEM a fused kernel adds to this
  kernel's (the flash_norm_attention kernel's norm vectors and cluster exchange)."""
  block_kv = 128 if kv_rows % 128 == 0 else 64
  candidates = [Config(block_kv=block_kv, q_stages=stages) for stages in (2, 1)]
  candidates += [Config(block_kv=64, q_stages=1)]
  candidates += [Config(block_kv=block_kv, q_stages=stages, kv_buffers=1) for stages in (2, 1)]
  candidates += [Config(block_kv=64, q_stages=stages, kv_stages=2) for stages in (2, 1)]
  for cfg in candidates:
    if smem_bytes(kv_rows, head_dim, dtype, out_dtype, cfg) + extra_bytes <= mgpu.SMEM_BYTES:
      return cfg
  return None
