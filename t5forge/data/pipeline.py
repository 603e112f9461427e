"""Training and evaluation batches on Grain.

Training (`get_batches`): task examples (a Grain `MapDataset` from
`tasks.get_dataset`: globally shuffled per epoch by seed, repeated, sharded
`shard_index::num_shards`) -> packed or padded rows by a feature converter ->
batches of `batch_size` rows, numpy int32 `[batch, length]`.

    it = get_batches("bible_translate_en_es", task_feature_lengths={"inputs": 512, "targets": 114},
                     batch_size=32, model_kind="encoder_decoder", seed=0)
    batch = next(it)          # {"encoder_input_tokens": int32[32, 512], ...}
    state = it.get_state()    # a small JSON-serialisable dict; store it in the checkpoint
    it.set_state(state)       # (also in a fresh process) the next batch is the one after `state`

Packing happens in windows of max(lengths) consecutive examples (SeqIO's rule),
so the iterator state is just "the data position where the current window starts
and how many of its rows were emitted": restoring re-packs that one window.

Evaluation (`get_eval_dataset`): one task's split in order, unshuffled, unpacked,
sharded the same way, the last batch padded with all-zero rows; each batch says
which rows are real (`example_mask`) and which example each row is
(`example_index`, -1 for padding), and `EvalDataset.examples[i]` keeps the
`*_pretokenized` text of example i.
"""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from t5forge import files
from t5forge.data import converters as conv
from t5forge.data import tasks as tasks_lib
from t5forge.errors import UserError

Batch = dict[str, np.ndarray]


class _ConvertIterDataset(grain.IterDataset):
  """Rows of model features from an IterDataset of task examples."""

  def __init__(self, parent, converter: conv.FeatureConverter, lengths: Mapping[str, int]):
    super().__init__(parent)
    self._converter = converter
    self._lengths = dict(lengths)

  def __iter__(self):
    return _ConvertIterator(self._parent.__iter__(), self._converter, self._lengths)

  def __str__(self):
    return f"ConvertIterDataset({self._converter!r})"


class _ConvertIterator(grain.DatasetIterator):
  """Packs/pads windows of examples into model-feature rows; checkpointable.

  State: {"parent": the parent's state where the current window starts,
  "emitted": rows of that window already returned}.
  """

  def __init__(self, parent, converter: conv.FeatureConverter, lengths: Mapping[str, int]):
    super().__init__(parent)
    self._converter = converter
    self._lengths = dict(lengths)
    self._window = converter.window_size(lengths)
    self._window_state = parent.get_state()
    self._rows: list[dict] = []
    self._emitted = 0

  def _fill(self) -> bool:
    """Reads and converts the next window; False at the end of the data."""
    self._window_state = copy.deepcopy(self._parent.get_state())
    examples = []
    for ex in self._parent:
      examples.append(ex)
      if len(examples) == self._window:
        break
    self._rows = self._converter.convert_window(examples, self._lengths) if examples else []
    self._emitted = 0
    return bool(self._rows)

  def __next__(self) -> dict:
    if self._emitted >= len(self._rows) and not self._fill():
      raise StopIteration
    row = self._rows[self._emitted]
    self._emitted += 1
    return row

  def get_state(self) -> dict[str, Any]:
    if self._emitted >= len(self._rows):
      # Between windows: the next row starts a fresh window at the parent's position.
      return {"parent": self._parent.get_state(), "emitted": 0}
    return {"parent": self._window_state, "emitted": self._emitted}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._rows, self._emitted = [], 0
    if state["emitted"]:
      if not self._fill() or state["emitted"] > len(self._rows):
        raise UserError("data iterator state does not match this data (window has fewer rows "
                        "than the state says); was it saved with other lengths, seed or task?")
      self._emitted = state["emitted"]


# ------------------------------------------------------------------------------- training iterator


