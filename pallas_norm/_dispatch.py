"""Choosing an implementation for an op (tokamax-style: several implementations behind one API).

Every public op takes ``implementation=None | "mosaic" | "triton" | "xla" | "interpret"``, or a
sequence of those names. An op has at most one kernel, of one of two kinds (:data:`GPU_KERNELS`):

* ``"xla"``: the plain-JAX reference (:mod:`pallas_norm.reference`), runs everywhere.
* ``"mosaic"``: a Pallas Mosaic-GPU kernel, needs a Hopper GPU (sm_90a).
* ``"triton"``: a Pallas kernel with the Triton lowering (the name tokamax uses for the same
  kind), needs an NVIDIA GPU of any generation Pallas' Triton backend supports; today only the
  backward of ``layer_norm`` and ``rms_norm``.
* ``"interpret"``: the op's kernel run in Pallas interpret mode on any backend (slow; for
  tests): GPU interpret mode for a Mosaic kernel, ``pallas_call(interpret=True)`` for a Triton
  one. A Mosaic kernel on the CPU needs ``PJRT_NPROC`` >= :data:`INTERPRET_MIN_CPU_THREADS` in the
  environment before JAX starts (the kernel's warpgroups run as concurrent CPU computations that
  wait on each other; with fewer threads they deadlock), else it raises RuntimeError.
* ``None``: the op's kernel when it exists, the default device can run it (a Hopper GPU for
  "mosaic", a CUDA GPU for "triton"), the kernel supports the arguments and it was measured
  faster than XLA at such shapes (see each op's ``slower_reason`` and ``benchmarks/results``);
  otherwise XLA, with the reason logged at debug level. Where the forward alone and training
  (forward+backward) were measured fastest on different paths, the op asks
  :func:`choose_by_use` and runs each use on its own path (:func:`pallas_norm._op.by_use`).
* a sequence, e.g. ``("interpret", "xla")``: the first name that can run the call, in order
  (unlike None, regardless of speed). A model passes one to all its layers to get the kernels
  wherever their shapes fit and XLA elsewhere. A kernel skipped for a reason of the process
  rather than of the call (not a Hopper GPU, too few CPU threads for interpret mode,
  ``jax_enable_x64``) is reported by a :class:`KernelSkippedWarning`, once per op, kernel and
  reason per process: a user who asked for the kernel learns that it did not run.

An op with a kernel passes ``unsupported_reason(candidate)`` to :func:`choose`: None when the
kernel implementation ``candidate`` (its kernel's name or "interpret") can run the call, or a
string saying why not; and ``kernel=`` the kind of its kernel ("mosaic" unless given).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from typing import Callable

import jax

IMPLEMENTATIONS = ("xla", "mosaic", "triton", "interpret")
"""The names every op's ``implementation=`` accepts, alone or in a non-empty sequence (None too);
anything else raises ValueError (:func:`check_implementation`). Each op has at most one kernel:
naming a kernel it lacks raises NotImplementedError (:func:`choose`)."""
GPU_KERNELS = ("mosaic", "triton")
"""The kinds of GPU kernel an op can have (one each)."""
INTERPRET_MIN_CPU_THREADS = 8
"""The CPU client threads GPU interpret mode needs (``PJRT_NPROC``): the kernels here run at most
3 warpgroups per CTA, each as a CPU computation blocking on the others."""
log = logging.getLogger("pallas_norm")


class KernelSkippedWarning(RuntimeWarning):
  """A kernel named in an ``implementation`` sequence cannot run in this process (its setup,
  not the call's shapes), so a later name of the sequence ran instead."""


_warned: set = set()  # (op, candidate, reason) already reported by a KernelSkippedWarning


def check_implementation(implementation):
  """``implementation`` validated: None, a name of :data:`IMPLEMENTATIONS`, or a non-empty
  sequence of them (returned as a tuple, hashable for jit's static arguments).

  Raises:
    ValueError: an unknown name, an empty sequence, or another type.
  """
  # The type first: a NumPy array compared with the names raised NumPy's "truth value ... is
  # ambiguous" instead of this function's error.
  if implementation is None or (isinstance(implementation, str)
                                and implementation in IMPLEMENTATIONS):
    return implementation
  if isinstance(implementation, (list, tuple)) and implementation and all(
      isinstance(i, str) and i in IMPLEMENTATIONS for i in implementation):
    return tuple(implementation)
  raise ValueError(f"implementation must be None, one of {IMPLEMENTATIONS} or a non-empty "
                   f"sequence of them, got {implementation!r}")


def interpret_threads_reason() -> str | None:
  """Why GPU interpret mode would deadlock here, or None: on the CPU backend it needs
  ``PJRT_NPROC`` >= :data:`INTERPRET_MIN_CPU_THREADS` (default: the core count), read when JAX
  creates its CPU client."""
  if jax.default_backend() != "cpu":
    return None
  threads = _xla_cpu_threads()
  if threads >= INTERPRET_MIN_CPU_THREADS:
    return None
  value = os.environ.get("PJRT_NPROC")
  unread = "" if value is None or _read_count(value) is not None else (
      f" (PJRT_NPROC={value!r} is not a number XLA reads)")
  return (f"GPU interpret mode on the CPU needs PJRT_NPROC >= {INTERPRET_MIN_CPU_THREADS} "
          f"(the kernel's warpgroups run as concurrent CPU computations that wait on each "
          f"other), this process has {threads}{unread}: set "
          f"PJRT_NPROC={INTERPRET_MIN_CPU_THREADS} in the environment before JAX starts")


def _read_count(text: str) -> int | None:
  """``text`` as absl::SimpleAtoi reads an int32 (ASCII digits, an optional sign, surrounding
  whitespace), or None."""
  if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text, flags=re.ASCII):
    return None
  n = int(text)
  return n if -2**31 <= n < 2**31 else None


