"""TFRecord framing, tf.train.Example decoding and the sources over them, against files that
TensorFlow's own `tf.io.TFRecordWriter` wrote (../shared/testdata/formats/tfrecord) and what
`tf.io.parse_single_example` read back from them."""
import gzip
import json
import os
import pickle
import shutil

import numpy as np
import pytest

from conftest import SHARED
from t5forge import data as seqio
from t5forge.data import records, sources, tf_example
from t5forge.errors import UserError

FORMATS = os.path.join(SHARED, "testdata", "formats")
EXPECTED = json.load(gzip.open(os.path.join(FORMATS, "expected.json.gz")))
PLAIN = os.path.join(FORMATS, "tfrecord", "pairs.tfrecord-*-of-00002")
GZIPPED = os.path.join(FORMATS, "tfrecord", "pairs.tfrecord.gz-*-of-00002")
DESCRIPTION = {"inputs": seqio.FixedLenFeature([], "string"),
               "targets": seqio.FixedLenFeature([], "string"),
               "weight": seqio.FixedLenFeature([], "float32"),
               "tags": seqio.VarLenFeature("int64")}


pytestmark = pytest.mark.usefixtures("cache")


def _all(src):
  return [src[i] for i in range(len(src))]


def _one_line(e) -> str:
  msg = str(e.value)
  assert "\n" not in msg
  return msg


@pytest.mark.parametrize("pattern", [PLAIN, GZIPPED], ids=["plain", "gzip"])
def test_examples_equal_what_tensorflow_parsed(pattern):
  source = seqio.TFExampleDataSource({"train": pattern}, feature_description=DESCRIPTION)
  got = _all(source.get("train"))
  assert got == EXPECTED["tfrecord"]["examples_in_file_order"]
  assert isinstance(got[0]["tags"], list) and isinstance(got[0]["weight"], float)
  assert source.num_input_examples("train") == 300


def test_gzip_named_explicitly_and_zlib(tmp_path):
  src = seqio.TFExampleDataSource({"train": GZIPPED}, DESCRIPTION, compression_type="GZIP")
  assert _all(src.get("train")) == EXPECTED["tfrecord"]["examples_in_file_order"]
  import zlib
  raw = b"".join(records.frame(tf_example.encode({"inputs": "a", "targets": "b"}))
                 for _ in range(3))
  (tmp_path / "z.tfrecord").write_bytes(zlib.compress(raw))
  src = seqio.TFExampleDataSource({"train": str(tmp_path / "z.tfrecord")},
                                  {"inputs": seqio.FixedLenFeature([], "string")},
                                  compression_type="ZLIB")
  assert _all(src.get("train")) == [{"inputs": "a"}] * 3


def test_raw_records_decode_function_and_pickling(tmp_path):
  raw = records.TFRecordDataSource({"train": PLAIN}).get("train")
  first = raw[0]["record"]
  assert tf_example.ExampleDecoder(DESCRIPTION)(first) == \
      EXPECTED["tfrecord"]["examples_in_file_order"][0]
  decoded = records.TFRecordDataSource({"train": PLAIN},
                                       decode=tf_example.ExampleDecoder(DESCRIPTION)).get("train")
  assert decoded[5] == EXPECTED["tfrecord"]["examples_in_file_order"][5]
  clone = pickle.loads(pickle.dumps(decoded))
  assert clone[299] == EXPECTED["tfrecord"]["examples_in_file_order"][299]


def test_index_is_cached_and_rebuilt_when_the_file_changes(tmp_path, cache):
  path = tmp_path / "d.tfrecord"
  records.write(str(path), [tf_example.encode({"x": i}) for i in range(4)])
  src = records.RecordFiles([str(path)])
  assert len(src) == 4 and sorted(os.listdir(tmp_path)) == ["cache", "d.tfrecord"]
  assert len(list((cache / "lines").glob("*.t5forge-records.npy"))) == 1
  records.write(str(path), [tf_example.encode({"x": i}) for i in range(7)])
  again = records.RecordFiles([str(path)])
  assert len(again) == 7
  assert tf_example.ExampleDecoder()(again.read(6)) == {"x": 6}


