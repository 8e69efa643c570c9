"""Benchmark suite of pallas-norm: every op, shape and implementation against the GEMM-alone
limit, the XLA baseline and the device's bytes/FLOP floors.

``python -m benchmarks.run [--quick] [--only RE] [--interpret] [--tiny]`` runs it;
``python -m benchmarks.report RESULTS.json`` turns its JSON into Markdown and a plot. Method:
``benchmarks/NOTES.md``.
"""

import pathlib
import tempfile


def unwritable_reason(folder) -> str | None:
  """Why results cannot be written into ``folder`` (created if missing), or None: for the
  command lines to check before they measure anything (a results folder that was a file, or
  one under a read-only path, failed in a traceback once the first case had run)."""
  try:
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
      pass
  except OSError as e:
    return f"cannot write into {folder}: {e.strerror or e}"
  return None
