"""The T5Gemma family (`model_type` t5gemma), read from and written as what
`transformers.T5GemmaForConditionalGeneration` loads.

config.json nests an `encoder` and a `decoder` config; the parameter tree is
`t5forge.nn.t5gemma`'s (architecture 't5gemma'). Norms are the same `w` of `x * (1 + w)`;
the decoder embedding is the tied output layer (`lm_head.out_proj.weight`). The tokenizer
files are Gemma's (`tokenizer.read_gemma`).
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from t5forge.convert.hf import tokenizer
from t5forge.convert.hf.config_files import (CONFIG_FILE, GENERATION_CONFIG_FILE, eos_token_ids,
                                             eos_value, int_if_whole, read_generation_config)
from t5forge.convert.hf.family import (Family, NameTable, Store, params_to_state,
                                      state_to_params)
from t5forge.convert.hf.weights import load_hf_state
from t5forge.errors import UserError
from t5forge.nn.config import T5GEMMA, ModelConfig

ARCHITECTURE = T5GEMMA
HF_ARCHITECTURE = "T5GemmaForConditionalGeneration"
LM_HEAD = "lm_head.out_proj.weight"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # both are the tanh form, our 'gelu'

# Fields the two stacks share in our config: encoder and decoder must agree on them.
_SHARED = ("rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping", "sliding_window",
           "max_position_embeddings")



def check_halves_agree(hf_cfg: dict, enc: dict, dec: dict, shared: tuple[str, ...],
                       source: str, *, encoder: str, model: str) -> int:
  """The one vocab_size of the top level, encoder and decoder configs; UserError unless
  they give one and the encoder and decoder agree on every field in `shared`. `encoder`
  names the encoder's config in messages ('encoder', 'encoder.text_config')."""
  vocab = {int(v) for v in (hf_cfg.get("vocab_size"), enc.get("vocab_size"),
                            dec.get("vocab_size")) if v is not None}
  if len(vocab) != 1:
    raise UserError(f"{source}: vocab_size differs between the top level, encoder and "
                    f"decoder ({sorted(vocab) or 'none given'}); t5forge's {model} has one")
  for name in shared:
    if enc.get(name) != dec.get(name):
      raise UserError(f"{source}: {encoder}.{name} = {enc.get(name)!r} but decoder.{name} = "
                      f"{dec.get(name)!r}; t5forge's {model} needs them equal")
  return vocab.pop()

def _rope_theta(module: dict, where: str) -> float:
  rope = module.get("rope_parameters") or module.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise UserError(f"{where}: rope type {rope_type!r} is not supported; T5Gemma uses the "
                    "default rotary embedding")
  return float(rope.get("rope_theta", module.get("rope_theta", 10000.0)))


def _module(hf_cfg: dict, side: str, source: str) -> dict:
  """The nested encoder/decoder config, checked for what we cannot represent."""
  m = hf_cfg.get(side)
  if not isinstance(m, dict):
    raise UserError(f"{source}: no nested {side!r} config; a T5Gemma config.json has "
                    "'encoder' and 'decoder' objects")
  where = f"{source} ({side})"
  act = m.get("hidden_activation", m.get("hidden_act", "gelu_pytorch_tanh"))
  if act not in _ACTIVATIONS:
    raise UserError(f"{where}: hidden_activation {act!r} is not supported; T5Gemma uses "
                    "'gelu_pytorch_tanh'")
  if m.get("attention_bias"):
    raise UserError(f"{where}: attention_bias true is not supported (T5Gemma has no biases)")
  n = int(m["num_hidden_layers"]) if "num_hidden_layers" in m else None
  if n is None:
    raise UserError(f"{where}: missing field 'num_hidden_layers'")
  types = m.get("layer_types")
  want = ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(n)]
  if types is not None and list(types) != want:
    raise UserError(f"{where}: layer_types {types} is not the alternating pattern "
                    "sliding, full, sliding, ... that t5forge's T5Gemma implements")
  heads, kv = m.get("num_attention_heads"), m.get("num_key_value_heads")
  if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
    raise UserError(f"{source}: {side}.num_attention_heads {heads} is not a multiple of "
                    f"{side}.num_key_value_heads {kv}; grouped-query attention needs a "
                    f"divisor of {heads} there")
  window, limit = m.get("sliding_window"), m.get("max_position_embeddings")
  if isinstance(window, int) and isinstance(limit, int) and window > limit:
    raise UserError(f"{source}: {side}.sliding_window {window} is larger than "
                    f"{side}.max_position_embeddings {limit}; set a window of at most {limit}")
  return m


