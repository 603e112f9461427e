"""`t5forge export --checkpoint PATH --output DIR --format {jax,saved_model,hf}`.

--format jax serializes the whole generate function (encoder + compiled decode loop) with
`jax.export` for each (batch size, input length, decode length), beside the weights
(safetensors), the vocabulary, a manifest, a standalone loader (`load_exported.py`) and the
`requirements.txt` it needs; `t5forge/export/writer.py` describes the directory. Run it with

    cd DIR && pip install -r requirements.txt     # where t5forge is not installed
    python -c "import load_exported as le; print(le.ExportedModel('.').generate(['...']))"

or serve it: `t5forge serve --checkpoint DIR` (greedy and sample requests).

`--methods beam` (either format) also exports T5X's beam search with `--num_beams N` beams
(default 4; compiled in) and a per-call `alpha`, returning the best beam and its score:
`ExportedModel(DIR).generate([...], method="beam", alpha=0.6)`.

--format saved_model (the `t5forge[tf]` extra) converts the same generate functions with
jax2tf into a TensorFlow SavedModel for TF Serving / Vertex AI: one batch-polymorphic
signature per (method, input length, decode length) taking token ids, the vocabulary in
assets/, and TF Serving warm-up requests at each --batch_sizes entry;
`t5forge/export/saved_model.py` describes it. Load it with `tf.saved_model.load(DIR)`, or
with text in and out: `t5forge.export.saved_model.SavedModelRunner(DIR).generate([...], 32)`.

--format hf writes a Hugging Face directory (the same writer as `t5forge convert --to hf`).
"""
from __future__ import annotations

import argparse
import time

from t5forge.errors import UserError

_JAX_DEFAULTS = {"batch_sizes": "1,8", "input_lengths": "64,512", "decode_lengths": "64",
                 "methods": "greedy"}


