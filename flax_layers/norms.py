"""``RMSNorm`` and ``LayerNorm`` as Flax NNX layers over :func:`pallas_norm.rms_norm` and
:func:`pallas_norm.layer_norm` (DESIGN.md, op 5).

Arguments and parameter names follow ``flax.nnx.RMSNorm`` / ``flax.nnx.LayerNorm`` (``scale``,
``bias``); the layers add ``implementation=`` and a fused residual add. As every Flax layer, a
call returns one array, also with a residual; ``return_h=True`` also returns the new residual
stream ``h = x + residual``, as :class:`flax_layers.DenseNorm` does.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import pallas_norm
from flax_layers import _common
from pallas_norm import _validate


def _check_call(layer, x, residual, return_h) -> None:
  """The call's arguments, before the compute-dtype rule reads their dtypes (a list residual
  failed there with AttributeError): x's last dimension, a residual that is an array (its shape
  is the op's check), a bool return_h."""
  name = type(layer).__name__
  _common.check_last_dim(name, x, "num_features", layer.num_features)
  if residual is not None:
    _common.shape_of(name, "residual", residual)
  _validate.flag(f"{_where(layer)}: return_h", return_h)


def _where(layer) -> str:
  """The layer as its errors name it (a model's error then says which sub-layer)."""
  return f"{type(layer).__name__}(num_features={layer.num_features})"


def _outputs(out, x, residual, return_h: bool):
  """y, or (y, h): the ops return (y, h) exactly when a residual is given."""
  y, h = out if residual is not None else (out, x)
  return (y, h) if return_h else y


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis: ``y = s · rsqrt(mean(s²) + epsilon) · scale``, ``s = x (+ r)``.

  The op is :func:`pallas_norm.rms_norm` (its values: :func:`pallas_norm.reference.rms_norm`;
  the math: DESIGN.md op 5).

  Args:
    num_features: N, the size of the normalized (last) axis: a positive integer (a Python or
      NumPy int).
    epsilon: positive float added to the mean square (default 1e-6); stored as a Python float.
    dtype: compute dtype; inputs and ``scale`` are cast to it before the op (default: the
      promoted dtype of the input and the parameters, as in Flax).
    param_dtype: dtype of ``scale``: a floating dtype (default float32).
    use_scale: create the (N,) ``scale`` parameter (gamma).
    scale_init: initializer of ``scale`` (default ones).
    rngs: ``nnx.Rngs`` for parameter initialization.
    implementation: passed to the op (:func:`pallas_norm.rms_norm`): None, "xla", "triton"
      (the Pallas backward kernel, XLA's forward; an NVIDIA GPU), "interpret" (that kernel in
      Pallas interpret mode) or a sequence of them; "mosaic" has no RMSNorm kernel.

  Raises:
    ValueError: at construction, for a num_features that is not a positive integer, an epsilon that
      is not positive and finite (in float32, or float64 where the layer computes in float64 with
      x64; see `_common.check_epsilon`) or an unknown implementation; at call time, when the
      input's last dimension is not num_features (with or without ``scale``).
    TypeError: at construction, for a non-number epsilon, a use_scale (LayerNorm: also
      use_bias) that is not a bool, a dtype that is neither None nor a floating dtype, a
      param_dtype that is not a floating dtype (bfloat16, float16, float32, float64), or an
      rngs that is not an ``nnx.Rngs`` (also with use_scale=False); at call time, for a
      non-array x or residual, or a return_h that is not a bool. The construction errors start
      with the layer's class name ("RMSNorm: ...").
    At call time also ValueError/TypeError from :func:`pallas_norm.rms_norm` for other bad inputs
    (e.g. a residual of another shape), and NotImplementedError for a kernel implementation that
    does not exist, with the layer named in front ("RMSNorm(num_features=16): ...").
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None,
               param_dtype=jnp.float32, use_scale: bool = True,
               scale_init=nnx.initializers.ones, rngs: nnx.Rngs, implementation=None):
    self.num_features = _common.check_features(type(self).__name__, "num_features", num_features)
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    self.epsilon = _common.check_epsilon(type(self).__name__, epsilon, self.dtype)
    self.param_dtype = _common.check_dtype(type(self).__name__, param_dtype, "param_dtype")
    self.implementation = _common.check_implementation(type(self).__name__, implementation)
    _common.check_rngs(type(self).__name__, rngs)
    _common.check_switches(type(self).__name__, use_scale=use_scale)
    self.scale = (_common.param(rngs, scale_init, (num_features,), param_dtype)
                  if use_scale else None)

  def __call__(self, x, residual=None, return_h: bool = False):
    """x: (..., N); residual: optional, x's shape, added before the norm. Returns y (..., N) in
    the compute dtype, or ``(y, h)`` with ``return_h`` (h = x + residual, the new residual
    stream; h = x without a residual)."""
    _check_call(self, x, residual, return_h)
    scale = _common.value(self.scale)
    cd = _common.compute_dtype(self.dtype, x, residual, scale)
    x_dtype = x.dtype
    x, residual, scale = _common.cast(cd, x, residual, scale)
    with _common.op_errors(_where(self), self.dtype, x_dtype, cd, [scale], residual=residual):
      out = pallas_norm.rms_norm(x, scale, residual, eps=self.epsilon,
                                 implementation=self.implementation)
    return _outputs(out, x, residual, return_h)


