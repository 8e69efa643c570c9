"""Flax NNX layers (flax_layers): parameters, values against pallas_norm.reference and against
plain Flax layers, jit, bf16 compute, the implementation switch, residuals and gradients.

Tolerances: float32 layer vs float32 oracle 1e-5 (abs and rel; same math, different op order);
bf16 compute vs float32 5e-2 abs on unit-scale outputs (bf16 has 8 mantissa bits).
"""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# The checkout first: an editable install made before flax_layers/ had an __init__.py maps it as a
# namespace package, which `pytest` (unlike `python -m pytest`) would otherwise import.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import pallas_norm  # noqa: E402
from flax_layers import (GDPA, DenseNorm, KunlunConfig, KunlunModel, LayerNorm,  # noqa: E402
                         NormDense, PFFNBlock, RMSNorm)
from flax_layers import _common  # noqa: E402
from pallas_norm import jagged, reference  # noqa: E402

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_ATOL = 5e-2
K, N = 16, 24
H, D, LKV = 2, 8, 4
LENS = (3, 0, 5, 2)  # one empty sample
MAX_LEN = 5
CAPACITY = len(LENS) * MAX_LEN  # padding rows past sum(LENS) = 10

_NORMAL = nnx.initializers.normal(1.0)


def _key(i):
  return jax.random.key(1000 + i)


def _x(i, shape, dtype=jnp.float32):
  return jax.random.normal(_key(i), shape, jnp.float32).astype(dtype)


def _offsets():
  return jnp.asarray(jagged.offsets_from_lengths(LENS))


def _attention_inputs(seed=0):
  q = _x(seed, (CAPACITY, H, D))
  k = _x(seed + 1, (len(LENS), LKV, H, D))
  v = _x(seed + 2, (len(LENS), LKV, H, D))
  return q, k, v


# Layer builders with random (not ones/zeros) affines so the tests see every parameter.
def _rms(**kw):
  return RMSNorm(N, scale_init=_NORMAL, rngs=nnx.Rngs(0), **kw)


def _ln(**kw):
  return LayerNorm(N, scale_init=_NORMAL, bias_init=_NORMAL, rngs=nnx.Rngs(0), **kw)


def _norm_dense(norm="layer", **kw):
  return NormDense(K, N, norm=norm, scale_init=_NORMAL, norm_bias_init=_NORMAL, bias_init=_NORMAL,
                   rngs=nnx.Rngs(0), **kw)


def _dense_norm(norm="layer", **kw):
  return DenseNorm(K, N, norm=norm, scale_init=_NORMAL, norm_bias_init=_NORMAL,
                   bias_init=_NORMAL, rngs=nnx.Rngs(0), **kw)


def _pffn(**kw):
  return PFFNBlock(H, D, pre_scale=D ** -0.5, post_scale=0.5, scale_init=_NORMAL,
                   bias_init=_NORMAL, rngs=nnx.Rngs(0), **kw)


def _params(layer):
  return {k: v for k, v in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}


# ---------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize("make, expected", [
    (_rms, {"scale": (N,)}),
    (_ln, {"scale": (N,), "bias": (N,)}),
    (lambda: _norm_dense("layer"),
     {"norm_scale": (K,), "norm_bias": (K,), "kernel": (K, N), "bias": (N,)}),
    (lambda: _norm_dense("rms"), {"norm_scale": (K,), "kernel": (K, N), "bias": (N,)}),
    (lambda: _dense_norm("layer"),
     {"kernel": (K, N), "bias": (N,), "norm_scale": (N,), "norm_bias": (N,)}),
    (lambda: _dense_norm("rms"), {"kernel": (K, N), "bias": (N,), "norm_scale": (N,)}),
    (_pffn, {"ln_scale": (H * D,), "ln_bias": (H * D,), "rms_scale": (H * D,)}),
])
def test_param_names_shapes_dtypes(make, expected):
  params = _params(make())
  assert {k: v.shape for k, v in params.items()} == expected
  assert all(v.dtype == jnp.float32 for v in params.values())


def test_optional_params_can_be_left_out():
  assert _params(RMSNorm(N, use_scale=False, rngs=nnx.Rngs(0))) == {}
  assert set(_params(NormDense(K, N, norm="layer", use_norm_bias=False, use_bias=False,
                               rngs=nnx.Rngs(0)))) == {"norm_scale", "kernel"}
  assert set(_params(DenseNorm(K, N, use_bias=False, use_scale=False, rngs=nnx.Rngs(0)))) == {
      "kernel", "norm_bias"}
  assert _params(GDPA(H, D)) == {}


def test_bf16_compute_keeps_f32_params():
  layer = _norm_dense(dtype=jnp.bfloat16)
  assert all(v.dtype == jnp.float32 for v in _params(layer).values())
  assert layer(_x(0, (3, K))).dtype == jnp.bfloat16


@pytest.mark.parametrize("make", [
    lambda: NormDense(K, N, norm="batch", rngs=nnx.Rngs(0)),
    lambda: DenseNorm(K, N, norm="group", rngs=nnx.Rngs(0)),
    lambda: RMSNorm(0, rngs=nnx.Rngs(0)),
    lambda: NormDense(K, -1, rngs=nnx.Rngs(0)),
    lambda: GDPA(H, D, activation="softmax"),
    lambda: PFFNBlock(H, D, activation="tanh", rngs=nnx.Rngs(0)),
    lambda: GDPA(H, D, activation=["gelu"]),  # unhashable: was a TypeError from the dict lookup
])
def test_bad_construction_raises(make):
  with pytest.raises(ValueError):
    make()


def test_norm_that_is_not_a_string_raises_naming_norm():
  """A NumPy array of names raised NumPy's "truth value ... is ambiguous" (a ValueError that
  named nothing)."""
  with pytest.raises(ValueError, match="norm must be"):
    NormDense(K, N, norm=np.array(["rms", "layer"]), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make, error, message", [
    (lambda: NormDense(128, 64, rngs=None), TypeError, "NormDense: rngs must be an nnx.Rngs"),
    (lambda: DenseNorm(K, N, rngs=0), TypeError, "DenseNorm: rngs must be an nnx.Rngs"),
    (lambda: RMSNorm(N, rngs=None), TypeError, "RMSNorm: rngs must be an nnx.Rngs"),
    # no parameter to create: the required rngs is checked all the same
    (lambda: RMSNorm(N, use_scale=False, rngs=None), TypeError, "RMSNorm: rngs must be"),
    (lambda: LayerNorm(N, rngs=jax.random.key(0)), TypeError, "LayerNorm: rngs must be"),
    (lambda: PFFNBlock(H, D, rngs=None), TypeError, "PFFNBlock: rngs must be an nnx.Rngs"),
    (lambda: KunlunModel(KunlunConfig(), rngs=None), TypeError,
     "KunlunModel: rngs must be an nnx.Rngs"),
    (lambda: NormDense(128, 64, norm="batch", rngs=nnx.Rngs(0)), ValueError,
     "NormDense: norm must be one of"),
    (lambda: DenseNorm(K, N, norm="group", rngs=nnx.Rngs(0)), ValueError,
     "DenseNorm: norm must be one of"),
    (lambda: NormDense(K, N, norm=np.array(["rms"]), rngs=nnx.Rngs(0)), ValueError,
     "NormDense: norm must be one of"),
    (lambda: GDPA(1, 64, activation="softmax"), ValueError, "GDPA: activation must be one of"),
    (lambda: PFFNBlock(H, D, activation="tanh", rngs=nnx.Rngs(0)), ValueError,
     "PFFNBlock: activation must be one of"),
    (lambda: GDPA(1, 64, pre_scale=float("inf")), ValueError, "GDPA: pre_scale must be finite"),
    (lambda: GDPA(1, 64, post_scale="1"), TypeError, "GDPA: post_scale must be a real scalar"),
    (lambda: GDPA(H, D, pre_scale=1e39, dtype=jnp.bfloat16), ValueError,
     "GDPA: pre_scale must be finite in float32"),
    (lambda: PFFNBlock(H, D, post_scale=float("nan"), rngs=nnx.Rngs(0)), ValueError,
     "PFFNBlock: post_scale must be finite"),
    (lambda: GDPA(H, D, implementation="cuda"), ValueError, "GDPA: implementation must be"),
    (lambda: NormDense(K, N, implementation="cuda", rngs=nnx.Rngs(0)), ValueError,
     "NormDense: implementation must be"),
    (lambda: KunlunModel(KunlunConfig(), implementation="cuda", rngs=nnx.Rngs(0)), ValueError,
     "KunlunModel: implementation must be"),
], ids=["norm_dense_rngs", "dense_norm_rngs", "rms_rngs", "rms_rngs_no_params", "ln_rngs_key",
        "pffn_rngs", "kunlun_rngs", "norm_dense_norm", "dense_norm_norm", "norm_array",
        "gdpa_activation", "pffn_activation", "gdpa_pre_scale", "gdpa_post_scale",
        "gdpa_pre_scale_f32", "pffn_post_scale", "gdpa_impl", "norm_dense_impl", "kunlun_impl"])
