"""CTranslate2's side of the benchmark; runs in a `ct2` worker (see bench/worker.py).

The models are converted by the `hf` worker (`TransformersConverter`, float32 and int8
weights) from the same HF directory the others load. CTranslate2 translates token
strings: its vocabulary is the benchmark tokenizer's three words (`<pad>`, `</s>`,
`<unk>`, ids 0-2) followed by `<extra_id_N>` up to config.vocab_size (its T5 loader
pads it so), so id i is the i-th entry of the converted model's vocabulary and every
id has a distinct string. Inputs go in as those strings; outputs map back by position.

Threads: intra_threads=2 (this machine's cores), inter_threads=1.
"""
from __future__ import annotations

import importlib.metadata
import json
import os

import ctranslate2
from bench import shapes

INTRA_THREADS = 2


def read_vocabulary(model_dir: str) -> list[str]:
  """The converted model's (shared) vocabulary, in id order."""
  path = os.path.join(model_dir, "shared_vocabulary.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  with open(os.path.join(model_dir, "shared_vocabulary.txt"), encoding="utf-8") as f:
    return [line.rstrip("\n") for line in f]


class Backend:
  """Jobs of the `ct2` worker."""

  def __init__(self):
    self._translators: dict[tuple[str, str], tuple] = {}
    self._last: dict[str, tuple[list, dict]] = {}  # tag -> (token strings, index)

  def op_versions(self) -> dict:
    return {"ctranslate2": importlib.metadata.version("ctranslate2"),
            "compute_types": sorted(ctranslate2.get_supported_compute_types("cpu"))}

  def op_tokens(self, tag: str) -> list:
    hyps, index = self._last[tag]
    return [[index[t] for t in h] for h in hyps]

  def _translator(self, model_dir: str, compute_type: str):
    key = (model_dir, compute_type)
    if key not in self._translators:
      vocab = read_vocabulary(model_dir)
      if len(set(vocab)) != len(vocab):
        raise RuntimeError(f"{model_dir}: the vocabulary has duplicate strings; ids would "
                           "not map back")
      translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type,
                                          inter_threads=1, intra_threads=INTRA_THREADS)
      self._translators[key] = (translator, vocab, {t: i for i, t in enumerate(vocab)})
    return self._translators[key]

  def setup_decode(self, tag: str, model_dir: str, compute_type: str, method: str, batch: int,
                   beams: int, input_length: int, new_tokens: int, vocab_size: int,
                   seed: int = 0):
    """translate_batch with min_decoding_length = max_decoding_length = new_tokens."""
    translator, vocab, index = self._translator(model_dir, compute_type)
    if len(vocab) != vocab_size:
      raise RuntimeError(f"{model_dir}: vocabulary of {len(vocab)} strings, the model has "
                         f"{vocab_size} ids")
    tokens = shapes.random_tokens(seed, batch, input_length, vocab_size, end_with_eos=True)
    source = [[vocab[i] for i in row] for row in tokens.tolist()]
    beam_size = beams if method == "beam" else 1

    def run():
      results = translator.translate_batch(
          source, beam_size=beam_size, num_hypotheses=1, min_decoding_length=new_tokens,
          max_decoding_length=new_tokens, max_batch_size=0, return_scores=False)
      hyps = [r.hypotheses[0] for r in results]
      lengths = sorted({len(h) for h in hyps})
      if lengths != [new_tokens]:
        raise AssertionError(f"decoded lengths {lengths}, expected {new_tokens}")
      self._last[tag] = (hyps, index)

    return run, {}
