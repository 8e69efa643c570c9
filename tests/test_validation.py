"""Argument validation of the public ops: every documented error raises the right type and names
the offending argument, before any computation; implementation dispatch; validation under jit.

Each op has one valid call (`GOOD`, checked to run); each case changes one argument of it.
"""

from __future__ import annotations

import decimal
import fractions
import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp

import numpy as np
import pytest

import pallas_norm
from pallas_norm import _dispatch, _validate, reference

F32 = jnp.float32
T, H, D, B = 7, 2, 4, 3          # q (T, H, D), B samples
Q_OFFSETS = [0, 2, 2, 5]          # an empty sample, two padding rows
KV_OFFSETS = [0, 1, 4, 4]         # packed k/v of capacity TKV
TKV, L_KV = 6, 4


def _arr(shape, dtype=F32, seed=0):
  return jnp.asarray(1.0 + np.random.default_rng(seed).standard_normal(shape), dtype)


def _off(values, dtype=np.int32):
  return jnp.asarray(np.asarray(values, dtype))


def good_args(op: str) -> dict:
  """A valid call of each public op (keyword form)."""
  if op == "rms_norm":
    return dict(x=_arr((3, 8)), scale=_arr((8,), seed=1), residual=_arr((3, 8), seed=2))
  if op == "layer_norm":
    return dict(good_args("rms_norm"), bias=_arr((8,), seed=3))
  if op == "norm_matmul":
    return dict(x=_arr((2, 3, 8)), w=_arr((8, 5), seed=1), scale=_arr((8,), seed=2),
                norm_bias=_arr((8,), seed=3), norm="layer")
  if op == "matmul_norm":
    return dict(x=_arr((3, 8)), w=_arr((8, 5), seed=1), dense_bias=_arr((5,), seed=2),
                residual=_arr((3, 5), seed=3), scale=_arr((5,), seed=4),
                norm_bias=_arr((5,), seed=5))
  if op == "gdpa":
    return dict(q=_arr((T, H, D)), k=_arr((B, L_KV, H, D), seed=1),
                v=_arr((B, L_KV, H, D), seed=2), q_offsets=_off(Q_OFFSETS))
  if op == "gdpa_jagged":
    return dict(q=_arr((T, H, D)), k=_arr((TKV, H, D), seed=1), v=_arr((TKV, H, D), seed=2),
                q_offsets=_off(Q_OFFSETS), kv_offsets=_off(KV_OFFSETS))
  if op == "flash_norm_attention":
    return dict(good_args("gdpa"), ln_scale=_arr((H * D,), seed=3),
                ln_bias=_arr((H * D,), seed=4), rms_scale=_arr((H * D,), seed=5))
  raise KeyError(op)


def op_fn(op: str):
  return getattr(pallas_norm, "gdpa" if op == "gdpa_jagged" else op)


ALL_OPS = ["rms_norm", "layer_norm", "norm_matmul", "matmul_norm", "gdpa", "gdpa_jagged",
           "flash_norm_attention"]


@pytest.mark.parametrize("op", ALL_OPS)
def test_good_calls_run(op):
  out = op_fn(op)(**good_args(op), implementation="xla")
  chex.assert_tree_all_finite(out)


# (op, argument(s), bad value, exception, text the message must contain). One change per case;
# "k,v" gives k and v the same value (a k/v pair that agrees with itself but not with q).
NORM_CASES = [
    ("x", _arr((3, 8), jnp.int32), TypeError, "x"),
    ("x", [[1.0, 2.0]], TypeError, "x"),
    ("x", _arr(()), ValueError, "x"),
    ("x", _arr((3, 0)), ValueError, "x"),
    ("scale", _arr((7,)), ValueError, "scale"),
    ("scale", _arr((1, 8)), ValueError, "scale"),
    ("scale", _arr((8,), jnp.int32), TypeError, "scale"),
    ("residual", _arr((3, 7)), ValueError, "residual"),
    ("residual", _arr((8,)), ValueError, "residual"),
    ("residual", _arr((3, 8), jnp.int8), TypeError, "residual"),
    ("residual", _arr((3, 8), jnp.bfloat16), TypeError, "residual"),  # x float32 (review)
    ("eps", 0.0, ValueError, "eps"),
    ("eps", -1e-6, ValueError, "eps"),
    ("eps", float("nan"), ValueError, "eps"),
    ("eps", float("inf"), ValueError, "eps"),
    ("eps", 1e-300, ValueError, "float32"),  # rounds to 0 in the float32 statistics
    ("eps", 1e300, ValueError, "float32"),  # rounds to inf
    ("eps", 1e-40, ValueError, "at least"),  # subnormal: XLA flushes it to 0 (review finding)
    ("eps", 1e-30, ValueError, "at least"),  # rstd³ of a zero row overflows float32
    ("eps", True, TypeError, "eps"),
    ("eps", "1e-6", TypeError, "eps"),
    ("eps", None, TypeError, "eps"),
    ("out_dtype", jnp.int32, TypeError, "out_dtype"),
    ("out_dtype", "not-a-dtype", TypeError, "out_dtype"),
    ("out_dtype", jnp.float64, TypeError, "jax_enable_x64"),  # would silently be float32
    ("implementation", "cuda", ValueError, "implementation"),
    ("implementation", "XLA", ValueError, "implementation"),
    # A NumPy array is not a sequence of names: ("xla", "triton") as one raised NumPy's
    # "truth value of an array ... is ambiguous" (and ["xla"] was accepted by accident).
    ("implementation", np.array(["xla", "triton"]), ValueError, "implementation"),
]
CASES = (
    [("rms_norm",) + c for c in NORM_CASES]
    + [("layer_norm",) + c for c in NORM_CASES]
    + [("layer_norm", "bias", _arr((9,)), ValueError, "bias"),
       ("layer_norm", "bias", _arr((8,), jnp.int32), TypeError, "bias")]
    + [("norm_matmul",) + c for c in [
        ("x", _arr((2, 3, 8), jnp.int32), TypeError, "x"),
        ("w", _arr((8, 5), jnp.int32), TypeError, "w"),
        ("w", _arr((8, 5), jnp.bfloat16), TypeError, "w"),  # x float32, w bfloat16
        ("w", _arr((8,)), ValueError, "w"),
        ("w", _arr((7, 5)), ValueError, "w"),
        ("scale", _arr((5,)), ValueError, "scale"),  # (K,), not (N,)
        ("norm_bias", _arr((5,)), ValueError, "norm_bias"),
        ("norm", "batch", ValueError, "norm"),
        ("norm", "RMS", ValueError, "norm"),
        ("norm", np.array(["rms", "layer"]), ValueError, "norm"),  # was NumPy's "ambiguous"
        ("eps", 0, ValueError, "eps"),
        ("eps", float("nan"), ValueError, "eps"),
        ("eps", False, TypeError, "eps"),
        ("out_dtype", jnp.int32, TypeError, "out_dtype"),
        ("implementation", "cuda", ValueError, "implementation")]]
    + [("matmul_norm",) + c for c in [
        ("x", _arr((3, 8), jnp.uint8), TypeError, "x"),
        ("w", _arr((8, 5), jnp.float16), TypeError, "w"),
        ("w", _arr((9, 5)), ValueError, "w"),
        ("dense_bias", _arr((8,)), ValueError, "dense_bias"),
        ("dense_bias", _arr((5,), jnp.int32), TypeError, "dense_bias"),
        ("residual", _arr((3, 8)), ValueError, "residual"),
        ("residual", _arr((5,)), ValueError, "residual"),
        ("residual", _arr((3, 5), jnp.bfloat16), TypeError, "residual"),  # x float32
        ("scale", _arr((8,)), ValueError, "scale"),  # (N,), not (K,)
        ("norm_bias", _arr((5,), jnp.int32), TypeError, "norm_bias"),
        ("norm", "group", ValueError, "norm"),
        ("norm", np.array(["layer"]), ValueError, "norm"),  # passed, by NumPy's ==, as "layer"
        ("eps", -1.0, ValueError, "eps"),
        ("eps", True, TypeError, "eps"),
        ("implementation", "cuda", ValueError, "implementation")]]
    + [("gdpa",) + c for c in [
        ("q", _arr((T, H, D), jnp.int32), TypeError, "q"),
        ("q", _arr((T, H * D)), ValueError, "q"),
        ("q", _arr((T, 0, D)), ValueError, "no heads"),
        ("q", _arr((T, H, 0)), ValueError, "empty feature axis"),
        ("k", _arr((B * L_KV, H, D)), ValueError, "k"),  # 3-D k without kv_offsets
        ("v", _arr((B, L_KV + 1, H, D)), ValueError, "v"),
        ("k,v", _arr((B, L_KV, H, D + 1)), ValueError, "(H, D)"),
        ("v", _arr((B, L_KV, H, D), jnp.bfloat16), TypeError, "dtype"),
        ("k,v", _arr((B - 1, L_KV, H, D)), ValueError, "batch"),  # dense k/v batch != B
        ("q_offsets", [0, 2, 2, 5], TypeError, "q_offsets"),
        ("q_offsets", np.asarray(Q_OFFSETS, np.uint32), TypeError, "q_offsets"),
        ("q_offsets", np.asarray(Q_OFFSETS, np.int16), TypeError, "q_offsets"),
        ("q_offsets", _off(Q_OFFSETS, np.float32), TypeError, "q_offsets"),
        ("q_offsets", _off([Q_OFFSETS]), ValueError, "q_offsets"),
        ("q_offsets", _off([0]), ValueError, "q_offsets"),
        ("q_offsets", _off([1, 2, 2, 5]), ValueError, "q_offsets[0]"),
        ("q_offsets", _off([0, 3, 2, 5]), ValueError, "q_offsets"),
        ("q_offsets", _off([0, 2, 2, T + 1]), ValueError, "q_offsets[-1]"),
        ("max_seq_len", 2, ValueError, "max_seq_len"),  # the longest sample has 3 rows
        ("max_seq_len", 0, ValueError, "max_seq_len"),
        ("max_seq_len", 3.0, TypeError, "max_seq_len"),  # not an int: as eps="1e-6"
        ("max_seq_len", True, TypeError, "max_seq_len"),
        ("max_kv_len", 4, ValueError, "max_kv_len"),  # only with jagged k/v
        ("kv_offsets", 8, TypeError, "kv_offsets"),  # gdpa(q, k, v, off, 8): max_seq_len?
        ("activation", "tanh", ValueError, "activation"),
        ("activation", "GELU", ValueError, "activation"),
        ("activation", ["gelu"], ValueError, "activation"),  # unhashable: was "unhashable type"
        ("pre_scale", float("nan"), ValueError, "pre_scale"),
        ("pre_scale", float("inf"), ValueError, "pre_scale"),
        ("pre_scale", jnp.asarray([1.0, 2.0]), TypeError, "pre_scale"),
        ("post_scale", -float("inf"), ValueError, "post_scale"),
        ("post_scale", None, TypeError, "post_scale"),
        ("out_dtype", jnp.int32, TypeError, "out_dtype"),
        ("implementation", "pallas", ValueError, "implementation")]]
    + [("gdpa_jagged",) + c for c in [
        ("k", _arr((B, L_KV, H, D)), ValueError, "k"),  # 4-D k with kv_offsets
        ("kv_offsets", _off([0, 1, 4]), ValueError, "kv_offsets"),  # B = 2 != 3
        ("kv_offsets", _off([0, 1, 4, 4], np.int16), TypeError, "kv_offsets"),
        ("kv_offsets", _off([2, 2, 4, 4]), ValueError, "kv_offsets[0]"),
        ("kv_offsets", _off([0, 4, 1, 4]), ValueError, "kv_offsets"),
        ("kv_offsets", _off([0, 1, 4, TKV + 1]), ValueError, "kv_offsets[-1]"),
        ("max_kv_len", 2, ValueError, "max_kv_len"),  # the longest kv sample has 3 rows
        ("max_kv_len", -1, ValueError, "max_kv_len")]]
    + [("flash_norm_attention",) + c for c in [
        ("q", _arr((T, H, D), jnp.int32), TypeError, "q"),
        ("q_offsets", _off([0, 2, 1, 5]), ValueError, "q_offsets"),
        ("k,v", _arr((B + 1, L_KV, H, D)), ValueError, "batch"),
        ("ln_scale", _arr((D,)), ValueError, "ln_scale"),  # (H·D,), not (D,)
        ("ln_scale", _arr((H, D)), ValueError, f"ln_scale must have shape ({H * D},)"),
        ("ln_bias", _arr((H * D,), jnp.int32), TypeError, "ln_bias"),
        ("rms_scale", _arr((H * D + 1,)), ValueError, "rms_scale"),
        ("activation", "softmax", ValueError, "activation"),
        ("activation", {"name": "gelu"}, ValueError, "activation"),
        ("pre_scale", float("nan"), ValueError, "pre_scale"),
        ("eps", 0.0, ValueError, "eps"),
        ("eps", True, TypeError, "eps"),
        ("max_seq_len", 1, ValueError, "max_seq_len"),
        ("implementation", "cuda", ValueError, "implementation")]]
)


