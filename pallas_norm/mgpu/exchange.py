"""Per-row partial sums shared by the CTAs of a cluster that own the same rows (distributed
shared memory), for the epilogues whose row reduction spans more columns than one CTA holds:
the post-norm forward's row statistics (``ops/matmul_norm/mosaic.py``) and the pre-norm dx
kernel's row sums (``ops/norm_matmul/mosaic_bwd.py``).

A consumer warpgroup hands :func:`cluster_row_sums` its ``n_partials`` per-row partials (row
vectors, layout ``WGMMA.reduce(1)``) and a ``merge`` that turns the partials of every CTA, in
CTA order, into ``n_partials`` row vectors; every CTA merges the same values in the same order,
so all hold the same bits. Two ways to exchange (:class:`Spec`.exchange):

* "pull": each CTA writes its partials to its own SMEM, arrives on a cluster barrier, and reads
  its peers' through :func:`plgpu.cluster_ref`; the barrier's arrive releases and its wait
  acquires at cluster scope (:mod:`pallas_norm.mgpu.cluster_barrier`), so no fence is needed.
* "push": each CTA sends its partials as one packet into every peer's inbox with ``st.async``
  stores that complete the receiver's barrier (each packet arrives once, with its byte count):
  no thread waits on a remote load. The "inbox read" barrier (``empty``) releases and acquires
  at cluster scope, as pull's do.

GPU interpret mode cannot read a peer CTA's shared memory, so c > 1 runs only on a GPU; the
kernels' lowering for sm_90a (``jax.export`` for "cuda") is checked on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm.mgpu import cluster_barrier
from pallas_norm.mgpu.device import swizzle_transforms
from pallas_norm.mgpu.pipeline import opaque_zero

EXCHANGES = ("pull", "push")

PACKET_COLS = 8
"""For the "push" exchange the partials of a warpgroup's rows travel to a peer as one (rows, 8)
f32 tile, columns 0-3 the first partial and 4-7 the second: ``st.async`` cannot send a row
vector (its layout repeats each value in 4 lanes), and (rows, 8) is the smallest WGMMA-layout
tile."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static facts of one exchange: ``cluster`` CTAs, ``rows`` per consumer warpgroup,
  ``n_partials`` (1 or 2) row vectors per row, the ``exchange`` mode, and for "pull" whether
  the peer addresses are recomputed at each read (``peer_addresses_in_loop``, see
  :func:`_peer_partials`)."""
  cluster: int
  rows: int
  n_partials: int
  exchange: str = "pull"
  peer_addresses_in_loop: bool = False


@dataclasses.dataclass(frozen=True)
class Exchange:
  """SMEM and barriers of the cluster exchange (c > 1), per consumer warpgroup w.

  "pull": ``part[w][q]``: this CTA's partial q, one (rows,) f32 allocation each: a peer reads
  it whole (Mosaic lowers a peer reference only for a whole allocation, not a slice of one).
  ``full``/``empty``: cluster barriers; ``full[w]`` completes when every CTA of the cluster
  wrote its partials for the tile, ``empty[w]`` when every CTA finished reading all of them.
  ``rows[w]``: (2, rows) f32 whose first ``n_partials`` rows carry the merged row vectors out
  of the static-w branch.

  "push": ``inbox[w, j]``: the packet of cluster CTA j (see :data:`PACKET_COLS`); ``full[w]``
  a CTA-local barrier that completes when all c packets landed; ``empty[w]`` as for "pull".
  """
  full: object
  empty: object
  part: tuple | None = None
  rows: object = None
  inbox: object = None


def allocs(spec: Spec) -> dict | None:
  """The ``pl.run_scoped`` allocations of the exchange (None for a cluster of 1); the kernel
  hands their refs to :class:`Exchange` (``Exchange(**refs)``)."""
  if spec.cluster == 1:
    return None
  cluster_bar = functools.partial(plgpu.ClusterBarrier, collective_axes=("cluster",),
                                  num_barriers=2, num_arrivals=1)
  if spec.exchange == "push":
    return dict(
        inbox=plgpu.SMEM((2, spec.cluster, spec.rows, PACKET_COLS), jnp.float32,
                         transforms=swizzle_transforms(PACKET_COLS, jnp.float32)),
        # In the warpgroup lowering a packet's store arrives once per sending warpgroup (not
        # once per thread): 128 · c arrivals hung the kernel on the H200.
        full=plgpu.Barrier(num_arrivals=spec.cluster, num_barriers=2),
        empty=cluster_bar())
  part = tuple(tuple(plgpu.SMEM((spec.rows,), jnp.float32) for _ in range(spec.n_partials))
               for _ in range(2))
  return dict(part=part, full=cluster_bar(), empty=cluster_bar(),
              rows=plgpu.SMEM((2, 2, spec.rows), jnp.float32))


def _pack(spec: Spec, partials):
  shape = (spec.rows, PACKET_COLS)
  if spec.n_partials == 1:
    return lax.broadcast_in_dim(partials[0], shape, [0])
  col = lax.broadcasted_iota(jnp.int32, shape, 1)
  return jnp.where(col < PACKET_COLS // 2, lax.broadcast_in_dim(partials[0], shape, [0]),
                   lax.broadcast_in_dim(partials[1], shape, [0]))


def _unpack(spec: Spec, packet):
  """The partials of one packet (:func:`_pack`); a max over equal values is exact."""
  if spec.n_partials == 1:
    return (jnp.max(packet, axis=1),)
  low = lax.broadcasted_iota(jnp.int32, packet.shape, 1) < PACKET_COLS // 2
  return (jnp.max(jnp.where(low, packet, -jnp.inf), axis=1),
          jnp.max(jnp.where(low, -jnp.inf, packet), axis=1))


Merge = Callable[[list], tuple]
"""``merge(per_cta)``: the partials of every CTA (a list of tuples, CTA order) → ``n_partials``
row vectors."""


def _push(spec: Spec, partials, ex: Exchange, wg, tile_index, merge: Merge) -> tuple:
  """The "push" exchange: once the peers have read the previous tile's packets (``empty``),
  send this CTA's packet into every CTA's inbox (its own included), wait for the own inbox,
  read it locally in CTA order, and arrive on ``empty`` in every CTA."""
  cta = lax.axis_index("cluster")

  @pl.when(tile_index > 0)
  def _():
    cluster_barrier.wait_acquire(ex.empty.at[wg])

  packet = _pack(spec, partials)
  for j in range(spec.cluster):
    plgpu.async_store_smem(packet, ex.inbox.at[wg, cta], ex.full.at[wg], cluster_idx=j,
                           cluster_dim="cluster")
  plgpu.barrier_wait(ex.full.at[wg])
  per_cta = [_unpack(spec, plgpu.load(ex.inbox.at[wg, j], layout=plgpu.Layout.WGMMA))
             for j in range(spec.cluster)]
  merged = merge(per_cta)
  plgpu.commit_smem()  # warpgroup barrier: every thread has read the inbox before the release
  cluster_barrier.arrive_release(ex.empty.at[wg])
  return merged


def _peer_partials(spec: Spec, bufs, tile_index):
  """The partials in ``bufs`` (one allocation per partial) of every CTA of the cluster, in CTA
  order, read through distributed shared memory.

  With ``spec.peer_addresses_in_loop`` peer j is named as ``j + opaque_zero(tile_index)``.
  With a constant j the peer addresses (``mapa`` of each buffer for each of the c peers, per
  warpgroup: 32 at c = 8 with two partials) are loop-invariant: LLVM computes them all once at
  the kernel's start, and where registers are short ptxas spills them (the FNA cluster forward
  at H = 8: 33 stores once, and a reload per peer address in every q block, on the exchange's
  critical path). Named through the tile's index, each is recomputed where it is read (one
  ``mapa``). Not the default: ptxas measured the pre-norm dx kernel's row sums (c = 2, 4)
  spilling more with it (RMSNorm 0 -> 12/40 B at c = 2, 0 -> 8/8 B at c = 4) and the post-norm
  forward (c = 4, 8) no better."""
  zero = opaque_zero(tile_index) if spec.peer_addresses_in_loop else 0
  return [tuple(plgpu.layout_cast(plgpu.cluster_ref(buf, {"cluster": j + zero})[...],
                                  plgpu.Layout.WGMMA.reduce(1)) for buf in bufs)
          for j in range(spec.cluster)]


def cluster_row_sums(spec: Spec, partials, ex: Exchange | None, wg, tile_index,
                     merge: Merge) -> tuple:
  """``merge`` of this CTA's ``partials`` and those of its cluster peers (tile ``tile_index``
  of this warpgroup: from the second one on, it first waits until the peers have read the
  previous tile's).

  c = 1: ``merge([partials])``. "push": :func:`_push`. "pull", for the warpgroup's static
  index w: wait until the peers have read the previous tile's partials (``empty``), write
  ours, arrive on ``full`` in every CTA and wait for all c arrivals, read the c partials
  through distributed shared memory in CTA order, arrive on ``empty``, and merge.
  """
  if spec.cluster == 1:
    return merge([tuple(partials)])
  if spec.exchange == "push":
    return _push(spec, partials, ex, wg, tile_index, merge)
  for w in range(2):

    @pl.when(wg == w)
    def _exchange():
      bufs = ex.part[w]

      @pl.when(tile_index > 0)
      def _():
        cluster_barrier.wait_acquire(ex.empty.at[w])

      for buf, v in zip(bufs, partials):
        buf[...] = v
      plgpu.commit_smem()  # warpgroup barrier: every thread's write precedes the release
      cluster_barrier.arrive_release(ex.full.at[w])
      cluster_barrier.wait_acquire(ex.full.at[w])
      for q, v in enumerate(merge(_peer_partials(spec, bufs, tile_index))):
        ex.rows[w, q] = v
      plgpu.commit_smem()  # every thread's peer reads precede the release
      cluster_barrier.arrive_release(ex.empty.at[w])

  return tuple(plgpu.load(ex.rows.at[wg, q], layout=plgpu.Layout.WGMMA.reduce(1))
               for q in range(spec.n_partials))


def final_sync(spec: Spec, ex: Exchange | None, wg) -> None:
  """Waits until the peers read the last tile's partials: no CTA exits while they may."""
  if spec.cluster == 1:
    return
  for w in range(2):

    @pl.when(wg == w)
    def _():
      cluster_barrier.wait_acquire(ex.empty.at[w])
