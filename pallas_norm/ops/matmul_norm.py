"""Post-norm GEMM with the norm in the epilogue (DESIGN.md, op 2):
``h = x @ w (+ dense_bias) (+ residual)``, ``y = norm(h)·scale (+ bias)``.

The fused kernel reduces each row's statistics across a cluster of CTAs that own different N
slices of the same rows. Oracle: :func:`pallas_norm.reference.matmul_norm`.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_norm import _dispatch, _validate, reference


def check_args(x, w, dense_bias, residual, scale, bias, norm, eps, out_dtype) -> None:
  """Validates the arguments of :func:`matmul_norm` (shared with the Flax layer)."""
  _validate.float_array("x", x)
  _validate.float_array("w", w, ndim=2)
  if w.shape[0] != x.shape[-1]:
    raise ValueError(f"w must have shape (K, N) with K = x.shape[-1] = {x.shape[-1]}, "
                     f"got {tuple(w.shape)}")
  if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
    raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
  n = w.shape[1]
  _validate.optional_vector("dense_bias", dense_bias, n)
  _validate.same_shape("residual", residual, x.shape[:-1] + (n,))
  _validate.optional_vector("scale", scale, n)
  _validate.optional_vector("bias", bias, n)
  _validate.norm_kind(norm)
  _validate.eps(eps)
  _validate.out_dtype(out_dtype)


def matmul_norm(x, w, dense_bias=None, residual=None, scale=None, bias=None, *,
                norm: str = "layer", eps: float = 1e-6, out_dtype=None, return_h: bool = False,
                return_stats: bool = False, implementation=None):
  """Post-norm GEMM: ``h = x @ w (+ dense_bias) (+ residual)``, ``y = norm(h)·scale (+ bias)``.

  Args:
    x: (..., K) bfloat16/float16/float32. w: (K, N), same dtype.
    dense_bias: optional (N,) bias of the dense layer. residual: optional (..., N) added to h.
    scale, bias: optional (N,) gamma and beta of the norm.
    norm: "layer" (default) or "rms". eps: positive float (default 1e-6).
    out_dtype: dtype of y and h (default x.dtype).
    return_h: also return h, the pre-norm residual stream, in the output dtype.
    return_stats: also return :class:`pallas_norm.NormStats` of h (float32).
    implementation: None, "xla", "mosaic" or "interpret".

  Returns:
    y (..., N); with ``return_h``/``return_stats`` the tuple ``(y, h?, stats?)``.

  Raises:
    TypeError, ValueError, NotImplementedError: as :func:`pallas_norm.norm_matmul`.
  """
  check_args(x, w, dense_bias, residual, scale, bias, norm, eps, out_dtype)
  _dispatch.choose("matmul_norm", implementation)
  return reference.matmul_norm(x, w, dense_bias, residual, scale, bias, norm=norm, eps=eps,
                               out_dtype=out_dtype, return_h=return_h,
                               return_stats=return_stats)
