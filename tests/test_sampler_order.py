"""Sampling filters in the order of transformers' `generate` and vLLM: temperature, top-k,
then top-p over what top-k kept (renormalised). Each path (the engine's per-row filter,
`temperature_sample`'s static one, the engine's sampler) is checked against
transformers' logits warpers. No model is compiled."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from t5forge import decoding, sampling
from t5forge.engine import slots

torch = pytest.importorskip("torch")
warpers = pytest.importorskip("transformers.generation.logits_process")

V = 50
DRAWS = 20000  # one shape: the engine's sampler compiles once
ROWS = np.random.default_rng(0).normal(0.0, 2.0, (20, V)).astype(np.float32)  # [20, v]
# (temperature, top_k, top_p); 0 and 1 switch a filter off.
CASES = [(1.0, 0, 0.9), (0.7, 10, 1.0), (1.0, 10, 0.8), (1.5, 5, 0.5), (0.5, 20, 0.95),
         (1.0, 3, 0.3), (2.0, 30, 0.7), (0.8, 1, 0.9)]
filter_rows = jax.jit(sampling.filter_rows)
filter_static = jax.jit(functools.partial(sampling.filter_static, use_topp=True),
                        static_argnums=1)
sample_tokens = jax.jit(slots.sample_tokens)  # the engine's sampler, as its step calls it


def engine_draws(row, n, seed, temperature, top_k, top_p):
  """n tokens drawn from logits row [v] by the engine's sampler, as n requests with seed
  `seed` and samples 0..n-1 at their first token (each its own key) -> [n] int."""
  keys = jax.vmap(lambda j: jax.random.key_data(jax.random.fold_in(jax.random.key(seed), j)))(
      jnp.arange(n))  # [n, 2]: the slot keys the engine's insert sets
  logits = jnp.broadcast_to(jnp.asarray(row), (n, V))
  tokens, _ = sample_tokens(logits, jax.nn.log_softmax(logits), keys, jnp.zeros((n,), jnp.int32),
                            jnp.full((n,), temperature, jnp.float32),
                            jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32),
                            jnp.ones((n,), bool))
  return np.asarray(tokens)


def hf_filter(rows, temperature, top_k, top_p):
  """transformers' warpers in `generate`'s order: rows [f, v] -> filtered logits [f, v]."""
  ids = torch.zeros((rows.shape[0], 1), dtype=torch.long)
  x = warpers.TemperatureLogitsWarper(temperature)(ids, torch.from_numpy(rows.copy()))
  if top_k:
    x = warpers.TopKLogitsWarper(top_k)(ids, x)
  if top_p < 1:
    x = warpers.TopPLogitsWarper(top_p)(ids, x)
  return x.numpy()


def ours(path, rows, temperature, top_k, top_p):
  """One of our filters: rows [f, v] -> filtered logits [f, v]."""
  scaled = jnp.asarray(rows) / temperature
  f = rows.shape[0]
  if path == "rows":  # the engine's: per-row options
    return np.asarray(filter_rows(scaled, jnp.full((f,), top_k, jnp.int32),
                                  jnp.full((f,), top_p, jnp.float32)))
  return np.asarray(filter_static(scaled, top_k, jnp.float32(top_p)))


def softmax(x):
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("path", ["rows", "static"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kept_tokens_and_probabilities_equal_transformers(path, case):
  want = hf_filter(ROWS, *case)
  got = ours(path, ROWS, *case)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=str(case))
  np.testing.assert_allclose(softmax(got), softmax(want), rtol=0, atol=1e-6)


def test_engine_sampler_histogram_fits_transformers():
  temperature, top_k, top_p, n = 0.8, 12, 0.85, DRAWS
  row = ROWS[3]
  want = softmax(hf_filter(row[None], temperature, top_k, top_p))[0]  # [v]
  support = want > 0
  assert 3 <= support.sum() < top_k  # both filters cut here
  counts = np.bincount(engine_draws(row, n, 7, temperature, top_k, top_p), minlength=V)
  assert counts[~support].sum() == 0
  expected = n * want[support].astype(np.float64) / want[support].sum(dtype=np.float64)
  assert expected.min() >= 5  # chi-square's approximation holds
  assert stats.chisquare(counts[support], expected).pvalue > 1e-3


def _long_tail_row():
  """Three tokens with 0.3, 0.2, 0.1 and 47 sharing 0.4 (logits [v]), and their ids."""
  top = np.array([7, 23, 41])
  probs = np.full(V, 0.4 / (V - 3))
  probs[top] = [0.3, 0.2, 0.1]
  return np.log(probs).astype(np.float32), top


def test_top_p_counts_only_what_top_k_kept():
  """top_k 3 then top_p 0.7: renormalised, the three are 0.5, 0.33, 0.17, so top-p keeps
  two; top-p over the whole row would need all three (and 12 tail tokens) to reach 0.7."""
  row, top = _long_tail_row()
  old = np.isfinite(ours("rows", row[None], 1.0, 0, 0.7)[0]) & np.isin(np.arange(V), top)
  assert set(np.flatnonzero(old)) == set(top)  # the cut of the former order
  want = set(np.flatnonzero(np.isfinite(hf_filter(row[None], 1.0, 3, 0.7)[0])))
  assert want == set(top[:2])
  for path in ("rows", "static"):
    assert set(np.flatnonzero(np.isfinite(ours(path, row[None], 1.0, 3, 0.7)[0]))) == want
  # The engine's sampler never draws the third token (1 in 6 draws under the former order).
  assert set(engine_draws(row, DRAWS, 1, 1.0, 3, 0.7).tolist()) == want


def test_temperature_sample_takes_top_k_with_top_p():
  """The pair T5X refused: one sampled step of `temperature_sample` draws from top-k then
  top-p's set, and scores tokens under that renormalised distribution."""
  row, top = _long_tail_row()
  ttl = lambda s: (jnp.broadcast_to(jnp.asarray(row), (s.cur_token.shape[0], V)), s.cache)
  decodes, scores = decoding.temperature_sample(
      jnp.zeros((1, 1), jnp.int32), {}, ttl, eos_id=1, decode_rng=jax.random.PRNGKey(0),
      num_decodes=64, topk=3, topp=0.7)
  drawn = np.asarray(decodes)[0, :, 0]
  assert set(drawn.tolist()) == set(top[:2])
  np.testing.assert_allclose(np.asarray(scores)[0],
                             np.sort(np.log(np.where(drawn == top[0], 0.6, 0.4))), atol=1e-5)
