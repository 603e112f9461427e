"""T5Gemma 2 (text) checkpoints and numerical parity with transformers'
T5Gemma2ForConditionalGeneration.

One random-init model built offline from `T5Gemma2Config` (tests/hf_t5gemma2_reference.py):
7 layers in Gemma 3's 5 local : 1 global pattern, grouped-query attention, head_dim
independent of the width, window 6 far below the inputs' lengths (40 encoder, 24 decoder
tokens), two RoPE bases, the end-of-image token in the inputs, rows padded to different
lengths. Accuracy is measured against transformers in float64 (float64 rotary angles):
our float32 run must be as close to it as transformers' own float32 run is (within 2x,
plus 1e-6 absolute). Numbers: MEASURED, printed with `pytest -s`.
"""
import json
import os

import jax
import numpy as np
import pytest

import t5forge
from hf_t5gemma2_reference import (BOS, EOI, EOS, build_hf_dir, hf_forward, hf_forward_unpadded,
                                   hf_greedy, load_hf_model, random_batch)
from t5forge.errors import UserError

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return build_hf_dir(str(tmp_path_factory.mktemp("t5gemma2")))


@pytest.fixture(scope="module")
def models(hf_dir):
  """(ours, transformers float32, transformers float64)."""
  return t5forge.load(hf_dir), load_hf_model(hf_dir), load_hf_model(hf_dir, float64=True)


def _max_err(a, b, mask=None):
  diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  return float(diff[mask].max() if mask is not None else diff.max())


def test_config_read_from_the_nested_configs(models):
  cfg = models[0].config
  assert cfg.architecture == "t5gemma2"
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.query_pre_attn_scalar) == (4, 2, 24, 20)
  assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
  assert cfg.sliding_layers(7) == (True,) * 5 + (False, True)
  assert (cfg.eoi_token_id, cfg.decoder_start_token_id, cfg.sliding_window) == (EOI, BOS, 6)


def test_encoder_and_logits_as_accurate_as_transformers_float32(models):
  ours, hf32, hf64 = models
  enc, dec = random_batch()
  ref_enc, ref_logits = hf_forward_unpadded(hf64, enc, dec)
  hf_enc, hf_logits = hf_forward(hf32, enc, dec)
  our_enc, our_logits = ours.encode(enc), ours.logits(enc, dec)
  valid = enc != 0  # encoder outputs at padded positions are not used by anything
  errs = {"encoder": (_max_err(our_enc, ref_enc, valid), _max_err(hf_enc, ref_enc, valid)),
          "logits": (_max_err(our_logits, ref_logits), _max_err(hf_logits, ref_logits))}
  print(f"MEASURED t5gemma2: max abs error vs transformers float64 (ours, transformers "
        f"float32): {errs}; |logits| max {np.abs(ref_logits).max():.3f}")
  for what, (mine, theirs) in errs.items():
    assert mine <= 2 * theirs + 1e-6, (what, mine, theirs)


def test_linear_rope_scaling_of_global_layers_as_transformers(tmp_path):
  """rope_parameters.full_attention {'rope_type': 'linear', 'factor': 8} (Gemma 3 4B's
  form) reads as rope_scaling_factor 8, gives transformers' logits and is written back."""
  rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
  d = build_hf_dir(str(tmp_path / "linear"), seed=1, rope_parameters=rope)
  ours, hf32, hf64 = t5forge.load(d), load_hf_model(d), load_hf_model(d, float64=True)
  assert ours.config.rope_scaling_factor == 8.0
  enc, dec = random_batch(batch=1)
  _, ref = hf_forward(hf64, enc, dec)
  _, theirs = hf_forward(hf32, enc, dec)
  mine = ours.logits(enc, dec)
  assert _max_err(mine, ref) <= 2 * _max_err(theirs, ref) + 1e-6
  unscaled = t5forge.Model(ours.config.replace(rope_scaling_factor=None), ours.params)
  assert _max_err(unscaled.logits(enc, dec), ref) > 1e-2
  ours.save_hf(str(tmp_path / "out"))
  assert t5forge.load(str(tmp_path / "out")).config == ours.config


@pytest.mark.parametrize("change", [dict(sliding_window=None), dict(rope_local_theta=1e6),
                                    dict(eoi_token_id=None), dict(sliding_window_pattern=2)])
def test_each_feature_changes_the_logits(change, models):
  """Windows, the local RoPE base, the eoi vector and the 5:1 pattern each matter for
  these inputs, so the parity above covers them."""
  ours, _, _ = models
  enc, dec = random_batch()
  params = dict(ours.params)
  if change.get("eoi_token_id", 0) is None:
    params.pop("eoi_embedding")
  other = t5forge.Model(ours.config.replace(**change), params)
  assert _max_err(other.logits(enc, dec), ours.logits(enc, dec)) > 1e-2


