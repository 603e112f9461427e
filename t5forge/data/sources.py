"""Random-access data sources: TSV, JSONL, text lines, ArrayRecord, in-memory.

Two levels, as in SeqIO:

* A *split source* (`LineSource`, `TsvSource`, ... ) is one split's examples: a
  Grain random-access data source (`len(src)`, `src[i] -> dict`).
* A *data source* (`TsvDataSource({"train": pattern, "validation": pattern})`,
  ...) names the splits of a task and builds the split sources lazily.

Line-based files are read through `files.LineFiles`: a byte-offset index built
in one pass (which also validates UTF-8 and, for TSV, the field count of every
line), so `src[i]` is a seek, not a scan. Gzip and glob patterns are handled
there too. Empty lines are skipped everywhere.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from t5forge.data.files import LineFiles, expand_patterns, stamp
from t5forge.errors import UserError


# ----------------------------------------------------------------------------------- split sources


class SplitSource:
  """One split's examples: `len(src)`, `src[i] -> dict`; a Grain data source."""

  def __len__(self) -> int:
    raise NotImplementedError

  def __getitem__(self, i: int) -> dict[str, Any]:
    raise NotImplementedError

  def fingerprint(self) -> str:
    """Changes when the data changes (used as part of preprocessing cache keys)."""
    raise NotImplementedError

  def describe(self) -> str:
    return type(self).__name__


class LineSource(SplitSource):
  """Plain text, one example a line: `{"text": line}`."""

  def __init__(self, patterns: str | Sequence[str], *, field: str = "text",
               skip_header_lines: int = 0):
    self._lines = LineFiles(expand_patterns(patterns), skip_header_lines)
    self._field = field

  def __len__(self):
    return len(self._lines)

  def __getitem__(self, i):
    return {self._field: self._lines.read(int(i))[0]}

  def fingerprint(self):
    return f"{_files_fingerprint(self._lines.files)}:{self._field}:{self._lines.skip}"

  def describe(self):
    return _describe_files(self._lines.files)


class TsvSource(SplitSource):
  """Tab-separated lines with named fields, e.g. `fields=("inputs", "targets")`.

  No quoting (as T5's `parse_tsv`): a field cannot contain a tab. Every line is
  checked for the field count when the source is opened.
  """

  def __init__(self, patterns: str | Sequence[str], *,
               fields: Sequence[str] = ("inputs", "targets"), skip_header_lines: int = 0):
    self._fields = tuple(fields)
    self._lines = LineFiles(expand_patterns(patterns), skip_header_lines)
    want = len(self._fields) - 1
    for f, path in enumerate(self._lines.files):
      tabs = self._lines.tabs(f)
      bad = np.flatnonzero(tabs != want)
      if bad.size:
        j = int(bad[0])
        line = int(self._lines.selected_line_numbers(f)[j]) + 1
        raise UserError(f"{path}:{line}: expected {len(self._fields)} tab-separated fields "
                        f"({', '.join(self._fields)}), found {int(tabs[j]) + 1}; "
                        "fix the line or the field names")

  def __len__(self):
    return len(self._lines)

  def __getitem__(self, i):
    text, _, _ = self._lines.read(int(i))
    return dict(zip(self._fields, text.split("\t")))

  def fingerprint(self):
    return f"{_files_fingerprint(self._lines.files)}:{','.join(self._fields)}:{self._lines.skip}"

  def describe(self):
    return _describe_files(self._lines.files)


class JsonlSource(SplitSource):
  """One JSON object a line."""

  def __init__(self, patterns: str | Sequence[str]):
    self._lines = LineFiles(expand_patterns(patterns))

  def __len__(self):
    return len(self._lines)

  def __getitem__(self, i):
    text, path, line = self._lines.read(int(i))
    try:
      value = json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{line}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
      raise UserError(f"{path}:{line}: expected a JSON object, found {type(value).__name__}")
    return value

  def fingerprint(self):
    return _files_fingerprint(self._lines.files)

  def describe(self):
    return _describe_files(self._lines.files)


class InMemorySource(SplitSource):
  """A list of example dicts held in memory."""

  def __init__(self, examples: Sequence[Mapping[str, Any]], *, name: str = "in-memory"):
    self._examples = list(examples)
    self._name = name
    for i, ex in enumerate(self._examples[:1]):
      if not isinstance(ex, Mapping):
        raise UserError(f"{name}: example {i} is a {type(ex).__name__}, expected a dict of "
                        "features")
    self._fp = None

  def __len__(self):
    return len(self._examples)

  def __getitem__(self, i):
    return dict(self._examples[int(i)])

  def fingerprint(self):
    if self._fp is None:
      h = hashlib.sha1()
      for ex in self._examples:
        h.update(repr(sorted((k, _stable_repr(v)) for k, v in ex.items())).encode())
      self._fp = h.hexdigest()[:20]
    return self._fp

  def describe(self):
    return self._name


class ArrayRecordSource(SplitSource):
  """ArrayRecord files (Grain's format); each record decoded by `decode`.

  Args:
    patterns: files or globs.
    decode: bytes -> dict; default JSON (UTF-8 object per record).
  """

  def __init__(self, patterns: str | Sequence[str], *,
               decode: Callable[[bytes], dict] | None = None):
    import grain
    self._files = expand_patterns(patterns)
    self._source = grain.sources.ArrayRecordDataSource(self._files)
    self._decode = decode or _json_record

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    return self._decode(self._source[int(i)])

  def fingerprint(self):
    return _files_fingerprint(self._files)

  def describe(self):
    return _describe_files(self._files)


