"""Hugging Face T5Gemma checkpoints <-> t5forge parameters, both ways, without torch.

Reads a local directory holding `config.json` (`model_type` 't5gemma', with nested
`encoder` and `decoder` configs) and weights as `model.safetensors` or sharded
safetensors with an index; writes a directory that
`transformers.T5GemmaForConditionalGeneration.from_pretrained` loads, with the tokenizer
files. The generic parts (weight files, sharding, the staged output directory, the
name-table walk) are `hf.py`'s; this module holds what is T5Gemma's: the nested configs,
the name table and the tokenizer files of T5Gemma releases.

The parameter tree is `t5forge.nn.t5gemma`'s (architecture 't5gemma'). HF Linear weights
are [out, in], our kernels [in, out]; norms are the same `w` of `x * (1 + w)`; the
decoder embedding is the tied output layer (`lm_head.out_proj.weight`).

Vocabulary: released directories hold `tokenizer.model` (Gemma's SentencePiece model:
pad 0, eos 1, bos 2, unk 3) and `tokenizer.json`; `vocab_io.from_hf_dir` reads the first
with our SentencePiece vocabulary, else the second with the `tokenizers` library.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

from t5forge.convert import hf
from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig

ARCHITECTURE = "t5gemma"
HF_ARCHITECTURE = "T5GemmaForConditionalGeneration"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json")
LM_HEAD = "lm_head.out_proj.weight"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # both are the tanh form, our 'gelu'

# Fields the two stacks share in our config: encoder and decoder must agree on them.
_SHARED = ("rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping", "sliding_window",
           "max_position_embeddings")


def is_t5gemma(config: ModelConfig) -> bool:
  return config.architecture == ARCHITECTURE


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


def _eos_token_ids(hf_cfg: dict, generation: dict | None, source: str,
                   generation_source: str) -> tuple[int, ...] | None:
  """The ids that end a decode: generation_config.json's eos_token_id (what
  transformers' generate uses), else config.json's. An int or [1] is the vocabulary's
  EOS alone (None); a list such as [1, 107] (instruction-tuned: <eos>, <end_of_turn>)
  is kept."""
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


def config_from_hf(hf_cfg: dict, *, source: str, untied_lm_head: bool = False,
                   generation: dict | None = None,
                   generation_source: str = "generation_config.json") -> ModelConfig:
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
    vocab = {int(v) for v in (hf_cfg.get("vocab_size"), enc.get("vocab_size"),
                              dec.get("vocab_size")) if v is not None}
    if len(vocab) != 1:
      raise UserError(f"{source}: vocab_size differs between the top level, encoder and "
                      f"decoder ({sorted(vocab) or 'none given'}); t5forge's T5Gemma has one")
    for name in _SHARED:
      if enc.get(name) != dec.get(name):
        raise UserError(f"{source}: encoder.{name} = {enc.get(name)!r} but decoder.{name} = "
                        f"{dec.get(name)!r}; t5forge's T5Gemma needs them equal")
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

    def dims(m: dict) -> dict:
      heads = int(m["num_attention_heads"])
      return {"emb_dim": int(m["hidden_size"]), "num_heads": heads,
              "num_kv_heads": int(m.get("num_key_value_heads") or heads),
              "head_dim": int(m.get("head_dim") or int(m["hidden_size"]) // heads),
              "mlp_dim": int(m["intermediate_size"])}

    d, e = dims(dec), dims(enc)

    def opt(name):
      value = dec.get(name)
      return None if value is None else float(value)

    window = dec.get("sliding_window")
    fields = dict(
        architecture=ARCHITECTURE,
        vocab_size=vocab.pop(),
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
        eos_token_ids=_eos_token_ids(hf_cfg, generation, source, generation_source),
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


def _int_if_whole(x: float) -> float | int:
  return int(x) if float(x).is_integer() else x


def _eos_value(config: ModelConfig) -> int | list[int]:
  """HF's eos_token_id: 1 (<eos>), or the list of ids that end a decode, <eos> first."""
  if not config.eos_token_ids:
    return 1
  return list(dict.fromkeys((1,) + tuple(config.eos_token_ids)))


def _module_config(config: ModelConfig, *, encoder: bool) -> dict:
  c = config.encoder if encoder else config
  layers = config.num_encoder_layers if encoder else config.num_decoder_layers
  m = {
      "model_type": "t5_gemma_module",
      "vocab_size": config.vocab_size,
      "hidden_size": c.emb_dim,
      "intermediate_size": c.mlp_dim,
      "num_hidden_layers": layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads or c.num_heads,
      "head_dim": c.head_dim,
      "hidden_activation": "gelu_pytorch_tanh",
      "max_position_embeddings": config.max_position_embeddings or 8192,
      "rms_norm_eps": config.layer_norm_epsilon,
      "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
      "attention_bias": False,
      "attention_dropout": 0.0,
      "dropout_rate": config.dropout_rate,
      # transformers declares it an int (strictly checked); ours is a float.
      "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar
                                             if config.query_pre_attn_scalar is not None
                                             else c.head_dim),
      "sliding_window": config.sliding_window,
      "layer_types": ["sliding_attention" if s else "full_attention"
                      for s in config.sliding_layers(layers)],
      "final_logit_softcapping": config.final_logit_softcapping,
      "attn_logit_softcapping": config.attn_logit_softcapping,
      "pad_token_id": 0,
      "eos_token_id": _eos_value(config),
      "bos_token_id": config.decoder_start_token_id,
      "tie_word_embeddings": config.logits_via_embedding,
      "is_decoder": not encoder,
  }
  if not encoder:
    m["cross_attention_hidden_size"] = config.encoder.emb_dim
  return m


