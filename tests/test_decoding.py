"""Decoding against plain Python references on a toy model with a real cache: greedy
against an argmax loop, sampling against the softmax frequencies, beam search against a
per-example T5X beam search and against exhaustive enumeration."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge import decoding
from t5forge.errors import UserError

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

V = 6  # 0 padding, 1 EOS, 2..5 words
PAD, EOS = 0, 1
WORDS = range(2, V)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


class Toy:
  """A Markov chain whose logits also depend on per-example state kept in the cache:
  a bias row, the counts of the tokens fed so far and the step count. A cache expanded,
  carried or gathered from the wrong row therefore changes the logits.

  logits(prefix) = table[last] + bias[e] + 0.7 * counts(prefix) + pos[len(prefix) - 1]
  """

  def __init__(self, seed, batch, length, sharp=1.0, eos_bias=0.0):
    rng = np.random.default_rng(seed)
    self.table = (rng.normal(size=(V, V)) * sharp).astype(np.float32)
    self.table[:, PAD] = -1e9  # padding is never predicted
    self.bias = rng.normal(size=(batch, V)).astype(np.float32)
    self.pos = (rng.normal(size=(length + 2, V)) * sharp).astype(np.float32)
    self.pos[:, EOS] += eos_bias
    self.traces = 0

  def logits_np(self, e, prefix):
    hist = np.bincount(prefix, minlength=V)
    return (self.table[prefix[-1]].astype(np.float64) + self.bias[e] + 0.7 * hist
            + self.pos[len(prefix) - 1])

  def cache(self, prefixes=None):
    """The cache after feeding `prefixes[e]` (default: nothing) for every example."""
    b = self.bias.shape[0]
    prefixes = prefixes or [[]] * b
    hist = np.stack([np.bincount(p, minlength=V) for p in prefixes]).astype(np.float32)
    return {"bias": jnp.asarray(self.bias), "hist": jnp.asarray(hist),
            "count": jnp.asarray([len(p) for p in prefixes], jnp.int32),
            "calls": jnp.zeros((), jnp.int32)}  # shared scalar: must not be expanded

  def tokens_to_logits(self, state):
    self.traces += 1
    c = state.cache
    tok = state.cur_token[:, 0]
    hist = c["hist"] + jax.nn.one_hot(tok, V)
    pos = jnp.asarray(self.pos)[jnp.minimum(c["count"], self.pos.shape[0] - 1)]
    logits = jnp.asarray(self.table)[tok] + c["bias"] + 0.7 * hist + pos
    # The DecodingState contract: cur_index is the position of cur_token in sequences,
    # and equals the steps fed so far. A violation favours token 2 in that row, which
    # the references notice (rows that are done may differ: their output is unused).
    at_index = jnp.take_along_axis(state.sequences, state.cur_index[:, None], axis=1)[:, 0]
    wrong = (state.cur_index != c["count"]) | (at_index != tok)
    logits = logits + 20.0 * wrong[:, None] * jax.nn.one_hot(2, V)
    return logits, {"bias": c["bias"], "hist": hist, "count": c["count"] + 1,
                    "calls": c["calls"] + 1}


def _prompts(rng, batch, length, max_prompt=3):
  inputs = np.zeros((batch, length), np.int32)
  for e in range(batch):
    p = rng.integers(0, max_prompt + 1)
    inputs[e, 1:1 + p] = rng.integers(1, V, size=p)  # EOS may appear in a prompt
  return inputs


def ref_greedy(toy, inputs, initial_index=None, max_steps=None):
  """An argmax loop per example with T5X's conventions."""
  outs, scores = [], []
  for e, row in enumerate(np.asarray(inputs)):
    l = len(row)
    seq = [int(t) for t in row] + [0]
    if initial_index is None:
      seq[0], i = 0, 0
    else:
      i = int(initial_index[e])
    limit = l + 1 if max_steps is None else min(int(np.sum(row[1:] != 0)) + max_steps, l) + 1
    score = 0.0
    while i + 1 < limit:
      if seq[i + 1] == 0:
        lsm = _log_softmax(toy.logits_np(e, seq[:i + 1]))
        tok = int(np.argmax(lsm))
        score += lsm[tok]
        seq[i + 1] = tok
        if tok == EOS:
          break
      i += 1
    outs.append(seq[1:])
    scores.append(score)
  return np.array(outs), np.array(scores)


