"""Vocabularies saved with checkpoints, found in Hugging Face directories, written for
transformers, and compared.

A checkpoint stores its vocabulary as a small JSON spec; a SentencePiece model travels
inside it (base64), so a checkpoint decodes text on any machine, without the file it was
trained with. Loading writes the model once into the cache directory
(`<cache dir>/vocab/<name>-<md5>.model`, see `files.cache_root`) and opens it from there.

`difference(a, b)` says whether two vocabularies map text to the same ids, and
`check_task` refuses a task whose vocabulary is not the one a checkpoint was trained with
(token ids of one vocabulary are other words in another: the output is garbage).
`write_hf_tokenizer` writes what transformers' `AutoTokenizer` loads.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re

from t5forge.data import files
from t5forge.data.vocab import (ByteVocabulary, PassThroughVocabulary, SentencePieceVocabulary,
                                TokenizersVocabulary, Vocabulary)
from t5forge.errors import UserError


def to_spec(vocab: Vocabulary | None) -> dict | None:
  """A JSON-able description that `from_spec` turns back into the same vocabulary."""
  if vocab is None:
    return None
  if isinstance(vocab, SentencePieceVocabulary):
    with open(vocab.path, "rb") as f:
      blob = f.read()
    return {"type": "sentencepiece", "extra_ids": vocab.extra_ids, "name": _label(vocab),
            "model_base64": base64.b64encode(blob).decode("ascii")}
  if isinstance(vocab, ByteVocabulary):
    return {"type": "byte", "extra_ids": vocab.extra_ids}
  if isinstance(vocab, TokenizersVocabulary):
    with open(vocab.path, "rb") as f:
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


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: not valid JSON ({e})") from None


def _token_name(value) -> str | None:
  """'<eos>' from "<eos>" or from {"content": "<eos>", ...} (an AddedToken)."""
  return value.get("content") if isinstance(value, dict) else value


def _t5gemma_vocab(path: str, hf_config: dict) -> Vocabulary | None:
  """A T5Gemma directory's tokenizer.model (SentencePiece), else its tokenizer.json
  (`tokenizers`), checked against config.json's vocab_size; None when it has neither and
  no tokenizer config either; a UserError naming the files when only that is there."""
  want = hf_config.get("vocab_size") or (hf_config.get("decoder") or {}).get("vocab_size")
  spm_path, json_path = os.path.join(path, "tokenizer.model"), os.path.join(path, "tokenizer.json")
  if os.path.isfile(spm_path):
    vocab, used = SentencePieceVocabulary(spm_path), spm_path
  elif os.path.isfile(json_path):
    special = {**_read_json(os.path.join(path, "special_tokens_map.json")),
               **_read_json(os.path.join(path, "tokenizer_config.json"))}
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    try:
      tok = Tokenizer.from_file(json_path)
    except Exception as e:  # tokenizers raises its own Exception type
      raise UserError(f"{json_path}: not a tokenizers tokenizer.json ({e})") from None
    ids = {k: tok.token_to_id(_token_name(special.get(f"{k}_token")) or default)
           for k, default in (("eos", "<eos>"), ("bos", "<bos>"), ("pad", "<pad>"))}
    if ids["pad"] not in (None, 0):
      raise UserError(f"{json_path}: pad token has id {ids['pad']}; t5forge pads with id 0")
    vocab = TokenizersVocabulary(json_path, eos_id=1 if ids["eos"] is None else ids["eos"],
                                 bos_id=ids["bos"])
    used = json_path
  elif any(os.path.isfile(os.path.join(path, n))
           for n in ("tokenizer_config.json", "special_tokens_map.json")):
    raise UserError(f"{path}: has tokenizer_config.json but neither tokenizer.model nor "
                    "tokenizer.json; copy one of them from the model's release")
  else:
    return None
  if want is not None and vocab.vocab_size != int(want):
    raise UserError(f"{used}: {vocab.vocab_size} ids, but config.json's vocab_size is {want}; "
                    "use the tokenizer this model was trained with")
  return vocab


def from_hf_dir(path: str) -> Vocabulary | None:
  """The vocabulary of an HF directory. T5: spiece.model (T5, Flan-T5, mT5) with the
  tokenizer's extra ids (100 unless tokenizer_config.json says otherwise), or ByT5's bytes
  (125 extra ids). T5Gemma (config.json's model_type): tokenizer.model, else
  tokenizer.json through the `tokenizers` library, of config.json's vocab_size. None when
  the directory has no tokenizer."""
  hf_config = _read_json(os.path.join(path, "config.json"))
  if hf_config.get("model_type") in ("t5gemma", "t5gemma2"):
    return _t5gemma_vocab(path, hf_config)
  tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
  spm_path = os.path.join(path, "spiece.model")
  if os.path.isfile(spm_path):
    return SentencePieceVocabulary(spm_path, extra_ids=int(tok_cfg.get("extra_ids", 100)))
  if "ByT5" in str(tok_cfg.get("tokenizer_class", "")):
    return ByteVocabulary(extra_ids=int(tok_cfg.get("extra_ids", 125)))
  return None


def of_checkpoint(ckpt) -> Vocabulary | None:
  """The vocabulary stored with a `convert.LoadedCheckpoint` (None: T5X, or HF without a
  tokenizer)."""
  if ckpt.format == "t5forge":
    return from_spec(ckpt.extras.get("vocabulary"))
  if ckpt.format == "hf":
    return from_hf_dir(ckpt.path)
  return None


def from_model_file(path: str, config) -> SentencePieceVocabulary:
  """A SentencePiece .model given on the command line (--vocabulary) for a model of
  `config`: with T5's 100 extra ids (sentinels), or none for T5Gemma, whose Gemma
  tokenizer has no sentinels (its config's vocab_size is the tokenizer's size)."""
  if not os.path.isfile(path):
    raise UserError(f"--vocabulary {path}: no such file; give a SentencePiece .model")
  gemma = str(getattr(config, "architecture", "")).startswith("t5gemma")
  return SentencePieceVocabulary(path, extra_ids=0 if gemma else 100)


def from_checkpoint(path: str) -> Vocabulary | None:
  """The vocabulary of the checkpoint at `path`, without reading its weights.

  For gin: `VOCABULARY = @vocab_io.from_checkpoint()` with
  `vocab_io.from_checkpoint.path = %INITIAL_CHECKPOINT_PATH`.

  Args:
    path: a t5forge checkpoint or MODEL_DIR (its latest checkpoint's spec), an HF
      directory (spiece.model / ByT5's tokenizer_config.json; weights are not needed),
      a Hugging Face Hub name (fetched as `convert.load_checkpoint` does), or a T5X
      checkpoint.

  Returns:
    The vocabulary, or None where the checkpoint stores none.
  """
  from t5forge import convert  # pylint: disable=import-outside-toplevel
  from t5forge.convert import native  # pylint: disable=import-outside-toplevel
  if not path:
    raise UserError("vocab_io.from_checkpoint: no path; bind vocab_io.from_checkpoint.path "
                    "(e.g. = %INITIAL_CHECKPOINT_PATH)")
  path = convert.local_path(path)
  if os.path.isdir(path):
    ckpt_dir = path if native.is_native_checkpoint(path) else native.latest_checkpoint(path)
    if ckpt_dir is not None:
      return from_spec(native.read_config(ckpt_dir).get("vocabulary"))
    vocab = from_hf_dir(path)
    if vocab is not None:
      return vocab
  convert.detect_format(path)  # not a checkpoint at all: its one-line error
  return None


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
  from sentencepiece import sentencepiece_model_pb2 as model_pb2  # pylint: disable=import-outside-toplevel
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
    if a == b or _sentencepiece_core(a.path) == _sentencepiece_core(b.path):
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


def write_hf_tokenizer(vocab: Vocabulary | None, out_dir: str) -> list[str]:
  """Writes the tokenizer files of `vocab` that transformers' `AutoTokenizer` loads.

  SentencePiece: `spiece.model` (the model itself; transformers appends the extra ids as
  T5's tokenizer always did), `tokenizer.json` (the fast tokenizer transformers would
  build from it: Unigram pieces and scores + `<extra_id_N>` counting down from the top,
  the model's normalization table, Metaspace splitting, EOS appended),
  `tokenizer_config.json` and `special_tokens_map.json` (as Google's T5 releases have
  them). Byte: ByT5's `tokenizer_config.json`, its extra ids listed from the top id down so
  that `<extra_id_0>` is the last id, as here and in T5X.

  Returns:
    Notes for the user (what could not be written, where transformers may differ).
  """
  def dump(name, obj):
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=2, ensure_ascii=False)

  if vocab is None:
    return ["no tokenizer written: the checkpoint stores no vocabulary (load it with "
            "t5forge.load(path, vocabulary=...) and save_hf from there)"]
  extras = [f"<extra_id_{i}>" for i in range(vocab.extra_ids)]
  special = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
  if isinstance(vocab, ByteVocabulary):
    dump("tokenizer_config.json", {"tokenizer_class": "ByT5Tokenizer", **special,
                                   "extra_ids": vocab.extra_ids,
                                   "additional_special_tokens": extras[::-1]})
    dump("special_tokens_map.json", {**special, "additional_special_tokens": extras[::-1]})
    return []
  if not isinstance(vocab, SentencePieceVocabulary):
    return [f"no tokenizer written: transformers has no tokenizer for {describe(vocab)}"]
  from sentencepiece import sentencepiece_model_pb2 as model_pb2  # pylint: disable=import-outside-toplevel
  with open(vocab.path, "rb") as f:
    blob = f.read()
  proto = model_pb2.ModelProto()
  proto.ParseFromString(blob)
  kinds = model_pb2.ModelProto.SentencePiece
  pieces = [(p.piece, p.score) for p in proto.pieces] + [(t, 0.0) for t in reversed(extras)]
  special = {"eos_token": pieces[vocab.eos_id][0], "unk_token": pieces[vocab.unk_id][0],
             "pad_token": pieces[vocab.pad_id][0]}

  def added(i, content, is_special):
    return {"id": i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": is_special}

  charsmap = proto.normalizer_spec.precompiled_charsmap
  metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
               "split": True}
  eos = special["eos_token"]
  tokenizer = {
      "version": "1.0", "truncation": None, "padding": None,
      "added_tokens": [added(i, p.piece, p.type != kinds.USER_DEFINED)
                       for i, p in enumerate(proto.pieces)
                       if p.type in (kinds.UNKNOWN, kinds.CONTROL, kinds.USER_DEFINED)]
                      + [added(len(pieces) - 1 - i, t, True) for i, t in enumerate(extras)][::-1],
      "normalizer": ({"type": "Precompiled",
                      "precompiled_charsmap": base64.b64encode(charsmap).decode("ascii")}
                     if charsmap else None),
      "pre_tokenizer": {"type": "Sequence",
                        "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]},
      "post_processor": {
          "type": "TemplateProcessing",
          "single": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": eos, "type_id": 0}}],
          "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": eos, "type_id": 0}},
                   {"Sequence": {"id": "B", "type_id": 0}},
                   {"SpecialToken": {"id": eos, "type_id": 0}}],
          "special_tokens": {eos: {"id": eos, "ids": [vocab.eos_id], "tokens": [eos]}}},
      "decoder": metaspace,
      "model": {"type": "Unigram", "unk_id": vocab.unk_id,
                "vocab": [[p, s] for p, s in pieces], "byte_fallback": False},
  }
  with open(os.path.join(out_dir, "spiece.model"), "wb") as f:
    f.write(blob)
  dump("tokenizer.json", tokenizer)
  # No model_max_length: T5's relative positions have no limit, and a number here makes
  # transformers warn about (and, with truncation=True, cut) longer inputs.
  dump("tokenizer_config.json", {"tokenizer_class": "T5Tokenizer", **special,
                                 "extra_ids": vocab.extra_ids,
                                 "additional_special_tokens": extras})
  dump("special_tokens_map.json", {**special, "additional_special_tokens": extras})
  spec = proto.normalizer_spec
  if (proto.trainer_spec.model_type != model_pb2.TrainerSpec.UNIGRAM
      or not spec.add_dummy_prefix or not spec.remove_extra_whitespaces):
    return [f"{describe(vocab)} is not a unigram model with SentencePiece's default "
            "whitespace handling; transformers' T5 tokenizer assumes one, so its ids may "
            "differ from t5forge's for some text"]
  return []
