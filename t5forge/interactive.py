"""The Python API: `t5forge.load(path)` and the model object it returns.

    m = t5forge.load("path/to/flan-t5-base")      # HF dir, T5X checkpoint, or ours
    logits = m.logits(encoder_input_tokens, decoder_input_tokens)   # numpy [b, t, v]
    m.save("out/")                                 # t5forge checkpoint
    m.save_hf("out-hf/")                           # loads in transformers

Token conventions are T5's: id 0 is padding in the encoder input (masked there), and
the decoder input starts with 0 as BOS and attends causally.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import nn as t5nn
from t5forge import presets
from t5forge.convert import LoadedCheckpoint, hf, load_checkpoint, native
from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig


def _as_tokens(x: Any, name: str, vocab_size: int) -> np.ndarray:
  arr = np.asarray(x)
  if arr.ndim == 1:
    arr = arr[None]
  if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
    raise UserError(f"{name} must be an integer array [batch, length], got "
                    f"{arr.dtype} with shape {arr.shape}")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    raise UserError(f"{name} has ids outside [0, {vocab_size}): min {arr.min()}, max {arr.max()}")
  return arr.astype(np.int32)


class Model:
  """A network, its parameters, and what was loaded with them.

  Attributes:
    config: the ModelConfig.
    params: parameter tree of jax arrays (float32).
    source: where the parameters came from (path and format), for display.
  """

  def __init__(self, config: ModelConfig, params: dict, *, source: str = "",
               checkpoint: LoadedCheckpoint | None = None):
    self.config = config
    self.params = jax.tree.map(jnp.asarray, params)
    self.source = source
    self.checkpoint = checkpoint
    self.network = t5nn.build(config)

  def __repr__(self) -> str:
    c = self.config
    return (f"t5forge.Model({c.architecture}, {t5nn.count_params(self.params):,} params, "
            f"emb_dim={c.emb_dim}, layers={c.num_encoder_layers}/{c.num_decoder_layers}, "
            f"vocab={c.vocab_size}, from {self.source or 'random init'})")

  @functools.cached_property
  def _logits_fn(self):
    net = self.network
    if self.config.is_encoder_decoder:
      return jax.jit(lambda p, e, d: net.apply({"params": p}, e, d))
    return jax.jit(lambda p, d, c: net.apply({"params": p}, d, decoder_causal_attention=c))

  @functools.cached_property
  def _encode_fn(self):
    net = self.network
    return jax.jit(lambda p, e: net.apply({"params": p}, e, method=net.encode))

  def logits(self, *tokens, decoder_causal_attention=None) -> np.ndarray:
    """Teacher-forced logits.

    Encoder-decoder: `logits(encoder_input_tokens [b, i], decoder_input_tokens [b, t])`.
    Decoder-only: `logits(decoder_input_tokens [b, t], decoder_causal_attention=None)`,
    where decoder_causal_attention [b, t] marks a bidirectional prefix (prefix-LM).

    Returns:
      float32 numpy array [b, t, vocab].
    """
    v = self.config.vocab_size
    if self.config.is_encoder_decoder:
      if len(tokens) != 2:
        raise UserError("logits(encoder_input_tokens, decoder_input_tokens) takes two arrays "
                        "for an encoder-decoder model")
      enc = _as_tokens(tokens[0], "encoder_input_tokens", v)
      dec = _as_tokens(tokens[1], "decoder_input_tokens", v)
      if enc.shape[0] != dec.shape[0]:
        raise UserError(f"batch sizes differ: encoder {enc.shape[0]}, decoder {dec.shape[0]}")
      return np.asarray(self._logits_fn(self.params, enc, dec))
    if len(tokens) != 1:
      raise UserError("logits(decoder_input_tokens) takes one array for a decoder-only model")
    dec = _as_tokens(tokens[0], "decoder_input_tokens", v)
    causal = None if decoder_causal_attention is None else np.asarray(
        decoder_causal_attention, np.int32).reshape(dec.shape)
    return np.asarray(self._logits_fn(self.params, dec, causal))

  def encode(self, encoder_input_tokens) -> np.ndarray:
    """Encoder output [b, i, emb_dim] (float32 numpy)."""
    if not self.config.is_encoder_decoder:
      raise UserError("encode() needs an encoder-decoder model")
    enc = _as_tokens(encoder_input_tokens, "encoder_input_tokens", self.config.vocab_size)
    return np.asarray(self._encode_fn(self.params, enc), dtype=np.float32)

  def save(self, path: str) -> None:
    """Writes a t5forge checkpoint directory (orbax)."""
    native.save(path, self.config, self.params)

  def save_hf(self, path: str) -> None:
    """Writes an HF directory that `T5ForConditionalGeneration.from_pretrained` loads."""
    tok_dir = self.checkpoint.path if self.checkpoint and self.checkpoint.format == "hf" else None
    hf.save_hf(jax.tree.map(np.asarray, self.params), self.config, path, tokenizer_dir=tok_dir)


def load(path: str, **overrides) -> Model:
  """Loads a model from a t5forge checkpoint or MODEL_DIR, an HF directory (or Hub name),
  or a T5X checkpoint.

  Args:
    path: where the checkpoint is (see `t5forge.convert.load_checkpoint`).
    **overrides: runtime config fields, e.g. dtype='bfloat16', scan_layers=True.
  """
  ckpt = load_checkpoint(path, **overrides)
  return Model(ckpt.config, ckpt.params, source=f"{ckpt.format}:{ckpt.path}", checkpoint=ckpt)


def init(config: ModelConfig | str, *, seed: int = 0, **overrides) -> Model:
  """A randomly initialised model from a config or a preset name (see `t5forge.presets`)."""
  if isinstance(config, str):
    config = presets.get(config, **overrides)
  elif overrides:
    config = config.replace(**overrides)
  return Model(config, t5nn.init_params(config, jax.random.key(seed)))
