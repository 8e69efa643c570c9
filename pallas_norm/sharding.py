"""The ops on several devices: rows (tokens or examples) split over a mesh axis, kernels per shard.

Every op of pallas-norm is row-local: a row's output depends on that row of the activations (and
for the jagged ops on that row's sample), plus parameters that every row shares. So data
parallelism needs no collective in the forward pass: each device runs the op, kernel included,
on its own rows. :func:`shard_rows` wraps an op in a :func:`jax.shard_map` that does exactly
that, so XLA never gathers a sharded activation to call a kernel (a Mosaic kernel is an opaque
custom call to XLA's partitioner, which has no rule to split it: a plain ``jax.jit`` of a
kernel on rows split over devices compiles to all-gathers of the rows, as the tests show in
interpret mode). In the backward
pass the gradients of the shared parameters (w, scale, bias, ...) are per-shard sums that
``shard_map``'s transpose adds up across the shards (one all-reduce each); the row statistics
(mean, rstd) are per row, so they need no reduction.

Jagged batches are split by samples (:func:`split_jagged`): shard ``s`` holds samples
``s·B/S .. (s+1)·B/S − 1`` packed into its own block of a static ``shard_capacity`` rows, with
its own *local* offsets (starting at 0 in its block). Inside the shard the block is an ordinary
jagged batch (:mod:`pallas_norm.jagged`), so the ops run unchanged.

Embedding tables too large for one device are split by rows over a model axis;
:func:`row_sharded_take` looks ids up in such a table inside ``shard_map``.

Why ``check_vma=False``: in jax 0.11.2 a ``pallas_call``'s outputs carry no varying-manual-axes
type, so a kernel's ``custom_vjp`` backward inside a type-checked ``shard_map`` fails jax's check
that each cotangent has its primal's type. Without the check, ``shard_map`` sums the cotangents
of replicated inputs over the mesh (what the shared parameters need) and trusts ``out_specs``.
A user's own ``shard_map`` around model code that calls kernels needs ``check_vma=False`` too
(the XLA path works either way).

GPU interpret mode (``implementation="interpret"``) under a ``shard_map`` over several devices
trips an internal assertion of jax 0.11.2's interpreter (each device's kernel checks that no
barrier of *any* device is still allocated, while other devices' kernels still run);
tests/sharding_checks.py shows the workaround its tests use. The Mosaic kernels themselves have
not yet run under ``shard_map`` on GPUs (no multi-GPU machine was available).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_norm import _dispatch, _validate

__all__ = ["ROW_ARGS", "gpu_interpret_reason", "join_jagged", "row_sharded_take", "shard_rows",
           "split_jagged"]

ROW_ARGS = {
    "rms_norm": ("x", "residual"),
    "layer_norm": ("x", "residual"),
    "norm_matmul": ("x",),
    "matmul_norm": ("x", "residual"),
    "gdpa": ("q", "k", "v", "q_offsets", "kv_offsets"),
    "flash_norm_attention": ("q", "k", "v", "q_offsets", "kv_offsets"),
}
"""Per public op, the arguments split by rows (leading axis) over the mesh axis; the others (the
weights and norm parameters) are replicated. Every output is split by rows. For the jagged ops
the per-sample ``k``, ``v`` are split by samples and the offsets are per-shard local offsets
(:func:`split_jagged`)."""

_JAGGED_OPS = ("gdpa", "flash_norm_attention")
_SETTINGS = ("eps",)  # static arguments of the ops that may come as concrete 0-d arrays
_OFFSET_ARGS = ("q_offsets", "kv_offsets")


def _public_op_name(op):
  """The name in :data:`ROW_ARGS` of the public op ``op`` is (by identity: a function of the
  same name elsewhere, whose arguments may differ, is not one), else None."""
  import pallas_norm  # pylint: disable=import-outside-toplevel  (the package imports this module)
  return next((name for name in ROW_ARGS if getattr(pallas_norm, name, None) is op), None)


def shard_rows(op, mesh=None, axis="data"):
  """``op`` run on each shard of the rows of its activations over mesh axis ``axis``.

  The returned function takes ``op``'s arguments (same names, positions and keywords). The
  arguments listed in :data:`ROW_ARGS` are split by their leading axis over ``axis`` (arrays
  already sharded that way stay where they are; others are put on the mesh first, those
  committed to other devices included, or under ``jax.jit`` resharded by XLA), the remaining
  arrays are replicated, and every other argument (``norm``, ``eps``, ``implementation``, ...)
  is passed through to each shard's call. Every output is split by rows like the activations.
  Works eagerly and under ``jax.jit``; gradients of replicated parameters are summed over the
  shards (see the module docstring). The ``shard_map`` runs under a ``jax.jit`` of its own (one
  per mesh and settings), so an eager ``jax.vjp``/``jax.grad`` works too (JAX's eager transpose
  of a bare ``shard_map`` failed on a cotangent not split by rows). With a mesh of explicit axes
  (``jax.make_mesh``'s default) the outputs are explicitly sharded, and JAX wants a loss computed
  on them outside ``jax.jit`` (its ``jnp.sum`` in a ``jax.grad``) under ``jax.set_mesh(mesh)``.

  Jagged ops (``gdpa``, ``flash_norm_attention``): ``q`` holds S blocks of T/S packed rows, ``k``
  and ``v`` the B samples in order (B/S per shard), and ``q_offsets`` (and ``kv_offsets``) the S
  per-shard local offset vectors, concatenated: shape (S·(B/S + 1),), as :func:`split_jagged`
  builds them. ``max_seq_len`` bounds a sample's length as usual. Traced offsets that break the
  jagged convention poison per shard: the rows of the shard whose offsets are bad are NaN, the
  other shards' outputs are their correct values.

  Args:
    op: one of the public ops (``pallas_norm.rms_norm``, ``layer_norm``, ``norm_matmul``,
      ``matmul_norm``, ``gdpa``, ``flash_norm_attention``).
    mesh: a ``jax.sharding.Mesh``; None uses the mesh set by ``jax.set_mesh``.
    axis: the mesh axis name, or a tuple of names, that splits the rows.

  Returns:
    A function with ``op``'s signature; its outputs are ``op``'s (the same structure and
    dtypes), each split by rows over ``axis`` like the activations.

  Raises:
    TypeError: (at the call) a mesh that is not a ``jax.sharding.Mesh``; jagged offsets that
      are not 1-D int32 arrays; arguments that do not bind to ``op``'s signature.
    ValueError: an ``op`` that is not one of the public ops themselves (another function of
      the same name, such as ``pallas_norm.reference.rms_norm``, included), or an ``axis``
      that names a mesh axis twice, when wrapping;
      (at the call) no mesh, ``axis`` not in the mesh, a row argument
      whose leading axis does not split evenly over the shards, a ``residual`` whose rows
      (all axes but the last) are not x's, per-sample ``k``/``v`` that do
      not match the offsets' batch, or concrete local offsets that break the jagged convention
      (naming the argument and the shard). The op's own errors come from tracing its per-shard
      call, before any kernel runs.
    NotImplementedError: (at the call) a Mosaic kernel op with ``implementation="interpret"``
      on a mesh of several devices, where jax 0.11.2's GPU interpreter fails an internal
      assertion (module docstring); a sequence there runs without "interpret" and warns
      (:class:`pallas_norm.KernelSkippedWarning`).
  """
  name = _public_op_name(op)
  if name is None:
    raise ValueError(f"op must be one of the public ops {sorted(ROW_ARGS)}, got {op!r}")
  _check_axis_names("axis", axis)
  signature = inspect.signature(op)

  @functools.wraps(op)
  def sharded(*args, **kwargs):
    the_mesh = _resolve_mesh(mesh, axis)
    num_shards = math.prod(the_mesh.shape[a] for a in _axis_names(axis))
    try:
      bound = signature.bind(*args, **kwargs)
    except TypeError as e:  # inspect's message ("too many positional arguments") names no op
      raise TypeError(f"shard_rows({name}): {e}") from None
    bound.apply_defaults()
    # The op's own check of x (q), here before any device work: the row checks below read its
    # shape (a list x next to a residual raised AttributeError 'NoneType' ... 'shape').
    _validate.float_array(ROW_ARGS[name][0], bound.arguments[ROW_ARGS[name][0]])
    # NumPy scalars (eps=np.float32(1e-5)) and eps in any form are settings, passed through
    # like Python numbers (eps=jnp.float32(1e-5) as a shard_map operand reached the op's static
    # eps check as a per-shard array and failed inside JAX while printing it).
    arrays = {k: v for k, v in bound.arguments.items()
              if _validate.is_array(v) and not isinstance(v, np.generic) and k not in _SETTINGS}
    static = {k: v for k, v in bound.arguments.items() if k not in arrays}
    static = _without_gpu_interpreter(name, static, the_mesh)
    _check_rows(name, arrays, num_shards, axis)
    if name in _JAGGED_OPS:
      _check_jagged(arrays, static, num_shards)
    specs = {k: P(axis) if k in ROW_ARGS[name] else P() for k in arrays}

    arrays = {k: _placed(v, the_mesh, specs[k]) for k, v in arrays.items()}

    return _jitted(the_mesh, static, specs)(arrays)

  jitted_cache = {}

  def _jitted(the_mesh, static, specs):
    """The shard_map under a jax.jit, one per mesh and settings (uncached when a setting is
    unhashable). Without the jit, an eager jax.grad/jax.vjp transposed the shard_map eagerly and
    failed inside JAX on a cotangent that is not split like out_specs ("in_specs passed to
    shard_map ... does not match"); under jit XLA reshards it."""
    # Each setting with its type: True == 1 == 1.0 (same hash), so a call with return_h=1 or
    # max_seq_len=8.0, which the op refuses, would otherwise reuse a program traced with a valid
    # value and skip the op's checks.
    key = (the_mesh, tuple((k, type(v), v) for k, v in static.items()))
    try:
      hash(key)
    except TypeError:
      key = None
    if key in jitted_cache:
      return jitted_cache[key]

    def per_shard(local):
      return op(**local, **static)

    fn = jax.jit(jax.shard_map(per_shard, mesh=the_mesh, in_specs=(specs,), out_specs=P(axis),
                               check_vma=False))
    if key is not None:
      jitted_cache[key] = fn
    return fn

  return sharded


def _placed(a, mesh, spec):
  """``a`` laid out on ``mesh`` by ``spec`` (a no-op when it already is). A concrete array
  committed to other devices (a program's output on one device) made the jit of the shard_map
  fail with JAX's "incompatible devices", naming whichever argument it met first: it is put
  on the mesh first. An explicit-sharding mesh types every array's sharding, and shard_map then
  takes its operands only as in_specs says: a traced one is resharded there."""
  # mesh=None: the abstract mesh of jax.set_mesh, whose devices jax.sharding.get_mesh() knows
  devices = mesh if isinstance(mesh, jax.sharding.Mesh) else jax.sharding.get_mesh()
  if (isinstance(devices, jax.sharding.Mesh) and not devices.empty
      and not isinstance(a, jax.core.Tracer)):
    return jax.device_put(a, jax.NamedSharding(devices, spec))
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jax.reshard(a, jax.NamedSharding(mesh, spec))
  return a


def _axis_names(axis) -> tuple:
  return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def _check_axis_names(arg: str, axis) -> None:
  """A ValueError naming ``arg`` for a mesh axis named twice in it; JAX's own errors for one
  (DuplicateSpecError from the PartitionSpec, "repeated axis" from a collective) name neither
  the argument nor the call."""
  names = _axis_names(axis)
  for i, a in enumerate(names):
    if a in names[:i]:
      raise ValueError(f"{arg}: mesh axis {a!r} appears more than once in {axis!r}; name "
                       "each axis once")


def _resolve_mesh(mesh, axis):
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError("mesh: none given and none set by jax.set_mesh")
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (or None), got {type(mesh).__name__}")
  for a in _axis_names(axis):
    if a not in mesh.axis_names:
      raise ValueError(f"axis {a!r} is not an axis of the mesh {dict(mesh.shape)}")
  return mesh


_MOSAIC_OPS = ("norm_matmul", "matmul_norm", "gdpa", "flash_norm_attention")
"""The ops whose ``"interpret"`` implementation runs JAX's GPU (Mosaic) interpreter; the norms'
runs the generic Pallas interpreter, which works on several devices."""


def _gpu_interpreter_checks_every_device() -> bool:
  """Whether jax's GPU interpreter still asserts, at the end of each device's kernel, that no
  barrier of *any* device is allocated (module docstring), i.e. nobody replaced that check."""
  try:  # a private module of jax 0.11.2
    # pylint: disable-next=import-outside-toplevel
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  except ImportError:  # pragma: no cover
    return False
  check = getattr(shared_memory.GPUSharedMemory, "assert_no_barriers_allocated", None)
  return getattr(check, "__module__", None) == shared_memory.__name__


def gpu_interpret_reason(num_devices: int) -> str | None:
  """Why the Mosaic kernel ops' GPU interpret mode (``implementation="interpret"`` of
  ``norm_matmul``, ``matmul_norm``, ``gdpa``, ``flash_norm_attention``) cannot run inside a
  ``shard_map`` over ``num_devices`` devices, or None where it can: on one device, or where
  jax's GPU interpreter no longer asserts every device's barriers at the end of each kernel
  (module docstring). For code that runs its own ``shard_map`` (``shard_rows`` checks it
  itself)."""
  if num_devices <= 1 or not _gpu_interpreter_checks_every_device():
    return None
  return (f"on a mesh of {num_devices} devices jax 0.11.2's GPU interpreter asserts at the end "
          "of each device's kernel that no barrier of any device is still allocated, which "
          "fails while other devices' kernels run")


def _without_gpu_interpreter(name, static, mesh) -> dict:
  """``static`` for a Mosaic kernel op on several devices, where GPU interpret mode would fail
  inside jax's interpreter with an opaque INTERNAL error (module docstring): a plain
  "interpret" raises NotImplementedError before anything runs; a sequence drops "interpret"
  with a :class:`pallas_norm.KernelSkippedWarning`, as the ops' dispatch skips a kernel for a
  reason of the process, and raises as a plain one if nothing else is left."""
  implementation = static.get("implementation")
  sequence = isinstance(implementation, (list, tuple))
  mesh_reason = gpu_interpret_reason(mesh.size)
  if not (name in _MOSAIC_OPS and mesh_reason
          and (implementation == "interpret" or (sequence and "interpret" in implementation))):
    return static
  reason = (f"shard_rows({name}) with implementation='interpret': {mesh_reason}. Use one "
            "device, or implementation='xla' (tests/sharding_checks.py shows the workaround "
            "its tests use).")
  rest = tuple(i for i in implementation if i != "interpret") if sequence else ()
  if not rest:
    raise NotImplementedError(reason)
  warnings.warn(f"{name}: implementation 'interpret' skipped: {reason} The sequence's other "
                f"names {rest} run instead.", _dispatch.KernelSkippedWarning, stacklevel=3)
  return {**static, "implementation": rest}


def _check_rows(name, arrays, num_shards, axis) -> None:
  first_arg = ROW_ARGS[name][0]
  first = arrays.get(first_arg)
  for arg in ROW_ARGS[name]:
    x = arrays.get(arg)
    if x is None:
      continue
    if arg in _OFFSET_ARGS:
      continue  # checked by _check_jagged, which says what per-shard offsets look like
    if x.ndim < 2:  # a 1-D x is one row: its only axis holds the features, not rows
      raise ValueError(f"{arg}: a row argument needs a leading rows axis and a feature axis "
                       f"(ndim >= 2), got shape {tuple(x.shape)}; call the op unsharded")
    if x.shape[0] % num_shards:
      raise ValueError(f"{arg}: its leading axis of {x.shape[0]} rows (shape {tuple(x.shape)}) "
                       f"must split evenly over the {num_shards} shards of mesh axis {axis!r}")
    if name not in _JAGGED_OPS and arg != first_arg and (
        tuple(x.shape[:-1]) != tuple(first.shape[:-1])):
      # Else the op's own check, run per shard, quoted the shards' shapes, not the caller's.
      raise ValueError(f"{arg}: shape {tuple(x.shape)} must have the rows of x "
                       f"{tuple(first.shape)} (all axes but the last)")


def _check_jagged(arrays, static, num_shards) -> None:
  """Per-shard batch of the offsets matches k, v; concrete local offsets are valid per shard."""
  kv_offsets = arrays.get("kv_offsets")
  for arg in ("q_offsets", "kv_offsets"):
    off = arrays.get(arg)
    if off is not None and (jnp.dtype(off.dtype) != jnp.int32 or off.ndim != 1):
      raise TypeError(f"{arg} must be a 1-D int32 array of per-shard local offsets, got "
                      f"{off.dtype} of shape {tuple(off.shape)}")
  q_offsets = arrays["q_offsets"]
  local_batch = q_offsets.shape[0] // num_shards - 1
  if q_offsets.shape[0] % num_shards or local_batch < 1:
    raise ValueError(f"q_offsets: {q_offsets.shape[0]} entries do not split into {num_shards} "
                     "per-shard local offset vectors of B/S + 1 >= 2 entries")
  if kv_offsets is not None and kv_offsets.shape != q_offsets.shape:
    raise ValueError(f"kv_offsets: shape {tuple(kv_offsets.shape)} must match q_offsets "
                     f"{tuple(q_offsets.shape)} (per-shard local offsets)")
  if kv_offsets is None:  # per-sample k, v: (B, Lkv, H, D)
    for arg in ("k", "v"):
      if arrays[arg].shape[0] != num_shards * local_batch:
        raise ValueError(f"{arg}: leading axis {arrays[arg].shape[0]} must be the batch "
                         f"B = {num_shards * local_batch} of the {num_shards} shards' local "
                         "q_offsets")
  for arg, rows, max_len in (("q_offsets", "q", static.get("max_seq_len")),
                             ("kv_offsets", "k", static.get("max_kv_len"))):
    off = arrays.get(arg)
    if off is None or isinstance(off, jax.core.Tracer):
      continue  # traced: the op poisons its output instead (see pallas_norm.gdpa)
    capacity = arrays[rows].shape[0] // num_shards
    for s, block in enumerate(np.asarray(off).reshape(num_shards, -1)):
      _validate.offsets(f"{arg} (shard {s})", block, capacity, max_len=max_len)


# ---------------------------------------------------------------------------------------------
# Jagged batches split by samples


def split_jagged(values, offsets, num_shards: int, shard_capacity: int | None = None):
  """A packed jagged batch split by samples into ``num_shards`` blocks with local offsets.

  Host-side (NumPy): for building sharded batches in the input pipeline.

  Args:
    values: (T, ...) packed rows (:mod:`pallas_norm.jagged`).
    offsets: (B+1,) int32 offsets of ``values``; B must be a multiple of ``num_shards``.
    num_shards: S, the number of shards.
    shard_capacity: static rows per shard; default T / S (T must then be a multiple of S).

  Returns:
    ``(values, local_offsets)``, NumPy: values (S·shard_capacity, ...) in values' dtype, with
    shard s's samples ``s·B/S .. (s+1)·B/S − 1`` packed at the start of block s and zeros after
    them;
    local_offsets (S·(B/S + 1),) int32, block s being those samples' offsets minus their first.

  Raises:
    TypeError: traced values or offsets (under ``jax.jit``: this runs on the host).
    TypeError, ValueError: offsets that break the jagged convention (:mod:`pallas_norm.jagged`);
      num_shards not a positive divisor of B; a shard_capacity that is not a non-negative int;
      T not a multiple of S without a shard_capacity; a shard whose samples hold more rows
      than shard_capacity.
  """
  values = _host_array("split_jagged", "values", values, min_ndim=1)
  offsets = _host_array("split_jagged", "offsets", offsets, list_dtype=np.int32)
  batch = _validate.offsets("offsets", offsets, values.shape[0])
  if not _is_count(num_shards) or batch % num_shards:
    raise ValueError(f"num_shards must be a positive divisor of the batch B = {batch}, got "
                     f"{num_shards!r}")
  if shard_capacity is not None:
    shard_capacity = _row_count("shard_capacity", shard_capacity)
  if shard_capacity is None:
    if values.shape[0] % num_shards:
      raise ValueError(f"values: {values.shape[0]} rows do not split into {num_shards} equal "
                       "blocks; pass shard_capacity")
    shard_capacity = values.shape[0] // num_shards
  local_batch = batch // num_shards
  out = np.zeros((num_shards * shard_capacity,) + values.shape[1:], values.dtype)
  local = np.empty((num_shards, local_batch + 1), np.int32)
  for s in range(num_shards):
    block = offsets[s * local_batch:(s + 1) * local_batch + 1]
    rows = int(block[-1] - block[0])
    if rows > shard_capacity:
      raise ValueError(f"shard_capacity: shard {s} holds {rows} rows, more than "
                       f"shard_capacity={shard_capacity}")
    out[s * shard_capacity:s * shard_capacity + rows] = values[block[0]:block[-1]]
    local[s] = block - block[0]
  return out, local.reshape(-1)


def _host_array(fn: str, name: str, a, min_ndim: int = 0, list_dtype=None) -> np.ndarray:
  """``a`` as a NumPy array, for the host-side helpers: a traced array (under ``jax.jit``)
  raised JAX's TracerArrayConversionError, and a 0-d values an IndexError, naming nothing. A
  list or tuple becomes ``list_dtype`` where given (offsets: int32)."""
  if isinstance(a, jax.core.Tracer):
    raise TypeError(f"{fn}: {name} must be concrete (a NumPy or jax array); it is traced "
                    f"({a.dtype}{list(a.shape)}): {fn} runs on the host, in the input "
                    "pipeline, not under jax.jit")
  if isinstance(a, (list, tuple)) and list_dtype is not None:
    # A list of Python ints has no dtype (NumPy makes it int64, which the offsets check
    # rejected naming a dtype the caller never chose); out-of-range ints raise here.
    try:
      a = np.asarray(a, list_dtype)
    except (OverflowError, ValueError, TypeError) as e:
      raise TypeError(f"{fn}: {name} must be int32 offsets, got {a!r}: {e}") from e
  a = np.asarray(a)
  if a.ndim < min_ndim:
    raise ValueError(f"{fn}: {name} must have a leading rows axis, got shape {a.shape}")
  return a


def _row_count(name: str, value) -> int:
  """A static number of rows: a non-negative Python or NumPy int (TypeError for a bool, float
  or string, ValueError for a negative one, naming ``name``)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a non-negative int (rows), got {value!r}")
  if value < 0:
    raise ValueError(f"{name} must be a non-negative int (rows), got {value!r}")
  return int(value)


def _is_count(num_shards) -> bool:
  """A positive Python or NumPy int (not a bool, float or string)."""
  return not isinstance(num_shards, bool) and isinstance(num_shards, (int, np.integer)) and (
      num_shards >= 1)


def join_jagged(values, local_offsets, num_shards: int, capacity: int | None = None):
  """The inverse of :func:`split_jagged`: one packed batch from per-shard blocks (host-side).

  Args:
    values: (S·C, ...) per-shard blocks of C rows each.
    local_offsets: (S·(B/S + 1),) int32 per-shard local offsets.
    num_shards: S.
    capacity: rows of the joined batch; default S·C.

  Returns:
    ``(values, offsets)``, NumPy: (capacity, ...) packed rows in values' dtype, zeros after the
    last sample, and the (B+1,) int32 global offsets.

  Raises:
    TypeError: traced values or local_offsets (under ``jax.jit``: this runs on the host).
    TypeError, ValueError: a block of local offsets that breaks the jagged convention within
      its C rows; rows that do not split into S blocks; a capacity that is not a non-negative
      int; more rows than ``capacity``.
  """
  values = _host_array("join_jagged", "values", values, min_ndim=1)
  blocks = _host_array("join_jagged", "local_offsets", local_offsets, list_dtype=np.int32)
  if not _is_count(num_shards) or values.shape[0] % num_shards or (
      blocks.shape[0] % num_shards):
    raise ValueError(f"values ({values.shape[0]} rows) and local_offsets "
                     f"({blocks.shape[0]}) must split into num_shards={num_shards} blocks")
  shard_rows_ = values.shape[0] // num_shards
  blocks = blocks.reshape(num_shards, -1)
  for s, block in enumerate(blocks):
    _validate.offsets(f"local_offsets (shard {s})", block, shard_rows_)
  lengths = np.diff(blocks, axis=1).reshape(-1)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  capacity = values.shape[0] if capacity is None else _row_count("capacity", capacity)
  if offsets[-1] > capacity:
    raise ValueError(f"capacity: the shards hold {offsets[-1]} rows, more than {capacity}")
  out = np.zeros((capacity,) + values.shape[1:], values.dtype)
  start = 0
  for s, block in enumerate(blocks):
    rows = int(block[-1])
    out[start:start + rows] = values[s * shard_rows_:s * shard_rows_ + rows]
    start += rows
  return out, offsets


# ---------------------------------------------------------------------------------------------
# Embedding tables split by rows


def row_sharded_take(table, ids, axis_name):
  """``full_table[ids]`` for a table split by rows over mesh axis ``axis_name``, in shard_map.

  Call inside ``jax.shard_map`` (over ``axis_name``, of size M). Each device holds the rows
  ``[i·V/M, (i+1)·V/M)`` of the (V, E) table, i its index along the axis, and the ids of its own
  examples (the M devices of the axis may hold different examples, e.g. when the batch is split
  over both a data and this model axis, or the same ones). The ids of the M devices are gathered
  (small), each device looks up those that fall in its rows (zeros for the others), and a
  reduce-scatter returns to each device the rows of its own ids: every row is one device's value
  plus zeros, so the result equals a lookup in the whole table bit for bit. The backward
  (all-gather of the row cotangents, scatter-add into the local rows) gives each device the
  gradient of its own rows; replicas of the table along other mesh axes still need their
  gradients summed over those axes (``shard_map``'s transpose does it for a table replicated over
  them).

  Args:
    table: (V/M, E) this device's rows of the table.
    ids: (n, ...) integer ids in [0, V) of this device's examples; ids outside that range,
      negative ones included, get zero rows (the unsharded ``jnp.take``, and ``nnx.Embed``,
      give NaN rows for ids >= V and, as NumPy, row V + id for an id in [-V, 0)).
    axis_name: the mesh axis (or tuple of axes) the table's rows are split over.

  Returns:
    (n, ..., E) in table's dtype.

  Raises:
    TypeError: an ids or table that is not an array; ids without an integer dtype.
    ValueError: a 0-d ids or a table that is not 2-D; an ``axis_name`` that names a mesh axis
      twice.
    NameError: called outside a ``shard_map`` over ``axis_name`` (JAX's unbound axis name).
  """
  for name, a in (("table", table), ("ids", ids)):
    if not isinstance(a, (jax.Array, np.ndarray)):
      raise TypeError(f"{name} must be an array, got {type(a).__name__}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
  if ids.ndim < 1 or table.ndim != 2:
    raise ValueError(f"ids must have a leading (example) axis and table must be 2-D, got ids "
                     f"{tuple(ids.shape)} and table {tuple(table.shape)}")
  _check_axis_names("axis_name", axis_name)
  rows = table.shape[0]
  first = jax.lax.axis_index(axis_name) * rows
  group_ids = jax.lax.all_gather(ids, axis_name, axis=0, tiled=True)   # (M·n, ...)
  # The range test in a dtype that holds both the ids and V exactly (narrow ids widened, wide
  # ones as they are): cast to int32 first, an int64 id past 2**31 would wrap into the table.
  group_ids = _validate.at_least_int32(group_ids)
  in_table = (group_ids >= 0) & (group_ids < rows * jax.lax.axis_size(axis_name))
  local = jnp.where(in_table, group_ids, 0).astype(jnp.int32) - first
  mine = in_table & (local >= 0) & (local < rows)
  found = jnp.take(table, jnp.where(mine, local, 0), axis=0)
  found = jnp.where(mine[..., None], found, jnp.zeros((), table.dtype))
  return jax.lax.psum_scatter(found, axis_name, scatter_dimension=0, tiled=True)
