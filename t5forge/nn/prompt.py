"""Prompt tuning (Lester et al. 2021, "The Power of Scale for Parameter-Efficient Prompt
Tuning"), as T5X's google-research/prompt-tuning does it, and its file formats.

A prompt is p learned vectors [p, e] prepended to the embedded encoder input, before the
embedding dropout and (T5Gemma, T5Gemma 2) before the sqrt(e) embedding scale, so that
they are treated as the token embeddings are. The attention masks count the p positions
as real tokens: the encoder's self-attention and the decoder's cross-attention see them,
and the encoder output keeps them ([b, p + i, e]), as the repo's `PromptEncoder` and
`PromptEncoderDecoder` do. Packed rows are refused (the repo: "Prompt Tuning does not
support packing").

The parameter is the leaf `prompt` of the module `encoder/prompt` (path
`encoder/prompt/prompt`, float32 [p, e], logical axes ('prompt', 'embed')); its name
puts it in `adapters.ADAPTER_LEAVES`, so adapter training trains only it.

Formats: the repo's `.npy` ([p, e] float32, as `scripts/extract_variable.py` writes it;
`save_npy` / `load_npy`) and Hugging Face peft's PROMPT_TUNING adapter directory
(`adapter_config.json` + `adapter_model.safetensors` with the one tensor
`prompt_embeddings`; `to_peft` / `from_peft`).

Shape letters (docs/shapes.md): b batch, i encoder length, p prompt length, e width,
v vocab.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5forge import files
from t5forge import sharding as ax
from t5forge.errors import UserError
from t5forge.nn.layers import param_with_axes

INITS = ("uniform", "sampled_vocab", "class_labels", "file")
AXES = (ax.PROMPT, ax.EMBED)
MODULE = "encoder/prompt"  # the module path of the parameter
PATH = MODULE + "/prompt"  # its leaf
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_KEY = "prompt_embeddings"
# Where each family keeps the table the encoder embeds with (sampled / class-label inits).
_EMBEDDING_PATHS = ("encoder/token_embedder/embedding", "token_embedder/embedding")


@dataclasses.dataclass(frozen=True)
class PromptConfig:
  """A tuned prompt of `length` vectors (gin: `prompt.PromptConfig`).

  Attributes:
    length: p, the number of prompt vectors (the repo's PROMPT_LENGTH, 100 there).
    init: 'uniform' (U[0, uniform_scale), the repo's model gins' default), 'sampled_vocab'
      (rows of the model's embedding table drawn without replacement from the first
      `population_size` ids, with replacement when p is larger), 'class_labels' (prompt
      row k is the mean embedding of the pieces of class_labels[k]; the rest sampled as
      'sampled_vocab'), or 'file' (a `.npy` [p, e] at `path`).
    uniform_scale: the upper bound of 'uniform'.
    population_size: ids 'sampled_vocab' draws from (the repo's gins: 5000); None: all.
    class_labels: 'class_labels': the label strings (encoded with the vocabulary), or
      token ids (an int or a tuple of ints each).
    path: 'file': the `.npy` file.
  """

  length: int
  init: str = "uniform"
  uniform_scale: float = 0.5
  population_size: int | None = 5000
  class_labels: tuple = ()
  path: str | None = None

  def __post_init__(self):
    # Gin and JSON hand us lists; keep the dataclass hashable.
    labels = self.class_labels
    labels = (labels,) if isinstance(labels, (str, int)) else tuple(
        tuple(x) if isinstance(x, (list, tuple)) else x for x in labels)
    object.__setattr__(self, "class_labels", labels)
    problems = []
    if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length <= 0:
      problems.append(f"length must be a positive int, got {self.length!r}")
    if self.init not in INITS:
      problems.append(f"init must be one of {INITS}, got {self.init!r}")
    if not float(self.uniform_scale) > 0:
      problems.append(f"uniform_scale must be positive, got {self.uniform_scale}")
    if self.population_size is not None and int(self.population_size) <= 0:
      problems.append(f"population_size must be positive or None, got {self.population_size}")
    if self.init == "class_labels" and not labels:
      problems.append("init 'class_labels' needs class_labels, e.g. ('positive', 'negative')")
    if self.init != "class_labels" and labels:
      problems.append(f"class_labels are read only by init 'class_labels', not {self.init!r}; "
                      "remove them or set init = 'class_labels'")
    if self.init == "file" and not self.path:
      problems.append("init 'file' needs path, a .npy file of shape [length, emb_dim]")
    if self.init != "file" and self.path:
      problems.append(f"path is read only by init 'file', not {self.init!r}; remove it or set "
                      "init = 'file'")
    if problems:
      raise UserError("invalid prompt config: " + "; ".join(problems))

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["class_labels"] = [list(x) if isinstance(x, tuple) else x for x in self.class_labels]
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "PromptConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise UserError(f"prompt config: unknown field(s) {unknown}; known: {sorted(fields)}")
    if "length" not in d:
      raise UserError("prompt config: missing field 'length'")
    return cls(**d)


def as_config(value: Any) -> PromptConfig | None:
  """A PromptConfig from itself, a dict (config.json) or None."""
  if value is None or isinstance(value, PromptConfig):
    return value
  if isinstance(value, dict):
    return PromptConfig.from_dict(value)
  raise UserError(f"prompt must be a prompt.PromptConfig, a dict or None, got {value!r}")


# -- the network side ------------------------------------------------------------------------
class Prompt(nn.Module):
  """The prompt parameter [p, e] (float32, axes ('prompt', 'embed')), initialised
  U[0, scale); `initialize` replaces it for the inits that read the base model."""

  length: int
  features: int
  scale: float = 0.5

  @nn.compact
  def __call__(self) -> jax.Array:
    def init(key, shape, dtype=jnp.float32):
      return jax.random.uniform(key, shape, dtype, 0.0, self.scale)
    return param_with_axes(self, "prompt", init, (self.length, self.features), AXES)


def prepend_tokens(tokens: jax.Array, length: int) -> jax.Array:
  """[b, i] -> [b, p + i]: p positions of a non-padding id (1) first, so that every mask
  built from `tokens > 0` counts the prompt (the repo's `add_fake_prompt`)."""
  return jnp.concatenate([jnp.ones((tokens.shape[0], length), tokens.dtype), tokens], axis=1)


def encoder_inputs(cfg: PromptConfig | None, features: int, tokens, segment_ids, positions,
                   valid):
  """Inside an encoder's compact call: creates the prompt and extends what the encoder
  builds its masks and positions from.

  Args:
    cfg: the model's prompt, or None (everything is returned unchanged, prompt None).
    features: e, the encoder's width.
    tokens: [b, i]; segment_ids: must be None (packing is refused); positions: [b, i] or
      None; valid: [b, i] bool or None (see `EncoderDecoderShell.encode`).

  Returns:
    (prompt [p, e] or None, tokens [b, p + i], positions [b, p + i] or None,
     valid [b, p + i] or None): the prompt counts as p real tokens at positions 0..p-1.
  """
  if cfg is None:
    return None, tokens, positions, valid
  if segment_ids is not None:
    raise UserError("prompt tuning does not support packed rows (encoder_segment_ids); "
                    "set train/utils.DatasetConfig.pack = False")
  p = cfg.length
  prompt = Prompt(length=p, features=features, scale=float(cfg.uniform_scale), name="prompt")()
  if positions is not None:
    positions = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(p, dtype=positions.dtype), (positions.shape[0], p)),
         positions + p], axis=1)
  if valid is not None:
    valid = jnp.concatenate([jnp.ones((valid.shape[0], p), bool), valid.astype(bool)], axis=1)
  return prompt, prepend_tokens(tokens, p), positions, valid


