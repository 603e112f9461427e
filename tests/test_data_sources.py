"""Sources: formats, random access by byte offsets, splits, and one-line errors for bad input."""
import gzip
import json
import os
import pickle
import tempfile

import numpy as np
import pytest

from t5forge.data import files, sources
from t5forge.errors import UserError


pytestmark = pytest.mark.usefixtures("cache")


def _one_line(e: pytest.ExceptionInfo) -> str:
  msg = str(e.value)
  assert "\n" not in msg
  return msg


def test_tsv_fields_random_access_and_index_beside_file(tmp_path):
  path = tmp_path / "d.tsv"
  path.write_text("a1\tb1\n\na2\tb2\r\na3\tb3")  # a blank line, CRLF, no final newline
  src = sources.TsvSource(str(path), fields=("src", "tgt"))
  assert len(src) == 3
  assert src[2] == {"src": "a3", "tgt": "b3"}
  assert src[1] == {"src": "a2", "tgt": "b2"}
  assert os.path.exists(tmp_path / ".d.tsv.t5forge-lines.npy")  # cached next to the file
  # A changed file is re-indexed (size/mtime are part of the index).
  path.write_text("x\ty\n")
  assert len(sources.TsvSource(str(path), fields=("src", "tgt"))) == 1
  clone = pickle.loads(pickle.dumps(src))
  assert clone[0] == {"src": "x", "tgt": "y"}


def test_index_goes_to_cache_dir_when_directory_is_read_only(tmp_path, cache, monkeypatch):
  d = tmp_path / "ro"
  d.mkdir()
  (d / "t.txt").write_text("one\ntwo\n")
  real_mkstemp = tempfile.mkstemp

  def mkstemp(dir=None, **kwargs):  # root ignores chmod, so refuse writes in `d` here
    if os.path.abspath(dir) == str(d):
      raise PermissionError(13, "Permission denied", dir)
    return real_mkstemp(dir=dir, **kwargs)

  monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
  os.chmod(d, 0o555)
  try:
    src = sources.LineSource(str(d / "t.txt"))
    assert [src[i]["text"] for i in range(len(src))] == ["one", "two"]
    assert not any(n.endswith(".npy") for n in os.listdir(d))
    assert any(n.endswith(".t5forge-lines.npy") for n in os.listdir(cache / "lines"))
  finally:
    os.chmod(d, 0o755)


def test_gzip_glob_and_file_order(tmp_path):
  for name, rows in (("b.txt.gz", ["b1", "b2"]), ("a.txt.gz", ["a1"])):
    with gzip.open(tmp_path / name, "wt", encoding="utf-8") as f:
      f.write("\n".join(rows) + "\n")
  src = sources.LineSource(str(tmp_path / "*.txt.gz"))
  assert [src[i]["text"] for i in range(len(src))] == ["a1", "b1", "b2"]  # sorted file order


