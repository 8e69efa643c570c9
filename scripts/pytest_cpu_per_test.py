"""A pytest plugin that logs each test's CPU cost: user + system CPU-seconds of the process that
ran it (an xdist worker) and of the subprocesses it waited for (getrusage SELF + CHILDREN deltas
over setup, call and teardown), and its wall time.

How the CPU suite's per-test tables in ``benchmarks/results/logs/*_ci_cpu_*`` are made, on a
fresh clone exactly as ``.ci/run`` runs the README's command::

  git clone . /tmp/ciclone && cd /tmp/ciclone
  CPU_PER_TEST_OUT=/tmp/cpu PYTHONPATH=$OLDPWD/scripts PYTEST_ADDOPTS="-p pytest_cpu_per_test" \\
      /usr/bin/time -v .ci/run
  cat /tmp/cpu/*.tsv | sort -t$'\\t' -k1 -rn | head   # the dearest tests

Writes one ``<worker>.tsv`` per process into ``$CPU_PER_TEST_OUT`` (default ``/tmp/cpu_per_test``),
rows ``cpu_s child_cpu_s wall_s nodeid``, appended as each test finishes. CPU-seconds are the
robust measure on a shared machine (wall time depends on what else runs); they still grow by
~10-20% under load (cache and frequency effects).
"""

import os
import resource
import time

import pytest


def _cpu_seconds():
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  own, children, start = *_cpu_seconds(), time.time()
  yield
  own_after, children_after = _cpu_seconds()
  out = os.environ.get("CPU_PER_TEST_OUT", "/tmp/cpu_per_test")
  os.makedirs(out, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  child = children_after - children
  with open(os.path.join(out, f"{worker}.tsv"), "a") as f:
    f.write(f"{own_after - own + child:.2f}\t{child:.2f}\t{time.time() - start:.1f}\t"
            f"{item.nodeid}\n")
