"""The jagged helpers (`pallas_norm.jagged`) against plain numpy loops over the samples:
offsets <-> lengths, segment ids, valid mask, positions, packed <-> padded round trips, including
empty samples (first, inner, last, all) and padding rows that hold garbage."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _numpy_oracle as npo
from pallas_norm import jagged

PATTERNS = {
    "inner_empty": [3, 0, 5, 1],
    "edge_empty": [0, 4, 2, 0],
    "all_empty": [0, 0, 0],
    "single": [6],
    "ones": [1, 1, 1, 1, 1],
}
PAD = 3  # padding rows after the last sample


@pytest.fixture(params=sorted(PATTERNS))
def lens(request):
  return PATTERNS[request.param]


@pytest.fixture
def rng(request):
  return np.random.default_rng(npo.seed_of(request.node.nodeid))


def np_offsets(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def capacity(lens):
  return int(sum(lens)) + PAD


def np_segment_ids(lens):
  """Sample of each row; padding rows get B."""
  return np.concatenate([np.repeat(np.arange(len(lens)), lens),
                         np.full(PAD, len(lens))]).astype(np.int32)


def np_positions(lens):
  return np.concatenate([np.arange(n) for n in lens] + [np.zeros(0)]).astype(np.int32)


def test_offsets_from_lengths_and_back(lens):
  offsets = jagged.offsets_from_lengths(lens)
  assert offsets.dtype == np.int32
  np.testing.assert_array_equal(offsets, np_offsets(lens))
  np.testing.assert_array_equal(jagged.lengths(jnp.asarray(offsets)), lens)


@pytest.mark.parametrize("bad, error", [
    ([0, 3, 3, 8], TypeError), (jnp.array([0.0, 3.0]), TypeError),
    (jnp.array([True, False]), TypeError), (jnp.zeros((2, 3), jnp.int32), TypeError),
    (jnp.int32(3), TypeError), (jnp.array([0, 5, 3, 8], jnp.int32), ValueError),
    (jnp.array([1, 3], jnp.int32), ValueError)],
    ids=["list", "float", "bool", "2-d", "0-d", "decreasing", "first-not-0"])
def test_lengths_rejects_bad_offsets(bad, error):
  """lengths() checked nothing: decreasing offsets gave negative lengths, float or 2-D offsets
  garbage, a list a bare "unsupported operand" TypeError (review11)."""
  with pytest.raises(error, match="lengths: offsets must"):
    jagged.lengths(bad)


def test_lengths_of_traced_offsets_checks_only_dtype_and_shape():
  f = jax.jit(jagged.lengths)
  np.testing.assert_array_equal(f(jnp.array([0, 5, 3], jnp.int32)), [5, -2])
  with pytest.raises(TypeError, match="lengths: offsets must"):
    f(jnp.array([0.0, 1.0]))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.uint32])
def test_lengths_of_numpy_offsets_are_the_jitted_jax_array(dtype):
  """Eagerly, NumPy offsets gave a NumPy array in their own dtype (int64 for int64 offsets),
  while under jax.jit the same offsets gave an int32 jax.Array: both are now the jax.Array in
  the offsets' dtype as JAX sees it. An int64 offset that int32 cannot hold raises eagerly
  (jnp.asarray, as jax.jit, would wrap it)."""
  offsets = np.asarray([0, 3, 3, 8], dtype)
  eager, jitted = jagged.lengths(offsets), jax.jit(jagged.lengths)(offsets)
  assert isinstance(eager, jax.Array) and isinstance(jitted, jax.Array)
  assert eager.dtype == jitted.dtype == jax.dtypes.canonicalize_dtype(dtype)
  np.testing.assert_array_equal(eager, [3, 0, 5])
  np.testing.assert_array_equal(jitted, [3, 0, 5])
  if dtype == np.int64:
    with pytest.raises(ValueError, match="lengths: offsets must fit int32"):
      jagged.lengths(np.asarray([0, 2**31], dtype))
    with jax.enable_x64(True):
      assert jagged.lengths(np.asarray([0, 2**31], dtype)).dtype == jnp.int64


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], [2, -1, 3], 5])
def test_offsets_from_lengths_rejects_bad_lengths(bad):
  with pytest.raises(ValueError, match="lengths"):
    jagged.offsets_from_lengths(bad)


@pytest.mark.parametrize("bad", [[2.7, 1.9], [2.0, 1.0], np.array([3.0]), jnp.array([1.0, 2.0]),
                                 [True, False], np.array([1, 0], bool), ["3"]],
                         ids=["floats", "integral-floats", "np-float", "jnp-float", "bools",
                              "np-bool", "str"])
def test_offsets_from_lengths_rejects_non_integer_dtypes(bad):
  """Floats were truncated silently ([2.7, 1.9] gave [0 2 3], review finding)."""
  with pytest.raises(TypeError, match="lengths must have an integer dtype"):
    jagged.offsets_from_lengths(bad)


@pytest.mark.parametrize("bad", [[2**31 - 1, 5], [2**30, 2**30], np.array([2**31], np.int64),
                                 np.array([2**64 - 1], np.uint64), [2**70]],
                         ids=["wraps", "sum", "one-int64", "uint64", "past-int64"])
def test_offsets_from_lengths_rejects_a_total_past_int32(bad):
  """[2**31 - 1, 5] wrapped to a negative last offset (review finding)."""
  with pytest.raises(ValueError, match="lengths sum"):
    jagged.offsets_from_lengths(bad)


@pytest.mark.parametrize("good, expected", [
    ([], [0]), (np.array([2**31 - 1]), [0, 2**31 - 1]),
    (np.array([3, 0, 5], np.uint8), [0, 3, 3, 8]),
    (jnp.array([1, 2], jnp.int32), [0, 1, 3]), ((np.int16(4), 2), [0, 4, 6])])
def test_offsets_from_lengths_integer_inputs(good, expected):
  offsets = jagged.offsets_from_lengths(good)
  assert isinstance(offsets, np.ndarray) and offsets.dtype == np.int32
  np.testing.assert_array_equal(offsets, expected)


def test_offsets_from_lengths_traced():
  """Under jit the dtype and shape are checked, not the values; the result is traced int32."""
  f = jax.jit(jagged.offsets_from_lengths)
  out = f(jnp.asarray([3, 0, 5], jnp.int32))
  chex.assert_type(out, jnp.int32)
  np.testing.assert_array_equal(out, [0, 3, 3, 8])
  with pytest.raises(TypeError, match="lengths must have an integer dtype"):
    f(jnp.asarray([1.5, 2.0]))
  with pytest.raises(ValueError, match="lengths must be a 1-D array"):
    f(jnp.ones((2, 2), jnp.int32))


def test_segment_ids_valid_mask_positions(lens):
  offsets, cap = jnp.asarray(np_offsets(lens)), capacity(lens)
  seg = jagged.segment_ids(offsets, cap)
  chex.assert_type(seg, jnp.int32)
  np.testing.assert_array_equal(seg, np_segment_ids(lens))
  mask = jagged.valid_mask(offsets, cap)
  np.testing.assert_array_equal(mask, np.arange(cap) < sum(lens))
  pos = jagged.positions(offsets, cap)
  chex.assert_type(pos, jnp.int32)
  np.testing.assert_array_equal(np.asarray(pos)[:sum(lens)], np_positions(lens))


def test_helpers_under_jit_match_eager(lens):
  offsets, cap = jnp.asarray(np_offsets(lens)), capacity(lens)

  @jax.jit
  def all_helpers(offsets):
    return (jagged.segment_ids(offsets, cap), jagged.valid_mask(offsets, cap),
            jagged.positions(offsets, cap), jagged.lengths(offsets))

  eager = (jagged.segment_ids(offsets, cap), jagged.valid_mask(offsets, cap),
           jagged.positions(offsets, cap), jagged.lengths(offsets))
  chex.assert_trees_all_equal(all_helpers(offsets), eager)


def np_to_padded(values, lens, max_len):
  offsets = np_offsets(lens)
  out = np.zeros((len(lens), max_len) + values.shape[1:], values.dtype)
  for b, n in enumerate(lens):
    m = min(n, max_len)
    out[b, :m] = values[offsets[b]:offsets[b] + m]
  return out


@pytest.mark.parametrize("feature_shape", [(), (2, 3)])
def test_to_padded_and_back(lens, feature_shape, rng):
  cap, max_len = capacity(lens), max(max(lens), 1) + 2
  values = rng.standard_normal((cap,) + feature_shape).astype(np.float32)
  values[sum(lens):] = 1e6  # padding rows must never be read
  offsets = jnp.asarray(np_offsets(lens))
  padded = jagged.to_padded(jnp.asarray(values), offsets, max_len)
  chex.assert_shape(padded, (len(lens), max_len) + feature_shape)
  np.testing.assert_array_equal(padded, np_to_padded(values, lens, max_len))
  packed = jagged.from_padded(padded, offsets, cap)
  chex.assert_shape(packed, values.shape)
  np.testing.assert_array_equal(np.asarray(packed)[:sum(lens)], values[:sum(lens)])
  np.testing.assert_array_equal(np.asarray(packed)[sum(lens):], 0.0)


def test_from_padded_ignores_positions_past_each_length(lens, rng):
  """Garbage in a padded tensor past a sample's length never reaches the packed rows."""
  cap, max_len = capacity(lens), max(max(lens), 1) + 2
  padded = rng.standard_normal((len(lens), max_len, 4)).astype(np.float32)
  clean = np.zeros_like(padded)
  for b, n in enumerate(lens):
    clean[b, :n] = padded[b, :n]
    padded[b, n:] = np.nan
  offsets = jnp.asarray(np_offsets(lens))
  packed = jagged.from_padded(jnp.asarray(padded), offsets, cap)
  chex.assert_tree_all_finite(packed)
  np.testing.assert_array_equal(jagged.to_padded(packed, offsets, max_len), clean)


