"""Prepared TensorFlow Datasets directories, read without TensorFlow: SeqIO's `TfdsDataSource`.

A T5X user prepares data with `tfds build wmt_t2t_translate --data_dir=$TFDS_DATA_DIR` and
names it in a task as `seqio.TfdsDataSource(tfds_name="wmt_t2t_translate/de-en:1.0.0")`.
The same task here:

    seqio.TfdsDataSource(tfds_name="wmt_t2t_translate/de-en:1.0.0",
                         splits={"train": "train", "validation": "validation[:2000]"})

Where the dataset is looked for, in order: the source's `tfds_data_dir`, the override set
by `--tfds_data_dir` (`set_tfds_data_dir_override`, SeqIO's name), `$TFDS_DATA_DIR`, then
`~/tensorflow_datasets`; under each, `<name>/<config>/<version>/` holds `dataset_info.json`,
`features.json` and the shards. A version may hold wildcards (`1.*.*`: the highest present).
`tfds_name=None` with `tfds_data_dir` reads that (version) directory itself.

Read: the shard files (`fileFormat` tfrecord or array_record, named by each split's
`filepathTemplate`), in TFDS's file order (shard after shard, as
`as_dataset(shuffle_files=False)` with an interleave cycle of 1, or `as_data_source`);
TFDS's split grammar (`train[:10%]`, `train[-5%:]`, `train[3:17]`, `validation[1shard:]`,
`train[:2%]+validation[:3]`, `all`) with TFDS's rounding; features as in `tfds_features`.
`num_input_examples` comes from the recorded shard lengths, without reading the files.
Nothing is downloaded or prepared.

A data dir may be a bucket (`--tfds_data_dir=gs://bucket/tensorflow_datasets`, or
`s3://`): the directories are listed there and the metadata read from there; each shard a
split reads is copied once into the cache dir (`files.local_file`, per object version) and
read from that copy, since both shard formats are read by random access.
"""
from __future__ import annotations

import dataclasses
import hashlib
import bisect
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from t5forge import storage
from t5forge.data import records, sources, tfds_features
from t5forge.data.array_records import ArrayRecordFiles
from t5forge.errors import UserError

_override: str | None = None


def set_tfds_data_dir_override(tfds_data_dir: str | None) -> None:
  """SeqIO's: where TfdsDataSources look after their own `tfds_data_dir` (T5X's
  `--tfds_data_dir`); None removes it."""
  global _override
  _override = os.path.expanduser(tfds_data_dir) if tfds_data_dir else None


def get_tfds_data_dir_override() -> str | None:
  return _override


_NAME_RE = re.compile(r"^(?P<name>[\w.-]+)(/(?P<config>[\w.+-]+))?(:(?P<version>[\w.*]+))?$")
_VERSION_RE = re.compile(r"^(\d+|\*)\.(\d+|\*)\.(\d+|\*)$")
_FORMATS = {"tfrecord": "tfrecord", "array_record": "array_record"}


@dataclasses.dataclass(frozen=True)
class TfdsSplit:
  """SeqIO's: one split of one (possibly other) TFDS dataset, for `splits={"train":
  TfdsSplit("wmt14_translate/de-en:1.0.0", "train"), ...}`."""
  dataset: str
  split: str | None
  data_dir: str | None = None


# ------------------------------------------------------------------------------ names, directories


def _parse_name(tfds_name: str) -> tuple[str, str | None, str]:
  m = _NAME_RE.match(tfds_name.strip()) if isinstance(tfds_name, str) else None
  if not m:
    raise UserError(f"tfds_name={tfds_name!r}: write 'name[/config]:version', e.g. "
                    "'wmt_t2t_translate/de-en:1.0.0'")
  version = m.group("version")
  if version is None:
    raise UserError(f"tfds_name={tfds_name!r} has no version (SeqIO requires one); write "
                    f"'{tfds_name}:1.0.0' with the version you prepared, or '{tfds_name}:1.*.*' "
                    "for the highest 1.x present")
  if not _VERSION_RE.match(version):
    raise UserError(f"tfds_name={tfds_name!r}: version {version!r} is not x.y.z (digits or *)")
  return m.group("name"), m.group("config"), version


