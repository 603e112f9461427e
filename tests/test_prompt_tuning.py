"""Prompt tuning (t5forge/nn/prompt.py) against Hugging Face peft's PROMPT_TUNING on
transformers' T5ForConditionalGeneration (a random-init flan-shaped model built offline):
a peft prompt read into t5forge gives peft's logits and greedy tokens, ours written as
peft loads in peft with the same logits; the initialisations, the masks, the formats
and the bad inputs.

Achieved on this machine (float32, CPU): logits agree to about 1e-6; asserted at 1e-4.
"""
import json
import os
import warnings

import jax
import numpy as np
import pytest

import t5forge
from hf_reference import load_hf_model, random_batch
from t5forge import nn as t5nn
from t5forge import presets
from t5forge.errors import UserError
from t5forge.nn import prompt as prompt_lib
from t5forge.nn.prompt import PromptConfig

TOL = dict(rtol=1e-4, atol=1e-4)
P = 5  # prompt length


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """(HF directory, our model of it) for the flan-shaped variant (untied, gated GELU)."""
  from hf_reference import build_hf_dir
  path = build_hf_dir("flan", str(tmp_path_factory.mktemp("hf_flan")))
  return path, t5forge.load(path)


def _with_prompt(model, cfg: PromptConfig, prompt) -> t5forge.Model:
  params = prompt_lib.with_prompt(jax.device_get(model.params), prompt)
  return t5forge.Model(model.config.replace(prompt=cfg), params, vocabulary=model.vocabulary)


def _peft_logits(peft_model, enc, dec):
  import torch
  enc_t = torch.tensor(enc, dtype=torch.long)
  with torch.no_grad():
    out = peft_model(input_ids=enc_t, attention_mask=(enc_t > 0).long(),
                     decoder_input_ids=torch.tensor(dec, dtype=torch.long))
  return out.logits.float().numpy()


@pytest.fixture(scope="module")
def peft_dir(base, tmp_path_factory):
  """A peft PROMPT_TUNING adapter of the HF base with random (not initial) prompt rows,
  saved by peft's save_pretrained; (directory, the peft model)."""
  import torch
  from peft import PromptTuningConfig, get_peft_model
  path, _ = base
  hf = load_hf_model(path)
  config = PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=P,
                              num_transformer_submodules=1)
  peft_model = get_peft_model(hf, config).eval()
  torch.manual_seed(3)
  with torch.no_grad():
    emb = peft_model.prompt_encoder["default"].embedding.weight
    emb.copy_(torch.randn_like(emb))
  out = str(tmp_path_factory.mktemp("peft_prompt"))
  peft_model.save_pretrained(out)
  return out, peft_model


@pytest.mark.slow
def test_a_peft_prompt_gives_peft_logits_and_greedy_tokens(base, peft_dir):
  _, ours = base
  out, peft_model = peft_dir
  with open(os.path.join(out, "adapter_config.json")) as f:
    assert json.load(f)["peft_type"] == "PROMPT_TUNING"
  cfg, prompt = prompt_lib.from_peft(out, ours.config)
  assert cfg.length == P and prompt.shape == (P, ours.config.emb_dim)
  tuned = _with_prompt(ours, cfg, prompt)
  # Rows padded to different lengths: the prompt's positions are counted by the masks.
  enc, dec = random_batch(ours.config.vocab_size, enc_len=50, dec_len=20)
  want = _peft_logits(peft_model, enc, dec)
  np.testing.assert_allclose(tuned.logits(enc, dec), want, **TOL)
  # The prompt changes the logits: the comparison is not the base model's against itself.
  assert np.abs(ours.logits(enc, dec) - want).max() > 1e-2
  # The encoder output keeps the prompt's positions, as peft's (and T5X's) encoders.
  assert tuned.encode(enc).shape == (enc.shape[0], P + enc.shape[1], ours.config.emb_dim)
  # Greedy through peft's forward (peft's generate() for seq2seq prompts fails on this
  # transformers' cache), one argmax per step.
  hf_tokens = np.zeros((enc.shape[0], 1), np.int32)
  for _ in range(8):
    step = _peft_logits(peft_model, enc, hf_tokens)[:, -1].argmax(-1).astype(np.int32)
    hf_tokens = np.concatenate([hf_tokens, step[:, None]], axis=1)
  tokens, _ = tuned.predict(enc, max_decode_length=8)
  hf_tokens = hf_tokens[:, 1:]  # without the decoder start token
  ends = []
  for ours_row, hf_row in zip(tokens, hf_tokens):
    ends.append(list(hf_row).index(1) + 1 if 1 in hf_row else len(hf_row))  # through EOS
    assert list(ours_row[:ends[-1]]) == list(hf_row[:ends[-1]])
  assert max(ends) >= 4, hf_tokens  # some row decoded several tokens


