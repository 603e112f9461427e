"""Multi-head attention with T5's relative position bias, and the masks T5 uses.

Shape letters: b batch, q query length, k key length, h heads, d head_dim, e emb_dim.
Masks are boolean `[b, 1, q, k]` (True = may attend); `mask_to_bias` turns them into
additive biases that are summed with the relative position bias `[1, h, q, k]`.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge import sharding as ax
from t5forge.nn.layers import Dense, param_with_axes

# Added to the logits of masked positions. Large and finite so that a fully masked row
# gives a uniform (not NaN) softmax, as in T5X; representable in bfloat16.
MASK_VALUE = -1e10


def relative_position_bucket(relative_position: jax.Array, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> jax.Array:
  """Maps key_position - query_position to T5's buckets.

  Half the buckets (per direction) are exact offsets, the rest logarithmic up to
  max_distance. The float32 arithmetic is Mesh TensorFlow's and Hugging Face's exactly
  (T5X adds an epsilon inside the log, which can move boundary offsets by one bucket;
  released checkpoints were trained with the formula used here).

  Args:
    relative_position: int32 array of any shape, key position minus query position.
    bidirectional: encoder attention (True) or causal decoder attention (False).

  Returns:
    int32 array of the same shape with values in [0, num_buckets).
  """
  ret = jnp.zeros_like(relative_position)
  n = relative_position
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n > 0).astype(n.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = -jnp.minimum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # log(0) only occurs where is_small selects the exact branch; keep it finite anyway.
  n_float = jnp.maximum(n, 1).astype(jnp.float32)
  large = max_exact + (jnp.log(n_float / max_exact) / math.log(max_distance / max_exact)
                       * (num_buckets - max_exact)).astype(n.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return ret + jnp.where(is_small, n, large)


class RelativePositionBias(nn.Module):
  """T5's learned relative position bias, one scalar per (head, bucket).

  Computed once per stack (encoder or decoder) and shared by all its layers, which is
  what T5 and HF do (HF computes it in the first layer and passes it on).
  """

  num_buckets: int
  max_distance: int
  num_heads: int
  bidirectional: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, query_length: int, key_length: int,
               query_offset: jax.Array | int = 0) -> jax.Array:
    """Returns the bias [1, h, q, k] for queries at positions query_offset + [0, q)."""
    rel_embedding = param_with_axes(
        self, "rel_embedding", nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
        (self.num_heads, self.num_buckets), (ax.HEADS, ax.RELPOS_BUCKETS))
    context = jnp.arange(query_length, dtype=jnp.int32)[:, None] + query_offset  # [q, 1]
    memory = jnp.arange(key_length, dtype=jnp.int32)[None, :]  # [1, k]
    buckets = relative_position_bucket(memory - context, bidirectional=self.bidirectional,
                                       num_buckets=self.num_buckets,
                                       max_distance=self.max_distance)  # [q, k]
    bias = jnp.take(rel_embedding, buckets, axis=1)  # [h, q, k]
    return bias[None].astype(self.dtype)


def padding_mask(query_valid: jax.Array | None, key_valid: jax.Array) -> jax.Array:
  """[b, q] and [b, k] booleans -> [b, 1, q, k]; query_valid None masks keys only."""
  mask = key_valid[:, None, None, :]
  if query_valid is not None:
    mask = mask & query_valid[:, None, :, None]
  return mask


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """Packed examples attend only within their segment: [b, q], [b, k] -> [b, 1, q, k]."""
  return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def causal_mask(length: int, bidirectional_prefix: jax.Array | None = None) -> jax.Array:
  """[1 or b, 1, l, l] causal mask; `bidirectional_prefix` [b, l] opens full attention
  among the positions it marks (prefix-LM inputs, SeqIO's decoder_causal_attention)."""
  idx = jnp.arange(length)
  mask = (idx[None, :] <= idx[:, None])[None, None]  # [1, 1, l, l]
  if bidirectional_prefix is not None:
    p = bidirectional_prefix.astype(bool)
    mask = mask | (p[:, None, :, None] & p[:, None, None, :])
  return mask


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
  out = None
  for m in masks:
    if m is not None:
      out = m if out is None else out & m
  return out


def mask_to_bias(mask: jax.Array | None, dtype: Any) -> jax.Array | None:
  if mask is None:
    return None
  return jnp.where(mask, 0.0, MASK_VALUE).astype(dtype)


class MultiHeadAttention(nn.Module):
  """T5 attention: no scaling of q.k (T5 folds it into the query initialisation).

  Parameters keep the 2-D layout of T5X checkpoints: query/key/value kernels
  [emb, heads * head_dim] ('embed', 'joined_kv') and out [heads * head_dim, emb].
  """

  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  float32_logits: bool = True

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None, bias: jax.Array | None,
               mask_bias: jax.Array | None, deterministic: bool, decode: str | None = None,
               cache_index: jax.Array | None = None, max_length: int | None = None) -> jax.Array:
    """Attends from inputs_q [b, q, e] to inputs_kv [b, k, e].

    Args:
      bias: relative position bias [1, h, q, k], or None (cross-attention).
      mask_bias: additive mask [b, 1, q, k] (0 or MASK_VALUE), or None. Kept apart from
        `bias` so that the [b, h, q, k] sum is only ever formed inside the fused softmax.
      decode: None (teacher forcing), 'self' (self-attention over a key/value cache of
        max_length positions: the q new keys/values are written at cache_index and the
        queries attend over the whole cache, k = max_length), or 'cross' (the encoder's
        keys/values are projected once, on the first call, and read from the cache
        afterwards; inputs_kv may then be None).
      cache_index: position of the first query in the cache (decode='self').

    Returns:
      [b, q, e]
    """
    h, d = self.num_heads, self.head_dim
    kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    # T5X scales the query initialisation by 1/sqrt(head_dim) instead of the logits.
    query_init = lambda *a: kernel_init(*a) / math.sqrt(d)  # noqa: E731
    proj = lambda name, init: Dense(h * d, (ax.EMBED, ax.JOINED_KV), dtype=self.dtype,  # noqa: E731
                                    kernel_init=init, name=name)
    q = proj("query", query_init)(inputs_q).reshape(*inputs_q.shape[:-1], h, d)  # [b, q, h, d]
    q = nn.with_logical_constraint(q, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.ACT_KV))

    def project_kv(x):
      k = proj("key", kernel_init)(x).reshape(*x.shape[:-1], h, d)  # [b, k, h, d]
      v = proj("value", kernel_init)(x).reshape(*x.shape[:-1], h, d)  # [b, k, h, d]
      return (nn.with_logical_constraint(k, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.ACT_KV)),
              nn.with_logical_constraint(v, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.ACT_KV)))

    if decode == "cross":
      # The encoder output is fixed during decoding: project it once into the cache.
      if self.has_variable("cache", "cached_key"):
        k = self.get_variable("cache", "cached_key")
        v = self.get_variable("cache", "cached_value")
      else:
        k, v = project_kv(inputs_kv)
        self.put_variable("cache", "cached_key", k)
        self.put_variable("cache", "cached_value", v)
    elif decode == "self":
      initialized = self.has_variable("cache", "cached_key")
      b = inputs_q.shape[0]
      k_new, v_new = project_kv(inputs_kv)
      ck = self.variable("cache", "cached_key", jnp.zeros, (b, max_length, h, d), k_new.dtype)
      cv = self.variable("cache", "cached_value", jnp.zeros, (b, max_length, h, d), v_new.dtype)
      if initialized:  # a real step (not the call that creates the cache): write in place
        zero = jnp.zeros((), jnp.int32)
        ck.value = jax.lax.dynamic_update_slice(ck.value, k_new, (zero, cache_index, zero, zero))
        cv.value = jax.lax.dynamic_update_slice(cv.value, v_new, (zero, cache_index, zero, zero))
      k, v = ck.value, cv.value  # [b, max_length, h, d]
    else:
      k, v = project_kv(inputs_kv)

    out = dot_product_attention(q, k, v, bias, mask_bias, dropout_rate=self.dropout_rate,
                                deterministic=deterministic, float32_logits=self.float32_logits,
                                dropout_rng=(None if deterministic or self.dropout_rate == 0
                                             else self.make_rng("dropout")))
    out = out.reshape(*out.shape[:-2], h * d)  # [b, q, h*d]
    return Dense(inputs_q.shape[-1], (ax.JOINED_KV, ax.EMBED), dtype=self.dtype,
                 kernel_init=kernel_init, name="out")(out)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                          mask_bias: jax.Array | None, *,
                          dropout_rate: float = 0.0, deterministic: bool = True,
                          float32_logits: bool = True,
                          dropout_rng: jax.Array | None = None) -> jax.Array:
  """softmax(q.k + bias) v, with the softmax in float32.

  Args:
    q: [b, q, h, d]; k, v: [b, k, h, d]; bias, mask_bias: broadcastable to
      [b, h, q, k], or None.

  Returns:
    [b, q, h, d] in v's dtype.
  """
  if float32_logits:
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # [b, h, q, k]
  for b in (bias, mask_bias):
    if b is not None:
      logits = logits + b.astype(logits.dtype)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)  # [b, q, h, d]
