"""End-to-end case: one training step of the Kunlun-style model (``flax_layers.KunlunModel``).

Two uses:

* ``make_step(config, implementation)``: one jitted train step for ``benchmarks.run``.
* ``python -m benchmarks.e2e [--tiny] [--out FILE]``: the train-step harness of issue 19. Three
  arms of the same model on the same batch:

  - ``baseline``: the model as plain JAX writes it: XLA ops, XLA softmax attention, and the
    jagged conversions differentiated by autodiff (the forward gathers' gradients are XLA
    scatter-adds), its batches packed into B·max_seq_len rows. It exists only here, as the
    reference (:func:`plain_jax_conversions`).
  - ``xla``: ``implementation="xla"``: XLA ops and attention, the library's conversions (whose
    gradients are gathers), the batches packed into the config's bucketed capacity
    (:data:`FULL_CAPACITY_ARMS`): the same tokens in about half the rows.
  - ``default``: ``implementation=None``: the library's choice (Mosaic kernels where measured
    faster, cuDNN's flash attention for the softmax attentions on the GPU), bucketed as ``xla``.

  It times the whole step and, forward + backward (``jax.vjp`` of the inputs and the layer's
  parameters), one self-attention layer, one PFFN layer, the seed pooling and the interaction
  MLP. Two instruments:

  - wall clock of each call up to ``block_until_ready``, the arms interleaved (A, B, C, then
    the next round in a rotated order) so that clock and thermal drift hit every arm alike;
    median and spread over ``--samples`` rounds. It is what a user waits for, launch gaps and
    host work included;
  - on a GPU, CUPTI: the sum of every kernel's time per call (mean of
    ``--profile-iterations`` calls; :mod:`benchmarks.kernel_profile`, which, unlike
    ``profiler.measure``, does not refuse a program with a ``lax.cond``; whether CUPTI sees the
    kernels of its branches is not checked), and for the whole step the
    kernels grouped by kind (GEMMs, cuDNN attention, Pallas kernels, gathers/scatters, layout,
    reductions, elementwise) and by model component (the model's named scopes), with the top
    kernels. Wall clock minus kernel sum is what gaps and host work cost.

  Then ``--loss-steps`` training steps from the same initial state on the same batches per
  arm, and of a float32 reference (:data:`LOSS_REFERENCE`): each arm's distance from the
  reference says whether its drift from the baseline exceeds the baseline's own bf16 drift.
  Every program is compiled ahead, in parallel, before anything is timed; the whole step's
  programs first, so that a run cut short keeps the step's numbers.

``make_step`` imports the model and its training script (``examples/train_kunlun.py``) lazily;
anything missing makes the case "skipped" with the reason instead of stopping the suite.
``step(*args)`` runs one full step (forward, backward, AdamW update) and does not donate its
arguments: the suite calls it repeatedly with the same ``args``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.util
import json
import pathlib
import sys
import time

import numpy as np

import benchmarks

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train_kunlun.py"

# Production-like sizes: the PFFN of the reference benchmarks (batch 768, jagged history up to
# 512 events, 4 heads of 128, per-sample K/V of 128 keys) inside the whole model. Every key but
# batch_size, seed, lr, weight_decay and token_buckets is a KunlunConfig field. token_buckets:
# the library's arms pack the behaviour sequences into the smallest of that many static
# capacities that holds every batch of the run (ads_data.bucket_capacity; lengths uniform on
# [1, 512] fill about half of B·512); the FULL_CAPACITY_ARMS pack them into B·max_seq_len.
PRODUCTION_CONFIG = {
    "batch_size": 768, "seed": 0, "lr": 1e-3, "weight_decay": 1e-4, "token_buckets": 32,
    "max_seq_len": 512, "num_heads": 4, "head_dim": 128, "kv_len": 128, "num_layers": 2,
    "embed_dim": 64, "summary_dim": 512, "mlp_dim": 1024, "num_mlp_layers": 3, "num_seeds": 4,
    "sparse_vocab_size": 1 << 20, "item_vocab_size": 1 << 18,
}
TINY_CONFIG = {
    "batch_size": 8, "seed": 0, "lr": 1e-3, "weight_decay": 1e-4, "token_buckets": 8,
    "max_seq_len": 32, "num_heads": 2, "head_dim": 16, "kv_len": 16, "num_layers": 1,
    "embed_dim": 16, "summary_dim": 32, "mlp_dim": 32, "num_mlp_layers": 1, "num_seeds": 2,
    "sparse_vocab_size": 1024, "item_vocab_size": 1024,
}
_NOT_MODEL = ("batch_size", "seed", "lr", "weight_decay", "token_buckets")


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


def _model_and_data(train, config: dict, implementation, num_batches: int = 1,
                    compute_dtype: str = "bfloat16", token_buckets: int = 1):
  """(model, optimizer, batches): the Kunlun model computing in ``compute_dtype`` with f32
  parameters and AdamW, and ``num_batches`` synthetic batches of ``config["batch_size"]``
  (device arrays) packed into one capacity: the smallest of ``token_buckets`` that holds each
  of them (1: B·max_seq_len, which splits evenly over devices)."""
  import jax.numpy as jnp
  from flax import nnx

  import flax_layers

  model_fields = {f.name for f in dataclasses.fields(flax_layers.KunlunConfig)}
  sizes = {k: v for k, v in config.items() if k not in _NOT_MODEL}
  unknown = set(sizes) - model_fields
  if unknown:
    raise ValueError(f"config keys {sorted(unknown)} are not KunlunConfig fields")
  batches = _synthetic_batches(tuple(sorted(config.items())), num_batches, token_buckets)
  model_config = flax_layers.KunlunConfig(num_sparse_features=batches[0].sparse_ids.shape[1],
                                          num_dense_features=batches[0].dense.shape[1], **sizes)
  model = flax_layers.KunlunModel(model_config, dtype=jnp.dtype(compute_dtype),
                                  param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(config["seed"]), implementation=implementation)
  optimizer = nnx.Optimizer(model, train.make_tx(config["lr"], config["weight_decay"]),
                            wrt=nnx.Param)
  return model, optimizer, batches


@functools.lru_cache(maxsize=2)
def _synthetic_batches(config_items: tuple, num_batches: int, token_buckets: int) -> tuple:
  """``num_batches`` synthetic batches (device arrays) of the config, shared by the arms, all
  packed into the smallest of ``token_buckets`` capacities that holds the largest of them."""
  import jax
  import jax.numpy as jnp

  ads_data, config = sys.modules["ads_data"], dict(config_items)
  batch_size = config["batch_size"]
  ds = ads_data.make_synthetic(batch_size * num_batches, max_seq_len=config["max_seq_len"],
                               sparse_vocab_size=config["sparse_vocab_size"],
                               item_vocab_size=config["item_vocab_size"], seed=config["seed"])
  examples = [np.arange(i * batch_size, (i + 1) * batch_size) for i in range(num_batches)]
  tokens = max(ads_data.batch_tokens(ds, idx, config["max_seq_len"]) for idx in examples)
  capacity = ads_data.bucket_capacity(tokens, batch_size, config["max_seq_len"], token_buckets)
  return tuple(jax.tree.map(jnp.asarray, ads_data.make_batch(ds, idx, config["max_seq_len"],
                                                             capacity)) for idx in examples)


def _jitted_step(train, graphdef):
  """train_kunlun.train_step without the donation: ``step(state, batch) -> (state, loss)``."""
  import jax
  from flax import nnx

  @jax.jit
  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(train.loss_fn)(model, batch)
    with jax.named_scope("optimizer"):  # a label for kernel profiles (benchmarks.kernel_profile)
      optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return step


def default_step(train, config: dict, implementation: str | None):
  """``(step, (state, batch))`` built from the training script's pieces; see the module doc."""
  from flax import nnx

  model, optimizer, (batch,) = _model_and_data(train, config, implementation,
                                               token_buckets=config.get("token_buckets", 1))
  graphdef, state = nnx.split((model, optimizer))
  return _jitted_step(train, graphdef), (state, batch)


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