def check_feature_lengths(cfg: PromptConfig | None, feature_lengths: dict | None,
                          *, pack: bool = False) -> None:
  """Refuses, in one line, a run whose prompt cannot be used: packing, or a prompt as
  long as the inputs feature length or longer (no room left for the inputs)."""
  if cfg is None:
    return
  if pack:
    raise UserError(f"a prompt (prompt.PromptConfig.length = {cfg.length}) cannot be trained "
                    "on packed rows; set train/utils.DatasetConfig.pack = False (as "
                    "runs/prompt_tuning.gin does)")
  inputs = (feature_lengths or {}).get("inputs")
  if inputs is not None and cfg.length >= int(inputs):
    raise UserError(f"prompt length {cfg.length} leaves no room for the inputs of "
                    f"TASK_FEATURE_LENGTHS['inputs'] = {inputs}; use a prompt shorter than "
                    f"{inputs} or longer inputs")


# -- initialisation ----------------------------------------------------------------------------
def _flat(tree) -> dict:
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def embedding_table(base_params) -> np.ndarray:
  """The table [v, e] the encoder embeds with, as float32 numpy."""
  flat = _flat(base_params)
  for name in _EMBEDDING_PATHS:
    if name in flat:
      return np.asarray(flat[name], np.float32)
  raise UserError(f"the base parameters have none of {list(_EMBEDDING_PATHS)} to initialise "
                  "the prompt from; use init 'uniform' or 'file'")