def test_conversions_reject_concrete_samples_longer_than_the_padded_length(rng):
  """A sample longer than max_len (to_padded) or L (from_padded) silently lost its rows past
  it (review, issue 17); concrete offsets raise, naming the argument. Exactly fitting is fine."""
  lens = [5, 1, 3]
  values = jnp.asarray(rng.standard_normal((sum(lens) + PAD, 3)), jnp.float32)
  offsets = jnp.asarray(np_offsets(lens))
  with pytest.raises(ValueError, match="to_padded: a sample of offsets has 5 rows, more than "
                     "max_len=4"):
    jagged.to_padded(values, offsets, 4)
  with pytest.raises(ValueError, match=r"from_padded: a sample of offsets has 5 rows, more "
                     r"than L \(padded.shape\[1\]\)=4"):
    jagged.from_padded(jnp.ones((3, 4, 3)), offsets, sum(lens) + PAD)
  with pytest.raises(ValueError, match="more than max_len=0"):
    jagged.to_padded(values, offsets, 0)
  padded = jagged.to_padded(values, offsets, 5)  # the longest sample fits exactly
  np.testing.assert_array_equal(padded, np_to_padded(np.asarray(values), lens, 5))
  np.testing.assert_array_equal(jagged.from_padded(padded, offsets, sum(lens) + PAD)[:9],
                                values[:9])


