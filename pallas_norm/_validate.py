"""Argument checks shared by the public ops. Every check raises before any kernel runs and names
the offending argument. Checks on *values* (offsets) run only when the values are concrete (not
under ``jax.jit`` tracing); shape and dtype checks always run."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
NORMS = ("rms", "layer")


def is_array(x) -> bool:
  """True for a real array: a ``jax.Array`` (tracers under ``jax.jit``/``eval_shape`` included),
  a NumPy array or a NumPy scalar, or an object JAX converts to one (``__jax_array__``, e.g. a
  Flax ``nnx.Param``). Duck-typed stand-ins that only carry ``shape`` and ``dtype``
  (``jax.ShapeDtypeStruct``) are not: the ops would fail deep inside on them."""
  return isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray, np.generic)) or hasattr(
      x, "__jax_array__")


def as_arrays(*args):
  """``args`` with the array-likes that only convert to arrays (``__jax_array__``, e.g. a Flax
  ``nnx.Param``) replaced by ``jnp.asarray`` of them; arrays, tracers, NumPy arrays, None and
  other values pass through unchanged. For the ops to call on their validated arguments before
  a ``custom_vjp``: it flattens its arguments as pytrees, and an ``nnx.Param`` is a pytree node,
  so under a gradient the kernel (or a ``custom_jvp`` inside the rule) received a Param holding
  JAX's internal ``CustomVJPPrimal`` and failed deep inside JAX or Pallas."""
  return tuple(a if a is None or isinstance(a, (jax.Array, jax.core.Tracer, np.ndarray,
                                                np.generic)) or not is_array(a)
               else jnp.asarray(a) for a in args)


def to_jax(*args):
  """``args`` with NumPy arrays and scalars replaced by ``jnp.asarray`` of them (JAX's dtype:
  without x64 float64 is float32 and int64 int32), everything else unchanged. For the ops to
  call once their arguments are validated: the library's own ``astype(x.dtype)`` and
  ``jnp.zeros(..., x.dtype)`` of a NumPy float64 input each warned "Explicitly requested dtype
  float64 ... will be truncated", a request the caller never made."""
  return tuple(jnp.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a for a in args)


def _dtype_of(name: str, x):
  if not is_array(x):
    raise TypeError(f"{name} must be an array, got {type(x).__name__} (a jax.Array or "
                    "numpy.ndarray is needed)")
  return jnp.dtype(x.dtype)


def float_array(name: str, x, *, ndim: int | None = None, min_ndim: int = 1) -> None:
  dt = _dtype_of(name, x)
  if dt not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
    raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {dt}")
  if ndim is not None and x.ndim != ndim:
    raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")
  if x.ndim < min_ndim:
    raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape "
                     f"{tuple(x.shape)}")
  if any(s == 0 for s in x.shape[-1:]):
    raise ValueError(f"{name} has an empty feature axis: shape {tuple(x.shape)}")


def jax_dtype(a) -> np.dtype:
  """``a``'s dtype as JAX sees it: without x64 a NumPy float64 (int64, uint64) array is
  float32 (int32, uint32), as ``jax.jit`` converts it before an op sees it."""
  return jax.dtypes.canonicalize_dtype(a.dtype)


def same_jax_dtype(*arrays) -> bool:
  """Whether the arrays' dtypes are one as JAX sees them (:func:`jax_dtype`): a NumPy float64
  array goes with a float32 one (a traced one is float32 already)."""
  return len({jax_dtype(a) for a in arrays}) == 1


def matmul_operands(x, w) -> None:
  """x (..., K) and w (K, N) of a GEMM op: float arrays of one dtype with matching K."""
  float_array("x", x)
  float_array("w", w, ndim=2)
  if w.shape[0] != x.shape[-1]:
    raise ValueError(f"w must have shape (K, N) with K = x.shape[-1] = {x.shape[-1]}, "
                     f"got {tuple(w.shape)}")
  # A traced float32 x (the gradient of an eager call with NumPy float64 x, w) goes with that w.
  if not same_jax_dtype(x, w):
    raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")


def optional_vector(name: str, v, size: int) -> None:
  if v is None:
    return
  float_array(name, v)
  if tuple(v.shape) != (size,):  # e.g. (H, D) for the (H·D,) affine of a norm over all heads
    raise ValueError(f"{name} must have shape ({size},), got {tuple(v.shape)}")


def same_shape(name: str, v, shape) -> None:
  if v is None:
    return
  float_array(name, v, min_ndim=0)
  if tuple(v.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(v.shape)}")


