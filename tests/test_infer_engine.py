"""`Model.generate` and `t5forge infer` on the engine (`engine.OfflineDecoder`): more texts
than slots, of mixed input and output lengths, give exactly what the static padded
batches (`generation.Generator.predict`) give for greedy decoding; a sampled text depends on its
seed and place only, not on how many slots decode beside it."""
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from t5forge import testing as sh
from t5forge.data.vocab import ByteVocabulary
from t5forge.decoding import text_ids

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
  # Its rows end at many different steps (`eos_prone`).
  vocab = ByteVocabulary()
  return sh.eos_prone("t5_1_1.tiny", vocab_size=vocab.vocab_size, vocabulary=vocab, seed=2)


def _texts(count: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(5, 250, int(rng.integers(3, 90))).tolist() for _ in range(count)]


@pytest.mark.slow
def test_generate_greedy_equals_static_batches_and_sampling_ignores_slots(model):
  texts = _texts(40)
  got = model.generate(texts, batch_size=8, max_decode_length=32)
  # The static path, one padded batch per 8 texts.
  arr, _ = model._encode_texts(texts, 512)
  tokens, _ = model.predict(arr, 32)
  want = [model.vocabulary.decode(text_ids(t, model.model.stop_ids)) for t in tokens.tolist()]
  assert got == want
  lengths = (tokens != 0).sum(1)
  assert len(set(lengths.tolist())) > 5, lengths  # rows end at many steps: slots are reused mid-way

  a = model.generate(texts, batch_size=8, max_decode_length=32, method="sample", seed=3)
  b = model.generate(texts, batch_size=4, max_decode_length=32, method="sample", seed=3)
  c = model.generate(texts, batch_size=8, max_decode_length=32, method="sample", seed=4)
  assert a == b and a != c
  # n samples per text, all returned best last, agree with the single best.
  many = model.generate(texts[:6], batch_size=4, max_decode_length=32, method="sample",
                        seed=3, num_decodes=3, return_all_decodes=True)
  best = model.generate(texts[:6], batch_size=4, max_decode_length=32, method="sample",
                        seed=3, num_decodes=3)
  assert [m[-1] for m in many] == best and all(len(m) == 3 for m in many)


def _infer(ckpt, src, out, *args):
  r = subprocess.run([sys.executable, "-m", "t5forge", "infer", "--checkpoint", str(ckpt),
                      "--input", str(src), "--output_dir", str(out), "--batch_size", "4",
                      "--max_decode_length", "24", *args],
                     capture_output=True, text=True, cwd=ROOT, timeout=600)
  return r


@pytest.mark.slow
def test_infer_cli_continuous_equals_static_and_sampling_is_recorded(model, tmp_path):
  ckpt = tmp_path / "ckpt"
  model.save(str(ckpt))
  rng = np.random.default_rng(1)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
  src = tmp_path / "mixed.txt"
  src.write_text("".join("".join(rng.choice(letters, int(rng.integers(3, 90)))).strip() + "x\n"
                         for _ in range(30)))
  rows = {}
  for scheduler in ("continuous", "static"):
    r = _infer(ckpt, src, tmp_path / scheduler, "--mode", "predict_with_aux", "--scheduler",
               scheduler)
    assert r.returncode == 0, r.stderr[-2000:]
    rows[scheduler] = [json.loads(l) for l in open(tmp_path / scheduler / "mixed-0.jsonl")]
  cont, static = rows["continuous"], rows["static"]
  assert [x["prediction_tokens"] for x in cont] == [x["prediction_tokens"] for x in static]
  assert [x["prediction"] for x in cont] == [x["prediction"] for x in static]
  np.testing.assert_allclose([x["aux"]["scores"] for x in cont],
                             [x["aux"]["scores"] for x in static], atol=1e-4)
  assert len({len(x["prediction_tokens"]) for x in cont}) > 3  # mixed output lengths
  # Sampled rows differ between the two: output of one is never resumed by the other.
  out = tmp_path / "sampled"
  r = _infer(ckpt, src, out, "--method", "sample", "--seed", "2", "--scheduler", "static")
  assert r.returncode == 0, r.stderr[-2000:]
  r = _infer(ckpt, src, out, "--method", "sample", "--seed", "2")
  assert r.returncode != 0 and "scheduler" in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.slow
