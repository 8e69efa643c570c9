"""The XLA path of the row norms: the reference's forward, and for LayerNorm a hand-written
derivative.

:func:`normalize_rows` computes what :func:`pallas_norm.reference.rms_norm` /
:func:`~pallas_norm.reference.layer_norm` compute (the same operations, so the same values).
RMSNorm is differentiated by JAX's autodiff. LayerNorm's derivative is a ``jax.custom_jvp``
whose tangent map is written in the one-pass form (DESIGN.md, op 5). With ``s = x (+ residual)``
in the statistics dtype, ``r`` the rstd, ``x̂ = (s − μ) · r`` and ``γ`` the applied scale
(``1 + scale`` when zero-centered)::

    ẋ̂ = r · (ṡ − mean(ṡ) − x̂ · mean(x̂ ⊙ ṡ))
    ẏ = ẋ̂ ⊙ γ + x̂ ⊙ γ̇ + β̇,   μ̇ = mean(ṡ),   ṙ = −r² · mean(x̂ ⊙ ṡ)

Reverse mode transposes this linear map, which gives the backward a hand-written rule would
(with ``g = dy ⊙ γ``)::

    ds = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))  (+ the cotangent of the returned s)
    dscale = Σ_rows dy ⊙ x̂,   dbias = Σ_rows dy

two row sums over (x, dy) that feed ds in the same pass (applied as a chain, see
:func:`_xhat_tangent`), and two column sums. XLA's autodiff of the reference makes seven
reductions instead, through the two-pass variance and the shift of
:func:`pallas_norm.reference._center`; with this rule XLA trains LayerNorm 1.37-1.64× faster
(measured: benchmarks/NOTES.md, "The XLA path's one-pass rule") up to rows of ~16384; wider
rows train faster under plain autodiff (which keeps 6× the memory for the backward), but
autodiff under ``jax.checkpoint`` (x's memory only) was 7-57% slower than the rule from 16384
to 32768 (EXPERIMENTS.md), so the rule serves every width. RMSNorm's
autodiff already makes one row sum; the same rule for it was slower than autodiff and is not used
(benchmarks/EXPERIMENTS.md).

Why a ``custom_jvp`` and not a ``custom_vjp``: the same backward, and forward mode (``jax.jvp``,
``jax.hessian``, ``jax.jacfwd``) keeps working, as it did with plain autodiff; derivatives of
any order are the derivatives of this jnp code. The tangent map rebuilds ``x̂`` from ``x`` (and
the residual) and the float32 row statistics inside ``jax.checkpoint``, so what reverse mode
keeps for the backward is x (, residual), the scale and the per-row statistics (the mean as the
pair shift + dmean, as the reference computes it), never a float32 ``x̂`` of x's size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pallas_norm import reference


class RowStats(NamedTuple):
  """Per-row statistics in the statistics dtype, shape x.shape[:-1]. LayerNorm's mean is kept
  as ``shift`` (the row's first element) plus ``dmean`` (the mean of ``s − shift``), as
  :func:`pallas_norm.reference._center` computes it: rows with a large mean keep the precision
  of their centered values. RMSNorm has ``shift = dmean = None``."""

  shift: jax.Array | None
  dmean: jax.Array | None
  rstd: jax.Array


def stat_dtype(dtype):
  """float64 for float64 inputs, else float32 (the reference's statistics dtype)."""
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def residual_sum(x, residual):
  """``s = x (+ residual)`` in the statistics dtype."""
  s = x.astype(stat_dtype(x.dtype))
  return s if residual is None else s + residual.astype(s.dtype)


def row_stats(s, norm: str, eps: float) -> RowStats:
  """The statistics of ``s`` (already in the statistics dtype) with the reference's
  operations: the shifted two-pass variance for LayerNorm, the mean square for RMSNorm."""
  if norm == "rms":
    return RowStats(None, None, reference.rstd_of(jnp.mean(jnp.square(s), axis=-1) + eps))
  # The shift is a constant of the math (any shift gives the same x̂): no derivative through it.
  shift = lax.stop_gradient(s[..., 0])
  d = s - shift[..., None]
  dmean = jnp.mean(d, axis=-1)
  centered = d - dmean[..., None]
  return RowStats(shift, dmean,
                  reference.rstd_of(jnp.mean(jnp.square(centered), axis=-1) + eps))


def shifted_variance(mean_sq, dmean):
  """The one-pass variance the kernels take, E[d²] − E[d]² of rows shifted by one of their
  values or a mean of a few (d = x − shift), at least 0; +inf where E[d²] overflows float32
  (rstd = 0, x̂ = 0, as the two-pass variance and the reference give there), where E[d]² can
  overflow too and inf − inf would make the row NaN."""
  return jnp.where(mean_sq < jnp.inf, jnp.maximum(mean_sq - dmean * dmean, 0.0), mean_sq)


def normalized(s, stats: RowStats):
  """``x̂`` from ``s`` and its statistics (the reference's rounding order)."""
  if stats.shift is not None:
    s = (s - stats.shift[..., None]) - stats.dmean[..., None]
  return s * stats.rstd[..., None]


def applied_scale(scale, zero_centered_scale: bool, dtype):
  """``γ`` as the norm multiplies by it (``1 + scale`` when zero-centered) in ``dtype`` (None:
  scale's own), or None."""
  if scale is None:
    return None
  gamma = scale if dtype is None else scale.astype(dtype)
  return 1 + gamma if zero_centered_scale else gamma


def affine(xhat, scale, bias, zero_centered_scale: bool):
  """``x̂ · γ + β`` in x̂'s dtype (either optional)."""
  gamma = applied_scale(scale, zero_centered_scale, xhat.dtype)
  y = xhat if gamma is None else xhat * gamma
  return y if bias is None else y + bias.astype(xhat.dtype)


def _norm_stats(stats: RowStats) -> reference.NormStats:
  mean = None if stats.shift is None else stats.shift + stats.dmean
  return reference.NormStats(mean, stats.rstd)


def _primal(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  """(outputs, RowStats): outputs ``(y, s in x's dtype or None, NormStats)``."""
  s = residual_sum(x, residual)
  stats = row_stats(s, norm, eps)
  y = affine(normalized(s, stats), scale, bias, zero_centered_scale).astype(out_dtype)
  s_out = None if residual is None else s.astype(x.dtype)
  return (y, s_out, _norm_stats(stats)), stats


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _layer_norm_rows(x, scale, bias, residual, eps, zero_centered_scale, out_dtype):
  return _primal(x, scale, bias, residual, "layer", eps, zero_centered_scale, out_dtype)[0]


def _dot(t):
  """A tangent, or None for a symbolic zero (an input that is not differentiated)."""
  return None if t is None or isinstance(t, SymbolicZero) else t


def _xhat_tangent(s_dot, xhat, rstd):
  """``(ẋ̂, μ̇, ṙ)`` for the tangent ``ṡ``, as a chain of row sums.

  The map ``r · (I − 11ᵀ/N − x̂x̂ᵀ/N)`` is applied as ``r · P_x̂ (P_1 ṡ)``: center ``ṡ`` first
  (``u = ṡ − mean(ṡ)``), then remove its ``x̂`` part (``u − x̂ · mean(x̂ ⊙ u)``); the same map,
  since ``x̂ ⊥ 1``. Its transpose, the backward, is then the chain ``v = g − x̂ · mean(x̂ ⊙ g)``,
  ``ds = r · (v − mean(v))``: each row sum is consumed by the next elementwise step, the shape
  of XLA's forward LayerNorm (mean, then the centered variance), and the final centering leaves
  ``ds`` summing to zero over the row to rounding.
  """
  mean_dot = jnp.mean(s_dot, axis=-1, keepdims=True)
  centered_dot = s_dot - mean_dot
  proj = jnp.mean(xhat * centered_dot, axis=-1, keepdims=True)
  xhat_dot = rstd[..., None] * (centered_dot - xhat * proj)
  return xhat_dot, mean_dot[..., 0], -jnp.square(rstd) * proj[..., 0]


def _tangents(x, residual, scale, stats, x_dot, residual_dot, scale_dot, bias_dot, *,
              zero_centered_scale, out_dtype):
  """The tangents of ``(y, s, NormStats)``: linear in the ``*_dot`` arguments (module
  docstring); ``x̂`` is rebuilt from x and the statistics."""
  sdt = stat_dtype(x.dtype)
  xhat = normalized(residual_sum(x, residual), stats)
  rows = xhat.shape[:-1]
  y_dot = jnp.zeros(xhat.shape, sdt)
  mean_dot, rstd_dot = jnp.zeros(rows, sdt), jnp.zeros(rows, sdt)
  s_dot = None
  if x_dot is not None or residual_dot is not None:
    parts = [t.astype(sdt) for t in (x_dot, residual_dot) if t is not None]
    s_dot = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    y_dot, mean_dot, rstd_dot = _xhat_tangent(s_dot, xhat, stats.rstd)
    gamma = applied_scale(scale, zero_centered_scale, sdt)
    if gamma is not None:
      y_dot = y_dot * gamma
  if scale_dot is not None:
    y_dot = y_dot + xhat * scale_dot.astype(sdt)
  if bias_dot is not None:
    y_dot = y_dot + bias_dot.astype(sdt)
  stats_dot = reference.NormStats(mean_dot, rstd_dot)
  s_out_dot = None
  if residual is not None:
    s_out_dot = jnp.zeros(x.shape, x.dtype) if s_dot is None else s_dot.astype(x.dtype)
  return y_dot.astype(out_dtype), s_out_dot, stats_dot


def _layer_norm_rows_jvp(eps, zero_centered_scale, out_dtype, primals, tangents):
  x, scale, bias, residual = primals
  x_dot, scale_dot, bias_dot, residual_dot = map(_dot, tangents)
  out, stats = _primal(x, scale, bias, residual, "layer", eps, zero_centered_scale, out_dtype)
  # Under jax.checkpoint, reverse mode keeps the arguments (x, residual, scale, the row
  # statistics) and rebuilds x̂ in the backward instead of keeping an x-sized float32 x̂.
  tangent_map = jax.checkpoint(functools.partial(
      _tangents, zero_centered_scale=zero_centered_scale, out_dtype=out_dtype))
  return out, tangent_map(x, residual, scale, stats, x_dot, residual_dot, scale_dot, bias_dot)


_layer_norm_rows.defjvp(_layer_norm_rows_jvp, symbolic_zeros=True)


def normalize_rows(x, scale=None, bias=None, residual=None, *, norm: str, eps: float,
                   zero_centered_scale: bool = False, out_dtype=None):
  """``(y, s, stats)`` of RMSNorm (``norm="rms"``) or LayerNorm (``"layer"``) over the last axis.

  Args:
    x: (..., N) float array; residual: optional array of x's shape (a float dtype), added
      to x in the statistics dtype.
    scale, bias: optional (N,) γ and β (β is added after either norm; ``pallas_norm.rms_norm``
      has none, a pre-norm GEMM's RMSNorm may).
    norm, eps, zero_centered_scale: as :func:`pallas_norm.rms_norm` (eps a positive float).
    out_dtype: dtype of y (default x's).

  Returns:
    ``y`` (..., N) in ``out_dtype``; ``s = x + residual`` in x's dtype, or None without a
    residual; :class:`pallas_norm.NormStats` in float32 (float64 for float64 x), shape
    x.shape[:-1]. The values are those of :mod:`pallas_norm.reference` (the same
    operations). Derivatives of any order, forward and reverse mode: LayerNorm's from the
    one-pass tangent map of the module docstring (the statistics' included), RMSNorm's from
    autodiff.

  No validation: the public ops validate first.
  """
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if norm == "rms":  # autodiff: faster than the one-pass rule on the H200 (module docstring)
    return _primal(x, scale, bias, residual, "rms", float(eps), bool(zero_centered_scale),
                   out_dtype)[0]
  return _layer_norm_rows(x, scale, bias, residual, float(eps), bool(zero_centered_scale),
                          out_dtype)