def residual(residual, x, shape) -> None:
  """An optional residual added to a stream in x's dtype: a float array of ``shape`` and of x's
  dtype. Another dtype would be rounded to x's dtype in the sum (or the returned stream would
  disagree with the y computed from it), so it raises TypeError naming ``residual``. The dtypes
  compare as JAX sees them (:func:`same_jax_dtype`), as x and w do."""
  if residual is None:
    return
  same_shape("residual", residual, shape)
  if not same_jax_dtype(residual, x):
    raise TypeError(f"residual must have x's dtype {jnp.dtype(x.dtype).name}, got "
                    f"{jnp.dtype(residual.dtype).name} (cast one of them)")


def _float_or_inf(value) -> float:
  """``float(value)``, inf for a Python int past float's range (NumPy's isfinite and Python's
  OverflowError would name no argument)."""
  try:
    return float(value)
  except OverflowError:
    return float("inf")


def _compute_dtype(dtype):
  """The float dtype the ops compute a scalar in for inputs of ``dtype``: float64 only for
  float64 inputs (a NumPy float64 input is float32 without jax_enable_x64), else float32."""
  canonical = None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
  return np.float64 if canonical == jnp.float64 else np.float32


def eps(value, dtype=None) -> float:
  """A positive finite static eps for statistics in float64 (float64 inputs, ``dtype``) or else
  float32, returned as a Python float. TypeError for a non-number, ValueError otherwise.

  It must be at least :func:`eps_floor` of that dtype: the gradient of a zero row holds rstd³ =
  eps^-1.5, which overflows below it (float32: ~2.1e-26; subnormal values, which XLA flushes to
  zero, are far below)."""
  if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and not isinstance(
      value, jax.core.Tracer) and (jnp.issubdtype(value.dtype, jnp.floating)
                                   or jnp.issubdtype(value.dtype, jnp.integer)):
    value = float(value)  # a concrete numpy/jax scalar (np.int64(1) passes as a Real too)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"eps must be a positive float (a static Python number), got {value!r}")
  as_float = _float_or_inf(value)
  if not (as_float > 0 and np.isfinite(as_float)):
    raise ValueError(f"eps must be a positive finite float, got {value!r}")
  value = as_float
  stat = _compute_dtype(dtype)
  with np.errstate(over="ignore"):  # an overflow to inf is the error reported just below
    rounded = stat(value)
  name = np.dtype(stat).name
  if not np.isfinite(rounded):
    raise ValueError(f"eps must be a positive finite {name} value (the statistics' dtype), got "
                     f"{value!r}, which is {float(rounded)} in {name}")
  if float(rounded) < eps_floor(stat):
    raise ValueError(f"eps must be a positive float of at least {eps_floor(stat):.2g} for {name} "
                     f"statistics (below it rstd³ of a zero row overflows in the gradient), got "
                     f"{value!r}")
  return float(value)


def eps_floor(stat_dtype) -> float:
  """The smallest eps :func:`eps` accepts for statistics in ``stat_dtype``: max^(-2/3)."""
  return float(np.finfo(stat_dtype).max) ** (-2.0 / 3.0)


