"""When norm_matmul takes its kernels, and which of their paths: thresholds measured on the H200
(benchmarks/results/nvidia-h200.md); and the split of K the dx kernel's row sums need
(:func:`k_split`), which those limits ask too."""

from __future__ import annotations

from pallas_norm import mgpu

# Largest K and N, per norm, at which the H200 benchmark (benchmarks/results/nvidia-h200.md)
# measured the op faster than XLA's unfused one forward *and* forward+backward (training is the
# use that matters; the exceptions below train faster with a forward that ties). At 262144×512×2048
# the suite's route of the time lost forward+backward for both norms, so the limit stays at 1024
# (issue 4; measured: benchmarks/NOTES.md, "Pre-norm forward", the table).
KERNEL_DEFAULT_MAX_KN = {"layer": 1024, "rms": 1024}

WIDE_MAX_K, WIDE_MAX_N = 512, 2048
"""Both norms also train with the kernel for K ≤ 512 up to N = 2048, where the backward's x̂
(M × K) replaces XLA's scaled dy (M × N), which is the larger array: RMSNorm with x̂, LayerNorm
once the dx kernel summed its rows in its epilogue (``api._takes_row_sums``) instead of the XLA
row-terms pass and the bias guard. Their forward alone ties or loses there, so a forward that is
not differentiated runs XLA for LayerNorm (:func:`kernel_slower_forward_reason`). LayerNorm
takes them only where K splits over a cluster (:func:`_k_splits`; not K = 320, 448): elsewhere
its backward has the XLA row-terms pass and the bias guard again. Measured:
``benchmarks/NOTES.md``, "Pre-norm backward" and "Row sums in the dx epilogue"."""


LAYER_SQUARE_MAX_KN = 2048
"""LayerNorm also takes the kernel for K = N up to 2048 to train: there it trains faster than XLA
although its forward is slower (a forward alone runs XLA, :func:`kernel_slower_forward_reason`).
The rule is K = N, the shapes measured (262144 and 65536 rows); at K = 512, N = 2048 the same
route trained slower (measured: ``benchmarks/NOTES.md``, "Pre-norm forward" and "Pre-norm
backward")."""

RMS_SQUARE_MAX_KN, RMS_SQUARE_MAX_M = 2048, 65536
"""RMSNorm also trains with the kernel for K = N up to 2048 with at most 65536 rows: at
65536×2048² it trained faster than XLA, at 262144×2048² slower (the rule is by shape and M, the
two M measured; measured: ``benchmarks/NOTES.md``, "Pre-norm backward")."""

RMS_FORWARD_MAX_KN = 2048
"""RMSNorm's forward alone also takes the kernel for K = N up to 2048, also where its training
is slower than XLA's (past :data:`RMS_SQUARE_MAX_M` rows) but its forward faster; at K = N =
4096 the forward loses too (measured: ``benchmarks/NOTES.md``, "Pre-norm forward")."""

KERNEL_DEFAULT_MIN_M = 65536
"""Fewest rows (M, the product of x's leading dimensions) at which ``implementation=None`` takes
the kernel: the smallest M the H200 measured it faster than XLA in training (65536×2048², the
suite). Below, the kernel path's fixed backward passes (the row-terms pass, the bias guard)
cost more than the fusion saves: LayerNorm at K = 576, N = 512 (the Kunlun model's K/V summary)
trained slower at every M measured up to 16384 (measured: ``benchmarks/NOTES.md``, "Small M")."""


WEIGHT_GRAD_KERNEL_MAX_KN = 512
"""Largest K and N at which the backward takes the weight-gradient kernel
(:func:`weight_grad_kernel_pays`)."""


def weight_grad_kernel_pays(k: int, n: int) -> bool:
  """Whether the backward's dW_γ = x̂ᵀ dy runs as the weight-gradient kernel, which reads x and
  makes x̂ itself (:mod:`pallas_norm.ops.norm_matmul.mosaic_dw`), rather than as cuBLAS's GEMM
  of the x̂ that the dx kernel writes (where the dx kernel sums its rows in the epilogue): for
  K, N ≤ :data:`WEIGHT_GRAD_KERNEL_MAX_KN`. Measured on an H100 (the op's fwd+bwd at the suite's
  shapes): faster at 256² and RMSNorm 512², tied at LayerNorm 512² and RMSNorm 1024², slower at
  512×2048, LayerNorm 1024² and 2048², where the product is bound by the tensor core and
  cuBLAS's GEMM is the faster one
  (``benchmarks/NOTES.md``, "Pre-norm backward")."""
  return k <= WEIGHT_GRAD_KERNEL_MAX_KN and n <= WEIGHT_GRAD_KERNEL_MAX_KN


