"""The fast paths against references: hand-written backward passes (attention, projections,
relative-position lookup, integer-target cross-entropy) against autodiff of the plain
formulas, and the whole training gradient against PyTorch's for the same HF weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import random_batch
from t5forge import losses
from t5forge.convert.hf import load_hf, params_to_state
from t5forge.models import EncoderDecoderModel
from t5forge.nn import attention, layers, matmul, philox, quant

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

RNG = np.random.default_rng(0)


def _plain_attention(q, k, v, bias, mask_bias, keep, rate):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias + mask_bias
  w = jax.nn.softmax(logits, axis=-1)
  if keep is not None:
    w = jnp.where(keep, w / philox.keep_probability(rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_attention_backward_equals_autodiff(dropout):
  b, q, k, h, d = 2, 5, 7, 3, 4
  qa, ka, va = (jnp.asarray(RNG.normal(size=s), jnp.float32)
                for s in ((b, q, h, d), (b, k, h, d), (b, k, h, d)))
  bias = jnp.asarray(RNG.normal(size=(1, h, q, k)), jnp.float32)
  mask = jnp.where(jnp.asarray(RNG.random((b, 1, q, k)) < 0.2), -1e10, 0.0)
  # The fast path takes the Philox seed and keeps the packed mask bits for its backward
  # pass; the reference is given philox.keep_mask's mask as an array (k = 7: a padded
  # last Philox call).
  seed = philox.seed_words(jax.random.key(7)) if dropout else None
  keep = philox.keep_mask(seed, (b, h, q, k), dropout) if dropout else None
  if dropout:
    assert 0 < int(jnp.sum(~keep)) < keep.size  # some weights are really dropped
  cot = jnp.asarray(RNG.normal(size=(b, q, h, d)), jnp.float32)

  def loss(fn, drop):
    return lambda *a: jnp.sum(fn(*a, mask, drop, dropout) * cot)

  got = jax.grad(loss(attention._attention, seed), argnums=(0, 1, 2, 3))(qa, ka, va, bias)
  want = jax.grad(loss(_plain_attention, keep), argnums=(0, 1, 2, 3))(qa, ka, va, bias)
  np.testing.assert_allclose(loss(attention._attention, seed)(qa, ka, va, bias),
                             loss(_plain_attention, keep)(qa, ka, va, bias), rtol=1e-5)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_bfloat16_dropout_keeps_the_expectation():
  """Kept bf16 attention weights are scaled by 1 / (the mask's keep probability) in
  float32 and rounded once. Dividing the bf16 array by 1 - rate (the old path) rounded
  0.9 to bf16's 0.8984: every kept weight 0.17% too large, which this test sees."""
  shape, rate = (4, 6, 64, 128), 0.1
  w = jnp.asarray(RNG.random(shape), jnp.bfloat16)
  seed = philox.seed_words(jax.random.key(3))
  keep = np.asarray(philox.keep_mask(seed, shape, rate))
  bits = philox.keep_bits(seed, shape, rate)
  got = np.asarray(attention._dropped(w, bits, rate, jnp.bfloat16).astype(jnp.float32))
  assert not got[~keep].any()
  ratio = got.astype(np.float64).sum() / np.asarray(w, np.float64)[keep].sum()
  assert abs(ratio * philox.keep_probability(rate) - 1) < 1e-4, ratio


def test_dense_and_fused_projections_equal_jnp_dot():
  x = jnp.asarray(RNG.normal(size=(2, 6, 8)), jnp.float32)
  ks = [jnp.asarray(RNG.normal(size=(8, n)), jnp.float32) for n in (5, 12, 3)]
  cot = [jnp.asarray(RNG.normal(size=(2, 6, k.shape[1])), jnp.float32) for k in ks]

  def loss(fn):
    return lambda x, ks: sum(jnp.sum(y * c) for y, c in zip(fn(x, ks), cot))

  fused = lambda x, ks: matmul.dense_multi(x, ks)
  single = lambda x, ks: [matmul.dense(x, k) for k in ks]
  plain = lambda x, ks: [jnp.dot(x, k) for k in ks]
  want = jax.grad(loss(plain), argnums=(0, 1))(x, ks)
  for fn in (fused, single):
    np.testing.assert_allclose(loss(fn)(x, ks), loss(plain)(x, ks), rtol=1e-5)
    got = jax.grad(loss(fn), argnums=(0, 1))(x, ks)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("i, o", [(16, 40), (40, 16)])
def test_bfloat16_projection_gradient_equals_autodiff(i, o):
  """bfloat16 dense: explicit (identity-product) transposes in the backward pass give
  autodiff's gradient of a bf16 x bf16 -> float32 dot, for both branches (i <= o,
  i > o). The backward pass multiplies in bf16 (the float32 output gradient rounded to
  bf16, as under autocast), so entries differ by bf16 rounding: ~0.4% of the scale."""
  x = jnp.asarray(RNG.normal(size=(3, 24, i)), jnp.bfloat16)
  k = jnp.asarray(RNG.normal(size=(i, o)), jnp.bfloat16)
  cot = jnp.asarray(RNG.normal(size=(3, 24, o)), jnp.float32)
  plain = lambda x, k: jnp.einsum("bni,io->bno", x, k, preferred_element_type=jnp.float32)
  loss = lambda fn: lambda x, k: jnp.sum(fn(x, k) * cot)
  y = matmul.dense(x, k)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, plain(x, k), rtol=1e-6, atol=1e-6)
  got = jax.jit(jax.grad(loss(matmul.dense), argnums=(0, 1)))(x, k)
  want = jax.grad(loss(plain), argnums=(0, 1))(x, k)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype == jnp.bfloat16
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.abs(g - w).max() / np.abs(w).max() < 1e-2


