"""Standalone row norms ``rms_norm`` and ``layer_norm`` (DESIGN.md, op 5).

Two implementations each: "xla" (:mod:`pallas_norm.ops.norms.xla`: the reference's forward;
``layer_norm`` with a hand-written one-pass derivative, a ``custom_jvp``, ``rms_norm``
differentiated by autodiff, on every backend) and the Pallas kernels of
:mod:`pallas_norm.ops.norms.triton` ("triton" on an NVIDIA GPU, "interpret" anywhere): the
backward kernel after XLA's forward (recomputing the row statistics) or after the forward kernel
of :mod:`pallas_norm.ops.norms.triton_fwd` (reading them). ``implementation=None`` takes the
kernels for each where they were measured faster (one table,
:data:`pallas_norm.ops.norms.triton.KERNEL_DOMAINS`). They are the
building blocks of the Flax layers and the oracle shape of the fused ops.
"""

from __future__ import annotations

import functools

from pallas_norm import _dispatch, _op, _validate
from pallas_norm.ops.norms import triton, xla


def _check(x, scale, bias, residual, eps, out_dtype, implementation, op):
  _validate.float_array("x", x)
  n = x.shape[-1]
  _validate.optional_vector("scale", scale, n)
  _validate.optional_vector("bias", bias, n)
  _validate.residual(residual, x, x.shape)
  _validate.eps(eps, x.dtype)
  _validate.out_dtype(out_dtype)
  norm = "rms" if op == "rms_norm" else "layer"
  has_residual = residual is not None
  forward, training = _dispatch.choose_by_use(
      op, implementation,
      lambda _: triton.unsupported_reason(norm, x.shape, x.dtype, has_residual),
      lambda: triton.slower_reason(norm, x.shape, x.dtype, has_residual),
      lambda: triton.slower_forward_reason(norm, x.shape, x.dtype, has_residual),
      kernel="triton")
  # An implementation asked for runs one path for both uses (its forward: forward_path's).
  return (None if implementation is not None else forward), training


def rms_norm(x, scale=None, residual=None, *, eps: float = 1e-6,
             zero_centered_scale: bool = False, out_dtype=None, implementation=None):
  """RMSNorm over the last axis, with an optional fused residual add.

  ``s = x + residual`` (or ``x``), ``y = s · rsqrt(mean(s²) + eps) · scale`` (``1 + scale`` with
  ``zero_centered_scale``). Statistics in float32 (float64 for float64 x), the values of
  :func:`pallas_norm.reference.rms_norm`; "xla" differentiates them by JAX's autodiff (any
  order; a hand-written one-pass rule measured slower for RMSNorm,
  :mod:`pallas_norm.ops.norms.xla`).

  Args:
    x: (..., N) bfloat16/float16/float32/float64.
    scale: optional (N,) gamma.
    residual: optional array of x's shape and dtype (another dtype: TypeError), added before
      the norm.
    eps: positive float added to the mean square (default 1e-6, the Flax default).
    zero_centered_scale: apply ``1 + scale`` instead of ``scale``.
    out_dtype: dtype of y (default x.dtype).
    implementation: None, "xla", "triton", "interpret" or a sequence of them (see
      :mod:`pallas_norm._dispatch`). "triton" runs the gradient as one Pallas kernel (Triton
      lowering, any NVIDIA GPU; :mod:`pallas_norm.ops.norms.triton`) after XLA's forward (the
      kernel recomputes rstd from the rows it holds) or after the forward kernel that hands it
      rstd (:func:`pallas_norm.ops.norms.triton.forward_path`; rows wider than 8192 always,
      walked in chunks, no residual there); "interpret" the same kernels in Pallas interpret
      mode. None picks the kernels on a Hopper GPU where they were measured faster in training
      than XLA (:data:`pallas_norm.ops.norms.triton.KERNEL_DOMAINS`), else XLA.
      The kernel path supports first-order reverse mode only.

  Returns:
    y (..., N), or ``(y, s)`` when ``residual`` is given (``s`` in x's dtype).

  Raises:
    TypeError: non-arrays (e.g. a ``jax.ShapeDtypeStruct``), non-float arrays or dtypes, a
      residual of another dtype than x.
    ValueError: shape mismatch, eps <= 0, unknown implementation.
    NotImplementedError: "mosaic" (no such kernel), or "triton"/"interpret" where the kernel
      cannot run the call (not on an NVIDIA GPU, float64, N > 8192 with a residual, no rows),
      requested alone.
  """
  chosen = _check(x, scale, None, residual, eps, out_dtype, implementation, "rms_norm")
  _validate.flag("zero_centered_scale", zero_centered_scale)
  return _run(chosen, x, scale, None, residual, "rms", eps, zero_centered_scale, out_dtype)


