"""Hugging Face checkpoints <-> t5forge parameters, both ways, without torch.

Reads a local directory holding `config.json` and weights as `model.safetensors`,
`pytorch_model.bin`, or sharded `*.index.json` files; writes a directory that transformers'
`from_pretrained` loads (safetensors, sharded past 5 GB), with the tokenizer files
`AutoTokenizer.from_pretrained` loads. One module per model family, each a `Family`:

  t5.py        T5 1.0, T5.1.1, Flan-T5, mT5, ByT5     model_type t5, mt5
  t5gemma.py   T5Gemma                                model_type t5gemma
  t5gemma2.py  T5Gemma 2 (text weights)               model_type t5gemma2

`FAMILIES` is the one table both directions dispatch on: config.json's `model_type` picks
the family that reads a directory, `ModelConfig.architecture` the one that writes it. A new
family is one module with its `FAMILY` and one entry here. Shared by all: `weights.py`
(weight files), `config_files.py` (config.json, generation_config.json), `tokenizer.py`,
`family.py` (the name-table walk).
"""
from __future__ import annotations

import os

import numpy as np

from t5forge import files
from t5forge.convert.hf import t5, t5gemma, t5gemma2, tokenizer
from t5forge.convert.hf.config_files import (CONFIG_FILE, GENERATION_CONFIG_FILE, read_hf_config,
                                             read_json)
from t5forge.convert.hf.family import Family, Store
from t5forge.convert.hf.weights import (MAX_SHARD_BYTES, SAFETENSORS, SAFETENSORS_INDEX,
                                        TORCH_BIN, TORCH_INDEX, WeightState, is_hf_dir,
                                        load_hf_state, write_safetensors)
from t5forge.data.vocab import Vocabulary
from t5forge.data.vocab_io import difference
from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig
from t5forge.nn.stack import stack_owned

FAMILIES: tuple[Family, ...] = (t5.FAMILY, t5gemma.FAMILY, t5gemma2.FAMILY)

__all__ = ["CONFIG_FILE", "FAMILIES", "Family", "MAX_SHARD_BYTES", "SAFETENSORS",
           "SAFETENSORS_INDEX", "Store", "TORCH_BIN", "TORCH_INDEX", "WeightState", "family_for", "family_of",
           "from_hf_dir", "hf_config_from", "is_hf_dir", "load_hf", "load_hf_state",
           "params_to_state", "read_hf_config", "save_hf"]


def _reader_of(model_type: str | None) -> Family | None:
  return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_of(hf_cfg: dict, source: str) -> Family:
  """The family that reads a directory with config.json `hf_cfg` (read from `source`)."""
  model_type = hf_cfg.get("model_type")
  family = _reader_of(model_type)
  if family is not None:
    return family
  what = ", ".join(hf_cfg.get("architectures") or []) or f"model_type {model_type!r}"
  known = "; ".join(f"{f.name} ({' and '.join(f.hf_architectures)})" for f in FAMILIES)
  raise UserError(f"{source}: unsupported HF architecture {what}; t5forge reads {known}")


def family_for(config: ModelConfig) -> Family:
  """The family that writes a model of `config`."""
  for family in FAMILIES:
    if config.architecture in family.architectures:
      return family
  archs = [a for f in FAMILIES for a in f.architectures]
  raise UserError(f"HF export supports the architectures {archs}; {config.architecture!r} has "
                  "no transformers counterpart (transformers has no decoder-only T5)")


def load_hf(model_dir: str, *, store: Store | None = None,
            scan_layers: bool = False) -> tuple[ModelConfig, dict]:
  """Reads an HF directory of any family -> (ModelConfig, parameter tree).

  The weights are read one tensor at a time (`weights.WeightState`), each converted to
  our layout and kept as `store` says (e.g. cast to bfloat16 or quantised to int8) before
  the next is read, so the peak is the tree kept plus about one tensor: a float32 copy
  of the whole model is never held unless float32 is what is kept.

  Args:
    store: how each leaf is kept (`family.Store`); None: float32.
    scan_layers: return the scanned layout (its config says so), stacked as it is made
      (`nn.stack.stack_owned`), not as a second copy.
  """
  if not os.path.isdir(model_dir):
    raise UserError(f"{model_dir}: no such directory")
  hf_cfg = read_hf_config(model_dir)
  family = family_of(hf_cfg, os.path.join(model_dir, CONFIG_FILE))
  config, params = family.load(model_dir, hf_cfg, store)
  if scan_layers and not config.scan_layers:
    config, params = config.replace(scan_layers=True), stack_owned(params)
  return config, params


def hf_config_from(config: ModelConfig) -> dict:
  """ModelConfig -> the config.json of its family."""
  return family_for(config).hf_config(config)


def params_to_state(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
  """Our parameter tree (either layout) -> the HF state dict of its family (float32)."""
  return family_for(config).to_state(params, config)


def from_hf_dir(path: str) -> Vocabulary | None:
  """The vocabulary of an HF directory, read as its family's tokenizer files (see
  `tokenizer.py`); None when the directory has no tokenizer."""
  hf_cfg = read_json(os.path.join(path, CONFIG_FILE), default={})
  # A directory without config.json, or of a family we do not read, is read as T5's: its
  # spiece.model is what such a directory most often holds.
  family = _reader_of(hf_cfg.get("model_type")) or t5.FAMILY
  return family.read_tokenizer(path, hf_cfg)


def save_hf(params: dict, config: ModelConfig, out_dir: str, *,
            vocabulary: Vocabulary | None = None, tokenizer_dir: str | None = None,
            max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes a directory of `config`'s family: config.json, generation_config.json,
  safetensors (sharded past `max_shard_bytes`, 5 GB as transformers) and the tokenizer.

  The tokenizer files are copied from `tokenizer_dir` (an HF directory read before) when
  it has them and `vocabulary` is None or the same as that directory's; else they are
  written from `vocabulary` (e.g. spiece.model, tokenizer.json, tokenizer_config.json for
  T5, which transformers' AutoTokenizer loads).

  The directory appears complete or not at all (`t5forge.files.staged_dir`).

  Returns:
    Notes for the user, e.g. that no tokenizer could be written.
  """
  family = family_for(config)
  hf_config = family.hf_config(config)
  state = family.to_state(params, config)
  has_tokenizer = tokenizer_dir is not None and any(
      os.path.isfile(os.path.join(tokenizer_dir, n)) for n in family.tokenizer_files)
  copy = has_tokenizer and (vocabulary is None
                            or difference(vocabulary, from_hf_dir(tokenizer_dir)) is None)
  # On a bucket config.json goes last: a prefix without it is not an HF directory.
  with files.staged_dir(out_dir, last=(CONFIG_FILE,)) as tmp:
    files.write_json(os.path.join(tmp, CONFIG_FILE), hf_config, sort_keys=True)
    files.write_json(os.path.join(tmp, GENERATION_CONFIG_FILE), family.generation_config(config),
                     sort_keys=True)
    write_safetensors(state, tmp, max_shard_bytes=max_shard_bytes)
    if copy:
      tokenizer.copy_files(tokenizer_dir, family.tokenizer_files, tmp)
      notes = []
    else:
      notes = family.write_tokenizer(vocabulary, tmp)
  return notes + list(family.save_notes)
