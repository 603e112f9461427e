"""Data sources reading `gs://` and `s3://` buckets (real emulators on 127.0.0.1): the
fixtures of ../shared/testdata/formats (written by TFDS, TensorFlow, SeqIO and HF
`datasets`) uploaded to a bucket read the same examples as the local files and as what
those libraries read back; every object is downloaded once per version."""
import collections
import gzip
import json
import os
import pickle

import numpy as np
import pytest

from conftest import SHARED
from t5forge import data as seqio
from t5forge import storage
from t5forge.cli import data_flags
from t5forge.data import preprocessors as pre
from t5forge.data import seqio_cache, tfds, vocab_io
from t5forge.data.hf_datasets import HfDataSource
from t5forge.data.tabular import ArrowDataSource, CsvDataSource, ParquetDataSource
from t5forge.errors import UserError

FORMATS = os.path.join(SHARED, "testdata", "formats")
EXPECTED = json.load(gzip.open(os.path.join(FORMATS, "expected.json.gz")))
SEQIO_EXPECTED = json.load(gzip.open(os.path.join(FORMATS, "seqio", "seqio_expected.json.gz")))
NAME = "bible_verses/en_es:1.0.0"
TFRECORD = {"inputs": seqio.FixedLenFeature([], "string"),
            "targets": seqio.FixedLenFeature([], "string"),
            "weight": seqio.FixedLenFeature([], "float32"),
            "tags": seqio.VarLenFeature("int64")}


@pytest.fixture(autouse=True)
def isolated(cache, tmp_path, monkeypatch):
  monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  seqio.set_tfds_data_dir_override(None)
  seqio.set_global_cache_dirs([])
  yield
  seqio.set_tfds_data_dir_override(None)
  seqio.set_global_cache_dirs([])
  seqio.TaskRegistry.remove("bible_cached")


def _plain(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_plain(v) for v in x]
  return x


def _rows(src):
  return [_plain(src[i]) for i in range(len(src))]


def _upload(bucket: str, *names: str) -> None:
  for name in names:
    local = os.path.join(FORMATS, name)
    if os.path.isdir(local):
      storage.upload_tree(local, storage.join(bucket, name))
    else:
      storage.upload(local, storage.join(bucket, name))


def _copies(cache) -> dict:
  """Every file under the cache dir -> (inode, mtime_ns): a new download changes it."""
  out = {}
  for root, _, names in os.walk(cache):
    for n in names:
      st = os.stat(os.path.join(root, n))
      out[os.path.join(root, n)] = (st.st_ino, st.st_mtime_ns)
  return out


def _multiset(examples):
  return collections.Counter(
      json.dumps({k: _plain(v) for k, v in ex.items()}, sort_keys=True) for ex in examples)


def _to_pair(ex):
  return {"inputs": "translate English to Spanish: " + ex["translation"]["en"],
          "targets": ex["translation"]["es"]}


