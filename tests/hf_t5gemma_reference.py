"""Random-init Hugging Face T5Gemma models, built offline and saved as real HF directories.

transformers (PyTorch) is the numerical reference in tests only. Every weight, norms
included, is randomised (norm weights around 0, i.e. scales `1 + w` around 1) so that no
scale or transpose can hide behind a value of 1 or 0.

The float64 reference is transformers' own model in float64, with its rotary angles also
computed in float64 (transformers computes them in float32 even for a float64 model,
which would make the "exact" run only as exact as float32 positions * frequencies).
"""
from __future__ import annotations

import json
import os
import types

import numpy as np

BOS, EOS, PAD = 2, 1, 0

# name -> (encoder fields, decoder fields) of T5GemmaModuleConfig; both share `_COMMON`.
#   mha: a T5-size-like shape scaled down (heads * head_dim == hidden, kv heads == heads,
#        query_pre_attn_scalar == head_dim, the released soft-caps 50 / 30).
#   gqa: grouped-query attention (2 kv heads for 4 query heads), head_dim independent of the
#        width, an encoder wider and deeper than the decoder (cross-attention keys/values from
#        the encoder width, as 9B-2B), small soft-caps so that tanh really bends.
# Both windows are far below the test inputs' lengths, so local and global layers differ.
_COMMON = dict(vocab_size=256, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
               max_position_embeddings=512, attention_bias=False, pad_token_id=PAD,
               eos_token_id=EOS, bos_token_id=BOS)
VARIANTS = {
    "mha": (dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                 query_pre_attn_scalar=16, sliding_window=6, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0),
            dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                 query_pre_attn_scalar=16, sliding_window=6, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0)),
    "gqa": (dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=3.0,
                 final_logit_softcapping=2.0),
            dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=3.0,
                 final_logit_softcapping=2.0)),
}


def hf_config(name: str, *, tied: bool = True):
  import transformers
  enc, dec = VARIANTS[name]
  return transformers.T5GemmaConfig(
      encoder=transformers.T5GemmaModuleConfig(**_COMMON, **enc),
      decoder=transformers.T5GemmaModuleConfig(**_COMMON, **dec),
      vocab_size=_COMMON["vocab_size"], tie_word_embeddings=tied, dropout_rate=0.0,
      attention_dropout=0.0, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)


def build_hf_dir(name: str, out_dir: str, seed: int = 0, max_shard_size: str | None = None,
                 tied: bool = True) -> str:
  """Saves a random-init T5GemmaForConditionalGeneration to out_dir; returns out_dir.

  Args:
    max_shard_size: e.g. '100KB' to write sharded safetensors with an index.
    tied: False: tie_word_embeddings false, a separate random lm_head (released models
      are tied).
  """
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.T5GemmaForConditionalGeneration(hf_config(name, tied=tied))
  with torch.no_grad():
    for pname, p in model.named_parameters():  # tied lm_head is the decoder embedding
      if pname.endswith("norm.weight"):
        p.copy_(0.2 * torch.randn_like(p))
      else:  # Linear [out, in], embedding [vocab, width]: unit-scale outputs
        p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(out_dir, **kwargs)
  return out_dir


def _rope_float64(module, x, position_ids):
  """T5GemmaRotaryEmbedding.forward with angles computed in float64."""
  import torch
  cfg = module.config
  dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  base = cfg.rope_parameters["rope_theta"]
  inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
  freqs = position_ids[..., None].to(torch.float64) * inv_freq
  emb = torch.cat((freqs, freqs), dim=-1)
  return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def load_hf_model(path: str, *, float64: bool = False):
  """T5GemmaForConditionalGeneration from `path`, eval mode; float64 with float64 RoPE."""
  import transformers
  model = transformers.T5GemmaForConditionalGeneration.from_pretrained(path).eval()
  if not float64:
    return model
  model = model.double()
  for module in model.modules():
    if type(module).__name__ == "T5GemmaRotaryEmbedding":
      module.forward = types.MethodType(_rope_float64, module)
  return model


def hf_forward(model, encoder_input_tokens: np.ndarray, decoder_input_tokens: np.ndarray):
  """(encoder last hidden state [b, i, e], logits [b, t, v]) as float64 numpy."""
  import torch
  enc = torch.tensor(encoder_input_tokens, dtype=torch.long)
  dec = torch.tensor(decoder_input_tokens, dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=enc, attention_mask=(enc != PAD).long(), decoder_input_ids=dec)
  return (out.encoder_last_hidden_state.double().numpy(), out.logits.double().numpy())


