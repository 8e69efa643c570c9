"""The lazy backward of norm_matmul (custom_vjp, DESIGN.md op 1) against JAX's autodiff of the
reference. Most tests use the kernels' math in XLA ("lazy_xla"), so they pin the backward
identities independently of the Mosaic kernels; the last ones run the public API with
``implementation="interpret"`` (forward kernel + dx kernel in GPU interpret mode on the CPU) and
compare forward and gradients with ``implementation="xla"`` and the f32 reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
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


@pytest.mark.parametrize("dtype,mean_offset", [(jnp.bfloat16, 100.0), (jnp.bfloat16, 250.0),
                                               (jnp.float16, 250.0)])
def test_lazy_backward_16bit_large_row_mean(dtype, mean_offset):
  """16-bit rows of mean 100-250 and unit spread: dW_γ = xᵀ(rstd ⊙ dy) − 1 ⊗ Σ rstd·mean·dy has
  two large terms that must cancel; the rank-1 term is built from the same rounded rstd ⊙ dy as
  the GEMM (a fresh-eyes review found 15-44% errors in dw and dscale when it was not). Compared
  with the f32 reference's gradients of the same 16-bit values."""
  x, w, scale, bias, ct = _inputs(13, 64, 128, 128, dtype, mean_offset=mean_offset)
  fused, ref = _losses("layer", ct, True, True)
  got = jax.grad(fused, argnums=(0, 1, 2, 3))(x, w, scale, bias)
  f32 = [a.astype(jnp.float32) for a in (x, w, scale, bias)]
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(*f32)
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


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("m,k,n,norm,use_affine", [(77, 128, 192, "layer", True),
                                                   (64, 64, 128, "rms", False)])
def test_public_api_interpret_matches_xla(monkeypatch, m, k, n, norm, use_affine):
  """pallas_norm.norm_matmul(implementation="interpret"): y and (dx, dw, dscale, dbias) within
  bf16 tolerance (relative Frobenius 2e-2; y 1e-2) of implementation="xla" and of the f32
  reference. Forward and backward each run once (jax.vjp): interpret mode is slow. The row
  terms come from the XLA pass here (FUSED_ROW_TERMS off; the LayerNorm default at these sizes
  is the fused path, which test_public_api_interpret_fused_row_terms covers)."""
  monkeypatch.setattr(nm, "FUSED_ROW_TERMS", False)
  x, w, scale, bias, ct = _inputs(21 + m, m, k, n, jnp.bfloat16)
  scale, bias = (scale, bias) if use_affine else (None, None)
  ct = ct.astype(jnp.bfloat16)

  def op(implementation):
    return lambda x, w, s, b: pallas_norm.norm_matmul(x, w, s, b, norm=norm,
                                                      implementation=implementation)

  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.norm_matmul(*a, norm=norm), *f32((x, w)),
                           scale, bias)
  grads_ref = vjp_ref(ct.astype(jnp.float32))
  for impl in ("interpret", "xla"):
    y, vjp = jax.vjp(op(impl), x, w, scale, bias)
    grads = vjp(ct)
    assert y.dtype == jnp.bfloat16 and _rel(y, y_ref) < 1e-2, impl
    if impl == "interpret":
      y_interp, grads_interp = y, grads
      assert bool(jnp.all(jnp.isfinite(y))), "the forward kernel left outputs unwritten"
  assert _rel(y_interp, y) < 1e-2
  names = ["dx", "dw", "dscale", "dbias"]
  for name, g, g_xla, g_ref in zip(names, grads_interp, grads, grads_ref):
    if g_ref is None:
      assert g is None and g_xla is None, name
      continue
    assert g.dtype == g_xla.dtype, name
    assert _rel(g, g_xla) < 2e-2, (name, _rel(g, g_xla))
    assert _rel(g, g_ref) < 2e-2, (name, _rel(g, g_ref))


