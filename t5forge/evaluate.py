"""Inference evaluation: decode (or score) a task's eval split, postprocess, compute the
task's metrics, and write what T5X / SeqIO write.

For each task, under `output_dir` (MODEL_DIR/inference_eval by default):

    <task>-metrics.jsonl       one line per evaluation: {"step": s, "bleu": ...,
                               "num_examples": n, "coverage": {split, num_examples,
                               feature_lengths, decode, model, checkpoint}}
    <task>-<step>.jsonl        one line per example: {"inputs": {...}, "prediction": ...,
                               "target": ..., "prediction_tokens": [...]}
    <task>/events.out.*        TensorBoard scalars `<task>/<metric>`, `<task>/num_examples`

`output_dir` (or MODEL_DIR) may be a `gs://` or `s3://` URL. A bucket has no append: the
metrics file is read and written back whole with its new line (one object, so a reader
sees the old lines or all of them), and TensorBoard's event files are written locally and
sent as whole objects after each evaluation.

`evaluate` (`t5forge eval`) skips a step only when a record covers exactly what it would
evaluate (see `InferenceEvaluator.why_evaluate`); `force` evaluates regardless.

`InferenceEvaluator` is also the trainer's infer-eval hook (`inference_evaluator_cls`).
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from t5forge import convert, data, decoding, files, multihost, opener, provenance, storage
from t5forge.convert import native, paths
from t5forge.data import vocab_io
from t5forge.engine import offline
from t5forge.errors import UserError
from t5forge.generation import Generator
from t5forge.predict import SCHEDULERS, DecodeOptions
from t5forge.sharding import Partitioner


# Checkpoint fields that the trainer's hook cannot know (it evaluates parameters in
# memory): compared only when both records have them.
_KNOWN_ONLY = ("checkpoint.path", "checkpoint.format", "checkpoint.content")


def max_feature_lengths(task, split: str, use_cached: bool = False) -> dict[str, int]:
  """T5X's `task_feature_lengths = None`: the longest example of the split, per feature."""
  ds = task.get_dataset(None, split, use_cached, shuffle=False, num_epochs=1)
  lengths: dict[str, int] = {}
  for ex in ds:
    for name in task.output_features:
      if name in ex:
        lengths[name] = max(lengths.get(name, 1), len(ex[name]))
  if not lengths:
    raise UserError(f"task {task.name!r}: split {split!r} has no examples to evaluate")
  return lengths