def _ints(flag: str, text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise UserError(f"--{flag} {text!r}: give comma-separated integers, e.g. "
                    f"--{flag} {_JAX_DEFAULTS[flag]}") from None
  if not values or min(values) < 1:
    raise UserError(f"--{flag} {text!r}: give integers >= 1, e.g. --{flag} {_JAX_DEFAULTS[flag]}")
  return sorted(set(values))


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5forge export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--checkpoint", required=True,
                      help="checkpoint to export (t5forge, MODEL_DIR, HF directory, T5X, Mesh TF)")
  parser.add_argument("--output", required=True, help="directory to create")
  parser.add_argument("--format", required=True, help="jax, saved_model or hf")
  jax_flags = parser.add_argument_group("--format jax and saved_model")
  jax_flags.add_argument("--batch_sizes", help=f"default {_JAX_DEFAULTS['batch_sizes']} (saved_model: "
                         "the batch is symbolic; these are the warm-up requests' batch sizes, "
                         "the shapes TF Serving compiles as it loads the model)")
  jax_flags.add_argument("--input_lengths", help=f"input tokens incl. EOS (decoder-only: incl. "
                         f"BOS); default {_JAX_DEFAULTS['input_lengths']}")
  jax_flags.add_argument("--decode_lengths", help=f"new tokens; default "
                         f"{_JAX_DEFAULTS['decode_lengths']}")
  jax_flags.add_argument("--methods", help="greedy, sample (per-row temperature, top-p, "
                         "seed) and/or beam (per-call alpha; the best beam); default "
                         f"{_JAX_DEFAULTS['methods']}")
  jax_flags.add_argument("--num_beams", help="beam size of --methods beam, fixed "
                         "in the compiled loop (default 4)")
  jax_flags.add_argument("--dtype", help="activation dtype: float32 (default: the "
                         "checkpoint's) or bfloat16")
  jax_flags.add_argument("--platforms", help="jax.export / jax2tf platforms, e.g. cpu,cuda "
                         "(default: this machine's)")
  args = parser.parse_args(argv)

  if args.format == "hf":
    given = [f"--{k}" for k in (*_JAX_DEFAULTS, "dtype", "platforms", "num_beams")
             if getattr(args, k) is not None]
    if given:
      raise UserError(f"{', '.join(given)} apply to --format jax and saved_model only, not hf")
    from t5forge.cli import convert  # noqa: PLC0415 (after the flags parse: --help stays fast)
    return convert.main(["--input", args.checkpoint, "--output", args.output, "--to", "hf"])
  if args.format not in ("jax", "saved_model"):
    raise UserError(f"--format {args.format!r}: choose jax, saved_model or hf")
  for k, v in _JAX_DEFAULTS.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  batch_sizes = _ints("batch_sizes", args.batch_sizes)
  input_lengths = _ints("input_lengths", args.input_lengths)
  decode_lengths = _ints("decode_lengths", args.decode_lengths)
  methods = tuple(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
  platforms = (tuple(p.strip() for p in args.platforms.split(",") if p.strip())
               if args.platforms else None)
  unknown = sorted(set(platforms or ()) - {"cpu", "cuda", "rocm", "tpu"})
  if unknown:
    raise UserError(f"--platforms: unknown platform(s) {unknown}; choose from cpu, cuda, "
                    "rocm, tpu")
  if args.dtype not in (None, "float32", "bfloat16"):
    raise UserError(f"--dtype {args.dtype!r}: choose float32 or bfloat16")

  from t5forge.opener import open_checkpoint  # noqa: PLC0415 (after the flags parse: --help stays fast)
  from t5forge.export import writer as export  # noqa: PLC0415 (after the flags parse: --help stays fast)
  try:
    given_beams = None if args.num_beams is None else int(args.num_beams)
  except ValueError:
    raise UserError(f"--num_beams {args.num_beams!r}: give an integer >= 2, e.g. "
                    "--num_beams 4") from None
  num_beams = export.check_methods(methods, given_beams)
  shown = ", ".join(f"beam with {num_beams} beams" if m == "beam" else m for m in methods)
  export.check_output(args.output)
  if args.format == "saved_model":
    from t5forge.export import saved_model  # noqa: PLC0415 (the [tf] extra, imported on use)
    saved_model.import_tensorflow()  # before the checkpoint is read: fail fast without TF
  start = time.perf_counter()
  opened = open_checkpoint(args.checkpoint,
                           overrides={"dtype": args.dtype} if args.dtype else None)
  ckpt, vocab = opened.checkpoint, opened.vocabulary
  if vocab is None:
    print(f"note: {ckpt.path} stores no vocabulary: the artifact takes and returns token ids")
  if args.format == "saved_model":
    manifest = saved_model.export_saved_model(
        opened.model, opened.params, vocab, args.output, input_lengths=input_lengths,
        decode_lengths=decode_lengths, warmup_batch_sizes=batch_sizes, methods=methods,
        num_beams=num_beams, platforms=platforms, source=opened.identity())
    n = len(manifest["signatures"])
    print(f"wrote a SavedModel with {n} signature{'s' if n != 1 else ''} ({shown}; "
          f"input lengths {input_lengths}, decode lengths {decode_lengths}; symbolic batch; "
          f"default {manifest['default_signature']}), {manifest['warmup']['requests']} warm-up "
          f"requests (batch sizes {batch_sizes}) and "
          f"{manifest['model']['num_parameters']:,} parameters to {args.output} in "
          f"{time.perf_counter() - start:.1f}s")
    return 0
  shapes = [export.Shape(b, i, l) for b in batch_sizes for i in input_lengths
            for l in decode_lengths]
  manifest = export.export_jax(
      opened.model, opened.params, vocab, args.output, shapes=shapes, methods=methods,
      num_beams=num_beams, platforms=platforms, source=opened.identity())
  n = len(manifest["functions"])
  print(f"wrote {n} function{'s' if n != 1 else ''} ({shown}; batch sizes "
        f"{batch_sizes}, input lengths {input_lengths}, decode lengths {decode_lengths}) and "
        f"{manifest['model']['num_parameters']:,} parameters to {args.output} in "
        f"{time.perf_counter() - start:.1f}s")
  return 0
