"""Runs a directory written by `t5forge export --format jax`, without t5forge's networks.

This file imports only jax, numpy, safetensors, sentencepiece and the standard library
(and jax.export deserializes with flatbuffers); the exporter copies it into every artifact
as `load_exported.py` beside a `requirements.txt` pinning those packages, so an artifact
runs where t5forge is not installed:

    pip install -r requirements.txt                    # in the artifact directory
    import load_exported                               # or: from t5forge.export import loader
    m = load_exported.ExportedModel("exported/")       # checks every file's sha256
    m.generate(["translate English to German: Hello"], max_new_tokens=32)   # -> [str]
    m.generate(np.array([[37, 8, 1]]), max_new_tokens=32)                  # -> tokens [b, l]
    m.generate(["..."], method="beam", alpha=0.6)   # if exported with --methods beam

Each call picks the smallest exported shape that fits (batch, input length, decode
length), pads to it, and splits batches larger than the largest exported batch.
`ExportedGenerator` wraps a model with the part of `t5forge.generation.Generator`'s
interface that `t5forge serve` uses (greedy and, if exported, sampling; n = 1). Beam
search (`--methods beam`, `num_beams` in the manifest) returns the best beam only, so it
runs from `ExportedModel`, and `t5forge serve` refuses num_beams over an export.

Shape letters: b batch, i input length, l decode length, n decodes per input.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np

FORMAT = "t5forge-jax-export"
FORMAT_VERSION = 1


class ExportError(ValueError):
  """A one-line problem with an artifact or a request it cannot run."""


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def is_exported_dir(path: str) -> bool:
  """True when `path` is a directory written by `t5forge export --format jax`."""
  try:
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False


class Vocabulary:
  """The artifact's SentencePiece vocabulary, decoding as t5forge does (SeqIO's rule: up to
  and including the first EOS; ids past the model's pieces become unk)."""

  def __init__(self, path: str, entry: dict):
    import sentencepiece  # noqa: PLC0415 (only a SentencePiece vocabulary needs it)
    self.processor = sentencepiece.SentencePieceProcessor(model_file=path)
    self.eos_id = int(entry["eos_id"])
    self.unk_id = int(entry["unk_id"])
    self.pad_id = int(entry.get("pad_id", 0))
    self.extra_ids = int(entry.get("extra_ids", 0))
    self.vocab_size = int(entry["vocab_size"])

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without EOS."""
    return self.processor.encode(text)

  def decode(self, ids) -> str:
    clean = [int(i) for i in np.asarray(ids).reshape(-1).tolist()]
    clean = [self.unk_id if i >= self.vocab_size else i for i in clean]
    if self.eos_id in clean:
      clean = clean[:clean.index(self.eos_id) + 1]
    return self.processor.decode(clean)


def encode_rows(texts, vocabulary: Vocabulary | None, eos_id: int,
                is_encoder_decoder: bool) -> np.ndarray:
  """Texts (or token lists) -> model-ready [b, longest] int32: encoder tokens ending in EOS,
  0-padded (encoder-decoder), or [0 (BOS), prompt..., 0 padding] (decoder-only)."""
  rows = []
  for t in texts:
    if isinstance(t, str):
      if vocabulary is None:
        raise ExportError("this artifact has no vocabulary; pass token ids, not text")
      ids = vocabulary.encode(t)
    else:
      ids = [int(i) for i in t]
    # T5's layouts: the encoder input ends in EOS; a prompt starts at BOS 0, no EOS.
    rows.append(ids + [eos_id] if is_encoder_decoder else [0] + ids)
  arr = np.zeros((len(rows), max((len(r) for r in rows), default=1)), np.int32)
  for i, r in enumerate(rows):
    arr[i, :len(r)] = r
  return arr


def text_ids(row, stop_ids, eos_id: int) -> list[int]:
  """`row` up to its first stop id: EOS kept (the vocabulary's decode ends there), another
  stop id such as <end_of_turn> left out of the text (t5forge.decoding.text_ids' rule)."""
  row = [int(i) for i in np.asarray(row).reshape(-1)]
  for k, i in enumerate(row):
    if i in stop_ids:
      return row[:k + 1] if i == eos_id else row[:k]
  return row


class ExportedModel:
  """An exported artifact: its parameters on the default device and its functions.

  Args:
    path: the directory `t5forge export --format jax` wrote.
    verify: check each file against the manifest's sha256 (ExportError naming the file).

  Attributes:
    manifest: the parsed manifest.json.
    vocabulary: a `Vocabulary`, or None when the artifact has none (token ids only).
    eos_id, pad_id, is_encoder_decoder, methods.
    num_beams: the beam functions' beam size, or None when beam search was not exported.
  """

  def __init__(self, path: str, *, verify: bool = True):
    self.path = os.path.abspath(path)
    manifest_path = os.path.join(self.path, "manifest.json")
    try:
      with open(manifest_path, encoding="utf-8") as f:
        self.manifest = json.load(f)
    except FileNotFoundError:
      raise ExportError(f"{self.path}: no manifest.json; not a directory written by "
                        "`t5forge export --format jax`") from None
    except ValueError as e:
      raise ExportError(f"{manifest_path}: not valid JSON ({e})") from None
    m = self.manifest
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
      raise ExportError(f"{manifest_path}: format {m.get('format')!r} version "
                        f"{m.get('format_version')!r}; this loader reads {FORMAT} version "
                        f"{FORMAT_VERSION}")
    if verify:
      for name, digest in m["sha256"].items():
        file = os.path.join(self.path, name)
        if not os.path.isfile(file):
          raise ExportError(f"{file}: missing (the manifest lists it); re-export the model")
        if sha256_file(file) != digest:
          raise ExportError(f"{file}: sha256 differs from manifest.json (the file was changed "
                            "or damaged after export); re-export the model")
    from safetensors.numpy import load_file  # noqa: PLC0415 (slow or optional import, on first use)
    flat = load_file(os.path.join(self.path, m["parameters"]["file"]))
    self.params = {k: jax.device_put(v) for k, v in flat.items()}
    self.vocabulary = (Vocabulary(os.path.join(self.path, m["vocabulary"]["file"]),
                                  m["vocabulary"]) if m.get("vocabulary") else None)
    self.eos_id = int(m["eos_id"])
    # Ids that end a row; artifacts from before the list have EOS only.
    self.stop_ids = tuple(int(i) for i in m.get("eos_ids", [self.eos_id]))
    self.pad_id = int(m["pad_id"])
    self.is_encoder_decoder = bool(m["model"]["is_encoder_decoder"])
    self.functions = m["functions"]
    self.methods = tuple(sorted({f["method"] for f in self.functions}))
    self.num_beams = m.get("num_beams")
    self._loaded: dict[str, object] = {}

  def __repr__(self) -> str:
    shapes = ", ".join(f"{f['method']} b{f['batch']} i{f['input_length']} l{f['decode_length']}"
                       for f in self.functions)
    return f"ExportedModel({self.path!r}: {shapes})"

  # -- shapes ---------------------------------------------------------------------------
  def _function(self, entry: dict):
    if entry["file"] not in self._loaded:
      with open(os.path.join(self.path, entry["file"]), "rb") as f:
        self._loaded[entry["file"]] = jax.export.deserialize(bytearray(f.read()))
    return self._loaded[entry["file"]]

  def pick(self, method: str, batch: int, input_length: int, decode_length: int) -> dict:
    """The smallest exported function of `method` whose input and decode lengths fit, and
    that has the smallest batch >= `batch` (else the largest batch: the call is split)."""
    own = [f for f in self.functions if f["method"] == method]
    if not own:
      fix = (f"re-export with --methods {method}" if method in ("greedy", "sample", "beam")
             else "an export runs greedy, sample or beam")
      raise ExportError(f"method {method!r} was not exported (this artifact has "
                        f"{', '.join(self.methods)}); {fix}")
    fits = [f for f in own if f["input_length"] >= input_length
            and f["decode_length"] >= decode_length]
    if not fits:
      have = sorted({(f["input_length"], f["decode_length"]) for f in own})
      raise ExportError(f"no exported {method} shape fits input length {input_length} and "
                        f"decode length {decode_length}; exported (input, decode) lengths: "
                        f"{have}; re-export with larger --input_lengths / --decode_lengths")
    big = [f for f in fits if f["batch"] >= batch]
    if big:
      return min(big, key=lambda f: (f["batch"] * f["input_length"], f["decode_length"]))
    return min(fits, key=lambda f: (-f["batch"], f["input_length"], f["decode_length"]))

  def run(self, method: str, inputs: np.ndarray, *, decode_length: int,
          max_new_tokens=None, temperature=1.0, topp=0.0, seed: int = 0,
          alpha: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """Decodes model-ready tokens.

    Args:
      method: 'greedy', 'sample' or 'beam' (`num_beams` beams, the best returned).
      inputs: [b, i] int: encoder tokens ending in EOS, 0-padded (encoder-decoder), or
        [0 (BOS), prompt..., 0 padding] (decoder-only).
      decode_length: l, the output length.
      max_new_tokens: scalar or [b]: stop each row after this many tokens (<= l).
      temperature, topp: scalar or [b] (sampling only); seed: sampling seed.
      alpha: beam search's brevity-penalty exponent, one for the call (T5X's
        ((5 + length) / 6) ** alpha; 0 ranks by plain log-prob).

    Returns:
      tokens [b, l] int32 (0 after EOS or the step limit), scores [b] float32 (beam: the
      best beam's log-prob over its brevity penalty).
    """
    x = np.asarray(inputs)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
      raise ExportError(f"inputs must be integer tokens [batch, length], got {x.dtype} "
                        f"with shape {list(x.shape)}")
    v = self.manifest["model"]["vocab_size"]
    if x.size and (x.min() < 0 or x.max() >= v):
      # The compiled embedding lookup would clamp such ids silently.
      raise ExportError(f"inputs have ids outside [0, {v}): min {x.min()}, max {x.max()}")
    b = x.shape[0]
    steps = np.broadcast_to(np.asarray(decode_length if max_new_tokens is None
                                       else max_new_tokens, np.int32), (b,))
    if b == 0:
      return np.zeros((0, decode_length), np.int32), np.zeros((0,), np.float32)
    if steps.min() < 1 or steps.max() > decode_length:
      raise ExportError(f"max_new_tokens must be in [1, {decode_length}], got "
                        f"{steps.min()}..{steps.max()}")
    # Trailing padding is free to drop: fit the input to the shortest exported length.
    used = int(np.max(np.nonzero(x.any(axis=0))[0], initial=-1)) + 1
    entry = self.pick(method, b, max(used, 1 if self.is_encoder_decoder else 2), decode_length)
    fb, fi = entry["batch"], entry["input_length"]
    temps = np.broadcast_to(np.asarray(temperature, np.float32), (b,))
    topps = np.broadcast_to(np.asarray(topp, np.float32), (b,))
    fn = self._function(entry)
    tokens, scores = [], []
    for start in range(0, b, fb):
      rows = min(fb, b - start)
      xs = np.zeros((fb, fi), np.int32)
      xs[:rows, :used] = x[start:start + rows, :used]
      # Padding rows stop after one step; a larger compiled l stops rows at their limit.
      ms = np.ones((fb,), np.int32)
      ms[:rows] = steps[start:start + rows]
      args = [self.params, xs, ms]
      if method == "sample":
        ts, ps = np.ones((fb,), np.float32), np.zeros((fb,), np.float32)
        ts[:rows], ps[:rows] = temps[start:start + rows], topps[start:start + rows]
        # The seed is a uint32 argument; a chunk after the first draws with its own.
        args += [ts, ps, np.uint32((int(seed) + start) % (1 << 32))]
      elif method == "beam":
        args.append(np.float32(alpha))
      try:
        t, s = fn.call(*args)
      except ValueError as e:
        if "was exported for platforms" not in str(e):
          raise
        raise ExportError(f"{entry['file']} was exported for {', '.join(entry['platforms'])}, "
                          f"not this machine's {jax.default_backend()}; re-export with "
                          "--platforms naming it") from None
      tokens.append(np.asarray(t)[:rows, :decode_length])
      scores.append(np.asarray(s)[:rows])
    return np.concatenate(tokens).astype(np.int32), np.concatenate(scores).astype(np.float32)

  # -- text -----------------------------------------------------------------------------
  def encode(self, texts) -> np.ndarray:
    """Texts (or token lists) -> model-ready [b, longest] int32 (see `run`)."""
    return encode_rows(texts, self.vocabulary, self.eos_id, self.is_encoder_decoder)

  def generate(self, inputs, max_new_tokens: int | None = None, *, method: str = "greedy",
               temperature: float = 1.0, topp: float = 0.0, seed: int = 0,
               alpha: float = 0.6):
    """Strings in, strings out; or model-ready tokens [b, i] in, new tokens [b, l] out.

    Args:
      inputs: a list of strings (encoded with the artifact's vocabulary), or an integer
        array [b, i] as `run` takes.
      max_new_tokens: decode length l (an exported decode length >= l is used); default
        the largest exported decode length.
      method, temperature, topp, seed, alpha: 'greedy', 'sample' with temperature, topp
        and seed, or 'beam' (the best of `num_beams` beams) with alpha.
    """
    if isinstance(inputs, str):
      raise ExportError("generate() takes a list of strings; wrap a single text in a list")
    texts = not isinstance(inputs, np.ndarray) and any(isinstance(t, str) for t in inputs)
    arr = self.encode(inputs) if texts else np.asarray(inputs)
    if max_new_tokens is None:
      self.pick(method, 1, 1, 1)  # the error when the method was not exported
      max_new_tokens = max(f["decode_length"] for f in self.functions if f["method"] == method)
    tokens, _ = self.run(method, arr, decode_length=max_new_tokens, temperature=temperature,
                         topp=topp, seed=seed, alpha=alpha)
    if not texts:
      return tokens
    return [self.vocabulary.decode(text_ids(row, self.stop_ids, self.eos_id))
            for row in tokens]

@dataclasses.dataclass(frozen=True)
class Kind:
  """What changes compiled code (the fields of t5forge.generation.Kind): requests of one
  Kind batch together. An export serves method 'greedy' or 'sample' with n = 1 only."""
  method: str = "greedy"
  num_decodes: int = 1
  topk: int = 0
  top_logprobs: int = 0


@dataclasses.dataclass
class Generated:
  """What `ExportedGenerator.generate` returns (the fields of t5forge.generation.Generated)."""
  tokens: np.ndarray
  scores: np.ndarray
  token_logprobs: np.ndarray | None
  top_ids: np.ndarray | None
  top_logprobs: np.ndarray | None
  lengths: np.ndarray
  finished: np.ndarray


class ExportedGenerator:
  """`t5forge.generation.Generator`'s serving interface over an exported artifact.

  Greedy (and sampling, if exported) with one decode per input; beams (an exported beam
  function returns the best beam only, and a served beam request wants all num_beams of
  them), n > 1, top-k, per-token log-probs and scoring raise ExportError naming what is
  missing.
  """

  def __init__(self, model: ExportedModel | str):
    self.exported = model if isinstance(model, ExportedModel) else ExportedModel(model)
    self.eos_id = self.exported.eos_id
    # As the checkpoint's Generator: None for one id, else the tuple (the app then leaves
    # the extra stop ids out of the text).
    stops = self.exported.stop_ids
    self.stop_ids = stops if len(stops) > 1 else None
    self.is_encoder_decoder = self.exported.is_encoder_decoder
    self.vocabulary = self.exported.vocabulary

  def check_kind(self, kind) -> str:
    """The method to run for `kind`; ExportError (a ValueError) naming what this export
    cannot do (n or beams, top_k, logprobs, a method it lacks)."""
    method = getattr(kind, "method", "greedy")
    if method == "beam":
      what = (f"its beam search (num_beams={self.exported.num_beams}) returns the best beam "
              "only, from the Python loader" if self.exported.num_beams else
              "it has no beam search")
      raise ExportError(f"num_beams is not served from an exported model: {what}; serve the "
                        "checkpoint for num_beams")
    if getattr(kind, "num_decodes", 1) != 1:
      raise ExportError(f"an exported model gives one decode per input (n = "
                        f"{kind.num_decodes}); serve the checkpoint for more")
    if getattr(kind, "topk", 0):
      raise ExportError("top_k is not available from an exported model (only top_p); serve "
                        "the checkpoint for top_k")
    if getattr(kind, "top_logprobs", 0):
      raise ExportError("logprobs are not available from an exported model; serve the "
                        "checkpoint for logprobs")
    if method not in self.exported.methods:
      raise ExportError(f"method {method!r} is not in this export "
                        f"({', '.join(self.exported.methods)}); re-export with --methods "
                        f"{method} or serve the checkpoint")
    return method

  def generate(self, kind, inputs: np.ndarray, *, decode_length: int, max_new_tokens,
               temperature=None, topp=None, alpha: float = 0.6, seed: int = 0,
               min_log_prob=None, stream: bool = False, on_chunk=None) -> Generated:
    """Decodes `inputs` [b, i]; returns Generated with tokens [b, 1, l].

    With stream=True, on_chunk(tokens, lengths, finished) is called once, at the end (the
    exported loop runs whole)."""
    del alpha  # beam search only, which check_kind refuses here
    if min_log_prob is not None:
      raise ExportError("min_log_prob applies to beam search, which an exported model does "
                        "not serve; serve the checkpoint for num_beams")
    method = self.check_kind(kind)
    b = np.asarray(inputs).shape[0]
    steps = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,))
    tokens, scores = self.exported.run(
        method, inputs, decode_length=decode_length, max_new_tokens=steps,
        temperature=1.0 if temperature is None else temperature,
        topp=0.0 if topp is None else topp, seed=seed)
    is_eos = np.isin(tokens, self.exported.stop_ids)
    finished = is_eos.any(axis=1)
    lengths = np.where(finished, np.argmax(is_eos, axis=1) + 1,
                       np.minimum(steps, decode_length)).astype(np.int32)
    out = Generated(tokens=tokens[:, None], scores=scores[:, None], token_logprobs=None,
                    top_ids=None, top_logprobs=None, lengths=lengths[:, None],
                    finished=finished[:, None])
    if stream and on_chunk is not None:
      on_chunk(out.tokens, out.lengths, out.finished)
    return out


  def score(self, inputs, targets):
    raise ExportError("scoring is not available from an exported model; serve the checkpoint "
                      "for /v1/score")

  def warmup(self, kinds, batch_sizes, input_lengths, decode_lengths) -> int:
    """Runs each exported function that the given shapes would use once; returns how many
    distinct functions ran."""
    ran = set()
    for kind in kinds:
      method = self.check_kind(kind)
      for b in batch_sizes:
        for i in input_lengths:
          for l in decode_lengths:
            entry = self.exported.pick(method, b, i, l)
            if entry["file"] in ran:
              continue
            x = np.zeros((b, i), np.int32)
            x[:, 0] = self.eos_id if self.is_encoder_decoder else 0
            self.exported.run(method, x, decode_length=l, max_new_tokens=1)
            ran.add(entry["file"])
    return len(ran)
