"""Generalized dot-product attention over jagged queries (DESIGN.md, op 3; Meta's GDPA).

``o_h = post_scale · act(pre_scale · q_h k_hᵀ) v_h`` per sample and head, with no softmax and no
row normalization; keys past a sample's length contribute exactly zero. Jagged layout:
:mod:`pallas_norm.jagged`. Oracle: :func:`pallas_norm.reference.gdpa`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_norm import _dispatch, _validate, reference


def check_args(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale, max_seq_len,
               max_kv_len, out_dtype) -> None:
  """Validates the attention arguments shared by :func:`gdpa` and ``flash_norm_attention``."""
  _validate.float_array("q", q, ndim=3)
  t, h, d = q.shape
  if kv_offsets is None:
    _validate.float_array("k", k, ndim=4)
    _validate.float_array("v", v, ndim=4)
  else:
    _validate.float_array("k", k, ndim=3)
    _validate.float_array("v", v, ndim=3)
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                     f"{tuple(v.shape)}")
  if tuple(k.shape[-2:]) != (h, d):
    raise ValueError(f"k and v must end in (H, D) = {(h, d)} like q, got {tuple(k.shape)}")
  if not (jnp.dtype(q.dtype) == jnp.dtype(k.dtype) == jnp.dtype(v.dtype)):
    raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  _validate.static_positive_int("max_seq_len", max_seq_len)
  _validate.static_positive_int("max_kv_len", max_kv_len)
  batch = _validate.offsets("q_offsets", q_offsets, t, max_len=max_seq_len)
  if kv_offsets is None:
    if k.shape[0] != batch:
      raise ValueError(f"dense k/v must have batch size B = len(q_offsets) - 1 = {batch}, "
                       f"got {k.shape[0]}")
    if max_kv_len is not None:
      raise ValueError("max_kv_len applies only to jagged k/v (with kv_offsets)")
  else:
    kv_batch = _validate.offsets("kv_offsets", kv_offsets, k.shape[0], max_len=max_kv_len,
                                 max_len_name="max_kv_len")
    if kv_batch != batch:
      raise ValueError(f"kv_offsets must describe B = {batch} samples like q_offsets, "
                       f"got {kv_batch}")
  if activation not in reference.ACTIVATIONS:
    raise ValueError(f"activation must be one of {sorted(reference.ACTIVATIONS)}, "
                     f"got {activation!r}")
  _validate.finite_scalar("pre_scale", pre_scale)
  _validate.finite_scalar("post_scale", post_scale)
  _validate.out_dtype(out_dtype)


def gdpa(q, k, v, q_offsets, kv_offsets=None, *, activation: str = "fast_gelu",
         pre_scale: float = 1.0, post_scale: float = 1.0, max_seq_len: int | None = None,
         max_kv_len: int | None = None, out_dtype=None, implementation=None):
  """Jagged generalized dot-product attention.

  Args:
    q: (T, H, D) packed query tokens; T is a static capacity.
    k, v: dense (B, Lkv, H, D), or packed (Tkv, H, D) with ``kv_offsets``; q's dtype.
    q_offsets: int32 (B+1,) jagged offsets of q (first 0, non-decreasing, last <= T).
    kv_offsets: optional int32 (B+1,) offsets of packed k/v.
    activation: "fast_gelu" (tanh GELU, default), "gelu", "silu", "relu", "relu2",
      "leaky_relu" (slope 0.01) or "identity".
    pre_scale, post_scale: finite real scalars (default 1): numbers or 0-d integer/floating
      arrays, traced ones included (an array of another shape would broadcast, so it raises).
    max_seq_len: static bound on q lengths; makes the XLA path use a padded (B, max_seq_len)
      layout (fast). Without it the XLA path gathers K/V per token (O(T·Lkv·H·D) memory).
    max_kv_len: static bound on jagged k/v lengths (default Tkv).
    out_dtype: output dtype (default q.dtype).
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`).

  Returns:
    (T, H, D); padding rows (>= q_offsets[-1]) are zeros.

  Offsets that are traced (under ``jax.jit``/``vmap``) cannot raise: if they break the jagged
  convention (first != 0, decreasing, last > T, a length over max_seq_len/max_kv_len) the whole
  output is NaN rather than silently wrong.

  Raises:
    TypeError: dtypes; a non-array q, k, v or offsets; a pre_scale or post_scale that is not a
    real scalar (also under ``jax.jit``: a traced scale must be 0-d, integer or floating).
    ValueError: shapes, offsets (when concrete), activation, non-finite concrete scales, lengths
    over max_seq_len/max_kv_len. NotImplementedError: kernel implementation not available.
  """
  check_args(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale, max_seq_len,
             max_kv_len, out_dtype)
  _dispatch.choose("gdpa", implementation)
  out = reference.gdpa(q, k, v, q_offsets, kv_offsets, activation=activation,
                        pre_scale=pre_scale, post_scale=post_scale, max_seq_len=max_seq_len,
                        max_kv_len=max_kv_len, out_dtype=out_dtype)
  return poison_if_offsets_invalid(out, q_offsets, kv_offsets, q.shape[0], k.shape[0],
                                   max_seq_len, max_kv_len)


def poison_if_offsets_invalid(out, q_offsets, kv_offsets, capacity, kv_capacity, max_seq_len,
                              max_kv_len):
  """NaN everywhere, in the output and in the gradients, when traced offsets break the jagged
  convention (see :func:`pallas_norm._validate.offsets_invalid`), and a checkify error under
  ``jax.experimental.checkify.checkify``; concrete offsets were already checked."""
  traced = [o for o in (q_offsets, kv_offsets) if isinstance(o, jax.core.Tracer)]
  if not traced:
    return out
  bad = _validate.offsets_invalid(q_offsets, capacity, max_seq_len)
  if kv_offsets is not None:
    bad = bad | _validate.offsets_invalid(kv_offsets, kv_capacity, max_kv_len)
  return _validate.poison_if_invalid(out, bad, OFFSETS_INVALID_MESSAGE)


OFFSETS_INVALID_MESSAGE = (
    "pallas_norm: traced q_offsets/kv_offsets break the jagged convention (first 0, "
    "non-decreasing, last <= the packed capacity, no length over max_seq_len/max_kv_len); the "
    "output and its gradients are NaN")
