"""T5's denoising toolkit: noise masks, token functions, denoise, span corruption.

Expected values are those of T5's own tests (t5/data/preprocessors_test.py) where
they do not depend on TensorFlow's random streams.
"""
import functools

import numpy as np
import pytest

from t5forge.data import preprocessors as pre
from t5forge.data.tasks import Feature
from t5forge.data.vocab import PassThroughVocabulary
from t5forge.errors import UserError

# T5's tests use a MockVocabulary of 1000 ids: the sentinel is 999.
VOCAB = PassThroughVocabulary(size=1000)
TOKENS = np.array([10, 11, 12, 13, 14, 15])
MASK = np.array([True, True, False, False, True, False])


def test_token_functions_on_t5s_fixed_mask():
  expected = {
      pre.noise_token_to_sentinel: [999, 999, 12, 13, 999, 15],
      pre.noise_span_to_sentinel: [999, 12, 13, 999, 15],
      pre.nonnoise_span_to_sentinel: [10, 11, 999, 14, 999],
      pre.noise_span_to_unique_sentinel: [999, 12, 13, 998, 15],
      pre.nonnoise_span_to_unique_sentinel: [10, 11, 999, 14, 998],
      pre.drop_noise_tokens: [12, 13, 15],
      pre.drop_nonnoise_tokens: [10, 11, 14],
  }
  for fn, want in expected.items():
    got = fn(TOKENS, MASK, VOCAB)
    assert got.dtype == np.int32, fn.__name__
    assert got.tolist() == want, fn.__name__
  assert pre.sentinel_id(VOCAB) == 999 and pre.sentinel_id(VOCAB, return_value=5) == 5


def test_random_token_functions_change_only_noise_tokens():
  rng = np.random.default_rng(0)
  tokens, mask = np.arange(100, 140), np.arange(40) % 3 == 0
  out = pre.noise_token_to_random_token(tokens, mask, VOCAB, rng)
  np.testing.assert_array_equal(out[~mask], tokens[~mask])
  assert ((out[mask] >= 3) & (out[mask] < 1000)).all() and (out[mask] != tokens[mask]).any()
  out = pre.permute_noise_tokens(tokens, mask, VOCAB, rng)
  np.testing.assert_array_equal(out[~mask], tokens[~mask])
  assert sorted(out[mask]) == sorted(tokens[mask]) and (out[mask] != tokens[mask]).any()
  out = pre.noise_token_to_gathered_token(tokens, mask, VOCAB, rng)
  np.testing.assert_array_equal(out[~mask], tokens[~mask])
  assert np.isin(out[mask], tokens).all()
  # random_prob 0: all sentinels; 1: all random ids (none is the sentinel here by chance).
  np.testing.assert_array_equal(
      pre.noise_token_to_random_token_or_sentinel(tokens, mask, VOCAB, rng, random_prob=0.0),
      pre.noise_token_to_sentinel(tokens, mask, VOCAB))
  out = pre.noise_token_to_random_token_or_sentinel(tokens, mask, VOCAB, rng, random_prob=1.0)
  np.testing.assert_array_equal(out[~mask], tokens[~mask])
  assert (out[mask] != 999).all()


def test_noise_density_zero_masks_nothing():
  for length in (1, 2, 32, 568):
    mask = pre.random_spans_noise_mask(length, 0.0, np.random.default_rng(0), 2.0)
    assert mask.dtype == bool and mask.shape == (length,) and not mask.any()
  # T5's test_denoise_no_corruption: 'The quick brown fox.' in its 26-id test vocabulary,
  # nothing corrupted: the inputs are the tokens, the targets one sentinel (25).
  vocab = PassThroughVocabulary(size=26)
  features = {"text_tokens": Feature(vocab), "targets": Feature(vocab)}
  tokens = [3, 2, 20, 4, 3, 2, 8, 13, 2, 3, 2, 23, 7, 19, 22, 3, 2, 7, 2]
  x = pre.denoise({"targets": tokens}, features, np.random.default_rng(42), noise_density=0.0,
                  noise_mask_fn=pre.random_spans_noise_mask,
                  inputs_fn=pre.noise_span_to_unique_sentinel,
                  targets_fn=pre.nonnoise_span_to_unique_sentinel,
                  input_feature_key="text_tokens")
  assert x["text_tokens"].tolist() == tokens and x["targets"].tolist() == [25]


