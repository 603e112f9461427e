"""Partitioning on 8 host CPU devices (a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8): meshes (8,1), (4,2), (2,4) with 1-D
and 2-D parameter rules train like one device, every leaf is sharded as the rules say,
checkpoints move between meshes; and the partitioner's errors for bad input."""
import json
import os
import subprocess
import sys

import pytest

from t5forge.errors import UserError
from t5forge.sharding import Partitioner, standard_logical_axis_rules
from train_helpers import EIGHT, ROOT, write_gin

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


def test_meshes_match_one_device_and_shard_as_the_rules_say(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharding_worker.py"),
                      str(tmp_path)], capture_output=True, text=True, env=EIGHT, cwd=ROOT,
                     timeout=1200)
  assert r.returncode == 0, r.stderr[-4000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  for name in ("8x1_p1", "4x2_p1", "4x2_p2", "2x4_p2"):
    x = report[name]
    # Three Adafactor steps; float32 rounding of differently ordered reductions only.
    assert x["max_param_diff"] < 1e-5 and x["loss_diff"] < 1e-2, (name, x)
    assert x["leaves_checked"] > 200
  # 2-D parameter rules shard more parameters (embed over 'data') than 1-D ones.
  assert report["4x2_p2"]["sharded_params"] > report["4x2_p1"]["sharded_params"]
  assert report["restore_8x1"]["devices"] == 8 and report["restore_1x1"]["devices"] == 1


def test_model_info_shows_partition_specs_and_batch_divisibility(tmp_path):
  gin = write_gin(tmp_path / "run.gin", steps=2, period=2, extra="""
partitioning.PjitPartitioner.mesh_shape = (4, 2)
partitioning.standard_logical_axis_rules.parameter_partitioning_dims = 2
network.ModelConfig.emb_dim = 128  # large enough for Adafactor to factor the embedding
""")
  cmd = [sys.executable, "-m", "t5forge", "train", f"--gin_file={gin}",
         f'--gin.MODEL_DIR="{tmp_path / "m"}"']
  r = subprocess.run(cmd, capture_output=True, text=True, env=EIGHT, cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  info = (tmp_path / "m" / "model-info.txt").read_text()
  assert "Mesh: {'data': 4, 'model': 2}" in info
  line = next(l for l in info.splitlines() if l.startswith("encoder/layers_0/mlp/wi_0/kernel"))
  assert "('embed', 'mlp')" in line and "('data', 'model')" in line
  line = next(l for l in info.splitlines() if l.startswith("opt_state/v_col/token_embedder"))
  assert "(8000,)" in line and "('vocab',)" in line and "('model',)" in line  # factored stats
  r = subprocess.run(cmd[:-1] + [f'--gin.MODEL_DIR="{tmp_path / "m2"}"', "--gin.BATCH_SIZE=6"],
                     capture_output=True, text=True, env=EIGHT, cwd=ROOT, timeout=600)
  assert r.returncode == 2 and "BATCH_SIZE 6 is not divisible by the data axis" in r.stderr


def test_bad_meshes_and_rules_give_one_line():
  with pytest.raises(UserError, match="num_partitions=3 does not divide"):
    Partitioner(num_partitions=3)
  with pytest.raises(UserError, match=r"mesh_shape \(2, 2\) has 4 devices but 1"):
    Partitioner(mesh_shape=(2, 2))
  with pytest.raises(UserError, match="unknown logical axis"):
    Partitioner(logical_axis_rules=[("bacth", "data")])
  with pytest.raises(UserError, match="not in the mesh"):
    Partitioner(logical_axis_rules=[("batch", "replica")])
  rules = [r for r in standard_logical_axis_rules() if r[0] != "mlp"]
  with pytest.raises(UserError, match="'mlp' that no partitioning rule covers"):
    Partitioner(logical_axis_rules=rules).tree_shardings({"w": ("embed", "mlp")})
  with pytest.raises(UserError, match="must each be 1 or 2"):
    standard_logical_axis_rules(3, 1)