def test_construction_errors_start_with_the_layer_name(make, error, message):
  """A review found rngs=None an AttributeError ('NoneType' object has no attribute 'params')
  and a bad norm, activation, scale or implementation a ValueError without the layer's name,
  where every other construction error starts with it."""
  with pytest.raises(error, match="^" + re.escape(message)) as info:
    make()
  assert type(info.value) is error


@pytest.mark.parametrize("make, name", [
    (lambda: RMSNorm(K, use_scale="no", rngs=nnx.Rngs(0)), "use_scale"),
    (lambda: LayerNorm(K, use_bias="False", rngs=nnx.Rngs(0)), "use_bias"),
    (lambda: NormDense(K, N, use_norm_bias="no", rngs=nnx.Rngs(0)), "use_norm_bias"),
    (lambda: NormDense(K, N, use_bias=None, rngs=nnx.Rngs(0)), "use_bias"),
    (lambda: DenseNorm(K, N, use_scale=1, rngs=nnx.Rngs(0)), "use_scale"),
    (lambda: PFFNBlock(H, D, use_bias="no", rngs=nnx.Rngs(0)), "use_bias"),
    (lambda: PFFNBlock(H, D, outer_residual="no", rngs=nnx.Rngs(0)), "outer_residual"),
])
def test_non_bool_switches_raise_when_the_layer_is_built(make, name):
  """use_scale="no" or use_bias="False" is truthy and silently created the parameter (review 9),
  where the ops' own switches (return_h, zero_centered_scale, ...) raise TypeError."""
  with pytest.raises(TypeError, match=f"{name} must be a bool"):
    make()


# ---------------------------------------------------------------------------------------------
# Argument checks: errors name the layer's own arguments (not the op's internal ones)


@pytest.mark.parametrize("make", [
    lambda: RMSNorm(32, rngs=nnx.Rngs(0)),
    lambda: RMSNorm(32, use_scale=False, rngs=nnx.Rngs(0)),
    lambda: LayerNorm(32, rngs=nnx.Rngs(0)),
    lambda: LayerNorm(32, use_scale=False, rngs=nnx.Rngs(0)),
    lambda: LayerNorm(32, use_scale=False, use_bias=False, rngs=nnx.Rngs(0)),
])
@pytest.mark.parametrize("jit", [False, True])
def test_norm_input_width_must_match_num_features(make, jit):
  layer = make()
  call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
  name = type(layer).__name__
  with pytest.raises(ValueError, match=f"{name}: num_features=32 does not match the input's "
                                       "last dimension 64"):
    call(layer, _x(0, (2, 64)))


@pytest.mark.parametrize("make", [lambda: RMSNorm(32, rngs=nnx.Rngs(0)),
                                  lambda: LayerNorm(32, rngs=nnx.Rngs(0))], ids=["rms", "ln"])
def test_norm_op_errors_name_the_layer(make):
  # The op's own checks (a residual of another shape, return_h) come back with the layer in
  # front, as the dense layers' do, so that a model's error says which sub-layer.
  layer = make()
  where = re.escape(f"{type(layer).__name__}(num_features=32): ")
  with pytest.raises(ValueError, match=where + r"residual must have shape \(4, 32\)"):
    layer(_x(0, (4, 32)), _x(1, (1, 32)))
  with pytest.raises(TypeError, match=where + "return_h must be a bool"):
    layer(_x(0, (4, 32)), return_h=1)


@pytest.mark.parametrize("make", [
    lambda: NormDense(32, 64, rngs=nnx.Rngs(0)),
    lambda: NormDense(32, 64, norm="layer", use_scale=False, use_norm_bias=False,
                      rngs=nnx.Rngs(0)),
    lambda: DenseNorm(32, 64, rngs=nnx.Rngs(0)),
    lambda: DenseNorm(32, 64, use_bias=False, use_scale=False, rngs=nnx.Rngs(0)),
])
def test_dense_input_width_must_match_in_features(make):
  layer = make()
  name = type(layer).__name__
  with pytest.raises(ValueError, match=f"{name}: in_features=32 does not match the input's "
                                       "last dimension 64"):
    layer(_x(0, (2, 64)))


@pytest.mark.parametrize("make", [_rms, _ln, _norm_dense, _dense_norm],
                         ids=["rms", "ln", "norm_dense", "dense_norm"])
def test_non_array_input_raises_type_error(make):
  layer = make()
  width = K if isinstance(layer, (NormDense, DenseNorm)) else N
  with pytest.raises(TypeError, match=f"{type(layer).__name__}: x must be an array, got list"):
    layer([[0.0] * width])


_EPSILON_LAYERS = [
    lambda **kw: RMSNorm(N, rngs=nnx.Rngs(0), **kw),
    lambda **kw: LayerNorm(N, rngs=nnx.Rngs(0), **kw),
    lambda **kw: NormDense(K, N, rngs=nnx.Rngs(0), **kw),
    lambda **kw: DenseNorm(K, N, rngs=nnx.Rngs(0), **kw),
    lambda **kw: PFFNBlock(H, D, rngs=nnx.Rngs(0), **kw),
]
_EPSILON_IDS = ["rms", "ln", "norm_dense", "dense_norm", "pffn"]


@pytest.mark.parametrize("make", _EPSILON_LAYERS, ids=_EPSILON_IDS)
@pytest.mark.parametrize("epsilon, error", [
    (-1, ValueError), (0, ValueError), (0.0, ValueError), (float("nan"), ValueError),
    (float("inf"), ValueError), (1e-50, ValueError),  # 1e-50 is 0 in float32
    ("1e-6", TypeError), (None, TypeError), (True, TypeError),
])
def test_bad_epsilon_raises_when_the_layer_is_built(make, epsilon, error):
  with pytest.raises(error, match=r"invalid epsilon: eps must be a positive"):
    make(epsilon=epsilon)


@pytest.mark.parametrize("make", _EPSILON_LAYERS, ids=_EPSILON_IDS)
@pytest.mark.parametrize("epsilon", [1e-5, 1, np.float32(1e-5), jnp.float32(1e-5)])
def test_good_epsilon_is_a_python_float(make, epsilon):
  layer = make(epsilon=epsilon)
  assert type(layer.epsilon) is float and layer.epsilon == float(epsilon)


def test_epsilon_is_checked_in_the_layers_compute_dtype():
  """With x64, a float64 layer takes an epsilon that only float64 statistics can hold (1e-50 is
  0 in float32) and gives the float64 reference's values; a bf16/float32 layer still refuses it
  when built, and a layer without a dtype leaves the check to the op, which names eps for
  float32 inputs."""
  tiny = 1e-50
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in _attention_inputs(22))
    off = _offsets()
    pffn = _pffn(epsilon=tiny, dtype=jnp.float64, param_dtype=jnp.float64)
    p = _params(pffn)
    want = reference.flash_norm_attention(q, k, v, off, ln_scale=p["ln_scale"],
                                          ln_bias=p["ln_bias"], rms_scale=p["rms_scale"],
                                          pre_scale=D ** -0.5, post_scale=0.5, eps=tiny)
    got = pffn(q, off, k, v, max_seq_len=MAX_LEN)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    rms = _rms(epsilon=tiny, dtype=jnp.float64, param_dtype=jnp.float64)
    x = _x(23, (3, N)).astype(jnp.float64)
    want = reference.rms_norm(x, _params(rms)["scale"], eps=tiny)
    np.testing.assert_allclose(rms(x), want, rtol=1e-12, atol=1e-12)
    for make in _EPSILON_LAYERS:
      for dtype in (jnp.bfloat16, jnp.float32):
        with pytest.raises(ValueError, match="invalid epsilon: eps must be"):
          make(epsilon=tiny, dtype=dtype)
    loose = _pffn(epsilon=tiny)  # no dtype: the inputs decide at call time
    with pytest.raises(ValueError, match="eps"):
      loose(*(a.astype(jnp.float32) for a in (q,)), off, k.astype(jnp.float32),
            v.astype(jnp.float32), max_seq_len=MAX_LEN)


