"""KunlunModel: output shape and dtype, empty sequences, per-sample independence, jit vs eager,
bf16 compute, the implementation switch reaching every sub-layer, and gradients."""

import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

# The checkout first: an editable install made before flax_layers/ had an __init__.py maps it as a
# namespace package, which `pytest` (unlike `python -m pytest`) would otherwise import.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flax_layers import KunlunConfig, KunlunModel  # noqa: E402
from pallas_norm import jagged  # noqa: E402

CONFIG = KunlunConfig(num_sparse_features=3, num_dense_features=2, sparse_vocab_size=64,
                      item_vocab_size=64, embed_dim=8, num_heads=2, head_dim=8, kv_len=4,
                      num_layers=2, max_seq_len=6, num_seeds=2, summary_dim=16, mlp_dim=16,
                      num_mlp_layers=1)
LENS = np.array([3, 0, 6, 1, 4])  # an empty and a full-length sequence
B = len(LENS)
T = B * CONFIG.max_seq_len


def _inputs(seed=0, lens=LENS):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, CONFIG.sparse_vocab_size, (B, CONFIG.num_sparse_features), np.int32),
          rng.normal(size=(B, CONFIG.num_dense_features)).astype(np.float32),
          rng.integers(1, CONFIG.item_vocab_size, T).astype(np.int32),
          jagged.offsets_from_lengths(lens))


def _model(**kw):
  return KunlunModel(CONFIG, rngs=nnx.Rngs(0), **kw)


@pytest.fixture(scope="module")
def model():
  return _model(implementation="xla")


@pytest.fixture(scope="module")
def forward():
  return nnx.jit(lambda m, *a: m(*a))


def test_output_shape_dtype_finite(model, forward):
  y = forward(model, *_inputs())
  assert y.shape == (B,) and y.dtype == jnp.float32
  assert np.all(np.isfinite(y))


def test_jit_equals_eager(model, forward):
  inputs = _inputs(1)
  np.testing.assert_allclose(model(*inputs), forward(model, *inputs), rtol=1e-5, atol=1e-5)


def test_all_empty_sequences_are_finite(model, forward):
  y = forward(model, *_inputs(2, lens=np.zeros(B, np.int64)))
  assert np.all(np.isfinite(y))


def test_samples_are_independent(model, forward):
  # Changing one sample's behaviour items changes its logit only; padding ids change nothing.
  sparse, dense, ids, off = _inputs(3)
  base = np.asarray(forward(model, sparse, dense, ids, off))
  rng = np.random.default_rng(4)
  for b in np.flatnonzero(LENS):
    changed = ids.copy()
    changed[off[b]:off[b + 1]] = rng.integers(1, CONFIG.item_vocab_size, LENS[b])
    delta = np.asarray(forward(model, sparse, dense, changed, off)) - base
    assert delta[b] != 0
    np.testing.assert_array_equal(np.delete(delta, b), 0)
  padded = ids.copy()
  padded[off[-1]:] = rng.integers(1, CONFIG.item_vocab_size, T - off[-1])
  np.testing.assert_array_equal(forward(model, sparse, dense, padded, off), base)


def test_bf16_compute_keeps_f32_params_and_stays_close(model, forward):
  bf16 = _model(dtype=jnp.bfloat16, implementation="xla")
  params = jax.tree.leaves(nnx.state(bf16, nnx.Param))
  assert all(p.dtype == jnp.float32 for p in params)
  inputs = _inputs(5)
  y16 = forward(bf16, *inputs)
  y32 = forward(model, *inputs)  # the module's f32 model: same parameters (nnx.Rngs(0))
  assert y16.dtype == jnp.float32 and np.all(np.isfinite(y16))
  # Logits of order 1e-1 after ~15 bf16 layers: agree to 0.1 absolute.
  np.testing.assert_allclose(y16, y32, atol=0.1)


def test_implementation_reaches_every_sublayer():
  m = _model(implementation=("interpret", "xla"))
  layers = [mod for _, mod in nnx.iter_graph(m)
            if isinstance(mod, nnx.Module) and hasattr(mod, "implementation")]
  # The model itself (its softmax attentions), summary, per layer (pffn, qkv, attn_out),
  # pool_kv, mlp_in, mlp blocks, head.
  assert len(layers) == 1 + 1 + 3 * CONFIG.num_layers + 1 + 1 + CONFIG.num_mlp_layers + 1
  assert {mod.implementation for mod in layers} == {("interpret", "xla")}


@pytest.mark.parametrize("implementation", ["mosaic", "interpret", ("interpret",),
                                            ["mosaic", "interpret"]])
