"""The lazy pre-norm GEMM kernels against the reference: the forward
(pallas_norm.ops.norm_matmul.mosaic) and the dx kernel of the backward
(pallas_norm.ops.norm_matmul.mosaic_bwd).

CPU tests run the Mosaic-GPU kernel in GPU interpret mode with the race detector on and every
uninitialized buffer (SMEM and the outputs) filled with NaN, so an output element the kernel
never writes shows up as NaN. Rows past M cannot be written: TMA stores are clipped to the
output array's bounds (the interpreter models this, and partial last row tiles are tested at
M = 1, 5, 77, 200). Lowering tests run Mosaic's Python lowering for sm_90a via ``jax.export`` (no
GPU needed). ``gpu`` tests run the compiled kernel at real sizes on a Hopper GPU.

The oracle is :func:`pallas_norm.reference.norm_matmul` on float32-upcast inputs (two-pass
statistics, no rounding of norm(x)); for dx, ``jax.grad`` of it. Tolerances: y and dx relative
Frobenius error < 1e-2 (bf16/f16 output rounding and the bf16 rounding of diag(scale)·w); rstd
relative error < 1e-4; mean error < 1e-4 · (|mean| + std).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import export

import pallas_norm as pn
from pallas_norm import mgpu, reference
from pallas_norm.mgpu import TileConfig
from pallas_norm.mgpu import gemm as gemm_core
from pallas_norm.ops.norm_matmul import mosaic as nmk
from pallas_norm.ops.norm_matmul import mosaic_bwd as nmb
from pallas_norm.ops.norm_matmul import xla as nm_xla

EPS = 1e-6

# Every XLA program costs a compile (~30 ms for the smallest on the CPU, ~0.8 s for JAX's
# random generator at the cases' shapes): inputs come from NumPy's generator, folds, oracles and
# kernel calls run jitted (one program per case instead of one per eager op) and the checks run
# in NumPy.


# diag(scale)·w in w's dtype, col_sum = 1ᵀ(that) in f32 (layer), out_bias = biasᵀ w (f32): the
# public op's fold, jitted as a user's program would run it.
_fold = jax.jit(nm_xla.fold_affine, static_argnames=("norm",))

EXCESS_PRECISION = {"xla_cpu_experimental_onednn_custom_call": True}
"""Compiler options under which XLA:CPU runs simplify-fp-conversions, the pass XLA:GPU runs by
default (``xla_allow_excess_precision``): it turns ``v.astype(f16).astype(f32)`` into the
unrounded v (on the CPU only for float16)."""


def _normal(rng, shape, scale=1.0, shift=0.0, dtype=np.float32):
  """shift + scale · N(0, 1) drawn in float32, rounded to ``dtype`` (NumPy, no XLA program)."""
  return jnp.asarray((shift + scale * rng.standard_normal(shape, np.float32)).astype(dtype))


def _inputs(seed, m, k, n, dtype, *, mu=0.0, affine=True):
  rng = np.random.default_rng(seed)
  x = _normal(rng, (m, k), shift=mu, dtype=dtype)
  w = _normal(rng, (k, n), scale=k ** -0.5, dtype=dtype)
  scale = _normal(rng, (k,), scale=0.2, shift=1.0) if affine else None
  bias = _normal(rng, (k,), scale=0.2) if affine else None
  return x, w, scale, bias


def _all_finite(a) -> bool:
  return bool(np.isfinite(np.asarray(a, np.float32)).all())


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.partial(jax.jit, static_argnames=("norm", "eps", "return_stats"))
def _reference(x, w, scale, bias, *, norm, eps, return_stats):
  """reference.norm_matmul on float32-upcast x and w."""
  return reference.norm_matmul(x.astype(jnp.float32), w.astype(jnp.float32), scale, bias,
                               norm=norm, eps=eps, return_stats=return_stats)


def _run_and_check(m, k, n, dtype, norm, *, mu=0.0, affine=True, config=None, interpret=True,
                   seed=0, y_tol=1e-2, fold=_fold):
  x, w, scale, bias = _inputs(seed, m, k, n, dtype, mu=mu, affine=affine)
  w_gamma, col_sum, out_bias = fold(w, scale, bias, norm)
  y, mean, rstd = jax.jit(lambda x, w_gamma, col_sum, out_bias: nmk.norm_matmul_fwd(
      x, w_gamma, col_sum, out_bias, norm=norm, eps=EPS, out_dtype=dtype, interpret=interpret,
      config=config))(x, w_gamma, col_sum, out_bias)
  y = jax.block_until_ready(y)
  if interpret:
    assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  y_ref, stats = _reference(x, w, scale, bias, norm=norm, eps=EPS, return_stats=True)
  assert y.shape == (m, n) and y.dtype == jnp.dtype(dtype)
  assert _all_finite(y), "some outputs were never written (NaN-filled)"
  assert _rel_err(y, y_ref) < y_tol
  np.testing.assert_allclose(rstd, stats.rstd, rtol=1e-4)
  if norm == "layer":
    ref_mean, std = np.asarray(stats.mean), 1.0 / np.asarray(stats.rstd)
    assert np.all(np.abs(np.asarray(mean) - ref_mean) <= 1e-4 * (np.abs(ref_mean) + std))
  else:
    assert mean is None


# ~8 shapes, not the cross product: every M in {1, 77, 256}, every K and N in {64, 128, 192},
# both norms, both dtypes, large-mean LayerNorm rows, with and without the affine.
FORWARD_CASES = [
    # m, k, n, dtype, norm, mu, affine, config
    (1, 64, 64, jnp.bfloat16, "rms", 0.0, True, None),
    (77, 192, 128, jnp.bfloat16, "layer", 1e3, True, None),
    (77, 128, 64, jnp.float16, "layer", 1e3, False, None),
    (256, 64, 128, jnp.bfloat16, "layer", 0.0, True, None),
    # several tiles per CTA (2 CTAs in interpret mode), partial N tile (N = 320, tile_n = 192)
    (200, 128, 320, jnp.bfloat16, "rms", 0.0, False, None),
    (256, 192, 192, jnp.bfloat16, "layer", 1e3, True, TileConfig(tile_m=128, tile_n=64)),
    # 256-row CTA tile (128 rows per warpgroup), narrow epilogue tiles, 5 rows
    (5, 128, 128, jnp.bfloat16, "layer", 0.0, True, TileConfig(tile_m=256, tile_n=128,
                                                               epi_tile_n=32)),
    # 3 row blocks, statistics once per row block (4 N tiles read them back).
    (300, 128, 256, jnp.bfloat16, "layer", 1e3, True, TileConfig(
        tile_m=128, tile_n=64, stats_once=True)),
    # K = 320 (5 steps): no stage count >= 2 divides it, so per-tile pipelines; 3 tiles per CTA.
    (300, 320, 128, jnp.bfloat16, "layer", 0.0, True, TileConfig(tile_m=128, tile_n=64)),
    # One WGMMA left in flight across K steps (stages released a step late, not chained); with
    # the in-loop statistics (rms, layer), and with statistics once per row block.
    (200, 256, 192, jnp.bfloat16, "layer", 1e3, True, TileConfig(
        tile_m=128, tile_n=64, max_concurrent_steps=2, delay_release=1)),
    (300, 128, 256, jnp.bfloat16, "layer", 0.0, True, TileConfig(
        tile_m=128, tile_n=64, stats_once=True, delay_release=1)),
    # K = 64: one step, so the pipeline runs without the delay (Pallas needs stages > delay).
    (100, 64, 128, jnp.bfloat16, "rms", 0.0, True, TileConfig(delay_release=1)),
    # The shared ring (the default, so the None rows above run it with one WGMMA in flight):
    # 3 stages over 5-step K loops numbered across 3
    # tiles per CTA, without the delay; with statistics once per row block and the delay; 2
    # stages with the delay (the producer refills a stage only after the next step's WGMMA
    # was issued); a one-step K loop; one tile per CTA (2 tiles on the 2 interpret CTAs: the
    # producer drains after its only tile).
    (300, 320, 128, jnp.bfloat16, "layer", 1e3, True, TileConfig(
        tile_m=128, tile_n=64, max_concurrent_steps=3, pipeline="ring")),
    (300, 192, 256, jnp.float16, "layer", 0.0, True, TileConfig(
        tile_m=128, tile_n=64, stats_once=True, pipeline="ring", delay_release=1)),
    (200, 256, 192, jnp.bfloat16, "rms", 0.0, False, TileConfig(
        tile_n=192, max_concurrent_steps=2, pipeline="ring", delay_release=1)),
    (256, 64, 128, jnp.bfloat16, "layer", 0.0, True, TileConfig(
        tile_n=64, pipeline="ring", delay_release=1)),
    (128, 128, 128, jnp.bfloat16, "rms", 0.0, True, TileConfig(
        tile_m=128, tile_n=64, pipeline="ring", delay_release=1)),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,mu,affine,config", FORWARD_CASES)
def test_forward_matches_reference(m, k, n, dtype, norm, mu, affine, config):
  _run_and_check(m, k, n, dtype, norm, mu=mu, affine=affine, config=config)


def test_layer_large_mean_with_the_fold_compiled_like_xla_gpu():
  """col_sum must sum the W_γ the kernel reads, also where XLA widens the fold's f32 → f16 → f32
  pair (XLA:GPU under jit): summing the unrounded diag(scale)·w made y 19% off here (bf16 on the
  H200: 190%; the lazy form multiplies col_sum's error by the row mean)."""
  fold = jax.jit(nm_xla.fold_affine, static_argnames=("norm",), compiler_options=EXCESS_PRECISION)
  _run_and_check(77, 128, 64, jnp.float16, "layer", mu=1e3, fold=fold)


def test_plain_gemm():
  """gemm (the benchmarks' GEMM-alone baseline) is x @ w, f32 accumulation."""
  x, w, _, _ = _inputs(3, 256, 128, 128, jnp.bfloat16)
  y = jax.block_until_ready(jax.jit(lambda x, w: nmk.gemm(x, w, out_dtype=jnp.float32,
                                                           interpret=True))(x, w))
  assert not mgpu.races_found()
  y_ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  assert _rel_err(y, y_ref) < 1e-5


def _layer_forward_f32_out(x, w, col_sum):
  """The LayerNorm forward kernel without the affine, float32 output, in interpret mode."""
  out = jax.jit(lambda x, w, col_sum: nmk.norm_matmul_fwd(
      x, w, col_sum, None, norm="layer", eps=EPS, out_dtype=jnp.float32, interpret=True))(
          x, w, col_sum)
  return jax.block_until_ready(out)


@pytest.mark.parametrize("ratio,tol", [(1e2, 1e-4), (1e3, 1e-3)])
def test_layer_accuracy_domain(ratio, tol):
  """The lazy LayerNorm error grows like |mean|/std · 1.4e-7 (f32 accumulator and output).

  float16 rows ``ratio + N(0, 1)`` (f16 resolves |mean|/std up to ~2e3) against the two-pass f32
  reference; measured 1.3e-5 at 1e2 and 1.4e-4 at 1e3 (module docstring of the kernel).
  """
  m, k, n = 128, 256, 128
  x, w, _, _ = _inputs(1, m, k, n, jnp.float16, mu=ratio, affine=False)
  _, col_sum, _ = _fold(w, None, None, "layer")
  y, mean, rstd = _layer_forward_f32_out(x, w, col_sum)
  y_ref, stats = _reference(x, w, None, None, norm="layer", eps=EPS, return_stats=True)
  assert _rel_err(y, y_ref) < tol
  np.testing.assert_allclose(rstd, stats.rstd, rtol=1e-5)
  np.testing.assert_allclose(mean, stats.mean, rtol=1e-6)


def test_layer_statistics_of_huge_rows_do_not_overflow():
  """Rows of ~3e17 (K = 512): Σ(x − shift)² is still finite in float32 but (Σ(x − shift))² is
  not; the lane merge must not square the sum first (a review found rstd = 1/√eps there)."""
  rng = np.random.default_rng(2)
  x = _normal(rng, (64, 512), scale=3e17, dtype=jnp.bfloat16)
  w = _normal(rng, (512, 64), scale=1 / 22.6, dtype=jnp.bfloat16)
  _, col_sum, _ = _fold(w, None, None, "layer")
  y, mean, rstd = _layer_forward_f32_out(x, w, col_sum)
  y_ref, stats = _reference(x, w, None, None, norm="layer", eps=EPS, return_stats=True)
  np.testing.assert_allclose(rstd, stats.rstd, rtol=1e-5)
  assert _rel_err(y, y_ref) < 1e-2


@pytest.mark.parametrize("implementation",
                         ["interpret", pytest.param("mosaic", marks=pytest.mark.gpu)])
def test_layer_statistics_past_float32_range(implementation):
  """Rows whose Σ(x − shift)² overflows float32 (|x| ≈ 1e19 and 1e20, K = 512) normalize to
  zeros: rstd = 0 and y = βᵀw, as in the reference (its centred squares overflow too) and on
  the XLA path. inf − inf in the lane merge made those rows NaN (a fuzzing run found it)."""
  x, w, scale, bias = _inputs(6, 64, 512, 128, np.float32)
  x = np.array(x)
  x[3] *= 1e19
  x[10] *= 1e20
  x = jnp.asarray(x, jnp.bfloat16)
  w = w.astype(jnp.bfloat16)
  y, stats = jax.jit(lambda x, w, scale, bias: pn.norm_matmul(
      x, w, scale=scale, norm_bias=bias, norm="layer", eps=EPS, return_stats=True,
      out_dtype=jnp.float32, implementation=implementation))(x, w, scale, bias)
  y_ref, stats_ref = _reference(x, w, scale, bias, norm="layer", eps=EPS, return_stats=True)
  assert not np.any(np.asarray(stats_ref.rstd)[[3, 10]])  # the reference's rows overflow
  assert _all_finite(y), "NaN rows"
  np.testing.assert_array_equal(np.asarray(stats.rstd)[[3, 10]], 0.0)
  np.testing.assert_allclose(np.asarray(y)[[3, 10]], np.asarray(y_ref)[[3, 10]], rtol=2e-2,
                             atol=2e-2)
  assert _rel_err(y, y_ref) < 1e-2


@pytest.mark.parametrize("implementation,config", [
    ("interpret", None),
    # 4 N tiles reading the row block's statistics (the epilogue's rstd among them) back
    ("interpret", TileConfig(tile_m=128, tile_n=64, stats_once=True)),
    pytest.param("mosaic", None, marks=pytest.mark.gpu),
])
def test_layer_constant_rows(implementation, config):
  """Rows that are one constant (var exactly 0) give y = βᵀW as the reference does, not the
  lazy form's f32 rounding of |mean|·|col_sum| times rsqrt(eps) (max error 0.24 at 1e3 on
  outputs of 0.34 before, logs/2026-12-04_s36_cpu_measurements.md); rstd stays rsqrt(eps) for
  the backward. bf16 rows of 1e3 + N(0, 1) round to such rows now and then."""
  m, k, n = 130, 128, 256
  x, w, scale, bias = _inputs(7, m, k, n, jnp.bfloat16)
  rows = {3: 1.0, 40: 100.0, 41: -1e3, 77: 1e4, 128: 3e5}
  x = x.at[jnp.array(list(rows))].set(jnp.array(list(rows.values()), jnp.bfloat16)[:, None])
  if config is None:
    fn = lambda x, w, scale, bias: pn.norm_matmul(
        x, w, scale=scale, norm_bias=bias, norm="layer", eps=EPS, return_stats=True,
        out_dtype=jnp.float32, implementation=implementation)
  else:
    def fn(x, w, scale, bias):
      w_gamma, col_sum, out_bias = _fold(w, scale, bias, "layer")
      y, mean, rstd = nmk.norm_matmul_fwd(x, w_gamma, col_sum, out_bias, norm="layer", eps=EPS,
                                          out_dtype=jnp.float32, interpret=True, config=config)
      return y, reference.NormStats(mean=mean, rstd=rstd)
  y, stats = jax.jit(fn)(x, w, scale, bias)
  y_ref, stats_ref = _reference(x, w, scale, bias, norm="layer", eps=EPS, return_stats=True)
  if implementation == "interpret":
    assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  const = np.array(list(rows))
  y, y_ref = np.asarray(y), np.asarray(y_ref)
  # the constant rows: βᵀW up to the fold's bf16 rounding of out_bias
  np.testing.assert_allclose(y[const], y_ref[const], rtol=0, atol=1e-2 * np.abs(y_ref).max())
  np.testing.assert_allclose(np.asarray(stats.rstd)[const], np.asarray(stats_ref.rstd)[const],
                             rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats.mean)[const],
                                np.asarray(x[const, 0], np.float32))
  assert _rel_err(np.delete(y, const, 0), np.delete(y_ref, const, 0)) < 1e-2


