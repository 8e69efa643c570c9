"""Train the Kunlun-style CTR model (:class:`flax_layers.KunlunModel`) on ads click data.

    python examples/train_kunlun.py --data taobao --steps 200 --implementation xla

Data: ``synthetic`` (generated), ``taobao`` or ``criteo`` (samples under ``--data-dir``, default
``../shared/data`` beside the checkout); see :mod:`ads_data`. A jit-compiled step runs AdamW on
the mean sigmoid cross-entropy; validation log-loss and AUC are printed every ``--eval-every``
steps; with ``--checkpoint-dir`` the parameters, optimizer state and step are saved with Orbax,
and ``--resume`` continues from the latest saved step up to ``--steps`` in total (the batch order
depends only on (seed, step), so a resumed run sees the batches an uninterrupted one would; a
resume with another --data, --seed, --batch-size or --train-examples than the checkpoint's is
refused, as is one whose data differ from the saved run's (checkpoints record a fingerprint of
the data, :func:`ads_data.fingerprint`; one saved without it, or with an older one that hashed
only the ends of each file, resumes with a warning); --lr,
--weight-decay, --dtype (the compute dtype: parameters stay float32), --implementation and
--steps may differ, as when training on from a checkpoint with new settings: AdamW's moments
are restored as saved and the new values apply from the resumed step).
``--devices N`` (default: every device) and ``--model-parallel M`` train data- and table-parallel
on a mesh of N devices (:mod:`distributed`; ``--multi-host`` for several hosts).
``--token-buckets K`` packs each batch's behaviour sequences into the smallest of K static
capacities that holds them (:func:`ads_data.bucket_capacity`) instead of B · max_seq_len rows,
of which lengths uniform on [1, max_seq_len] fill about half; each capacity that occurs compiles
its own step (default: 16 on one GPU, 1 elsewhere, where compiling costs more than it saves).

The progress bar shows the last batch's loss, the median step time and examples/s so far; the
last line printed is machine-readable::

    final: train_loss=<f> val_logloss=<f> val_auc=<f> steps=<n> step_ms=<f> examples_per_s=<f>

train_loss is the mean over the last 10% of this run's steps (the ``step N:`` lines show the
last batch's loss); step_ms is the median wall-clock time of a training step and
examples_per_s the examples of all training steps over their total time, both without the
compiling steps (the first, and with ``--token-buckets`` the first of each new capacity; nan
for a single step).

Exit status: 2 with a one-line message for missing or malformed data, synthetic data too
large for memory (about 48 bytes per behaviour item, (--max-seq-len + 1) / 2 items per example,
past half of the machine's memory), a --batch-size larger than the training set, a checkpoint
of another model or data, a --checkpoint-dir with less free space than a checkpoint's
arrays (checked before training and before each save), a --model-parallel that does not
divide the embedding tables' rows, or an --implementation with no kernel for the model's
calls. SIGTERM (a preempted job) or Ctrl-C during training stops it after the current step
(saying so at once), saves that step with --checkpoint-dir and exits 143 or 130 with one line
(at the last step the run ends as usual); a second Ctrl-C stops at once,
leaving that save unfinished (the next --resume starts from the checkpoint before it). A
signal during a step's compile (the first step's, and each new capacity's with
--token-buckets) takes effect when that step ends. Before the training loop (imports, loading
the data and a checkpoint, building the model) either signal exits at once with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import shutil
import signal
import sys
import threading
import time
from typing import NamedTuple


def _interrupted_outside_training(signum, frame):
  # Raising KeyboardInterrupt here gave a traceback from whichever import was running, and in
  # JAX's garbage-collection callback it was printed and ignored; nothing is being written
  # outside the training loop, so exit at once.
  os.write(2, f"train_kunlun: interrupted by {signal.Signals(signum).name} outside training "
              "(nothing was being saved)\n".encode())
  os._exit(128 + signum)


if __name__ == "__main__":  # the imports below take seconds
  for _signum in (signal.SIGINT, signal.SIGTERM):
    if signal.getsignal(_signum) is not signal.SIG_IGN:
      signal.signal(_signum, _interrupted_outside_training)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

# The checkout's root first: runs without installing, and finds flax_layers/ as a regular package
# even where an older editable install registered it as a namespace.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ads_data  # noqa: E402
import distributed  # noqa: E402  (several devices: --devices, --model-parallel, --multi-host)
import pallas_norm  # noqa: E402
import pallas_norm.sharding  # noqa: E402  (gpu_interpret_reason: --implementation interpret)
from flax_layers import KunlunConfig, KunlunModel  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
IMPLEMENTATIONS = ("default", "xla", "mosaic", "interpret")
INTERPRET_HINT = ("a step takes seconds and every evaluation batch as long, so try "
                  "PJRT_NPROC=8 python examples/train_kunlun.py --implementation interpret "
                  "--embed-dim 64 --head-dim 32 --batch-size 8 --max-seq-len 8 --steps 3 "
                  "--eval-every 3 --valid-examples 16 (measured: under two minutes of CPU "
                  "time, most of it compiling); the defaults, 200 steps and an evaluation of "
                  "all 2048 validation examples every 50, take far longer")


class CheckpointMismatchError(ValueError):
  """The checkpoint to resume from was saved for a different model config, by a run whose
  batch stream (:func:`data_stream`) differs from this one's, or from other data
  (:func:`ads_data.fingerprint`)."""


class CheckpointIncompleteError(ValueError):
  """The latest checkpoint step lacks the config or the state (an interrupted save or copy)."""


class CheckpointSpaceError(OSError):
  """The disk under --checkpoint-dir has less free space than the next checkpoint's state:
  Orbax writing into a full disk printed ~2,300 lines of tracebacks and then crashed."""


class BatchSizeError(ValueError):
  """--batch-size exceeds the training examples: every batch would hold each example several
  times (10^8 over 64 examples hung, cutting 1.5 million epochs into the first batch)."""


class Stopped(Exception):
  """SIGTERM (a preempted or cancelled job) or SIGINT (Ctrl-C) during training: the loop
  finished its current step, checkpointed it with --checkpoint-dir, and stopped."""

  def __init__(self, signum: int, step: int, directory: pathlib.Path | None,
               not_saved: str | None = None):
    self.signum, self.step = signum, step
    if directory is None:
      kept = "; nothing saved (no --checkpoint-dir)"
    elif not_saved is not None:
      kept = f"; step {step} not saved: {not_saved}"
    else:
      kept = f"; checkpoint of step {step} saved under {directory} (--resume continues from it)"
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{kept}")


@contextlib.contextmanager
def _stop_requests():
  """Yields a list to which SIGTERM and SIGINT append their number while the training loop
  runs, so that it stops after the current step and saves it: a preempted job gets SIGTERM and
  then, after a grace period, SIGKILL. A second Ctrl-C interrupts at once (a SIGTERM then a
  Ctrl-C still stop after the step). Nothing is installed outside the main thread (Python runs
  handlers there only) or on several processes, whose saves are collective: a signal reaching
  one process at another step would hang them."""
  requests: list[int] = []
  if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
    yield requests
    return

  def request_stop(signum, frame):
    if signum == signal.SIGINT and signal.SIGINT in requests:
      raise KeyboardInterrupt
    if not requests:  # the step and its evaluation may take a while: say the signal was seen
      # os.write: a print could re-enter the stream the handler interrupted.
      again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
      os.write(2, f"\ntrain_kunlun: {signal.Signals(signum).name}: stopping after this step"
                  f"{again}\n".encode())
    requests.append(signum)

  # A signal the process was started ignoring (SIGINT under nohup or `&`) stays ignored.
  previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)
              if signal.getsignal(s) is not signal.SIG_IGN}
  try:
    yield requests
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


class CheckpointDirInUseError(ValueError):
  """A run without --resume was pointed at a folder that already holds checkpoints: Orbax
  skips saves at or below its latest step, so the run would keep none of its own and a later
  --resume would restore the other run's."""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              epilog=__doc__[__doc__.index("Exit status:"):],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data", choices=ads_data.DATASETS, default="synthetic")
  p.add_argument("--data-dir", type=pathlib.Path, default=ads_data.DEFAULT_DATA_DIR,
                 help="folder holding taobao_ad_sample/ and criteo_sample.txt")
  p.add_argument("--implementation", choices=IMPLEMENTATIONS, default="default",
                 help="pallas-norm implementation. default: the library's choice (on a Hopper "
                 "GPU the kernels where measured faster, cuDNN's flash attention for the softmax "
                 "attentions; XLA elsewhere). xla: XLA everywhere. mosaic / interpret: the "
                 "kernels (interpret: in GPU interpret mode on the CPU) in every layer whose "
                 "shapes they support, XLA in the others (the model gets (name, 'xla')). The "
                 "kernels need K and N multiples of 64: with the default sizes few layers fit, "
                 "with --embed-dim 64 --head-dim 32 every norm-fused dense layer but the 1-wide "
                 "head does. Interpret mode emulates the GPU on the CPU and is slow: "
                 f"{INTERPRET_HINT}")
  p.add_argument("--embed-dim", type=int, default=KunlunConfig.embed_dim,
                 help="width of a context token")
  p.add_argument("--head-dim", type=int, default=KunlunConfig.head_dim,
                 help="width of an attention head (2 heads)")
  p.add_argument("--steps", type=int, default=200, help="total training steps")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--max-seq-len", type=int, default=32)
  p.add_argument("--seed", type=int, default=0, help="seeds init, batch order, synthetic data")
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--weight-decay", type=float, default=1e-4)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--train-examples", type=int, default=ads_data.SYNTHETIC_TRAIN_EXAMPLES,
                 help="examples of --data synthetic's training split (the others ignore it)")
  p.add_argument("--valid-examples", type=int, default=None,
                 help="evaluate on the first N validation examples (default: all of them)")
  p.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                 help="save parameters, optimizer state and step with Orbax at every "
                 "--eval-every step and the last one, keeping the latest two (created if "
                 "missing; a fresh run needs it free of checkpoints)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the latest checkpoint under --checkpoint-dir; where it "
                 "holds none (or does not exist), start from step 0 and say so. Exit 2 when "
                 "the checkpoint was saved for another model config, another --data, --seed, "
                 "--batch-size or --train-examples, or other data: each checkpoint records the "
                 "size and SHA-256 of every file read under --data-dir (the generating "
                 "arguments for synthetic data; not the folder's path: the same files moved "
                 "resume), and a file of another size or other contents is refused, naming it. "
                 "A checkpoint saved before fingerprints were recorded resumes unchecked, one "
                 "whose fingerprint hashed only each file's first and last 64 KiB with those "
                 "checked; both with a warning on stderr")
  p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--token-buckets", default="auto",
                 help="pack each batch's sequences into the smallest of this many static "
                 "capacities (multiples of B*max-seq-len/K) that holds them, one compiled step "
                 "per capacity used; 1: always B*max-seq-len. auto: 16 on one GPU, else 1 "
                 "(several devices need 1)")
  distributed.add_arguments(p)
  args = p.parse_args(argv)
  for name in ("steps", "batch_size", "max_seq_len", "eval_every", "embed_dim", "head_dim",
               "train_examples", "valid_examples"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  # NumPy's generators take no negative seed, jax.random none of 64 bits or more (tracebacks)
  if not 0 <= args.seed < 2**63:
    p.error(f"--seed must be >= 0 and < 2**63, got {args.seed}")
  if args.max_seq_len < 2:  # ads_data.load's bound (the synthetic lengths); was a traceback
    p.error("--max-seq-len must be >= 2")
  if not (np.isfinite(args.lr) and args.lr > 0):  # nan trained silently to a nan log-loss
    p.error(f"--lr must be a positive finite number, got {args.lr}")
  if not (np.isfinite(args.weight_decay) and args.weight_decay >= 0):
    p.error(f"--weight-decay must be a non-negative finite number, got {args.weight_decay}")
  if args.resume and args.checkpoint_dir is None:
    p.error("--resume needs --checkpoint-dir")
  if args.checkpoint_dir is not None:
    # Orbax failed on these only at the first save, after training had begun: a file in the
    # path, or a nearest existing folder that takes no writes (a read-only mount).
    existing = next(d for d in (args.checkpoint_dir, *args.checkpoint_dir.parents) if d.exists())
    if not existing.is_dir():
      p.error(f"--checkpoint-dir must be a directory, but {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
      p.error(f"--checkpoint-dir {args.checkpoint_dir}: {existing} is not writable")
  distributed.check_arguments(p, args)
  args.token_buckets = _token_buckets(p, args)
  return args


def _token_buckets(parser, args) -> int:
  """``--token-buckets`` as an int (see its help); exits through ``parser.error`` when bad."""
  if args.token_buckets == "auto":
    return 16 if args.devices == 1 and jax.default_backend() == "gpu" else 1
  try:
    buckets = int(args.token_buckets)
  except ValueError:
    buckets = 0
  if buckets < 1:
    parser.error(f"--token-buckets must be 'auto' or an int >= 1, got {args.token_buckets!r}")
  if buckets > 1 and args.devices > 1:
    parser.error("--token-buckets > 1 needs --devices 1 (the sharded batch splits its "
                 "capacity evenly over the devices)")
  return buckets


# ---------------------------------------------------------------------------------------------
# Metrics


def logloss(labels, logits) -> float:
  """Mean binary cross-entropy of logits, computed stably (log(1 + e^z) − y·z)."""
  z = np.asarray(logits, np.float64)
  return float(np.mean(np.logaddexp(0.0, z) - np.asarray(labels, np.float64) * z))


def auc(labels, scores) -> float:
  """ROC AUC by the rank (Mann–Whitney) formula with average ranks for tied scores; nan when
  the labels hold a single class."""
  labels = np.asarray(labels) > 0.5
  n_pos = int(labels.sum())
  n_neg = labels.size - n_pos
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  _, inverse, counts = np.unique(np.asarray(scores, np.float64), return_inverse=True,
                                 return_counts=True)
  avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each value
  rank_sum = avg_rank[inverse][labels].sum()
  return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ---------------------------------------------------------------------------------------------
# Model, steps, checkpoints


def build(args, spec: ads_data.DataSpec):
  """(config, model, optimizer) for the dataset's features."""
  config = KunlunConfig(num_sparse_features=spec.num_sparse_features,
                        num_dense_features=spec.num_dense_features,
                        sparse_vocab_size=spec.sparse_vocab_size,
                        item_vocab_size=spec.item_vocab_size, max_seq_len=args.max_seq_len,
                        embed_dim=args.embed_dim, head_dim=args.head_dim)
  model = KunlunModel(config, dtype=DTYPES[args.dtype], param_dtype=jnp.float32,
                      rngs=nnx.Rngs(args.seed), implementation=model_implementation(args))
  return config, model, nnx.Optimizer(model, make_tx(args.lr, args.weight_decay), wrt=nnx.Param)


def check_implementation_can_run(implementation, devices: int = 1) -> None:
  """NotImplementedError when a kernel implementation asked for on the command line cannot run
  on this machine at all (e.g. "mosaic" off a Hopper GPU, "interpret" with too few CPU client
  threads, either under jax_enable_x64), so the run does not silently train on XLA under its
  name. Probes the library with one tiny pre-norm GEMM, which gives the library's own reason.
  "interpret" on several ``devices``: the model's ``shard_map`` would run jax's GPU
  interpreter on each, which fails there (:func:`pallas_norm.sharding.gpu_interpret_reason`)."""
  if implementation not in ("mosaic", "interpret"):
    return
  reason = implementation == "interpret" and pallas_norm.sharding.gpu_interpret_reason(devices)
  if reason:
    raise NotImplementedError(f"--implementation interpret with --devices {devices}: {reason}; "
                              "pass --devices 1 (or --implementation xla)")
  x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
  try:
    jax.block_until_ready(pallas_norm.norm_matmul(x, w, implementation=implementation))
  except (NotImplementedError, RuntimeError) as e:
    raise NotImplementedError(f"--implementation {implementation} cannot run here: {e}") from e


def model_implementation(args):
  """The model's ``implementation``: a kernel name becomes (name, "xla"), the kernel wherever a
  layer's shapes fit it and XLA elsewhere (see pallas_norm._dispatch); "default" is None, the
  library's choice; "xla" as given."""
  if args.implementation in ("mosaic", "interpret"):
    return (args.implementation, "xla")
  return None if args.implementation == "default" else args.implementation


@functools.lru_cache(maxsize=8)
def make_tx(lr: float, weight_decay: float) -> optax.GradientTransformation:
  """AdamW after global-norm clipping. Cached: the transformation is static data of the
  optimizer's graph definition, so reusing it lets equal runs share the compiled steps."""
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(lr, weight_decay=weight_decay))


def loss_fn(model: KunlunModel, batch: ads_data.Batch):
  logits = model(batch.sparse_ids, batch.dense, batch.seq_ids, batch.seq_offsets)
  return optax.sigmoid_binary_cross_entropy(logits, batch.labels).mean()


# Module-level jitted steps with the graph definition as a static argument: the split/merge form
# of ``nnx.jit`` (no module-graph traversal per call), and a second run of the same model in one
# process (tests, a resume) reuses the compiled program.
@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def train_step(graphdef, state, batch):
  """One AdamW step on ``batch``; returns (new state, mean loss)."""
  model, optimizer = nnx.merge(graphdef, state)
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return nnx.state((model, optimizer)), loss


@functools.partial(jax.jit, static_argnums=0)
def predict(graphdef, state, batch):
  """Click logits (B,) of ``batch``."""
  model, _ = nnx.merge(graphdef, state)
  return model(batch.sparse_ids, batch.dense, batch.seq_ids, batch.seq_offsets)


def evaluate(graphdef, state, ds, batch_size, max_seq_len, predict_fn=predict,
             token_buckets: int = 1) -> tuple[float, float]:
  """(log-loss, AUC) of the model on every example of ``ds``; ``predict_fn`` as
  :func:`predict` (a sharded one for several devices); batches packed as
  :func:`ads_data.eval_batches` with ``token_buckets``."""
  logits = []
  for batch, n_real in ads_data.eval_batches(ds, batch_size, max_seq_len, token_buckets):
    logits.append(np.asarray(predict_fn(graphdef, state, batch))[:n_real])
  logits = np.concatenate(logits)
  return logloss(ds.labels, logits), auc(ds.labels, logits)


def checkpoint_manager(directory: pathlib.Path) -> ocp.CheckpointManager:
  # Synchronous saves: the next train step donates (deletes) the state buffers being saved.
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(directory.resolve(), options=options)


def data_stream(args) -> dict:
  """The flags that decide which batches step s sees (the batch order depends only on them and
  s): a resumed run must have the saved run's, or it continues on another stream."""
  return {"data": args.data, "seed": args.seed, "batch_size": args.batch_size,
          "train_examples": args.train_examples if args.data == "synthetic" else None}


def save_checkpoint(manager, step: int, state, config: KunlunConfig,
                    stream: dict | None = None, data: dict | None = None) -> None:
  """Saves params + optimizer state (which holds the step), the model config, and (when given)
  the run's :func:`data_stream` and the fingerprint of its data (:func:`ads_data.fingerprint`),
  each config and metadata item as an Orbax JSON item."""
  _check_space(manager, state)
  items = dict(state=ocp.args.StandardSave(state),
               config=ocp.args.JsonSave(dataclasses.asdict(config)))
  if stream is not None:
    items["data_stream"] = ocp.args.JsonSave(stream)
  if data is not None:
    items["data_fingerprint"] = ocp.args.JsonSave(data)
  manager.save(step, args=ocp.args.Composite(**items))


def _check_space(manager, state) -> None:
  """Refuses (:class:`CheckpointSpaceError`), before Orbax writes anything, a folder with less
  free space than the state's arrays: Orbax's files measured ~0.7 of them, and a save that
  runs out of space mid-write gave hundreds of lines of tracebacks and exit 1 (a review:
  refusing only under half let a tight disk through). One process only: on several, a refusal
  on one of them would leave the others waiting in the collective save."""
  if jax.process_count() > 1:
    return
  directory = pathlib.Path(manager.directory)
  need = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(state))
  free = shutil.disk_usage(directory).free
  if free < need:
    raise CheckpointSpaceError(
        f"--checkpoint-dir {directory} has {free / 2**20:.1f} MiB free, less than the "
        f"{need / 2**20:.1f} MiB of arrays each checkpoint of this model saves: free some space "
        f"or pass another folder; {_kept(directory)}")


