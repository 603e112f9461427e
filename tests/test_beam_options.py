"""Beam search options as T5X has them: max_decode_steps, min_log_prob,
an EOS forced inside the prompt, and the Generator.predict / CLI wiring of those options.

The logits come from fixed tables (as T5X's decoding_test.py does), so every expected
sequence and score below follows by hand from the table.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import t5forge
from t5forge import decoding
from t5forge.cli import decode_flags
from t5forge.errors import UserError
from t5forge.predict import DecodeOptions

EOS = 1
NEVER = -1e10  # a logit no beam takes (T5X's tests give EOS this to keep beams live)


def _lsm(x):
  return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32)))


def _table_ttl(table, k):
  """tokens_to_logits reading logits [b, positions, v] at each row's cur_index."""
  table = jnp.asarray(table, jnp.float32)

  def ttl(state):
    rows = jnp.repeat(table, k, axis=0)  # [f, positions, v], beams of an example adjacent
    return jnp.take_along_axis(rows, state.cur_index[:, None, None], axis=1)[:, 0], state.cache
  return ttl


# T5X's test_beam_search_min_log_prob / test_beam_search_max_decode_step table: one row
# of logits per example, the same at every position. PAD 0, EOS 1, words 2 and 3.
T5X_LOGITS = np.array([[-1e7, NEVER, -0.1, -0.9], [-1e7, NEVER, -0.9, -0.1]], np.float32)


def test_min_log_prob_stops_after_the_first_step_t5x_example():
  """T5X's documented example: min_log_prob=-0.05 and every first token below it."""
  table = np.repeat(T5X_LOGITS[:, None], 6, axis=1)
  decodes, scores = decoding.beam_search(np.zeros((2, 5), np.int32), {}, _table_ttl(table, 2),
                                         EOS, num_decodes=2, min_log_prob=-0.05)
  np.testing.assert_array_equal(decodes, [[[3, 0, 0, 0, 0], [2, 0, 0, 0, 0]],
                                          [[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]]])
  lsm = _lsm(T5X_LOGITS)
  # No EOS: the live beams come back with their raw log-probs, best last.
  np.testing.assert_allclose(scores, [[lsm[0, 3], lsm[0, 2]], [lsm[1, 2], lsm[1, 3]]], rtol=1e-6)


def test_min_log_prob_stops_each_example_when_its_best_beam_falls_below():
  # Example 0's best beam loses ~0.371 a step: -0.371, -0.742, -1.113 < -1 after 3 tokens.
  # Example 1's best beam loses ~0.0067 a step and never falls below -1.
  logits = np.array([[-1e7, NEVER, -0.1, -0.9], [-1e7, NEVER, 0.0, -5.0]], np.float32)
  table = np.repeat(logits[:, None], 7, axis=1)
  lsm = _lsm(logits)
  assert 3 * lsm[0, 2] < -1.0 < 2 * lsm[0, 2] and 6 * lsm[1, 2] > -1.0
  search = jax.jit(lambda inputs, m: decoding.beam_search(
      inputs, {}, _table_ttl(table, 2), EOS, num_decodes=2, min_log_prob=m))
  decodes, scores = search(np.zeros((2, 6), np.int32), -1.0)
  np.testing.assert_array_equal(decodes[0, -1], [2, 2, 2, 0, 0, 0])
  np.testing.assert_allclose(scores[0, -1], 3 * lsm[0, 2], rtol=1e-6)
  np.testing.assert_array_equal(decodes[1, -1], [2, 2, 2, 2, 2, 2])
  # Traced: another threshold, same program; -inf never stops.
  decodes, _ = search(np.zeros((2, 6), np.int32), -np.inf)
  np.testing.assert_array_equal(decodes[:, -1], [[2] * 6, [2] * 6])
  assert search._cache_size() == 1


# Logits per position for one example (PAD 0, EOS 1, words 2, 3, 4), chosen so that no
# two two-token sequences tie: position 0 prefers 2 then 3, position 1 prefers 4 then 2.
STEP_TABLE = np.array([[[-1e7, NEVER, 0.0, -0.7, -2.0],
                        [-1e7, NEVER, -0.4, -3.0, 0.0]] + [[-1e7, NEVER, 0.0, 0.0, 0.0]] * 5])


