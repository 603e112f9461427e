"""Task and Mixture registries, shaped like SeqIO's so a T5X `tasks.py` ports with small edits.

    import functools
    from t5forge import data as seqio          # the usual alias keeps ports short
    from t5forge.data import preprocessors as t5_pre

    vocab = seqio.SentencePieceVocabulary("spm.model", extra_ids=100)
    seqio.TaskRegistry.add(
        "my_task",
        source=seqio.TsvDataSource({"train": "train.tsv", "validation": "dev.tsv"},
                                   field_names=("en", "de")),
        preprocessors=[
            functools.partial(t5_pre.translate, source_language="en", target_language="de"),
            seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim],
        output_features={"inputs": seqio.Feature(vocab), "targets": seqio.Feature(vocab)},
        metric_fns=[t5forge.metrics.bleu])

Differences from SeqIO a port must know: a preprocessor is a function of one
example (see `preprocessors`), `seed`/`seeds` arguments become `rng`, and the sources
are t5forge's (SeqIO's names, read without TensorFlow: t5forge/data/README.md).
`get_dataset` returns a Grain `MapDataset` of dicts of numpy int32 arrays (plus the
`<feature>_pretokenized` strings).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import importlib
import inspect
import logging
import os
import re
import sys
import threading
import traceback
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from t5forge.data import cache as cache_lib
from t5forge.data import files
from t5forge.data import preprocessors as pre
from t5forge.data import seqio_cache
from t5forge.data import sources as src
from t5forge.data import vocab_io
from t5forge.data.vocab import Vocabulary
from t5forge.errors import UserError

log = logging.getLogger(__name__)

# Offline-stage randomness (e.g. select_random_chunk) is seeded by this constant
# and the example's position only, so the stage can be cached and shared.
_OFFLINE_SEED = 0x7435


@dataclasses.dataclass(frozen=True)
class ShardInfo:
  """SeqIO's shard spec: this process reads shard `index` of `num_shards`."""
  index: int
  num_shards: int


@dataclasses.dataclass(frozen=True)
class Feature:
  """An output feature: its vocabulary and how the preprocessors treat it.

  Attributes:
    vocabulary: encodes the feature's text.
    add_eos: `append_eos` / `append_eos_after_trim` add EOS to this feature.
    required: the feature must exist after preprocessing.
    dtype: always int32 here (kept for SeqIO compatibility).
  """
  vocabulary: Vocabulary
  add_eos: bool = True
  required: bool = True
  dtype: Any = np.int32


# -------------------------------------------------------------------------------------------- task


