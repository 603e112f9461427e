"""The weight files of a Hugging Face directory: read (safetensors, or PyTorch pickles without
torch, one file or shards with an index) and written as transformers writes safetensors."""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from t5forge import files
from t5forge.convert.hf.config_files import CONFIG_FILE, read_json
from t5forge.convert.torch_pickle import load_torch_state_dict
from t5forge.errors import UserError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size, "5GB"


def is_hf_dir(path: str) -> bool:
  """Whether `path` holds config.json and weights in one of the forms `load_state` reads."""
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) and any(
      os.path.isfile(os.path.join(path, f))
      for f in (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_INDEX))


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  try:
    with safe_open(path, framework="numpy") as f:
      return {k: f.get_tensor(k) for k in f.keys()}
  except Exception as e:  # noqa: BLE001 (safetensors raises its own SafetensorError)
    raise UserError(f"{path}: cannot read safetensors file ({e})") from None


def _weight_files(model_dir: str) -> tuple[list[str], Callable[[str], dict[str, np.ndarray]]]:
  """The weight files of `model_dir` (shards in name order) and the reader for them."""
  for index, reader in ((SAFETENSORS_INDEX, _read_safetensors),
                        (TORCH_INDEX, load_torch_state_dict)):
    path = os.path.join(model_dir, index)
    if os.path.isfile(path):
      weight_map = (read_json(path) or {}).get("weight_map", {})
      names = sorted(set(weight_map.values()))
      missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
      if missing:
        raise UserError(f"{path} lists shard(s) {missing} that are not in {model_dir}")
      return [os.path.join(model_dir, n) for n in names], reader
  for single, reader in ((SAFETENSORS, _read_safetensors), (TORCH_BIN, load_torch_state_dict)):
    path = os.path.join(model_dir, single)
    if os.path.isfile(path):
      return [path], reader
  raise UserError(f"{model_dir}: no weights found; expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                  f"{TORCH_BIN} or {TORCH_INDEX} next to config.json")


def load_hf_state(model_dir: str) -> dict[str, np.ndarray]:
  """All weights of an HF directory as {name: numpy array} (dtypes as stored)."""
  paths, reader = _weight_files(model_dir)
  state: dict[str, np.ndarray] = {}
  for path in paths:
    state.update(reader(path))
  return state


def write_safetensors(state: dict[str, np.ndarray], out_dir: str, *,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes `state` as transformers does: one `model.safetensors`, or, when larger than
  `max_shard_bytes`, `model-0000i-of-0000n.safetensors` shards (tensors in name order, a
  shard closed before it would pass the limit) plus `model.safetensors.index.json`.

  `out_dir` is a staged directory (`t5forge.files.staged_dir`): it appears whole or not at
  all, so the files are written in place.

  Returns:
    The file names written.
  """
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(state):
    nbytes = state[name].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = state[name]
    size += nbytes
  if len(shards) == 1:
    save_file(state, os.path.join(out_dir, SAFETENSORS), metadata={"format": "pt"})
    return [SAFETENSORS]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for fname, shard in zip(names, shards):
    save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
    weight_map.update({k: fname for k in shard})
  index = {"metadata": {"total_size": int(sum(v.nbytes for v in state.values()))},
           "weight_map": weight_map}
  files.write_json(os.path.join(out_dir, SAFETENSORS_INDEX), index, sort_keys=True)
  return names + [SAFETENSORS_INDEX]