# ---------------------------------------------------------------------------------------------
# The train-step harness (issue 19): arms, components, interleaved timing, losses.

ARMS = {"baseline": "xla", "xla": "xla", "default": None}
"""Arm -> the model's ``implementation``; "baseline" also traces under
:func:`plain_jax_conversions`."""
COMPONENTS = ("self_attention", "pffn", "seed_pool", "mlp")
LOSS_REFERENCE = "f32"
"""The arm that is trained but not timed: the baseline computing in float32 with its matmuls at
``Precision.HIGHEST``. The timed arms' losses are compared with its losses, so that a drift
from the baseline can be set against the baseline's own bf16 drift."""
FULL_CAPACITY_ARMS = ("baseline", LOSS_REFERENCE)
"""Arms whose batches pack the sequences into B·max_seq_len rows, as the plain pipeline does; the
others pack them into the smallest of the config's ``token_buckets`` capacities that holds
every batch of the run (the same tokens, fewer padding rows: equal losses)."""


@contextlib.contextmanager
def plain_jax_conversions():
  """While active, ``jagged.to_padded`` / ``from_padded`` are the plain gathers that autodiff
  differentiates into scatter-adds: the baseline's conversions, as plain JAX code writes them.
  Only tracing needs it (programs are lowered inside, compiled and run outside)."""
  from pallas_norm import jagged
  saved = jagged.to_padded, jagged.from_padded
  jagged.to_padded, jagged.from_padded = jagged._gather_to_padded, jagged._gather_from_padded
  try:
    yield
  finally:
    jagged.to_padded, jagged.from_padded = saved


