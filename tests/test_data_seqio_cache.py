"""SeqIO caches read without TensorFlow, against the cache that SeqIO 0.0.20's own
`cache_tasks_main` wrote (../shared/testdata/formats/seqio) and what SeqIO's
`get_dataset(use_cached=True)` yielded from it; and `use_cached`'s SeqIO semantics."""
import collections
import glob
import gzip
import json
import logging
import os
import shutil

import numpy as np
import pytest

from conftest import SHARED
from seqio_bible_task import register
from t5forge import data as seqio
from t5forge.cli import data_flags
from t5forge.data import records, seqio_cache
from t5forge.errors import UserError

FORMATS = os.path.join(SHARED, "testdata", "formats")
CACHE = os.path.join(FORMATS, "seqio", "seqio_cache")
EXPECTED = json.load(gzip.open(os.path.join(FORMATS, "seqio", "seqio_expected.json.gz")))


@pytest.fixture(autouse=True)
def isolated(cache, monkeypatch):
  seqio.set_global_cache_dirs([])
  yield
  seqio.set_global_cache_dirs([])
  for name in ("bible_cached", "no_placeholder", "needs_cache"):
    seqio.TaskRegistry.remove(name)


def _multiset(examples):
  def key(ex):
    return json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v)
                       for k, v in ex.items()}, sort_keys=True)
  return collections.Counter(key(ex) for ex in examples)


def _one_line(e) -> str:
  msg = str(e.value)
  assert "\n" not in msg
  return msg


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "validation"])
def test_cached_examples_are_what_seqio_yielded(split):
  task = register()
  seqio.add_global_cache_dirs([CACHE])
  cached = list(task.get_dataset(None, split, use_cached=True, shuffle=False))
  assert len(cached) == len(EXPECTED["examples"][split])
  assert _multiset(cached) == _multiset(EXPECTED["examples"][split])
  assert cached[0]["inputs"].dtype == np.int32 and isinstance(cached[0]["inputs_pretokenized"], str)
  # Our own run of the preprocessors on the TFDS source gives what SeqIO cached.
  fresh = list(task.get_dataset(None, split, shuffle=False))
  assert len(fresh) == EXPECTED["examples"][f"{split}_uncached_count"]
  assert _multiset(fresh) == _multiset(cached)


def test_cache_in_array_record_format(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  task_dir = tmp_path / "caches" / "bible_cached"
  shutil.copytree(os.path.join(CACHE, "bible_cached"), task_dir)
  for path in sorted(glob.glob(str(task_dir / "validation.tfrecord-*"))):
    shard = records.RecordFiles([path])
    writer = ArrayRecordWriter(path.replace(".tfrecord-", ".array_record-"), "group_size:1")
    for i in range(len(shard)):
      writer.write(shard.read(i))
    writer.close()
    os.chmod(path, 0o644)
    os.unlink(path)
  task = register()
  seqio.add_global_cache_dirs([str(tmp_path / "caches")])
  got = list(task.get_dataset(None, "validation", use_cached=True, shuffle=False))
  assert _multiset(got) == _multiset(EXPECTED["examples"]["validation"])


def test_the_flag_adds_cache_dirs_and_lengths_trim_after_the_cache():
  rest = data_flags.take(["--seqio_additional_cache_dirs", CACHE, "--other"])
  assert rest == ["--other"] and seqio.get_global_cache_dirs() == [CACHE]
  task = register()
  ds = task.get_dataset({"inputs": 16, "targets": 8}, "validation", use_cached=True,
                        shuffle=False)
  ex = next(iter(ds))
  assert len(ex["targets"]) == 8 and ex["targets"][-1] == 1  # EOS kept after the trim
  assert task.num_input_examples("validation") == 240


def test_use_cached_without_a_placeholder_reads_the_source(caplog):
  task = register("no_placeholder", placeholder=False)
  with caplog.at_level(logging.WARNING):
    ds = task.get_dataset(None, "validation", use_cached=True, shuffle=False)
  assert len(list(ds)) == 240 and "has no CacheDatasetPlaceholder" in caplog.text


def test_a_required_placeholder_needs_a_cache():
  task = register("needs_cache", required=True)
  with pytest.raises(UserError) as e:
    task.get_dataset(None, "validation", shuffle=False)
  assert "requires caching" in _one_line(e) and "use_cached=True" in str(e.value)


# --------------------------------------------------------------------------------- bad input


def test_no_cache_dirs_or_no_cache_of_the_task(tmp_path):
  task = register()
  with pytest.raises(UserError) as e:
    task.get_dataset(None, "validation", use_cached=True)
  assert "--seqio_additional_cache_dirs" in _one_line(e)
  seqio.add_global_cache_dirs([str(tmp_path)])
  with pytest.raises(UserError) as e:
    task.get_dataset(None, "validation", use_cached=True)
  assert "no SeqIO cache in" in _one_line(e) and "bible_cached/COMPLETED" in str(e.value)


def _copy_cache(tmp_path):
  d = tmp_path / "caches" / "bible_cached"
  shutil.copytree(os.path.join(CACHE, "bible_cached"), d)
  for p in d.iterdir():
    os.chmod(p, 0o644)
  seqio.add_global_cache_dirs([str(tmp_path / "caches")])
  return d


def test_a_cache_without_completed(tmp_path):
  d = _copy_cache(tmp_path)
  (d / "COMPLETED").unlink()
  with pytest.raises(UserError) as e:
    register().get_dataset(None, "validation", use_cached=True)
  msg = _one_line(e)
  assert "incomplete" in msg and "COMPLETED" in msg and str(d) in msg


def test_a_cache_whose_ids_do_not_fit_the_vocabulary(tmp_path):
  _copy_cache(tmp_path)
  small = seqio.ByteVocabulary()  # 259 ids; the cache holds SentencePiece ids up to ~1000
  with pytest.raises(UserError) as e:
    register(vocab=small).get_dataset(None, "validation", use_cached=True)
  msg = _one_line(e)
  assert "vocabulary has 259 ids" in msg and "another vocabulary" in msg and "record " in msg
  assert not list((tmp_path / "caches" / "bible_cached").glob(".*"))  # nothing beside it


def test_a_cache_missing_a_shard_or_a_split(tmp_path):
  d = _copy_cache(tmp_path)
  (d / "validation.tfrecord-00002-of-00003").unlink()
  with pytest.raises(UserError) as e:
    register().get_dataset(None, "validation", use_cached=True)
  assert "2 of the 3 'validation' shards" in _one_line(e)
  with pytest.raises(UserError) as e:
    register().get_dataset(None, "test", use_cached=True)
  assert "info.test.json: missing" in _one_line(e) and "train, validation" in str(e.value)


def test_a_cache_whose_count_differs_from_its_stats(tmp_path):
  d = _copy_cache(tmp_path)
  stats = json.loads((d / "stats.validation.json").read_text())
  stats["examples"] = 241
  (d / "stats.validation.json").write_text(json.dumps(stats))
  with pytest.raises(UserError) as e:
    register().get_dataset(None, "validation", use_cached=True)
  assert "hold 240 examples where stats.validation.json says 241" in _one_line(e)


def test_cache_dir_names_follow_seqio():
  assert seqio_cache.task_dir("a:b") == os.path.join("a", "b")
