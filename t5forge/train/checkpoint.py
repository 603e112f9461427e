"""Training checkpoints with Orbax, and the restore order of a run.

A checkpoint is `MODEL_DIR/checkpoint_<step>/` with the items of `convert.native`
(`params/`, `config/`) plus `opt_state/` and `data_iter/` (every process's data
iterator state), written asynchronously and committed atomically (Orbax writes a
temporary directory and renames it) together with `t5forge_manifest.json`, the size and
sha256 of each file (`convert.manifest`). Which checkpoints stay: the latest `keep`, plus
the best `keep_best` by a metric when one is named.

Restore order (loop's `_restore_or_init`): the newest intact checkpoint in MODEL_DIR (full
state, data iterator; `Checkpointer.restore_latest`: a damaged one is named in one line,
renamed aside to `checkpoint_<step>.damaged-<time>` and the next older one tried; with
none intact the run refuses. Damage is what is verified: files that differ from the
manifest, or a checkpoint without one that Orbax cannot read for a reason that cannot
pass. A read that fails on the network, a time-out or memory is retried, then stops the
run in one line with exit status 75 and nothing set aside), else INITIAL_CHECKPOINT_PATH (parameters and step from a t5forge,
HF or T5X checkpoint, renamed or dropped by a regex assignment map, missing ones
initialised fresh if allowed, cast to the model's dtype), else a fresh init.

A bucket MODEL_DIR. On `gs://` Orbax writes straight to the bucket (TensorStore's GCS
driver; every process its own `ocdbt.process_<i>`) in place, as it does on GCS, and the
primary process writes the manifest after every other object: the manifest commits the
checkpoint (`convert.manifest`). Orbax has no S3 array path, so on `s3://` a step is
written into a local staging directory under the cache (`storage.cache_root()`), its
manifest added, uploaded with the manifest last and the local copy removed; restores
read `storage.local_copy` of the step (one download per object version), and which old
steps go (`keep`, `keep_best`) is decided here, as Orbax's policy would on disk. A
damaged checkpoint on a bucket is moved aside (copied to `checkpoint_<step>.damaged-
<time>`, then deleted: buckets have no rename). A save the bucket refuses or that the
network cuts short is a one-line StorageError naming the checkpoint; with no manifest
written, nothing of it counts, and a resume reads the previous checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from t5forge import convert, multihost, storage
from t5forge.convert import load_checkpoint, manifest, mtf, native
from t5forge.errors import UserError
from t5forge.nn import quant
from t5forge.train import optim
from t5forge.train.settings import RestoreCheckpointConfig, SaveCheckpointConfig

OPT_STATE = "opt_state"
DATA_ITER = "data_iter"
# A restore that fails in a way that may pass is tried this often (1 s, then 2 s apart):
# time for a network blip or a bucket's 503 to clear, not for an outage (which stops the
# run with exit status 75, for its supervisor to restart).
RESTORE_TRIES = 3


def _flatten(tree: Any) -> dict[str, Any]:
  # An int8 kernel (a frozen base read with base_dtype='int8') is one parameter.
  is_q = lambda x: isinstance(x, quant.QArray)
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_q)[0]}


def _unflatten_like(template: Any, flat: dict[str, Any]) -> Any:
  paths = ["/".join(str(getattr(k, "key", k)) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
  return jax.tree.unflatten(jax.tree.structure(template), [flat[p] for p in paths])


# The model gins of each architecture, for the fix in a cross-architecture mismatch.
_MODEL_GINS = {"encoder_decoder": "a T5 model gin (models/t5_1_1/*.gin, models/t5_1_0/*.gin, ...)",
               "t5gemma": "a T5Gemma model gin (models/t5gemma/*.gin)",
               "decoder_only": "a decoder-only model gin (models/decoder_only/*.gin)"}


def remap_params(ckpt_params: Any, fresh_params: Any, config: RestoreCheckpointConfig, *,
                 source: str, fix: str | None = None,
                 keep_dtype: bool = False) -> tuple[Any, list[str]]:
  """Builds the model's parameters from a checkpoint's, by name, as RestoreConfig says.

  Args:
    fix: what to do when a parameter is missing or of another shape (default: it may
      be a checkpoint of another model; rename or initialise it).
    keep_dtype: keep each checkpoint leaf's dtype (a frozen base already stored as
      bfloat16 or int8) instead of casting it to the fresh leaf's.

  Returns:
    (parameters shaped like fresh_params, names taken from the fresh initialisation).
  """
  have = _flatten(ckpt_params)
  fresh = _flatten(fresh_params)
  rules = [(re.compile(p), r) for p, r in config.assignment_map]
  out, from_scratch = {}, []
  for name, init_value in fresh.items():
    source_name = name
    for pattern, replacement in rules:
      if pattern.fullmatch(name):
        source_name = None if replacement is None else pattern.sub(replacement, name)
        break
    if source_name is None:
      out[name] = init_value
      from_scratch.append(name)
      continue
    if source_name not in have:
      if config.fallback_to_scratch:
        out[name] = init_value
        from_scratch.append(name)
        continue
      raise UserError(f"{source}: has no parameter {source_name!r} (needed for {name!r}); "
                      + (fix or "is it a checkpoint of another model? Set fallback_to_scratch "
                         "or an assignment_map rule to initialise or rename it"))
    value = have[source_name]
    if tuple(value.shape) != tuple(init_value.shape):
      raise UserError(f"{source}: parameter {source_name!r} has shape {tuple(value.shape)} but "
                      f"the model's {name!r} is {tuple(init_value.shape)}; "
                      + (fix or "it is a checkpoint of another model"))
    out[name] = (jax.tree.map(jnp.asarray, value) if keep_dtype  # QArray: q and scale
                 else jnp.asarray(value, dtype=init_value.dtype))  # dtype cast (e.g. bf16 -> f32)
  return _unflatten_like(fresh_params, out), from_scratch


class Checkpointer:
  """Saves and restores train states in MODEL_DIR with an Orbax CheckpointManager."""

  def __init__(self, model_dir: str, config: SaveCheckpointConfig, *,
               log: Callable[[str], None] = print):
    self.scheme = storage.scheme(model_dir)  # '' (local disk), 'gs' or 's3'
    self.model_dir = storage.normalize(model_dir) if self.scheme else model_dir
    self.config = config
    orbax_dir = self.model_dir
    self._staging = None  # s3://: where Orbax writes a step before it is uploaded
    if self.scheme:
      storage.check_bucket(self.model_dir)  # a missing bucket: one line, before Orbax
    if self.scheme == "gs":
      storage.configure_tensorstore()
      if multihost.is_chief():
        self._finish_orbax_commits(log)
      multihost.sync("t5forge-checkpointer-orbax-commits")  # before any process's Orbax lists
    elif self.scheme == "s3":
      digest = hashlib.sha256(self.model_dir.encode()).hexdigest()[:16]
      self._staging = orbax_dir = os.path.join(storage.cache_root(), "staging", digest)
      shutil.rmtree(self._staging, ignore_errors=True)  # left by a killed run: not uploaded
      os.makedirs(self._staging)
    keep = []
    if config.keep is not None:
      keep.append(policies.LatestN(n=config.keep))
    if config.best_metric and config.keep_best:
      metric, reverse = config.best_metric, config.best_mode == "max"
      keep.append(policies.BestN(get_metric_fn=lambda m: m[metric], reverse=reverse,
                                 n=config.keep_best, keep_checkpoints_without_metrics=False))
    # s3://: the steps live in the bucket, not in Orbax's staging directory (_prune_bucket).
    policy = policies.AnyPreservationPolicy(keep) if keep and self.scheme != "s3" else None
    self._saving = None  # the directory of the save in flight
    self._extra_files: dict[str, str] = {}
    # Always Orbax's asynchronous checkpointer: its post-finalization callback writes the
    # manifest into the temporary directory before the commit; `save` waits when
    # saves are to be synchronous.
    options = ocp.CheckpointManagerOptions(
        step_prefix=native.CHECKPOINT_PREFIX.rstrip("_"), create=True,
        enable_async_checkpointing=True, preservation_policy=policy,
        cleanup_tmp_directories=True,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest))
    self._mngr = ocp.CheckpointManager(orbax_dir, options=options,
                                       item_handlers=self._item_handlers())

  def _finish_orbax_commits(self, log: Callable[[str], None]) -> None:
    """gs://: the steps committed by their manifest but not by Orbax's marker (a run stopped
    between the two writes) get the marker before Orbax starts here: it would take them for
    unfinished saves and delete them, and the run would start over without a word."""
    for step, names in sorted(native.bucket_steps(self.model_dir).items()):
      if manifest.needs_orbax_commit(names):
        manifest.finish_orbax_commit(self.step_dir(step))
        log(f"note: {self.step_dir(step)} was whole but its save was stopped before Orbax "
            "marked it committed; marked it")

  @staticmethod
  def _item_handlers() -> dict:
    return {native.PARAMS: ocp.StandardCheckpointHandler(),
            OPT_STATE: ocp.StandardCheckpointHandler(),
            native.CONFIG: ocp.JsonCheckpointHandler(),
            DATA_ITER: ocp.JsonCheckpointHandler()}

  def should_save(self, step: int, last_step: int) -> bool:
    return bool(step == last_step or (self.config.period and step % self.config.period == 0)
                or step in set(self.config.save_steps))

  def latest_step(self) -> int | None:
    """The newest committed step (not checked for damage)."""
    steps = native.checkpoint_steps(self.model_dir)
    return steps[-1] if steps else None

  def step_dir(self, step: int) -> str:
    return native.step_dir(self.model_dir, step)

  def _write_manifest(self) -> None:
    # Orbax runs this on the primary process after every process's files are written.
    if self.scheme == "gs":  # written in place: the manifest, last, commits it
      manifest.write_objects(self._saving, self._extra_files)
      return
    if self.scheme == "s3":
      local = os.path.join(self._staging, storage.basename(self._saving))
      manifest.write_staged(local, self._extra_files)
      storage.upload_tree(manifest.staged_dir(local), self._saving, last=(manifest.MANIFEST,))
      self._prune_bucket()
      return
    manifest.write_staged(self._saving, self._extra_files)

  def _prune_bucket(self) -> None:
    """Deletes the s3:// steps the preservation policy of `__init__` would (the latest
    `keep`, and the best `keep_best` by `best_metric`, stay; so does the newest)."""
    cfg = self.config
    best = bool(cfg.best_metric and cfg.keep_best)
    if cfg.keep is None and not best:
      return
    steps = native.checkpoint_steps(self.model_dir)
    keep = set(steps[-1:])
    if cfg.keep is not None:
      keep |= set(steps[len(steps) - cfg.keep:]) if cfg.keep else set()
    if best:
      scored = []
      for step in steps:
        try:
          meta = json.loads(storage.read_bytes(storage.join(self.step_dir(step),
                                                            manifest.ORBAX_METADATA)))
          value = (meta.get("metrics") or {}).get(cfg.best_metric)
        except (FileNotFoundError, ValueError, AttributeError):
          value = None  # damaged: no metric, as Orbax treats it
        if value is not None:
          scored.append((float(value), step))
      scored.sort(reverse=cfg.best_mode == "max")
      keep |= {step for _, step in scored[:cfg.keep_best]}
    for step in steps:
      if step not in keep:
        _delete_remote(self.step_dir(step))

  def _orbax(self, fn: Callable[[], Any], step: int | None = None) -> Any:
    """`fn()`, an Orbax save or wait; on a bucket its failure is one line naming the
    checkpoint (nothing of it was committed: its manifest is written last)."""
    try:
      return fn()
    except UserError:
      raise
    except Exception as e:  # network and bucket errors, in any form
      if not self.scheme:
        raise
      where = self.step_dir(step) if step is not None else self._saving or self.model_dir
      first = " ".join((str(e).strip().splitlines() or [type(e).__name__])[0].split())[:200]
      raise storage.StorageError(
          f"{where}: saving the checkpoint failed ({type(e).__name__}: {first}); it is not "
          f"committed (no {manifest.MANIFEST}), the previous checkpoints are untouched; "
          "check the network or the bucket and resume") from None

  def _finish(self) -> None:
    """Waits for the save in flight; on s3:// drops its uploaded local staging copy."""
    self._orbax(self._mngr.wait_until_finished)
    if self.scheme == "s3" and multihost.is_chief():
      names = [n for n in os.listdir(self._staging) if native.step_of(n) is not None]
      for name in names:
        shutil.rmtree(os.path.join(self._staging, name), ignore_errors=True)
      if names:
        self._mngr.reload()  # Orbax listed the staged steps

  def save(self, step: int, state, *, config_item: dict, data_state: Any = None,
           metrics: dict | None = None, extra_files: dict[str, str] | None = None) -> None:
    """Starts writing checkpoint_<step> (returns before it is on disk when async).
    `extra_files` ({name: text}) are written into it too (adapter training's
    adapter.json), covered by its manifest."""
    data_item = {"num_processes": jax.process_count(), "states": multihost.gather_json(data_state)}
    self._finish()  # the previous save's callback still reads _saving
    self._saving = self.step_dir(step)
    if self.scheme == "gs":
      # One request through storage first: a bucket out of reach is then a one-line
      # error before Orbax starts TensorStore writes, which retry for many minutes.
      storage.exists(storage.join(self._saving, manifest.MANIFEST))
    self._extra_files = dict(extra_files or {})
    self._orbax(lambda: self._mngr.save(step, args=ocp.args.Composite(**{
        native.PARAMS: ocp.args.StandardSave(state.params),
        OPT_STATE: ocp.args.StandardSave(state.opt_state),
        native.CONFIG: ocp.args.JsonSave({**config_item, manifest.EXPECTED: manifest.MANIFEST}),
        DATA_ITER: ocp.args.JsonSave(data_item),
    }), metrics=metrics, force=True), step)
    if not self.config.async_save:
      self._finish()

  def check_compatible(self, step: int, abstract_params: Any) -> None:
    """Names the first parameter whose saved shape differs from the model's."""
    if self.scheme == "s3":
      params_dir = os.path.join(storage.local_copy(self.step_dir(step)), native.PARAMS)
      stored = ocp.StandardCheckpointHandler().metadata(epath.Path(params_dir))
      saved = _flatten(getattr(stored, "tree", stored))
    else:
      meta = self._mngr.item_metadata(step)
      saved = _flatten(getattr(meta[native.PARAMS], "tree", meta[native.PARAMS]))
    want = _flatten(abstract_params)
    path = self.step_dir(step)
    for name, spec in want.items():
      if name not in saved:
        raise UserError(f"{path}: has no parameter {name!r}; it was written for another model "
                        "(use a new MODEL_DIR, or the matching model gin)")
      if tuple(saved[name].shape) != tuple(spec.shape):
        raise UserError(f"{path}: parameter {name!r} has shape {tuple(saved[name].shape)} but "
                        f"the model needs {tuple(spec.shape)}; it was written for another "
                        "model (use a new MODEL_DIR, or the matching model gin)")

  def restore(self, step: int, abstract_state, *, log: Callable[[str], None] = print
              ) -> tuple[Any, Any, dict]:
    """-> (params, opt_state, data item) of checkpoint_<step>, placed as abstract_state.

    A read that fails in a way that may pass (network, time-out, memory) is tried again
    after 1 s, then 2 s (`RESTORE_TRIES` in all).

    Raises:
      manifest.CheckpointDamaged: its files differ from its manifest, or Orbax cannot
        read a checkpoint that has none and the error cannot pass by itself.
      manifest.CheckpointUnavailable: the reads failed every try, or Orbax cannot read
        files that match their manifest; nothing shows damage (nothing is set aside).
      UserError: it was written for another model.
    """
    path = self.step_dir(step)
    note = manifest.verify(path)
    for tries in range(1, RESTORE_TRIES + 1):
      try:
        restored = self._read(step, path, abstract_state)
        break
      except UserError:
        raise
      except Exception as e:  # noqa: BLE001 # damage or a passing fault, in any form
        failure = manifest.read_failure(path, e, verified=note is None, tries=tries)
        if tries == RESTORE_TRIES or not manifest.is_passing(e):
          raise failure from None
        log(f"note: reading {path} failed ({type(e).__name__}); trying again in "
            f"{2 ** (tries - 1)} s")
        time.sleep(2 ** (tries - 1))
    if note:
      log(f"note: {note}")
    return restored[native.PARAMS], restored[OPT_STATE], restored[DATA_ITER]

  def _read(self, step: int, path: str, abstract_state) -> dict:
    self.check_compatible(step, abstract_state.params)
    args = ocp.args.Composite(**{
        native.PARAMS: ocp.args.StandardRestore(abstract_state.params),
        OPT_STATE: ocp.args.StandardRestore(abstract_state.opt_state),
        DATA_ITER: ocp.args.JsonRestore(),
    })
    if self.scheme == "s3":  # verified by `restore` on this same local copy
      return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**self._item_handlers())
                              ).restore(storage.local_copy(path), args)
    return self._mngr.restore(step, args=args)

  def restore_latest(self, abstract_state, *, log: Callable[[str], None] = print
                     ) -> tuple[int, tuple[Any, Any, dict]] | None:
    """The newest intact checkpoint of MODEL_DIR: (step, `restore`'s result), or None
    when there is no checkpoint.

    Each newer damaged checkpoint is named in one line and renamed aside to
    `checkpoint_<step>.damaged-<time>`: kept, but out of Orbax's sight, so that neither
    the preservation policy deletes it nor the save of that step again collides with it
    (Orbax refuses to save a step that exists). With no intact checkpoint nothing is
    renamed and UserError says so: starting over from scratch would silently drop the
    run's progress; the user decides (move them, or use another MODEL_DIR).
    """
    damaged = []
    for step in reversed(native.checkpoint_steps(self.model_dir)):
      try:
        restored = self.restore(step, abstract_state, log=log)
      except manifest.CheckpointDamaged as e:
        damaged.append(e)
        continue
      self._set_aside(damaged, used=self.step_dir(step), log=log)
      return step, restored
    if damaged:
      raise UserError(f"{self.model_dir}: every checkpoint is damaged, none was moved or "
                      f"deleted: {'; '.join(map(str, damaged))}. Move them aside (or use "
                      "another MODEL_DIR) to start again from INITIAL_CHECKPOINT_PATH or scratch")
    return None

  def _set_aside(self, damaged: list[manifest.CheckpointDamaged], *, used: str,
                 log: Callable[[str], None]) -> None:
    if not damaged:
      return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for error in damaged:
      aside = f"{error.path}.damaged-{stamp}"
      if multihost.is_chief():
        if self.scheme:  # no rename on a bucket: a copy, then the original deleted
          storage.copy_tree(error.path, aside)
          _delete_remote(error.path)
        else:
          os.rename(error.path, aside)
      log(f"note: {error}; {'moved' if self.scheme else 'renamed'} it to "
          f"{storage.basename(aside)} (kept) and resumed from {storage.basename(used)}")
    multihost.sync("t5forge_damaged_checkpoints_set_aside")
    if self.scheme == "gs":  # Orbax lists the bucket through its own client
      storage.forget_shared_listings(self.model_dir)
    self._mngr.reload()  # Orbax listed the damaged steps when it started

  def wait(self) -> None:
    self._finish()

  def close(self) -> None:
    try:
      self._finish()
    finally:
      # Orbax starts cleaning up unfinished saves in a thread when the manager is made, and
      # waits for it only at the first save, not in close(): a run that stopped before one
      # (a configuration error) exited under that thread, whose next executor call then
      # printed "RuntimeError: cannot schedule new futures after shutdown" after the error.
      self._mngr._maybe_await_cleanup_tmp_directory()  # noqa: SLF001 (Orbax has no public wait)
      self._mngr.close()
      if self._staging:
        shutil.rmtree(self._staging, ignore_errors=True)


