"""Standalone row norms :func:`rms_norm` (XLA) and :func:`layer_norm` (XLA, or the Pallas
backward kernel); DESIGN.md, op 5."""

from pallas_norm.ops.norms.api import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
