"""The XLA path of rms_norm / layer_norm (pallas_norm/ops/norms/xla.py): the reference's values,
for LayerNorm with a hand-written one-pass derivative (a custom_jvp; RMSNorm is autodiff).

* float64 on the CPU: LayerNorm's outputs, reverse-mode gradients (x, scale, bias, residual,
  both cotangents) and forward-mode tangents equal jax.vjp / jax.jvp of the reference's autodiff
  to 1e-10 (the same math summed in another order), for residual / zero-centered / odd N
  variants; a second derivative (grad of grad, hessian) matches too.
* bfloat16 / float32 inputs (float16 shares bfloat16's code path): the same values as the reference (identical operations: exact),
  float32 statistics, out_dtype, gradients against the float32 reference within 16-bit
  rounding.
* What reverse mode keeps for the backward: x (not an x-sized float32 x̂) and row statistics.
* norm_matmul's and matmul_norm's "xla" LayerNorm (through the same rule): float64 values and
  gradients equal the reference's autodiff.
* Rows of large magnitude (|x| ~ 1e13–1e16): float32 gradients of both norms, the reference and
  the fused ops' XLA paths within 1e-5 of float64 (``reference.rstd_of``'s derivative).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import reference
from pallas_norm.ops.norms import xla as norms_xla
from _numpy_oracle import seed_of

F64_TOL = 1e-10
BF16_TOL = 1e-2  # norm-relative, 16-bit gradients vs the float32 reference


def _call(op, impl, eps=1e-5, zero_centered=False, out_dtype=None):
  """f(x, scale, bias, residual) of the public op (``impl`` a name) or of the reference."""
  kw = dict(eps=eps, zero_centered_scale=zero_centered, out_dtype=out_dtype)
  if impl == "reference":
    fn = reference.rms_norm if op == "rms" else reference.layer_norm
  else:
    fn = functools.partial(pn.rms_norm if op == "rms" else pn.layer_norm, implementation=impl)
  if op == "rms":
    return lambda x, scale, bias, residual: fn(x, scale, residual, **kw)
  return lambda x, scale, bias, residual: fn(x, scale, bias, residual, **kw)


def _inputs(seed, shape, dtype, *, norm, residual, mean=0.5):
  keys = jax.random.split(jax.random.key(seed), 6)
  n = shape[-1]
  x = (mean + jax.random.normal(keys[0], shape, jnp.float32)).astype(dtype)
  scale = (1 + 0.2 * jax.random.normal(keys[1], (n,))).astype(dtype)
  bias = (0.1 * jax.random.normal(keys[2], (n,))).astype(dtype) if norm == "layer" else None
  res = jax.random.normal(keys[3], shape, jnp.float32).astype(dtype) if residual else None
  cts = [jax.random.normal(k, shape, jnp.float32) for k in keys[4:]]
  return (x, scale, bias, res), cts


def _vjp(f, args, cts):
  """(outputs, grads of every non-None argument) under jit; cotangents in the outputs' dtypes."""
  mask = [a is not None for a in args]

  @jax.jit
  def run(present, cts):
    full = iter(present)
    filled = [next(full) if m else None for m in mask]

    def g(*p):
      it = iter(p)
      return f(*[next(it) if m else None for m in mask])
    out, pull = jax.vjp(g, *[a for a in filled if a is not None])
    outs = out if isinstance(out, tuple) else (out,)
    return out, pull(tuple(c.astype(o.dtype) for o, c in zip(outs, cts))
                     if isinstance(out, tuple) else cts[0].astype(out.dtype))
  return run([a for a in args if a is not None], cts)


CASES_F64 = [
    # norm, shape, residual, zero_centered
    ("layer", (2, 3, 33), True, False),
    ("layer", (7, 20), False, True),
]