def _check_against_f32_reference(y, grads, x, w, scale, bias, ct, norm):
  """y within 1e-2 and each gradient (dx, dw, dscale, dbias) finite, within 2e-2 of the largest
  entry of the f32 reference's elementwise, and within 2e-2 relative (Frobenius)."""
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.norm_matmul(*a, norm=norm), f32(x), f32(w),
                           scale, bias)
  assert _rel(y, y_ref) < 1e-2
  grads_ref = vjp_ref(f32(ct))
  chex.assert_trees_all_equal_shapes(grads, grads_ref)
  for name, g, r in zip(["dx", "dw", "dscale", "dbias"], grads, grads_ref):
    assert bool(jnp.all(jnp.isfinite(g))), name
    top = float(jnp.max(jnp.abs(r)))
    chex.assert_trees_all_close(f32(g) / top, r / top, atol=2e-2, rtol=0, custom_message=name)
    assert _rel(g, r) < 2e-2, (name, _rel(g, r))


FUSED_WITH_GUARD = ["y_term", "y"]
"""The dx kernel calls traced for fused row terms when the norm has a bias: lax.cond traces the
bias-cancellation guard's exact branch (row terms given) and then the fused one (y given); at
run time only one runs."""


def _traced(expected, with_bias=True):
  """``expected`` kernel calls as traced: a fused call ["y"] comes with the guard's branch."""
  return FUSED_WITH_GUARD if with_bias and expected == ["y"] else expected


def _spy_on_dx_kernel(monkeypatch, run_kernel=True, dy_scaled_flags=None):
  """Replaces norm_matmul_dx by a wrapper that records which row-term inputs each call got:
  "y" (fused row terms) or "y_term" (the XLA pass), and its ``return_dy_scaled`` in
  ``dy_scaled_flags`` (a list) when given; without ``run_kernel`` it returns zeros."""
  from pallas_norm.ops import norm_matmul_bwd_mgpu as nmb
  calls, real = [], nmb.norm_matmul_dx

  def spy(dy, w_gamma, x, *args, **kwargs):
    calls.append("y" if kwargs.get("y") is not None else "y_term")
    if dy_scaled_flags is not None:
      dy_scaled_flags.append(kwargs.get("return_dy_scaled", False))
    if run_kernel:
      return real(dy, w_gamma, x, *args, **kwargs)
    if kwargs.get("return_dy_scaled"):
      return jnp.zeros_like(x), jnp.zeros(dy.shape, x.dtype)
    return jnp.zeros_like(x)

  monkeypatch.setattr(nmb, "norm_matmul_dx", spy)
  return calls


@pytest.mark.parametrize("m,k,n,norm", [(77, 128, 192, "layer"), (64, 64, 128, "rms")])
def test_public_api_interpret_fused_row_terms(monkeypatch, m, k, n, norm):
  """norm_matmul.FUSED_ROW_TERMS on: pallas_norm.norm_matmul(implementation="interpret") takes
  the dx kernel's fused row terms (the kernel gets y, not y_term) and its gradients match the
  f32 reference's (each within 2e-2 of the largest reference entry, elementwise; relative
  Frobenius < 2e-2, as the XLA row-terms path above)."""
  monkeypatch.setattr(nm, "FUSED_ROW_TERMS", True)
  calls = _spy_on_dx_kernel(monkeypatch)
  x, w, scale, bias, ct = _inputs(31 + m, m, k, n, jnp.bfloat16)
  ct = ct.astype(jnp.bfloat16)
  op = lambda *a: pallas_norm.norm_matmul(*a, norm=norm, implementation="interpret")
  y, vjp = jax.vjp(op, x, w, scale, bias)
  grads = vjp(ct)
  assert calls == FUSED_WITH_GUARD
  _check_against_f32_reference(y, grads, x, w, scale, bias, ct, norm)


