"""Task/Mixture registries and get_dataset: splits, shuffling, sharding, caching, errors."""
import collections
import functools

import numpy as np
import pytest

import t5forge.data as data
from t5forge.data import preprocessors as pre
from t5forge.data.tasks import Feature, MixtureRegistry, TaskRegistry
from t5forge.data.vocab import PassThroughVocabulary
from t5forge.errors import UserError

VOCAB = PassThroughVocabulary(1000)
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}


pytestmark = pytest.mark.usefixtures("shared_cache")


def _examples(n, offset=0):
  return [{"id": i + offset, "inputs": [10 + (i + offset) % 900, 1], "targets": [20 + i % 5, 1]}
          for i in range(n)]


def _add(name, n=20, preprocessors=(), **kwargs):
  TaskRegistry.remove(name)
  source = data.InMemoryDataSource({"train": _examples(n), "validation": _examples(5)})
  return TaskRegistry.add(name, source, preprocessors=preprocessors, output_features=FEATURES,
                          **kwargs)


LENGTHS = {"inputs": 8, "targets": 8}


def test_bundled_tasks_are_registered():
  for name in ("bible_translate_en_es", "python_docstring_summarize", "english_span_corruption"):
    task = data.get_mixture_or_task(name)
    assert set(task.splits) == {"train", "validation"}
  bible = data.get_mixture_or_task("bible_translate_en_es")
  assert bible.num_input_examples("train") == 30198
  assert bible.num_input_examples("validation") == 879
  ex = next(iter(data.get_dataset("bible_translate_en_es", "validation",
                                  {"inputs": 64, "targets": 64}, shuffle=False)))
  assert ex["inputs_pretokenized"].startswith("translate English to Spanish: ")
  vocab = bible.output_features["targets"].vocabulary
  assert vocab.decode(ex["targets"]) == ex["targets_pretokenized"]
  assert ex["targets"][-1] == 1 and ex["inputs"].dtype == np.int32
  assert [f.__name__ for f in bible.metric_fns] == ["bleu", "chrf"]


def test_unknown_name_suggests_close_names():
  with pytest.raises(UserError) as e:
    data.get_mixture_or_task("bible_translate_en_de")
  assert "did you mean 'bible_translate_en_es'" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(UserError, match="unknown task or mixture 'zzz'; registered: "):
    data.get_dataset("zzz", "train", LENGTHS)


def test_feature_without_a_length_is_named():
  _add("t_len")
  with pytest.raises(UserError) as e:
    data.get_dataset("t_len", "train", {"inputs": 8})
  assert "output feature 'targets'" in str(e.value) and "no length" in str(e.value)


def test_duplicate_name_and_missing_required_feature():
  _add("t_dup")
  with pytest.raises(UserError, match="already registered"):
    TaskRegistry.add("t_dup", data.InMemoryDataSource({"train": _examples(2)}),
                     output_features=FEATURES)
  _add("t_missing", preprocessors=[functools.partial(pre.rekey, key_map={"inputs": "inputs"})])
  with pytest.raises(UserError, match="feature 'targets' is missing after preprocessing"):
    data.get_dataset("t_missing", "train", LENGTHS)[0]


def test_trimming_and_unshuffled_order():
  key_map = {"inputs": "inputs", "targets": "targets", "id": "id"}
  _add("t_trim", preprocessors=[functools.partial(pre.rekey, key_map=key_map)])
  ds = data.get_dataset("t_trim", "train", {"inputs": 1, "targets": None}, shuffle=False)
  assert [ds[i]["id"] for i in range(len(ds))] == list(range(20))
  assert ds[3]["inputs"].tolist() == [13] and ds[3]["targets"].tolist() == [23, 1]


def _ids(ds):
  return [ex["id"] for ex in ds]


def test_shuffle_is_deterministic_and_differs_per_epoch():
  _add("t_shuffle", n=50)
  a = _ids(data.get_dataset("t_shuffle", "train", LENGTHS, seed=3, num_epochs=2))
  b = _ids(data.get_dataset("t_shuffle", "train", LENGTHS, seed=3, num_epochs=2))
  c = _ids(data.get_dataset("t_shuffle", "train", LENGTHS, seed=4, num_epochs=2))
  assert a == b and a != c
  assert sorted(a[:50]) == sorted(a[50:]) == list(range(50)) and a[:50] != a[50:]


@pytest.mark.parametrize("num_shards", [2, 3])
def test_shards_are_disjoint_and_cover_each_epoch_exactly_once(num_shards):
  n = 101
  _add("t_shard", n=n)
  shards = [_ids(data.get_dataset("t_shard", "train", LENGTHS, seed=1, shard_index=k,
                                  num_shards=num_shards, num_epochs=3))
            for k in range(num_shards)]
  # Shard k holds the global positions k, k + num_shards, ...: interleave them back.
  merged = [None] * (3 * n)
  for k, ids in enumerate(shards):
    merged[k::num_shards] = ids
  for epoch in range(3):
    assert sorted(merged[epoch * n:(epoch + 1) * n]) == list(range(n))
  assert merged == _ids(data.get_dataset("t_shard", "train", LENGTHS, seed=1, num_epochs=3))
  with pytest.raises(UserError, match="shard_index must be in"):
    data.get_dataset("t_shard", "train", LENGTHS, shard_index=2, num_shards=2)


