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
import inspect
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from t5forge.data import tf_example
from t5forge.data.array_records import ArrayRecordFiles
from t5forge.data.files import LineFiles, expand_patterns, sample_digest, version_key
from t5forge.errors import UserError


# ----------------------------------------------------------------------------------- split sources


class SplitSource:
  """One split's examples: `len(src)`, `src[i] -> dict`; a Grain data source."""

  def __len__(self) -> int:
    raise NotImplementedError

  def __getitem__(self, i: int) -> dict[str, Any]:
    raise NotImplementedError

  def fingerprint(self) -> str:
    """Changes when the data changes (used as part of preprocessing cache keys); may
    include where the data is and when it was written."""
    raise NotImplementedError

  def content_fingerprint(self) -> str:
    """Identifies the examples and their order, not where they are: the same after the
    data is copied or moved, different when it is rewritten. A data iterator's saved
    state carries it, so that resuming on other data is refused."""
    return self.fingerprint()

  def describe(self) -> str:
    return type(self).__name__

  def shards(self) -> list[tuple[int, int]]:
    """The split's input shards as [start, stop) index ranges that tile [0, len): one per
    file where the examples come from files (SeqIO's `list_shards`), else one. A SeqIO
    cache gets at least this many output shards, and each is preprocessed apart."""
    return [(0, len(self))]


def ranges_of(counts: Sequence[int]) -> list[tuple[int, int]]:
  """Consecutive [start, stop) ranges of the given lengths, e.g. [2, 3] -> [(0, 2), (2, 5)]."""
  out, start = [], 0
  for n in counts:
    out.append((start, start + int(n)))
    start += int(n)
  return out


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
    return f"{files_fingerprint(self._lines.files)}:{self._field}:{self._lines.skip}"

  def content_fingerprint(self):
    return f"{self._lines.content_digest()}:{self._field}"

  def describe(self):
    return describe_files(self._lines.files)


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
    return f"{files_fingerprint(self._lines.files)}:{','.join(self._fields)}:{self._lines.skip}"

  def content_fingerprint(self):
    return f"{self._lines.content_digest()}:{','.join(self._fields)}"

  def describe(self):
    return describe_files(self._lines.files)


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
    return files_fingerprint(self._lines.files)

  def content_fingerprint(self):
    return self._lines.content_digest()

  def describe(self):
    return describe_files(self._lines.files)


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
    decode: 'json', 'tf_example', 'auto' (by the first record) or a callable
      `bytes -> dict`; see `ArrayRecordDataSource`.
    description: a `tf_example.ExampleDecoder` for 'tf_example' records.
  """

  def __init__(self, patterns: str | Sequence[str], *,
               decode: str | Callable[[bytes], dict] = "auto",
               description: tf_example.ExampleDecoder | None = None):
    self._files = expand_patterns(patterns)
    self._records = ArrayRecordFiles(self._files)
    self._mode = decode if isinstance(decode, str) else "callable"
    if decode == "auto":
      first = self._records.read(0) if len(self._records) else b"{}"
      self._mode = "tf_example" if tf_example.looks_like_example(first) else "json"
    if self._mode == "tf_example":
      self._decode = description or tf_example.ExampleDecoder()
    else:
      self._decode = _json_record if self._mode == "json" else decode

  def __len__(self):
    return len(self._records)

  def __getitem__(self, i):
    i = int(i)
    data = self._records.read(i)
    if self._mode == "callable":
      return self._decode(data)
    return self._decode(data, self._records.where(i))

  def fingerprint(self):
    return f"{files_fingerprint(self._files)}:{self._mode}:{_decoder_key(self._decode)}"

  def content_fingerprint(self):
    return f"{files_content_digest(self._files)}:{self._mode}"

  def describe(self):
    return describe_files(self._files)


def _decoder_key(decode: Any) -> str:
  if isinstance(decode, tf_example.ExampleDecoder):
    return repr(decode.description)
  return getattr(decode, "__qualname__", type(decode).__name__)


def _json_record(data: bytes, where: str = "a record") -> dict:
  try:
    value = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    hint = (" (it looks like a tf.train.Example: decode='tf_example')"
            if tf_example.looks_like_example(data) else "")
    raise UserError(f"{where}: not a UTF-8 JSON object ({type(e).__name__}){hint}") from None
  if not isinstance(value, dict):
    raise UserError(f"{where}: expected a JSON object, found {type(value).__name__}")
  return value


def files_content_digest(paths: Sequence[str]) -> str:
  """`files.sample_digest` of each file, in order: the files' content, not their names."""
  h = hashlib.blake2b(digest_size=10)
  for path in paths:
    h.update(sample_digest(path).encode())
  return h.hexdigest()


def describe_files(files: Sequence[str]) -> str:
  # Error messages stay one readable line even for a glob of thousands of files.
  if len(files) <= 3:
    return ", ".join(files)
  return f"{', '.join(files[:3])} and {len(files) - 3} more"


