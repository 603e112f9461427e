"""`t5forge infer`: predict or score a task's split or a file, writing T5X's JSONL.

    t5forge infer --checkpoint MODEL_DIR --input inputs.txt --output_dir out/
    t5forge infer --checkpoint MODEL_DIR --task bible_translate_en_es --split validation \\
        --mode predict_with_aux --beam_size 4 --output_dir out/
    t5forge infer --checkpoint ckpt --input pairs.tsv --mode score --output_dir out/
    t5forge infer --gin_file=runs/infer.gin --gin.CHECKPOINT_PATH=\"...\" ...  (T5X style)

Files: .tsv (inputs[<TAB>targets]), .jsonl ({"inputs": ..., "targets": ...}) or text
(one input a line), optionally .gz. The output is written in chunks with .COMPLETED
markers, so rerunning a killed command resumes it; then merged into one file. A rerun
reuses earlier output only when inputs, mode, decoding options, lengths and checkpoint
are the same; otherwise it refuses, naming what differs (--overwrite replaces it).
"""
from __future__ import annotations

import argparse
import warnings

from t5forge.cli import data_flags, decode_flags
from t5forge.errors import UserError


def main(argv: list[str]) -> int:
  if any(a.startswith("--gin") for a in argv):  # T5X style: runs/infer.gin + bindings
    from t5forge.cli import gin_flags  # noqa: PLC0415 (after the flags parse: --help stays fast)
    files, bindings, paths, rest = gin_flags.split_flags(data_flags.take(argv))
    if rest:
      raise UserError(f"unknown flag(s) {rest} with --gin_file; set options as gin bindings")
    gin_flags.parse(files, bindings, paths)
    from t5forge import infer  # noqa: PLC0415 (after the flags parse: --help stays fast)
    result = gin_flags.call(infer.infer_task)
    print(f"wrote {result.num_examples} lines to {result.path}")
    return 0
  parser = argparse.ArgumentParser(prog="t5forge infer", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--checkpoint", required=True,
                      help="a checkpoint, a MODEL_DIR (latest), an HF directory, a T5X or Mesh TF checkpoint")
  src = parser.add_mutually_exclusive_group(required=True)
  src.add_argument("--input", help="TSV, JSONL or text file of inputs")
  src.add_argument("--task", help="registered task (with --split)")
  parser.add_argument("--split", default="validation")
  parser.add_argument("--mode", choices=["predict", "predict_with_aux", "score"],
                      default="predict")
  parser.add_argument("--output_dir", required=True)
  parser.add_argument("--name", default=None, help="output name (default: task or file name)")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--chunk_size", type=int, default=1024, help="inputs per resumable chunk")
  parser.add_argument("--scheduler", choices=["continuous", "static"], default="continuous",
                      help="continuous: greedy / sampled rows of an encoder-decoder feed "
                      "--batch_size decode slots as they free up; static: padded batches "
                      "that decode as long as their longest row (beams, decoder-only models "
                      "and score mode always)")
  parser.add_argument("--max_input_length", type=int, default=None,
                      help="truncate longer inputs (counted warning), default: longest")
  parser.add_argument("--max_decode_length", type=int, default=64,
                      help="tokens to decode; in score mode the longest target kept")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace earlier output of this name made from other inputs, "
                      "options or checkpoint (default: refuse)")
  parser.add_argument("--strict", action="store_true",
                      help="refuse inputs longer than --max_input_length instead of truncating")
  parser.add_argument("--vocabulary", default=None,
                      help="SentencePiece .model when the checkpoint carries none")
  parser.add_argument("--module", default=None, help="module to import (registers tasks)")
  parser.add_argument("--use_checkpoint_vocabulary", action="store_true",
                      help="with --task: tokenize the task with the checkpoint's vocabulary "
                      "(or --vocabulary) instead of its own")
  data_flags.add(parser)
  decode_flags.add(parser)
  args = parser.parse_args(argv)
  opts = decode_flags.options(args)
  data_flags.apply(args.tfds_data_dir, args.seqio_additional_cache_dirs)
  if args.use_cached and not args.task:
    raise UserError("--use_cached reads a task's SeqIO cache; it needs --task")

  from t5forge import data, infer  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.train.settings import DatasetConfig, RestoreCheckpointConfig  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if args.module:  # first, so that an error names the flag given here
    data.import_task_module(args.module)
  lengths = {"targets": args.max_decode_length}
  if args.max_input_length:
    lengths["inputs"] = args.max_input_length
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = infer.infer_task(
        restore_checkpoint_cfg=RestoreCheckpointConfig(path=args.checkpoint, mode="latest"),
        dataset_cfg=DatasetConfig(args.task, lengths, split=args.split,
                                  batch_size=args.batch_size, shuffle=False, pack=False,
                                  module=args.module, use_cached=args.use_cached),
        input_path=args.input, vocabulary_path=args.vocabulary,
        use_checkpoint_vocabulary=args.use_checkpoint_vocabulary,
        load_overrides=decode_flags.runtime_overrides(args), output_dir=args.output_dir,
        name=args.name, mode=args.mode, chunk_size=args.chunk_size, strict=args.strict,
        decode_options=opts, overwrite=args.overwrite, scheduler=args.scheduler,
        partitioner=decode_flags.partitioner(args, per_process=True))
  for w in caught:
    print(f"warning: {w.message}")
  print(f"wrote {result.num_examples} lines to {result.path} ({result.chunks_done_now} of "
        f"{result.num_chunks} chunks computed now; the rest were done by an earlier run)")
  return 0
