"""Every shipped example gin trains: each file in
t5forge/configs/examples/ (globbed: a new example is covered without editing this file)
runs through the CLI for 2 steps, with its own model and task, made small only in what
sets a run's cost (batch, lengths, steps, two layers a stack); it exits 0, writes checkpoint_2, and reports
the teacher-forced train-eval loss at step 2 in metrics.jsonl. The Hugging Face fine-tuning
example starts from a tiny HF directory written here by transformers."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from t5forge.data import bundled_tasks
from train_helpers import ROOT, error_line, read_jsonl, train_in_process

EXAMPLES_DIR = os.path.join(ROOT, "t5forge", "configs", "examples")
EXAMPLES = sorted(glob.glob(os.path.join(EXAMPLES_DIR, "*.gin")))
# Macros every run gin (runs/pretrain.gin, runs/finetune.gin) defines: only those are bound
# (a command-line macro no gin file uses is refused).
SMALL = ["TRAIN_STEPS=2", "EVAL_PERIOD=2", "EVAL_STEPS=1", "BATCH_SIZE=2",
         "TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}"]
TWO_LAYERS = ["network.ModelConfig.num_encoder_layers=2",
              "network.ModelConfig.num_decoder_layers=2"]
# The tiny HF model's shapes, as network.ModelConfig bindings over flan_t5/small.gin's
# (flan-t5-small itself would take minutes to write and compile here).
TINY_HF = dict(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, num_decoder_layers=2)
TINY_MODEL = ["network.ModelConfig.emb_dim=64", "network.ModelConfig.head_dim=16",
              "network.ModelConfig.num_heads=4", "network.ModelConfig.mlp_dim=128",
              "network.ModelConfig.num_encoder_layers=2",
              "network.ModelConfig.num_decoder_layers=2", "network.ModelConfig.vocab_size=8000"]


def test_the_examples_are_found():
  names = {os.path.basename(p) for p in EXAMPLES}
  assert {"bible_translate_from_scratch.gin", "span_corruption_pretrain.gin",
          "finetune_from_hf.gin", "docstring_summarize.gin", "prompt_tuning_from_hf.gin"} <= names


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  """A flan-t5-shaped HF directory (gated GELU, untied output layer), random weights,
  written by transformers, whose tokenizer is the bundled 8k spiece.model (8000 ids with
  its 100 extra ids, the vocab_size of the model)."""
  import torch
  import transformers
  from safetensors.torch import load_file, save_file
  d = str(tmp_path_factory.mktemp("hf") / "tiny-flan")
  vocab_size = bundled_tasks.VOCABULARY.vocab_size
  torch.manual_seed(0)
  config = transformers.T5Config(feed_forward_proj="gated-gelu", vocab_size=vocab_size,
                                 decoder_start_token_id=0, **TINY_HF)
  transformers.T5ForConditionalGeneration(config).save_pretrained(d)
  # transformers 5 writes no lm_head for this config: add an untied one, as flan-t5-small's
  # files (transformers 4.x) have, with their config's tie_word_embeddings = false.
  weights = os.path.join(d, "model.safetensors")
  state = load_file(weights)
  state["lm_head.weight"] = torch.randn(vocab_size, TINY_HF["d_model"]) * 0.05
  save_file(state, weights, metadata={"format": "pt"})
  with open(os.path.join(d, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["tie_word_embeddings"] = False
  hf_config.pop("scale_decoder_outputs", None)  # a transformers 5 field flan-t5's lacks
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  shutil.copy(bundled_tasks.VOCAB_PATH, os.path.join(d, "spiece.model"))
  return d


def _bindings(gin_file, request):
  with open(gin_file) as f:
    text = "\n".join(l.split("#")[0] for l in f)  # not the comments
  bindings = list(SMALL)
  if "runs/finetune.gin" not in text:
    # Two layers a stack instead of the example's 3-8: the compiles (most of a 2-step run)
    # shrink with the unrolled stack; everything else the example sets stays as written.
    bindings += TWO_LAYERS
  if "runs/finetune.gin" in text:  # it needs INITIAL_CHECKPOINT_PATH: the tiny HF model
    bindings += [f'INITIAL_CHECKPOINT_PATH="{request.getfixturevalue("tiny_hf")}"', *TINY_MODEL,
                 "EVALUATOR_NUM_EXAMPLES=2"]  # infer-eval decodes the whole split otherwise
  return bindings


@pytest.mark.slow
@pytest.mark.parametrize("gin_file", EXAMPLES, ids=os.path.basename)
def test_example_trains(gin_file, tmp_path, request):
  model_dir = tmp_path / "model"
  r = train_in_process(os.path.relpath(gin_file, ROOT), model_dir,
                *_bindings(gin_file, request))
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert os.path.isdir(model_dir / "checkpoint_2"), os.listdir(model_dir)
  rows = read_jsonl(model_dir / "metrics.jsonl")
  train_eval = [row for row in rows
                if row["step"] == 2 and row["split"].startswith("training_eval/")]
  assert train_eval, [row["split"] for row in rows]
  for row in train_eval:  # teacher-forced loss of a model that has trained 2 steps
    assert 0.0 < row["loss_per_nonpadding_target_token"] < 20.0, json.dumps(row)[:500]
  if any("INITIAL_CHECKPOINT_PATH" in b for b in _bindings(gin_file, request)):
    # runs/finetune.gin's inference evaluator decoded and scored (BLEU) at step 2.
    assert any(row["step"] == 2 and row["split"].startswith("inference_eval/")
               for row in rows), [row["split"] for row in rows]
  if os.path.basename(gin_file) == "lora_from_hf.gin":
    # Adapter training: the checkpoint is the adapter on the frozen bfloat16 base.
    with open(model_dir / "checkpoint_2" / "adapter.json") as f:
      record = json.load(f)
    assert record["base_dtype"] == "bfloat16" and record["model"]["lora"]["targets"] == "qv"
  if os.path.basename(gin_file) == "span_corruption_pretrain.gin":
    # A pre-training task has no metric_fns: train-eval still reports its loss.
    assert [row["split"] for row in train_eval] == ["training_eval/english_span_corruption"]
  if os.path.basename(gin_file) == "ul2_pretrain.gin":
    # ul2.ul2_task with the bundled task's own settings names the bundled task itself.
    assert [row["split"] for row in train_eval] == ["training_eval/english_ul2"]


@pytest.mark.slow
def test_training_without_metrics_skips_inference_eval_with_a_note(tmp_path):
  """T5X's train.py: an inference evaluator with no task that has metric_fns is skipped
  (one note); train-eval still reports the teacher-forced loss. Before: 'no task has a
  'validation' split with metric_fns to evaluate' stopped the run at start-up."""
  gin = tmp_path / "pretrain_with_infer_eval.gin"
  gin.write_text("""
from __gin__ import dynamic_registration
from t5forge import evaluate as evaluation
from t5forge.nn import config as network
from t5forge.train import loop as train_script
from t5forge.train import settings as utils
include 'runs/pretrain.gin'
include 'models/t5_1_1/tiny.gin'
MIXTURE_OR_TASK_NAME = 'english_span_corruption'
TASK_FEATURE_LENGTHS = {'inputs': 64, 'targets': 16}
TRAIN_STEPS = 2
BATCH_SIZE = 2
EVAL_PERIOD = 2
EVAL_STEPS = 1
DROPOUT_RATE = 0.0
network.ModelConfig.vocab_size = 8000
train_script.train.infer_eval_dataset_cfg = @infer_eval/utils.DatasetConfig()
train_script.train.inference_evaluator_cls = @evaluation.InferenceEvaluator
infer_eval/utils.DatasetConfig:
  mixture_or_task_name = %MIXTURE_OR_TASK_NAME
  task_feature_lengths = %TASK_FEATURE_LENGTHS
  split = 'validation'
  batch_size = %BATCH_SIZE
  shuffle = False
  pack = False
""")
  model_dir = tmp_path / "model"
  r = train_in_process(str(gin), model_dir)
  assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
  notes = [l for l in r.stdout.splitlines() if "inference evaluation skipped" in l]
  assert notes == ["note: 'english_span_corruption': no task has a 'validation' split with "
                   "metric_fns to evaluate; inference evaluation skipped (train-eval still "
                   "reports the teacher-forced loss)"], r.stdout[-3000:]
  splits = [row["split"] for row in read_jsonl(model_dir / "metrics.jsonl") if row["step"] == 2]
  assert "training_eval/english_span_corruption" in splits, splits
  assert not any(s.startswith("inference_eval") for s in splits), splits
  assert not os.path.exists(model_dir / "inference_eval")
  # `t5forge eval` of such a task has nothing to do: refused in one line, as before.
  r = subprocess.run([sys.executable, "-m", "t5forge", "eval", "--checkpoint",
                      str(model_dir / "checkpoint_2"), "--task", "english_span_corruption"],
                     capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert error_line(r) == ("t5forge: error: 'english_span_corruption': no task has a "
                           "'validation' split with metric_fns to evaluate")
