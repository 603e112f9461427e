"""LoRA adapters <-> Hugging Face peft (`t5forge.convert.peft`), against peft itself.

Models are random-init transformers models saved offline (tests/hf_*reference.py); peft
(pinned in the test extras) builds, saves, loads and merges adapters on them. Both ways,
for T5 (Flan-T5 shape: gated MLP, untied head), T5Gemma (grouped-query attention, an
encoder wider than the decoder) and T5Gemma 2 (whose encoder modules live under
`text_model` and whose vision tower peft's suffix targets also reach); peft-made
adapters also on T5 1.0 (ungated MLP), mT5 and ByT5:

- ours -> peft: `save_adapter(format="peft")` loads with `PeftModel.from_pretrained`
  with exactly the LoRA weights it holds (no missing, no unexpected), float32 logits
  within 1e-4, the same greedy tokens, and `merge_and_unload()` equals `merge_adapter()`;
- peft -> ours: an adapter peft made (`init_lora_weights=False`, rsLoRA, `rank_pattern`,
  `alpha_pattern`) loads with `t5forge.load(base, adapter=DIR)`, logits within 1e-4;
- bad adapters are one-line UserErrors naming the field; the CLI round trip is exact and
  `--merge --to hf` loads in transformers with peft's merged logits.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import hf_reference
import hf_t5gemma2_reference as ref2
import hf_t5gemma_reference as ref1

TOL = dict(rtol=1e-4, atol=1e-4)
STEPS = 8


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
  """family -> (HF directory, loader of the transformers model, encoder rows, decoder
  rows, decoder start id)."""
  root = tmp_path_factory.mktemp("peft_bases")
  t5 = hf_reference.build_hf_dir("flan", str(root / "t5"))
  g1 = ref1.build_hf_dir("gqa", str(root / "t5gemma"))
  g2 = ref2.build_hf_dir(str(root / "t5gemma2"))
  enc, dec = hf_reference.random_batch(160, batch=2, enc_len=12, dec_len=10)
  # Full-length rows for the Gemma families: transformers gives NaN in a padded row whose
  # tail is longer than the sliding window.
  rng = np.random.default_rng(1)
  genc = rng.integers(3, 256, size=(2, 12)).astype(np.int32)
  gdec = rng.integers(3, 256, size=(2, 10)).astype(np.int32)
  gdec[:, 0] = ref1.BOS
  more = {}
  for name, vocab in (("t5_1_0", 128), ("mt5", 300), ("byt5", 384)):
    e, d = hf_reference.random_batch(vocab, batch=2, enc_len=12, dec_len=10, seed=2)
    more[name] = (hf_reference.build_hf_dir(name, str(root / name)), hf_reference.load_hf_model,
                  e, d, 0)
  return {
      **more,
      "t5": (t5, hf_reference.load_hf_model, enc, dec, 0),
      "t5gemma": (g1, ref1.load_hf_model, genc, gdec, ref1.BOS),
      "t5gemma2": (g2, ref2.load_hf_model, genc, gdec, ref1.BOS),
  }


def _hf_logits(model, enc, dec):
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.tensor(enc, dtype=torch.long),
                attention_mask=torch.tensor(enc != 0, dtype=torch.long),
                decoder_input_ids=torch.tensor(dec, dtype=torch.long))
  return out.logits.float().numpy()


def _hf_greedy(model, enc, start):
  import torch
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(enc, dtype=torch.long),
                         attention_mask=torch.tensor(enc != 0, dtype=torch.long),
                         do_sample=False, num_beams=1, max_new_tokens=STEPS, min_new_tokens=0,
                         decoder_start_token_id=start, eos_token_id=1, pad_token_id=0,
                         # transformers' T5 cache is sized by the encoder's layer count:
                         # the Flan shape here has more decoder layers
                         use_cache=False)
  out = out[:, 1:].numpy()
  return np.pad(out, ((0, 0), (0, STEPS - out.shape[1])))


def _lora_keys(peft_model) -> dict:
  """The LoRA weights a PeftModel holds, under the names its adapter file uses."""
  return {k.replace(".default", ""): v.detach().numpy() for k, v in
          peft_model.state_dict().items() if ".lora_" in k}


def _with_random_adapter(hf_dir, lora_config, seed=0, **load):
  """t5forge.load(hf_dir, **load) with a LoRA adapter of `lora_config` whose lora_a and
  lora_b are both random (non-zero)."""
  import jax
  import t5forge
  from t5forge import nn as t5nn
  from t5forge.interactive import Model
  from t5forge.nn import adapters
  base = t5forge.load(hf_dir, **load)
  config = base.config.replace(lora=lora_config)
  adapter, _ = adapters.split(t5nn.init_params(config, jax.random.key(seed)))
  rng = np.random.default_rng(seed)
  adapter = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32),
                         adapter)
  return Model(config, adapters.join(adapter, jax.device_get(base.params)),
               source=base.source, checkpoint=base.checkpoint, vocabulary=base.vocabulary)


# Ours -> peft: several targets, a second rank and a second alpha, in our module paths.
OURS = {
    "t5": dict(rank=4, alpha=8.0, targets="query,value,wi_0,wo",
               rank_pattern=(("decoder/layers_1/.*", 2),), alpha_pattern=((".*/mlp/wo", 3.0),)),
    "t5gemma": dict(rank=4, alpha=8.0, targets="all-linear",
                    rank_pattern=((".*encoder_decoder_attention/(key|value)", 2),)),
    "t5gemma2": dict(rank=3, alpha=6.0, targets="attention", rslora=True,
                     alpha_pattern=(("decoder/.*", 2.0),)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(OURS))
def test_ours_loads_in_peft(family, bases, tmp_path):
  """Our adapter, written as peft's, is what peft loads and runs: the same LoRA weights,
  logits, greedy tokens, and merged kernels."""
  from peft import PeftModel
  from safetensors.numpy import load_file
  from t5forge.convert import hf
  from t5forge.nn.lora import LoraConfig
  hf_dir, load_hf, enc, dec, start = bases[family]
  ours = _with_random_adapter(hf_dir, LoraConfig(**OURS[family]))
  out = str(tmp_path / "peft")
  ours.save_adapter(out, format="peft")
  written = load_file(os.path.join(out, "adapter_model.safetensors"))
  pm = PeftModel.from_pretrained(load_hf(hf_dir), out).eval()
  held = _lora_keys(pm)
  assert sorted(held) == sorted(written)  # nothing missing, nothing unexpected
  for k, v in written.items():
    np.testing.assert_array_equal(held[k], v)
  np.testing.assert_allclose(ours.logits(enc, dec), _hf_logits(pm, enc, dec), **TOL)
  tokens, _ = ours.predict(enc, max_decode_length=STEPS)
  np.testing.assert_array_equal(tokens, _hf_greedy(pm, enc, start))

  merged = hf.t5gemma2.text_state({k: v.detach().numpy() for k, v in
                                   pm.merge_and_unload().state_dict().items()})
  ours.merge_adapter()
  assert ours.config.lora is None
  state = hf.params_to_state(ours.params, ours.config)
  before = hf.t5gemma2.text_state(hf.load_hf_state(hf_dir))
  changed = 0
  for k, v in state.items():
    np.testing.assert_allclose(v, merged[k], rtol=1e-5, atol=1e-5, err_msg=k)
    changed += not np.array_equal(v, before[k])
  assert changed >= len(written) // 2  # every adapted kernel moved


# peft -> ours: adapters as peft makes them (its own patterns over transformers' names).
PEFT = {
    "t5": dict(r=4, lora_alpha=8, target_modules=["q", "v", "wo"],
               rank_pattern={"EncDecAttention.v": 2}, alpha_pattern={"wo": 5}),
    "t5gemma": dict(r=4, lora_alpha=8, target_modules=r".*decoder.*\.(q_proj|v_proj|down_proj)",
                    rank_pattern={"cross_attn.v_proj": 2}),
    # T5 1.0's ungated MLP (wi), mT5 (MT5ForConditionalGeneration), ByT5
    "t5_1_0": dict(r=3, lora_alpha=6, target_modules=["k", "o", "wi"]),
    "mt5": dict(r=4, lora_alpha=8, target_modules=["q", "v"],
                rank_pattern={"decoder.block.0.layer.0.SelfAttention.q": 2}),
    "byt5": dict(r=2, lora_alpha=4, target_modules=r".*encoder.*\.(wi_0|wi_1|wo)"),
    # suffixes: these reach the vision tower too, which the text model does not have
    "t5gemma2": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                     rank_pattern={"mlp.gate_proj": 6}),
}


def _peft_adapter(family, bases, out):
  """An adapter peft made and saved; returns (its PeftModel, the directory)."""
  import peft
  import torch
  hf_dir, load_hf, *_ = bases[family]
  torch.manual_seed(0)
  cfg = peft.LoraConfig(**PEFT[family], init_lora_weights=False, use_rslora=True,
                        task_type="SEQ_2_SEQ_LM")
  pm = peft.get_peft_model(load_hf(hf_dir), cfg).eval()
  pm.save_pretrained(out)
  return pm, out


@pytest.mark.slow
@pytest.mark.parametrize("family", list(PEFT))
def test_peft_adapter_loads_in_t5forge(family, bases, tmp_path):
  import t5forge
  hf_dir, _, enc, dec, _ = bases[family]
  pm, out = _peft_adapter(family, bases, str(tmp_path / "peft"))
  ours = t5forge.load(hf_dir, adapter=out)
  assert ours.config.lora is not None and ours.config.lora.rslora
  np.testing.assert_allclose(ours.logits(enc, dec), _hf_logits(pm, enc, dec), **TOL)
  # The base alone is not the adapted model: the adapter changed the logits.
  assert np.abs(t5forge.load(hf_dir).logits(enc, dec) - ours.logits(enc, dec)).max() > 1e-2


# ---------------------------------------------------------------------------------------
# Bad adapters: one line each, naming the field.

@pytest.fixture(scope="module")
def t5_peft_dir(bases, tmp_path_factory):
  return _peft_adapter("t5", bases, str(tmp_path_factory.mktemp("t5peft") / "a"))[1]


def _edited(src, dst, *, config=None, weights=None):
  from safetensors.numpy import load_file, save_file
  shutil.copytree(src, dst)
  if config:
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
      cfg = json.load(f)
    cfg.update(config)
    with open(path, "w") as f:
      json.dump(cfg, f)
  if weights:
    path = os.path.join(dst, "adapter_model.safetensors")
    save_file(weights(load_file(path)), path)
  return dst


def _renamed(state):
  return {k.replace("encoder.block.0.layer.0.SelfAttention.q",
                    "model.layers.0.self_attn.q_proj"): v for k, v in state.items()}


def _head(state):
  key = next(k for k in sorted(state) if k.endswith("lora_A.weight"))
  return {**state, "base_model.model.lm_head.lora_A.weight": state[key]}


def _reshaped(state):
  key = next(k for k in sorted(state) if k.endswith("lora_A.weight"))
  return {**state, key: np.zeros((state[key].shape[0], 64), np.float32)}


BAD = [
    ("dora", dict(config={"use_dora": True}), "use_dora"),
    ("bias", dict(config={"bias": "lora_only"}), "bias"),
    ("modules_to_save", dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    ("layers", dict(config={"layers_to_transform": [0]}), "layers_to_transform"),
    ("fan_in", dict(config={"fan_in_fan_out": True}), "fan_in_fan_out"),
    ("ia3", dict(config={"peft_type": "IA3"}), "peft_type 'IA3'"),
    ("task", dict(config={"task_type": "CAUSAL_LM"}), "task_type"),
    ("pissa", dict(config={"init_lora_weights": "pissa"}), "init_lora_weights"),
    ("named_base", dict(config={"base_model_name_or_path": "google/t5gemma-2b-2b-ul2"}),
     "for a T5Gemma base"),
    ("other_arch", dict(weights=_renamed), "another architecture"),
    ("other_size", dict(weights=_reshaped), "another size"),
    ("lm_head", dict(weights=_head), "output layer"),
]


@pytest.mark.parametrize("name,edit,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_peft_adapter(name, edit, needle, bases, t5_peft_dir, tmp_path):
  import t5forge
  from t5forge.errors import UserError
  bad = _edited(t5_peft_dir, str(tmp_path / name), **edit)
  with pytest.raises(UserError) as err:
    t5forge.load(bases["t5"][0], adapter=bad)
  msg = str(err.value)
  assert needle in msg and "\n" not in msg, msg


def test_fingerprint_mismatch(bases, t5_peft_dir, tmp_path):
  """Our format records the base's fingerprint: another base with the same shapes is
  refused, naming both fingerprints."""
  import t5forge
  from t5forge.errors import UserError
  ours_dir = str(tmp_path / "ours")
  t5forge.load(bases["t5"][0], adapter=t5_peft_dir).save_adapter(ours_dir)
  other = hf_reference.build_hf_dir("flan", str(tmp_path / "other"), seed=1)
  with pytest.raises(UserError) as err:
    t5forge.load(other, adapter=ours_dir)
  msg = str(err.value)
  assert msg.count("fingerprint") >= 2 and "\n" not in msg, msg
  # and on its own base it loads
  t5forge.load(bases["t5"][0], adapter=ours_dir)


def test_api_misuse_is_one_line(bases, t5_peft_dir, tmp_path):
  """save_hf of an adapted model, an unknown save_adapter format, and merging or saving
  an adapter that is not there: one line each, saying what to do."""
  import t5forge
  from t5forge.errors import UserError
  adapted = t5forge.load(bases["t5"][0], adapter=t5_peft_dir)
  plain = t5forge.load(bases["t5"][0])
  for call, needle in ((lambda: adapted.save_hf(str(tmp_path / "hf")), "merge_adapter()"),
                       (lambda: adapted.save_adapter(str(tmp_path / "a"), format="lora"),
                        "'t5forge' or 'peft'"),
                       (lambda: plain.merge_adapter(), "adapter=DIR"),
                       (lambda: plain.save_adapter(str(tmp_path / "b")), "adapter=DIR"),
                       (lambda: t5forge.load(bases["t5"][0], adapter=str(tmp_path)),
                        "not an adapter directory")):
    with pytest.raises(UserError) as err:
      call()
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
  assert not os.path.exists(tmp_path / "hf")


@pytest.mark.slow
def test_scanned_model_with_adapter(bases, t5_peft_dir, tmp_path):
  """A scanned model runs an adapter that treats every layer alike as the unscanned one
  does; one whose layers differ is refused (a scan holds one update per stack)."""
  import t5forge
  from t5forge.errors import UserError
  hf_dir, _, enc, dec, _ = bases["t5"]
  scanned = t5forge.load(hf_dir, adapter=t5_peft_dir, scan_layers=True)
  np.testing.assert_allclose(scanned.logits(enc, dec),
                             t5forge.load(hf_dir, adapter=t5_peft_dir).logits(enc, dec),
                             rtol=1e-5, atol=1e-5)
  uneven = _edited(t5_peft_dir, str(tmp_path / "uneven"),
                   config={"alpha_pattern": {"block.1.layer.0.SelfAttention.q": 2}})
  t5forge.load(hf_dir, adapter=uneven)  # unscanned: fine
  with pytest.raises(UserError, match="layers_1.*scan_layers=False"):
    t5forge.load(hf_dir, adapter=uneven, scan_layers=True)


@pytest.mark.slow
def test_scanned_model_writes_the_adapter_it_runs(bases, tmp_path):
  """A scanned model matches every layer as layer 0: a pattern on another layer does not
  apply there, and the adapter it writes says so (peft runs what the scan ran)."""
  from peft import PeftModel
  from t5forge.nn.lora import LoraConfig
  hf_dir, load_hf, enc, dec, _ = bases["t5"]
  ours = _with_random_adapter(hf_dir, LoraConfig(rank=2, alpha=4.0, targets="query,value",
                                                 alpha_pattern=(("decoder/layers_1/.*", 1.0),)),
                              scan_layers=True)
  ours.save_adapter(str(tmp_path / "peft"), format="peft")
  pm = PeftModel.from_pretrained(load_hf(hf_dir), str(tmp_path / "peft")).eval()
  np.testing.assert_allclose(ours.logits(enc, dec), _hf_logits(pm, enc, dec), **TOL)


# ---------------------------------------------------------------------------------------
# The CLI.

def _cli(*args):
  return subprocess.run([sys.executable, "-m", "t5forge", "convert", *args], capture_output=True,
                        text=True, timeout=300)


@pytest.mark.slow
def test_cli_round_trip_and_merge(bases, tmp_path):
  """peft -> ours -> peft gives peft's file back (bitwise, same targets and ranks);
  `--merge --to hf` writes a checkpoint transformers loads with peft's merged logits."""
  import torch
  from safetensors.numpy import load_file
  hf_dir, load_hf, enc, dec, _ = bases["t5"]
  pm, src = _peft_adapter("t5", bases, str(tmp_path / "peft"))
  ours, back, merged, merged_ours = (str(tmp_path / n) for n in ("ours", "back", "merged",
                                                                   "merged_ours"))
  for args in (("--adapter", src, "--base", hf_dir, "--to", "t5forge", "--output", ours),
               ("--adapter", ours, "--base", hf_dir, "--to", "peft", "--output", back),
               ("--adapter", src, "--base", hf_dir, "--merge", "--to", "hf", "--output", merged),
               ("--adapter", ours, "--base", hf_dir, "--merge", "--to", "t5forge", "--output",
                merged_ours)):
    run = _cli(*args)
    assert run.returncode == 0, run.stderr
  want, got = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (src, back))
  assert sorted(want) == sorted(got)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  with open(os.path.join(back, "adapter_config.json")) as f:
    cfg = json.load(f)
  assert cfg["use_rslora"] and cfg["target_modules"] == ["q", "v", "wo"]
  assert cfg["rank_pattern"] and cfg["alpha_pattern"]
  from peft import PeftModel
  again = PeftModel.from_pretrained(load_hf(hf_dir), back).eval()
  np.testing.assert_allclose(_hf_logits(again, enc, dec), _hf_logits(pm, enc, dec), atol=1e-6)
  with torch.no_grad():
    merged_ref = _hf_logits(pm.merge_and_unload(), enc, dec)
  np.testing.assert_allclose(_hf_logits(load_hf(merged), enc, dec), merged_ref, **TOL)
  import t5forge
  plain = t5forge.load(merged_ours)
  assert plain.config.lora is None
  np.testing.assert_allclose(plain.logits(enc, dec), merged_ref, **TOL)

  run = _cli("--to", "peft", "--output", str(tmp_path / "x"), "--input", hf_dir)
  assert run.returncode == 2 and "--adapter" in run.stderr, run.stderr
  assert len(run.stderr.strip().splitlines()) == 1, run.stderr


