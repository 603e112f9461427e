"""TfdsDataSource over prepared TFDS directories that TensorFlow Datasets 4.9.10 itself wrote
(../shared/testdata/formats/tfds_*), checked example by example against what
`builder.as_dataset` / `as_data_source` read back, for every split string listed there."""
import gzip
import json
import os
import shutil

import numpy as np
import pytest

from conftest import SHARED
from t5forge import data as seqio
from t5forge.data import tfds
from t5forge.errors import UserError

FORMATS = os.path.join(SHARED, "testdata", "formats")
EXPECTED = json.load(gzip.open(os.path.join(FORMATS, "expected.json.gz")))
NAME = "bible_verses/en_es:1.0.0"


@pytest.fixture(autouse=True)
def isolated(tmp_path, cache, monkeypatch):
  monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  seqio.set_tfds_data_dir_override(None)
  yield
  seqio.set_tfds_data_dir_override(None)


def _plain(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_plain(v) for v in x]
  return x


def _data_dir(fmt):
  return os.path.join(FORMATS, EXPECTED["tfds"][fmt]["data_dir"])


def _one_line(e) -> str:
  msg = str(e.value)
  assert "\n" not in msg
  return msg


@pytest.mark.parametrize("fmt", ["tfrecord", "array_record"])
@pytest.mark.parametrize("split", list(EXPECTED["tfds"]["tfrecord"]["examples"]))
def test_every_split_string_gives_tfds_examples(fmt, split):
  want = EXPECTED["tfds"][fmt]["examples"][split]
  source = seqio.TfdsDataSource(NAME, tfds_data_dir=_data_dir(fmt), splits={"x": split})
  assert source.num_input_examples("x") == len(want)  # from shardLengths, before any read
  assert not source._built
  got = source.get("x")
  assert [_plain(got[i]) for i in range(len(got))] == want


def test_types_of_decoded_features():
  ex = seqio.TfdsDataSource(NAME, tfds_data_dir=_data_dir("tfrecord")).get("train")[0]
  assert isinstance(ex["translation"]["en"], str) and isinstance(ex["length"], int)
  assert isinstance(ex["num_words"], int) and isinstance(ex["words"], list)
  assert isinstance(ex["id"], str)


def test_all_splits_counts_and_label_names():
  source = seqio.TfdsDataSource(NAME, tfds_data_dir=_data_dir("tfrecord"))
  assert source.splits == ("train", "validation")
  for split, n in EXPECTED["tfds"]["tfrecord"]["num_examples"].items():
    assert source.num_input_examples(split) == n
  assert source.label_names == {"length": ["short", "medium", "long"]}
  assert source.get("train").label_names["length"][1] == "medium"
  everything = seqio.TfdsDataSource(NAME, tfds_data_dir=_data_dir("tfrecord"), splits={"x": "all"})
  assert everything.num_input_examples("x") == 2640


def test_where_the_dataset_is_found(tmp_path, monkeypatch):
  data_dir = _data_dir("tfrecord")
  # The override (T5X's --tfds_data_dir), then $TFDS_DATA_DIR, then ~/tensorflow_datasets.
  seqio.set_tfds_data_dir_override(data_dir)
  assert seqio.TfdsDataSource(NAME).num_input_examples("train") == 2400
  seqio.set_tfds_data_dir_override(None)
  monkeypatch.setenv("TFDS_DATA_DIR", data_dir)
  assert tfds.find_dataset(NAME) == os.path.join(data_dir, "bible_verses", "en_es", "1.0.0")
  monkeypatch.delenv("TFDS_DATA_DIR")
  home = tmp_path / "home" / "tensorflow_datasets"
  shutil.copytree(data_dir, home)
  assert tfds.find_dataset(NAME).startswith(str(home))
  # The source's own tfds_data_dir comes first.
  seqio.set_tfds_data_dir_override(str(tmp_path / "elsewhere"))
  assert tfds.find_dataset(NAME, _data_dir("array_record")).startswith(_data_dir("array_record"))


def test_wildcard_versions_take_the_highest(tmp_path):
  root = tmp_path / "d"
  for v in ("1.0.0", "1.2.0", "2.0.0"):
    shutil.copytree(os.path.join(_data_dir("tfrecord"), "bible_verses", "en_es", "1.0.0"),
                    root / "bible_verses" / "en_es" / v)
  assert tfds.find_dataset("bible_verses/en_es:1.*.*", str(root)).endswith("1.2.0")
  assert tfds.find_dataset("bible_verses/en_es:*.*.*", str(root)).endswith("2.0.0")
  # No config named: the only config present (TFDS: .config/metadata.json's default).
  assert tfds.find_dataset("bible_verses:1.0.0", str(root)).endswith(
      os.path.join("en_es", "1.0.0"))


def test_a_version_directory_read_directly():
  directory = os.path.join(_data_dir("array_record"), "bible_verses", "en_es", "1.0.0")
  source = seqio.TfdsDataSource(tfds_data_dir=directory, splits=["validation"])
  assert source.get("validation")[0]["id"] == EXPECTED["tfds"]["array_record"]["examples"][
      "validation"][0]["id"]
  other = seqio.TfdsDataSource(splits={"train": seqio.TfdsSplit(NAME, "train[:5]",
                                                                _data_dir("tfrecord"))})
  assert len(other.get("train")) == 5
  assert other.label_names == {"length": ["short", "medium", "long"]}


