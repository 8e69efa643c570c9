"""Lazy pre-norm GEMM ``y = norm(x)·scale (+ bias) @ w`` (DESIGN.md, op 1).

The fused kernel never materializes ``norm(x)``: it folds the affine into the weight
(``W_γ = diag(scale) w``, ``c = 1ᵀ W_γ``, ``b = biasᵀ w``), accumulates the row statistics from
the A tiles the K loop already streams, and applies ``rstd ⊙ (x @ W_γ − mean ⊗ c) + b`` in the
epilogue. Math and backward identities: DESIGN.md; oracle: :func:`pallas_norm.reference.norm_matmul`.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_norm import _dispatch, _validate, reference


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
  _validate.eps(eps)
  _validate.out_dtype(out_dtype)


def norm_matmul(x, w, scale=None, bias=None, *, norm: str = "rms", eps: float = 1e-6,
                out_dtype=None, return_stats: bool = False, implementation=None):
  """Pre-norm GEMM ``y = norm(x)·scale (+ bias) @ w``.

  Args:
    x: (..., K) activations, bfloat16/float16/float32.
    w: (K, N) weight, same dtype as x.
    scale: optional (K,) gamma of the norm. bias: optional (K,) beta (LayerNorm or RMSNorm).
    norm: "rms" (RMSNorm) or "layer" (LayerNorm).
    eps: positive float (default 1e-6).
    out_dtype: dtype of y (default x.dtype).
    return_stats: also return :class:`pallas_norm.NormStats` (float32 mean (None for RMS), rstd;
      shape x.shape[:-1]).
    implementation: None, "xla", "mosaic" or "interpret" (see :mod:`pallas_norm._dispatch`).

  Returns:
    y (..., N), or ``(y, stats)``.

  Raises:
    TypeError: non-float or mismatched dtypes. ValueError: shapes, eps, norm or implementation.
    NotImplementedError: a kernel implementation that is not available for this call.
  """
  check_args(x, w, scale, bias, norm, eps, out_dtype)
  _dispatch.choose("norm_matmul", implementation)
  return reference.norm_matmul(x, w, scale, bias, norm=norm, eps=eps, out_dtype=out_dtype,
                               return_stats=return_stats)