def flag(name: str, value) -> None:
  """A static boolean option: ``True``/``False`` (or a NumPy bool). A string such as "no" is
  truthy and would silently turn the option on: TypeError."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")


def finite_scalar(name: str, value, dtype=None) -> None:
  """A real scalar: a Python/NumPy number or a 0-d array of an integer or floating dtype
  (bools and complex numbers are not). TypeError naming ``name`` for anything else, e.g. an
  array of another shape, which would broadcast into a silently different result; ValueError
  for a concrete value that is not finite in float64, or, given the inputs' ``dtype``, in the
  dtype the ops compute it in (float32 unless ``dtype`` is float64, as for :func:`eps`): the
  kernels cast the scales to float32, and 1e39 became inf there. A traced value (under
  ``jax.jit``) is checked for its shape and dtype only."""
  if hasattr(value, "dtype") and hasattr(value, "shape"):
    dt = jnp.dtype(value.dtype)
    real = (jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)) and (
        dt != jnp.dtype(bool))
    if tuple(value.shape) != () or not real:
      raise TypeError(f"{name} must be a real scalar (a number or a 0-d integer or floating "
                      f"array), got an array of shape {tuple(value.shape)} and dtype {dt}")
  if isinstance(value, jax.core.Tracer):
    return
  if isinstance(value, (str, bytes, bool, np.bool_)):
    raise TypeError(f"{name} must be a real scalar, got {value!r}")
  try:
    f = _float_or_inf(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be a real scalar, got {value!r}") from e
  if not np.isfinite(f):
    raise ValueError(f"{name} must be finite, got {value!r}")
  if dtype is not None and _compute_dtype(dtype) == np.float32:
    with np.errstate(over="ignore"):
      if not np.isfinite(np.float32(f)):
        # float64 computes in float32 only with x64 off (a layer with dtype None asks as float64)
        when = ("with x64 off" if jnp.dtype(dtype) == np.float64
                else f"for {jnp.dtype(dtype).name} inputs")
        raise ValueError(f"{name} must be finite in float32 (the dtype the ops compute it in "
                         f"{when}), got {value!r}")


def scale_value(value):
  """A pre_scale/post_scale that :func:`finite_scalar` accepted, as the ops compute with it: a
  concrete integer (a Python int, a NumPy integer scalar or 0-d array) as a Python float, the
  value the kernels already took. JAX parses a Python int past int32 with an OverflowError that
  names no argument, and with x64 off wraps a NumPy int64 into int32 (2**40 became 0, a silent
  wrong answer on the XLA path). Other real numbers that JAX cannot take (a
  ``fractions.Fraction``, a ``decimal.Decimal``, a NumPy ``longdouble``) are their Python float
  too: they passed the checks and failed inside the XLA path ("unsupported operand type(s) for
  *", "float128 is not a valid dtype for JAX type promotion"). JAX arrays and tracers, Python
  floats and NumPy floating scalars of :data:`FLOAT_DTYPES` pass unchanged (their integers are
  JAX's already). Bools never get here: :func:`finite_scalar` refuses them."""
  if isinstance(value, (jax.Array, jax.core.Tracer)):
    return value
  if isinstance(value, (np.ndarray, np.generic)):
    if jnp.dtype(value.dtype) in [jnp.dtype(d) for d in FLOAT_DTYPES]:
      return value
    return float(value)
  return value if isinstance(value, float) else float(value)


def activation(value, names) -> None:
  """``value`` is one of the activation ``names`` (a string): ValueError naming ``activation``
  otherwise. Checked as a string first: an unhashable value (a list, a dict) made the
  membership test against the name table raise "unhashable type" without naming the argument."""
  if not isinstance(value, str) or value not in names:
    raise ValueError(f"activation must be one of {sorted(names)}, got {value!r}")


def norm_kind(value) -> None:
  """``value`` is "rms" or "layer" (a string; a NumPy array of names made the membership test
  raise NumPy's "truth value ... is ambiguous", or pass one name by its elementwise ==)."""
  if not isinstance(value, str) or value not in NORMS:
    raise ValueError(f"norm must be one of {NORMS}, got {value!r}")


def float_dtype(name: str, value) -> jnp.dtype:
  """``value`` as a ``jnp.dtype`` of :data:`FLOAT_DTYPES`; TypeError naming ``name`` for anything
  else (an integer or bool dtype, None, or a value that is not a dtype)."""
  if value is None:  # jnp.dtype(None) would be float64
    raise TypeError(f"{name} must be a floating dtype, got None")
  try:
    dt = jnp.dtype(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be a floating dtype, got {value!r}") from e
  if dt not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
    raise TypeError(f"{name} must be a floating dtype, got {dt}")
  return dt


def out_dtype(value) -> None:
  if value is None:
    return
  dt = float_dtype("out_dtype", value)
  if dt == jnp.float64 and not jax.config.jax_enable_x64:
    # JAX would silently produce float32.
    raise TypeError("out_dtype float64 needs jax_enable_x64 (without it JAX computes in "
                    "float32); enable x64 or ask for float32")


def static_positive_int(name: str, value) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be a positive static integer (a Python or NumPy int), got "
                    f"{value!r}")
  if value < 1:
    raise ValueError(f"{name} must be a positive static integer (a Python or NumPy int), got "
                     f"{value!r}")


def within_capacity(bound, capacity: int) -> int | None:
  """A validated static length bound (max_seq_len, max_kv_len; None stays None) as a Python
  int of at most the packed capacity (and at least 1): no sample can hold more rows than its
  capacity, so a larger bound never binds, but the XLA paths size their padded layout by it
  (2**31 overflowed JAX's int32 shapes, 2**40 killed the process with SIGFPE)."""
  return None if bound is None else max(1, min(int(bound), capacity))


def host_offsets(off) -> np.ndarray:
  """Concrete offsets on the host in int64, so that their differences (the lengths) cannot
  wrap around as int32 ones do (``[0, 2**31 - 1, -2**31 + 1]`` has int32 steps 2**31 - 1 and 2)."""
  return np.asarray(off).astype(np.int64)


def offsets(name: str, off, capacity: int, *, max_len: int | None = None,
            max_len_name: str = "max_seq_len") -> int:
  """Checks a jagged offsets vector; returns the batch size B (= len(offsets) - 1)."""
  if not is_array(off):
    raise TypeError(f"{name} must be an int32 array of shape (B+1,), got {type(off).__name__}")
  # As JAX sees it (:func:`jax_dtype`): the eager call refused what the jitted one took.
  if jax_dtype(off) != jnp.int32:
    raise TypeError(f"{name} must be int32, got {off.dtype} (cast with .astype(jnp.int32))")
  if off.ndim != 1 or off.shape[0] < 2:
    raise ValueError(f"{name} must have shape (B+1,) with B >= 1, got {tuple(off.shape)}")
  if isinstance(off, jax.core.Tracer):
    return off.shape[0] - 1
  host = host_offsets(off)
  if host[0] != 0:
    raise ValueError(f"{name}[0] must be 0, got {host[0]}")
  steps = np.diff(host)
  if np.any(steps < 0):
    raise ValueError(f"{name} must be non-decreasing; it decreases at index "
                     f"{int(np.argmax(steps < 0)) + 1}")
  if host[-1] > capacity:
    raise ValueError(f"{name}[-1] = {host[-1]} exceeds the packed capacity {capacity}")
  if max_len is not None and steps.size and steps.max() > max_len:
    raise ValueError(f"a sample of {name} has {steps.max()} rows, more than "
                     f"{max_len_name}={max_len}")
  return off.shape[0] - 1


def at_least_int32(a):
  """Integer array ``a`` widened to int32 (exactly) if narrower, else as it is: Python-int
  bounds compared with a narrow dtype wrap (uint8(300) is 44), and so do differences."""
  return a.astype(jnp.int32) if jnp.iinfo(a.dtype).bits < 32 else a


def offsets_invalid(off, capacity: int, max_len: int | None):
  """Traced counterpart of :func:`offsets`: a scalar bool, True when ``off`` breaks the jagged
  convention (first != 0, decreasing, an offset outside [0, capacity], a length > max_len).
  Under ``jax.jit`` the values cannot raise, so the ops turn their output into NaN instead of a
  silent wrong answer. Every offset is bounded first: the steps are int32 differences, which
  wrap around for offsets far apart (offsets of lengths whose int32 sum overflowed look
  non-decreasing with short steps), and cannot once all offsets lie in [0, capacity]. Offsets
  narrower than 32 bits are widened to int32 first (exactly): in their own dtype the bounds
  would wrap (uint8(300) is 44) and so would a decreasing step (100 − 200 is 156 in uint8);
  the order is tested by comparison, not by the sign of a difference, for the same reason."""
  off = at_least_int32(off)
  steps = off[1:] - off[:-1]
  bad = ((off[0] != 0) | jnp.any(off < 0) | jnp.any(off > capacity)
         | jnp.any(off[1:] < off[:-1]))
  if max_len is not None:
    bad = bad | jnp.any(steps > max_len)
  return bad


def nan_if(bad, a):
  """``a`` times 1, or times NaN where the traced scalar ``bad`` (None: known False) is True;
  arrays that cannot hold NaN pass unchanged. A multiply (unlike a select) is linear in ``a``,
  so forward mode sees NaN tangents and reverse mode NaN cotangents, with no custom rule: a
  train step on bad offsets gets NaN gradients, never finite (zero) ones."""
  if bad is None or not jnp.issubdtype(a.dtype, jnp.inexact):
    return a
  return a * jnp.where(bad, jnp.nan, 1.0).astype(a.dtype)


def poison_if_invalid(out, bad, message: str):
  """``out`` (a pytree of arrays) turned into NaN, values and gradients, where the traced scalar
  ``bad`` is True (:func:`nan_if`); also a :func:`jax.experimental.checkify.debug_check`, so a
  caller that wraps its step in ``checkify.checkify`` gets ``message`` as an error instead of
  NaN."""
  checkify.debug_check(jnp.logical_not(bad), message)
  return jax.tree.map(lambda a: nan_if(bad, a), out)