def _kept(directory: pathlib.Path) -> str:
  """What a run that stops now leaves under --checkpoint-dir, for its last line: the step
  folders Orbax finished (an unfinished one is named "<step>.orbax-checkpoint-tmp")."""
  steps = sorted(int(d.name) for d in (directory.iterdir() if directory.is_dir() else ())
                 if d.is_dir() and d.name.isdigit())
  if not steps:
    return f"no checkpoint saved under {directory}"
  return (f"the checkpoint{'s' * (len(steps) > 1)} of step{'s' * (len(steps) > 1)} "
          f"{', '.join(map(str, steps))} stay under {directory} (--resume continues "
          "from the latest)")


@contextlib.contextmanager
def _item_by_item():
  """Orbax logs a warning for each saved item a restore leaves out ('... could not be
  restored'), which read as if the state were lost: :func:`restore_checkpoint` reads the config
  and data stream before the state on purpose, so its restores run with absl's warnings off."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _is_closed_loop_report(unraisable) -> bool:
  return (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed")


class _NeverRetrievedQuiet(logging.Filter):
  """Drops asyncio's "Future/Task exception was never retrieved" records (logged when such a
  future is garbage-collected), the other form the orphaned reads below take."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(
        ("Future exception was never retrieved", "Task exception was never retrieved"))


