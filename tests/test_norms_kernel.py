"""layer_norm and rms_norm with the Pallas backward kernel (pallas_norm/ops/norms/triton.py).

CPU tests run the kernel with ``implementation="interpret"`` (Pallas interpret mode, which fills
every output it does not write with NaN: an element the kernel skips fails the finiteness and
value checks) against the float32 reference differentiated by JAX (``jax.vjp`` of
``pallas_norm.reference``) and, for rows with a large mean, a float64 NumPy closed form. Shapes
are tiny and cover N not a power of two, rows that do not fill the last row block, several
programs, leading batch dimensions. GPU tests (``gpu``) run the Triton-lowered kernel at real
sizes.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import reference
from pallas_norm.ops.norms import api as norms_api
from pallas_norm.ops.norms import routing as norms_routing
from pallas_norm.ops.norms import triton as row_norm_pallas
from _numpy_oracle import seed_of

F32_TOL = 2e-5  # float32 kernel vs float32 autodiff: only the summation order differs
BF16_TOL = 1e-2  # 16-bit outputs and gradients (rounding 2^-9) vs the float32 reference


def _inputs(seed, shape, dtype, *, scale, bias, residual, mean=0.0):
  keys = jax.random.split(jax.random.key(seed), 6)
  n = shape[-1]
  x = (mean + jax.random.normal(keys[0], shape, jnp.float32)).astype(dtype)
  vecs = dict(
      scale=(1 + 0.2 * jax.random.normal(keys[1], (n,))) if scale else None,
      bias=0.1 * jax.random.normal(keys[2], (n,)) if bias else None,
      residual=jax.random.normal(keys[3], shape, jnp.float32).astype(dtype) if residual else None)
  dy = jax.random.normal(keys[4], shape, jnp.float32)
  ds = jax.random.normal(keys[5], shape, jnp.float32) if residual else None
  return x, vecs, dy, ds


def _op(impl, eps, zero_centered_scale, out_dtype=None, norm="layer"):
  """The op as f(x, scale, bias, residual); RMSNorm ignores bias (pass None)."""
  def f(x, scale, bias, residual):
    kw = dict(eps=eps, zero_centered_scale=zero_centered_scale, out_dtype=out_dtype)
    if norm == "rms":
      assert bias is None
      fn = reference.rms_norm if impl == "reference" else functools.partial(
          pallas_norm.rms_norm, implementation=impl)
      return fn(x, scale, residual, **kw)
    if impl == "reference":
      return reference.layer_norm(x, scale, bias, residual, **kw)
    return pallas_norm.layer_norm(x, scale, bias, residual, implementation=impl, **kw)
  return f


def _outputs_and_grads(f, x, vecs, dy, ds):
  """(outputs, grads of (x, scale, bias, residual)) under jit; cotangents cast to the outputs'
  dtypes."""
  @jax.jit
  def run(x, scale, bias, residual, dy, ds):
    out, vjp = jax.vjp(f, x, scale, bias, residual)
    ct = dy.astype(out.dtype) if ds is None else (dy.astype(out[0].dtype), ds.astype(out[1].dtype))
    return out, vjp(ct)
  return run(x, vecs["scale"], vecs["bias"], vecs["residual"], dy, ds)


def _upcast(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def _assert_close(got, want, tol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), f"{what}: non-finite values (an unwritten output?)"
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


CASES = [
    # shape, dtype, scale, bias, residual, zero_centered, out_dtype, norm
    ((3, 13, 100), jnp.float32, True, True, True, False, None, "layer"),
    ((37, 64), jnp.bfloat16, True, False, True, True, None, "layer"),
    ((20, 256), jnp.bfloat16, False, False, False, False, jnp.float32, "layer"),
    ((5, 33), jnp.float32, False, False, False, False, None, "layer"),
    ((50, 24), jnp.float16, True, False, False, True, None, "layer"),
    ((3, 13, 100), jnp.float32, True, False, True, False, None, "rms"),
    ((37, 64), jnp.bfloat16, True, False, False, True, None, "rms"),
]


@pytest.mark.parametrize("shape,dtype,scale,bias,residual,zero_centered,out_dtype,norm", CASES)
def test_values_and_grads_match_reference(shape, dtype, scale, bias, residual, zero_centered,
                                          out_dtype, norm):
  """Outputs (y, and s with a residual) and the gradients of x, scale, bias and residual
  through the public op, jitted, match jax.vjp of the float32 reference."""
  x, vecs, dy, ds = _inputs(seed_of(f"{shape}{dtype}{norm}"), shape, dtype, scale=scale,
                            bias=bias, residual=residual)
  eps = 1e-5
  got_out, got_grads = _outputs_and_grads(
      _op("interpret", eps, zero_centered, out_dtype, norm), x, vecs, dy, ds)
  want_out, want_grads = _outputs_and_grads(
      _op("reference", eps, zero_centered, norm=norm), *_upcast((x, vecs)), dy, ds)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got_out), jax.tree.leaves(want_out))):
    assert g.dtype == ((out_dtype or dtype) if i == 0 else dtype)
    _assert_close(g, w, tol, f"output {i}")
  names = ("dx", "dscale", "dbias", "dresidual")
  for name, g, w, arg in zip(names, got_grads, want_grads, (x, vecs["scale"], vecs["bias"],
                                                            vecs["residual"])):
    if arg is None:
      continue
    assert g.dtype == arg.dtype, name
    _assert_close(g, w, tol, name)


def _layer_norm_grads_f64(x, scale, bias, dy, eps):
  """NumPy float64 closed form of LayerNorm's gradients: (dx, dscale, dbias)."""
  x, scale, dy = (np.asarray(a, np.float64) for a in (x, scale, dy))
  centered = x - x.mean(-1, keepdims=True)
  rstd = 1 / np.sqrt((centered**2).mean(-1, keepdims=True) + eps)
  xhat = centered * rstd
  g = dy * scale
  dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
  del bias  # dbias = Σ dy whatever β is
  return dx, (dy * xhat).sum(0), dy.sum(0)


def _check_large_mean_grads(seed: int, make_op):
  """float32 LayerNorm rows with mean 1e4 and spread 1 through ``make_op(eps)``: dx, dscale and
  dbias against the float64 closed form to 1e-5."""
  x, vecs, dy, _ = _inputs(seed, (24, 80), jnp.float32, scale=True, bias=True, residual=False,
                           mean=1e4)
  eps = 1e-6
  _, grads = _outputs_and_grads(make_op(eps), x, vecs, dy, None)
  want = _layer_norm_grads_f64(x, vecs["scale"], vecs["bias"], dy, eps)
  for name, g, w in zip(("dx", "dscale", "dbias"), grads, want):
    _assert_close(g, w, 1e-5, name)


def test_rows_with_a_large_mean_keep_their_precision():
  """Rows with mean 1e4 and spread 1: the kernel rebuilds x̂ from the saved (shift, dmean)
  pair, so its gradients match a float64 oracle to float32 accuracy (a mean rounded to one
  float32 would put ulp(1e4)/std ~ 1e-3 into x̂)."""
  _check_large_mean_grads(7, lambda eps: _op("interpret", eps, False))


