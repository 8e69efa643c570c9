"""The norm backward of the post-norm GEMM (:mod:`pallas_norm.ops.matmul_norm`) as one
Mosaic-GPU kernel (Hopper): dh and the column sums in one pass over the row blocks.

Math (DESIGN.md, op 2; :func:`pallas_norm.ops.matmul_norm.xla.norm_backward`): with
``g = scale ⊙ dy`` and means over the N columns of a row,

    dh = rstd ⊙ (g − x̂ ⊙ mean_N(g ⊙ x̂) − mean_N(g)) (+ dh_out)      (RMS: no mean_N(g))

and the column sums Σ_i dy ⊙ x̂ (dscale), Σ_i dy (dbias), Σ_i dh (d dense_bias), all in
float32. In XLA this is two passes (the row sums, then dh; 124 + 221 µs at 262144×512 bf16 on
the H200 for RMSNorm with a scale) plus reductions; the floor of one pass (read dy and x̂, write
dh) is ~187 µs at the suite's measured copy bandwidth.

Kernel: a persistent grid of CTAs with a TMA producer warpgroup and two consumer warpgroups
(:data:`CONSUMERS`), each holding (64, 64) tiles in the WGMMA register layout. A CTA walks row
blocks of 64 rows; each pipeline step brings a (64, 128) tile of dy and x̂ (and dh_out), 64
columns per warpgroup. A row block is streamed twice: the first pass accumulates each
row's Σ g ⊙ x̂ and Σ g (per-thread partial sums, reduced across lanes once; the two warpgroups'
halves are added through SMEM at the end of the pass, behind an mbarrier); the second pass reads
the tiles again (from L2: all CTAs' row blocks are 132 · 64 · N · 4 bytes, 17 MiB at N = 512)
and writes dh through a double-buffered SMEM slot and TMA.

Column sums run on the tensor core: a WGMMA of a one-hot (64, 64) A (row j all ones) with the
summed tile as B adds the tile's column sums to row j of a float32 accumulator, which holds 64
chunks of 64 columns (:data:`MAX_ACCS`). Σ dy reads dy's pipeline stage; Σ dy ⊙ x̂ and Σ dh are
computed in registers and staged through SMEM as bf16 parts that add up to the float32 value
(:func:`_split_bf16`: two parts hold a bf16 product exactly, three any float32 value), so the
sums keep float32 accuracy. A non-finite value spreads further than in XLA's sums: 0 · inf in
the one-hot's zero rows makes the same column of every other 64-column chunk NaN (the sum is
non-finite either way). No reduction crosses warps, so the kernel needs no Mosaic
reduction scratch (``reduction_scratch_bytes=0``): that scratch is one buffer per kernel, and
two warpgroups reducing across warps at once corrupt each other's sums (session 6,
``git show 002e419:benchmarks/dev/colsum_layouts.py``).

Measured on the H200 (``benchmarks/gpu_norm_backward.py``, session 7; 262144 rows, bf16, µs,
kernel vs XLA's passes): RMSNorm (dscale) 297 / 351 at N = 512, 591 / 681 at 1024; LayerNorm
(dscale, dbias) 316 / 416, 616 / 796 (the final code, one ``commit_smem`` per second-pass step;
an earlier version ran 1334 / 1331 and 1359 / 1564 at N = 2048). Session 6's one-warpgroup kernel with cross-warp
column sums: 334 / 474 at N = 512.

Column sums are deterministic: each warpgroup's accumulators add its tiles in a fixed order and
are written to ``(ctas, CONSUMERS, sums, N)`` at the end; the caller reduces those in a fixed
pairwise order (:func:`pallas_norm.ops.matmul_norm.xla.column_sum`'s stage 2). The partition of rows
among CTAs depends on the SM count, so the bits are the same on every run on one GPU model.

Shapes: any M ≥ 1 (TMA zero-fills rows past M, where dy = x̂ = 0 gives dh = 0 and adds nothing
to a column sum, and drops their stores; for M not a multiple of 8 the inputs are padded and dh
sliced, full copies, so :mod:`pallas_norm.ops.matmul_norm` keeps XLA's passes there); N a
multiple of 64 with ``sums · ceil(N / 4096) ≤`` :data:`MAX_ACCS` (N ≤ 12288 with one sum, 4096
with two or three); dy, x̂ and dh_out bfloat16 or float16 of one dtype; dh in that dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_norm import mgpu

__all__ = ["SUMS", "unsupported_reason", "norm_backward"]

_F32 = jnp.float32
_BF16 = jnp.dtype(jnp.bfloat16)
WG_ROWS = 64  # rows of one consumer warpgroup (the WGMMA register layout)
CONSUMERS = 2
"""Consumer warpgroups, each owning a (64, 64) part of every step. Two are safe because the
column sums never go through Mosaic's cross-warp reductions (whose one SMEM scratch buffer per kernel
two warpgroups would share: wrong sums on the H200, ``git show 002e419:benchmarks/dev/colsum_layouts.py``)."""
CHUNK = 64
"""Columns of a warpgroup's tile per step: one 128-byte swizzle span of 16-bit values (128
would leave one pipeline stage next to the staging and output tiles)."""
ACC_ROWS = 64  # rows of one WGMMA accumulator: one chunk of a column sum per row
MAX_ACCS = 3
"""WGMMA accumulators ((64, 64) float32, 32 registers per thread each) per consumer warpgroup
for the column sums: each sum needs ``ceil(N / 4096)`` of them."""
OUT_SLOTS = 2
ROW_ALIGN = 8  # tiled TMA copies move whole 8-row groups
MAX_STAGES = 6
SUMS = ("dscale", "dbias", "ddense")
"""Column sums the kernel can return: Σ dy ⊙ x̂, Σ dy, Σ dh (float32, over the M rows)."""
STAGED_SUMS = ("dscale", "ddense")
"""Column sums of values computed in registers, staged through SMEM as bf16 parts for the tensor
core (:func:`_split_bf16`; Σ dy reads dy's pipeline stage directly)."""
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def _accs_per_sum(n: int) -> int:
  return -(-(n // CHUNK) // ACC_ROWS)


def unsupported_reason(m: int, n: int, dtype, n_sums: int = 3) -> str | None:
  """Why the kernel cannot run (M, N) with 16-bit ``dtype`` and ``n_sums`` column sums; None
  when it can."""
  if jnp.dtype(dtype) not in mgpu.SUPPORTED_DTYPES:
    return f"dtype {jnp.dtype(dtype)} (the kernel takes bfloat16 or float16)"
  if m < 1:
    return f"M = {m} (needs at least one row)"
  if n < CHUNK or n % CHUNK:
    return f"N = {n} is not a positive multiple of {CHUNK}"
  if n_sums * _accs_per_sum(n) > MAX_ACCS:
    return (f"N = {n} with {n_sums} column sums needs {n_sums * _accs_per_sum(n)} WGMMA "
            f"accumulators, more than {MAX_ACCS}")
  return None


@dataclasses.dataclass(frozen=True)
class _Plan:
  m: int
  n: int
  dtype: jnp.dtype
  norm: str
  has_scale: bool
  has_dh_out: bool
  sums: tuple[str, ...]
  ctas: int
  stages: int

  @property
  def block_rows(self) -> int:  # rows of a CTA's row block
    return WG_ROWS

  @property
  def step_cols(self) -> int:  # columns of a pipeline step's tiles: one chunk per warpgroup
    return CONSUMERS * CHUNK

  @property
  def chunks(self) -> int:  # 64-column chunks of N
    return self.n // CHUNK

  @property
  def steps_per_pass(self) -> int:
    return -(-self.n // self.step_cols)

  @property
  def blocks(self) -> int:  # row blocks
    return -(-self.m // self.block_rows)

  @property
  def blocks_per_cta(self) -> int:
    return -(-self.blocks // self.ctas)

  @property
  def n_inputs(self) -> int:  # (block_rows, step_cols) tiles per step: dy, x̂, dh_out
    return 2 + self.has_dh_out

  @property
  def staged(self) -> tuple[str, ...]:
    return tuple(q for q in self.sums if q in STAGED_SUMS)

  def parts(self, q: str) -> int:
    """bf16 parts of sum q's staged values: a product of two bf16 values has at most 16
    significant bits, so two parts hold it exactly; float16 products (22 bits) and Σ dh's
    float32 values (24) take three."""
    return 2 if q == "dscale" and self.dtype == _BF16 else 3

  def first_tile(self, q: str) -> int:  # index of sum q's first staged tile
    return sum(self.parts(p) for p in self.staged[:self.staged.index(q)])

  @property
  def staged_tiles(self) -> int:
    return sum(self.parts(q) for q in self.staged)

  @property
  def accs_per_sum(self) -> int:
    return _accs_per_sum(self.n)

  @property
  def one_hot_dtypes(self) -> tuple[jnp.dtype, ...]:
    """A operands' dtypes: bf16 for the staged tiles, dy's for Σ dy (read from its stage)."""
    dtypes = {_BF16} if self.staged else set()
    if "dbias" in self.sums:
      dtypes.add(self.dtype)
    return tuple(sorted(dtypes, key=str))


def _stage_bytes(plan: _Plan) -> int:
  tiles = plan.n_inputs * plan.block_rows * plan.step_cols * jnp.dtype(plan.dtype).itemsize
  return tiles + plan.block_rows * 4 + plan.has_scale * plan.step_cols * 4


def _fixed_bytes(plan: _Plan) -> int:
  out = CONSUMERS * OUT_SLOTS * WG_ROWS * CHUNK * jnp.dtype(plan.dtype).itemsize
  staging = CONSUMERS * _staging_tiles(plan) * WG_ROWS * CHUNK * 2  # also the readout
  one_hots = CONSUMERS * _one_hot_tiles(plan) * ACC_ROWS * WG_ROWS * 2
  row_sums = 2 * CONSUMERS * 2 * WG_ROWS * 4
  return out + staging + one_hots + row_sums + 4096  # + barriers and alignment


def _staging_tiles(plan: _Plan) -> int:
  """Per warpgroup, the staging SMEM in bf16 (64, 64) tiles: the staged sums' parts, at least
  the two that the accumulators' float32 readout takes."""
  return max(2, plan.staged_tiles)


def _one_hot_tiles(plan: _Plan) -> int:
  return plan.accs_per_sum * len(plan.one_hot_dtypes)


def _make_plan(m, n, dtype, norm, has_scale, has_dh_out, sums, interpret) -> _Plan:
  plan = _Plan(m, n, jnp.dtype(dtype), norm, has_scale, has_dh_out, tuple(sums), 1, 1)
  ctas = max(1, min(mgpu.num_sms(interpret), plan.blocks))
  fit = (mgpu.SMEM_BYTES - _fixed_bytes(plan)) // _stage_bytes(plan)
  # A CTA's steps: two passes over the columns of each of its row blocks.
  steps = 2 * plan.steps_per_pass * (-(-plan.blocks // ctas))
  stages = max(1, min(MAX_STAGES, fit, steps))
  return dataclasses.replace(plan, ctas=ctas, stages=stages)


def _one_hot_rows(row, dtype):
  """A (64, 64) WGMMA A operand whose row ``row`` is all ones, the others zeros (all zeros when
  ``row`` is outside [0, 64)): ``A @ B`` adds B's column sums to that accumulator row."""
  rows = lax.broadcasted_iota(jnp.int32, (ACC_ROWS, WG_ROWS), 0)
  return plgpu.layout_cast(jnp.where(rows == row, 1.0, 0.0).astype(dtype), plgpu.Layout.WGMMA)


def _split_bf16(value, parts: int):
  """``parts`` bf16 tiles that add up to the float32 ``value``: each holds the rounding error
  of the ones before it, so two parts keep 16 significant bits and three all 24 (float32);
  the tensor core adds them in float32. The first part is clamped to bf16's largest finite
  value, so a float32 value above it (up to float32's max) stays finite."""
  out, rest = [], value
  for i in range(parts):
    part = (jnp.clip(rest, -_BF16_MAX, _BF16_MAX) if i == 0 else rest).astype(_BF16)
    out.append(part)
    if i + 1 < parts:
      rest = rest - part.astype(_F32)
  return out


def _kernel(*refs, plan: _Plan):
  it = iter(refs)
  dy_gmem, xhat_gmem = next(it), next(it)
  dho_gmem = next(it) if plan.has_dh_out else None
  rstd_gmem = next(it)  # padded to whole row blocks
  scale_gmem = next(it) if plan.has_scale else None  # (1, N) f32
  dh_gmem = next(it)
  sums_gmem = next(it) if plan.sums else None  # (ctas, CONSUMERS, accs, 64, 64) f32
  steps, inv_n = plan.steps_per_pass, 1.0 / plan.n
  # Tiled (the SMEM layout of WGMMA operands); its TMA needs whole 8-row groups, hence M padded
  # to a multiple of 8.
  transforms = mgpu.swizzle_transforms(CHUNK, plan.dtype)
  cta = lax.axis_index("cta")

  def step_coords(s):  # (local row block, pass, column step) of pipeline step s
    return s // (2 * steps), (s // steps) % 2, s % steps

  def block_of(s):  # the row block of step s; past the CTA's share, its last valid one
    r, _, _ = step_coords(s)
    return jnp.minimum(cta + r * plan.ctas, plan.blocks - 1)

  spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
  tile_spec = spec((plan.block_rows, plan.step_cols),
                   lambda s: (block_of(s), step_coords(s)[2]), transforms=transforms)
  in_specs = [tile_spec] * plan.n_inputs + [spec((plan.block_rows,), lambda s: (block_of(s),))]
  if plan.has_scale:
    in_specs.append(spec((1, plan.step_cols), lambda s: (0, step_coords(s)[2])))
  gmems = [r for r in (dy_gmem, xhat_gmem, dho_gmem, rstd_gmem, scale_gmem) if r is not None]

  @functools.partial(
      pl.run_scoped,
      out_smem=plgpu.SMEM((CONSUMERS, OUT_SLOTS, WG_ROWS, CHUNK), plan.dtype,
                          transforms=transforms),
      # Staged bf16 parts of the column-summed values; at the end, the accumulators' float32
      # readout, once both warpgroups are past their last staging (``done``).
      sum_smem=plgpu.RefUnion(
          plgpu.SMEM((CONSUMERS, _staging_tiles(plan), WG_ROWS, CHUNK), _BF16,
                     transforms=mgpu.swizzle_transforms(CHUNK, _BF16)),
          plgpu.SMEM((CONSUMERS, ACC_ROWS, CHUNK), _F32)),
      one_hot_smem=tuple(  # per A dtype
          plgpu.SMEM((CONSUMERS, plan.accs_per_sum, ACC_ROWS, WG_ROWS), dtype,
                     transforms=mgpu.swizzle_transforms(WG_ROWS, dtype))
          for dtype in plan.one_hot_dtypes),
      # Each warpgroup's row sums over its columns, (row block parity, wg, Σg·x̂ / Σg).
      row_sum_smem=plgpu.SMEM((2, CONSUMERS, 2, WG_ROWS), _F32),
      row_sums_ready=plgpu.Barrier(num_arrivals=CONSUMERS),
      done=plgpu.Barrier(num_arrivals=CONSUMERS),
      collective_axes="wg",
  )
  def _scope(out_smem, sum_smem, one_hot_smem, row_sum_smem, row_sums_ready, done):
    stage_smem, readout_smem = sum_smem
    wg = lax.axis_index("wg")
    # This warpgroup's (64, 64) part of a step's tiles, and its 64-column chunk index.
    rows = pl.ds(0, WG_ROWS)
    cols = pl.ds(wg * CHUNK, CHUNK)
    chunk_of = lambda c: c * CONSUMERS + wg  # noqa: E731
    wgmma = plgpu.Layout.WGMMA
    zero_parts = (mgpu.lane_partial_zeros(WG_ROWS),) * 2

    def stage_column_sums(j, values):
      """Write the SMEM operands of chunk j's column sums: each staged sum's bf16 parts
      (``values``: name → a function giving its (64, 64) float32 tile, called only for the
      requested sums) and the one-hot A tiles. The caller commits them (``commit_smem``)."""
      for q in plan.staged:
        for h, part in enumerate(_split_bf16(values[q](), plan.parts(q))):
          stage_smem[wg, plan.first_tile(q) + h] = part
      for dtype, ref in zip(plan.one_hot_dtypes, one_hot_smem):
        for k in range(plan.accs_per_sum):
          ref[wg, k] = _one_hot_rows(j - k * ACC_ROWS, dtype)

    def add_column_sums(accs, dy_tile):
      """Issue acc[j] += Σ_rows value for each column sum of the staged chunk j: WGMMAs of the
      one-hot A with the value's tile as B, so no reduction crosses warps. Sum q's
      accumulators are ``accs[q · accs_per_sum + j // 64]``. The caller waits for the WGMMAs
      before the SMEM they read is reused."""
      one_hot = dict(zip(plan.one_hot_dtypes, one_hot_smem))
      for qi, q in enumerate(plan.sums):
        for k in range(plan.accs_per_sum):
          acc = accs[qi * plan.accs_per_sum + k]
          if q in STAGED_SUMS:
            a = one_hot[_BF16].at[wg, k]
            for h in range(plan.parts(q)):
              plgpu.wgmma(acc, a, stage_smem.at[wg, plan.first_tile(q) + h])
          else:  # dbias: dy's own tile
            plgpu.wgmma(acc, one_hot[plan.dtype].at[wg, k], dy_tile)

    def row_means(r, gx_part, g_part):
      """mean_N(g ⊙ x̂) and mean_N(g) of the row block's rows (both warpgroups' column halves,
      published at the end of the first pass), in the row layout."""
      del gx_part, g_part
      # Both warpgroups add the two halves in the same order, so they agree on every bit.
      half = row_sum_smem.at[r % 2]
      load = lambda w, q: plgpu.load(half.at[w, q], layout=wgmma.reduce(1))  # noqa: E731
      return ((load(0, 0) + load(1, 0)) * inv_n, (load(0, 1) + load(1, 1)) * inv_n)

    def body(idxs, *refs):
      (s,) = idxs
      *refs, carry = refs
      accs, parts = carry
      dy_smem, xhat_smem = refs.pop(0), refs.pop(0)
      dho_smem = refs.pop(0) if plan.has_dh_out else None
      rstd_smem = refs.pop(0)
      scale_smem = refs.pop(0) if plan.has_scale else None
      r, p, c = step_coords(s)
      j = chunk_of(c)
      valid = cta + r * plan.ctas < plan.blocks
      in_n = j < plan.chunks  # N % 128 = 64: the last step's second half is past N
      tile = lambda ref: ref.at[rows, cols]  # noqa: E731
      load_f32 = lambda ref: plgpu.load(tile(ref), layout=wgmma).astype(_F32)  # noqa: E731
      dy, xhat = load_f32(dy_smem), load_f32(xhat_smem)  # zeros past N (TMA zero fill)
      g = dy
      if plan.has_scale:
        scale = plgpu.load(scale_smem.at[0, cols], layout=wgmma.reduce(0))
        g = dy * lax.broadcast_in_dim(scale, dy.shape, [1])

      def first_pass(parts):  # this step's row sums, from zero at a row block's first step
        parts = lax.cond(c == 0, lambda: zero_parts, lambda: parts)
        gx_part = parts[0] + mgpu.lane_partial_sum(g * xhat)
        g_part = parts[1] + mgpu.lane_partial_sum(g) if plan.norm == "layer" else parts[1]
        return gx_part, g_part

      parts = lax.cond(p == 0, first_pass, lambda parts: parts, parts)
      gx_part, g_part = parts

      @pl.when((p == 0) & (c == steps - 1))
      def _publish_row_sums():
        row_sum_smem[r % 2, wg, 0] = jnp.sum(gx_part, axis=1)
        row_sum_smem[r % 2, wg, 1] = jnp.sum(g_part, axis=1)
        plgpu.barrier_arrive(row_sums_ready)

      @pl.when((p == 1) & (c == 0))
      def _await_row_sums():
        plgpu.barrier_wait(row_sums_ready)

      second_pass = (p == 1) & valid & in_n

      @pl.when(second_pass)
      def _second_pass():
        mean_gx, mean_g = row_means(r, gx_part, g_part)
        inner = g - xhat * lax.broadcast_in_dim(mean_gx, g.shape, [0])
        if plan.norm == "layer":
          inner = inner - lax.broadcast_in_dim(mean_g, g.shape, [0])
        rstd = plgpu.load(rstd_smem.at[rows], layout=wgmma.reduce(1))
        dh = inner * lax.broadcast_in_dim(rstd, g.shape, [0])
        if plan.has_dh_out:
          dh = dh + plgpu.load(tile(dho_smem), layout=wgmma).astype(_F32)
        if plan.sums:
          stage_column_sums(j, {"dscale": lambda: dy * xhat, "ddense": lambda: dh})
        slot = (r * steps + c) % OUT_SLOTS
        # The store that last read this slot (OUT_SLOTS stores ago) must be done.
        plgpu.wait_smem_to_gmem(OUT_SLOTS - 1, wait_read_only=True)
        out_smem[wg, slot] = dh.astype(plan.dtype)
        # One fence and barrier for all of this step's SMEM writes (read next by the tensor
        # core and the TMA store), also ordering the stage's reads before its release.
        plgpu.commit_smem()
        if plan.sums:
          add_column_sums(accs, tile(dy_smem))
        row0 = (cta + r * plan.ctas) * plan.block_rows
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                dh_gmem.at[pl.ds(row0, WG_ROWS), pl.ds(j * CHUNK, CHUNK)])
        if plan.sums:  # the stage (dy) and the staged tiles are free once the WGMMAs are done
          plgpu.wgmma_wait(0)

      @pl.when(~second_pass)
      def _release_reads():
        # The stage's reads (generic proxy) precede its release to the TMA producer (async
        # proxy); the second pass's commit_smem already did this.
        plgpu.commit_smem()

      return accs, parts

    def compute_context(eval_pipeline):
      def with_accs(*accs):
        eval_pipeline((accs, zero_parts))
        if accs:
          plgpu.barrier_arrive(done)
          plgpu.barrier_wait(done)
        for k, acc in enumerate(accs):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous readout's store
          readout_smem[wg] = acc[...]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(readout_smem.at[wg], sums_gmem.at[cta, wg, k])
        plgpu.wait_smem_to_gmem(0)

      if plan.sums:
        pl.run_scoped(with_accs, *[plgpu.ACC((ACC_ROWS, CHUNK), _F32)
                                   for _ in range(len(plan.sums) * plan.accs_per_sum)])
      else:
        with_accs()

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(2 * steps * plan.blocks_per_cta,), memory_registers=40,
        in_specs=in_specs, wg_axis="wg", num_compute_wgs=CONSUMERS,
        max_concurrent_steps=plan.stages, compute_context=compute_context)
    pipeline(*gmems)


def norm_backward(dy, xhat, rstd, scale=None, dh_out=None, *, norm: str,
                  sums: tuple[str, ...] = (), interpret: bool = False):
  """dh and the column partial sums of the post-norm backward, one Mosaic-GPU kernel.

  Args:
    dy: (M, N) cotangent of y, bfloat16 or float16.
    xhat: (M, N) x̂ = (h − mean) · rstd (RMS: h · rstd) in dy's dtype, saved by the forward.
    rstd: (M,) float32.
    scale: optional (N,) norm scale γ (any float dtype; used in float32).
    dh_out: optional (M, N) in dy's dtype, added to dh (the cotangent of a returned h).
    norm: "rms" or "layer".
    sums: which column sums to return, a sub-sequence of :data:`SUMS`.
    interpret: run in Pallas GPU interpret mode (CPU), :func:`mgpu.interpret_params`.

  Returns:
    ``(dh, partials)``: dh (M, N) in dy's dtype; partials (ctas, :data:`CONSUMERS`, len(sums), N) float32
    whose sum over the first two axes is each requested column sum (None when ``sums`` is
    empty). Sum them in a fixed order for deterministic bits.

  Raises:
    ValueError: a shape, dtype, norm or sum name the kernel does not take
      (:func:`unsupported_reason`).
    TypeError: an argument that is not an array, or rstd not a real float.
  """
  if norm not in ("rms", "layer"):
    raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
  if (not isinstance(sums, (tuple, list)) or any(s not in SUMS for s in sums)
      or len(set(sums)) != len(sums)):
    raise ValueError(f"sums must be distinct names from {SUMS}, got {sums!r}")
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
                    interpret)
  out_type = [jax.ShapeDtypeStruct((m, n), dy.dtype)]
  if sums:
    out_type.append(jax.ShapeDtypeStruct(
        (plan.ctas, CONSUMERS, len(sums) * plan.accs_per_sum, ACC_ROWS, CHUNK), _F32))
  call = plgpu.kernel(
      functools.partial(_kernel, plan=plan),
      out_type=tuple(out_type),
      grid=(plan.ctas,),
      grid_names=("cta",),
      num_threads=CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          # No scratch: every reduction stays within a warp (a cross-warp one would fail to
          # compile rather than share one buffer between the two consumer warpgroups).
          reduction_scratch_bytes=0),
      interpret=mgpu.interpret_params() if interpret else None,
  )
  rstd_padded = jnp.pad(rstd.astype(_F32), (0, plan.blocks * plan.block_rows - m + pad))
  tiles = [mgpu.pad_rows(a, pad) for a in (dy, xhat, dh_out) if a is not None]
  args = tiles + [rstd_padded] + ([] if scale is None else [scale.astype(_F32)[None, :]])
  outs = call(*args)
  dh = outs[0][:m - pad] if pad else outs[0]
  return dh, (_column_partials(outs[1], plan) if sums else None)


def _column_partials(acc_rows, plan: _Plan):
  """(ctas, CONSUMERS, sums · accs_per_sum, 64, chunk) accumulator rows → (ctas, CONSUMERS,
  sums, N): row c of a sum's accumulators holds its columns ``c · chunk …``."""
  ctas, n_sums = acc_rows.shape[0], len(plan.sums)
  rows = acc_rows.reshape(ctas, CONSUMERS, n_sums, plan.accs_per_sum * ACC_ROWS, CHUNK)
  return rows[:, :, :, :plan.chunks].reshape(ctas, CONSUMERS, n_sums, plan.n)