def _sample(cfg: PromptConfig, table: np.ndarray, rng: jax.Array) -> np.ndarray:
  population = table.shape[0] if cfg.population_size is None else min(
      int(cfg.population_size), table.shape[0])
  # Without replacement unless the prompt is longer than the population (as the repo).
  index = jax.random.choice(rng, population, (cfg.length,), replace=cfg.length > population)
  return table[np.asarray(index)]


def _label_ids(label, vocabulary) -> list[int]:
  if isinstance(label, str):
    if vocabulary is None:
      raise UserError(f"class label {label!r} is text but no vocabulary was given; give "
                      "token ids instead, or the model's vocabulary")
    ids = list(vocabulary.encode(label))
    if not ids:
      raise UserError(f"class label {label!r} encodes to no tokens; use another label")
    return ids
  ids = [label] if isinstance(label, int) else list(label)
  if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise UserError(f"class label {label!r} must be a string, a token id or a tuple of ids")
  return ids


def initialize(cfg: PromptConfig, base_params, vocabulary=None,
               rng: jax.Array | None = None) -> np.ndarray:
  """The initial prompt [p, e] float32 of `cfg.init`, from the base model's own
  embedding table where the init reads it (sampled vocabulary, class labels).

  Args:
    cfg: the prompt's config.
    base_params: the base model's parameters (nested dicts; any storage dtype, the
      embedding table is float32).
    vocabulary: encodes string class labels (`data.vocab` vocabularies' `encode`).
    rng: a jax key (uniform, sampled_vocab, class_labels' filler); None: key 0.
  """
  rng = jax.random.key(0) if rng is None else rng
  table = embedding_table(base_params)
  v, e = table.shape
  if cfg.init == "file":
    return load_npy(cfg.path, length=cfg.length, emb_dim=e)
  if cfg.init == "uniform":
    return np.asarray(jax.random.uniform(rng, (cfg.length, e), jnp.float32, 0.0,
                                         float(cfg.uniform_scale)))
  prompt = _sample(cfg, table, rng).astype(np.float32)
  if cfg.init == "class_labels":
    if len(cfg.class_labels) > cfg.length:
      raise UserError(f"{len(cfg.class_labels)} class labels do not fit a prompt of length "
                      f"{cfg.length}; use at most {cfg.length} labels or a longer prompt")
    for k, label in enumerate(cfg.class_labels):
      ids = _label_ids(label, vocabulary)
      bad = [i for i in ids if not 0 <= i < v]
      if bad:
        raise UserError(f"class label {label!r} has ids {bad} outside the embedding table "
                        f"[0, {v})")
      # A label of several pieces: the mean of their embeddings (as the repo).
      prompt[k] = table[ids].mean(axis=0)
  return prompt