def assert_names(error, text):
  """The message contains ``text`` as a whole word (so "x" is not found inside "max")."""
  found = re.search(r"(?<!\w)" + re.escape(text) + r"(?!\w)", str(error))
  assert found, f"{type(error).__name__} should name {text!r}: {error}"


def _case_id(case):
  op, arg, value, exc, _ = case
  shown = getattr(value, "shape", None)
  shown = f"{getattr(value, 'dtype', '')}{tuple(shown)}" if shown is not None else repr(value)
  return f"{op}-{arg}={shown}-{exc.__name__}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_argument_raises_naming_it(case):
  op, arg, value, exc, text = case
  args = dict(good_args(op), **{name: value for name in arg.split(",")})
  with pytest.raises(exc) as info:
    op_fn(op)(**args)
  assert_names(info.value, text)




@pytest.mark.parametrize("arg,value", [("pre_scale", "0.5"), ("post_scale", "abc")])
def test_string_scale_raises_type_error_naming_it(arg, value):
  with pytest.raises(TypeError, match=arg):
    pallas_norm.gdpa(**good_args("gdpa"), **{arg: value})


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
@pytest.mark.parametrize("value", [2**31, np.int64(2**40), np.asarray(3**30, np.uint64)],
                         ids=["int_2^31", "np_int64_2^40", "np_uint64_0d"])
def test_whole_number_scales_past_int32_compute_as_floats(op, value):
  """Review finding: on the XLA path a Python int scale past int32 died in JAX with an
  OverflowError naming no argument, and a NumPy int64 one wrapped into int32 with x64 off
  (2**40 gave an output of 0). Both now compute as the float of the same value, against the
  float32 reference, under jit too."""
  args = good_args(op)
  ref_fn = reference.gdpa if op != "flash_norm_attention" else reference.flash_norm_attention
  want = ref_fn(**args, pre_scale=0.5, post_scale=float(value))
  wrapped = ref_fn(**args, pre_scale=0.5, post_scale=0.0)  # what 2**40 wrapped into int32 gave
  assert np.all(np.isfinite(np.asarray(want)))
  assert np.max(np.abs(np.asarray(want) - np.asarray(wrapped))) > 0.1
  got = op_fn(op)(**args, pre_scale=0.5, post_scale=value, implementation="xla")
  chex.assert_trees_all_close(got, want, rtol=1e-5)
  jitted = jax.jit(lambda a: op_fn(op)(**a, pre_scale=0.5, post_scale=value,
                                       implementation="xla"))(args)
  chex.assert_trees_all_close(jitted, want, rtol=1e-5)


def test_concrete_integer_array_eps_is_accepted_as_a_number():
  """Review finding: ``eps=np.int64(1)`` and a concrete float array were accepted but a
  concrete integer ``jnp.asarray(1)`` raised TypeError; it is the number 1 too."""
  x = _arr((3, 8))
  want = pallas_norm.rms_norm(x, eps=1.0, implementation="xla")
  for eps in (jnp.asarray(1), np.asarray(1, np.int32)):
    chex.assert_trees_all_close(pallas_norm.rms_norm(x, eps=eps, implementation="xla"), want,
                                rtol=0, atol=0)
  with pytest.raises(TypeError, match="eps"):
    pallas_norm.rms_norm(x, eps=jnp.asarray(True))