def test_scanned_layers_equal_the_loop(models):
  from t5forge.nn import stack
  ours, _, _ = models
  enc, dec = random_batch()
  scanned = t5forge.Model(ours.config.replace(scan_layers=True, remat_policy="full"),
                          stack.stack_layers(jax.tree.map(np.asarray, ours.params)))
  np.testing.assert_allclose(scanned.logits(enc, dec), ours.logits(enc, dec), atol=2e-5)


@pytest.mark.slow  # 45 s on the shared 2-core AMD EPYC (compiles the Adafactor train step)
def test_training_steps_lower_the_loss(hf_dir):
  """Gradients flow through the merged attention, the shared embedding and the eoi
  vector: three Adafactor steps on one batch lower its loss."""
  model = t5forge.load(hf_dir)
  rng = np.random.default_rng(7)
  examples = [{"inputs": list(rng.integers(3, 256, 20)) + [EOI],
               "targets": list(rng.integers(3, 256, 12))} for _ in range(4)]
  losses = [model.train_step(examples, learning_rate=1e-2)["loss"] for _ in range(4)]
  print(f"MEASURED t5gemma2 train_step losses: {losses}")
  assert losses[-1] < losses[0] - 0.1, losses


def test_greedy_tokens_equal_transformers_generate(models):
  """Cached decoding past the window: the merged attention's cache holds the decoder's
  and the encoder's keys/values."""
  ours, hf32, _ = models
  enc, _ = random_batch(seed=3)
  want = hf_greedy(hf32, enc, 12)
  tokens, _ = ours.predict(enc, max_decode_length=12)
  np.testing.assert_array_equal(tokens, want)


@pytest.mark.slow  # 20-45 s on the shared 2-core AMD EPYC (compiles beam search)
def test_beam_search_over_the_merged_cache_scores_its_beams(models):
  """Beams expand and reorder both caches (decoder and encoder keys/values) on the batch
  axis: the best beam's score is its teacher-forced log-likelihood (alpha 0)."""
  import jax.numpy as jnp
  from t5forge import decoding
  ours, _, _ = models
  model, params = ours.model, ours.params
  enc, _ = random_batch(seed=4)
  batch = {"encoder_input_tokens": jnp.asarray(enc),
           "decoder_input_tokens": jnp.zeros((3, 10), jnp.int32),
           "decoder_target_tokens": jnp.zeros((3, 10), jnp.int32)}
  beams, aux = model.predict_batch_with_aux(params, batch, decode_fn=decoding.beam_search,
                                            decoder_params={"alpha": 0.0}, num_decodes=3,
                                            return_all_decodes=True)
  best = beams[:, -1]
  dec_in = jnp.concatenate([jnp.zeros((3, 1), jnp.int32), best[:, :-1]], axis=1)
  ll = model.score_batch(params, {**batch, "decoder_input_tokens": dec_in,
                                  "decoder_target_tokens": best})
  np.testing.assert_allclose(aux["scores"][:, -1], ll, atol=1e-3, rtol=1e-4)


@pytest.mark.slow  # 35-60 s on the shared 2-core AMD EPYC (three more compiles)
def test_bfloat16_and_int8_stay_close_to_float32(models):
  from t5forge.nn import quant
  ours, _, _ = models
  enc, dec = random_batch()
  ref = jax.nn.log_softmax(ours.logits(enc, dec))
  for cfg, params in ((ours.config.replace(dtype="bfloat16"), ours.params),
                      (ours.config.replace(weight_dtype="int8"),
                       quant.quantize_params(ours.params))):
    got = jax.nn.log_softmax(t5forge.Model(cfg, params).logits(enc, dec))
    # Mean absolute log-prob error: rounding, not a wrong network.
    err = float(np.mean(np.abs(np.exp(ref) * (got - ref)).sum(-1)))
    assert err < 0.05, (cfg.dtype, cfg.weight_dtype, err)
  # bfloat16 decoding over the GQA caches runs (XLA:CPU once lacked a bf16 dot there)
  # and mostly picks float32's tokens.
  enc, _ = random_batch(seed=3)
  want, _ = ours.predict(enc, max_decode_length=8)
  got, _ = t5forge.Model(ours.config.replace(dtype="bfloat16"), ours.params).predict(
      enc, max_decode_length=8)
  assert np.mean(np.asarray(got) == np.asarray(want)) >= 0.75