def _sampler(toy, **kw):
  return jax.jit(functools.partial(decoding.temperature_sample,
                                   tokens_to_logits=toy.tokens_to_logits, eos_id=EOS, **kw))


def _beam(toy, **kw):
  return jax.jit(functools.partial(decoding.beam_search, tokens_to_logits=toy.tokens_to_logits,
                                   eos_id=EOS, **kw))


# ------------------------------------------------------------------------------------
# Greedy and sampling
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_argmax_loop_with_prompts_and_step_limits(seed):
  rng = np.random.default_rng(seed)
  b, l = 5, 7
  toy = Toy(seed, b, l, eos_bias=0.5)
  inputs = _prompts(rng, b, l)
  greedy = _sampler(toy, temperature=0.0)
  decodes, scores = greedy(inputs, toy.cache())
  want, want_scores = ref_greedy(toy, inputs)
  np.testing.assert_array_equal(decodes[:, 0], want)
  np.testing.assert_allclose(scores[:, 0], want_scores, rtol=1e-5, atol=1e-4)
  # Forced tokens are kept even when the prompt holds EOS.
  np.testing.assert_array_equal(np.where(inputs[:, 1:] != 0, decodes[:, 0, :-1], 0),
                                inputs[:, 1:])
  for steps in (1, 2):
    decodes, scores = _sampler(toy, temperature=0.0, max_decode_steps=steps)(inputs, toy.cache())
    want, want_scores = ref_greedy(toy, inputs, max_steps=steps)
    np.testing.assert_array_equal(decodes[:, 0], want)
    np.testing.assert_allclose(scores[:, 0], want_scores, rtol=1e-5, atol=1e-4)


def test_generated_eos_pads_the_rest_with_zeros():
  b, l = 6, 8
  toy = Toy(3, b, l, eos_bias=2.0)
  decodes, _ = _sampler(toy, temperature=1.0, num_decodes=3)(
      np.zeros((b, l), np.int32), toy.cache(), decode_rng=jax.random.PRNGKey(0))
  rows = np.asarray(decodes).reshape(-1, l)
  ended = 0
  for row in rows:
    if EOS in row:
      ended += 1
      assert not row[list(row).index(EOS) + 1:].any()
    assert PAD not in row[:list(row).index(EOS) if EOS in row else l]
  assert ended > len(rows) // 2


def test_prefilled_cache_with_initial_index_equals_forcing_the_prompt():
  rng = np.random.default_rng(4)
  b, l = 4, 8
  toy = Toy(4, b, l)
  inputs = np.zeros((b, l), np.int32)
  lengths = np.array([1, 3, 2, 4])  # different prompt lengths per example
  for e, p in enumerate(lengths):
    inputs[e, 1:1 + p] = rng.integers(2, V, size=p)
  prefixes = [list(inputs[e, :lengths[e]]) for e in range(b)]  # fed before the loop
  for max_steps in (None, 2):
    kw = dict(temperature=0.0, max_decode_steps=max_steps)
    forced = _sampler(toy, **kw)(inputs, toy.cache())
    prefilled = _sampler(toy, **kw)(inputs, toy.cache(prefixes), initial_index=lengths)
    np.testing.assert_array_equal(prefilled[0], forced[0])
    np.testing.assert_allclose(prefilled[1], forced[1], rtol=1e-5, atol=1e-5)
    want, _ = ref_greedy(toy, inputs, initial_index=lengths, max_steps=max_steps)
    np.testing.assert_array_equal(prefilled[0][:, 0], want)


