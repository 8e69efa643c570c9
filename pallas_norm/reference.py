"""Plain jax.numpy versions of every pallas-norm op: the oracle for tests and the XLA path.

Conventions shared by all ops (math in ``DESIGN.md``, "Notation" and "The ops"):

* Statistics (mean, variance, rstd) are computed in float32 (float64 when the inputs are float64),
  with the **shifted two-pass** variance: ``d = x - x[..., :1]`` (exact, :func:`_center`), then
  ``mean((d - mean(d))**2)``, so rows with a large mean keep their precision (no cancellation,
  no mean rounded to one float32 subtracted from them).
* Matrix products take their operands in the inputs' dtype. float32/float64 operands multiply at
  ``Precision.HIGHEST`` (the oracle: tests feed upcast inputs); bfloat16/float16 operands give a
  16-bit product accumulated in float32 inside the GEMM, as plain JAX code does (the XLA
  baseline), and the result is upcast to float32 for what follows.
* The output dtype is the input's dtype unless ``out_dtype`` is given.
* ``scale`` is gamma, ``bias`` is beta. With ``zero_centered_scale=True`` the applied scale is
  ``1 + scale`` (the "zero-centered gamma" parametrization).
* Jagged tensors follow :mod:`pallas_norm.jagged`; padding rows of outputs are zeros.

These functions do **no argument validation**: call them through the public API
(:mod:`pallas_norm`) for checked arguments. They are differentiable with ``jax.grad``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_norm import jagged

__all__ = [
    "NormStats",
    "ACTIVATIONS",
    "rms_norm",
    "layer_norm",
    "norm_matmul",
    "matmul_norm",
    "gdpa",
    "flash_norm_attention",
]


class NormStats(NamedTuple):
  """Row statistics of a normalization, float32 (float64 for float64 inputs), shape = the
  input's leading dims (flash_norm_attention: (T,), per token over all heads).

  ``mean`` is None for RMSNorm. ``rstd = rsqrt(var + eps)`` (RMSNorm: ``rsqrt(mean(x²) + eps)``).
  """

  mean: jax.Array | None
  rstd: jax.Array


def _stat_dtype(dtype) -> jnp.dtype:
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _leaky_relu(s):
  return jax.nn.leaky_relu(s, negative_slope=0.01)


ACTIVATIONS = {
    "fast_gelu": lambda s: jax.nn.gelu(s, approximate=True),
    "gelu": lambda s: jax.nn.gelu(s, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "relu2": lambda s: jnp.square(jax.nn.relu(s)),
    "leaky_relu": _leaky_relu,
    "identity": lambda s: s,
}
"""Activation name -> elementwise function, as used by :func:`gdpa` (leaky slope 0.01)."""


def _center(xf: jax.Array):
  """(x - mean(x), mean(x)) over the last axis, accurate when |mean| >> std.

  Shifting by the row's first element first is exact for values within a factor 2 of each
  other (Sterbenz), so the centered values keep full precision; subtracting a mean that was
  rounded to float32 would cost up to ulp(mean)/std (0.1 at 1e4 + 1e-2 noise).
  """
  shift = lax.stop_gradient(xf[..., :1])
  d = xf - shift
  dmean = jnp.mean(d, axis=-1, keepdims=True)
  return d - dmean, (shift + dmean)[..., 0]


@jax.custom_jvp
def rstd_of(a: jax.Array) -> jax.Array:
  """``rsqrt(a)`` (``a`` = the mean square or variance plus eps) whose derivative stays in
  range: ``d rsqrt(a) = −½ r³ da``, formed as three products by ``r`` in turn. Autodiff of
  ``lax.rsqrt`` forms the factor ``r³`` (or ``r / a``) itself, which flushes to zero in float32
  once ``r`` < ~2e-13 (rows with |x| ≳ 5e12, far from overflow): the input gradient lost its
  ``x̂ · mean(g ⊙ x̂)`` term there, 10–50% off. Here each partial product stays within a factor
  ``r`` of a term of the gradient."""
  return lax.rsqrt(a)


@rstd_of.defjvp
def _rstd_of_jvp(primals, tangents):
  (a,), (a_dot,) = primals, tangents
  r = rstd_of(a)
  # Linear in a_dot through one product at a time, so the transpose scales the cotangent by
  # r three times instead of multiplying it by r³.
  return r, (-0.5 * r) * (r * (r * a_dot))


def _row_stats(xf: jax.Array, norm: str, eps: float) -> NormStats:
  if norm not in ("rms", "layer"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
  if norm == "rms":
    return NormStats(None, rstd_of(jnp.mean(jnp.square(xf), axis=-1) + eps))
  centered, mean = _center(xf)
  var = jnp.mean(jnp.square(centered), axis=-1)  # shifted two-pass: no cancellation
  return NormStats(mean, rstd_of(var + eps))


def _normalize(xf, stats: NormStats, scale, bias, zero_centered_scale: bool):
  centered = xf if stats.mean is None else _center(xf)[0]
  y = centered * stats.rstd[..., None]
  if scale is not None:
    s = scale.astype(xf.dtype)
    y = y * (1 + s if zero_centered_scale else s)
  if bias is not None:
    y = y + bias.astype(xf.dtype)
  return y


def _norm(x, scale, bias, residual, norm, eps, zero_centered_scale, out_dtype):
  sdt = _stat_dtype(x.dtype)
  xf = x.astype(sdt)
  if residual is not None:
    xf = xf + residual.astype(sdt)
  stats = _row_stats(xf, norm, eps)
  y = _normalize(xf, stats, scale, bias, zero_centered_scale).astype(out_dtype or x.dtype)
  if residual is None:
    return y
  return y, xf.astype(x.dtype)


def rms_norm(x, scale=None, residual=None, *, eps=1e-6, zero_centered_scale=False,
             out_dtype=None):
  """RMSNorm over the last axis: ``s · rsqrt(mean(s²) + eps) · scale`` with ``s = x (+ residual)``.

  The math of DESIGN.md, "Notation" (RMSNorm of Zhang & Sennrich, 2019); the oracle of
  :func:`pallas_norm.rms_norm`.

  Args:
    x: (..., N) bfloat16/float16/float32/float64.
    scale: optional (N,) gamma of any float dtype (``1 + scale`` with ``zero_centered_scale``),
      applied in the statistics' dtype.
    residual: optional array of x's shape, added to x in the statistics' dtype.
    eps: added to the mean square. out_dtype: dtype of y (default x.dtype).

  Returns:
    ``y`` (..., N) in ``out_dtype``, or ``(y, s)`` when ``residual`` is given (``s`` in x's
    dtype: the new residual stream). The statistics are float32 (float64 for float64 x).

  Raises:
    Nothing of its own (no validation, see the module docstring): a scale or residual whose
    shape does not broadcast against x fails inside JAX (TypeError).
  """
  return _norm(x, scale, None, residual, "rms", eps, zero_centered_scale, out_dtype)


def layer_norm(x, scale=None, bias=None, residual=None, *, eps=1e-6, zero_centered_scale=False,
               out_dtype=None):
  """LayerNorm over the last axis: ``(s - μ) · rsqrt(σ² + eps) · scale + bias``,
  ``s = x (+ residual)``.

  The math of DESIGN.md, "Notation" (LayerNorm of Ba, Kiros & Hinton, 2016), with the shifted
  two-pass variance (module docstring); the oracle of :func:`pallas_norm.layer_norm`.

  Args:
    x, scale, residual, eps, zero_centered_scale, out_dtype: as :func:`rms_norm`.
    bias: optional (N,) beta of any float dtype, added in the statistics' dtype.

  Returns:
    ``y`` (..., N) in ``out_dtype`` (default x.dtype), or ``(y, s)`` when ``residual`` is
    given (``s`` in x's dtype).

  Raises:
    Nothing of its own: as :func:`rms_norm`.
  """
  return _norm(x, scale, bias, residual, "layer", eps, zero_centered_scale, out_dtype)


def _contract(fn, a, b):
  """A product in the operands' precision, returned in the statistics dtype.

  32/64-bit operands: full precision (the oracle). 16-bit operands: a 16-bit product
  (accumulated in f32 inside the GEMM) as plain JAX code writes it, so that its backward also
  stays in 16-bit GEMMs: a float32 cotangent would turn every backward GEMM into a slow f32 one
  and make the XLA baseline look worse than it is.
  """
  dt = jnp.result_type(a.dtype, b.dtype)
  if jnp.dtype(dt).itemsize >= 4:
    return fn(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=_stat_dtype(dt))
  return fn(a, b).astype(jnp.float32)


def _dot(a, b):
  """a @ b over the last axis of a (see :func:`_contract` for the precision)."""
  return _contract(jnp.matmul, a, b)


def _einsum(spec, a, b):
  return _contract(lambda x, y, **kw: jnp.einsum(spec, x, y, **kw), a, b)


def norm_matmul(x, w, scale=None, norm_bias=None, *, norm="rms", eps=1e-6, out_dtype=None,
                return_stats=False):
  """Pre-norm GEMM ``y = (norm(x)·scale + norm_bias) @ w``; x (..., K), w (K, N), scale and
  norm_bias (K,) (γ and β of the norm).

  The unfused math of DESIGN.md op 1 (the oracle of :func:`pallas_norm.norm_matmul`).
  ``norm(x)`` is rounded to the operands' dtype before the product, as an unfused XLA program
  does.

  Args:
    x: (..., K) and w: (K, N), bfloat16/float16/float32/float64 (one dtype in the public op).
    scale, norm_bias: optional (K,) of any float dtype, applied in the statistics' dtype.
    norm: "rms" or "layer". eps: added to the mean square or variance.
    out_dtype: dtype of y (default x.dtype). return_stats: also return the statistics.

  Returns:
    ``y`` (..., N) in ``out_dtype``, or ``(y, NormStats)`` with ``return_stats`` (x's leading
    shape, float32; float64 for float64 x).

  Raises:
    ValueError: a norm other than "rms" or "layer". Nothing else of its own (no validation):
      a w whose K is not x's fails inside JAX's product (TypeError).
  """
  sdt = _stat_dtype(x.dtype)
  xf = x.astype(sdt)
  stats = _row_stats(xf, norm, eps)
  xn = _normalize(xf, stats, scale, norm_bias, False).astype(jnp.result_type(x.dtype, w.dtype))
  y = _dot(xn, w).astype(out_dtype or x.dtype)
  return (y, stats) if return_stats else y


def matmul_norm(x, w, dense_bias=None, residual=None, scale=None, norm_bias=None, *,
                norm="layer", eps=1e-6, out_dtype=None, return_h=False, return_stats=False):
  """Post-norm GEMM: ``h = x @ w (+ dense_bias) (+ residual)``, ``y = norm(h)·scale (+ norm_bias)``.

  x (..., K), w (K, N), dense_bias/scale/norm_bias (N,), residual (..., N). The GEMM is rounded to
  the operands' dtype as plain JAX writes it (:func:`_contract`; for 16-bit operands a float16
  product past 65504 is inf, where the kernels keep the float32 accumulator), then ``h`` is
  float32 for the statistics. The unfused math of DESIGN.md op 2 (the oracle of
  :func:`pallas_norm.matmul_norm`).

  Args:
    x: (..., K) and w: (K, N), bfloat16/float16/float32/float64 (one dtype in the public op).
    dense_bias, scale, norm_bias: optional (N,); residual: optional (..., N); any float dtype,
      added or applied to h in the statistics' dtype.
    norm: "layer" or "rms". eps: added to the variance or mean square.
    out_dtype: dtype of y and h (default x.dtype). return_h, return_stats: also return them.

  Returns:
    ``y`` (..., N) in ``out_dtype``; with ``return_h`` and/or ``return_stats`` a tuple
    ``(y, h?, stats?)`` in that order, ``h`` (..., N) in the output dtype, stats a
    :class:`NormStats` of x's leading shape (float32; float64 for float64 inputs).

  Raises:
    ValueError: a norm other than "layer" or "rms". Nothing else of its own (no validation):
      a w whose K is not x's fails inside JAX's product (TypeError).
  """
  out_dtype = out_dtype or x.dtype
  h = _dot(x, w)
  if dense_bias is not None:
    h = h + dense_bias.astype(h.dtype)
  if residual is not None:
    h = h + residual.astype(h.dtype)
  stats = _row_stats(h, norm, eps)
  y = _normalize(h, stats, scale, norm_bias, False).astype(out_dtype)
  if not (return_h or return_stats):
    return y
  out = (y,)
  if return_h:
    out += (h.astype(out_dtype),)
  if return_stats:
    out += (stats,)
  return out


def _padded_kv(k, v, kv_offsets, max_kv_len):
  """Dense (B, L, H, D) k/v and their key-valid mask (B, L)."""
  if kv_offsets is None:
    return k, v, jnp.ones(k.shape[:2], bool)
  max_kv_len = max_kv_len or k.shape[0]
  kp = jagged.to_padded(k, kv_offsets, max_kv_len)
  vp = jagged.to_padded(v, kv_offsets, max_kv_len)
  key_valid = jnp.arange(max_kv_len)[None, :] < jagged.lengths(kv_offsets)[:, None]
  return kp, vp, key_valid


def _gdpa_acc(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale,
              max_seq_len, max_kv_len):
  """GDPA output in the accumulator dtype (f32/f64), (T, H, D); padding rows not yet zeroed."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
  batch = jnp.shape(q_offsets)[0] - 1
  if kv_offsets is None and (jnp.ndim(k) != 4 or jnp.shape(k)[0] != batch):
    # The gathers below would clip or broadcast another batch silently.
    raise ValueError(f"dense k must be (B, Lkv, H, D) with B = len(q_offsets) - 1 = {batch}, "
                     f"got {jnp.shape(k)}")
  if jnp.shape(v) != jnp.shape(k):
    raise ValueError(f"v must have k's shape {jnp.shape(k)}, got {jnp.shape(v)}")
  act = ACTIVATIONS[activation]
  # Padding rows of q are never data: zero them so NaN there cannot reach any gradient.
  q = jnp.where(jagged.valid_mask(q_offsets, q.shape[0])[:, None, None], q, 0)
  kp, vp, key_valid = _padded_kv(k, v, kv_offsets, max_kv_len)
  capacity = q.shape[0]
  if max_seq_len is None:
    # Token-wise: gather each token's own sample K/V. O(T·Lkv·H·D) memory: tests only.
    seg = jagged.segment_ids(q_offsets, capacity)
    # Padding rows have seg = B: clip explicitly (their output is zeroed) so that numpy
    # inputs index fine and the gather's VJP agrees with its forward.
    kt, vt, mt = (jnp.take(a, seg, axis=0, mode="clip") for a in (kp, vp, key_valid))
    s = _einsum("thd,tjhd->thj", q, kt)
    p = jnp.where(mt[:, None, :], act(pre_scale * s), 0).astype(v.dtype)
    o = _einsum("thj,tjhd->thd", p, vt)
  else:
    qp = jagged.to_padded(q, q_offsets, max_seq_len)  # (B, L, H, D)
    s = _einsum("blhd,bjhd->bhlj", qp, kp)
    p = jnp.where(key_valid[:, None, None, :], act(pre_scale * s), 0).astype(v.dtype)
    op = _einsum("bhlj,bjhd->blhd", p, vp)
    o = jagged.from_padded(op, q_offsets, capacity)
  return post_scale * o


