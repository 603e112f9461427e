"""UL2's mixture of denoisers: concrete arrays per denoiser, lengths,
the mixture rates, reproducibility by seed and across shard counts, bad configurations."""
import functools
import logging

import numpy as np
import pytest

from t5forge.data import preprocessors as pre
from t5forge.data import ul2
from t5forge.data.bundled_tasks import VOCABULARY
from t5forge.data.sources import InMemoryDataSource
from t5forge.data.tasks import Feature, TaskRegistry
from t5forge.data.vocab import PassThroughVocabulary
from t5forge.errors import UserError

# 100 ids, the last 10 extra ids: the first sentinel is 99, then 98, ... (T5's order).
VOCAB = PassThroughVocabulary(size=100, extra_ids=10)
FEATURES = {"inputs": Feature(VOCAB, add_eos=True, required=False),
            "targets": Feature(VOCAB, add_eos=True)}
# One-id mode tokens, so that the arrays below read easily: R -> 3, S -> 4, X -> 5.
MODES = {"R": 3, "S": 4, "X": 5}
MODE_IDS = {"R": (3,), "S": (4,), "X": (5,)}
TOKENS = np.arange(10, 30, dtype=np.int32)  # 20 distinct tokens, none a sentinel
R3, R8, S = ul2.Denoiser("R", 3.0, 0.15), ul2.Denoiser("R", 8.0, 0.15), ul2.Denoiser("S")
X3, X64 = ul2.Denoiser("X", 3.0, 0.5), ul2.Denoiser("X", 64.0, 0.15)


def _one(d, tokens=TOKENS, seed=0, window=None):
  """`tokens` through denoiser `d` alone, with the rng of example 0 of seed `seed`."""
  rng = np.random.Generator(np.random.Philox(key=np.array([seed, 0], np.uint64)))
  return ul2.denoise_mixture({"targets": tokens}, FEATURES, rng, denoisers=(d,), rates=(1.0,),
                             windows=(window or len(tokens),), mode_ids=(MODE_IDS[d.mode],))


def _reconstruct(inputs, targets, first_sentinel=90):
  """Fills each sentinel of the inputs with the tokens after it in the targets."""
  spans, current = {}, None
  for t in targets:
    if t >= first_sentinel:
      current = int(t)
      spans[current] = []
    else:
      spans[current].append(int(t))
  out = []
  for t in inputs:
    out.extend(spans[int(t)]) if t >= first_sentinel else out.append(int(t))
  return out


def _check_span_corruption(x, mode_id, n, density, mean_span):
  inputs, targets = x["inputs"], x["targets"]
  assert inputs.dtype == np.int32 and targets.dtype == np.int32
  assert inputs[0] == mode_id
  body = inputs[1:]
  num_noise = int(np.round(n * density))
  num_spans = max(1, int(np.round(num_noise / mean_span)))
  sentinels = 99 - np.arange(num_spans)  # descending from the last id, in order
  np.testing.assert_array_equal(body[body >= 90], sentinels)
  np.testing.assert_array_equal(targets[targets >= 90], sentinels)
  assert targets[0] == 99
  assert len(body) == n - num_noise + num_spans and len(targets) == num_noise + num_spans
  assert _reconstruct(body, targets) == list(range(10, 10 + n))


def test_r_denoiser_concrete_arrays():
  x = _one(R3)
  # 20 tokens, density 0.15: 3 noise tokens in round(3 / 3) = 1 span; T5's masks start
  # with a non-noise span, so a single span ends the window (no random_roll, as T5).
  np.testing.assert_array_equal(x["inputs"], [3, *range(10, 27), 99])
  np.testing.assert_array_equal(x["targets"], [99, 27, 28, 29])
  _check_span_corruption(x, 3, 20, 0.15, 3.0)
  _check_span_corruption(_one(R8, seed=1), 3, 20, 0.15, 8.0)


def test_x_denoiser_concrete_arrays():
  x = _one(X3)
  # density 0.5: 10 noise tokens in round(10 / 3) = 3 spans (1 + 6 + 3 tokens),
  # sentinels 99, 98, 97.
  np.testing.assert_array_equal(x["inputs"], [5, 10, 11, 99, 13, 14, 15, 98, 22, 23, 24, 25,
                                              26, 97])
  np.testing.assert_array_equal(x["targets"], [99, 12, 98, 16, 17, 18, 19, 20, 21, 97, 27, 28,
                                               29])
  _check_span_corruption(x, 5, 20, 0.5, 3.0)
  long = np.arange(10, 70, dtype=np.int32)
  x = _one(X64, tokens=long)  # 60 tokens at 0.15: 9 noise tokens, one span
  assert x["inputs"][0] == 5 and (x["inputs"] >= 90).sum() == 1 and len(x["targets"]) == 10


