"""T5's denoising toolkit: noise masks, and what inputs/targets make of the noise.

`preprocessors.denoise` (T5's `denoise`) draws a noise mask over an example's
`targets` tokens and builds the new inputs and targets from it:

    noise_mask = noise_mask_fn(length, noise_density, rng)          bool [L]
    inputs     = inputs_fn(tokens, noise_mask, vocabulary[, rng])   int32 [L']
    targets    = targets_fn(tokens, noise_mask, vocabulary[, rng])  (or the tokens)

Noise masks (`noise_mask_fn`), each bool [length], True on noise tokens:
  random_spans_noise_mask   alternating non-noise/noise spans (span corruption)
  regular_noise_mask        equally spaced spans of one random length
  iid_noise_mask            each token independently
  random_prefix_noise_mask  a random prefix (prefix LM)

Token functions (`inputs_fn` / `targets_fn`), tokens int [L] -> int32 [L']:
  noise_token_to_sentinel, noise_span_to_sentinel, nonnoise_span_to_sentinel (the
  sentinel is `sentinel_id(vocabulary)` = vocab_size - 1); noise_span_to_unique_sentinel,
  nonnoise_span_to_unique_sentinel (vocab_size - 1, vocab_size - 2, ... per span, so
  inputs and targets align); drop_noise_tokens, drop_nonnoise_tokens; and the random
  ones permute_noise_tokens, noise_token_to_gathered_token, noise_token_to_random_token,
  noise_token_to_random_token_or_sentinel.

T5's functions take `seeds`; here a random one takes `rng` (a numpy Generator),
which `denoise` passes when the function names it, so the same numbers of tokens
are noise as in T5 but not the same positions. All are importable as
`t5forge.data.preprocessors.<name>`, where a ported `tasks.py` finds T5's.
"""
from __future__ import annotations

import numpy as np

from t5forge.errors import UserError


def _check_density(noise_density: float, fn: str) -> None:
  if not 0.0 <= noise_density < 1.0:
    raise UserError(f"{fn}: noise_density must be in [0, 1), got {noise_density!r} "
                    "(the fraction of tokens to corrupt, e.g. 0.15)")


def random_spans_helper(inputs_length: int, noise_density: float, mean_noise_span_length: float,
                        extra_tokens_per_span_inputs: int = 1,
                        extra_tokens_per_span_targets: int = 1) -> tuple[int, int]:
  """T5's length arithmetic for span corruption without padding.

  Returns:
    (tokens_length, targets_length): how many raw tokens to cut so that the
    corrupted inputs (with EOS) are exactly `inputs_length` long, and the length of
    the corrupted targets (with EOS). For 512, 0.15, 3.0: (568, 114).
  """
  def lengths(tokens_length):
    num_noise = int(round(tokens_length * noise_density))
    num_nonnoise = tokens_length - num_noise
    num_spans = int(round(num_noise / mean_noise_span_length))
    # Inputs keep the non-noise tokens plus a sentinel per span and EOS; targets
    # the noise tokens plus a sentinel per span and EOS.
    return (num_nonnoise + num_spans * extra_tokens_per_span_inputs + 1,
            num_noise + num_spans * extra_tokens_per_span_targets + 1)

  tokens_length = inputs_length - 1
  while lengths(tokens_length + 1)[0] <= inputs_length:
    tokens_length += 1
  inputs_length, targets_length = lengths(tokens_length)
  # T5's "minor hack" to make targets equal inputs for the 50% density case.
  if noise_density == 0.5 and targets_length > inputs_length:
    tokens_length -= 1
    targets_length -= 1
  return tokens_length, targets_length


# ------------------------------------------------------------------------------------ noise masks


