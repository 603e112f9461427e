"""The Grain pipeline: batches, exact resumption (also in a new process), sharding, eval batches."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import t5forge.data as data
from t5forge.data.tasks import Feature, TaskRegistry
from t5forge.data.vocab import PassThroughVocabulary
from t5forge.errors import UserError

VOCAB = PassThroughVocabulary(5000)
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
BIBLE = "bible_translate_en_es"
BIBLE_LENGTHS = {"inputs": 64, "targets": 64}


pytestmark = pytest.mark.usefixtures("shared_cache")


def _id_task(name, n):
  """Example i: inputs [100 + i], targets [100 + i, 7, 1]; ids are recoverable from any row."""
  TaskRegistry.remove(name)
  examples = [{"inputs": [100 + i], "targets": [100 + i, 7, 1]} for i in range(n)]
  source = data.InMemoryDataSource({"train": examples, "validation": examples[:n // 2]})
  TaskRegistry.add(name, source, output_features=FEATURES,
                   metric_fns=[lambda targets, predictions: {"n": len(predictions)}])


def _equal(a, b):
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_batch_shapes_for_each_model_kind():
  it = data.get_batches(BIBLE, {"inputs": 128, "targets": 96}, batch_size=4, seed=0)
  b = next(it)
  assert {k: v.shape for k, v in b.items()} == {
      "encoder_input_tokens": (4, 128), "encoder_segment_ids": (4, 128),
      "encoder_positions": (4, 128), "decoder_input_tokens": (4, 96),
      "decoder_target_tokens": (4, 96), "decoder_loss_weights": (4, 96),
      "decoder_segment_ids": (4, 96), "decoder_positions": (4, 96)}
  assert all(v.dtype == np.int32 for v in b.values())
  assert (b["decoder_segment_ids"].max(axis=1) >= 2).all()  # several verses per row
  assert it.model_feature_lengths["encoder_input_tokens"] == 128
  lm = next(data.get_batches(BIBLE, {"inputs": None, "targets": 64}, batch_size=2,
                             model_kind="decoder_only"))
  assert set(lm) == {"decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights",
                     "decoder_segment_ids", "decoder_positions"}
  plm = next(data.get_batches(BIBLE, {"inputs": 64, "targets": 64}, batch_size=2,
                              model_kind="prefix_lm", pack=False))
  assert plm["decoder_causal_attention"].shape == (2, 128) and "decoder_segment_ids" not in plm


def test_state_round_trip_in_process_mid_window():
  kwargs = dict(batch_size=3, seed=5)
  it = data.get_batches(BIBLE, BIBLE_LENGTHS, **kwargs)
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  assert state["grain"]["emitted"] > 0  # inside a packing window
  expected = [next(it) for _ in range(3)]
  fresh = data.get_batches(BIBLE, BIBLE_LENGTHS, **kwargs)
  fresh.set_state(state)
  assert all(_equal(e, next(fresh)) for e in expected)
  other = data.get_batches(BIBLE, BIBLE_LENGTHS, batch_size=3, seed=6)
  with pytest.raises(UserError, match="different pipeline.*seed"):
    other.set_state(state)
  with pytest.raises(UserError, match="not a t5forge data iterator state"):
    other.set_state({"foo": 1})


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import t5forge.data as data
    state = json.load(open(sys.argv[1]))
    it = data.get_batches("bible_translate_en_es", {"inputs": 64, "targets": 64}, batch_size=4,
                          seed=11, shuffle=True)
    it.set_state(state)
    np.savez(sys.argv[2], **next(it))
""")


def test_resume_in_a_new_process_yields_the_next_batch(tmp_path):
  it = data.get_batches(BIBLE, BIBLE_LENGTHS, batch_size=4, seed=11, shuffle=True)
  for _ in range(5):
    next(it)
  (tmp_path / "state.json").write_text(json.dumps(it.get_state()))
  expected = next(it)  # what an uninterrupted run sees next
  args = [sys.executable, "-c", _CHILD, str(tmp_path / "state.json"), str(tmp_path / "next.npz")]
  res = subprocess.run(args, capture_output=True, text=True, timeout=120, env=dict(os.environ))
  assert res.returncode == 0, res.stderr
  got = dict(np.load(tmp_path / "next.npz"))
  assert _equal(expected, got)


def _ids_in(batch):
  tokens = batch["encoder_input_tokens"]
  return tokens[tokens >= 100].tolist()


@pytest.mark.parametrize("pack", [True, False])
def test_two_shards_cover_the_split_exactly_once_per_epoch(pack):
  _id_task("p_shards", 97)
  seen = []
  for k in (0, 1):
    it = data.get_batches("p_shards", {"inputs": 4, "targets": 8}, batch_size=3, pack=pack, seed=2,
                          shard_index=k, num_shards=2, num_epochs=2, drop_remainder=False)
    shard = [i for b in it for i in _ids_in(b)]
    seen.append(shard)
  assert not set(seen[0][:48]) & set(seen[1][:48])
  assert sorted(seen[0] + seen[1]) == sorted(list(range(100, 197)) * 2)