def _run(chosen, x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  """The outputs by ``chosen = (forward use, training)`` (:func:`_check`). Training takes the
  kernels' path with :func:`triton.forward_path`'s forward. Under ``implementation=None`` a
  call that is not differentiated runs the forward kernel where the forward use chose the
  kernels (:data:`triton.FORWARD_DOMAINS`), else XLA's forward; where that is not the training
  path's forward, :func:`_op.by_use` runs each use on its own. Forward use None: the training
  path for both."""
  kw = dict(eps=eps, zero_centered_scale=zero_centered_scale, out_dtype=out_dtype)

  def run(impl, forward, x, scale, bias, residual):
    if impl == "xla":
      return _xla(x, scale, bias, residual, norm, **kw)
    return triton.row_norm(x, scale, bias, residual, norm=norm, interpret=impl == "interpret",
                           forward=forward, **kw)

  forward_use, training = chosen
  args = (x, scale, bias, residual)
  training_forward = "xla" if training == "xla" else triton.forward_path(
      norm, x.shape, residual is not None)
  # The forward kernel adds no residual: with one, both uses run XLA's forward.
  use_forward = "xla" if forward_use == "xla" or residual is not None else "kernel"
  if forward_use is None or use_forward == training_forward:  # one path
    return run(training, None, *args)
  return _op.by_use(functools.partial(run, forward_use, use_forward),
                    functools.partial(run, training, None), *args)


def _xla(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  """The "xla" implementation's outputs (``y`` or ``(y, s)``), statistics dropped."""
  y, s, _ = xla.normalize_rows(x, scale, bias, residual, norm=norm, eps=eps,
                               zero_centered_scale=zero_centered_scale, out_dtype=out_dtype)
  return y if residual is None else (y, s)


def layer_norm(x, scale=None, bias=None, residual=None, *, eps: float = 1e-6,
               zero_centered_scale: bool = False, out_dtype=None, implementation=None):
  """LayerNorm over the last axis, with an optional fused residual add.

  ``s = x + residual`` (or ``x``), ``y = (s − μ) · rsqrt(σ² + eps) · scale + bias`` with the
  shifted two-pass variance in float32, the values of :func:`pallas_norm.reference.layer_norm`.
  The "xla" derivative is hand-written (:mod:`pallas_norm.ops.norms.xla`, DESIGN.md op 5): a
  ``custom_jvp`` whose transpose makes the backward's two row sums in one pass over (s, dy) and
  dscale/dbias as column sums; forward mode (``jax.jvp``) and higher orders work as with
  autodiff. Arguments, returns and errors as :func:`rms_norm`, plus ``bias``: optional (N,)
  beta, and but for ``implementation``:

  Args:
    implementation: None, "xla", "triton", "interpret" or a sequence of them (see
      :mod:`pallas_norm._dispatch`). "triton" keeps XLA's forward and runs the gradient as one
      Pallas kernel (Triton lowering, any NVIDIA GPU; :mod:`pallas_norm.ops.norms.triton`),
      "interpret" the same kernel in Pallas interpret mode; None picks it on a GPU only where
      it was measured faster in training (forward + backward) than "xla". The kernel path
      supports first-order reverse mode only (it is a ``custom_vjp``: ``jax.jvp`` raises JAX's
      TypeError "can't apply forward-mode autodiff (jvp) to a custom_vjp function", a second
      derivative NotImplementedError naming the op); "xla" supports every order.

  Raises:
    NotImplementedError: as :func:`rms_norm`.
  """
  chosen = _check(x, scale, bias, residual, eps, out_dtype, implementation, "layer_norm")
  _validate.flag("zero_centered_scale", zero_centered_scale)
  return _run(chosen, x, scale, bias, residual, "layer", eps, zero_centered_scale, out_dtype)
