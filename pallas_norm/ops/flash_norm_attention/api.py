"""The fused Kunlun PFFN block (DESIGN.md, op 4)::

    u   = LayerNorm_{H·D}(q)·ln_scale + ln_bias
    z   = u + gdpa(u, k, v)
    out = RMSNorm_{H·D}(z)·rms_scale + q

Both norms reduce over all heads of a token. Oracle:
:func:`pallas_norm.reference.flash_norm_attention`.

The fused kernel is not written yet (issue 21). Where the GDPA kernel supports the call, the
kernel implementations ("mosaic", "interpret", and None on Hopper) run the unfused chain: the two
norms in XLA around the GDPA kernel (:mod:`pallas_norm.ops.gdpa`), whose output is rounded to
q's dtype before the inner residual adds it (the XLA path keeps it in float32).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

import jax.numpy as jnp

from pallas_norm import _dispatch, _validate, jagged, reference
from pallas_norm.ops.gdpa import api as gdpa_api
from pallas_norm.ops.gdpa import check_args as check_attention_args
from pallas_norm.ops.gdpa import mosaic as gdpa_mosaic
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
      can run the call; see :mod:`pallas_norm._dispatch`). The kernel names run the norms in
      XLA around the GDPA kernel (the fused kernel is not written yet); None picks that on
      Hopper where :func:`pallas_norm.gdpa` would pick its kernel.

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
  impl = _dispatch.choose(
      "flash_norm_attention", implementation,
      unsupported_reason=lambda _: gdpa_mosaic.unsupported_reason(q, k, kv_offsets, max_kv_len,
                                                                  None),
      slower_reason=lambda: gdpa_api.kernel_slower_reason(q, k, kv_offsets, max_kv_len, None))
  block = reference.flash_norm_attention if impl == "xla" else functools.partial(
      _gdpa_kernel_chain, gdpa_implementation=impl)
  q, k, v, ln_scale, ln_bias, rms_scale = gdpa_api.poison_inputs_if_offsets_invalid(
      (q, k, v, ln_scale, ln_bias, rms_scale), q_offsets, kv_offsets, q.shape[0], k.shape[0],
      max_seq_len, max_kv_len)
  out = block(q, k, v, q_offsets, kv_offsets, ln_scale=ln_scale, ln_bias=ln_bias,
              rms_scale=rms_scale, activation=activation, pre_scale=pre_scale,
              post_scale=post_scale, eps=eps, max_seq_len=max_seq_len, max_kv_len=max_kv_len,
              out_dtype=out_dtype, return_stats=return_stats)
  if return_stats:  # outputs, not a differentiable path, as in every op that returns them
    out = (out[0], jax.tree.map(lax.stop_gradient, out[1]))
  # Traced offsets that break the jagged convention give NaN, never a silent wrong answer.
  return poison_if_offsets_invalid(out, q_offsets, kv_offsets, q.shape[0], k.shape[0],
                                   max_seq_len, max_kv_len)


def _gdpa_kernel_chain(q, k, v, q_offsets, kv_offsets, *, ln_scale, ln_bias, rms_scale,
                       activation, pre_scale, post_scale, eps, max_seq_len, max_kv_len,
                       out_dtype, return_stats, gdpa_implementation):
  """:func:`pallas_norm.reference.flash_norm_attention` with its attention through the GDPA
  kernel (``gdpa_implementation``: "mosaic" or "interpret"); same arguments and outputs."""
  t, h, d = q.shape
  qf = q.reshape(t, h * d).astype(jnp.float32)
  qf = jnp.where(jagged.valid_mask(q_offsets, t)[:, None], qf, 0)  # padding rows: never data
  ln_stats = reference._row_stats(qf, "layer", eps)
  u = reference._normalize(qf, ln_stats, ln_scale, ln_bias, False)
  attn = gdpa_api.kernel_path(u.astype(q.dtype).reshape(t, h, d), k, v, q_offsets, kv_offsets,
                              activation=activation, pre_scale=pre_scale,
                              post_scale=post_scale, max_seq_len=max_seq_len,
                              max_kv_len=max_kv_len, out_dtype=None,
                              implementation=gdpa_implementation)
  z = u + attn.reshape(t, h * d).astype(jnp.float32)
  rms_stats = reference._row_stats(z, "rms", eps)
  out = reference._normalize(z, rms_stats, rms_scale, None, False) + qf
  out = reference._zero_padding(out.reshape(t, h, d), q_offsets).astype(out_dtype or q.dtype)
  return (out, (ln_stats, rms_stats)) if return_stats else out