# ------------------------------------------------------------------------------------------------
# Arguments, configs and lowering (no kernel run).


@pytest.mark.parametrize("m,k,n,dtype,fragment", [
    (64, 96, 64, jnp.bfloat16, "K = 96"),
    (64, 64, 100, jnp.bfloat16, "N = 100"),
    (64, 64, 64, jnp.float32, "float32"),
    (0, 64, 64, jnp.bfloat16, "M = 0"),
])
def test_unsupported_reason(m, k, n, dtype, fragment):
  assert fragment in nmk.unsupported_reason(m, k, n, dtype)


def test_supported_shapes():
  for m, k, n in [(1, 64, 64), (77, 192, 320), (262144, 512, 512)]:
    for dtype in (jnp.bfloat16, jnp.float16):
      assert nmk.unsupported_reason(m, k, n, dtype) is None


def test_bad_arguments_raise():
  x = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((64, 64), jnp.bfloat16)
  c = jnp.ones((64,), jnp.float32)
  call = lambda *a, **kw: nmk.norm_matmul_fwd(*a, **{"eps": EPS, "out_dtype": jnp.bfloat16,
                                                     "interpret": True, **kw})
  with pytest.raises(ValueError, match="col_sum"):
    call(x, w, None, None, norm="layer")
  with pytest.raises(ValueError, match="col_sum"):
    call(x, w, c, None, norm="rms")
  with pytest.raises(TypeError, match="same dtype"):
    call(x, w.astype(jnp.float16), None, None, norm="rms")
  with pytest.raises(ValueError, match="norm must be"):
    call(x, w, None, None, norm="batch")
  with pytest.raises(ValueError, match="out_bias"):
    call(x, w, None, c.astype(jnp.bfloat16), norm="rms")
  with pytest.raises(ValueError, match="eps"):
    call(x, w, None, None, norm="rms", eps=0.0)
  with pytest.raises(ValueError, match="K = 96"):
    call(jnp.ones((8, 96), jnp.bfloat16), jnp.ones((96, 64), jnp.bfloat16), None, None,
         norm="rms")
  with pytest.raises(ValueError, match="tile_m"):
    TileConfig(tile_m=64)
  with pytest.raises(ValueError, match="tile_n"):
    TileConfig(tile_n=96)
  with pytest.raises(ValueError, match="pipeline"):
    TileConfig(pipeline="emit")
  with pytest.raises(TypeError):
    TileConfig(pingpong=True)  # experiments are not options


