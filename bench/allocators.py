"""Host allocators compared on one training step: `python -m bench.allocators [flags]`.

Each choice runs in its own process, one after the other (over several cases the order
is reversed every other case, so that no choice always runs first), started with the
environment the `t5forge` command would restart itself with (t5forge.host_memory.plan),
so the numbers are the command line's. Choices: a T5FORGE_MALLOC value (`default` is
`auto`, the default), or `jemalloc:<MALLOC_CONF>` for jemalloc with other settings (for
A/B runs of the settings), either followed by space-separated KEY=VALUE environment
settings (`"system GLIBC_TUNABLES=glibc.malloc.hugetlb=1"`). Each process compiles ours'
training step (bench/ours.py setup_train: the bench cache's model for --size, fp32), runs
it --steps times and records
every step's seconds, resident memory after the step (VmRSS) and the highest RSS seen
during the step (a thread reads /proc/self/statm every 5 ms), its minor page faults and
user / system CPU seconds (getrusage), and the peak (VmHWM).
Prints a line per choice; writes bench/results/allocators_<size>_<optimizer>[_scan].json
after each.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time

from bench import prepare, shapes
from bench.prepare import CACHE_DIR, RESULTS_DIR

POLL_S = 0.005


def _status_mib(field: str) -> float:
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _rss_mib() -> float:
  with open("/proc/self/statm", encoding="utf-8") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args) -> None:
  """Runs in the measured process: one JSON line per step on stdout."""
  from t5forge import host_memory
  host_memory.keep_freed_memory()
  from bench.ours import Backend
  run, info = Backend().setup_train(
      model_dir=args.model_dir, dtype="float32", optimizer=args.optimizer, scan=args.scan,
      batch=args.batch, input_length=args.input_length, target_length=args.target_length)
  print(json.dumps({"compile_s": info["compile_s"], "allocator": host_memory.describe()}),
        flush=True)
  high = [0.0]  # the highest RSS since the last step began, kept by the polling thread
  done = threading.Event()

  def poll():
    while not done.wait(POLL_S):
      high[0] = max(high[0], _rss_mib())

  threading.Thread(target=poll, daemon=True).start()
  for step in range(args.steps):
    high[0] = _rss_mib()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    # Page faults and kernel time per step: what an allocator that returns and re-maps
    # the step's temporaries costs (user time: the step's own work on all threads).
    print(json.dumps({"step": step, "s": seconds, "rss_mib": _rss_mib(),
                      "step_high_rss_mib": max(high[0], _rss_mib()),
                      "minflt": after.ru_minflt - before.ru_minflt,
                      "user_s": after.ru_utime - before.ru_utime,
                      "sys_s": after.ru_stime - before.ru_stime}), flush=True)
  done.set()
  print(json.dumps({"peak_rss_mib": _status_mib("VmHWM")}), flush=True)


def environment(choice: str) -> dict:
  """The environment a choice's process starts with (as the t5forge command's restart).

  `choice` may be followed by space-separated KEY=VALUE settings for that process
  (e.g. `system MALLOC_ARENA_MAX=1`, `jemalloc:<conf> GLIBC_TUNABLES=...`).
  """
  from t5forge import host_memory
  choice, *extra = choice.split()
  env = {k: v for k, v in os.environ.items() if k not in (host_memory.MARKER, "MALLOC_CONF")}
  for item in extra:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"--choice {choice!r}: {item!r} is not KEY=VALUE")
    env[key] = value
  if choice.startswith("jemalloc:"):
    env.update(T5FORGE_MALLOC="jemalloc", MALLOC_CONF=choice.split(":", 1)[1])
  else:
    env["T5FORGE_MALLOC"] = "auto" if choice == "default" else choice
  planned, note = host_memory.plan(env)
  if note:
    raise SystemExit(note)
  return planned or env


def measure(choice: str, args) -> dict:
  env = environment(choice)
  cmd = [sys.executable, "-m", "bench.allocators", "--child", "--model_dir", args.model_dir,
         "--optimizer", args.optimizer, "--batch", str(args.batch), "--steps", str(args.steps),
         "--input_length", str(args.input_length), "--target_length", str(args.target_length)]
  cmd += ["--scan"] if args.scan else []
  log_dir = os.path.join(CACHE_DIR, "logs")
  os.makedirs(log_dir, exist_ok=True)
  load = os.getloadavg()[0]
  name = "-".join([args.size, args.optimizer] + ["scan"] * args.scan
                  + [re.sub(r"[^A-Za-z0-9_.=-]+", "-", choice)])
  with open(os.path.join(log_dir, f"allocators-{name}.log"), "w", encoding="utf-8") as log:
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log,
                         text=True, check=True).stdout
  lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
  steps = [x for x in lines if "step" in x]
  times = [x["s"] for x in steps[args.skip:]]
  rss = [x["rss_mib"] for x in steps]
  high = [x["step_high_rss_mib"] for x in steps]
  half = len(steps) // 2
  timed = steps[args.skip:]
  return {"choice": choice, "malloc_conf": env.get("MALLOC_CONF"),
          "allocator": lines[0]["allocator"], "compile_s": lines[0]["compile_s"],
          "median_step_s": statistics.median(times), "mean_step_s": statistics.mean(times),
          "peak_rss_mib": lines[-1]["peak_rss_mib"],
          "median_minflt": statistics.median(x["minflt"] for x in timed),
          "median_user_s": statistics.median(x["user_s"] for x in timed),
          "median_sys_s": statistics.median(x["sys_s"] for x in timed),
          "rss_mib_at": {"step_5": rss[min(4, len(rss) - 1)], "last": rss[-1]},
          # Flat over the run: the highest RSS within steps of the first and second half.
          "step_high_rss_mib": {"first_half": max(high[:half] or high),
                                "second_half": max(high[half:])},
          "load": [load, os.getloadavg()[0]], "steps": steps}


def _gib(mib: float) -> str:
  return f"{mib / 1024:.2f}"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--choice", action="append", dest="choices",
                 help="a T5FORGE_MALLOC value (default = auto) or jemalloc:<MALLOC_CONF>, "
                 "optionally followed by space-separated KEY=VALUE environment settings; "
                 "repeat for several (default: system, keep, default)")
  p.add_argument("--size", default="small", choices=sorted(shapes.SHAPES))
  p.add_argument("--model_dir", default=None, help="default: the bench cache's for --size")
  p.add_argument("--optimizer", default="adafactor", choices=("adafactor", "adamw"))
  p.add_argument("--scan", action="store_true", help="scan over layers")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--input_length", type=int, default=512)
  p.add_argument("--target_length", type=int, default=114)
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--skip", type=int, default=3, help="first steps left out of the times")
  p.add_argument("--reverse", action="store_true", help="run the choices in reverse order")
  p.add_argument("--out", default=None, help="result file (default: see above)")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.model_dir = prepare.model_dir(args.size, args.model_dir)
  if args.child:
    child(args)
    return
  choices = args.choices or ["system", "keep", "default"]
  if args.reverse:
    choices.reverse()
  load = os.getloadavg()
  path = args.out or os.path.join(
      RESULTS_DIR, f"allocators_{args.size}_{args.optimizer}{'_scan' if args.scan else ''}.json")
  record = {"size": args.size, "optimizer": args.optimizer, "scan": args.scan,
            "batch": args.batch, "lengths": [args.input_length, args.target_length],
            "steps": args.steps, "skip": args.skip, "machine": _machine(),
            "load_at_start": load, "results": []}
  for choice in choices:
    r = measure(choice, args)
    record["results"].append(r)
    record["load_at_end"] = os.getloadavg()
    with open(path, "w", encoding="utf-8") as f:  # after every choice: a stopped run keeps it
      json.dump(record, f, indent=1)
    print(f"{choice:9} step {r['median_step_s']:.2f} s (median of {args.steps - args.skip}), "
          f"peak RSS {_gib(r['peak_rss_mib'])} GiB, RSS after step 5 "
          f"{_gib(r['rss_mib_at']['step_5'])} / last {_gib(r['rss_mib_at']['last'])} GiB, "
          f"highest in steps of the 1st / 2nd half {_gib(r['step_high_rss_mib']['first_half'])}"
          f" / {_gib(r['step_high_rss_mib']['second_half'])} GiB, per step "
          f"{r['median_minflt']:.0f} minor faults, user {r['median_user_s']:.2f} s, "
          f"sys {r['median_sys_s']:.2f} s, load {r['load'][0]:.1f}-"
          f"{r['load'][1]:.1f} [{r['allocator']}]", flush=True)
  print(f"load {load[0]:.2f} at start, {record['load_at_end'][0]:.2f} at end; wrote {path}")


def _machine() -> dict:
  from bench.prepare import machine_info
  return machine_info()


if __name__ == "__main__":
  main()
