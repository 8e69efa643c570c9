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

__all__ = ["softmax_attention", "softmax_attention_backend"]

log = logging.getLogger("pallas_norm")


def softmax_attention(q, k, v, q_lengths, kv_lengths, *, implementation=None):
  """Softmax attention ``softmax(q kᵀ / sqrt(D)) v`` over padded sequences, per sample and head.

  Args:
    q: (B, Lq, H, D) padded queries. k, v: (B, Lkv, H, D) padded keys and values, q's dtype.
    q_lengths: int32 (B,) real query rows per sample, or None (all Lq rows are real).
    kv_lengths: int32 (B,) real keys per sample; keys at or past a sample's length are masked.
    implementation: the model's choice (None, "xla", "mosaic", "interpret" or a sequence of
      them). None or a choice that includes "mosaic" runs cuDNN's flash attention
      (``jax.nn.dot_product_attention(implementation="cudnn")``) where it can (an NVIDIA GPU of
      compute capability >= 8.0 with cuDNN, bf16/f16, D a multiple of 8 up to 256 on Hopper,
      128 before), and XLA's attention elsewhere; "xla" and "interpret" run XLA's (CPU tests).

  Returns:
    (B, Lq, H, D). Rows at or past ``q_lengths`` and samples with no key (``kv_lengths == 0``)
    hold unspecified finite values (XLA averages the masked values, cuDNN attends to key 0):
    callers drop or zero them, and give those rows a zero cotangent.

  The two backends differ only by rounding: XLA materializes the f32 scores and rounds the
  probabilities to the operands' dtype before the product with v; cuDNN runs a blockwise
  (online) softmax that never stores the scores. float16 on the CPU runs XLA's in float32 (its
  backward needs a float16 dot with a float32 result, which XLA:CPU lacks), rounded back.
  """
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
