"""The fused-attention path for GPUs (`t5forge.nn.fused_attention`).

On CPU: the wrapper, run with jax's XLA implementation of the same function, against
T5's own `attention.dot_product_attention` (outputs and the q, k, v and bias gradients,
float32 and bfloat16, with a padding mask, a causal decoder mask and no bias); the
dispatch rules; the model-level hook. On a CUDA GPU: cuDNN against the float32
reference, and the cuDNN custom call in the compiled HLO.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge.errors import UserError
from t5forge.nn import ModelConfig, build, init_params
from t5forge.nn import attention as attn
from t5forge.nn import fused_attention as fa

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

B, L, H, D = 2, 8, 4, 16
# float32: both sides compute the same float32 sums in a different order.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# bfloat16 q/k/v (and, in the fused form, the bias rounded to bfloat16: |bias| <= ~4
# here, a rounding of up to 2**-8 * 4 in a logit) against the float32 reference, as a
# fraction of the largest reference value of each array.
BF16_REL = 3e-2
# cuDNN (GPU) against the float32 reference: bf16 inputs and a bf16 dbias per example.
CUDNN_REL = 3e-2


def _case(kind, dtype=jnp.float32, seed=0, length=L, head_dim=D):
  """q, k, v [B, l, H, d], bias [1, H, l, l] float32 (or None), mask_bias [.., l] (or None)."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, length, H, head_dim)), dtype) for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(1, H, length, length)), jnp.float32)
  valid = np.ones((B, length), bool)
  valid[0, length - 3:] = False  # the first example is padded
  if kind == "padding":  # the encoder's key-padding mask [b, 1, 1, k]
    mask = attn.padding_mask(None, jnp.asarray(valid))
  elif kind == "padding_qk":  # queries masked too: [b, 1, q, k], fully masked rows
    mask = attn.padding_mask(jnp.asarray(valid), jnp.asarray(valid))
  elif kind == "causal":  # the decoder's self-attention mask [1, 1, t, t]
    mask = attn.causal_mask(length)
  elif kind == "cross":  # cross-attention: no relative bias
    mask, bias = attn.padding_mask(None, jnp.asarray(valid)), None
  else:
    raise ValueError(kind)
  return q, k, v, bias, attn.mask_to_bias(mask, dtype)


def _grads(fn, q, k, v, bias, mask_bias):
  """Output and the gradients of sum(out * w) for q, k, v and the bias."""
  w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

  def loss(q, k, v, bias):
    return jnp.sum(fn(q, k, v, bias, mask_bias).astype(jnp.float32) * w)

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  out = fn(q, k, v, bias, mask_bias)
  return (out, *jax.grad(loss, argnums=argnums)(q, k, v, bias))


def _ours(q, k, v, bias, mask_bias):
  return attn.dot_product_attention(q, k, v, bias, mask_bias)


def _xla(q, k, v, bias, mask_bias):
  return fa.fused_attention(q, k, v, bias, mask_bias, implementation="xla")