def test_a_choice_without_xla_is_refused_at_construction(implementation):
  # The logit head is NormDense(mlp_dim, 1): N = 1 fits no kernel, so kernels alone could
  # never run the model; they used to fail at the first call with the op's "N = 1" message
  # (a one-item sequence did so too).
  choices = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  with pytest.raises(ValueError, match="logit head.*" + re.escape(repr((*choices, "xla")))):
    _model(implementation=implementation)


def _bce(m, sparse, dense, ids, off, labels):
  logits = m(sparse, dense, ids, off)
  return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)


_grad = nnx.jit(nnx.grad(_bce))  # one compiled program for both gradient tests


def _labels(seed):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 2, B), jnp.float32)


def test_gradients_finite_and_reach_every_param(model):
  grads = _grad(model, *_inputs(6), _labels(7))
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
    g = np.asarray(g)
    name = jax.tree_util.keystr(path)
    assert np.all(np.isfinite(g)), name
    assert np.any(g != 0), name


def test_gradients_finite_with_empty_sequences(model):
  grads = _grad(model, *_inputs(8, lens=np.array([0, 0, 2, 0, 0])), _labels(9))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_a_smaller_packed_capacity_gives_the_same_logits_and_gradients(model, forward):
  """Packing the same tokens into fewer rows (ads_data's token buckets: about half of
  B·max_seq_len for uniform lengths) is the same model: logits and every parameter gradient
  agree (f32; only summation orders differ)."""
  sparse, dense, ids, off = _inputs(6)
  small = int(off[-1]) + 2  # 2 padding rows instead of T - off[-1]
  np.testing.assert_allclose(forward(model, sparse, dense, ids[:small], off),
                             forward(model, sparse, dense, ids, off), rtol=1e-6, atol=1e-7)
  grads = _grad(model, sparse, dense, ids[:small], off, _labels(7))
  full = _grad(model, sparse, dense, ids, off, _labels(7))
  for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)),
                             jax.tree.leaves(nnx.to_pure_dict(full)), strict=True):
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7,
                               err_msg=jax.tree_util.keystr(path))


def test_attentions_reuse_the_batch_row_index(model, monkeypatch):
  """The model searches the offsets once per batch (jagged.row_index in __call__): the
  self-attention and the seed pooling, forward and backward, search them no more."""
  _, _, seq_ids, offsets = _inputs()
  offsets = jnp.asarray(offsets)
  x = jax.random.normal(jax.random.key(0), (T, CONFIG.num_heads, CONFIG.head_dim))
  rows = jagged.row_index(offsets, T)
  searches = []
  real = jagged._segment_ids  # every search of the offsets, public helpers' and conversions'
  monkeypatch.setattr(jagged, "_segment_ids", lambda *a: searches.append(a) or real(*a))
  jax.make_jaxpr(lambda o: jagged.to_padded(x, o, CONFIG.max_seq_len))(offsets)
  assert searches, "the patch must see a conversion's own search (else the test cannot fail)"
  searches.clear()
  loss = lambda x: (jnp.sum(model._self_attention(0, x, offsets, rows) ** 2)  # noqa: E731
                    + jnp.sum(model._seed_pool(x, offsets, rows) ** 2))
  jax.make_jaxpr(jax.grad(loss))(x)
  assert not searches


def test_bad_offsets_shape_raises(model):
  sparse, dense, ids, off = _inputs()
  with pytest.raises(ValueError, match="seq_offsets"):
    model(sparse, dense, ids, off[:-1])


@pytest.mark.parametrize("field, value", [("num_heads", 0), ("kv_len", 1.5), ("epsilon", 0.0),
                                          ("num_sparse_features", True),
                                          ("activation", "gelu_fast"), ("activation", None)])
