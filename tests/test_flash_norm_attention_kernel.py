"""The fused FlashNormAttention kernel (pallas_norm.ops.flash_norm_attention) and the unfused
chain, against the reference.

CPU tests run the kernels in GPU interpret mode (race detector on, uninitialized SMEM and
outputs NaN-filled, so a row the kernel never writes shows up as NaN); q's padding rows are NaN
too. Lowering tests run Mosaic's lowering for sm_90a via ``jax.export`` (no GPU). ``gpu`` tests
run the compiled kernel at the issue's sizes.

The oracle is :func:`pallas_norm.reference.flash_norm_attention` on float32-upcast inputs.
Tolerance: relative Frobenius error < 2e-2 (u, P and the attention output are rounded to bf16,
as in the unfused chain), padding rows exactly zero; the scale gradients, sums that cancel, within
2e-2 of |sum| + sqrt(Σ term²) (:func:`_scale_terms`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import export

from conftest import FAST_COMPILE_FLAG
import pallas_norm as pn
from pallas_norm import _dispatch, jagged, mgpu, reference
from pallas_norm.ops.flash_norm_attention import api as fna_api
from pallas_norm.ops.flash_norm_attention import cluster, mosaic, norm_bwd
from pallas_norm.ops.gdpa import mosaic as gdpa_mosaic
from pallas_norm.ops.gdpa import mosaic_bwd as gdpa_mosaic_bwd

TOL = 2e-2
F32 = jnp.float32


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _problem(seed, q_lens, heads, head_dim, lkv=64, *, large_mean_row=None, capacity=None):
  """Random bf16 inputs, dense K/V; q's padding rows NaN (by default 8 to 15 of them); affines
  with some zeros in γ2. NumPy's generator (drawn in float32): JAX's would compile a program
  per shape."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, scale=1.0, shift=0.0: shift + scale * rng.standard_normal(  # noqa: E731
      shape, np.float32)
  total = int(np.sum(q_lens))
  capacity = capacity or -(-total // 8) * 8 + 8
  q = normal((capacity, heads, head_dim))
  if large_mean_row is not None:  # |mean| / std = 100: the shifted one-pass variance must hold
    q[large_mean_row] += 100.0
  q = q.astype(jnp.bfloat16)
  q[total:] = np.nan
  q_offsets = jnp.asarray(jagged.offsets_from_lengths(np.asarray(q_lens)))
  shape = (len(q_lens), lkv, heads, head_dim)
  k = normal(shape, head_dim ** -0.5).astype(jnp.bfloat16)
  v = normal(shape).astype(jnp.bfloat16)
  f = heads * head_dim
  affine = dict(ln_scale=normal((f,), 0.2, 1.0), ln_bias=normal((f,), 0.2),
                rms_scale=normal((f,), 0.2, 1.0))
  affine["rms_scale"][::7] = 0.0
  return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_offsets,
          {name: jnp.asarray(a) for name, a in affine.items()})


def _clean(q, q_offsets):
  return jnp.where(jagged.valid_mask(q_offsets, q.shape[0])[:, None, None], q, 0)


def _scale_terms(q, k, v, q_offsets, affine, weights, pre, post, max_seq_len):
  """sqrt(Σ term²) of the sums that make the scale gradients, from the f32 reference at
  ``weights`` (the cotangent): ``d pre = Σ (du_attn / pre) ⊙ u`` and ``d post = Σ (attn / post)
  ⊙ dz`` (test_gdpa_bwd_kernel's terms, for the block's inner GDPA with dO = dz).

  The sums cancel: dz ⊥ z row by row (the RMSNorm's output does not change with z's scale), and
  z is mostly attn (|attn| ≈ 5-7 |u| here), so d post is a small rest of Σ attn ⊙ dz, and d pre
  often as small. Rounding u, P, attn, z and dz to 16 bits, as the kernel paths do, moves each
  term by ~2^-9 of itself: the error scales with these terms, not with the sum, which can be
  10^2-10^3 times smaller. Against an f64 oracle (bf16, 23 random problems of H·D = 128 and
  256) the fused path's error reached 42% of d pre and 57% of d post, but at most 1.1% of
  sqrt(Σ term²) (median 0.25%); the unfused chain's was as large (0.73%), and an f64 emulation
  of those five roundings gives the kernel's values to 0.02% of sqrt(Σ term²)."""
  qf, kf, vf = (x.astype(F32) for x in (q, k, v))

  def attention(u):
    return reference.gdpa(u, kf, vf, q_offsets, pre_scale=pre, post_scale=post,
                          max_seq_len=max_seq_len)

  def block(attention):
    return reference.flash_norm_block(
        qf, q_offsets, attention, eps=1e-6, out_dtype=None, pre_layer_norm=True,
        inner_residual=True, outer_residual=True, return_stats=False, **affine)

  @jax.jit  # one program: eagerly, each op compiled on its own (4 of the test's seconds)
  def terms(weights):
    captured = {}
    block(lambda u: captured.setdefault("u", u) * 0)  # u as the block makes it
    u = captured["u"]
    attn, attn_vjp = jax.vjp(attention, u)
    (dz,) = jax.vjp(lambda a: block(lambda _: a), attn)[1](weights.astype(F32))
    (du,) = attn_vjp(dz)
    return du / pre * u, attn / post * dz

  norm = lambda x: float(np.linalg.norm(np.asarray(x, np.float64).ravel()))  # noqa: E731
  return tuple(map(norm, terms(weights)))


def _reference(q, k, v, q_offsets, **kw):
  """The f32 oracle, jitted: one compiled program instead of one per eager op."""
  oracle = jax.jit(lambda q, k, v: reference.flash_norm_attention(
      _clean(q, q_offsets).astype(F32), k.astype(F32), v.astype(F32), q_offsets,
      return_stats=True, **kw))
  return oracle(q, k, v)


@pytest.mark.parametrize("kernel,heads", [("mosaic", 2), ("cluster", 1)])
def test_fused_forward_matches_reference(kernel, heads, monkeypatch):
  """Output and statistics (μ1, r1, r2) of the fused kernel (one CTA per q block, or the
  cluster kernel at H = 1), through the op: an empty sample, a sample over two q blocks, a row
  with a large mean, γ2 with zeros, a NaN padding row of q. Also ``return_stats=False`` (the
  kernel then skips writing the statistics): no statistics output, and out bit for bit as with
  them (merged from a test of its own that compiled the with-statistics kernel again).
  Exactly one padding row (capacity = total + 1; the other problems have 8 or more): it is
  written, 0 in out and the statistics (interpret mode NaN-fills unwritten rows). A mutation
  test that left the last padding block unwritten when it held one row passed before (merged
  from test_fused_forward_zeroes_a_single_padding_row, which compiled this kernel again)."""
  for end, capacity, want in ((87, 88, 1), (88, 88, 0), (81, 88, 1), (7, 72, 2)):
    assert int(mosaic.padding_blocks(jnp.int32(end), capacity)) == want, (end, capacity)
  if kernel == "cluster":
    _route_to_cluster(monkeypatch)
  q, k, v, qo, affine = _problem(0, [5, 70, 0, 12], heads, 64, large_mean_row=6, capacity=88)
  kw = dict(affine, pre_scale=0.9, post_scale=1.1, eps=1e-5)
  run = lambda stats: jax.block_until_ready(jax.jit(  # noqa: E731
      lambda q, k, v, qo: pn.flash_norm_attention(
          q, k, v, qo, return_stats=stats, implementation="interpret", **kw))(q, k, v, qo))
  out, (ln, rms) = run(True)
  no_stats = run(False)
  assert not isinstance(no_stats, tuple)
  np.testing.assert_array_equal(np.asarray(no_stats, np.float32), np.asarray(out, np.float32))
  assert not mgpu.races_found()
  ref, (ln_ref, rms_ref) = _reference(q, k, v, qo, **kw)
  total = int(qo[-1])
  assert q.shape[0] == total + 1
  assert bool(jnp.all(jnp.isfinite(out))), "rows never written (NaN-filled) or NaN leaked"
  assert not bool(jnp.any(out[total:] != 0)), "padding rows must be zeros"
  assert _rel_err(out[:total], ref[:total]) < TOL
  assert _rel_err(out[6], ref[6]) < TOL  # the large-mean row
  for got, want in ((ln.mean, ln_ref.mean), (ln.rstd, ln_ref.rstd), (rms.rstd, rms_ref.rstd)):
    assert _rel_err(got[:total], want[:total]) < TOL
    assert not bool(jnp.any(got[total:] != 0))


@pytest.mark.parametrize("switches", [(False, False, False)])
def test_fused_switches_match_reference(switches):
  """The megakernel's switches all off (with the default, all on, in
  test_fused_forward_matches_reference, each switch runs both ways; the outer residual adds q,
  not u, which the default's LayerNorm tells apart)."""
  pre_layer_norm, inner_residual, outer_residual = switches
  q, k, v, qo, affine = _problem(1, [3, 64, 20], 2, 64)
  if not pre_layer_norm:
    affine = dict(rms_scale=affine["rms_scale"])
  kw = dict(affine, pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
            outer_residual=outer_residual, activation="silu")
  out, (ln, rms) = jax.jit(lambda q, k, v, qo: pn.flash_norm_attention(
      q, k, v, qo, return_stats=True, implementation="interpret", **kw))(q, k, v, qo)
  ref, (_, rms_ref) = _reference(q, k, v, qo, **kw)
  total = int(qo[-1])
  assert (ln is None) == (not pre_layer_norm)
  assert not bool(jnp.any(out[total:] != 0))
  assert _rel_err(out[:total], ref[:total]) < TOL
  assert _rel_err(rms.rstd[:total], rms_ref.rstd[:total]) < TOL


