"""Host allocators compared on one training step: `python -m bench.allocators [flags]`.

Each T5FORGE_MALLOC choice runs in its own process, one after the other, started with the
environment the `t5forge` command would restart itself with (t5forge.host_memory.plan), so
the numbers are the command line's. Each process compiles ours' training step
(bench/ours.py setup_train: flan-t5-small shape from the bench cache, fp32, unscanned),
runs it --steps times and records every step's seconds and resident memory (VmRSS after
the step) and the peak (VmHWM). Prints a table; writes bench/results/allocators.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench import shapes
from bench.prepare import CACHE_DIR, RESULTS_DIR


def _status_mib(field: str) -> float:
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  return float("nan")


def child(args) -> None:
  """Runs in the measured process: one JSON line per step on stdout."""
  from t5forge import host_memory  # pylint: disable=import-outside-toplevel
  host_memory.keep_freed_memory()
  from bench.ours import Backend  # pylint: disable=import-outside-toplevel
  run, info = Backend().setup_train(
      model_dir=args.model_dir, dtype="float32", optimizer=args.optimizer, scan=False,
      batch=args.batch, input_length=args.input_length, target_length=args.target_length)
  print(json.dumps({"compile_s": info["compile_s"], "allocator": host_memory.describe()}),
        flush=True)
  for step in range(args.steps):
    start = time.perf_counter()
    run()
    print(json.dumps({"step": step, "s": time.perf_counter() - start,
                      "rss_mib": _status_mib("VmRSS")}), flush=True)
  print(json.dumps({"peak_rss_mib": _status_mib("VmHWM")}), flush=True)


def measure(choice: str, args) -> dict:
  env = dict(os.environ, T5FORGE_MALLOC=choice)
  env.pop("T5FORGE_MALLOC_CHOSEN", None)
  from t5forge import host_memory  # pylint: disable=import-outside-toplevel
  planned, note = host_memory.plan(env)
  if note:
    raise SystemExit(note)
  cmd = [sys.executable, "-m", "bench.allocators", "--child", "--model_dir", args.model_dir,
         "--optimizer", args.optimizer, "--batch", str(args.batch), "--steps", str(args.steps),
         "--input_length", str(args.input_length), "--target_length", str(args.target_length)]
  log_dir = os.path.join(CACHE_DIR, "logs")
  os.makedirs(log_dir, exist_ok=True)
  with open(os.path.join(log_dir, f"allocators-{choice}.log"), "w", encoding="utf-8") as log:
    out = subprocess.run(cmd, env=planned or env, stdout=subprocess.PIPE, stderr=log,
                         text=True, check=True).stdout
  lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
  steps = [x for x in lines if "step" in x]
  times = [x["s"] for x in steps[args.skip:]]
  rss = [x["rss_mib"] for x in steps]
  return {"choice": choice, "allocator": lines[0]["allocator"], "compile_s": lines[0]["compile_s"],
          "median_step_s": statistics.median(times), "mean_step_s": statistics.mean(times),
          "peak_rss_mib": lines[-1]["peak_rss_mib"],
          "rss_mib_at": {"step_5": rss[min(4, len(rss) - 1)], "last": rss[-1]},
          "steps": steps}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--choices", default="system,keep,tcmalloc,jemalloc")
  p.add_argument("--size", default="small", choices=sorted(shapes.SHAPES))
  p.add_argument("--model_dir", default=None, help="default: the bench cache's for --size")
  p.add_argument("--optimizer", default="adafactor", choices=("adafactor", "adamw"))
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--input_length", type=int, default=512)
  p.add_argument("--target_length", type=int, default=114)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--skip", type=int, default=3, help="first steps left out of the times")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.model_dir is None:
    args.model_dir = os.path.join(CACHE_DIR, shapes.SHAPES[args.size].cache_key(0), "hf")
  if args.child:
    child(args)
    return
  if not os.path.isdir(args.model_dir):
    raise SystemExit(f"{args.model_dir} does not exist: run `python -m bench train` once "
                     "(it builds the model directories), or pass --model_dir")
  load = os.getloadavg()[0]
  results = []
  for choice in args.choices.split(","):
    r = measure(choice, args)
    results.append(r)
    print(f"{choice:9} step {r['median_step_s']:.2f} s (median of {args.steps - args.skip}), "
          f"peak RSS {r['peak_rss_mib'] / 1024:.2f} GiB, RSS at step 5 "
          f"{r['rss_mib_at']['step_5'] / 1024:.2f} / last {r['rss_mib_at']['last'] / 1024:.2f} GiB"
          f" [{r['allocator']}]", flush=True)
  record = {"size": args.size, "optimizer": args.optimizer, "batch": args.batch,
            "lengths": [args.input_length, args.target_length], "steps": args.steps,
            "load_at_start": load, "load_at_end": os.getloadavg()[0], "results": results}
  path = os.path.join(RESULTS_DIR, f"allocators_{args.size}_{args.optimizer}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
  print(f"load {load:.2f} at start, {record['load_at_end']:.2f} at end; wrote {path}")


if __name__ == "__main__":
  main()