def test_bad_config_raises(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(CONFIG, **{field: value})


def test_config_accepts_numpy_ints_and_checks_epsilon_type():
  cfg = dataclasses.replace(CONFIG, num_heads=np.int64(CONFIG.num_heads))
  assert type(cfg.num_heads) is int and cfg.num_heads == CONFIG.num_heads
  with pytest.raises(TypeError, match="epsilon"):
    dataclasses.replace(CONFIG, epsilon="a")
  with pytest.raises(ValueError, match="epsilon"):
    dataclasses.replace(CONFIG, epsilon=1e-50)  # 0 in float32


def test_config_that_is_not_a_kunlun_config_raises_naming_config():
  with pytest.raises(TypeError, match="config must be a KunlunConfig, got dict"):
    KunlunModel(dataclasses.asdict(CONFIG), rngs=nnx.Rngs(0))


def test_float16_model_trains_on_the_cpu(model, forward):
  """float16 compute differentiates on the CPU (the softmax attentions run in float32 there:
  XLA:CPU has no float16 dot with a float32 result), and its logits and gradients stay near
  the float32 model's (same parameters: nnx.Rngs(0)). The logits jitted (the module's
  ``forward``): eagerly each of the float16 model's ops compiled on its own (most of the
  test's 16 s); test_jit_equals_eager checks eager against jit."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU behaviour")
  f16 = _model(dtype=jnp.float16, implementation="xla")
  inputs, labels = _inputs(10), _labels(11)
  g16, g32 = _grad(f16, *inputs, labels), _grad(model, *inputs, labels)
  np.testing.assert_allclose(forward(f16, *inputs), forward(model, *inputs),
                             atol=2e-3)  # measured 5e-5
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g16)),
                          jax.tree.leaves(nnx.to_pure_dict(g32))):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    name = jax.tree_util.keystr(path)
    assert np.all(np.isfinite(a)), name
    # float16 through ~15 layers: within 2% of the gradient's own scale (measured ≤ 0.4%)
    assert np.max(np.abs(a - b)) <= 0.02 * np.max(np.abs(b)) + 1e-6, name


def test_context_only_model_without_dense_features():
  cfg = dataclasses.replace(CONFIG, num_dense_features=0, num_layers=1, num_mlp_layers=0)
  m = KunlunModel(cfg, rngs=nnx.Rngs(1), implementation="xla")
  sparse, _, ids, _ = _inputs(9)
  y = nnx.jit(lambda m, *a: m(*a))(m, sparse, np.zeros((B, 0), np.float32), ids,
                                   jagged.offsets_from_lengths(np.zeros(B, np.int64)))
  assert y.shape == (B,) and np.all(np.isfinite(y))


def test_out_of_range_ids_are_hashed_into_the_tables(model, forward):
  """Ids past the vocabulary (or negative) map modulo the table size: finite, same logits."""
  sparse, dense, ids, off = _inputs(7)
  want = forward(model, sparse, dense, ids, off)
  shifted = forward(model, sparse + 10 * CONFIG.sparse_vocab_size, dense,
                    ids - 3 * CONFIG.item_vocab_size, off)
  np.testing.assert_allclose(shifted, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,offset", [(np.uint8, 0), (np.int8, 0), (np.int16, 0),
                                          (np.uint16, 40000)])
def test_narrow_integer_ids_hash_as_int32_ids(dtype, offset):
  """Ids in a dtype narrower than 32 bits give the logits of the same ids in int32 (review
  finding: the modulo ran in the ids' dtype, where the vocabulary size wraps: 4096 is 0 in
  uint8, so every id went to row 0; 100000 is 34464 in uint16)."""
  cfg = dataclasses.replace(CONFIG, sparse_vocab_size=4096, item_vocab_size=100000)
  model = KunlunModel(cfg, rngs=nnx.Rngs(0), implementation="xla")
  sparse, dense, ids, off = _inputs(3)
  sparse, ids = sparse % 100 + offset, ids % 100 + offset
  want = model(sparse.astype(np.int32), dense, ids.astype(np.int32), off)
  got = model(sparse.astype(dtype), dense, ids.astype(dtype), off)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("arg,make,error,name", [
    ("sparse_ids", lambda s, d, i, o: (s[:, :2], d, i, o), ValueError, "sparse_ids"),
    ("sparse_ids", lambda s, d, i, o: (s.astype(np.float32), d, i, o), TypeError, "sparse_ids"),
    ("dense", lambda s, d, i, o: (s, d[:, :1], i, o), ValueError, "dense"),
    # A nested list of the right shape was reported as "dense must have shape (B, Fd) ... got ()".
    ("dense_list", lambda s, d, i, o: (s, d.tolist(), i, o), TypeError,
     "dense must be an array, got list"),
    # Review finding: nnx.Linear cast a complex dense to real, dropping its imaginary part.
    ("dense_complex", lambda s, d, i, o: (s, d + 1j, i, o), TypeError,
     "dense must be a real array, got complex"),
    ("seq_ids", lambda s, d, i, o: (s, d, i.reshape(B, -1), o), ValueError, "seq_ids"),
    ("seq_offsets", lambda s, d, i, o: (s, d, i, list(o)), TypeError, "seq_offsets"),
    # The jagged rule of the PFFN op, checked by the model so that errors name seq_offsets
    # (they used to name the op's q_offsets, or for float offsets say nothing of either).
    ("seq_offsets_int16", lambda s, d, i, o: (s, d, i, o.astype(np.int16)), TypeError,
     "seq_offsets must be int32"),
    ("seq_offsets_float", lambda s, d, i, o: (s, d, i, o.astype(np.float32)), TypeError,
     "seq_offsets must be int32"),
    ("seq_offsets_first", lambda s, d, i, o: (s, d, i, o + 1), ValueError,
     r"seq_offsets\[0\] must be 0"),
    ("seq_offsets_decreasing", lambda s, d, i, o: (s, d, i, o[[0, 1, 3, 2, 4, 5]]), ValueError,
     "seq_offsets must be non-decreasing"),
    ("seq_offsets_past_capacity", lambda s, d, i, o: (s, d, i[:o[-1] - 1], o), ValueError,
     r"seq_offsets\[-1\] = 14 exceeds the packed capacity 13"),
    ("seq_offsets_too_long", lambda s, d, i, o: (s, d, i, np.array([0, 3, 3, 10, 10, 14],
                                                                   np.int32)),
     ValueError, "seq_offsets has 7 rows, more than KunlunConfig.max_seq_len=6"),
    ("batch", lambda s, d, i, o: (s[:0], d[:0], i, o[:1]), ValueError, "sparse_ids"),
])
def test_bad_model_inputs_raise_naming_the_argument(model, arg, make, error, name):
  # The model's name in front, as every layer's errors have theirs (review finding: they had
  # none, so a training loop's traceback did not say which module refused the batch).
  with pytest.raises(error, match="^KunlunModel: .*" + name) as info:
    model(*make(*_inputs(8)))
  assert type(info.value) is error


def test_numpy_int64_offsets_are_int32_as_under_jit(model):
  """Without x64 a NumPy int64 seq_offsets is int32 to JAX, as under jax.jit (which converts
  it before the model sees it): the eager model raised "seq_offsets must be int32, got int64"
  (review_jagged); it now gives the int32 offsets' logits, exactly."""
  sparse, dense, ids, off = _inputs(8)
  np.testing.assert_array_equal(np.asarray(model(sparse, dense, ids, off.astype(np.int64))),
                                np.asarray(model(sparse, dense, ids, off)))


def test_traced_bad_offsets_dtype_names_seq_offsets(model, forward):
  """Under jit the dtype check still runs (on the tracer) and names the model's argument."""
  sparse, dense, ids, off = _inputs(8)
  with pytest.raises(TypeError, match="^KunlunModel: seq_offsets must be int32"):
    forward(model, sparse, dense, ids, off.astype(np.int16))


@pytest.mark.parametrize("path,param,error,message", [
    ("pffn[0]", "rms_scale", ValueError, r"PFFNBlock: rms_scale must have shape \(16,\), got "),
    ("pffn[1]", "rms_scale", ValueError, r"PFFNBlock: rms_scale must have shape \(16,\), got "),
    ("qkv[1]", "norm_scale", ValueError,
     r"NormDense\(in_features=16, out_features=48\): scale must have shape \(16,\), got "),
    ("mlp[0]", "bias", ValueError, r"DenseNorm: bias must have shape \(16,\)"),
    ("head", "bias", ValueError, r"NormDense: bias must have shape \(1,\), got \(3,\)"),
    # nnx.Linear's own error (JAX's broadcasting TypeError) gets the path too.
    ("kv_gen[1]", "bias", TypeError, "add got incompatible shapes for broadcasting"),
])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sub_layer_errors_name_the_sub_layers_path(forward, path, param, error, message, jit):
  """A sub-layer's error names its class only; the model holds several of each (pffn[0] and
  pffn[1] raised the same message), so the model puts the sub-layer's path in front. Here a
  parameter replaced by one of another shape, which only the sub-layer's call detects."""
  m = _model(implementation="xla")
  name, index = re.fullmatch(r"(\w+)(?:\[(\d)\])?", path).groups()
  layer = getattr(m, name) if index is None else getattr(m, name)[int(index)]
  setattr(layer, param, nnx.Param(jnp.ones(3)))
  call = forward if jit else lambda m, *a: m(*a)
  with pytest.raises(error, match="^" + re.escape(f"KunlunModel.{path}: ") + message) as info:
    call(m, *_inputs(8))
  assert type(info.value) is error
  assert type(info.value.__cause__) is error  # the sub-layer's own error, chained
  assert not str(info.value.__cause__).startswith("KunlunModel")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "not-a-dtype"])
