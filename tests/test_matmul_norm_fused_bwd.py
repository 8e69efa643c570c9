"""The post-norm backward's fused kernel (:mod:`pallas_norm.ops.matmul_norm.mosaic_bwd`: dh
built as the dx GEMM's A operand, the row sums and column sums in a pre-pass) against a float64
NumPy oracle of the same math on the same bfloat16 inputs; Pallas GPU interpret mode on the CPU
(race detector on, outputs and SMEM filled with NaN, so an unwritten row shows), lowering for
sm_90a, the GPU at real sizes; and the op's backward around it.

Tolerances: dh is rounded once to bfloat16 (2⁻⁹ relative) after float32 sums, and dx is a GEMM of
that dh (compared with the float64 product of the returned dh: float32 accumulation only); the
column sums go through two bfloat16 parts per product and per partial sum (~2⁻¹⁶) and float32
sums.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_norm import mgpu, reference
from pallas_norm.ops.matmul_norm import api as mn
from pallas_norm.ops.matmul_norm import mosaic_bwd as mb
from pallas_norm.ops.norms import triton as norms_triton

BF = jnp.bfloat16


def _inputs(seed, m, n, k):
  rng = np.random.default_rng(seed)
  dy = jnp.asarray(rng.standard_normal((m, n), np.float32)).astype(BF)
  xhat = jnp.asarray(rng.standard_normal((m, n), np.float32)).astype(BF)
  w = jnp.asarray(rng.standard_normal((k, n), np.float32) / 8).astype(BF)
  rstd = jnp.asarray(rng.uniform(0.5, 2.0, m).astype(np.float32))
  scale = rng.uniform(0.1, 1.0, n).astype(np.float32)
  scale[::7] = 0.0  # zeros: nothing divides by the scale
  return dy, xhat, w, rstd, jnp.asarray(scale)


def _rel(got, want):
  got = np.asarray(got, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _check(outs, dy, xhat, w, rstd, scale, norm, norm_bias):
  dx, dh, parts = outs
  d, xh, wt, r, s = (np.asarray(v, np.float64) for v in (dy, xhat, w, rstd, scale))
  g = d * s
  dh_ref = g - xh * (g * xh).mean(axis=1, keepdims=True)
  if norm == "layer":
    dh_ref -= g.mean(axis=1, keepdims=True)
  dh_ref *= r[:, None]
  for name, v in (("dx", dx), ("dh", dh)):
    assert np.all(np.isfinite(np.asarray(v, np.float32))), name  # every row written
  assert _rel(dh, dh_ref) < 2 ** -8
  assert _rel(dx, np.asarray(dh, np.float64) @ wt.T) < 2 ** -8
  col = mb.column_sums(parts, dy.shape[1], norm_bias)
  assert sorted(col) == (["dbias", "dscale"] if norm_bias else ["dscale"])
  assert _rel(col["dscale"], (d * xh).sum(0)) < 1e-5
  if norm_bias:
    assert _rel(col["dbias"], d.sum(0)) < 1e-5


@pytest.mark.parametrize("m,n,k,norm,norm_bias", [
    (200, 128, 256, "layer", True),  # 2 row blocks on 2 CTAs, rows past M
    (300, 192, 512, "rms", False),  # 2 row blocks on one CTA, 2 column tiles, 3 K steps
    (130, 64, 256, "layer", False),  # a warpgroup wholly past M (its stores not issued)
])
def test_fused_backward_interpret_matches_oracle(m, n, k, norm, norm_bias):
  args = _inputs(m + n + k, m, n, k)
  outs = jax.jit(lambda *a: mb.dh_dx(*a, norm=norm, norm_bias=norm_bias, interpret=True))(*args)
  jax.block_until_ready(outs)
  assert not mgpu.races_found()
  _check(outs, *args, norm, norm_bias)


def test_unsupported_reasons():
  assert mb.unsupported_reason(262144, 512, 512, BF) is None
  assert mb.unsupported_reason(262144, 4096, 1024, BF) is None
  assert "bfloat16 only" in mb.unsupported_reason(256, 512, 512, jnp.float16)
  assert "up to 4096" in mb.unsupported_reason(256, 8192, 512, BF)
  assert "multiple of 64" in mb.unsupported_reason(256, 96, 512, BF)
  assert "multiple of 256" in mb.unsupported_reason(256, 512, 128, BF)
  assert "multiple of 8" in mb.unsupported_reason(77, 512, 512, BF)
  assert mb.unsupported_reason(77, 512, 512, BF, interpret=True) is None
  with pytest.raises(ValueError, match="multiple of 256"):
    mb.dh_dx(*_inputs(0, 64, 64, 128), norm="rms", norm_bias=False, interpret=True)


def test_pre_pass_needs_the_shared_ring():
  """The GEMM body's pre-pass runs on the shared ring only (its own barriers, no w stage)."""
  from pallas_norm.mgpu import gemm as gemm_core
  cfg = mgpu.TileConfig(pipeline="pallas")
  with pytest.raises(ValueError, match="pre-pass needs the shared ring"):
    gemm_core.plan_k_loop(cfg, mb._streams(cfg), 8, {}, pre_pass=True)
  assert mb._make_plan(256, 512, 512, True, True, True).kloop.pre_pass