def test_validation_runs_before_any_computation(monkeypatch):
  """A bad argument raises before the op's math is reached."""
  from pallas_norm import reference  # pylint: disable=import-outside-toplevel

  def boom(*args, **kwargs):
    raise AssertionError("reference reached before validation")

  for name in ("rms_norm", "gdpa", "matmul_norm"):
    monkeypatch.setattr(reference, name, boom)
  with pytest.raises(ValueError, match="eps"):
    pallas_norm.rms_norm(**good_args("rms_norm"), eps=0.0)
  with pytest.raises(ValueError, match="activation"):
    pallas_norm.gdpa(**good_args("gdpa"), activation="nope")
  with pytest.raises(ValueError, match="residual"):
    pallas_norm.matmul_norm(**dict(good_args("matmul_norm"), residual=_arr((3, 8))))


# ---- implementation dispatch ----------------------------------------------------------------


def test_implementation_names():
  assert set(pallas_norm.IMPLEMENTATIONS) == {"xla", "mosaic", "triton", "interpret"}


@pytest.mark.parametrize("implementation", ["mosaic", "interpret"])
def test_kernel_implementation_without_kernel_raises_naming_op(implementation):
  with pytest.raises(NotImplementedError, match=r"some_op.*" + implementation):
    _dispatch.choose("some_op", implementation)


def test_dispatch_choices():
  assert _dispatch.choose("some_op", "xla") == "xla"
  assert _dispatch.choose("some_op", None) == "xla"  # no kernel: XLA
  with pytest.raises(ValueError, match="implementation"):
    _dispatch.choose("some_op", "gpu")
  # An op with a kernel: an explicit request runs it when it supports the call, else says why.
  assert _dispatch.choose("some_op", "interpret", lambda _: None) == "interpret"
  with pytest.raises(NotImplementedError, match=r"some_op.*N = 3 is too small"):
    _dispatch.choose("some_op", "mosaic", lambda _: "N = 3 is too small")
  # None falls back to XLA when the kernel cannot run the call.
  assert _dispatch.choose("some_op", None, lambda _: "N = 3 is too small") == "xla"
  if not _dispatch.on_hopper_gpu():
    assert _dispatch.choose("some_op", None, lambda _: None) == "xla"


def test_dispatch_sequences_take_the_first_implementation_that_can_run():
  never = lambda _: "N = 3 is too small"  # noqa: E731
  only_interpret = lambda c: None if c == "interpret" else "needs interpret"  # noqa: E731
  assert _dispatch.choose("some_op", ("interpret", "xla"), never) == "xla"
  assert _dispatch.choose("some_op", ["interpret", "xla"], lambda _: None) == "interpret"
  assert _dispatch.choose("some_op", ("mosaic", "interpret"), only_interpret) == "interpret"
  assert _dispatch.choose("some_op", ("mosaic", "xla")) == "xla"  # no kernel at all
  # None of them can run: every candidate's reason, named.
  with pytest.raises(NotImplementedError, match=r"some_op.*'mosaic': N = 3.*'interpret': N = 3"):
    _dispatch.choose("some_op", ("mosaic", "interpret"), never)
  for bad in [(), ["xla", "gpu"], ("xla", None), "XLA", 3, {"xla": 1}]:
    with pytest.raises(ValueError, match="implementation"):
      _dispatch.choose("some_op", bad)
  assert _dispatch.check_implementation(["interpret", "xla"]) == ("interpret", "xla")


def test_interpret_on_a_cpu_client_with_too_few_threads_raises(monkeypatch):
  """Interpret-mode kernels deadlock with fewer CPU client threads than warpgroups in flight:
  a clear RuntimeError naming PJRT_NPROC instead of a hang; a sequence falls through to XLA."""
  if jax.default_backend() != "cpu":
    pytest.skip("the check applies to the CPU backend")
  monkeypatch.setenv("PJRT_NPROC", "2")
  assert "PJRT_NPROC" in _dispatch.interpret_threads_reason()
  with pytest.raises(RuntimeError, match=r"some_op.*PJRT_NPROC=8"):
    _dispatch.choose("some_op", "interpret", lambda _: None)
  with pytest.warns(_dispatch.KernelSkippedWarning, match=r"some_op.*PJRT_NPROC.*ran 'xla'"):
    assert _dispatch.choose("some_op", ("interpret", "xla"), lambda _: None) == "xla"
  # The kernel's own reason comes first: an unsupported call is still NotImplementedError.
  with pytest.raises(NotImplementedError, match="N = 3"):
    _dispatch.choose("some_op", "interpret", lambda _: "N = 3 is too small")
  monkeypatch.setenv("PJRT_NPROC", "8")
  assert _dispatch.interpret_threads_reason() is None
  assert _dispatch.choose("some_op", "interpret", lambda _: None) == "interpret"


def test_a_kernel_skipped_by_the_process_is_reported_once(monkeypatch):
  """implementation=("interpret", "xla") with too few CPU threads for interpret mode used to run
  XLA silently (issue 17): one KernelSkippedWarning per op, kernel and reason per process; a
  kernel skipped for the call's shapes is not reported (models pass sequences on purpose)."""
  monkeypatch.setattr(_dispatch, "interpret_threads_reason", lambda: "too few threads")
  monkeypatch.setattr(_dispatch, "_warned", set())
  x = jnp.ones((4, 64), jnp.bfloat16)
  w = jnp.ones((64, 64), jnp.bfloat16)
  with pytest.warns(_dispatch.KernelSkippedWarning, match="norm_matmul.*too few threads"):
    pallas_norm.norm_matmul(x, w, implementation=("interpret", "xla"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pallas_norm.norm_matmul(x, w, implementation=("interpret", "xla"))  # once per process
    monkeypatch.setattr(_dispatch, "interpret_threads_reason", lambda: None)
    odd = jnp.ones((64, 96), jnp.bfloat16)  # N = 96: the kernel does not take the shape
    pallas_norm.norm_matmul(x, odd, implementation=("interpret", "xla"))


@pytest.mark.filterwarnings("ignore::pallas_norm._dispatch.KernelSkippedWarning")
def test_public_ops_take_an_implementation_sequence():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)) / 8, jnp.bfloat16)
  want = pallas_norm.norm_matmul(x, w, implementation="xla")
  # "mosaic" cannot run on a CPU: the sequence falls through to XLA, with the same values.
  if not _dispatch.on_hopper_gpu():
    got = pallas_norm.norm_matmul(x, w, implementation=("mosaic", "xla"))
    chex.assert_trees_all_close(got, want, rtol=0, atol=0)
    got = pallas_norm.rms_norm(x, implementation=["mosaic", "xla"])
    chex.assert_trees_all_close(got, pallas_norm.rms_norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("op", ALL_OPS)
def test_default_implementation_matches_xla(op):
  fn, args = op_fn(op), good_args(op)
  chex.assert_trees_all_close(fn(**args), fn(**args, implementation="xla"), rtol=0, atol=0)


# ---- under jax.jit --------------------------------------------------------------------------


def _jit_gdpa(**static):
  """gdpa jitted with q and the offsets traced (k/v dense, from GOOD unless given)."""
  return jax.jit(functools.partial(pallas_norm.gdpa, **static))


def test_jit_traced_offsets_skip_value_checks():
  good = good_args("gdpa")
  eager = pallas_norm.gdpa(**good)
  f = _jit_gdpa(activation="fast_gelu")
  chex.assert_trees_all_close(f(good["q"], good["k"], good["v"], good["q_offsets"]), eager,
                              rtol=1e-6, atol=1e-6)
  # Values can't be checked while tracing: a first offset != 0 is not an error under jit.
  out = f(good["q"], good["k"], good["v"], _off([1, 2, 2, 5]))
  chex.assert_shape(out, (T, H, D))


@pytest.mark.parametrize("change,exc,text", [
    (dict(q_offsets=_off([0, 2, 5])), ValueError, "batch"),  # B = 2, dense k has 3
    (dict(q_offsets=_off(Q_OFFSETS, np.float32)), TypeError, "q_offsets"),
    (dict(q_offsets=_off([Q_OFFSETS])), ValueError, "q_offsets"),
    (dict(k=_arr((B, L_KV, H, D + 1)), v=_arr((B, L_KV, H, D + 1))), ValueError,
     "(H, D)"),
    (dict(q=_arr((T, H, D), jnp.bfloat16)), TypeError, "dtype"),
])
def test_jit_shape_and_dtype_errors_still_raise(change, exc, text):
  args = dict(good_args("gdpa"), **change)
  with pytest.raises(exc) as info:
    jax.jit(pallas_norm.gdpa)(**args)
  assert_names(info.value, text)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "matmul_norm"])
