"""Parquet, Arrow and CSV files as random-access split sources, read with pyarrow.

A task shuffles every split globally, so `src[i]` is called once per example in random
order; reading must cost microseconds and not depend on where the row lies. Arrow IPC
files with uncompressed buffers allow that: memory-mapped, row i is a few offsets and the
row's own bytes. So:

* Arrow files (`datasets.save_to_disk`'s `data-0000N-of-0000M.arrow` streams, Feather v2 /
  IPC files) are mapped where they are, zero copy.
* Parquet and CSV cannot be read one row at a time (Parquet pages are compressed and
  encoded per row group, CSV has no index and quoted fields span lines), so each file is
  converted once, on first use, into an uncompressed Arrow IPC file under
  `<cache dir>/tables/` (`files.cache_root()`), written to a temp name and renamed, keyed
  by the file's path, size and mtime; then mapped. A Parquet split's length comes from the
  footers, so `len` and `num_input_examples` convert nothing.
* Files in a bucket (`gs://`, `s3://`; patterns too) are read through their local copy
  (`files.local_file`: one per object version, in the cache dir, made again when the
  generation / ETag changes), since mapping needs a local file; the converted copy is
  keyed on the object's URL, size and version.

Rows come back as HF `datasets` gives them with no format set: structs (`Translation`) as
dicts, lists as lists, ClassLabel as its int. The class names of ClassLabel columns, from
the `huggingface` schema metadata that `datasets` writes (or `dataset_info.json` beside
the files), are `src.label_names`, e.g. `{"length": ["short", "medium", "long"]}`.

pyarrow is imported on first use: `import t5forge.data` stays fast.
"""
from __future__ import annotations

import bisect
import csv
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from t5forge import storage
from t5forge.data import sources
from t5forge.data.files import cache_path, cache_root, expand_patterns, local_file, version_key
from t5forge.errors import UserError

# Part of the cache key of converted files: change it when the conversion changes.
_CONVERSION = "1"
# Rows per record batch of a converted file: bounds the memory used while converting.
_BATCH_ROWS = 16384
# Bytes of CSV parsed at a time; column types are inferred from the first block.
_CSV_BLOCK = 1 << 22
# memoryview formats of the fixed-width Arrow types (`str(arrow type)`).
_FORMATS = {"int8": "b", "uint8": "B", "int16": "h", "uint16": "H", "int32": "i",
            "uint32": "I", "int64": "q", "uint64": "Q", "float": "f", "double": "d"}
_ITEMSIZE = {"b": 1, "B": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8}


# ------------------------------------------------------------------------------ reading one row


