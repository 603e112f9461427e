"""What the converter needs of one Hugging Face model family (`Family`), and the walk of a
name table that maps every family's weights to our parameter tree and back.

A name table lists (our parameter path, HF weight name, transpose) for every parameter of
an unscanned model; `transpose` because HF Linear weights are [out, in] and our kernels
[in, out].
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from t5forge.data.vocab import Vocabulary
from t5forge.errors import UserError
from t5forge.nn import abstract_params
from t5forge.nn.config import ModelConfig
from t5forge.nn.stack import stack_owned, unstack_layers

NameTable = list[tuple[tuple[str, ...], str, bool]]
# How a parameter is kept as it is read: (our path, its float32 value in our layout) -> the
# leaf held (e.g. a bfloat16 array, or an int8 `quant.QArray`); None keeps float32.
Store = Callable[[tuple[str, ...], np.ndarray], Any]


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face model family that t5forge reads and writes (`hf.FAMILIES`).

  Attributes:
    name: for messages, e.g. 'T5Gemma'.
    model_types: config.json `model_type`s read as this family.
    hf_architectures: config.json `architectures` of the family, for messages.
    architectures: `ModelConfig.architecture`s written as this family.
    load: (directory, its config.json, `Store` or None) -> (ModelConfig, parameter tree,
      unscanned), each weight read and kept as `Store` says before the next is read.
    hf_config: ModelConfig -> config.json.
    generation_config: ModelConfig -> generation_config.json.
    to_state: (parameter tree, ModelConfig) -> {HF weight name: float32 array}, all the
      weights the directory holds.
    tokenizer_files: the tokenizer files of such a directory, copied as they are when a
      model is saved with the vocabulary of the directory it was read from.
    read_tokenizer: (directory, its config.json or {}) -> its vocabulary, None without one.
    write_tokenizer: (vocabulary or None, directory) -> notes for the user; writes the
      tokenizer files for `vocabulary`.
    save_notes: told the user after every save.
    name_table: ModelConfig -> the family's name table (see the module docstring); also
      what names an adapter's modules in transformers (`convert.peft`).
    module_prefixes: (weight-name prefix as saved, the module's name in transformers'
      model) where the two differ: the names peft's adapter files use are the live
      modules', not the saved weights'.
  """

  name: str
  model_types: tuple[str, ...]
  hf_architectures: tuple[str, ...]
  architectures: tuple[str, ...]
  load: Callable[[str, dict, Store | None], tuple[ModelConfig, dict]]
  hf_config: Callable[[ModelConfig], dict]
  generation_config: Callable[[ModelConfig], dict]
  to_state: Callable[[dict, ModelConfig], dict[str, np.ndarray]]
  tokenizer_files: tuple[str, ...]
  read_tokenizer: Callable[[str, dict], Vocabulary | None]
  write_tokenizer: Callable[[Vocabulary | None, str], list[str]]
  save_notes: tuple[str, ...] = ()
  name_table: Callable[[ModelConfig], NameTable] | None = None
  module_prefixes: tuple[tuple[str, str], ...] = ()


def _set(tree: dict, path: tuple, value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def state_to_params(state: Mapping[str, np.ndarray], config: ModelConfig, *, source: str,
                    table: NameTable, ignore: tuple[str, ...] = (), family: str,
                    leftover_hint: str = "", store: Store | None = None) -> dict:
  """HF state dict -> our parameter tree (float32, or as `store` keeps each leaf),
  checking every name and shape.

  Each weight is looked up once and converted before the next (a `weights.WeightState`
  reads it from disk then), so with a `store` that casts, the tree is built without a
  float32 copy of the model in memory.

  Args:
    state: {HF weight name: array}, e.g. a `weights.WeightState`.
    config: the model the weights are for; its `scan_layers` decides the layout returned.
    source: the directory, for messages.
    table: the family's name table for `config`.
    ignore: HF names that may be present without a place in the tree (tied copies).
    family: the family's name, for messages.
    leftover_hint: appended to the message about weights with no place in the tree.
    store: how each leaf is kept (`Store`); None: float32.
  """
  expected = unstack_layers(abstract_params(config.replace(scan_layers=False)))
  params: dict = {}
  used = set()
  for path, key, transpose in table:
    if key not in state:
      raise UserError(f"{source}: weight {key!r} is missing (needed for {'/'.join(path)}); "
                      f"is this a {family} checkpoint of the architecture config.json describes?")
    stored = np.asarray(state[key])
    value = stored.T if transpose else stored
    want = tuple(_get(expected, path).shape)
    if value.shape != want:
      raise UserError(f"{source}: weight {key!r} has shape {tuple(stored.shape)}, but "
                      f"config.json implies {want if not transpose else want[::-1]} "
                      f"for {'/'.join(path)}; config and weights disagree")
    value = value.astype(np.float32)
    _set(params, path, value if store is None else store(path, value))
    del stored, value  # one weight of the file in memory at a time
    used.add(key)
  leftover = sorted(set(state) - used - set(ignore))
  if leftover:
    raise UserError(f"{source}: {len(leftover)} weight(s) have no place in a {family} model, "
                    f"e.g. {leftover[0]!r}{leftover_hint}")
  return stack_owned(params) if config.scan_layers else params


def params_to_state(params: dict, config: ModelConfig, table: NameTable) -> dict[str, np.ndarray]:
  """Our parameter tree (either layout) -> HF state dict (float32, contiguous) by `table`."""
  if config.scan_layers:
    params = unstack_layers(params)
  state = {}
  for path, key, transpose in table:
    value = np.asarray(_get(params, path), dtype=np.float32)
    state[key] = np.ascontiguousarray(value.T if transpose else value)
  return state
