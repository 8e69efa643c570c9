"""norm_matmul in XLA: the ``"xla"`` implementation, and the parts of the kernel backward that
XLA runs (the row terms of dx, the bias-cancellation guard, the weight gradients).

The ``"xla"`` implementation of a 16-bit RMSNorm call uses the kernel's lazy form (DESIGN.md,
op 1), ``y = rstd ⊙ (x @ W_γ) + βᵀW``: the product reads x as it is and only its result is
rounded, where the unfused ``norm(x)·γ @ w`` rounds every element of ``norm(x)·γ`` to x's dtype
before the product, an error that the product sums over K. At 1024×1024 bf16 randn (w unscaled)
the unfused form put ~1.4% of the outputs outside atol = rtol = 3e-2 of the float32 math, the
lazy form none (``tests/test_norm_matmul_vjp.py::test_xla_rms_is_as_accurate_as_the_kernel``).
The GEMM writes x's dtype, as the unfused one does, and the row scaling is one elementwise pass
over the output instead of the unfused form's pass over x before the product (the same traffic
at K = N); a bfloat16 output is rounded twice (after the product and after the scaling), each
rounding ≤ 2⁻⁸ relative. For float16 the GEMM writes float32 (y is rounded once, ≤ 2⁻¹¹): the
product of the un-normalized x (rows of RMS 300, K = 1024) passed float16's 65504 and came out
inf where y and the kernel's result are finite; bfloat16 has float32's range. Autodiff keeps
16-bit GEMMs in the backward. LayerNorm stays unfused: its lazy form subtracts ``mean ⊗
colsum(W_γ)``, whose gradient must cancel against the GEMM's for rows with a large mean, which
plain autodiff of it does not arrange (the kernel's custom backward forms dW_γ = x̂ᵀ dy from the
centered x̂, :func:`weight_grads_from_x_hat`; built from uncentered x without matching
roundings, dw was 15-44% off for bf16 rows of mean 100-250). The unfused form's norm takes the
one-pass derivative of :mod:`pallas_norm.ops.norms.xla` (autodiff of the reference's LayerNorm
chains seven row reductions).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_norm import reference
from pallas_norm.ops.norms import xla as norms_xla

_F32 = jnp.float32
_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def norm_matmul(x, w, scale, norm_bias, *, norm, eps, out_dtype):
  """(y (..., N), :class:`pallas_norm.NormStats`) in XLA; lazy for 16-bit RMSNorm (module
  docstring), else :func:`pallas_norm.reference.norm_matmul`."""
  if norm != "rms" or jnp.dtype(x.dtype) not in _16BIT:
    return _unfused(x, w, scale, norm_bias, norm=norm, eps=eps, out_dtype=out_dtype)
  lead, k = x.shape[:-1], x.shape[-1]
  x2 = x.reshape(-1, k)
  w_gamma, _, out_bias = fold_affine(w, scale, norm_bias, norm)
  stats = reference._row_stats(x2.astype(_F32), norm, eps)  # pylint: disable=protected-access
  # float16's product of the un-normalized x may pass 65504 where y does not: written in f32.
  product_dtype = _F32 if jnp.dtype(x.dtype) == jnp.float16 else None
  y = jnp.matmul(x2, w_gamma, preferred_element_type=product_dtype).astype(_F32)
  y = y * stats.rstd[:, None]
  if out_bias is not None:
    y = y + out_bias
  y = y.astype(out_dtype or x.dtype).reshape(lead + (w.shape[1],))
  return y, reference.NormStats(None, stats.rstd.reshape(lead))


def _unfused(x, w, scale, norm_bias, *, norm, eps, out_dtype):
  """:func:`pallas_norm.reference.norm_matmul` (the same values: ``norm(x)·γ + β`` rounded to
  x's dtype, then the product), with the norm's derivative the one-pass rule of
  :mod:`pallas_norm.ops.norms.xla` instead of autodiff's chain of row reductions."""
  xn, _, stats = norms_xla.normalize_rows(x, scale, norm_bias, norm=norm, eps=eps)
  y = reference._dot(xn, w).astype(out_dtype or x.dtype)  # pylint: disable=protected-access
  return y, stats


def _stored(v):
  """``v`` (just rounded to a 16-bit dtype) as the array in memory, for a sum that must see the
  values a kernel or GEMM reads: ``col_sum = 1ᵀW_γ`` cancels against products of the
  rounded W_γ, for rows with a large mean (the backward's dW_γ = x̂ᵀ dy has no such sum: x̂
  is centered).

  Under ``jit`` XLA:GPU does not keep ``v.astype(f32)`` rounded: with its default
  ``xla_allow_excess_precision`` the simplify-fp-conversions pass turns the pair
  ``f32 → bf16 → f32`` into the unrounded f32 value. A col_sum of the unrounded
  ``diag(scale)·w`` is off by W_γ's rounding summed over K, which the lazy form multiplies by
  the row mean: for LayerNorm rows of mean 1e3 y is then 190% off in bf16 and 20% in f16 (the
  jitted kernel tests on the H200; XLA:CPU does the same for float16 when it runs the pass,
  ``tests/test_norm_matmul_kernel.py``). No pass looks through an optimization barrier (XLA:GPU
  removes it only after scheduling)."""
  return lax.optimization_barrier(v)


def fold_affine(w, scale, bias, norm):
  """The folded operands ``(W_γ in w.dtype, c (N,) f32 or None, b (N,) f32 or None)``: c is
  the column sums of the stored W_γ (:func:`_stored`), the rounded values the kernels read."""
  wf = w.astype(_F32)
  w_gamma = w if scale is None else (scale.astype(_F32)[:, None] * wf).astype(w.dtype)
  col_sum = jnp.sum(_stored(w_gamma).astype(_F32), axis=0) if norm == "layer" else None
  out_bias = None if bias is None else jnp.matmul(bias.astype(_F32), wf,
                                                  precision=lax.Precision.HIGHEST)
  return w_gamma, col_sum, out_bias


# ------------------------------------------------------------------------------------------------
# The XLA parts of the kernel backward (pallas_norm.ops.norm_matmul.api).


def row_terms(dy, y, col_sum, out_bias, rstd, k):
  """The per-row scalars of the dx epilogue, from one pass over dy and y (XLA fuses it).

  y_term = rstd² · rowsum(dy ⊙ y') / K with y' = y − out_bias (that is rstd · mean_k(g ⊙ x̂)),
  c_term = rstd · (dy · col_sum) / K (that is rstd · mean_k(g); LayerNorm only).
  """
  dyf = dy.astype(_F32)
  y_gemm = y.astype(_F32) if out_bias is None else y.astype(_F32) - out_bias
  y_term = rstd * rstd * (jnp.sum(dyf * y_gemm, axis=1) / k)
  c_term = None if col_sum is None else rstd * (jnp.sum(dyf * col_sum, axis=1) / k)
  return y_term, c_term


BIAS_CANCELLATION_LIMIT = 16.0
"""Largest :func:`bias_cancellation` for which the backward rebuilds y' = y − out_bias from the
rounded output y. The rounding error of y is about |out_bias| · 2⁻⁹ per element, so relative to
y' it grows with the ratio: measured dx errors (bf16, LayerNorm, K = N = 128) 0.3% at a ratio of
~10, 1.3% at ~100 and 28% at ~1000 (a norm scale of 1e-3 next to a bias of 1), against 0.35% for
XLA. Past the limit the backward recomputes y' exactly (one more XLA GEMM, under ``lax.cond``:
it runs only then). When it does not fire the conditional costs ~2% of fwd+bwd at 262144×512²,
and defeats CUPTI's per-kernel timing (measured: ``benchmarks/NOTES.md``, "Pre-norm backward",
bias guard). Where the dx kernel sums the rows in its epilogue there is no guard (nothing
rebuilds y' from y)."""


def bias_cancellation(w_gamma, out_bias):
  """max_j |out_bias_j| / ‖W_γ[:, j]‖₂ (float32 scalar): how many times the norm bias's part
  βᵀW of an output column exceeds the typical size of its normalized part y' = x̂ W_γ (x̂ rows
  have unit mean square, so ‖W_γ[:, j]‖₂ is the size of y'_j for uncorrelated features)."""
  spread = jnp.sqrt(jnp.sum(jnp.square(w_gamma.astype(_F32)), axis=0))
  return jnp.max(jnp.abs(out_bias) / jnp.maximum(spread, jnp.finfo(_F32).tiny))


def _bias_cancels(w_gamma, out_bias):
  """The traced predicate of the guard: :func:`bias_cancellation` past the limit."""
  return bias_cancellation(w_gamma, out_bias) > BIAS_CANCELLATION_LIMIT


def guarded(fast, exact, w_gamma, out_bias, *operands):
  """``exact(*operands)`` when the bias cancels, else ``fast(*operands)``, under ``lax.cond``;
  just ``fast`` without a bias."""
  if out_bias is None:
    return fast(*operands)
  return lax.cond(_bias_cancels(w_gamma, out_bias), exact, fast, *operands)


def exact_row_terms(dy, x, w_gamma, col_sum, mean, rstd):
  """:func:`row_terms` from y' = rstd ⊙ (x @ W_γ − mean ⊗ col_sum) recomputed in f32 (one
  GEMM), for when y − out_bias would cancel (:data:`BIAS_CANCELLATION_LIMIT`)."""
  acc = jnp.matmul(x, w_gamma, preferred_element_type=_F32, precision=lax.Precision.HIGHEST)
  if mean is not None:
    acc = acc - mean[:, None] * col_sum[None, :]
  return row_terms(dy, rstd[:, None] * acc, col_sum, None, rstd, x.shape[1])


def guarded_row_terms(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd):
  """:func:`row_terms` from y, or :func:`exact_row_terms` when the bias would cancel.

  The terms from y are computed outside the ``lax.cond`` (and passed through it), so XLA can
  still fuse their pass over dy with the weight gradients' (for RMSNorm that made it nearly
  free, benchmarks/NOTES.md, "Pre-norm backward"); only the exact GEMM is conditional."""
  fast = row_terms(dy, y, col_sum, out_bias, rstd, x.shape[1])
  return guarded(lambda terms: terms,
                 lambda _: exact_row_terms(dy, x, w_gamma, col_sum, mean, rstd),
                 w_gamma, out_bias, fast)


def rms_weight_grads(dy, x, w, scale, bias, rstd):
  """RMSNorm's (dw, dscale, dbias) from dW_γ = xᵀ (rstd ⊙ dy) (XLA), rstd ⊙ dy rounded to x's
  dtype for the GEMM: the backward's choice where K ≥ N, where this scaled dy (M × N) is
  no larger than the x̂ (M × K) of :func:`weight_grads_from_x_hat`. (LayerNorm always takes x̂:
  its uncentered form would subtract 1_K ⊗ Σ_i rstd_i mean_i dy_i, two large terms that
  cancel for rows with a large mean.)"""
  dy_scaled = (rstd[:, None] * dy.astype(_F32)).astype(x.dtype)
  return affine_grads(_transposed_product(x, dy_scaled), dy, w, scale, bias)


def weight_grads_from_x_hat(dy, x_hat, w, scale, bias, dy_colsum=None):
  """(dw, dscale, dbias) from dW_γ = x̂ᵀ dy, with x̂ = (x − mean) ⊙ rstd (RMSNorm: x ⊙ rstd) as
  the dx kernel writes it (``norm_matmul_dx(..., return_x_hat=True)``): one GEMM, no pass
  over dy to scale it and no rank-1 correction (x̂ is centered, so nothing cancels).

  x̂ wider than w's K rows (``x_hat_ones``: its last column is ones) makes the product's last
  row Σ_i dy_i, the column sums of dy that a bias's gradients need, in the same GEMM instead
  of a reduction pass over dy (f32 accumulation of exact products, as that pass would);
  ``dy_colsum`` (N,) f32 gives them instead (the dx kernel's ``return_dy_col_sums``: f32 sums
  of dy in x's dtype, which ``norm_matmul`` takes only where dy has that dtype)."""
  k = w.shape[0]
  product = _transposed_product(x_hat, dy)
  if x_hat.shape[1] > k:
    dy_colsum = product[-1]
  return affine_grads(product[:k], dy, w, scale, bias, dy_colsum)


def _transposed_product(a, b):
  """aᵀ b (float32) for a (M, K), b (M, N): the GEMM contracts the rows (no transpose pass)."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32,
                         precision=lax.Precision.HIGHEST)


def affine_grads(dw_gamma, dy, w, scale, bias, dy_colsum=None):
  """(dw, dscale, dbias) from dW_γ (K, N) float32 (W_γ = diag(scale) w, out_bias = biasᵀ w):
  dw = diag(scale) dW_γ + bias ⊗ Σ_i dy_i, dscale_k = Σ_n dW_γ[k, n] w[k, n],
  dbias = w Σ_i dy_i; Σ_i dy_i (N,) f32 is reduced from dy unless ``dy_colsum`` gives it."""
  wf = w.astype(_F32)
  dw = dw_gamma if scale is None else scale.astype(_F32)[:, None] * dw_gamma
  dscale = None if scale is None else jnp.sum(dw_gamma * wf, axis=1).astype(scale.dtype)
  dbias = None
  if bias is not None:
    if dy_colsum is None:
      dy_colsum = jnp.sum(dy.astype(_F32), axis=0)
    dw = dw + bias.astype(_F32)[:, None] * dy_colsum[None, :]
    dbias = (wf @ dy_colsum).astype(bias.dtype)
  return dw.astype(w.dtype), dscale, dbias
