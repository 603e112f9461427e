"""Bad input to `t5forge train`: one clear line each, exit status 2 (0 when there is
simply nothing to do), and nothing half-written."""
import os

import pytest

from t5forge.convert import native
from train_helpers import cli, error_line, train_in_process, write_gin

# `t5forge train` in this process (train_helpers.cli): each error is one line, exit 2.
pytestmark = pytest.mark.slow  # tiny training runs: make test, not test-fast


def test_batch_not_divisible_by_microbatches(tmp_path):
  gin = write_gin(tmp_path / "run.gin")
  msg = error_line(train_in_process(gin, tmp_path / "m", "trainer.Trainer.num_microbatches=3"))
  assert "BATCH_SIZE 8" in msg and "num_microbatches 3" in msg
  assert not any(native.checkpoint_steps(str(tmp_path / "m")))
  assert not os.path.exists(tmp_path / "m" / "metrics.jsonl")


def test_no_model_dir(tmp_path):
  gin = write_gin(tmp_path / "run.gin")
  msg = error_line(cli("train", f"--gin_file={gin}"))
  assert "MODEL_DIR is required" in msg and "--gin.MODEL_DIR" in msg


def test_model_dir_not_writable(tmp_path):
  gin = write_gin(tmp_path / "run.gin")
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  msg = error_line(train_in_process(gin, blocker / "model"))
  assert "not writable" in msg and "a_file/model" in msg


def test_unquoted_path_unknown_binding_and_parameter(tmp_path):
  gin = write_gin(tmp_path / "run.gin")
  assert "quoted" in error_line(cli("train", f"--gin_file={gin}", f"--gin.MODEL_DIR={tmp_path}/m"))
  msg = error_line(train_in_process(gin, tmp_path / "m", "utils.NoSuchConfig.period=3"))
  assert "utils.NoSuchConfig" in msg
  msg = error_line(train_in_process(gin, tmp_path / "m", "train_script.train.bogus_flag=3"))
  assert "bogus_flag" in msg and "train" in msg
  bad = tmp_path / "bad.gin"
  bad.write_text(open(gin).read() + "\nBATCH_SIZE = %NOT_DEFINED_ANYWHERE\n")
  msg = error_line(train_in_process(bad, tmp_path / "m"))
  assert "NOT_DEFINED_ANYWHERE" in msg


def test_checkpoint_of_another_model_names_the_parameter(tmp_path):
  gin = write_gin(tmp_path / "run.gin", steps=2, period=2)
  assert train_in_process(gin, tmp_path / "m").returncode == 0
  msg = error_line(train_in_process(gin, tmp_path / "m", "TRAIN_STEPS=4",
                              "network.ModelConfig.emb_dim=32"))
  assert "checkpoint_2" in msg and "(64,)" in msg and "(32,)" in msg
  assert native.checkpoint_steps(str(tmp_path / "m")) == [2]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  gin = write_gin(tmp_path / "run.gin", steps=20, period=2, header="""
from __gin__ import dynamic_registration
from t5forge.nn import config as network
from t5forge.train import loop as train_script
from t5forge.train import optim
from t5forge.train import settings as utils
""", extra="""
OPTIMIZER = @optim.AdamW()
# A sane learning rate for 4 steps, then 1e37: the run diverges after checkpoint_4.
utils.create_learning_rate_scheduler.factors = 'constant * decay_every'
utils.create_learning_rate_scheduler.base_learning_rate = 1e-3
utils.create_learning_rate_scheduler.decay_factor = 1e40
utils.create_learning_rate_scheduler.steps_per_decay = 4
""")
  r = train_in_process(gin, tmp_path / "m")
  msg = error_line(r)
  assert "NaN/Inf at step" in msg and "last good checkpoint" in msg
  steps = native.checkpoint_steps(str(tmp_path / "m"))
  assert steps and 4 <= steps[-1] < 20 and f"checkpoint_{steps[-1]} is the last good" in msg
  _, params, _ = native.load(native.latest_checkpoint(str(tmp_path / "m")))
  import jax, numpy as np
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