def _json_record(data: bytes) -> dict:
  return json.loads(data.decode("utf-8"))


def _describe_files(files: Sequence[str]) -> str:
  # Error messages stay one readable line even for a glob of thousands of files.
  if len(files) <= 3:
    return ", ".join(files)
  return f"{', '.join(files[:3])} and {len(files) - 3} more"


def _files_fingerprint(files: Sequence[str]) -> str:
  h = hashlib.sha1()
  for path in files:
    size, mtime = stamp(path)
    h.update(f"{os.path.abspath(path)}|{size}|{mtime};".encode())
  return h.hexdigest()[:20]


def _stable_repr(v: Any) -> str:
  if isinstance(v, np.ndarray):
    digest = hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest()
    return f"array({v.dtype},{v.shape},{digest})"
  return repr(v)


# --------------------------------------------------------------------------- data sources (splits)

SplitSpec = str | Sequence[str] | Callable[[], str | Sequence[str]]


class DataSource:
  """A task's source: named splits, each built lazily into a `SplitSource`.

  Args:
    splits: split name -> spec; what a spec is depends on the subclass (file
      patterns here; a callable returning the patterns is resolved at first use,
      which lets a task build its files lazily).
  """

  def __init__(self, splits: Mapping[str, Any]):
    if not splits:
      raise UserError(f"{type(self).__name__} needs at least one split, e.g. "
                      "{'train': 'data/*.tsv'}")
    self._splits = dict(splits)
    self._built: dict[str, SplitSource] = {}
    self._lock = threading.Lock()

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._splits)

  def __getstate__(self):
    return {"splits": self._splits, "cls_state": self._extra_state()}

  def __setstate__(self, state):
    DataSource.__init__(self, state["splits"])
    self._restore_extra_state(state["cls_state"])

  def _extra_state(self) -> dict:
    return {}

  def _restore_extra_state(self, state: dict) -> None:
    pass

  def _build(self, split: str, spec: Any) -> SplitSource:
    raise NotImplementedError

  def get(self, split: str) -> SplitSource:
    """Returns the split's source, checking that it exists and is not empty."""
    if split not in self._splits:
      raise UserError(f"no split {split!r} in this source; available: {', '.join(self._splits)}")
    with self._lock:
      if split not in self._built:
        spec = self._splits[split]
        if callable(spec):
          spec = spec()
        source = self._build(split, spec)
        if len(source) == 0:
          raise UserError(f"split {split!r} is empty ({source.describe()}); it needs at least one "
                          "example")
        self._built[split] = source
      return self._built[split]

  def num_input_examples(self, split: str) -> int:
    return len(self.get(split))


class TextLineDataSource(DataSource):
  """Text files, one example a line (`{"text": line}`); SeqIO's TextLineDataSource."""

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], *, field: str = "text",
               skip_header_lines: int = 0):
    super().__init__(split_to_filepattern)
    self._field = field
    self._skip = skip_header_lines

  def _extra_state(self):
    return {"field": self._field, "skip": self._skip}

  def _restore_extra_state(self, state):
    self._field, self._skip = state["field"], state["skip"]

  def _build(self, split, spec):
    return LineSource(spec, field=self._field, skip_header_lines=self._skip)


class TsvDataSource(DataSource):
  """TSV files with named fields (`field_names=("inputs", "targets")`)."""

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], *,
               field_names: Sequence[str] = ("inputs", "targets"), skip_header_lines: int = 0):
    super().__init__(split_to_filepattern)
    self._fields = tuple(field_names)
    self._skip = skip_header_lines

  def _extra_state(self):
    return {"fields": self._fields, "skip": self._skip}

  def _restore_extra_state(self, state):
    self._fields, self._skip = state["fields"], state["skip"]

  def _build(self, split, spec):
    return TsvSource(spec, fields=self._fields, skip_header_lines=self._skip)


class JsonlDataSource(DataSource):
  """JSON-lines files, one object (example) a line."""

  def _build(self, split, spec):
    return JsonlSource(spec)


class ArrayRecordDataSource(DataSource):
  """ArrayRecord files; records are JSON objects unless `decode` says otherwise."""

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], *,
               decode: Callable[[bytes], dict] | None = None):
    super().__init__(split_to_filepattern)
    self._decode = decode

  def _extra_state(self):
    return {"decode": self._decode}

  def _restore_extra_state(self, state):
    self._decode = state["decode"]

  def _build(self, split, spec):
    return ArrayRecordSource(spec, decode=self._decode)


class InMemoryDataSource(DataSource):
  """Lists of example dicts per split: `InMemoryDataSource({"train": [{...}, ...]})`.

  A split's value may also be a callable returning the list (built at first use).
  """

  def _build(self, split, spec):
    return InMemorySource(spec, name=f"in-memory split {split!r}")


class FunctionDataSource(DataSource):
  """`dataset_fn(split) -> list of dicts`, called once per split (SeqIO's name)."""

  def __init__(self, dataset_fn: Callable[[str], Sequence[Mapping[str, Any]]],
               splits: Sequence[str]):
    super().__init__({s: s for s in splits})
    self._fn = dataset_fn

  def _extra_state(self):
    return {"fn": self._fn}

  def _restore_extra_state(self, state):
    self._fn = state["fn"]

  def _build(self, split, spec):
    name = getattr(self._fn, "__name__", "dataset_fn")
    return InMemorySource(self._fn(split), name=f"{name}({split!r})")
