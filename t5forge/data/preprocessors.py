"""Preprocessors: SeqIO's and T5's, as pure functions of one example.

A SeqIO preprocessor maps a `tf.data.Dataset` to another. Here a preprocessor is
one of four kinds, so that most of a pipeline stays random-access (any example is
computable from its index alone, which is what makes global shuffling, sharding
and resumption exact on any host count):

* map (the default): `fn(example, [rng], [sequence_length], [output_features])
  -> example | None`. Returning None drops the example (a filter). Arguments in
  brackets are passed when the function's signature names them, as SeqIO does
  for `sequence_length` and `output_features`. `rng` is a `numpy.random.Generator`
  derived from (seed, example index): the replacement for SeqIO's `seeds`.
* stream (`@stream`): `fn(examples: Iterator[dict], ...) -> Iterator[dict]`, for
  steps that change the number of examples (`reduce_concat_tokens`). `@flat_map`
  turns a one-to-many function (`split_tokens`) into a stream step.
* composite (`@composite`): `fn(sequence_length, output_features, ...) -> list`
  of preprocessors, expanded when the lengths are known (`span_corruption`).
* `CacheDatasetPlaceholder()`: marks the end of the deterministic part.

Stream steps need the examples before them in order, so a task runs everything up
to its last stream step (or the placeholder, when caching is on) once per split,
sequentially, and keeps the result (in memory, or on disk with `cache=True`): the
"offline" stage. Randomness there is seeded by the example's position in that
stage only. The remaining map steps run lazily per example at read time with an
rng keyed by (seed, global example index), so every epoch gets a fresh span
corruption and the result does not depend on the host count.

T5's noise masks and token functions (`random_spans_noise_mask`,
`regular_noise_mask`, `noise_span_to_unique_sentinel`, ...) live in `denoise.py`
and are importable from here, where a ported `tasks.py` looks for them.
"""
from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from t5forge.data.denoise import (  # noqa: F401  (T5's names, re-exported for ported tasks.py)
    drop_noise_tokens, drop_nonnoise_tokens, iid_noise_mask, noise_span_to_sentinel,
    noise_span_to_unique_sentinel, noise_token_to_gathered_token, noise_token_to_random_token,
    noise_token_to_random_token_or_sentinel, noise_token_to_sentinel, nonnoise_span_to_sentinel,
    nonnoise_span_to_unique_sentinel, permute_noise_tokens, random_prefix_noise_mask,
    random_spans_helper, random_spans_noise_mask, regular_noise_mask, sentinel_id)
from t5forge.errors import UserError

Example = dict[str, Any]

# ------------------------------------------------------------------------------------------- kinds


class CacheDatasetPlaceholder:
  """Where SeqIO caches: with `Task(cache=True)` everything before it is stored on disk, and
  with `use_cached=True` a SeqIO cache (`seqio_cache`) replaces the source and everything
  before it.

  As in SeqIO, the steps before it should not need fresh randomness every epoch:
  they run once, seeded by the example's position only.

  Args:
    required: the task may not run its preprocessors on the fly: it needs
      `use_cached=True` (a SeqIO cache) or `Task(cache=True)`.
    file_shuffle_buffer_size: SeqIO's; not needed with the global shuffle.
  """

  def __init__(self, required: bool = False, file_shuffle_buffer_size: int | None = None):
    self.required = required
    self.file_shuffle_buffer_size = file_shuffle_buffer_size

  def __repr__(self):
    return f"CacheDatasetPlaceholder(required={self.required})"


def _mark(fn, kind):
  fn._t5forge_kind = kind  # noqa: SLF001 (our marker on a function)
  return fn


def stream(fn: Callable) -> Callable:
  """Marks `fn(examples: Iterator[dict], ...) -> Iterator[dict]` as a stream step."""
  return _mark(fn, "stream")


def flat_map(fn: Callable) -> Callable:
  """Marks `fn(example, ...) -> Iterable[dict]` (one to many) as a stream step."""
  return _mark(fn, "flat_map")


def composite(fn: Callable) -> Callable:
  """Marks `fn(sequence_length, output_features, ...) -> list of preprocessors`."""
  return _mark(fn, "composite")


def map_over_dataset(fn: Callable | None = None, *, num_seeds: int | None = None):
  """SeqIO compatibility: a no-op marker (every function is already per-example).

  A ported function that took `seed`/`seeds` should take `rng` instead.
  """
  del num_seeds
  if fn is None:
    return lambda f: f
  return fn


