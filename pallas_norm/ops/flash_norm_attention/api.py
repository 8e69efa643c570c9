"""The fused Kunlun PFFN block (DESIGN.md, op 4)::

    u   = LayerNorm_{H·D}(q)·ln_scale + ln_bias
    z   = u + gdpa(u, k, v)
    out = RMSNorm_{H·D}(z)·rms_scale + q

Both norms reduce over all heads of a token. Oracle:
:func:`pallas_norm.reference.flash_norm_attention`.
"""

from __future__ import annotations

import jax
from jax import lax

from pallas_norm import _dispatch, _validate, reference
from pallas_norm.ops.gdpa import check_args as check_attention_args
from pallas_norm.ops.gdpa import poison_if_offsets_invalid


def flash_norm_attention(q, k, v, q_offsets, kv_offsets=None, *, ln_scale=None, ln_bias=None,
                         rms_scale=None, activation: str = "fast_gelu", pre_scale: float = 1.0,
                         post_scale: float = 1.0, eps: float = 1e-6,
                         max_seq_len: int | None = None, max_kv_len: int | None = None,
                         out_dtype=None, return_stats: bool = False, implementation=None):
  """PFFN block: LayerNorm → GDPA with inner residual → RMSNorm with outer residual.

  Args:
    q: (T, H, D) packed sequence tokens; k, v, q_offsets, kv_offsets, activation, pre_scale,
      post_scale, max_seq_len, max_kv_len: as :func:`pallas_norm.gdpa`.
    ln_scale, ln_bias: optional (H·D,) affine of the LayerNorm.
    rms_scale: optional (H·D,) gamma of the RMSNorm.
    eps: positive float for both norms (default 1e-6).
    out_dtype: default q.dtype.
    return_stats: also return ``(ln_stats, rms_stats)`` (:class:`pallas_norm.NormStats`, (T,)),
      which carry no gradient (``lax.stop_gradient``).
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`).

  Returns:
    out (T, H, D), zeros on padding rows; or ``(out, (ln_stats, rms_stats))``.

  Raises:
    TypeError, ValueError, NotImplementedError: as :func:`pallas_norm.gdpa`, plus eps and the
    affine shapes.
  """
  check_attention_args(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale,
                       max_seq_len, max_kv_len, out_dtype)
  features = q.shape[1] * q.shape[2]
  _validate.optional_vector("ln_scale", ln_scale, features)
  _validate.optional_vector("ln_bias", ln_bias, features)
  _validate.optional_vector("rms_scale", rms_scale, features)
  eps = _validate.eps(eps, q.dtype)
  _validate.flag("return_stats", return_stats)
  _dispatch.choose("flash_norm_attention", implementation)
  out = reference.flash_norm_attention(
      q, k, v, q_offsets, kv_offsets, ln_scale=ln_scale, ln_bias=ln_bias, rms_scale=rms_scale,
      activation=activation, pre_scale=pre_scale, post_scale=post_scale, eps=eps,
      max_seq_len=max_seq_len, max_kv_len=max_kv_len, out_dtype=out_dtype,
      return_stats=return_stats)
  if return_stats:  # outputs, not a differentiable path, as in every op that returns them
    out = (out[0], jax.tree.map(lax.stop_gradient, out[1]))
  # Traced offsets that break the jagged convention give NaN, never a silent wrong answer.
  return poison_if_offsets_invalid(out, q_offsets, kv_offsets, q.shape[0], k.shape[0],
                                   max_seq_len, max_kv_len)
