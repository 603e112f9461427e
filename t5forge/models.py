"""Models: a network plus what training and evaluation need from it.

`EncoderDecoderModel` and `DecoderOnlyModel` share one contract (T5X's `BaseModel`):

- `loss_fn(params, batch, dropout_rng) -> (loss, metric sums)`
- `score_batch(params, batch) -> log-likelihood [b]`
- `predict_batch(params, batch, rng) -> tokens [b, l]` and `predict_batch_with_aux`
  (plus scores), decoding with a KV cache through a function of `t5forge.decoding`;
  its two pieces, `decode_setup` (encoder run / prompt prefill and the cache) and
  `decode_step` (the model step over that cache), are public so that
  `t5forge.generation` can run the loop in resumable chunks
- `init_params(rng)`, `abstract_params()`, `logical_axes()`

A batch is a dict of SeqIO model features (`encoder_input_tokens`,
`decoder_input_tokens`, `decoder_target_tokens`, `decoder_loss_weights`, segment ids and
positions when packed, `decoder_causal_attention` for prefix-LM), each [b, length].
Metric sums are scalars that add up across microbatches and steps; `train.metrics`
turns them into T5X's reported values.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from t5forge import decoding, losses
from t5forge import nn as t5nn
from t5forge.errors import UserError
from t5forge.nn.config import ModelConfig

ENC_DEC_FEATURES = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
                    "encoder_segment_ids", "decoder_segment_ids", "encoder_positions",
                    "decoder_positions")
DEC_ONLY_FEATURES = ("decoder_input_tokens", "decoder_target_tokens", "decoder_segment_ids",
                     "decoder_positions", "decoder_causal_attention")


class DecodeSetup(NamedTuple):
  """What a model prepares before its decode loop (`decode_setup`).

  Attributes:
    inputs: [b, L] int32 decoder inputs for `t5forge.decoding` (BOS, prompt, zeros).
    cache: the decoder's cache for b examples.
    initial_index: [b] int32 last prompt position already in the cache, or None.
    cache_length: static; the cache's length, for `decode_step`.
    offset: static; new token j of the decodes is at decodes[..., offset + j].
  """
  inputs: jax.Array
  cache: Any
  initial_index: jax.Array | None
  cache_length: int
  offset: int


class BaseModel:
  """Network + loss settings (+ optional vocabulary used for decoding text).

  Args:
    config: the network's ModelConfig.
    z_loss: coefficient of the log-normaliser penalty (T5X default 1e-4).
    label_smoothing: label smoothing mass.
    loss_normalizing_factor: None, a number, or a LossNormalizingFactor (or its name).
    vocabulary: optional; when None the task's vocabulary is used.
    optimizer: optional optimizer spec (T5X keeps `optimizer_def` on the model; the
      trainer uses it unless given another).
  """

  FEATURES: tuple[str, ...] = ()

  def __init__(self, config: ModelConfig, *, z_loss: float = 1e-4, label_smoothing: float = 0.0,
               loss_normalizing_factor=None, vocabulary: Any = None, optimizer: Any = None,
               decode_fn: Any = None, decoder_params: dict | None = None):
    self.config = config
    self.network = t5nn.build(config)
    self.z_loss = float(z_loss)
    self.label_smoothing = float(label_smoothing)
    self.loss_normalizing_factor = losses.parse_loss_normalizing_factor(loss_normalizing_factor)
    self.vocabulary = vocabulary
    self.optimizer = optimizer
    # T5X's `decode_fn`; the default is greedy decoding (temperature 0).
    self.decode_fn = decode_fn or decoding.temperature_sample
    self.decoder_params = dict(decoder_params if decoder_params is not None else (
        {"temperature": 0.0} if decode_fn is None else {}))

  @property
  def eos_id(self) -> int:
    return getattr(self.vocabulary, "eos_id", None) or 1

  @property
  def stop_ids(self) -> int | tuple[int, ...]:
    """What ends a decode: the EOS id, or a tuple of ids (EOS first) when the config
    lists more (`ModelConfig.eos_token_ids`, e.g. T5Gemma's <end_of_turn> 107)."""
    extra = self.config.eos_token_ids
    if not extra or set(extra) == {self.eos_id}:
      return self.eos_id
    return tuple(dict.fromkeys((self.eos_id,) + tuple(extra)))

  def predict_batch(self, params: dict, batch: dict, rng: jax.Array | None = None,
                    **kwargs) -> jax.Array:
    """The best decode of each example, [b, l] (see `predict_batch_with_aux`)."""
    return self.predict_batch_with_aux(params, batch, rng, **kwargs)[0]

  def predict_batch_with_aux(self, params: dict, batch: dict, rng: jax.Array | None = None, *,
                             decoder_params: dict | None = None, num_decodes: int = 1,
                             return_all_decodes: bool = False,
                             max_decode_length: int | None = None, decode_fn=None):
    """Decodes each example of `batch` (see the subclass's `decode_setup` for what it
    reads), inside one compiled loop over a KV cache.

    Args:
      decoder_params: options of the decode function (temperature, topk, topp, alpha,
        max_decode_steps, ...); values may be traced arrays.
      num_decodes: samples or beams per example.
      return_all_decodes: return [b, n, l] sorted by score (best last) instead of the best.
      max_decode_length: output length l (new tokens); default decoder_input_tokens' length.
      decode_fn: a decode function of `t5forge.decoding` instead of the model's own
        (then decoder_params are its complete options).

    Returns:
      (tokens [b, l] or [b, n, l] of new tokens only, {"scores": [b] or [b, n]}); a
      decode function that returns per-token values too (beam search with `log_probs`)
      adds them to the dict, cut to the same l positions ([b, (n,) l, ...]).
    """
    length = max_decode_length or batch["decoder_input_tokens"].shape[1]
    setup = self.decode_setup(params, batch, length)
    decodes, scores, *extra = self._decode(
        setup.inputs, setup.cache, self.decode_step(params, setup.cache_length), rng,
        num_decodes=num_decodes, decoder_params=decoder_params, decode_fn=decode_fn,
        initial_index=setup.initial_index)
    window = slice(setup.offset, setup.offset + length)  # output j is input j + 1
    aux = {"scores": scores}
    for name, x in (extra[0] if extra else {}).items():
      aux[name] = x[:, :, window]  # [b, n, l, ...]
    aux_decodes = decodes[..., window]
    if return_all_decodes:
      return aux_decodes, aux
    return aux_decodes[:, -1], {name: x[:, -1] for name, x in aux.items()}

  def _decode(self, inputs, cache, tokens_to_logits, rng, *, num_decodes, decoder_params,
              decode_fn=None, initial_index=None):
    if decode_fn is None:
      decode_fn = self.decode_fn
      params = {**self.decoder_params, **(decoder_params or {})}
    else:  # a caller's own function comes with its own parameters
      params = dict(decoder_params or {})
    return decode_fn(inputs=inputs, cache=cache, tokens_to_logits=tokens_to_logits,
                          eos_id=self.stop_ids, decode_rng=rng, num_decodes=num_decodes,
                          initial_index=initial_index, **params)

  # -- parameters ---------------------------------------------------------------------
  def init_params(self, rng: jax.Array) -> dict:
    return t5nn.init_params(self.config, rng)

  def abstract_params(self) -> dict:
    return t5nn.abstract_params(self.config)

  def logical_axes(self) -> dict:
    return t5nn.logical_axes(self.config)

  # -- forward ------------------------------------------------------------------------
  def logits(self, params: dict, batch: dict, dropout_rng: jax.Array | None = None) -> jax.Array:
    """Teacher-forced float32 logits [b, t, v]; dropout on iff dropout_rng is given."""
    features = {k: batch[k] for k in self.FEATURES if batch.get(k) is not None}
    if dropout_rng is None:
      return self.network.apply({"params": params}, **features, enable_dropout=False)
    return self.network.apply({"params": params}, **features, enable_dropout=True,
                              rngs={"dropout": dropout_rng})

  def loss_fn(self, params: dict, batch: dict, dropout_rng: jax.Array | None, *,
              normalization: tuple | None = None) -> tuple[jax.Array, dict]:
    """T5X's loss with metric sums.

    Args:
      normalization: (factor, weights) precomputed over a whole batch, so that
        microbatches of it reproduce the full-batch loss; None computes them here.

    Returns:
      (scalar loss, dict of scalar metric sums).
    """
    logits = self.logits(params, batch, dropout_rng)
    targets = batch["decoder_target_tokens"]
    if normalization is None:
      normalization = losses.normalizing_factor_and_weights(self.loss_normalizing_factor, batch)
    factor, weights = normalization
    if weights is None:
      weights = batch.get("decoder_loss_weights")
    loss, z_loss, weight_sum = losses.compute_weighted_cross_entropy(
        logits, targets, weights, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
        loss_normalizing_factor=factor)
    return loss, self._metric_sums(batch, logits, weights, loss, z_loss, weight_sum)

  def score_batch(self, params: dict, batch: dict) -> jax.Array:
    """Sum of target-token log-likelihoods per example [b] (weights: loss weights, or
    targets > 0)."""
    logits = self.logits(params, batch).astype(jnp.float32)
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights")
    if weights is None:
      weights = targets > 0
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    token_ll = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(token_ll * weights, axis=-1)

  # -- metrics ------------------------------------------------------------------------
  def _metric_sums(self, batch, logits, weights, loss, z_loss, weight_sum) -> dict:
    targets = batch["decoder_target_tokens"]
    w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    sums = {
        "loss": loss,
        "z_loss": z_loss,
        "cross_ent_loss": loss - z_loss,
        "accuracy_correct": jnp.sum(correct * w),
        "accuracy_count": jnp.sum(w),
        "weight_sum": weight_sum,
        "num_target_tokens": jnp.asarray(targets.size, jnp.float32),
        "num_examples": jnp.asarray(targets.shape[0], jnp.float32),
        "decoder_nonpadding": jnp.sum(targets > 0).astype(jnp.float32),
        "loss_weights_nonzero": jnp.sum(w > 0).astype(jnp.float32),
        "decoder_segments": _count_segments(batch.get("decoder_segment_ids"), targets),
    }
    if "encoder_input_tokens" in batch:
      enc = batch["encoder_input_tokens"]
      sums["encoder_nonpadding"] = jnp.sum(enc > 0).astype(jnp.float32)
      sums["num_encoder_tokens"] = jnp.asarray(enc.size, jnp.float32)
      sums["encoder_segments"] = _count_segments(batch.get("encoder_segment_ids"), enc)
    return sums


def _count_segments(segment_ids: jax.Array | None, tokens: jax.Array) -> jax.Array:
  """Number of (packed) examples in a batch: distinct non-zero segment ids per row."""
  if segment_ids is None:
    return jnp.sum(jnp.any(tokens > 0, axis=-1)).astype(jnp.float32)
  # Segment ids count up from 1 within a row, so the row maximum is the count.
  return jnp.sum(jnp.max(segment_ids, axis=-1)).astype(jnp.float32)


class EncoderDecoderModel(BaseModel):
  FEATURES = ENC_DEC_FEATURES

  def decode_setup(self, params: dict, batch: dict, length: int) -> DecodeSetup:
    """Runs the encoder once over `encoder_input_tokens` [b, i] and makes the decoder's
    cache for `length` positions (the encoder keys/values are projected once)."""
    enc = batch["encoder_input_tokens"]
    b = enc.shape[0]
    net, variables = self.network, {"params": params}
    encoded = net.apply(variables, enc, batch.get("encoder_segment_ids"), method=net.encode)
    _, init = net.apply(variables, encoded, enc, jnp.zeros((b, 1), jnp.int32), decode=True,
                        max_decode_length=length, method=net.decode, mutable=["cache"])
    return DecodeSetup(jnp.zeros((b, length), jnp.int32), init["cache"], None,
                       *self.decode_layout(enc.shape[1], length))

  def encode(self, params: dict, tokens: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The encoder's last hidden states [b, i, e] (float32) of tokens [b, i]; valid [b, i]
    bool marks the positions attended to as keys (None: tokens > 0)."""
    net = self.network
    encoded = net.apply({"params": params}, tokens, method=net.encode, encoder_valid=valid)
    return encoded.astype(jnp.float32)

  def decode_layout(self, input_length: int, length: int) -> tuple[int, int]:
    """(cache_length, offset) of `decode_setup` for inputs [b, input_length] (static)."""
    del input_length
    return length, 0

  def decode_step(self, params: dict, cache_length: int) -> decoding.TokensToLogits:
    net = self.network

    def tokens_to_logits(state: decoding.DecodingState):
      logits, new = net.apply({"params": params, "cache": state.cache}, None, None,
                              state.cur_token, decode=True, max_decode_length=cache_length,
                              method=net.decode, mutable=["cache"])
      return logits[:, 0, :], new["cache"]

    return tokens_to_logits

  def feature_converter_kind(self, task_has_inputs: bool) -> str:
    del task_has_inputs
    return "encoder_decoder"


class DecoderOnlyModel(BaseModel):
  """A decoder-only LM. Tasks with inputs become prefix-LM rows (inputs + targets, loss on
  the targets); `inputs_bidirectional_attention` lets the inputs attend both ways (T5X's
  option of the same name; off by default as in T5X)."""

  FEATURES = DEC_ONLY_FEATURES

  def __init__(self, config: ModelConfig, *, inputs_bidirectional_attention: bool = False,
               **kwargs):
    super().__init__(config, **kwargs)
    self.inputs_bidirectional_attention = inputs_bidirectional_attention

  def feature_converter_kind(self, task_has_inputs: bool) -> str:
    return "prefix_lm" if task_has_inputs else "decoder_only"

  def decode_setup(self, params: dict, batch: dict, length: int) -> DecodeSetup:
    """Prefills the cache with each example's prompt: the positions of
    `decoder_input_tokens` [b, t] marked by `decoder_causal_attention` (SeqIO's
    prefix-LM layout: BOS and the inputs); without it, the non-zero prefix of each row
    after BOS is the prompt.

    The prompts are right-aligned (left-padded) in t positions and prefilled in one pass
    (bidirectionally over the inputs when the model attends that way); the loop then
    decodes `length` new tokens for every example in lockstep from position t - 1.
    """
    tokens = batch["decoder_input_tokens"]
    b, t = tokens.shape
    causal = batch.get("decoder_causal_attention")
    if causal is not None:
      prompt_len = jnp.sum(causal, axis=-1).astype(jnp.int32)  # BOS + inputs
    else:
      prompt_len = 1 + jnp.sum(jnp.cumprod(tokens[:, 1:] > 0, axis=-1), axis=-1).astype(jnp.int32)
    shift = t - prompt_len  # [b] right-align each prompt
    src = jnp.arange(t)[None, :] - shift[:, None]  # [b, t]
    valid = src >= 0
    prompt = jnp.where(valid, jnp.take_along_axis(tokens, jnp.maximum(src, 0), axis=1), 0)
    net, total = self.network, self.decode_layout(t, length)[0]
    prefix = valid.astype(jnp.int32) if self.inputs_bidirectional_attention else None
    _, init = net.apply({"params": params}, prompt[:, :1], decode=True,
                        max_decode_length=total, mutable=["cache"])
    _, filled = net.apply({"params": params, "cache": init["cache"]}, prompt, decode=True,
                          max_decode_length=total, decoder_causal_attention=prefix,
                          decoder_valid=valid, mutable=["cache"])
    cache = filled["cache"]
    # The loop feeds the last prompt token again (to get the first new token's logits);
    # it rewrites the same key/value at t - 1, which is exact (see DecoderOnly).
    cache = {**cache, "decoder": {**cache["decoder"], "index": jnp.asarray(t - 1, jnp.int32)}}
    inputs = jnp.concatenate([prompt, jnp.zeros((b, length), jnp.int32)], axis=1)
    return DecodeSetup(inputs, cache, jnp.full((b,), t - 1, jnp.int32),
                       *self.decode_layout(t, length))

  def decode_layout(self, input_length: int, length: int) -> tuple[int, int]:
    """(cache_length, offset) of `decode_setup` for prompts [b, input_length] (static):
    the cache holds the prompt and the new tokens; new token j is at decodes[t - 1 + j]."""
    return input_length + length, input_length - 1

  def decode_step(self, params: dict, cache_length: int) -> decoding.TokensToLogits:
    net = self.network

    def tokens_to_logits(state: decoding.DecodingState):
      logits, new = net.apply({"params": params, "cache": state.cache}, state.cur_token,
                              decode=True, max_decode_length=cache_length, mutable=["cache"])
      return logits[:, 0, :], new["cache"]

    return tokens_to_logits

  def logits(self, params: dict, batch: dict, dropout_rng: jax.Array | None = None) -> jax.Array:
    if not self.inputs_bidirectional_attention and "decoder_causal_attention" in batch:
      batch = {k: v for k, v in batch.items() if k != "decoder_causal_attention"}
    return super().logits(params, batch, dropout_rng)


def check_params_fit(model: BaseModel, params: dict, *, source: str) -> None:
  """UserError naming the first parameter where `params` (read from `source`) and the
  model disagree, e.g. a model gin of another size than the checkpoint, instead of a
  shape error from inside jit."""
  mismatch = t5nn.params_mismatch(model.config, params)
  if mismatch:
    raise UserError(f"{source}: {mismatch}; the model gin does not match this checkpoint: "
                    "include the model gin of the checkpoint's architecture and size")


def model_for(config: ModelConfig, **kwargs) -> BaseModel:
  cls = EncoderDecoderModel if config.is_encoder_decoder else DecoderOnlyModel
  return cls(config, **kwargs)
