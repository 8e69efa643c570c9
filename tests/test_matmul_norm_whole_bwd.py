"""The post-norm op's whole backward as one kernel at K = N = 128
(:func:`pallas_norm.ops.matmul_norm.mosaic_bwd.backward`: h recomputed from x, dh, dx, dw and the
column sums from x, dy and the forward's statistics), against a float64 NumPy oracle of the same
math on the same 16-bit inputs (interpret mode on the CPU; the GPU at real sizes), and the op's
route to it.

Tolerances: relative Frobenius 1e-2 for dx, dw and dscale (x̂ is rounded to the 16-bit dtype as
the forward's saved x̂ of the row-kernel path is, and dh once more on its way to the GEMMs),
1e-6 for dbias (float32 sums of the 16-bit dy).
"""

import jax
import jax.numpy as jnp
from jax import export
import numpy as np
import pytest

import pallas_norm
from pallas_norm import mgpu, reference
from pallas_norm.ops.matmul_norm import api as mn
from pallas_norm.ops.matmul_norm import mosaic_bwd as mb

K = N = mb.WIDTH


def _inputs(seed, m, dtype=jnp.bfloat16, mean_offset=0.0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray((rng.standard_normal((m, K)) + mean_offset).astype(np.float32).astype(dtype))
  w = jnp.asarray((rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32).astype(dtype))
  dy = jnp.asarray(rng.standard_normal((m, N)).astype(np.float32).astype(dtype))
  scale = rng.uniform(0.1, 1.5, N).astype(np.float32)
  scale[::9] = 0.0  # zeros: nothing divides by the scale
  return x, w, dy, jnp.asarray(scale)


def _oracle(x, w, dy, scale, norm, eps=1e-6, residual=None, dense_bias=None):
  """float64 (dx, dw, dscale, dbias, d(residual) = dh, d(dense_bias)) and the forward's float32
  statistics (mean or None, rstd)."""
  xf, wf, dyf = (np.asarray(a, np.float64) for a in (x, w, dy))
  h = xf @ wf
  if dense_bias is not None:
    h = h + np.asarray(dense_bias, np.float64)
  if residual is not None:
    h = h + np.asarray(residual, np.float64)
  mean = h.mean(1) if norm == "layer" else np.zeros(len(h))
  var = ((h - mean[:, None]) ** 2).mean(1) if norm == "layer" else (h ** 2).mean(1)
  rstd = 1.0 / np.sqrt(var + eps)
  x_hat = (h - mean[:, None]) * rstd[:, None]
  g = dyf if scale is None else dyf * np.asarray(scale, np.float64)
  d = g - x_hat * (g * x_hat).mean(1, keepdims=True)
  if norm == "layer":
    d = d - g.mean(1, keepdims=True)
  dh = d * rstd[:, None]
  want = (dh @ wf.T, xf.T @ dh, (dyf * x_hat).sum(0), dyf.sum(0), dh, dh.sum(0))
  stats = (jnp.asarray(mean, jnp.float32) if norm == "layer" else None,
           jnp.asarray(rstd, jnp.float32))
  return want, stats


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check(m, norm, *, scale=True, dtype=jnp.bfloat16, mean_offset=0.0, interpret=True, seed=0,
           residual=False, dense_bias=False):
  x, w, dy, s = _inputs(seed, m, dtype, mean_offset)
  s = s if scale else None
  res = None
  if residual:
    rng = np.random.default_rng(seed + 7)
    res = jnp.asarray((2 * rng.standard_normal((m, N)) + 1).astype(np.float32).astype(dtype))
  bias = jnp.asarray(np.linspace(-1, 1, N), jnp.float32) if dense_bias else None
  want, (mean, rstd) = _oracle(x, w, dy, s, norm, residual=res, dense_bias=bias)
  got = jax.block_until_ready(jax.jit(lambda *a: mb.backward(*a, interpret=interpret))(
      x, w, dy, rstd, mean, s, res, bias))
  if interpret:
    assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  *got, dres, ddense = got
  if dense_bias:  # Σ_i dh of dh in x's dtype: its rounding, relative to Σ_i |dh|
    scale_dh = np.abs(want[4]).sum(0)
    np.testing.assert_array_less(np.abs(np.asarray(ddense, np.float64) - want[5]),
                                 4e-3 * scale_dh + 1e-6)
  else:
    assert ddense is None
  if residual:
    assert dres.shape == (m, N) and dres.dtype == x.dtype
    assert _rel(dres, want[4]) < 1e-2, _rel(dres, want[4])
  else:
    assert dres is None
  dx, dw, dscale, dbias = got
  assert dx.shape == (m, K) and dx.dtype == x.dtype
  assert dw.shape == (K, N) and dw.dtype == jnp.float32
  for name, g in zip(("dx", "dw", "dscale", "dbias"), got):
    assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name}: unwritten (NaN-filled) output"
  for name, g, r, tol in zip(("dx", "dw", "dscale"), got, want, (1e-2, 1e-2, 1e-2)):
    assert _rel(g, r) < tol, (name, _rel(g, r))
  np.testing.assert_allclose(np.asarray(dbias), want[3], rtol=0,
                             atol=1e-6 * float(np.abs(np.asarray(dy, np.float64)).sum(0).max()))


