"""Jagged attention layers of the Kunlun PFFN (DESIGN.md, ops 3 and 4, and "Where the Kunlun PFFN
comes from"): the per-sample FFN weights are generated from context features and passed in as
K (= W1ᵀ) and V (= W2), so these layers hold only the norm affines and the attention config.

* :class:`GDPA`: ``o = post_scale · act(pre_scale · q kᵀ) v`` over :func:`pallas_norm.gdpa`.
* :class:`PFFNBlock`: LayerNorm → GDPA (+u) → RMSNorm (+q) over
  :func:`pallas_norm.flash_norm_attention`.

The model's softmax attentions are :func:`pallas_norm.softmax_attention` (cuDNN's flash attention
on an NVIDIA GPU, XLA elsewhere).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import pallas_norm
from flax_layers import _common


def _check_config(layer, num_heads, head_dim, activation, pre_scale, post_scale, dtype):
  """The checked (num_heads, head_dim); raises for a bad config when the layer is built. The
  scales are checked as the ops check them for inputs of the compute ``dtype`` (finite in
  float32 unless it is float64 with x64), by epsilon's rule (:func:`_common.rule_dtype`)."""
  num_heads = _common.check_features(layer, "num_heads", num_heads)
  head_dim = _common.check_features(layer, "head_dim", head_dim)
  _common.check_activation(layer, activation, pallas_norm.ACTIVATIONS)
  _common.check_scale(layer, "pre_scale", pre_scale, dtype)
  _common.check_scale(layer, "post_scale", post_scale, dtype)
  return num_heads, head_dim


class GDPA(nnx.Module):
  """Generalized (softmax-free) dot-product attention over jagged queries; no parameters.

  The op is :func:`pallas_norm.gdpa` (its values: :func:`pallas_norm.reference.gdpa`; the math:
  DESIGN.md op 3 and "Where the Kunlun PFFN comes from").

  Args:
    num_heads: H. head_dim: D (positive integers, checked against the inputs).
    activation: one of :data:`pallas_norm.ACTIVATIONS` (default "fast_gelu").
    pre_scale, post_scale: finite scalars (default 1), kept as Python floats: static config,
      not traced under ``nnx.jit`` (a 0-d array too).
    dtype: compute dtype; q, k, v are cast to it (default: their promoted dtype).
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`).

  Raises:
    ValueError: at construction, for num_heads or head_dim that is not a positive integer, an
      unknown activation, a pre_scale or post_scale that is not finite (in float32, or float64
      where the layer computes in float64 with x64; the rule of epsilon, see
      `_common.check_epsilon`) or an unknown implementation; at
      call time, when q is not of shape (T, num_heads, head_dim) or q_offsets is not 1-D.
    TypeError: at construction, for a pre_scale or post_scale that is not a real scalar (a
      number or a 0-d integer or floating array) or a dtype that is neither None nor a floating
      dtype; at call time, for a non-array q, q_offsets, k or v, a q_offsets that is not of an
      integer dtype (checked first, naming the layer's order (q, q_offsets, k, v)), or an
      argument after v passed positionally (they are keyword-only).
    At call time also as :func:`pallas_norm.gdpa` for other bad inputs (its RuntimeError, for
    ``implementation="interpret"`` alone on a CPU with too few threads, too), with the layer's
    class name in front ("GDPA: gdpa: implementation='interpret' cannot run here: ...").
    The construction errors start with it too ("GDPA: activation must be one of ...").
  """

  def __init__(self, num_heads: int, head_dim: int, *, activation: str = "fast_gelu",
               pre_scale: float = 1.0, post_scale: float = 1.0, dtype=None,
               implementation=None):
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    self.num_heads, self.head_dim = _check_config(
        type(self).__name__, num_heads, head_dim, activation, pre_scale, post_scale, self.dtype)
    self.activation = activation
    self.pre_scale, self.post_scale = map(_common.static_scale, (pre_scale, post_scale))
    self.implementation = _common.check_implementation(type(self).__name__, implementation)

  def __call__(self, q, q_offsets, k, v, *, kv_offsets=None, max_seq_len: int | None = None,
               max_kv_len: int | None = None):
    """q: (T, H, D) packed tokens with int32 ``q_offsets`` (B+1,); k, v: (B, Lkv, H, D) per
    sample (or packed (Tkv, H, D) with ``kv_offsets``). ``max_seq_len``: static bound on the
    sequence lengths (the XLA path pads to it). Returns (T, H, D) in the compute dtype, zeros
    on padding rows.
    Pass ``max_seq_len`` in training: without it the XLA path (every non-Hopper backend) gathers
    K/V per token, O(T·Lkv·H·D) memory (tens of GB at the PFFN shape; ``pallas_norm.gdpa``).

    The arguments after ``v`` are keyword-only, as in :class:`PFFNBlock` (the two layers once
    took them in different positional orders, so ``layer(q, off, k, v, 8)`` meant kv_offsets=8
    here and max_seq_len=8 there); a positional one raises Python's TypeError."""
    _check_offsets(self, q_offsets)
    _check_heads(self, "q", q)
    _check_arrays(self, k=k, v=v)
    cd = _common.compute_dtype(self.dtype, q, k, v)
    with _common.op_errors(type(self).__name__, self.dtype, q.dtype, cd, [], k=k, v=v):
      q, k, v = _common.cast(cd, q, k, v)
      return pallas_norm.gdpa(q, k, v, q_offsets, kv_offsets, activation=self.activation,
                              pre_scale=self.pre_scale, post_scale=self.post_scale,
                              max_seq_len=max_seq_len, max_kv_len=max_kv_len,
                              implementation=self.implementation)