def config_from_hf(hf_cfg: dict, *, source: str, untied_lm_head: bool = False,
                   generation: dict | None = None,
                   generation_source: str = GENERATION_CONFIG_FILE) -> ModelConfig:
  """T5Gemma config.json (nested encoder/decoder) -> ModelConfig (architecture 't5gemma').

  Args:
    source: the file the fields came from, for error messages.
    untied_lm_head: the weights hold an `lm_head.out_proj.weight` distinct from the
      decoder embedding (and config.json says tie_word_embeddings false).
    generation: the directory's generation_config.json, if any (its eos_token_id list
      becomes `eos_token_ids`), read from `generation_source`.
  """
  archs = hf_cfg.get("architectures") or []
  if hf_cfg.get("model_type") != ARCHITECTURE or (archs and HF_ARCHITECTURE not in archs):
    raise UserError(f"{source}: {', '.join(archs) or hf_cfg.get('model_type')!r} is not "
                    f"{HF_ARCHITECTURE}; t5forge reads T5Gemma encoder-decoders")
  enc, dec = _module(hf_cfg, "encoder", source), _module(hf_cfg, "decoder", source)
  try:
    vocab_size = check_halves_agree(hf_cfg, enc, dec, _SHARED, source, encoder="encoder",
                                    model="T5Gemma")
    theta = _rope_theta(dec, f"{source} (decoder)")
    if _rope_theta(enc, f"{source} (encoder)") != theta:
      raise UserError(f"{source}: encoder and decoder rope_theta differ; t5forge needs one")
    cross = dec.get("cross_attention_hidden_size")
    if cross is not None and int(cross) != int(enc["hidden_size"]):
      raise UserError(f"{source}: decoder.cross_attention_hidden_size {cross} is not "
                      f"encoder.hidden_size {enc['hidden_size']}; the cross-attention reads "
                      "the encoder's output, so they must be equal")
    if int(dec.get("pad_token_id", 0) or 0) != 0:
      raise UserError(f"{source}: decoder pad_token_id {dec.get('pad_token_id')} is not 0; "
                      "t5forge pads with id 0")
    tied = hf_cfg.get("tie_word_embeddings", True) is not False and not untied_lm_head

    d, e = stack_dims(dec), stack_dims(enc)

    def opt(name):
      value = dec.get(name)
      return None if value is None else float(value)

    window = dec.get("sliding_window")
    fields = dict(
        architecture=ARCHITECTURE,
        vocab_size=vocab_size,
        num_encoder_layers=int(enc["num_hidden_layers"]),
        num_decoder_layers=int(dec["num_hidden_layers"]),
        mlp_activations=("gelu", "linear"),
        logits_via_embedding=tied,
        scale_logits=False,
        dropout_rate=float(hf_cfg.get("dropout_rate", 0.0)),
        layer_norm_epsilon=float(dec.get("rms_norm_eps", 1e-6)),
        **d,
        **{f"encoder_{k}": (v if v != d[k] else None) for k, v in e.items()},
        rope_theta=theta,
        query_pre_attn_scalar=opt("query_pre_attn_scalar"),
        attn_logit_softcapping=opt("attn_logit_softcapping"),
        final_logit_softcapping=opt("final_logit_softcapping"),
        sliding_window=None if window is None else int(window),
        sliding_window_pattern=2,
        max_position_embeddings=(None if dec.get("max_position_embeddings") is None
                                 else int(dec["max_position_embeddings"])),
        decoder_start_token_id=int(dec.get("bos_token_id", 2)),
        eos_token_ids=eos_token_ids(hf_cfg, generation, source, generation_source),
    )
  except KeyError as err:
    raise UserError(f"{source}: missing field {err.args[0]!r} needed for a T5Gemma "
                    "config") from None
  except (TypeError, ValueError) as err:
    raise UserError(f"{source}: a field has the wrong type ({err})") from None
  try:
    return ModelConfig(**fields)
  except UserError as err:  # what the checks above do not name by its config.json field
    raise UserError(f"{source}: {err}") from None