# Traced offsets that break the convention: (offsets, max_len) with a capacity of 10 rows.
BAD_TRACED = {
    "decreasing": ([0, 5, 3, 8], 5),
    "first_not_0": ([1, 3, 3, 8], 5),
    "past_capacity": ([0, 3, 3, 11], 8),
    "longer_than_max_len": ([0, 3, 3, 8], 4),
}


@pytest.mark.parametrize("case", sorted(BAD_TRACED))
def test_traced_invalid_offsets_poison_outputs_and_gradients(case, rng):
  """Under jax.jit bad offsets cannot raise; to_padded gave plausible rows for non-monotone
  offsets (review, issue 17). Now both conversions give NaN outputs, NaN gradients and NaN
  tangents, with or without a shared row index; the same jitted function is exact on good
  offsets."""
  off, max_len = BAD_TRACED[case]
  bad, good = jnp.asarray(off, jnp.int32), jnp.asarray([0, 3, 3, 4], jnp.int32)
  values = jnp.asarray(rng.standard_normal((10, 2)), jnp.float32)
  padded = jnp.asarray(rng.standard_normal((3, max_len, 2)), jnp.float32)

  def both(values, padded, offsets, shared):
    rows = jagged.row_index(offsets, 10) if shared else None
    to = lambda v: jagged.to_padded(v, offsets, max_len, rows=rows)  # noqa: E731
    fro = lambda p: jagged.from_padded(p, offsets, 10, rows=rows)  # noqa: E731
    return (to(values), fro(padded), jax.grad(lambda v: to(v).sum())(values),
            jax.grad(lambda p: fro(p).sum())(padded), jax.jvp(to, (values,), (values,))[1],
            jax.jvp(fro, (padded,), (padded,))[1])

  run = jax.jit(both, static_argnums=3)
  for shared in (False, True):
    for name, a in zip(["to_padded", "from_padded", "grad values", "grad padded",
                        "jvp to_padded", "jvp from_padded"], run(values, padded, bad, shared)):
      assert np.all(np.isnan(np.asarray(a))), (name, a)
    out = run(values, padded, good, shared)
    np.testing.assert_array_equal(out[0], np_to_padded(np.asarray(values), [3, 0, 1], max_len))
    np.testing.assert_array_equal(out[1][:4], np.asarray(padded)[[0, 0, 0, 2], [0, 1, 2, 0]])
    np.testing.assert_array_equal(out[1][4:], 0.0)
    np.testing.assert_array_equal(out[2], np.r_[np.ones(4), np.zeros(6)][:, None] * [1, 1])