def random_spans_noise_mask(length: int, noise_density: float, rng: np.random.Generator,
                            mean_noise_span_length: float = 3.0,
                            random_roll: bool = False) -> np.ndarray:
  """T5's noise mask: alternating non-noise/noise spans, starting with non-noise.

  num_noise_tokens = round(length * noise_density) and num_noise_spans =
  round(num_noise_tokens / mean_noise_span_length), both clipped to avoid empty
  spans (so any density > 0 corrupts at least one token); the span lengths are
  uniformly random partitions. noise_density=0 masks nothing (T5).

  Args:
    random_roll: roll the mask by a random offset in [0, length) (T5): noise
      then also starts a sequence, and when one short span meets the density it
      is not always at the end. The number of noise tokens is unchanged.

  Returns:
    bool [length], True on noise tokens.
  """
  _check_density(noise_density, "random_spans_noise_mask")
  if noise_density == 0.0:
    return np.zeros(length, bool)
  orig_length = length
  length = max(length, 2)  # avoid degeneracy
  # float32 and round-half-to-even, as T5's tf.round(tf.cast(.., tf.float32)).
  num_noise = int(np.round(np.float32(length) * np.float32(noise_density)))
  num_noise = min(max(num_noise, 1), length - 1)
  num_spans = int(np.round(np.float32(num_noise) / np.float32(mean_noise_span_length)))
  num_spans = max(num_spans, 1)
  num_nonnoise = length - num_noise

  def random_segmentation(num_items, num_segments):
    # Choose which of the num_items - 1 gaps start a new segment.
    first = np.zeros(num_items, np.int64)
    cuts = np.zeros(num_items - 1, bool)
    cuts[:num_segments - 1] = True
    rng.shuffle(cuts)
    first[1:] = cuts
    return np.bincount(np.cumsum(first), minlength=num_segments)

  noise_lengths = random_segmentation(num_noise, num_spans)
  nonnoise_lengths = random_segmentation(num_nonnoise, num_spans)
  interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
  starts = np.cumsum(interleaved)[:-1]
  indicator = np.zeros(length, np.int64)
  indicator[starts] = 1
  is_noise = np.cumsum(indicator) % 2 == 1
  mask = is_noise[:orig_length]
  if random_roll:
    # Drawn only when asked, so masks without the roll are those of before.
    mask = np.roll(mask, int(rng.integers(0, length)))
  return mask


def regular_noise_mask(length: int, noise_density: float, rng: np.random.Generator,
                       min_span_length: int = 1, max_span_length: int = 5) -> np.ndarray:
  """T5's equally spaced noise spans of equal length.

  A span length s is drawn uniformly from [min_span_length, max_span_length] and an
  offset from [0, period), period = round(s / noise_density); token i is noise when
  (i + offset) % period < s. The sequence may start and end in a shorter span.
  With s = 2 and density 0.25 (period 8), 800 tokens have exactly 200 noise tokens.

  Returns:
    bool [length].
  """
  _check_density(noise_density, "regular_noise_mask")
  if noise_density == 0.0:
    return np.zeros(length, bool)
  span_length = int(rng.integers(min_span_length, max_span_length + 1))
  period = int(np.round(np.float32(span_length) / np.float32(noise_density)))
  offset = int(rng.integers(0, period))
  return (np.arange(length) + offset) % period < span_length


def iid_noise_mask(length: int, noise_density: float, rng: np.random.Generator) -> np.ndarray:
  """Each token is noise independently with probability `noise_density` (T5). bool [length]."""
  _check_density(noise_density, "iid_noise_mask")
  return rng.random(length) < noise_density


def random_prefix_noise_mask(length: int, noise_density: float,
                             rng: np.random.Generator) -> np.ndarray:
  """The first k tokens are noise (T5's prefix_lm); bool [length].

  k is uniform in [min_k, length - 1], min_k = max(1, round((1 - 2 * density) *
  (length - 1))): with density 0.5, any split point.
  """
  if noise_density > 0.5:
    raise UserError(f"random_prefix_noise_mask: noise_density must not exceed 0.5, got "
                    f"{noise_density!r} (as in T5)")
  max_input = length - 1
  rounded = int(np.round(np.float32(1 - 2 * noise_density) * np.float32(max_input)))
  min_input = min(max_input, max(1, rounded))
  k = int(rng.integers(min_input, max_input + 1))
  return np.arange(length) < k


# -------------------------------------------------------------------------------- token functions