@pytest.mark.parametrize("n,tile_n", [(64, 64), (128, 128), (192, 192), (256, 256), (512, 256),
                                      (320, 192), (1024, 256), (2048, 256)])
def test_pick_config_tile_n(n, tile_n):
  cfg = nmk.pick_config(4096, 512, n)
  assert cfg.tile_n == tile_n
  assert cfg.tile_m == (256 if tile_n <= 128 else 128)


def test_plan_fits_smem():
  """Pipeline stages are cut to what fits in 227 KiB next to the epilogue buffers."""
  for n in (128, 512, 2048):
    cfg = nmk.pick_config(262144, 512, n)
    plan = nmk._make_plan(262144, 512, n, jnp.bfloat16, jnp.bfloat16, "layer", EPS, True, cfg,
                          interpret=False)
    stage = (cfg.tile_m * cfg.tile_k + cfg.tile_k * cfg.tile_n) * 2
    fixed = (gemm_core.smem_bytes(nmk._smem(cfg, jnp.bfloat16, plan.n_vecs, plan.n_stats))
             + gemm_core.SMEM_SLACK)
    assert 2 <= plan.stages <= cfg.max_concurrent_steps
    assert plan.stages * stage + fixed <= mgpu.SMEM_BYTES


@pytest.mark.parametrize("steps,max_stages,expected", [
    (8, 4, (4, True)), (8, 3, (3, False)), (2, 4, (2, True)), (3, 4, (3, True)),
    (1, 4, (1, True)), (5, 4, (4, False)), (6, 4, (4, False)), (12, 4, (4, True)),
    (8, 2, (2, True)),
])
def test_pipeline_stages(steps, max_stages, expected):
  """As many stages as fit; chained across tiles only when that count divides the K steps
  (a pipeline of pipelines needs it), so chaining never costs a stage."""
  assert mgpu.pipeline_stages(steps, max_stages) == expected
  # A WGMMA in flight across steps rules chaining out (Pallas cannot chain such pipelines),
  # except for a one-stage loop, which runs without the delay.
  stages = min(steps, max_stages)
  assert mgpu.pipeline_stages(steps, max_stages, 1) == (
      stages, expected[1] and stages == 1)


def test_ring_plan():
  """The default plan takes the shared ring: as many stages as fit whether or not they divide
  the K steps (never chained through Pallas), with one WGMMA in flight, except with x in
  registers (M % 8 != 0 on a GPU); with stats_once too; the plain GEMM and dx (with or without
  the fused row terms) without a WGMMA in flight."""
  for m, k, n in ((262144, 2048, 2048), (65536, 2048, 2048), (262144, 320, 256)):
    cfg = nmk.pick_config(m, k, n)
    assert not cfg.stats_once and cfg.pipeline == "ring" and cfg.delay_release == 1
    plan = nmk._make_plan(m, k, n, jnp.bfloat16, jnp.bfloat16, "layer", EPS, True, cfg,
                          interpret=False)
    assert not plan.chained and plan.delay_release == 1
    fixed = gemm_core.smem_bytes(nmk._smem(cfg, jnp.bfloat16, plan.n_vecs, plan.n_stats))
    assert plan.stages == min(4, (mgpu.SMEM_BYTES - gemm_core.SMEM_SLACK - fixed)
                              // ((cfg.tile_m + cfg.tile_n) * 64 * 2))
  once = nmk.pick_config(262144, 512, 512)
  assert once.stats_once and once.pipeline == "ring" and once.delay_release == 1
  assert nmb.pick_config(262144, 512, 576, x_hat=True).pipeline == "ring"
  for cfg in (nmk.gemm_config(262144, 512, 512), nmk.gemm_config(262144, 512, 2048),
              nmb.pick_config(262144, 512, 448, fused_row_terms=True, x_hat=True)):
    assert cfg.pipeline == "ring" and cfg.delay_release == 0 and not cfg.stats_once
  odd = nmk._make_plan(65536 + 77, 2048, 2048, jnp.bfloat16, jnp.bfloat16, "rms", EPS, False,
                       nmk.pick_config(65536 + 77, 2048, 2048), interpret=False)
  assert odd.a_in_registers and odd.delay_release == 0


def test_dx_refuses_forward_only_options():
  x = jnp.ones((64, 64), jnp.bfloat16)
  r = jnp.ones((64,), jnp.float32)
  with pytest.raises(ValueError, match="stats_once"):
    nmb.norm_matmul_dx(x, x, x, r, r, interpret=True, config=TileConfig(stats_once=True))


def test_delay_release_option():
  with pytest.raises(ValueError, match="delay_release"):
    TileConfig(delay_release=True)
  assert mgpu.delay_release_for(1, 4) == 1
  assert mgpu.delay_release_for(1, 1) == 0
  assert mgpu.delay_release_for(0, 4) == 0
  with pytest.raises(ValueError, match="delay_release"):
    TileConfig(delay_release=2)
  plan = nmk._make_plan(262144, 512, 512, jnp.bfloat16, jnp.bfloat16, "rms", EPS, False,
                        TileConfig(delay_release=1), interpret=False)
  assert plan.delay_release == 1 and not plan.chained


def test_seed_shape_plan_has_four_stages():
  """The seed shape (statistics once per row block) takes 64×32 epilogue tiles, which leave
  room for 4 ring stages (64×64 ones leave 3)."""
  cfg = nmk.pick_config(262144, 512, 512)
  plan = nmk._make_plan(262144, 512, 512, jnp.bfloat16, jnp.bfloat16, "rms", EPS, False, cfg,
                        interpret=False)
  assert cfg.epi_tile_n == 32 and plan.stages == 4 and not plan.chained


def _export_for_hopper(m, k, n, norm, dtype=jnp.bfloat16, config=None):
  spec = jax.ShapeDtypeStruct
  vec = spec((n,), jnp.float32)
  if norm is None:  # the plain GEMM
    fn = jax.jit(lambda x, w, c, b: nmk.gemm(x, w, out_dtype=dtype, config=config))
  else:
    fn = jax.jit(lambda x, w, c, b: nmk.norm_matmul_fwd(x, w, c, b, norm=norm, eps=EPS,
                                                        out_dtype=dtype, config=config))
  return export.export(fn, platforms=["cuda"])(
      spec((m, k), dtype), spec((k, n), dtype), vec if norm == "layer" else None, vec)


@pytest.mark.parametrize("m,k,n,norm,config", [
    (65536, 2048, 2048, None, TileConfig(tile_m=256, tile_n=128, epi_tile_n=32)),
])
def test_lowers_for_hopper(m, k, n, norm, config):
  """Mosaic's layout inference and lowering accept the kernel for sm_90a (runs on the CPU;
  PTX generation and ptxas run only on the GPU). Only the plain GEMM (the benchmarks' baseline),
  which no ``gpu`` test runs: the pre-norm forward's variants are compiled by the ``gpu`` tests
  below (the README's testing section: lowering tests a GPU test duplicates go)."""
  exported = _export_for_hopper(m, k, n, norm, config=config)
  assert "mosaic_gpu" in exported.mlir_module()


# ------------------------------------------------------------------------------------------------
# Compiled on a Hopper GPU at real sizes (the coordinator runs these with `pytest -m gpu`).


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096 + 77, 512, 512), (262144, 512, 512), (1, 128, 128),
                                   (5, 256, 192), (8192, 1024, 320)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gpu_forward(m, k, n, norm):
  _run_and_check(m, k, n, jnp.bfloat16, norm, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_layer_large_mean(dtype):
  _run_and_check(4096 + 77, 512, 512, dtype, "layer", mu=1e3, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    TileConfig(stats_once=True), TileConfig(max_concurrent_steps=3, pipeline="ring",
                                            delay_release=1)])
def test_gpu_layer_large_mean_configs(config):
  """Rows of mean 1e3 (where an error of the shift or the statistics, invisible at mean 0, is
  multiplied by the mean) through the other schedules at M % 8 == 0 (x stages tiled for WGMMA):
  statistics once per row block (later N tiles read them from SMEM), and the shared ring with
  a WGMMA in flight over several tiles per CTA."""
  _run_and_check(8192, 512, 1024, jnp.bfloat16, "layer", mu=1e3, config=config,
                 interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    TileConfig(tile_m=256, tile_n=128), TileConfig(stats_once=True),
    TileConfig(epi_tile_n=32, stats_once=True, delay_release=1),
    TileConfig(max_concurrent_steps=3, pipeline="ring", delay_release=1),
])
@pytest.mark.parametrize("m", [8192, 8192 + 77])  # M % 8 != 0: x untiled, A from registers
def test_gpu_forward_configs(config, m):
  """The tile configs the defaults take at real sizes (statistics once per row block, the ring
  with 3 stages over 8 K steps, 256-row tiles), also with M % 8 != 0."""
  _run_and_check(m, 512, 1024, jnp.bfloat16, "layer", config=config, interpret=False)


# ------------------------------------------------------------------------------------------------
# The dx kernel of the backward: dx = rstd ⊙ (dy @ W_γᵀ) − y_term ⊙ (x − mean) − c_term.


@functools.partial(jax.jit, static_argnames=("norm",))
def _reference_forward_and_dx(x, w, scale, bias, dy, *, norm):
  """y, statistics and dx = (∂y/∂x)ᵀ dy of the f32 reference on the upcast inputs."""
  xf, wf, dyf = (a.astype(jnp.float32) for a in (x, w, dy))
  forward = lambda xf: reference.norm_matmul(xf, wf, scale, bias, norm=norm, eps=EPS,
                                             return_stats=True)
  (y, stats), vjp = jax.vjp(forward, xf)
  (dx_ref,) = vjp((dyf, jax.tree.map(jnp.zeros_like, stats)))
  return y, stats, dx_ref