@pytest.mark.parametrize("flag,implementation,y_dtype,expected", [
    (False, "interpret", jnp.bfloat16, ["y_term"]),
    (None, "interpret", jnp.bfloat16, ["y"]),  # by shape: LayerNorm, K = N = 64 <= 512
    (None, "interpret", jnp.float32, ["y_term"]),
    (True, "interpret", jnp.bfloat16, ["y"]),
    (True, "mosaic", jnp.bfloat16, ["y"]),
    (True, "interpret", jnp.float32, ["y_term"]),  # out_dtype f32: y not in x's dtype
    (True, "lazy_xla", jnp.bfloat16, []),  # the reference math never calls the kernel
])
def test_input_grad_row_terms_switch(monkeypatch, flag, implementation, y_dtype, expected):
  """Which row-term path _input_grad takes under the module switch (no kernel runs)."""
  _check_row_terms_route(monkeypatch, flag, implementation, y_dtype, expected, 64, 64)


@pytest.mark.parametrize("k,n,norm,expected", [
    (512, 512, "layer", ["y"]), (512, 1024, "layer", ["y_term"]), (1024, 512, "layer", ["y_term"]),
    (128, 256, "layer", ["y"]), (512, 512, "rms", ["y_term"]), (128, 128, "rms", ["y_term"])])
def test_row_terms_default_by_shape(monkeypatch, k, n, norm, expected):
  """FUSED_ROW_TERMS = None: fused for LayerNorm up to K, N <= FUSED_ROW_TERMS_MAX_KN (measured
  faster at 512², slower at 2048²), never for RMSNorm (slower in the whole backward)."""
  _check_row_terms_route(monkeypatch, None, "mosaic", jnp.bfloat16, expected, k, n, norm)


def _check_row_terms_route(monkeypatch, flag, implementation, y_dtype, expected, k, n,
                           norm="layer"):
  monkeypatch.setattr(nm, "FUSED_ROW_TERMS", flag)
  calls = _spy_on_dx_kernel(monkeypatch, run_kernel=False)
  m = 16
  x, w, scale, bias, ct = _inputs(3, m, k, n, jnp.bfloat16)
  w_gamma, col_sum, out_bias = nm.fold_affine(w, scale, bias, norm)
  y = jnp.ones((m, n), y_dtype)
  rows = jnp.ones((m,), jnp.float32)
  dx, dy_scaled = nm._input_grad(implementation, ct.astype(y_dtype), x, w_gamma, col_sum,
                                 out_bias, y, None if norm == "rms" else rows, rows)
  assert calls == _traced(expected) and dx.shape == x.shape and dy_scaled is None


@pytest.mark.parametrize("m,k,n,norm", [(77, 128, 192, "layer"), (64, 64, 128, "rms")])
def test_public_api_interpret_dx_writes_dy_scaled(monkeypatch, m, k, n, norm):
  """norm_matmul.DX_WRITES_DY_SCALED on: the dx kernel (fused row terms for this LayerNorm
  call, given ones for RMSNorm) returns dy_scaled and the weight gradients use it. The
  gradients match the f32 reference's as the other paths do, and the weight gradients equal
  bit for bit those XLA computes from its own dy_scaled (the kernel's values are XLA's)."""
  monkeypatch.setattr(nm, "DX_WRITES_DY_SCALED", True)
  flags = []
  calls = _spy_on_dx_kernel(monkeypatch, dy_scaled_flags=flags)
  x, w, scale, bias, ct = _inputs(41 + m, m, k, n, jnp.bfloat16)
  ct = ct.astype(jnp.bfloat16)
  op = lambda *a: pallas_norm.norm_matmul(*a, norm=norm, implementation="interpret",
                                          return_stats=True)
  (y, stats), vjp = jax.vjp(op, x, w, scale, bias)
  grads = vjp((ct, jax.tree.map(jnp.zeros_like, stats)))
  assert calls == _traced(["y"] if norm == "layer" else ["y_term"]) and all(flags)
  _check_against_f32_reference(y, grads, x, w, scale, bias, ct, norm)
  xla_weight_grads = nm._weight_grads(ct, x, w, scale, bias, stats.mean, stats.rstd)
  chex.assert_trees_all_equal(tuple(grads[1:]), xla_weight_grads)


