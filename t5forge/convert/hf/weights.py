"""The weight files of a Hugging Face directory: read (safetensors tensor by tensor, or
PyTorch pickles without torch, one file or shards with an index) and written as
transformers writes safetensors."""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Callable, Iterator

import ml_dtypes
import numpy as np
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


# safetensors' dtype names -> numpy (bfloat16 and float8 through ml_dtypes, as torch_pickle).
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class _SafetensorsFile:
  """The header of one safetensors file (8-byte little-endian length, JSON header, then
  the tensors' bytes), and its tensors read one at a time.

  Read with positioned reads, not `safetensors.safe_open`: safe_open memory-maps the file,
  and every page it reads stays resident in the process (counted in its RSS, and against
  a container's memory limit) until the file is closed, so reading a 44 GB checkpoint
  through it holds the whole file at once. A read here holds the one tensor asked for.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
          raise ValueError(f"header length {n} does not fit in a {size}-byte file")
        header = json.loads(f.read(n))
      if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
      header.pop("__metadata__", None)
      self.entries = {name: (e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"]))
                      for name, e in header.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise UserError(f"{path}: cannot read safetensors file ({e})") from None
    self.data_start = 8 + n

  def read(self, name: str) -> np.ndarray:
    """The tensor `name`, in the dtype and shape stored."""
    dtype_name, shape, (start, end) = self.entries[name]
    dtype = _SAFETENSORS_DTYPES.get(dtype_name)
    if dtype is None:
      raise UserError(f"{self.path}: tensor {name!r} has dtype {dtype_name}, which t5forge "
                      f"does not read; known: {sorted(_SAFETENSORS_DTYPES)}")
    out = np.empty(end - start, np.uint8)
    with open(self.path, "rb") as f:
      f.seek(self.data_start + start)
      got = f.readinto(memoryview(out))
    if got != end - start or out.size != int(np.prod(shape)) * np.dtype(dtype).itemsize:
      raise UserError(f"{self.path}: tensor {name!r} is truncated or its header is wrong "
                      f"({got} of {end - start} bytes for shape {list(shape)} {dtype_name})")
    return out.view(dtype).reshape(shape)


class WeightState(Mapping):
  """{HF weight name: numpy array} of a directory's weight files, each tensor read from
  disk when it is looked up and not kept: a caller that converts one tensor at a time
  and drops it holds one tensor of the checkpoint at a time, never the whole file.

  safetensors files are read tensor by tensor (`_SafetensorsFile`); a PyTorch pickle has
  no such index, so `pytorch_model.bin` files are read whole on opening, as before.
  Looking a name up twice reads it twice.
  """

  def __init__(self, readers: dict[str, Callable[[], np.ndarray]]):
    self._readers = readers

  def __getitem__(self, name: str) -> np.ndarray:
    return self._readers[name]()

  def __iter__(self) -> Iterator[str]:
    return iter(self._readers)

  def __len__(self) -> int:
    return len(self._readers)

  def renamed(self, names: dict[str, str]) -> WeightState:
    """The weights `names` lists ({new name: name here}), under their new names; still
    read on look-up."""
    return WeightState({new: self._readers[old] for new, old in names.items()})


def _readers_of(path: str, kind: str) -> dict[str, Callable[[], np.ndarray]]:
  if kind == "safetensors":
    st = _SafetensorsFile(path)
    return {name: functools.partial(st.read, name) for name in st.entries}
  state = load_torch_state_dict(path)
  return {name: functools.partial(state.__getitem__, name) for name in state}


def _weight_files(model_dir: str) -> tuple[list[str], str]:
  """The weight files of `model_dir` (shards in name order) and their kind."""
  for index, kind in ((SAFETENSORS_INDEX, "safetensors"), (TORCH_INDEX, "torch")):
    path = os.path.join(model_dir, index)
    if os.path.isfile(path):
      weight_map = (read_json(path) or {}).get("weight_map", {})
      names = sorted(set(weight_map.values()))
      missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
      if missing:
        raise UserError(f"{path} lists shard(s) {missing} that are not in {model_dir}")
      return [os.path.join(model_dir, n) for n in names], kind
  for single, kind in ((SAFETENSORS, "safetensors"), (TORCH_BIN, "torch")):
    path = os.path.join(model_dir, single)
    if os.path.isfile(path):
      return [path], kind
  raise UserError(f"{model_dir}: no weights found; expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                  f"{TORCH_BIN} or {TORCH_INDEX} next to config.json")


def load_hf_state(model_dir: str) -> WeightState:
  """All weights of an HF directory as {name: numpy array} (dtypes as stored), each read
  when it is looked up (`WeightState`)."""
  paths, kind = _weight_files(model_dir)
  readers: dict[str, Callable[[], np.ndarray]] = {}
  for path in paths:
    readers.update(_readers_of(path, kind))
  return WeightState(readers)


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
