"""The T5Gemma network (t5forge/nn/t5gemma.py): parameter counts against transformers'
T5GemmaForConditionalGeneration (built on the meta device, no memory), cached decoding
against teacher forcing with sliding windows shorter than the sequences, scan/remat
against the loop, bf16 and int8, and the config's refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge import decoding, models, presets
from t5forge import nn as t5nn
from t5forge.errors import UserError
from t5forge.nn import quant
from t5forge.nn.stack import stack_layers

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

SIZES = ["s-s", "b-b", "l-l", "ml-ml", "xl-xl", "2b-2b", "9b-2b", "9b-9b", "tiny", "tiny_gqa"]
TINY = ["tiny", "tiny_gqa"]


def _hf_config(cfg):
  """transformers' T5GemmaConfig of the same shape (written here from the HF docs'
  field names, independently of t5forge/convert)."""
  import transformers
  enc = cfg.encoder

  def module(c, layers):
    return transformers.T5GemmaModuleConfig(
        vocab_size=cfg.vocab_size, hidden_size=c.emb_dim, intermediate_size=c.mlp_dim,
        num_hidden_layers=layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar, sliding_window=cfg.sliding_window,
        attn_logit_softcapping=cfg.attn_logit_softcapping,
        final_logit_softcapping=cfg.final_logit_softcapping)

  return transformers.T5GemmaConfig(encoder=module(enc, cfg.num_encoder_layers),
                                    decoder=module(cfg, cfg.num_decoder_layers),
                                    vocab_size=cfg.vocab_size, tie_word_embeddings=True)


def _hf_meta_model(cfg):
  import torch
  import transformers
  with torch.device("meta"):
    return transformers.T5GemmaForConditionalGeneration(_hf_config(cfg))


@pytest.mark.parametrize("size", SIZES)
def test_parameter_count_equals_transformers(size):
  cfg = presets.get(f"t5gemma.{size}")
  # Scanned: the same parameters, one traced layer per stack (fast for 9b-9b).
  ours = t5nn.count_params(t5nn.abstract_params(cfg.replace(scan_layers=True)))
  hf = _hf_meta_model(cfg)
  # parameters() yields the tied lm_head / decoder embedding once.
  theirs = sum(p.numel() for p in hf.parameters())
  assert ours == theirs, (size, ours, theirs)


def _hf_name(path: str) -> tuple[str, bool]:
  """Our parameter path -> (HF state_dict name, transposed), per
  /work/notes/t5gemma_params.md."""
  parts = path.split("/")
  stack = parts[0]
  if parts[1] == "token_embedder":
    return f"model.{stack}.embed_tokens.weight", False
  if parts[1] in ("encoder_norm", "decoder_norm"):
    return f"model.{stack}.norm.weight", False
  i = parts[1][len("layers_"):]
  norms = {"pre_self_attention_layer_norm": "pre_self_attn_layernorm",
           "post_self_attention_layer_norm": "post_self_attn_layernorm",
           "pre_cross_attention_layer_norm": "pre_cross_attn_layernorm",
           "post_cross_attention_layer_norm": "post_cross_attn_layernorm",
           "pre_mlp_layer_norm": "pre_feedforward_layernorm",
           "post_mlp_layer_norm": "post_feedforward_layernorm"}
  prefix = f"model.{stack}.layers.{i}"
  if parts[2] in norms:
    return f"{prefix}.{norms[parts[2]]}.weight", False
  block = {"attention": "self_attn", "self_attention": "self_attn",
           "encoder_decoder_attention": "cross_attn", "mlp": "mlp"}[parts[2]]
  proj = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj",
          "wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}[parts[3]]
  return f"{prefix}.{block}.{proj}.weight", True


@pytest.mark.parametrize("size", TINY + ["9b-2b"])
def test_parameter_tree_maps_onto_transformers_state_dict(size):
  """Every parameter has one HF weight of the (transposed) shape, and all HF weights but
  the tied lm_head are covered: the table H's converter is written against."""
  cfg = presets.get(f"t5gemma.{size}")
  hf = {k: tuple(v.shape) for k, v in _hf_meta_model(cfg).state_dict().items()}
  seen = set()
  for path, leaf in t5nn.named_leaves(t5nn.abstract_params(cfg)).items():
    name, transposed = _hf_name(path)
    assert name in hf, (path, name)
    shape = tuple(leaf.shape)
    assert (shape[::-1] if transposed else shape) == hf[name], (path, shape, hf[name])
    seen.add(name)
  assert set(hf) - seen == {"lm_head.out_proj.weight"}