def test_fixed_shapes_sequences_defaults_and_dtypes(tmp_path):
  path = tmp_path / "d.tfrecord"
  records.write(str(path), [tf_example.encode({"m": [1, 2, 3, 4, 5, 6], "s": ["a", "b"],
                                               "seq": [1.5, 2.5, 3.5, 4.5]}),
                            tf_example.encode({"m": [0] * 6, "s": ["c", "d"]})])
  desc = {"m": seqio.FixedLenFeature([2, 3], "int64"), "s": seqio.FixedLenFeature([2], "string"),
          "seq": seqio.FixedLenSequenceFeature([2], "float32", allow_missing=True),
          "w": seqio.FixedLenFeature([], "float32", default_value=1.0),
          "i32": seqio.FixedLenFeature([], "int32", default_value=7)}
  src = seqio.TFExampleDataSource({"train": str(path)}, desc).get("train")
  a, b = src[0], src[1]
  np.testing.assert_array_equal(a["m"], [[1, 2, 3], [4, 5, 6]])
  assert a["m"].dtype == np.int64 and a["s"] == ["a", "b"]
  assert a["seq"].shape == (2, 2) and a["seq"].dtype == np.float32
  assert b["seq"].shape == (0, 2) and a["w"] == 1.0 and a["i32"] == 7
  # TF's own types work as dtypes too (anything with .name), and numpy dtypes.
  assert tf_example.normalize_dtype(np.int64) == "int64"
  assert tf_example.normalize_dtype(type("DType", (), {"name": "string"})()) == "string"


