"""`t5forge convert --input PATH --output DIR --to {t5forge,hf}`.

Reads any checkpoint t5forge understands (HF directory, T5X checkpoint, t5forge
checkpoint or MODEL_DIR) and writes it as a t5forge checkpoint or an HF directory, with
the vocabulary stored in the input (an HF directory gets the tokenizer files that
transformers' AutoTokenizer loads).
"""
from __future__ import annotations

import argparse

from t5forge.errors import UserError


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5forge convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", required=True, help="checkpoint to read (any format)")
  parser.add_argument("--output", required=True, help="directory to create")
  parser.add_argument("--to", required=True, choices=["t5forge", "hf"], help="output format")
  args = parser.parse_args(argv)

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
  vocab = of_checkpoint(ckpt)
  if args.to == "hf":
    if ckpt.config.scan_layers:
      ckpt.params = relayout(ckpt.params, scanned=True, to_scanned=False)
      ckpt.config = ckpt.config.replace(scan_layers=False)
    notes = hf.save_hf(ckpt.params, ckpt.config, args.output, vocabulary=vocab,
                       tokenizer_dir=ckpt.path if ckpt.format == "hf" else None)
  elif args.to == "t5forge":
    native.save(args.output, ckpt.config, ckpt.params,
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