def test_residual_of_another_dtype_raises_naming_it(op):
  """Review: rms_norm(x_f16, None, residual_f32) returned a residual stream s that overflowed to
  inf while y was finite; matmul_norm(x_f32, w_f32, residual=r_bf16) ran. Both raise TypeError
  naming residual, also under jax.jit; x's dtype still runs and matches the reference."""
  args = good_args(op)
  x16 = args["x"].astype(jnp.float16)
  if op == "matmul_norm":
    args.update(x=x16, w=args["w"].astype(jnp.float16), dense_bias=None)
  else:
    args.update(x=x16, scale=None)
  good_residual = args["residual"].astype(jnp.float16)
  for call in (op_fn(op), jax.jit(op_fn(op))):
    with pytest.raises(TypeError) as info:
      call(**dict(args, residual=jnp.full(good_residual.shape, 7e4, jnp.float32)))
    assert_names(info.value, "residual")
  args["residual"] = good_residual
  out = op_fn(op)(**args, implementation="xla")
  want = getattr(reference, op)(**args)
  for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    assert got.dtype == ref.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("op", ["gdpa", "flash_norm_attention"])
@pytest.mark.parametrize("arg", ["pre_scale", "post_scale"])
@pytest.mark.parametrize("value", [np.ones(8, np.float32), np.ones((H, D), np.float32),
                                   np.ones(1, np.float32), np.asarray(True),
                                   np.asarray(1 + 2j, np.complex64)],
                         ids=["(8,)", "(H,D)", "(1,)", "bool", "complex"])
def test_jit_traced_array_scale_raises_naming_it(op, arg, value):
  """A traced scale must be a real 0-d value (review finding: under jit an array scale was
  broadcast into a silently different result, while eager calls raised)."""
  args = good_args(op)
  fn = jax.jit(lambda s: op_fn(op)(**args, **{arg: s}))
  with pytest.raises(TypeError) as info:
    fn(jnp.asarray(value))
  assert_names(info.value, arg)
  with pytest.raises(TypeError) as info:  # and the same concrete value raises outside jit
    op_fn(op)(**args, **{arg: value})
  assert_names(info.value, arg)


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
@pytest.mark.parametrize("value", [jnp.float32(0.5), jnp.bfloat16(0.5), jnp.int32(2)],
                         ids=["f32", "bf16", "int32"])
def test_jit_traced_scalar_scales_still_work(op, value):
  args = good_args(op)
  traced = jax.jit(lambda pre, post: op_fn(op)(**args, pre_scale=pre, post_scale=post))(
      value, value)
  eager = op_fn(op)(**args, pre_scale=float(value), post_scale=float(value))
  chex.assert_trees_all_close(traced, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, arg", [
    ("rms_norm", "x"), ("layer_norm", "scale"), ("norm_matmul", "x"), ("norm_matmul", "w"),
    ("matmul_norm", "residual"), ("gdpa", "q"), ("gdpa", "k"), ("gdpa", "q_offsets"),
    ("gdpa_jagged", "kv_offsets"), ("flash_norm_attention", "ln_scale")])
def test_shape_dtype_struct_is_not_an_array(op, arg):
  """Duck-typed stand-ins with only .shape and .dtype used to pass validation and fail deep
  inside (AttributeError 'astype' in reference.py, review finding)."""
  args = good_args(op)
  args[arg] = jax.ShapeDtypeStruct(args[arg].shape, args[arg].dtype)
  with pytest.raises(TypeError, match=f"{arg} must be an (int32 )?array.*, got ShapeDtypeStruct"):
    op_fn(op)(**args)


@pytest.mark.parametrize("op", ALL_OPS)
def test_eval_shape_and_numpy_inputs_still_work(op):
  args = good_args(op)
  arrays = {k: v for k, v in args.items() if isinstance(v, jax.Array)}
  static = {k: v for k, v in args.items() if k not in arrays}
  shapes = jax.eval_shape(lambda a: op_fn(op)(**a, **static), arrays)
  host = {k: np.asarray(v) if isinstance(v, jax.Array) else v for k, v in args.items()}
  out = op_fn(op)(**host)
  chex.assert_trees_all_equal_shapes_and_dtypes(shapes, out)


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_flax_params_are_arrays(op, impl):
  """A Flax ``nnx.Param`` (an ``__jax_array__`` object) passed as an array works as before the
  is-an-array check: same values as its ``[...]``."""
  from flax import nnx
  ks = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(ks[0], (16, 64), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(ks[1], (64, 64), jnp.float32) / 8).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks[2], (64,), jnp.float32)
  want = op_fn(op)(x, w, scale=scale, norm="layer", implementation=impl)
  got = op_fn(op)(x, nnx.Param(w), scale=nnx.Param(scale), norm="layer", implementation=impl)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_flax_params_in_row_norm_gradients(norm, impl):
  """γ and β as ``nnx.Param``s with only x (or only β) differentiated (review finding: the
  LayerNorm rule's custom_jvp received a Param holding a symbolic zero and failed inside JAX):
  values and gradients those of the arrays, under jit."""
  from flax import nnx
  ks = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(ks[0], (16, 64), jnp.float32) + 2.0
  dy = jax.random.normal(ks[1], (16, 64), jnp.float32)
  scale = 1 + 0.1 * jax.random.normal(ks[2], (64,), jnp.float32)
  bias = 0.1 * jax.random.normal(ks[3], (64,), jnp.float32)
  if impl == "interpret":
    x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
  op = pallas_norm.layer_norm if norm == "layer" else pallas_norm.rms_norm
  kw = dict(implementation=impl)

  def loss(x, s, b):
    y = op(x, s, b, **kw) if norm == "layer" else op(x, s, **kw)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  want_dx = jax.jit(jax.grad(loss))(x, scale, bias)
  got_dx = jax.jit(lambda x: jax.grad(loss)(x, nnx.Param(scale), nnx.Param(bias)))(x)
  np.testing.assert_array_equal(np.asarray(got_dx, np.float32), np.asarray(want_dx, np.float32))
  if norm == "layer":  # a frozen γ, a trained β
    want_db = jax.grad(loss, argnums=2)(x, scale, bias)
    got_db = jax.grad(lambda b: loss(x, nnx.Param(scale), b))(nnx.Param(bias))
    np.testing.assert_array_equal(np.asarray(got_db[...]), np.asarray(want_db))


@pytest.mark.parametrize("op", ["gdpa", "flash_norm_attention"])
def test_flax_param_scales_under_jit_and_grad(op):
  """A 0-d ``nnx.Param`` pre_scale (a learned temperature) works under jit and grad as it does
  eagerly (review finding: the scalar check saw a Param holding a tracer and raised
  "must be a real scalar" only when traced); values and its gradient those of the array."""
  from flax import nnx
  ks = jax.random.split(jax.random.key(6), 3)
  q = jax.random.normal(ks[0], (16, 2, 16), jnp.float32)
  k = jax.random.normal(ks[1], (2, 8, 2, 16), jnp.float32) / 4
  v = jax.random.normal(ks[2], (2, 8, 2, 16), jnp.float32)
  off = _off([0, 5, 12])
  fn = getattr(pallas_norm, op)
  loss = lambda p: jnp.sum(fn(q, k, v, off, pre_scale=p, max_seq_len=16,
                              implementation="xla") ** 2)
  want_v, want_g = jax.value_and_grad(loss)(jnp.float32(0.5))
  got_v, got_g = jax.jit(jax.value_and_grad(loss))(nnx.Param(jnp.float32(0.5)))
  np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-6)
  np.testing.assert_allclose(float(got_g[...]), float(want_g), rtol=1e-5)
  assert float(want_g) != 0.0


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_kernel_dtype_reason_names_x_when_out_dtype_was_not_passed(op):
  """A float64 NumPy x (no out_dtype) was reported as "out_dtype float64 is not ..." (review
  finding): the reason names x's dtype, which the caller chose."""
  x, w = np.ones((8, 64)), np.ones((64, 64))
  with pytest.raises(NotImplementedError, match="'interpret': x dtype float64 is not bfloat16 "
                                                "or float16") as info:
    op_fn(op)(x, w, implementation="interpret")
  assert "out_dtype" not in str(info.value)


