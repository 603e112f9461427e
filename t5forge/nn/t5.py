"""The T5 encoder-decoder: T5 1.0, T5.1.1 / Flan-T5, mT5 and ByT5 by config.

Parameter names follow T5X (`token_embedder`, `encoder/layers_0/attention/query`, ...),
so T5X checkpoints map one to one and HF checkpoints by a fixed table.

Shape letters (docs/shapes.md): b batch, i encoder length, t decoder length, e emb_dim, v vocab.
"""
from __future__ import annotations

import flax.linen as nn

from t5forge.nn import attention as attn
from t5forge.nn import prompt
from t5forge.nn.blocks import (decoder_head, embed, final_norm, mlp_residual, norm, residual,
                               t5_attention)
from t5forge.nn.config import ModelConfig
from t5forge.nn.encdec import EncoderDecoderShell, decoder_masks, encoder_mask
from t5forge.nn.layers import Embed
from t5forge.nn.stack import layer_stack


def relative_position_bias(cfg: ModelConfig, *, bidirectional: bool) -> attn.RelativePositionBias:
  """T5's relative position bias of a stack (`relpos_bias`), shared by its layers."""
  return attn.RelativePositionBias(
      num_buckets=cfg.relative_attention_num_buckets,
      max_distance=cfg.relative_attention_max_distance, num_heads=cfg.num_heads,
      bidirectional=bidirectional, name="relpos_bias")


class EncoderLayer(nn.Module):
  """Pre-norm self-attention and MLP, each with a residual connection."""

  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, position_bias, mask_bias, deterministic: bool):
    # x: [b, i, e]; position_bias: [1, h, i, i]; mask_bias: [b, 1, i, i] or [b, 1, 1, i]
    cfg = self.config
    y = norm(cfg, "pre_attention_layer_norm")(x)
    y = t5_attention(cfg, "attention")(y, y, position_bias, mask_bias, deterministic)
    x = residual(cfg, x, y, deterministic)
    x = mlp_residual(cfg, x, deterministic)
    return (x, None) if self.scanned else x


class DecoderLayer(nn.Module):
  """Self-attention (causal), cross-attention to the encoder, MLP; all pre-norm."""

  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, encoded, position_bias, self_mask_bias, cross_mask_bias,
               deterministic: bool, decode: bool = False, cache_index=None,
               max_length: int | None = None):
    # x: [b, t, e]; encoded: [b, i, e] (None when decoding from a filled cache);
    # position_bias: [1, h, t, t] ([1, h, t, max_length] when decoding)
    cfg = self.config
    y = norm(cfg, "pre_self_attention_layer_norm")(x)
    y = t5_attention(cfg, "self_attention")(y, y, position_bias, self_mask_bias, deterministic,
                                            "self" if decode else None, cache_index, max_length)
    x = residual(cfg, x, y, deterministic)
    y = norm(cfg, "pre_cross_attention_layer_norm")(x)
    y = t5_attention(cfg, "encoder_decoder_attention")(y, encoded, None, cross_mask_bias,
                                                       deterministic, "cross" if decode else None)
    x = residual(cfg, x, y, deterministic)
    x = mlp_residual(cfg, x, deterministic)
    return (x, None) if self.scanned else x


class Encoder(nn.Module):
  config: ModelConfig
  shared_embedding: Embed

  @nn.compact
  def __call__(self, *, tokens, segment_ids, positions, deterministic: bool, valid=None):
    """tokens [b, i] (0 = padding), segment_ids [b, i] or None -> encoded [b, i, e]
    ([b, p + i, e] with a prompt, `nn.prompt`). T5's relative attention needs no
    positions (packed segments are contiguous).
    valid [b, i] bool: the keys attended to, or None (`EncoderDecoderShell.encode`)."""
    cfg = self.config
    embedded = tokens
    prompt_vectors, tokens, _, valid = prompt.encoder_inputs(
        cfg.prompt, cfg.emb_dim, tokens, segment_ids, positions, valid)
    del positions
    length = tokens.shape[-1]
    x = embed(cfg, self.shared_embedding, embedded, deterministic, prompt=prompt_vectors)
    position_bias = relative_position_bias(cfg, bidirectional=True)(length, length)
    mask_bias = attn.mask_to_bias(encoder_mask(tokens, segment_ids, valid),
                                  cfg.activation_dtype)
    x = layer_stack(EncoderLayer, num_layers=cfg.num_encoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=cfg), x=x,
                    args=dict(position_bias=position_bias, mask_bias=mask_bias),
                    static=dict(deterministic=deterministic))
    return final_norm(cfg, x, deterministic, name="encoder_norm")


class Decoder(nn.Module):
  config: ModelConfig
  shared_embedding: Embed

  @nn.compact
  def __call__(self, *, encoded, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
               decoder_segment_ids, decoder_positions, deterministic: bool,
               decode: bool = False, max_decode_length: int | None = None):
    """The decoder -> logits [b, t, v] (float32); arguments as `EncoderDecoderShell.decode`'s
    (decoder_positions unused: relative attention)."""
    del decoder_positions
    cfg = self.config
    length = decoder_input_tokens.shape[-1]
    dtype = cfg.activation_dtype
    y = embed(cfg, self.shared_embedding, decoder_input_tokens, deterministic)
    relpos = relative_position_bias(cfg, bidirectional=False)
    masks = decoder_masks(self, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
                          decoder_segment_ids, decode=decode,
                          max_decode_length=max_decode_length)
    if decode:
      position_bias = relpos(length, max_decode_length, masks.cache_index)  # [1, h, t, max_len]
    else:
      position_bias = relpos(length, length)
    y = layer_stack(DecoderLayer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=cfg), x=y,
                    args=dict(encoded=encoded, position_bias=position_bias,
                              self_mask_bias=attn.mask_to_bias(masks.self_mask, dtype),
                              cross_mask_bias=attn.mask_to_bias(masks.cross_mask, dtype),
                              cache_index=masks.cache_index),
                    static=dict(deterministic=deterministic, decode=decode,
                                max_length=max_decode_length))
    return decoder_head(cfg, y, self.shared_embedding, deterministic)


class EncoderDecoder(EncoderDecoderShell):
  """The T5 network (`EncoderDecoderShell`), one embedding shared by both stacks."""

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                                dtype=cfg.activation_dtype)
    self.encoder = Encoder(config=cfg, shared_embedding=self.token_embedder)
    self.decoder = Decoder(config=cfg, shared_embedding=self.token_embedder)