@pytest.mark.parametrize("kwargs,needle", [
    (dict(adapter=None, base="b", to="peft", merge=False), "needs --adapter"),
    (dict(adapter="a", base=None, to="peft", merge=False), "needs --base"),
    (dict(adapter="a", base="b", to="peft", merge=True), "--to t5forge or --to hf"),
    (dict(adapter="a", base="b", to="hf", merge=False), "needs --merge"),
    (dict(adapter="a", base="b", to="peft", merge=False, input_given="x"), "--base BASE"),
])
def test_convert_flags(kwargs, needle, tmp_path):
  """`convert --adapter`'s flag combinations that mean nothing: one line each."""
  from t5forge.convert import peft
  from t5forge.errors import UserError
  with pytest.raises(UserError) as err:
    peft.convert_adapter(output=str(tmp_path / "out"), **kwargs)
  assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


TRAIN_GIN = """from __gin__ import dynamic_registration
from t5forge.nn import config as network
from t5forge.nn import lora
from t5forge.train import settings as utils
include 'runs/finetune.gin'
include 'models/t5_1_1/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 32}}
TRAIN_STEPS = 4
BATCH_SIZE = 8
DROPOUT_RATE = 0.0
EVAL_PERIOD = 1000
INITIAL_CHECKPOINT_PATH = '{base}'
network.ModelConfig.vocab_size = 8000
network.ModelConfig.dtype = 'float32'
network.ModelConfig.lora = @lora.LoraConfig()
lora.LoraConfig.rank = 4
utils.SaveCheckpointConfig.period = 4
"""