def test_sampling_reproduces_and_degenerate_settings_are_greedy():
  rng = np.random.default_rng(5)
  b, l = 4, 7
  toy = Toy(5, b, l, eos_bias=0.5)
  inputs = _prompts(rng, b, l)
  want, want_scores = ref_greedy(toy, inputs)
  key = jax.random.PRNGKey(42)
  sample = _sampler(toy, num_decodes=4)
  one, s1 = sample(inputs, toy.cache(), decode_rng=key)
  two, s2 = sample(inputs, toy.cache(), decode_rng=key)
  np.testing.assert_array_equal(one, two)
  np.testing.assert_array_equal(s1, s2)
  other, _ = sample(inputs, toy.cache(), decode_rng=jax.random.PRNGKey(7))
  assert not np.array_equal(one, other)
  assert np.all(np.diff(np.asarray(s1), axis=1) >= 0)  # increasing: best last

  # temperature and topp are traced: one compilation per (topk, rescale_log_probs).
  cases = [(0, dict(temperature=1.0, topp=1e-6)), (0, dict(temperature=0.0, topp=0.0)),
           (0, dict(temperature=1e-5, topp=0.0)), (1, dict(temperature=1.0, topp=0.0)),
           (1, dict(temperature=3.0, topp=0.0))]
  for rescale in (True, False):
    samplers = {topk: _sampler(toy, num_decodes=2, topk=topk, rescale_log_probs=rescale)
                for topk in (0, 1)}
    for topk, kw in cases:
      decodes, scores = samplers[topk](inputs, toy.cache(), decode_rng=key, **kw)
      for j in range(2):
        np.testing.assert_array_equal(decodes[:, j], want, err_msg=f"topk={topk} {kw}")
      if not rescale or kw["temperature"] < 1e-4:
        # The model's own log-probs (greedy rows always use them).
        np.testing.assert_allclose(scores[:, 0], want_scores, rtol=1e-5, atol=1e-4)
      else:
        # The distribution sampled from is a point mass.
        np.testing.assert_allclose(scores, 0.0, atol=1e-5)


def test_per_example_temperature_zero_rows_are_greedy():
  rng = np.random.default_rng(6)
  b, l = 4, 7
  toy = Toy(6, b, l)
  inputs = _prompts(rng, b, l)
  want, _ = ref_greedy(toy, inputs)
  temps = np.array([0.0, 1.5, 0.0, 1.0], np.float32)
  decodes, _ = _sampler(toy, num_decodes=3)(inputs, toy.cache(), temperature=temps,
                                              decode_rng=jax.random.PRNGKey(1))
  for e in (0, 2):
    for j in range(3):
      np.testing.assert_array_equal(decodes[e, j], want[e])


@functools.partial(jax.jit, static_argnames=("n", "topk"))
def _one_step_samples(logits, n, topk=0, temperature=1.0, topp=0.0):
  """n single tokens sampled from fixed logits [v]: (tokens [n], scores [n])."""
  ttl = lambda s: (jnp.broadcast_to(logits, (s.cur_token.shape[0], V)), s.cache)
  decodes, scores = decoding.temperature_sample(
      jnp.zeros((1, 1), jnp.int32), {}, ttl, EOS, decode_rng=jax.random.PRNGKey(0),
      num_decodes=n, temperature=temperature, topk=topk, topp=topp)
  return decodes[0, :, 0], scores[0]