def test_fused_layer_norm_variance_past_float32_range():
  """Rows of q whose squares pass float32's range: values ≈ 1e20 but the row's first 8 (the
  shift of the one-pass variance, _layer_norm_stats) 0, so E[d²] and E[d]² both overflow. The
  variance is +inf, r1 = 0 and u = β1, as in the reference (its centred squares overflow too)
  and in two-pass statistics; inf − inf made those rows NaN.
  H·D = 512 (one q buffer: the streamed statistics); no outer residual, which would hide u
  under + q.
  Then, in the same compiled program (merged from
  test_layer_norm_statistics_of_rows_near_bf16_resolution, which compiled the kernel at other
  sizes): bf16 rows of values μ and μ ± ulp(μ) (|mean|/std ≈ 150, about the most bf16
  resolves): the shifted sums give r1 to ~1e-7 of the float64 statistics of the same values;
  the plain one-pass variance is ~1e-3 off, which the 2e-2 tolerances elsewhere cannot see."""
  q, k, v, qo, affine = _problem(5, [70, 0, 9], 4, 128)
  x = np.asarray(q, np.float32)
  x[:4] = 1e20 * (1.0 + 1e-2 * x[:4])
  x[:4, 0, :8] = 0.0
  q = jnp.asarray(x.astype(jnp.bfloat16))
  kw = dict(pre_scale=0.9, post_scale=1.1, outer_residual=False)
  run = jax.jit(lambda q, k, v, qo, affine: pn.flash_norm_attention(
      q, k, v, qo, return_stats=True, implementation="interpret", **affine, **kw))
  out, (ln, rms) = run(q, k, v, qo, affine)
  ref, (ln_ref, rms_ref) = _reference(q, k, v, qo, **affine, **kw)
  total = int(qo[-1])
  assert bool(jnp.all(jnp.isfinite(ref[:total]))) and not bool(jnp.any(ln_ref.rstd[:4]))
  assert bool(jnp.all(jnp.isfinite(out))), "NaN rows"
  assert _rel_err(out[:total], ref[:total]) < TOL
  assert _worst_row_err(out[:total], ref[:total]) < TOL
  for got, want in ((ln.mean, ln_ref.mean), (ln.rstd, ln_ref.rstd), (rms.rstd, rms_ref.rstd)):
    assert _rel_err(got[:total], want[:total]) < TOL
  # Rows near bf16's resolution: three samples (one empty) in the same capacity.
  rng = np.random.default_rng(1)
  t, heads, d = q.shape
  mu = rng.uniform(1, 2, (t, 1, 1)) * 2.0 ** rng.integers(0, 20, (t, 1, 1))
  x = mu * (1.0 + 2.0 ** -7 * rng.integers(-1, 2, size=(t, heads, d)))
  x[total:] = 0
  q = jnp.asarray(x.astype(np.float32)).astype(jnp.bfloat16)
  rows = np.asarray(q, np.float64)[:total].reshape(total, -1)  # the values the kernel sees
  _, (ln, _) = run(q, k, v, jnp.asarray(np.array([0, 40, 40, total], np.int32)), affine)
  mean, rstd = (np.asarray(a[:total], np.float64) for a in (ln.mean, ln.rstd))
  assert np.max(np.abs(mean - rows.mean(1)) / np.sqrt(rows.var(1))) < 1e-4
  np.testing.assert_allclose(rstd, 1 / np.sqrt(rows.var(1) + 1e-6), rtol=2e-5)


@pytest.mark.slow  # 15-20 s: xdist hands it out early
@pytest.mark.parametrize("variants,switches", [
    ([dict(kv_stages=2), dict(residual_copy=False), dict(q_buffers=2, residual_copy=False),
      dict(cta_group=1), dict(q_buffers=2, cta_group=1)], dict()),
    ([dict(q_buffers=2)], dict(pre_layer_norm=False, inner_residual=False))],
    ids=["ring_and_q_buffers", "q_buffers_switches_off"])
def test_fused_variants_match_default(variants, switches):
  """Each variant of the one-CTA kernel's base Config (one q buffer, a 4-slot K/V ring) against
  it, bit for bit, with the backward's residuals z and u (checked against their definitions),
  over a sample of three q blocks (130 rows), one of none and one of a single block, and three
  key blocks per head:
  - a 2-slot K/V ring (the H = 4 kernel's): same arithmetic; the ring wraps at other key blocks
    and the producer waits for releases. Default switches only (the ring depth is orthogonal
    to them).
  - two q buffers (Config.q_buffers: the next block's q tiles, statistics and u tiles made
    before the current block's epilogue; the first buffer reused), also with the LayerNorm and
    the inner residual off (the attention warpgroup then waits for q itself, reading q_h as TMA
    wrote it, in the block's buffer).
  - no residual copy (Config.residual_copy: the epilogue loads q_h again from GMEM into the
    head's working tile once z_h was read from it), with one and with two q buffers.
  - CTAs that each take a contiguous run of the block list (Config.cta_group = 1) instead of
    the pairs that take a run's blocks in turn, with one and with two q buffers: in interpret
    mode both of the two CTAs cross a sample boundary in either schedule.
  Two q buffers alone (the residual copy, CTA pairs) is no variant of its own: the kernel
  indexes its buffers by the CTA's own block count, so the schedule does not meet them; the
  buffers with the copy run in (q_buffers=2, cta_group=1) and q_buffers_switches_off, with CTA
  pairs in (q_buffers=2, residual_copy=False) and q_buffers_switches_off.
  One default run serves the variants of a parametrization (the ring and the q-buffer tests
  ran it each). The op's forward-only tests cover the kernel without the residuals."""
  _check_variant_matches_default(mosaic, 2, variants, (130, 0, 9), **switches)


def _check_variant_matches_default(module, heads, variants, lens=(70, 0, 9), lkv=192,
                                   **switches):
  """Each of ``variants`` (Config field changes) of a base Config of the forward kernel
  ``module`` against it, bit for bit (samples of ``lens`` rows, Lkv = 192 by default: three
  key blocks); the default and its z and u against the reference."""
  q, k, v, qo, affine = _problem(3, list(lens), heads, 64, lkv=lkv)
  a = jnp.stack([affine["ln_scale"], affine["ln_bias"], affine["rms_scale"]]).reshape(
      3, heads, 64)
  run = lambda cfg: jax.block_until_ready(module.flash_norm_attention_fwd(  # noqa: E731
      q, k, v, qo, a, 0.9, 1.1, activation="fast_gelu", eps=1e-6,
      save_residuals=True, config=cfg, interpret=True, **switches))
  if module is mosaic:  # one q buffer and a 4-slot K/V ring: the base the variants change
    default = mosaic.Config(block_kv=64, kv_stages=4)
  else:  # the cluster kernel's own pick: resident K/V
    default = module.pick_config(heads, 64, q.dtype, q.dtype, k.shape[1])
    assert default.kv_stages is None
  want = run(default)
  assert len(want) == 4
  for variant in variants:
    got = run(dataclasses.replace(default, **variant))
    _assert_forwards_equal(got, want, int(qo[-1]), err_msg=str(variant))
  assert not mgpu.races_found()
  total = int(qo[-1])
  pre_layer_norm = switches.get("pre_layer_norm", True)
  kw = dict(affine, pre_scale=0.9, post_scale=1.1, **switches)
  if not pre_layer_norm:
    kw = dict(kw, ln_scale=None, ln_bias=None)
  ref = _reference(q, k, v, qo, **kw)[0]
  assert _rel_err(want[0][:total], ref[:total]) < TOL
  _check_residuals(want, q, k, v, qo, kw)
  if module is mosaic:  # r2 of the z it saves, to float32's rounding (it squares z as saved;
    # TOL let r2 rounded to bf16, 3.5e-3 off, pass a mutation test. The cluster kernel squares
    # z before rounding it for the save: ~1e-3 from this, too close to tell.)
    zf = np.asarray(want[2][:total], np.float64).reshape(total, -1)
    np.testing.assert_allclose(want[1][:total, 2], 1 / np.sqrt((zf ** 2).mean(1) + 1e-6),
                               rtol=1e-5)


def _assert_forwards_equal(got, want, total: int, err_msg: str = ""):
  """Two training-form forwards bit for bit: out and the statistics whole, the saved z and u
  (None or not) on the live rows (their padding rows are unspecified)."""
  for i, (g, w) in enumerate(zip(got, want)):
    assert (g is None) == (w is None)
    if w is not None:
      rows = slice(None) if i < 2 else slice(0, total)
      np.testing.assert_array_equal(np.asarray(g[rows], np.float32),
                                    np.asarray(w[rows], np.float32), err_msg=err_msg)


def _check_residuals(outputs, q, k, v, qo, kw, row_tol=None):
  """The forward's saved z and u against the reference's u and u + gdpa(u) (the attention
  through reference.gdpa) on the live rows (their padding rows are unspecified: the backward
  never reads them, which the gradient tests check with NaN-filled unwritten memory); with
  ``row_tol`` also every row's relative error (a few bad rows hide in the whole array's)."""
  _, stats, z, u = outputs
  total = int(qo[-1])
  qf = _clean(q, qo).astype(F32)
  t, h, d = q.shape
  if kw.get("pre_layer_norm", True):
    x_hat = (qf.reshape(t, h * d) - stats[:, :1]) * stats[:, 1:2]
    u_want = (x_hat * kw["ln_scale"] + kw["ln_bias"]).reshape(q.shape)
    assert _rel_err(u[:total], u_want[:total]) < TOL
    if row_tol is not None:
      assert _worst_row_err(u[:total], u_want[:total]) < row_tol
  else:
    assert u is None
    u_want = qf
  attn = jax.jit(lambda u: reference.gdpa(
      u.astype(q.dtype).astype(F32), k.astype(F32), v.astype(F32), qo, activation="fast_gelu",
      pre_scale=kw["pre_scale"], post_scale=kw["post_scale"]))(u_want)
  z_want = attn + u_want if kw.get("inner_residual", True) else attn
  assert _rel_err(z[:total], z_want[:total]) < TOL
  if row_tol is not None:
    assert _worst_row_err(z[:total], z_want[:total]) < row_tol


def _worst_row_err(a, b):
  """max over rows of ‖a_row − b_row‖ / ‖b_row‖ (rows: the first axis)."""
  a = np.asarray(a, np.float64).reshape(a.shape[0], -1)
  b = np.asarray(b, np.float64).reshape(b.shape[0], -1)
  num = np.linalg.norm(a - b, axis=1)
  return float(np.max(num / np.maximum(np.linalg.norm(b, axis=1), 1e-30)))


