"""Periodic work of a training run: teacher-forced evaluation on a validation split,
and early stopping on any reported metric."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from t5forge import data
from t5forge.errors import UserError
from t5forge.train import metrics as metrics_lib
from t5forge.train.settings import DatasetConfig, EarlyStopping


class EarlyStopper:

  def __init__(self, config: EarlyStopping | None):
    self.config = config
    self.best: float | None = None
    self.bad_evals = 0

  def update(self, scalars: Mapping[str, float]) -> bool:
    """Returns True when training should stop."""
    c = self.config
    if c is None or c.metric not in scalars:
      return False
    value = float(scalars[c.metric])
    sign = 1.0 if c.mode == "min" else -1.0
    if self.best is None or sign * (self.best - value) > c.min_delta:
      self.best, self.bad_evals = value, 0
      return False
    self.bad_evals += 1
    return self.bad_evals >= c.patience


class TrainEvaluator:
  """Teacher-forced loss and accuracy on each task's validation split, as T5X's
  train-eval: `eval_steps` batches per task, scalars under training_eval/<task>/. Every
  task with the split is evaluated, with metric_fns or without (pre-training tasks)."""

  def __init__(self, cfg: DatasetConfig, *, model, eval_step: Callable, shard_batch: Callable,
               eval_steps: int | None, shard_index: int, num_shards: int, model_kind: str):
    per_process = cfg.batch_size // num_shards
    self.datasets = data.get_eval_datasets(
        cfg.mixture_or_task_name, cfg.task_feature_lengths, per_process, split=cfg.split,
        model_kind=model_kind, shard_index=shard_index, num_shards=num_shards,
        use_cached=cfg.use_cached)
    self.eval_step = eval_step
    self.shard_batch = shard_batch
    self.eval_steps = eval_steps

  def __call__(self, params: Any) -> dict[str, dict[str, float]]:
    """-> {task: scalars}."""
    out = {}
    for task, ds in self.datasets.items():
      total = None
      for i, batch in enumerate(ds):
        if self.eval_steps is not None and self.eval_steps > 0 and i >= self.eval_steps:
          break
        # Everything but the evaluator's bookkeeping (example_index / example_mask).
        feats = {k: v for k, v in batch.items() if not k.startswith("example_")}
        total = metrics_lib.add_sums(total, self.eval_step(params, self.shard_batch(feats)))
      if total is None:
        raise UserError(f"train-eval: task {task!r} produced no batches")
      scalars = metrics_lib.summarize(jax.device_get(total))
      out[task] = {k: v for k, v in scalars.items() if np.isfinite(v)}
    return out
