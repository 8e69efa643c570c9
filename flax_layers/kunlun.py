"""A small Kunlun-style click-through-rate model built from the fused-norm layers.

Structure (DESIGN.md, "Where the Kunlun PFFN comes from"): context features (hashed categorical
ids + dense values) → embeddings → context tokens X; a summary of X → per layer, per-sample K and
V (the personalized FFN weights, (B, Lkv, H, D)); the jagged behaviour sequence S (packed item
ids + offsets) → per layer: PFFN (:class:`PFFNBlock`, i.e. ``flash_norm_attention``) →
softmax self-attention over S → seed pooling of S → an interaction MLP over [X, pooled S] of
pre-norm (:class:`NormDense`) and post-norm residual (:class:`DenseNorm`) layers → click logit.

Every sub-layer that calls a pallas-norm op takes the model's ``implementation``.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_norm as pn
from pallas_norm import _validate, jagged
from flax_layers import _common
from flax_layers.attention import PFFNBlock
from flax_layers.dense import DenseNorm, NormDense


@dataclasses.dataclass(frozen=True)
class KunlunConfig:
  """Sizes of :class:`KunlunModel`. The defaults train on a CPU in milliseconds per step.

  Attributes:
    num_sparse_features: Fs, categorical fields per example (ids in [0, sparse_vocab_size)).
    num_dense_features: Fd, float features per example (0 allowed: no dense token).
    sparse_vocab_size: rows of the shared hashed-id embedding table.
    item_vocab_size: rows of the item embedding table of the behaviour sequence.
    embed_dim: E, width of a context token.
    num_heads, head_dim: H and D of the sequence tokens (token width H·D).
    kv_len: Lkv, the hidden width of the personalized FFN (keys/values per sample and layer);
      Kunlun uses 128.
    num_layers: PFFN + self-attention layers over the sequence.
    max_seq_len: static bound on sequence lengths (the padded layout of the attentions).
    num_seeds: learnable seed queries of the sequence pooling.
    summary_dim: width of the context summary that generates K and V.
    mlp_dim, num_mlp_layers: the interaction MLP (residual post-norm layers after the first).
    activation: GDPA activation of the PFFN (see :data:`pallas_norm.ACTIVATIONS`).
    epsilon: eps of every norm.

  Raises:
    ValueError: a size that is not an integer of at least 1 (bools and floats are refused; 0
      is allowed for num_dense_features and num_mlp_layers), an unknown activation, or an epsilon
      that is not positive and finite in float64 (x64 on) or float32, or below its floor
      (:func:`pallas_norm._validate.eps`).
    TypeError: an epsilon that is not a real number.
  """

  num_sparse_features: int = 8
  num_dense_features: int = 4
  sparse_vocab_size: int = 4096
  item_vocab_size: int = 4096
  embed_dim: int = 16
  num_heads: int = 2
  head_dim: int = 16
  kv_len: int = 16
  num_layers: int = 2
  max_seq_len: int = 32
  num_seeds: int = 2
  summary_dim: int = 64
  mlp_dim: int = 64
  num_mlp_layers: int = 2
  activation: str = "fast_gelu"
  epsilon: float = 1e-6

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name in ("activation", "epsilon"):
        continue
      minimum = 0 if f.name in ("num_dense_features", "num_mlp_layers") else 1
      try:  # any integer (NumPy ones too), stored as a Python int; not a bool or a float
        size = None if isinstance(v, bool) else operator.index(v)
      except TypeError:
        size = None
      if size is None or size < minimum:
        raise ValueError(f"KunlunConfig.{f.name} must be an int >= {minimum}, got {v!r}")
      object.__setattr__(self, f.name, size)
    try:
      _validate.activation(self.activation, pn.ACTIVATIONS)
    except ValueError as e:
      raise ValueError(f"KunlunConfig.{e}") from e
    # the ops' own eps rule (the loosest: the layers built from the config check theirs)
    object.__setattr__(self, "epsilon", _common.check_epsilon("KunlunConfig", self.epsilon))

  @property
  def token_dim(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def num_context_tokens(self) -> int:
    return self.num_sparse_features + (1 if self.num_dense_features else 0)


def _hashed(ids, vocab_size: int):
  """``ids mod vocab_size``, computed in at least 32 bits: in a narrower dtype the vocabulary
  size itself wraps (4096 is 0 in uint8, 100000 is 34464 in uint16), which sent every id to
  the wrong row, or a negative one, without an error."""
  if jnp.dtype(ids.dtype).itemsize < 4:
    ids = ids.astype(jnp.int32)
  return jnp.mod(ids, vocab_size)


class KunlunModel(nnx.Module):
  """Kunlun-style CTR model; ``__call__`` returns one click logit per example.

  The architecture of DESIGN.md, "Where the Kunlun PFFN comes from" (Meta's Kunlun ads models),
  at small sizes; the module docstring lists its parts.

  On several devices: under a mesh of Explicit axes (``jax.set_mesh``, or inputs or parameters
  placed on such a mesh) a call runs with those axes Auto (``jax.sharding.auto_axes``), as
  under an Auto mesh: XLA partitions it from the inputs' and parameters' shardings (e.g. the
  batch split over "data", the embedding tables by rows), and the logits come back split like
  ``sparse_ids``' first axis. Its pallas-norm kernels are not split by rows there; for that run
  the model per shard inside ``jax.shard_map`` (``examples/distributed.py``).

  Args:
    config: :class:`KunlunConfig`.
    dtype: compute dtype (e.g. jnp.bfloat16); None computes in the parameters' dtype.
    param_dtype: parameter dtype: a floating dtype (default float32).
    rngs: ``nnx.Rngs`` for initialization.
    implementation: passed to every pallas-norm op: None, "xla", "mosaic", "interpret", or a
      sequence tried in order per call, e.g. ("mosaic", "xla"): the kernels in every layer
      whose shapes they support and XLA in the others (the dense layers need bf16/f16 and K,
      N multiples of 64; the PFFN's kernels bf16/f16, head_dim 64 or 128 and kv_len a
      multiple of 64; see the README's status table). The softmax self-attention and the
      seed pooling run cuDNN's flash attention on an NVIDIA GPU for None and for choices that
      include "mosaic", XLA's attention otherwise
      (:func:`pallas_norm.softmax_attention`). A choice without "xla" ("mosaic" or
      "interpret" alone, or a sequence of kernels only) is refused: the logit head (N = 1)
      never fits a kernel.

  Raises:
    TypeError: at construction, for a config that is not a :class:`KunlunConfig`, a dtype that
      is neither None nor a floating dtype, a param_dtype that is not a floating dtype
      (bfloat16, float16, float32, float64), or an rngs that is not an ``nnx.Rngs``.
    ValueError: at construction, for an unknown implementation or one without "xla".
  """

  def __init__(self, config: KunlunConfig, *, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs, implementation=None):
    if not isinstance(config, KunlunConfig):
      raise TypeError(f"KunlunModel: config must be a KunlunConfig, got {type(config).__name__}"
                      " (e.g. KunlunConfig(**fields) for a dict of fields)")
    c = config
    self.config = c
    self.dtype = _common.check_dtype(type(self).__name__, dtype)
    _common.check_dtype(type(self).__name__, param_dtype, "param_dtype")
    # the softmax attentions
    self.implementation = _common.check_implementation(type(self).__name__, implementation)
    _common.check_rngs(type(self).__name__, rngs)
    choices = ((self.implementation,) if isinstance(self.implementation, str)
               else self.implementation)
    if choices is not None and "xla" not in choices:
      raise ValueError(
          f"KunlunModel: implementation={implementation!r} has no 'xla' to run the logit head "
          "(NormDense(mlp_dim, 1): the kernels need N a multiple of 64); pass a sequence such "
          f"as {(*choices, 'xla')!r} for the kernels wherever they fit and XLA elsewhere")
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    lkw = dict(kw, epsilon=c.epsilon, implementation=implementation)
    hd = c.token_dim
    ctx_dim = c.num_context_tokens * c.embed_dim
    # The tables are read in param_dtype and the rows cast afterwards (_embed): their gradient is
    # then a scatter-add in param_dtype. With the compute dtype, nnx.Embed casts the whole table
    # and its gradient adds the rows' cotangents in bf16 (~T/max_seq_len of them per element
    # of the recency table, every padding row onto row 0), then casts the whole table back.
    ekw = dict(kw, dtype=None)
    # Context: one shared hashed-id table (the ids already carry their field through the hash).
    self.sparse_embed = nnx.Embed(c.sparse_vocab_size, c.embed_dim, **ekw)
    self.dense_proj = (nnx.Linear(c.num_dense_features, c.embed_dim, **kw)
                       if c.num_dense_features else None)
    self.summary = NormDense(ctx_dim, c.summary_dim, norm="layer", **lkw)
    # Per layer, the personalized FFN weights K (= W1ᵀ) and V (= W2) from the summary.
    self.kv_gen = nnx.List([nnx.Linear(c.summary_dim, 2 * c.kv_len * hd, **kw)
                            for _ in range(c.num_layers)])
    # Sequence: item embedding plus a recency embedding (0 = most recent event).
    self.item_embed = nnx.Embed(c.item_vocab_size, hd, **ekw)
    self.recency_embed = nnx.Embed(c.max_seq_len, hd, **ekw)
    # The scales keep q·k and the Lkv-term sum near unit size at init (no softmax in GDPA).
    self.pffn = nnx.List([
        PFFNBlock(c.num_heads, c.head_dim, activation=c.activation,
                  pre_scale=c.head_dim ** -0.5, post_scale=c.kv_len ** -0.5, **lkw)
        for _ in range(c.num_layers)])
    self.qkv = nnx.List([NormDense(hd, 3 * hd, norm="rms", use_bias=False, **lkw)
                         for _ in range(c.num_layers)])
    self.attn_out = nnx.List([DenseNorm(hd, hd, norm="layer", **lkw)
                              for _ in range(c.num_layers)])
    # Seed pooling: small seeds start as near-uniform (mean) pooling.
    self.seeds = _common.param(rngs, nnx.initializers.normal(0.1),
                               (c.num_seeds, c.num_heads, c.head_dim), param_dtype)
    self.pool_kv = NormDense(hd, 2 * hd, norm="rms", use_bias=False, **lkw)
    # Interaction MLP over [context tokens, pooled sequence].
    self.mlp_in = NormDense(ctx_dim + c.num_seeds * hd, c.mlp_dim, norm="layer", **lkw)
    self.mlp = nnx.List([DenseNorm(c.mlp_dim, c.mlp_dim, norm="layer", **lkw)
                         for _ in range(c.num_mlp_layers)])
    # A small head starts every logit near 0 (p ≈ 0.5) instead of at O(1) random values.
    self.head = NormDense(c.mlp_dim, 1, norm="rms", kernel_init=nnx.initializers.normal(0.01),
                          **lkw)

  def __call__(self, sparse_ids, dense, seq_ids, seq_offsets):
    """Click logits.

    Args:
      sparse_ids: (B, Fs) int hashed categorical ids; taken modulo sparse_vocab_size (the
        hashing trick), so any int id, negative or out of range, maps to a row. With
        ``jax_enable_x64`` off JAX turns int64 arrays into int32 (their low 32 bits) before any
        op sees them, so the modulo applies to those: reduce 64-bit hashes modulo the
        vocabulary on the host first (``ids % sparse_vocab_size`` in NumPy) to keep the full
        hash.
      dense: (B, Fd) float dense features (ignored when Fd = 0; pass shape (B, 0)).
      seq_ids: (T,) int packed item ids of the behaviour sequences, T a static capacity; taken
        modulo item_vocab_size like sparse_ids (and as those, 32-bit with x64 off).
      seq_offsets: (B+1,) int32 jagged offsets of ``seq_ids`` (lengths <= max_seq_len; empty
        sequences allowed).

    Returns:
      (B,) float32 logits; under a mesh of Explicit axes split like ``sparse_ids``' first axis.

    Raises:
      TypeError: non-integer ids; a dense that is not a real array; seq_offsets that is not
        an int32 array.
      ValueError: ids/dense/offsets of inconsistent shapes; concrete seq_offsets that do not
        start at 0, decrease, end past T or hold a sequence longer than max_seq_len. Under
        ``jax.jit`` those values cannot raise: every logit is NaN instead, and so is a loss
        of them; the gradients are NaN in the parameters the poisoned rows reach and 0 in
        others (e.g. embedding rows no id looked up), so a global-norm clip makes the whole
        update NaN (also a :func:`jax.experimental.checkify.debug_check` error).
      Those errors start with "KunlunModel: ". A sub-layer's error at call time (a plain
      ValueError, TypeError, RuntimeError or NotImplementedError, e.g. for a parameter
      replaced by one of another shape) keeps its type and starts with the sub-layer's path:
      "KunlunModel.pffn[1]: PFFNBlock: ...". JAX's own exception types pass unchanged.
    """
    c = self.config
    with _common.named(type(self).__name__):
      _check_model_inputs(c, sparse_ids, dense, seq_ids, seq_offsets)
    inputs = (sparse_ids, dense, seq_ids, seq_offsets)
    mesh = _explicit_mesh(inputs, self)
    if mesh is None:
      return self._logits(*inputs)
    # Explicit axes type every op's sharding, and JAX refuses the ops whose output sharding it
    # cannot infer: nnx.Embed's gather of a replicated table at ids split by examples
    # (ShardingTypeError, "Use `.at[...].get(out_sharding=)`"), then the jagged conversions and
    # attentions that mix the per-example K/V with the packed sequence. The whole call runs
    # with those axes Auto instead, as under an Auto mesh (XLA propagates the shardings); the
    # parameters go in as arguments, since auto_axes retypes only its arguments.
    graphdef, state = nnx.split(self)

    def logits(state, *inputs):
      return nnx.merge(graphdef, state)._logits(*inputs)
    out = jax.sharding.NamedSharding(mesh, P(jax.typeof(sparse_ids).sharding.spec[0]))
    return jax.sharding.auto_axes(logits, axes=mesh.explicit_axes, out_sharding=out)(
        state, *inputs)

  def _logits(self, sparse_ids, dense, seq_ids, seq_offsets):
    c = self.config
    # Hashing trick: out-of-range ids would make nnx.Embed's gather return NaN rows.
    sparse_ids = _hashed(sparse_ids, c.sparse_vocab_size)
    seq_ids = _hashed(seq_ids, c.item_vocab_size)
    batch = sparse_ids.shape[0]
    # Every jagged conversion of the batch shares one search of the offsets (and its
    # derivatives reuse it).
    rows = jagged.row_index(seq_offsets, seq_ids.shape[0])
    # The named scopes label the parts in profiles (HLO op_name metadata); no effect on the math.
    with jax.named_scope("context_tokens"):
      ctx = self._context(sparse_ids, dense)                   # (B, Nc·E)
    with jax.named_scope("kv_gen"), _common.part(self, "summary") as summarize:
      summary = jax.nn.gelu(summarize(ctx))                    # (B, summary_dim)
    with jax.named_scope("sequence_tokens"):
      x = self._sequence_tokens(seq_ids, seq_offsets, rows)    # (T, H, D)
    for layer in range(c.num_layers):
      with jax.named_scope("kv_gen"):
        with _common.part(self, "kv_gen", layer) as kv_gen:
          kv = kv_gen(summary)
        kv = kv.reshape(batch, 2, c.kv_len, c.num_heads, c.head_dim).astype(x.dtype)
      with jax.named_scope("pffn"), _common.part(self, "pffn", layer) as pffn:
        x = pffn(x, seq_offsets, kv[:, 0], kv[:, 1], max_seq_len=c.max_seq_len)
      with jax.named_scope("self_attention"):
        x = self._self_attention(layer, x, seq_offsets, rows)
    with jax.named_scope("seed_pool"):
      pooled = self._seed_pool(x, seq_offsets, rows)           # (B, S·H·D)
    with jax.named_scope("interaction_mlp"):
      z = jnp.concatenate([ctx, pooled.astype(ctx.dtype)], axis=-1)
      with _common.part(self, "mlp_in") as mlp_in:
        h = jax.nn.gelu(mlp_in(z))
      for i in range(len(self.mlp)):
        with _common.part(self, "mlp", i) as block:
          h = block(jax.nn.gelu(h), residual=h)
      with _common.part(self, "head") as head:
        logits = head(h)[:, 0].astype(jnp.float32)
    return _poison_if_offsets_invalid(logits, seq_offsets, seq_ids.shape[0], c.max_seq_len)

  def _context(self, sparse_ids, dense):
    tokens = self._embed("sparse_embed", sparse_ids)           # (B, Fs, E)
    if self.dense_proj is not None:
      dense = dense if self.dtype is None else dense.astype(self.dtype)
      with _common.part(self, "dense_proj") as dense_proj:
        dense_tok = dense_proj(dense)[:, None, :].astype(tokens.dtype)
      tokens = jnp.concatenate([tokens, dense_tok], axis=1)
    return tokens.reshape(tokens.shape[0], -1)

  def _embed(self, name, ids):
    """Rows of the table ``name`` (an nnx.Embed reading in param_dtype) in the compute dtype."""
    with _common.part(self, name) as table:
      rows = table(ids)
    return rows if self.dtype is None else rows.astype(self.dtype)

  def _sequence_tokens(self, seq_ids, seq_offsets, rows=None):
    """(T, H, D) item + recency embeddings; ``rows``: the batch's jagged.row_index."""
    c = self.config
    capacity = seq_ids.shape[0]
    seg, pos = jagged.row_index(seq_offsets, capacity) if rows is None else rows
    lens = jagged.lengths(seq_offsets)
    recency = jnp.take(lens, seg, mode="clip") - 1 - pos
    x = (self._embed("item_embed", seq_ids)
         + self._embed("recency_embed", jnp.clip(recency, 0, c.max_seq_len - 1)))
    x = _zero_padding_rows(x, seq_offsets)
    return x.reshape(capacity, c.num_heads, c.head_dim)

  def _self_attention(self, layer, x, seq_offsets, rows=None):
    """Softmax self-attention over each sequence (padded layout), post-norm residual;
    ``rows``: the batch's jagged.row_index (else computed here)."""
    c = self.config
    t, h, d = x.shape
    flat = x.reshape(t, h * d)
    with _common.part(self, "qkv", layer) as project:
      qkv = project(flat).reshape(t, 3, h, d)
    rows = jagged.row_index(seq_offsets, t) if rows is None else rows
    # One conversion of the packed q, k, v: the backward then gathers the three cotangents,
    # concatenated (split's transpose), into dqkv in one pass. Converted one by one, each
    # cotangent was gathered and padded to (T, 3, H, D) apart and the three summed, a separate
    # pass over dqkv that the qkv layer's backward (kernel dx, GEMM dW) cannot absorb.
    padded = jagged.to_padded(qkv, seq_offsets, c.max_seq_len, rows=rows)  # (B, L, 3, H, D)
    # split, not strided views: each of q, k, v is its own (B, L, H, D) array, in the layout
    # the attention takes.
    q, k, v = (p[:, :, 0] for p in jnp.split(padded, 3, axis=2))
    lens = jagged.lengths(seq_offsets)
    o = pn.softmax_attention(q, k, v, lens, lens, implementation=self.implementation)
    o = jagged.from_padded(o, seq_offsets, t, rows=rows).reshape(t, h * d)
    with _common.part(self, "attn_out", layer) as attn_out:
      y = attn_out(o, residual=flat.astype(o.dtype))
    return _zero_padding_rows(y, seq_offsets).reshape(t, h, d)

  def _seed_pool(self, x, seq_offsets, rows=None):
    """Learnable seed queries attend to each sequence; empty sequences pool to exactly 0.
    ``rows``: the batch's jagged.row_index (else computed here)."""
    c = self.config
    t, h, d = x.shape
    batch = seq_offsets.shape[0] - 1
    with _common.part(self, "pool_kv") as pool_kv:
      kv = pool_kv(x.reshape(t, h * d)).reshape(t, 2, h, d)
    rows = jagged.row_index(seq_offsets, t) if rows is None else rows
    k, v = (jagged.to_padded(kv[:, i], seq_offsets, c.max_seq_len, rows=rows) for i in range(2))
    seeds = jnp.broadcast_to(self.seeds[...].astype(kv.dtype), (batch,) + self.seeds.shape)
    lens = jagged.lengths(seq_offsets)
    o = pn.softmax_attention(seeds, k, v, None, lens,
                          implementation=self.implementation)  # (B, S, H, D)
    # With no valid key the softmax is uniform over masked (zero) values; make that explicit.
    o = jnp.where((lens > 0)[:, None, None, None], o, jnp.zeros((), o.dtype))
    return o.reshape(batch, -1)


OFFSETS_INVALID_MESSAGE = (
    "KunlunModel: traced seq_offsets break the jagged convention (first 0, non-decreasing, last "
    "<= len(seq_ids), no length over KunlunConfig.max_seq_len); the logits are NaN")


def _poison_if_offsets_invalid(logits, seq_offsets, capacity: int, max_seq_len: int):
  """Every logit NaN (values and gradients) when traced ``seq_offsets`` are invalid. The PFFN op
  already returns NaN tokens for them, but the seed pooling zeroes the samples whose length is
  <= 0, so offsets such as [3, 3, 3] (first != 0) or [0, 0, -1] gave finite, plausible logits.
  Concrete offsets were checked by :func:`_check_model_inputs`."""
  if not isinstance(seq_offsets, jax.core.Tracer):
    return logits
  bad = _validate.offsets_invalid(seq_offsets, capacity, max_seq_len)
  return _validate.poison_if_invalid(logits, bad, OFFSETS_INVALID_MESSAGE)


def _explicit_mesh(inputs, model):
  """The abstract mesh that types the call (that of ``jax.set_mesh``, else of the first input or
  parameter placed on a mesh) when it has Explicit axes, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = _placed_mesh(inputs, mesh)
  if mesh.empty:  # only then the parameters: nnx.state walks the whole model
    mesh = _placed_mesh(nnx.state(model), mesh)
  return mesh if mesh.explicit_axes else None


def _placed_mesh(tree, default):
  meshes = (jax.typeof(a).sharding.mesh for a in jax.tree.leaves(tree))
  return next((m for m in meshes if not m.empty), default)


def _zero_padding_rows(x, offsets):
  valid = jagged.valid_mask(offsets, x.shape[0])
  return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _check_model_inputs(c, sparse_ids, dense, seq_ids, seq_offsets) -> None:
  for name, ids in (("sparse_ids", sparse_ids), ("seq_ids", seq_ids)):
    if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got {getattr(ids, 'dtype', type(ids))}")
  if sparse_ids.ndim != 2 or sparse_ids.shape[1] != c.num_sparse_features:
    raise ValueError(f"sparse_ids must have shape (B, {c.num_sparse_features}), got "
                     f"{tuple(sparse_ids.shape)}")
  if sparse_ids.shape[0] < 1:
    raise ValueError("sparse_ids must hold at least one example (B >= 1)")
  if not _validate.is_array(dense):
    raise TypeError(f"dense must be an array, got {type(dense).__name__} (a jax.Array or "
                    "numpy.ndarray of shape (B, Fd))")
  _common.check_real("dense", dense)  # nnx.Linear casts it
  if tuple(dense.shape) != (sparse_ids.shape[0], c.num_dense_features):
    raise ValueError(f"dense must have shape (B, {c.num_dense_features}) = "
                     f"({sparse_ids.shape[0]}, {c.num_dense_features}), got "
                     f"{tuple(getattr(dense, 'shape', ()))}")
  if seq_ids.ndim != 1:
    raise ValueError(f"seq_ids must be 1-D packed ids (T,), got shape {tuple(seq_ids.shape)}")
  batch = sparse_ids.shape[0]
  if hasattr(seq_offsets, "shape") and tuple(seq_offsets.shape) != (batch + 1,):
    raise ValueError(f"seq_offsets must have shape ({batch + 1},) for B = {batch}, got "
                     f"{tuple(seq_offsets.shape)}")
  # The jagged rule of the ops (int32, 0 first, non-decreasing, last <= T, lengths <=
  # max_seq_len; values only when concrete), here so that errors name seq_offsets, not the
  # PFFN op's q_offsets (or jagged.segment_ids's opaque error for float offsets).
  _validate.offsets("seq_offsets", seq_offsets, seq_ids.shape[0], max_len=c.max_seq_len,
                    max_len_name="KunlunConfig.max_seq_len")
