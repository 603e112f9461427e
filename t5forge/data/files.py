"""Files: patterns, the user cache dir, atomic writes, and random access to lines.

A text file is never loaded whole. One pass builds a byte-offset index of its
lines (validating UTF-8 and counting the tabs of each line on the way); the index
is cached next to the file, or under the cache dir when that directory is not
writable, and rebuilt when the file's size or mtime changes. Reading line i is
then one `os.pread`. Gzipped files are decompressed once into the cache dir
(gzip cannot seek) and indexed there.

The cache dir (`cache_root()`) holds those copies and indexes, the vocabularies loaded
from checkpoints (`vocab/`) and the offline stage of `cache=True` tasks (`tasks/`). It is
`$T5FORGE_CACHE` when set, else `$XDG_CACHE_HOME/t5forge`, else `~/.cache/t5forge`.
`T5FORGE_CACHE=off` (or `none`) keeps nothing between runs: all of it, line indexes of
plain files included, goes to a temporary directory of the process (shared with the
processes it starts) that is removed when it exits.

Bucket paths (`gs://`, `s3://`): patterns expand with `storage.glob`, and every file is read
through its one local copy (`storage.local_copy`, under the cache dir, made again only when
the object's generation / ETag changes). Line indexes and decompressed copies then live
next to that copy, so they are keyed on the object version, not on a local mtime; messages
name the object's URL.
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import glob
import gzip
import hashlib
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from t5forge import files as t5files
from t5forge import storage
from t5forge.errors import UserError

_CHUNK = 16 << 20  # bytes read per step while indexing: bounds the memory used


# The cache directory and its T5FORGE_CACHE=off mode live with the rest of where bytes live.
cache_enabled = storage.cache_enabled
cache_root = storage.cache_root


@contextlib.contextmanager
def cache_path(path: str) -> Iterator[str]:
  """`t5forge.files.atomic_path` for a cache file: a temporary path renamed to `path` on
  success; an unwritable cache directory is a UserError naming T5FORGE_CACHE."""
  directory = os.path.dirname(path) or "."
  try:
    os.makedirs(directory, exist_ok=True)
    if not os.access(directory, os.W_OK):
      raise PermissionError(errno.EACCES, "Permission denied")
  except OSError as e:
    raise UserError(f"cannot write in {directory} ({e.strerror}); cache files go under "
                    f"{cache_root()}: set T5FORGE_CACHE to a writable directory") from None
  with t5files.atomic_path(path) as tmp:
    yield tmp


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to the cache file `path` through a temp file and a rename (no torn files)."""
  with cache_path(path) as tmp, open(tmp, "wb") as f:
    f.write(data)


def expand_patterns(patterns: str | Sequence[str]) -> list[str]:
  """Expands file names and glob patterns, in order; each must match something.

  Raises:
    UserError: a named file does not exist, or a pattern matched nothing.
  """
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  files = []
  for pattern in patterns:
    pattern = os.fspath(pattern)
    if storage.is_remote(pattern):
      files.extend(_expand_remote(storage.normalize(pattern)))
      continue
    pattern = os.path.expanduser(pattern)
    if glob.has_magic(pattern):
      matched = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
      if not matched:
        raise UserError(f"file pattern {pattern!r} matched no files; check the path")
      files.extend(matched)
    elif os.path.isfile(pattern):
      files.append(pattern)
    else:
      raise UserError(f"file not found: {pattern}")
  return files


def _expand_remote(pattern: str) -> list[str]:
  if glob.has_magic(pattern):
    matched = [p for p in storage.glob(pattern) if storage.isfile(p)]
    if not matched:
      raise UserError(f"file pattern {pattern!r} matched no objects; check the path")
    return matched
  if not storage.isfile(pattern):
    raise UserError(f"file not found: {pattern}")
  return [pattern]


def local_file(path: str) -> str:
  """`path` itself when local; for a bucket object, its local copy, made once per object
  version (`storage.local_copy`)."""
  return storage.local_copy(path)


def version_key(path: str) -> str:
  """Changes when the file is rewritten: its absolute path, size and mtime on disk; a bucket
  object's URL, size and generation / ETag."""
  if storage.is_remote(path):
    meta = storage.info(path)
    # Without a generation / ETag (a server that gives none), its last-modified time.
    version = meta["version"] if meta["version"] is not None else f"mtime-{meta['mtime']}"
    return f"{storage.normalize(path)}|{meta['size']}|{version}"
  size, mtime = stamp(path)
  return f"{os.path.abspath(path)}|{size}|{mtime}"


def _open_binary(path: str):
  local = local_file(path)
  return gzip.open(local, "rb") if path.endswith(".gz") else open(local, "rb")