@pytest.mark.parametrize("shape", [(24, 128), (24, 40), (200, 64)])
def test_bfloat16_transpose_is_exact(shape):
  """The identity-product transpose (per 64-column block, or whole when the width is
  not a multiple of 64) gives a.T bit for bit."""
  a = jnp.asarray(RNG.normal(size=shape), jnp.bfloat16)
  got = jax.jit(matmul._transposed)(a)
  assert got.dtype == jnp.bfloat16 and got.shape == shape[::-1]
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(a.T, np.float32))


@pytest.mark.parametrize("i, o", [(128, 40), (40, 128)])
def test_bfloat16_projection_of_float32_kernel_gives_float32_gradient(i, o):
  """A float32 kernel with bfloat16 activations (what every layer passes): the kernel is
  rounded to bf16 for the product, and its gradient comes back in float32, accumulated in
  float32 from the bf16 operands, not rounded to bf16. With an output gradient that bf16
  represents exactly, the kernel gradient equals the float32 one up to float32 summation
  order (a gradient rounded to bf16 would be off by up to 2^-9 of each entry); the input
  gradient is bf16 (x's dtype)."""
  x = jnp.asarray(RNG.normal(size=(3, 24, i)), jnp.bfloat16)
  k = jnp.asarray(RNG.normal(size=(i, o)), jnp.float32)
  cot = jnp.asarray(RNG.normal(size=(3, 24, o)), jnp.bfloat16).astype(jnp.float32)
  # The reference: float32 arithmetic on the rounded operands (x32, k32 are leaves, so no
  # gradient passes through a rounding).
  x32, k32 = x.astype(jnp.float32), k.astype(jnp.bfloat16).astype(jnp.float32)
  ref = lambda x, k: jnp.einsum("bni,io->bno", x, k)
  loss = lambda fn: lambda x, k: jnp.sum(fn(x, k) * cot)
  np.testing.assert_allclose(matmul.dense(x, k), ref(x32, k32), rtol=1e-5, atol=1e-5)
  gx, gk = jax.jit(jax.grad(loss(matmul.dense), argnums=(0, 1)))(x, k)
  wx, wk = jax.grad(loss(ref), argnums=(0, 1))(x32, k32)
  assert gx.dtype == jnp.bfloat16 and gk.dtype == jnp.float32
  np.testing.assert_allclose(gk, wk, rtol=1e-5, atol=1e-5 * np.abs(wk).max())
  gx, wx = np.asarray(gx, np.float32), np.asarray(wx, np.float32)
  assert np.abs(gx - wx).max() / np.abs(wx).max() < 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_scale_gradient_equals_autodiff(dtype):
  """RMSNorm's scale multiply (`layers.scale_columns`): the scale's gradient, summed as a
  product with ones, equals the float32 column sum of autodiff, also for bf16 activations
  (where it stays float32, not rounded to bf16: the output gradient is exactly
  representable in bf16 here, so only float32 summation order differs)."""
  y = jnp.asarray(RNG.normal(size=(3, 24, 16)), dtype)
  scale = jnp.asarray(RNG.normal(size=(16,)), jnp.float32)
  cot = jnp.asarray(RNG.normal(size=(3, 24, 16)), jnp.bfloat16).astype(dtype)
  got_y, got_s = jax.jit(jax.grad(
      lambda y, s: jnp.sum((layers.scale_columns(y, s) * cot).astype(jnp.float32)),
      argnums=(0, 1)))(y, scale)
  y32, s32 = y.astype(jnp.float32), scale.astype(dtype).astype(jnp.float32)
  want_y, want_s = jax.grad(lambda y, s: jnp.sum(y * s * cot.astype(jnp.float32)),
                            argnums=(0, 1))(y32, s32)
  assert got_y.dtype == dtype and got_s.dtype == jnp.float32
  np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-5 * np.abs(want_s).max())
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got_y, np.float32), want_y, rtol=tol, atol=tol)


