"""Decoding options, parsed and validated once, and the model features of token lists.

    opts = DecodeOptions.from_kwargs(beam_size=4)        # a UserError names a bad option
    batch = features_from_tokens(inputs, targets, encoder_decoder=True, input_length=512,
                                 target_length=64, eos=1, rows=8)
    tokens, scores = generation.Generator(model).predict(batch, opts, params=params)

`generation.Generator` decodes and scores the batches; `engine.OfflineDecoder` runs the
same options on the slots.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from t5forge.errors import UserError

METHODS = ("greedy", "sample", "beam")
# How `t5forge infer` and eval feed greedy / sampled encoder-decoder rows: the engine's
# slots as they free up, or padded batches that decode as long as their longest row.
SCHEDULERS = ("continuous", "static")


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
    temperature, topk, topp: sampling options (topp applies to what topk kept).
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