def _view(buf, fmt: str) -> memoryview:
  """A typed memoryview of an Arrow buffer (no copy; empty for a missing buffer)."""
  if buf is None:
    return memoryview(b"").cast(fmt)
  mv = memoryview(buf)
  size = _ITEMSIZE[fmt]
  return mv[:len(mv) // size * size].cast(fmt)


def _cells(arr) -> Callable[[int], Any]:
  """A function `j -> arr[j]` as a Python value, reading the array's buffers directly.

  `arr[j].as_py()` builds a scalar object per call (a few microseconds a column);
  indexing memoryviews of the offsets and data buffers costs a tenth of that. Types
  without a fast path (dates, decimals, extension types, ...) fall back to `as_py`.
  """
  import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
  t, o, bufs = arr.type, arr.offset, arr.buffers()
  if pa.types.is_null(t):
    return lambda j: None
  if pa.types.is_dictionary(t):
    index, values = _cells(arr.indices), _cells(arr.dictionary)  # nulls live in the indices
    return lambda j: None if (k := index(j)) is None else values(k)
  fmt = _FORMATS.get(str(t)) if not isinstance(t, pa.ExtensionType) else None
  if fmt:
    vals = _view(bufs[1], fmt)
    get = lambda j: vals[j + o]
  elif pa.types.is_boolean(t):
    bits = _view(bufs[1], "B")
    get = lambda j: bool(bits[(j + o) >> 3] >> ((j + o) & 7) & 1)
  elif (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)):
    offs = _view(bufs[1], "i" if pa.types.is_string(t) or pa.types.is_binary(t) else "q")
    data = _view(bufs[2], "B")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
      get = lambda j: str(data[offs[j + o]:offs[j + o + 1]], "utf-8")
    else:
      get = lambda j: bytes(data[offs[j + o]:offs[j + o + 1]])
  elif pa.types.is_struct(t):
    # `field(k)` is the child already sliced like the struct (the parent's offset applied).
    pairs = tuple((t.field(k).name, _cells(arr.field(k))) for k in range(t.num_fields))
    get = lambda j: {name: cell(j) for name, cell in pairs}
  elif pa.types.is_list(t) or pa.types.is_large_list(t):
    # `values` ignores the list's offset: the offsets buffer indexes it directly.
    offs = _view(bufs[1], "i" if pa.types.is_list(t) else "q")
    values = arr.values
    vfmt = _FORMATS.get(str(values.type))
    if vfmt and values.null_count == 0:  # token ids and the like: one slice, one tolist
      vv, vo = _view(values.buffers()[1], vfmt), values.offset
      get = lambda j: vv[offs[j + o] + vo:offs[j + o + 1] + vo].tolist()
    else:
      child = _cells(values)
      get = lambda j: [child(x) for x in range(offs[j + o], offs[j + o + 1])]
  elif pa.types.is_fixed_size_list(t):
    child, n = _cells(arr.values), t.list_size
    get = lambda j: [child(x) for x in range((j + o) * n, (j + o + 1) * n)]
  else:
    return lambda j: arr[j].as_py()
  if arr.null_count:
    valid, inner = _view(bufs[0], "B"), get
    get = lambda j: inner(j) if valid[(j + o) >> 3] >> ((j + o) & 7) & 1 else None
  return get


def _map_ipc(path: str, origin: str):
  """Memory-maps an Arrow IPC file or stream: (schema, record batches), zero copy."""
  import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
  try:
    source = pa.memory_map(path, "r")
    if source.read(6) == b"ARROW1":  # the IPC file format (Feather v2) starts with its magic
      source.seek(0)
      reader = pa.ipc.open_file(source)
      batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
    else:
      source.seek(0)
      reader = pa.ipc.open_stream(source)
      batches = list(reader)
    return reader.schema, [b for b in batches if b.num_rows]
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{origin}: not a readable Arrow file ({first_line(e)}); is it complete? "
                    "copy or write it again") from None


def first_line(e: BaseException, limit: int = 200) -> str:
  """The first line of an exception's message, kept short: messages stay one line."""
  text = (str(e).strip().splitlines() or [type(e).__name__])[0]
  return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------ class names


def label_names_from_features(features: Mapping[str, Any]) -> dict[str, list[str]]:
  """ClassLabel names from HF `datasets` features (as `Features.to_dict()` writes them).

  A ClassLabel column gives its name; a Sequence/List of ClassLabel (NER tags) gives the
  column's name too; a ClassLabel inside a dict feature is named `outer.inner`.
  """
  out: dict[str, list[str]] = {}

  def walk(feature: Any, name: str) -> None:
    if isinstance(feature, list) and len(feature) == 1:  # the old `[feature]` list syntax
      walk(feature[0], name)
    elif not isinstance(feature, Mapping):
      return
    elif feature.get("_type") == "ClassLabel" and feature.get("names"):
      out[name] = [str(n) for n in feature["names"]]
    elif feature.get("_type") in ("Sequence", "List", "LargeList"):
      walk(feature.get("feature"), name)
    elif "_type" not in feature:
      for key, sub in feature.items():
        walk(sub, f"{name}.{key}" if name else key)

  walk(features, "")
  return out


def _schema_label_names(schema) -> dict[str, list[str]]:
  raw = (schema.metadata or {}).get(b"huggingface")
  if not raw:
    return {}
  try:
    return label_names_from_features(json.loads(raw).get("info", {}).get("features") or {})
  except (ValueError, AttributeError):
    return {}  # metadata of another writer: no class names rather than a failure


