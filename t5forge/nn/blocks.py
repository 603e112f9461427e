"""The sub-layers every family's layers are built from: dropout, norms, the MLP and its
residual, attention configured from a `ModelConfig`, embeddings and the output layer.

The T5 family (t5.py, decoder_only.py) and the Gemma-based encoder-decoders
(t5gemma.py, t5gemma2.py) call these from their compact methods; each creates its
parameters under the name given, so the calling layer's parameter paths are those of
T5X and HF checkpoints.

Shape letters (docs/shapes.md): b batch, l length, e emb_dim, v vocab.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge import sharding as ax
from t5forge.nn import attention as attn
from t5forge.nn.config import ModelConfig
from t5forge.nn.layers import Dense, Embed, MlpBlock, RMSNorm, default_kernel_init

# The logical axes of the residual stream [b, l, e].
ACT = (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)

# transformers initialises (T5)Gemma embeddings N(0, 0.02) (`initializer_range`). T5's
# N(0, 1) would make the tied, unscaled output layer's initial logits N(0, emb_dim): a
# first loss of ~25 nats over an 8,000-word vocabulary instead of ~ln(8000) = 9.
EMBED_INIT = nn.initializers.normal(stddev=0.02)


def dropout(cfg: ModelConfig, x: jax.Array, deterministic: bool) -> jax.Array:
  """Residual and embedding dropout of x [b, l, e]."""
  # T5X broadcasts residual and embedding dropout masks over the length axis.
  return nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)


def residual(cfg: ModelConfig, x: jax.Array, y: jax.Array, deterministic: bool) -> jax.Array:
  """x + dropout(y), both [b, l, e], constrained to the residual stream's sharding."""
  return nn.with_logical_constraint(x + dropout(cfg, y, deterministic), ACT)


def norm(cfg: ModelConfig, name: str) -> RMSNorm:
  """T5's RMS norm (scale w, initialised to ones)."""
  return RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.activation_dtype, name=name)


def gemma_norm(cfg: ModelConfig, name: str) -> RMSNorm:
  """Gemma's RMS norm: scale 1 + w, w stored zero-centred."""
  return RMSNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.activation_dtype, plus_one=True,
                 name=name)


def mlp(cfg: ModelConfig) -> MlpBlock:
  """cfg's feed-forward block, named `mlp`."""
  return MlpBlock(intermediate_dim=cfg.mlp_dim, activations=cfg.mlp_activations,
                  intermediate_dropout_rate=cfg.dropout_rate, dtype=cfg.activation_dtype,
                  lora=cfg.lora, name="mlp")


def mlp_residual(cfg: ModelConfig, x: jax.Array, deterministic: bool, *,
                 sandwich: bool = False) -> jax.Array:
  """x [b, l, e] + the MLP of its pre-norm (`pre_mlp_layer_norm`); with `sandwich`
  (Gemma), the MLP's output is normed again (`post_mlp_layer_norm`)."""
  make_norm = gemma_norm if sandwich else norm
  y = mlp(cfg)(make_norm(cfg, "pre_mlp_layer_norm")(x), deterministic)
  if sandwich:
    y = gemma_norm(cfg, "post_mlp_layer_norm")(y)
  return residual(cfg, x, y, deterministic)


def t5_attention(cfg: ModelConfig, name: str) -> attn.MultiHeadAttention:
  """T5's attention: cfg's heads, relative position bias passed in at the call."""
  return attn.MultiHeadAttention(num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                 dropout_rate=cfg.dropout_rate, dtype=cfg.activation_dtype,
                                 float32_logits=cfg.float32_attention_logits,
                                 kernel=cfg.attention_kernel, lora=cfg.lora, name=name)


