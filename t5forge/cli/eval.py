"""`t5forge eval`: decode a task's eval split with one, the latest, or all checkpoints and
compute the task's metrics (T5X's eval.py).

    t5forge eval --checkpoint MODEL_DIR --mode all --task bible_translate_en_es
    t5forge eval --gin_file=runs/eval.gin --gin.CHECKPOINT_PATH=\\"...\\" ...

Writes <task>-metrics.jsonl, per-example <task>-<step>.jsonl and TensorBoard events to
--output_dir (default MODEL_DIR/inference_eval). Each metrics line records what it covers
(split, example count, feature lengths, decoding options, checkpoint); a rerun skips a
checkpoint only when a record covers exactly what it would evaluate (--force: never).
"""
from __future__ import annotations

import argparse

from t5forge.cli import data_flags, decode_flags, gin_flags


def _lengths(text: str | None) -> dict[str, int] | None:
  """'inputs=512,targets=128' -> {'inputs': 512, 'targets': 128}; None when not given."""
  if not text:
    return None
  out = {}
  for part in text.split(","):
    k, eq, v = part.partition("=")
    try:
      if not eq or not k.strip():
        raise ValueError
      out[k.strip()] = int(v)
      if out[k.strip()] <= 0:
        raise ValueError
    except ValueError:
      from t5forge.errors import UserError  # noqa: PLC0415 (after the flags parse: --help stays fast)
      raise UserError(f"--feature_lengths {text!r}: {part.strip()!r} is not NAME=LENGTH with a "
                      "positive integer; write e.g. --feature_lengths inputs=512,targets=128") from None
  return out


def main(argv: list[str]) -> int:
  if any(a.startswith("--gin") for a in argv):
    files, bindings, paths, rest = gin_flags.split_flags(data_flags.take(argv))
    if rest:
      from t5forge.errors import UserError  # noqa: PLC0415 (after the flags parse: --help stays fast)
      raise UserError(f"unknown flag(s) {rest} with --gin_file; set options as gin bindings")
    gin_flags.parse(files, bindings, paths)
    from t5forge import evaluate  # noqa: PLC0415 (after the flags parse: --help stays fast)
    gin_flags.call(evaluate.evaluate)
    return 0
  parser = argparse.ArgumentParser(prog="t5forge eval", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--checkpoint", required=True,
                      help="a checkpoint, a MODEL_DIR, an HF directory, a T5X or Mesh TF checkpoint")
  parser.add_argument("--mode", choices=["specific", "latest", "all"], default=None,
                      help="default: 'latest' for a MODEL_DIR, else 'specific'")
  parser.add_argument("--task", required=True, help="registered task or mixture")
  parser.add_argument("--split", default="validation")
  parser.add_argument("--feature_lengths", default=None,
                      help="e.g. inputs=512,targets=128 (default: the longest example)")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--num_examples", type=int, default=None,
                      help="evaluate the first N examples of each task (default: all)")
  parser.add_argument("--force", action="store_true",
                      help="evaluate even checkpoints already evaluated the same way")
  parser.add_argument("--output_dir", default=None)
  parser.add_argument("--scheduler", choices=["continuous", "static"], default="continuous",
                      help="continuous: greedy / sampled rows of an encoder-decoder feed "
                      "--batch_size decode slots as they free up; static: padded batches "
                      "(beams and decoder-only models always)")
  parser.add_argument("--module", default=None, help="module to import (registers tasks)")
  parser.add_argument("--use_checkpoint_vocabulary", action="store_true",
                      help="tokenize the task with the checkpoint's vocabulary instead of its "
                      "own (e.g. a model fine-tuned from Flan-T5 with finetune_from_hf.gin)")
  data_flags.add(parser)
  decode_flags.add(parser)
  args = parser.parse_args(argv)
  data_flags.apply(args.tfds_data_dir, args.seqio_additional_cache_dirs)
  from t5forge import evaluate  # noqa: PLC0415 (after the flags parse: --help stays fast)
  task = args.task
  if args.use_checkpoint_vocabulary:
    from t5forge import data  # noqa: PLC0415 (after the flags parse: --help stays fast)
    from t5forge import convert  # noqa: PLC0415 (after the flags parse: --help stays fast)
    if args.module:
      data.import_task_module(args.module)
    task = data.with_vocabulary(task, convert.from_checkpoint(args.checkpoint))
  from t5forge.convert import paths  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.train.settings import DatasetConfig, RestoreCheckpointConfig  # noqa: PLC0415 (after the flags parse: --help stays fast)
  mode = args.mode or ("latest" if paths.is_model_dir(args.checkpoint) else "specific")
  evaluate.evaluate(
      dataset_cfg=DatasetConfig(task, _lengths(args.feature_lengths), split=args.split,
                                batch_size=args.batch_size, shuffle=False, pack=False,
                                module=args.module, use_cached=args.use_cached),
      restore_checkpoint_cfg=RestoreCheckpointConfig(path=args.checkpoint, mode=mode),
      output_dir=args.output_dir, decode_options=decode_flags.options(args),
      num_examples=args.num_examples, force=args.force,
      load_overrides=decode_flags.runtime_overrides(args),
      partitioner=decode_flags.partitioner(args), scheduler=args.scheduler)
  return 0
