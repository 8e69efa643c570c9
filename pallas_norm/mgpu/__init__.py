"""Shared pieces of the Pallas Mosaic-GPU (Hopper, sm_90a) kernels of pallas-norm.

* :mod:`.config`: :class:`TileConfig`, the tiling of a warp-specialized GEMM kernel.
* :mod:`.device`: SM counts, resident clusters, SMEM swizzles, GPU interpret mode
  (:func:`interpret_params`, :func:`races_found`, :func:`reset_interpret_state`).
* :mod:`.pipeline`: the K-loop pipelines (Pallas's, chained across tiles, and the shared ring).
* :mod:`.row_stats`: per-thread partial row sums in the WGMMA register layout.

The structure of the kernels follows JAX's ``pallas/ops/gpu/hopper_matmul_mgpu.py`` (persistent
grid over the SMs, a TMA producer warpgroup, two WGMMA consumer warpgroups). The names are
re-exported here, so kernels use ``mgpu.TileConfig``, ``mgpu.ring_k_loop`` and so on.
"""

from pallas_norm.mgpu.config import (INTERPRET_NUM_CTAS, SMEM_BYTES, SUPPORTED_DTYPES,
                                     TileConfig, reject_unused_options)
from pallas_norm.mgpu.device import (RESIDENT_SHARE, interpret_params, num_sms, pad_rows,
                                     persistent_clusters, races_found, reset_interpret_state,
                                     resident_clusters, swizzle_transforms)
from pallas_norm.mgpu.pipeline import (CONSUMER_REGISTERS, PRODUCER_REGISTERS, SharedRing,
                                       consumer_pipeline, delay_release_for,
                                       drain_single_tile_pipeline, pipeline_stages,
                                       plan_delay_release, ring_drain, ring_k_loop, ring_produce,
                                       run_tile_pipeline, shared_ring_allocs, stages_for,
                                       tile_pipeline_state, warp_specialize)
from pallas_norm.mgpu.row_stats import (LANE_COLS, lane_partial_sum, lane_partial_zeros,
                                        lane_slices, tree_sum)