def test_one_sample_longer_than_max_len_raises():
  """A batch of one sample longer than max_len raises as a batch of two does, never a silent
  truncation (a mutation test skipped the length check for B = 1 unnoticed)."""
  values, off = jnp.ones((5, 2)), jnp.asarray([0, 5], jnp.int32)
  with pytest.raises(ValueError):
    jagged.to_padded(values, off, 3)
  with pytest.raises(ValueError):
    jagged.from_padded(jnp.ones((1, 3, 2)), off, 5)


def test_traced_invalid_offsets_raise_under_checkify(rng):
  from jax.experimental import checkify
  values = jnp.asarray(rng.standard_normal((10, 2)), jnp.float32)
  f = checkify.checkify(jax.jit(lambda o: jagged.to_padded(values, o, 5)))
  err, _ = f(jnp.asarray([0, 5, 3, 8], jnp.int32))
  with pytest.raises(checkify.JaxRuntimeError, match="traced offsets break the jagged"):
    err.throw()
  err, out = f(jnp.asarray([0, 5, 5, 8], jnp.int32))
  assert err.get() is None
  np.testing.assert_array_equal(out[0, :5], values[:5])


def test_to_padded_under_jit_with_traced_offsets(rng):
  lens = PATTERNS["inner_empty"]
  values = jnp.asarray(rng.standard_normal((capacity(lens), 2)), jnp.float32)
  offsets = jnp.asarray(np_offsets(lens))
  round_trip = jax.jit(lambda v, o: jagged.from_padded(jagged.to_padded(v, o, 5), o,
                                                        capacity(lens)))
  got = np.asarray(round_trip(values, offsets))
  np.testing.assert_array_equal(got[:sum(lens)], np.asarray(values)[:sum(lens)])
  np.testing.assert_array_equal(got[sum(lens):], 0.0)