@pytest.mark.slow  # 15-20 s: xdist hands it out early
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_gradients_match_reference(head_dim):
  """The custom_vjp (the two row kernels of norm_bwd around the GDPA backward kernel) against
  the f32 reference's gradients: q, k, v, the three affines and traced pre_scale and post_scale.
  The scale gradients are judged against the size of their terms (:func:`_scale_terms`), as
  test_gdpa_bwd_kernel does: a bound relative to the sum alone would fail on rounding alone.
  TOL there is 2.5 times the worst of a sweep of this family (84 problems: H 1 and 2, D 64 and
  128, with and without the LayerNorm, random lengths and scales; 8.0e-3 of |sum| +
  sqrt(Σ term²), benchmarks/results/logs/2026-12-07_fna_scale_grad_sweep_cpu.md).
  Also, with the default switches, test_fused_gradients_ignore_nan_padding_rows's check: NaN in
  the padding rows of q and of the cotangent gives the same gradients bit for bit (one compiled
  program runs all three). D = 128 takes the GDPA backward's fused dQ with its + dO (the path
  of the issue shape), D = 64 the separate dQ kernel."""
  q_nan, k, v, qo, affine = _problem(2, [5, 0, 70, 9], 2, head_dim)  # with an empty sample
  total = int(qo[-1])
  q = _clean(q_nan, qo)  # a gradient at NaN inputs is NaN in the reference
  weights = jnp.sin(jnp.arange(q.size, dtype=F32)).reshape(q.shape)

  def loss(q, k, v, ln_scale, ln_bias, rms_scale, pre, post, weights, offsets, impl):
    out = pn.flash_norm_attention(q, k, v, offsets, ln_scale=ln_scale, ln_bias=ln_bias,
                                  rms_scale=rms_scale, pre_scale=pre, post_scale=post,
                                  max_seq_len=80, implementation=impl)
    return jnp.sum(out.astype(F32) * weights), out

  # pre·post = 0.75, far from 1: at 0.9 · 1.1 a scale dropped or applied twice moved dq by 1%,
  # under TOL (a mutation test: dO added as pre·post·dO in the dQ kernel passed).
  args = (q, k, v, affine["ln_scale"], affine["ln_bias"], affine["rms_scale"], jnp.float32(0.5),
          jnp.float32(1.5))
  # Traced offsets (an argument, not a constant): the bad offsets below run the same program.
  grad_and_out = jax.jit(jax.grad(loss, argnums=range(8), has_aux=True), static_argnums=10)
  grad = lambda *a: grad_and_out(*a[:-1], qo, a[-1])[0]  # noqa: E731
  got = grad(*args, weights, "interpret")
  want = grad(*(a.astype(F32) for a in args), weights, "xla")  # one program
  names = ("q", "k", "v", "ln_scale", "ln_bias", "rms_scale")
  for name, a, g, w in zip(names, args, got, want):
    assert g.shape == a.shape and g.dtype == a.dtype, name
    assert _rel_err(g, w) < TOL, name
  terms = _scale_terms(q, k, v, qo, affine, weights, 0.5, 1.5, 80)
  for name, g, w, t in zip(("pre_scale", "post_scale"), got[6:], want[6:], terms):
    assert g.shape == () and g.dtype == F32, name
    err = abs(float(g) - float(w))
    assert err <= TOL * (abs(float(w)) + t), (name, float(g), float(w), t)
  nan_got = grad(q_nan, *args[1:], weights.at[total:].set(jnp.nan), "interpret")
  for name, g, c in zip(names + ("pre_scale", "post_scale"), nan_got, got):
    assert bool(jnp.all(jnp.isfinite(g))), f"NaN from a padding row leaked into d{name}"
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(c, np.float32), name)
  assert not bool(jnp.any(nan_got[0][total:] != 0)), "dq's padding rows must be 0"
  # γ2 = 0: out = q, so only the outer residual carries a cotangent: dq is it (weights in bf16)
  # bit for bit, dk, dv, dγ1, dβ1 exactly 0 (TOL let that branch scaled by 0.99 pass a
  # mutation test). The same compiled program.
  out_only = grad(*args[:5], jnp.zeros_like(args[5]), *args[6:], weights, "interpret")
  np.testing.assert_array_equal(np.asarray(out_only[0][:total], F32),
                                np.asarray(weights[:total].astype(q.dtype), F32))
  for name, g in zip(names[:5], (out_only[0][total:],) + out_only[1:5]):
    assert not np.any(np.asarray(g, F32)), name
  if head_dim == 64:  # and the one-CTA forward's poison (see _check_bad_offsets_give_nan)
    bad = jnp.array([0, 5, 5, 75, q.shape[0] + 1], jnp.int32)  # the last past the capacity
    _check_bad_offsets_give_nan(*grad_and_out(*args, weights, bad, "interpret"),
                                names + ("pre_scale", "post_scale"))


@pytest.mark.parametrize("switches,kernel", [((False, True, False), "mosaic"),
                                             ((False, True, True), "mosaic"),
                                             ((True, False, True), "mosaic"),
                                             ((True, True, True), "cluster")])
def test_fused_gradients_ignore_nan_padding_rows(switches, kernel, monkeypatch):
  """The backward's row kernels work on live rows only (dz's padding rows unwritten, NaN in
  interpret mode): NaN in the padding rows of q and of the cotangent, with traced scales, gives
  the gradients of zero padding bit for bit (dq's padding rows 0, every parameter and scale
  gradient finite) and the f32 reference's (review13). With the LayerNorm and the outer
  residual off, the LayerNorm off alone, the inner residual off alone (a mutation test dropped
  the outer residual's dq, or added dO to dq without the inner residual, unnoticed before
  these two); test_fused_gradients_match_reference checks the same with every switch on.
  Also through the cluster forward (H = 1, every switch on), whose saved z and u keep their
  padding rows unwritten (NaN-filled here): the backward must not read them."""
  if kernel == "cluster":
    _route_to_cluster(monkeypatch)
  pre_layer_norm, inner_residual, outer_residual = switches
  heads = 2 if kernel == "mosaic" else 1
  q, k, v, qo, affine = _problem(5, [5, 0, 9], heads, 64)  # q's padding rows NaN, T = 24
  if not pre_layer_norm:
    affine = dict(rms_scale=affine["rms_scale"])
  total = 14
  weights = jnp.cos(jnp.arange(q.size, dtype=F32)).reshape(q.shape)
  nan_weights = weights.at[total:].set(jnp.nan)
  switch_kw = dict(pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
                   outer_residual=outer_residual)

  def grads(q, k, v, affine, pre, post, w, offsets, impl):
    def block(q, k, v, affine, pre, post):
      return pn.flash_norm_attention(q, k, v, offsets, pre_scale=pre, post_scale=post,
                                     max_seq_len=16, implementation=impl, **affine, **switch_kw)
    out, vjp = jax.vjp(block, q, k, v, affine, pre, post)
    return out, vjp(w.astype(out.dtype))

  # Traced offsets (an argument, not a constant): the cluster's bad offsets run the same program.
  out_and_grads = jax.jit(grads, static_argnums=8)
  run = lambda *a: out_and_grads(*a[:-1], qo, a[-1])[1]  # noqa: E731
  scales = (jnp.float32(0.9), jnp.float32(1.1))
  got = run(q, k, v, affine, *scales, nan_weights, "interpret")
  clean = run(_clean(q, qo), k, v, affine, *scales, weights.at[total:].set(0), "interpret")
  want = run(_clean(q, qo).astype(F32), k.astype(F32), v.astype(F32), affine, *scales,
             weights.at[total:].set(0), "xla")
  for g, c in zip(jax.tree.leaves(got), jax.tree.leaves(clean)):
    assert bool(jnp.all(jnp.isfinite(g))), "NaN from a padding row leaked into a gradient"
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(c, np.float32))
  assert not bool(jnp.any(got[0][total:] != 0)), "dq's padding rows must be 0"
  for name, g, w in zip(("q", "k", "v"), got[:3], want[:3]):
    assert _rel_err(g[:total], w[:total]) < TOL, name
  for name in affine:
    assert _rel_err(got[3][name], want[3][name]) < TOL, name
  if kernel == "cluster":  # and the cluster forward's poison (see _check_bad_offsets_give_nan)
    bad = jnp.array([0, 5, 14, q.shape[0] + 1], jnp.int32)  # the last past the capacity
    out, (dq, dk, dv, daffine, dpre, dpost) = out_and_grads(
        _clean(q, qo), k, v, affine, *scales, weights, bad, "interpret")
    _check_bad_offsets_give_nan((dq, dk, dv, *daffine.values(), dpre, dpost), out,
                                ("q", "k", "v", *daffine, "pre_scale", "post_scale"))


@pytest.mark.parametrize("switches,prefetch", [
    ((True, True, True), False), ((True, True, True), True), ((False, True, True), None),
    ((True, False, False), None)])