def gemma2_attention(cfg: ModelConfig, name: str, *, rope: bool) -> attn.MultiHeadAttention:
  """Gemma 2 attention with cfg's heads (cfg: the encoder's or the decoder's shape):
  grouped-query, queries scaled by query_pre_attn_scalar ** -0.5, soft-capped logits,
  RoPE when `rope` (self-attention)."""
  scalar = cfg.query_pre_attn_scalar or cfg.head_dim
  return attn.MultiHeadAttention(
      num_heads=cfg.num_heads, head_dim=cfg.head_dim, dropout_rate=cfg.dropout_rate,
      dtype=cfg.activation_dtype, float32_logits=cfg.float32_attention_logits,
      num_kv_heads=cfg.kv_heads, query_scale=float(scalar) ** -0.5,
      softcap=cfg.attn_logit_softcapping, rope_theta=cfg.rope_theta if rope else None,
      lora=cfg.lora, name=name)


def pick(sliding, local, global_):
  """A layer's sliding-window value or its global one: `sliding` is a Python bool in a
  loop of layers and a traced bool scalar under scan. A None `local` means no window."""
  if local is None:
    return global_
  if isinstance(sliding, bool):
    return local if sliding else global_
  return jnp.where(sliding, local, global_)


def embed(cfg: ModelConfig, embedder: Embed, tokens: jax.Array, deterministic: bool, *,
          scaled: bool = False, eoi: jax.Array | None = None,
          prompt: jax.Array | None = None) -> jax.Array:
  """tokens [b, l] -> the float32 residual stream [b, l, e] ([b, p + l, e] with a
  prompt), after embedding dropout.

  Args:
    scaled: multiply the embeddings by sqrt(e) (Gemma).
    eoi: [e] the input vector of token cfg.eoi_token_id (T5Gemma 2), unscaled; or None.
    prompt: [p, e] tuned prompt vectors (`nn.prompt`) put before the embedded tokens,
      scaled and dropped out as they are; or None.
  """
  x = embedder(tokens)
  is_eoi = None if eoi is None else tokens == cfg.eoi_token_id
  if prompt is not None:
    b, p = tokens.shape[0], prompt.shape[0]
    x = jnp.concatenate([jnp.broadcast_to(prompt.astype(x.dtype), (b, *prompt.shape)), x], 1)
    if is_eoi is not None:
      is_eoi = jnp.concatenate([jnp.zeros((b, p), bool), is_eoi], axis=1)
  if scaled:
    x = x * jnp.float32(cfg.emb_dim ** 0.5)
  if eoi is not None:
    x = jnp.where(is_eoi[..., None], eoi.astype(jnp.float32), x)
  x = dropout(cfg, x, deterministic)
  # The residual stream stays float32 in every dtype (see ModelConfig.dtype).
  return nn.with_logical_constraint(x.astype(jnp.float32), ACT)


def output_logits(cfg: ModelConfig, y: jax.Array, embedder: Embed) -> jax.Array:
  """Final decoder states [b, l, e] -> float32 logits [b, l, v] (tied or untied).

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


def final_norm(cfg: ModelConfig, x: jax.Array, deterministic: bool, *, name: str,
               sandwich: bool = False) -> jax.Array:
  """A stack's last norm (`encoder_norm` or `decoder_norm`; Gemma's with `sandwich`),
  then dropout: [b, l, e] -> [b, l, e]."""
  return dropout(cfg, (gemma_norm if sandwich else norm)(cfg, name)(x), deterministic)


def decoder_head(cfg: ModelConfig, y: jax.Array, embedder: Embed, deterministic: bool, *,
                 sandwich: bool = False) -> jax.Array:
  """The decoder's final norm (`decoder_norm`), dropout and output layer, then the
  final-logit soft-cap where cfg sets one: y [b, l, e] -> float32 logits [b, l, v].
  `sandwich`: the norm is Gemma's."""
  y = final_norm(cfg, y, deterministic, name="decoder_norm", sandwich=sandwich)
  logits = output_logits(cfg, y, embedder)
  if cfg.final_logit_softcapping is not None:
    cap = cfg.final_logit_softcapping
    logits = jnp.tanh(logits / cap) * cap
  return logits