@pytest.mark.parametrize("dtype,n,tols", [(jnp.float32, 1024, (1e-5, 1e-5)),
                                          (jnp.float16, 4096, (None, 1.5e-4))])
def test_rows_whose_first_element_is_an_outlier_keep_their_precision(dtype, n, tols):
  """Rows whose first element (the kernel's shift) lies ~sqrt(N) spreads from their mean: the
  shifted moments' variance Σd²/N − dmean² cancels ~N·ulp; the kernel must match the float64
  oracle to float32 accuracy as the "xla" path does (review 7: 2.3e-4 at N = 2048). float16
  rows take the same two-pass path: their dscale (dx is within float16's rounding either way)
  was 5e-4 off with the one-pass moments at N = 4096 (a mutation test), 4e-5 with them."""
  rng = np.random.default_rng(3)
  x = 3.0 + 0.01 * rng.standard_normal((4, n))
  x[:, 0] = 3.0 + 0.01 * np.sqrt(n) * np.array([10.0, 30.0, 100.0, 300.0])
  x, vecs, dy = jnp.asarray(x, dtype), dict(scale=jnp.asarray(1 + 0.2 * rng.standard_normal(n),
                                                              jnp.float32),
                                            bias=None, residual=None), jnp.asarray(
      rng.standard_normal((4, n)), dtype)
  _, grads = _outputs_and_grads(_op("interpret", 1e-6, False), x, vecs, dy, None)
  want = _layer_norm_grads_f64(np.asarray(x, np.float64), vecs["scale"], np.zeros(n),
                               np.asarray(dy, np.float64), 1e-6)
  for name, g, w, tol in zip(("dx", "dscale"), grads, want, tols):
    if tol is not None:
      _assert_close(g, w, tol, name)


@pytest.mark.parametrize("config", [
    row_norm_pallas.BackwardConfig(block_m=1, programs=7, num_warps=4, num_stages=1),
    row_norm_pallas.BackwardConfig(block_m=4, programs=2, num_warps=8),
    row_norm_pallas.BackwardConfig(block_m=2, programs=5, num_warps=4, prefetch=True),
    row_norm_pallas.BackwardConfig(block_m=4, programs=16, num_warps=4, prefetch=True),
])
def test_other_tilings_give_the_same_gradients(monkeypatch, config):
  """The kernel under tilings other than pick_config's, as the GPU tilings under test take them
  (45 rows: one row per step over 7 programs; 12 blocks of 4 rows over 2, the last block one
  row; 23 blocks of 2 over 5 programs, the next block loaded ahead, programs with 5 and 4
  blocks; 12 blocks over 16 programs, 4 of them with none): the same values as the
  reference."""
  x, vecs, dy, ds = _inputs(8, (45, 96), jnp.bfloat16, scale=True, bias=True, residual=True)
  monkeypatch.setattr(row_norm_pallas, "pick_config", lambda m, n, interpret, kind: config)
  _, got = _outputs_and_grads(_op("interpret", 1e-5, False), x, vecs, dy, ds)
  _, want = _outputs_and_grads(_op("reference", 1e-5, False), *_upcast((x, vecs)), dy, ds)
  for name, g, w in zip(("dx", "dscale", "dbias", "dresidual"), got, want):
    _assert_close(g, w, BF16_TOL, name)


