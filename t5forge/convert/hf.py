"""Hugging Face T5 checkpoints <-> t5forge parameters, both ways, without torch.

Reads a local directory holding `config.json` and weights as `model.safetensors`,
`pytorch_model.bin`, or sharded `*.index.json` files; writes a directory that
`transformers.T5ForConditionalGeneration.from_pretrained` loads (transformers 4.x and
5.x), with the tokenizer files `AutoTokenizer.from_pretrained` loads. Covers T5 1.0,
T5.1.1, Flan-T5, mT5 and ByT5 (`model_type` t5 or mt5).

Tied output layers: transformers 4.x wrote `"tie_word_embeddings": false` for T5.1.1 /
Flan-T5 and stored a separate `lm_head.weight`; 5.x always writes `true` and records the
logit scaling as `scale_decoder_outputs`, untying only when the weights hold a distinct
`lm_head.weight`. We read both: untied iff the config says `false` or the file holds an
`lm_head.weight` different from `shared.weight`; scaled iff `scale_decoder_outputs`
(5.x) or, without it, iff `tie_word_embeddings` is not false (4.x) and the model is not
an mT5 (transformers' MT5 never rescales).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Callable, Iterator

import numpy as np

from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig
from t5forge.nn.stack import stack_layers, unstack_layers

CONFIG_FILE = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("spiece.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json")

SUPPORTED_ARCHITECTURES = ("T5ForConditionalGeneration", "MT5ForConditionalGeneration")

# feed_forward_proj -> our mlp_activations.
_ACTIVATIONS = {
    "relu": ("relu",),
    "gelu": ("gelu_exact",),
    "gelu_new": ("gelu",),
    "silu": ("silu",),
    "gated-gelu": ("gelu", "linear"),
    "gated-gelu_new": ("gelu", "linear"),
    "gated-relu": ("relu", "linear"),
    "gated-silu": ("silu", "linear"),
}
_FEED_FORWARD_PROJ = {
    ("relu",): "relu", ("gelu_exact",): "gelu", ("gelu",): "gelu_new", ("silu",): "silu",
    ("gelu", "linear"): "gated-gelu", ("relu", "linear"): "gated-relu",
    ("silu", "linear"): "gated-silu",
}


def is_hf_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) and any(
      os.path.isfile(os.path.join(path, f))
      for f in (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_INDEX))


def read_hf_config(model_dir: str) -> dict:
  path = os.path.join(model_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise UserError(f"{model_dir}: no {CONFIG_FILE}; an HF T5 directory needs config.json "
                    f"and {SAFETENSORS} (or {TORCH_BIN}, or a sharded *.index.json)")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: not valid JSON ({e})") from None


def config_from_hf(hf: dict, *, untied_lm_head: bool, source: str) -> ModelConfig:
  """HF config.json fields -> ModelConfig.

  Args:
    untied_lm_head: the weights hold an `lm_head.weight` distinct from `shared.weight`.
    source: the file the fields came from, for error messages.
  """
  model_type = hf.get("model_type")
  archs = hf.get("architectures") or []
  if model_type not in ("t5", "mt5") or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
    what = ", ".join(archs) or f"model_type {model_type!r}"
    raise UserError(f"{source}: unsupported HF architecture {what}; t5forge reads "
                    f"{' and '.join(SUPPORTED_ARCHITECTURES)} (T5 1.0, T5.1.1, Flan-T5, mT5, "
                    "ByT5)")
  proj = hf.get("feed_forward_proj", "relu")
  if proj not in _ACTIVATIONS:
    raise UserError(f"{source}: feed_forward_proj {proj!r} is not supported; "
                    f"known: {sorted(_ACTIVATIONS)}")
  try:
    num_layers = int(hf["num_layers"])
    tie_flag = hf.get("tie_word_embeddings", True)
    tied = tie_flag is not False and not untied_lm_head
    # MT5 (transformers 5.x) never rescales; T5 does unless told otherwise.
    scale = hf.get("scale_decoder_outputs", model_type == "t5" and tie_flag is not False)
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        emb_dim=int(hf["d_model"]),
        num_heads=int(hf["num_heads"]),
        head_dim=int(hf["d_kv"]),
        mlp_dim=int(hf["d_ff"]),
        num_encoder_layers=num_layers,
        num_decoder_layers=int(hf.get("num_decoder_layers") or num_layers),
        mlp_activations=_ACTIVATIONS[proj],
        logits_via_embedding=tied,
        scale_logits=bool(scale),
        dropout_rate=float(hf.get("dropout_rate", 0.1)),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-6)),
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
    )
  except KeyError as e:
    raise UserError(f"{source}: missing field {e.args[0]!r} needed for a T5 config") from None


def hf_config_from(config: ModelConfig) -> dict:
  """ModelConfig -> an HF config.json both transformers 4.x and 5.x read correctly."""
  if not config.is_encoder_decoder:
    raise UserError("HF export supports encoder-decoder models only "
                    "(transformers has no decoder-only T5)")
  proj = _FEED_FORWARD_PROJ.get(tuple(config.mlp_activations))
  if proj is None:
    raise UserError(f"mlp_activations {config.mlp_activations} have no HF feed_forward_proj")
  return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "vocab_size": config.vocab_size,
      "d_model": config.emb_dim,
      "d_kv": config.head_dim,
      "d_ff": config.mlp_dim,
      "num_heads": config.num_heads,
      "num_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "feed_forward_proj": proj,
      "dropout_rate": config.dropout_rate,
      "layer_norm_epsilon": config.layer_norm_epsilon,
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "initializer_factor": 1.0,
      "is_encoder_decoder": True,
      # 4.x reads tying and scaling from this flag; 5.x reads scaling from the next one
      # and unties when the weights hold a distinct lm_head.weight.
      "tie_word_embeddings": config.logits_via_embedding,
      "scale_decoder_outputs": config.should_scale_logits,
      "pad_token_id": 0,
      "eos_token_id": 1,
      "decoder_start_token_id": 0,
      "use_cache": True,
  }


# ---------------------------------------------------------------------------------------
# The name table. Each entry: (our path, HF key, transpose?). HF Linear weights are
# [out, in]; our kernels are [in, out]; the relative bias is [buckets, heads] in HF.

def _attention_entries(ours: tuple, hf: str) -> Iterator[tuple[tuple, str, bool]]:
  for o, h in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
    yield ours + (o, "kernel"), f"{hf}.{h}.weight", True


def _mlp_entries(config: ModelConfig, ours: tuple, hf: str) -> Iterator[tuple[tuple, str, bool]]:
  names = ["wi"] if len(config.mlp_activations) == 1 else [
      f"wi_{i}" for i in range(len(config.mlp_activations))]
  for n in names + ["wo"]:
    yield ours + ("mlp", n, "kernel"), f"{hf}.DenseReluDense.{n}.weight", True


def name_table(config: ModelConfig) -> list[tuple[tuple, str, bool]]:
  """All (our parameter path, HF weight name, transpose) pairs of an unscanned model."""
  t: list[tuple[tuple, str, bool]] = [(("token_embedder", "embedding"), "shared.weight", False)]
  t.append((("encoder", "relpos_bias", "rel_embedding"),
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True))
  for i in range(config.num_encoder_layers):
    o, h = ("encoder", f"layers_{i}"), f"encoder.block.{i}"
    t.append((o + ("pre_attention_layer_norm", "scale"), f"{h}.layer.0.layer_norm.weight", False))
    t += _attention_entries(o + ("attention",), f"{h}.layer.0.SelfAttention")
    t.append((o + ("pre_mlp_layer_norm", "scale"), f"{h}.layer.1.layer_norm.weight", False))
    t += _mlp_entries(config, o, f"{h}.layer.1")
  t.append((("encoder", "encoder_norm", "scale"), "encoder.final_layer_norm.weight", False))
  t.append((("decoder", "relpos_bias", "rel_embedding"),
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True))
  for i in range(config.num_decoder_layers):
    o, h = ("decoder", f"layers_{i}"), f"decoder.block.{i}"
    t.append((o + ("pre_self_attention_layer_norm", "scale"), f"{h}.layer.0.layer_norm.weight",
              False))
    t += _attention_entries(o + ("self_attention",), f"{h}.layer.0.SelfAttention")
    t.append((o + ("pre_cross_attention_layer_norm", "scale"), f"{h}.layer.1.layer_norm.weight",
              False))
    t += _attention_entries(o + ("encoder_decoder_attention",), f"{h}.layer.1.EncDecAttention")
    t.append((o + ("pre_mlp_layer_norm", "scale"), f"{h}.layer.2.layer_norm.weight", False))
    t += _mlp_entries(config, o, f"{h}.layer.2")
  t.append((("decoder", "decoder_norm", "scale"), "decoder.final_layer_norm.weight", False))
  if not config.logits_via_embedding:
    t.append((("decoder", "logits_dense", "kernel"), "lm_head.weight", True))
  return t


# Present in some files but duplicates of shared.weight.
_REDUNDANT = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


# ---------------------------------------------------------------------------------------
# Weight files.

def _weight_files(model_dir: str) -> tuple[list[str], Callable[[str], dict[str, np.ndarray]]]:
  for index, loader in ((SAFETENSORS_INDEX, _load_safetensors), (TORCH_INDEX, _load_torch)):
    path = os.path.join(model_dir, index)
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map", {})
      files = sorted(set(weight_map.values()))
      missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
      if missing:
        raise UserError(f"{path} lists shard(s) {missing} that are not in {model_dir}")
      return [os.path.join(model_dir, f) for f in files], loader
  for single, loader in ((SAFETENSORS, _load_safetensors), (TORCH_BIN, _load_torch)):
    path = os.path.join(model_dir, single)
    if os.path.isfile(path):
      return [path], loader
  raise UserError(f"{model_dir}: no weights found; expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                  f"{TORCH_BIN} or {TORCH_INDEX} next to config.json")


def _load_safetensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(path, framework="numpy") as f:
      return {k: f.get_tensor(k) for k in f.keys()}
  except Exception as e:  # safetensors raises its own SafetensorError
    raise UserError(f"{path}: cannot read safetensors file ({e})") from None


def _load_torch(path: str) -> dict[str, np.ndarray]:
  from t5forge.convert.torch_pickle import load_torch_state_dict  # pylint: disable=import-outside-toplevel
  return load_torch_state_dict(path)


def load_hf_state(model_dir: str) -> dict[str, np.ndarray]:
  """All weights of an HF directory as {name: numpy array} (dtypes as stored)."""
  files, loader = _weight_files(model_dir)
  state: dict[str, np.ndarray] = {}
  for path in files:
    state.update(loader(path))
  return state


def _set(tree: dict, path: tuple, value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def state_to_params(state: dict[str, np.ndarray], config: ModelConfig, *, source: str,
                    table: list[tuple[tuple, str, bool]] | None = None,
                    ignore: tuple[str, ...] = _REDUNDANT + ("lm_head.weight",),
                    family: str = "T5") -> dict:
  """HF state dict -> our parameter tree (float32), checking every name and shape.

  Args:
    table: (our path, HF name, transpose) entries; default T5's `name_table(config)`.
    ignore: HF names that may be present without a place in the tree (tied copies).
    family: the model family, for messages.
  """
  from t5forge.nn import abstract_params  # pylint: disable=import-outside-toplevel
  expected = unstack_layers(abstract_params(config.replace(scan_layers=False)))
  params: dict = {}
  used = set()
  for path, key, transpose in (name_table(config) if table is None else table):
    if key not in state:
      raise UserError(f"{source}: weight {key!r} is missing (needed for {'/'.join(path)}); "
                      f"is this a {family} checkpoint of the architecture config.json describes?")
    value = np.asarray(state[key])
    value = value.T if transpose else value
    want = tuple(_get(expected, path).shape)
    if value.shape != want:
      raise UserError(f"{source}: weight {key!r} has shape {tuple(state[key].shape)}, but "
                      f"config.json implies {want if not transpose else want[::-1]} "
                      f"for {'/'.join(path)}; config and weights disagree")
    _set(params, path, value.astype(np.float32))
    used.add(key)
  leftover = sorted(set(state) - used - set(ignore))
  if leftover:
    detail = "; UMT5 and other variants are not supported" if family == "T5" else ""
    raise UserError(f"{source}: {len(leftover)} weight(s) have no place in a {family} model, "
                    f"e.g. {leftover[0]!r}{detail}")
  return stack_layers(params) if config.scan_layers else params


def _distinct_lm_head(state: dict[str, np.ndarray]) -> bool:
  if "lm_head.weight" not in state:
    return False
  shared = state.get("shared.weight")
  return shared is None or shared.shape != state["lm_head.weight"].shape or not np.array_equal(
      shared, state["lm_head.weight"])


def load_hf(model_dir: str) -> tuple[ModelConfig, dict]:
  """Reads an HF T5 (or T5Gemma: `hf_t5gemma.load_hf`; T5Gemma 2: `hf_t5gemma2.load_hf`)
  directory -> (ModelConfig, float32 parameter tree)."""
  if not os.path.isdir(model_dir):
    raise UserError(f"{model_dir}: no such directory")
  hf = read_hf_config(model_dir)
  if hf.get("model_type") == "t5gemma":
    from t5forge.convert import hf_t5gemma  # pylint: disable=import-outside-toplevel
    return hf_t5gemma.load_hf(model_dir, hf)
  if hf.get("model_type") == "t5gemma2":
    from t5forge.convert import hf_t5gemma2  # pylint: disable=import-outside-toplevel
    return hf_t5gemma2.load_hf(model_dir, hf)
  state = load_hf_state(model_dir)
  config = config_from_hf(hf, untied_lm_head=_distinct_lm_head(state),
                          source=os.path.join(model_dir, CONFIG_FILE))
  return config, state_to_params(state, config, source=model_dir)


def params_to_state(params: dict, config: ModelConfig,
                    table: list[tuple[tuple, str, bool]] | None = None) -> dict[str, np.ndarray]:
  """Our parameter tree -> HF state dict (float32, contiguous); `table` as in
  `state_to_params`."""
  if config.scan_layers:
    params = unstack_layers(params)
  state = {}
  for path, key, transpose in (name_table(config) if table is None else table):
    value = np.asarray(_get(params, path), dtype=np.float32)
    state[key] = np.ascontiguousarray(value.T if transpose else value)
  return state


MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size, "5GB"


def write_safetensors(state: dict[str, np.ndarray], out_dir: str, *,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes `state` as transformers does: one `model.safetensors`, or, when larger than
  `max_shard_bytes`, `model-0000i-of-0000n.safetensors` shards (tensors in name order,
  a shard closed before it would pass the limit) plus `model.safetensors.index.json`.

  Returns:
    The file names written.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
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
  with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
    json.dump(index, f, indent=2, sort_keys=True)
  return names + [SAFETENSORS_INDEX]


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
  """Yields a temporary sibling of `out_dir` to write into, renamed into place at the end:
  the directory appears complete or not at all (a failure removes the sibling)."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and os.listdir(out_dir):
    raise UserError(f"{out_dir}: exists and is not empty; choose a new output directory")
  tmp = out_dir + ".tmp-t5forge"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.exists(out_dir):
    os.rmdir(out_dir)
  os.rename(tmp, out_dir)


