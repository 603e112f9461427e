"""The encoder-decoder shell every encoder-decoder family shares (T5, T5Gemma,
T5Gemma 2): `encode`, `decode` and teacher-forcing `__call__`, and the decoder's masks.

A family subclasses `EncoderDecoderShell` and builds, in `setup`, its `encoder` and
`decoder` (and any parameters they share). The shell calls them with keyword arguments:

  encoder(tokens=, segment_ids=, positions=, valid=, deterministic=, **shared_inputs())
  decoder(encoded=, encoder_tokens=, decoder_input_tokens=, encoder_segment_ids=,
          decoder_segment_ids=, decoder_positions=, deterministic=, decode=,
          max_decode_length=, **shared_inputs())

Shape letters (docs/shapes.md): b batch, i encoder length, t decoder length, e width,
v vocab.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5forge.nn import attention as attn
from t5forge.nn import prompt
from t5forge.nn.config import ModelConfig


class EncoderDecoderShell(nn.Module):
  """An encoder-decoder network: `__call__` is teacher forcing, `encode` and `decode`
  are its halves (what `t5forge.models.EncoderDecoderModel` trains, scores and decodes
  with). Subclasses set `self.encoder` and `self.decoder` in `setup`."""

  config: ModelConfig

  def shared_inputs(self) -> dict:
    """Keyword arguments both stacks take besides the shell's (e.g. a parameter of the
    top-level network that they read); none by default."""
    return {}

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, *,
             enable_dropout: bool = False, encoder_positions=None, encoder_valid=None):
    """[b, i] int -> [b, i, e_enc] ([b, p + i, e_enc] with a prompt of length p, see
    `nn.prompt`); segment ids / positions [b, i] for packed rows.

    encoder_valid: [b, i] bool, the positions attended to as keys; None: the tokens > 0.
    Embeddings set it to encode padding as content (Flux / SD3 run T5 on ids padded to
    a fixed length without an attention mask)."""
    return self.encoder(tokens=encoder_input_tokens, segment_ids=encoder_segment_ids,
                        positions=encoder_positions, valid=encoder_valid,
                        deterministic=not enable_dropout, **self.shared_inputs())

  def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
             encoder_segment_ids=None, decoder_segment_ids=None, *,
             enable_dropout: bool = False, decode: bool = False,
             max_decode_length: int | None = None, decoder_positions=None):
    """The decoder: -> float32 logits [b, t, v].

    Args:
      encoded: [b, i, e_enc] encoder output (when decoding: needed on the call that
        creates the cache only).
      encoder_input_tokens: [b, i], only for the padding mask of the cross-attention
        (same).
      decoder_input_tokens: [b, t], targets shifted right with 0 as BOS; when decoding,
        the t next tokens (usually t = 1).
      encoder_segment_ids, decoder_segment_ids: [b, i], [b, t] for packed rows, or None.
      decode: use and update the 'cache' collection (key/values of max_decode_length
        positions, the encoder's projected keys/values and mask, the write index). The
        first call with an empty cache creates it and leaves the index at 0.
      decoder_positions: [b, t] positions of packed rows (families with RoPE), or None.
    """
    if self.config.prompt is not None and encoder_input_tokens is not None:
      # The encoder output starts with the prompt's positions: the cross-attention sees
      # them (the prompt-tuning repo's PromptEncoderDecoder.decode).
      encoder_input_tokens = prompt.prepend_tokens(encoder_input_tokens,
                                                   self.config.prompt.length)
    return self.decoder(encoded=encoded, encoder_tokens=encoder_input_tokens,
                        decoder_input_tokens=decoder_input_tokens,
                        encoder_segment_ids=encoder_segment_ids,
                        decoder_segment_ids=decoder_segment_ids,
                        decoder_positions=decoder_positions, deterministic=not enable_dropout,
                        decode=decode, max_decode_length=max_decode_length,
                        **self.shared_inputs())

  def __call__(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens=None,
               encoder_segment_ids=None, decoder_segment_ids=None, encoder_positions=None,
               decoder_positions=None, *, enable_dropout: bool = False):
    """Teacher forcing: [b, i], [b, t] -> logits [b, t, v] (float32).

    `decoder_target_tokens` is accepted for SeqIO's feature names. Positions (packed
    rows) place RoPE and the decoder starts where a family uses them (T5's relative
    attention needs none: packed segments are contiguous); None: 0..length-1.
    """
    del decoder_target_tokens
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids,
                          enable_dropout=enable_dropout, encoder_positions=encoder_positions)
    return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                       encoder_segment_ids, decoder_segment_ids, enable_dropout=enable_dropout,
                       decoder_positions=decoder_positions)


class DecoderMasks(NamedTuple):
  """What `decoder_masks` returns; k is t, or max_decode_length when decoding."""
  positions: jax.Array  # [t] or [b, t]: the queries' positions
  self_mask: jax.Array  # [b or 1, 1, t, k]: causal (and within segments)
  local: jax.Array | None  # self_mask within the causal sliding window; None: no window
  cross_mask: jax.Array  # [b, 1, t or 1, i]
  starts: jax.Array  # [b, t] bool: the positions that begin a segment
  cache_index: jax.Array | None  # the first query's cache position; None unless decoding


def decoder_masks(module: nn.Module, encoder_tokens, decoder_input_tokens, encoder_segment_ids,
                  decoder_segment_ids, *, decode: bool, max_decode_length: int | None,
                  decoder_positions=None, sliding_window: int | None = None) -> DecoderMasks:
  """The masks of an encoder-decoder's decoder, built inside `module`'s compact call.

  Decoding keeps its step index and the encoder's valid positions in `module`'s "cache"
  collection: the call that creates the cache leaves the index at 0, each later call
  advances it by t.

  Args:
    encoder_tokens: [b, i] (0 = padding); when decoding, read on the first call only.
    decoder_input_tokens: [b, t].
    encoder_segment_ids, decoder_segment_ids: [b, i], [b, t] for packed rows, or None.
    decoder_positions: [b, t] positions of packed rows, or None (0..t-1).
    sliding_window: the causal window of sliding-window layers, or None.
  """
  length = decoder_input_tokens.shape[-1]
  cache_index = None
  if decode:
    initialized = module.has_variable("cache", "index")
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    encoder_valid = module.variable("cache", "encoder_valid", lambda: encoder_tokens > 0)
    # A scalar (every row at one position), or [b] set by `t5forge.engine` (a position
    # per row: the decode slots of requests that started at different times).
    cache_index = index.value
    positions = cache_index[..., None] + jnp.arange(length)  # [t] or [b, t]
    keys = jnp.arange(max_decode_length)
    self_mask = attn.cached_causal_mask(positions, max_decode_length)  # [1, 1, t, max_len]
    local = (None if sliding_window is None
             else attn.window_mask(positions, keys, sliding_window, True))
    cross_mask = attn.padding_mask(None, encoder_valid.value)
    if initialized:
      index.value = cache_index + length
  else:
    positions = decoder_positions if decoder_positions is not None else jnp.arange(length)
    idx = jnp.arange(length)
    self_mask = attn.causal_mask(length)
    local = (None if sliding_window is None
             else attn.window_mask(idx, idx, sliding_window, True))
    # Keys that are padding are masked; padded queries still attend to real keys (as HF).
    cross_mask = attn.padding_mask(None, encoder_tokens > 0)
    if decoder_segment_ids is not None:
      self_mask = attn.combine_masks(
          self_mask, attn.segment_mask(decoder_segment_ids, decoder_segment_ids))
      cross_mask = attn.combine_masks(
          cross_mask, attn.segment_mask(decoder_segment_ids, encoder_segment_ids))
  starts = jnp.broadcast_to(positions == 0, decoder_input_tokens.shape)
  local = attn.combine_masks(self_mask, local) if local is not None else None
  return DecoderMasks(positions, self_mask, local, cross_mask, starts, cache_index)


def encoder_mask(tokens, segment_ids, valid=None):
  """[b, i] tokens (0 = padding) and segment ids (or None) -> [b, 1, 1 or i, i] bool.

  Keys that are padding are masked; padded queries still attend to real keys (as HF),
  so every row of the softmax has support. valid: [b, i] bool, the keys to attend to
  instead of tokens > 0 (see `EncoderDecoderShell.encode`), or None."""
  mask = attn.padding_mask(None, tokens > 0 if valid is None else valid)
  if segment_ids is not None:
    mask = attn.combine_masks(mask, attn.segment_mask(segment_ids, segment_ids))
  return mask