def _batch(cfg, seed=0, b=3, enc_len=20, dec_len=18):
  rng = np.random.default_rng(seed)
  enc = rng.integers(3, cfg.vocab_size, size=(b, enc_len)).astype(np.int32)
  enc[1, 13:] = 0  # a padded row
  targets = rng.integers(3, cfg.vocab_size, size=(b, dec_len)).astype(np.int32)
  dec_in = np.concatenate([np.zeros((b, 1), np.int32), targets[:, :-1]], axis=1)
  return {"encoder_input_tokens": jnp.asarray(enc), "decoder_input_tokens": jnp.asarray(dec_in),
          "decoder_target_tokens": jnp.asarray(targets)}


def _model_and_params(size, seed=0, **changes):
  cfg = presets.get(f"t5gemma.{size}", dropout_rate=0.0, **changes)
  model = models.EncoderDecoderModel(cfg)
  params = model.init_params(jax.random.key(seed))
  # Zero-centred norms make every (1 + w) scale 1; randomise them so a wrong norm shows.
  keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.3 * jax.random.normal(next(keys), x.shape)
      if "norm" in jax.tree_util.keystr(p) else x, params)
  # Embeddings N(0, 1) instead of the N(0, 0.02) init: peaked output distributions (nearly
  # uniform ones leave beam search and greedy decoding to rounding).
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x / 0.02 if "token_embedder" in jax.tree_util.keystr(p) else x, params)
  return cfg, model, params


@pytest.mark.slow  # 35-50 s on the shared, loaded 2-core AMD EPYC
@pytest.mark.parametrize("size", TINY)
def test_cached_decoding_equals_teacher_forcing(size):
  """Step logits over the KV cache (fed the teacher tokens) equal the teacher-forced
  logits at every position, past the sliding window (8) too; greedy decoding equals
  the argmax of teacher forcing on its own output."""
  cfg, model, params = _model_and_params(size)
  batch = _batch(cfg)
  b, t = batch["decoder_input_tokens"].shape
  logits_fn = jax.jit(model.logits)
  full = logits_fn(params, batch)  # [b, t, v]
  setup = model.decode_setup(params, batch, t)
  step = jax.jit(model.decode_step(params, setup.cache_length))
  cache, stepped = setup.cache, []
  for i in range(t):
    state = decoding.DecodingState(cur_index=jnp.full((b,), i, jnp.int32),
                                   sequences=batch["decoder_input_tokens"],
                                   cur_token=batch["decoder_input_tokens"][:, i:i + 1],
                                   cache=cache)
    logits, cache = step(state)
    stepped.append(logits)
  np.testing.assert_allclose(np.stack(stepped, 1), full, atol=2e-4, rtol=2e-4)

  tokens = jax.jit(model.predict_batch)(params, batch)  # greedy
  dec_in = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tokens[:, :-1]], axis=1)
  forced = jnp.argmax(logits_fn(params, {**batch, "decoder_input_tokens": dec_in}), -1)
  for row in range(b):
    ends = np.flatnonzero(np.asarray(tokens[row]) == model.eos_id)
    n = ends[0] + 1 if ends.size else t
    assert n > cfg.sliding_window + 2, "EOS too early for the test to see the window"
    np.testing.assert_array_equal(tokens[row, :n], forced[row, :n])