def files_fingerprint(files: Sequence[str]) -> str:
  h = hashlib.sha1()
  for path in files:
    h.update(f"{version_key(path)};".encode())
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
    num_input_examples: split -> number of examples, as SeqIO's: returned by
      `num_input_examples(split)` (e.g. for mixing rates) without opening the split.
    caching_permitted: SeqIO's; False forbids keeping this source's preprocessed
      examples on disk (`Task(cache=True)` is refused).
  """

  def __init__(self, splits: Mapping[str, Any] | None, *,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    # None: the splits are known only once the data is opened (a subclass's `splits`).
    if splits is not None and not splits:
      raise UserError(f"{type(self).__name__} needs at least one split, e.g. "
                      "{'train': 'data/*.tsv'}")
    self._splits = dict(splits) if splits is not None else None
    if num_input_examples is not None:
      if not isinstance(num_input_examples, Mapping):
        raise UserError(f"{type(self).__name__}: num_input_examples must be a dict of split -> "
                        f"count, got {type(num_input_examples).__name__}")
      unknown = sorted(set(num_input_examples) - set(self._splits or num_input_examples))
      if unknown:
        raise UserError(f"{type(self).__name__}: num_input_examples names split(s) "
                        f"{', '.join(map(repr, unknown))} that the source does not have "
                        f"({', '.join(self._splits)})")
      num_input_examples = {k: int(v) for k, v in num_input_examples.items()}
    self._num_input_examples = num_input_examples
    self.caching_permitted = bool(caching_permitted)
    self._built: dict[str, SplitSource] = {}
    self._lock = threading.Lock()

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._splits)

  def __getstate__(self):
    # Built split sources hold open files and indexes; a worker process rebuilds them.
    state = dict(self.__dict__)
    state["_built"], state["_lock"] = {}, None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def _spec(self, split: str) -> Any:
    """What `_build` gets for `split` (a callable spec is called once, here)."""
    spec = self._splits[split]
    return spec() if callable(spec) else spec

  def _build(self, split: str, spec: Any) -> SplitSource:
    raise NotImplementedError

  def get(self, split: str) -> SplitSource:
    """Returns the split's source, checking that it exists and is not empty."""
    splits = self.splits
    if split not in splits:
      raise UserError(f"no split {split!r} in {self!r}; available: {', '.join(splits)}")
    with self._lock:
      if split not in self._built:
        source = self._build(split, self._spec(split))
        if len(source) == 0:
          raise UserError(f"split {split!r} is empty ({source.describe()}); it needs at least one "
                          "example")
        self._built[split] = source
      return self._built[split]

  def __repr__(self):
    return f"{type(self).__name__}({list(self._splits or ())})"

  def num_input_examples(self, split: str) -> int:
    """The split's number of examples: SeqIO's `num_input_examples` when given, else
    counted (opening the split, without reading every example where the format records
    it)."""
    if self._num_input_examples is not None and split in self._num_input_examples:
      return self._num_input_examples[split]
    return len(self.get(split))


_INTERLEAVE_NOTE = ("t5forge shuffles every split globally (each epoch a new permutation of all "
                    "examples), so files need no shuffle buffer or interleave")


def interleave_keywords(owner: str, file_shuffle_buffer_size: int | None, cycle_length: int,
                        block_length: int) -> None:
  """SeqIO's file-reading keywords, accepted so ported sources run; they would tune
  tf.data's file interleave, which a global shuffle does not need. A value other than
  SeqIO's default is reported once."""
  given = [f"{k}={v}" for k, v, default in (
      ("file_shuffle_buffer_size", file_shuffle_buffer_size, None),
      ("cycle_length", cycle_length, 16), ("block_length", block_length, 16)) if v != default]
  if given:
    logging.getLogger(__name__).info("%s: %s has no effect: %s", owner, ", ".join(given),
                                     _INTERLEAVE_NOTE)


class TextLineDataSource(DataSource):
  """Text files, one example a line (`{"text": line}`); SeqIO's TextLineDataSource.

  `file_shuffle_buffer_size`, `cycle_length`, `block_length`: SeqIO's, accepted and not
  needed (`interleave_keywords`).
  """

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], skip_header_lines: int = 0,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True, file_shuffle_buffer_size: int | None = None,
               cycle_length: int = 16, block_length: int = 16, *, field: str = "text"):
    super().__init__(split_to_filepattern, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    interleave_keywords(type(self).__name__, file_shuffle_buffer_size, cycle_length,
                        block_length)
    self._field = field
    self._skip = skip_header_lines

  def _build(self, split, spec):
    return LineSource(spec, field=self._field, skip_header_lines=self._skip)


class TsvDataSource(DataSource):
  """TSV files with named fields (`field_names=("inputs", "targets")`)."""

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], *,
               field_names: Sequence[str] = ("inputs", "targets"), skip_header_lines: int = 0,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    super().__init__(split_to_filepattern, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    self._fields = tuple(field_names)
    self._skip = skip_header_lines

  def _build(self, split, spec):
    return TsvSource(spec, fields=self._fields, skip_header_lines=self._skip)


class JsonlDataSource(DataSource):
  """JSON-lines files, one object (example) a line."""

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], *,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    super().__init__(split_to_filepattern, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)

  def _build(self, split, spec):
    return JsonlSource(spec)