class LayerNorm(nnx.Module):
  """LayerNorm over the last axis: ``y = (s − μ) · rsqrt(σ² + epsilon) · scale + bias``.

  The op is :func:`pallas_norm.layer_norm` (its values: :func:`pallas_norm.reference.layer_norm`;
  the math: DESIGN.md op 5). Arguments as :class:`RMSNorm`, plus ``use_bias`` (create the (N,)
  ``bias``, beta) and ``bias_init`` (default zeros). Statistics are float32 (float64 for
  float64 inputs) with a two-pass variance.
  ``implementation`` may also name the Pallas backward kernel of :func:`pallas_norm.layer_norm`:
  "triton" (an NVIDIA GPU) or "interpret".

  Raises: as :class:`RMSNorm` (the input's last dimension is checked against num_features with
  or without ``scale`` and ``bias``), the op being :func:`pallas_norm.layer_norm`.
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None,
               param_dtype=jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros, scale_init=nnx.initializers.ones,
               rngs: nnx.Rngs, implementation=None):
    self.num_features = _common.check_features(type(self).__name__, "num_features", num_features)
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    self.epsilon = _common.check_epsilon(type(self).__name__, epsilon, self.dtype)
    self.param_dtype = _common.check_dtype(type(self).__name__, param_dtype, "param_dtype")
    self.implementation = _common.check_implementation(type(self).__name__, implementation)
    _common.check_rngs(type(self).__name__, rngs)
    _common.check_switches(type(self).__name__, use_scale=use_scale, use_bias=use_bias)
    self.scale = (_common.param(rngs, scale_init, (num_features,), param_dtype)
                  if use_scale else None)
    self.bias = (_common.param(rngs, bias_init, (num_features,), param_dtype)
                 if use_bias else None)

  def __call__(self, x, residual=None, return_h: bool = False):
    """x: (..., N). Returns y, or ``(y, h)`` with ``return_h``, as :class:`RMSNorm`."""
    _check_call(self, x, residual, return_h)
    scale, bias = _common.value(self.scale), _common.value(self.bias)
    cd = _common.compute_dtype(self.dtype, x, residual, scale, bias)
    x_dtype = x.dtype
    x, residual, scale, bias = _common.cast(cd, x, residual, scale, bias)
    with _common.op_errors(_where(self), self.dtype, x_dtype, cd, [scale, bias],
                           residual=residual):
      out = pallas_norm.layer_norm(x, scale, bias, residual, eps=self.epsilon,
                                   implementation=self.implementation)
    return _outputs(out, x, residual, return_h)
