"""Random access to ArrayRecord files (Grain's, MaxText's and TFDS's `array_record` format).

The sources that read ArrayRecord files (`sources.ArrayRecordSource`, TFDS shards, SeqIO
caches) read through `ArrayRecordFiles`: one reader a file, opened in the process that
reads (Grain's worker processes reopen their own), with the reader's read-ahead and
thread pool off. A task shuffles every split globally, so reads are single records in
random order: read-ahead fetches chunks that the next read does not want, and the pool's
threads compete with the pipeline's own work for the cores.

A file in a bucket is read through its local copy (`files.local_file`: one per object
version, under the cache dir); the C++ reader wants a seekable local file.
"""
from __future__ import annotations

from collections.abc import Sequence

from t5forge.data.files import ProcessHandles, RecordCounts, local_file
from t5forge.errors import UserError

_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


def _unreadable(path: str, e: Exception) -> UserError:
  detail = str(e).splitlines()[0] if str(e) else type(e).__name__
  return UserError(f"{path}: not a readable ArrayRecord file ({detail}); copy or write it "
                   "again")


def _open(local: str, path: str):
  from array_record.python.array_record_module import ArrayRecordReader  # noqa: PLC0415 (slow import, on first use)
  try:
    return ArrayRecordReader(local, _OPTIONS)
  except Exception as e:  # noqa: BLE001 (the C++ reader raises RuntimeError / ValueError / OSError)
    raise _unreadable(path, e) from None


def _count(local: str, path: str) -> int:
  """The file's number of records; a damaged file fails here, when the source is built.
  `local` is what is read, `path` what messages name."""
  reader = _open(local, path)
  try:
    n = reader.num_records()
    reader.close()  # the reader checks the file's footer as it closes
    return n
  except Exception as e:  # noqa: BLE001
    raise _unreadable(path, e) from None


class ArrayRecordFiles(ProcessHandles, RecordCounts):
  """The records of several ArrayRecord files, in file order.

  Args:
    paths: the files (expanded).
    lengths: expected records per file (e.g. TFDS's `shardLengths`); a file holding
      another number is refused.
  """

  def __init__(self, paths: Sequence[str], lengths: Sequence[int] | None = None):
    counts = []
    self._local = [local_file(p) for p in paths]
    for k, path in enumerate(paths):
      counts.append(_count(self._local[k], path))
      if lengths is not None and counts[-1] != int(lengths[k]):
        raise UserError(f"{path}: holds {counts[-1]} records where {int(lengths[k])} are "
                        "recorded for it; the file is incomplete or from another version of "
                        "the dataset: copy or prepare it again")
    self._count_records(paths, counts)
    self._init_handles()

  def _open_handle(self, f: int):
    return _open(self._local[f], self._paths[f])

  def _close_handle(self, handle) -> None:
    handle.close()

  def read(self, i: int) -> bytes:
    """The bytes of record `i`."""
    if not 0 <= i < len(self):
      raise IndexError(f"record {i} out of range for {len(self)} records")
    f, r = self.locate(i)
    # The range form: the list form's cost grows with the number of records in the file.
    return self._handle(f).read(r, r + 1)[0]

  def __getstate__(self):
    return {"paths": self._paths, "counts": self._counts}

  def __setstate__(self, state):
    self.__init__(state["paths"], state["counts"])

