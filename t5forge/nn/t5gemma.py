"""T5Gemma (arXiv 2504.06225): Gemma 2 layers as an encoder-decoder.

Built from the T5 family's parts (`attention.MultiHeadAttention` with its grouped-query,
RoPE, query-scale and soft-cap options, `layers.RMSNorm(plus_one=True)`, the gated
`MlpBlock`, `stack.layer_stack`) and selected by `ModelConfig(architecture='t5gemma')`.
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
import jax
import jax.numpy as jnp

from t5forge.nn import attention as attn
from t5forge.nn.config import ModelConfig
from t5forge.nn.layers import Embed, RMSNorm
from t5forge.nn.stack import layer_stack
from t5forge.nn.t5 import ACT, _dropout, _mlp, output_logits


def _attention(cfg: ModelConfig, name: str, *, rope: bool) -> attn.MultiHeadAttention:
  """Gemma 2 attention with cfg's heads (cfg: the encoder's or the decoder's shape)."""
  scalar = cfg.query_pre_attn_scalar or cfg.head_dim
  return attn.MultiHeadAttention(
      num_heads=cfg.num_heads, head_dim=cfg.head_dim, dropout_rate=cfg.dropout_rate,
      dtype=cfg.activation_dtype, float32_logits=cfg.float32_attention_logits,
      num_kv_heads=cfg.kv_heads, query_scale=float(scalar) ** -0.5,
      softcap=cfg.attn_logit_softcapping, rope_theta=cfg.rope_theta if rope else None,
      name=name)


def _norm(cfg: ModelConfig, name: str) -> RMSNorm:
  return RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.activation_dtype, plus_one=True,
                 name=name)


def _pick(sliding, local_bias, global_bias):
  """The mask bias of a layer: a Python bool (loop) or a traced one (scan)."""
  if local_bias is None:
    return global_bias
  if isinstance(sliding, bool):
    return local_bias if sliding else global_bias
  return jnp.where(sliding, local_bias, global_bias)


# transformers' T5Gemma initialises embeddings N(0, 0.02) (`initializer_range`). T5's N(0, 1)
# would make the tied, unscaled output layer's initial logits N(0, emb_dim): a first loss of
# ~25 nats over an 8,000-word vocabulary instead of ~ln(8000) = 9.
EMBED_INIT = nn.initializers.normal(stddev=0.02)


def _embed(cfg: ModelConfig, embedder: Embed, tokens, deterministic: bool):
  """tokens [b, l] -> embeddings * sqrt(e) [b, l, e], float32 (the residual stream)."""
  x = embedder(tokens) * jnp.float32(cfg.emb_dim ** 0.5)
  x = _dropout(cfg, x, deterministic)
  return nn.with_logical_constraint(x.astype(jnp.float32), ACT)


class EncoderLayer(nn.Module):
  """Sandwich-normed bidirectional self-attention and MLP, each with a residual."""

  config: ModelConfig  # the encoder's shape (ModelConfig.encoder)
  scanned: bool = False

  @nn.compact
  def __call__(self, x, sliding, positions, global_bias, local_bias, deterministic: bool):
    # x: [b, i, e]; positions: [b, i] or [i]; *_bias: [b, 1, i, i] or [b, 1, 1, i]
    cfg = self.config
    y = _norm(cfg, "pre_self_attention_layer_norm")(x)
    y = _attention(cfg, "attention", rope=True)(
        y, y, None, _pick(sliding, local_bias, global_bias), deterministic, positions=positions)
    y = _norm(cfg, "post_self_attention_layer_norm")(y)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _mlp(cfg)(_norm(cfg, "pre_mlp_layer_norm")(x), deterministic)
    y = _norm(cfg, "post_mlp_layer_norm")(y)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
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
    y = _norm(cfg, "pre_self_attention_layer_norm")(x)
    y = _attention(cfg, "self_attention", rope=True)(
        y, y, None, _pick(sliding, local_bias, global_bias), deterministic,
        "self" if decode else None, cache_index, max_length, positions=positions)
    y = _norm(cfg, "post_self_attention_layer_norm")(y)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _norm(cfg, "pre_cross_attention_layer_norm")(x)
    y = _attention(cfg, "encoder_decoder_attention", rope=False)(
        y, encoded, None, cross_bias, deterministic, "cross" if decode else None)
    y = _norm(cfg, "post_cross_attention_layer_norm")(y)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _mlp(cfg)(_norm(cfg, "pre_mlp_layer_norm")(x), deterministic)
    y = _norm(cfg, "post_mlp_layer_norm")(y)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    return (x, None) if self.scanned else x


