"""TFRecord files without TensorFlow: framing, random access, and the sources that read them.

A TFRecord file is a sequence of records, each framed as

    uint64 length (little endian) | uint32 masked CRC32C of the length bytes
    data (length bytes)           | uint32 masked CRC32C of the data

One pass over a file (`RecordFiles`) verifies both checksums of every record and keeps
the byte offset and length of each in an index, cached in the cache dir (never beside the
data) and rebuilt when the file changes (as `files.LineFiles` does for text); reading
record i is then one `os.pread` (its data checksum verified again). GZIP and ZLIB files
(TensorFlow's `compression_type`) are decompressed once into the cache dir.
A file in a bucket (`gs://`, `s3://`; patterns too) is read through its local copy
(`files.local_file`, one per object version), and its index keyed on that version.

Sources:
  `TFRecordDataSource(split_to_filepattern, decode=None)`: raw records, `{"record": bytes}`
    or `decode(bytes) -> dict`.
  `TFExampleDataSource(split_to_filepattern, feature_description)`: SeqIO's, for files of
    serialized `tf.train.Example` (see `tf_example` for the feature specs).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import google_crc32c
import numpy as np

from t5forge.data import files, sources, tf_example
from t5forge.errors import UserError

_MASK_DELTA = 0xA282EAD8
_HEADER = 12  # length (8) + its masked CRC (4)
_CHUNK = 8 << 20


def masked_crc(data: bytes) -> int:
  """TFRecord's checksum: CRC32C rotated right by 15 bits plus a constant (mod 2^32)."""
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
  """One record as a TFRecord writer frames it."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc(length)) + data
          + struct.pack("<I", masked_crc(data)))


def write(path: str, records: Sequence[bytes]) -> None:
  """Writes an uncompressed TFRecord file atomically (tests and small tools)."""
  files.atomic_write_bytes(path, b"".join(frame(r) for r in records))


def _build_index(plain: str, origin: str) -> np.ndarray:
  """One pass over a TFRecord file, verifying every checksum.

  Returns:
    int64 [num_records + 1, 2]: row 0 is (size, mtime_ns) of the file (`files.stamp`);
    row 1 + i is (byte offset of record i's data, its length).
  """
  size, mtime = files.stamp(plain)
  rows = [(size, mtime)]
  with open(plain, "rb") as f:
    pos = 0
    while pos < size:
      n = len(rows) - 1
      header = f.read(_HEADER)
      if len(header) < _HEADER:
        raise UserError(f"{origin}: truncated TFRecord file: record {n} at byte {pos} has a "
                        f"{len(header)}-byte header (12 needed); the file was cut short "
                        "(an interrupted copy?): copy or write it again")
      length_bytes, length_crc = header[:8], struct.unpack("<I", header[8:])[0]
      if masked_crc(length_bytes) != length_crc:
        if n == 0:
          kind = ("a gzip file: pass compression_type='GZIP'" if header[:2] == b"\x1f\x8b"
                  else "its first 12 bytes are not a record header")
          raise UserError(f"{origin}: not a TFRecord file ({kind})")
        raise UserError(f"{origin}: corrupt TFRecord file: the length of record {n} at byte "
                        f"{pos} fails its CRC check; the file is damaged: copy or write it "
                        "again")
      length = struct.unpack("<Q", length_bytes)[0]
      if pos + _HEADER + length + 4 > size:
        raise UserError(f"{origin}: truncated TFRecord file: record {n} at byte {pos} needs "
                        f"{_HEADER + length + 4} bytes, the file ends after {size - pos}; it "
                        "was cut short (an interrupted copy?): copy or write it again")
      data = f.read(length)
      data_crc = struct.unpack("<I", f.read(4))[0]
      if masked_crc(data) != data_crc:
        raise UserError(f"{origin}: corrupt TFRecord file: the data of record {n} at byte "
                        f"{pos} fails its CRC check; the file is damaged: copy or write it "
                        "again")
      rows.append((pos + _HEADER, length))
      pos += _HEADER + length + 4
  return np.asarray(rows, np.int64).reshape(-1, 2)


_COMPRESSIONS = {None: None, "": "", "NONE": "", "GZIP": "GZIP", "ZLIB": "ZLIB"}


def check_compression(compression_type: str | None) -> str | None:
  """TensorFlow's `compression_type` ('', 'GZIP', 'ZLIB', any case) or None (detect)."""
  key = compression_type.upper() if isinstance(compression_type, str) else compression_type
  if key not in _COMPRESSIONS:
    raise UserError(f"compression_type={compression_type!r}: use None (detect gzip), '', "
                    "'GZIP' or 'ZLIB'")
  return _COMPRESSIONS[key]


def _compression(path: str, compression_type: str | None) -> str:
  """The file's compression; None: gzip is recognised by its magic bytes (TensorFlow needs
  it named), anything else is read as uncompressed."""
  key = check_compression(compression_type)
  if key is None:
    return "GZIP" if files.is_gzip(path) else ""
  return key


class RecordFiles(files.PlainFiles, files.RecordCounts):
  """Random access to the records of several TFRecord files, in file order.

  Args:
    paths: the files (already expanded; `files.expand_patterns`).
    compression_type: see `_compression`.
    lengths: expected records per file (e.g. TFDS's `shardLengths`); a file with
      another count is refused.
  """

  def __init__(self, paths: Sequence[str], compression_type: str | None = None,
               lengths: Sequence[int] | None = None):
    self._compression = compression_type
    plain_files, self._index = [], []
    counts = []
    for k, path in enumerate(paths):
      plain = files.plain_copy(path, _compression(path, compression_type))
      # In the cache dir only: record files often sit in directories other tools own
      # (prepared TFDS datasets, SeqIO caches), shared between machines.
      index = files.load_index(path, plain, "t5forge-records.npy", _build_index,
                               beside_ok=False)
      if lengths is not None and len(index) != int(lengths[k]):
        raise UserError(f"{path}: holds {len(index)} records where {int(lengths[k])} are "
                        "recorded for it; the file is incomplete or from another version of "
                        "the dataset: copy or prepare it again")
      plain_files.append(plain)
      self._index.append(index)
      counts.append(len(index))
    self._count_records(paths, counts)
    super().__init__(plain_files)

  def read(self, i: int) -> bytes:
    """The data of record `i` (its checksum verified)."""
    if not 0 <= i < len(self):
      raise IndexError(f"record {i} out of range for {len(self)} records")
    f, r = self.locate(i)
    index = self._index[f]
    offset, length = index.item(r, 0), index.item(r, 1)
    raw = self.pread(f, length + 4, offset)
    data = raw[:length]
    if len(raw) != length + 4 or masked_crc(data) != struct.unpack("<I", raw[length:])[0]:
      raise UserError(f"{self._paths[f]}: record {r} (byte {offset - _HEADER}) changed since it "
                      "was indexed or is damaged (CRC mismatch); copy or write the file again")
    return data

  def content_digest(self) -> str:
    """The records' content (each file's sampled digest and record layout), not the
    files' names or places."""
    h = hashlib.blake2b(digest_size=10)
    for path, index in zip(self._paths, self._index):
      h.update(files.sample_digest(path).encode())
      h.update(np.ascontiguousarray(index).tobytes())
    return h.hexdigest()

  def __getstate__(self):
    return {"paths": self._paths, "compression": self._compression}

  def __setstate__(self, state):
    self.__init__(state["paths"], state["compression"])


# ----------------------------------------------------------------------------------- split sources


class RecordSource(sources.SplitSource):
  """One split of TFRecord files: `decode(data, where) -> dict` per record.

  Args:
    records: the files.
    decode: the record's bytes (and a `Where` naming it for messages) -> example;
      None gives `{"record": bytes}`.
    label: names the decoder in fingerprints (a stable description of it).
  """

  def __init__(self, records: RecordFiles,
               decode: Callable[[bytes, Any], dict] | None = None, label: str = "raw"):
    self._records = records
    self._decode = decode
    self._label = label

  def __len__(self):
    return len(self._records)

  def __getitem__(self, i):
    i = int(i)
    data = self._records.read(i)
    if self._decode is None:
      return {"record": data}
    return self._decode(data, self._records.where(i))

  def fingerprint(self):
    return f"{sources.files_fingerprint(self._records.paths)}:{self._label}"

  def content_fingerprint(self):
    return f"{self._records.content_digest()}:{self._label}"

  def describe(self):
    return sources.describe_files(self._records.paths)

  def shards(self):
    return sources.ranges_of(self._records.counts)


class _WithWhere:
  """A picklable `(data, where) -> dict` from a `bytes -> dict` function."""

  def __init__(self, fn: Callable[[bytes], dict]):
    self.fn = fn

  def __call__(self, data: bytes, where: str) -> dict:
    del where
    return self.fn(data)


# ---------------------------------------------------------------------------------- data sources


def _reader_cls(owner: str, reader_cls: Any) -> None:
  if reader_cls is not None:
    raise UserError(f"{owner}: reader_cls={getattr(reader_cls, '__name__', reader_cls)!r}: "
                    "t5forge reads TFRecord files itself; remove reader_cls (for ArrayRecord "
                    "files use ArrayRecordDataSource(decode='tf_example'))")


class TFRecordDataSource(sources.DataSource):
  """TFRecord files of any records: `{"record": bytes}`, or `decode(bytes) -> dict`.

  Args:
    split_to_filepattern: split -> files or globs (plain, GZIP or ZLIB).
    decode: `bytes -> dict`; None keeps the raw bytes under "record".
    compression_type: None (gzip detected), '', 'GZIP' or 'ZLIB'.
    num_input_examples / caching_permitted: as `sources.DataSource`.
    file_shuffle_buffer_size / cycle_length / block_length: SeqIO's, not needed
      (`sources.interleave_keywords`).
  """

  def __init__(self, split_to_filepattern: Mapping[str, sources.SplitSpec],
               decode: Callable[[bytes], dict] | None = None, *,
               compression_type: str | None = None,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True, file_shuffle_buffer_size: int | None = None,
               cycle_length: int = 16, block_length: int = 16):
    super().__init__(split_to_filepattern, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    sources.interleave_keywords(type(self).__name__, file_shuffle_buffer_size, cycle_length,
                                block_length)
    if decode is not None and not callable(decode):
      raise UserError(f"TFRecordDataSource: decode must be a function of a record's bytes, got "
                      f"{type(decode).__name__}")
    check_compression(compression_type)
    self._user_decode = decode
    self._compression_type = compression_type

  def _decoder(self) -> tuple[Callable[[bytes, str], dict] | None, str]:
    if self._user_decode is None:
      return None, "raw"
    name = getattr(self._user_decode, "__qualname__", type(self._user_decode).__name__)
    return _WithWhere(self._user_decode), f"fn:{name}"

  def _build(self, split, spec):
    decode, label = self._decoder()
    return RecordSource(RecordFiles(files.expand_patterns(spec), self._compression_type),
                        decode, label)


class TFExampleDataSource(TFRecordDataSource):
  """SeqIO's `TFExampleDataSource`: TFRecord files of serialized `tf.train.Example`.

      seqio.TFExampleDataSource(
          {"train": "data/train.tfrecord-*", "validation": "data/dev.tfrecord-*"},
          feature_description={"inputs": seqio.FixedLenFeature([], "string"),
                               "targets": seqio.FixedLenFeature([], "string")})

  Args:
    split_to_filepattern: split -> files or globs.
    feature_description: feature name -> `FixedLenFeature` / `VarLenFeature` /
      `FixedLenSequenceFeature` (`tf_example`; TF's `tf.io.` names, dtypes as strings).
    reader_cls: SeqIO's; only None (TFRecord) is accepted.
    The rest as `TFRecordDataSource`.
  """

  def __init__(self, split_to_filepattern: Mapping[str, sources.SplitSpec],
               feature_description: Mapping[str, tf_example.FeatureSpec],
               reader_cls: Any = None, num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True, file_shuffle_buffer_size: int | None = None,
               cycle_length: int = 16, block_length: int = 16, *,
               compression_type: str | None = None):
    _reader_cls(type(self).__name__, reader_cls)
    super().__init__(split_to_filepattern, compression_type=compression_type,
                     num_input_examples=num_input_examples, caching_permitted=caching_permitted,
                     file_shuffle_buffer_size=file_shuffle_buffer_size,
                     cycle_length=cycle_length, block_length=block_length)
    self._example_decoder = tf_example.ExampleDecoder(feature_description)

  @property
  def feature_description(self) -> dict[str, Any]:
    return dict(self._example_decoder.description)

  def _decoder(self):
    return self._example_decoder, f"tf_example:{self._example_decoder.description!r}"
