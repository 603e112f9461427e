"""A t5forge checkpoint opened for inference on a mesh is restored as training restores
it: Orbax reads each parameter straight into its shards on the mesh (`opener`), through
`t5forge.load`, `t5forge eval` (`evaluate.evaluate`) and the opener `t5forge serve` calls;
no parameter a mesh axis splits is ever made whole on one device or placed from the host.
Runs on 8 simulated CPU devices in a subprocess (`mesh_restore_worker.py`)."""
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
from train_helpers import ROOT, host_devices

BUNDLED = os.path.join(ROOT, "t5forge", "data", "bundled")
WORKER = os.path.join(os.path.dirname(__file__), "mesh_restore_worker.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A tiny random t5.1.1 model with the bundled vocabulary, saved as training saves."""
  vocab = SentencePieceVocabulary(os.path.join(BUNDLED, "bible_en_es_8k.model"), extra_ids=100)
  config = t5forge.presets.get("t5_1_1.tiny", vocab_size=vocab.vocab_size)
  path = str(tmp_path_factory.mktemp("mesh_restore") / "ckpt")
  native.save(path, config, init_params(config, jax.random.key(5)),
              extra_config={"vocabulary": vocab_io.to_spec(vocab)})
  return path


@pytest.mark.slow  # ~1 min: a subprocess that compiles eval on 8 devices
def test_load_eval_and_serve_restore_each_parameter_onto_its_shards(ckpt, tmp_path):
  env = host_devices(8)
  r = subprocess.run([sys.executable, WORKER, ckpt, "2", str(tmp_path / "eval")],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  assert report["devices"] == 8 and report["mesh"] == {"data": 4, "model": 2}
  # The worker asserted, for each entry point: every restored array's sharding is the
  # rules' NamedSharding, and the one Orbax restore of the parameters targeted exactly
  # those shardings.
  for name in ("load", "serve", "eval"):
    assert report[name]["params"] > 10 and report[name]["split"] > 5, report[name]
    specs = report[name]["specs"]
    assert specs["token_embedder/embedding"] == "P('model', None)", specs
    wi = next(v for k, v in specs.items() if k.endswith("mlp/wi_0/kernel"))
    assert wi == "P(None, 'model')", specs
  assert report["eval_steps"] == [0] and report["scanned"] > 5
  # No split parameter was whole on one device or placed from the host; the restore onto
  # one device (`native.load`) was not used.
  assert report["full_copies"] == [] and report["native_loads"] == 0, report