def test_sampling_follows_the_softmax():
  logits = np.array([-1e9, 0.3, 1.2, -0.5, 0.9, 0.0], np.float32)
  n = 20000

  def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()

  def check(want, **kw):
    toks, scores = map(np.asarray, _one_step_samples(logits, n, **kw))
    np.testing.assert_allclose(np.bincount(toks, minlength=V) / n, want, atol=0.015,
                               err_msg=str(kw))
    # Scores are the log-probs of the distribution sampled from.
    np.testing.assert_allclose(scores, np.sort(np.log(want[toks])), rtol=1e-4, atol=1e-4)

  check(softmax(logits), temperature=1.0)
  check(softmax(logits / 0.5), temperature=0.5)
  top2 = np.where(logits >= np.sort(logits)[-2], logits, -np.inf)
  check(softmax(top2), temperature=1.0, topk=2)
  # Both: top-p 0.5 over top-k's two (0.57, 0.43) keeps one; over the whole row
  # (0.38, 0.28, ...) it would keep both (T5X refused the pair; transformers' order).
  check(np.eye(V)[2], temperature=1.0, topk=2, topp=0.5)
  # Nucleus: the smallest top set with mass >= 0.6 is {2, 4} (0.37 + 0.29 = 0.66).
  p = softmax(logits)
  assert p[2] < 0.6 < p[2] + p[4]
  check(softmax(np.where(np.isin(np.arange(V), [2, 4]), logits, -np.inf)), topp=0.6)


# ------------------------------------------------------------------------------------
# Beam search
# ------------------------------------------------------------------------------------


def ref_beam(toy, e, row, k, alpha, l):
  """T5X's beam search for one example, over real beams only; returns the finished
  (score, seq) pairs in increasing order, or the live ones if none finished."""
  bp = lambda n: ((5.0 + n) / 6.0) ** alpha
  prompt = [int(t) for t in row[:l]] + [0] * (l + 1 - len(row[:l]))
  prompt[0] = 0
  live, finished = [(0.0, [0])], []
  for i in range(l):
    if prompt[i + 1]:
      lp, seq = max(live)
      live = [(lp, seq + [prompt[i + 1]])]
      if prompt[i + 1] == EOS:  # a forced EOS finishes the beam, and nothing is live
        finished = [(lp / bp(i + 1), live[0][1])]
        break
      continue
    cands = []
    for lp, seq in live:
      lsm = _log_softmax(toy.logits_np(e, seq))
      cands += [(lp + lsm[t], seq + [t]) for t in range(V) if lsm[t] > -1e8]  # possible
    cands = sorted(cands, key=lambda c: -c[0])[:2 * k]
    live = [c for c in cands if c[1][-1] != EOS][:k]
    finished += [(lp / bp(i + 1), seq) for lp, seq in cands if seq[-1] == EOS]
    finished = sorted(finished, key=lambda c: -c[0])[:k]
  out = finished or live
  return [(s, (seq + [0] * (l + 1))[1:l + 1]) for s, seq in sorted(out, key=lambda c: c[0])]


def _real(decodes, scores, e):
  """The beams of example e that hold real sequences (not fillers), increasing."""
  return [(float(s), list(map(int, d))) for d, s in zip(decodes[e], scores[e]) if s > -1e6]


def _assert_beams_equal(got, want):
  assert [seq for _, seq in got] == [seq for _, seq in want]
  np.testing.assert_allclose([s for s, _ in got], [s for s, _ in want], rtol=1e-5, atol=1e-4)


# (3, 3.0, 2.0): a strong length reward and early EOS, where stopping an example too
# early (a wrong bound on the best live score) would change the result.
@pytest.mark.parametrize("k,alpha,eos_bias,seed", [
    (1, 0.0, 0.8, 1), (2, 0.6, 0.8, 2), (3, 0.0, 0.8, 3), (4, 1.0, 0.8, 4), (3, 3.0, 2.0, 0)])
