"""Dense layers with a fused norm (DESIGN.md, ops 1 and 2):

* :class:`NormDense`: pre-norm ``y = norm(x)·norm_scale (+ norm_bias) @ kernel (+ bias)`` over
  :func:`pallas_norm.norm_matmul` (the lazy pre-norm GEMM).
* :class:`DenseNorm`: post-norm ``h = x @ kernel + bias (+ residual)``,
  ``y = norm(h)·norm_scale (+ norm_bias)`` over :func:`pallas_norm.matmul_norm` (norm in the
  GEMM epilogue).

Arguments follow ``flax.nnx.Linear`` (in_features, out_features, use_bias, kernel_init, ...) and
``flax.nnx.LayerNorm`` (epsilon, use_scale, scale_init): ``bias`` is the dense layer's bias, as in
``nnx.Linear``, and ``norm_bias`` the norm's β. Both layers default to LayerNorm, as
``flax.nnx.LayerNorm`` is the norm Flax users reach for; pass ``norm="rms"`` for RMSNorm. As every
Flax layer, a call returns one array; :class:`DenseNorm` takes ``layer(x, return_h=True)`` (a
call argument, as for :class:`flax_layers.RMSNorm` and :class:`flax_layers.LayerNorm`), which
also returns the pre-norm residual stream h. :class:`NormDense` has no residual stream to
return (its norm reads x itself) and takes no ``return_h``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import pallas_norm
from flax_layers import _common

default_kernel_init = nnx.initializers.lecun_normal()


def _norm_params(rngs, norm, size, use_scale, use_norm_bias, scale_init, norm_bias_init,
                 param_dtype):
  """(norm_scale, norm_bias) parameters of size ``size``; the bias defaults to LayerNorm only
  (``norm`` is checked by the layer)."""
  if use_norm_bias is None:
    use_norm_bias = norm == "layer"
  scale = _common.param(rngs, scale_init, (size,), param_dtype) if use_scale else None
  bias = _common.param(rngs, norm_bias_init, (size,), param_dtype) if use_norm_bias else None
  return scale, bias


def _where(layer) -> str:
  """The layer as errors name it: the op's K and N are in_features and out_features."""
  return (f"{type(layer).__name__}(in_features={layer.in_features}, "
          f"out_features={layer.out_features})")


_OP_NAMES = {"scale": "norm_scale"}
"""The op's argument names that the dense layers hold under another name, for the op's errors
(the kernel and the dense bias are checked by the layer itself: :func:`_check_dense_params`)."""


def _check_dense_params(layer, kernel, bias) -> None:
  """The layer's ``kernel`` (K, N) and dense ``bias`` (N,) against in_features and
  out_features, checked at call time because a user may replace a parameter's value (a restored
  checkpoint of another layer): a (K, N, 1) kernel or a (N + 1,) bias would otherwise fail
  inside the op under its own argument names, or broadcast in ``y + bias``. ValueError naming
  the layer and the parameter."""
  for name, p, shape in (("kernel", kernel, (layer.in_features, layer.out_features)),
                         ("bias", bias, (layer.out_features,))):
    if p is not None and tuple(p.shape) != shape:
      raise ValueError(f"{type(layer).__name__}: {name} must have shape {shape}, got "
                       f"{tuple(p.shape)}")


