"""Hugging Face data: save_to_disk, Parquet, a Hub cache (offline), CSV, JSON lines.

The reference rows are what HF `datasets` 5.2.0 itself read back from the shared fixtures
(`load_from_disk`); no `datasets` here. Bad input must give one line naming the file,
split, column or flag and the fix.
"""
import csv
import gzip
import json
import os
import pickle
import shutil

import pytest

from conftest import SHARED
from t5forge.data import files, hf_datasets, tabular
from t5forge.data import preprocessors as pre
from t5forge.data.hf_datasets import HfDataSource
from t5forge.data.tabular import (ArrowDataSource, CsvDataSource, JsonTableDataSource,
                                  ParquetDataSource)
from t5forge.data.tasks import Feature, Task
from t5forge.data.vocab import ByteVocabulary
from t5forge.errors import UserError

FORMATS = os.path.join(SHARED, "testdata", "formats")
SAVED = os.path.join(FORMATS, "hf_save_to_disk")
PARQUET = {s: os.path.join(FORMATS, "hf_parquet", f"{s}.parquet") for s in ("train", "validation")}
HUB_CACHE = os.path.join(FORMATS, "hf_hub_cache")
REPO = "t5forge-fixtures/bible-verses"
SPLITS = ("train", "validation")


@pytest.fixture(scope="module")
def expected():
  with gzip.open(os.path.join(FORMATS, "expected.json.gz"), "rt", encoding="utf-8") as f:
    return json.load(f)["hf"]


pytestmark = pytest.mark.usefixtures("cache")


@pytest.fixture
def offline_hub(monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", HUB_CACHE)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _rows(src):
  return [src[i] for i in range(len(src))]


def _one_line(e: pytest.ExceptionInfo) -> str:
  msg = str(e.value)
  assert "\n" not in msg and msg
  return msg


def _flat(row):
  """A reference row as a CSV holds it: the Translation struct as two columns."""
  return {"id": row["id"], "en": row["translation"]["en"], "es": row["translation"]["es"],
          "length": row["length"]}


# ------------------------------------------------------------------------- the reference rows


def test_save_to_disk_matches_datasets(expected):
  source = HfDataSource(SAVED)
  assert source.splits == SPLITS
  for split in SPLITS:
    src = source.get(split)
    assert isinstance(src, tabular.ArrowSource)
    assert _rows(src) == expected["examples"][split]
    assert src.label_names == expected["label_names"]
  # The same files through the plain Arrow source: mapped in place, nothing in the cache.
  arrow = ArrowDataSource({"train": os.path.join(SAVED, "train", "data-*.arrow")})
  assert arrow.get("train")[599] == expected["examples"]["train"][599]


def test_parquet_matches_datasets(expected, cache):
  source = ParquetDataSource(PARQUET)
  for split in SPLITS:
    src = source.get(split)
    assert _rows(src) == expected["examples"][split]
    assert src.label_names == expected["label_names"]
  # Converted once into an uncompressed Arrow file in the cache dir, and nothing else.
  converted = os.listdir(cache / "tables")
  assert len(converted) == 2 and all(n.endswith(".parquet.arrow") for n in converted)


def test_hub_cache_offline_matches_datasets(expected, offline_hub):
  for source in (HfDataSource(REPO, "en_es"), HfDataSource(REPO)):  # the only config
    assert source.splits == SPLITS
    for split in SPLITS:
      src = source.get(split)
      assert _rows(src) == expected["examples"][split]
      assert src.label_names == expected["label_names"]
  renamed = HfDataSource(REPO, "en_es", splits={"eval": "validation"}, columns=["id"])
  assert renamed.splits == ("eval",)
  assert renamed.get("eval")[3] == {"id": expected["examples"]["validation"][3]["id"]}


def test_csv_written_by_python_csv_module(expected, tmp_path, monkeypatch):
  rows = {s: [_flat(r) for r in expected["examples"][s]] for s in SPLITS}
  rows["train"][5]["en"] = 'He said "stop", twice,\nthen left;\r\nthe end'  # quotes, commas, lines
  rows["validation"][0]["es"] = ""
  for split, name in (("train", "train.csv"), ("validation", "valid.csv")):
    with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
      writer = csv.DictWriter(f, fieldnames=["id", "en", "es", "length"])
      writer.writeheader()
      writer.writerows(rows[split])
  source = CsvDataSource({s: str(tmp_path / n) for s, n in (("train", "train.csv"),
                                                            ("validation", "valid.csv"))})
  for split in SPLITS:
    assert _rows(source.get(split)) == rows[split]
  # A directory of CSV files: the splits come from the file names, as HF infers them.
  hf = HfDataSource(str(tmp_path))
  assert hf.splits == SPLITS and _rows(hf.get("train")) == rows["train"]
  # load_dataset("csv", data_files=...): relative to the directory the source was made in.
  monkeypatch.chdir(tmp_path)
  builder = HfDataSource("csv", data_files={"validation": "valid.csv"})
  monkeypatch.chdir(FORMATS)
  assert _rows(builder.get("validation")) == rows["validation"]


def test_json_lines(expected, tmp_path):
  path = tmp_path / "validation.jsonl"
  path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                          for r in expected["examples"]["validation"]), encoding="utf-8")
  src = JsonTableDataSource({"validation": str(path)}).get("validation")
  assert _rows(src) == expected["examples"]["validation"]


