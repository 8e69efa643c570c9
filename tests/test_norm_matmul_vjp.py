"""The lazy backward of norm_matmul (custom_vjp, DESIGN.md op 1) against JAX's autodiff of the
reference: the public API with ``implementation="interpret"`` (forward kernel + dx kernel in GPU
interpret mode on the CPU) against ``implementation="xla"`` and the f32 reference, and the
backward's XLA parts (row terms, weight gradients, the bias-cancellation guard) on their own.
Also matmul_norm's: its dispatch by use and its composed training route (CPU and ``gpu``)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm
from pallas_norm import reference
from pallas_norm.ops.matmul_norm import routing as mn_routing
from pallas_norm.ops.norm_matmul import api as nm
from pallas_norm.ops.norm_matmul import routing as nm_routing
from pallas_norm.ops.norm_matmul import mosaic_bwd as nmb
from pallas_norm.ops.norm_matmul import xla as nm_xla

# f32 inputs: the identities are exact algebra, so only f32 rounding separates the two paths.
F32_TOL = dict(rtol=2e-4, atol=2e-4)


def _inputs(seed, m, k, n, dtype, mean_offset=0.0):
  # NumPy's generator: JAX's would compile a program per shape (~0.8 CPU-s each on the CPU).
  rng = np.random.default_rng(seed)
  normal = lambda shape, scale=1.0, shift=0.0: shift + scale * rng.standard_normal(  # noqa: E731
      shape, np.float32)
  x = normal((m, k), shift=mean_offset)
  w = normal((k, n), k ** -0.5)
  scale = normal((k,), 0.3, 1.0)
  bias = normal((k,), 0.3)
  ct = normal((m, n))
  return tuple(map(jnp.asarray, (x.astype(dtype), w.astype(dtype), scale, bias, ct)))


def _losses(norm, ct, use_scale, use_bias, implementation="interpret", eps=1e-6):
  def pick(scale, bias):
    return (scale if use_scale else None), (bias if use_bias else None)

  def fused(x, w, scale, bias):
    s, b = pick(scale, bias)
    y = pallas_norm.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm, eps=eps,
                                implementation=implementation)
    return jnp.sum(y.astype(jnp.float32) * ct)

  def ref(x, w, scale, bias):
    s, b = pick(scale, bias)
    y = reference.norm_matmul(x, w, s, b, norm=norm, eps=eps)
    return jnp.sum(y.astype(jnp.float32) * ct)

  return fused, ref


@pytest.mark.parametrize("dtype,mean_offset", [(jnp.bfloat16, 250.0)])
def test_lazy_backward_16bit_large_row_mean(dtype, mean_offset):
  """16-bit rows of mean 100-250 and unit spread: the uncentered dW_γ = xᵀ(rstd ⊙ dy) − 1 ⊗ Σ
  rstd·mean·dy has two large terms that must cancel (a fresh-eyes review found 15-44% errors in
  dw and dscale when their roundings differed); the backward forms dW_γ = x̂ᵀ dy from the
  centered x̂ of the dx kernel. Compared with the f32 reference's gradients of the same 16-bit
  values."""
  x, w, scale, bias, ct = _inputs(13, 64, 128, 128, dtype, mean_offset=mean_offset)
  fused, ref = _losses("layer", ct, True, True)
  # Jitted: one program each instead of one compile per eager op.
  got = jax.jit(jax.grad(fused, argnums=(0, 1, 2, 3)))(x, w, scale, bias)
  f32 = [a.astype(jnp.float32) for a in (x, w, scale, bias)]
  want = jax.jit(jax.grad(ref, argnums=(0, 1, 2, 3)))(*f32)
  for name, g, r in zip(["dx", "dw", "dscale", "dbias"], got, want):
    g, r = g.astype(jnp.float32), r.astype(jnp.float32)
    err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    assert err < 2e-2, (name, err)


@pytest.mark.parametrize("implementation", [
    "interpret", pytest.param("mosaic", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("k,n", [
    (256, 256),  # the weight-gradient kernel (x̂ in its registers) and dx without x̂
    (128, 128),  # dW_γ summed by the dx kernel (x̂ in its SMEM A tile)
])
def test_layer_backward_constant_rows(k, n, implementation):
  """LayerNorm rows that are one constant (var exactly 0: the forward keeps rstd = 1/√eps for
  them) among ordinary rows: x̂ must be exactly 0 there, as in the reference, in dW_γ and in dx.
  An x̂ formed as x·rstd − mean·rstd where the compiler fuses it into one FMA carries the
  rounding of mean·rstd instead (up to ~128 at 1e7 · 3162), which dW_γ sums into dw and dscale
  and which reaches dx through its row sum (session 49: dw 0.32 off with rows of 3e5 at eps =
  1e-5, dx 5.8 on a row of 1e6 at 1e-7; EXPERIMENTS.md); the kernels form it as
  (x − mean)·rstd. ptxas fuses such pairs on the GPU; XLA:CPU at the suite's optimization level
  0 does not (then both roundings of x·rstd and mean·rstd are equal and cancel), so only the
  GPU case would see that form fail. Against the f32 reference's gradients of the same bf16
  values."""
  m = 136
  x, w, scale, bias, ct = _inputs(17, m, k, n, jnp.bfloat16)
  rows = {3: 1.0, 40: 100.0, 41: -1e3, 77: 1e4, 100: 3e5, 130: -1e6, 131: 1e7}
  const = np.array(list(rows))
  x = x.at[const].set(jnp.array(list(rows.values()), jnp.bfloat16)[:, None])
  # 1/√eps is no short binary fraction here, so mean·rstd rounds (at eps = 1e-6, rstd = 1000
  # exactly and every bf16 constant times it is exact in f32); and small, so that rounding is
  # large at these constants.
  fused, ref = _losses("layer", ct, True, True, implementation, eps=1e-7)
  got = jax.jit(jax.grad(fused, argnums=(0, 1, 2, 3)))(x, w, scale, bias)
  want = jax.jit(jax.grad(ref, argnums=(0, 1, 2, 3)))(
      *(a.astype(jnp.float32) for a in (x, w, scale, bias)))
  rest = np.delete(np.arange(m), const)
  for name, g, r in [*((f"dx, the row of {c:g}", got[0][i], want[0][i]) for i, c in rows.items()),
                     ("dx, other rows", got[0][rest], want[0][rest]),
                     *zip(["dw", "dscale", "dbias"], got[1:], want[1:])]:
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _rel(g, r) < 1e-2, (name, _rel(g, r))


def _jit_vjp(fn, primals, ct):
  """(fn(*primals), its VJP at ct) as one compiled program: run eagerly, each op of the
  reference and of the XLA path compiled on its own (most of the test's CPU time)."""
  return jax.jit(lambda p: (lambda y, vjp: (y, vjp(ct)))(*jax.vjp(fn, *p)))(primals)


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


FUSED_WITH_GUARD = ["y_term", "y"]
"""The dx kernel calls traced for fused row terms when the norm has a bias: lax.cond traces the
bias-cancellation guard's exact branch (row terms given) and then the fused one (y given); at
run time only one runs."""


@pytest.mark.parametrize("m,k,n,norm,use_affine,lead,route", [
    (77, 320, 192, "layer", True, (), FUSED_WITH_GUARD),
    (64, 320, 128, "rms", False, (2, 4), ["y_term"])])
def test_public_api_interpret_matches_xla(monkeypatch, m, k, n, norm, use_affine, lead, route):
  """pallas_norm.norm_matmul(implementation="interpret"): y and (dx, dw, dscale, dbias) within
  bf16 tolerance (relative Frobenius 2e-2; y 1e-2) of implementation="xla" and of the f32
  reference. Forward and backward each run once (jax.vjp): interpret mode is slow. K = 320
  splits over no cluster, so dx takes the row terms' routes (``route``, as traced): the fused
  row terms for this LayerNorm call (the bias guard's other branch traced, not run), the XLA
  pass for the RMSNorm one, whose weight gradients come from XLA's scaled dy (x̂ would be wider
  than dy). The row sums in the epilogue (K ≤ 256 in interpret mode) run through the op in
  test_lazy_backward_16bit_large_row_mean. The RMSNorm call has leading dimensions ``lead``
  (x (2, 4, 8, K)): flattened for the kernels, restored in y and dx."""
  calls = _spy_on_dx_kernel(monkeypatch)
  x, w, scale, bias, ct = _inputs(21 + m, m, k, n, jnp.bfloat16)
  if lead:
    x, ct = x.reshape(*lead, -1, k), ct.reshape(*lead, -1, n)
  scale, bias = (scale, bias) if use_affine else (None, None)
  ct = ct.astype(jnp.bfloat16)

  def op(implementation):
    return lambda x, w, s, b: pallas_norm.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm,
                                                      implementation=implementation)

  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  y_ref, grads_ref = _jit_vjp(lambda *a: reference.norm_matmul(*a, norm=norm),
                              (*f32((x, w)), scale, bias), ct.astype(jnp.float32))
  for impl in ("interpret", "xla"):
    y, grads = _jit_vjp(op(impl), (x, w, scale, bias), ct)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape[:-1] + (n,), impl
    assert _rel(y, y_ref) < 1e-2, impl
    if impl == "interpret":
      y_interp, grads_interp = y, grads
      assert bool(jnp.all(jnp.isfinite(y))), "the forward kernel left outputs unwritten"
  assert _rel(y_interp, y) < 1e-2
  assert calls == route
  names = ["dx", "dw", "dscale", "dbias"]
  for name, g, g_xla, g_ref in zip(names, grads_interp, grads, grads_ref):
    if g_ref is None:
      assert g is None and g_xla is None, name
      continue
    assert g.dtype == g_xla.dtype and g.shape == g_ref.shape, name
    assert _rel(g, g_xla) < 2e-2, (name, _rel(g, g_xla))
    assert _rel(g, g_ref) < 2e-2, (name, _rel(g, g_ref))