def _version_key(text: str) -> tuple[int, int, int] | None:
  m = _VERSION_RE.match(text)
  if not m or "*" in text:
    return None
  return tuple(int(g) for g in m.groups())


def _matches(version: str, pattern: str) -> bool:
  return all(p in ("*", v) for p, v in zip(pattern.split("."), version.split(".")))


def _versions(directory: str) -> list[str]:
  """The prepared versions in a config directory, lowest first."""
  try:
    names = storage.listdir(directory)
  except OSError:
    return []
  found = [n for n in names if _version_key(n) and storage.isdir(storage.join(directory, n))]
  return sorted(found, key=_version_key)


def _subdirs(directory: str) -> list[str]:
  try:
    return sorted(n for n in storage.listdir(directory)
                  if not n.startswith(".") and storage.isdir(storage.join(directory, n)))
  except OSError:
    return []


def data_dirs(tfds_data_dir: str | None = None) -> list[str]:
  """Where a dataset is looked for, in order (see the module doc)."""
  out = []
  for d in (tfds_data_dir, _override, os.environ.get("TFDS_DATA_DIR"), "~/tensorflow_datasets"):
    if d:
      d = os.path.expanduser(d)
      if d not in out:
        out.append(d)
  return out


def _default_config(name_dir: str) -> str | None:
  """The config TFDS reads when none is named: `.config/metadata.json`'s default, or the
  only config present."""
  meta = storage.join(name_dir, ".config", "metadata.json")
  try:
    default = json.loads(storage.read_text(meta)).get("default_config_name")
    if default:
      return default
  except (OSError, ValueError):
    pass
  configs = [c for c in _subdirs(name_dir) if not _version_key(c)]
  return configs[0] if len(configs) == 1 else None


def find_dataset(tfds_name: str, tfds_data_dir: str | None = None) -> str:
  """The version directory of `tfds_name` (see the module doc for the search).

  Raises:
    UserError: not found; says where it looked, what exists there and how to prepare it.
  """
  name, config, version = _parse_name(tfds_name)
  seen = []
  for data_dir in data_dirs(tfds_data_dir):
    name_dir = storage.join(data_dir, name)
    if not storage.isdir(name_dir):
      continue
    cfg = config if config is not None else (
        None if _versions(name_dir) else _default_config(name_dir))
    config_dir = storage.join(name_dir, cfg) if cfg else name_dir
    present = _versions(config_dir)
    for v in reversed(present):
      if _matches(v, version):
        return storage.join(config_dir, v)
    configs = [c for c in _subdirs(name_dir) if not _version_key(c)]
    listing = []
    for c in configs:
      listing.append(f"{name}/{c}:{','.join(_versions(storage.join(name_dir, c))) or '-'}")
    if _versions(name_dir):
      listing.append(f"{name}:{','.join(_versions(name_dir))}")
    seen.append(f"{data_dir} has {'; '.join(listing) or 'no prepared version'}")
  searched = ", ".join(data_dirs(tfds_data_dir))
  where = f" ({' | '.join(seen)})" if seen else ""
  raise UserError(
      f"TFDS dataset {tfds_name!r} is not prepared in {searched}{where}. t5forge reads prepared "
      f"datasets and never downloads: run `tfds build {name}{f'/{config}' if config else ''}"
      f" --data_dir=DIR` where TensorFlow is installed (or copy a prepared "
      f"{name}/{config + '/' if config else ''}<version> directory), then pass "
      "--tfds_data_dir=DIR or set TFDS_DATA_DIR")


# ---------------------------------------------------------------------------------- dataset info


