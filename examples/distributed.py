"""Training :mod:`train_kunlun`'s model on several devices: mesh, shardings, sharded steps.

    python examples/train_kunlun.py --devices 8 --model-parallel 2

Layout (a ``jax.sharding.Mesh`` with axes ``("data", "model")``, devices = data × model):

* The batch is split by examples over *all* devices (both axes): each device trains on
  B / devices examples. The jagged behaviour sequence is split by samples, each shard packed in
  its own block with local offsets (:func:`pallas_norm.sharding.split_jagged`).
* Parameters and optimizer state are replicated, except the two large embedding tables
  (``sparse_embed``, ``item_embed``) and their AdamW moments, split by rows over ``"model"``
  (and replicated over ``"data"``); the lookups go through
  :func:`pallas_norm.sharding.row_sharded_take`.
* The forward and backward of a shard run inside one ``jax.shard_map``: the model's code is the
  single-device code, its pallas-norm ops (kernels included) run on the shard's own rows. The
  loss is the mean of the shards' mean losses (equal shard sizes: the global mean); the
  transpose of ``shard_map`` sums each parameter's gradient over the devices that replicate it.
  The AdamW update runs under ``jax.jit`` on the sharded state (each device updates its rows).
* Checkpoints (Orbax, as in the single-device script) save the sharded arrays and restore them
  directly into the mesh's shardings.

Multi-host: start the same command on every host with ``--multi-host``; it calls
``jax.distributed.initialize()`` before anything touches the devices, which finds the cluster in
the environment (SLURM, Open MPI, Kubernetes; see jax's multi-process guide) or takes
``--coordinator-address host:port --num-processes N --process-id I``. ``--devices`` then counts
the devices of all hosts. Every process builds the same global batches (same seed) and
hands each of its devices its own shard (``jax.make_array_from_callback``); the checkpoint
directory must be shared by all hosts. Tested as two processes on one CPU machine
(``scripts/multihost_cpu.sh``), not across machines or GPUs (see the README).

Run alone (``python examples/distributed.py [flags]``, see :func:`main`) it trains nothing: it
checks its flags and prints the mesh and layout they give on this machine.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import re
import shlex
import sys

if __name__ == "__main__":  # as a script: the checkout's pallas_norm, as train_kunlun.py does
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ads_data  # noqa: E402
from pallas_norm import sharding as pn_sharding  # noqa: E402

DATA, MODEL = "data", "model"
ALL = (DATA, MODEL)
TABLES = ("sparse_embed", "item_embed")
"""The embedding tables split by rows over the model axis (the model's attribute names)."""
_TABLE_PATH = re.compile(r"\['(" + "|".join(TABLES) + r")'\]\['embedding'\]")


class TableSplitError(ValueError):
  """An embedding table whose rows do not split evenly over the mesh's model axis
  (``--model-parallel``): train_kunlun exits 2 with its one-line message."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The command-line flags of this module (``--devices``, ``--model-parallel``,
  ``--multi-host``)."""
  parser.add_argument("--devices", default="auto",
                      help="devices to train on: a number or 'auto' (all of them); the batch "
                      "size must be a multiple of it")
  parser.add_argument("--model-parallel", type=int, default=1,
                      help="size of the mesh's model axis, over which the embedding tables are "
                      "split by rows (a divisor of --devices)")
  parser.add_argument("--multi-host", action="store_true",
                      help="call jax.distributed.initialize() first (one process per host); "
                      "the cluster comes from the environment (SLURM, Open MPI, Kubernetes) "
                      "or the three flags below")
  parser.add_argument("--coordinator-address", default=None,
                      help="with --multi-host: host:port of process 0 (or "
                      "JAX_COORDINATOR_ADDRESS)")
  parser.add_argument("--num-processes", type=int, default=None, help="with --multi-host")
  parser.add_argument("--process-id", type=int, default=None, help="with --multi-host")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Exits through ``parser.error`` on flags that cannot work (``--batch-size`` too, where the
  parser has it); sets ``args.devices`` to an int.

  Initializes the multi-host runtime first when asked, since that decides the device count."""
  if args.multi_host:
    _initialize(parser, args)
  elif (args.coordinator_address, args.num_processes, args.process_id) != (None,) * 3:
    parser.error("--coordinator-address, --num-processes and --process-id need --multi-host")
  available = jax.device_count()
  if args.devices == "auto":
    args.devices = available
  else:
    try:
      args.devices = int(args.devices)
    except ValueError:
      parser.error(f"--devices must be a number or 'auto', got {args.devices!r}")
  if not 1 <= args.devices <= available:
    parser.error(f"--devices must be between 1 and the {available} devices here, got "
                 f"{args.devices}")
  if args.model_parallel < 1 or args.devices % args.model_parallel:
    parser.error(f"--model-parallel must divide --devices={args.devices}, got "
                 f"{args.model_parallel}")
  if getattr(args, "batch_size", None) is not None and args.batch_size % args.devices:
    parser.error(f"--batch-size {args.batch_size} must be a multiple of --devices "
                 f"{args.devices}")


def _initialize(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """``jax.distributed.initialize`` with the flags, range-checked first; its own refusals (no
  cluster in the environment, a flag it needs) become ``parser.error``."""
  n, i = args.num_processes, args.process_id
  if n is not None and n < 1:
    parser.error(f"--num-processes must be >= 1, got {n}")
  if i is not None and not (0 <= i and (n is None or i < n)):
    parser.error(f"--process-id must be >= 0 and below --num-processes ({n}), got {i}")
  try:
    jax.distributed.initialize(args.coordinator_address, n, i)
  except (ValueError, RuntimeError) as e:
    parser.error(f"--multi-host: jax.distributed.initialize failed: {e}")


def make_runner(args, *, loss_fn, train_step, predict):
  """The step functions for ``args.devices``: the script's own single-device ``train_step`` and
  ``predict`` on one device, a :class:`MeshRunner` on several."""
  if getattr(args, "devices", 1) == 1:
    return SingleDevice(train_step, predict)
  return _mesh_runner(args.devices, args.model_parallel, loss_fn)


@functools.cache
def _mesh_runner(devices: int, model_parallel: int, loss_fn):
  # One runner per layout: a second run in the process (tests, a resume) reuses its compiled
  # steps, as the script's module-level steps do on one device.
  return MeshRunner(make_mesh(devices, model_parallel), loss_fn)


def make_mesh(devices: int, model_parallel: int = 1) -> jax.sharding.Mesh:
  """A (devices / model_parallel, model_parallel) mesh with axes ("data", "model") over the
  first ``devices`` devices (of all processes). Auto axes: XLA propagates the shardings of the
  jitted update from the state's."""
  return jax.make_mesh((devices // model_parallel, model_parallel), ALL,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:devices])


class SingleDevice:
  """The single-device script's steps behind the :class:`MeshRunner` interface."""

  def __init__(self, train_step, predict):
    self.train_step = train_step
    self._predict = predict

  def adapt(self, model):
    return model

  def place_state(self, state):
    return jax.device_put(state, jax.devices()[0])

  def predict(self, graphdef, state, batch) -> np.ndarray:
    return np.asarray(self._predict(graphdef, state, batch))


def state_specs(state):
  """PartitionSpecs of a model's or (model, optimizer)'s state: the rows of the embedding tables
  (:data:`TABLES`, and their optimizer moments, which have the same path tail) over "model",
  everything else replicated."""
  def spec(path, leaf):
    if _TABLE_PATH.search(jax.tree_util.keystr(path)) and jnp.ndim(leaf) == 2:
      return P(MODEL, None)
    return P()
  return jax.tree_util.tree_map_with_path(spec, state)


def batch_specs() -> ads_data.Batch:
  """Every field of a sharded :class:`ads_data.Batch` is split over all devices by examples
  (the sequences and their local offsets by samples)."""
  return ads_data.Batch(*(P(ALL),) * len(ads_data.Batch._fields))


def shard_batch(batch: ads_data.Batch, num_shards: int) -> ads_data.Batch:
  """A host batch with its jagged sequences split by samples into ``num_shards`` blocks with
  local offsets (:func:`pallas_norm.sharding.split_jagged`); the other fields keep their
  example order, so block s of every field holds the same examples."""
  seq_ids, seq_offsets = pn_sharding.split_jagged(batch.seq_ids, batch.seq_offsets, num_shards)
  return batch._replace(seq_ids=seq_ids, seq_offsets=seq_offsets)


def put_global(tree, shardings):
  """Host or device arrays that every process holds in full, as global arrays with
  ``shardings``; each process only transfers the shards of its own devices (multi-host safe)."""
  def put(x, sharding):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(put, tree, shardings)


class RowShardedEmbed(nnx.Embed):
  """``nnx.Embed`` whose table is split by rows over a mesh axis; call it inside ``shard_map``
  over that axis (:func:`pallas_norm.sharding.row_sharded_take`). Same parameter as the layer it
  replaces, so states and checkpoints are interchangeable."""

  def __init__(self, embed: nnx.Embed, axis_name: str):
    super().__init__(embed.num_embeddings, embed.features, dtype=embed.dtype,
                     param_dtype=embed.param_dtype, embedding_init=nnx.initializers.zeros_init(),
                     rngs=nnx.Rngs(0))
    self.embedding = embed.embedding  # the replaced layer's parameter itself
    self.axis_name = axis_name

  def __call__(self, inputs, out_sharding=None):
    del out_sharding  # inside shard_map the result is this device's rows
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return pn_sharding.row_sharded_take(table, inputs, self.axis_name)


def use_row_sharded_tables(model, axis_name: str = MODEL):
  """Replaces the model's :data:`TABLES` layers by :class:`RowShardedEmbed` (in place); their
  rows must split evenly over the axis (:meth:`MeshRunner.adapt` checks it)."""
  for name in TABLES:
    setattr(model, name, RowShardedEmbed(getattr(model, name), axis_name))
  return model


class MeshRunner:
  """Sharded ``train_step`` and ``predict`` over ``mesh`` (see the module docstring)."""

  def __init__(self, mesh: jax.sharding.Mesh, loss_fn):
    self.mesh = mesh
    self.loss_fn = loss_fn
    self.num_shards = math.prod(mesh.shape.values())

  def adapt(self, model):
    """The model with its tables read by rows over "model" (when that axis is larger than 1).

    Raises: TableSplitError (a ValueError) when a table's rows do not split evenly over the
      model axis."""
    parts = self.mesh.shape[MODEL]
    if parts == 1:
      return model
    for name in TABLES:
      rows = getattr(model, name).num_embeddings
      if rows % parts:
        raise TableSplitError(f"{name}: {rows} rows do not split over --model-parallel "
                              f"{parts}; pass a --model-parallel that divides {rows}")
    return use_row_sharded_tables(model)

  def shardings(self, state):
    return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), state_specs(state))

  def place_state(self, state):
    """``state`` laid out on the mesh (tables by rows, the rest replicated)."""
    return put_global(state, self.shardings(state))

  def place_batch(self, batch: ads_data.Batch) -> ads_data.Batch:
    """A host batch (the same on every process) as global arrays split over all devices."""
    sharded = shard_batch(batch, self.num_shards)
    return put_global(sharded, jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                                            batch_specs()))

  def train_step(self, graphdef, state, batch):
    """One AdamW step on the host ``batch``; returns (new state, mean loss)."""
    return self._jitted_step(graphdef, state, self.place_batch(batch))

  def predict(self, graphdef, state, batch) -> np.ndarray:
    """Click logits (B,) of the host ``batch`` as a NumPy array (on every process)."""
    logits = self._jitted_predict(graphdef, state, self.place_batch(batch))
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(logits, tiled=True))
    return np.asarray(logits)

  def _per_shard(self, fn, model_graphdef, params, rest, batch):
    """``fn(model, batch)`` (a per-example (B,) or a scalar per shard) run on every shard."""
    def local(params, rest, batch):
      out = fn(nnx.merge(model_graphdef, params, rest), batch)
      return jnp.reshape(out, (-1,))
    specs = (state_specs(params), state_specs(rest), batch_specs())
    # check_vma=False: kernels inside (see pallas_norm.sharding's module docstring).
    return jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=P(ALL),
                         check_vma=False)(params, rest, batch)

  @functools.cached_property
  def _jitted_step(self):
    def step(graphdef, state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      model_graphdef, params, rest = nnx.split(model, nnx.Param, ...)

      def mean_loss(params):
        return jnp.mean(self._per_shard(self.loss_fn, model_graphdef, params, rest, batch))

      loss, grads = jax.value_and_grad(mean_loss)(params)
      optimizer.update(model, grads)
      new_state = nnx.state((model, optimizer))
      return jax.lax.with_sharding_constraint(new_state, self.shardings(new_state)), loss
    return jax.jit(step, static_argnums=0, donate_argnums=1)

  @functools.cached_property
  def _jitted_predict(self):
    def predict(graphdef, state, batch):
      model, _ = nnx.merge(graphdef, state)
      model_graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      def logits(model, batch):
        return model(batch.sparse_ids, batch.dense, batch.seq_ids, batch.seq_offsets)
      return self._per_shard(logits, model_graphdef, params, rest, batch)
    return jax.jit(predict, static_argnums=0)


DESCRIPTION = """\
The multi-device part of examples/train_kunlun.py: a (data, model) mesh of --devices devices,
the batch split by examples over all of them, the embedding tables (and their AdamW moments)
split by rows over the model axis, every other parameter replicated, and each shard's forward
and backward in one jax.shard_map. Train with these flags on train_kunlun.py:

  python examples/train_kunlun.py --devices 8 --model-parallel 2

Run alone, this script trains nothing: it checks the flags and prints the mesh and layout they
give on this machine, and the train_kunlun.py command line that trains on it."""


def main(argv=None) -> int:
  """``python examples/distributed.py [flags]``: the flags of :func:`add_arguments`, checked
  (exit 2 with argparse's message for flags that cannot work here), and the layout they give
  printed; returns 0. ``--multi-host`` initializes the multi-host runtime as in training."""
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(prog="distributed.py", description=DESCRIPTION,
                                   epilog="Exit status: 0, or 2 for flags that cannot work.",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser)
  args = parser.parse_args(argv)
  check_arguments(parser, args)
  mesh = make_mesh(args.devices, args.model_parallel)
  data, model, n = mesh.shape[DATA], mesh.shape[MODEL], args.devices
  processes = jax.process_count()
  print(f"mesh: {DATA} {data} x {MODEL} {model} = {n} {jax.default_backend()} device"
        f"{'s' * (n > 1)}, {processes} process{'es' * (processes > 1)}")
  print(f"batch: split by examples over the {n} device{'s' * (n > 1)} (train_kunlun.py's "
        f"--batch-size: a multiple of {n})")
  print(f"tables: {' and '.join(TABLES)} split by rows in {model} over {MODEL!r}, their AdamW "
        "moments too; the other parameters replicated")
  print(f"train: {shlex.join(['python', 'examples/train_kunlun.py', *argv])}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