def test_tfds_dirs_seqio_cache_and_vocabulary_on_a_bucket(bucket_env, cache):
  emu, bucket = bucket_env
  _upload(bucket, "tfds_tfrecord", "tfds_array_record", "seqio")
  for fmt in ("tfrecord", "array_record"):
    data_dir = storage.join(bucket, EXPECTED["tfds"][fmt]["data_dir"])
    assert tfds.find_dataset(NAME, data_dir) == storage.join(data_dir, "bible_verses", "en_es",
                                                             "1.0.0")
    for split in ("train[3:17]", "validation", "train[:2%]+validation[:3]"):
      source = seqio.TfdsDataSource(NAME, tfds_data_dir=data_dir, splits={"x": split})
      assert _rows(source.get("x")) == EXPECTED["tfds"][fmt]["examples"][split], (fmt, split)
    assert seqio.TfdsDataSource(NAME, tfds_data_dir=data_dir).label_names == {
        "length": ["short", "medium", "long"]}
  # --tfds_data_dir=gs://... (the override T5X's flag sets), a wildcard version.
  data_flags.apply(storage.join(bucket, "tfds_tfrecord"), None)
  source = seqio.TfdsDataSource("bible_verses/en_es:1.*.*", splits={"v": "validation[1shard:]"})
  assert _rows(source.get("v")) == EXPECTED["tfds"]["tfrecord"]["examples"]["validation[1shard:]"]
  with pytest.raises(UserError, match=r"--tfds_data_dir=.*/nothing-here: no such directory"):
    data_flags.apply(storage.join(bucket, "nothing-here"), None)
  with pytest.raises(UserError, match=r"nope-missing-bucket: the bucket does not exist"):
    data_flags.apply(f"{emu.scheme}://nope-missing-bucket/tfds", None)
  # ArrayRecord shards named by a bucket pattern (ArrayRecordDataSource), as TFDS reads them.
  shards = storage.join(bucket, "tfds_array_record", "bible_verses", "en_es", "1.0.0",
                        "bible_verses-validation.array_record-*")
  remote_records = seqio.ArrayRecordDataSource({"v": shards}, decode="tf_example").get("v")
  local_records = seqio.ArrayRecordDataSource(
      {"v": os.path.join(FORMATS, "tfds_array_record", "bible_verses", "en_es", "1.0.0",
                         "bible_verses-validation.array_record-*")}, decode="tf_example").get("v")
  assert len(remote_records) == 240 and _rows(remote_records) == _rows(local_records)

  # The vocabulary, read from the bucket: the same ids as the local model; saved with a
  # checkpoint it travels as the same bytes.
  local_vocab = seqio.SentencePieceVocabulary(os.path.join(FORMATS, "seqio", "spiece.model"))
  vocab = seqio.SentencePieceVocabulary(storage.join(bucket, "seqio", "spiece.model"))
  assert vocab.path.startswith(f"{emu.scheme}://") and os.path.isfile(vocab.local_path)
  text = "In the beginning God created the heavens and the earth."
  assert vocab.encode(text) == local_vocab.encode(text) and vocab == local_vocab
  assert vocab_io.to_spec(vocab)["model_base64"] == vocab_io.to_spec(local_vocab)["model_base64"]
  assert vocab_io.difference(vocab, local_vocab) is None

  # A SeqIO cache on the bucket: found there (COMPLETED), read as SeqIO yielded it.
  data_flags.apply(None, storage.join(bucket, "seqio", "seqio_cache"))
  found = seqio_cache.find("bible_cached")
  assert found == storage.join(bucket, "seqio", "seqio_cache", "bible_cached")
  local_dir = os.path.join(FORMATS, "seqio", "seqio_cache", "bible_cached")
  remote_src = seqio_cache.CachedSplitSource(found, "validation")
  assert _rows(remote_src) == _rows(seqio_cache.CachedSplitSource(local_dir, "validation"))
  # A task with use_cached=True reads it as SeqIO's get_dataset(use_cached=True) did.
  task = seqio.TaskRegistry.add(
      "bible_cached", seqio.TfdsDataSource(NAME, tfds_data_dir=storage.join(bucket,
                                                                            "tfds_tfrecord")),
      preprocessors=[_to_pair, pre.tokenize, seqio.CacheDatasetPlaceholder(),
                     pre.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(vocab), "targets": seqio.Feature(vocab)},
      overwrite=True)
  seqio.set_global_cache_dirs([])
  seqio.add_global_cache_dirs([storage.join(bucket, "seqio", "seqio_cache")])
  got = list(task.get_dataset(None, "validation", use_cached=True, shuffle=False))
  assert _multiset(got) == _multiset(SEQIO_EXPECTED["examples"]["validation"])

  # Every shard read so far came down once: reading all of it again downloads nothing.
  before = _copies(cache / "buckets")
  assert before
  for fmt in ("tfrecord", "array_record"):
    data_dir = storage.join(bucket, EXPECTED["tfds"][fmt]["data_dir"])
    _rows(seqio.TfdsDataSource(NAME, tfds_data_dir=data_dir, splits={"x": "validation"}).get("x"))
  _rows(seqio_cache.CachedSplitSource(found, "validation"))
  assert _copies(cache / "buckets") == before


