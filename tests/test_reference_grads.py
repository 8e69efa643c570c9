"""Gradients of every reference op, and jit vs eager equality of the public ops.

* `jax.test_util.check_grads` (order 1) in float64 against central finite differences, w.r.t.
  every float argument (activations, weights, scale/gamma, bias/beta, residuals, q/k/v), with
  x64 enabled inside each test only. Tolerance: atol = rtol = 1e-5 (jax's float64 default; the
  finite-difference error at step 1e-4 is ~1e-8 here). "rev" everywhere, "fwd" where cheap.
* Padding rows of jagged inputs get exactly zero gradient.
* `jax.jit` of the public ops (offsets traced, so only their value checks are skipped) gives
  the eager outputs and gradients (float64, 1e-12: XLA may fuse and reorder sums).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import _numpy_oracle as npo
import pallas_norm
from pallas_norm import jagged, reference

GRAD_TOL = dict(atol=1e-5, rtol=1e-5)
H, D = 2, 3
LENGTHS, KV_LENGTHS, T_CAP, TKV_CAP, L_KV = [2, 0, 3], [1, 3, 0], 7, 6, 4
MAX_SEQ_LEN = 3


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.fixture
def rng(request):
  return np.random.default_rng(npo.seed_of(request.node.nodeid))


def rand(rng, shape, dtype=jnp.float64, *, loc=0.0, scale=1.0):
  return jnp.asarray(loc + scale * rng.standard_normal(shape), dtype)


def check(f, args, modes=("rev",)):
  # check_grads perturbs the args as numpy arrays; the reference gdpa path cannot index dense
  # numpy k/v (see test_reference.py::test_public_ops_accept_numpy_inputs), so hand it jax ones.
  def f_jax(*a):
    return f(*map(jnp.asarray, a))

  check_grads(f_jax, tuple(args), order=1, modes=modes, **GRAD_TOL)


# ---- norms and GEMMs ------------------------------------------------------------------------


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_grads(x64, rng, norm, zero_centered):
  x, res = rand(rng, (2, 3, 5), loc=0.5), rand(rng, (2, 3, 5))
  scale = rand(rng, (5,), loc=0.0 if zero_centered else 1.0, scale=0.3)
  if norm == "rms":
    f = functools.partial(reference.rms_norm, eps=1e-3, zero_centered_scale=zero_centered)
    check(f, (x, scale, res), modes=("fwd", "rev"))  # returns (y, x + residual)
    check(lambda x, s: f(x, s), (x, scale))
  else:
    f = functools.partial(reference.layer_norm, eps=1e-3, zero_centered_scale=zero_centered)
    bias = rand(rng, (5,))
    check(f, (x, scale, bias, res), modes=("fwd", "rev"))
    check(lambda x, s, b: f(x, s, b), (x, scale, bias))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_matmul_grads(x64, rng, norm):
  x, w = rand(rng, (4, 5), loc=-0.5), rand(rng, (5, 3))
  scale, bias = rand(rng, (5,), loc=1.0, scale=0.3), rand(rng, (5,))
  f = functools.partial(reference.norm_matmul, norm=norm, eps=1e-3, return_stats=True)
  check(f, (x, w, scale, bias), modes=("fwd", "rev"))  # through y and the NormStats
  check(lambda x, w: f(x, w)[0], (x, w))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_matmul_norm_grads(x64, rng, norm):
  x, w = rand(rng, (2, 2, 4)), rand(rng, (4, 5))
  dense_bias, res = rand(rng, (5,)), rand(rng, (2, 2, 5))
  scale, bias = rand(rng, (5,), loc=1.0, scale=0.3), rand(rng, (5,))
  f = functools.partial(reference.matmul_norm, norm=norm, eps=1e-3, return_h=True,
                        return_stats=True)
  check(f, (x, w, dense_bias, res, scale, bias), modes=("fwd", "rev"))
  check(lambda x, w: reference.matmul_norm(x, w, norm=norm), (x, w))


# ---- attention ------------------------------------------------------------------------------


def attention_case(rng, kv_layout, dtype=jnp.float64, garbage=100.0):
  """Small jagged q (with an empty sample and garbage padding rows) and dense or packed k/v."""
  q_off = jagged.offsets_from_lengths(LENGTHS)
  q = rng.standard_normal((T_CAP, H, D))
  q[q_off[-1]:] *= garbage
  case = {"q": jnp.asarray(q, dtype), "q_offsets": jnp.asarray(q_off), "kv_offsets": None}
  if kv_layout == "dense":
    k, v = rng.standard_normal((2, len(LENGTHS), L_KV, H, D))
  else:
    kv_off = jagged.offsets_from_lengths(KV_LENGTHS)
    k, v = rng.standard_normal((2, TKV_CAP, H, D))
    k[kv_off[-1]:] *= garbage
    v[kv_off[-1]:] *= garbage
    case["kv_offsets"] = jnp.asarray(kv_off)
  case["k"], case["v"] = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
  return case


def fna_affines(rng, dtype=jnp.float64):
  return (rand(rng, (H * D,), dtype, loc=1.0, scale=0.3), rand(rng, (H * D,), dtype),
          rand(rng, (H * D,), dtype, loc=1.0, scale=0.3))


# Every activation once, cycling through the (k/v layout, formulation) pairs; all four pairs
# are covered again with the default activation in fwd and rev mode below.
ACTIVATION_CASES = [(a, ("dense", "jagged")[i % 2], (None, MAX_SEQ_LEN)[i // 2 % 2])
                    for i, a in enumerate(sorted(reference.ACTIVATIONS))]


@pytest.mark.parametrize("activation,kv_layout,max_seq_len", ACTIVATION_CASES)
def test_gdpa_grads(x64, rng, activation, kv_layout, max_seq_len):
  """Every activation, through the token-gather (max_seq_len None) or padded formulation."""
  case = attention_case(rng, kv_layout)
  f = functools.partial(reference.gdpa, q_offsets=case["q_offsets"],
                        kv_offsets=case["kv_offsets"], activation=activation, pre_scale=0.6,
                        post_scale=1.4, max_seq_len=max_seq_len)
  check(f, (case["q"], case["k"], case["v"]))


@pytest.mark.parametrize("max_seq_len", [None, MAX_SEQ_LEN])
@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_gdpa_grads_both_paths_fwd_and_rev(x64, rng, kv_layout, max_seq_len):
  case = attention_case(rng, kv_layout)
  f = functools.partial(reference.gdpa, q_offsets=case["q_offsets"],
                        kv_offsets=case["kv_offsets"], max_seq_len=max_seq_len)
  check(f, (case["q"], case["k"], case["v"]), modes=("fwd", "rev"))


@pytest.mark.parametrize("max_seq_len", [None, MAX_SEQ_LEN])
@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_flash_norm_attention_grads(x64, rng, kv_layout, max_seq_len):
  case = attention_case(rng, kv_layout)
  offs = dict(q_offsets=case["q_offsets"], kv_offsets=case["kv_offsets"])

  def f(q, k, v, ln_scale, ln_bias, rms_scale):
    out, (ln, rms) = reference.flash_norm_attention(
        q, k, v, **offs, ln_scale=ln_scale, ln_bias=ln_bias, rms_scale=rms_scale,
        activation="silu", pre_scale=0.7, eps=1e-3, max_seq_len=max_seq_len,
        return_stats=True)
    # The statistics of real rows only: on the token path a padding row's RMS statistic reads
    # keys through an out-of-range gather (segment id B) that JAX clamps forward but drops in
    # the VJP, so its gradient is inconsistent (reported with test_public_ops_accept_numpy_inputs).
    valid = sum(LENGTHS)
    return out, ln.mean[:valid], ln.rstd[:valid], rms.rstd[:valid]

  check(f, (case["q"], case["k"], case["v"]) + fna_affines(rng))
  if kv_layout == "dense" and max_seq_len is None:  # without affines (default fast_gelu)
    check(functools.partial(reference.flash_norm_attention, **offs),
          (case["q"], case["k"], case["v"]))


def _vjp_of_sum(f, args, cotangent_seed):
  """Gradients of <f(args), random cotangent>, w.r.t. every arg."""
  out = f(*args)
  ct = np.random.default_rng(cotangent_seed).standard_normal(out.shape)
  return jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=tuple(range(len(args))))(*args)


# float64 and the shapes of the check_grads tests above: the eager compilations are shared.
@pytest.mark.parametrize("op,kv_layout,max_seq_len", [
    ("gdpa", "dense", None), ("gdpa", "jagged", MAX_SEQ_LEN),
    ("flash_norm_attention", "dense", MAX_SEQ_LEN), ("flash_norm_attention", "jagged", None)])
def test_padding_rows_get_zero_gradient(x64, rng, op, kv_layout, max_seq_len):
  case = attention_case(rng, kv_layout)
  f = functools.partial(getattr(reference, op), q_offsets=case["q_offsets"],
                        kv_offsets=case["kv_offsets"], max_seq_len=max_seq_len)
  dq, dk, dv = _vjp_of_sum(f, (case["q"], case["k"], case["v"]), 0)
  np.testing.assert_array_equal(np.asarray(dq[sum(LENGTHS):]), 0.0)
  # Sample 0 has keys in both layouts: its rows must get real gradients.
  assert np.all(np.any(np.asarray(dq[:LENGTHS[0]]) != 0, axis=(1, 2)))
  if kv_layout == "jagged":
    np.testing.assert_array_equal(np.asarray(dk[sum(KV_LENGTHS):]), 0.0)
    np.testing.assert_array_equal(np.asarray(dv[sum(KV_LENGTHS):]), 0.0)




@pytest.mark.parametrize("op,max_seq_len", [("gdpa", None), ("flash_norm_attention", None),
                                            ("flash_norm_attention", MAX_SEQ_LEN)])
def test_nan_padding_rows_get_zero_gradient(x64, rng, op, max_seq_len):
  case = attention_case(rng, "dense")
  q = case["q"].at[sum(LENGTHS):].set(jnp.nan)
  f = functools.partial(getattr(reference, op), q_offsets=case["q_offsets"],
                        max_seq_len=max_seq_len)
  dq, dk, dv = _vjp_of_sum(f, (q, case["k"], case["v"]), 0)
  chex.assert_tree_all_finite((dk, dv))
  np.testing.assert_array_equal(np.asarray(dq[sum(LENGTHS):]), 0.0)


def test_gdpa_nan_padding_padded_path_gradient_is_zero(x64, rng):
  """The padded (max_seq_len) gdpa path never touches padding rows, even in backward."""
  case = attention_case(rng, "jagged")
  q = case["q"].at[sum(LENGTHS):].set(jnp.nan)
  k = case["k"].at[sum(KV_LENGTHS):].set(jnp.nan)
  f = functools.partial(reference.gdpa, q_offsets=case["q_offsets"],
                        kv_offsets=case["kv_offsets"], max_seq_len=MAX_SEQ_LEN)
  dq, dk, _ = _vjp_of_sum(f, (q, k, case["v"]), 1)
  np.testing.assert_array_equal(np.asarray(dq[sum(LENGTHS):]), 0.0)
  np.testing.assert_array_equal(np.asarray(dk[sum(KV_LENGTHS):]), 0.0)
  chex.assert_tree_all_finite((dq, dk))


# ---- jit vs eager, public API ---------------------------------------------------------------


def _public_cases(rng, dtype):
  """{name: (function, args)} for every public op. Offsets are arguments too, so that jit
  traces them (and the public ops skip only their value checks)."""
  x, res = rand(rng, (2, 3, 5), dtype, loc=0.5), rand(rng, (2, 3, 5), dtype)
  g, b = rand(rng, (5,), dtype, loc=1.0, scale=0.2), rand(rng, (5,), dtype)
  w = rand(rng, (5, 3), dtype)
  g3, b3, res3 = rand(rng, (3,), dtype, loc=1.0), rand(rng, (3,), dtype), rand(rng, (2, 3, 3),
                                                                                  dtype)
  att = attention_case(rng, "jagged", dtype)
  qkv_offs = (att["q"], att["k"], att["v"], att["q_offsets"], att["kv_offsets"])
  return {
      "rms_norm": (lambda x, g, r: pallas_norm.rms_norm(x, g, r)[0], (x, g, res)),
      "layer_norm": (lambda x, g, b, r: pallas_norm.layer_norm(x, g, b, r)[0], (x, g, b, res)),
      "norm_matmul": (lambda x, w, g, b: pallas_norm.norm_matmul(x, w, scale=g, norm_bias=b,
                                                                   norm="layer"),
                      (x, w, g, b)),
      "matmul_norm": (lambda x, w, r, g, b: pallas_norm.matmul_norm(x, w, residual=r, scale=g,
                                                                       norm_bias=b),
                      (x, w, res3, g3, b3)),
      "gdpa": (lambda q, k, v, qo, ko: pallas_norm.gdpa(q, k, v, qo, ko, activation="gelu"),
               qkv_offs),
      "gdpa_padded": (lambda q, k, v, qo, ko: pallas_norm.gdpa(
          q, k, v, qo, ko, max_seq_len=MAX_SEQ_LEN), qkv_offs),
      "flash_norm_attention": (lambda q, k, v, qo, ko: pallas_norm.flash_norm_attention(
          q, k, v, qo, ko, max_seq_len=MAX_SEQ_LEN), qkv_offs),
  }


def _outputs_and_grads(cases):
  """{name: (output, grads of sum(output²) w.r.t. the float args)}."""
  result = {}
  for name, (f, args) in cases.items():
    n_float = sum(jnp.issubdtype(a.dtype, jnp.floating) for a in args)
    grad = jax.grad(lambda *a, f=f: jnp.sum(f(*a) ** 2), argnums=tuple(range(n_float)))
    result[name] = (f(*args), grad(*args))
  return result


def test_jit_matches_eager_outputs_and_grads(x64, rng):
  """All public ops under one jax.jit (one compilation) vs eager, in float64 (the eager
  compilations are shared with the tests above). XLA may fuse and reorder sums: 1e-12."""
  tol = 1e-12
  cases = _public_cases(rng, jnp.float64)
  eager = _outputs_and_grads(cases)
  all_args = {name: args for name, (_, args) in cases.items()}

  @jax.jit
  def jitted(all_args):
    return _outputs_and_grads({n: (cases[n][0], a) for n, a in all_args.items()})

  for name, got in jitted(all_args).items():
    chex.assert_trees_all_close(got, eager[name], rtol=tol, atol=tol, custom_message=name)
    chex.assert_tree_all_finite(got)
