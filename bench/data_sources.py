"""The same rows in every format t5forge reads, through the whole input pipeline.

    python -m bench.data_sources            # from the repo root; ~4.5 minutes on 2 CPU cores
    python -m bench.data_sources --quick    # smoke test: 3,000 rows, 3 short rounds (~30 s)

The Bible train TSV (all 30,198 verse pairs; --quick: the first 3,000) is written once into
a temp directory as TSV (the baseline), gzipped TSV, TFRecord of tf.train.Example (plain
and GZIP), ArrayRecord (tf.train.Example and JSON), prepared TFDS directories (tfrecord
and array_record shards), a SeqIO cache, Parquet, a `save_to_disk` directory (Arrow IPC
streams), CSV and a Hub-style snapshot of Parquet shards. One task per format runs
`bible_translate_en_es`'s preprocessors; before any timing, 1,000 of every task's examples
(unshuffled: the first 250 and a sample reaching every shard) must equal the TSV task's,
so every row does the same work. Per source:

* examples/s through `get_batches` (read -> translate -> tokenize -> pack 256/192 -> batch
  32, shuffled): rounds alternate the sources (load drifts hit all alike); the median, and
  the median of the per-round ratios to TSV (the project's target: >= 0.8x);
* the first open (index build, decompression or conversion into the t5forge cache) with a
  cold cache (`T5FORGE_CACHE` a fresh dir, index files beside the data removed), in
  seconds and seconds per MB of source files (in the page cache: CPU, not disk);
* the raw read, `src[i]` over a random permutation, in microseconds per example.

Sources under 0.8x are profiled with cProfile (TSV too, to compare). Writes
`bench/results/data_sources.json` (machine, load, every round). What to expect: the pipeline
costs ~250 us an example on 2 cores, a reader 3-36 us, so every format lands at 0.83-1.24x of
TSV (single rounds scatter by +-30% on a shared machine; the medians by about +-0.07); the
ArrayRecord sources are the slowest readers (zstd-compressed single-record chunks).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import functools
import gc
import glob
import gzip
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

LENGTHS = {"inputs": 256, "targets": 192}  # the Bible's own ratio (bench/data_pipeline.py)
BATCH = 32
SHARDS = 4
TARGET = 0.8
HF_FEATURES = {"translation": {"languages": ["en", "es"], "_type": "Translation"}}


# ------------------------------------------------------------------------- the rows, written

def read_rows(limit: int | None) -> list[tuple[str, str]]:
  from t5forge.data import bundled_tasks  # the bundled copy of shared/data's train TSV
  with gzip.open(bundled_tasks.BIBLE_TRAIN, "rt", encoding="utf-8") as f:
    rows = [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]
  return rows[:limit] if limit else rows


def _chunks(rows, k):
  bounds = np.linspace(0, len(rows), k + 1).astype(int)
  return [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _dump(path, value):
  with open(path, "w") as f:
    json.dump(value, f, indent=2)


def _write_array_record(path, payloads):
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(path, "group_size:1")  # as TFDS writes it: cheap random access
  for p in payloads:
    writer.write(p)
  writer.close()


def _arrow_table(rows):
  import pyarrow as pa
  meta = {"huggingface": json.dumps({"info": {"features": HF_FEATURES}})}
  col = pa.StructArray.from_arrays([pa.array([r[0] for r in rows]), pa.array([r[1] for r in rows])],
                                   names=["en", "es"])
  return pa.table({"translation": col}).replace_schema_metadata(meta)


def _write_parquet(path, rows):
  import pyarrow.parquet as pq
  # Row groups of 1,000 rows and snappy, as `datasets`' to_parquet writes them.
  pq.write_table(_arrow_table(rows), path, row_group_size=1000, compression="snappy")


def _write_tfds(root, rows, fmt):
  from t5forge.data import records, tf_example
  d = os.path.join(root, "bible_verses", "en_es", "1.0.0")
  os.makedirs(d)
  parts = _chunks(rows, SHARDS)
  for k, part in enumerate(parts):
    path = os.path.join(d, f"bible_verses-train.{fmt}-{k:05d}-of-{SHARDS:05d}")
    payloads = [tf_example.encode({"translation/en": en, "translation/es": es}) for en, es in part]
    if fmt == "tfrecord":
      records.write(path, payloads)
    else:
      _write_array_record(path, payloads)
  info = {"configName": "en_es", "fileFormat": fmt, "name": "bible_verses", "version": "1.0.0",
          "splits": [{"filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
                      "name": "train", "shardLengths": [str(len(p)) for p in parts]}]}
  trans = "tensorflow_datasets.core.features.translation_feature.Translation"
  feats = {"featuresDict": {"features": {"translation": {
      "pythonClassName": trans, "translation": {"languages": ["en", "es"]}}}},
      "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict"}
  _dump(os.path.join(d, "dataset_info.json"), info)
  _dump(os.path.join(d, "features.json"), feats)


def _write_seqio_cache(d, rows, task):
  """cache_tasks_main's layout: the examples as they are at the CacheDatasetPlaceholder."""
  from t5forge.data import preprocessors as pre, records, tf_example
  os.makedirs(d)
  for k, part in enumerate(_chunks(rows, SHARDS)):
    records.write(os.path.join(d, f"train.tfrecord-{k:05d}-of-{SHARDS:05d}"), [
        tf_example.encode(pre.tokenize(pre.translate({"en": en, "es": es}, "en", "es"),
                                       task.output_features)) for en, es in part])
  feats = {k: {"dtype": "int32", "shape": [None]} for k in ("inputs", "targets")}
  feats.update({f"{k}_pretokenized": {"dtype": "string", "shape": []} for k in feats})
  _dump(os.path.join(d, "info.train.json"), {"features": feats, "num_shards": SHARDS,
                                              "seqio_version": "0.0.20"})
  _dump(os.path.join(d, "stats.train.json"), {"examples": len(rows)})
  with open(os.path.join(d, "COMPLETED"), "w") as f:
    f.write("tfrecord")


