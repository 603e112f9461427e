"""What a run reports: T5X's scalar names, TensorBoard events (tensorboardX), a
`metrics.jsonl` with the same scalars, and a progress bar.

Steps return *sums* (see `models.BaseModel.loss_fn`); they are added up on the host
between reports (fetched once per report, not per step) and turned into T5X's values:
averages per step, per token, rates per second.

Progress: a tqdm bar on a terminal; without one (a log file, a scheduler's job), one
line per report, `step 40/1400: loss per target token 3.210, 1,234 tok/s, ETA 5m12s`.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import jax
import numpy as np

from t5forge import storage

log = logging.getLogger(__name__)


def add_sums(total: dict | None, sums: dict) -> dict:
  """Adds two dicts of (device or host) scalars; None + x = x."""
  if total is None:
    return dict(sums)
  return {k: total.get(k, 0.0) + v for k, v in sums.items()}


def summarize(sums: dict, *, seconds: float | None = None) -> dict[str, float]:
  """Metric sums over some steps -> T5X's scalars.

  Args:
    sums: host floats keyed as `BaseModel._metric_sums` plus `steps` (and
      `learning_rate`, summed over steps).
    seconds: wall time the steps took; adds timing/* rates when given.
  """
  s = {k: float(v) for k, v in sums.items()}
  steps = max(s.get("steps", 1.0), 1.0)
  out = {
      "loss": s["loss"] / steps,
      "z_loss": s["z_loss"] / steps,
      "cross_ent_loss": s["cross_ent_loss"] / steps,
      "accuracy": s["accuracy_correct"] / max(s["accuracy_count"], 1e-9),
      "loss_per_nonpadding_target_token": s["loss"] / max(s["weight_sum"], 1e-9),
      "loss_per_all_target_tokens": s["loss"] / max(s["num_target_tokens"], 1e-9),
      "nonpadding_fraction": s["weight_sum"] / max(s["num_target_tokens"], 1e-9),
      "non_padding_fraction/decoder": s["decoder_nonpadding"] / max(s["num_target_tokens"], 1e-9),
      "non_padding_fraction/loss_weights": s["loss_weights_nonzero"] / max(s["num_target_tokens"], 1e-9),
      "effective_batch_size/decoder": s["decoder_segments"] / steps,
  }
  if "encoder_nonpadding" in s:
    out["non_padding_fraction/encoder"] = s["encoder_nonpadding"] / max(s["num_encoder_tokens"], 1e-9)
    out["effective_batch_size/encoder"] = s["encoder_segments"] / steps
  if "learning_rate" in s:
    out["learning_rate"] = s["learning_rate"] / steps
  if seconds:
    cores = jax.device_count()
    out["timing/seconds"] = seconds
    out["timing/steps_per_second"] = steps / seconds
    out["timing/seqs"] = s["num_examples"]
    out["timing/seqs_per_second"] = s["num_examples"] / seconds
    out["timing/seqs_per_second_per_core"] = s["num_examples"] / seconds / cores
    out["timing/target_tokens_per_second"] = s["num_target_tokens"] / seconds
    out["timing/target_tokens_per_second_per_core"] = s["num_target_tokens"] / seconds / cores
  return out


class MetricWriter:
  """TensorBoard events under MODEL_DIR/<subdir>/ and one JSONL line per write.

  Only the writing process (process 0) creates files; others accept and drop writes.
  Both are appended to, so on a bucket MODEL_DIR they are written in `mirror`'s local
  working copy (`storage.AppendMirror`) and reach the bucket at its `sync()`: the run's
  checkpoints and its end. metrics.jsonl continues the bucket's copy.
  """

  def __init__(self, model_dir: str, *, enabled: bool = True,
               mirror: storage.AppendMirror | None = None):
    self.model_dir = model_dir
    self.enabled = enabled
    self.mirror = mirror or storage.AppendMirror(model_dir)
    self._writers: dict[str, Any] = {}
    self._jsonl = None  # opened on the first write: a run that fails early leaves no file

  def _writer(self, subdir: str):
    if subdir not in self._writers:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 (slow or optional import, on first use)
      self._writers[subdir] = SummaryWriter(self.mirror.path(subdir))
    return self._writers[subdir]

  def write_scalars(self, step: int, scalars: dict[str, float], *, subdir: str = "train") -> None:
    if not self.enabled:
      return
    writer = self._writer(subdir)
    if self._jsonl is None:
      self._jsonl = open(self.mirror.path("metrics.jsonl", resume=True), "a", encoding="utf-8")
    clean = {}
    for name, value in scalars.items():
      value = float(value)
      writer.add_scalar(name, value, step)
      clean[name] = value if np.isfinite(value) else str(value)
    writer.flush()
    self._jsonl.write(json.dumps({"step": int(step), "split": subdir, **clean}) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    for w in self._writers.values():
      w.close()
    self._writers = {}
    if self._jsonl:
      self._jsonl.close()
      self._jsonl = None


class Progress:
  """Step, loss per target token, tokens/s and ETA on process 0: a tqdm bar when
  `enabled` (a terminal), else one printed line per report (`report`)."""

  def __init__(self, *, start: int, total: int, enabled: bool = True, chief: bool = True):
    self._bar = None
    self._chief = chief
    self._total = total
    self._since: tuple[float, int] | None = None  # (time, step) after the compiling step
    if enabled:
      from tqdm import tqdm  # noqa: PLC0415 (slow or optional import, on first use)
      self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                       desc="train", smoothing=0.1)

  def update(self, n: int = 1) -> None:
    if self._bar is not None:
      self._bar.update(n)

  def start_timing(self, step: int) -> None:
    """Marks the end of the first (compiling) step: the ETA counts from here."""
    self._since = (time.time(), step)

  def report(self, step: int, scalars: dict[str, float]) -> None:
    """Shows a report's values (`summarize`'s names): the bar's postfix, or one line."""
    loss = scalars["loss_per_nonpadding_target_token"]
    tokens = scalars.get("timing/target_tokens_per_second", 0.0)
    if self._bar is not None:
      self._bar.set_postfix({"loss/token": f"{loss:.3f}", "tok/s": f"{tokens:,.0f}"},
                            refresh=False)
    elif self._chief:
      log.info("step %d/%d: loss per target token %.3f, %s tok/s, ETA %s", step, self._total,
               loss, f"{tokens:,.0f}", format_duration(self._eta(step, scalars)))

  def _eta(self, step: int, scalars: dict[str, float]) -> float:
    # Wall time per step since the first step (evaluations and checkpoints included),
    # else the report's own rate (step time only).
    if self._since is not None and step > self._since[1]:
      per_step = (time.time() - self._since[0]) / (step - self._since[1])
    else:
      per_step = 1.0 / max(scalars.get("timing/steps_per_second", 0.0), 1e-9)
    return max(self._total - step, 0) * per_step

  def write(self, msg: str) -> None:
    if self._bar is not None:
      self._bar.write(msg)
    elif self._chief:
      log.info(msg)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def format_duration(seconds: float) -> str:
  """5 -> '5s', 312 -> '5m12s', 3720 -> '1h02m'."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
