"""Torch anchors (torch.compile/inductor, eager, liger-kernel) of the standalone norms at the
suite's shapes: x of 1 GB, M = 2^29 / N, N in benchmarks.cases.NORM_NS, under the suite's case
names (rms_norm/MxN/{fwd,fwd+bwd}, layer_norm/...). The staged anchors tool (.anchors/, by
../shared/anchors/stage.sh) times the norms only at the GEMMs' x shapes and 262144x2048; this
file reuses its measuring code unchanged and only replaces its case plan:

  * anchors_torch.plan -> the suite's norm shapes (same inputs, check, CUPTI timer, flush);
  * anchors_torch.__file__ -> this file, so its prewarm workers (which re-run "__file__") build
    the same plan and their case indices match.

Run through anchors_norms.sh (unpacks the liger wheel, caches, timeout, summary), or directly:
  python3 .devcarry/norms22_ab/anchors_norms.py --list
All flags are anchors_torch.py's (--select, --impls, --budget-s, --iters, --prewarm, --out, ...).
"""

import os
import sys

ANCHORS = os.environ.get("ANCHORS_DIR") or os.path.join(os.getcwd(), ".anchors")
sys.path.insert(0, ANCHORS)
import anchors_torch as at  # noqa: E402  (puts .anchors/site and vendor/ on sys.path)

NORM_NS = (32768, 8192, 512, 128, 2048)  # the suite's NORM_NS, unmeasured shapes first
NORM_BYTES = 1 << 30
IMPLS = ("inductor", "eager", "liger")


def plan(tiny: bool = False):
  """[(case, implementations)] in run order: per shape fwd+bwd, then fwd."""
  shapes = [(64, 32), (32, 64)] if tiny else [(NORM_BYTES // (2 * n), n) for n in NORM_NS]
  out = []
  for m, n in shapes:
    for mode in ("fwd+bwd", "fwd"):
      for op in ("rms_norm", "layer_norm"):
        out.append((at.Case(op, "", (("M", m), ("N", n)), mode), IMPLS))
  return out


at.plan = plan
at.__file__ = os.path.abspath(__file__)

if __name__ == "__main__":
  sys.exit(at.main())
