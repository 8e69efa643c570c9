"""Checks on 8 CPU devices (or several GPUs), run by tests/test_sharding.py in a subprocess.

``python tests/sharding_checks.py GROUP`` sets ``--xla_force_host_platform_device_count=8``
and the CPU platform before JAX starts (the pytest process has one CPU device and must keep
it), except for the GPU groups (:data:`ON_GPUS`), runs the checks of GROUP (:data:`GROUPS`),
and exits 0 only if all pass; an assertion's message says what differed.
Not a pytest module (no ``test_`` prefix): pytest collects only its wrapper.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import warnings

ON_GPUS = ("ops_mosaic",)
"""The groups that run on the machine's GPUs; every other one on 8 CPU devices, also where a
GPU is present."""
if not set(sys.argv[1:]) & set(ON_GPUS):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  os.environ.setdefault("PJRT_NPROC", "8")  # interpret-mode kernels (see tests/conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_norm as pn  # noqa: E402
from pallas_norm import sharding  # noqa: E402

EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto


def _mesh(shape, names, axis_type=AUTO):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                       devices=jax.devices()[:int(np.prod(shape))])


def _normal(key, shape, dtype=jnp.float32, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _close(got, want, rtol, atol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def _float_args(args):
  return [k for k, v in args.items() if v is not None and jnp.issubdtype(v.dtype, jnp.floating)]


def _jit_vjp(f):
  """``(primals, ct) -> (f(*primals), f's VJP at ct)`` as one jitted program: run eagerly, each
  op of a reference compiles on its own (a quarter of the ops_xla group's CPU time)."""
  def forward_backward(primals, ct):
    y, vjp = jax.vjp(f, *primals)
    return y, vjp(ct)
  return jax.jit(forward_backward)


def _compare_op(op, args, static, mesh, *, axis="data", jagged=None, rtol, atol, ref_op=None):
  """The sharded op's forward and VJP (every float argument) under jit, inputs placed by rows,
  against the unsharded ``ref_op`` (default: the op of :mod:`pallas_norm.reference`) in f32.
  ``jagged``: (offsets of the unsharded batch, its capacity) to join the sharded rows back."""
  sharded_op = sharding.shard_rows(op, mesh, axis)
  names = _float_args(args)
  num_shards = int(np.prod([mesh.shape[a] for a in sharding._axis_names(axis)]))

  def split(name, value):
    if jagged is not None and name in ("q",):
      return sharding.split_jagged(value, jagged[0], num_shards)[0]
    if jagged is not None and name == "q_offsets":
      return sharding.split_jagged(args["q"], jagged[0], num_shards)[1]
    return value

  local = {k: (None if v is None else jnp.asarray(split(k, np.asarray(v))))
           for k, v in args.items()}
  row_args = sharding.ROW_ARGS[op.__name__]
  local = {k: (v if v is None or k not in row_args else jax.device_put(
      v, NamedSharding(mesh, P(axis)))) for k, v in local.items()}

  def run(fn, inputs):
    def f(*floats):
      return fn(**dict(inputs, **dict(zip(names, floats))), **static)
    return f

  f_ref = run(ref_op or getattr(pn.reference, op.__name__), args)
  ref_floats = [args[k] for k in names]
  dy_ref = jax.tree.map(lambda t: _normal(jax.random.key(7), t.shape, t.dtype),
                        jax.eval_shape(f_ref, *ref_floats))
  y_ref, ref_grads = _jit_vjp(f_ref)(ref_floats, dy_ref)
  if jagged is not None:
    dy = jax.tree.map(lambda t: jnp.asarray(split("q", np.asarray(t))), dy_ref)
    join = lambda t: sharding.join_jagged(np.asarray(t), local["q_offsets"], num_shards,
                                          jagged[1])[0]
  else:
    dy, join = dy_ref, np.asarray

  # One compiled program: its results are checked and its HLO searched for gathers.
  compiled = _jit_vjp(run(sharded_op, local)).lower([local[k] for k in names], dy).compile()
  assert "all-gather" not in compiled.as_text(), f"{op.__name__}: the program gathers"
  y, grads = compiled([local[k] for k in names], dy)
  for got, want in zip(jax.tree.leaves(y), jax.tree.leaves(y_ref), strict=True):
    _close(join(got), want, rtol, atol, f"{op.__name__} forward")
  for name, got, want in zip(names, grads, ref_grads, strict=True):
    if jagged is not None and name == "q":
      got = join(got)
    _close(got, want, rtol, atol, f"{op.__name__} d{name}")


def ops_xla():
  """Every op split by rows over 4 devices (explicit and auto meshes, one over two axes) equals
  the f32 reference: forward (returned statistics and h included) and the gradients of every
  float input (the shared parameters' summed over the shards), with no all-gather."""
  keys = iter(jax.random.split(jax.random.key(0), 32))
  m, k, n = 32, 16, 24
  x, res_n, res_k = (_normal(next(keys), s) for s in ((m, k), (m, n), (m, k)))
  w = _normal(next(keys), (k, n), scale=k ** -0.5)
  gk, bk, gn, bn = (1 + _normal(next(keys), (d,), scale=0.1) for d in (k, k, n, n))
  tol = dict(rtol=2e-5, atol=2e-5)
  explicit, auto = _mesh((4,), ("data",), EXPLICIT), _mesh((4,), ("data",))
  _compare_op(pn.rms_norm, dict(x=x, scale=gk, residual=res_k), {}, explicit, **tol)
  _compare_op(pn.layer_norm, dict(x=x, scale=gk, bias=bk, residual=None), {}, auto, **tol)
  # The op's returned statistics carry no gradient (the reference's do): the unsharded op
  # (XLA on the CPU) is the oracle for this case.
  _compare_op(pn.norm_matmul, dict(x=x, w=w, scale=gk, norm_bias=bk),
              dict(norm="layer", return_stats=True), explicit, **tol, ref_op=pn.norm_matmul)
  two_axes = _mesh((2, 2), ("data", "model"))
  _compare_op(pn.matmul_norm, dict(x=x, w=w, dense_bias=bn, residual=res_n, scale=gn, norm_bias=bn),
              dict(norm="layer", return_h=True), two_axes, axis=("data", "model"), **tol)
  # Jagged: 8 samples (one empty, one full) over 4 shards of 2 samples.
  lengths = np.array([3, 0, 6, 1, 2, 6, 5, 4])
  offsets = pn.jagged.offsets_from_lengths(lengths)
  h, d, lkv, max_len = 2, 8, 5, 6
  cap = lengths.size * max_len
  q = np.asarray(_normal(next(keys), (cap, h, d)))
  kk, vv = (_normal(next(keys), (lengths.size, lkv, h, d), scale=0.5) for _ in range(2))
  args = dict(q=q, k=kk, v=vv, q_offsets=offsets)
  _compare_op(pn.gdpa, args, dict(max_seq_len=max_len, activation="silu"), explicit,
              jagged=(offsets, cap), **tol)
  ln_g, ln_b, rms_g = (1 + _normal(next(keys), (h * d,), scale=0.1) for _ in range(3))
  _compare_op(pn.flash_norm_attention, dict(args, ln_scale=ln_g, ln_bias=ln_b, rms_scale=rms_g),
              dict(max_seq_len=max_len), auto, jagged=(offsets, cap), **tol)
  _eager_gradients()


def _eager_gradients():
  """Outside jax.jit: jax.vjp with a cotangent that is not split by rows (it failed inside
  JAX's eager shard_map transpose, "in_specs ... does not match", before shard_rows ran its
  shard_map under a jit) and jax.grad equal the reference's. With an explicit mesh the
  loss's own sum needs jax.set_mesh outside jit, as any explicitly sharded array does."""
  keys = iter(jax.random.split(jax.random.key(5), 4))
  x, w = _normal(next(keys), (8, 16)), _normal(next(keys), (16, 8), scale=0.25)
  ct = _normal(next(keys), (8, 8))
  want_y, want = _jit_vjp(lambda x, w: pn.reference.norm_matmul(x, w))([x, w], ct)
  for mesh in (_mesh((4,), ("data",), EXPLICIT), _mesh((4,), ("data",))):
    f = sharding.shard_rows(pn.norm_matmul, mesh)
    y, vjp = jax.vjp(f, x, w)
    _close(y, want_y, 2e-5, 2e-5, "eager shard_rows forward")
    for name, got, ref in zip("xw", vjp(ct), want, strict=True):
      _close(got, ref, 2e-5, 2e-5, f"eager shard_rows vjp d{name}")
    with jax.set_mesh(mesh):
      got = jax.grad(lambda w: jnp.sum(f(x, w) * ct))(w)
    _close(got, want[1], 2e-5, 2e-5, "eager shard_rows grad dw")
  got = jax.grad(lambda w: jnp.sum(f(x, w) * ct))(w)  # the auto mesh needs no set_mesh
  _close(got, want[1], 2e-5, 2e-5, "eager shard_rows grad dw (auto mesh, no set_mesh)")


def _allow_interpret_on_several_devices():
  """Works around jax 0.11.2's GPU interpreter under a multi-device ``shard_map``: at the end of
  each device's kernel it asserts that no barrier of *any* device is still allocated
  (``call_assert_no_barriers_allocated`` in ``interpret_pallas_call.py`` runs before the
  cross-device clean-up barrier), so a device that finishes first trips on the live barriers of
  one still running. Each barrier's own checks at its deallocation still run."""
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  shared_memory.GPUSharedMemory.assert_no_barriers_allocated = lambda self: None


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _kernel_vs_reference(op, mesh, implementation, x, rest, static, seed):
  """``op(x, *rest, **static)`` split by rows over ``mesh``'s "data" axis with a kernel
  implementation, forward and VJP of every float input under one jit: y and every gradient
  within bf16 tolerance of the unsharded f32 reference (relative Frobenius: y 1e-2, gradients
  2e-2, as tests/test_norm_matmul_vjp.py), every output written (finite), and no all-gather
  in the compiled program."""
  sharded = sharding.shard_rows(op, mesh)
  names = list(rest)  # the arguments after x are keyword-only in the ops
  rest = tuple(rest.values())
  ref_op = getattr(pn.reference, op.__name__)
  f = lambda x, *a: sharded(x, **dict(zip(names, a)), **static, implementation=implementation)
  ref = lambda x, *a: ref_op(x, **dict(zip(names, a)), **static)
  y_shape = jax.eval_shape(ref, x, *rest)
  ct = _normal(jax.random.key(seed), y_shape.shape, x.dtype)
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  compiled = jax.jit(lambda *a: (lambda y, vjp: (y, vjp(ct)))(*jax.vjp(f, *a))).lower(
      xs, *rest).compile()
  assert "all-gather" not in compiled.as_text(), f"{op.__name__}: the program gathers"
  y, grads = compiled(xs, *rest)
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
  y_ref, vjp_ref = jax.vjp(ref, f32(x), *map(f32, rest))
  name = op.__name__
  assert y.dtype == x.dtype and bool(jnp.all(jnp.isfinite(y))), f"{name}: unwritten outputs"
  assert _rel(y, y_ref) < 1e-2, (name, "y", _rel(y, y_ref))
  for i, (g, r) in enumerate(zip(grads, vjp_ref(f32(ct)), strict=True)):
    if r is None:
      continue
    assert bool(jnp.all(jnp.isfinite(g))), (name, f"gradient of input {i}")
    assert _rel(g, r) < 2e-2, (name, f"gradient of input {i}", _rel(g, r))


def _prenorm_inputs(m, k, n, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = _normal(keys[0], (m, k), jnp.bfloat16)
  w = _normal(keys[1], (k, n), jnp.bfloat16, scale=k ** -0.5)
  scale, bias = 1 + _normal(keys[2], (k,), scale=0.1), _normal(keys[3], (k,), scale=0.1)
  return x, dict(w=w, scale=scale, norm_bias=bias)


def ops_interpret():
  """The pre-norm kernels (forward and dx) and the post-norm ones (forward and norm backward)
  in GPU interpret mode on 2 CPU devices of 64 rows each (:func:`_kernel_vs_reference`), with
  no all-gather; a plain jit of the kernel on the same sharded rows gathers them. Without the
  workaround, shard_rows refuses the interpreter on several devices before anything runs (it
  failed inside jax with an opaque INTERNAL error)."""
  mesh = _mesh((2,), ("data",))
  x, rest = _prenorm_inputs(128, 64, 64, 1)
  try:
    sharding.shard_rows(pn.norm_matmul, mesh)(x, **rest, implementation="interpret")
  except NotImplementedError as e:
    assert "interpret" in str(e) and "2 devices" in str(e), e
  else:
    raise AssertionError("expected NotImplementedError for 'interpret' on 2 devices")
  # A sequence is not refused: where the kernel cannot take the call (float32 x), XLA runs it.
  xf, restf = x.astype(jnp.float32), {k: v.astype(jnp.float32) for k, v in rest.items()}
  got = sharding.shard_rows(pn.norm_matmul, mesh)(xf, **restf,
                                                   implementation=("interpret", "xla"))
  _close(got, pn.reference.norm_matmul(xf, **restf), 1e-5, 1e-5, "('interpret', 'xla'), f32")
  # Where the kernel would take the call, the sequence skips the interpreter with a warning and
  # runs XLA (it ran the interpreter, which failed inside jax on 4 devices: a review's repro).
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = sharding.shard_rows(pn.norm_matmul, mesh)(x, **rest,
                                                     implementation=("interpret", "xla"))
  assert any(issubclass(w.category, pn.KernelSkippedWarning) and "2 devices" in str(w.message)
             for w in caught), [str(w.message) for w in caught]
  _close(got, pn.norm_matmul(x, **rest, implementation="xla"), 1e-2, 1e-2,
         "('interpret', 'xla'), bf16")
  _allow_interpret_on_several_devices()
  # Without shard_rows, XLA's partitioner gathers the sharded rows to call the kernel.
  plain = jax.jit(lambda x, r: pn.norm_matmul(x, **r, implementation="interpret")).lower(
      jax.device_put(x, NamedSharding(mesh, P("data"))), rest).compile()
  assert "all-gather" in plain.as_text(), "expected the plain jit to gather x"
  _kernel_vs_reference(pn.norm_matmul, mesh, "interpret", x, rest, dict(norm="layer"), 5)
  post = _prenorm_inputs(128, 64, 64, 6)[1]  # post-norm: K = N here
  residual = _normal(jax.random.key(7), (128, 64), jnp.bfloat16)
  _kernel_vs_reference(pn.matmul_norm, mesh, "interpret", x,
                       dict(w=post["w"], residual=residual, scale=post["scale"],
                            norm_bias=post["norm_bias"]),
                       dict(norm="layer"), 8)


def ops_mosaic():
  """On every GPU of a Hopper machine with 2 or more (not CPU devices): the pre-norm and the
  post-norm Mosaic kernels, forward and backward, split by rows over all GPUs
  (:func:`_kernel_vs_reference`), at 2048 rows per GPU."""
  gpus = jax.devices()
  assert len(gpus) >= 2 and gpus[0].platform == "gpu", f"needs 2 or more GPUs, got {gpus}"
  mesh = jax.make_mesh((len(gpus),), ("data",), axis_types=(AUTO,))
  m = 2048 * len(gpus)
  for norm in ("layer", "rms"):
    x, rest = _prenorm_inputs(m, 512, 512, 2)
    _kernel_vs_reference(pn.norm_matmul, mesh, "mosaic", x, rest, dict(norm=norm), 3)
    w, scale, bias = _prenorm_inputs(m, 512, 1024, 4)[1]["w"], *(
        1 + _normal(jax.random.key(i), (1024,), scale=0.1) for i in (5, 6))
    residual = _normal(jax.random.key(7), (m, 1024), jnp.bfloat16)
    _kernel_vs_reference(pn.matmul_norm, mesh, "mosaic", x,
                         dict(w=w, residual=residual, scale=scale, norm_bias=bias),
                         dict(norm=norm), 8)


def embedding():
  """row_sharded_take over a (data 2, model 4) mesh, ids split over both axes: equal to
  jnp.take of the whole table bit for bit, and its table gradient (summed over "data" by
  shard_map) equal to the unsharded one, with and without shard_map's type check."""
  keys = jax.random.split(jax.random.key(2), 3)
  table = _normal(keys[0], (64, 8))
  ids = jax.random.randint(keys[1], (16, 3), 0, 64)
  ct = _normal(keys[2], (16, 3, 8))
  mesh = _mesh((2, 4), ("data", "model"))
  want = jnp.take(table, ids, axis=0)
  want_grad = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * ct))(table)
  for check_vma in (True, False):
    lookup = jax.shard_map(lambda t, i: sharding.row_sharded_take(t, i, "model"), mesh=mesh,
                           in_specs=(P("model", None), P(("data", "model"))),
                           out_specs=P(("data", "model")), check_vma=check_vma)
    got = jax.jit(lookup)(table, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(check_vma))
    grad = jax.jit(jax.grad(lambda t: jnp.sum(lookup(t, ids) * ct)))(table)
    _close(grad, want_grad, 1e-6, 1e-6, f"table gradient, check_vma={check_vma}")


def _leaves(state):
  from flax import nnx
  return jax.tree.leaves(nnx.to_pure_dict(state))


def _train(argv):
  import train_kunlun
  return train_kunlun.train(train_kunlun.parse_args(argv))


def _one_device_steps(argv, steps):
  """(losses, state) of ``steps`` steps of the script's own single-device ``train_step`` on the
  batches that ``train_kunlun.train(parse_args(argv))`` trains on."""
  import ads_data
  import train_kunlun
  from flax import nnx
  args = train_kunlun.parse_args(argv + ["--devices", "1"])
  train_ds, _, spec = ads_data.load(args.data, args.data_dir, max_seq_len=args.max_seq_len,
                                    seed=args.seed, num_train=args.train_examples)
  _, model, optimizer = train_kunlun.build(args, spec)
  graphdef, state = nnx.split((model, optimizer))
  state = jax.device_put(state, jax.devices()[0])
  batches = ads_data.train_batches(train_ds, args.batch_size, args.max_seq_len, args.seed)
  losses = []
  for _ in range(steps):
    state, loss = train_kunlun.train_step(graphdef, state, next(batches))
    losses.append(float(loss))
  return losses, state


def training():
  """examples/train_kunlun.py on a (data 4, model 2) mesh equals one device over 3 steps
  (float32: losses, every parameter and optimizer moment); its sharded checkpoint restores bit
  for bit into the same, another (data 8) and a one-device layout, the tables split by rows
  where the layout says so; --resume continues to where an uninterrupted sharded run lands."""
  import distributed
  import train_kunlun
  from flax import nnx
  # Evaluations on one batch of the validation set (its 2048 examples took 128 predict calls
  # per evaluation, a third of the group's CPU time; the metrics are not checked here). The
  # narrow model of tests/test_training.py (token width 8, heads of 4): the same layers and
  # shardings, 48.7 -> 45.6 user CPU-s for the group.
  # 8192 training examples: the tolerances below were measured on these batches.
  common = ["--batch-size", "16", "--max-seq-len", "8", "--dtype", "float32",
            "--implementation", "xla", "--valid-examples", "16", "--embed-dim", "8",
            "--head-dim", "4", "--train-examples", "8192"]
  with tempfile.TemporaryDirectory() as tmp:
    where = ["--devices", "8", "--model-parallel", "2", "--checkpoint-dir", tmp]
    eight = _train(common + where + ["--steps", "3", "--eval-every", "3"])
    one_losses, one_state = _one_device_steps(common, 3)
    np.testing.assert_allclose(eight.losses, one_losses, rtol=2e-6)
    # Reduction order differs (per-shard sums, then across shards) and AdamW divides by the
    # gradients' size, so entries with tiny gradients move most: measured ≤ 6e-5 of a leaf's
    # largest entry.
    for a, b in zip(_leaves(eight.state), _leaves(one_state), strict=True):
      top = float(np.max(np.abs(np.asarray(b))))
      _close(a, b, 0, 2e-4 * top, "state after 3 steps, relative to the leaf's largest entry")
    table = eight.state[0]["sparse_embed"]["embedding"][...]
    assert table.sharding.is_equivalent_to(
        NamedSharding(table.sharding.mesh, P("model", None)), 2), table.sharding
    # The checkpoint of step 3 into three layouts.
    args = train_kunlun.parse_args(common + where + ["--steps", "3"])
    spec = train_kunlun.ads_data.load("synthetic", max_seq_len=8, seed=0)[2]
    manager = train_kunlun.checkpoint_manager(pathlib.Path(tmp))
    for devices, model_parallel in ((8, 2), (8, 1), (1, 1)):
      args.devices, args.model_parallel = devices, model_parallel
      config, model, optimizer = train_kunlun.build(args, spec)
      runner = distributed.make_runner(args, loss_fn=train_kunlun.loss_fn,
                                       train_step=train_kunlun.train_step,
                                       predict=train_kunlun.predict)
      fresh = runner.place_state(nnx.state((model, optimizer)))
      back = train_kunlun.restore_checkpoint(manager, fresh, config)
      for a, b, f in zip(_leaves(back), _leaves(eight.state), _leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(f.sharding, a.ndim), (a.sharding, f.sharding)
    manager.close()
    resumed = _train(common + where + ["--steps", "5", "--eval-every", "5", "--resume"])
    assert len(resumed.losses) == 2, resumed.losses
  straight = _train(common + ["--devices", "8", "--model-parallel", "2", "--steps", "5",
                              "--eval-every", "5"])
  np.testing.assert_allclose(resumed.losses, straight.losses[3:], rtol=1e-6)
  for a, b in zip(_leaves(resumed.state), _leaves(straight.state), strict=True):
    _close(a, b, 1e-6, 1e-7, "resumed state")


def distributed_checks():
  """examples/distributed.py's own checks on 8 devices (a mutation test removed each unnoticed):
  --batch-size must split over --devices (exit 2), make_mesh(8, 2) is (data 4, model 2), and a
  table whose rows do not split over "model" raises ValueError."""
  import types
  import distributed
  import train_kunlun
  try:
    train_kunlun.parse_args(["--devices", "8", "--batch-size", "12"])
  except SystemExit as e:
    assert e.code == 2, e.code
  else:
    raise AssertionError("--batch-size 12 over 8 devices was accepted")
  mesh = distributed.make_mesh(8, 2)
  assert dict(mesh.shape) == {"data": 4, "model": 2}, dict(mesh.shape)
  runner = distributed.MeshRunner(mesh, loss_fn=None)
  model = types.SimpleNamespace(**{t: types.SimpleNamespace(num_embeddings=4097)
                                   for t in distributed.TABLES})
  try:
    runner.adapt(model)
  except ValueError:
    pass
  else:
    raise AssertionError("a table of 4097 rows over model-parallel 2 was accepted")


def layouts():
  """Inputs and layouts a user of several devices meets first: shard_rows on arrays committed
  to one device (a previous program's outputs) equals the reference, on auto and explicit
  meshes, given or set by jax.set_mesh (it raised JAX's "incompatible devices", naming another
  argument, where its docstring says such arrays are resharded); train_kunlun with a
  --model-parallel that does not split the embedding tables' rows exits 2 with one line (it was
  a ValueError traceback)."""
  import contextlib
  import io
  import train_kunlun
  keys = jax.random.split(jax.random.key(11), 3)
  x, w = _normal(keys[0], (16, 32)), _normal(keys[1], (32, 8), scale=0.2)
  scale = 1 + _normal(keys[2], (32,), scale=0.1)
  want = pn.reference.norm_matmul(x, w, scale=scale)
  for axis_type in (AUTO, EXPLICIT):
    mesh = _mesh((8,), ("data",), axis_type)
    f = sharding.shard_rows(pn.norm_matmul, mesh)
    for device in (0, 3):
      on_one = jax.device_put(x, jax.devices()[device])
      got = f(on_one, jax.device_put(w, jax.devices()[device]), scale=scale)
      _close(got, want, 2e-5, 2e-5, f"x and w committed to device {device}, {axis_type}")
    with jax.set_mesh(mesh):  # mesh=None: the mesh of jax.set_mesh
      got = sharding.shard_rows(pn.norm_matmul)(jax.device_put(x, jax.devices()[2]), w,
                                                scale=scale)
      _close(got, want, 2e-5, 2e-5, f"x committed to device 2, set_mesh, {axis_type}")
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    status = train_kunlun.main(
        ["--devices", "3", "--model-parallel", "3", "--batch-size", "6", "--steps", "1",
         "--max-seq-len", "4", "--embed-dim", "8", "--head-dim", "4", "--train-examples", "64",
         "--valid-examples", "6", "--implementation", "xla"])
  lines = [line for line in stderr.getvalue().splitlines() if "error" in line]
  assert status == 2 and len(lines) == 1 and "--model-parallel 3" in lines[0], (
      status, stderr.getvalue()[-2000:])


def explicit_model():
  """KunlunModel on a (data 4, model 2) mesh of Explicit axes, the batch split over "data" and
  the embedding tables by rows over "model", equals one device: the logits (split like the
  batch) and the parameters' gradient, under jax.set_mesh and without it (the mesh known only
  from the placed parameters). nnx.Embed's gather raised JAX's ShardingTypeError "Use
  `.at[...].get(out_sharding=)`" in both."""
  from flax import nnx
  from flax_layers import KunlunConfig, KunlunModel
  from pallas_norm import jagged
  config = KunlunConfig(num_sparse_features=3, num_dense_features=2, sparse_vocab_size=64,
                        item_vocab_size=64, embed_dim=8, num_heads=2, head_dim=4, kv_len=4,
                        num_layers=1, max_seq_len=4, num_seeds=2, summary_dim=16, mlp_dim=16,
                        num_mlp_layers=1)
  lengths = np.array([1, 0, 4, 2, 3, 1, 4, 2])  # B = 8, 17 tokens in a capacity of 24
  rng = np.random.default_rng(5)
  inputs = (rng.integers(0, 1000, (8, 3), np.int32), rng.normal(size=(8, 2)).astype(np.float32),
            rng.integers(0, 1000, 24).astype(np.int32), jagged.offsets_from_lengths(lengths))
  ct = rng.normal(size=8).astype(np.float32)
  graphdef, state = nnx.split(KunlunModel(config, rngs=nnx.Rngs(0), implementation="xla"))

  @jax.jit
  def logits_and_grad(state, *inputs):
    y, vjp = jax.vjp(lambda state: nnx.merge(graphdef, state)(*inputs), state)
    return y, vjp(ct)[0]

  want, want_grad = logits_and_grad(state, *inputs)
  mesh = _mesh((4, 2), ("data", "model"), EXPLICIT)
  tables = jax.tree_util.tree_map_with_path(
      lambda path, leaf: P("model", None) if "embed']['embedding" in jax.tree_util.keystr(path)
      and leaf.shape[0] % 2 == 0 else P(), state)
  placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), tables))
  assert placed["sparse_embed"]["embedding"][...].sharding.spec == P("model", None)
  split_inputs = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in inputs[:3]]
  with jax.set_mesh(mesh):
    with_set_mesh = logits_and_grad(placed, *split_inputs, inputs[3])
  assert with_set_mesh[0].sharding.spec == P("data"), with_set_mesh[0].sharding
  for (got, got_grad), what in ((with_set_mesh, "under jax.set_mesh"),
                                (logits_and_grad(placed, *inputs), "parameters placed only")):
    _close(got, want, 1e-5, 1e-6, f"logits, {what}")
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
      top = float(np.max(np.abs(np.asarray(b))))
      _close(a, b, 0, 1e-5 * top, f"gradient {what}, relative to the leaf's largest entry")

GROUPS = {"training": training, "ops_mosaic": ops_mosaic, "ops_xla": ops_xla,
          "ops_interpret": ops_interpret, "embedding": embedding,
          "distributed": distributed_checks,
          "layouts": layouts, "explicit_model": explicit_model}


def main(argv) -> int:
  for group in argv or list(GROUPS):
    GROUPS[group]()
    print(f"{group}: ok", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