def test_s_denoiser_concrete_arrays():
  x = _one(S)
  # Prefix LM: inputs the mode token then a prefix, targets the rest.
  np.testing.assert_array_equal(x["inputs"], [4, *range(10, 22)])
  np.testing.assert_array_equal(x["targets"], range(22, 30))
  seen = set()
  for seed in range(30):
    x = _one(S, seed=seed)
    assert x["inputs"][0] == 4
    assert x["inputs"][1:].tolist() + x["targets"].tolist() == TOKENS.tolist()
    assert 1 <= len(x["targets"]) <= 19
    seen.add(len(x["targets"]))
  assert len(seen) > 8  # the split point is random


def test_a_longer_example_gives_a_random_window_of_the_denoisers_length():
  tokens = np.arange(10, 50, dtype=np.int32)  # 40 tokens, window 20
  starts = set()
  for seed in range(10):
    x = _one(S, tokens=tokens, seed=seed, window=20)
    kept = x["inputs"][1:].tolist() + x["targets"].tolist()
    assert len(kept) == 20 and kept == list(range(kept[0], kept[0] + 20))
    starts.add(kept[0])
  assert len(starts) > 3


def _steps(lengths, features=FEATURES, **kwargs):
  kwargs.setdefault("mode_tokens", MODES)
  return pre.expand([functools.partial(ul2.ul2_objective, **kwargs), pre.append_eos_after_trim],
                    lengths, features)


def test_windows_fit_the_lengths_like_t5s_span_corruption(caplog, monkeypatch):
  monkeypatch.setattr(ul2, "_WARNED", set())  # the warning is logged once per setting
  vocab = PassThroughVocabulary(size=2000, extra_ids=100)  # sentinels 1999 ... 1900
  features = {"inputs": Feature(vocab, add_eos=True, required=False),
              "targets": Feature(vocab, add_eos=True)}
  with caplog.at_level(logging.WARNING):
    steps = _steps({"inputs": 512, "targets": 512}, features=features)
  assert [pre.kind_of(p) for p in steps] == ["map", "stream", "flat_map", "map", "map"]
  windows = steps[3].keywords["windows"]
  # T5's arithmetic for inputs of 511 (one slot for the mode token): one token less than
  # T5's 568 for R(3, 0.15); S: a prefix of up to 510 tokens + mode + EOS.
  t5 = [pre.random_spans_helper(511, d.noise_density, d.mean_noise_span_length)[0]
        if d.mode != "S" else 511 for d in ul2.UL2_DENOISERS]
  assert windows == (567, 587, 511, 602, 907, 599, 1004)
  assert windows[:2] == tuple(t5[:2])
  # Each span window is the longest that fits: inputs 510 + EOS (+ the mode token), targets
  # 511 + EOS, at most 100 spans. T5's helper gives X(8, 0.5) 906 (its density-0.5
  # adjustment) and X(3, 0.5) 765 tokens, which would make 127 spans for 100 sentinels.
  for w, d in zip(windows, ul2.UL2_DENOISERS):
    if d.mode != "S":
      fits = lambda n: (lambda i, t, s: i <= 510 and t <= 511 and s <= 100)(
          *ul2.span_lengths(n, d))
      assert fits(w) and not fits(w + 1), d
  assert t5[3] == 765 and ul2.span_lengths(765, X3)[2] == 127
  assert "X(mean span 3, density 0.5): 602 of 765" in caplog.text and "R(" not in caplog.text
  assert steps[2].keywords["max_tokens_per_segment"] == max(windows)
  # Every denoiser's example fits 512/512 without trimming; span corruption fills the
  # inputs; every sentinel is an extra id, numbered down from the last id.
  long = {"targets": np.arange(3, 3 + max(windows))}
  for i, d in enumerate(ul2.UL2_DENOISERS):
    kwargs = dict(steps[3].keywords, rates=tuple(float(j == i) for j in range(7)))
    x = ul2.denoise_mixture(long, features, np.random.default_rng(i), **kwargs)
    assert x["inputs"][0] == MODES[d.mode]
    assert len(x["inputs"]) + 1 <= 512 and len(x["targets"]) + 1 <= 512, d
    if d.mode == "S":
      continue
    inputs, targets = x["inputs"][1:], x["targets"]
    spans = (targets >= 1900).sum()
    np.testing.assert_array_equal(targets[targets >= 1900], 1999 - np.arange(spans))
    np.testing.assert_array_equal(inputs[inputs >= 1900], 1999 - np.arange(spans))
    window = _reconstruct(inputs, targets, 1900)  # a random sub-window of its length
    assert window == list(range(window[0], window[0] + windows[i])), d
    if d.mode == "R":
      assert len(x["inputs"]) + 1 == 512, d


