"""Building blocks of T5: RMS norm, embedding, dense projections, the MLP block.

Every parameter is float32 and created with logical axis names (see `t5forge.sharding`)
through `nn.with_logical_partitioning`, so a rules table alone decides its sharding.
Computation happens in the activation `dtype` (float32 or bfloat16).

Shape letters (docs/shapes.md): b batch, l length, e emb_dim, f mlp_dim, v vocab.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge import sharding as ax
from t5forge.errors import UserError
from t5forge.nn import lora as lora_lib
from t5forge.nn import matmul

Initializer = Callable[..., jax.Array]

# T5X's initialisers (t5x/examples/t5/layers.py): fan-in scaled kernels, unit-normal
# embeddings. They matter only when training from scratch.
default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
default_embed_init = nn.initializers.normal(stddev=1.0)


def param_with_axes(module: nn.Module, name: str, init: Initializer, shape: tuple[int, ...],
                    axes: tuple[str, ...]) -> jax.Array:
  """Creates a float32 parameter annotated with logical axis names."""
  assert len(axes) == len(shape), (name, shape, axes)
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """Maps T5X / HF activation names to functions.

  'gelu' is the tanh approximation: it is what T5X's flax `nn.gelu` computes and what
  HF calls `gelu_new` (used by gated-gelu T5.1.1 / Flan-T5 / mT5 / ByT5).
  """
  return {
      "relu": jax.nn.relu,
      "gelu": lambda x: jax.nn.gelu(x, approximate=True),
      "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
      "silu": jax.nn.silu,
      "linear": lambda x: x,
  }[name]


class RMSNorm(nn.Module):
  """T5's layer norm: scale only, no mean subtraction, no bias.

  The variance is accumulated in float32 whatever the activation dtype. With
  `plus_one` (Gemma, T5Gemma) the parameter w is stored zero-centred and the scale is
  1 + w, taken in float32 as transformers' Gemma norms do. `axis` is the logical name
  of the normalised axis ('kv' for Gemma 3's per-head query/key norms).
  """

  epsilon: float = 1e-6
  dtype: Any = jnp.float32
  plus_one: bool = False
  axis: str = ax.EMBED

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # x: [..., d]
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = param_with_axes(self, "scale", init, (x.shape[-1],), (self.axis,))
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + self.epsilon)
    if self.plus_one:
      return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
    return scale_columns(y.astype(self.dtype), scale)


@jax.custom_vjp
def scale_columns(y: jax.Array, scale: jax.Array) -> jax.Array:
  """y [..., d] * scale [d] in y's dtype (scale rounded to it).

  The backward pass sums the scale's gradient over all rows as a product with a ones
  vector, in float32: autodiff's column sum over the [b * l, d] rows became, after XLA's
  tree-reduction rewrite, reduce-windows that XLA:CPU runs far below memory speed. The
  gradient is in scale's dtype (float32: not rounded to bf16).
  """
  return y * scale.astype(y.dtype)


def _scale_columns_fwd(y, scale):
  return scale_columns(y, scale), (y, scale)


def _scale_columns_bwd(res, g):
  y, scale = res
  rows = (g.astype(jnp.float32) * y.astype(jnp.float32)).reshape(-1, y.shape[-1])
  ones = jnp.ones((rows.shape[0],), jnp.float32)
  d_scale = jnp.dot(ones, rows)  # [d]
  return (g * scale.astype(g.dtype)).astype(y.dtype), d_scale.astype(scale.dtype)


scale_columns.defvjp(_scale_columns_fwd, _scale_columns_bwd)


class Embed(nn.Module):
  """Token embedding [vocab, embed]; `attend` reuses it as the tied output layer."""

  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  embedding_init: Initializer = default_embed_init

  def setup(self):
    self.embedding = param_with_axes(self, "embedding", self.embedding_init,
                                     (self.num_embeddings, self.features), (ax.VOCAB, ax.EMBED))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    # tokens: [b, l] int -> [b, l, e] float32: embeddings feed the float32 residual
    # stream; `dtype` is the compute dtype of `attend`.
    return jnp.take(self.embedding, tokens.astype(jnp.int32), axis=0)

  def attend(self, x: jax.Array) -> jax.Array:
    # x: [b, l, e] -> logits [b, l, v], in float32 for a stable softmax (bfloat16
    # operands accumulate in float32).
    return jnp.einsum("bld,vd->blv", x.astype(self.dtype), self.embedding.astype(self.dtype),
                      preferred_element_type=jnp.float32)


def _lora_a_init(key, shape, dtype=jnp.float32):
  # peft's kaiming_uniform_(a=sqrt(5)) of the [r, in] weight: U(-1/sqrt(in), 1/sqrt(in)).
  bound = 1.0 / shape[0] ** 0.5
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def adapted(module: nn.Module, kernel: jax.Array, kernel_axes: tuple[str, str],
            lora: lora_lib.LoraConfig | None, deterministic: bool):
  """kernel, or `matmul.Lora` with this module's update parameters when `lora` targets
  its path (`lora_a` [in, r], `lora_b` [r, out], created beside `kernel`; stacked
  adapters: [N, in, R] and [N, R, out], filled by `lora.stack`, zeros until then)."""
  if lora is None:
    return kernel
  path = "/".join(module.path)
  rank = lora.rank_for(path)
  if not rank:
    return kernel
  i, o = kernel.shape[-2:]
  if lora.stacked:
    n, stacked = lora.stacked, (lora_lib.ADAPTERS_AXIS,)
    a = param_with_axes(module, lora_lib.A, nn.initializers.zeros, (n, i, rank),
                        stacked + (kernel_axes[0], lora_lib.RANK_AXIS))
    b = param_with_axes(module, lora_lib.B, nn.initializers.zeros, (n, rank, o),
                        stacked + (lora_lib.RANK_AXIS, kernel_axes[1]))
    return matmul.Lora(kernel, a, b, 1.0)  # the scales are folded into b
  if rank > min(i, o):
    raise UserError(f"lora.LoraConfig: rank {rank} at {lora_lib.canonical(path)} is larger than "
                    f"its kernel [{i}, {o}] allows; use a rank of at most {min(i, o)}")
  a = param_with_axes(module, lora_lib.A, _lora_a_init, (i, rank),
                      (kernel_axes[0], lora_lib.RANK_AXIS))
  b = param_with_axes(module, lora_lib.B, nn.initializers.zeros, (rank, o),
                      (lora_lib.RANK_AXIS, kernel_axes[1]))
  rng = (module.make_rng("dropout") if not deterministic and lora.dropout > 0 else None)
  return matmul.Lora(kernel, a, b, lora.scale_for(path), float(lora.dropout), rng)


class Dense(nn.Module):
  """A bias-free projection with a 2-D kernel [in, out], as T5X stores its kernels.

  Attention projections keep the 2-D `[embed, joined_kv]` layout of T5X and HF
  checkpoints; callers reshape the output to heads.
  """

  features: int
  kernel_axes: tuple[str, str]
  dtype: Any = jnp.float32  # compute dtype of the operands
  kernel_init: Initializer = default_kernel_init
  out_dtype: Any = None  # dtype of the result; None: see `matmul.dense`
  lora: lora_lib.LoraConfig | None = None

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    # x: [..., in] -> [..., out]
    kernel = param_with_axes(self, "kernel", self.kernel_init, (x.shape[-1], self.features),
                             self.kernel_axes)
    kernel = adapted(self, kernel, self.kernel_axes, self.lora, deterministic)
    # The float32 kernel is rounded to the compute dtype inside `matmul.dense`, whose
    # backward pass returns its gradient in float32 (not rounded to bfloat16).
    return matmul.dense(x.astype(self.dtype), kernel, out_dtype=self.out_dtype)


class Kernel(nn.Module):
  """The [in, out] kernel of a `Dense` layer (same parameter), for callers that multiply
  several kernels at once (see `matmul.dense_multi`); with a LoRA update on it, a
  `matmul.Lora`."""

  features: int
  kernel_axes: tuple[str, str]
  kernel_init: Initializer = default_kernel_init
  lora: lora_lib.LoraConfig | None = None

  @nn.compact
  def __call__(self, in_features: int, deterministic: bool = True):
    kernel = param_with_axes(self, "kernel", self.kernel_init, (in_features, self.features),
                             self.kernel_axes)
    return adapted(self, kernel, self.kernel_axes, self.lora, deterministic)


class MlpBlock(nn.Module):
  """T5's feed-forward block: wi (or gated wi_0 * wi_1) -> activation -> dropout -> wo."""

  intermediate_dim: int
  activations: Sequence[str] = ("relu",)
  intermediate_dropout_rate: float = 0.1
  dtype: Any = jnp.float32
  lora: lora_lib.LoraConfig | None = None

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    # x: [b, l, e]
    branches = []
    names = (["wi"] if len(self.activations) == 1
             else [f"wi_{i}" for i in range(len(self.activations))])
    # The gated branches share their input: one matmul on the concatenated kernels.
    kernels = [Kernel(self.intermediate_dim, (ax.EMBED, ax.MLP), lora=self.lora, name=n)(
        x.shape[-1], deterministic) for n in names]
    hs = matmul.dense_multi(x.astype(self.dtype), kernels)  # float32 kernels (see Dense)
    for act, h in zip(self.activations, hs):
      branches.append(activation(act)(h))  # [b, l, f]
    h = branches[0]
    for other in branches[1:]:
      h = h * other
    h = nn.with_logical_constraint(h, (ax.BATCH, ax.LENGTH, ax.ACT_MLP))
    # T5X broadcasts the MLP dropout mask over the length axis.
    h = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=(-2,))(
        h, deterministic=deterministic)
    return Dense(x.shape[-1], (ax.MLP, ax.EMBED), dtype=self.dtype, lora=self.lora,
                 name="wo")(h, deterministic)  # [b, l, e]