@pytest.mark.parametrize("norm,norm_bias", [("rms", False), ("layer", True)])
def test_lowers_for_hopper(monkeypatch, norm, norm_bias):
  """The suite's shape lowers for sm_90a (jax.export for "cuda"; nothing runs), with the
  3 ring stages the SMEM plan gives."""
  fake = lambda interpret: 2 if interpret else 132  # noqa: E731  an H100/H200's 132 SMs
  monkeypatch.setattr(mgpu, "num_sms", fake)
  monkeypatch.setattr(mgpu.device, "num_sms", fake)
  m, n, k = 262144, 512, 512
  spec = jax.ShapeDtypeStruct
  fn = lambda dy, xh, w, r, s: mb.dh_dx(dy, xh, w, r, s, norm=norm,  # noqa: E731
                                        norm_bias=norm_bias)
  exported = export.export(jax.jit(fn), platforms=["cuda"])(
      spec((m, n), BF), spec((m, n), BF), spec((k, n), BF), spec((m,), jnp.float32),
      spec((n,), jnp.float32))
  assert "mosaic_gpu" in exported.mlir_module()
  assert [a.shape for a in exported.out_avals][:2] == [(m, k), (m, n)]
  assert mb._make_plan(m, n, k, norm == "layer", norm_bias, False).stages == 3


# ------------------------------------------------------------------------------------------------
# The op's backward: the fused kernel where it fits.


def _op_grads(impl, norm, m, k, n, seed=5, dense=False):
  ks = jax.random.split(jax.random.key(seed), 7)
  x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(BF)
  w = (jax.random.normal(ks[1], (k, n), jnp.float32) / 16).astype(BF)
  residual = jax.random.normal(ks[2], (m, n), jnp.float32).astype(BF)
  scale = jax.random.uniform(ks[3], (n,), jnp.float32, 0.1, 1.0)
  bias = jax.random.normal(ks[4], (n,), jnp.float32) * 0.1 if norm == "layer" else None
  dense_bias = jax.random.normal(ks[5], (n,), jnp.float32) * 0.1 if dense else None
  dy = jax.random.normal(ks[6], (m, n), jnp.float32)

  def loss(x, w, residual, scale, bias, dense_bias):
    if impl == "reference":
      y = reference.matmul_norm(*(None if v is None else v.astype(jnp.float32)
                                  for v in (x, w, dense_bias, residual, scale, bias)),
                                norm=norm)
    else:
      y = mn.matmul_norm(x, w, dense_bias=dense_bias, residual=residual, scale=scale,
                         norm_bias=bias, norm=norm, implementation=impl)
    return jnp.sum(y.astype(jnp.float32) * dy)

  args = (x, w, residual, scale, bias, dense_bias)
  argnums = tuple(i for i, v in enumerate(args) if v is not None)
  return jax.jit(jax.grad(loss, argnums=argnums))(*args)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_op_backward_takes_fused_kernel(monkeypatch, norm):
  """K a multiple of 256: the op's backward is the fused kernel (not the norm-backward kernel),
  its gradients against autodiff of the f32 reference."""
  fused, rows = [], []
  real_fused, real_rows = mb.dh_dx, norms_triton.norm_backward
  monkeypatch.setattr(mb, "dh_dx", lambda *a, **kw: fused.append(kw) or real_fused(*a, **kw))
  monkeypatch.setattr(norms_triton, "norm_backward",
                      lambda *a, **kw: rows.append(kw) or real_rows(*a, **kw))
  got = _op_grads("interpret", norm, 136, 256, 128)
  assert len(fused) == 1 and not rows
  assert not mgpu.races_found()
  want = _op_grads("reference", norm, 136, 256, 128)
  for i, (g, r) in enumerate(zip(got, want)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2, i


def test_op_backward_keeps_row_kernel_with_a_dense_bias(monkeypatch):
  """The fused kernel has no Σ dh (the dense bias's gradient): that call keeps the row kernel."""
  fused = []
  real_fused = mb.dh_dx
  monkeypatch.setattr(mb, "dh_dx", lambda *a, **kw: fused.append(kw) or real_fused(*a, **kw))
  _op_grads("interpret", "layer", 64, 256, 64, dense=True)
  assert not fused
  bf = jnp.zeros((8, 64), BF)
  assert "dense bias" in mn._fused_dx_reason(bf, None, jnp.zeros(64), bf, bf, bf, True)
  assert "bfloat16 only" in mn._fused_dx_reason(bf.astype(jnp.float16), None, None, bf, bf,
                                                bf, True)
  wide = jnp.zeros((8, 1024), BF)
  assert "measured only" in mn._fused_dx_reason(wide, None, None, jnp.zeros((8, 256), BF),
                                                jnp.zeros((256, 1024), BF), wide, True)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,norm,norm_bias", [
    (8192, 512, 512, "layer", True),  # the suite's tiling, several row blocks per CTA
    (4096 + 8, 1024, 1024, "rms", False),  # 4 column tiles, rows past M
    (2048, 2048, 256, "layer", True),  # 32 K steps: half the one-hot rows
])
def test_gpu_fused_backward_matches_oracle(m, n, k, norm, norm_bias):
  args = _inputs(m + n + k, m, n, k)
  fn = jax.jit(lambda *a: mb.dh_dx(*a, norm=norm, norm_bias=norm_bias))
  outs = fn(*args)
  _check(outs, *args, norm, norm_bias)
  again = fn(*args)
  for a, b in zip(outs, again):  # no race: the same bits twice
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gpu_op_backward_fused(norm):
  got = _op_grads("mosaic", norm, 8192, 512, 512)
  want = _op_grads("reference", norm, 8192, 512, 512)
  for i, (g, r) in enumerate(zip(got, want)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2, i
