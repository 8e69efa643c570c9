"""Standalone row norms ``rms_norm`` and ``layer_norm`` (DESIGN.md, op 5).

Two implementations each: "xla" (:mod:`pallas_norm.ops.norms.xla`: the reference's forward;
``layer_norm`` with a hand-written one-pass derivative, a ``custom_jvp``; ``rms_norm``
differentiated by autodiff; on every backend) and the Pallas kernels of
:mod:`pallas_norm.ops.norms.triton` ("triton" on an NVIDIA GPU, "interpret" anywhere): the
backward kernel after XLA's forward (recomputing the row statistics) or after the forward kernel
of :mod:`pallas_norm.ops.norms.triton_fwd` (reading them). ``implementation=None`` takes the
kernels for each where they were measured faster (the tables of
:mod:`pallas_norm.ops.norms.routing`: ``KERNEL_DOMAINS`` in training, ``FORWARD_DOMAINS`` not
differentiated). They are the building blocks of the Flax layers and the oracle shape of the
fused ops.

Here: the ops, the dispatch questions (:func:`forward_path`, :func:`slower_reason`,
:func:`slower_forward_reason`) and the kernel path's ``custom_vjp`` (:func:`row_norm`, whose
backward runs :func:`pallas_norm.ops.norms.triton.row_backward` through
``_op.first_order_only``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_norm import _dispatch, _op, _validate
from pallas_norm.ops.norms import routing, triton, triton_fwd, xla


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
      lambda: slower_reason(norm, x.shape, x.dtype, has_residual),
      lambda: slower_forward_reason(norm, x.shape, x.dtype, has_residual),
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
  :mod:`pallas_norm.ops.norms.xla`). The math: RMSNorm of Zhang & Sennrich, "Root Mean Square
  Layer Normalization" (2019); DESIGN.md, "Notation" and op 5.

  Args:
    x: (..., N) bfloat16/float16/float32/float64.
    scale: optional (N,) gamma, bfloat16/float16/float32/float64 (applied in the statistics'
      dtype).
    residual: optional array of x's shape and dtype (another dtype: TypeError), added before
      the norm.
    eps: positive float added to the mean square (default 1e-6, the Flax default), static (a
      Python or NumPy scalar, not a traced value), at least the statistics dtype's max^(-2/3)
      (~2.1e-26 for float32).
    zero_centered_scale: apply ``1 + scale`` instead of ``scale``.
    out_dtype: dtype of y (default x.dtype).
    implementation: None, "xla", "triton", "interpret" or a sequence of them (see
      :mod:`pallas_norm._dispatch`). "triton" runs the gradient as one Pallas kernel (Triton
      lowering, any NVIDIA GPU; :mod:`pallas_norm.ops.norms.triton`) after XLA's forward (the
      kernel recomputes rstd from the rows it holds) or after the forward kernel that hands it
      rstd (:func:`forward_path`; rows wider than 8192 always,
      walked in chunks, no residual there); "interpret" the same kernels in Pallas interpret
      mode. None picks the kernels on a Hopper GPU where they were measured faster in training
      than XLA (:data:`pallas_norm.ops.norms.routing.KERNEL_DOMAINS`), and for a call that is
      not differentiated the forward kernel where it was measured faster than XLA's forward
      (:data:`pallas_norm.ops.norms.routing.FORWARD_DOMAINS`); else XLA. The kernel path
      supports first-order reverse mode only (also the forward kernel that None picks for a
      call that is not differentiated: ``jax.jvp`` of it raises JAX's TypeError).

  Returns:
    y (..., N) in ``out_dtype`` (default x.dtype), or ``(y, s)`` when ``residual`` is given
    (``s = x + residual``, the new residual stream, in x's dtype).

  Raises:
    TypeError: non-arrays (e.g. a ``jax.ShapeDtypeStruct``), non-float arrays or dtypes, a
      residual of another dtype than x; an eps that is not a real number (a string, a traced
      value); a zero_centered_scale that is not a bool; an out_dtype that is not a floating
      dtype, or float64 without jax_enable_x64.
    ValueError: shape mismatch (a 0-d x, an empty last axis, a scale not (N,), a residual not
      of x's shape); an eps that is not positive and finite or is below the floor above;
      unknown implementation.
    NotImplementedError: "mosaic" (no such kernel), or "triton"/"interpret" where the kernel
      cannot run the call (not on an NVIDIA GPU, float64, N > 8192 with a residual, no rows,
      more elements than int32 offsets reach, jax_enable_x64 on), requested alone; a second
      derivative (a gradient of a gradient) of the kernel path.
  """
  x, scale, residual = _validate.as_arrays(x, scale, residual)
  chosen = _check(x, scale, None, residual, eps, out_dtype, implementation, "rms_norm")
  _validate.flag("zero_centered_scale", zero_centered_scale)
  return _run(chosen, x, scale, None, residual, "rms", eps, zero_centered_scale, out_dtype)