def kernel_slower_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA to train (forward+backward) x (M, K) @ w (K, N), or
  None to take the kernel."""
  limit = KERNEL_DEFAULT_MAX_KN[norm]
  # LayerNorm's wide shapes train faster only with the row sums in the dx epilogue, which
  # needs K split into one column tile per CTA of a cluster (K = 320 or 448 does not split).
  wide = k <= WIDE_MAX_K and n <= WIDE_MAX_N and (norm == "rms" or _k_splits(k))
  square_layer = norm == "layer" and k == n <= LAYER_SQUARE_MAX_KN
  square_rms = norm == "rms" and k == n <= RMS_SQUARE_MAX_KN and m <= RMS_SQUARE_MAX_M
  if (k > limit or n > limit) and not (wide or square_layer or square_rms):
    if norm == "rms" and k == n <= RMS_SQUARE_MAX_KN:
      return (f"M = {m}, K = N = {k}: past {RMS_SQUARE_MAX_M} rows the rms Mosaic kernel is "
              "measured slower than XLA in training on the H200 (pass implementation='mosaic' "
              "to force it)")
    return (f"K = {k}, N = {n}: past {limit} the {norm} Mosaic kernel is measured slower than XLA "
            "in training on the H200 (pass implementation='mosaic' to force it)")
  return _small_m_reason(m)


def k_split(k: int, interpret: bool) -> tuple[int, int] | None:
  """(cluster, tile_n) for the dx kernel's row sums in its epilogue
  (:mod:`pallas_norm.ops.norm_matmul.mosaic_bwd`): the post-norm forward's split of a row
  (:func:`pallas_norm.mgpu.cluster_split`) with one column tile per CTA; in interpret mode (no
  peer SMEM) a cluster of 1. None where K does not split so."""
  split = mgpu.cluster_split(k)
  if split is None or split[2] != 1 or (interpret and split[0] != 1):
    return None
  return split[0], split[1]


def _k_splits(k: int) -> bool:
  """Whether K splits into one column tile per CTA of a cluster, as the dx kernel's row sums in
  the epilogue need on a GPU (:func:`k_split`)."""
  return k_split(k, interpret=False) is not None


def kernel_slower_forward_reason(m: int, k: int, n: int, norm: str) -> str | None:
  """Why ``implementation=None`` keeps XLA for a forward of x (M, K) @ w (K, N) that is not
  differentiated, or None to take the kernel: where training takes it, and RMSNorm at K = N ≤
  :data:`RMS_FORWARD_MAX_KN`; not LayerNorm past K, N ≤ 1024 (the wide shapes of
  :data:`WIDE_MAX_K` and the squares of :data:`LAYER_SQUARE_MAX_KN`, where only training is
  faster on the kernel: its forward alone at 2048² measured 1–4% slower than XLA's at 65536 and
  262144 rows, benchmarks/results/nvidia-h200.md)."""
  if norm == "rms" and k == n <= RMS_FORWARD_MAX_KN:
    return _small_m_reason(m)
  limit = KERNEL_DEFAULT_MAX_KN[norm]
  if norm == "layer" and max(k, n) > limit:
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
it (LayerNorm only). Why the limit:

* The fused terms win where a row block has 2 column tiles (K = 512) and lose with 8 (K =
  2048): the kernel's extra y stream and sums are not hidden under the WGMMAs, cost a stage,
  and are repeated by every column tile of a row block.
* RMSNorm loses fused even at 512²: without col_sum, XLA fuses the row-terms pass with the
  weight gradients' pass over dy, so moving it into the kernel saves less than it costs.
* At K = N = 1024 LayerNorm's public fwd+bwd is slower fused, with and without a bias.

Measured: ``benchmarks/NOTES.md``, "Pre-norm backward" (fused row terms, cost), and
``benchmarks/EXPERIMENTS.md`` (the fused row terms forced on past these limits)."""


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
  tensor core waits for); it saves the scaled dy's 2N
  written by XLA. LayerNorm always takes x̂ (the uncentered form also needs the rank-1 term
  ``Σ_i rstd_i mean_i dy_i``, one more column reduction over M × N, whose cancellation for
  rows with a large mean needs matching roundings); RMSNorm where K < N, the bytes saved more
  than those added (at K = N it is a wash by the bytes, and the kernel's write, unlike XLA's,
  delays the tensor core). Chosen from those bytes; on the H200 x̂ was faster for LayerNorm at
  512² and 512×2048 and for RMSNorm at 512×2048 (benchmarks/NOTES.md, pre-norm backward); RMSNorm
  at K = N keeps the scaled dy, not yet timed against x̂.

  With x̂ and a norm bias, Σ_i dy_i comes from the dx kernel (``return_dy_col_sums``, with the
  row sums in its epilogue) or else from a ones block at x̂'s end (``x_hat_ones``), in dW_γ's
  GEMM; never from a column reduction over dy (2N bytes per row read again)."""
  return norm == "layer" or k < n