@pytest.mark.parametrize("name", ["pre_scale", "post_scale"])
def test_attention_scales_are_checked_in_the_layers_compute_dtype(name):
  """As epsilon: a bf16/float16/float32 GDPA or PFFNBlock refuses, when built, a scale that is
  inf in float32 (the dtype the ops compute it in for such inputs), naming it; it used to build
  and raise only at the first call. A float64 layer (x64) takes 1e39 and computes with it; a
  layer without a dtype keeps the loosest rule (float64's with x64, else float32's)."""
  makers = (lambda **kw: GDPA(H, D, **kw), lambda **kw: PFFNBlock(H, D, rngs=nnx.Rngs(0), **kw))
  for make in makers:
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
      with pytest.raises(ValueError, match=f"{name} must be finite in float32"):
        make(dtype=dtype, **{name: 1e39})
    # No dtype, x64 off: the inputs cannot be float64, and the message says so (it spoke of
    # float64 inputs).
    with pytest.raises(ValueError, match=f"{name} must be finite in float32 .*with x64 off"):
      make(**{name: 1e39})
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in _attention_inputs(24))
    off = _offsets()
    for make in makers:
      make(**{name: 1e39})  # no dtype: float64 inputs may come
    layer = GDPA(H, D, pre_scale=1e39, post_scale=1e-39, dtype=jnp.float64)
    want = reference.gdpa(q, k, v, off, pre_scale=1e39, post_scale=1e-39)
    np.testing.assert_allclose(layer(q, off, k, v, max_seq_len=MAX_LEN), want, rtol=1e-12,
                               atol=1e-12)


def test_array_epsilon_works_under_jit():
  # A concrete jax scalar epsilon used to become a tracer under nnx.jit, which the op rejects.
  layer = RMSNorm(N, epsilon=jnp.float32(1e-5), rngs=nnx.Rngs(0))
  x = _x(0, (3, N))
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), layer(x), **F32_TOL)


@pytest.mark.parametrize("make", [
    lambda **kw: GDPA(H, D, **kw),
    lambda **kw: PFFNBlock(H, D, rngs=nnx.Rngs(0), **kw),
], ids=["gdpa", "pffn"])
@pytest.mark.parametrize("arg, value, error", [
    ("pre_scale", "0.5", TypeError), ("pre_scale", float("nan"), ValueError),
    ("post_scale", None, TypeError), ("post_scale", float("inf"), ValueError),
])
def test_bad_attention_scale_raises_when_the_layer_is_built(make, arg, value, error):
  with pytest.raises(error, match=arg):
    make(**{arg: value})


@pytest.mark.parametrize("size", [np.int64(N), np.int32(N), np.uint8(N), jnp.int32(N)],
                         ids=["np.int64", "np.int32", "np.uint8", "jnp.int32"])
def test_integer_like_sizes_are_accepted(size):
  x = _x(0, (3, N))
  for layer in (RMSNorm(size, rngs=nnx.Rngs(0)), LayerNorm(size, rngs=nnx.Rngs(0))):
    assert type(layer.num_features) is int and layer.num_features == N
    assert layer(x).shape == (3, N)
  for cls in (NormDense, DenseNorm):
    layer = cls(size, size, rngs=nnx.Rngs(0))
    assert (type(layer.in_features), type(layer.out_features)) == (int, int)
    assert layer.kernel.shape == (N, N) and layer(x).shape == (3, N)
  q, k, v = _attention_inputs()
  for layer in (GDPA(np.int64(H), np.int64(D)), PFFNBlock(np.int64(H), np.int64(D),
                                                          rngs=nnx.Rngs(0))):
    assert (type(layer.num_heads), type(layer.head_dim)) == (int, int)
    assert layer(q, _offsets(), k, v, max_seq_len=MAX_LEN).shape == q.shape


@pytest.mark.parametrize("size", [float(N), np.float64(N), True, np.bool_(True), 0, np.int64(0),
                                  -1, np.int64(-3), "16", None])
@pytest.mark.parametrize("make, name", [
    (lambda s: RMSNorm(s, rngs=nnx.Rngs(0)), "num_features"),
    (lambda s: LayerNorm(s, rngs=nnx.Rngs(0)), "num_features"),
    (lambda s: NormDense(s, N, rngs=nnx.Rngs(0)), "in_features"),
    (lambda s: NormDense(K, s, rngs=nnx.Rngs(0)), "out_features"),
    (lambda s: DenseNorm(s, N, rngs=nnx.Rngs(0)), "in_features"),
    (lambda s: DenseNorm(K, s, rngs=nnx.Rngs(0)), "out_features"),
    (lambda s: GDPA(s, D), "num_heads"),
    (lambda s: PFFNBlock(H, s, rngs=nnx.Rngs(0)), "head_dim"),
], ids=["rms", "ln", "norm_dense_in", "norm_dense_out", "dense_norm_in", "dense_norm_out",
        "gdpa_heads", "pffn_head_dim"])
def test_non_integer_or_non_positive_sizes_raise(make, name, size):
  # The layer's name first, as every other construction error of the layers gives it.
  with pytest.raises(ValueError, match=rf"^(RMSNorm|LayerNorm|NormDense|DenseNorm|GDPA|PFFNBlock): "
                                       rf"{name} must be a positive integer"):
    make(size)


# ---------------------------------------------------------------------------------------------
# Values against the reference and against plain Flax layers (float32)


def test_rms_norm_matches_reference_and_flax():
  layer = _rms()
  x = _x(1, (2, 3, N))
  y = layer(x)
  np.testing.assert_allclose(y, reference.rms_norm(x, layer.scale[...]), **F32_TOL)
  flax_layer = nnx.RMSNorm(N, rngs=nnx.Rngs(0))
  flax_layer.scale[...] = layer.scale[...]
  np.testing.assert_allclose(y, flax_layer(x), **F32_TOL)


def test_layer_norm_matches_reference_and_flax():
  layer = _ln()
  x = _x(2, (2, 3, N)) * 3 + 1  # a nonzero mean exercises the centering
  y = layer(x)
  np.testing.assert_allclose(y, reference.layer_norm(x, layer.scale[...], layer.bias[...]),
                             **F32_TOL)
  flax_layer = nnx.LayerNorm(N, use_fast_variance=False, rngs=nnx.Rngs(0))
  flax_layer.scale[...], flax_layer.bias[...] = layer.scale[...], layer.bias[...]
  np.testing.assert_allclose(y, flax_layer(x), **F32_TOL)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_norms_without_parameters_compute_integer_inputs_in_float32_as_flax(cls):
  """With dtype=None the compute dtype is Flax's rule: the promoted dtype of the input and the
  parameters, float32 where that is an integer. A norm without parameters (use_scale=False,
  LayerNorm also use_bias=False) promoted an int32 input to int32 alone and raised "x must be
  bfloat16, ..., got int32", where the same layer with a scale (and Flax's own norms) compute
  in float32."""
  off = dict(use_bias=False) if cls is LayerNorm else {}
  layer = cls(N, use_scale=False, rngs=nnx.Rngs(0), **off)
  x = jax.random.randint(_key(40), (4, N), -50, 50, jnp.int32)
  y = layer(x)
  assert y.dtype == jnp.float32
  xf = x.astype(jnp.float32)
  want = reference.rms_norm(xf) if cls is RMSNorm else reference.layer_norm(xf)
  np.testing.assert_allclose(y, want, **F32_TOL)
  flax_layer = (nnx.RMSNorm if cls is RMSNorm else nnx.LayerNorm)(N, use_scale=False,
                                                                  rngs=nnx.Rngs(0), **off)
  np.testing.assert_allclose(y, flax_layer(x), **F32_TOL)