def test_relative_bias_lookup_gradient_equals_gather_gradient():
  table = jnp.asarray(RNG.normal(size=(4, 32)), jnp.float32)
  buckets = jnp.asarray(RNG.integers(0, 32, size=(9, 11)), jnp.int32)
  cot = jnp.asarray(RNG.normal(size=(4, 9, 11)), jnp.float32)
  got = jax.grad(lambda t: jnp.sum(attention.bucket_lookup(t, buckets) * cot))(table)
  want = jax.grad(lambda t: jnp.sum(jnp.take(t, buckets, axis=1) * cot))(table)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 1e-4), (0.0, 1e-2)])
def test_integer_target_cross_entropy_equals_one_hot_version(smoothing, z):
  v = 11
  logits = jnp.asarray(RNG.normal(size=(2, 5, v)) * 3, jnp.float32)
  targets = jnp.asarray(RNG.integers(0, v, size=(2, 5)), jnp.int32)
  conf = 1.0 - smoothing
  low = (1.0 - conf) / (v - 1)
  soft = jax.nn.one_hot(targets, v) * (conf - low) + low

  def total(fn):
    return lambda lg: jnp.sum(fn(lg)[0] * jnp.arange(1, 11.0).reshape(2, 5))

  new = total(lambda lg: losses.token_cross_entropy(lg, targets, z, conf, low))
  old = total(lambda lg: losses.cross_entropy_with_logits(lg, soft, z))
  np.testing.assert_allclose(new(logits), old(logits), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(new)(logits), jax.grad(old)(logits), rtol=1e-5, atol=1e-6)


def _torch_grads(path, enc, dec, targets):
  import torch
  import transformers
  model = transformers.T5ForConditionalGeneration.from_pretrained(path).float()
  model.train(False)
  labels = torch.tensor(np.where(targets > 0, targets, -100), dtype=torch.long)
  out = model(input_ids=torch.tensor(enc, dtype=torch.long),
              attention_mask=torch.tensor(enc > 0, dtype=torch.long),
              decoder_input_ids=torch.tensor(dec, dtype=torch.long),
              decoder_attention_mask=torch.ones(dec.shape, dtype=torch.long), labels=labels)
  out.loss.backward()
  return float(out.loss), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["flan", "t5_1_0"])
def test_training_gradient_equals_pytorch(variant, hf_dirs):
  """jax.grad of our loss (all custom VJPs on the path) = torch autograd of HF's loss."""
  path = hf_dirs(variant)
  config, params = load_hf(path)
  enc, dec = random_batch(config.vocab_size, batch=3, enc_len=24, dec_len=16)
  targets = np.concatenate([dec[:, 1:], RNG.integers(1, config.vocab_size, (3, 1))], axis=1)
  targets[1, 10:] = 0  # padded targets carry no loss
  want_loss, want = _torch_grads(path, enc, dec, targets)
  # HF's loss is the mean over real target tokens, without z-loss.
  model = EncoderDecoderModel(config, z_loss=0.0, loss_normalizing_factor="NUM_REAL_TARGET_TOKENS")
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
           "decoder_target_tokens": targets,
           "decoder_loss_weights": (targets > 0).astype(np.float32)}
  (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, None)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  got = params_to_state(grads, config)
  assert set(got) <= set(want)
  for name, g in got.items():
    scale = np.abs(want[name]).max() + 1e-12
    assert np.abs(g - want[name]).max() / scale < 1e-4, name


