"""The lazy backward of norm_matmul (custom_vjp, DESIGN.md op 1) against JAX's autodiff of the
reference. The forward here is the kernel's epilogue math in XLA ("lazy_xla"), so these tests pin
the backward identities independently of the Mosaic kernel; the kernel tests reuse them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import reference
from pallas_norm.ops import norm_matmul as nm

# f32 inputs: the identities are exact algebra, so only f32 rounding separates the two paths.
F32_TOL = dict(rtol=2e-4, atol=2e-4)


def _inputs(seed, m, k, n, dtype, mean_offset=0.0):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (m, k), jnp.float32) + mean_offset
  w = jax.random.normal(ks[1], (k, n), jnp.float32) / np.sqrt(k)
  scale = 1.0 + 0.3 * jax.random.normal(ks[2], (k,), jnp.float32)
  bias = 0.3 * jax.random.normal(ks[3], (k,), jnp.float32)
  ct = jax.random.normal(ks[4], (m, n), jnp.float32)
  return x.astype(dtype), w.astype(dtype), scale, bias, ct


def _losses(norm, ct, use_scale, use_bias, implementation="lazy_xla"):
  def pick(scale, bias):
    return (scale if use_scale else None), (bias if use_bias else None)

  def fused(x, w, scale, bias):
    s, b = pick(scale, bias)
    y = nm._fused_call(x, w, s, b, norm, 1e-6, x.dtype, False, implementation)
    return jnp.sum(y.astype(jnp.float32) * ct)

  def ref(x, w, scale, bias):
    s, b = pick(scale, bias)
    y = reference.norm_matmul(x, w, s, b, norm=norm, eps=1e-6)
    return jnp.sum(y.astype(jnp.float32) * ct)

  return fused, ref


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("use_scale,use_bias", [(False, False), (True, False), (True, True),
                                                (False, True)])
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (77, 128, 192), (33, 17, 769)])
def test_lazy_backward_matches_autodiff_f32(norm, use_scale, use_bias, m, k, n):
  x, w, scale, bias, ct = _inputs(m * k + n, m, k, n, jnp.float32)
  fused, ref = _losses(norm, ct, use_scale, use_bias)
  got = jax.grad(fused, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  for name, g, r in zip(["dx", "dw", "dscale", "dbias"], got, want):
    scale_ = float(jnp.max(jnp.abs(r))) + 1e-6
    np.testing.assert_allclose(g / scale_, r / scale_, err_msg=name, **F32_TOL)


def test_lazy_backward_large_row_mean():
  """Rows of 1e3 + N(0, 1): the identities use the saved mean, so no cancellation blows up."""
  x, w, scale, bias, ct = _inputs(3, 32, 128, 64, jnp.float32, mean_offset=1e3)
  fused, ref = _losses("layer", ct, True, True)
  got = jax.grad(fused, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  for name, g, r in zip(["dx", "dw", "dscale", "dbias"], got, want):
    err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    assert err < 2e-3, (name, err)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_lazy_backward_bf16(norm):
  """bf16 operands: both paths round differently; compare by relative Frobenius error."""
  x, w, scale, bias, ct = _inputs(11, 64, 128, 128, jnp.bfloat16)
  fused, ref = _losses(norm, ct, True, True)
  got = jax.grad(fused, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  for name, g, r in zip(["dx", "dw", "dscale", "dbias"], got, want):
    g, r = g.astype(jnp.float32), r.astype(jnp.float32)
    err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    assert err < 2e-2, (name, err)


def test_fused_forward_and_stats_match_reference():
  x, w, scale, bias, _ = _inputs(5, 40, 64, 128, jnp.float32, mean_offset=2.0)
  y, stats = nm._fused_call(x, w, scale, bias, "layer", 1e-6, jnp.float32, True, "lazy_xla")
  y_ref, stats_ref = reference.norm_matmul(x, w, scale, bias, norm="layer", return_stats=True)
  chex.assert_trees_all_close(y, y_ref, rtol=1e-4, atol=1e-4)
  chex.assert_trees_all_close(stats, stats_ref, rtol=1e-5)


def test_fused_grad_under_jit_equals_eager():
  x, w, scale, bias, ct = _inputs(9, 16, 64, 64, jnp.float32)
  fused, _ = _losses("layer", ct, True, True)
  grad = jax.grad(fused, argnums=(0, 1, 2, 3))
  chex.assert_trees_all_close(jax.jit(grad)(x, w, scale, bias), grad(x, w, scale, bias),
                              rtol=1e-5, atol=1e-6)


def test_leading_dims_are_flattened_and_restored():
  x, w, scale, bias, _ = _inputs(4, 24, 64, 64, jnp.float32)
  x3 = x.reshape(2, 3, 4, 64)
  y = nm._fused_call(x3, w, scale, None, "rms", 1e-6, jnp.float32, False, "lazy_xla")
  chex.assert_shape(y, (2, 3, 4, 64))
  chex.assert_trees_all_close(y, reference.norm_matmul(x3, w, scale, None, norm="rms"),
                              rtol=1e-4, atol=1e-4)
