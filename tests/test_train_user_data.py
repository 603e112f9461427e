"""End to end through the CLI with the data users hold: a user's `tasks.py` registers a task
on `TfdsDataSource("bible_verses/en_es:1.0.0")` (a directory TFDS itself prepared) and the
same task on `HfDataSource("t5forge-fixtures/bible-verses", name="en_es")` (the Hub cache,
offline); each trains 20 steps, resumes bitwise after SIGKILL and is scored by `t5forge
eval`; the TFDS task also trains from the SeqIO cache that SeqIO wrote for it
(`USE_CACHED_TASKS`), with the TFDS data absent."""
import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import SHARED
from t5forge.convert import native
from train_helpers import ROOT, fingerprints, final_params, kill_when, read_jsonl, write_gin

pytestmark = pytest.mark.slow

FORMATS = os.path.join(SHARED, "testdata", "formats")

TASKS_PY = '''
import os
import t5forge
from t5forge import data as seqio

FORMATS = os.environ["FIXTURES"]
vocab = seqio.SentencePieceVocabulary(os.path.join(FORMATS, "seqio", "spiece.model"))
features = {"inputs": seqio.Feature(vocab), "targets": seqio.Feature(vocab)}


def to_pair(ex):
  return {"inputs": "translate English to Spanish: " + ex["translation"]["en"],
          "targets": ex["translation"]["es"]}


steps = [to_pair, seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
         seqio.preprocessors.append_eos_after_trim]
# The task SeqIO's cache_tasks_main cached as seqio/seqio_cache/bible_cached.
seqio.TaskRegistry.add("bible_cached", seqio.TfdsDataSource("bible_verses/en_es:1.0.0"),
                       preprocessors=steps, output_features=features,
                       metric_fns=[t5forge.metrics.bleu])
seqio.TaskRegistry.add("bible_hub",
                       seqio.HfDataSource("t5forge-fixtures/bible-verses", name="en_es"),
                       preprocessors=steps, output_features=features,
                       metric_fns=[t5forge.metrics.bleu])
'''


# task, flags, environment, validation examples
TFDS = ("bible_cached", [f"--tfds_data_dir={os.path.join(FORMATS, 'tfds_tfrecord')}"], {}, 240)
HUB = ("bible_hub", [], {"HF_HUB_OFFLINE": "1",
                         "HF_HUB_CACHE": os.path.join(FORMATS, "hf_hub_cache")}, 60)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("user")
  (d / "tasks.py").write_text(TASKS_PY)
  write_gin(d / "run.gin", steps=20, period=5, stats_period=5,
            extra="MIXTURE_OR_TASK_MODULE = 'tasks'\n")
  return d


def _env(user_dir, extra):
  env = {**os.environ, "FIXTURES": FORMATS, "T5FORGE_CACHE": str(user_dir / "cache"),
         "PYTHONPATH": os.pathsep.join([str(user_dir), ROOT])}
  for k in ("TFDS_DATA_DIR", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
    env.pop(k, None)
  env.update(extra)
  return env


def _train_cmd(user_dir, model_dir, task, flags):
  return [sys.executable, "-m", "t5forge", "train", f"--gin_file={user_dir / 'run.gin'}",
          f"--gin_search_paths={user_dir}", f'--gin.MODEL_DIR="{model_dir}"',
          f'--gin.MIXTURE_OR_TASK_NAME="{task}"', "--gin.network.ModelConfig.vocab_size=1024",
          *flags]


def _run(cmd, user_dir, extra_env):
  return subprocess.run(cmd, capture_output=True, text=True, cwd=user_dir,
                        env=_env(user_dir, extra_env), timeout=600)


@pytest.mark.parametrize("task,flags,env,num_eval", [TFDS, HUB], ids=["tfds", "hf_hub"])
def test_trains_resumes_bitwise_after_sigkill_and_evaluates(user_dir, task, flags, env, num_eval):
  ref = user_dir / f"{task}_ref"
  r = _run(_train_cmd(user_dir, ref, task, flags), user_dir, env)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "training stopped at step 20" in r.stdout
  # Killed after its first checkpoint, rerun: the same parameters and batches, bit for bit.
  model_dir = user_dir / f"{task}_killed"
  cmd = _train_cmd(user_dir, model_dir, task, flags)
  killed = kill_when(cmd, lambda: 5 in native.checkpoint_steps(str(model_dir)), cwd=user_dir,
                     env=_env(user_dir, env))
  assert killed, "the run finished before it could be killed"
  assert native.checkpoint_steps(str(model_dir))[-1] < 20
  r = _run(cmd, user_dir, env)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from" in r.stdout
  path, params = final_params(model_dir)
  ref_path, ref_params = final_params(ref)
  assert path.endswith("checkpoint_20") and ref_path.endswith("checkpoint_20")
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
  assert fingerprints(model_dir) == fingerprints(ref)
  # t5forge eval scores the task's validation split with its metric.
  r = _run([sys.executable, "-m", "t5forge", "eval", "--checkpoint", str(ref), "--task", task,
            "--module", "tasks", "--feature_lengths", "inputs=64,targets=32", "--batch_size", "48",
            *flags], user_dir, env)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = read_jsonl(ref / "inference_eval" / f"{task}-metrics.jsonl")
  assert rows[-1]["step"] == 20 and rows[-1]["num_examples"] == num_eval
  assert 0 <= rows[-1]["bleu"] <= 100
  assert glob.glob(str(ref / "inference_eval" / f"{task}-20.jsonl"))


def test_trains_from_the_seqio_cache_without_the_tfds_data(user_dir):
  cache_flag = f"--seqio_additional_cache_dirs={os.path.join(FORMATS, 'seqio', 'seqio_cache')}"
  model_dir = user_dir / "cached"
  r = _run(_train_cmd(user_dir, model_dir, "bible_cached",
                      ["--gin.USE_CACHED_TASKS=True", cache_flag]), user_dir, {})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "training stopped at step 20" in r.stdout
  # The same run without the cache needs the TFDS data, which is not given: one line.
  r = _run(_train_cmd(user_dir, user_dir / "uncached", "bible_cached", []), user_dir, {})
  assert r.returncode == 2 and "is not prepared in" in r.stderr and "Traceback" not in r.stderr
  r = _run([sys.executable, "-m", "t5forge", "eval", "--checkpoint", str(model_dir),
            "--task", "bible_cached", "--module", "tasks", "--use_cached", cache_flag,
            "--feature_lengths", "inputs=64,targets=32", "--batch_size", "48"], user_dir, {})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "bible_cached/bleu" in r.stdout + r.stderr
