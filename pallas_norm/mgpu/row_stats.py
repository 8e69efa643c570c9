"""Per-thread partial row sums of tiles in the WGMMA register layout, with no cross-lane traffic
(the in-loop row reductions of the pre-norm forward and of the dx kernel)."""

from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu


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
