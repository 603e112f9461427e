"""Tiny training runs through the CLI, for the end-to-end tests."""
import contextlib
import io
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_devices(n: int) -> dict:
  """The environment of a subprocess with n host CPU devices: this process's, with the
  device count added to its XLA_FLAGS (which keep the suite's compile flags, conftest.py)."""
  flags = os.environ.get("XLA_FLAGS", "")
  return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}


# The environment of a subprocess with 8 host CPU devices (the partitioning tests).
EIGHT = host_devices(8)

TINY_GIN = """
include 'runs/pretrain.gin'
include 'models/{model}.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 32}}
TRAIN_STEPS = {steps}
BATCH_SIZE = 8
DROPOUT_RATE = 0.0
EVAL_PERIOD = {eval_period}
EVAL_STEPS = 2
network.ModelConfig.vocab_size = 8000
# float32 whatever the CPU: these runs compare layouts and resumes bit for bit or at float32
# tolerances (the machine's automatic choice: tests/test_precision.py).
network.ModelConfig.dtype = 'float32'
utils.SaveCheckpointConfig.period = {period}
train_script.train.stats_period = {stats_period}
train_script.train.record_batch_fingerprints = True
utils.create_learning_rate_scheduler.warmup_steps = 100
"""


def write_gin(path, *, steps=12, period=4, eval_period=1000, stats_period=4, extra="", header="",
              model="t5_1_1/tiny"):
  with open(path, "w") as f:
    f.write(header + TINY_GIN.format(steps=steps, period=period, eval_period=eval_period,
                                     stats_period=stats_period, model=model) + extra)
  return str(path)


def train_cmd(gin_file, model_dir, *bindings):
  return [sys.executable, "-m", "t5forge", "train", f"--gin_file={gin_file}",
          f'--gin.MODEL_DIR="{model_dir}"', *[f"--gin.{b}" for b in bindings]]


def run_train(gin_file, model_dir, *bindings, timeout=600):
  return subprocess.run(train_cmd(gin_file, model_dir, *bindings), capture_output=True,
                        text=True, cwd=ROOT, timeout=timeout)


def cli(*argv, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
  """`python -m t5forge *argv` run in this process, as a subprocess would see it: the exit
  status and what it printed (`.returncode`, `.stdout`, `.stderr`), with `env` (variables
  set for the call only) and `cwd`; sys.path starts with `cwd` and env's PYTHONPATH, as
  `python -m` would. For the one-line errors and short commands, which would otherwise
  pay a Python start, a JAX import and the same compiles in a new process each; an
  exception the command does not turn into an exit status propagates (a subprocess would
  print its traceback and exit 1). A subprocess stays the point where the process itself
  is: signals, exit codes after a kill, several processes, the environment at start-up.
  """
  from t5forge.cli import main as cli_main
  out, err = io.StringIO(), io.StringIO()
  code = 0
  with contextlib.ExitStack() as stack:
    stack.enter_context(_logging_restored())
    stack.enter_context(_registrations_undone())
    stack.enter_context(_environ(env or {}))
    stack.enter_context(_sys_path(cwd, (env or {}).get("PYTHONPATH")))
    stack.enter_context(contextlib.chdir(cwd))
    stack.enter_context(contextlib.redirect_stdout(out))
    stack.enter_context(contextlib.redirect_stderr(err))
    try:
      cli_main.main([str(a) for a in argv])
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  return subprocess.CompletedProcess(["t5forge", *map(str, argv)], code, out.getvalue(),
                                     err.getvalue())


def train_in_process(gin_file, model_dir, *bindings, env=None) -> subprocess.CompletedProcess:
  """`run_train` in this process (see `cli`)."""
  return cli(*train_cmd(gin_file, model_dir, *bindings)[3:], env=env)


@contextlib.contextmanager
def _logging_restored():
  """The command line installs its console handler on the root logger: removed again, so
  later tests in this process see the library's logging as a library user does."""
  import logging
  handlers, level = list(logging.root.handlers), logging.getLogger("t5forge").level
  try:
    yield
  finally:
    logging.root.handlers[:] = handlers
    logging.getLogger("t5forge").setLevel(level)


@contextlib.contextmanager
def _registrations_undone():
  """What the command imported from the user's paths (a `--module`, a gin's `import tasks`)
  and the tasks and mixtures it registered are gone again, as when its process ends: a
  later test in this process sees the bundled registry only, and its own `tasks` module
  when it imports one, not this one's from sys.modules."""
  from t5forge.data import MixtureRegistry, TaskRegistry
  before = {r: set(r.names()) for r in (TaskRegistry, MixtureRegistry)}
  modules = set(sys.modules)
  try:
    yield
  finally:
    for registry, names in before.items():
      for name in set(registry.names()) - names:
        registry.remove(name)
    kept = (sys.prefix, sys.base_prefix, os.path.join(ROOT, "t5forge"))
    for name in set(sys.modules) - modules:
      path = getattr(sys.modules[name], "__file__", None) or ""
      if path and not os.path.abspath(path).startswith(kept):
        del sys.modules[name]


@contextlib.contextmanager
def _sys_path(cwd, pythonpath):
  """sys.path as `python -m` starts it: the working directory, then PYTHONPATH."""
  saved = list(sys.path)
  sys.path[:0] = [os.path.abspath(cwd)] + [p for p in str(pythonpath or "").split(os.pathsep)
                                           if p]
  try:
    yield
  finally:
    sys.path[:] = saved


@contextlib.contextmanager
def _environ(values):
  old = {k: os.environ.get(k) for k in values}
  os.environ.update({k: str(v) for k, v in values.items()})
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def dead_pid() -> int:
  """The pid of a process that has exited (and been reaped): a lock holder known dead."""
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def kill_when(cmd, cond, timeout=300, cwd=ROOT, env=None) -> bool:
  """Starts cmd and SIGKILLs it as soon as cond() holds; False if it ended first."""
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  start = time.time()
  try:
    while proc.poll() is None and time.time() - start < timeout:
      if cond():
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True
      time.sleep(0.002)
    return False
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def wait_all(procs, timeout=600) -> list[str]:
  """The stdout of each process of a multi-process job, each of which must exit 0 (the
  assertion shows its stderr's tail); any still running at the end is killed."""
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      assert p.returncode == 0, err[-3000:]
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return outs


def final_params(model_dir):
  """(path, numpy params) of the latest checkpoint in model_dir."""
  import jax
  import numpy as np
  from t5forge.convert import native
  path = native.latest_checkpoint(str(model_dir))
  _, params, _ = native.load(path)
  return path, jax.tree.map(np.asarray, params)


def fingerprints(model_dir):
  """{step: crc} of the recorded batches. Last write wins: a resumed run re-records the
  steps after its checkpoint."""
  return {r["step"]: r["crc"] for r in read_jsonl(os.path.join(model_dir,
                                                              "batch_fingerprints.0.jsonl"))}


def read_jsonl(path):
  import json
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def error_line(r) -> str:
  """The one `t5forge: error:` line of a CLI run that must fail with exit 2 and no traceback."""
  assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
  lines = [l for l in r.stderr.splitlines() if l.startswith("t5forge: error:")]
  assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  return lines[0]