def test_beam_search_matches_reference_beam_search(k, alpha, eos_bias, seed):
  rng = np.random.default_rng(seed)
  b, l = 4, 6
  toy = Toy(100 + seed, b, l, eos_bias=eos_bias)
  inputs = _prompts(rng, b, l, max_prompt=2)
  inputs[0, 1:3] = [4, EOS]  # a forced EOS ends the beam (T5X)
  decodes, scores = _beam(toy, num_decodes=k)(inputs, toy.cache(), alpha=alpha)
  decodes, scores = np.asarray(decodes), np.asarray(scores)
  assert decodes.shape == (b, k, l) and scores.shape == (b, k)
  assert np.all(np.diff(scores, axis=1) >= 0)  # increasing: best last
  for e in range(b):
    _assert_beams_equal(_real(decodes, scores, e), ref_beam(toy, e, inputs[e], k, alpha, l))
    p = (inputs[e, 1:] != 0).sum()
    for d, score in zip(decodes[e], scores[e]):
      if score > -1e6:  # a real sequence: prompt, words, a generated EOS and zeros
        prompt = list(inputs[e, 1:1 + p])
        if EOS in prompt:  # the beam ended at the forced EOS
          end = prompt.index(EOS)
          np.testing.assert_array_equal(d[:end + 1], prompt[:end + 1])
        else:
          np.testing.assert_array_equal(d[:p], prompt)
          gen = list(d[p:])
          end = p + gen.index(EOS) if EOS in gen else l  # (no EOS: live beams returned)
        assert PAD not in d[:end] and not d[end + 1:].any()


def _enumerate_finished(toy, e, prompt, l, alpha):
  """Every sequence that ends with a generated EOS within l, with its score."""
  p = len(prompt)
  out = []
  for n in range(p + 1, l + 1):  # n: position of EOS
    for words in itertools.product(WORDS, repeat=n - p - 1):
      seq = [0] + list(prompt) + list(words) + [EOS]
      lp = sum(_log_softmax(toy.logits_np(e, seq[:i]))[seq[i]] for i in range(p + 1, n + 1))
      out.append((lp / ((5.0 + n) / 6.0) ** alpha, (seq + [0] * l)[1:l + 1]))
  return sorted(out, key=lambda c: c[0])


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_search_covering_everything_is_exhaustive(alpha):
  b, l = 2, 4
  toy = Toy(20, b, l, eos_bias=-0.5)
  inputs = np.zeros((b, l), np.int32)
  inputs[1, 1] = 3  # a prompt
  # 2k must hold every candidate of the last step: 4^(l-1) live prefixes x 5 tokens.
  k = 5 * 4 ** (l - 1) // 2
  decodes, scores = _beam(toy, num_decodes=k)(inputs, toy.cache(), alpha=alpha)
  decodes, scores = np.asarray(decodes), np.asarray(scores)
  for e in range(b):
    want = _enumerate_finished(toy, e, [3] if e else [], l, alpha)
    got = _real(decodes, scores, e)
    _assert_beams_equal(got, want)  # all of them, in order; the best is last
    assert list(decodes[e, -1]) == want[-1][1]


def test_beam_of_one_is_greedy_on_a_peaked_model():
  rng = np.random.default_rng(8)
  b, l = 6, 7
  toy = Toy(8, b, l, sharp=4.0, eos_bias=2.0)
  inputs = _prompts(rng, b, l, max_prompt=2)
  inputs[inputs == EOS] = 2
  want, want_scores = ref_greedy(toy, inputs)
  assert all(EOS in row for row in want)  # beam search returns finished sequences
  for alpha in (0.0, 0.6):
    decodes, scores = _beam(toy, num_decodes=1)(inputs, toy.cache(), alpha=alpha)
    np.testing.assert_array_equal(decodes[:, 0], want)
    lengths = [list(row).index(EOS) + 1 for row in want]
    np.testing.assert_allclose(
        scores[:, 0], want_scores / ((5.0 + np.array(lengths)) / 6.0) ** alpha, rtol=1e-5,
        atol=1e-4)