def _run_dx_and_check(m, k, n, dtype, norm, *, mu=0.0, affine=True, config=None,
                      interpret=True, seed=0, tol=1e-2, fused=False, x_hat=False,
                      x_hat_ones=False, row_sums=False, col_sums=False, dw=False):
  """The dx kernel, fed the reference forward's y and statistics, against jax.grad of the
  f32 reference (the cotangent is rounded to ``dtype`` first, so both see the same dy).
  ``fused``: the kernel computes the row terms itself from y (rounded to ``dtype``, as the
  forward kernel returns it), out_bias and col_sum. ``x_hat``: the kernel also returns x̂,
  checked against (x − mean) · rstd in f32 to its rounding; ``x_hat_ones``: with its block of
  ones columns at the end (the padding columns between finite). ``row_sums``: the kernel
  forms the row sums over K in its epilogue (no y, no row terms given); ``col_sums``: it also
  returns Σ_i dy_i, checked against the float64 sum of the same dy; ``dw``: it also returns
  dW_γ = x̂ᵀ dy (with ``row_sums``), checked against the float64 product of x̂ rounded to
  ``dtype`` (as the kernel's WGMMA reads it) and dy."""
  x, w, scale, bias = _inputs(seed, m, k, n, dtype, mu=mu, affine=affine)
  dy = _normal(np.random.default_rng(seed + 1000), (m, n), dtype=dtype)
  y, stats, dx_ref = _reference_forward_and_dx(x, w, scale, bias, dy, norm=norm)
  w_gamma, col_sum, out_bias = _fold(w, scale, bias, norm)

  def dx_kernel(dy, w_gamma, x, y, rstd, mean, col_sum, out_bias):
    if row_sums:
      return nmb.norm_matmul_dx(dy, w_gamma, x, rstd, mean=mean, row_sums_in_epilogue=True,
                                return_x_hat=x_hat, x_hat_ones=x_hat_ones,
                                return_dy_col_sums=col_sums, return_dw_gamma=dw,
                                interpret=interpret, config=config)
    if fused:
      return nmb.norm_matmul_dx(dy, w_gamma, x, rstd, mean=mean, y=y.astype(dtype),
                                out_bias=out_bias, col_sum=col_sum, return_x_hat=x_hat,
                                x_hat_ones=x_hat_ones, interpret=interpret, config=config)
    y_term, c_term = nm_xla.row_terms(dy, y, col_sum, out_bias, rstd, k)
    return nmb.norm_matmul_dx(dy, w_gamma, x, rstd, y_term, mean, c_term, return_x_hat=x_hat,
                              x_hat_ones=x_hat_ones, interpret=interpret, config=config)

  out = jax.block_until_ready(jax.jit(dx_kernel)(dy, w_gamma, x, y, stats.rstd, stats.mean,
                                                 col_sum, out_bias))
  if dw:
    *out, dw_gamma = out
    out = tuple(out) if len(out) > 1 else out[0]
    _check_dw_gamma(dw_gamma, x, dy, stats, dtype)
  if col_sums:
    *out, dy_sums = out
    out = tuple(out) if x_hat else out[0]
    want = np.asarray(dy, np.float64).sum(axis=0)
    assert dy_sums.shape == (n,) and dy_sums.dtype == jnp.float32
    # f32 sums of M 16-bit values: a few f32 ulps of Σ|dy| per column.
    np.testing.assert_allclose(np.asarray(dy_sums), want, rtol=0, atol=1e-6 * float(
        np.abs(np.asarray(dy, np.float64)).sum(axis=0).max()))
  dx, x_hat_out = out if x_hat else (out, None)
  if interpret:
    assert not mgpu.races_found(), "the interpreter's race detector reported a race"
  assert dx.shape == (m, k) and dx.dtype == jnp.dtype(dtype)
  assert _all_finite(dx), "some outputs were never written (NaN-filled)"
  assert _rel_err(dx, dx_ref) < tol
  if x_hat:
    mean = 0.0 if stats.mean is None else np.asarray(stats.mean)[:, None]
    want = (np.asarray(x, np.float32) - mean) * np.asarray(stats.rstd)[:, None]
    assert x_hat_out.dtype == jnp.dtype(dtype)
    x_hat_out = np.asarray(x_hat_out, np.float32)
    assert np.isfinite(x_hat_out).all(), "some x̂ outputs were never written"
    if x_hat_ones:
      assert x_hat_out.shape[0] == m and x_hat_out.shape[1] > k
      assert np.all(x_hat_out[:, -1] == 1), "the ones column was not written"
      x_hat_out = x_hat_out[:, :k]
    assert x_hat_out.shape == (m, k)
    # One rounding of an f32 value to dtype: within half an ulp (2⁻⁹ relative for bf16).
    ulp = 2.0 ** -8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0 ** -11
    err = np.abs(x_hat_out - want)
    assert np.all(err <= ulp * np.abs(want) + 1e-6), float(np.max(err))


def _check_dw_gamma(dw_gamma, x, dy, stats, dtype):
  """dW_γ (K, N) f32 against x̂ᵀ dy in float64, x̂ = (x − mean) · rstd rounded once to dtype."""
  mean = 0.0 if stats.mean is None else np.asarray(stats.mean)[:, None]
  x_hat = jnp.asarray((np.asarray(x, np.float32) - mean) * np.asarray(stats.rstd)[:, None])
  x_hat = np.asarray(x_hat.astype(dtype), np.float64)
  want = x_hat.T @ np.asarray(dy, np.float64)
  assert dw_gamma.shape == want.shape and dw_gamma.dtype == jnp.float32
  got = np.asarray(dw_gamma, np.float64)
  assert np.isfinite(got).all(), "some dW_γ partials were never written"
  # f32 sums of M exact products: a few f32 ulps of Σ |x̂ dy| per entry.
  scale = np.abs(x_hat).T @ np.abs(np.asarray(dy, np.float64))
  np.testing.assert_array_less(np.abs(got - want), 1e-5 * scale + 1e-6)


