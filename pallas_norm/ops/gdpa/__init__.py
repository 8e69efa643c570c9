"""Generalized dot-product attention over jagged queries (DESIGN.md, op 3; Meta's GDPA).

``api`` (the public op), ``xla`` (the XLA path), ``mosaic`` (the Hopper forward kernel),
``mosaic_bwd`` (the backward kernels), ``configs`` (the forward kernel's tiling).
"""

from pallas_norm.ops.gdpa.api import (check_args, gdpa, offsets_invalid,
                                      poison_if_offsets_invalid, poisoned_kernel_inputs)

__all__ = ["gdpa", "check_args", "offsets_invalid", "poison_if_offsets_invalid",
           "poisoned_kernel_inputs"]