def hf_config_from(config: ModelConfig) -> dict:
  """ModelConfig (architecture 't5gemma') -> T5Gemma config.json."""
  if not is_t5gemma(config):
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
      "eos_token_id": _eos_value(config),
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


def name_table(config: ModelConfig) -> list[tuple[tuple, str, bool]]:
  """All (our parameter path, HF weight name, transpose) pairs of an unscanned model, in
  the order of the HF state dict (so the first mismatch reported is the first one there)."""
  t: list[tuple[tuple, str, bool]] = []
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
  import numpy as np  # pylint: disable=import-outside-toplevel
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


def _read_generation_config(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: not valid JSON ({e}); fix or remove it") from None
  if not isinstance(value, dict):
    raise UserError(f"{path}: not a JSON object; fix or remove it")
  return value


def load_hf(model_dir: str, hf_cfg: dict | None = None) -> tuple[ModelConfig, dict]:
  """Reads an HF T5Gemma directory -> (ModelConfig, float32 parameter tree)."""
  if not os.path.isdir(model_dir):
    raise UserError(f"{model_dir}: no such directory")
  hf_cfg = hf.read_hf_config(model_dir) if hf_cfg is None else hf_cfg
  source = os.path.join(model_dir, hf.CONFIG_FILE)
  state = hf.load_hf_state(model_dir)
  untied = hf_cfg.get("tie_word_embeddings", True) is False and _distinct_lm_head(state)
  gen_source = os.path.join(model_dir, "generation_config.json")
  generation = _read_generation_config(gen_source)
  config = config_from_hf(hf_cfg, source=source, untied_lm_head=untied,
                          generation=generation, generation_source=gen_source)
  _check_layer_counts(state, config, source)
  params = hf.state_to_params(state, config, source=model_dir, table=name_table(config),
                              ignore=(LM_HEAD,) if config.logits_via_embedding else (),
                              family="T5Gemma")
  return config, params


def save_hf(params: dict, config: ModelConfig, out_dir: str, *, vocabulary=None,
            tokenizer_dir: str | None = None,
            max_shard_bytes: int = hf.MAX_SHARD_BYTES) -> list[str]:
  """Writes config.json, generation_config.json, safetensors (sharded past
  `max_shard_bytes`, 5 GB as transformers) and the tokenizer files: copied from
  `tokenizer_dir` (a T5Gemma directory read before) when `vocabulary` is None or the
  same, else written from `vocabulary`.

  Returns:
    Notes for the user, e.g. that no tokenizer could be written.
  """
  hf_config = hf_config_from(config)
  state = hf.params_to_state(params, config, name_table(config))
  with hf.staged_dir(out_dir) as tmp:
    hf.write_json(os.path.join(tmp, hf.CONFIG_FILE), hf_config)
    hf.write_json(os.path.join(tmp, "generation_config.json"), {
        "decoder_start_token_id": config.decoder_start_token_id,
        "bos_token_id": config.decoder_start_token_id, "eos_token_id": _eos_value(config),
        "pad_token_id": 0})
    hf.write_safetensors(state, tmp, max_shard_bytes=max_shard_bytes)
    notes = ([] if hf.copy_tokenizer_files(tokenizer_dir, TOKENIZER_FILES, tmp, vocabulary)
             else write_tokenizer(vocabulary, tmp))
  return notes


def write_tokenizer(vocabulary, out_dir: str) -> list[str]:
  """The tokenizer files of a T5Gemma directory for `vocabulary`: `tokenizer.model` for a
  SentencePiece vocabulary, `tokenizer.json` for a `tokenizers` one, with Gemma's
  tokenizer_config.json / special_tokens_map.json."""
  from t5forge.data import vocab_io  # pylint: disable=import-outside-toplevel
  from t5forge.data import vocab as vocab_lib  # pylint: disable=import-outside-toplevel
  if vocabulary is None:
    return ["no tokenizer written: the checkpoint stores no vocabulary (load it with "
            "t5forge.load(path, vocabulary=...) and save_hf from there)"]
  if isinstance(vocabulary, vocab_lib.SentencePieceVocabulary) and not vocabulary.extra_ids:
    shutil.copy(vocabulary.path, os.path.join(out_dir, "tokenizer.model"))
    piece = vocabulary.processor.id_to_piece
  elif isinstance(vocabulary, vocab_lib.TokenizersVocabulary):
    shutil.copy(vocabulary.path, os.path.join(out_dir, "tokenizer.json"))
    piece = vocabulary.tokenizer.id_to_token
  else:
    return [f"no tokenizer written: a T5Gemma directory holds tokenizer.model or "
            f"tokenizer.json, which {vocab_io.describe(vocabulary)} has not"]
  special = {f"{k}_token": piece(i) for k, i in (
      ("pad", vocabulary.pad_id), ("eos", vocabulary.eos_id), ("bos", vocabulary.bos_id),
      ("unk", vocabulary.unk_id)) if i is not None}
  hf.write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
  hf.write_json(os.path.join(out_dir, "tokenizer_config.json"),
                {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True,
                 "add_eos_token": False, **special})
  return []
