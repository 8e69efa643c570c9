"""The pre-norm op's weight-gradient kernel (:func:`pallas_norm.ops.norm_matmul.mosaic_dw
.weight_grad`: dW_γ = x̂ᵀ dy from x, dy and the forward's statistics, x̂ made in registers),
against a float64 NumPy oracle of the same math on the same 16-bit inputs (interpret mode on the
CPU; the GPU at real sizes, where x̂ reaches the WGMMA from registers, which interpret mode
cannot run), and the op's route to it.

Tolerance: relative Frobenius 5e-3 (x̂ is rounded to the 16-bit dtype before its product, as
the dx kernel's x̂ output was; bfloat16's half ulp 2⁻⁹ ≈ 2e-3 per element, measured ~1.7e-3).
"""

import jax
import jax.numpy as jnp
from jax import export
import numpy as np
import pytest

import pallas_norm
from pallas_norm import mgpu, reference
from pallas_norm.ops.norm_matmul import api as nm_api
from pallas_norm.ops.norm_matmul import mosaic_dw as md

TOL = 5e-3


def _inputs(seed, m, k, n, dtype=jnp.bfloat16, layer=True, mean_offset=0.5):
  rng = np.random.default_rng(seed)
  x = jnp.asarray((2 * rng.standard_normal((m, k)) + mean_offset).astype(np.float32), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)).astype(np.float32), dtype)
  xf = np.asarray(x, np.float64)
  mean = xf.mean(1) if layer else np.zeros(m)
  var = ((xf - mean[:, None]) ** 2).mean(1)
  rstd = 1.0 / np.sqrt(var + 1e-6)
  want = ((xf - mean[:, None]) * rstd[:, None]).T @ np.asarray(dy, np.float64)
  stats = (jnp.asarray(rstd, jnp.float32), jnp.asarray(mean, jnp.float32) if layer else None)
  return x, dy, stats, want


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check(m, k, n, *, layer=True, dtype=jnp.bfloat16, config=None, interpret=True, seed=0,
           mean_offset=0.5):
  x, dy, (rstd, mean), want = _inputs(seed, m, k, n, dtype, layer, mean_offset)
  got = jax.block_until_ready(jax.jit(
      lambda *a: md.weight_grad(*a, config=config, interpret=interpret))(x, dy, rstd, mean))
  if interpret:
    assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  assert got.shape == (k, n) and got.dtype == jnp.float32
  # Interpret mode fills the uninitialized output with NaN: a partial tile left unwritten
  # would show here.
  assert np.isfinite(np.asarray(got)).all(), "unwritten (NaN-filled) partial"
  assert _rel(got, want) < TOL, _rel(got, want)


# Interpret mode runs 2 CTAs; K = 256 or N = 512 give more tiles than CTAs (several items a
# CTA, the ring's steps carried across them); M = 8 is one block mostly past M, 136 and 1000 a
# partial last block. At the default 4 stages these all run one group of M (a group needs 2
# ring-lengths of steps): the tests below split M.
@pytest.mark.parametrize("m,k,n,layer,dtype,config", [
    (1000, 128, 256, True, jnp.bfloat16, None),
    (136, 128, 128, False, jnp.bfloat16, None),
    (8, 128, 64, True, jnp.float16, None),
    (1000, 256, 192, True, jnp.bfloat16, None),  # tile_n 64, 6 tiles
    (520, 384, 512, False, jnp.float16, None),
    (640, 256, 256, True, jnp.bfloat16, md.Config(tile_n=128, stages=2)),
])
def test_weight_grad_interpret_matches_oracle(m, k, n, layer, dtype, config):
  _check(m, k, n, layer=layer, dtype=dtype, config=config)


def test_weight_grad_two_groups_of_uneven_length():
  """Two M groups (2 CTAs, 2 stages) over 9 steps: each group's partial is written to its own
  slot and summed (a mutation that wrote every group's partial to slot 0 passed the cases
  above, which all run one group)."""
  cfg = md.Config(tile_n=128, stages=2)
  plan = md._make_plan(520, 128, 128, jnp.bfloat16, True, cfg, True)
  assert plan.groups == 2 and plan.steps % plan.groups
  _check(520, 128, 128, config=cfg)


