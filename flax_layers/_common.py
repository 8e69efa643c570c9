"""Helpers shared by the Flax layers: parameter creation and the compute-dtype rule."""

from __future__ import annotations

import contextlib
import operator
import re

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_norm import _dispatch, _op, _validate


def param(rngs: nnx.Rngs, init, shape, param_dtype) -> nnx.Param:
  """An ``nnx.Param`` drawn from ``init(key, shape, param_dtype)``, as Flax's own layers do."""
  return nnx.Param(init(rngs.params(), shape, param_dtype))


def value(p: nnx.Param | None):
  """The array of an optional parameter (None stays None)."""
  return None if p is None else p[...]


def compute_dtype(dtype, *arrays) -> jnp.dtype:
  """``dtype`` if given, else the promoted dtype of the non-None arrays (Flax's rule: a bf16
  input with f32 parameters computes in f32), promoted with float32 where that is not a
  floating dtype (Flax's ``inexact=True``: integer or bool inputs of a layer without
  parameters compute in float32, as they do with float32 parameters)."""
  if dtype is not None:
    return jnp.dtype(dtype)
  promoted = jnp.result_type(*[a.dtype for a in arrays if a is not None])
  if not jnp.issubdtype(promoted, jnp.inexact):
    promoted = jnp.promote_types(jnp.float32, promoted)
  return promoted


# NotImplementedError subclasses RuntimeError: not being exactly one of these, it passes named()
# unchanged, to op_errors' own branch that adds the dtype-promotion hint.
CALL_ERRORS = (ValueError, TypeError, RuntimeError)
"""The exception types :func:`op_errors` names the layer in, besides NotImplementedError."""
LAYER_ERRORS = (*CALL_ERRORS, NotImplementedError)
"""Every exception type a layer's call names itself in (:func:`op_errors`): those a model names
the sub-layer's path in (:func:`part`)."""


JVP_OF_CUSTOM_VJP = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
"""JAX's TypeError for forward mode (``jax.jvp``, ``jax.jacfwd``) of a kernel path, which
:func:`op_errors` completes with what to use instead."""


@contextlib.contextmanager
def op_errors(layer: str, dtype, input_dtype, compute: jnp.dtype, params, aliases=None,
              **others):
  """Names the layer in the errors of the op it calls. A kernel's NotImplementedError is
  re-raised with the likely cause when ``dtype=None`` made the parameters (or another input in
  ``others``, e.g. ``residual=``) promote the input (e.g. bf16 with float32 parameters computes
  in float32, which the kernels do not take; an integer input computes in float32 too, and the
  hint names a floating dtype to pass, not the input's). ``params`` are
  the layer's parameter arrays (None for absent ones); the hint names their own dtype, not the
  promoted one. Otherwise the error, a plain ValueError or TypeError of the op (a bad
  argument) and a plain RuntimeError (e.g. ``implementation="interpret"`` on a CPU client with
  too few threads) are re-raised with ``layer`` (the layer and the arguments the op's shapes
  come from) in front, so that a model's error names its sub-layer; JAX's TypeError for forward
  mode of a kernel path also says to pass ``implementation="xla"``. ``aliases`` maps the op's
  argument names to the layer's parameter names where they differ (``{"scale": "norm_scale"}``): an
  error about such an argument also names the layer's parameter."""
  try:
    with named(layer, CALL_ERRORS, aliases):
      try:
        yield
      except TypeError as e:
        # JAX's own words name neither the cause (a kernel path) nor the fix.
        if type(e) is not TypeError or JVP_OF_CUSTOM_VJP not in str(e):
          raise
        raise TypeError(f"{e} (the kernel path: {_op.SECOND_ORDER_HINT})") from e
  except NotImplementedError as e:
    input_dtype = jnp.dtype(input_dtype)
    if dtype is None and not jnp.issubdtype(input_dtype, jnp.floating):
      # dtype=jnp.int32 (the input's own) is refused when a layer is built.
      raise NotImplementedError(
          f"{e}. ({layer}: with dtype=None the {input_dtype} input computes in {compute}; "
          "pass a dtype the kernels take, e.g. dtype=jnp.bfloat16.)") from e
    if dtype is None and input_dtype != compute:
      causes = []
      present = [p for p in params if p is not None]
      if present:
        param_dtype = jnp.result_type(*[p.dtype for p in present])
        causes.append(f"the {param_dtype} parameters")
      for name, a in others.items():
        if a is not None and jnp.dtype(a.dtype) != input_dtype:
          causes.append(f"the {jnp.dtype(a.dtype)} {name}")
      raise NotImplementedError(
          f"{e}. ({layer}: with dtype=None {' and '.join(causes)} promoted the {input_dtype} "
          f"input to {compute}; pass dtype=jnp.{input_dtype} to compute in the input's "
          "dtype.)") from e
    raise NotImplementedError(f"{layer}: {e}") from e


