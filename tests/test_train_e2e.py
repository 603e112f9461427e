"""End-to-end training through `t5forge train`: loss falls, runs resume exactly after
SIGKILL (also during an asynchronous save), runs start from HF and T5X checkpoints,
the seed's fine-tuning gin runs, and bad input gets one clear line."""
import glob
import shutil

import jax
import numpy as np
import pytest

from conftest import T5X_FIXTURE
from t5forge.convert import native
from train_helpers import (final_params, fingerprints, kill_when, read_jsonl, train_cmd,
                           train_in_process, write_gin)

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  d = tmp_path_factory.mktemp("uninterrupted")
  gin = write_gin(d / "run.gin", steps=12, period=4, eval_period=6)
  r = train_in_process(gin, d / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  return gin, d / "model", r


def test_run_leaves_what_t5x_leaves_and_loss_falls(uninterrupted):
  _, model_dir, r = uninterrupted
  for name in ("config.gin", "model-info.txt", "metrics.jsonl", "checkpoint_12"):
    assert (model_dir / name).exists(), name
  assert glob.glob(str(model_dir / "train" / "events.out.tfevents.*"))
  assert glob.glob(str(model_dir / "training_eval" / "bible_translate_en_es" / "events.out.*"))
  info = (model_dir / "model-info.txt").read_text()
  assert "encoder/layers_0/attention/query/kernel" in info and "('embed', 'joined_kv')" in info
  assert "opt_state/" in info and "Total number of parameters" in info
  rows = read_jsonl(model_dir / "metrics.jsonl")
  train_rows = [x for x in rows if x["split"] == "train"]
  for key in ("loss", "accuracy", "z_loss", "cross_ent_loss", "learning_rate",
              "timing/seqs_per_second", "timing/target_tokens_per_second",
              "non_padding_fraction/decoder", "effective_batch_size/decoder"):
    assert key in train_rows[-1], key
  losses = [x["loss_per_nonpadding_target_token"] for x in train_rows]
  assert losses[-1] < losses[0]
  assert "MODEL_DIR" in (model_dir / "config.gin").read_text()


def test_loss_falls_by_a_margin(tmp_path):
  """60 steps of a 1.1M-parameter model (vocab 8000, emb 64) on the Bible task: the
  held-out (Gospel of John) loss per target token falls from ln(8000) ~ 9.0 at step 0
  by more than 2.5 nats."""
  gin = write_gin(tmp_path / "run.gin", steps=60, period=60, eval_period=60, stats_period=10)
  r = train_in_process(gin, tmp_path / "model", "utils.create_learning_rate_scheduler.factors='constant'",
                "utils.create_learning_rate_scheduler.base_learning_rate=0.05",
                "train_script.train.run_eval_before_training=True")
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [x for x in read_jsonl(tmp_path / "model" / "metrics.jsonl")
          if x["split"] == "training_eval/bible_translate_en_es"]
  assert [x["step"] for x in rows] == [0, 60]
  first, last = (x["loss_per_nonpadding_target_token"] for x in rows)
  assert first > 8.5 and first - last > 2.5, (first, last)


def test_sigkill_after_a_checkpoint_resumes_bitwise(uninterrupted, tmp_path):
  gin, ref_dir, _ = uninterrupted
  model_dir = tmp_path / "model"
  killed = kill_when(train_cmd(gin, model_dir),
                     lambda: 4 in native.checkpoint_steps(str(model_dir)))
  assert killed, "the run finished before it could be killed"
  assert native.checkpoint_steps(str(model_dir))[-1] < 12
  r = train_in_process(gin, model_dir)
  assert r.returncode == 0, r.stderr[-3000:]
  path, params = final_params(model_dir)
  ref_path, ref = final_params(ref_dir)
  assert path.endswith("checkpoint_12") and ref_path.endswith("checkpoint_12")
  jax.tree.map(np.testing.assert_array_equal, params, ref)
  assert fingerprints(model_dir) == fingerprints(ref_dir)


def test_sigkill_during_an_async_save_resumes_bitwise(uninterrupted, tmp_path):
  gin, ref_dir, _ = uninterrupted
  model_dir = tmp_path / "model"

  def saving():
    return bool(glob.glob(str(model_dir / "*orbax-checkpoint-tmp*")))

  for _ in range(5):  # a save of a tiny model is quick; try again if we missed it
    shutil.rmtree(model_dir, ignore_errors=True)
    if kill_when(train_cmd(gin, model_dir), saving):
      break
  else:
    pytest.fail("never caught a save in progress")
  assert glob.glob(str(model_dir / "*orbax-checkpoint-tmp*"))  # the torn save is on disk
  r = train_in_process(gin, model_dir)
  assert r.returncode == 0, r.stderr[-3000:]
  _, params = final_params(model_dir)
  _, ref = final_params(ref_dir)
  jax.tree.map(np.testing.assert_array_equal, params, ref)
  assert fingerprints(model_dir) == fingerprints(ref_dir)


def test_rerun_after_the_last_step_says_so_and_exits_0(uninterrupted):
  gin, model_dir, _ = uninterrupted
  r = train_in_process(gin, model_dir)
  assert r.returncode == 0 and "not above the restored step 12" in r.stdout


def test_starts_from_the_t5x_fixture(tmp_path):
  """The fixture's shapes (emb 8, 4 heads of 3) with the task's 8000-id vocabulary: the
  embedding and output layer (32128 rows in the fixture) are dropped by the assignment
  map and initialised fresh; everything else comes from T5X's checkpoint."""
  gin = tmp_path / "t5x.gin"
  gin.write_text(f"""
include 'runs/finetune.gin'
include 'models/t5_1_1/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
TRAIN_STEPS = 2
BATCH_SIZE = 4
DROPOUT_RATE = 0.0
network.ModelConfig:
  vocab_size = 8000
  emb_dim = 8
  num_heads = 4
  head_dim = 3
  mlp_dim = 16
INITIAL_CHECKPOINT_PATH = '{T5X_FIXTURE}'
utils.RestoreCheckpointConfig.assignment_map = (
    (r'token_embedder/embedding', None), (r'decoder/logits_dense/kernel', None))
""")
  r = train_in_process(gin, tmp_path / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "initialised from" in r.stdout and "2 parameter(s) from scratch" in r.stdout
  _, params = final_params(tmp_path / "model")
  from t5forge.convert import load_checkpoint
  t5x_params = load_checkpoint(T5X_FIXTURE).params
  # Two steps away from the fixture's values: close to them, not equal.
  got = params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  want = np.asarray(t5x_params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"])
  assert np.abs(got - want).max() < 0.1 and not np.array_equal(got, want)


def test_starts_from_an_hf_directory(tmp_path):
  """A random-init T5 1.0-shaped HF model (tied, ReLU) whose vocabulary covers the
  task's 8000 ids, fine-tuned with runs/finetune.gin."""
  import torch
  import transformers
  hf = tmp_path / "hf_dir"
  torch.manual_seed(0)
  transformers.T5ForConditionalGeneration(transformers.T5Config(
      vocab_size=8000, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2,
      feed_forward_proj="relu")).save_pretrained(hf)
  gin = tmp_path / "hf.gin"
  gin.write_text(f"""
include 'runs/finetune.gin'
include 'models/t5_1_0/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'
TASK_FEATURE_LENGTHS = {{'inputs': 16, 'targets': 16}}
TRAIN_STEPS = 2
BATCH_SIZE = 4
DROPOUT_RATE = 0.0
network.ModelConfig:
  vocab_size = 8000
  emb_dim = 16
  num_heads = 4
  head_dim = 4
  mlp_dim = 32
INITIAL_CHECKPOINT_PATH = '{hf}'
""")
  r = train_in_process(gin, tmp_path / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"initialised from {hf} (step 0)" in r.stdout
  assert native.checkpoint_steps(str(tmp_path / "model")) == [2]
