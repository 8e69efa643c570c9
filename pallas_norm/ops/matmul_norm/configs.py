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
# 4102) although the forward wins (872 vs 969, 1096 vs 1266).
KERNEL_DEFAULT_MAX_N = {"layer": 2048, "rms": 512}


KERNEL_DEFAULT_MIN_M = 4096
"""Fewest rows (M) at which ``implementation=None`` takes the kernel. H200, LayerNorm + residual
at K = N = 1024 (the Kunlun model's interaction MLP), fwd+bwd, CUPTI µs, XLA vs kernel
(`benchmarks/results/logs/2026-12-02_s15_gemm3_ab.log`): M = 768 51.4 vs 55.7 (slower: 6 row
blocks, 6 clusters of 4 CTAs on 132 SMs; the train step's MLP trained 0.87× with the kernels,
`2026-12-02_s14_train_step.log`), M = 4096 160.2 vs 97.8, M = 16384 336.4 vs 246.0."""


def kernel_slower_reason(m: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA for M rows of width N, or None to take the kernel."""
  limit = KERNEL_DEFAULT_MAX_N[norm]
  if n > limit:
    return (f"N = {n}: past {limit} the {norm} Mosaic kernel is measured slower than XLA in "
            "training on the H200 (pass implementation='mosaic' to force it)")
  if m < KERNEL_DEFAULT_MIN_M:
    return (f"M = {m}: below {KERNEL_DEFAULT_MIN_M} rows the Mosaic kernel is measured slower "
            "than XLA in training on the H200 (pass implementation='mosaic' to force it)")
  return None


def norm_backward_kernel(m: int, n: int, norm: str) -> str:
  """Which one-pass kernel computes the backward's dh and column sums: "mosaic"
  (:mod:`.mosaic_bwd`, two passes over each 64-row block, the second from L2; ~1.6× its bytes
  floor at 262144×512) or "triton" (:func:`pallas_norm.ops.norms.triton.norm_backward`: full
  rows in registers, one pass; not yet timed). The Mosaic kernel until the H200 says otherwise."""
  del m, n, norm
  return "mosaic"