@pytest.mark.parametrize("flag,fused,implementation,dy_dtype,expected", [
    (False, False, "interpret", jnp.bfloat16, [False]),
    (False, True, "interpret", jnp.bfloat16, [False]),
    (True, False, "interpret", jnp.bfloat16, [True]),
    (True, True, "interpret", jnp.bfloat16, [True]),
    (True, False, "mosaic", jnp.bfloat16, [True]),
    (True, True, "mosaic", jnp.bfloat16, [True]),
    (True, False, "interpret", jnp.float32, [False]),  # dy not in x's dtype: XLA's pass
    (True, False, "lazy_xla", jnp.bfloat16, []),  # the reference math never calls the kernel
])
def test_input_grad_dy_scaled_switch(monkeypatch, flag, fused, implementation, dy_dtype,
                                     expected):
  """Which calls ask the dx kernel for dy_scaled under DX_WRITES_DY_SCALED, on both row-term
  paths (no kernel runs), and that _input_grad hands it on (None where XLA computes it)."""
  monkeypatch.setattr(nm, "DX_WRITES_DY_SCALED", flag)
  monkeypatch.setattr(nm, "FUSED_ROW_TERMS", fused)
  flags = []
  _spy_on_dx_kernel(monkeypatch, run_kernel=False, dy_scaled_flags=flags)
  m, k, n = 16, 64, 64
  x, w, scale, bias, ct = _inputs(5, m, k, n, jnp.bfloat16)
  w_gamma, col_sum, out_bias = nm.fold_affine(w, scale, bias, "layer")
  rows = jnp.ones((m,), jnp.float32)
  dx, dy_scaled = nm._input_grad(implementation, ct.astype(dy_dtype), x, w_gamma, col_sum,
                                 out_bias, jnp.ones((m, n), jnp.bfloat16), rows, rows)
  traced = 2 if fused and implementation != "lazy_xla" and dy_dtype == jnp.bfloat16 else 1
  assert flags == expected * traced and dx.shape == x.shape
  if expected == [True]:
    assert dy_scaled.shape == (m, n) and dy_scaled.dtype == x.dtype
  else:
    assert dy_scaled is None


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_weight_grads_take_the_given_dy_scaled(norm):
  """_weight_grads uses a given dy_scaled (the GEMM and the LayerNorm rank-1 term) instead of
  recomputing it, and gives XLA's own result when handed XLA's values (no other input
  changes)."""
  m, k, n = 32, 64, 64
  x, w, scale, bias, ct = _inputs(6, m, k, n, jnp.bfloat16)
  dy = ct.astype(jnp.bfloat16)
  mean = None if norm == "rms" else jnp.full((m,), 0.5, jnp.float32)
  rstd = jnp.linspace(0.5, 2.0, m, dtype=jnp.float32)
  own = nm._weight_grads(dy, x, w, scale, None, mean, rstd)
  xla_values = (rstd[:, None] * dy.astype(jnp.float32)).astype(x.dtype)
  chex.assert_trees_all_equal(nm._weight_grads(dy, x, w, scale, None, mean, rstd, xla_values),
                              own)
  dw, dscale, _ = nm._weight_grads(dy, x, w, scale, None, mean, rstd, jnp.zeros_like(dy))
  assert float(jnp.max(jnp.abs(dw.astype(jnp.float32)))) == 0.0
  assert float(jnp.max(jnp.abs(dscale))) == 0.0
  # dbias reads dy itself (the column sums), not dy_scaled.
  _, _, dbias = nm._weight_grads(dy, x, w, scale, bias, mean, rstd, jnp.zeros_like(dy))
  chex.assert_trees_all_equal(dbias, nm._weight_grads(dy, x, w, scale, bias, mean, rstd)[2])


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096 + 77, 512, 512), (16384, 1024, 320)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gpu_public_api_gradients(m, k, n, norm):
  """implementation="mosaic" (both kernels compiled) against the f32 reference's gradients."""
  x, w, scale, bias, ct = _inputs(m + n, m, k, n, jnp.bfloat16)
  ct = ct.astype(jnp.bfloat16)
  op = lambda *a: pallas_norm.norm_matmul(*a, norm=norm, implementation="mosaic")
  y, vjp = jax.vjp(op, x, w, scale, bias)
  grads = vjp(ct)
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.norm_matmul(*a, norm=norm), f32(x), f32(w),
                           scale, bias)
  assert _rel(y, y_ref) < 1e-2
  for name, g, g_ref in zip(["dx", "dw", "dscale", "dbias"], grads, vjp_ref(f32(ct))):
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _rel(g, g_ref) < 2e-2, (name, _rel(g, g_ref))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096 + 77, 512, 512), (16384, 1024, 320)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gpu_public_api_gradients_fused_row_terms(monkeypatch, m, k, n, norm):
  """As above, with norm_matmul.FUSED_ROW_TERMS on (dx's row terms in the dx kernel)."""
  monkeypatch.setattr(nm, "FUSED_ROW_TERMS", True)
  calls = _spy_on_dx_kernel(monkeypatch)
  test_gpu_public_api_gradients(m, k, n, norm)
  assert calls == FUSED_WITH_GUARD


