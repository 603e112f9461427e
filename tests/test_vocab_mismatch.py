"""A task whose vocabulary is not the checkpoint's is refused in one line:
eval, infer --task, fine-tuning from INITIAL_CHECKPOINT_PATH (unless
allow_vocabulary_change), resuming a MODEL_DIR, a model gin's VOCABULARY; and
finetune_from_hf.gin fine-tunes with the checkpoint's own vocabulary."""
import base64
import contextlib
import io
import os
import shutil

import jax
import pytest

from t5forge import presets
from t5forge.cli import main as cli
from t5forge.convert import hf, native
from t5forge.data import bundled_tasks, vocab_io
from t5forge.data.vocab import (ByteVocabulary, SentencePieceVocabulary, read_training_text,
                                train_sentencepiece)
from t5forge.nn import init_params
from train_helpers import ROOT

BUNDLED = os.path.join(os.path.dirname(bundled_tasks.__file__), "bundled")
BUNDLED_SPM = os.path.join(BUNDLED, "bible_en_es_8k.model")
TASK = "bible_translate_en_es"
# flan_t5.tiny's shapes with room for both vocabularies (8000 bundled ids, 400 tiny ones).
TINY_FLAN = ["network.ModelConfig.vocab_size=8000", "network.ModelConfig.emb_dim=64",
             "network.ModelConfig.num_heads=4", "network.ModelConfig.num_encoder_layers=2",
             "network.ModelConfig.num_decoder_layers=2", "network.ModelConfig.head_dim=16",
             "network.ModelConfig.mlp_dim=128"]


@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory):
  """A 400-id SentencePiece vocabulary (300 pieces + 100 extra ids) of its own: not the
  bundled one."""
  d = tmp_path_factory.mktemp("spm")
  sentences, _ = read_training_text([os.path.join(BUNDLED, "en_es_bible.validation.tsv.gz")])
  path = train_sentencepiece(sentences, vocab_size=400, extra_ids=100,
                             output_prefix=str(d / "tiny_bible"))
  return SentencePieceVocabulary(path, extra_ids=100)


@pytest.fixture(scope="module")
def flan_like_hf(tiny_spm, tmp_path_factory):
  """An HF directory shaped like flan-t5 (gated GELU, untied), random weights, whose
  tokenizer is `tiny_spm` (its spiece.model, as Flan-T5 ships its own)."""
  d = str(tmp_path_factory.mktemp("hf") / "flan-like")
  config = presets.get("flan_t5.tiny", vocab_size=8000)
  hf.save_hf(init_params(config, jax.random.key(1)), config, d)
  shutil.copy(tiny_spm.path, os.path.join(d, "spiece.model"))
  return d


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_spm, tmp_path_factory):
  """A t5forge checkpoint trained (random here) with `tiny_spm`."""
  d = str(tmp_path_factory.mktemp("ckpt") / "checkpoint")
  config = presets.get("t5_1_1.tiny", vocab_size=8000)
  native.save(d, config, init_params(config, jax.random.key(0)),
              extra_config={"vocabulary": vocab_io.to_spec(tiny_spm)})
  return d


def _run(*argv):
  """`t5forge ...` in this process -> (exit code, stdout, the error line or None)."""
  out, err = io.StringIO(), io.StringIO()
  with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(out), \
       contextlib.redirect_stderr(err):
    cli.main(list(argv))
  out, err = out.getvalue(), err.getvalue()
  errors = [l for l in err.splitlines() if l.startswith("t5forge: error:")]
  assert "Traceback" not in err and len(errors) <= 1, err[-3000:]
  return e.value.code, out, (errors[0] if errors else None)


def _refused(result):
  code, out, line = result
  assert code == 2 and line is not None, out[-2000:]
  return line


