"""Decoder-only T5-style language model: causal LM, or prefix-LM with bidirectional
attention over the inputs part (SeqIO's `decoder_causal_attention`).

Parameter names follow T5X's decoder-only example: everything under `decoder/`
(`decoder/token_embedder`, `decoder/relpos_bias`, `decoder/layers_0/self_attention`, ...).

Shape letters: b batch, l length, e emb_dim, v vocab.
"""
from __future__ import annotations

import flax.linen as nn

from t5forge.nn import attention as attn
from t5forge.nn.config import ModelConfig
from t5forge.nn.layers import Embed
from t5forge.nn.stack import layer_stack
from t5forge.nn.t5 import ACT, _attention, _dropout, _mlp, _norm, output_logits


class DecoderOnlyLayer(nn.Module):
  """Pre-norm self-attention and MLP, each with a residual connection."""

  config: ModelConfig
  scanned: bool = False

  @nn.compact
  def __call__(self, x, position_bias, mask_bias, deterministic: bool):
    # x: [b, l, e]; position_bias: [1, h, l, l]; mask_bias: [b or 1, 1, l, l]
    cfg = self.config
    y = _norm(cfg, "pre_self_attention_layer_norm")(x)
    y = _attention(cfg, "self_attention")(y, y, position_bias, mask_bias, deterministic)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    y = _mlp(cfg)(_norm(cfg, "pre_mlp_layer_norm")(x), deterministic)
    x = nn.with_logical_constraint(x + _dropout(cfg, y, deterministic), ACT)
    return (x, None) if self.scanned else x


class _Decoder(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, segment_ids, causal_attention, deterministic: bool):
    cfg = self.config
    length = tokens.shape[-1]
    embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                     dtype=cfg.activation_dtype, name="token_embedder")
    x = _dropout(cfg, embedder(tokens), deterministic)
    x = nn.with_logical_constraint(x.astype(cfg.activation_dtype), ACT)
    position_bias = attn.RelativePositionBias(
        num_buckets=cfg.relative_attention_num_buckets,
        max_distance=cfg.relative_attention_max_distance, num_heads=cfg.num_heads,
        bidirectional=False, dtype=cfg.activation_dtype, name="relpos_bias")(length, length)
    mask = attn.causal_mask(length, causal_attention)
    if segment_ids is not None:
      mask = attn.combine_masks(mask, attn.segment_mask(segment_ids, segment_ids))
    x = layer_stack(DecoderOnlyLayer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, deterministic_argnum=3,
                    layer_kwargs=dict(config=cfg), x=x,
                    args=(position_bias, attn.mask_to_bias(mask, cfg.activation_dtype),
                          deterministic))
    x = _dropout(cfg, _norm(cfg, "decoder_norm")(x), deterministic)
    return output_logits(cfg, x, embedder)


class DecoderOnly(nn.Module):
  """The decoder-only network. `__call__(decoder_input_tokens, ...) -> logits [b, l, v]`."""

  config: ModelConfig

  def setup(self):
    self.decoder = _Decoder(config=self.config, name="decoder")

  def __call__(self, decoder_input_tokens, decoder_target_tokens=None, decoder_segment_ids=None,
               decoder_positions=None, decoder_causal_attention=None, *,
               enable_dropout: bool = False):
    """Teacher forcing over [b, l] tokens.

    Args:
      decoder_input_tokens: [b, l], the sequence shifted right (0 as BOS).
      decoder_segment_ids: [b, l] for packed rows, or None.
      decoder_causal_attention: [b, l] 1 over the prefix (inputs) that attends
        bidirectionally (prefix-LM), or None for a plain causal LM.
    """
    del decoder_target_tokens, decoder_positions
    return self.decoder(decoder_input_tokens, decoder_segment_ids, decoder_causal_attention,
                        not enable_dropout)
