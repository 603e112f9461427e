"""Every shipped gin file parses and builds its model; model gins equal the presets;
the fine-tuning gin of T5X's guide (../shared/seeds) runs with only paths changed."""
import glob
import os
import shutil
import sys

import pytest

from t5forge import presets
from t5forge.cli import gin_flags
from train_helpers import ROOT, cli

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

CONFIGS = os.path.join(ROOT, "t5forge", "configs")
MODEL_GINS = sorted(glob.glob(os.path.join(CONFIGS, "models", "*", "*.gin")))
EXAMPLE_GINS = sorted(glob.glob(os.path.join(CONFIGS, "examples", "*.gin")))
RUN_GINS = sorted(glob.glob(os.path.join(CONFIGS, "runs", "*.gin")))
REQUIRED = ['MODEL_DIR="/tmp/unused"', "MIXTURE_OR_TASK_NAME='bible_translate_en_es'",
            "TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 8}", "TRAIN_STEPS=1",
            "DROPOUT_RATE=0.0"]  # only macros pretrain.gin uses: others are refused


def _model_from_gin():
  import gin
  return gin.query_parameter("MODEL/macro.value").scoped_configurable_fn()


def test_model_gins_are_generated_from_the_presets():
  sys.path.insert(0, os.path.join(ROOT, "tools"))
  import make_model_gins
  assert len(MODEL_GINS) == len(presets.names())
  for name in presets.names():
    family, size = name.split(".")
    with open(os.path.join(CONFIGS, "models", family, f"{size}.gin")) as f:
      assert f.read() == make_model_gins.render(name), f"{name}: rerun tools/make_model_gins.py"


@pytest.mark.parametrize("path", MODEL_GINS, ids=lambda p: os.path.relpath(p, CONFIGS))
def test_model_gin_parses_and_matches_its_preset(path):
  run = os.path.join(CONFIGS, "runs", "pretrain.gin")
  gin_flags.parse([run, path], REQUIRED)
  model = _model_from_gin()
  family, size = os.path.relpath(path, os.path.join(CONFIGS, "models"))[:-4].split("/")
  want = presets.get(f"{family}.{size}").replace(dropout_rate=0.0)
  assert model.config == want


TRAIN_RUN_GINS = [p for p in RUN_GINS if os.path.basename(p) in ("pretrain.gin", "finetune.gin")]
# Run gins included after a training run gin (they change it, they do not make a run).
ADDON_RUN_GINS = [p for p in RUN_GINS if os.path.basename(p) == "prompt_tuning.gin"]


@pytest.mark.parametrize("path", [p for p in RUN_GINS
                                  if p not in TRAIN_RUN_GINS + ADDON_RUN_GINS],
                         ids=lambda p: os.path.relpath(p, CONFIGS))
def test_eval_and_infer_gins_parse(path):
  output_dir = 'EVAL_OUTPUT_DIR="/tmp/unused"' if "eval" in path else 'INFER_OUTPUT_DIR="/tmp/unused"'
  gin_flags.parse([os.path.join(CONFIGS, "models", "t5_1_1", "tiny.gin"), path],
                  ['CHECKPOINT_PATH="/tmp/unused"', output_dir,
                   "MIXTURE_OR_TASK_NAME='bible_translate_en_es'"])
  import gin
  fn = "eval_script.evaluate" if "eval" in path else "infer_script.infer_task"
  assert gin.query_parameter(f"{fn}.restore_checkpoint_cfg") is not None
  assert _model_from_gin().config.vocab_size > 0


@pytest.mark.parametrize("path", TRAIN_RUN_GINS + EXAMPLE_GINS, ids=lambda p: os.path.relpath(p, CONFIGS))
def test_run_and_example_gins_parse(path, tmp_path):
  files = [path] if "examples" in path else [path, os.path.join(CONFIGS, "models", "t5_1_1",
                                                                  "tiny.gin")]
  # Only the macros a gin uses: a command-line macro that none uses is refused.
  initial = (["INITIAL_CHECKPOINT_PATH='/tmp/unused'"]
             if "finetune" in os.path.basename(path) else [])
  if path.endswith("_from_hf.gin"):  # it reads the checkpoint's vocabulary
    shutil.copy(os.path.join(CONFIGS, "..", "data", "bundled", "bible_en_es_8k.model"),
                tmp_path / "spiece.model")
    initial = [f"INITIAL_CHECKPOINT_PATH='{tmp_path}'"]
  gin_flags.parse(files, ['MODEL_DIR="/tmp/unused"', *initial]
                  + ([] if "examples" in path else REQUIRED[1:]))
  import gin
  from t5forge.train import loop
  assert gin.query_parameter("train_script.train.model_dir") is not None
  assert _model_from_gin().config.vocab_size > 0
  del loop


