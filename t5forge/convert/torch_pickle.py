"""Reads `pytorch_model.bin` files without importing PyTorch.

A `torch.save` file is a zip archive: `<name>/data.pkl` pickles the state dict, and each
tensor's storage is the raw little-endian bytes of `<name>/data/<key>`. Unpickling with
our own `persistent_load` and a whitelist of the two rebuild functions gives numpy arrays.
Nothing else in the pickle is trusted or executed.
"""
from __future__ import annotations

import collections
import pickle
import zipfile

import ml_dtypes
import numpy as np

from t5forge.errors import UserError

_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
  def __init__(self, name: str):
    self.dtype = _STORAGE_DTYPES.get(name)
    self.name = name


def _rebuild_tensor(storage, offset, size, stride, *unused):
  arr, _ = storage
  if not size:
    return arr[offset].copy()
  itemsize = arr.dtype.itemsize
  return np.lib.stride_tricks.as_strided(
      arr[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)).copy()


def _rebuild_parameter(data, requires_grad=None, backward_hooks=None, *unused):
  return data


class _Unpickler(pickle.Unpickler):

  def __init__(self, file, zf: zipfile.ZipFile, prefix: str, path: str):
    super().__init__(file)
    self._zf, self._prefix, self._path = zf, prefix, path

  def find_class(self, module, name):
    if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
      return _rebuild_tensor
    if module == "torch._utils" and name == "_rebuild_parameter":
      return _rebuild_parameter
    if module == "torch" and name.endswith("Storage"):
      return _StorageType(name)
    if module == "collections" and name == "OrderedDict":
      return collections.OrderedDict
    if module == "torch" and name in ("float32", "float16", "bfloat16", "int64", "bool"):
      return name
    raise UserError(f"{self._path}: unsupported object {module}.{name} in the pickle; "
                    "convert the checkpoint to model.safetensors with transformers")

  def persistent_load(self, pid):
    # ('storage', storage_type, key, location, numel)
    _, storage_type, key, _, numel = pid
    dtype = storage_type.dtype
    if dtype is None:
      raise UserError(f"{self._path}: unsupported tensor storage {storage_type.name}")
    raw = self._zf.read(f"{self._prefix}/data/{key}")
    return np.frombuffer(raw, dtype=dtype, count=numel), key


def load_torch_state_dict(path: str) -> dict[str, np.ndarray]:
  """`pytorch_model.bin` -> {name: numpy array}. Only the zip format (torch >= 1.6)."""
  if not zipfile.is_zipfile(path):
    raise UserError(f"{path}: not a zip-format torch checkpoint (saved by torch < 1.6?); "
                    "re-save it with a recent torch or as model.safetensors")
  with zipfile.ZipFile(path) as zf:
    pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
    if not pkl:
      raise UserError(f"{path}: no data.pkl inside; not a torch checkpoint")
    prefix = pkl[0][: -len("/data.pkl")]
    with zf.open(pkl[0]) as f:
      state = _Unpickler(f, zf, prefix, path).load()
  if not isinstance(state, dict):
    raise UserError(f"{path}: expected a state dict, found {type(state).__name__}")
  return {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
