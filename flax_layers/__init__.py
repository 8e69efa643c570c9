"""Flax NNX layers over the fused-norm ops of :mod:`pallas_norm`.

* :class:`RMSNorm`, :class:`LayerNorm`: row norms with an optional fused residual add.
* :class:`NormDense`: pre-norm dense layer (:func:`pallas_norm.norm_matmul`).
* :class:`DenseNorm`: dense layer with a post-norm epilogue (:func:`pallas_norm.matmul_norm`).
* :class:`GDPA`, :class:`PFFNBlock`: jagged generalized attention and the Kunlun PFFN block
  (:func:`pallas_norm.gdpa`, :func:`pallas_norm.flash_norm_attention`).
* :class:`KunlunModel`, :class:`KunlunConfig`: a small Kunlun-style CTR model built from them.

Parameters are created in ``param_dtype`` (float32 by default); ``dtype`` is the compute dtype that
inputs and parameters are cast to before each op. Every layer passes ``implementation=`` through.
"""

from flax_layers.attention import GDPA, PFFNBlock
from flax_layers.dense import DenseNorm, NormDense
from flax_layers.kunlun import KunlunConfig, KunlunModel
from flax_layers.norms import LayerNorm, RMSNorm

__all__ = [
    "DenseNorm",
    "GDPA",
    "KunlunConfig",
    "KunlunModel",
    "LayerNorm",
    "NormDense",
    "PFFNBlock",
    "RMSNorm",
]