def test_tfrecord_parquet_and_save_to_disk_on_a_bucket(bucket_env, cache):
  emu, bucket = bucket_env
  _upload(bucket, "tfrecord", "hf_parquet", "hf_save_to_disk")
  want = EXPECTED["tfrecord"]["examples_in_file_order"]
  for name in ("pairs.tfrecord-*-of-00002", "pairs.tfrecord.gz-*-of-00002"):
    source = seqio.TFExampleDataSource({"train": storage.join(bucket, "tfrecord", name)},
                                       feature_description=TFRECORD)
    assert _rows(source.get("train")) == want
    assert source.get("train").describe().startswith(f"{emu.scheme}://")
  hf = EXPECTED["hf"]
  parquet = ParquetDataSource({s: storage.join(bucket, "hf_parquet", f"{s}.parquet")
                               for s in ("train", "validation")})
  local = ParquetDataSource({s: os.path.join(FORMATS, "hf_parquet", f"{s}.parquet")
                             for s in ("train", "validation")})
  for split in ("train", "validation"):
    assert _rows(parquet.get(split)) == hf["examples"][split] == _rows(local.get(split))
    assert parquet.get(split).label_names == hf["label_names"]
  arrow = ArrowDataSource({"train": storage.join(bucket, "hf_save_to_disk", "train",
                                                 "data-*.arrow")})
  assert _rows(arrow.get("train")) == hf["examples"]["train"]
  by_files = HfDataSource("parquet", data_files={
      "validation": storage.join(bucket, "hf_parquet", "valid*.parquet")})
  assert _rows(by_files.get("validation")) == hf["examples"]["validation"]
  saved = HfDataSource(storage.join(bucket, "hf_save_to_disk"))
  assert saved.splits == ("train", "validation")
  for split in saved.splits:
    assert _rows(saved.get(split)) == hf["examples"][split]
  # A second run (new sources, same cache dir) downloads and converts nothing again.
  before = _copies(cache)
  again = seqio.TFExampleDataSource(
      {"train": storage.join(bucket, "tfrecord", "pairs.tfrecord.gz-*-of-00002")},
      feature_description=TFRECORD)
  assert _rows(again.get("train")) == want
  assert _rows(ParquetDataSource({"train": storage.join(bucket, "hf_parquet", "train.parquet")})
               .get("train")) == hf["examples"]["train"]
  assert _rows(HfDataSource(storage.join(bucket, "hf_save_to_disk")).get("validation")) == \
      hf["examples"]["validation"]
  assert _copies(cache) == before


