"""The T5Gemma 2 family (`model_type` t5gemma2), text weights, read from and written as what
`transformers.T5Gemma2ForConditionalGeneration` loads.

config.json holds an `encoder` (with `text_config` and `vision_config`) and a `decoder`.
The generation config and tokenizer files are T5Gemma's.

Text only. The released checkpoints are multimodal: their SigLIP vision tower
(`model.encoder.vision_tower.*`) and projector (`model.encoder.multi_modal_projector.*`)
are skipped when reading, so a text model reads from them; t5forge never feeds images.
A directory we write holds the text weights and, because transformers always builds a
vision tower, a placeholder one-layer 16-wide vision config (transformers initialises
that tower randomly and says so): it gives the same text logits, and is not for images.

Weight names: transformers saves the encoder text stack as `model.encoder.{embed_tokens,
layers,norm}` (older files: `model.encoder.text_model.*`, read too); the decoder
embedding and `lm_head.out_proj.weight` are tied to the encoder embedding and not saved.
`model.encoder.embed_tokens.eoi_embedding` is the input vector of the end-of-image token
(`eoi_embedding`, ModelConfig.eoi_token_id).
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from t5forge.convert.hf import t5gemma, tokenizer
from t5forge.convert.hf.config_files import (CONFIG_FILE, GENERATION_CONFIG_FILE, eos_token_ids,
                                             eos_value, read_generation_config)
from t5forge.convert.hf.family import (Family, NameTable, Store, params_to_state,
                                      state_to_params)
from t5forge.convert.hf.weights import WeightState, load_hf_state
from t5forge.errors import UserError
from t5forge.nn.config import T5GEMMA2, ModelConfig

ARCHITECTURE = T5GEMMA2
HF_ARCHITECTURE = "T5Gemma2ForConditionalGeneration"
EOI = "model.encoder.embed_tokens.eoi_embedding"
# Not part of the text model: skipped when reading (see the module docstring).
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.multi_modal_projector.")
# Tied copies of the encoder embedding, when a file holds them.
TIED = ("model.decoder.embed_tokens.weight", "model.decoder.embed_tokens.eoi_embedding",
        "lm_head.out_proj.weight")
_SHARED = ("rms_norm_eps", "query_pre_attn_scalar", "sliding_window", "max_position_embeddings",
           "layer_types")
# A valid, tiny SigLIP config for the vision tower transformers builds on loading.
PLACEHOLDER_VISION = {"model_type": "siglip_vision_model", "hidden_size": 16,
                      "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "image_size": 28, "patch_size": 14}


def _rope(m: dict, where: str) -> tuple[float, float, float | None]:
  """(global base, local base, linear scaling factor of the global layers or None) of a
  T5Gemma 2 text config."""
  params = m.get("rope_parameters") or {}
  out = []
  for kind, old_name, default in (("full_attention", "rope_theta", 1e6),
                                  ("sliding_attention", "rope_local_base_freq", 1e4)):
    p = params.get(kind) or {}
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ("default", "linear") or (
        rope_type == "linear" and kind == "sliding_attention"):
      raise UserError(f"{where}: rope_parameters.{kind} type {rope_type!r} is not supported; "
                      "t5forge's T5Gemma 2 has the default rotary embedding (and linear "
                      "scaling in full-attention layers)")
    out.append(float(p.get("rope_theta", m.get(old_name, default))))
    if kind == "full_attention":
      factor = float(p["factor"]) if rope_type == "linear" else None
  return out[0], out[1], factor


def _pattern(types: list, where: str) -> int:
  """The sliding_window_pattern p with layer i global iff (i + 1) % p == 0."""
  n = len(types)
  full = [i for i, t in enumerate(types) if t == "full_attention"]
  p = full[0] + 1 if full else n + 1
  want = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
  if list(types) != want:
    raise UserError(f"{where}: layer_types {types} is not a repeating pattern of "
                    "sliding layers ending in one full layer, which t5forge implements")
  return p


def _text_config(m: dict, where: str) -> dict:
  act = m.get("hidden_activation", m.get("hidden_act", "gelu_pytorch_tanh"))
  if act not in ("gelu_pytorch_tanh", "gelu_new"):
    raise UserError(f"{where}: hidden_activation {act!r} is not supported; T5Gemma 2 uses "
                    "'gelu_pytorch_tanh'")
  if m.get("attention_bias"):
    raise UserError(f"{where}: attention_bias true is not supported (T5Gemma 2 has no biases)")
  if m.get("attn_logit_softcapping") is not None:
    raise UserError(f"{where}: attn_logit_softcapping {m['attn_logit_softcapping']} is set, "
                    "but transformers' T5Gemma 2 ignores it; set it to null")
  if "num_hidden_layers" not in m:
    raise UserError(f"{where}: missing field 'num_hidden_layers'")
  return m


def config_from_hf(hf_cfg: dict, *, source: str, generation: dict | None = None,
                   generation_source: str = GENERATION_CONFIG_FILE) -> ModelConfig:
  """T5Gemma 2 config.json -> ModelConfig (architecture 't5gemma2').

  Args:
    generation: the directory's generation_config.json, if any: a list of eos ids there
      (or in config.json) becomes `eos_token_ids`, as for T5Gemma.
  """
  archs = hf_cfg.get("architectures") or []
  if hf_cfg.get("model_type") != ARCHITECTURE or (archs and HF_ARCHITECTURE not in archs):
    raise UserError(f"{source}: {', '.join(archs) or hf_cfg.get('model_type')!r} is not "
                    f"{HF_ARCHITECTURE}; t5forge reads T5Gemma 2 encoder-decoders")
  encoder = hf_cfg.get("encoder")
  if not isinstance(encoder, dict) or not isinstance(encoder.get("text_config"), dict):
    raise UserError(f"{source}: no encoder.text_config; a T5Gemma 2 config.json has "
                    "'encoder' (with 'text_config') and 'decoder' objects")
  if not isinstance(hf_cfg.get("decoder"), dict):
    raise UserError(f"{source}: no nested 'decoder' config")
  enc = _text_config(encoder["text_config"], f"{source} (encoder.text_config)")
  dec = _text_config(hf_cfg["decoder"], f"{source} (decoder)")
  try:
    vocab_size = t5gemma.check_halves_agree(hf_cfg, enc, dec, _SHARED, source,
                                            encoder="encoder.text_config", model="T5Gemma 2")
    thetas = _rope(dec, f"{source} (decoder)")
    if _rope(enc, f"{source} (encoder)") != thetas:
      raise UserError(f"{source}: encoder and decoder rope_parameters differ; t5forge needs "
                      "one pair of bases")
    if int(dec["hidden_size"]) != int(enc["hidden_size"]):
      raise UserError(f"{source}: encoder hidden_size {enc['hidden_size']} differs from the "
                      f"decoder's {dec['hidden_size']}; T5Gemma 2 needs them equal")
    if hf_cfg.get("tie_word_embeddings", True) is False:
      raise UserError(f"{source}: tie_word_embeddings false; t5forge's T5Gemma 2 ties the "
                      "encoder, decoder and output embeddings as the released models do")
    if int(dec.get("pad_token_id", 0) or 0) != 0:
      raise UserError(f"{source}: decoder pad_token_id {dec.get('pad_token_id')} is not 0; "
                      "t5forge pads with id 0")
    n_dec = int(dec["num_hidden_layers"])
    types = dec.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0
                                       else "sliding_attention" for i in range(n_dec)]
    pattern = _pattern(types, f"{source} (decoder)")
    enc_types = enc.get("layer_types")
    if enc_types is not None and _pattern(enc_types, f"{source} (encoder)") != pattern:
      raise UserError(f"{source}: encoder and decoder layer_types follow different patterns")
    window = dec.get("sliding_window")
    if window is None and pattern <= n_dec:
      raise UserError(f"{source}: sliding layers but sliding_window is null")

    d, e = t5gemma.stack_dims(dec), t5gemma.stack_dims(enc)
    eoi = int(hf_cfg.get("eoi_token_index", encoder.get("eoi_token_index", 256000)))
    cap = dec.get("final_logit_softcapping")
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=vocab_size,
        num_encoder_layers=int(enc["num_hidden_layers"]),
        num_decoder_layers=n_dec,
        mlp_activations=("gelu", "linear"),
        logits_via_embedding=True,
        scale_logits=False,
        dropout_rate=float(hf_cfg.get("dropout_rate", 0.0)),
        layer_norm_epsilon=float(dec.get("rms_norm_eps", 1e-6)),
        **d,
        **{f"encoder_{k}": (v if v != d[k] else None) for k, v in e.items()},
        rope_theta=thetas[0],
        rope_local_theta=thetas[1],
        rope_scaling_factor=thetas[2],
        query_pre_attn_scalar=(None if dec.get("query_pre_attn_scalar") is None
                               else float(dec["query_pre_attn_scalar"])),
        final_logit_softcapping=None if cap is None else float(cap),
        sliding_window=None if window is None else int(window),
        sliding_window_pattern=pattern,
        max_position_embeddings=(None if dec.get("max_position_embeddings") is None
                                 else int(dec["max_position_embeddings"])),
        # An id outside the vocabulary never occurs: no eoi vector then.
        eoi_token_id=eoi if 0 <= eoi < vocab_size else None,
        eos_token_ids=eos_token_ids(hf_cfg, generation, source, generation_source),
        decoder_start_token_id=int(dec.get("bos_token_id", 2)),
    )
  except KeyError as err:
    raise UserError(f"{source}: missing field {err.args[0]!r} needed for a T5Gemma 2 "
                    "config") from None
  except (TypeError, ValueError) as err:
    raise UserError(f"{source}: a field has the wrong type ({err})") from None


def _text_module(config: ModelConfig, *, encoder: bool) -> dict:
  return {
      "model_type": "t5gemma2_text" if encoder else "t5gemma2_decoder",
      **t5gemma.stack_fields(config, encoder=encoder),
      "max_position_embeddings": config.max_position_embeddings or 131072,
      "rope_parameters": {
          "full_attention": (
              {"rope_type": "default", "rope_theta": config.rope_theta}
              if config.rope_scaling_factor is None else
              {"rope_type": "linear", "factor": config.rope_scaling_factor,
               "rope_theta": config.rope_theta}),
          "sliding_attention": {"rope_type": "default",
                                "rope_theta": config.rope_local_theta or config.rope_theta}},
      "attn_logit_softcapping": None,
      "tie_word_embeddings": True,
  }


def hf_config_from(config: ModelConfig) -> dict:
  """ModelConfig (architecture 't5gemma2') -> T5Gemma 2 config.json (with the placeholder
  vision config, see the module docstring)."""
  if config.architecture != ARCHITECTURE:
    raise UserError(f"architecture {config.architecture!r} is not {ARCHITECTURE!r}")
  if tuple(config.mlp_activations) != ("gelu", "linear"):
    raise UserError(f"mlp_activations {config.mlp_activations}: HF T5Gemma 2 has only the "
                    "gated tanh-GELU MLP ('gelu', 'linear')")
  if config.should_scale_logits:
    raise UserError("scale_logits: HF T5Gemma 2 does not scale the decoder output; set "
                    "scale_logits = False")
  if config.attn_logit_softcapping is not None:
    raise UserError("attn_logit_softcapping: transformers' T5Gemma 2 ignores it, so its "
                    "logits would differ; set it to None")
  eoi = config.eoi_token_id if config.eoi_token_id is not None else 256000
  return {
      "architectures": [HF_ARCHITECTURE],
      "model_type": ARCHITECTURE,
      "encoder": {"model_type": "t5gemma2_encoder",
                  "text_config": _text_module(config, encoder=True),
                  "vision_config": dict(PLACEHOLDER_VISION), "mm_tokens_per_image": 4,
                  "boi_token_index": 255999, "eoi_token_index": eoi,
                  "image_token_index": 256001, "tie_word_embeddings": True},
      "decoder": _text_module(config, encoder=False),
      "vocab_size": config.vocab_size,
      "eoi_token_index": eoi,
      "image_token_index": 256001,
      "is_encoder_decoder": True,
      "tie_word_embeddings": True,
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

_NORMS = {"pre_self_attention_layer_norm": "pre_self_attn_layernorm",
          "post_self_attention_layer_norm": "post_self_attn_layernorm",
          "pre_mlp_layer_norm": "pre_feedforward_layernorm",
          "post_mlp_layer_norm": "post_feedforward_layernorm"}


def _layer(ours: tuple, attention: str, theirs: str) -> Iterator[tuple[tuple, str, bool]]:
  yield ours + ("pre_self_attention_layer_norm", "scale"), f"{theirs}.pre_self_attn_layernorm.weight", False
  for o, h in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
    yield ours + (attention, o, "kernel"), f"{theirs}.self_attn.{h}_proj.weight", True
  for o, h in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
    yield ours + (attention, o, "scale"), f"{theirs}.self_attn.{h}.weight", False
  yield ours + ("post_self_attention_layer_norm", "scale"), f"{theirs}.post_self_attn_layernorm.weight", False
  yield ours + ("pre_mlp_layer_norm", "scale"), f"{theirs}.pre_feedforward_layernorm.weight", False
  for o, h in (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down")):
    yield ours + ("mlp", o, "kernel"), f"{theirs}.mlp.{h}_proj.weight", True
  yield ours + ("post_mlp_layer_norm", "scale"), f"{theirs}.post_feedforward_layernorm.weight", False


def name_table(config: ModelConfig) -> NameTable:
  """All (our parameter path, HF weight name, transpose) pairs of an unscanned model."""
  t: NameTable = [
      (("token_embedder", "embedding"), "model.encoder.embed_tokens.weight", False)]
  if config.eoi_token_id is not None:
    t.append((("eoi_embedding",), EOI, False))
  for side, n, attention in (("encoder", config.num_encoder_layers, "attention"),
                             ("decoder", config.num_decoder_layers, "merged_attention")):
    for i in range(n):
      t += _layer((side, f"layers_{i}"), attention, f"model.{side}.layers.{i}")
    t.append(((side, f"{side}_norm", "scale"), f"model.{side}.norm.weight", False))
  return t


def text_state(state: WeightState | dict) -> WeightState | dict:
  """The text weights of a T5Gemma 2 state dict under the names `name_table` uses:
  vision weights dropped, `model.encoder.text_model.` read as `model.encoder.` (still
  read on look-up)."""
  names = {name.replace("model.encoder.text_model.", "model.encoder.", 1): name
           for name in state if not name.startswith(VISION_PREFIXES)}
  if isinstance(state, WeightState):
    return state.renamed(names)
  return {new: state[old] for new, old in names.items()}  # a plain {name: array}


def load(model_dir: str, hf_cfg: dict,
         store: Store | None = None) -> tuple[ModelConfig, dict]:
  """An HF T5Gemma 2 directory and its config.json -> (ModelConfig, float32 parameter tree
  or each leaf as `store` keeps it), text only."""
  gen_source = os.path.join(model_dir, GENERATION_CONFIG_FILE)
  config = config_from_hf(hf_cfg, source=os.path.join(model_dir, CONFIG_FILE),
                          generation=read_generation_config(gen_source),
                          generation_source=gen_source)
  state = text_state(load_hf_state(model_dir))
  emb = state.get("model.encoder.embed_tokens.weight")
  for name in TIED:
    tied = state.get(name)
    if (tied is not None and emb is not None and name.endswith(".weight")
        and (tied.shape != emb.shape or not np.array_equal(tied, emb))):
      raise UserError(f"{model_dir}: {name} differs from model.encoder.embed_tokens.weight; "
                      "T5Gemma 2 ties them (t5forge cannot hold separate ones)")
  ignore = TIED + (() if config.eoi_token_id is not None else (EOI,))
  params = state_to_params(state, config, source=model_dir, table=name_table(config),
                           ignore=ignore, family="T5Gemma 2", store=store)
  return config, params


def to_state(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
  """Our parameter tree -> the HF T5Gemma 2 state dict (float32), with the end-of-image
  vector transformers expects even where the config has none (it is never used then)."""
  state = params_to_state(params, config, name_table(config))
  if config.eoi_token_id is None:
    state[EOI] = np.zeros((config.emb_dim,), np.float32)
  return state


FAMILY = Family(
    name="T5Gemma 2",
    model_types=(ARCHITECTURE,),
    hf_architectures=(HF_ARCHITECTURE,),
    architectures=(ARCHITECTURE,),
    load=load,
    hf_config=hf_config_from,
    generation_config=t5gemma.generation_config,
    to_state=to_state,
    tokenizer_files=tokenizer.GEMMA_FILES,
    read_tokenizer=tokenizer.read_gemma,
    write_tokenizer=tokenizer.write_gemma,
    save_notes=("text weights only: transformers initialises the placeholder vision tower "
                "randomly on loading; do not give this model images",),
    name_table=name_table,
    # transformers keeps the encoder text stack as model.encoder.text_model (saved without it).
    module_prefixes=(("model.encoder.", "model.encoder.text_model."),),
)