def test_beam_search_without_finished_sequences_returns_live_beams():
  b, l, k = 3, 5, 3
  toy = Toy(13, b, l)
  toy.table[:, EOS] = -1e9  # EOS is never predicted
  inputs = np.zeros((b, l), np.int32)
  decodes, scores = _beam(toy, num_decodes=k)(inputs, toy.cache(), alpha=0.6)
  for e in range(b):
    want = ref_beam(toy, e, inputs[e], k, 0.6, l)
    assert len(want) == k and all(EOS not in seq for _, seq in want)
    _assert_beams_equal(_real(np.asarray(decodes), np.asarray(scores), e), want)


@pytest.mark.parametrize("eos_bias", [0.0, -3.0])
def test_beam_search_with_prefilled_cache_equals_forcing_the_prompt(eos_bias):
  """Examples start at different positions, so some reach the end first and must keep
  their beams while the others continue."""
  rng = np.random.default_rng(1)
  b, l = 3, 6
  toy = Toy(1, b, l, eos_bias=eos_bias)
  lengths = np.array([2, 1, 4])
  inputs = np.zeros((b, l), np.int32)
  for e, p in enumerate(lengths):
    inputs[e, 1:1 + p] = rng.integers(2, V, size=p)
  prefixes = [list(inputs[e, :lengths[e]]) for e in range(b)]
  search = _beam(toy, num_decodes=2)
  forced = search(inputs, toy.cache(), alpha=0.6)
  prefilled = search(inputs, toy.cache(prefixes), alpha=0.6, initial_index=lengths)
  np.testing.assert_array_equal(prefilled[0], forced[0])
  np.testing.assert_allclose(prefilled[1], forced[1], rtol=1e-5, atol=1e-4)


def test_position_zero_of_inputs_is_ignored():
  """BOS is fed as 0 whatever inputs[:, 0] holds (T5X without initial_index)."""
  b, l = 3, 6
  toy = Toy(14, b, l, eos_bias=0.5)
  inputs = _prompts(np.random.default_rng(14), b, l, max_prompt=2)
  dirty = inputs.copy()
  dirty[:, 0] = [3, 5, 1]
  for fn in (_sampler(toy, temperature=0.0), _beam(toy, num_decodes=2)):
    np.testing.assert_array_equal(fn(dirty, toy.cache())[0], fn(inputs, toy.cache())[0])


def test_cache_with_a_scanned_layers_axis():
  """cache_offset=1: leaves [layers, batch, ...] are expanded and gathered on axis 1."""
  rng = np.random.default_rng(11)
  b, l = 3, 6
  toy = Toy(11, b, l, eos_bias=0.5)
  inputs = _prompts(rng, b, l, max_prompt=2)
  inputs[inputs == EOS] = 2

  per_example = ("bias", "hist", "count")
  stack = lambda c: dict(c, **{n: jnp.stack([c[n], 2 * c[n]]) for n in per_example})

  def stacked_ttl(state):
    c = state.cache
    layer0 = dict(c, **{n: c[n][0] for n in per_example})  # layer 0 holds the real cache
    del layer0["layer_index"]
    logits, new = toy.tokens_to_logits(decoding.DecodingState(
        cur_index=state.cur_index, sequences=state.sequences, cur_token=state.cur_token,
        cache=layer0))
    return logits, dict(stack(new), layer_index=c["layer_index"] + 1)

  cache = toy.cache()
  # [layers, batch, ...] leaves, and a [layers] leaf shared by all examples.
  stacked = dict(stack(cache), layer_index=jnp.zeros((2,), jnp.int32))
  for fn, kw in ((decoding.beam_search, dict(num_decodes=3, alpha=0.6)),
                 (decoding.temperature_sample, dict(num_decodes=3, temperature=0.0))):
    want = fn(inputs, cache, toy.tokens_to_logits, EOS, **kw)
    got = fn(inputs, stacked, stacked_ttl, EOS, cache_offset=1, **kw)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_brevity_penalty():
  np.testing.assert_allclose(decoding.brevity_penalty(0.6, 7), (12 / 6) ** 0.6, rtol=1e-6)
  assert float(decoding.brevity_penalty(0.0, 100)) == 1.0


