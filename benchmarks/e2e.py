"""End-to-end case: one training step of the Kunlun-style model (``flax_layers.KunlunModel``).

The model and its training script (``examples/train_kunlun.py``) are written elsewhere in the
project and may be incomplete: this module imports them lazily, and anything missing makes the
case "skipped" with the reason instead of stopping the suite.

Hooks for the coordinator:

* :func:`build_config` (edit :data:`PRODUCTION_CONFIG`): batch size and ``KunlunConfig`` sizes.
* If ``examples/train_kunlun.py`` defines ``make_benchmark_step(config, implementation) ->
  (step, args)``, that is used; otherwise :func:`default_step` builds the step from the
  script's ``loss_fn`` and ``make_tx`` on a synthetic batch (``ads_data.make_synthetic``).

``step(*args)`` must run one full step (forward, backward, AdamW update) and must not donate its
arguments: the suite calls it repeatedly with the same ``args``. There is no oracle for a whole
step; its floating-point outputs are checked finite.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train_kunlun.py"

# Production-like sizes: the PFFN of the reference benchmarks (batch 768, jagged history up to
# 512 events, 4 heads of 128, per-sample K/V of 128 keys) inside the whole model. Every key but
# batch_size, seed, lr and weight_decay is a KunlunConfig field.
PRODUCTION_CONFIG = {
    "batch_size": 768, "seed": 0, "lr": 1e-3, "weight_decay": 1e-4,
    "max_seq_len": 512, "num_heads": 4, "head_dim": 128, "kv_len": 128, "num_layers": 2,
    "embed_dim": 64, "summary_dim": 512, "mlp_dim": 1024, "num_mlp_layers": 3, "num_seeds": 4,
    "sparse_vocab_size": 1 << 20, "item_vocab_size": 1 << 18,
}
TINY_CONFIG = {
    "batch_size": 8, "seed": 0, "lr": 1e-3, "weight_decay": 1e-4,
    "max_seq_len": 32, "num_heads": 2, "head_dim": 16, "kv_len": 16, "num_layers": 1,
    "embed_dim": 16, "summary_dim": 32, "mlp_dim": 32, "num_mlp_layers": 1, "num_seeds": 2,
    "sparse_vocab_size": 1024, "item_vocab_size": 1024,
}
_NOT_MODEL = ("batch_size", "seed", "lr", "weight_decay")


class Unavailable(Exception):
  """The model, the training script or a piece of their API is missing; the message says what."""


def build_config(tiny: bool) -> dict:
  """Hook: the config of the end-to-end case (tiny: a CPU-sized one)."""
  return dict(TINY_CONFIG if tiny else PRODUCTION_CONFIG)


def dims(config: dict) -> tuple[tuple[str, int], ...]:
  """The shape-like entries of ``config`` (B, L, H, D, KV, layers), for names and reports."""
  keys = (("B", "batch_size"), ("L", "max_seq_len"), ("H", "num_heads"), ("D", "head_dim"),
          ("KV", "kv_len"), ("layers", "num_layers"))
  return tuple((short, config[k]) for short, k in keys if k in config)


def _load_train_script():
  if not TRAIN_SCRIPT.is_file():
    raise Unavailable(f"{TRAIN_SCRIPT.relative_to(REPO)} does not exist yet")
  for path in (str(REPO), str(TRAIN_SCRIPT.parent)):  # the script imports ads_data beside it
    if path not in sys.path:
      sys.path.append(path)
  spec = importlib.util.spec_from_file_location("train_kunlun", TRAIN_SCRIPT)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # a half-written script must not stop the suite
    raise Unavailable(f"importing {TRAIN_SCRIPT.name} failed: {type(e).__name__}: {e}") from e
  return module


def default_step(train, config: dict, implementation: str | None):
  """``(step, (state, batch))`` built from the training script's pieces; see the module doc."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import flax_layers

  ads_data = sys.modules["ads_data"]
  model_fields = {f.name for f in dataclasses.fields(flax_layers.KunlunConfig)}
  sizes = {k: v for k, v in config.items() if k not in _NOT_MODEL}
  unknown = set(sizes) - model_fields
  if unknown:
    raise ValueError(f"config keys {sorted(unknown)} are not KunlunConfig fields")
  ds = ads_data.make_synthetic(config["batch_size"], max_seq_len=config["max_seq_len"],
                               sparse_vocab_size=config["sparse_vocab_size"],
                               item_vocab_size=config["item_vocab_size"], seed=config["seed"])
  batch = ads_data.make_batch(ds, np.arange(config["batch_size"]), config["max_seq_len"])
  model_config = flax_layers.KunlunConfig(num_sparse_features=ds.sparse.shape[1],
                                          num_dense_features=ds.dense.shape[1], **sizes)
  model = flax_layers.KunlunModel(model_config, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(config["seed"]), implementation=implementation)
  optimizer = nnx.Optimizer(model, train.make_tx(config["lr"], config["weight_decay"]),
                            wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def step(state, batch):  # train_kunlun.train_step without the donation
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(train.loss_fn)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return step, (state, jax.tree.map(jnp.asarray, batch))


def make_step(config: dict, implementation: str | None):
  """``(step, args)`` for one train step.

  Raises:
    Unavailable: flax_layers.KunlunModel, the training script or a piece of their API the
      default builder uses is missing.
  """
  try:
    import flax_layers
    flax_layers.KunlunModel  # noqa: B018  (the attribute check is the point)
  except (ImportError, AttributeError) as e:
    raise Unavailable(f"flax_layers.KunlunModel is not importable yet ({e})") from e
  train = _load_train_script()
  factory = getattr(train, "make_benchmark_step", None)
  if factory is not None:
    return factory(config, implementation=implementation)
  try:
    return default_step(train, config, implementation)
  except (AttributeError, KeyError, TypeError, ImportError) as e:
    raise Unavailable(f"the default train step could not be built from {TRAIN_SCRIPT.name} "
                      f"and ads_data ({type(e).__name__}: {e}); define make_benchmark_step "
                      "there or adapt benchmarks/e2e.py") from e