def test_default_implementation_prefers_xla_where_the_kernel_is_measured_slower(monkeypatch):
  """implementation=None on a Hopper GPU: the kernel only at shapes where it was measured faster."""
  from pallas_norm import _dispatch
  from pallas_norm.ops import matmul_norm as mn
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  ok = lambda _: None  # noqa: E731  (the kernel supports the call)
  pick = lambda reason: _dispatch.choose("op", None, ok, lambda: reason)
  # Thresholds from the H200's forward+backward measurements, per norm.
  assert pick(nm._kernel_slower_reason(512, 512, "rms")) == "mosaic"
  assert pick(nm._kernel_slower_reason(1024, 1024, "rms")) == "mosaic"
  assert pick(nm._kernel_slower_reason(512, 2048, "rms")) == "xla"
  assert pick(nm._kernel_slower_reason(1024, 1024, "layer")) == "mosaic"
  assert pick(nm._kernel_slower_reason(2048, 512, "layer")) == "xla"
  assert pick(mn._kernel_slower_reason(128, "rms")) == "mosaic"
  assert pick(mn._kernel_slower_reason(512, "rms")) == "mosaic"
  assert pick(mn._kernel_slower_reason(1024, "rms")) == "xla"
  assert pick(mn._kernel_slower_reason(1024, "layer")) == "mosaic"
  assert pick(mn._kernel_slower_reason(2048, "layer")) == "mosaic"
  assert pick(mn._kernel_slower_reason(4096, "layer")) == "xla"
  # An explicit request is honoured even where the kernel is slower.
  assert _dispatch.choose("op", "mosaic", ok, lambda: "slower") == "mosaic"


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_returned_stats_carry_no_gradient_on_any_path(op):
  """The fused paths return statistics through lax.stop_gradient; the XLA path must too, or the
  same loss would differentiate differently on a CPU and on a Hopper GPU (review finding)."""
  from pallas_norm.ops import matmul_norm as mn
  x, w, scale, bias, _ = _inputs(21, 16, 64, 64, jnp.float32, mean_offset=1.0)

  def loss(x, with_stats):
    if op == "norm_matmul":
      y, stats = nm.norm_matmul(x, w, scale, bias, norm="layer", return_stats=True,
                                implementation="xla")
    else:
      y, stats = mn.matmul_norm(x, w, None, None, scale[:64], bias[:64], norm="layer",
                                return_stats=True, implementation="xla")
    total = jnp.sum(y * y)
    return total + jnp.sum(stats.rstd) + jnp.sum(stats.mean) if with_stats else total

  chex.assert_trees_all_close(jax.grad(loss)(x, True), jax.grad(loss)(x, False), rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(8192, 512, 512), (8192 + 77, 1024, 1024)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gpu_public_api_gradients_dx_writes_dy_scaled(monkeypatch, m, k, n, norm):
  """As test_gpu_public_api_gradients, with norm_matmul.DX_WRITES_DY_SCALED on (the dx kernel
  writes rstd ⊙ dy for the weight gradients)."""
  monkeypatch.setattr(nm, "DX_WRITES_DY_SCALED", True)
  flags = []
  _spy_on_dx_kernel(monkeypatch, dy_scaled_flags=flags)
  test_gpu_public_api_gradients(m, k, n, norm)
  assert flags and all(flags)  # two traced calls where the bias guard adds a lax.cond branch


@pytest.mark.parametrize("norm,scale_size,bias_size", [
    ("layer", 1e-3, 1.0),   # review finding: dx was 28% off (fused row terms)
    ("rms", 1e-3, 1.0),     # the XLA row-terms pass
    ("layer", 0.0, 1.0),    # a zero scale: the true dx is exactly 0
    ("layer", 1.0, 100.0),  # a large bias, ratio ~100: was 1.3% off
])
def test_dx_stays_accurate_when_the_bias_dwarfs_the_scale(norm, scale_size, bias_size):
  """y' = y − βᵀW rebuilt from the rounded y cancels when |βᵀW| ≫ ‖W_γ[:, j]‖; past
  BIAS_CANCELLATION_LIMIT the backward recomputes y' exactly, so dx stays as accurate as XLA's."""
  x, w, _, _, ct = _inputs(31, 64, 128, 128, jnp.bfloat16)
  ks = jax.random.split(jax.random.key(32), 2)
  scale = scale_size * (1.0 + 0.1 * jax.random.normal(ks[0], (128,), jnp.float32))
  bias = bias_size * jax.random.normal(ks[1], (128,), jnp.float32)
  w_gamma, out_bias = scale[:, None] * w.astype(jnp.float32), bias @ w.astype(jnp.float32)
  assert float(nm.bias_cancellation(w_gamma, out_bias)) > nm.BIAS_CANCELLATION_LIMIT
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  _, vjp_ref = jax.vjp(lambda x: reference.norm_matmul(x, f32(w), scale, bias, norm=norm), f32(x))
  (dx_ref,) = vjp_ref(ct)
  _check_dx_accuracy_under_bias_cancellation(x, w, scale, bias, ct, norm, scale_size, dx_ref,
                                             ("interpret", "lazy_xla"))


def _check_dx_accuracy_under_bias_cancellation(x, w, scale, bias, ct, norm, scale_size, dx_ref,
                                               impls):
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  for impl in impls:
    _, vjp = jax.vjp(lambda x: nm._fused_call(x, w, scale, bias, norm, 1e-6, x.dtype, False,
                                              impl), x)
    (dx,) = vjp(ct.astype(jnp.bfloat16))
    if scale_size == 0.0:
      assert float(jnp.max(jnp.abs(f32(dx)))) == 0.0, impl
    else:
      assert _rel(dx, dx_ref) < 1e-2, (impl, _rel(dx, dx_ref))


def test_bias_cancellation_is_small_for_usual_parameters():
  """The guard's extra GEMM runs only for unusual parameters: a unit scale with a bias of 0.3
  (these tests' inputs) or of 1 stays far below the limit."""
  _, w, scale, bias, _ = _inputs(33, 8, 512, 512, jnp.bfloat16)
  wf = w.astype(jnp.float32)
  for b in (bias, bias / 0.3):
    assert float(nm.bias_cancellation(scale[:, None] * wf, b @ wf)) < nm.BIAS_CANCELLATION_LIMIT / 4


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gpu_dx_stays_accurate_when_the_bias_dwarfs_the_scale(norm):
  """The lax.cond of the bias-cancellation guard around the dx kernel, on the GPU."""
  x, w, _, _, ct = _inputs(34, 4096 + 77, 512, 512, jnp.bfloat16)
  ks = jax.random.split(jax.random.key(35), 2)
  scale = 1e-3 * (1.0 + 0.1 * jax.random.normal(ks[0], (512,), jnp.float32))
  bias = jax.random.normal(ks[1], (512,), jnp.float32)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  _, vjp_ref = jax.vjp(lambda x: reference.norm_matmul(x, f32(w), scale, bias, norm=norm), f32(x))
  (dx_ref,) = vjp_ref(ct)
  _check_dx_accuracy_under_bias_cancellation(x, w, scale, bias, ct, norm, 1e-3, dx_ref,
                                             ("mosaic",))
