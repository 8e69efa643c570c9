"""RMSNorm / LayerNorm over the last axis with a hand-written backward (the XLA path).

Autodiff of the forward (:func:`pallas_norm.reference.rms_norm` / ``layer_norm``) makes XLA
emit several passes over the activations in the backward (the centering, the variance and the
normalization each get their own adjoint). The backward here is the closed form
(``docs/DESIGN.md``, op 5), with ``x̂`` the normalized row, ``g = dy · γ`` and ``r`` the rstd::

    RMSNorm:   ds = r · (g − x̂ · mean(g ⊙ x̂))
    LayerNorm: ds = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))
    dγ = Σ_rows dy ⊙ x̂,  dβ = Σ_rows dy

two row sums and one elementwise pass, plus the column sums of dγ/dβ. It saves only the inputs
and two f32 numbers per row (the LayerNorm mean's offset from the row's first element, and r),
and recomputes ``x̂`` with the same shifted centering as the forward, so rows with a large mean
keep their precision in the gradients too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp



def _stat_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _sum_input(x, residual, sdt):
  s = x.astype(sdt)
  return s if residual is None else s + residual.astype(sdt)


def _applied_scale(scale, zero_centered_scale, sdt):
  if scale is None:
    return None
  s = scale.astype(sdt)
  return 1 + s if zero_centered_scale else s


def _centered(s, norm, dmean):
  """The row minus its mean, exact for large means: shifted by the row's first element (exact
  subtraction for nearby values), then by the small remainder ``dmean``."""
  if norm == "rms":
    return s
  return (s - jax.lax.stop_gradient(s[..., :1])) - dmean[..., None]


def _stats(s, norm, eps):
  if norm == "rms":
    return None, jax.lax.rsqrt(jnp.mean(jnp.square(s), axis=-1) + eps)
  dmean = jnp.mean(s - s[..., :1], axis=-1)
  c = _centered(s, norm, dmean)
  return dmean, jax.lax.rsqrt(jnp.mean(jnp.square(c), axis=-1) + eps)


def _forward(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  sdt = _stat_dtype(x.dtype)
  s = _sum_input(x, residual, sdt)
  dmean, rstd = _stats(s, norm, eps)
  y = _centered(s, norm, dmean) * rstd[..., None]
  gamma = _applied_scale(scale, zero_centered_scale, sdt)
  if gamma is not None:
    y = y * gamma
  if bias is not None:
    y = y + bias.astype(sdt)
  y = y.astype(out_dtype or x.dtype)
  out = y if residual is None else (y, s.astype(x.dtype))
  return out, (dmean, rstd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _row_norm(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  return _forward(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype)[0]


def _row_norm_fwd(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  out, (dmean, rstd) = _forward(x, scale, bias, residual, norm, eps, zero_centered_scale,
                                out_dtype)
  return out, (x, scale, bias, residual, dmean, rstd)


def _row_norm_bwd(norm, eps, zero_centered_scale, out_dtype, saved, cotangent):
  del eps, out_dtype
  x, scale, bias, residual, dmean, rstd = saved
  dy, ds_out = (cotangent, None) if residual is None else cotangent
  sdt = _stat_dtype(x.dtype)
  s = _sum_input(x, residual, sdt)
  xhat = _centered(s, norm, dmean) * rstd[..., None]
  dyf = dy.astype(sdt)
  gamma = _applied_scale(scale, zero_centered_scale, sdt)
  g = dyf if gamma is None else dyf * gamma
  proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
  inner = g - xhat * proj
  if norm == "layer":
    inner = inner - jnp.mean(g, axis=-1, keepdims=True)
  ds = inner * rstd[..., None]
  if ds_out is not None:
    ds = ds + ds_out.astype(sdt)
  rows = tuple(range(x.ndim - 1))
  dscale = None if scale is None else jnp.sum(dyf * xhat, axis=rows).astype(scale.dtype)
  dbias = None if bias is None else jnp.sum(dyf, axis=rows).astype(bias.dtype)
  dres = None if residual is None else ds.astype(residual.dtype)
  return ds.astype(x.dtype), dscale, dbias, dres


_row_norm.defvjp(_row_norm_fwd, _row_norm_bwd)


def row_norm(x, scale=None, bias=None, residual=None, *, norm: str, eps: float,
             zero_centered_scale: bool = False, out_dtype=None):
  """``reference.rms_norm`` (``norm="rms"``, ``bias`` must be None) or ``reference.layer_norm``
  (``norm="layer"``) with the closed-form backward of this module; same arguments, outputs
  (``y``, or ``(y, s)`` with ``residual``) and dtypes, no validation (the public ops validate).

  Raises:
    ValueError: ``norm`` is not "rms" or "layer", or a bias with ``norm="rms"``.
  """
  if norm not in ("rms", "layer"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
  if norm == "rms" and bias is not None:
    raise ValueError("bias is a LayerNorm parameter; RMSNorm takes none")
  return _row_norm(x, scale, bias, residual, norm, float(eps), bool(zero_centered_scale),
                   None if out_dtype is None else jnp.dtype(out_dtype))