def kind_of(p: Any) -> str:
  """'map', 'stream', 'flat_map', 'composite' or 'placeholder'."""
  if isinstance(p, CacheDatasetPlaceholder):
    return "placeholder"
  fn = p
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "_t5forge_kind", "map")


@functools.lru_cache(maxsize=1024)
def _accepted_params(fn: Callable) -> frozenset[str] | None:
  """Parameter names `fn` takes (None: it takes **kwargs)."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return frozenset()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
    return None
  return frozenset(sig.parameters)


def call_kwargs(fn: Callable, available: Mapping[str, Any]) -> dict[str, Any]:
  """The subset of `available` (rng, sequence_length, output_features) `fn` accepts."""
  try:
    names = _accepted_params(fn)
  except TypeError:  # unhashable callable (e.g. a partial holding a dict)
    names = _accepted_params.__wrapped__(fn)
  if names is None:
    return dict(available)
  bound = fn.keywords if isinstance(fn, functools.partial) else {}
  return {k: v for k, v in available.items() if k in names and k not in bound}


# ----------------------------------------------------------------------------------------- SeqIO's


def rekey(x: Example, key_map: Mapping[str, str | None] | None = None) -> Example:
  """Renames features; a None/empty old key yields "" (SeqIO). Unmapped keys are dropped."""
  if not key_map:
    return x
  return {new: (x[old] if old else "") for new, old in key_map.items()}


def tokenize(x: Example, output_features: Mapping[str, Any], copy_pretokenized: bool = True,
             with_eos: bool = False) -> Example:
  """Encodes every string output feature; keeps the text as `<feature>_pretokenized`."""
  out = {}
  for k, v in x.items():
    if k in output_features and isinstance(v, (str, bytes)):
      if isinstance(v, bytes):
        v = v.decode("utf-8")
      if copy_pretokenized:
        out[f"{k}_pretokenized"] = v
      feature = output_features[k]
      ids = feature.vocabulary.encode(v)
      if with_eos and feature.add_eos:
        ids = list(ids) + [feature.vocabulary.eos_id]
      v = np.asarray(ids, np.int32)
    out[k] = v
  return out


def tokenize_and_append_eos(x: Example, output_features: Mapping[str, Any],
                            copy_pretokenized: bool = True) -> Example:
  return tokenize(x, output_features, copy_pretokenized=copy_pretokenized, with_eos=True)


def _ids(v) -> np.ndarray:
  return np.asarray(v, np.int32).reshape(-1)


def append_eos(x: Example, output_features: Mapping[str, Any]) -> Example:
  """Appends EOS to every output feature with `add_eos=True`."""
  out = dict(x)
  for k, feature in output_features.items():
    if k in out and feature.add_eos and not k.endswith("_pretokenized"):
      out[k] = np.append(_ids(out[k]), np.int32(feature.vocabulary.eos_id))
  return out


def append_eos_after_trim(x: Example, output_features: Mapping[str, Any],
                          sequence_length: Mapping[str, int | None] | None = None) -> Example:
  """Trims to `length - 1` and appends EOS, so a trimmed example keeps its EOS."""
  out = dict(x)
  for k, feature in output_features.items():
    if k not in out or not feature.add_eos:
      continue
    v = _ids(out[k])
    length = (sequence_length or {}).get(k)
    if length:
      v = v[:length - 1]
    out[k] = np.append(v, np.int32(feature.vocabulary.eos_id))
  return out


def trim(x: Example, sequence_length: Mapping[str, int | None],
         output_features: Mapping[str, Any] | None = None) -> Example:
  """Trims each feature that has a length (only output features, if given)."""
  out = dict(x)
  for k, length in sequence_length.items():
    if length is not None and k in out and (output_features is None or k in output_features):
      out[k] = _ids(out[k])[:length]
  return out


def filter_by_length(x: Example, feature_key: str = "targets", min_length: int = 1,
                     max_length: int = 1 << 30) -> Example | None:
  """Drops examples whose string (or token) feature length is out of range."""
  return x if min_length <= len(x[feature_key]) <= max_length else None


# ---------------------------------------------------------------------------------- T5's text ones


def _line(x: Example | str) -> str:
  # SeqIO's TextLineDataSource yields bare strings; ours yields {"text": line}.
  return x["text"] if isinstance(x, Mapping) else x


def parse_tsv(x: Example | str, field_names: Sequence[str] | None = None,
              field_delim: str = "\t") -> Example:
  """Splits a line into named fields (T5's `parse_tsv`); missing fields are ""."""
  names = list(field_names or ("inputs", "targets"))
  values = _line(x).split(field_delim)
  if len(values) > len(names):
    raise UserError(f"parse_tsv: a line has {len(values)} fields but field_names has {len(names)}: "
                    f"{_line(x)[:80]!r}")
  return dict(zip(names, values + [""] * (len(names) - len(values))))


def preprocess_tsv(x: Example | str, field_delim: str = "\t", num_fields: int = 2,
                   inputs_format: str = "{0}", targets_format: str = "{1}") -> Example:
  """Formats `inputs`/`targets` from numbered fields, e.g. 'question: {0}' (T5's)."""
  fields = (_line(x).split(field_delim) + [""] * num_fields)[:num_fields]

  def fill(fmt: str) -> str:  # only {digit} is a placeholder, other braces stay
    return re.sub(r"{(\d)}", lambda m: fields[int(m.group(1))], fmt)

  return {"inputs": fill(inputs_format), "targets": fill(targets_format)}


LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish",
    "et": "Estonian", "fi": "Finnish", "fr": "French", "gu": "Gujarati", "hi": "Hindi",
    "it": "Italian", "ja": "Japanese", "kk": "Kazakh", "ko": "Korean", "lt": "Lithuanian",
    "lv": "Latvian", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "tr": "Turkish", "zh": "Chinese",
}


