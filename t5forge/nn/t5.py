"""The T5 encoder-decoder: T5 1.0, T5.1.1 / Flan-T5, mT5 and ByT5 by config.

Parameter names follow T5X (`token_embedder`, `encoder/layers_0/attention/query`, ...),
so T5X checkpoints map one to one and HF checkpoints by a fixed table.

Shape letters (docs/shapes.md): b batch, i encoder length, t decoder length, e emb_dim, v vocab.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge import sharding as ax
from t5forge.nn import attention as attn
from t5forge.nn.config import ModelConfig
from t5forge.nn.layers import Dense, Embed, MlpBlock, RMSNorm, default_kernel_init
from t5forge.nn.stack import layer_stack

ACT = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)


def _dropout(cfg: ModelConfig, x: jax.Array, deterministic: bool) -> jax.Array:
  # T5X broadcasts residual and embedding dropout masks over the length axis.
  return nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)


def _attention(cfg: ModelConfig, name: str) -> attn.MultiHeadAttention:
  return attn.MultiHeadAttention(num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                 dropout_rate=cfg.dropout_rate, dtype=cfg.activation_dtype,
                                 float32_logits=cfg.float32_attention_logits,
                                 kernel=cfg.attention_kernel, name=name)


def _norm(cfg: ModelConfig, name: str) -> RMSNorm:
  return RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.activation_dtype, name=name)


def _mlp(cfg: ModelConfig) -> MlpBlock:
  return MlpBlock(intermediate_dim=cfg.mlp_dim, activations=cfg.mlp_activations,
                  intermediate_dropout_rate=cfg.dropout_rate, dtype=cfg.activation_dtype,
                  name="mlp")


class EncoderLayer(nn.Module):
  """Pre-norm self-attention and MLP, each with a residual connection."""

  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, position_bias, mask_bias, deterministic: bool):
    # x: [b, i, e]; position_bias: [1, h, i, i]; mask_bias: [b, 1, i, i] or [b, 1, 1, i]
    cfg = self.config
    y = _norm(cfg, "pre_attention_layer_norm")(x)
    y = _attention(cfg, "attention")(y, y, position_bias, mask_bias, deterministic)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _mlp(cfg)(_norm(cfg, "pre_mlp_layer_norm")(x), deterministic)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
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
    y = _norm(cfg, "pre_self_attention_layer_norm")(x)
    y = _attention(cfg, "self_attention")(y, y, position_bias, self_mask_bias, deterministic,
                                          "self" if decode else None, cache_index, max_length)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _norm(cfg, "pre_cross_attention_layer_norm")(x)
    y = _attention(cfg, "encoder_decoder_attention")(y, encoded, None, cross_mask_bias,
                                                     deterministic, "cross" if decode else None)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _mlp(cfg)(_norm(cfg, "pre_mlp_layer_norm")(x), deterministic)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    return (x, None) if self.scanned else x


def output_logits(cfg: ModelConfig, y: jax.Array, embedder: Embed) -> jax.Array:
  """Final decoder states [b, t, e] -> float32 logits [b, t, v] (tied or untied).

  The product runs in the activation dtype (bfloat16 accumulating in float32, as T5X's
  `logits_dense` and autocast do); the logits come out in float32 either way."""
  if cfg.should_scale_logits:
    # T5 1.0 rescales before the tied output layer (HF: `scale_decoder_outputs`).
    y = y.astype(jnp.float32) * cfg.emb_dim ** -0.5
  y = y.astype(cfg.activation_dtype)
  if cfg.logits_via_embedding:
    return embedder.attend(y)
  return Dense(cfg.vocab_size, (ax.EMBED, ax.VOCAB), dtype=cfg.activation_dtype,
               out_dtype=jnp.float32, kernel_init=default_kernel_init, name="logits_dense")(y)


class Encoder(nn.Module):
  config: ModelConfig
  shared_embedding: Embed

  @nn.compact
  def __call__(self, tokens, segment_ids, deterministic: bool):
    """tokens [b, i] (0 = padding), segment_ids [b, i] or None -> encoded [b, i, e]."""
    cfg = self.config
    length = tokens.shape[-1]
    x = _dropout(cfg, self.shared_embedding(tokens), deterministic)
    # The residual stream stays float32 in every dtype (see ModelConfig.dtype).
    x = nn.with_logical_constraint(x.astype(jnp.float32), ACT)
    position_bias = attn.RelativePositionBias(
        num_buckets=cfg.relative_attention_num_buckets,
        max_distance=cfg.relative_attention_max_distance, num_heads=cfg.num_heads,
        bidirectional=True, name="relpos_bias")(length, length)
    # Keys that are padding are masked; padded queries still attend to real keys (as HF),
    # so every row of the softmax has support.
    mask = attn.padding_mask(None, tokens > 0)
    if segment_ids is not None:
      mask = attn.combine_masks(mask, attn.segment_mask(segment_ids, segment_ids))
    x = layer_stack(EncoderLayer, num_layers=cfg.num_encoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, static_argnums=(3,),
                    layer_kwargs=dict(config=cfg), x=x,
                    args=(position_bias, attn.mask_to_bias(mask, cfg.activation_dtype),
                          deterministic))
    x = _norm(cfg, "encoder_norm")(x)
    return _dropout(cfg, x, deterministic)


class Decoder(nn.Module):
  config: ModelConfig
  shared_embedding: Embed

  @nn.compact
  def __call__(self, encoded, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
               decoder_segment_ids, deterministic: bool, decode: bool = False,
               max_decode_length: int | None = None):
    """The decoder: -> logits [b, t, v] (float32).

    Args:
      encoded: [b, i, e] encoder output (when decoding: needed on the call that creates
        the cache only).
      encoder_tokens: [b, i], only for the padding mask of the cross-attention (same).
      decoder_input_tokens: [b, t], targets shifted right with 0 as BOS; when decoding,
        the t next tokens (usually t = 1).
      encoder_segment_ids, decoder_segment_ids: [b, i], [b, t] for packed rows, or None.
      decode: use and update the 'cache' collection (key/values of max_decode_length
        positions, the encoder's projected keys/values and mask, the write index). The
        first call with an empty cache creates it and leaves the index at 0.
    """
    cfg = self.config
    length = decoder_input_tokens.shape[-1]
    dtype = cfg.activation_dtype
    y = _dropout(cfg, self.shared_embedding(decoder_input_tokens), deterministic)
    y = nn.with_logical_constraint(y.astype(jnp.float32), ACT)  # float32 residual stream
    relpos = attn.RelativePositionBias(
        num_buckets=cfg.relative_attention_num_buckets,
        max_distance=cfg.relative_attention_max_distance, num_heads=cfg.num_heads,
        bidirectional=False, name="relpos_bias")
    cache_index = None
    if decode:
      initialized = self.has_variable("cache", "index")
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      encoder_valid = self.variable("cache", "encoder_valid", lambda: encoder_tokens > 0)
      cache_index = index.value
      position_bias = relpos(length, max_decode_length, cache_index)  # [1, h, t, max_len]
      query_pos = cache_index + jnp.arange(length)
      self_mask = (jnp.arange(max_decode_length)[None, :] <= query_pos[:, None])[None, None]
      cross_mask = attn.padding_mask(None, encoder_valid.value)
      if initialized:
        index.value = cache_index + length
    else:
      position_bias = relpos(length, length)
      self_mask = attn.causal_mask(length)
      cross_mask = attn.padding_mask(None, encoder_tokens > 0)
      if decoder_segment_ids is not None:
        self_mask = attn.combine_masks(
            self_mask, attn.segment_mask(decoder_segment_ids, decoder_segment_ids))
        cross_mask = attn.combine_masks(
            cross_mask, attn.segment_mask(decoder_segment_ids, encoder_segment_ids))
    y = layer_stack(DecoderLayer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, static_argnums=(5, 6, 8),
                    layer_kwargs=dict(config=cfg), x=y, decode=decode,
                    args=(encoded, position_bias, attn.mask_to_bias(self_mask, dtype),
                          attn.mask_to_bias(cross_mask, dtype), deterministic, decode,
                          cache_index, max_decode_length))
    y = _dropout(cfg, _norm(cfg, "decoder_norm")(y), deterministic)
    return output_logits(cfg, y, self.shared_embedding)


class EncoderDecoder(nn.Module):
  """The T5 network. `__call__` is teacher forcing; `encode`/`decode` are its halves."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                                dtype=cfg.activation_dtype)
    self.encoder = Encoder(config=cfg, shared_embedding=self.token_embedder)
    self.decoder = Decoder(config=cfg, shared_embedding=self.token_embedder)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, *,
             enable_dropout: bool = False):
    """[b, i] int -> [b, i, e]."""
    return self.encoder(encoder_input_tokens, encoder_segment_ids, not enable_dropout)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
             encoder_segment_ids=None, decoder_segment_ids=None, *,
             enable_dropout: bool = False, decode: bool = False,
             max_decode_length: int | None = None):
    """[b, i, e], [b, i], [b, t] -> logits [b, t, v]; with decode=True, one step of
    cached decoding (see `Decoder`)."""
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        encoder_segment_ids, decoder_segment_ids, not enable_dropout,
                        decode, max_decode_length)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout: bool = False):
    """Teacher forcing: [b, i], [b, t] -> logits [b, t, v] (float32).

    `decoder_target_tokens` and the positions are accepted for SeqIO's feature names; T5's
    relative attention needs no positions (packed segments are contiguous).
    """
    del decoder_target_tokens, encoder_positions, decoder_positions
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids,
                          enable_dropout=enable_dropout)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       encoder_segment_ids, decoder_segment_ids, enable_dropout=enable_dropout)
