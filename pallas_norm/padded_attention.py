"""Softmax attention over padded sequences, as the Kunlun model's self-attention and seed pooling
use it: cuDNN's flash attention through ``jax.nn.dot_product_attention`` on an NVIDIA GPU and
XLA's attention elsewhere. No pallas-norm kernel: a well-kept library's attention beats our own
code here (docs/DESIGN.md, "Where the Kunlun PFFN comes from"); this module only chooses the
backend per call and makes the padding rules of the two agree.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallas_norm import _dispatch, _validate

__all__ = ["softmax_attention", "softmax_attention_backend"]

log = logging.getLogger("pallas_norm")


def softmax_attention(q, k, v, q_lengths, kv_lengths, *, implementation=None):
  """Softmax attention ``softmax(q kᵀ / sqrt(D)) v`` over padded sequences, per sample and head.

  Not one of DESIGN.md's ops (no kernel of ours, no :mod:`pallas_norm.reference` oracle): the
  math is that of ``jax.nn.dot_product_attention`` (default scale 1/sqrt(D)) with a key mask,
  which both backends compute.

  Args:
    q: (B, Lq, H, D) padded queries, bfloat16/float16/float32/float64 (cuDNN: bfloat16 or
      float16). k, v: (B, Lkv, H, D) padded keys and values, q's dtype as JAX sees it
      (without jax_enable_x64 a NumPy float64 array is float32).
    q_lengths: int32 (B,) real query rows per sample, or None (all Lq rows are real).
    kv_lengths: int32 (B,) real keys per sample; keys at or past a sample's length are masked.
    implementation: the model's choice (None, "xla", "mosaic", "interpret" or a sequence of
      them). None or a choice that includes "mosaic" runs cuDNN's flash attention
      (``jax.nn.dot_product_attention(implementation="cudnn")``) where it can (an NVIDIA GPU of
      compute capability >= 8.0 with cuDNN, bf16/f16, D a multiple of 8 up to 256 on Hopper,
      128 before), and XLA's attention elsewhere; "xla" and "interpret" run XLA's (CPU tests).

  Returns:
    (B, Lq, H, D) in q's dtype. Rows at or past ``q_lengths`` and samples with no key
    (``kv_lengths == 0``) hold unspecified finite values (XLA averages the masked values, cuDNN
    attends to key 0): callers drop or zero them, and give those rows a zero cotangent.

  Lengths that are traced (under ``jax.jit``/``vmap``) cannot raise: if one lies outside
  [0, Lq] (q_lengths) or [0, Lkv] (kv_lengths) the whole output is NaN rather than silently
  wrong, and so are the gradients of q, k and v (also a
  :func:`jax.experimental.checkify.debug_check` error under ``checkify``).

  The two backends differ only by rounding: XLA materializes the f32 scores and rounds the
  probabilities to the operands' dtype before the product with v; cuDNN runs a blockwise
  (online) softmax that never stores the scores. float16 on the CPU runs XLA's in float32 (its
  backward needs a float16 dot with a float32 result, which XLA:CPU lacks), rounded back.
  float64 operands get float32 accuracy (~1e-7 relative): ``jax.nn.dot_product_attention``
  computes the softmax in float32 whatever the operands, so a float64 finite-difference check
  (``jax.test_util.check_grads``) of this function fails.

  Raises:
    TypeError: q, k, v that are not float arrays of one dtype; lengths that are not int32
      arrays (kv_lengths None included).
    ValueError: an implementation that is not a known name (or an empty sequence); q not 4-D,
      k or v not (B, Lkv, H, D) for q's B, H, D; lengths not of shape (B,); concrete lengths
      outside [0, Lq] (q_lengths) or [0, Lkv] (kv_lengths). Traced lengths are not checked
      here but poison the output (above).
  """
  implementation = _check_args(q, k, v, q_lengths, kv_lengths, implementation)
  q, k, v, q_lengths, kv_lengths = _validate.to_jax(q, k, v, q_lengths, kv_lengths)
  bad = _lengths_invalid(q_lengths, kv_lengths, q.shape[1], k.shape[1])
  if bad is None:
    return _attention(q, k, v, q_lengths, kv_lengths, implementation)
  # The inputs are poisoned too (with the checkify error), not only the output: the backends'
  # key masks would otherwise send exact zeros back to the masked keys, a finite gradient. The
  # lengths are clipped to the padded lengths for the backends, which do not expect others.
  q, k, v = _validate.poison_if_invalid((q, k, v), bad, LENGTHS_INVALID_MESSAGE)
  q_lengths = None if q_lengths is None else jnp.clip(q_lengths, 0, q.shape[1])
  out = _attention(q, k, v, q_lengths, jnp.clip(kv_lengths, 0, k.shape[1]), implementation)
  return _validate.nan_if(bad, out)


LENGTHS_INVALID_MESSAGE = (
    "pallas_norm: traced q_lengths/kv_lengths lie outside [0, Lq] / [0, Lkv] (the padded "
    "lengths); the output and its gradients are NaN")


def _lengths_invalid(q_lengths, kv_lengths, q_len: int, kv_len: int):
  """A traced bool, True when a traced length lies outside [0, its padded length]; None when
  no lengths are traced (concrete ones were checked by :func:`_check_args`)."""
  bad = None
  for lengths, padded in ((q_lengths, q_len), (kv_lengths, kv_len)):
    if isinstance(lengths, jax.core.Tracer):
      outside = jnp.any((lengths < 0) | (lengths > padded))
      bad = outside if bad is None else bad | outside
  return bad


def _attention(q, k, v, q_lengths, kv_lengths, implementation):
  """:func:`softmax_attention` on validated JAX arrays: cuDNN's or XLA's."""
  if softmax_attention_backend(implementation, q.dtype, q.shape[-1]) == "cudnn":
    # cuDNN's padding mask with an empty sample is not a softmax; give it one key (its output
    # is unspecified either way, see Returns) so that no 0/0 reaches the backward.
    q_len = None if q_lengths is None else jnp.maximum(q_lengths, 1)
    try:
      return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_len,
                                          key_value_seq_lengths=jnp.maximum(kv_lengths, 1),
                                          implementation="cudnn")
    except (NotImplementedError, RuntimeError) as e:  # raised while tracing: no cuDNN, shapes
      log.debug("softmax_attention: using XLA: cuDNN cannot run this call: %s", e)
  dtype = q.dtype
  if jnp.dtype(dtype) == jnp.float16 and jax.default_backend() == "cpu":
    # XLA:CPU has no float16 dot with a float32 result, which the backward of JAX's attention
    # asks for ("precision F16_F16_F32 is not supported"): float32 there, rounded back.
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths,
                                      implementation="xla").astype(dtype)


def _check_args(q, k, v, q_lengths, kv_lengths, implementation):
  """The checks of :func:`softmax_attention`'s Raises, before either backend runs (XLA's
  ignored q_lengths, took integer q and k with fewer heads, and named its own arguments in the
  rest); returns the validated implementation."""
  implementation = _dispatch.check_implementation(implementation)
  _validate.float_array("q", q, ndim=4)
  for name, a in (("k", k), ("v", v)):
    _validate.float_array(name, a, ndim=4)
    # As JAX sees them (:func:`_validate.same_jax_dtype`): the gradient in q of an eager call
    # with NumPy float64 q, k, v traces q as float32, and was refused against the NumPy k.
    if not _validate.same_jax_dtype(a, q):
      raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
  b, _, h, d = q.shape
  if k.shape[0] != b or k.shape[2:] != (h, d):
    raise ValueError(f"k must have shape (B, Lkv, H, D) = ({b}, Lkv, {h}, {d}) for q of shape "
                     f"{tuple(q.shape)}, got {tuple(k.shape)}")
  if v.shape != k.shape:
    raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
  for name, lengths, padded in (("q_lengths", q_lengths, q.shape[1]),
                                ("kv_lengths", kv_lengths, k.shape[1])):
    if lengths is None and name == "q_lengths":
      continue
    if not _validate.is_array(lengths):
      raise TypeError(f"{name} must be an int32 array of shape (B,), got "
                      f"{type(lengths).__name__}")
    if _validate.jax_dtype(lengths) != jnp.int32:
      raise TypeError(f"{name} must be int32, got {lengths.dtype}")
    if tuple(lengths.shape) != (b,):
      raise ValueError(f"{name} must have shape (B,) = ({b},), got {tuple(lengths.shape)}")
    if not isinstance(lengths, jax.core.Tracer):
      host = np.asarray(lengths)
      bad = np.flatnonzero((host < 0) | (host > padded))
      if bad.size:
        raise ValueError(f"{name} must lie in [0, {padded}] (the padded length), got "
                         f"{name}[{bad[0]}] = {int(host[bad[0]])}")
  return implementation


def softmax_attention_backend(implementation, dtype, head_dim: int) -> str:
  """"cudnn" or "xla": what :func:`softmax_attention` tries for this model implementation,
  dtype and head dim on the default device (see there)."""
  candidates = (implementation,) if implementation is None or isinstance(
      implementation, str) else tuple(implementation)
  if not any(c is None or c == "mosaic" for c in candidates):
    return "xla"
  reason = _cudnn_unsupported_reason(dtype, head_dim)
  if reason is not None:
    log.debug("softmax_attention: using XLA: %s", reason)
    return "xla"
  return "cudnn"


def _cudnn_unsupported_reason(dtype, head_dim: int) -> str | None:
  """Why cuDNN's flash attention cannot run here (the checks of
  ``jax._src.cudnn.fused_attention_stablehlo`` that do not need a trace), or None."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return "no device"
  if device.platform != "gpu" or "cuda" not in device.client.platform_version.lower():
    return f"the default device is not an NVIDIA GPU ({device.platform})"
  cc = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split("."))
  if cc < (8, 0):
    return f"compute capability {cc} < 8.0"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN's flash attention takes bf16/f16, got {jnp.dtype(dtype)}"
  max_head_dim = 256 if cc >= (9, 0) else 128
  if head_dim % 8 or head_dim > max_head_dim:
    return f"head dim {head_dim} is not a multiple of 8 up to {max_head_dim}"
  return None
