"""Random-init Hugging Face T5 models, built offline and saved as real HF directories.

transformers (PyTorch) is the numerical reference in tests only. Every weight, norms
included, is randomised so that no scale or transpose can hide behind a value of 1.
"""
from __future__ import annotations

import json
import os

import numpy as np

# name -> (model class family, T5Config fields, how the output layer is stored)
#   untie: None = tied (T5 1.0); "4.x" = config says tie_word_embeddings false and the
#   weights hold a distinct lm_head (real Flan-T5 files); "5.x" = config as transformers 5
#   writes it (tie true, scale_decoder_outputs false) plus a distinct lm_head.
VARIANTS = {
    "t5_1_0": ("t5", dict(feed_forward_proj="relu", d_model=32, d_kv=8, num_heads=4, d_ff=64,
                          num_layers=2, num_decoder_layers=2, vocab_size=128), None),
    "flan": ("t5", dict(feed_forward_proj="gated-gelu", d_model=32, d_kv=8, num_heads=4, d_ff=48,
                        num_layers=2, num_decoder_layers=3, vocab_size=160), "4.x"),
    "flan_5x": ("t5", dict(feed_forward_proj="gated-gelu", d_model=32, d_kv=8, num_heads=4,
                           d_ff=48, num_layers=2, num_decoder_layers=2, vocab_size=160), "5.x"),
    "mt5": ("mt5", dict(feed_forward_proj="gated-gelu", d_model=32, d_kv=8, num_heads=4, d_ff=48,
                        num_layers=2, num_decoder_layers=2, vocab_size=300), "4.x"),
    "byt5": ("t5", dict(feed_forward_proj="gated-gelu", d_model=48, d_kv=8, num_heads=6, d_ff=64,
                        num_layers=4, num_decoder_layers=2, vocab_size=384), "4.x"),
}


def build_hf_dir(name: str, out_dir: str, seed: int = 0, **overrides) -> str:
  """Saves a random-init HF model of the given variant to out_dir; returns out_dir.
  overrides: config fields to change (e.g. vocab_size=8100 for the bundled vocabulary)."""
  import torch
  import transformers
  from safetensors.torch import load_file, save_file
  family, fields, untie = VARIANTS[name]
  fields = {**fields, **overrides}
  torch.manual_seed(seed)
  if family == "mt5":
    cfg = transformers.MT5Config(**fields, tie_word_embeddings=untie is None)
    model = transformers.MT5ForConditionalGeneration(cfg)
  else:
    cfg = transformers.T5Config(**fields, tie_word_embeddings=untie is None)
    model = transformers.T5ForConditionalGeneration(cfg)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if "layer_norm" in pname:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "relative_attention_bias" in pname:
        p.copy_(torch.randn_like(p))
  model.save_pretrained(out_dir)
  if untie is not None:
    weights_path = os.path.join(out_dir, "model.safetensors")
    state = load_file(weights_path)
    state["lm_head.weight"] = torch.randn(fields["vocab_size"], fields["d_model"]) * 0.5
    save_file(state, weights_path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
      config = json.load(f)
    if untie == "4.x":
      config["tie_word_embeddings"] = False
      config.pop("scale_decoder_outputs", None)
    with open(config_path, "w") as f:
      json.dump(config, f, indent=2)
  return out_dir


def load_hf_model(path: str):
  import transformers
  with open(os.path.join(path, "config.json")) as f:
    model_type = json.load(f)["model_type"]
  cls = (transformers.MT5ForConditionalGeneration if model_type == "mt5"
         else transformers.T5ForConditionalGeneration)
  return cls.from_pretrained(path).eval()


def hf_forward(model, encoder_input_tokens: np.ndarray, decoder_input_tokens: np.ndarray):
  """(encoder last hidden state [b, i, e], logits [b, t, v]) as float32 numpy."""
  import torch
  enc = torch.tensor(encoder_input_tokens, dtype=torch.long)
  dec = torch.tensor(decoder_input_tokens, dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=enc, attention_mask=(enc > 0).long(), decoder_input_ids=dec)
  return out.encoder_last_hidden_state.float().numpy(), out.logits.float().numpy()


def random_batch(vocab_size: int, *, batch: int = 3, enc_len: int = 150, dec_len: int = 140,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Encoder inputs with padded tails of different lengths; decoder inputs with BOS 0."""
  rng = np.random.default_rng(seed)
  enc = rng.integers(1, vocab_size, size=(batch, enc_len)).astype(np.int32)
  for row, keep in enumerate([enc_len, enc_len - 37, 90][:batch]):
    enc[row, keep:] = 0
  dec = rng.integers(1, vocab_size, size=(batch, dec_len)).astype(np.int32)
  dec[:, 0] = 0
  return enc, dec