class NormDense(nnx.Module):
  """Pre-norm dense layer: ``y = norm(x)·norm_scale (+ norm_bias) @ kernel (+ bias)``.

  The op is :func:`pallas_norm.norm_matmul` (its values:
  :func:`pallas_norm.reference.norm_matmul`; the lazy pre-norm GEMM: DESIGN.md op 1), then
  ``+ bias``.

  Args:
    in_features: K. out_features: N. Positive integers (Python or NumPy ints).
    norm: "layer" (default, as :class:`DenseNorm`) or "rms".
    epsilon: positive float of the norm (default 1e-6); stored as a Python float.
    use_scale: create ``norm_scale`` (K,) (gamma). use_norm_bias: create ``norm_bias`` (K,)
      (beta); default True for "layer", False for "rms".
    use_bias: create the dense ``bias`` (N,), added after the GEMM (the op has no dense bias).
    dtype: compute dtype; x and all parameters are cast to it before the op (default: the
      promoted dtype of x and the parameters). param_dtype: a floating dtype (default
      float32).
    kernel_init (default lecun_normal), bias_init, scale_init, norm_bias_init: initializers.
    rngs: ``nnx.Rngs``.
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`).

  Parameters: ``kernel`` (K, N), ``bias`` (N,), ``norm_scale`` (K,), ``norm_bias`` (K,).

  Raises:
    ValueError: at construction, for in_features or out_features that is not a positive integer, an
      unknown norm, an epsilon that is not positive and finite (in float32, or float64 where the
      layer computes in float64 with x64; see `_common.check_epsilon`) or an unknown
      implementation; at call time, when the input's last dimension is not in_features, or
      for a ``kernel`` or ``bias`` whose value was replaced by one of another shape.
    TypeError: at construction, for a non-number epsilon, a use_scale/use_bias/use_norm_bias
      that is not a bool (use_norm_bias: or None), a dtype that is neither None nor a floating
      dtype, a param_dtype that is not a floating dtype (bfloat16, float16, float32,
      float64), or an rngs that is not an ``nnx.Rngs``; at call time, for a non-array x.
    The layer's own checks (at construction and call) start with its class name ("NormDense:
    norm must be ..."), the op's errors with the class and its features ("NormDense(in_features=8,
    out_features=4): ..."; an op argument the layer holds under another name, e.g. the op's
    ``scale``, is named both ways). At call time also ValueError/TypeError from
    :func:`pallas_norm.norm_matmul` for other bad inputs, NotImplementedError for a kernel
    implementation that does not exist, and the op's RuntimeError for
    ``implementation="interpret"`` alone on a CPU with too few threads, each with the layer
    named in front.
  """

  def __init__(self, in_features: int, out_features: int, *, norm: str = "layer",
               epsilon: float = 1e-6, use_scale: bool = True, use_norm_bias: bool | None = None,
               use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
               kernel_init=default_kernel_init, bias_init=nnx.initializers.zeros,
               scale_init=nnx.initializers.ones, norm_bias_init=nnx.initializers.zeros,
               rngs: nnx.Rngs, implementation=None):
    in_features = _common.check_features(type(self).__name__, "in_features", in_features)
    out_features = _common.check_features(type(self).__name__, "out_features", out_features)
    self.in_features, self.out_features = in_features, out_features
    _common.check_norm(type(self).__name__, norm)
    self.norm = norm
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    self.epsilon = _common.check_epsilon(type(self).__name__, epsilon, self.dtype)
    self.param_dtype = _common.check_dtype(type(self).__name__, param_dtype, "param_dtype")
    self.implementation = _common.check_implementation(type(self).__name__, implementation)
    _common.check_rngs(type(self).__name__, rngs)
    _common.check_switches(type(self).__name__, use_scale=use_scale, use_bias=use_bias,
                           **({} if use_norm_bias is None else {"use_norm_bias": use_norm_bias}))
    self.norm_scale, self.norm_bias = _norm_params(
        rngs, norm, in_features, use_scale, use_norm_bias, scale_init, norm_bias_init,
        param_dtype)
    self.kernel = _common.param(rngs, kernel_init, (in_features, out_features), param_dtype)
    self.bias = (_common.param(rngs, bias_init, (out_features,), param_dtype)
                 if use_bias else None)

  def __call__(self, x):
    """x: (..., K). Returns (..., N) in the compute dtype."""
    _common.check_last_dim(type(self).__name__, x, "in_features", self.in_features)
    params = [_common.value(p) for p in (self.kernel, self.norm_scale, self.norm_bias, self.bias)]
    _check_dense_params(self, params[0], params[3])
    cd = _common.compute_dtype(self.dtype, x, *params)
    x_dtype = x.dtype
    x, kernel, scale, norm_bias, bias = _common.cast(cd, x, *params)
    with _common.op_errors(_where(self), self.dtype, x_dtype, cd, params,
                           aliases=_OP_NAMES):
      y = pallas_norm.norm_matmul(x, kernel, scale=scale, norm_bias=norm_bias, norm=self.norm,
                                  eps=self.epsilon, implementation=self.implementation)
    return y if bias is None else y + bias