def test_sharded_file_names_and_arrow_ipc_file(expected, tmp_path):
  import pyarrow as pa
  import pyarrow.feather as feather
  import pyarrow.parquet as pq
  data = tmp_path / "repo" / "data"
  data.mkdir(parents=True)
  shutil.copy(PARQUET["train"], data / "train-00000-of-00001.parquet")
  shutil.copy(PARQUET["validation"], data / "test-00000-of-00001.parquet")
  hf = HfDataSource(str(tmp_path / "repo"))
  assert hf.splits == ("train", "test")
  assert hf.get("test")[59] == expected["examples"]["validation"][59]
  # Feather v2 (the IPC file format), with types the fixtures lack: nulls, lists, binary,
  # dictionaries, and record batches that are slices of larger arrays.
  table = pa.table({
      "ids": pa.array([[1, 2], [], None, [3]], pa.list_(pa.int32())),
      "spans": pa.array([[{"a": 1, "b": "x"}], [], [None], [{"a": None, "b": "y"}]]),
      "flag": pa.array([True, None, False, True]),
      "score": pa.array([0.5, 1.5, None, -2.0], pa.float32()),
      "raw": pa.array([b"\x00", b"", None, b"zz"]),
      "tag": pa.array(["a", "b", "a", None]).dictionary_encode(),
      "big": pa.array(["x", "yy", None, "\u00e9"], pa.large_string()),
      "day": pa.array([0, 1, 2, 3], pa.int32()).cast(pa.date32()),
  })
  path = tmp_path / "t.feather"
  feather.write_feather(pa.concat_tables([table.slice(0, 1), table.slice(1)]), str(path),
                        compression="uncompressed")
  assert _rows(tabular.ArrowSource(str(path))) == table.to_pylist()
  pq.write_table(table, str(tmp_path / "t.parquet"), row_group_size=3)
  assert _rows(tabular.ParquetSource(str(tmp_path / "t.parquet"))) == table.to_pylist()


# ------------------------------------------------------------------- length, pickling, sharding


def test_num_input_examples_without_reading_rows(cache, offline_hub, monkeypatch):
  def no_conversion(*args):
    raise AssertionError("rows were read")

  monkeypatch.setattr(tabular.ParquetSource, "_convert", no_conversion)
  assert ParquetDataSource(PARQUET).num_input_examples("train") == 600
  hub = HfDataSource(REPO, "en_es")
  assert [hub.num_input_examples(s) for s in SPLITS] == [600, 60]
  assert not os.path.exists(cache / "tables")
  # Given counts are returned as given, without resolving the dataset at all.
  assert HfDataSource("nobody/nothing", num_input_examples={"train": 7}).num_input_examples(
      "train") == 7


def test_pickled_sources_reopen_their_files(expected, tmp_path):
  parquet = tabular.ParquetSource(PARQUET["validation"])
  arrow = tabular.ArrowSource(os.path.join(SAVED, "validation", "data-*.arrow"))
  for src in (parquet, arrow):
    src[0]  # mapped now: the maps must not travel
    clone = pickle.loads(pickle.dumps(src))
    assert clone.fingerprint() == src.fingerprint()
    assert clone[59] == expected["examples"]["validation"][59] == src[59]
  source = HfDataSource(SAVED, splits=["validation"])
  source.get("validation")[0]
  clone = pickle.loads(pickle.dumps(source))
  assert clone.get("validation")[1] == expected["examples"]["validation"][1]
  # The content fingerprint stays with the data when it moves; the location one does not.
  moved = tmp_path / "v.parquet"
  shutil.copy(PARQUET["validation"], moved)
  copy = tabular.ParquetSource(str(moved))
  assert copy.content_fingerprint() == parquet.content_fingerprint()
  assert copy.fingerprint() != parquet.fingerprint()
  assert str(moved) in copy.describe()


def _id_and_spanish(x):
  return {"inputs": x["id"], "targets": x["translation"]["es"]}


def test_two_hosts_read_disjoint_examples_covering_the_split(expected):
  vocab = ByteVocabulary()
  task = Task("hf_two_hosts", HfDataSource(SAVED), [_id_and_spanish, pre.tokenize],
              {"inputs": Feature(vocab), "targets": Feature(vocab)})
  seen = [[ex["inputs_pretokenized"] for ex in task.get_dataset(
      None, "validation", shuffle=True, seed=0, shard_index=k, num_shards=2)] for k in range(2)]
  assert not set(seen[0]) & set(seen[1])
  assert sorted(seen[0] + seen[1]) == sorted(r["id"] for r in expected["examples"]["validation"])


# ------------------------------------------------------------------------------------- bad input


def test_offline_hub_dataset_not_in_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  source = HfDataSource("someone/missing", splits=["train"])  # nothing is resolved yet
  with pytest.raises(UserError) as e:
    source.get("train")
  msg = _one_line(e)
  for part in ("someone/missing", "HF_HUB_OFFLINE", str(tmp_path / "empty"),
               "hf download someone/missing --repo-type dataset"):
    assert part in msg