def test_a_short_targets_length_shortens_the_windows_it_must(caplog, monkeypatch):
  monkeypatch.setattr(ul2, "_WARNED", set())
  lengths = {"inputs": 64, "targets": 16}
  with caplog.at_level(logging.WARNING):
    steps = _steps(lengths)
  assert "raw windows shortened" in caplog.text and "X(mean span 3, density 0.5)" in caplog.text
  kwargs = steps[3].keywords
  window = {"targets": np.arange(10, 10 + max(kwargs["windows"])) % 80 + 10}
  for seed in range(200):  # every denoiser, many times: nothing is ever trimmed
    x = steps[3](window, output_features=FEATURES, rng=np.random.default_rng(seed))
    assert len(x["inputs"]) + 1 <= 64 and len(x["targets"]) + 1 <= 16


def _counts(rates, denoisers, n=2000, seed=0):
  steps = _steps({"inputs": 64, "targets": 64}, denoisers=denoisers, rates=rates)
  counts = {m: 0 for m in MODES.values()}
  window = {"targets": np.arange(10, 10 + max(steps[3].keywords["windows"])) % 80 + 10}
  for i in range(n):
    rng = np.random.Generator(np.random.Philox(key=np.array([seed, i], np.uint64)))
    counts[int(steps[3](window, output_features=FEATURES, rng=rng)["inputs"][0])] += 1
  return counts


def _within_binomial(count, n, p):
  return abs(count - n * p) <= 4 * np.sqrt(n * p * (1 - p))


def test_mixture_rates_over_2000_examples():
  counts = _counts([5, 2, 3], [("R", 3, 0.15), ("S",), ("X", 64, 0.5)])
  for mode_id, p in ((3, 0.5), (4, 0.2), (5, 0.3)):
    assert _within_binomial(counts[mode_id], 2000, p), counts
  # The default: the paper's seven denoisers, uniform: R 2/7, S 1/7, X 4/7.
  counts = _counts(None, None)
  for mode_id, p in ((3, 2 / 7), (4, 1 / 7), (5, 4 / 7)):
    assert _within_binomial(counts[mode_id], 2000, p), counts
  counts = _counts([0, 1, 0], [("R", 3, 0.15), ("S",), ("X", 64, 0.5)], n=200)
  assert counts == {3: 0, 4: 200, 5: 0}


@pytest.fixture
def tiny_task():
  """A task of 40 token documents through the UL2 objective (no cache)."""
  rng = np.random.default_rng(0)
  docs = [{"targets": rng.integers(10, 90, size=int(rng.integers(5, 60))).astype(np.int32)}
          for _ in range(40)]
  name = "test_ul2_tiny"
  TaskRegistry.add(name, InMemoryDataSource({"train": docs}),
                   preprocessors=[pre.CacheDatasetPlaceholder(),
                                  functools.partial(ul2.ul2_objective, mode_tokens=MODES),
                                  pre.append_eos_after_trim],
                   output_features=FEATURES, overwrite=True)
  yield TaskRegistry.get(name)
  TaskRegistry.remove(name)


def _examples(task, seed, shard_index=0, num_shards=1):
  ds = task.get_dataset({"inputs": 32, "targets": 32}, "train", shuffle=True, seed=seed,
                        shard_index=shard_index, num_shards=num_shards, num_epochs=2)
  return [(x["inputs"].tolist(), x["targets"].tolist()) for x in ds]


