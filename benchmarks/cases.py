"""What the suite measures: cases (op, variant, shape, mode) and how to build each one.

A :class:`Case` names one op at one shape in one mode ("fwd" or "fwd+bwd"). :func:`build` turns
it into a :class:`Problem`: how to make a random input set, which inputs are differentiated,
the function of each implementation and the f32 oracle from :mod:`pallas_norm.reference`.

Implementations per op: "xla" (the public op with ``implementation="xla"``), the kernel
("mosaic" on a GPU, "interpret" with ``--interpret``) and any registered with
:func:`register_impl`. The GEMM-alone limit has "xla" (``jnp.dot``) and "ours" (the pre-norm
kernel without a norm, forward only); the limit is the faster of the two.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_norm as pn
from pallas_norm import jagged, reference
from pallas_norm.ops.matmul_norm import routing as mn_routing

DTYPE = jnp.bfloat16
MODES = ("fwd", "fwd+bwd")
# Attention shapes of the reference GDPA benchmarks (DESIGN.md, "Where the Kunlun PFFN comes from").
ATTN_B, ATTN_D, ATTN_LKV = 768, 128, 128
NORM_BYTES = 1 << 30  # standalone norms: M chosen so that x is ~1 GB


@dataclasses.dataclass(frozen=True)
class Case:
  """One op at one shape in one mode. ``dims`` is a tuple of (name, size) pairs."""

  op: str
  variant: str
  dims: tuple[tuple[str, int], ...]
  mode: str
  quick: bool = False

  @property
  def shape(self) -> str:
    if self.op in ("gdpa", "flash_norm_attention", "train_step"):
      return " ".join(f"{k}{v}" for k, v in self.dims)
    return "x".join(str(v) for _, v in self.dims)

  @property
  def key(self) -> str:
    """The case without its mode: rows of one key share shapes across modes."""
    op = f"{self.op}/{self.variant}" if self.variant else self.op
    return f"{op}/{self.shape.replace(' ', '_')}"

  @property
  def name(self) -> str:
    return f"{self.key}/{self.mode}"

  def dim(self, name: str) -> int:
    return dict(self.dims)[name]


def limit_of(case: Case) -> Case | None:
  """The case whose best time is this case's physical limit: the GEMM alone for the fused
  GEMMs, GDPA alone for the PFFN block; None for ops that only have floors."""
  if case.op in ("norm_matmul", "matmul_norm"):
    return Case("gemm", "", case.dims, case.mode, case.quick)
  if case.op == "flash_norm_attention":  # GDPA alone at the same lengths and capacity
    return Case("gdpa", case.variant, case.dims, case.mode, case.quick)
  return None


@dataclasses.dataclass
class Problem:
  """A case made concrete.

  make_set(rand) -> tuple of arrays: one input set, float inputs drawn with
    ``rand(shape, scale=1, offset=0)`` (normal, never zeros): :class:`DeviceRandom` inside a
    jitted function on a GPU, :class:`HostRandom` (no compile) for CPU-sized shapes.
  diff: indices of the inputs that fwd+bwd differentiates.
  impl_fn(name) -> fn(*inputs) -> output array; raises NotImplementedError when unavailable.
  ref_fn: fn(*inputs) -> output, called on float32-upcast inputs (the oracle).
  flops_fwd / flops_bwd: useful floating-point work (multiply-add = 2), 0 for pure norms.
  """

  make_set: Callable[[Callable], tuple]
  diff: tuple[int, ...]
  impl_fn: Callable[[str], Callable]
  ref_fn: Callable
  flops_fwd: float
  flops_bwd: float
  impls: tuple[str, ...] = ()


# Registry of extra implementations: op -> name -> factory(case) -> fn(*inputs) -> output.
# The fn takes the same inputs as the op's "xla" implementation (see the builders below).
_EXTRA: dict[str, dict[str, Callable[[Case], Callable]]] = {}


def register_impl(op: str, name: str, factory: Callable[[Case], Callable]) -> None:
  """Adds an implementation of ``op`` to every case of it, e.g. our GEMM as ``("gemm", "ours",
  lambda case: my_gemm)``. ``factory`` may raise NotImplementedError: the row says "n/a"."""
  if name in ("xla", "mosaic", "interpret", "auto", "ours"):
    raise ValueError(f"name {name!r} is reserved for the public implementations")
  _EXTRA.setdefault(op, {})[name] = factory


def unregister_impl(op: str, name: str) -> None:
  _EXTRA.get(op, {}).pop(name, None)


def known_impls() -> tuple[str, ...]:
  """Every implementation name a case can have: the public ones, "ours" (our GEMM alone) and
  the registered extras."""
  extras = {name for by_name in _EXTRA.values() for name in by_name}
  return ("xla", "mosaic", "interpret", "auto", "ours", *sorted(extras))


class DeviceRandom:
  """Normal bf16 arrays from a PRNG key, a fresh subkey per call (use inside jax.jit)."""

  def __init__(self, key):
    self.key, self.calls = key, 0

  def __call__(self, shape, scale=1.0, offset=0.0):
    self.calls += 1
    x = jax.random.normal(jax.random.fold_in(self.key, self.calls), shape, jnp.float32)
    return (x * scale + offset).astype(DTYPE)


class HostRandom:
  """Normal bf16 arrays drawn by numpy and copied to the device: nothing to compile."""

  def __init__(self, seed: int):
    self.rng = np.random.default_rng(seed)

  def __call__(self, shape, scale=1.0, offset=0.0):
    x = self.rng.standard_normal(shape, dtype=np.float32) * scale + offset
    return jnp.asarray(x.astype(DTYPE))


def _kernel_impl_fn(op_call: Callable, extras: dict, case: Case):
  """impl_fn for an op whose public function is ``op_call(implementation, *inputs)``; the name
  "auto" calls it with ``implementation=None`` (what a user gets by default)."""
  def impl_fn(name):
    if name in ("xla", "mosaic", "interpret", "auto"):
      implementation = None if name == "auto" else name
      return lambda *a: op_call(implementation, *a)
    return extras[name](case)
  return impl_fn


def _our_gemm(case: Case, kernel: str):
  """Our plain GEMM (the pre-norm kernel without statistics), forward only."""
  if case.mode != "fwd":
    raise NotImplementedError("our GEMM alone has no backward")
  from pallas_norm.ops.norm_matmul import mosaic as norm_matmul_mgpu
  from pallas_norm import _dispatch
  if kernel == "mosaic" and not _dispatch.on_hopper_gpu():
    raise NotImplementedError("our GEMM needs a Hopper GPU (or --interpret)")
  m, k, n = (case.dim(d) for d in "MKN")
  reason = norm_matmul_mgpu.unsupported_reason(m, k, n, DTYPE)
  if reason is not None:
    raise NotImplementedError(reason)

  def ours(x, w):
    return norm_matmul_mgpu.gemm(x, w, interpret=kernel == "interpret")
  return ours


def _gemm(case: Case, kernel: str) -> Problem:
  m, k, n = (case.dim(d) for d in "MKN")

  def make_set(rand):
    return rand((m, k)), rand((k, n), 1 / math.sqrt(k))

  def xla(x, w):
    return jnp.dot(x, w)  # bf16 out, f32 accumulation: the GEMM every fused op must match

  extras = _EXTRA.get("gemm", {})

  def impl_fn(name):
    if name == "xla":
      return xla
    return _our_gemm(case, kernel) if name == "ours" else extras[name](case)

  return Problem(make_set, (0, 1), impl_fn,
                 lambda x, w: jnp.dot(x, w, precision=lax.Precision.HIGHEST),
                 2.0 * m * k * n, 4.0 * m * k * n, ("xla", "ours", *extras))


def _norm_matmul(case: Case, kernel: str) -> Problem:
  m, k, n = (case.dim(d) for d in "MKN")
  norm = case.variant

  def make_set(rand):
    xs = (rand((m, k)), rand((k, n), 1 / math.sqrt(k)), rand((k,), 0.1, 1.0))
    return xs + (rand((k,), 0.1),) if norm == "layer" else xs

  def call(impl, x, w, scale, bias=None):
    return pn.norm_matmul(x, w, scale=scale, norm_bias=bias, norm=norm, implementation=impl)

  def ref(x, w, scale, bias=None):
    return reference.norm_matmul(x, w, scale, bias, norm=norm)

  extras = _EXTRA.get("norm_matmul", {})
  nargs = 4 if norm == "layer" else 3
  return Problem(make_set, tuple(range(nargs)), _kernel_impl_fn(call, extras, case), ref,
                 2.0 * m * k * n, 4.0 * m * k * n, ("xla", kernel, *extras))


def _matmul_norm(case: Case, kernel: str) -> Problem:
  m, k, n = (case.dim(d) for d in "MKN")
  norm = "rms" if case.variant == "rms" else "layer"
  with_residual = case.variant == "layer+res"

  def make_set(rand):
    xs = (rand((m, k)), rand((k, n), 1 / math.sqrt(k)))
    if with_residual:
      xs += (rand((m, n)),)
    xs += (rand((n,), 0.1, 1.0),)
    return xs + (rand((n,), 0.1),) if norm == "layer" else xs

  def split(args):  # -> x, w, residual, scale, bias
    x, w, *rest = args
    residual = rest.pop(0) if with_residual else None
    return x, w, residual, rest[0], (rest[1] if len(rest) > 1 else None)

  def call(impl, *args):
    x, w, residual, scale, bias = split(args)
    return pn.matmul_norm(x, w, residual=residual, scale=scale, norm_bias=bias, norm=norm,
                          implementation=impl)

  def ref(*args):
    x, w, residual, scale, bias = split(args)
    return reference.matmul_norm(x, w, None, residual, scale, bias, norm=norm)

  nargs = 2 + with_residual + (2 if norm == "layer" else 1)
  extras = _EXTRA.get("matmul_norm", {})
  # Where implementation=None trains on neither path timed here (the composed route: cuBLAS's
  # GEMM, then rms_norm's kernels), "auto" times what a user gets by default.
  composed = (case.mode == "fwd+bwd"
              and mn_routing.composed_training_reason(m, k, n, norm) is None)
  return Problem(make_set, tuple(range(nargs)), _kernel_impl_fn(call, extras, case), ref,
                 2.0 * m * k * n, 4.0 * m * k * n,
                 ("xla", kernel, *(("auto",) if composed else ()), *extras))


def attention_lengths(case: Case) -> np.ndarray:
  """Per-sample query lengths, uniform on [1, L] (density ~0.5), fixed per shape; all L for
  the "full" variants (density 1.0: "full", "jagged_kv_full"). The "padded" variant has the
  default lengths in a capacity of B·L rows (:func:`attention_capacity`)."""
  if case.variant in ("full", "jagged_kv_full"):
    return np.full(case.dim("B"), case.dim("L"))
  rng = np.random.default_rng(case.dim("B") * 7919 + case.dim("L"))
  return rng.integers(1, case.dim("L") + 1, size=case.dim("B"))


def attention_capacity(case: Case, lens) -> int:
  """Packed rows T: the sum of the lengths rounded up to 128, or B·L for the "padded" variant
  (a jitted model's static capacity: about half the rows padding at density 0.5)."""
  if case.variant == "padded":
    return case.dim("B") * case.dim("L")
  return -(-int(lens.sum()) // 128) * 128


def _attention(case: Case, kernel: str) -> Problem:
  b, h, lmax, d, lkv = (case.dim(x) for x in ("B", "H", "L", "D", "KV"))
  lens = attention_lengths(case)
  capacity = attention_capacity(case, lens)
  offsets = jagged.offsets_from_lengths(lens)
  fused = case.op == "flash_norm_attention"
  # "jagged_kv", "jagged_kv_full": GDPA as self-attention, K/V packed like q with its offsets
  # (KV = L).
  self_attention = case.variant in ("jagged_kv", "jagged_kv_full")
  kv_shape = (capacity, h, d) if self_attention else (b, lkv, h, d)

  def make_set(rand):
    xs = (rand((capacity, h, d)), rand(kv_shape, 1 / math.sqrt(d)), rand(kv_shape),
          jnp.asarray(offsets))
    if fused:
      xs += (rand((h * d,), 0.1, 1.0), rand((h * d,), 0.1), rand((h * d,), 0.1, 1.0))
    return xs

  def call(impl, q, k, v, q_offsets, *affine):
    if fused:
      ln_scale, ln_bias, rms_scale = affine
      return pn.flash_norm_attention(q, k, v, q_offsets, ln_scale=ln_scale, ln_bias=ln_bias,
                                     rms_scale=rms_scale, max_seq_len=lmax, implementation=impl)
    if self_attention:
      return pn.gdpa(q, k, v, q_offsets, q_offsets, max_seq_len=lmax, max_kv_len=lkv,
                     implementation=impl)
    return pn.gdpa(q, k, v, q_offsets, max_seq_len=lmax, implementation=impl)

  def ref(q, k, v, q_offsets, *affine):
    if fused:
      ln_scale, ln_bias, rms_scale = affine
      return reference.flash_norm_attention(q, k, v, q_offsets, ln_scale=ln_scale,
                                            ln_bias=ln_bias, rms_scale=rms_scale,
                                            max_seq_len=lmax)
    if self_attention:
      return reference.gdpa(q, k, v, q_offsets, q_offsets, max_seq_len=lmax, max_kv_len=lkv)
    return reference.gdpa(q, k, v, q_offsets, max_seq_len=lmax)

  # Useful work over real tokens: q·kᵀ and p·v forward, four such products backward.
  kv_per_token = lens if self_attention else lkv
  flops = 4.0 * float(np.sum(lens * kv_per_token)) * h * d
  diff = (0, 1, 2, 4, 5, 6) if fused else (0, 1, 2)
  extras = _EXTRA.get(case.op, {})
  return Problem(make_set, diff, _kernel_impl_fn(call, extras, case), ref, flops, 2 * flops,
                 ("xla", kernel, *extras))


def _unfused_chain(case: Case):
  """The PFFN block unfused on the GPU: the norms in XLA around our GDPA kernel (what the op
  ran on Hopper before the fused kernel), as the "chain" row of flash_norm_attention."""
  from pallas_norm import _dispatch
  if not _dispatch.on_hopper_gpu():
    raise NotImplementedError("the unfused chain runs the GDPA kernel: needs a Hopper GPU")
  lmax = case.dim("L")

  def chain(q, k, v, q_offsets, ln_scale, ln_bias, rms_scale):
    def attention(u):
      return pn.gdpa(u, k, v, q_offsets, max_seq_len=lmax, implementation="mosaic")
    return reference.flash_norm_block(
        q, q_offsets, attention, ln_scale=ln_scale, ln_bias=ln_bias, rms_scale=rms_scale,
        eps=1e-6, out_dtype=None, pre_layer_norm=True, inner_residual=True,
        outer_residual=True, return_stats=False)
  return chain


register_impl("flash_norm_attention", "chain", _unfused_chain)


def _norm(case: Case, kernel: str) -> Problem:
  m, n = case.dim("M"), case.dim("N")
  layer = case.op == "layer_norm"

  def make_set(rand):
    xs = (rand((m, n)), rand((n,), 0.1, 1.0))
    return xs + (rand((n,), 0.1),) if layer else xs

  def call(impl, x, scale, bias=None):
    # The suite's "mosaic" column is "the kernel": for the row norms that is the Pallas
    # backward kernel with the Triton lowering (pallas_norm/ops/norms/triton.py).
    impl = "triton" if impl == "mosaic" else impl
    if layer:
      return pn.layer_norm(x, scale, bias, implementation=impl)
    return pn.rms_norm(x, scale, implementation=impl)

  def ref(x, scale, bias=None):
    return reference.layer_norm(x, scale, bias) if layer else reference.rms_norm(x, scale)

  extras = _EXTRA.get(case.op, {})
  return Problem(make_set, tuple(range(3 if layer else 2)), _kernel_impl_fn(call, extras, case),
                 ref, 0.0, 0.0, ("xla", kernel, *extras))


def _autodiff_norm(case: Case):
  """The reference differentiated by JAX's autodiff: what the row norms' "xla" implementation
  was before its one-pass derivative (pallas_norm/ops/norms/xla.py), kept as that baseline
  (fwd+bwd only: the forward is the same operations as "xla"'s)."""
  if case.mode != "fwd+bwd":
    raise NotImplementedError("the forward is the 'xla' row's")
  if case.op == "layer_norm":
    return lambda x, scale, bias: reference.layer_norm(x, scale, bias)
  return lambda x, scale: reference.rms_norm(x, scale)


register_impl("rms_norm", "autodiff", _autodiff_norm)
register_impl("layer_norm", "autodiff", _autodiff_norm)


def build(case: Case, kernel: str = "mosaic") -> Problem:
  """The :class:`Problem` of ``case``; ``kernel`` names the kernel implementation to try
  ("mosaic" on a GPU, "interpret" on the CPU)."""
  if case.op == "gemm":
    return _gemm(case, kernel)
  if case.op == "norm_matmul":
    return _norm_matmul(case, kernel)
  if case.op == "matmul_norm":
    return _matmul_norm(case, kernel)
  if case.op in ("gdpa", "flash_norm_attention"):
    return _attention(case, kernel)
  if case.op in ("rms_norm", "layer_norm"):
    return _norm(case, kernel)
  raise ValueError(f"no problem builder for op {case.op!r}")


# ---------------------------------------------------------------------------------------------
# The case list.

def _mkn(m, k, n):
  return (("M", m), ("K", k), ("N", n))


def _attn(h, lmax, lkv=ATTN_LKV):
  return (("B", ATTN_B), ("H", h), ("L", lmax), ("D", ATTN_D), ("KV", lkv))


HEADLINE_MKN = (262144, 512, 512)  # the --quick shape of the fused GEMMs
# DESIGN.md's baseline table first (a run cut by its time budget still has them), then the rest.
PRE_SHAPES = [(262144, 512, 512), (262144, 128, 128), (262144, 512, 2048), (65536, 2048, 2048),
              (16384, 8192, 8192), (262144, 256, 256), (262144, 1024, 1024),
              (262144, 2048, 2048), (32768, 4096, 4096)]
# Post-norm also goes wide at K=512 (the reference implementation stops at N=2048). M is halved
# at N=8192 so that ten timed outputs of the fwd+bwd case stay well inside 139 GB.
POST_SHAPES = PRE_SHAPES + [(262144, 512, 4096), (131072, 512, 8192)]
ATTN_CONFIGS = [(h, lmax) for lmax in (256, 512, 1024) for h in (2, 4, 8)]
# GDPA only (issue 20: H in {2, 4, 8}, densities 0.5 and 1.0, dense and jagged K/V): density
# 1.0 with dense K/V ("full"), and jagged K/V self-attention ("jagged_kv", KV = L) at density
# 0.5 and 1.0 ("jagged_kv_full"). The kernel keeps a sample's K/V in SMEM, which at D = 128
# holds up to L = 128 (the jagged rows at every H); at L512 it streams them per q block, measured
# faster than XLA there too (implementation=None takes it: gdpa.api.kernel_slower_reason).
GDPA_VARIANT_CONFIGS = ([("full", h, 512, ATTN_LKV) for h in (2, 4, 8)]
                        + [("jagged_kv", h, 128, 128) for h in (2, 4, 8)]
                        + [("jagged_kv", 4, 512, 512)]
                        + [("jagged_kv_full", h, 128, 128) for h in (2, 4, 8)]
                        + [("padded", h, 512, ATTN_LKV) for h in (4, 8)])
# The fused block at density 1.0 too (issue 21: rows at H in {2, 4, 8} and density 1.0), and
# at H = 4 and 8 (the one-CTA and the cluster kernel) in a static capacity of B·L rows
# ("padded": the padding's zero rows; GDPA alone there too, the block's limit).
FNA_VARIANT_CONFIGS = [("full", h, 512, ATTN_LKV) for h in (2, 4, 8)] + [
    ("padded", h, 512, ATTN_LKV) for h in (4, 8)]
QUICK_ATTN = (4, 512)
NORM_NS = (128, 512, 2048, 8192, 32768)
QUICK_NORM_N = 2048
FUSED_VARIANTS = (("norm_matmul", "rms"), ("norm_matmul", "layer"),
                  ("matmul_norm", "layer+res"), ("matmul_norm", "rms"))


def all_cases() -> list[Case]:
  """Every case, the --quick ones first, then in the order of DESIGN.md's baseline table."""
  cases = []
  for mode in MODES:
    for op, variant in FUSED_VARIANTS:
      cases.append(Case(op, variant, _mkn(*HEADLINE_MKN), mode, True))
    for op in ("gdpa", "flash_norm_attention"):
      cases.append(Case(op, "", _attn(*QUICK_ATTN), mode, True))
    for op in ("rms_norm", "layer_norm"):
      cases.append(Case(op, "", (("M", NORM_BYTES // (2 * QUICK_NORM_N)), ("N", QUICK_NORM_N)),
                        mode, True))
  for mode in MODES:
    for op, variant in FUSED_VARIANTS:
      shapes = PRE_SHAPES if op == "norm_matmul" else POST_SHAPES
      cases += [Case(op, variant, _mkn(*s), mode) for s in shapes if s != HEADLINE_MKN]
  for mode in MODES:
    for op in ("gdpa", "flash_norm_attention"):
      cases += [Case(op, "", _attn(*c), mode) for c in ATTN_CONFIGS if c != QUICK_ATTN]
    cases += [Case("gdpa", variant, _attn(h, lmax, lkv), mode)
              for variant, h, lmax, lkv in GDPA_VARIANT_CONFIGS]
    cases += [Case("flash_norm_attention", variant, _attn(h, lmax, lkv), mode)
              for variant, h, lmax, lkv in FNA_VARIANT_CONFIGS]
  for mode in MODES:
    for op in ("rms_norm", "layer_norm"):
      cases += [Case(op, "", (("M", NORM_BYTES // (2 * n)), ("N", n)), mode)
                for n in NORM_NS if n != QUICK_NORM_N]
  return cases


def tiny(case: Case) -> Case:
  """The same case at a CPU-sized shape (every code path, none of the cost)."""
  d = dict(case.dims)
  if case.op in ("gemm", "norm_matmul", "matmul_norm"):
    d = {"M": 256, "K": 128 if d["K"] <= 1024 else 256, "N": 128 if d["N"] <= 1024 else 256}
  elif case.op in ("gdpa", "flash_norm_attention"):
    d.update(B=2, H=min(d["H"], 2), L=128 if d["L"] <= 512 else 256)
  elif case.op in ("rms_norm", "layer_norm"):
    d = {"M": 64, "N": max(128, d["N"] // 32)}
  return dataclasses.replace(case, dims=tuple(d.items()))


def select(cases: list[Case], *, quick: bool, only: str | None, tiny_shapes: bool) -> list[Case]:
  """Filters (--quick), maps to tiny shapes when ``tiny_shapes``, deduplicates (several shapes
  share a tiny one: the first case keeps it), then keeps the cases whose name matches the
  --only regex.

  The regex sees the names that are run and that --list prints: the tiny ones (e.g.
  ``norm_matmul/rms/256x128x128/fwd``) under ``tiny_shapes``, the full-size ones otherwise."""
  import re
  pattern = re.compile(only) if only else None
  out, seen = [], set()
  for c in cases:
    if quick and not c.quick:
      continue
    c = tiny(c) if tiny_shapes else c
    if pattern and not pattern.search(c.name):
      continue
    if c.name not in seen:
      seen.add(c.name)
      out.append(c)
  return out
