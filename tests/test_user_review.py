"""Defects found by a new user's review (session 16): each test failed before its fix.

Tiny shapes, XLA paths only (the whole file costs a few CPU-seconds)."""

from __future__ import annotations

import os
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_layers as fl
import pallas_norm as pn
from pallas_norm import jagged, sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import train_kunlun  # noqa: E402

OFFSETS = jnp.array([0, 3, 3, 8], jnp.int32)


# ------------------------------------------------------------------------------------------------
# jagged conversions: bad sizes and non-array values raised Python/JAX errors naming no argument.


@pytest.mark.parametrize("call, error, name", [
    (lambda v: jagged.to_padded(v, OFFSETS, 5.0), TypeError, "max_len"),
    (lambda v: jagged.to_padded(v, OFFSETS, "5"), TypeError, "max_len"),
    (lambda v: jagged.from_padded(v.reshape(3, 5, 2)[:, :5], OFFSETS, 10.0), TypeError,
     "capacity"),
    (lambda v: jagged.row_index(OFFSETS, 10.0), TypeError, "capacity"),
    (lambda v: jagged.to_padded(np.float32(1.0), OFFSETS, 5), ValueError, "values"),
    (lambda v: jagged.to_padded([[1.0]] * 10, OFFSETS, 5), TypeError, "values"),
    (lambda v: jagged.from_padded([[1.0]] * 3, OFFSETS, 10), TypeError, "padded"),
])
def test_jagged_conversions_name_a_bad_argument(call, error, name):
  """to_padded(v, off, 5.0) raised "'float' object cannot be interpreted as an integer", a 0-d
  values IndexError and a list AttributeError (review)."""
  values = jax.random.normal(jax.random.key(0), (10, 3))
  with pytest.raises(error, match=f"{name} must"):
    call(values)


# ------------------------------------------------------------------------------------------------
# sharding helpers


@pytest.mark.parametrize("kwargs, error", [
    (dict(shard_capacity=-1), ValueError), (dict(shard_capacity=6.0), TypeError),
    (dict(shard_capacity=True), TypeError)])
def test_split_jagged_checks_shard_capacity(kwargs, error):
  """shard_capacity=-1 raised NumPy's 'negative dimensions are not allowed', 6.0 "'float' object
  cannot be interpreted as an integer" (review)."""
  values = np.ones((10, 2), np.float32)
  with pytest.raises(error, match="shard_capacity must"):
    sharding.split_jagged(values, np.array([0, 3, 3, 8], np.int32), 1, **kwargs)


@pytest.mark.parametrize("capacity, error", [(-1, ValueError), (10.0, TypeError)])
def test_join_jagged_checks_capacity(capacity, error):
  values = np.ones((10, 2), np.float32)
  with pytest.raises(error, match="capacity must"):
    sharding.join_jagged(values, np.array([0, 3, 3, 8], np.int32), 1, capacity)


@pytest.mark.parametrize("first, second", [
    (dict(return_h=True), dict(return_h=1)),          # True == 1: the cached program ran
    (dict(return_h=False), dict(return_h=0)),
    (dict(eps=1), dict(eps=True))])
def test_shard_rows_validates_settings_that_compare_equal_to_cached_ones(first, second):
  """shard_rows caches its jitted shard_map per settings, keyed by ==: after a call with
  return_h=True, return_h=1 (which the op refuses) reused that program and ran (review)."""
  mesh = jax.make_mesh((1,), ("data",))
  op = sharding.shard_rows(pn.matmul_norm, mesh)
  x = jax.random.normal(jax.random.key(0), (4, 8))
  w = jax.random.normal(jax.random.key(1), (8, 8))
  op(x, w, **first)
  with pytest.raises(TypeError):
    op(x, w, **second)


# ------------------------------------------------------------------------------------------------
# KunlunModel under jit with traced offsets that break the jagged convention


