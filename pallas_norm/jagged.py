"""The jagged-tensor convention used by every op of pallas-norm.

A jagged batch of B variable-length sequences is stored *packed*:

* ``values``: shape ``(T, ...)``: the tokens of sample 0, then sample 1, ... back to back.
  ``T`` is a **static capacity** (it fixes the compiled shapes); it may exceed the number of
  real tokens.
* ``offsets``: int32, shape ``(B + 1,)``, with ``offsets[0] == 0``, non-decreasing, and
  ``offsets[B] <= T``. Sample ``b`` owns rows ``offsets[b]:offsets[b + 1]``; its length is
  ``offsets[b + 1] - offsets[b]`` (zero is allowed).
* Rows ``offsets[B]:T`` are **padding**: ops never read them as data and always write zeros
  there, so a padded output is deterministic whatever the padded input holds.

This is the layout of FBGEMM's jagged tensors and of Meta's GDPA kernels (``q_offsets``,
``kv_offsets``). The helpers below convert between packed and padded ``(B, L, ...)`` layouts
and are used by the XLA reference path.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_norm import _validate

__all__ = [
    "RowIndex",
    "row_index",
    "segment_ids",
    "valid_mask",
    "positions",
    "lengths",
    "to_padded",
    "from_padded",
    "offsets_from_lengths",
]


def lengths(offsets: jax.Array) -> jax.Array:
  """Per-sample lengths ``offsets[1:] - offsets[:-1]``: a jax.Array of shape (B,) in the
  offsets' integer dtype as JAX sees it (int32 for int32 offsets; without jax_enable_x64 a
  NumPy int64 array is int32), eagerly as under ``jax.jit``.

  Args:
    offsets: (B+1,) integer array (int32 in the ops; not bool or uint64) of the convention
      above.

  Raises:
    TypeError: offsets that are not a 1-D integer array of shape (B+1,).
    ValueError: concrete offsets that do not start at 0 or decrease (they gave negative
      lengths), or that do not fit that dtype (a NumPy int64 offset past 2**31 - 1 without
      jax_enable_x64). Traced offsets (under ``jax.jit``) are checked for dtype and shape only.
  """
  _check_offsets_kind("lengths", offsets)
  if not isinstance(offsets, jax.core.Tracer):
    host = _validate.host_offsets(offsets)
    if host[0] != 0 or np.any(np.diff(host) < 0):
      raise ValueError(f"lengths: offsets must start at 0 and never decrease, got "
                       f"{host.tolist()}")
    dtype = _validate.jax_dtype(offsets)
    if host[-1] > np.iinfo(dtype).max:  # jnp.asarray would wrap it silently, as jax.jit does
      raise ValueError(f"lengths: offsets must fit {dtype} (their dtype as JAX sees it), got "
                       f"offsets[-1] = {host[-1]}")
    offsets = jnp.asarray(offsets, dtype)  # a NumPy result in NumPy's dtype disagreed with jit
  return _lengths(offsets)


def _lengths(offsets):
  return offsets[1:] - offsets[:-1]


def offsets_from_lengths(lens):
  """int32 offsets (B+1,) from per-sample lengths (B,): ``[0, cumsum(lens)...]``.

  ``lens`` must have an integer dtype (a list of Python ints, a NumPy or JAX integer array);
  floats would be truncated and bools are not lengths, so both raise. Concrete lengths give a
  NumPy int32 array, and their values are checked: no negative length, and a total that fits
  int32 (a larger one would wrap to negative offsets). Traced lengths (under ``jax.jit``) give a
  traced int32 array; only their dtype and shape are checked, not their values, so negative
  lengths or a total past 2**31 - 1 give offsets that break the jagged convention (the ops then
  return NaN, see :func:`pallas_norm.gdpa`).

  Raises:
    TypeError: ``lens`` does not have an integer dtype (float, bool, complex, strings, ...).
    ValueError: ``lens`` is not 1-D (or not array-like); a concrete length is negative, or the
      concrete total exceeds 2**31 - 1 (int32).
  """
  if isinstance(lens, jax.core.Tracer):
    _check_lengths_dtype(lens.dtype, lens)
    if lens.ndim != 1:
      raise ValueError(f"lengths must be a 1-D array, got shape {tuple(lens.shape)}")
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens, dtype=jnp.int32)])
  try:
    host = np.asarray(lens)
  except ValueError as e:  # ragged nesting
    raise ValueError(f"lengths must be a 1-D array of non-negative ints, got {lens!r}") from e
  int32_max = np.iinfo(np.int32).max
  if host.dtype == object and all(isinstance(n, int) and not isinstance(n, bool)
                                  for n in host.ravel()):
    # Python ints past uint64: NumPy keeps them as objects; each is already past int32.
    raise ValueError(f"lengths sum past the int32 offsets' maximum {int32_max}: {lens!r}")
  if host.size == 0 and not hasattr(lens, "dtype"):
    host = host.astype(np.int64)  # [] is float64 in NumPy; no samples, no offsets past 0
  _check_lengths_dtype(host.dtype, lens)
  if host.ndim != 1:
    raise ValueError(f"lengths must be a 1-D array of non-negative ints, got {lens!r}")
  if np.any(host < 0):
    raise ValueError(f"lengths must be non-negative, got {lens!r}")
  # Each term is checked below 2**31 first, so the int64 running sum cannot wrap.
  if host.size and (host.max() > int32_max or np.sum(host, dtype=np.int64) > int32_max):
    raise ValueError(f"lengths sum to {int(np.sum(host, dtype=object))}, past the int32 "
                     f"offsets' maximum {int32_max}")
  return np.concatenate([[0], np.cumsum(host, dtype=np.int64)]).astype(np.int32)


def _check_lengths_dtype(dtype, lens) -> None:
  if not np.issubdtype(np.dtype(dtype), np.integer):
    raise TypeError(f"lengths must have an integer dtype, got {np.dtype(dtype)}: {lens!r}")


def _check_index_args(name: str, offsets, capacity) -> int:
  """The arguments of the index helpers (:func:`segment_ids`, :func:`valid_mask`,
  :func:`positions`, :func:`row_index`): ``capacity`` a static non-negative int, returned as a
  Python int; ``offsets`` a 1-D integer array and, when concrete, following the jagged
  convention for ``capacity`` rows (first 0, non-decreasing, last <= capacity). Traced offsets
  (under ``jax.jit``/``vmap``) cannot raise and are not checked: the indices of offsets that
  break the convention are meaningless (the conversions and ops poison their outputs instead).
  Without the check, a capacity below offsets[-1] gave a mask of all True, offsets not starting
  at 0 negative positions, decreasing ones negative lengths, float offsets a silent search."""
  capacity = _static_size(name, "capacity", capacity)
  if capacity < 0:
    raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
  _check_offsets_kind(name, offsets)
  if not isinstance(offsets, jax.core.Tracer):
    host = _validate.host_offsets(offsets)
    if host[0] != 0 or np.any(np.diff(host) < 0) or host[-1] > capacity:
      raise ValueError(f"{name}: offsets must start at 0, never decrease and end at most at the "
                       f"packed capacity {capacity}, got {host.tolist()}")
  return capacity


def segment_ids(offsets: jax.Array, capacity: int) -> jax.Array:
  """Sample index of each packed row, shape (capacity,), int32.

  Padding rows (index >= offsets[-1]) get B (one past the last sample), so a gather with
  ``mode="fill"`` or a mask from :func:`valid_mask` drops them. A batch converted several times
  computes it once: :func:`row_index`.

  Args:
    offsets: (B+1,) integer array (int32 in the ops; not bool or uint64) of the convention
      above.
    capacity: T, the static number of packed rows: a Python or NumPy int (or a concrete
      integer scalar array), at least offsets[-1].

  Raises:
    TypeError: offsets that are not a 1-D integer array; a non-integer ``capacity``.
    ValueError: a negative ``capacity``; concrete offsets that break the jagged convention for
      ``capacity`` rows (traced ones are not checked).
  """
  capacity = _check_index_args("segment_ids", offsets, capacity)
  return _segment_ids(offsets, capacity)


def _segment_ids(offsets, capacity: int):
  rows = jnp.arange(capacity, dtype=jnp.int32)
  # side="right" maps a row equal to offsets[b] to sample b even when earlier samples are empty.
  return (jnp.searchsorted(offsets, rows, side="right") - 1).astype(jnp.int32).clip(
      0, offsets.shape[0] - 1)


class RowIndex(NamedTuple):
  """Per-row indices of one packed batch, shared by every conversion of that batch.

  ``segment_ids`` (T,) int32: :func:`segment_ids`. ``positions`` (T,) int32: :func:`positions`.
  Build it with :func:`row_index` once per batch and pass it as ``rows=`` to
  :func:`to_padded` and :func:`from_padded`, which otherwise search the offsets on every call
  (and again in their derivatives).
  """

  segment_ids: jax.Array
  positions: jax.Array


def row_index(offsets: jax.Array, capacity: int) -> RowIndex:
  """The :class:`RowIndex` of a packed batch of static ``capacity`` rows (one search of the
  offsets): its segment ids and positions, each (capacity,) int32.

  Args: as :func:`segment_ids`.

  Raises:
    TypeError, ValueError: as :func:`segment_ids`.
  """
  capacity = _check_index_args("row_index", offsets, capacity)
  return _row_index(offsets, capacity)


def _row_index(offsets, capacity: int) -> RowIndex:
  seg = _segment_ids(offsets, capacity)
  starts = jnp.take(offsets, seg, mode="clip")
  return RowIndex(seg, jnp.arange(capacity, dtype=jnp.int32) - starts)


def _rows_for(rows: RowIndex | None, offsets, capacity: int, arg: str):
  """``(rows, mismatch)``: ``rows`` checked against the packed capacity (computed when None),
  and None or, when ``rows`` or ``offsets`` are traced, a traced bool that is True when
  ``rows`` was not built from ``offsets`` (:func:`_rows_mismatch`). Concrete ones that
  disagree raise ValueError: the forward gathers read ``offsets`` and the derivatives ``rows``,
  so a RowIndex of another batch gave the right values with silently wrong gradients."""
  if rows is None:
    return _row_index(offsets, capacity), None
  if not isinstance(rows, RowIndex):
    raise TypeError(f"rows must be a jagged.RowIndex (from jagged.row_index), got "
                    f"{type(rows).__name__}")
  for name, a in zip(rows._fields, rows):
    if tuple(a.shape) != (capacity,) or a.dtype != jnp.int32:
      raise ValueError(f"rows.{name} must be int32 of shape ({capacity},) (the {arg}), got "
                       f"{a.dtype}{list(a.shape)}")
  if capacity == 0:
    return rows, None
  if any(isinstance(a, jax.core.Tracer) for a in (offsets, *rows)):
    mismatch = _rows_mismatch(jnp, rows, offsets, capacity)
    checkify.debug_check(jnp.logical_not(mismatch), ROWS_MISMATCH_MESSAGE)
    return rows, mismatch
  if _rows_mismatch(np, tuple(map(np.asarray, rows)), np.asarray(offsets), capacity):
    raise ValueError(ROWS_MISMATCH)
  return rows, None


ROWS_MISMATCH = "rows is not the jagged.row_index of these offsets (a RowIndex of another batch)"
ROWS_MISMATCH_MESSAGE = f"jagged conversion: {ROWS_MISMATCH}; the output and the gradients are NaN"


def _rows_mismatch(xp, rows, offsets, capacity: int):
  """True when ``rows`` (segment ids, positions) is not the row index of valid ``offsets``, in
  2B + 1 lookups instead of a search: each non-empty sample's first row must have its sample
  id and position 0, its last row its sample id, and the first padding row (if any) the id B.
  With the rows of valid offsets, these pin every offset (``xp``: NumPy or jax.numpy)."""
  seg, pos = rows
  batch = offsets.shape[0] - 1
  starts, ends = offsets[:-1], offsets[1:]
  samples = xp.arange(batch)
  first = xp.clip(starts, 0, capacity - 1)
  last = xp.clip(ends - 1, 0, capacity - 1)
  wrong = (ends > starts) & ((seg[first] != samples) | (pos[first] != 0) | (seg[last] != samples))
  padding = xp.clip(offsets[-1], 0, capacity - 1)
  return xp.any(wrong) | ((offsets[-1] < capacity) & (seg[padding] != batch))


def valid_mask(offsets: jax.Array, capacity: int) -> jax.Array:
  """True for real tokens, False for padding rows; shape (capacity,), bool.

  Args and Raises: as :func:`segment_ids`."""
  capacity = _check_index_args("valid_mask", offsets, capacity)
  return _valid_mask(offsets, capacity)


def _valid_mask(offsets, capacity: int):
  return jnp.arange(capacity, dtype=jnp.int32) < offsets[-1]


def positions(offsets: jax.Array, capacity: int) -> jax.Array:
  """Position of each packed row inside its own sample, shape (capacity,), int32.

  Args and Raises: as :func:`segment_ids`."""
  capacity = _check_index_args("positions", offsets, capacity)
  return _row_index(offsets, capacity).positions


def _static_size(name: str, size_name: str, size) -> int:
  """``size`` (a Python or NumPy integer, or a concrete integer scalar array) as a Python int;
  TypeError naming ``size_name`` otherwise (``operator.index``'s own message names nothing)."""
  try:
    if isinstance(size, bool):
      raise TypeError
    return operator.index(size)
  except TypeError:
    raise TypeError(f"{name}: {size_name} must be an int (static), got {size!r}") from None


def _array_arg(name: str, arg_name: str, a, min_ndim: int) -> None:
  """TypeError naming ``arg_name`` when ``a`` is not an array, ValueError when it has fewer than
  ``min_ndim`` dimensions (checked before its shape is read)."""
  if not _validate.is_array(a):
    raise TypeError(f"{name}: {arg_name} must be an array (a jax.Array or numpy.ndarray), got "
                    f"{type(a).__name__}")
  if a.ndim < min_ndim:
    raise ValueError(f"{name}: {arg_name} must have at least {min_ndim} dimension(s), got shape "
                     f"{tuple(a.shape)}")


def _check_conversion(name: str, values, offsets, capacity: int, size_name: str,
                      size: int) -> np.ndarray | None:
  """Checks the arguments of :func:`to_padded` / :func:`from_padded`: ``offsets`` a 1-D integer
  array (B+1,) and, when concrete (not traced under ``jax.jit``), following the jagged
  convention for ``capacity`` rows; ``size`` (max_len or capacity) non-negative. The gathers
  clip their indices, so offsets past the capacity or a batch that disagrees with the padded
  tensor would otherwise give silently wrong rows. Returns the concrete offsets (NumPy), or
  None for traced ones (see :func:`_traced_invalid`)."""
  if not hasattr(values, "shape") or not hasattr(offsets, "dtype") or not hasattr(
      offsets, "shape"):
    raise TypeError(f"{name}: values and offsets must be arrays, got {type(values).__name__} "
                    f"and {type(offsets).__name__}")
  _check_offsets_kind(name, offsets)
  if size < 0:
    raise ValueError(f"{name}: {size_name} must be >= 0, got {size}")
  if isinstance(offsets, jax.core.Tracer):
    return None  # traced values cannot raise: the conversions poison their outputs instead
  host = _validate.host_offsets(offsets)
  if host[0] != 0 or np.any(np.diff(host) < 0) or host[-1] > capacity:
    raise ValueError(f"{name}: offsets must start at 0, never decrease and end at most at the "
                     f"packed capacity {capacity}, got {host.tolist()}")
  return host


def _check_lengths(name: str, host: np.ndarray | None, max_len: int, max_len_name: str) -> None:
  """Concrete offsets whose longest sample fits the padded length (the gathers would silently
  drop the rows past it)."""
  if host is None or host.shape[0] < 2:
    return
  longest = int(np.max(np.diff(host)))
  if longest > max_len:
    raise ValueError(f"{name}: a sample of offsets has {longest} rows, more than "
                     f"{max_len_name}={max_len}")


OFFSETS_INVALID_MESSAGE = (
    "jagged conversion: traced offsets break the jagged convention (first != 0, decreasing, last "
    "past the packed capacity, or a sample longer than the padded length); the output and the "
    "gradients are NaN")


def _traced_invalid(offsets, capacity: int, max_len: int):
  """None for concrete offsets (checked already); for traced ones a scalar bool, True when they
  break the jagged convention for ``capacity`` packed rows and padded length ``max_len`` (a few
  scalar reductions over the B+1 offsets), also a checkify debug check of it."""
  if not isinstance(offsets, jax.core.Tracer):
    return None
  bad = _validate.offsets_invalid(offsets, capacity, max_len)
  checkify.debug_check(jnp.logical_not(bad), OFFSETS_INVALID_MESSAGE)
  return bad


def _either(a, b):
  """``a | b`` for optional traced bools (None: known False)."""
  return b if a is None else a if b is None else a | b


def to_padded(values: jax.Array, offsets: jax.Array, max_len: int, *,
              rows: RowIndex | None = None) -> jax.Array:
  """Packed ``(T, ...)`` -> padded ``(B, max_len, ...)``, zeros past each sample's length.

  Samples are never truncated: concrete offsets with a sample longer than ``max_len`` raise.
  Traced offsets (under ``jax.jit`` / ``vmap``) cannot raise: when they break the jagged
  convention (first != 0, decreasing, last > T, a sample longer than ``max_len``) a float output
  is all NaN, and so are the tangents and the gradient of ``values`` (also a
  :func:`jax.experimental.checkify.debug_check` error under ``checkify``); integer values cannot
  hold NaN and are not poisoned. A zero capacity (``T == 0``) gives zeros.

  Differentiable in ``values``: the gradient is :func:`from_padded` of the cotangent (a gather,
  since on the valid rows each conversion is the other's transpose), not the scatter-add that
  autodiff of the forward gather would give. ``offsets`` get no gradient. ``rows``: the
  batch's :func:`row_index` (the derivatives need it), else computed here.

  Args:
    values: (T, ...) packed rows, any dtype.
    offsets: (B+1,) integer array (int32 in the ops; not bool or uint64).
    max_len: the static padded length L: a non-negative Python or NumPy int.
    rows: optional :class:`RowIndex` of ``offsets`` for T rows.

  Returns:
    (B, max_len, ...) in values' dtype.

  Raises:
    TypeError: values or offsets that are not arrays; offsets that are not a 1-D integer
      array; a non-integer ``max_len``; ``rows`` that is not a :class:`RowIndex`.
    ValueError: a 0-d ``values``; a negative ``max_len``, or one that gives more than 2**31
      padded rows (B · max_len: the rows are indexed in int32); concrete offsets that break the
      jagged convention (first 0, non-decreasing, last <= T) or hold a sample longer than
      ``max_len``; ``rows`` not of T int32 rows, or (concrete) not the row index of
      ``offsets``. Traced offsets are not checked here but poison the output (above), and so
      do traced ``rows`` that are not the row index of ``offsets`` (a RowIndex of another
      batch would give the right values but wrong gradients).
  """
  _array_arg("to_padded", "values", values, 1)
  max_len = _static_size("to_padded", "max_len", max_len)
  host = _check_conversion("to_padded", values, offsets, values.shape[0], "max_len", max_len)
  if (offsets.shape[0] - 1) * max_len > 2**31:  # the padded rows are indexed in int32
    raise ValueError(f"to_padded: max_len = {max_len} gives {offsets.shape[0] - 1} × {max_len} "
                     f"padded rows, past the 2**31 that int32 row indices reach")
  _check_lengths("to_padded", host, max_len, "max_len")
  rows, mismatch = _rows_for(rows, offsets, values.shape[0], "values' T")
  bad = _either(_traced_invalid(offsets, values.shape[0], max_len), mismatch)
  return _to_padded_linear(values, offsets, rows, bad, max_len)


def from_padded(padded: jax.Array, offsets: jax.Array, capacity: int, *,
                rows: RowIndex | None = None) -> jax.Array:
  """Padded ``(B, L, ...)`` -> packed ``(capacity, ...)``, zeros in the padding rows.

  Positions at or past a sample's length are never read; an empty padded tensor
  (``B·L == 0``) gives zeros. A sample longer than ``L`` would lose rows: concrete offsets
  raise, and traced ones (under ``jax.jit`` / ``vmap``) that break the jagged convention (first
  != 0, decreasing, last > capacity, a sample longer than ``L``) make a float output all NaN,
  and its tangents and the gradient of ``padded`` too (also a checkify debug check).
  Differentiable in ``padded``: the gradient is
  :func:`to_padded` of the cotangent (a gather, zeros past each length), not a scatter-add.
  ``rows``: the batch's :func:`row_index` of ``capacity`` rows, else computed here.

  Args:
    padded: (B, L, ...), any dtype.
    offsets: (B+1,) integer array (int32 in the ops; not bool or uint64).
    capacity: T, the static number of packed rows: a non-negative Python or NumPy int.
    rows: optional :class:`RowIndex` of ``offsets`` for ``capacity`` rows.

  Returns:
    (capacity, ...) in padded's dtype.

  Raises:
    TypeError: padded or offsets that are not arrays; offsets that are not a 1-D integer
      array; a non-integer ``capacity``; ``rows`` that is not a :class:`RowIndex`.
    ValueError: ``padded`` with fewer than 2 dimensions or another batch than the offsets'
      B; a negative ``capacity``; concrete offsets that break the jagged convention (first 0,
      non-decreasing, last <= capacity) or hold a sample longer than ``L``; ``rows`` not of
      ``capacity`` int32 rows, or (concrete) not the row index of ``offsets``. Traced offsets
      (and traced ``rows`` of another batch) are not checked here but poison the output.
  """
  _array_arg("from_padded", "padded", padded, 2)
  capacity = _static_size("from_padded", "capacity", capacity)
  host = _check_conversion("from_padded", padded, offsets, capacity, "capacity", capacity)
  if padded.ndim < 2 or padded.shape[0] != offsets.shape[0] - 1:
    raise ValueError(f"from_padded: padded must have shape (B, L, ...) with B = "
                     f"len(offsets) - 1 = {offsets.shape[0] - 1}, got {tuple(padded.shape)}")
  _check_lengths("from_padded", host, padded.shape[1], "L (padded.shape[1])")
  rows, mismatch = _rows_for(rows, offsets, capacity, "capacity")
  bad = _either(_traced_invalid(offsets, capacity, padded.shape[1]), mismatch)
  return _from_padded_linear(padded, offsets, rows, bad, capacity)


def _gather_to_padded(values, offsets, max_len, *, rows=None):
  """The forward of :func:`to_padded` as plain jnp (autodiff of it is a scatter-add); ``rows``
  is unused (the gather reads rows ``offsets[b] + l``)."""
  del rows
  batch = offsets.shape[0] - 1
  shape = (batch, max_len) + values.shape[1:]
  if values.shape[0] == 0 or batch * max_len == 0:  # nothing to gather (take() would raise)
    return jnp.zeros(shape, values.dtype)
  pos = jnp.arange(max_len, dtype=jnp.int32)
  rows = offsets[:-1, None] + pos[None, :]  # (B, max_len)
  inside = pos[None, :] < _lengths(offsets)[:, None]
  gathered = jnp.take(values, rows.reshape(-1), axis=0, mode="clip").reshape(shape)
  mask = inside.reshape(inside.shape + (1,) * (values.ndim - 1))
  return jnp.where(mask, gathered, jnp.zeros((), values.dtype))


def _gather_from_padded(padded, offsets, capacity, *, rows=None):
  """The forward of :func:`from_padded` as plain jnp (autodiff of it is a scatter-add)."""
  batch, max_len = padded.shape[:2]
  if batch * max_len == 0 or capacity == 0:
    return jnp.zeros((capacity,) + padded.shape[2:], padded.dtype)
  seg, pos = _row_index(offsets, capacity) if rows is None else rows
  valid = _valid_mask(offsets, capacity) & (pos < max_len)
  flat = padded.reshape((batch * max_len,) + padded.shape[2:])
  idx = jnp.where(valid, seg * max_len + pos, 0)
  out = jnp.take(flat, idx, axis=0, mode="clip")
  mask = valid.reshape(valid.shape + (1,) * (padded.ndim - 2))
  return jnp.where(mask, out, jnp.zeros((), padded.dtype))


def _scatter_to_padded(values, offsets, max_len, rows):
  """:func:`to_padded` written as a scatter-add (the same linear map; its transpose is a gather)."""
  batch, capacity = offsets.shape[0] - 1, values.shape[0]
  shape = (batch, max_len) + values.shape[1:]
  if capacity == 0 or batch * max_len == 0:
    return jnp.zeros(shape, values.dtype)
  seg, pos = rows
  valid = _valid_mask(offsets, capacity) & (pos < max_len)
  idx = jnp.where(valid, seg * max_len + pos, batch * max_len)
  flat = jnp.zeros((batch * max_len,) + values.shape[1:], values.dtype)
  return flat.at[idx].add(values, mode="drop").reshape(shape)


def _scatter_from_padded(padded, offsets, capacity, rows):
  """:func:`from_padded` written as a scatter-add (the same linear map; its transpose is a
  gather)."""
  del rows  # the scatter writes rows offsets[b] + l
  batch, max_len = padded.shape[:2]
  if batch * max_len == 0 or capacity == 0:
    return jnp.zeros((capacity,) + padded.shape[2:], padded.dtype)
  pos = jnp.arange(max_len, dtype=jnp.int32)
  rows = offsets[:-1, None] + pos[None, :]  # (B, max_len)
  rows = jnp.where(pos[None, :] < _lengths(offsets)[:, None], rows, capacity).reshape(-1)
  flat = padded.reshape((batch * max_len,) + padded.shape[2:])
  out = jnp.zeros((capacity,) + padded.shape[2:], padded.dtype)
  return out.at[rows].add(flat, mode="drop")


def _linear_map(gather, scatter):
  """``gather(x, offsets, out_size, rows=rows)`` whose tangent map is ``scatter``, the same
  linear map written as a scatter-add. Reverse mode transposes the tangent map, and the
  transpose of a scatter-add is a gather: so the gradient of each conversion is the other
  conversion, a gather, where autodiff of ``gather`` would give a scatter-add (milliseconds at
  the benchmark's B = 768, L = 512: serialized atomic adds). Forward mode (jvp, hessians) stays
  available, unlike with a custom_vjp.
  ``to_padded`` and ``from_padded`` transpose each other on the valid rows (row
  ``offsets[b] + l`` <-> position ``(b, l)`` for ``l < min(length_b, max_len)``); every other
  entry is a constant zero. ``rows`` (the batch's :class:`RowIndex`, integer arrays: no
  tangent) is passed in, so that the scatters' indices are not searched again. ``bad`` (None,
  or a traced bool from :func:`_traced_invalid`) multiplies the output, the tangent and, through
  the transpose, the cotangent by NaN where the offsets are invalid
  (:func:`pallas_norm._validate.nan_if`)."""

  @functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
  def convert(x, offsets, rows, bad, out_size):
    return _validate.nan_if(bad, gather(x, offsets, out_size, rows=rows))

  @convert.defjvp
  def convert_jvp(out_size, primals, tangents):
    x, offsets, rows, bad = primals
    tangent = _validate.nan_if(
        bad, scatter(_validate.nan_if(bad, tangents[0]), offsets, out_size, rows))
    return convert(x, offsets, rows, bad, out_size), tangent

  return convert


_to_padded_linear = _linear_map(_gather_to_padded, _scatter_to_padded)
_from_padded_linear = _linear_map(_gather_from_padded, _scatter_from_padded)


def _check_offsets_kind(name: str, offsets) -> None:
  """TypeError naming ``name`` unless ``offsets`` is a 1-D integer array of at least one entry,
  not uint64 (whose sums with int32 positions JAX promotes to float64). The dtype as JAX sees
  it: without x64 a NumPy uint64 array is uint32, as under ``jax.jit``, which converts it
  before the helper sees it (the eager call refused what the jitted one took)."""
  if not _validate.is_array(offsets) or not jnp.issubdtype(offsets.dtype, jnp.integer) or (
      _validate.jax_dtype(offsets) in (jnp.dtype(bool), jnp.dtype("uint64"))) or (
      offsets.ndim != 1 or offsets.shape[0] < 1):
    raise TypeError(f"{name}: offsets must be a 1-D integer (int32) array of shape (B+1,), got "
                    f"{getattr(offsets, 'dtype', type(offsets).__name__)} of shape "
                    f"{tuple(getattr(offsets, 'shape', ()))}")