def iter_lines(path: str) -> Iterator[tuple[int, str]]:
  """Streams `(line_number, text)` of a (gzipped) UTF-8 file, newline stripped."""
  with _open_binary(path) as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        yield lineno, raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        raise UserError(f"{path}:{lineno}: invalid UTF-8 ({e.reason} at byte {e.start}); "
                        "re-encode the file as UTF-8") from None


# -------------------------------------------------------------------------------------- line index


def stamp(path: str) -> tuple[int, int]:
  """(size, mtime_ns): changes when a file is rewritten."""
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


def _key(path: str) -> str:
  return hashlib.sha1(version_key(path).encode()).hexdigest()[:20]


def is_gzip(path: str) -> bool:
  """Whether the file starts with gzip's magic bytes."""
  with open(local_file(path), "rb") as f:
    return f.read(2) == b"\x1f\x8b"


def plain_copy(path: str, compression: str | None = None) -> str:
  """Returns a seekable uncompressed file for `path`, decompressing it once into the cache dir.

  Args:
    path: the file (a bucket object: decompressed from its local copy).
    compression: 'GZIP', 'ZLIB', '' (none), or None: gzip when the name ends in `.gz`.
  """
  if compression is None:
    compression = "GZIP" if path.endswith(".gz") else ""
  if not compression:
    return local_file(path)
  name = storage.basename(path)
  name = name[:-3] if name.endswith(".gz") else name + ".plain"
  out = os.path.join(cache_root(), "lines", f"{_key(path)}-{name}")
  if not os.path.exists(out):
    try:
      source = local_file(path)
      with cache_path(out) as tmp, open(tmp, "wb") as dst:
        if compression == "GZIP":
          with gzip.open(source, "rb") as src:
            while block := src.read(_CHUNK):
              dst.write(block)
        else:  # ZLIB: one zlib stream, as TensorFlow's ZLIB record option writes
          inflate = zlib.decompressobj()
          with open(source, "rb") as src:
            while block := src.read(_CHUNK):
              dst.write(inflate.decompress(block))
          dst.write(inflate.flush())
          if not inflate.eof:
            raise EOFError("the zlib stream ends early")
    except (OSError, EOFError, zlib.error) as e:
      raise UserError(f"{path}: cannot decompress as {compression} ({e}); is it a complete "
                      f"{compression.lower()} file?") from None
  return out


def _index_paths(plain: str, origin: str, suffix: str, beside_ok: bool) -> list[str]:
  """Where an index may live: next to the file first (when `beside_ok`), then in the cache
  dir (only there with the cache off: nothing is left beside the user's data)."""
  name = f".{os.path.basename(plain)}.{suffix}"
  beside = os.path.join(os.path.dirname(os.path.abspath(plain)), name)
  cached = os.path.join(cache_root(), "lines", f"{_key(plain)}.{suffix}")
  if plain != origin:  # a decompressed copy already lives in the cache dir
    return [beside]
  return [beside, cached] if cache_enabled() and beside_ok else [cached]


def load_index(path: str, plain: str, suffix: str,
               build: Callable[[str, str], np.ndarray], beside_ok: bool = True) -> np.ndarray:
  """A per-file index, built once and cached, rebuilt when the file changes.

  Args:
    path: the user's file (for messages).
    plain: the seekable file the index describes (`plain_copy(path)`).
    suffix: names the kind of index (`t5forge-lines.npy`, ...).
    build: `(plain, path) -> int64 [n + 1, k]` whose row 0 starts with the file's
      (size, mtime_ns) (`stamp`).
    beside_ok: the index may be written next to the file (else only in the cache dir).

  Returns:
    The index without its stamp row, `[n, k]`, memory-mapped when it was cached.
  """
  current = stamp(plain)
  candidates = _index_paths(plain, path, suffix, beside_ok)
  for cand in candidates:
    if os.path.exists(cand):
      try:
        index = np.load(cand, mmap_mode="r")
        if index.ndim == 2 and tuple(index[0, :2]) == current:
          return index[1:]
      except (OSError, ValueError):
        pass  # a corrupt or foreign file: rebuild below
  index = build(plain, path)
  for cand in candidates:
    try:
      with t5files.atomic_file(cand, binary=True) as f:
        np.save(f, index)
      break
    except OSError:
      continue  # read-only directory: fall back to the cache dir
  return index[1:]


