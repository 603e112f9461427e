"""t5forge's own checkpoint directory: an Orbax composite checkpoint.

Layout of one checkpoint (a training step `MODEL_DIR/checkpoint_<step>/`, or the output
of `t5forge convert --to t5forge`):

    <dir>/config/     JSON: {"model": ModelConfig fields, "vocabulary": spec or null, ...}
    <dir>/params/     the parameter tree (orbax StandardCheckpointHandler)
    <dir>/opt_state/  optimizer state (training checkpoints only)
    <dir>/data_iter/  data iterator state (training checkpoints only)

A MODEL_DIR holds several `checkpoint_<step>` directories; the latest complete one is
what `t5forge.load(MODEL_DIR)` and a resumed run read.
"""
from __future__ import annotations

import os
import re
import shutil

import jax
import numpy as np

from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig

PARAMS = "params"
CONFIG = "config"
CHECKPOINT_PREFIX = "checkpoint_"
_STEP_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
_METADATA = "_CHECKPOINT_METADATA"


def is_native_checkpoint(path: str) -> bool:
  """A single t5forge checkpoint directory (not a MODEL_DIR)."""
  return os.path.isdir(os.path.join(path, PARAMS)) and os.path.isdir(os.path.join(path, CONFIG))


def is_complete(path: str) -> bool:
  # Orbax writes into a temporary name and renames on commit; the metadata file is
  # written last, so its presence means the step is whole.
  return is_native_checkpoint(path) and os.path.isfile(os.path.join(path, _METADATA))


def checkpoint_steps(model_dir: str) -> list[int]:
  """Steps of the complete checkpoints in MODEL_DIR, ascending."""
  if not os.path.isdir(model_dir):
    return []
  steps = []
  for name in os.listdir(model_dir):
    m = _STEP_DIR.match(name)
    if m and is_complete(os.path.join(model_dir, name)):
      steps.append(int(m.group(1)))
  return sorted(steps)


def latest_checkpoint(model_dir: str) -> str | None:
  steps = checkpoint_steps(model_dir)
  return os.path.join(model_dir, f"{CHECKPOINT_PREFIX}{steps[-1]}") if steps else None


def _checkpointer():
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save(path: str, config: ModelConfig, params: dict, *, extra_config: dict | None = None) -> None:
  """Writes a params-only checkpoint (what `convert --to t5forge` produces)."""
  ocp, ckpt = _checkpointer()
  path = os.path.abspath(path)
  if os.path.exists(path) and os.listdir(path):
    raise UserError(f"{path}: exists and is not empty; choose a new output directory")
  if os.path.isdir(path):
    os.rmdir(path)
  meta = {"model": config.to_dict(), **(extra_config or {})}
  # Orbax writes to a temporary directory and renames it on success (atomic commit).
  ckpt.save(path, ocp.args.Composite(**{
      PARAMS: ocp.args.StandardSave(jax.tree.map(np.asarray, params)),
      CONFIG: ocp.args.JsonSave(meta)}))


def read_config(path: str) -> dict:
  """The JSON config item of a checkpoint: {"model": {...}, ...}."""
  ocp, ckpt = _checkpointer()
  return ckpt.restore(path, ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]


def load(path: str, *, abstract_params=None) -> tuple[ModelConfig, dict, dict]:
  """Reads params and config from one checkpoint directory.

  Args:
    path: a `checkpoint_<step>` directory (or a converted one).
    abstract_params: optional tree of ShapeDtypeStruct (with shardings) to restore onto.

  Returns:
    (config, params, the whole JSON config item).
  """
  ocp, ckpt = _checkpointer()
  if not is_native_checkpoint(path):
    raise UserError(f"{path}: not a t5forge checkpoint (needs params/ and config/ inside)")
  meta = read_config(path)
  config = ModelConfig.from_dict(meta["model"], source=os.path.join(path, CONFIG))
  if abstract_params is None:
    from t5forge.nn import abstract_params as _abstract  # pylint: disable=import-outside-toplevel
    # Place on this process's first device: a checkpoint written by another mesh or
    # process count restores anywhere once the target says where.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract_params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), _abstract(config))
  try:
    restored = ckpt.restore(path, ocp.args.Composite(**{
        PARAMS: ocp.args.StandardRestore(abstract_params)}))
  except (ValueError, KeyError) as e:
    raise UserError(f"{path}: parameters do not match the config stored with them ({e})") from None
  return config, restored[PARAMS], meta


def remove(path: str) -> None:
  shutil.rmtree(path, ignore_errors=True)