DX_CASES = [
    # m, k, n, dtype, norm, mu, affine, config
    (77, 192, 128, jnp.bfloat16, "layer", 0.0, True, None),  # M tail, tile_n 192 over K
    (1, 64, 64, jnp.bfloat16, "rms", 0.0, True, None),
    # K = 320 with tile_n 192 (a partial column tile, several tiles per CTA) and large row means
    # through 256-row tiles with narrow epilogue tiles: X_HAT_CASES' first two (the same kernel
    # inputs; without the affine only the XLA row terms differ).
    # 3 row blocks, 2 column tiles on 2 CTAs
    (300, 128, 128, jnp.bfloat16, "layer", 0.0, True, TileConfig(tile_m=128, tile_n=64)),
    # one WGMMA in flight across reduction steps
    (200, 128, 256, jnp.bfloat16, "layer", 0.0, True, TileConfig(tile_m=128, tile_n=64,
                                                                 delay_release=1)),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,mu,affine,config", DX_CASES)
def test_dx_kernel_matches_autodiff(m, k, n, dtype, norm, mu, affine, config):
  _run_dx_and_check(m, k, n, dtype, norm, mu=mu, affine=affine, config=config)


# x̂ as a second output of the dx epilogue (the weight gradients' GEMM operand): M tails, a
# partial column tile and several tiles per CTA (the x̂ slot reused across tiles), large row
# means, the fused row terms on the shared ring.
# With x_hat_ones the ones block follows K padded to whole column tiles (K = 320, tile_n 192:
# 64 padding columns, then the block), stored by each row block's last column tile. One x̂ slot
# per warpgroup but where two cost no stage (the fused cases).
X_HAT_CASES = [
    # m, k, n, dtype, norm, mu, config, fused, ones
    (200, 320, 128, jnp.bfloat16, "rms", 0.0, None, False, True),
    (5, 128, 192, jnp.float16, "layer", 1e3, TileConfig(tile_m=256, tile_n=128, epi_tile_n=32),
     False, True),
    (77, 192, 128, jnp.bfloat16, "layer", 0.0, TileConfig(
        tile_m=128, tile_n=64, tile_k=32, max_concurrent_steps=3, pipeline="ring",
        delay_release=1), True, True),
    # 2 x̂ slots (fused, 32-wide steps leave room) used in turn by 4 epilogue tiles per tile
    (77, 128, 128, jnp.bfloat16, "layer", 0.0, TileConfig(tile_m=128, tile_n=128, tile_k=32,
                                                          epi_tile_n=32), True, False),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,mu,config,fused,ones", X_HAT_CASES)
def test_dx_kernel_returns_x_hat(m, k, n, dtype, norm, mu, config, fused, ones):
  _run_dx_and_check(m, k, n, dtype, norm, mu=mu, config=config, fused=fused, x_hat=True,
                    x_hat_ones=ones)


@pytest.mark.parametrize("m,k,n,norm,fused,ones", [
    # the default at 512²: fused row terms, 32-wide steps, ones column (a norm bias)
    (262144, 512, 512, "layer", True, True),
    (262144, 512, 2048, "layer", False, True),
    (262144 + 77, 512, 2048, "rms", False, False),  # M % 8 != 0: dy untiled, A from registers
])
def test_dx_with_x_hat_output_shapes(m, k, n, norm, fused, ones):
  """x̂'s columns at the default tiles: K, then a block of ones as wide as an epilogue tile.
  Shapes only (jax.eval_shape, nothing lowered): test_gpu_dx_x_hat compiles these paths."""
  spec = jax.ShapeDtypeStruct
  row, col = spec((m,), jnp.float32), spec((n,), jnp.float32)
  layer_row = row if norm == "layer" else None
  if fused:
    fn = lambda dy, w, x, r, mu, y, ob, cs: nmb.norm_matmul_dx(
        dy, w, x, r, mean=mu, y=y, out_bias=ob, col_sum=cs, return_x_hat=True,
        x_hat_ones=ones)
    extra = (layer_row, spec((m, n), jnp.bfloat16), col, col if norm == "layer" else None)
  else:
    fn = lambda dy, w, x, r, yt, mu, ct: nmb.norm_matmul_dx(dy, w, x, r, yt, mu, ct,
                                                            return_x_hat=True, x_hat_ones=ones)
    extra = (row, layer_row, layer_row)
  out = jax.eval_shape(fn, spec((m, n), jnp.bfloat16), spec((k, n), jnp.bfloat16),
                       spec((m, k), jnp.bfloat16), row, *extra)
  # 128×256 tiles, 64×32 epilogue tiles: a 32-column ones block after K = 512
  assert [a.shape for a in out] == [(m, k), (m, k + 32 if ones else k)]


def test_dx_bad_arguments_raise():
  dy = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((128, 64), jnp.bfloat16)
  x = jnp.ones((8, 128), jnp.bfloat16)
  r = jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="both given"):
    nmb.norm_matmul_dx(dy, w, x, r, r, r, None, interpret=True)
  with pytest.raises(ValueError, match="rstd"):
    nmb.norm_matmul_dx(dy, w, x, r[:4], r, interpret=True)
  with pytest.raises(ValueError, match="x \\(M, K\\)"):
    nmb.norm_matmul_dx(dy, w, x[:, :64], r, r, interpret=True)
  with pytest.raises(TypeError, match="share a dtype"):
    nmb.norm_matmul_dx(dy.astype(jnp.float16), w, x, r, r, interpret=True)
  with pytest.raises(ValueError, match="K = 96"):
    nmb.norm_matmul_dx(dy, w[:96], x[:, :96], r, r, interpret=True)
  with pytest.raises(ValueError, match="x_hat_ones needs return_x_hat"):
    nmb.norm_matmul_dx(dy, w, x, r, r, x_hat_ones=True, interpret=True)
  with pytest.raises(TypeError, match="return_x_hat"):
    nmb.norm_matmul_dx(dy, w, x, r, r, return_x_hat="yes", interpret=True)


# ------------------------------------------------------------------------------------------------
# Fused row terms: the dx kernel computes y_term / c_term from y in its own K loop.

# Every M in {1, 77, 256}, K and N in {64, 128, 192, 320}; several reduction steps (N > tile_k)
# and several column tiles per row block (K > tile_n); both norms, both dtypes, with and without
# the affine (out_bias None or not; LayerNorm without it streams col_sum alone), large row means.
FUSED_DX_CASES = [
    # m, k, n, dtype, norm, mu, affine, config
    (77, 192, 128, jnp.bfloat16, "layer", 0.0, True, None),  # M tail, 2 steps, tile_n 192
    (1, 64, 64, jnp.float16, "rms", 0.0, False, None),  # one row, one step, no out_bias
    # 5 column tiles per row block, 3 steps, chained pipelines across a CTA's 5 tiles
    (256, 320, 192, jnp.bfloat16, "rms", 0.0, True, TileConfig(tile_m=128, tile_n=64)),
    # rows of mean 1e2 (f16 resolves them), 5 steps, 2 column tiles
    (77, 128, 320, jnp.float16, "layer", 1e2, True, TileConfig(tile_m=128, tile_n=64)),
    # LayerNorm without the affine (col_sum only), 256-row tile, narrow epilogue tiles
    (256, 64, 128, jnp.bfloat16, "layer", 0.0, False, TileConfig(tile_m=256, tile_n=64,
                                                                 epi_tile_n=32)),
    # pick_config's 32-wide steps at 256×128 tiles (64-wide ones would leave a single stage)
    (77, 128, 128, jnp.bfloat16, "rms", 0.0, True, None),
    # one WGMMA in flight across steps; 6 32-wide steps
    (77, 128, 256, jnp.float16, "rms", 0.0, False, TileConfig(
        tile_m=128, tile_n=64, max_concurrent_steps=2, delay_release=1)),
    (77, 192, 128, jnp.float16, "layer", 1e2, True, TileConfig(tile_m=128, tile_n=128,
                                                               tile_k=32)),
    # the shared ring with the y and vector streams: 3 stages over 4 steps numbered across 3
    # column tiles per CTA, one WGMMA in flight
    (77, 192, 128, jnp.bfloat16, "layer", 0.0, True, TileConfig(
        tile_m=128, tile_n=64, tile_k=32, max_concurrent_steps=3, pipeline="ring",
        delay_release=1)),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,mu,affine,config", FUSED_DX_CASES)
def test_dx_fused_row_terms_match_autodiff(m, k, n, dtype, norm, mu, affine, config):
  _run_dx_and_check(m, k, n, dtype, norm, mu=mu, affine=affine, config=config, fused=True)


def _lazy_forward(x, w_gamma, col_sum, out_bias, *, norm, eps, out_dtype):
  """The forward kernel's epilogue math in plain XLA (``norm_matmul_fwd``'s interface), so the
  dx tests need not compile the forward kernel: the GEMM of x with W_γ accumulated in f32, then
  the row scaling (and mean correction) in f32. Two-pass statistics in f32."""
  row_stats = reference._row_stats  # pylint: disable=protected-access
  stats = row_stats(x.astype(jnp.float32), norm, eps)
  acc = jnp.matmul(x, w_gamma, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
  if norm == "layer":
    acc = acc - stats.mean[:, None] * col_sum[None, :]
  y = acc * stats.rstd[:, None]
  if out_bias is not None:
    y = y + out_bias
  return y.astype(out_dtype), stats.mean, stats.rstd


@pytest.mark.parametrize("norm,bias_scales", [("layer", (1.0, 30.0))])
def test_dx_fused_row_terms_agree_with_xla_row_terms(norm, bias_scales):
  """Same inputs, row terms from the kernel's K loop vs from the XLA pass (``_row_terms``): the
  same f32 math in another summation order, so dx agrees to output rounding. A large β (30:
  |out_bias| ≫ the spread of y) checks that y − out_bias is formed per element (two large
  sums would cancel). Each kernel is compiled once for all the bias scales. LayerNorm only:
  RMSNorm's row terms are LayerNorm's without c_term (FUSED_DX_CASES check them)."""
  m, k, n, dtype = 77, 128, 192, jnp.bfloat16
  x, w, scale, bias = _inputs(7, m, k, n, dtype)
  dy = _normal(np.random.default_rng(8), (m, n), dtype=dtype)
  cfg = TileConfig(tile_m=128, tile_n=64)  # 2 column tiles, 3 steps
  fused_dx = jax.jit(lambda dy, w_gamma, x, rstd, mean, y, out_bias, col_sum: nmb.norm_matmul_dx(
      dy, w_gamma, x, rstd, mean=mean, y=y, out_bias=out_bias, col_sum=col_sum, interpret=True,
      config=cfg))
  dx = jax.jit(lambda dy, w_gamma, x, rstd, y_term, mean, c_term: nmb.norm_matmul_dx(
      dy, w_gamma, x, rstd, y_term, mean, c_term, interpret=True, config=cfg))
  forward = jax.jit(lambda x, w_gamma, col_sum, out_bias: _lazy_forward(
      x, w_gamma, col_sum, out_bias, norm=norm, eps=EPS, out_dtype=dtype))
  row_terms = jax.jit(lambda dy, y, col_sum, out_bias, rstd: nm_xla.row_terms(
      dy, y, col_sum, out_bias, rstd, k))
  for bias_scale in bias_scales:
    w_gamma, col_sum, out_bias = _fold(w, scale, bias * bias_scale, norm)
    y, mean, rstd = forward(x, w_gamma, col_sum, out_bias)
    fused = jax.block_until_ready(fused_dx(dy, w_gamma, x, rstd, mean, y, out_bias, col_sum))
    assert not mgpu.races_found()
    y_term, c_term = row_terms(dy, y, col_sum, out_bias, rstd)
    want = dx(dy, w_gamma, x, rstd, y_term, mean, c_term)
    assert _all_finite(fused), bias_scale
    assert _rel_err(fused, want) < 2e-3, (bias_scale, _rel_err(fused, want))


def test_dx_fused_bad_arguments_raise():
  """Mixed or incomplete row-term inputs are refused, naming the argument, before any kernel
  runs."""
  m, n, k = 8, 64, 128
  dy = jnp.ones((m, n), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16)
  x = jnp.ones((m, k), jnp.bfloat16)
  r = jnp.ones((m,), jnp.float32)
  v = jnp.ones((n,), jnp.float32)
  call = lambda *a, **kw: nmb.norm_matmul_dx(dy, w, x, *a, interpret=True, **kw)
  with pytest.raises(ValueError, match="y_term must be None"):
    call(r, r, y=dy)
  with pytest.raises(ValueError, match="c_term must be None"):
    call(r, None, r, r, y=dy, col_sum=v)
  with pytest.raises(ValueError, match="out_bias"):
    call(r, r, out_bias=v)
  with pytest.raises(ValueError, match="col_sum"):
    call(r, r, r, r, col_sum=v)
  with pytest.raises(ValueError, match="y_term is required"):
    call(r)
  with pytest.raises(ValueError, match="rstd is required"):
    call(None, y=dy)
  with pytest.raises(ValueError, match="y must have dy's shape"):
    call(r, y=dy[:, :32])
  with pytest.raises(TypeError, match="y must have dy's dtype"):
    call(r, y=dy.astype(jnp.float32))
  with pytest.raises(TypeError, match="y must be an array"):
    call(r, y=1.0)
  with pytest.raises(ValueError, match="mean and col_sum"):
    call(r, mean=r, y=dy)
  with pytest.raises(ValueError, match="mean and col_sum"):
    call(r, y=dy, col_sum=v)
  with pytest.raises(ValueError, match="out_bias must be float32"):
    call(r, y=dy, out_bias=v[:32])
  with pytest.raises(ValueError, match="col_sum must be float32"):
    call(r, mean=r, y=dy, col_sum=v.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="out_bias must be an array"):
    call(r, y=dy, out_bias=[0.0] * n)


def test_dx_fused_plan_and_config():
  """SMEM: the y stage (and the vectors' block) shrink the pipeline; at K = N = 512 the default
  128×256 tiles keep 2 ring stages of 64-wide steps (64.5 KiB each; 3 without y), 4 of 32-wide
  ones, which pick_config takes for the fused row terms (measured faster)."""
  m = 262144
  base = nmb.pick_config(m, 512, 512)
  assert base.tile_k == 64
  assert nmb.pick_config(m, 512, 512, fused_row_terms=True) == dataclasses.replace(base,
                                                                                  tile_k=32)
  plan = lambda cfg, fused: nmb._make_plan(m, 512, 512, jnp.bfloat16, True, cfg, False,
                                           fused=fused, has_bias=True)
  assert (plan(base, False).stages, plan(base, False).chained) == (3, False)
  fused = plan(base, True)
  assert (fused.stages, fused.chained, fused.n_rows, fused.n_vecs) == (2, False, 2, 2)
  k32 = plan(dataclasses.replace(base, tile_k=32), True)
  assert (k32.stages, k32.chained) == (4, False)
  for cfg, stages in ((base, fused.stages), (dataclasses.replace(base, tile_k=32), k32.stages)):
    used = (stages * sum(st.nbytes for st in nmb._streams(cfg, jnp.bfloat16, False, True, 2))
            + gemm_core.smem_bytes(nmb._smem(cfg, jnp.bfloat16, 2)))
    assert used <= mgpu.SMEM_BYTES
  small = nmb.pick_config(m, 128, 128, fused_row_terms=True)
  assert (small.tile_m, small.tile_n, small.tile_k) == (256, 128, 32)
  assert nmb.pick_config(m, 128, 128).tile_k == 64


# RMSNorm without a norm bias: no vector stream at all, a variant no gpu test runs (they
# compile the others: defaults, M % 8 != 0, 256×128 tiles, a WGMMA in flight).
@pytest.mark.parametrize("m,k,n,norm,bias,config", [
    (262144, 512, 512, "rms", False, TileConfig(tile_k=32)),
])
def test_dx_fused_row_terms_lower_for_hopper(m, k, n, norm, bias, config):
  spec = jax.ShapeDtypeStruct
  row, col = spec((m,), jnp.float32), spec((n,), jnp.float32)
  fn = jax.jit(lambda dy, w, x, r, mu, y, ob, cs: nmb.norm_matmul_dx(
      dy, w, x, r, mean=mu, y=y, out_bias=ob, col_sum=cs, config=config))
  exported = export.export(fn, platforms=["cuda"])(
      spec((m, n), jnp.bfloat16), spec((k, n), jnp.bfloat16), spec((m, k), jnp.bfloat16), row,
      row if norm == "layer" else None, spec((m, n), jnp.bfloat16), col if bias else None,
      col if norm == "layer" else None)
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096 + 77, 512, 512), (262144, 512, 512), (1, 128, 128),
                                   (65536, 2048, 2048)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_dx(m, k, n, norm, fused):
  _run_dx_and_check(m, k, n, jnp.bfloat16, norm, interpret=False, fused=fused)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,norm,fused", [
    (4096 + 77, 512, 512, "layer", True),  # the default at 512²: fused row terms
    (8192, 512, 2048, "layer", False),
    (8192 + 77, 512, 2048, "rms", False),  # M % 8 != 0: dy untiled, A from registers
    (4096, 512, 512, "rms", False),
])
def test_gpu_dx_x_hat(m, k, n, norm, fused):
  """dx and x̂ from the same epilogue at real sizes (the backward's default with x̂; LayerNorm
  with the ones column, as with a norm bias)."""
  _run_dx_and_check(m, k, n, jnp.bfloat16, norm, interpret=False, fused=fused, x_hat=True,
                    x_hat_ones=norm == "layer")


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,norm", [
    (262144, 512, 512, "layer"),  # cluster of 2, 4 steps per CTA
    (8192, 512, 2048, "layer"),  # 16 steps per CTA
    (4096 + 8, 1024, 1024, "rms"),  # cluster of 4, a partial row block
    (65536, 2048, 512, "layer"),  # cluster of 8: one step per CTA, consumer 1's row zero
    (8, 128, 128, "layer"),  # one row block, mostly rows past M
])
def test_gpu_dx_col_sums(m, k, n, norm):
  """Σ_i dy_i from the dx kernel's dy stages, read transposed (a layout interpret mode does
  not check), across the clusters' CTAs."""
  _run_dx_and_check(m, k, n, jnp.bfloat16, norm, interpret=False, x_hat=True, row_sums=True,
                    col_sums=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,norm,col_sums", [
    (262144, 128, "layer", True),  # the suite's shape: ~15 row blocks per CTA
    (262144, 128, "rms", False),
    (4096 + 8, 64, "layer", False),  # a partial row block, N = 64
    (8, 128, "rms", True),  # one row block, mostly rows past M
])
def test_gpu_dx_dw_gamma(m, n, norm, col_sums):
  """dW_γ = x̂ᵀ dy summed by the dx kernel: the two consumers' x̂ exchange through SMEM and
  their barriers, WGMMA's transposed A, in real asynchrony. Only these check the ``ready`` /
  ``free`` protocol: interpret mode runs WGMMA at once and its race detector does not see
  WGMMA's SMEM reads (a review removed the ``free`` barrier, then ``ready``, and no interpret
  test failed but for NaNs without ``ready``)."""
  _run_dx_and_check(m, 128, n, jnp.bfloat16, norm, interpret=False, row_sums=True,
                    col_sums=col_sums, dw=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_dx_large_mean(fused):
  _run_dx_and_check(4096 + 77, 512, 512, jnp.float16, "layer", mu=1e3, interpret=False,
                    fused=fused)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [TileConfig(tile_m=256, tile_n=128, tile_k=32),
                                    TileConfig(epi_tile_n=32), TileConfig(delay_release=1)])