def _build_index(plain: str, origin: str) -> np.ndarray:
  """One pass over the file: line offsets and tab counts, validating UTF-8.

  Returns:
    int64 [num_lines + 2, 2]: row 0 is (size, mtime_ns) of the file; row 1 + i is
    (byte offset of line i, number of tabs in line i); the last row is (size, 0).
  """
  size, mtime = stamp(plain)
  offsets, tabs = [np.zeros(1, np.int64)], []
  pos, line_base, carry = 0, 0, b""
  with open(plain, "rb") as f:
    while True:
      chunk = f.read(_CHUNK)
      data = carry + chunk
      if not chunk:
        block, carry = data, b""
      else:
        cut = data.rfind(b"\n") + 1
        block, carry = data[:cut], data[cut:]
      if block:
        try:
          block.decode("utf-8")
        except UnicodeDecodeError as e:
          line = line_base + block.count(b"\n", 0, e.start) + 1
          raise UserError(f"{origin}:{line}: invalid UTF-8 ({e.reason}); "
                          "re-encode the file as UTF-8") from None
        arr = np.frombuffer(block, np.uint8)
        ends = np.flatnonzero(arr == 10) + 1  # exclusive end of each line
        if not chunk and (not ends.size or ends[-1] != len(block)):
          ends = np.append(ends, len(block))  # last line without a newline
        tab_cum = np.concatenate([[0], np.cumsum(arr == 9)])
        starts = np.concatenate([[0], ends[:-1]])
        tabs.append((tab_cum[ends] - tab_cum[starts]).astype(np.int64))
        offsets.append(pos + ends.astype(np.int64))
        pos += len(block)
        line_base += len(ends)
      if not chunk:
        break
  off = np.concatenate(offsets)
  tab = np.concatenate(tabs + [np.zeros(1, np.int64)])
  index = np.empty((len(off) + 1, 2), np.int64)
  index[0] = (size, mtime)
  index[1:, 0] = off
  index[1:, 1] = tab
  return index


def load_line_index(path: str) -> tuple[str, np.ndarray]:
  """Returns (seekable file, index rows [num_lines + 1, 2]) for `path`.

  The index (see `_build_index`) is loaded memory-mapped when cached and valid.
  """
  plain = plain_copy(path)
  return plain, load_index(path, plain, "t5forge-lines.npy", _build_index)


