"""T5Gemma 2 (arXiv 2512.14856): Gemma 3 layers as an encoder-decoder, text only.

Selected by `ModelConfig(architecture='t5gemma2')`; the T5Gemma fields (grouped-query
heads, query_pre_attn_scalar, sliding_window, soft-caps, ...) mean what they mean for
`t5forge.nn.t5gemma`, and the sandwich norms, gated tanh-GELU MLP, sqrt(width)
embedding scale (`t5forge.nn.blocks`) and the decoder's start token are T5Gemma's. The
shell (`encode`, `decode`, `__call__`) is `encdec.EncoderDecoderShell`. What differs:

- per-head RMS norms of queries and keys (`query_norm`, `key_norm`, (1 + w) scale over
  head_dim) before RoPE;
- two RoPE bases: sliding-window layers use `rope_local_theta` (10,000), global layers
  `rope_theta` (1,000,000), optionally linearly scaled (`rope_scaling_factor`); five
  local layers to one global (`sliding_window_pattern` 6);
- the decoder has no separate cross-attention: each layer's "merged" attention projects
  the encoder output with its own key/value kernels (keys key-normed, no RoPE) and its
  queries attend over [decoder keys ; encoder keys] in one softmax. Decoding therefore
  caches both: the decoder's keys/values (`cached_key`, `cached_value`, max_length
  positions) and the encoder's (`cross_key`, `cross_value`), projected once;
- one embedding table (`token_embedder`) for the encoder, the decoder and the output
  layer, and `eoi_embedding`: the input vector of token `eoi_token_id` (unscaled);
- the encoder's sliding window is transformers' T5Gemma 2 window: a query at i sees keys
  j with -((w + 1) // 2 - 1) <= j - i <= w // 2 (w keys); the decoder's is causal,
  0 <= i - j < w.

The vision tower of the released checkpoints is not modelled (t5forge reads text).

Parameter paths: `token_embedder/embedding` [v, e], `eoi_embedding` [e] (when
eoi_token_id is set), `encoder/layers_<i>/{pre,post}_self_attention_layer_norm`,
`.../attention/{query,key,value,out}/kernel`, `.../attention/{query,key}_norm/scale`,
`.../{pre,post}_mlp_layer_norm`, `.../mlp/{wi_0,wi_1,wo}`, `encoder/encoder_norm`; the
decoder's layers the same with `merged_attention` for `attention`, `decoder/decoder_norm`.

Shape letters (docs/shapes.md): b batch, i encoder length, t decoder length, e width,
v vocab, h heads, n key/value heads, d head_dim.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from t5forge import sharding as ax
from t5forge.nn import attention as attn
from t5forge.nn import matmul, prompt
from t5forge.nn.blocks import (EMBED_INIT, decoder_head, embed, final_norm, gemma_norm,
                               mlp_residual, pick, residual)
from t5forge.nn.config import ModelConfig
from t5forge.nn.encdec import EncoderDecoderShell, decoder_masks, encoder_mask
from t5forge.nn.layers import Dense, Embed, Kernel, RMSNorm, param_with_axes
from t5forge.nn.stack import layer_stack
from t5forge.nn.t5gemma import start_tokens


def _encoder_window_mask(length: int, window: int):
  """[1, 1, i, i] bool: transformers' bidirectional T5Gemma 2 window, (w + 1) // 2 keys
  at or before the query and w // 2 after it."""
  idx = jnp.arange(length)
  delta = idx[None, :] - idx[:, None]  # key - query
  return ((delta > -((window + 1) // 2)) & (delta <= window // 2))[None, None]


class Gemma3Attention(nn.Module):
  """Gemma 3 attention: GQA with query/key RMS norms and RoPE, optionally merged with
  attention to the encoder (decoder) through the same key/value kernels.

  Built from `attention`'s pieces: `Kernel` projections (fused by `matmul.dense_multi`),
  `apply_rope`, `grouped_attention` and the head-major decoding cache layout.
  """

  config: ModelConfig  # the stack's shape

  @nn.compact
  def __call__(self, x, encoded, theta, mask_bias, deterministic: bool,
               decode: bool = False, cache_index=None, max_length: int | None = None,
               positions=None, merged: bool = False, rope_factor=1.0):
    """x [b, t, e] attends to itself (and, merged, to encoded [b, i, e]).

    Args:
      theta: the RoPE base of this layer (a float, or a traced scalar under scan);
        rope_factor its linear scaling (frequencies / factor), likewise.
      mask_bias: additive mask [b, 1, t, t (+ i)] over [own keys ; encoder keys], or
        [b, 1, t, max_length + i] when decoding.
      decode: one step over the cache; `encoded` is only read on the call that creates
        the cache (the encoder keys/values are projected into it then).
      positions: [b, t] or [t] RoPE positions; None: 0..t-1 (+ cache_index).

    Returns:
      [b, t, e]
    """
    cfg = self.config
    h, n, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    dtype = cfg.activation_dtype
    init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    width = x.shape[-1]
    kq = Kernel(h * d, (ax.EMBED, ax.JOINED_KV), kernel_init=init, lora=cfg.lora,
                name="query")(width, deterministic)
    kk = Kernel(n * d, (ax.EMBED, ax.KV_HEADS), kernel_init=init, lora=cfg.lora,
                name="key")(width, deterministic)
    kv = Kernel(n * d, (ax.EMBED, ax.KV_HEADS), kernel_init=init, lora=cfg.lora,
                name="value")(width, deterministic)
    # float32 kernels: `matmul.dense` rounds them to the compute dtype (see layers.Dense).
    query_norm = RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype, plus_one=True,
                         axis=ax.KV, name="query_norm")
    key_norm = RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype, plus_one=True,
                       axis=ax.KV, name="key_norm")

    def heads(y, num, axis):  # [b, l, num * d] -> [b, l, num, d]
      # (Few kv heads on a wider model axis stay replicated: see attention.head_axis.)
      return nn.with_logical_constraint(
          y.astype(dtype).reshape(*y.shape[:-1], num, d),
          (ax.BATCH, ax.LENGTH, attn.head_axis(axis, num), ax.ACT_KV))

    q, k, v = matmul.dense_multi(x.astype(dtype), [kq, kk, kv])
    q, k, v = heads(q, h, ax.ACT_HEADS), heads(k, n, ax.KV_HEADS), heads(v, n, ax.KV_HEADS)
    if positions is None:
      positions = jnp.arange(x.shape[1]) + (
          0 if cache_index is None else jnp.asarray(cache_index)[..., None])
    q = attn.apply_rope(query_norm(q), positions, theta, rope_factor)
    k = attn.apply_rope(key_norm(k), positions, theta, rope_factor)
    scalar = cfg.query_pre_attn_scalar or d
    q = (q.astype(jnp.float32) * float(scalar) ** -0.5).astype(q.dtype)

    def project_encoder(enc):  # [b, i, e] -> key-normed k, v [b, i, n, d]
      ek, ev = matmul.dense_multi(enc.astype(dtype), [kk, kv])
      return key_norm(heads(ek, n, ax.KV_HEADS)), heads(ev, n, ax.KV_HEADS)

    head_major = attn.head_major

    if decode:  # the cache layout: [b, n, max_length, d]
      k, v = attn.write_cache(self, head_major(k), head_major(v), cache_index, max_length)
      if merged:
        if not self.has_variable("cache", "cross_key"):
          ek, ev = project_encoder(encoded)
          self.put_variable("cache", "cross_key", head_major(ek))
          self.put_variable("cache", "cross_value", head_major(ev))
        k = jnp.concatenate([k, self.get_variable("cache", "cross_key")], axis=2)
        v = jnp.concatenate([v, self.get_variable("cache", "cross_value")], axis=2)
    elif merged:  # [b, t + i, n, d]
      ek, ev = project_encoder(encoded)
      k, v = jnp.concatenate([k, ek], axis=1), jnp.concatenate([v, ev], axis=1)
    dropout_rng = (None if deterministic or cfg.dropout_rate == 0 or decode
                   else self.make_rng("dropout"))
    out = attn.grouped_attention(q, k, v, None, mask_bias, cache_layout=decode,
                                 softcap=cfg.attn_logit_softcapping,
                                 float32_logits=cfg.float32_attention_logits,
                                 dropout_rate=cfg.dropout_rate, dropout_rng=dropout_rng)
    out = out.reshape(*out.shape[:-2], h * d)  # [b, t, h*d]
    return Dense(width, (ax.JOINED_KV, ax.EMBED), dtype=dtype, kernel_init=init,
                 lora=cfg.lora, name="out")(out, deterministic)


class Layer(nn.Module):
  """Sandwich-normed attention (merged in the decoder) and MLP, each with a residual."""

  config: ModelConfig  # the stack's shape
  merged: bool = False  # decoder layer: attend to the encoder output too
  scanned: bool = False

  @nn.compact
  def __call__(self, x, sliding, encoded, positions, global_bias, local_bias,
               deterministic: bool, decode: bool = False, cache_index=None,
               max_length: int | None = None):
    # x: [b, l, e]; sliding: bool (traced under scan); *_bias: [b, 1, l, keys]
    cfg = self.config
    local_theta = cfg.rope_local_theta or cfg.rope_theta
    theta = pick(sliding, local_theta, cfg.rope_theta)
    rope_factor = pick(sliding, 1.0, cfg.rope_scaling_factor or 1.0)
    y = gemma_norm(cfg, "pre_self_attention_layer_norm")(x)
    y = Gemma3Attention(cfg, name="merged_attention" if self.merged else "attention")(
        y, encoded, theta, pick(sliding, local_bias, global_bias), deterministic, decode,
        cache_index, max_length, positions, self.merged, rope_factor)
    x = residual(cfg, x, gemma_norm(cfg, "post_self_attention_layer_norm")(y), deterministic)
    x = mlp_residual(cfg, x, deterministic, sandwich=True)
    return (x, None) if self.scanned else x


def _broadcast_concat(self_mask, cross_mask, shape):
  """[., 1, t, k] and [., 1, . , i] bool -> [b, 1, t, k + i]."""
  b, t = shape
  self_mask = jnp.broadcast_to(self_mask, (b, 1, t, self_mask.shape[-1]))
  cross_mask = jnp.broadcast_to(cross_mask, (b, 1, t, cross_mask.shape[-1]))
  return jnp.concatenate([self_mask, cross_mask], axis=-1)


class Encoder(nn.Module):
  config: ModelConfig
  embedder: Embed

  @nn.compact
  def __call__(self, *, tokens, segment_ids, positions, eoi, deterministic: bool,
               valid=None):
    """tokens [b, i] (0 = padding), segment_ids / positions [b, i] or None -> [b, i, e];
    eoi [e]: the input vector of eoi_token_id, or None; valid [b, i] bool: the keys
    attended to, or None (`EncoderDecoderShell.encode`)."""
    cfg = self.config
    enc = cfg.encoder
    embedded = tokens
    # A prompt (nn.prompt) goes before the sqrt(e) scale, scaled as the tokens are.
    prompt_vectors, tokens, positions, valid = prompt.encoder_inputs(
        cfg.prompt, enc.emb_dim, tokens, segment_ids, positions, valid)
    length = tokens.shape[-1]
    x = embed(enc, self.embedder, embedded, deterministic, scaled=True, eoi=eoi,
              prompt=prompt_vectors)
    mask = encoder_mask(tokens, segment_ids, valid)
    local = (None if cfg.sliding_window is None
             else attn.combine_masks(mask, _encoder_window_mask(length, cfg.sliding_window)))
    if positions is None:
      positions = jnp.arange(length)
    dtype = cfg.activation_dtype
    x = layer_stack(Layer, num_layers=cfg.num_encoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=enc), x=x,
                    layer_flags=cfg.sliding_layers(cfg.num_encoder_layers),
                    args=dict(encoded=None, positions=positions,
                              global_bias=attn.mask_to_bias(mask, dtype),
                              local_bias=attn.mask_to_bias(local, dtype)),
                    static=dict(deterministic=deterministic))
    return final_norm(cfg, x, deterministic, name="encoder_norm", sandwich=True)


