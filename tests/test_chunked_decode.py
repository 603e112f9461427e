"""`t5forge.generation.Generator.generate` (the server's chunked decode) against the
one-call feature-batch path (`interactive.Model.predict` / `score`: `Generator.predict`,
T5X's `predict_batch_with_aux` over `decoding`'s whole loops): greedy, per-row options, sampling,
beam search, top log-probs and scoring, each decoded whole and in resumed chunks, on
tiny random-init encoder-decoder and decoder-only models whose EOS is boosted so that
rows end at different steps."""
import numpy as np
import pytest

import t5forge
from t5forge.generation import Generator, Kind
from t5forge.sharding import Partitioner

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

VOCAB = 64
LENGTH = 10  # decode length l
B = 4


def _eos_prone(name: str):
  """A tiny model whose EOS logit nearly copies a token greedy decoding often picks, so
  that some rows end early (at different steps) and others run to the limit."""
  m = t5forge.init(name, vocab_size=VOCAB, seed=1)
  x = _inputs(m, seed=0)
  tokens, _ = m.predict(x, max_decode_length=LENGTH)
  counts = np.bincount(tokens[:, 2:].ravel(), minlength=VOCAB)
  counts[:2] = 0
  params = m.params
  kernel = params["decoder"]["logits_dense"]["kernel"]
  kernel = kernel.at[:, 1].set(kernel[:, int(counts.argmax())] * 1.01)
  m.params = {**params, "decoder": {**params["decoder"],
                                    "logits_dense": {"kernel": kernel}}}
  return m


def _inputs(m, seed: int, b: int = B) -> np.ndarray:
  """[b, 7] inputs of different lengths in the layout `generate` takes."""
  rng = np.random.default_rng(seed)
  x = np.zeros((b, 7), np.int32)
  for r in range(b):
    n = 2 + r % 4
    if m.config.is_encoder_decoder:
      x[r, :n] = rng.integers(2, VOCAB, n)
      x[r, n] = 1  # EOS
    else:
      x[r, 1:1 + n] = rng.integers(2, VOCAB, n)  # 0 (BOS), prompt, 0 padding
  return x


@pytest.fixture(scope="module")
def models():
  """Each model built once per module, on first use."""
  cache = {}

  def get(name):
    if name not in cache:
      m = _eos_prone(name)
      cache[name] = m, Generator(m.model, m.params, chunk_tokens=3)
    return cache[name]

  return get


@pytest.fixture(params=["t5_1_1.tiny", "decoder_only.tiny"])
def setup(request, models):
  return models(request.param)


def _rows(b, value, dtype=np.float32):
  return np.full((b,), value, dtype)


def _greedy(g, x, stream, on_chunk=None, max_new=LENGTH, kind=Kind()):
  b = x.shape[0]
  return g.generate(kind, x, decode_length=LENGTH, max_new_tokens=_rows(b, max_new, np.int32),
                    temperature=_rows(b, 0), topp=_rows(b, 0), stream=stream,
                    on_chunk=on_chunk)


def test_greedy_chunked_and_whole_equal_predict(setup):
  m, g = setup
  x = _inputs(m, seed=2)
  ref_tokens, ref_scores = m.predict(x, max_decode_length=LENGTH)
  chunks = []
  streamed = _greedy(g, x, True, lambda t, l, f: chunks.append((t.copy(), l.copy(), f.copy())))
  whole = _greedy(g, x, False)
  for out in (streamed, whole):
    np.testing.assert_array_equal(out.tokens[:, 0], ref_tokens)
    np.testing.assert_allclose(out.scores[:, 0], ref_scores, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.token_logprobs.sum(-1), out.scores, rtol=1e-5, atol=1e-5)
    assert out.top_ids is None and out.top_logprobs is None
  # The boosted EOS ends some rows early and not others.
  assert streamed.finished.any() and not streamed.finished.all()
  ends = [np.flatnonzero(row == 1) for row in ref_tokens]
  np.testing.assert_array_equal(streamed.lengths[:, 0],
                                [e[0] + 1 if len(e) else LENGTH for e in ends])
  np.testing.assert_array_equal(streamed.finished[:, 0], [len(e) > 0 for e in ends])
  # Several chunks, growing; what each shows is a prefix of the final tokens.
  assert len(chunks) > 1
  lengths = np.stack([c[1] for c in chunks])
  assert np.all(np.diff(lengths, axis=0) >= 0) and np.any(np.diff(lengths, axis=0) > 0)
  assert lengths[0].max() <= g.chunk_tokens
  for tokens, lens, _ in chunks:
    for r in range(B):
      n = lens[r, 0]
      np.testing.assert_array_equal(tokens[r, 0, :n], streamed.tokens[r, 0, :n])
      assert not tokens[r, 0, n:].any()
  np.testing.assert_array_equal(chunks[-1][0], streamed.tokens)
  np.testing.assert_array_equal(chunks[-1][2], streamed.finished)