def test_norm_backward_kernels_match_autodiff(switches, prefetch):
  """norm_bwd's two row kernels (interpret mode), with the attention replaced by attn = c·u (so
  du_attn = c·dz), against autodiff of the reference block in float32: dq, dγ1, dβ1, dγ2, and
  dz for the GDPA backward. H·D = 96 (masked columns), a row with a large mean, γ with zeros,
  NaN padding rows in q and z (past ``end``), f32 kernels' inputs (the math, tight). Rows past
  ``end`` are neither read nor written: dz's stay unwritten (the GDPA backward never reads
  them), dq's keep du's (dq is written over it). ``prefetch``: both kernels with the next
  block's loads ahead of the math, or both without (None: each kernel's default); the
  programs take uneven numbers of row blocks (p, p + P, ...), the last one fewer."""
  pre_layer_norm, inner_residual, outer_residual = switches
  t, heads, head_dim, end, c = 40, 2, 48, 33, 0.7
  n = heads * head_dim
  ks = jax.random.split(jax.random.key(11), 5)
  q = jax.random.normal(ks[0], (t, heads, head_dim), F32).at[3].add(100.0)
  g = jax.random.normal(ks[1], (t, heads, head_dim), F32)
  gamma1 = (1 + 0.3 * jax.random.normal(ks[2], (n,))).at[::5].set(0.0)
  beta1 = 0.3 * jax.random.normal(ks[3], (n,))
  gamma2 = (1 + 0.3 * jax.random.normal(ks[4], (n,))).at[::7].set(0.0)
  qo = jnp.array([0, 12, end], jnp.int32)
  opts = dict(eps=1e-5, out_dtype=None, pre_layer_norm=pre_layer_norm,
              inner_residual=inner_residual, outer_residual=outer_residual)

  def block(q, gamma1, beta1, gamma2, return_stats=False):
    return reference.flash_norm_block(q, qo, lambda u: c * u, ln_scale=gamma1, ln_bias=beta1,
                                      rms_scale=gamma2, return_stats=return_stats, **opts)

  @jax.jit  # the oracle as one program: eagerly, each op compiled on its own
  def oracle(q, gamma1, beta1, gamma2, g):
    stats = block(q, gamma1, beta1, gamma2, return_stats=True)[1]
    return stats, jax.vjp(block, q, gamma1, beta1, gamma2)[1](g)

  (ln, rms), (dq_ref, dg1_ref, db1_ref, dg2_ref) = oracle(q, gamma1, beta1, gamma2, g)
  zeros = jnp.zeros((t,), F32)
  stats = jnp.stack([ln.mean, ln.rstd, rms.rstd] if ln else [zeros, zeros, rms.rstd], axis=1)
  rows = lambda a: a.reshape(t, n)  # noqa: E731
  q_in = rows(q).at[end:].set(jnp.nan)  # padding rows are never read as data
  x_hat = (rows(q) - stats[:, :1]) * stats[:, 1:2]
  u_want = jnp.where(jnp.arange(t)[:, None] < end,
                     x_hat * gamma1 + beta1 if pre_layer_norm else rows(q), 0)
  z = ((1 + c) * u_want if inner_residual else c * u_want).at[end:].set(jnp.nan)
  # The forward's (T, 32) layout: the kernels read their columns in place, the rest is junk.
  stats32 = jnp.concatenate([stats, jnp.full((t, 29), jnp.nan, F32)], axis=1)
  def config(kernel):
    cfg = norm_bwd.pick_config(n, True, t, kernel)
    return cfg if prefetch is None else dataclasses.replace(cfg, prefetch=prefetch)

  dz, dg2 = norm_bwd.rms_backward(rows(g), z, stats32, gamma2, jnp.int32(end),
                                  interpret=True, config=config("rms"))
  with pytest.raises(ValueError, match="stats"):  # a column slice: the old (T,) argument
    norm_bwd.rms_backward(rows(g), z, stats[:, 2], gamma2, jnp.int32(end), interpret=True)
  assert _rel_err(dg2, dg2_ref) < 1e-4
  if not pre_layer_norm:  # u = q: dq is the sum of the branches (the op does it in XLA)
    dq = c * dz + (dz if inner_residual else 0) + (rows(g) if outer_residual else 0)
    assert _rel_err(dq[:end], rows(dq_ref)[:end]) < 1e-4
    return
  du = c * dz + dz if inner_residual else c * dz  # the GDPA backward's dq (+ dO)
  du = du.at[end:].set(0.25)  # the GDPA backward's padding rows (0 · pre · post), a marker here
  dq, dg1, db1 = norm_bwd.ln_backward(du, rows(g), q_in, stats32, gamma1, jnp.int32(end),
                                      outer_residual=outer_residual, interpret=True,
                                      config=config("ln"))
  assert bool(jnp.all(dq[end:] == 0.25)), "dq's padding rows are du's"
  assert _rel_err(dq[:end], rows(dq_ref)[:end]) < 1e-4
  assert _rel_err(dq[3], rows(dq_ref)[3]) < 1e-4  # the large-mean row
  assert _rel_err(dg1, dg1_ref) < 1e-4 and _rel_err(db1, db1_ref) < 1e-4


@pytest.mark.parametrize("prefetch", [False, True])
def test_norm_backward_weight_grads_depend_only_on_live_rows(prefetch):
  """The row kernels' dγ/dβ partials (one row per program, programs taking row blocks p,
  p + P, ...) are summed in an order fixed by ``end`` and the tiling: the same live rows with
  different junk past ``end`` (NaN or values) and, at the same tiling, a larger capacity give
  bit-identical weight gradients, and the live rows of dz and dq are identical too. (The
  default tiling's program count follows the capacity only below P row blocks: on the GPU
  P = 8 or 4 programs per SM.) H·D = 96 (masked columns), 37 live rows, programs of uneven
  block counts."""
  n, end = 96, 37
  ks = jax.random.split(jax.random.key(5), 8)
  live = [jax.random.normal(k, (end, n), F32).astype(jnp.bfloat16) for k in ks[:4]]
  stats = jnp.stack([jax.random.normal(ks[4], (end,)), 1 + jax.random.uniform(ks[5], (end,)),
                     0.5 + jax.random.uniform(ks[6], (end,))], axis=1)
  gamma = 1 + 0.1 * jax.random.normal(ks[7], (n,))

  def run(capacity, junk):
    pad = lambda a: jnp.concatenate(  # noqa: E731
        [a, jnp.full((capacity - end,) + a.shape[1:], junk, a.dtype)])
    g, z, q, du = (pad(a) for a in live)
    st = pad(stats)

    def config(kernel):  # the tiling of capacity 48, whatever the capacity
      return dataclasses.replace(norm_bwd.pick_config(n, True, 48, kernel), prefetch=prefetch)

    dz, dg2 = norm_bwd.rms_backward(g, z, st, gamma, jnp.int32(end), interpret=True,
                                    config=config("rms"))
    dq, dg1, db1 = norm_bwd.ln_backward(du, g, q, st, gamma, jnp.int32(end),
                                        outer_residual=True, interpret=True, config=config("ln"))
    return dz[:end], dq[:end], dg2, dg1, db1

  first = run(48, jnp.nan)
  for capacity, junk in ((48, 3.0), (64, jnp.nan)):
    for a, b in zip(first, run(capacity, junk)):
      assert bool(jnp.all(jnp.isfinite(a)))
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_norm_backward_kernels_clip_end_to_the_capacity():
  """``end`` past T acts as T (the documented clip to [0, T]): both row kernels give the same
  outputs as with end = T, every row live (a mutation test removed the clip unnoticed)."""
  t, n = 24, 96
  ks = jax.random.split(jax.random.key(12), 6)
  g, z, q, du = (jax.random.normal(k, (t, n), F32) for k in ks[:4])
  stats = jnp.stack([jax.random.normal(ks[4], (t,)), 1 + jax.random.uniform(ks[5], (t,)),
                     0.5 + jax.random.uniform(ks[5], (t,))], axis=1)
  gamma = 1 + 0.1 * jnp.sin(jnp.arange(n, dtype=F32))

  def run(end):
    return (norm_bwd.rms_backward(g, z, stats, gamma, jnp.int32(end), interpret=True),
            norm_bwd.ln_backward(du, g, q, stats, gamma, jnp.int32(end), outer_residual=True,
                                 interpret=True))

  want = run(t)
  assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(want))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(run(t + 9))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gdpa_backward_adds_do_to_dq():
  """The GDPA backward's ``add_do_to_dq`` (the inner residual's gradient, which the fused
  block's backward uses) at D = 128, Lkv = 64: dQ fused into the dK/dV kernel, dO read from
  the ring stage (the FNA gradient test covers D = 64, the separate dQ kernel), against the
  float32 vjp of reference.gdpa: dq + dO, dk, dv; padding rows of dq zero."""
  q, k, v, qo, _ = _problem(9, [5, 70], 1, 128, 64)
  q = _clean(q, qo)
  do = _clean(jnp.asarray(np.random.default_rng(10).standard_normal(q.shape, np.float32),
                          jnp.bfloat16), qo)
  got = jax.jit(lambda *a: gdpa_mosaic_bwd.gdpa_bwd(
      *a, activation="fast_gelu", pre_scale=0.9, post_scale=1.1, interpret=True,
      add_do_to_dq=True))(q, k, v, qo, None, do)
  assert not mgpu.races_found()  # dO's ring stage: read by the consumers, then reloaded by TMA
  attention = lambda q, k, v: reference.gdpa(  # noqa: E731
      q, k, v, qo, activation="fast_gelu", pre_scale=0.9, post_scale=1.1)
  f32 = [x.astype(F32) for x in (q, k, v)]
  dq, dk, dv = jax.jit(lambda *a: jax.vjp(attention, *a)[1](do.astype(F32)))(*f32)
  total = int(qo[-1])
  assert _rel_err(got[0][:total], (dq + do.astype(F32))[:total]) < TOL
  assert not bool(jnp.any(got[0][total:] != 0))
  assert _rel_err(got[1], dk) < TOL and _rel_err(got[2], dv) < TOL


def test_chain_for_calls_the_fused_kernel_does_not_take():
  """Jagged K/V is not the fused kernel's: the kernel names run the unfused chain (norms in
  XLA around the GDPA kernel, whose gradients test_gdpa_bwd_kernel covers) as the reference."""
  lens = [5, 60]
  q, _, _, qo, affine = _problem(3, lens, 2, 64)
  q = _clean(q, qo)
  ks = jax.random.split(jax.random.key(4), 2)
  kv_lens = np.array([40, 17])
  ko = jnp.asarray(jagged.offsets_from_lengths(kv_lens))
  k = (0.125 * jax.random.normal(ks[0], (64, 2, 64))).astype(jnp.bfloat16)
  v = jax.random.normal(ks[1], (64, 2, 64)).astype(jnp.bfloat16)
  assert "jagged" in mosaic.unsupported_reason(q, k, ko, None)

  out = jax.jit(lambda q, k, v: pn.flash_norm_attention(  # one program, not one per eager op
      q, k, v, qo, ko, max_seq_len=64, max_kv_len=64, implementation="interpret", **affine))(
          q, k, v)
  ref = jax.jit(lambda q, k, v: reference.flash_norm_attention(
      q.astype(F32), k.astype(F32), v.astype(F32), qo, ko, max_seq_len=64, max_kv_len=64,
      **affine))(q, k, v)
  assert not bool(jnp.any(out[65:] != 0)) and _rel_err(out[:65], ref[:65]) < TOL


def test_dispatch_reasons():
  """What the fused kernel refuses (then the chain or XLA runs), and the op's switch checks."""
  bf = jnp.bfloat16
  q = jnp.zeros((64, 4, 128), bf)
  dense = jnp.zeros((2, 128, 4, 128), bf)
  assert mosaic.unsupported_reason(q, dense, None, None) is None
  assert "SMEM" in mosaic.unsupported_reason(jnp.zeros((64, 8, 128), bf),
                                             jnp.zeros((2, 128, 8, 128), bf), None, None)
  assert "multiple of 64" in mosaic.unsupported_reason(q, dense[:, :96], None, None)
  assert "zero token capacity" in mosaic.unsupported_reason(q[:0], dense, None, None)
  assert "float32" in mosaic.unsupported_reason(q.astype(F32), dense, None, None)
  offs = jnp.array([0, 10, 64], jnp.int32)
  with pytest.raises(ValueError, match="pre_layer_norm"):
    pn.flash_norm_attention(q, dense, dense, offs, ln_scale=jnp.ones(512),
                            pre_layer_norm=False)
  with pytest.raises(TypeError, match="inner_residual"):
    pn.flash_norm_attention(q, dense, dense, offs, inner_residual="no")


