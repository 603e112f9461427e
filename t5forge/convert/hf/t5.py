"""The T5 family: T5 1.0, T5.1.1, Flan-T5, mT5 and ByT5 (`model_type` t5 or mt5), read from
and written as what `transformers.T5ForConditionalGeneration` loads (4.x and 5.x).

Tied output layers: transformers 4.x wrote `"tie_word_embeddings": false` for T5.1.1 /
Flan-T5 and stored a separate `lm_head.weight`; 5.x always writes `true` and records the
logit scaling as `scale_decoder_outputs`, untying only when the weights hold a distinct
`lm_head.weight`. We read both: untied iff the config says `false` or the file holds an
`lm_head.weight` different from `shared.weight`; scaled iff `scale_decoder_outputs`
(5.x) or, without it, iff `tie_word_embeddings` is not false (4.x) and the model is not
an mT5 (transformers' MT5 never rescales).
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from t5forge.convert.hf import tokenizer
from t5forge.convert.hf.config_files import CONFIG_FILE
from t5forge.convert.hf.family import (Family, NameTable, Store, params_to_state,
                                      state_to_params)
from t5forge.convert.hf.weights import load_hf_state
from t5forge.errors import UserError
from t5forge.nn.config import ENCODER_DECODER, ModelConfig

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
# Present in some files but duplicates of shared.weight.
_REDUNDANT = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


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


def generation_config(config: ModelConfig) -> dict:
  """generation_config.json: T5's fixed ids (pad and decoder start 0, eos 1)."""
  del config
  return {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}


# ---------------------------------------------------------------------------------------
# The name table. The relative bias is [buckets, heads] in HF.

def _attention_entries(ours: tuple, hf: str) -> Iterator[tuple[tuple, str, bool]]:
  for o, h in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
    yield ours + (o, "kernel"), f"{hf}.{h}.weight", True


def _mlp_entries(config: ModelConfig, ours: tuple, hf: str) -> Iterator[tuple[tuple, str, bool]]:
  names = ["wi"] if len(config.mlp_activations) == 1 else [
      f"wi_{i}" for i in range(len(config.mlp_activations))]
  for n in names + ["wo"]:
    yield ours + ("mlp", n, "kernel"), f"{hf}.DenseReluDense.{n}.weight", True


def name_table(config: ModelConfig) -> NameTable:
  """All (our parameter path, HF weight name, transpose) pairs of an unscanned model."""
  t: NameTable = [(("token_embedder", "embedding"), "shared.weight", False)]
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


def _distinct_lm_head(state: dict[str, np.ndarray]) -> bool:
  if "lm_head.weight" not in state:
    return False
  shared = state.get("shared.weight")
  return shared is None or shared.shape != state["lm_head.weight"].shape or not np.array_equal(
      shared, state["lm_head.weight"])


def load(model_dir: str, hf_cfg: dict,
         store: Store | None = None) -> tuple[ModelConfig, dict]:
  """An HF T5 directory and its config.json -> (ModelConfig, float32 parameter tree,
  or each leaf as `store` keeps it)."""
  state = load_hf_state(model_dir)
  config = config_from_hf(hf_cfg, untied_lm_head=_distinct_lm_head(state),
                          source=os.path.join(model_dir, CONFIG_FILE))
  params = state_to_params(state, config, source=model_dir, table=name_table(config),
                           ignore=_REDUNDANT + ("lm_head.weight",), family="T5",
                           leftover_hint="; UMT5 and other variants are not supported",
                           store=store)
  return config, params


def to_state(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
  """Our parameter tree -> the HF T5 state dict (float32)."""
  return params_to_state(params, config, name_table(config))


FAMILY = Family(
    name="T5",
    model_types=("t5", "mt5"),
    hf_architectures=SUPPORTED_ARCHITECTURES,
    architectures=(ENCODER_DECODER,),
    load=load,
    hf_config=hf_config_from,
    generation_config=generation_config,
    to_state=to_state,
    tokenizer_files=tokenizer.T5_FILES,
    read_tokenizer=tokenizer.read_t5,
    write_tokenizer=tokenizer.write_t5,
    name_table=name_table,
)