def test_per_row_options_equal_rows_alone(setup):
  """Mixed max_new_tokens and temperatures in one batch: each greedy row is what it
  would be decoded alone with its own limit."""
  m, g = setup
  x = _inputs(m, seed=3)
  max_new = np.array([LENGTH, 4, 7, 2], np.int32)
  temperature = np.array([0.0, 0.9, 0.0, 0.0], np.float32)
  for stream in (True, False):
    out = g.generate(Kind("sample"), x, decode_length=LENGTH, max_new_tokens=max_new,
                     temperature=temperature, topp=_rows(B, 0), seed=4, stream=stream)
    for r in range(B):
      assert out.lengths[r, 0] <= max_new[r] and not out.tokens[r, 0, max_new[r]:].any()
      if temperature[r] == 0:
        tokens, scores = m.predict(x[r:r + 1], max_decode_length=LENGTH,
                                   max_decode_steps=int(max_new[r]))
        np.testing.assert_array_equal(out.tokens[r, 0], tokens[0])
        np.testing.assert_allclose(out.scores[r, 0], scores[0], rtol=1e-6, atol=1e-6)


def test_sampling_reproducible_chunked_equal_whole_and_predict(setup):
  m, g = setup
  x = _inputs(m, seed=5)
  kind = Kind("sample", num_decodes=2)

  def run(seed, stream):
    return g.generate(kind, x, decode_length=LENGTH, max_new_tokens=_rows(B, LENGTH, np.int32),
                      temperature=_rows(B, 1.5), topp=_rows(B, 0.0), seed=seed, stream=stream)

  a, b, whole, other = run(7, True), run(7, True), run(7, False), run(8, False)
  for out in (b, whole):
    np.testing.assert_array_equal(out.tokens, a.tokens)
    np.testing.assert_array_equal(out.scores, a.scores)
    np.testing.assert_array_equal(out.lengths, a.lengths)
  assert not np.array_equal(other.tokens, a.tokens)
  assert np.all(np.diff(a.scores, axis=1) >= 0)  # best last
  # The same keys as the one-call loop: its samples for the same seed.
  tokens, scores = m.predict(x, max_decode_length=LENGTH, method="sample", num_decodes=2,
                             temperature=1.5, seed=7, return_all_decodes=True)
  np.testing.assert_array_equal(a.tokens, tokens)
  np.testing.assert_allclose(a.scores, scores, rtol=1e-6, atol=1e-6)


def test_top_k_is_a_runtime_value_no_client_compiles(models):
  """The static path (`--scheduler static`, beam-free sampling): top_k, as temperature and
  top_p, is a traced per-row value. A client sending a new top_k per request made the
  server compile each time (4 s a request on a tiny T5, measured); now nothing compiles,
  and top_k still applies (1 is greedy; any k agrees with `predict`'s static filter)."""
  from t5forge.engine import compile_count
  m, g = models("t5_1_1.tiny")
  x = _inputs(m, seed=9)

  def run(k, seed=3):
    return g.generate(Kind("sample", topk=k), x, decode_length=LENGTH,
                      max_new_tokens=_rows(B, LENGTH, np.int32), temperature=_rows(B, 2.0),
                      topp=_rows(B, 0.9), seed=seed)

  greedy = _greedy(g, x, stream=False)
  run(5)
  before = compile_count()
  out = {k: run(k) for k in (1, 2, 17, 63, 999)}
  assert compile_count() == before
  np.testing.assert_array_equal(out[1].tokens[:, 0], greedy.tokens[:, 0])
  assert not np.array_equal(out[999].tokens, out[1].tokens)
  tokens, _ = m.predict(x, max_decode_length=LENGTH, method="sample", topk=2, topp=0.9,
                        temperature=2.0, seed=3, return_all_decodes=True)
  np.testing.assert_array_equal(out[2].tokens, tokens)