@pytest.mark.parametrize("name", ["GDPA", "PFFNBlock"])
def test_attention_layers_without_parameters_compute_integer_inputs_in_float32(name):
  """GDPA (no parameters) and a PFFNBlock without affines, dtype=None: integer q, k, v compute
  in float32 (Flax's rule, as the layers with parameters do); they raised "q must be bfloat16,
  ..., got int32"."""
  q, k, v = (jax.random.randint(_key(41 + i), a.shape, -3, 4, jnp.int32)
             for i, a in enumerate(_attention_inputs()))
  off = _offsets()
  kw = dict(pre_scale=0.1, post_scale=0.5)
  if name == "GDPA":
    layer = GDPA(H, D, **kw)
    want = reference.gdpa(*(a.astype(jnp.float32) for a in (q, k, v)), off, **kw)
  else:
    layer = PFFNBlock(H, D, use_scale=False, use_bias=False, rngs=nnx.Rngs(0), **kw)
    want = reference.flash_norm_attention(*(a.astype(jnp.float32) for a in (q, k, v)), off,
                                          **kw)
  y = layer(q, off, k, v, max_seq_len=MAX_LEN)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, want, **F32_TOL)


@pytest.mark.parametrize("make", [_rms, _ln, _norm_dense, _dense_norm])
def test_layers_pass_their_epsilon_to_the_op(make):
  """A non-default epsilon (0.5, the size of the rows' variance, so it moves every output)
  reaches the op: the value tests above use the op's default, under which a layer dropping its
  epsilon passed (a mutation test, LayerNorm and DenseNorm)."""
  eps = 0.5
  layer = make(epsilon=eps)
  p = _params(layer)
  if make in (_rms, _ln):
    x = _x(8, (4, N))
    want = (reference.rms_norm(x, p["scale"], eps=eps) if make is _rms
            else reference.layer_norm(x, p["scale"], p["bias"], eps=eps))
  elif make is _norm_dense:
    x = _x(8, (4, K))
    want = reference.norm_matmul(x, p["kernel"], p["norm_scale"], p["norm_bias"], norm="layer",
                                 eps=eps) + p["bias"]
  else:
    x = 0.2 * _x(8, (4, K))
    want = reference.matmul_norm(x, p["kernel"], p["bias"], None, p["norm_scale"],
                                 p["norm_bias"], norm="layer", eps=eps)
  np.testing.assert_allclose(layer(x), want, **F32_TOL)


@pytest.mark.parametrize("make", [_rms, _ln])
def test_norm_residual_returns_y_and_the_sum_on_request(make):
  """As every Flax layer (and DenseNorm), a call returns one array, also with a residual;
  return_h=True adds the new residual stream x + residual."""
  layer = make()
  x, r = _x(3, (4, N)), _x(4, (4, N))
  y = layer(x, residual=r)
  assert not isinstance(y, tuple)
  np.testing.assert_allclose(y, layer(x + r), **F32_TOL)
  y2, s = layer(x, residual=r, return_h=True)
  np.testing.assert_allclose(s, x + r, **F32_TOL)
  np.testing.assert_array_equal(y2, y)
  np.testing.assert_array_equal(layer(x, return_h=True)[1], x)


def test_dense_layers_default_to_the_same_norm():
  """NormDense and DenseNorm both default to LayerNorm (they used to differ: rms / layer)."""
  rngs = nnx.Rngs(0)
  assert NormDense(K, N, rngs=rngs).norm == DenseNorm(K, N, rngs=rngs).norm == "layer"


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_dense_matches_reference_and_flax(norm):
  layer = _norm_dense(norm)
  x = _x(5, (2, 3, K)) + 0.5
  y = layer(x)
  p = _params(layer)
  want = reference.norm_matmul(x, p["kernel"], p["norm_scale"], p.get("norm_bias"), norm=norm)
  np.testing.assert_allclose(y, want + p["bias"], **F32_TOL)
  # Independent oracle: the Flax norm followed by the Flax dense layer.
  if norm == "rms":
    flax_norm = nnx.RMSNorm(K, rngs=nnx.Rngs(0))
  else:
    flax_norm = nnx.LayerNorm(K, use_fast_variance=False, rngs=nnx.Rngs(0))
    flax_norm.bias[...] = p["norm_bias"]
  flax_norm.scale[...] = p["norm_scale"]
  dense = nnx.Linear(K, N, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))
  dense.kernel[...], dense.bias[...] = p["kernel"], p["bias"]
  np.testing.assert_allclose(y, dense(flax_norm(x)), **F32_TOL)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_dense_norm_matches_reference_and_flax(norm, with_residual):
  layer = _dense_norm(norm)
  x = _x(6, (2, 3, K))
  r = _x(7, (2, 3, N)) if with_residual else None
  y, h = layer(x, residual=r, return_h=True)
  p = _params(layer)
  want_y, want_h = reference.matmul_norm(x, p["kernel"], p["bias"], r, p["norm_scale"],
                                         p.get("norm_bias"), norm=norm, return_h=True)
  np.testing.assert_allclose(y, want_y, **F32_TOL)
  np.testing.assert_allclose(h, want_h, **F32_TOL)
  np.testing.assert_allclose(layer(x, residual=r), y, **F32_TOL)
  # Independent oracle: Flax dense (+ residual), then the Flax norm.
  dense = nnx.Linear(K, N, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))
  dense.kernel[...], dense.bias[...] = p["kernel"], p["bias"]
  flax_h = dense(x) + (0 if r is None else r)
  if norm == "rms":
    flax_norm = nnx.RMSNorm(N, rngs=nnx.Rngs(0))
  else:
    flax_norm = nnx.LayerNorm(N, use_fast_variance=False, rngs=nnx.Rngs(0))
    flax_norm.bias[...] = p["norm_bias"]
  flax_norm.scale[...] = p["norm_scale"]
  np.testing.assert_allclose(h, flax_h, **F32_TOL)
  np.testing.assert_allclose(y, flax_norm(flax_h), **F32_TOL)


@pytest.mark.parametrize("activation", ["fast_gelu", "relu2"])
def test_gdpa_matches_reference(activation):
  layer = GDPA(H, D, activation=activation, pre_scale=0.3, post_scale=0.7)
  q, k, v = _attention_inputs(10)
  off = _offsets()
  y = layer(q, off, k, v, max_seq_len=MAX_LEN)
  want = reference.gdpa(q, k, v, off, activation=activation, pre_scale=0.3, post_scale=0.7)
  np.testing.assert_allclose(y, want, **F32_TOL)
  assert not np.any(np.asarray(y[sum(LENS):]))  # padding rows are zeros


def test_attention_layers_keep_array_scales_static(monkeypatch):
  """A 0-d JAX or NumPy pre_scale/post_scale was stored as an array attribute: the module's
  state, traced under nnx.jit, which put the op on its array-scale path (the kernels' slower
  backward). The layers keep Python floats; under nnx.jit the op gets them, and the values
  equal the layer built with the floats and the reference."""
  seen = []
  real = pallas_norm.gdpa

  def spy(*args, pre_scale, post_scale, **kw):
    seen.append((type(pre_scale), type(post_scale)))
    return real(*args, pre_scale=pre_scale, post_scale=post_scale, **kw)
  monkeypatch.setattr(pallas_norm, "gdpa", spy)
  q, k, v = _attention_inputs(11)
  off = _offsets()
  layer = GDPA(H, D, pre_scale=jnp.float32(0.3), post_scale=np.float64(0.7))
  assert type(layer.pre_scale) is float and type(layer.post_scale) is float
  run = nnx.jit(lambda m, q, k, v: m(q, off, k, v, max_seq_len=MAX_LEN))
  y = run(layer, q, k, v)
  assert seen == [(float, float)]
  pre = float(jnp.float32(0.3))
  np.testing.assert_array_equal(y, run(GDPA(H, D, pre_scale=pre, post_scale=0.7), q, k, v))
  want = reference.gdpa(q, k, v, off, pre_scale=pre, post_scale=0.7)
  np.testing.assert_allclose(y, want, **F32_TOL)
  block = PFFNBlock(H, D, pre_scale=jnp.asarray(D ** -0.5), post_scale=np.asarray(0.5),
                    rngs=nnx.Rngs(0))
  assert type(block.pre_scale) is float and type(block.post_scale) is float


