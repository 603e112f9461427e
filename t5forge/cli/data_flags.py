"""T5X's data flags, for `train`, `eval` and `infer`: where prepared TFDS datasets and SeqIO
caches are.

    --tfds_data_dir=DIR                 TfdsDataSources look here (after their own
                                        tfds_data_dir): data.set_tfds_data_dir_override
    --seqio_additional_cache_dirs=A,B   SeqIO caches of tasks run with use_cached:
                                        data.add_global_cache_dirs

With gin files (`train`, and `eval` / `infer` in T5X style) `use_cached` is the run gins'
`USE_CACHED_TASKS`; `eval` and `infer` with flags take `--use_cached`. Both directories may
be buckets (`gs://...`, `s3://...`).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from t5forge import storage
from t5forge.errors import UserError

_NAMES = ("--tfds_data_dir", "--seqio_additional_cache_dirs")


def add(parser: argparse.ArgumentParser) -> None:
  """The flags on an argparse command (`eval`, `infer`)."""
  g = parser.add_argument_group("data (T5X's flags)")
  g.add_argument("--tfds_data_dir", default=None,
                 help="where prepared TFDS datasets are (tfds build --data_dir=DIR)")
  g.add_argument("--seqio_additional_cache_dirs", default=None,
                 help="comma-separated directories holding SeqIO caches (cache_tasks_main)")
  g.add_argument("--use_cached", action="store_true",
                 help="read tasks from their SeqIO cache (skipping the preprocessors before "
                 "their CacheDatasetPlaceholder)")


def apply(tfds_data_dir: str | None, cache_dirs: str | Sequence[str] | None) -> None:
  """Sets what the flags say, checking that the directories exist."""
  from t5forge import data  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if tfds_data_dir:
    if not _isdir(tfds_data_dir):
      raise UserError(f"--tfds_data_dir={tfds_data_dir}: no such directory")
    data.set_tfds_data_dir_override(tfds_data_dir)
  if cache_dirs:
    dirs = [d for d in cache_dirs.split(",") if d] if isinstance(cache_dirs, str) \
        else list(cache_dirs)
    for d in dirs:
      if not _isdir(d):
        raise UserError(f"--seqio_additional_cache_dirs: {d}: no such directory")
    data.add_global_cache_dirs(dirs)


def _isdir(path: str) -> bool:
  if storage.is_remote(path):
    storage.check_bucket(path)  # a missing bucket is named as such, not as a missing prefix
    return storage.isdir(path)
  return os.path.isdir(os.path.expanduser(path))


def take(argv: Sequence[str]) -> list[str]:
  """Applies the data flags found in `argv` (`--flag=V` or `--flag V`); returns the rest."""
  rest, values = [], {}
  args = list(argv)
  i = 0
  while i < len(args):
    name, eq, value = args[i].partition("=")
    if name in _NAMES:
      if not eq:
        if i + 1 >= len(args):
          raise UserError(f"{name} needs a value")
        value, i = args[i + 1], i + 1
      values[name] = value
    else:
      rest.append(args[i])
    i += 1
  apply(values.get("--tfds_data_dir"), values.get("--seqio_additional_cache_dirs"))
  return rest