def with_prompt(params: dict, prompt) -> dict:
  """params (nested dicts) with `encoder/prompt/prompt` set to prompt [p, e] (float32)."""
  out = dict(params)
  encoder = dict(out.get("encoder", {}))
  encoder["prompt"] = {"prompt": jnp.asarray(prompt, jnp.float32)}
  out["encoder"] = encoder
  return out


def get_prompt(params) -> np.ndarray:
  """The prompt [p, e] of a parameter tree (float32 numpy)."""
  flat = _flat(params)
  if PATH not in flat:
    raise UserError(f"these parameters hold no prompt ({PATH}); the model has no "
                    "prompt.PromptConfig")
  return np.asarray(flat[PATH], np.float32)


# -- the repo's .npy ---------------------------------------------------------------------------
def save_npy(path: str, prompt) -> None:
  """Writes prompt [p, e] as the repo's extract script does: `np.save` of float32."""
  arr = np.asarray(prompt, np.float32)
  if arr.ndim != 2:
    raise UserError(f"a prompt is [length, emb_dim]; got shape {arr.shape}")
  with files.atomic_file(path, binary=True) as f:
    np.save(f, arr)


def load_npy(path: str, *, length: int | None = None, emb_dim: int | None = None) -> np.ndarray:
  """Reads a `.npy` prompt [p, e] (cast to float32), checking its shape where given."""
  try:
    arr = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as err:
    raise UserError(f"cannot read the prompt file {path!r}: {err}") from None
  want = (length, emb_dim)
  if arr.ndim != 2 or any(w is not None and w != s for w, s in zip(want, arr.shape)):
    raise UserError(f"the prompt file {path!r} has shape {tuple(arr.shape)} but the model "
                    f"needs [{length or 'length'}, {emb_dim or 'emb_dim'}]; set "
                    "prompt.PromptConfig.length to its length, or use a prompt of this model")
  return arr.astype(np.float32)


# -- Hugging Face peft's PROMPT_TUNING ---------------------------------------------------------
def _peft_scale(config) -> float:
  """What our prompt is multiplied by to be peft's: transformers' T5Gemma 2 scales the
  token embeddings inside `embed_tokens`, so peft's prompt there is added after the
  scale; ours (and T5Gemma's in both) before it."""
  return math.sqrt(config.emb_dim) if config.architecture == "t5gemma2" else 1.0


def to_peft(out_dir: str, prompt, config, *, base_model_name_or_path: str | None = None) -> None:
  """Writes prompt [p, e] as a peft PROMPT_TUNING adapter of the encoder-decoder described
  by `config` (a ModelConfig): what `PeftModel.from_pretrained(base, out_dir)` loads.

  One transformer submodule: the prompt goes to the encoder only (T5X's prompt tuning;
  peft's seq2seq prompt tuning feeds only the first num_virtual_tokens rows anyway)."""
  from safetensors.numpy import save_file  # noqa: PLC0415 (only writers of peft need it)
  if not config.is_encoder_decoder:
    raise UserError("peft PROMPT_TUNING export is for encoder-decoder models; this one is "
                    f"{config.architecture!r}")
  arr = np.asarray(prompt, np.float32)
  enc = config.encoder
  if arr.ndim != 2 or arr.shape[1] != enc.emb_dim:
    raise UserError(f"prompt of shape {arr.shape} does not fit this model: it needs "
                    f"[length, {enc.emb_dim}]")
  peft_config = {
      "peft_type": "PROMPT_TUNING", "task_type": "SEQ_2_SEQ_LM", "auto_mapping": None,
      "base_model_name_or_path": base_model_name_or_path, "revision": None,
      "inference_mode": True, "num_virtual_tokens": int(arr.shape[0]),
      "token_dim": int(enc.emb_dim), "num_transformer_submodules": 1,
      "num_attention_heads": int(enc.num_heads), "num_layers": int(config.num_encoder_layers),
      "modules_to_save": None, "prompt_tuning_init": "RANDOM",
      "prompt_tuning_init_text": None, "tokenizer_name_or_path": None,
      "tokenizer_kwargs": None}
  os.makedirs(out_dir, exist_ok=True)
  files.write_json(os.path.join(out_dir, PEFT_CONFIG), peft_config)
  with files.atomic_path(os.path.join(out_dir, PEFT_WEIGHTS)) as tmp:
    save_file({PEFT_KEY: np.ascontiguousarray(arr * _peft_scale(config))}, tmp,
              metadata={"format": "pt"})