# Interpret mode runs 2 CTAs: 1000 rows give each several row blocks (the ring's
# stages reused, the dh tile and the barriers across blocks), 136 a partial last block, 8 one
# block mostly past M; float16 rows of mean 1e3.
@pytest.mark.parametrize("m,norm,scale,dtype,mean_offset,residual", [
    (1000, "rms", True, jnp.bfloat16, 0.0, False),
    (136, "rms", False, jnp.bfloat16, 0.0, False),
    (8, "layer", True, jnp.float16, 1e3, False),
    # a residual: loaded into the dh rows, for the CTA's next block at the end of the one before
    (1000, "layer", True, jnp.bfloat16, 0.0, True),
    (136, "rms", True, jnp.float16, 0.0, True),
])
def test_whole_backward_interpret_matches_oracle(m, norm, scale, dtype, mean_offset, residual):
  _check(m, norm, scale=scale, dtype=dtype, mean_offset=mean_offset, residual=residual)


@pytest.mark.parametrize("m,norm,residual", [(600, "layer", True), (8, "rms", False)])
def test_whole_backward_with_a_dense_bias(m, norm, residual):
  """h = x w + dense_bias (+ residual): the bias in h, Σ_i dh its gradient (a third column
  sum, from the dh tile)."""
  _check(m, norm, residual=residual, dense_bias=True)