def _window_mask(query_pos, key_pos, window: int, causal: bool):
  """[q], [k] int positions -> [1, 1, q, k] bool: keys within the sliding window."""
  delta = query_pos[:, None] - key_pos[None, :]
  inside = (delta >= 0) & (delta < window) if causal else jnp.abs(delta) <= window
  return inside[None, None]


class Encoder(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, deterministic: bool):
    """tokens [b, i] (0 = padding), segment_ids / positions [b, i] or None -> [b, i, e]."""
    cfg = self.config
    enc = cfg.encoder
    length = tokens.shape[-1]
    embedder = Embed(num_embeddings=cfg.vocab_size, features=enc.emb_dim,
                     dtype=cfg.activation_dtype, embedding_init=EMBED_INIT,
                     name="token_embedder")
    x = _embed(enc, embedder, tokens, deterministic)
    # Padding keys are masked; padded queries still attend to real keys (as HF).
    mask = attn.padding_mask(None, tokens > 0)
    if segment_ids is not None:
      mask = attn.combine_masks(mask, attn.segment_mask(segment_ids, segment_ids))
    local = None
    if cfg.sliding_window is not None:
      idx = jnp.arange(length)
      local = attn.combine_masks(mask, _window_mask(idx, idx, cfg.sliding_window, False))
    if positions is None:
      positions = jnp.arange(length)
    dtype = cfg.activation_dtype
    x = layer_stack(EncoderLayer, num_layers=cfg.num_encoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, static_argnums=(4,),
                    layer_kwargs=dict(config=enc), x=x,
                    layer_flags=cfg.sliding_layers(cfg.num_encoder_layers),
                    args=(positions, attn.mask_to_bias(mask, dtype),
                          attn.mask_to_bias(local, dtype), deterministic))
    x = _norm(enc, "encoder_norm")(x)
    return _dropout(cfg, x, deterministic)



def decoder_masks(module: nn.Module, cfg: ModelConfig, encoder_tokens, decoder_input_tokens,
                  encoder_segment_ids, decoder_segment_ids, decoder_positions, decode: bool,
                  max_decode_length: int | None):
  """The masks of a T5Gemma-family decoder (T5Gemma's and T5Gemma 2's), built inside
  `module`'s compact call (decoding keeps its step index and the encoder's valid positions
  in `module`'s "cache" collection).

  Returns (positions [t] or [b, t], self_mask [.., t, k] causal (and segments), local (the
  causal sliding window combined with self_mask; None without a window), cross_mask
  [.., t, i], starts [b, t] (positions that begin a segment), cache_index (None unless
  decoding)); k is t, or max_decode_length when decoding.
  """
  length = decoder_input_tokens.shape[-1]
  cache_index = None
  if decode:
    initialized = module.has_variable("cache", "index")
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    encoder_valid = module.variable("cache", "encoder_valid", lambda: encoder_tokens > 0)
    cache_index = index.value
    positions = cache_index + jnp.arange(length)  # [t]
    keys = jnp.arange(max_decode_length)
    self_mask = (keys[None, :] <= positions[:, None])[None, None]  # [1, 1, t, max_len]
    local = (None if cfg.sliding_window is None
             else _window_mask(positions, keys, cfg.sliding_window, True))
    cross_mask = attn.padding_mask(None, encoder_valid.value)
    if initialized:
      index.value = cache_index + length
  else:
    positions = decoder_positions if decoder_positions is not None else jnp.arange(length)
    idx = jnp.arange(length)
    self_mask = attn.causal_mask(length)
    local = (None if cfg.sliding_window is None
             else _window_mask(idx, idx, cfg.sliding_window, True))
    cross_mask = attn.padding_mask(None, encoder_tokens > 0)
    if decoder_segment_ids is not None:
      self_mask = attn.combine_masks(
          self_mask, attn.segment_mask(decoder_segment_ids, decoder_segment_ids))
      cross_mask = attn.combine_masks(
          cross_mask, attn.segment_mask(decoder_segment_ids, encoder_segment_ids))
  starts = jnp.broadcast_to(positions == 0, decoder_input_tokens.shape)
  local = attn.combine_masks(self_mask, local) if local is not None else None
  return positions, self_mask, local, cross_mask, starts, cache_index


