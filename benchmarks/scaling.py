"""Train-step throughput of the Kunlun-style model on 1..N devices (issue 23's measurement).

On a machine with several GPUs (from the repository root)::

    PYTHONPATH=$PWD python3 -m benchmarks.scaling                  # 1, 2, 4, 8 GPUs (those present)
    PYTHONPATH=$PWD python3 -m benchmarks.scaling --devices 1,2 --out $OUT/scaling.json

Each device count n runs the sharded step of ``examples/distributed.py`` (n = 1: the script's
own single-device step) on the production config of :mod:`benchmarks.e2e` with B examples per
device (weak scaling; ``--global-batch`` fixes the total instead), warms up (compiles), then
times ``--windows`` windows of ``--steps`` back-to-back steps by the wall clock (one
``block_until_ready`` per window; the host batch is placed on the devices inside every step, as
in training). It prints, per n, the median window's step time, examples/s, and the scaling
efficiency ``examples_per_s(n) / (n · examples_per_s(1))``. NCCL's NVLink multicast (NVLS) is
left off (``NCCL_NVLS_ENABLE=0`` unless set). ``--tiny`` uses the CPU-sized config, e.g. with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU (numbers meaningless there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before jax loads NCCL

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import e2e  # noqa: E402

IMPLEMENTATIONS = {"auto": None, "xla": "xla", "mosaic": ("mosaic", "xla")}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", default=None,
                 help="comma-separated device counts (default: 1, 2, 4, 8 up to those present)")
  p.add_argument("--model-parallel", type=int, default=1,
                 help="model axis of the mesh (embedding tables split by rows), n > 1 only")
  p.add_argument("--global-batch", type=int, default=None,
                 help="fixed total batch (strong scaling); default: the config's batch per device")
  p.add_argument("--implementation", choices=tuple(IMPLEMENTATIONS), default="auto",
                 help="auto: the kernels where measured faster; mosaic: wherever they fit")
  p.add_argument("--steps", type=int, default=10, help="steps per timed window")
  p.add_argument("--windows", type=int, default=3)
  p.add_argument("--tiny", action="store_true", help="CPU-sized config")
  p.add_argument("--out", default=None, help="write the results as JSON here")
  return p.parse_args(argv)


def device_counts(spec: str | None) -> list[int]:
  available = jax.device_count()
  if spec is None:
    return [n for n in (1, 2, 4, 8) if n <= available]
  counts = [int(n) for n in spec.split(",")]
  missing = [n for n in counts if not 1 <= n <= available]
  if missing:
    raise SystemExit(f"scaling: {missing} devices asked for, {available} present")
  return counts


def _setup(config, n, model_parallel, implementation, global_batch):
  """(runner, graphdef, state, host batch) for n devices: e2e's model, optimizer and synthetic
  batch at ``global_batch`` examples."""
  from flax import nnx
  train = e2e._load_train_script()  # puts examples/ on sys.path
  import distributed
  model, optimizer, (batch,) = e2e._model_and_data(
      train, dict(config, batch_size=global_batch), implementation)
  if n == 1 and model_parallel == 1:
    runner = distributed.SingleDevice(train.train_step, train.predict)
  else:
    runner = distributed.MeshRunner(distributed.make_mesh(n, model_parallel), train.loss_fn)
  graphdef, state = nnx.split((runner.adapt(model), optimizer))
  # On the host, as in training: every step places its batch (split by samples for n > 1).
  return runner, graphdef, runner.place_state(state), jax.tree.map(np.asarray, batch)


def measure(config, n, args) -> dict:
  """Median and best window of ``args.steps`` train steps on ``n`` devices."""
  global_batch = args.global_batch or config["batch_size"] * n
  if global_batch % n:
    raise SystemExit(f"scaling: global batch {global_batch} does not split over {n} devices")
  runner, graphdef, state, batch = _setup(config, n, args.model_parallel if n > 1 else 1,
                                          IMPLEMENTATIONS[args.implementation], global_batch)
  for _ in range(2):  # compile, then one more warm step
    state, loss = runner.train_step(graphdef, state, batch)
    jax.block_until_ready(loss)
  windows = []
  for _ in range(args.windows):
    start = time.perf_counter()
    for _ in range(args.steps):
      state, loss = runner.train_step(graphdef, state, batch)
    jax.block_until_ready((state, loss))
    windows.append((time.perf_counter() - start) / args.steps)
  step_s = statistics.median(windows)
  return {"devices": n, "global_batch": global_batch, "step_ms": 1e3 * step_s,
          "best_step_ms": 1e3 * min(windows), "examples_per_s": global_batch / step_s,
          "loss": float(loss), "windows_ms": [1e3 * w for w in windows]}


def main(argv=None) -> int:
  args = parse_args(argv)
  config = e2e.build_config(args.tiny)
  rows = []
  for n in device_counts(args.devices):
    row = measure(config, n, args)
    base = rows[0] if rows and rows[0]["devices"] == 1 else (row if n == 1 else None)
    row["efficiency"] = (row["examples_per_s"] / (n * base["examples_per_s"])
                         if base is not None else None)
    rows.append(row)
    eff = "" if row["efficiency"] is None else f"  efficiency {100 * row['efficiency']:.1f}%"
    print(f"devices={n} global_batch={row['global_batch']} step={row['step_ms']:.2f} ms "
          f"(best {row['best_step_ms']:.2f}) examples/s={row['examples_per_s']:.1f}{eff}",
          flush=True)
  result = {"config": dict(config, **{"tiny": args.tiny}), "implementation": args.implementation,
            "model_parallel": args.model_parallel, "per_device_batch": args.global_batch is None,
            "devices": [str(d) for d in jax.devices()[:max(r["devices"] for r in rows)]],
            "jax": jax.__version__, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "rows": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