@pytest.mark.parametrize("density", [-0.1, 1.0, 1.5])
def test_noise_density_outside_0_1_is_one_line(density):
  for fn in (pre.random_spans_noise_mask, pre.regular_noise_mask, pre.iid_noise_mask):
    with pytest.raises(UserError, match=r"noise_density must be in \[0, 1\)") as e:
      fn(20, density, np.random.default_rng(0))
    assert "\n" not in str(e.value) and fn.__name__ in str(e.value)


def test_regular_noise_mask_t5_count():
  # T5's test: 800 tokens, density 0.25, span length 2 -> exactly 200 noise tokens.
  for seed in range(10):
    mask = pre.regular_noise_mask(800, 0.25, np.random.default_rng(seed),
                                  min_span_length=2, max_span_length=2)
    assert mask.sum() == 200
    # Equally spaced: period round(2 / 0.25) = 8, every full period holds one span of 2.
    starts = np.flatnonzero(mask[1:] & ~mask[:-1]) + 1
    assert set(np.diff(starts)) == {8}
    assert all(mask[s:s + 2].all() and not mask[s + 2] for s in starts if s + 2 < 800)
  # Default spans of 1..5 tokens: the density holds up to the partial spans at the ends.
  for seed in range(10):
    mask = pre.regular_noise_mask(800, 0.25, np.random.default_rng(seed))
    assert abs(mask.mean() - 0.25) < 0.02


def test_random_roll_moves_spans_not_the_count():
  rolled_first_noise = 0
  for seed in range(40):
    plain = pre.random_spans_noise_mask(32, 0.25, np.random.default_rng(seed), 3)
    rolled = pre.random_spans_noise_mask(32, 0.25, np.random.default_rng(seed), 3,
                                         random_roll=True)
    assert not plain[0]  # without the roll a mask always starts with non-noise
    assert rolled.sum() == plain.sum() == 8
    # T5's test: the rolled mask is the plain one rolled by some offset.
    assert any((np.roll(plain, k) == rolled).all() for k in range(32))
    rolled_first_noise += int(rolled[0])
  assert rolled_first_noise > 0
  # T5's test_random_spans_noise_mask_with_roll_avg: the density holds on short masks.
  masked = total = 0
  for i in range(50):
    length = 16 + i % 3
    masked += pre.random_spans_noise_mask(length, 0.15, np.random.default_rng(i), 3,
                                          random_roll=True).sum()
    total += length
  assert abs(masked / total - 0.15) <= 0.01


def test_iid_and_prefix_masks():
  mask = pre.iid_noise_mask(10000, 0.3, np.random.default_rng(0))
  assert mask.shape == (10000,) and abs(mask.mean() - 0.3) < 0.02
  for seed in range(100):  # T5's test: length 10, density 0.5
    mask = pre.random_prefix_noise_mask(10, 0.5, np.random.default_rng(seed))
    assert mask[0] and not mask[-1]
  # T5 allows densities up to 0.5: at least round((1 - 2 * 0.25) * 9) = 4 noise tokens.
  sums = {int(pre.random_prefix_noise_mask(10, 0.25, np.random.default_rng(s)).sum())
          for s in range(200)}
  assert sums == set(range(4, 10))
  with pytest.raises(UserError, match="must not exceed 0.5"):
    pre.random_prefix_noise_mask(10, 0.6, np.random.default_rng(0))


