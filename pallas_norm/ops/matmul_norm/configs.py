"""When matmul_norm takes its kernels: thresholds measured on the H200
(benchmarks/results/nvidia-h200.md)."""

from __future__ import annotations

# Widest N, per norm, at which the H200 benchmark (benchmarks/results/nvidia-h200.md) measured
# the op faster than XLA's unfused one in training (forward+backward), without losing more than
# run-to-run spread forward. LayerNorm (+ residual): N ≤ 2048 since session 8's shared-ring K
# loop (one N tile per CTA up to 2048); session 10's suite: forward 963 vs 1160 µs at
# 262144×1024², 1418 vs 1725 at 262144×512×2048, 840 vs 921 at 65536×2048², 3402 vs 3716 at
# 262144×2048²; fwd+bwd 3296 vs 4663, 4537 vs 7179, 2830 vs 3265, 11784 vs 13195. At N = 4096 a
# CTA loops over N tiles and the forward loses (4904 vs 3218 at K = 512). RMSNorm: N ≤ 512
# since session 7's norm-backward kernel (session 10: fwd+bwd 222 vs 247 µs at 128², 421 vs 470
# at 256², 1037 vs 1039 at 512²); at 1024² and 512×2048 fwd+bwd loses (3162 vs 2980, 4270 vs
# 4102) although the forward wins (872 vs 969, 1096 vs 1266). Training only: the forward alone
# follows :func:`kernel_slower_forward_reason`; both norms also train with the kernel at K ≤ 512
# on wider rows (LAYER_WIDE_TRAINING_*, RMS_WIDE_TRAINING_*).
KERNEL_DEFAULT_MAX_N = {"layer": 2048, "rms": 512}


KERNEL_DEFAULT_MIN_M = 4096
"""Fewest rows (M) at which ``implementation=None`` takes the kernel. H200, LayerNorm + residual
at K = N = 1024 (the Kunlun model's interaction MLP), fwd+bwd, CUPTI µs, XLA vs kernel
(`benchmarks/results/logs/2026-12-02_s15_gemm3_ab.log`): M = 768 51.4 vs 55.7 (slower: 6 row
blocks, 6 clusters of 4 CTAs on 132 SMs; the train step's MLP trained 0.87× with the kernels,
`2026-12-02_s14_train_step.log`), M = 4096 160.2 vs 97.8, M = 16384 336.4 vs 246.0."""


LAYER_WIDE_TRAINING_MAX_K, LAYER_WIDE_TRAINING_MAX_N = 512, 4096
"""LayerNorm also trains with the kernel at K ≤ 512 up to N = 4096, where its forward loses:
H200, the suite, 262144×512×4096 LayerNorm + residual, CUPTI µs, kernel vs XLA: fwd+bwd 13302.8
vs 14565.4, forward 4903.6 vs 3218.0 (a CTA loops over 2 N tiles). So a forward that is not
differentiated runs XLA there and training the kernel (:func:`kernel_slower_forward_reason`).
Past K = 512 (32768×4096², 16384×8192²) and at N = 8192 XLA trains faster. Session 16 (the norm
backward by the row kernel, `2026-12-02_s16_gemm4_ab.log`): implementation=None 12312.6 vs XLA
14249.5 µs fwd+bwd, forward alone 3247.6 for both (it runs XLA's)."""

RMS_WIDE_TRAINING_MAX_K, RMS_WIDE_TRAINING_MAX_N = 512, 2048
"""RMSNorm also trains with the kernel at K ≤ 512 up to N = 2048, since its norm backward is the
one-pass row kernel: H200, session 16 (`benchmarks/results/logs/2026-12-02_s16_gemm4_ab.log`),
CUPTI µs, fwd+bwd kernel vs XLA: 262144×512×2048 3832.5 vs 4127.7 (4269.9 with the Mosaic norm
backward); at 1024² a tie, 3023.5 vs 3016.0, so XLA trains there."""

RMS_FORWARD_MAX_K, RMS_FORWARD_MAX_N = 1024, 2048
"""RMSNorm's forward alone takes the kernel up to K ≤ 1024, N ≤ 2048 although it trains slower
past N = 512 (the forward kernel writes x̂ for the backward, which the timed forward does not):
H200, the suite, CUPTI µs, kernel vs XLA, forward / fwd+bwd: 262144×1024² 871.6 vs 968.9 /
3162.3 vs 2980.0, 262144×512×2048 1095.7 vs 1266.4 / 4269.9 vs 4101.6; at K = 2048 the forward
ties or loses (65536×2048² 790.5 vs 804.7, 262144×2048² 3342.7 vs 3223.1)."""


def kernel_slower_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA to train (forward+backward) x (M, K) @ w (K, N),
  or None to take the kernel."""
  limit = KERNEL_DEFAULT_MAX_N[norm]
  wide = {"layer": (LAYER_WIDE_TRAINING_MAX_K, LAYER_WIDE_TRAINING_MAX_N),
          "rms": (RMS_WIDE_TRAINING_MAX_K, RMS_WIDE_TRAINING_MAX_N)}[norm]
  if n > limit and not (k <= wide[0] and n <= wide[1]):
    return (f"K = {k}, N = {n}: the {norm} Mosaic kernel is measured slower than XLA in "
            "training on the H200 (pass implementation='mosaic' to force it)")
  return _small_m_reason(m)


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
