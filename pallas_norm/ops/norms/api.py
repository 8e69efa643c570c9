"""Standalone row norms ``rms_norm`` and ``layer_norm`` (DESIGN.md, op 5).

XLA already runs these near copy bandwidth, so only the XLA implementation exists; they are the
building blocks of the Flax layers and the oracle shape of the fused ops.
"""

from __future__ import annotations

from pallas_norm import _dispatch, _validate, reference


def _check(x, scale, bias, residual, eps, out_dtype, implementation, op):
  _validate.float_array("x", x)
  n = x.shape[-1]
  _validate.optional_vector("scale", scale, n)
  _validate.optional_vector("bias", bias, n)
  _validate.same_shape("residual", residual, x.shape)
  _validate.eps(eps, x.dtype)
  _validate.out_dtype(out_dtype)
  return _dispatch.choose(op, implementation)


def rms_norm(x, scale=None, residual=None, *, eps: float = 1e-6,
             zero_centered_scale: bool = False, out_dtype=None, implementation=None):
  """RMSNorm over the last axis, with an optional fused residual add.

  ``s = x + residual`` (or ``x``), ``y = s · rsqrt(mean(s²) + eps) · scale`` (``1 + scale`` with
  ``zero_centered_scale``). Statistics in float32.

  Args:
    x: (..., N) bfloat16/float16/float32/float64.
    scale: optional (N,) gamma.
    residual: optional array of x's shape, added before the norm.
    eps: positive float added to the mean square (default 1e-6, the Flax default).
    zero_centered_scale: apply ``1 + scale`` instead of ``scale``.
    out_dtype: dtype of y (default x.dtype).
    implementation: None or "xla" (see :mod:`pallas_norm._dispatch`).

  Returns:
    y (..., N), or ``(y, s)`` when ``residual`` is given (``s`` in x's dtype).

  Raises:
    TypeError: non-arrays (e.g. a ``jax.ShapeDtypeStruct``), non-float arrays or dtypes.
    ValueError: shape mismatch, eps <= 0, unknown implementation. NotImplementedError: a kernel
    implementation was requested.
  """
  _check(x, scale, None, residual, eps, out_dtype, implementation, "rms_norm")
  _validate.flag("zero_centered_scale", zero_centered_scale)
  return reference.rms_norm(x, scale, residual, eps=eps, zero_centered_scale=zero_centered_scale,
                            out_dtype=out_dtype)


def layer_norm(x, scale=None, bias=None, residual=None, *, eps: float = 1e-6,
               zero_centered_scale: bool = False, out_dtype=None, implementation=None):
  """LayerNorm over the last axis, with an optional fused residual add.

  ``s = x + residual`` (or ``x``), ``y = (s − μ) · rsqrt(σ² + eps) · scale + bias`` with the
  two-pass variance in float32. Arguments, returns and errors as :func:`rms_norm`, plus
  ``bias``: optional (N,) beta.
  """
  _check(x, scale, bias, residual, eps, out_dtype, implementation, "layer_norm")
  _validate.flag("zero_centered_scale", zero_centered_scale)
  return reference.layer_norm(x, scale, bias, residual, eps=eps,
                              zero_centered_scale=zero_centered_scale, out_dtype=out_dtype)