def test_reproducible_by_seed_and_across_shard_counts(tiny_task):
  one = _examples(tiny_task, seed=7)
  assert len(one) > 40 and len({x[0][0] for x in one}) == 3  # all three modes occur
  assert _examples(tiny_task, seed=7) == one
  assert _examples(tiny_task, seed=8) != one
  # 3 shards: shard i holds global examples i, i + 3, ...; together they are the 1-shard run.
  shards = [_examples(tiny_task, seed=7, shard_index=i, num_shards=3) for i in range(3)]
  merged = [None] * len(one)
  for i, shard in enumerate(shards):
    merged[i::3] = shard
  assert merged == one
  # The second epoch corrupts the same windows afresh.
  assert one[:len(one) // 2] != one[len(one) // 2:]


@pytest.mark.parametrize("kwargs, message", [
    (dict(rates=[0, 0, 0, 0, 0, 0, 0]), r"sum to 0.0; they must sum to a positive number"),
    (dict(rates=[1, -1, 1, 1, 1, 1, 1]), r"rates\[1\] = -1; each rate must be a finite"),
    (dict(rates=[1, 1]), r"rates must be a list of one number per denoiser \(7\)"),
    (dict(denoisers=[("R", 3, 0.15), ("Q", 3, 0.5)]), r"denoisers\[1\] has unknown denoiser "
     r"mode 'Q'; use 'R'"),
    (dict(denoisers=[("S", 3, 0.5)]), r"S-denoiser .* takes no mean_noise_span_length"),
    (dict(denoisers=[("X", 64)]), r"denoisers\[0\] \(X\) needs noise_density in \(0, 1\)"),
    (dict(denoisers=[]), r"denoisers is empty"),
    (dict(mode_tokens={"Y": "[Y]"}), r"mode_tokens has unknown mode 'Y'"),
])
def test_bad_configurations_are_one_line_errors(kwargs, message):
  with pytest.raises(UserError, match=message) as e:
    _steps({"inputs": 64, "targets": 64}, **kwargs)
  assert "\n" not in str(e.value)


def test_lengths_too_short_for_a_denoiser():
  # "[NLU]" is 6 ids of the bundled vocabulary: inputs of 7 leave no room.
  features = TaskRegistry.get("english_ul2").output_features
  with pytest.raises(UserError, match="the R.* denoiser .* has no room for a window") as e:
    pre.expand([ul2.ul2_objective], {"inputs": 7, "targets": 64}, features)
  assert "\n" not in str(e.value)


def test_bundled_task_uses_the_papers_mode_tokens():
  features = TaskRegistry.get("english_ul2").output_features
  steps = pre.expand(TaskRegistry.get("english_ul2").preprocessors,
                     {"inputs": 512, "targets": 512}, features)
  mixture = [p for p in steps if pre._name(p) == "denoise_mixture"][0].keywords
  want = {m: tuple(VOCABULARY.encode(t)) for m, t in ul2.MODE_TOKENS.items()}
  assert [ids for ids in mixture["mode_ids"]] == [want[d.mode] for d in ul2.UL2_DENOISERS]
  assert ul2.MODE_TOKENS == {"R": "[NLU]", "S": "[S2S]", "X": "[NLG]"}
  assert mixture["rates"] == (1 / 7,) * 7


def test_ul2_task_registers_a_copy_with_other_settings_for_gin():
  assert ul2.ul2_task("english_ul2") == "english_ul2"
  assert ul2.ul2_task("english_ul2", rates=[1] * 7) == "english_ul2"  # the task's own
  name = ul2.ul2_task("english_ul2", rates=[2, 2, 1, 1, 1, 1, 1], mode_tokens={"S": 4})
  assert name.startswith("english_ul2.ul2_")
  assert ul2.ul2_task("english_ul2", rates=[2, 2, 1, 1, 1, 1, 1], mode_tokens={"S": 4}) == name
  task = TaskRegistry.get(name)
  steps = pre.expand(task.preprocessors, {"inputs": 512, "targets": 512}, task.output_features)
  mixture = [p for p in steps if pre._name(p) == "denoise_mixture"][0].keywords
  np.testing.assert_allclose(mixture["rates"], np.array([2, 2, 1, 1, 1, 1, 1]) / 9)
  assert mixture["mode_ids"][2] == (4,)
  with pytest.raises(UserError, match="must be a task with one ul2_objective preprocessor"):
    ul2.ul2_task("english_span_corruption", rates=[1])
  with pytest.raises(UserError, match="unknown denoiser mode 'Q'"):
    ul2.ul2_task("english_ul2", denoisers=[("Q",)], rates=[1])
