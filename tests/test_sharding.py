"""pallas_norm.sharding and examples/distributed.py (issue 23: training on several devices).

The checks that need several devices run on 8 CPU devices in a subprocess
(tests/sharding_checks.py): this pytest process has one CPU device and keeps it. The rest runs
here: the jagged split helpers, argument errors (raised before any device work, so an abstract
mesh of 4 devices stands in), and one-device meshes.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_norm as pn
from pallas_norm import sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import train_kunlun  # noqa: E402

CHECKS = ROOT / "tests" / "sharding_checks.py"
FOUR = jax.sharding.AbstractMesh((4,), ("data",))


def _run_checks(*groups):
  # The subprocess sets its own device count; other XLA flags (tests/conftest.py's) pass on.
  env = dict(os.environ, XLA_FLAGS=" ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")))
  result = subprocess.run([sys.executable, str(CHECKS), *groups], capture_output=True,
                          text=True, timeout=1200, env=env, cwd=ROOT)
  assert result.returncode == 0 and all(f"{g}: ok" in result.stdout for g in groups), (
      result.stdout[-2000:] + result.stderr[-6000:])


# Two processes, each paying ~3 CPU-s of start-up (Python, JAX, the library): the op groups
# share one, training (the longest) has the other, so that -n 2 runs them side by side.
@pytest.mark.parametrize("groups", [
    pytest.param(("ops_xla", "embedding", "ops_interpret", "distributed"),
                 marks=pytest.mark.slow),
    pytest.param(("training",), marks=pytest.mark.slow),
    ("layouts", "explicit_model")], ids=lambda g: "+".join(g))
def test_on_8_cpu_devices(groups):
  """See each group's docstring in tests/sharding_checks.py."""
  _run_checks(*groups)


