"""`t5forge cache_tasks` against the cache that SeqIO 0.0.20's own `cache_tasks_main`
wrote of the same task (../shared/testdata/formats/seqio, --min_shards=2): the same
files, the same examples (every feature of every tf.train.Example, as a multiset: both
shuffle), the same info and stats; and `use_cached=True` reads what it wrote."""
import collections
import glob
import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import seqio_bible_task
from conftest import SHARED
from t5forge import data as seqio
from t5forge import storage
from t5forge.cli import main as cli_main
from t5forge.data import cache_tasks, records, tf_example
from t5forge.errors import UserError

SEQIO_CACHE = os.path.join(SHARED, "testdata", "formats", "seqio", "seqio_cache")
SEQIO_TASK_DIR = os.path.join(SEQIO_CACHE, "bible_cached")
EXPECTED = json.load(gzip.open(os.path.join(SHARED, "testdata", "formats", "seqio",
                                            "seqio_expected.json.gz")))
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _run_cli(argv):
  with pytest.raises(SystemExit) as e:
    cli_main.main(["cache_tasks", *argv])
  return e.value.code


@pytest.fixture(scope="module")
def written(shared_cache, tmp_path_factory):
  """Our cache of bible_cached, written once through the CLI (DirectRunner)."""
  seqio_bible_task.register()
  out = tmp_path_factory.mktemp("cache_tasks") / "out"
  code = _run_cli(["--module_import", "seqio_bible_task", "--tasks", "bible_cached",
                   "--output_cache_dir", str(out), "--min_shards", "2"])
  assert code == 0
  yield out
  seqio.TaskRegistry.remove("bible_cached")
  seqio.set_global_cache_dirs([])


def _examples(task_dir, split):
  """Every record of a split's shards as {feature: (kind, values)}, as a multiset."""
  paths = sorted(glob.glob(os.path.join(task_dir, f"{split}.tfrecord-*")))
  files = records.RecordFiles(paths, compression_type="")
  out = collections.Counter()
  for i in range(len(files)):
    msg = tf_example.parse(files.read(i))
    ex = {}
    for k, f in msg.features.feature.items():
      kind = f.WhichOneof("kind")
      ex[k] = (kind, list(getattr(f, kind).value) if kind else [])
    out[json.dumps(ex, sort_keys=True, default=repr)] += 1
  return out


def _multiset(examples):
  return collections.Counter(
      json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in ex.items()},
                 sort_keys=True) for ex in examples)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_the_cache_is_seqios(written, split):
  ours = os.path.join(written, "bible_cached")
  # The same files: 3 shards a split (the TFDS source's 3 files > --min_shards=2).
  assert sorted(os.listdir(ours)) == sorted(os.listdir(SEQIO_TASK_DIR))
  # The same examples, every feature (the ids, the *_pretokenized text), each as often.
  mine, seqios = _examples(ours, split), _examples(SEQIO_TASK_DIR, split)
  assert sum(mine.values()) == EXPECTED["examples"][f"{split}_uncached_count"]
  assert mine == seqios
  # info and stats byte for byte: no field differs (no path is stored; seqio_version is
  # the version whose layout this writes, 0.0.20, the fixture's).
  for name in (f"info.{split}.json", f"stats.{split}.json", "COMPLETED"):
    with open(os.path.join(ours, name), "rb") as a, open(os.path.join(SEQIO_TASK_DIR, name),
                                                         "rb") as b:
      assert a.read() == b.read(), name
  assert not [n for n in os.listdir(written) if n.startswith(".")]  # no staging left


@pytest.mark.parametrize("split", ["train", "validation"])
def test_use_cached_reads_it(written, split):
  task = seqio_bible_task.register()
  seqio.set_global_cache_dirs([str(written)])
  got = list(task.get_dataset(None, split, use_cached=True, shuffle=False))
  assert _multiset(got) == _multiset(EXPECTED["examples"][split])


def test_a_complete_cache_is_kept(written, capsys):
  before = os.stat(os.path.join(written, "bible_cached", "COMPLETED")).st_mtime_ns
  assert _run_cli(["--tasks", "bible_cached", "--output_cache_dir", str(written)]) == 0
  assert "cached in" in capsys.readouterr().out
  assert os.stat(os.path.join(written, "bible_cached", "COMPLETED")).st_mtime_ns == before


# ------------------------------------------------------------------------------ seeds


