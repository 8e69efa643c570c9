"""Helpers shared by the Flax layers: parameter creation and the compute-dtype rule."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_norm import IMPLEMENTATIONS


def param(rngs: nnx.Rngs, init, shape, param_dtype) -> nnx.Param:
  """An ``nnx.Param`` drawn from ``init(key, shape, param_dtype)``, as Flax's own layers do."""
  return nnx.Param(init(rngs.params(), shape, param_dtype))


def value(p: nnx.Param | None):
  """The array of an optional parameter (None stays None)."""
  return None if p is None else p[...]


def compute_dtype(dtype, *arrays) -> jnp.dtype:
  """``dtype`` if given, else the promoted dtype of the non-None arrays (Flax's rule: a bf16
  input with f32 parameters computes in f32)."""
  if dtype is not None:
    return jnp.dtype(dtype)
  return jnp.result_type(*[a.dtype for a in arrays if a is not None])


def cast(dtype, *arrays):
  """Casts every non-None array to ``dtype``; returns them as a tuple."""
  return tuple(None if a is None else a.astype(dtype) for a in arrays)


def check_norm(norm: str) -> None:
  if norm not in ("rms", "layer"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")


def check_features(name: str, value_) -> None:
  if isinstance(value_, bool) or not isinstance(value_, int) or value_ < 1:
    raise ValueError(f"{name} must be a positive int, got {value_!r}")


def check_implementation(implementation) -> str | None:
  """Rejects an unknown implementation name when the layer is built, not at its first call."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  return implementation