def test_pffn_matches_reference_and_composition():
  layer = _pffn()
  q, k, v = _attention_inputs(20)
  off = _offsets()
  y = layer(q, off, k, v, max_seq_len=MAX_LEN)
  p = _params(layer)
  want = reference.flash_norm_attention(q, k, v, off, ln_scale=p["ln_scale"],
                                        ln_bias=p["ln_bias"], rms_scale=p["rms_scale"],
                                        pre_scale=D ** -0.5, post_scale=0.5)
  np.testing.assert_allclose(y, want, **F32_TOL)
  # Independent composition: Flax LayerNorm over H·D -> GDPA (+u) -> Flax RMSNorm (+q).
  ln = nnx.LayerNorm(H * D, use_fast_variance=False, rngs=nnx.Rngs(0))
  ln.scale[...], ln.bias[...] = p["ln_scale"], p["ln_bias"]
  rms = nnx.RMSNorm(H * D, rngs=nnx.Rngs(0))
  rms.scale[...] = p["rms_scale"]
  u = ln(q.reshape(CAPACITY, H * D))
  attn = GDPA(H, D, pre_scale=D ** -0.5, post_scale=0.5)(u.reshape(q.shape), off, k, v)
  z = u + attn.reshape(CAPACITY, H * D)
  composed = (rms(z) + q.reshape(CAPACITY, H * D)).reshape(q.shape)
  valid = np.arange(CAPACITY) < sum(LENS)
  np.testing.assert_allclose(y[valid], composed[valid], **F32_TOL)
  assert not np.any(np.asarray(y[~valid]))


@pytest.mark.parametrize("pre_layer_norm,inner_residual,outer_residual", [
    (False, True, True), (True, False, True), (True, True, False), (False, False, False)])
def test_pffn_switches_match_reference(pre_layer_norm, inner_residual, outer_residual):
  """The block's switches reach the op: values against the reference with the same switches;
  without the LayerNorm the block has no ln_scale/ln_bias."""
  switches = dict(pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
                  outer_residual=outer_residual)
  layer = _pffn(**switches)
  p = _params(layer)
  assert set(p) == ({"ln_scale", "ln_bias", "rms_scale"} if pre_layer_norm else {"rms_scale"})
  q, k, v = _attention_inputs(21)
  off = _offsets()
  y = layer(q, off, k, v, max_seq_len=MAX_LEN)
  want = reference.flash_norm_attention(q, k, v, off, ln_scale=p.get("ln_scale"),
                                        ln_bias=p.get("ln_bias"), rms_scale=p["rms_scale"],
                                        pre_scale=D ** -0.5, post_scale=0.5, **switches)
  np.testing.assert_allclose(y, want, **F32_TOL)


@pytest.mark.parametrize("make", [_rms, _ln, _norm_dense, _dense_norm],
                         ids=["rms", "ln", "norm_dense", "dense_norm"])
@pytest.mark.parametrize("arg", ["x", "residual"])
def test_complex_input_raises_with_an_explicit_dtype(make, arg):
  """Review finding: with ``dtype`` set, the cast to it dropped a complex input's imaginary part
  silently (dtype=None already raised in the op). TypeError naming the layer's argument."""
  layer = make(dtype=jnp.float32)
  width = K if isinstance(layer, (NormDense, DenseNorm)) else N
  x = _x(0, (4, width)) + 1j
  if arg == "x":
    call = lambda: layer(x)  # noqa: E731
  elif isinstance(layer, NormDense):
    pytest.skip("NormDense takes no residual")
  else:
    call = lambda: layer(_x(0, (4, width)), residual=_x(1, (4, N)) + 1j)  # noqa: E731
  with pytest.raises(TypeError, match=f"{type(layer).__name__}: {arg} must be a real array, "
                                      "got complex64"):
    call()


@pytest.mark.parametrize("bad", [(1,), (4, N)])
def test_norm_dense_checks_a_swapped_in_bias_shape(bad):
  """Review finding: a NormDense bias replaced after building (e.g. a bad restore) broadcast
  into y; DenseNorm's op already named it. ValueError naming bias."""
  layer = _norm_dense()
  layer.bias = nnx.Param(jnp.ones(bad, jnp.float32))
  with pytest.raises(ValueError, match=rf"^NormDense: bias must have shape \({N},\)"):
    layer(_x(0, (4, K)))


@pytest.mark.parametrize("param,bad", [("kernel", (K, N, 1)), ("kernel", (N, K)),
                                       ("bias", (N + 1,))])
@pytest.mark.parametrize("name", ["NormDense", "DenseNorm"])
def test_dense_layers_check_a_swapped_in_kernel_or_bias_shape(name, param, bad):
  """Review finding: a kernel of another shape put in after building failed by its op's name
  ``w`` (a (K, N, 1) kernel even as "bias must have shape (1,)" in NormDense, whose bias check
  took N from the kernel). ValueError naming the layer and its parameter."""
  layer = _norm_dense() if name == "NormDense" else _dense_norm()
  setattr(layer, param, nnx.Param(jnp.ones(bad, jnp.float32)))
  want = (K, N) if param == "kernel" else (N,)
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{name}: {param} must have shape {want}, got {bad}")):
    layer(_x(0, (4, K)))


@pytest.mark.parametrize("name,param,op_name", [
    ("NormDense", "norm_scale", "scale"), ("DenseNorm", "norm_scale", "scale")])
def test_dense_layer_op_errors_name_the_layers_parameter(name, param, op_name):
  """Review finding: the op's checks name its own arguments (``scale``, ``dense_bias``,
  ``w``), which the layer holds as ``norm_scale``, ``bias``, ``kernel``; the layer's error
  adds its own name for the argument."""
  layer = _norm_dense() if name == "NormDense" else _dense_norm()
  setattr(layer, param, nnx.Param(jnp.ones(3, jnp.float32)))
  with pytest.raises(ValueError, match=re.escape(
      f": {op_name} must have shape") + r".*" + re.escape(
          f"(the op's {op_name}: this layer's {param})") + "$"):
    layer(_x(0, (4, K)))


def test_attention_layers_reject_complex_inputs_with_an_explicit_dtype():
  q, k, v = _attention_inputs()
  with pytest.raises(TypeError, match="GDPA: q must be a real array"):
    GDPA(H, D, dtype=jnp.float32)(q + 1j, _offsets(), k, v, max_seq_len=MAX_LEN)
  with pytest.raises(TypeError, match="PFFNBlock: v must be a real array"):
    _pffn(dtype=jnp.float32)(q, _offsets(), k, v + 1j, max_seq_len=MAX_LEN)


def test_attention_layers_check_head_shape():
  q, k, v = _attention_inputs()
  with pytest.raises(ValueError, match=r"GDPA: q must have shape \(T, num_heads, head_dim\)"):
    GDPA(H + 1, D)(q, _offsets(), k, v)
  # PFFNBlock's query argument is q_tokens, not the op's q.
  with pytest.raises(ValueError, match="PFFNBlock: q_tokens must have shape"):
    _pffn()(q.reshape(CAPACITY, H * D, 1), _offsets(), k, v)
  with pytest.raises(TypeError, match="PFFNBlock: q_tokens must be an array"):
    _pffn()(np.asarray(q).tolist(), _offsets(), k, v)
  with pytest.raises(TypeError, match="PFFNBlock: v must be an array"):
    _pffn()(q, _offsets(), k, np.asarray(v).tolist())
  with pytest.raises(TypeError, match="GDPA: k must be an array"):
    GDPA(H, D)(q, _offsets(), np.asarray(k).tolist(), v)


@pytest.mark.parametrize("make", [lambda: GDPA(H, D), _pffn], ids=["gdpa", "pffn"])
def test_attention_layers_name_q_offsets_when_called_in_the_ops_order(make):
  """Review: GDPA(H, D)(q, k, v, offsets), the op's order, failed with "v must have 4
  dimensions, got shape (3,)". The layers check q_offsets first, naming it and their order."""
  q, k, v = _attention_inputs()
  layer, name = make(), ("GDPA" if make is not _pffn else "PFFNBlock")
  with pytest.raises(TypeError, match=rf"{name}: q_offsets \(the second argument\) must be a "
                                      r"1-D integer array.*\(q, q_offsets, k, v\)"):
    layer(q, k, v, _offsets())
  with pytest.raises(ValueError, match=rf"{name}: q_offsets .*got shape \(1, {len(LENS) + 1}\)"):
    layer(q, _offsets()[None], k, v)
  with pytest.raises(TypeError, match=rf"{name}: q_offsets must be an array"):
    layer(q, np.asarray(_offsets()).tolist(), k, v)
  assert layer(q, _offsets(), k, v).shape == q.shape  # the layer's order still runs


