"""Tiny training runs through the CLI, for the end-to-end tests."""
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment of a subprocess with 8 host CPU devices (the partitioning tests).
EIGHT = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

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