def sentinel_id(vocabulary, return_value: int | None = None) -> int:
  """The sentinel of the non-unique functions: the last id of the vocabulary (T5)."""
  return int(return_value) if return_value is not None else vocabulary.vocab_size - 1


def _prev(noise_mask: np.ndarray) -> np.ndarray:
  """bool [L]: whether the token before is noise (False for the first)."""
  return np.concatenate([[False], noise_mask[:-1]])


def noise_token_to_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                            vocabulary) -> np.ndarray:
  """Replaces every noise token by `sentinel_id(vocabulary)`; same length."""
  return np.where(noise_mask, sentinel_id(vocabulary), tokens).astype(np.int32)


def noise_span_to_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary) -> np.ndarray:
  """Replaces each run of noise tokens by one `sentinel_id(vocabulary)`."""
  noise_mask = np.asarray(noise_mask, bool)
  out = noise_token_to_sentinel(tokens, noise_mask, vocabulary)
  return out[~(noise_mask & _prev(noise_mask))]


def nonnoise_span_to_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                              vocabulary) -> np.ndarray:
  return noise_span_to_sentinel(tokens, ~np.asarray(noise_mask, bool), vocabulary)


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                                  vocabulary) -> np.ndarray:
  """Replaces each noise span by one sentinel: vocab_size - 1, vocab_size - 2, ..."""
  noise_mask = np.asarray(noise_mask, bool)
  prev_noise = _prev(noise_mask)
  first_noise = noise_mask & ~prev_noise
  subsequent_noise = noise_mask & prev_noise
  sentinel = sentinel_id(vocabulary) + 1 - np.cumsum(first_noise)
  out = np.where(first_noise, sentinel, tokens)
  return out[~subsequent_noise].astype(np.int32)


def nonnoise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                                     vocabulary) -> np.ndarray:
  return noise_span_to_unique_sentinel(tokens, ~np.asarray(noise_mask, bool), vocabulary)


def drop_noise_tokens(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary=None) -> np.ndarray:
  return np.asarray(tokens, np.int32)[~np.asarray(noise_mask, bool)]


def drop_nonnoise_tokens(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary=None) -> np.ndarray:
  return np.asarray(tokens, np.int32)[np.asarray(noise_mask, bool)]


def permute_noise_tokens(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary,
                         rng: np.random.Generator) -> np.ndarray:
  """Shuffles the noise tokens among the noise positions; the others stay (T5)."""
  del vocabulary
  out = np.array(tokens, np.int32)
  noise_mask = np.asarray(noise_mask, bool)
  out[noise_mask] = rng.permutation(out[noise_mask])
  return out


def noise_token_to_gathered_token(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary,
                                  rng: np.random.Generator) -> np.ndarray:
  """Replaces each noise token by a uniformly chosen token of the same sequence (T5)."""
  del vocabulary
  tokens = np.asarray(tokens, np.int32)
  picked = tokens[rng.integers(0, max(len(tokens), 1), size=len(tokens))]
  return np.where(noise_mask, picked, tokens).astype(np.int32)


def noise_token_to_random_token(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary,
                                rng: np.random.Generator,
                                num_reserved_tokens: int = 3) -> np.ndarray:
  """Replaces each noise token by a uniform id in [num_reserved_tokens, vocab_size) (T5)."""
  tokens = np.asarray(tokens, np.int32)
  random = rng.integers(num_reserved_tokens, vocabulary.vocab_size, size=len(tokens))
  return np.where(noise_mask, random, tokens).astype(np.int32)


def noise_token_to_random_token_or_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                                            vocabulary, rng: np.random.Generator,
                                            random_prob: float = 0.1) -> np.ndarray:
  """Each noise token becomes a random id with probability `random_prob`, else the sentinel."""
  tokens = np.asarray(tokens, np.int32)
  use_random = rng.random(len(tokens)) < random_prob
  return np.where(use_random,
                  noise_token_to_random_token(tokens, noise_mask, vocabulary, rng),
                  noise_token_to_sentinel(tokens, noise_mask, vocabulary)).astype(np.int32)