def sample_digest(path: str) -> str:
  """A digest of a file's size and of 64 KiB read at 16 evenly spaced places (the first
  and last bytes included): it does not depend on the file's name, directory or mtime, so
  it stays the same when data is copied, and changes when a file is rewritten, appended
  to or cut, without reading a large file whole. A bucket object: of its local copy."""
  path = local_file(path)
  size = os.path.getsize(path)
  h = hashlib.blake2b(str(size).encode(), digest_size=10)
  block = 1 << 16
  with open(path, "rb") as f:
    if size <= 16 * block:
      h.update(f.read())
    else:
      for k in range(16):
        f.seek((size - block) * k // 15)
        h.update(f.read(block))
  return h.hexdigest()


class Where:
  """'record R of FILE' for messages, formatted only when a message is: decoding passes one
  per record. `files` has `locate(i) -> (file number, record number)` and `paths`."""

  __slots__ = ("_files", "_i")

  def __init__(self, files, i: int):
    self._files, self._i = files, i

  def __str__(self) -> str:
    f, r = self._files.locate(self._i)
    return f"record {r} of {self._files.paths[f]}"

  def __format__(self, spec: str) -> str:
    return format(str(self), spec)


class RecordCounts:
  """Numbers the records of several files, file after file (a mixin; `_count_records`)."""

  def _count_records(self, paths: Sequence[str], counts: Sequence[int]) -> None:
    self._paths = list(paths)
    self._counts = [int(c) for c in counts]
    self._starts = [0]
    for c in self._counts:
      self._starts.append(self._starts[-1] + c)

  @property
  def paths(self) -> list[str]:
    return self._paths

  @property
  def counts(self) -> list[int]:
    """Records per file."""
    return list(self._counts)

  def __len__(self) -> int:
    return self._starts[-1]

  def locate(self, i: int) -> tuple[int, int]:
    """Global record index -> (file number, record number within the file)."""
    f = bisect.bisect_right(self._starts, i) - 1
    return f, i - self._starts[f]

  def where(self, i: int) -> Where:
    """Names record `i` in messages ('record R of FILE'), formatted only when used."""
    return Where(self, i)


class ProcessHandles:
  """One open handle a file, opened on first use and never shared with a forked child
  (Grain's workers): a subclass says how to open (`_open_handle`) and close one."""

  def _init_handles(self) -> None:
    self._handles: dict[int, Any] = {}
    self._pid = os.getpid()
    self._lock = threading.Lock()

  def _open_handle(self, f: int) -> Any:
    raise NotImplementedError

  def _close_handle(self, handle: Any) -> None:
    raise NotImplementedError

  def _handle(self, f: int) -> Any:
    if os.getpid() != self._pid:  # after a fork, never share file offsets/handles
      self._handles, self._pid = {}, os.getpid()
    handle = self._handles.get(f)
    if handle is None:
      with self._lock:
        handle = self._handles.get(f)
        if handle is None:
          handle = self._handles[f] = self._open_handle(f)
    return handle

  def __del__(self):
    for handle in getattr(self, "_handles", {}).values():
      try:
        self._close_handle(handle)
      except Exception:  # noqa: BLE001 (closing at interpreter exit: nothing to report to)
        pass


class PlainFiles(ProcessHandles):
  """Reads byte ranges of several seekable files (`pread`)."""

  def __init__(self, plain: Sequence[str]):
    self._plain = list(plain)
    self._init_handles()

  def _open_handle(self, f: int) -> int:
    return os.open(self._plain[f], os.O_RDONLY)

  def _close_handle(self, handle: int) -> None:
    os.close(handle)

  def pread(self, f: int, size: int, offset: int) -> bytes:
    """`size` bytes of file `f` from byte `offset`."""
    return os.pread(self._handle(f), size, offset)


class LineFiles(PlainFiles):
  """Random access to the non-empty lines of several files, in file order.

  Args:
    files: the files (plain or .gz).
    skip_header_lines: non-empty lines to drop at the start of every file.
  """

  def __init__(self, files: Sequence[str], skip_header_lines: int = 0):
    self._files = list(files)
    self._skip = skip_header_lines
    plain_files: list[str] = []
    self._rows: list[np.ndarray | None] = []  # selected line numbers, None = all
    self._index: list[np.ndarray] = []
    counts = []
    for path in self._files:
      plain, index = load_line_index(path)
      lengths = np.diff(index[:, 0])
      # A line's length includes its newline: empty lines are not examples.
      nonempty = lengths > 1
      if lengths.size:
        last_has_nl = _ends_with_newline(plain, int(index[-1, 0]))
        nonempty[-1] = lengths[-1] > (1 if last_has_nl else 0)
      rows = None
      if not nonempty.all() or skip_header_lines:
        rows = np.flatnonzero(nonempty)[skip_header_lines:]
      plain_files.append(plain)
      self._index.append(index)
      self._rows.append(rows)
      counts.append(len(nonempty) if rows is None else len(rows))
    self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    super().__init__(plain_files)

  @property
  def files(self) -> list[str]:
    return self._files

  @property
  def skip(self) -> int:
    return self._skip

  def __len__(self) -> int:
    return int(self._starts[-1])

  def locate(self, i: int) -> tuple[int, int]:
    """Global example index -> (file number, line number within the file)."""
    f = int(np.searchsorted(self._starts, i, side="right")) - 1
    j = i - int(self._starts[f])
    rows = self._rows[f]
    return f, (int(rows[j]) if rows is not None else j)

  def tabs(self, f: int) -> np.ndarray:
    """Tab counts of the selected lines of file `f`."""
    t = self._index[f][:-1, 1]
    return t if self._rows[f] is None else t[self._rows[f]]

  def selected_line_numbers(self, f: int) -> np.ndarray:
    n = len(self._index[f]) - 1
    return np.arange(n) if self._rows[f] is None else self._rows[f]

  def read(self, i: int) -> tuple[str, str, int]:
    """Returns (line text, origin file, 1-based line number) of example `i`."""
    if not 0 <= i < len(self):
      raise IndexError(f"index {i} out of range for {len(self)} lines")
    f, line = self.locate(i)
    start, end = self._index[f][line, 0], self._index[f][line + 1, 0]
    raw = self.pread(f, int(end - start), int(start))
    return raw.decode("utf-8").rstrip("\r\n"), self._files[f], line + 1

  def content_digest(self) -> str:
    """Identifies the selected lines' content, not where the files are (`sample_digest`
    of each file and the line offsets)."""
    h = hashlib.blake2b(str(self._skip).encode(), digest_size=10)
    for path, index, rows in zip(self._files, self._index, self._rows):
      h.update(sample_digest(path).encode())
      h.update(np.ascontiguousarray(index[:, 0]).tobytes())
      if rows is not None:
        h.update(np.ascontiguousarray(rows).tobytes())
    return h.hexdigest()

  def __getstate__(self):
    return {"files": self._files, "skip": self._skip}

  def __setstate__(self, state):
    self.__init__(state["files"], state["skip"])


def _ends_with_newline(plain: str, size: int) -> bool:
  if size == 0:
    return False
  with open(plain, "rb") as f:
    f.seek(size - 1)
    return f.read(1) == b"\n"
