"""pallas-norm: LayerNorm/RMSNorm fused into the GEMM and attention kernels of JAX training.

Public ops (each takes ``implementation=``: None, "xla", its kernel's name -- "mosaic", or
"triton" for ``layer_norm`` and ``rms_norm`` -- "interpret", or a sequence of them tried in
order; see :mod:`pallas_norm._dispatch` and the README's status table):

* :func:`rms_norm`, :func:`layer_norm`: standalone row norms with optional residual add.
* :func:`norm_matmul`: lazy pre-norm GEMM ``norm(x) @ w``.
* :func:`matmul_norm`: GEMM with the norm in its epilogue ``norm(x @ w + bias + residual)``.
* :func:`gdpa`: generalized (softmax-free) dot-product attention over jagged queries.
* :func:`flash_norm_attention`: the Kunlun PFFN block, LN → GDPA (+u) → RMSNorm (+q).

:func:`softmax_attention` (no kernel of ours: cuDNN's flash attention or XLA's, per call) is the
Kunlun model's softmax attention over padded sequences.

:mod:`pallas_norm.reference` holds the plain-JAX math of each; :mod:`pallas_norm.jagged` the
packed-offsets convention for variable-length sequences; :mod:`pallas_norm.sharding` runs the
ops on rows split over several devices.
"""

from pallas_norm import jagged, reference
from pallas_norm._dispatch import IMPLEMENTATIONS, KernelSkippedWarning
from pallas_norm.ops.flash_norm_attention import flash_norm_attention
from pallas_norm.ops.gdpa import gdpa
from pallas_norm.ops.matmul_norm import matmul_norm
from pallas_norm.ops.norm_matmul import norm_matmul
from pallas_norm.ops.norms import layer_norm, rms_norm
from pallas_norm.reference import ACTIVATIONS, NormStats
from pallas_norm.padded_attention import softmax_attention

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "IMPLEMENTATIONS",
    "KernelSkippedWarning",
    "NormStats",
    "flash_norm_attention",
    "gdpa",
    "jagged",
    "layer_norm",
    "matmul_norm",
    "norm_matmul",
    "reference",
    "rms_norm",
    "softmax_attention",
]