def hf_forward_unpadded(model, encoder_input_tokens: np.ndarray, decoder_input_tokens: np.ndarray):
  """`hf_forward` row by row, each encoder row cut to its unpadded length (padded
  positions of the encoder output are NaN). The float64 reference: transformers' float64
  run of a padded batch gives NaN in rows whose padded tail is longer than the sliding
  window (a query with no visible key), and a padded row must give what its unpadded
  self gives."""
  b, i = encoder_input_tokens.shape
  encoded, logits = np.full((b, i, 0), np.nan), []
  for r in range(b):
    n = int((encoder_input_tokens[r] != PAD).sum())
    e, l = hf_forward(model, encoder_input_tokens[r:r + 1, :n], decoder_input_tokens[r:r + 1])
    if not encoded.shape[-1]:
      encoded = np.full((b, i, e.shape[-1]), np.nan)
    encoded[r, :n] = e[0]
    logits.append(l[0])
  return encoded, np.stack(logits)


def hf_greedy(model, encoder_input_tokens: np.ndarray, max_new_tokens: int) -> np.ndarray:
  """transformers' generate (greedy, decoder start BOS 2), without the start token:
  [b, max_new_tokens], 0 after EOS (transformers pads finished rows with pad 0)."""
  import torch
  enc = torch.tensor(encoder_input_tokens, dtype=torch.long)
  with torch.no_grad():
    out = model.generate(input_ids=enc, attention_mask=(enc != PAD).long(), do_sample=False,
                         num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         decoder_start_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
  out = out[:, 1:].numpy()
  return np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1])))


def hf_summed_log_probs(model, encoder_input_tokens: np.ndarray, targets: np.ndarray):
  """Summed log p(target tokens) per row; targets [b, t] end with EOS, 0-padded. Each
  row is run unpadded (see `hf_forward_unpadded`)."""
  import torch
  dec = np.concatenate([np.full((targets.shape[0], 1), BOS), targets[:, :-1]], axis=1)
  _, logits = hf_forward_unpadded(model, encoder_input_tokens, dec)
  logp = torch.log_softmax(torch.tensor(logits), dim=-1).numpy()
  picked = np.take_along_axis(logp, targets[..., None].astype(np.int64), axis=-1)[..., 0]
  return (picked * (targets != PAD)).sum(axis=1)


def random_batch(vocab_size: int, *, batch: int = 3, enc_len: int = 40, dec_len: int = 24,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Encoder inputs with padded tails of different lengths (ids 3.. so that no stray
  pad/EOS/BOS appears inside); decoder inputs starting with BOS 2."""
  rng = np.random.default_rng(seed)
  enc = rng.integers(3, vocab_size, size=(batch, enc_len)).astype(np.int32)
  for row, keep in enumerate([enc_len, enc_len - 13, 21][:batch]):
    enc[row, keep:] = PAD
  dec = rng.integers(3, vocab_size, size=(batch, dec_len)).astype(np.int32)
  dec[:, 0] = BOS
  return enc, dec


def read_config(path: str) -> dict:
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def write_config(path: str, cfg: dict) -> None:
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(cfg, f, indent=2)


# ---------------------------------------------------------------------------------------
# Tokenizers with Gemma's id layout (pad 0, eos 1, bos 2, unk 3), trained offline on the
# bundled English text: a SentencePiece `tokenizer.model` and a `tokenizers` `tokenizer.json`.

def _english_lines(n: int = 2000) -> list[str]:
  import gzip
  path = os.path.join(os.path.dirname(__file__), "..", "t5forge", "data", "bundled",
                      "english_web_bible.txt.gz")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return [line.strip() for _, line in zip(range(n), f) if line.strip()]


def write_sentencepiece(path: str, vocab_size: int) -> str:
  """A unigram SentencePiece model of exactly `vocab_size` pieces, Gemma's layout."""
  import io
  import sentencepiece as spm
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_english_lines()), model_writer=buf, vocab_size=vocab_size,
      model_type="unigram", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
      eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", num_threads=1, minloglevel=2,
      hard_vocab_limit=True)
  with open(path, "wb") as f:
    f.write(buf.getvalue())
  return path


def write_tokenizer_json(path: str, vocab_size: int) -> str:
  """A `tokenizers` BPE tokenizer.json of exactly `vocab_size` ids, Gemma's layout."""

  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  tok.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_previous")
  tok.decoder = decoders.Replace("\u2581", " ")
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
  tok.train_from_iterator(_english_lines(), trainer=trainer)
  if tok.get_vocab_size() != vocab_size:
    raise AssertionError(f"trained {tok.get_vocab_size()} ids, wanted {vocab_size}")
  tok.save(path)
  return path


def write_tokenizer_config(model_dir: str) -> None:
  """tokenizer_config.json / special_tokens_map.json as Gemma releases have them."""
  special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
             "unk_token": "<unk>"}
  with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "GemmaTokenizer", "add_bos_token": True,
               "add_eos_token": False, **special}, f, indent=2)
  with open(os.path.join(model_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
    json.dump(special, f, indent=2)
