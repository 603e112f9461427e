"""Vocabularies with T5's id layout: pad 0, eos 1, unk 2, sentinels at the top.

Four vocabularies share one interface (`Vocabulary`):

* `SentencePieceVocabulary`: a SentencePiece model file plus `extra_ids` sentinel
  pieces appended at load time, exactly like SeqIO: `<extra_id_0>` is the last id
  (`vocab_size - 1`), `<extra_id_1>` the one before it, and so on. The model file
  itself holds `vocab_size - extra_ids` pieces, as T5's released models do.
* `ByteVocabulary`: ByT5's layout, 3 special ids, then the 256 UTF-8 bytes, then
  the extra ids (`vocab_size = 259 + extra_ids`).
* `TokenizersVocabulary`: a Hugging Face `tokenizer.json` through the `tokenizers`
  library (T5Gemma directories without a SentencePiece model; Gemma's layout pad 0,
  eos 1, bos 2, unk 3).
* `PassThroughVocabulary`: ids in, ids out; for tests.

`decode` follows SeqIO: ids past the base vocabulary become unk, everything after
the first EOS is dropped, and pad/eos decode to nothing.

Vocabularies are picklable and cheap to copy: a SentencePiece vocabulary pickles
as `(path, extra_ids)` and reloads its model lazily (Grain workers need this).

A model file in a bucket (`gs://`, `s3://`) is read through its local copy
(`files.local_file`, one per object version, in the cache dir); `path` stays the URL
(messages, pickles), `local_path` is the file that is read.
"""
from __future__ import annotations

import abc
import functools
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from t5forge import files as t5files
from t5forge import storage
from t5forge.data import files as files_lib
from t5forge.errors import UserError

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2