def test_save_to_disk_state_names_a_missing_file(tmp_path):
  saved = tmp_path / "saved"
  shutil.copytree(SAVED, saved)
  os.chmod(saved / "train", 0o755)
  os.unlink(saved / "train" / "data-00001-of-00002.arrow")
  with pytest.raises(UserError) as e:
    HfDataSource(str(saved)).get("train")
  msg = _one_line(e)
  assert str(saved / "train" / "state.json") in msg and "data-00001-of-00002.arrow" in msg


def test_corrupt_parquet_footer(tmp_path):
  bad = tmp_path / "bad.parquet"
  data = bytearray(open(PARQUET["validation"], "rb").read())
  data[-12:-4] = b"\xff" * 8  # the footer's length and the end of its metadata
  bad.write_bytes(bytes(data))
  with pytest.raises(UserError) as e:
    ParquetDataSource({"train": str(bad)}).get("train")
  msg = _one_line(e)
  assert str(bad) in msg and "Parquet" in msg


def test_column_that_does_not_exist():
  with pytest.raises(UserError) as e:
    ParquetDataSource(PARQUET, columns=["translation", "label"]).get("train")
  msg = _one_line(e)
  assert "'label'" in msg and "translation, length, id" in msg and PARQUET["train"] in msg


def test_csv_with_unbalanced_quotes(tmp_path):
  path = tmp_path / "bad.csv"
  path.write_text('inputs,targets\na,b\n"c,d\ne,f\ng,h\n', encoding="utf-8")
  with pytest.raises(UserError) as e:
    CsvDataSource({"train": str(path)}).get("train")
  msg = _one_line(e)
  assert str(path) in msg and "line 3" in msg and "quote" in msg
  # A quote left open in the last column swallows the rest of the file without a parse
  # error from pyarrow; it is caught too.
  path.write_text('inputs,targets\na,b\nc,"d\ne,f\n', encoding="utf-8")
  with pytest.raises(UserError) as e:
    CsvDataSource({"train": str(path)}).get("train")
  assert "line 3" in _one_line(e)
  assert not os.listdir(os.path.join(files.cache_root(), "tables"))  # nothing half-written


def test_config_name_not_in_readme(offline_hub):
  with pytest.raises(UserError) as e:
    HfDataSource(REPO, "fr_de").get("train")
  msg = _one_line(e)
  assert "'fr_de'" in msg and "en_es" in msg and REPO in msg


def test_split_not_present(offline_hub):
  with pytest.raises(UserError) as e:
    HfDataSource(REPO, "en_es", splits={"test": "test"}).get("test")
  msg = _one_line(e)
  assert "'test'" in msg and "train, validation" in msg
  with pytest.raises(UserError) as e:
    HfDataSource(REPO).get("test")
  assert "train, validation" in _one_line(e)


# ------------------------------------------------------------------------------- details


def test_csv_column_types_widen_after_the_first_block(tmp_path, monkeypatch):
  monkeypatch.setattr(tabular, "_CSV_BLOCK", 1 << 10)
  lines = ["n,text"] + [f"{i},{i}" for i in range(400)] + ["1.5,words"]
  path = tmp_path / "t.csv"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  rows = _rows(tabular.CsvSource(str(path)))
  assert rows[0] == {"n": 0.0, "text": "0"} and rows[-1] == {"n": 1.5, "text": "words"}
  assert isinstance(rows[0]["n"], float)


def test_online_download_is_limited_to_the_config(monkeypatch, tmp_path):
  import huggingface_hub
  from huggingface_hub import constants
  snapshot = os.path.join(HUB_CACHE, "datasets--t5forge-fixtures--bible-verses", "snapshots",
                          "eca5f6605e6a172e7a071b2ef06277be7be93a58")
  calls = {}

  def snapshot_download(repo_id, **kwargs):
    calls.update(kwargs, repo_id=repo_id)
    return snapshot

  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
  monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                      lambda *a, **k: os.path.join(snapshot, "README.md"))
  monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
  assert len(HfDataSource(REPO, "en_es").get("validation")) == 60
  assert calls["repo_type"] == "dataset" and calls["cache_dir"] == str(tmp_path)
  assert calls["allow_patterns"] == ["README.md", "en_es/train-*", "en_es/validation-*"]
  assert calls["local_files_only"] is False


def test_label_names_from_dataset_card_and_features():
  assert hf_datasets._card_label_names(
      {"dataset_info": {"features": [
          {"name": "label", "dtype": {"class_label": {"names": {"0": "neg", "1": "pos"}}}},
          {"name": "tags", "sequence": {"class_label": {"names": ["O", "B"]}}}]}},
      "default") == {"label": ["neg", "pos"], "tags": ["O", "B"]}
  assert tabular.label_names_from_features(
      {"ner": {"feature": {"names": ["O", "B-PER"], "_type": "ClassLabel"},
               "_type": "Sequence"}}) == {"ner": ["O", "B-PER"]}
