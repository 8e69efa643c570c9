"""Arrive and wait on a Pallas ``plgpu.ClusterBarrier`` with cluster-scope memory semantics.

Mosaic GPU (jax 0.11.2) lowers ``plgpu.barrier_arrive`` on a cluster barrier to ``mapa`` +
``mbarrier.arrive.shared::cluster.b64`` (PTX's default: a release at CTA scope) and
``plgpu.barrier_wait`` to ``mbarrier.try_wait.parity.shared::cta.b64`` (an acquire at CTA
scope). Neither orders shared-memory accesses for a peer CTA, so an exchange through
distributed shared memory had to put ``fence.acq_rel.cluster`` around them, executed by every
thread of the warpgroup. :func:`arrive_release` arrives with ``.release.cluster`` and
:func:`wait_acquire` waits with ``.acquire.cluster`` (PTX ISA 8.0, sm_90): the barrier itself
then publishes the writes before the arrive to the reads after the wait (through the warpgroup
barrier before the arrive, which orders the other threads' accesses before the arriving
thread's release), and no fence is needed. Same barriers, same arrival counts and phase
tracking as Mosaic's own lowering (``CollectiveBarrierRef.arrive``, ``BarrierRef.wait``), only
the PTX differs.

These are Pallas primitives with Mosaic GPU lowering rules only: GPU interpret mode has no
cluster of more than one CTA, so the kernels bind them only for c > 1.
"""

from __future__ import annotations

from jax import tree_util
from jax._src import core as jax_core
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives
from jax._src.state import primitives as state_primitives
import jax.experimental.mosaic.gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref

# pylint: disable=protected-access

_ARRIVE_PTX = """
{
    .reg .b32 mapped_addr;
    @$0 mapa.shared::cluster.u32 mapped_addr, $1, $2;
    @$0 mbarrier.arrive.release.cluster.shared::cluster.b64 _, [mapped_addr];
}"""

# Braces scope the labels, so the form can be inlined many times in one kernel (as CUTLASS's
# ClusterBarrier::wait does).
_WAIT_PTX = """
{
    .reg .pred done;
    wait_again:
    mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$0], $1, $2;
    @!done bra wait_again;
}"""


def _barrier_at(ctx, barrier, flat_transforms, transforms_treedef):
  transforms = transforms_treedef.unflatten(flat_transforms)
  base_index = mgpu_primitives._get_barrier_base_index(ctx.avals_in[0], transforms)
  if base_index is not None:
    barrier = barrier[base_index]
  if not isinstance(barrier, mgpu_utils.CollectiveBarrierRef):
    raise TypeError(f"a cluster barrier (plgpu.ClusterBarrier) is needed, got {barrier}")
  return barrier


def _abstract_eval(barrier, *args, **params):
  del args, params
  mgpu_primitives._check_ref(barrier, "barrier", gpu_core.SMEM)
  return (), {gpu_core._memory_effect}


arrive_release_p = jax_core.Primitive("cluster_barrier_arrive_release")
arrive_release_p.multiple_results = True
arrive_release_p.def_effectful_abstract_eval(_abstract_eval)

wait_acquire_p = jax_core.Primitive("cluster_barrier_wait_acquire")
wait_acquire_p.multiple_results = True
wait_acquire_p.def_effectful_abstract_eval(_abstract_eval)


def _arrive_lowering(ctx, barrier, *flat_transforms, transforms_treedef):
  """``CollectiveBarrierRef.arrive``'s predicate (thread 8j of the warpgroup signals cluster
  CTA j where j is in the barrier's cluster mask) with a cluster-scope release."""
  ref = _barrier_at(ctx, barrier, flat_transforms, transforms_treedef)
  if ref.cluster_mask is None or ref.leader_tracked:
    raise NotImplementedError("a cluster barrier over every CTA of its cluster axis is needed")
  i32 = ir.IntegerType.get_signless(32)
  per_block = mgpu_utils.WARPGROUP_SIZE // 16
  thread = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(mgpu_utils.WARPGROUP_SIZE, i32))
  block = arith.divui(thread, mgpu_utils.c(per_block, i32))
  in_mask = arith.cmpi(arith.CmpIPredicate.ne,
                       arith.andi(ref.cluster_mask, arith.shli(mgpu_utils.c(1, i32), block)),
                       mgpu_utils.c(0, i32))
  signals = arith.cmpi(arith.CmpIPredicate.eq,
                       arith.remui(thread, mgpu_utils.c(per_block, i32)), mgpu_utils.c(0, i32))
  mgpu_utils.inline_ptx(_ARRIVE_PTX, arith.andi(in_mask, signals), ref.barrier.get_ptr(),
                        block, has_side_effects=True)
  return ()


def _wait_lowering(ctx, barrier, *flat_transforms, transforms_treedef):
  """``BarrierRef.wait``'s phase tracking with a cluster-scope acquire."""
  ref = _barrier_at(ctx, barrier, flat_transforms, transforms_treedef).barrier
  parities = memref.load(ref.phases, [])
  parity, new_parities = ref.update_parities(parities)
  memref.store(new_parities, ref.phases, [])
  parity = arith.extui(ir.IntegerType.get_signless(32), parity)
  ticks = mgpu_utils.c(10_000_000, ir.IntegerType.get_signless(32))  # Mosaic's suspend hint
  mgpu_utils.inline_ptx(_WAIT_PTX, ref.get_ptr(), parity, ticks, has_side_effects=True)
  return ()


for _semantics in (mgpu.LoweringSemantics.Lane, mgpu.LoweringSemantics.Warpgroup):
  mgpu_lowering.register_lowering_rule(arrive_release_p, _semantics)(_arrive_lowering)
  mgpu_lowering.register_lowering_rule(wait_acquire_p, _semantics)(_wait_lowering)


def _bind(primitive, barrier):
  barrier, transforms = state_primitives.get_ref_and_transforms(barrier, None, primitive.name)
  flat_transforms, treedef = tree_util.tree_flatten(transforms)
  primitive.bind(barrier, *flat_transforms, transforms_treedef=treedef)


def arrive_release(barrier) -> None:
  """Arrives on ``barrier`` (a ``plgpu.ClusterBarrier``, one barrier of it) in every CTA of
  its cluster axis, once per warpgroup, releasing at cluster scope: the calling warpgroup's
  shared-memory accesses ordered before it (by a warpgroup barrier) are visible to every peer
  that waits on it with :func:`wait_acquire`."""
  _bind(arrive_release_p, barrier)


def wait_acquire(barrier) -> None:
  """Waits for the current phase of ``barrier`` (a ``plgpu.ClusterBarrier``, one barrier of
  it) to complete, acquiring at cluster scope (see :func:`arrive_release`)."""
  _bind(wait_acquire_p, barrier)
