"""LoRA numerics: a fresh adapter changes nothing, storage dtypes of the frozen base, the
merge, and the adapter's gradient through our hand-written matmul rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge import models, presets
from t5forge.errors import UserError
from t5forge.nn import adapters, lora, matmul, quant
from t5forge.nn.lora import LoraConfig

SLOW = pytest.mark.slow
SCAN = [False, pytest.param(True, marks=SLOW)]
FAMILIES = ["t5_1_1.tiny", "t5_1_0.tiny", "t5gemma.tiny_gqa", "t5gemma2.tiny", "decoder_only.tiny"]


def _model(name, **kw):
  cfg = presets.get(name, dropout_rate=0.0, **kw)
  cls = models.DecoderOnlyModel if cfg.architecture == "decoder_only" else models.EncoderDecoderModel
  return cls(cfg)


def _logits(model, params, batch):
  return np.asarray(jax.jit(model.logits)(params, batch))


def _batch(model, seed=0, b=2, inputs=128, targets=8):
  # 256 encoder rows: matmul.FUSE_MIN_ROWS, so the fused q/k/v path runs too.
  rng = np.random.default_rng(seed)
  batch = {"decoder_input_tokens": rng.integers(2, 100, (b, targets)).astype(np.int32),
           "decoder_target_tokens": rng.integers(2, 100, (b, targets)).astype(np.int32)}
  if model.config.is_encoder_decoder:
    batch["encoder_input_tokens"] = rng.integers(2, 100, (b, inputs)).astype(np.int32)
  return batch


def _noisy_b(params, seed=1, scale=0.05):
  """An adapter that changes the model: lora_b drawn instead of zeros."""
  key = jax.random.key(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x + scale * jax.random.normal(jax.random.fold_in(key, hash(str(path)) % 2**31),
                                                    x.shape)
      if str(path[-1].key) == lora.B else x, params)


# Every pair of (family, layout, dtype) values once, not all 20 triples: every family
# unscanned in float32 and scanned in bfloat16, plus the two other layout/dtype pairs.
# Each case compiles two models; the pairs are where the code paths differ.
ZERO_INIT = ([("t5_1_1.tiny", False, "float32")]
             + [pytest.param(name, False, "float32", marks=SLOW) for name in FAMILIES[1:]]
             + [pytest.param(name, True, "bfloat16", marks=SLOW) for name in FAMILIES]
             + [pytest.param("t5gemma2.tiny", True, "float32", marks=SLOW),
                pytest.param("t5_1_1.tiny", False, "bfloat16", marks=SLOW)])


@pytest.mark.parametrize("name, scan, dtype", ZERO_INIT)
def test_zero_initialised_lora_gives_the_base_logits_bitwise(name, scan, dtype):
  lm = _model(name, scan_layers=scan, dtype=dtype, lora=LoraConfig(rank=4, targets="all-linear"))
  params = lm.init_params(jax.random.key(0))
  assert lora.targets(params)
  _, base = adapters.split(params)
  plain = _model(name, scan_layers=scan, dtype=dtype)
  batch = _batch(lm)
  np.testing.assert_array_equal(_logits(lm, params, batch), _logits(plain, base, batch))


@pytest.mark.parametrize("name", ["t5_1_1.tiny", "t5gemma.tiny_gqa", "t5gemma2.tiny"])
@pytest.mark.slow
def test_a_bfloat16_stored_base_gives_the_float32_bases_bfloat16_logits_bitwise(name):
  lm = _model(name, dtype="bfloat16", lora=LoraConfig(rank=4))
  params = _noisy_b(lm.init_params(jax.random.key(0)))
  adapter, base = adapters.split(params)
  stored = adapters.store_base(base, "bfloat16")
  kernels = [x for p, x in jax.tree_util.tree_flatten_with_path(stored)[0]
             if str(p[-1].key) == "kernel"]
  assert kernels and all(k.dtype == jnp.bfloat16 for k in kernels)
  batch = _batch(lm)
  np.testing.assert_array_equal(_logits(lm, adapters.join(adapter, stored), batch),
                                _logits(lm, params, batch))


# Every family unscanned; the stacked (scanned) merge on one T5 and one T5Gemma 2 stack.
@pytest.mark.parametrize("name, scan", [
    ("t5_1_1.tiny", False), pytest.param("t5gemma.tiny_gqa", False, marks=SLOW),
    pytest.param("t5gemma2.tiny", False, marks=SLOW),
    pytest.param("decoder_only.tiny", False, marks=SLOW), pytest.param("t5_1_1.tiny", True, marks=SLOW),
    pytest.param("t5gemma2.tiny", True, marks=SLOW)])
def test_merged_equals_unmerged(name, scan):
  cfg = LoraConfig(rank=4, alpha=8.0, targets="all-linear", rslora=True,
                   rank_pattern=(("wo", 2),), alpha_pattern=(("query", 3.0),))
  lm = _model(name, scan_layers=scan, lora=cfg)
  params = _noisy_b(lm.init_params(jax.random.key(0)))
  merged = lora.merge(jax.device_get(params), cfg)
  assert not adapters.has_adapter(merged)
  batch = _batch(lm)
  want = _logits(lm, params, batch)
  plain = _model(name, scan_layers=scan)
  np.testing.assert_allclose(_logits(plain, merged, batch), want, atol=1e-5, rtol=0)
  # The adapter does change the logits.
  assert np.abs(want - _logits(plain, adapters.split(params)[1], batch)).max() > 1e-3


def test_ranks_scales_and_targets_follow_peft():
  cfg = LoraConfig(rank=8, alpha=16, rank_pattern=(("decoder/layers_1/.*value", 2),),
                   alpha_pattern=(("query", 4.0),))
  assert cfg.rank_for("encoder/layers_0/attention/query") == 8
  assert cfg.rank_for("encoder/layers_0/attention/key") == 0
  assert cfg.rank_for("decoder/layers_1/self_attention/value") == 2
  assert cfg.scale_for("decoder/layers_1/self_attention/value") == 8.0
  assert cfg.scale_for("encoder/layers_0/attention/query") == 0.5
  assert LoraConfig(rank=4, alpha=8, rslora=True).scale_for("a/query") == 4.0
  assert LoraConfig(targets="all-linear").rank_for("decoder/logits_dense") == 0
  assert LoraConfig(targets="re:encoder/.*/wi_0").rank_for("encoder/layers/mlp/wi_0") == 8
  assert not LoraConfig(targets="wo").is_target("decoder/layers_0/mlp/wi_0")
  assert LoraConfig.from_dict(cfg.to_dict()) == cfg


def _plain_reference(x, w, a, b, scale):
  return x @ w + scale * (x @ a) @ b


@pytest.mark.parametrize("rows", [4, 300])
def test_adapter_gradients_through_our_matmul_rules_equal_jax_grad_of_plain_jnp(rows):
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (rows, 32))
  w = jax.random.normal(k[1], (32, 48)) / 6
  a = jax.random.normal(k[2], (32, 4)) / 6
  b = jax.random.normal(k[3], (4, 48)) / 2
  g = jax.random.normal(k[4], (rows, 48))

  def ours(x, a, b):
    return jnp.sum(matmul.dense(x, matmul.Lora(w, a, b, 0.5)) * g)

  def ref(x, a, b):
    return jnp.sum(_plain_reference(x, w, a, b, 0.5) * g)

  got = jax.grad(ours, argnums=(0, 1, 2))(x, a, b)
  want = jax.grad(ref, argnums=(0, 1, 2))(x, a, b)
  for gg, ww in zip(got, want):
    np.testing.assert_allclose(np.asarray(gg), np.asarray(ww), rtol=2e-5, atol=2e-5)
  # The fused path (several kernels on one input) gives the same adapter gradient.
  w2 = jax.random.normal(k[1], (32, 16)) / 6

  def fused(a, b):
    y1, y2 = matmul.dense_multi(x, [matmul.Lora(w, a, b, 0.5), w2])
    return jnp.sum(y1 * g) + jnp.sum(y2)

  got = jax.grad(fused, argnums=(0, 1))(a, b)
  for gg, ww in zip(got, want[1:]):
    np.testing.assert_allclose(np.asarray(gg), np.asarray(ww), rtol=2e-5, atol=2e-5)


def test_int8_base_gradients_equal_the_dequantised_reference():
  k = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(k[0], (300, 32))
  w = quant.quantize_kernel(np.asarray(jax.random.normal(k[1], (32, 48)) / 6), exact=True)
  a = jax.random.normal(k[2], (32, 4)) / 6
  b = jax.random.normal(k[3], (4, 48)) / 2
  g = jax.random.normal(k[4], (300, 48))
  deq = w.dequantize()

  def ours(x, a, b):
    return jnp.sum(matmul.dense(x, matmul.Lora(w, a, b, 2.0)) * g)

  def ref(x, a, b):
    return jnp.sum(_plain_reference(x, deq, a, b, 2.0) * g)

  np.testing.assert_allclose(np.asarray(matmul.dense(x, w)), np.asarray(x @ deq), rtol=1e-5,
                             atol=1e-5)
  for gg, ww in zip(jax.grad(ours, argnums=(0, 1, 2))(x, a, b),
                    jax.grad(ref, argnums=(0, 1, 2))(x, a, b)):
    np.testing.assert_allclose(np.asarray(gg), np.asarray(ww), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scan", SCAN)
@pytest.mark.slow
def test_the_adapter_gradient_with_a_frozen_base_is_the_full_gradients_part(scan):
  """Frozen kernels skip their gradient (symbolic zeros): the adapter's gradient is still
  what differentiating everything gives, for a float32, bfloat16 and int8 base."""
  lm = _model("t5_1_1.tiny", scan_layers=scan, lora=LoraConfig(rank=4, targets="attention"))
  params = _noisy_b(lm.init_params(jax.random.key(0)))
  adapter, base = adapters.split(params)
  batch = _batch(lm, inputs=32)
  loss = lambda p: lm.loss_fn(p, batch, None)[0]
  full = adapters.split(jax.jit(jax.grad(loss))(params))[0]
  frozen = jax.jit(jax.grad(lambda ad, base: loss(adapters.join(ad, base))))(adapter, base)
  for f, g in zip(jax.tree.leaves(full), jax.tree.leaves(frozen)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(f), rtol=1e-5, atol=1e-6)
  int8 = adapters.store_base(base, "int8")
  deq = jax.tree.map(lambda q: q.dequantize() if isinstance(q, quant.QArray) else q, int8,
                     is_leaf=lambda q: isinstance(q, quant.QArray))
  grad = jax.jit(jax.grad(lambda ad, base: loss(adapters.join(ad, base))))
  got, want = grad(adapter, int8), grad(adapter, deq)
  for f, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(f), rtol=1e-4, atol=1e-5)


def test_fingerprint_is_the_same_for_every_storage_and_layout_and_differs_between_bases():
  lm = _model("t5_1_1.tiny", lora=LoraConfig())
  _, base = adapters.split(lm.init_params(jax.random.key(0)))
  fp = adapters.fingerprint(base)
  assert fp == adapters.fingerprint(adapters.store_base(base, "bfloat16"))
  assert fp == adapters.fingerprint(adapters.store_base(base, "int8"))
  scanned = _model("t5_1_1.tiny", scan_layers=True)
  from t5forge.nn import stack
  assert fp == adapters.fingerprint(stack.stack_layers(jax.device_get(base)))
  _, other = adapters.split(lm.init_params(jax.random.key(1)))
  assert adapters.fingerprint(other) != fp
  del scanned
  with pytest.raises(UserError, match=f"fingerprint {fp}.*fingerprint {adapters.fingerprint(other)}"):
    adapters.check_base({"fingerprint": fp, "base": "a"}, adapters.fingerprint(other),
                        adapter="ad", base="b")


def test_adapter_files_round_trip(tmp_path):
  cfg = LoraConfig(rank=2, targets="qv")
  lm = _model("t5_1_1.tiny", scan_layers=True, lora=cfg)
  adapter, _ = adapters.split(_noisy_b(lm.init_params(jax.random.key(0))))
  adapters.save(str(tmp_path), adapter, model_config=lm.config.to_dict(),
                record={"fingerprint": "abc", "base": "somewhere", "base_dtype": "bfloat16"})
  tree, model_config, record = adapters.load(str(tmp_path))
  assert record == {"fingerprint": "abc", "base": "somewhere", "base_dtype": "bfloat16"}
  assert LoraConfig.from_dict(model_config["lora"]) == cfg
  from t5forge.nn import stack
  for got, want in zip(jax.tree.leaves(stack.stack_layers(tree)), jax.tree.leaves(adapter)):
    np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "rank 0"),
    ({"dropout": 1.0}, "dropout"),
    ({"targets": "re:("}, "does not compile"),
    ({"targets": " , "}, "is empty"),
])
def test_bad_lora_configs_are_one_line(kwargs, match):
  with pytest.raises(UserError, match=match) as e:
    LoraConfig(**kwargs)
  assert "\n" not in str(e.value)


def test_a_target_that_matches_nothing_or_a_rank_above_the_kernel_is_refused():
  lm = _model("t5_1_1.tiny", lora=LoraConfig(targets="re:encoder/nothing"))
  with pytest.raises(UserError, match="matches no projection.*encoder_decoder_attention/key"):
    lora.check_targets(lm.config.lora, lm.abstract_params())
  with pytest.raises(UserError, match="rank 1000 at encoder/layers_0/attention/query .* at most 64"):
    _model("t5_1_1.tiny", lora=LoraConfig(rank=1000)).abstract_params()


def test_lora_axes_are_known_to_the_sharding_and_adafactor_rules():
  from t5forge.sharding import Partitioner
  from t5forge.train import optim
  lm = _model("t5_1_1.tiny", scan_layers=True, lora=LoraConfig(rank=4, targets="all-linear"))
  abstract = lm.abstract_params()
  adapter, _ = adapters.split(abstract)
  axes, _ = adapters.split(lm.logical_axes())
  lora_axes = {a for leaf in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
               for a in leaf}
  assert "lora_rank" in lora_axes and "layers" in lora_axes
  shardings = Partitioner().tree_shardings(axes, shapes=adapter)
  assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(adapter))
  tx = optim.Adafactor().build(lambda s: jnp.float32(1e-2), axes)
  state = jax.eval_shape(tx.init, adapter)
  # Full (unfactored) second moments for the small rank axis, per layer.
  get = lambda tree, path: tree if not path else get(tree[path[0]], path[1:])
  path = next(p for p in lora.targets(adapter) if p.endswith("attention/query")).split("/")
  assert get(state.v, path)[lora.A].shape == get(adapter, path)[lora.A].shape
