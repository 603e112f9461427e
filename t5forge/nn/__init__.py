"""Flax Linen networks of the T5 family, with logically annotated parameters."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge.nn.config import DECODER_ONLY, ENCODER_DECODER, ModelConfig
from t5forge.nn.decoder_only import DecoderOnly
from t5forge.nn.t5 import EncoderDecoder


def build(config: ModelConfig):
  """The network a config describes: EncoderDecoder or DecoderOnly."""
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
  """The parameter tree as ShapeDtypeStructs, without allocating any memory."""
  return nn.meta.unbox(_boxed_shapes(config))


def logical_axes(config: ModelConfig) -> dict:
  """The parameter tree with each leaf replaced by its PartitionSpec of logical names."""
  return nn.get_partition_spec(_boxed_shapes(config))


def init_params(config: ModelConfig, rng: jax.Array) -> dict:
  """Random float32 parameters (unboxed)."""
  return nn.meta.unbox(init_boxed(config, rng))


def count_params(tree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))


__all__ = ["ModelConfig", "EncoderDecoder", "DecoderOnly", "build", "abstract_params",
           "logical_axes", "init_params", "count_params", "ENCODER_DECODER", "DECODER_ONLY"]