def test_kunlun_logits_are_nan_for_invalid_traced_offsets():
  """Under jax.jit the model cannot raise for bad seq_offsets; its docstring promised NaN. The
  PFFN op's NaN tokens were masked away by the seed pooling of samples whose length is <= 0,
  so offsets [3, 3, 3] (first != 0) or [0, 0, -1] gave finite, plausible logits and a finite
  loss (only the gradients were NaN) (review). One compiled forward for every case."""
  config = fl.KunlunConfig(num_sparse_features=1, num_dense_features=0, sparse_vocab_size=8,
                           item_vocab_size=8, embed_dim=4, head_dim=4, kv_len=2, num_layers=1,
                           max_seq_len=4, num_seeds=1, summary_dim=4, mlp_dim=4,
                           num_mlp_layers=0)
  model = fl.KunlunModel(config, rngs=nnx.Rngs(0), implementation="xla")
  sparse, dense = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 0), jnp.float32)
  seq_ids = jnp.arange(8, dtype=jnp.int32)
  forward = nnx.jit(lambda m, o: m(sparse, dense, seq_ids, o))
  for offsets in ([3, 3, 3], [0, 0, -1], [0, 9, 9], [0, 5, 5]):
    logits = forward(model, jnp.asarray(offsets, jnp.int32))
    assert bool(jnp.isnan(logits).all()), (offsets, logits)
  for offsets in ([0, 0, 4], [0, 4, 8], [0, 0, 0]):
    logits = forward(model, jnp.asarray(offsets, jnp.int32))
    assert bool(jnp.isfinite(logits).all()), (offsets, logits)


# ------------------------------------------------------------------------------------------------
# examples/train_kunlun.py


@pytest.mark.parametrize("argv, message", [
    (["--max-seq-len", "1"], "--max-seq-len"),          # was a traceback from ads_data.load
    (["--lr", "nan"], "--lr"),                          # trained silently to val_logloss=nan
    (["--lr=-1e-3"], "--lr"),
    (["--weight-decay", "inf"], "--weight-decay"),
    (["--seed", "-1"], "--seed"),                       # was NumPy's traceback (review 9)
    (["--seed", str(2**63)], "--seed"),                 # jax.random's OverflowError (review 44)
    (["--multi-host", "--num-processes", "2", "--process-id", "5"], "--process-id"),
    (["--multi-host", "--num-processes", "0"], "--num-processes"),
    # a file: Orbax's NotADirectoryError after the first steps had trained (review 9)
    (["--checkpoint-dir", str(ROOT / "README.md")], "--checkpoint-dir")])
def test_train_kunlun_rejects_bad_flags_with_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_kunlun.parse_args(argv)
  assert exit_info.value.code == 2
  assert f"{message} must" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# jagged conversions with rows= of another batch


def _conversions(values, offsets, rows):
  """to_padded and from_padded of one batch, with the given RowIndex."""
  padded = jagged.to_padded(values, offsets, 5, rows=rows)
  return padded, jagged.from_padded(padded, offsets, values.shape[0], rows=rows)


@pytest.mark.parametrize("other", [[0, 5, 5, 8], [0, 2, 3, 8], [0, 3, 3, 9], [0, 3, 8, 8]])
def test_a_row_index_of_other_offsets_raises_or_poisons(other):
  """rows= is searched once per batch and reused (KunlunModel); a RowIndex of another batch of
  the same capacity gave the right forward values (the gathers read the offsets) but gradients
  from the other batch's rows, silently (review). Concrete: ValueError; traced: NaN values and
  gradients, as for bad traced offsets. The right RowIndex gives what rows=None gives."""
  values = jax.random.normal(jax.random.key(0), (10, 3))
  wrong = jagged.row_index(jnp.asarray(other, jnp.int32), 10)
  with pytest.raises(ValueError, match="rows is not the jagged.row_index"):
    _conversions(values, OFFSETS, wrong)

  value, g = _conversions_grad(values, OFFSETS, wrong)
  assert bool(jnp.isnan(value)) and bool(jnp.isnan(g).all())
  right = jagged.row_index(OFFSETS, 10)
  np.testing.assert_allclose(_conversions_grad(values, OFFSETS, right)[1],
                             jax.grad(_conversions_loss)(values, OFFSETS, None), rtol=1e-6)


