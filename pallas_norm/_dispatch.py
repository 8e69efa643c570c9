"""Choosing an implementation for an op (tokamax-style: several implementations behind one API).

Every public op takes ``implementation=None | "mosaic" | "xla" | "interpret"``:

* ``"xla"``: the plain-JAX reference (:mod:`pallas_norm.reference`), runs everywhere.
* ``"mosaic"``: the Pallas Mosaic-GPU kernel, needs a Hopper GPU (sm_90a).
* ``"interpret"``: the same kernel run in Pallas GPU interpret mode on any backend (slow; for
  tests).
* ``None``: the Mosaic kernel when it exists, the default device is a Hopper GPU, the kernel
  supports the arguments and it was measured faster than XLA at such shapes (see each op's
  ``_kernel_slower_reason`` and ``benchmarks/results``); otherwise XLA, with the reason logged at
  debug level.

An op registers its kernels by passing ``kernels={"mosaic": supports_fn}`` to :func:`choose`,
where ``supports_fn(**static_args)`` returns None when it can run the call or a string saying
why not.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax

IMPLEMENTATIONS = ("xla", "mosaic", "interpret")
log = logging.getLogger("pallas_norm")


@functools.cache
def on_hopper_gpu() -> bool:
  """True when the default JAX device is an NVIDIA GPU of compute capability 9.x."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  cc = getattr(dev, "compute_capability", None)
  return dev.platform == "gpu" and cc is not None and str(cc).startswith("9")


def choose(op: str, implementation: str | None,
           unsupported_reason: Callable[[], str | None] | None = None,
           slower_reason: Callable[[], str | None] | None = None) -> str:
  """Returns "xla", "mosaic" or "interpret" for this call of ``op``.

  ``unsupported_reason`` is None for ops that have no kernel yet; otherwise it returns None when
  the kernel can run these arguments, or why it cannot. ``slower_reason`` (consulted only for
  ``implementation=None``) returns why XLA is measured faster for these shapes, or None.

  Raises:
    ValueError: ``implementation`` is not a known name.
    NotImplementedError: a kernel implementation was asked for but ``op`` has none, or it does
      not support these arguments.
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation == "xla":
    return "xla"
  if unsupported_reason is None:
    if implementation is None:
      return "xla"
    raise NotImplementedError(f"{op}: implementation={implementation!r}: this op has no "
                              "kernel (only 'xla'); see the README's status table")
  reason = unsupported_reason()
  if implementation is None:
    if not on_hopper_gpu():
      log.debug("%s: using XLA: the default device is not a Hopper GPU", op)
      return "xla"
    if reason is None and slower_reason is not None:
      reason = slower_reason()
    if reason is not None:
      log.debug("%s: using XLA: %s", op, reason)
      return "xla"
    return "mosaic"
  if reason is None and implementation == "mosaic" and not on_hopper_gpu():
    reason = ("the default JAX device is not a Hopper GPU (sm_90a); use 'interpret' to run the "
              "kernel on another backend, or 'xla'")
  if reason is not None:
    raise NotImplementedError(f"{op}: implementation={implementation!r} cannot run this call: "
                              f"{reason}")
  return implementation