def _check_against_f32_reference(y, grads, x, w, scale, bias, ct, norm):
  """y within 1e-2 and each gradient (dx, dw, dscale, dbias) finite, within 2e-2 of the largest
  entry of the f32 reference's elementwise, and within 2e-2 relative (Frobenius)."""
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, grads_ref = _jit_vjp(lambda *a: reference.norm_matmul(*a, norm=norm),
                              (f32(x), f32(w), scale, bias), f32(ct))
  assert _rel(y, y_ref) < 1e-2
  chex.assert_trees_all_equal_shapes(grads, grads_ref)
  for name, g, r in zip(["dx", "dw", "dscale", "dbias"], grads, grads_ref):
    assert bool(jnp.all(jnp.isfinite(g))), name
    top = float(jnp.max(jnp.abs(r)))
    chex.assert_trees_all_close(f32(g) / top, r / top, atol=2e-2, rtol=0, custom_message=name)
    assert _rel(g, r) < 2e-2, (name, _rel(g, r))


def _traced(expected, with_bias=True):
  """``expected`` kernel calls as traced: a fused call ["y"] comes with the guard's branch."""
  return FUSED_WITH_GUARD if with_bias and expected == ["y"] else expected


def _spy_on_dx_kernel(monkeypatch, run_kernel=True):
  """Replaces the dx kernel's launch (what the op's backward calls) by a wrapper that records
  which row-term inputs each call got: "y" (fused row terms), "y_term" (the XLA pass) or
  "row_sums" (the row sums in the epilogue); without ``run_kernel`` it returns zeros."""
  calls, real = [], nmb.launch

  def spy(dy, w_gamma, x, *args, **kwargs):
    calls.append("row_sums" if kwargs.get("row_sums") else
                 "y" if kwargs.get("y") is not None else "y_term")
    if run_kernel:
      return real(dy, w_gamma, x, *args, **kwargs)
    return _zero_launch_outputs(dy, x, kwargs)

  monkeypatch.setattr(nmb, "launch", spy)
  return calls


@pytest.mark.parametrize("y_dtype,expected", [
    (jnp.bfloat16, ["y"]),  # by shape: LayerNorm, K = N = 64 <= 512
    (jnp.float32, ["y_term"]),  # out_dtype f32: y not in x's dtype
])
def test_input_grad_row_terms_dtype(monkeypatch, y_dtype, expected):
  """Which row-term path _input_grad takes by the output dtype (no kernel runs)."""
  _check_row_terms_route(monkeypatch, y_dtype, expected, 64, 64)


@pytest.mark.parametrize("k,n,norm,expected", [
    (512, 512, "layer", ["y"]), (512, 1024, "layer", ["y_term"]), (1024, 512, "layer", ["y_term"]),
    (128, 256, "layer", ["y"]), (512, 512, "rms", ["y_term"]), (128, 128, "rms", ["y_term"])])
def test_row_terms_default_by_shape(monkeypatch, k, n, norm, expected):
  """Fused for LayerNorm up to K, N <= FUSED_ROW_TERMS_MAX_KN (measured faster at 512², slower
  at 2048²), never for RMSNorm (slower in the whole backward)."""
  _check_row_terms_route(monkeypatch, jnp.bfloat16, expected, k, n, norm)


def _check_row_terms_route(monkeypatch, y_dtype, expected, k, n, norm="layer"):
  """The route of dx's row terms where the epilogue's row sums are not taken."""
  calls = _spy_on_dx_kernel(monkeypatch, run_kernel=False)
  m = 16
  x, w, scale, bias, ct = _inputs(3, m, k, n, jnp.bfloat16)
  w_gamma, col_sum, out_bias = nm_xla.fold_affine(w, scale, bias, norm)
  y = jnp.ones((m, n), y_dtype)
  rows = jnp.ones((m,), jnp.float32)
  dx = nm._input_grad(ct.astype(y_dtype), x, w_gamma, col_sum, out_bias, y,
                      None if norm == "rms" else rows, rows, interpret=False, row_sums=False,
                      x_hat=False)
  assert calls == _traced(expected) and dx.shape == x.shape


@pytest.mark.parametrize("k,n,norm,x_hat", [
    (512, 512, "layer", True), (1024, 512, "layer", True), (512, 2048, "rms", True),
    (512, 512, "rms", False), (1024, 512, "rms", False)])
def test_weight_grads_take_x_hat_by_shape(monkeypatch, k, n, norm, x_hat):
  """The backward asks the dx kernel for x̂ (dW_γ = x̂ᵀ dy) for LayerNorm, and for RMSNorm
  where x̂ (M × K) is smaller than the scaled dy it replaces (M × N); no kernel runs."""
  kwargs_seen = _spy_on_launch(monkeypatch)
  x, w, scale, bias, _ = _inputs(3, 16, k, n, jnp.bfloat16)
  _trace_grads(x, w, scale, bias, norm)
  assert kwargs_seen and {kw["x_hat"] for kw in kwargs_seen} == {x_hat}


def _spy_on_launch(monkeypatch) -> list:
  """Replaces the dx kernel's launch by zeros of its outputs; returns the list its keyword
  arguments are appended to."""
  kwargs_seen = []

  def spy(dy, w_gamma, x, *args, **kwargs):
    kwargs_seen.append(kwargs)
    return _zero_launch_outputs(dy, x, kwargs)

  monkeypatch.setattr(nmb, "launch", spy)
  return kwargs_seen


