"""Writing files so that readers never see half of one: the one home of atomic writes.

Every writer in t5forge goes through here. A file is written to a temporary sibling and
renamed over its name (`os.replace` is atomic on POSIX within one filesystem), so a reader,
a concurrent writer or a run killed half-way sees the old file or the new one, never a torn
one. A directory is written into a temporary sibling and renamed into place (`staged_dir`).

A `gs://` or `s3://` path has no rename: the file is written locally and sent as one
object (`t5forge.storage.upload`), which a bucket makes visible whole or not at all; a
directory is written locally and uploaded file by file, the files named in `last` after
the rest, so the one a reader takes as the mark of a complete copy comes last.

`jsonable` turns numpy scalars/arrays and bytes into what `json` accepts.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any

import numpy as np

from t5forge import storage
from t5forge.errors import UserError

# mkstemp makes 0600 files; what we write (checkpoint metadata, caches a team may share,
# predictions) is read like any other file.
_MODE = 0o644


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
  """Yields a temporary path beside `path`; on success it is renamed to `path`.

  For libraries that write by file name (ArrayRecord, pyarrow, numpy). On an exception the
  temporary file is removed and `path` is left as it was. The directory of `path` is created
  if missing; an unwritable directory raises OSError before anything is written.
  """
  if storage.is_remote(path):
    with tempfile.TemporaryDirectory(prefix="t5forge-write-") as tmpdir:
      tmp = os.path.join(tmpdir, storage.basename(path))
      yield tmp
      storage.upload(tmp, path)
    return
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.tmp-")
  os.close(fd)
  try:
    yield tmp
    os.chmod(tmp, _MODE)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False, fsync: bool = False) -> Iterator[IO]:
  """Yields a file object open for writing; on success it becomes `path` in one rename.

  As `atomic_path`. `fsync=True` flushes the bytes to disk before the rename (for files whose
  loss after a power cut would be worse than a stale copy).
  """
  with atomic_path(path) as tmp:
    with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
      yield f
      if fsync:
        f.flush()
        os.fsync(f.fileno())


def write_bytes(path: str, data: bytes, fsync: bool = False) -> None:
  """`data` -> `path`, atomically."""
  with atomic_file(path, binary=True, fsync=fsync) as f:
    f.write(data)


def write_text(path: str, text: str, fsync: bool = False) -> None:
  """`text` (UTF-8) -> `path`, atomically."""
  with atomic_file(path, fsync=fsync) as f:
    f.write(text)


def write_json(path: str, obj: Any, indent: int | None = 2, sort_keys: bool = False,
               fsync: bool = False) -> None:
  """`obj` (made `jsonable`) -> `path` as JSON, atomically."""
  with atomic_file(path, fsync=fsync) as f:
    json.dump(jsonable(obj), f, indent=indent, sort_keys=sort_keys, ensure_ascii=False)
    if indent is not None:
      f.write("\n")


def write_lines(path: str, rows: Iterable[Any]) -> int:
  """One JSON value per line (JSON Lines) -> `path`, atomically; returns the row count."""
  count = 0
  with atomic_file(path) as f:
    for row in rows:
      f.write(json.dumps(jsonable(row), ensure_ascii=False) + "\n")
      count += 1
  return count


@contextlib.contextmanager
def staged_dir(out_dir: str, last: tuple[str, ...] = ()) -> Iterator[str]:
  """Yields a temporary sibling of `out_dir` to write into, renamed into place at the end.

  The directory appears complete or not at all: a failure removes the sibling. An existing
  non-empty `out_dir` is refused (a UserError naming it) before anything is written. For a
  bucket URL the directory is local and uploaded at the end, the relative names in `last`
  after every other file.
  """
  if storage.is_remote(out_dir):
    out_dir = storage.normalize(out_dir)
    storage.check_bucket(out_dir)
    if storage.walk_files(out_dir):
      raise UserError(f"{out_dir}: exists and is not empty; choose a new output directory")
    with storage.staged_upload(out_dir, last=last) as tmp:
      yield tmp
    return
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise UserError(f"{out_dir}: exists and is not empty; choose a new output directory")
  tmp = out_dir + ".tmp-t5forge"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.exists(out_dir):
    os.rmdir(out_dir)
  os.rename(tmp, out_dir)


def jsonable(x: Any, bytes_encoding: str = "utf-8") -> Any:
  """numpy arrays/scalars -> lists/Python numbers, bytes -> str, mappings -> str-keyed dicts.

  Bytes are decoded with `bytes_encoding` (undecodable bytes replaced); "latin-1" maps every
  byte to one character and back, for values that must round-trip (grain iterator states).
  """
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, bytes):
    return x.decode(bytes_encoding, errors="replace")
  if isinstance(x, Mapping):
    return {str(k): jsonable(v, bytes_encoding) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v, bytes_encoding) for v in x]
  return x