def test_a_row_index_with_wrong_positions_raises_or_poisons():
  """A RowIndex whose segment ids are right but positions are not (hand-built, or mixed from two
  batches): the first row of each sample must be position 0 (a mutation that dropped that check
  passed the case above, where a RowIndex from other offsets also has other segment ids)."""
  values = jax.random.normal(jax.random.key(0), (10, 3))
  right = jagged.row_index(OFFSETS, 10)
  bad = jagged.RowIndex(right.segment_ids, right.positions + 1)
  with pytest.raises(ValueError, match="rows is not the jagged.row_index"):
    _conversions(values, OFFSETS, bad)
  value, g = _conversions_grad(values, OFFSETS, bad)
  assert bool(jnp.isnan(value)) and bool(jnp.isnan(g).all())


def _conversions_loss(values, offsets, rows):
  padded, packed = _conversions(values, offsets, rows)
  return jnp.sum(padded * jnp.arange(padded.size).reshape(padded.shape)) + jnp.sum(packed ** 2)


_conversions_grad = jax.jit(jax.value_and_grad(_conversions_loss))  # one compile for every case


# ------------------------------------------------------------------------------------------------
# Flax parameters passed straight to the ops (the validation accepts them: _validate.is_array)


def test_as_arrays_converts_array_likes_only():
  from pallas_norm import _validate
  param, array = nnx.Param(jnp.ones(3)), np.ones(2)
  converted = _validate.as_arrays(param, array, None, 1.5)
  assert isinstance(converted[0], jax.Array) and converted[1] is array
  assert converted[2] is None and converted[3] == 1.5


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_kernel_path_gradient_with_an_nnx_param_weight(op):
  """A Flax module that passes its nnx.Param weight straight to the op (``pn.matmul_norm(x,
  self.w)``) trains on the XLA path but failed on the kernel path (the default for such shapes
  on a Hopper GPU): "Error interpreting argument to custom_jvp_call as a JAX value ...
  CustomVJPPrimal" (matmul_norm), "Input specs and input gmem refs must have the same pytree
  structure" (norm_matmul, inside the Pallas pipeline) (review)."""
  x = jax.random.normal(jax.random.key(0), (8, 64), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (64, 64)) / 8).astype(jnp.bfloat16)
  fn = getattr(pn, op)

  def loss(w, implementation):
    return fn(x, nnx.Param(w), implementation=implementation).astype(jnp.float32).sum()

  got = jax.grad(loss)(w, "interpret").astype(jnp.float32)
  want = jax.grad(loss)(w, "xla").astype(jnp.float32)
  np.testing.assert_allclose(got, want, atol=0.1, rtol=0.05)


def test_kernel_skipped_warning_is_public():
  """The README tells users about KernelSkippedWarning, which lived only in the private
  pallas_norm._dispatch: no public name to filter it by (review)."""
  from pallas_norm import _dispatch
  assert pn.KernelSkippedWarning is _dispatch.KernelSkippedWarning
  assert "KernelSkippedWarning" in pn.__all__


# ------------------------------------------------------------------------------------------------
# _op.by_use (implementation=None's two uses) under JAX's transformations (review 7: all pass;
# kept so that a change to its custom_vjp cannot break them silently)