# ("triton", "xla") on the CPU warns once per process that it ran XLA (tested in test_validation).
@pytest.mark.filterwarnings("ignore::pallas_norm._dispatch.KernelSkippedWarning")
def test_kernel_names_and_refusals_on_the_cpu():
  """On the CPU: None and "xla" are XLA's autodiff; "triton" needs an NVIDIA GPU and "mosaic"
  does not exist for these ops (NotImplementedError naming the op); a sequence falls through
  to what can run; calls the kernel cannot run are refused with the reason, before any work."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU behaviour")
  x = jnp.ones((4, 8), jnp.float32) + jnp.arange(8.0)
  want = reference.layer_norm(x)
  np.testing.assert_array_equal(pallas_norm.layer_norm(x), want)
  np.testing.assert_array_equal(pallas_norm.layer_norm(x, implementation=("triton", "xla")), want)
  with pytest.raises(NotImplementedError, match="layer_norm.*NVIDIA GPU"):
    pallas_norm.layer_norm(x, implementation="triton")
  np.testing.assert_array_equal(pallas_norm.rms_norm(x), reference.rms_norm(x))
  with pytest.raises(NotImplementedError, match="rms_norm.*NVIDIA GPU"):
    pallas_norm.rms_norm(x, implementation="triton")
  with pytest.raises(NotImplementedError, match="rms_norm has no 'mosaic' kernel"):
    pallas_norm.rms_norm(x, implementation="mosaic")
  wide = np.ones((2, row_norm_pallas.MAX_N + 1), np.float32)
  with pytest.raises(NotImplementedError, match="N = 8193 with a residual"):
    pallas_norm.layer_norm(wide, residual=wide, implementation="interpret")
  with pytest.raises(NotImplementedError, match="float64"):
    pallas_norm.layer_norm(np.ones((2, 8)), implementation="interpret")
  # A residual of another dtype is refused by the shared validation, before the dispatch.
  with pytest.raises(TypeError, match="residual must have x's dtype float32, got bfloat16"):
    pallas_norm.layer_norm(x, residual=x.astype(jnp.bfloat16), implementation="interpret")
  # No rows: the kernel's gradient failed with ZeroDivisionError (review finding).
  with pytest.raises(NotImplementedError, match="no rows"):
    pallas_norm.layer_norm(x[:0], implementation="interpret")
  grad = jax.grad(lambda x: jnp.sum(pallas_norm.layer_norm(x, implementation=("interpret",
                                                                              "xla"))))(x[:0])
  assert grad.shape == (0, 8)


def test_default_takes_the_kernel_only_where_measured_faster(monkeypatch):
  """implementation=None's rule (norms_api.slower_reason), as on a Hopper GPU: LayerNorm
  for bf16, no residual, 128 <= N <= 8192, >= 65536 rows; RMSNorm for 128 <= N <= 2048, >=
  262144 rows (slower at 65536×8192); nothing off Hopper."""
  from pallas_norm import _dispatch
  reason = functools.partial(norms_api.slower_reason, "layer")
  rms = functools.partial(norms_api.slower_reason, "rms")
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  for shape in ((262144, 2048), (1048576, 512), (4194304, 128)):
    assert rms(shape, jnp.bfloat16, False) is None, shape
  for shape in ((65536, 8192), (65536, 2048), (262144, 4096)):
    assert "N = " in rms(shape, jnp.bfloat16, False), shape
  assert "residual" in rms((262144, 2048), jnp.bfloat16, True)
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: False)
  assert "Hopper" in rms((262144, 2048), jnp.bfloat16, False)
  assert "Hopper" in reason((262144, 2048), jnp.bfloat16, False)
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  for shape in ((262144, 2048), (65536, 128), (4, 65536, 1000)):
    assert reason(shape, jnp.bfloat16, False) is None, shape
  assert "bfloat16" in reason((262144, 2048), jnp.float32, False)
  assert "residual" in reason((262144, 2048), jnp.bfloat16, True)
  assert reason((65536, 8192), jnp.bfloat16, False) is None
  for shape in ((262144, 64), (1024, 2048)):
    assert "N = " in reason(shape, jnp.bfloat16, False), shape


# ---- GPU (Triton lowering) ------------------------------------------------------------------


GPU_CASES = [
    ((8192, 2048), jnp.bfloat16, True, True, False, False, "layer"),
    ((4, 1000, 1000), jnp.bfloat16, True, True, True, True, "layer"),
    ((65536, 128), jnp.bfloat16, True, False, True, False, "layer"),
    ((3000, 4096), jnp.float32, True, True, False, False, "layer"),
    ((8192, 2048), jnp.bfloat16, True, False, False, False, "rms"),
    ((4, 1000, 1000), jnp.bfloat16, True, False, True, True, "rms"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,scale,bias,residual,zero_centered,norm", GPU_CASES)
def test_gpu_kernel_matches_reference(shape, dtype, scale, bias, residual, zero_centered, norm):
  """implementation="triton" on the GPU at real sizes: outputs and gradients vs the float32
  reference."""
  x, vecs, dy, ds = _inputs(11, shape, dtype, scale=scale, bias=bias, residual=residual)
  got_out, got_grads = _outputs_and_grads(_op("triton", 1e-6, zero_centered, norm=norm),
                                          x, vecs, dy, ds)
  want_out, want_grads = _outputs_and_grads(_op("reference", 1e-6, zero_centered, norm=norm),
                                            *_upcast((x, vecs)), dy, ds)
  tol = F32_TOL * 10 if dtype == jnp.float32 else BF16_TOL
  for g, w in zip(jax.tree.leaves(got_out), jax.tree.leaves(want_out)):
    _assert_close(g, w, tol, "output")
  for g, w in zip(got_grads, want_grads):
    if g is not None:
      _assert_close(g, w, tol, "grad")


def test_default_picks_the_kernel_where_measured_faster(monkeypatch):
  """implementation=None through the op's own check (``api._check``), as on a Hopper GPU (the
  device queries patched, so this runs on the CPU too): (forward use, training) per
  FORWARD_DOMAINS and KERNEL_DOMAINS, the H200's winners per suite shape: LayerNorm trains
  through the kernels and runs the forward kernel alone at every suite N (128-32768); RMSNorm
  trains through them at N = 128-2048 and runs the forward kernel alone at 512-2048 and past
  8192; XLA outside the measured domains."""
  from pallas_norm import _dispatch
  from pallas_norm.ops.norms import api as norms
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  monkeypatch.setattr(_dispatch, "on_cuda_gpu", lambda: True)

  def chosen(op, shape, dtype=jnp.bfloat16, residual=False):
    """The op's choice for operands of this shape, traced (no 1 GB array on the CPU)."""
    out = []
    def check(x):
      out.append(norms._check(x, None, None, x if residual else None, 1e-6, None, None, op))
      return x
    jax.eval_shape(check, jax.ShapeDtypeStruct(shape, dtype))
    return out[0]

  kernels, xla_both = ("triton", "triton"), ("xla", "xla")
  for shape in ((262144, 2048), (4194304, 128), (65536, 8192), (65536, 4096), (1048576, 512),
                (32768, 16384), (21845, 24576), (16384, 32768)):
    assert chosen("layer_norm", shape) == kernels, shape
  assert chosen("rms_norm", (16384, 32768)) == ("triton", "xla")
  for shape in ((262144, 2048), (1048576, 512)):
    assert chosen("rms_norm", shape) == kernels, shape
  assert chosen("rms_norm", (4194304, 128)) == ("xla", "triton")
  assert chosen("rms_norm", (131072, 512)) == ("xla", "xla")  # below both domains' rows
  assert chosen("rms_norm", (65536, 8192)) == xla_both
  assert chosen("layer_norm", (262144, 2048), jnp.float32) == xla_both
  for shape in ((1024, 2048), (65536, 64)):
    assert chosen("layer_norm", shape) == xla_both, shape
  assert chosen("layer_norm", (262144, 2048), residual=True) == xla_both
  # The domains' edges (a mutation test moved each unnoticed): RMSNorm's forward kernel alone
  # starts at N = 512; LayerNorm's wide rows need 16384 rows.
  assert chosen("rms_norm", (262144, 256)) == ("xla", "triton")
  assert chosen("layer_norm", (8192, 16384)) == xla_both


@pytest.mark.parametrize("op,n", [("layer_norm", 64), ("rms_norm", 8200), ("layer_norm", 8200)])
def test_second_order_raises_naming_the_op(op, n):
  """The kernel path is first-order reverse mode only: a gradient of a gradient names the op
  and the fix (it was a bare AssertionError from inside Pallas), also where training runs the
  forward kernel (rows wider than 8192 always do; so do the default's training domains on
  Hopper), whose rule the second derivative differentiates."""
  x = jax.random.normal(jax.random.key(0), (2, n), jnp.bfloat16)
  import pallas_norm as pn
  norm = getattr(pn, op)
  first = lambda x: jnp.sum(norm(x, implementation="interpret").astype(jnp.float32))  # noqa: E731
  assert jax.grad(first)(x).shape == x.shape
  with pytest.raises(NotImplementedError, match=f"{op}: its kernel paths") as info:
    jax.grad(lambda x: jnp.sum(jax.grad(first)(x).astype(jnp.float32)))(x)
  assert "Mosaic" not in str(info.value)  # its kernel is Triton (review)


# ---- The forward kernel (pallas_norm/ops/norms/triton_fwd.py) and the backward reading its
# statistics (full rows and chunked rows) ----------------------------------------------------

from pallas_norm.ops.norms import triton_fwd  # noqa: E402
from pallas_norm.ops.norms import xla as norms_xla  # noqa: E402


def _chunked(monkeypatch, chunk, block_m, sums="registers", hints=False, min_n=64):
  """Rows of at least ``min_n`` elements through the chunked kernels, ``chunk`` columns a
  load, ``block_m`` rows a step, the backward's column partials in registers ("registers") or
  summed apart ("apart": a program per row block) (the GPU's chunked paths at CPU sizes);
  ``hints``: both kernels' L2 hints (no effect in interpret mode but the lowering of the
  arguments)."""
  monkeypatch.setattr(triton_fwd, "CHUNKED_MIN_N", min_n)
  monkeypatch.setattr(triton_fwd, "TILINGS", {**triton_fwd.TILINGS, "chunked": dict.fromkeys(
      ("layer", "rms"), (chunk, 2, 4, hints))})
  monkeypatch.setattr(row_norm_pallas, "CHUNKED_TILING", dict.fromkeys(
      ("layer", "rms"), (chunk, block_m, None if sums == "apart" else 2, 4, sums, hints)))
  # Column sums apart: blocks of 64 columns (the last short at N = 100), 4 rows a step, so
  # the 3 interpret programs make 2 row splits, the last short of a step.
  monkeypatch.setattr(row_norm_pallas, "COLUMN_SUM_TILING", (64, 4, 8))


