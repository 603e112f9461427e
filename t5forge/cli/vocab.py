"""`t5forge vocab train|info`: train a SentencePiece vocabulary with T5's layout, or inspect one.

  python -m t5forge vocab train --input 'data/*.tsv.gz' --vocab_size 8000 --extra_ids 100 \\
      --output my_vocab
  python -m t5forge vocab info my_vocab.model --extra_ids 100
"""
from __future__ import annotations

import argparse
import time

from t5forge.data import vocab
from t5forge.errors import UserError


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="t5forge vocab", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="action", required=True)

  train = sub.add_parser("train", help="train a SentencePiece model (pad 0, eos 1, unk 2, no bos)")
  train.add_argument("--input", required=True, nargs="+",
                     help="text files or globs: .txt (a sentence a line), .tsv (every column), "
                          "optionally .gz")
  train.add_argument("--vocab_size", required=True, type=int,
                     help="full vocabulary size including --extra_ids (the model gets "
                          "vocab_size - extra_ids pieces)")
  train.add_argument("--extra_ids", type=int, default=100,
                     help="sentinel ids reserved at the top (T5: 100)")
  train.add_argument("--output", required=True, help="output prefix: writes PREFIX.model")
  train.add_argument("--model_type", default="unigram", choices=("unigram", "bpe", "char", "word"))
  train.add_argument("--character_coverage", type=float, default=0.9995)
  train.add_argument("--require_ascii", action="store_true",
                     help="always include every printable ASCII character (keeps code "
                          "representable)")

  info = sub.add_parser("info", help="print size, special ids and an encode/decode example")
  info.add_argument("path", help="a .model file")
  info.add_argument("--extra_ids", type=int, default=100)
  info.add_argument("--text", help="example text to encode and decode",
                    default="translate English to Spanish: In the beginning was the Word.")
  return parser


def _train(args) -> None:
  if args.vocab_size <= 0 or args.extra_ids < 0:
    raise UserError("--vocab_size must be > 0 and --extra_ids >= 0")
  start = time.time()
  sentences, files = vocab.read_training_text(args.input)
  path = vocab.train_sentencepiece(
      sentences, vocab_size=args.vocab_size, extra_ids=args.extra_ids, output_prefix=args.output,
      model_type=args.model_type, character_coverage=args.character_coverage,
      required_chars=vocab.ASCII_CHARS if args.require_ascii else "")
  v = vocab.SentencePieceVocabulary(path, extra_ids=args.extra_ids)
  print(f"wrote {path}: {v.vocab_size} ids ({v.base_vocab_size} pieces + {v.extra_ids} extra ids) "
        f"from {len(sentences)} sentences in {len(files)} file(s), {time.time() - start:.1f}s")


def _info(args) -> None:
  v = vocab.SentencePieceVocabulary(args.path, extra_ids=args.extra_ids)
  p = v.processor
  print(f"model:      {args.path}")
  print(f"vocab_size: {v.vocab_size} ({v.base_vocab_size} pieces + {v.extra_ids} extra ids)")
  specials = [f"{name}={i} {p.id_to_piece(i)!r}"
              for name, i in (("pad", v.pad_id), ("eos", v.eos_id), ("unk", v.unk_id))]
  print(f"special:    {'  '.join(specials)}  bos={p.bos_id()}")
  if v.extra_ids:
    print(f"sentinels:  <extra_id_0>={v.sentinel_id(0)}  <extra_id_{v.extra_ids - 1}>="
          f"{v.sentinel_id(v.extra_ids - 1)}")
  ids = v.encode(args.text)
  print(f"encode:     {args.text!r}")
  print(f"  ids:      {ids}")
  print(f"  pieces:   {[p.id_to_piece(i) for i in ids]}")
  print(f"decode:     {v.decode(ids + [v.eos_id, 7, 7])!r}  (stops at eos)")


def main(argv: list[str]) -> int | None:
  args = _parser().parse_args(argv)
  if args.action == "train":
    _train(args)
  else:
    _info(args)
  return 0
