"""Data pipeline throughput and packing density on this machine.

    python -m bench.data_pipeline            # from the repo root; ~1 minute on 2 CPU cores
    python -m bench.data_pipeline --quick    # fewer batches

For each configuration: task examples/s and real (non-padding) tokens/s through
the whole pipeline (read -> preprocess -> tokenize -> pack -> batch, in one
process unless noted), and the share of real tokens in the batches, per feature
and overall. Writes `bench/results/data_pipeline.json`.

What to expect: the Bible task at T5's pretraining lengths 512/114 cannot be
dense, whatever the packer: a verse pair is ~45 input and ~33 target tokens, so
114 target slots hold ~3 verses whose inputs fill only ~135 of 512 encoder
slots. The decoder side packs >90% full with first-fit; with lengths in the
data's own ratio (256/192) both sides do. Span corruption at 512/114 is dense by
construction (568-token windows -> exactly 512/114).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

BIBLE, SPAN = "bible_translate_en_es", "english_span_corruption"
T5_LENGTHS = {"inputs": 512, "targets": 114}
RATIO_LENGTHS = {"inputs": 256, "targets": 192}  # the Bible's own inputs:targets ratio
CONFIGS = [
    # name, task, lengths, pack, packer
    ("bible 512/114 first_fit", BIBLE, T5_LENGTHS, True, "first_fit"),
    ("bible 512/114 greedy", BIBLE, T5_LENGTHS, True, "greedy"),
    ("bible 512/114 unpacked", BIBLE, T5_LENGTHS, False, "first_fit"),
    ("bible 256/192 first_fit", BIBLE, RATIO_LENGTHS, True, "first_fit"),
    ("bible 256/192 greedy", BIBLE, RATIO_LENGTHS, True, "greedy"),
    ("span_corruption 512/114", SPAN, T5_LENGTHS, True, "first_fit"),
]
# The same pipeline with Grain worker processes (one per core here).
WORKER_CONFIGS = [("bible 256/192 first_fit, 2 workers", BIBLE, RATIO_LENGTHS, True, "first_fit")]


def run(name, task, lengths, pack, packer, batch_size, num_batches, num_workers=0):
  import t5forge.data as data

  start = time.perf_counter()
  it = data.get_batches(task, lengths, batch_size=batch_size, pack=pack, packer=packer, seed=0,
                        num_workers=num_workers)
  next(it)  # first batch: builds indexes/caches and fills the first packing window
  startup = time.perf_counter() - start
  examples = real_in = real_out = slots_in = slots_out = 0
  start = time.perf_counter()
  for _ in range(num_batches):
    b = next(it)
    enc, dec = b["encoder_input_tokens"], b["decoder_target_tokens"]
    real_in += int((enc != 0).sum())
    real_out += int((dec != 0).sum())
    slots_in += enc.size
    slots_out += dec.size
    if pack:
      examples += int(b["decoder_segment_ids"].max(axis=1).sum())
    else:
      examples += int((dec != 0).any(axis=1).sum())
  seconds = time.perf_counter() - start
  it.close()
  return {
      "name": name, "task": task, "lengths": lengths, "pack": pack,
      "packer": packer if pack else None,
      "batch_size": batch_size, "batches": num_batches, "num_workers": num_workers,
      "seconds": round(seconds, 3),
      "startup_seconds": round(startup, 3),
      "examples_per_s": round(examples / seconds, 1),
      "real_tokens_per_s": round((real_in + real_out) / seconds, 1),
      "rows_per_s": round(batch_size * num_batches / seconds, 1),
      "examples_per_row": round(examples / (batch_size * num_batches), 2),
      "real_share_inputs": round(real_in / slots_in, 4),
      "real_share_targets": round(real_out / slots_out, 4),
      "real_share_total": round((real_in + real_out) / (slots_in + slots_out), 4),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="20 batches per configuration instead of 150")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--output", default=os.path.join("bench", "results", "data_pipeline.json"))
  args = parser.parse_args(argv)
  num_batches = 20 if args.quick else 150

  import grain
  results = [run(*cfg, batch_size=args.batch_size, num_batches=num_batches) for cfg in CONFIGS]
  results += [run(*cfg, batch_size=args.batch_size, num_batches=num_batches, num_workers=2)
              for cfg in WORKER_CONFIGS]

  header = (f"{'configuration':<36} {'examples/s':>10} {'tokens/s':>10} {'ex/row':>6} "
            f"{'real in':>8} {'real tgt':>8} {'real all':>8} {'startup':>8}")
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['name']:<36} {r['examples_per_s']:>10.0f} {r['real_tokens_per_s']:>10.0f} "
          f"{r['examples_per_row']:>6.2f} {r['real_share_inputs']:>8.1%} "
          f"{r['real_share_targets']:>8.1%} {r['real_share_total']:>8.1%} "
          f"{r['startup_seconds']:>7.1f}s")
  report = {
      "benchmark": "data_pipeline",
      "command": "python -m bench.data_pipeline" + (" --quick" if args.quick else ""),
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "python": sys.version.split()[0], "grain": getattr(grain, "__version__", ""),
                  "numpy": np.__version__},
      "notes": "one process unless num_workers > 0; tokens/s counts real (non-padding) tokens "
               "of inputs and targets",
      "results": results,
  }
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  tmp = args.output + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=2)
  os.replace(tmp, args.output)
  print(f"\nwrote {args.output}")


if __name__ == "__main__":
  main()
