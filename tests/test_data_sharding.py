"""Every source, sharded over two simulated hosts: disjoint examples that together cover the
split; a saved iterator state restores the same next batch; resuming on changed data is
refused, naming the task and split (unless allowed), and data copied elsewhere resumes."""
import csv
import gzip
import json
import os
import shutil

import numpy as np
import pytest

from conftest import SHARED
from t5forge import data as seqio
from t5forge.data import preprocessors as pre
from t5forge.data import records, tf_example
from t5forge.errors import UserError

FORMATS = os.path.join(SHARED, "testdata", "formats")
HF = json.load(gzip.open(os.path.join(FORMATS, "expected.json.gz")))["hf"]
VOCAB = seqio.SentencePieceVocabulary(os.path.join(FORMATS, "seqio", "spiece.model"))
PAIRS = os.path.join(FORMATS, "tfrecord", "pairs.tfrecord-*-of-00002")
PAIR_DESC = {"inputs": seqio.FixedLenFeature([], "string"),
             "targets": seqio.FixedLenFeature([], "string")}


def from_translation(ex):
  return {"inputs": ex["translation"]["en"], "targets": ex["translation"]["es"]}


def from_pair(ex):
  return {"inputs": ex["inputs"], "targets": ex["targets"]}


def from_record(ex):
  return from_pair(tf_example.ExampleDecoder(PAIR_DESC)(ex["record"]))