def test_array_record_reads_tf_example_records_by_default(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  path = str(tmp_path / "d.array_record")
  writer = ArrayRecordWriter(path, "group_size:1")
  for ex in EXPECTED["tfrecord"]["examples_in_file_order"][:10]:
    writer.write(tf_example.encode(ex))
  writer.close()
  auto = seqio.ArrayRecordDataSource({"train": path}, feature_description=DESCRIPTION)
  assert _all(auto.get("train")) == EXPECTED["tfrecord"]["examples_in_file_order"][:10]
  plain = seqio.ArrayRecordDataSource({"train": path}).get("train")  # no description: guessed
  assert plain[1]["inputs"] == EXPECTED["tfrecord"]["examples_in_file_order"][1]["inputs"]
  as_json = seqio.ArrayRecordDataSource({"train": path}, decode="json").get("train")
  with pytest.raises(UserError) as e:
    as_json[0]
  assert "not a UTF-8 JSON object" in _one_line(e) and "decode='tf_example'" in str(e.value)


# --------------------------------------------------------------------------------- bad input


def _copy_first_shard(tmp_path) -> bytes:
  return open(PLAIN.replace("*", "00000"), "rb").read()


def test_truncated_mid_record(tmp_path):
  data = _copy_first_shard(tmp_path)
  path = tmp_path / "cut.tfrecord"
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(UserError) as e:
    seqio.TFExampleDataSource({"train": str(path)}, DESCRIPTION).get("train")
  msg = _one_line(e)
  assert str(path) in msg and "truncated" in msg and "cut short" in msg
  assert not any(n.endswith(".npy") for n in os.listdir(tmp_path))  # no index of a bad file


@pytest.mark.parametrize("where", ["length", "data"])
def test_crc_mismatch(tmp_path, where):
  data = bytearray(_copy_first_shard(tmp_path))
  first_len = int.from_bytes(data[:8], "little")
  second = 12 + first_len + 4
  data[second + (3 if where == "length" else 20)] ^= 0x40  # a byte of record 1
  path = tmp_path / "bad.tfrecord"
  path.write_bytes(bytes(data))
  with pytest.raises(UserError) as e:
    records.RecordFiles([str(path)])
  msg = _one_line(e)
  assert str(path) in msg and "record 1" in msg and "CRC" in msg


def test_not_a_tfrecord_file(tmp_path):
  path = tmp_path / "x.tfrecord"
  path.write_text('{"inputs": "a", "targets": "b"}\n' * 5)
  with pytest.raises(UserError) as e:
    records.TFRecordDataSource({"train": str(path)}).get("train")
  assert "not a TFRecord file" in _one_line(e) and str(path) in str(e.value)


def test_gzip_named_as_plain_says_so(tmp_path):
  with pytest.raises(UserError) as e:
    seqio.TFExampleDataSource({"train": GZIPPED}, DESCRIPTION, compression_type="").get("train")
  assert "compression_type='GZIP'" in _one_line(e)


def test_example_lacking_a_feature_or_of_the_wrong_type(tmp_path):
  desc = dict(DESCRIPTION, lang=seqio.FixedLenFeature([], "string"))
  src = seqio.TFExampleDataSource({"train": PLAIN}, desc).get("train")
  with pytest.raises(UserError) as e:
    src[3]
  msg = _one_line(e)
  assert "'lang' is missing" in msg and "record 3 of" in msg and "default_value" in msg
  desc = dict(DESCRIPTION, weight=seqio.FixedLenFeature([], "string"))
  with pytest.raises(UserError) as e:
    seqio.TFExampleDataSource({"train": PLAIN}, desc).get("train")[0]
  msg = _one_line(e)
  assert "'weight' holds float32" in msg and "describe it as 'float32'" in msg
  desc = dict(DESCRIPTION, tags=seqio.FixedLenFeature([2], "int64"))
  with pytest.raises(UserError) as e:
    _all(seqio.TFExampleDataSource({"train": PLAIN}, desc).get("train"))
  assert "VarLenFeature" in _one_line(e)


def test_descriptions_and_arguments_refused_in_one_line():
  with pytest.raises(UserError) as e:
    seqio.TFExampleDataSource({"train": PLAIN}, {"x": seqio.FixedLenFeature([], "complex64")})
  assert "'string', 'int64' or 'float32'" in _one_line(e)
  with pytest.raises(UserError) as e:
    seqio.TFExampleDataSource({"train": PLAIN}, DESCRIPTION, reader_cls=object)
  assert "remove reader_cls" in _one_line(e)
  with pytest.raises(UserError) as e:
    seqio.TFExampleDataSource({"train": PLAIN}, DESCRIPTION, compression_type="LZ4")
  assert "'GZIP'" in _one_line(e)


def test_content_fingerprint_ignores_where_the_files_are(tmp_path):
  for k in range(2):
    shutil.copy(PLAIN.replace("*", f"0000{k}"), tmp_path)
  here = seqio.TFExampleDataSource({"train": str(tmp_path / "pairs.tfrecord-*")}, DESCRIPTION)
  there = seqio.TFExampleDataSource({"train": PLAIN}, DESCRIPTION)
  assert here.get("train").content_fingerprint() == there.get("train").content_fingerprint()
  assert here.get("train").fingerprint() != there.get("train").fingerprint()
  records.write(str(tmp_path / "pairs.tfrecord-00001-of-00002"), [tf_example.encode({"a": 1})])
  changed = seqio.TFExampleDataSource({"train": str(tmp_path / "pairs.tfrecord-*")}, DESCRIPTION)
  assert changed.get("train").content_fingerprint() != there.get("train").content_fingerprint()
  assert isinstance(sources.files_content_digest([PLAIN.replace("*", "00000")]), str)


def test_not_an_array_record_file(tmp_path):
  path = tmp_path / "x.array_record"
  path.write_bytes(b"\x00garbage" * 100)
  with pytest.raises(UserError) as e:
    seqio.ArrayRecordDataSource({"train": str(path)}).get("train")
  assert "not a readable ArrayRecord file" in _one_line(e) and str(path) in str(e.value)