def test_jsonl_and_in_memory_and_function_sources(tmp_path):
  path = tmp_path / "d.jsonl"
  rows = [{"q": "¿qué?", "a": 1}, {"q": "why", "a": 2}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  src = sources.JsonlSource(str(path))
  assert src[0] == {"q": "¿qué?", "a": 1}
  mem = sources.InMemoryDataSource({"train": [{"x": 1}, {"x": 2}]})
  assert len(mem.get("train")) == 2 and mem.get("train")[1] == {"x": 2}
  fn = sources.FunctionDataSource(lambda split: [{"split": split}] * 3, splits=("train", "test"))
  assert fn.get("test")[2] == {"split": "test"}


def test_array_record_source(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  path = str(tmp_path / "d.array_record")
  writer = ArrayRecordWriter(path, "group_size:1")
  for i in range(5):
    writer.write(json.dumps({"inputs": f"q{i}", "targets": f"a{i}"}).encode())
  writer.close()
  ds = sources.ArrayRecordDataSource({"train": path})
  assert len(ds.get("train")) == 5 and ds.get("train")[3] == {"inputs": "q3", "targets": "a3"}


def test_large_file_is_read_by_offsets(tmp_path, monkeypatch):
  monkeypatch.setattr(files, "_CHUNK", 1000)  # force many chunks in the indexing pass
  path = tmp_path / "big.tsv"
  with open(path, "w") as f:
    for i in range(5000):
      f.write(f"input {i}\ttarget {i} ñ\n")
  src = sources.TsvSource(str(path))
  assert len(src) == 5000
  for i in (0, 1, 2499, 4999):
    assert src[i] == {"inputs": f"input {i}", "targets": f"target {i} ñ"}
  index = np.load(tmp_path / ".big.tsv.t5forge-lines.npy")
  assert index.shape == (5002, 2)  # stamp row + one offset per line + the end


def test_named_splits():
  ds = sources.InMemoryDataSource({"train": [{"a": 1}], "validation": [{"a": 2}]})
  assert ds.splits == ("train", "validation")
  with pytest.raises(UserError) as e:
    ds.get("test")
  assert "no split 'test'" in _one_line(e) and "train, validation" in str(e.value)


# ----------------------------------------------------------------------------- bad input


def test_missing_file_is_named(tmp_path):
  with pytest.raises(UserError) as e:
    sources.TsvDataSource({"train": str(tmp_path / "nope.tsv")}).get("train")
  assert _one_line(e) == f"file not found: {tmp_path / 'nope.tsv'}"


def test_glob_matching_nothing(tmp_path):
  with pytest.raises(UserError) as e:
    sources.LineSource(str(tmp_path / "*.txt"))
  assert "matched no files" in _one_line(e) and "*.txt" in str(e.value)


def test_tsv_wrong_number_of_fields_names_file_and_line(tmp_path):
  path = tmp_path / "bad.tsv"
  path.write_text("a\tb\nc\td\ne\tf\tg\nh\ti\n")
  with pytest.raises(UserError) as e:
    sources.TsvSource(str(path), fields=("inputs", "targets"))
  msg = _one_line(e)
  assert f"{path}:3:" in msg and "expected 2" in msg and "found 3" in msg


def test_tsv_wrong_fields_in_gzip_counts_lines_after_blank_ones(tmp_path):
  path = tmp_path / "bad.tsv.gz"
  with gzip.open(path, "wt") as f:
    f.write("a\tb\n\nonly-one-field\n")
  with pytest.raises(UserError) as e:
    sources.TsvSource(str(path))
  assert f"{path}:3:" in _one_line(e) and "found 1" in str(e.value)


def test_invalid_utf8_names_file_and_line(tmp_path):
  path = tmp_path / "latin1.txt"
  path.write_bytes("fine\nstill fine\n".encode() + "año\n".encode("latin-1"))
  with pytest.raises(UserError) as e:
    sources.LineSource(str(path))
  assert f"{path}:3:" in _one_line(e) and "UTF-8" in str(e.value)


def test_invalid_utf8_in_gzip(tmp_path):
  path = tmp_path / "latin1.txt.gz"
  with gzip.open(path, "wb") as f:
    f.write(b"ok\n" + "año".encode("latin-1") + b"\n")
  with pytest.raises(UserError) as e:
    sources.LineSource(str(path))
  assert f"{path}:2:" in _one_line(e)


def test_empty_split(tmp_path):
  (tmp_path / "empty.txt").write_text("\n\n")
  with pytest.raises(UserError) as e:
    sources.TextLineDataSource({"train": str(tmp_path / "empty.txt")}).get("train")
  assert "split 'train' is empty" in _one_line(e) and "empty.txt" in str(e.value)
  with pytest.raises(UserError, match="split 'validation' is empty"):
    sources.InMemoryDataSource({"validation": []}).get("validation")


def test_invalid_json_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"a": 1}\n{"a": \n')
  src = sources.JsonlSource(str(path))
  with pytest.raises(UserError) as e:
    src[1]
  assert f"{path}:2:" in _one_line(e) and "invalid JSON" in str(e.value)


def test_seqio_keywords_of_ported_sources(tmp_path, caplog):
  """FLAN's task files write TextLineDataSource({...}, num_input_examples={...}) and SeqIO's
  file keywords; they are accepted, and the count is used without reading the files."""
  path = tmp_path / "t.txt"
  path.write_text("a\nb\nc\n")
  src = sources.TextLineDataSource({"train": str(path)}, num_input_examples={"train": 1000},
                                   caching_permitted=True, file_shuffle_buffer_size=16,
                                   cycle_length=8, block_length=4)
  assert src.num_input_examples("train") == 1000 and not src._built
  assert [src.get("train")[i]["text"] for i in range(3)] == ["a", "b", "c"]
  positional = sources.TextLineDataSource({"train": str(path)}, 0, {"train": 3})
  assert positional.num_input_examples("train") == 3
  with pytest.raises(UserError) as e:
    sources.TsvDataSource({"train": str(path)}, num_input_examples={"test": 3})
  assert "'test'" in _one_line(e)


def test_function_source_calls_dataset_fn_as_seqio_does():
  calls = []

  def seqio_style(split, shuffle_files, seed=None):  # SeqIO's signature
    calls.append((split, shuffle_files, seed))
    return ({"x": i, "split": split} for i in range(3))  # any iterable of dicts

  src = sources.FunctionDataSource(seqio_style, splits=["train", "validation"],
                                   num_input_examples={"train": 3})
  assert src.get("validation")[2] == {"x": 2, "split": "validation"}
  assert calls == [("validation", False, 0)]
  keywords_only = sources.FunctionDataSource(lambda *, split, shuffle_files: [{"s": split}],
                                             splits=("train",))
  assert keywords_only.get("train")[0] == {"s": "train"}
  with pytest.raises(UserError) as e:
    sources.FunctionDataSource(lambda split: {"not": "a list"}, splits=("train",)).get("train")
  assert "iterable of example dicts" in _one_line(e)


def test_a_source_that_forbids_caching_refuses_a_cached_task(tmp_path):
  from t5forge.data import tasks, vocab
  path = tmp_path / "t.txt"
  path.write_text("a\n")
  src = sources.TextLineDataSource({"train": str(path)}, caching_permitted=False)
  with pytest.raises(UserError) as e:
    tasks.Task("no_cache", src, output_features={"targets": tasks.Feature(vocab.ByteVocabulary())},
               cache=True)
  assert "caching_permitted=False" in _one_line(e)