def cast(dtype, *arrays):
  """Casts every non-None array to ``dtype``; returns them as a tuple."""
  return tuple(None if a is None else a.astype(dtype) for a in arrays)


@contextlib.contextmanager
def named(layer: str, kinds=(ValueError, TypeError), aliases=None):
  """Re-raises an exception of exactly one of ``kinds`` (by default a plain ValueError or
  TypeError of a construction check) with ``layer`` (the layer's class name) in front, the form
  of every error a layer raises when it is built. Subclasses (JAX's own errors, e.g.
  ``jax.errors.ConcretizationTypeError`` or ``JaxRuntimeError``) pass unchanged: their type
  and message are what JAX documents. With ``aliases`` (:func:`op_errors`), a message that
  starts with one of its op argument names ends with the layer's name for it."""
  try:
    yield
  except kinds as e:
    if type(e) not in kinds:
      raise
    raise type(e)(f"{layer}: {e}{_alias_note(str(e), aliases)}") from e


def _alias_note(message: str, aliases) -> str:
  """The note " (the op's scale: this layer's norm_scale)" where ``message`` is about an op argument
  that the layer holds under another name (the op's checks name their own arguments), else
  ""."""
  for op_name, layer_name in (aliases or {}).items():
    if re.match(rf"{re.escape(op_name)}\b", message):
      return f" (the op's {op_name}: this layer's {layer_name})"
  return ""


@contextlib.contextmanager
def part(model, name: str, index: int | None = None):
  """Yields ``model``'s sub-layer ``name`` (item ``index`` of an ``nnx.List``) and re-raises an
  error of its call with the sub-layer's path in front ("KunlunModel.pffn[1]: PFFNBlock: ..."):
  the layer's own prefix names its class only, and a model holds several layers of one class.
  Only exact :data:`LAYER_ERRORS` types are renamed; subclasses (JAX's own errors) pass
  unchanged, as in :func:`named`."""
  layer, path = getattr(model, name), f"{type(model).__name__}.{name}"
  if index is not None:
    layer, path = layer[index], f"{path}[{index}]"
  with named(path, LAYER_ERRORS):
    yield layer


def check_switches(layer: str, **switches) -> None:
  """The layer's on/off arguments (``use_scale``, ``use_bias``, ...) are bools (or NumPy bools;
  None where a switch has a default rule, passed here only when set): a string such as "no" is
  truthy and would silently create the parameter. TypeError naming the layer's argument."""
  for name, value in switches.items():
    with named(layer):
      _validate.flag(name, value)


def check_rngs(layer: str, rngs) -> None:
  """The layer's ``rngs``: an ``nnx.Rngs``, checked when the layer is built, also where it
  creates no parameter (None or a key failed with "AttributeError: 'NoneType' object has no
  attribute 'params'" at the first parameter). TypeError naming the layer and ``rngs``."""
  if not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"{layer}: rngs must be an nnx.Rngs (e.g. rngs=nnx.Rngs(0)), got "
                    f"{type(rngs).__name__}")


def check_norm(layer: str, norm: str) -> None:
  """The layer's ``norm``: the ops' rule (:func:`pallas_norm._validate.norm_kind`); ValueError
  naming the layer."""
  with named(layer):
    _validate.norm_kind(norm)


def check_activation(layer: str, activation: str, names) -> None:
  """The layer's ``activation``: one of ``names`` (:func:`pallas_norm._validate.activation`);
  ValueError naming the layer."""
  with named(layer):
    _validate.activation(activation, names)


def check_scale(layer: str, name: str, scale, dtype=None) -> None:
  """The layer's static scalar ``name`` (an attention scale) by the ops' rule
  (:func:`pallas_norm._validate.finite_scalar`) for the layer's compute ``dtype`` (epsilon's rule,
  :func:`rule_dtype`): TypeError for a non-scalar, ValueError for a value that is not finite
  there; both name the layer."""
  with named(layer):
    _validate.finite_scalar(name, scale, rule_dtype(dtype))