def _run(chosen, x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  """The outputs by ``chosen = (forward use, training)`` (:func:`_check`). Training takes the
  kernels' path with :func:`forward_path`'s forward. Under ``implementation=None`` a
  call that is not differentiated runs the forward kernel where the forward use chose the
  kernels (:data:`routing.FORWARD_DOMAINS`), else XLA's forward; where that is not the training
  path's forward, :func:`_op.by_use` runs each use on its own. Forward use None: the training
  path for both."""
  kw = dict(eps=eps, zero_centered_scale=zero_centered_scale, out_dtype=out_dtype)

  def run(impl, forward, x, scale, bias, residual):
    if impl == "xla":
      return _xla(x, scale, bias, residual, norm, **kw)
    return row_norm(x, scale, bias, residual, norm=norm, interpret=impl == "interpret",
                    forward=forward, **kw)

  forward_use, training = chosen
  args = (x, scale, bias, residual)
  training_forward = "xla" if training == "xla" else forward_path(
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
  shifted two-pass variance in float32 (float64 for float64 x), the values of
  :func:`pallas_norm.reference.layer_norm`. The math: LayerNorm of Ba, Kiros & Hinton, "Layer
  Normalization" (2016); DESIGN.md, "Notation" and op 5.
  The "xla" derivative is hand-written (:mod:`pallas_norm.ops.norms.xla`, DESIGN.md op 5): a
  ``custom_jvp`` whose transpose makes the backward's two row sums in one pass over (s, dy) and
  dscale/dbias as column sums; forward mode (``jax.jvp``) and higher orders work as with
  autodiff. Arguments, returns and errors are those of :func:`rms_norm`, plus ``bias``, an
  optional (N,) beta of one of those dtypes; ``implementation`` differs:

  Args:
    implementation: None, "xla", "triton", "interpret" or a sequence of them (see
      :mod:`pallas_norm._dispatch`). "triton" runs the gradient as one Pallas kernel (Triton
      lowering, any NVIDIA GPU; :mod:`pallas_norm.ops.norms.triton`) after XLA's forward or
      after the forward kernel that hands it the statistics, as :func:`rms_norm` says
      (:func:`forward_path`), "interpret" the same kernels in Pallas interpret mode; None picks
      them on a Hopper GPU where they were measured faster in training (forward + backward)
      than "xla", and the forward kernel alone for a call that is not differentiated where
      :data:`pallas_norm.ops.norms.routing.FORWARD_DOMAINS` holds. The kernel path supports
      first-order reverse mode only (it is a ``custom_vjp``: ``jax.jvp`` raises JAX's TypeError
      "can't apply forward-mode autodiff (jvp) to a custom_vjp function", a second derivative
      NotImplementedError naming the op); "xla" supports every order.

  Returns:
    As :func:`rms_norm`: y (..., N) in ``out_dtype`` (default x.dtype), or ``(y, s)`` with a
    residual.

  Raises:
    TypeError, ValueError, NotImplementedError: as :func:`rms_norm`, ``bias`` checked as
      ``scale`` (a non-array or non-float bias: TypeError; a shape other than (N,):
      ValueError).
  """
  x, scale, bias, residual = _validate.as_arrays(x, scale, bias, residual)
  chosen = _check(x, scale, bias, residual, eps, out_dtype, implementation, "layer_norm")
  _validate.flag("zero_centered_scale", zero_centered_scale)
  return _run(chosen, x, scale, bias, residual, "layer", eps, zero_centered_scale, out_dtype)


# ----------------------------------------------------------------------------------------------
# Where implementation=None takes the kernels (the tables: routing.py).


def _covers(domains, n: int, rows: int) -> bool:
  return any(lo <= n <= hi and rows >= r for lo, hi, r in domains)


def forward_path(norm: str, x_shape, has_residual: bool) -> str:
  """The forward the kernel path runs for this call: "kernel" (the forward kernel, whose
  statistics the backward reads) where :data:`routing.KERNEL_DOMAINS` holds the call or nothing
  else serves (rows wider than :data:`triton.MAX_N`); "xla" (XLA's fused forward, the backward
  recomputing the statistics) with a residual (the forward kernel adds none) or elsewhere
  (measured slower than XLA either way)."""
  n, rows = x_shape[-1], math.prod(x_shape[:-1])
  if has_residual:
    return "xla"
  return "kernel" if n > triton.MAX_N or _covers(routing.KERNEL_DOMAINS[norm], n, rows) else "xla"


def _slower(rows_of_norm, what: str, x_shape, x_dtype, has_residual: bool) -> str | None:
  n, rows = x_shape[-1], math.prod(x_shape[:-1])
  if not _dispatch.on_hopper_gpu():
    return "the Pallas row-norm kernels were measured only on a Hopper GPU (H200)"
  if jnp.dtype(x_dtype) != jnp.dtype(jnp.bfloat16) or has_residual:
    return f"the {what} was measured faster only for bfloat16 x without a residual"
  if not _covers(rows_of_norm, n, rows):
    spans = ", ".join(f"{lo} <= N <= {hi} with at least {r} rows" for lo, hi, r in rows_of_norm)
    return (f"the {what} was measured faster only for {spans or 'no shape'}, "
            f"got N = {n}, {rows} rows")
  return None


def slower_reason(norm: str, x_shape, x_dtype, has_residual: bool) -> str | None:
  """Why ``implementation=None`` keeps XLA for this call in training, or None to use the
  kernels (:data:`routing.KERNEL_DOMAINS`, measured on a Hopper GPU, the only one measured)."""
  return _slower(routing.KERNEL_DOMAINS[norm], "kernel path", x_shape, x_dtype, has_residual)


def slower_forward_reason(norm: str, x_shape, x_dtype, has_residual: bool) -> str | None:
  """Why ``implementation=None`` keeps XLA for this call when it is not differentiated, or None
  to run the forward kernel (:data:`routing.FORWARD_DOMAINS`)."""
  return _slower(routing.FORWARD_DOMAINS[norm], "forward kernel", x_shape, x_dtype,
                 has_residual)


# ----------------------------------------------------------------------------------------------
# The kernel path: a custom_vjp over XLA's forward or the forward kernel; its backward runs the
# backward kernel through _op.first_order_only.


def _forward(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  """The reference's outputs (``y`` or ``(y, s)``) by the same operations as the XLA path
  (:mod:`pallas_norm.ops.norms.xla`). Nothing else leaves it: the statistics stay inside
  XLA's one fused pass, and the kernel recomputes them."""
  s = xla.residual_sum(x, residual)
  stats = xla.row_stats(s, norm, eps)
  y = xla.affine(xla.normalized(s, stats), scale, bias, zero_centered_scale)
  y = y.astype(out_dtype or x.dtype)
  return y if residual is None else (y, s.astype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _row_norm(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype, interpret,
              forward):
  return _row_norm_fwd(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype,
                       interpret, forward)[0]


def _row_norm_fwd(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype,
                  interpret, forward):
  if forward == "kernel":  # the forward kernel: y and the statistics the backward reads
    # A second derivative differentiates this rule too: it must name the op, not fail
    # inside Pallas.
    launch = functools.partial(triton_fwd.forward, norm=norm, eps=eps,
                               zero_centered_scale=zero_centered_scale, out_dtype=out_dtype,
                               interpret=interpret)
    y, stats = _op.first_order_only(f"{norm}_norm", launch, x, scale, bias)
    return y, (x, scale, bias, residual, stats)
  out = _forward(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype)
  return out, (x, scale, bias, residual, None)


def _row_norm_bwd(norm, eps, zero_centered_scale, out_dtype, interpret, forward, saved,
                  cotangent):
  del out_dtype, forward
  x, scale, bias, residual, stats = saved
  dy, ds_out = (cotangent, None) if residual is None else cotangent
  launch, inputs = triton.row_backward(x, scale, bias, residual, stats, dy, ds_out, norm=norm,
                                       eps=eps, zero_centered_scale=zero_centered_scale,
                                       interpret=interpret)
  ds, sums = _op.first_order_only(f"{norm}_norm", launch, *inputs)
  dscale = sums.pop(0) if scale is not None else None
  dbias = sums.pop(0) if bias is not None else None
  ds = ds.reshape(x.shape)
  return (ds, None if scale is None else dscale.astype(scale.dtype),
          None if bias is None else dbias.astype(bias.dtype),
          None if residual is None else ds)


_row_norm.defvjp(_row_norm_fwd, _row_norm_bwd)


def row_norm(x, scale=None, bias=None, residual=None, *, norm: str, eps: float,
             zero_centered_scale: bool = False, out_dtype=None, interpret: bool = False,
             forward: str | None = None):
  """:func:`pallas_norm.reference.layer_norm` (``norm="layer"``) or
  :func:`pallas_norm.reference.rms_norm` (``norm="rms"``, no bias) whose gradient runs the
  Pallas backward kernel of :mod:`pallas_norm.ops.norms.triton` (:func:`triton.row_backward`,
  which refuses a second derivative).

  Same arguments, outputs (``y``, or ``(y, s)`` with ``residual``) and dtypes as the reference;
  no validation (the public op validates and checks :func:`triton.unsupported_reason` first).
  ``interpret=True`` runs the kernels in Pallas interpret mode (any backend). ``forward``:
  "kernel" (the forward kernel of :mod:`pallas_norm.ops.norms.triton_fwd`, no residual; the
  backward reads its statistics), "xla" (XLA's forward; the backward recomputes them, rows up
  to :data:`triton.MAX_N`), or None for :func:`forward_path`'s choice.
  """
  forward = forward or forward_path(norm, x.shape, residual is not None)
  if forward not in ("kernel", "xla"):
    raise ValueError(f"forward must be 'kernel', 'xla' or None, got {forward!r}")
  if forward == "kernel" and residual is not None:
    raise ValueError("the forward kernel adds no residual: forward='xla'")
  if forward == "xla" and x.shape[-1] >= triton_fwd.CHUNKED_MIN_N:
    raise ValueError(f"rows of {x.shape[-1]} elements need the forward kernel's statistics "
                     "(the backward walks them in chunks): forward='kernel'")
  return _row_norm(x, scale, bias, residual, norm, float(eps), bool(zero_centered_scale),
                   None if out_dtype is None else jnp.dtype(out_dtype), bool(interpret),
                   forward)
