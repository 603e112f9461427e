"""T5Gemma (arXiv 2504.06225): Gemma 2 layers as an encoder-decoder.

Built from the T5 family's parts (`attention.MultiHeadAttention` with its grouped-query,
RoPE, query-scale and soft-cap options, `blocks.gemma_norm`, the gated MLP,
`stack.layer_stack`, the `encdec.EncoderDecoderShell`) and selected by
`ModelConfig(architecture='t5gemma')`.
What differs from T5 (t5forge/nn/t5.py):

- rotary position embeddings in self-attention (none in cross-attention), no relative
  position bias; grouped-query attention (`num_kv_heads`); queries scaled by
  `query_pre_attn_scalar ** -0.5`; attention logits soft-capped;
- layers alternate sliding-window and global self-attention (`sliding_window`,
  `sliding_window_pattern`): the encoder's window is bidirectional (|i - j| <= window),
  the decoder's causal (0 <= i - j < window), as transformers' masks;
- "sandwich" norms: RMS norms before and after self-attention, cross-attention and the
  MLP, with a (1 + w) scale; embeddings multiplied by sqrt(width);
- separate encoder and decoder embeddings, the decoder's tied to the output layer
  (`logits_via_embedding`), final logits soft-capped; the encoder may be wider than
  the decoder (`encoder_*` fields, e.g. 9B-2B), the cross-attention keys/values are
  then projected from the encoder width;
- the decoder starts from `decoder_start_token_id` (BOS, 2): a 0 (SeqIO's BOS) at the
  start of a decoder segment is read as that id, in teacher forcing and in decoding.

Parameter paths (t5forge/convert and /work docs): `encoder/token_embedder`,
`encoder/layers_<i>/{pre,post}_self_attention_layer_norm`, `.../attention/{query,key,
value,out}`, `.../{pre,post}_mlp_layer_norm`, `.../mlp/{wi_0,wi_1,wo}`,
`encoder/encoder_norm`; the decoder likewise plus `self_attention`,
`encoder_decoder_attention` and `{pre,post}_cross_attention_layer_norm`,
`decoder/decoder_norm` (`decoder/logits_dense` only when untied).

Shape letters (docs/shapes.md): b batch, i encoder length, t decoder length, e width,
v vocab.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from t5forge.nn import attention as attn
from t5forge.nn import prompt
from t5forge.nn.blocks import (EMBED_INIT, decoder_head, embed, final_norm, gemma2_attention,
                               gemma_norm, mlp_residual, pick, residual)
from t5forge.nn.config import ModelConfig
from t5forge.nn.encdec import EncoderDecoderShell, decoder_masks, encoder_mask
from t5forge.nn.layers import Embed
from t5forge.nn.stack import layer_stack


def start_tokens(cfg: ModelConfig, tokens, starts):
  """Decoder input tokens [b, t] with a 0 at a segment start (`starts` [b, t]) read as
  cfg.decoder_start_token_id: SeqIO's decoder inputs begin each segment with 0, T5Gemma's
  decoder starts from BOS."""
  if not cfg.decoder_start_token_id:
    return tokens
  return jnp.where(starts & (tokens == 0), cfg.decoder_start_token_id, tokens)


class EncoderLayer(nn.Module):
  """Sandwich-normed bidirectional self-attention and MLP, each with a residual."""

  config: ModelConfig  # the encoder's shape (ModelConfig.encoder)
  scanned: bool = False

  @nn.compact
  def __call__(self, x, sliding, positions, global_bias, local_bias, deterministic: bool):
    # x: [b, i, e]; positions: [b, i] or [i]; *_bias: [b, 1, i, i] or [b, 1, 1, i]
    cfg = self.config
    y = gemma_norm(cfg, "pre_self_attention_layer_norm")(x)
    y = gemma2_attention(cfg, "attention", rope=True)(
        y, y, None, pick(sliding, local_bias, global_bias), deterministic, positions=positions)
    x = residual(cfg, x, gemma_norm(cfg, "post_self_attention_layer_norm")(y), deterministic)
    x = mlp_residual(cfg, x, deterministic, sandwich=True)
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Causal self-attention, cross-attention to the encoder, MLP; all sandwich-normed."""

  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, sliding, encoded, positions, global_bias, local_bias, cross_bias,
               deterministic: bool, decode: bool = False, cache_index=None,
               max_length: int | None = None):
    # x: [b, t, e]; encoded: [b, i, e_enc] (None when decoding from a filled cache);
    # *_bias: [b or 1, 1, t, t] ([.., t, max_length] when decoding); cross: [b, 1, 1, i]
    cfg = self.config
    y = gemma_norm(cfg, "pre_self_attention_layer_norm")(x)
    y = gemma2_attention(cfg, "self_attention", rope=True)(
        y, y, None, pick(sliding, local_bias, global_bias), deterministic,
        "self" if decode else None, cache_index, max_length, positions=positions)
    x = residual(cfg, x, gemma_norm(cfg, "post_self_attention_layer_norm")(y), deterministic)
    y = gemma_norm(cfg, "pre_cross_attention_layer_norm")(x)
    y = gemma2_attention(cfg, "encoder_decoder_attention", rope=False)(
        y, encoded, None, cross_bias, deterministic, "cross" if decode else None)
    x = residual(cfg, x, gemma_norm(cfg, "post_cross_attention_layer_norm")(y), deterministic)
    x = mlp_residual(cfg, x, deterministic, sandwich=True)
    return (x, None) if self.scanned else x


