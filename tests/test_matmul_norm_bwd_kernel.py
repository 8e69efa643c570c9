"""The post-norm backward's norm kernel (:func:`pallas_norm.ops.norms.triton.norm_backward`,
``layer_norm``'s one-pass backward kernel given x̂ and rstd): dh and the column sums in one pass,
against a float64 NumPy oracle of the same math on the same 16-bit inputs; Pallas interpret mode
on the CPU, the GPU at real sizes; and the op's backward around it.

Tolerances: dh is rounded once to the 16-bit output dtype, so its error is at most one rounding
(2⁻⁹ relative for bfloat16, 2⁻¹² for float16) plus float32 sums; the column sums are float32 and
compared at 1e-5 of their largest magnitude.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm.ops.matmul_norm import api as mn
from pallas_norm.ops.matmul_norm import xla as mn_xla
from pallas_norm.ops.norms import triton as norms_triton

ALL_SUMS = ("dscale", "dbias", "ddense")
DH_TOL = {jnp.dtype(jnp.bfloat16): 2 ** -8, jnp.dtype(jnp.float16): 2 ** -10}
SUM_TOL = {"dscale": 1e-5, "dbias": 1e-5, "ddense": 1e-5}


def _inputs(seed, m, n, dtype=jnp.bfloat16, scale=True, dh_out=False):
  """dy, x̂, rstd, scale, dh_out from NumPy's generator (drawn in float32, rounded to ``dtype``):
  JAX's would compile a program per shape."""
  rng = np.random.default_rng(seed)
  dy = jnp.asarray(rng.standard_normal((m, n), np.float32).astype(dtype))
  xhat = jnp.asarray(rng.standard_normal((m, n), np.float32).astype(dtype))
  rstd = jnp.asarray(rng.uniform(0.5, 2.0, m).astype(np.float32))
  s = None
  if scale:  # with zeros: dh must not depend on dividing by the scale
    s = rng.uniform(0.1, 1.0, n).astype(np.float32)
    s[::7] = 0.0
    s = jnp.asarray(s)
  d = jnp.asarray(rng.standard_normal((m, n), np.float32).astype(dtype)) if dh_out else None
  return dy, xhat, rstd, s, d


def _oracle(dy, xhat, rstd, scale, dh_out, norm):
  """float64 dh and the three column sums."""
  dy, xhat = np.asarray(dy, np.float64), np.asarray(xhat, np.float64)
  g = dy if scale is None else dy * np.asarray(scale, np.float64)
  dh = g - xhat * (g * xhat).mean(axis=1, keepdims=True)
  if norm == "layer":
    dh = dh - g.mean(axis=1, keepdims=True)
  dh = dh * np.asarray(rstd, np.float64)[:, None]
  if dh_out is not None:
    dh = dh + np.asarray(dh_out, np.float64)
  return dh, {"dscale": (dy * xhat).sum(0), "dbias": dy.sum(0), "ddense": dh.sum(0)}


# ------------------------------------------------------------------------------------------------
# The op's backward: the kernel where it fits, XLA elsewhere.


def _spy(monkeypatch):
  calls = []
  real = norms_triton.norm_backward

  def spy(*args, **kwargs):
    calls.append(kwargs["sums"])
    return real(*args, **kwargs)

  monkeypatch.setattr(norms_triton, "norm_backward", spy)
  return calls