def test_by_use_runs_each_use_on_its_path_under_transformations():
  """Values from ``forward``, derivatives from ``training`` (tagged here by a factor 2 in its
  backward only), under jit, vmap, remat, scan and grad of grad, with a None argument."""
  from pallas_norm import _op

  def forward(x, w, none):
    assert none is None
    return jnp.sin(x) * w

  @jax.custom_vjp
  def training(x, w, none):
    return jnp.sin(x) * w

  training.defvjp(lambda x, w, none: (jnp.sin(x) * w, (x, w)),
                  lambda res, ct: (2 * ct * jnp.cos(res[0]) * res[1],
                                   2 * jnp.sum(ct * jnp.sin(res[0])), None))
  op = lambda x, w: _op.by_use(forward, training, x, w, None)  # noqa: E731
  x, w = jnp.linspace(0.1, 1.0, 8), jnp.float32(1.5)
  loss = lambda x, w: jnp.sum(op(x, w) ** 2) / 2  # noqa: E731
  want = (2 * w**2 * jnp.sin(x) * jnp.cos(x), 2 * w * jnp.sum(jnp.sin(x) ** 2))
  np.testing.assert_allclose(jax.jit(op)(x, w), jnp.sin(x) * w, rtol=1e-6)
  for name, grad in [
      ("jit", jax.jit(jax.grad(loss, (0, 1)))),
      ("remat", jax.grad(jax.checkpoint(loss), (0, 1))),
      ("scan", jax.grad(lambda x, w: jax.lax.scan(
          lambda c, xi: (c + loss(xi, w), None), 0.0, x.reshape(2, 4))[0], (0, 1)))]:
    for got, ref in zip(grad(x, w), want):
      np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=name)
  dx = jax.vmap(jax.grad(loss), (0, None))(x.reshape(2, 4), w)
  np.testing.assert_allclose(dx.reshape(-1), want[0], rtol=1e-5)
  # grad of grad differentiates the training path's backward (2·w²·(cos² − sin²) here).
  second = jax.grad(lambda x: jnp.sum(jax.grad(loss)(x, w)))(x)
  np.testing.assert_allclose(second, 2 * w**2 * jnp.cos(2 * x), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# A new user's review: the interpreters' import and the jit cache.


def test_the_first_interpret_call_does_not_retrace_jitted_functions():
  """JAX's interpreters register a config option (part of every jit cache key) when first
  imported; imported during the first interpret-mode trace, every jitted function traced twice
  (a new user's train step compiled twice). A fresh process: the import state is the point."""
  import os
  import subprocess
  script = "\n".join([
      "import jax, jax.numpy as jnp, pallas_norm as pn",
      "traces = []",
      "def loss(x, w):",
      "  traces.append(1)",
      "  y = pn.norm_matmul(x, w, implementation='interpret')",
      "  return jnp.sum(y.astype(jnp.float32) ** 2)",
      "f = jax.jit(jax.grad(loss, (0, 1)))",
      "x = jax.random.normal(jax.random.key(0), (128, 64), jnp.bfloat16)",
      "w = jax.random.normal(jax.random.key(1), (64, 64), jnp.bfloat16) / 8",
      "for _ in range(2):",  # a retrace shows at the second call
      "  jax.block_until_ready(f(x, w))",
      "print('traces', len(traces))",
  ])
  env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC=os.environ.get("PJRT_NPROC", "8"),
             PYTHONPATH=str(ROOT))
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "traces 1" in result.stdout, result.stdout


# ------------------------------------------------------------------------------------------------
# Session 44's review


def test_multi_host_without_a_cluster_exits_2(monkeypatch, capsys):
  """jax.distributed.initialize's refusal (no cluster in the environment, a flag it needs) was
  a traceback with exit status 1; now a usage error naming --multi-host."""
  def refuse(*args):
    raise ValueError("coordinator_address should be defined.")
  monkeypatch.setattr(jax.distributed, "initialize", refuse)
  with pytest.raises(SystemExit) as exit_info:
    train_kunlun.parse_args(["--multi-host"])
  assert exit_info.value.code == 2
  assert "--multi-host: jax.distributed.initialize failed: coordinator_address" in (
      capsys.readouterr().err)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16, jnp.uint16])
def test_narrow_offsets_are_checked_without_wrapping_under_jit(dtype):
  """Traced offsets of 8 or 16 bits were checked in their own dtype: the capacity and max_len
  wrapped (uint8(300) = 44), so valid offsets gave NaN under jit, and a decreasing step wrapped
  to a large positive one (uint8 100 − 200 = 156), so invalid offsets gave a finite answer."""
  values = jnp.arange(1.0, 301.0)[:, None]
  offsets = jnp.array([0, 100, 120], dtype)
  eager = jagged.to_padded(values, offsets, 128)
  jitted = jax.jit(lambda o: jagged.to_padded(values, o, 128))(offsets)
  np.testing.assert_array_equal(jitted, eager)
  padded = jax.jit(lambda o: jagged.from_padded(eager, o, 300))(offsets)
  np.testing.assert_array_equal(padded, jagged.from_padded(eager, offsets, 300))
  decreasing = jnp.array([0, 120, 100], dtype)
  assert bool(jnp.isnan(jax.jit(lambda o: jagged.to_padded(values, o, 128))(decreasing)).all())


