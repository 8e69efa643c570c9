"""Post-norm GEMM with the norm in the epilogue (DESIGN.md, op 2):
``h = x @ w (+ dense_bias) (+ residual)``, ``y = norm(h)·scale (+ bias)``.

The fused kernel (:mod:`pallas_norm.ops.matmul_norm.mosaic`) reduces each row's statistics across
a cluster of CTAs that own different N slices of the same rows. Oracle:
:func:`pallas_norm.reference.matmul_norm`.

The backward (``custom_vjp``) saves x̂ = norm(h) before the affine (in the output dtype) and
rstd, never rebuilding x̂ from y by dividing by the scale (which may contain zeros). With
``g = scale ⊙ dy`` and means over the N columns of a row,

    dh     = rstd ⊙ (g − mean_N(g) − x̂ ⊙ mean_N(g ⊙ x̂))    (RMS: no mean_N(g) term)
             (+ the cotangent of the returned h, when h is an output)
    dscale = Σ_i dy ⊙ x̂,  dbias = Σ_i dy,  d(dense_bias) = Σ_i dh,  d(residual) = dh,
    dx     = dh @ wᵀ,  dw = xᵀ dh,

the column sums by a deterministic two-stage reduction (:func:`.xla.column_sum`). In the kernel
implementations, dh and the column sums run as one Pallas kernel with the Triton lowering
(:func:`pallas_norm.ops.norms.triton.norm_backward`, ``layer_norm``'s backward kernel given x̂
and rstd; its per-program partial sums are added in a fixed order) where it takes the shape,
else in XLA. At K = N = 128 without a returned h, and the output (and a residual) in x's dtype,
the whole backward is one kernel instead (:func:`.mosaic_bwd.backward`: h recomputed from x, the
dense bias and the residual, so the forward saves no x̂). The ``"xla"``
implementation is the unfused reference's math (:func:`.xla.matmul_norm`): the GEMM
differentiated by JAX, the norm by the one-pass rule of :mod:`pallas_norm.ops.norms.xla`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pallas_norm import _dispatch, _op, _validate, reference
from pallas_norm.ops.matmul_norm import mosaic, mosaic_bwd, routing, xla
from pallas_norm.ops.norms import api as norms_api
from pallas_norm.ops.norms import triton as norms_triton

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def matmul_norm(x, w, *, dense_bias=None, residual=None, scale=None, norm_bias=None,
                norm: str = "layer", eps: float = 1e-6, out_dtype=None, return_h: bool = False,
                return_stats: bool = False, implementation=None):
  """Post-norm GEMM: ``h = x @ w (+ dense_bias) (+ residual)``, ``y = norm(h)·scale (+ norm_bias)``.

  The values of :func:`pallas_norm.reference.matmul_norm`; the fused kernel (the row statistics
  reduced across a cluster of CTAs) and its backward are DESIGN.md op 2, as this module's
  docstring writes them.

  Args:
    x: (..., K) bfloat16/float16/float32 (float64 with jax_enable_x64). w: (K, N), same dtype.
    dense_bias: optional (N,) bias of the dense layer, added to h (keyword-only, as every
      argument after w), bfloat16/float16/float32/float64. residual: optional (..., N) added
      to h, in x's dtype (another dtype: TypeError).
    scale, norm_bias: optional (N,) γ and β of the norm, bfloat16/float16/float32/float64
      (applied in float32, float64 for float64 inputs).
    norm: "layer" (default) or "rms". eps: positive float (default 1e-6), static (a Python or
      NumPy scalar, not a traced value), at least the statistics dtype's max^(-2/3) (~2.1e-26
      for float32).
    out_dtype: dtype of y and h (default x.dtype).
    return_h: also return h, the pre-norm residual stream, in the output dtype.
    return_stats: also return :class:`pallas_norm.NormStats` of h, shape ``x.shape[:-1]``
      (float32; float64 for float64 inputs). The statistics carry no gradient
      (``lax.stop_gradient``), with every implementation.
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them tried in order
      (see :mod:`pallas_norm._dispatch`).
      The kernel needs bfloat16/float16 x, w and outputs, K and N multiples of 64,
      N = c · n_tiles · tile_n with c ∈ {1, 2, 4, 8}, n_tiles ≤ 4 and tile_n ≤ 256 (so
      N ≤ 8192; past 2048 a multiple of 1024), a residual in the output dtype; "interpret"
      runs one CTA per row block, so N ≤ 4 · tile_n. None falls back to XLA otherwise, with
      the reason logged at debug level; where the forward alone and training were measured
      fastest on different paths, None runs a call that is not differentiated on one and a
      differentiated call on the other (as a kernel path, it then has no forward mode). At
      RMSNorm K = N = 1024 with M ≥ 262144, a differentiated bfloat16 call with y in x's
      dtype and without dense_bias, residual, norm_bias, return_h or return_stats runs composed:
      cuBLAS's GEMM, then :func:`pallas_norm.rms_norm` on h with its own kernels (measured
      faster there than the fused kernel in training;
      :func:`.routing.composed_training_reason`); its y may differ from the plain call's in
      the last bit. The kernel paths are first-order reverse mode only.

  Returns:
    y (..., N) in ``out_dtype`` (default x.dtype); with ``return_h``/``return_stats`` the tuple
    ``(y, h?, stats?)``, h (..., N) in ``out_dtype`` too.

  Raises:
    TypeError: an argument that is not an array (jax.Array, NumPy array or tracer; e.g. a
      ``jax.ShapeDtypeStruct``), non-float or mismatched dtypes (a residual not in x's dtype
      included), or an argument after w passed by position; an eps that is not a real
      number; a return_h or return_stats that is not a bool; an out_dtype that is not a
      floating dtype, or float64 without jax_enable_x64.
    ValueError: shapes (w not (K, N) with x's K, an empty K or N, dense_bias, scale or
      norm_bias not (N,), a residual not (..., N)), eps (not positive and finite, or below
      the floor above), norm (not "layer"/"rms") or implementation (an unknown name).
    RuntimeError: ``implementation="interpret"`` alone, for a call the kernel supports, on a CPU
      backend with fewer than 8 client threads (``PJRT_NPROC``; GPU interpret mode would
      deadlock, :func:`pallas_norm._dispatch.interpret_threads_reason`); in a sequence that
      name is skipped with a :class:`pallas_norm.KernelSkippedWarning` instead.
    NotImplementedError: "mosaic"/"interpret" asked for a call the kernel cannot run; a
      second derivative (``jax.hessian``, a gradient of a gradient) of a kernel path (on the
      composed route the message names rms_norm).
      Forward mode (``jax.jvp``, ``jax.jacfwd``) of a kernel path raises JAX's own TypeError
      "can't apply forward-mode autodiff (jvp) to a custom_vjp function" (under ``jax.jit``
      when it lowers): pass ``implementation="xla"`` for those.
  """
  check_args(x, w, dense_bias, residual, scale, norm_bias, norm, eps, out_dtype)
  x, w, dense_bias, residual, scale, norm_bias = _validate.as_arrays(
      x, w, dense_bias, residual, scale, norm_bias)
  eps = float(eps)  # a validated numpy/jax scalar too: the kernels take a Python float
  _validate.flag("return_h", return_h)
  _validate.flag("return_stats", return_stats)
  m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
  forward, training = _dispatch.choose_by_use(
      "matmul_norm", implementation,
      lambda candidate: kernel_unsupported_reason(x, w, residual, out_dtype,
                                                  interpret=candidate == "interpret"),
      lambda: routing.kernel_slower_reason(m, k, n, norm),
      lambda: routing.kernel_slower_forward_reason(m, k, n, norm))

  def run(chosen, x, w, dense_bias, residual, scale, norm_bias):
    if chosen != "xla":
      return _kernel_call(x, w, dense_bias, residual, scale, norm_bias, norm, eps,
                          jnp.dtype(out_dtype or x.dtype), return_h, return_stats, chosen)
    out = xla.matmul_norm(x, w, dense_bias, residual, scale, norm_bias, norm=norm, eps=eps,
                          out_dtype=out_dtype, return_h=return_h, return_stats=return_stats)
    if return_stats:  # outputs, not a differentiable path, in every implementation
      out = (*out[:-1], jax.tree.map(lax.stop_gradient, out[-1]))
    return out

  args = (x, w, dense_bias, residual, scale, norm_bias)
  train = functools.partial(run, training)
  if implementation is None and training != "xla" and _trains_composed(
      m, k, n, norm, dense_bias, residual, norm_bias, out_dtype, x.dtype, return_h,
      return_stats):
    train = functools.partial(_composed_training, eps=eps)
  elif forward == training:
    return run(training, *args)
  return _op.by_use(functools.partial(run, forward), train, *args)


def _trains_composed(m, k, n, norm, dense_bias, residual, norm_bias, out_dtype, x_dtype,
                     return_h, return_stats) -> bool:
  """Whether a training call on the kernel path runs :func:`_composed_training`: at the shapes
  of :func:`.routing.composed_training_reason`, for the plain call measured there (bfloat16,
  where ``rms_norm`` takes its kernels; no dense bias, residual, norm bias, h or statistics;
  the output in x's dtype). Not with h returned: its cotangent would be added to rms_norm's dh
  after that is rounded to bf16, a second rounding the fused kernel's backward does not make
  (dx and dw ~25% further from the f32 reference in a review's repro)."""
  plain = (dense_bias is None and residual is None and norm_bias is None and not return_h
           and not return_stats
           and jnp.dtype(x_dtype) == jnp.bfloat16
           and jnp.dtype(out_dtype or x_dtype) == jnp.dtype(x_dtype))
  return plain and routing.composed_training_reason(m, k, n, norm) is None


def _composed_training(x, w, dense_bias, residual, scale, norm_bias, *, eps):
  """RMSNorm's post-norm as two ops: h = x @ w by cuBLAS (rounded to x's dtype, as the "xla"
  path and torch.compile round it), then :func:`pallas_norm.rms_norm` of h, which picks its own
  kernels. The values are the "xla" implementation's up to the norm kernels' rounding. A second
  derivative raises rms_norm's NotImplementedError."""
  del dense_bias, residual, norm_bias  # None: _trains_composed
  return norms_api.rms_norm(jnp.matmul(x, w), scale, eps=eps)


def check_args(x, w, dense_bias, residual, scale, norm_bias, norm, eps, out_dtype) -> None:
  """Validates the arguments of :func:`matmul_norm`, once per call: the forward kernel does not
  check them again."""
  _validate.matmul_operands(x, w)
  n = w.shape[1]
  _validate.optional_vector("dense_bias", dense_bias, n)
  _validate.residual(residual, x, x.shape[:-1] + (n,))
  _validate.optional_vector("scale", scale, n)
  _validate.optional_vector("norm_bias", norm_bias, n)
  _validate.norm_kind(norm)
  _validate.eps(eps, x.dtype)
  _validate.out_dtype(out_dtype)


def kernel_unsupported_reason(x, w, residual, out_dtype, interpret: bool) -> str | None:
  return mosaic.unsupported_reason(
      math.prod(x.shape[:-1]), x.shape[-1], w.shape[1], x.dtype, out_dtype or x.dtype,
      None if residual is None else residual.dtype, interpret=interpret)


def _kernel_call(x, w, dense_bias, residual, scale, norm_bias, norm, eps, out_dtype, return_h,
                 return_stats, implementation):
  lead, k, n = x.shape[:-1], x.shape[-1], w.shape[1]
  res2d = None if residual is None else residual.reshape(-1, n)
  # The forward kernel's tiling, picked once per call (the custom_vjp's rules take it as is).
  config = mosaic.pick_config(math.prod(lead), k, n)
  y, h, mean, rstd = _fused(x.reshape(-1, k), w, dense_bias, res2d, scale, norm_bias, norm, eps,
                            jnp.dtype(out_dtype), return_h, return_stats, implementation, config)
  y = y.reshape(lead + (n,))
  if not (return_h or return_stats):
    return y
  out = (y,)
  if return_h:
    out += (h.reshape(lead + (n,)),)
  if return_stats:
    out += (reference.NormStats(
        None if mean is None else lax.stop_gradient(mean.reshape(lead)),
        lax.stop_gradient(rstd.reshape(lead))),)
  return out


# ------------------------------------------------------------------------------------------------
# The kernels' custom_vjp: the forward kernel, then the norm-backward kernel (or XLA's passes)
# and XLA's GEMMs.


def _forward(x, w, dense_bias, residual, scale, bias, norm, eps, out_dtype, return_h,
             return_stats, implementation, config, return_xhat):
  """The forward kernel on arguments :func:`matmul_norm` validated (no second check)."""
  forward = functools.partial(
      mosaic.launch, norm=norm, eps=eps, out_dtype=out_dtype, return_h=return_h,
      return_xhat=return_xhat, return_stats=return_stats,
      interpret=implementation == "interpret", config=config)
  return _op.first_order_only("matmul_norm", forward, x, w, dense_bias, residual, scale, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _fused(x, w, dense_bias, residual, scale, bias, norm, eps, out_dtype, return_h,
           return_stats, implementation, config):
  y, h, _, mean, rstd = _forward(x, w, dense_bias, residual, scale, bias, norm, eps, out_dtype,
                                 return_h, return_stats, implementation, config,
                                 return_xhat=False)
  return y, h, mean, rstd


def _fused_fwd(x, w, dense_bias, residual, scale, bias, norm, eps, out_dtype, return_h,
               return_stats, implementation, config):
  # symbolic_zeros=True (see defvjp below) wraps each differentiable input.
  x, w, dense_bias, residual, scale, bias = (
      None if p is None else p.value for p in (x, w, dense_bias, residual, scale, bias))
  if _whole_backward(x, w, out_dtype, return_h, interpret=implementation == "interpret"):
    # The backward kernel recomputes h from x (and the residual): the forward saves only the
    # statistics.
    y, h, _, mean, rstd = _forward(x, w, dense_bias, residual, scale, bias, norm, eps,
                                   out_dtype, return_h, True, implementation, config,
                                   return_xhat=False)
    saved = (x, w, dense_bias, residual, scale, bias, None, (mean, rstd))
    return (y, h, mean, rstd) if return_stats else (y, h, None, None), saved
  y, h, xhat, mean, rstd = _forward(x, w, dense_bias, residual, scale, bias, norm, eps,
                                    out_dtype, return_h, True, implementation, config,
                                    return_xhat=True)
  # A zero-size stand-in keeps the residual's dtype without keeping the residual alive.
  residual_dtype = None if residual is None else jnp.zeros((0,), residual.dtype)
  saved = (x, w, dense_bias, residual_dtype, scale, bias, xhat, rstd)
  if not return_stats:
    mean, rstd = None, None
  return (y, h, mean, rstd), saved


def _whole_backward(x, w, out_dtype, return_h, interpret: bool = False) -> bool:
  """Whether the whole backward runs as one kernel (:func:`.mosaic_bwd.backward`: h recomputed
  from x, dh, dx, dw and the column sums in one pass over x and dy), so the forward saves no
  x̂: K = N = 128 (:func:`.mosaic_bwd.unsupported_reason`), no returned h, the output in x's
  dtype (a residual is in x's dtype already: :func:`check_args`; a dense bias the kernel adds
  to h itself), and on the GPU at least :data:`.routing.WHOLE_BACKWARD_MIN_M` rows (a speed
  rule: interpret mode takes it at any M, so the CPU tests run it)."""
  m = x.shape[0]
  return (not return_h
          and (interpret or m >= routing.WHOLE_BACKWARD_MIN_M)
          and jnp.dtype(out_dtype) == jnp.dtype(x.dtype)
          and mosaic_bwd.unsupported_reason(m, x.shape[1], w.shape[1], x.dtype) is None)


def _norm_backward_kernel_reason(dy_out, dh_out, xhat, x_dtype) -> str | None:
  """Why the backward keeps XLA's passes instead of the one-pass norm-backward kernel
  (:func:`pallas_norm.ops.norms.triton.norm_backward`), or None.

  The kernel (full rows in registers, every tensor read once) was measured faster on the H200
  than XLA's passes and than the Mosaic kernel it replaced, for both norms at N = 512 and
  LayerNorm at 2048 (``benchmarks/NOTES.md``, "Post-norm backward"). It writes dh in the
  cotangent's dtype: with an ``out_dtype`` other than x's, dh would be rounded twice on its way
  to the GEMMs (or overflow float16), so those calls keep XLA."""
  if dy_out.dtype != xhat.dtype or (dh_out is not None and dh_out.dtype != xhat.dtype):
    return f"cotangents in {dy_out.dtype}, x̂ in {xhat.dtype}"
  if jnp.dtype(dy_out.dtype) != jnp.dtype(x_dtype):
    return f"cotangent in {dy_out.dtype}, x in {jnp.dtype(x_dtype)}"
  return norms_triton.saved_stats_unsupported_reason(*dy_out.shape, dy_out.dtype)


def _norm_backward_kernel(norm, dy_out, dh_out, xhat, rstd, scale, sums, interpret):
  """(dh in the cotangent's dtype, {sum name: column sum}) from the one-pass kernel; its
  per-program partial sums are added by XLA in a fixed order (deterministic bits on one GPU
  model)."""
  backward = functools.partial(norms_triton.norm_backward, norm=norm, sums=sums,
                               interpret=interpret)
  return _op.first_order_only("matmul_norm", backward, dy_out, xhat, rstd, scale, dh_out)


def _fused_bwd(norm, eps, out_dtype, return_h, return_stats, implementation, config, saved,
               cotangents):
  del eps, out_dtype, return_stats, config
  x, w, dense_bias, residual_dtype, scale, bias, xhat, rstd = saved
  dy_out, dh_out = cotangents[0], cotangents[1]  # the statistics carry no gradient
  if xhat is None:  # _whole_backward: one kernel from x, dy and the statistics
    if isinstance(dy_out, SymbolicZero):
      dy_out = jnp.zeros(dy_out.shape, dy_out.dtype)
    mean, rstd = rstd
    residual = residual_dtype  # this route saves the residual itself
    dx, dw, dscale, dbias, dres, ddense = mosaic_bwd.backward(
        x, w, dy_out, rstd, mean, scale, residual, dense_bias,
        interpret=implementation == "interpret")
    return (dx, dw.astype(w.dtype), None if dense_bias is None else ddense.astype(dense_bias.dtype),
            dres,
            None if scale is None else dscale.astype(scale.dtype),
            None if bias is None else dbias.astype(bias.dtype))
  if not return_h or isinstance(dh_out, SymbolicZero):
    dh_out = None  # h unused: no M × N array of zeros to read
  if isinstance(dy_out, SymbolicZero):  # only h is used
    dy_out = jnp.zeros(dy_out.shape, dy_out.dtype)
  sums = tuple(name for name, v in (("dscale", scale), ("dbias", bias), ("ddense", dense_bias))
               if v is not None)
  if _norm_backward_kernel_reason(dy_out, dh_out, xhat, x.dtype) is None:
    dh, col = _norm_backward_kernel(norm, dy_out, dh_out, xhat, rstd, scale, sums,
                                    interpret=implementation == "interpret")
  else:
    dh, col = xla.norm_backward(norm, dy_out, dh_out, xhat, rstd, scale, sums)
  dscale = None if scale is None else col["dscale"].astype(scale.dtype)
  dbias = None if bias is None else col["dbias"].astype(bias.dtype)
  ddense = None if dense_bias is None else col["ddense"].astype(dense_bias.dtype)
  dres = None if residual_dtype is None else dh.astype(residual_dtype.dtype)
  dh_in = dh.astype(x.dtype)
  # In x's dtype straight out of the GEMM (f32 accumulation all the same): asking for f32 and
  # converting made XLA emit a Triton GEMM fusion for dx, a third slower than cuBLAS on the
  # H200 (benchmarks/NOTES.md, "Post-norm backward"). A float32 dh keeps HIGHEST: the default
  # could round operands to TF32.
  dx = jnp.matmul(dh_in, w.T, precision=_HI if dh_in.dtype == jnp.float32 else None)
  dw = jnp.matmul(x.T, dh_in, preferred_element_type=_F32, precision=_HI).astype(w.dtype)
  return dx, dw, ddense, dres, dscale, dbias


# Symbolic zeros: a returned h that the loss does not use gives no cotangent array, instead of
# one of zeros that the backward would read.
_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


