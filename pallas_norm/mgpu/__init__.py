"""Shared pieces of the Pallas Mosaic-GPU (Hopper, sm_90a) kernels of pallas-norm.

* :mod:`.config`: :class:`TileConfig`, the tiling of a warp-specialized GEMM kernel, and
  :func:`cluster_split`, how the CTAs of a cluster share a row of output columns.
* :mod:`.device`: SM counts, resident clusters, SMEM swizzles, GPU interpret mode
  (:func:`interpret_params`, :func:`races_found`).
* :mod:`.pipeline`: the K-loop pipelines (Pallas's, chained across tiles, and the shared ring).
* :mod:`.gemm`: the persistent warp-specialized GEMM body the fused GEMM kernels run through
  hooks (after JAX's ``pallas/ops/gpu/hopper_matmul_mgpu.py``), imported as a module.
* :mod:`.row_stats`: per-thread partial row sums in the WGMMA register layout.
* :mod:`.exchange`: per-row partial sums shared by the CTAs of a cluster (the post-norm
  forward's row statistics, the pre-norm dx kernel's row sums), imported as a module.
* :mod:`.store`: epilogue stores through SMEM.

The names are re-exported here, so kernels use ``mgpu.TileConfig``, ``mgpu.ring_k_loop`` and so
on.
"""

from pallas_norm.mgpu.config import (CLUSTER_SIZES, INTERPRET_NUM_CTAS, L2_BYTES,
                                     MAX_N_TILES, MAX_TILE_N, SMEM_BYTES, SUPPORTED_DTYPES, TileConfig,
                                     cluster_split, reject_unused_options)
from pallas_norm.mgpu.device import (RESIDENT_SHARE, interpret_params, num_sms, pad_rows,
                                     persistent_clusters, races_found, resident_clusters,
                                     swizzle_transforms)
from pallas_norm.mgpu.pipeline import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, SharedRing,
                                       delay_release_for, opaque_zero, pipeline_stages,
                                       plan_delay_release, ring_drain, ring_k_loop, ring_produce,
                                       warp_specialize)
from pallas_norm.mgpu.row_stats import (LANE_COLS, lane_partial_sum, lane_partial_zeros,
                                        lane_slices, tree_sum)
