"""`t5forge cache_tasks`: writes SeqIO caches on Apache Beam, as `seqio_cache_tasks` does.

A task's preprocessors up to its `CacheDatasetPlaceholder` run once, as a Beam pipeline
(DirectRunner by default; any runner through `pipeline_options`), and what they yield is
kept where `use_cached=True` (T5X's `USE_CACHED_TASKS = True`) and SeqIO itself read it:

    DIR/<task, ':' as '/'>/<split>.tfrecord-0000k-of-0000n   tf.train.Example shards
    DIR/<task>/info.<split>.json     {"features": {name: {"dtype", "shape"}}, "num_shards",
                                      "seqio_version"}
    DIR/<task>/stats.<split>.json    {"examples", "<feature>_tokens", "<feature>_max_tokens"}
    DIR/<task>/COMPLETED             "tfrecord", written last

The pipeline is SeqIO's (`seqio/scripts/cache_tasks_main.py`, `seqio/beam_utils.py`): one
element per input shard of a split (a file of the source: `SplitSource.shards`), each
preprocessed apart with its own seed, then shuffled globally and written as
max(input shards, min_shards) output shards (at most max_shards). Seeds as SeqIO derives
them: a task seed md5(task name) + base_seed (none without base_seed), and per shard
md5(task name + "shard<i>") + the task seed, so the same base_seed gives the same cache.

A local cache is written in a hidden directory beside its final place and renamed into
place whole, COMPLETED inside: a crash leaves no directory that looks like a cache. In a
bucket (no renames there) it is written in place with COMPLETED last, as SeqIO does, and
removed if the run fails.

This module, and only it, needs Apache Beam (`pip install 't5forge[beam]'`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from t5forge import storage
from t5forge.data import preprocessors as pre
from t5forge.data import seqio_cache, tasks, tf_example
from t5forge.errors import UserError

log = logging.getLogger(__name__)

# What SeqIO's COMPLETED file holds (the shards' format), and the SeqIO version whose
# cache layout this writes (info.json's "seqio_version").
COMPLETED_CONTENTS = "tfrecord"
SEQIO_VERSION = "0.0.20"
_INT64_MAX = 2**63 - 1


# ----------------------------------------------------------------------------------- seeds


def _md5_int(text: str, nbytes: int = 16) -> int:
  return int.from_bytes(hashlib.md5(text.encode()).digest()[:nbytes], "little")


def task_seed(task_name: str, base_seed: int | None) -> int | None:
  """SeqIO's per-task preprocessors seed: md5(name) (little-endian) + base_seed; None
  without a base seed (None, 0 or -1)."""
  if not base_seed or base_seed == -1:
    return None
  return _md5_int(task_name) + base_seed


def shard_seed(task_name: str, shard_index: int, task_seed_: int | None) -> int:
  """SeqIO's seed of one input shard: md5(name + "shard<i>") + the task seed, below 2**63-1
  (when the sum is larger, md5's first 7 bytes replace its 16, then the sum is reduced)."""
  key = f"{task_name}shard{shard_index}"
  seed = _md5_int(key) + (task_seed_ or 0)
  if seed > _INT64_MAX:
    seed = _md5_int(key, 7) + (task_seed_ or 0)
  return seed % _INT64_MAX


# -------------------------------------------------------------------------------- features


def _python_dtype(values: Sequence[Any]) -> str:
  """The dtype `tf.constant` gives Python values: int32 (int64 if one does not fit),
  float32, bool, string."""
  if values and all(isinstance(v, (str, bytes)) for v in values):
    return "string"
  if values and all(isinstance(v, (bool, np.bool_)) for v in values):
    return "bool"
  if values and all(isinstance(v, (int, np.integer)) for v in values):
    fits = all(-2**31 <= int(v) < 2**31 for v in values)
    return "int32" if fits else "int64"
  return "float32"


def _dtype_name(value: Any) -> str:
  """The dtype name SeqIO's info.json gives a value: a numpy array's or scalar's own (any
  text: "string"), else what `tf.constant` makes of the Python values."""
  if isinstance(value, (np.ndarray, np.generic)):
    dtype = np.asarray(value).dtype
    return "string" if dtype.kind in "USO" else dtype.name
  values = list(np.asarray(value, dtype=object).reshape(-1))
  if values and all(isinstance(v, np.generic) for v in values):
    return _dtype_name(np.asarray(values))
  return _python_dtype(values)


def feature_info(value: Any) -> dict[str, Any]:
  """A feature's entry in info.json as SeqIO's `GetInfo` writes it: the dtype name and
  the shape with the first dimension None ([] for a scalar, [None] for a sequence,
  [None, None] for a ragged list of lists)."""
  ragged = tf_example.nested_rows(value)
  if ragged is not None:
    flat, lengths = ragged
    return {"dtype": _dtype_name(flat), "shape": [None] * (len(lengths) + 1)}
  shape = list(np.shape(value)) if not isinstance(value, (str, bytes)) else []
  return {"dtype": _dtype_name(value), "shape": [None] + shape[1:] if shape else []}


def info_dict(examples: Sequence[Mapping[str, Any]], num_shards: int) -> dict[str, Any]:
  """info.<split>.json from one example of the split (SeqIO samples one); {} if none."""
  if not examples:
    return {}
  return {"features": {k: feature_info(v) for k, v in examples[0].items()},
          "num_shards": num_shards, "seqio_version": SEQIO_VERSION}


def to_json(value: Any) -> str:
  """As SeqIO's `WriteJson`: sorted keys, two-space indent (WriteToText adds the newline)."""
  return json.dumps(value, sort_keys=True, indent=2)


class TokenStats(beam.CombineFn):
  """stats.<split>.json as SeqIO's `GetStats`: the example count, and per output feature
  held as an integer array the tokens that are neither EOS nor PAD, summed and at most.

  Args:
    special_ids: output feature -> (eos id or None, pad id or None).
  """

  def __init__(self, special_ids: Mapping[str, tuple[int | None, int | None]]):
    self._special = dict(special_ids)

  def create_accumulator(self):
    return [0, {}, {}]  # examples, feature -> token sum, feature -> token max

  def add_input(self, acc, ex):
    acc[0] += 1
    for name, (eos, pad) in self._special.items():
      v = ex.get(name)
      if v is None or isinstance(v, (str, bytes)):
        continue
      v = np.asarray(v)
      if v.ndim < 1 or v.dtype.kind not in "iu":
        continue
      valid = np.ones(v.shape, bool)
      for special in (eos, pad):
        if special is not None:
          valid &= v != special
      n = int(valid.sum())
      acc[1][name] = acc[1].get(name, 0) + n
      acc[2][name] = max(acc[2].get(name, n), n)
    return acc

  def merge_accumulators(self, accs):
    out = self.create_accumulator()
    for n, sums, maxes in accs:
      out[0] += n
      for k, s in sums.items():
        out[1][k] = out[1].get(k, 0) + s
      for k, m in maxes.items():
        out[2][k] = max(out[2].get(k, m), m)
    return out

  def extract_output(self, acc):
    stats = {"examples": acc[0]}
    stats.update({f"{k}_tokens": s for k, s in acc[1].items()})
    stats.update({f"{k}_max_tokens": m for k, m in acc[2].items()})
    return stats


# ---------------------------------------------------------------------------- preprocessing


def import_modules(modules: Sequence[str]) -> None:
  """Imports the modules that register tasks (`--module_import`), on the driver and on
  every worker (a worker process starts with an empty registry)."""
  for m in modules:
    if m:
      tasks.import_task_module(m, flag="--module_import")


def preprocess_shard(task: tasks.Task, split: str, start: int, stop: int,
                     seed: int) -> Iterator[dict[str, Any]]:
  """Runs the task's preprocessors before its CacheDatasetPlaceholder over examples
  [start, stop) of a split. A preprocessor's `rng` is seeded by `seed` and its position
  (and for a per-example step, the example's position in the shard), so a cached random
  step is the same on every run with the same seed."""
  source = task.source.get(split)
  ctx = {"sequence_length": None, "output_features": task.output_features}
  it: Iterator[dict] = (source[i] for i in range(start, stop))
  for step, p in enumerate(task.precache_preprocessors()):
    kind = pre.kind_of(p)
    if kind == "stream":
      it = p(it, **pre.call_kwargs(p, dict(ctx, rng=np.random.default_rng([seed, step]))))
    else:
      it = tasks.map_examples(p, it, step, ctx, flat=(kind == "flat_map"), seed=seed)
  return it


class _PreprocessShards(beam.DoFn):
  """(shard index, (start, stop)) -> the shard's preprocessed examples. Holds names,
  not the task: a worker imports the modules and looks the task up itself."""

  def __init__(self, task_name: str, split: str, modules: Sequence[str], seed: int | None):
    self._task_name = task_name
    self._split = split
    self._modules = list(modules)
    self._seed = seed

  def setup(self):
    if self._task_name not in tasks.TaskRegistry.names():
      import_modules(self._modules)
    self._task = tasks.TaskRegistry.get(self._task_name)
    self._examples = beam.metrics.Metrics.counter(f"{self._task_name}_{self._split}",
                                                  "examples")

  def process(self, shard):
    index, (start, stop) = shard
    seed = shard_seed(self._task_name, index, self._seed)
    for ex in preprocess_shard(self._task, self._split, start, stop, seed):
      self._examples.inc()
      yield ex


# -------------------------------------------------------------------------------- selection


def select_tasks(patterns: Sequence[str], excluded: Sequence[str] = ()) -> list[tasks.Task]:
  """The registered tasks to cache, as SeqIO selects them: every name that one of
  `patterns` matches in full (all tasks if none given) and no `excluded` pattern matches;
  of these, those with a CacheDatasetPlaceholder (others are skipped, as SeqIO does, unless
  named exactly).

  Raises:
    UserError: a pattern matches no task, a task named exactly cannot be cached, or no
      selected task can be.
  """
  names = tasks.TaskRegistry.names()
  try:
    compiled = [(p, re.compile(p)) for p in patterns] or [(".*", re.compile(".*"))]
    drop = [re.compile(p) for p in excluded]
  except re.error as e:
    raise UserError(f"--tasks/--excluded_tasks: {e.pattern!r} is not a valid regular "
                    f"expression ({e}); give task names or Python regexes") from None
  chosen = []
  for text, rx in compiled:
    hits = [n for n in names if rx.fullmatch(n)]
    if not hits:
      if re.escape(text) == text:  # a plain name: the registry's message, with suggestions
        tasks.TaskRegistry.get(text)
      raise UserError(f"--tasks {text!r} matches no registered task (registered: "
                      f"{', '.join(names) or 'none'}); register tasks with --module_import")
    chosen += [n for n in hits if n not in chosen]
  chosen = [n for n in chosen if not any(rx.fullmatch(n) for rx in drop)]
  out = []
  for name in chosen:
    task = tasks.TaskRegistry.get(name)
    try:
      task.precache_preprocessors()
    except UserError:
      if name in patterns:
        raise
      log.info("skipping task %r: it has no CacheDatasetPlaceholder", name)
      continue
    out.append(task)
  if not out:
    raise UserError(f"--tasks {','.join(patterns) or '.*'}: none of the selected tasks "
                    f"({', '.join(chosen) or 'none, after --excluded_tasks'}) has a "
                    "CacheDatasetPlaceholder; nothing to cache")
  return out


def num_output_shards(input_shards: int, min_shards: int, max_shards: int) -> int:
  """SeqIO's count: max(input shards, min_shards) (min_shards <= 0: the input's), at most
  max_shards when that is > 0."""
  n = max(input_shards, min_shards) if min_shards > 0 else input_shards
  return min(n, max_shards) if max_shards > 0 else n


# -------------------------------------------------------------------------------- pipeline


def pipeline_options(text: str) -> PipelineOptions:
  """Beam's options from a string of Beam flags: space-separated as on a command line, or
  comma-separated as SeqIO's `--pipeline_options` list ("--runner=X,--flag=Y").

  Raises:
    UserError: an unknown runner or option.
  """
  argv = [part for token in shlex.split(text or "") for part in re.split(r",(?=--)", token)]
  options = PipelineOptions(argv)
  # Beam drops a flag it does not know with a warning; a typo would then change nothing.
  unknown = sorted(set(options.get_all_options(retain_unknown_options=True))
                   - set(options.get_all_options()))
  if unknown:
    raise UserError(f"--pipeline_options: Beam has no option {', '.join('--' + u for u in unknown)}"
                    "; check the spelling against the runner's pipeline options")
  runner = options.view_as(StandardOptions).runner
  if runner:
    from apache_beam.runners import create_runner  # noqa: PLC0415 (only to check the name)
    try:
      create_runner(runner)
    except (ValueError, ImportError) as e:
      raise UserError(f"--pipeline_options: unknown Beam runner {runner!r} "
                      f"({str(e).splitlines()[0][:200]}); use e.g. --runner=DirectRunner, "
                      "DataflowRunner, FlinkRunner or SparkRunner") from None
  return options


def _target(output_cache_dir: str, task_name: str) -> tuple[str, str] | None:
  """(final directory, directory to write in) for a task's cache; None if a complete cache
  is there already. Locally the second is an empty staging directory beside the first; in
  a bucket it is the first (object stores cannot rename a directory: COMPLETED is last).

  Raises:
    UserError: an incomplete cache is there, or the directory cannot be written.
  """
  final = storage.join(output_cache_dir, seqio_cache.task_dir(task_name))
  if storage.isfile(storage.join(final, "COMPLETED")):
    return None
  if storage.isdir(final) or storage.isfile(final):
    raise UserError(f"{final}: an incomplete cache of task {task_name!r} is there (no "
                    "COMPLETED: an earlier run did not finish, or another program wrote it); "
                    "remove that directory and run cache_tasks again")
  if storage.is_remote(final):
    storage.check_bucket(final)
    return final, final
  parent = os.path.dirname(final)
  try:
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.incomplete-", dir=parent)
  except OSError as e:
    raise UserError(f"--output_cache_dir {output_cache_dir}: cannot write there "
                    f"({e.strerror or e}); pass a directory you can write") from None
  return final, staging


def _finish(final: str, written: str) -> None:
  """COMPLETED last; locally, then the whole directory appears at once."""
  if written == final:
    storage.write_bytes(storage.join(written, "COMPLETED"), COMPLETED_CONTENTS.encode())
    return
  with open(os.path.join(written, "COMPLETED"), "w") as f:
    f.write(COMPLETED_CONTENTS)
  os.chmod(written, 0o755)  # mkdtemp made it private
  os.rename(written, final)


def _discard(written: str) -> None:
  """Removes what a failed run wrote of a cache (best effort: the failure is reported)."""
  try:
    if storage.is_remote(written):
      if storage.isdir(written):
        storage.rmtree(written)
    elif os.path.isdir(written):
      shutil.rmtree(written, ignore_errors=True)
  except Exception:  # the run's own error, raised after this, matters more
    log.warning("could not remove the partial cache %s; remove it before running again",
                written, exc_info=True)


def cache_tasks(task_patterns: Sequence[str], output_cache_dir: str, *,
                excluded_tasks: Sequence[str] = (), modules: Sequence[str] = (),
                min_shards: int = 64, max_shards: int = 0, base_seed: int | None = None,
                options: str = "--runner=DirectRunner") -> dict[str, str]:
  """Writes the SeqIO cache of every selected task (see the module docstring).

  Args:
    task_patterns: task names or regexes (SeqIO's --tasks); empty: every task.
    output_cache_dir: a directory every Beam worker reaches at the same path (a local
      disk, a shared mount) or a bucket (gs://, s3://) the workers can write.
    excluded_tasks: regexes of tasks to skip.
    modules: modules that register the tasks, imported here and on every worker.
    min_shards / max_shards: bounds on the output shards of a split (0: none).
    base_seed: seeds the preprocessors reproducibly (None or -1: SeqIO's default seeds).
    options: Beam flags (`pipeline_options`).

  Returns:
    task name -> its cache directory, for the tasks written (a task with a complete cache
    in output_cache_dir already is skipped, as SeqIO does without --overwrite).
  """
  if min_shards < 0 or max_shards < 0:
    raise UserError(f"--min_shards {min_shards} / --max_shards {max_shards}: must be >= 0 "
                    "(0: no bound)")
  beam_options = pipeline_options(options)
  import_modules(modules)
  selected = select_tasks(task_patterns, excluded_tasks)
  if not storage.is_remote(output_cache_dir):
    output_cache_dir = os.path.abspath(os.path.expanduser(output_cache_dir))
  targets: dict[str, tuple[str, str]] = {}
  done: set[str] = set()
  try:
    p = beam.Pipeline(options=beam_options)
    for task in selected:
      where = _target(output_cache_dir, task.name)
      if where is None:
        log.info("skipping task %r: its cache in %s is complete", task.name, output_cache_dir)
        continue
      targets[task.name] = where
      _add_task(p, task, where[1], modules, min_shards, max_shards, base_seed)
    if targets:
      state = p.run().wait_until_finish()
      if state != beam.runners.runner.PipelineState.DONE:
        raise UserError(f"the Beam pipeline ended in state {state}; nothing was cached "
                        "(see the runner's log)")
    for name, (final, written) in targets.items():
      _finish(final, written)
      done.add(name)
  finally:
    for name, (_, written) in targets.items():
      if name not in done:
        _discard(written)
  return {name: final for name, (final, _) in targets.items()}


def _add_task(p, task: tasks.Task, directory: str, modules: Sequence[str], min_shards: int,
              max_shards: int, base_seed: int | None) -> None:
  seed = task_seed(task.name, base_seed)
  special = {k: (f.vocabulary.eos_id, f.vocabulary.pad_id)
             for k, f in task.output_features.items()}
  for split in task.splits:
    shards = task.source.get(split).shards()
    n = num_output_shards(len(shards), min_shards, max_shards)
    label = f"{task.name}_{split}"
    examples = (
        p
        | f"{label}_shards" >> beam.Create(list(enumerate(shards)))
        # One shard a worker: keep the shards apart, not fused into the Create.
        | f"{label}_spread" >> beam.Reshuffle()
        | f"{label}_preprocess" >> beam.ParDo(_PreprocessShards(task.name, split, modules,
                                                                 seed))
        # A global shuffle of the examples: each output shard holds a random part of all.
        | f"{label}_shuffle" >> beam.Reshuffle())
    _ = (examples
         | f"{label}_encode" >> beam.Map(tf_example.encode)
         | f"{label}_write" >> beam.io.WriteToTFRecord(
             storage.join(directory, f"{split}.tfrecord"), num_shards=n))
    _ = (examples
         | f"{label}_sample" >> beam.combiners.Sample.FixedSizeGlobally(1)
         | f"{label}_info" >> beam.Map(lambda ex, n=n: to_json(info_dict(ex, n)))
         | f"{label}_write_info" >> beam.io.WriteToText(
             storage.join(directory, f"info.{split}.json"), num_shards=1,
             shard_name_template=""))
    _ = (examples
         | f"{label}_stats" >> beam.CombineGlobally(TokenStats(special))
         | f"{label}_json" >> beam.Map(to_json)
         | f"{label}_write_stats" >> beam.io.WriteToText(
             storage.join(directory, f"stats.{split}.json"), num_shards=1,
             shard_name_template=""))
