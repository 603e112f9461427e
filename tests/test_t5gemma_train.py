"""T5Gemma through `t5forge train`: a tiny T5Gemma's loss falls on a bundled task,
a SIGKILLed run resumes bitwise, it trains on 8 CPU devices with 2-D rules like on one,
fine-tuning starts from an HF T5Gemma directory's exact weights, and a checkpoint of the
other family gets one line naming the first mismatching parameter and the fix."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from hf_t5gemma_reference import build_hf_dir, write_sentencepiece, write_tokenizer_config
from t5forge.convert import native
from t5forge.errors import UserError
from train_helpers import (EIGHT, ROOT, error_line, final_params, fingerprints, kill_when,
                           read_jsonl, train_cmd, train_in_process, write_gin)

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

# Grouped-query attention (decoder 4 query heads over 2 kv heads, encoder 6 over 3), an
# encoder wider than the decoder, sliding window 8 < the 32-token sequences.
MODEL = "t5gemma/tiny_gqa"
TASK = "bible_translate_en_es"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """24 uninterrupted steps at a constant learning rate 0.1, checkpoints at 12 and 24,
  held-out loss before the first step and after the last."""
  d = tmp_path_factory.mktemp("t5gemma_ref")
  gin = write_gin(d / "run.gin", model=MODEL, steps=24, period=12, eval_period=24,
                  stats_period=6, extra="""