@contextlib.contextmanager
def _orphaned_reads_quiet():
  """Orbax runs a restore in a fresh asyncio event loop and closes that loop as soon as the
  restore returns or raises. When one array of the state cannot be read, the restore raises
  while the reads of the other arrays (100-odd tensorstore opens) are still in flight, and
  each that finishes after the close reports an unraisable ``RuntimeError: Event loop is
  closed`` (a traceback each on stderr, 1 to 50 of them per failed restore: a race), or, when
  its future is collected with its error unread, asyncio logs "Future exception was never
  retrieved" with the error (4 of them after the line in one CI run). Nobody
  waits for those reads, so inside this block both reports are dropped, and after a failed
  restore for the rest of the process (the reads finish at any time after it); any other
  unraisable exception still reaches the previous hook, any other asyncio record its log."""
  previous = sys.unraisablehook
  asyncio_log, quiet = logging.getLogger("asyncio"), _NeverRetrievedQuiet()

  def hook(unraisable):
    if not _is_closed_loop_report(unraisable):
      previous(unraisable)

  sys.unraisablehook = hook
  asyncio_log.addFilter(quiet)
  yield  # an exception leaves the hook and the filter in place
  asyncio_log.removeFilter(quiet)
  if sys.unraisablehook is hook:
    sys.unraisablehook = previous


