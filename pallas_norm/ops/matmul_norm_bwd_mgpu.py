"""The norm backward of the post-norm GEMM (:mod:`pallas_norm.ops.matmul_norm`) as one
Mosaic-GPU kernel (Hopper): dh and the column sums in one pass over the row blocks.

Math (DESIGN.md, op 2; :func:`pallas_norm.ops.matmul_norm._norm_backward`): with
``g = scale ⊙ dy`` and means over the N columns of a row,

    dh = rstd ⊙ (g − x̂ ⊙ mean_N(g ⊙ x̂) − mean_N(g)) (+ dh_out)      (RMS: no mean_N(g))

and the column sums Σ_i dy ⊙ x̂ (dscale), Σ_i dy (dbias), Σ_i dh (d dense_bias), all in
float32. In XLA this is two passes (the row sums, then dh; 124 + 225 µs at 262144×512 bf16 on
the H200 for RMSNorm with a scale) plus reductions; the floor of one pass (read dy and x̂, write
dh) is ~187 µs at the suite's measured copy bandwidth.

Kernel: a persistent grid of CTAs, each walking row blocks of 64 rows (one consumer warpgroup,
:data:`CONSUMERS`, in the WGMMA register layout) with a TMA producer warpgroup. A row block is
streamed twice, in (64, 128) column chunks (:data:`WIDE_CHUNK`; 64 where N is not a multiple of
128) of dy and x̂ (and dh_out): the first pass accumulates each row's Σ g ⊙ x̂ and Σ g
(per-thread partial sums carried across the steps, reduced across lanes once) and
dscale/dbias's column partial sums; the second pass, which reads the chunks again (from L2: a
row block is 64 · N · 2 · 2 bytes, 128 KiB at N = 512), writes dh through a double-buffered SMEM
slot and TMA, and adds to d(dense_bias)'s column partials (from dh in float32, before
rounding). Each column sum is a cross-warp reduction per step; the warpgroup's reads of the old
sums and writes of the new ones are separated by one barrier per step.

Measured on the H200 (``benchmarks/gpu_norm_backward.py``, session 6; 262144 rows, bf16):
RMSNorm (the dscale sum) 334 µs vs XLA's 353 at N = 512, 617 vs 682 at N = 1024; LayerNorm
(dscale and dbias) 474 vs 415 and 937 vs 796, so :mod:`pallas_norm.ops.matmul_norm` uses it for
RMSNorm only (``NORM_BACKWARD_KERNEL``). Versions: two consumer warpgroups ran 294 µs (RMSNorm)
and 348 (LayerNorm) at N = 512 but their column sums were wrong on the GPU (the shared
reduction scratch); one warpgroup with 64-wide steps 360 / 526; 128-wide steps as now; the
LayerNorm sums stacked into one (64, 256) reduction were slower (497 µs; 1454 at N = 1024).

Column sums are deterministic: each CTA accumulates its column partials in a fixed order in
SMEM, writes them to ``(ctas, CONSUMERS, sums, N)`` at the end, and the caller reduces
those in a fixed pairwise order (:func:`pallas_norm.ops.matmul_norm.column_sum`'s stage 2). The
partition of rows among CTAs depends on the SM count, so the bits are the same on every run on
one GPU model.

Shapes: any M ≥ 1 (TMA zero-fills rows past M, where dy = x̂ = 0 gives dh = 0 and adds nothing
to a column sum, and drops their stores; for M not a multiple of 8 the inputs are padded and dh
sliced, full copies, so :mod:`pallas_norm.ops.matmul_norm` keeps XLA's passes there); N a multiple of 64 with the column accumulators
(sums · N · 4 bytes) within :data:`MAX_ACC_BYTES`; dy, x̂ and dh_out bfloat16 or float16 of
one dtype; dh in that dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm import mgpu_common

__all__ = ["SUMS", "unsupported_reason", "norm_backward"]

_F32 = jnp.float32
WG_ROWS = 64  # rows of one consumer warpgroup (the WGMMA register layout)
CONSUMERS = 1
"""Consumer warpgroups. One: Mosaic's cross-warp reductions (the column sums) use one SMEM
scratch buffer for the whole kernel, so two warpgroups reducing at once corrupt each other's
sums (measured on the H200, ``benchmarks/dev/colsum_layouts.py``: exact with one warpgroup,
wrong with two, in the WGMMA and the transposed register layouts alike)."""
BLOCK_ROWS = CONSUMERS * WG_ROWS
CHUNK = 64  # the unit of N: one 128-byte swizzle span of 16-bit values
WIDE_CHUNK = 128
"""Columns per pipeline step where N allows (else :data:`CHUNK`): wider steps halve the fixed
cost per byte (pipeline barriers, the column sums' cross-warp reductions)."""
OUT_SLOTS = 2
ROW_ALIGN = 8  # tiled TMA copies move whole 8-row groups
MAX_ACC_BYTES = 64 * 1024
MAX_STAGES = 6
SUMS = ("dscale", "dbias", "ddense")
"""Column sums the kernel can return: Σ dy ⊙ x̂, Σ dy, Σ dh (float32, over the M rows)."""


def unsupported_reason(m: int, n: int, dtype, n_sums: int = 3) -> str | None:
  """Why the kernel cannot run (M, N) with 16-bit ``dtype`` and ``n_sums`` column sums; None
  when it can."""
  if jnp.dtype(dtype) not in mgpu_common.SUPPORTED_DTYPES:
    return f"dtype {jnp.dtype(dtype)} (the kernel takes bfloat16 or float16)"
  if m < 1:
    return f"M = {m} (needs at least one row)"
  if n < CHUNK or n % CHUNK:
    return f"N = {n} is not a positive multiple of {CHUNK}"
  if _acc_bytes(n, n_sums) > MAX_ACC_BYTES:
    return (f"N = {n} with {n_sums} column sums needs {_acc_bytes(n, n_sums)} bytes of SMEM "
            f"accumulators, more than {MAX_ACC_BYTES}")
  return None


def _acc_bytes(n: int, n_sums: int) -> int:
  return CONSUMERS * max(n_sums, 1) * n * 4


@dataclasses.dataclass(frozen=True)
class _Plan:
  m: int
  n: int
  dtype: jnp.dtype
  norm: str
  has_scale: bool
  has_dh_out: bool
  sums: tuple[str, ...]
  chunk: int
  ctas: int
  stages: int

  @property
  def chunks(self) -> int:
    return self.n // self.chunk

  @property
  def blocks(self) -> int:  # row blocks of BLOCK_ROWS rows
    return -(-self.m // BLOCK_ROWS)

  @property
  def blocks_per_cta(self) -> int:
    return -(-self.blocks // self.ctas)

  @property
  def n_inputs(self) -> int:  # (BLOCK_ROWS, chunk) tiles per step: dy, x̂, dh_out
    return 2 + self.has_dh_out


def _stage_bytes(plan: _Plan) -> int:
  tiles = plan.n_inputs * BLOCK_ROWS * plan.chunk * jnp.dtype(plan.dtype).itemsize
  return tiles + BLOCK_ROWS * 4 + plan.has_scale * plan.chunk * 4


def _fixed_bytes(plan: _Plan) -> int:
  out = CONSUMERS * OUT_SLOTS * WG_ROWS * plan.chunk * jnp.dtype(plan.dtype).itemsize
  return out + _acc_bytes(plan.n, len(plan.sums)) + 8192  # + reduction scratch and barriers


def _make_plan(m, n, dtype, norm, has_scale, has_dh_out, sums, interpret,
               chunk=None) -> _Plan:
  chunk = chunk or (WIDE_CHUNK if n % WIDE_CHUNK == 0 else CHUNK)
  if chunk not in (CHUNK, WIDE_CHUNK) or n % chunk:
    raise ValueError(f"chunk must be {CHUNK} or {WIDE_CHUNK} and divide N = {n}, got {chunk}")
  plan = _Plan(m, n, jnp.dtype(dtype), norm, has_scale, has_dh_out, tuple(sums), chunk, 1, 1)
  ctas = max(1, min(mgpu_common.num_sms(interpret), plan.blocks))
  fit = (mgpu_common.SMEM_BYTES - _fixed_bytes(plan)) // _stage_bytes(plan)
  # A CTA's steps: two passes over the chunks of each of its row blocks.
  steps = 2 * plan.chunks * (-(-plan.blocks // ctas))
  stages = max(1, min(MAX_STAGES, fit, steps))
  return dataclasses.replace(plan, ctas=ctas, stages=stages)


def _kernel(*refs, plan: _Plan):
  it = iter(refs)
  dy_gmem, xhat_gmem = next(it), next(it)
  dho_gmem = next(it) if plan.has_dh_out else None
  rstd_gmem = next(it)  # padded to whole row blocks
  scale_gmem = next(it) if plan.has_scale else None  # (1, N) f32
  dh_gmem = next(it)
  sums_gmem = next(it) if plan.sums else None  # (ctas, CONSUMERS, sums, N) f32
  chunks, inv_n = plan.chunks, 1.0 / plan.n
  # Tiled (the SMEM layout of WGMMA operands); its TMA needs whole 8-row groups, hence M padded
  # to a multiple of 8.
  chunk = plan.chunk
  transforms = mgpu_common.swizzle_transforms(chunk, plan.dtype)
  cta = lax.axis_index("cta")

  def step_coords(s):  # (local row block, pass, chunk) of pipeline step s
    return s // (2 * chunks), (s // chunks) % 2, s % chunks

  def block_of(s):  # the row block of step s; past the CTA's share, its last valid one
    r, _, _ = step_coords(s)
    return jnp.minimum(cta + r * plan.ctas, plan.blocks - 1)

  spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
  tile_spec = spec((BLOCK_ROWS, chunk), lambda s: (block_of(s), step_coords(s)[2]),
                   transforms=transforms)
  in_specs = [tile_spec] * plan.n_inputs + [spec((BLOCK_ROWS,), lambda s: (block_of(s),))]
  if plan.has_scale:
    in_specs.append(spec((1, chunk), lambda s: (0, step_coords(s)[2])))
  gmems = [r for r in (dy_gmem, xhat_gmem, dho_gmem, rstd_gmem, scale_gmem) if r is not None]
  n_sums = len(plan.sums)

  @functools.partial(
      pl.run_scoped,
      out_smem=plgpu.SMEM((CONSUMERS, OUT_SLOTS, WG_ROWS, chunk), plan.dtype,
                          transforms=transforms),
      acc_smem=plgpu.SMEM((CONSUMERS, max(n_sums, 1), plan.n), _F32),
      collective_axes="wg",
  )
  def _scope(out_smem, acc_smem):
    wg = lax.axis_index("wg")
    rows = pl.ds(wg * WG_ROWS, WG_ROWS)
    wgmma = plgpu.Layout.WGMMA
    zero_parts = (mgpu_common.lane_partial_zeros(WG_ROWS),) * 2

    def col_sum_updates(c, values):
      """[(ref, new sums)] for acc_smem[wg, q, chunk c] += Σ_rows value, for each (name, value):
      store them after a warpgroup barrier (every warp reads the old sums before any writes)."""
      updates = []
      for name, value in values:
        ref = acc_smem.at[wg, plan.sums.index(name), pl.ds(c * chunk, chunk)]
        updates.append((ref, plgpu.load(ref, layout=wgmma.reduce(0)) + jnp.sum(value, axis=0)))
      return updates

    def store_updates(updates):
      for ref, value in updates:
        ref[...] = value

    def body(idxs, *refs):
      (s,) = idxs
      *refs, carry = refs
      dy_smem, xhat_smem = refs.pop(0), refs.pop(0)
      dho_smem = refs.pop(0) if plan.has_dh_out else None
      rstd_smem = refs.pop(0)
      scale_smem = refs.pop(0) if plan.has_scale else None
      r, p, c = step_coords(s)
      valid = cta + r * plan.ctas < plan.blocks
      load_f32 = lambda ref, lay: plgpu.load(ref.at[rows], layout=lay).astype(_F32)  # noqa: E731
      dy, xhat = load_f32(dy_smem, wgmma), load_f32(xhat_smem, wgmma)
      g = dy
      if plan.has_scale:
        scale = plgpu.load(scale_smem.at[0], layout=wgmma.reduce(0))
        g = dy * lax.broadcast_in_dim(scale, dy.shape, [1])
      def first_pass(parts):  # this chunk's row sums, from zero at a row block's first chunk
        parts = lax.cond(c == 0, lambda: zero_parts, lambda: parts)
        gx_part = parts[0] + mgpu_common.lane_partial_sum(g * xhat)
        g_part = parts[1] + mgpu_common.lane_partial_sum(g) if plan.norm == "layer" else parts[1]

        @pl.when(valid)
        def _column_sums():
          values = {"dscale": lambda: dy * xhat, "dbias": lambda: dy}
          updates = col_sum_updates(c, [(q, values[q]()) for q in plan.sums if q in values])
          if updates:
            plgpu.commit_smem()
            store_updates(updates)
        return gx_part, g_part

      carry = lax.cond(p == 0, first_pass, lambda parts: parts, carry)
      gx_part, g_part = carry

      @pl.when((p == 1) & valid)
      def _second_pass():
        mean_gx = jnp.sum(gx_part, axis=1) * inv_n
        inner = g - xhat * lax.broadcast_in_dim(mean_gx, g.shape, [0])
        if plan.norm == "layer":
          inner = inner - lax.broadcast_in_dim(jnp.sum(g_part, axis=1) * inv_n, g.shape, [0])
        rstd = plgpu.load(rstd_smem.at[rows], layout=wgmma.reduce(1))
        dh = inner * lax.broadcast_in_dim(rstd, g.shape, [0])
        if plan.has_dh_out:
          dh = dh + plgpu.load(dho_smem.at[rows], layout=wgmma).astype(_F32)
        updates = col_sum_updates(c, [("ddense", dh)] if "ddense" in plan.sums else [])
        slot = (r * chunks + c) % OUT_SLOTS
        # The store that last read this slot (OUT_SLOTS stores ago) must be done.
        plgpu.wait_smem_to_gmem(OUT_SLOTS - 1, wait_read_only=True)
        out_smem[wg, slot] = dh.astype(plan.dtype)
        plgpu.commit_smem()  # also the barrier between the old sums' reads and the new ones
        store_updates(updates)
        row0 = (cta + r * plan.ctas) * BLOCK_ROWS + wg * WG_ROWS
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                dh_gmem.at[pl.ds(row0, WG_ROWS), pl.ds(c * chunk, chunk)])

      # The stage's reads (generic proxy) precede its release to the TMA producer (async proxy).
      plgpu.commit_smem()
      return carry

    def compute_context(eval_pipeline):
      for q in range(n_sums):
        @pl.loop(0, chunks)
        def _zero(c, q=q):
          acc_smem[wg, q, pl.ds(c * chunk, chunk)] = plgpu.layout_cast(
              jnp.zeros((chunk,), _F32), wgmma.reduce(0))
      eval_pipeline(zero_parts)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if plan.sums:
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem.at[wg], sums_gmem.at[cta, wg])
      plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(2 * chunks * plan.blocks_per_cta,), memory_registers=40,
        in_specs=in_specs, wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=plan.stages,
        compute_context=compute_context)
    pipeline(*gmems)


def norm_backward(dy, xhat, rstd, scale=None, dh_out=None, *, norm: str,
                  sums: tuple[str, ...] = (), interpret: bool = False, chunk: int | None = None):
  """dh and the column partial sums of the post-norm backward, one Mosaic-GPU kernel.

  Args:
    dy: (M, N) cotangent of y, bfloat16 or float16.
    xhat: (M, N) x̂ = (h − mean) · rstd (RMS: h · rstd) in dy's dtype, saved by the forward.
    rstd: (M,) float32.
    scale: optional (N,) norm scale γ (any float dtype; used in float32).
    dh_out: optional (M, N) in dy's dtype, added to dh (the cotangent of a returned h).
    norm: "rms" or "layer".
    sums: which column sums to return, a sub-sequence of :data:`SUMS`.
    interpret: run in Pallas GPU interpret mode (CPU), :func:`mgpu_common.interpret_params`.
    chunk: columns per pipeline step, :data:`CHUNK` or :data:`WIDE_CHUNK` (None: the widest
      that divides N).

  Returns:
    ``(dh, partials)``: dh (M, N) in dy's dtype; partials (ctas, :data:`CONSUMERS`, len(sums), N) float32
    whose sum over the first two axes is each requested column sum (None when ``sums`` is
    empty). Sum them in a fixed order for deterministic bits.

  Raises:
    ValueError: a shape, dtype, norm or sum name the kernel does not take
      (:func:`unsupported_reason`).
  """
  if norm not in ("rms", "layer"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
  if (not isinstance(sums, (tuple, list)) or any(s not in SUMS for s in sums)
      or len(set(sums)) != len(sums)):
    raise ValueError(f"sums must be distinct names from {SUMS}, got {sums!r}")
  if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)):
    raise TypeError(f"chunk must be None or an int, got {chunk!r}")
  for name, a in (("dy", dy), ("xhat", xhat), ("rstd", rstd), ("scale", scale),
                  ("dh_out", dh_out)):
    if a is not None and not (hasattr(a, "shape") and hasattr(a, "dtype")):
      raise TypeError(f"{name} must be an array, got {type(a).__name__}")
  if not jnp.issubdtype(rstd.dtype, jnp.floating):
    raise TypeError(f"rstd must be a real float array, got {rstd.dtype}")
  if dy.ndim != 2 or xhat.shape != dy.shape or rstd.shape != dy.shape[:1]:
    raise ValueError(f"dy and xhat must be (M, N) and rstd (M,), got {dy.shape}, {xhat.shape}, "
                     f"{rstd.shape}")
  if xhat.dtype != dy.dtype or (dh_out is not None and dh_out.dtype != dy.dtype):
    raise ValueError(f"xhat and dh_out must have dy's dtype {dy.dtype}")
  if dh_out is not None and dh_out.shape != dy.shape:
    raise ValueError(f"dh_out must be {dy.shape}, got {dh_out.shape}")
  if scale is not None and scale.shape != dy.shape[1:]:
    raise ValueError(f"scale must be ({dy.shape[1]},), got {scale.shape}")
  m, n = dy.shape
  if reason := unsupported_reason(m, n, dy.dtype, len(sums)):
    raise ValueError(f"norm_backward kernel: {reason}")
  pad = -m % ROW_ALIGN
  m += pad
  plan = _make_plan(m, n, dy.dtype, norm, scale is not None, dh_out is not None, sums,
                    interpret, chunk)
  out_type = [jax.ShapeDtypeStruct((m, n), dy.dtype)]
  if sums:
    out_type.append(jax.ShapeDtypeStruct((plan.ctas, CONSUMERS, len(sums), n), _F32))
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=tuple(out_type),
      grid=(plan.ctas,),
      grid_names=("cta",),
      num_threads=CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          reduction_scratch_bytes=6144),  # Mosaic's suggestion for H100-class GPUs
      interpret=mgpu_common.interpret_params() if interpret else None,
  )
  rstd_padded = jnp.pad(rstd.astype(_F32), (0, plan.blocks * BLOCK_ROWS - m + pad))
  tiles = [mgpu_common.pad_rows(a, pad) for a in (dy, xhat, dh_out) if a is not None]
  args = tiles + [rstd_padded] + ([] if scale is None else [scale.astype(_F32)[None, :]])
  outs = call(*args)
  dh = outs[0][:m - pad] if pad else outs[0]
  return dh, (outs[1] if sums else None)