def test_our_prompt_written_as_peft_loads_in_peft(base, tmp_path):
  from peft import PeftModel
  path, ours = base
  cfg = PromptConfig(length=P, init="sampled_vocab")
  prompt = prompt_lib.initialize(cfg, ours.params, rng=jax.random.key(7))
  prompt = prompt + np.random.default_rng(0).normal(size=prompt.shape).astype(np.float32)
  out = str(tmp_path / "ours_as_peft")
  prompt_lib.to_peft(out, prompt, ours.config, base_model_name_or_path=path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    peft_model = PeftModel.from_pretrained(load_hf_model(path), out).eval()
  # peft warns of missing or unexpected adapter keys; it loaded ours without any.
  assert not [w for w in caught if "keys" in str(w.message).lower()], [
      str(w.message) for w in caught]
  loaded = peft_model.prompt_encoder["default"].embedding.weight.detach().numpy()
  np.testing.assert_array_equal(loaded, prompt)
  enc, dec = random_batch(ours.config.vocab_size, enc_len=30, dec_len=12, seed=2)
  np.testing.assert_allclose(_with_prompt(ours, cfg, prompt).logits(enc, dec),
                             _peft_logits(peft_model, enc, dec), **TOL)
  # And back: from_peft reads what to_peft wrote, bit for bit.
  cfg_back, back = prompt_lib.from_peft(out, ours.config)
  assert cfg_back.length == P
  np.testing.assert_array_equal(back, prompt)


def test_padding_does_not_change_a_rows_logits(base):
  """The masks: a row padded to a longer batch keeps its logits (the prompt's p
  positions are real keys, the padding after the inputs is not)."""
  _, ours = base
  cfg = PromptConfig(length=P)
  tuned = _with_prompt(ours, cfg, np.random.default_rng(1).normal(
      size=(P, ours.config.emb_dim)).astype(np.float32))
  row = np.array([[7, 8, 9, 10, 11]], np.int32)
  dec = np.array([[0, 5, 6, 7]], np.int32)
  alone = tuned.logits(row, dec)
  padded = np.zeros((2, 12), np.int32)
  padded[0, :5] = row[0]
  padded[1] = np.arange(3, 15)
  np.testing.assert_allclose(tuned.logits(padded, np.repeat(dec, 2, 0))[:1], alone,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["t5gemma.tiny", "t5gemma2.tiny"])
@pytest.mark.slow
def test_the_prompt_is_scaled_as_the_token_embeddings_in_t5gemma(family):
  """T5Gemma's sqrt(e) embedding scale applies to the prompt too: a prompt equal to some
  tokens' embedding rows encodes exactly as those tokens do."""
  cfg = presets.get(family).replace(dropout_rate=0.0, prompt=PromptConfig(length=3))
  net = t5nn.build(cfg)
  params = t5nn.init_params(cfg, jax.random.key(0))
  table = prompt_lib.embedding_table(params)
  ids = np.array([11, 12, 13])
  params = prompt_lib.with_prompt(params, table[ids])
  enc = np.array([[20, 21, 22, 0]], np.int32)
  with_prompt = net.apply({"params": params}, enc, method=net.encode)
  plain_cfg = cfg.replace(prompt=None)
  plain = t5nn.build(plain_cfg)
  params.get("encoder").pop("prompt")
  spelled = plain.apply({"params": params}, np.concatenate([ids[None], enc], 1),
                        method=plain.encode)
  np.testing.assert_allclose(with_prompt, spelled, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_initializations(base, tmp_path):
  _, ours = base
  table = prompt_lib.embedding_table(ours.params)
  e = ours.config.emb_dim
  uniform = prompt_lib.initialize(PromptConfig(length=P), ours.params)
  assert uniform.shape == (P, e) and uniform.min() >= 0.0 and uniform.max() < 0.5
  assert uniform.std() > 0.05  # U[0, 0.5): std 0.144
  # The network's own initial value is the same uniform draw's kind.
  net_init = t5nn.init_params(ours.config.replace(prompt=PromptConfig(length=P)),
                              jax.random.key(1))["encoder"]["prompt"]["prompt"]
  assert net_init.shape == (P, e) and 0.0 <= float(net_init.min()) < float(net_init.max()) < 0.5
  sampled = prompt_lib.initialize(PromptConfig(length=P, init="sampled_vocab",
                                               population_size=20), ours.params,
                                  rng=jax.random.key(2))
  rows = [int(np.flatnonzero((table == r).all(axis=1))[0]) for r in sampled]
  assert len(set(rows)) == P and all(r < 20 for r in rows)  # without replacement, < 20
  # More rows than the population: drawn with replacement.
  long = prompt_lib.initialize(PromptConfig(length=8, init="sampled_vocab", population_size=3),
                               ours.params)
  assert all(any((table[i] == r).all() for i in range(3)) for r in long)
  labels = prompt_lib.initialize(PromptConfig(length=P, init="class_labels",
                                              class_labels=(4, (5, 9))), ours.params)
  np.testing.assert_array_equal(labels[0], table[4])
  np.testing.assert_allclose(labels[1], (table[5] + table[9]) / 2, rtol=1e-6)
  # String labels are encoded with the vocabulary, a label of several pieces averaged.
  from t5forge.data import bundled_tasks
  vocab = bundled_tasks.VOCABULARY
  small = {"token_embedder": {"embedding": np.random.default_rng(0).normal(
      size=(vocab.vocab_size, 4)).astype(np.float32)}}
  text = prompt_lib.initialize(PromptConfig(length=2, init="class_labels",
                                            class_labels=("entailment",)), small, vocab)
  want = small["token_embedder"]["embedding"][vocab.encode("entailment")].mean(axis=0)
  np.testing.assert_allclose(text[0], want, rtol=1e-6)
  npy = str(tmp_path / "prompt.npy")
  prompt_lib.save_npy(npy, labels)
  assert np.load(npy).dtype == np.float32 and np.load(npy).shape == (P, e)
  from_file = prompt_lib.initialize(PromptConfig(length=P, init="file", path=npy), ours.params)
  np.testing.assert_array_equal(from_file, labels)


def test_config_round_trips_through_config_json(base):
  _, ours = base
  cfg = ours.config.replace(prompt=PromptConfig(length=7, init="class_labels",
                                                class_labels=["yes", [3, 4]]))
  d = json.loads(json.dumps(cfg.to_dict()))
  back = type(cfg).from_dict(d)
  assert back == cfg and back.prompt.class_labels == ("yes", (3, 4))
  hash(back)


def test_bad_inputs_are_one_line_errors(base, peft_dir, tmp_path):
  _, ours = base
  cfg = ours.config.replace(prompt=PromptConfig(length=P))
  net = t5nn.build(cfg)
  params = prompt_lib.with_prompt(jax.device_get(ours.params), np.zeros((P, cfg.emb_dim)))
  enc = np.ones((1, 6), np.int32)
  with pytest.raises(UserError, match="packed rows.*pack = False"):
    net.apply({"params": params}, enc, enc, encoder_segment_ids=enc, decoder_segment_ids=enc)
  with pytest.raises(UserError, match="no room for the inputs.*shorter than 5"):
    prompt_lib.check_feature_lengths(PromptConfig(length=5), {"inputs": 5, "targets": 8})
  prompt_lib.check_feature_lengths(PromptConfig(length=4), {"inputs": 5})
  with pytest.raises(UserError, match="pack = False"):
    prompt_lib.check_feature_lengths(PromptConfig(length=4), {"inputs": 64}, pack=True)
  for kwargs, match in [(dict(length=0), "length must be a positive int"),
                        (dict(length=3, init="text"), "init must be one of"),
                        (dict(length=3, init="class_labels"), "needs class_labels"),
                        (dict(length=3, init="file"), "needs path"),
                        (dict(length=3, class_labels=("a",)), "read only by init")]:
    with pytest.raises(UserError, match=match):
      PromptConfig(**kwargs)
  with pytest.raises(UserError, match="encoder-decoder"):
    presets.get("decoder_only.tiny").replace(prompt=PromptConfig(length=2))
  with pytest.raises(UserError, match="do not fit a prompt of length 1"):
    prompt_lib.initialize(PromptConfig(length=1, init="class_labels", class_labels=(1, 2)),
                          ours.params)
  npy = str(tmp_path / "p.npy")
  np.save(npy, np.zeros((3, 7), np.float32))
  with pytest.raises(UserError, match=r"shape \(3, 7\).*needs \[5, 32\]"):
    prompt_lib.initialize(PromptConfig(length=5, init="file", path=npy), ours.params)
  # peft adapters t5forge cannot read as a prompt.
  src, _ = peft_dir
  for change, match in [({"peft_type": "LORA"}, "not 'PROMPT_TUNING'"),
                        ({"task_type": "CAUSAL_LM"}, "another architecture"),
                        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                        ({"num_virtual_tokens": 9}, "has shape")]:
    bad = tmp_path / f"bad_{len(os.listdir(tmp_path))}"
    bad.mkdir()
    with open(os.path.join(src, "adapter_config.json")) as f:
      pc = json.load(f)
    pc.update(change)
    (bad / "adapter_config.json").write_text(json.dumps(pc))
    os.symlink(os.path.join(src, "adapter_model.safetensors"), bad / "adapter_model.safetensors")
    with pytest.raises(UserError, match=match) as err:
      prompt_lib.from_peft(str(bad), ours.config)
    assert "\n" not in str(err.value)
  wide = ours.config.replace(emb_dim=48)
  with pytest.raises(UserError, match="token_dim 32 does not match.*48"):
    prompt_lib.from_peft(src, wide)


TRAIN_GIN = """
include 'runs/finetune.gin'
include 'models/t5_1_1/tiny.gin'
include 'runs/prompt_tuning.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 16}
TRAIN_STEPS = 40
BATCH_SIZE = 8
DROPOUT_RATE = 0.0
EVAL_PERIOD = 40
EVAL_STEPS = 2
EVALUATOR_NUM_EXAMPLES = 2
PROMPT_LENGTH = 8
prompt.PromptConfig.init = 'file'
network.ModelConfig.vocab_size = 8000
network.ModelConfig.dtype = 'float32'
utils.SaveCheckpointConfig.period = 40
train_script.train.stats_period = 1
"""


@pytest.mark.slow
def test_prompt_tuning_trains_only_the_prompt_and_the_loss_falls(tmp_path):
  """`t5forge train` with runs/prompt_tuning.gin on a frozen base: the checkpoint holds
  the prompt alone (and its optimizer state), the prompt moved away from the .npy it
  started from, the training loss fell over 40 steps at lr 0.3 (on a random base the
  prompt can only shift the output distribution: measured 9.29 -> 9.10 nats, the mean
  of the first and last 5 steps; asserted 0.1), and the inference evaluator decoded
  with the prompt."""
  from t5forge.convert import native
  from t5forge.data import bundled_tasks
  from t5forge.nn import adapters
  from train_helpers import read_jsonl, train_in_process
  base = t5forge.init("t5_1_1.tiny", vocab_size=8000, dropout_rate=0.0,
                      vocabulary=bundled_tasks.VOCABULARY)
  base_dir = str(tmp_path / "base")
  base.save(base_dir)
  start = np.random.default_rng(0).uniform(0, 0.5, (8, base.config.emb_dim)).astype(np.float32)
  npy = str(tmp_path / "start.npy")
  prompt_lib.save_npy(npy, start)
  gin_file = tmp_path / "prompt.gin"
  gin_file.write_text(TRAIN_GIN)
  model_dir = tmp_path / "run"
  r = train_in_process(str(gin_file), model_dir, f'INITIAL_CHECKPOINT_PATH="{base_dir}"',
                f'prompt.PromptConfig.path="{npy}"')
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  rows = read_jsonl(model_dir / "metrics.jsonl")
  train = [x["loss_per_nonpadding_target_token"] for x in rows if x["split"] == "train"]
  assert len(train) >= 38 and np.mean(train[-5:]) < np.mean(train[:5]) - 0.1, train
  assert any(x["split"].startswith("inference_eval/") for x in rows)
  ckpt = str(model_dir / "checkpoint_40")
  with open(os.path.join(ckpt, adapters.CONFIG_FILE)) as f:
    record = json.load(f)
  assert record["model"]["prompt"]["length"] == 8 and record["fingerprint"]
  cfg = base.config.replace(prompt=PromptConfig(length=8, init="file", path=npy))
  adapter, _ = adapters.split(t5nn.abstract_params(cfg))
  assert list(t5nn.named_leaves(adapter)) == [prompt_lib.PATH]
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  restored = native.restore_params(ckpt, jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), adapter))
  trained = prompt_lib.get_prompt(restored)
  assert trained.shape == start.shape and np.abs(trained - start).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5gemma", "t5gemma2"])