def test_decoder_starts_from_bos_and_kv_cache_holds_kv_heads():
  cfg, model, params = _model_and_params("tiny_gqa")
  batch = _batch(cfg)
  bos = {**batch, "decoder_input_tokens": batch["decoder_input_tokens"].at[:, 0].set(2)}
  # SeqIO's 0 at the start is read as BOS (2): the same logits as an explicit BOS...
  logits = jax.jit(model.logits)
  np.testing.assert_array_equal(logits(params, batch), logits(params, bos))
  # ...and different from a model that starts from 0.
  other = models.EncoderDecoderModel(cfg.replace(decoder_start_token_id=0))
  assert not np.allclose(jax.jit(other.logits)(params, batch), logits(params, batch))
  cache = model.decode_setup(params, batch, 18).cache
  k = cache["decoder"]["layers_0"]["self_attention"]["cached_key"]
  assert k.shape == (3, cfg.num_kv_heads, 18, cfg.head_dim)  # [b, kv heads, length, d]
  x = cache["decoder"]["layers_0"]["encoder_decoder_attention"]["cached_key"]
  assert x.shape == (3, cfg.num_kv_heads, 20, cfg.head_dim)


@pytest.mark.parametrize("size", TINY)
def test_sliding_window_layers_differ_from_global(size):
  """With inputs longer than the window, the window changes the logits; with inputs
  within it (encoder |i - j| <= 8, decoder i - j < 8), it does not."""
  cfg, model, params = _model_and_params(size)
  glob = models.EncoderDecoderModel(cfg.replace(sliding_window=None))
  long = _batch(cfg)
  ours, theirs = jax.jit(model.logits), jax.jit(glob.logits)
  assert not np.allclose(ours(params, long), theirs(params, long), atol=1e-3)
  short = _batch(cfg, enc_len=9, dec_len=8)
  np.testing.assert_allclose(ours(params, short), theirs(params, short),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # 35-50 s on the shared, loaded 2-core AMD EPYC
def test_scan_and_remat_equal_the_loop():
  cfg, model, params = _model_and_params("tiny_gqa")
  batch = _batch(cfg)
  scanned_cfg = cfg.replace(scan_layers=True, remat_policy="full")
  scanned = models.EncoderDecoderModel(scanned_cfg)
  stacked = stack_layers(jax.tree.map(np.asarray, params))
  want = jax.tree.map(lambda x: tuple(x.shape), scanned.abstract_params())
  assert jax.tree.map(lambda x: tuple(x.shape), stacked) == want
  np.testing.assert_allclose(jax.jit(scanned.logits)(stacked, batch),
                             jax.jit(model.logits)(params, batch), atol=1e-5, rtol=1e-5)
  grad = lambda m, p: jax.jit(jax.grad(lambda q: m.loss_fn(q, batch, None)[0]))(p)
  g_loop = stack_layers(jax.tree.map(np.asarray, grad(model, params)))
  g_scan = grad(scanned, stacked)
  for a, b in zip(jax.tree.leaves(g_loop), jax.tree.leaves(g_scan)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
  # Cached decoding through the scanned stack gives the loop's tokens.
  np.testing.assert_array_equal(jax.jit(scanned.predict_batch)(stacked, batch),
                                jax.jit(model.predict_batch)(params, batch))


def test_beam_search_runs_over_the_gqa_cache():
  cfg, model, params = _model_and_params("tiny_gqa")
  batch = _batch(cfg)
  beams, aux = model.predict_batch_with_aux(params, batch, decode_fn=decoding.beam_search,
                                            decoder_params={"alpha": 0.0}, num_decodes=3,
                                            return_all_decodes=True)
  assert beams.shape == (3, 3, 18)
  # The best beam's score is its log-likelihood under teacher forcing (alpha 0).
  best = beams[:, -1]
  dec_in = jnp.concatenate([jnp.zeros((3, 1), jnp.int32), best[:, :-1]], axis=1)
  ll = model.score_batch(params, {**batch, "decoder_input_tokens": dec_in,
                                  "decoder_target_tokens": best})
  np.testing.assert_allclose(aux["scores"][:, -1], ll, atol=1e-3, rtol=1e-4)
  greedy_ll = model.predict_batch_with_aux(params, batch)[1]["scores"]
  assert np.all(np.asarray(aux["scores"][:, -1]) >= np.asarray(greedy_ll) - 1e-4)


@pytest.mark.slow  # 35-50 s on the shared, loaded 2-core AMD EPYC
def test_bfloat16_and_int8_stay_close_to_float32():
  cfg, model, params = _model_and_params("tiny_gqa")
  batch = _batch(cfg)
  ref = jax.nn.log_softmax(jax.jit(model.logits)(params, batch))
  bf16 = models.EncoderDecoderModel(cfg.replace(dtype="bfloat16"))
  int8 = models.EncoderDecoderModel(cfg.replace(weight_dtype="int8"))
  for m, p in ((bf16, params), (int8, quant.quantize_params(params))):
    got = jax.nn.log_softmax(jax.jit(m.logits)(p, batch))
    # Mean absolute log-prob error: bf16 / int8 rounding, not a wrong network.
    err = float(jnp.mean(jnp.abs(jnp.exp(ref) * (got - ref)).sum(-1)))
    assert err < 0.05, err
    assert jax.jit(m.predict_batch)(p, batch).shape == (3, 18)


def test_bad_configs_say_what_to_change():
  tiny = presets.get("t5gemma.tiny")
  with pytest.raises(UserError, match="num_heads 4 is not a multiple of num_kv_heads 3"):
    tiny.replace(num_kv_heads=3)
  with pytest.raises(UserError, match="encoder_num_heads 6 is not a multiple"):
    presets.get("t5gemma.tiny_gqa").replace(encoder_num_kv_heads=4)
  with pytest.raises(UserError, match="sliding_window 9000 is larger than "
                                      "max_position_embeddings 8192"):
    tiny.replace(sliding_window=9000)
  with pytest.raises(UserError, match="apply only to architecture 't5gemma'"):
    presets.get("t5_1_1.tiny").replace(num_kv_heads=2)


def test_packed_rows_equal_separate_examples():
  """Two examples packed in one row (segment ids, positions restarting: RoPE and the
  decoder start follow the positions) give each example's own logits."""
  cfg, model, params = _model_and_params("tiny_gqa")
  logits = jax.jit(model.logits)
  rng = np.random.default_rng(3)
  enc = [rng.integers(3, cfg.vocab_size, n).astype(np.int32) for n in (11, 6)]
  tgt = [rng.integers(3, cfg.vocab_size, n).astype(np.int32) for n in (10, 5)]
  alone = []
  for e, t in zip(enc, tgt):
    dec_in = np.concatenate([[0], t[:-1]]).astype(np.int32)
    alone.append(logits(params, {"encoder_input_tokens": jnp.asarray(e[None]),
                                 "decoder_input_tokens": jnp.asarray(dec_in[None])})[0])
  seg = lambda xs: np.concatenate([np.full(len(x), i + 1) for i, x in enumerate(xs)])
  pos = lambda xs: np.concatenate([np.arange(len(x)) for x in xs])
  dec_in = np.concatenate([np.concatenate([[0], t[:-1]]) for t in tgt])
  packed = {"encoder_input_tokens": np.concatenate(enc), "encoder_segment_ids": seg(enc),
            "encoder_positions": pos(enc), "decoder_input_tokens": dec_in,
            "decoder_segment_ids": seg(tgt), "decoder_positions": pos(tgt)}
  got = logits(params, {k: jnp.asarray(v[None], jnp.int32) for k, v in packed.items()})[0]
  np.testing.assert_allclose(got[:10], alone[0], atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(got[10:], alone[1], atol=2e-4, rtol=2e-4)