def test_max_decode_steps_returns_that_many_tokens_then_padding():
  lsm = _lsm(STEP_TABLE[0])
  search = jax.jit(lambda inputs, steps: decoding.beam_search(
      inputs, {}, _table_ttl(STEP_TABLE, 2), EOS, num_decodes=2, alpha=0.6,
      max_decode_steps=steps))
  decodes, scores = search(np.zeros((1, 6), np.int32), 2)
  # Best: 2 then 4; second: 2 then 2 (-0.4 - ...) beats 3 then 4 (-0.7 - ...).
  best, second = lsm[0, 2] + lsm[1, 4], lsm[0, 2] + lsm[1, 2]
  assert second > lsm[0, 3] + lsm[1, 4]
  np.testing.assert_array_equal(decodes[0], [[2, 2, 0, 0, 0, 0], [2, 4, 0, 0, 0, 0]])
  np.testing.assert_allclose(scores[0], [second, best], rtol=1e-6)
  # One step, traced: the same compiled loop.
  decodes, _ = search(np.zeros((1, 6), np.int32), 1)
  np.testing.assert_array_equal(decodes[0], [[3, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]])
  assert search._cache_size() == 1
  # The steps count after a forced prompt: [0, 3] + 2 steps -> 3, x, y.
  decodes, _ = search(np.array([[0, 3, 0, 0, 0, 0]], np.int32), 2)
  assert list(decodes[0, -1, :1]) == [3] and decodes[0, -1, 1:3].all()
  assert not decodes[0, :, 3:].any()
  with pytest.raises(UserError, match="max_decode_steps=0 must be >= 1"):
    decoding.beam_search(np.zeros((1, 6), np.int32), {}, _table_ttl(STEP_TABLE, 2), EOS,
                         num_decodes=2, max_decode_steps=0)


def test_a_forced_eos_in_the_prompt_ends_the_beam():
  """T5X's beam search ends a beam at any EOS written, forced ones included: the prompt
  up to its EOS is finished with log-prob 0 and nothing after it is decoded."""
  # [2 examples, 7 positions, 5 tokens]: word 2 is the best everywhere, EOS never generated.
  table = np.tile(np.array([-1e7, NEVER, 0.0, -0.7, -2.0], np.float32), (2, 7, 1))
  inputs = np.array([[0, 3, EOS, 4, 0, 0], [0, 3, 4, 0, 0, 0]], np.int32)
  decodes, scores = decoding.beam_search(inputs, {}, _table_ttl(table, 2), EOS, num_decodes=2,
                                         alpha=0.6)
  np.testing.assert_array_equal(decodes[0, -1], [3, EOS, 0, 0, 0, 0])
  assert float(scores[0, -1]) == 0.0
  # Without an EOS the prompt is forced and the rest decoded (2 is the best word).
  np.testing.assert_array_equal(decodes[1, -1], [3, 4, 2, 2, 2, 2])


@pytest.mark.slow
def test_predict_honours_max_decode_steps_for_every_method():
  m = t5forge.init("t5_1_1.tiny", vocab_size=64)
  enc = np.random.default_rng(0).integers(2, 64, size=(3, 8)).astype(np.int32)
  full, _ = m.predict(enc, max_decode_length=8, method="beam", num_decodes=2)
  assert (full[:, 2:] != 0).any()  # without the option the decodes are longer
  for kw in (dict(method="beam", num_decodes=2), dict(method="greedy"),
             dict(method="sample", temperature=1.0, num_decodes=2)):
    tokens, _ = m.predict(enc, max_decode_length=8, max_decode_steps=2, **kw)
    assert tokens.shape == (3, 8) and not tokens[:, 2:].any(), kw
    assert tokens[:, 0].all(), kw
  short, _ = m.predict(enc, max_decode_length=8, method="beam", num_decodes=2,
                       max_decode_steps=2, return_all_decodes=True)
  assert not short[:, :, 2:].any()


@pytest.mark.slow
def test_predict_honours_max_decode_steps_for_decoder_only_prompts():
  """Decoder-only prompts are right-aligned and prefilled: the steps count after them."""
  m = t5forge.init("decoder_only.tiny", vocab_size=64)
  prompts = np.array([[0, 5, 6, 7, 0, 0], [0, 9, 0, 0, 0, 0]], np.int32)
  for kw in (dict(method="beam", num_decodes=2), dict(method="greedy")):
    tokens, _ = m.predict(prompts, max_decode_length=6, max_decode_steps=3, **kw)
    assert not tokens[:, 3:].any() and tokens[:, 0].all(), kw


def test_min_log_prob_through_predict_and_the_cli_flag():
  m = t5forge.init("t5_1_1.tiny", vocab_size=64)
  enc = np.random.default_rng(1).integers(2, 64, size=(2, 8)).astype(np.int32)
  # Every token of a random 64-word model costs about log(64) > 1 nat: one step, then stop.
  tokens, _ = m.predict(enc, max_decode_length=8, method="beam", num_decodes=2,
                        min_log_prob=-1.0)
  assert tokens[:, 0].all() and not tokens[:, 1:].any()
  parser = argparse.ArgumentParser()
  decode_flags.add(parser)
  opts = decode_flags.options(parser.parse_args(["--beam_size", "3", "--min_log_prob", "-2.5"]))
  assert (opts.method, opts.num_decodes, opts.min_log_prob) == ("beam", 3, -2.5)