def test_fast_training_modes_give_the_reference_gradient(hf_dirs):
  """scan over layers, remat and bfloat16 activations: same gradient as the plain loop."""
  config, params = load_hf(hf_dirs("flan"))
  enc, dec = random_batch(config.vocab_size, batch=2, enc_len=20, dec_len=12)
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
           "decoder_target_tokens": np.roll(dec, -1, axis=1),
           "decoder_loss_weights": np.ones(dec.shape, np.float32)}

  def grads(cfg):
    from t5forge.nn.stack import stack_layers
    p = stack_layers(params) if cfg.scan_layers else params
    g = jax.jit(jax.grad(lambda p: EncoderDecoderModel(cfg).loss_fn(p, batch, None)[0]))(p)
    return params_to_state(g, cfg)

  want = grads(config)
  for overrides, tol in ((dict(scan_layers=True), 1e-5),
                         (dict(scan_layers=True, remat_policy="full"), 1e-5),
                         (dict(remat_policy="minimal"), 1e-5),
                         (dict(dtype="bfloat16"), 0.05)):
    got = grads(config.replace(**overrides))
    for name, w in want.items():
      err = np.abs(got[name] - w).max() / (np.abs(w).max() + 1e-12)
      assert err < tol, (overrides, name, err)


def test_scanned_stack_recomputes_to_the_same_gradient_with_dropout(hf_dirs, monkeypatch):
  """A scan without remat keeps only the expensive intermediates (`stack.scan_saveable`)
  and recomputes the rest in the backward pass, dropout masks included: the gradient
  equals that of the scan keeping everything."""
  from t5forge.nn import stack
  config, params = load_hf(hf_dirs("flan"))
  config = config.replace(scan_layers=True, dropout_rate=0.3)
  params = stack.stack_layers(params)
  enc, dec = random_batch(config.vocab_size, batch=2, enc_len=20, dec_len=12)
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
           "decoder_target_tokens": np.roll(dec, -1, axis=1),
           "decoder_loss_weights": np.ones(dec.shape, np.float32)}
  model = EncoderDecoderModel(config)

  def grads():
    loss = lambda p: model.loss_fn(p, batch, jax.random.key(7))[0]
    return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

  got = grads()
  monkeypatch.setattr(stack, "scan_saveable", jax.checkpoint_policies.everything_saveable)
  want = grads()
  for g, w in zip(got, want):  # recomputed in other XLA fusions: float32 rounding only
    assert np.abs(g - w).max() / (np.abs(w).max() + 1e-12) < 1e-5


def test_int8_weights_stay_close_to_float_and_to_transformers(hf_dirs):
  """int8 weight-only kernels (per-channel weights, per-token activations): logits within
  a few percent of HF's float logits, and greedy decoding mostly the same tokens."""
  import t5forge
  from t5forge.nn import quant
  from hf_reference import hf_forward, load_hf_model
  path = hf_dirs("flan")
  f32 = t5forge.load(path)
  enc, dec = random_batch(f32.config.vocab_size, batch=2, enc_len=40, dec_len=30)
  want = hf_forward(load_hf_model(path), enc, dec)[1]
  for overrides in (dict(weight_dtype="int8"), dict(weight_dtype="int8", scan_layers=True)):
    q = t5forge.load(path, **overrides)
    kernels = [x for x in jax.tree.leaves(q.params, is_leaf=lambda x: isinstance(x, quant.QArray))
               if isinstance(x, quant.QArray)]
    assert kernels and all(k.q.dtype == jnp.int8 for k in kernels)
    got = q.logits(enc, dec)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 0.06, (overrides, rel)  # measured 4.2% on these random weights
    # Greedy decoding: the same tokens where the float model's top-2 margin is not tiny.
    a = f32.predict(enc, max_decode_length=12)[0]
    b = q.predict(enc, max_decode_length=12)[0]
    assert (a == b).mean() > 0.8, (a, b)


def test_int8_matmul_error_is_bounded():
  x = jnp.asarray(RNG.normal(size=(16, 64)), jnp.float32)
  w = jnp.asarray(RNG.normal(size=(64, 48)), jnp.float32)
  got = matmul.dense(x, quant.quantize_kernel(w))
  want = x @ w
  # Two roundings of at most half a step (1/254 of the row / column maximum) each.
  assert np.abs(got - want).max() / np.abs(want).max() < 0.02
  np.testing.assert_allclose(quant.quantize_kernel(w).dequantize(), w, atol=np.abs(w).max() / 254)


def test_int8_refuses_training_and_saving(hf_dirs, tmp_path):
  import t5forge
  from t5forge.errors import UserError
  from t5forge.train import optim
  from t5forge.train.step import make_train_step
  q = t5forge.load(hf_dirs("flan"), weight_dtype="int8")
  with pytest.raises(UserError, match="inference only"):
    make_train_step(EncoderDecoderModel(q.config), optim.adamw(1e-3))
  with pytest.raises(UserError, match="weight_dtype"):
    q.save_hf(str(tmp_path / "out"))