def language_name(code: str) -> str:
  """English name of a language code, as T5's `translate` (via babel) prints it."""
  name = LANGUAGE_NAMES.get(code[:2].lower())
  if name is None:
    raise UserError(f"unknown language code {code!r}; use one of "
                    f"{', '.join(sorted(LANGUAGE_NAMES))}")
  return name


def translate(x: Example, source_language: str, target_language: str) -> Example:
  """{'en': ..., 'es': ...} -> inputs 'translate English to Spanish: ...', targets the Spanish."""
  return {
      "inputs": f"translate {language_name(source_language)} to {language_name(target_language)}: "
                f"{x[source_language]}",
      "targets": x[target_language],
  }


def summarize(x: Example, article_key: str, summary_key: str) -> Example:
  """inputs 'summarize: <article>', targets the summary (T5's `summarize`)."""
  return {"inputs": f"summarize: {x[article_key]}", "targets": x[summary_key]}


# --------------------------------------------------------------------------------- T5's token ones


def select_random_chunk(x: Example, rng: np.random.Generator,
                        output_features: Mapping[str, Any] | None = None,
                        max_length: int | None = None, feature_key: str = "targets",
                        additional_feature_keys: Sequence[str] | None = None,
                        passthrough_feature_keys: Sequence[str] | None = None,
                        sequence_length: Mapping[str, int] | None = None,
                        uniform_random_start: bool = False,
                        min_length: int | None = None) -> Example | None:
  """Keeps one random chunk of at most `max_length` tokens; drops empty examples (T5)."""
  if max_length is None and sequence_length is not None:
    max_length = sequence_length[feature_key]
    if output_features is not None and output_features[feature_key].add_eos:
      max_length -= 1  # leave room for EOS
  if max_length is None:
    raise UserError("select_random_chunk needs max_length or sequence_length")
  tokens = _ids(x[feature_key])
  n = len(tokens)
  if n == 0:
    return None
  length = max_length if min_length is None else int(rng.integers(min_length, max_length))
  if uniform_random_start:
    start = int(rng.integers(-length + 1, n))
    end, start = min(start + length, n), max(start, 0)
  else:
    num_segments = math.ceil(n / length)
    start = length * int(rng.integers(0, num_segments))
    end = min(start + length, n)
  out = {feature_key: tokens[start:end]}
  for k in additional_feature_keys or ():
    out[k] = _ids(x[k])[start:end]
  for k in passthrough_feature_keys or ():
    out[k] = x[k]
  return out


@stream
def reduce_concat_tokens(examples: Iterator[Example], feature_key: str = "targets",
                         batch_size: int = 128) -> Iterator[Example]:
  """Concatenates the tokens of each run of `batch_size` examples (T5); other features drop."""
  batch = []
  for x in examples:
    batch.append(_ids(x[feature_key]))
    if len(batch) == batch_size:
      yield {feature_key: _concat_nonzero(batch)}
      batch = []
  if batch:
    yield {feature_key: _concat_nonzero(batch)}