@dataclasses.dataclass(frozen=True)
class SplitInfo:
  name: str
  shard_lengths: tuple[int, ...]
  filepath_template: str

  @property
  def num_examples(self) -> int:
    return sum(self.shard_lengths)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What `dataset_info.json` and `features.json` of a prepared version directory say."""
  directory: str
  name: str
  file_format: str
  splits: dict[str, SplitInfo]
  decoder: tfds_features.Decoder
  label_names: dict[str, list[str]]
  digest: str  # of dataset_info.json and features.json

  def shard_path(self, split: str, shard: int) -> str:
    info = self.splits[split]
    num = len(info.shard_lengths)
    name = (info.filepath_template.replace("{DATASET}", self.name).replace("{SPLIT}", split)
            .replace("{FILEFORMAT}", self.file_format)
            .replace("{SHARD_X_OF_Y}", f"{shard:05d}-of-{num:05d}")
            .replace("{SHARD_INDEX}", f"{shard:05d}").replace("{NUM_SHARDS}", f"{num:05d}"))
    return storage.join(self.directory, name)


def _read_json(path: str, what: str) -> Any:
  try:
    raw = storage.read_bytes(path)
  except FileNotFoundError:
    raise UserError(f"{path}: missing; a prepared TFDS dataset directory holds {what} (prepare "
                    "it again with `tfds build`, or copy the whole version directory)") from None
  try:
    return json.loads(raw), raw
  except ValueError as e:
    raise UserError(f"{path}: not valid JSON ({e}); the file is damaged: copy or prepare the "
                    "dataset again") from None


def read_info(directory: str) -> DatasetInfo:
  """Reads a prepared version directory's metadata (no shard is opened)."""
  info_path = storage.join(directory, "dataset_info.json")
  info, raw_info = _read_json(info_path, "dataset_info.json")
  feats_path = storage.join(directory, "features.json")
  feats, raw_feats = _read_json(feats_path, "features.json")
  try:
    name = info["name"]
    file_format = info.get("fileFormat", "tfrecord") or "tfrecord"
    splits = {}
    for s in info["splits"]:
      lengths = tuple(int(n) for n in s.get("shardLengths", ()))
      if not lengths:
        raise KeyError(f"splits[{s.get('name')!r}].shardLengths")
      template = s.get("filepathTemplate") or "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
      splits[s["name"]] = SplitInfo(s["name"], lengths, template)
  except (KeyError, TypeError, ValueError) as e:
    raise UserError(f"{info_path}: not a prepared dataset's info (missing or invalid field "
                    f"{e}); prepare it again with `tfds build`") from None
  if file_format not in _FORMATS:
    raise UserError(f"{info_path}: fileFormat {file_format!r} is not supported; t5forge reads "
                    "'tfrecord' and 'array_record' (prepare it with `tfds build "
                    "--file_format=array_record`)")
  if not isinstance(feats, Mapping):
    raise UserError(f"{feats_path}: expected a JSON object describing the features")
  try:
    tree = tfds_features.build(feats, "", feats_path)
  except (KeyError, TypeError, ValueError) as e:
    raise UserError(f"{feats_path}: not a TFDS features description (missing or invalid "
                    f"{e}); prepare the dataset again") from None
  if not isinstance(tree, Mapping):
    tree = {"": tree}
  labels = tfds_features.class_labels(feats, directory)
  digest = hashlib.blake2b(raw_info + b"\0" + raw_feats, digest_size=10).hexdigest()
  return DatasetInfo(directory, name, file_format, splits, tfds_features.Decoder(tree), labels,
                     digest)


# ------------------------------------------------------------------------------------ split grammar

_SUB_RE = re.compile(r"^(?P<split>[\w-]+)(\[(?P<sel>[\w%:.-]+)\])?$")
_SLICE_RE = re.compile(r"^((?P<val>-?[\d_.]+)(?P<unit>%|shard)?)?$")