def _zero_launch_outputs(dy, x, kwargs):
  """Zeros shaped as the dx kernel's launch returns them for ``kwargs``: dx; with x̂ (wider by
  its ones block), Σ_i dy_i where asked (also without x̂: the weight-gradient kernel's route),
  and dW_γ (K, N) where asked."""
  sums = (jnp.zeros((dy.shape[1],), jnp.float32),) if kwargs.get("dy_col_sums") else ()
  if kwargs.get("dw_gamma"):
    return (jnp.zeros_like(x), *sums, jnp.zeros((x.shape[1], dy.shape[1]), jnp.float32))
  if not kwargs.get("x_hat"):
    return (jnp.zeros_like(x), *sums) if sums else jnp.zeros_like(x)
  x_hat = jnp.zeros((x.shape[0], x.shape[1] + 32 * kwargs.get("x_hat_ones", False)), x.dtype)
  return (jnp.zeros_like(x), x_hat, *sums)


def _trace_grads(x, w, scale, bias, norm, out_dtype=None):
  """Traces the op's backward under jax.eval_shape: no kernel runs."""
  grads = jax.grad(lambda x, w, s, b: pallas_norm.norm_matmul(
      x, w, scale=s, norm_bias=b, norm=norm, implementation="interpret",
      out_dtype=out_dtype).astype(jnp.float32).sum(),
                   argnums=(0, 1, 2, 3) if bias is not None else (0, 1, 2))
  jax.eval_shape(grads, x, w, scale, bias)


@pytest.mark.parametrize("m,k,n,bias,sums,ones", [
    (16, 128, 128, True, True, False),  # row sums in the epilogue, 64-wide steps
    (16, 128, 128, False, False, False),  # no norm bias: no sums wanted
    (16, 256, 320, True, False, True),  # 32-wide steps: the ones block gives them
    (16, 320, 128, True, False, True),  # K = 320: no row sums in the epilogue, so no sums
])
def test_bias_grads_take_dy_col_sums_where_the_kernel_can(monkeypatch, m, k, n, bias, sums,
                                                          ones):
  """A norm bias's gradients take Σ_i dy_i from the dx kernel where it can sum them
  (dy_col_sums_unsupported_reason), else from x̂'s ones block; no kernel runs. The x̂ route:
  the weight-gradient kernel off (it reads no x̂, so no ones block: the test below)."""
  monkeypatch.setattr(nm_routing, "weight_grad_kernel_pays", lambda k, n: False)
  kwargs_seen = _spy_on_launch(monkeypatch)
  x, w, scale, b, _ = _inputs(5, m, k, n, jnp.bfloat16)
  _trace_grads(x, w, scale, b if bias else None, "layer")
  assert kwargs_seen and all(kw["dy_col_sums"] == sums and kw["x_hat_ones"] == ones
                             for kw in kwargs_seen), kwargs_seen


def test_bias_grads_with_the_weight_grad_kernel_take_dy_col_sums(monkeypatch):
  """Where the weight-gradient kernel makes x̂ from x (K = 256, N = 320 here), the dx kernel
  writes no x̂ and so no ones block: Σ_i dy_i comes from its column sums; no kernel runs."""
  monkeypatch.setattr(nm_routing, "weight_grad_kernel_pays", lambda k, n: True)
  kwargs_seen = _spy_on_launch(monkeypatch)
  x, w, scale, b, _ = _inputs(5, 16, 256, 320, jnp.bfloat16)
  _trace_grads(x, w, scale, b, "layer")
  assert kwargs_seen and all(kw["dy_col_sums"] and not kw["x_hat"] and not kw["x_hat_ones"]
                             for kw in kwargs_seen), kwargs_seen


def test_bias_grads_of_a_float32_output_keep_the_ones_block(monkeypatch):
  """With out_dtype float32 the cotangent is float32: the kernel would sum it rounded to x's
  dtype, so the bias's Σ_i dy_i stays in dW_γ's GEMM, which reads dy as it came (a review
  found dβ's error 1.5e-3 instead of 3e-7 there, and 1.0 for a near-cancelling dy)."""
  kwargs_seen = _spy_on_launch(monkeypatch)
  x, w, scale, b, _ = _inputs(5, 16, 128, 128, jnp.bfloat16)
  _trace_grads(x, w, scale, b, "layer", out_dtype=jnp.float32)
  assert kwargs_seen and all(not kw["dy_col_sums"] and kw["x_hat_ones"] for kw in kwargs_seen)


@pytest.mark.parametrize("m,n,norm,bias", [(200, 128, "layer", True), (64, 64, "rms", False)])
def test_dw_gamma_from_the_dx_kernel_matches_reference(monkeypatch, m, n, norm, bias):
  """At K = 128, N ≤ 128 the backward takes dW_γ = x̂ᵀ dy from the dx kernel (no x̂, no GEMM of
  its own): the gradients of the public op (interpret mode) against the f32 reference's, and
  the route asked of the kernel."""
  routes = []
  real_launch = nmb.launch
  monkeypatch.setattr(nmb, "launch", lambda *a, **kw: routes.append(kw) or real_launch(*a, **kw))
  x, w, scale, b, ct = _inputs(7, m, 128, n, jnp.bfloat16, mean_offset=2.0)
  b = b if bias else None
  ct = ct.astype(jnp.bfloat16)
  op = lambda x, w, s, b: pallas_norm.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm,
                                                  implementation="interpret")
  y, vjp = jax.vjp(op, x, w, scale, b)
  grads = vjp(ct)
  assert routes and all(kw["dw_gamma"] and not kw["x_hat"] and kw["dy_col_sums"] == bias
                        for kw in routes), routes
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.norm_matmul(*a, norm=norm), f32(x), f32(w),
                           scale, b)
  for name, g, g_ref in zip(["dx", "dw", "dscale", "dbias"], grads, vjp_ref(f32(ct))):
    if g_ref is None:
      continue
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _rel(g, g_ref) < 2e-2, (name, _rel(g, g_ref))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096 + 77, 512, 512), (16384, 320, 320),
                                   (8192, 512, 2048), (16384, 128, 128)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gpu_public_api_gradients(m, k, n, norm):
  """implementation="mosaic" (both kernels compiled) against the f32 reference's gradients. dx
  takes the row sums in its epilogue at K = 512 (a cluster of 2), and for the norm bias's
  gradients sums dy's columns at M % 8 = 0 (else x̂'s ones block); K = 320 splits over no
  cluster: the fused row terms (LayerNorm) and the XLA row-terms pass (RMSNorm); at 128² the
  dx kernel also sums dW_γ."""
  x, w, scale, bias, ct = _inputs(m + n, m, k, n, jnp.bfloat16)
  ct = ct.astype(jnp.bfloat16)
  op = lambda x, w, s, b: pallas_norm.norm_matmul(x, w, scale=s, norm_bias=b, norm=norm,
                                                  implementation="mosaic")
  y, vjp = jax.vjp(op, x, w, scale, bias)
  grads = vjp(ct)
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.norm_matmul(*a, norm=norm), f32(x), f32(w),
                           scale, bias)
  assert _rel(y, y_ref) < 1e-2
  for name, g, g_ref in zip(["dx", "dw", "dscale", "dbias"], grads, vjp_ref(f32(ct))):
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert _rel(g, g_ref) < 2e-2, (name, _rel(g, g_ref))


