"""Multi-head attention with T5's relative position bias, and the masks T5 uses; with
options, T5Gemma's (Gemma 2) attention: grouped-query, rotary positions, query scaling
and logit soft-capping (`MultiHeadAttention`, `apply_rope`, `grouped_attention`).

Shape letters (docs/shapes.md): b batch, q query length, k key length, h heads,
n key/value heads, g = h / n, d head_dim, e emb_dim.
Masks are boolean `[b, 1, q, k]` (True = may attend); `mask_to_bias` turns them into
additive biases that are summed with the relative position bias `[1, h, q, k]`.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from t5forge import sharding as ax
from t5forge.nn import fused_attention, matmul, philox, stack
from t5forge.nn.layers import Dense, Kernel, param_with_axes

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
  what T5 and HF do (HF computes it in the first layer and passes it on). Kept in
  float32 whatever the activation dtype: it is added to float32 logits, and in bfloat16
  XLA fused every layer's [b, h, q, k] bias gradient into one slow reduction.
  """

  num_buckets: int
  max_distance: int
  num_heads: int
  bidirectional: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, query_length: int, key_length: int,
               query_offset: jax.Array | int = 0) -> jax.Array:
    """Returns the bias [1, h, q, k] for queries at positions query_offset + [0, q);
    query_offset [b] (one position per row, `t5forge.engine`'s slots) gives [b, h, q, k]."""
    rel_embedding = param_with_axes(
        self, "rel_embedding", nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
        (self.num_heads, self.num_buckets), (ax.HEADS, ax.RELPOS_BUCKETS))
    context = jnp.arange(query_length, dtype=jnp.int32)[:, None]  # [q, 1]
    memory = jnp.arange(key_length, dtype=jnp.int32)[None, :]  # [1, k]
    if jnp.ndim(query_offset):
      context = context[None] + jnp.asarray(query_offset, jnp.int32)[:, None, None]  # [b, q, 1]
      buckets = relative_position_bucket(memory[None] - context, bidirectional=self.bidirectional,
                                         num_buckets=self.num_buckets,
                                         max_distance=self.max_distance)  # [b, q, k]
      return jnp.take(rel_embedding, buckets, axis=1).swapaxes(0, 1).astype(self.dtype)
    context = context + query_offset
    buckets = relative_position_bucket(memory - context, bidirectional=self.bidirectional,
                                       num_buckets=self.num_buckets,
                                       max_distance=self.max_distance)  # [q, k]
    bias = bucket_lookup(rel_embedding, buckets)  # [h, q, k]
    return bias[None].astype(self.dtype)


@jax.custom_vjp
def bucket_lookup(table: jax.Array, buckets: jax.Array) -> jax.Array:
  """table [h, n] and int buckets [q, k] -> table[:, buckets] [h, q, k].

  The gradient of a gather is a scatter-add, which XLA:CPU runs element by element
  (and, for a bias shared by all layers, only after summing every layer's [h, q, k]
  gradient in a transposed layout). A one-hot matmul computes the same sums.
  """
  return jnp.take(table, buckets, axis=1)


def _bucket_lookup_fwd(table, buckets):
  return jnp.take(table, buckets, axis=1), (buckets, table.shape[1])


def _bucket_lookup_bwd(res, g):
  buckets, n = res
  h = g.shape[0]
  one_hot = jax.nn.one_hot(buckets.reshape(-1), n, dtype=g.dtype)  # [q * k, n]
  return jnp.dot(g.reshape(h, -1), one_hot), None  # [h, n]


bucket_lookup.defvjp(_bucket_lookup_fwd, _bucket_lookup_bwd)


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


def _rows(mask: jax.Array) -> jax.Array:
  """[q, k] -> [1, 1, q, k]; [b, q, k] (queries at per-row positions) -> [b, 1, q, k]."""
  return mask[None, None] if mask.ndim == 2 else mask[:, None]


def cached_causal_mask(query_pos: jax.Array, max_length: int) -> jax.Array:
  """[1 or b, 1, q, max_length] causal mask of queries at int positions query_pos [q]
  (or [b, q], one set per row) over a decoding cache of max_length positions."""
  return _rows(jnp.arange(max_length) <= query_pos[..., None])