def _instruction(spec: str, info: DatasetInfo, whole: str) -> list[tuple[str, int, int]]:
  """One `name[selector]` -> [(split, start, stop)] as TFDS's ReadInstruction resolves it."""
  m = _SUB_RE.match(spec)
  fmt = ("see https://www.tensorflow.org/datasets/splits: e.g. 'train', 'train[:10%]', "
         "'train[-5%:]', 'train[3:17]', 'validation[1shard:]', 'train+validation'")
  if not m:
    raise UserError(f"split {whole!r}: {spec!r} is not a TFDS split; {fmt}")
  split, sel = m.group("split"), m.group("sel")
  if split == "all":
    if sel:
      raise UserError(f"split {whole!r}: 'all' cannot be sliced (TFDS's rule); slice each split")
    return [r for s in info.splits for r in _instruction(s, info, whole)]
  if split not in info.splits:
    raise UserError(f"split {whole!r}: no split {split!r} in {info.directory}/dataset_info.json; "
                    f"it has {', '.join(info.splits)}")
  si = info.splits[split]
  n = si.num_examples
  if sel is None:
    return [(split, 0, n)]
  parts = [_SLICE_RE.match(x) for x in sel.split(":")]
  if not all(parts) or not any(p.group(0) for p in parts) or len(parts) > 2:
    raise UserError(f"split {whole!r}: malformed slice [{sel}]; {fmt}")
  if len(parts) == 1:
    unit = parts[0]["unit"] or "abs"
    if unit != "shard":
      raise UserError(f"split {whole!r}: [{sel}] selects one item, which TFDS allows only for "
                      "shards (e.g. [2shard]); write a slice such as [3:4]")
    lo, hi = parts[0]["val"], str(int(parts[0]["val"]) + 1)
  else:
    lo, hi = parts[0]["val"], parts[1]["val"]
    unit = parts[0]["unit"] or parts[1]["unit"] or "abs"
  try:
    lo = None if lo is None else (float(lo) if unit == "%" else int(lo))
    hi = None if hi is None else (float(hi) if unit == "%" else int(hi))
  except ValueError:
    raise UserError(f"split {whole!r}: malformed slice [{sel}]; {fmt}") from None
  if unit == "%":
    if abs(lo or 0) > 100 or abs(hi or 0) > 100:
      raise UserError(f"split {whole!r}: percent boundaries must be in [-100, 100]")
    # TFDS's 'closest' rounding: Python's round, halves to even.
    lo = 0 if lo is None else int(round(lo * n / 100.0))
    hi = n if hi is None else int(round(hi * n / 100.0))
  elif unit == "shard":
    lengths = si.shard_lengths
    lo = 0 if lo is None else sum(lengths[:lo])
    if hi is not None and hi <= 0:
      hi = len(lengths) + hi
    hi = n if hi is None else sum(lengths[:hi])
  else:
    lo = 0 if lo is None else lo
    hi = n if hi is None else hi
  if abs(lo) > n or abs(hi) > n:
    raise UserError(f"split {whole!r}: slice [{sel}] is outside the {n} examples of {split!r}")
  lo = n + lo if lo < 0 else lo
  hi = n + hi if hi < 0 else hi
  return [(split, lo, max(lo, hi))]


def resolve_split(spec: str, info: DatasetInfo) -> list[tuple[str, int, int]]:
  """A TFDS split string -> the (split, start, stop) ranges it reads, in order."""
  if not isinstance(spec, str) or not spec.strip():
    raise UserError(f"split {spec!r}: expected a TFDS split string such as 'train[:10%]'")
  return [r for sub in re.split(r"\s*\+\s*", spec.strip())
          for r in _instruction(sub, info, spec)]


# ---------------------------------------------------------------------------------- split source