def _check_offsets(layer, q_offsets):
  """The layer's second argument must be q_offsets, a 1-D integer array. Checked first: the
  layers take (q, q_offsets, k, v) where the ops take (q, k, v, q_offsets), and a call in the
  ops' order failed on v ("v must have 4 dimensions, got shape (3,)")."""
  name = type(layer).__name__
  order = (f"{name} takes (q, q_offsets, k, v), unlike pallas_norm.gdpa's (q, k, v, q_offsets)")
  shape = _common.shape_of(name, "q_offsets", q_offsets)
  dtype = jnp.dtype(q_offsets.dtype)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name}: q_offsets (the second argument) must be a 1-D integer array, got "
                    f"dtype {dtype} and shape {shape}; {order}")
  if len(shape) != 1:
    raise ValueError(f"{name}: q_offsets (the second argument) must be a 1-D integer array, got "
                     f"shape {shape}; {order}")


def _check_arrays(layer, **arrays):
  """TypeError naming the argument when one of ``arrays`` is not an array."""
  for name, a in arrays.items():
    _common.shape_of(type(layer).__name__, name, a)


def _check_heads(layer, name, q):
  """Checks the layer's query argument ``name`` against its num_heads and head_dim."""
  shape = _common.shape_of(type(layer).__name__, name, q)
  h, d = layer.num_heads, layer.head_dim
  if len(shape) != 3 or shape[1:] != (h, d):
    raise ValueError(f"{type(layer).__name__}: {name} must have shape (T, num_heads, head_dim) = "
                     f"(T, {h}, {d}), got {shape}")


