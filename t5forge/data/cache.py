"""The on-disk cache of a task's offline stage, and stable fingerprints of preprocessors.

A cached split lives at `<cache_dir>/<task>/<fingerprint>/<split>.array_record`:
one msgpack record per example (numpy arrays kept with dtype and shape), written
to a temp name and renamed. The fingerprint hashes the source (files, sizes,
mtimes or in-memory content), every offline preprocessor (qualified name, a hash
of its source code, its bound arguments), the output features' vocabularies and
the sequence lengths; anything without a stable identity (a lambda's closure, an
object whose repr is an address) disables the cache rather than risk reuse.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from t5forge.data import files
from t5forge.data.array_records import ArrayRecordFiles
from t5forge.data import sources as src
from t5forge.data.vocab import Vocabulary
from t5forge.errors import UserError

_UNSTABLE = "<unstable>"


def fn_fingerprint(fn: Any) -> Any:
  """A JSON-able, stable description of a preprocessor or of one of its arguments."""
  if isinstance(fn, functools.partial):
    return [fn_fingerprint(fn.func), [fn_fingerprint(a) for a in fn.args],
            {k: fn_fingerprint(v) for k, v in sorted(fn.keywords.items())}]
  if isinstance(fn, Vocabulary):
    return fn.fingerprint()
  if hasattr(fn, "vocabulary") and isinstance(fn.vocabulary, Vocabulary):  # a Feature
    return ["Feature", fn.vocabulary.fingerprint(), getattr(fn, "add_eos", None)]
  if callable(fn) and hasattr(fn, "__qualname__"):
    if "<lambda>" in fn.__qualname__ or getattr(fn, "__closure__", None):
      return _UNSTABLE  # captured values are invisible to us
    try:
      code = hashlib.sha1(inspect.getsource(fn).encode()).hexdigest()[:12]
    except (OSError, TypeError):
      code = ""
    return f"{getattr(fn, '__module__', '')}.{fn.__qualname__}:{code}"
  text = repr(fn)
  return _UNSTABLE if " at 0x" in text else text


def fingerprint(parts: Any) -> str | None:
  """A short hash of `parts`, or None if any part has no stable identity."""
  text = json.dumps(parts, sort_keys=True, default=repr)
  if _UNSTABLE in text:
    return None
  return hashlib.sha1(text.encode()).hexdigest()[:16]


def encode_example(ex: Mapping[str, Any]) -> bytes:
  import msgpack  # noqa: PLC0415 (slow import, on first use)
  packed = {}
  for k, v in ex.items():
    if isinstance(v, np.ndarray):
      packed[k] = {"__nd__": v.dtype.str, "shape": list(v.shape), "data": v.tobytes()}
    elif isinstance(v, np.generic):
      packed[k] = v.item()
    else:
      packed[k] = v
  return msgpack.packb(packed, use_bin_type=True)


def decode_example(data: bytes) -> dict:
  import msgpack  # noqa: PLC0415 (slow import, on first use)
  out = msgpack.unpackb(data, raw=False)
  for k, v in out.items():
    if isinstance(v, dict) and "__nd__" in v:
      out[k] = np.frombuffer(v["data"], np.dtype(v["__nd__"])).reshape(v["shape"]).copy()
  return out


def write_records(path: str, examples: Iterable[Mapping[str, Any]]) -> int:
  """Writes the examples to an ArrayRecord file atomically; returns the count."""
  from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415 (slow import, on first use)
  # Concurrent writers produce the same bytes; the last rename wins.
  with files.cache_path(path) as tmp:
    writer = ArrayRecordWriter(tmp, "group_size:1")  # group size 1: cheap random access
    count = 0
    try:
      for ex in examples:
        writer.write(encode_example(ex))
        count += 1
    finally:
      writer.close()
    if count == 0:
      raise UserError(f"no examples left after preprocessing (while caching {path})")
  files.atomic_write_bytes(path + ".json", json.dumps({"examples": count}).encode())
  return count


class RecordSource(src.SplitSource):
  """A cached offline stage: msgpack records in an ArrayRecord file."""

  def __init__(self, path: str):
    self._path = path
    self._records = ArrayRecordFiles([path])

  def __len__(self):
    return len(self._records)

  def __getitem__(self, i):
    return decode_example(self._records.read(int(i)))

  def fingerprint(self):
    return self._path

  def describe(self):
    return self._path