class TfdsSplitSource(sources.SplitSource):
  """The examples of a TFDS split string: ranges over the split's shards, in file order.

  Only the shards a range touches are opened (a TFRecord shard is indexed once, verifying
  its checksums; every shard's record count must equal its recorded length).
  """

  def __init__(self, info: DatasetInfo, spec: str):
    self._info = info
    self._spec = spec
    self._ranges = resolve_split(spec, info)
    self._segments = []  # (start in this source, reader, first record in the reader, count)
    total = 0
    for split, lo, hi in self._ranges:
      if hi <= lo:
        continue
      lengths = info.splits[split].shard_lengths
      first = last = 0
      starts = [0]
      for n in lengths:
        starts.append(starts[-1] + n)
      first = max(k for k in range(len(lengths)) if starts[k] <= lo)
      last = max(k for k in range(len(lengths)) if starts[k] < hi)
      shards = list(range(first, last + 1))
      reader = self._open(split, shards, [lengths[k] for k in shards])
      self._segments.append((total, reader, lo - starts[first], hi - lo))
      total += hi - lo
    self._len = total
    self._starts = [s[0] for s in self._segments]
    self.label_names = dict(info.label_names)

  def _open(self, split: str, shards: Sequence[int], lengths: Sequence[int]):
    paths = [self._info.shard_path(split, k) for k in shards]
    for path in paths:
      if not storage.isfile(path):
        present = [n for n in storage.listdir(self._info.directory) if f"-{split}." in n]
        raise UserError(f"{path}: shard missing from the prepared dataset (found "
                        f"{len(present)} {split!r} shard file(s)); copy the whole version "
                        "directory again")
    if self._info.file_format == "tfrecord":
      return records.RecordFiles(paths, compression_type="", lengths=lengths)
    return ArrayRecordFiles(paths, lengths)

  def __len__(self):
    return self._len

  def __getitem__(self, i):
    i = int(i)
    if not 0 <= i < self._len:
      raise IndexError(f"example {i} out of range for {self._len} examples")
    k = bisect.bisect_right(self._starts, i) - 1
    start, reader, offset, _ = self._segments[k]
    j = offset + i - start
    return self._info.decoder(reader.read(j), reader.where(j))

  def fingerprint(self):
    directory = self._info.directory
    where = directory if storage.is_remote(directory) else os.path.abspath(directory)
    return f"{where}:{self._info.digest}:{self._spec}"

  def content_fingerprint(self):
    sizes = [storage.info(self._info.shard_path(s, k))["size"] for s, _, _ in self._ranges
             for k in range(len(self._info.splits[s].shard_lengths))]
    return f"{self._info.digest}:{self._ranges}:{hashlib.sha1(repr(sizes).encode()).hexdigest()[:12]}"

  def describe(self):
    return f"{self._info.directory} split {self._spec!r}"

  def shards(self):
    """One range per shard file a split range touches (a file cut by a slice gives the
    part of it in the slice), as SeqIO's TFDS file instructions."""
    counts = []
    for split, lo, hi in self._ranges:
      start = 0
      for n in self._info.splits[split].shard_lengths:
        part = min(hi, start + n) - max(lo, start)
        if part > 0:
          counts.append(part)
        start += n
    return sources.ranges_of(counts)

  def __getstate__(self):
    return {"directory": self._info.directory, "spec": self._spec}

  def __setstate__(self, state):
    self.__init__(read_info(state["directory"]), state["spec"])


# ----------------------------------------------------------------------------------- data source