def test_the_prompt_tuning_gin_makes_a_prompt_model_with_the_repos_optimizer():
  """runs/prompt_tuning.gin over runs/finetune.gin and a model gin: a prompt of
  PROMPT_LENGTH, unpacked training rows, Adafactor without parameter scaling, weight decay
  1e-5, a constant learning rate of 0.3 (google-research/prompt-tuning's settings)."""
  files = [os.path.join(CONFIGS, "runs", "finetune.gin"),
           os.path.join(CONFIGS, "models", "t5_1_1", "tiny.gin"), *ADDON_RUN_GINS]
  gin_flags.parse(files, [*REQUIRED, "INITIAL_CHECKPOINT_PATH='/tmp/unused'",
                          "PROMPT_LENGTH=7"])
  import gin
  from t5forge.nn.prompt import PromptConfig
  model = _model_from_gin()
  assert model.config.prompt == PromptConfig(length=7, init="uniform", uniform_scale=0.5)
  assert gin.query_parameter("train/utils.DatasetConfig.pack") is False
  assert gin.query_parameter("adafactor.Adafactor.multiply_by_parameter_scale") is False
  assert gin.query_parameter("adafactor.Adafactor.weight_decay_rate") == 1e-5
  assert gin.query_parameter("utils.create_learning_rate_scheduler.factors") == "constant"
  assert gin.query_parameter("utils.create_learning_rate_scheduler.base_learning_rate") == 0.3


def test_the_guides_finetune_gin_runs_with_paths_changed(tmp_path):
  """T5X's fine-tuning guide: include the finetune run gin and the T5.1.1 small model gin,
  set the macros. Changed: the include paths, the task module, the task (bundled), the
  checkpoint (an HF directory of flan-t5-small's shape with random weights), and, for the
  test's speed, lengths, steps, batch size and two layers a stack (on the command line and
  in the checkpoint) instead of eight. In this process: the subprocess's start is not the
  point."""
  from hf_reference import VARIANTS, build_hf_dir
  VARIANTS["flan_small"] = ("t5", dict(feed_forward_proj="gated-gelu", d_model=512, d_kv=64,
                                       num_heads=6, d_ff=1024, num_layers=2,
                                       num_decoder_layers=2, vocab_size=32128), "4.x")
  ckpt = build_hf_dir("flan_small", str(tmp_path / "flan-t5-small"))
  gin = tmp_path / "small_bible_finetune.gin"
  gin.write_text(f"""
include 't5forge/configs/runs/finetune.gin'
include 't5forge/configs/models/t5_1_1/small.gin'

# Register necessary SeqIO Tasks/Mixtures.
import t5forge.data

MIXTURE_OR_TASK_NAME = "bible_translate_en_es"
TASK_FEATURE_LENGTHS = {{"inputs": 32, "targets": 32}}
TRAIN_STEPS = 2  # 0 pre-trained steps (an HF checkpoint records none) + 2 fine-tuning steps.
DROPOUT_RATE = 0.0
INITIAL_CHECKPOINT_PATH = "{ckpt}"
LOSS_NORMALIZING_FACTOR = 233472
""")
  model_dir = tmp_path / "finetune-model"
  r = cli("train", f"--gin_file={gin}", f'--gin.MODEL_DIR="{model_dir}"', "--gin.BATCH_SIZE=2",
          "--gin.network.ModelConfig.num_encoder_layers=2",
          "--gin.network.ModelConfig.num_decoder_layers=2", "--alsologtostderr")
  assert r.returncode == 0, r.stderr[-3000:]
  assert (model_dir / "checkpoint_2").is_dir()
  assert "LOSS_NORMALIZING_FACTOR = 233472" in (model_dir / "config.gin").read_text()