def _changed(saved: dict, want: dict) -> dict:
  """{key: (saved, wanted)} for each key of ``want`` whose saved value differs."""
  return {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}


def _other_source(where: str, saved: str | None, now: str) -> CheckpointMismatchError:
  # Said first and alone: the other flags of a run on another source (--train-examples is
  # synthetic's only, the files differ) differ as a consequence and hid the cause.
  return CheckpointMismatchError(
      f"{where} was trained on another data source: --data {saved}, where this run asks for "
      f"--data {now}; resume it with --data {saved} and the flags it was trained on")


def restore_checkpoint(manager, state, config: KunlunConfig, stream: dict | None = None,
                       data: dict | None = None):
  """The latest saved state, shaped like ``state``.

  Raises: CheckpointMismatchError when the saved :func:`data_stream` differs from ``stream``
    (when both exist; checkpoints saved without one are not checked), the saved data
    fingerprint from ``data`` (:func:`ads_data.fingerprint`; when ``data`` is given and the
    checkpoint has none, a warning on stderr and no check; one of an older version, which
    hashed only the ends of a file, checks those and warns), or the saved config from
    ``config``; CheckpointIncompleteError when the latest step lacks the config or the state,
    or one of its items cannot be read (an interrupted save or copy).
  """
  step = manager.latest_step()
  where = f"checkpoint at step {step}"
  fix = f"(an interrupted save or copy?): remove {manager.directory / str(step)} to resume " \
        "from the step before"

  def read(**items):
    try:
      with _orphaned_reads_quiet():
        return manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001  Orbax and tensorstore raise plain Exceptions too
      raise CheckpointIncompleteError(
          f"{where} could not be read ({type(e).__name__}: {' '.join(str(e).split())[:160]}) "
          f"{fix}") from e

  unchecked = []  # files whose saved fingerprint covers only their ends
  with _item_by_item():
    items = set(manager.item_metadata(step).keys())
    if missing := sorted({"config", "state"} - items):
      raise CheckpointIncompleteError(f"{where} lacks its {' and '.join(missing)} {fix}")
    # The data first: a change of --data shows as the flag, not as the feature counts.
    if stream is not None and "data_stream" in items:
      saved = read(data_stream=ocp.args.JsonRestore())
      if saved.data_stream.get("data") != stream["data"]:
        raise _other_source(where, saved.data_stream.get("data"), stream["data"])
      if diff := _changed(saved.data_stream, stream):
        flags = ", ".join(f"--{k.replace('_', '-')} {old} (now {new})"
                          for k, (old, new) in diff.items())
        raise CheckpointMismatchError(
            f"{where} was saved by a run with {flags}: resumed, this run would continue on "
            "another batch stream; pass the saved values")
    if data is not None and "data_fingerprint" in items:
      saved = read(data_fingerprint=ocp.args.JsonRestore()).data_fingerprint
      if saved.get("data") != data["data"]:
        raise _other_source(where, saved.get("data"), data["data"])
      if diffs := ads_data.fingerprint_differences(saved, data):
        now = " ".join(f"--{k.replace('_', '-')} {data[k]}" for k in ("data", "data_dir")
                       if k in data)
        then = f"; saved from --data-dir {saved['data_dir']}" if "data_dir" in saved else ""
        fix = ("pass the --data-dir and --data it was trained on" if "files" in data else
               "pass the flags it was trained on")
        raise CheckpointMismatchError(
            f"{where} was trained on other data than this run's ({now}{then}): "
            f"{'; '.join(diffs)}; {fix}")
      unchecked = ads_data.fingerprint_unchecked(saved)
    saved = read(config=ocp.args.JsonRestore())
    if diff := _changed(saved.config, dataclasses.asdict(config)):
      raise CheckpointMismatchError(f"{where} was saved for another model config; (saved, "
                                    f"now): {diff}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = read(state=ocp.args.StandardRestore(abstract))
  if data is not None and "data_fingerprint" not in items:
    print(f"train_kunlun: warning: {where} records no fingerprint of its data (saved by an "
          "older version): resuming without checking that it was trained on this run's data",
          file=sys.stderr)
  elif unchecked:
    print(f"train_kunlun: warning: {where} records a hash of only the first and last "
          f"{ads_data.FINGERPRINT_BYTES // 1024} KiB of {', '.join(unchecked)} (saved by an "
          "older version): resuming without checking the rest of it", file=sys.stderr)
  return restored.state


# ---------------------------------------------------------------------------------------------
# Main


class TrainResult(NamedTuple):
  """What :func:`train` returns: the final line, the split model+optimizer and the losses."""

  line: str
  graphdef: nnx.GraphDef
  state: nnx.State
  losses: list[float]


def _check_unused(directory: pathlib.Path) -> None:
  """A fresh run's checkpoint folder holds no checkpoint (:class:`CheckpointDirInUseError`)."""
  if not directory.exists():
    return
  manager = checkpoint_manager(directory)
  latest = manager.latest_step()
  manager.close()
  if latest is not None:
    raise CheckpointDirInUseError(
        f"--checkpoint-dir {directory} already holds checkpoints (latest step {latest}); pass "
        "--resume to continue that run, or give an empty folder")


def _initial_state(args, manager, config, state, data: dict | None):
  if not args.resume:
    return state
  if manager.latest_step() is None:
    tqdm.write(f"no checkpoint under {args.checkpoint_dir}: starting from step 0")
    return state
  return restore_checkpoint(manager, state, config, data_stream(args), data)


def _speed(step_seconds, batch_size) -> tuple[float, float]:
  """(median step ms, examples/s) of the training steps after the first (compiling) one; nan
  before there is one."""
  timed = step_seconds[1:]
  if not timed or sum(timed) <= 0:
    return float("nan"), float("nan")
  return 1e3 * float(np.median(timed)), len(timed) * batch_size / sum(timed)


def _final_line(losses, val, step, step_seconds, batch_size) -> str:
  tail = losses[-max(1, len(losses) // 10):] if losses else [float("nan")]
  step_ms, rate = _speed(step_seconds, batch_size)
  return (f"final: train_loss={np.mean(tail):.6f} val_logloss={val[0]:.6f} "
          f"val_auc={val[1]:.6f} steps={step} step_ms={step_ms:.2f} examples_per_s={rate:.1f}")


def _load(args, load_kw):
  """``ads_data.load`` of ``args.data``. Raises ads_data.DataTooLargeError naming the flags when
  ``load`` refuses synthetic data that would not fit in memory (its estimate, checked before
  generating: --max-seq-len 100000 was a numpy MemoryError traceback), and when loading runs
  out of memory all the same."""
  try:
    return ads_data.load(args.data, args.data_dir, **load_kw)
  except ads_data.DataTooLargeError as e:
    raise ads_data.DataTooLargeError(
        f"--data synthetic with --max-seq-len {args.max_seq_len} and --train-examples "
        f"{args.train_examples} (+ {ads_data.SYNTHETIC_VALID_EXAMPLES} validation examples, "
        f"which --valid-examples does not reduce) would not fit in memory ({e}); lower "
        "--max-seq-len or --train-examples") from e
  except MemoryError as e:
    raise ads_data.DataTooLargeError(
        f"out of memory loading --data {args.data} with --max-seq-len {args.max_seq_len}"
        + (f" and --train-examples {args.train_examples}" if args.data == "synthetic" else "")
        + f" ({type(e).__name__}: {' '.join(str(e).split())[:120]}); lower them") from e


def train(args) -> TrainResult:
  """Runs the job described by ``args`` (see :func:`parse_args`).

  Raises: ads_data.DataNotFoundError, ads_data.DataFormatError, ads_data.DataTooLargeError,
    BatchSizeError, CheckpointMismatchError, CheckpointDirInUseError, CheckpointSpaceError
    (before a save the disk cannot hold), distributed.TableSplitError (a --model-parallel that
    does not divide a table's rows); Stopped after the step during which SIGTERM or SIGINT
    arrived (with --checkpoint-dir, that step saved).
  """
  if args.checkpoint_dir is not None and not args.resume:
    _check_unused(args.checkpoint_dir)
  load_kw = dict(max_seq_len=args.max_seq_len, seed=args.seed, num_train=args.train_examples)
  train_ds, valid_ds, spec = _load(args, load_kw)
  if args.batch_size > len(train_ds):
    raise BatchSizeError(
        f"--batch-size {args.batch_size} is larger than the {len(train_ds)} training examples "
        f"of --data {args.data}"
        + (f" (--train-examples {args.train_examples})" if args.data == "synthetic" else "")
        + f": pass --batch-size {len(train_ds)} or less")
  # Recorded with each checkpoint and checked on --resume (the files as just read).
  data = ads_data.fingerprint(args.data, args.data_dir, **load_kw) if args.checkpoint_dir else None
  if args.valid_examples is not None:
    valid_ds = valid_ds.subset(np.arange(min(args.valid_examples, len(valid_ds))))
  config, model, optimizer = build(args, spec)
  # One device: this module's steps; several: sharded ones (examples/distributed.py).
  runner = distributed.make_runner(args, loss_fn=loss_fn, train_step=train_step, predict=predict)
  graphdef, state = nnx.split((runner.adapt(model), optimizer))
  del model, optimizer  # the loop owns `state` (donated each step)
  manager = checkpoint_manager(args.checkpoint_dir) if args.checkpoint_dir else None
  with contextlib.ExitStack() as scope:  # closed after the manager: see _stop_requests below
    try:
      # Commit the state to its device(s) before a restore, which then reads the checkpoint
      # straight into that placement: fresh and restored states hit the same compiled step.
      state = _initial_state(args, manager, config, runner.place_state(state), data)
      if manager is not None:  # before training, not at the first save --eval-every steps in
        _check_space(manager, state)
      step = start = int(nnx.merge(graphdef, state)[1].step[...])
      tqdm.write(f"data={args.data} train={len(train_ds)} valid={len(valid_ds)} "
                 f"start_step={start} steps={args.steps} batch={args.batch_size} "
                 f"dtype={args.dtype} implementation={args.implementation} "
                 f"devices={args.devices}x(model {args.model_parallel}) "
                 f"token_buckets={args.token_buckets}")
      batches = ads_data.train_batches(train_ds, args.batch_size, args.max_seq_len, args.seed,
                                       start_step=start, token_buckets=args.token_buckets)
      # From the first step to the manager's close: a signal after the loop (the final
      # evaluation, the close) is taken as one during the last step, which ends the run as usual.
      stop = scope.enter_context(_stop_requests())
      losses, step_seconds = [], []
      capacities = set()  # packed capacities whose step has compiled
      val = (float("nan"), float("nan"))
      with tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True) as bar:
        while step < args.steps:
          batch = next(batches)
          t0 = time.perf_counter()
          state, loss = runner.train_step(graphdef, state, batch)
          losses.append(float(loss))  # waits for the step
          # _speed drops the first step (it compiles); a later new capacity compiles too.
          if not step_seconds or batch.seq_ids.shape[0] in capacities:
            step_seconds.append(time.perf_counter() - t0)
          capacities.add(batch.seq_ids.shape[0])
          step += 1
          bar.update(1)
          step_ms, rate = _speed(step_seconds, args.batch_size)
          bar.set_postfix(loss=f"{losses[-1]:.4f}", step_ms=f"{step_ms:.4g}",
                          examples_per_s=f"{rate:.4g}", refresh=False)
          if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(graphdef, state, valid_ds, args.batch_size, args.max_seq_len,
                           runner.predict, args.token_buckets)
            tqdm.write(f"step {step}: batch_loss={losses[-1]:.4f} val_logloss={val[0]:.4f} "
                       f"val_auc={val[1]:.4f}")
            if manager is not None:
              save_checkpoint(manager, step, state, config, data_stream(args), data)
          if stop and step < args.steps:  # at the last step the run is done: it ends as usual
            not_saved = None
            if manager is not None and manager.latest_step() != step:
              try:
                save_checkpoint(manager, step, state, config, data_stream(args), data)
              except CheckpointSpaceError as e:
                not_saved = str(e)
            raise Stopped(stop[0], step, args.checkpoint_dir, not_saved)
      if not losses:  # resumed at or past --steps: report the saved model
        tqdm.write(f"nothing to train: the checkpoint is at step {step}, --steps is "
                   f"{args.steps}; evaluating the saved model (train_loss is nan)")
        val = evaluate(graphdef, state, valid_ds, args.batch_size, args.max_seq_len,
                       runner.predict, args.token_buckets)
    finally:
      if manager is not None:
        manager.wait_until_finished()
        manager.close()
  line = _final_line(losses, val, step, step_seconds, args.batch_size)
  return TrainResult(line, graphdef, state, losses)


def _forget_failed_runtime_tokens() -> None:
  """JAX keeps the failed step's runtime tokens, and its exit handlers wait on them again,
  printing the same RESOURCE_EXHAUSTED error twice more as tracebacks after the one-line
  message; nothing waits for that step any more, so drop them (a private JAX structure: where
  it is missing, the tracebacks stay)."""
  from jax._src import dispatch  # pylint: disable=import-outside-toplevel
  tokens = getattr(dispatch, "runtime_tokens", None)
  if tokens is not None and hasattr(tokens, "clear"):
    tokens.clear()


def main(argv=None) -> int:
  """CLI entry point; returns the exit status: 2, with a one-line message, for missing or
  malformed data, data too large for memory, a --batch-size past the training examples, a
  checkpoint that the free disk space cannot hold, a device out of memory (JAX's
  RESOURCE_EXHAUSTED), a mismatched (other model config, batch
  stream or data) or incomplete checkpoint, a fresh run into a folder that holds checkpoints,
  a --model-parallel that does not divide the embedding tables' rows, or an
  --implementation that cannot run the model; 128 + the signal's number (143, 130),
  with one line, for SIGTERM or SIGINT during training (the step saved), and 130 for an
  interrupt (Ctrl-C) before training or a second one during it."""
  args = parse_args(argv)
  try:
    check_implementation_can_run(args.implementation, args.devices)
    line = train(args).line
  # NotImplementedError: an --implementation with no kernel for a call of the model
  except (ads_data.DataNotFoundError, ads_data.DataFormatError, ads_data.DataTooLargeError,
          BatchSizeError, CheckpointMismatchError, CheckpointIncompleteError,
          CheckpointDirInUseError, CheckpointSpaceError, distributed.TableSplitError,
          NotImplementedError) as e:
    print(f"train_kunlun: error: {e}", file=sys.stderr)
    return 2
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # The model's padded arrays grow with --batch-size × --max-seq-len (the attention's scores
    # with their product times the keys), whatever the data's own lengths.
    print(f"train_kunlun: error: the device ran out of memory ({str(e).splitlines()[0][:160]})"
          f" with --batch-size {args.batch_size} and --max-seq-len {args.max_seq_len}: lower "
          "them", file=sys.stderr)
    _forget_failed_runtime_tokens()
    return 2
  except Stopped as e:
    print(f"train_kunlun: {e}", file=sys.stderr)
    return 128 + e.signum
  except KeyboardInterrupt:  # was a traceback into whatever was loading or compiling
    kept = "" if args.checkpoint_dir is None else "; " + _kept(args.checkpoint_dir)
    print(f"train_kunlun: interrupted{kept}", file=sys.stderr)
    return 130
  print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