def _noisy_task(name):
  """A task with a random step before its placeholder: a random id appended."""
  def noise(ex, rng):
    return dict(ex, targets=np.append(ex["targets"], np.int32(rng.integers(3, 200))))

  vocab = seqio.ByteVocabulary()
  rows = [{"targets": f"row {i}"} for i in range(40)]
  return seqio.TaskRegistry.add(
      name, seqio.InMemoryDataSource({"train": rows}),
      preprocessors=[seqio.preprocessors.tokenize, noise, seqio.CacheDatasetPlaceholder()],
      output_features={"targets": seqio.Feature(vocab)}, overwrite=True)


@pytest.mark.slow  # four pipeline runs
def test_base_seed_makes_a_random_step_reproducible(tmp_path, shared_cache):
  try:
    _noisy_task("noisy_a")
    _noisy_task("noisy_b")

    def run(out, seed, pattern="noisy_.*"):
      cache_tasks.cache_tasks([pattern], str(tmp_path / out), min_shards=2, base_seed=seed)
      return {t: _examples(tmp_path / out / t, "train") for t in os.listdir(tmp_path / out)}

    first, again, other = run("1", 7), run("2", 7), run("3", 8, "noisy_a")
    assert first == again
    assert first["noisy_a"] != other["noisy_a"]
    assert first["noisy_a"] != first["noisy_b"]  # the task name is in the seed
    assert sorted(os.listdir(tmp_path / "1" / "noisy_a")) == [
        "COMPLETED", "info.train.json", "stats.train.json", "train.tfrecord-00000-of-00002",
        "train.tfrecord-00001-of-00002"]
    info = json.loads((tmp_path / "1" / "noisy_a" / "info.train.json").read_text())
    assert info["num_shards"] == 2 and info["features"]["targets"] == {
        "dtype": "int32", "shape": [None]}
  finally:
    seqio.TaskRegistry.remove("noisy_a")
    seqio.TaskRegistry.remove("noisy_b")


def test_seeds_are_seqios():
  # seqio.beam_utils: md5(name + "shard<i>") little-endian, plus the task seed
  # md5(name) + base_seed; reduced below 2**63 - 1 as SeqIO does.
  assert cache_tasks.task_seed("t", None) is None and cache_tasks.task_seed("t", -1) is None
  # md5's 16 bytes pass 2**63 - 1, so its first 7 bytes are taken (plus the task seed).
  digest = hashlib.md5(b"bible_cachedshard0").digest()
  assert cache_tasks.shard_seed("bible_cached", 0, None) == int.from_bytes(digest[:7], "little")
  seed = int.from_bytes(hashlib.md5(b"bible_cached").digest(), "little") + 5
  assert cache_tasks.task_seed("bible_cached", 5) == seed
  assert cache_tasks.shard_seed("bible_cached", 0, seed) == (
      (int.from_bytes(digest[:7], "little") + seed) % (2**63 - 1))
  assert 0 <= cache_tasks.shard_seed("t", 3, cache_tasks.task_seed("t", 5)) < 2**63 - 1


def test_ragged_features_are_written_with_row_lengths():
  data = tf_example.encode({"spans": [[1, 2], [3]], "ids": np.arange(4, dtype=np.int32)})
  feats = tf_example.parse(data).features.feature
  assert list(feats["spans"].int64_list.value) == [1, 2, 3]
  assert list(feats["_rl:0:spans"].int64_list.value) == [2, 1]
  assert cache_tasks.feature_info([[1, 2], [3]]) == {"dtype": "int32", "shape": [None, None]}
  assert cache_tasks.feature_info(np.zeros((3, 2), np.float32)) == {
      "dtype": "float32", "shape": [None, 2]}
  assert cache_tasks.feature_info("text") == {"dtype": "string", "shape": []}


# ------------------------------------------------------------------------------- bad input


def _one_line(e) -> str:
  msg = str(e.value)
  assert "\n" not in msg
  return msg


@pytest.fixture
def bible(cache):
  seqio_bible_task.register()
  seqio_bible_task.register("bible_no_placeholder", placeholder=False)
  yield
  for name in ("bible_cached", "bible_no_placeholder", "failing"):
    seqio.TaskRegistry.remove(name)


def test_unknown_task_or_regex(bible, tmp_path):
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["bible_cahced"], str(tmp_path))
  assert "unknown task 'bible_cahced'" in _one_line(e) and "bible_cached" in str(e.value)
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["nothing_.*"], str(tmp_path))
  assert "'nothing_.*' matches no registered task" in _one_line(e)
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["bible_no_placeholder"], str(tmp_path))
  assert "has no CacheDatasetPlaceholder" in _one_line(e)
  assert not os.listdir(tmp_path)