@pytest.mark.slow
def test_adapter_trained_here_loads_in_peft(tmp_path):
  """The MODEL_DIR of an adapter training run is an adapter for `t5forge.load`: on its
  base it gives what peft gives with the adapter written as peft's on that base written
  as HF's; on another base it is refused by fingerprint."""
  import t5forge
  from peft import PeftModel
  from t5forge.errors import UserError
  base, other = str(tmp_path / "base"), str(tmp_path / "other")
  t5forge.init("t5_1_1.tiny", vocab_size=8000, dtype="float32").save(base)
  t5forge.init("t5_1_1.tiny", seed=1, vocab_size=8000, dtype="float32").save(other)
  gin = tmp_path / "lora.gin"
  gin.write_text(TRAIN_GIN.format(base=base))
  run = subprocess.run([sys.executable, "-m", "t5forge", "train", f"--gin_file={gin}",
                        f'--gin.MODEL_DIR="{tmp_path / "run"}"'], capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  model = t5forge.load(base, adapter=str(tmp_path / "run"))
  assert model.config.lora.rank == 4
  enc, dec = hf_reference.random_batch(8000, batch=2, enc_len=12, dec_len=10)
  ours = model.logits(enc, dec)
  plain = t5forge.load(base)
  assert np.abs(plain.logits(enc, dec) - ours).max() > 1e-4  # trained: not the base
  model.save_adapter(str(tmp_path / "peft"), format="peft")
  plain.save_hf(str(tmp_path / "hf"))
  pm = PeftModel.from_pretrained(hf_reference.load_hf_model(str(tmp_path / "hf")),
                                 str(tmp_path / "peft")).eval()
  np.testing.assert_allclose(_hf_logits(pm, enc, dec), ours, **TOL)
  with pytest.raises(UserError, match="fingerprint.*fingerprint"):
    t5forge.load(other, adapter=str(tmp_path / "run"))