@pytest.mark.gpu
def test_kernels_split_by_rows_over_several_gpus():
  """tests/sharding_checks.py's ops_mosaic: needs a Hopper machine with 2 or more GPUs."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 or more GPUs")
  _run_checks("ops_mosaic")


# ---------------------------------------------------------------------------------------------
# Jagged batches split by samples


def _jagged(seed, lengths, width=3):
  offsets = pn.jagged.offsets_from_lengths(lengths)
  capacity = len(lengths) * max(max(lengths), 1)
  values = np.random.default_rng(seed).normal(size=(capacity, width)).astype(np.float32)
  values[offsets[-1]:] = 7.0  # padding of the input must not reach the shards
  return values, offsets


@pytest.mark.parametrize("lengths,shards", [([3, 0, 5, 2, 5, 1], 3), ([4, 4], 2),
                                            ([0, 0, 2, 1], 4), ([2, 3, 1], 1)])
def test_split_jagged_blocks_hold_their_samples_with_local_offsets(lengths, shards):
  values, offsets = _jagged(len(lengths), lengths)
  split, local = sharding.split_jagged(values, offsets, shards)
  cap = values.shape[0] // shards
  per = len(lengths) // shards
  assert split.shape == (shards * cap, 3) and local.shape == (shards * (per + 1),)
  assert local.dtype == np.int32
  for s in range(shards):
    block, off = split[s * cap:(s + 1) * cap], local[s * (per + 1):(s + 1) * (per + 1)]
    np.testing.assert_array_equal(off, offsets[s * per:(s + 1) * per + 1] - offsets[s * per])
    rows = slice(offsets[s * per], offsets[(s + 1) * per])
    np.testing.assert_array_equal(block[:off[-1]], values[rows])
    assert not block[off[-1]:].any(), "rows past a shard's samples are zeros"
  joined, joined_offsets = sharding.join_jagged(split, local, shards, values.shape[0])
  np.testing.assert_array_equal(joined_offsets, offsets)
  np.testing.assert_array_equal(joined[:offsets[-1]], values[:offsets[-1]])
  assert not joined[offsets[-1]:].any()


_LOCAL = np.array([0, 3, 3, 0, 5, 7], np.int32)


@pytest.mark.parametrize("fn, arg", [
    (lambda v, o: sharding.split_jagged(v, np.asarray(o), 2), "values"),
    (lambda v, o: sharding.split_jagged(np.ones((10, 2)), jnp.asarray(o) + v[0, 0].astype(int),
                                        2), "offsets"),
    (lambda v, o: sharding.join_jagged(v, _LOCAL, 2), "values"),
    (lambda v, o: sharding.join_jagged(np.ones((10, 2)), jnp.asarray(_LOCAL) +
                                       v[0, 0].astype(int), 2), "local_offsets")],
    ids=["split-values", "split-offsets", "join-values", "join-local_offsets"])
def test_split_and_join_jagged_name_a_traced_argument(fn, arg):
  """Under jax.jit they raised JAX's TracerArrayConversionError about __array__, naming no
  argument (review11): they are host-side helpers of the input pipeline."""
  values, offsets = _jagged(0, [3, 0, 5, 2])
  with pytest.raises(TypeError, match=f"{arg} must be concrete"):
    jax.jit(lambda v: fn(v, offsets)[1])(jnp.asarray(values))


@pytest.mark.parametrize("fn", [lambda o: sharding.split_jagged(np.float32(1.0), o, 2),
                                lambda o: sharding.join_jagged(np.float32(1.0), _LOCAL, 2)],
                         ids=["split", "join"])
def test_split_and_join_jagged_name_0d_values(fn):
  """A 0-d values raised IndexError "tuple index out of range" (review11)."""
  with pytest.raises(ValueError, match="values must"):
    fn(np.asarray(_jagged(0, [3, 0, 5, 2])[1]))


def test_split_and_join_jagged_take_offsets_as_python_lists():
  """A list of Python ints is int32 offsets (NumPy made it int64, and the check then said
  "offsets must be int32, got int64" of a list); ints past int32 raise naming the argument."""
  values, offsets = _jagged(0, [3, 0, 5, 2])
  want = sharding.split_jagged(values, offsets, 2)
  got = sharding.split_jagged(values, [int(o) for o in offsets], 2)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  back = sharding.join_jagged(got[0], [int(o) for o in got[1]], 2)
  for g, w in zip(back, sharding.join_jagged(*want, 2), strict=True):
    np.testing.assert_array_equal(g, w)
  with pytest.raises(TypeError, match="split_jagged: offsets must be int32 offsets"):
    sharding.split_jagged(values, [0, 2**40, 2**40, 2**40, 2**40], 2)


def test_split_jagged_errors_name_the_argument():
  values, offsets = _jagged(0, [3, 0, 5, 2])
  with pytest.raises(ValueError, match="num_shards"):
    sharding.split_jagged(values, offsets, 3)
  with pytest.raises(ValueError, match="shard_capacity: shard 0 holds 3 rows"):
    sharding.split_jagged(values, offsets, 2, shard_capacity=2)
  with pytest.raises(ValueError, match="pass shard_capacity"):
    sharding.split_jagged(values[:-1], offsets, 2)
  with pytest.raises(ValueError, match="offsets must be non-decreasing"):
    sharding.split_jagged(values, np.array([0, 3, 2, 5, 6], np.int32), 2)
  with pytest.raises(TypeError, match="offsets must be int32"):
    sharding.split_jagged(values, offsets.astype(np.float32), 2)
  with pytest.raises(ValueError, match=r"local_offsets \(shard 1\)"):
    sharding.join_jagged(values[:8], np.array([0, 2, 3, 0, 3, 1], np.int32), 2)
  for bad in ("2", 2.0, 0, True):  # "2" and 2.0 failed inside NumPy/Python (review finding)
    with pytest.raises(ValueError, match="num_shards"):
      sharding.join_jagged(values[:8], np.array([0, 2, 3, 0, 3, 1], np.int32), bad)


# ---------------------------------------------------------------------------------------------
# shard_rows


def test_shard_rows_on_one_device_is_the_op():
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (8, 16))
  w = jax.random.normal(kw, (16, 8)) / 4
  mesh = jax.make_mesh((1,), ("data",))
  got = sharding.shard_rows(pn.norm_matmul, mesh)(x, w, norm="layer", return_stats=True)
  want = pn.reference.norm_matmul(x, w, norm="layer", return_stats=True)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
  # eps as a concrete JAX scalar (the ops take it) is a setting, not a replicated operand.
  np.testing.assert_allclose(
      sharding.shard_rows(pn.rms_norm, mesh)(x, eps=jnp.float32(1e-3)),
      pn.reference.rms_norm(x, eps=1e-3), rtol=1e-6)
  with jax.set_mesh(mesh):  # the mesh from the context
    np.testing.assert_allclose(sharding.shard_rows(pn.rms_norm)(x), pn.reference.rms_norm(x),
                               rtol=1e-6)


def test_shard_rows_errors_before_any_device_work():
  x, w = jnp.ones((6, 64)), jnp.ones((64, 64))
  with pytest.raises(ValueError, match="op must be one of"):
    sharding.shard_rows(jnp.matmul, FOUR)
  # A function of a public op's name is not that op: its arguments may split differently.
  with pytest.raises(ValueError, match="op must be one of"):
    sharding.shard_rows(pn.reference.rms_norm, FOUR)
  with pytest.raises(ValueError,
                     match=r"x: its leading axis of 6 rows \(shape \(6, 64\)\) must split"):
    sharding.shard_rows(pn.norm_matmul, FOUR)(x, w)
  with pytest.raises(ValueError, match="'model' is not an axis"):
    sharding.shard_rows(pn.norm_matmul, FOUR, axis="model")(x, w)
  with pytest.raises(ValueError, match="residual: its leading axis"):
    sharding.shard_rows(pn.matmul_norm, FOUR)(jnp.ones((8, 64)), w, residual=jnp.ones((6, 64)))
  with pytest.raises(ValueError, match="mesh: none given"):
    sharding.shard_rows(pn.rms_norm)(x)
  # A 1-D x holds one row's features: splitting it would normalize slices of a row silently.
  with pytest.raises(ValueError, match=r"x: a row argument needs .* \(ndim >= 2\)"):
    sharding.shard_rows(pn.rms_norm, FOUR)(jnp.ones((64,)))


def test_shard_rows_names_the_callers_shapes_and_a_mesh_of_another_type():
  """A residual of other rows than x reached the op per shard, whose error quoted the shards'
  shapes ("residual must have shape (2, 32), got (1, 32)" for x (8, 32) and a residual (4, 32)
  on 4 shards); a mesh that is not one raised AttributeError 'axis_names'."""
  x, r = jnp.ones((8, 32)), jnp.ones((4, 32))
  with pytest.raises(ValueError, match=r"residual: shape \(4, 32\) must have the rows of x "
                                       r"\(8, 32\)"):
    sharding.shard_rows(pn.rms_norm, FOUR)(x, None, r)
  with pytest.raises(ValueError, match=r"residual: shape \(4, 4, 16\) must have the rows"):
    sharding.shard_rows(pn.matmul_norm, FOUR)(x.reshape(4, 2, 32), jnp.ones((32, 16)),
                                              residual=jnp.ones((4, 4, 16)))
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    sharding.shard_rows(pn.rms_norm, "data")(x)


def test_shard_rows_checks_each_shards_local_offsets():
  q = jnp.ones((8, 1, 8))
  kv = jnp.ones((4, 3, 1, 8))
  gdpa = sharding.shard_rows(pn.gdpa, jax.sharding.AbstractMesh((2,), ("data",)))
  good = np.array([0, 1, 3, 0, 2, 4], np.int32)
  with pytest.raises(ValueError, match=r"q_offsets \(shard 1\)\[-1\] = 5 exceeds"):
    gdpa(q, kv, kv, jnp.asarray(good + np.array([0, 0, 0, 0, 1, 1], np.int32)))
  with pytest.raises(ValueError, match=r"a sample of q_offsets \(shard 0\) has 2 rows"):
    gdpa(q, kv, kv, jnp.asarray(good), max_seq_len=1)
  with pytest.raises(ValueError, match="k: leading axis 2 must be the batch B = 4"):
    gdpa(q, kv[:2], kv, jnp.asarray(good))
  with pytest.raises(TypeError, match="q_offsets must be a 1-D int32"):
    gdpa(q, kv, kv, jnp.asarray(good, jnp.float32))
  with pytest.raises(ValueError, match="q_offsets: 2 entries do not split"):
    gdpa(q, kv, kv, jnp.asarray(good[:2]))
  # Packed K/V: each shard's kv_offsets against its own K/V rows (4 here), not q's (8).
  q16, packed = jnp.ones((16, 1, 8)), jnp.ones((8, 1, 8))
  kv_off = np.array([0, 2, 6, 0, 1, 2], np.int32)  # shard 0 ends at 6 > 4
  with pytest.raises(ValueError, match=r"kv_offsets \(shard 0\)"):
    gdpa(q16, packed, packed, jnp.asarray(good), jnp.asarray(kv_off))


def test_join_jagged_names_a_capacity_below_the_shards_rows():
  values = np.arange(16, dtype=np.float32).reshape(8, 2)
  local = np.array([0, 2, 3, 0, 3, 4], np.int32)  # 3 + 4 = 7 rows
  with pytest.raises(ValueError, match="^capacity: the shards hold 7 rows"):
    sharding.join_jagged(values, local, 2, capacity=5)


def test_row_sharded_take_on_one_device_and_bad_ids():
  table = jax.random.normal(jax.random.key(3), (10, 4))
  ids = jnp.array([[0, 9], [3, 3]])
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  take = jax.shard_map(lambda t, i: sharding.row_sharded_take(t, i, "model"), mesh=mesh,
                       in_specs=(P("model"), P("model")), out_specs=P("model"))
  np.testing.assert_array_equal(take(table, ids), jnp.take(table, ids, axis=0))
  # Ids outside [0, V) give zero rows (10 is the first row past this device's block).
  got = np.asarray(take(table, jnp.array([[0, 10], [3, -1]])))
  np.testing.assert_array_equal(got[:, 1], 0.0)
  np.testing.assert_array_equal(got[:, 0], np.asarray(table[jnp.array([0, 3])]))
  with pytest.raises(TypeError, match="ids must have an integer dtype"):
    take(table, ids.astype(jnp.float32))
  # Not arrays (called directly: shard_map would convert them): a TypeError naming the argument,
  # checked before the first attribute access (was an AttributeError).
  with pytest.raises(TypeError, match="^ids must be an array, got list"):
    sharding.row_sharded_take(table, [[0, 9]], "model")
  with pytest.raises(TypeError, match="^table must be an array, got tuple"):
    sharding.row_sharded_take((1.0, 2.0), ids, "model")


def test_sharding_helpers_name_a_mesh_axis_given_twice():
  """An axis named twice surfaced JAX's errors, naming neither argument: DuplicateSpecError
  from shard_rows' PartitionSpec at the call, "repeated axis in `source` argument" from
  row_sharded_take's all_gather."""
  two = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
  with pytest.raises(ValueError, match=r"^axis: mesh axis 'data' appears more than once in "
                                       r"\('data', 'data'\)"):
    sharding.shard_rows(pn.rms_norm, two, axis=("data", "data"))
  with pytest.raises(ValueError, match=r"^axis: mesh axis 'model' .* \['model', 'data', "):
    sharding.shard_rows(pn.norm_matmul, axis=["model", "data", "model"])
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  take = jax.shard_map(lambda t, i: sharding.row_sharded_take(t, i, ("model", "model")),
                       mesh=mesh, in_specs=(P("model"), P("model")), out_specs=P("model"))
  with pytest.raises(ValueError, match=r"^axis_name: mesh axis 'model' appears more than once"):
    take(jnp.ones((4, 2)), jnp.array([1, 3]))