def test_bad_runner(bible, tmp_path):
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["bible_cached"], str(tmp_path), options="--runner=NoSuchRunner")
  assert "unknown Beam runner 'NoSuchRunner'" in _one_line(e)
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["bible_cached"], str(tmp_path), options="--direct_num_worker=2")
  assert "Beam has no option --direct_num_worker" in _one_line(e)
  assert not os.listdir(tmp_path)


def test_output_dir_not_writable_or_holding_an_incomplete_cache(bible, tmp_path):
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["bible_cached"], str(tmp_path / "a_file" / "out"))
  assert "--output_cache_dir" in _one_line(e) and "cannot write there" in str(e.value)
  (tmp_path / "out" / "bible_cached").mkdir(parents=True)
  (tmp_path / "out" / "bible_cached" / "train.tfrecord-00000-of-00003").write_text("")
  with pytest.raises(UserError) as e:
    cache_tasks.cache_tasks(["bible_cached"], str(tmp_path / "out"))
  assert "an incomplete cache" in _one_line(e) and "remove that directory" in str(e.value)


def test_the_cli_prints_one_line(bible, tmp_path, capsys):
  assert _run_cli(["--tasks", "no_such", "--output_cache_dir", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("t5forge: error: unknown task 'no_such'") and "\n" not in err


def _explode(ex):
  if ex["targets"] in ("row 7", "x"):
    raise RuntimeError("boom")
  return ex


def test_a_failed_run_leaves_nothing(bible, tmp_path):
  seqio.TaskRegistry.add(
      "failing", seqio.InMemoryDataSource({"train": [{"targets": f"row {i}"}
                                                     for i in range(10)]}),
      preprocessors=[_explode, seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder()],
      output_features={"targets": seqio.Feature(seqio.ByteVocabulary())})
  with pytest.raises(Exception, match="boom"):
    cache_tasks.cache_tasks(["failing"], str(tmp_path / "out"), min_shards=1)
  assert os.listdir(tmp_path / "out") == []  # no task directory, no staging directory


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_beam_is_imported_only_by_cache_tasks():
  code = ("import sys, t5forge, t5forge.data, t5forge.cli.main, t5forge.cli.cache_tasks; "
          "assert 'apache_beam' not in sys.modules, 'imported'; "
          "from t5forge.data import cache_tasks; assert 'apache_beam' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                 env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.slow
def test_multi_processing_gives_the_same_cache(tmp_path):
  """The CLI as a user runs it, with two DirectRunner worker processes: each imports the
  task module itself."""
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "-m", "t5forge", "cache_tasks", "--module_import", "seqio_bible_task",
       "--tasks", "bible_cached", "--output_cache_dir", str(out), "--min_shards=2",
       "--pipeline_options=--direct_num_workers=2 --direct_running_mode=multi_processing"],
      capture_output=True, text=True, timeout=400,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
               T5FORGE_CACHE=str(tmp_path / "cache")))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "cached task 'bible_cached'" in proc.stdout
  for split in ("train", "validation"):
    assert _examples(out / "bible_cached", split) == _examples(SEQIO_TASK_DIR, split)
    for name in (f"info.{split}.json", f"stats.{split}.json"):
      assert (out / "bible_cached" / name).read_text() == open(
          os.path.join(SEQIO_TASK_DIR, name)).read()


@pytest.mark.slow
def test_a_cache_in_a_bucket(bible, bucket_env, tmp_path):
  """Beam's GCS and S3 filesystems write the shards (to the emulators), COMPLETED last;
  the cache is read back from the bucket; a failed run leaves nothing there."""
  _, url = bucket_env
  out = f"{url}/caches"
  assert cache_tasks.cache_tasks(["bible_cached"], out, min_shards=2) == {
      "bible_cached": f"{out}/bible_cached"}
  seqio.set_global_cache_dirs([out])
  got = list(seqio.TaskRegistry.get("bible_cached").get_dataset(
      None, "validation", use_cached=True, shuffle=False))
  seqio.set_global_cache_dirs([])
  assert _multiset(got) == _multiset(EXPECTED["examples"]["validation"])
  assert storage.read_text(f"{out}/bible_cached/stats.train.json") == open(
      os.path.join(SEQIO_TASK_DIR, "stats.train.json")).read()
  seqio.TaskRegistry.add(
      "failing", seqio.InMemoryDataSource({"train": [{"targets": "x"}]}),
      preprocessors=[_explode, seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder()],
      output_features={"targets": seqio.Feature(seqio.ByteVocabulary())})
  with pytest.raises(Exception, match="boom"):
    cache_tasks.cache_tasks(["failing"], out, min_shards=1)
  assert sorted(storage.listdir(out)) == ["bible_cached"]