def _jitted_layer_large_mean_errors(m=4096 + 77, k=512, n=512, mean_offset=250.0,
                                    implementation="mosaic"):
  """Relative errors of y, dx, dw, dscale, dbias of the public op (both kernels) run as one
  jitted program, LayerNorm rows of mean ``mean_offset``, against the f32 reference."""
  x, w, scale, bias, ct = _inputs(41, m, k, n, jnp.bfloat16, mean_offset=mean_offset)
  ct = ct.astype(jnp.bfloat16)
  op = lambda x, w, s, b: pallas_norm.norm_matmul(x, w, scale=s, norm_bias=b, norm="layer",
                                                  implementation=implementation)

  @jax.jit
  def run(x, w, scale, bias, ct):
    y, vjp = jax.vjp(op, x, w, scale, bias)
    return y, vjp(ct)

  y, grads = run(x, w, scale, bias, ct)
  f32 = lambda a: a.astype(jnp.float32)
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.norm_matmul(*a, norm="layer"), f32(x), f32(w),
                           scale, bias)
  names = ["y", "dx", "dw", "dscale", "dbias"]
  return dict(zip(names, (_rel(g, r) for g, r in zip([y, *grads], [y_ref, *vjp_ref(f32(ct))]))))


@pytest.mark.gpu
def test_gpu_jitted_layer_large_mean():
  """The public op as one jitted program on the GPU, where XLA may widen a value rounded to bf16
  back to its unrounded f32 (simplify-fp-conversions): every sum that must cancel against a
  product of rounded operands (the fold's col_sum, xla._stored) reads the stored array; rows of
  mean 250 multiply any mismatch."""
  errors = _jitted_layer_large_mean_errors()
  assert errors.pop("y") < 1e-2
  for name, err in errors.items():
    assert err < 2e-2, (name, err)


