"""Semantics of the networks that parity with HF does not reach: packing, prefix-LM,
padding invariance, dropout, config validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import t5forge
from t5forge.errors import UserError
from t5forge.nn import ModelConfig, build, init_params
from t5forge.nn.attention import relative_position_bucket

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

CFG = ModelConfig(vocab_size=97, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                  num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1)
DEC_ONLY = CFG.replace(architecture="decoder_only", num_encoder_layers=0)


def _apply(cfg, params, *args, **kw):
  return np.asarray(build(cfg).apply({"params": params}, *args, **kw))


def test_packed_rows_equal_separate_examples_encoder_decoder():
  params = init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  inputs = [rng.integers(1, 97, n) for n in (5, 7)]
  targets = [rng.integers(1, 97, n) for n in (4, 3)]
  # Packed: both examples in one row, then padding.
  enc = np.zeros((1, 16), np.int32); enc_seg = np.zeros_like(enc)
  dec_in = np.zeros((1, 10), np.int32); dec_tgt = np.zeros_like(dec_in); dec_seg = np.zeros_like(dec_in)
  e = d = 0
  for s, (x, y) in enumerate(zip(inputs, targets), start=1):
    enc[0, e:e + len(x)] = x; enc_seg[0, e:e + len(x)] = s; e += len(x)
    dec_tgt[0, d:d + len(y)] = y; dec_seg[0, d:d + len(y)] = s
    dec_in[0, d + 1:d + len(y)] = y[:-1]  # shifted right within the segment, 0 as BOS
    d += len(y)
  packed = _apply(CFG, params, enc, dec_in, encoder_segment_ids=enc_seg,
                  decoder_segment_ids=dec_seg)
  d = 0
  for x, y in zip(inputs, targets):
    single = _apply(CFG, params, x[None].astype(np.int32),
                    np.concatenate([[0], y[:-1]])[None].astype(np.int32))
    np.testing.assert_allclose(packed[0, d:d + len(y)], single[0], rtol=1e-5, atol=1e-5)
    d += len(y)


def test_packed_rows_equal_separate_examples_decoder_only():
  params = init_params(DEC_ONLY, jax.random.key(1))
  rng = np.random.default_rng(1)
  seqs = [rng.integers(1, 97, n) for n in (6, 4)]
  tokens = np.zeros((1, 12), np.int32); seg = np.zeros_like(tokens)
  p = 0
  for s, x in enumerate(seqs, start=1):
    tokens[0, p + 1:p + len(x)] = x[:-1]; seg[0, p:p + len(x)] = s; p += len(x)
  packed = _apply(DEC_ONLY, params, tokens, decoder_segment_ids=seg)
  p = 0
  for x in seqs:
    single = _apply(DEC_ONLY, params, np.concatenate([[0], x[:-1]])[None].astype(np.int32))
    np.testing.assert_allclose(packed[0, p:p + len(x)], single[0], rtol=1e-5, atol=1e-5)
    p += len(x)


def test_prefix_lm_is_bidirectional_over_the_prefix_only():
  params = init_params(DEC_ONLY, jax.random.key(2))
  tokens = np.arange(1, 9, dtype=np.int32)[None]
  prefix = np.array([[1, 1, 1, 1, 0, 0, 0, 0]], np.int32)
  changed_prefix = tokens.copy(); changed_prefix[0, 2] = 50
  changed_suffix = tokens.copy(); changed_suffix[0, 6] = 50
  base = _apply(DEC_ONLY, params, tokens, decoder_causal_attention=prefix)
  a = _apply(DEC_ONLY, params, changed_prefix, decoder_causal_attention=prefix)
  b = _apply(DEC_ONLY, params, changed_suffix, decoder_causal_attention=prefix)
  assert not np.allclose(a[0, 0], base[0, 0])  # position 0 sees prefix position 2
  np.testing.assert_allclose(b[0, :6], base[0, :6], rtol=1e-6)  # causal after the prefix
  causal = _apply(DEC_ONLY, params, changed_prefix)
  np.testing.assert_allclose(causal[0, :2], _apply(DEC_ONLY, params, tokens)[0, :2], rtol=1e-6)


def test_encoder_padding_does_not_change_real_positions():
  m = t5forge.init(CFG)
  enc = np.array([[5, 6, 7, 8]], np.int32)
  dec = np.array([[0, 3, 4]], np.int32)
  padded = np.array([[5, 6, 7, 8, 0, 0, 0]], np.int32)
  np.testing.assert_allclose(m.logits(enc, dec), m.logits(padded, dec), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m.encode(enc)[0], m.encode(padded)[0, :4], rtol=1e-5, atol=1e-6)


def test_dropout_is_off_by_default_and_keyed_when_on():
  params = init_params(CFG, jax.random.key(3))
  enc = np.ones((2, 6), np.int32); dec = np.ones((2, 5), np.int32)
  base = _apply(CFG, params, enc, dec)
  np.testing.assert_array_equal(base, _apply(CFG, params, enc, dec))
  on = lambda k: _apply(CFG, params, enc, dec, enable_dropout=True,
                        rngs={"dropout": jax.random.key(k)})
  np.testing.assert_array_equal(on(0), on(0))
  assert not np.allclose(on(0), on(1)) and not np.allclose(on(0), base)


def test_relative_buckets_match_t5_definition():
  # Worked by hand from T5's definition: 8 exact buckets per direction (16 causal), then
  # max_exact + floor(log(n / max_exact) / log(max_distance / max_exact) * (buckets - max_exact)),
  # capped; e.g. n=20 bidirectional: 8 + floor(log(2.5) / log(16) * 8) = 10.
  rp = jnp.array([-200, -128, -20, -8, -1, 0, 1, 7, 8, 20, 128, 200])
  bi = np.asarray(relative_position_bucket(rp, bidirectional=True, num_buckets=32,
                                           max_distance=128))
  np.testing.assert_array_equal(bi, [15, 15, 10, 8, 1, 0, 17, 23, 24, 26, 31, 31])
  causal = np.asarray(relative_position_bucket(rp, bidirectional=False, num_buckets=32,
                                               max_distance=128))
  np.testing.assert_array_equal(causal, [31, 31, 17, 8, 1, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("bad,field", [
    (dict(emb_dim=0), "emb_dim"), (dict(dtype="float16"), "dtype"),
    (dict(mlp_activations=("swish",)), "mlp_activations"),
    (dict(remat_policy="some"), "remat_policy"), (dict(num_encoder_layers=0), "num_encoder_layers")])
def test_invalid_config_names_the_field(bad, field):
  with pytest.raises(UserError, match=field):
    CFG.replace(**bad)


def test_logits_rejects_bad_arrays():
  m = t5forge.init(CFG)
  with pytest.raises(UserError, match="ids outside"):
    m.logits(np.array([[1, 200]]), np.array([[0, 1]]))
  with pytest.raises(UserError, match="integer array"):
    m.logits(np.ones((1, 3), np.float32), np.array([[0, 1]]))
  with pytest.raises(UserError, match="two arrays"):
    m.logits(np.array([[0, 1]]))