def test_kernel_dtype_reason_names_an_explicit_out_dtype():
  x = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((64, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="'interpret': out_dtype float32 is not"):
    pallas_norm.matmul_norm(x, w, out_dtype=jnp.float32, implementation="interpret")


def test_jit_jagged_kv_batch_mismatch_raises():
  args = dict(good_args("gdpa_jagged"), kv_offsets=_off([0, 1, 4]))
  with pytest.raises(ValueError, match="kv_offsets"):
    jax.jit(pallas_norm.gdpa)(**args)


def test_jit_norm_shape_errors_still_raise():
  good = good_args("layer_norm")
  with pytest.raises(ValueError, match="scale"):
    jax.jit(pallas_norm.layer_norm)(good["x"], _arr((7,)))
  with pytest.raises(ValueError, match="w must have shape"):
    jax.jit(pallas_norm.norm_matmul)(good["x"], _arr((7, 5)))  # K = 8


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "matmul_norm", "norm_matmul"])
def test_tiny_eps_is_fine_for_float64_statistics(op):
  """float64 inputs (x64) keep float64 statistics, so an eps that only float32 rounds to 0 is
  accepted there, and gives the reference's result; float32 inputs still reject it."""
  rng = np.random.default_rng(7)
  with jax.enable_x64(True):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float64)
    args = ((x, jnp.asarray(rng.standard_normal((64, 64)), jnp.float64))
            if op in ("matmul_norm", "norm_matmul") else (x,))
    fn = getattr(pallas_norm, op)
    got = fn(*args, eps=1e-100)
    ref = getattr(pallas_norm.reference, op)(*args, eps=1e-100)
    chex.assert_trees_all_close(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="float32"):
      fn(*(a.astype(jnp.float32) for a in args), eps=1e-100)
    with pytest.raises(ValueError, match="float64"):  # below float64's floor
      fn(*args, eps=1e-300)


def test_flash_norm_attention_stats_carry_no_gradient():
  """Like norm_matmul's and matmul_norm's (test_norm_matmul_vjp): the returned statistics are
  outputs, so a loss that adds them differentiates like one that does not (review finding)."""
  args = good_args("flash_norm_attention")
  q = args.pop("q").astype(jnp.float32)

  def loss(q, with_stats):
    out, (ln, rms) = pallas_norm.flash_norm_attention(q, **args, return_stats=True)
    total = jnp.sum(out.astype(jnp.float32) ** 2)
    if with_stats:
      total = total + jnp.sum(ln.rstd) + jnp.sum(ln.mean) + jnp.sum(rms.rstd)
    return total

  with_stats, without = jax.grad(loss)(q, True), jax.grad(loss)(q, False)
  assert float(jnp.max(jnp.abs(without))) > 0
  chex.assert_trees_all_close(with_stats, without, rtol=1e-6)


def test_eps_floor_keeps_zero_rows_and_their_gradients_finite():
  """The smallest eps accepted: a zero row's output and rstd³ gradient stay finite."""
  floor = _validate.eps_floor(np.float32)
  assert 1e-26 < floor < 1e-25
  x = jnp.zeros((2, 64), jnp.float32).at[1].set(1.0)
  w = jnp.asarray(np.random.default_rng(8).standard_normal((64, 64)), jnp.float32)
  eps = 1.01 * floor
  for norm in ("rms", "layer"):
    grad = jax.grad(lambda x: jnp.sum(
        pallas_norm.norm_matmul(x, w, norm=norm, eps=eps, implementation="xla") ** 2))(x)
    assert bool(jnp.all(jnp.isfinite(grad))), norm
  assert bool(jnp.all(jnp.isfinite(pallas_norm.rms_norm(x, eps=eps))))


@pytest.mark.parametrize("flag_name", ["return_stats", "return_h", "zero_centered_scale"])
def test_boolean_options_reject_non_bools(flag_name):
  """A string option is truthy: "no" would silently turn it on (review finding)."""
  op = {"return_stats": "norm_matmul", "return_h": "matmul_norm",
        "zero_centered_scale": "rms_norm"}[flag_name]
  fn, args = op_fn(op), good_args(op)
  with pytest.raises(TypeError, match=flag_name):
    fn(**args, **{flag_name: "no"})
  fn(**args, **{flag_name: np.bool_(False)})  # a NumPy bool is a bool


# Not np.float64: it subclasses Python's float, so it takes the float path (~3 CPU-s a case).
@pytest.mark.parametrize("eps", [np.float32(1e-5), np.int64(1)])
def test_numpy_eps_reaches_the_kernel_as_a_float(eps):
  """The public check accepts NumPy scalars; the kernel path must too (it raised inside the
  kernel's own check, review finding). Interpret mode at a tiny shape, against XLA."""
  if _dispatch.interpret_threads_reason():
    pytest.skip(_dispatch.interpret_threads_reason())
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.bfloat16)
  for fn in (pallas_norm.norm_matmul, pallas_norm.matmul_norm):
    got = fn(x, w, eps=eps, implementation="interpret").astype(jnp.float32)
    want = fn(x, w, eps=float(eps), implementation="xla").astype(jnp.float32)
    chex.assert_trees_all_close(got, want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "matmul_norm", "norm_matmul"])
def test_float64_out_dtype_works_with_x64(op):
  """out_dtype=float64 is refused without x64 (JAX would give float32) and honoured with it."""
  rng = np.random.default_rng(8)
  with jax.enable_x64(True):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    args = ((x, jnp.asarray(rng.standard_normal((64, 64)), jnp.float32))
            if op in ("matmul_norm", "norm_matmul") else (x,))
    got = getattr(pallas_norm, op)(*args, out_dtype=jnp.float64)
    assert got.dtype == jnp.float64
    ref = getattr(pallas_norm.reference, op)(*args, out_dtype=jnp.float64)
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)


def test_eps_floor_follows_the_dtype_jax_computes_in():
  """A NumPy float64 input without x64 is computed in float32 (JAX canonicalizes it), so it
  gets float32's eps floor: 1e-30 would overflow rstd³ of a zero row in float32."""
  x = np.random.default_rng(9).standard_normal((4, 64))  # float64 NumPy
  with pytest.raises(ValueError, match="float32"):
    pallas_norm.rms_norm(x, eps=1e-30)
  with jax.enable_x64(True):  # computed in float64 there: accepted
    assert pallas_norm.rms_norm(x, eps=1e-30).dtype == jnp.float64


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
@pytest.mark.parametrize("op", ["matmul_norm", "norm_matmul"])
def test_numpy_float64_weight_with_a_float32_x(op):
  """Without x64 a NumPy float64 w is float32 to JAX: the eager call with NumPy float64 x and w
  was accepted, while its gradient in x (x traced as float32) or a jnp float32 x raised 'x and
  w must have the same dtype' (a new-user review). Both are accepted now, with the same values;
  a bfloat16 x with that w is still refused."""
  rng = np.random.default_rng(3)
  x, w = rng.standard_normal((16, 64)), rng.standard_normal((64, 64)) / 8  # float64 NumPy
  fn = getattr(pallas_norm, op)
  eager = fn(x, w, norm="layer")
  np.testing.assert_array_equal(fn(jnp.asarray(x), w, norm="layer"), eager)
  grad = jax.grad(lambda a: fn(a, w, norm="layer").sum())(x)
  want = jax.grad(lambda a: fn(a, jnp.asarray(w), norm="layer").sum())(jnp.asarray(x))
  np.testing.assert_array_equal(grad, want)
  with pytest.raises(TypeError, match="same dtype"):
    fn(jnp.asarray(x, jnp.bfloat16), w, norm="layer")


@pytest.mark.parametrize("op,implementation", [("rms_norm", "xla"), ("layer_norm", "xla"),
                                               ("layer_norm", "interpret"),
                                               ("matmul_norm", "xla")])