def test_bad_dtype_raises_naming_dtype_when_the_model_is_built(dtype):
  # It used to build, and the first call failed naming an op's x.
  with pytest.raises(TypeError, match="KunlunModel: dtype must be a floating dtype"):
    _model(dtype=dtype)


@pytest.mark.parametrize("param_dtype", [jnp.int32, jnp.bool_, "bogus", None])
def test_bad_param_dtype_raises_naming_it_when_the_model_is_built(param_dtype):
  # int32 used to build int32 parameters silently; "bogus" failed inside JAX (review finding).
  with pytest.raises(TypeError, match="KunlunModel: param_dtype must be a floating dtype"):
    _model(param_dtype=param_dtype)


# Every dense layer but the head has K and N multiples of 64, so the kernels can run them.
KERNEL_CONFIG = dataclasses.replace(CONFIG, num_dense_features=1, embed_dim=64, head_dim=32,
                                    num_layers=1, summary_dim=64, mlp_dim=64)


@pytest.mark.slow
def test_kernel_where_it_fits_xla_elsewhere(monkeypatch):
  """implementation=("interpret", "xla"): the norm GEMMs run the kernel (GPU interpret mode)
  wherever their shapes fit, the rest (the 1-wide head) XLA; same logits as XLA."""
  from pallas_norm import _dispatch
  if _dispatch.interpret_threads_reason():
    pytest.skip(_dispatch.interpret_threads_reason())
  chosen = []
  choose = _dispatch.choose
  monkeypatch.setattr(_dispatch, "choose",
                      lambda op, *a, **k: chosen.append((op, choose(op, *a, **k))) or chosen[-1][1])
  rng = np.random.default_rng(3)
  inputs = (rng.integers(0, 64, (B, 3), np.int32), rng.normal(size=(B, 1)).astype(np.float32),
            rng.integers(1, 64, T).astype(np.int32), jagged.offsets_from_lengths(LENS))
  def build(impl):  # the same parameters: a fresh Rngs each
    return KunlunModel(KERNEL_CONFIG, implementation=impl, dtype=jnp.bfloat16, rngs=nnx.Rngs(4))
  # Under jit: the whole model is one compile (eagerly, each op compiled on its own cost 1.5x
  # the CPU time); the implementation is static, so each model traces and chooses anew.
  forward = nnx.jit(lambda m, *a: m(*a))
  want = forward(build("xla"), *inputs)
  chosen.clear()
  got = forward(build(("interpret", "xla")), *inputs)
  assert ("norm_matmul", "interpret") in chosen and ("matmul_norm", "interpret") in chosen
  assert ("norm_matmul", "xla") in chosen  # the head: N = 1
  # The PFFN: the norms around the GDPA kernel where its shapes fit, else XLA.
  assert any(op == "flash_norm_attention" for op, _ in chosen)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.02, atol=0.02)
  assert float(np.max(np.abs(np.asarray(want)))) > 0