@pytest.mark.parametrize("norm,shape,residual,zero_centered", CASES_F64)
def test_float64_values_gradients_and_tangents_match_autodiff(norm, shape, residual,
                                                              zero_centered):
  with jax.enable_x64(True):
    args, cts = _inputs(seed_of(f"{norm}{shape}"), shape, jnp.float64, norm=norm,
                        residual=residual)
    ours = _call(norm, "xla", zero_centered=zero_centered)
    ref = _call(norm, "reference", zero_centered=zero_centered)
    got, want = _vjp(ours, args, cts), _vjp(ref, args, cts)
    chex.assert_trees_all_close(got, want, atol=F64_TOL, rtol=F64_TOL)
    present = [a for a in args if a is not None]
    tangents = [jax.random.normal(jax.random.key(i), a.shape, a.dtype)
                for i, a in enumerate(present)]

    def jvp(f):
      def g(*p):
        it = iter(p)
        return f(*[next(it) if a is not None else None for a in args])
      return jax.jit(lambda p, t: jax.jvp(g, p, t))(present, tangents)
    chex.assert_trees_all_close(jvp(ours), jvp(ref), atol=F64_TOL, rtol=F64_TOL)


def test_float64_second_derivatives_match_autodiff():
  """The tangent map is jnp code: a gradient of a gradient and a hessian match autodiff's."""
  norm = "layer"
  with jax.enable_x64(True):
    (x, scale, bias, _), (dy, _) = _inputs(3, (2, 6), jnp.float64, norm=norm, residual=False)

    def loss(f):
      return lambda x, scale: jnp.sum(jnp.sin(f(x, scale, bias, None)) * dy)
    ours, ref = loss(_call(norm, "xla")), loss(_call(norm, "reference"))
    def second(f):  # reverse over reverse, and forward over reverse
      ggrad = jax.grad(lambda x, s: jnp.sum(jax.grad(f, (0, 1))(x, s)[0] ** 2), (0, 1))
      return jax.jit(lambda x, s: (ggrad(x, s), jax.hessian(f)(x[:1], s)))(x, scale)
    chex.assert_trees_all_close(second(ours), second(ref), atol=1e-9, rtol=1e-9)


CASES_16 = [
    # norm, shape, dtype, residual, zero_centered, out_dtype
    ("rms", (37, 64), jnp.bfloat16, True, False, None),
    ("rms", (20, 100), jnp.float32, False, True, jnp.bfloat16),
    ("layer", (3, 13, 96), jnp.bfloat16, True, True, jnp.float32),
]


