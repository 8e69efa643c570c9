"""Standalone row norms :func:`rms_norm`, :func:`layer_norm` (DESIGN.md, op 5; XLA only)."""

from pallas_norm.ops.norms.api import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