@pytest.mark.parametrize("m", [8192, 8192 + 77])
def test_gpu_dx_configs(config, m):
  """dx under other tilings at real sizes, with M % 8 != 0 (dy and y untiled, A from
  registers) too; the fused row terms (one more input stream) on the same tiles."""
  _run_dx_and_check(m, 512, 512, jnp.bfloat16, "layer", config=config, interpret=False,
                    fused=True)


def test_resident_clusters_fit_the_gpcs():
  """Clusters must sit inside one GPC: on the H200, 30 clusters of 4 and 15 of 8 fit at once
  (measured), not 132 // 4 = 33 and 132 // 8 = 16."""
  counts = [mgpu.resident_clusters(c, interpret=False) for c in (1, 2, 4, 8)]
  if mgpu.num_sms(False) == 132:
    assert counts == [132, 66, 30, 15]
  for c, count in zip((1, 2, 4, 8), counts):
    assert 1 <= count * c <= mgpu.num_sms(False)


def test_persistent_clusters_respects_the_work():
  assert mgpu.persistent_clusters(1, 5, interpret=False) == 5  # fewer units than SMs
  assert mgpu.persistent_clusters(4, 1000, interpret=False) == (
      mgpu.resident_clusters(4, interpret=False))


@pytest.mark.parametrize("m,k,n,once", [
    (262144, 512, 512, True), (262144, 1024, 1024, True), (262144, 512, 256, False),
    (4096, 512, 2048, False), (8 * 132 * 128, 512, 1024, True), (262144, 2048, 2048, False)])
def test_pick_config_stats_once(m, k, n, once):
  """Statistics once per row block only with several N tiles, >= 8 waves of row blocks, and
  row blocks in flight that fit in L2 (K = 2048 does not: measured slower on the H200)."""
  assert nmk.pick_config(m, k, n).stats_once is once


def test_delay_release_off_with_register_a_operand():
  """A WGMMA left in flight across K steps would still read its A registers while the next step
  loads new ones (wrong y on the H200 for M % 8 != 0 with delay_release=1), so plans with a
  register A operand run with delay_release 0, forward and dx alike."""
  cfg = TileConfig(delay_release=1)
  assert mgpu.plan_delay_release(cfg, 4) == 1
  assert mgpu.plan_delay_release(cfg, 4, a_in_registers=True) == 0
  assert mgpu.plan_delay_release(TileConfig(), 4, a_in_registers=True) == 0


# ------------------------------------------------------------------------------------------------
# The row sums in the dx epilogue: dx = rstd ⊙ (G − mean_K(G) − x̂ ⊙ mean_K(G ⊙ x̂)) from the
# accumulator and the x tile, summed across the cluster's CTAs (one CTA in interpret mode: K ≤
# 256; the clusters of 2-8 lower below and run in the GPU tests).

