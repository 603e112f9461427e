"""What a result was made from, so that a rerun reuses a result only for the same work.

`t5forge infer` keeps `<name>-<step>.jsonl.fingerprint.json` beside its chunks and its
merged output, and `t5forge eval` a `coverage` field in each `<task>-metrics.jsonl` line.
Both are plain JSON dicts built from the pieces here, and compared with `differences`:

    checkpoint_identity(path, step, fmt) -> {"path", "step", "format", "content"}
    decode_record(options)               -> the DecodeOptions fields
    model_record(config)                 -> the ModelConfig fields that change results
    differences(old, new)                -> ["--mode predict, now score", ...]
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from t5forge import storage

# Files up to this size are hashed; larger ones (weights) count by size and mtime, so
# that a fingerprint costs a few stat calls, not a read of the model.
_HASHED_FILE_BYTES = 1 << 20

# ModelConfig fields that do not change what inference computes (layout, memory, training).
_NOT_RESULTS = ("scan_layers", "remat_policy", "dropout_rate")

# How each recorded field is named to the user: the flag that sets it.
_LABELS = {
    "mode": "--mode", "input_length": "input length (--max_input_length)",
    "target_length": "target length (--max_decode_length)", "chunk_size": "--chunk_size",
    "split": "--split", "num_examples": "the example count (--num_examples)",
    "decode.method": "--method", "decode.num_decodes": "--num_decodes (--beam_size)",
    "decode.temperature": "--temperature", "decode.topk": "--topk", "decode.topp": "--topp",
    "decode.alpha": "--alpha", "decode.max_decode_steps": "--max_decode_steps",
    "decode.seed": "--seed", "decode.return_all_decodes": "return_all_decodes",
    "checkpoint.path": "checkpoint", "checkpoint.step": "checkpoint step",
    "checkpoint.format": "checkpoint format", "inputs.count": "inputs: examples",
}
# Fields whose values mean nothing to a reader (digests): said in words instead.
_PHRASES = {
    "inputs.sha256": "other inputs (the text or tokens differ)",
    "checkpoint.content": "the checkpoint as it was then (it has been rewritten since)",
}


def checkpoint_identity(path: str | None, step: int, fmt: str | None) -> dict[str, Any]:
  """Which checkpoint parameters came from: its path, step, format and a content digest.

  The digest covers the checkpoint directory's top-level files: small ones (Orbax's
  _CHECKPOINT_METADATA with its commit time, manifests, config.json) by content, large ones
  (weights) by name, size and mtime; a checkpoint rewritten at the same path differs. In
  a bucket, every top-level object by name, size and version (GCS generation / S3 ETag,
  new whenever an object is rewritten), from one listing: nothing is downloaded.
  """
  if path is None:
    return {"path": None, "step": int(step), "format": fmt, "content": None}
  if storage.is_remote(path):
    path = storage.normalize(path)
    h = hashlib.sha256()
    listing = storage.walk_files(path) or {storage.basename(path): storage.info(path)}
    for name, entry in sorted(listing.items()):
      if "/" not in name:  # parameter subdirectories: covered by the commit metadata
        h.update(f"{name}\0{entry['size']}\0{entry['version']}\0".encode())
    return {"path": path, "step": int(step), "format": fmt, "content": h.hexdigest()}
  path = os.path.abspath(path)
  h = hashlib.sha256()
  names = sorted(os.listdir(path)) if os.path.isdir(path) else [os.path.basename(path)]
  root = path if os.path.isdir(path) else os.path.dirname(path)
  for name in names:
    full = os.path.join(root, name)
    if not os.path.isfile(full):
      continue  # parameter subdirectories: covered by the metadata written on commit
    st = os.stat(full)
    h.update(f"{name}\0{st.st_size}\0".encode())
    if st.st_size <= _HASHED_FILE_BYTES:
      with open(full, "rb") as f:
        h.update(f.read())
    else:
      h.update(str(st.st_mtime_ns).encode())
  return {"path": path, "step": int(step), "format": fmt, "content": h.hexdigest()}


def decode_record(options) -> dict[str, Any]:
  """The DecodeOptions fields, as JSON values."""
  return normalized(dataclasses.asdict(options))


def model_record(config) -> dict[str, Any]:
  """The ModelConfig fields that change results (dtype, weight_dtype, shapes ...)."""
  return normalized({k: v for k, v in config.to_dict().items() if k not in _NOT_RESULTS})


def normalized(obj: Any) -> Any:
  """`obj` as it reads back from JSON (tuples as lists ...), so that records compare; key
  order kept (it is the order `differences` reports in)."""
  return json.loads(json.dumps(obj, default=str))


def digest(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _show(value: Any) -> str:
  return "unset" if value is None else str(value)


def differences(old: dict, new: dict, *, known_only: tuple[str, ...] = ()) -> list[str]:
  """What differs between two records, each as "<flag> <old>, now <new>".

  Args:
    known_only: dotted fields compared only where both records know them (not None),
      e.g. a checkpoint's content digest that the trainer's hook cannot know.
  """
  a, b = _flat(old), _flat(new)
  out = []
  for key in list(b) + [k for k in a if k not in b]:
    x, y = a.get(key), b.get(key)
    if x == y or (key in known_only and (x is None or y is None)):
      continue
    if key in _PHRASES:
      out.append(_PHRASES[key])
    elif key.startswith("feature_lengths."):
      out.append(f"--feature_lengths {key[16:]}={_show(x)}, now {_show(y)}")
    elif key.startswith("model."):
      out.append(f"model {key[6:]} {_show(x)}, now {_show(y)} (--dtype / --weight_dtype)")
    else:
      out.append(f"{_LABELS.get(key, key)} {_show(x)}, now {_show(y)}")
  return out