def test_numpy_float64_residual_with_a_float32_x(op, implementation):
  """Without x64 a NumPy float64 residual is float32 to JAX, as a NumPy float64 w is (the test
  above); a review found it refused with a jnp float32 x ("residual must have x's dtype
  float32, got float64"), eagerly, under jax.jit and in the gradient, while such a w is
  accepted. It runs now, with the values of the float32 residual; a bfloat16 x with it is
  still refused."""
  args = good_args(op)
  residual = np.asarray(args["residual"], np.float64)
  fn = functools.partial(op_fn(op), implementation=implementation)
  for call in (fn, jax.jit(fn)):
    for got, ref in zip(jax.tree.leaves(call(**dict(args, residual=residual))),
                        jax.tree.leaves(call(**args))):
      assert got.dtype == ref.dtype == F32
      np.testing.assert_array_equal(got, ref)
  loss = lambda x, r: jnp.sum(jax.tree.leaves(fn(**dict(args, x=x, residual=r)))[0] ** 2)
  np.testing.assert_array_equal(jax.grad(loss)(args["x"], residual),
                                jax.grad(loss)(args["x"], args["residual"]))
  w16 = {"w": args["w"].astype(jnp.bfloat16)} if op == "matmul_norm" else {}
  with pytest.raises(TypeError) as info:
    fn(**dict(args, x=args["x"].astype(jnp.bfloat16), residual=residual, **w16))
  assert_names(info.value, "residual")


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_numpy_float64_kv_with_a_float32_q(op):
  """The attention ops' form of the test above (review_attn): the eager call with NumPy
  float64 q, k, v (float32 to JAX without x64) was accepted, while its gradient in q (q traced
  as float32), its jit, or a jnp float32 q with those k, v raised "q, k and v must share a
  dtype". All give the float32 call's values now (rtol 1e-6 against the float32 reference);
  a bfloat16 q with them is still refused."""
  args = {name: np.asarray(a, np.float64) if name in "qkv" else a
          for name, a in good_args(op).items()}
  as_f32 = {name: jnp.asarray(a, F32) if name in "qkv" else a for name, a in args.items()}
  fn = functools.partial(op_fn(op), implementation="xla")
  ref_fn = reference.flash_norm_attention if op == "flash_norm_attention" else reference.gdpa
  loss = lambda f, a: jnp.sum(jnp.sin(f(**a)))  # noqa: E731
  want = ref_fn(**as_f32)
  np.testing.assert_allclose(fn(**args), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(fn(**dict(args, q=as_f32["q"])), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.jit(lambda q: fn(**dict(args, q=q)))(args["q"]), want,
                             rtol=1e-6, atol=1e-6)
  grad = jax.grad(lambda q: loss(fn, dict(args, q=q)))(args["q"])
  want_grad = jax.grad(lambda q: loss(ref_fn, dict(as_f32, q=q)))(as_f32["q"])
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
  with pytest.raises(TypeError, match="share a dtype"):
    fn(**dict(args, q=jnp.asarray(args["q"], jnp.bfloat16)))


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_numpy_int64_offsets_are_int32_eagerly_as_under_jit(op):
  """Without x64 a NumPy int64 offsets array is int32 to JAX: jax.jit converts it before the op
  sees it, so the jitted call took it while the eager call raised "q_offsets must be int32,
  got int64" (review_jagged). Both now give the int32 call's values (rtol 1e-6 against the
  reference), and its gradient; with x64 on, int64 offsets stay refused, eagerly and under
  jit alike. Narrower or unsigned offsets are refused either way (the cases above)."""
  args = good_args(op)
  names = [n for n in ("q_offsets", "kv_offsets") if n in args]
  as64 = dict(args, **{n: np.asarray(args[n], np.int64) for n in names})
  fn = functools.partial(op_fn(op), implementation="xla")
  ref_fn = reference.flash_norm_attention if op == "flash_norm_attention" else reference.gdpa
  want = ref_fn(**args)
  np.testing.assert_allclose(fn(**as64), want, rtol=1e-6, atol=1e-6)
  jitted = jax.jit(lambda q, *off: fn(**dict(as64, q=q, **dict(zip(names, off)))))
  np.testing.assert_allclose(jitted(args["q"], *(as64[n] for n in names)), want, rtol=1e-6,
                             atol=1e-6)
  loss = lambda f, a, q: jnp.sum(jnp.sin(f(**dict(a, q=q))))  # noqa: E731
  np.testing.assert_allclose(jax.grad(functools.partial(loss, fn, as64))(args["q"]),
                             jax.grad(functools.partial(loss, ref_fn, args))(args["q"]),
                             rtol=1e-5, atol=1e-6)
  with jax.enable_x64(True):
    for call in (fn, jax.jit(fn)):
      with pytest.raises(TypeError, match="q_offsets must be int32, got int64"):
        call(**as64)


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention",
                                "softmax_attention"])
def test_numpy_float64_inputs_warn_of_no_truncation(op):
  """NumPy float64 inputs (float32 to JAX without x64) are accepted; the library's own
  ``astype(q.dtype)`` / ``jnp.zeros(..., k.dtype)`` of them warned "Explicitly requested dtype
  float64 requested in astype is not available" although the caller asked for no float64
  (review_jagged). No warning now, forward or gradient, and the float32 call's values.
  softmax_attention compared dtypes as written: its gradient in such a q (traced as float32)
  raised "k must have q's dtype float32, got float64" where the eager call ran."""
  if op == "softmax_attention":
    rng = np.random.default_rng(5)
    args = dict(zip("qkv", (rng.standard_normal((2, 8, H, D)) for _ in range(3))),
                q_lengths=np.asarray([8, 3], np.int32), kv_lengths=np.asarray([5, 8], np.int32))
    fn = pallas_norm.softmax_attention
  else:
    args = {name: np.asarray(a, np.float64) if name in ("q", "k", "v", "ln_scale", "ln_bias",
                                                        "rms_scale") else a
            for name, a in good_args(op).items()}
    fn = functools.partial(op_fn(op), implementation="xla")
  as_f32 = {n: jnp.asarray(a, F32) if a.dtype == np.float64 else a for n, a in args.items()}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = fn(**args)
    grad = jax.grad(lambda q: jnp.sum(jnp.sin(fn(**dict(args, q=q)))))(args["q"])
  np.testing.assert_allclose(got, fn(**as_f32), rtol=1e-6, atol=1e-6)
  want_grad = jax.grad(lambda q: jnp.sum(jnp.sin(fn(**dict(as_f32, q=q)))))(as_f32["q"])
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::pallas_norm._dispatch.KernelSkippedWarning")
@pytest.mark.parametrize("op", ["matmul_norm", "norm_matmul"])
def test_kernels_step_aside_under_x64(monkeypatch, op):
  """Under jax_enable_x64 the kernels cannot be traced (their int32 index arithmetic meets int64
  loop indices; a fresh-eyes review found every kernel call failing inside the kernel): a
  sequence falls back to XLA with XLA's values, "interpret" alone raises NotImplementedError
  naming x64 before any kernel runs, and implementation=None on a Hopper GPU picks XLA."""
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((128, 128)) / 11, jnp.bfloat16)
  fn = getattr(pallas_norm, op)
  with jax.enable_x64(True):
    want = fn(x, w, implementation="xla")
    chex.assert_trees_all_close(fn(x, w, implementation=("interpret", "xla")), want,
                                rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="jax_enable_x64"):
      fn(x, w, implementation="interpret")
    monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
    assert _dispatch.choose(op, None, lambda _: None) == "xla"
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  assert _dispatch.choose(op, None, lambda _: None) == "mosaic"  # x64 off again


def test_norm_matmul_kernel_refuses_an_out_dtype_it_cannot_write():
  from pallas_norm.ops.norm_matmul import api as nm
  x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
  assert "float64" in nm.kernel_unsupported_reason(x, w, jnp.float64)
  assert nm.kernel_unsupported_reason(x, w, jnp.float32) is None