def test_input_shards_are_the_source_files():
  source = seqio.TfdsDataSource(
      "bible_verses/en_es:1.0.0", splits={"a": "train", "b": "train[500:1700]"},
      tfds_data_dir=os.path.join(SHARED, "testdata", "formats", "tfds_tfrecord"))
  whole = source.get("a").shards()
  assert len(whole) == 3 and whole[0][0] == 0 and whole[-1][1] == 2400
  assert all(a[1] == b[0] for a, b in zip(whole, whole[1:]))
  # A slice keeps the part of each file it covers.
  cut = source.get("b").shards()
  assert cut[0][0] == 0 and cut[-1][1] == 1200
  assert [hi - lo for lo, hi in cut] == [
      min(1700, hi) - max(500, lo) for lo, hi in whole if min(1700, hi) > max(500, lo)]
  assert seqio.InMemoryDataSource({"x": [{"a": 1}] * 5}).get("x").shards() == [(0, 5)]


def test_ragged_features_round_trip(tmp_path, cache):
  """A list of lists (ints, and text) is cached with SeqIO's row lengths and comes back
  from use_cached=True as the uncached run makes it."""
  def split_words(ex):
    words = ex["targets"].split()
    return dict(ex, words=[w.split("o") for w in words],
                spans=[list(range(len(w))) for w in words])

  rows = [{"targets": t} for t in ("one two", "go to town now", "o", "book of words")]
  task = seqio.TaskRegistry.add(
      "ragged", seqio.InMemoryDataSource({"train": rows}),
      preprocessors=[split_words, seqio.preprocessors.tokenize,
                     seqio.CacheDatasetPlaceholder()],
      output_features={"targets": seqio.Feature(seqio.ByteVocabulary())}, overwrite=True)
  try:
    cache_tasks.cache_tasks(["ragged"], str(tmp_path), min_shards=1)
    info = json.loads((tmp_path / "ragged" / "info.train.json").read_text())
    assert info["features"]["spans"] == {"dtype": "int32", "shape": [None, None]}
    assert info["features"]["words"] == {"dtype": "string", "shape": [None, None]}
    seqio.set_global_cache_dirs([str(tmp_path)])
    cached = list(task.get_dataset(None, "train", use_cached=True, shuffle=False))
    fresh = list(task.get_dataset(None, "train", shuffle=False))

    def plain(ex):
      return json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else
                             [r.tolist() if isinstance(r, np.ndarray) else r for r in v]
                             if isinstance(v, list) else v) for k, v in ex.items()},
                        sort_keys=True)
    assert sorted(map(plain, cached)) == sorted(map(plain, fresh))
  finally:
    seqio.set_global_cache_dirs([])
    seqio.TaskRegistry.remove("ragged")


@pytest.mark.slow
def test_t5forge_train_reads_the_cache(written, tmp_path):
  """T5X's way: USE_CACHED_TASKS = True and --seqio_additional_cache_dirs; two steps of
  the tiny model on what cache_tasks wrote (the task module is imported by the run)."""
  gin = tmp_path / "cached.gin"
  gin.write_text("\n".join([
      "include 'runs/pretrain.gin'", "include 'models/t5_1_1/tiny.gin'",
      "MIXTURE_OR_TASK_NAME = 'bible_cached'", "MIXTURE_OR_TASK_MODULE = 'seqio_bible_task'",
      "USE_CACHED_TASKS = True", "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 32}",
      "TRAIN_STEPS = 2", "BATCH_SIZE = 8", "DROPOUT_RATE = 0.0", "EVAL_PERIOD = 1000",
      "network.ModelConfig.vocab_size = 1000", "network.ModelConfig.dtype = 'float32'", ""]))
  proc = subprocess.run(
      [sys.executable, "-m", "t5forge", "train", f"--gin_file={gin}",
       f"--gin.MODEL_DIR='{tmp_path / 'model'}'", f"--seqio_additional_cache_dirs={written}"],
      capture_output=True, text=True, timeout=500, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS])))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "training stopped at step 2" in proc.stdout + proc.stderr