def _array_record(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  path = str(tmp_path / "pairs.array_record")
  writer = ArrayRecordWriter(path, "group_size:1")
  src = records.RecordFiles(sorted(__import__("glob").glob(PAIRS)))
  for i in range(len(src)):
    writer.write(src.read(i))
  writer.close()
  return path


def _csv(tmp_path):
  path = tmp_path / "train.csv"
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(["en", "es"])
    for ex in HF["examples"]["train"]:
      w.writerow([ex["translation"]["en"], ex["translation"]["es"]])
  return str(path)


def _tsv(tmp_path):
  path = tmp_path / "train.tsv"
  path.write_text("".join(f"{ex['translation']['en']}\t{ex['translation']['es']}\n"
                          for ex in HF["examples"]["train"]), encoding="utf-8")
  return str(path)


def from_columns(ex):
  return {"inputs": ex["en"], "targets": ex["es"]}


# name -> (source factory(tmp_path), first preprocessor, split, use_cached)
SOURCES = {
    "tsv": (lambda t: seqio.TsvDataSource({"train": _tsv(t)}, field_names=("en", "es")),
            from_columns, "train", False),
    "tfexample": (lambda t: seqio.TFExampleDataSource({"train": PAIRS}, PAIR_DESC), from_pair,
                  "train", False),
    "tfrecord": (lambda t: seqio.TFRecordDataSource({"train": PAIRS}), from_record, "train", False),
    "array_record": (lambda t: seqio.ArrayRecordDataSource({"train": _array_record(t)}),
                     from_pair, "train", False),
    "tfds_tfrecord": (lambda t: seqio.TfdsDataSource(
        "bible_verses/en_es:1.0.0", tfds_data_dir=os.path.join(FORMATS, "tfds_tfrecord")),
        from_translation, "validation", False),
    "tfds_array_record": (lambda t: seqio.TfdsDataSource(
        "bible_verses/en_es:1.0.0", tfds_data_dir=os.path.join(FORMATS, "tfds_array_record")),
        from_translation, "validation", False),
    "seqio_cache": (lambda t: seqio.TfdsDataSource(
        "bible_verses/en_es:1.0.0", tfds_data_dir=os.path.join(FORMATS, "tfds_tfrecord")),
        None, "validation", True),
    "parquet": (lambda t: seqio.ParquetDataSource(
        {"train": os.path.join(FORMATS, "hf_parquet", "train.parquet")}), from_translation,
        "train", False),
    "save_to_disk": (lambda t: seqio.HfDataSource(os.path.join(FORMATS, "hf_save_to_disk")),
                     from_translation, "train", False),
    "csv": (lambda t: seqio.CsvDataSource({"train": _csv(t)}), from_columns, "train", False),
    "hf_hub": (lambda t: seqio.HfDataSource("t5forge-fixtures/bible-verses", name="en_es"),
               from_translation, "validation", False),
}


def to_cache_inputs(ex):
  return {"inputs": "translate English to Spanish: " + ex["translation"]["en"],
          "targets": ex["translation"]["es"]}


@pytest.fixture(autouse=True)
def isolated(cache, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", os.path.join(FORMATS, "hf_hub_cache"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  seqio.set_global_cache_dirs([os.path.join(FORMATS, "seqio", "seqio_cache")])
  yield
  seqio.set_global_cache_dirs([])
  for name in ["bible_cached", "resume_check"] + [f"shard_{k}" for k in SOURCES]:
    seqio.TaskRegistry.remove(name)


def _register(kind, tmp_path):
  make, first, split, cached = SOURCES[kind]
  name = "bible_cached" if cached else f"shard_{kind}"
  steps = ([to_cache_inputs, pre.tokenize, seqio.CacheDatasetPlaceholder()] if cached
           else [first, pre.tokenize])
  task = seqio.TaskRegistry.add(name, make(tmp_path), preprocessors=steps + [
      pre.append_eos_after_trim], output_features={"inputs": seqio.Feature(VOCAB),
                                                   "targets": seqio.Feature(VOCAB)},
      overwrite=True)
  return task, split, cached


def _key(ex):
  return ex["inputs_pretokenized"] + "\t" + ex["targets_pretokenized"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SOURCES))
def test_two_hosts_read_disjoint_examples_that_cover_the_split(kind, tmp_path):
  task, split, cached = _register(kind, tmp_path)
  everything = [_key(ex) for ex in task.get_dataset(None, split, cached, shuffle=False)]
  shards = [[_key(ex) for ex in task.get_dataset(None, split, cached, shuffle=True, seed=3,
                                                 shard_index=k, num_shards=2)]
            for k in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(everything)
  assert abs(len(shards[0]) - len(shards[1])) <= 1


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_saved_state_restores_the_same_next_batch(kind, tmp_path):
  task, split, cached = _register(kind, tmp_path)
  kwargs = dict(split=split, batch_size=4, seed=5, shard_index=1, num_shards=2,
                use_cached=cached)
  it = seqio.get_batches(task.name, {"inputs": 48, "targets": 48}, **kwargs)
  next(it), next(it)
  state = json.loads(json.dumps(it.get_state()))  # as the checkpoint stores it
  want = next(it)
  again = seqio.get_batches(task.name, {"inputs": 48, "targets": 48}, **kwargs)
  again.set_state(state)
  got = next(again)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  it.close(), again.close()


def test_resuming_on_changed_data_is_refused_naming_task_and_split(tmp_path):
  data_dir = tmp_path / "d"
  data_dir.mkdir()
  path = data_dir / "train.tsv"
  path.write_text(open(_tsv(tmp_path), encoding="utf-8").read(), encoding="utf-8")

  def register(tsv):
    seqio.TaskRegistry.add("resume_check", seqio.TsvDataSource({"train": str(tsv)},
                                                               field_names=("en", "es")),
                           preprocessors=[from_columns, pre.tokenize],
                           output_features={"inputs": seqio.Feature(VOCAB),
                                            "targets": seqio.Feature(VOCAB)}, overwrite=True)

  register(path)
  lengths = {"inputs": 48, "targets": 48}
  it = seqio.get_batches("resume_check", lengths, batch_size=4)
  next(it)
  state = it.get_state()
  want = next(it)
  # The same content elsewhere (copied, new mtime): resumes.
  moved = tmp_path / "moved"
  shutil.copytree(data_dir, moved)
  register(moved / "train.tsv")
  copy = seqio.get_batches("resume_check", lengths, batch_size=4)
  copy.set_state(state)
  np.testing.assert_array_equal(next(copy)["encoder_input_tokens"], want["encoder_input_tokens"])
  # Other data at the same path: refused in one line, unless allowed.
  lines = (moved / "train.tsv").read_text(encoding="utf-8").splitlines()
  (moved / "train.tsv").write_text("\n".join(lines[1:] + lines[:1]) + "\n", encoding="utf-8")
  # Same size: only the mtime tells the cached line index it is stale, and file times
  # tick in milliseconds; an edit by hand comes later than this.
  st = os.stat(moved / "train.tsv")
  os.utime(moved / "train.tsv", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  register(moved / "train.tsv")  # a new run registers its tasks anew
  changed = seqio.get_batches("resume_check", lengths, batch_size=4)
  with pytest.raises(UserError) as e:
    changed.set_state(state)
  msg = str(e.value)
  assert "\n" not in msg and "task 'resume_check' split 'train'" in msg
  assert "allow_changed_data=True" in msg
  changed.set_state(state, allow_changed_data=True)
  next(changed)
  # A state saved before states carried fingerprints resumes as before.
  old = json.loads(json.dumps(state))
  del old["pipeline"]["data"], old["pipeline"]["use_cached"]
  changed.set_state(old)
  for x in (it, copy, changed):
    x.close()