class Vocabulary(abc.ABC):
  """Maps text to token ids and back. Ids 0..vocab_size-1, pad is always 0."""

  def __init__(self, extra_ids: int = 0):
    if extra_ids < 0:
      raise UserError(f"extra_ids must be >= 0, got {extra_ids}")
    self._extra_ids = int(extra_ids)

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  @abc.abstractmethod
  def eos_id(self) -> int | None:
    """End-of-sequence id, or None if the vocabulary has none."""

  @property
  @abc.abstractmethod
  def unk_id(self) -> int | None:
    """Unknown-token id, or None if the vocabulary has none."""

  @property
  def bos_id(self) -> int | None:
    """Beginning-of-sequence id (T5Gemma's decoder start, 2), or None (T5: none)."""
    return None

  @property
  def extra_ids(self) -> int:
    """Number of sentinel ids reserved at the top of the vocabulary."""
    return self._extra_ids

  @property
  @abc.abstractmethod
  def base_vocab_size(self) -> int:
    """Size without the extra ids (including pad/eos/unk)."""

  @property
  def vocab_size(self) -> int:
    """Size including the extra ids: the model's embedding rows must cover this."""
    return self.base_vocab_size + self.extra_ids

  def sentinel_id(self, i: int) -> int:
    """Id of `<extra_id_i>`: sentinels count down from the top of the vocabulary."""
    if not 0 <= i < self.extra_ids:
      raise UserError(f"sentinel {i} out of range: this vocabulary has {self.extra_ids} extra ids "
                      "(T5 uses extra_ids=100)")
    return self.vocab_size - 1 - i

  @abc.abstractmethod
  def _encode(self, text: str) -> list[int]:
    ...

  @abc.abstractmethod
  def _decode(self, ids: list[int]) -> str:
    ...

  def encode(self, text: str) -> list[int]:
    """Tokenizes `text` to ids, without EOS."""
    return self._encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Detokenizes up to and including the first EOS (SeqIO's rule)."""
    clean = [int(i) for i in (ids.tolist() if isinstance(ids, np.ndarray) else ids)]
    if self.unk_id is not None:
      # Ids the model cannot render (past the base vocabulary, or past the
      # sentinels where those are real pieces) become unk, as in SeqIO.
      limit = self._decodable_limit()
      clean = [self.unk_id if i >= limit else i for i in clean]
    if self.eos_id is not None and self.eos_id in clean:
      clean = clean[:clean.index(self.eos_id) + 1]
    return self._decode(clean)

  def _decodable_limit(self) -> int:
    return self.base_vocab_size

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode_batch(self, ids: Iterable[Iterable[int]]) -> list[str]:
    """Decodes each row of `ids` (e.g. an int array [batch, length])."""
    return [self.decode(row) for row in ids]

  def fingerprint(self) -> str:
    """A short stable string identifying this vocabulary (cache keys)."""
    return f"{type(self).__name__}:{self.extra_ids}"


class SentencePieceVocabulary(Vocabulary):
  """A SentencePiece model with T5's layout; see the module docstring.

  Args:
    path: the `.model` file (pad_id=0, eos_id=1, unk_id=2, no bos, as
      `t5forge vocab train` writes it and as T5's released models are).
    extra_ids: sentinel pieces `<extra_id_0..N-1>` appended in reverse order, so
      `<extra_id_0>` is `vocab_size - 1`. T5 uses 100.
  """

  def __init__(self, path: str | os.PathLike, extra_ids: int = 0):
    super().__init__(extra_ids)
    self._path = os.fspath(path)
    if not storage.isfile(self._path):
      raise UserError(f"SentencePiece model not found: {self._path}; pass the path of a .model "
                      "file (`t5forge vocab train` makes one)")
    self._local = files_lib.local_file(self._path)
    self._processor = None
    self._lock = threading.Lock()

  @property
  def path(self) -> str:
    return self._path

  @property
  def local_path(self) -> str:
    """A local file holding the model: `path`, or its cached copy for a bucket object."""
    return self._local

  def __getstate__(self):
    # Only (path, extra_ids) travel to Grain workers; the processor reloads lazily.
    return {"path": self._path, "extra_ids": self._extra_ids}

  def __setstate__(self, state):
    self.__init__(state["path"], state["extra_ids"])

  def __eq__(self, other):
    if other is self:  # the common case (denoise checks it per example): no file access
      return True
    return (isinstance(other, SentencePieceVocabulary) and self.extra_ids == other.extra_ids
            and self._model_digest() == other._model_digest())

  def __hash__(self):
    return hash((self._model_digest(), self.extra_ids))

  def __repr__(self):
    return f"SentencePieceVocabulary({self._path!r}, extra_ids={self.extra_ids})"

  @property
  def processor(self):
    """The loaded `sentencepiece.SentencePieceProcessor` (with the extra ids)."""
    if self._processor is None:
      with self._lock:
        if self._processor is None:
          self._processor = _load_processor(self._local, self._extra_ids,
                                            _file_stamp(self._local), self._path)
    return self._processor

  def _model_digest(self) -> str:
    return _file_md5(self._local, _file_stamp(self._local))

  def fingerprint(self) -> str:
    return f"spm:{self._model_digest()}:{self.extra_ids}"

  @property
  def eos_id(self) -> int:
    return self.processor.eos_id()

  @property
  def unk_id(self) -> int:
    return self.processor.unk_id()

  @property
  def bos_id(self) -> int | None:
    bos = self.processor.bos_id()  # -1 when the model has none (T5's)
    return bos if bos >= 0 else None

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def base_vocab_size(self) -> int:
    return self.processor.get_piece_size() - self.extra_ids

  def _decodable_limit(self) -> int:
    # The sentinels are real (user-defined) pieces of the loaded model, so they
    # decode to "<extra_id_N>" like the newer SeqIO does.
    return self.vocab_size

  def _encode(self, text: str) -> list[int]:
    return self.processor.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self.processor.encode(list(texts))

  def _decode(self, ids: list[int]) -> str:
    return self.processor.decode(ids)


def _file_stamp(path: str) -> tuple[int, int]:
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _file_md5(path: str, stamp: tuple[int, int]) -> str:
  del stamp  # part of the cache key only: a rewritten file gets a new digest
  with open(path, "rb") as f:
    return hashlib.md5(f.read()).hexdigest()[:16]


_LOAD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=16)
def _load_processor(local: str, extra_ids: int, stamp: tuple[int, int], path: str):
  """Loads the model file `local` and appends the sentinel pieces (cached per file
  version); messages name `path`, what the user gave."""
  del stamp
  import sentencepiece as spm  # noqa: PLC0415 (slow import, on first use)
  from sentencepiece import sentencepiece_model_pb2 as model_pb2  # noqa: PLC0415 (slow import, on first use)

  with open(local, "rb") as f:
    blob = f.read()
  proto = model_pb2.ModelProto()
  try:
    proto.ParseFromString(blob)
  except Exception as e:  # noqa: BLE001 (protobuf raises DecodeError; any failure means the same)
    raise UserError(f"{path}: not a SentencePiece model ({e}); pass a .model file") from None
  if len(proto.pieces) < 3:
    raise UserError(f"{path}: SentencePiece model has only {len(proto.pieces)} pieces")
  # Reverse order so that <extra_id_0> is the very last id, as T5's span
  # corruption expects (first noise span -> vocab_size - 1).
  for i in reversed(range(extra_ids)):
    proto.pieces.add(piece=f"▁<extra_id_{i}>", score=0.0,
                     type=model_pb2.ModelProto.SentencePiece.USER_DEFINED)
  with _LOAD_LOCK:  # LoadFromSerializedProto is not thread-safe (SeqIO saw SIGSEGVs)
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
  if processor.pad_id() != PAD_ID or processor.eos_id() != EOS_ID:
    raise UserError(f"{path}: expected T5's layout pad_id=0 eos_id=1, found "
                    f"pad_id={processor.pad_id()} eos_id={processor.eos_id()}; "
                    "retrain with `t5forge vocab train`")
  return processor


