"""When norm_matmul takes its kernels, and which of their paths: thresholds measured on the H200
(benchmarks/results/nvidia-h200.md)."""

from __future__ import annotations

from pallas_norm.ops.matmul_norm import mosaic as post_norm
from pallas_norm.ops.norm_matmul import mosaic_bwd

# Largest K and N, per norm, at which the H200 benchmark (benchmarks/results/nvidia-h200.md)
# measured the op faster than XLA's unfused one forward *and* forward+backward (training is the
# use that matters; two exceptions below train faster with a forward that ties). Session 3's
# suite (commit c22661a, 262144×1024²): LayerNorm forward 859 vs 1044 µs, fwd+bwd 3145 vs 4529;
# RMSNorm forward 812 vs 977, fwd+bwd 2749 vs 2875 (it lost by 2% before statistics once per row
# block became the default). At 262144×512×2048 both norms lose forward+backward (RMS 3077 vs
# 2540 µs), so the limit stays at 1024 (issue 4).
KERNEL_DEFAULT_MAX_KN = {"layer": 1024, "rms": 1024}

WIDE_MAX_K, WIDE_MAX_N = 512, 2048
"""Both norms also train with the kernel for K ≤ 512 up to N = 2048, where the backward's x̂
(M × K) replaces XLA's scaled dy (M × N). H200, bf16, 262144×512×2048, fwd+bwd µs: RMSNorm
2853.9 vs XLA's 3383.5 (CUPTI, the suite, 2026-12-02); LayerNorm, once the dx kernel summed its
rows in its epilogue (``api._takes_row_sums``), 2636.1 vs 2938.2 CUPTI, 3081.4 vs 3235.7 wall
clock (session 17, ``benchmarks/results/logs/2026-12-02_s17_gemm5_ab.log``; before, with the
XLA row-terms pass and the bias guard, 3540.1 wall clock). Their forward alone ties or loses
there (RMSNorm 853 vs 851, LayerNorm 932 vs 881, the suite at c22661a), so a forward that is
not differentiated runs XLA for LayerNorm (:func:`kernel_slower_forward_reason`). LayerNorm
takes them only where K splits over a cluster (:func:`_k_splits`; not K = 320, 448): elsewhere
its backward has the XLA row-terms pass and the bias guard again."""


LAYER_SQUARE_MAX_KN = 2048
"""LayerNorm also takes the kernel for K = N up to 2048: there it trains faster than XLA although
the forward ties (H200, the suite, bf16, µs, kernel vs XLA, fwd+bwd / fwd): 262144×2048²
11484 vs 12544 / 3426 vs 3399, 65536×2048² 2729 vs 3115 / 881 vs 850 (commit c22661a, before
the x̂ backward that took 8–16% off LayerNorm's training elsewhere). At K = 512, N = 2048 it
trains slower (3272 vs 2925), so the rule is K = N, the shapes measured."""

RMS_FORWARD_MAX_KN = 2048
"""RMSNorm's forward alone also takes the kernel for K = N up to 2048, where it trains slower:
H200, the suite, CUPTI µs, kernel vs XLA, forward / fwd+bwd: 262144×2048² 2994.5 vs 3291.3 /
10640.2 vs 9892.2, 65536×2048² 758.9 vs 819.8 / 2421.1 vs 2407.9. At 32768×4096² the forward
loses (1528.2 vs 1496.0)."""

KERNEL_DEFAULT_MIN_M = 65536
"""Fewest rows (M, the product of x's leading dimensions) at which ``implementation=None`` takes
the kernel: the smallest M the H200 measured it faster than XLA in training (65536×2048², the
suite). Below, LayerNorm at K = 576, N = 512 (the Kunlun model's K/V summary) trained slower at
every M measured, fwd+bwd wall clock of back-to-back calls (the kernel path's bias guard defeats
CUPTI), µs, XLA vs kernel: M = 768 154.6 vs 227.7, 4096 182.8 vs 233.2, 16384 176.6 vs 274.1
(`benchmarks/results/logs/2026-12-02_s15_gemm3_ab.log`)."""