def _info_label_names(directory: str) -> dict[str, list[str]]:
  """ClassLabel names from the `dataset_info.json` that `save_to_disk` puts beside its files."""
  path = storage.join(directory, "dataset_info.json")
  try:
    return label_names_from_features(json.loads(storage.read_text(path)).get("features") or {})
  except (OSError, ValueError, AttributeError):
    return {}


# ------------------------------------------------------------------------------------ split sources


class TableSource(sources.SplitSource):
  """Rows of tabular files through memory-mapped Arrow IPC files; the formats' base.

  Subclasses say how a file becomes a mappable IPC file (`_ipc_file`) and may give its
  row count and schema without that (`_peek`).

  Args:
    patterns: files or globs, in order.
    columns: keep only these columns (in this order); None keeps all.
  """

  _format = "table"

  def __init__(self, patterns: str | Sequence[str], *, columns: Sequence[str] | None = None):
    if isinstance(columns, str):
      columns = [columns]
    self._files = expand_patterns(patterns)
    self._columns = tuple(columns) if columns is not None else None
    self._lock = threading.Lock()
    self._mapped: dict[int, tuple] = {}  # file number -> (schema, batches), while open
    self._batches = self._starts = self._rows = None
    counts, schemas = [], []
    for f, path in enumerate(self._files):
      count, schema = self._peek(f, path)
      counts.append(count)
      schemas.append(schema)
    self._names = self._check_columns(schemas)
    self._num_rows = sum(counts)
    labels = _schema_label_names(schemas[0]) if schemas else {}
    if not labels and self._files:
      first = self._files[0]
      labels = _info_label_names(storage.dirname(first) if storage.is_remote(first)
                                 else os.path.dirname(os.path.abspath(first)))
    self.label_names: dict[str, list[str]] = {
        k: v for k, v in labels.items() if k.split(".")[0] in self._names}

  # --- what subclasses provide

  def _ipc_file(self, path: str) -> str:
    """The uncompressed Arrow IPC file holding `path`'s rows (converted if need be)."""
    return local_file(path)

  def _peek(self, f: int, path: str):
    """(number of rows, Arrow schema) of file `f`; by default by mapping it now."""
    schema, batches = self._mapped[f] = _map_ipc(self._ipc_file(path), path)
    return sum(b.num_rows for b in batches), schema

  def _options(self) -> str:
    """What besides the files changes the rows (part of the fingerprints)."""
    return f"{self._format}:{','.join(self._columns or ())}"

  # --- the protocol

  def __len__(self):
    return self._num_rows

  def __getitem__(self, i):
    i = int(i)
    if not 0 <= i < self._num_rows:
      if -self._num_rows <= i < 0:
        i += self._num_rows
      else:
        raise IndexError(f"index {i} out of range for {self._num_rows} rows")
    if self._batches is None:
      self._open()
    b = bisect.bisect_right(self._starts, i) - 1
    row = self._rows[b]
    if row is None:
      row = self._rows[b] = self._row_reader(b)
    j = i - self._starts[b]
    return {name: cell(j) for name, cell in row}

  def fingerprint(self):
    return f"{sources.files_fingerprint(self._files)}:{self._options()}"

  def content_fingerprint(self):
    return f"{sources.files_content_digest(self._files)}:{self._options()}"

  def describe(self):
    return sources.describe_files(self._files)

  @property
  def column_names(self) -> tuple[str, ...]:
    """The columns of every row, in order."""
    return self._names

  def __getstate__(self):
    # Mapped files and row readers belong to this process; a worker maps the files again.
    state = dict(self.__dict__)
    state.update(_lock=None, _mapped={}, _batches=None, _starts=None, _rows=None)
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  # --- internals

  def _check_columns(self, schemas) -> tuple[str, ...]:
    first = tuple(schemas[0].names) if schemas else ()
    for path, schema in zip(self._files, schemas):
      names = tuple(schema.names)
      if self._columns is not None:
        missing = [c for c in self._columns if c not in names]
        if missing:
          raise UserError(f"{path}: no column {missing[0]!r}; its columns are: "
                          f"{', '.join(names)}; fix columns=")
      elif names != first:
        raise UserError(f"{path} has columns {', '.join(names)} but {self._files[0]} has "
                        f"{', '.join(first)}; pass columns= to read the common ones")
    return self._columns if self._columns is not None else first

  def _open(self) -> None:
    with self._lock:
      if self._batches is not None:
        return
      batches = []
      for f, path in enumerate(self._files):
        if f not in self._mapped:
          self._mapped[f] = _map_ipc(self._ipc_file(path), path)
        batches.extend(self._mapped[f][1])
      starts = [0]
      for batch in batches:
        starts.append(starts[-1] + batch.num_rows)
      if starts[-1] != self._num_rows:
        raise UserError(f"{self.describe()}: {starts[-1]} rows now, {self._num_rows} when opened; "
                        "the files changed while in use: start again")
      self._rows = [None] * len(batches)
      self._starts = starts[:-1]
      self._batches = batches

  def _row_reader(self, b: int) -> tuple:
    batch = self._batches[b]
    return tuple((name, _cells(batch.column(name))) for name in self._names)