class DataIterator:
  """Batches of model features with a JSON-serialisable position.

  Iterating yields dicts of numpy int32 arrays `[batch_size, length]` with the
  keys of `model_feature_lengths`.
  """

  def __init__(self, dataset, model_feature_lengths: Mapping[str, int],
               description: Mapping[str, Any], copy_batches: bool = False):
    self._dataset = dataset
    self._iter = iter(dataset)
    self._copy = copy_batches
    self.model_feature_lengths = dict(model_feature_lengths)
    self._description = dict(description)

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    batch = next(self._iter)
    if self._copy:
      # Grain's workers hand over shared-memory arrays whose lifetime is tied
      # to Grain's bookkeeping; plain copies are safe to keep (e.g. across the
      # end of the program).
      batch = {k: np.array(v) for k, v in batch.items()}
    return batch

  def get_state(self) -> dict[str, Any]:
    """The position after the last returned batch (JSON-serialisable)."""
    # latin-1 maps each byte to one character and back, so raw bytes in grain's state survive.
    return {"version": 1, "pipeline": self._description,
            "grain": files.jsonable(self._iter.get_state(), bytes_encoding="latin-1")}

  def set_state(self, state: Mapping[str, Any], *, allow_changed_data: bool = False) -> None:
    """Continues from `state` (from `get_state`, possibly of another process).

    Args:
      state: what `get_state` returned.
      allow_changed_data: continue at the saved position even when a task's data is not
        the data the state was saved with (its content fingerprint differs): the next
        example is then example N of other data.

    Raises:
      UserError: the state is of another pipeline, or of other data (naming the task and
        split; unless `allow_changed_data`).
    """
    if not isinstance(state, Mapping) or state.get("version") != 1 or "grain" not in state:
      raise UserError("not a t5forge data iterator state (expected the dict that "
                      "DataIterator.get_state returns)")
    saved = dict(state.get("pipeline", {}))
    saved.setdefault("use_cached", False)  # states saved before these keys existed
    saved_data = saved.pop("data", None)
    current = dict(self._description)
    current_data = current.pop("data", None)
    if saved == current and saved_data is not None and saved_data != current_data:
      changed = sorted(k for k in set(saved_data) | set(current_data or {})
                       if saved_data.get(k) != (current_data or {}).get(k))
      if not allow_changed_data:
        raise UserError(
            f"the data of {', '.join(changed)} is not the data this run's checkpoint was saved "
            "with (its content changed since); resuming would continue at the saved example "
            "number of other data. Restore that data, start a new MODEL_DIR, or continue "
            "anyway with --gin.train/utils.DatasetConfig.allow_changed_data=True")
      logging.getLogger(__name__).warning(
          "continuing at the saved position although the data of %s changed "
          "(allow_changed_data=True)", ", ".join(changed))
    if saved != current:
      diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
      raise UserError(f"data iterator state was saved for a different pipeline (differs in: "
                      f"{', '.join(diff)}); resume with the same task, lengths, batch size, seed "
                      "and sharding")
    self._iter.set_state(state["grain"])

  def close(self) -> None:
    """Stops Grain's workers and threads (also done when the iterator is collected)."""
    it, self._iter = getattr(self, "_iter", None), None
    if it is not None and hasattr(it, "close"):
      it.close()
    # Drop the pipeline now, while the interpreter is intact: Grain's iterators
    # clean up in __del__ and fail noisily when that runs during shutdown.
    del it
    self._dataset = None

  def __del__(self):
    self.close()