class InferenceEvaluator:
  """Evaluates parameters on every task (with metrics) of a mixture's eval split.

  Tasks without the split or without metric_fns are left out; `eval_tasks` names the
  others (empty: nothing to evaluate; the trainer then skips inference evaluation).

  Args:
    model: an EncoderDecoderModel or DecoderOnlyModel (its vocabulary, or the task's,
      decodes predictions).
    dataset_cfg: DatasetConfig: task or mixture, split, global batch size,
      task_feature_lengths (None: the longest example of the split).
    partitioner: mesh and rules (default: all devices on 'data').
    model_dir / output_dir: files go to output_dir, default MODEL_DIR/inference_eval.
    decode_options: DecodeOptions (default greedy).
    num_examples: evaluate only the first n examples of each task (None: all).
    write_predictions: write the per-example `<task>-<step>.jsonl`.
    metric_writer: a train.metrics.MetricWriter to report through (the trainer's: its
      TensorBoard dirs and metrics.jsonl); default: own TensorBoard writers.
    param_shardings: the parameters' shardings (`opener.Opened`) for the prediction
      functions' explicit input shardings; None: as the arrays come.
    scheduler: 'continuous' (greedy / sampled decodes of an encoder-decoder feed the
      engine's slots) or 'static' (padded batches, as beams and decoder-only models
      always); sampled texts differ between the two, so a sampled record names it.
  """

  def __init__(self, *, model, dataset_cfg, partitioner: Partitioner | None = None,
               model_dir: str | None = None, output_dir: str | None = None,
               decode_options: DecodeOptions | None = None, num_examples: int | None = None,
               write_predictions: bool = True, metric_writer=None, param_shardings=None,
               scheduler: str = "continuous"):
    if scheduler not in SCHEDULERS:
      raise UserError(f"--scheduler {scheduler!r}: choose one of {SCHEDULERS}")
    if dataset_cfg.module:
      data.import_task_module(dataset_cfg.module, flag="--module / MIXTURE_OR_TASK_MODULE")
    self.model = model
    self.partitioner = partitioner or Partitioner()
    self.output_dir = output_dir or storage.join(model_dir or ".", "inference_eval")
    if storage.is_remote(self.output_dir):
      self.output_dir = storage.normalize(self.output_dir)
    self.model_dir = model_dir
    self.split = dataset_cfg.split
    self.options = decode_options or DecodeOptions()
    self.continuous = scheduler == "continuous" and offline.supports(model, self.options)
    self.write_predictions = write_predictions
    self.num_examples = num_examples
    item = data.get_mixture_or_task(dataset_cfg.mixture_or_task_name)
    tasks = item.tasks if hasattr(item, "tasks") else [item]
    # As SeqIO's Evaluator: tasks without the split or without metric_fns are left out;
    # none left is an empty `eval_tasks` (the trainer skips inference evaluation, as T5X's
    # train.py; `t5forge eval` refuses).
    tasks = [t for t in tasks
             if t.metric_fns and t.has_split(dataset_cfg.split, dataset_cfg.use_cached)]
    self.no_tasks_reason = (f"{dataset_cfg.mixture_or_task_name!r}: no task has a "
                            f"{dataset_cfg.split!r} split with metric_fns to evaluate")
    if model.vocabulary is not None:  # it decodes the predictions of every task
      for task in tasks:
        vocab_io.check_task(task, model.vocabulary, against="the model (its VOCABULARY)",
                            fix="Evaluate a task with the model's vocabulary "
                            "(MIXTURE_OR_TASK_NAME = @data.with_vocabulary(), see "
                            "t5forge/data/README.md), or set VOCABULARY = None")
    self.partitioner.check_batch_size(int(dataset_cfg.batch_size))
    per_process = int(dataset_cfg.batch_size) // jax.process_count()
    self.datasets = {}
    for task in tasks:
      lengths = dataset_cfg.task_feature_lengths or max_feature_lengths(
          task, dataset_cfg.split, dataset_cfg.use_cached)
      kind = model.feature_converter_kind("inputs" in task.output_features)
      self.datasets[task.name] = data.get_eval_dataset(
          task.name, lengths, per_process, split=dataset_cfg.split, model_kind=kind,
          shard_index=jax.process_index(), num_shards=jax.process_count(),
          use_cached=dataset_cfg.use_cached)
    self.generator = Generator(model, partitioner=self.partitioner,
                               param_shardings=param_shardings)
    self.batch_size = int(dataset_cfg.batch_size)
    self._engines: dict[tuple[int, int], Any] = {}
    self._writers = {}
    # TensorBoard's writers append to their event files, which a bucket cannot: on a bucket
    # they write a local working copy, sent whole after each evaluation.
    self._events: storage.AppendMirror | None = None
    self.metric_writer = metric_writer

  @property
  def eval_tasks(self) -> list[str]:
    """The tasks evaluated (those with the split and metric_fns), as SeqIO's Evaluator."""
    return list(self.datasets)

  def _engine(self, params, input_length: int, decode_length: int):
    """The engine for these lengths, kept across tasks and evaluations (the trainer's
    periodic ones included: new parameters of the same shapes compile nothing)."""
    key = (input_length, decode_length)
    if key not in self._engines:
      self._engines[key] = offline.OfflineDecoder(
          self.model, params, num_slots=self.batch_size, decode_length=decode_length,
          input_length=input_length, partitioner=self.partitioner)
    return self._engines[key]

  def _vocab(self, task):
    return self.model.vocabulary or task.output_features["targets"].vocabulary

  def _run_task(self, params, name: str, ds) -> tuple[dict, list]:
    task = ds.task
    vocab = self._vocab(task)
    preds, tokens_out, scores = {}, {}, {}
    want_predict, want_score = bool(task.predict_metric_fns), bool(task.score_metric_fns)
    limit = self.num_examples
    # Greedy / sampled decodes of an encoder-decoder: every example's input is gathered,
    # then all feed the engine's slots (as `t5forge infer`); else per padded batch.
    continuous = want_predict and self.continuous
    inputs: dict[int, list[int]] = {}
    shape = None
    for batch in ds:
      index = batch["example_index"]
      feats = {k: v for k, v in batch.items() if not k.startswith("example_")}
      if limit is not None and index[index >= 0].size and index[index >= 0].min() >= limit:
        break
      gbatch = self.partitioner.shard_batch(feats)
      if want_predict and not continuous:
        toks, _ = self.generator.predict(gbatch, self.options, params=params)  # global rows
      if want_score:
        sc = self.generator.score_batch(gbatch, params=params)
      idx = multihost.gather_rows(index)
      for r, i in enumerate(idx.tolist()):
        if i < 0 or (limit is not None and i >= limit):
          continue
        if continuous:
          ids = np.asarray(feats["encoder_input_tokens"][r])
          inputs[i] = ids[:int(np.flatnonzero(ids)[-1]) + 1 if ids.any() else 0].tolist()
          shape = (feats["encoder_input_tokens"].shape[1], feats["decoder_input_tokens"].shape[1])
        elif want_predict:
          tokens_out[i] = [int(t) for t in toks[r]]
        if want_score:
          scores[i] = float(sc[r])
    if continuous and inputs:
      order = sorted(inputs)
      toks, _ = self._engine(params, *shape).decode([inputs[i] for i in order], self.options,
                                                    params=params)
      tokens_out.update({i: [int(t) for t in toks[k]] for k, i in enumerate(order)})
    for i, row in tokens_out.items():
      # Several stop ids (ModelConfig.eos_token_ids): <end_of_turn> not in the text.
      text = vocab.decode(decoding.text_ids(row, self.model.stop_ids))
      preds[i] = task.postprocess(text, example=ds.examples[i], is_target=False)
    n = ds.num_examples if limit is None else min(limit, ds.num_examples)
    metrics = {}
    targets = ds.targets[:n]
    if want_predict:
      metrics.update(task.compute_metrics(targets, [preds[i] for i in range(n)]))
    for fn in task.score_metric_fns:
      metrics.update(fn(targets, [scores[i] for i in range(n)]))
    rows = []
    for i in range(n):
      ex = ds.examples[i]
      row = {"inputs": {k: v for k, v in ex.items() if k.endswith("_pretokenized")},
             "target": targets[i]}
      if want_predict:
        row.update(prediction=preds[i], prediction_tokens=tokens_out[i])
      if want_score:
        row["score"] = scores[i]
      rows.append(row)
    return metrics, rows

  def coverage(self, name: str, step: int, checkpoint: dict | None = None) -> dict[str, Any]:
    """What evaluating task `name` at `step` covers: split, example count, feature lengths,
    decoding options, model numerics and checkpoint (`provenance.checkpoint_identity`;
    default, for the trainer's hook: MODEL_DIR/checkpoint_<step>, content unknown)."""
    ds = self.datasets[name]
    if checkpoint is None and self.model_dir is not None:
      checkpoint = {"path": native.step_dir(_absolute(self.model_dir), step),
                    "step": int(step), "format": "t5forge", "content": None}
    n = ds.num_examples if self.num_examples is None else min(self.num_examples,
                                                              ds.num_examples)
    decode = provenance.decode_record(self.options) if ds.task.predict_metric_fns else None
    if decode is not None and self.continuous and self.options.method == "sample":
      decode["scheduler"] = "continuous"  # the slots draw other samples than static batches
    return provenance.normalized({
        "split": self.split, "num_examples": n, "feature_lengths": dict(ds.lengths),
        "decode": decode,
        "model": provenance.model_record(self.model.config), "checkpoint": checkpoint})

  def __call__(self, params, step: int, checkpoint: dict | None = None) -> dict[str, float]:
    """Evaluates every task; returns {'inference_eval/<task>/<metric>': value}, with
    'inference_eval/<task>/num_examples' the count the metrics cover.

    Args:
      checkpoint: where `params` came from (`provenance.checkpoint_identity`), recorded
        with the metrics; default MODEL_DIR/checkpoint_<step> (the trainer's hook).
    """
    out = {}
    chief = multihost.is_chief()
    if chief:
      storage.makedirs(self.output_dir)  # a bucket: checks that it exists
    for name, ds in self.datasets.items():
      metrics, rows = self._run_task(params, name, ds)
      metrics = {k: float(v) for k, v in metrics.items()}
      coverage = self.coverage(name, step, checkpoint)
      scalars = {**metrics, "num_examples": float(len(rows))}
      out.update({f"inference_eval/{name}/{k}": v for k, v in scalars.items()})
      if not chief:
        continue
      if self.write_predictions:
        files.write_lines(storage.join(self.output_dir, f"{name}-{step}.jsonl"), rows)
      _append_line(storage.join(self.output_dir, f"{name}-metrics.jsonl"),
                   json.dumps({"step": int(step), **metrics, "num_examples": len(rows),
                               "coverage": coverage}) + "\n")
      if self.metric_writer is not None:
        self.metric_writer.write_scalars(step, scalars, subdir=f"inference_eval/{name}")
      else:
        writer = self._tensorboard(name)
        for k, v in scalars.items():
          writer.add_scalar(f"{name}/{k}", v, step)
        writer.flush()
        self._sync_events()
    return out

  def _tensorboard(self, name: str):
    if name not in self._writers:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 (slow or optional import, on first use)
      if self._events is None:
        self._events = storage.AppendMirror(self.output_dir, name=f"eval-{os.getpid()}")
      self._writers[name] = SummaryWriter(self._events.path(name))
    return self._writers[name]

  def _sync_events(self) -> None:
    if self._events is not None:
      self._events.sync()

  def records(self) -> dict[str, list[dict]]:
    """Each task's <task>-metrics.jsonl lines (earlier evaluations), oldest first."""
    done = {}
    for name in self.datasets:
      path = storage.join(self.output_dir, f"{name}-metrics.jsonl")
      rows = []
      if storage.isfile(path):
        with storage.open_read(path, binary=False) as f:
          for n, line in enumerate(f, 1):
            if not line.strip():
              continue
            try:
              rows.append(json.loads(line))
            except json.JSONDecodeError:
              raise UserError(f"{path}:{n}: not a JSON line (a torn write?); delete or fix "
                              "that line") from None
      done[name] = rows
    return done

  def why_evaluate(self, records: dict[str, list[dict]], step: int,
                   checkpoint: dict | None) -> str | None:
    """None when every task has a record of `step` covering what evaluating it now would
    (so it is done); else why not, in words ('' when there is no record of `step`)."""
    reasons, missing = [], False
    for name in self.datasets:
      path = storage.join(self.output_dir, f"{name}-metrics.jsonl")
      earlier = [r for r in records.get(name, []) if r.get("step") == step]
      if not earlier:
        missing = True
        continue
      now = self.coverage(name, step, checkpoint)
      if not any("coverage" in r for r in earlier):
        reasons.append(f"{path} has step {step} with no record of what it covered "
                       "(written by an older t5forge)")
        continue
      diffs = [provenance.differences(r["coverage"], now, known_only=_KNOWN_ONLY)
               for r in earlier if "coverage" in r]
      if all(diffs):
        reasons.append(f"{path} has step {step} evaluated with {'; '.join(diffs[-1])}")
    return "; ".join(reasons) if reasons or missing else None

  def close(self) -> None:
    for w in self._writers.values():
      w.close()
    if self._events is not None:
      self._events.close()
    self._writers, self._events = {}, None
    for dec in self._engines.values():
      dec.close()
    self._engines = {}