class Task:
  """A named dataset: source -> preprocessors -> output features (+ metrics).

  Args:
    name: registry name.
    source: a `sources.DataSource` (its splits are the task's splits).
    preprocessors: see `preprocessors` for the kinds.
    output_features: feature name -> `Feature`.
    postprocess_fn: `fn(decoded_text, example=None, is_target=False)` applied to
      predictions and (with is_target=True) to targets before the metrics.
    metric_fns: `fn(targets, predictions) -> dict` (or `fn(targets, scores)`).
    cache: keep the offline stage (everything up to the last stream step, or up to
      `CacheDatasetPlaceholder`) on disk under `<cache dir>/tasks/` (`files.cache_root`), reused
      while the source, preprocessors and vocabularies are unchanged.
  """

  def __init__(self, name: str, source: src.DataSource, preprocessors: Sequence[Any] = (),
               output_features: Mapping[str, Feature] | None = None,
               postprocess_fn: Callable | None = None, metric_fns: Sequence[Callable] = (),
               cache: bool = False, cache_dir: str | None = None):
    if not isinstance(source, src.DataSource):
      raise UserError(f"task {name!r}: source must be a t5forge.data DataSource (e.g. "
                      f"TsvDataSource), got {type(source).__name__}")
    if not output_features:
      raise UserError(f"task {name!r} needs output_features, e.g. {{'targets': Feature(vocab)}}")
    for k, f in output_features.items():
      if not isinstance(f, Feature):
        raise UserError(f"task {name!r}: output feature {k!r} must be a Feature(vocabulary), "
                        f"got {type(f).__name__}")
    self.name = name
    self.source = source
    self.preprocessors = tuple(preprocessors)
    self.output_features = dict(output_features)
    self.postprocess_fn = postprocess_fn
    self.metric_fns = tuple(metric_fns)
    self.cache = cache or cache_dir is not None
    if self.cache and not getattr(source, "caching_permitted", True):
      raise UserError(f"task {name!r}: its source does not permit caching "
                      "(caching_permitted=False); register it without cache=True")
    self.cache_dir = cache_dir
    self._offline: dict[tuple, src.SplitSource] = {}
    self._seqio_cached: dict[str, src.SplitSource] = {}
    self._lock = threading.Lock()

  def __repr__(self):
    return f"Task({self.name!r}, splits={list(self.splits)})"

  def register_copy(self, name: str, **changes: Any) -> str:
    """Registers (once) a copy of this task as `name`, with the attributes in `changes`
    (e.g. `output_features`, `preprocessors`) replaced; returns `name`.

    The copy keeps a Task subclass and its attributes, and caches nothing of this task's:
    its offline stage and SeqIO cache are looked up under its own name.
    """
    if name not in TaskRegistry.names():
      new = copy.copy(self)
      new.name = name
      for key, value in changes.items():
        setattr(new, key, value)
      new._offline, new._seqio_cached, new._lock = {}, {}, threading.Lock()  # noqa: SLF001 (Task's own state)
      TaskRegistry._add(name, new)  # noqa: SLF001 (Task's own state)
    return name

  @property
  def splits(self) -> tuple[str, ...]:
    return self.source.splits

  def num_input_examples(self, split: str) -> int:
    return self.source.num_input_examples(split)

  def has_split(self, split: str, use_cached: bool = False) -> bool:
    """Whether `split` can be read; with `use_cached`, from the task's SeqIO cache (the
    source itself need not be on this machine)."""
    if use_cached and self._placeholder() is not None:
      return split in seqio_cache.cached_splits(seqio_cache.find(self.name))
    return split in self.splits

  @property
  def predict_metric_fns(self) -> list[Callable]:
    return [f for f in self.metric_fns if "scores" not in _param_names(f)]

  @property
  def score_metric_fns(self) -> list[Callable]:
    return [f for f in self.metric_fns if "scores" in _param_names(f)]

  def postprocess(self, text: Any, example: Mapping[str, Any] | None = None,
                  is_target: bool = False) -> Any:
    """Applies `postprocess_fn` (identity if None)."""
    if self.postprocess_fn is None:
      return text
    kwargs = pre.call_kwargs(self.postprocess_fn, {"example": example, "is_target": is_target})
    return self.postprocess_fn(text, **kwargs)

  def compute_metrics(self, targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
    """Runs every predict metric fn and merges the results."""
    out = {}
    for fn in self.predict_metric_fns:
      out.update(fn(list(targets), list(predictions)))
    return out

  # -- stages

  def _placeholder(self) -> pre.CacheDatasetPlaceholder | None:
    for p in self.preprocessors:
      if isinstance(p, pre.CacheDatasetPlaceholder):
        return p
    return None

  def precache_preprocessors(self) -> list:
    """What a SeqIO cache of this task holds the output of: its preprocessors before the
    CacheDatasetPlaceholder, expanded as `get_dataset` runs them (without sequence
    lengths: as SeqIO, a cache is written before they are known).

    Raises:
      UserError: the task has no CacheDatasetPlaceholder.
    """
    placeholder = self._placeholder()
    if placeholder is None:
      raise UserError(f"task {self.name!r} has no CacheDatasetPlaceholder, so it cannot be "
                      "cached; add seqio.CacheDatasetPlaceholder() to its preprocessors where "
                      "the cache should end (after tokenize, before random or length steps)")
    steps = list(self.preprocessors)
    return pre.expand(steps[:steps.index(placeholder)], None, self.output_features)

  def _plan(self, sequence_length, cached: bool = False) -> tuple[list, list, bool]:
    """Splits the preprocessors into the offline and the online stage; `cached`: only those
    after the CacheDatasetPlaceholder (a SeqIO cache holds what precedes it)."""
    steps = list(self.preprocessors)
    if cached:
      steps = steps[steps.index(self._placeholder()) + 1:]
    steps = pre.expand(steps, sequence_length, self.output_features)
    kinds = [pre.kind_of(p) for p in steps]
    cut = 1 + max((i for i, k in enumerate(kinds) if k in ("stream", "flat_map")), default=-1)
    if self.cache and "placeholder" in kinds:
      cut = max(cut, kinds.index("placeholder") + 1)
    offline = [p for p in steps[:cut] if pre.kind_of(p) != "placeholder"]
    online = [p for p in steps[cut:] if pre.kind_of(p) != "placeholder"]
    uses_length = any("sequence_length" in pre.call_kwargs(p, {"sequence_length": 1})
                      for p in offline)
    return offline, online, uses_length

  def _context(self, sequence_length) -> dict[str, Any]:
    return {"sequence_length": dict(sequence_length) if sequence_length else None,
            "output_features": self.output_features}

  def uses_seqio_cache(self, use_cached: bool) -> bool:
    """Whether `use_cached` reads this task from a SeqIO cache: it must have a
    CacheDatasetPlaceholder (without one SeqIO, and we, warn and read the source); a
    placeholder with `required=True` refuses to run without a cache of either kind."""
    placeholder = self._placeholder()
    if use_cached and placeholder is None:
      seqio_cache.warn_not_cacheable(self.name)
      return False
    if placeholder is not None and placeholder.required and not use_cached and not self.cache:
      raise UserError(f"task {self.name!r} requires caching (CacheDatasetPlaceholder("
                      "required=True)); pass use_cached=True with its SeqIO cache "
                      "(--seqio_additional_cache_dirs, USE_CACHED_TASKS = True), or register "
                      "it with cache=True")
    return bool(use_cached)

  def split_source(self, split: str, use_cached: bool = False) -> src.SplitSource:
    """The split's examples before any preprocessor: the source's, or (use_cached) the
    SeqIO cache's, which hold the examples after the CacheDatasetPlaceholder."""
    if not self.uses_seqio_cache(use_cached):
      return self.source.get(split)
    with self._lock:
      if split not in self._seqio_cached:
        sizes = {k: f.vocabulary.vocab_size for k, f in self.output_features.items()}
        self._seqio_cached[split] = seqio_cache.CachedSplitSource(
            seqio_cache.find(self.name), split, sizes)
      return self._seqio_cached[split]

  def _offline_source(self, split: str, sequence_length,
                      use_cached: bool = False) -> src.SplitSource:
    """The split's examples after the offline stage (the raw source if empty)."""
    cached = self.uses_seqio_cache(use_cached)
    offline, _, uses_length = self._plan(sequence_length, cached)
    source = self.split_source(split, cached)
    if not offline:
      return source
    key = (split, cached,
           tuple(sorted((sequence_length or {}).items())) if uses_length else None)
    with self._lock:
      if key not in self._offline:
        self._offline[key] = self._materialize(split, source, offline, sequence_length, uses_length)
      return self._offline[key]

  def _materialize(self, split, source, offline, sequence_length, uses_length) -> src.SplitSource:
    ctx = self._context(sequence_length)
    if self.cache:
      # Lengths baked into expanded composites are in their fingerprints already;
      # the lengths themselves matter only to steps that read them.
      fp = cache_lib.fingerprint([
          source.fingerprint(), [cache_lib.fn_fingerprint(p) for p in offline],
          {k: (f.vocabulary.fingerprint(), f.add_eos) for k, f in self.output_features.items()},
          sorted((sequence_length or {}).items()) if uses_length else None])
      if fp is None:
        log.warning("task %r: a preprocessor before the cache point has no stable identity "
                        "(a lambda or closure); its output is kept in memory, not cached on disk",
                        self.name)
      else:
        root = self.cache_dir or os.path.join(files.cache_root(), "tasks")
        path = os.path.join(root, self.name, fp, f"{split}.array_record")
        if not os.path.exists(path):
          cache_lib.write_records(path, _run_offline(source, offline, ctx))
        return cache_lib.RecordSource(path)
    examples = list(_run_offline(source, offline, ctx))
    if not examples:
      raise UserError(f"task {self.name!r}: split {split!r} has no examples left after "
                      "preprocessing")
    return src.InMemorySource(examples, name=f"task {self.name!r} split {split!r}")

  def get_dataset(self, sequence_length: Mapping[str, int | None] | None, split: str = "train",
                  use_cached: bool = False, *, shuffle: bool = True, seed: int | None = 0,
                  shard_index: int = 0, num_shards: int = 1, num_epochs: int | None = 1,
                  shard_info: ShardInfo | None = None):
    """The preprocessed, tokenized, trimmed examples of one split, as a Grain MapDataset.

    Args:
      sequence_length: feature -> length (None value: no trimming); every output
        feature needs an entry. None skips trimming entirely.
      split: a split of the source.
      use_cached: read the task's SeqIO cache (`seqio_cache`) instead of its source and
        the preprocessors before its CacheDatasetPlaceholder, as SeqIO's.
      shuffle: a global shuffle, different every epoch, determined by `seed`.
      seed: seeds the shuffle and the per-example rng (with the example index).
        None means 0: runs are always reproducible.
      shard_index / num_shards: this process takes every num_shards-th example of
        the global (shuffled, repeated) order, so shards are disjoint and together
        see each example once per epoch.
      num_epochs: None repeats forever.
      shard_info: SeqIO's `ShardInfo(index, num_shards)`, instead of the two above.

    Returns:
      `grain.MapDataset` of dicts (numpy int32 arrays and `*_pretokenized` text);
      examples dropped by a filter are None at their index (iteration skips them).
    """
    import grain  # noqa: PLC0415 (slow import, on first use)

    seed = 0 if seed is None else seed
    if shard_info is not None:
      shard_index, num_shards = shard_info.index, shard_info.num_shards
    _check_lengths(self, sequence_length)
    check_sharding(shard_index, num_shards, seed)
    if num_epochs is not None and num_epochs < 1:
      raise UserError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
    cached = self.uses_seqio_cache(use_cached)
    _, online, _ = self._plan(sequence_length, cached)
    ds = grain.MapDataset.source(self._offline_source(split, sequence_length, cached))
    if shuffle:
      ds = ds.shuffle(seed=seed % (1 << 32))
    if num_epochs != 1:
      ds = ds.repeat(num_epochs)
    ds = ds.map_with_index(_Online(self.name, online, self.output_features, sequence_length, seed))
    if num_shards > 1:
      ds = ds[shard_index::num_shards]
    return ds


def _check_lengths(task: Task, sequence_length) -> None:
  if sequence_length is None:
    return
  for k in task.output_features:
    if k not in sequence_length:
      raise UserError(f"task {task.name!r} has output feature {k!r} but task_feature_lengths has "
                      f"no length for it; add {k!r}: N (or {k!r}: None to keep it untrimmed)")


def check_sharding(shard_index: int, num_shards: int, seed: int) -> None:
  """UserError unless 0 <= shard_index < num_shards and seed is a non-negative integer."""
  if num_shards < 1 or not 0 <= shard_index < num_shards:
    raise UserError(f"shard_index must be in [0, num_shards); got shard_index={shard_index}, "
                    f"num_shards={num_shards}")
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise UserError(f"seed must be an integer >= 0, got {seed!r}")


def _param_names(fn: Callable) -> tuple[str, ...]:
  try:
    return tuple(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return ()


class _Online:
  """The online stage: per-example preprocessors, then validation and trimming.

  Picklable (Grain workers). The rng of example `index` is Philox keyed by
  (seed, index): the same on every host count and every resumption.
  """

  def __init__(self, task_name, steps, output_features, sequence_length, seed):
    self.task_name = task_name
    self.steps = list(steps)
    self.output_features = output_features
    self.sequence_length = dict(sequence_length) if sequence_length else None
    self.seed = int(seed)
    self._kwargs = [pre.call_kwargs(p, {"rng": None, "sequence_length": self.sequence_length,
                                        "output_features": output_features}) for p in self.steps]

  def __call__(self, index: int, example: dict) -> dict | None:
    rng = None
    for p, kwargs in zip(self.steps, self._kwargs):
      if "rng" in kwargs:
        if rng is None:
          rng = np.random.Generator(np.random.Philox(key=np.array([self.seed, index], np.uint64)))
        kwargs = dict(kwargs, rng=rng)
      example = p(example, **kwargs)
      if example is None:
        return None
    return finalize_example(example, self.output_features, self.sequence_length, self.task_name)


def finalize_example(example: Mapping[str, Any], output_features: Mapping[str, Feature],
                     sequence_length, task_name: str) -> dict:
  """Checks the output features, makes them int32 arrays and trims them."""
  out = dict(example)
  for k, feature in output_features.items():
    if k not in out:
      if feature.required:
        raise UserError(f"task {task_name!r}: feature {k!r} is missing after preprocessing "
                        f"(example has {sorted(out)}); add a preprocessor that makes it, or "
                        "Feature(required=False)")
      continue
    v = out[k]
    if isinstance(v, (str, bytes)):
      raise UserError(f"task {task_name!r}: feature {k!r} is still text after preprocessing; add "
                      "preprocessors.tokenize to the task")
    v = np.asarray(v, np.int32).reshape(-1)
    length = (sequence_length or {}).get(k)
    out[k] = v[:length] if length is not None else v
  return out


def _run_offline(source: src.SplitSource, steps: Sequence[Any], ctx: Mapping[str, Any]):
  """Runs the offline stage sequentially over the whole split; yields examples."""
  it = (source[i] for i in range(len(source)))
  for n, p in enumerate(steps):
    kind = pre.kind_of(p)
    if kind == "stream":
      kwargs = pre.call_kwargs(p, dict(ctx, rng=np.random.default_rng([_OFFLINE_SEED, n])))
      it = p(it, **kwargs)
    else:
      it = map_examples(p, it, n, ctx, flat=(kind == "flat_map"))
  return it


def map_examples(p, examples, step, ctx, flat, seed: int = _OFFLINE_SEED):
  """Runs a per-example (or flat_map) preprocessor p over examples; one taking `rng` gets
  a generator seeded by (seed, step, example index), so a rerun draws the same."""
  kwargs = pre.call_kwargs(p, dict(ctx, rng=None))
  for i, ex in enumerate(examples):
    if "rng" in kwargs:
      kwargs["rng"] = np.random.default_rng([seed, step, i])
    out = p(ex, **kwargs)
    if flat:
      yield from out
    elif out is not None:
      yield out


# ----------------------------------------------------------------------------------------- mixture


class Mixture:
  """Tasks mixed by rate: `rate` is a number or `fn(task) -> number`."""

  def __init__(self, name: str, tasks: Sequence[tuple[str | Task, float | Callable] | str | Task],
               default_rate: float | Callable | None = None):
    self.name = name
    self._specs = []
    for item in tasks:
      if isinstance(item, (tuple, list)):
        task, rate = item
      else:
        task, rate = item, default_rate
      if rate is None:
        raise UserError(f"mixture {name!r}: task {_task_name(task)!r} has no rate; pass "
                        "(task, rate) or default_rate")
      self._specs.append((task, rate))
    if not self._specs:
      raise UserError(f"mixture {name!r} has no tasks")

  def __repr__(self):
    return f"Mixture({self.name!r}, {[(t.name, r) for t, r in self.tasks_and_rates]})"

  @property
  def tasks(self) -> list[Task]:
    return [t for t, _ in self.tasks_and_rates]

  @property
  def tasks_and_rates(self) -> list[tuple[Task, float]]:
    out = []
    for task, rate in self._specs:
      task = task if isinstance(task, Task) else TaskRegistry.get(task)
      value = float(rate(task) if callable(rate) else rate)
      if value < 0:
        raise UserError(f"mixture {self.name!r}: rate of {task.name!r} is negative ({value})")
      out.append((task, value))
    return out

  @property
  def output_features(self) -> dict[str, Feature]:
    tasks = self.tasks
    first = tasks[0].output_features
    for t in tasks[1:]:
      if {k: f.vocabulary for k, f in t.output_features.items() if k in first} != \
         {k: f.vocabulary for k, f in first.items() if k in t.output_features}:
        raise UserError(f"mixture {self.name!r}: tasks {tasks[0].name!r} and {t.name!r} use "
                        "different vocabularies")
    return first

  def get_dataset(self, sequence_length, split: str = "train", use_cached: bool = False, *,
                  shuffle: bool = True, seed: int | None = 0, shard_index: int = 0,
                  num_shards: int = 1, num_epochs: int | None = None,
                  shard_info: ShardInfo | None = None):
    """The tasks' datasets interleaved by rate, then sharded; see `Task.get_dataset`.

    Mixing is Grain's deterministic proportional interleave: every window of the
    stream holds the tasks in their exact rate proportions (SeqIO samples i.i.d.).
    A mixture ends when its first task runs out (None epochs: never).
    """
    import grain  # noqa: PLC0415 (slow import, on first use)

    seed = 0 if seed is None else seed
    if shard_info is not None:
      shard_index, num_shards = shard_info.index, shard_info.num_shards
    check_sharding(shard_index, num_shards, seed)
    pairs = [(t, r) for t, r in self.tasks_and_rates if r > 0]
    if not pairs:
      raise UserError(f"mixture {self.name!r}: every rate is 0")
    datasets = [t.get_dataset(sequence_length, split, use_cached, shuffle=shuffle,
                              seed=_derive_seed(seed, t.name), num_epochs=num_epochs)
                for t, _ in pairs]
    if len(datasets) == 1:
      ds = datasets[0]
    else:
      ds = grain.MapDataset.mix(datasets, [r for _, r in pairs])
    if num_shards > 1:
      ds = ds[shard_index::num_shards]
    return ds


def _task_name(t) -> str:
  return t.name if isinstance(t, Task) else str(t)


def _derive_seed(seed: int, name: str) -> int:
  return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 32)


def mixing_rate_num_examples(task: Task, maximum: int | None = None, scale: float = 1.0,
                             temperature: float = 1.0) -> float:
  """SeqIO's rate: the number of train examples, scaled, clipped, tempered."""
  rate = task.num_input_examples("train") * scale
  if maximum:
    rate = min(rate, maximum)
  if temperature != 1.0:
    rate = rate ** (1.0 / temperature)
  return rate


# -------------------------------------------------------------------------------------- registries


class _Registry:
  _items: dict[str, Any]
  _kind = ""

  @classmethod
  def names(cls) -> list[str]:
    return sorted(cls._items)

  @classmethod
  def remove(cls, name: str) -> None:
    cls._items.pop(name, None)

  @classmethod
  def _add(cls, name: str, item: Any, overwrite: bool = False) -> Any:
    if name in TaskRegistry._items or name in MixtureRegistry._items:  # noqa: SLF001 (this module's registry)
      if not overwrite:
        raise UserError(f"a task or mixture named {name!r} is already registered; pick another "
                        "name (or pass overwrite=True)")
      TaskRegistry._items.pop(name, None)  # noqa: SLF001 (this module's registry)
      MixtureRegistry._items.pop(name, None)  # noqa: SLF001 (this module's registry)
    cls._items[name] = item
    return item

  @classmethod
  def get(cls, name: str):
    if name not in cls._items:
      raise _unknown(name, cls._kind, cls.names())
    return cls._items[name]


class TaskRegistry(_Registry):
  _items: dict[str, Task] = {}
  _kind = "task"

  @classmethod
  def add(cls, name: str, source: src.DataSource, preprocessors: Sequence[Any] = (),
          output_features: Mapping[str, Feature] | None = None,
          postprocess_fn: Callable | None = None, metric_fns: Sequence[Callable] = (), *,
          cache: bool = False, cache_dir: str | None = None, overwrite: bool = False,
          task_cls: type = Task) -> Task:
    task = task_cls(name, source, preprocessors, output_features, postprocess_fn, metric_fns,
                    cache=cache, cache_dir=cache_dir)
    return cls._add(name, task, overwrite)


class MixtureRegistry(_Registry):
  _items: dict[str, Mixture] = {}
  _kind = "mixture"

  @classmethod
  def add(cls, name: str, tasks: Sequence[Any], default_rate: float | Callable | None = None, *,
          overwrite: bool = False) -> Mixture:
    return cls._add(name, Mixture(name, tasks, default_rate), overwrite)


def _unknown(name: str, kind: str, candidates: Sequence[str]) -> UserError:
  close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
  if len(close) == 1:
    hint = f"; did you mean {close[0]!r}?"
  elif close:
    hint = f"; did you mean one of {', '.join(repr(c) for c in close)}?"
  else:
    hint = ""
  listing = "" if close else f"; registered: {', '.join(sorted(candidates)) or 'none'}"
  return UserError(f"unknown {kind} {name!r}{hint}{listing}. Your own tasks are registered "
                   "when their module is imported: pass --module tasks (CLI), set "
                   "MIXTURE_OR_TASK_MODULE = 'tasks' or add `import tasks` to the gin file, with "
                   "its directory on PYTHONPATH")


def import_task_module(name: str, *, flag: str = "--module") -> None:
  """Imports the module that registers a user's tasks (a T5X `tasks.py`).

  The working directory is searched after sys.path, as `python -m` does, so that
  `--module tasks` finds ./tasks.py under the `t5forge` console script too.

  Raises:
    UserError: the module cannot be imported (one line: which, why, and PYTHONPATH).
  """
  cwd = os.getcwd()
  if cwd not in sys.path and "" not in sys.path:
    sys.path.append(cwd)
  try:
    importlib.import_module(name)
  except ModuleNotFoundError as e:
    missing = e.name or ""
    if name == missing or name.startswith(missing + "."):
      raise UserError(f"{flag} {name}: no module {missing!r} found; put the directory that holds "
                      f"{name.replace('.', '/')}.py on PYTHONPATH (PYTHONPATH=/path/to/dir "
                      "t5forge ...) or pass it with --gin_search_paths") from None
    hint = (" (SeqIO names live in t5forge.data: `from t5forge import data as seqio`, see "
            "t5forge/data/README.md)" if missing.split(".")[0] in ("seqio", "t5", "tensorflow")
            else "; install it")
    raise UserError(f"{flag} {name}: it imports {missing!r}, which is not installed{hint}") from None
  except (ImportError, SyntaxError) as e:
    where = f" ({e.filename}:{e.lineno})" if isinstance(e, SyntaxError) else ""
    raise UserError(f"{flag} {name}: importing it failed{where}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
  except AttributeError as e:  # a ported tasks.py naming a metric or preprocessor we lack
    raise UserError(f"{flag} {name}: {unknown_name_message(e)}") from None


def unknown_name_message(e: AttributeError) -> str:
  """One line for `module.name` missing while a user's module ran: where (file:line of the
  user's code), which name, the closest names the module has, and where the list is.

  A ported `tasks.py` that calls e.g. `t5.evaluation.metrics.glue_f1` as
  `t5forge.metrics.glue_f1` ends here instead of in a traceback."""
  frames = traceback.extract_tb(e.__traceback__)
  user = [f for f in frames if "site-packages" not in f.filename
          and os.sep + "t5forge" + os.sep not in f.filename and not f.filename.startswith("<")]
  where = f"{user[-1].filename}:{user[-1].lineno}: " if user else ""
  owner, missing = getattr(e, "obj", None), getattr(e, "name", None)
  m = re.match(r"module '([\w.]+)' has no attribute '(\w+)'", str(e))
  if (owner is None or missing is None) and m:  # re-raised (gin) without .obj / .name
    owner, missing = sys.modules.get(m.group(1)), m.group(2)
  if owner is None or missing is None:
    return f"{where}{str(e).splitlines()[0] if str(e) else type(e).__name__}"
  label = getattr(owner, "__name__", type(owner).__name__)
  public = [n for n in dir(owner) if not n.startswith("_")]
  close = difflib.get_close_matches(missing, public, n=3, cutoff=0.5)
  hint = (f"; did you mean {', '.join(close)}?" if close else
          f"; it has: {', '.join(public[:40])}{' ...' if len(public) > 40 else ''}")
  return (f"{where}{label} has no {missing!r}{hint} (T5/SeqIO names that t5forge provides: "
          "t5forge/data/README.md)")


def get_mixture_or_task(name: str) -> Task | Mixture:
  """The registered task or mixture called `name` (UserError with suggestions if none)."""
  if name in MixtureRegistry._items:  # noqa: SLF001 (this module's registry)
    return MixtureRegistry._items[name]  # noqa: SLF001 (this module's registry)
  if name in TaskRegistry._items:  # noqa: SLF001 (this module's registry)
    return TaskRegistry._items[name]  # noqa: SLF001 (this module's registry)
  raise _unknown(name, "task or mixture", TaskRegistry.names() + MixtureRegistry.names())


def get_dataset(mixture_or_task_name: str, split: str,
                task_feature_lengths: Mapping[str, int | None] | None, *, shuffle: bool = True,
                seed: int | None = 0, shard_index: int = 0, num_shards: int = 1,
                num_epochs: int | None = 1, shard_info: ShardInfo | None = None,
                use_cached: bool = False):
  """Task-feature examples of a task or mixture; see `Task.get_dataset`."""
  item = get_mixture_or_task(mixture_or_task_name)
  return item.get_dataset(task_feature_lengths, split, use_cached, shuffle=shuffle, seed=seed,
                          shard_index=shard_index, num_shards=num_shards, num_epochs=num_epochs,
                          shard_info=shard_info)


def get_vocabulary(mixture_or_task_name: str) -> tuple[Vocabulary, Vocabulary]:
  """(inputs vocabulary, targets vocabulary) of a task or mixture, as T5X's `get_vocabulary`.

  A task without an `inputs` feature (decoder-only) returns the targets vocabulary twice.
  """
  features = get_mixture_or_task(mixture_or_task_name).output_features
  if "targets" not in features:
    raise UserError(f"{mixture_or_task_name!r} has no 'targets' output feature")
  targets = features["targets"].vocabulary
  return (features["inputs"].vocabulary if "inputs" in features else targets), targets


def with_vocabulary(mixture_or_task_name: str, vocabulary: Vocabulary | None) -> str:
  """The name of a registered copy of a task (or mixture) whose output features all use
  `vocabulary`; e.g. to fine-tune a checkpoint on a task with the checkpoint's own
  vocabulary. In gin (configs/examples/finetune_from_hf.gin):

      MIXTURE_OR_TASK_NAME = @data.with_vocabulary()
      data.with_vocabulary.mixture_or_task_name = 'bible_translate_en_es'
      data.with_vocabulary.vocabulary = @vocab_io.from_checkpoint()

  The copy is named `<name>.vocab_<8 hex digits of the vocabulary>` and registered once
  (the same call returns the same name); source, preprocessors, postprocessing and
  metrics are the task's. A cached task's copy has its own cache: the cache key holds
  the vocabulary. With `vocabulary` None (a checkpoint that stores none), or the task's
  own vocabulary, the name is returned unchanged.
  """
  item = get_mixture_or_task(mixture_or_task_name)
  tasks = item.tasks if isinstance(item, Mixture) else [item]
  if vocabulary is None or all(vocab_io.difference(f.vocabulary, vocabulary) is None
                               for t in tasks for f in t.output_features.values()):
    return mixture_or_task_name
  if not isinstance(vocabulary, Vocabulary):
    raise UserError(f"with_vocabulary({mixture_or_task_name!r}, ...): vocabulary must be a "
                    f"t5forge.data Vocabulary, got {type(vocabulary).__name__}")
  suffix = ".vocab_" + hashlib.md5(vocabulary.fingerprint().encode()).hexdigest()[:8]
  if isinstance(item, Mixture):
    name = mixture_or_task_name + suffix
    if name not in MixtureRegistry._items:  # noqa: SLF001 (this module's registry)
      MixtureRegistry.add(name, [(_task_copy(t, vocabulary, suffix), rate)
                                 for t, rate in item.tasks_and_rates])
    return name
  return _task_copy(item, vocabulary, suffix)


def _task_copy(task: Task, vocabulary: Vocabulary, suffix: str) -> str:
  """Registers (once) `task` with `vocabulary` in every output feature as name+suffix."""
  return task.register_copy(task.name + suffix, output_features={
      k: dataclasses.replace(f, vocabulary=vocabulary) for k, f in task.output_features.items()})
