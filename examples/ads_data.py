"""Click-through-rate data for the Kunlun example: loaders, a synthetic generator, and batching
into the static shapes that a jit-compiled step needs.

Every dataset is an :class:`AdsDataset` of N examples:

* ``sparse`` (N, Fs) int32: categorical features, each ``field=value`` hashed into
  [0, sparse_vocab_size) (one shared table; the field name is part of the hashed string);
* ``dense`` (N, Fd) float32: numeric features, log-compressed;
* a jagged behaviour sequence per example: ``seq_values`` (item ids hashed into
  [1, item_vocab_size); 0 is kept for padding) with int64 ``seq_offsets`` (N+1,), oldest first;
* ``labels`` (N,) float32 clicks in {0, 1}.

Sources (``name``):

* ``synthetic``: generated here; lengths uniform on [1, max_seq_len], clicks drawn from a
  logistic function of the context features and of the sequence content (how many behaviour items
  share the ad's category), so a model can learn it (the true logits give AUC ≈ 0.8; the
  example's Kunlun model reaches ~0.70–0.72 in 200–1000 steps, mostly from the context: the
  README says more).
* ``taobao``: ``taobao_ad_sample/{train,valid}_sample.csv`` under ``data_dir`` (see
  ``shared/data/README.md``); ``click_sequence`` ('^'-joined item ids, maybe empty) is the
  behaviour sequence, 15 id columns are sparse, ``price`` is dense, ``clk`` is the label.
  The sample's valid file shares 87 of its 100 rows (all 4 clicks included) with the train file
  (it is FuxiCTR's tiny test data), so validation there measures fitting, not generalization.
* ``criteo``: ``criteo_sample.txt`` (label, I1–I13, C1–C26); context only (empty sequences);
  rows ``i % 5 == 4`` are the validation split.

:func:`fingerprint` identifies the data a source gives (the synthetic generator's arguments, or
each file's size and SHA-256): the training example's checkpoints record it, and a resume on
other data is refused.

Batches (:class:`Batch`) have a fixed batch size B and a static packed capacity T, by default
B · max_seq_len (every batch fits); sequences longer than max_seq_len keep their most recent
max_seq_len items (the last ones: the Taobao sequences are taken to be oldest first). With
lengths spread over [1, max_seq_len] a batch holds about half of B · max_seq_len real tokens, and
every op on the token axis (GEMMs, norms, embeddings) runs over all T rows: ``token_buckets``
packs each batch into the smallest of a few static capacities that holds it
(:func:`bucket_capacity`), one compiled step per capacity used.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import pathlib
import zlib
from typing import Iterator, NamedTuple

import numpy as np

DATASETS = ("synthetic", "taobao", "criteo")
# ../shared/data beside the checkout, as tests/conftest.py; PALLAS_NORM_DATA overrides it.
DEFAULT_DATA_DIR = pathlib.Path(os.environ.get(
    "PALLAS_NORM_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))

TAOBAO_SPARSE = ("userid", "adgroup_id", "pid", "cate_id", "campaign_id", "customer", "brand",
                 "cms_segid", "cms_group_id", "final_gender_code", "age_level", "pvalue_level",
                 "shopping_level", "occupation", "new_user_class_level")
TAOBAO_DENSE = ("price",)
CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))
TAOBAO_FILE = "taobao_ad_sample/{split}_sample.csv"
CRITEO_FILE = "criteo_sample.txt"
DATA_FILES = {"synthetic": (), "criteo": (CRITEO_FILE,),
              "taobao": tuple(TAOBAO_FILE.format(split=s) for s in ("train", "valid"))}
"""The files under ``data_dir`` that :func:`load` reads for each dataset (paths relative to it)."""
FINGERPRINT_BYTES = 64 * 1024
"""The ends hash of :func:`file_fingerprint` covers this many bytes at each end of a file (older
fingerprints hashed only those)."""


class DataNotFoundError(FileNotFoundError):
  """A data file or directory is missing; the message names the path and what it should hold."""


class DataFormatError(ValueError):
  """A data file lacks a required column or holds a value that cannot be parsed."""


class DataTooLargeError(ValueError):
  """The data asked for would not fit in this machine's memory (:func:`synthetic_size_problem`),
  or loading them ran out of memory."""


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What a model needs to know about a dataset's features."""

  num_sparse_features: int
  num_dense_features: int
  sparse_vocab_size: int
  item_vocab_size: int


