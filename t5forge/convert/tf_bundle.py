"""TensorFlow V2 checkpoint bundles (`PREFIX.index` + `PREFIX.data-0000k-of-0000n`) without
TensorFlow.

This is the format `tf.compat.v1.train.Saver` and `tf.train.Checkpoint` write, and so the
format of the Mesh TensorFlow T5 releases (`gs://t5-data/pretrained_models/...`).

- `PREFIX.index` is a LevelDB-style table (TensorFlow's `core/lib/io/table*`): data blocks
  of prefix-compressed key/value entries ending in restart points, each block followed by a
  one-byte compression type (0 none, 1 Snappy) and a masked crc32c of the block and that
  byte; an index block mapping each data block's last key to its (offset, size) handle; and
  a 48-byte footer (metaindex and index handles, padding, the magic number).
- Key "" holds a `BundleHeaderProto` (shard count, endianness); every other key is a
  tensor name holding a `BundleEntryProto` (dtype, shape, shard, offset, size, masked
  crc32c of the bytes, slices of a partitioned variable).
- The data shards hold the tensors' bytes back to back, little endian. A string tensor is
  its elements' lengths as varint64s, a masked crc32c of those lengths, then the bytes.

    bundle = Bundle("model.ckpt-1000000")
    bundle.names()                       # ['decoder/block_000/...', 'global_step', ...]
    bundle.entry("shared/embedding")     # Entry(dtype='bfloat16', shape=(32128, 768), ...)
    bundle.read("shared/embedding")      # np.ndarray, its checksum checked

Every damage (a bad footer, a block or tensor failing its checksum, a missing or short
shard) is a one-line UserError naming the file and, for a tensor, its name.
"""
from __future__ import annotations

import dataclasses
import os
import struct

import google_crc32c
import ml_dtypes
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from t5forge.errors import UserError

INDEX_SUFFIX = ".index"
_MAGIC = 0xDB4775248B80FB57  # TensorFlow's table footer magic (`core/lib/io/format.h`)
_FOOTER = 48  # two block handles of at most 20 bytes, padded to 40, then the magic
_TRAILER = 5  # after each block: its compression type (1 byte) and masked crc32c (4)
_MASK_DELTA = 0xA282EAD8

# TensorFlow's `DataType` enum values (types.proto) -> numpy dtypes.
_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f8"), 3: np.dtype("<i4"), 4: np.dtype("u1"),
           5: np.dtype("<i2"), 6: np.dtype("i1"), 9: np.dtype("<i8"), 10: np.dtype("?"),
           14: np.dtype(ml_dtypes.bfloat16), 17: np.dtype("<u2"), 19: np.dtype("<f2"),
           22: np.dtype("<u4"), 23: np.dtype("<u8")}
_DT_STRING = 7


def masked_crc(data: bytes | memoryview, crc: int | None = None) -> int:
  """crc32c of `data` (extending `crc`, unmasked, when given), masked as TensorFlow stores
  it (also TFRecord's mask: rotate right by 15, add a constant)."""
  crc = google_crc32c.value(bytes(data)) if crc is None else google_crc32c.extend(crc, bytes(data))
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# ------------------------------------------------------------------------------ messages


