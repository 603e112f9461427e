"""Adapters on a frozen base: which leaves train, the base's storage, and the adapter file.

An adapter is the set of parameter leaves named in `ADAPTER_LEAVES` (LoRA's `lora_a` /
`lora_b`, prompt tuning's `prompt`); everything else is the frozen base. Adapter training
(`t5forge.train`) differentiates only the adapter and keeps the base as a separate,
non-donated input, stored in float32, bfloat16 or int8 (`store_base`).

Our adapter format is a directory:

    adapter.json           {"format": "t5forge-adapter", "model": ModelConfig dict,
                            "base": where the base came from, "fingerprint": the base's
                            `fingerprint`, "base_dtype": ...}
    adapter.safetensors    the adapter's leaves, '/'-joined unscanned paths, float32

Hugging Face peft's format is read and written by `t5forge.convert.peft`.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from t5forge import files
from t5forge.errors import UserError
from t5forge.nn import quant, stack

ADAPTER_LEAVES = frozenset({"lora_a", "lora_b", "prompt"})
FORMAT = "t5forge-adapter"
CONFIG_FILE = "adapter.json"
WEIGHTS_FILE = "adapter.safetensors"
BASE_DTYPES = ("float32", "bfloat16", "int8")


def split(params: dict) -> tuple[dict, dict]:
  """params -> (adapter, base): two nested dicts that `join` puts back together. Subtrees
  left empty on one side are dropped from it."""
  adapter, base = {}, {}
  for name, value in params.items():
    if isinstance(value, dict):
      a, b = split(value)
      if a:
        adapter[name] = a
      if b:
        base[name] = b
    elif name in ADAPTER_LEAVES:
      adapter[name] = value
    else:
      base[name] = value
  return adapter, base


def join(adapter: dict, base: dict) -> dict:
  """The union of two nested dicts with no leaf in common (inverse of `split`)."""
  out = dict(base)
  for name, value in adapter.items():
    if isinstance(value, dict) and isinstance(out.get(name), dict):
      out[name] = join(value, out[name])
    else:
      out[name] = value
  return out


def has_adapter(params: Any) -> bool:
  """Whether a (possibly abstract) parameter tree has adapter leaves."""
  if not isinstance(params, dict):
    return False
  return any(name in ADAPTER_LEAVES or has_adapter(v) for name, v in params.items())


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  """(path, leaf) in path order; a QArray is one leaf."""
  if not isinstance(tree, dict):
    return [(prefix, tree)]
  out = []
  for name in sorted(tree):
    out += _leaves(tree[name], f"{prefix}/{name}" if prefix else name)
  return out


def _unscanned(path: str, leaf: Any) -> list[tuple[str, Any]]:
  """A scanned leaf [L, ...] at `.../layers/...` as its L per-layer leaves (lazily
  sliced), so that a scanned and an unscanned base fingerprint alike."""
  parts = path.split("/")
  if "layers" not in parts:
    return [(path, leaf)]
  i = parts.index("layers")
  n = leaf.shape[0]
  return [("/".join(parts[:i] + [f"layers_{k}"] + parts[i + 1:]), (leaf, k)) for k in range(n)]


def fingerprint(base: dict, samples: int = 64) -> str:
  """A digest of the base: every leaf's unscanned path and shape, and `samples` values at
  a fixed stride of each leaf that every storage dtype keeps in float32 (embeddings,
  norms, relative-position tables; not the kernels, which `store_base` rounds), so that
  the same weights stored in float32, bfloat16 or int8, scanned or not, give the same
  digest. Reads a few values per leaf, never the whole base."""
  h = hashlib.sha256()
  entries = []
  for path, leaf in _leaves(base):
    entries += _unscanned(path, leaf)
  for path, leaf in sorted(entries, key=lambda e: e[0]):
    layer = None
    if isinstance(leaf, tuple):
      leaf, layer = leaf
    shape = tuple(leaf.shape)[1:] if layer is not None else tuple(leaf.shape)
    h.update(f"{path}:{shape};".encode())
    if path.rsplit("/", 1)[-1] == "kernel" or isinstance(leaf, quant.QArray):
      continue
    value = leaf[layer] if layer is not None else leaf
    flat = np.asarray(jax.device_get(value), np.float32).reshape(-1)
    if flat.size:
      idx = np.linspace(0, flat.size - 1, min(samples, flat.size)).astype(np.int64)
      h.update(flat[idx].tobytes())
  return h.hexdigest()[:16]


def store_base(base: dict, dtype: str) -> dict:
  """The frozen base in its storage dtype: 'float32' as it is; 'bfloat16' casts the
  projection kernels (`kernel` leaves: what `matmul.dense` rounds to the compute dtype
  anyway); 'int8' quantises them to `quant.QArray(exact=True)`. Embeddings, norms and
  relative-position tables stay float32 (they are read unrounded)."""
  if dtype not in BASE_DTYPES:
    raise UserError(f"base_dtype {dtype!r} is not one of {BASE_DTYPES}")
  if dtype == "float32":
    return base
  if dtype == "int8":
    return quant.quantize_params(base, exact=True)

  def cast(tree):
    return {k: cast(v) if isinstance(v, dict) else (
        v.astype("bfloat16") if k == "kernel" and not isinstance(v, quant.QArray) else v)
        for k, v in tree.items()}

  return cast(base)


def save(path: str, adapter: dict, *, model_config: dict, record: dict) -> None:
  """Writes our adapter format into directory `path` (unscanned layout, float32)."""
  flat = {p: np.ascontiguousarray(np.asarray(v, np.float32)) for p, v in
          traverse_util.flatten_dict(stack.unstack_layers(jax.device_get(adapter)),
                                     sep="/").items()}
  if not flat:
    raise UserError("there is no adapter to save: the model has no LoRA or prompt parameters")
  os.makedirs(path, exist_ok=True)
  files.write_bytes(os.path.join(path, WEIGHTS_FILE), st_save(flat))
  files.write_text(os.path.join(path, CONFIG_FILE), json.dumps(
      {"format": FORMAT, "model": model_config, **record}, indent=2, sort_keys=True) + "\n")


def is_adapter_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_FILE))


def load(path: str) -> tuple[dict, dict, dict]:
  """Reads our adapter format: (adapter params, unscanned nested dict of numpy arrays;
  the model config dict; the record: base, fingerprint, base_dtype)."""
  config_path = os.path.join(path, CONFIG_FILE)
  try:
    with open(config_path, encoding="utf-8") as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise UserError(f"{path} is not a t5forge adapter: it has no {CONFIG_FILE}") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{config_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
  if meta.get("format") != FORMAT:
    raise UserError(f"{config_path}: format is {meta.get('format')!r}, not {FORMAT!r}")
  weights = os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(weights):
    raise UserError(f"{path}: {WEIGHTS_FILE} is missing")
  with open(weights, "rb") as f:
    flat = st_load(f.read())
  tree = traverse_util.unflatten_dict(flat, sep="/")
  record = {k: v for k, v in meta.items() if k not in ("format", "model")}
  return tree, meta.get("model") or {}, record


def check_base(record: dict, base_fingerprint: str, *, adapter: str, base: str) -> None:
  """Refuses an adapter trained on another base (when the adapter records one)."""
  want = record.get("fingerprint")
  if want and want != base_fingerprint:
    raise UserError(f"adapter {adapter} was trained on a base with fingerprint {want} "
                    f"({record.get('base', 'unknown')}), but {base} has fingerprint "
                    f"{base_fingerprint}; load it on the base it was trained on")
