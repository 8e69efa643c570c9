"""When matmul_norm takes its kernels: thresholds measured on the H200 (the times:
``benchmarks/NOTES.md``, "Post-norm forward", routing)."""

from __future__ import annotations

# Widest N, per norm, at which the op trained (forward+backward) faster than XLA's unfused one
# without losing more than run-to-run spread forward. LayerNorm (+ residual): N ≤ 2048, where a
# CTA holds one N tile on the shared ring; at N = 4096 a CTA loops over N tiles and the forward
# loses. RMSNorm: N ≤ 512; at 1024×2048 training lost although the forward won (the training
# forward also writes x̂). Training only: the forward alone follows
# :func:`kernel_slower_forward_reason`; both norms also train with the kernel at K ≤ 512 on
# wider rows (LAYER_WIDE_TRAINING_*, RMS_WIDE_TRAINING_*), RMSNorm at K = N = 1024 with enough
# rows (RMS_SQUARE_TRAINING_*).
KERNEL_DEFAULT_MAX_N = {"layer": 2048, "rms": 512}


KERNEL_DEFAULT_MIN_M = 4096
"""Fewest rows (M) at which ``implementation=None`` takes the kernel. At K = N = 1024 (the
Kunlun model's interaction MLP, LayerNorm + residual) the kernel trained slower than XLA at
M = 768 (6 row blocks: 6 clusters of 4 CTAs on 132 SMs) and faster from M = 4096."""


WHOLE_BACKWARD_MIN_M = 16384
"""Fewest rows at which the kernel path's backward at K = N = 128 runs as the one whole-backward
kernel (``api._whole_backward``) instead of the row kernel and cuBLAS's GEMMs. Measured on an
H100 (fwd+bwd, both norms): faster from M = 16384 (RMSNorm 26.8 → 24.8 µs, LayerNorm + residual
35.6 → 30.0), slower at 4096 (18.4 → 19.5, 22.2 → 22.8), where it runs 32 CTAs
(``benchmarks/NOTES.md``, "Post-norm backward")."""


LAYER_WIDE_TRAINING_MAX_K, LAYER_WIDE_TRAINING_MAX_N = 512, 4096
"""LayerNorm also trains with the kernel at K ≤ 512 up to N = 4096, where its forward loses (a
CTA loops over 2 N tiles). So a forward that is not differentiated runs XLA there and training
the kernel (:func:`kernel_slower_forward_reason`; the by-use ``custom_vjp`` measured no cost).
Past K = 512 and at N = 8192 XLA trains faster."""

RMS_WIDE_TRAINING_MAX_K, RMS_WIDE_TRAINING_MAX_N = 512, 2048
"""RMSNorm also trains with the kernel at K ≤ 512 up to N = 2048, since its norm backward is the
one-pass row kernel."""

RMS_SQUARE_TRAINING_KN, RMS_SQUARE_TRAINING_MIN_M = 1024, 262144
"""RMSNorm also trains on the kernel path at K = N = 1024 from 262144 rows, the one M measured at
that shape. There the plain bfloat16 call (no dense bias, residual, norm bias, returned h or
statistics) trains composed (:func:`composed_training_reason`): the fused forward's epilogue,
run after each row block's K loop, costs more than a separate norm pass over h. Fewer rows were
not measured and keep XLA. Measured: ``benchmarks/NOTES.md``, "Post-norm forward", routing and
"Post-norm backward"."""

RMS_FORWARD_MAX_K, RMS_FORWARD_MAX_N = 1024, 2048
"""RMSNorm's forward alone takes the kernel up to K ≤ 1024, N ≤ 2048 although it trains slower
past N = 512 (the training forward writes x̂ for the backward, which the forward alone does
not); at K = 2048 the forward ties or loses."""


def kernel_slower_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA to train (forward+backward) x (M, K) @ w (K, N),
  or None to take the kernel."""
  limit = KERNEL_DEFAULT_MAX_N[norm]
  wide = {"layer": (LAYER_WIDE_TRAINING_MAX_K, LAYER_WIDE_TRAINING_MAX_N),
          "rms": (RMS_WIDE_TRAINING_MAX_K, RMS_WIDE_TRAINING_MAX_N)}[norm]
  if n > limit and not (k <= wide[0] and n <= wide[1]):
    if norm == "rms" and k == n == RMS_SQUARE_TRAINING_KN:
      if m >= RMS_SQUARE_TRAINING_MIN_M:
        return None
      return (f"M = {m}, K = N = {k}: the rms Mosaic kernel trains faster than XLA there only "
              f"from the {RMS_SQUARE_TRAINING_MIN_M} rows measured on the H200 (pass "
              "implementation='mosaic' to force it)")
    return (f"K = {k}, N = {n}: the {norm} Mosaic kernel is measured slower than XLA in "
            "training on the H200 (pass implementation='mosaic' to force it)")
  return _small_m_reason(m)


def composed_training_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why a training call that ``implementation=None`` puts on the kernel path runs the fused
  kernel, or None to run it composed: cuBLAS's GEMM for h, then :func:`pallas_norm.rms_norm`,
  whose own ``None`` takes the standalone norm kernels (a forward that saves rstd, a one-pass
  backward reading h), as torch.compile's inductor splits it. Measured faster than the fused
  kernel (whose training forward writes y and x̂ after each row block's K loop) at RMSNorm
  K = N = 1024 with :data:`RMS_SQUARE_TRAINING_MIN_M` rows."""
  if norm == "rms" and k == n == RMS_SQUARE_TRAINING_KN and m >= RMS_SQUARE_TRAINING_MIN_M:
    return None
  return f"{norm}, M = {m}, K = {k}, N = {n}: the fused kernel trains faster or was not compared"


def kernel_slower_forward_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA for a forward of x (M, K) @ w (K, N) that is not
  differentiated, or None to take the kernel."""
  if norm == "rms":
    faster = k <= RMS_FORWARD_MAX_K and n <= RMS_FORWARD_MAX_N
  else:
    faster = n <= KERNEL_DEFAULT_MAX_N["layer"]
  if not faster:
    return (f"K = {k}, N = {n}: the {norm} Mosaic kernel's forward is measured slower than "
            "XLA's on the H200 (pass implementation='mosaic' to force it)")
  return _small_m_reason(m)


def _small_m_reason(m: int) -> str | None:
  if m < KERNEL_DEFAULT_MIN_M:
    return (f"M = {m}: below {KERNEL_DEFAULT_MIN_M} rows the Mosaic kernel is measured slower "
            "than XLA on the H200 (pass implementation='mosaic' to force it)")
  return None