def test_default_takes_the_fused_kernel_where_measured(monkeypatch):
  """implementation=None's rule (api.fused_slower_reason): the fused kernel on Hopper for bf16,
  D = 128, H·D = 256, 512 or 1024, Lkv <= 128 (measured faster than the chain); elsewhere a
  reason."""
  from pallas_norm import _dispatch
  from pallas_norm.ops.flash_norm_attention import api
  bf = jnp.bfloat16
  q, dense = jnp.zeros((64, 4, 128), bf), jnp.zeros((2, 128, 4, 128), bf)
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: False)
  assert "Hopper" in api.fused_slower_reason(q, dense, None, None)
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  assert api.fused_slower_reason(q, dense, None, None) is None
  assert api.fused_slower_reason(q[:, :2], dense[:, :, :2], None, None) is None  # H = 2
  assert "H·D" in api.fused_slower_reason(q[:, :1], dense[:, :, :1], None, None)
  h8, dense8 = jnp.zeros((64, 8, 128), bf), jnp.zeros((2, 128, 8, 128), bf)  # cluster kernel
  assert api.fused_slower_reason(h8, dense8, None, None) is None
  assert "Lkv" in api.fused_slower_reason(q, jnp.zeros((2, 256, 4, 128), bf), None, None)
  assert "bf16" in api.fused_slower_reason(q, dense, None, F32)
  # H·D = 512 at D = 64 (H = 8) fits the one-CTA kernel but was never measured
  d64, dense64 = jnp.zeros((64, 8, 64), bf), jnp.zeros((2, 128, 8, 64), bf)
  assert "D = 64" in api.fused_slower_reason(d64, dense64, None, None)


def test_float16_z_past_its_range_stays_finite():
  """In float16, z = u + attn can pass 65504 where u and attn do not. The one-CTA kernel holds
  z in q's dtype, so it declines float16 q, and the op takes a path that adds in float32 (here
  the chain): finite rows, equal to the float32 reference."""
  t, h, d = 8, 2, 64
  sign = jnp.where(jnp.arange(d) % 2 == 0, 1.0, -1.0)
  noise = np.random.default_rng(0).standard_normal((t, h, d)).astype(np.float32)
  q = (4e4 * sign + noise).astype(jnp.float16)  # |u| = |q| ≈ 4e4 (no LayerNorm)
  k = jnp.zeros((1, 64, h, d), jnp.float16).at[..., 0].set(1.0)  # scores = pre · q[..., 0]
  v = jnp.broadcast_to(sign, (1, 64, h, d)).astype(jnp.float16)
  kw = dict(pre_layer_norm=False, pre_scale=1e-4, post_scale=3e4 / 256)  # |attn| ≈ 3e4
  qo = jnp.array([0, t], jnp.int32)
  assert "float16" in mosaic.unsupported_reason(q, k, None, None)
  out = jax.jit(lambda q, k, v: pn.flash_norm_attention(
      q, k, v, qo, implementation="interpret", **kw))(q, k, v)
  want = _reference(q, k, v, qo, **kw)[0]
  assert bool(jnp.all(jnp.isfinite(want))) and bool(jnp.all(jnp.isfinite(out)))
  assert _rel_err(out, want) < TOL