def _zero_padding(out, q_offsets):
  valid = jagged.valid_mask(q_offsets, out.shape[0])
  return jnp.where(valid.reshape((-1,) + (1,) * (out.ndim - 1)), out, jnp.zeros((), out.dtype))


def gdpa(q, k, v, q_offsets, kv_offsets=None, *, activation="fast_gelu", pre_scale=1.0,
         post_scale=1.0, max_seq_len=None, max_kv_len=None, out_dtype=None):
  """Generalized dot-product attention over jagged queries (no softmax, no row normalization).

  ``o_h = post_scale · act(pre_scale · q_h k_hᵀ) v_h`` per sample and head, keys past a sample's
  length contribute zero. q (T, H, D) packed with ``q_offsets`` (B+1,); k, v dense (B, Lkv, H, D)
  or packed (Tkv, H, D) with ``kv_offsets``. ``max_seq_len`` (static) switches to the padded
  formulation (B, max_seq_len, H, D), which is what the XLA path uses; without it every token
  gathers its sample's keys. The math of DESIGN.md op 3 (the oracle of
  :func:`pallas_norm.gdpa`).

  Args:
    q: (T, H, D) bfloat16/float16/float32/float64; k, v: q's dtype in the public op.
    q_offsets, kv_offsets: (B+1,) integer offsets (int32 in the public op) of the jagged
      convention (:mod:`pallas_norm.jagged`).
    activation: a key of :data:`ACTIVATIONS`. pre_scale, post_scale: real scalars.
    max_seq_len, max_kv_len: static padded lengths (max_kv_len default Tkv, with kv_offsets).
    out_dtype: output dtype (default q.dtype).

  Returns:
    (T, H, D) in ``out_dtype``, zeros on padding rows; accumulated in float32 (float64 for
    float64 inputs).

  Raises:
    TypeError: offsets that are not 1-D integer arrays (the :mod:`pallas_norm.jagged`
      helpers).
    ValueError: an activation that is not a key of :data:`ACTIVATIONS`; dense k that is not
      (B, Lkv, H, D) with B = len(q_offsets) - 1, or v not of k's shape; concrete offsets that
      break the jagged convention, or a sample longer than max_seq_len/max_kv_len
      (:func:`pallas_norm.jagged.to_padded`). Other shape mismatches fail in JAX's einsum.
  """
  o = _gdpa_acc(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale,
                max_seq_len, max_kv_len)
  return _zero_padding(o, q_offsets).astype(out_dtype or q.dtype)