def _concat_nonzero(parts: list[np.ndarray]) -> np.ndarray:
  tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
  return tokens[tokens != 0]  # T5 strips the padding of its padded batch (and any 0 id)


@flat_map
def split_tokens(x: Example, max_tokens_per_segment: int, rng: np.random.Generator | None = None,
                 min_tokens_per_segment: int | None = None, feature_key: str = "targets",
                 additional_feature_keys: Sequence[str] | None = None,
                 passthrough_feature_keys: Sequence[str] | None = None) -> Iterator[Example]:
  """Splits one example into segments of `max_tokens_per_segment` (last may be shorter).

  With `min_tokens_per_segment`, the segment length is log-uniform per example (T5).
  Empty examples are dropped.
  """
  tokens = _ids(x[feature_key])
  n = len(tokens)
  if n == 0:
    return
  if min_tokens_per_segment is None:
    length = max_tokens_per_segment
  else:
    if rng is None:
      raise UserError("split_tokens with min_tokens_per_segment needs an rng")
    log_length = rng.uniform(math.log(min_tokens_per_segment), math.log(max_tokens_per_segment))
    length = int(math.exp(log_length))
  for start in range(0, n, length):
    out = {feature_key: tokens[start:start + length]}
    for k in additional_feature_keys or ():
      out[k] = _ids(x[k])[start:start + length]
    for k in passthrough_feature_keys or ():
      out[k] = x[k]
    yield out


@flat_map
def split_tokens_to_inputs_length(x: Example, sequence_length: Mapping[str, int],
                                  output_features: Mapping[str, Any],
                                  **kwargs) -> Iterator[Example]:
  max_tokens = sequence_length["inputs"] - (1 if output_features["inputs"].add_eos else 0)
  return split_tokens(x, max_tokens_per_segment=max_tokens, **kwargs)


@flat_map
def split_tokens_to_targets_length(x: Example, sequence_length: Mapping[str, int],
                                   output_features: Mapping[str, Any],
                                   **kwargs) -> Iterator[Example]:
  max_tokens = sequence_length["targets"] - (1 if output_features["targets"].add_eos else 0)
  return split_tokens(x, max_tokens_per_segment=max_tokens, **kwargs)


def denoise(x: Example, output_features: Mapping[str, Any], rng: np.random.Generator,
            noise_density: float, noise_mask_fn: Callable, inputs_fn: Callable,
            targets_fn: Callable | None = None,
            passthrough_feature_keys: Sequence[str] | None = None,
            input_feature_key: str = "inputs") -> Example:
  """T5's denoise: a noise mask over `targets`, then inputs/targets built from it.

  The building blocks are in `t5forge.data.denoise` (also importable from here).

  Args:
    noise_mask_fn: (length, noise_density, rng) -> bool [length], e.g.
      `random_spans_noise_mask`, `regular_noise_mask`, `iid_noise_mask`.
    inputs_fn / targets_fn: (tokens, noise_mask, vocabulary[, rng]) -> tokens,
      e.g. `noise_span_to_unique_sentinel`; `rng` is passed when the function names
      it (T5's `seeds`). Targets default to the original tokens.
    passthrough_feature_keys: features copied unchanged when the example has them
      (T5); naming `input_feature_key` or 'targets' is an error.
  """
  if passthrough_feature_keys and {input_feature_key, "targets"} & set(passthrough_feature_keys):
    raise UserError(f"passthrough keys cannot contain {input_feature_key!r} or 'targets'")
  vocabulary = output_features["targets"].vocabulary
  inputs_feature = output_features.get(input_feature_key)
  if inputs_feature is not None and inputs_feature.vocabulary != vocabulary:
    raise UserError("denoise builds inputs from the tokenized targets, so inputs and targets need "
                    "the same vocabulary")
  tokens = _ids(x["targets"])
  noise_mask = np.asarray(noise_mask_fn(len(tokens), noise_density, rng), bool)

  def apply(fn):
    return np.asarray(fn(tokens, noise_mask, vocabulary, **call_kwargs(fn, {"rng": rng})),
                      np.int32)

  out = {input_feature_key: apply(inputs_fn), "targets": apply(targets_fn) if targets_fn else tokens}
  for k in passthrough_feature_keys or ():
    if k in x:  # T5 passes through the keys the example has
      out[k] = x[k]
  return out