def test_row_sharded_take_range_test_in_the_ids_own_dtype():
  """Ids outside [0, V) give zero rows: int64 ids were cast to int32 first, so 2**32 + 5 read
  row 5; narrow ids are widened, so a uint8 id below V = 300 still reads its row."""
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  from jax.sharding import PartitionSpec as P
  take = jax.shard_map(lambda t, i: sharding.row_sharded_take(t, i, "model"), mesh=mesh,
                       in_specs=(P("model"), P("model")), out_specs=P("model"))
  table = 1.0 + jnp.arange(300 * 2, dtype=jnp.float32).reshape(300, 2)
  got = take(table, jnp.array([200, 7], jnp.uint8))
  np.testing.assert_array_equal(got, table[jnp.array([200, 7])])
  with jax.enable_x64(True):
    ids = jnp.array([2**32 + 5, 5, -(2**32) + 5], jnp.int64)
    got = np.asarray(take(table, ids))
    big = jnp.array([2**32 - 3, 5], jnp.uint32)
    got_u32 = np.asarray(take(table, big))
  np.testing.assert_array_equal(got[[0, 2]], 0.0)
  np.testing.assert_array_equal(got[1], table[5])
  np.testing.assert_array_equal(got_u32[0], 0.0)
  np.testing.assert_array_equal(got_u32[1], table[5])


@pytest.mark.parametrize("pjrt, nproc, threads", [
    ("abc", None, 2), ("8.0", None, 2), ("\u0661\u0662", None, 2), ("²", None, 2),
    ("99999999999", None, 2), ("+8", None, 8), (" 8 ", None, 8), ("0", None, 1),
    (None, "8", 8), ("x", "16", 16)])
def test_pjrt_nproc_is_read_as_xla_reads_it(monkeypatch, pjrt, nproc, threads):
  """The interpret-mode guard counts the CPU client's threads as XLA's DefaultThreadPoolSize
  does (absl::SimpleAtoi of PJRT_NPROC, else of NPROC, else the core count; a review counted
  XLA's threads for each of these values): PJRT_NPROC=abc was int()'s ValueError in every
  interpret call (also where a sequence should fall back), non-ASCII digits passed the guard
  while XLA ran 2 threads, and '+8' was refused though XLA reads it."""
  from pallas_norm import _dispatch
  monkeypatch.setattr(os, "cpu_count", lambda: 2)
  for name, value in (("PJRT_NPROC", pjrt), ("NPROC", nproc)):
    if value is None:
      monkeypatch.delenv(name, raising=False)
    else:
      monkeypatch.setenv(name, value)
  assert _dispatch._xla_cpu_threads() == threads
  reason = _dispatch.interpret_threads_reason()
  assert (reason is None) == (threads >= 8), reason
  if reason is not None:
    assert f"this process has {threads}" in reason
    if pjrt in ("abc", "8.0"):
      assert f"PJRT_NPROC={pjrt!r} is not a number XLA reads" in reason
  if pjrt == "abc":
    x = jnp.ones((256, 128), jnp.bfloat16)
    w = jnp.ones((128, 128), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="PJRT_NPROC"):
      pn.norm_matmul(x, w, implementation="interpret")
    with warnings.catch_warnings():  # the skip is reported once per process
      warnings.simplefilter("ignore")
      y = pn.norm_matmul(x, w, implementation=("interpret", "xla"))
    np.testing.assert_array_equal(y, pn.norm_matmul(x, w, implementation="xla"))


def test_uint64_offsets_are_refused_naming_them():
  """uint64 offsets (under x64) reached jax's "indices must have an integer type" from the
  conversions (uint64 + int32 positions promote to float64); now the offsets' TypeError, as
  the ops give for any dtype but int32."""
  values = jnp.arange(8.0)[:, None]
  with jax.enable_x64(True):
    offsets = jnp.array([0, 3, 8], jnp.uint64)
    with pytest.raises(TypeError, match="offsets must be a 1-D integer"):
      jagged.to_padded(values, offsets, 5)
    with pytest.raises(TypeError, match="offsets must be a 1-D integer"):
      jagged.from_padded(jnp.zeros((2, 5, 1)), offsets, 8)
