"""`t5forge demo` (what `make demo` runs): train a small T5 from scratch on the bundled
English -> Spanish Bible task, evaluate BLEU on the held-out Gospel of John, and show
translations beside their references.

It runs the same code as `t5forge train` with
`t5forge/configs/examples/bible_translate_from_scratch.gin`, then `t5forge eval`; a rerun
resumes from the last checkpoint in --model_dir (or starts over with --fresh).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time

from t5forge import host_memory, precision
from t5forge.cli import gin_flags

EXAMPLE_GIN = os.path.join(gin_flags.CONFIGS_DIR, "examples", "bible_translate_from_scratch.gin")
TASK = "bible_translate_en_es"
# Training steps of about 8 minutes on 2 CPU cores (AMD EPYC Zen 4), by the precision
# t5forge chooses for the machine (t5forge/precision.py): bf16 steps are faster where the
# CPU has bf16 instructions, so they buy more steps in the same time.
DEFAULT_STEPS = {"bfloat16": 1900, "float32": 1400}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5forge demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model_dir", default="demo_run", help="where the run is written")
  parser.add_argument("--steps", type=int, default=None,
                      help=f"training steps (default: {DEFAULT_STEPS['bfloat16']} where the "
                      f"CPU has bf16 instructions, else {DEFAULT_STEPS['float32']})")
  parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                      help="matmul precision (auto: bfloat16 where the CPU has bf16 "
                      "instructions, else float32)")
  parser.add_argument("--eval_period", type=int, default=None,
                      help="steps between held-out loss reports (default: the gin's EVAL_PERIOD)")
  parser.add_argument("--eval_examples", type=int, default=None,
                      help="evaluate on the first N verses of John (default: all 879)")
  parser.add_argument("--show", type=int, default=5, help="translations to print")
  parser.add_argument("--fresh", action="store_true", help="delete --model_dir first")
  args = parser.parse_args(argv)
  model_dir = os.path.abspath(args.model_dir)
  if args.fresh:
    shutil.rmtree(model_dir, ignore_errors=True)

  # The demo gin sets no dtype: --dtype or the machine's default, bound explicitly so that
  # config.gin has it.
  choice = precision.for_machine(None if args.dtype == "auto" else args.dtype,
                                 flag="--dtype {}")
  steps = args.steps or DEFAULT_STEPS[choice.dtype]
  print(f"t5forge demo: English -> Spanish on the bundled Bible task ({steps} steps, "
        f"model dir {model_dir})", flush=True)
  print(host_memory.describe(), flush=True)
  print(choice.line, flush=True)
  if choice.note:
    print(choice.note, file=sys.stderr, flush=True)
  started = time.time()
  bindings = [f'MODEL_DIR="{model_dir}"', f"TRAIN_STEPS={steps}",
              f"network.ModelConfig.dtype='{choice.dtype}'"]
  if args.eval_period:
    bindings.append(f"EVAL_PERIOD={args.eval_period}")
  gin_flags.parse([EXAMPLE_GIN], bindings)
  import gin  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.train import loop  # noqa: PLC0415 (after the flags parse: --help stays fast)
  result = gin_flags.call(loop.train, operative_config=gin.config_str(),
                          show_progress=sys.stderr.isatty())
  trained = time.time() - started

  from t5forge import evaluate  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.train.settings import DatasetConfig, RestoreCheckpointConfig  # noqa: PLC0415 (after the flags parse: --help stays fast)
  t_eval = time.time()
  out_dir = os.path.join(model_dir, "inference_eval")
  metrics = evaluate.evaluate(
      dataset_cfg=DatasetConfig(TASK, None, split="validation", batch_size=64, shuffle=False,
                                pack=False),
      restore_checkpoint_cfg=RestoreCheckpointConfig(path=model_dir, mode="latest"),
      output_dir=out_dir, num_examples=args.eval_examples)
  evaluated = time.time() - t_eval
  step = result.step
  scores = metrics.get(step) or _last_metrics(out_dir)

  predictions = os.path.join(out_dir, f"{TASK}-{step}.jsonl")
  print("\n" + "=" * 78)
  print(f"Trained {step} steps in {trained / 60:.1f} min, evaluated in {evaluated / 60:.1f} min "
        f"(total {(time.time() - started) / 60:.1f} min).")
  if result.train_metrics:
    print(f"Final training loss per target token: "
          f"{result.train_metrics.get('loss_per_nonpadding_target_token', float('nan')):.3f}")
  bleu = scores.get(f"inference_eval/{TASK}/bleu", scores.get("bleu"))
  chrf = scores.get(f"inference_eval/{TASK}/chrf", scores.get("chrf"))
  print(f"Held-out Gospel of John: BLEU {bleu:.2f}, chrF {chrf:.2f} (sacrebleu, greedy decoding)")
  if os.path.isfile(predictions):
    print("\nTranslations (English / reference / model):")
    with open(predictions, encoding="utf-8") as f:
      rows = [json.loads(line) for _, line in zip(range(args.show), f)]
    for row in rows:
      src = row["inputs"].get("inputs_pretokenized", "").replace(
          "translate English to Spanish: ", "")
      for label, text in (("EN ", src), ("REF", row["target"]), ("OUT", row["prediction"])):
        print(textwrap.fill(text, width=100, initial_indent=f"  {label} ",
                            subsequent_indent="      "))
      print()
  print("Where things are:")
  print(f"  checkpoints:   {model_dir}/checkpoint_<step>/ (rerun `make demo` to resume)")
  print(f"  predictions:   {predictions}")
  print(f"  metrics:       {out_dir}/{TASK}-metrics.jsonl, {model_dir}/metrics.jsonl")
  print(f"  TensorBoard:   tensorboard --logdir {model_dir}")
  print(f"  run config:    {model_dir}/config.gin, {model_dir}/model-info.txt")
  print("Next: .venv/bin/python -m t5forge infer --checkpoint "
        f"{model_dir} --input my_verses.txt --output_dir /tmp/out")
  return 0


def _last_metrics(out_dir: str) -> dict:
  path = os.path.join(out_dir, f"{TASK}-metrics.jsonl")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f if line.strip()]
  return lines[-1] if lines else {}