def _kernel_path(norm, eps, zero_centered, out_dtype=None):
  def f(x, scale, bias, residual):
    assert residual is None
    return norms_api.row_norm(x, scale, bias if norm == "layer" else None, norm=norm, eps=eps,
                              zero_centered_scale=zero_centered, out_dtype=out_dtype,
                              interpret=True, forward="kernel")
  return f


FWD_CASES = [
    # shape, dtype, scale, bias, zero_centered, out_dtype, norm, chunking (chunk, block_m) or None
    ((3, 13, 100), jnp.float32, True, True, False, None, "layer", None),
    ((37, 64), jnp.bfloat16, True, True, True, None, "layer", None),
    ((20, 256), jnp.bfloat16, False, False, False, jnp.float32, "layer", None),
    ((50, 24), jnp.float16, True, False, False, None, "layer", None),
    ((3, 13, 100), jnp.float32, True, False, False, None, "rms", None),
    ((37, 64), jnp.bfloat16, True, False, True, None, "rms", None),
    ((13, 100), jnp.float32, True, True, False, None, "layer", (32, 2)),
    ((2, 7, 96), jnp.bfloat16, True, True, True, None, "layer", (32, 1)),
    ((13, 100), jnp.float32, True, False, False, None, "rms", (32, 2)),
    ((9, 128), jnp.bfloat16, False, False, False, jnp.float32, "rms", (64, 4)),
    ((13, 100), jnp.float32, True, True, False, None, "layer", (32, 2, "apart")),
    ((2, 7, 96), jnp.bfloat16, True, True, True, None, "layer", (32, 1, "apart")),
    ((13, 100), jnp.float32, True, False, False, None, "rms", (32, 1, "apart")),
    ((9, 100), jnp.float32, False, True, False, None, "layer", (32, 2, "apart")),
    ((13, 100), jnp.float32, True, True, False, None, "layer", (32, 2, "apart", True)),
    ((2, 7, 96), jnp.bfloat16, True, False, False, None, "rms", (32, 1, "registers", True)),
]


@pytest.mark.parametrize("shape,dtype,scale,bias,zero_centered,out_dtype,norm,chunking",
                         FWD_CASES)
def test_forward_kernel_path_matches_reference(monkeypatch, shape, dtype, scale, bias,
                                               zero_centered, out_dtype, norm, chunking):
  """forward="kernel": y and the gradients of x, scale and bias through the forward kernel and
  the backward kernel reading its statistics, jitted, against jax.vjp of the float32 reference;
  full rows and rows walked in chunks (the last chunk short, rows short of the last block, one
  and several rows a step). Interpret mode fills what a kernel leaves unwritten with NaN."""
  if chunking:
    _chunked(monkeypatch, *chunking)
  x, vecs, dy, _ = _inputs(seed_of(f"fwd{shape}{dtype}{norm}{chunking}"), shape, dtype,
                           scale=scale, bias=bias, residual=False)
  eps = 1e-5
  got_out, got_grads = _outputs_and_grads(_kernel_path(norm, eps, zero_centered, out_dtype),
                                          x, vecs, dy, None)
  want_out, want_grads = _outputs_and_grads(
      _op("reference", eps, zero_centered, norm=norm), *_upcast((x, vecs)), dy, None)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  assert got_out.dtype == (out_dtype or dtype)
  _assert_close(got_out, want_out, tol, "y")
  for name, g, w, arg in zip(("dx", "dscale", "dbias"), got_grads, want_grads,
                             (x, vecs["scale"], vecs["bias"])):
    if arg is None or (name == "dbias" and norm == "rms"):
      continue
    assert g.dtype == arg.dtype, name
    _assert_close(g, w, tol, name)


@pytest.mark.parametrize("path", ["forward_kernel", "forward_kernel_chunked", "backward_kernel",
                                  pytest.param("triton", marks=pytest.mark.gpu)])
def test_bfloat16_rows_past_float32_range_normalize_to_zeros(monkeypatch, path):
  """bfloat16 LayerNorm rows whose Σd² overflows float32 (|x| ≈ 1e19, 1e20): y = β and dx = 0
  there, as the reference and the XLA path give (README, Limitations). The one-pass variance
  that bfloat16 takes (E[d²] − E[d]², d = x − the row's first element) made them NaN where E[d]²
  overflowed too (inf − inf): the forward kernel over full rows and in chunks, and the backward
  kernel recomputing the statistics after XLA's forward (found by fuzzing); "triton": the
  compiled kernels on the GPU."""
  if path == "forward_kernel_chunked":
    _chunked(monkeypatch, 32, 2)
  x, vecs, dy, _ = _inputs(seed_of(f"overflow{path}"), (13, 100), jnp.bfloat16, scale=True,
                           bias=True, residual=False)
  x = x.at[3].multiply(1e19).at[10].multiply(1e20)
  eps = 1e-5
  f = (_kernel_path("layer", eps, False) if path.startswith("forward")
       else _op("interpret" if path == "backward_kernel" else path, eps, False))
  got_out, got_grads = _outputs_and_grads(f, x, vecs, dy, None)
  want_out, want_grads = _outputs_and_grads(_op("reference", eps, False), *_upcast((x, vecs)),
                                            dy, None)
  np.testing.assert_array_equal(np.asarray(want_grads[0], np.float32)[[3, 10]], 0.0)
  _assert_close(got_out, want_out, BF16_TOL, "y")
  np.testing.assert_allclose(np.asarray(got_out, np.float32)[[3, 10]],
                             np.broadcast_to(np.asarray(vecs["bias"], np.float32), (2, 100)),
                             rtol=1e-2, atol=1e-3)
  for name, g, w in zip(("dx", "dscale", "dbias"), got_grads, want_grads):
    _assert_close(g, w, BF16_TOL, name)


GRID_CASES = [
    # shape, dtype, norm, bias, chunked (forward tiling: a program per row block)
    ((37, 64), jnp.bfloat16, "layer", True, False),
    ((3, 13, 100), jnp.float32, "layer", True, False),
    ((37, 64), jnp.bfloat16, "rms", False, False),
    ((13, 100), jnp.float32, "layer", True, True),
    ((2, 7, 96), jnp.bfloat16, "rms", False, True),
]