def _table_cache_path(path: str, options: str) -> str:
  key = hashlib.sha1(f"{version_key(path)}|{options}|{_CONVERSION}".encode())
  return os.path.join(cache_root(), "tables",
                      f"{key.hexdigest()[:20]}-{storage.basename(path)}.arrow")


def _converted(path: str, options: str, write: Callable[[str], None]) -> str:
  """The cached IPC copy of `path`, written by `write(temp_path)` when missing.

  Written to a temp name and renamed: a reader sees a whole file or none, and workers
  converting the same file at once each publish a complete copy.
  """
  out = _table_cache_path(path, options)
  if os.path.exists(out):
    return out
  with cache_path(out) as tmp:
    write(tmp)
  return out


def _write_batches(tmp: str, schema, batches) -> None:
  import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
  with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
    for batch in batches:
      writer.write_batch(batch)


class ParquetSource(TableSource):
  """Parquet files (`Dataset.to_parquet`, the Hub's `refs/convert/parquet`, pandas, Spark).

  The row count and schema come from each file's footer when the source is opened;
  the rows are converted to the cache on the first `src[i]`.
  """

  _format = "parquet"

  def _peek(self, f, path):
    import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
    import pyarrow.parquet as pq  # noqa: PLC0415 (slow import, on first use)
    try:
      with pq.ParquetFile(local_file(path)) as pf:
        return pf.metadata.num_rows, pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
      raise UserError(f"{path}: not a readable Parquet file ({first_line(e)}); is it complete? "
                      "download or write it again") from None

  def _ipc_file(self, path):
    return _converted(path, self._options(), lambda tmp: self._convert(path, tmp))

  def _convert(self, path: str, tmp: str) -> None:
    import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
    import pyarrow.parquet as pq  # noqa: PLC0415 (slow import, on first use)
    try:
      with pq.ParquetFile(local_file(path)) as pf:
        schema = pf.schema_arrow
        if self._columns is not None:
          schema = pa.schema([schema.field(c) for c in self._columns], metadata=schema.metadata)
        batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=self._columns)
        _write_batches(tmp, schema, (pa.RecordBatch.from_arrays(b.columns, schema=schema)
                                     for b in batches))
    except (pa.ArrowException, OSError) as e:
      raise UserError(f"{path}: cannot read its Parquet data ({first_line(e)}); is it complete? "
                      "download or write it again") from None


class ArrowSource(TableSource):
  """Arrow files: IPC streams (`datasets.save_to_disk`'s `data-*.arrow`, `Dataset`'s
  cache files) and IPC files (Feather v2), mapped where they are.

  Buffers compressed inside the file (an IPC option, rarely used) are decompressed
  into memory when the file is opened.
  """

  _format = "arrow"