def test_default_implementation_prefers_xla_where_the_kernel_is_measured_slower(monkeypatch):
  """implementation=None on a Hopper GPU: the kernel only at shapes where it was measured faster."""
  from pallas_norm import _dispatch
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  ok = lambda _: None  # noqa: E731  (the kernel supports the call)
  pick = lambda reason: _dispatch.choose("op", None, ok, lambda: reason)
  # Thresholds from the H200's forward+backward measurements, per norm (M = 262144 rows).
  m = 262144
  assert pick(nm_routing.kernel_slower_reason(m, 512, 512, "rms")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(m, 1024, 1024, "rms")) == "mosaic"
  # K = 512, N = 2048: RMSNorm faster with x̂ (2854 vs 3384 µs), LayerNorm with the row sums
  # in the dx epilogue (2636 vs 2938 µs); LayerNorm's forward alone stays on XLA (932 vs 881).
  assert pick(nm_routing.kernel_slower_reason(m, 512, 2048, "rms")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(m, 1024, 2048, "rms")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(m, 512, 2048, "layer")) == "mosaic"
  # K = 320 or 448 does not split over a cluster: LayerNorm's backward would take the XLA
  # row-terms pass and the bias guard, measured slower than XLA at 512x2048 (3540 vs 3236).
  assert pick(nm_routing.kernel_slower_reason(m, 320, 2048, "layer")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(m, 448, 1536, "layer")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(m, 384, 2048, "layer")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(m, 448, 2048, "rms")) == "mosaic"
  assert pick(nm_routing.kernel_slower_forward_reason(m, 512, 2048, "layer")) == "xla"
  assert pick(nm_routing.kernel_slower_forward_reason(m, 512, 2048, "rms")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(m, 1024, 1024, "layer")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(m, 2048, 512, "layer")) == "xla"
  # LayerNorm at K = N = 2048 trains faster (11484 vs 12544 µs), the forward ties.
  assert pick(nm_routing.kernel_slower_reason(m, 2048, 2048, "layer")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(65536, 2048, 2048, "layer")) == "mosaic"
  # RMSNorm at K = N = 2048: faster at 65536 rows (2406 vs 2519 µs), slower at 262144 (10640
  # vs 9892): the rule is by M too.
  assert pick(nm_routing.kernel_slower_reason(m, 2048, 2048, "rms")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(65536, 2048, 2048, "rms")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(131072, 2048, 2048, "rms")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(32768, 2048, 2048, "rms")) == "xla"  # small M
  assert pick(nm_routing.kernel_slower_reason(65536, 1024, 2048, "rms")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(m, 4096, 4096, "layer")) == "xla"
  assert pick(mn_routing.kernel_slower_reason(m, 512, 128, "rms")) == "mosaic"
  assert pick(mn_routing.kernel_slower_reason(m, 512, 512, "rms")) == "mosaic"
  # RMSNorm at K = N = 1024 trains faster with the kernel at 262144 rows (2878 vs 2995 µs),
  # the one M measured there.
  assert pick(mn_routing.kernel_slower_reason(m, 1024, 1024, "rms")) == "mosaic"
  assert pick(mn_routing.kernel_slower_reason(65536, 1024, 1024, "rms")) == "xla"
  assert pick(mn_routing.kernel_slower_reason(m, 1024, 2048, "rms")) == "xla"
  assert pick(mn_routing.kernel_slower_reason(m, 2048, 1024, "rms")) == "xla"
  assert pick(mn_routing.kernel_slower_reason(m, 1024, 1024, "layer")) == "mosaic"
  assert pick(mn_routing.kernel_slower_reason(m, 512, 2048, "layer")) == "mosaic"
  assert pick(mn_routing.kernel_slower_reason(m, 1024, 4096, "layer")) == "xla"
  # LayerNorm at K = 512, N = 4096 trains faster with the kernel (13303 vs 14565 µs).
  assert pick(mn_routing.kernel_slower_reason(m, 512, 4096, "layer")) == "mosaic"
  assert pick(mn_routing.kernel_slower_reason(m // 2, 512, 8192, "layer")) == "xla"
  assert pick(mn_routing.kernel_slower_reason(65536, 512, 2048, "layer")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(65536, 1024, 1024, "layer")) == "mosaic"
  # Small M (the Kunlun model's batch-sized layers, M = 768): the post-norm kernel trains
  # slower at M = 768 and faster from 4096 (LayerNorm + residual, 1024²: 97.8 vs 160.2 µs); the
  # pre-norm kernel slower through 16384 (LayerNorm, K = 576, N = 512).
  assert pick(mn_routing.kernel_slower_reason(768, 1024, 1024, "layer")) == "xla"
  assert pick(mn_routing.kernel_slower_reason(4096, 1024, 1024, "layer")) == "mosaic"
  assert pick(nm_routing.kernel_slower_reason(768, 576, 512, "layer")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(16384, 576, 512, "layer")) == "xla"
  assert pick(nm_routing.kernel_slower_reason(768, 512, 1024, "rms")) == "xla"
  # An explicit request is honoured even where the kernel is slower.
  assert _dispatch.choose("op", "mosaic", ok, lambda: "slower") == "mosaic"


def test_default_forward_alone_takes_the_path_measured_faster_forward(monkeypatch):
  """implementation=None on a Hopper GPU: a call that is not differentiated follows the forward's
  measurements where they disagree with training's (H200, the suite, M = 262144)."""
  from pallas_norm import _dispatch
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  ok = lambda _: None  # noqa: E731

  def uses(routing, *dims):
    return _dispatch.choose_by_use("op", None, ok, lambda: routing.kernel_slower_reason(*dims),
                                   lambda: routing.kernel_slower_forward_reason(*dims))

  m = 262144
  # matmul_norm LayerNorm at 512×4096: forward 4904 (kernel) vs 3218, fwd+bwd 13303 vs 14565.
  assert uses(mn_routing, m, 512, 4096, "layer") == ("xla", "mosaic")
  # matmul_norm RMSNorm: forward 872 vs 969 at 1024², 1096 vs 1266 at 512×2048; at 1024²
  # it also trains faster (2878 vs 2995 µs at 262144 rows, the M measured), at 1024×2048 slower.
  assert uses(mn_routing, m, 1024, 1024, "rms") == ("mosaic", "mosaic")
  assert uses(mn_routing, 65536, 1024, 1024, "rms") == ("mosaic", "xla")
  # RMSNorm at 512×2048 trains with the kernel since its norm backward is the row kernel
  # (3832.5 vs 4127.7 µs).
  assert uses(mn_routing, m, 512, 2048, "rms") == ("mosaic", "mosaic")
  assert uses(mn_routing, m, 1024, 2048, "rms") == ("mosaic", "xla")
  assert uses(mn_routing, m, 2048, 2048, "rms") == ("xla", "xla")
  assert uses(mn_routing, m, 512, 512, "rms") == ("mosaic", "mosaic")
  assert uses(mn_routing, m, 2048, 2048, "layer") == ("mosaic", "mosaic")
  assert uses(mn_routing, 768, 1024, 1024, "rms") == ("xla", "xla")
  # norm_matmul RMSNorm at K = N = 2048: forward 2994 vs 3291 (65536 rows: 759 vs 820);
  # training faster at 65536 rows only (2406 vs 2519; 262144: 10640 vs 9892).
  assert uses(nm_routing, m, 2048, 2048, "rms") == ("mosaic", "xla")
  assert uses(nm_routing, 65536, 2048, 2048, "rms") == ("mosaic", "mosaic")
  assert uses(nm_routing, m, 4096, 4096, "rms") == ("xla", "xla")
  # norm_matmul LayerNorm at 512×2048: forward 881 (XLA) vs 932, fwd+bwd 2636 (kernel) vs 2938.
  assert uses(nm_routing, m, 512, 2048, "layer") == ("xla", "mosaic")
  assert uses(nm_routing, m, 1024, 1024, "layer") == ("mosaic", "mosaic")
  # norm_matmul LayerNorm at K = N = 2048: forward 3426 (kernel) vs 3399 (XLA), 65536 rows 881
  # vs 850; fwd+bwd 11484 vs 12544, 2604 vs 2854 (the forward took the kernel until session 33).
  assert uses(nm_routing, m, 2048, 2048, "layer") == ("xla", "mosaic")
  assert uses(nm_routing, 65536, 2048, 2048, "layer") == ("xla", "mosaic")
  # An explicit implementation is used for both.
  assert _dispatch.choose_by_use("op", "xla", ok, lambda: None, lambda: "slower") == ("xla", "xla")


def test_choose_by_use_asks_the_kernel_once(monkeypatch):
  """implementation=None: the two uses share one answer of the kernel's unsupported_reason."""
  from pallas_norm import _dispatch
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  asked = []
  uses = _dispatch.choose_by_use("op", None, lambda c: asked.append(c), lambda: None,
                                 lambda: "slower")
  assert uses == ("xla", "mosaic") and asked == ["mosaic"], (uses, asked)


def test_choose_by_use_logs_each_use_once(monkeypatch, caplog):
  """implementation=None: one debug line per use that takes XLA, saying which use it is (a
  new-user review saw the same line twice per call)."""
  from pallas_norm import _dispatch
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  with caplog.at_level("DEBUG", logger="pallas_norm"):
    _dispatch.choose_by_use("op", None, lambda c: None, lambda: "slow to train",
                            lambda: "slow forward")
  assert [r.getMessage() for r in caplog.records] == [
      "op (a call that is not differentiated): using XLA: slow forward",
      "op (training): using XLA: slow to train"]


@pytest.mark.parametrize("op,uses", [("norm_matmul", ("xla", "interpret")),
                                     ("matmul_norm", ("interpret", "xla"))])
def test_forward_alone_and_training_run_their_own_paths(monkeypatch, op, uses):
  """Where implementation=None picks different paths for the two uses, the op's value is the
  forward path's and its gradients (jit, grad) are the training path's, with return_stats."""
  from pallas_norm import _dispatch
  from pallas_norm.ops.matmul_norm import api as mn
  monkeypatch.setattr(_dispatch, "choose_by_use", lambda *a, **k: uses)
  x, w, scale, bias, ct = _inputs(31, 64, 64, 128, jnp.bfloat16)
  if op == "matmul_norm":
    scale, bias = scale.astype(jnp.bfloat16)[:64], bias.astype(jnp.bfloat16)[:64]
    w = w[:, :64]
    ct = ct[:, :64]

  def call(impl, x, w, scale, bias):
    if op == "norm_matmul":
      return nm.norm_matmul(x, w, scale=scale, norm_bias=bias, norm="layer", return_stats=True,
                            implementation=impl)
    return mn.matmul_norm(x, w, scale=scale, norm_bias=bias, norm="layer", return_stats=True,
                          implementation=impl)

  def loss(impl, *args):
    y, stats = call(impl, *args)
    return jnp.sum(y.astype(jnp.float32) * ct) + jnp.sum(stats.rstd)

  args = (x, w, scale, bias)
  both = jax.jit(lambda *a: call(None, *a))(*args)
  chex.assert_trees_all_equal(both, jax.jit(lambda *a: call(uses[0], *a))(*args))
  grads = jax.jit(jax.grad(lambda *a: loss(None, *a), argnums=(0, 1, 2, 3)))(*args)
  want = jax.jit(jax.grad(lambda *a: loss(uses[1], *a), argnums=(0, 1, 2, 3)))(*args)
  chex.assert_trees_all_equal(grads, want)


def _composed_spy(monkeypatch):
  from pallas_norm.ops.matmul_norm import api as mn
  calls, real = [], mn._composed_training
  monkeypatch.setattr(mn, "_composed_training",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  return calls


def test_composed_training_route(monkeypatch):
  """Where training on the kernel path runs composed (routing.composed_training_reason, RMSNorm
  K = N = 1024 from 262144 rows, scaled down here): the value of a call that is not
  differentiated is the fused kernel's; its gradients are exactly those of the GEMM then
  pallas_norm.rms_norm's kernels, and within bf16 rounding of the f32 reference. A norm bias,
  a returned h or statistics, float16 or an explicit implementation keep the fused kernel."""
  from pallas_norm import _dispatch
  from pallas_norm.ops.matmul_norm import api as mn
  real = _dispatch.choose_by_use
  monkeypatch.setattr(_dispatch, "choose_by_use", lambda op, impl, *a, **k: (
      ("interpret", "interpret") if impl is None else real(op, impl, *a, **k)))
  monkeypatch.setattr(mn_routing, "RMS_SQUARE_TRAINING_KN", 64)
  monkeypatch.setattr(mn_routing, "RMS_SQUARE_TRAINING_MIN_M", 40)
  calls = _composed_spy(monkeypatch)
  x, w, scale, bias, ct = _inputs(37, 40, 64, 64, jnp.bfloat16)
  scale, bias, ct = scale[:64].astype(jnp.bfloat16), bias[:64], ct.astype(jnp.bfloat16)

  def op(impl, **kw):
    return lambda x, w, s: mn.matmul_norm(x, w, scale=s, norm="rms", implementation=impl, **kw)

  def vjp(f, *args):
    y, pull = jax.vjp(f, *args)
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
    return y, pull(ct if not isinstance(y, tuple) else (ct,) + tuple(map(zeros, y[1:])))

  def composed(x, w, s):  # the route's math with rms_norm's kernels named explicitly
    return pallas_norm.rms_norm(jnp.matmul(x, w), s, implementation="interpret")

  args = (x, w, scale)
  chex.assert_trees_all_equal(jax.jit(op(None))(*args), jax.jit(op("interpret"))(*args))
  assert calls == []  # not differentiated: the fused kernel
  y, grads = jax.jit(lambda *a: vjp(op(None), *a))(*args)
  assert calls == [1]
  chex.assert_trees_all_equal((y, grads), jax.jit(lambda *a: vjp(composed, *a))(*args))
  f32 = [a.astype(jnp.float32) for a in args]
  y_ref, pull_ref = jax.vjp(
      lambda x, w, s: reference.matmul_norm(x, w, None, None, s, None, norm="rms"), *f32)
  assert _rel(y, y_ref) < 1e-2
  for name, g, r in zip(["dx", "dw", "dscale"], grads, pull_ref(ct.astype(jnp.float32))):
    assert _rel(g, r) < 2e-2, name
  # Calls the composed route was not measured for keep the fused kernel in training (traced
  # only: the route is chosen while tracing).
  for kw in (dict(norm_bias=bias), dict(return_stats=True), dict(return_h=True)):
    jax.eval_shape(lambda *a, kw=kw: vjp(op(None, **kw), *a), *args)
  jax.eval_shape(lambda *a: vjp(op("interpret"), *a), *args)
  f16 = (x.astype(jnp.float16), w.astype(jnp.float16), scale)
  jax.eval_shape(lambda *a: jax.vjp(op(None), *a)[0], *f16)
  assert calls == [1]
  jax.eval_shape(lambda *a: vjp(op(None), *a), *args)
  assert calls == [1, 1]  # and tracing does see the route where it applies


def test_composed_training_reason():
  m = 262144
  assert mn_routing.composed_training_reason(m, 1024, 1024, "rms") is None
  assert mn_routing.composed_training_reason(m // 4, 1024, 1024, "rms") is not None
  assert mn_routing.composed_training_reason(m, 1024, 1024, "layer") is not None
  assert mn_routing.composed_training_reason(m, 512, 512, "rms") is not None
  assert mn_routing.composed_training_reason(m, 1024, 2048, "rms") is not None


@pytest.mark.gpu
def test_gpu_composed_training_matches_reference(monkeypatch):
  """The composed training route at its measured shape on the GPU (the standalone RMSNorm
  kernels after cuBLAS's GEMM): gradients within bf16 rounding of the f32 reference."""
  from pallas_norm.ops.matmul_norm import api as mn
  calls = _composed_spy(monkeypatch)
  m, k, n = 262144, 1024, 1024
  x, w, scale, _, ct = _inputs(41, m, k, n, jnp.bfloat16)
  scale, ct = _inputs(42, 1, n, n, jnp.float32)[2], ct.astype(jnp.bfloat16)
  op = lambda x, w, s: mn.matmul_norm(x, w, scale=s, norm="rms")  # noqa: E731
  y, grads = jax.jit(lambda *a: (lambda r: (r[0], r[1](ct)))(jax.vjp(op, *a)))(x, w, scale)
  assert calls == [1]
  f32 = [a.astype(jnp.float32) for a in (x, w, scale)]
  y_ref, pull_ref = jax.vjp(
      lambda x, w, s: reference.matmul_norm(x, w, None, None, s, None, norm="rms"), *f32)
  assert _rel(y, y_ref) < 1e-2
  for name, g, r in zip(["dx", "dw", "dscale"], grads, pull_ref(ct.astype(jnp.float32))):
    assert _rel(g, r) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("norm,k,n,uses", [("rms", 1024, 1024, ("mosaic", "xla")),
                                           ("layer", 512, 4096, ("xla", "mosaic"))])
def test_gpu_default_runs_each_use_on_its_path(norm, k, n, uses):
  """matmul_norm with implementation=None where the forward alone and training take different
  paths (routing): jitted, the forward equals the forward path's and the gradients the training
  path's to rounding, and both match the f32 reference."""
  from pallas_norm.ops.matmul_norm import api as mn
  from pallas_norm import _dispatch
  m = 4096
  x, w, scale, bias, ct = _inputs(m + k + n, m, k, n, jnp.bfloat16)
  scale, bias = _inputs(n, 1, n, 1, jnp.float32)[2:4]
  args = (x, w, scale, bias if norm == "layer" else None)
  ct = ct.astype(jnp.bfloat16)
  assert _dispatch.choose_by_use(
      "matmul_norm", None, lambda _: None,
      lambda: mn_routing.kernel_slower_reason(m, k, n, norm),
      lambda: mn_routing.kernel_slower_forward_reason(m, k, n, norm)) == uses

  def op(impl):
    return lambda x, w, s, b: mn.matmul_norm(x, w, scale=s, norm_bias=b, norm=norm,
                                             implementation=impl)

  def vjp(impl):
    return jax.jit(lambda *a: jax.vjp(op(impl), *a)[1](ct))(*args)

  y = jax.jit(op(None))(*args)
  assert _rel(y, jax.jit(op(uses[0]))(*args)) < 1e-3
  f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
  y_ref, vjp_ref = jax.vjp(lambda *a: reference.matmul_norm(a[0], a[1], None, None, *a[2:],
                                                            norm=norm), *map(f32, args))
  assert _rel(y, y_ref) < 1e-2
  for g, g_path, g_ref in zip(vjp(None), vjp(uses[1]), vjp_ref(f32(ct))):
    if g_ref is not None:
      assert _rel(g, g_path) < 1e-3 and _rel(g, g_ref) < 2e-2


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_returned_stats_carry_no_gradient_on_any_path(op):
  """The fused paths return statistics through lax.stop_gradient; the XLA path must too, or the
  same loss would differentiate differently on a CPU and on a Hopper GPU (review finding)."""
  from pallas_norm.ops.matmul_norm import api as mn
  x, w, scale, bias, _ = _inputs(21, 16, 64, 64, jnp.float32, mean_offset=1.0)

  def loss(x, with_stats):
    if op == "norm_matmul":
      y, stats = nm.norm_matmul(x, w, scale=scale, norm_bias=bias, norm="layer", return_stats=True,
                                implementation="xla")
    else:
      y, stats = mn.matmul_norm(x, w, scale=scale[:64], norm_bias=bias[:64], norm="layer",
                                return_stats=True, implementation="xla")
    total = jnp.sum(y * y)
    return total + jnp.sum(stats.rstd) + jnp.sum(stats.mean) if with_stats else total

  chex.assert_trees_all_close(jax.grad(loss)(x, True), jax.grad(loss)(x, False), rtol=1e-6)


@pytest.mark.parametrize("norm,scale_size,bias_size", [
    ("layer", 1e-3, 1.0),   # review finding: dx was 28% off (fused row terms)
    ("rms", 1e-3, 1.0),     # the XLA row-terms pass
    ("layer", 0.0, 1.0),    # a zero scale: the true dx is exactly 0
    ("layer", 1.0, 100.0),  # a large bias, ratio ~100: was 1.3% off
])
def test_dx_stays_accurate_when_the_bias_dwarfs_the_scale(norm, scale_size, bias_size):
  """y' = y − βᵀW rebuilt from the rounded y cancels when |βᵀW| ≫ ‖W_γ[:, j]‖; past
  BIAS_CANCELLATION_LIMIT the backward recomputes y' exactly, so dx stays as accurate as XLA's.
  K = 320: in interpret mode K ≤ 256 takes the row sums in the dx epilogue, which read no y and
  have no guard; at 320 LayerNorm takes the fused row terms, RMSNorm the XLA row-terms pass."""
  k = 320
  x, w, _, _, ct = _inputs(31, 64, k, 128, jnp.bfloat16)
  ks = jax.random.split(jax.random.key(32), 2)
  scale = scale_size * (1.0 + 0.1 * jax.random.normal(ks[0], (k,), jnp.float32))
  bias = bias_size * jax.random.normal(ks[1], (k,), jnp.float32)
  w_gamma, out_bias = scale[:, None] * w.astype(jnp.float32), bias @ w.astype(jnp.float32)
  assert float(nm_xla.bias_cancellation(w_gamma, out_bias)) > nm_xla.BIAS_CANCELLATION_LIMIT
  dx_ref = _reference_dx(x, w, scale, bias, ct, norm=norm)
  _check_dx_accuracy_under_bias_cancellation(x, w, scale, bias, ct, norm, scale_size, dx_ref,
                                             ("interpret",))


@functools.partial(jax.jit, static_argnames=("norm",))
def _reference_dx(x, w, scale, bias, ct, *, norm):
  """dx of the f32 reference as one program (eagerly, each op compiled on its own), shared by
  the cases of a norm."""
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  _, vjp_ref = jax.vjp(lambda x: reference.norm_matmul(x, f32(w), scale, bias, norm=norm), f32(x))
  return vjp_ref(ct)[0]


@functools.partial(jax.jit, static_argnames=("norm", "impl"))
def _kernel_dx(x, w, scale, bias, ct, *, norm, impl):
  """dx of the public op as one program: the cases of a norm share its compile (the guard's
  lax.cond picks the branch from the values)."""
  _, vjp = jax.vjp(lambda x: pallas_norm.norm_matmul(x, w, scale=scale, norm_bias=bias, norm=norm,
                                                     implementation=impl), x)
  return vjp(ct.astype(jnp.bfloat16))[0]


def _check_dx_accuracy_under_bias_cancellation(x, w, scale, bias, ct, norm, scale_size, dx_ref,
                                               impls):
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  for impl in impls:
    dx = _kernel_dx(x, w, scale, bias, ct, norm=norm, impl=impl)
    if scale_size == 0.0:
      assert float(jnp.max(jnp.abs(f32(dx)))) == 0.0, impl
    else:
      assert _rel(dx, dx_ref) < 1e-2, (impl, _rel(dx, dx_ref))


def test_bias_cancellation_is_small_for_usual_parameters():
  """The guard's extra GEMM runs only for unusual parameters: a unit scale with a bias of 0.3
  (these tests' inputs) or of 1 stays far below the limit."""
  _, w, scale, bias, _ = _inputs(33, 8, 512, 512, jnp.bfloat16)
  wf = w.astype(jnp.float32)
  for b in (bias, bias / 0.3):
    assert float(nm_xla.bias_cancellation(scale[:, None] * wf, b @ wf)) < nm_xla.BIAS_CANCELLATION_LIMIT / 4


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_gpu_dx_stays_accurate_when_the_bias_dwarfs_the_scale(norm):
  """The lax.cond of the bias-cancellation guard around the dx kernel, on the GPU. K = 320: it
  splits over no cluster, so the row sums in the dx epilogue (no guard: K = 512 took them) do
  not run; LayerNorm takes the fused row terms, RMSNorm the XLA row-terms pass."""
  k = 320
  x, w, _, _, ct = _inputs(34, 4096 + 77, k, 512, jnp.bfloat16)
  ks = jax.random.split(jax.random.key(35), 2)
  scale = 1e-3 * (1.0 + 0.1 * jax.random.normal(ks[0], (k,), jnp.float32))
  bias = jax.random.normal(ks[1], (k,), jnp.float32)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  _, vjp_ref = jax.vjp(lambda x: reference.norm_matmul(x, f32(w), scale, bias, norm=norm), f32(x))
  (dx_ref,) = vjp_ref(ct)
  _check_dx_accuracy_under_bias_cancellation(x, w, scale, bias, ct, norm, 1e-3, dx_ref,
                                             ("mosaic",))


def test_xla_rms_is_as_accurate_as_the_kernel():
  """Issue 18.4: the XLA path rounded norm(x) to bf16 before the product, which put ~1.4% of the
  outputs of a 1024² bf16 RMSNorm call outside atol = rtol = 3e-2 of the f32 math; the lazy form
  (f32 scaling after the product, as the kernel) puts none there. Its gradients stay within
  bf16 tolerance of the f32 reference's."""
  ks = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(ks[0], (512, 1024), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(ks[1], (1024, 1024), jnp.float32).astype(jnp.bfloat16)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  want = jax.jit(lambda x, w: reference.norm_matmul(f32(x), f32(w), norm="rms"))(x, w)
  y = jax.jit(lambda x, w: pallas_norm.norm_matmul(x, w, norm="rms", implementation="xla"))(x, w)
  outside = ~np.isclose(np.asarray(f32(y)), np.asarray(want), atol=3e-2, rtol=3e-2)
  assert outside.mean() == 0.0, outside.mean()
  m, k, n = 64, 128, 96
  x, w, scale, bias, ct = _inputs(8, m, k, n, jnp.bfloat16)
  y, grads = _jit_vjp(lambda x, w, s, b: pallas_norm.norm_matmul(
      x, w, scale=s, norm_bias=b, norm="rms", implementation="xla"), (x, w, scale, bias),
      ct.astype(jnp.bfloat16))
  assert [g.dtype for g in grads[:2]] == [jnp.bfloat16] * 2  # 16-bit backward GEMMs
  _check_against_f32_reference(y, grads, x, w, scale, bias, ct, "rms")


def test_xla_rms_float16_product_does_not_overflow():
  """The lazy form's product x @ W_γ of un-normalized float16 rows (values 250-300, K = 1024:
  |x @ W_γ| ~ 7.7e4 > 65504) overflowed to inf, value and gradient, where norm(x) @ w is O(K·w)
  and the kernel's float32 accumulator is finite; against the float32 reference."""
  k, n = 1024, 64
  ks = jax.random.split(jax.random.key(11), 3)
  x = jax.random.uniform(ks[0], (8, k), minval=250.0, maxval=300.0).astype(jnp.float16)
  w = jax.random.uniform(ks[1], (k, n), minval=0.25, maxval=0.3).astype(jnp.float16)
  assert not bool(jnp.all(jnp.isfinite(jnp.matmul(x, w))))  # the product alone overflows
  ct = jax.random.normal(ks[2], (8, n), jnp.float32)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  loss = lambda x, w, impl: jnp.sum(f32(pallas_norm.norm_matmul(  # noqa: E731
      x, w, norm="rms", implementation=impl)) * ct)
  want = reference.norm_matmul(f32(x), f32(w), norm="rms")
  y = jax.jit(lambda x, w: pallas_norm.norm_matmul(x, w, norm="rms", implementation="xla"))(x, w)
  assert _rel(f32(y), want) < 2e-3
  grads = jax.jit(jax.grad(lambda x, w: loss(x, w, "xla"), argnums=(0, 1)))(x, w)
  want_grads = jax.grad(lambda x, w: jnp.sum(reference.norm_matmul(x, w, norm="rms") * ct),
                        argnums=(0, 1))(f32(x), f32(w))
  for g, wg in zip(grads, want_grads):
    assert bool(jnp.all(jnp.isfinite(g))) and _rel(f32(g), wg) < 2e-2


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_xla_statistics_are_those_of_float32_x(norm):
  """The returned statistics of bf16 rows (mean 1) are the float32 reference's to 1e-6: the
  value checks' 1e-2 let statistics computed in bf16 (4.8e-3 off in rstd, y 2.4e-3 → 3.0e-3
  from the oracle) pass a mutation test of the lazy RMSNorm path."""
  ks = jax.random.split(jax.random.key(12), 2)
  x = (jax.random.normal(ks[0], (256, 512)) + 1.0).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (512, 128)) / 22).astype(jnp.bfloat16)
  _, stats = pallas_norm.norm_matmul(x, w, norm=norm, return_stats=True, implementation="xla")
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  _, want = reference.norm_matmul(f32(x), f32(w), norm=norm, return_stats=True)
  np.testing.assert_allclose(stats.rstd, want.rstd, rtol=1e-6)
  if norm == "layer":
    np.testing.assert_allclose(stats.mean, want.mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
@pytest.mark.parametrize("derivative", ["grad_of_grad", "hessian"])
def test_second_order_derivatives_of_the_kernels_say_what_to_use(op, derivative):
  """Issue 18.5: a second derivative of a kernel path failed deep in JAX ("Differentiation rule
  for 'mpmd_map' not implemented"); it raises NotImplementedError naming the op and the fix.
  Traced only (jax.make_jaxpr): no kernel runs."""
  w = jnp.ones((64, 64), jnp.bfloat16)
  call = getattr(pallas_norm, op)
  f = lambda x: jnp.sum(call(x.astype(jnp.bfloat16), w, implementation="interpret")  # noqa: E731
                        .astype(jnp.float32) ** 2)
  x = jnp.ones((16, 64), jnp.float32)
  second = (jax.grad(lambda x: jnp.sum(jax.grad(f)(x))) if derivative == "grad_of_grad"
            else jax.hessian(f))
  with pytest.raises(NotImplementedError, match=f"{op}:.*implementation='xla'"):
    jax.make_jaxpr(second)(x)
  jax.make_jaxpr(jax.grad(f))(x)  # first order still traces


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_forward_mode_of_the_kernels_raises_jax_type_error(op):
  """Review: plain jax.jvp of a kernel path never reaches the op's own NotImplementedError (JAX
  runs the custom_vjp's forward rule on the primals, then raises its TypeError on the linear
  part, under jax.jit when it lowers). Documented (the ops' Raises, README Limitations); this
  pins the documented behaviour. Lowered only: no kernel runs."""
  w = jnp.ones((64, 64), jnp.bfloat16)
  call = getattr(pallas_norm, op)
  x = jnp.ones((16, 64), jnp.bfloat16)
  jvp = lambda impl: jax.jit(lambda x: jax.jvp(  # noqa: E731
      lambda x: call(x, w, implementation=impl), (x,), (x,)))
  with pytest.raises(TypeError, match="forward-mode autodiff"):
    jvp("interpret").lower(x)
  jvp("xla").lower(x)  # the fix the docs give


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["NormDense", "DenseNorm"])
def test_gpu_checkpoint_around_a_layer(layer):
  """Issue 18.5: jax.checkpoint (remat) around a layer on the kernel path, on the GPU: the same
  gradients as without remat. (Interpret mode cannot: its host callbacks are ordered effects,
  which remat's AD rejects; README, Limitations.)"""
  import flax_layers
  from flax import nnx
  model = getattr(flax_layers, layer)(512, 512, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                      implementation="mosaic")
  graphdef, state = nnx.split(model)
  x = jax.random.normal(jax.random.key(1), (4096, 512), jnp.float32).astype(jnp.bfloat16)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32) ** 2)

  plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(state, x)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2,
                               atol=1e-2 * float(jnp.max(jnp.abs(a.astype(jnp.float32)))))


