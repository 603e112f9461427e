"""SeqIO's offline caches (`seqio.scripts.cache_tasks_main`), read without TensorFlow.

A T5X user who ran `cache_tasks_main --tasks=my_task --output_cache_dir=DIR` holds

    DIR/my_task/COMPLETED                  written last: the cache is whole
    DIR/my_task/info.<split>.json          features: dtype and shape of each
    DIR/my_task/stats.<split>.json         "examples": the count, token statistics
    DIR/my_task/<split>.tfrecord-0000N-of-0000M      tf.train.Example shards
                (or <split>.array_record-0000N-of-0000M with --output_format=arrayrecord)

and trains with `use_cached=True` and `--seqio_additional_cache_dirs=DIR`. Here the same:
`add_global_cache_dirs([DIR])` (SeqIO's name; the flag calls it) and
`Task.get_dataset(..., use_cached=True)` (the run gins' `USE_CACHED_TASKS`), which reads
the cache in place of the source and skips the task's preprocessors up to its
`CacheDatasetPlaceholder`, as SeqIO does. A ragged feature (info shape [None, None, ...],
row lengths in `_rl:<dim>:<key>`) comes back as nested lists. `t5forge cache_tasks`
(`cache_tasks.py`, on Apache Beam) writes such caches. The cache's examples come in file
order (SeqIO interleaves 16 shards; the task then shuffles them globally either way). A task name with
'' is looked for in nested directories, as SeqIO's `get_task_dir_from_name`.

DIR may be a bucket (`gs://` or `s3://`): the metadata is read from there and each shard
read through its local copy (`files.local_file`, one per object version, in the cache dir).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


from t5forge import storage
from t5forge.data import records, sources, tf_example
from t5forge.data.array_records import ArrayRecordFiles
from t5forge.errors import UserError

_cache_dirs: list[str] = []


def add_global_cache_dirs(global_cache_dirs: Iterable[str]) -> None:
  """SeqIO's: directories searched (in order) for tasks' caches; T5X's
  `--seqio_additional_cache_dirs`."""
  if isinstance(global_cache_dirs, str):
    global_cache_dirs = [global_cache_dirs]
  for d in global_cache_dirs:
    d = os.path.expanduser(str(d))
    if d and d not in _cache_dirs:
      _cache_dirs.append(d)


def set_global_cache_dirs(global_cache_dirs: Iterable[str]) -> None:
  """SeqIO's: replaces the searched directories."""
  _cache_dirs.clear()
  add_global_cache_dirs(global_cache_dirs)


def get_global_cache_dirs() -> list[str]:
  return list(_cache_dirs)


def task_dir(task_name: str) -> str:
  """SeqIO's `get_task_dir_from_name`: 'a:b' lives in a/b."""
  return os.path.join(*task_name.split(":"))


def find(task_name: str) -> str:
  """The directory of `task_name`'s complete cache.

  Raises:
    UserError: no cache directory given, no cache of this task, or only incomplete ones.
  """
  if not _cache_dirs:
    raise UserError(f"task {task_name!r}: use_cached=True, but no SeqIO cache directory is "
                    "given; pass --seqio_additional_cache_dirs=DIR (or call "
                    "t5forge.data.add_global_cache_dirs([DIR])) with the directory "
                    "cache_tasks_main wrote")
  incomplete = []
  for d in _cache_dirs:
    path = storage.join(d, task_dir(task_name))
    if storage.isfile(storage.join(path, "COMPLETED")):
      return path
    if storage.isdir(path):
      incomplete.append(path)
  if incomplete:
    raise UserError(f"{incomplete[0]}: the SeqIO cache of task {task_name!r} is incomplete (no "
                    "COMPLETED file: cache_tasks_main did not finish); run it again, or train "
                    "without use_cached")
  raise UserError(f"task {task_name!r}: no SeqIO cache in {', '.join(_cache_dirs)} (looked for "
                  f"{task_dir(task_name)}/COMPLETED); run seqio's cache_tasks_main for it, or "
                  "train without use_cached")


