"""Hugging Face datasets without the `datasets` package: Hub repos, snapshots, save_to_disk.

`HfDataSource(path, name=None, splits=None, ...)` reads, as `datasets.load_dataset` /
`load_from_disk` would:

* a Hub dataset id (`"owner/name"`), fetched with `huggingface_hub.snapshot_download`
  into the Hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`); with `HF_HUB_OFFLINE=1` only
  that cache is used. Online, only the README and the files of the chosen config are
  downloaded (a repo may hold many configs: C4 has terabytes);
* a local copy of such a repo (a directory with the same layout);
* a `save_to_disk` directory: a `DatasetDict` (`dataset_dict.json`, `<split>/state.json`
  listing the `data-*.arrow` files) or a single `Dataset` (`state.json`);
* `"parquet"`, `"csv"`, `"json"` or `"arrow"` with `data_files=` (HF's packaged builders,
  `load_dataset("csv", data_files={"train": "train.csv"})`), relative to the working dir.

In a repo, the README's YAML front matter `configs:` names each config's `data_files`
per split (`name=` picks the config; `default: true` marks the one used without a name);
without it, splits come from file names as HF infers them (`data/train-00000-of-00002.*`,
`train.csv`, `valid/...`, `test-*.parquet`). The files are read by the split sources of
`tabular` (Parquet, Arrow, CSV/TSV, JSON lines).

A directory in a bucket (`gs://`, `s3://`: a save_to_disk directory or a copy of a repo) is
read through one local copy of it (`storage.local_copy`: made once per listing of object
versions, in the cache dir, made again when any object changes), since its Arrow files are
memory-mapped; `data_files=` may name bucket objects and patterns, which the tabular
sources read through their own local copies.

Resolution is lazy: constructing the source (e.g. when a task module registers it) reads
and downloads nothing; the first `get(split)` (or `splits` when not given) does.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from t5forge import storage
from t5forge.data import sources, tabular
from t5forge.errors import UserError

# File extension -> format; `.gz`/`.bz2`/`.zst` after a CSV or JSON one are decompressed.
_EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".tsv": "tsv",
               ".json": "json", ".jsonl": "json", ".ndjson": "json"}
_COMPRESSION = (".gz", ".bz2", ".zst")
_BUILDERS = ("parquet", "arrow", "csv", "json")
# Files HF never takes as data (`datasets.data_files.FILES_TO_IGNORE`).
_IGNORED = {"README.md", "config.json", "dataset_info.json", "dataset_infos.json",
            "dummy_data.zip", "dataset_dict.json"}
# HF's split inference (`datasets.data_files`): first `data/<split>-NNNNN-of-NNNNN.*`
# (any split name), then the split keywords in directory names, then in file names, and
# last every file as "train".
_SHARDED = "data/*-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*"
_SHARD_NAME = re.compile(r"^(.+)-\d{5}-of-\d{5}")
_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
             "test": ("test", "testing", "eval", "evaluation")}
_SEP = "[-._ 0-9]"
_IN_DIR = ("**/{k}/**", "**/{k}" + _SEP + "*/**", "**/*" + _SEP + "{k}/**",
           "**/*" + _SEP + "{k}" + _SEP + "*/**")
_IN_NAME = ("**/{k}" + _SEP + "*", "**/*" + _SEP + "{k}" + _SEP + "*")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclasses.dataclass
class _Layout:
  """What a path resolved to: the files of each HF split and how to read them."""
  where: str  # names it in messages: "Hub dataset owner/name", "directory /x"
  fmt: str  # a key of `_SOURCES`
  files: dict[str, list[str]]  # HF split -> files, in order
  columns: dict[str, list[str]]  # HF split -> columns save_to_disk's set_format kept
  label_names: dict[str, list[str]]  # from the README's `dataset_info` (a fallback)


_SOURCES = {
    "parquet": lambda files, columns: tabular.ParquetSource(files, columns=columns),
    "arrow": lambda files, columns: tabular.ArrowSource(files, columns=columns),
    "csv": lambda files, columns: tabular.CsvSource(files, columns=columns),
    "tsv": lambda files, columns: tabular.CsvSource(files, columns=columns, delimiter="\t"),
    "json": lambda files, columns: tabular.JsonTableSource(files, columns=columns),
}


class HfDataSource(sources.DataSource):
  """A Hugging Face dataset: a Hub id, a local snapshot or a `save_to_disk` directory.

  Args:
    path: a Hub dataset id (`"owner/name"`), a directory (a repo's files or
      `save_to_disk`'s), or a builder name (`"parquet"`, `"csv"`, `"json"`,
      `"arrow"`) with `data_files`.
    name: the config (README `configs:` `config_name`), as `load_dataset`'s second
      argument; None takes the default config.
    splits: None (all the dataset's splits), a list of split names, or a dict
      {our split name: the dataset's split name}, e.g. {"validation": "test"}.
    revision: a Hub branch, tag or commit.
    data_files: as `load_dataset(data_files=...)`: a pattern or a list of them (split
      "train") or a dict split -> pattern(s), relative to the repo or directory; they
      replace the README's configs.
    columns: keep only these columns.
    num_input_examples, caching_permitted: SeqIO's (see `sources.DataSource`).

  A split's source (`get(split)`) is a `tabular` source: rows as HF gives them, and
  `label_names` (ClassLabel column -> class names).
  """

  def __init__(self, path: str, name: str | None = None,
               splits: Sequence[str] | Mapping[str, str] | None = None,
               revision: str | None = None,
               data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
               columns: Sequence[str] | None = None, *,
               num_input_examples: Mapping[str, int] | None = None,
               caching_permitted: bool = True):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
      raise UserError(f"HfDataSource: path must be a Hub dataset id or a directory, got {path!r}")
    if isinstance(splits, str):
      splits = [splits]
    wanted = (dict(splits) if isinstance(splits, Mapping)
              else {s: s for s in splits} if splits is not None else None)
    # Without `splits` the names are the dataset's own, known once it is resolved
    # (`splits`), which may mean a download: not while a task module is imported.
    super().__init__(wanted, num_input_examples=num_input_examples,
                     caching_permitted=caching_permitted)
    self._path = os.fspath(path)
    # Relative paths and patterns mean relative to where the source was made, as
    # `load_dataset` reads them at once; this source reads them later.
    self._cwd = os.getcwd()
    if storage.is_remote(self._path):
      self._path = storage.normalize(self._path)
    elif os.path.exists(os.path.expanduser(self._path)):
      self._path = os.path.abspath(os.path.expanduser(self._path))
    self._name = name
    self._revision = revision
    self._data_files = data_files
    self._columns = [columns] if isinstance(columns, str) else columns
    self._layout: _Layout | None = None

  def __repr__(self):
    return f"HfDataSource({self._path!r}, name={self._name!r})"

  @property
  def splits(self) -> tuple[str, ...]:
    if self._splits is None:
      layout = self.layout()
      unknown = sorted(set(self._num_input_examples or ()) - set(layout.files))
      if unknown:
        raise UserError(f"HfDataSource: num_input_examples names split(s) "
                        f"{', '.join(map(repr, unknown))} that {layout.where} does not have "
                        f"({', '.join(layout.files)})")
      self._splits = {s: s for s in layout.files}
    return tuple(self._splits)

  def layout(self) -> _Layout:
    """Resolves the path (downloading when it is a Hub id not yet cached); kept."""
    if self._layout is None:
      self._layout = _resolve(self._path, self._name, self._revision, self._data_files,
                              self._cwd)
    return self._layout

  def _build(self, split, spec):
    layout = self.layout()
    if spec not in layout.files:
      raise UserError(f"{layout.where}: no split {spec!r}; its splits: "
                      f"{', '.join(layout.files) or 'none'}")
    columns = self._columns if self._columns is not None else layout.columns.get(spec)
    source = _SOURCES[layout.fmt](layout.files[spec], columns)
    if not source.label_names and layout.label_names:
      source.label_names = {k: v for k, v in layout.label_names.items()
                            if k.split(".")[0] in source.column_names}
    return source


# ------------------------------------------------------------------------------------- resolving


def _resolve(path: str, name: str | None, revision: str | None, data_files: Any,
             cwd: str) -> _Layout:
  if storage.is_remote(path):
    if not storage.isdir(path):
      raise UserError(f"HfDataSource: no directory {path} (give a save_to_disk directory or a "
                      "copy of a dataset repo); check the path")
    return _layout_of(storage.local_copy(path), f"directory {path}", name, data_files)
  local = os.path.expanduser(path)
  if path in _BUILDERS and not os.path.isdir(local):
    if data_files is None:
      raise UserError(f"HfDataSource({path!r}) reads files named by data_files=, e.g. "
                      f"data_files={{'train': 'train.{path}'}}")
    return _repo_layout(cwd, f"data_files of {path!r}", name, data_files, fmt=path)
  if os.path.isdir(local):
    root, where = local, f"directory {local}"
  elif _REPO_ID.match(path) and not os.path.exists(local):
    root, where = _hub_snapshot(path, revision, name, data_files), f"Hub dataset {path}"
  elif os.path.isfile(local):
    raise UserError(f"HfDataSource: {path} is a file; give its directory, or data_files="
                    f"{path!r} with path='parquet'/'csv'/'json'/'arrow'")
  else:
    raise UserError(f"HfDataSource: no directory {local} and {path!r} is not a Hub dataset id "
                    "(owner/name); check the path")
  return _layout_of(root, where, name, data_files)


def _layout_of(root: str, where: str, name: str | None, data_files: Any) -> _Layout:
  if data_files is None and (os.path.isfile(os.path.join(root, "dataset_dict.json"))
                             or os.path.isfile(os.path.join(root, "state.json"))):
    if name is not None:
      raise UserError(f"{where} is a save_to_disk directory, which has no configs; "
                      f"remove name={name!r}")
    return _saved_layout(root, where)
  return _repo_layout(root, where, name, data_files)


def _saved_layout(root: str, where: str) -> _Layout:
  """The splits of a `DatasetDict.save_to_disk` or `Dataset.save_to_disk` directory."""
  dict_file = os.path.join(root, "dataset_dict.json")
  if os.path.isfile(dict_file):
    split_names = _read_json(dict_file).get("splits") or []
    dirs = {str(s): os.path.join(root, str(s)) for s in split_names}
  else:
    split = _read_json(os.path.join(root, "state.json")).get("_split") or "train"
    dirs = {str(split): root}
  files, columns = {}, {}
  for split, directory in dirs.items():
    state_file = os.path.join(directory, "state.json")
    if not os.path.isfile(state_file):
      raise UserError(f"{where}: split {split!r} has no {state_file}; copy the whole "
                      "save_to_disk directory again")
    state = _read_json(state_file)
    names = [e.get("filename") for e in state.get("_data_files") or [] if isinstance(e, dict)]
    paths = [os.path.join(directory, n) for n in names if n]
    for n, p in zip(names, paths):
      if not os.path.isfile(p):
        raise UserError(f"{state_file} lists {n}, which is missing from {directory}; copy the "
                        "whole save_to_disk directory again")
    if not paths:
      raise UserError(f"{state_file} lists no data files (_data_files); save the dataset again")
    files[split] = paths
    # `set_format(columns=...)` before saving: load_from_disk then gives only those.
    if state.get("_format_columns") and not state.get("_output_all_columns"):
      columns[split] = list(state["_format_columns"])
  return _Layout(where, "arrow", files, columns, {})


def _repo_layout(root: str, where: str, name: str | None, data_files: Any,
                 fmt: str | None = None) -> _Layout:
  """The splits of a repo's files: `data_files`, else the README's config, else inferred."""
  card = _front_matter(os.path.join(root, "README.md"))
  base, patterns = root, None
  if data_files is not None:
    patterns = _split_patterns(data_files, "data_files=")
  else:
    config = _pick_config(card.get("configs"), name, where)
    if config is not None:
      if config.get("data_dir"):
        base = os.path.join(root, str(config["data_dir"]))
      if config.get("data_files") is not None:
        patterns = _split_patterns(config["data_files"],
                                   f"{where}: README.md config {config.get('config_name')!r}")
    elif name not in (None, "default"):
      raise UserError(f"{where}: no config {name!r}; its README.md defines no configs, so "
                      "remove name= (or pass data_files=)")
  if patterns is None:
    found = {split: _match(base, pats, where, explicit=False)
             for split, pats in _inferred_patterns(base).items()}
  else:
    found = {split: _match(base, pats, where, explicit=True) for split, pats in patterns.items()}
  if fmt is None:  # as HF: the most common format decides, files of others are left out
    fmt = _majority_format(found, where)
    found = {s: [f for f in fs if _format_of(f) == fmt] for s, fs in found.items()}
  files = {s: fs for s, fs in found.items() if fs}
  if not files:
    raise UserError(f"{where}: no data files found; pass data_files=")
  return _Layout(where, fmt, files, {}, _card_label_names(card, name or "default"))


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"{path}: cannot read as JSON ({tabular.first_line(e)}); copy the "
                    "directory again") from None
  if not isinstance(value, dict):
    raise UserError(f"{path}: expected a JSON object, found {type(value).__name__}")
  return value


def _front_matter(readme: str) -> dict:
  """The YAML header of a dataset card (between `---` lines), or {} without one."""
  try:
    with open(readme, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError):
    return {}
  if not lines or lines[0].strip() != "---":
    return {}
  end = next((k for k in range(1, len(lines)) if lines[k].strip() == "---"), None)
  if end is None:
    return {}
  import yaml  # noqa: PLC0415 (slow import, on first use)
  try:
    card = yaml.safe_load("\n".join(lines[1:end]))
  except yaml.YAMLError as e:
    raise UserError(f"{readme}: its YAML header does not parse ({tabular.first_line(e)}); fix "
                    "it or pass data_files=") from None
  return card if isinstance(card, dict) else {}


def _pick_config(configs: Any, name: str | None, where: str) -> Mapping | None:
  """The README config `name` (None: the `default: true` one, or the only one)."""
  if not configs:
    return None
  if not isinstance(configs, list) or not all(isinstance(c, Mapping) for c in configs):
    raise UserError(f"{where}: README.md `configs:` must be a list of mappings with "
                    "config_name and data_files")
  names = [str(c.get("config_name", "default")) for c in configs]
  if name is None:
    marked = [c for c in configs if c.get("default")]
    if marked:
      return marked[0]
    if len(configs) == 1:
      return configs[0]
    if "default" in names:
      return configs[names.index("default")]
    raise UserError(f"{where} has several configs ({', '.join(names)}); pick one with name=")
  if name not in names:
    raise UserError(f"{where}: no config {name!r}; its configs: {', '.join(names)}")
  return configs[names.index(name)]


def _split_patterns(value: Any, what: str) -> dict[str, list[str]]:
  """`data_files` as `datasets.data_files.sanitize_patterns`: split -> patterns."""
  def strings(v: Any) -> list[str]:
    items = [v] if isinstance(v, (str, os.PathLike)) else v
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(x, (str, os.PathLike)) for x in items):
      raise UserError(f"{what}: expected a file pattern or a list of them, got {v!r}")
    return [os.fspath(x) for x in items]

  if isinstance(value, Mapping):
    return {str(k): strings(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
    out: dict[str, list[str]] = {}
    for v in value:
      if not isinstance(v, Mapping) or "split" not in v or "path" not in v:
        raise UserError(f"{what}: each entry must be {{split: ..., path: ...}}, got {v!r}")
      out[str(v["split"])] = strings(v["path"])
    return out
  return {"train": strings(value)}


def _inferred_patterns(base: str) -> dict[str, list[str]]:
  """Split -> patterns from file names, as `datasets.data_files.get_data_patterns`."""
  sharded = _glob(base, _SHARDED)
  if sharded:
    names = {m.group(1) for f in sharded if (m := _SHARD_NAME.match(os.path.basename(f)))}
    order = [s for s in _KEYWORDS if s in names] + sorted(names - set(_KEYWORDS))
    return {s: [_SHARDED.replace("*", glob.escape(s), 1)] for s in order}
  for templates in (_IN_DIR, _IN_NAME):
    out = {}
    for split, keywords in _KEYWORDS.items():
      patterns = [t.format(k=k) for k in keywords for t in templates]
      if any(_glob(base, p) for p in patterns):
        out[split] = patterns
    if out:
      return out
  return {"train": ["**"]}


def _glob(base: str, pattern: str) -> list[str]:
  """Files matching `pattern` under `base`, sorted; hidden files, `__*__` directories and
  dataset cards are left out unless the pattern names them (as HF's `resolve_pattern`)."""
  if storage.is_remote(pattern):
    return [p for p in storage.glob(pattern) if storage.isfile(p)]
  if os.path.isabs(pattern):
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  named = os.path.basename(pattern)
  special = sum(part.startswith("__") for part in PurePath(pattern).parent.parts)
  out = []
  for rel in glob.glob(pattern, root_dir=base, recursive=True):
    path = os.path.join(base, rel)
    if not os.path.isfile(path) or (os.path.basename(rel) in _IGNORED and named != rel):
      continue
    if sum(part.startswith("__") for part in PurePath(rel).parent.parts) != special:
      continue
    out.append(path)
  return sorted(out)


def _match(base: str, patterns: list[str], where: str, explicit: bool) -> list[str]:
  out: list[str] = []
  for pattern in patterns:
    hits = _glob(base, os.path.expanduser(pattern))
    if explicit and not hits:
      raise UserError(f"{where}: data_files pattern {pattern!r} matched no files under {base}")
    out.extend(h for h in hits if h not in out)
  return out


def _format_of(path: str) -> str | None:
  name = path.lower()
  for ext in _COMPRESSION:
    if name.endswith(ext):
      name = name[:-len(ext)]
      break
  return _EXTENSIONS.get(os.path.splitext(name)[1])


def _majority_format(found: Mapping[str, list[str]], where: str) -> str:
  counts: dict[str, int] = {}
  for fs in found.values():
    for f in fs:
      fmt = _format_of(f)
      if fmt:
        counts[fmt] = counts.get(fmt, 0) + 1
  if not counts:
    seen = sorted({os.path.splitext(f)[1] or os.path.basename(f)
                   for fs in found.values() for f in fs})
    raise UserError(f"{where}: no data files t5forge reads (Parquet, Arrow, CSV/TSV, JSON "
                    f"lines) among its files ({', '.join(seen[:8]) or 'none'})")
  return max(counts, key=counts.get)


def _card_label_names(card: Mapping, config_name: str) -> dict[str, list[str]]:
  """ClassLabel names from the card's `dataset_info` (YAML features) for one config."""
  info = card.get("dataset_info")
  if isinstance(info, list):
    info = next((i for i in info if isinstance(i, Mapping)
                 and i.get("config_name", "default") == config_name),
                info[0] if len(info) == 1 else None)
  if not isinstance(info, Mapping) or not isinstance(info.get("features"), list):
    return {}
  out: dict[str, list[str]] = {}

  def walk(node: Any, name: str) -> None:
    if isinstance(node, list):  # a struct: a list of named features
      for sub in node:
        if isinstance(sub, Mapping) and "name" in sub:
          walk(sub, f"{name}.{sub['name']}" if name else str(sub["name"]))
    elif isinstance(node, Mapping):
      label = node.get("class_label")
      if isinstance(label, Mapping) and label.get("names"):
        names = label["names"]
        out[name] = ([str(names[k]) for k in sorted(names, key=int)]
                     if isinstance(names, Mapping) else [str(n) for n in names])
        return
      for key in ("dtype", "sequence", "list", "large_list", "feature", "struct"):
        if key in node:
          walk(node[key], name)

  walk(info["features"], "")
  return out


# ------------------------------------------------------------------------------------------- Hub


def _hub_cache_dir() -> str:
  """The Hub cache as huggingface_hub computes it, read from the environment now (its own
  constants are fixed when it is imported)."""
  env = os.environ
  value = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
  if not value:
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                              "huggingface")
    value = os.path.join(home, "hub")
  return os.path.expandvars(os.path.expanduser(value))


def _hub_offline() -> bool:
  from huggingface_hub import constants  # noqa: PLC0415 (slow import, on first use)
  value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
  return value.upper() in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


def _hub_snapshot(repo_id: str, revision: str | None, name: str | None,
                  data_files: Any) -> str:
  """The local snapshot dir of a Hub dataset repo, downloading what is needed when online."""
  import huggingface_hub as hub  # noqa: PLC0415 (slow import, on first use)
  from huggingface_hub import errors  # noqa: PLC0415 (slow import, on first use)
  cache_dir, offline = _hub_cache_dir(), _hub_offline()
  at = f" at revision {revision!r}" if revision else ""
  try:
    allow = None if offline else _allow_patterns(repo_id, revision, name, data_files, cache_dir)
    return hub.snapshot_download(repo_id, repo_type="dataset", revision=revision,
                                 cache_dir=cache_dir, local_files_only=offline,
                                 allow_patterns=allow)
  except errors.GatedRepoError:
    raise UserError(f"Hub dataset {repo_id} is gated: accept its conditions on "
                    f"https://huggingface.co/datasets/{repo_id} and log in (`hf auth login` "
                    "or HF_TOKEN)") from None
  except errors.RepositoryNotFoundError:
    raise UserError(f"no dataset {repo_id} on the Hub; check the name, or log in (`hf auth "
                    "login` or HF_TOKEN) if it is private") from None
  except errors.RevisionNotFoundError:
    raise UserError(f"Hub dataset {repo_id} has no revision {revision!r}; "
                    "check revision=") from None
  except errors.LocalEntryNotFoundError as e:
    get = f"`hf download {repo_id} --repo-type dataset`"
    if offline:
      state = ("has only an incomplete snapshot in" if isinstance(e, errors.IncompleteSnapshotError)
               else "is not in")
      raise UserError(f"Hub dataset {repo_id}{at} {state} the Hugging Face cache searched, "
                      f"{cache_dir}, and HF_HUB_OFFLINE=1 forbids downloading it: run {get} on "
                      "a machine online and copy that cache here (or set HF_HUB_CACHE to a "
                      "cache that holds it)") from None
    raise UserError(f"cannot download Hub dataset {repo_id}{at} and it is not in the Hugging "
                    f"Face cache {cache_dir} ({tabular.first_line(e)}); check the network, or "
                    f"run {get} elsewhere and copy the cache here with HF_HUB_OFFLINE=1") from None
  except errors.HFValidationError as e:
    raise UserError(f"{repo_id!r} is not a Hub dataset id ({tabular.first_line(e)}); give "
                    "owner/name or a directory") from None
  except errors.HfHubHTTPError as e:
    raise UserError(f"the Hub refused Hub dataset {repo_id}{at} ({tabular.first_line(e)}); "
                    "try again, or use a local copy") from None


def _allow_patterns(repo_id: str, revision: str | None, name: str | None, data_files: Any,
                    cache_dir: str) -> list[str] | None:
  """Which repo files to download: the README and the chosen config's data files (None:
  all). Reads the README first, so a repo of many configs is not downloaded whole."""
  import huggingface_hub as hub  # noqa: PLC0415 (slow import, on first use)
  from huggingface_hub import errors  # noqa: PLC0415 (slow import, on first use)
  where = f"Hub dataset {repo_id}"
  prefix = ""
  if data_files is not None:
    patterns = _split_patterns(data_files, "data_files=")
  else:
    try:
      readme = hub.hf_hub_download(repo_id, "README.md", repo_type="dataset",
                                   revision=revision, cache_dir=cache_dir)
    except errors.RemoteEntryNotFoundError:
      return None
    config = _pick_config(_front_matter(readme).get("configs"), name, where)
    if config is None or config.get("data_files") is None:
      return None
    patterns = _split_patterns(config["data_files"], f"{where}: README.md config")
    prefix = str(config.get("data_dir") or "").strip("/")
  flat = [f"{prefix}/{p}" if prefix else p for ps in patterns.values() for p in ps]
  # The Hub filter is fnmatch, where `*` crosses `/` but `**/x` needs a slash.
  return ["README.md", *flat, *(p[3:] for p in flat if p.startswith("**/"))]