class Encoder(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, *, tokens, segment_ids, positions, deterministic: bool, valid=None):
    """tokens [b, i] (0 = padding), segment_ids / positions [b, i] or None -> [b, i, e];
    valid [b, i] bool: the keys attended to, or None (`EncoderDecoderShell.encode`)."""
    cfg = self.config
    enc = cfg.encoder
    embedder = Embed(num_embeddings=cfg.vocab_size, features=enc.emb_dim,
                     dtype=cfg.activation_dtype, embedding_init=EMBED_INIT,
                     name="token_embedder")
    embedded = tokens
    # A prompt (nn.prompt) goes before the sqrt(e) scale, scaled as the tokens are.
    prompt_vectors, tokens, positions, valid = prompt.encoder_inputs(
        cfg.prompt, enc.emb_dim, tokens, segment_ids, positions, valid)
    length = tokens.shape[-1]
    x = embed(enc, embedder, embedded, deterministic, scaled=True, prompt=prompt_vectors)
    mask = encoder_mask(tokens, segment_ids, valid)
    local = None
    if cfg.sliding_window is not None:
      idx = jnp.arange(length)
      local = attn.combine_masks(mask, attn.window_mask(idx, idx, cfg.sliding_window, False))
    if positions is None:
      positions = jnp.arange(length)
    dtype = cfg.activation_dtype
    x = layer_stack(EncoderLayer, num_layers=cfg.num_encoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=enc), x=x,
                    layer_flags=cfg.sliding_layers(cfg.num_encoder_layers),
                    args=dict(positions=positions, global_bias=attn.mask_to_bias(mask, dtype),
                              local_bias=attn.mask_to_bias(local, dtype)),
                    static=dict(deterministic=deterministic))
    # (The encoder's norm: layer_norm_epsilon and dtype are the whole config's.)
    return final_norm(cfg, x, deterministic, name="encoder_norm", sandwich=True)


class Decoder(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, *, encoded, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
               decoder_segment_ids, decoder_positions, deterministic: bool,
               decode: bool = False, max_decode_length: int | None = None):
    """The decoder -> float32 logits [b, t, v]; arguments as `EncoderDecoderShell.decode`'s
    (decoder_positions [b, t] place RoPE and the decoder starts; None: 0..t-1)."""
    cfg = self.config
    dtype = cfg.activation_dtype
    embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=dtype,
                     embedding_init=EMBED_INIT, name="token_embedder")
    masks = decoder_masks(self, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
                          decoder_segment_ids, decode=decode,
                          max_decode_length=max_decode_length,
                          decoder_positions=decoder_positions,
                          sliding_window=cfg.sliding_window)
    tokens = start_tokens(cfg, decoder_input_tokens, masks.starts)
    y = embed(cfg, embedder, tokens, deterministic, scaled=True)
    y = layer_stack(DecoderLayer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=cfg), x=y,
                    layer_flags=cfg.sliding_layers(cfg.num_decoder_layers),
                    args=dict(encoded=encoded, positions=masks.positions,
                              global_bias=attn.mask_to_bias(masks.self_mask, dtype),
                              local_bias=attn.mask_to_bias(masks.local, dtype),
                              cross_bias=attn.mask_to_bias(masks.cross_mask, dtype),
                              cache_index=masks.cache_index),
                    static=dict(deterministic=deterministic, decode=decode,
                                max_length=max_decode_length))
    return decoder_head(cfg, y, embedder, deterministic, sandwich=True)


class T5GemmaEncoderDecoder(EncoderDecoderShell):
  """The T5Gemma network (`EncoderDecoderShell`); each stack has its own embedding."""

  def setup(self):
    self.encoder = Encoder(config=self.config)
    self.decoder = Decoder(config=self.config)