class PFFNBlock(nnx.Module):
  """The Kunlun personalized FFN block, per token over all H·D features::

      u   = LayerNorm(q)·ln_scale + ln_bias     (pre_layer_norm; else u = q)
      z   = u + post_scale · act(pre_scale · u kᵀ) v     (inner_residual; else without u +)
      out = RMSNorm(z)·rms_scale + q     (outer_residual; else without + q)

  The op is :func:`pallas_norm.flash_norm_attention` (its values:
  :func:`pallas_norm.reference.flash_norm_attention`; the block: DESIGN.md op 4 and "Where the
  Kunlun PFFN comes from").

  Args:
    num_heads: H. head_dim: D. Positive integers.
    activation, pre_scale, post_scale: the GDPA config (see :class:`GDPA`).
    epsilon: positive float of both norms (default 1e-6); stored as a Python float.
    use_scale: create ``ln_scale`` and ``rms_scale`` (H·D,). use_bias: create ``ln_bias``.
    dtype: compute dtype (q, k, v and the affines are cast to it). param_dtype: a floating
      dtype (default float32).
    scale_init (default ones), bias_init (default zeros): initializers.
    rngs: ``nnx.Rngs``.
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`).
    pre_layer_norm, inner_residual, outer_residual: bools (default True), the op's switches
      (:func:`pallas_norm.flash_norm_attention`); without the LayerNorm the block has no
      ``ln_scale``/``ln_bias``.

  Raises: as :class:`GDPA` (the query argument being ``q_tokens``), plus at construction ValueError
  for an epsilon that is not positive and finite (in float32, or float64 where the layer computes
  in float64 with x64; see `_common.check_epsilon`) and TypeError for a non-number epsilon, a
  use_scale/use_bias or a switch that is not a bool, a param_dtype that is not a floating dtype
  (bfloat16, float16, float32, float64), or an rngs that is not an ``nnx.Rngs`` (also where the
  block creates no parameter); at call time also as :func:`pallas_norm.flash_norm_attention`.
  """

  def __init__(self, num_heads: int, head_dim: int, *, activation: str = "fast_gelu",
               pre_scale: float = 1.0, post_scale: float = 1.0, epsilon: float = 1e-6,
               use_scale: bool = True, use_bias: bool = True, dtype=None,
               param_dtype=jnp.float32, scale_init=nnx.initializers.ones,
               bias_init=nnx.initializers.zeros, rngs: nnx.Rngs, implementation=None,
               pre_layer_norm: bool = True, inner_residual: bool = True,
               outer_residual: bool = True):
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    self.num_heads, self.head_dim = _check_config(
        type(self).__name__, num_heads, head_dim, activation, pre_scale, post_scale, self.dtype)
    _common.check_switches(type(self).__name__, pre_layer_norm=pre_layer_norm,
                           inner_residual=inner_residual, outer_residual=outer_residual)
    self.pre_layer_norm = pre_layer_norm
    self.inner_residual, self.outer_residual = inner_residual, outer_residual
    self.activation = activation
    self.pre_scale, self.post_scale = map(_common.static_scale, (pre_scale, post_scale))
    self.epsilon = _common.check_epsilon(type(self).__name__, epsilon, self.dtype)
    self.param_dtype = _common.check_dtype(type(self).__name__, param_dtype, "param_dtype")
    self.implementation = _common.check_implementation(type(self).__name__, implementation)
    _common.check_switches(type(self).__name__, use_scale=use_scale, use_bias=use_bias)
    _common.check_rngs(type(self).__name__, rngs)
    features = self.num_heads * self.head_dim
    make = lambda init, use: (_common.param(rngs, init, (features,), param_dtype)  # noqa: E731
                              if use else None)
    self.ln_scale = make(scale_init, use_scale and pre_layer_norm)
    self.ln_bias = make(bias_init, use_bias and pre_layer_norm)
    self.rms_scale = make(scale_init, use_scale)

  def __call__(self, q_tokens, q_offsets, k, v, *, kv_offsets=None,
               max_seq_len: int | None = None, max_kv_len: int | None = None):
    """q_tokens: (T, H, D) packed with int32 ``q_offsets`` (B+1,); k, v: (B, Lkv, H, D) (or
    packed with ``kv_offsets``). Returns (T, H, D) in the compute dtype, zeros on padding rows.
    Pass ``max_seq_len`` in training, as for :meth:`GDPA.__call__` (without it the XLA path
    gathers K/V per token). The arguments after ``v`` are keyword-only (see
    :meth:`GDPA.__call__`)."""
    _check_offsets(self, q_offsets)
    _check_heads(self, "q_tokens", q_tokens)
    _check_arrays(self, k=k, v=v)
    affines = [_common.value(p) for p in (self.ln_scale, self.ln_bias, self.rms_scale)]
    cd = _common.compute_dtype(self.dtype, q_tokens, k, v, *affines)
    with _common.op_errors(type(self).__name__, self.dtype, q_tokens.dtype, cd, affines,
                           k=k, v=v):
      q, k, v, ln_scale, ln_bias, rms_scale = _common.cast(cd, q_tokens, k, v, *affines)
      return pallas_norm.flash_norm_attention(
          q, k, v, q_offsets, kv_offsets, ln_scale=ln_scale, ln_bias=ln_bias,
          rms_scale=rms_scale, activation=self.activation, pre_scale=self.pre_scale,
          post_scale=self.post_scale, eps=self.epsilon, max_seq_len=max_seq_len,
          max_kv_len=max_kv_len, implementation=self.implementation,
          pre_layer_norm=self.pre_layer_norm, inner_residual=self.inner_residual,
          outer_residual=self.outer_residual)