def flash_norm_attention(q, k, v, q_offsets, kv_offsets=None, *, ln_scale=None, ln_bias=None,
                         rms_scale=None, activation="fast_gelu", pre_scale=1.0, post_scale=1.0,
                         eps=1e-6, max_seq_len=None, max_kv_len=None, out_dtype=None,
                         pre_layer_norm=True, inner_residual=True, outer_residual=True,
                         return_stats=False):
  """The Kunlun PFFN block (DESIGN.md, op 4), per token over all H·D features:

  ``u = LayerNorm(q)·ln_scale + ln_bias``; ``z = u + gdpa(u, k, v)``;
  ``out = RMSNorm(z)·rms_scale + q``. ln_scale, ln_bias, rms_scale have shape (H·D,).
  ``u`` is rounded to q's dtype before it feeds the attention products. The switches of Meta's
  megakernel (``fused_layernorm``, ``fused_q_residual_add``): ``pre_layer_norm=False`` makes
  ``u = q`` (ln_scale and ln_bias unused), ``inner_residual=False`` makes
  ``z = gdpa(u, k, v)``, ``outer_residual=False`` drops ``+ q``. The oracle of
  :func:`pallas_norm.flash_norm_attention`.

  Args:
    q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale, max_seq_len,
      max_kv_len: as :func:`gdpa`.
    ln_scale, ln_bias, rms_scale: optional (H·D,), any float dtype, applied in the
      statistics' dtype. eps: of both norms. out_dtype: default q.dtype.
    pre_layer_norm, inner_residual, outer_residual, return_stats: bools (above).

  Returns:
    (T, H, D) in ``out_dtype``, zeros on padding rows; with ``return_stats`` also
    ``(NormStats of LN or None, NormStats of RMS)``, each (T,) float32 (float64 for float64
    q), zeros on padding rows.

  Raises:
    TypeError, ValueError: as :func:`gdpa`.
  """
  def attention(u_in):
    return _gdpa_acc(u_in, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale,
                     max_seq_len, max_kv_len)

  return flash_norm_block(q, q_offsets, attention, ln_scale=ln_scale, ln_bias=ln_bias,
                          rms_scale=rms_scale, eps=eps, out_dtype=out_dtype,
                          pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
                          outer_residual=outer_residual, return_stats=return_stats)