def test_whole_backward_float16_dscale_of_large_cotangents():
  """float16 cotangents of ±4e4 on two equal rows: dscale's products dy ⊙ x̂ pass float16's
  range (a review's reproducer: rounded to float16 before their sum they gave ±inf, then NaN);
  the kernel multiplies in f32, as the row-kernel path does."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, K))
  x[1] = x[0]
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  dy = 0.01 * rng.standard_normal((8, N))
  dy[0], dy[1] = 4e4, -4e4
  x, w, dy = (jnp.asarray(a.astype(np.float16)) for a in (x, w, dy))
  want, (mean, rstd) = _oracle(x, w, dy, None, "layer")
  _, _, dscale, _, _, _ = mb.backward(x, w, dy, rstd, mean, interpret=True)
  assert np.isfinite(np.asarray(dscale)).all()
  # f32 sums of terms up to ~4e5 that cancel to ~0.1: a few f32 ulps of Σ |dy ⊙ x̂| per column
  # (the true x̂: rows 0 and 1 round to the same x̂ in both).
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  h = xf @ wf
  x_hat = (h - h.mean(1, keepdims=True)) / np.sqrt(h.var(1, keepdims=True) + 1e-6)
  scale = np.abs(np.asarray(dy, np.float64) * x_hat).sum(0)
  np.testing.assert_array_less(np.abs(np.asarray(dscale, np.float64) - want[2]), 1e-6 * scale)


def test_whole_backward_refuses_what_it_cannot_run():
  assert mb.unsupported_reason(262144, 128, 128, jnp.bfloat16) is None
  assert "K = N = 128" in mb.unsupported_reason(262144, 256, 128, jnp.bfloat16)
  assert "K = N = 128" in mb.unsupported_reason(262144, 128, 64, jnp.bfloat16)
  assert "bfloat16 or float16" in mb.unsupported_reason(262144, 128, 128, jnp.float32)
  assert "multiple of 8" in mb.unsupported_reason(77, 128, 128, jnp.bfloat16)
  x, w, dy, s = _inputs(0, 16)
  r = jnp.ones((16,), jnp.float32)
  with pytest.raises(ValueError, match="K = N = 128"):
    mb.backward(x[:, :64], w[:64], dy, r, interpret=True)
  with pytest.raises(ValueError, match="in x's dtype"):
    mb.backward(x, w, dy.astype(jnp.float16), r, interpret=True)
  with pytest.raises(ValueError, match="residual"):
    mb.backward(x, w, dy, r, residual=dy.astype(jnp.float16), interpret=True)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_whole_backward_lowers_for_hopper(norm):
  """The kernel lowers for sm_90a (jax.export for "cuda"; nothing runs)."""
  m = 262144
  spec = jax.ShapeDtypeStruct
  row = spec((m,), jnp.float32)
  layer = norm == "layer"  # with a residual and a dense bias too
  fn = lambda x, w, dy, r, mu, s, res, d: mb.backward(x, w, dy, r, mu, s, res, d)  # noqa: E731
  tile = spec((m, N), jnp.bfloat16)
  exported = export.export(jax.jit(fn), platforms=["cuda"])(
      spec((m, K), jnp.bfloat16), spec((K, N), jnp.bfloat16), tile, row,
      row if layer else None, spec((N,), jnp.float32), tile if layer else None,
      spec((N,), jnp.float32) if layer else None)
  assert "mosaic_gpu" in exported.mlir_module()


# ------------------------------------------------------------------------------------------------
# The op's route: the whole-backward kernel where it applies, the row kernel and cuBLAS elsewhere.


def _spy(monkeypatch):
  calls = []
  real = mb.backward
  monkeypatch.setattr(mb, "backward", lambda *a, **kw: calls.append(a) or real(*a, **kw))
  return calls


@pytest.mark.parametrize("norm,bias,residual,dense", [
    ("rms", False, False, False), ("layer", True, False, False),
    ("layer", True, True, True)])  # the last: flax_layers.DenseNorm's defaults
def test_op_takes_the_whole_backward_and_matches_reference(monkeypatch, norm, bias, residual,
                                                           dense):
  calls = _spy(monkeypatch)
  x, w, dy, s = _inputs(3, 200)
  s = s.astype(jnp.bfloat16)
  b = jnp.asarray(np.linspace(-0.2, 0.3, N), jnp.bfloat16) if bias else None
  res = (jnp.asarray(np.linspace(-2, 2, 200 * N).reshape(200, N), jnp.bfloat16) if residual
         else None)
  d = jnp.asarray(np.linspace(0.5, -0.5, N), jnp.bfloat16) if dense else None
  op = lambda x, w, s, b, res, d: pallas_norm.matmul_norm(
      x, w, dense_bias=d, residual=res, scale=s, norm_bias=b, norm=norm,
      implementation="interpret")
  y, vjp = jax.vjp(op, x, w, s, b, res, d)
  grads = vjp(dy)
  assert len(calls) == 1
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  y_ref, vjp_ref = jax.vjp(lambda x, w, s, b, res, d: reference.matmul_norm(
      x, w, d, res, scale=s, norm_bias=b, norm=norm), f32(x), f32(w), f32(s), f32(b),
      f32(res), f32(d))
  assert _rel(y, y_ref) < 1e-2
  names = ("dx", "dw", "dscale", "dbias", "dres", "ddense")
  for name, g, r in zip(names, grads, vjp_ref(f32(dy))):
    if r is None:
      continue
    assert g.dtype == (x.dtype if name in ("dx", "dw", "dres") else s.dtype), name
    assert _rel(g, r) < 2e-2, (name, _rel(g, r))


@pytest.mark.parametrize("kwargs", [
    dict(return_h=True), dict(return_h=True, residual=True),
    dict(out_dtype=jnp.float16)])
def test_op_keeps_the_row_kernel_path_elsewhere(monkeypatch, kwargs):
  """A returned h or another output dtype keep the saved x̂, the row kernel and cuBLAS (traced
  only: no kernel runs)."""
  calls = _spy(monkeypatch)
  x, w, dy, s = _inputs(4, 16)
  extra = {}
  if kwargs.get("residual"):
    extra["residual"] = jnp.ones((16, N), jnp.bfloat16)
  if kwargs.get("dense_bias"):
    extra["dense_bias"] = jnp.ones((N,), jnp.bfloat16)
  if kwargs.get("return_h"):
    extra["return_h"] = True
  if "out_dtype" in kwargs:
    extra["out_dtype"] = kwargs["out_dtype"]

  def loss(x, w):
    out = pallas_norm.matmul_norm(x, w, scale=s, norm="rms", implementation="interpret",
                                  **extra)
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out.astype(jnp.float32))
  jax.eval_shape(jax.grad(loss, argnums=(0, 1)), x, w)
  assert not calls
  whole = mn._whole_backward  # pylint: disable=protected-access
  assert not whole(x, w, jnp.dtype(extra.get("out_dtype", x.dtype)), extra.get("return_h", False))


# ------------------------------------------------------------------------------------------------
# GPU: real asynchrony (WGMMA in flight, TMA), which interpret mode does not check.


@pytest.mark.gpu
@pytest.mark.parametrize("m,norm,scale,residual", [
    (262144, "rms", True, False), (262144, "layer", True, False), (4096 + 8, "layer", False, False),
    (8, "rms", True, False), (262144, "layer", True, True), (4096 + 8, "rms", True, True)])
def test_gpu_whole_backward_matches_oracle(m, norm, scale, residual):
  _check(m, norm, scale=scale, interpret=False, residual=residual)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gpu_op_gradients_through_the_whole_backward(monkeypatch, norm):
  calls = _spy(monkeypatch)
  x, w, dy, s = _inputs(5, 16384)
  s = s.astype(jnp.bfloat16)
  op = lambda x, w, s: pallas_norm.matmul_norm(x, w, scale=s, norm=norm,
                                               implementation="mosaic")
  _, vjp = jax.vjp(op, x, w, s)
  grads = vjp(dy)
  assert len(calls) == 1
  f32 = lambda a: a.astype(jnp.float32)
  _, vjp_ref = jax.vjp(lambda x, w, s: reference.matmul_norm(x, w, scale=s, norm=norm),
                       f32(x), f32(w), f32(s))
  for name, g, r in zip(("dx", "dw", "dscale"), grads, vjp_ref(f32(dy))):
    assert _rel(g, r) < 2e-2, (name, _rel(g, r))


def test_whole_backward_takes_a_minimum_m_on_the_gpu():
  """On the GPU the whole backward starts at routing.WHOLE_BACKWARD_MIN_M rows (measured slower
  at 4096); interpret mode takes it at any M, so the CPU tests run it."""
  from pallas_norm.ops.matmul_norm import routing
  w = jnp.ones((K, N), jnp.bfloat16)
  whole = mn._whole_backward  # pylint: disable=protected-access
  for m, gpu in ((8, False), (routing.WHOLE_BACKWARD_MIN_M - 8, False),
                 (routing.WHOLE_BACKWARD_MIN_M, True), (262144, True)):
    x = jax.ShapeDtypeStruct((m, K), jnp.bfloat16)
    assert whole(x, w, jnp.dtype(jnp.bfloat16), False) == gpu, m
    assert whole(x, w, jnp.dtype(jnp.bfloat16), False, interpret=True)