def test_difference_names_both_vocabularies(tiny_spm, tmp_path):
  bundled = SentencePieceVocabulary(BUNDLED_SPM, extra_ids=100)
  copy = tmp_path / "spiece.model"
  shutil.copy(BUNDLED_SPM, copy)
  assert vocab_io.difference(bundled, SentencePieceVocabulary(copy, extra_ids=100)) is None
  # The same pieces with another trainer record (input files ...) tokenize the same.
  from sentencepiece import sentencepiece_model_pb2 as pb
  proto = pb.ModelProto()
  proto.ParseFromString(open(BUNDLED_SPM, "rb").read())
  proto.trainer_spec.input.append("/somewhere/else.txt")
  (tmp_path / "retrained.model").write_bytes(proto.SerializeToString())
  assert vocab_io.difference(
      bundled, SentencePieceVocabulary(tmp_path / "retrained.model", extra_ids=100)) is None
  # The name travels with a checkpoint's spec.
  back = vocab_io.from_spec(vocab_io.to_spec(bundled))
  assert vocab_io.difference(bundled, back) is None
  assert vocab_io.describe(back) == "sentencepiece 8000 ids (bible_en_es_8k)"
  assert vocab_io.difference(bundled, tiny_spm) == (
      "sentencepiece 8000 ids (bible_en_es_8k) vs sentencepiece 400 ids (tiny_bible)")
  assert "extra_ids 100 vs 0" in vocab_io.difference(
      bundled, SentencePieceVocabulary(BUNDLED_SPM, extra_ids=0))
  assert vocab_io.difference(ByteVocabulary(125), ByteVocabulary(125)) is None
  assert vocab_io.difference(ByteVocabulary(125), ByteVocabulary(0)) == (
      "byte 384 ids (125 extra) vs byte 259 ids (0 extra)")
  assert vocab_io.difference(ByteVocabulary(125), bundled).startswith("byte 384 ids")
  assert vocab_io.from_checkpoint(str(tmp_path)) == SentencePieceVocabulary(copy, extra_ids=100)


@pytest.mark.slow
def test_eval_refuses_another_vocabulary_and_runs_with_the_checkpoints(tiny_ckpt, tmp_path):
  args = ["eval", "--checkpoint", tiny_ckpt, "--task", TASK, "--num_examples", "2",
          "--feature_lengths", "inputs=32,targets=4", "--output_dir", str(tmp_path / "eval")]
  line = _refused(_run(*args))
  assert (f"task '{TASK}' is tokenized with sentencepiece 8000 ids (bible_en_es_8k), but "
          f"checkpoint {tiny_ckpt} uses sentencepiece 400 ids (tiny_bible)") in line
  assert "--use_checkpoint_vocabulary" in line
  assert not os.path.exists(tmp_path / "eval")
  code, out, _ = _run(*args, "--use_checkpoint_vocabulary")
  assert code == 0, out
  names = os.listdir(tmp_path / "eval")
  assert any(n.startswith(f"{TASK}.vocab_") and n.endswith("-metrics.jsonl") for n in names)


def test_infer_task_refuses_another_vocabulary(tiny_ckpt, tmp_path):
  line = _refused(_run("infer", "--checkpoint", tiny_ckpt, "--task", TASK,
                       "--output_dir", str(tmp_path / "out")))
  assert f"task '{TASK}'" in line and "tiny_bible" in line and "bible_en_es_8k" in line
  assert "--use_checkpoint_vocabulary" in line
  # T5X-style infer (gin): the same check.
  from t5forge import infer
  from t5forge.errors import UserError
  from t5forge.train.settings import DatasetConfig, RestoreCheckpointConfig
  with pytest.raises(UserError, match="@data.with_vocabulary") as e:
    infer.infer_task(dataset_cfg=DatasetConfig(TASK, None, split="validation", batch_size=8),
                     restore_checkpoint_cfg=RestoreCheckpointConfig(path=tiny_ckpt),
                     output_dir=str(tmp_path / "gin"))
  assert "\n" not in str(e.value) and "tiny_bible" in str(e.value)


def _train(model_dir, *bindings, gin_files=("t5forge/configs/runs/finetune.gin",
                                                    "t5forge/configs/models/flan_t5/tiny.gin")):
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    return _run("train", *[f"--gin_file={g}" for g in gin_files],
                f'--gin.MODEL_DIR="{model_dir}"', "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=2",
                "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
                "--gin.DROPOUT_RATE=0.0", *[f"--gin.{b}" for b in TINY_FLAN + list(bindings)])
  finally:
    os.chdir(cwd)


@pytest.fixture(scope="module")
def finetuned(flan_like_hf, tmp_path_factory):
  """MODEL_DIR of finetune_from_hf.gin (made tiny) run 2 steps from `flan_like_hf`."""
  model_dir = str(tmp_path_factory.mktemp("finetuned") / "model")
  code, out, line = _train(model_dir, f'INITIAL_CHECKPOINT_PATH="{flan_like_hf}"',
                           gin_files=["t5forge/configs/examples/finetune_from_hf.gin"])
  assert code == 0, (line, out[-2000:])
  return model_dir


@pytest.mark.slow
def test_finetune_from_hf_gin_uses_the_checkpoints_vocabulary(finetuned, tiny_spm):
  spec = native.read_config(os.path.join(finetuned, "checkpoint_2"))["vocabulary"]
  with open(tiny_spm.path, "rb") as f:
    assert base64.b64decode(spec["model_base64"]) == f.read()  # the checkpoint's, not bundled
  assert vocab_io.describe(vocab_io.from_spec(spec)) == "sentencepiece 400 ids (flan-like/spiece)"