def _read_json(path: str) -> Any:
  try:
    return json.loads(storage.read_text(path))
  except FileNotFoundError:
    held = ", ".join(sorted(cached_splits(storage.dirname(path)))) or "no split"
    raise UserError(f"{path}: missing from the SeqIO cache (it holds: {held}); cache that split "
                    "with cache_tasks_main, or use the task without use_cached") from None
  except ValueError as e:
    raise UserError(f"{path}: not valid JSON ({e}); the cache is damaged: write it again") \
        from None


def cached_splits(directory: str) -> list[str]:
  """The splits a task's cache directory holds (its `info.<split>.json` files)."""
  try:
    return [m.group(1) for n in storage.listdir(directory)
            if (m := re.match(r"info\.(.+)\.json$", n))]
  except OSError:
    return []


def _description(features: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, int]]:
  """info.json's features -> (TF feature specs, ragged feature -> its ragged dimensions),
  as SeqIO's `_CachedDataSource` builds them (int32 and bool are stored as int64; a leading
  None is a sequence; a None after it a ragged dimension, whose row lengths are the
  `_rl:<dim>:<key>` features)."""
  out, ragged = {}, {}
  for key, desc in features.items():
    try:
      dtype, shape = desc["dtype"], list(desc.get("shape") or [])
    except (KeyError, TypeError):
      raise UserError(f"{where}: feature {key!r} has no dtype/shape") from None
    if any(d is None for d in shape[1:]):
      if not all(d is None for d in shape):
        raise UserError(f"{where}: feature {key!r} has shape {shape}; t5forge reads cached "
                        "ragged features whose every dimension is ragged ([None, None, ...]), "
                        "as SeqIO writes a list of lists")
      ragged[key] = len(shape) - 1
      out[key] = tf_example.FixedLenSequenceFeature([], dtype, allow_missing=True)
      for dim in range(ragged[key]):
        out[tf_example.ragged_length_key(key, dim)] = tf_example.FixedLenSequenceFeature(
            [], "int64", allow_missing=True)
    elif shape and shape[0] is None:
      out[key] = tf_example.FixedLenSequenceFeature(shape[1:], dtype, allow_missing=True)
    else:
      out[key] = tf_example.FixedLenFeature(shape, dtype)
  return out, ragged


def _nest(flat: Any, lengths: list[Any]) -> list:
  """Flat values and the row lengths of each ragged dimension (outermost first) -> nested
  lists, the innermost rows as they were decoded (arrays, or lists of text)."""
  rows = flat
  for row_lengths in reversed(lengths):
    ends = np.cumsum(np.asarray(row_lengths, np.int64))
    rows = [rows[a:b] for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)]
  return rows