@pytest.mark.parametrize("call,match", [
    (lambda v, p: jagged.to_padded(v, jnp.asarray([0, 2, 9], jnp.int32), 7), "capacity 6"),
    (lambda v, p: jagged.to_padded(v, jnp.asarray([0, 4, 2], jnp.int32), 4), "never decrease"),
    (lambda v, p: jagged.to_padded(v, jnp.asarray([2, 4, 6], jnp.int32), 2), "start at 0"),
    (lambda v, p: jagged.to_padded(v, jnp.asarray([0, 2, 5], jnp.int32), -1), "max_len"),
    (lambda v, p: jagged.from_padded(p, jnp.asarray([0, 2, 4, 6], jnp.int32), 6), "B = "),
    (lambda v, p: jagged.from_padded(p[:1], jnp.asarray([0, 2, 5], jnp.int32), 6), "B = "),
    (lambda v, p: jagged.from_padded(p, jnp.asarray([0, 2, 5], jnp.int32), 3), "capacity 3"),
], ids=["past_capacity", "decreasing", "first_not_0", "negative_max_len", "padded_batch_short",
        "padded_batch_long", "capacity_short"])
def test_conversions_reject_concrete_offsets_that_would_clip(call, match, rng):
  """Both gathers clip their indices: offsets past the capacity, decreasing ones or a padded
  batch other than the offsets' B gave silently repeated or dropped rows; concrete ones raise."""
  values = jnp.asarray(rng.standard_normal((6, 2)), jnp.float32)
  padded = jnp.asarray(rng.standard_normal((2, 3, 2)), jnp.float32)
  with pytest.raises(ValueError, match=match):
    call(values, padded)


def test_conversions_reject_non_integer_offsets():
  with pytest.raises(TypeError, match="offsets"):
    jagged.to_padded(jnp.ones((6, 2)), jnp.asarray([0.0, 2.0, 5.0]), 3)


def test_numpy_uint64_offsets_are_uint32_eagerly_as_under_jit(rng):
  """Without x64 a NumPy uint64 offsets array is uint32 to JAX: jax.jit converts it before
  the helper sees it, so the jitted helpers took it while the eager ones raised "offsets must
  be a 1-D integer (int32) array ..., got uint64" (review_jagged). Both now give the int32
  offsets' values; with x64 on, uint64 stays refused eagerly and under jit alike."""
  values = jnp.asarray(rng.standard_normal((10, 2)), jnp.float32)
  good, wide = np.asarray([0, 3, 3, 8], np.int32), np.asarray([0, 3, 3, 8], np.uint64)
  calls = {"lengths": jagged.lengths, "segment_ids": lambda o: jagged.segment_ids(o, 10),
           "to_padded": lambda o: jagged.to_padded(values, o, 5)}
  for name, call in calls.items():
    want = np.asarray(call(jnp.asarray(good)))
    np.testing.assert_array_equal(call(wide), want, err_msg=name)
    np.testing.assert_array_equal(jax.jit(call)(wide), want, err_msg=name)
    with jax.enable_x64(True):
      for f in (call, jax.jit(call)):
        with pytest.raises(TypeError, match=f"{name}: offsets must"):
          f(wide)


# ---------------------------------------------------------------------------------------------
# Derivatives of the conversions: each is the other's transpose, so the backward is a gather;
# forward mode still works (a custom_jvp whose tangent map is a scatter-add).


# Three of the ten (pattern, max_len) pairs, each ~2 CPU-s of compiles: empty samples inside
# with positions past each length, empty samples at both edges, and nothing at all. The
# conversions' values on every pattern are checked above; what is checked here is that their
# derivatives are each other's maps, which no pattern changes.
@pytest.mark.parametrize("pattern,extra", [("inner_empty", 2), ("edge_empty", 0),
                                           ("all_empty", 0)],
                         ids=["inner_empty-padding", "edge_empty-exact", "all_empty-exact"])
