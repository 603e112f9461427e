"""config.json and generation_config.json of a Hugging Face directory: reading them, and the
end-of-sequence fields that the Gemma families read and write the same way."""
from __future__ import annotations

import json
import os
from typing import Any

from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def read_json(path: str, *, default: Any = None, fix: str = "") -> Any:
  """The JSON value in `path`, or `default` when there is no such file.

  Args:
    fix: appended to the message when the file is not JSON, e.g. '; fix or remove it'.
  """
  if not os.path.isfile(path):
    return default
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: not valid JSON ({e}){fix}") from None


def read_hf_config(model_dir: str) -> dict:
  """The config.json of `model_dir`; a UserError when it is missing or not JSON."""
  path = os.path.join(model_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise UserError(f"{model_dir}: no {CONFIG_FILE}; an HF T5 directory needs config.json "
                    "and model.safetensors (or pytorch_model.bin, or a sharded *.index.json)")
  return read_json(path)


def read_generation_config(path: str) -> dict | None:
  """generation_config.json at `path` as a dict; None when there is none."""
  value = read_json(path, fix="; fix or remove it")
  if value is not None and not isinstance(value, dict):
    raise UserError(f"{path}: not a JSON object; fix or remove it")
  return value


def eos_token_ids(hf_cfg: dict, generation: dict | None, source: str,
                  generation_source: str) -> tuple[int, ...] | None:
  """The ids that end a decode: generation_config.json's eos_token_id (what transformers'
  generate uses), else config.json's (top level, else its decoder's).

  An int or [1] is the vocabulary's EOS alone (None); a list such as [1, 107]
  (instruction-tuned: <eos>, <end_of_turn>) is kept, duplicates dropped.

  Args:
    hf_cfg: config.json, read from `source`.
    generation: generation_config.json or None, read from `generation_source`.
  """
  where, value = generation_source, (generation or {}).get("eos_token_id")
  if value is None:
    where = source
    value = hf_cfg.get("eos_token_id", (hf_cfg.get("decoder") or {}).get("eos_token_id"))
  ids = [value] if value is None or isinstance(value, int) else value
  vocab = hf_cfg.get("vocab_size") or (hf_cfg.get("decoder") or {}).get("vocab_size")
  if not isinstance(ids, list) or not all(
      i is None or (isinstance(i, int) and not isinstance(i, bool) and 0 < i
                    and (vocab is None or i < int(vocab))) for i in ids):
    raise UserError(f"{where}: eos_token_id {value!r} is not a token id or a list of them "
                    f"(in [1, vocab_size {vocab})); fix it, e.g. [1, 107]")
  ids = [i for i in ids if i is not None]
  return None if set(ids) <= {1} else tuple(dict.fromkeys(ids))


def eos_value(config: ModelConfig) -> int | list[int]:
  """HF's eos_token_id for `config`: 1 (<eos>), or the list of ids that end a decode, <eos>
  first."""
  if not config.eos_token_ids:
    return 1
  return list(dict.fromkeys((1,) + tuple(config.eos_token_ids)))


def int_if_whole(x: float) -> float | int:
  """`x` as an int when it is whole: transformers declares some of our float fields ints
  and checks them strictly."""
  return int(x) if float(x).is_integer() else x
