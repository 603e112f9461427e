"""Flax Linen networks of the T5 family, with logically annotated parameters."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge.nn.config import DECODER_ONLY, ENCODER_DECODER, T5GEMMA, T5GEMMA2, ModelConfig
from t5forge.nn.decoder_only import DecoderOnly
from t5forge.nn.t5 import EncoderDecoder
from t5forge.nn.t5gemma import T5GemmaEncoderDecoder
from t5forge.nn.t5gemma2 import T5Gemma2EncoderDecoder


def build(config: ModelConfig):
  """The network a config describes: EncoderDecoder, DecoderOnly, T5GemmaEncoderDecoder or
  T5Gemma2EncoderDecoder."""
  if config.architecture == T5GEMMA:
    return T5GemmaEncoderDecoder(config)
  if config.architecture == T5GEMMA2:
    return T5Gemma2EncoderDecoder(config)
  return EncoderDecoder(config) if config.is_encoder_decoder else DecoderOnly(config)


def dummy_inputs(config: ModelConfig, batch: int = 1, length: int = 4) -> dict:
  """Integer inputs of the right kind for `init` / `eval_shape`."""
  tokens = jnp.ones((batch, length), jnp.int32)
  if config.is_encoder_decoder:
    return {"encoder_input_tokens": tokens, "decoder_input_tokens": tokens}
  return {"decoder_input_tokens": tokens}


def init_boxed(config: ModelConfig, rng: jax.Array) -> dict:
  """Random parameters, still boxed with their logical axis names."""
  return build(config).init(rng, **dummy_inputs(config))["params"]


@functools.lru_cache(maxsize=64)
def _boxed_shapes(config: ModelConfig) -> dict:
  # Tracing a 24-layer init takes about a second; configs are hashable, so cache.
  return jax.eval_shape(lambda: init_boxed(config, jax.random.key(0)))


def abstract_params(config: ModelConfig) -> dict:
  """The parameter tree as ShapeDtypeStructs, without allocating any memory. No sharding
  constraint is applied: under a mesh's activation context (an evaluation inside
  `Partitioner.activation_context`) a constraint on a shape would fail."""
  return nn.meta.map_axis_meta(lambda x: x.unbox(apply_constraint=False),
                               _boxed_shapes(config))


def logical_axes(config: ModelConfig) -> dict:
  """The parameter tree with each leaf replaced by its PartitionSpec of logical names."""
  return nn.get_partition_spec(_boxed_shapes(config))


def init_params(config: ModelConfig, rng: jax.Array) -> dict:
  """Random float32 parameters (unboxed)."""
  return nn.meta.unbox(init_boxed(config, rng))


def count_params(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))


def named_leaves(tree) -> dict:
  """{'decoder/layers_0/self_attention/query/kernel': leaf, ...}: leaves keyed by path."""
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def params_mismatch(config: ModelConfig, params) -> str | None:
  """How `params` differ from what a model of `config` holds: the first missing,
  extra or differently shaped parameter, in words; None when they fit."""
  want = named_leaves(abstract_params(config))
  # int8 kernels (nn/quant.py) hold `.q` [same shape as the kernel] and `.scale`.
  have = {name[:-len("/.q")] if name.endswith("/.q") else name: leaf
          for name, leaf in named_leaves(params).items() if not name.endswith("/.scale")}
  for name, spec in want.items():
    if name not in have:
      return f"has no parameter {name!r}"
    if tuple(have[name].shape) != tuple(spec.shape):
      return (f"parameter {name!r} has shape {tuple(have[name].shape)} but the model needs "
              f"{tuple(spec.shape)}")
  extra = sorted(set(have) - set(want))
  return f"has a parameter {extra[0]!r} the model does not" if extra else None


__all__ = ["ModelConfig", "EncoderDecoder", "DecoderOnly", "T5GemmaEncoderDecoder",
           "T5Gemma2EncoderDecoder", "build", "abstract_params",
           "logical_axes", "init_params", "count_params", "named_leaves", "params_mismatch",
           "ENCODER_DECODER", "DECODER_ONLY", "T5GEMMA", "T5GEMMA2"]