@pytest.mark.parametrize("make", [lambda: GDPA(H, D), _pffn], ids=["gdpa", "pffn"])
def test_op_argument_errors_name_the_layer(make):
  """An op's ValueError for a bad argument, raised inside a layer, starts with the layer's name
  (review: "q_offsets must be non-decreasing" alone did not say which layer of a model), also
  under jit; the op's own wording follows."""
  q, k, v = _attention_inputs()
  layer, name = make(), ("GDPA" if make is not _pffn else "PFFNBlock")
  bad = np.asarray(_offsets()).copy()
  bad[2], bad[3] = bad[3], bad[2]  # [0, 3, 8, 3, 10]: decreasing at index 3
  with pytest.raises(ValueError, match=rf"^{name}: q_offsets must be non-decreasing"):
    layer(q, jnp.asarray(bad), k, v, max_seq_len=MAX_LEN)
  with pytest.raises(ValueError, match=rf"^{name}: .*max_seq_len"):
    nnx.jit(lambda m, q, o, k, v: m(q, o, k, v, max_seq_len=0))(layer, q, _offsets(), k, v)


@pytest.mark.parametrize("make", [lambda: GDPA(H, D), _pffn], ids=["gdpa", "pffn"])
def test_attention_layer_arguments_after_v_are_keyword_only(make):
  """GDPA took (kv_offsets, max_seq_len) and PFFNBlock (max_seq_len, kv_offsets) after v, so
  layer(q, off, k, v, 5) meant different things (review finding); now it is Python's TypeError
  in both, and the keyword forms agree with the ops."""
  q, k, v = _attention_inputs()
  layer = make()
  with pytest.raises(TypeError, match="positional argument"):
    layer(q, _offsets(), k, v, MAX_LEN)
  with pytest.raises(TypeError, match="positional argument"):
    layer(q, _offsets(), k, v, None, MAX_LEN)
  # Packed k/v through kv_offsets, by keyword.
  kv_lens = (2, 1, 4, 3)
  kv_off = jnp.asarray(jagged.offsets_from_lengths(kv_lens))
  kp, vp = (a.reshape(-1, H, D)[:sum(kv_lens)] for a in (k, v))
  y = layer(q, _offsets(), kp, vp, kv_offsets=kv_off, max_seq_len=MAX_LEN, max_kv_len=4)
  if isinstance(layer, GDPA):
    expected = pallas_norm.gdpa(q, kp, vp, _offsets(), kv_off, max_seq_len=MAX_LEN)
  else:
    p = _params(layer)
    expected = pallas_norm.flash_norm_attention(
        q, kp, vp, _offsets(), kv_off, ln_scale=p["ln_scale"], ln_bias=p["ln_bias"],
        rms_scale=p["rms_scale"], pre_scale=D ** -0.5, post_scale=0.5, max_seq_len=MAX_LEN)
  np.testing.assert_allclose(y, expected, **F32_TOL)


@pytest.mark.parametrize("make", [_rms, _ln, _norm_dense, _dense_norm],
                         ids=["rms", "ln", "norm_dense", "dense_norm"])
def test_shape_dtype_struct_input_raises_type_error(make):
  """Only .shape and .dtype is not an array (it used to fail inside, on .astype)."""
  layer = make()
  width = K if isinstance(layer, (NormDense, DenseNorm)) else N
  with pytest.raises(TypeError, match=f"{type(layer).__name__}: x must be an array, got "
                                      "ShapeDtypeStruct"):
    layer(jax.ShapeDtypeStruct((3, width), jnp.float32))
  # Tracers are arrays: eval_shape still works.
  out = jax.eval_shape(lambda x: make()(x), jax.ShapeDtypeStruct((3, width), jnp.float32))
  assert out.shape == (3, N)


@pytest.mark.parametrize("make", [_rms, _ln, _dense_norm], ids=["rms", "ln", "dense_norm"])
def test_non_array_residual_raises_type_error(make):
  """RMSNorm and LayerNorm failed on a list residual with AttributeError ('list' object has no
  attribute 'dtype') in their compute-dtype rule."""
  layer = make()
  x = _x(0, (4, K if isinstance(layer, DenseNorm) else N))
  with pytest.raises(TypeError, match=f"{type(layer).__name__}: residual must be an array"):
    layer(x, residual=[[0.0] * N] * 4)


# ---------------------------------------------------------------------------------------------
# jit, bf16 compute


def _calls():
  """(name, layer factory, call(layer, **kw)) for every layer, with fresh random inputs."""
  x_n, x_k, r_n = _x(30, (5, N)), _x(31, (5, K)), _x(32, (5, N))
  q, k, v = _attention_inputs(33)
  off = _offsets()
  return [
      ("rms", _rms, lambda m: m(x_n, residual=r_n)),
      ("ln", _ln, lambda m: m(x_n)),
      ("norm_dense", _norm_dense, lambda m: m(x_k)),
      ("dense_norm", _dense_norm, lambda m: m(x_k, residual=r_n, return_h=True)),
      ("gdpa", lambda **kw: GDPA(H, D, **kw), lambda m: m(q, off, k, v, max_seq_len=MAX_LEN)),
      ("pffn", _pffn, lambda m: m(q, off, k, v, max_seq_len=MAX_LEN)),
  ]


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_jit_equals_eager(case):
  _, make, call = _calls()[case]
  layer = make()
  eager = call(layer)
  jitted = nnx.jit(call)(layer)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_bf16_compute_close_to_f32(case):
  _, make, call = _calls()[case]
  f32 = call(make())
  bf16 = call(make(dtype=jnp.bfloat16))  # same seeds -> same f32 parameters
  for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(b, np.float32), a, rtol=BF16_ATOL, atol=BF16_ATOL)


# ---------------------------------------------------------------------------------------------
# The implementation switch


_OPS = {"rms": "rms_norm", "ln": "layer_norm", "norm_dense": "norm_matmul",
        "dense_norm": "matmul_norm", "gdpa": "gdpa", "pffn": "flash_norm_attention"}


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_implementation_is_passed_to_the_op(case, monkeypatch):
  name, make, call = _calls()[case]
  seen = []
  op = getattr(pallas_norm, _OPS[name])

  def spy(*args, **kwargs):
    seen.append(kwargs.get("implementation"))
    return op(*args, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(pallas_norm, _OPS[name], spy)
  call(make(implementation="interpret"))
  assert seen == ["interpret"]


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_xla_implementation_equals_default(case):
  _, make, call = _calls()[case]
  for a, b in zip(jax.tree.leaves(call(make())), jax.tree.leaves(call(make(implementation="xla")))):
    np.testing.assert_allclose(a, b, **F32_TOL)


def _op_has_no_kernel(name: str) -> bool:
  """True while the op itself, called directly on the layer's input shapes and dtypes, answers
  implementation="mosaic" with NotImplementedError (no kernel yet, or none for this call)."""
  x_n, x_k, w = _x(50, (5, N)), _x(51, (5, K)), _x(52, (K, N))
  q, k, v = _attention_inputs(53)
  direct = {
      "rms": lambda **kw: pallas_norm.rms_norm(x_n, **kw),
      "ln": lambda **kw: pallas_norm.layer_norm(x_n, **kw),
      "norm_dense": lambda **kw: pallas_norm.norm_matmul(x_k, w, **kw),
      "dense_norm": lambda **kw: pallas_norm.matmul_norm(x_k, w, **kw),
      "gdpa": lambda **kw: pallas_norm.gdpa(q, k, v, _offsets(), max_seq_len=MAX_LEN, **kw),
      "pffn": lambda **kw: pallas_norm.flash_norm_attention(q, k, v, _offsets(),
                                                            max_seq_len=MAX_LEN, **kw),
  }
  try:
    direct[name](implementation="mosaic")
  except NotImplementedError:
    return True
  return False


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_mosaic_without_kernel_raises(case):
  # This test must change when the Mosaic kernels land: a layer then runs the kernel (on a Hopper
  # GPU) instead of raising. Until then the op's NotImplementedError reaches the caller.
  name, make, call = _calls()[case]
  if not _op_has_no_kernel(name):
    pytest.skip(f"pallas_norm.{_OPS[name]} has a Mosaic kernel for this call")
  with pytest.raises(NotImplementedError):
    call(make(implementation="mosaic"))


def test_unknown_implementation_raises():
  with pytest.raises(ValueError, match="implementation"):
    _norm_dense(implementation="cuda")(_x(0, (2, K)))


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_unknown_implementation_raises_when_the_layer_is_built(case):
  _, make, _ = _calls()[case]
  with pytest.raises(ValueError, match="implementation"):
    make(implementation="MOSAIC")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "not-a-dtype", object()],
                         ids=["int32", "bool", "str", "object"])
