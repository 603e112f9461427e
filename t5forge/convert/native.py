"""t5forge's own checkpoint directory: an Orbax composite checkpoint.

Layout of one checkpoint (a training step `MODEL_DIR/checkpoint_<step>/`, or the output
of `t5forge convert --to t5forge`):

    <dir>/config/     JSON: {"model": ModelConfig fields, "vocabulary": spec or null, ...}
    <dir>/params/     the parameter tree (orbax StandardCheckpointHandler)
    <dir>/opt_state/  optimizer state (training checkpoints only)
    <dir>/data_iter/  data iterator state (training checkpoints only)
    <dir>/t5forge_manifest.json  size and sha256 of every file (`manifest`), committed
                      with the rest

A MODEL_DIR holds several `checkpoint_<step>` directories; the newest intact one (files
matching the manifest) is what `t5forge.load(MODEL_DIR)`, `eval` and `infer` read, each
damaged one skipped with a note (`convert.paths.resolve`); a resumed run does the same
(`train.checkpoint`). Reading one damaged checkpoint directory is a one-line UserError.

Reading is two steps, so that a caller can decide where the parameters go before any is
read: `read_header` (manifest check, config) and `restore_params` onto targets that carry
their shardings (the opener's mesh, training's state). `load` does both onto one device.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys

import jax
import numpy as np

from t5forge import storage
from t5forge.convert import manifest
from t5forge.errors import UserError
from t5forge.nn import abstract_params as _abstract
from t5forge.nn.config import ModelConfig

PARAMS = "params"
CONFIG = "config"
CHECKPOINT_PREFIX = "checkpoint_"
_STEP_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def step_dir(model_dir: str, step: int) -> str:
  """MODEL_DIR/checkpoint_<step> (a URL under a bucket MODEL_DIR)."""
  return storage.join(model_dir, f"{CHECKPOINT_PREFIX}{step}")


def step_of(path: str) -> int | None:
  """The step of a `checkpoint_<step>` directory, None for a directory of another name."""
  name = storage.basename(path) if storage.is_remote(path) else os.path.basename(
      os.path.normpath(path))
  m = _STEP_DIR.match(name)
  return int(m.group(1)) if m else None


def absolute(path: str) -> str:
  """A local path made absolute (Orbax takes no other); a bucket URL normalized."""
  return storage.normalize(path) if storage.is_remote(path) else os.path.abspath(path)


def is_native_checkpoint(path: str) -> bool:
  """A single t5forge checkpoint directory (not a MODEL_DIR), intact or not. On a bucket
  its manifest is its commit marker: a prefix without one is no checkpoint."""
  if storage.is_remote(path):
    return storage.isfile(storage.join(path, manifest.MANIFEST))
  return (os.path.isdir(os.path.join(path, PARAMS)) and os.path.isdir(os.path.join(path, CONFIG))
          or os.path.isfile(os.path.join(path, manifest.MANIFEST)))


def is_complete(path: str) -> bool:
  """Committed by Orbax: written under a temporary name and renamed into place, so a
  `checkpoint_<step>` directory of ours is whole unless damaged since (`manifest.verify`
  says). The same steps Orbax's CheckpointManager sees, so that none of them is hidden
  from the damage checks while Orbax would still delete or refuse to overwrite it.
  On a bucket (no rename) the manifest, written after every other file, commits it."""
  if storage.is_remote(path):
    return is_native_checkpoint(path)
  return is_native_checkpoint(path) or os.path.isfile(os.path.join(path,
                                                                   manifest.ORBAX_METADATA))


def checkpoint_steps(model_dir: str) -> list[int]:
  """Steps of the committed checkpoints in MODEL_DIR, ascending (intact or not; a damaged
  one set aside by training is renamed `checkpoint_<step>.damaged-<time>` and not listed)."""
  if storage.is_remote(model_dir):
    return sorted(step for step, have in bucket_steps(model_dir).items()
                  if manifest.committed_on_bucket(have))
  if not os.path.isdir(model_dir):
    return []
  steps = []
  for name in os.listdir(model_dir):
    m = _STEP_DIR.match(name)
    if m and is_complete(os.path.join(model_dir, name)):
      steps.append(int(m.group(1)))
  return sorted(steps)


def bucket_steps(model_dir: str) -> dict[int, set[str]]:
  """{step: names of its top-level objects} of every `checkpoint_<step>` prefix under the
  bucket MODEL_DIR, committed or not, from one listing."""
  names: dict[int, set[str]] = {}
  for found in storage.glob(storage.join(model_dir, f"{CHECKPOINT_PREFIX}*", "*")):
    step = step_of(storage.dirname(found))
    if step is not None:
      names.setdefault(step, set()).add(storage.basename(found))
  return names


def latest_checkpoint(model_dir: str) -> str | None:
  """The newest checkpoint of MODEL_DIR whose files match its manifest (or that has none
  to check), None when MODEL_DIR has none. Each newer damaged one is named in a note on
  stderr; UserError when every one is damaged."""
  damaged = []
  for step in reversed(checkpoint_steps(model_dir)):
    path = step_dir(model_dir, step)
    try:
      manifest.verify(path)
    except manifest.CheckpointDamaged as e:
      damaged.append(str(e))
      continue
    for line in damaged:
      print(f"note: {line}; reading {path}", file=sys.stderr)
    return path
  if damaged:
    raise UserError(f"{model_dir}: every checkpoint is damaged: {'; '.join(damaged)}")
  return None


def _orbax():
  """orbax.checkpoint, with TensorStore (its array I/O) pointed at the storage emulator
  when one is set: a gs:// checkpoint read outside a training run's Checkpointer (an
  INITIAL_CHECKPOINT_PATH, `t5forge.load`) goes where gcsfs goes."""
  import orbax.checkpoint as ocp  # noqa: PLC0415 (slow import, on first use)
  storage.configure_tensorstore()
  return ocp


def _checkpointer():
  ocp = _orbax()
  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save(path: str, config: ModelConfig, params: dict, *, extra_config: dict | None = None) -> None:
  """Writes a params-only checkpoint with its manifest (what `convert --to t5forge` produces)."""
  ocp = _orbax()
  path = os.path.abspath(path)
  if os.path.exists(path) and os.listdir(path):
    raise UserError(f"{path}: exists and is not empty; choose a new output directory")
  if os.path.isdir(path):
    os.rmdir(path)
  meta = {"model": config.to_dict(), **(extra_config or {}), manifest.EXPECTED: manifest.MANIFEST}
  # Orbax writes to a temporary directory and renames it on success (atomic commit); the
  # manifest goes into that directory just before the rename.
  ckpt = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler(), async_options=ocp.AsyncOptions(
      post_finalization_callback=lambda: manifest.write_staged(path)))
  try:
    ckpt.save(path, ocp.args.Composite(**{
        PARAMS: ocp.args.StandardSave(jax.tree.map(np.asarray, params)),
        CONFIG: ocp.args.JsonSave(meta)}))
    ckpt.wait_until_finished()
  finally:
    ckpt.close()


def read_config(path: str) -> dict:
  """The JSON config item of a checkpoint: {"model": {...}, ...}."""
  ocp, ckpt = _checkpointer()
  # Orbax takes absolute paths only.
  return ckpt.restore(absolute(path),
                      ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]


def _shape_difference(path: str, abstract_params) -> str | None:
  """The first parameter whose stored name or shape differs from `abstract_params`'s
  ('encoder/.../kernel: stored (64, 32), config (64, 16)'), None when all agree (or the
  stored shapes cannot be read: then the restore's own error says what went wrong)."""
  ocp = _orbax()
  from etils import epath  # noqa: PLC0415 (Orbax's path type: local or gs://)
  try:
    stored = ocp.StandardCheckpointHandler().metadata(
        (epath.Path(path) if storage.is_remote(path) else pathlib.Path(path)) / PARAMS)
  except Exception:  # noqa: BLE001 # unreadable metadata: no verdict
    return None

  def shapes(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in key): tuple(getattr(v, "shape", ()))
            for key, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

  have, want = shapes(stored), shapes(abstract_params)
  for name in sorted(set(have) | set(want)):
    if name not in have:
      return f"{name}: not in the checkpoint"
    if name not in want:
      return f"{name}: in the checkpoint, not in the config"
    if have[name] != want[name]:
      return f"{name}: stored {have[name]}, config {want[name]}"
  return None


def read_header(path: str) -> tuple[ModelConfig, dict]:
  """Checks a checkpoint directory against its manifest and reads its config item.

  Args:
    path: a `checkpoint_<step>` directory (or a converted one); messages name it as given.

  Returns:
    (config, the whole JSON config item).

  Raises:
    manifest.CheckpointDamaged (a UserError) naming what is damaged.
  """
  if not is_native_checkpoint(path):
    raise UserError(f"{path}: not a t5forge checkpoint (needs params/ and config/ inside)")
  note = manifest.verify(absolute(path))
  if note:
    print(f"note: {note}", file=sys.stderr)
  try:
    meta = read_config(path)
  except Exception as e:  # noqa: BLE001 # damage or a passing fault, in any form
    raise manifest.read_failure(path, e, verified=note is None) from None
  return ModelConfig.from_dict(meta["model"], source=storage.join(path, CONFIG)), meta


def restore_params(path: str, abstract_params) -> dict:
  """Restores the parameters of a checkpoint directory straight onto their targets.

  Args:
    path: a checkpoint directory whose header was read (`read_header`).
    abstract_params: tree of jax.ShapeDtypeStruct with shardings: each array is read
      into its shards on the devices the sharding names, no full copy elsewhere first.

  Returns:
    The parameter tree of jax arrays placed as `abstract_params` says.

  Raises:
    UserError: the stored parameters differ in name or shape from `abstract_params`.
    manifest.CheckpointDamaged: Orbax cannot read them.
    manifest.CheckpointUnavailable: reading failed in a way that may pass (network, memory).
  """
  ocp = _orbax()
  # Compared before restoring: Orbax restores a stored array into a target of another
  # shape without a word.
  difference = _shape_difference(absolute(path), abstract_params)
  if difference:
    raise UserError(f"{path}: parameters do not match the config stored with them "
                    f"({difference})")
  try:
    # Orbax takes absolute paths only.
    restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        absolute(path), ocp.args.Composite(**{
            PARAMS: ocp.args.StandardRestore(abstract_params)}))
  except Exception as e:  # noqa: BLE001 # Orbax raises many kinds
    # read_header verified the files (or said they could not be): damage is what may not pass
    raise manifest.read_failure(path, e, verified=False) from None
  return restored[PARAMS]


def load(path: str, *, abstract_params=None) -> tuple[ModelConfig, dict, dict]:
  """Reads params and config from one checkpoint directory, checked against its manifest,
  for a caller that converts them (`convert.load_checkpoint`: another layout, another
  format); `opener.open_checkpoint` restores onto the mesh instead.

  Args:
    path: a `checkpoint_<step>` directory (or a converted one).
    abstract_params: optional tree of ShapeDtypeStruct (with shardings) to restore onto;
      default this process's first device.

  Returns:
    (config, params, the whole JSON config item).

  Raises:
    manifest.CheckpointDamaged (a UserError) naming what is damaged.
  """
  config, meta = read_header(path)
  if abstract_params is None:
    # Place on this process's first device: a checkpoint written by another mesh or
    # process count restores anywhere once the target says where.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract_params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), _abstract(config))
  return config, restore_params(path, abstract_params), meta


def remove(path: str) -> None:
  if storage.is_remote(path):
    storage.rmtree(path)
    return
  shutil.rmtree(path, ignore_errors=True)