def test_denoise_composes_masks_and_rng_taking_token_functions():
  features = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
  tokens = np.arange(100, 900)
  x = pre.denoise({"targets": tokens, "id": 7, "other": 1}, features, np.random.default_rng(3),
                  noise_density=0.25,
                  noise_mask_fn=functools.partial(pre.regular_noise_mask, min_span_length=2,
                                                  max_span_length=2),
                  inputs_fn=pre.noise_token_to_random_token, targets_fn=pre.drop_nonnoise_tokens,
                  passthrough_feature_keys=["id", "missing"])
  assert set(x) == {"inputs", "targets", "id"} and x["id"] == 7  # T5: absent keys are skipped
  assert len(x["inputs"]) == 800 and len(x["targets"]) == 200
  kept = x["inputs"] == tokens
  assert kept.sum() >= 600 and np.isin(x["targets"], tokens[~kept]).all()
  with pytest.raises(UserError, match="passthrough keys cannot contain 'inputs' or 'targets'"):
    pre.denoise({"targets": tokens}, features, np.random.default_rng(0), noise_density=0.15,
                noise_mask_fn=pre.random_spans_noise_mask, inputs_fn=pre.drop_noise_tokens,
                passthrough_feature_keys=["targets"])


def _run(steps, docs, features):
  """Runs expanded map / stream / flat_map steps over `docs`, as a task would."""
  examples = list(docs)
  for i, step in enumerate(steps):
    kind = pre.kind_of(step)
    rng = np.random.default_rng(i)
    if kind == "map":
      kwargs = pre.call_kwargs(step, {"rng": rng, "output_features": features})
      examples = [y for y in (step(x, **kwargs) for x in examples) if y is not None]
    elif kind == "stream":
      examples = list(step(iter(examples)))
    else:
      examples = [y for x in examples for y in step(x)]
  return examples


def test_span_corruption_passthrough_keys():
  # T5's test_span_corruption_passthrough: 100 examples of 1..99 with a passthrough list.
  features = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB), "passthrough": Feature(VOCAB)}
  lengths = {"inputs": 100, "targets": 100}
  steps = pre.expand([functools.partial(pre.span_corruption,
                                        merge_examples_to_reduce_padding=False,
                                        passthrough_feature_keys=["passthrough"])],
                     lengths, features)
  inp, pt = list(range(1, 100)), list(range(1, 20))
  out = _run(steps, [{"targets": inp, "passthrough": pt}] * 100, features)
  assert len(out) == 100
  for ex in out:
    assert set(ex) == {"inputs", "targets", "passthrough"}
    assert len(ex["inputs"]) <= len(inp) and ex["passthrough"] == pt
    assert (ex["inputs"] >= 999 - 20).any()  # corrupted: sentinels present
  # Merged examples have no one value to pass through (T5 raises too).
  with pytest.raises(UserError, match="merge_examples_to_reduce_padding=False"):
    pre.expand([functools.partial(pre.span_corruption, passthrough_feature_keys=["passthrough"])],
               lengths, features)
  with pytest.raises(UserError, match="cannot contain 'inputs' or 'targets'"):
    pre.expand([functools.partial(pre.span_corruption, merge_examples_to_reduce_padding=False,
                                  passthrough_feature_keys=["targets"])], lengths, features)
  # Without passthrough keys the output keys are T5's.
  out = _run(pre.expand([pre.span_corruption], lengths, features),
             [{"targets": inp, "passthrough": pt}] * 100, features)
  assert all(set(ex) == {"inputs", "targets"} for ex in out)


def test_span_corruption_reserved_for_packing():
  features = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
  plain = pre.expand([pre.span_corruption], {"inputs": 512, "targets": 114}, features)
  reserved = pre.expand([functools.partial(pre.span_corruption, reserved_for_packing=12)],
                        {"inputs": 512, "targets": 114}, features)
  # Windows are cut for inputs of 500: random_spans_helper(500, 0.15, 3.0).
  assert plain[2].keywords["max_tokens_per_segment"] == 568
  assert reserved[2].keywords["max_tokens_per_segment"] == \
      pre.random_spans_helper(500, 0.15, 3.0)[0]