class CachedSplitSource(sources.SplitSource):
  """One split of a SeqIO cache: its examples as SeqIO's `use_cached=True` yields them
  before the post-cache preprocessors (token features as int32 arrays, `*_pretokenized`
  text as str).

  Args:
    directory: the task's cache directory (`find`).
    split: the split.
    vocab_sizes: feature -> the task's vocabulary size; every token id of those features
      must be below it (checked once per cache, remembered in the cache dir).
  """

  def __init__(self, directory: str, split: str, vocab_sizes: Mapping[str, int] | None = None):
    self._dir = directory
    self._split = split
    self._vocab_sizes = dict(vocab_sizes or {})
    info_path = storage.join(directory, f"info.{split}.json")
    info = _read_json(info_path)
    stats = _read_json(storage.join(directory, f"stats.{split}.json"))
    try:
      features, num_shards = info["features"], int(info["num_shards"])
      self._count = int(stats["examples"])
    except (KeyError, TypeError, ValueError) as e:
      raise UserError(f"{info_path}: missing or invalid field {e}; the cache is damaged") \
          from None
    self._dtypes = {k: v.get("dtype") for k, v in features.items()}
    description, self._ragged = _description(features, info_path)
    decoder = tf_example.ExampleDecoder(description)
    paths, fmt = self._shards(num_shards)
    if fmt == "tfrecord":
      self._records = records.RecordFiles(paths, compression_type="")
    else:
      self._records = ArrayRecordFiles(paths)
    total = len(self._records)
    if total != self._count:
      raise UserError(f"{directory}: the {split!r} shards hold {total} examples where "
                      f"stats.{split}.json says {self._count}; the cache is damaged: write it "
                      "again")
    self._paths = paths
    self._decoder = decoder
    self._check_vocabulary()

  def _shards(self, num_shards: int) -> tuple[list[str], str]:
    for fmt in ("tfrecord", "array_record"):
      pattern = storage.join(self._dir, f"{self._split}.{fmt}-*-of-{num_shards:05d}")
      paths = storage.glob(pattern)
      if paths:
        if len(paths) != num_shards:
          raise UserError(f"{self._dir}: {len(paths)} of the {num_shards} {self._split!r} "
                          f"shards ({fmt}) are present; the cache is damaged: write it again")
        return paths, fmt
    raise UserError(f"{self._dir}: no {self._split!r} shards ({self._split}.tfrecord-*-of-"
                    f"{num_shards:05d} or .array_record-...); the cache is damaged: write it "
                    "again")

  def __len__(self):
    return self._count

  def __getitem__(self, i):
    i = int(i)
    ex = self._decoder(self._records.read(i), self._records.where(i))
    for k, size in self._checked:
      v = ex.get(k)
      if v is not None and v.size and (top := int(v.max())) >= size:
        self._refuse(k, top, self._records.where(i))
    for key, dims in self._ragged.items():
      ex[key] = _nest(ex[key], [ex.pop(tf_example.ragged_length_key(key, d)) for d in range(dims)])
    for old, new in self._renamed:  # caches written before SeqIO renamed the feature
      if old in ex:
        ex[new] = ex.pop(old)
    return ex

  # Records checked when the split is opened, evenly spaced; the rest as they are read.
  _SAMPLE = 2000

  def _check_vocabulary(self) -> None:
    """Token ids of the vocabulary-backed features must fit the task's vocabularies:
    checked on a sample when the split is opened (a cache written with another
    vocabulary fails there, before training starts) and on every example read."""
    self._checked = [(k, int(n)) for k, n in self._vocab_sizes.items()
                     if self._dtypes.get(k) in ("int32", "int64")]
    self._renamed = [(k, k[:-len("_plaintext")] + "_pretokenized") for k in self._dtypes
                     if k.endswith("_plaintext")]
    if not self._checked or not self._count:
      return
    step = max(1, self._count // self._SAMPLE)
    for i in range(0, self._count, step):
      self[i]

  def _refuse(self, key: str, token: int, where) -> None:
    raise UserError(f"{self._dir}: cached {self._split!r} feature {key!r} holds token id "
                    f"{token} ({where}), but the task's vocabulary has "
                    f"{dict(self._checked)[key]} ids; the cache was written with another "
                    "vocabulary: write it again with this task's, or use this task without "
                    "use_cached")

  def fingerprint(self):
    return f"{sources.files_fingerprint(self._paths)}:seqio-cache"

  def content_fingerprint(self):
    h = hashlib.blake2b(digest_size=10)
    h.update(sources.files_content_digest(self._paths).encode())
    h.update(json.dumps(self._dtypes, sort_keys=True).encode())
    return f"seqio-cache:{h.hexdigest()}:{self._count}"

  def describe(self):
    return f"SeqIO cache {self._dir} split {self._split!r}"

  def __getstate__(self):
    return {"dir": self._dir, "split": self._split, "vocab": self._vocab_sizes}

  def __setstate__(self, state):
    self.__init__(state["dir"], state["split"], state["vocab"])


def warn_not_cacheable(task_name: str) -> None:
  logging.getLogger(__name__).warning(
      "task %r has no CacheDatasetPlaceholder, so it has no SeqIO cache; use_cached=True "
      "reads it from its source (as SeqIO does)", task_name)