def test_conversion_gradients_match_autodiff_of_the_plain_gathers(pattern, extra, rng):
  """vjp of to_padded / from_padded equals autodiff of the same gathers (a scatter-add), padding
  rows and positions past each length included (exact: each entry sums at most one term); the
  jvp of these linear maps is the map of the tangent."""
  lens = PATTERNS[pattern]
  cap, max_len = capacity(lens), max(lens) + extra
  offsets = jnp.asarray(np_offsets(lens))
  values = jnp.asarray(rng.standard_normal((cap, 2, 3)), jnp.float32)
  padded = jnp.asarray(rng.standard_normal((len(lens), max_len, 2, 3)), jnp.float32)
  pairs = ((lambda v: jagged.to_padded(v, offsets, max_len),
            lambda v: jagged._gather_to_padded(v, offsets, max_len), values, padded),
           (lambda p: jagged.from_padded(p, offsets, cap),
            lambda p: jagged._gather_from_padded(p, offsets, cap), padded, values))


  def value_vjp_jvp(fn, primal, cotangent, tangent_in):
    out, vjp = jax.vjp(fn, primal)
    return out, vjp(cotangent)[0], jax.jvp(fn, (primal,), (tangent_in,))[1]

  # Jitted: one program per map instead of one per eager op (the CPU time of this test).
  value_vjp_jvp = jax.jit(value_vjp_jvp, static_argnums=0)
  for ours, plain, primal, cotangent in pairs:
    tangent_in = jnp.asarray(rng.standard_normal(primal.shape), jnp.float32)
    out, grad, tangent = value_vjp_jvp(ours, primal, cotangent, tangent_in)
    want_out, want, _ = value_vjp_jvp(plain, primal, cotangent, tangent_in)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(grad, want)
    assert np.any(np.asarray(grad) != 0) or sum(lens) == 0
    # Forward mode: a linear map's tangent is the map itself (its scatter-add form).
    np.testing.assert_array_equal(tangent, jax.jit(plain)(tangent_in))
  # The packed gradient is zero on padding rows.
  (grad,) = jax.vjp(pairs[0][0], values)[1](padded)
  kept = np.concatenate([np.ones(sum(lens), bool), np.zeros(PAD, bool)])
  np.testing.assert_array_equal(np.asarray(grad)[~kept], 0.0)


def test_a_shared_row_index_gives_the_same_values_and_gradients_and_no_search(rng):
  """rows=jagged.row_index(...) (one search per batch) changes nothing but the program: the
  conversions and their gradients are bitwise those without it, and with it neither the
  conversions nor their derivatives search the offsets again."""
  lens = PATTERNS["inner_empty"]
  cap, offsets = capacity(lens), jnp.asarray(np_offsets(lens))
  values = jnp.asarray(rng.standard_normal((cap, 3)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((len(lens), 5, 3)), jnp.float32)

  def loss(values, rows):
    padded = jagged.to_padded(values, offsets, 5, rows=rows)
    return jnp.sum(jagged.from_padded(padded * weights, offsets, cap, rows=rows) ** 2)

  rows = jagged.row_index(offsets, cap)
  np.testing.assert_array_equal(rows.segment_ids, jagged.segment_ids(offsets, cap))
  np.testing.assert_array_equal(rows.positions, jagged.positions(offsets, cap))
  chex.assert_trees_all_equal(jax.value_and_grad(loss)(values, rows),
                              jax.value_and_grad(loss)(values, None))
  searches = lambda rows: str(jax.make_jaxpr(jax.grad(loss))(values, rows)).count(  # noqa: E731
      " scan[")  # jnp.searchsorted's binary search
  assert searches(rows) == 0 and searches(None) > 0


@pytest.mark.parametrize("rows, error, match", [
    ((np.zeros(4, np.int32),) * 2, TypeError, "rows must be a jagged.RowIndex"),
    (jagged.RowIndex(jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32)), ValueError,
     r"rows.segment_ids must be int32 of shape \(9,\)"),
    (jagged.RowIndex(jnp.zeros(9, jnp.int32), jnp.zeros(9, jnp.float32)), ValueError,
     "rows.positions must be int32"),
])
def test_a_row_index_of_another_batch_raises(rows, error, match):
  offsets = jnp.asarray(np_offsets(PATTERNS["inner_empty"]))  # 9 tokens, capacity 9 here
  with pytest.raises(error, match=match):
    jagged.to_padded(jnp.ones((9, 2)), offsets, 5, rows=rows)
  with pytest.raises(error, match=match):
    jagged.from_padded(jnp.ones((4, 5, 2)), offsets, 9, rows=rows)