def static_scale(scale):
  """A scale that :func:`check_scale` accepted, kept as the layer's static config: a concrete
  number or 0-d array as its Python float (a JAX or NumPy array attribute would be the module's
  state, traced under ``nnx.jit``, and put the ops on their array-scale path); a tracer (a layer
  built inside a transform) unchanged."""
  return scale if isinstance(scale, jax.core.Tracer) else float(scale)


def check_features(layer: str, name: str, value_) -> int:
  """``value_`` as a Python int: any integral number >= 1 (int, NumPy integer, a concrete integer
  scalar array); bools, floats, zero and negatives raise ValueError naming ``layer`` and
  ``name``."""
  try:
    size = None if isinstance(value_, bool) else operator.index(value_)
  except TypeError:
    size = None
  if size is None or size < 1:
    raise ValueError(f"{layer}: {name} must be a positive integer, got {value_!r}")
  return size


def rule_dtype(dtype):
  """The inputs' dtype whose rule (:mod:`pallas_norm._validate`) checks a layer's static
  scalars (epsilon, the attention scales) when it is built: the compute ``dtype``, or for
  ``None`` (the inputs decide) float64, the loosest — float32 unless x64 is on."""
  return jnp.float64 if dtype is None else dtype


def check_epsilon(layer: str, epsilon, dtype=None) -> float:
  """``epsilon`` as a Python float, checked when the layer is built by the ops' own eps rule
  (:func:`pallas_norm._validate.eps`) for the statistics' dtype of the layer's compute ``dtype``:
  float64 for ``float64`` (with x64), float32 for any other. ``dtype=None`` (the inputs decide)
  takes the loosest rule that some input could meet — float64's with x64 on, else float32's —
  and the op checks ``eps`` again against its actual inputs. TypeError for a non-number,
  ValueError for a value that is not positive and finite in that dtype (or below its floor);
  the message names the layer's ``epsilon``."""
  try:
    _validate.eps(epsilon, rule_dtype(dtype))
  except (TypeError, ValueError) as e:
    raise type(e)(f"{layer}: invalid epsilon: {e}") from e
  return float(epsilon)


def shape_of(layer: str, name: str, x) -> tuple:
  """The shape of the layer's array argument ``name``; TypeError when ``x`` is not an array."""
  if not _validate.is_array(x):
    raise TypeError(f"{layer}: {name} must be an array, got {type(x).__name__} (a jax.Array "
                    "or numpy.ndarray is needed)")
  check_real(f"{layer}: {name}", x)
  return tuple(x.shape)


def check_real(what: str, x) -> None:
  """TypeError for a complex array ``x`` (named ``what``): the cast to the compute dtype would
  drop its imaginary part."""
  if jnp.issubdtype(jnp.dtype(x.dtype), jnp.complexfloating):
    raise TypeError(f"{what} must be a real array, got {jnp.dtype(x.dtype)} (its imaginary "
                    "part would be dropped)")


def check_last_dim(layer: str, x, features_name: str, features: int) -> None:
  """Raises ValueError naming the layer's ``features_name`` when the input's last dimension is
  not ``features`` (before the op, whose message would name its own ``scale`` or ``w``). A
  0-d input is left to the op, which names ``x``."""
  shape = shape_of(layer, "x", x)
  if shape and shape[-1] != features:
    raise ValueError(f"{layer}: {features_name}={features} does not match the input's last "
                     f"dimension {shape[-1]}")


def check_dtype(layer: str, dtype, name: str = "dtype"):
  """Checks the layer's dtype argument ``name`` when the layer is built: the compute ``dtype``
  may be None or a floating dtype, ``param_dtype`` must be a floating dtype
  (:func:`pallas_norm._validate.float_dtype`: bfloat16, float16, float32 or float64); otherwise
  TypeError naming the layer's argument (not the op's ``x``, which would see the input already
  cast to it, nor an initializer failing inside JAX). Returns the value unchanged."""
  if dtype is None and name == "dtype":
    return dtype
  with named(layer):
    _validate.float_dtype(name, dtype)
  return dtype


def check_implementation(layer: str, implementation):
  """Rejects an unknown implementation when the layer is built, not at its first call
  (ValueError naming the layer); a sequence (tried in order, see :mod:`pallas_norm._dispatch`)
  comes back as a tuple."""
  with named(layer):
    return _dispatch.check_implementation(implementation)