def kernel_slower_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA to train (forward+backward) x (M, K) @ w (K, N), or
  None to take the kernel."""
  limit = KERNEL_DEFAULT_MAX_KN[norm]
  # LayerNorm's wide shapes train faster only with the row sums in the dx epilogue, which
  # needs K split into one column tile per CTA of a cluster (K = 320 or 448 does not split).
  wide = k <= WIDE_MAX_K and n <= WIDE_MAX_N and (norm == "rms" or _k_splits(k))
  square_layer = norm == "layer" and k == n <= LAYER_SQUARE_MAX_KN
  if (k > limit or n > limit) and not (wide or square_layer):
    return (f"K = {k}, N = {n}: past {limit} the {norm} Mosaic kernel is measured slower than XLA "
            "in training on the H200 (pass implementation='mosaic' to force it)")
  return _small_m_reason(m)


def _k_splits(k: int) -> bool:
  """Whether K splits into one column tile per CTA of a cluster, as the dx kernel's row sums in
  the epilogue need on a GPU (the kernel's own rule, ``mosaic_bwd._k_split``)."""
  return mosaic_bwd._k_split(k, interpret=False) is not None  # pylint: disable=protected-access


def kernel_slower_forward_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA for a forward of x (M, K) @ w (K, N) that is not
  differentiated, or None to take the kernel: where training takes it, and RMSNorm at K = N ≤
  :data:`RMS_FORWARD_MAX_KN`; not LayerNorm past K, N ≤ 1024 but for K = N (the wide shapes of
  :data:`WIDE_MAX_K`, where only training is faster on the kernel)."""
  if norm == "rms" and k == n <= RMS_FORWARD_MAX_KN:
    return _small_m_reason(m)
  limit = KERNEL_DEFAULT_MAX_KN[norm]
  if norm == "layer" and k != n and max(k, n) > limit:
    return (f"K = {k}, N = {n}: the forward alone of the layer Mosaic kernel is measured slower "
            "than XLA's there on the H200 (it trains faster: pass implementation='mosaic' to "
            "force it)")
  return kernel_slower_reason(m, k, n, norm)


def _small_m_reason(m: int) -> str | None:
  if m < KERNEL_DEFAULT_MIN_M:
    return (f"M = {m}: below {KERNEL_DEFAULT_MIN_M} rows the Mosaic kernel is measured slower "
            "than XLA on the H200 (pass implementation='mosaic' to force it)")
  return None


FUSED_ROW_TERMS_MAX_KN = 512
"""Largest K and N where the backward computes dx's row terms (y_term, c_term) inside the dx
kernel's K loop (``norm_matmul_dx(..., y=...)``) instead of in an XLA pass over dy and y before
it (LayerNorm only). H200:

* dx with its row terms alone (``benchmarks/gpu_norm_matmul_check.py --sections dx``):
  262144×512² LayerNorm 392 vs 424 µs (XLA pass + dx kernel), RMSNorm 366 vs 413; 65536×2048²
  1.14-1.27× slower (the kernel's extra y stream and sums are not hidden and cost a stage).
* The public API's fwd+bwd at 262144×512² (``--sections train``, same run): LayerNorm 1062 vs
  1097 µs, but RMSNorm 946 vs 894: without col_sum, XLA fuses the row-terms pass with the
  weight gradients' pass over dy, so moving it into the kernel saves less than it costs there.
* K = N = 1024 (session 7; LayerNorm, public fwd+bwd): slower fused, 3253 vs 3194 µs without a
  bias (CUPTI) and 3637 vs 3440 with one (wall clock); at 512² the same run ties without a bias
  (1099 vs 1100) and gains with one (1153 vs 1176)."""


def fused_row_terms_pay(k: int, n: int, norm: str) -> bool:
  """Whether the dx kernel computes its own row terms for x (M, k) @ w (k, n): LayerNorm up to
  :data:`FUSED_ROW_TERMS_MAX_KN`."""
  return norm == "layer" and max(k, n) <= FUSED_ROW_TERMS_MAX_KN


def x_hat_pays(k: int, n: int, norm: str) -> bool:
  """Whether the backward takes x̂ from the dx kernel (``norm_matmul_dx(...,
  return_x_hat=True)``) and forms dW_γ = x̂ᵀ dy, instead of scaling dy in an XLA pass
  (``rstd ⊙ dy``, M × N written and read again by the GEMM; RMSNorm only,
  :func:`.xla.rms_weight_grads`).

  Bytes per row (16-bit): x̂ costs 2K written by the dx kernel (in its epilogue, which the
  tensor core waits for: ~60-80 µs at 262144×512² by the bytes); it saves the scaled dy's 2N
  written by XLA. LayerNorm always takes x̂ (the uncentered form also needs the rank-1 term
  ``Σ_i rstd_i mean_i dy_i``, one more column reduction over M × N, whose cancellation for
  rows with a large mean needs matching roundings); RMSNorm where K < N, the bytes saved more
  than those added (at K = N it is a wash by the bytes, and the kernel's write, unlike XLA's,
  delays the tensor core). Chosen from those bytes; on the H200 x̂ was faster for LayerNorm at
  512² and 512×2048 and for RMSNorm at 512×2048 (benchmarks/NOTES.md, pre-norm backward); RMSNorm
  at K = N keeps the scaled dy, not yet timed against x̂.

  With x̂ and a norm bias, x̂ always ends with a ones block (``x_hat_ones``), so dW_γ's GEMM
  also gives Σ_i dy_i instead of a column reduction over dy: fewer bytes at every K, N ≥ 64
  (one more epilogue tile of the GEMM against 2N bytes per row of dy read)."""
  return norm == "layer" or k < n