def get_batches(mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
                batch_size: int, *, split: str = "train", model_kind: str = "encoder_decoder",
                feature_converter: conv.FeatureConverter | None = None, pack: bool = True,
                packer: str = "first_fit", shuffle: bool = True, seed: int | None = 0,
                shard_index: int = 0, num_shards: int = 1, num_epochs: int | None = None,
                drop_remainder: bool = True, num_workers: int = 0,
                read_threads: int = 0, bos_id: int = 0,
                use_cached: bool = False) -> DataIterator:
  """Training batches for this process.

  Args:
    mixture_or_task_name: a registered task or mixture.
    task_feature_lengths: e.g. {"inputs": 512, "targets": 114}.
    batch_size: rows per batch for this process (global batch / num_shards).
    split: the source split.
    model_kind: 'encoder_decoder' | 'decoder_only' | 'prefix_lm' (ignored when
      `feature_converter` is given).
    feature_converter: a converter instance, e.g. PrefixLMFeatureConverter(
      loss_on_targets_only=False).
    pack / packer: pack several examples per row; 'first_fit' (dense, default)
      or 'greedy' (SeqIO's default tf-ops packer, exactly).
    shuffle / seed: global shuffle per epoch and per-example randomness.
    shard_index / num_shards: this process's share (e.g. jax.process_index(),
      jax.process_count()); shards are disjoint and cover every epoch.
    num_epochs: None repeats forever.
    drop_remainder: drop a last partial batch (only reached with finite epochs).
    num_workers: Grain worker processes (0: everything in this process). Each
      worker packs its own slice of the example stream, so the row order depends
      on this number; resume with the same value.
    read_threads: Grain threads preprocessing examples (0: none; preprocessing
      is mostly GIL-bound, so threads rarely help on small machines).
    bos_id: the first decoder input token (SeqIO's converters' `bos_id`): 0 for T5
      (the pad id), 2 for T5Gemma; ignored when `feature_converter` is given.
    use_cached: read each task's SeqIO cache (`Task.get_dataset`).

  Returns:
    A `DataIterator`; `get_state()`/`set_state()` resume exactly. Its state records
    the content fingerprint of every task's split, so that resuming on changed data is
    refused.
  """
  if batch_size < 1:
    raise UserError(f"batch_size must be >= 1, got {batch_size}")
  seed = 0 if seed is None else seed
  converter = feature_converter or conv.get_converter(model_kind, pack=pack, packer=packer,
                                                      bos_id=bos_id)
  lengths = converter.check_lengths(task_feature_lengths)
  examples = tasks_lib.get_dataset(
      mixture_or_task_name, split, dict(task_feature_lengths), shuffle=shuffle, seed=seed,
      shard_index=shard_index, num_shards=num_shards, num_epochs=num_epochs,
      use_cached=use_cached)
  read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(64, 4 * read_threads))
  ds = _ConvertIterDataset(examples.to_iter_dataset(read), converter, lengths)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder)
  if num_workers > 0:
    from absl import flags  # noqa: PLC0415 (slow import, on first use)
    if not flags.FLAGS.is_parsed():
      # Grain's workers read absl flags; a program that never parsed them (any
      # non-absl CLI) would fail on the first batch.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  # Saved with the state: resuming a different pipeline from it would be silently wrong.
  description = {"task": mixture_or_task_name, "split": split,
                 "lengths": dict(sorted(lengths.items())), "batch_size": batch_size,
                 "converter": repr(converter), "shuffle": shuffle, "seed": seed,
                 "shard": [shard_index, num_shards], "num_epochs": num_epochs,
                 "num_workers": num_workers, "use_cached": use_cached,
                 "data": data_fingerprints(mixture_or_task_name, split, use_cached)}
  return DataIterator(ds, converter.model_feature_lengths(lengths), description,
                      copy_batches=num_workers > 0)


def data_fingerprints(mixture_or_task_name: str, split: str,
                      use_cached: bool = False) -> dict[str, str]:
  """{"<task>/<split>": content fingerprint} of every task of a mixture (or the task)."""
  item = tasks_lib.get_mixture_or_task(mixture_or_task_name)
  tasks: Sequence[tasks_lib.Task] = item.tasks if isinstance(item, tasks_lib.Mixture) else [item]
  return {f"task {t.name!r} split {split!r}":
          t.split_source(split, use_cached).content_fingerprint() for t in tasks}


# -------------------------------------------------------------------------------------- evaluation