@pytest.mark.parametrize("shape,dtype,norm,bias,chunked", GRID_CASES)
def test_forward_kernel_one_program_per_row_block(monkeypatch, shape, dtype, norm, bias,
                                                  chunked):
  """Forward tilings with programs per SM None (a grid over the row blocks, no row loop): y,
  the statistics and the gradients as with the slab tiling, against the float32 reference;
  several programs, the last block short of rows."""
  if chunked:
    _chunked(monkeypatch, 32, 2)
  monkeypatch.setattr(triton_fwd, "TILINGS", {**triton_fwd.TILINGS, "full": (256, None, 4),
                                              "chunked": {norm: (32, None, 4)}})
  m, n = math.prod(shape[:-1]), shape[-1]
  cfg = triton_fwd.pick_config(m, n, interpret=True, norm=norm)
  assert cfg.programs == -(-m // cfg.block_m) > 1
  assert triton_fwd.slab_rows(m, cfg) == (cfg.block_m, cfg.programs)
  x, vecs, dy, _ = _inputs(seed_of(f"grid{shape}{dtype}{norm}"), shape, dtype, scale=True,
                           bias=bias, residual=False)
  got_out, got_grads = _outputs_and_grads(_kernel_path(norm, 1e-5, False), x, vecs, dy, None)
  want_out, want_grads = _outputs_and_grads(_op("reference", 1e-5, False, norm=norm),
                                            *_upcast((x, vecs)), dy, None)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  _assert_close(got_out, want_out, tol, "y")
  for name, g, w, arg in zip(("dx", "dscale", "dbias"), got_grads, want_grads,
                             (x, vecs["scale"], vecs["bias"])):
    if arg is not None and not (name == "dbias" and norm == "rms"):
      _assert_close(g, w, tol, name)
  _, stats = triton_fwd.forward(x.astype(jnp.float32), None, None, norm=norm, eps=1e-5,
                                zero_centered_scale=False, interpret=True)
  want = norms_xla.row_stats(x.astype(jnp.float32), norm, 1e-5)
  for name, got, ref in zip(("shift", "dmean", "rstd"), stats, want):
    if ref is not None:
      np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-6, atol=1e-6,
                                 err_msg=name)


STRIDED_CASES = [
    # shape, dtype, norm, (block_m, programs, prefetch) or None (pick_config's, interpret mode)
    ((3, 13, 100), jnp.float32, "layer", (4, 3, False)),
    ((3, 13, 100), jnp.float32, "layer", (4, 3, True)),
    ((3, 13, 100), jnp.float32, "rms", (4, 12, True)),
    ((3, 13, 100), jnp.float32, "rms", (2, 6, False)),
    ((37, 64), jnp.bfloat16, "layer", (2, 40, True)),
    ((21, 1000), jnp.float32, "rms", None),
]


@pytest.mark.parametrize("shape,dtype,norm,tiling", STRIDED_CASES)
def test_backward_given_statistics_strided_blocks(monkeypatch, shape, dtype, norm, tiling):
  """The backward kernel reading the forward kernel's statistics, program p taking row blocks
  p, p + P, ... with and without the next block loaded ahead: 39 rows of N = 100 (columns
  masked) in 10 blocks of 4 over 3 programs (4, 3 and 3 blocks, the last block 3 rows) and
  over 12 programs (2 with no block), 20 blocks of 2 over 6 programs, 37 rows in 19 blocks over
  40 programs, and pick_config's RMSNorm tiling at N = 1000 (2 rows a step, prefetch; 11
  blocks over 3 programs, the last block one row). dx, dscale (and dbias) against jax.vjp of
  the float32 reference; interpret mode fills what the kernel leaves unwritten with NaN."""
  m, n = math.prod(shape[:-1]), shape[-1]
  if tiling is not None:
    block_m, programs, prefetch = tiling
    config = row_norm_pallas.BackwardConfig(block_m=block_m, programs=programs, num_warps=4,
                                            prefetch=prefetch)
    monkeypatch.setattr(row_norm_pallas, "pick_config", lambda m, n, interpret, kind: config)
  else:
    config = row_norm_pallas.pick_config(m, n, True, norm + "_given")
    assert (config.block_m, config.programs, config.prefetch) == (2, 3, True)
  assert m % config.block_m, "the last row block should be short of rows"
  bias = norm == "layer"
  x, vecs, dy, _ = _inputs(seed_of(f"strided{shape}{dtype}{norm}{tiling}"), shape, dtype,
                           scale=True, bias=bias, residual=False)
  _, got = _outputs_and_grads(_kernel_path(norm, 1e-5, False), x, vecs, dy, None)
  _, want = _outputs_and_grads(_op("reference", 1e-5, False, norm=norm), *_upcast((x, vecs)),
                               dy, None)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
    if name != "dbias" or bias:
      _assert_close(g, w, tol, name)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_norm_backward_strided_blocks_match_float64(monkeypatch, norm, prefetch):
  """norm_backward (given x̂ and rstd, with dh_out and all three column sums) over 30 rows of
  N = 48 in 8 blocks of 4 (the last 2 rows) over 3 and over 11 programs, with and without the
  next block loaded ahead: dh, Σ dy ⊙ x̂, Σ dy and Σ dh against a float64 NumPy closed form
  from the same float32 inputs, to 1e-5 (float32 kernel: only the summation order differs)."""
  m, n = 30, 48
  keys = jax.random.split(jax.random.key(seed_of(f"nbstrided{norm}{prefetch}")), 5)
  dy, xhat, dh_out = (jax.random.normal(k, (m, n), jnp.float32) for k in keys[:3])
  rstd = jax.random.uniform(keys[3], (m,), jnp.float32, 0.5, 2.0)
  scale = 1 + 0.2 * jax.random.normal(keys[4], (n,), jnp.float32)
  d, xh, r, dho, g = (np.asarray(a, np.float64) for a in (dy, xhat, rstd, dh_out, scale))
  gd = d * g
  inner = gd - xh * (gd * xh).mean(-1, keepdims=True)
  if norm == "layer":
    inner = inner - gd.mean(-1, keepdims=True)
  dh_want = r[:, None] * inner + dho
  want = {"dscale": (d * xh).sum(0), "dbias": d.sum(0), "ddense": dh_want.sum(0)}
  for programs in (3, 11):
    config = row_norm_pallas.BackwardConfig(block_m=4, programs=programs, num_warps=4,
                                            prefetch=prefetch)
    monkeypatch.setattr(row_norm_pallas, "pick_config", lambda m, n, interpret, kind: config)
    dh, sums = jax.jit(functools.partial(
        row_norm_pallas.norm_backward, norm=norm, sums=row_norm_pallas.SAVED_STATS_SUMS,
        interpret=True))(dy, xhat, rstd, scale, dh_out)
    _assert_close(dh, dh_want, 1e-5, f"dh ({programs} programs)")
    for name, w in want.items():
      _assert_close(sums[name], w, 1e-5, f"{name} ({programs} programs)")


