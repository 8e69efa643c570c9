"""Generalized dot-product attention over jagged queries (DESIGN.md, op 3; Meta's GDPA).

``o_h = post_scale · act(pre_scale · q_h k_hᵀ) v_h`` per sample and head, with no softmax and no
row normalization; keys past a sample's length contribute exactly zero. Jagged layout:
:mod:`pallas_norm.jagged`. Oracle: :func:`pallas_norm.reference.gdpa`.

The call validates its arguments once (:func:`check_args`), chooses the implementation once
(:func:`pallas_norm._dispatch.choose`), then runs either the XLA path (:mod:`.xla`, differentiated
by JAX) or the kernel path: one ``jax.custom_vjp`` whose forward rule is the Hopper kernel
(:mod:`.mosaic`) and whose backward rule sits beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from pallas_norm import _dispatch, _op, _validate, reference
from pallas_norm.ops.gdpa import mosaic, mosaic_bwd, xla

_F32 = jnp.float32


def check_args(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale, max_seq_len,
               max_kv_len, out_dtype) -> None:
  """Validates the attention arguments shared by :func:`gdpa` and ``flash_norm_attention``."""
  _validate.float_array("q", q, ndim=3)
  t, h, d = q.shape
  if h == 0:  # as an empty feature axis (D = 0) raises: no heads is no attention to compute
    raise ValueError(f"q has no heads: H = 0 (shape {tuple(q.shape)})")
  if kv_offsets is not None and not _validate.is_array(kv_offsets):
    # Checked before k's rank, which kv_offsets decides: gdpa(q, k, v, off, 8) (max_seq_len
    # passed by position) would otherwise be reported as a 4-D k that should be 3-D.
    raise TypeError(f"kv_offsets must be an int32 array of shape (B+1,) or None, got "
                    f"{type(kv_offsets).__name__} (the arguments after kv_offsets are "
                    "keyword-only)")
  ndim = 4 if kv_offsets is None else 3
  for name, a in (("k", k), ("v", v)):
    _validate.float_array(name, a)
    if a.ndim != ndim:  # kv_offsets decides the form: say so, not just the rank expected
      form = ("dense (B, Lkv, H, D) without kv_offsets; packed (Tkv, H, D) k/v need "
              "kv_offsets" if kv_offsets is None else
              "packed (Tkv, H, D) with kv_offsets; dense (B, Lkv, H, D) k/v take "
              "kv_offsets=None")
      raise ValueError(f"{name} must have {ndim} dimensions, {form}; got shape "
                       f"{tuple(a.shape)}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                     f"{tuple(v.shape)}")
  if tuple(k.shape[-2:]) != (h, d):
    raise ValueError(f"k and v must end in (H, D) = {(h, d)} like q, got {tuple(k.shape)}")
  # As JAX sees them: a traced float32 q (the gradient or jit of an eager call with NumPy
  # float64 q, k, v, which was accepted) or a jnp float32 q goes with NumPy float64 k, v.
  if not _validate.same_jax_dtype(q, k, v):
    raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  _validate.static_positive_int("max_seq_len", max_seq_len)
  _validate.static_positive_int("max_kv_len", max_kv_len)
  batch = _validate.offsets("q_offsets", q_offsets, t, max_len=max_seq_len)
  if kv_offsets is None:
    if k.shape[0] != batch:
      raise ValueError(f"dense k/v must have batch size B = len(q_offsets) - 1 = {batch}, "
                       f"got {k.shape[0]}")
    if max_kv_len is not None:
      raise ValueError("max_kv_len applies only to jagged k/v (with kv_offsets)")
  else:
    kv_batch = _validate.offsets("kv_offsets", kv_offsets, k.shape[0], max_len=max_kv_len,
                                 max_len_name="max_kv_len")
    if kv_batch != batch:
      raise ValueError(f"kv_offsets must describe B = {batch} samples like q_offsets, "
                       f"got {kv_batch}")
  _validate.activation(activation, reference.ACTIVATIONS)
  _validate.finite_scalar("pre_scale", pre_scale, q.dtype)
  _validate.finite_scalar("post_scale", post_scale, q.dtype)
  _validate.out_dtype(out_dtype)


def gdpa(q, k, v, q_offsets, kv_offsets=None, *, activation: str = "fast_gelu",
         pre_scale: float = 1.0, post_scale: float = 1.0, max_seq_len: int | None = None,
         max_kv_len: int | None = None, out_dtype=None, implementation=None):
  """Jagged generalized dot-product attention.

  ``o_h = post_scale · act(pre_scale · q_h k_hᵀ) v_h`` per sample and head, no softmax and no
  row normalization: the values of :func:`pallas_norm.reference.gdpa`. The op is DESIGN.md
  op 3: the personalized FFN of Meta's Kunlun ads models written as attention (DESIGN.md,
  "Where the Kunlun PFFN comes from"), as Meta's Triton GDPA kernel computes it.

  Args:
    q: (T, H, D) packed query tokens, bfloat16/float16/float32/float64 (the kernels: bfloat16
      or float16); T is a static capacity.
    k, v: dense (B, Lkv, H, D), or packed (Tkv, H, D) with ``kv_offsets``; q's dtype as JAX
      sees it (without jax_enable_x64 a NumPy float64 array is float32).
    q_offsets: int32 (B+1,), B >= 1, jagged offsets of q (first 0, non-decreasing, last <= T);
      int32 as JAX sees it: without jax_enable_x64 a NumPy int64 array is int32, eagerly as
      under ``jax.jit``.
    kv_offsets: optional int32 (B+1,) offsets of packed k/v, the same.
    activation: "fast_gelu" (tanh GELU, default), "gelu", "silu", "relu", "relu2",
      "leaky_relu" (slope 0.01) or "identity".
    pre_scale, post_scale: finite real scalars (default 1): numbers or 0-d integer/floating
      arrays, traced ones included (an array of another shape would broadcast, so it raises).
      A concrete integer (Python or NumPy) computes as its float, whatever its size.
    max_seq_len: static bound on q lengths; makes the XLA path use a padded (B, max_seq_len)
      layout (fast). Without it the XLA path gathers K/V per token (O(T·Lkv·H·D) memory). A
      bound past T acts as T (no sample can be longer).
    max_kv_len: static bound on jagged k/v lengths (default Tkv; a bound past Tkv acts as Tkv).
    out_dtype: output dtype (default q.dtype).
    implementation: None, "xla", "mosaic", "interpret" or a sequence of them (the first that
      can run the call; see :mod:`pallas_norm._dispatch`).

  Returns:
    (T, H, D) in ``out_dtype`` (default q.dtype); padding rows (>= q_offsets[-1]) are zeros.

  Offsets that are traced (under ``jax.jit``/``vmap``) cannot raise: if they break the jagged
  convention (first != 0, decreasing, last > T, a length over max_seq_len/max_kv_len) the whole
  output is NaN rather than silently wrong (under :func:`pallas_norm.sharding.shard_rows`, the
  whole output of that shard). In float16, scores or outputs past 65504 overflow to inf/NaN on
  every path.

  Raises:
    TypeError: dtypes (q, k, v not one float dtype, offsets not int32, an out_dtype that is
      not a floating dtype or float64 without jax_enable_x64); a non-array q, k, v or
      offsets; a pre_scale or post_scale that is not a real scalar (also under ``jax.jit``: a
      traced scale must be 0-d, integer or floating); a max_seq_len or max_kv_len that is not
      a static integer (a Python or NumPy int; not a bool or an array).
    ValueError: shapes (H = 0 or D = 0 included; dense k/v whose batch is not B), offsets
      (when concrete), activation, concrete scales that are not finite (in float32, what every
      path computes them in, unless q is float64), lengths over max_seq_len/max_kv_len, a
      max_seq_len or max_kv_len below 1, a max_kv_len without kv_offsets, unknown
      implementation.
    RuntimeError: ``implementation="interpret"`` alone, for a call the kernel supports, on a CPU
      backend with fewer than 8 client threads (``PJRT_NPROC``; GPU interpret mode would
      deadlock, :func:`pallas_norm._dispatch.interpret_threads_reason`); in a sequence that
      name is skipped with a :class:`pallas_norm.KernelSkippedWarning` instead.
    NotImplementedError: kernel implementation not available; a second derivative
      (``jax.hessian``, a gradient of a gradient) of a kernel path. Forward mode (``jax.jvp``,
      ``jax.jacfwd``) of a kernel path raises JAX's own TypeError "can't apply forward-mode
      autodiff (jvp) to a custom_vjp function": pass ``implementation="xla"``.
  """
  q, k, v, q_offsets, kv_offsets, pre_scale, post_scale = _validate.as_arrays(
      q, k, v, q_offsets, kv_offsets, pre_scale, post_scale)
  check_args(q, k, v, q_offsets, kv_offsets, activation, pre_scale, post_scale, max_seq_len,
             max_kv_len, out_dtype)
  pre_scale, post_scale = _validate.scale_value(pre_scale), _validate.scale_value(post_scale)
  q, k, v, q_offsets, kv_offsets = _validate.to_jax(q, k, v, q_offsets, kv_offsets)
  max_seq_len, max_kv_len = bounds_within_capacity(q, k, kv_offsets, max_seq_len, max_kv_len)
  # The kernel's tiling, or why it cannot run the call: asked once, for the dispatch, and the
  # tiling handed down to the kernel.
  tiling = functools.cache(
      lambda: mosaic.tiling_or_reason(q, k, kv_offsets, max_kv_len, out_dtype))
  impl = _dispatch.choose(
      "gdpa", implementation, unsupported_reason=lambda _: tiling()[1],
      slower_reason=lambda: kernel_slower_reason(q, k, kv_offsets, max_kv_len, out_dtype))
  if impl == "xla":
    q, k, v, pre_scale, post_scale = poison_inputs_if_offsets_invalid(
        (q, k, v, pre_scale, post_scale), q_offsets, kv_offsets, q.shape[0], k.shape[0],
        max_seq_len, max_kv_len)
    out = xla.gdpa(q, k, v, q_offsets, kv_offsets, pre_scale, post_scale, activation=activation,
                   max_seq_len=max_seq_len, max_kv_len=max_kv_len, out_dtype=out_dtype)
    return poison_if_offsets_invalid(out, q_offsets, kv_offsets, q.shape[0], k.shape[0],
                                     max_seq_len, max_kv_len)
  return kernel_path(q, k, v, q_offsets, kv_offsets, activation=activation,
                     pre_scale=pre_scale, post_scale=post_scale, max_seq_len=max_seq_len,
                     max_kv_len=max_kv_len, out_dtype=out_dtype, implementation=impl,
                     config=tiling()[0])


def bounds_within_capacity(q, k, kv_offsets, max_seq_len, max_kv_len):
  """The validated ``max_seq_len`` and ``max_kv_len`` capped at the packed capacities of q and
  (jagged) k/v (:func:`pallas_norm._validate.within_capacity`)."""
  return (_validate.within_capacity(max_seq_len, q.shape[0]),
          None if kv_offsets is None else _validate.within_capacity(max_kv_len, k.shape[0]))


def kernel_path(q, k, v, q_offsets, kv_offsets, *, activation, pre_scale, post_scale,
                max_seq_len, max_kv_len, out_dtype, implementation, config, op="gdpa"):
  """:func:`gdpa` after validation and the choice of a kernel implementation ("mosaic" or
  "interpret"): bad traced offsets poisoned, then the kernels' ``custom_vjp``. For callers that
  validated and chose already (``flash_norm_attention``'s chain). ``config``: the forward
  kernel's tiling, :func:`mosaic.tiling_or_reason`'s for these arguments. ``op``: the public op
  that a second derivative's NotImplementedError names (the caller's)."""
  scale_grads = not all(isinstance(s, (int, float)) for s in (pre_scale, post_scale))
  pre_scale, post_scale = jnp.asarray(pre_scale, _F32), jnp.asarray(post_scale, _F32)
  bad = offsets_invalid(q_offsets, kv_offsets, q.shape[0], k.shape[0], max_seq_len, max_kv_len)
  if bad is not None:
    q_offsets, pre_scale, post_scale = poisoned_kernel_inputs(bad, q_offsets, pre_scale,
                                                              post_scale)
  return _kernel_gdpa(q, k, v, pre_scale, post_scale, (q_offsets, kv_offsets), activation,
                      max_seq_len, max_kv_len, jnp.dtype(out_dtype or q.dtype),
                      implementation == "interpret", scale_grads, config, op)


def poisoned_kernel_inputs(bad, q_offsets, pre_scale, post_scale):
  """(q_offsets, pre_scale, post_scale) as the kernel path takes them where ``bad`` (a traced
  bool, :func:`offsets_invalid`): its answer to traced offsets that break the jagged convention,
  with no pass over the output: NaN scales and all-empty samples (q offsets all 0), for the
  forward and the backward alike (``flash_norm_attention``'s fused kernel answers so too).
  The kernels then write every row as padding, 0 · scale = NaN: the output, dq
  (0 · pre · post) and dk, dv (a zero accumulator times the scales), and the scale gradients
  are made NaN by the backward rule. With every q sample empty no kernel reads a key
  by the (unchecked) kv offsets. Also a checkify error (``jax.experimental.checkify``)."""
  checkify.debug_check(jnp.logical_not(bad), OFFSETS_INVALID_MESSAGE)
  # A product, not a select: a select's derivative sends the caller's traced scale a zero
  # cotangent, so its gradient came back 0 instead of NaN.
  poison = jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(1))
  return (jnp.where(bad, jnp.zeros_like(q_offsets), q_offsets), pre_scale * poison,
          post_scale * poison)


def kernel_slower_reason(q, k, kv_offsets, max_kv_len, out_dtype) -> str | None:
  """Why XLA is the default for a call the kernel supports (None: the kernel is). None for
  every such call: the H200 suite measured the kernels faster than XLA through the op, forward
  and forward+backward, at every GDPA case it ran, K/V streamed per q block (too long for SMEM)
  included (``benchmarks/results``, the GDPA rows; ``benchmarks/NOTES.md``). Kept as the
  dispatch's hook (``flash_norm_attention``'s unfused chain asks it too) for a shape measured
  slower later.
  """
  del q, k, kv_offsets, max_kv_len, out_dtype
  return None


# ------------------------------------------------------------------------------------------------
# The kernel path: one custom_vjp, forward and backward rules side by side. The scales are f32
# 0-d arrays (traced ones get gradients); the offsets are integer inputs (no cotangent).

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12, 13))
def _kernel_gdpa(q, k, v, pre_scale, post_scale, offsets, activation, max_seq_len, max_kv_len,
                 out_dtype, interpret, scale_grads, config, op):
  return _kernel_fwd_rule(q, k, v, pre_scale, post_scale, offsets, activation, max_seq_len,
                          max_kv_len, out_dtype, interpret, scale_grads, config, op)[0]


def _kernel_fwd_rule(q, k, v, pre_scale, post_scale, offsets, activation, max_seq_len,
                     max_kv_len, out_dtype, interpret, scale_grads, config, op):
  del max_seq_len, scale_grads  # the kernel's work list comes from the offsets themselves
  q_offsets, kv_offsets = offsets
  rows = mosaic.kv_rows(k, kv_offsets, max_kv_len)
  # Built once: the backward reads its dense tile order from it (no second sort).
  table = mosaic.work_items(q_offsets, kv_offsets, q.shape[0], k.shape[0], rows)

  def forward(q, k, v, q_offsets, kv_offsets, pre_scale, post_scale, table):
    return mosaic.gdpa_fwd(q, k, v, q_offsets, kv_offsets, pre_scale, post_scale,
                           activation=activation, max_kv_len=max_kv_len, out_dtype=out_dtype,
                           config=config, work_table=table, interpret=interpret)

  out = _op.first_order_only(op, forward, q, k, v, q_offsets, kv_offsets, pre_scale,
                             post_scale, table)
  return out, (q, k, v, pre_scale, post_scale, offsets, table)


def _kernel_bwd_rule(activation, max_seq_len, max_kv_len, out_dtype, interpret, scale_grads,
                     config, op, saved, d_out):
  del out_dtype, config  # the backward kernel's tiles are its own constants
  q, k, v, pre_scale, post_scale, offsets, table = saved
  q_offsets, kv_offsets = offsets
  kw = dict(activation=activation, pre_scale=pre_scale, post_scale=post_scale,
            max_seq_len=max_seq_len, max_kv_len=max_kv_len, interpret=interpret)
  if mosaic_bwd.unsupported_reason(q, k, v, kv_offsets, max_seq_len, max_kv_len) is None:
    def backward(q, k, v, q_offsets, kv_offsets, d_out, table):
      grads = mosaic_bwd.gdpa_bwd(q, k, v, q_offsets, kv_offsets, d_out,
                                  scale_grads=scale_grads, work_table=table, **kw)
      if grads[3] is None:  # numbers given by the caller: constants, cotangents dropped
        grads = (*grads[:3], jnp.zeros_like(pre_scale), jnp.zeros_like(post_scale))
      return grads
    dq, dk, dv, d_pre, d_post = _op.first_order_only(op, backward, q, k, v, q_offsets,
                                                     kv_offsets, d_out, table)
  else:  # shapes the backward kernel refuses (none that the forward kernel takes today)
    dq, dk, dv, d_pre, d_post = _xla_backward(q, k, v, q_offsets, kv_offsets, d_out, **kw)
    # Poisoned offsets are all-empty samples here, whose masks would give zeros: NaN instead.
    poisoned = jnp.isnan(pre_scale * post_scale)
    dq, dk, dv = (jnp.where(poisoned, jnp.nan, g).astype(g.dtype) for g in (dq, dk, dv))
  # Scales poisoned for bad traced offsets (NaN) give NaN scale gradients, whatever was masked.
  d_pre = jnp.where(jnp.isnan(pre_scale), pre_scale, d_pre)
  d_post = jnp.where(jnp.isnan(post_scale), post_scale, d_post)
  return dq, dk, dv, d_pre, d_post, None


_kernel_gdpa.defvjp(_kernel_fwd_rule, _kernel_bwd_rule)


def _xla_backward(q, k, v, q_offsets, kv_offsets, d_out, *, activation, pre_scale, post_scale,
                  max_seq_len, max_kv_len, interpret):
  """(dq, dk, dv, d_pre_scale, d_post_scale) by JAX's VJP of the XLA path (recomputes the
  forward), with the backward kernel's interface: for the shapes that kernel refuses."""
  del interpret

  def forward(q, k, v, pre, post):
    return xla.gdpa(q, k, v, q_offsets, kv_offsets, pre, post, activation=activation,
                    max_seq_len=max_seq_len, max_kv_len=max_kv_len, out_dtype=d_out.dtype)

  return jax.vjp(forward, q, k, v, pre_scale, post_scale)[1](d_out)


