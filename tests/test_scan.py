"""What a scanned layer stack keeps for its backward pass (`stack.scan_saveable`,
`stack.keep`): the residuals a loop of layers would keep, not the inputs to recompute them.
(That scan and loop compute the same loss and gradients: tests/test_hf_parity.py and
tests/test_fast_paths.py.)"""
import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge.nn import attention, stack

B, L, H, D = 2, 16, 3, 8


def _saved(dtype, dropout: bool) -> list[tuple[str, tuple[int, ...], str]]:
  """(dtype, shape, description) of each value attention saves for its backward pass
  under the scanned stack's policy (jax.ad_checkpoint.print_saved_residuals)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, L, H, D)), dtype) for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(1, H, L, L)), jnp.float32)
  mask = attention.mask_to_bias(jnp.asarray(rng.random((B, 1, L, L)) < 0.9), jnp.float32)

  def f(q, k, v, bias):
    return attention.dot_product_attention(
        q, k, v, bias, mask, dropout_rate=0.1 if dropout else 0.0,
        deterministic=not dropout, dropout_rng=jax.random.key(1)).astype(jnp.float32).sum()

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(f, policy=stack.scan_saveable), q, k, v, bias)
  saved = []
  for line in out.getvalue().splitlines():  # e.g. "f32[2,3,16,16] named 'x' from ..."
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
    assert m, line
    saved.append((m[1], tuple(int(n) for n in m[2].split(",") if n), m[3]))
  return saved


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dropout", [False, True])
def test_scanned_attention_keeps_its_probabilities(dtype, dropout):
  """The backward loop of a scan reads attention's float32 probabilities [b, h, q, k]
  as the forward computed them. Without `stack.keep` the policy saved the logits (a dot
  output) and the softmax's max and sum, and reran the softmax (exp, divide) over
  [b, h, q, k] in the backward loop of every layer, a pass a loop does not make."""
  saved = _saved(dtype, dropout)
  full = [(dt, why) for dt, shape, why in saved if shape == (B, H, L, L)]
  assert full == [("f32", full[0][1])] and full[0][1].startswith(f"named '{stack.KEPT}'"), saved
  # Nothing else of the softmax: no row maxima or sums [b, h, q(, 1)].
  assert not [s for s in saved if s[1] in ((B, H, L), (B, H, L, 1))], saved
  # q, k, v and the output as the loop keeps them: in the compute dtype (in bfloat16 not
  # the float32 product that the projection's cast reads; here: no float32 copy of q).
  # bfloat16 ones as their uint16 bits (see test_kept_bfloat16_is_written_in_place).
  small = [(dt, why) for dt, shape, why in saved if shape == (B, L, H, D)]
  want = "u16" if dtype == jnp.bfloat16 else "f32"
  assert len(small) == 4 and all(dt == want for dt, _ in small), saved


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scanned_attention_keeps_its_dropout_bits(dtype):
  """With dropout, the backward loop of a scan reads the forward's packed keep bits
  (uint8 [b, h, q, ceil(k / 4)], `philox.keep_bits`) instead of rerunning the Philox
  calls from the seed: in a loop of layers XLA merges the backward's calls with the
  forward's, across a scan's two loops it cannot (0.21 s of a flan-t5-small bf16 step).
  Before, the custom VJP kept the seed (u32[2]) and regenerated the mask."""
  saved = _saved(dtype, dropout=True)
  bits = [why for dt, shape, why in saved if (dt, shape) == ("u8", (B, H, L, L // 4))]
  assert len(bits) == 1 and bits[0].startswith(f"named '{stack.KEPT}'"), saved
  assert not [s for s in saved if s[:2] == ("u32", (2,))], saved  # no seed words


def test_kept_bfloat16_is_written_in_place():
  """A kept bfloat16 residual [4, 64, 32] per layer, stacked over 6 layers by a scan: its
  writes must not convert the whole [6, 4, 64, 32] stack to float32 and back (what
  XLA:CPU does for a bfloat16 dynamic-update-slice; in the flan-t5-small bf16 step a
  pass over a whole stack per layer and kept array); `stack.keep` stores uint16 bits."""
  layers, shape = 6, (4, 64, 32)

  @jax.custom_vjp
  def square(x):
    return x * x

  def square_fwd(x):
    return x * x, stack.keep((2 * x).astype(jnp.bfloat16))

  def square_bwd(res, g):
    (twice_x,) = res
    return (g * twice_x.astype(g.dtype),)

  square.defvjp(square_fwd, square_bwd)

  def layer(x, w):
    return jnp.sin(square(x * w)), None

  def loss(x, ws):
    return jax.lax.scan(jax.checkpoint(layer, policy=stack.scan_saveable), x, ws)[0].sum()

  x = jnp.linspace(-1, 1, np.prod(shape)).reshape(shape)
  ws = jnp.linspace(0.5, 1.5, layers * shape[-1]).reshape(layers, 1, 1, shape[-1])
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  hlo = grad.lower(x, ws).compile().as_text()
  stacked = ",".join(map(str, (layers, *shape)))
  assert f"u16[{stacked}]" in hlo and f"bf16[{stacked}]" not in hlo

  def unrolled(x, ws):  # the bits are the value: the gradient of the plain layers
    for i in range(layers):
      x = layer(x, ws[i])[0]
    return x.sum()
  for got, want in zip(grad(x, ws), jax.jit(jax.grad(unrolled, argnums=(0, 1)))(x, ws)):
    assert np.abs(got).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_scanned_bfloat16_projection_keeps_its_operand():
  """A bf16 projection (`matmul.dense`) in a scanned stack keeps its bf16 operand, as
  uint16 bits, for the kernel gradient: not its float32 inputs (and, for a norm's
  output, a bf16 copy that XLA:CPU wrote per layer through the whole stack)."""
  from t5forge.nn import matmul
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)

  def f(x, w):
    return matmul.dense(jnp.tanh(x).astype(jnp.bfloat16), w).sum()

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=stack.scan_saveable), x, w)
  operand = [line for line in out.getvalue().splitlines() if line.startswith("u16[32,8]")]
  assert operand and f"named '{stack.KEPT}'" in operand[0], out.getvalue()


@pytest.mark.slow
def test_scanned_bfloat16_gradient_equals_the_loop(hf_dirs):
  """bf16 with scan (its residuals kept as uint16 bits): the gradient of the bf16 loop,
  up to bfloat16 rounding in other fusions."""
  from hf_reference import random_batch
  from t5forge.convert.hf import load_hf, params_to_state
  from t5forge.models import EncoderDecoderModel
  config, params = load_hf(hf_dirs("flan"))
  config = config.replace(dtype="bfloat16")
  enc, dec = random_batch(config.vocab_size, batch=2, enc_len=20, dec_len=12)
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
           "decoder_target_tokens": np.roll(dec, -1, axis=1),
           "decoder_loss_weights": np.ones(dec.shape, np.float32)}

  def grads(cfg):
    p = stack.stack_layers(params) if cfg.scan_layers else params
    g = jax.jit(jax.grad(lambda p: EncoderDecoderModel(cfg).loss_fn(p, batch, None)[0]))(p)
    return params_to_state(g, cfg)

  want, got = grads(config), grads(config.replace(scan_layers=True))
  for name, w in want.items():
    err = np.abs(got[name] - w).max() / (np.abs(w).max() + 1e-12)
    assert err < 0.02, (name, err)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scanned_mlp_keeps_its_activation(dtype):
  """A scanned stack keeps the tanh of the gated-GELU MLP (`layers.MlpBlock`, float32
  after the projection) for its backward loop instead of recomputing it there from the
  saved projection: that recompute, with the tanh's derivative, took the MLP's gradient
  fusion from 0.41 to 0.87 s of a flan-t5-small bf16 step's op time (AMD EPYC)."""
  from t5forge.nn import layers
  mlp = layers.MlpBlock(intermediate_dim=16, activations=("gelu", "linear"), dtype=dtype)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 4)), jnp.float32)
  params = mlp.init(jax.random.key(0), x, True)

  def f(params, x):
    return mlp.apply(params, x, True).astype(jnp.float32).sum()

  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(f, policy=stack.scan_saveable), params, x)
  tanh = [line for line in out.getvalue().splitlines() if "output of tanh" in line]
  assert [line.split()[0] for line in tanh] == ["f32[2,8,16]"], out.getvalue()