class TfdsDataSource(sources.DataSource):
  """SeqIO's `TfdsDataSource`, over prepared TFDS directories (see the module doc).

  Args:
    tfds_name: 'name[/config]:version' (a version is required; wildcards allowed), or None
      with `tfds_data_dir` naming a prepared version directory.
    tfds_data_dir: searched first.
    splits: None (every split of the dataset), a list of split names, or a dict of our
      split name -> a TFDS split string (`{"validation": "validation[:10%]"}`) or a
      `TfdsSplit`.
    caching_permitted: as `sources.DataSource`.
    decoders: SeqIO/TFDS's per-feature decoders; text features need none: only None.
    tfds_builder_kwargs: only `config` and `file_format` (checked against the prepared
      data); a builder's other arguments concern preparing, which happens elsewhere.
    read_only: SeqIO's (whether reading may prepare the data); t5forge never prepares, so
      both values read the same.
    num_input_examples: overrides the counts from the shard lengths.
  """

  def __init__(self, tfds_name: str | None = None, tfds_data_dir: str | None = None,
               splits: Iterable[str] | Mapping[str, str | TfdsSplit] | None = None,
               caching_permitted: bool = True, decoders: Any = None,
               tfds_builder_kwargs: Mapping[str, Any] | None = None, read_only: bool = False,
               num_input_examples: Mapping[str, int] | None = None):
    if decoders is not None:
      raise UserError("TfdsDataSource: decoders are TFDS's image/audio decoding options; "
                      "t5forge decodes text, labels and tensors itself: remove decoders=")
    extra = sorted(set(tfds_builder_kwargs or {}) - {"config", "file_format"})
    if extra:
      raise UserError(f"TfdsDataSource: tfds_builder_kwargs {extra} concern preparing the "
                      "dataset, which t5forge never does; prepare it with `tfds build` and "
                      "remove them")
    if tfds_name is None and not tfds_data_dir and not (
        isinstance(splits, Mapping) and splits and
        all(isinstance(v, TfdsSplit) for v in splits.values())):
      raise UserError("TfdsDataSource needs tfds_name='name[/config]:version' or "
                      "tfds_data_dir=<a prepared version directory>")
    if tfds_name is not None:
      _parse_name(tfds_name)  # a name without a version is refused when the task is defined
    self.tfds_name = tfds_name
    self.tfds_data_dir = tfds_data_dir
    self._builder_kwargs = dict(tfds_builder_kwargs or {})
    self.read_only = read_only
    self._split_arg = splits
    self._infos: dict[tuple, DatasetInfo] = {}
    names = [splits] if isinstance(splits, str) else (list(splits) if splits is not None else None)
    super().__init__({n: n for n in names} if names is not None else None,
                     num_input_examples=num_input_examples, caching_permitted=caching_permitted)

  def _resolve(self, dataset: str | None, data_dir: str | None) -> DatasetInfo:
    key = (dataset, data_dir, _override, os.environ.get("TFDS_DATA_DIR"))
    if key not in self._infos:
      name = dataset
      if name is not None and "config" in self._builder_kwargs and "/" not in name.split(":")[0]:
        base, _, version = name.partition(":")
        name = f"{base}/{self._builder_kwargs['config']}:{version}"
      directory = data_dir if name is None else find_dataset(name, data_dir)
      info = read_info(os.path.expanduser(directory))
      wanted = self._builder_kwargs.get("file_format")
      if wanted and wanted != info.file_format:
        raise UserError(f"{directory}: prepared as {info.file_format}, but tfds_builder_kwargs "
                        f"asks for file_format={wanted!r}; remove it or prepare the dataset as "
                        f"{wanted}")
      self._infos[key] = info
    return self._infos[key]

  def _target(self, split: str) -> tuple[DatasetInfo, str]:
    """The dataset and TFDS split string our split `split` reads."""
    value = self._split_arg[split] if isinstance(self._split_arg, Mapping) else split
    if isinstance(value, TfdsSplit):
      return self._resolve(value.dataset, value.data_dir), value.split or split
    return self._resolve(self.tfds_name, self.tfds_data_dir), value

  @property
  def splits(self) -> tuple[str, ...]:
    if self._splits is None:
      return tuple(self._resolve(self.tfds_name, self.tfds_data_dir).splits)
    return tuple(self._splits)

  def _spec(self, split: str) -> str:
    return split

  def _build(self, split: str, spec: str) -> sources.SplitSource:
    info, tfds_split = self._target(split)
    source = TfdsSplitSource(info, tfds_split)
    if len(source) == 0:
      raise UserError(f"split {split!r} ({tfds_split!r} of {info.directory}) selects no "
                      "examples")
    return source

  def num_input_examples(self, split: str) -> int:
    """From the recorded shard lengths, without opening a shard."""
    if self._num_input_examples is not None and split in self._num_input_examples:
      return self._num_input_examples[split]
    if split not in self.splits:
      self.get(split)  # raises the one-line error
    info, spec = self._target(split)
    return sum(hi - lo for _, lo, hi in resolve_split(spec, info))

  @property
  def label_names(self) -> dict[str, list[str]]:
    """ClassLabel feature -> its names (from `<feature>.labels.txt`), of the dataset the
    first split reads (splits given as TfdsSplit may name no source-wide dataset)."""
    return dict(self._target(self.splits[0])[0].label_names)

  def __getstate__(self):
    state = super().__getstate__()
    state["_infos"] = {}
    return state

  def __repr__(self):
    return f"TfdsDataSource(tfds_name={self.tfds_name!r}, tfds_data_dir={self.tfds_data_dir!r})"