class EvalDataset:
  """One task's eval split: ordered, unpacked, padded batches; see the module docstring.

  Attributes:
    task: the Task (vocabularies: task.output_features[k].vocabulary;
      task.postprocess, task.compute_metrics).
    examples: every example of the split, in order (all shards), with the
      `*_pretokenized` text.
    targets: the postprocessed targets used by the metrics, per example.
    indices: the example indices this shard evaluates.
    num_batches: equal on every shard (multi-host lockstep).
  """

  def __init__(self, task: tasks_lib.Task, split: str, task_feature_lengths: Mapping[str, int],
               batch_size: int, converter: conv.FeatureConverter, shard_index: int = 0,
               num_shards: int = 1, use_cached: bool = False):
    if converter.pack:
      raise UserError("evaluation batches are not packed; pass a converter with pack=False")
    if batch_size < 1:
      raise UserError(f"batch_size must be >= 1, got {batch_size}")
    self.task = task
    self.split = split
    self.batch_size = batch_size
    self.converter = converter
    self.lengths = converter.check_lengths(task_feature_lengths)
    ds = task.get_dataset(dict(task_feature_lengths), split, use_cached, shuffle=False,
                          num_epochs=1)
    # Every host preprocesses the whole (small) split so that all agree on the
    # count after filters, hence on the number of batches.
    self.examples = [ex for ex in ds.to_iter_dataset(grain.ReadOptions(num_threads=0))]
    if not self.examples:
      raise UserError(f"task {task.name!r}: eval split {split!r} has no examples after "
                      "preprocessing")
    self.indices = list(range(shard_index, len(self.examples), num_shards))
    per_shard = math.ceil(len(self.examples) / num_shards)
    self.num_batches = math.ceil(per_shard / batch_size)
    self.model_feature_lengths = converter.model_feature_lengths(self.lengths)
    self._targets = None

  @property
  def num_examples(self) -> int:
    return len(self.examples)

  @property
  def targets(self) -> list[Any]:
    if self._targets is None:
      self._targets = [
          self.task.postprocess(_target_text(self.task, ex), example=ex, is_target=True)
          for ex in self.examples]
    return self._targets

  def __len__(self) -> int:
    return self.num_batches

  def __iter__(self) -> Iterator[Batch]:
    for b in range(self.num_batches):
      idx = self.indices[b * self.batch_size:(b + 1) * self.batch_size]
      rows = self.converter.convert_window([self.examples[i] for i in idx], self.lengths)
      batch = {k: np.zeros((self.batch_size, n), np.int32)
               for k, n in self.model_feature_lengths.items()}
      for r, row in enumerate(rows):
        for k in batch:
          batch[k][r] = row[k]
      batch["example_index"] = np.full(self.batch_size, -1, np.int32)
      batch["example_index"][:len(idx)] = idx
      batch["example_mask"] = (batch["example_index"] >= 0).astype(np.int32)
      yield batch

  def compute_metrics(self, predictions: Mapping[int, Any]) -> dict[str, float]:
    """Metrics from {example_index: postprocessed prediction} over all examples.

    The evaluator gathers every shard's predictions first; a missing example is
    an error (it would silently bias the metric).
    """
    missing = [i for i in range(self.num_examples) if i not in predictions]
    if missing:
      raise UserError(f"task {self.task.name!r}: no prediction for {len(missing)} of "
                      f"{self.num_examples} eval examples (first: {missing[0]}); gather "
                      "predictions from every shard")
    ordered = [predictions[i] for i in range(self.num_examples)]
    return self.task.compute_metrics(self.targets, ordered)


def _target_text(task: tasks_lib.Task, example: Mapping[str, Any]) -> Any:
  if "targets_pretokenized" in example:
    return example["targets_pretokenized"]
  return task.output_features["targets"].vocabulary.decode(example["targets"])


def get_eval_dataset(task_name: str, task_feature_lengths: Mapping[str, int], batch_size: int, *,
                     split: str = "validation", model_kind: str = "encoder_decoder",
                     feature_converter: conv.FeatureConverter | None = None, shard_index: int = 0,
                     num_shards: int = 1, bos_id: int = 0,
                     use_cached: bool = False) -> EvalDataset:
  """Deterministic eval batches of one task (see `EvalDataset`); `bos_id` and `use_cached`
  as in `get_batches`."""
  item = tasks_lib.get_mixture_or_task(task_name)
  if not isinstance(item, tasks_lib.Task):
    raise UserError(f"{task_name!r} is a mixture; evaluate its tasks with get_eval_datasets")
  converter = feature_converter or conv.get_converter(model_kind, pack=False, bos_id=bos_id)
  tasks_lib.check_sharding(shard_index, num_shards, 0)
  return EvalDataset(item, split, task_feature_lengths, batch_size, converter, shard_index,
                     num_shards, use_cached)


def get_eval_datasets(mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
                      batch_size: int, **kwargs) -> dict[str, EvalDataset]:
  """One `EvalDataset` per task of a mixture (or the task) that has the split, metrics or
  not: the teacher-forced train-eval, as T5X's `get_training_eval_datasets` (a task without
  the split is skipped; its inference evaluation needs metric_fns, see evaluate.py)."""
  item = tasks_lib.get_mixture_or_task(mixture_or_task_name)
  split = kwargs.get("split", "validation")
  tasks: Sequence[tasks_lib.Task] = item.tasks if isinstance(item, tasks_lib.Mixture) else [item]
  out = {}
  for t in tasks:
    if t.has_split(split, kwargs.get("use_cached", False)):
      out[t.name] = get_eval_dataset(t.name, task_feature_lengths, batch_size, **kwargs)
  if not out:
    raise UserError(f"{mixture_or_task_name!r}: no task has a {split!r} split to evaluate")
  return out