def test_peft_prompts_on_t5gemma_both_ways(family, tmp_path):
  """peft on transformers' T5Gemma / T5Gemma 2: its prompt read into t5forge gives its
  logits, and ours written back loads in peft with them. (transformers' T5Gemma 2 adds
  peft's prompt after the sqrt(e) scale, T5Gemma before it: `to_peft` / `from_peft`
  convert; measured agreement about 5e-6.)"""
  import torch
  from peft import PeftModel, PromptTuningConfig, get_peft_model
  import hf_t5gemma2_reference as g2
  import hf_t5gemma_reference as g1
  hf_dir = str(tmp_path / "hf")
  if family == "t5gemma":
    ref, enc_dec = g1, lambda v: g1.random_batch(v)
    g1.build_hf_dir("mha", hf_dir)
  else:
    ref, enc_dec = g2, lambda v: g2.random_batch()
    g2.build_hf_dir(hf_dir)
  ours = t5forge.load(hf_dir)
  cfg = ours.config
  peft_model = get_peft_model(ref.load_hf_model(hf_dir), PromptTuningConfig(
      task_type="SEQ_2_SEQ_LM", num_virtual_tokens=4, num_transformer_submodules=1,
      num_layers=cfg.num_encoder_layers, token_dim=cfg.emb_dim,
      num_attention_heads=cfg.num_heads)).eval()
  torch.manual_seed(1)
  with torch.no_grad():
    emb = peft_model.prompt_encoder["default"].embedding.weight
    emb.copy_(torch.randn_like(emb))
  peft_model.save_pretrained(str(tmp_path / "theirs"))
  enc, dec = enc_dec(cfg.vocab_size)
  want = _peft_logits(peft_model, enc, dec)
  prompt_cfg, prompt = prompt_lib.from_peft(str(tmp_path / "theirs"), cfg)
  tuned = _with_prompt(ours, prompt_cfg, prompt)
  np.testing.assert_allclose(tuned.logits(enc, dec), want, **TOL)
  assert np.abs(ours.logits(enc, dec) - want).max() > 1e-2
  prompt_lib.to_peft(str(tmp_path / "ours"), prompt * 0.5, cfg)
  back = PeftModel.from_pretrained(ref.load_hf_model(hf_dir), str(tmp_path / "ours")).eval()
  np.testing.assert_allclose(_with_prompt(ours, prompt_cfg, prompt * 0.5).logits(enc, dec),
                             _peft_logits(back, enc, dec), **TOL)


