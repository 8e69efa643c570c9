"""CUPTI kernel profile of a compiled program: every kernel's time, grouped by kind and by the
model component that launched it.

:func:`cupti_kernels` records every kernel of ``iterations`` calls (after one warm-up call)
through the CUPTI hooks of Mosaic GPU's bindings (what ``profiler.measure`` uses, without its
requirement that every call launch the same kernel names in the same order, which programs with
a ``lax.cond`` break). :func:`profile` groups them:

* by kind, from the kernel's name (:data:`KINDS`): GEMMs, cuDNN's attention, Pallas kernels,
  gathers/scatters, layout copies, reductions, elementwise loop fusions;
* by component, from the optimized HLO: an XLA fusion's kernel carries the fusion's name, whose
  ``op_name`` metadata holds the ``jax.named_scope`` it was traced in (the model scopes its
  parts: :data:`COMPONENT_SCOPES`); a library kernel (cuBLAS, cuDNN, Pallas), whose name is not
  an HLO name, is given to the first custom call after the last fusion launched before it (the
  thunks run in the HLO schedule's order). The latter is approximate: two custom calls between
  the same two fusions share the first one's component.

Kernel sums leave out launch gaps and host work; the wall clock of the same program says how
much those add.
"""

from __future__ import annotations

import collections
import re

KINDS = (
    ("GEMM", r"gemm|xmma|nvjet|cutlass|cublas|splitk|split_k|_dot_|dot_fusion"),
    ("attention (cuDNN)", r"cudnn|sdpa|fmha|flash"),
    ("Pallas kernels", r"mosaic|pallas|gdpa|norm_backward"),
    ("gather/scatter", r"gather|scatter|dynamic.update|dynamic.slice|sort|cub::"),
    ("layout (transpose, copy, concatenate, pad, slice)",
     r"transpose|copy|concatenate|\bpad|_pad|slice|memcpy|memset|bitcast"),
    ("reductions (norm statistics, softmax, sums)", r"reduce|reduction"),
    ("elementwise (loop fusions)", r"loop_|fusion|convert|multiply|add|select"),
)
"""(kind, regex on the kernel name), first match wins; anything else is "other"."""

COMPONENT_SCOPES = (
    ("embeddings", r"context_tokens|sequence_tokens"),
    ("K/V generator", r"kv_gen"),
    ("PFFN", r"pffn"),
    ("self-attention", r"self_attention"),
    ("seed pooling", r"seed_pool"),
    ("interaction MLP", r"interaction_mlp"),
    ("optimizer (AdamW)", r"optimizer"),
)
"""(component, regex on an HLO op_name), first match wins; anything else (the loss, glue) is
"rest"."""

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=.*?\s(fusion|custom-call)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def sanitize(name: str) -> str:
  """An HLO instruction name as XLA names its kernel (non-alphanumerics become '_')."""
  return re.sub(r"[^0-9A-Za-z_]", "_", name)


def hlo_launches(hlo_text: str) -> list[tuple[str, str, bool]]:
  """(kernel-style name, op_name, is_custom_call) of every fusion and custom call of an
  optimized HLO module, in text order (the schedule's, within a computation)."""
  out = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      op = _OP_NAME.search(line)
      out.append((sanitize(m.group(1)), op.group(1) if op else "", m.group(2) == "custom-call"))
  return out


def kind_of(kernel: str) -> str:
  for kind, pattern in KINDS:
    if re.search(pattern, kernel, re.IGNORECASE):
      return kind
  return "other"


def component_of(op_name: str) -> str:
  for component, pattern in COMPONENT_SCOPES:
    if re.search(pattern, op_name):
      return component
  return "rest"


def attribute(kernels, hlo_text: str) -> list[tuple[str, float, str]]:
  """(kernel name, ms, op_name) for each recorded kernel, in launch order (see the module doc
  for library kernels). ``kernels``: (name, ms) pairs as CUPTI recorded them."""
  launches = hlo_launches(hlo_text)
  index = {name: i for i, (name, _, _) in enumerate(launches)}
  out, last = [], -1
  for name, ms in kernels:
    i = index.get(sanitize(name))
    if i is not None:
      last = i
      out.append((name, ms, launches[i][1]))
      continue
    following = next((j for j in range(last + 1, len(launches)) if launches[j][2]), None)
    out.append((name, ms, launches[following][1] if following is not None else ""))
  return out


def cupti_kernels(fn, args, iterations: int) -> list[tuple[str, float]]:
  """(kernel name, ms) of every kernel that ``iterations`` calls of ``fn(*args)`` launched,
  after one warm-up call. GPU only (Mosaic GPU's CUPTI bindings).

  Raises:
    RuntimeError: the bindings are missing (not a CUDA build of jaxlib).
  """
  import jax
  try:
    from jax._src.lib import mosaic_gpu
  except ImportError as e:
    raise RuntimeError("CUPTI profiling needs jaxlib's Mosaic GPU bindings") from e
  ext = mosaic_gpu._mosaic_gpu_ext
  jax.block_until_ready(fn(*args))
  ext._cupti_init()
  try:
    outs = [fn(*args) for _ in range(iterations)]
    jax.block_until_ready(outs)
  finally:
    timings = ext._cupti_get_timings(True)
  return [(name, float(ms)) for name, ms in timings]


def profile(kernels, iterations: int, hlo_text: str = "", top: int = 25) -> dict:
  """Per-call kernel ms of a program: total, by kind, by component, and the ``top`` kernels
  (summed over launches of the same name: name, ms per call, launches per call, kind,
  component, op_name)."""
  rows = attribute(kernels, hlo_text)
  by_kind, by_component = collections.Counter(), collections.Counter()
  per_name = {}
  for name, ms, op_name in rows:
    kind, component = kind_of(name), component_of(op_name)
    by_kind[kind] += ms / iterations
    by_component[component] += ms / iterations
    entry = per_name.setdefault(name, [0.0, 0, kind, component, op_name])
    entry[0] += ms / iterations
    entry[1] += 1
  ranked = sorted(per_name.items(), key=lambda item: -item[1][0])[:top]
  return {
      "kernel_ms": sum(by_kind.values()), "kernels_per_call": len(rows) / iterations,
      "by_kind": {k: round(v, 3) for k, v in by_kind.most_common()},
      "by_component": {k: round(v, 3) for k, v in by_component.most_common()},
      "top": [[name, round(ms, 3), count / iterations, kind, component, _short(op_name)]
              for name, (ms, count, kind, component, op_name) in ranked],
  }


def _short(op_name: str, keep: int = 160) -> str:
  return op_name if len(op_name) <= keep else "…" + op_name[-keep:]
