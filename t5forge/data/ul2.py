"""UL2's mixture of denoisers (Tay et al. 2022, arXiv 2205.05131), chosen per example.

Three families of denoisers, each announced by a mode token prepended to the inputs:

  R  regular span corruption: T5's, short spans, density 0.15        "[NLU]"
  S  sequential: prefix LM, the window split at a uniform random point  "[S2S]"
  X  extreme span corruption: long spans or a high density             "[NLG]"

The default mixture is the paper's seven denoisers (`UL2_DENOISERS`): R(3, 0.15),
R(8, 0.15), S, X(3, 0.5), X(8, 0.5), X(64, 0.15), X(64, 0.5) as (mean span length,
density), mixed uniformly (the reference `ul2_objective`'s default without rates).

How it is built: `ul2_objective` is a composite preprocessor (like T5's
`span_corruption`, whose parts it reuses) that expands to

  select_random_chunk -> reduce_concat_tokens -> split_tokens     offline stage
  denoise_mixture                                                  per example, rng

The offline stage cuts windows of the longest raw length any denoiser needs. Then, for
each example, `denoise_mixture` draws the denoiser at the given rates from the
example's rng (keyed by (seed, global example index), as for every per-example
preprocessor), takes a random sub-window of the length that denoiser needs, corrupts it
with `preprocessors.denoise` and T5's masks/token functions (`denoise.py`), and
prepends the denoiser's mode token. So the choice of denoiser is fresh every epoch,
reproducible from the seed, and the same whatever the number of shards or hosts.
(The reference instead shards the dataset per denoiser and samples the shards.)

Lengths: each denoiser's raw window is the longest whose corrupted inputs (mode token
and EOS included) fit the inputs length, whose targets (EOS included) fit the targets
length, and whose spans each get their own sentinel (at most the vocabulary's extra
ids: T5's sentinels count down from the last id and would otherwise run into ordinary
tokens), counted with the noise mask's own arithmetic (`span_lengths`). With UL2's
512/512 and a one-id mode token the R windows are T5's `random_spans_helper` windows
for inputs of 511 (567 tokens; T5's 568 for 512) and X(3, 0.5) is shortened from 765
tokens (127 spans) to 602 (100 spans, the bundled vocabulary's extra ids). A window
shortened by a limit is logged once (a warning), where T5's span_corruption refuses a
short targets length.

Mode tokens are strings encoded with the task's vocabulary (as T5X's UL2 gins do: with
the bundled SentencePiece model "[NLU]" is 6 ids), or a single id (an int) for a
vocabulary with dedicated tokens, or None for none. Override them per family with
`mode_tokens={"R": ..., "S": ..., "X": ...}`.

In a task definition:

    TaskRegistry.add("my_ul2", source=..., preprocessors=[
        functools.partial(pre.rekey, key_map={"inputs": None, "targets": "text"}),
        pre.tokenize, pre.CacheDatasetPlaceholder(),
        functools.partial(ul2.ul2_objective, rates=[...]),
        pre.append_eos_after_trim], output_features=..., cache=True)

In gin, `ul2_task` registers a copy of a task that uses `ul2_objective` with other
settings (configs/examples/ul2_pretrain.gin):

    MIXTURE_OR_TASK_NAME = @ul2.ul2_task()
    ul2.ul2_task.like = 'english_ul2'
    ul2.ul2_task.rates = [2, 2, 1, 1, 1, 1, 1]
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from t5forge.data import preprocessors as pre
from t5forge.data import tasks as tasks_lib
from t5forge.errors import UserError

log = logging.getLogger(__name__)

MODES = ("R", "S", "X")
MODE_TOKENS: dict[str, str | int | None] = {"R": "[NLU]", "S": "[S2S]", "X": "[NLG]"}


@dataclasses.dataclass(frozen=True)
class Denoiser:
  """One denoiser of the mixture.

  Attributes:
    mode: 'R' or 'X' (span corruption) or 'S' (prefix LM); picks the mode token.
    mean_noise_span_length: R and X only: T5's mean span length.
    noise_density: R and X only: the fraction of the window's tokens to corrupt.
  """
  mode: str
  mean_noise_span_length: float | None = None
  noise_density: float | None = None


UL2_DENOISERS = (
    Denoiser("R", 3.0, 0.15), Denoiser("R", 8.0, 0.15), Denoiser("S"),
    Denoiser("X", 3.0, 0.5), Denoiser("X", 8.0, 0.5), Denoiser("X", 64.0, 0.15),
    Denoiser("X", 64.0, 0.5))

# ------------------------------------------------------------------------------ configuration


def as_denoiser(d: Any, where: str = "denoisers[0]") -> Denoiser:
  """A `Denoiser` from itself, a tuple ('R', 3.0, 0.15) / ('S',) (gin) or a dict; checked."""
  if isinstance(d, Denoiser):
    mode, span, density = d.mode, d.mean_noise_span_length, d.noise_density
  elif isinstance(d, Mapping):
    unknown = set(d) - {"mode", "mean_noise_span_length", "noise_density"}
    if unknown or "mode" not in d:
      raise UserError(f"ul2: {where} = {dict(d)!r}: use the keys 'mode', "
                      "'mean_noise_span_length', 'noise_density'")
    mode, span, density = d["mode"], d.get("mean_noise_span_length"), d.get("noise_density")
  elif isinstance(d, (tuple, list)) and 1 <= len(d) <= 3:
    mode, span, density = (list(d) + [None, None])[:3]
  elif isinstance(d, str):
    mode, span, density = d, None, None
  else:
    raise UserError(f"ul2: {where} = {d!r}: give a denoiser as ('R', mean_span_length, density), "
                    "('X', mean_span_length, density) or ('S',)")
  if mode not in MODES:
    raise UserError(f"ul2: {where} has unknown denoiser mode {mode!r}; use 'R' (span "
                    "corruption), 'X' (extreme span corruption) or 'S' (prefix LM)")
  if mode == "S":
    if span is not None or density is not None:
      raise UserError(f"ul2: {where} is an S-denoiser (prefix LM, split at a random point): it "
                      "takes no mean_noise_span_length or noise_density; give ('S',)")
    return Denoiser("S")
  if not isinstance(span, (int, float)) or isinstance(span, bool) or not span >= 1:
    raise UserError(f"ul2: {where} ({mode}) needs mean_noise_span_length >= 1, got {span!r}")
  if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0 < density < 1:
    raise UserError(f"ul2: {where} ({mode}) needs noise_density in (0, 1), got {density!r}")
  return Denoiser(mode, float(span), float(density))


def _settings(denoisers, rates, mode_tokens) -> tuple[tuple[Denoiser, ...], tuple[float, ...],
                                                       tuple[tuple[str, Any], ...]]:
  """Checked (denoisers, normalized rates, mode tokens per family) of a configuration."""
  if denoisers is None:
    denoisers = UL2_DENOISERS
  if isinstance(denoisers, (str, Denoiser, Mapping)) or not isinstance(denoisers, Sequence):
    raise UserError(f"ul2: denoisers must be a list of denoisers, got {denoisers!r}")
  if not denoisers:
    raise UserError("ul2: denoisers is empty; give at least one, e.g. [('R', 3.0, 0.15)]")
  ds = tuple(as_denoiser(d, f"denoisers[{i}]") for i, d in enumerate(denoisers))
  if rates is None:
    rates = [1.0] * len(ds)
  if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence) or len(rates) != len(ds):
    raise UserError(f"ul2: rates must be a list of one number per denoiser ({len(ds)}), got "
                    f"{rates!r}")
  for i, r in enumerate(rates):
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
      raise UserError(f"ul2: rates[{i}] = {r!r}; each rate must be a finite number >= 0")
  total = float(sum(rates))
  if not total > 0:
    raise UserError(f"ul2: rates {list(rates)} sum to {total}; they must sum to a positive "
                    "number (they are normalized)")
  tokens = dict(MODE_TOKENS)
  for k, v in (mode_tokens or {}).items():
    if k not in MODES:
      raise UserError(f"ul2: mode_tokens has unknown mode {k!r}; use 'R', 'S' and/or 'X'")
    if not (v is None or isinstance(v, str) or
            (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0)):
      raise UserError(f"ul2: mode_tokens[{k!r}] = {v!r}; give a string (encoded with the "
                      "vocabulary), an id >= 0, or None")
    tokens[k] = v
  return ds, tuple(float(r) / total for r in rates), tuple(sorted(tokens.items()))


def _mode_ids(token: str | int | None, vocabulary, mode: str) -> tuple[int, ...]:
  if token is None or token == "":
    return ()
  if isinstance(token, str):
    return tuple(int(i) for i in vocabulary.encode(token))
  if not token < vocabulary.vocab_size:
    raise UserError(f"ul2: mode token of {mode} is id {token}, outside the vocabulary "
                    f"({vocabulary.vocab_size} ids)")
  return (int(token),)


# -------------------------------------------------------------------------------------- lengths


def span_lengths(length: int, d: Denoiser) -> tuple[int, int, int]:
  """(inputs, targets, spans) of `length` raw tokens after span corruption, without EOS.

  The arithmetic of `random_spans_noise_mask` (float32 rounding, at least one noise token
  and one span), of which T5's `random_spans_helper` is a float64 approximation that
  lets a short window have no span (so a targets length it computes can be one short).
  """
  n = max(length, 2)  # the mask's guard against degenerate lengths
  num_noise = int(np.round(np.float32(n) * np.float32(d.noise_density)))
  num_noise = min(max(num_noise, 1), n - 1)
  num_spans = max(int(np.round(np.float32(num_noise) / np.float32(d.mean_noise_span_length))), 1)
  return n - num_noise + num_spans, num_noise + num_spans, num_spans


def _span_window(d: Denoiser, inputs_room: int, targets_room: int | None = None,
                 max_spans: int | None = None) -> int:
  """The longest raw window of a span denoiser whose corrupted inputs take at most
  `inputs_room` tokens, targets at most `targets_room` and spans at most `max_spans`
  (EOS not counted); 0 when not even 2 tokens fit. Inputs, targets and spans all grow
  with the window, so a binary search finds it."""
  def ok(length):
    inputs, targets, spans = span_lengths(length, d)
    return (inputs <= inputs_room and (targets_room is None or targets <= targets_room)
            and (max_spans is None or spans <= max_spans))

  if not ok(2):
    return 0
  lo, hi = 2, int((inputs_room + 2) / (1.0 - d.noise_density)) + 2  # ok(lo), not ok(hi)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if ok(mid):
      lo = mid
    else:
      hi = mid
  return lo


_WARNED: set = set()


def denoiser_windows(denoisers: Sequence[Denoiser], mode_ids: Sequence[Sequence[int]],
                     sequence_length: Mapping[str, int | None],
                     output_features: Mapping[str, Any], input_feature_key: str = "inputs",
                     reserved_for_packing: int | None = None) -> tuple[int, ...]:
  """Raw window length (tokens) of each denoiser; see the module docstring."""
  inputs_length = sequence_length.get(input_feature_key)
  if not inputs_length:
    raise UserError(f"ul2_objective needs a length for {input_feature_key!r} in "
                    "task_feature_lengths")
  targets_length = sequence_length.get("targets")
  targets_feature = output_features["targets"]
  # T5's unique sentinels count down from the last id; past the extra ids they would be
  # ordinary tokens (a vocabulary without extra ids, e.g. a test's, sets no limit).
  max_spans = targets_feature.vocabulary.extra_ids or None
  eos_inputs = int(output_features.get(input_feature_key, targets_feature).add_eos)
  eos_targets = int(targets_feature.add_eos)
  windows, shortened = [], []
  for d, ids in zip(denoisers, mode_ids):
    budget = inputs_length - (reserved_for_packing or 0) - len(ids)
    if d.mode == "S":
      # Inputs: mode + prefix (k tokens) + EOS; targets: the n - k >= 1 others + EOS;
      # the split point k is uniform in [1, n - 1] (T5's prefix_lm), so k <= n - 1 must
      # fit the inputs and n - 1 the targets.
      full = budget - eos_inputs + 1
      n = full if targets_length is None else min(full, targets_length - eos_targets + 1)
    else:
      targets_room = None if targets_length is None else targets_length - eos_targets
      full = _span_window(d, budget - eos_inputs)
      n = _span_window(d, budget - eos_inputs, targets_room, max_spans)
    if n < 2:
      raise UserError(f"ul2_objective: with task_feature_lengths {dict(sequence_length)} the "
                      f"{_describe(d)} denoiser (mode token of {len(ids)} ids) has no room for "
                      "a window of 2 tokens; raise the lengths")
    if n < full:
      shortened.append(f"{_describe(d)}: {n} of {full}")
    windows.append(int(n))
  key = (tuple(denoisers), tuple(windows), tuple(sorted(sequence_length.items())))
  if shortened and key not in _WARNED:
    _WARNED.add(key)
    log.warning("ul2_objective: raw windows shortened so that the targets fit their "
                    "length (%s; UL2 uses equal inputs and targets lengths) and every span has "
                    "its own sentinel (%s extra ids): %s tokens", targets_length, max_spans,
                    ", ".join(shortened))
  return tuple(windows)


def _describe(d: Denoiser) -> str:
  if d.mode == "S":
    return "S"
  return f"{d.mode}(mean span {d.mean_noise_span_length:g}, density {d.noise_density:g})"


# ------------------------------------------------------------------------------- preprocessors


@pre.composite
def ul2_objective(sequence_length: Mapping[str, int], output_features: Mapping[str, Any],
                  denoisers: Sequence[Any] | None = None, rates: Sequence[float] | None = None,
                  mode_tokens: Mapping[str, str | int | None] | None = None,
                  input_feature_key: str = "inputs",
                  merge_examples_to_reduce_padding: bool = True, max_chunk_length: int = 65536,
                  reserved_for_packing: int | None = None) -> list:
  """UL2's mixture of denoisers on tokenized `targets` (see the module docstring).

  Args:
    denoisers: `Denoiser`s or tuples ('R', mean_span, density) / ('X', ...) / ('S',);
      None: `UL2_DENOISERS`, the paper's seven.
    rates: one number >= 0 per denoiser, normalized; None: uniform.
    mode_tokens: per family ('R'/'S'/'X'), a string, an id or None, over `MODE_TOKENS`.
    input_feature_key: the feature the corrupted inputs go to.
    merge_examples_to_reduce_padding: concatenate documents before cutting windows (T5).
    max_chunk_length: the longest chunk kept of one document (T5's select_random_chunk).
    reserved_for_packing: shorten the inputs by this many tokens (T5).

  Returns:
    The steps: chunk, concatenate, split (offline), then `denoise_mixture` per example;
    follow it with `append_eos_after_trim` as for span_corruption.
  """
  ds, probs, tokens = _settings(denoisers, rates, mode_tokens)
  vocabulary = output_features["targets"].vocabulary
  tokens = dict(tokens)
  mode_ids = tuple(_mode_ids(tokens[d.mode], vocabulary, d.mode) for d in ds)
  windows = denoiser_windows(ds, mode_ids, sequence_length, output_features, input_feature_key,
                             reserved_for_packing)
  steps = [functools.partial(pre.select_random_chunk, feature_key="targets",
                             max_length=max_chunk_length)]
  if merge_examples_to_reduce_padding:
    steps.append(functools.partial(pre.reduce_concat_tokens, feature_key="targets",
                                   batch_size=128))
  # Windows of the longest raw length a denoiser that can be drawn needs.
  longest = max(w for w, p in zip(windows, probs) if p > 0)
  steps.append(functools.partial(pre.split_tokens, feature_key="targets",
                                 max_tokens_per_segment=longest))
  steps.append(functools.partial(denoise_mixture, denoisers=ds, rates=probs, windows=windows,
                                 mode_ids=mode_ids, input_feature_key=input_feature_key))
  return steps


def denoise_mixture(x: pre.Example, output_features: Mapping[str, Any], rng: np.random.Generator,
                    denoisers: Sequence[Denoiser], rates: Sequence[float],
                    windows: Sequence[int], mode_ids: Sequence[Sequence[int]],
                    input_feature_key: str = "inputs") -> pre.Example:
  """One example through one denoiser drawn at `rates` from its rng.

  Args:
    x: {"targets": int [n]} raw tokens (no EOS), n <= max(windows).
    denoisers / rates / windows / mode_ids: per denoiser: the denoiser, its probability,
      its raw window length and the ids of its mode token.

  Returns:
    {input_feature_key: int32 [len(mode ids) + corrupted], "targets": int32 [...]}, no EOS.
  """
  i = int(rng.choice(len(denoisers), p=rates))
  d, n = denoisers[i], windows[i]
  tokens = np.asarray(x["targets"], np.int32).reshape(-1)
  if len(tokens) > n:  # a random sub-window, a different one each epoch
    start = int(rng.integers(0, len(tokens) - n + 1))
    tokens = tokens[start:start + n]
  if d.mode == "S":
    out = pre.denoise({"targets": tokens}, output_features, rng, noise_density=0.5,
                      noise_mask_fn=pre.random_prefix_noise_mask,
                      inputs_fn=pre.drop_nonnoise_tokens, targets_fn=pre.drop_noise_tokens,
                      input_feature_key=input_feature_key)
  else:
    out = pre.denoise({"targets": tokens}, output_features, rng, noise_density=d.noise_density,
                      noise_mask_fn=functools.partial(
                          pre.random_spans_noise_mask,
                          mean_noise_span_length=d.mean_noise_span_length),
                      inputs_fn=pre.noise_span_to_unique_sentinel,
                      targets_fn=pre.nonnoise_span_to_unique_sentinel,
                      input_feature_key=input_feature_key)
  out[input_feature_key] = np.concatenate(
      [np.asarray(mode_ids[i], np.int32), out[input_feature_key]]).astype(np.int32)
  return out


# ------------------------------------------------------------------------------------------- gin


def ul2_task(like: str, denoisers: Sequence[Any] | None = None,
             rates: Sequence[float] | None = None,
             mode_tokens: Mapping[str, str | int | None] | None = None) -> str:
  """The name of a registered copy of task `like` whose `ul2_objective` step takes these
  settings (None: the step's own). For gin:

      MIXTURE_OR_TASK_NAME = @ul2.ul2_task()
      ul2.ul2_task.like = 'english_ul2'
      ul2.ul2_task.rates = [2, 2, 1, 1, 1, 1, 1]

  The copy is named `<like>.ul2_<8 hex digits of the settings>` and registered once (the
  same settings give the same name); when the settings are the task's own, `like` itself.
  """
  task = tasks_lib.get_mixture_or_task(like)
  steps = [i for i, p in enumerate(getattr(task, "preprocessors", ()))
           if _base(p) is ul2_objective]
  if not isinstance(task, tasks_lib.Task) or len(steps) != 1:
    raise UserError(f"ul2_task: {like!r} must be a task with one ul2_objective preprocessor "
                    "(e.g. 'english_ul2')")
  step = task.preprocessors[steps[0]]
  own = dict(step.keywords) if isinstance(step, functools.partial) else {}
  given = {"denoisers": denoisers, "rates": rates, "mode_tokens": mode_tokens}
  settings = {k: (own.get(k) if v is None else v) for k, v in given.items()}
  new = _settings(**settings)
  if new == _settings(own.get("denoisers"), own.get("rates"), own.get("mode_tokens")):
    return like
  name = f"{like}.ul2_{hashlib.md5(repr(new).encode()).hexdigest()[:8]}"
  if name not in tasks_lib.TaskRegistry.names():
    preprocessors = list(task.preprocessors)
    base_kwargs = {k: v for k, v in own.items() if k not in given}
    # The checked settings; the copy's offline stage is cached under its own name.
    preprocessors[steps[0]] = functools.partial(
        ul2_objective, **base_kwargs, denoisers=list(new[0]), rates=list(new[1]),
        mode_tokens=dict(new[2]))
    task.register_copy(name, preprocessors=tuple(preprocessors))
  return name


def _base(p):
  while isinstance(p, functools.partial):
    p = p.func
  return p