def write_all(root: str, rows, bible_task) -> None:
  """Every format into its own subdirectory of `root` (its size is the source's MB)."""
  import pyarrow as pa
  from t5forge.data import records, tf_example
  def mk(name):
    os.makedirs(os.path.join(root, name))
    return os.path.join(root, name)
  tsv = "".join(f"{en}\t{es}\n" for en, es in rows).encode()
  with open(os.path.join(mk("tsv"), "train.tsv"), "wb") as f:
    f.write(tsv)
  with gzip.open(os.path.join(mk("tsv_gz"), "train.tsv.gz"), "wb") as f:
    f.write(tsv)
  dirs = {name: mk(name) for name in ("tfrecord", "tfrecord_gz", "ar_example", "ar_json")}
  for k, part in enumerate(_chunks(rows, SHARDS)):
    shard = f"-{k:05d}-of-{SHARDS:05d}"
    examples = [tf_example.encode({"en": en, "es": es}) for en, es in part]
    records.write(os.path.join(dirs["tfrecord"], "train.tfrecord" + shard), examples)
    with open(os.path.join(dirs["tfrecord_gz"], "train.tfrecord.gz" + shard), "wb") as f:
      # TF's compression_type='GZIP': the whole framed file, gzipped.
      f.write(gzip.compress(b"".join(records.frame(e) for e in examples)))
    _write_array_record(os.path.join(dirs["ar_example"], "train.array_record" + shard), examples)
    _write_array_record(os.path.join(dirs["ar_json"], "train.array_record" + shard),
                        [json.dumps({"en": en, "es": es}, ensure_ascii=False).encode()
                         for en, es in part])
  _write_tfds(mk("tfds_tfrecord"), rows, "tfrecord")
  _write_tfds(mk("tfds_array_record"), rows, "array_record")
  _write_seqio_cache(os.path.join(mk("seqio"), "bench_src_seqio_cache"), rows, bible_task)
  _write_parquet(os.path.join(mk("parquet"), "train.parquet"), rows)
  # save_to_disk: Arrow IPC streams of 1,000-row record batches, 2 shards, state.json.
  saved = os.path.join(mk("hf_saved"), "train")
  os.makedirs(saved)
  names = [f"data-{k:05d}-of-00002.arrow" for k in range(2)]
  for name, part in zip(names, _chunks(rows, 2)):
    table = _arrow_table(part)
    with pa.OSFile(os.path.join(saved, name), "wb") as sink, \
         pa.ipc.new_stream(sink, table.schema) as writer:
      for batch in table.to_batches(max_chunksize=1000):
        writer.write_batch(batch)
  _dump(os.path.join(saved, "state.json"), {"_data_files": [{"filename": n} for n in names],
                                            "_format_columns": None, "_split": None})
  _dump(os.path.join(saved, "dataset_info.json"), {"features": HF_FEATURES})
  _dump(os.path.join(root, "hf_saved", "dataset_dict.json"), {"splits": ["train"]})
  with open(os.path.join(mk("csv"), "train.csv"), "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)  # RFC 4180 quoting of commas and quotes, as pandas' to_csv
    w.writerow(["en", "es"])
    w.writerows(rows)
  snap = mk("hf_snapshot")
  os.makedirs(os.path.join(snap, "en_es"))
  for k, part in enumerate(_chunks(rows, 2)):
    _write_parquet(os.path.join(snap, "en_es", f"train-{k:05d}-of-00002.parquet"), part)
  with open(os.path.join(snap, "README.md"), "w") as f:
    f.write("---\nconfigs:\n- config_name: en_es\n  data_files:\n  - split: train\n"
            "    path: en_es/train-*\n---\n# bench\n")


# ------------------------------------------------------------------------------- the sources

def translate_nested(x):
  """HF's and TFDS's `Translation` feature: {"translation": {"en": .., "es": ..}}."""
  from t5forge.data import preprocessors as pre
  return pre.translate(x["translation"], source_language="en", target_language="es")


def sources(root: str) -> list[dict]:
  """Every source: name, reader, row layout, directory, a factory of its DataSource."""
  import t5forge.data as data
  p = lambda *parts: os.path.join(root, *parts)
  desc = dict.fromkeys(("en", "es"), data.FixedLenFeature([], "string"))
  tsv = lambda d: lambda: data.TsvDataSource({"train": p(d, "train.*")}, field_names=("en", "es"))
  tfex = lambda d, **kw: lambda: data.TFExampleDataSource({"train": p(d, "train.*")}, desc, **kw)
  ar = lambda d, **kw: lambda: data.ArrayRecordDataSource({"train": p(d, "train.*")}, **kw)
  tfds = lambda d: lambda: data.TfdsDataSource("bible_verses/en_es:1.0.0", p(d), ["train"])
  specs = [
      ("tsv", "TsvDataSource", "flat", "tsv", tsv("tsv")),
      ("tsv.gz", "TsvDataSource", "flat", "tsv_gz", tsv("tsv_gz")),
      ("tfrecord", "TFExampleDataSource", "flat", "tfrecord", tfex("tfrecord")),
      ("tfrecord gzip", "TFExampleDataSource", "flat", "tfrecord_gz",
       tfex("tfrecord_gz", compression_type="GZIP")),
      ("array_record example", "ArrayRecordDataSource", "flat", "ar_example",
       ar("ar_example", decode="tf_example", feature_description=desc)),
      ("array_record json", "ArrayRecordDataSource", "flat", "ar_json",
       ar("ar_json", decode="json")),
      ("tfds tfrecord", "TfdsDataSource", "nested", "tfds_tfrecord", tfds("tfds_tfrecord")),
      ("tfds array_record", "TfdsDataSource", "nested", "tfds_array_record",
       tfds("tfds_array_record")),
      ("seqio cache", "use_cached=True", "cached", "seqio", tsv("tsv")),  # source unread
      ("parquet", "ParquetDataSource", "nested", "parquet",
       lambda: data.ParquetDataSource({"train": p("parquet", "*.parquet")})),
      ("arrow", "ArrowDataSource", "nested", "hf_saved",
       lambda: data.ArrowDataSource({"train": p("hf_saved", "train", "*.arrow")})),
      ("csv", "CsvDataSource", "flat", "csv", lambda: data.CsvDataSource({"train": p("csv", "*")})),
      ("hf save_to_disk", "HfDataSource", "nested", "hf_saved",
       lambda: data.HfDataSource(p("hf_saved"), splits=["train"])),
      ("hf snapshot parquet", "HfDataSource", "nested", "hf_snapshot",
       lambda: data.HfDataSource(p("hf_snapshot"), name="en_es", splits=["train"])),
  ]
  return [dict(name=n, reader=r, layout=l, dir=p(d), factory=f,
               task="bench_src_" + "".join(c if c.isalnum() else "_" for c in n))
          for n, r, l, d, f in specs]


def make_task(s: dict):
  from t5forge.data import bundled_tasks, preprocessors as pre, tasks
  first = (translate_nested if s["layout"] == "nested" else
           functools.partial(pre.translate, source_language="en", target_language="es"))
  return tasks.Task(s["task"], source=s["factory"](),
                    preprocessors=[first, pre.tokenize, pre.CacheDatasetPlaceholder(),
                                   pre.append_eos_after_trim],
                    output_features=bundled_tasks.OUTPUT_FEATURES)


def first_open(s: dict, scratch: str) -> tuple[float, float]:
  """Seconds to open the split and read one example with a cold t5forge cache, and the
  MB that opening wrote (cache dir and index files beside the data)."""
  for f in glob.glob(os.path.join(s["dir"], "**", ".*.t5forge-*"), recursive=True):
    os.unlink(f)
  cache = tempfile.mkdtemp(dir=scratch, prefix="cold-")
  os.environ["T5FORGE_CACHE"] = cache
  try:
    task = make_task(s)
    start = time.perf_counter()
    task.split_source("train", s["layout"] == "cached")[0]
    seconds = time.perf_counter() - start
    written = [f for d in (cache, s["dir"])
               for f in glob.glob(os.path.join(d, "**"), recursive=True, include_hidden=True)
               if os.path.isfile(f) and (d == cache or ".t5forge-" in f)]
    return seconds, round(sum(os.path.getsize(f) for f in written) / 1e6, 2)
  finally:
    shutil.rmtree(cache, ignore_errors=True)


# --------------------------------------------------------------------------------- measuring

def pipeline_rate(s: dict, seed: int, num_batches: int, profile=None) -> float:
  import t5forge.data as data
  it = data.get_batches(s["task"], LENGTHS, batch_size=BATCH, pack=True, packer="first_fit",
                        seed=seed, use_cached=s["layout"] == "cached")
  next(it)  # untimed: opens the source and fills the first packing window
  examples = 0
  gc.collect()
  with profile or contextlib.nullcontext():
    start = time.perf_counter()
    for _ in range(num_batches):
      examples += int(next(it)["decoder_segment_ids"].max(axis=1).sum())
    seconds = time.perf_counter() - start
  it.close()
  return examples / seconds


def raw_read_us(s: dict, seed: int, count: int) -> float:
  from t5forge.data import tasks
  src = tasks.TaskRegistry.get(s["task"]).split_source("train", s["layout"] == "cached")
  order = np.random.default_rng(seed).permutation(len(src))[:count].tolist()
  start = time.perf_counter()
  for i in order:
    src[i]
  return (time.perf_counter() - start) / len(order) * 1e6


def task_examples(s: dict, indices) -> list[dict]:
  from t5forge.data import tasks
  ds = tasks.TaskRegistry.get(s["task"]).get_dataset(None, "train", s["layout"] == "cached",
                                                     shuffle=False)
  return [ds[i] for i in indices]


def same_examples(s: dict, reference: dict) -> str | None:
  """None when the task's examples (unshuffled) at `reference`'s indices equal it, else why."""
  for i, got in zip(reference, task_examples(s, reference)):
    want = reference[i]
    for k in sorted(set(got) | set(want)):
      a, b = got.get(k), want.get(k)
      if not (np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b):
        return f"example {i} feature {k!r}: {a!r} != {b!r}"
  return None


def hot_spots(profile, top: int = 12) -> tuple[list[dict], float]:
  """The `top` functions by own time (share of the profiled time), and the share spent
  in the split source's `src[i]` (reading and decoding; Grain's per-read stats excluded)."""
  stats = pstats.Stats(profile)
  total = stats.total_tt
  source = max((v[3] for (path, _, func), v in stats.stats.items()
                if "t5forge/data/" in path and func == "__getitem__"), default=0.0) / total
  rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
  name = lambda path: path.split("site-packages/")[-1].replace(os.getcwd() + "/", "")
  return [{"function": f"{name(path)}:{line}:{func}", "calls": n, "tottime_share": round(
      tt / total, 3), "cumtime_share": round(ct / total, 3)}
          for (path, line, func), (_, n, tt, ct, _) in rows], round(source, 3)


def machine() -> dict:
  import google.protobuf, grain, pyarrow
  cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
              if l.startswith("model name")), platform.processor())
  return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(),
          "python": sys.version.split()[0], "grain": getattr(grain, "__version__", ""),
          "pyarrow": pyarrow.__version__, "protobuf": google.protobuf.__version__}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="3,000 rows, 3 rounds of 10 batches, 1 cold open per source")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--output", default=None)
  args = parser.parse_args(argv)
  rows_limit, rounds, batches, opens, check, raw = (
      (3000, 3, 10, 1, 200, 1000) if args.quick else (None, 11, 30, 3, 1000, 3000))
  rounds = args.rounds or rounds
  output = args.output or os.path.join(
      "bench", "results", "data_sources_quick.json" if args.quick else "data_sources.json")

  import t5forge.data as data
  from t5forge.data import tasks
  import pyarrow.parquet, grain, yaml  # noqa: F401  (not part of any first open)
  load = [os.getloadavg()]
  root = tempfile.mkdtemp(prefix="t5forge-bench-sources-")
  try:
    rows = read_rows(rows_limit)
    start = time.perf_counter()
    write_all(root, rows, tasks.TaskRegistry.get("bible_translate_en_es"))
    print(f"{len(rows)} rows written in every format in {time.perf_counter() - start:.1f}s "
          f"({root})")
    specs = sources(root)
    mb = lambda d: sum(os.path.getsize(f) for f in glob.glob(  # "**" skips index files
        os.path.join(d, "**"), recursive=True) if os.path.isfile(f)) / 1e6
    results = {s["name"]: {"source": s["name"], "reader": s["reader"], "mb": mb(s["dir"]),
                           "first_open_s": [], "rates": [], "raw_us": []} for s in specs}
    data.add_global_cache_dirs([os.path.join(root, "seqio")])
    first_open(specs[0], root)  # warm-up, discarded: the first open of all pays for imports
    for k in range(opens):  # alternated as well
      for s in specs[k:] + specs[:k]:
        sec, results[s["name"]]["first_open_wrote_mb"] = first_open(s, root)
        results[s["name"]]["first_open_s"].append(sec)
    os.environ["T5FORGE_CACHE"] = os.path.join(root, "cache")  # warm from here on
    for s in specs:
      t = make_task(s)
      tasks.TaskRegistry.add(t.name, source=t.source, preprocessors=t.preprocessors,
                             output_features=t.output_features)
    # The first examples and a random sample of the rest: every shard, row group and
    # record batch is visited, not only the first.
    head = check // 4
    picked = list(range(head)) + sorted(np.random.default_rng(0).choice(
        np.arange(head, len(rows)), check - head, replace=False).tolist())
    reference = dict(zip(picked, task_examples(specs[0], picked)))
    for s in specs:
      n = len(tasks.TaskRegistry.get(s["task"]).split_source("train", s["layout"] == "cached"))
      why = same_examples(s, reference) if n == len(rows) else (
          f"{n} examples, the TSV has {len(rows)}")
      if why:
        raise SystemExit(f"{s['name']}: not the TSV's examples: {why}")
    print(f"{len(reference)} task examples (the first {head}, then sampled) identical "
          f"across {len(specs)} sources")
    for r in range(rounds):
      for s in specs[r % len(specs):] + specs[:r % len(specs)]:
        results[s["name"]]["rates"].append(pipeline_rate(s, r, batches))
        results[s["name"]]["raw_us"].append(raw_read_us(s, r, raw))
      load.append(os.getloadavg())
      print(f"round {r + 1}/{rounds} done, load {load[-1][0]:.2f}")
    base = results["tsv"]["rates"]
    for res in results.values():
      # Paired with the TSV's rate of the same round: load drifts between rounds cancel.
      res["x_tsv"] = round(statistics.median(a / b for a, b in zip(res["rates"], base)), 3)
      res["examples_per_s"] = round(statistics.median(res["rates"]), 1)
      res["pipeline_us_per_example"] = round(1e6 / res["examples_per_s"], 1)
      res["first_open_s_median"] = round(statistics.median(res["first_open_s"]), 4)
      res["s_per_mb"] = round(res["first_open_s_median"] / res["mb"], 4)
      res["raw_read_us"] = round(statistics.median(res["raw_us"]), 2)
      res["mb"] = round(res["mb"], 2)
    slow = [s for s in specs if results[s["name"]]["x_tsv"] < TARGET]
    for s in ([specs[0]] + slow) if slow else []:
      prof = cProfile.Profile()
      pipeline_rate(s, 0, batches, prof)
      results[s["name"]]["profile"], results[s["name"]]["source_share"] = hot_spots(prof)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  report(results, load, args.quick, output, rows=len(rows), rounds=rounds, batches=batches,
         batch_size=BATCH, lengths=LENGTHS, checked_examples=len(reference),
         target_x_tsv=TARGET)


