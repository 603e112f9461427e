"""`t5forge cache_tasks`: write SeqIO caches of tasks on Apache Beam (SeqIO's flags).

  t5forge cache_tasks --module_import my_tasks --tasks 'my_task.*' \\
      --output_cache_dir /data/seqio_cache --min_shards 64 \\
      --pipeline_options="--direct_num_workers=4 --direct_running_mode=multi_processing"

Then train with USE_CACHED_TASKS = True and --seqio_additional_cache_dirs=/data/seqio_cache.
Needs Apache Beam: pip install 't5forge[beam]'.
"""
from __future__ import annotations

import argparse
import logging
import os
import re

from t5forge.errors import UserError


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="t5forge cache_tasks",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--module_import", action="append", default=[],
                      help="a module that registers tasks (repeatable), e.g. my_project.tasks")
  parser.add_argument("--tasks", action="append", default=[],
                      help="task names or regexes matching whole names, comma-separated or "
                           "repeated (default: every registered task)")
  parser.add_argument("--excluded_tasks", action="append", default=[],
                      help="regexes of tasks to skip, comma-separated or repeated")
  parser.add_argument("--output_cache_dir", required=True,
                      help="where the caches go: DIR/<task>/ (':' in a name nests)")
  parser.add_argument("--min_shards", type=int, default=64,
                      help="at least this many output shards a split (SeqIO's default 64; "
                           "0: as many as the input has)")
  parser.add_argument("--max_shards", type=int, default=0,
                      help="at most this many output shards a split (0: no bound)")
  parser.add_argument("--base_seed", type=int, default=None,
                      help="seeds the cached preprocessors reproducibly (as SeqIO, per task "
                           "and input shard)")
  parser.add_argument("--pipeline_options", default="--runner=DirectRunner",
                      help="Beam flags, passed to Beam as they are (space- or "
                           "comma-separated); give them after '=': "
                           "--pipeline_options='--runner=FlinkRunner --flink_master=host:8081'")
  return parser


def _names(values: list[str]) -> list[str]:
  return [v.strip() for value in values for v in value.split(",") if v.strip()]


def main(argv: list[str]) -> int | None:
  args = _parser().parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  try:
    from t5forge.data import cache_tasks  # noqa: PLC0415 (needs the [beam] extra)
  except ModuleNotFoundError as e:
    if not re.match(r"apache_beam\b", e.name or ""):
      raise
    raise UserError("t5forge cache_tasks needs Apache Beam: pip install 't5forge[beam]'") \
        from None
  written = cache_tasks.cache_tasks(
      _names(args.tasks), args.output_cache_dir, excluded_tasks=_names(args.excluded_tasks),
      modules=args.module_import, min_shards=args.min_shards, max_shards=args.max_shards,
      base_seed=args.base_seed, options=args.pipeline_options)
  for name, directory in written.items():
    splits = sorted(f[len("stats."):-len(".json")] for f in os.listdir(directory)
                    if f.startswith("stats."))
    print(f"cached task {name!r} in {directory} (splits: {', '.join(splits)})")
  if not written:
    print(f"nothing to write: the selected tasks are cached in {args.output_cache_dir} already")
  return 0
