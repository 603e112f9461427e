"""Losses, loss normalisation, Adafactor and schedules against values computed by hand
in numpy; microbatching against the full batch."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5forge import losses
from t5forge.models import EncoderDecoderModel
from t5forge.nn import ModelConfig, init_params, logical_axes
from t5forge.train import optim
from t5forge.train.state import create
from t5forge.train.step import make_train_step

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

RNG = np.random.default_rng(0)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _batch(b=2, t=5, v=7):
  logits = RNG.normal(size=(b, t, v)).astype(np.float32) * 3
  targets = RNG.integers(1, v, size=(b, t)).astype(np.int32)
  targets[0, 3:] = 0  # padding
  return logits, targets


def test_cross_entropy_z_loss_and_label_smoothing_by_hand():
  logits, targets = _batch()
  weights = (targets > 0).astype(np.float32)
  v = logits.shape[-1]
  for ls, z in ((0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)):
    lsm = _log_softmax(logits.astype(np.float64))
    soft = np.full(logits.shape, ls / (v - 1)); np.put_along_axis(soft, targets[..., None], 1 - ls, -1)
    log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    const = -((1 - ls) * np.log(1 - ls) + ls * np.log(ls / (v - 1) + 1e-20)) if ls else 0.0
    per_tok = -(soft * lsm).sum(-1) + z * log_z ** 2 - const
    want_loss = (per_tok * weights).sum()
    want_z = (z * log_z ** 2 * weights).sum()
    loss, z_loss, wsum = losses.compute_weighted_cross_entropy(
        jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), label_smoothing=ls, z_loss=z)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(z_loss, want_z, rtol=1e-5, atol=1e-7)
    assert float(wsum) == weights.sum()


def test_z_loss_custom_gradient_equals_autodiff():
  logits, targets = _batch()
  onehot = jax.nn.one_hot(targets, logits.shape[-1])

  def plain(lg):
    lse = jax.scipy.special.logsumexp(lg, axis=-1)
    return jnp.sum(-jnp.sum(onehot * (lg - lse[..., None]), -1) + 1e-2 * lse ** 2)

  custom = lambda lg: jnp.sum(losses.cross_entropy_with_logits(lg, onehot, 1e-2)[0])
  np.testing.assert_allclose(jax.grad(custom)(jnp.asarray(logits)),
                             jax.grad(plain)(jnp.asarray(logits)), rtol=1e-5, atol=1e-6)


def test_loss_normalizing_factors():
  targets = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
  batch = {"decoder_target_tokens": jnp.asarray(targets)}
  f, w = losses.normalizing_factor_and_weights(losses.LossNormalizingFactor.NUM_REAL_TARGET_TOKENS, batch)
  assert float(f) == 5 and np.array_equal(w, targets > 0)
  f, _ = losses.normalizing_factor_and_weights("NUM_TOTAL_TARGET_TOKENS", batch)
  assert float(f) == 8
  f, w = losses.normalizing_factor_and_weights("AVERAGE_PER_SEQUENCE", batch)
  assert float(f) == 2
  np.testing.assert_allclose(w, [[1 / 3, 1 / 3, 1 / 3, 0], [0.5, 0.5, 0, 0]])
  # Packed: per segment, not per row. Row 0 holds segments of 2 and 1 tokens.
  packed = {"decoder_target_tokens": jnp.asarray([[5, 6, 7, 0]]),
            "decoder_segment_ids": jnp.asarray([[1, 1, 2, 0]]),
            "decoder_positions": jnp.asarray([[0, 1, 0, 0]])}
  f, w = losses.normalizing_factor_and_weights("AVERAGE_PER_SEQUENCE", packed)
  assert float(f) == 2
  np.testing.assert_allclose(w, [[0.5, 0.5, 1.0, 0.0]])
  assert losses.normalizing_factor_and_weights(233472, batch)[0] == 233472


def _adafactor_by_hand(p, g, *, lr, step, factored_dims=None, decay_rate=0.8, eps1=1e-30,
                       eps2=1e-3, clip=1.0):
  """One Adafactor update from zero statistics, written out from the paper / T5X."""
  decay = 1 - (step + 1.0) ** -decay_rate
  mix = 1 - decay
  scale = max(np.sqrt(np.mean(p * p)), eps2)
  g2 = g * g + eps1
  if factored_dims:
    row, col = factored_dims
    v_row = mix * g2.mean(axis=col)
    v_col = mix * g2.mean(axis=row)
    # The paper's rank-1 estimate: V = R C / sum(R), with R and C per-row / per-column means.
    v_hat = np.expand_dims(v_row, col) * np.expand_dims(v_col, row) / v_row.mean()
  else:
    v_hat = mix * g2
  y = g / np.sqrt(v_hat)
  y = y / max(1.0, np.sqrt(np.mean(y * y)) / clip)
  return p - lr * scale * y


@pytest.mark.parametrize("shape,factored", [((4, 3), None), ((128, 256), (0, 1)), ((256, 128), (1, 0))])
def test_adafactor_one_update_by_hand(shape, factored):
  p = RNG.normal(size=shape).astype(np.float32)
  g = RNG.normal(size=shape).astype(np.float32)
  tx = optim.adafactor(0.01)
  state = tx.init({"w": jnp.asarray(p)})
  state = optim.set_step(state, 5)  # decay depends on the step
  upd, new_state = tx.update({"w": jnp.asarray(g)}, state, {"w": jnp.asarray(p)})
  got = np.asarray(optax.apply_updates({"w": jnp.asarray(p)}, upd)["w"])
  want = _adafactor_by_hand(p.astype(np.float64), g.astype(np.float64), lr=0.01, step=5,
                            factored_dims=factored)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  if factored:
    assert new_state.v["w"].shape == (1,) and new_state.v_row["w"].ndim == 1
  else:
    assert new_state.v["w"].shape == shape and new_state.v_row["w"].shape == (1,)
  assert int(new_state.count) == 6


def test_scanned_adafactor_matches_per_layer():
  """Stacked (scanned) parameters get per-layer statistics, scales and clipping."""
  layers = [RNG.normal(size=(128, 256)).astype(np.float32) * s for s in (1.0, 5.0)]
  grads = [RNG.normal(size=(128, 256)).astype(np.float32) * s for s in (1.0, 0.1)]
  per_layer = optim.adafactor(0.01)
  want = []
  for p, g in zip(layers, grads):
    st = per_layer.init({"w": jnp.asarray(p)})
    want.append(np.asarray(per_layer.update({"w": jnp.asarray(g)}, st, {"w": jnp.asarray(p)})[0]["w"]))
  stacked = optim.adafactor(0.01, param_axes={"w": ("layers", "embed", "mlp")})
  P, G = jnp.asarray(np.stack(layers)), jnp.asarray(np.stack(grads))
  st = stacked.init({"w": P})
  assert st.v_row["w"].shape == (2, 128) and st.v_col["w"].shape == (2, 256)
  got = np.asarray(stacked.update({"w": G}, st, {"w": P})[0]["w"])
  np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-8)


def test_learning_rate_factors():
  f = optim.create_learning_rate_scheduler("constant * linear_warmup * rsqrt_decay",
                                           base_learning_rate=1.0, warmup_steps=100)
  np.testing.assert_allclose([f(0), f(50), f(100), f(400)], [0.0 + 1e-8, 0.05, 0.1, 0.05], rtol=1e-5)
  c = optim.create_learning_rate_scheduler("constant * cosine_decay", base_learning_rate=2.0,
                                           warmup_steps=0, steps_per_cycle=100)
  # float32 cosine near pi: relative error ~1e-4 of a small value.
  np.testing.assert_allclose([c(0), c(50), c(99)], [2.0, 1.0, 2.0 * 0.5 * (1 + np.cos(np.pi * 0.99))],
                             rtol=1e-4)
  with pytest.raises(Exception, match="unknown"):
    optim.create_learning_rate_scheduler("constant * warmdown")


def test_microbatches_equal_full_batch():
  cfg = ModelConfig(vocab_size=50, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                    num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
  params = init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(1)
  batch = {"encoder_input_tokens": rng.integers(1, 50, (8, 6)).astype(np.int32),
           "decoder_target_tokens": rng.integers(1, 50, (8, 5)).astype(np.int32)}
  batch["decoder_target_tokens"][:, 3:] *= rng.integers(0, 2, (8, 2)).astype(np.int32)
  batch["decoder_input_tokens"] = np.pad(batch["decoder_target_tokens"][:, :-1], ((0, 0), (1, 0)))
  batch["decoder_loss_weights"] = (batch["decoder_target_tokens"] > 0).astype(np.float32)
  for lnf in (None, "NUM_REAL_TARGET_TOKENS", "AVERAGE_PER_SEQUENCE"):
    model = EncoderDecoderModel(cfg, loss_normalizing_factor=lnf)
    tx = optim.adafactor(0.1, param_axes=jax.tree.map(tuple, logical_axes(cfg),
                                                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    results = []
    for k in (1, 4):
      step = jax.jit(make_train_step(model, tx, num_microbatches=k))
      state, sums = step(create(params, tx), batch)
      results.append((state, sums))
    (s1, m1), (s4, m4) = results
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), s1.params, s4.params)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["accuracy_correct"], m4["accuracy_correct"])