@pytest.mark.parametrize("ctas,group", [(2, 2), (8, 1), (132, 2), (132, 4), (132, 3)])
def test_cta_schedule_deals_every_row_once(ctas, group):
  """The forward's block list, runs and padding blocks: every q block of every sample (lengths
  0, 1, one block, block edges, long; offsets not aligned) is taken by exactly one CTA, once;
  the blocks' rows partition the sample's rows, in blocks of at most BLOCK_Q rows from an
  ALIGN-aligned row; the runs differ by at most one block, and the CTAs of a group take their
  run's blocks in turn (CTA g of a group its g-th, g + group-th, ...); the padding blocks
  partition [offsets[-1], capacity)."""
  from pallas_norm.ops.gdpa import mosaic as gdpa
  rng = np.random.default_rng(7)
  lens = np.array([0, 1, 63, 64, 65, 128, 129, 0, 300, 511, 512, 7, 200, 0])
  lens = np.concatenate([lens, rng.integers(0, 513, size=18)])
  offsets = jagged.offsets_from_lengths(lens)
  for capacity in (int(offsets[-1]), -(-int(offsets[-1]) // 128) * 128 + 257):
    blocks, ends = (np.asarray(a) for a in jax.jit(mosaic.cta_schedule, static_argnums=1)(
        jnp.asarray(offsets), capacity))
    total = int(ends[-1])
    runs = np.array([[int(x) for x in mosaic.cta_run(np.int32(c), np.int32(total), ctas, group)]
                     for c in range(ctas)])
    taken = np.concatenate([first + group * np.arange(count) for first, count in runs])
    np.testing.assert_array_equal(np.sort(taken), np.arange(total))
    for run in range(ctas // group):
      members = runs[run * group:(run + 1) * group]
      np.testing.assert_array_equal(members[:, 0], members[0, 0] + np.arange(group))
      assert members[0, 1] >= members[-1, 1] >= members[0, 1] - 1
    sizes = runs.reshape(-1, group, 2)[:, :, 1].sum(axis=1)
    assert sizes.max() - sizes.min() <= 1
    rows = {}
    for row, lo, count, sample in blocks[:total]:
      assert row % gdpa.ALIGN == 0 and 0 <= lo and lo + count <= mosaic.BLOCK_Q and count > 0
      got = set(range(row + lo, row + lo + count))
      assert not rows.setdefault(sample, set()) & got
      rows[sample] |= got
    for sample in range(len(lens)):
      assert rows.get(sample, set()) == set(range(offsets[sample], offsets[sample + 1]))
    end = np.int32(offsets[-1])
    padding = []
    for i in range(int(mosaic.padding_blocks(end, capacity))):
      row, lo, count = (int(x) for x in mosaic.padding_block(end, capacity, np.int32(i)))
      assert row % gdpa.ALIGN == 0 and 0 <= lo and lo + count <= mosaic.BLOCK_Q and count > 0
      padding.extend(range(row + lo, row + lo + count))
    assert padding == list(range(int(end), capacity))


def test_cta_schedule_stays_in_its_list_for_overlapping_samples():
  """Decreasing traced offsets (samples that overlap once clamped, which the op poisons) count
  more blocks than the list holds: the counts stop at its size, so the kernel reads no entry
  past it, and every entry's rows stay inside q (an adversarial review's case: 8 samples that
  alternate [0, 512) and empty, 32 blocks for a list of 24)."""
  capacity = 512
  offsets = jnp.array([0, 512] * 4 + [0], jnp.int32)
  blocks, ends = (np.asarray(a) for a in jax.jit(mosaic.cta_schedule, static_argnums=1)(
      offsets, capacity))
  assert int(ends[-1]) == blocks.shape[0] == capacity // mosaic.BLOCK_Q + 2 * 8
  for row, lo, count, sample in blocks:
    assert 0 <= row and row + lo + count <= capacity and 0 <= sample < 8


def test_default_config_two_q_buffers_where_they_fit():
  """Two q buffers (2-slot K/V ring) where they fit: with the residual copy at H·D = 256
  (D = 128, bf16 out) in both forms; without it, at H·D = 512 and for a float32 output at 256,
  in the inference form only (the training form keeps one buffer with the copy and the
  deepest ring that fits); none at H·D = 512 with a float32 output. CTA pairs by the K/V's
  size against L2."""
  bf = jnp.bfloat16
  fields = lambda c: (c.q_buffers, c.kv_stages, c.residual_copy)  # noqa: E731
  for save in (False, True):
    assert fields(mosaic.pick_config(2, 128, bf, bf, 128, save)) == (2, 2, True)
    assert mosaic.pick_config(4, 128, bf, F32, 128, save) is None
  assert fields(mosaic.pick_config(4, 128, bf, bf, 128)) == (2, 2, False)
  assert fields(mosaic.pick_config(2, 128, bf, F32, 128)) == (2, 2, False)
  assert fields(mosaic.pick_config(4, 128, bf, bf, 128, True)) == (1, 2, True)
  assert fields(mosaic.pick_config(4, 128, bf, bf, 512, True)) == (1, 2, True)
  assert fields(mosaic.pick_config(2, 128, bf, F32, 128, True)) == (1, 3, True)
  # CTA pairs where one sample's K/V per SM (132 SMs) pass half of L2: 35 MB at H·D = 512
  for save in (False, True):
    assert mosaic.pick_config(4, 128, bf, bf, 128, save).cta_group == 2
    assert mosaic.pick_config(2, 128, bf, bf, 128, save).cta_group == 1
    assert mosaic.pick_config(2, 128, bf, bf, 512, save).cta_group == 2


@pytest.mark.parametrize("save_residuals,out_dtype,heads,q_buffers", [
    (False, jnp.float32, 2, 1), (True, None, 2, 2), (True, None, 4, 2)])
def test_forward_lowers_for_sm90a(save_residuals, out_dtype, heads, q_buffers):
  """Mosaic's sm_90a lowering accepts the forward kernel (layouts, SMEM, TMA boxes) at real
  sizes without the residuals and the statistics and with a float32 output (one q buffer),
  which no ``gpu`` test runs, and with two q buffers in the training form at H = 2 (the
  residual copy: 223 KB of SMEM with a 2-slot K/V ring) and at H = 4 (without it: q_h reloaded
  into its working tile)."""
  head_dim = 128
  spec = jax.ShapeDtypeStruct
  t, b = 4096, 16
  cfg = mosaic.pick_config(heads, head_dim, jnp.bfloat16, out_dtype or jnp.bfloat16, 128)
  cfg = dataclasses.replace(cfg, kv_stages=2, q_buffers=q_buffers,
                            residual_copy=cfg.residual_copy and q_buffers > 1)
  assert mosaic.smem_bytes(heads, head_dim, jnp.bfloat16, out_dtype or jnp.bfloat16,
                           cfg) <= mgpu.SMEM_BYTES
  fn = jax.jit(lambda q, k, v, qo, a: mosaic.flash_norm_attention_fwd(
      q, k, v, qo, a, 1.0, 1.0, activation="fast_gelu", eps=1e-6,
      save_residuals=save_residuals, return_stats=save_residuals, out_dtype=out_dtype,
      config=cfg))
  kv = spec((b, 128, heads, head_dim), jnp.bfloat16)
  export.export(fn, platforms=["cuda"])(spec((t, heads, head_dim), jnp.bfloat16), kv, kv,
                                        spec((b + 1,), jnp.int32),
                                        spec((3, heads, head_dim), F32))


# ------------------------------------------------------------------------------------------------
# GPU, the issue's sizes (B=768, Lmax=512 density 0.5, D=128, dense K/V Lkv=128).

def _pffn(seed, heads, density=0.5, samples=768):
  rng = np.random.default_rng(seed)
  lens = np.full(samples, 512) if density >= 1 else rng.integers(1, 513, size=samples)
  return _problem(seed, lens, heads, 128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,density", [(4, 0.5), (2, 0.5), (4, 1.0)])
def test_gpu_forward_at_issue_shape(heads, density):
  q, k, v, qo, affine = _pffn(5, heads, density)
  out, (ln, rms) = jax.jit(lambda *a: pn.flash_norm_attention(
      *a, **affine, max_seq_len=512, return_stats=True, implementation="mosaic"))(q, k, v, qo)
  ref, (ln_ref, rms_ref) = jax.jit(lambda *a: _reference(*a, **affine, max_seq_len=512))(
      q, k, v, qo)
  total = int(qo[-1])
  assert bool(jnp.all(jnp.isfinite(out))) and not bool(jnp.any(out[total:] != 0))
  assert _rel_err(out[:total], ref[:total]) < TOL
  assert _rel_err(rms.rstd[:total], rms_ref.rstd[:total]) < TOL
  assert _rel_err(ln.rstd[:total], ln_ref.rstd[:total]) < TOL


@pytest.mark.gpu
def test_gpu_two_q_buffers_match_default():
  """The default tiling at H = 2, the issue's shape (two q buffers, a 2-slot K/V ring), in the
  training form: out, the statistics, z and u bit for bit against one q buffer with a 4-slot
  ring."""
  heads = 2
  q, k, v, qo, affine = _pffn(8, heads)
  a = jnp.stack([affine["ln_scale"], affine["ln_bias"], affine["rms_scale"]]).reshape(
      3, heads, 128)
  default = mosaic.pick_config(heads, 128, q.dtype, q.dtype, 128)
  run = lambda cfg: jax.jit(lambda *x: mosaic.flash_norm_attention_fwd(  # noqa: E731
      *x, qo, a, 1.0, 1.0, activation="fast_gelu", eps=1e-6, save_residuals=True,
      config=cfg))(q, k, v)
  want = run(default)
  assert (default.q_buffers, default.kv_stages) == (2, 2)
  got = run(dataclasses.replace(default, kv_stages=4, q_buffers=1))
  _assert_forwards_equal(got, want, int(qo[-1]))
  total = int(qo[-1])
  ref = jax.jit(lambda *x: _reference(*x, **affine, max_seq_len=512))(q, k, v, qo)[0]
  assert _rel_err(want[0][:total], ref[:total]) < TOL


@pytest.mark.gpu
def test_gpu_training_form_at_issue_shape():
  """The training form at H = 4, the issue's shape (one q buffer: the next block's q loads
  overwrite a head's tiles as soon as the epilogue releases them, while z and u are saved and
  the statistics stream the landing tiles): out and the statistics bit for bit against the
  inference form (two q buffers without the residual copy: the epilogue's q_h reloads land in
  a tile whose z_h was just read, the same race class), z and u against their definitions row
  by row (a read of a tile after the next block's q landed in it shows as a bad row; the
  interpret mode's race detector does not see TMA writes), zeros on padding rows."""
  heads = 4
  q, k, v, qo, affine = _pffn(9, heads)
  a = jnp.stack([affine["ln_scale"], affine["ln_bias"], affine["rms_scale"]]).reshape(
      3, heads, 128)
  run = lambda save: jax.jit(lambda *x: mosaic.flash_norm_attention_fwd(  # noqa: E731
      *x, qo, a, 0.9, 1.1, activation="fast_gelu", eps=1e-6, save_residuals=save))(q, k, v)
  got = run(True)
  for g, w in zip(got[:2], run(False)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  _check_residuals(got, q, k, v, qo, dict(affine, pre_scale=0.9, post_scale=1.1), row_tol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [4, 2])
def test_gpu_gradients_at_issue_shape(heads):
  """The fused path's gradients against the f32 XLA reference's. At H = 8 on half the samples:
  the reference's padded gradients need ~19 GB there (XLA's memory analysis), more than a
  GPU test worker's share of the device."""
  q, k, v, qo, affine = _pffn(6, heads, samples=384 if heads == 8 else 768)
  q = _clean(q, qo)
  weights = jax.random.normal(jax.random.key(7), q.shape, F32)

  def loss(q, k, v, ln_scale, rms_scale, impl):
    out = pn.flash_norm_attention(q, k, v, qo, ln_scale=ln_scale, ln_bias=affine["ln_bias"],
                                  rms_scale=rms_scale, max_seq_len=512, implementation=impl)
    return jnp.sum(out.astype(F32) * weights)

  args = (q, k, v, affine["ln_scale"], affine["rms_scale"])
  got = jax.jit(jax.grad(lambda *a: loss(*a, "mosaic"), argnums=range(5)))(*args)
  want = jax.jit(jax.grad(lambda *a: loss(*a, "xla"), argnums=range(5)))(
      *(a.astype(F32) for a in args))
  for g, w in zip(got, want):
    assert bool(jnp.all(jnp.isfinite(g))) and _rel_err(g, w) < TOL


@pytest.mark.gpu
def test_gpu_norm_backward_kernels():
  """norm_bwd's row kernels compiled (Triton) at the issue's row count, H·D = 384 (masked
  columns) and 512, bf16, against the same formulas in float32 XLA."""
  rng = np.random.default_rng(12)
  t, end = 202368, 200001
  for n in (384, 512):
    ks = jax.random.split(jax.random.key(n), 6)
    g, q, z, du = (jax.random.normal(kk, (t, n), F32).astype(jnp.bfloat16) for kk in ks[:4])
    stats = jnp.stack([jax.random.normal(ks[4], (t,)), 1 + jax.random.uniform(ks[5], (t,)),
                       0.5 + jax.random.uniform(ks[5], (t,))], axis=1)
    affine = tuple(jnp.asarray(rng.normal(1.0, 0.2, n), F32) for _ in range(3))
    got = jax.jit(norm_bwd.rms_backward)(g, z, stats, affine[2], end)
    live = (jnp.arange(t) < end)[:, None]
    gf, qf, zf = (jnp.where(live, x.astype(F32), 0) for x in (g, q, z))
    z_hat = zf * stats[:, 2:3]
    gz = gf * affine[2]
    dz = stats[:, 2:3] * (gz - z_hat * jnp.mean(gz * z_hat, axis=1, keepdims=True))
    for a, b in ((got[0][:end], dz[:end]), (got[1], jnp.sum(gf * z_hat, axis=0))):
      assert _rel_err(a, b) < 1e-2
    dq, dg1, db1 = jax.jit(lambda *a: norm_bwd.ln_backward(*a, outer_residual=True))(
        du, g, q, stats, affine[0], end)
    duf = jnp.where(live, du.astype(F32), 0)
    x_hat = (qf - stats[:, :1]) * stats[:, 1:2]
    gu = duf * affine[0]
    want = jnp.where(live, stats[:, 1:2] * (gu - jnp.mean(gu, axis=1, keepdims=True) - x_hat
                                            * jnp.mean(gu * x_hat, axis=1, keepdims=True)) + gf, 0)
    assert _rel_err(dq[:end], want[:end]) < 1e-2
    assert bool(jnp.all(dq[end:] == du[end:])), "dq's padding rows are du's (written over it)"
    assert _rel_err(dg1, jnp.sum(duf * x_hat, axis=0)) < 1e-2
    assert _rel_err(db1, jnp.sum(duf, axis=0)) < 1e-2


def _check_bad_offsets_give_nan(grads, out, names):
  """Traced offsets that break the jagged convention: the fused path answers with NaN in every
  output row and every gradient (NaN scales, no pass over the data), as the GDPA kernel does;
  test_fused_gradients_match_reference[64] checks it with the one-CTA forward,
  test_fused_gradients_ignore_nan_padding_rows[switches3-cluster] with the cluster one (H = 1),
  each in its own compiled program (a test of its own compiled both again at other sizes).
  Every condition that raises the flag (past capacity, a sample longer than max_seq_len) is
  tested on its own in test_traced_offsets.py and test_jagged.py; one trips the poison here:
  the last offset past the capacity. Every row of dq (all rows are padding under the poison),
  dk, dv, the norm weights' and the traced scales' (0 before the poison became a product)."""
  assert bool(jnp.all(jnp.isnan(out)))
  for name, g in zip(names, grads, strict=True):
    assert bool(jnp.all(jnp.isnan(g))), name


# ------------------------------------------------------------------------------------------------
# The forward as a cluster of H CTAs, one per head (pallas_norm.ops.flash_norm_attention.cluster,
# which the op runs where the one-CTA kernel does not fit; tests route other calls to it by
# monkeypatching the op's router). Interpret mode
# cannot read a peer CTA's shared memory, so the CPU runs it at H = 1 (all its math but the
# cluster exchange); the exchange at H = 2, 4, 8: lowering here, results in the gpu tests.


@pytest.mark.parametrize("variant,switches", [
    (dict(kv_stages=2), dict()), (None, dict(pre_layer_norm=False, inner_residual=False))])
def test_cluster_kv_form_matches_default(variant, switches):
  """The cluster kernel with K/V streamed per q block through 2-slot rings (the GDPA kernel's
  form for long K/V) against its default resident K/V, bit for bit, over three key blocks,
  with the backward's residuals z and u (against their definitions); also, default form only,
  with the LayerNorm and the inner residual off (the WGMMA then reads q_h as TMA wrote it, and
  the consumer reads it for the outer residual), with one key block per head and samples that
  make a consumer reuse a q slot (the producer's TMA must not overwrite the tile before that
  read: the race detector flagged it before the fence)."""
  if variant is not None:
    _check_variant_matches_default(cluster, 1, [variant], **switches)
  else:
    _check_variant_matches_default(cluster, 1, [], (79, 79, 80, 31, 14, 74), 64, **switches)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_cluster_merges_match_whole_rows(heads):
  """The cluster kernel's merges of the per-head row partials (what each CTA computes after the
  exchange, which interpret mode cannot run) against the whole rows' statistics in float64:
  rows of H·D features with |mean| / std up to 1e3 (past what bf16 q resolves: 8 bits), so
  the LayerNorm's merge must not cancel; heads in CTA order. Tolerance: the f32 rounding of the
  head means (ulp(100) ≈ 8e-6 against head-mean spreads ≈ 1e-2) in the between-head term."""
  rng = np.random.default_rng(heads)
  d, eps = 64, 1e-6
  rows = (rng.standard_normal((16, heads * d)) * np.logspace(-1, 1, 16)[:, None]
          + np.linspace(-100, 100, 16)[:, None]).astype(np.float32)
  per_head = rows.reshape(16, heads, d).astype(np.float64)
  means = per_head.mean(axis=2)
  m2s = np.square(per_head - means[..., None]).sum(axis=2)
  per_cta = [(jnp.asarray(means[:, h], F32), jnp.asarray(m2s[:, h], F32)) for h in range(heads)]
  mean, rstd = cluster.merge_layer_norm(per_cta, d, eps)
  whole = rows.astype(np.float64)
  np.testing.assert_allclose(mean, whole.mean(axis=1), rtol=1e-6)
  np.testing.assert_allclose(rstd, 1 / np.sqrt(whole.var(axis=1) + eps), rtol=5e-4)
  squares = np.square(per_head).sum(axis=2)
  (rms_rstd,) = cluster.merge_rms([(jnp.asarray(squares[:, h], F32),) for h in range(heads)],
                                  d, eps)
  np.testing.assert_allclose(rms_rstd, 1 / np.sqrt(np.square(whole).mean(axis=1) + eps),
                             rtol=1e-5)


def _route_to_cluster(monkeypatch):
  """The op's fused path runs the cluster kernel (where it can) instead of the one-CTA one."""
  monkeypatch.setattr(fna_api, "_forward_kernel", lambda q, k, kv_offsets, out_dtype, interpret: (
      "cluster", cluster.unsupported_reason(q, k, kv_offsets, out_dtype, interpret=interpret)))


def test_cluster_dispatch_reasons(monkeypatch):
  """What the cluster kernel takes: H in 1, 2, 4, 8 (H = 8 fits: one head per CTA); only H = 1
  in interpret mode, where the op then runs the chain."""
  bf = jnp.bfloat16
  q, dense = jnp.zeros((64, 4, 128), bf), jnp.zeros((2, 128, 4, 128), bf)
  assert cluster.unsupported_reason(q, dense, None, None) is None
  assert cluster.unsupported_reason(jnp.zeros((64, 8, 128), bf),
                                    jnp.zeros((2, 128, 8, 128), bf), None, None) is None
  assert "H = 3" in cluster.unsupported_reason(jnp.zeros((64, 3, 128), bf),
                                               jnp.zeros((2, 128, 3, 128), bf), None, None)
  assert "interpret" in cluster.unsupported_reason(q, dense, None, None, interpret=True)
  assert cluster.unsupported_reason(q[:, :1], dense[:, :, :1], None, None, interpret=True) is None
  assert "jagged" in cluster.unsupported_reason(q, dense[0], jnp.zeros(3, jnp.int32), None)
  route = fna_api._forward_kernel  # noqa: SLF001
  h8, dense8 = jnp.zeros((64, 8, 128), bf), jnp.zeros((2, 128, 8, 128), bf)
  assert route(q, dense, None, None, False) == ("mosaic", None)  # where the one-CTA kernel fits
  assert route(h8, dense8, None, None, False) == ("cluster", None)
  assert "interpret" in route(h8, dense8, None, None, True)[1]
  # implementation=None at H = 8 on Hopper: the cluster kernel (measured faster than the chain)
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  assert fna_api.fused_slower_reason(h8, dense8, None, None) is None


@pytest.mark.parametrize("heads,save_residuals,out_dtype,switches", [
    (2, False, jnp.float32, {}), (4, True, None, {}),
    (8, True, None, dict(pre_layer_norm=False, inner_residual=False))])
def test_cluster_lowers_for_sm90a(heads, save_residuals, out_dtype, switches):
  """Mosaic's sm_90a lowering accepts the cluster kernel (clusters of H CTAs, the exchange's
  DSMEM reads and cluster barriers, SMEM within the limit, TMA boxes) at real sizes: a float32
  output, the training form, and H = 8 with one exchange per block."""
  head_dim, t, b = 128, 4096, 16
  spec = jax.ShapeDtypeStruct
  fn = jax.jit(lambda q, k, v, qo, a: cluster.flash_norm_attention_fwd(
      q, k, v, qo, a, 1.0, 1.0, activation="fast_gelu", eps=1e-6,
      save_residuals=save_residuals, out_dtype=out_dtype, **switches))
  kv = spec((b, 128, heads, head_dim), jnp.bfloat16)
  export.export(fn, platforms=["cuda"])(spec((t, heads, head_dim), jnp.bfloat16), kv, kv,
                                        spec((b + 1,), jnp.int32),
                                        spec((3, heads, head_dim), F32))


@pytest.mark.parametrize("heads,traced_scales", [(4, False), (4, True), (8, True)])
def test_op_gradients_lower_for_sm90a(heads, traced_scales, monkeypatch):
  """The public op's forward and backward (the fused forward, both row kernels and the GDPA
  backward with ``add_do_to_dq``) pass Mosaic's sm_90a lowering, so their SMEM fits: with
  Python-float scales (the GDPA backward adds dO by a WGMMA) and traced ones (scale gradients:
  that identity tile did not fit beside their partials, 104 bytes over, before d0b6384), at the
  one-CTA (H = 4) and cluster (H = 8) forwards. The row kernels lower through Pallas' Triton
  backend, which needs a GPU's compute capability: an abstract H200 gives it."""
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  head_dim, t, b, n = 128, 4096, 16, heads * 128
  spec = jax.ShapeDtypeStruct

  def loss(q, k, v, qo, gamma1, beta1, gamma2, pre, post):
    scales = (pre, post) if traced_scales else (0.125, 1.5)
    out = pn.flash_norm_attention(q, k, v, qo, None, ln_scale=gamma1, ln_bias=beta1,
                                  rms_scale=gamma2, pre_scale=scales[0], post_scale=scales[1],
                                  max_seq_len=512, implementation="mosaic")
    return out.astype(F32).sum()

  args = [spec((t, heads, head_dim), jnp.bfloat16), spec((b, 128, heads, head_dim), jnp.bfloat16),
          spec((b, 128, heads, head_dim), jnp.bfloat16), spec((b + 1,), jnp.int32),
          *(spec((n,), F32),) * 3, spec((), F32), spec((), F32)]
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4, 5, 6, 7, 8)))
  h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  with jax.sharding.use_abstract_mesh(h200):
    exported = export.export(grads, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("heads,density", [(4, 0.5), (2, 0.5), (8, 0.5)])
def test_gpu_cluster_forward_at_issue_shape(heads, density, monkeypatch):
  """The op's forward and statistics with the cluster forward (its exchange at H = 2, 4, 8)."""
  _route_to_cluster(monkeypatch)
  test_gpu_forward_at_issue_shape(heads, density)


_ALL_OFF = dict(pre_layer_norm=False, inner_residual=False, outer_residual=False)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,switches", [(2, {}), (4, _ALL_OFF), (8, {}), (8, _ALL_OFF)],
                         ids=["h2", "h4_off", "h8", "h8_off"])
def test_gpu_cluster_training_form_and_switches(heads, switches):
  """The cluster exchange in the training form (z, u and the statistics saved) with the
  LayerNorm (two exchanges per q block) or with every switch off (one), against the reference:
  96 samples of up to 300 rows (partial q blocks, 8-row windows), a row with a large mean, γ2
  with zeros."""
  _check_cluster_training_form(heads, 128, np.random.default_rng(9).integers(1, 300, size=96),
                               switches)


def _check_cluster_training_form(heads, head_dim, lens, switches, interpret=False):
  """The cluster kernel with the residuals saved against the reference: out (a large-mean
  row, row 3), the statistics, z and u; zeros on padding rows."""
  q, k, v, qo, affine = _problem(9, lens, heads, head_dim, 128, large_mean_row=3)
  if switches:
    affine = dict(rms_scale=affine["rms_scale"])
  ones = jnp.ones(heads * head_dim, F32)
  a = jnp.stack([affine.get("ln_scale", ones), affine.get("ln_bias", 0 * ones),
                 affine["rms_scale"]]).reshape(3, heads, head_dim)
  outputs = jax.jit(lambda q, k, v, qo, a: cluster.flash_norm_attention_fwd(
      q, k, v, qo, a, 0.9, 1.1, activation="fast_gelu", eps=1e-6, save_residuals=True,
      interpret=interpret, **switches))(q, k, v, qo, a)
  kw = dict(affine, pre_scale=0.9, post_scale=1.1, **switches)
  ref, (ln_ref, rms_ref) = _reference(q, k, v, qo, **kw)
  total = int(qo[-1])
  out, stats = outputs[:2]
  assert bool(jnp.all(jnp.isfinite(out))) and not bool(jnp.any(out[total:] != 0))
  assert not bool(jnp.any(stats[total:] != 0))
  assert _rel_err(out[:total], ref[:total]) < TOL and _rel_err(out[3], ref[3]) < TOL
  wanted = {2: rms_ref.rstd} if switches else {0: ln_ref.mean, 1: ln_ref.rstd, 2: rms_ref.rstd}
  for column, want in wanted.items():
    assert _rel_err(stats[:total, column], want[:total]) < TOL
  _check_residuals(outputs, q, k, v, qo, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [4, 2, 8])
def test_gpu_cluster_gradients_at_issue_shape(heads, monkeypatch):
  """The op's gradients with the cluster forward (its saved z, u and statistics feed the
  unchanged backward) against the f32 XLA reference's."""
  _route_to_cluster(monkeypatch)
  test_gpu_gradients_at_issue_shape(heads)




# ------------------------------------------------------------------------------------------------
# Found by a mutation test of the kernel bodies: each failed to notice its mutant before.

@pytest.mark.parametrize("inner,outer", [(True, True), (False, False)])
def test_fused_forward_at_a_large_eps(inner, outer):
  """Both norms' eps at 1.0 (the rows' variance's size; at 1e-6 eps moves r1, r2 by ~1e-6):
  out, r1 and r2 against the f32 reference."""
  heads, d = 2, 64
  q, k, v, qo, affine = _problem(0, [70, 9], heads, d)
  a = jnp.stack([affine["ln_scale"], affine["ln_bias"], affine["rms_scale"]]).reshape(3, heads, d)
  out, stats = mosaic.flash_norm_attention_fwd(
      q, k, v, qo, a, 0.9, 1.1, activation="fast_gelu", eps=1.0, inner_residual=inner,
      outer_residual=outer, return_stats=True, interpret=True)
  ref, (ln, rms) = _reference(q, k, v, qo, **affine, pre_scale=0.9, post_scale=1.1,
                              activation="fast_gelu", eps=1.0, inner_residual=inner,
                              outer_residual=outer)
  total = int(qo[-1])
  assert _rel_err(out[:total], ref[:total]) < TOL
  np.testing.assert_allclose(stats[:total, 1], ln.rstd[:total], rtol=1e-3)
  np.testing.assert_allclose(stats[:total, 2], rms.rstd[:total], rtol=1e-2)  # z is bf16


def _value_and_vjp(f, primals, cotangent):
  out, vjp = jax.vjp(f, *primals)
  return out, vjp(cotangent)


def _check_constant_rows(implementation):
  """Tokens whose q row is exactly constant (c = 7, 1000, −333 over all H·D features) among
  random ones, at eps 3e-7 and 1e-17 (a review found both): there x − μ1 = 0, so u = β1 = 0, z =
  0, RMSNorm(z) = 0 and out = q, as the reference gives; the other rows and the gradients of
  q, k, v against the reference too. A u made as x·r1 + (−μ1·r1) by one FMA kept the rounding
  of μ1·r1 (~|μ1|·r1·2⁻²⁴: O(1) at eps 3e-7) on those rows, and RMSNorm turned that noise into
  outputs off by up to 4 and dk, dv off by 31–43% (benchmarks/results/logs/
  2026-12-06_s50_fna_constant_rows_cpu.md); only where a·b + c is contracted (the GPU, XLA:CPU
  above optimization level 0)."""
  rng = np.random.default_rng(0)
  t, heads, d, lkv = 32, 2, 128, 64
  q_offsets = jnp.asarray(np.array([0, 5, 18], np.int32))
  q = rng.standard_normal((t, heads, d)).astype(np.float32)
  const = {0: 7.0, 7: 1000.0, 15: -333.0}
  for row, c in const.items():
    q[row] = c
  k = rng.standard_normal((2, lkv, heads, d)).astype(np.float32) / np.sqrt(d)
  v = rng.standard_normal((2, lkv, heads, d)).astype(np.float32)
  ct = rng.standard_normal((t, heads, d)).astype(np.float32)
  q, k, v, ct = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v, ct))
  f32 = lambda *a: tuple(x.astype(F32) for x in a)  # noqa: E731
  for eps in (3e-7, 1e-17):
    op = lambda q, k, v, eps=eps: pn.flash_norm_attention(  # noqa: E731
        q, k, v, q_offsets, eps=eps, implementation=implementation)
    ref = lambda q, k, v, eps=eps: reference.flash_norm_attention(  # noqa: E731
        q, k, v, q_offsets, eps=eps)
    # One program per eps, the op's and the reference's outputs and gradients: eagerly each op
    # compiled on its own (~200 compiles, most of the subprocess's time at level 2).
    (out, grads), (want, grads_ref) = jax.jit(lambda q, k, v, ct, op=op, ref=ref: (
        _value_and_vjp(op, (q, k, v), ct),
        _value_and_vjp(ref, f32(q, k, v), ct.astype(F32))))(q, k, v, ct)
    rows = np.array(list(const))
    np.testing.assert_array_equal(np.asarray(out[rows], F32), np.asarray(q[rows], F32),
                                  err_msg=f"constant rows, eps {eps}")
    np.testing.assert_array_equal(np.asarray(want[rows]), np.asarray(q[rows], F32))
    total = int(q_offsets[-1])
    assert _rel_err(out[:total], want[:total]) < TOL, eps
    for name, g, r in zip("qkv", grads, grads_ref):
      live = slice(0, total) if name == "q" else slice(None)
      g, r = np.asarray(g[live], np.float64), np.asarray(r[live], np.float64)
      if name == "q":  # the constant rows' dq is r1·(...) with r1 up to 3e8: judged apart
        keep = np.ones(total, bool)
        keep[rows] = False
        np.testing.assert_allclose(g[rows], r[rows], rtol=2e-2,
                                   atol=2e-2 * np.abs(r[rows]).max(), err_msg=f"dq {eps}")
        g, r = g[keep], r[keep]
      assert _rel_err(g, r) < TOL, (name, eps, _rel_err(g, r))