class CsvSource(TableSource):
  """CSV files with a header row of column names (what `run_translation.py --train_file
  x.csv` reads): RFC 4180 quoting, so quoted fields may hold delimiters, doubled quotes and
  newlines. Column types are inferred (integers, floats, text) as pyarrow does.

  Args:
    patterns: files or globs (`.gz`, `.bz2`, `.zst` are decompressed).
    columns: keep only these columns.
    delimiter: the field separator, e.g. "\\t" for TSV with quoting.
  """

  _format = "csv"

  def __init__(self, patterns: str | Sequence[str], *, columns: Sequence[str] | None = None,
               delimiter: str = ","):
    if not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in "\"\r\n":
      raise UserError(f"CSV delimiter must be one character other than a quote or newline, "
                      f"got {delimiter!r}")
    self._delimiter = delimiter
    super().__init__(patterns, columns=columns)

  def _options(self):
    return f"{super()._options()}:{self._delimiter!r}"

  def _ipc_file(self, path):
    # All columns are converted (the copy serves any `columns`); it must exist to count rows.
    return _converted(path, f"csv:{self._delimiter!r}", lambda tmp: self._convert(path, tmp))

  def _convert(self, path: str, tmp: str) -> None:
    import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
    import pyarrow.csv as pcsv  # noqa: PLC0415 (slow import, on first use)
    source = local_file(path)
    parse = pcsv.ParseOptions(delimiter=self._delimiter, newlines_in_values=True)
    read = pcsv.ReadOptions(block_size=_CSV_BLOCK)
    types: dict[str, Any] = {}
    # Types are inferred from the first block; a later value that does not fit (a float
    # after integers, text after numbers) starts again with that column widened.
    while True:
      try:
        reader = pcsv.open_csv(source, read_options=read, parse_options=parse,
                               convert_options=pcsv.ConvertOptions(column_types=types))
        _write_batches(tmp, reader.schema, reader)
        break
      except pa.ArrowInvalid as e:
        m = _CONVERSION_ERROR.search(str(e))
        if not m:
          raise UserError(self._csv_error(path, e)) from None
        header = pcsv.open_csv(source, read_options=read, parse_options=parse).schema.names
        name = header[int(m.group(1))]
        wider = pa.float64() if m.group(2).startswith(("int", "uint")) else pa.string()
        if types.get(name) == wider:
          raise UserError(self._csv_error(path, e)) from None
        types[name] = wider
      except (pa.ArrowException, OSError) as e:
        raise UserError(self._csv_error(path, e)) from None
    # pyarrow reads a quote left open to the end of the file as one long last field;
    # an odd number of quote characters gives it away.
    if _odd_quotes(path):
      bad = _unbalanced_quote(path, self._delimiter)
      if bad:
        raise UserError(bad)

  def _csv_error(self, path: str, e: BaseException) -> str:
    return _unbalanced_quote(path, self._delimiter) or (
        f"{path}: cannot read as CSV with delimiter {self._delimiter!r} ({first_line(e)}); "
        "fix the file or the delimiter")


_CONVERSION_ERROR = re.compile(r"In CSV column #(\d+): .*CSV conversion error to (\w+)")


def _odd_quotes(path: str) -> bool:
  import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
  count = 0
  with pa.input_stream(local_file(path), compression="detect") as f:
    while block := f.read(1 << 24):
      count += int(np.count_nonzero(np.frombuffer(block, np.uint8) == ord('"')))
  return count % 2 == 1


def _unbalanced_quote(path: str, delimiter: str) -> str | None:
  """Where Python's strict csv reader finds bad quoting (a one-line message), or None.

  Only called when something is wrong: pyarrow does the reading, this names the line.
  """
  import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
  line = 1
  try:
    with pa.input_stream(local_file(path), compression="detect") as raw:
      reader = csv.reader(io.TextIOWrapper(raw, encoding="utf-8", newline=""),
                          delimiter=delimiter, strict=True)
      for _ in reader:
        line = reader.line_num + 1
  except csv.Error as e:
    return (f"{path}: line {line}: unbalanced quotes ({e}); a field that starts with a quote "
            "must end with one, and a quote inside it is written twice")
  except (UnicodeDecodeError, OSError, pa.ArrowException):
    return None
  return None