def test_conversion_gradients_are_gathers_not_scatter_adds():
  """The point of the custom_vjp pair: XLA's scatter-add gradients cost 5-9 ms at B=768,
  L=512 on the H200, the gathers a fraction of that."""
  offsets = jnp.asarray(np_offsets(PATTERNS["inner_empty"]))
  cap = capacity(PATTERNS["inner_empty"])
  round_trip = lambda v: jnp.sum(jagged.from_padded(jagged.to_padded(v, offsets, 5), offsets,  # noqa: E731
                                                    cap) ** 2)
  jaxpr = str(jax.make_jaxpr(jax.grad(round_trip))(jnp.ones((cap, 2), jnp.float32)))
  assert "gather" in jaxpr and "scatter" not in jaxpr


@pytest.mark.parametrize("kind", ["q", "kv"])
@pytest.mark.parametrize("op", ["gdpa", "flash_norm_attention"])
def test_zero_capacity_gives_empty_outputs_and_zero_gradients(op, kind):
  """A zero-capacity packed axis with max_seq_len / max_kv_len used to raise IndexError from
  to_padded's take() (issue 18, item 2)."""
  import pallas_norm as pn
  rng = np.random.default_rng(18)
  h, d = 2, 8
  if kind == "q":  # three samples, every one empty; dense k/v
    q = jnp.zeros((0, h, d), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 3, h, d)), jnp.float32)
    q_offsets, kv_offsets, extra = jnp.zeros(3, jnp.int32), None, {}
  else:  # real queries, jagged k/v of zero capacity
    q = jnp.asarray(rng.standard_normal((4, h, d)), jnp.float32)
    k = jnp.zeros((0, h, d), jnp.float32)
    q_offsets = jnp.asarray([0, 2, 4], jnp.int32)
    kv_offsets, extra = jnp.zeros(3, jnp.int32), {"max_kv_len": 1}
  f = getattr(pn, op)

  def loss(q, k, v):
    out = f(q, k, v, q_offsets, kv_offsets, max_seq_len=2, implementation="xla", **extra)
    return jnp.sum(out ** 2), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, k)
  assert out.shape == q.shape and np.all(np.isfinite(np.asarray(out)))
  if kind == "kv" and op == "gdpa":  # no keys: the attention is exactly zero
    np.testing.assert_array_equal(out, 0.0)
  for g, primal in zip(grads, (q, k, k)):
    assert g.shape == primal.shape
    if kind == "q" or primal is k:
      np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("offsets, cap, error, match", [
    ([0, 3, 3, 8], 6, ValueError, "offsets"),        # last offset past the capacity
    ([0, 5, 3, 8], 10, ValueError, "offsets"),       # decreasing
    ([2, 5, 8], 10, ValueError, "offsets"),          # first offset not 0
    (np.array([0.0, 3.0, 8.0]), 10, TypeError, "offsets"),
    ([[0, 3, 8]], 10, TypeError, "offsets"),         # not 1-D
    ([0, 3, 8], 10.0, TypeError, "capacity"),
    ([0, 3, 8], -1, ValueError, "capacity"),
])
@pytest.mark.parametrize("helper", ["segment_ids", "valid_mask", "positions", "row_index"])
def test_index_helpers_reject_offsets_that_break_the_convention(helper, offsets, cap, error,
                                                                match):
  """segment_ids, valid_mask, positions and row_index returned silently wrong indices for
  concrete offsets that break the jagged convention (review 9): capacity 6 < offsets[-1] = 8
  gave a mask of all True, offsets starting at 2 negative positions, decreasing offsets a
  sample of negative length; float offsets and a float capacity were searched as they were."""
  offsets = jnp.asarray(np.asarray(offsets, np.int32) if isinstance(offsets, list) else offsets)
  with pytest.raises(error, match=match):
    getattr(jagged, helper)(offsets, cap)