# ---------------------------------------------------------------------------------------------
# The softmax attentions: cuDNN's flash attention on an NVIDIA GPU, XLA elsewhere.

from pallas_norm import padded_attention as attention  # noqa: E402


def _padded_attention_case(seed, dtype, lens=(5, 0, 8, 1), max_len=8, heads=2, head_dim=16):
  rng = np.random.default_rng(seed)
  shape = (len(lens), max_len, heads, head_dim)
  q, k, v, cot = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4))
  return q, k, v, cot, jnp.asarray(lens, jnp.int32)


def _valid_rows(lens, max_len):
  return (np.arange(max_len)[None, :] < np.asarray(lens)[:, None])[..., None, None]


def _plain_attention(q, k, v, kv_lengths):
  """The masked softmax attention in plain JAX: the tests' oracle of softmax_attention."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  keep = jnp.arange(k.shape[1])[None, :] < kv_lengths[:, None]
  return jnp.einsum("bhqk,bkhd->bqhd",
                    jax.nn.softmax(jnp.where(keep[:, None, None], s, -jnp.inf), axis=-1), v)


@pytest.mark.parametrize("implementation", [None, "mosaic", ("mosaic", "xla"), "xla",
                                            "interpret"])
def test_softmax_attention_uses_xla_off_an_nvidia_gpu(implementation):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU behaviour")
  assert attention.softmax_attention_backend(implementation, jnp.bfloat16, 128) == "xla"


def test_softmax_attention_falls_back_to_xla_where_cudnn_cannot_trace(monkeypatch):
  """When the static checks pass but cuDNN refuses the call while tracing (here: a CPU has no
  cuDNN), the attention is XLA's, not an error."""
  monkeypatch.setattr(attention, "_cudnn_unsupported_reason", lambda *a: None)
  q, k, v, _, lens = _padded_attention_case(0, jnp.bfloat16)
  assert attention.softmax_attention_backend(None, q.dtype, q.shape[-1]) == "cudnn"
  got = attention.softmax_attention(q, k, v, lens, lens)
  want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _bad_attention_args(case):
  """softmax_attention's arguments with one of them broken as ``case`` says."""
  q, k, v, _, lens = _padded_attention_case(2, jnp.float32)
  b, lq, h, d = q.shape
  args = {"q": q, "k": k, "v": v, "q_lengths": lens, "kv_lengths": lens}
  broken = {
      "q 3-D": {"q": q[0]},
      "q a list": {"q": np.asarray(q).tolist()},
      "q int32": {"q": q.astype(jnp.int32)},
      "k other head dim": {"k": k[..., :8]},
      "k other heads": {"k": k[:, :, :1], "v": v[:, :, :1]},
      "k other batch": {"k": k[:2], "v": v[:2]},
      "v other length": {"v": v[:, :6]},
      "v bfloat16": {"v": v.astype(jnp.bfloat16)},
      "kv_lengths None": {"kv_lengths": None},
      "kv_lengths float": {"kv_lengths": lens.astype(jnp.float32)},
      "kv_lengths (B, 1)": {"kv_lengths": lens[:, None]},
      "q_lengths float": {"q_lengths": lens.astype(jnp.float32)},
      "q_lengths (B-1,)": {"q_lengths": lens[:-1]},
      "q_lengths a list": {"q_lengths": [5, 0, 8, 1]},
      "kv_lengths past Lkv": {"kv_lengths": lens.at[2].set(lq + 1)},
      "kv_lengths negative": {"kv_lengths": lens.at[1].set(-1)},
      "q_lengths past Lq": {"q_lengths": lens.at[0].set(lq + 3)},
  }[case]
  return {**args, **broken}


