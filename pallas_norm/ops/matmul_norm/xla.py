"""matmul_norm in XLA: the ``"xla"`` implementation (:func:`matmul_norm`), and the parts of the
kernel backward that XLA runs: the norm backward's passes (where the norm-backward kernel does not
take the shape) and the deterministic column sums."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_norm import reference
from pallas_norm.ops.norms import xla as norms_xla

_F32 = jnp.float32

def matmul_norm(x, w, dense_bias, residual, scale, norm_bias, *, norm, eps, out_dtype,
                return_h, return_stats):
  """:func:`pallas_norm.reference.matmul_norm` (the same values and outputs), with the norm's
  derivative the one-pass rule of :mod:`pallas_norm.ops.norms.xla`: autodiff of the
  reference's LayerNorm chains seven row reductions over h. The GEMM, the biases and the
  residual are differentiated by JAX."""
  out_dtype = out_dtype or x.dtype
  h = reference._dot(x, w)  # pylint: disable=protected-access
  for addend in (dense_bias, residual):
    if addend is not None:
      h = h + addend.astype(h.dtype)
  y, _, stats = norms_xla.normalize_rows(h, scale, norm_bias, norm=norm, eps=eps,
                                         out_dtype=out_dtype)
  if not (return_h or return_stats):
    return y
  return (y,) + ((h.astype(out_dtype),) if return_h else ()) + ((stats,) if return_stats else ())


COLUMN_SUM_BLOCK = 1024
"""Rows per first-stage block of :func:`column_sum`."""


def column_sum(v):
  """Deterministic Σ_i v[i, :] of an (M, N) array in float32 (same bits on every run).

  Stage 1 sums fixed blocks of :data:`COLUMN_SUM_BLOCK` rows (and the tail rows), stage 2 adds
  the block sums in a fixed pairwise tree, so the order of additions never depends on the
  device or the launch.
  """
  v = v.astype(_F32)
  m = v.shape[0]
  full = m - m % COLUMN_SUM_BLOCK
  parts = []
  if full:
    blocks = v[:full].reshape(full // COLUMN_SUM_BLOCK, COLUMN_SUM_BLOCK, v.shape[1])
    parts.append(jnp.sum(blocks, axis=1))
  if m % COLUMN_SUM_BLOCK or not m:
    parts.append(jnp.sum(v[full:], axis=0, keepdims=True))
  return _pairwise_sum(jnp.concatenate(parts) if len(parts) > 1 else parts[0])


def _pairwise_sum(sums):
  """Σ over the first axis of ``sums`` in a fixed pairwise tree (same bits on every run)."""
  while sums.shape[0] > 1:
    half = sums.shape[0] // 2
    paired = sums[:half] + sums[half:2 * half]
    sums = jnp.concatenate([paired, sums[2 * half:]]) if sums.shape[0] % 2 else paired
  return sums[0]


def _norm_backward(norm, dy, xhat, rstd, scale):
  """dh of y = x̂·scale + bias, x̂ = norm(h), given x̂ and rstd (f32, (M, N) and (M,))."""
  g = dy if scale is None else dy * scale.astype(_F32)
  dh = g - xhat * jnp.mean(g * xhat, axis=1, keepdims=True)
  if norm == "layer":
    dh = dh - jnp.mean(g, axis=1, keepdims=True)
  return dh * rstd[:, None]


def norm_backward(norm, dy_out, dh_out, xhat, rstd, scale, sums):
  """(dh in float32, {sum name: column sum}) of the norm backward in XLA."""
  dy = dy_out.astype(_F32)
  xhat = xhat.astype(_F32)
  dh = _norm_backward(norm, dy, xhat, rstd, scale)
  if dh_out is not None:
    dh = dh + dh_out.astype(_F32)  # h is also an output (the residual stream)
  columns = {"dscale": lambda: dy * xhat, "dbias": lambda: dy, "ddense": lambda: dh}
  return dh, {name: column_sum(columns[name]()) for name in sums}