utils.create_learning_rate_scheduler.factors = 'constant'
utils.create_learning_rate_scheduler.base_learning_rate = 0.1
train_script.train.run_eval_before_training = True
""")
  r = train_in_process(gin, d / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  return gin, d / "model"


def test_tiny_t5gemma_trains_through_the_cli_and_its_held_out_loss_falls(reference):
  """Held-out (Gospel of John) loss per target token: ln(8000) = 8.99 at step 0 (the
  N(0, 0.02) embedding init; T5's N(0, 1) gave 25 nats), 6.27 after 24 steps (AMD EPYC)."""
  _, model_dir = reference
  rows = [x for x in read_jsonl(model_dir / "metrics.jsonl")
          if x["split"] == f"training_eval/{TASK}"]
  assert [x["step"] for x in rows] == [0, 24]
  first, last = (x["loss_per_nonpadding_target_token"] for x in rows)
  assert 8.5 < first < 9.5 and first - last > 2.0, (first, last)
  assert "architecture = 't5gemma'" in (model_dir / "config.gin").read_text()
  info = (model_dir / "model-info.txt").read_text()
  line = next(l for l in info.splitlines()
              if l.startswith("decoder/layers_0/self_attention/key/kernel"))
  assert "(64, 32)" in line and "('embed', 'kv_heads')" in line, line


@pytest.mark.slow  # two CLI runs: 60-70 s on the shared 2-core AMD EPYC at load 5-6
def test_sigkill_after_a_checkpoint_resumes_bitwise(reference, tmp_path):
  gin, ref_dir = reference
  model_dir = tmp_path / "model"
  # Without the reference's two evaluations (quicker; they must not touch training either).
  no_eval = ("train_script.train.run_eval_before_training=False", "EVAL_PERIOD=1000")
  killed = kill_when(train_cmd(gin, model_dir, *no_eval),
                     lambda: 12 in native.checkpoint_steps(str(model_dir)))
  assert killed, "the run finished before it could be killed"
  assert native.checkpoint_steps(str(model_dir))[-1] < 24
  r = train_in_process(gin, model_dir, *no_eval)
  assert r.returncode == 0, r.stderr[-3000:]
  # Resumed from checkpoint 12 (not restarted: that would also end bitwise equal).
  assert "step 18/24" in r.stdout and "step 6/24" not in r.stdout, r.stdout[-2000:]
  path, params = final_params(model_dir)
  ref_path, ref = final_params(ref_dir)
  assert path.endswith("checkpoint_24") and ref_path.endswith("checkpoint_24")
  jax.tree.map(np.testing.assert_array_equal, params, ref)
  assert fingerprints(model_dir) == fingerprints(ref_dir)
  assert sorted(fingerprints(ref_dir)) == list(range(24))


@pytest.mark.slow
def test_eight_device_mesh_with_2d_rules_matches_one_device(tmp_path):
  """tests/sharding_worker.py t5gemma: 3 Adafactor steps of a T5Gemma (decoder 2 kv heads,
  encoder 1) on meshes (4, 2) and (2, 4) with 2-D parameter rules against one device.
  Measured (AMD EPYC): parameters within 2.4e-7, summed loss within 5e-4 of 2193.3.
  ~70-130 s on the shared 2-core machine."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharding_worker.py"),
                      str(tmp_path), "t5gemma"], capture_output=True, text=True, env=EIGHT,
                     cwd=ROOT, timeout=1200)
  assert r.returncode == 0, r.stderr[-4000:]
  # A kv-head dimension split unevenly (1 or 2 kv heads over 4 devices) made XLA regather
  # it in full at every reshape; such activations are now replicated instead.
  assert "Involuntary full rematerialization" not in r.stderr, r.stderr[-3000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  for name in ("4x2_p2", "2x4_p2"):
    x = report[name]
    assert x["max_param_diff"] < 1e-5 and x["loss_diff"] < 1e-2, (name, x)
    assert x["leaves_checked"] > 200, x
  specs = report["4x2_p2"]["specs"]
  # 2-D rules: embed over 'data', mlp / heads / kv heads over 'model' (2 kv heads of 32 on
  # a model axis of 2: one whole head per device).
  assert specs["['decoder']['layers_0']['self_attention']['key']['kernel']"] == ["data", "model"]
  assert specs["['decoder']['layers_0']['self_attention']['query']['kernel']"] == ["data",
                                                                                   "model"]
  assert specs["['encoder']['layers_0']['mlp']['wi_0']['kernel']"] == ["data", "model"]
  assert specs["['decoder']['token_embedder']['embedding']"] == ["model", "data"]


# runs/finetune.gin + a T5Gemma model gin fitted to the HF variant 'gqa' of
# hf_t5gemma_reference (tiny_gqa's fields set to its shapes, scanned layers), the task
# tokenized with the directory's own tokenizer.model (as docs/training.md shows).
GQA_GIN = """
from __gin__ import dynamic_registration
from t5forge import data
from t5forge.data import vocab_io
from t5forge.nn import config as network
include 'runs/finetune.gin'
include 'models/t5gemma/tiny_gqa.gin'
INITIAL_CHECKPOINT_PATH = '{path}'
VOCABULARY = @vocab_io.from_checkpoint()
vocab_io.from_checkpoint.path = %INITIAL_CHECKPOINT_PATH
MIXTURE_OR_TASK_NAME = @data.with_vocabulary()
data.with_vocabulary:
  mixture_or_task_name = 'bible_translate_en_es'
  vocabulary = %VOCABULARY
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
TRAIN_STEPS = 1
BATCH_SIZE = 4
DROPOUT_RATE = 0.0
network.ModelConfig:
  vocab_size = 256
  emb_dim = 48
  mlp_dim = 80
  num_heads = 4
  num_kv_heads = 2
  head_dim = 24
  num_decoder_layers = 2
  num_encoder_layers = 3
  encoder_emb_dim = 64
  encoder_mlp_dim = 96
  encoder_num_heads = None
  encoder_num_kv_heads = None
  query_pre_attn_scalar = 20
  sliding_window = 5
  attn_logit_softcapping = 3.0
  final_logit_softcapping = 2.0
  max_position_embeddings = 512
  scan_layers = True
"""


@pytest.fixture(scope="module")
def hf_gqa(tmp_path_factory):
  """An HF T5Gemma directory: random weights (vocabulary 256) and a 256-piece
  SentencePiece tokenizer.model with Gemma's special ids."""
  d = build_hf_dir("gqa", str(tmp_path_factory.mktemp("hf") / "t5gemma_gqa"))
  write_sentencepiece(os.path.join(d, "tokenizer.model"), 256)
  write_tokenizer_config(d)
  return d


def test_finetune_gin_starts_from_an_hf_t5gemma_directory(hf_gqa, tmp_path):
  """One step at learning rate 0 (min_learning_rate 0 too: the schedule's floor is 1e-8)
  saves exactly the directory's weights, so step 0 had them; none initialised fresh."""
  from t5forge.convert import load_checkpoint
  gin = tmp_path / "ft.gin"
  gin.write_text(GQA_GIN.format(path=hf_gqa))
  r = train_in_process(gin, tmp_path / "model",
                "utils.create_learning_rate_scheduler.base_learning_rate=0.0",
                "utils.create_learning_rate_scheduler.min_learning_rate=0.0")
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"initialised from {hf_gqa} (step 0)" in r.stdout and "from scratch" not in r.stdout
  path, params = final_params(tmp_path / "model")
  assert path.endswith("checkpoint_1")
  want = load_checkpoint(hf_gqa, scan_layers=True).params
  assert jax.tree.structure(params) == jax.tree.structure(want)
  assert params["decoder"]["layers"]["self_attention"]["key"]["kernel"].shape == (2, 48, 48)
  jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, want))
  # The run's vocabulary is the directory's tokenizer (256 pieces), not the task's 8k one.
  from t5forge.data import vocab_io
  assert vocab_io.from_spec(native.read_config(path)["vocabulary"]).vocab_size == 256