def stack_dims(m: dict) -> dict:
  """A Gemma stack's sizes in config.json (T5Gemma's and T5Gemma 2's encoder and
  decoder) -> ModelConfig's field names."""
  heads = int(m["num_attention_heads"])
  return {"emb_dim": int(m["hidden_size"]), "num_heads": heads,
          "num_kv_heads": int(m.get("num_key_value_heads") or heads),
          "head_dim": int(m.get("head_dim") or int(m["hidden_size"]) // heads),
          "mlp_dim": int(m["intermediate_size"])}


def stack_fields(config: ModelConfig, *, encoder: bool) -> dict:
  """The config.json fields of one Gemma stack of `config` that T5Gemma and T5Gemma 2
  write alike (each adds its model type, RoPE, soft-cap and tying fields)."""
  c = config.encoder if encoder else config
  layers = config.num_encoder_layers if encoder else config.num_decoder_layers
  return {
      "vocab_size": config.vocab_size,
      "hidden_size": c.emb_dim,
      "intermediate_size": c.mlp_dim,
      "num_hidden_layers": layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.kv_heads,
      "head_dim": c.head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "rms_norm_eps": config.layer_norm_epsilon,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "dropout_rate": config.dropout_rate,
      # transformers declares it an int (strictly checked); ours is a float.
      "query_pre_attn_scalar": int_if_whole(config.query_pre_attn_scalar
                                             if config.query_pre_attn_scalar is not None
                                             else c.head_dim),
      "sliding_window": config.sliding_window,
      "layer_types": ["sliding_attention" if s else "full_attention"
                      for s in config.sliding_layers(layers)],
      "final_logit_softcapping": config.final_logit_softcapping,
      "pad_token_id": 0,
      "eos_token_id": eos_value(config),
      "bos_token_id": config.decoder_start_token_id,
  }


def _module_config(config: ModelConfig, *, encoder: bool) -> dict:
  m = {
      "model_type": "t5_gemma_module",
      **stack_fields(config, encoder=encoder),
      "max_position_embeddings": config.max_position_embeddings or 8192,
      "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
      "attn_logit_softcapping": config.attn_logit_softcapping,
      "tie_word_embeddings": config.logits_via_embedding,
      "is_decoder": not encoder,
  }
  if not encoder:
    m["cross_attention_hidden_size"] = config.encoder.emb_dim
  return m


def hf_config_from(config: ModelConfig) -> dict:
  """ModelConfig (architecture 't5gemma') -> T5Gemma config.json."""
  if config.architecture != ARCHITECTURE:
    raise UserError(f"architecture {config.architecture!r} is not {ARCHITECTURE!r}")
  if tuple(config.mlp_activations) != ("gelu", "linear"):
    raise UserError(f"mlp_activations {config.mlp_activations}: HF T5Gemma has only the gated "
                    "tanh-GELU MLP ('gelu', 'linear')")
  if config.should_scale_logits:
    raise UserError("scale_logits: HF T5Gemma does not scale the decoder output; set "
                    "scale_logits = False")
  if config.sliding_window_pattern != 2 and config.sliding_window is not None:
    raise UserError(f"sliding_window_pattern {config.sliding_window_pattern}: HF T5Gemma "
                    "alternates sliding and full layers (pattern 2)")
  return {
      "architectures": [HF_ARCHITECTURE],
      "model_type": ARCHITECTURE,
      "encoder": _module_config(config, encoder=True),
      "decoder": _module_config(config, encoder=False),
      "vocab_size": config.vocab_size,
      "is_encoder_decoder": True,
      "tie_word_embeddings": config.logits_via_embedding,
      "dropout_rate": config.dropout_rate,
      "attention_dropout": 0.0,
      "classifier_dropout_rate": 0.0,
      "pad_token_id": 0,
      "eos_token_id": eos_value(config),
      "bos_token_id": config.decoder_start_token_id,
      "use_cache": True,
  }


# ---------------------------------------------------------------------------------------
# The name table: (our path, HF name, transpose?).

def _attention(ours: tuple, theirs: str) -> Iterator[tuple[tuple, str, bool]]:
  for o, h in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
    yield ours + (o, "kernel"), f"{theirs}.{h}_proj.weight", True


_NORMS = {"pre_self_attention_layer_norm": "pre_self_attn_layernorm",
          "post_self_attention_layer_norm": "post_self_attn_layernorm",
          "pre_cross_attention_layer_norm": "pre_cross_attn_layernorm",
          "post_cross_attention_layer_norm": "post_cross_attn_layernorm",
          "pre_mlp_layer_norm": "pre_feedforward_layernorm",
          "post_mlp_layer_norm": "post_feedforward_layernorm"}


def _norm(ours: tuple, name: str, theirs: str) -> tuple[tuple, str, bool]:
  return ours + (name, "scale"), f"{theirs}.{_NORMS[name]}.weight", False


def _mlp(ours: tuple, theirs: str) -> Iterator[tuple[tuple, str, bool]]:
  for o, h in (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down")):
    yield ours + ("mlp", o, "kernel"), f"{theirs}.mlp.{h}_proj.weight", True


def name_table(config: ModelConfig) -> NameTable:
  """All (our parameter path, HF weight name, transpose) pairs of an unscanned model, in
  the order of the HF state dict (so the first mismatch reported is the first one there)."""
  t: NameTable = []
  for side, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    prefix = f"model.{side}"
    t.append(((side, "token_embedder", "embedding"), f"{prefix}.embed_tokens.weight", False))
    for i in range(n):
      o, h = (side, f"layers_{i}"), f"{prefix}.layers.{i}"
      t.append(_norm(o, "pre_self_attention_layer_norm", h))
      t += _attention(o + ("attention" if side == "encoder" else "self_attention",),
                      f"{h}.self_attn")
      t.append(_norm(o, "post_self_attention_layer_norm", h))
      if side == "decoder":
        t.append(_norm(o, "pre_cross_attention_layer_norm", h))
        t += _attention(o + ("encoder_decoder_attention",), f"{h}.cross_attn")
        t.append(_norm(o, "post_cross_attention_layer_norm", h))
      t.append(_norm(o, "pre_mlp_layer_norm", h))
      t += _mlp(o, h)
      t.append(_norm(o, "post_mlp_layer_norm", h))
    t.append(((side, f"{side}_norm", "scale"), f"{prefix}.norm.weight", False))
  if not config.logits_via_embedding:
    t.append((("decoder", "logits_dense", "kernel"), LM_HEAD, True))
  return t


def _distinct_lm_head(state: dict) -> bool:
  head, emb = state.get(LM_HEAD), state.get("model.decoder.embed_tokens.weight")
  return head is not None and (emb is None or head.shape != emb.shape
                               or not np.array_equal(head, emb))


def _check_layer_counts(state: dict, config: ModelConfig, source: str) -> None:
  """config.json's num_hidden_layers against the layers the weights hold, per stack."""
  for side, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    prefix = f"model.{side}.layers."
    held = {int(k[len(prefix):].split(".")[0]) for k in state
            if k.startswith(prefix) and k[len(prefix):].split(".")[0].isdigit()}
    if held and max(held) + 1 != n:
      m = max(held) + 1
      raise UserError(f"{source}: {side}.num_hidden_layers is {n}, but the weights hold {m} "
                      f"{side} layers ({prefix}0..{m - 1}); set it (and {side}.layer_types) "
                      f"to {m}")


def load(model_dir: str, hf_cfg: dict,
         store: Store | None = None) -> tuple[ModelConfig, dict]:
  """An HF T5Gemma directory and its config.json -> (ModelConfig, float32 parameter tree,
  or each leaf as `store` keeps it)."""
  source = os.path.join(model_dir, CONFIG_FILE)
  state = load_hf_state(model_dir)
  untied = hf_cfg.get("tie_word_embeddings", True) is False and _distinct_lm_head(state)
  gen_source = os.path.join(model_dir, GENERATION_CONFIG_FILE)
  config = config_from_hf(hf_cfg, source=source, untied_lm_head=untied,
                          generation=read_generation_config(gen_source),
                          generation_source=gen_source)
  _check_layer_counts(state, config, source)
  params = state_to_params(state, config, source=model_dir, table=name_table(config),
                           ignore=(LM_HEAD,) if config.logits_via_embedding else (),
                           family="T5Gemma", store=store)
  return config, params


def to_state(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
  """Our parameter tree -> the HF T5Gemma state dict (float32)."""
  return params_to_state(params, config, name_table(config))


def generation_config(config: ModelConfig) -> dict:
  """generation_config.json of the Gemma families: bos starts the decoder; eos as
  `config_files.eos_value`."""
  return {"decoder_start_token_id": config.decoder_start_token_id,
          "bos_token_id": config.decoder_start_token_id, "eos_token_id": eos_value(config),
          "pad_token_id": 0}


FAMILY = Family(
    name="T5Gemma",
    model_types=(ARCHITECTURE,),
    hf_architectures=(HF_ARCHITECTURE,),
    architectures=(ARCHITECTURE,),
    load=load,
    hf_config=hf_config_from,
    generation_config=generation_config,
    to_state=to_state,
    tokenizer_files=tokenizer.GEMMA_FILES,
    read_tokenizer=tokenizer.read_gemma,
    write_tokenizer=tokenizer.write_gemma,
    name_table=name_table,
)
