"""Reads T5X native checkpoints (msgpack, format version 3) into t5forge parameters.

A T5X checkpoint is `checkpoint_<step>/checkpoint`: a msgpack map
`{"version": 3, "optimizer": {"target": <params>, "state": {"step": ..,
"param_states": <optimizer state>}}}`. Arrays are stored inline (msgpack extension type
1: shape, dtype name, raw bytes; flax's chunked form for arrays over 1 GiB) or, for
partitioned arrays, as a TensorStore spec dict pointing to a zarr array next to the
msgpack file (path relative to the checkpoint directory).

T5X's parameter names are ours, so the target tree maps one to one. The optimizer state
is returned too, so a caller decides explicitly what to keep; nothing is dropped
silently.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import ml_dtypes
import msgpack
import numpy as np

from t5forge.errors import UserError
from t5forge.nn import abstract_params
from t5forge.nn.config import DECODER_ONLY, ModelConfig
from t5forge.nn.stack import stack_layers

_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
_DTYPES = {"bfloat16": ml_dtypes.bfloat16}


def _dtype(name: str) -> np.dtype:
  return np.dtype(_DTYPES.get(name, name))


def _ext_hook(code: int, data: bytes) -> Any:
  if code == _EXT_NDARRAY:
    shape, dtype, buf = msgpack.unpackb(data)
    return np.frombuffer(buf, dtype=_dtype(dtype)).reshape(shape)
  if code == _EXT_NPSCALAR:
    dtype, buf = msgpack.unpackb(data)
    return np.frombuffer(buf, dtype=_dtype(dtype))[0]
  if code == _EXT_COMPLEX:
    return complex(*msgpack.unpackb(data))
  return msgpack.ExtType(code, data)


def checkpoint_file(path: str) -> str:
  """A T5X checkpoint path (the `checkpoint_<step>` dir or its msgpack file) -> the file."""
  if os.path.isdir(path):
    candidate = os.path.join(path, "checkpoint")
    if os.path.isfile(candidate):
      return candidate
    raise UserError(f"{path}: no T5X 'checkpoint' msgpack file in this directory")
  if not os.path.isfile(path):
    raise UserError(f"{path}: no such T5X checkpoint file or directory")
  return path


def is_t5x_checkpoint(path: str) -> bool:
  try:
    f = checkpoint_file(path)
  except UserError:
    return False
  with open(f, "rb") as fh:
    head = fh.read(64)
  return b"version" in head or b"optimizer" in head


def _is_ts_spec(x: Any) -> bool:
  return isinstance(x, dict) and "driver" in x and ("kvstore" in x or "path" in x)


def _read_tensorstore(spec: dict, ckpt_dir: str, name: str) -> np.ndarray:
  # Lazy: tensorstore takes ~0.7 s to import; only T5X checkpoints with external arrays need it.
  import tensorstore as ts  # noqa: PLC0415 (slow import, on first use)
  spec = dict(spec)
  kvstore = dict(spec.get("kvstore", {}))
  rel = kvstore.get("path", spec.pop("path", None))
  if rel is None:
    raise UserError(f"{ckpt_dir}: TensorStore reference for {name} has no path")
  kvstore.update(driver="file", path=os.path.join(ckpt_dir, rel))
  kvstore.pop("bucket", None)
  spec["kvstore"] = kvstore
  if not os.path.exists(kvstore["path"]):
    raise UserError(f"{ckpt_dir}: {name} refers to TensorStore array {rel!r}, which is missing")
  try:
    return ts.open(spec, open=True, read=True).result().read().result()
  except Exception as e:  # noqa: BLE001 (tensorstore raises ValueError / its own errors)
    raise UserError(f"{kvstore['path']}: cannot read TensorStore array for {name} ({e})") from None


def _materialize(tree: Any, ckpt_dir: str, path: str = "") -> Any:
  """Replaces TensorStore specs and flax chunked arrays by numpy arrays."""
  if _is_ts_spec(tree):
    return _read_tensorstore(tree, ckpt_dir, path)
  if isinstance(tree, dict):
    if tree.get("__msgpack_chunked_array__"):
      chunks = tree["chunks"]
      flat = np.concatenate([np.ravel(chunks[str(i)]) for i in range(len(chunks))])
      return flat.reshape(tree["shape"])
    return {k: _materialize(v, ckpt_dir, f"{path}/{k}") for k, v in tree.items()}
  return tree


def read_t5x_checkpoint(path: str) -> dict:
  """The whole checkpoint as nested dicts of numpy arrays (TensorStore arrays read)."""
  f = checkpoint_file(path)
  with open(f, "rb") as fh:
    raw = fh.read()
  try:
    tree = msgpack.unpackb(raw, ext_hook=_ext_hook, raw=False, strict_map_key=False)
  except (msgpack.UnpackException, ValueError) as e:
    raise UserError(f"{f}: not a T5X msgpack checkpoint ({e})") from None
  if not isinstance(tree, dict) or "optimizer" not in tree:
    raise UserError(f"{f}: not a T5X checkpoint (no 'optimizer' entry at the top)")
  version = tree.get("version")
  if version != 3:
    raise UserError(f"{f}: T5X checkpoint format version {version}; t5forge reads version 3")
  return _materialize(tree, os.path.dirname(os.path.abspath(f)))


def _layers(tree: dict) -> int:
  return sum(1 for k in tree if k.startswith("layers_"))


def infer_config(target: dict, *, source: str, mlp_activations=None,
                 relative_attention_max_distance: int = 128) -> ModelConfig:
  """Reads a ModelConfig off the parameter shapes of a T5X target tree.

  Shapes fix everything but the MLP activation (T5X's standard gated MLP is
  ('gelu', 'linear'); a single `wi` means ReLU unless `mlp_activations` says otherwise)
  and the relative attention max distance (128 unless given).
  """
  if any(k == "layers" for part in ("encoder", "decoder") for k in target.get(part, {})):
    raise UserError(f"{source}: scanned T5X checkpoints (parameters stacked under "
                    "'layers/') are not supported; export it unscanned from T5X")
  decoder = target.get("decoder")
  if decoder is None:
    raise UserError(f"{source}: no 'decoder' parameters in the checkpoint target")
  decoder_only = "encoder" not in target
  embedder = decoder.get("token_embedder") if decoder_only else target.get("token_embedder")
  if embedder is None:
    raise UserError(f"{source}: no token_embedder/embedding parameter")
  vocab, emb = embedder["embedding"].shape
  heads, buckets = decoder["relpos_bias"]["rel_embedding"].shape
  layer0 = decoder["layers_0"]
  attn = layer0["self_attention"]["query"]["kernel"]
  mlp = layer0["mlp"]
  wi = mlp["wi"]["kernel"] if "wi" in mlp else mlp["wi_0"]["kernel"]
  n_wi = 1 if "wi" in mlp else sum(1 for k in mlp if k.startswith("wi_"))
  if mlp_activations is None:
    mlp_activations = ("relu",) if n_wi == 1 else ("gelu",) + ("linear",) * (n_wi - 1)
  tied = "logits_dense" not in decoder
  return ModelConfig(
      vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=attn.shape[1] // heads,
      mlp_dim=wi.shape[1],
      num_encoder_layers=0 if decoder_only else _layers(target["encoder"]),
      num_decoder_layers=_layers(decoder), mlp_activations=tuple(mlp_activations),
      logits_via_embedding=tied, relative_attention_num_buckets=buckets,
      relative_attention_max_distance=relative_attention_max_distance,
      architecture=DECODER_ONLY if decoder_only else "encoder_decoder")


def load_t5x(path: str, config: ModelConfig | None = None) -> tuple[ModelConfig, dict, dict]:
  """Reads a T5X checkpoint.

  Args:
    path: `checkpoint_<step>` directory or its msgpack file.
    config: the model config; inferred from the shapes when None.

  Returns:
    (config, params as float32 numpy tree, extras) where extras holds `step` and
    `param_states` (T5X's optimizer state, e.g. Adafactor v_row / v_col / v / m).
  """
  tree = read_t5x_checkpoint(path)
  opt = tree["optimizer"]
  if "target" not in opt:
    raise UserError(f"{path}: checkpoint has no optimizer/target (the parameters)")
  target = opt["target"]
  config = config or infer_config(target, source=path)
  expected = abstract_params(config.replace(scan_layers=False))
  flat_target = dict(_flatten(target))
  flat_expected = dict(_flatten(expected))
  missing = sorted(set(flat_expected) - set(flat_target))
  extra = sorted(set(flat_target) - set(flat_expected))
  if missing or extra:
    what = (f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}")
    raise UserError(f"{path}: parameters do not match the model config ({what}; "
                    f"{len(missing)} missing, {len(extra)} unexpected)")
  for name, want in flat_expected.items():
    got = flat_target[name].shape
    if tuple(got) != tuple(want.shape):
      raise UserError(f"{path}: parameter {name!r} has shape {tuple(got)}, the config needs "
                      f"{tuple(want.shape)}")
  params = jax.tree.map(lambda x: np.asarray(x, dtype=np.float32), target)
  if config.scan_layers:
    params = stack_layers(params)
  state = opt.get("state", {})
  step = state.get("step")
  extras = {"step": int(step) if step is not None else 0,
            "param_states": state.get("param_states", {})}
  return config, params, extras


def _flatten(tree: Any, prefix: str = ""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flatten(v, f"{prefix}/{k}" if prefix else str(k))
  else:
    yield prefix, tree
