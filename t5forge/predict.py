"""Compiled prediction and scoring with decoding options given at call time.

`Predictor(model)` is what the Python API, `t5forge infer` and `t5forge eval` share:

    p = Predictor(model)
    tokens, scores = p.predict(params, batch, DecodeOptions(method="beam", num_decodes=4))
    log_likelihoods = p.score(params, batch)

Options that change shapes or code (method, num_decodes, topk, output length) select a
compiled function; the others (temperature, topp, alpha, max_decode_steps, min_log_prob,
seed) are passed as arrays, so changing them does not recompile.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import decoding, multihost
from t5forge.errors import UserError

METHODS = ("greedy", "sample", "beam")


def fit(ids: list[int], length: int, eos: int) -> list[int]:
  """`ids` cut to `length` tokens, its last one EOS when it was cut."""
  return ids if len(ids) <= length else ids[:length - 1] + [eos]


def features_from_tokens(inputs: list[list[int]], targets: list[list[int] | None], *,
                         encoder_decoder: bool, input_length: int, target_length: int,
                         eos: int, rows: int) -> dict[str, np.ndarray]:
  """Model features [rows, ...] for token lists (inputs and targets end with EOS);
  rows >= len(inputs), extra rows are padding. Longer sequences are cut, EOS kept.

  Encoder-decoder rows are SeqIO's unpacked features. Decoder-only rows are prefix-LM
  rows [0, inputs..., targets...] with the inputs as the bidirectional prompt and the
  loss on the targets."""
  if encoder_decoder:
    b = {"encoder_input_tokens": np.zeros((rows, input_length), np.int32),
         "decoder_input_tokens": np.zeros((rows, target_length), np.int32),
         "decoder_target_tokens": np.zeros((rows, target_length), np.int32),
         # Without weights the loss would also count the padded target positions.
         "decoder_loss_weights": np.zeros((rows, target_length), np.float32)}
    for r, (xs, ys) in enumerate(zip(inputs, targets)):
      x = fit(xs, input_length, eos)
      b["encoder_input_tokens"][r, :len(x)] = x
      if ys is not None:
        y = fit(ys, target_length, eos)
        b["decoder_target_tokens"][r, :len(y)] = y
        b["decoder_input_tokens"][r, 1:len(y)] = y[:-1]
        b["decoder_loss_weights"][r, :len(y)] = 1
    return b
  # Decoder-only: prefix-LM rows [0, inputs..., targets...]; the inputs are the prompt.
  width = input_length + target_length
  b = {k: np.zeros((rows, width), np.int32) for k in (
      "decoder_input_tokens", "decoder_target_tokens", "decoder_causal_attention")}
  b["decoder_loss_weights"] = np.zeros((rows, width), np.float32)
  for r, (xs, ys) in enumerate(zip(inputs, targets)):
    x = fit(xs, input_length, eos)
    y = fit(ys, target_length, eos) if ys is not None else []
    seq = x + y
    b["decoder_target_tokens"][r, :len(seq)] = seq
    b["decoder_input_tokens"][r, 1:len(seq)] = seq[:-1]
    b["decoder_causal_attention"][r, :len(x) + 1] = 1
    b["decoder_loss_weights"][r, len(x):len(seq)] = 1
  return b


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How to decode.

  Attributes:
    method: 'greedy' (temperature 0), 'sample' (temperature / top-k / top-p) or 'beam'.
    num_decodes: samples or beams per example.
    temperature, topk, topp: sampling options (topk and topp exclude each other).
    alpha: beam search brevity-penalty exponent, T5X's ((5 + length) / 6) ** alpha.
    max_decode_steps: decode at most this many new tokens (after the prompt of a
      decoder-only model); the rest of the output is 0. Default: the output length.
      Every method honours it.
    min_log_prob: beam search only: stop an example once its best live beam's log-prob
      (no brevity penalty) is below this; it returns its finished beams if any, else
      its live ones (T5X). Default: no such stop.
    seed: sampling seed.
    return_all_decodes: return every sample / beam ([b, n, l], best last).
  """

  method: str = "greedy"
  num_decodes: int = 1
  temperature: float = 1.0
  topk: int = 0
  topp: float = 0.0
  alpha: float = 0.6
  max_decode_steps: int | None = None
  min_log_prob: float | None = None
  seed: int = 0
  return_all_decodes: bool = False

  def __post_init__(self):
    if self.method not in METHODS:
      raise UserError(f"decoding method {self.method!r} is not one of {METHODS}")
    if self.num_decodes < 1:
      raise UserError(f"num_decodes (beam size / samples) must be >= 1, got {self.num_decodes}")
    if self.method == "sample":
      if self.topk and self.topp:
        raise UserError("topk and topp exclude each other; set one of them (topk=0 or topp=0)")
      if self.temperature < 0:
        raise UserError(f"temperature must be >= 0, got {self.temperature}")
      if self.topk < 0 or not 0.0 <= self.topp <= 1.0:
        raise UserError(f"topk must be >= 0 and topp in [0, 1], got {self.topk}, {self.topp}")
    elif self.method == "greedy" and self.num_decodes != 1:
      raise UserError("greedy decoding gives one decode; use method 'sample' or 'beam' for "
                      f"num_decodes={self.num_decodes}")
    if self.max_decode_steps is not None and self.max_decode_steps < 1:
      raise UserError(f"max_decode_steps must be >= 1 (new tokens to decode), got "
                      f"{self.max_decode_steps}; leave it unset to decode the whole length")
    if self.min_log_prob is not None and self.method != "beam":
      raise UserError(f"min_log_prob={self.min_log_prob} applies to beam search only, not "
                      f"method {self.method!r}; use method 'beam' or drop min_log_prob")

  @classmethod
  def from_kwargs(cls, **kw) -> "DecodeOptions":
    """Builds options from the keyword arguments a user passes (`beam_size=4` works too),
    naming any unknown one."""
    if "beam_size" in kw:
      kw.setdefault("method", "beam")
      kw["num_decodes"] = kw.pop("beam_size")
    if kw.get("method") is None and any(k in kw for k in ("temperature", "topk", "topp")):
      kw["method"] = "sample"
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kw) - fields)
    if unknown:
      raise UserError(f"unknown decoding option(s) {unknown}; known: {sorted(fields)}")
    return cls(**{k: v for k, v in kw.items() if v is not None})