# --------------------------------------------------------------------------------- bad input


def test_name_without_a_version():
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource("bible_verses/en_es")
  assert "has no version" in _one_line(e) and "bible_verses/en_es:1.0.0" in str(e.value)


@pytest.mark.parametrize("name", ["bible_verses/de_en:1.0.0", "bible_verses/en_es:2.0.0",
                                  "bible_versez/en_es:1.0.0"])
def test_unknown_config_or_version_lists_what_exists(name):
  source = seqio.TfdsDataSource(name, tfds_data_dir=_data_dir("tfrecord"))
  with pytest.raises(UserError) as e:
    source.get("train")
  msg = _one_line(e)
  assert "is not prepared in" in msg and _data_dir("tfrecord") in msg and "tfds build" in msg
  if "versez" not in name:
    assert "bible_verses/en_es:1.0.0" in msg  # what is there


@pytest.mark.parametrize("split,needle", [
    ("test", "no split 'test'"), ("train[:10", "not a TFDS split"),
    ("train[1:2:3]", "malformed slice"), ("train[5]", "only for shards"),
    ("train[:101%]", "[-100, 100]"), ("train[:3000]", "outside the 2400")])
def test_bad_split_strings(split, needle):
  source = seqio.TfdsDataSource(NAME, tfds_data_dir=_data_dir("tfrecord"), splits={"x": split})
  with pytest.raises(UserError) as e:
    source.get("x")
  assert needle in _one_line(e)


def _copy_version(tmp_path, fmt="tfrecord"):
  src = os.path.join(_data_dir(fmt), "bible_verses", "en_es", "1.0.0")
  dst = tmp_path / "copy" / "bible_verses" / "en_es" / "1.0.0"
  shutil.copytree(src, dst)
  for p in dst.iterdir():
    os.chmod(p, 0o644)
  return dst


def test_a_missing_shard(tmp_path):
  d = _copy_version(tmp_path)
  (d / "bible_verses-train.tfrecord-00001-of-00003").unlink()
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, tfds_data_dir=str(tmp_path / "copy")).get("train")
  assert "shard missing" in _one_line(e) and "00001-of-00003" in str(e.value)
  # A slice that needs only shard 0 still reads.
  src = seqio.TfdsDataSource(NAME, tfds_data_dir=str(tmp_path / "copy"), splits={"x": "train[:10]"})
  assert len(src.get("x")) == 10


@pytest.mark.parametrize("fmt", ["tfrecord", "array_record"])
def test_a_shard_with_another_record_count(tmp_path, fmt):
  d = _copy_version(tmp_path, fmt)
  info = json.loads((d / "dataset_info.json").read_text())
  info["splits"][1]["shardLengths"][0] = "81"
  (d / "dataset_info.json").write_text(json.dumps(info))
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, tfds_data_dir=str(tmp_path / "copy")).get("validation")
  assert "holds 80 records where 81 are recorded" in _one_line(e)


def test_unsupported_file_format(tmp_path):
  d = _copy_version(tmp_path)
  info = json.loads((d / "dataset_info.json").read_text())
  info["fileFormat"] = "parquet"
  (d / "dataset_info.json").write_text(json.dumps(info))
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, tfds_data_dir=str(tmp_path / "copy")).get("train")
  assert "fileFormat 'parquet' is not supported" in _one_line(e)


@pytest.mark.parametrize("name,content,needle", [
    ("dataset_info.json", None, "dataset_info.json: missing"),
    ("dataset_info.json", "{not json", "not valid JSON"),
    ("dataset_info.json", '{"name": "x"}', "missing or invalid field"),
    ("features.json", None, "features.json: missing"),
    ("features.json", '{"pythonClassName": "x.Image", "image": {}}', "is a TFDS Image"),
    ("features.json", "[1, 2", "not valid JSON")])
def test_missing_or_invalid_metadata(tmp_path, name, content, needle):
  d = _copy_version(tmp_path)
  if content is None:
    (d / name).unlink()
  else:
    (d / name).write_text(content)
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, tfds_data_dir=str(tmp_path / "copy")).get("train")
  assert needle in _one_line(e)


def test_arguments_that_would_prepare_data_are_refused():
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, tfds_builder_kwargs={"download_config": None})
  assert "never does" in _one_line(e)
  with pytest.raises(UserError) as e:
    seqio.TfdsDataSource(NAME, decoders={"image": object()})
  assert "remove decoders" in _one_line(e)
  ok = seqio.TfdsDataSource("bible_verses:1.0.0", tfds_data_dir=_data_dir("array_record"),
                            tfds_builder_kwargs={"config": "en_es", "file_format": "array_record"})
  assert ok.num_input_examples("validation") == 240
  wrong = seqio.TfdsDataSource(NAME, tfds_data_dir=_data_dir("tfrecord"),
                               tfds_builder_kwargs={"file_format": "array_record"})
  with pytest.raises(UserError) as e:
    wrong.get("train")
  assert "prepared as tfrecord" in _one_line(e)
