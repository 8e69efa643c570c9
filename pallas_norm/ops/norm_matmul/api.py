"""Lazy pre-norm GEMM ``y = norm(x)·scale (+ bias) @ w`` (DESIGN.md, op 1).

The fused path never materializes ``norm(x)``. The op folds the affine into the weight,

    W_γ = diag(scale) w,   c = 1ᵀ W_γ  (N,),   b = biasᵀ w  (N,),

and the kernel (:mod:`pallas_norm.ops.norm_matmul.mosaic`) accumulates the row statistics from the
A tiles its K loop already streams, then applies in the epilogue

    RMSNorm:   y = rstd ⊙_rows (x @ W_γ) + b
    LayerNorm: y = rstd ⊙_rows (x @ W_γ − mean ⊗ c) + b.

The backward (``custom_vjp``) uses the lazy identities of DESIGN.md, so nothing reduces over a
full row of K: with ``y' = y − b``, ``s = rowsum(dy ⊙ y') / K`` and ``G = dy @ W_γᵀ``,

    dx   = rstd ⊙ G − rstd ⊙ (dy·c)/K − rstd² ⊙ (x − mean) ⊙ s     (RMS: drop the c and mean terms)
    dW_γ = xᵀ (rstd ⊙ dy) − 1_K ⊗ Σ_i rstd_i mean_i dy_i
    dscale_k = Σ_n dW_γ[k, n] w[k, n], dw = diag(scale) dW_γ + bias ⊗ Σ_i dy_i, dbias = w Σ_i dy_i.

For the kernel implementations ("mosaic", "interpret") dx is one Mosaic GEMM with that per-row
epilogue (:mod:`pallas_norm.ops.norm_matmul.mosaic_bwd`). Where the kernel can
(:func:`_takes_row_sums`), the epilogue forms the row sums itself, as the post-norm backward does:
``s = rowsum(G ⊙ x̂) / K`` and ``dy·c = rowsum(G)``, from the accumulator and the x tile, summed
across the CTAs of a cluster that share the rows (nothing reads y). Elsewhere its two row
scalars ``y_term = rstd² ⊙ s`` and ``c_term = rstd ⊙ (dy·c)/K`` come from one XLA pass over dy
and y, or, for LayerNorm up to K, N ≤ 512 (:func:`.routing.fused_row_terms_pay`), from the dx
kernel's K loop, which then streams y next to dy. The weight gradient dW_γ = x̂ᵀ dy, with
x̂ = (x − mean) ⊙ rstd: with the row sums in the epilogue, at K = 128 (N ≤ 128) the dx kernel
sums it itself; for K, N ≤ 512 (:func:`.routing.weight_grad_kernel_pays`; K a multiple of 128,
N of 64, M of 8 and dy in x's dtype, :func:`.mosaic_dw.unsupported_reason`) the weight-gradient
kernel (:mod:`pallas_norm.ops.norm_matmul.mosaic_dw`) reads x and dy and makes x̂ in its
registers, so x̂ never goes to memory; elsewhere the dx kernel's epilogue writes x̂ from the x
tile it holds and dW_γ is one XLA GEMM with nothing to scale or correct (also without the row
sums, for LayerNorm and for RMSNorm with K < N, :func:`.routing.x_hat_pays`); otherwise
(RMSNorm, K ≥ N) dW_γ = xᵀ (rstd ⊙ dy) with the scaling as its own XLA pass. A norm bias's
terms need Σ_i dy_i: with the row sums in the epilogue the dx kernel sums the dy stages it
streams (``return_dy_col_sums``, where :func:`.mosaic_bwd.dy_col_sums_unsupported_reason`
allows), so x̂ stays K wide; elsewhere x̂ ends with a ones column, and the same GEMM gives them
(x̂ past K columns makes cuBLAS leave its best tiles: ``benchmarks/NOTES.md``, pre-norm
backward).

The ``"xla"`` implementation is :func:`.xla.norm_matmul`: the unfused reference's math
(:func:`pallas_norm.reference.norm_matmul`; the lazy form for 16-bit RMSNorm), differentiated by
JAX but for the norm, which takes the one-pass rule of :mod:`pallas_norm.ops.norms.xla`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_norm import _dispatch, _op, _validate, reference
from pallas_norm.ops.norm_matmul import mosaic, mosaic_bwd, mosaic_dw, routing, xla

_F32 = jnp.float32


def norm_matmul(x, w, *, scale=None, norm_bias=None, norm: str = "rms", eps: float = 1e-6,
                out_dtype=None, return_stats: bool = False, implementation=None):
  """Pre-norm GEMM ``y = (norm(x)·scale + norm_bias) @ w``.

  The values of :func:`pallas_norm.reference.norm_matmul`. The kernel's lazy form (the affine
  folded into w, the statistics applied in the epilogue) and its backward's identities are
  DESIGN.md op 1, as this module's docstring writes them.

  Args:
    x: (..., K) activations, bfloat16/float16/float32 (float64 with jax_enable_x64).
    w: (K, N) weight, same dtype as x.
    scale: optional (K,) γ of the norm (keyword-only, as every argument after w),
      bfloat16/float16/float32/float64 (its gradient comes back in it). The kernel folds it
      into w in w's dtype: in float16 a product |scale · w| below 6.1e-5 loses precision and
      one above 65504 is inf (README, Limitations); bfloat16 has neither.
    norm_bias: optional (K,) β of the norm (LayerNorm or RMSNorm), added before the product;
      not a bias of the dense layer; one of scale's dtypes.
    norm: "rms" (RMSNorm) or "layer" (LayerNorm).
    eps: positive float (default 1e-6), static (a Python or NumPy scalar, not a traced value),
      at least the statistics dtype's max^(-2/3) (~2.1e-26 for float32), where rstd's
      derivative eps^-1.5 would overflow.
    out_dtype: dtype of y (default x.dtype).
    return_stats: also return :class:`pallas_norm.NormStats` (mean (None for RMS), rstd;
      float32, float64 for float64 x; shape x.shape[:-1]). The statistics are outputs for the
      caller's backward; they carry no gradient (``lax.stop_gradient``), with every
      implementation, so a loss differentiates the same on any backend.
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them tried in order
      (see :mod:`pallas_norm._dispatch`). The kernel needs bfloat16/float16 with K and N
      multiples of 64; None falls back to XLA otherwise, and where the forward alone and
      training were measured fastest on different paths it runs a call that is not
      differentiated on one and a differentiated call on the other (as a kernel path, it then
      has no forward mode). The kernel paths are first-order reverse mode only (see
      :func:`pallas_norm._op.first_order_only`).

  Returns:
    y (..., N) in ``out_dtype`` (default x.dtype), or ``(y, stats)`` with ``return_stats``.

  Raises:
    TypeError: an argument that is not an array (jax.Array, NumPy array or tracer; e.g. a
      ``jax.ShapeDtypeStruct``), non-float or mismatched dtypes, or an argument after w passed
      by position; an eps that is not a real number; a return_stats that is not a bool; an
      out_dtype that is not a floating dtype, or float64 without jax_enable_x64.
    ValueError: shapes (w not (K, N) with x's K, an empty K or N, scale or norm_bias not (K,)),
      eps (not positive and finite, or below the floor above), norm (not "rms"/"layer") or
      implementation (an unknown name).
    RuntimeError: ``implementation="interpret"`` alone, for a call the kernel supports, on a CPU
      backend with fewer than 8 client threads (``PJRT_NPROC``; GPU interpret mode would
      deadlock, :func:`pallas_norm._dispatch.interpret_threads_reason`); in a sequence that
      name is skipped with a :class:`pallas_norm.KernelSkippedWarning` instead.
    NotImplementedError: "mosaic"/"interpret" asked for a call the kernel cannot run; a
      second derivative (``jax.hessian``, a gradient of a gradient) of a kernel path.
      Forward mode (``jax.jvp``, ``jax.jacfwd``) of a kernel path raises JAX's own TypeError
      "can't apply forward-mode autodiff (jvp) to a custom_vjp function" (under ``jax.jit``
      when it lowers): pass ``implementation="xla"`` for those.
  """
  check_args(x, w, scale, norm_bias, norm, eps, out_dtype)
  x, w, scale, norm_bias = _validate.as_arrays(x, w, scale, norm_bias)
  eps = float(eps)  # a validated numpy/jax scalar too: the kernels take a Python float
  _validate.flag("return_stats", return_stats)
  m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
  forward, training = _dispatch.choose_by_use(
      "norm_matmul", implementation,
      lambda candidate: kernel_unsupported_reason(x, w, out_dtype),
      lambda: routing.kernel_slower_reason(m, k, n, norm),
      lambda: routing.kernel_slower_forward_reason(m, k, n, norm))

  def run(chosen, x, w, scale, norm_bias):
    if chosen == "xla":
      y, stats = xla.norm_matmul(x, w, scale, norm_bias, norm=norm, eps=eps,
                                 out_dtype=out_dtype)
    else:
      y, stats = _kernel_call(x, w, scale, norm_bias, norm, eps,
                              jnp.dtype(out_dtype or x.dtype), chosen)
    # The statistics are outputs, not a differentiable path, in every implementation.
    return (y, jax.tree.map(lax.stop_gradient, stats)) if return_stats else y

  if forward == training:
    return run(training, x, w, scale, norm_bias)
  return _op.by_use(functools.partial(run, forward), functools.partial(run, training),
                    x, w, scale, norm_bias)


def check_args(x, w, scale, norm_bias, norm, eps, out_dtype) -> None:
  """Validates the arguments of :func:`norm_matmul`, once per call: the forward kernel does not
  check them again."""
  _validate.matmul_operands(x, w)
  _validate.optional_vector("scale", scale, x.shape[-1])
  _validate.optional_vector("norm_bias", norm_bias, x.shape[-1])
  _validate.norm_kind(norm)
  _validate.eps(eps, x.dtype)
  _validate.out_dtype(out_dtype)


def kernel_unsupported_reason(x, w, out_dtype=None) -> str | None:
  m = math.prod(x.shape[:-1])
  # x's dtype is checked first (by the kernel's own check), so a float64 x without an
  # out_dtype is reported as x's, not as the output's it defaults to.
  reason = mosaic.unsupported_reason(m, x.shape[-1], w.shape[1], x.dtype)
  if reason is None and out_dtype is not None and jnp.dtype(out_dtype) not in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    return f"out_dtype {jnp.dtype(out_dtype).name} is not bfloat16, float16 or float32"
  return reason


def _kernel_call(x, w, scale, norm_bias, norm, eps, out_dtype, implementation):
  """(y, NormStats) from the kernels' custom_vjp on x flattened to 2-D."""
  lead = x.shape[:-1]
  # The forward kernel's tiling, picked once per call (the custom_vjp's rules take it as is).
  config = mosaic.pick_config(math.prod(lead), x.shape[-1], w.shape[1])
  y, mean, rstd = _fused(x.reshape(-1, x.shape[-1]), w, scale, norm_bias, norm, eps, out_dtype,
                         implementation, config)
  return y.reshape(lead + (w.shape[1],)), reference.NormStats(
      None if mean is None else mean.reshape(lead), rstd.reshape(lead))


# ------------------------------------------------------------------------------------------------
# The kernels' custom_vjp: the forward kernel, then the dx kernel and XLA's weight gradients.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(x, w, scale, norm_bias, norm, eps, out_dtype, implementation, config):
  return _fused_fwd(x, w, scale, norm_bias, norm, eps, out_dtype, implementation, config)[0]


def _fused_fwd(x, w, scale, norm_bias, norm, eps, out_dtype, implementation, config):
  w_gamma, col_sum, out_bias = xla.fold_affine(w, scale, norm_bias, norm)
  # The arguments were validated by norm_matmul (no second check in the kernel module).
  forward = functools.partial(mosaic.launch, norm=norm, eps=eps, out_dtype=out_dtype,
                              interpret=implementation == "interpret", config=config)
  y, mean, rstd = _op.first_order_only("norm_matmul", forward, x, w_gamma, col_sum, out_bias)
  saved = (x, w, scale, norm_bias, w_gamma, col_sum, out_bias, y, mean, rstd)
  return (y, mean, rstd), saved


def _fused_bwd(norm, eps, out_dtype, implementation, config, saved, cotangents):
  del norm, eps, out_dtype, config  # the dx kernel's tiling is its own (its output is (M, K))
  x, w, scale, norm_bias, w_gamma, col_sum, out_bias, y, mean, rstd = saved
  dy = cotangents[0]  # the stats outputs are not differentiated (see norm_matmul)
  norm = "layer" if mean is not None else "rms"
  interpret = implementation == "interpret"
  (m, k), n = x.shape, y.shape[1]
  # Asked once per backward: the dx kernel's route (and so its tiling) follows from it.
  row_sums = _takes_row_sums(m, k, n, x.dtype, interpret)
  dw_config = (_dw_gamma_config(m, k, n, x.dtype, dy.dtype, norm, interpret) if row_sums
               else None)
  dw = dw_config is not None
  dw_kernel = not dw and row_sums and _takes_weight_grad_kernel(m, k, n, x.dtype, dy.dtype)
  # With the row sums in the dx epilogue no pass over dy is left in XLA but the weight
  # gradients' scaling of dy, which x̂ from the same epilogue replaces (or, where the dx kernel
  # sums dW_γ = x̂ᵀ dy itself or the weight-gradient kernel makes x̂ from x, the GEMM of x̂ too).
  x_hat = not (dw or dw_kernel) and (row_sums or routing.x_hat_pays(k, n, norm))
  out = _input_grad(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd, interpret=interpret,
                    row_sums=row_sums, x_hat=x_hat, dw_config=dw_config,
                    bias_sums=(x_hat or dw or dw_kernel) and norm_bias is not None)
  if dw_kernel:
    dx, dy_colsum = out
    dw_gamma = _op.first_order_only(
        "norm_matmul", functools.partial(mosaic_dw.weight_grad, interpret=interpret),
        x, dy, rstd, mean)
    return (dx, *xla.affine_grads(dw_gamma, dy, w, scale, norm_bias, dy_colsum))
  if dw:
    dx, dy_colsum, dw_gamma = out
    return (dx, *xla.affine_grads(dw_gamma, dy, w, scale, norm_bias, dy_colsum))
  if x_hat:
    dx, x_hat, dy_colsum = out
    return (dx, *xla.weight_grads_from_x_hat(dy, x_hat, w, scale, norm_bias, dy_colsum))
  return (out, *xla.rms_weight_grads(dy, x, w, scale, norm_bias, rstd))


_fused.defvjp(_fused_fwd, _fused_bwd)


def _takes_row_sums(m, k, n, dtype, interpret) -> bool:
  """Whether the dx kernel sums dx's rows over K in its epilogue for x (m, k) @ w (k, n), for
  either norm: wherever the kernel can (K split over a cluster, K ≤ 2048), and then the weight
  gradients take its x̂. It removes the y stream of the fused row terms or the XLA row-terms pass
  over dy and y, and the bias guard's ``lax.cond`` with its exact GEMM (nothing rebuilds y' from
  the rounded y); it costs the cluster exchange of the row sums. Measured on the H200 against
  the routes before it in ``benchmarks/NOTES.md`` ("Pre-norm backward")."""
  return mosaic_bwd.row_sums_unsupported_reason(m, n, k, dtype, interpret) is None


def _takes_weight_grad_kernel(m, k, n, dtype, dy_dtype) -> bool:
  """Whether dW_γ = x̂ᵀ dy comes from :func:`.mosaic_dw.weight_grad` (x̂ made from x in its
  registers) instead of x̂ written by the dx kernel and cuBLAS's GEMM of it: with the row sums
  in the dx epilogue (the caller asks), where the kernel takes the shapes (dy in x's dtype,
  :func:`.mosaic_dw.unsupported_reason`) and :func:`.routing.weight_grad_kernel_pays`. Measured
  on the GPU in ``benchmarks/NOTES.md`` ("Pre-norm backward")."""
  return (routing.weight_grad_kernel_pays(k, n)
          and mosaic_dw.unsupported_reason(m, k, n, dtype, dy_dtype) is None)


def _dw_gamma_config(m, k, n, dtype, dy_dtype, norm, interpret):
  """The dx kernel's tiling where it (with the row sums in its epilogue) also sums dW_γ = x̂ᵀ dy
  over its row blocks, so that x̂ never goes to GMEM and no GEMM reads it and dy again; else
  None. Wherever the kernel can (:func:`.mosaic_bwd.dw_gamma_unsupported_reason`: K = 128,
  N ≤ 128; its static limits asked before a tiling is picked) and dy has x's dtype (the kernel
  reads dy in x's dtype: a float32 cotangent keeps the GEMM, which reads it as it came).
  Measured on the GPU against x̂ and cuBLAS's GEMM in ``benchmarks/NOTES.md`` ("Pre-norm
  backward")."""
  if k != mosaic_bwd.DW_K or n > mosaic_bwd.DW_MAX_N or dy_dtype != dtype:
    return None
  config = mosaic_bwd.pick_config(m, n, k, row_sums=True, interpret=interpret)
  reason = mosaic_bwd.dw_gamma_unsupported_reason(m, n, k, dtype, config,
                                                  layer=norm == "layer", interpret=interpret)
  return config if reason is None else None


def _input_grad(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd, interpret, row_sums, x_hat,
                bias_sums=False, dw_config=None):
  """dx with no reduction over a full row of K: one GEMM plus a per-row epilogue, the dx
  kernel, with its row sums in the epilogue where ``row_sums`` (:func:`_takes_row_sums`);
  ``(dx, x̂, None)`` with ``x_hat`` (the same epilogue writes x̂). ``bias_sums`` (with x̂, a
  norm bias's gradients need Σ_i dy_i): ``(dx, x̂, Σ_i dy_i)`` where the kernel sums the dy
  stages it streams (the row sums' route, with dy in x's dtype, where
  :func:`.mosaic_bwd.dy_col_sums_unsupported_reason` allows), else ``(dx, x̂, None)`` with x̂
  ending in a ones column, so that dW_γ's GEMM also sums dy's columns (which costs it cuBLAS's
  best tiles). ``dw_config`` (with ``row_sums``, :func:`_dw_gamma_config`'s tiling):
  ``(dx, Σ_i dy_i or None, dW_γ)``, the kernel summing dW_γ = x̂ᵀ dy (and Σ_i dy_i where
  ``bias_sums`` and it can; else None, and XLA reduces dy's columns). With ``row_sums`` and
  neither x̂ nor ``dw_config`` (the weight-gradient kernel's route): ``(dx, Σ_i dy_i or None)``."""
  norm = "rms" if mean is None else "layer"
  (m, k), n = x.shape, y.shape[1]
  dw = dw_config is not None

  def dx_kernel(row_sums=False, **row_args):
    # The route is chosen here, so the tiling is picked here, once; the kernel module's
    # launch checks nothing again (the op validated the arguments).
    config = dw_config or mosaic_bwd.pick_config(m, n, k, fused_row_terms="y" in row_args,
                                                 x_hat=x_hat, row_sums=row_sums,
                                                 interpret=interpret)
    # The kernel sums dy in x's dtype: a wider cotangent (out_dtype float32) keeps the ones
    # block, whose GEMM reads dy as it came.
    sums = bias_sums and row_sums and dy.dtype == x.dtype and (
        mosaic_bwd.dy_col_sums_unsupported_reason(m, n, k, x.dtype, config,
                                                  layer=norm == "layer", x_hat=x_hat,
                                                  interpret=interpret, dw=dw) is None)
    launch = functools.partial(mosaic_bwd.launch, x_hat=x_hat,
                               x_hat_ones=bias_sums and not sums and not dw,
                               row_sums=row_sums, interpret=interpret, config=config,
                               dy_col_sums=sums, dw_gamma=dw)
    names = tuple(row_args)
    out = _op.first_order_only(
        "norm_matmul", lambda *a: launch(*a[:4], **dict(zip(names, a[4:]))),
        dy.astype(x.dtype), w_gamma, x, rstd, *row_args.values())
    if dw:
      return (out[0], out[1] if sums else None, out[-1])
    if row_sums and not x_hat:  # the weight-gradient kernel's route
      return (out[0], out[1]) if sums else (out, None)
    return out if sums or not x_hat else (*out, None)

  if row_sums:
    # The row sums over K in the epilogue: no y, no row-terms pass, no bias guard.
    return dx_kernel(row_sums=True, mean=mean)

  def with_row_terms(terms):
    return dx_kernel(y_term=terms[0], mean=mean, c_term=terms[1])

  fused = routing.fused_row_terms_pay(k, n, norm)
  if not (fused and y.dtype == dy.dtype == x.dtype):
    return with_row_terms(
        xla.guarded_row_terms(dy, x, w_gamma, col_sum, out_bias, y, mean, rstd))
  # The kernel sums the rows of dy ⊙ (y − out_bias) and dy ⊙ col_sum in its K loop. With y
  # and dy in x's dtype it reads the very values the XLA pass would (no rounding of y).
  return xla.guarded(
      lambda: dx_kernel(mean=mean, y=y, out_bias=out_bias, col_sum=col_sum),
      lambda: with_row_terms(xla.exact_row_terms(dy, x, w_gamma, col_sum, mean, rstd)),
      w_gamma, out_bias)