@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _calls()])
def test_bad_dtype_raises_naming_dtype_when_the_layer_is_built(case, dtype):
  # It used to build, and the call then failed naming the op's x (or q) or not naming anything.
  _, make, _ = _calls()[case]
  with pytest.raises(TypeError, match=r"(RMSNorm|LayerNorm|NormDense|DenseNorm|GDPA|PFFNBlock): "
                                      "dtype must be a floating dtype"):
    make(dtype=dtype)


@pytest.mark.parametrize("param_dtype", [jnp.int32, jnp.bool_, "bogus", None, object()],
                         ids=["int32", "bool", "str", "None", "object"])
@pytest.mark.parametrize("case", [0, 1, 2, 3, 5], ids=["rms", "ln", "norm_dense", "dense_norm",
                                                     "pffn"])
def test_bad_param_dtype_raises_naming_it_when_the_layer_is_built(case, param_dtype):
  """An int32 param_dtype silently made int32 parameters, "bogus" failed inside JAX (review
  finding)."""
  _, make, _ = _calls()[case]
  with pytest.raises(TypeError, match=r"(RMSNorm|LayerNorm|NormDense|DenseNorm|PFFNBlock): "
                                      "param_dtype must be a floating dtype"):
    make(param_dtype=param_dtype)


@pytest.mark.parametrize("case", [0, 1, 2, 3, 5], ids=["rms", "ln", "norm_dense", "dense_norm",
                                                     "pffn"])
def test_floating_param_dtype_makes_parameters_of_it(case):
  _, make, _ = _calls()[case]
  params = _params(make(param_dtype=jnp.bfloat16))
  assert params and all(p.dtype == jnp.bfloat16 for p in params.values())


# ---------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("case", [0, 1, 2, 3, 5], ids=["rms", "ln", "norm_dense", "dense_norm",
                                                      "pffn"])
def test_gradients_reach_every_param(case):
  _, make, call = _calls()[case]
  layer = make()
  weights = [_x(40 + i, a.shape) for i, a in enumerate(jax.tree.leaves(call(layer)))]

  def loss(m):
    return sum(jnp.sum(o * w) for o, w in zip(jax.tree.leaves(call(m)), weights))

  grads = nnx.to_pure_dict(nnx.grad(loss)(layer))
  assert set(grads) == set(_params(layer))
  for name, g in grads.items():
    g = np.asarray(g)
    assert np.all(np.isfinite(g)), name
    assert np.any(g != 0), name


def test_kernel_error_names_a_promoting_residual():
  """DenseNorm with bf16 parameters and a float32 residual: the residual promoted the input."""
  x = jnp.ones((8, 64), jnp.bfloat16)
  layer = DenseNorm(64, 64, param_dtype=jnp.bfloat16, implementation="interpret",
                    rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match=r"with dtype=None the bfloat16 parameters and "
                                                r"the float32 residual promoted the bfloat16 "
                                                r"input to float32"):
    layer(x, residual=jnp.ones((8, 64), jnp.float32))


def test_attention_kernel_errors_name_the_dtype_promotion():
  """PFFNBlock's float32 parameters and GDPA's float32 k/v promote a bfloat16 q with
  dtype=None: the kernel's refusal says so, as the dense layers' does (review finding: it said
  "q dtype float32" although the caller passed bfloat16)."""
  rng = np.random.default_rng(6)
  q = jnp.asarray(rng.standard_normal((128, 1, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, 64, 1, 64)) / 8, jnp.bfloat16)
  offs = jnp.array([0, 60, 120], jnp.int32)
  with pytest.raises(NotImplementedError, match=r"PFFNBlock: with dtype=None the float32 "
                                                r"parameters promoted the bfloat16"):
    PFFNBlock(1, 64, rngs=nnx.Rngs(0), implementation="interpret")(q, offs, k, k, max_seq_len=64)
  k32 = k.astype(jnp.float32)
  with pytest.raises(NotImplementedError, match=r"GDPA: with dtype=None the float32 k and the "
                                                r"float32 v promoted the bfloat16"):
    GDPA(1, 64, implementation="interpret")(q, offs, k32, k32, max_seq_len=64)


@pytest.mark.parametrize("layer", ["NormDense", "DenseNorm"])
def test_kernel_error_names_the_dtype_promotion(layer):
  """A bf16 input with float32 parameters and dtype=None computes in float32, which the kernels
  do not take: the error says so and how to fix it (review finding); with dtype=bf16 the same
  input gets past the dtype check."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 64)), jnp.bfloat16)
  make = {"NormDense": NormDense, "DenseNorm": DenseNorm}[layer]
  with pytest.raises(NotImplementedError, match=r"promoted the bfloat16 input to float32.*"
                                                r"dtype=jnp\.bfloat16"):
    make(64, 64, implementation="mosaic", rngs=nnx.Rngs(0))(x)
  # float16 parameters: the hint names them, not the float32 they promote to (review finding).
  with pytest.raises(NotImplementedError, match=r"the float16 parameters promoted the bfloat16 "
                                                r"input to float32"):
    make(64, 64, implementation="interpret", param_dtype=jnp.float16, rngs=nnx.Rngs(0))(x)
  if not pallas_norm._dispatch.on_hopper_gpu():
    with pytest.raises(NotImplementedError) as info:  # mosaic needs a GPU here, no dtype hint
      make(64, 64, implementation="mosaic", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x)
    assert "promoted" not in str(info.value) and "Hopper" in str(info.value)


@pytest.mark.parametrize("layer", ["NormDense", "GDPA"])
def test_kernel_error_for_an_integer_input_suggests_a_floating_dtype(layer):
  """An integer input with dtype=None computes in float32, which the kernels refuse: the hint
  said "pass dtype=jnp.int32 to compute in the input's dtype", a dtype every layer refuses
  when it is built. It now names a 16-bit float the kernels take, which then gets past the
  kernel's dtype check (the error, if any, is no longer about the dtype)."""
  rng = np.random.default_rng(6)
  if layer == "NormDense":
    args = (jnp.asarray(rng.integers(-5, 5, (8, 64)), jnp.int32),)
    make = lambda **kw: NormDense(64, 64, rngs=nnx.Rngs(0), **kw)  # noqa: E731
  else:
    q = jnp.asarray(rng.integers(-2, 3, (8, 1, 64)), jnp.int32)
    k = jnp.asarray(rng.integers(-2, 3, (1, 64, 1, 64)), jnp.int32)
    args = (q, jnp.array([0, 8], jnp.int32), k, k)
    make = lambda **kw: GDPA(1, 64, **kw)  # noqa: E731
  with pytest.raises(NotImplementedError) as info:
    make(implementation="interpret")(*args)
  message = str(info.value)
  assert "dtype=jnp.int32" not in message
  assert re.search(rf"{layer}.*int32 input.*float32.*dtype=jnp\.bfloat16", message), message
  if layer == "NormDense":
    y = make(implementation="interpret", dtype=jnp.bfloat16)(*args)
    layer_ = make(dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(layer_(*args), np.float32), atol=BF16_ATOL)


@pytest.mark.parametrize("cls,k,n,fragment", [(NormDense, 128, 1, "N = 1"),
                                               (DenseNorm, 100, 64, "K = 100")])
