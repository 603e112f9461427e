"""Vocabularies saved with checkpoints and found in Hugging Face directories.

A checkpoint stores its vocabulary as a small JSON spec; a SentencePiece model travels
inside it (base64), so a checkpoint decodes text on any machine, without the file it was
trained with. Loading writes the model once into the cache directory
(`$T5FORGE_CACHE/vocab/<md5>.model`) and opens it from there.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os

from t5forge.data import files
from t5forge.data.vocab import (ByteVocabulary, PassThroughVocabulary, SentencePieceVocabulary,
                                Vocabulary)
from t5forge.errors import UserError


def to_spec(vocab: Vocabulary | None) -> dict | None:
  """A JSON-able description that `from_spec` turns back into the same vocabulary."""
  if vocab is None:
    return None
  if isinstance(vocab, SentencePieceVocabulary):
    with open(vocab.path, "rb") as f:
      blob = f.read()
    return {"type": "sentencepiece", "extra_ids": vocab.extra_ids,
            "model_base64": base64.b64encode(blob).decode("ascii")}
  if isinstance(vocab, ByteVocabulary):
    return {"type": "byte", "extra_ids": vocab.extra_ids}
  if isinstance(vocab, PassThroughVocabulary):
    return {"type": "passthrough", **vocab.__getstate__()}
  raise UserError(f"cannot save vocabulary {vocab!r} with a checkpoint; use a "
                  "SentencePieceVocabulary or ByteVocabulary")


def from_spec(spec: dict | None) -> Vocabulary | None:
  if not spec:
    return None
  kind = spec.get("type")
  if kind == "sentencepiece":
    blob = base64.b64decode(spec["model_base64"])
    path = os.path.join(files.cache_root(), "vocab", hashlib.md5(blob).hexdigest() + ".model")
    if not os.path.isfile(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
      files.atomic_write_bytes(path, blob)
    return SentencePieceVocabulary(path, extra_ids=int(spec.get("extra_ids", 0)))
  if kind == "byte":
    return ByteVocabulary(extra_ids=int(spec.get("extra_ids", 0)))
  if kind == "passthrough":
    return PassThroughVocabulary(spec["size"], spec.get("eos_id"), spec.get("extra_ids", 0))
  raise UserError(f"unknown vocabulary type {kind!r} in checkpoint config")


def from_hf_dir(path: str) -> Vocabulary | None:
  """The vocabulary of an HF T5 directory: spiece.model (T5, Flan-T5, mT5) with the
  tokenizer's extra ids (100 unless tokenizer_config.json says otherwise), or ByT5's bytes
  (125 extra ids). None when the directory has no tokenizer."""
  cfg_path = os.path.join(path, "tokenizer_config.json")
  tok_cfg = {}
  if os.path.isfile(cfg_path):
    with open(cfg_path, encoding="utf-8") as f:
      tok_cfg = json.load(f)
  spm_path = os.path.join(path, "spiece.model")
  if os.path.isfile(spm_path):
    return SentencePieceVocabulary(spm_path, extra_ids=int(tok_cfg.get("extra_ids", 100)))
  if "ByT5" in str(tok_cfg.get("tokenizer_class", "")):
    return ByteVocabulary(extra_ids=int(tok_cfg.get("extra_ids", 125)))
  return None
