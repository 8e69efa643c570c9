"""Epilogue stores of the Hopper kernels: row-exact TMA stores of a tile through SMEM."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_norm.mgpu.device import swizzle_transforms


def row_store_smem(rows: int, cols: int, dtype, count: int = 1) -> plgpu.SMEM:
  """SMEM for :func:`store_rows`: ``count`` tiles of (rows, cols), each kept as column chunks
  of at most 128 bytes with the widest swizzle and no 8-row tiling, so a TMA store may start
  at any row. Shape (count, chunks, rows, cols / chunks)."""
  chunks = max(1, cols * jnp.dtype(dtype).itemsize // 128)
  return plgpu.SMEM((count, chunks, rows, cols // chunks), dtype,
                    transforms=swizzle_transforms(cols // chunks, dtype, tiled=False))


def store_rows(tile, chunk_smem, dst_at, row0, lo, rows) -> None:
  """Writes rows ``[lo, lo + rows)`` (traced, within the tile) of ``tile`` (R, C), a register
  array, to ``dst_at(row_slice, col_slice)`` for the rows ``[row0 + lo, row0 + lo + rows)``:
  :func:`stage` then :func:`copy_rows`.

  ``chunk_smem`` (chunks, R, C / chunks) is one tile of :func:`row_store_smem`; ``dst_at`` maps
  a row and a column ``pl.ds`` to the GMEM ref view to write (e.g.
  ``o_ref.at[rows, head, cols]``). The caller waits for the last stores before the kernel ends
  (``plgpu.wait_smem_to_gmem(0, wait_read_only=True)``).
  """
  stage(tile, chunk_smem)
  copy_rows(chunk_smem, dst_at, row0, lo, rows)


def stage(tile, chunk_smem) -> None:
  """Writes the register array ``tile`` (R, C) into ``chunk_smem`` (a tile of
  :func:`row_store_smem`) for TMA stores, once the previous stores have read it."""
  chunks, _, chunk_cols = chunk_smem.shape
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for c in range(chunks):
    chunk_smem[c] = tile[:, c * chunk_cols:(c + 1) * chunk_cols]
  plgpu.commit_smem()


def copy_rows(chunk_smem, dst_at, row0, lo, rows) -> None:
  """TMA stores of rows ``[lo, lo + rows)`` of the tile :func:`stage` wrote, to GMEM rows
  ``[row0 + lo, row0 + lo + rows)`` through ``dst_at`` (as :func:`store_rows`): one store per
  set bit of ``rows`` and per column chunk (the store ladder of JAX's ``ragged_dot_mgpu.py``).
  Nothing waits: a staged tile that does not change (zeros) serves any number of them."""
  chunks, tile_rows, chunk_cols = chunk_smem.shape
  offset = lo
  size = tile_rows
  while size:
    @pl.when((rows & size) != 0)
    def _(size=size, offset=offset):
      for c in range(chunks):
        plgpu.copy_smem_to_gmem(chunk_smem.at[c, pl.ds(offset, size)],
                                dst_at(pl.ds(row0 + offset, size),
                                       pl.ds(c * chunk_cols, chunk_cols)))
    offset = offset + (rows & size)
    size //= 2