def test_unpacked_batches_and_end_of_data():
  _id_task("p_end", 10)
  it = data.get_batches("p_end", {"inputs": 2, "targets": 4}, batch_size=4, pack=False,
                        shuffle=False, num_epochs=1, drop_remainder=False)
  batches = list(it)
  assert [len(b["encoder_input_tokens"]) for b in batches] == [4, 4, 2]
  np.testing.assert_array_equal(batches[0]["encoder_input_tokens"],
                                [[100, 0], [101, 0], [102, 0], [103, 0]])
  np.testing.assert_array_equal(batches[0]["decoder_input_tokens"][0], [0, 100, 7, 1])
  dropped = data.get_batches("p_end", {"inputs": 2, "targets": 4}, batch_size=4, pack=False,
                             num_epochs=1)
  assert len(list(dropped)) == 2


def test_batches_from_a_mixture():
  _id_task("p_mix_a", 30)
  TaskRegistry.remove("p_mix_b")
  other = [{"inputs": [2000 + i], "targets": [2000 + i, 1]} for i in range(30)]
  TaskRegistry.add("p_mix_b", data.InMemoryDataSource({"train": other}), output_features=FEATURES)
  data.MixtureRegistry.remove("p_mix")
  data.MixtureRegistry.add("p_mix", [("p_mix_a", 1), ("p_mix_b", 1)])
  it = data.get_batches("p_mix", {"inputs": 4, "targets": 8}, batch_size=4, pack=False, seed=0)
  ids = [i for _ in range(10) for i in _ids_in(next(it))]
  assert sum(i >= 2000 for i in ids) == 20  # equal rates: half from each task


def test_grain_worker_processes_match_and_resume():
  kwargs = dict(batch_size=2, seed=1)
  plain = data.get_batches(BIBLE, BIBLE_LENGTHS, **kwargs)
  workers = data.get_batches(BIBLE, BIBLE_LENGTHS, num_workers=1, **kwargs)
  try:
    first = [next(workers) for _ in range(3)]
    assert all(_equal(a, next(plain)) for a in first)
    state = json.loads(json.dumps(workers.get_state()))
    expected = next(workers)
  finally:
    workers.close()
  resumed = data.get_batches(BIBLE, BIBLE_LENGTHS, num_workers=1, **kwargs)
  try:
    resumed.set_state(state)
    assert _equal(expected, next(resumed))
  finally:
    resumed.close()


def test_eval_batches_ordered_padded_and_sharded():
  _id_task("p_eval", 22)  # validation: 11 examples
  ev = data.get_eval_dataset("p_eval", {"inputs": 2, "targets": 4}, batch_size=4)
  assert ev.num_examples == 11 and len(ev) == 3
  batches = list(ev)
  last = batches[-1]
  np.testing.assert_array_equal(last["example_index"], [8, 9, 10, -1])
  np.testing.assert_array_equal(last["example_mask"], [1, 1, 1, 0])
  assert not last["encoder_input_tokens"][3].any() and not last["decoder_target_tokens"][3].any()
  order = [i for b in batches for i in b["example_index"] if i >= 0]
  assert order == list(range(11))
  assert [_ids_in(b) for b in batches][0] == [100, 101, 102, 103]
  assert ev.examples[3]["inputs"].tolist() == [103]
  # Sharded: every shard has the same number of batches; together they hold every example once.
  shards = [data.get_eval_dataset("p_eval", {"inputs": 2, "targets": 4}, batch_size=2,
                                  shard_index=k, num_shards=3) for k in range(3)]
  assert {len(s) for s in shards} == {2}
  got = sorted(int(i) for s in shards for b in s for i in b["example_index"] if i >= 0)
  assert got == list(range(11))
  with pytest.raises(UserError, match="no prediction for 1 of 11"):
    ev.compute_metrics({i: "x" for i in range(10)})
  assert ev.compute_metrics({i: "x" for i in range(11)}) == {"n": 11}


def test_eval_on_the_bible_keeps_pretokenized_text():
  ev = data.get_eval_dataset(BIBLE, {"inputs": 128, "targets": 128}, batch_size=64)
  assert ev.num_examples == 879 and len(ev) == 14
  first_input = ev.examples[0]["inputs_pretokenized"]
  assert first_input.startswith("translate English to Spanish: In the beginning")
  assert ev.targets[0] == ev.examples[0]["targets_pretokenized"]
  first = next(iter(ev))
  vocab = ev.task.output_features["targets"].vocabulary
  assert vocab.decode(first["decoder_target_tokens"][0]) == ev.examples[0]["targets_pretokenized"]
  perfect = ev.compute_metrics(dict(enumerate(ev.targets)))
  assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
  assert list(data.get_eval_datasets(BIBLE, {"inputs": 128, "targets": 128}, 64)) == [BIBLE]