def test_t5_checkpoint_given_to_a_t5gemma_gin_names_the_parameter_and_the_fix(tmp_path):
  """From the CLI: an HF T5 directory as INITIAL_CHECKPOINT_PATH of a T5Gemma run."""
  import torch
  import transformers
  hf = tmp_path / "hf_t5"
  torch.manual_seed(0)
  transformers.T5ForConditionalGeneration(transformers.T5Config(
      vocab_size=8000, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2,
      feed_forward_proj="relu")).save_pretrained(hf)
  gin = tmp_path / "ft.gin"
  gin.write_text(f"""
include 'runs/finetune.gin'
include 'models/t5gemma/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
TRAIN_STEPS = 1
BATCH_SIZE = 4
DROPOUT_RATE = 0.0
network.ModelConfig.vocab_size = 8000
INITIAL_CHECKPOINT_PATH = '{hf}'
""")
  line = error_line(train_in_process(gin, tmp_path / "model"))
  assert "(a encoder_decoder checkpoint, the model is t5gemma)" in line, line
  assert "parameter 'decoder/decoder_norm/scale' has shape (16,)" in line, line
  assert "include a T5 model gin" in line and "architecture 't5gemma'" in line, line


def test_native_t5_checkpoint_and_the_reverse_direction(hf_gqa, tmp_path):
  """A t5forge T5 checkpoint given to a T5Gemma model, and an HF T5Gemma directory given
  to a T5 model (in-process, as the CLI calls it): the first parameter the model needs
  that does not fit, and the fix."""
  import t5forge
  from t5forge import presets
  from t5forge.nn import abstract_params
  from t5forge.train.checkpoint import initial_params
  from t5forge.train.settings import RestoreCheckpointConfig
  t5_dir = str(tmp_path / "t5")
  t5forge.init("t5_1_1.tiny", vocab_size=8000, seed=0).save(t5_dir)
  for path, model, says in (
      (t5_dir, "t5gemma.tiny_gqa",
       r"\(a encoder_decoder checkpoint, the model is t5gemma\): parameter "
       r"'decoder/layers_0/encoder_decoder_attention/key/kernel' has shape \(64, 64\) but the "
       r"model's .* is \(96, 32\); include a T5 model gin .* architecture 't5gemma'$"),
      (hf_gqa, "t5_1_1.tiny",
       r"\(a t5gemma checkpoint, the model is encoder_decoder\): parameter "
       r"'decoder/decoder_norm/scale' has shape \(48,\) but .* is \(64,\); include a T5Gemma "
       r"model gin \(models/t5gemma/\*.gin\) .* architecture 'encoder_decoder'$")):
    config = presets.get(model, vocab_size=8000 if path == t5_dir else 256)
    fresh = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config))
    with pytest.raises(UserError, match=says) as e:
      initial_params(RestoreCheckpointConfig(path=path), fresh, model_config=config)
    assert "\n" not in str(e.value)
