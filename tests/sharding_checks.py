"""Checks on 8 CPU devices, run by tests/test_sharding.py in a subprocess of their own.

``python tests/sharding_checks.py GROUP`` sets ``--xla_force_host_platform_device_count=8``
before JAX starts (the pytest process has one CPU device and must keep it), runs the checks of
GROUP (:data:`GROUPS`), and exits 0 only if all pass; an assertion's message says what differed.
Not a pytest module (no ``test_`` prefix): pytest collects only its wrapper.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

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

  f_sharded = run(sharded_op, local)
  y, vjp = jax.jit(lambda *a: jax.vjp(f_sharded, *a))(*(local[k] for k in names))
  f_ref = run(ref_op or getattr(pn.reference, op.__name__), args)
  y_ref, vjp_ref = jax.vjp(f_ref, *(args[k] for k in names))
  dy_ref = jax.tree.map(lambda t: _normal(jax.random.key(7), t.shape, t.dtype), y_ref)
  if jagged is not None:
    dy = jax.tree.map(lambda t: jnp.asarray(split("q", np.asarray(t))), dy_ref)
    join = lambda t: sharding.join_jagged(np.asarray(t), local["q_offsets"], num_shards,
                                          jagged[1])[0]
  else:
    dy, join = dy_ref, np.asarray
  for got, want in zip(jax.tree.leaves(y), jax.tree.leaves(y_ref), strict=True):
    _close(join(got), want, rtol, atol, f"{op.__name__} forward")
  grads = jax.jit(lambda d: vjp(d))(dy)
  for name, got, want in zip(names, grads, vjp_ref(dy_ref), strict=True):
    if jagged is not None and name == "q":
      got = join(got)
    _close(got, want, rtol, atol, f"{op.__name__} d{name}")
  hlo = jax.jit(lambda *a: jax.vjp(f_sharded, *a)[1](dy)).lower(
      *(local[k] for k in names)).compile().as_text()
  assert "all-gather" not in hlo, f"{op.__name__}: the sharded program gathers an operand"


def ops_xla():
  """Every op split by rows over 4 devices (explicit and auto meshes, one over two axes) equals
  the unsharded op, forward and gradients of every float input, with no all-gather."""
  keys = iter(jax.random.split(jax.random.key(0), 32))
  m, k, n = 32, 16, 24
  x, res_n, res_k = (_normal(next(keys), s) for s in ((m, k), (m, n), (m, k)))
  w = _normal(next(keys), (k, n), scale=k ** -0.5)
  gk, bk, gn, bn = (1 + _normal(next(keys), (d,), scale=0.1) for d in (k, k, n, n))
  tol = dict(rtol=2e-5, atol=2e-5)
  explicit, auto = _mesh((4,), ("data",), EXPLICIT), _mesh((4,), ("data",))
  _compare_op(pn.rms_norm, dict(x=x, scale=gk, residual=res_k), {}, explicit, **tol)
  _compare_op(pn.layer_norm, dict(x=x, scale=gk, bias=bk, residual=None), {}, auto, **tol)
  _compare_op(pn.norm_matmul, dict(x=x, w=w, scale=gk, bias=bk), dict(norm="layer"),
              explicit, **tol)
  two_axes = _mesh((2, 2), ("data", "model"))
  _compare_op(pn.matmul_norm, dict(x=x, w=w, dense_bias=bn, residual=res_n, scale=gn, bias=bn),
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


GROUPS = {"ops_xla": ops_xla}


def main(argv) -> int:
  for group in argv or list(GROUPS):
    GROUPS[group]()
    print(f"{group}: ok", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