@pytest.mark.parametrize("norm,shape,dtype,residual,zero_centered,out_dtype", CASES_16)
def test_low_precision_matches_reference(norm, shape, dtype, residual, zero_centered, out_dtype):
  """Outputs equal the reference's exactly (the same operations, float32 statistics); the
  gradients match the float32 reference within 16-bit rounding, in the arguments' dtypes."""
  args, cts = _inputs(seed_of(f"{norm}{shape}{dtype}"), shape, dtype, norm=norm,
                      residual=residual)
  ours = _call(norm, "xla", zero_centered=zero_centered, out_dtype=out_dtype)
  out, grads = _vjp(ours, args, cts)
  ref_out = jax.jit(_call(norm, "reference", zero_centered=zero_centered,
                          out_dtype=out_dtype))(*args)
  chex.assert_trees_all_equal(out, ref_out)
  up = [None if a is None else a.astype(jnp.float32) for a in args]
  _, want = _vjp(_call(norm, "reference", zero_centered=zero_centered), up, cts)
  # A 16-bit y also rounds the cotangent: 16-bit tolerance.
  tol = 2e-5 if jnp.dtype(out_dtype or dtype) == jnp.float32 == jnp.dtype(dtype) else BF16_TOL
  for g, w, a in zip(grads, want, [a for a in args if a is not None]):
    assert g.dtype == a.dtype
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.all(np.isfinite(g))
    assert np.linalg.norm(g - w) / np.linalg.norm(w) <= tol


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_statistics_are_float32_and_match_the_reference(norm):
  x = (100 + jax.random.normal(jax.random.key(1), (6, 40))).astype(jnp.bfloat16)
  _, _, stats = norms_xla.normalize_rows(x, norm=norm, eps=1e-6)
  want = reference._row_stats(x.astype(jnp.float32), norm, 1e-6)  # pylint: disable=protected-access
  for got, ref in zip(stats, want):
    if ref is None:
      assert got is None
      continue
    assert got.dtype == jnp.float32 and got.shape == (6,)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_float64_statistics_tangents_match_autodiff(norm):
  """The statistics' own derivatives (``normalize_rows`` promises them; the public ops stop
  their gradient): forward-mode tangents of mean and rstd, with a residual, equal autodiff of
  the reference's statistics (a mutation test changed LayerNorm's rstd tangent unnoticed)."""
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(seed_of(f"stats_tangent_{norm}")), 4)
    x, res, tx, tr = (jax.random.normal(k, (6, 40), jnp.float64) for k in ks)
    x = 0.3 * x + 0.5  # a non-zero mean: the mean's tangent enters rstd's

    def ours(x, res):
      return norms_xla.normalize_rows(x, residual=res, norm=norm, eps=1e-5)[2]

    def want(x, res):
      return reference._row_stats(x + res, norm, 1e-5)

    _, got = jax.jvp(ours, (x, res), (tx, tr))
    _, ref = jax.jvp(want, (x, res), (tx, tr))
    for name in ("mean", "rstd"):
      g, r = getattr(got, name), getattr(ref, name)
      if r is None:
        assert g is None, name
        continue
      np.testing.assert_allclose(g, r, rtol=F64_TOL, atol=F64_TOL * float(jnp.max(jnp.abs(r))),
                                 err_msg=name)


def test_reverse_mode_keeps_x_and_row_statistics():
  """What jax.vjp of LayerNorm keeps for the backward: x in its dtype, the scale and (M,)
  float32 rows, never an (M, N) float32 array (x̂ is rebuilt in the backward)."""
  norm = "layer"
  (x, scale, bias, _), _ = _inputs(0, (8, 64), jnp.bfloat16, norm=norm, residual=False)
  f = _call(norm, "xla")
  _, pull = jax.vjp(lambda x, scale: f(x, scale, bias, None), x, scale)
  kept = [(a.shape, jnp.dtype(a.dtype)) for a in jax.tree.leaves(pull)
          if hasattr(a, "shape")]
  big = [k for k in kept if k[0] == x.shape]
  assert big == [(x.shape, jnp.dtype(jnp.bfloat16))], kept


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_fused_ops_xla_layer_norm_takes_the_rule_with_the_references_values(op):
  """The fused ops' "xla" implementations run their LayerNorm through the rule: outputs (h
  too) and gradients of every argument equal the reference's autodiff in float64."""
  with jax.enable_x64(True):
    keys = jax.random.split(jax.random.key(5), 8)
    m, k, n = 6, 12, 10
    r = lambda i, shape, loc=0.0: loc + jax.random.normal(keys[i], shape, jnp.float64)  # noqa: E731
    if op == "norm_matmul":
      args = (r(0, (m, k), 0.3), r(1, (k, n)), r(2, (k,), 1.0), r(3, (k,)))
      ours = lambda x, w, s, b: pn.norm_matmul(x, w, scale=s, norm_bias=b, norm="layer",  # noqa: E731
                                               implementation="xla")
      ref = lambda x, w, s, b: reference.norm_matmul(x, w, s, b, norm="layer")  # noqa: E731
    else:
      args = (r(0, (m, k)), r(1, (k, n)), r(2, (n,)), r(3, (m, n)), r(4, (n,), 1.0), r(5, (n,)))
      ours = lambda *a: pn.matmul_norm(*a[:2], dense_bias=a[2], residual=a[3], scale=a[4],  # noqa: E731
                                       norm_bias=a[5], implementation="xla", return_h=True)
      ref = lambda *a: reference.matmul_norm(*a, norm="layer", return_h=True)  # noqa: E731

    def loss(f):
      def total(*a):
        outs = f(*a)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(outs))
      return jax.jit(jax.value_and_grad(total, argnums=tuple(range(len(args)))))
    chex.assert_trees_all_close(loss(ours)(*args), loss(ref)(*args), atol=F64_TOL, rtol=F64_TOL)