def test_kernel_refusal_names_the_layer(cls, k, n, fragment):
  """A kernel asked for on shapes it does not take names the layer and its features before the
  op's K / N (a review: inside a model only the op's "N = 1" was said)."""
  x = jnp.ones((64, k), jnp.bfloat16)
  with pytest.raises(NotImplementedError,
                     match=rf"^{cls.__name__}\(in_features={k}, out_features={n}\): "
                           rf"(norm_matmul|matmul_norm): .*{fragment}"):
    cls(k, n, dtype=jnp.bfloat16, implementation="interpret", rngs=nnx.Rngs(0))(x)


def _interpret_call(name):
  """A call of layer ``name`` (bf16, implementation="interpret") that the kernel takes."""
  bf16 = dict(dtype=jnp.bfloat16, implementation="interpret")
  if name in ("NormDense", "DenseNorm"):
    layer = (NormDense if name == "NormDense" else DenseNorm)(64, 64, rngs=nnx.Rngs(0), **bf16)
    return lambda: layer(jnp.ones((8, 64), jnp.bfloat16))
  q = jnp.ones((128, 1, 64), jnp.bfloat16)
  k = jnp.ones((2, 64, 1, 64), jnp.bfloat16) / 8
  offs = jnp.array([0, 60, 120], jnp.int32)
  layer = GDPA(1, 64, **bf16) if name == "GDPA" else PFFNBlock(1, 64, rngs=nnx.Rngs(0), **bf16)
  return lambda: layer(q, offs, k, k, max_seq_len=64)


@pytest.mark.parametrize("name", ["NormDense", "DenseNorm", "GDPA", "PFFNBlock"])
def test_interpret_thread_error_names_the_layer(monkeypatch, name):
  """implementation="interpret" on a CPU client with too few threads: the op's RuntimeError
  said "flash_norm_attention: ... PJRT_NPROC" but not which layer of a model called it (a
  review); now the layer is in front, the type and the op's wording unchanged."""
  if jax.default_backend() != "cpu":
    pytest.skip("the thread check applies to the CPU backend")
  call = _interpret_call(name)
  monkeypatch.setenv("PJRT_NPROC", "2")  # read at each call; the client itself keeps its 8
  where = name + ("(in_features=64, out_features=64)" if "Dense" in name else "")
  op = {"NormDense": "norm_matmul", "DenseNorm": "matmul_norm", "GDPA": "gdpa",
        "PFFNBlock": "flash_norm_attention"}[name]
  with pytest.raises(RuntimeError, match=rf"^{re.escape(where)}: {op}: implementation="
                                         r"'interpret' cannot run here: .*PJRT_NPROC") as info:
    call()
  assert type(info.value) is RuntimeError
  assert type(info.value.__cause__) is RuntimeError  # the op's own error, chained
  assert not str(info.value.__cause__).startswith(name)


@pytest.mark.parametrize("name", ["NormDense", "DenseNorm"])
def test_forward_mode_of_a_kernel_path_says_to_pass_xla(name):
  """jax.jvp of a layer on a kernel path raised JAX's bare "can't apply forward-mode autodiff
  (jvp) to a custom_vjp function"; now the layer names itself and the fix."""
  layer = (NormDense if name == "NormDense" else DenseNorm)(
      64, 64, rngs=nnx.Rngs(0), implementation="interpret", dtype=jnp.bfloat16)
  x = _x(0, (16, 64), jnp.bfloat16)
  with pytest.raises(TypeError) as info:
    jax.jvp(layer, (x,), (x,))
  assert type(info.value) is TypeError
  assert re.fullmatch(rf"{name}\(in_features=64, out_features=64\): can't apply forward-mode "
                      r"autodiff \(jvp\) to a custom_vjp function\. \(the kernel path: .*"
                      r"for jax\.jvp, .* pass implementation='xla'\)", str(info.value)), info.value


def test_op_shape_errors_name_the_layer():
  """Shape errors of the ops themselves (not the layers' own checks) inside two layers."""
  q, k, v = _attention_inputs()
  with pytest.raises(ValueError, match=r"^PFFNBlock: k and v must have the same shape"):
    _pffn()(q, _offsets(), k, v[:, :-1], max_seq_len=MAX_LEN)
  with pytest.raises(ValueError, match=r"^DenseNorm\(in_features=32, out_features=64\): "
                                       r"residual must have shape \(4, 64\), got \(4, 32\)"):
    DenseNorm(32, 64, rngs=nnx.Rngs(0))(_x(0, (4, 32)), residual=_x(1, (4, 32)))


def _raise(error):
  raise error


@pytest.mark.parametrize("run", [lambda: jax.jit(lambda x: bool(x))(jnp.ones(())),
                                 lambda: _raise(jax.errors.JaxRuntimeError("xla failed")),
                                 lambda: _raise(RecursionError("deep"))],
                         ids=["tracer_bool", "jax_runtime", "recursion"])
def test_op_errors_keep_jax_and_other_subclasses_unchanged(run):
  """Only exactly ValueError, TypeError and RuntimeError get the layer's name: a subclass (JAX's
  own errors, which its docs describe by type and message) comes back as it was raised."""
  with pytest.raises(Exception) as bare:
    run()
  assert type(bare.value) not in _common.CALL_ERRORS
  assert isinstance(bare.value, _common.CALL_ERRORS)
  # A model's _common.part, around its sub-layer's call, keeps them unchanged too.
  for context in (lambda: _common.op_errors("Layer", None, jnp.float32, jnp.float32, []),
                  lambda: _common.part(_Model(), "blocks", 0)):
    with pytest.raises(type(bare.value)) as info:
      with context():
        run()
    assert type(info.value) is type(bare.value) and str(info.value) == str(bare.value)


class _Model:
  """A stand-in for a model holding its sub-layers in a list attribute (KunlunModel.pffn)."""
  blocks = ["first", "second"]


@pytest.mark.parametrize("error", [ValueError, TypeError, RuntimeError, NotImplementedError])
def test_model_part_names_the_sub_layers_path(error):
  """Every exact type a layer names itself in (op_errors'), the kernels' NotImplementedError
  included, gets the sub-layer's path in front; part yields that sub-layer."""
  with pytest.raises(error, match=r"^_Model\.blocks\[1\]: Layer: bad input$") as info:
    with _common.part(_Model(), "blocks", 1) as layer:
      assert layer == "second"
      raise error("Layer: bad input")
  assert type(info.value) is error and type(info.value.__cause__) is error


@pytest.mark.parametrize("cls", [NormDense, DenseNorm])
def test_dense_layers_default_init_and_one_dimensional_input(cls):
  """The kernel's default init is LeCun normal (std 1/√K), and a 1-D input raises the layer's
  ValueError naming in_features (mutation tests changed both unnoticed)."""
  std = float(np.std(np.asarray(cls(256, 512, rngs=nnx.Rngs(0)).kernel[...])))
  assert abs(std * np.sqrt(256) - 1) < 0.1
  with pytest.raises(ValueError, match="in_features=8"):
    cls(8, 16, rngs=nnx.Rngs(0), implementation="xla")(jnp.ones((4,), jnp.float32))


@pytest.mark.parametrize("make", [
    lambda: RMSNorm(32, rngs=nnx.Rngs(0)),
    lambda: RMSNorm(32, use_scale=False, rngs=nnx.Rngs(0)),
    lambda: LayerNorm(32, use_scale=False, use_bias=False, rngs=nnx.Rngs(0)),
    lambda: NormDense(32, 64, rngs=nnx.Rngs(0)),
    lambda: DenseNorm(32, 64, use_bias=False, use_scale=False, rngs=nnx.Rngs(0)),
])
def test_a_1d_input_of_another_width_is_refused_by_the_layer(make):
  """A 1-D input (one row) of 64 features for a layer of 32: the layer's own width check
  applies to it as to a batch (a mutation test skipped it for 1-D inputs unnoticed: a norm
  without parameters then normalized the 64 features silently). A 1-D input of the right
  width matches the reference."""
  layer = make()
  name = type(layer).__name__
  features = "in_features" if "Dense" in name else "num_features"
  with pytest.raises(ValueError, match=f"{name}: {features}=32 does not match the input's "
                                       "last dimension 64"):
    layer(_x(0, (64,)))
  if name == "RMSNorm":
    x = _x(1, (32,))
    scale = None if layer.scale is None else layer.scale[...]
    np.testing.assert_allclose(layer(x), reference.rms_norm(x, scale, eps=layer.epsilon),
                               rtol=1e-6, atol=1e-6)