def test_constant_rows_match_reference_with_fma_contraction():
  """:func:`_check_constant_rows` in interpret mode where XLA:CPU contracts a·b + c into FMAs
  as ptxas does: in a pytest subprocess at optimization level 2 when this process runs at the
  suite's level 0 (tests/conftest.py), which does not contract and so cannot see the error."""
  flags = os.environ.get("XLA_FLAGS", "")
  if FAST_COMPILE_FLAG not in flags:
    _check_constant_rows("interpret")
    return
  env = dict(os.environ, XLA_FLAGS=flags.replace(FAST_COMPILE_FLAG,
                                                 "--xla_backend_optimization_level=2"))
  root = pathlib.Path(__file__).resolve().parents[1]
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
       f"{__file__}::test_constant_rows_match_reference_with_fma_contraction"],
      capture_output=True, text=True, timeout=900, env=env, cwd=root)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  assert "1 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.gpu
def test_gpu_constant_rows_match_reference():
  """:func:`_check_constant_rows` on the GPU (the fused one-CTA kernel at H·D = 256, bf16)."""
  _check_constant_rows("mosaic")


@pytest.mark.parametrize("module", ["mosaic", "cluster"])
def test_saved_z_rounds_attn_before_the_inner_residual(module):
  """z = bf16(q + bf16(attn)) (the unfused chain's rounding, the kernels' docstrings), not
  bf16(q + attn): with the LayerNorm and the outer residual off (u = q), attn emulated in
  float32 as the kernels compute it; where the two roundings differ, z follows the first."""
  fwd = (mosaic if module == "mosaic" else cluster).flash_norm_attention_fwd
  heads, d, total = (2 if module == "mosaic" else 1), 64, 64
  q, k, v, qo, _ = _problem(7, [total], heads, d)
  pre, post = 0.9, 1.1
  _, _, z, u = fwd(q, k, v, qo, jnp.ones((3, heads, d), F32), pre, post, activation="silu",
                   eps=1e-6, pre_layer_norm=False, outer_residual=False, save_residuals=True,
                   interpret=True)
  assert u is None
  qf = np.asarray(q[:total], np.float32)
  s = np.einsum("thd,lhd->htl", qf.astype(np.float64),
                np.asarray(k[0], np.float64)).astype(np.float32)
  act = gdpa_mosaic.KERNEL_ACTIVATIONS["silu"]
  p = np.asarray(act(jnp.asarray(s * np.float32(pre))).astype(jnp.bfloat16), np.float64)
  attn = np.einsum("htl,lhd->thd", p, np.asarray(v[0], np.float64)).astype(np.float32)
  attn = attn * np.float32(post)
  to_bf = lambda a: np.asarray(jnp.asarray(a, F32).astype(jnp.bfloat16), np.float32)  # noqa: E731
  rounded_first, summed_first = to_bf(qf + to_bf(attn)), to_bf(qf + attn)
  differ = rounded_first != summed_first
  got = np.asarray(z[:total], np.float32)
  assert differ.sum() > 50
  # 1.0 in interpret mode; attn rounded to bf16 before ·post as well gave 0.71 (a mutation test)
  assert np.mean(got[differ] == rounded_first[differ]) > 0.95