@pytest.mark.slow
def test_the_adapter_api_and_cli_take_prompts_both_formats(base, peft_dir, tmp_path):
  """t5forge.load(base, adapter=peft PROMPT_TUNING dir) gives peft's logits; save_adapter
  writes it as ours and as peft's; `convert --adapter` converts it and refuses --merge."""
  import subprocess
  import sys
  path, _ = base
  out, peft_model = peft_dir
  tuned = t5forge.load(path, adapter=out)
  assert tuned.config.prompt.length == P and tuned.config.lora is None
  enc, dec = random_batch(tuned.config.vocab_size, enc_len=20, dec_len=8, seed=5)
  want = _peft_logits(peft_model, enc, dec)
  np.testing.assert_allclose(tuned.logits(enc, dec), want, **TOL)
  tuned.save_adapter(str(tmp_path / "ours"))
  tuned.save_adapter(str(tmp_path / "as_peft"), format="peft")
  for d in ("ours", "as_peft"):
    np.testing.assert_allclose(t5forge.load(path, adapter=str(tmp_path / d)).logits(enc, dec),
                               want, **TOL)
  with pytest.raises(UserError, match="not merged into weights"):
    tuned.merge_adapter()
  cli = [sys.executable, "-m", "t5forge", "convert", "--adapter", str(tmp_path / "ours"),
         "--base", path]
  r = subprocess.run(cli + ["--to", "peft", "--output", str(tmp_path / "cli_peft")],
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  cfg, arr = prompt_lib.from_peft(str(tmp_path / "cli_peft"), tuned.config)
  np.testing.assert_array_equal(arr, prompt_lib.get_prompt(jax.device_get(tuned.params)))
  r = subprocess.run(cli + ["--merge", "--to", "t5forge", "--output", str(tmp_path / "m")],
                     capture_output=True, text=True)
  assert r.returncode != 0 and "is a tuned prompt" in r.stderr.strip().splitlines()[-1]


def test_the_generators_encode_returns_the_tokens_states_only(base):
  """/v1/embeddings pools Generator.encode over the tokens' mask: with a prompt, the
  prompt's positions are left out and the tokens' states are the tuned encoder's."""
  from t5forge.generation import Generator
  _, ours = base
  cfg = PromptConfig(length=P)
  prompt = np.random.default_rng(1).normal(size=(P, ours.config.emb_dim)).astype(np.float32)
  tuned = _with_prompt(ours, cfg, prompt)
  enc, _ = random_batch(ours.config.vocab_size, enc_len=12, dec_len=4, seed=3)
  gen = Generator(tuned.model, tuned.params)
  out = gen.encode(enc, enc > 0)
  assert out.shape == (enc.shape[0], enc.shape[1], ours.config.emb_dim)
  np.testing.assert_allclose(out, np.asarray(tuned.encode(enc))[:, P:], rtol=1e-5, atol=1e-5)
