"""Decoder-only T5-style language model: causal LM, or prefix-LM with bidirectional
attention over the inputs part (SeqIO's `decoder_causal_attention`).

Parameter names follow T5X's decoder-only example: everything under `decoder/`
(`decoder/token_embedder`, `decoder/relpos_bias`, `decoder/layers_0/self_attention`, ...).

Shape letters (docs/shapes.md): b batch, l length, e emb_dim, v vocab.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge.nn import attention as attn
from t5forge.nn.blocks import decoder_head, embed, mlp_residual, norm, residual, t5_attention
from t5forge.nn.config import ModelConfig
from t5forge.nn.layers import Embed
from t5forge.nn.stack import layer_stack
from t5forge.nn.t5 import relative_position_bias


class DecoderOnlyLayer(nn.Module):
  """Pre-norm self-attention and MLP, each with a residual connection."""

  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, position_bias, mask_bias, deterministic: bool, decode: bool = False,
               cache_index=None, max_length: int | None = None):
    # x: [b, l, e]; position_bias: [1, h, l, l]; mask_bias: [b or 1, 1, l, l]
    # (keys span max_length cache positions when decoding)
    cfg = self.config
    y = norm(cfg, "pre_self_attention_layer_norm")(x)
    y = t5_attention(cfg, "self_attention")(y, y, position_bias, mask_bias, deterministic,
                                            "self" if decode else None, cache_index, max_length)
    x = residual(cfg, x, y, deterministic)
    x = mlp_residual(cfg, x, deterministic)
    return (x, None) if self.scanned else x


class _Decoder(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, segment_ids, causal_attention, deterministic: bool,
               decode: bool = False, max_decode_length: int | None = None, valid=None):
    cfg = self.config
    length = tokens.shape[-1]
    embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                     dtype=cfg.activation_dtype, name="token_embedder")
    x = embed(cfg, embedder, tokens, deterministic)
    relpos = relative_position_bias(cfg, bidirectional=False)
    cache_index = None
    if decode:
      mask, position_bias, cache_index = self._decode_mask(relpos, tokens, causal_attention,
                                                           valid, max_decode_length)
    else:
      position_bias = relpos(length, length)
      mask = attn.causal_mask(length, causal_attention)
      if segment_ids is not None:
        mask = attn.combine_masks(mask, attn.segment_mask(segment_ids, segment_ids))
    x = layer_stack(DecoderOnlyLayer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=cfg), x=x,
                    args=dict(position_bias=position_bias,
                              mask_bias=attn.mask_to_bias(mask, cfg.activation_dtype),
                              cache_index=cache_index),
                    static=dict(deterministic=deterministic, decode=decode,
                                max_length=max_decode_length))
    return decoder_head(cfg, x, embedder, deterministic)

  def _decode_mask(self, relpos, tokens, causal_attention, valid, max_len):
    """Masks for cached decoding over max_len positions.

    The cache keeps which positions hold real tokens (`key_valid`): a prompt may be
    left-padded (`valid` marks its real tokens, BOS included), so that every example
    of a batch prefills the same number of positions and decodes in lockstep. Relative
    positions make left padding harmless: only distances between real tokens matter.
    Positions marked in causal_attention (prefix-LM inputs) attend to each other in
    both directions within the call that writes them (the prefill).
    """
    b, length = tokens.shape
    initialized = self.has_variable("cache", "index")
    index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    key_valid = self.variable("cache", "key_valid", jnp.zeros, (b, max_len), jnp.bool_)
    pos = index.value
    valid = jnp.ones((b, length), jnp.bool_) if valid is None else valid.astype(bool)
    if initialized:
      key_valid.value = jax.lax.dynamic_update_slice(key_valid.value, valid,
                                                     (jnp.zeros((), jnp.int32), pos))
      index.value = pos + length
    mask = attn.cached_causal_mask(pos + jnp.arange(length), max_len)  # [1, 1, l, L]
    mask = mask & key_valid.value[:, None, None, :]
    if causal_attention is not None:
      prefix = causal_attention.astype(bool) & valid  # [b, l]
      prefix_keys = jax.lax.dynamic_update_slice(jnp.zeros((b, max_len), jnp.bool_), prefix,
                                                 (jnp.zeros((), jnp.int32), pos))
      mask = mask | (prefix[:, None, :, None] & prefix_keys[:, None, None, :])
    return mask, relpos(length, max_len, pos), pos


class DecoderOnly(nn.Module):
  """The decoder-only network. `__call__(decoder_input_tokens, ...) -> logits [b, l, v]`."""

  config: ModelConfig

  def setup(self):
    self.decoder = _Decoder(config=self.config, name="decoder")

  def __call__(self, decoder_input_tokens, decoder_target_tokens=None, decoder_segment_ids=None,
               decoder_positions=None, decoder_causal_attention=None, *,
               enable_dropout: bool = False, decode: bool = False,
               max_decode_length: int | None = None, decoder_valid=None):
    """Teacher forcing over [b, l] tokens, or a step of cached decoding.

    Args:
      decoder_input_tokens: [b, l], the sequence shifted right (0 as BOS).
      decoder_segment_ids: [b, l] for packed rows, or None.
      decoder_causal_attention: [b, l] 1 over the prefix (inputs) that attends
        bidirectionally (prefix-LM), or None for a plain causal LM.
      decode / max_decode_length: use and update the 'cache' collection; the call that
        creates the cache writes nothing and leaves the index at 0. A call with l > 1
        prefills l positions at once.
      decoder_valid: [b, l] real tokens when decoding (left-padded prompts), else all.
    """
    del decoder_target_tokens, decoder_positions
    return self.decoder(decoder_input_tokens, decoder_segment_ids, decoder_causal_attention,
                        not enable_dropout, decode, max_decode_length, decoder_valid)