def _trace_context(arm: str):
  if arm == LOSS_REFERENCE:
    stack = contextlib.ExitStack()
    stack.enter_context(plain_jax_conversions())
    stack.enter_context(_highest_precision())
    return stack
  return plain_jax_conversions() if arm == "baseline" else contextlib.nullcontext()


def _highest_precision():
  import jax
  return jax.default_matmul_precision("highest")


_PARAMS_OF = {"self_attention": ("qkv", "attn_out"), "pffn": ("pffn",),
              "seed_pool": ("pool_kv", "seeds"), "mlp": ("mlp_in", "mlp", "head")}
_PER_LAYER = ("qkv", "attn_out", "pffn")  # lists over layers: the pieces use layer 0


def _owned_by(component: str, path, value) -> bool:
  """nnx filter: a parameter of ``component`` (its first layer's, for per-layer lists)."""
  from flax import nnx
  return (isinstance(value, nnx.Param) and path[0] in _PARAMS_OF[component]
          and (path[0] not in _PER_LAYER or path[1] == 0))


def component_programs(model, batch, seed: int = 0) -> dict:
  """name -> (f, args): ``f(*args)`` is the forward + backward (``jax.vjp`` of the float inputs
  and the component's parameters, random cotangent) of one piece of ``model`` on ``batch``'s
  realistic activations: the first self-attention layer, the first PFFN layer, the seed
  pooling and the interaction MLP (mlp_in, the residual blocks and the head)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from pallas_norm import jagged

  c = model.config
  offsets, max_len = batch.seq_offsets, c.max_seq_len
  ctx = model._context(jnp.mod(batch.sparse_ids, c.sparse_vocab_size), batch.dense)
  summary = jax.nn.gelu(model.summary(ctx))
  rows = jagged.row_index(offsets, batch.seq_ids.shape[0])  # once per batch, as the model does
  x = model._sequence_tokens(jnp.mod(batch.seq_ids, c.item_vocab_size), offsets, rows)
  kv = model.kv_gen[0](summary).reshape(-1, 2, c.kv_len, c.num_heads, c.head_dim).astype(x.dtype)
  pooled_width = c.num_seeds * c.token_dim
  z = jnp.concatenate([ctx, jnp.zeros((ctx.shape[0], pooled_width), ctx.dtype)], axis=-1)
  z = z + 0.1 * jax.random.normal(jax.random.key(seed), z.shape, z.dtype)

  def mlp(model, z):
    h = jax.nn.gelu(model.mlp_in(z))
    for block in model.mlp:
      h = block(jax.nn.gelu(h), residual=h)
    return model.head(h)

  pieces = {
      "self_attention": (lambda m, x: m._self_attention(0, x, offsets, rows), (x,)),
      "pffn": (lambda m, x, k, v: m.pffn[0](x, offsets, k, v, max_seq_len=max_len),
               (x, kv[:, 0], kv[:, 1])),
      "seed_pool": (lambda m, x: m._seed_pool(x, offsets, rows), (x,)),
      "mlp": (mlp, (z,)),
  }
  programs = {}
  for i, (name, (apply, inputs)) in enumerate(pieces.items()):
    # Only the piece's own parameters: the gradient of every other one would be zeros that
    # the program still writes (~1.3 GB of embedding and K/V-generator tables at production).
    graphdef, params, rest = nnx.split(model, functools.partial(_owned_by, name), ...)

    def forward(params, *inputs, apply=apply, graphdef=graphdef, rest=rest):
      return apply(nnx.merge(graphdef, params, rest), *inputs)

    out_shape = jax.eval_shape(forward, params, *inputs)
    cotangent = jax.random.normal(jax.random.key(seed + 1 + i), out_shape.shape, out_shape.dtype)

    def fwd_bwd(params, cotangent, *inputs, forward=forward):
      out, vjp = jax.vjp(forward, params, *inputs)
      return out, vjp(cotangent)

    programs[name] = (jax.jit(fwd_bwd), (params, cotangent) + tuple(inputs))
  return programs


def build_arms(config: dict, arms, loss_steps: int, loss_reference: bool = False,
               compute_dtype: str = "bfloat16", with_components: bool = True) -> dict:
  """arm -> {"batches": [...], "programs": {name: (jitted fn, args)}, "errors": {}}: the train
  step and (``with_components``) every component of :func:`component_programs`, not yet
  lowered, the timed arms computing in ``compute_dtype``; with ``loss_reference`` also the step
  of :data:`LOSS_REFERENCE`."""
  from flax import nnx

  train = _load_train_script()
  built = {}
  for arm in tuple(arms) + ((LOSS_REFERENCE,) if loss_reference else ()):
    reference = arm == LOSS_REFERENCE
    model, optimizer, batches = _model_and_data(
        train, config, "xla" if reference else ARMS[arm], max(1, loss_steps),
        compute_dtype="float32" if reference else compute_dtype,
        token_buckets=1 if arm in FULL_CAPACITY_ARMS else config.get("token_buckets", 1))
    graphdef, state = nnx.split((model, optimizer))
    programs = {"step": (_jitted_step(train, graphdef), (state, batches[0]))}
    if with_components and not reference:  # tracing them costs seconds even when unused
      programs.update(component_programs(model, batches[0]))
    built[arm] = {"batches": batches, "programs": programs, "errors": {}}
  return built


def compile_programs(built: dict, wanted: dict, log=print) -> None:
  """Lowers the programs ``wanted[arm]`` (names) of each arm (the baseline's and the reference's
  under :func:`_trace_context`) and compiles them all in parallel threads; each compiled
  program is stored as ``built[arm][name] = (compiled, args)``. A program that fails to build
  is left out and its error recorded in ``built[arm]["errors"]``, so the others still run.
  Logs when each program is ready (seconds since the lowering began)."""
  t0 = time.perf_counter()
  lowered = []
  for arm, names in wanted.items():
    entry = built[arm]
    with _trace_context(arm):
      for name in names:
        fn, args = entry["programs"][name]
        try:
          lowered.append((arm, name, fn.lower(*args), args))
        except Exception as e:  # noqa: BLE001  (recorded; the other programs still run)
          entry["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
  log(f"lowered {len(lowered)} programs in {time.perf_counter() - t0:.0f} s")
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    futures = {pool.submit(item[2].compile): item for item in lowered}
    for future in concurrent.futures.as_completed(futures):
      arm, name, _, args = futures[future]
      try:
        built[arm][name] = (future.result(), args)
        log(f"  {arm} {name} compiled at {time.perf_counter() - t0:.0f} s")
      except Exception as e:  # noqa: BLE001
        built[arm]["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
  for arm, names in wanted.items():
    for name in names:
      if name in built[arm]["errors"]:
        log(f"{arm} {name}: FAILED to build: {built[arm]['errors'][name][:300]}")


def interleaved_times(programs: dict, samples: int, warmup: int = 2) -> dict:
  """name -> wall-clock seconds of ``samples`` calls each, the programs called in turn (the
  order rotated every round); each call's outputs are waited for and dropped."""
  import jax

  names = list(programs)
  for name in names:
    for _ in range(warmup):
      fn, args = programs[name]
      jax.block_until_ready(fn(*args))
  times = {name: [] for name in names}
  for r in range(samples):
    for name in names[r % len(names):] + names[:r % len(names)]:
      fn, args = programs[name]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return times