def window_mask(query_pos: jax.Array, key_pos: jax.Array, window: int,
                causal: bool) -> jax.Array:
  """[q] (or [b, q]), [k] int positions -> [1 (or b), 1, q, k] bool: keys within the
  sliding window, 0 <= i - j < window when causal, |i - j| <= window otherwise
  (transformers' T5Gemma)."""
  delta = query_pos[..., None] - key_pos
  inside = (delta >= 0) & (delta < window) if causal else jnp.abs(delta) <= window
  return _rows(inside)


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
  """Multi-head attention: T5's by default; T5Gemma's (Gemma 2) with the optional fields.

  T5: no scaling of q.k (T5 folds it into the query initialisation), relative position
  bias passed in. Parameters keep the 2-D layout of T5X checkpoints: query/key/value
  kernels [emb, heads * head_dim] ('embed', 'joined_kv') and out [heads * head_dim, emb].

  Optional (T5Gemma):
    num_kv_heads: grouped-query attention; key/value kernels are [kv_emb, num_kv_heads *
      head_dim] ('embed', 'kv_heads'), query head h reads kv head h // (heads / kv_heads),
      and the decoding cache holds only the kv heads.
    query_scale: queries are multiplied by it (query_pre_attn_scalar**-0.5).
    softcap: attention logits become softcap * tanh(logits / softcap) before masking.
    rope_theta: rotary position embeddings on queries and keys (self-attention), at the
      `positions` given to `__call__`.
    kernel: ModelConfig.attention_kernel: 'auto' runs T5's teacher-forcing attention in
      cuDNN's fused kernel where `fused_attention.use_cudnn` allows (a CUDA GPU, no
      attention dropout), 'xla' never, 'cudnn' always.
  """

  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  float32_logits: bool = True
  num_kv_heads: int | None = None
  query_scale: float | None = None
  softcap: float | None = None
  rope_theta: float | None = None
  kernel: str = "auto"
  lora: Any = None  # a `t5forge.nn.lora.LoraConfig`: updates on the projections it targets

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None, bias: jax.Array | None,
               mask_bias: jax.Array | None, deterministic: bool, decode: str | None = None,
               cache_index: jax.Array | None = None, max_length: int | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Attends from inputs_q [b, q, e] to inputs_kv [b, k, e_kv].

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
      positions: int [b, q] or [q] positions of the queries (= of the keys, in
        self-attention), for RoPE (rope_theta set); None: 0..q-1, or cache_index + 0..q-1
        when decoding.

    Returns:
      [b, q, e]
    """
    h, d = self.num_heads, self.head_dim
    grouped = self.num_kv_heads is not None
    n = self.num_kv_heads if grouped else h
    kv_axis = ax.KV_HEADS if grouped else ax.JOINED_KV  # of the key/value kernels
    kv_act = ax.KV_HEADS if grouped else ax.ACT_HEADS  # of the key/value heads
    kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
    # T5X scales the query initialisation by 1/sqrt(head_dim) instead of the logits.
    query_init = (kernel_init if self.query_scale is not None
                  else lambda *a: kernel_init(*a) / math.sqrt(d))
    fused_qkv = decode is None and inputs_kv is inputs_q
    # float32 kernels: `matmul.dense` rounds them to the compute dtype (see layers.Dense).
    kernel = lambda name, init, x, width, axis: Kernel(
        width, (ax.EMBED, axis), kernel_init=init, lora=self.lora, name=name)(
            x.shape[-1], deterministic)
    heads = lambda y, x, num, axis: nn.with_logical_constraint(
        y.astype(self.dtype).reshape(*x.shape[:-1], num, d),
        (ax.BATCH, ax.LENGTH, head_axis(axis, num), ax.ACT_KV))
    kv_kernels = lambda x: [kernel(name, kernel_init, x, n * d, kv_axis)
                            for name in ("key", "value")]

    def project_kv(x):
      # [b, k, e_kv] -> k, v [b, k, n, d]
      k, v = matmul.dense_multi(x.astype(self.dtype), kv_kernels(x))
      return heads(k, x, n, kv_act), heads(v, x, n, kv_act)

    kq = kernel("query", query_init, inputs_q, h * d, ax.JOINED_KV)
    if fused_qkv:
      # Self-attention: one [e, (h + 2 n) d] product for the query, key and value projections.
      q, k, v = matmul.dense_multi(inputs_q.astype(self.dtype), [kq, *kv_kernels(inputs_q)])
      q = heads(q, inputs_q, h, ax.ACT_HEADS)  # [b, l, h, d]
      k, v = heads(k, inputs_q, n, kv_act), heads(v, inputs_q, n, kv_act)  # [b, l, n, d]
    else:
      q = heads(matmul.dense(inputs_q.astype(self.dtype), kq), inputs_q, h, ax.ACT_HEADS)
    if self.rope_theta is not None:
      if positions is None:
        positions = jnp.arange(inputs_q.shape[1]) + (
            0 if cache_index is None else jnp.asarray(cache_index)[..., None])
      q = apply_rope(q, positions, self.rope_theta)
      if fused_qkv:
        k = apply_rope(k, positions, self.rope_theta)
    if self.query_scale is not None:
      q = (q.astype(jnp.float32) * self.query_scale).astype(q.dtype)
    if decode == "cross":
      # The encoder output is fixed during decoding: project it once into the cache.
      if self.has_variable("cache", "cached_key"):
        k = self.get_variable("cache", "cached_key")
        v = self.get_variable("cache", "cached_value")
      else:
        k, v = map(head_major, project_kv(inputs_kv))
        self.put_variable("cache", "cached_key", k)
        self.put_variable("cache", "cached_value", v)
    elif decode == "self":
      k_new, v_new = project_kv(inputs_kv)  # [b, q, n, d]
      if self.rope_theta is not None:
        k_new = apply_rope(k_new, positions, self.rope_theta)
      k, v = write_cache(self, head_major(k_new), head_major(v_new), cache_index, max_length)
    elif not fused_qkv:
      k, v = project_kv(inputs_kv)

    plain = not grouped and self.softcap is None
    dropout_rng = (None if deterministic or self.dropout_rate == 0 or decode is not None
                   else self.make_rng("dropout"))
    if decode is not None and plain:
      out = cached_attention(q, k, v, bias, mask_bias, float32_logits=self.float32_logits)
    elif plain and fused_attention.use_cudnn(self.kernel, q, k, bias, mask_bias,
                                             dropout=dropout_rng is not None):
      out = fused_attention.fused_attention(q, k, v, bias, mask_bias)
    elif plain:
      out = dot_product_attention(q, k, v, bias, mask_bias, dropout_rate=self.dropout_rate,
                                  deterministic=deterministic,
                                  float32_logits=self.float32_logits, dropout_rng=dropout_rng)
    else:
      out = grouped_attention(q, k, v, bias, mask_bias, cache_layout=decode is not None,
                              softcap=self.softcap, float32_logits=self.float32_logits,
                              dropout_rate=self.dropout_rate, dropout_rng=dropout_rng)
    out = out.reshape(*out.shape[:-2], h * d)  # [b, q, h*d]
    return Dense(inputs_q.shape[-1], (ax.JOINED_KV, ax.EMBED), dtype=self.dtype,
                 kernel_init=kernel_init, lora=self.lora, name="out")(out, deterministic)


def head_axis(axis: str, num_heads: int) -> str | None:
  """The logical axis to constrain a [.., num_heads, head_dim] activation's head dimension
  with: `axis` where the mesh axes the rules map it to divide num_heads, else None.

  GQA has fewer key/value heads than the model axis may have devices (1 or 2 kv heads on
  4): a head dimension split unevenly is padded, and XLA then regathers it in full
  ("involuntary full rematerialization") at every reshape; replicated it is not.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.shape:
    return axis
  mesh_axes = nn.logical_to_mesh_axes((axis,))[0]
  if mesh_axes is None:
    return axis
  size = math.prod(mesh.shape[a] for a in ((mesh_axes,) if isinstance(mesh_axes, str)
                                           else mesh_axes))
  return axis if num_heads % size == 0 else None


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               factor: float = 1.0) -> jax.Array:
  """Rotary position embedding of x [b, l, n, d] at int positions [b, l] or [l].

  The rotate-half form (dims i and i + d/2 form a pair) with frequencies
  theta**(-2i/d), as Gemma and transformers' T5Gemma. Angles are float32 whatever x's
  dtype (transformers computes them in float32 too, even in a float64 model). `factor`
  is linear RoPE scaling (transformers' 'linear' rope type): frequencies / factor.
  """
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [d/2]
  if not (isinstance(factor, (int, float)) and factor == 1.0):
    inv_freq = inv_freq / factor
  angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq  # [(b,) l, d/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  if angles.ndim == 2:
    angles = angles[None]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]  # [b, l, 1, d]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :d // 2], x32[..., d // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                      mask_bias: jax.Array | None, *, cache_layout: bool,
                      softcap: float | None = None, float32_logits: bool = True,
                      dropout_rate: float = 0.0,
                      dropout_rng: jax.Array | None = None) -> jax.Array:
  """softmax(cap(q.k) + bias) v with query heads grouped over fewer key/value heads.

  Query head h reads key/value head h // g (g = h / n), without repeating k and v (a
  decoding cache is read once per step, not g times). Autodiff gives the backward pass.

  Args:
    q: [b, q, h, d]; k, v: [b, k, n, d], or [b, n, k, d] when cache_layout (the
      head-major decoding caches); bias, mask_bias: broadcastable to [b, h, q, k].
    softcap: logits -> softcap * tanh(logits / softcap) before the biases; None = off.
    dropout_rng: key of the attention-weight dropout mask (philox), None = no dropout.

  Returns:
    [b, q, h, d] in v's dtype.
  """
  b, lq, h, d = q.shape
  n = k.shape[1] if cache_layout else k.shape[2]
  q, k = _logit_operands(q, k, float32_logits)
  qg = q.reshape(b, lq, n, h // n, d)
  kv_eq = "bnkd" if cache_layout else "bknd"
  logits = _einsum(f"bqngd,{kv_eq}->bngqk", qg, k)  # [b, n, g, q, k]
  logits = logits.astype(jnp.float32)
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  for x in (bias, mask_bias):
    if x is not None:
      # [b', 1 or h, q', k'] -> [b', 1 or n, 1 or g, q', k']
      x = x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], n, h // n, *x.shape[2:])
      logits = logits + x.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  bits = None
  if dropout_rng is not None and dropout_rate > 0.0:
    bits = philox.keep_bits(philox.seed_words(dropout_rng), probs.shape, dropout_rate)
  weights = _dropped(probs, bits, dropout_rate, v.dtype)
  if cache_layout:
    # The plain batched matmul [b, n, g*q, k] x [b, n, k, d]. As the 5-D einsum below,
    # XLA:CPU put the cache first in a bfloat16 while loop, a dot its bf16 kernels lack
    # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    out = _einsum("bnmk,bnkd->bnmd", weights.reshape(b, n, (h // n) * lq, -1), v)
    out = out.reshape(b, n, h // n, lq, d).transpose(0, 3, 1, 2, 4).astype(v.dtype)
  else:
    out = _einsum(f"bngqk,{kv_eq}->bqngd", weights, v).astype(v.dtype)
  return out.reshape(b, lq, h, d)


def _einsum(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """jnp.einsum; bfloat16 operands accumulate in (and return) float32, the form XLA:CPU
  runs on its fast bf16 kernels (see `matmul`)."""
  return jnp.einsum(eq, a, b, preferred_element_type=matmul.accumulation_dtype(a.dtype))


def _weighted_sum(w: jax.Array, x: jax.Array) -> jax.Array:
  """w [b, h, q, k] times x [b, k, h, d] over k -> [b, q, h, d] (float32 for bfloat16).

  The same sum as `_einsum("bhqk,bkhd->bqhd", w, x)`, written so that XLA:CPU runs the
  product with the [b, h, q, k] array as the left operand (contracting its last axis)
  and a [b, h, q, d] result, from a head-major copy of x. From the einsum it chose the
  transposed product x^T w^T, [b, h, d, k] x [b, h, q, k] -> [b, h, d, q], which
  YNNPACK runs slower. Used for the attention output and the query gradient, in every
  dtype.
  """
  out = lax.dot_general(w, x, (((3,), (1,)), ((0, 1), (0, 2))),
                        preferred_element_type=matmul.accumulation_dtype(w.dtype))
  return jnp.swapaxes(out, 1, 2)  # [b, h, q, d] -> [b, q, h, d]


def _logit_operands(q: jax.Array, k: jax.Array, float32_logits: bool):
  # float32 logits: bfloat16 q and k are multiplied with float32 accumulation, which is
  # exact for their products, so they need no cast; other dtypes are cast to float32.
  if float32_logits and q.dtype != jnp.bfloat16:
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  return q, k


def head_major(x: jax.Array) -> jax.Array:
  """[b, k, h, d] -> [b, h, k, d], the layout of the decoding caches."""
  return jnp.swapaxes(x, 1, 2)


def write_cache(module: nn.Module, k_new: jax.Array, v_new: jax.Array,
                cache_index: jax.Array, max_length: int) -> tuple[jax.Array, jax.Array]:
  """Writes a decoding step's keys and values into `module`'s self-attention cache.

  Call from `module`'s compact method. The call that creates the cache (its variables
  do not exist yet) writes nothing: it only gives the cache its shape.

  Args:
    k_new, v_new: [b, n, q, d], head-major (see `cached_attention`).
    cache_index: position of the first of the q new keys: a scalar (every row at the
      same position), or [b] (one per row, `t5forge.engine`'s slots).
    max_length: the cache's length.

  Returns:
    The cache's keys and values [b, n, max_length, d], the new ones included.
  """
  initialized = module.has_variable("cache", "cached_key")
  b, n, _, d = k_new.shape
  ck = module.variable("cache", "cached_key", jnp.zeros, (b, n, max_length, d), k_new.dtype)
  cv = module.variable("cache", "cached_value", jnp.zeros, (b, n, max_length, d), v_new.dtype)
  if initialized:  # a real step: write in place
    zero = jnp.zeros((), jnp.int32)
    if jnp.ndim(cache_index):
      # One update per row ([n, max_length, d] at its own position): a scatter.
      write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (zero, i, zero)))
      ck.value = write(ck.value, k_new, cache_index)
      cv.value = write(cv.value, v_new, cache_index)
    else:
      ck.value = jax.lax.dynamic_update_slice(ck.value, k_new, (zero, zero, cache_index, zero))
      cv.value = jax.lax.dynamic_update_slice(cv.value, v_new, (zero, zero, cache_index, zero))
  return ck.value, cv.value


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                     mask_bias: jax.Array | None, *, float32_logits: bool = True) -> jax.Array:
  """softmax(q.k + bias) v over a decoding cache kept head-major.

  The caches are [b, h, k, d] rather than the [b, k, h, d] of teacher forcing: the dots
  batch over (b, h), and with that layout XLA reads the cache in place. With [b, k, h, d]
  it copied every layer's whole cache into a transposed layout on every decoding step.

  Args:
    q: [b, q, h, d]; k, v: [b, h, k, d]; bias, mask_bias: broadcastable to [b, h, q, k].

  Returns:
    [b, q, h, d] in v's dtype.
  """
  q, k = _logit_operands(q, k, float32_logits)
  logits = _einsum("bqhd,bhkd->bhqk", q, k)  # [b, h, q, k]
  for b in (bias, mask_bias):
    if b is not None:
      logits = logits + b.astype(logits.dtype)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
  return _einsum("bhqk,bhkd->bqhd", probs, v).astype(v.dtype)  # [b, q, h, d]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                          mask_bias: jax.Array | None, *,
                          dropout_rate: float = 0.0, deterministic: bool = True,
                          float32_logits: bool = True,
                          dropout_rng: jax.Array | None = None) -> jax.Array:
  """softmax(q.k + bias) v, with the softmax in float32.

  Dropout on the attention weights (T5X's: each of [b, h, q, k] kept with probability
  1 - rate, kept weights scaled by 1 / (1 - rate)) draws its mask from
  `t5forge.nn.philox`, keyed by `dropout_rng`; the backward pass reuses the forward's
  packed mask bits (uint8 [b, h, q, ceil(k / 4)]), kept by a scanned stack.

  Args:
    q: [b, q, h, d]; k, v: [b, k, h, d]; bias, mask_bias: broadcastable to
      [b, h, q, k], or None.

  Returns:
    [b, q, h, d] in v's dtype.
  """
  q, k = _logit_operands(q, k, float32_logits)
  seed = None
  if not deterministic and dropout_rate > 0.0:
    seed = philox.seed_words(dropout_rng)
  return _attention(q, k, v, bias, mask_bias, seed, dropout_rate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, bias, mask_bias, seed, dropout_rate):
  """The attention core with a hand-written backward pass (see `_attention_bwd`).

  seed: uint32 [2] Philox seed of the dropout mask, or None (no dropout)."""
  return _attention_fwd(q, k, v, bias, mask_bias, seed, dropout_rate)[0]