class Decoder(nn.Module):
  config: ModelConfig
  embedder: Embed

  @nn.compact
  def __call__(self, *, encoded, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
               decoder_segment_ids, decoder_positions, eoi, deterministic: bool,
               decode: bool = False, max_decode_length: int | None = None):
    """-> float32 logits [b, t, v]; arguments as t5gemma.Decoder's, plus eoi (see
    `Encoder`)."""
    cfg = self.config
    b, length = decoder_input_tokens.shape
    dtype = cfg.activation_dtype
    masks = decoder_masks(self, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
                          decoder_segment_ids, decode=decode,
                          max_decode_length=max_decode_length,
                          decoder_positions=decoder_positions,
                          sliding_window=cfg.sliding_window)
    merged = _broadcast_concat(masks.self_mask, masks.cross_mask, (b, length))
    merged_local = (None if masks.local is None
                    else _broadcast_concat(masks.local, masks.cross_mask, (b, length)))
    tokens = start_tokens(cfg, decoder_input_tokens, masks.starts)
    y = embed(cfg, self.embedder, tokens, deterministic, scaled=True, eoi=eoi)
    y = layer_stack(Layer, num_layers=cfg.num_decoder_layers, scan=cfg.scan_layers,
                    remat_policy=cfg.remat_policy, layer_kwargs=dict(config=cfg, merged=True),
                    x=y, layer_flags=cfg.sliding_layers(cfg.num_decoder_layers),
                    args=dict(encoded=encoded, positions=masks.positions,
                              global_bias=attn.mask_to_bias(merged, dtype),
                              local_bias=attn.mask_to_bias(merged_local, dtype),
                              cache_index=masks.cache_index),
                    static=dict(deterministic=deterministic, decode=decode,
                                max_length=max_decode_length))
    return decoder_head(cfg, y, self.embedder, deterministic, sandwich=True)


class T5Gemma2EncoderDecoder(EncoderDecoderShell):
  """The T5Gemma 2 text network (`EncoderDecoderShell`): one embedding for both stacks
  and the output layer; decoding caches the decoder's and the encoder's keys/values."""

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim,
                                dtype=cfg.activation_dtype, embedding_init=EMBED_INIT)
    self.eoi_embedding = (None if cfg.eoi_token_id is None else param_with_axes(
        self, "eoi_embedding", nn.initializers.zeros, (cfg.emb_dim,), (ax.EMBED,)))
    self.encoder = Encoder(config=cfg, embedder=self.token_embedder)
    self.decoder = Decoder(config=cfg, embedder=self.token_embedder)

  def shared_inputs(self) -> dict:
    return {"eoi": self.eoi_embedding}