class TokenizersVocabulary(Vocabulary):
  """A Hugging Face `tokenizers` file (`tokenizer.json`), for T5Gemma directories that
  ship no SentencePiece `tokenizer.model`. Ids are the file's, pad must be 0.

  `encode` adds no special tokens (no BOS, no EOS: the preprocessors append EOS, as for
  SentencePiece); `decode` drops special tokens.

  Args:
    path: the tokenizer.json file.
    eos_id: the EOS id (Gemma's and T5's: 1).
    bos_id: the BOS id (Gemma's: 2), or None.
  """

  def __init__(self, path: str | os.PathLike, eos_id: int = EOS_ID, bos_id: int | None = None):
    super().__init__(0)
    self._path = os.fspath(path)
    if not storage.isfile(self._path):
      raise UserError(f"tokenizer.json not found: {self._path}")
    self._local = files_lib.local_file(self._path)
    self._eos, self._bos = int(eos_id), (None if bos_id is None else int(bos_id))
    self._tokenizer = None
    self._lock = threading.Lock()

  @property
  def path(self) -> str:
    return self._path

  @property
  def local_path(self) -> str:
    """A local file holding tokenizer.json: `path`, or its cached copy for a bucket object."""
    return self._local

  def __getstate__(self):
    return {"path": self._path, "eos_id": self._eos, "bos_id": self._bos}

  def __setstate__(self, state):
    self.__init__(state["path"], state["eos_id"], state["bos_id"])

  def __eq__(self, other):
    return (isinstance(other, TokenizersVocabulary) and self._eos == other._eos
            and self._bos == other._bos and self.fingerprint() == other.fingerprint())

  def __hash__(self):
    return hash(self.fingerprint())

  def __repr__(self):
    return f"TokenizersVocabulary({self._path!r}, eos_id={self._eos}, bos_id={self._bos})"

  def fingerprint(self) -> str:
    return f"tok:{_file_md5(self._local, _file_stamp(self._local))}:{self._eos}:{self._bos}"

  @property
  def tokenizer(self):
    """The loaded `tokenizers.Tokenizer`."""
    if self._tokenizer is None:
      with self._lock:
        if self._tokenizer is None:
          from tokenizers import Tokenizer  # noqa: PLC0415 (slow or optional import, on first use)
          try:
            self._tokenizer = Tokenizer.from_file(self._local)
          except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception type)
            raise UserError(f"{self._path}: not a tokenizers tokenizer.json ({e})") from None
    return self._tokenizer

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @functools.cached_property
  def unk_id(self) -> int | None:
    with open(self._local, encoding="utf-8") as f:
      model = json.load(f).get("model") or {}
    if model.get("unk_id") is not None:  # Unigram
      return int(model["unk_id"])
    token = model.get("unk_token")  # BPE, WordPiece
    return self.tokenizer.token_to_id(token) if token else None

  @property
  def base_vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def _encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def _decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)


class ByteVocabulary(Vocabulary):
  """ByT5's byte vocabulary: ids 3..258 are the UTF-8 bytes 0..255."""

  _NUM_SPECIAL = 3
  _NUM_BYTES = 256

  def __init__(self, extra_ids: int = 0):
    super().__init__(extra_ids)

  def __getstate__(self):
    return {"extra_ids": self._extra_ids}

  def __setstate__(self, state):
    self.__init__(state["extra_ids"])

  def __eq__(self, other):
    return isinstance(other, ByteVocabulary) and self.extra_ids == other.extra_ids

  def __hash__(self):
    return hash(("byte", self.extra_ids))

  def __repr__(self):
    return f"ByteVocabulary(extra_ids={self.extra_ids})"

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def unk_id(self) -> int:
    return UNK_ID

  @property
  def base_vocab_size(self) -> int:
    return self._NUM_SPECIAL + self._NUM_BYTES

  def _encode(self, text: str) -> list[int]:
    return [b + self._NUM_SPECIAL for b in text.encode("utf-8")]

  def _decode(self, ids: list[int]) -> str:
    lo, hi = self._NUM_SPECIAL, self._NUM_SPECIAL + self._NUM_BYTES
    data = bytes(i - lo for i in ids if lo <= i < hi)
    # ByT5 drops invalid byte sequences (a model can emit half a character).
    return data.decode("utf-8", errors="ignore")