# ------------------------------------------------------------------------------------------------
# Rows of large magnitude: autodiff of rsqrt formed r³, which flushes to zero in float32 once
# r < ~2e-13 (|x| ≳ 5e12), and the input gradient lost its x̂·mean(g ⊙ x̂) term (10–50% off).


def _large_rows(seed, shape, magnitude):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x = magnitude * (0.5 + jax.random.normal(k1, shape, jnp.float32))
  scale = 1 + 0.2 * jax.random.normal(k2, (shape[-1],))
  return x, scale, jax.random.normal(k3, shape, jnp.float32)


def _grad_vs_float64(f, args, ct):
  """max |g32 − g64| / max |g64| over each argument's float32 gradient of f against the same
  function in float64 (the reference's closed form is exact there)."""
  g32 = jax.jit(lambda *a: jax.vjp(f, *a)[1](ct))(*args)
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
    g64 = jax.vjp(f, *a64)[1](jnp.asarray(np.asarray(ct), jnp.float64))
  return [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))) /
                np.max(np.abs(np.asarray(b)))) for a, b in zip(g32, g64)]


@pytest.mark.parametrize("magnitude", [1e13, 1e16])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_gradients_of_large_rows_match_float64(impl, norm, magnitude):
  """dx and dγ of rows with |x| ~ 1e13 and 1e16 (their mean square within float32's range)
  within 1e-5 of float64 (float32 rounding; was 0.1–0.5 for dx)."""
  x, scale, ct = _large_rows(seed_of(f"large-{norm}-{magnitude}"), (6, 96), magnitude)
  f = _call(norm, impl, eps=1e-6)
  errs = _grad_vs_float64(lambda x, s: f(x, s, None, None), (x, scale), ct)
  assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm", "flash_norm_attention"])
def test_fused_ops_xla_gradients_of_large_rows_match_float64(op):
  """The fused ops' XLA path on inputs of |x| ~ 1e14: every input gradient within 1e-5 of
  float64 (the RMSNorm in each: norm_matmul's of x, matmul_norm's of h = x W, the block's of z
  = gdpa(q) without the LayerNorm and residuals)."""
  x, scale, _ = _large_rows(seed_of(f"fused-{op}"), (8, 64), 1e14)
  k = jax.random.split(jax.random.key(seed_of(f"fused-w-{op}")), 3)
  if op == "flash_norm_attention":
    q = x.reshape(8, 2, 32)
    kv = [0.3 * jax.random.normal(k[i], (2, 4, 2, 32)) for i in range(2)]
    offsets = jnp.array([0, 3, 8], jnp.int32)

    def f(q, s, kk, vv):
      return pn.flash_norm_attention(q, kk, vv, offsets, rms_scale=s, pre_layer_norm=False,
                                     inner_residual=False, outer_residual=False,
                                     implementation="xla")
    args, ct = (q, scale, *kv), jax.random.normal(k[2], q.shape)
  else:
    w = jax.random.normal(k[0], (64, 64)) / 8
    fn = getattr(pn, op)
    f = lambda x, s, w: fn(x, w, norm="rms", scale=s, implementation="xla")
    args, ct = (x, scale, w), jax.random.normal(k[2], (8, 64))
  errs = _grad_vs_float64(f, args, ct)
  assert max(errs) < 1e-5, errs