@pytest.mark.parametrize("case, error, names", [
    ("q 3-D", ValueError, "q"), ("q a list", TypeError, "q"), ("q int32", TypeError, "q"),
    ("k other head dim", ValueError, "k"), ("k other heads", ValueError, "k"),
    ("k other batch", ValueError, "k"), ("v other length", ValueError, "v"),
    ("v bfloat16", TypeError, "v"), ("kv_lengths None", TypeError, "kv_lengths"),
    ("kv_lengths float", TypeError, "kv_lengths"), ("kv_lengths (B, 1)", ValueError, "kv_lengths"),
    ("q_lengths float", TypeError, "q_lengths"), ("q_lengths (B-1,)", ValueError, "q_lengths"),
    ("q_lengths a list", TypeError, "q_lengths"),
    ("kv_lengths past Lkv", ValueError, "kv_lengths"),
    ("kv_lengths negative", ValueError, "kv_lengths"),
    ("q_lengths past Lq", ValueError, "q_lengths"),
])
def test_softmax_attention_names_a_bad_argument(case, error, names):
  """Each bad argument raises naming it, before JAX's attention runs: the XLA path ignored
  q_lengths (any dtype, shape or value passed on the CPU and failed only on a GPU), accepted an
  integer q, k of fewer heads and lengths past the padded length, and the rest failed inside
  jax.nn.dot_product_attention naming its own arguments ("value shape should be ..." for a bad
  k, "key_value_seq_lengths ...") or with an AttributeError."""
  args = _bad_attention_args(case)
  with pytest.raises(error, match=rf"^{names}\b"):
    attention.softmax_attention(**args)


def test_softmax_attention_checks_shapes_under_jit_and_bad_implementation():
  q, k, v, _, lens = _padded_attention_case(3, jnp.float32)
  with pytest.raises(ValueError, match="^k"):
    jax.jit(attention.softmax_attention)(q, k[:, :, :1], v[:, :, :1], lens, lens)
  for implementation in ("cuda", 3, ()):
    with pytest.raises(ValueError, match="implementation"):
      attention.softmax_attention(q, k, v, lens, lens, implementation=implementation)
  # Traced lengths cannot raise: valid ones run as before (bad ones: the test below).
  got = jax.jit(attention.softmax_attention)(q, k, v, lens, lens)
  np.testing.assert_array_equal(got, attention.softmax_attention(q, k, v, lens, lens))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("path", ["xla", "interpret", "cudnn-fallback"])