def _delete_remote(step_url: str) -> None:
  """Deletes a checkpoint under a bucket prefix, its manifest (the commit marker) first:
  one cut short is no longer listed as a checkpoint."""
  storage.remove(storage.join(step_url, manifest.MANIFEST))
  storage.rmtree(step_url)


def data_state_for_this_process(data_item: dict | None) -> Any:
  """The saved iterator state of this process, or None if it cannot be used.

  In 'rows' shard mode every process's iterator reads the same global stream, so the
  states are equal and any process count can continue from the first one."""
  if not data_item:
    return None
  states = data_item.get("states") or []
  if states and all(s == states[0] for s in states) and (
      (states[0] or {}).get("pipeline", {}).get("shard") == [0, 1]):
    return states[0]
  if data_item.get("num_processes") != jax.process_count():
    return None
  return states[jax.process_index()] if jax.process_index() < len(states) else None


def initial_params(config: RestoreCheckpointConfig, fresh_params: Any, *, model_config,
                   base_dtype: str | None = None) -> tuple[Any, int, list[str], list[str]]:
  """Parameters to start training from INITIAL_CHECKPOINT_PATH.

  Args:
    fresh_params: a freshly initialised parameter tree of the model (its shapes and
      dtypes are the target; its values fill what the checkpoint does not provide).
    base_dtype: read a frozen base stored as this (`convert.load_checkpoint`: an HF
      checkpoint is cast tensor by tensor as it is read) and keep its dtypes.

  Returns:
    (params, step to continue from, names initialised fresh, notes on config fields
    that differ between the checkpoint and the model without changing shapes).
  """
  if config.dtype != "float32":
    raise UserError(f"RestoreCheckpointConfig.dtype={config.dtype!r}: parameters are float32")
  if config.mode == "all":
    raise UserError("RestoreCheckpointConfig.mode='all' is for `t5forge eval`; training "
                    "starts from one checkpoint: use 'specific' or 'latest'")
  # 'latest' and 'specific' alike: a MODEL_DIR means its newest intact checkpoint
  # (`convert.paths.resolve`, through `load_checkpoint`).
  ckpt = load_checkpoint(config.path, scan_layers=model_config.scan_layers,
                         base_dtype=base_dtype)
  fix = None
  theirs, ours = ckpt.config.architecture, model_config.architecture
  if theirs != ours:  # e.g. a T5 checkpoint given to a T5Gemma model gin
    fix = (f"include {_MODEL_GINS.get(theirs, f'a model gin of architecture {theirs!r}')} to "
           f"start from this checkpoint, or set INITIAL_CHECKPOINT_PATH to a checkpoint of "
           f"architecture {ours!r}")
  params, scratch = remap_params(ckpt.params, fresh_params, config,
                                 source=ckpt.source_for(model_config), fix=fix,
                                 keep_dtype=base_dtype is not None)
  semantic = ("mlp_activations", "logits_via_embedding", "should_scale_logits",
              "relative_attention_max_distance", "layer_norm_epsilon")
  notes = [f"{name}: checkpoint {getattr(ckpt.config, name)!r}, model {getattr(model_config, name)!r}"
           for name in semantic if getattr(ckpt.config, name) != getattr(model_config, name)]
  return params, (ckpt.step if config.restore_step else 0), scratch, notes