def _attention_fwd(q, k, v, bias, mask_bias, seed, dropout_rate):
  logits = _einsum("bqhd,bkhd->bhqk", q, k)  # [b, h, q, k]
  for b in (bias, mask_bias):
    if b is not None:
      logits = logits + b.astype(logits.dtype)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [b, h, q, k] float32
  bits = None
  if seed is not None:
    bits = philox.keep_bits(seed, probs.shape, dropout_rate)  # [b, h, q, ceil(k / 4)]
  weights = _dropped(probs, bits, dropout_rate, v.dtype)
  out = _weighted_sum(weights, v).astype(v.dtype)  # [b, q, h, d]
  # Kept as they are by a scanned stack, not recomputed in its backward loop (stack.keep).
  # The packed dropout bits too (an eighth of the mask's bytes, uint8): regenerating
  # them in a scan's backward loop would rerun the Philox calls, which in a layer loop
  # XLA merges with the forward's.
  q, k, v, probs, kept_out = stack.keep(q, k, v, probs, out)
  if bits is not None:
    bits, = stack.keep(bits)
  return out, (q, k, v, bias, mask_bias, bits, probs, kept_out)


def _dropped(weights, bits, rate, dtype):
  """weights [..., k] with dropout applied (the mask unpacked from `philox.keep_bits`
  bits [..., ceil(k / 4)], or None: no dropout), in dtype.

  Kept weights are scaled by the inverse of the mask's exact keep probability (within
  2^-17 of 1 - rate, see `philox`) in float32 and rounded to dtype once. (Dividing a
  bfloat16 array by 1 - rate rounds the constant to bfloat16 too: 0.9 becomes 0.8984,
  a 0.17% bias of every kept weight.)"""
  if bits is None:
    return weights.astype(dtype)
  keep = philox.unpack_keep(bits, weights.shape[-1])
  scale = jnp.float32(1.0 / philox.keep_probability(rate))
  return jnp.where(keep, weights.astype(jnp.float32) * scale, 0.0).astype(dtype)


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Sums x over the axes that `shape` broadcasts (size 1), keeping them."""
  axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _attention_bwd(dropout_rate, res, dout):
  """What autodiff computes, in fewer passes over the [b, h, q, k] arrays.

  The softmax backward needs rowsum(probs * d_probs); it equals rowsum(dout * out) over
  the head dimension (FlashAttention's identity), a pass over [b, q, h, d] instead of
  one over [b, h, q, k]. In bfloat16 `out` is rounded, so there the rowsum is taken
  over the float32 probabilities as autodiff does.
  """
  q, k, v, bias, mask_bias, bits, probs, out = res
  weights = _dropped(probs, bits, dropout_rate, v.dtype)
  dv = _einsum("bhqk,bqhd->bkhd", weights, dout.astype(v.dtype))  # [b, k, h, d]
  d_weights = _einsum("bqhd,bkhd->bhqk", dout.astype(v.dtype), v).astype(jnp.float32)
  d_probs = _dropped(d_weights, bits, dropout_rate, jnp.float32)  # [b, h, q, k]
  if out.dtype == jnp.float32:
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out)[..., None]
  else:
    delta = jnp.sum(probs * d_probs, axis=-1, keepdims=True)
  d_logits = probs * (d_probs - delta)  # [b, h, q, k] float32
  dq = _weighted_sum(d_logits.astype(q.dtype), k).astype(q.dtype)
  dk = _einsum("bhqk,bqhd->bkhd", d_logits.astype(q.dtype), q).astype(k.dtype)
  d_bias = d_mask = None
  if bias is not None:
    # The bias is shared by every layer of a stack. Left alone, XLA defers this
    # reduction to the end and sums all layers' [b, h, q, k] gradients in one slow
    # fusion (keeping them all alive); the barrier reduces each layer's right here.
    d_bias = d_logits
    if bias.shape[0] == 1 and d_logits.shape[0] > 1:
      ones = jnp.ones((d_logits.shape[0],), d_logits.dtype)
      d_bias = jnp.einsum("b,bhqk->hqk", ones, d_logits)[None]
    d_bias = jax.lax.optimization_barrier(
        _sum_to_shape(d_bias, bias.shape).astype(bias.dtype))
  if mask_bias is not None:
    d_mask = _sum_to_shape(d_logits, mask_bias.shape).astype(mask_bias.dtype)
  return dq, dk, dv.astype(v.dtype), d_bias, d_mask, None


_attention.defvjp(_attention_fwd, _attention_bwd)
