"""`t5forge convert --input PATH --output DIR --to {t5forge,hf}`.

Reads any checkpoint t5forge understands (HF directory, T5X or Mesh TF checkpoint, t5forge
checkpoint or MODEL_DIR) and writes it as a t5forge checkpoint or an HF directory, with
the vocabulary stored in the input (an HF directory gets the tokenizer files that
transformers' AutoTokenizer loads).

LoRA adapters: `t5forge convert --adapter DIR --base BASE --to {peft,t5forge} --output OUT`
rewrites an adapter (either format) as Hugging Face peft's or ours; with `--merge`
(`--to t5forge` or `--to hf`) it writes BASE with the adapter merged into its kernels.

--output may be a `gs://` or `s3://` URL: the directory is written locally and uploaded,
the file a reader takes as the mark of a complete copy last (t5forge's manifest, an HF
directory's config.json, an adapter's config).
"""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from t5forge.errors import UserError


@contextlib.contextmanager
def staged_output(output: str) -> Iterator[str]:
  """Where a writer puts `output`: `output` itself when local; for a bucket URL a local
  directory uploaded at the end, each format's commit file after the rest."""
  from t5forge import files, storage  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if not storage.is_remote(output):
    yield output
    return
  from t5forge.convert import manifest  # noqa: PLC0415 (as above)
  from t5forge.convert.hf.config_files import CONFIG_FILE  # noqa: PLC0415 (as above)
  from t5forge.nn import adapters, prompt  # noqa: PLC0415 (as above)
  last = (prompt.PEFT_CONFIG, adapters.CONFIG_FILE, CONFIG_FILE, manifest.MANIFEST)
  with files.staged_dir(output, last=last) as tmp:
    yield tmp


def check_output(output: str) -> None:
  """Before anything slow: an unknown scheme, a missing bucket, absent credentials or
  client package, or a prefix that already holds files, are one line naming `output`."""
  from t5forge import storage  # noqa: PLC0415 (after the flags parse: --help stays fast)
  if storage.is_remote(output):
    storage.check_new_output(output)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5forge convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", help="checkpoint to read (any format)")
  parser.add_argument("--output", required=True, help="directory to create")
  parser.add_argument("--to", required=True, choices=["t5forge", "hf", "peft"],
                      help="output format (peft: a LoRA adapter, with --adapter)")
  parser.add_argument("--adapter", help="a LoRA adapter directory (t5forge's or peft's) to "
                      "convert, or with --merge to merge into --base")
  parser.add_argument("--base", help="with --adapter: the checkpoint the adapter applies to")
  parser.add_argument("--merge", action="store_true",
                      help="with --adapter: write --base with the adapter merged (--to t5forge "
                      "or hf)")
  args = parser.parse_args(argv)
  check_output(args.output)
  if args.adapter or args.base or args.merge or args.to == "peft":
    from t5forge.convert import peft  # noqa: PLC0415 (after the flags parse: --help stays fast)
    with staged_output(args.output) as out:
      lines = peft.convert_adapter(args.adapter, args.base, out, to=args.to,
                                   merge=args.merge, input_given=args.input)
    for line in lines:
      print(line.replace(out, args.output) if out != args.output else line)
    return 0
  if not args.input:
    raise UserError("--input is required: the checkpoint to convert (or --adapter DIR --base "
                    "BASE for a LoRA adapter)")

  from t5forge.convert import hf, load_checkpoint, native, of_checkpoint, relayout  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.data import vocab_io  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.nn import count_params  # noqa: PLC0415 (after the flags parse: --help stays fast)
  ckpt = load_checkpoint(args.input)
  print(f"read {ckpt.format} checkpoint {ckpt.path}: {count_params(ckpt.params):,} parameters, "
        f"{ckpt.config.architecture}, emb_dim={ckpt.config.emb_dim}")
  if ckpt.format == "t5x" and ckpt.extras.get("param_states"):
    import jax  # noqa: PLC0415 (after the flags parse: --help stays fast)
    n = len(jax.tree.leaves(ckpt.extras["param_states"]))
    print(f"note: not converted: T5X optimizer state ({n} arrays) and step {ckpt.step}; "
          "the parameters are complete")
  if ckpt.format == "mtf":
    print(f"note: not converted: Mesh TF Adafactor slots ({ckpt.extras['slots']} arrays) "
          f"and global_step {ckpt.step}; the parameters are complete")
  vocab = of_checkpoint(ckpt)
  if args.to == "hf":
    if ckpt.config.scan_layers:
      ckpt.params = relayout(ckpt.params, scanned=True, to_scanned=False)
      ckpt.config = ckpt.config.replace(scan_layers=False)
    with staged_output(args.output) as out:
      notes = hf.save_hf(ckpt.params, ckpt.config, out, vocabulary=vocab,
                         tokenizer_dir=ckpt.path if ckpt.format == "hf" else None)
  elif args.to == "t5forge":
    with staged_output(args.output) as out:
      native.save(out, ckpt.config, ckpt.params,
                  extra_config={"vocabulary": vocab_io.to_spec(vocab)})
    notes = [] if vocab is not None else [
        "no vocabulary written: the input stores none; `t5forge infer` will need --vocabulary"]
  else:  # argparse already restricts the choices
    raise UserError(f"--to {args.to!r}: choose t5forge or hf")
  for note in notes:
    print(f"note: {note}")
  print(f"wrote {args.to} checkpoint to {args.output}"
        + (f" with its vocabulary ({vocab_io.describe(vocab)})" if vocab is not None else ""))
  return 0