def _absolute(path: str) -> str:
  return storage.normalize(path) if storage.is_remote(path) else os.path.abspath(path)


def _append_line(path: str, line: str) -> None:
  """Appends `line` to the file `path`. A bucket object cannot be appended to: it is read
  and written back whole with the line added (one object: the old lines or all of them)."""
  if not storage.is_remote(path):
    with open(path, "a", encoding="utf-8") as f:
      f.write(line)
    return
  try:
    old = storage.read_text(path)
  except FileNotFoundError:
    old = ""
  files.write_text(path, old + line)


def _shown(scalars: dict[str, float]) -> str:
  """'task/bleu = 1.2, task/chrf = 30.1 (1,234 examples)', task after task."""
  groups: dict[str, list[str]] = {}
  counts: dict[str, int] = {}
  for key, value in scalars.items():
    task, metric = key.split("/")[1], key.split("/", 2)[2]
    if metric == "num_examples":
      counts[task] = int(value)
    else:
      groups.setdefault(task, []).append(f"{task}/{metric} = {value:.4g}")
  return "; ".join(f"{', '.join(shown)} ({counts.get(task, 0):,} examples)"
                   for task, shown in groups.items())


def evaluate(*, dataset_cfg, restore_checkpoint_cfg, model=None, output_dir: str | None = None,
             partitioner: Partitioner | None = None, decode_options: DecodeOptions | None = None,
             num_examples: int | None = None, vocabulary=None, force: bool = False,
             load_overrides: dict | None = None,
             scheduler: str = "continuous") -> dict[int, dict[str, float]]:
  """`t5forge eval`: one, the latest, or all checkpoints (T5X's eval.py).

  A checkpoint is skipped when <task>-metrics.jsonl already has, for every task, a record
  of its step covering what this evaluation would: the same split, example count, feature
  lengths, decoding options, model dtype and checkpoint. Otherwise (a partial evaluation,
  other options, a record from an older t5forge) it is evaluated again, with a note.

  Args:
    dataset_cfg: task or mixture, split, batch size, task_feature_lengths (None: max).
    restore_checkpoint_cfg: path (a checkpoint, a MODEL_DIR, an HF directory or a T5X
      checkpoint) and mode: 'specific', 'latest' or 'all' (every checkpoint of a MODEL_DIR).
    model: the model (gin's MODEL); default built from the checkpoint's config.
    output_dir: default <MODEL_DIR>/inference_eval.
    force: evaluate even checkpoints with a matching record.
    load_overrides: runtime ModelConfig fields applied as checkpoints are read
      (`--dtype`, `--weight_dtype`); a gin MODEL's own layout and weight type otherwise.
    scheduler: `InferenceEvaluator`'s ('continuous' or 'static').

  Returns:
    {step: {"inference_eval/<task>/<metric>": value, ".../num_examples": n}} for the
    checkpoints evaluated now.
  """
  path, mode = restore_checkpoint_cfg.path, restore_checkpoint_cfg.mode
  if not path:
    raise UserError("no checkpoint to evaluate; set CHECKPOINT_PATH (--checkpoint)")
  storage.is_remote(path)  # an unknown scheme is one line, before anything is read
  if output_dir and storage.is_remote(output_dir):
    storage.check_bucket(output_dir)
  if mode == "all":
    checkpoints = paths.resolve_all(path)
  elif storage.is_remote(path):  # stays a URL: the outputs go beside it, in the bucket
    checkpoints = [paths.resolve(path)]
  else:  # 'latest' and 'specific': a MODEL_DIR means its newest; a Hub name is fetched
    checkpoints = [paths.resolve(convert.local_path(path))]
  model_dir = checkpoints[0].model_dir or checkpoints[0].path
  output_dir = output_dir or storage.join(model_dir, "inference_eval")
  evaluator, results = None, {}
  partitioner = partitioner or Partitioner()
  try:
    for located in checkpoints:
      try:
        # A gin MODEL's layout and weight type apply to the checkpoints as they are read
        # (and the model of the first checkpoint is kept for the others).
        opened = opener.open_checkpoint(located.path, vocabulary=vocabulary, model=model,
                                        overrides=load_overrides, partitioner=partitioner)
      except UserError as e:
        if mode != "all" or len(checkpoints) == 1:
          raise
        print(f"note: {str(e).splitlines()[0]}; skipped")  # a damaged one of many
        continue
      ckpt = opened.checkpoint
      ckpt_vocab = convert.of_checkpoint(ckpt)
      if dataset_cfg.module:
        data.import_task_module(dataset_cfg.module, flag="--module / MIXTURE_OR_TASK_MODULE")
      vocab_io.check_task(
          data.get_mixture_or_task(dataset_cfg.mixture_or_task_name), ckpt_vocab,
          against=f"checkpoint {ckpt.path}",
          fix="Evaluate the task with the checkpoint's vocabulary: t5forge eval "
          "--use_checkpoint_vocabulary (gin: MIXTURE_OR_TASK_NAME = @data.with_vocabulary(), "
          "see t5forge/data/README.md)")
      model = opened.model
      if evaluator is None:
        evaluator = InferenceEvaluator(model=model, dataset_cfg=dataset_cfg,
                                       partitioner=partitioner, output_dir=output_dir,
                                       decode_options=decode_options, num_examples=num_examples,
                                       param_shardings=opened.param_shardings,
                                       scheduler=scheduler)
        if not evaluator.eval_tasks:
          raise UserError(evaluator.no_tasks_reason)
        done = evaluator.records()
      identity = opened.identity()
      if storage.is_remote(located.path):  # read through a local copy: record the URL
        identity["path"] = located.path
      why = "" if force else evaluator.why_evaluate(done, ckpt.step, identity)
      if why is None:
        print(f"step {ckpt.step}: already evaluated on the same examples and options "
              f"({output_dir}); skipped (--force evaluates again)")
        continue
      if why:
        print(f"step {ckpt.step}: note: {why}; evaluating again")
      with partitioner.activation_context():
        results[ckpt.step] = evaluator(opened.params, ckpt.step, checkpoint=identity)
      print(f"step {ckpt.step}: {_shown(results[ckpt.step])}")
  finally:
    if evaluator is not None:
      evaluator.close()
  return results
