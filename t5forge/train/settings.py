"""Run settings with T5X's names, so T5X run gins bind them with only paths changed.

In our gin files this module is imported as `utils` (`utils.DatasetConfig`,
`utils.SaveCheckpointConfig`, `utils.create_learning_rate_scheduler`, ...), mirroring
T5X's `t5x.utils`. All are plain frozen dataclasses; nothing here imports gin.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from t5forge.errors import UserError
from t5forge.train.optim import create_learning_rate_scheduler  # noqa: F401  (re-exported)


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """Which data a run reads (T5X's `utils.DatasetConfig`).

  Attributes:
    mixture_or_task_name: a registered task or mixture.
    task_feature_lengths: e.g. {'inputs': 512, 'targets': 114}.
    split: source split.
    batch_size: the global batch (all processes together).
    shuffle / seed: shuffling and per-example randomness (seed None: the run's seed).
    pack: pack several examples per row (training only).
    use_cached: read each task's SeqIO cache (written by seqio's cache_tasks_main; found
      in --seqio_additional_cache_dirs) in place of its source and the preprocessors
      before its CacheDatasetPlaceholder, as SeqIO's `use_cached`.
    module: a Python module to import first, to register tasks (T5X's
      MIXTURE_OR_TASK_MODULE).
    num_workers: Grain worker processes for preprocessing.
    allow_changed_data: resume even when a task's data is not the data the checkpoint's
      iterator state was saved with (its content fingerprint differs); without it such a
      resume is refused, naming the task and split.
    shard_mode: how processes split the data. 'rows' (default): every process reads
      the whole (shuffled, packed) stream and takes its rows of each global batch, so
      the batches, and the training, are the same on any number of processes and a
      checkpoint resumes exactly on another process count; preprocessing is repeated
      on every process. 'examples': each process reads every n-th example (SeqIO's
      sharding): no repeated work, but the batches depend on the process count.
  """

  mixture_or_task_name: str
  task_feature_lengths: Mapping[str, int]
  split: str = "train"
  batch_size: int = 128
  shuffle: bool = True
  seed: int | None = None
  pack: bool = True
  use_cached: bool = False
  module: str | None = None
  num_workers: int = 0
  use_custom_packing_ops: bool = False  # T5X/TF only; accepted and ignored
  shard_mode: str = "rows"
  allow_changed_data: bool = False

  def __post_init__(self):
    if self.shard_mode not in ("rows", "examples"):
      raise UserError(f"DatasetConfig.shard_mode={self.shard_mode!r}: use 'rows' or 'examples'")


@dataclasses.dataclass(frozen=True)
class SaveCheckpointConfig:
  """When to save and what to keep (T5X's `utils.SaveCheckpointConfig`).

  Attributes:
    period: save every this many steps (and always at the last step).
    dtype: parameter dtype on disk; only 'float32' (resumes are bitwise exact).
    keep: how many of the latest checkpoints to keep (None: all).
    save_dataset: accepted for T5X gins; the data iterator state is always saved.
    save_steps: extra steps to save at.
    keep_best / best_metric / best_mode: also keep the `keep_best` best checkpoints by a
      reported metric, e.g. 'training_eval/bible_translate_en_es/loss' ('min') or
      'inference_eval/bible_translate_en_es/bleu' ('max').
    async_save: write in the background while training continues.
  """

  period: int = 1000
  dtype: str = "float32"
  keep: int | None = None
  save_dataset: bool = True
  save_steps: Sequence[int] = ()
  keep_best: int = 0
  best_metric: str | None = None
  best_mode: str = "min"
  async_save: bool = True

  def __post_init__(self):
    if self.dtype != "float32":
      raise UserError(f"SaveCheckpointConfig.dtype={self.dtype!r}: t5forge saves float32 "
                      "parameters (so a resumed run is exact); remove the binding")
    if self.period is not None and self.period < 1:
      raise UserError(f"SaveCheckpointConfig.period must be >= 1, got {self.period}")
    if self.best_mode not in ("min", "max"):
      raise UserError(f"SaveCheckpointConfig.best_mode must be 'min' or 'max', got "
                      f"{self.best_mode!r}")


@dataclasses.dataclass(frozen=True)
class RestoreCheckpointConfig:
  """What a run starts from when MODEL_DIR has no checkpoint (T5X's
  `utils.RestoreCheckpointConfig`; INITIAL_CHECKPOINT_PATH).

  Attributes:
    path: a t5forge checkpoint or MODEL_DIR, an HF directory, or a T5X checkpoint.
    mode: 'specific' (this checkpoint) or 'latest' (the latest in a MODEL_DIR path);
      `t5forge eval` also takes 'all' (every checkpoint of a MODEL_DIR).
    dtype: parameters are cast to the model's float32 parameters ('float32' only).
    assignment_map: ((regex, replacement or None), ...) applied to each of the model's
      parameter names ('encoder/layers_0/mlp/wi_0/kernel'); the first full match
      decides: None keeps the fresh initialisation, a replacement names the checkpoint
      parameter to read (regex groups allowed).
    fallback_to_scratch: initialise parameters the checkpoint lacks instead of failing.
    restore_step: continue the checkpoint's step count (T5X: TRAIN_STEPS includes the
      pre-training steps); False restarts at step 0.
    allow_vocabulary_change: start even when the checkpoint stores another vocabulary
      than the task's (a warning, not an error): fine-tuning onto a new vocabulary on
      purpose. Without it such a run is refused: the checkpoint's embeddings would read
      the task's ids as other words.
  """

  path: str | None = None
  mode: str = "specific"
  dtype: str = "float32"
  assignment_map: Sequence[tuple[str, str | None]] = ()
  fallback_to_scratch: bool = False
  restore_step: bool = True
  restore_dataset: bool = False  # accepted for T5X gins
  allow_vocabulary_change: bool = False

  def __post_init__(self):
    if self.mode not in ("specific", "latest", "all"):
      raise UserError(f"RestoreCheckpointConfig.mode={self.mode!r}: use 'specific', 'latest' "
                      "or 'all' (evaluation only)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """T5X's `utils.CheckpointConfig`: saving and the initial restore together."""

  save: SaveCheckpointConfig | None = None
  restore: RestoreCheckpointConfig | None = None


@dataclasses.dataclass(frozen=True)
class EarlyStopping:
  """Stop when `metric` (e.g. 'training_eval/bible_translate_en_es/loss') has not
  improved by min_delta for `patience` evaluations in a row."""

  metric: str
  mode: str = "min"
  patience: int = 3
  min_delta: float = 0.0


@dataclasses.dataclass(frozen=True)
class Trainer:
  """T5X's `trainer.Trainer` settings that run gins bind: the learning-rate schedule and
  gradient accumulation."""

  learning_rate_fn: Callable[[Any], Any] | None = None
  num_microbatches: int | None = None
