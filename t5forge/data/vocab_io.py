"""Vocabularies saved with checkpoints, described and compared.

A checkpoint stores its vocabulary as a small JSON spec; a SentencePiece model travels
inside it (base64), so a checkpoint decodes text on any machine, without the file it was
trained with. Loading writes the model once into the cache directory
(`<cache dir>/vocab/<name>-<md5>.model`, see `files.cache_root`) and opens it from there.

`difference(a, b)` says whether two vocabularies map text to the same ids, and
`check_task` refuses a task whose vocabulary is not the one a checkpoint was trained with
(token ids of one vocabulary are other words in another: the output is garbage).

Reading the vocabulary of a checkpoint on disk (a t5forge, Hugging Face or T5X one) needs
the checkpoint formats, a layer above this one: the `convert` package's `from_checkpoint`.
That package installs it as `from_checkpoint` here when imported (every command that reads
gin files imports it first), so that gin files keep naming it `vocab_io.from_checkpoint`.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
from typing import Callable

from t5forge import storage
from t5forge.data import files
from t5forge.data.vocab import (ByteVocabulary, PassThroughVocabulary, SentencePieceVocabulary,
                                TokenizersVocabulary, Vocabulary)
from t5forge.errors import UserError

# What `from_checkpoint` calls; set by the convert layer (see the module doc).
_checkpoint_reader: Callable[[str], Vocabulary | None] | None = None


def to_spec(vocab: Vocabulary | None) -> dict | None:
  """A JSON-able description that `from_spec` turns back into the same vocabulary."""
  if vocab is None:
    return None
  if isinstance(vocab, SentencePieceVocabulary):
    with open(vocab.local_path, "rb") as f:
      blob = f.read()
    return {"type": "sentencepiece", "extra_ids": vocab.extra_ids, "name": _label(vocab),
            "model_base64": base64.b64encode(blob).decode("ascii")}
  if isinstance(vocab, ByteVocabulary):
    return {"type": "byte", "extra_ids": vocab.extra_ids}
  if isinstance(vocab, TokenizersVocabulary):
    with open(vocab.local_path, "rb") as f:
      blob = f.read()
    return {"type": "tokenizers", "eos_id": vocab.eos_id, "bos_id": vocab.bos_id,
            "name": _label(vocab), "json_base64": base64.b64encode(blob).decode("ascii")}
  if isinstance(vocab, PassThroughVocabulary):
    return {"type": "passthrough", **vocab.__getstate__()}
  raise UserError(f"cannot save vocabulary {vocab!r} with a checkpoint; use a "
                  "SentencePieceVocabulary or ByteVocabulary")


def from_spec(spec: dict | None) -> Vocabulary | None:
  if not spec:
    return None
  kind = spec.get("type")
  if kind in ("sentencepiece", "tokenizers"):
    blob = base64.b64decode(spec["model_base64" if kind == "sentencepiece" else "json_base64"])
    # The name (e.g. bible_en_es_8k) is kept in the file name for the messages of `describe`.
    name = re.sub(r"[^\w.-]", "_", str(spec.get("name") or "").replace("/", "--"))[:64]
    digest = hashlib.md5(blob).hexdigest()
    ext = ".model" if kind == "sentencepiece" else ".json"
    path = os.path.join(files.cache_root(), "vocab", f"{name}-{digest}{ext}" if name else
                        f"{digest}{ext}")
    if not os.path.isfile(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
      files.atomic_write_bytes(path, blob)
    if kind == "tokenizers":
      return TokenizersVocabulary(path, eos_id=int(spec.get("eos_id", 1)),
                                  bos_id=spec.get("bos_id"))
    return SentencePieceVocabulary(path, extra_ids=int(spec.get("extra_ids", 0)))
  if kind == "byte":
    return ByteVocabulary(extra_ids=int(spec.get("extra_ids", 0)))
  if kind == "passthrough":
    return PassThroughVocabulary(spec["size"], spec.get("eos_id"), spec.get("extra_ids", 0))
  raise UserError(f"unknown vocabulary type {kind!r} in checkpoint config")


def from_model_file(path: str, config) -> SentencePieceVocabulary:
  """A SentencePiece .model given on the command line (--vocabulary) for a model of
  `config`: with T5's 100 extra ids (sentinels), or none for T5Gemma, whose Gemma
  tokenizer has no sentinels (its config's vocab_size is the tokenizer's size)."""
  if not storage.isfile(path):
    raise UserError(f"--vocabulary {path}: no such file; give a SentencePiece .model")
  gemma = str(getattr(config, "architecture", "")).startswith("t5gemma")
  return SentencePieceVocabulary(path, extra_ids=0 if gemma else 100)


def set_checkpoint_reader(reader: Callable[[str], Vocabulary | None]) -> None:
  """Installs what `from_checkpoint` calls (the convert layer's `from_checkpoint`)."""
  global _checkpoint_reader
  _checkpoint_reader = reader


def from_checkpoint(path: str) -> Vocabulary | None:
  """The vocabulary of the checkpoint at `path`: the gin name of `convert.from_checkpoint`
  (see there), e.g. `VOCABULARY = @vocab_io.from_checkpoint()` with
  `vocab_io.from_checkpoint.path = %INITIAL_CHECKPOINT_PATH`."""
  if _checkpoint_reader is None:
    raise UserError("vocab_io.from_checkpoint needs the checkpoint readers, which are not "
                    "loaded: import t5forge's convert package first, or call its "
                    "from_checkpoint")
  return _checkpoint_reader(path)


def _label(vocab: SentencePieceVocabulary | TokenizersVocabulary) -> str:
  """A short name for messages: the file's stem, `org/name` for a Hub download."""
  stem = os.path.splitext(os.path.basename(vocab.path))[0]
  # A cached copy (from_spec): <name with / as -->-<md5>.
  stem = re.sub(r"^(?:(.+)-)?[0-9a-f]{32}$", r"\1", stem).replace("--", "/")
  if stem in ("spiece", "tokenizer", ""):
    parts = os.path.abspath(vocab.path).split(os.sep)
    hub = [p for p in parts if p.startswith("models--")]
    where = hub[-1][len("models--"):].replace("--", "/") if hub else parts[-2]
    stem = f"{where}/{stem}" if stem else where
  return stem


def describe(vocab: Vocabulary | None) -> str:
  """A few words naming a vocabulary, e.g. 'sentencepiece 8000 ids (bible_en_es_8k)'."""
  if vocab is None:
    return "no vocabulary"
  if isinstance(vocab, SentencePieceVocabulary):
    return f"sentencepiece {vocab.vocab_size} ids ({_label(vocab)})"
  if isinstance(vocab, ByteVocabulary):
    return f"byte {vocab.vocab_size} ids ({vocab.extra_ids} extra)"
  if isinstance(vocab, PassThroughVocabulary):
    return f"passthrough {vocab.vocab_size} ids"
  if isinstance(vocab, TokenizersVocabulary):
    return f"tokenizers {vocab.vocab_size} ids ({_label(vocab)})"
  return f"{type(vocab).__name__} {vocab.vocab_size} ids"


def _sentencepiece_core(path: str) -> bytes:
  """What decides a SentencePiece model's ids and text: the pieces and the normalizer;
  not the trainer's record of its input files."""
  from sentencepiece import sentencepiece_model_pb2 as model_pb2  # noqa: PLC0415 (slow or optional import, on first use)
  proto = model_pb2.ModelProto()
  with open(path, "rb") as f:
    proto.ParseFromString(f.read())
  model_type = proto.trainer_spec.model_type
  proto.ClearField("trainer_spec")
  proto.trainer_spec.model_type = model_type
  return proto.SerializeToString(deterministic=True)


def _mismatch(a: Vocabulary | None, b: Vocabulary | None) -> str | None:
  """None when `a` and `b` map text to the same ids; else what `describe` leaves out of the
  difference ('' when the descriptions already differ)."""
  if a is b:
    return None
  if isinstance(a, SentencePieceVocabulary) and isinstance(b, SentencePieceVocabulary):
    if a.extra_ids != b.extra_ids:
      return f"; extra_ids {a.extra_ids} vs {b.extra_ids}"
    if a == b or _sentencepiece_core(a.local_path) == _sentencepiece_core(b.local_path):
      return None
    return "" if describe(a) != describe(b) else ", the same size but other pieces"
  if type(a) is type(b) and a == b:
    return None
  return ""


def difference(a: Vocabulary | None, b: Vocabulary | None) -> str | None:
  """None when `a` and `b` map text to the same ids; else a few words, e.g.
  'sentencepiece 8000 ids (bible_en_es_8k) vs sentencepiece 32100 ids (google/flan-t5-small/spiece)'.

  SentencePiece: the same model (same bytes, or the same pieces, scores and normalizer)
  and the same extra_ids. Byte: the same extra_ids. Different types always differ.
  """
  detail = _mismatch(a, b)
  return None if detail is None else f"{describe(a)} vs {describe(b)}{detail}"


def check_task(item, vocab: Vocabulary | None, *, against: str, fix: str, log=print) -> None:
  """Refuses a task (or mixture) whose vocabulary is not `vocab`, in one line.

  Args:
    item: a Task or Mixture: every output feature of every task is checked.
    vocab: the vocabulary of what the task meets (a checkpoint's, a model's); None:
      nothing to check against, which `log` notes.
    against: names it in the message, e.g. 'checkpoint /runs/a/checkpoint_400'.
    fix: how to fix it, the end of the message.
  """
  tasks = item.tasks if hasattr(item, "tasks") else [item]
  if vocab is None:
    own = [describe(f.vocabulary) for f in tasks[0].output_features.values()]
    log(f"note: {against} stores no vocabulary, so nothing checks that it was trained with "
        f"the vocabulary of task {tasks[0].name!r} ({own[0] if own else 'none'})")
    return
  for task in tasks:
    for feature in task.output_features.values():
      detail = _mismatch(feature.vocabulary, vocab)
      if detail is not None:
        raise UserError(f"task {task.name!r} is tokenized with {describe(feature.vocabulary)}, "
                        f"but {against} uses {describe(vocab)}{detail}: the same ids would be "
                        f"other words. {fix}")