def is_peft_prompt(adapter_dir: str) -> bool:
  """Whether adapter_dir holds a peft adapter of peft_type PROMPT_TUNING."""
  try:
    with open(os.path.join(adapter_dir, PEFT_CONFIG)) as f:
      return json.load(f).get("peft_type") == "PROMPT_TUNING"
  except (OSError, ValueError, AttributeError):
    return False


def from_peft(adapter_dir: str, config=None) -> tuple[PromptConfig, np.ndarray]:
  """Reads a peft PROMPT_TUNING adapter: (PromptConfig(length), prompt [p, e] float32).

  config: the ModelConfig of the base it is loaded into (checks token_dim and undoes
  T5Gemma 2's embedding scale, see `_peft_scale`), or None. Refused in one line: another
  peft_type, a causal-LM adapter, `modules_to_save`, a shape that does not fit."""
  from safetensors import SafetensorError  # noqa: PLC0415 (only readers of peft need it)
  from safetensors.numpy import load_file  # noqa: PLC0415
  path = os.path.join(adapter_dir, PEFT_CONFIG)
  try:
    with open(path) as f:
      pc = json.load(f)
  except (OSError, ValueError) as err:
    raise UserError(f"cannot read the peft adapter config {path!r}: {err}") from None
  where = f"peft adapter {adapter_dir!r}"
  if pc.get("peft_type") != "PROMPT_TUNING":
    raise UserError(f"{where}: peft_type is {pc.get('peft_type')!r}, not 'PROMPT_TUNING'")
  if pc.get("task_type") not in (None, "SEQ_2_SEQ_LM"):
    raise UserError(f"{where}: task_type {pc.get('task_type')!r} is for another architecture; "
                    "t5forge reads SEQ_2_SEQ_LM prompts (encoder-decoders)")
  if pc.get("modules_to_save"):
    raise UserError(f"{where}: modules_to_save {pc['modules_to_save']!r} is not supported; "
                    "save the adapter without it")
  n = pc.get("num_virtual_tokens")
  if not isinstance(n, int) or n <= 0:
    raise UserError(f"{where}: num_virtual_tokens must be a positive int, got {n!r}")
  weights = os.path.join(adapter_dir, PEFT_WEIGHTS)
  if not os.path.exists(weights):
    raise UserError(f"{where} has no {PEFT_WEIGHTS}; save it with safetensors "
                    "(save_pretrained's default)")
  try:
    tensors = load_file(weights)
  except (OSError, SafetensorError) as err:
    raise UserError(f"cannot read {weights!r}: {err}") from None
  if PEFT_KEY not in tensors:
    raise UserError(f"{weights!r} has no tensor {PEFT_KEY!r}; it holds {sorted(tensors)[:4]}")
  arr = np.asarray(tensors[PEFT_KEY], np.float32)
  submodules = pc.get("num_transformer_submodules") or 1
  if arr.ndim != 2 or arr.shape[0] != n * submodules:
    raise UserError(f"{where}: {PEFT_KEY} has shape {arr.shape}, not [num_virtual_tokens * "
                    f"num_transformer_submodules = {n * submodules}, token_dim]")
  # peft's seq2seq prompt tuning prepends only the first n rows, to the encoder input.
  arr = arr[:n]
  if config is not None:
    width = config.encoder.emb_dim
    if arr.shape[1] != width:
      raise UserError(f"{where}: token_dim {arr.shape[1]} does not match this model's "
                      f"encoder width {width}; use the adapter of this base model")
    arr = arr / _peft_scale(config)
  return PromptConfig(length=n), np.ascontiguousarray(arr, np.float32)