ROW_SUMS_CASES = [
    # m, k, n, dtype, norm, mu, config, x_hat, ones
    (77, 192, 128, jnp.bfloat16, "layer", 0.0, None, False, False),  # M tail, tile_n 192
    (1, 64, 64, jnp.bfloat16, "rms", 0.0, None, True, False),  # one row, one step
    # 3 row blocks on 2 CTAs (x refilled after the previous block's stores), x̂ with the ones
    # block, 5 reduction steps
    (300, 256, 320, jnp.bfloat16, "layer", 0.0, None, True, True),
    # rows of mean 1e3 (f16 resolves them), one WGMMA in flight across steps
    (77, 128, 192, jnp.float16, "layer", 1e3, TileConfig(tile_m=128, tile_n=128,
                                                         delay_release=1), True, False),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,mu,config,x_hat,ones", ROW_SUMS_CASES)
def test_dx_kernel_row_sums_in_epilogue(m, k, n, dtype, norm, mu, config, x_hat, ones):
  _run_dx_and_check(m, k, n, dtype, norm, mu=mu, config=config, x_hat=x_hat, x_hat_ones=ones,
                    row_sums=True)


# Σ_i dy_i from the dx kernel's dy stages (a norm bias's gradients without x̂'s ones block):
# one CTA in interpret mode, so its two consumers split the steps (odd step counts leave
# consumer 1 a zero row), M tails (rows past M read as zeros), one row, several row blocks per
# CTA (the sums carried across them in SMEM), a WGMMA in flight across steps.
COL_SUMS_CASES = [
    # m, k, n, dtype, norm, config
    (77, 128, 128, jnp.bfloat16, "layer", None),
    (1, 64, 64, jnp.float16, "rms", None),
    (600, 128, 320, jnp.bfloat16, "layer", TileConfig(tile_m=128, tile_n=128, tile_k=64)),
    (300, 64, 576, jnp.float16, "layer", TileConfig(tile_m=128, tile_n=64, tile_k=64,
                                                    delay_release=1)),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,config", COL_SUMS_CASES)
def test_dx_kernel_returns_dy_col_sums(m, k, n, dtype, norm, config):
  _run_dx_and_check(m, k, n, dtype, norm, config=config, x_hat=True, row_sums=True,
                    col_sums=True)


# dW_γ = x̂ᵀ dy summed in the dx kernel (K = 128, N ≤ 128): several row blocks per CTA (x̂ and
# dy's tiles refilled after both consumers' WGMMAs read them), M tails (rows past M zero in
# both operands), one row, N = 64, with dy's column sums beside it, float16.
DW_CASES = [
    # m, k, n, dtype, norm, col_sums
    (600, 128, 128, jnp.bfloat16, "layer", True),
    (77, 128, 64, jnp.float16, "rms", False),
    (1, 128, 128, jnp.bfloat16, "layer", False),
    (300, 128, 128, jnp.bfloat16, "rms", True),
]


@pytest.mark.parametrize("m,k,n,dtype,norm,col_sums", DW_CASES)
def test_dx_kernel_returns_dw_gamma(m, k, n, dtype, norm, col_sums):
  _run_dx_and_check(m, k, n, dtype, norm, row_sums=True, col_sums=col_sums, dw=True)


def test_dw_gamma_unsupported_reasons():
  """Where the kernel cannot sum dW_γ (the op then takes x̂ and cuBLAS's GEMM) it says why,
  and norm_matmul_dx raises it (or a conflicting flag) as a ValueError before any kernel."""
  def reason(m, n, k, interpret=False):
    cfg = nmb.pick_config(m, n, k, row_sums=True, interpret=interpret)
    return nmb.dw_gamma_unsupported_reason(m, n, k, jnp.bfloat16, cfg, layer=True,
                                           interpret=interpret)
  assert reason(262144, 128, 128) is None
  assert reason(262144, 64, 128) is None
  assert "tile_n = 128" in reason(262144, 256, 256)
  assert "N ≤ 128" in reason(262144, 256, 128)
  assert "multiple of 8" in reason(262144 + 77, 128, 128)
  assert "one CTA" in reason(262144, 512, 512)
  assert "split into 1, 2, 4 or 8" in nmb.dw_gamma_unsupported_reason(
      300, 512, 512, jnp.bfloat16, TileConfig(), layer=True, interpret=True)
  dy, x = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((8, 128), jnp.bfloat16)
  w, r = jnp.ones((128, 128), jnp.bfloat16), jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="return_dw_gamma needs row_sums_in_epilogue"):
    nmb.norm_matmul_dx(dy, w, x, r, r, mean=r, c_term=r, return_dw_gamma=True, interpret=True)
  with pytest.raises(ValueError, match="return_dw_gamma needs row_sums_in_epilogue"):
    nmb.norm_matmul_dx(dy, w, x, r, return_dw_gamma=True, interpret=True)  # before y_term's
  narrow = dataclasses.replace(nmb.pick_config(8, 128, 128, row_sums=True, interpret=True),
                               epi_tile_n=32)  # a review's crash: 32-wide x̂ chunks
  with pytest.raises(ValueError, match="return_dw_gamma: .*64-column epilogue tiles"):
    nmb.norm_matmul_dx(dy, w, x, r, mean=r, row_sums_in_epilogue=True, return_dw_gamma=True,
                       interpret=True, config=narrow)
  with pytest.raises(ValueError, match="return_x_hat=False"):
    nmb.norm_matmul_dx(dy, w, x, r, mean=r, row_sums_in_epilogue=True, return_x_hat=True,
                       return_dw_gamma=True, interpret=True)
  with pytest.raises(ValueError, match="return_dw_gamma: .*N ≤ 128"):
    nmb.norm_matmul_dx(jnp.ones((8, 256), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16), x,
                       r, mean=r, row_sums_in_epilogue=True, return_dw_gamma=True,
                       interpret=True)
  with pytest.raises(TypeError, match="return_dw_gamma"):
    nmb.norm_matmul_dx(dy, w, x, r, mean=r, row_sums_in_epilogue=True, return_dw_gamma=1,
                       interpret=True)


@pytest.mark.parametrize("norm,sums", [("layer", True), ("rms", False)])
def test_dx_dw_gamma_lowers_for_hopper(monkeypatch, norm, sums):
  """The dx kernel with dW_γ (transposed x̂ as WGMMA's A, dy's whole tile as B, the partial's
  f32 stores) lowers for sm_90a (jax.export for "cuda"; nothing runs)."""
  fake = lambda interpret: 2 if interpret else 132  # noqa: E731  an H100/H200's 132 SMs
  monkeypatch.setattr(mgpu, "num_sms", fake)
  monkeypatch.setattr(mgpu.device, "num_sms", fake)
  m, k, n = 262144, 128, 128
  spec = jax.ShapeDtypeStruct
  row = spec((m,), jnp.float32)
  fn = lambda dy, w, x, r, mu: nmb.norm_matmul_dx(  # noqa: E731
      dy, w, x, r, mean=mu, row_sums_in_epilogue=True, return_dy_col_sums=sums,
      return_dw_gamma=True)
  exported = export.export(jax.jit(fn), platforms=["cuda"])(
      spec((m, n), jnp.bfloat16), spec((k, n), jnp.bfloat16), spec((m, k), jnp.bfloat16), row,
      row if norm == "layer" else None)
  assert "mosaic_gpu" in exported.mlir_module()
  assert [a.shape for a in exported.out_avals] == [(m, k)] + ([(n,)] if sums else []) + [(k, n)]


def test_dy_col_sums_unsupported_reasons():
  """Where the kernel cannot sum dy's columns (the op then takes x̂'s ones block), it says
  why, and norm_matmul_dx raises it as a ValueError before any kernel runs."""
  def reason(m, n, k, interpret=False, layer=True):
    cfg = nmb.pick_config(m, n, k, x_hat=True, row_sums=True, interpret=interpret)
    return nmb.dy_col_sums_unsupported_reason(m, n, k, jnp.bfloat16, cfg, layer=layer,
                                              x_hat=True, interpret=interpret)
  assert reason(262144, 2048, 512) is None
  assert reason(262144, 2048, 512, layer=False) is None
  assert "multiple of 8" in reason(262144 + 77, 2048, 512)
  assert "costs a stage" in reason(262144, 4096, 512)
  assert "multiples of 64" in reason(300, 320, 256, interpret=True)  # 32-wide steps
  dy, x = jnp.ones((300, 320), jnp.bfloat16), jnp.ones((300, 256), jnp.bfloat16)
  r = jnp.ones((300,), jnp.float32)
  with pytest.raises(ValueError, match="return_dy_col_sums: .*multiples of 64"):
    nmb.norm_matmul_dx(dy, jnp.ones((256, 320), jnp.bfloat16), x, r, mean=r,
                       row_sums_in_epilogue=True, return_x_hat=True, return_dy_col_sums=True,
                       interpret=True)
  with pytest.raises(ValueError, match="return_dy_col_sums needs row_sums_in_epilogue"):
    nmb.norm_matmul_dx(dy[:, :64], jnp.ones((64, 64), jnp.bfloat16), x[:, :64], r, r,
                       return_dy_col_sums=True, interpret=True)
  # A config that fails without the sums too is reported as such, not blamed on them.
  with pytest.raises(ValueError, match="^row sums in the epilogue need K = 128"):
    nmb.norm_matmul_dx(dy[:, :128], jnp.ones((128, 128), jnp.bfloat16), x[:, :128], r,
                       mean=r, row_sums_in_epilogue=True, return_x_hat=True,
                       return_dy_col_sums=True, interpret=True,
                       config=TileConfig(tile_m=128, tile_n=64, tile_k=64))


@pytest.mark.parametrize("m,k,n,norm,ones,sums", [
    (262144, 512, 512, "layer", True, False),  # cluster of 2 (push), the ones block
    (262144 + 77, 1024, 1024, "rms", False, False),  # cluster of 4 (pull), A from registers
    (65536, 2048, 512, "layer", False, True),  # cluster of 8, dy's column sums
    (262144, 512, 2048, "layer", False, True),  # 16 steps' sums per CTA
])
def test_dx_row_sums_lower_for_hopper(monkeypatch, m, k, n, norm, ones, sums):
  """The row sums' cluster exchange (and dy's column sums) lower for sm_90a (jax.export for
  "cuda"; nothing runs; the transposed stage reads compile only past this point:
  test_gpu_dx_col_sums)."""
  fake = lambda interpret: 2 if interpret else 132  # noqa: E731  an H100/H200's 132 SMs
  monkeypatch.setattr(mgpu, "num_sms", fake)
  monkeypatch.setattr(mgpu.device, "num_sms", fake)
  spec = jax.ShapeDtypeStruct
  row = spec((m,), jnp.float32)
  fn = lambda dy, w, x, r, mu: nmb.norm_matmul_dx(  # noqa: E731
      dy, w, x, r, mean=mu, return_x_hat=True, x_hat_ones=ones, row_sums_in_epilogue=True,
      return_dy_col_sums=sums)
  exported = export.export(jax.jit(fn), platforms=["cuda"])(
      spec((m, n), jnp.bfloat16), spec((k, n), jnp.bfloat16), spec((m, k), jnp.bfloat16), row,
      row if norm == "layer" else None)
  assert "mosaic_gpu" in exported.mlir_module()
  assert [a.shape for a in exported.out_avals] == [(m, k), (m, k + 32 if ones else k)] + (
      [(n,)] if sums else [])


def test_dx_row_sums_bad_arguments_raise():
  dy = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((512, 64), jnp.bfloat16)
  x = jnp.ones((8, 512), jnp.bfloat16)
  r = jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="y_term must be None with row_sums_in_epilogue"):
    nmb.norm_matmul_dx(dy, w[:128], x[:, :128], r, r, row_sums_in_epilogue=True,
                       interpret=True)
  with pytest.raises(ValueError, match="interpret mode: a cluster of 1"):
    nmb.norm_matmul_dx(dy, w, x, r, row_sums_in_epilogue=True, interpret=True)
  with pytest.raises(ValueError, match="K = 4096 does not split"):
    nmb.norm_matmul_dx(jnp.ones((8, 64), jnp.bfloat16), jnp.ones((4096, 64), jnp.bfloat16),
                       jnp.ones((8, 4096), jnp.bfloat16), r, row_sums_in_epilogue=True)
  with pytest.raises(TypeError, match="row_sums_in_epilogue"):
    nmb.norm_matmul_dx(dy, w[:128], x[:, :128], r, row_sums_in_epilogue="yes", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,norm,x_hat", [
    (4096 + 77, 512, 512, "layer", True),  # cluster of 2, the backward's default at 512²
    (8192, 1024, 512, "rms", False),  # cluster of 4
    (8192 + 77, 2048, 512, "layer", True),  # cluster of 8, M % 8 != 0
])
def test_gpu_dx_row_sums(m, k, n, norm, x_hat):
  """The row sums in the dx epilogue with their cluster exchange, at real sizes."""
  _run_dx_and_check(m, k, n, jnp.bfloat16, norm, interpret=False, x_hat=x_hat,
                    x_hat_ones=x_hat and norm == "layer", row_sums=True)


