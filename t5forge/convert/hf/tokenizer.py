"""The tokenizer files of Hugging Face directories, read into our vocabularies and written
from them, in the two kinds the families use.

T5 (T5, Flan-T5, mT5, ByT5): `spiece.model` with the tokenizer's extra ids (100 unless
tokenizer_config.json says otherwise), or ByT5's bytes (125 extra ids); written as
`spiece.model` + `tokenizer.json` + `tokenizer_config.json` + `special_tokens_map.json`,
which transformers' `AutoTokenizer` loads.

Gemma (T5Gemma, T5Gemma 2): `tokenizer.model` (Gemma's SentencePiece model: pad 0, eos 1,
bos 2, unk 3), else `tokenizer.json` through the `tokenizers` library, of config.json's
vocab_size.
"""
from __future__ import annotations

import base64
import os
import shutil

from t5forge import files
from t5forge.convert.hf.config_files import read_json
from t5forge.data.vocab import (ByteVocabulary, SentencePieceVocabulary, TokenizersVocabulary,
                                Vocabulary)
from t5forge.data.vocab_io import describe
from t5forge.errors import UserError

T5_FILES = ("spiece.model", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "added_tokens.json")
GEMMA_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json")
_NO_VOCABULARY = ("no tokenizer written: the checkpoint stores no vocabulary (load it with "
                  "t5forge.load(path, vocabulary=...) and save_hf from there)")


def _read_optional(path: str) -> dict:
  return read_json(path, default={})


def copy_files(src_dir: str | None, names: tuple[str, ...], out_dir: str) -> bool:
  """Copies those of the files `names` that `src_dir` holds into `out_dir`, byte for byte.

  Returns:
    Whether there was any to copy.
  """
  present = [os.path.join(src_dir, n) for n in names
             if src_dir and os.path.isfile(os.path.join(src_dir, n))]
  for src in present:
    shutil.copy(src, os.path.join(out_dir, os.path.basename(src)))
  return bool(present)


# ---------------------------------------------------------------------------------------
# T5

def read_t5(path: str, hf_config: dict) -> Vocabulary | None:
  """The vocabulary of a T5 directory (see the module doc); None when it has no tokenizer.
  `hf_config` is unused: T5's tokenizer files say all."""
  del hf_config
  tok_cfg = _read_optional(os.path.join(path, "tokenizer_config.json"))
  spm_path = os.path.join(path, "spiece.model")
  if os.path.isfile(spm_path):
    return SentencePieceVocabulary(spm_path, extra_ids=int(tok_cfg.get("extra_ids", 100)))
  if "ByT5" in str(tok_cfg.get("tokenizer_class", "")):
    return ByteVocabulary(extra_ids=int(tok_cfg.get("extra_ids", 125)))
  return None


def write_t5(vocab: Vocabulary | None, out_dir: str) -> list[str]:
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
    files.write_json(os.path.join(out_dir, name), obj)

  if vocab is None:
    return [_NO_VOCABULARY]
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
  # Lazy: the protobuf module costs ~80 ms, needed only when a tokenizer is written.
  from sentencepiece import sentencepiece_model_pb2 as model_pb2  # noqa: PLC0415 (slow or optional import, on first use)
  with open(vocab.local_path, "rb") as f:
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
  files.write_bytes(os.path.join(out_dir, "spiece.model"), blob)
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


# ---------------------------------------------------------------------------------------
# Gemma

def _token_name(value) -> str | None:
  """'<eos>' from "<eos>" or from {"content": "<eos>", ...} (an AddedToken)."""
  return value.get("content") if isinstance(value, dict) else value


def read_gemma(path: str, hf_config: dict) -> Vocabulary | None:
  """A Gemma-family directory's tokenizer.model (SentencePiece), else its tokenizer.json
  (`tokenizers`), checked against config.json's vocab_size; None when it has neither and
  no tokenizer config either; a UserError naming the files when only that is there."""
  want = hf_config.get("vocab_size") or (hf_config.get("decoder") or {}).get("vocab_size")
  spm_path, json_path = os.path.join(path, "tokenizer.model"), os.path.join(path, "tokenizer.json")
  if os.path.isfile(spm_path):
    vocab, used = SentencePieceVocabulary(spm_path), spm_path
  elif os.path.isfile(json_path):
    special = {**_read_optional(os.path.join(path, "special_tokens_map.json")),
               **_read_optional(os.path.join(path, "tokenizer_config.json"))}
    # Lazy: `tokenizers` is an optional dependency, needed only for a tokenizer.json.
    from tokenizers import Tokenizer  # noqa: PLC0415 (slow or optional import, on first use)
    try:
      tok = Tokenizer.from_file(json_path)
    except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception type)
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


def write_gemma(vocabulary: Vocabulary | None, out_dir: str) -> list[str]:
  """The tokenizer files of a Gemma-family directory for `vocabulary`: `tokenizer.model`
  for a SentencePiece vocabulary, `tokenizer.json` for a `tokenizers` one, with Gemma's
  tokenizer_config.json / special_tokens_map.json.

  Returns:
    Notes for the user, e.g. that no tokenizer could be written.
  """
  if vocabulary is None:
    return [_NO_VOCABULARY]
  if isinstance(vocabulary, SentencePieceVocabulary) and not vocabulary.extra_ids:
    shutil.copy(vocabulary.local_path, os.path.join(out_dir, "tokenizer.model"))
    piece = vocabulary.processor.id_to_piece
  elif isinstance(vocabulary, TokenizersVocabulary):
    shutil.copy(vocabulary.local_path, os.path.join(out_dir, "tokenizer.json"))
    piece = vocabulary.tokenizer.id_to_token
  else:
    return [f"no tokenizer written: a T5Gemma directory holds tokenizer.model or "
            f"tokenizer.json, which {describe(vocabulary)} has not"]
  special = {f"{k}_token": piece(i) for k, i in (
      ("pad", vocabulary.pad_id), ("eos", vocabulary.eos_id), ("bos", vocabulary.bos_id),
      ("unk", vocabulary.unk_id)) if i is not None}
  files.write_json(os.path.join(out_dir, "special_tokens_map.json"), special, sort_keys=True)
  files.write_json(os.path.join(out_dir, "tokenizer_config.json"),
                   {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True,
                    "add_eos_token": False, **special}, sort_keys=True)
  return []