def _op_pullback(seed, m, k, n, norm):
  """The pullback of one interpret-mode forward of the op with every optional operand and h
  returned (bf16), and random cotangents of (y, h)."""
  ks = jax.random.split(jax.random.key(seed), 8)
  bf = jnp.bfloat16
  x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(bf)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / 8).astype(bf)
  residual = jax.random.normal(ks[2], (m, n), jnp.float32).astype(bf)
  vecs = tuple(jax.random.normal(kk, (n,), jnp.float32) * 0.5 + 1.0 for kk in ks[3:6])

  def op(x, w, residual, dense, scale, bias):
    return mn.matmul_norm(x, w, dense_bias=dense, residual=residual, scale=scale, norm_bias=bias,
                          norm=norm, return_h=True, implementation="interpret")

  _, pullback = jax.vjp(op, x, w, residual, *vecs)
  return pullback, tuple(jax.random.normal(kk, (m, n), jnp.float32).astype(bf) for kk in ks[6:])


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_op_backward_uses_kernel_and_matches_xla_backward(monkeypatch, norm):
  """The op's default backward runs the norm kernel for both norms; against the same forward's
  backward by XLA's passes (what the op runs where the kernel does not take the shape, forced
  here). One forward (jax.vjp), its backward rule run twice."""
  calls = _spy(monkeypatch)
  # The custom_vjp's backward rule runs when the pullback is called, so each call below picks
  # the norm backward anew (kernel first, then XLA's passes).
  pullback, cotangents = _op_pullback(11, 80, 64, 128, norm)
  got = pullback(cotangents)
  assert calls == [ALL_SUMS]
  monkeypatch.setattr(mn, "_norm_backward_kernel_reason", lambda *_: "forced off")
  xla_calls, xla_backward = [], mn_xla.norm_backward
  monkeypatch.setattr(mn_xla, "norm_backward",
                      lambda *a: xla_calls.append(a[-1]) or xla_backward(*a))
  want = pullback(cotangents)
  assert len(calls) == 1 and xla_calls == [ALL_SUMS]
  for i, (g, r) in enumerate(zip(got, want)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    # Both round dh once to bfloat16 for the GEMMs; they differ in float32 summation order.
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 4e-3, i


def test_op_backward_falls_back_where_the_kernel_does_not_fit():
  bf = jnp.bfloat16
  dy = jnp.zeros((13, 8192), bf)  # any M, N up to 8192 with every sum
  assert mn._norm_backward_kernel_reason(dy, None, dy, bf) is None
  assert "at most N" in mn._norm_backward_kernel_reason(jnp.zeros((8, 16384), bf), None,
                                                       jnp.zeros((8, 16384), bf), bf)
  assert "cotangents" in mn._norm_backward_kernel_reason(dy.astype(jnp.float32), None, dy, bf)
  # out_dtype other than x's: the kernel's dh (in the cotangent's dtype) would round twice.
  assert "x in" in mn._norm_backward_kernel_reason(dy, None, dy, jnp.float16)


def test_op_backward_with_float16_output_keeps_xla_and_stays_finite(monkeypatch):
  """x bfloat16, out_dtype float16, a large cotangent: dh exceeds float16's range, so a dh
  written in the cotangent's dtype would be inf (the review's repro); XLA's path rounds the
  float32 dh straight to bfloat16."""
  ks = jax.random.split(jax.random.key(5), 3)
  x = (jax.random.normal(ks[0], (64, 64), jnp.float32) * 1e-3).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (64, 128), jnp.float32) / 8).astype(jnp.bfloat16)
  dy = jax.random.normal(ks[2], (64, 128), jnp.float32) * 100
  calls = _spy(monkeypatch)
  dx = jax.grad(lambda x: jnp.sum(mn.matmul_norm(
      x, w, norm="rms", out_dtype=jnp.float16, implementation="interpret").astype(
          jnp.float32) * dy))(x)
  assert calls == []
  assert np.all(np.isfinite(np.asarray(dx, np.float32)))


# ------------------------------------------------------------------------------------------------
# The kernel alone.


def _run_rows(args, norm, sums, interpret):
  dy, xhat, rstd, scale, dh_out = args
  out = jax.jit(lambda *a: norms_triton.norm_backward(*a, norm=norm, sums=sums,
                                                      interpret=interpret))(
      dy, xhat, rstd, scale, dh_out)
  return jax.block_until_ready(out)


def _check_rows(out, oracle, sums, dtype):
  """The row kernel's (dh, {name: column sum}) against the float64 oracle (same tolerances)."""
  dh, got_sums = out
  assert dh.dtype == jnp.dtype(dtype) and sorted(got_sums) == sorted(sums)
  dh = np.asarray(dh, np.float64)
  assert np.all(np.isfinite(dh))  # an unwritten element would be NaN in interpret mode
  err = np.max(np.abs(dh - oracle[0])) / np.max(np.abs(oracle[0]))
  assert err < DH_TOL[jnp.dtype(dtype)], err
  for name in sums:
    want = oracle[1][name]
    assert got_sums[name].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got_sums[name], np.float64), want,
                               atol=SUM_TOL[name] * np.max(np.abs(want)), err_msg=name)


@pytest.mark.parametrize("m,n,norm,scale,dh_out,sums,dtype", [
    (1, 64, "rms", False, False, (), jnp.bfloat16),  # one row
    (77, 192, "layer", True, True, ALL_SUMS, jnp.bfloat16),  # N not a power of 2, tail rows
    (300, 128, "rms", True, False, ("dscale",), jnp.bfloat16),
    (130, 128, "layer", False, True, ("ddense", "dbias"), jnp.float16),  # the order asked for
    (40, 64, "layer", True, False, (), jnp.bfloat16),  # a scale without its sum
])
def test_row_kernel_interpret_matches_oracle(m, n, norm, scale, dh_out, sums, dtype):
  args = _inputs(m + n + 1, m, n, dtype, scale=scale, dh_out=dh_out)
  _check_rows(_run_rows(args, norm, sums, interpret=True), _oracle(*args, norm), sums, dtype)