def test_default_backward_tilings(monkeypatch):
  """pick_config's full-row backward tilings at the measured shapes (132 SMs, as the H200):
  RMSNorm given the statistics at N = 2048 one row a step, 12 programs per SM, prefetch; at
  N = 512 8 rows, no prefetch; LayerNorm's given them 2048 elements over 8 programs per SM,
  no prefetch; the recomputing kinds (norm_backward's): RMSNorm at 2048 as RMSNorm given the
  statistics, at 512 8 rows, LayerNorm at 512 4 rows over 8 per SM; no more programs than row
  blocks; rows wider than 4096 16 warps, 4 programs per SM."""
  monkeypatch.setattr(row_norm_pallas, "_gpu_core_count", lambda: 132)
  cfg = functools.partial(row_norm_pallas.BackwardConfig, num_warps=4)
  pick = functools.partial(row_norm_pallas.pick_config, interpret=False)
  assert pick(262144, 2048, norm="rms_given") == cfg(1, 12 * 132, prefetch=True)
  assert pick(262144, 1024, norm="rms_given") == cfg(2, 12 * 132, prefetch=True)
  assert pick(1048576, 512, norm="rms_given") == cfg(8, 12 * 132)
  assert pick(262144, 2048, norm="layer_given") == cfg(1, 8 * 132)
  assert pick(1048576, 512, norm="layer_given") == cfg(4, 8 * 132)
  assert pick(4194304, 128, norm="layer_given") == cfg(32, 12 * 132)
  assert pick(262144, 2048, norm="rms") == cfg(1, 12 * 132, prefetch=True)
  assert pick(262144, 512, norm="rms") == cfg(8, 12 * 132)
  assert pick(262144, 512, norm="layer") == cfg(4, 8 * 132)
  assert pick(100, 2048, norm="rms_given") == cfg(1, 100, prefetch=True)
  assert pick(65536, 8192, norm="layer") == row_norm_pallas.BackwardConfig(1, 4 * 132, 16)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("chunking", [None, (32, 2)])
def test_forward_kernel_statistics_match_the_xla_paths(monkeypatch, norm, chunking):
  """The row statistics the forward kernel hands the backward: (shift, dmean, rstd) as
  :func:`pallas_norm.ops.norms.xla.row_stats` computes them from float32 x (the shift exactly
  the row's first element), float32, of x's leading shape."""
  if chunking:
    _chunked(monkeypatch, *chunking)
  x = 0.5 + jax.random.normal(jax.random.key(5), (3, 11, 100), jnp.float32)
  _, stats = triton_fwd.forward(x, None, None, norm=norm, eps=1e-5, zero_centered_scale=False,
                                interpret=True)
  want = norms_xla.row_stats(x, norm, 1e-5)
  for name, got, ref in zip(("shift", "dmean", "rstd"), stats, want):
    if ref is None:
      assert got is None, name
      continue
    assert got.shape == x.shape[:-1] and got.dtype == jnp.float32, name
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-6, atol=1e-6,
                               err_msg=name)
  if norm == "layer":
    np.testing.assert_array_equal(np.asarray(stats.shift), np.asarray(x[..., 0]))


@pytest.mark.parametrize("chunking", [None, (32, 2), (32, 2, "apart", True)])
def test_forward_kernel_path_keeps_the_precision_of_rows_with_a_large_mean(monkeypatch,
                                                                           chunking):
  """Rows with mean 1e4 and spread 1 through the forward kernel (the chunks' moments merged by
  Chan's formula when chunked) and the backward reading (shift, dmean, rstd): float32
  gradients match the float64 closed form to float32 accuracy."""
  if chunking:
    _chunked(monkeypatch, *chunking)
  _check_large_mean_grads(17, lambda eps: _kernel_path("layer", eps, False))


def test_forward_paths_and_refusals(monkeypatch):
  """forward_path: the forward kernel for rows wider than MAX_N (no other forward serves them),
  XLA's with a residual, the forward kernel where KERNEL_DOMAINS holds, else XLA's; row_norm
  refuses the combinations no kernel serves; the public op runs rows wider than MAX_N
  (chunked) but refuses them with a residual."""
  fp = norms_api.forward_path
  assert fp("rms", (16384, 32768), False) == "kernel"
  assert fp("layer", (262144, 2048), True) == "xla"
  assert fp("layer", (262144, 2048), False) == "kernel"
  assert fp("rms", (262144, 2048), False) == "kernel"
  assert fp("rms", (65536, 8192), False) == "xla"
  assert fp("layer", (16384, 32768), False) == "kernel"
  assert fp("layer", (1024, 2048), False) == "xla"
  monkeypatch.setattr(norms_routing, "KERNEL_DOMAINS",
                      {"layer": ((128, 8192, 65536),), "rms": ()})
  assert fp("layer", (262144, 2048), False) == "kernel"
  assert fp("rms", (262144, 2048), False) == "xla"
  x = jnp.ones((4, 64), jnp.float32)
  with pytest.raises(ValueError, match="no residual"):
    norms_api.row_norm(x, residual=x, norm="layer", eps=1e-6, forward="kernel")
  with pytest.raises(ValueError, match="forward='kernel'"):
    norms_api.row_norm(jnp.ones((2, 8193)), norm="rms", eps=1e-6, forward="xla")
  wide = jax.random.normal(jax.random.key(2), (2, row_norm_pallas.MAX_N + 1), jnp.float32)
  with pytest.raises(NotImplementedError, match="N = 8193 with a residual"):
    pallas_norm.layer_norm(wide, residual=wide, implementation="interpret")
  scale = 1 + 0.1 * jax.random.normal(jax.random.key(3), (wide.shape[-1],))
  # Jitted: one program each instead of one compile per eager op.
  got = jax.jit(jax.grad(lambda x, s: jnp.sum(jnp.sin(pallas_norm.rms_norm(
      x, s, implementation="interpret"))), (0, 1)))(wide, scale)
  want = jax.jit(jax.grad(lambda x, s: jnp.sum(jnp.sin(reference.rms_norm(x, s))), (0, 1)))(
      wide, scale)
  for g, w in zip(got, want):
    _assert_close(g, w, F32_TOL, "grad")