def test_beam_equals_predict(setup):
  m, g = setup
  x = _inputs(m, seed=6)
  calls = []
  out = g.generate(Kind("beam", num_decodes=3), x, decode_length=LENGTH,
                   max_new_tokens=_rows(B, LENGTH, np.int32), temperature=_rows(B, 0),
                   topp=_rows(B, 0), alpha=0.6, stream=True,
                   on_chunk=lambda *a: calls.append(a))
  tokens, scores = m.predict(x, max_decode_length=LENGTH, method="beam", num_decodes=3,
                             alpha=0.6, return_all_decodes=True)
  np.testing.assert_array_equal(out.tokens, tokens)
  np.testing.assert_allclose(out.scores, scores, rtol=1e-6, atol=1e-6)
  assert len(calls) == 1
  # Beams carry their tokens' log-probs (tests/test_beam_options.py checks their values):
  # one per new token, 0 after the end.
  assert out.token_logprobs.shape == out.tokens.shape
  past = np.arange(LENGTH) >= out.lengths[..., None]
  assert not out.token_logprobs[past].any() and (out.token_logprobs[~past] <= 0).all()
  np.testing.assert_array_equal(out.finished, (tokens == 1).any(-1))


def test_top_logprobs(setup):
  m, g = setup
  x = _inputs(m, seed=7)
  temperature = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
  out = g.generate(Kind("sample", top_logprobs=3), x, decode_length=LENGTH,
                   max_new_tokens=_rows(B, LENGTH, np.int32), temperature=temperature,
                   topp=_rows(B, 0), seed=1, stream=True)
  assert out.top_ids.shape == out.top_logprobs.shape == (B, 1, LENGTH, 3)
  np.testing.assert_allclose(out.token_logprobs.sum(-1), out.scores, rtol=1e-5, atol=1e-5)
  hits = 0
  for r in range(B):
    n = out.lengths[r, 0]
    assert np.all(np.diff(out.top_logprobs[r, 0, :n], axis=-1) <= 0)
    assert not out.top_ids[r, 0, n:].any() and not out.token_logprobs[r, 0, n:].any()
    if temperature[r] == 0:
      # Greedy picks the most likely token: top-1 is the chosen one, with its log-prob.
      np.testing.assert_array_equal(out.top_ids[r, 0, :n, 0], out.tokens[r, 0, :n])
      np.testing.assert_allclose(out.top_logprobs[r, 0, :n, 0], out.token_logprobs[r, 0, :n],
                                 rtol=1e-6, atol=1e-6)
      continue
    # Sampling at temperature 1 without top-k / top-p draws from the model's softmax, so
    # the chosen token's log-prob is its entry among the top ones whenever it is there.
    for j in range(n):
      where = np.flatnonzero(out.top_ids[r, 0, j] == out.tokens[r, 0, j])
      if len(where):
        hits += 1
        np.testing.assert_allclose(out.top_logprobs[r, 0, j, where[0]],
                                   out.token_logprobs[r, 0, j], rtol=1e-5, atol=1e-6)
  assert hits > 0


def test_score_equals_model_score(setup):
  m, g = setup
  x = _inputs(m, seed=8)
  if not m.config.is_encoder_decoder:
    # Model.score ends a decoder-only prompt with EOS; generate's layout takes the
    # prompt as given, so give it that EOS.
    for r in range(B):
      x[r, 1 + np.count_nonzero(x[r])] = 1
  rng = np.random.default_rng(9)
  targets = np.zeros((B, 6), np.int32)
  target_lists = []
  for r in range(B):
    t = rng.integers(2, VOCAB, 2 + r).tolist()
    target_lists.append(t)
    targets[r, :len(t) + 1] = t + [1]
  body = x if m.config.is_encoder_decoder else x[:, 1:]
  inputs = [[int(t) for t in row if t not in (0, 1)] for row in body]
  np.testing.assert_allclose(g.score(x, targets), m.score(inputs, target_lists),
                             rtol=1e-5, atol=1e-5)


def test_partitioner(models):
  """With a Partitioner: inputs placed (split when the batch divides the data axis,
  else replicated), run under its rules: the same tokens."""
  m, _ = models("t5_1_1.tiny")
  p = Partitioner(num_partitions=1)
  g = Generator(m.model, p.place(m.params), partitioner=p, chunk_tokens=4)
  x = _inputs(m, seed=2)
  ref_tokens, _ = m.predict(x, max_decode_length=LENGTH)
  np.testing.assert_array_equal(_greedy(g, x, True).tokens[:, 0], ref_tokens)


def test_warmup_compiles_what_generate_runs(models):
  """After warmup, a request of that shape with other per-row options compiles nothing."""
  m, _ = models("t5_1_1.tiny")
  g = Generator(m.model, m.params)
  assert g.warmup([Kind()], [2], [7], [5]) == 1
  start, advance = g._sample_fns(Kind(), 5)
  sizes = start._cache_size(), advance._cache_size()
  g.generate(Kind(), _inputs(m, seed=3, b=2), decode_length=5,
             max_new_tokens=np.array([5, 2], np.int32), temperature=_rows(2, 0.7),
             topp=_rows(2, 0.5), stream=True)
  assert (start._cache_size(), advance._cache_size()) == sizes == (1, 1)