# ---------------------------------------------------------------------------------------------
# The example's flags


@pytest.mark.parametrize("argv,message", [
    (["--devices", "2"], "--devices must be between 1 and the 1 devices"),
    (["--devices", "two"], "--devices must be a number or 'auto'"),
    (["--model-parallel", "2"], "--model-parallel must divide --devices=1"),
])
def test_device_flags_that_cannot_work_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_kunlun.parse_args(argv)
  assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_devices_auto_is_every_device():
  args = train_kunlun.parse_args([])
  assert args.devices == jax.device_count() and args.model_parallel == 1


def test_distributed_script_has_a_cli(capsys):
  """`python examples/distributed.py --help` printed nothing (the module had no CLI): its help
  says what it runs and lists its flags; run alone it prints the layout of its flags (here one
  device) and the train_kunlun.py command, and exits 2 on flags that cannot work."""
  import distributed
  proc = subprocess.run([sys.executable, str(ROOT / "examples" / "distributed.py"), "--help"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and proc.stdout.startswith("usage: distributed.py "), (
      proc.stdout + proc.stderr)
  help_text = " ".join(proc.stdout.split())
  for words in ("--devices", "--model-parallel", "--multi-host", "trains nothing",
                "python examples/train_kunlun.py --devices 8 --model-parallel 2"):
    assert words in help_text, words
  assert distributed.main(["--devices", "1"]) == 0  # this process's one CPU device
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"mesh: data 1 x model 1 = 1 {jax.default_backend()} device, 1 process", out
  assert out[-1] == "train: python examples/train_kunlun.py --devices 1", out
  with pytest.raises(SystemExit) as exit_info:
    distributed.main(["--model-parallel", "2"])
  assert exit_info.value.code == 2
  assert "--model-parallel must divide --devices=1" in capsys.readouterr().err


@pytest.mark.parametrize("x", [np.ones((8, 32)).tolist(), None,
                               jax.ShapeDtypeStruct((8, 32), jnp.float32)],
                         ids=["list", "None", "ShapeDtypeStruct"])
@pytest.mark.parametrize("op", ["rms_norm", "matmul_norm"])
def test_shard_rows_names_a_non_array_x_next_to_a_residual(op, x):
  """A residual's rows were compared with x's shape before x was known to be an array: a list,
  None or a ShapeDtypeStruct x with a residual raised AttributeError 'NoneType' ... 'shape'
  instead of the op's TypeError naming x (raised as without a residual)."""
  args = (x, jnp.ones((32, 16))) if op == "matmul_norm" else (x,)
  residual = jnp.ones((8, 16 if op == "matmul_norm" else 32))
  with pytest.raises(TypeError, match="^x must be an array"):
    sharding.shard_rows(getattr(pn, op), FOUR)(*args, residual=residual)


def test_shard_rows_names_the_op_for_arguments_that_do_not_bind():
  """Arguments that do not bind to the op's signature raised inspect's bare "too many
  positional arguments", naming no op."""
  x, w = jnp.ones((8, 32)), jnp.ones((32, 16))
  with pytest.raises(TypeError, match=r"^shard_rows\(matmul_norm\): too many positional"):
    sharding.shard_rows(pn.matmul_norm, FOUR)(x, w, w)
  with pytest.raises(TypeError, match=r"^shard_rows\(rms_norm\): got an unexpected keyword "
                                      "argument 'bias'"):
    sharding.shard_rows(pn.rms_norm, FOUR)(x, bias=jnp.ones(32))


def test_shard_rows_checks_each_calls_settings_after_an_equal_valid_one():
  """The program cache of a shard_rows function keys each setting with its type: True == 1
  (same hash), so without the type a zero_centered_scale=1 call after a True one reused the
  traced program and skipped the op's TypeError (a mutation test dropped the type
  unnoticed). The valid call matches the reference."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 16)), jnp.float32)
  scale = jnp.asarray(np.random.default_rng(6).standard_normal(16), jnp.float32)
  f = sharding.shard_rows(pn.rms_norm, jax.make_mesh((1,), ("data",)))
  np.testing.assert_allclose(f(x, scale, zero_centered_scale=True),
                             pn.reference.rms_norm(x, scale, zero_centered_scale=True),
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(TypeError, match="^zero_centered_scale must be a bool, got 1"):
    f(x, scale, zero_centered_scale=1)