def test_text_tsv_jsonl_patterns_across_objects(bucket_env, cache, tmp_path):
  emu, bucket = bucket_env
  local = tmp_path / "local"
  local.mkdir()
  lines = {"a": ["first line", "", "second line"], "b": ["third line", "fourth line"]}
  for part, rows in lines.items():
    (local / f"text-{part}.txt").write_text("\n".join(rows) + "\n")
    (local / f"pairs-{part}.tsv").write_text("".join(f"{r}\tout {r}\n" for r in rows if r))
    with gzip.open(local / f"pairs-{part}.tsv.gz", "wt") as f:
      f.write("".join(f"{r}\tout {r}\n" for r in rows if r))
    (local / f"rows-{part}.jsonl").write_text(
        "".join(json.dumps({"text": r, "n": len(r)}) + "\n" for r in rows if r))
    (local / f"table-{part}.csv").write_text(
        "text,n\n" + "".join(f'"{r}, quoted",{len(r)}\n' for r in rows if r))
  storage.upload_tree(str(local), storage.join(bucket, "data"))
  remote = storage.join(bucket, "data")
  for make, pattern in [
      (lambda p: seqio.TextLineDataSource({"train": p}), "text-*.txt"),
      (lambda p: seqio.TsvDataSource({"train": p}), "pairs-*.tsv"),
      (lambda p: seqio.TsvDataSource({"train": p}), "pairs-*.tsv.gz"),
      (lambda p: seqio.JsonlDataSource({"train": p}), "rows-*.jsonl")]:
    got = _rows(make(storage.join(remote, pattern)).get("train"))
    assert got == _rows(make(str(local / pattern)).get("train")), pattern
    assert len(got) == 4
  csv_rows = _rows(CsvDataSource({"train": storage.join(remote, "table-*.csv")}).get("train"))
  assert csv_rows == _rows(CsvDataSource({"train": str(local / "table-*.csv")}).get("train"))
  assert csv_rows[0] == {"text": "first line, quoted", "n": 10}
  assert _rows(seqio.TextLineDataSource({"train": storage.join(remote, "text-*.txt")})
               .get("train"))[2] == {"text": "third line"}
  # A Grain worker gets the source pickled: it reopens the objects by URL.
  tsv = seqio.TsvDataSource({"train": storage.join(remote, "pairs-*.tsv.gz")}).get("train")
  assert _rows(pickle.loads(pickle.dumps(tsv))) == _rows(tsv)
  # Messages name the object, with its line number.
  storage.write_bytes(storage.join(remote, "bad.jsonl"), b'{"text": "ok"}\n{"text": \n')
  with pytest.raises(UserError, match=r"^\w+://[^ ]+/data/bad\.jsonl:2: invalid JSON"):
    seqio.JsonlDataSource({"train": storage.join(remote, "bad.jsonl")}).get("train")[1]
  # A rewritten object is a new version: read again, fingerprint changed.
  src = seqio.TextLineDataSource({"train": storage.join(remote, "text-b.txt")})
  fp = src.get("train").fingerprint()
  storage.write_bytes(storage.join(remote, "text-b.txt"), b"only line\n")
  src = seqio.TextLineDataSource({"train": storage.join(remote, "text-b.txt")})
  assert _rows(src.get("train")) == [{"text": "only line"}]
  assert src.get("train").fingerprint() != fp
  with pytest.raises(UserError, match=r"matched no objects"):
    seqio.TextLineDataSource({"train": storage.join(remote, "nope-*.txt")}).get("train")
  with pytest.raises(UserError, match=r"file not found: .*/data/absent.txt"):
    seqio.TextLineDataSource({"train": storage.join(remote, "absent.txt")}).get("train")


@pytest.mark.slow  # gcsfs retries each request 6 times inside every one of our 2 tries
def test_network_gone_mid_read_is_one_line_naming_the_object(private_bucket_env, cache, monkeypatch):
  emu, bucket = private_bucket_env
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", "2")
  _upload(bucket, "tfds_tfrecord")
  source = seqio.TfdsDataSource(NAME, tfds_data_dir=storage.join(bucket, "tfds_tfrecord"))
  assert source.num_input_examples("train") == 2400  # the metadata is read; no shard yet
  # Killed, not paused: a paused S3 emulator holds each request until botocore's read
  # timeout, minutes per try.
  emu.stop()
  with pytest.raises(UserError) as e:
    source.get("train")
  msg = str(e.value)
  assert "\n" not in msg and "failed after 2 tries" in msg, msg
  assert f"{bucket}/tfds_tfrecord/bible_verses/en_es/1.0.0/bible_verses-train.tfrecord-00000" \
      in msg, msg
  # Looking the dataset up while the network is gone says so; not "not prepared".
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", "1")
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, tfds_data_dir=storage.join(bucket, "tfds_tfrecord")
                         ).num_input_examples("train")
  msg = str(e.value)
  assert "\n" not in msg and "failed after 1 tries" in msg and "not prepared" not in msg, msg
  assert f"{bucket}/tfds_tfrecord/bible_verses" in msg, msg
