"""A benchmark worker: one long-lived process per framework (`python -m bench.worker KIND`).

KIND is `ours` (JAX, bench/ours.py), `hf` (torch + transformers, bench/hf_torch.py) or
`ct2` (CTranslate2, bench/ct2.py); JAX and torch never share a process. An `ours`
worker applies T5FORGE_MALLOC as the t5forge command line does (`t5forge.host_memory`:
the default preloads tcmalloc or jemalloc where installed).

Protocol, one JSON object per line: the driver writes `{"op": ..., "args": {...}}` on
stdin; the worker answers `{"ok": true, "result": ...}` or `{"ok": false, "error": ...}`
on the stdout it had at start. Anything libraries print goes to stderr (the driver's log
file for this worker). Ops:

- `setup {name, kind, ...}`: prepare job `name` (a backend's `setup_<kind>(**args)`, which
  returns (run function, info)); runs it once (compiling) and returns info with
  `first_run_s` (and what the backend adds, e.g. the compile time).
- `run {name}`: one timed run of a job; returns `{"seconds": ...}` measured here, around
  the blocking call only.
- `call {fn, ...}`: a backend's `op_<fn>(**args)` (build a model directory, the data
  pipeline, versions).
- `drop {name}`: forget a job (frees its memory).

The worker exits when its stdin closes (the driver finished or died), or on SIGTERM.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback

BACKENDS = {"ours": "bench.ours", "hf": "bench.hf_torch", "ct2": "bench.ct2"}


class Jobs:
  """The prepared jobs of one worker and their run functions."""

  def __init__(self, backend):
    self.backend = backend
    self.runs = {}

  def setup(self, name: str, kind: str, **args) -> dict:
    run, info = getattr(self.backend, f"setup_{kind}")(**args)
    start = time.perf_counter()
    extra = run()
    info = dict(info)
    info["first_run_s"] = time.perf_counter() - start + info.get("compile_s", 0.0)
    if isinstance(extra, dict):
      info.update(extra)
    self.runs[name] = run
    return info

  def run(self, name: str) -> dict:
    fn = self.runs[name]
    start = time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - start}

  def drop(self, name: str) -> dict:
    self.runs.pop(name, None)
    import gc
    gc.collect()
    return {}

  def call(self, fn: str, **args):
    return getattr(self.backend, f"op_{fn}")(**args)


def main(argv=None) -> None:
  kind = (argv or sys.argv[1:])[0]
  if kind == "ours":  # before the descriptors below change: execve keeps 0, 1 and 2 only
    from t5forge import host_memory
    host_memory.reexec()
  # Keep the protocol channel private: libraries that print would corrupt it.
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  sys.stdout = sys.stderr

  def reply(**msg):
    proto.write(json.dumps(msg) + "\n")
    proto.flush()

  if kind == "ours":
    # As the t5forge command line does, before JAX starts its threads (T5FORGE_MALLOC=keep).
    host_memory.keep_freed_memory()
  try:
    backend = importlib.import_module(BACKENDS[kind]).Backend()
  except Exception:
    reply(ok=False, error=traceback.format_exc())
    return
  jobs = Jobs(backend)
  reply(ok=True, result={"pid": os.getpid(), "kind": kind})
  for line in sys.stdin:
    if not line.strip():
      continue
    msg = json.loads(line)
    try:
      result = getattr(jobs, msg["op"])(**msg.get("args", {}))
      reply(ok=True, result=result)
    except Exception:
      reply(ok=False, error=traceback.format_exc())


if __name__ == "__main__":
  main()
