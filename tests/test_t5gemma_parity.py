"""T5Gemma checkpoints and numerical parity with transformers' T5GemmaForConditionalGeneration.

Random-init models built offline from `T5GemmaConfig` (tests/hf_t5gemma_reference.py):
'mha' (a T5-size-like shape) and 'gqa' (grouped-query attention, head_dim independent of
the width, an encoder wider than the decoder, small soft-caps). Both sliding windows (6
and 5) are far below the inputs' lengths (40 encoder, 24 decoder tokens), and rows are
padded to different lengths.

Accuracy is measured against transformers in float64 (with float64 rotary angles): our
float32 run must be as close to it as transformers' own float32 run is (within 2x, plus
1e-6 absolute for rounding of near-zero maxima). Measured on AMD EPYC (CPU) — see
MEASURED below, printed with `pytest -s`.
"""
import json
import os

import jax
import numpy as np
import pytest

import t5forge
from hf_t5gemma_reference import (BOS, EOS, VARIANTS, build_hf_dir, hf_forward,
                                  hf_forward_unpadded, hf_greedy,
                                  hf_summed_log_probs, load_hf_model, random_batch, read_config,
                                  write_config, write_sentencepiece, write_tokenizer_config,
                                  write_tokenizer_json)
from t5forge.errors import UserError

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
  """Builds each variant's HF directory once per module, on first use."""
  cache = {}

  def get(name: str) -> str:
    if name not in cache:
      cache[name] = build_hf_dir(name, str(tmp_path_factory.mktemp(f"t5gemma_{name}")))
    return cache[name]

  return get


@pytest.fixture(scope="module")
def models(gemma_dirs):
  """(ours, transformers float32, transformers float64) per variant, loaded once."""
  cache = {}

  def get(name: str):
    if name not in cache:
      path = gemma_dirs(name)
      cache[name] = (t5forge.load(path), load_hf_model(path), load_hf_model(path, float64=True))
    return cache[name]

  return get


def _max_err(a, b, mask=None):
  diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  return float(diff[mask].max() if mask is not None else diff.max())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_encoder_and_logits_as_accurate_as_transformers_float32(variant, models):
  ours, hf32, hf64 = models(variant)
  cfg = ours.config
  enc, dec = random_batch(cfg.vocab_size)
  assert cfg.sliding_window < enc.shape[1] // 2 and cfg.sliding_window < dec.shape[1] // 2
  ref_enc, ref_logits = hf_forward_unpadded(hf64, enc, dec)
  hf_enc, hf_logits = hf_forward(hf32, enc, dec)
  our_enc, our_logits = ours.encode(enc), ours.logits(enc, dec)
  valid = enc != 0  # encoder outputs at padded positions are not used by anything
  errs = {"encoder": (_max_err(our_enc, ref_enc, valid), _max_err(hf_enc, ref_enc, valid)),
          "logits": (_max_err(our_logits, ref_logits), _max_err(hf_logits, ref_logits))}
  print(f"MEASURED {variant}: max abs error vs transformers float64 (ours, transformers "
        f"float32): {errs}; |logits| max {np.abs(ref_logits).max():.3f}")
  for what, (mine, theirs) in errs.items():
    assert mine <= 2 * theirs + 1e-6, (what, mine, theirs)


# The mha variant repeats what gqa shows, at another compile each (~5 s, ~15 s).
_GQA_FAST = ["gqa", pytest.param("mha", marks=pytest.mark.slow)]


@pytest.mark.parametrize("variant", _GQA_FAST)
def test_sliding_window_layers_matter(variant, models):
  """The same weights with all layers global give other logits: the inputs are long
  enough that local and global layers differ, so the parity above covers both."""
  ours, _, _ = models(variant)
  enc, dec = random_batch(ours.config.vocab_size)
  everything_global = t5forge.Model(ours.config.replace(sliding_window=None), ours.params)
  assert _max_err(everything_global.logits(enc, dec), ours.logits(enc, dec)) > 1e-2


@pytest.mark.parametrize("variant", _GQA_FAST)
def test_greedy_tokens_equal_transformers_generate(variant, models):
  ours, hf32, _ = models(variant)
  enc, _ = random_batch(ours.config.vocab_size, seed=3)
  steps = 12
  want = hf_greedy(hf32, enc, steps)
  tokens, _ = ours.predict(enc, max_decode_length=steps)
  np.testing.assert_array_equal(tokens, want)


