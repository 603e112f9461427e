"""Random-init Hugging Face T5Gemma 2 models, built offline and saved as real HF directories.

transformers (PyTorch) is the numerical reference in tests only. Every text weight, norms
and the end-of-image vector included, is randomised (norm weights around 0, i.e. scales
`1 + w` around 1). The vision tower is a tiny SigLIP (transformers always builds one); it
is saved with the rest and t5forge skips it.

The float64 reference is transformers' model in float64 with its rotary angles computed
in float64 too (transformers computes them in float32 even in a float64 model).
"""
from __future__ import annotations

import types

import numpy as np

from hf_t5gemma_reference import BOS, EOS, PAD

EOI = 200  # the end-of-image token, moved inside the tiny vocabulary so that it is tested

# Gemma 3's layout scaled down: 7 layers, 5 local : 1 global (layer 5 global, layer 6
# local again), grouped-query attention (4 heads over 2), head_dim 24 independent of the
# width 64, query_pre_attn_scalar 20 != head_dim, window 6 far below the inputs' lengths,
# RoPE bases 10,000 (local) and 1,000,000 (global), final soft-cap 2 (tanh really bends).
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20,
            sliding_window=6, max_position_embeddings=512, rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=2.0,
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)


def hf_config(**text_changes):
  import transformers
  text = {**TEXT, **text_changes}
  encoder = transformers.T5Gemma2EncoderConfig(text_config=dict(text), vision_config=VISION,
                                               mm_tokens_per_image=4, eoi_token_index=EOI)
  decoder = transformers.T5Gemma2DecoderConfig(**text)
  return transformers.T5Gemma2Config(encoder=encoder, decoder=decoder, dropout_rate=0.0,
                                     attention_dropout=0.0)


def build_hf_dir(out_dir: str, seed: int = 0, **text_changes) -> str:
  """Saves a random-init T5Gemma2ForConditionalGeneration to out_dir; returns out_dir."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.T5Gemma2ForConditionalGeneration(hf_config(**text_changes))
  with torch.no_grad():
    for pname, p in model.named_parameters():  # tied copies are the same tensor
      if pname.endswith("norm.weight") or p.ndim == 1:
        p.copy_(0.2 * torch.randn_like(p))
      else:  # Linear [out, in], embedding [vocab, width]: unit-scale outputs
        p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
  model.save_pretrained(out_dir)
  return out_dir


def _rope_float64(module, x, position_ids, layer_type):
  """T5Gemma2RotaryEmbedding.forward with angles computed in float64 (default or linear
  RoPE)."""
  import torch
  cfg = module.config
  rope = cfg.rope_parameters[layer_type]
  dim = cfg.head_dim
  inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
  if rope.get("rope_type") == "linear":
    inv_freq = inv_freq / rope["factor"]
  freqs = position_ids[..., None].to(torch.float64) * inv_freq
  emb = torch.cat((freqs, freqs), dim=-1)
  return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def load_hf_model(path: str, *, float64: bool = False):
  """T5Gemma2ForConditionalGeneration from `path`, eval mode; float64 with float64 RoPE."""
  import transformers
  model = transformers.T5Gemma2ForConditionalGeneration.from_pretrained(path).eval()
  if not float64:
    return model
  model = model.double()
  for module in model.modules():
    if type(module).__name__ == "T5Gemma2RotaryEmbedding":
      module.forward = types.MethodType(_rope_float64, module)
  return model


def hf_forward(model, encoder_input_tokens: np.ndarray, decoder_input_tokens: np.ndarray):
  """(encoder last hidden state [b, i, e], logits [b, t, v]) as float64 numpy."""
  import torch
  enc = torch.tensor(encoder_input_tokens, dtype=torch.long)
  dec = torch.tensor(decoder_input_tokens, dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=enc, attention_mask=(enc != PAD).long(), decoder_input_ids=dec)
  return out.encoder_last_hidden_state.double().numpy(), out.logits.double().numpy()


def hf_forward_unpadded(model, encoder_input_tokens: np.ndarray, decoder_input_tokens: np.ndarray):
  """`hf_forward` row by row, each encoder row cut to its unpadded length (padded
  positions of the encoder output are NaN)."""
  b, i = encoder_input_tokens.shape
  encoded, logits = None, []
  for r in range(b):
    n = int((encoder_input_tokens[r] != PAD).sum())
    e, l = hf_forward(model, encoder_input_tokens[r:r + 1, :n], decoder_input_tokens[r:r + 1])
    if encoded is None:
      encoded = np.full((b, i, e.shape[-1]), np.nan)
    encoded[r, :n] = e[0]
    logits.append(l[0])
  return encoded, np.stack(logits)


def hf_greedy(model, encoder_input_tokens: np.ndarray, max_new_tokens: int) -> np.ndarray:
  """transformers' generate (greedy, from BOS 2) without the start token:
  [b, max_new_tokens], 0 after EOS."""
  import torch
  enc = torch.tensor(encoder_input_tokens, dtype=torch.long)
  with torch.no_grad():
    out = model.generate(input_ids=enc, attention_mask=(enc != PAD).long(), do_sample=False,
                         num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         decoder_start_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
  out = out[:, 1:].numpy()
  return np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1])))


def random_batch(*, batch: int = 3, enc_len: int = 40, dec_len: int = 24, seed: int = 0):
  """Encoder rows padded to different lengths, decoder rows from BOS; the end-of-image
  token appears in both (its input vector is the separate eoi embedding)."""
  rng = np.random.default_rng(seed)
  enc = rng.integers(3, TEXT["vocab_size"], size=(batch, enc_len)).astype(np.int32)
  for row, keep in enumerate([enc_len, enc_len - 13, 21][:batch]):
    enc[row, keep:] = PAD
  enc[:, 4] = EOI
  dec = rng.integers(3, TEXT["vocab_size"], size=(batch, dec_len)).astype(np.int32)
  dec[:, 0] = BOS
  dec[:, 7] = EOI
  return enc, dec
