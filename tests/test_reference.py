"""Forward values of every op, public API (implementation="xla") and `pallas_norm.reference`,
against the independent float64 numpy formulas of `_numpy_oracle` (DESIGN.md math).

Tolerances (`TOL`) are relative to max(1, max|expected|) (see `_numpy_oracle.assert_close`):
* float64 inputs: the same math in float64, only the summation order differs: 1e-10.
* float32 inputs: products accumulate in float32 over K <= 769 and statistics are float32:
  a few hundred float32 ulps (6e-8 each): 2e-5.
* bfloat16 inputs: the output is rounded to bfloat16 (2^-9 relative) and so are the operands
  the reference feeds to its second product (norm(x) in norm_matmul, act(s) in gdpa, u in
  flash_norm_attention): a few bfloat16 ulps after accumulation: 3e-2.
Statistics (NormStats) are float32 for float32/bfloat16 inputs: compared at `STATS_TOL`.
"""

from __future__ import annotations

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _numpy_oracle as npo
import pallas_norm
from pallas_norm import jagged, reference

TOL = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2}
STATS_TOL = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 2e-5}  # stats of the same inputs
OPS = ("rms_norm", "layer_norm", "norm_matmul", "matmul_norm", "gdpa", "flash_norm_attention")


@pytest.fixture(params=["public_xla", "reference"])
def ops(request):
  """The op namespace under test: the public API forced to XLA, or the reference module."""
  if request.param == "reference":
    return types.SimpleNamespace(**{n: getattr(reference, n) for n in OPS})
  return types.SimpleNamespace(**{
      n: functools.partial(getattr(pallas_norm, n), implementation="xla") for n in OPS})


@pytest.fixture(params=["float32", "float64", "bfloat16"])
def dtype(request):
  """Input dtype; float64 runs with x64 enabled for this test only."""
  if request.param == "float64":
    with jax.enable_x64(True):
      yield jnp.dtype(jnp.float64)
  else:
    yield jnp.dtype(request.param)


@pytest.fixture
def rng(request):
  return np.random.default_rng(npo.seed_of(request.node.nodeid))


def rand(rng, shape, dtype, *, loc=0.0, scale=1.0):
  return jnp.asarray(loc + scale * rng.standard_normal(shape), dtype)


def tol(dtype) -> float:
  return TOL[jnp.dtype(dtype).name]


def stat_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# ---- rms_norm / layer_norm ------------------------------------------------------------------

NORM_SHAPES = [(1, 3), (5, 17), (2, 3, 769)]  # M=1, non-power-of-two N, leading batch dims


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_all_options(ops, dtype, shape, rng):
  n = shape[-1]
  x, res = rand(rng, shape, dtype), rand(rng, shape, dtype, scale=0.5)
  scale = rand(rng, (n,), dtype, loc=1.0, scale=0.2)
  y, s = ops.rms_norm(x, scale, res, eps=1e-5)
  want_y, want_s, _ = npo.rms_norm(x, scale, res, eps=1e-5)
  chex.assert_shape([y, s], shape)
  chex.assert_type([y, s], dtype)
  npo.assert_close(y, want_y, tol(dtype), "y")
  npo.assert_close(s, want_s, tol(dtype), "s = x + residual")


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_layer_norm_all_options(ops, dtype, shape, rng):
  n = shape[-1]
  x, res = rand(rng, shape, dtype, loc=0.3), rand(rng, shape, dtype, scale=0.5)
  scale = rand(rng, (n,), dtype, loc=1.0, scale=0.2)
  bias = rand(rng, (n,), dtype, scale=0.2)
  y, s = ops.layer_norm(x, scale, bias, res, eps=1e-5)
  want_y, want_s, _, _ = npo.layer_norm(x, scale, bias, res, eps=1e-5)
  chex.assert_shape([y, s], shape)
  chex.assert_type([y, s], dtype)
  npo.assert_close(y, want_y, tol(dtype), "y")
  npo.assert_close(s, want_s, tol(dtype), "s = x + residual")