def test_row_kernel_refuses_what_it_cannot_run():
  bf = jnp.bfloat16
  dy = jnp.zeros((8, 64), bf)
  with pytest.raises(ValueError, match="norm must be"):
    norms_triton.norm_backward(dy, dy, jnp.ones((8,)), norm="batch")
  with pytest.raises(ValueError, match="sums must be"):
    norms_triton.norm_backward(dy, dy, jnp.ones((8,)), norm="rms", sums=("dgamma",))
  assert "at most N" in norms_triton.saved_stats_unsupported_reason(8, 16384, bf)
  assert "float64" in norms_triton.saved_stats_unsupported_reason(8, 64, jnp.float64)
  assert norms_triton.saved_stats_unsupported_reason(8, 8192, bf) is None


def test_row_kernel_column_sums_keep_float32_accuracy():
  """Σ dy ⊙ x̂ from float32 products of the 16-bit inputs: float32-accurate where a bf16 rounding
  of the products would not be ((1 + 2⁻⁷)(1 + 2⁻⁶) = 1.02355957 rounds to 1.0234375 in bf16)."""
  m, n = 256, 64
  dy = jnp.full((m, n), 1 + 2 ** -7, jnp.bfloat16)
  xhat = jnp.full((m, n), 1 + 2 ** -6, jnp.bfloat16)
  _, sums = norms_triton.norm_backward(dy, xhat, jnp.ones((m,), jnp.float32), norm="rms",
                                       sums=("dscale",), interpret=True)
  want = m * (1 + 2 ** -7) * (1 + 2 ** -6)  # exact in float64
  np.testing.assert_allclose(np.asarray(sums["dscale"], np.float64), want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# GPU.


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,norm,scale,dh_out,sums", [
    (262144, 512, "layer", True, True, ALL_SUMS),
    (262144, 2048, "rms", True, False, ("dscale",)),
    (8192 + 77, 1024, "layer", True, False, ALL_SUMS),
    (3, 8192, "rms", False, True, ("ddense",)),
])
def test_gpu_row_kernel_matches_oracle(m, n, norm, scale, dh_out, sums):
  args = _inputs(m, m, n, scale=scale, dh_out=dh_out)
  out = _run_rows(args, norm, sums, interpret=False)
  again = _run_rows(args, norm, sums, interpret=False)
  _check_rows(out, _oracle(*args, norm), sums, jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(again)):  # deterministic bits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("use_y,use_h,norm", [(True, False, "rms"), (False, True, "layer")])
def test_unused_output_gives_no_cotangent_array(monkeypatch, use_y, use_h, norm):
  """return_h=True with h (or y) unused in the loss: the backward gets a symbolic zero, so the
  kernel reads no M × N array of zeros (dh_out is None), and the gradients of x, w, scale and
  norm_bias match XLA's (with y unused, dscale and dbias are exactly zero in both)."""
  m, k, n = 64, 64, 128
  ks = jax.random.split(jax.random.key(21), 5)
  x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / 8).astype(jnp.bfloat16)
  scale = jax.random.uniform(ks[2], (n,), jnp.float32, 0.5, 1.5)
  norm_bias = 0.1 * jax.random.normal(ks[4], (n,), jnp.float32)
  ct = jax.random.normal(ks[3], (m, n), jnp.float32)
  seen = []
  real = norms_triton.norm_backward

  def spy(dy, xhat, rstd, scale=None, dh_out=None, **kwargs):
    seen.append(dh_out)
    return real(dy, xhat, rstd, scale, dh_out, **kwargs)

  monkeypatch.setattr(norms_triton, "norm_backward", spy)

  def loss(x, w, scale, norm_bias, impl):
    y, h = mn.matmul_norm(x, w, scale=scale, norm_bias=norm_bias, norm=norm, return_h=True,
                          implementation=impl)
    total = jnp.sum(y.astype(jnp.float32) * ct) if use_y else 0.0
    return total + (jnp.sum(h.astype(jnp.float32) * ct) if use_h else 0.0)

  # Jitted: one program per implementation instead of one compile per eager op.
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
  got = grad(x, w, scale, norm_bias, "interpret")
  assert len(seen) == 1 and (seen[0] is not None) == use_h
  want = grad(x, w, scale, norm_bias, "xla")
  for g, r in zip(got, want):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    assert np.all(np.isfinite(g))
    assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r)