@pytest.mark.parametrize("k,n,norm,interpret,expected", [
    (512, 512, "layer", False, ["row_sums"]), (2048, 512, "layer", False, ["row_sums"]),
    (512, 2048, "layer", False, ["row_sums"]), (128, 192, "layer", True, ["row_sums"]),
    # past what one CTA per column tile of a cluster of 8 covers (K > 2048), or a cluster in
    # interpret mode (K > 256): the row terms' routes, with the bias guard
    (4096, 512, "layer", False, ["y_term"]), (512, 512, "layer", True, FUSED_WITH_GUARD),
    (512, 512, "rms", False, ["row_sums"]), (4096, 512, "rms", False, ["y_term"])])
def test_epilogue_row_sums_route_by_shape(monkeypatch, k, n, norm, interpret, expected):
  """dx takes the row sums in the dx kernel's epilogue wherever K splits over a cluster (no y,
  no bias guard: one kernel call traced even with a norm bias; api._takes_row_sums), the
  row terms' routes elsewhere. Traced only: no kernel runs."""
  calls = _spy_on_dx_kernel(monkeypatch, run_kernel=False)
  m = 16
  x, w, scale, bias, ct = _inputs(3, m, k, n, jnp.bfloat16)
  w_gamma, col_sum, out_bias = nm_xla.fold_affine(w, scale, bias, norm)
  rows = jnp.ones((m,), jnp.float32)
  row_sums = nm._takes_row_sums(m, k, n, x.dtype, interpret)
  jax.make_jaxpr(lambda *a: nm._input_grad(*a, interpret=interpret, row_sums=row_sums,
                                           x_hat=False))(
      ct.astype(jnp.bfloat16), x, w_gamma, col_sum, out_bias, jnp.ones((m, n), jnp.bfloat16),
      None if norm == "rms" else rows, rows)
  assert calls == expected


