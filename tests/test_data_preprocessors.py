"""Preprocessors: SeqIO's text/token helpers and T5's span corruption and prefix LM."""
import functools

import numpy as np
import pytest

from t5forge.data import preprocessors as pre
from t5forge.data.bundled_tasks import VOCABULARY
from t5forge.data.tasks import Feature
from t5forge.data.vocab import PassThroughVocabulary
from t5forge.errors import UserError

VOCAB = PassThroughVocabulary(size=32100, extra_ids=100)
FEATURES = {"inputs": Feature(VOCAB, required=False), "targets": Feature(VOCAB)}


def test_rekey_tokenize_append_eos():
  x = pre.rekey({"en": "In the beginning", "es": "En el principio", "id": 3},
                key_map={"inputs": "en", "targets": "es", "empty": None})
  assert x == {"inputs": "In the beginning", "targets": "En el principio", "empty": ""}
  features = {"inputs": Feature(VOCABULARY), "targets": Feature(VOCABULARY, add_eos=False)}
  t = pre.tokenize(x, features)
  assert t["inputs_pretokenized"] == "In the beginning"
  assert t["targets_pretokenized"] == "En el principio"
  assert t["inputs"].dtype == np.int32 and VOCABULARY.decode(t["inputs"]) == "In the beginning"
  assert t["empty"] == ""  # not an output feature: untouched
  e = pre.append_eos(t, features)
  assert e["inputs"][-1] == 1 and len(e["inputs"]) == len(t["inputs"]) + 1
  np.testing.assert_array_equal(e["targets"], t["targets"])  # add_eos=False
  with_eos = pre.tokenize_and_append_eos(x, features)
  assert with_eos["inputs"][-1] == 1 and with_eos["targets"][-1] != 1


def test_translate_and_summarize_prefixes():
  x = pre.translate({"en": "Hi.", "es": "Hola."}, source_language="en", target_language="es")
  assert x == {"inputs": "translate English to Spanish: Hi.", "targets": "Hola."}
  assert pre.translate({"de": "Das ist gut.", "en": "That is good."}, "de", "en")["inputs"] == \
      "translate German to English: Das ist gut."
  x = pre.summarize({"article": "Long text.", "highlights": "Short."}, "article", "highlights")
  assert x == {"inputs": "summarize: Long text.", "targets": "Short."}
  with pytest.raises(UserError, match="unknown language code 'xx'"):
    pre.translate({"xx": "a", "en": "b"}, "xx", "en")


def test_random_spans_helper_t5_arithmetic():
  assert pre.random_spans_helper(512, 0.15, 3.0, 1, 1) == (568, 114)
  # 141 raw tokens: 21 noise in 7 spans -> inputs 120 + 7 + 1 = 128, targets 21 + 7 + 1 = 29.
  assert pre.random_spans_helper(inputs_length=128, noise_density=0.15,
                                 mean_noise_span_length=3.0) == (141, 29)
  assert pre.random_spans_helper(1024, 0.15, 3.0) == (1137, 229)


def test_random_spans_noise_mask():
  rng = np.random.default_rng(0)
  for length in (2, 10, 100, 568):
    mask = pre.random_spans_noise_mask(length, 0.15, rng)
    num_noise = int(np.round(length * 0.15))
    assert mask.sum() == min(max(num_noise, 1), length - 1)
    assert not mask[0]  # spans alternate starting with non-noise
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    assert len(starts) == max(int(np.round(mask.sum() / 3.0)), 1)
  mask = pre.random_spans_noise_mask(568, 0.15, np.random.default_rng(1))
  assert mask.sum() == 85 and len(np.flatnonzero(np.diff(mask.astype(int)) == 1)) == 28
  # Deterministic for a given rng state; different for another one.
  a = pre.random_spans_noise_mask(100, 0.15, np.random.default_rng(7))
  b = pre.random_spans_noise_mask(100, 0.15, np.random.default_rng(7))
  c = pre.random_spans_noise_mask(100, 0.15, np.random.default_rng(8))
  assert (a == b).all() and not (a == c).all()


def test_unique_sentinels_on_a_fixed_mask():
  tokens = np.array([10, 11, 12, 13, 14, 15, 16, 17])
  mask = np.array([0, 1, 1, 0, 0, 1, 0, 1], bool)
  top = VOCAB.vocab_size - 1  # 32099 = <extra_id_0>
  inputs = pre.noise_span_to_unique_sentinel(tokens, mask, VOCAB)
  targets = pre.nonnoise_span_to_unique_sentinel(tokens, mask, VOCAB)
  np.testing.assert_array_equal(inputs, [10, top, 13, 14, top - 1, 16, top - 2])
  np.testing.assert_array_equal(targets, [top, 11, 12, top - 1, 15, top - 2, 17])