def test_softmax_attention_poisons_traced_lengths_out_of_range(monkeypatch, path, dtype):
  """Traced lengths were not checked: under jax.jit a q length past Lq acted as Lq and a
  negative kv length as 0, a finite answer where the eager call raises. Now the whole output
  is NaN, and so are the gradients of q, k and v (the key mask sent exact zeros to masked keys,
  and the caller's mask of dropped rows zeros to their queries), also a checkify error; valid
  traced lengths still give the eager call's values, the plain masked softmax's on the kept
  rows. Both paths the CPU takes: XLA's, and the cuDNN attempt that falls back to it while
  tracing (float16: the CPU's float32 detour)."""
  if path == "cudnn-fallback":
    monkeypatch.setattr(attention, "_cudnn_unsupported_reason", lambda *a: None)
  implementation = None if path == "cudnn-fallback" else path
  q, k, v, cot, lens = _padded_attention_case(6, dtype, lens=(5, 3, 8, 1))
  lq, lkv = q.shape[1], k.shape[1]
  keep = jnp.asarray(_valid_rows(lens, lq))

  def fn(q, k, v, q_lengths, kv_lengths):
    return attention.softmax_attention(q, k, v, q_lengths, kv_lengths,
                                       implementation=implementation)

  def loss(q, k, v, q_lengths, kv_lengths):  # as the model: dropped rows get no cotangent
    o = fn(q, k, v, q_lengths, kv_lengths).astype(jnp.float32)
    return jnp.sum(jnp.where(keep, o * cot.astype(jnp.float32), 0))

  jitted, grad = jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = jitted(q, k, v, lens, lens)
  np.testing.assert_array_equal(got, fn(q, k, v, lens, lens))
  f64 = [np.asarray(a, np.float64) for a in (q, k, v)]
  with jax.enable_x64(True):
    want = np.asarray(_plain_attention(*f64, jnp.asarray(np.asarray(lens))))
  tol = 1e-5 if dtype == jnp.float32 else 2e-3
  np.testing.assert_allclose(np.where(keep, np.asarray(got, np.float64), 0),
                             np.where(keep, want, 0), rtol=tol, atol=tol)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad(q, k, v, lens, lens))
  for q_lengths, kv_lengths in ((lens.at[0].set(lq + 1), lens), (lens, lens.at[1].set(-1)),
                                (None, lens.at[2].set(lkv + 2)), (lens.at[3].set(-4), lens)):
    out = jitted(q, k, v, q_lengths, kv_lengths)
    assert out.shape == q.shape and out.dtype == dtype
    assert bool(jnp.all(jnp.isnan(out)))
    for g in grad(q, k, v, q_lengths, kv_lengths):
      assert bool(jnp.all(jnp.isnan(g)))
  err, _ = checkify.checkify(jitted)(q, k, v, lens, lens.at[1].set(-1))
  with pytest.raises(checkify.JaxRuntimeError, match="kv_lengths lie outside"):
    err.throw()
  checkify.checkify(jitted)(q, k, v, lens, lens)[0].throw()  # valid lengths: no error


def test_softmax_attention_matches_a_plain_masked_softmax_on_valid_rows():
  """XLA's path (the CPU's) against a masked softmax in plain JAX: values and gradients on the
  rows the model keeps, in float32, float16 (run in float32 on the CPU) and bfloat16."""
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.float16, 2e-3), (jnp.bfloat16, 2e-2)):
    q, k, v, cot, lens = _padded_attention_case(4, dtype, lens=(5, 3, 8, 1))
    keep = jnp.asarray(_valid_rows(lens, q.shape[1]))

    def loss(fn, q, k, v):
      o = fn(q, k, v).astype(jnp.float32)
      return jnp.sum(jnp.where(keep, o * cot.astype(jnp.float32), 0))

    got = jax.value_and_grad(lambda *a: loss(
        lambda q, k, v: attention.softmax_attention(q, k, v, lens, lens), *a),
        argnums=(0, 1, 2))(q, k, v)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want = jax.value_and_grad(lambda *a: loss(
        lambda q, k, v: _plain_attention(q, k, v, lens), *a),
                              argnums=(0, 1, 2))(*f32)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert g.dtype == (jnp.float32 if g.ndim == 0 else dtype)
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_softmax_attention_cudnn_matches_xla_on_valid_rows():
  """cuDNN (the default on the GPU) vs XLA on the rows the model keeps: values and gradients,
  empty and full samples, zero cotangent on the rows the model drops."""
  q, k, v, cot, lens = _padded_attention_case(1, jnp.bfloat16)
  assert attention.softmax_attention_backend(None, q.dtype, q.shape[-1]) == "cudnn"
  keep = jnp.asarray(_valid_rows(lens, q.shape[1]))
  cot = jnp.where(keep, cot, 0)

  def run(implementation):
    def f(q, k, v):
      o = attention.softmax_attention(q, k, v, lens, lens, implementation=implementation)
      return jnp.sum(jnp.where(keep, o, 0).astype(jnp.float32) * cot.astype(jnp.float32)), o
    (_, o), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(a, np.float32) for a in (jnp.where(keep, o, 0), *grads)]

  for got, want in zip(run(None), run("xla")):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=0.03, rtol=0.03)  # bf16 operands and outputs


