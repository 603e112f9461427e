"""The training run: setup in named stages, one loop, periodic hooks.

`train(...)` takes T5X's arguments (`model`, `model_dir`, `train_dataset_cfg`,
`total_steps`, `eval_period`, ...), so T5X run gins bind it unchanged except for paths.
What it leaves in MODEL_DIR: `config.gin`, `model-info.txt`, `checkpoint_<step>/`,
TensorBoard events under `train/` and `training_eval/<task>/`, and `metrics.jsonl`; and
`.lock`, held while the run lasts so that a second run on the same MODEL_DIR refuses
(see `run_lock.py`).

MODEL_DIR may be a bucket (`gs://...`, `s3://...`): it stays a URL, its bucket must exist,
and the same files are objects there. config.gin and model-info.txt are written whole;
the files a run appends to (metrics.jsonl, TensorBoard events, batch fingerprints) are
written in a local working copy and uploaded at every checkpoint and at the end
(`storage.AppendMirror`), so a run killed between checkpoints loses the lines since the
last one, as it loses those steps.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import time
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import data, files, multihost, storage
from t5forge.convert import from_checkpoint
from t5forge.data import vocab_io
from t5forge.errors import UserError
from t5forge.models import BaseModel
from t5forge.nn import adapters, lora, quant
from t5forge.nn import prompt as prompt_lib
from t5forge.sharding import Partitioner
from t5forge.train import checkpoint as ckpt_lib
from t5forge.train import device_memory, hooks, model_info, optim, run_lock
from t5forge.train import metrics as metrics_lib
from t5forge.train.settings import (CheckpointConfig, DatasetConfig, EarlyStopping,
                                    SaveCheckpointConfig, Trainer)
from t5forge.train.state import TrainState
from t5forge.train.step import check_microbatches, make_eval_step, make_train_step

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
  """The loss became NaN or infinite."""


@dataclasses.dataclass
class TrainResult:
  step: int
  train_metrics: dict
  eval_metrics: dict
  stopped: str  # 'total_steps', 'early_stopping', 'preempted', 'nothing_to_do'
  state: TrainState | None = None  # the final (sharded) train state


def _prepare_model_dir(model_dir: str | None) -> str:
  if not model_dir:
    raise UserError("MODEL_DIR is not set; pass --gin.MODEL_DIR=\\\"/path/to/dir\\\"")
  if storage.is_remote(model_dir):
    return _prepare_bucket_model_dir(storage.normalize(model_dir))
  model_dir = os.path.abspath(os.path.expanduser(model_dir))
  try:
    os.makedirs(model_dir, exist_ok=True)
    probe = os.path.join(model_dir, f".write-test-{os.getpid()}")
    with open(probe, "w", encoding="utf-8") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise UserError(f"MODEL_DIR {model_dir} is not writable ({e.strerror}); choose a directory "
                    "you can write to") from None
  return model_dir


def _prepare_bucket_model_dir(model_dir: str) -> str:
  """A bucket MODEL_DIR stays a URL: its bucket must exist, and an object written and
  deleted under it is the write probe (before the lock, so a refused write is one line
  about the bucket, not about the lock)."""
  storage.check_bucket(model_dir)
  probe = storage.join(model_dir, f".write-test-{socket.gethostname()}-{os.getpid()}")
  try:
    storage.write_bytes(probe, b"ok")
    storage.remove(probe)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 (any refusal the storage layer did not name)
    raise UserError(f"MODEL_DIR {model_dir} is not writable ({' '.join(str(e).split())[:200]}); "
                    "check the bucket's permissions or choose another MODEL_DIR") from None
  return model_dir


class _Preemption:
  """SIGTERM (a scheduler's preemption notice) -> save a checkpoint and stop cleanly."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    try:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread: leave signals alone
      self._old = None
    return self

  def _handle(self, *_):
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def train(*, model: BaseModel, model_dir: str, train_dataset_cfg: DatasetConfig,
          total_steps: int, optimizer: Any = None, trainer_cls: Callable[[], Trainer] = Trainer,
          partitioner: Partitioner | None = None, checkpoint_cfg: CheckpointConfig | None = None,
          train_eval_dataset_cfg: DatasetConfig | None = None,
          infer_eval_dataset_cfg: DatasetConfig | None = None,
          inference_evaluator_cls: Callable | None = None,
          eval_period: int = 1000, eval_steps: int | None = 20, stats_period: int | None = 100,
          random_seed: int | None = 0, early_stopping: EarlyStopping | None = None,
          run_eval_before_training: bool = False, operative_config: str = "",
          record_batch_fingerprints: bool = False, show_progress: bool = True,
          base_dtype: str = "float32", lock_wait_s: float | None = None) -> TrainResult:
  """Trains `model` until step `total_steps` (counted from step 0, as T5X).

  Args:
    model: an EncoderDecoderModel or DecoderOnlyModel.
    model_dir: where checkpoints, summaries and configs go; a rerun resumes from it.
    train_dataset_cfg: the training data (batch_size is global).
    total_steps: TRAIN_STEPS; includes the steps of a restored initial checkpoint.
    optimizer: an optimizer spec with `build(lr_fn, param_axes)` (optim.Adafactor(),
      optim.AdamW(), optim.Optax(...)); default the model's, else Adafactor.
    trainer_cls: settings.Trainer: learning_rate_fn (default constant 1e-3) and
      num_microbatches (gradient accumulation).
    partitioner: mesh and rules; default all devices on the 'data' axis.
    checkpoint_cfg: `save` (when to save, what to keep) and `restore` (what to start
      from when MODEL_DIR has no checkpoint: INITIAL_CHECKPOINT_PATH).
    train_eval_dataset_cfg: teacher-forced evaluation data, every eval_period steps.
    infer_eval_dataset_cfg / inference_evaluator_cls: decoding evaluation every
      eval_period steps: `inference_evaluator_cls(model=, dataset_cfg=, partitioner=,
      model_dir=, metric_writer=)` returns a callable `fn(params, step) -> scalars`
      (evaluate.InferenceEvaluator: decoding + the tasks' metrics; skipped with a note
      when its `eval_tasks` is empty: no task has metric_fns).
    eval_steps: batches per train-eval task (None or <= 0: all).
    stats_period: report training metrics every this many steps.
    random_seed: seeds parameter init, dropout (fold_in(seed, step)) and the data order.
    early_stopping: stop on a metric that stopped improving.
    run_eval_before_training: evaluate once before the first step.
    operative_config: the gin config text, written to config.gin.
    record_batch_fingerprints: write a CRC of every batch to batch_fingerprints.jsonl
      (to check that a resumed run sees exactly the batches of an uninterrupted one).
    base_dtype: adapter training only (a model with LoRA or prompt parameters, see
      `t5forge.nn.adapters`): how the frozen base from INITIAL_CHECKPOINT_PATH is stored,
      'float32', 'bfloat16' or 'int8' (its projection kernels; the rest stays float32).
    lock_wait_s: a bucket MODEL_DIR whose lock another host holds: how long to wait for
      that lock to go stale before refusing (0: refuse at once; None: the stale timeout
      and a margin, see `run_lock`). `t5forge train --lock_wait_s=SECONDS` sets it.

  Raises:
    run_lock.LockLost: another run took this run's bucket lock; this run stopped before
      its next checkpoint or evaluation, having written nothing more.
  """
  seed = 0 if random_seed is None else int(random_seed)
  model_dir = _prepare_model_dir(model_dir)
  # Before anything is written into MODEL_DIR: one run per MODEL_DIR (one lock per job).
  lock = run_lock.lock_for_job(model_dir, command="t5forge train",
                               log=log.info if multihost.is_chief() else lambda *_: None,
                               wait_s=lock_wait_s)
  run = None
  try:
    run = _Run(model_dir=model_dir, model=model, seed=seed,
               partitioner=partitioner or Partitioner(), total_steps=int(total_steps),
               lock=lock)
    run.setup_data(train_dataset_cfg)
    settings = trainer_cls() if callable(trainer_cls) else trainer_cls
    run.setup_state(optimizer or getattr(model, "optimizer", None) or optim.Adafactor(),
                    settings, checkpoint_cfg or CheckpointConfig(), base_dtype=base_dtype)
    if run.start >= run.total_steps:
      run.log(f"TRAIN_STEPS={run.total_steps} is not above the restored step {run.start}: "
              "nothing to train. Raise TRAIN_STEPS to train further.")
      return TrainResult(run.start, {}, {}, "nothing_to_do")
    run.write_run_files(operative_config)
    run.setup_hooks(train_eval_dataset_cfg, infer_eval_dataset_cfg, inference_evaluator_cls,
                    eval_steps=eval_steps, record_batch_fingerprints=record_batch_fingerprints)
    return _loop(run, eval_period=eval_period, stats_period=stats_period,
                 stopper=hooks.EarlyStopper(early_stopping),
                 run_eval_before_training=run_eval_before_training,
                 show_progress=show_progress)
  finally:
    try:
      if run is not None:
        run.close()  # waits for the last checkpoint: only then may another run start
    finally:
      if lock is not None:
        lock.release()


def _loop(run: "_Run", *, eval_period, stats_period, stopper, run_eval_before_training,
          show_progress) -> TrainResult:
  """The training loop: step, report, evaluate, checkpoint; nothing waits on the device
  except reports (every stats_period) and the one-step-late finiteness check."""
  step, total = run.start, run.total_steps
  progress = metrics_lib.Progress(start=step, total=total, enabled=run.is_chief and show_progress,
                                  chief=run.is_chief)
  window, window_start, hook_seconds = [], None, 0.0  # step time excludes hooks
  last_train, last_eval, stopped, pending_ok = {}, {}, "total_steps", None
  if run_eval_before_training:
    last_eval = run.evaluate(step)
    _show_eval(progress, step, last_eval)
  t_first = time.time()
  with _Preemption() as preemption, run.partitioner.activation_context():
    while step < total:
      batch = run.next_batch(step)
      if window_start is None:  # before the first step: would it fit in device memory?
        run.check_step_fits(batch)
      state, sums = run.train_step(run.state, batch, *run.base_args)
      run.state, step = state, step + 1
      _check_finite(pending_ok, step - 1, run.checkpointer)  # the previous step is done
      pending_ok = sums.pop("finite")
      if window_start is None:  # the first step includes compilation
        jax.block_until_ready(sums)
        progress.write(f"first step (compile + run) took {time.time() - t_first:.1f} s")
        progress.start_timing(step)
        window_start = time.time()
      else:
        window.append(sums)
      if step % (stats_period or total) == 0 or step == total:
        if window:
          last_train = run.report(step, window, time.time() - window_start - hook_seconds)
          progress.report(step, last_train)
        window, window_start, hook_seconds = [], time.time(), 0.0
      progress.update(1)
      hook_start = time.time()
      eval_now = bool(eval_period) and step % eval_period == 0
      if eval_now:
        _check_finite(pending_ok, step, run.checkpointer)
        last_eval = run.evaluate(step)
        _show_eval(progress, step, last_eval)
        stopped = "early_stopping" if stopper.update(last_eval) else stopped
      stopped = "preempted" if preemption.requested else stopped
      if run.checkpointer.should_save(step, total) or stopped != "total_steps":
        _check_finite(pending_ok, step, run.checkpointer)
        run.save(step, metrics=last_eval if eval_now else None)
      hook_seconds += time.time() - hook_start
      if stopped != "total_steps":
        progress.write(f"stopping at step {step}: {stopped}")
        break
  _check_finite(pending_ok, step, run.checkpointer)
  progress.close()
  return TrainResult(step, last_train, last_eval, stopped, run.state)


class _Run:
  """The resources of one training run, set up in stages and closed together."""

  def __init__(self, *, model_dir: str, model: BaseModel, seed: int, partitioner: Partitioner,
               total_steps: int, lock=None):
    self.model_dir, self.model, self.seed = model_dir, model, seed
    self.partitioner, self.total_steps = partitioner, total_steps
    self.lock = lock  # the MODEL_DIR lock, on process 0 (None on the others)
    self.lock_lost = False
    self.is_chief = multihost.is_chief()
    self.log = log.info if self.is_chief else (lambda *a, **k: None)
    self.train_iter = self.checkpointer = self.fingerprints = None
    # The files this process appends to; on a bucket MODEL_DIR a local working copy,
    # uploaded at every checkpoint and at the end (`close`).
    self.mirror = storage.AppendMirror(model_dir, name=f"process-{jax.process_index()}")
    self.writer = metrics_lib.MetricWriter(model_dir, enabled=self.is_chief, mirror=self.mirror)
    self.train_eval = self.inference_evaluator = None
    self.base, self.base_record = None, None  # adapter training: the frozen base

  # -- stage 1: data ----------------------------------------------------------------------
  def setup_data(self, cfg: DatasetConfig) -> None:
    # A tuned prompt: unpacked rows, inputs longer than the prompt (before any reading).
    prompt_lib.check_feature_lengths(self.model.config.prompt, cfg.task_feature_lengths,
                                     pack=cfg.pack)
    if cfg.module:
      data.import_task_module(cfg.module, flag="MIXTURE_OR_TASK_MODULE")
    self.global_batch = int(cfg.batch_size)
    self.partitioner.check_batch_size(self.global_batch)
    task = data.get_mixture_or_task(cfg.mixture_or_task_name)
    first_task = task.tasks[0] if hasattr(task, "tasks") else task
    self.model_kind = self.model.feature_converter_kind("inputs" in first_task.output_features)
    vocab = first_task.output_features["targets"].vocabulary
    if vocab.vocab_size > self.model.config.vocab_size:
      raise UserError(f"task {first_task.name!r} has a vocabulary of {vocab.vocab_size} ids but "
                      f"the model's vocab_size is {self.model.config.vocab_size}; set "
                      f"network.ModelConfig.vocab_size >= {vocab.vocab_size}")
    self.task = task
    if self.model.vocabulary is None:  # T5X's VOCABULARY = None: the task's vocabulary
      self.model.vocabulary = vocab
    else:  # it decodes infer-eval predictions and is saved with every checkpoint
      vocab_io.check_task(task, self.model.vocabulary, against="the model (its VOCABULARY)",
                          fix=_MODEL_VOCABULARY_FIX)
    self.shard_index, self.num_shards = self.partitioner.host_batch_slice(self.global_batch)
    self.shard_rows = cfg.shard_mode == "rows"
    # 'rows': read the global batch, keep this process's rows; 'examples': read a shard.
    reader_shards = (0, 1) if self.shard_rows else (self.shard_index, self.num_shards)
    self.train_iter = data.get_batches(
        cfg.mixture_or_task_name, cfg.task_feature_lengths,
        self.global_batch if self.shard_rows else self.global_batch // self.num_shards,
        split=cfg.split, model_kind=self.model_kind, pack=cfg.pack, shuffle=cfg.shuffle,
        seed=self.seed if cfg.seed is None else int(cfg.seed), shard_index=reader_shards[0],
        num_shards=reader_shards[1], num_workers=cfg.num_workers, use_cached=cfg.use_cached)
    self.allow_changed_data = cfg.allow_changed_data

  def next_batch(self, step: int) -> dict:
    batch = next(self.train_iter)
    if self.fingerprints:
      self.fingerprints.write(json.dumps({"step": step, "crc": _crc(batch)}) + "\n")
      self.fingerprints.flush()  # survives a SIGKILL
    if self.shard_rows and self.num_shards > 1:
      rows = self.global_batch // self.num_shards
      batch = {k: v[self.shard_index * rows:(self.shard_index + 1) * rows]
               for k, v in batch.items()}
    return self.partitioner.shard_batch(batch)

  # -- stage 2: optimizer, shardings, state -------------------------------------------------
  def setup_state(self, optimizer, settings: Trainer, checkpoint_cfg: CheckpointConfig, *,
                  base_dtype: str = "float32") -> None:
    model, part = self.model, self.partitioner
    check_microbatches(self.global_batch // part.num_data_shards, settings.num_microbatches)
    self.num_microbatches = settings.num_microbatches
    lr_fn = settings.learning_rate_fn or (lambda step: jnp.asarray(1e-3, jnp.float32))
    self.param_axes = model.logical_axes()
    self.abstract_params = model.abstract_params()
    if model.config.lora is not None:
      lora.check_targets(model.config.lora, self.abstract_params)
    self.adapter = adapters.has_adapter(self.abstract_params)
    if self.adapter:
      # The train state holds the adapter alone; the base is loaded (and frozen) below.
      self.abstract_params, abstract_base = adapters.split(self.abstract_params)
      self.param_axes, base_axes = adapters.split(self.param_axes)
      self.setup_base(checkpoint_cfg.restore, abstract_base, base_axes, base_dtype)
    elif base_dtype != "float32":
      raise UserError(f"base_dtype={base_dtype!r} applies to adapter training only (a model "
                      "with network.ModelConfig.lora or a prompt); remove it")
    tx = optimizer.build(lr_fn, self.param_axes)
    self.abstract_opt = jax.eval_shape(tx.init, self.abstract_params)
    self.opt_axes = optimizer.state_axes(self.abstract_opt, self.abstract_params, self.param_axes)
    self.shardings = TrainState(
        step=part.replicated(),
        params=part.tree_shardings(self.param_axes, prefix="params",
                                   shapes=self.abstract_params),
        opt_state=part.tree_shardings(self.opt_axes, prefix="opt_state",
                                      shapes=self.abstract_opt))
    self.checkpointer = ckpt_lib.Checkpointer(self.model_dir,
                                              checkpoint_cfg.save or SaveCheckpointConfig(),
                                              log=self.log)
    restore = checkpoint_cfg.restore
    if self.adapter and self.checkpointer.latest_step() is not None:
      self.check_adapter_base()
    if self.checkpointer.latest_step() is None and restore is not None and restore.path:
      self.check_vocabulary(restore.path, allow=restore.allow_vocabulary_change, fix=(
          "Train the task with the checkpoint's vocabulary (MIXTURE_OR_TASK_NAME = "
          "@data.with_vocabulary() and VOCABULARY = @vocab_io.from_checkpoint(), as "
          "configs/examples/finetune_from_hf.gin does), or set utils.RestoreCheckpointConfig."
          "allow_vocabulary_change = True to fine-tune onto the task's vocabulary on purpose"))
    # Outside the activation context: initialisation places parameters by out_shardings.
    self.state = _restore_or_init(
        model=model, tx=tx, seed=self.seed, checkpointer=self.checkpointer,
        restore_cfg=checkpoint_cfg.restore, train_iter=self.train_iter,
        abstract=(self.abstract_params, self.abstract_opt), shardings=self.shardings, log=self.log,
        axes=(self.param_axes, self.opt_axes),
        allow_changed_data=self.allow_changed_data, adapter=self.adapter, base=self.base)
    self.start = int(self.state.step)
    resumed = storage.join(self.model_dir, f"checkpoint_{self.start}")
    if self.checkpointer.latest_step() is not None and storage.isdir(resumed):
      self.check_vocabulary(resumed, fix=(
          "This MODEL_DIR was trained with the other one: train the task it was trained with, "
          "or use a new MODEL_DIR (INITIAL_CHECKPOINT_PATH = this checkpoint, with "
          "utils.RestoreCheckpointConfig.allow_vocabulary_change = True to start from it on "
          "purpose)"))
    with part.activation_context():
      # The frozen base is an input like the batch: not donated, placed once.
      self.train_step = jax.jit(
          make_train_step(model, tx, learning_rate_fn=lr_fn,
                          num_microbatches=settings.num_microbatches, seed=self.seed,
                          adapter=self.adapter),
          in_shardings=(self.shardings, None) + ((self.base_shardings,) if self.adapter else ()),
          out_shardings=(self.shardings, None), donate_argnums=(0,))
      self.eval_step = jax.jit(make_eval_step(model))

  @property
  def base_args(self) -> tuple:
    """The train step's arguments after (state, batch): the frozen base, if any."""
    return (self.base,) if self.adapter else ()

  def full_params(self, params):
    """The model's whole parameter tree: the adapter joined with the frozen base."""
    return adapters.join(params, self.base) if self.adapter else params

  def setup_base(self, restore, abstract_base, base_axes, base_dtype: str) -> None:
    """Loads the frozen base of adapter training from INITIAL_CHECKPOINT_PATH, stores it in
    base_dtype and places it; records where it came from and its fingerprint."""
    if restore is None or not restore.path:
      raise UserError("adapter training (network.ModelConfig.lora or a prompt) needs the frozen "
                      "base: set INITIAL_CHECKPOINT_PATH to the checkpoint to adapt")
    # Stored as read (an HF base tensor by tensor): never a float32 copy of the base.
    base, _, scratch, notes = ckpt_lib.initial_params(restore, abstract_base,
                                                      model_config=self.model.config,
                                                      base_dtype=base_dtype)
    if scratch:
      raise UserError(f"{restore.path}: the frozen base must come from the checkpoint, but "
                      f"{len(scratch)} parameter(s) would not ({', '.join(scratch[:3])}); remove "
                      "the assignment_map / fallback_to_scratch rules that leave them out")
    for note in notes:
      self.log(f"note: checkpoint and model config differ in {note}")
    fingerprint = adapters.fingerprint(base)
    base = adapters.store_base(base, base_dtype)
    self.base_shardings = _base_shardings(self.partitioner, base_axes, base)
    self.base = jax.device_put(base, self.base_shardings)
    self.base_record = {"base": str(restore.path), "fingerprint": fingerprint,
                        "base_dtype": base_dtype}
    self.log(f"adapter training: base {restore.path} frozen in {base_dtype} "
             f"(fingerprint {fingerprint})")

  def check_adapter_base(self) -> None:
    """Refuses to resume an adapter on another base than the one it was trained on."""
    step = self.checkpointer.latest_step()
    path = storage.join(self.checkpointer.step_dir(step), adapters.CONFIG_FILE)
    try:
      record = json.loads(storage.read_text(path))
    except (OSError, ValueError):
      raise UserError(f"{self.checkpointer.step_dir(step)} has no readable "
                      f"{adapters.CONFIG_FILE}: it is not a checkpoint of adapter training; "
                      "use a new MODEL_DIR") from None
    adapters.check_base(record, self.base_record["fingerprint"],
                        adapter=self.checkpointer.step_dir(step),
                        base=self.base_record["base"])

  def check_step_fits(self, batch: dict) -> None:
    """Compiles the training step for `batch` ahead of its first call and stops with one
    line when one device would need more memory than it has (`device_memory`). The call
    that follows reuses this executable from jit's cache: still one compilation
    (tests/test_device_memory.py counts them). A device that reports no limit (CPU)
    is not checked, so the step is not lowered ahead there."""
    device = jax.local_devices()[0]
    if device_memory.limit_bytes(device) is None:
      return
    compiled = self.train_step.lower(self.state, batch, *self.base_args).compile()
    device_memory.check_step_fits(compiled, device=device,
                                  batch_size=self.global_batch, config=self.model.config,
                                  num_microbatches=self.num_microbatches)

  def check_vocabulary(self, path: str, *, fix: str, allow: bool = False) -> None:
    """Refuses (with `allow`: warns) when the checkpoint at `path` stores another
    vocabulary than the task's: its embeddings would read the task's ids as other words."""
    theirs = from_checkpoint(path)
    diff = theirs is not None and vocab_io.difference(self.model.vocabulary, theirs)
    if diff and allow:
      self.log(f"warning: task {self.task.name!r} and checkpoint {path} have different "
               f"vocabularies ({diff}); fine-tuning onto the task's vocabulary as "
               "allow_vocabulary_change = True asks")
      return
    vocab_io.check_task(self.task, theirs, against=f"checkpoint {path}", fix=fix, log=self.log)

  def write_run_files(self, operative_config: str) -> None:
    if not self.is_chief:
      return
    if operative_config:
      files.write_text(storage.join(self.model_dir, "config.gin"), operative_config)
    model_info.write(self.model_dir, model_info.render(
        self.abstract_params, self.param_axes, self.shardings.params, self.abstract_opt,
        self.opt_axes, self.shardings.opt_state, self.partitioner.mesh.shape))

  # -- stage 3: hooks ---------------------------------------------------------------------
  def setup_hooks(self, train_eval_cfg, infer_eval_cfg, inference_evaluator_cls, *, eval_steps,
                  record_batch_fingerprints) -> None:
    if train_eval_cfg is not None:
      self.train_eval = hooks.TrainEvaluator(
          train_eval_cfg, model=self.model, eval_step=self.eval_step,
          shard_batch=self.partitioner.shard_batch, eval_steps=eval_steps,
          shard_index=self.shard_index, num_shards=self.num_shards, model_kind=self.model_kind)
      vocab_io.check_task(data.get_mixture_or_task(train_eval_cfg.mixture_or_task_name),
                          self.model.vocabulary, against="the model (its VOCABULARY)",
                          fix=_MODEL_VOCABULARY_FIX)
    if infer_eval_cfg is not None and inference_evaluator_cls is not None:
      self.inference_evaluator = inference_evaluator_cls(
          model=self.model, dataset_cfg=infer_eval_cfg, partitioner=self.partitioner,
          model_dir=self.model_dir, metric_writer=self.writer)
      # T5X's train.py: no task with metrics (e.g. pre-training) skips inference evaluation;
      # train-eval (teacher-forced loss) still runs.
      if getattr(self.inference_evaluator, "eval_tasks", None) == []:
        self.log(f"note: {self.inference_evaluator.no_tasks_reason}; inference evaluation "
                 "skipped (train-eval still reports the teacher-forced loss)")
        self.inference_evaluator.close()
        self.inference_evaluator = None
    if record_batch_fingerprints:
      self.fingerprints = open(self.mirror.path(
          f"batch_fingerprints.{jax.process_index()}.jsonl", resume=True), "a",
          encoding="utf-8")

  # -- periodic work ------------------------------------------------------------------------
  def report(self, step: int, window: list, seconds: float) -> dict[str, float]:
    host = jax.device_get(window)
    total = {k: sum(float(s[k]) for s in host) for k in host[0]}
    scalars = metrics_lib.summarize(total, seconds=seconds)
    self.writer.write_scalars(step, scalars, subdir="train")
    return scalars

  def check_lock(self, before: str) -> None:
    """Stops the run (LockLost, on every process) when its MODEL_DIR lock is no longer its
    own, before it writes into MODEL_DIR again (`before`: what it was about to do)."""
    lost = self.lock.lost_error(before=before) if self.lock and self.lock.check() else None
    if jax.process_count() > 1:
      lost = multihost.gather_json(lost)[0]  # only process 0 holds the lock
    if not lost:
      return
    self.lock_lost = True
    self.checkpointer.wait()  # a save started before the loss was seen ends committed
    last = self.checkpointer.latest_step()
    where = (f"checkpoint_{last} is the last committed checkpoint" if last is not None
             else "no checkpoint was committed")
    raise run_lock.LockLost(f"{lost}; {where} and nothing was written after the loss; if "
                            "the run that took it should not be there, stop it and start this "
                            "one again (it resumes)")

  def evaluate(self, step: int) -> dict[str, float]:
    self.check_lock(f"evaluating step {step}")  # inference evaluation writes MODEL_DIR/inference_eval
    scalars = {}
    with self.partitioner.activation_context():
      if self.train_eval is not None:
        for task_name, values in self.train_eval(self.full_params(self.state.params)).items():
          self.writer.write_scalars(step, values, subdir=f"training_eval/{task_name}")
          scalars.update({f"training_eval/{task_name}/{k}": v for k, v in values.items()})
      if self.inference_evaluator is not None:
        scalars.update(self.inference_evaluator(self.full_params(self.state.params), step))
    return scalars

  def save(self, step: int, *, metrics: dict | None) -> None:
    self.check_lock(f"saving checkpoint_{step}")
    if not hasattr(self, "_config"):
      self._config = _config_item(self.model)  # the vocabulary is base64: build it once
    extra = None
    if self.adapter:
      extra = {adapters.CONFIG_FILE: json.dumps(
          {"format": adapters.FORMAT, "model": self._config["model"], **self.base_record},
          indent=2, sort_keys=True) + "\n"}
    self.checkpointer.save(step, self.state, config_item=self._config,
                           data_state=self.train_iter.get_state(), metrics=metrics,
                           extra_files=extra)
    self.mirror.sync()  # a bucket's metrics.jsonl and events as of this checkpoint

  def close(self) -> None:
    for resource in (self.checkpointer, self.writer, self.train_iter, self.fingerprints):
      if resource is not None:
        resource.close()
    # A run that lost its lock uploads nothing more: the new holder's files stay as it wrote them.
    self.mirror.close(upload=not self.lock_lost)


def _show_eval(progress: metrics_lib.Progress, step: int, scalars: dict[str, float]) -> None:
  """One line per train-eval task: the held-out teacher-forced loss as training goes."""
  prefix, key = "training_eval/", "/loss_per_nonpadding_target_token"
  for name, loss in scalars.items():
    if name.startswith(prefix) and name.endswith(key):
      task = name[len(prefix):-len(key)]
      acc = scalars.get(f"{prefix}{task}/accuracy", float("nan"))
      progress.write(f"held-out at step {step}: {task} loss per target token {loss:.3f}, "
                     f"accuracy {acc:.3f} (teacher-forced)")


def _crc(batch: dict) -> int:
  crc = 0
  for k in sorted(batch):
    crc = zlib.crc32(np.ascontiguousarray(batch[k]).tobytes(), crc)
  return crc


def _check_finite(flag, step: int, checkpointer: ckpt_lib.Checkpointer) -> None:
  if flag is None or bool(flag):
    return
  checkpointer.wait()
  last = checkpointer.latest_step()
  where = f"checkpoint_{last} is the last good checkpoint" if last is not None else (
      "no checkpoint was written")
  raise TrainingDiverged(f"the loss or gradients became NaN/Inf at step {step}; {where}. "
                         "Lower the learning rate, enable z-loss, or check the data")


_MODEL_VOCABULARY_FIX = (
    "Set VOCABULARY = None (the task's), or train the task with the model's vocabulary: "
    "MIXTURE_OR_TASK_NAME = @data.with_vocabulary() (see configs/examples/finetune_from_hf.gin)")


def _config_item(model: BaseModel) -> dict:
  return {"model": model.config.to_dict(), "vocabulary": vocab_io.to_spec(model.vocabulary)}


def _base_shardings(part: Partitioner, axes: dict, base: dict) -> dict:
  """The frozen base's shardings: by its logical axes; an int8 kernel's scales [..., out]
  as the kernel's output axis."""
  is_q = lambda x: isinstance(x, quant.QArray)
  shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.q.dtype if is_q(v) else v.dtype),
                        base, is_leaf=is_q)
  shardings = part.tree_shardings(axes, shapes=shapes)

  def one(value, sharding):
    if not is_q(value):
      return sharding
    spec = tuple(sharding.spec) + (None,) * (len(value.shape) - len(sharding.spec))
    scale = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *spec[:-2], spec[-1]))
    return quant.QArray(q=sharding, scale=scale, exact=value.exact)

  return jax.tree.map(one, base, shardings, is_leaf=is_q)