def report(results: dict, load: list, quick: bool, output: str, **run) -> None:
  """Prints the table (and profiles) and writes the JSON."""
  from bench.table import _table
  body = [[r["source"], r["reader"], f"{r['examples_per_s']:.0f}", f"{r['x_tsv']:.2f}x",
           f"{r['first_open_s_median']:.3f}", f"{r['s_per_mb']:.3f}", f"{r['raw_read_us']:.1f}",
           f"{r['mb']:.1f}"] for r in results.values()]
  m = machine()
  print(f"\n{m['cpu']}, {m['cpus']} cores, load average {load[0][0]:.2f} at start, "
        f"{load[-1][0]:.2f} at end; {run['rows']} rows; medians of {run['rounds']} rounds of "
        f"{run['batches']} batches (x TSV: of the per-round ratios)")
  print("\n".join(_table(["source", "reader", "examples/s", "x TSV", "first open s", "s/MB",
                          "raw read us/ex", "MB"], body, left=2)))
  for name, res in results.items():
    if "profile" in res:
      print(f"\nprofile, {name} ({res['x_tsv']:.2f}x TSV): src[i] takes {res['source_share']:.1%} "
            "of the time; top functions by own time:")
      for p in res["profile"][:8]:
        print(f"  {p['tottime_share']:6.1%}  {p['function']}")
  out = {"benchmark": "data_sources",
         "command": "python -m bench.data_sources" + (" --quick" if quick else ""),
         "machine": m, "load_average": [list(map(float, x)) for x in load], **run,
         "results": list(results.values())}
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output + ".tmp", "w") as f:
    json.dump(out, f, indent=2)
  os.replace(output + ".tmp", output)
  print(f"\nwrote {output}")


if __name__ == "__main__":
  main()