def test_weight_grad_three_groups_split_m_without_overlap(monkeypatch):
  """Three M groups (3 CTAs) over 14 steps: the groups' step ranges 0–4, 4–9, 9–14 tile M
  exactly (a first step of ``group · (steps // groups)`` overlaps 8–14 with 4–9; with one or
  two groups both forms agree). The GPU runs up to 33 groups."""
  monkeypatch.setattr(md.mgpu, "num_sms", lambda interpret: 3)
  cfg = md.Config(tile_n=128, stages=2)
  plan = md._make_plan(840, 128, 128, jnp.bfloat16, True, cfg, True)
  assert plan.groups == 3 and plan.steps == 14
  assert [plan.item(g * plan.tiles)[3:] for g in range(3)] == [(0, 4), (4, 5), (9, 5)]
  _check(840, 128, 128, config=cfg)


def test_weight_grad_rows_of_a_large_mean():
  """LayerNorm rows of mean 1e3 (float16 x): x − mean in float32 before the scaling, so the
  centered x̂ keeps its digits (|x − mean| ~ 2 against |x| ~ 1e3)."""
  _check(264, 128, 128, dtype=jnp.float16, mean_offset=1e3)


def test_weight_grad_refuses_what_it_cannot_run():
  assert md.unsupported_reason(262144, 256, 256, jnp.bfloat16) is None
  assert "multiple of 128" in md.unsupported_reason(262144, 192, 256, jnp.bfloat16)
  assert "multiple of 64" in md.unsupported_reason(262144, 256, 96, jnp.bfloat16)
  assert "multiple of 8" in md.unsupported_reason(77, 256, 256, jnp.bfloat16)
  assert "bfloat16 or float16" in md.unsupported_reason(64, 128, 128, jnp.float32)
  assert "x's dtype" in md.unsupported_reason(64, 128, 128, jnp.bfloat16, jnp.float32)
  assert "divide" in md.unsupported_reason(64, 128, 192, jnp.bfloat16,
                                           config=md.Config(tile_n=128))
  one_stage = md.Config(tile_n=128, stages=1)
  assert "2+" in md.unsupported_reason(64, 128, 128, jnp.bfloat16, config=one_stage)
  assert "SMEM" in md.unsupported_reason(64, 128, 256, jnp.bfloat16, config=md.Config(stages=5))
  x, dy, (rstd, mean), _ = _inputs(0, 16, 128, 128)
  with pytest.raises(ValueError, match="multiple of 128"):
    md.weight_grad(x[:, :64], dy, rstd, interpret=True)
  with pytest.raises(ValueError, match="x's dtype"):
    md.weight_grad(x, dy.astype(jnp.float16), rstd, interpret=True)
  with pytest.raises(ValueError, match="rstd must be an array of shape"):
    md.weight_grad(x, dy, rstd[:8], interpret=True)
  with pytest.raises(ValueError, match="rows"):
    md.weight_grad(x, dy[:8], rstd, interpret=True)
  # A review's cases: each a ValueError naming the argument before any kernel or tiling runs.
  with pytest.raises(ValueError, match="multiple of 64"):
    md.weight_grad(x, dy[:, :96], rstd, interpret=True)
  with pytest.raises(ValueError, match="dy must be a 2-D"):
    md.weight_grad(x, dy[0], rstd, interpret=True)
  with pytest.raises(ValueError, match="x must be a 2-D"):
    md.weight_grad(x[None], dy, rstd, interpret=True)
  with pytest.raises(ValueError, match="rstd must be an array"):
    md.weight_grad(x, dy, None, mean, interpret=True)
  with pytest.raises(ValueError, match="rstd must be an array"):
    md.weight_grad(x, dy, list(np.asarray(rstd)), interpret=True)


