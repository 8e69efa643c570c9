"""The fused Kunlun PFFN block (DESIGN.md, op 4)::

    u   = LayerNorm_{H·D}(q)·ln_scale + ln_bias     (pre_layer_norm; else u = q)
    z   = u + gdpa(u, k, v)                          (inner_residual; else z = gdpa(u, k, v))
    out = RMSNorm_{H·D}(z)·rms_scale + q            (outer_residual; else without + q)

Both norms reduce over all heads of a token. Oracle:
:func:`pallas_norm.reference.flash_norm_attention`.

Kernel paths ("mosaic", "interpret"): the fused forward kernel (:mod:`.mosaic`: one CTA owns
every head of a q block) where it supports the call (dense K/V, H·D small enough for SMEM);
where that one does not fit, the cluster kernel (:mod:`.cluster`: a cluster of H CTAs, one
per head, H in 1, 2, 4, 8; the GDPA kernel's schedule with the norms' row sums exchanged
through distributed shared memory), each in
one ``custom_vjp`` whose forward also saves z and u, and whose backward is two one-pass row
kernels (:mod:`.norm_bwd`: the RMSNorm backward from z, and the LayerNorm backward, both
reading the saved statistics) around the GDPA backward kernel (which takes the saved u and
adds dz to its dq for the inner residual).
Elsewhere, where the GDPA kernel supports the call,
the unfused chain: the two norms in XLA around the GDPA kernel (:mod:`pallas_norm.ops.gdpa`).
Both round the attention output to q's dtype before the inner residual adds it (the XLA path
keeps it in float32). The one-CTA kernel adds it to u as the attention read it (in q's dtype)
and holds z in q's dtype (the z its backward reads); the cluster kernel and the chain add it
to the float32 u. Either is within the tests' 2e-2 relative error of the oracle by a wide
margin (about 3e-3 at the issue's shape on the H200).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax

import jax.numpy as jnp

from pallas_norm import _dispatch, _op, _validate, jagged, reference
from pallas_norm.ops.flash_norm_attention import cluster, mosaic, norm_bwd
from pallas_norm.ops.gdpa import api as gdpa_api
from pallas_norm.ops.gdpa import check_args as check_attention_args
from pallas_norm.ops.gdpa import mosaic as gdpa_mosaic
from pallas_norm.ops.gdpa import mosaic_bwd as gdpa_mosaic_bwd
from pallas_norm.ops.gdpa import (offsets_invalid, poison_if_offsets_invalid,
                                  poisoned_kernel_inputs)

_F32 = jnp.float32


def flash_norm_attention(q, k, v, q_offsets, kv_offsets=None, *, ln_scale=None, ln_bias=None,
                         rms_scale=None, activation: str = "fast_gelu", pre_scale: float = 1.0,
                         post_scale: float = 1.0, eps: float = 1e-6,
                         max_seq_len: int | None = None, max_kv_len: int | None = None,
                         out_dtype=None, pre_layer_norm: bool = True, inner_residual: bool = True,
                         outer_residual: bool = True, return_stats: bool = False,
                         implementation=None):
  """PFFN block: LayerNorm → GDPA with inner residual → RMSNorm with outer residual.

  ``u = LayerNorm_{H·D}(q)·ln_scale + ln_bias``, ``z = u + gdpa(u, k, v)``,
  ``out = RMSNorm_{H·D}(z)·rms_scale + q``, both norms per token over all heads: the values of
  :func:`pallas_norm.reference.flash_norm_attention`. The block is DESIGN.md op 4, the
  personalized FFN of Meta's Kunlun ads models ("Where the Kunlun PFFN comes from") as the
  megakernel of Meta's ads_model_kernel_library fuses it.

  Args:
    q: (T, H, D) packed sequence tokens, bfloat16/float16/float32/float64 (the fused kernels:
      bfloat16; float16 on the cluster kernel and the chain); k, v, q_offsets, kv_offsets,
      activation, pre_scale, post_scale, max_seq_len, max_kv_len: as :func:`pallas_norm.gdpa`.
    ln_scale, ln_bias: optional (H·D,) affine of the LayerNorm (only with pre_layer_norm),
      bfloat16/float16/float32/float64 (applied in float32, float64 for float64 q).
    rms_scale: optional (H·D,) gamma of the RMSNorm, the same.
    eps: positive float for both norms (default 1e-6), static (a Python or NumPy scalar, not a
      traced value), at least float32's max^(-2/3) (~2.1e-26).
    out_dtype: dtype of out (default q.dtype).
    pre_layer_norm: LayerNorm q first (default); False: ``u = q``.
    inner_residual: ``z = u + gdpa(u, k, v)`` (default); False: ``z = gdpa(u, k, v)``.
    outer_residual: add q to the output (default).
      (The switches of Meta's megakernel: ``out = RMSNorm(gdpa(q, k, v))`` is
      ``pre_layer_norm=False, inner_residual=False, outer_residual=False``.)
    return_stats: also return ``(ln_stats, rms_stats)`` (:class:`pallas_norm.NormStats`, (T,)
      float32 (float64 for float64 q), zeros on padding rows; ln_stats is None without the
      LayerNorm), which carry no gradient (``lax.stop_gradient``).
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`). The kernel names run the fused
      kernel where it supports the call (:func:`mosaic.unsupported_reason`), else the norms in
      XLA around the GDPA kernel; None picks the fused kernel on Hopper where it was measured
      faster (:func:`fused_slower_reason`), else the chain where :func:`pallas_norm.gdpa` would
      pick its kernel, else XLA.

  Returns:
    out (T, H, D) in ``out_dtype`` (default q.dtype), zeros on padding rows; or
    ``(out, (ln_stats, rms_stats))`` with ``return_stats``.

  Raises:
    TypeError, ValueError, RuntimeError, NotImplementedError: as :func:`pallas_norm.gdpa`.
      Plus TypeError for an eps that is not a real number, a switch or return_stats that is
      not a bool, or a non-array or non-float affine; ValueError for an eps that is not
      positive and finite (or below the floor above), H·D = 0, an affine not of shape (H·D,),
      and ln_scale/ln_bias given with ``pre_layer_norm=False``.

  Non-finite values: a non-finite q, k or v token of one sample makes that sample's output
  non-finite. On the kernel paths the gradients may also carry it to other samples: the
  sample's dz (the GDPA backward's dO) is then NaN, which reaches dk/dv of the kv tiles its
  q blocks meet (:mod:`pallas_norm.ops.gdpa.mosaic_bwd`: dense K/V, the neighbouring samples
  whose q blocks overlap its rows; packed K/V, every row of the shared 128-row tiles) and,
  with Python-float scales, the dq rows of its 64-row q blocks (dz enters dq through the
  tensor cores), always as NaN, never as a wrong finite value. The XLA path keeps it inside
  the sample.
  """
  (q, k, v, q_offsets, kv_offsets, ln_scale, ln_bias, rms_scale, pre_scale,
   post_scale) = _validate.as_arrays(q, k, v, q_offsets, kv_offsets, ln_scale, ln_bias,
                                     rms_scale, pre_scale, post_scale)
  check_attention_args(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale,
                       max_seq_len, max_kv_len, out_dtype)
  pre_scale, post_scale = _validate.scale_value(pre_scale), _validate.scale_value(post_scale)
  max_seq_len, max_kv_len = gdpa_api.bounds_within_capacity(q, k, kv_offsets, max_seq_len,
                                                            max_kv_len)
  features = q.shape[1] * q.shape[2]  # > 0: check_attention_args refuses H = 0 and D = 0
  _validate.optional_vector("ln_scale", ln_scale, features)
  _validate.optional_vector("ln_bias", ln_bias, features)
  _validate.optional_vector("rms_scale", rms_scale, features)
  eps = _validate.eps(eps, q.dtype)
  for name, value in (("pre_layer_norm", pre_layer_norm), ("inner_residual", inner_residual),
                      ("outer_residual", outer_residual), ("return_stats", return_stats)):
    _validate.flag(name, value)
  if not pre_layer_norm and (ln_scale is not None or ln_bias is not None):
    raise ValueError("ln_scale and ln_bias apply only with pre_layer_norm=True")
  q, k, v, q_offsets, kv_offsets, ln_scale, ln_bias, rms_scale = _validate.to_jax(
      q, k, v, q_offsets, kv_offsets, ln_scale, ln_bias, rms_scale)

  def fused_reason(candidate):
    return (_forward_kernel(q, k, kv_offsets, out_dtype, candidate == "interpret")[1]
            or norm_bwd.unsupported_reason(q.shape))

  # The GDPA kernel's tiling for the chain, or why it cannot run: asked once, then handed down.
  gdpa_tiling = functools.cache(
      lambda: gdpa_mosaic.tiling_or_reason(q, k, kv_offsets, max_kv_len, None))
  impl = _dispatch.choose(
      "flash_norm_attention", implementation,
      unsupported_reason=lambda candidate: fused_reason(candidate) and gdpa_tiling()[1],
      slower_reason=lambda: (fused_reason("mosaic")
                             or fused_slower_reason(q, k, kv_offsets, out_dtype)) and (
          gdpa_api.kernel_slower_reason(q, k, kv_offsets, max_kv_len, None)))
  fused = impl != "xla" and fused_reason(impl) is None and (
      implementation is not None or fused_slower_reason(q, k, kv_offsets, out_dtype) is None)
  if fused:  # poisons bad traced offsets itself (NaN scales), with no pass over the data
    out = _fused_block(q, k, v, q_offsets, ln_scale=ln_scale, ln_bias=ln_bias,
                       rms_scale=rms_scale, activation=activation, pre_scale=pre_scale,
                       post_scale=post_scale, eps=eps, max_seq_len=max_seq_len,
                       out_dtype=out_dtype, pre_layer_norm=pre_layer_norm,
                       inner_residual=inner_residual, outer_residual=outer_residual,
                       return_stats=return_stats, interpret=impl == "interpret",
                       forward=_forward_kernel(q, k, kv_offsets, out_dtype,
                                               impl == "interpret")[0])
    return out if not return_stats else (out[0], jax.tree.map(lax.stop_gradient, out[1]))
  block = reference.flash_norm_attention if impl == "xla" else functools.partial(
      _gdpa_kernel_chain, gdpa_implementation=impl, gdpa_config=gdpa_tiling()[0])
  q, k, v, ln_scale, ln_bias, rms_scale = gdpa_api.poison_inputs_if_offsets_invalid(
      (q, k, v, ln_scale, ln_bias, rms_scale), q_offsets, kv_offsets, q.shape[0], k.shape[0],
      max_seq_len, max_kv_len)
  out = block(q, k, v, q_offsets, kv_offsets, ln_scale=ln_scale, ln_bias=ln_bias,
              rms_scale=rms_scale, activation=activation, pre_scale=pre_scale,
              post_scale=post_scale, eps=eps, max_seq_len=max_seq_len, max_kv_len=max_kv_len,
              out_dtype=out_dtype, pre_layer_norm=pre_layer_norm, inner_residual=inner_residual,
              outer_residual=outer_residual, return_stats=return_stats)
  if return_stats:  # outputs, not a differentiable path, as in every op that returns them
    out = (out[0], jax.tree.map(lax.stop_gradient, out[1]))
  # Traced offsets that break the jagged convention give NaN, never a silent wrong answer.
  return poison_if_offsets_invalid(out, q_offsets, kv_offsets, q.shape[0], k.shape[0],
                                   max_seq_len, max_kv_len)


FORWARD_KERNELS = {"mosaic": mosaic, "cluster": cluster}
"""The fused forward kernels by name; both take the same arguments and save the same residuals
for the backward."""


def _forward_kernel(q, k, kv_offsets, out_dtype, interpret: bool):
  """``(name, None)``: the fused forward kernel of :data:`FORWARD_KERNELS` for this call,
  "mosaic" (one CTA per q block) where it fits, else "cluster" (a cluster of H CTAs, for larger
  H·D; interpret mode runs it at H = 1 only). ``(None, why)`` when neither can. Where both
  fit, the one-CTA kernel: at H = 4 (issue shape) the cluster kernel measured 1.7× slower
  (benchmarks/NOTES.md, "flash_norm_attention")."""
  reason = mosaic.unsupported_reason(q, k, kv_offsets, out_dtype)
  if reason is None:
    return "mosaic", None
  cluster_reason = cluster.unsupported_reason(q, k, kv_offsets, out_dtype, interpret=interpret)
  if cluster_reason is None:
    return "cluster", None
  return None, f"{reason}; the cluster kernel: {cluster_reason}"


FUSED_DEFAULT_DOMAIN = dict(dtypes=(jnp.dtype(jnp.bfloat16),), head_dims=(128,),
                            features=(256, 512, 1024), max_kv_len=128)
"""Where ``implementation=None`` takes the fused kernel: what the H200 measured faster than the
unfused chain, forward and forward+backward (benchmarks/NOTES.md, "flash_norm_attention"):
bf16 q, H·D = 256 or 512 (H = 2 or 4, D = 128: the one-CTA kernel) or 1024 (H = 8, D = 128:
the cluster kernel, the only one that fits there), dense K/V of at most 128 keys."""


def fused_slower_reason(q, k, kv_offsets, out_dtype) -> str | None:
  """Why ``implementation=None`` does not pick the fused kernel for a call it supports (None:
  it does): outside :data:`FUSED_DEFAULT_DOMAIN` or off Hopper, the chain was not measured
  slower."""
  d = FUSED_DEFAULT_DOMAIN
  features = q.shape[1] * q.shape[2]
  if not _dispatch.on_hopper_gpu():
    return "the fused kernel was measured only on a Hopper GPU (H200)"
  if (jnp.dtype(q.dtype) not in d["dtypes"] or jnp.dtype(out_dtype or q.dtype) != q.dtype
      or q.shape[2] not in d["head_dims"] or features not in d["features"]
      or k.shape[1] > d["max_kv_len"]):
    return (f"the fused kernel was measured faster than the chain only for bf16 q and output, "
            f"D in {d['head_dims']}, H·D in {d['features']} and Lkv <= {d['max_kv_len']}; got "
            f"{jnp.dtype(q.dtype)}, D = {q.shape[2]}, H·D = {features}, Lkv = {k.shape[1]}; "
            f"pass implementation='mosaic' to force it")
  return None


def _gdpa_kernel_chain(q, k, v, q_offsets, kv_offsets, *, activation, pre_scale, post_scale,
                       max_seq_len, max_kv_len, gdpa_implementation, gdpa_config,
                       **block_options):
  """:func:`pallas_norm.reference.flash_norm_attention` with its attention through the GDPA
  kernel (``gdpa_implementation``: "mosaic" or "interpret"; ``gdpa_config``: its tiling, as
  the dispatch found it); same arguments and outputs."""
  def attention(u_in):
    return gdpa_api.kernel_path(u_in, k, v, q_offsets, kv_offsets, activation=activation,
                                pre_scale=pre_scale, post_scale=post_scale,
                                max_seq_len=max_seq_len, max_kv_len=max_kv_len, out_dtype=None,
                                implementation=gdpa_implementation, config=gdpa_config,
                                op="flash_norm_attention")

  return reference.flash_norm_block(q, q_offsets, attention, **block_options)


# ------------------------------------------------------------------------------------------------
# The fused kernel path: one custom_vjp, forward and backward rules side by side.

def _fused_block(q, k, v, q_offsets, *, ln_scale, ln_bias, rms_scale, activation, pre_scale,
                 post_scale, eps, max_seq_len, out_dtype, pre_layer_norm, inner_residual,
                 outer_residual, return_stats, interpret, forward):
  """The block by the fused kernel (dense K/V); the op's outputs.

  Traced offsets that break the jagged convention are answered as the GDPA kernel path does
  (:func:`pallas_norm.ops.gdpa.api.poisoned_kernel_inputs`): NaN scales, all rows padding in
  the forward (the kernel writes them as 0 · post_scale = NaN), and a checkify error. The
  backward runs on the same (all-empty) offsets: the GDPA backward writes every row of du, dk
  and dv as 0 · the scales = NaN, and the norm weights' gradients get 0 · post_scale added
  (NaN), so no second set of offsets is made."""
  scale_grads = not all(isinstance(s, (int, float)) for s in (pre_scale, post_scale))
  pre_scale, post_scale = jnp.asarray(pre_scale, _F32), jnp.asarray(post_scale, _F32)
  bad = offsets_invalid(q_offsets, None, q.shape[0], k.shape[0], max_seq_len, None)
  if bad is not None:
    q_offsets, pre_scale, post_scale = poisoned_kernel_inputs(bad, q_offsets, pre_scale,
                                                              post_scale)
  heads, head_dim = q.shape[1:]
  ones, zeros = jnp.ones((heads * head_dim,), _F32), jnp.zeros((heads * head_dim,), _F32)
  affine = tuple(jnp.asarray(a, _F32) if a is not None else default
                 for a, default in ((ln_scale, ones), (ln_bias, zeros), (rms_scale, ones)))
  static = _Static(activation=activation, eps=eps, pre_layer_norm=pre_layer_norm,
                   inner_residual=inner_residual, outer_residual=outer_residual,
                   out_dtype=jnp.dtype(out_dtype or q.dtype), interpret=interpret,
                   scale_grads=scale_grads, forward=forward, return_stats=return_stats)
  out, stats = _fused(q, k, v, q_offsets, affine, pre_scale, post_scale, static)
  if not return_stats:
    return out
  ln_stats = reference.NormStats(stats[:, 0], stats[:, 1]) if pre_layer_norm else None
  return out, (ln_stats, reference.NormStats(None, stats[:, 2]))


@dataclasses.dataclass(frozen=True)
class _Static:
  """The fused path's static options (hashable: a nondiff argument of the custom_vjp)."""

  activation: str
  eps: float
  pre_layer_norm: bool
  inner_residual: bool
  outer_residual: bool
  out_dtype: jnp.dtype
  interpret: bool
  scale_grads: bool
  forward: str  # a key of FORWARD_KERNELS
  return_stats: bool  # the primal's statistics (the backward's are always saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(q, k, v, q_offsets, affine, pre_scale, post_scale, static):
  out, stats = _fused_forward(q, k, v, q_offsets, affine, pre_scale, post_scale, static, False)
  return out, _primal_stats(stats, static)


def _primal_stats(stats, static):
  """The op's statistics output: the kernel's first 3 columns, or None where the op does not
  return them (the forward kernel then skips writing them)."""
  return stats[:, :3] if static.return_stats else None


def _fused_forward(q, k, v, q_offsets, affine, pre_scale, post_scale, static,
                   save_residuals):
  heads, head_dim = q.shape[1:]
  forward = functools.partial(
      FORWARD_KERNELS[static.forward].flash_norm_attention_fwd, activation=static.activation,
      eps=static.eps,
      pre_layer_norm=static.pre_layer_norm, inner_residual=static.inner_residual,
      outer_residual=static.outer_residual, out_dtype=static.out_dtype,
      save_residuals=save_residuals, return_stats=static.return_stats,
      interpret=static.interpret)
  return _op.first_order_only("flash_norm_attention", forward, q, k, v, q_offsets,
                              jnp.stack(affine).reshape(3, heads, head_dim), pre_scale,
                              post_scale)


def _fused_fwd_rule(q, k, v, q_offsets, affine, pre_scale, post_scale, static):
  out, stats, z, u = _fused_forward(q, k, v, q_offsets, affine, pre_scale, post_scale, static,
                                    True)
  # The backward reads the statistics' columns in place from the kernel's (T, 32) array.
  return ((out, _primal_stats(stats, static)),
          (q, k, v, q_offsets, affine, pre_scale, post_scale, stats, z, u))


def _fused_bwd_rule(static, saved, cotangents):
  """The block's backward: the RMSNorm backward (one pass over dout and the saved z,
  :func:`norm_bwd.rms_backward`), the GDPA backward kernel on the saved u (q without the
  LayerNorm), whose dq is du (dz added inside it for the inner residual), then the LayerNorm
  backward (one pass, :func:`norm_bwd.ln_backward`). The
  per-token row sums over H·D (the cross-head reductions) are register reductions over full
  rows; the weight gradients are float32 column sums (deterministic)."""
  q, k, v, q_offsets, (ln_scale, ln_bias, rms_scale), pre_scale, post_scale, stats, z, u = saved
  d_out = cotangents[0]  # the statistics carry no gradient (the op stops it)
  t, heads, head_dim = q.shape
  rows = lambda a: a.reshape(t, heads * head_dim)  # noqa: E731
  end = q_offsets[-1]  # the row kernels clip it to [0, T]
  # Padding rows of dq are zero, or NaN where bad traced offsets poisoned the scales (then every
  # row is padding): the GDPA backward's 0 · pre · post, which the LayerNorm backward leaves in
  # place (it writes dq over du, rows below end only); without the LayerNorm, 0 · post_scale.
  # The norm weights' gradients get it added too: NaN under the poison (their sums then run
  # over no rows), else ± 0 (XLA folds the add into the partial sums' reduction).
  pad = 0 * post_scale
  # Each kernel call goes through _op.first_order_only (no second derivative).
  dz, d_rms_scale = _op.first_order_only(
      "flash_norm_attention", functools.partial(norm_bwd.rms_backward,
                                                interpret=static.interpret),
      rows(d_out), rows(z), stats, rms_scale, end)
  du, dk, dv, d_pre, d_post = gdpa_mosaic_bwd.gdpa_bwd(
      q if u is None else u, k, v, q_offsets, None, dz.reshape(q.shape),
      activation=static.activation, pre_scale=pre_scale, post_scale=post_scale,
      interpret=static.interpret, scale_grads=static.scale_grads,
      add_do_to_dq=static.inner_residual)
  if static.pre_layer_norm:
    dq, d_ln_scale, d_ln_bias = _op.first_order_only(
        "flash_norm_attention", functools.partial(
            norm_bwd.ln_backward, outer_residual=static.outer_residual,
            interpret=static.interpret),
        rows(du), rows(d_out), rows(q), stats, ln_scale, end)
  else:  # u = q: dq is du plus the outer branch, one elementwise pass
    d_ln_scale = d_ln_bias = jnp.zeros_like(ln_scale)
    dq = rows(du).astype(_F32)
    if static.outer_residual:
      dq = dq + rows(d_out).astype(_F32)
    valid = jagged.valid_mask(q_offsets, t)[:, None]
    dq = jnp.where(valid, dq, pad)
  dq = dq.reshape(q.shape).astype(q.dtype)
  if d_pre is None:  # numbers given by the caller: constants, cotangents dropped
    d_pre, d_post = jnp.zeros_like(pre_scale), jnp.zeros_like(post_scale)
  d_affine = tuple(g + pad for g in (d_ln_scale, d_ln_bias, d_rms_scale))
  return (dq, dk, dv, None, d_affine, d_pre, d_post)


_fused.defvjp(_fused_fwd_rule, _fused_bwd_rule)