def summarize(seconds) -> dict:
  """Median, min, quartiles and 10/90th percentiles of a list of seconds, in ms."""
  ms = np.asarray(seconds) * 1e3
  q = np.percentile(ms, [10, 25, 50, 75, 90])
  return {"n": int(ms.size), "median_ms": float(q[2]), "min_ms": float(ms.min()),
          "p10_ms": float(q[0]), "p25_ms": float(q[1]), "p75_ms": float(q[3]),
          "p90_ms": float(q[4])}


def train_losses(step, state, batches, steps: int) -> list[float]:
  """Losses of ``steps`` AdamW steps from ``state``, cycling through ``batches``."""
  losses = []
  for i in range(steps):
    state, loss = step(state, batches[i % len(batches)])
    losses.append(float(loss))
  return losses


def run_harness(config: dict, arms=tuple(ARMS), components=COMPONENTS, samples: int = 30,
                loss_steps: int = 20, log=print, save=lambda result: None,
                with_step: bool = True, profile_iterations: int = 3,
                loss_reference: bool = True, compute_dtype: str = "bfloat16") -> dict:
  """The measurement of the module doc, as a JSON-ready dict: the arms' whole-step programs
  and (``loss_reference``) the float32 :data:`LOSS_REFERENCE`'s step are compiled in parallel,
  the steps timed, every step trained for the losses and the arms' steps profiled with CUPTI
  (GPU only); then the components' programs are compiled, timed and their CUPTI kernel sums
  taken. ``save(result)`` is called after each piece, so a run cut short keeps what it
  measured. ``with_step=False``: the components only. ``compute_dtype``: the timed arms' (the
  reference computes in float32)."""
  import jax

  from benchmarks import timing

  loss_reference = loss_reference and with_step
  # The loss steps' batches even without the step: their capacity is the one the step runs.
  built = build_arms(config, arms, loss_steps, loss_reference=loss_reference,
                     compute_dtype=compute_dtype, with_components=bool(components))
  cupti = timing.default_timer() == "cupti"
  result = {
      "what": "Kunlun train step (issue 19): whole step and per-component forward+backward",
      "method": ("wall clock per call up to block_until_ready, arms interleaved with a "
                 "rotating order, after 2 warm-up calls each; ms. cupti_kernel_ms: the sum of "
                 f"the kernels' CUPTI times per call, mean of {profile_iterations} calls"),
      "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
      "git_commit": _git_commit(), "config": config, "compute_dtype": compute_dtype,
      "samples_per_arm": samples,
      "loss_steps": loss_steps,
      "arms": {arm: ("plain JAX: XLA ops and attention, autodiff (scatter-add) conversions"
                     if arm == "baseline" else f"implementation={ARMS[arm]!r}")
               + (", B·max_seq_len rows" if arm in FULL_CAPACITY_ARMS else
                  f", capacity of {config.get('token_buckets', 1)} buckets") for arm in arms},
      "errors": {}, "rows": [], "profiles": {}, "losses": {}, "summary": {},
  }
  # Packed rows of each arm's batches and the real tokens of each batch (the same for all).
  result["capacity"] = {arm: int(built[arm]["batches"][0].seq_ids.shape[0]) for arm in built}
  result["real_tokens"] = [int(b.seq_offsets[-1]) for b in built[arms[0]]["batches"]]
  log(f"packed capacity per arm: {result['capacity']}; real tokens per batch "
      f"{min(result['real_tokens'])}..{max(result['real_tokens'])}")
  if loss_reference:
    result["loss_reference"] = f"{LOSS_REFERENCE}: the baseline in float32, HIGHEST matmuls"
  timed = {arm: built[arm] for arm in arms}
  # The steps (the reference's too: compiling in parallel beats a second stage) come first, so
  # that a run cut short keeps the whole step's numbers.
  stages = []
  if with_step:
    trained = tuple(built)
    stages.append(({arm: ("step",) for arm in trained}, ("step",), trained))
  if components:
    stages.append(({arm: tuple(components) for arm in arms}, tuple(components), ()))
  for wanted, pieces, trained in stages:
    t0 = time.perf_counter()
    compile_programs(built, wanted, log)
    log(f"compiled {sum(map(len, wanted.values()))} programs in {time.perf_counter() - t0:.0f} s")
    result["errors"] = {arm: built[arm]["errors"] for arm in built if built[arm]["errors"]}
    for piece in pieces:
      _time_piece(result, timed, piece, samples, log)
      save(result)
    for arm in (a for a in trained if "step" in built[a]):
      step, (state, _) = built[arm]["step"]
      result["losses"][arm] = train_losses(step, state, built[arm]["batches"], loss_steps)
      result["summary"] = summary(result)
      save(result)
    for piece in pieces if cupti else ():  # last: the newest instrument, the likeliest to fail
      _profile_piece(result, timed, piece, profile_iterations, log)
      result["summary"] = summary(result)
      save(result)
  result["summary"] = summary(result)
  save(result)
  return result


