"""The XLA implementation of GDPA: the padded formulation of :func:`pallas_norm.reference.gdpa`
(differentiated by JAX)."""

from __future__ import annotations

from pallas_norm import reference


def gdpa(q, k, v, q_offsets, kv_offsets, pre_scale, post_scale, *, activation, max_seq_len,
         max_kv_len, out_dtype=None):
  """:func:`pallas_norm.reference.gdpa` (arguments already validated); same shapes."""
  return reference.gdpa(q, k, v, q_offsets, kv_offsets, activation=activation,
                        pre_scale=pre_scale, post_scale=post_scale, max_seq_len=max_seq_len,
                        max_kv_len=max_kv_len, out_dtype=out_dtype)