# ------------------------------------------------------------------------------------
# Compilation and options
# ------------------------------------------------------------------------------------


def test_traced_options_compile_the_loop_once():
  rng = np.random.default_rng(12)
  b, l = 3, 6
  toy = Toy(12, b, l)
  inputs = _prompts(rng, b, l)
  sample = _sampler(toy, num_decodes=2)
  key = jax.random.PRNGKey(0)
  first = sample(inputs, toy.cache(), decode_rng=key, temperature=0.7, topp=0.9,
                 max_decode_steps=3)
  traces = toy.traces
  assert traces >= 1
  second = sample(inputs, toy.cache(), decode_rng=key, temperature=1.3, topp=0.5,
                  max_decode_steps=5)
  # A traced temperature of 0 takes the greedy branch of the same program.
  greedy = sample(inputs, toy.cache(), decode_rng=key, temperature=0.0, topp=0.0,
                  max_decode_steps=6)
  assert toy.traces == traces
  assert not np.array_equal(first[0], second[0])
  np.testing.assert_array_equal(greedy[0][:, 0], ref_greedy(toy, inputs)[0])

  search = _beam(toy, num_decodes=2)
  search(inputs, toy.cache(), alpha=0.0)
  traces = toy.traces
  search(inputs, toy.cache(), alpha=0.8)
  assert toy.traces == traces


@pytest.mark.parametrize("fn,kw", [
    (decoding.temperature_sample, dict(num_decodes=2, topp=0.9)),
    (decoding.temperature_sample, dict(num_decodes=2, topk=3)),
    (decoding.beam_search, dict(num_decodes=2)),
])
def test_one_device_loop_and_no_host_callbacks(fn, kw):
  toy = Toy(0, 2, 5)
  jaxpr = str(jax.make_jaxpr(
      lambda inputs, cache: fn(inputs, cache, toy.tokens_to_logits, EOS, **kw))(
          np.zeros((2, 5), np.int32), toy.cache()))
  assert jaxpr.count("while[") == 1
  assert "callback" not in jaxpr


@pytest.mark.parametrize("fn,kw,message", [
    (decoding.temperature_sample, dict(temperature=-0.5), "temperature=-0.5"),
    (decoding.temperature_sample, dict(temperature=np.array([1.0, -1.0])), "negative"),
    (decoding.temperature_sample, dict(topk=-1), "topk=-1"),
    (decoding.temperature_sample, dict(topk=2.5), "topk=2.5"),
    (decoding.temperature_sample, dict(topp=1.5), "topp=1.5"),
    (decoding.temperature_sample, dict(num_decodes=0), "num_decodes=0"),
    (decoding.temperature_sample, dict(max_decode_steps=0), "max_decode_steps=0"),
    (decoding.temperature_sample, dict(max_decode_steps=9), "exceeds the decode length 4"),
    (decoding.beam_search, dict(num_decodes=0), "beam size"),
    (decoding.beam_search, dict(max_decode_len=0), "max_decode_len=0"),
])
def test_bad_options_are_user_errors(fn, kw, message):
  toy = Toy(0, 2, 4)
  with pytest.raises(UserError, match=message) as info:
    fn(np.zeros((2, 4), np.int32), toy.cache(), toy.tokens_to_logits, EOS, **kw)
  assert "\n" not in str(info.value)


def test_cache_without_batch_axis_is_rejected():
  toy = Toy(0, 2, 4)
  cache = dict(toy.cache(), bad=jnp.zeros((3, 2)))
  with pytest.raises(ValueError, match=r"\['bad'\].*axis 0 must be the batch \(2\)"):
    decoding.beam_search(np.zeros((2, 4), np.int32), cache, toy.tokens_to_logits, EOS)