class Predictor:
  """Jitted predict / score functions for one model, compiled once per static setting.

  With a partitioner and the parameters' shardings (`opener.Opened.param_shardings`) the
  functions are jitted with those as explicit input shardings and replicated outputs,
  and run under the partitioner's mesh and activation rules; a batch whose rows divide
  the data axis is split over it, any other is replicated (the Python API's odd batch
  sizes on a multi-device host).
  """

  def __init__(self, model, *, partitioner=None, param_shardings=None,
               jit_kwargs: dict | None = None):
    self.model = model
    self.partitioner = partitioner
    self._jit_kwargs = dict(jit_kwargs or {})
    if partitioner is not None and param_shardings is not None:
      # Params as placed; the batch's sharding comes with its arrays (see _place).
      self._jit_kwargs.setdefault("in_shardings", (param_shardings, None, None, None))
      self._jit_kwargs.setdefault("out_shardings", partitioner.replicated())
      self._score_kwargs = {"in_shardings": (param_shardings, None),
                            "out_shardings": partitioner.replicated()}
    else:
      self._score_kwargs = dict(jit_kwargs or {})
    self._fns: dict[tuple, Any] = {}

  def _place(self, batch: dict) -> dict:
    """Host rows -> arrays on the mesh: split on 'batch' when the rows divide the data
    axis, else replicated. Arrays already on devices (eval's sharded batches) are kept."""
    part = self.partitioner
    if part is None:
      return batch
    out = {}
    for k, x in batch.items():
      if x is None or isinstance(x, jax.Array):
        out[k] = x
        continue
      x = np.asarray(x)
      sharding = (part.batch_sharding(x.ndim) if x.shape[0] % part.num_data_shards == 0
                  else part.replicated())
      out[k] = jax.device_put(x, sharding)
    return out

  def _context(self):
    return (self.partitioner.activation_context() if self.partitioner is not None
            else contextlib.nullcontext())

  def _predict_fn(self, opts: DecodeOptions, length: int):
    key = (opts.method, opts.num_decodes, opts.topk, length, opts.return_all_decodes)
    if key not in self._fns:
      model = self.model
      decode_fn = decoding.beam_search if opts.method == "beam" else decoding.temperature_sample

      def fn(params, batch, rng, traced):
        if opts.method == "beam":
          params_ = {"alpha": traced["alpha"], "max_decode_steps": traced["max_decode_steps"],
                     "min_log_prob": traced["min_log_prob"]}
        else:
          params_ = {"temperature": traced["temperature"], "topk": opts.topk,
                     "topp": traced["topp"], "max_decode_steps": traced["max_decode_steps"]}
        return model.predict_batch_with_aux(
            params, batch, rng, decoder_params=params_, num_decodes=opts.num_decodes,
            return_all_decodes=opts.return_all_decodes, max_decode_length=length,
            decode_fn=decode_fn)

      self._fns[key] = jax.jit(fn, **self._jit_kwargs)
    return self._fns[key]

  def predict(self, params, batch: dict, opts: DecodeOptions, *,
              max_decode_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens [b, l] or [b, n, l], scores [b] or [b, n]) as numpy."""
    length = max_decode_length or batch["decoder_input_tokens"].shape[1]
    temperature = 0.0 if opts.method == "greedy" else opts.temperature
    traced = {"temperature": jnp.float32(temperature), "topp": jnp.float32(opts.topp),
              "alpha": jnp.float32(opts.alpha),
              "max_decode_steps": jnp.int32(min(opts.max_decode_steps or length, length)),
              # -inf: no live beam falls below it, so the stop never fires.
              "min_log_prob": jnp.float32(-np.inf if opts.min_log_prob is None
                                          else opts.min_log_prob)}
    with self._context():
      tokens, aux = self._predict_fn(opts, length)(params, self._place(batch),
                                                   jax.random.key(opts.seed), traced)
    return multihost.to_host(tokens), multihost.to_host(aux["scores"])

  def score(self, params, batch: dict) -> np.ndarray:
    """Summed target log-likelihood per example [b]."""
    if "score" not in self._fns:
      self._fns["score"] = jax.jit(self.model.score_batch, **self._score_kwargs)
    with self._context():
      return multihost.to_host(self._fns["score"](params, self._place(batch)))
