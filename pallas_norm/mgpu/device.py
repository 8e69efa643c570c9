"""Device facts and GPU interpret mode for the Hopper kernels: SM counts and resident clusters,
the SMEM layouts WGMMA operands need, and the interpret-mode parameters the tests use (race
detection, NaN-filled uninitialized memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm.mgpu.config import INTERPRET_NUM_CTAS

# The GPU interpreter's first run imports the Mosaic (TPU) interpreter, whose imports register
# a config option (``pallas_fuser_disable_nested_fuse``, a part of every jit cache key). Inside
# the first interpret-mode trace that made every function jitted before it trace and compile
# twice; imported here, with the package, it does not.
try:  # a private module of jax 0.11.2 (not re-exported); a later JAX may move it
  # pylint: disable=unused-import
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interpreter
except Exception:  # pragma: no cover  # pylint: disable=broad-exception-caught
  pass  # only the retrace's cost is at stake: never let it break the package's import


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
GPC, and GPCs have uneven SM counts (some are harvested). On the H200 (132 SMs) 30 clusters of
4 and 15 of 8 fit at once, and one more runs as a second wave that costs ~1.6× (measured by a
sweep of the launched count: ``benchmarks/EXPERIMENTS.md``, post-norm GEMM, ``max_clusters``).
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