def _restore_or_init(*, model, tx, seed, checkpointer, restore_cfg, train_iter, abstract,
                     shardings, log, axes=None, allow_changed_data=False, adapter=False,
                     base=None) -> TrainState:
  """The restore order: MODEL_DIR's latest checkpoint, INITIAL_CHECKPOINT_PATH, scratch.
  Adapter training: the latest checkpoint, else a fresh adapter (the base is loaded
  apart, by `_Run.setup_base`)."""
  abstract_params, abstract_opt = abstract
  latest = checkpointer.latest_step()
  if latest is not None:
    target = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step),
        params=jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract_params, shardings.params),
        opt_state=jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                               abstract_opt, shardings.opt_state))
    # The newest intact one: damaged ones are named and set aside (checkpoint.py).
    latest, (params, opt_state, data_item) = checkpointer.restore_latest(target, log=log)
    data_state = ckpt_lib.data_state_for_this_process(data_item)
    if data_state is not None:
      train_iter.set_state(data_state, allow_changed_data=allow_changed_data)
    else:
      log("note: the data iterator state was saved with another number of processes; "
          "the data order restarts")
    log(f"resumed from {checkpointer.model_dir}/checkpoint_{latest}")
    return TrainState(step=jax.device_put(jnp.asarray(latest, jnp.int32), shardings.step),
                      params=params, opt_state=opt_state)
  if adapter:
    # Only the adapter's leaves are outputs: XLA drops the base's initialisation.
    init_params = jax.jit(lambda rng: adapters.split(model.init_params(rng))[0],
                          out_shardings=shardings.params)
  else:
    init_params = jax.jit(model.init_params, out_shardings=shardings.params)
  params = init_params(jax.random.key(seed))
  prompt_cfg = model.config.prompt
  if adapter and prompt_cfg is not None and prompt_cfg.init != "uniform":
    # Sampled-vocabulary and class-label prompts start from the base's own embeddings.
    first = prompt_lib.initialize(prompt_cfg, base, model.vocabulary,
                                  jax.random.fold_in(jax.random.key(seed), 1))
    params = jax.device_put(prompt_lib.with_prompt(params, first), shardings.params)
    log(f"prompt of {prompt_cfg.length} initialised by {prompt_cfg.init!r}")
  step = 0
  if restore_cfg is not None and restore_cfg.path and not adapter:
    params, step, scratch, notes = ckpt_lib.initial_params(restore_cfg, params,
                                                           model_config=model.config)
    params = jax.device_put(params, shardings.params)
    log(f"initialised from {restore_cfg.path} (step {step}"
        + (f"; {len(scratch)} parameter(s) from scratch: {', '.join(scratch[:3])}" if scratch else "")
        + ")")
    for note in notes:
      log(f"note: checkpoint and model config differ in {note}")
  opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
  if restore_cfg is not None and restore_cfg.path and not adapter and axes is not None:
    # A Mesh TF checkpoint's Adafactor slots, where this run's Adafactor factors alike.
    opt_state, notes = ckpt_lib.initial_second_moments(restore_cfg, opt_state, axes[1], axes[0],
                                                       model_config=model.config)
    if notes:  # the seeded leaves are host arrays: placed as the state's shardings say
      opt_state = jax.device_put(opt_state, shardings.opt_state)
    for note in notes:
      log(f"note: {note}")
  if step:
    opt_state = jax.device_put(optim.set_step(opt_state, step), shardings.opt_state)
  return TrainState(step=jax.device_put(jnp.asarray(step, jnp.int32), shardings.step),
                    params=params, opt_state=opt_state)