GPU_FWD_CASES = [
    # shape, dtype, norm, bias, forward
    ((8192, 2048), jnp.bfloat16, "layer", True),
    ((8192, 2048), jnp.bfloat16, "rms", False),
    ((65536, 128), jnp.bfloat16, "layer", True),
    ((4, 1000, 1000), jnp.bfloat16, "layer", True),
    ((2048, 8192), jnp.bfloat16, "rms", False),
    ((512, 32768), jnp.bfloat16, "layer", True),
    ((512, 32768), jnp.bfloat16, "rms", False),
    ((300, 10000), jnp.float32, "layer", True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,norm,bias", GPU_FWD_CASES)
def test_gpu_forward_kernel_path_matches_reference(shape, dtype, norm, bias):
  """forward="kernel" on the GPU (Triton lowering) at real sizes, full rows and (N > 8192)
  chunked rows: y and the gradients of x, scale, bias vs the float32 reference."""
  x, vecs, dy, _ = _inputs(13, shape, dtype, scale=True, bias=bias, residual=False)

  def path(x, scale, bias, residual):
    del residual
    return norms_api.row_norm(x, scale, bias, norm=norm, eps=1e-6, forward="kernel")

  got_out, got_grads = _outputs_and_grads(path, x, vecs, dy, None)
  want_out, want_grads = _outputs_and_grads(_op("reference", 1e-6, False, norm=norm),
                                            *_upcast((x, vecs)), dy, None)
  tol = F32_TOL * 10 if dtype == jnp.float32 else BF16_TOL
  _assert_close(got_out, want_out, tol, "y")
  for name, g, w in zip(("dx", "dscale", "dbias"), got_grads, want_grads):
    if g is not None:
      _assert_close(g, w, tol, name)


GPU_DEFAULT_CASES = [
    # shape, norm: the suite's N at fewer rows, each default tiling (pick_config's rows)
    ((65536, 128), "layer"), ((65536, 512), "rms"), ((8192, 2048), "layer"),
    ((2048, 8192), "layer"), ((512, 32768), "layer"), ((512, 32768), "rms"),
    ((300, 10000), "layer"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,norm", GPU_DEFAULT_CASES)
def test_gpu_forward_kernel_path_default_tilings(shape, norm):
  """The default tilings on the GPU (:func:`test_default_tilings_are_the_measured_winners`):
  a program per row block for full rows up to 4096, the slab past it, LayerNorm's chunked rows
  a program per row with L2 hints and the column sums apart, RMSNorm's chunked slab with the
  sums in registers; y and the gradients vs the float32 reference."""
  x, vecs, dy, _ = _inputs(29, shape, jnp.bfloat16, scale=True, bias=norm == "layer",
                           residual=False)

  def path(x, scale, bias, residual):
    del residual
    return norms_api.row_norm(x, scale, bias, norm=norm, eps=1e-6, forward="kernel")

  got_out, got_grads = _outputs_and_grads(path, x, vecs, dy, None)
  want_out, want_grads = _outputs_and_grads(_op("reference", 1e-6, False, norm=norm),
                                            *_upcast((x, vecs)), dy, None)
  _assert_close(got_out, want_out, BF16_TOL, "y")
  for name, g, w in zip(("dx", "dscale", "dbias"), got_grads, want_grads):
    if g is not None:
      _assert_close(g, w, BF16_TOL, name)


def test_default_tilings_are_the_measured_winners(monkeypatch):
  """The forward kernel's and the chunked backward's default tilings at the suite's shapes
  (132 SMs, as the H200), the H200 A/B's winners (benchmarks/NOTES.md, "Standalone norms"):
  full rows up to 4096 a program per 4096-element row block over 4 warps (both norms, both
  uses); 8192 the slab of 4 programs per SM over 8 warps; LayerNorm's chunked rows a program
  per row (16 warps, L2 hints), its backward 4096-column chunks a program per row (8 warps,
  hints, γ widened to float32) with the column sums apart; RMSNorm's chunked forward the same
  grid (its forward alone's winner) with γ widened to float32 before the kernel (every other
  tiling reads it in its own dtype) and its backward's one program per SM with the sums in
  registers."""
  monkeypatch.setattr(triton_fwd, "gpu_core_count", lambda: 132)
  monkeypatch.setattr(row_norm_pallas, "_gpu_core_count", lambda: 132)
  tiling = triton_fwd.RowTiling
  for norm in ("layer", "rms"):
    for m, n, block_m in ((4194304, 128, 32), (1048576, 512, 8), (262144, 2048, 2)):
      assert triton_fwd.pick_config(m, n, False, norm) == tiling(
          block_m=block_m, chunk=n, programs=m // block_m, num_warps=4), (norm, n)
    assert triton_fwd.pick_config(65536, 8192, False, norm) == tiling(
        block_m=1, chunk=8192, programs=4 * 132, num_warps=8)
  assert triton_fwd.pick_config(16384, 32768, False, "layer") == tiling(
      block_m=1, chunk=8192, programs=16384, num_warps=16, l2_hints=True)
  assert triton_fwd.pick_config(16384, 32768, False, "rms") == tiling(
      block_m=1, chunk=8192, programs=16384, num_warps=16, l2_hints=True, f32_vectors=True)
  assert row_norm_pallas.pick_chunked_config(16384, 32768, False, "layer") == tiling(
      block_m=1, chunk=4096, programs=16384, num_warps=8, column_sums="apart", l2_hints=True,
      f32_vectors=True)
  assert row_norm_pallas.pick_chunked_config(16384, 32768, False, "rms") == tiling(
      block_m=1, chunk=4096, programs=132, num_warps=16, column_sums="registers")


def test_default_forward_use_reads_forward_domains(monkeypatch):
  """implementation=None for a call that is not differentiated: the forward kernel only where
  FORWARD_DOMAINS holds (as on a Hopper GPU, device queries patched); an explicit
  implementation runs one path for both uses (forward use None)."""
  from pallas_norm import _dispatch
  from pallas_norm.ops.norms import api as norms
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  monkeypatch.setattr(_dispatch, "on_cuda_gpu", lambda: True)
  monkeypatch.setattr(norms_routing, "FORWARD_DOMAINS",
                      {"layer": (), "rms": ((128, 512, 1024),)})

  def chosen(op, shape, implementation=None):
    out = []
    jax.eval_shape(lambda x: out.append(norms._check(x, None, None, None, 1e-6, None,
                                                     implementation, op)) or x,
                   jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    return out[0]

  assert chosen("rms_norm", (4096, 512)) == ("triton", "xla")
  assert chosen("rms_norm", (4096, 2048)) == ("xla", "xla")
  assert chosen("layer_norm", (4096, 512)) == ("xla", "xla")
  assert chosen("rms_norm", (4096, 512), "triton") == (None, "triton")


def test_forward_use_runs_the_forward_kernel_and_training_its_own_path(monkeypatch):
  """By use (``_op.by_use``): a forward-use kernel with an XLA training path gives the
  reference's values undifferentiated and the reference's gradients differentiated."""
  from pallas_norm.ops.norms import api as norms
  x, vecs, dy, _ = _inputs(21, (40, 96), jnp.float32, scale=True, bias=False, residual=False)
  calls = []
  real = triton_fwd.forward
  monkeypatch.setattr(triton_fwd, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
  f = lambda x, s: norms._run(("interpret", "xla"), x, s, None, None, "rms", 1e-5, False, None)  # noqa: E731
  _assert_close(jax.jit(f)(x, vecs["scale"]), reference.rms_norm(x, vecs["scale"], eps=1e-5),
                F32_TOL, "y")
  assert calls, "the forward use did not run the forward kernel"
  # Jitted: one program each instead of one compile per eager op.
  got = jax.jit(jax.grad(lambda x, s: jnp.sum(jnp.sin(f(x, s))), (0, 1)))(x, vecs["scale"])
  want = jax.jit(jax.grad(lambda x, s: jnp.sum(jnp.sin(reference.rms_norm(x, s, eps=1e-5))),
                          (0, 1)))(x, vecs["scale"])
  for g, w in zip(got, want):
    _assert_close(g, w, F32_TOL, "grad")


def test_forward_use_with_a_residual_takes_xla(monkeypatch):
  """Where the forward use chose the forward kernel (which adds no residual), a call with a
  residual runs XLA's forward for both uses: the reference's values (a mutation test dropping
  that guard passed the CPU suite; on a GPU the kernel would have raised)."""
  from pallas_norm.ops.norms import api as norms
  x, vecs, _, _ = _inputs(22, (40, 96), jnp.float32, scale=True, bias=False, residual=True)
  r = vecs["residual"]
  calls = []
  real = triton_fwd.forward
  monkeypatch.setattr(triton_fwd, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
  y, h = jax.jit(lambda x, s, r: norms._run(("interpret", "xla"), x, s, None, r, "rms", 1e-5,
                                            False, None))(x, vecs["scale"], r)
  want_y, want_h = reference.rms_norm(x, vecs["scale"], r, eps=1e-5)
  _assert_close(y, want_y, F32_TOL, "y")
  _assert_close(h, want_h, F32_TOL, "h")
  assert not calls, "the forward kernel ran for a call with a residual"


# Found by a mutation test (each failed to notice its mutant before).

def test_forward_kernel_float32_rows_with_a_far_first_element():
  """float32 LayerNorm rows whose first element (3e4) is far from the rest: the forward
  kernel's rstd within 1e-6 of float64 (the two-pass statistics; one pass is 1e-5 off)."""
  from pallas_norm.ops.norms import triton_fwd
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 256)).astype(np.float32)
  x[:, 0] = 3e4
  _, stats = triton_fwd.forward(jnp.asarray(x), None, None, norm="layer", eps=1e-5,
                                zero_centered_scale=False, interpret=True)
  want = 1 / np.sqrt(x.astype(np.float64).var(axis=1) + 1e-5)
  np.testing.assert_allclose(np.asarray(stats.rstd, np.float64), want, rtol=1e-6)


def _stores(jaxpr, found):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("masked_swap", "swap"):
      found.append(eqn)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr or a Jaxpr
      inner = getattr(inner, "jaxpr", inner)
      if hasattr(inner, "eqns"):
        _stores(inner, found)
  return found


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("n", [64, 9000])  # full rows and chunked rows
def test_forward_kernel_masks_every_store(norm, n):
  """Every store of the forward kernel (y and each row statistic) carries a mask when M is not
  a multiple of the row block: interpret mode drops out-of-bounds stores, so only the kernel's
  jaxpr shows an unmasked one, which on the GPU writes past M (a mutation test)."""
  from pallas_norm.ops.norms import triton_fwd
  jaxpr = jax.make_jaxpr(lambda x: triton_fwd.forward(
      x, None, None, norm=norm, eps=1e-5, zero_centered_scale=False, interpret=False))(
          jnp.ones((37, n), jnp.float32))
  call = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call")
  found = _stores(call.params["jaxpr"], [])
  masked = [e for e in found if e.primitive.name == "masked_swap"
            and not str(e.params["args_tree"]).endswith("None))")]
  assert len(found) >= 2 + 2 * (norm == "layer") and len(masked) == len(found)


# Not the cross product with chunked: the kernel widens γ and β in one load_vec for either
# body, and the zero-centered 1 + scale is made (in float32) before the kernel, so chunked rows
# need one 16-bit case (bf16); the other dtypes and the zero-centered scale run on full rows.
@pytest.mark.parametrize("vec_dtype,zero_centered,chunked", [
    (jnp.bfloat16, False, False), (jnp.float16, False, False), (jnp.float32, False, False),
    (jnp.bfloat16, True, False), (jnp.bfloat16, False, True)])
def test_forward_kernel_vectors_in_their_own_dtype_give_the_same_bits(
    monkeypatch, vec_dtype, zero_centered, chunked):
  """The forward kernel reads γ and β in their own dtype (widened in the kernel) where its
  tiling does not ask for float32 vectors: y and the row statistics are bit for bit those of
  the float32 vectors (the widening is exact), for full and chunked rows, 16- and 32-bit
  vectors, and the zero-centered scale (1 + scale, float32 either way)."""
  if chunked:
    _chunked(monkeypatch, 32, 1)
  x = (0.5 + 2 * jax.random.normal(jax.random.key(3), (37, 100))).astype(jnp.bfloat16)
  scale = jax.random.uniform(jax.random.key(4), (100,), minval=-1.0, maxval=1.5).astype(vec_dtype)
  bias = (0.3 * jax.random.normal(jax.random.key(5), (100,))).astype(vec_dtype)

  def run(f32_vectors, norm):
    tilings = {**triton_fwd.TILINGS}
    for kind in ("full", "wide"):
      tilings[kind] = tilings[kind][:3] + (False, f32_vectors)
    tilings["chunked"] = {k: v[:4] + (f32_vectors,) for k, v in tilings["chunked"].items()}
    monkeypatch.setattr(triton_fwd, "TILINGS", tilings)
    cfg = triton_fwd.pick_config(37, 100, True, norm)
    assert cfg.f32_vectors == f32_vectors and (cfg.chunk < 100) == chunked
    return triton_fwd.forward(x, scale, bias if norm == "layer" else None, norm=norm, eps=1e-5,
                              zero_centered_scale=zero_centered, interpret=True)

  for norm in ("layer", "rms"):
    own, wide = run(False, norm), run(True, norm)
    for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(wide), strict=True):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("norm,n,zero_centered,wide_gamma", [
    ("layer", 100, False, False), ("rms", 100, False, False), ("layer", 100, True, True),
    ("layer", 9000, False, True), ("rms", 9000, False, False), ("rms", 9000, True, True)])
def test_backward_gamma_in_its_own_dtype_gives_the_same_bits(norm, n, zero_centered, wide_gamma):
  """The backward kernels take γ in its own dtype (bf16 here) except where zero-centered (1 +
  scale) or where the chunked tiling asks for float32 (LayerNorm's, CHUNKED_TILING); either
  way ds and the column sums are bit for bit those of the same launch given float32 γ, for
  full rows (N = 100) and chunked rows (N = 9000, given the forward kernel's statistics)."""
  x = (0.5 + 2 * jax.random.normal(jax.random.key(6), (5, n))).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(7), (5, n)).astype(jnp.bfloat16)
  scale = jax.random.uniform(jax.random.key(8), (n,), minval=-1.0, maxval=1.5).astype(
      jnp.bfloat16)
  bias = jnp.zeros((n,), jnp.bfloat16) if norm == "layer" else None
  stats = None
  if n >= triton_fwd.CHUNKED_MIN_N:
    _, stats = triton_fwd.forward(x, scale, bias, norm=norm, eps=1e-5,
                                  zero_centered_scale=zero_centered, interpret=True)
  launch, inputs = row_norm_pallas.row_backward(
      x, scale, bias, None, stats, dy, None, norm=norm, eps=1e-5,
      zero_centered_scale=zero_centered, interpret=True)
  gamma = inputs[-1]
  assert gamma.dtype == (jnp.float32 if wide_gamma else jnp.bfloat16), gamma.dtype
  own, wide = launch(*inputs), launch(*inputs[:-1], gamma.astype(jnp.float32))
  for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(wide), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