def _close(got, want, rel, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  assert err <= rel, f"{what}: max error {err:.2e} of the largest value, above {rel:.0e}"


NAMES = ("out", "dq", "dk", "dv", "dbias")
KINDS = ["padding", "padding_qk", "causal", "cross"]


@pytest.mark.parametrize("kind", KINDS)
def test_wrapper_equals_ours_float32(kind):
  case = _case(kind)
  for name, got, want in zip(NAMES, _grads(_xla, *case), _grads(_ours, *case)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_wrapper_bfloat16_close_to_float32_reference(kind):
  q, k, v, bias, mask_bias = _case(kind, jnp.bfloat16)
  ref = _grads(_ours, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
               bias, mask_bias.astype(jnp.float32))
  got = _grads(_xla, q, k, v, bias, mask_bias)
  assert got[0].dtype == jnp.bfloat16
  for name, g, r in zip(NAMES, got, ref):
    _close(g, r, BF16_REL, name)


def test_wrapper_passes_scale_one_and_the_bias():
  """What a broken wrapper would change: T5 has no 1/sqrt(d) scaling and needs the bias."""
  q, k, v, bias, mask_bias = _case("padding")
  want = _ours(q, k, v, bias, mask_bias)
  scaled = jax.nn.dot_product_attention(q, k, v, bias=bias + mask_bias, implementation="xla")
  unbiased = _ours(q, k, v, None, mask_bias)
  for wrong in (scaled, unbiased):
    assert np.max(np.abs(np.asarray(wrong - want))) > 1e-2  # the test below would see it
  np.testing.assert_allclose(_xla(q, k, v, bias, mask_bias), want, **F32_TOL)


CAP_H100 = (9, 0)


def _eligible(dtype=jnp.bfloat16, length=L, head_dim=64, dropout=False, capability=CAP_H100,
              bias=True):
  q, k, _, b, m = _case("padding", dtype, length=length, head_dim=head_dim)
  return fa.ineligible(q, k, b if bias else None, m if bias else None, dropout=dropout,
                       capability=capability)


def test_eligibility_rules():
  assert _eligible() is None  # T5.1.1 base/large on an H100: bf16, head_dim 64
  assert _eligible(capability=(8, 0)) is None  # A100
  assert "float16" in _eligible(dtype=jnp.float16)  # -1e10 overflows float16
  assert "not a CUDA GPU" in _eligible(capability=None)
  assert "below 8.0" in _eligible(capability=(7, 5))
  assert "dropout" in _eligible(dropout=True)
  assert "float32" in _eligible(dtype=jnp.float32)
  assert "head_dim 60" in _eligible(head_dim=60)
  assert _eligible(head_dim=192) is None  # Hopper: up to 256
  assert "head_dim 192" in _eligible(head_dim=192, capability=(8, 0))  # Ampere: up to 128
  assert "odd" in _eligible(length=7)
  assert _eligible(length=7, bias=False) is None


def test_auto_on_cpu_is_ours_and_cudnn_on_cpu_names_the_field(monkeypatch):
  if jax.default_backend() == "cpu":
    assert fa.cuda_capability() is None
  else:  # on a GPU machine: what a CPU backend reports
    monkeypatch.setattr(fa, "cuda_capability", lambda: None)
  q, k, _, bias, mask_bias = _case("padding", jnp.bfloat16)
  assert not fa.use_cudnn("auto", q, k, bias, mask_bias, dropout=False)
  assert not fa.use_cudnn("xla", q, k, bias, mask_bias, dropout=False)
  with pytest.raises(UserError, match=r"network\.ModelConfig\.attention_kernel = 'cudnn'.*"
                                      r"not a CUDA GPU.*'auto'"):
    fa.use_cudnn("cudnn", q, k, bias, mask_bias, dropout=False)


def test_auto_on_a_gpu_takes_cudnn_only_where_eligible(monkeypatch):
  monkeypatch.setattr(fa, "cuda_capability", lambda: CAP_H100)
  q, k, _, bias, mask_bias = _case("padding", jnp.bfloat16)
  assert fa.use_cudnn("auto", q, k, bias, mask_bias, dropout=False)
  assert fa.use_cudnn("cudnn", q, k, bias, mask_bias, dropout=False)
  assert not fa.use_cudnn("xla", q, k, bias, mask_bias, dropout=False)
  assert not fa.use_cudnn("auto", q, k, bias, mask_bias, dropout=True)
  assert not fa.use_cudnn("auto", q.astype(jnp.float32), k.astype(jnp.float32), bias,
                          mask_bias, dropout=False)
  with pytest.raises(UserError, match="attention_kernel = 'cudnn'.*dropout"):
    fa.use_cudnn("cudnn", q, k, bias, mask_bias, dropout=True)


@pytest.mark.parametrize("bad", ["flash", "CUDNN", None])
def test_bad_attention_kernel_names_the_field(bad):
  with pytest.raises(UserError, match="attention_kernel must be one of"):
    ModelConfig(vocab_size=97, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                num_encoder_layers=1, num_decoder_layers=1, attention_kernel=bad)


CFG = ModelConfig(vocab_size=97, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                  num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                  dtype="bfloat16")


def _model_grads(cfg, params):
  rng = np.random.default_rng(3)
  enc = rng.integers(1, 97, (2, 8)).astype(np.int32)
  enc[0, 5:] = 0  # padding
  dec = rng.integers(1, 97, (2, 6)).astype(np.int32)

  def loss(p):
    logits = build(cfg).apply({"params": p}, enc, dec)
    return jnp.sum(jnp.tanh(logits.astype(jnp.float32)))

  return jax.value_and_grad(loss)(params)


def _count_calls(monkeypatch):
  calls = []
  real = jax.nn.dot_product_attention

  def counting(*args, **kw):
    calls.append(kw.get("implementation"))
    return real(*args, **kw)

  monkeypatch.setattr(jax.nn, "dot_product_attention", counting)
  return calls


def test_model_takes_the_fused_path_on_a_cuda_gpu_only(monkeypatch):
  calls = _count_calls(monkeypatch)
  params = init_params(CFG, jax.random.key(0))
  calls.clear()  # (initialisation traces the attentions too)
  _model_grads(CFG, params)
  # CPU: never; a CUDA GPU: all 6 teacher-forcing attentions (2 encoder, 2 + 2 decoder).
  assert calls == ([] if fa.cuda_capability() is None else ["cudnn"] * 6)


def test_model_hook_on_a_gpu_runs_the_fused_form_with_the_same_result(monkeypatch):
  """The hook as it runs on a GPU (capability injected), with jax's XLA implementation in
  place of cuDNN: every teacher-forcing attention goes through the wrapper, and the loss
  and every parameter gradient (the relative-bias tables included) match ours."""
  params = init_params(CFG, jax.random.key(0))
  want_loss, want = _model_grads(CFG.replace(attention_kernel="xla"), params)
  monkeypatch.setattr(fa, "cuda_capability", lambda: CAP_H100)
  monkeypatch.setattr(fa, "IMPLEMENTATION", "xla")
  calls = _count_calls(monkeypatch)  # (after init_params: counts the step's attentions)
  got_loss, got = _model_grads(CFG, params)
  # 2 encoder + 2 decoder self + 2 cross attentions, traced for value_and_grad.
  assert calls == ["xla"] * 6
  _close(got_loss, want_loss, BF16_REL, "loss")
  flat_got = jax.tree_util.tree_leaves_with_path(got)
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
  assert any("rel_embedding" in jax.tree_util.keystr(p) for p, _ in flat_got)
  for path, g in flat_got:
    _close(g, flat_want[path], 5e-2, jax.tree_util.keystr(path))


def _has_gpu():
  return fa.cuda_capability() is not None


@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU: cuDNN's fused attention runs on "
                    "CUDA GPUs only (this backend is " + jax.default_backend() + ")")
@pytest.mark.parametrize("kind", ["padding", "causal", "cross"])
def test_cudnn_matches_float32_reference_and_is_fused(kind):
  # T5.1.1's head_dim 64, lengths divisible by 64 as the training runs use.
  q, k, v, bias, mask_bias = _case(kind, jnp.bfloat16, length=128, head_dim=64)
  with jax.default_matmul_precision("highest"):  # a float32 reference, not TF32
    ref = _grads(_ours, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                 bias, mask_bias.astype(jnp.float32))
  cudnn = lambda *a: fa.fused_attention(*a, implementation="cudnn")
  got = _grads(cudnn, q, k, v, bias, mask_bias)
  for name, g, r in zip(NAMES, got, ref):
    _close(g, r, CUDNN_REL, f"{kind} {name}")

  def loss(q, k, v, bias):
    return jnp.sum(cudnn(q, k, v, bias, mask_bias).astype(jnp.float32))

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, bias).compile().as_text()
  assert "__cudnn$fmha" in hlo and "Backward" in hlo, "no cuDNN fused attention custom call"