def _git_commit() -> str:
  """$GIT_COMMIT when set, else HEAD of the checkout, else "unknown" (as benchmarks.run: a copy
  of a working tree can carry a stale .git, so the caller's name for the tree wins)."""
  import os
  import subprocess
  if os.environ.get("GIT_COMMIT"):
    return os.environ["GIT_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _time_piece(result, built, piece, samples, log) -> None:
  ready = {arm: built[arm][piece] for arm in built if piece in built[arm]}
  times = interleaved_times(ready, samples)
  for arm in ready:
    row = {"component": piece, "arm": arm, **summarize(times[arm])}
    result["rows"].append(row)
    log(f"{piece:15s} {arm:9s} median {row['median_ms']:8.2f} ms  (p10 {row['p10_ms']:.2f}, "
        f"p90 {row['p90_ms']:.2f}, min {row['min_ms']:.2f})")


def _profile_piece(result, built, piece, iterations, log) -> None:
  """CUPTI kernel sums of ``piece`` per arm into its rows; for the whole step also the
  grouped profile (:func:`benchmarks.kernel_profile.profile`) into ``result["profiles"]``."""
  from benchmarks import kernel_profile

  rows = {r["arm"]: r for r in result["rows"] if r["component"] == piece}
  for arm, row in rows.items():
    compiled, args = built[arm][piece]
    try:
      kernels = kernel_profile.cupti_kernels(compiled, args, iterations)
      hlo = compiled.as_text() if piece == "step" else ""
      prof = kernel_profile.profile(kernels, iterations, hlo, top=30 if piece == "step" else 0)
    except Exception as e:  # noqa: BLE001  (recorded; the wall clock still stands)
      result["errors"].setdefault(arm, {})[f"{piece}/cupti"] = f"{type(e).__name__}: {e}"[:500]
      log(f"{piece} {arm}: CUPTI failed: {e}")
      continue
    row["cupti_kernel_ms"] = prof["kernel_ms"]
    row["cupti_by_kind"] = prof["by_kind"]
    log(f"{piece:15s} {arm:9s} CUPTI kernels {prof['kernel_ms']:8.2f} ms "
        f"({prof['kernels_per_call']:.0f} launches)")
    if piece == "step":
      result["profiles"][arm] = prof
      for kind, ms in prof["by_kind"].items():
        log(f"    {ms:8.2f}  {kind}")
      for component, ms in prof["by_component"].items():
        log(f"    {ms:8.2f}  [{component}]")


def summary(result: dict) -> dict:
  """Speed-ups of each arm against the baseline (median over median, and CUPTI kernel sum over
  kernel sum), and each arm's largest and mean loss difference from the baseline's and from the
  float32 reference's over the loss steps."""
  out = {}
  for key, stat in (("", "median_ms"), ("cupti_", "cupti_kernel_ms")):
    value = {(r["component"], r["arm"]): r[stat] for r in result["rows"] if stat in r}
    for (piece, arm), ms in value.items():
      if arm != "baseline" and (piece, "baseline") in value:
        out[f"{piece}/{arm}_{key}speedup"] = value[(piece, "baseline")] / ms
  losses = result["losses"]
  for ref in ("baseline", LOSS_REFERENCE):
    if ref not in losses:
      continue
    for arm, values in losses.items():
      if arm not in (ref, LOSS_REFERENCE):
        diff = np.abs(np.subtract(values, losses[ref]))
        suffix = "" if ref == "baseline" else f"_vs_{ref}"
        out[f"loss/{arm}_max_abs_diff{suffix}"] = float(np.max(diff))
        out[f"loss/{arm}_mean_abs_diff{suffix}"] = float(np.mean(diff))
  return out


COMPONENT_NAMES = {"step": "whole train step (+ AdamW)", "self_attention": "one self-attention layer",
                   "pffn": "one PFFN layer", "seed_pool": "seed pooling",
                   "mlp": "interaction MLP"}


def _not_harness_result_reason(result) -> str | None:
  """Why ``result`` (a parsed JSON) is not one of :func:`run_harness`'s results that
  :func:`markdown_table` reads, or None (a suite JSON raised KeyError 'arms' there)."""
  if not isinstance(result, dict) or not isinstance(result.get("arms"), (list, dict)):
    return "no 'arms'"
  rows = result.get("rows")
  if not isinstance(rows, list):
    return "no list of 'rows'"
  for i, r in enumerate(rows):
    keys = ("component", "arm") + (("p10_ms", "p90_ms") if "median_ms" in r else ())
    if missing := [k for k in keys if k not in r]:
      return f"row {i} lacks {', '.join(missing)}"
  return None


def markdown_table(result: dict, stat: str = "median_ms") -> str:
  """The README's table of a harness result: per component and arm the wall-clock median ms
  (p10–p90), or with ``stat="cupti_kernel_ms"`` the CUPTI kernel sum, and each arm's speed-up
  over the baseline in that statistic."""
  arms = list(result["arms"])
  cell = {(r["component"], r["arm"]): r for r in result["rows"] if stat in r}
  what = "ms" if stat == "median_ms" else "kernel ms"
  head = ["| forward + backward of | " + " | ".join(f"{a} {what}" for a in arms) + " | " +
          " | ".join(f"{a} speed-up" for a in arms if a != "baseline") + " |"]
  head.append("|---|" + "---:|" * (2 * len(arms) - 1))
  lines = []
  for piece, name in COMPONENT_NAMES.items():
    if not any((piece, a) in cell for a in arms):
      continue
    times = [("—" if (piece, a) not in cell else
              f"{cell[piece, a][stat]:.1f} ({cell[piece, a]['p10_ms']:.1f}–"
              f"{cell[piece, a]['p90_ms']:.1f})" if stat == "median_ms" else
              f"{cell[piece, a][stat]:.1f}") for a in arms]
    ratios = [f"{cell[piece, 'baseline'][stat] / cell[piece, a][stat]:.2f}×"
              if (piece, a) in cell and (piece, "baseline") in cell else "—"
              for a in arms if a != "baseline"]
    lines.append(f"| {name} | " + " | ".join(times + ratios) + " |")
  return "\n".join(head + lines)


def profile_table(result: dict, arm: str = "default", top: int = 30) -> str:
  """The CUPTI profile of ``arm``'s step: ms by kind, by component, and the top kernels."""
  prof = result.get("profiles", {}).get(arm)
  if not prof:
    return f"(no CUPTI profile of the {arm} step)"
  lines = [f"{arm} step: {prof['kernel_ms']:.2f} ms of kernels, "
           f"{prof['kernels_per_call']:.0f} launches"]
  lines += [f"  {ms:8.2f}  {kind}" for kind, ms in prof["by_kind"].items()]
  lines += [f"  {ms:8.2f}  [{component}]" for component, ms in prof["by_component"].items()]
  for name, ms, count, kind, component, op_name in prof["top"][:top]:
    lines.append(f"  {ms:7.3f} x{count:<4g} {kind[:12]:12s} {component[:14]:14s} {name[:60]}  "
                 f"{op_name[-90:]}")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.e2e",
                              description="Kunlun train-step harness (see the module doc)")
  p.add_argument("--tiny", action="store_true", help="the CPU-sized config")
  p.add_argument("--samples", type=int, default=30, help="timed calls per arm")
  p.add_argument("--loss-steps", type=int, default=20)
  p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of "
                 f"{','.join(ARMS)}")
  p.add_argument("--components", default=",".join(COMPONENTS),
                 help="comma-separated subset of " + ",".join(COMPONENTS) + " (or empty)")
  p.add_argument("--profile-iterations", type=int, default=3,
                 help="calls per CUPTI profile (GPU only)")
  p.add_argument("--no-step", action="store_true",
                 help="time the components only (no whole step, no losses)")
  p.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="the timed arms' compute dtype (parameters are float32)")
  p.add_argument("--loss-reference", action=argparse.BooleanOptionalAction, default=True,
                 help=f"train the float32 reference ({LOSS_REFERENCE}) for the losses too (one "
                 "more program to compile)")
  p.add_argument("--out", type=pathlib.Path, default=None, help="JSON result file")
  p.add_argument("--table", type=pathlib.Path, default=None,
                 help="print the README table of this JSON result and exit")
  args = p.parse_args(argv)
  if args.table is not None:
    try:
      result = json.loads(args.table.read_text())
    except (OSError, ValueError) as e:
      p.error(f"--table: cannot read {args.table}: {e}")
    if problem := _not_harness_result_reason(result):
      p.error(f"--table: {args.table} is not a JSON of benchmarks.e2e ({problem}; a suite "
              "JSON of benchmarks.run is printed by `python -m benchmarks.report FILE --readme`)")
    print(markdown_table(result))
    return 0
  arms = tuple(a for a in args.arms.split(",") if a)
  components = tuple(c for c in args.components.split(",") if c)
  bad = sorted(set(arms) - set(ARMS)) + sorted(set(components) - set(COMPONENTS))
  if bad or not arms:
    p.error(f"unknown or missing arms/components: {bad or '(no arm)'}")
  # Before anything compiles: --samples 0 or --loss-steps -1 failed in NumPy after the
  # compiles and the timing, an unwritable --out after the first component.
  for flag, value in (("--samples", args.samples), ("--loss-steps", args.loss_steps),
                      ("--profile-iterations", args.profile_iterations)):
    if value < 1:
      p.error(f"{flag} must be >= 1, got {value}")
  if args.out is not None:
    if args.out.is_dir():
      p.error(f"--out: {args.out} is a folder; give the JSON file's path")
    if reason := benchmarks.unwritable_reason(args.out.parent):
      p.error(f"--out: {reason}")

  def save(result):
    if args.out is not None:
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(result, indent=1) + "\n")

  result = run_harness(build_config(args.tiny), arms, components, args.samples,
                       args.loss_steps, log=lambda m: print(m, flush=True), save=save,
                       with_step=not args.no_step,
                       profile_iterations=args.profile_iterations,
                       loss_reference=args.loss_reference, compute_dtype=args.compute_dtype)
  for key, value in result["summary"].items():
    print(f"{key}: {value:.4g}", flush=True)
  for arm, losses in result["losses"].items():
    print(f"losses {arm}: " + " ".join(f"{v:.5f}" for v in losses), flush=True)
  for arm in result["profiles"]:
    print(profile_table(result, arm, top=30 if arm == "default" else 12), flush=True)
  print(markdown_table(result), flush=True)
  if any("cupti_kernel_ms" in r for r in result["rows"]):
    print(markdown_table(result, "cupti_kernel_ms"), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