class PassThroughVocabulary(Vocabulary):
  """Ids pass through unchanged: `encode` takes a list of ints. For tests.

  Args:
    size: the full vocabulary size.
    eos_id: the EOS id (default 1, T5's), or None for no EOS.
  """

  def __init__(self, size: int, eos_id: int | None = EOS_ID, extra_ids: int = 0):
    super().__init__(extra_ids)
    self._size = int(size)
    self._eos = eos_id

  def __getstate__(self):
    return {"size": self._size, "eos_id": self._eos, "extra_ids": self._extra_ids}

  def __setstate__(self, state):
    self.__init__(state["size"], state["eos_id"], state["extra_ids"])

  def __eq__(self, other):
    return isinstance(other, PassThroughVocabulary) and self.__getstate__() == other.__getstate__()

  def __hash__(self):
    return hash(("pass", self._size, self._eos, self._extra_ids))

  def __repr__(self):
    return f"PassThroughVocabulary(size={self._size}, eos_id={self._eos})"

  def fingerprint(self) -> str:
    return f"pass:{self._size}:{self._eos}:{self._extra_ids}"

  @property
  def eos_id(self) -> int | None:
    return self._eos

  @property
  def unk_id(self) -> None:
    return None

  @property
  def base_vocab_size(self) -> int:
    return self._size - self._extra_ids

  def _encode(self, text) -> list[int]:
    return [int(i) for i in text]

  def decode(self, ids: Iterable[int]) -> list[int]:  # type: ignore[override]
    ids = [int(i) for i in (ids.tolist() if isinstance(ids, np.ndarray) else ids)]
    if self._eos is not None and self._eos in ids:
      ids = ids[:ids.index(self._eos) + 1]
    return ids

  def _decode(self, ids: list[int]) -> list[int]:  # type: ignore[override]
    return ids


# ---------------------------------------------------------------------------------------- training

# Printable ASCII without whitespace: forcing these into the character set keeps
# code and markup representable even when the training text (e.g. the Bible)
# never uses `_`, `{` or `|`.
ASCII_CHARS = "".join(chr(c) for c in range(33, 127))


def read_training_text(patterns: Sequence[str]) -> tuple[list[str], list[str]]:
  """Reads the sentences for `train_sentencepiece`.

  Args:
    patterns: files or glob patterns: `.txt` (a sentence a line), `.tsv` (every
      column is a sentence), each optionally gzipped.

  Returns:
    (sentences, files): non-empty lines/cells in file order; the files matched.
  """
  files = files_lib.expand_patterns(patterns)
  sentences = []
  for path in files:
    is_tsv = ".tsv" in os.path.basename(path)
    for _, line in files_lib.iter_lines(path):
      if is_tsv:
        sentences.extend(cell for cell in line.split("\t") if cell.strip())
      elif line.strip():
        sentences.append(line)
  if not sentences:
    raise UserError(f"no text in {', '.join(files)}; `--input` needs non-empty .txt or .tsv files")
  return sentences, files


def train_sentencepiece(sentences: Sequence[str], *, vocab_size: int, extra_ids: int,
                        output_prefix: str, model_type: str = "unigram",
                        character_coverage: float = 0.9995, required_chars: str = "",
                        max_sentence_length: int = 8192) -> str:
  """Trains a SentencePiece model with T5's id layout; writes `<output_prefix>.model`.

  The model holds `vocab_size - extra_ids` pieces, so that the full vocabulary
  with the sentinels (`SentencePieceVocabulary(path, extra_ids)`) has exactly
  `vocab_size` ids. Training is deterministic: sentences are fed in order from
  memory (the model records no file names) on one thread (SentencePiece's
  result depends on the thread count, and one thread is also the fastest on
  small corpora).

  Returns:
    The path of the written model.
  """
  import sentencepiece as spm  # noqa: PLC0415 (slow import, on first use)

  pieces = vocab_size - extra_ids
  if pieces < 4 + len(set(required_chars)):
    raise UserError(f"--vocab_size {vocab_size} leaves {pieces} pieces after {extra_ids} extra "
                    "ids; raise --vocab_size")
  buf = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, vocab_size=pieces,
        model_type=model_type,
        pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
        pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        character_coverage=character_coverage, required_chars=required_chars,
        max_sentence_length=max_sentence_length, num_threads=1, minloglevel=2)
  except RuntimeError as e:
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
    limit = re.search(r"value <= (\d+)", msg)
    if limit:
      most = int(limit.group(1))
      raise UserError(f"--vocab_size {vocab_size} is too large for this input: it supports at "
                      f"most {most + extra_ids} ({most} pieces + {extra_ids} extra ids); "
                      "lower --vocab_size or add text") from None
    raise UserError(f"SentencePiece training failed: {msg}") from None
  path = output_prefix + ".model"
  t5files.write_bytes(path, buf.getvalue())  # readers never see a half-written model
  return path