@pytest.mark.parametrize("layer", [False, True])
def test_weight_grad_lowers_for_hopper(layer):
  """The GPU form (x̂ as a register operand) lowers for sm_90a (jax.export for "cuda"; nothing
  runs)."""
  m, k, n = 262144, 256, 256
  spec = jax.ShapeDtypeStruct
  row = spec((m,), jnp.float32)
  exported = export.export(jax.jit(md.weight_grad), platforms=["cuda"])(
      spec((m, k), jnp.bfloat16), spec((m, n), jnp.bfloat16), row, row if layer else None)
  module = exported.mlir_module()
  assert "mosaic_gpu" in module
  # The GPU form releases a stage only after its WGMMAs completed (a WGMMA in flight still
  # reads its A registers and B stage); interpret mode cannot see a missing wait (its WGMMA
  # completes at once), so the lowered kernel is checked for one.
  assert "wgmma_wait" in module


# ------------------------------------------------------------------------------------------------
# The op's route: the kernel where the dx kernel sums its rows in the epilogue and x̂ would
# otherwise be written for cuBLAS.


def _spy(monkeypatch):
  calls = []
  real = md.weight_grad
  monkeypatch.setattr(md, "weight_grad", lambda *a, **kw: calls.append(a) or real(*a, **kw))
  return calls


def _op_check(monkeypatch, m, k, n, norm, bias, implementation, tol):
  calls = _spy(monkeypatch)
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((m, k)) + 0.3, jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
  s = jnp.asarray(rng.uniform(0.5, 1.5, k), jnp.bfloat16)
  b = jnp.asarray(0.1 * rng.standard_normal(k), jnp.bfloat16) if bias else None
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  op = lambda x, w, s, b: pallas_norm.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm,
                                                  implementation=implementation)
  _, vjp = jax.vjp(op, x, w, s, b)
  grads = vjp(dy)
  assert len(calls) == 1, "the weight-gradient kernel did not run"
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  _, vjp_ref = jax.vjp(
      lambda x, w, s, b: reference.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm),
      f32(x), f32(w), f32(s), f32(b))
  for name, g, r in zip(("dx", "dw", "dscale", "dbias"), grads, vjp_ref(f32(dy))):
    if r is None:
      assert g is None
      continue
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert _rel(g, r) < tol, (name, _rel(g, r))


# Interpret mode: the dx kernel's row sums need K on one CTA (K = 128 or 256); K = 128 with
# N ≤ 128 is the dx kernel's own dW_γ route instead.
@pytest.mark.parametrize("m,k,n,norm,bias", [
    (264, 128, 256, "layer", True),
    (128, 256, 128, "rms", False),
])
def test_op_takes_the_weight_grad_kernel_and_matches_reference(monkeypatch, m, k, n, norm,
                                                               bias):
  _op_check(monkeypatch, m, k, n, norm, bias, "interpret", 1e-2)


def test_op_keeps_cublas_for_a_float32_cotangent(monkeypatch):
  """dy in float32 (out_dtype float32) is not x's dtype: the kernel's WGMMA needs one dtype, so
  x̂ and XLA's GEMM stay."""
  assert not nm_api._takes_weight_grad_kernel(256, 128, 256, jnp.bfloat16, jnp.float32)
  assert nm_api._takes_weight_grad_kernel(256, 128, 256, jnp.bfloat16, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,layer", [
    (262144, 256, 256, True), (65536, 512, 512, False), (16392, 1024, 1024, True),
    (4104, 512, 2048, False)])
def test_gpu_weight_grad_matches_oracle(m, k, n, layer):
  _check(m, k, n, layer=layer, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("norm,bias", [("rms", False), ("layer", True)])
def test_gpu_op_gradients_through_the_weight_grad_kernel(monkeypatch, norm, bias):
  _op_check(monkeypatch, 16384, 256, 256, norm, bias, "mosaic", 2e-2)


def test_weight_grad_kernel_pays_where_measured():
  """The measured rule (routing.weight_grad_kernel_pays): K, N ≤ 512 take the kernel; 512×2048
  and 1024², where it trained slower, keep cuBLAS."""
  from pallas_norm.ops.norm_matmul import routing
  assert routing.weight_grad_kernel_pays(256, 256) and routing.weight_grad_kernel_pays(512, 512)
  assert routing.weight_grad_kernel_pays(128, 320)
  assert not routing.weight_grad_kernel_pays(512, 2048)
  assert not routing.weight_grad_kernel_pays(1024, 1024)
  assert not routing.weight_grad_kernel_pays(1024, 256)
