"""Scan over layers against the layer loop: `python -m bench.scan [flags]`.

One process (started with the allocator the `t5forge` command would use) compiles ours'
training step (bench/ours.py setup_train: Adafactor, the bench cache's model for --size)
unscanned and scanned in each --dtypes, then runs the four steps in turn for --rounds
rounds, so that all of them see the same machine load; each timed step follows --lead_in
untimed steps of its own variant. Prints the compile seconds, the
median step seconds (wall and process CPU, which other sessions' load inflates less) and
the scanned/unscanned ratios; writes bench/results/scan_<size>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench import prepare, shapes
from bench.prepare import RESULTS_DIR


def child(args) -> None:
  from t5forge import host_memory
  host_memory.keep_freed_memory()  # T5FORGE_MALLOC=keep, as the command would
  from bench.ours import Backend
  backend, runs, rows = Backend(), {}, []
  for dtype in args.dtypes.split(","):
    for scan in (False, True):
      run, info = backend.setup_train(args.model_dir, dtype, "adafactor", scan, args.batch,
                                      args.input_length, args.target_length)
      loss = run()["loss"]  # the first execution (warm-up), not timed
      runs[(dtype, scan)] = run
      rows.append({"dtype": dtype, "scan": scan, "compile_s": info["compile_s"],
                   "first_loss": loss, "wall_s": [], "cpu_s": []})
  load = [os.getloadavg()[0]]
  for _ in range(args.rounds):
    for row in rows:
      for _ in range(args.lead_in):  # untimed: see bench.workers.alternate's lead_in
        runs[(row["dtype"], row["scan"])]()
      cpu, wall = time.process_time(), time.perf_counter()
      runs[(row["dtype"], row["scan"])]()
      row["wall_s"].append(time.perf_counter() - wall)
      row["cpu_s"].append(time.process_time() - cpu)
    load.append(os.getloadavg()[0])
  print(json.dumps({"rows": rows, "load": load}), flush=True)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="small", choices=sorted(shapes.SHAPES))
  p.add_argument("--model_dir", default=None, help="default: the bench cache's for --size")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--rounds", type=int, default=4)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--input_length", type=int, default=512)
  p.add_argument("--target_length", type=int, default=114)
  p.add_argument("--lead_in", type=int, default=1,
                 help="untimed steps of the same variant right before each timed one, so "
                      "that a timed step follows its own, as in a training loop")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.model_dir = prepare.model_dir(args.size, args.model_dir)
  if args.child:
    child(args)
    return
  from t5forge import host_memory
  env, note = host_memory.plan(dict(os.environ))
  if note:
    print(note, file=sys.stderr)
  cmd = [sys.executable, "-m", "bench.scan", "--child", "--model_dir", args.model_dir,
         "--dtypes", args.dtypes, "--rounds", str(args.rounds), "--lead_in", str(args.lead_in),
         "--batch", str(args.batch), "--input_length", str(args.input_length),
         "--target_length", str(args.target_length)]
  out = subprocess.run(cmd, env=env or dict(os.environ), stdout=subprocess.PIPE, text=True,
                       check=True).stdout
  result = json.loads([x for x in out.splitlines() if x.startswith("{")][-1])
  rows = result["rows"]
  for row in rows:
    row["median_wall_s"] = statistics.median(row["wall_s"])
    row["median_cpu_s"] = statistics.median(row["cpu_s"])
  print(f"load {' '.join(f'{x:.1f}' for x in result['load'])}")
  for dtype in args.dtypes.split(","):
    loop, scan = (next(r for r in rows if r["dtype"] == dtype and r["scan"] == s)
                  for s in (False, True))
    for r in (loop, scan):
      print(f"{dtype:9s} {'scan' if r['scan'] else 'loop'}: step {r['median_wall_s']:.2f} s "
            f"(cpu {r['median_cpu_s']:.2f} s), compile {r['compile_s']:.1f} s")
    print(f"{dtype:9s} scan/loop: step {scan['median_wall_s'] / loop['median_wall_s']:.3f} "
          f"(cpu {scan['median_cpu_s'] / loop['median_cpu_s']:.3f}), "
          f"compile {scan['compile_s'] / loop['compile_s']:.2f}")
  path = os.path.join(RESULTS_DIR, f"scan_{args.size}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(dict(result, args=vars(args)), f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