@composite
def span_corruption(sequence_length: Mapping[str, int], output_features: Mapping[str, Any],
                    mean_noise_span_length: float = 3.0, noise_density: float = 0.15,
                    input_feature_key: str = "inputs",
                    merge_examples_to_reduce_padding: bool = True,
                    max_chunk_length: int = 65536, reserved_for_packing: int | None = None,
                    passthrough_feature_keys: Sequence[str] | None = None) -> list:
  """T5's pretraining objective: chunk, concatenate, split to 568, corrupt spans.

  For inputs length 512 the raw windows are 568 tokens and the targets 114
  (`random_spans_helper`); a targets length below that is an error, as in T5.
  `reserved_for_packing` shortens the inputs by that many tokens (T5).
  `passthrough_feature_keys` are copied unchanged into every window; as in T5
  they need `merge_examples_to_reduce_padding=False` (merged examples have no one
  value for them) and cannot be the inputs or 'targets'.
  """
  if passthrough_feature_keys and merge_examples_to_reduce_padding:
    raise UserError(f"span_corruption: passthrough_feature_keys={list(passthrough_feature_keys)} "
                    "needs merge_examples_to_reduce_padding=False (as in T5)")
  if passthrough_feature_keys and {input_feature_key, "targets"} & set(passthrough_feature_keys):
    raise UserError(f"span_corruption: passthrough_feature_keys cannot contain "
                    f"{input_feature_key!r} or 'targets'")
  inputs_length = sequence_length[input_feature_key] - (reserved_for_packing or 0)
  tokens_length, targets_length = random_spans_helper(
      inputs_length=inputs_length, noise_density=noise_density,
      mean_noise_span_length=mean_noise_span_length)
  if sequence_length.get("targets") is not None and sequence_length["targets"] < targets_length:
    raise UserError(f"span corruption with inputs length {sequence_length[input_feature_key]} "
                    f"makes targets of {targets_length} tokens, but the targets length is "
                    f"{sequence_length['targets']}; set it to {targets_length}")
  # Named only when given, so the cached offline stage of existing tasks keeps its fingerprint.
  passthrough = ({"passthrough_feature_keys": list(passthrough_feature_keys)}
                 if passthrough_feature_keys else {})
  steps = [functools.partial(select_random_chunk, feature_key="targets",
                             max_length=max_chunk_length, **passthrough)]
  if merge_examples_to_reduce_padding:
    steps.append(functools.partial(reduce_concat_tokens, feature_key="targets", batch_size=128))
  steps.append(functools.partial(split_tokens, feature_key="targets",
                                 max_tokens_per_segment=tokens_length, **passthrough))
  steps.append(functools.partial(
      denoise, noise_density=noise_density,
      noise_mask_fn=functools.partial(_spans_mask, mean_noise_span_length=mean_noise_span_length),
      inputs_fn=noise_span_to_unique_sentinel, targets_fn=nonnoise_span_to_unique_sentinel,
      input_feature_key=input_feature_key, **passthrough))
  return steps


def _spans_mask(length, noise_density, rng, mean_noise_span_length):
  return random_spans_noise_mask(length, noise_density, rng,
                                 mean_noise_span_length=mean_noise_span_length)


@composite
def prefix_lm(sequence_length: Mapping[str, int], output_features: Mapping[str, Any]) -> list:
  """T5's prefix LM objective: split each `inputs`-length window at a random point."""
  del sequence_length, output_features  # used by split_tokens_to_inputs_length at run time
  return [
      functools.partial(select_random_chunk, feature_key="targets", max_length=65536),
      split_tokens_to_inputs_length,
      functools.partial(denoise, noise_density=0.5, noise_mask_fn=random_prefix_noise_mask,
                        inputs_fn=drop_nonnoise_tokens, targets_fn=drop_noise_tokens),
  ]


def expand(preprocessors: Iterable[Any], sequence_length: Mapping[str, int | None] | None,
           output_features: Mapping[str, Any]) -> list:
  """Expands composite preprocessors (and nested lists) into a flat list."""
  out = []
  for p in preprocessors:
    if isinstance(p, (list, tuple)):
      out.extend(expand(p, sequence_length, output_features))
    elif kind_of(p) == "composite":
      if sequence_length is None:
        raise UserError(f"{_name(p)} needs task_feature_lengths (it depends on the sequence "
                        "length)")
      kwargs = call_kwargs(p, {"sequence_length": sequence_length,
                               "output_features": output_features})
      out.extend(expand(p(**kwargs), sequence_length, output_features))
    else:
      out.append(p)
  return out


def _name(p: Any) -> str:
  while isinstance(p, functools.partial):
    p = p.func
  return getattr(p, "__qualname__", repr(p))