def write_json(path: str, obj: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)


def copy_tokenizer_files(tokenizer_dir: str | None, names: tuple[str, ...], out_dir: str,
                         vocabulary) -> bool:
  """Copies the tokenizer files `names` of `tokenizer_dir` (an HF directory read before)
  byte for byte, when it has any and `vocabulary` is None or the same as that directory's.

  Returns:
    Whether files were copied (else the caller writes them from `vocabulary`).
  """
  from t5forge.data import vocab_io  # pylint: disable=import-outside-toplevel
  copy = [os.path.join(tokenizer_dir, n) for n in names
          if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, n))]
  if not copy or (vocabulary is not None and vocab_io.difference(
      vocabulary, vocab_io.from_hf_dir(tokenizer_dir)) is not None):
    return False
  for src in copy:
    shutil.copy(src, os.path.join(out_dir, os.path.basename(src)))
  return True


def save_hf(params: dict, config: ModelConfig, out_dir: str, *, vocabulary=None,
            tokenizer_dir: str | None = None) -> list[str]:
  """Writes config.json + model.safetensors (sharded past 5 GB) + the tokenizer.

  The tokenizer files are copied from `tokenizer_dir` (an HF directory read before) when
  it has them and `vocabulary` is None or the same as that directory's; else they are
  written from `vocabulary` (`vocab_io.write_hf_tokenizer`: spiece.model, tokenizer.json,
  tokenizer_config.json ... that transformers' AutoTokenizer loads).

  A T5Gemma config is written as a T5Gemma directory (`hf_t5gemma.save_hf`), a T5Gemma 2
  config as a T5Gemma 2 one (`hf_t5gemma2.save_hf`, text weights).

  The directory appears complete or not at all: everything is written to a temporary
  sibling that is renamed into place.

  Returns:
    Notes for the user, e.g. that no tokenizer could be written.
  """
  from t5forge.convert import hf_t5gemma  # pylint: disable=import-outside-toplevel
  if hf_t5gemma.is_t5gemma(config):
    return hf_t5gemma.save_hf(params, config, out_dir, vocabulary=vocabulary,
                              tokenizer_dir=tokenizer_dir)
  if config.architecture == "t5gemma2":
    from t5forge.convert import hf_t5gemma2  # pylint: disable=import-outside-toplevel
    return hf_t5gemma2.save_hf(params, config, out_dir, vocabulary=vocabulary,
                               tokenizer_dir=tokenizer_dir)
  from t5forge.data import vocab_io  # pylint: disable=import-outside-toplevel
  hf_config = hf_config_from(config)
  state = params_to_state(params, config)
  with staged_dir(out_dir) as tmp:
    write_json(os.path.join(tmp, CONFIG_FILE), hf_config)
    write_json(os.path.join(tmp, "generation_config.json"),
               {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0})
    write_safetensors(state, tmp)
    notes = ([] if copy_tokenizer_files(tokenizer_dir, TOKENIZER_FILES, tmp, vocabulary)
             else vocab_io.write_hf_tokenizer(vocabulary, tmp))
  return notes
