"""Random access to ArrayRecord files (Grain's, MaxText's and TFDS's `array_record` format).

The sources that read ArrayRecord files (`sources.ArrayRecordSource`, TFDS shards, SeqIO
caches) read through `ArrayRecordFiles`: one reader a file, opened in the process that
reads (Grain's worker processes reopen their own), with the reader's read-ahead and
thread pool off. A task shuffles every split globally, so reads are single records in
random order: read-ahead fetches chunks that the next read does not want, and the pool's
threads compete with the pipeline's own work for the cores.
"""
from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence

from t5forge.data.files import Where
from t5forge.errors import UserError

_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


def _unreadable(path: str, e: Exception) -> UserError:
  detail = str(e).splitlines()[0] if str(e) else type(e).__name__
  return UserError(f"{path}: not a readable ArrayRecord file ({detail}); copy or write it "
                   "again")


def _open(path: str):
  from array_record.python.array_record_module import ArrayRecordReader
  try:
    return ArrayRecordReader(path, _OPTIONS)
  except Exception as e:  # the C++ reader raises RuntimeError / ValueError / OSError
    raise _unreadable(path, e) from None


def _count(path: str) -> int:
  """The file's number of records; a damaged file fails here, when the source is built."""
  reader = _open(path)
  try:
    n = reader.num_records()
    reader.close()  # the reader checks the file's footer as it closes
    return n
  except Exception as e:
    raise _unreadable(path, e) from None


class ArrayRecordFiles:
  """The records of several ArrayRecord files, in file order.

  Args:
    paths: the files (expanded).
    lengths: expected records per file (e.g. TFDS's `shardLengths`); a file holding
      another number is refused.
  """

  def __init__(self, paths: Sequence[str], lengths: Sequence[int] | None = None):
    self._paths = list(paths)
    counts = []
    for k, path in enumerate(self._paths):
      counts.append(_count(path))
      if lengths is not None and counts[-1] != int(lengths[k]):
        raise UserError(f"{path}: holds {counts[-1]} records where {int(lengths[k])} are "
                        "recorded for it; the file is incomplete or from another version of "
                        "the dataset: copy or prepare it again")
    self._counts = counts
    self._starts = [0]
    for c in counts:
      self._starts.append(self._starts[-1] + c)
    self._readers: dict[int, object] = {}
    self._pid = os.getpid()
    self._lock = threading.Lock()

  @property
  def paths(self) -> list[str]:
    return list(self._paths)

  @property
  def counts(self) -> list[int]:
    return list(self._counts)

  def __len__(self) -> int:
    return self._starts[-1]

  def locate(self, i: int) -> tuple[int, int]:
    """Global record index -> (file number, record number within the file)."""
    f = bisect.bisect_right(self._starts, i) - 1
    return f, i - self._starts[f]

  def _reader(self, f: int):
    if os.getpid() != self._pid:  # a forked child opens its own
      self._readers, self._pid = {}, os.getpid()
    reader = self._readers.get(f)
    if reader is None:
      with self._lock:
        reader = self._readers.get(f)
        if reader is None:
          reader = self._readers[f] = _open(self._paths[f])
    return reader

  def read(self, i: int) -> bytes:
    """The bytes of record `i`."""
    if not 0 <= i < len(self):
      raise IndexError(f"record {i} out of range for {len(self)} records")
    f, r = self.locate(i)
    # The range form: the list form's cost grows with the number of records in the file.
    return self._reader(f).read(r, r + 1)[0]

  def where(self, i: int) -> Where:
    """Names record `i` in messages ('record R of FILE'), formatted only when used."""
    return Where(self, i)

  def __getstate__(self):
    return {"paths": self._paths, "counts": self._counts}

  def __setstate__(self, state):
    self.__init__(state["paths"], state["counts"])

  def __del__(self):
    for reader in getattr(self, "_readers", {}).values():
      try:
        reader.close()
      except Exception:  # closing at interpreter exit: nothing to report to
        pass