def test_cluster_padding_chunks_of_several_blocks():
  """The cluster kernel (H = 1) with 200 padding rows: a padding chunk of several q blocks, so
  both consumers store zero blocks (other tests have at most one padding block); out's and the
  statistics' padding rows exactly 0, nothing left unwritten (interpret mode fills NaN)."""
  lens = [70, 9]
  total = sum(lens)
  q, k, v, qo, _ = _problem(5, lens, 1, 64, capacity=80 + 200)
  a = jnp.ones((3, 1, 64), F32).at[1].set(0.0)
  out, stats = cluster.flash_norm_attention_fwd(q, k, v, qo, a, 0.9, 1.1, activation="silu",
                                                eps=1e-6, return_stats=True, interpret=True)
  out, stats = np.asarray(out, np.float32), np.asarray(stats, np.float32)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(stats))
  assert not np.any(out[total:]) and not np.any(stats[total:])
  assert not mgpu.races_found()


@pytest.mark.parametrize("kv_layout", ["dense", "jagged"])
def test_second_derivative_names_flash_norm_attention(kv_layout):
  """A second derivative of a kernel path raises NotImplementedError naming the op the user
  called: the fused kernel (dense K/V) and the chain (jagged K/V: its GDPA kernel named "gdpa"
  before, a review's finding). Traced only (jax.make_jaxpr): no kernel runs."""
  q = jnp.ones((32, 2, 128), jnp.bfloat16)
  q_offsets = jnp.array([0, 20, 32], jnp.int32)
  if kv_layout == "dense":
    k = v = jnp.ones((2, 64, 2, 128), jnp.bfloat16)
    kv_offsets = None
  else:
    k = v = jnp.ones((128, 2, 128), jnp.bfloat16)
    kv_offsets = jnp.array([0, 64, 128], jnp.int32)
  f = lambda p: jnp.sum(pn.flash_norm_attention(  # noqa: E731
      q, k, v, q_offsets, kv_offsets, pre_scale=p, implementation="interpret")
                        .astype(jnp.float32) ** 3)
  with pytest.raises(NotImplementedError, match="^flash_norm_attention:.*implementation='xla'"):
    jax.make_jaxpr(jax.hessian(f))(jnp.float32(0.5))
  jax.make_jaxpr(jax.grad(f))(jnp.float32(0.5))  # first order still traces