def flash_norm_block(q, q_offsets, attention, *, ln_scale, ln_bias, rms_scale, eps, out_dtype,
                     pre_layer_norm, inner_residual, outer_residual, return_stats):
  """:func:`flash_norm_attention` around any ``attention(u_in) -> (T, H, D)`` (u_in: u rounded
  to q's dtype; the result is taken in the statistics dtype): the norms of the block, shared by
  the reference and the unfused kernel chain."""
  t, h, d = q.shape
  sdt = _stat_dtype(q.dtype)
  valid = jagged.valid_mask(q_offsets, t)
  qf = q.reshape(t, h * d).astype(sdt)
  qf = jnp.where(valid[:, None], qf, 0)  # padding rows: never data
  ln_stats = _row_stats(qf, "layer", eps) if pre_layer_norm else None
  u = _normalize(qf, ln_stats, ln_scale, ln_bias, False) if pre_layer_norm else qf
  attn = attention(u.astype(q.dtype).reshape(t, h, d)).reshape(t, h * d).astype(sdt)
  z = u + attn if inner_residual else attn
  rms_stats = _row_stats(z, "rms", eps)
  out = _normalize(z, rms_stats, rms_scale, None, False)
  if outer_residual:
    out = out + qf
  out = _zero_padding(out.reshape(t, h, d), q_offsets).astype(out_dtype or q.dtype)
  if not return_stats:
    return out
  zero_padding = lambda s: None if s is None else jnp.where(valid, s, 0)  # noqa: E731
  return out, tuple(None if s is None else NormStats(*map(zero_padding, s))
                    for s in (ln_stats, rms_stats))