class ArrayRecordDataSource(DataSource):
  """ArrayRecord files (Grain's and MaxText's format, and TFDS's `array_record`).

  Args:
    split_to_filepattern: split -> files or globs.
    decode: how a record becomes an example: 'tf_example' (a serialized
      `tf.train.Example`, decoded with `feature_description`), 'json' (a UTF-8 JSON
      object), a callable `bytes -> dict`, or 'auto' (default): the first record of the
      split decides between the two formats (an Example starts with byte 0x0a, a JSON
      object with `{`).
    feature_description: for 'tf_example' (see `tf_example.ExampleDecoder`); None
      decodes every feature, a value where it holds one and a list otherwise.
  """

  def __init__(self, split_to_filepattern: Mapping[str, SplitSpec], *,
               decode: str | Callable[[bytes], dict] = "auto",
               feature_description: Mapping[str, Any] | None = None,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    super().__init__(split_to_filepattern, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    if not callable(decode) and decode not in ("auto", "json", "tf_example"):
      raise UserError(f"ArrayRecordDataSource: decode={decode!r}; use 'tf_example', 'json', "
                      "'auto' or a function of the record's bytes")
    if feature_description is not None and (callable(decode) or decode == "json"):
      raise UserError("ArrayRecordDataSource: feature_description is for tf.train.Example "
                      "records; remove it or use decode='tf_example'")
    self._decode = decode
    self._description = (tf_example.ExampleDecoder(feature_description)
                         if feature_description is not None else None)

  def _build(self, split, spec):
    return ArrayRecordSource(spec, decode=self._decode, description=self._description)


class InMemoryDataSource(DataSource):
  """Lists of example dicts per split: `InMemoryDataSource({"train": [{...}, ...]})`.

  A split's value may also be a callable returning the list (built at first use).
  """

  def __init__(self, splits: Mapping[str, Any], *,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    super().__init__(splits, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)

  def _build(self, split, spec):
    return InMemorySource(spec, name=f"in-memory split {split!r}")


class FunctionDataSource(DataSource):
  """SeqIO's `FunctionDataSource(dataset_fn, splits, num_input_examples=None,
  caching_permitted=True)`.

  `dataset_fn` is called once per split with the keywords it takes among SeqIO's
  (`split`, `shuffle_files`, `seed`): `dataset_fn(split=..., shuffle_files=False[, seed=0])`;
  a function taking one positional argument gets the split. It returns any iterable of
  example dicts (a list, a generator, ...), held in memory. `shuffle_files` is False and
  `seed` 0: the examples are shuffled globally by the task, by its own seed.
  """

  def __init__(self, dataset_fn: Callable[..., Iterable[Mapping[str, Any]]],
               splits: Sequence[str], num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    if isinstance(splits, str):
      splits = [splits]
    super().__init__({s: s for s in splits}, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    if not callable(dataset_fn):
      raise UserError(f"FunctionDataSource: dataset_fn must be a function, got "
                      f"{type(dataset_fn).__name__}")
    self._fn = dataset_fn

  def _build(self, split, spec):
    name = getattr(self._fn, "__name__", "dataset_fn")
    examples = _call_dataset_fn(self._fn, split)
    if isinstance(examples, Mapping) or not isinstance(examples, Iterable):
      raise UserError(f"FunctionDataSource: {name}(split={split!r}) returned a "
                      f"{type(examples).__name__}; it must return an iterable of example dicts")
    return InMemorySource(list(examples), name=f"{name}({split!r})")


def _call_dataset_fn(fn: Callable, split: str) -> Any:
  """Calls SeqIO's `dataset_fn(split, shuffle_files, seed=None)` with the keywords `fn`
  takes (a one-argument function gets the split)."""
  named = {"split": split, "shuffle_files": False, "seed": 0}
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return fn(split=split, shuffle_files=False)
  if any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return fn(**named)
  kwargs = {k: v for k, v in named.items()
            if k in params and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY}
  if "split" in kwargs:
    return fn(**kwargs)
  positional = [p for p in params.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in kwargs]
  if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
    raise UserError(f"FunctionDataSource: {getattr(fn, '__name__', 'dataset_fn')} takes no "
                    "split argument; write it as dataset_fn(split, shuffle_files)")
  return fn(split, **kwargs)