def _declare_messages():
  """TensorFlow's `tensor_bundle.proto` messages and the ones they use (tensor_shape,
  tensor_slice, versions), declared to the protobuf runtime: no generated code."""
  f = descriptor_pb2.FileDescriptorProto(name="t5forge_tensor_bundle.proto",
                                         package="t5forge.tf_bundle", syntax="proto3")
  fd = descriptor_pb2.FieldDescriptorProto

  def message(name, fields, parent=None):
    m = (parent.nested_type if parent else f.message_type).add(name=name)
    for field, number, kind, type_name, repeated in fields:
      d = m.field.add(name=field, number=number, type=kind,
                      label=fd.LABEL_REPEATED if repeated else fd.LABEL_OPTIONAL)
      if type_name:
        d.type_name = f".t5forge.tf_bundle.{type_name}"
    return m

  message("VersionDef", [("producer", 1, fd.TYPE_INT32, None, False),
                         ("min_consumer", 2, fd.TYPE_INT32, None, False),
                         ("bad_consumers", 3, fd.TYPE_INT32, None, True)])
  shape = message("TensorShapeProto", [
      ("dim", 2, fd.TYPE_MESSAGE, "TensorShapeProto.Dim", True),
      ("unknown_rank", 3, fd.TYPE_BOOL, None, False)])
  message("Dim", [("size", 1, fd.TYPE_INT64, None, False),
                  ("name", 2, fd.TYPE_STRING, None, False)], parent=shape)
  tslice = message("TensorSliceProto", [
      ("extent", 1, fd.TYPE_MESSAGE, "TensorSliceProto.Extent", True)])
  message("Extent", [("start", 1, fd.TYPE_INT64, None, False),
                     ("length", 2, fd.TYPE_INT64, None, False)], parent=tslice)
  # Enums (DataType, Endianness) are read as their numbers.
  message("BundleHeaderProto", [("num_shards", 1, fd.TYPE_INT32, None, False),
                                ("endianness", 2, fd.TYPE_INT32, None, False),
                                ("version", 3, fd.TYPE_MESSAGE, "VersionDef", False)])
  message("BundleEntryProto", [("dtype", 1, fd.TYPE_INT32, None, False),
                               ("shape", 2, fd.TYPE_MESSAGE, "TensorShapeProto", False),
                               ("shard_id", 3, fd.TYPE_INT32, None, False),
                               ("offset", 4, fd.TYPE_INT64, None, False),
                               ("size", 5, fd.TYPE_INT64, None, False),
                               ("crc32c", 6, fd.TYPE_FIXED32, None, False),
                               ("slices", 7, fd.TYPE_MESSAGE, "TensorSliceProto", True)])
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"t5forge.tf_bundle.{n}"))
          for n in ("BundleHeaderProto", "BundleEntryProto")}


_MESSAGES = _declare_messages()


# ------------------------------------------------------------------------------- the table


def _varint(buf: memoryview, pos: int, where: str) -> tuple[int, int]:
  """(value, next position) of the base-128 varint at `buf[pos:]`."""
  value = shift = 0
  while True:
    if pos >= len(buf) or shift > 63:
      raise UserError(f"{where}: damaged (a length runs past its block); copy the "
                      "checkpoint again")
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return value, pos


def _snappy(raw: bytes, where: str) -> bytes:
  # pyarrow is already a dependency and ships Snappy's codec; a raw Snappy block starts with
  # its uncompressed length (a varint), which pyarrow's decompress needs to be told.
  import pyarrow  # noqa: PLC0415 (slow import; only Snappy-compressed indexes need it)
  size, _ = _varint(memoryview(raw), 0, where)
  try:
    return pyarrow.decompress(raw, decompressed_size=size, codec="snappy").to_pybytes()
  except (OSError, ValueError) as e:
    raise UserError(f"{where}: a Snappy block does not decompress ({e}); the index is "
                    "damaged, copy the checkpoint again") from None


def _block(data: bytes, offset: int, size: int, where: str) -> memoryview:
  """The contents of the block at (offset, size), its checksum checked, decompressed."""
  end = offset + size + _TRAILER
  if offset < 0 or end > len(data):
    raise UserError(f"{where}: a block at offset {offset} runs past the end of the file "
                    f"({len(data)} bytes); the index is truncated or damaged, copy it again")
  contents, kind = data[offset:offset + size], data[offset + size]
  stored = struct.unpack_from("<I", data, offset + size + 1)[0]
  if masked_crc(bytes([kind]), google_crc32c.value(contents)) != stored:
    raise UserError(f"{where}: the block at offset {offset} fails its crc32c checksum; "
                    "the index is damaged, copy the checkpoint again")
  if kind == 0:
    return memoryview(contents)
  if kind == 1:
    return memoryview(_snappy(contents, where))
  raise UserError(f"{where}: block compression type {kind} is unknown (TensorFlow writes 0, "
                  "none, or 1, Snappy); the index is damaged")


def _entries(block: memoryview, where: str):
  """(key, value) of each entry of a block, in order (keys share prefixes with the one
  before; the restart array at the end only speeds up seeks, not needed for a scan)."""
  if len(block) < 4:
    raise UserError(f"{where}: a block of {len(block)} bytes is too short; the index is damaged")
  restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
  limit = len(block) - 4 * (restarts + 1)
  if limit < 0:
    raise UserError(f"{where}: a block's restart count {restarts} exceeds its size; the "
                    "index is damaged")
  pos, key = 0, b""
  while pos < limit:
    shared, pos = _varint(block, pos, where)
    unshared, pos = _varint(block, pos, where)
    size, pos = _varint(block, pos, where)
    if shared > len(key) or pos + unshared + size > limit:
      raise UserError(f"{where}: an entry at byte {pos} of a block runs past it; the index "
                      "is damaged, copy the checkpoint again")
    key = key[:shared] + bytes(block[pos:pos + unshared])
    pos += unshared
    yield key, block[pos:pos + size]
    pos += size