def _xla_cpu_threads() -> int:
  """The CPU client's thread count as XLA's DefaultThreadPoolSize takes it: PJRT_NPROC, else
  NPROC, where it reads as a number (at least 1), else the core count."""
  for name in ("PJRT_NPROC", "NPROC"):
    count = _read_count(os.environ.get(name) or "")
    if count is not None:
      return max(count, 1)
  return os.cpu_count() or 1


@functools.cache
def on_hopper_gpu() -> bool:
  """True when the default JAX device is an NVIDIA GPU of compute capability 9.x."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  cc = getattr(dev, "compute_capability", None)
  return dev.platform == "gpu" and cc is not None and str(cc).startswith("9")


@functools.cache
def on_cuda_gpu() -> bool:
  """True when the default JAX device is an NVIDIA (CUDA) GPU: where Pallas' Triton lowering
  runs (ROCm is not claimed: nothing here was run there)."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  version = str(getattr(getattr(dev, "client", None), "platform_version", "")).lower()
  return dev.platform == "gpu" and "rocm" not in version


def choose(op: str, implementation,
           unsupported_reason: Callable[[str], str | None] | None = None,
           slower_reason: Callable[[], str | None] | None = None,
           kernel: str = "mosaic") -> str:
  """Returns "xla", ``kernel`` or "interpret" for this call of ``op``.

  ``unsupported_reason`` is None for ops that have no kernel yet; otherwise
  ``unsupported_reason(candidate)`` returns None when the kernel implementation ``candidate``
  (``kernel`` or "interpret") can run these arguments, or why it cannot. ``slower_reason``
  (consulted only for ``implementation=None``) returns why XLA is measured faster for these
  shapes on this device, or None. ``kernel`` is the kind of the op's kernel
  (:data:`GPU_KERNELS`); asking for the other kind is an error like asking for a missing kernel.

  Raises:
    ValueError: ``implementation`` is not a known name or a sequence of them.
    NotImplementedError: a kernel implementation was asked for (alone, or every name of a
      sequence) but ``op`` has none, it does not support these arguments, or
      ``jax_enable_x64`` is on (:data:`X64_REASON`).
    RuntimeError: "interpret" alone on a CPU client with too few threads
      (:func:`interpret_threads_reason`); in a sequence that candidate is skipped instead.
  """
  implementation = check_implementation(implementation)
  if implementation is None:
    return _choose_default(op, unsupported_reason, slower_reason, kernel)
  candidates = (implementation,) if isinstance(implementation, str) else implementation
  reasons, skipped = [], []
  for candidate in candidates:
    reason = _cannot_run_reason(op, candidate, unsupported_reason, kernel)
    if reason is None:
      if reasons:
        _warn_skipped(op, candidate, skipped)
      return candidate
    reasons.append(f"{candidate!r}: {reason}")
    if unsupported_reason is not None and reason in _process_reasons(candidate, kernel):
      skipped.append((reasons[-1], reason))
  if candidates == ("interpret",) and unsupported_reason is not None and kernel == "mosaic" and (
      not jax.config.jax_enable_x64) and unsupported_reason("interpret") is None:
    raise RuntimeError(f"{op}: implementation='interpret' cannot run here: {reasons[0]}")
  raise NotImplementedError(f"{op}: implementation={implementation!r} cannot run this call: "
                            + "; ".join(reasons))


