"""Driver side of the workers: start, talk to, time and stop framework processes.

    with WorkerGroup(log_dir) as group:
      ours = group.start("ours", "ours fp32")
      hf = group.start("hf", "hf fp32")
      group.wait_ready()
      ours.setup("step", kind="train", ...)          # compiles, runs once
      medians = alternate([(ours, "step"), (hf, "step")], rounds=3)
      ours.peak_rss_mib()                             # VmHWM of that process

Every worker is a child in its own session (so a ctrl-C in the terminal reaches only
the driver, which then stops them in order) and is killed by the kernel if the driver
dies (PR_SET_PDEATHSIG). Leaving a `WorkerGroup` stops all of its workers, whatever
happened inside.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PR_SET_PDEATHSIG = 1


class WorkerError(RuntimeError):
  """A worker failed or died; the message holds its traceback or its log's tail."""


def _die_with_parent() -> None:
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except OSError:
    pass  # not Linux: the closed stdin still ends the worker


def log(msg: str) -> None:
  """Progress to stderr (the tables go to stdout)."""
  print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Worker:
  """One framework process. `call`s block until it answers."""

  def __init__(self, kind: str, label: str, log_path: str, env: dict | None = None):
    self.kind, self.label, self.log_path = kind, label, log_path
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    self._log = open(log_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "bench.worker", kind], cwd=REPO_ROOT, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        bufsize=1, start_new_session=True, preexec_fn=_die_with_parent)
    self.ready = False

  @property
  def pid(self) -> int:
    return self.proc.pid

  def _log_tail(self, lines: int = 25) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    except OSError:
      return ""

  def _read(self):
    line = self.proc.stdout.readline()
    if not line:
      code = self.proc.poll()
      raise WorkerError(f"worker {self.label!r} (pid {self.pid}) died (exit code {code}); "
                        f"last lines of {self.log_path}:\n{self._log_tail()}")
    msg = json.loads(line)
    if not msg["ok"]:
      raise WorkerError(f"worker {self.label!r} failed:\n{msg['error']}")
    return msg["result"]

  def wait_ready(self) -> None:
    if not self.ready:
      self._read()
      self.ready = True

  def request(self, op: str, **args):
    self.wait_ready()
    try:
      self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
      self.proc.stdin.flush()
    except BrokenPipeError:
      pass  # _read reports the death with the log
    return self._read()

  def setup(self, name: str, **args) -> dict:
    return self.request("setup", name=name, **args)

  def run(self, name: str) -> float:
    return self.request("run", name=name)["seconds"]

  def call(self, fn: str, **args):
    return self.request("call", fn=fn, **args)

  def peak_rss_mib(self) -> float | None:
    """The process's peak resident set size so far (VmHWM), MiB."""
    try:
      with open(f"/proc/{self.pid}/status") as f:
        for line in f:
          if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    except OSError:
      pass
    return None

  def stop(self, timeout: float = 15.0) -> None:
    """Closes stdin (the worker exits), then SIGTERM, then SIGKILL."""
    if self.proc.poll() is None:
      try:
        self.proc.stdin.close()
      except OSError:
        pass
      try:
        self.proc.wait(timeout=max(timeout, 0.01))
      except subprocess.TimeoutExpired:
        self.proc.terminate()
        try:
          self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
          self.proc.kill()
          self.proc.wait()
    for stream in (self.proc.stdout, self.proc.stdin):
      try:
        stream.close()
      except OSError:
        pass
    self._log.close()


class WorkerGroup:
  """Workers that live together; all are stopped when the `with` block ends."""

  def __init__(self, log_dir: str):
    self.log_dir = log_dir
    self.workers: list[Worker] = []
    os.makedirs(log_dir, exist_ok=True)

  def start(self, kind: str, label: str, env: dict | None = None) -> Worker:
    """A worker of `kind` (see bench/worker.py); `env` adds environment variables."""
    slug = "".join(c if c.isalnum() else "_" for c in label)
    worker = Worker(kind, label, os.path.join(self.log_dir, f"{slug}.log"), env)
    self.workers.append(worker)
    return worker

  def wait_ready(self) -> None:
    """Workers import their framework in parallel; this waits for all of them."""
    for w in self.workers:
      w.wait_ready()

  def __enter__(self) -> "WorkerGroup":
    return self

  def __exit__(self, exc_type, *exc) -> None:
    # Unwinding an error or ctrl-C: a busy worker would only read EOF after its step.
    self.stop_all(timeout=15.0 if exc_type is None else 0.0)

  def stop_all(self, timeout: float = 15.0) -> None:
    for w in reversed(self.workers):
      w.stop(timeout)
    self.workers.clear()


def warm_up(worker: Worker, name: str, *, min_runs: int, max_runs: int,
            tolerance: float = 0.1) -> list[float]:
  """Untimed runs after setup: at least min_runs, then more (up to max_runs) while the
  last run still differs from the one before by more than `tolerance` (some first steps
  are slow for a while, e.g. HF's Adafactor allocating its statistics over ~3 steps)."""
  times = []
  while len(times) < max_runs:
    times.append(worker.run(name))
    if len(times) >= max(min_runs, 2) and abs(times[-1] - times[-2]) <= tolerance * times[-2]:
      break
  return [round(t, 4) for t in times]


def alternate(jobs: list[tuple[Worker, str]], rounds: int,
              lead_in: int = 0) -> dict[tuple[str, str], dict]:
  """Times every (worker, job) once per round, round-robin, for `rounds` rounds.

  lead_in: untimed runs of the same job just before each timed one, so that a timed
  training step follows a step of its own, as in a training loop. Memory a process freed
  and left unused for a few seconds may have to be faulted in again (glibc and jemalloc
  give it back to the kernel; on a VM with free page reporting, such as the Firecracker
  machines this project ran on, the kernel gives it to the host, and a step after another
  framework's step then spent 5-6 s more in the kernel: docs/performance.md, "Freed memory
  and the host").

  Returns:
    {(worker label, job name): {"median_s", "runs_s"}}.
  """
  runs: dict[tuple[str, str], list[float]] = {(w.label, name): [] for w, name in jobs}
  for r in range(rounds):
    for w, name in jobs:
      for _ in range(lead_in):
        w.run(name)
      runs[(w.label, name)].append(w.run(name))
    log(f"  round {r + 1}/{rounds} done")
  return {k: {"median_s": statistics.median(v), "runs_s": [round(x, 4) for x in v]}
          for k, v in runs.items()}