def read_table(path: str) -> list[tuple[bytes, bytes]]:
  """Every (key, value) of the table file at `path`, in key order."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise UserError(f"{path}: no such file; a TensorFlow checkpoint needs its .index beside "
                    "its .data-* shards") from None
  if len(data) < _FOOTER or struct.unpack_from("<Q", data, len(data) - 8)[0] != _MAGIC:
    raise UserError(f"{path}: not a TensorFlow checkpoint index (no table footer magic at its "
                    "end); the file is truncated or damaged, copy it again")
  footer = memoryview(data)[len(data) - _FOOTER:]
  _, pos = _varint(footer, 0, path)  # the metaindex block's handle: TensorFlow writes it empty
  _, pos = _varint(footer, pos, path)
  index_offset, pos = _varint(footer, pos, path)
  index_size, _ = _varint(footer, pos, path)
  out = []
  for _, handle in _entries(_block(data, index_offset, index_size, path), path):
    offset, pos = _varint(handle, 0, path)
    size, _ = _varint(handle, pos, path)
    out.extend((k, bytes(v)) for k, v in _entries(_block(data, offset, size, path), path))
  return out


# ------------------------------------------------------------------------------ the bundle


@dataclasses.dataclass(frozen=True)
class Entry:
  """One tensor's record in the index.

  Attributes:
    dtype: numpy dtype name ('float32', 'bfloat16', 'int64', ...) or 'string'.
    shape: the tensor's shape.
    shard: the data shard holding it.
    offset, size: where its bytes are in that shard.
    crc32c: masked crc32c of those bytes.
  """

  dtype: str
  shape: tuple[int, ...]
  shard: int
  offset: int
  size: int
  crc32c: int


def prefix_of(path: str) -> str:
  """A bundle's prefix from the prefix or its `.index` file's path."""
  return path[:-len(INDEX_SUFFIX)] if path.endswith(INDEX_SUFFIX) else path


def is_bundle(path: str) -> bool:
  """`path` is a bundle's prefix or its .index file (on local disk)."""
  return os.path.isfile(prefix_of(path) + INDEX_SUFFIX)


