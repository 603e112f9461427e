"""Hugging Face T5Gemma 2 checkpoints <-> t5forge parameters (text weights), without torch.

Reads a local directory holding `config.json` (`model_type` 't5gemma2': an `encoder`
with `text_config` and `vision_config`, a `decoder`) and safetensors weights; writes a
directory that `transformers.T5Gemma2ForConditionalGeneration.from_pretrained` loads. The
generic parts (weight files, shards, the staged directory, the name-table walk, tokenizer
files) are `hf.py`'s and `hf_t5gemma.py`'s.

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

from t5forge.convert import hf, hf_t5gemma
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
                   generation_source: str = "generation_config.json") -> ModelConfig:
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
    vocab = {int(v) for v in (hf_cfg.get("vocab_size"), enc.get("vocab_size"),
                              dec.get("vocab_size")) if v is not None}
    if len(vocab) != 1:
      raise UserError(f"{source}: vocab_size differs between the top level, encoder and "
                      f"decoder ({sorted(vocab) or 'none given'}); T5Gemma 2 has one")
    for name in _SHARED:
      if enc.get(name) != dec.get(name):
        raise UserError(f"{source}: encoder.text_config.{name} = {enc.get(name)!r} but "
                        f"decoder.{name} = {dec.get(name)!r}; t5forge needs them equal")
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

    def dims(m: dict) -> dict:
      heads = int(m["num_attention_heads"])
      return {"emb_dim": int(m["hidden_size"]), "num_heads": heads,
              "num_kv_heads": int(m.get("num_key_value_heads") or heads),
              "head_dim": int(m.get("head_dim") or int(m["hidden_size"]) // heads),
              "mlp_dim": int(m["intermediate_size"])}

    d, e = dims(dec), dims(enc)
    vocab_size = vocab.pop()
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
        eos_token_ids=hf_t5gemma._eos_token_ids(  # pylint: disable=protected-access
            hf_cfg, generation, source, generation_source),
        decoder_start_token_id=int(dec.get("bos_token_id", 2)),
    )
  except KeyError as err:
    raise UserError(f"{source}: missing field {err.args[0]!r} needed for a T5Gemma 2 "
                    "config") from None
  except (TypeError, ValueError) as err:
    raise UserError(f"{source}: a field has the wrong type ({err})") from None


def _text_module(config: ModelConfig, *, encoder: bool) -> dict:
  c = config.encoder if encoder else config
  layers = config.num_encoder_layers if encoder else config.num_decoder_layers
  return {
      "model_type": "t5gemma2_text" if encoder else "t5gemma2_decoder",
      "vocab_size": config.vocab_size,
      "hidden_size": c.emb_dim,
      "intermediate_size": c.mlp_dim,
      "num_hidden_layers": layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.kv_heads,
      "head_dim": c.head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "max_position_embeddings": config.max_position_embeddings or 131072,
      "rms_norm_eps": config.layer_norm_epsilon,
      "rope_parameters": {
          "full_attention": (
              {"rope_type": "default", "rope_theta": config.rope_theta}
              if config.rope_scaling_factor is None else
              {"rope_type": "linear", "factor": config.rope_scaling_factor,
               "rope_theta": config.rope_theta}),
          "sliding_attention": {"rope_type": "default",
                                "rope_theta": config.rope_local_theta or config.rope_theta}},
      "attention_bias": False,
      "attention_dropout": 0.0,
      "dropout_rate": config.dropout_rate,
      # transformers declares it an int (strictly checked); ours is a float.
      "query_pre_attn_scalar": hf_t5gemma._int_if_whole(  # pylint: disable=protected-access
          config.query_pre_attn_scalar if config.query_pre_attn_scalar is not None
          else c.head_dim),
      "sliding_window": config.sliding_window,
      "layer_types": ["sliding_attention" if s else "full_attention"
                      for s in config.sliding_layers(layers)],
      "final_logit_softcapping": config.final_logit_softcapping,
      "attn_logit_softcapping": None,
      "pad_token_id": 0,
      "eos_token_id": hf_t5gemma._eos_value(config),  # pylint: disable=protected-access
      "bos_token_id": config.decoder_start_token_id,
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
      "eos_token_id": hf_t5gemma._eos_value(config),  # pylint: disable=protected-access
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


def name_table(config: ModelConfig) -> list[tuple[tuple, str, bool]]:
  """All (our parameter path, HF weight name, transpose) pairs of an unscanned model."""
  t: list[tuple[tuple, str, bool]] = [
      (("token_embedder", "embedding"), "model.encoder.embed_tokens.weight", False)]
  if config.eoi_token_id is not None:
    t.append((("eoi_embedding",), EOI, False))
  for side, n, attention in (("encoder", config.num_encoder_layers, "attention"),
                             ("decoder", config.num_decoder_layers, "merged_attention")):
    for i in range(n):
      t += _layer((side, f"layers_{i}"), attention, f"model.{side}.layers.{i}")
    t.append(((side, f"{side}_norm", "scale"), f"model.{side}.norm.weight", False))
  return t


def text_state(state: dict) -> dict:
  """The text weights of a T5Gemma 2 state dict under the names `name_table` uses:
  vision weights dropped, `model.encoder.text_model.` read as `model.encoder.`."""
  out = {}
  for name, value in state.items():
    if name.startswith(VISION_PREFIXES):
      continue
    out[name.replace("model.encoder.text_model.", "model.encoder.", 1)] = value
  return out


def load_hf(model_dir: str, hf_cfg: dict | None = None) -> tuple[ModelConfig, dict]:
  """Reads an HF T5Gemma 2 directory -> (ModelConfig, float32 parameter tree), text only."""
  if not os.path.isdir(model_dir):
    raise UserError(f"{model_dir}: no such directory")
  hf_cfg = hf.read_hf_config(model_dir) if hf_cfg is None else hf_cfg
  gen_source = os.path.join(model_dir, "generation_config.json")
  config = config_from_hf(
      hf_cfg, source=os.path.join(model_dir, hf.CONFIG_FILE),
      generation=hf_t5gemma._read_generation_config(gen_source),  # pylint: disable=protected-access
      generation_source=gen_source)
  state = text_state(hf.load_hf_state(model_dir))
  emb = state.get("model.encoder.embed_tokens.weight")
  for name in TIED:
    tied = state.get(name)
    if (tied is not None and emb is not None and name.endswith(".weight")
        and (tied.shape != emb.shape or not np.array_equal(tied, emb))):
      raise UserError(f"{model_dir}: {name} differs from model.encoder.embed_tokens.weight; "
                      "T5Gemma 2 ties them (t5forge cannot hold separate ones)")
  ignore = TIED + (() if config.eoi_token_id is not None else (EOI,))
  params = hf.state_to_params(state, config, source=model_dir, table=name_table(config),
                              ignore=ignore, family="T5Gemma 2")
  return config, params


def save_hf(params: dict, config: ModelConfig, out_dir: str, *, vocabulary=None,
            tokenizer_dir: str | None = None,
            max_shard_bytes: int = hf.MAX_SHARD_BYTES) -> list[str]:
  """Writes config.json, generation_config.json, safetensors and the tokenizer files (as
  `hf_t5gemma.save_hf`). Returns notes for the user."""
  hf_config = hf_config_from(config)
  state = hf.params_to_state(params, config, name_table(config))
  if config.eoi_token_id is None:  # transformers expects the vector; it is never used
    state[EOI] = np.zeros((config.emb_dim,), np.float32)
  with hf.staged_dir(out_dir) as tmp:
    hf.write_json(os.path.join(tmp, hf.CONFIG_FILE), hf_config)
    hf.write_json(os.path.join(tmp, "generation_config.json"), {
        "decoder_start_token_id": config.decoder_start_token_id,
        "bos_token_id": config.decoder_start_token_id,
        "eos_token_id": hf_t5gemma._eos_value(config),  # pylint: disable=protected-access
        "pad_token_id": 0})
    hf.write_safetensors(state, tmp, max_shard_bytes=max_shard_bytes)
    notes = ([] if hf.copy_tokenizer_files(tokenizer_dir, hf_t5gemma.TOKENIZER_FILES, tmp,
                                           vocabulary)
             else hf_t5gemma.write_tokenizer(vocabulary, tmp))
  notes.append("text weights only: transformers initialises the placeholder vision tower "
               "randomly on loading; do not give this model images")
  return notes
