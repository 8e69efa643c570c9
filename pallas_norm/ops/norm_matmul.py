"""Lazy pre-norm GEMM ``y = norm(x)·scale (+ bias) @ w`` (DESIGN.md, op 1).

The fused path never materializes ``norm(x)``. The op folds the affine into the weight,

    W_γ = diag(scale) w,   c = 1ᵀ W_γ  (N,),   b = biasᵀ w  (N,),

and the kernel (:mod:`pallas_norm.ops.norm_matmul_mgpu`) accumulates the row statistics from the
A tiles its K loop already streams, then applies in the epilogue

    RMSNorm:   y = rstd ⊙_rows (x @ W_γ) + b
    LayerNorm: y = rstd ⊙_rows (x @ W_γ − mean ⊗ c) + b.

The backward (``custom_vjp``) uses the lazy identities of DESIGN.md, so nothing reduces over a
full row of K: with ``y' = y − b``, ``s = rowsum(dy ⊙ y') / K`` and ``G = dy @ W_γᵀ``,

    dx   = rstd ⊙ G − rstd ⊙ (dy·c)/K − rstd² ⊙ (x − mean) ⊙ s     (RMS: drop the c and mean terms)
    dW_γ = xᵀ (rstd ⊙ dy) − 1_K ⊗ Σ_i rstd_i mean_i dy_i
    dscale_k = Σ_n dW_γ[k, n] w[k, n], dw = diag(scale) dW_γ + bias ⊗ Σ_i dy_i, dbias = w Σ_i dy_i.

For the kernel implementations ("mosaic", "interpret") dx is one Mosaic GEMM with that per-row
epilogue (:mod:`pallas_norm.ops.norm_matmul_bwd_mgpu`); its two row scalars
``y_term = rstd² ⊙ s`` and ``c_term = rstd ⊙ (dy·c)/K`` come from one XLA pass over dy and y,
or, for LayerNorm up to K, N ≤ 512 (:func:`fused_row_terms_pay`, where it was measured faster),
from the dx kernel's own K loop, which then streams y next to dy. dW_γ and the rest stay in
XLA.

The ``"xla"`` implementation is the unfused reference (:func:`pallas_norm.reference.norm_matmul`)
differentiated by JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_norm import _dispatch, _validate, reference
from pallas_norm.ops import norm_matmul_bwd_mgpu, norm_matmul_mgpu

_F32 = jnp.float32


def check_args(x, w, scale, bias, norm, eps, out_dtype) -> None:
  """Validates the arguments of :func:`norm_matmul` (shared with the Flax layer)."""
  _validate.float_array("x", x)
  _validate.float_array("w", w, ndim=2)
  if w.shape[0] != x.shape[-1]:
    raise ValueError(f"w must have shape (K, N) with K = x.shape[-1] = {x.shape[-1]}, "
                     f"got {tuple(w.shape)}")
  if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
    raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
  _validate.optional_vector("scale", scale, x.shape[-1])
  _validate.optional_vector("bias", bias, x.shape[-1])
  _validate.norm_kind(norm)
  _validate.eps(eps, x.dtype)
  _validate.out_dtype(out_dtype)


def _kernel_unsupported_reason(x, w, out_dtype=None) -> str | None:
  m = 1
  for d in x.shape[:-1]:
    m *= d
  # x's dtype is checked first (by the kernel's own check), so a float64 x without an
  # out_dtype is reported as x's, not as the output's it defaults to.
  reason = norm_matmul_mgpu.unsupported_reason(m, x.shape[-1], w.shape[1], x.dtype)
  if reason is None and out_dtype is not None and jnp.dtype(out_dtype) not in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    return f"out_dtype {jnp.dtype(out_dtype).name} is not bfloat16, float16 or float32"
  return reason


# Largest K and N, per norm, at which the H200 benchmark (benchmarks/results/nvidia-h200.md)
# measured the op faster than XLA's unfused one forward *and* forward+backward (training is the
# use that matters). Session 3's suite (commit c22661a, 262144×1024²): LayerNorm forward 859 vs
# 1044 µs, fwd+bwd 3145 vs 4529; RMSNorm forward 812 vs 977, fwd+bwd 2749 vs 2875 (it lost by 2%
# before statistics once per row block became the default). At 262144×512×2048 both norms lose
# forward+backward (RMS 3077 vs 2540 µs), so the limit stays at 1024 (issue 4).
KERNEL_DEFAULT_MAX_KN = {"layer": 1024, "rms": 1024}


def _kernel_slower_reason(k: int, n: int, norm: str) -> str | None:
  limit = KERNEL_DEFAULT_MAX_KN[norm]
  if k > limit or n > limit:
    return (f"K = {k}, N = {n}: past {limit} the {norm} Mosaic kernel is measured slower than XLA "
            "in training on the H200 (pass implementation='mosaic' to force it)")
  return None


def fold_affine(w, scale, bias, norm):
  """The folded operands ``(W_γ in w.dtype, c (N,) f32 or None, b (N,) f32 or None)``."""
  wf = w.astype(_F32)
  w_gamma = w if scale is None else (scale.astype(_F32)[:, None] * wf).astype(w.dtype)
  col_sum = jnp.sum(w_gamma.astype(_F32), axis=0) if norm == "layer" else None
  out_bias = None if bias is None else jnp.matmul(bias.astype(_F32), wf,
                                                  precision=lax.Precision.HIGHEST)
  return w_gamma, col_sum, out_bias


def lazy_forward(x, w_gamma, col_sum, out_bias, *, norm, eps, out_dtype):
  """The kernel's epilogue math in plain XLA (the interface of ``norm_matmul_fwd``): the GEMM
  of x with W_γ accumulated in f32, then the row scaling (and mean correction) in f32. Two-pass
  statistics in f32."""
  stats = reference._row_stats(x.astype(_F32), norm, eps)  # pylint: disable=protected-access
  acc = jnp.matmul(x, w_gamma, preferred_element_type=_F32, precision=lax.Precision.HIGHEST)
  if norm == "layer":
    acc = acc - stats.mean[:, None] * col_sum[None, :]
  y = acc * stats.rstd[:, None]
  if out_bias is not None:
    y = y + out_bias
  return y.astype(out_dtype), stats.mean, stats.rstd


def _kernel_forward(implementation):
  return functools.partial(norm_matmul_mgpu.norm_matmul_fwd,
                           interpret=implementation == "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(x, w, scale, bias, norm, eps, out_dtype, implementation):
  return _fused_fwd(x, w, scale, bias, norm, eps, out_dtype, implementation)[0]


def _fused_fwd(x, w, scale, bias, norm, eps, out_dtype, implementation):
  w_gamma, col_sum, out_bias = fold_affine(w, scale, bias, norm)
  y, mean, rstd = _kernel_forward(implementation)(
      x, w_gamma, col_sum, out_bias, norm=norm, eps=eps, out_dtype=out_dtype)
  saved = (x, w, scale, bias, w_gamma, col_sum, out_bias, y, mean, rstd)
  return (y, mean, rstd), saved


FUSED_ROW_TERMS_MAX_KN = 512
"""Largest K and N where the backward computes dx's row terms (y_term, c_term) inside the dx
kernel's K loop (``norm_matmul_dx(..., y=...)``) instead of in an XLA pass over dy and y before
it (LayerNorm only). H200:

* dx with its row terms alone (``benchmarks/gpu_norm_matmul_check.py --sections dx``):
  262144×512² LayerNorm 392 vs 424 µs (XLA pass + dx kernel), RMSNorm 366 vs 413; 65536×2048²
  1.14-1.27× slower (the kernel's extra y stream and sums are not hidden and cost a stage).
* The public API's fwd+bwd at 262144×512² (``--sections train``, same run): LayerNorm 1062 vs
  1097 µs, but RMSNorm 946 vs 894: without col_sum, XLA fuses the row-terms pass with the
  weight gradients' pass over dy, so moving it into the kernel saves less than it costs there.
* K = N = 1024 (session 7; LayerNorm, public fwd+bwd): slower fused, 3253 vs 3194 µs without a
  bias (CUPTI) and 3637 vs 3440 with one (wall clock); at 512² the same run ties without a bias
  (1099 vs 1100) and gains with one (1153 vs 1176)."""


def fused_row_terms_pay(k: int, n: int, norm: str) -> bool:
  """Whether the dx kernel computes its own row terms for x (M, k) @ w (k, n): LayerNorm up to
  :data:`FUSED_ROW_TERMS_MAX_KN`."""
  return norm == "layer" and max(k, n) <= FUSED_ROW_TERMS_MAX_KN


def _row_terms(dy, y, col_sum, out_bias, rstd, k):
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
it runs only then). On the H200 the conditional costs ~2% of fwd+bwd at 262144×512² when it does
not fire (wall clock of back-to-back calls: RMSNorm with a bias 1142 vs 1118 µs, LayerNorm 1093 vs
1075; ``benchmarks/gpu_guard_cost.py``, session 6); when it fires, the f32 GEMM adds ~350-550
µs."""


def bias_cancellation(w_gamma, out_bias):
  """max_j |out_bias_j| / ‖W_γ[:, j]‖₂ (float32 scalar): how many times the norm bias's part
  βᵀW of an output column exceeds the typical size of its normalized part y' = x̂ W_γ (x̂ rows
  have unit mean square, so ‖W_γ[:, j]‖₂ is the size of y'_j for uncorrelated features)."""
  spread = jnp.sqrt(jnp.sum(jnp.square(w_gamma.astype(_F32)), axis=0))
  return jnp.max(jnp.abs(out_bias) / jnp.maximum(spread, jnp.finfo(_F32).tiny))


def _bias_cancels(w_gamma, out_bias):
  """The traced predicate of the guard: :func:`bias_cancellation` past the limit."""
  return bias_cancellation(w_gamma, out_bias) > BIAS_CANCELLATION_LIMIT


def _guarded(fast, exact, w_gamma, out_bias, *operands):
  """``exact(*operands)`` when the bias cancels, else ``fast(*operands)``, under ``lax.cond``;
  just ``fast`` without a bias."""
  if out_bias is None:
    return fast(*operands)
  return lax.cond(_bias_cancels(w_gamma, out_bias), exact, fast, *operands)


def _exact_row_terms(dy, x, w_gamma, col_sum, mean, rstd):
  """:func:`_row_terms` from y' = rstd ⊙ (x @ W_γ − mean ⊗ col_sum) recomputed in f32 (one
  GEMM), for when y − out_bias would cancel (:data:`BIAS_CANCELLATION_LIMIT`)."""
  acc = jnp.matmul(x, w_gamma, preferred_element_type=_F32, precision=lax.Precision.HIGHEST)
  if mean is not None:
    acc = acc - mean[:, None] * col_sum[None, :]
  return _row_terms(dy, rstd[:, None] * acc, col_sum, None, rstd, x.shape[1])


def _guarded_row_terms(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd):
  """:func:`_row_terms` from y, or :func:`_exact_row_terms` when the bias would cancel.

  The terms from y are computed outside the ``lax.cond`` (and passed through it), so XLA can
  still fuse their pass over dy with the weight gradients' (for RMSNorm that made it nearly
  free, benchmarks/NOTES.md, session 4); only the exact GEMM is conditional."""
  fast = _row_terms(dy, y, col_sum, out_bias, rstd, x.shape[1])
  return _guarded(lambda terms: terms,
                  lambda _: _exact_row_terms(dy, x, w_gamma, col_sum, mean, rstd),
                  w_gamma, out_bias, fast)


def _input_grad(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd, interpret):
  """dx with no reduction over a full row of K: one GEMM plus a per-row epilogue, the dx
  kernel."""
  norm = "rms" if mean is None else "layer"

  def dx_kernel(**row_args):
    return norm_matmul_bwd_mgpu.norm_matmul_dx(dy.astype(x.dtype), w_gamma, x, rstd, **row_args,
                                               interpret=interpret)

  def with_row_terms(terms):
    return dx_kernel(y_term=terms[0], mean=mean, c_term=terms[1])

  if not (fused_row_terms_pay(x.shape[1], y.shape[1], norm) and y.dtype == dy.dtype == x.dtype):
    return with_row_terms(_guarded_row_terms(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd))
  # The kernel sums the rows of dy ⊙ (y − out_bias) and dy ⊙ col_sum in its K loop. With y
  # and dy in x's dtype it reads the very values the XLA pass would (no rounding of y).
  return _guarded(lambda: dx_kernel(mean=mean, y=y, out_bias=out_bias, col_sum=col_sum),
                  lambda: with_row_terms(_exact_row_terms(dy, x, w_gamma, col_sum, mean, rstd)),
                  w_gamma, out_bias)


def _weight_grads(dy, x, w, scale, bias, mean, rstd):
  """(dw, dscale, dbias) from dW_γ = xᵀ (rstd ⊙ dy) − 1_K ⊗ Σ_i rstd_i mean_i dy_i (XLA).

  rstd ⊙ dy is rounded to x's dtype for the GEMM, and the rank-1 term is built from those
  same rounded values: for rows with a large mean both terms are large and must cancel, which
  they do only if they see the same numbers (else 15-44% errors in dw for bf16 rows of mean
  100-250)."""
  dy_scaled = (rstd[:, None] * dy.astype(_F32)).astype(x.dtype)
  dw_gamma = jnp.matmul(x.T, dy_scaled, preferred_element_type=_F32,
                        precision=lax.Precision.HIGHEST)
  if mean is not None:
    dw_gamma = dw_gamma - jnp.sum(mean[:, None] * dy_scaled.astype(_F32), axis=0)[None, :]
  wf = w.astype(_F32)
  dw = dw_gamma if scale is None else scale.astype(_F32)[:, None] * dw_gamma
  dscale = None if scale is None else jnp.sum(dw_gamma * wf, axis=1).astype(scale.dtype)
  dbias = None
  if bias is not None:
    dy_colsum = jnp.sum(dy.astype(_F32), axis=0)
    dw = dw + bias.astype(_F32)[:, None] * dy_colsum[None, :]
    dbias = (wf @ dy_colsum).astype(bias.dtype)
  return dw.astype(w.dtype), dscale, dbias


def _fused_bwd(norm, eps, out_dtype, implementation, saved, cotangents):
  del norm, eps, out_dtype
  x, w, scale, bias, w_gamma, col_sum, out_bias, y, mean, rstd = saved
  dy = cotangents[0]  # the stats outputs are not differentiated (see norm_matmul)
  dx = _input_grad(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd,
                   interpret=implementation == "interpret")
  return (dx, *_weight_grads(dy, x, w, scale, bias, mean, rstd))


_fused.defvjp(_fused_fwd, _fused_bwd)


def norm_matmul(x, w, scale=None, bias=None, *, norm: str = "rms", eps: float = 1e-6,
                out_dtype=None, return_stats: bool = False, implementation=None):
  """Pre-norm GEMM ``y = norm(x)·scale (+ bias) @ w``.

  Args:
    x: (..., K) activations, bfloat16/float16/float32 (float64 with jax_enable_x64).
    w: (K, N) weight, same dtype as x.
    scale: optional (K,) gamma of the norm. bias: optional (K,) beta (LayerNorm or RMSNorm).
    norm: "rms" (RMSNorm) or "layer" (LayerNorm).
    eps: positive float (default 1e-6).
    out_dtype: dtype of y (default x.dtype).
    return_stats: also return :class:`pallas_norm.NormStats` (float32 mean (None for RMS), rstd;
      shape x.shape[:-1]). The statistics are outputs for the caller's backward; they carry no
      gradient (``lax.stop_gradient``), with every implementation, so a loss differentiates
      the same on any backend.
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them tried in order
      (see :mod:`pallas_norm._dispatch`).
      The kernel needs bfloat16/float16 with K and N multiples of 64; None falls back to XLA
      otherwise.

  Returns:
    y (..., N), or ``(y, stats)``.

  Raises:
    TypeError: an argument that is not an array (jax.Array, NumPy array or tracer; e.g. a
    ``jax.ShapeDtypeStruct``), non-float or mismatched dtypes. ValueError: shapes, eps, norm or
    implementation.
    NotImplementedError: "mosaic"/"interpret" asked for a call the kernel cannot run.
  """
  check_args(x, w, scale, bias, norm, eps, out_dtype)
  eps = float(eps)  # a validated numpy/jax scalar too: the kernels take a Python float
  _validate.flag("return_stats", return_stats)
  chosen = _dispatch.choose("norm_matmul", implementation,
                            lambda candidate: _kernel_unsupported_reason(x, w, out_dtype),
                            lambda: _kernel_slower_reason(x.shape[-1], w.shape[1], norm))
  if chosen == "xla":
    out = reference.norm_matmul(x, w, scale, bias, norm=norm, eps=eps, out_dtype=out_dtype,
                                return_stats=return_stats)
    # The statistics are outputs, not a differentiable path, in every implementation.
    return (out[0], jax.tree.map(lax.stop_gradient, out[1])) if return_stats else out
  return _fused_call(x, w, scale, bias, norm, eps, out_dtype or x.dtype, return_stats, chosen)


def _fused_call(x, w, scale, bias, norm, eps, out_dtype, return_stats, implementation):
  lead = x.shape[:-1]
  y, mean, rstd = _fused(x.reshape(-1, x.shape[-1]), w, scale, bias, norm, eps,
                         jnp.dtype(out_dtype), implementation)
  y = y.reshape(lead + (w.shape[1],))
  if not return_stats:
    return y
  stats = reference.NormStats(None if mean is None else lax.stop_gradient(mean.reshape(lead)),
                              lax.stop_gradient(rstd.reshape(lead)))
  return y, stats