class Bundle:
  """A TensorFlow V2 checkpoint bundle on local disk (see the module doc).

  Args:
    path: the prefix (`.../model.ckpt-1000000`) or its `.index` file.

  Raises:
    UserError: the index is missing or damaged, or records something this reader does not
      read (big-endian data, a partitioned variable).
  """

  def __init__(self, path: str):
    self.prefix = prefix_of(path)
    self.index_path = self.prefix + INDEX_SUFFIX
    rows = read_table(self.index_path)
    if not rows or rows[0][0] != b"":
      raise UserError(f"{self.index_path}: no bundle header (key ''); not a TensorFlow V2 "
                      "checkpoint index, or a damaged one")
    header = self._parse("BundleHeaderProto", rows[0][1], "its header")
    if header.endianness != 0:
      raise UserError(f"{self.index_path}: a big-endian checkpoint; t5forge reads the "
                      "little-endian ones every TensorFlow on x86 / ARM / TPU hosts writes")
    self.num_shards = max(int(header.num_shards), 1)
    self._entries: dict[str, Entry] = {}
    for key, value in rows[1:]:
      name = key.decode("utf-8", "replace")
      proto = self._parse("BundleEntryProto", value, f"tensor {name!r}")
      if len(proto.slices):
        raise UserError(f"{self.index_path}: tensor {name!r} is a partitioned variable "
                        f"({len(proto.slices)} slices); t5forge reads whole tensors only, "
                        "save it unpartitioned")
      if proto.dtype != _DT_STRING and proto.dtype not in _DTYPES:
        raise UserError(f"{self.index_path}: tensor {name!r} has TensorFlow dtype "
                        f"{proto.dtype}, which t5forge does not read")
      dtype = "string" if proto.dtype == _DT_STRING else _DTYPES[proto.dtype].name
      self._entries[name] = Entry(dtype, tuple(int(d.size) for d in proto.shape.dim),
                                  int(proto.shard_id), int(proto.offset), int(proto.size),
                                  int(proto.crc32c))

  def _parse(self, kind: str, value: bytes, what: str):
    msg = _MESSAGES[kind]()
    try:
      msg.ParseFromString(value)
    except message.DecodeError:
      raise UserError(f"{self.index_path}: {what} is not a valid {kind}; the index is "
                      "damaged, copy the checkpoint again") from None
    return msg

  def names(self) -> list[str]:
    """Every tensor name, sorted."""
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def entry(self, name: str) -> Entry:
    if name not in self._entries:
      raise UserError(f"{self.index_path}: no tensor {name!r} in this checkpoint")
    return self._entries[name]

  def shard_path(self, shard: int) -> str:
    return f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

  def check_shards(self) -> None:
    """Every data shard the tensors use exists, and is long enough for them."""
    ends: dict[int, tuple[int, str]] = {}
    for name, e in self._entries.items():
      if e.offset + e.size > ends.get(e.shard, (-1, ""))[0]:
        ends[e.shard] = (e.offset + e.size, name)
    for shard, (end, name) in sorted(ends.items()):
      path = self.shard_path(shard)
      if not os.path.isfile(path):
        raise UserError(f"{path}: missing; the checkpoint {self.prefix} has {self.num_shards} "
                        "data shards, copy all of them beside its .index")
      size = os.path.getsize(path)
      if size < end:
        raise UserError(f"{path}: truncated ({size} bytes, tensor {name!r} ends at byte "
                        f"{end}); copy the shard again")

  def read(self, name: str) -> np.ndarray:
    """The tensor `name` (a numpy array; strings as an object array of bytes), its
    checksum checked."""
    e = self.entry(name)
    path = self.shard_path(e.shard)
    try:
      with open(path, "rb") as f:
        f.seek(e.offset)
        raw = f.read(e.size)
    except FileNotFoundError:
      raise UserError(f"{path}: missing; the checkpoint {self.prefix} has {self.num_shards} "
                      "data shards, copy all of them beside its .index") from None
    if len(raw) != e.size:
      raise UserError(f"{path}: truncated: tensor {name!r} needs bytes [{e.offset}, "
                      f"{e.offset + e.size}), the file ends first; copy the shard again")
    if e.dtype == "string":
      return self._strings(name, e, raw, path)
    if masked_crc(raw) != e.crc32c:
      raise UserError(f"{path}: tensor {name!r} fails its crc32c checksum; the shard is "
                      "damaged, copy it again")
    dtype = np.dtype(ml_dtypes.bfloat16) if e.dtype == "bfloat16" else np.dtype(e.dtype)
    count = int(np.prod(e.shape, dtype=np.int64))
    if count * dtype.itemsize != e.size:
      raise UserError(f"{self.index_path}: tensor {name!r} has {e.size} bytes, its shape "
                      f"{e.shape} and dtype {e.dtype} need {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(e.shape)

  def _strings(self, name: str, e: Entry, raw: bytes, path: str) -> np.ndarray:
    # The checksum covers each length as little-endian uint32 (uint64 past 4 GiB: how
    # TensorFlow kept old checkpoints' sums valid), not its varint; then the stored masked
    # checksum of the lengths; then the string bytes.
    view, count = memoryview(raw), int(np.prod(e.shape, dtype=np.int64))
    lengths, pos, crc = [], 0, 0
    for _ in range(count):
      n, pos = _varint(view, pos, f"{path}: tensor {name!r}")
      lengths.append(n)
      crc = google_crc32c.extend(crc, struct.pack("<I" if n <= 0xFFFFFFFF else "<Q", n))
    crc = google_crc32c.extend(crc, raw[pos:pos + 4])
    pos += 4
    out = []
    for n in lengths:
      out.append(raw[pos:pos + n])
      pos += n
    crc = google_crc32c.extend(crc, raw[pos - sum(lengths):pos])
    if pos != len(raw) or masked_crc(b"", crc) != e.crc32c:
      raise UserError(f"{path}: tensor {name!r} fails its crc32c checksum; the shard is "
                      "damaged, copy it again")
    return np.array(out, dtype=object).reshape(e.shape)