@pytest.mark.slow
def test_finetune_refuses_another_vocabulary_unless_allowed(flan_like_hf, tmp_path):
  line = _refused(_train(tmp_path / "m", f'INITIAL_CHECKPOINT_PATH="{flan_like_hf}"',
                         f"MIXTURE_OR_TASK_NAME='{TASK}'"))
  assert (f"task '{TASK}' is tokenized with sentencepiece 8000 ids (bible_en_es_8k), but "
          f"checkpoint {flan_like_hf} uses sentencepiece 400 ids (flan-like/spiece)") in line
  assert "@data.with_vocabulary()" in line and "allow_vocabulary_change = True" in line
  assert not native.checkpoint_steps(str(tmp_path / "m"))
  code, out, line = _train(tmp_path / "m", f'INITIAL_CHECKPOINT_PATH="{flan_like_hf}"',
                           f"MIXTURE_OR_TASK_NAME='{TASK}'", "TRAIN_STEPS=1",
                           "utils.RestoreCheckpointConfig.allow_vocabulary_change=True")
  assert code == 0, (line, out[-2000:])
  assert "warning: task 'bible_translate_en_es' and checkpoint" in out


def test_resuming_with_another_vocabulary_is_refused(flan_like_hf, finetuned, tiny_spm):
  """The task the MODEL_DIR was trained on, redefined with another vocabulary (as an edited
  tasks.py would): the data iterator's state matches by name, the vocabulary does not."""
  from t5forge import data
  name = data.with_vocabulary(TASK, tiny_spm)  # the task finetune_from_hf.gin trained
  bible = data.get_mixture_or_task(TASK)
  data.TaskRegistry.add(name, bible.source, bible.preprocessors, bible.output_features,
                        bible.postprocess_fn, bible.metric_fns, overwrite=True)
  try:
    line = _refused(_train(finetuned, f'INITIAL_CHECKPOINT_PATH="{flan_like_hf}"',
                           f"MIXTURE_OR_TASK_NAME='{name}'", "TRAIN_STEPS=4"))
  finally:
    data.TaskRegistry.remove(name)
  assert (f"task '{name}' is tokenized with sentencepiece 8000 ids (bible_en_es_8k), but "
          f"checkpoint {finetuned}/checkpoint_2 uses sentencepiece 400 ids (flan-like/spiece)"
          ) in line
  assert "new MODEL_DIR" in line
  assert native.checkpoint_steps(finetuned) == [2]


def test_model_vocabulary_other_than_the_tasks_is_refused(flan_like_hf, tmp_path):
  gin = tmp_path / "run.gin"
  gin.write_text("from __gin__ import dynamic_registration\n"
                 "from t5forge.data import vocab_io\n"
                 "include 't5forge/configs/runs/pretrain.gin'\n"
                 "include 't5forge/configs/models/flan_t5/tiny.gin'\n"
                 f"MIXTURE_OR_TASK_NAME = '{TASK}'\n"
                 "VOCABULARY = @vocab_io.from_checkpoint()\n"
                 f"vocab_io.from_checkpoint.path = '{flan_like_hf}'\n")
  line = _refused(_train(tmp_path / "m", gin_files=[str(gin)]))
  assert f"task '{TASK}'" in line and "the model (its VOCABULARY)" in line
  assert "but the model (its VOCABULARY) uses sentencepiece 400 ids (flan-like/spiece)" in line
  assert "VOCABULARY = None" in line


def test_with_vocabulary_copies_a_cached_task_with_its_own_cache(tiny_spm, tmp_path):
  from t5forge import data
  bundled = SentencePieceVocabulary(BUNDLED_SPM, extra_ids=100)
  text = "En el principio creó Dios los cielos y la tierra."
  data.TaskRegistry.add(
      "vm_cached", data.InMemoryDataSource({"train": [{"inputs": text, "targets": text}]}),
      [data.preprocessors.tokenize, data.CacheDatasetPlaceholder()],
      {"inputs": data.Feature(bundled), "targets": data.Feature(bundled)},
      cache_dir=str(tmp_path / "cache"), overwrite=True)
  try:
    name = data.with_vocabulary("vm_cached", tiny_spm)
    assert name.startswith("vm_cached.vocab_") and data.with_vocabulary("vm_cached", tiny_spm) == name
    assert data.with_vocabulary("vm_cached", bundled) == "vm_cached"  # its own: unchanged
    def targets(task):
      return list(next(iter(data.get_dataset(task, "train", None, shuffle=False)))["targets"])
    assert targets("vm_cached") == bundled.encode(text)
    assert targets(name) == tiny_spm.encode(text)  # not the cached ids of the 8k vocabulary
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(["vm_cached", name])
  finally:
    data.TaskRegistry.remove("vm_cached")