class DenseNorm(nnx.Module):
  """Post-norm dense layer: ``h = x @ kernel (+ bias) (+ residual)``,
  ``y = norm(h)·norm_scale (+ norm_bias)``.

  The op is :func:`pallas_norm.matmul_norm` (its values:
  :func:`pallas_norm.reference.matmul_norm`; the norm in the GEMM epilogue: DESIGN.md op 2).

  Args:
    in_features: K. out_features: N. Positive integers (Python or NumPy ints).
    norm: "layer" (default, as :class:`NormDense`) or "rms". epsilon: positive float (default
      1e-6).
    use_bias: create the dense ``bias`` (N,), added before the norm.
    use_scale: create ``norm_scale`` (N,). use_norm_bias: create ``norm_bias`` (N,); default
      True for "layer", False for "rms".
    dtype, param_dtype, kernel_init, bias_init, scale_init, norm_bias_init, rngs,
      implementation: as :class:`NormDense`.

  Parameters: ``kernel`` (K, N), ``bias`` (N,), ``norm_scale`` (N,), ``norm_bias`` (N,).

  Raises: as :class:`NormDense` (the input's last dimension is checked against in_features),
  the op being :func:`pallas_norm.matmul_norm`; a residual that is not of shape (..., N) raises
  its ValueError naming ``residual``.
  """

  def __init__(self, in_features: int, out_features: int, *, norm: str = "layer",
               epsilon: float = 1e-6, use_bias: bool = True, use_scale: bool = True,
               use_norm_bias: bool | None = None, dtype=None, param_dtype=jnp.float32,
               kernel_init=default_kernel_init, bias_init=nnx.initializers.zeros,
               scale_init=nnx.initializers.ones, norm_bias_init=nnx.initializers.zeros,
               rngs: nnx.Rngs, implementation=None):
    in_features = _common.check_features(type(self).__name__, "in_features", in_features)
    out_features = _common.check_features(type(self).__name__, "out_features", out_features)
    self.in_features, self.out_features = in_features, out_features
    _common.check_norm(type(self).__name__, norm)
    self.norm = norm
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    self.epsilon = _common.check_epsilon(type(self).__name__, epsilon, self.dtype)
    self.param_dtype = _common.check_dtype(type(self).__name__, param_dtype, "param_dtype")
    self.implementation = _common.check_implementation(type(self).__name__, implementation)
    _common.check_rngs(type(self).__name__, rngs)
    _common.check_switches(type(self).__name__, use_scale=use_scale, use_bias=use_bias,
                           **({} if use_norm_bias is None else {"use_norm_bias": use_norm_bias}))
    self.kernel = _common.param(rngs, kernel_init, (in_features, out_features), param_dtype)
    self.bias = (_common.param(rngs, bias_init, (out_features,), param_dtype)
                 if use_bias else None)
    self.norm_scale, self.norm_bias = _norm_params(
        rngs, norm, out_features, use_scale, use_norm_bias, scale_init, norm_bias_init,
        param_dtype)

  def __call__(self, x, residual=None, return_h: bool = False):
    """x: (..., K); residual: optional (..., N). Returns y (..., N) in the compute dtype, or
    ``(y, h)`` with ``return_h`` (h = the pre-norm residual stream, same dtype)."""
    _common.check_last_dim(type(self).__name__, x, "in_features", self.in_features)
    if residual is not None:
      _common.shape_of(type(self).__name__, "residual", residual)
    params = [_common.value(p) for p in (self.kernel, self.bias, self.norm_scale, self.norm_bias)]
    _check_dense_params(self, params[0], params[1])
    cd = _common.compute_dtype(self.dtype, x, residual, *params)
    x_dtype = x.dtype
    errors = _common.op_errors(_where(self), self.dtype, x_dtype, cd, params,
                               aliases=_OP_NAMES, residual=residual)
    x, residual, kernel, bias, scale, norm_bias = _common.cast(cd, x, residual, *params)
    with errors:
      return pallas_norm.matmul_norm(x, kernel, dense_bias=bias, residual=residual, scale=scale,
                                     norm_bias=norm_bias, norm=self.norm, eps=self.epsilon,
                                     return_h=return_h, implementation=self.implementation)