OFFSETS_INVALID_MESSAGE = (
    "pallas_norm: traced q_offsets/kv_offsets break the jagged convention (first 0, "
    "non-decreasing, last <= the packed capacity, no length over max_seq_len/max_kv_len); the "
    "output and its gradients are NaN")


def poison_if_offsets_invalid(out, q_offsets, kv_offsets, capacity, kv_capacity, max_seq_len,
                              max_kv_len):
  """NaN everywhere, in the output and in the gradients, when traced offsets break the jagged
  convention (see :func:`pallas_norm._validate.offsets_invalid`), and a checkify error under
  ``jax.experimental.checkify.checkify``; concrete offsets were already checked."""
  bad = offsets_invalid(q_offsets, kv_offsets, capacity, kv_capacity, max_seq_len, max_kv_len)
  if bad is None:
    return out
  return _validate.poison_if_invalid(out, bad, OFFSETS_INVALID_MESSAGE)


def poison_inputs_if_offsets_invalid(inputs, q_offsets, kv_offsets, capacity, kv_capacity,
                                     max_seq_len, max_kv_len):
  """``inputs`` (q, k, v, scales, ...) poisoned like :func:`poison_if_offsets_invalid`, so that
  their gradients are NaN too: masks downstream (rows outside every sample under bad offsets)
  would otherwise send exact zeros back. Python-number scales stay numbers (no gradient)."""
  bad = offsets_invalid(q_offsets, kv_offsets, capacity, kv_capacity, max_seq_len, max_kv_len)
  if bad is None:
    return inputs
  return tuple(a if a is None or not _validate.is_array(a) else
               _validate.poison_if_invalid(a, bad, OFFSETS_INVALID_MESSAGE) for a in inputs)


def offsets_invalid(q_offsets, kv_offsets, capacity, kv_capacity, max_seq_len, max_kv_len):
  """A traced bool, True when traced offsets break the jagged convention
  (:func:`pallas_norm._validate.offsets_invalid` of each); None when no offsets are traced
  (concrete ones were checked by :func:`check_args`). Shared with ``flash_norm_attention``."""
  traced = [o for o in (q_offsets, kv_offsets) if isinstance(o, jax.core.Tracer)]
  if not traced:
    return None
  bad = _validate.offsets_invalid(q_offsets, capacity, max_seq_len)
  if kv_offsets is not None:
    bad = bad | _validate.offsets_invalid(kv_offsets, kv_capacity, max_kv_len)
  return bad