# Found by a mutation test (each failed to notice its mutant before).

def test_rms_statistics_take_eps_zero_rows_and_a_large_eps():
  """RMSNorm's eps in the forward kernel: a zero row (a padding token) gives rstd = 1/√eps and
  y = out_bias, finite, and at eps = 0.5 rstd = 1/√(mean(x²) + eps) (at 1e-6 on rows of unit
  variance eps moves rstd by 5e-7, below every other test's tolerance)."""
  m, k, n = 77, 128, 64
  rng = np.random.default_rng(0)
  xn = rng.standard_normal((m, k)).astype(np.float32)
  xn[5] = 0.0
  x = jnp.asarray(xn).astype(jnp.bfloat16)
  w = jnp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32)).astype(
      jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(n).astype(np.float32))
  xf = np.asarray(x, np.float64)
  for eps in (1e-6, 0.5):
    y, _, rstd = nmk.norm_matmul_fwd(x, w, None, bias, norm="rms", eps=eps,
                                     out_dtype=jnp.float32, interpret=True)
    want = 1 / np.sqrt(np.mean(xf * xf, 1) + eps)
    y_want = (xf * want[:, None]) @ np.asarray(w, np.float64) + np.asarray(bias, np.float64)
    assert np.all(np.isfinite(np.asarray(y)))
    np.testing.assert_allclose(np.asarray(rstd, np.float64), want, rtol=1e-4)
    assert np.linalg.norm(np.asarray(y, np.float64) - y_want) / np.linalg.norm(y_want) < 1e-2


def test_dx_kernel_x_hat_ones_block_is_all_ones():
  """With ``x_hat_ones`` every column of the block after K's padded tiles is exactly 1 (the
  weight GEMM's last rows are Σ dy from it); other tests read only its last column."""
  m, k, n = 200, 320, 128
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray((rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32)).astype(
      jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, n)).astype(np.float32)).astype(jnp.bfloat16)
  xf = np.asarray(x, np.float64)
  rstd = jnp.asarray((1 / np.sqrt(np.mean(xf * xf, 1) + 1e-6)).astype(np.float32))
  _, x_hat = nmb.norm_matmul_dx(dy, w, x, rstd, jnp.zeros((m,), jnp.float32), None, None,
                                return_x_hat=True, x_hat_ones=True, interpret=True)
  cfg = nmb.pick_config(m, n, k, x_hat=True, interpret=True)
  k_padded = -(-k // cfg.tile_n) * cfg.tile_n
  block = np.asarray(x_hat, np.float32)[:, k_padded:]
  assert block.size and np.all(block == 1)


def test_row_sums_added_in_cta_order():
  """The dx kernel's cluster row sums: every CTA's partials, in CTA order (interpret mode runs a
  cluster of 1, so only this unit test sees a partial dropped)."""
  per_cta = [(jnp.full((4,), 10.0 ** i), jnp.full((4,), -10.0 ** i)) for i in range(4)]
  got = nmb._sum_in_cta_order(per_cta)  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(got[0]), np.full(4, 1111.0))
  np.testing.assert_array_equal(np.asarray(got[1]), np.full(4, -1111.0))


# Non-finite inputs (README, Limitations): where the lazy forms give NaN for the reference's ±inf.
# (norm, what is made non-finite, with a norm_bias) -> the implementations that give NaN where
# the reference has ±inf; every other case gives the reference's NaN/±inf exactly.
NON_FINITE_CASES = {
    ("layer", "w", False): {"interpret"},       # x W_γ − mean ⊗ 1ᵀW_γ: inf − inf
    ("layer", "w", True): {"interpret"},
    ("layer", "scale", False): {"interpret"},   # scale's row of W_γ is inf: every col_sum is
    ("rms", "w", False): set(),
    ("rms", "w", True): {"xla", "interpret"},   # rstd ⊙ (x W_γ) + βᵀW: inf − inf
    ("rms", "scale", True): set(),
    ("layer", "norm_bias", True): set(),
    ("layer", "x", True): set(),
    ("rms", "x", False): set(),
    ("layer", "w_nan", True): set(),
}


@pytest.mark.parametrize("norm,bad,use_bias", list(NON_FINITE_CASES),
                         ids=["-".join(map(str, c)) for c in NON_FINITE_CASES])
def test_non_finite_inputs_give_the_references_non_finite_positions(norm, bad, use_bias):
  """An inf in w (w[3, 5]), scale (scale[7]), norm_bias (norm_bias[9]) or x (x[2, 4]), or a NaN
  in w: the "xla" and kernel ("interpret") paths are non-finite exactly where the float32
  reference is, with the reference's inf signs, and finite values close to it; they give NaN
  where the reference gives ±inf only in the README's cases (NON_FINITE_CASES). bfloat16 only:
  float16 runs the same formulas (the review's 176 combinations, both dtypes, agreed)."""
  dtype = jnp.bfloat16
  x, w, scale, bias = _inputs(17, 64, 128, 64, dtype)
  scale, bias = scale.astype(dtype), (bias.astype(dtype) if use_bias else None)
  if bad == "w":
    w = w.at[3, 5].set(jnp.inf)
  elif bad == "w_nan":
    w = w.at[3, 5].set(jnp.nan)
  elif bad == "scale":
    scale = scale.at[7].set(jnp.inf)
  elif bad == "norm_bias":
    bias = bias.at[9].set(jnp.inf)
  else:
    x = x.at[2, 4].set(jnp.inf)
  f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
  want = np.asarray(reference.norm_matmul(f32(x), f32(w), scale=f32(scale), norm_bias=f32(bias),
                                          norm=norm, eps=EPS))
  assert not np.isfinite(want).all()
  for impl in ("xla", "interpret"):
    got = np.asarray(pn.norm_matmul(x, w, scale=scale, norm_bias=bias, norm=norm, eps=EPS,
                                    implementation=impl), np.float32)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=impl)
    inf = np.isinf(got)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=impl)  # same signs
    assert not (np.isnan(got) & ~np.isnan(want) & ~np.isinf(want)).any()
    nan_for_inf = np.isnan(got) & np.isinf(want)
    assert nan_for_inf.any() == (impl in NON_FINITE_CASES[norm, bad, use_bias]), (
        impl, int(nan_for_inf.sum()))
    if finite.any():
      assert _rel_err(got[finite], want[finite]) < 1e-2, impl