@pytest.mark.gpu
def test_softmax_attention_cudnn_poisons_traced_lengths_out_of_range():
  """The GPU's cuDNN path with traced lengths: valid ones give the eager call's output; a q
  length past Lq or a negative kv length makes the output and the gradients of q, k, v NaN
  (the lengths reach cuDNN clipped: it never sees a length past its padded one)."""
  q, k, v, cot, lens = _padded_attention_case(12, jnp.bfloat16, lens=(5, 3, 8, 1))
  assert attention.softmax_attention_backend(None, q.dtype, q.shape[-1]) == "cudnn"
  keep = jnp.asarray(_valid_rows(lens, q.shape[1]))

  def loss(q, k, v, q_lengths, kv_lengths):
    o = attention.softmax_attention(q, k, v, q_lengths, kv_lengths).astype(jnp.float32)
    return jnp.sum(jnp.where(keep, o * cot.astype(jnp.float32), 0))

  jitted = jax.jit(attention.softmax_attention)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  got = np.asarray(jnp.where(keep, jitted(q, k, v, lens, lens), 0), np.float32)
  want = np.asarray(jnp.where(keep, attention.softmax_attention(q, k, v, lens, lens), 0),
                    np.float32)
  np.testing.assert_array_equal(got, want)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad(q, k, v, lens, lens))
  for q_lengths, kv_lengths in ((lens.at[0].set(q.shape[1] + 1), lens), (lens, lens.at[1].set(-1))):
    assert bool(jnp.all(jnp.isnan(jitted(q, k, v, q_lengths, kv_lengths))))
    for g in grad(q, k, v, q_lengths, kv_lengths):
      assert bool(jnp.all(jnp.isnan(g)))


@pytest.mark.gpu
def test_default_model_matches_xla_on_the_gpu():
  """implementation=None (cuDNN attentions, kernels where the dispatch picks them) against
  "xla": same logits and loss gradient up to bf16 rounding."""
  def build(impl):
    return _model(dtype=jnp.bfloat16, implementation=impl)

  inputs, labels = _inputs(10), _labels(11)
  loss_and_grad = nnx.jit(nnx.value_and_grad(_bce))
  (got_loss, got), (want_loss, want) = (loss_and_grad(build(i), *inputs, labels)
                                        for i in (None, "xla"))
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=0.02)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, atol=0.05 * float(np.max(np.abs(w))) + 1e-6)


def test_embedding_tables_are_read_in_param_dtype_and_cast_after():
  """bf16 compute: the rows are gathered from the f32 tables and then cast (the same values as
  casting the tables first), so the tables' gradients are f32 scatter-adds: no bf16
  accumulation of the many cotangent rows that share a table row (every padding row shares
  row 0; each recency row gets one row per sample)."""
  model = _model(dtype=jnp.bfloat16, implementation="xla")
  sparse_ids, dense, seq_ids, offsets = _inputs(3)
  x = model._sequence_tokens(jnp.asarray(seq_ids), jnp.asarray(offsets))
  rows = model.item_embed.embedding[...].astype(jnp.bfloat16)[seq_ids]
  seg, pos = jagged.segment_ids(offsets, T), jagged.positions(offsets, T)
  recency = np.clip(np.asarray(LENS)[np.minimum(seg, B - 1)] - 1 - pos, 0, CONFIG.max_seq_len - 1)
  rows = rows + model.recency_embed.embedding[...].astype(jnp.bfloat16)[recency]
  valid = np.arange(T) < offsets[-1]
  expect = np.where(valid[:, None], np.asarray(rows, np.float32), 0.0)
  assert x.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(x, np.float32).reshape(T, -1), expect)

  def loss(m):
    return jnp.sum(m(sparse_ids, dense, seq_ids, offsets))
  jaxpr = str(jax.make_jaxpr(nnx.grad(loss))(model))
  for table in (model.item_embed, model.recency_embed, model.sparse_embed):
    rows, width = table.embedding.shape
    assert f"f32[{rows},{width}] = scatter-add" in jaxpr
    assert f"bf16[{rows},{width}] = scatter-add" not in jaxpr