def test_score_equals_transformers_summed_log_probs(models):
  ours, _, hf64 = models("gqa")
  rng = np.random.default_rng(5)
  inputs = [list(rng.integers(3, 256, n)) for n in (30, 11, 22)]
  targets = [list(rng.integers(3, 256, n)) for n in (9, 14, 3)]
  ours_scores = ours.score(inputs, targets)
  # Transformers' rows: the same tokens, EOS appended, 0-padded.
  width = max(len(t) for t in targets) + 1
  enc = np.zeros((3, max(len(x) for x in inputs) + 1), np.int64)
  tgt = np.zeros((3, width), np.int64)
  for r, (x, y) in enumerate(zip(inputs, targets)):
    enc[r, :len(x) + 1] = x + [EOS]
    tgt[r, :len(y) + 1] = y + [EOS]
  want = hf_summed_log_probs(hf64, enc, tgt)
  np.testing.assert_allclose(ours_scores, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_export_loads_in_transformers_with_the_same_logits(variant, models, tmp_path):
  ours, _, _ = models(variant)
  out = str(tmp_path / "exported")
  ours.save_hf(out)
  reloaded = load_hf_model(out)
  enc, dec = random_batch(ours.config.vocab_size, seed=1)
  _, hf_logits = hf_forward(reloaded, enc, dec)
  np.testing.assert_allclose(ours.logits(enc, dec), hf_logits, rtol=1e-5, atol=1e-5)
  again = t5forge.load(out)
  assert again.config == ours.config
  for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_safetensors_read_and_written(gemma_dirs, tmp_path):
  """transformers' sharded save reads as the single file does; ours writes shards with an
  index that transformers and we read back."""
  from t5forge.convert import hf
  single = t5forge.convert.load_checkpoint(gemma_dirs("gqa"))
  sharded_dir = build_hf_dir("gqa", str(tmp_path / "sharded"), max_shard_size="100KB")
  assert os.path.isfile(os.path.join(sharded_dir, "model.safetensors.index.json"))
  sharded = t5forge.convert.load_checkpoint(sharded_dir)
  for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
    np.testing.assert_array_equal(a, b)
  out = str(tmp_path / "ours_sharded")
  hf.save_hf(single.params, single.config, out, max_shard_bytes=100_000)
  names = sorted(os.listdir(out))
  shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
  assert len(shards) > 2 and "model.safetensors.index.json" in names, names
  back = t5forge.convert.load_checkpoint(out)
  for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(a, b)
  enc, dec = random_batch(256, batch=2, enc_len=12, dec_len=7)
  np.testing.assert_allclose(hf_forward(load_hf_model(out), enc, dec)[1],
                             hf_forward(load_hf_model(sharded_dir), enc, dec)[1], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# Tokenizers.

@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("gemma_tokenizers")
  return {"model": write_sentencepiece(str(d / "tokenizer.model"), 256),
          "json": write_tokenizer_json(str(d / "tokenizer.json"), 256),
          "small": write_sentencepiece(str(d / "small.model"), 200)}


def _dir_with(gemma_dirs, tmp_path, files: dict) -> str:
  """A copy of the mha directory (config + weights) with the given tokenizer files."""
  import shutil
  d = str(tmp_path / "with_tokenizer")
  shutil.copytree(gemma_dirs("mha"), d)
  for name, src in files.items():
    shutil.copy(src, os.path.join(d, name))
  write_tokenizer_config(d)
  return d


def test_tokenizer_model_read_with_sentencepiece(gemma_dirs, tokenizer_files, tmp_path):
  from t5forge.data import vocab_io
  from t5forge.data.vocab import SentencePieceVocabulary
  d = _dir_with(gemma_dirs, tmp_path, {"tokenizer.model": tokenizer_files["model"],
                                       "tokenizer.json": tokenizer_files["json"]})
  m = t5forge.load(d)
  vocab = m.vocabulary
  assert isinstance(vocab, SentencePieceVocabulary)  # preferred over tokenizer.json
  assert (vocab.vocab_size, vocab.pad_id, vocab.eos_id, vocab.bos_id) == (256, 0, 1, BOS)
  ids = vocab.encode("In the beginning God created the heavens")
  assert ids and min(ids) > 3 and vocab.decode(ids + [EOS, 77]) == (
      "In the beginning God created the heavens")
  out = str(tmp_path / "exported")
  m.save_hf(out)  # the tokenizer files, byte for byte
  for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(d, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
      assert a.read() == b.read(), name
  assert vocab_io.from_checkpoint(out) == vocab


def test_tokenizer_json_read_with_tokenizers_as_transformers_reads_it(gemma_dirs,
                                                                     tokenizer_files, tmp_path):
  import transformers
  from t5forge.data import vocab_io
  from t5forge.data.vocab import TokenizersVocabulary
  d = _dir_with(gemma_dirs, tmp_path, {"tokenizer.json": tokenizer_files["json"]})
  vocab = vocab_io.from_checkpoint(d)
  assert isinstance(vocab, TokenizersVocabulary)
  assert (vocab.vocab_size, vocab.eos_id, vocab.bos_id, vocab.unk_id) == (256, 1, BOS, 3)
  text = "And God said, Let there be light: and there was light."
  theirs = transformers.AutoTokenizer.from_pretrained(d)
  assert vocab.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
  assert vocab.decode(vocab.encode(text) + [EOS, 9]) == theirs.decode(
      vocab.encode(text), skip_special_tokens=True)
  # Saved with a t5forge checkpoint (its spec) and back: the same vocabulary.
  again = vocab_io.from_spec(vocab_io.to_spec(vocab))
  assert again == vocab and vocab_io.difference(again, vocab) is None
  assert "tokenizers 256 ids" in vocab_io.describe(vocab)


@pytest.mark.parametrize("tokenizer,kind", [("tokenizer.json", "tokenizers"),
                                            ("tokenizer.model", "sentencepiece")])
def test_convert_cli_to_t5forge_and_back_to_hf_keeps_weights_and_tokenizer(
    gemma_dirs, tokenizer_files, tmp_path, capsys, tokenizer, kind):
  """`t5forge convert`: T5Gemma HF dir (one tokenizer file) -> t5forge checkpoint (the
  tokenizer inside its vocabulary spec) -> HF dir again: same weights, same tokenizer."""
  from t5forge.cli import convert as convert_cli
  d = _dir_with(gemma_dirs, tmp_path, {tokenizer: tokenizer_files[tokenizer.split(".")[1]]})
  native_dir, hf_dir = str(tmp_path / "native"), str(tmp_path / "back")
  assert convert_cli.main(["--input", d, "--output", native_dir, "--to", "t5forge"]) == 0
  assert convert_cli.main(["--input", native_dir, "--output", hf_dir, "--to", "hf"]) == 0
  assert f"with its vocabulary ({kind} 256 ids" in capsys.readouterr().out
  first, last = (t5forge.convert.load_checkpoint(p) for p in (d, hf_dir))
  assert last.config == first.config
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(last.params)):
    np.testing.assert_array_equal(a, b)
  with open(os.path.join(d, tokenizer), "rb") as a, open(
      os.path.join(hf_dir, tokenizer), "rb") as b:
    assert a.read() == b.read()
  from t5forge.data import vocab_io
  vocab = vocab_io.from_checkpoint(hf_dir)
  assert vocab == vocab_io.from_checkpoint(d)
  if kind == "tokenizers":
    # (transformers turns a tokenizer.model into its GemmaTokenizer assuming Gemma's own
    # settings, which this small unigram test model does not have; not compared.)
    import transformers
    text = "Now the earth was formless and empty."
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert theirs(text, add_special_tokens=False)["input_ids"] == vocab.encode(text)


def test_tokenizer_missing_or_of_the_wrong_size_is_one_line(gemma_dirs, tokenizer_files,
                                                            tmp_path):
  from t5forge.data import vocab_io
  wrong = _dir_with(gemma_dirs, tmp_path, {"tokenizer.model": tokenizer_files["small"]})
  with pytest.raises(UserError, match=r"tokenizer.model: 200 ids, but config.json's "
                                      r"vocab_size is 256") as e:
    t5forge.load(wrong)
  assert "\n" not in str(e.value)
  os.remove(os.path.join(wrong, "tokenizer.model"))  # only tokenizer_config.json is left
  with pytest.raises(UserError, match="neither tokenizer.model nor tokenizer.json") as e:
    vocab_io.from_checkpoint(wrong)
  assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------
# Bad input.

def _edited(gemma_dirs, tmp_path, edit) -> str:
  import shutil
  d = str(tmp_path / "edited")
  shutil.copytree(gemma_dirs("gqa"), d)
  cfg = read_config(d)
  edit(cfg)
  write_config(d, cfg)
  return d


@pytest.mark.parametrize("edit,first", [
    (lambda c: c["decoder"].update(intermediate_size=64),
     "'model.decoder.layers.0.mlp.gate_proj.weight' has shape (80, 48), but config.json "
     "implies (64, 48)"),
    (lambda c: c["encoder"].update(num_key_value_heads=4),
     "'model.encoder.layers.0.self_attn.k_proj.weight' has shape (48, 64), but config.json "
     "implies (96, 64)"),
    (lambda c: c["encoder"].update(num_hidden_layers=4, layer_types=[
        "sliding_attention", "full_attention"] * 2),
     "config.json: encoder.num_hidden_layers is 4, but the weights hold 3 encoder layers"),
])
def test_nested_config_that_disagrees_with_the_weights_names_the_first_weight(
    gemma_dirs, tmp_path, edit, first):
  d = _edited(gemma_dirs, tmp_path, edit)
  with pytest.raises(UserError) as e:
    t5forge.convert.load_checkpoint(d)
  assert first in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("edit,says", [
    (lambda c: c["encoder"].update(vocab_size=300), "vocab_size differs"),
    (lambda c: c["decoder"].update(layer_types=["full_attention"] * 2), "layer_types"),
    (lambda c: c.pop("decoder"), "no nested 'decoder' config"),
    (lambda c: c["decoder"].update(sliding_window=600), "sliding_window"),
    (lambda c: c["encoder"].update(num_attention_heads=3), "encoder.num_attention_heads 3 is "
     "not a multiple of encoder.num_key_value_heads 2"),
])
def test_config_t5forge_cannot_represent_is_one_line(gemma_dirs, tmp_path, edit, says):
  d = _edited(gemma_dirs, tmp_path, edit)
  with pytest.raises(UserError, match=says) as e:
    t5forge.convert.load_checkpoint(d)
  assert "\n" not in str(e.value)


def test_t5_checkpoint_given_to_a_t5gemma_model_names_the_first_parameter(hf_dirs, models):
  """As INITIAL_CHECKPOINT_PATH of a training run and as the checkpoint of `t5forge infer`
  with a T5Gemma model gin: one line naming both architectures and the first parameter."""
  from t5forge import models as model_lib
  from t5forge import opener
  from t5forge.train.checkpoint import initial_params
  from t5forge.train.settings import RestoreCheckpointConfig
  ours, _, _ = models("mha")
  t5_dir = hf_dirs("t5_1_0")
  says = (r"\(a encoder_decoder checkpoint, the model is t5gemma\): .*parameter "
          r"'(encoder|decoder)/[\w/]+'")
  with pytest.raises(UserError, match=says) as e:
    opener.open_checkpoint(t5_dir, model=model_lib.model_for(ours.config))
  assert "\n" not in str(e.value)
  with pytest.raises(UserError, match=says) as e:
    initial_params(RestoreCheckpointConfig(path=t5_dir), ours.params, model_config=ours.config)
  assert "\n" not in str(e.value)


def test_export_config_is_what_transformers_writes(models, tmp_path):
  """Our config.json reads back as transformers' own config of the same model."""
  import transformers
  from hf_t5gemma_reference import hf_config
  ours, _, _ = models("gqa")
  out = str(tmp_path / "cfg")
  ours.save_hf(out)
  theirs = hf_config("gqa")
  loaded = transformers.T5GemmaConfig.from_pretrained(out)
  for side in ("encoder", "decoder"):
    a, b = getattr(loaded, side), getattr(theirs, side)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window",
                  "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                  "rms_norm_eps", "bos_token_id", "rope_parameters"):
      assert getattr(a, field) == getattr(b, field), (side, field)
  assert loaded.decoder.cross_attention_hidden_size == 64
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f)["decoder_start_token_id"] == BOS


@pytest.mark.parametrize("scan_layers", [False, True])
def test_initial_checkpoint_path_starts_training_from_the_hf_weights(gemma_dirs, scan_layers):
  """INITIAL_CHECKPOINT_PATH = a T5Gemma HF directory: the model gin's parameters (either
  layout) are the directory's weights, nothing initialised fresh."""
  from t5forge.nn import abstract_params
  from t5forge.train.checkpoint import initial_params
  from t5forge.train.settings import RestoreCheckpointConfig
  path = gemma_dirs("gqa")
  want = t5forge.convert.load_checkpoint(path, scan_layers=scan_layers)
  config = want.config
  fresh = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config))
  params, step, scratch, notes = initial_params(RestoreCheckpointConfig(path=path), fresh,
                                                model_config=config)
  assert (step, scratch, notes) == (0, [], [])
  for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_untied_output_layer_read_and_written(tmp_path):
  """tie_word_embeddings false (no released model has it): a separate lm_head is read as
  decoder/logits_dense, gives transformers' logits and is written back untied."""
  path = build_hf_dir("mha", str(tmp_path / "untied"), tied=False)
  ours = t5forge.load(path)
  assert not ours.config.logits_via_embedding
  enc, dec = random_batch(ours.config.vocab_size, batch=2, enc_len=20, dec_len=9)
  want = hf_forward(load_hf_model(path), enc, dec)[1]
  np.testing.assert_allclose(ours.logits(enc, dec), want, rtol=1e-5, atol=1e-5)
  out = str(tmp_path / "exported")
  ours.save_hf(out)
  assert read_config(out)["tie_word_embeddings"] is False
  np.testing.assert_allclose(hf_forward(load_hf_model(out), enc, dec)[1], want, rtol=0, atol=0)
