"""`t5forge train --gin_file=... --gin.MODEL_DIR=\\"...\\" [--gin_search_paths=...]`.

T5X's train.py interface: gin files (a run gin such as runs/finetune.gin plus a model
gin such as models/t5_1_1/small.gin, or an example gin), macro bindings with
--gin.NAME=VALUE, T5X's data flags --tfds_data_dir and --seqio_additional_cache_dirs
(`cli/data_flags.py`), and the T5X flags for several processes (see `t5forge/multihost.py`).

    --lock_wait_s=SECONDS   a bucket MODEL_DIR whose lock another host holds: wait up to
                            this long for it to go stale, then take it over (0: refuse at
                            once; default: the stale timeout T5FORGE_BUCKET_LOCK_TIMEOUT_S
                            and a margin). Same as train_script.train.lock_wait_s in a gin.

A run whose gin files and flags set no network.ModelConfig.dtype gets bfloat16 mixed
precision where the CPU has bf16 instructions, else float32 (printed; `t5forge/precision.py`).
"""
from __future__ import annotations

import os
import sys

from t5forge import host_memory, precision
from t5forge.cli import data_flags, gin_flags
from t5forge.errors import UserError

USAGE = __doc__


def main(argv: list[str]) -> int:
  if any(a in ("-h", "--help") for a in argv):
    print(USAGE)
    return 0
  argv, lock_wait_s = _take_lock_wait(argv)
  files, bindings, paths, rest = gin_flags.split_flags(data_flags.take(argv))
  if rest:
    raise UserError(f"unknown flag(s) {rest}; train takes --gin_file, --gin.NAME=VALUE, "
                    "--gin_bindings, --gin_search_paths, --tfds_data_dir, "
                    "--seqio_additional_cache_dirs and --lock_wait_s")
  # What this host runs with (every process of a multi-process job says its own).
  print(host_memory.describe(), flush=True)
  gin_flags.parse(files, bindings, paths)
  show_precision(gin_flags.apply_precision())
  import gin  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.train import loop  # noqa: PLC0415 (after the flags parse: --help stays fast)
  result = gin_flags.call(loop.train, operative_config=gin.config_str(),
                          show_progress=sys.stderr.isatty() or bool(os.environ.get("T5FORGE_PROGRESS")),
                          **({} if lock_wait_s is None else {"lock_wait_s": lock_wait_s}))
  from t5forge import multihost  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if not multihost.is_chief():  # process 0 reports for the whole job
    return 0
  model_dir = gin.query_parameter("MODEL_DIR/macro.value") if _has_macro("MODEL_DIR") else None
  print(f"training stopped at step {result.step} ({result.stopped})")
  if result.train_metrics:  # per token, as the progress lines (T5X's `loss` is a sum)
    m = result.train_metrics
    print(f"  train loss per target token "
          f"{m.get('loss_per_nonpadding_target_token', float('nan')):.3f}, "
          f"accuracy {m.get('accuracy', float('nan')):.3f}")
  if model_dir:
    print(f"  checkpoints, config.gin, model-info.txt, metrics.jsonl: {model_dir}")
    print(f"  TensorBoard: tensorboard --logdir {model_dir}")
  return 0


def _take_lock_wait(argv: list[str]) -> tuple[list[str], float | None]:
  """argv without `--lock_wait_s=SECONDS` (or `--lock_wait_s SECONDS`), and its value."""
  rest, value = [], None
  i = 0
  while i < len(argv):
    name, eq, raw = argv[i].partition("=")
    if name != "--lock_wait_s":
      rest.append(argv[i])
      i += 1
      continue
    if not eq:
      if i + 1 >= len(argv):
        raise UserError("--lock_wait_s needs a value: seconds to wait for another host's "
                        "MODEL_DIR lock, e.g. --lock_wait_s=600 (0: refuse at once)")
      raw, i = argv[i + 1], i + 1
    try:
      value = float(raw)
    except ValueError:
      value = -1.0
    if not value >= 0:
      raise UserError(f"--lock_wait_s={raw}: expected seconds >= 0, e.g. --lock_wait_s=600 "
                      "(0: refuse at once when another host holds the MODEL_DIR lock)")
    i += 1
  return rest, value


def show_precision(choice: precision.Choice) -> None:
  """Prints the run's precision line (and its note, if the choice is slow here) on the
  process that reports for the job; `t5forge demo` prints it the same way."""
  from t5forge import multihost  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if multihost.is_chief():
    print(choice.line, flush=True)
    if choice.note:
      print(choice.note, file=sys.stderr, flush=True)


def _has_macro(name: str) -> bool:
  import gin  # noqa: PLC0415 (after the flags parse: --help stays fast)
  try:
    gin.query_parameter(f"{name}/macro.value")
    return True
  except (ValueError, KeyError):
    return False