def test_index_helpers_take_traced_offsets_unchecked():
  """Under jax.jit the values cannot raise (the conversions and ops poison instead); the helpers
  still trace and return the indices of valid offsets."""
  offsets = jnp.asarray([0, 3, 3, 8], jnp.int32)
  seg, pos, mask = jax.jit(lambda o: (jagged.segment_ids(o, 10), jagged.positions(o, 10),
                                      jagged.valid_mask(o, 10)))(offsets)
  np.testing.assert_array_equal(seg, [0, 0, 0, 2, 2, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(pos, [0, 1, 2, 0, 1, 2, 3, 4, 0, 1])
  np.testing.assert_array_equal(mask, [True] * 8 + [False] * 2)


@pytest.mark.parametrize("max_len", [2**31 + 1, 2**40])
def test_to_padded_refuses_more_padded_rows_than_int32_indexes(max_len):
  """B · max_len past 2**31 padded rows: a ValueError naming max_len before anything is built
  (2**40 killed the process with SIGFPE; review11's finding). 2**31 rows of one sample are the
  largest padded layout int32 row indices reach."""
  values, offsets = jnp.ones((4, 2), jnp.float32), jnp.array([0, 4], jnp.int32)
  with pytest.raises(ValueError, match="max_len"):
    jagged.to_padded(values, offsets, max_len)
  with pytest.raises(ValueError, match="max_len"):
    jagged.to_padded(values, jnp.array([0, 2, 4], jnp.int32), 2**30 + 1)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_traced_narrow_offsets_with_a_capacity_past_their_range(dtype, rng):
  """uint8/int16 offsets of a batch whose capacity (300 or 40000 rows) their dtype cannot hold:
  the traced validity check compares in int32 (in uint8 the bound 300 is 44, which made the
  valid offsets 100 and 200 look past the capacity and poisoned the output with NaN). The
  jitted to_padded matches the eager one and a NumPy loop over the samples."""
  cap, lens = (300, [100, 0, 100, 50]) if dtype == np.uint8 else (40000, [10000, 0, 10000, 12000])
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(dtype)
  values = jnp.asarray(rng.standard_normal((cap, 2)), jnp.float32)
  max_len = max(lens)
  want = np.zeros((len(lens), max_len, 2), np.float32)
  for b, (start, n) in enumerate(zip(offsets[:-1].astype(int), lens)):
    want[b, :n] = np.asarray(values)[start:start + n]
  np.testing.assert_array_equal(jagged.to_padded(values, jnp.asarray(offsets), max_len), want)
  got = jax.jit(lambda v, o: jagged.to_padded(v, o, max_len))(values, jnp.asarray(offsets))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("helper", ["lengths", "segment_ids", "valid_mask", "positions",
                                    "row_index", "to_padded", "from_padded"])
def test_helpers_refuse_offsets_of_no_entry(helper, jit, rng):
  """Offsets of shape (0,) (not even the leading 0) raise the helper's TypeError naming its
  offsets, eagerly and under jit alike (a mutation test let them through unnoticed: then
  IndexError named no argument, and the jitted lengths and segment_ids returned arrays)."""
  values = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
  calls = {"lengths": jagged.lengths,
           "to_padded": lambda o: jagged.to_padded(values, o, 3),
           "from_padded": lambda o: jagged.from_padded(values[:0, None], o, 4)}
  call = calls.get(helper, lambda o: getattr(jagged, helper)(o, 4))
  with pytest.raises(TypeError, match=rf"^{helper}: offsets must be a 1-D integer"):
    (jax.jit(call) if jit else call)(jnp.zeros((0,), jnp.int32))