@pytest.mark.parametrize("k,n,norm,x_hat", [(512, 512, "rms", True), (4096, 512, "rms", False),
                                            (4096, 512, "layer", True)])
def test_weight_grads_take_x_hat_with_the_row_sums(monkeypatch, k, n, norm, x_hat):
  """On a GPU (interpret=False) the weight gradients take x̂ wherever the dx kernel sums its
  rows in the epilogue (RMSNorm at K = N too: no XLA pass over dy is left to fuse the scaling
  into), else by routing.x_hat_pays; the weight-gradient kernel off (with it no x̂ is written:
  test_weight_grad_kernel's route tests). Traced only: no kernel runs."""
  monkeypatch.setattr(nm_routing, "weight_grad_kernel_pays", lambda k, n: False)
  seen = []

  def spy(dy, w_gamma, x, *args, **kwargs):
    seen.append(kwargs.get("x_hat"))
    return (jnp.zeros((x.shape[0], x.shape[1] + 64), x.dtype),) * 2 if kwargs.get(
        "x_hat") else jnp.zeros_like(x)

  monkeypatch.setattr(nmb, "launch", spy)
  m = 16
  x, w, scale, bias, ct = _inputs(3, m, k, n, jnp.bfloat16)
  w_gamma, col_sum, out_bias = nm_xla.fold_affine(w, scale, bias, norm)
  rows = jnp.ones((m,), jnp.float32)
  saved = (x, w, scale, None, w_gamma, col_sum, None, jnp.ones((m, n), jnp.bfloat16),
           None if norm == "rms" else rows, rows)
  jax.make_jaxpr(lambda ct: nm._fused_bwd(norm, 1e-6, None, "mosaic", None, saved,
                                          (ct, None, None)))(ct.astype(jnp.bfloat16))
  assert seen == [x_hat]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_xla_rms_lazy_form_takes_out_dtype(dtype):
  """The 16-bit RMSNorm "xla" path (the lazy form) returns out_dtype (a mutation test ignored
  it unnoticed: the other out_dtype tests use LayerNorm, which is unfused)."""
  x = jax.random.normal(jax.random.key(0), (16, 64), dtype)
  w = (jax.random.normal(jax.random.key(1), (64, 32), jnp.float32) / 8).astype(dtype)
  y = pallas_norm.norm_matmul(x, w, norm="rms", out_dtype=jnp.float32, implementation="xla")
  want = reference.norm_matmul(x.astype(jnp.float32), w.astype(jnp.float32), norm="rms")
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, want, atol=5e-2)


def test_dispatch_limits_at_their_edges():
  """implementation=None's measured limits just past their edges keep XLA (mutation tests
  moved each unnoticed): the pre-norm's wide shapes end at N = 2048; the post-norm needs
  M ≥ 4096 rows, and RMSNorm's wide training shapes end at N = 2048."""
  from pallas_norm.ops.norm_matmul import routing as nm_routing
  assert nm_routing.kernel_slower_reason(262144, 512, 3072, "rms") is not None
  assert mn_routing.kernel_slower_reason(2048, 1024, 1024, "layer") is not None
  assert mn_routing.kernel_slower_reason(262144, 512, 4096, "rms") is not None