@dataclasses.dataclass
class AdsDataset:
  """N examples on the host (numpy); see the module docstring for the layout.

  ``true_logits`` (N,) is set for synthetic data only: the logits the labels were drawn from.
  """

  sparse: np.ndarray
  dense: np.ndarray
  seq_values: np.ndarray
  seq_offsets: np.ndarray
  labels: np.ndarray
  true_logits: np.ndarray | None = None

  def __post_init__(self):
    n = self.labels.shape[0]
    if self.sparse.shape[0] != n or self.dense.shape[0] != n or self.seq_offsets.shape != (n + 1,):
      raise ValueError(f"inconsistent dataset: {n} labels, sparse {self.sparse.shape}, dense "
                       f"{self.dense.shape}, seq_offsets {self.seq_offsets.shape}")
    if self.seq_offsets[0] != 0 or self.seq_offsets[-1] != self.seq_values.shape[0]:
      raise ValueError("seq_offsets must start at 0 and end at len(seq_values)")

  def __len__(self) -> int:
    return self.labels.shape[0]

  def subset(self, idx) -> AdsDataset:
    """The examples ``idx`` (an index array), sequences included, in that order."""
    idx = np.asarray(idx, dtype=np.int64)
    starts, ends = self.seq_offsets[idx], self.seq_offsets[idx + 1]
    values, offsets = _gather_ranges(self.seq_values, starts, ends - starts)
    return AdsDataset(self.sparse[idx], self.dense[idx], values, offsets, self.labels[idx],
                      None if self.true_logits is None else self.true_logits[idx])


class Batch(NamedTuple):
  """One batch in static shapes (a pytree, so it can go straight into ``jax.jit``).

  sparse_ids (B, Fs) int32; dense (B, Fd) float32; seq_ids (T,) int32 with T the static packed
  capacity (default B·max_seq_len), padding 0; seq_offsets (B+1,) int32; labels (B,) float32.
  """

  sparse_ids: np.ndarray
  dense: np.ndarray
  seq_ids: np.ndarray
  seq_offsets: np.ndarray
  labels: np.ndarray


def _gather_ranges(values, starts, lens):
  """Concatenation of ``values[s:s+l]`` for each (s, l), with its int64 offsets."""
  lens = np.asarray(lens, np.int64)
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  rows = np.repeat(np.asarray(starts, np.int64) - offsets[:-1], lens) + np.arange(offsets[-1])
  return values[rows].astype(values.dtype), offsets


# ---------------------------------------------------------------------------------------------
# Batching


CAPACITY_ALIGN = 8
"""Packed capacities are multiples of it (the GDPA kernels take token capacities that are)."""