def test_parameter_counts_equal_transformers_text_model():
  """jax.eval_shape counts (no memory) against transformers' model on the meta device,
  its vision tower and projector left out: the tiny preset and a Gemma 3 1B-shaped
  config (26 layers, width 1152, 4 heads over 1, head_dim 256, 262,144 ids)."""
  import torch
  import transformers
  from t5forge import presets
  from t5forge.convert.hf import t5gemma2 as hf_t5gemma2
  tiny = presets.get("t5gemma2.tiny")
  big = tiny.replace(vocab_size=262144, emb_dim=1152, num_heads=4, num_kv_heads=1,
                     head_dim=256, mlp_dim=6912, num_encoder_layers=26, num_decoder_layers=26,
                     query_pre_attn_scalar=256, sliding_window=512, eoi_token_id=256000)
  for cfg in (tiny, big):
    with torch.device("meta"):
      model = transformers.T5Gemma2ForConditionalGeneration(
          transformers.T5Gemma2Config.from_dict(hf_t5gemma2.hf_config_from(cfg)))
    want = sum(p.numel() for n, p in model.named_parameters()
               if not n.startswith(tuple("model." + v[len("model."):]
                                         for v in ("model.encoder.vision_tower.",
                                                   "model.encoder.multi_modal_projector."))))
    if cfg.eoi_token_id is None:  # transformers always holds the eoi vector
      want -= cfg.emb_dim
    assert t5forge.nn.count_params(t5forge.nn.abstract_params(cfg)) == want


def test_score_equals_transformers_summed_log_probs(models):
  from hf_t5gemma_reference import hf_summed_log_probs
  ours, _, hf64 = models
  rng = np.random.default_rng(5)
  inputs = [list(rng.integers(3, 256, n)) for n in (30, 11, 22)]
  targets = [list(rng.integers(3, 256, n)) for n in (9, 14, 3)]
  got = ours.score(inputs, targets)
  enc = np.zeros((3, 31), np.int64)  # transformers' rows: EOS appended, 0-padded
  tgt = np.zeros((3, 15), np.int64)
  for r, (x, y) in enumerate(zip(inputs, targets)):
    enc[r, :len(x) + 1] = x + [EOS]
    tgt[r, :len(y) + 1] = y + [EOS]
  np.testing.assert_allclose(got, hf_summed_log_probs(hf64, enc, tgt), rtol=1e-5, atol=1e-4)


def test_packed_rows_equal_separate_examples(models):
  """Two examples packed in one row (segment ids, restarting positions; windows shorter
  than the segments) give each example's own logits: the merged attention's encoder part
  is masked by segment too."""
  import jax.numpy as jnp
  ours, _, _ = models
  logits = jax.jit(ours.model.logits)
  rng = np.random.default_rng(3)
  enc = [rng.integers(3, 256, n).astype(np.int32) for n in (11, 9)]
  tgt = [rng.integers(3, 256, n).astype(np.int32) for n in (10, 8)]
  alone = [logits(ours.params, {"encoder_input_tokens": jnp.asarray(e[None]),
                                "decoder_input_tokens": jnp.asarray(
                                    np.concatenate([[0], t[:-1]])[None], jnp.int32)})[0]
           for e, t in zip(enc, tgt)]
  seg = lambda xs: np.concatenate([np.full(len(x), i + 1) for i, x in enumerate(xs)])
  pos = lambda xs: np.concatenate([np.arange(len(x)) for x in xs])
  packed = {"encoder_input_tokens": np.concatenate(enc), "encoder_segment_ids": seg(enc),
            "encoder_positions": pos(enc),
            "decoder_input_tokens": np.concatenate([np.concatenate([[0], t[:-1]]) for t in tgt]),
            "decoder_segment_ids": seg(tgt), "decoder_positions": pos(tgt)}
  got = logits(ours.params, {k: jnp.asarray(v[None], jnp.int32) for k, v in packed.items()})[0]
  np.testing.assert_allclose(got[:10], alone[0], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got[10:], alone[1], atol=2e-5, rtol=2e-5)


