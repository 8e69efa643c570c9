"""The closed-form backward of rms_norm/layer_norm against autodiff of the reference.

Tolerances: float64 inputs (x64 on the CPU) agree to 1e-10 relative (the same math in another
order); bfloat16 inputs are compared with the float32 reference's gradients of the same bf16
values at 2e-2 relative Frobenius error (the gradients are cast to bf16 once).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import reference
from pallas_norm.ops.row_norm_vjp import row_norm


def _reference(norm, x, scale, bias, residual, **kw):
  if norm == "rms":
    return reference.rms_norm(x, scale, residual, **kw)
  return reference.layer_norm(x, scale, bias, residual, **kw)


def _inputs(rng, shape, dtype, with_scale, with_bias, with_res, mean=0.0):
  n = shape[-1]
  x = (rng.standard_normal(shape) + mean).astype(np.float32)
  args = [jnp.asarray(x, dtype)]
  args.append(jnp.asarray(rng.standard_normal(n), dtype) if with_scale else None)
  args.append(jnp.asarray(rng.standard_normal(n), dtype) if with_bias else None)
  args.append(jnp.asarray(rng.standard_normal(shape), dtype) if with_res else None)
  return args


def _vjp_all(fn, args, cot_seed):
  out, pullback = jax.vjp(fn, *args)
  leaves = jax.tree.leaves(out)
  rng = np.random.default_rng(cot_seed)
  cots = [jnp.asarray(rng.standard_normal(l.shape), l.dtype) for l in leaves]
  return out, pullback(jax.tree.unflatten(jax.tree.structure(out), cots))


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("zc", [False, True])
def test_grads_match_reference_f64(norm, with_res, zc):
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    args = _inputs(rng, (3, 5, 48), jnp.float64, True, norm == "layer", with_res)
    kw = dict(eps=1e-5, zero_centered_scale=zc)
    fn = lambda x, s, b, r: row_norm(x, s, b, r, norm=norm, **kw)
    ref = lambda x, s, b, r: _reference(norm, x, s, b, r, **kw)
    out, grads = _vjp_all(fn, args, 1)
    want_out, want_grads = _vjp_all(ref, args, 1)
    for got, want in zip(jax.tree.leaves((out, grads)), jax.tree.leaves((want_out, want_grads))):
      assert got.dtype == want.dtype
      assert _rel(got, want) < 1e-10


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_grads_bf16_without_affine(norm):
  rng = np.random.default_rng(2)
  args = _inputs(rng, (64, 256), jnp.bfloat16, False, False, False)
  fn = lambda x: row_norm(x, None, None, None, norm=norm, eps=1e-6, out_dtype=jnp.float32)
  ref = lambda x: _reference(norm, x.astype(jnp.float32), None, None, None, eps=1e-6)
  out, (dx,) = _vjp_all(fn, args[:1], 3)
  want_out, (want_dx,) = _vjp_all(ref, args[:1], 3)
  assert out.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
  assert _rel(out, want_out) < 1e-6
  assert _rel(dx, want_dx) < 2e-2


def test_layer_norm_large_mean_keeps_gradient_precision():
  """Rows of mean 1e4 and std 1: an f32 centering by the rounded mean would lose ~1e-3 of x̂;
  the shifted recompute keeps the f32 gradients within 1e-4 of the float64 oracle."""
  rng = np.random.default_rng(4)
  x32, scale32, bias32, _ = _inputs(rng, (16, 512), jnp.float32, True, True, False, mean=1e4)
  fn = lambda x, s, b: row_norm(x, s, b, None, norm="layer", eps=1e-6)
  _, grads = _vjp_all(fn, [x32, scale32, bias32], 5)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (x32, scale32, bias32)]
    ref = lambda x, s, b: reference.layer_norm(x, s, b, eps=1e-6)
    _, want = _vjp_all(ref, args64, 5)
    for got, w in zip(grads, want):
      assert _rel(got, w) < 1e-4


def test_rejects_bias_for_rms_and_unknown_norm():
  x = jnp.ones((2, 8))
  with pytest.raises(ValueError, match="bias"):
    row_norm(x, None, jnp.ones(8), norm="rms", eps=1e-6)
  with pytest.raises(ValueError, match="norm"):
    row_norm(x, norm="batch", eps=1e-6)