def decoder_head(cfg: ModelConfig, y, embedder, deterministic: bool):
  """The decoder's last norm, dropout and output layer with the final-logit soft-cap, for
  T5Gemma and T5Gemma 2 (call inside the decoder's compact call: the norm's name is
  `decoder_norm`). y [b, t, e] -> float32 logits [b, t, v]."""
  y = _dropout(cfg, _norm(cfg, "decoder_norm")(y), deterministic)
  logits = output_logits(cfg, y, embedder)
  if cfg.final_logit_softcapping is not None:
    cap = cfg.final_logit_softcapping
    logits = jnp.tanh(logits / cap) * cap
  return logits

class Decoder(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, encoded, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
               decoder_segment_ids, decoder_positions, deterministic: bool,
               decode: bool = False, max_decode_length: int | None = None):
    """The decoder -> float32 logits [b, t, v]; arguments as t5.Decoder's, plus
    decoder_positions [b, t] (packed rows; None: 0..t-1)."""
    cfg = self.config
    dtype = cfg.activation_dtype
    embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=dtype,
                     embedding_init=EMBED_INIT, name="token_embedder")
    positions, self_mask, local, cross_mask, starts, cache_index = decoder_masks(
        self, cfg, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
        decoder_segment_ids, decoder_positions, decode, max_decode_length)
    tokens = decoder_input_tokens
    if cfg.decoder_start_token_id:
      # SeqIO's decoder inputs begin each segment with 0; T5Gemma's decoder starts from BOS.
      tokens = jnp.where(starts & (tokens == 0), cfg.decoder_start_token_id, tokens)
    y = _embed(cfg, embedder, tokens, deterministic)
    y = layer_stack(DecoderLayer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, static_argnums=(6, 7, 9),
                    layer_kwargs=dict(config=cfg), x=y, decode=decode,
                    layer_flags=cfg.sliding_layers(cfg.num_decoder_layers),
                    args=(encoded, positions, attn.mask_to_bias(self_mask, dtype),
                          attn.mask_to_bias(local, dtype), attn.mask_to_bias(cross_mask, dtype),
                          deterministic, decode, cache_index, max_decode_length))
    return decoder_head(cfg, y, embedder, deterministic)


class T5GemmaEncoderDecoder(nn.Module):
  """The T5Gemma network, with `EncoderDecoder`'s methods (`encode`, `decode`,
  `__call__`), so `t5forge.models.EncoderDecoderModel` trains, scores and decodes it."""

  config: ModelConfig

  def setup(self):
    self.encoder = Encoder(config=self.config)
    self.decoder = Decoder(config=self.config)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, *,
             enable_dropout: bool = False, encoder_positions=None):
    """[b, i] int -> [b, i, e_enc]."""
    return self.encoder(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                        not enable_dropout)

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
             encoder_segment_ids=None, decoder_segment_ids=None, *,
             enable_dropout: bool = False, decode: bool = False,
             max_decode_length: int | None = None, decoder_positions=None):
    """[b, i, e_enc], [b, i], [b, t] -> logits [b, t, v]; with decode=True, one step of
    cached decoding (see `Decoder`)."""
    return self.decoder(encoded, encoder_input_tokens, decoder_input_tokens,
                        encoder_segment_ids, decoder_segment_ids, decoder_positions,
                        not enable_dropout, decode, max_decode_length)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout: bool = False):
    """Teacher forcing: [b, i], [b, t] -> logits [b, t, v] (float32). Positions (packed
    rows) place RoPE and the decoder starts; None: 0..length-1."""
    del decoder_target_tokens
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids,
                          enable_dropout=enable_dropout, encoder_positions=encoder_positions)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       encoder_segment_ids, decoder_segment_ids, enable_dropout=enable_dropout,
                       decoder_positions=decoder_positions)