class JsonTableSource(TableSource):
  """JSON files as HF's `json` builder reads `.jsonl`/`.json`: one object a line (or one
  array of objects), typed columns (nested objects -> dicts), read with pyarrow.json.

  Unlike `sources.JsonlSource`, which hands each line to `json.loads`, a column has one
  type throughout, as in HF `datasets`.
  """

  _format = "json"

  def _ipc_file(self, path):
    return _converted(path, "json", lambda tmp: _convert_json(path, tmp))


def _convert_json(path: str, tmp: str) -> None:
  import pyarrow as pa  # noqa: PLC0415 (slow import, on first use)
  import pyarrow.json as pjson  # noqa: PLC0415 (slow import, on first use)
  try:
    table = pjson.read_json(local_file(path))
  except pa.ArrowInvalid as e:
    with pa.input_stream(local_file(path), compression="detect") as f:
      text = f.read().decode("utf-8", errors="replace")
    if not text.lstrip().startswith("["):
      raise UserError(f"{path}: cannot read as JSON lines ({first_line(e)}); "
                      "fix the file") from None
    try:  # one JSON array of objects, as HF also reads
      rows = json.loads(text)
      table = pa.Table.from_pylist(rows)
    except (ValueError, TypeError, pa.ArrowException) as e2:
      raise UserError(f"{path}: cannot read as a JSON array of objects ({first_line(e2)}); "
                      "fix the file") from None
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path}: cannot read as JSON lines ({first_line(e)}); fix the file") from None
  _write_batches(tmp, table.schema, table.to_batches(max_chunksize=_BATCH_ROWS))


# ------------------------------------------------------------------------- data sources (splits)


class _TableDataSource(sources.DataSource):
  """Named splits of one tabular format, each a `_split_source(files, columns=...)`."""

  _split_source: type[TableSource] = TableSource

  def __init__(self, split_to_filepattern: Mapping[str, sources.SplitSpec], *,
               columns: Sequence[str] | None = None,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    super().__init__(split_to_filepattern, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    self._columns = [columns] if isinstance(columns, str) else columns
    self._options: dict[str, Any] = {}

  def _build(self, split, spec):
    return self._split_source(spec, columns=self._columns, **self._options)


class ParquetDataSource(_TableDataSource):
  """Parquet files per split: `ParquetDataSource({"train": "data/train-*.parquet"})`.

  Args:
    split_to_filepattern: split -> files or globs (or a function returning them).
    columns: keep only these columns; None keeps all.
    num_input_examples, caching_permitted: SeqIO's (see `sources.DataSource`); without
      `num_input_examples`, the count comes from the files' footers.
  """

  _split_source = ParquetSource


class ArrowDataSource(_TableDataSource):
  """Arrow IPC files per split: the `data-*.arrow` streams of `datasets.save_to_disk`, HF
  `datasets` cache files, Feather v2. Mapped in place: nothing is copied."""

  _split_source = ArrowSource


class CsvDataSource(_TableDataSource):
  """CSV files per split, with a header row (see `CsvSource`); `delimiter="\\t"` for TSV
  with quoting."""

  _split_source = CsvSource

  def __init__(self, split_to_filepattern: Mapping[str, sources.SplitSpec], *,
               columns: Sequence[str] | None = None, delimiter: str = ",",
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    super().__init__(split_to_filepattern, columns=columns,
                     num_input_examples=num_input_examples, caching_permitted=caching_permitted)
    self._options = {"delimiter": delimiter}


class JsonTableDataSource(_TableDataSource):
  """JSON-lines files per split with typed columns, as HF's `json` builder (`JsonTableSource`)."""

  _split_source = JsonTableSource