def test_online_randomness_depends_on_seed_and_index_only():
  def noisy(x, rng):
    return dict(x, targets=[int(rng.integers(3, 999)), 1])

  _add("t_rng", n=30, preprocessors=[noisy])
  def targets_by_id(datasets):
    return {ex["id"]: ex["targets"].tolist() for ds in datasets for ex in ds}

  full = targets_by_id([data.get_dataset("t_rng", "train", LENGTHS, seed=9)])
  half = [data.get_dataset("t_rng", "train", LENGTHS, seed=9, shard_index=k, num_shards=2)
          for k in (0, 1)]
  assert targets_by_id(half) == full
  assert targets_by_id([data.get_dataset("t_rng", "train", LENGTHS, seed=10)]) != full


def test_filters_and_stream_preprocessors():
  def drop_odd(x):
    return x if x["id"] % 2 == 0 else None

  @pre.stream
  def pairs(examples):
    buf = []
    for ex in examples:
      buf.append(ex)
      if len(buf) == 2:
        yield {"id": buf[0]["id"], "inputs": [3, 1], "targets": [ex["targets"][0], 1]}
        buf = []

  _add("t_filter", n=20, preprocessors=[drop_odd, pairs])
  ds = data.get_dataset("t_filter", "train", LENGTHS, shuffle=False)
  assert _ids(ds) == [0, 4, 8, 12, 16]  # 10 even ids -> 5 pairs, materialised once
  _add("t_filter_online", n=6, preprocessors=[drop_odd])
  ds = data.get_dataset("t_filter_online", "train", LENGTHS, shuffle=False)
  assert len(ds) == 6 and ds[1] is None and _ids(ds) == [0, 2, 4]


calls = collections.Counter()


def _count(x, tag):
  calls[tag] += 1
  return x


def test_disk_cache_is_reused_until_the_preprocessors_change(tmp_path):
  def make(tag):
    steps = [functools.partial(_count, tag=tag), pre.CacheDatasetPlaceholder()]
    return _add("t_cache", n=10, preprocessors=steps, cache_dir=str(tmp_path))

  make("a")
  assert _ids(data.get_dataset("t_cache", "train", LENGTHS, shuffle=False)) == list(range(10))
  assert calls["a"] == 10
  make("a")  # a new Task object (as in a new process): reads the cache
  assert len(data.get_dataset("t_cache", "train", LENGTHS)) == 10 and calls["a"] == 10
  make("b")  # a changed preprocessor argument: a new fingerprint, recomputed
  data.get_dataset("t_cache", "train", LENGTHS)
  assert calls["b"] == 10
  assert len(list(tmp_path.glob("t_cache/*/train.array_record"))) == 2
  ex = data.get_dataset("t_cache", "train", LENGTHS, shuffle=False)[2]
  assert ex["inputs"].dtype == np.int32 and ex["id"] == 2
  # A closure has no stable identity (what it captured is invisible): never cached.
  _add("t_nocache", n=3, preprocessors=[lambda x: x, pre.CacheDatasetPlaceholder()],
       cache_dir=str(tmp_path))
  assert len(data.get_dataset("t_nocache", "train", LENGTHS)) == 3
  assert not list(tmp_path.glob("t_nocache/*"))


def test_mixture_rates_and_sharding():
  _add("mix_a", n=40)
  TaskRegistry.remove("mix_b")
  TaskRegistry.add("mix_b", data.InMemoryDataSource({"train": _examples(40, offset=1000)}),
                   output_features=FEATURES)
  MixtureRegistry.remove("mix_ab")
  MixtureRegistry.add("mix_ab", [("mix_a", 3), ("mix_b", lambda t: 1.0)])
  ds = data.get_dataset("mix_ab", "train", LENGTHS, seed=2, num_epochs=None)
  first = [ds[i]["id"] for i in range(400)]
  from_b = sum(i >= 1000 for i in first)
  assert from_b == 100  # exact 3:1 proportions
  shards = [data.get_dataset("mix_ab", "train", LENGTHS, seed=2, num_epochs=None, shard_index=k,
                             num_shards=2) for k in (0, 1)]
  assert [shards[i % 2][i // 2]["id"] for i in range(40)] == first[:40]
  with pytest.raises(UserError, match="did you mean one of .*'mix_ab'"):
    data.get_mixture_or_task("mix_ac")
  mixture = data.get_mixture_or_task("mix_ab")
  assert [t.name for t in mixture.tasks] == ["mix_a", "mix_b"]
  assert data.mixing_rate_num_examples(mixture.tasks[0]) == 40


def test_postprocess_and_metrics():
  def strip_prefix(text, example=None, is_target=False):
    return text.removeprefix("A: ")

  def exact(targets, predictions):
    return {"exact": 100.0 * np.mean([t == p for t, p in zip(targets, predictions)])}

  def scored(targets, scores):
    return {"mean_score": float(np.mean(scores))}

  task = _add("t_metrics", postprocess_fn=strip_prefix, metric_fns=[exact, scored])
  assert task.postprocess("A: yes", is_target=True) == "yes"
  assert task.predict_metric_fns == [exact] and task.score_metric_fns == [scored]
  assert task.compute_metrics(["yes", "no"], ["yes", "yes"]) == {"exact": 50.0}
