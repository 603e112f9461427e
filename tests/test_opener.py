"""One opener for inference (`t5forge.opener`): parameters placed by the partitioner's
rules; a model on 8 CPU devices with 2-D parameter rules decodes, scores and infers the
same as on one device, through the Python API and `t5forge infer`."""
import json
import os
import subprocess
import sys

import jax
import pytest

import t5forge
from t5forge.convert import native
from t5forge.data import vocab_io
from t5forge.data.vocab import SentencePieceVocabulary
from t5forge.nn import init_params
from train_helpers import ROOT, error_line, host_devices, read_jsonl

BUNDLED = os.path.join(ROOT, "t5forge", "data", "bundled")
WORKER = os.path.join(os.path.dirname(__file__), "mesh_inference_worker.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A tiny random t5.1.1 model with the bundled vocabulary; every sharded dimension
  divides a (data 4, model 2) mesh."""
  vocab = SentencePieceVocabulary(os.path.join(BUNDLED, "bible_en_es_8k.model"), extra_ids=100)
  config = t5forge.presets.get("t5_1_1.tiny", vocab_size=vocab.vocab_size)
  path = str(tmp_path_factory.mktemp("opener") / "ckpt")
  native.save(path, config, init_params(config, jax.random.key(3)),
              extra_config={"vocabulary": vocab_io.to_spec(vocab)})
  return path


def _worker(ckpt, devices, mp, pdims):
  r = subprocess.run([sys.executable, WORKER, ckpt, str(mp), str(pdims)], capture_output=True,
                     text=True, env=host_devices(devices), cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_mesh_of_8_with_2d_rules_matches_one_device(ckpt):
  one = _worker(ckpt, 1, 1, 1)
  mesh = _worker(ckpt, 8, 2, 2)
  assert one["devices"] == 1 and mesh["devices"] == 8
  assert mesh["mesh"] == {"data": 4, "model": 2}
  # The rules placed the parameters: the token embedding's vocab axis on 'model' and its
  # embed axis on 'data' (2-D), an MLP kernel's embed on 'data' and mlp on 'model'.
  specs = mesh["specs"]
  assert specs["token_embedder/embedding"] == "P('model', 'data')", specs
  wi = next(v for k, v in specs.items() if k.endswith("mlp/wi_0/kernel"))
  assert wi == "P('data', 'model')", specs
  assert one["mesh"] == {"data": 1, "model": 1}
  for key in ("greedy", "beams", "odd"):
    assert mesh[key] == one[key], key
  assert mesh["scores"] == pytest.approx(one["scores"], rel=1e-5, abs=1e-4)


@pytest.mark.slow
def test_infer_cli_on_a_mesh_equals_one_device(ckpt, tmp_path):
  inputs = tmp_path / "inputs.txt"
  inputs.write_text("In the beginning God created the heavens.\nJesus wept.\n"
                    "The LORD is my shepherd.\nLove is patient.\n", encoding="utf-8")
  out = {}
  for devices, flags in ((1, []), (8, ["--num_partitions", "2",
                                       "--parameter_partitioning_dims", "2"])):
    r = subprocess.run([sys.executable, "-m", "t5forge", "infer", "--checkpoint", ckpt,
                        "--input", str(inputs), "--output_dir", str(tmp_path / f"d{devices}"),
                        "--batch_size", "4", "--max_decode_length", "10", *flags],
                       capture_output=True, text=True, env=host_devices(devices), cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out[devices] = [row["prediction_tokens"] for row in
                    read_jsonl(os.path.join(tmp_path / f"d{devices}", "inputs-0.jsonl"))]
  assert out[8] == out[1] and len(out[1]) == 4


def test_infer_cli_refuses_a_mesh_that_does_not_fit(ckpt, tmp_path):
  """--num_partitions that does not divide the devices: one line naming the fix."""
  inputs = tmp_path / "inputs.txt"
  inputs.write_text("Jesus wept.\n", encoding="utf-8")
  r = subprocess.run([sys.executable, "-m", "t5forge", "infer", "--checkpoint", ckpt,
                      "--input", str(inputs), "--output_dir", str(tmp_path / "o"),
                      "--num_partitions", "3"], capture_output=True, text=True,
                     env=host_devices(2), cwd=ROOT, timeout=600)
  assert "num_partitions=3 does not divide the 2 available devices" in error_line(r)


def test_opener_without_vocabulary_names_what_was_found(tmp_path):
  from t5forge import opener
  config = t5forge.presets.get("t5_1_1.tiny", vocab_size=256)
  path = str(tmp_path / "novocab")
  native.save(path, config, init_params(config, jax.random.key(0)))
  with pytest.raises(t5forge.UserError, match=r"no vocabulary saved with this t5forge "
                     r"checkpoint \(found .*params.*\); pass --vocabulary"):
    opener.open_checkpoint(path, require_vocabulary=True)
  opened = opener.open_checkpoint(path)  # not required: opens without one
  assert opened.vocabulary is None and opened.checkpoint.params is None
