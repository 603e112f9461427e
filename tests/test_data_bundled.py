"""The bundled tasks built from CPython (docstrings, help topics) and span corruption on them."""
import os

import numpy as np
import pytest

import t5forge.data as data
from t5forge.data import pycorpus

DOCS = "python_docstring_summarize"


pytestmark = pytest.mark.usefixtures("shared_cache")


@pytest.mark.slow
def test_docstring_task_examples_and_fixed_split():
  paths = pycorpus.docstring_split_files()
  assert paths == pycorpus.docstring_split_files()  # cached, same files
  lengths = {"inputs": 512, "targets": 64}
  train = data.get_dataset(DOCS, "train", lengths, shuffle=False)
  valid = data.get_dataset(DOCS, "validation", lengths, shuffle=False)
  assert len(train) > 1000 and 0.05 < len(valid) / (len(train) + len(valid)) < 0.15
  ex = train[0]
  assert ex["inputs_pretokenized"].startswith("summarize: ")
  assert "(" in ex["inputs_pretokenized"].split(":")[1]  # the signature comes first
  assert 3 <= len(ex["targets_pretokenized"].split()) <= 40
  assert ex["targets"][-1] == 1 and len(ex["inputs"]) <= 512
  source = data.get_mixture_or_task(DOCS).source
  names = {source.get(s)[i]["name"] for s, n in (("train", 300), ("validation", 30))
           for i in range(n)}
  assert len(names) == 330  # no function is in both splits (split by name hash)
  ev = data.get_eval_dataset(DOCS, lengths, batch_size=32)
  perfect = ev.compute_metrics(dict(enumerate(ev.targets)))
  assert set(perfect) == {"rouge1", "rouge2", "rougeLsum"}
  assert perfect["rouge1"] == pytest.approx(100.0)


@pytest.mark.slow
def test_english_span_corruption_task():
  lengths = {"inputs": 512, "targets": 114}
  ds = data.get_dataset("english_span_corruption", "train", lengths, seed=0)
  assert len(ds) > 2000
  vocab = data.bundled_tasks.VOCABULARY
  full = 0
  for i in range(20):
    ex = ds[i]
    assert len(ex["inputs"]) <= 512 and len(ex["targets"]) <= 114
    assert ex["inputs"][-1] == ex["targets"][-1] == 1
    if len(ex["inputs"]) == 512:  # a full 568-token window
      full += 1
      assert len(ex["targets"]) == 114
      assert ex["targets"][0] == vocab.sentinel_id(0)
      assert (ex["inputs"] >= 7900).sum() == 28
  assert full >= 15
  # Per-example randomness: another seed corrupts the same windows differently.
  other = data.get_dataset("english_span_corruption", "train", lengths, seed=1, shuffle=False)
  same = data.get_dataset("english_span_corruption", "train", lengths, seed=0, shuffle=False)
  assert not np.array_equal(other[0]["inputs"], same[0]["inputs"])
  # The offline stage (tokenize, concat, split to 568) was cached on disk.
  root = os.path.join(os.environ["T5FORGE_CACHE"], "tasks", "english_span_corruption")
  assert any(f.endswith(".array_record") for _, _, fs in os.walk(root) for f in fs)
  text = vocab.decode(same[0]["inputs"])
  assert "<extra_id_0>" in text and "<extra_id_1>" in text


def test_vocabulary_lookup_and_seqio_compat_names():
  inputs_vocab, targets_vocab = data.get_vocabulary("bible_translate_en_es")
  assert inputs_vocab == targets_vocab and targets_vocab.vocab_size == 8000
  ds = data.get_dataset("bible_translate_en_es", "validation", {"inputs": 32, "targets": 32},
                        seed=None, shard_info=data.ShardInfo(index=1, num_shards=2),
                        shuffle=False)
  assert len(ds) == 439
  assert ds[0]["inputs_pretokenized"].startswith("translate English to Spanish: ")
  assert data.preprocessors.parse_tsv({"text": "a\tb"}) == {"inputs": "a", "targets": "b"}
  assert data.preprocessors.preprocess_tsv("6,7,42", field_delim=",", num_fields=3,
                                           inputs_format="numerator: {2} denominator: {1}",
                                           targets_format="quotient: {0}") == {
      "inputs": "numerator: 42 denominator: 7", "targets": "quotient: 6"}