def bucket_capacity(num_tokens: int, batch_size: int, max_seq_len: int, buckets: int) -> int:
  """The smallest of ``buckets`` static packed capacities that holds ``num_tokens`` rows: the
  multiples of the bucket width ceil(B·max_seq_len / buckets) rounded up to
  :data:`CAPACITY_ALIGN`, the largest capped at B·max_seq_len (which holds any batch).
  ``buckets=1`` gives B·max_seq_len for every batch (one compiled step); more buckets waste
  fewer rows (at most one bucket width) and compile one step per capacity that occurs.

  Raises:
    ValueError: ``buckets`` < 1, or ``num_tokens`` past B·max_seq_len.
  """
  full = batch_size * max_seq_len
  if buckets < 1:
    raise ValueError(f"buckets must be >= 1, got {buckets}")
  if not 0 <= num_tokens <= full:
    raise ValueError(f"num_tokens={num_tokens} is not in [0, B·max_seq_len = {full}]")
  if buckets == 1:
    return full
  width = -(-full // buckets)
  width = -(-width // CAPACITY_ALIGN) * CAPACITY_ALIGN
  return min(full, max(1, -(-num_tokens // width)) * width)


def batch_tokens(ds: AdsDataset, idx, max_seq_len: int) -> int:
  """Real tokens of the examples ``idx`` after truncation to max_seq_len (what a batch packs)."""
  idx = np.asarray(idx, dtype=np.int64)
  lens = ds.seq_offsets[idx + 1] - ds.seq_offsets[idx]
  return int(np.minimum(lens, max_seq_len).sum())


def make_batch(ds: AdsDataset, idx, max_seq_len: int, capacity: int | None = None,
               token_buckets: int = 1) -> Batch:
  """The examples ``idx`` as a :class:`Batch`, sequences truncated to their last max_seq_len
  items and packed into ``capacity`` rows (padding ids are 0). ``capacity`` None: the smallest
  of ``token_buckets`` capacities that holds the batch (:func:`bucket_capacity`; the default
  single bucket is ``len(idx) · max_seq_len``).

  Raises:
    ValueError: the batch holds more tokens than ``capacity`` (never dropped silently).
  """
  idx = np.asarray(idx, dtype=np.int64)
  ends = ds.seq_offsets[idx + 1]
  lens = np.minimum(ends - ds.seq_offsets[idx], max_seq_len)
  num_tokens = int(lens.sum())
  if capacity is None:
    capacity = bucket_capacity(num_tokens, len(idx), max_seq_len, token_buckets)
  elif num_tokens > capacity:
    raise ValueError(f"capacity: the batch holds {num_tokens} tokens, more than its packed "
                     f"capacity {capacity} (use a larger capacity or token_buckets)")
  values, offsets = _gather_ranges(ds.seq_values, ends - lens, lens)
  seq_ids = np.zeros(capacity, np.int32)
  seq_ids[:values.shape[0]] = values
  return Batch(ds.sparse[idx], ds.dense[idx], seq_ids, offsets.astype(np.int32),
               ds.labels[idx])


@functools.lru_cache(maxsize=4)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """Example indices of training step ``step``: the batches cut a stream of per-epoch
  permutations, so the order depends only on (seed, step) and a resumed run sees the same
  batches as an uninterrupted one; batch_size may exceed n (the batch spans epochs). Time and
  memory are O(batch_size + n), whatever the step."""
  start = step * batch_size
  # The batch's positions are contiguous, so its epochs are one run: a mask per epoch made a
  # batch spanning E epochs cost E · batch_size.
  first, last = start // n, (start + batch_size - 1) // n
  stream = np.concatenate([_epoch_permutation(n, seed, e) for e in range(first, last + 1)])
  offset = start - first * n
  return stream[offset:offset + batch_size]


def train_batches(ds: AdsDataset, batch_size: int, max_seq_len: int, seed: int,
                  start_step: int = 0, token_buckets: int = 1) -> Iterator[Batch]:
  """Endless training batches from step ``start_step`` (see :func:`batch_indices`), each packed
  into the smallest of ``token_buckets`` capacities that holds it (:func:`make_batch`)."""
  if len(ds) == 0:
    raise DataFormatError("the training set is empty")
  step = start_step
  while True:
    yield make_batch(ds, batch_indices(len(ds), batch_size, seed, step), max_seq_len,
                     token_buckets=token_buckets)
    step += 1


def eval_batches(ds: AdsDataset, batch_size: int, max_seq_len: int, token_buckets: int = 1
                 ) -> Iterator[tuple[Batch, int]]:
  """``(batch, n_real)`` over the dataset in order; the last batch is filled up with copies of
  example 0, and only its first n_real rows are real. Capacities as :func:`train_batches`."""
  for start in range(0, len(ds), batch_size):
    idx = np.arange(start, min(start + batch_size, len(ds)))
    n_real = idx.shape[0]
    idx = np.concatenate([idx, np.zeros(batch_size - n_real, np.int64)])
    yield make_batch(ds, idx, max_seq_len, token_buckets=token_buckets), n_real


# ---------------------------------------------------------------------------------------------
# Hashing and parsing


def hash_strings(strings, vocab_size: int, *, reserve_zero: bool = False) -> np.ndarray:
  """Stable (CRC-32, not Python's salted ``hash``) ids of strings in [0, vocab_size), or in
  [1, vocab_size) with ``reserve_zero``."""
  h = np.fromiter((zlib.crc32(s.encode()) for s in strings), dtype=np.int64)
  if reserve_zero:
    return (1 + h % (vocab_size - 1)).astype(np.int32)
  return (h % vocab_size).astype(np.int32)


def _signed_log1p(x):
  return np.sign(x) * np.log1p(np.abs(x))


def _float(value: str, column: str, path) -> float:
  """A numeric field: empty is 0 (Criteo's missing counts); "nan", "inf" and the like are
  refused (float() parses them, and one trained the model to NaN with exit status 0)."""
  if value == "":
    return 0.0
  try:
    number = float(value)
  except ValueError as e:
    raise DataFormatError(f"{path}: column {column!r} holds {value!r}, not a number") from e
  if not math.isfinite(number):
    raise DataFormatError(f"{path}: column {column!r} holds {value!r}, not a finite number")
  return number


def _read_csv(path: pathlib.Path, required) -> list[dict[str, str]]:
  if not path.is_file():
    raise DataNotFoundError(f"data file not found: {path} (pass --data-dir, the folder with the "
                            "ads samples; see shared/data/README.md)")
  try:
    return _read_rows(path, required)
  except UnicodeDecodeError as e:  # the header's or a row's: was a traceback
    raise DataFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a read "
                          "block)") from e


def _read_rows(path: pathlib.Path, required) -> list[dict[str, str]]:
  # utf-8-sig: a byte-order mark would otherwise join the first column's name ("missing
  # column(s) ['label']" for a header that shows it).
  with path.open(newline="", encoding="utf-8-sig") as f:
    reader = csv.DictReader(f)
    missing = [c for c in required if c not in (reader.fieldnames or [])]
    if missing:
      raise DataFormatError(f"{path}: missing column(s) {missing}")
    rows = []
    try:
      for row in reader:
        # DictReader fills a short row with None and keeps a long one's extra fields under the
        # key None: a row cut mid-way was hashed as "C20=None" or failed deep in the loaders.
        if None in row or None in row.values():
          fields = len(reader.fieldnames) - list(row.values()).count(None) + len(
              row.get(None) or ())
          raise DataFormatError(f"{path}: line {reader.line_num} has {fields} fields where "
                                f"the header has {len(reader.fieldnames)} (a cut or malformed "
                                "file?)")
        rows.append(row)
    except csv.Error as e:
      raise DataFormatError(f"{path}: line {reader.line_num}: {e}") from e
    return rows


def _categoricals(rows, columns, vocab_size) -> np.ndarray:
  strings = [f"{c}={r[c]}" for r in rows for c in columns]
  return hash_strings(strings, vocab_size).reshape(len(rows), len(columns))


def _numerics(rows, columns, path) -> np.ndarray:
  values = np.array([[_float(r[c], c, path) for c in columns] for r in rows], np.float64)
  return _signed_log1p(values.reshape(len(rows), len(columns))).astype(np.float32)


def _labels(rows, column, path) -> np.ndarray:
  if empty := [i for i, r in enumerate(rows) if r[column] == ""][:1]:
    # _float reads an empty field as 0 (a missing count): as a label that is a silent "no click"
    raise DataFormatError(f"{path}: column {column!r} is empty in data row {empty[0] + 1}: "
                          "labels must be 0/1 clicks")
  labels = np.array([_float(r[column], column, path) for r in rows], np.float32)
  if not np.isin(labels, (0.0, 1.0)).all():
    raise DataFormatError(f"{path}: column {column!r} must hold 0/1 clicks")
  return labels


def _check_dir(data_dir: pathlib.Path) -> None:
  if not data_dir.is_dir():
    raise DataNotFoundError(f"data directory not found: {data_dir} (pass --data-dir, the folder "
                            "with the ads samples; see shared/data/README.md)")


# ---------------------------------------------------------------------------------------------
# Sources


def load_taobao(data_dir, split: str, *, sparse_vocab_size: int, item_vocab_size: int
                ) -> AdsDataset:
  """``taobao_ad_sample/{split}_sample.csv``: 15 hashed id columns, log1p(price), the
  ``click_sequence`` as hashed item ids (empty allowed), ``clk`` as the label."""
  data_dir = pathlib.Path(data_dir)
  _check_dir(data_dir)
  path = data_dir / TAOBAO_FILE.format(split=split)
  rows = _read_csv(path, ("clk", "click_sequence") + TAOBAO_SPARSE + TAOBAO_DENSE)
  seqs = [[t for t in r["click_sequence"].split("^") if t] for r in rows]
  lens = [len(s) for s in seqs]
  items = hash_strings([f"item={t}" for s in seqs for t in s], item_vocab_size,
                       reserve_zero=True)
  return AdsDataset(_categoricals(rows, TAOBAO_SPARSE, sparse_vocab_size),
                    _numerics(rows, TAOBAO_DENSE, path), items,
                    np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                    _labels(rows, "clk", path))


def load_criteo(data_dir, *, sparse_vocab_size: int) -> tuple[AdsDataset, AdsDataset]:
  """``criteo_sample.txt``: 26 hashed categoricals (empty is a value of its own), 13 signed
  log1p counts (empty → 0), no behaviour sequence. Returns (train, valid): rows i % 5 == 4 are
  the validation split."""
  data_dir = pathlib.Path(data_dir)
  _check_dir(data_dir)
  path = data_dir / CRITEO_FILE
  rows = _read_csv(path, ("label",) + CRITEO_DENSE + CRITEO_SPARSE)
  n = len(rows)
  ds = AdsDataset(_categoricals(rows, CRITEO_SPARSE, sparse_vocab_size),
                  _numerics(rows, CRITEO_DENSE, path), np.zeros(0, np.int32),
                  np.zeros(n + 1, np.int64), _labels(rows, "label", path))
  valid = np.arange(n) % 5 == 4
  return ds.subset(np.flatnonzero(~valid)), ds.subset(np.flatnonzero(valid))


def _mix(field: int, values, vocab_size: int) -> np.ndarray:
  """Multiplicative hash of integer ``values`` of feature ``field`` into [0, vocab_size)."""
  v = np.asarray(values, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
  v ^= np.uint64((field + 1) * 0xBF58476D1CE4E5B9 % 2**64)
  v ^= v >> np.uint64(31)
  return (v % np.uint64(vocab_size)).astype(np.int32)


def make_synthetic(n: int, *, max_seq_len: int, sparse_vocab_size: int, item_vocab_size: int,
                   seed: int = 0, num_categories: int = 10, num_items: int = 200,
                   match_weight: float = 3.0, quality_weight: float = 1.0) -> AdsDataset:
  """n examples with production-like structure and a learnable click model.

  Each user prefers one of ``num_categories`` item categories (item ``i`` has category
  ``i % num_categories``); half of a user's behaviour items come from that category. The ad's
  category (sparse field 0) is the user's with probability 0.4. The click logit is
  ``-2 + match_weight · (share of sequence items in the ad's category)
  + quality_weight · (mean item quality over the sequence, qualities N(0, 1) per item)``
  plus small random effects of the user, ad and three other categorical fields and a linear
  function of 4 dense N(0, 1) features. Sequence lengths are uniform on [1, max_seq_len].
  """
  rng = np.random.default_rng(seed)
  cards = (num_categories, 500, 300, 20, 8, 4)  # ad category, user, ad, three small fields
  effect_sd = (0.0, 0.2, 0.3, 0.5, 0.3, 0.3)
  effects = [rng.normal(0, sd, c) for c, sd in zip(cards, effect_sd)]
  quality = rng.normal(0, 1, num_items)
  user_pref = rng.integers(0, num_categories, cards[1])
  users = rng.integers(0, cards[1], n)
  pref = user_pref[users]
  ad_cat = np.where(rng.random(n) < 0.4, pref, rng.integers(0, num_categories, n))
  raw = np.stack([ad_cat, users] + [rng.integers(0, c, n) for c in cards[2:]], axis=1)
  lens = rng.integers(1, max_seq_len + 1, n)
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  owner = np.repeat(np.arange(n), lens)
  per_cat = num_items // num_categories
  cat = np.where(rng.random(offsets[-1]) < 0.5, pref[owner],
                 rng.integers(0, num_categories, offsets[-1]))
  items = cat + num_categories * rng.integers(0, per_cat, offsets[-1])
  match = np.bincount(owner, weights=cat == ad_cat[owner], minlength=n) / lens
  mean_quality = np.bincount(owner, weights=quality[items], minlength=n) / lens
  dense = rng.normal(size=(n, 4))
  logits = (-2.0 + match_weight * match + quality_weight * mean_quality
            + dense @ rng.normal(0, 0.4, 4) + sum(e[raw[:, f]] for f, e in enumerate(effects)))
  labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
  sparse = np.stack([_mix(f, raw[:, f], sparse_vocab_size) for f in range(len(cards))], axis=1)
  seq_values = 1 + _mix(-1, items, item_vocab_size - 1)
  return AdsDataset(sparse, dense.astype(np.float32), seq_values.astype(np.int32), offsets,
                    labels, logits.astype(np.float32))


SYNTHETIC_TRAIN_EXAMPLES = 65536
"""The synthetic training split's default size: 200 steps of 64 never repeat an example."""
SYNTHETIC_VALID_EXAMPLES = 2048
"""The synthetic validation split's default size."""
SYNTHETIC_BYTES_PER_ITEM = 48
SYNTHETIC_BYTES_PER_EXAMPLE = 400
"""Peak host memory of :func:`load` ("synthetic") is about ``SYNTHETIC_BYTES_PER_ITEM`` bytes per
behaviour item plus ``SYNTHETIC_BYTES_PER_EXAMPLE`` per example (measured with tracemalloc: 44
and about 330; the generator's int64 and float64 temporaries of one entry per item)."""
MEMORY_FRACTION = 0.5
""":func:`synthetic_size_problem` refuses data whose generation would take more than this share
of the machine's physical memory."""


def physical_memory_bytes() -> int | None:
  """This machine's physical memory in bytes, None where ``os.sysconf`` cannot tell."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):
    return None


def synthetic_peak_bytes(num_examples: int, max_seq_len: int) -> int:
  """Estimated peak host memory of generating ``num_examples`` synthetic examples (lengths
  uniform on [1, max_seq_len]: (max_seq_len + 1) / 2 items each on average) and splitting
  them, per :data:`SYNTHETIC_BYTES_PER_ITEM`."""
  items = num_examples * (max_seq_len + 1) / 2
  return int(items * SYNTHETIC_BYTES_PER_ITEM + num_examples * SYNTHETIC_BYTES_PER_EXAMPLE)


def synthetic_size_problem(num_examples: int, max_seq_len: int,
                           memory_bytes: int | None = None) -> str | None:
  """Why generating ``num_examples`` synthetic examples with ``max_seq_len`` would not fit in
  memory (a phrase for an error message), or None when it fits: the estimate of
  :func:`synthetic_peak_bytes` against :data:`MEMORY_FRACTION` of ``memory_bytes`` (default
  :func:`physical_memory_bytes`; None there: no check)."""
  memory_bytes = physical_memory_bytes() if memory_bytes is None else memory_bytes
  need = synthetic_peak_bytes(num_examples, max_seq_len)
  if memory_bytes is None or need <= MEMORY_FRACTION * memory_bytes:
    return None
  items = num_examples * (max_seq_len + 1) / 2
  return (f"{num_examples} examples of up to {max_seq_len} behaviour items hold about "
          f"{items:.3g} items, about {need / 2**30:.3g} GiB to generate, more than "
          f"{MEMORY_FRACTION:.0%} of this machine's {memory_bytes / 2**30:.3g} GiB")


def load(name: str, data_dir=None, *, max_seq_len: int = 32, sparse_vocab_size: int = 4096,
         item_vocab_size: int = 4096, seed: int = 0,
         num_train: int = SYNTHETIC_TRAIN_EXAMPLES,
         num_valid: int = SYNTHETIC_VALID_EXAMPLES) -> tuple[AdsDataset, AdsDataset, DataSpec]:
  """``(train, valid, spec)`` of dataset ``name`` (one of :data:`DATASETS`).

  ``data_dir`` (default :data:`DEFAULT_DATA_DIR`) is read by "taobao" and "criteo";
  ``seed``, ``num_train`` and ``num_valid`` by "synthetic". ``max_seq_len`` bounds the synthetic
  lengths (real sequences are truncated later, by :func:`make_batch`).

  Raises:
    ValueError: unknown ``name`` or bad sizes. DataNotFoundError: a missing file or directory.
    DataFormatError: a missing column, an unparsable or non-finite value, an empty label, a
      file that is not UTF-8, an empty validation split. DataTooLargeError: synthetic data
      that would not fit in memory (:func:`synthetic_size_problem`; checked before generating).
  """
  if name not in DATASETS:
    raise ValueError(f"name must be one of {DATASETS}, got {name!r}")
  for arg, v in (("max_seq_len", max_seq_len), ("sparse_vocab_size", sparse_vocab_size),
                 ("item_vocab_size", item_vocab_size)):
    if v < 2:
      raise ValueError(f"{arg} must be >= 2, got {v}")
  data_dir = pathlib.Path(DEFAULT_DATA_DIR if data_dir is None else data_dir)
  if name == "synthetic":
    if problem := synthetic_size_problem(num_train + num_valid, max_seq_len):
      raise DataTooLargeError(f"synthetic data (num_train={num_train}, num_valid={num_valid}, "
                              f"max_seq_len={max_seq_len}): {problem}")
    ds = make_synthetic(num_train + num_valid, max_seq_len=max_seq_len,
                        sparse_vocab_size=sparse_vocab_size, item_vocab_size=item_vocab_size,
                        seed=seed)
    train, valid = ds.subset(np.arange(num_train)), ds.subset(np.arange(num_train, len(ds)))
  elif name == "taobao":
    kw = dict(sparse_vocab_size=sparse_vocab_size, item_vocab_size=item_vocab_size)
    train, valid = load_taobao(data_dir, "train", **kw), load_taobao(data_dir, "valid", **kw)
  else:
    train, valid = load_criteo(data_dir, sparse_vocab_size=sparse_vocab_size)
  if len(valid) == 0:  # evaluation concatenated no batches: a ValueError traceback
    raise DataFormatError(f"the validation set of --data {name} is empty (Taobao: "
                          "valid_sample.csv without rows; Criteo: rows i % 5 == 4 are the "
                          "validation split, so fewer than 5 rows leave none)")
  spec = DataSpec(train.sparse.shape[1], train.dense.shape[1], sparse_vocab_size,
                  item_vocab_size)
  return train, valid, spec


def file_fingerprint(path) -> dict:
  """``{"size": bytes, "sha256": hex, "ends_sha256": hex}`` of a file: the SHA-256 of all of it
  (streamed) and that of its first and last :data:`FINGERPRINT_BYTES` only (all of it when
  smaller than twice that), which fingerprints saved by older versions hold as their "sha256"
  (without "ends_sha256"): they still compare."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    whole = hashlib.file_digest(f, "sha256")
    f.seek(0)
    ends = hashlib.sha256(f.read(FINGERPRINT_BYTES))
    if size > FINGERPRINT_BYTES:
      f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
      ends.update(f.read())
  return {"size": size, "sha256": whole.hexdigest(), "ends_sha256": ends.hexdigest()}


def fingerprint(name: str, data_dir=None, **load_kwargs) -> dict:
  """What identifies the data ``load(name, data_dir, **load_kwargs)`` returns, as a JSON-able
  dict: for "synthetic" its generating arguments (seed, sizes; the defaults of :func:`load`
  filled in); for a file source each file it reads (:data:`DATA_FILES`) by its path relative to
  ``data_dir`` with :func:`file_fingerprint`, and under "data_dir" the resolved folder (for
  messages only: the same files elsewhere are the same data).

  Raises: DataNotFoundError for a missing data file (as :func:`load`)."""
  bound = inspect.signature(load).bind(name, data_dir, **load_kwargs)
  bound.apply_defaults()
  if name == "synthetic":
    return {"data": name, "generator": {k: v for k, v in bound.arguments.items()
                                        if k not in ("name", "data_dir")}}
  data_dir = pathlib.Path(DEFAULT_DATA_DIR if data_dir is None else data_dir)
  files = {}
  for rel in DATA_FILES[name]:
    try:
      files[rel] = file_fingerprint(data_dir / rel)
    except FileNotFoundError as e:
      raise DataNotFoundError(f"data file not found: {data_dir / rel}") from e
  return {"data": name, "data_dir": str(data_dir.resolve()), "files": files}


def _ends_only(entry: dict) -> bool:
  """A :func:`file_fingerprint` saved by an older version: its "sha256" hashed only the ends."""
  return "ends_sha256" not in entry


def fingerprint_differences(saved: dict, now: dict) -> list[str]:
  """What differs between two :func:`fingerprint` results, one phrase each (empty when they
  describe the same data; "data_dir" is not compared). A file the saved fingerprint hashed by
  its ends only (an older version's) is compared by its ends: see :func:`fingerprint_unchecked`
  for what that misses."""
  if saved.get("data") != now.get("data"):
    return [f"--data {saved.get('data')} (now {now.get('data')})"]
  generator = now.get("generator", {})
  diffs = [f"generated with {k}={v} (now {generator.get(k)})"
           for k, v in saved.get("generator", {}).items() if generator.get(k) != v]
  saved_files, now_files = saved.get("files", {}), now.get("files", {})
  for rel in sorted(set(saved_files) | set(now_files)):
    old, new = saved_files.get(rel), now_files.get(rel)
    if old is None or new is None:
      diffs.append(f"{rel} not read by {'this' if new is None else 'the saved'} run")
    elif old["size"] != new["size"]:
      diffs.append(f"{rel} has {new['size']} bytes (saved: {old['size']})")
    elif old["sha256"] != new["ends_sha256" if _ends_only(old) else "sha256"]:
      diffs.append(f"{rel} has other contents (same size, {new['size']} bytes)")
  return diffs


def fingerprint_unchecked(saved: dict) -> list[str]:
  """The files of a saved :func:`fingerprint` whose middle it cannot check: those an older
  version hashed by their ends only, larger than twice :data:`FINGERPRINT_BYTES` (a smaller
  file's ends are all of it)."""
  return sorted(rel for rel, entry in saved.get("files", {}).items()
                if _ends_only(entry) and entry["size"] > 2 * FINGERPRINT_BYTES)