@pytest.mark.parametrize("kw,text", [
    (dict(method="sample", min_log_prob=-1.0), "min_log_prob=-1.0 applies to beam search only"),
    (dict(method="greedy", min_log_prob=-1.0), "min_log_prob=-1.0 applies to beam search only"),
    (dict(method="beam", max_decode_steps=0), "max_decode_steps must be >= 1"),
    (dict(temperature=0.5, min_log_prob=-3.0), "not method 'sample'"),
])
def test_bad_beam_options_give_one_line(kw, text):
  with pytest.raises(UserError, match=text) as info:
    DecodeOptions.from_kwargs(**kw)
  assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_1_1.tiny", "decoder_only.tiny"])
def test_beam_token_log_probs_equal_teacher_forcing_and_sum_to_the_score(name):
  """`Generator.generate` with beams carries each token's log-prob with its beam: they
  equal the teacher-forced log-softmax of `Model.logits` on the beam's own tokens, the
  top alternatives are that distribution's best, and their sum is the beam's log-prob
  (its score times T5X's brevity penalty)."""
  from t5forge.generation import Generator, Kind
  m = t5forge.init(name, vocab_size=64, seed=4)
  g = Generator(m.model, m.params)
  rng = np.random.default_rng(2)
  b, k, length = 3, 3, 6
  x = np.zeros((b, 7), np.int32)
  for r in range(b):
    n = 3 + r
    if m.config.is_encoder_decoder:
      x[r, :n], x[r, n] = rng.integers(2, 64, n), EOS
    else:
      x[r, 1:1 + n] = rng.integers(2, 64, n)
  for alpha in (0.0, 0.6):
    out = g.generate(Kind("beam", num_decodes=k, top_logprobs=2), x, decode_length=length,
                     max_new_tokens=np.full((b,), length, np.int32), temperature=0.0,
                     topp=0.0, alpha=alpha)
    for r in range(b):
      for j in range(k):
        toks, n = out.tokens[r, j], int(out.lengths[r, j])
        if m.config.is_encoder_decoder:
          dec_in = np.concatenate([[0], toks[:-1]])[None].astype(np.int32)
          logits = m.logits(x[r:r + 1], dec_in)[0]  # [l, v]
          positions = np.arange(length)
        else:
          prompt = [int(t) for t in x[r] if t]
          seq = np.array([[0] + prompt + toks.tolist()], np.int32)
          logits = m.logits(seq[:, :-1])[0]  # causal over the prompt too, as it decodes
          positions = len(prompt) + np.arange(length)
        lsm = _lsm(logits)[positions]  # [l, v]: the distribution each new token came from
        want = lsm[np.arange(length), toks] * (np.arange(length) < n)
        np.testing.assert_allclose(out.token_logprobs[r, j], want, atol=2e-5)
        best = np.argsort(-lsm[:n], axis=-1)[:, :2]
        np.testing.assert_array_equal(out.top_ids[r, j, :n], best)
        np.testing.assert_allclose(out.top_logprobs[r, j, :n],
                                   np.take_along_axis(lsm[:n], best, -1), atol=2e-5)
        total = float(out.token_logprobs[r, j].sum())
        if out.finished[r, j]:
          prompt_len = 0 if m.config.is_encoder_decoder else len([t for t in x[r] if t])
          penalty = ((5.0 + prompt_len + n) / 6.0) ** alpha
          np.testing.assert_allclose(total, out.scores[r, j] * penalty, rtol=1e-5)


@pytest.mark.slow
def test_min_log_prob_per_row_in_generate():
  """`Generator.generate(min_log_prob=[b])` stops each row at its own threshold, as
  `Model.predict` does for the whole batch with one."""
  from t5forge.generation import Generator, Kind
  m = t5forge.init("t5_1_1.tiny", vocab_size=64)
  enc = np.random.default_rng(1).integers(2, 64, size=(2, 8)).astype(np.int32)
  g = Generator(m.model, m.params)
  out = g.generate(Kind("beam", num_decodes=2), enc, decode_length=8,
                   max_new_tokens=np.full((2,), 8, np.int32), temperature=0.0, topp=0.0,
                   min_log_prob=np.array([-1.0, -np.inf], np.float32))
  stopped, _ = m.predict(enc[:1], max_decode_length=8, method="beam", num_decodes=2,
                         min_log_prob=-1.0, return_all_decodes=True)
  full, _ = m.predict(enc[1:], max_decode_length=8, method="beam", num_decodes=2,
                      return_all_decodes=True)
  np.testing.assert_array_equal(out.tokens[0], stopped[0])
  np.testing.assert_array_equal(out.tokens[1], full[0])
  assert int(out.lengths[0, -1]) == 1 and int(out.lengths[1, -1]) > 1
  with pytest.raises(UserError, match="beam search only"):
    g.generate(Kind("greedy"), enc, decode_length=8, max_new_tokens=np.full((2,), 8, np.int32),
               temperature=0.0, topp=0.0, min_log_prob=-1.0)