@pytest.mark.parametrize("scale_mode", ["none", "plain", "zero_centered"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("norm,with_bias", [("rms", False), ("layer", False), ("layer", True)])
def test_norm_option_combinations(ops, norm, scale_mode, with_bias, with_residual, rng):
  dt, shape = jnp.float32, (4, 17)
  x = rand(rng, shape, dt, loc=-0.4)
  res = rand(rng, shape, dt) if with_residual else None
  # A zero-centered scale is a small offset around 0 (the applied gamma is 1 + scale).
  scale = None if scale_mode == "none" else rand(
      rng, (17,), dt, loc=0.0 if scale_mode == "zero_centered" else 1.0, scale=0.3)
  bias = rand(rng, (17,), dt, scale=0.3) if with_bias else None
  zc = scale_mode == "zero_centered"
  if norm == "rms":
    out = ops.rms_norm(x, scale, res, eps=1e-6, zero_centered_scale=zc)
    want_y, want_s, _ = npo.rms_norm(x, scale, res, eps=1e-6, zero_centered_scale=zc)
  else:
    out = ops.layer_norm(x, scale, bias, res, eps=1e-6, zero_centered_scale=zc)
    want_y, want_s, _, _ = npo.layer_norm(x, scale, bias, res, eps=1e-6, zero_centered_scale=zc)
  if with_residual:
    y, s = out
    npo.assert_close(s, want_s, TOL["float32"], "s")
  else:
    assert not isinstance(out, tuple), "without a residual the norm returns y only"
    y = out
  chex.assert_shape(y, shape)
  npo.assert_close(y, want_y, TOL["float32"], "y")


@pytest.mark.parametrize("in_dt,out_dt", [("float32", "bfloat16"), ("bfloat16", "float32")])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_out_dtype(ops, norm, in_dt, out_dt, rng):
  x, res = rand(rng, (3, 769), in_dt), rand(rng, (3, 769), in_dt)
  scale = rand(rng, (769,), in_dt, loc=1.0, scale=0.2)
  fn = ops.rms_norm if norm == "rms" else ops.layer_norm
  y, s = fn(x, scale, residual=res, out_dtype=out_dt)
  chex.assert_type(y, out_dt)
  chex.assert_type(s, in_dt)  # the residual stream keeps the input dtype
  ref_fn = npo.rms_norm if norm == "rms" else npo.layer_norm
  npo.assert_close(y, ref_fn(x, scale, residual=res)[0], TOL["bfloat16"])
  if out_dt == "float32":  # float32 output of bfloat16 inputs: no output rounding at all
    npo.assert_close(y, ref_fn(x, scale, residual=res)[0], TOL["float32"])


# ---- rows with a large mean -----------------------------------------------------------------
# Rows 1e4 + 1e-2·noise: |mean|/std = 1e6. A one-pass variance E[x²] − E[x]² is pure rounding
# noise there in float32 (ulp(1e8) = 8 >> var = 1e-4); a two-pass variance is right only when
# the mean itself is accurate to far below std, which a float32 mean of values near 1e4
# (ulp 1e-3 = 0.1·std, plus summation error) is not. A shifted two-pass (subtract a row element
# first: exact by Sterbenz) is accurate to float32 precision: rstd to 1e-5, normalized
# values to 1e-4 (the expected results here are O(1)). Inputs are on the float32 grid of 1e4
# (multiples of 2^-10), so float64 sees exactly the same values and h = x @ w + residual is
# exact in float32 (x holds small ints, w multiples of 2^-10, K = 4).

GRID = 2.0**-10  # the float32 spacing of values in [8192, 16384)


def large_mean_rows(rng, shape):
  """1e4 + ~1e-2·noise, exactly representable in float32."""
  return jnp.asarray(1e4 + GRID * np.round(10 * rng.standard_normal(shape)), jnp.float32)


def moderate_mean_rows(rng, shape):
  """|mean|/std = 1e3: a float32 two-pass is accurate here, a one-pass would not be: its
  E[x²] ~ 1e6 carries ~ulp(1e6) = 0.06 of error per term, vs var = 1."""
  return jnp.asarray(1e3 + rng.standard_normal(shape), jnp.float32)


def _check_large_mean_stats(y, stats, want_y, want_mean, want_rstd, y_tol, rstd_tol):
  npo.assert_close(stats.rstd, want_rstd, rstd_tol, "rstd")
  chex.assert_trees_all_close(npo.f64(stats.mean), want_mean, rtol=0, atol=2e-3)  # ~2 ulp(1e4)
  npo.assert_close(y, want_y, y_tol, "y")


def _large_mean_layer_norm(ops, rows, rng, y_tol, rstd_tol):
  for n in (3, 17, 769):
    x = rows(rng, (16, n))
    y = ops.layer_norm(x)
    want_y, _, want_mean, want_rstd = npo.layer_norm(x)
    w = jnp.asarray(rng.standard_normal((n, 5)), jnp.float32)
    y2, stats = ops.norm_matmul(x, w, norm="layer", return_stats=True)
    npo.assert_close(y, want_y, y_tol, f"layer_norm y, N={n}")
    _check_large_mean_stats(y2, stats, npo.norm_matmul(x, w, norm="layer")[0], want_mean,
                            want_rstd, y_tol, rstd_tol)


def _large_mean_matmul_norm(ops, rows, rng, y_tol, rstd_tol):
  for n in (3, 17, 769):
    x = jnp.asarray(rng.integers(-3, 4, (16, 4)), jnp.float32)
    w = jnp.asarray(GRID * rng.integers(-4, 5, (4, n)), jnp.float32)
    res = rows(rng, (16, n))
    y, h, stats = ops.matmul_norm(x, w, residual=res, return_h=True, return_stats=True)
    want_y, want_h, want_mean, want_rstd = npo.matmul_norm(x, w, residual=res)
    chex.assert_trees_all_close(npo.f64(h), want_h, rtol=0, atol=0)  # exact by construction
    _check_large_mean_stats(y, stats, want_y, want_mean, want_rstd, y_tol, rstd_tol)


@pytest.mark.parametrize("check", [_large_mean_layer_norm, _large_mean_matmul_norm])
def test_moderate_mean_rows_two_pass_accuracy(ops, check, rng):
  # The float32 mean is off by a few ulp(1e3) = 6e-5 (rounding and summation): y within 1e-3
  # (~16 ulp(mean)/std), rstd (second order in that error) within 1e-4 of float64.
  check(ops, moderate_mean_rows, rng, y_tol=1e-3, rstd_tol=1e-4)


@pytest.mark.parametrize("check", [_large_mean_layer_norm, _large_mean_matmul_norm])
def test_large_mean_rows_two_pass_accuracy(ops, check, rng):
  check(ops, large_mean_rows, rng, y_tol=1e-4, rstd_tol=1e-5)


# ---- norm_matmul ----------------------------------------------------------------------------

MATMUL_SHAPES = [((1, 17), 3), ((5, 3), 769), ((2, 3, 769), 17)]  # (x shape, N)


def test_oracle_norm_matmul_matches_lazy_design_form(rng):
  """The oracle's direct formula equals DESIGN.md's lazy form r ⊙ (x W_γ − μ ⊗ c) + βᵀW."""
  x, w = rng.standard_normal((6, 17)) + 2.0, rng.standard_normal((17, 5))
  scale, bias = rng.standard_normal(17), rng.standard_normal(17)
  for norm in ("rms", "layer"):
    np.testing.assert_allclose(npo.norm_matmul(x, w, scale, bias, norm=norm)[0],
                               npo.norm_matmul_folded(x, w, scale, bias, norm=norm), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("x_shape,n", MATMUL_SHAPES)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_matmul_shapes_dtypes(ops, dtype, norm, x_shape, n, rng):
  k = x_shape[-1]
  x = rand(rng, x_shape, dtype, loc=0.5)
  w = rand(rng, (k, n), dtype, scale=k**-0.5)
  scale = rand(rng, (k,), dtype, loc=1.0, scale=0.2)
  bias = rand(rng, (k,), dtype, scale=0.2)
  y, stats = ops.norm_matmul(x, w, scale=scale, norm_bias=bias, norm=norm, eps=1e-5,
                             return_stats=True)
  want_y, want_mean, want_rstd = npo.norm_matmul(x, w, scale, bias, norm=norm, eps=1e-5)
  chex.assert_shape(y, x_shape[:-1] + (n,))
  chex.assert_type(y, dtype)
  chex.assert_shape(stats.rstd, x_shape[:-1])
  chex.assert_type(stats.rstd, stat_dtype(dtype))
  npo.assert_close(y, want_y, tol(dtype), "y")
  npo.assert_close(stats.rstd, want_rstd, STATS_TOL[dtype.name], "rstd")
  if norm == "rms":
    assert stats.mean is None
  else:
    npo.assert_close(stats.mean, want_mean, STATS_TOL[dtype.name], "mean")


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_matmul_affine_options(ops, norm, with_scale, with_bias, rng):
  x, w = rand(rng, (7, 17), jnp.float32, loc=-1.0), rand(rng, (17, 5), jnp.float32)
  scale = rand(rng, (17,), jnp.float32, loc=1.0, scale=0.3) if with_scale else None
  bias = rand(rng, (17,), jnp.float32, scale=0.3) if with_bias else None
  y = ops.norm_matmul(x, w, scale=scale, norm_bias=bias, norm=norm)
  assert not isinstance(y, tuple), "without return_stats norm_matmul returns y only"
  npo.assert_close(y, npo.norm_matmul(x, w, scale, bias, norm=norm)[0], TOL["float32"])


def test_norm_matmul_out_dtype(ops, rng):
  x, w = rand(rng, (4, 17), jnp.bfloat16), rand(rng, (17, 3), jnp.bfloat16)
  y = ops.norm_matmul(x, w, norm="layer", out_dtype=jnp.float32)
  chex.assert_type(y, jnp.float32)
  npo.assert_close(y, npo.norm_matmul(x, w, norm="layer")[0], TOL["bfloat16"])


# ---- matmul_norm ----------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,n", MATMUL_SHAPES)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_matmul_norm_shapes_dtypes(ops, dtype, norm, x_shape, n, rng):
  k = x_shape[-1]
  x, w = rand(rng, x_shape, dtype), rand(rng, (k, n), dtype, scale=k**-0.5)
  dense_bias = rand(rng, (n,), dtype, loc=0.5)
  res = rand(rng, x_shape[:-1] + (n,), dtype)
  scale = rand(rng, (n,), dtype, loc=1.0, scale=0.2)
  bias = rand(rng, (n,), dtype, scale=0.2)
  y, h, stats = ops.matmul_norm(x, w, dense_bias=dense_bias, residual=res, scale=scale,
                                norm_bias=bias, norm=norm, eps=1e-5, return_h=True,
                                return_stats=True)
  want_y, want_h, want_mean, want_rstd = npo.matmul_norm(x, w, dense_bias, res, scale, bias,
                                                         norm=norm, eps=1e-5)
  chex.assert_shape([y, h], x_shape[:-1] + (n,))
  chex.assert_type([y, h], dtype)
  chex.assert_type(stats.rstd, stat_dtype(dtype))
  npo.assert_close(y, want_y, tol(dtype), "y")
  npo.assert_close(h, want_h, tol(dtype), "h")
  # 16-bit inputs: the XLA path rounds x @ w to bf16 before the statistics (as plain JAX code
  # does), so they carry bf16 rounding (2^-9 per element, averaged over N) against the oracle.
  stats_tol = 2e-3 if dtype == jnp.bfloat16 else STATS_TOL[dtype.name]
  npo.assert_close(stats.rstd, want_rstd, stats_tol, "rstd")
  if norm == "rms":
    assert stats.mean is None
  else:
    npo.assert_close(stats.mean, want_mean, stats_tol, "mean")


@pytest.mark.parametrize("with_dense_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("affine", ["none", "scale", "scale_bias"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_matmul_norm_options(ops, norm, with_dense_bias, with_residual, affine, rng):
  dt, n = jnp.float32, 17
  x, w = rand(rng, (6, 5), dt), rand(rng, (5, n), dt)
  dense_bias = rand(rng, (n,), dt) if with_dense_bias else None
  res = rand(rng, (6, n), dt) if with_residual else None
  scale = rand(rng, (n,), dt, loc=1.0, scale=0.3) if affine != "none" else None
  bias = rand(rng, (n,), dt, scale=0.3) if affine == "scale_bias" else None
  want_y, want_h, _, want_rstd = npo.matmul_norm(x, w, dense_bias, res, scale, bias, norm=norm)
  y = ops.matmul_norm(x, w, dense_bias=dense_bias, residual=res, scale=scale,
                      norm_bias=bias, norm=norm)
  assert not isinstance(y, tuple)
  npo.assert_close(y, want_y, TOL["float32"], "y")
  # The optional outputs come in the order (y, h?, stats?).
  y_h = ops.matmul_norm(x, w, dense_bias=dense_bias, residual=res, scale=scale,
                        norm_bias=bias, norm=norm, return_h=True)
  assert len(y_h) == 2
  npo.assert_close(y_h[1], want_h, TOL["float32"], "h")
  y_s = ops.matmul_norm(x, w, dense_bias=dense_bias, residual=res, scale=scale,
                        norm_bias=bias, norm=norm, return_stats=True)
  assert len(y_s) == 2 and isinstance(y_s[1], pallas_norm.NormStats)
  npo.assert_close(y_s[1].rstd, want_rstd, TOL["float32"], "rstd")


def test_matmul_norm_out_dtype(ops, rng):
  x, w = rand(rng, (4, 17), jnp.float32), rand(rng, (17, 9), jnp.float32)
  y, h = ops.matmul_norm(x, w, out_dtype=jnp.bfloat16, return_h=True)
  chex.assert_type([y, h], jnp.bfloat16)
  want_y, want_h, _, _ = npo.matmul_norm(x, w)
  npo.assert_close(y, want_y, TOL["bfloat16"], "y")
  npo.assert_close(h, want_h, TOL["bfloat16"], "h")


# ---- gdpa -----------------------------------------------------------------------------------

LENGTHS = {"inner_empty": [3, 0, 5, 1], "edge_empty": [0, 4, 2, 0]}
KV_LENGTHS = {"inner_empty": [2, 4, 0, 3], "edge_empty": [3, 0, 1, 2]}
# One capacity for every pattern (>= 3 padding rows each): the eager op-by-op compilations of
# one shape are reused across tests, which keeps the suite fast on a small CPU.
H, D, L_KV, T_CAP, TKV_CAP = 3, 5, 6, 12, 11
MAX_SEQ_LEN = 5  # >= every length above: the static bound of the padded (max_seq_len) path


def jagged_case(rng, dtype, pattern, kv_layout, *, garbage=1e3):
  """q (T_CAP, H, D) with garbage in its padding rows, dense k/v (B, L_KV, H, D) or jagged ones
  (TKV_CAP, H, D) with garbage past the last offset, and their int32 offsets."""
  q_off = jagged.offsets_from_lengths(LENGTHS[pattern])
  qn = rng.standard_normal((T_CAP, H, D))
  qn[q_off[-1]:] *= garbage
  case = {"q": jnp.asarray(qn, dtype), "q_offsets": jnp.asarray(q_off), "kv_offsets": None}
  if kv_layout == "dense":
    kn, vn = rng.standard_normal((2, len(LENGTHS[pattern]), L_KV, H, D))
  else:
    kv_off = jagged.offsets_from_lengths(KV_LENGTHS[pattern])
    kn, vn = rng.standard_normal((2, TKV_CAP, H, D))
    kn[kv_off[-1]:], vn[kv_off[-1]:] = garbage, -garbage
    case["kv_offsets"] = jnp.asarray(kv_off)
  case["k"], case["v"] = jnp.asarray(kn, dtype), jnp.asarray(vn, dtype)
  return case


def n_valid(case) -> int:
  return int(case["q_offsets"][-1])


def assert_padding_zero(out, case):
  np.testing.assert_array_equal(np.asarray(out[n_valid(case):], np.float32), 0.0)


@pytest.mark.parametrize("activation", sorted(reference.ACTIVATIONS))
@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_gdpa_activations(ops, activation, kv_layout, rng):
  case = jagged_case(rng, jnp.float32, "inner_empty", kv_layout)
  kw = dict(activation=activation, pre_scale=D**-0.5, post_scale=0.7)
  out = ops.gdpa(**case, **kw)
  chex.assert_shape(out, case["q"].shape)
  chex.assert_type(out, jnp.float32)
  npo.assert_close(out, npo.gdpa(**case, **kw), TOL["float32"])
  assert_padding_zero(out, case)


@pytest.mark.parametrize("pattern", sorted(LENGTHS))
@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_gdpa_dtypes_and_empty_samples(ops, dtype, pattern, kv_layout, rng):
  case = jagged_case(rng, dtype, pattern, kv_layout)
  out = ops.gdpa(**case, activation="silu", pre_scale=0.5)
  chex.assert_type(out, dtype)
  npo.assert_close(out, npo.gdpa(**case, activation="silu", pre_scale=0.5), tol(dtype))
  assert_padding_zero(out, case)


@pytest.mark.parametrize("kv_layout,activation", [("dense", "relu2"), ("jagged", "fast_gelu")])
def test_gdpa_padded_path_equals_token_path(ops, kv_layout, activation, rng):
  case = jagged_case(rng, jnp.float32, "inner_empty", kv_layout)
  token = ops.gdpa(**case, activation=activation)
  for max_seq_len in (MAX_SEQ_LEN, MAX_SEQ_LEN + 3):  # the tightest bound and a loose one
    padded = ops.gdpa(**case, activation=activation, max_seq_len=max_seq_len)
    npo.assert_close(padded, token, 1e-6, f"max_seq_len={max_seq_len}")
    assert_padding_zero(padded, case)
  if kv_layout == "jagged":  # a tighter static bound on the key lengths changes nothing
    bounded = ops.gdpa(**case, activation=activation, max_seq_len=MAX_SEQ_LEN,
                       max_kv_len=max(KV_LENGTHS["inner_empty"]))
    npo.assert_close(bounded, token, 1e-6, "max_kv_len")


@pytest.mark.parametrize("max_seq_len", [None, MAX_SEQ_LEN])
@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_gdpa_ignores_nan_padding(ops, kv_layout, max_seq_len, rng):
  """Padding rows of q (and of packed k/v) are never read: NaN there changes nothing."""
  clean = jagged_case(rng, jnp.float32, "inner_empty", kv_layout)
  dirty = dict(clean, q=clean["q"].at[n_valid(clean):].set(jnp.nan))
  if kv_layout == "jagged":
    end = int(clean["kv_offsets"][-1])
    dirty["k"], dirty["v"] = clean["k"].at[end:].set(jnp.nan), clean["v"].at[end:].set(jnp.inf)
  out = ops.gdpa(**dirty, max_seq_len=max_seq_len)
  chex.assert_trees_all_equal(out, ops.gdpa(**clean, max_seq_len=max_seq_len))
  assert_padding_zero(out, dirty)


def test_gdpa_all_samples_empty(ops, rng):
  q_off = jnp.zeros(5, jnp.int32)
  q = rand(rng, (T_CAP, H, D), jnp.float32)
  k = v = rand(rng, (4, L_KV, H, D), jnp.float32)
  for max_seq_len in (None, 2):
    out = ops.gdpa(q, k, v, q_off, max_seq_len=max_seq_len)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_gdpa_out_dtype(ops, rng):
  case = jagged_case(rng, jnp.float32, "edge_empty", "dense")
  out = ops.gdpa(**case, out_dtype=jnp.bfloat16, activation="gelu")
  chex.assert_type(out, jnp.bfloat16)
  npo.assert_close(out, npo.gdpa(**case, activation="gelu"), TOL["bfloat16"])


# ---- flash_norm_attention -------------------------------------------------------------------


def fna_affines(rng, dtype, with_affines):
  if not with_affines:
    return {}
  f = H * D
  return {"ln_scale": rand(rng, (f,), dtype, loc=1.0, scale=0.3),
          "ln_bias": rand(rng, (f,), dtype, scale=0.3),
          "rms_scale": rand(rng, (f,), dtype, loc=1.0, scale=0.3)}


@pytest.mark.parametrize("with_affines", [False, True])
@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_flash_norm_attention(ops, dtype, kv_layout, with_affines, rng):
  case = jagged_case(rng, dtype, "inner_empty", kv_layout)
  kw = dict(fna_affines(rng, dtype, with_affines), activation="fast_gelu", pre_scale=D**-0.5,
            post_scale=0.5, eps=1e-5)
  out, (ln_stats, rms_stats) = ops.flash_norm_attention(**case, **kw, return_stats=True)
  want, (ln_mean, ln_rstd), rms_rstd = npo.flash_norm_attention(**case, **kw)
  chex.assert_shape(out, case["q"].shape)
  chex.assert_type(out, dtype)
  chex.assert_shape([ln_stats.mean, ln_stats.rstd, rms_stats.rstd], (case["q"].shape[0],))
  assert rms_stats.mean is None
  npo.assert_close(out, want, tol(dtype), "out")
  assert_padding_zero(out, case)
  valid = n_valid(case)
  npo.assert_close(ln_stats.mean[:valid], ln_mean[:valid], STATS_TOL[dtype.name], "ln mean")
  npo.assert_close(ln_stats.rstd[:valid], ln_rstd[:valid], STATS_TOL[dtype.name], "ln rstd")
  # z = u + attention went through the dtype's rounding of u: the dtype's tolerance.
  npo.assert_close(rms_stats.rstd[:valid], rms_rstd[:valid], tol(dtype), "rms rstd")


@pytest.mark.parametrize("activation", sorted(reference.ACTIVATIONS))
def test_flash_norm_attention_activations_and_paths(ops, activation, rng):
  case = jagged_case(rng, jnp.float32, "edge_empty", "jagged")
  kw = dict(fna_affines(rng, jnp.float32, True), activation=activation, pre_scale=0.4)
  out = ops.flash_norm_attention(**case, **kw)
  assert not isinstance(out, tuple)
  npo.assert_close(out, npo.flash_norm_attention(**case, **kw)[0], TOL["float32"])
  padded = ops.flash_norm_attention(**case, **kw, max_seq_len=MAX_SEQ_LEN)
  npo.assert_close(padded, out, 1e-6, "max_seq_len path")
  assert_padding_zero(padded, case)


def test_flash_norm_attention_nan_padding_and_out_dtype(ops, rng):
  clean = jagged_case(rng, jnp.float32, "inner_empty", "dense")
  dirty = dict(clean, q=clean["q"].at[n_valid(clean):].set(jnp.nan))
  out = ops.flash_norm_attention(**dirty, out_dtype=jnp.bfloat16)
  chex.assert_type(out, jnp.bfloat16)
  chex.assert_trees_all_equal(out, ops.flash_norm_attention(**clean, out_dtype=jnp.bfloat16))
  npo.assert_close(out, npo.flash_norm_attention(**clean)[0], TOL["bfloat16"])
  assert_padding_zero(out, clean)


# ---- numpy inputs ---------------------------------------------------------------------------



def _numpy_case(rng, op):
  """(public function, args as numpy arrays) for one op, float32."""
  x = rng.standard_normal((3, 17)).astype(np.float32)
  g = (1 + 0.2 * rng.standard_normal(17)).astype(np.float32)
  w = rng.standard_normal((17, 5)).astype(np.float32)
  if op == "norm_matmul":  # scale is keyword-only, as every argument after w
    return (lambda x, w, g: pallas_norm.norm_matmul(x, w, scale=g)), (x, w, g)
  if op in ("rms_norm", "layer_norm", "matmul_norm"):
    args = {"rms_norm": (x, g), "layer_norm": (x, g, g - 1), "matmul_norm": (x, w)}[op]
    return getattr(pallas_norm, op), args
  name, kv_layout, max_seq_len = op.split("-")
  case = jagged_case(rng, jnp.float32, "inner_empty", kv_layout)
  fn = functools.partial(getattr(pallas_norm, name),
                         max_seq_len=MAX_SEQ_LEN if max_seq_len == "padded" else None)
  return fn, tuple(None if case[a] is None else np.asarray(case[a])
                   for a in ("q", "k", "v", "q_offsets", "kv_offsets"))


@pytest.mark.parametrize("op", [
    "rms_norm", "layer_norm", "norm_matmul", "matmul_norm",
    "gdpa-dense-token", "gdpa-dense-padded",
    "gdpa-jagged-token",
    "flash_norm_attention-dense-token",
    "flash_norm_attention-jagged-padded"])
def test_public_ops_accept_numpy_inputs(op, rng):
  """numpy arrays pass the public validation, so they must give the jax arrays' result."""
  fn, args = _numpy_case(rng, op)
  want = fn(*(None if a is None else jnp.asarray(a) for a in args))
  chex.assert_trees_all_close(fn(*args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn,args", [
    (reference.norm_matmul, lambda x: (x, jnp.ones((4, 3)))),
    (reference.matmul_norm, lambda x: (x, jnp.ones((4, 3)))),
])
def test_unknown_norm_is_rejected(fn, args):
  """A norm the reference does not define (e.g. "none", once an internal kernel mode) is a
  ValueError, not a silent LayerNorm."""
  x = jax.random.normal(jax.random.key(0), (2, 4))
  with pytest.raises(ValueError, match="norm"):
    fn(*args(x), norm="none")


@pytest.mark.parametrize("fn", [reference.gdpa, reference.flash_norm_attention])
@pytest.mark.parametrize("max_seq_len", [None, MAX_SEQ_LEN])
def test_reference_attention_rejects_what_it_would_get_silently_wrong(fn, max_seq_len, rng):
  """Dense k/v of another batch than B were clipped (token path) or broadcast (padded path)
  into a wrong answer, v of another shape than k likewise; an unknown activation was a
  KeyError: each is a ValueError naming the argument."""
  case = jagged_case(rng, jnp.float32, "edge_empty", "dense")
  batch = case["k"].shape[0]
  for bad, match in ((dict(k=case["k"][:1], v=case["v"][:1]), "dense k"),
                     (dict(k=case["k"][:batch - 1], v=case["v"][:batch - 1]), "dense k"),
                     (dict(v=case["v"][:, :-1]), "v must"),
                     (dict(activation="softmax"), "activation")):
    with pytest.raises(ValueError, match=match):
      fn(**{**case, **bad}, max_seq_len=max_seq_len)