def test_interpret_kernel_runs_under_disable_jit():
  """jax.disable_jit() hands the kernel body Python ints for loop indices (a review found the
  pre-norm statistics failing on them)."""
  _dispatch.interpret_threads_reason() is None or pytest.skip("needs PJRT_NPROC >= 8")
  rng = np.random.default_rng(12)
  x = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((128, 64)) / 11, jnp.bfloat16)
  with jax.disable_jit():
    got = pallas_norm.norm_matmul(x, w, norm="layer", implementation="interpret")
  want = pallas_norm.reference.norm_matmul(x.astype(jnp.float32), w.astype(jnp.float32),
                                           norm="layer")
  chex.assert_trees_all_close(got.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("op", ["norm_matmul", "matmul_norm"])
def test_kernel_path_validates_and_picks_its_config_once(op, monkeypatch):
  """One call of the op on the kernel path, forward and backward traced (as on a Hopper GPU, so
  nothing runs): the forward kernel's config is picked once and handed down, and the kernel
  module does not check the arguments again (the op validated them)."""
  import importlib
  mosaic = importlib.import_module(f"pallas_norm.ops.{op}.mosaic")
  picked, checked = [], []
  real_pick = mosaic.pick_config
  monkeypatch.setattr(mosaic, "pick_config",
                      lambda *shape: picked.append(shape) or real_pick(*shape))
  monkeypatch.setattr(mosaic, "_check_args", lambda *a: checked.append(a))
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  x, w = jnp.ones((4, 8, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16)
  kw = dict(residual=jnp.ones((4, 8, 256), jnp.bfloat16)) if op == "matmul_norm" else {}
  fn = getattr(pallas_norm, op)
  loss = lambda x, w: jnp.sum(fn(x, w, implementation="mosaic", **kw).astype(F32))  # noqa: E731
  jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  # (M, K, N) is the forward's; norm_matmul's dx kernel derives its tiles from (M, N, K).
  assert picked.count((32, 128, 256)) == 1 and not checked, (picked, len(checked))


@pytest.mark.parametrize("op", ["gdpa", "flash_norm_attention"])
def test_gdpa_kernel_path_hands_its_config_down(op, monkeypatch):
  """pn.gdpa on the kernel path, and flash_norm_attention's unfused chain around the GDPA kernel
  (jagged K/V: the fused kernels take dense K/V only), forward and backward traced as on a
  Hopper GPU (nothing runs): the op picks the forward kernel's tiling once (the dispatch's
  question whether one fits) and passes it to the kernel, which picks none."""
  from pallas_norm.ops.gdpa import configs as gdpa_configs, mosaic as gdpa_mosaic
  handed, picked = [], []
  real_fwd, real_pick = gdpa_mosaic.gdpa_fwd, gdpa_configs.pick_config
  monkeypatch.setattr(gdpa_mosaic, "gdpa_fwd", lambda *a, config=None, **kw: (
      handed.append(config) or real_fwd(*a, config=config, **kw)))
  monkeypatch.setattr(gdpa_configs, "pick_config",
                      lambda *a, **kw: picked.append(a) or real_pick(*a, **kw))
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  q = jnp.ones((128, 2, 64), jnp.bfloat16)
  offsets = jnp.array([0, 60, 128], jnp.int32)
  if op == "gdpa":
    kv, kv_offsets, kv_rows = jnp.ones((2, 128, 2, 64), jnp.bfloat16), None, 128
  else:  # packed K/V: a window of Tkv + 7 rows, rounded up to 64
    kv, kv_offsets, kv_rows = jnp.ones((128, 2, 64), jnp.bfloat16), offsets, 192
  fn = getattr(pallas_norm, op)
  loss = lambda q: jnp.sum(fn(q, kv, kv, offsets, kv_offsets, implementation="mosaic")  # noqa: E731
                           .astype(F32))
  jax.make_jaxpr(jax.grad(loss))(q)
  want = real_pick(kv_rows, 64, jnp.bfloat16, jnp.bfloat16)
  assert handed == [want] and len(picked) == 1, (handed, picked)


def test_norm_matmul_backward_decides_its_dx_route_once(monkeypatch):
  """norm_matmul's backward on the kernel path (traced as on a Hopper GPU, nothing runs): it asks
  once whether the dx kernel sums its rows in the epilogue, picks the dx kernel's tiling once,
  and calls the kernel module's launch, which checks nothing again (the op validated)."""
  from pallas_norm.ops.norm_matmul import mosaic_bwd, routing
  # The x̂ route (the weight-gradient kernel's route picks the same way, with x_hat=False).
  monkeypatch.setattr(routing, "weight_grad_kernel_pays", lambda k, n: False)
  asked, picked, checked = [], [], []
  real_ask, real_pick = mosaic_bwd.row_sums_unsupported_reason, mosaic_bwd.pick_config
  monkeypatch.setattr(mosaic_bwd, "row_sums_unsupported_reason",
                      lambda *a, **kw: asked.append(a) or real_ask(*a, **kw))
  monkeypatch.setattr(mosaic_bwd, "pick_config",
                      lambda *a, **kw: picked.append((a, kw)) or real_pick(*a, **kw))
  monkeypatch.setattr(mosaic_bwd, "_check_args", lambda *a: checked.append(a))
  monkeypatch.setattr(_dispatch, "on_hopper_gpu", lambda: True)
  x, w = jnp.ones((4, 8, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16)
  bias = jnp.ones((128,), jnp.bfloat16)
  loss = lambda x, w: jnp.sum(pallas_norm.norm_matmul(  # noqa: E731
      x, w, norm_bias=bias, norm="layer", implementation="mosaic").astype(F32))
  jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  want = ((32, 256, 128), dict(fused_row_terms=False, x_hat=True, row_sums=True,
                               interpret=False))
  assert len(asked) == 1 and picked == [want] and not checked, (asked, picked, len(checked))


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_attention_bounds_equal_to_the_longest_sample_are_accepted(op):
  """max_seq_len (and max_kv_len) equal to the longest sample (3 q rows, 3 kv rows) is valid,
  concrete and traced, and gives the capacity's result; one less raises (the cases above). A
  mutation test made the concrete check `>=` unnoticed by this file."""
  args = good_args(op)
  fn = op_fn(op)
  kv = {"max_kv_len": 3} if op == "gdpa_jagged" else {}
  want = fn(**args, max_seq_len=T, implementation="xla")
  got = fn(**args, max_seq_len=3, **kv, implementation="xla")
  traced = jax.jit(lambda a: fn(**a, max_seq_len=3, **kv, implementation="xla"))(args)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(traced, want, rtol=1e-6, atol=1e-6)


def test_zero_max_seq_len_raises_naming_it_also_for_empty_samples():
  q, k = _arr((8, 1, 4)), _arr((1, 4, 1, 4), seed=1)
  with pytest.raises(ValueError, match="max_seq_len must be a positive"):
    pallas_norm.gdpa(q, k, k, _off([0, 0]), max_seq_len=0, implementation="xla")


def test_a_kernel_skipped_off_hopper_warns_naming_hopper(monkeypatch):
  """("mosaic", "xla") off a Hopper GPU runs XLA with a KernelSkippedWarning that says why (a
  reason of the process, reported; a mutation test made it silent unnoticed)."""
  if _dispatch.on_hopper_gpu():
    pytest.skip("checks the behaviour off Hopper")
  monkeypatch.setattr(_dispatch, "_warned", set())  # once per process: not yet in this one
  x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
  with pytest.warns(_dispatch.KernelSkippedWarning, match="Hopper"):
    pallas_norm.norm_matmul(x, w, implementation=("mosaic", "xla"))


@pytest.mark.parametrize("bound", [T + 1, 2**31, 2**40])
@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_attention_bounds_past_the_capacity_act_as_the_capacity(op, bound):
  """max_seq_len / max_kv_len are upper bounds, and a sample never holds more rows than its
  packed capacity. Bounds far past it sized the XLA path's padded layout by the bound: 2**31
  raised JAX's OverflowError naming no argument, 2**40 killed the process with SIGFPE, 10**7 sat
  on gigabytes for a 7-row batch (review11). They now act as the capacity."""
  args = good_args(op)
  fn = op_fn(op)
  want = fn(**args, max_seq_len=T, **({"max_kv_len": TKV} if op == "gdpa_jagged" else {}),
            implementation="xla")
  got = fn(**args, max_seq_len=bound, **({"max_kv_len": bound} if op == "gdpa_jagged" else {}),
           implementation="xla")
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("eps, error", [
    (10**400, ValueError), (fractions.Fraction(1, 10**6), None), (-(10**400), ValueError)],
    ids=["int-past-float", "fraction", "negative-int-past-float"])
def test_eps_of_other_real_types(eps, error):
  """eps=10**400 raised Python's OverflowError "int too large to convert to float" and a
  Fraction NumPy's "ufunc 'isfinite' not supported", neither naming eps (review11). A Fraction
  is a real number: it works."""
  x = _arr((3, 8))
  if error is None:
    np.testing.assert_allclose(pallas_norm.rms_norm(x, eps=eps, implementation="xla"),
                               reference.rms_norm(x, eps=1e-6), rtol=1e-6)
    return
  with pytest.raises(error, match="eps must"):
    pallas_norm.rms_norm(x, eps=eps, implementation="xla")


@pytest.mark.parametrize("op", ["gdpa", "flash_norm_attention"])
@pytest.mark.parametrize("arg", ["pre_scale", "post_scale"])
@pytest.mark.parametrize("value", [10**400, -(10**400), 1e39, np.float64(-1e39)],
                         ids=["int-past-float", "negative-int-past-float", "past-float32",
                              "np-past-float32"])
def test_scales_past_the_compute_dtype_raise_naming_them(op, arg, value):
  """pre_scale=10**400 raised Python's OverflowError "int too large to convert to float"
  naming no argument, and 1e39 (finite as a Python float, inf in the float32 every path
  computes the scales in for non-float64 q: the kernels cast them to float32, the XLA path
  multiplies a float32 product by them) passed and gave an output of ±inf and NaN (review12).
  As for eps: a ValueError naming the scale."""
  with pytest.raises(ValueError, match=arg):
    op_fn(op)(**good_args(op), **{arg: value}, implementation="xla")


def test_scales_finite_in_float64_run_with_float64_q():
  """The float32 bound applies to float32 statistics only: a float64 q computes in float64,
  where pre_scale=1e39 is an ordinary number (as eps=1e39 is there)."""
  with jax.enable_x64(True):
    args = {name: a.astype(jnp.float64) if name in "qkv" else a
            for name, a in good_args("gdpa").items()}
    got = pallas_norm.gdpa(**args, post_scale=1e39, activation="identity", implementation="xla")
    want = reference.gdpa(**args, post_scale=1e39, activation="identity")
  np.testing.assert_allclose(got, want, rtol=1e-12)
  assert bool(jnp.all(jnp.isfinite(got)))


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
@pytest.mark.parametrize("value", [fractions.Fraction(1, 3), decimal.Decimal("0.375"),
                                   np.longdouble(0.625)],
                         ids=["fraction", "decimal", "longdouble"])
def test_scales_of_other_real_types_compute_as_floats(op, value):
  """A Fraction, a Decimal or a NumPy longdouble pre_scale/post_scale passed the checks (real,
  finite) and failed inside the XLA path: TypeError "unsupported operand type(s) for *:
  'Fraction' and 'ArrayImpl'", ValueError "float128 is not a valid dtype for JAX type
  promotion", naming no argument (review_attn). They compute as their float now, as eps does
  (rtol 1e-6 against the float32 reference), under jit too."""
  args = good_args(op)
  ref_fn = reference.flash_norm_attention if op == "flash_norm_attention" else reference.gdpa
  want = ref_fn(**args, pre_scale=float(value), post_scale=2 * float(value))
  call = lambda a: op_fn(op)(**a, pre_scale=value, post_scale=2 * value,  # noqa: E731
                             implementation="xla")
  np.testing.assert_allclose(call(args), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.jit(call)(args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_kv_of_the_other_form_raises_naming_kv_offsets(op):
  """kv_offsets decides whether k/v are dense (B, Lkv, H, D) or packed (Tkv, H, D): packed k/v
  without kv_offsets raised "k must have 4 dimension(s), got shape (12, 2, 4)", and dense k/v
  with them "... 3 dimension(s) ...", neither saying that kv_offsets is what decides
  (review_attn). The ValueError names k and what to pass."""
  args = good_args(op)
  if op == "gdpa_jagged":  # dense k/v with kv_offsets
    other = dict(k=_arr((B, L_KV, H, D), seed=1), v=_arr((B, L_KV, H, D), seed=2))
    text = r"k must have 3 dimensions, packed \(Tkv, H, D\) with kv_offsets.*kv_offsets=None"
  else:  # packed k/v without kv_offsets
    other = dict(k=_arr((TKV, H, D), seed=1), v=_arr((TKV, H, D), seed=2))
    text = r"k must have 4 dimensions, dense \(B, Lkv, H, D\) without kv_offsets.*need kv_off"
  with pytest.raises(ValueError, match=text):
    op_fn(op)(**dict(args, **other), implementation="xla")
  with pytest.raises(ValueError, match=text):  # the same under jit
    jax.jit(lambda a: op_fn(op)(**a, implementation="xla"))(dict(args, **other))


def test_layer_scales_past_float_raise_naming_them():
  """The layers validate their scales at construction: 10**400 raised OverflowError there."""
  import flax_layers as fl  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="pre_scale"):
    fl.GDPA(H, D, pre_scale=10**400)
  with pytest.raises(ValueError, match="post_scale"):
    fl.PFFNBlock(H, D, post_scale=-(10**400), rngs=nnx.Rngs(0))


def test_flash_norm_attention_without_heads_raises_naming_q():
  """q of shape (T, 0, D): the block normalizes over H·D = 0 features, as a norm of an empty
  feature axis (which rms_norm/layer_norm refuse with a ValueError naming x); it raised
  IndexError "index is out of bounds for axis 1 with size 0" from inside the reference's
  LayerNorm (review12). gdpa refuses it too, as it refuses D = 0."""
  args = good_args("gdpa")
  empty = {name: a[..., :0, :] if name in "qkv" else a for name, a in args.items()}
  with pytest.raises(ValueError, match="q has no heads"):
    pallas_norm.gdpa(**empty, implementation="xla")
  with pytest.raises(ValueError, match=r"\bq\b"):
    pallas_norm.flash_norm_attention(**empty, implementation="xla")
  with pytest.raises(ValueError, match=r"\bq\b"):
    pallas_norm.flash_norm_attention(**empty, pre_layer_norm=False, implementation="xla")


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_offsets_that_fill_the_capacity_are_valid_eagerly_and_under_jit(op):
  """A last offset equal to the packed capacity (no padding rows) is valid: the eager check
  allows last <= T, and the traced check must not turn the jitted output into NaN. Both calls
  match the reference (a mutation test made either bound strict unnoticed: every test batch
  had padding rows)."""
  args = dict(good_args(op), q=_arr((T, H, D), seed=7), q_offsets=_off([0, 2, 2, T]))
  if op == "gdpa_jagged":
    args["kv_offsets"] = _off([0, 1, 4, TKV])
  fn = functools.partial(op_fn(op), implementation="xla")
  ref_fn = reference.flash_norm_attention if op == "flash_norm_attention" else reference.gdpa
  want = ref_fn(**args)
  np.testing.assert_allclose(fn(**args), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jax.jit(lambda a: fn(**a))(args), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_offsets_of_no_sample_raise_the_shape_error(op):
  """q_offsets of shape (1,) describe B = 0 samples, which the ops refuse by shape ("(B+1,)
  with B >= 1"), also where k/v agree with B = 0 (the bad-argument case of _off([0]) was met
  only by the k/v batch check, whose message also names q_offsets)."""
  args = dict(good_args(op), q_offsets=_off([0]))
  if op == "gdpa_jagged":
    args["kv_offsets"] = _off([0])
  else:
    args.update(k=_arr((0, L_KV, H, D), seed=1), v=_arr((0, L_KV, H, D), seed=2))
  with pytest.raises(ValueError, match=r"^q_offsets must have shape \(B\+1,\) with B >= 1"):
    op_fn(op)(**args, implementation="xla")


@pytest.mark.parametrize("heads", [1, H + 1])
@pytest.mark.parametrize("op", ["gdpa", "gdpa_jagged", "flash_norm_attention"])
def test_kv_of_other_heads_raise_naming_h_and_d(op, heads):
  """k/v of another number of heads than q (D the same) raise the check's ValueError, eagerly
  and under jit (the bad-argument cases changed D only; a mutation test that compared D alone
  survived)."""
  args = good_args(op)
  shape = args["k"].shape[:-2] + (heads, D)
  args.update(k=_arr(shape, seed=8), v=_arr(shape, seed=9))
  fn = functools.partial(op_fn(op), implementation="xla")
  with pytest.raises(ValueError, match=r"^k and v must end in \(H, D\) = \(2, 4\) like q"):
    fn(**args)
  with pytest.raises(ValueError, match=r"^k and v must end in \(H, D\)"):
    jax.jit(lambda a: fn(**a))(args)


@pytest.mark.parametrize("given", ["ln_scale", "ln_bias"])
def test_layer_norm_affine_without_pre_layer_norm_raises(given):
  """ln_scale or ln_bias alone with pre_layer_norm=False would be ignored silently: each one
  raises (a mutation test that checked ln_scale only survived)."""
  args = dict(good_args("flash_norm_attention"), ln_scale=None, ln_bias=None)
  args[given] = _arr((H * D,), seed=10)
  with pytest.raises(ValueError, match="^ln_scale and ln_bias apply only with pre_layer_norm"):
    pallas_norm.flash_norm_attention(**args, pre_layer_norm=False, implementation="xla")