def _reconstruct(inputs, targets, vocab_size):
  """Fills every sentinel of the inputs with the tokens that follow it in the targets."""
  spans, current = {}, None
  for t in targets:
    if t >= vocab_size - 100:
      current = int(t)
      spans[current] = []
    else:
      spans[current].append(int(t))
  out = []
  for t in inputs:
    out.extend(spans.get(int(t), [])) if t >= vocab_size - 100 else out.append(int(t))
  return out


def test_span_corruption_end_to_end_lengths_noise_sentinels_and_reconstruction():
  steps = pre.expand([pre.span_corruption, pre.append_eos_after_trim],
                     {"inputs": 512, "targets": 114}, FEATURES)
  kinds = [pre.kind_of(p) for p in steps]
  assert kinds == ["map", "stream", "flat_map", "map", "map"]
  rng = np.random.default_rng(0)
  docs = [{"targets": np.arange(3, 3 + n) % 30000 + 3} for n in (1000, 300, 700)]
  chunked = [steps[0](d, rng=rng) for d in docs]
  concat = list(steps[1](iter(chunked)))
  assert len(concat) == 1 and len(concat[0]["targets"]) == 2000
  windows = [w for c in concat for w in steps[2](c)]
  assert [len(w["targets"]) for w in windows] == [568, 568, 568, 296]
  for w in windows[:3]:
    x = steps[3](w, output_features=FEATURES, rng=np.random.default_rng(5))
    x = steps[4](x, output_features=FEATURES, sequence_length={"inputs": 512, "targets": 114})
    assert len(x["inputs"]) == 512 and len(x["targets"]) == 114
    assert x["inputs"][-1] == 1 and x["targets"][-1] == 1
    inputs, targets = x["inputs"][:-1], x["targets"][:-1]
    sentinels_in = inputs[inputs >= VOCAB.vocab_size - 100]
    sentinels_out = targets[targets >= VOCAB.vocab_size - 100]
    # 28 spans, numbered down from the top of the vocabulary in order.
    np.testing.assert_array_equal(sentinels_in, 32099 - np.arange(28))
    np.testing.assert_array_equal(sentinels_out, 32099 - np.arange(28))
    assert targets[0] == 32099  # targets start with the first sentinel
    noise = len(targets) - len(sentinels_out)
    assert noise == 85 and abs(noise / 568 - 0.15) < 0.005
    assert _reconstruct(inputs, targets, VOCAB.vocab_size) == w["targets"].tolist()


def test_span_corruption_targets_too_short():
  with pytest.raises(UserError, match="set it to 114"):
    pre.expand([pre.span_corruption], {"inputs": 512, "targets": 100}, FEATURES)


def test_prefix_lm_splits_at_a_random_point():
  steps = pre.expand([pre.prefix_lm], {"inputs": 9, "targets": 9}, FEATURES)
  tokens = np.arange(10, 18)
  chunk = steps[0]({"targets": tokens}, rng=np.random.default_rng(0))
  windows = list(steps[1](chunk, sequence_length={"inputs": 9, "targets": 9},
                          output_features=FEATURES))
  assert [len(w["targets"]) for w in windows] == [8]  # 9 - 1 for EOS
  seen = set()
  for seed in range(20):
    x = steps[2](windows[0], output_features=FEATURES, rng=np.random.default_rng(seed))
    assert x["inputs"].tolist() + x["targets"].tolist() == tokens.tolist()
    assert 1 <= len(x["inputs"]) <= 7
    seen.add(len(x["inputs"]))
  assert len(seen) > 3


def test_select_random_chunk_split_tokens_reduce_concat():
  rng = np.random.default_rng(0)
  assert pre.select_random_chunk({"targets": []}, rng=rng, max_length=4) is None  # empty dropped
  chunk = pre.select_random_chunk({"targets": np.arange(10)}, rng=rng, max_length=4)["targets"]
  assert chunk.tolist() in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9])
  parts = list(pre.split_tokens({"targets": np.arange(7), "id": 5}, max_tokens_per_segment=3,
                                passthrough_feature_keys=["id"]))
  assert [p["targets"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
  assert all(p["id"] == 5 for p in parts)
  docs = [{"targets": [1, 2]}, {"targets": [3]}, {"targets": [4]}]
  merged = list(pre.reduce_concat_tokens(iter(docs), batch_size=2))
  assert [m["targets"].tolist() for m in merged] == [[1, 2, 3], [4]]


def test_call_kwargs_passes_only_what_a_function_takes():
  def f(x, sequence_length):
    return x
  part = functools.partial(pre.denoise, noise_density=0.5)
  avail = {"rng": 1, "sequence_length": 2, "output_features": 3}
  assert pre.call_kwargs(f, avail) == {"sequence_length": 2}
  assert set(pre.call_kwargs(part, avail)) == {"rng", "output_features"}
  assert pre.kind_of(functools.partial(pre.split_tokens, max_tokens_per_segment=3)) == "flat_map"
  assert pre.kind_of(pre.CacheDatasetPlaceholder()) == "placeholder"