def test_generate_follows_new_parameters_without_recompiling(model):
  from t5forge.engine import compile_count
  texts = _texts(6, seed=3)
  old = model.params
  place = lambda p: jax.device_put(p, model.param_shardings)  # as train_step leaves them
  try:
    model.params = place(old)
    before = model.generate(texts, batch_size=4, max_decode_length=16)
    model.params = place(jax.tree.map(lambda x: x * 1.5, old))
    after = model.generate(texts, batch_size=4, max_decode_length=16)
    arr, _ = model._encode_texts(texts, 512)
    tokens, _ = model.predict(arr, 16)
    assert after == [model.vocabulary.decode(t) for t in tokens.tolist()] != before
    # Back to the first parameters: every shape is compiled already, in the same engine.
    model.params = place(old)
    compiles = compile_count()
    assert model.generate(texts, batch_size=4, max_decode_length=16) == before
    assert compile_count() == compiles
  finally:
    model.params = old


@pytest.mark.slow
def test_generate_over_mixed_lengths_reuses_one_engine_without_recompiling(model):
  """A notebook loop over texts of mixed lengths: once an engine fits the longest input,
  shorter ones run on its smaller encoder buckets. (It was keyed on the longest input
  rounded to 32 tokens: every call whose longest text changed bucket built a new engine
  and compiled again.)"""
  from t5forge.engine import compile_count
  rng = np.random.default_rng(7)
  text = lambda n: rng.integers(5, 250, n).tolist()
  short, middle, long_ = [text(10)], [text(45), text(20)], [text(100)]
  want = {}
  for name, texts in (("long", long_), ("short", short), ("middle", middle)):
    arr, _ = model._encode_texts(texts, 512)
    tokens, _ = model.predict(arr, 16)  # the static path
    want[name] = [model.vocabulary.decode(text_ids(t, model.model.stop_ids))
                  for t in tokens.tolist()]
    assert model.generate(texts, batch_size=4, max_decode_length=16) == want[name]
  engine, compiles = model._offline[1], compile_count()
  for name, texts in (("short", short), ("middle", middle), ("long", long_), ("short", short)):
    assert model.generate(texts, batch_size=4, max_decode_length=16) == want[name]
  assert model._offline[1] is engine and compile_count() == compiles


@pytest.mark.slow
def test_predict_and_score_take_new_parameters_without_recompiling(model):
  """`Model.predict` / `score` pass the current parameters to the one Generator per call:
  new parameters give what a Generator built for them gives, and going back to the first
  ones compiles nothing."""
  from t5forge.engine import compile_count
  from t5forge.generation import Generator
  from t5forge.predict import DecodeOptions
  texts = _texts(4, seed=5)
  arr, _ = model._encode_texts(texts, 512)
  targets = [t[:5] for t in texts]
  old = model.params
  place = lambda p: jax.device_put(p, model.param_shardings)  # as train_step leaves them
  try:
    model.params = place(old)
    beams = model.predict(arr, 12, method="beam", num_decodes=2)
    scores = model.score(texts, targets)
    new = place(jax.tree.map(lambda x: x * 1.5, old))
    model.params = new
    fresh = Generator(model.model, new)  # its own compile cache, the new parameters built in
    batch = model._text_batch(texts, targets, None)
    want = fresh.score_batch(batch)
    np.testing.assert_allclose(model.score(texts, targets), want, rtol=1e-6)
    assert not np.allclose(want, scores)
    got = model.predict(arr, 12, method="beam", num_decodes=2)
    want = fresh.predict({"encoder_input_tokens": arr,
                          "decoder_input_tokens": np.zeros((len(arr), 12), np.int32)},
                         DecodeOptions(method="beam", num_decodes=2))
    np.testing.assert_array_equal(got[0], want[0])
    model.params = place(old)
    compiles = compile_count()
    again = model.predict(arr, 12, method="beam", num_decodes=2)
    np.testing.assert_array_equal(again[0], beams[0])
    np.testing.assert_allclose(model.score(texts, targets), scores, rtol=1e-6)
    assert compile_count() == compiles
  finally:
    model.params = old
