"""Tiny training runs through the CLI, for the end-to-end tests."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_GIN = """
include 'runs/pretrain.gin'
include 'models/t5_1_1/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 32}}
TRAIN_STEPS = {steps}
BATCH_SIZE = 8
DROPOUT_RATE = 0.0
EVAL_PERIOD = {eval_period}
EVAL_STEPS = 2
network.ModelConfig.vocab_size = 8000
utils.SaveCheckpointConfig.period = {period}
train_script.train.stats_period = {stats_period}
train_script.train.record_batch_fingerprints = True
utils.create_learning_rate_scheduler.warmup_steps = 100
"""


def write_gin(path, *, steps=12, period=4, eval_period=1000, stats_period=4, extra="", header=""):
  with open(path, "w") as f:
    f.write(header + TINY_GIN.format(steps=steps, period=period, eval_period=eval_period,
                                     stats_period=stats_period) + extra)
  return str(path)


def train_cmd(gin_file, model_dir, *bindings):
  return [sys.executable, "-m", "t5forge", "train", f"--gin_file={gin_file}",
          f'--gin.MODEL_DIR="{model_dir}"', *[f"--gin.{b}" for b in bindings]]


def run_train(gin_file, model_dir, *bindings, timeout=600):
  return subprocess.run(train_cmd(gin_file, model_dir, *bindings), capture_output=True,
                        text=True, cwd=ROOT, timeout=timeout)


def read_jsonl(path):
  import json  # pylint: disable=import-outside-toplevel
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def error_line(r) -> str:
  """The one `t5forge: error:` line of a CLI run that must fail with exit 2 and no traceback."""
  assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
  lines = [l for l in r.stderr.splitlines() if l.startswith("t5forge: error:")]
  assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  return lines[0]