def choose_by_use(op: str, implementation,
                  unsupported_reason: Callable[[str], str | None] | None,
                  slower_reason: Callable[[], str | None] | None,
                  slower_forward_reason: Callable[[], str | None] | None,
                  kernel: str = "mosaic") -> tuple[str, str]:
  """``(forward, training)``: the implementation for a call that is not differentiated and the
  one for a call under reverse-mode differentiation (its forward and backward).

  ``implementation=None`` chooses each as :func:`choose` does, training by ``slower_reason``
  (measured forward+backward) and the forward alone by ``slower_forward_reason`` (measured
  forward); any other ``implementation`` gives ``(choose(...),) * 2``. Raises as :func:`choose`.
  """
  if unsupported_reason is not None:
    # Asked once per candidate: both uses share the kernel's answer for these arguments.
    unsupported_reason = functools.cache(unsupported_reason)
  if implementation is not None or unsupported_reason is None:
    training = choose(op, implementation, unsupported_reason, slower_reason, kernel)
    return training, training
  # Each use logs its own reason for XLA, so that the two debug lines say which use each is.
  return (_choose_default(op, unsupported_reason, slower_forward_reason, kernel,
                          use="a call that is not differentiated"),
          _choose_default(op, unsupported_reason, slower_reason, kernel, use="training"))


X64_REASON = ("jax_enable_x64 is on: the kernels (Mosaic GPU and Triton lowerings) are traced "
              "with int32 index arithmetic only (loop indices become int64 under x64); use "
              "'xla' or turn x64 off")
"""Why no kernel runs while ``jax_enable_x64`` is set (the kernels fail inside their tracing under
x64: their index arithmetic is int32)."""


NOT_HOPPER_REASON = ("the default JAX device is not a Hopper GPU (sm_90a); use 'interpret' to run "
                     "the kernel on another backend, or 'xla'")
NOT_CUDA_REASON = ("the default JAX device is not an NVIDIA GPU; use 'interpret' to run the "
                   "kernel on another backend, or 'xla'")


def _process_reasons(candidate: str, kernel: str) -> tuple:
  """The reasons ``candidate`` cannot run that come from the process, not from the call."""
  return (X64_REASON, NOT_HOPPER_REASON, NOT_CUDA_REASON,
          interpret_threads_reason() if candidate == "interpret" and kernel == "mosaic" else None)


def _warn_skipped(op: str, ran: str, skipped) -> None:
  """One :class:`KernelSkippedWarning` per (op, kernel, reason) and process."""
  for described, reason in skipped:
    key = (op, described.split(":")[0], reason)
    if key in _warned:
      continue
    _warned.add(key)
    warnings.warn(f"{op}: implementation {described}; ran {ran!r} instead (reported once per "
                  "process)", KernelSkippedWarning, stacklevel=4)


def _cannot_run_reason(op: str, candidate: str, unsupported_reason, kernel: str) -> str | None:
  if candidate == "xla":
    return None
  if unsupported_reason is None:
    return f"{op} has no kernel (only 'xla'); see the README's status table"
  if candidate in GPU_KERNELS and candidate != kernel:
    return f"{op} has no {candidate!r} kernel (its kernel is {kernel!r})"
  if jax.config.jax_enable_x64:
    return X64_REASON
  reason = unsupported_reason(candidate)
  if reason is None and candidate in GPU_KERNELS:
    reason = _device_reason(candidate)
  if reason is None and candidate == "interpret" and kernel == "mosaic":
    reason = interpret_threads_reason()
  return reason


def _device_reason(kernel: str) -> str | None:
  """Why the default device cannot run a kernel of this kind, or None."""
  if kernel == "mosaic" and not on_hopper_gpu():
    return NOT_HOPPER_REASON
  if kernel == "triton" and not on_cuda_gpu():
    return NOT_CUDA_REASON
  return None


def _choose_default(op: str, unsupported_reason, slower_reason, kernel: str,
                    use: str | None = None) -> str:
  if unsupported_reason is None:
    return "xla"
  reason = _device_reason(kernel)
  if reason is None:
    reason = X64_REASON if jax.config.jax_enable_x64 else unsupported_reason(kernel)
  if reason is None and slower_reason is not None:
    reason = slower_reason()
  if reason is not None:
    log.debug("%s%s: using XLA: %s", op, f" ({use})" if use else "", reason)
    return "xla"
  return kernel