def test_export_loads_in_transformers_with_the_same_logits(models, tmp_path):
  ours, _, _ = models
  out = str(tmp_path / "exported")
  ours.save_hf(out)
  reloaded = load_hf_model(out)
  enc, dec = random_batch(seed=1)
  _, hf_logits = hf_forward(reloaded, enc, dec)
  np.testing.assert_allclose(ours.logits(enc, dec), hf_logits, rtol=1e-5, atol=1e-5)
  again = t5forge.load(out)
  assert again.config == ours.config
  for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_convert_cli_to_t5forge_and_back_to_hf_keeps_weights_and_tokenizer(
    hf_dir, tmp_path, capsys):
  """`t5forge convert`: T5Gemma 2 HF dir with a tokenizer.json -> t5forge checkpoint ->
  HF dir again: the same weights and tokenizer; the note says the vision tower is not."""
  import shutil
  from hf_t5gemma_reference import (
      write_tokenizer_config, write_tokenizer_json)
  from t5forge.cli import convert as convert_cli
  d = str(tmp_path / "with_tokenizer")
  shutil.copytree(hf_dir, d)
  write_tokenizer_json(os.path.join(d, "tokenizer.json"), 256)
  write_tokenizer_config(d)
  native_dir, back = str(tmp_path / "native"), str(tmp_path / "back")
  assert convert_cli.main(["--input", d, "--output", native_dir, "--to", "t5forge"]) == 0
  assert convert_cli.main(["--input", native_dir, "--output", back, "--to", "hf"]) == 0
  assert "placeholder vision tower" in capsys.readouterr().out
  first, last = (t5forge.convert.load_checkpoint(p) for p in (d, back))
  assert last.config == first.config
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(last.params)):
    np.testing.assert_array_equal(a, b)
  with open(os.path.join(d, "tokenizer.json"), "rb") as a, open(
      os.path.join(back, "tokenizer.json"), "rb") as b:
    assert a.read() == b.read()


def test_eos_ids_from_generation_config_round_trip(hf_dir, tmp_path):
  """generation_config.json's eos list (<eos> 1, Gemma 3's <end_of_turn> 106) becomes
  eos_token_ids and is written back."""
  import shutil
  d = str(tmp_path / "it")
  shutil.copytree(hf_dir, d)
  with open(os.path.join(d, "generation_config.json"), encoding="utf-8") as f:
    gen = json.load(f)
  with open(os.path.join(d, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump({**gen, "eos_token_id": [1, 106]}, f)
  model = t5forge.load(d)
  assert model.config.eos_token_ids == (1, 106)
  model.save_hf(str(tmp_path / "out"))
  with open(tmp_path / "out" / "generation_config.json", encoding="utf-8") as f:
    assert json.load(f)["eos_token_id"] == [1, 106]
  assert t5forge.load(str(tmp_path / "out")).config == model.config


def test_vision_weights_are_skipped(hf_dir):
  """The saved directory holds a vision tower and projector; reading keeps the text."""
  from t5forge.convert import hf
  from t5forge.convert.hf import t5gemma2 as hf_t5gemma2
  names = hf.load_hf_state(hf_dir)
  vision = [n for n in names if n.startswith(hf_t5gemma2.VISION_PREFIXES)]
  assert vision and "model.encoder.embed_tokens.eoi_embedding" in names
  _, params = hf.load_hf(hf_dir)
  assert t5forge.nn.count_params(params) == sum(
      v.size for n, v in names.items() if n not in vision)


def _edit(hf_dir, tmp_path, edit):
  import shutil
  out = str(tmp_path / "edited")
  shutil.copytree(hf_dir, out)
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    cfg = json.load(f)
  edit(cfg)
  with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
    json.dump(cfg, f)
  return out


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["decoder"].update(attn_logit_softcapping=50.0), "ignores it"),
    (lambda c: c.update(tie_word_embeddings=False), "tie_word_embeddings false"),
    (lambda c: c["decoder"].update(layer_types=["full_attention"] + ["sliding_attention"] * 6),
     "layer_types"),
    (lambda c: c["decoder"]["rope_parameters"]["full_attention"].update(
        rope_type="dynamic", factor=8.0), "rope_parameters.full_attention type 'dynamic'"),
])
def test_configs_we_cannot_represent_are_one_line_errors(edit, words, hf_dir, tmp_path):
  with pytest.raises(UserError) as err:
    t5forge.load(_edit(hf_dir, tmp_path, edit))
  assert words in str(err.value) and "\n" not in str(err.value)


def test_config_errors_name_the_field():
  from t5forge.nn.config import ModelConfig
  base = dict(vocab_size=256, emb_dim=64, num_heads=4, head_dim=16, mlp_dim=96,
              num_encoder_layers=2, num_decoder_layers=2, architecture="t5gemma2",
              logits_via_embedding=True, scale_logits=False)
  ModelConfig(**base)
  for change, words in ((dict(logits_via_embedding=False), "logits_via_embedding"),
                        (dict(encoder_emb_dim=32), "encoder_emb_dim 32"),
                        (dict(eoi_token_id=256), "eoi_token_id 256")):
    with pytest.raises(UserError, match=words):
      ModelConfig(**{**base, **change})
  with pytest.raises(UserError, match="apply only to architecture 't5gemma2'"):
    ModelConfig(**{**base, "architecture": "t5gemma", "rope_local_theta": 1e4})