def initial_second_moments(config: RestoreCheckpointConfig, opt_state: Any, opt_axes: Any,
                           param_axes: Any, *, model_config) -> tuple[Any, list[str]]:
  """The run's fresh optimizer state with a Mesh TF checkpoint's Adafactor slots in it,
  where the run's Adafactor factors each parameter the same way
  (`optim.seed_second_moments`); other formats: as it is.

  Returns:
    (optimizer state, lines for the log: what was seeded and what was left fresh).
  """
  local, _ = convert.locate(config.path)  # a bucket's copy is cached: not fetched again
  if convert.detect_format(local) != convert.MTF:
    return opt_state, []
  if model_config.scan_layers:
    return opt_state, [f"{config.path}: Mesh TF Adafactor slots not used: the model scans "
                       "its layers (scan_layers), the slots are per layer"]
  moments = mtf.read_slots(local)
  if not moments:
    return opt_state, []
  opt_state, seeded, fresh = optim.seed_second_moments(opt_state, opt_axes, param_axes, moments)
  notes = [f"Adafactor second moments of {seeded} parameter(s) from the Mesh TF slots of "
           f"{config.path}"]
  if fresh:
    notes.append(f"{len(fresh)} parameter(s) start with fresh second moments (the run's "
                 f"optimizer does not factor them as the checkpoint's did): "
                 f"{', '.join(fresh[:3])}{', ...' if len(fresh) > 3 else ''}")
  return opt_state, notes
