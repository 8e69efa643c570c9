"""Offsets that only exist as traced values (under jit/vmap) cannot raise: the jagged ops return
NaN for offsets that break the convention, never a silently wrong answer."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn

T, H, D, B, LKV, MAX_LEN = 12, 2, 8, 3, 5, 6


@pytest.fixture(scope="module")
def qkv():
  ks = jax.random.split(jax.random.key(42), 3)
  return (jax.random.normal(ks[0], (T, H, D)), jax.random.normal(ks[1], (B, LKV, H, D)),
          jax.random.normal(ks[2], (B, LKV, H, D)))


OPS = {
    "gdpa": lambda q, k, v, o: pn.gdpa(q, k, v, o, max_seq_len=MAX_LEN),
    "flash_norm_attention": lambda q, k, v, o: pn.flash_norm_attention(q, k, v, o,
                                                                       max_seq_len=MAX_LEN),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("offsets", [
    [0, 2, 2, 13],   # last > T
    [0, 5, 3, 8],    # decreasing
    [1, 2, 3, 4],    # first != 0
    [0, 1, 1, 8],    # a sample of 7 rows > max_seq_len = 6
])
def test_invalid_traced_offsets_give_nan(qkv, op, offsets):
  out = jax.jit(OPS[op])(*qkv, jnp.asarray(offsets, jnp.int32))
  assert bool(jnp.all(jnp.isnan(out)))
  with pytest.raises(ValueError, match="q_offsets"):  # the same offsets, concrete, raise
    OPS[op](*qkv, jnp.asarray(offsets, jnp.int32))


# Offsets far apart whose int32 differences wrap around: every step looks non-negative and short
# (2**30, or 2**31 - 1 then 2), and the last offset is below T. Without max_seq_len no length
# check catches them; the second is what offsets_from_lengths makes of lengths summing past
# 2**31 - 1.
# The third: every step non-negative after the wrap and no offset past T, so only the negative
# last offset tells (a mutation test removed that check unnoticed).
WRAPPING_OFFSETS = [[0, 2**31 - 1, -2**31 + 1, -2**31 + 3], [0, 2**30, -2**31, -2**30],
                    [0, 4, 6, -2**31 + 2]]
OPS_UNBOUNDED = {
    "gdpa": lambda q, k, v, o: pn.gdpa(q, k, v, o),
    "flash_norm_attention": lambda q, k, v, o: pn.flash_norm_attention(q, k, v, o),
}


@pytest.mark.parametrize("op", sorted(OPS_UNBOUNDED))
@pytest.mark.parametrize("offsets", WRAPPING_OFFSETS,
                         ids=["wrap_once", "lengths_overflow", "negative_last"])
def test_offsets_whose_int32_steps_wrap_are_invalid(qkv, op, offsets):
  """Traced: NaN output and NaN gradients (the steps alone passed the check, and the ops
  returned finite zeros); concrete: a ValueError naming q_offsets (the host check took int32
  differences too)."""
  fn = OPS_UNBOUNDED[op]
  off = jnp.asarray(offsets, jnp.int32)
  out = jax.jit(fn)(*qkv, off)
  assert bool(jnp.all(jnp.isnan(out)))
  grad = jax.jit(jax.grad(lambda q, o: jnp.sum(fn(q, *qkv[1:], o))))(qkv[0], off)
  assert bool(jnp.all(jnp.isnan(grad)))
  with pytest.raises(ValueError, match="q_offsets"):
    fn(*qkv, off)


def test_offsets_from_lengths_past_int32_poison_the_ops(qkv):
  """Lengths whose total passes 2**31 - 1 (traced): offsets_from_lengths's int32 cumsum wraps
  and the op returns NaN, as its docstring says; concrete offsets of that kind make
  jagged.lengths raise."""
  lens = jnp.full((B,), 2**30, jnp.int32)
  out = jax.jit(lambda q, k, v, n: pn.gdpa(q, k, v, pn.jagged.offsets_from_lengths(n)))(
      *qkv, lens)
  assert bool(jnp.all(jnp.isnan(out)))
  with pytest.raises(ValueError, match="never decrease"):
    pn.jagged.lengths(jnp.asarray(WRAPPING_OFFSETS[0], jnp.int32))


@pytest.mark.parametrize("op", sorted(OPS))
def test_valid_traced_offsets_match_eager(qkv, op):
  offsets = jnp.asarray([0, 4, 4, 10], jnp.int32)
  chex.assert_trees_all_close(jax.jit(OPS[op])(*qkv, offsets), OPS[op](*qkv, offsets),
                              rtol=1e-5, atol=1e-5)


def test_vmapped_offsets_poison_only_the_bad_batch(qkv):
  offsets = jnp.asarray([[0, 4, 4, 10], [0, 1, 1, 8]], jnp.int32)
  out = jax.vmap(lambda o: OPS["gdpa"](*qkv, o))(offsets)
  assert bool(jnp.all(jnp.isfinite(out[0]))) and bool(jnp.all(jnp.isnan(out[1])))


def test_mosaic_off_gpu_raises_naming_the_op():
  if pn._dispatch.on_hopper_gpu():
    pytest.skip("on a Hopper GPU 'mosaic' runs")
  x = jnp.ones((8, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="norm_matmul.*Hopper"):
    pn.norm_matmul(x, jnp.ones((64, 64), jnp.bfloat16), implementation="mosaic")
  with pytest.raises(NotImplementedError, match="matmul_norm.*Hopper"):
    pn.matmul_norm(x, jnp.ones((64, 64), jnp.bfloat16), implementation="mosaic")


def test_eps_accepts_concrete_numpy_and_jax_scalars():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)), jnp.float32)
  want = pn.rms_norm(x, eps=1e-5)
  for eps in (np.float32(1e-5), jnp.float32(1e-5), np.float64(1e-5)):
    chex.assert_trees_all_close(pn.rms_norm(x, eps=eps), want, rtol=1e-6)
  with pytest.raises(TypeError, match="eps"):
    pn.rms_norm(x, eps=jnp.ones(2))


@pytest.mark.parametrize("op", sorted(OPS))
def test_invalid_traced_offsets_give_nan_gradients(qkv, op):
  """A jitted train step on bad offsets must not get finite (zero) gradients: every gradient
  holds NaN (padding rows of q may keep a zero gradient), so an optimizer cannot go on
  silently; a plain `where` poison gave gradients that were exactly 0."""
  loss = lambda q, k, v, o: jnp.sum(OPS[op](q, k, v, o) ** 2)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv, jnp.asarray([0, 5, 3, 8], jnp.int32))
  for g in grads:
    assert bool(jnp.any(jnp.isnan(g)))
  assert bool(jnp.all(jnp.isnan(grads[0][:8])))  # every real row of q
  good = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv, jnp.asarray([0, 4, 4, 10], jnp.int32))
  for g in good:
    assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("op", sorted(OPS))
def test_checkify_reports_invalid_traced_offsets(qkv, op):
  from jax.experimental import checkify
  checked = checkify.checkify(jax.jit(OPS[op]))
  err, _ = checked(*qkv, jnp.asarray([0, 5, 3, 8], jnp.int32))
  with pytest.raises(checkify.JaxRuntimeError, match="jagged convention"):
    err.throw()
  err, _ = checked(*qkv, jnp.asarray([0, 4, 4, 10], jnp.int32))
  err.throw()  # valid offsets: no error
