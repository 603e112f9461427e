"""Checkpoint formats: T5X native (the fixture written by T5X, and TensorStore
references), HF variants (torch .bin read without torch, shards, bf16), our own, the
convert CLI, and the errors for bad input."""
import json
import os
import shutil
import subprocess
import sys

import jax
import msgpack
import numpy as np
import pytest

import t5forge
from conftest import T5X_FIXTURE
from hf_reference import hf_forward, load_hf_model, random_batch
from t5forge.convert import load_checkpoint, t5x
from t5forge.errors import UserError
from train_helpers import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flat(v, f"{prefix}/{k}" if prefix else k)
  else:
    yield prefix, tree


def test_t5x_fixture_imports_every_leaf_and_runs(tmp_path):
  raw = t5x.read_t5x_checkpoint(T5X_FIXTURE)
  target = dict(_flat(raw["optimizer"]["target"]))
  ckpt = load_checkpoint(T5X_FIXTURE)
  ours = dict(_flat(jax.tree.map(np.asarray, ckpt.params)))
  assert ckpt.format == "t5x" and set(ours) == set(target) and len(ours) == 52
  for name, arr in target.items():
    assert ours[name].shape == arr.shape
    np.testing.assert_array_equal(ours[name], arr)
  cfg = ckpt.config
  assert (cfg.vocab_size, cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim) == (
      32128, 8, 4, 3, 16)
  assert cfg.mlp_activations == ("gelu", "linear") and not cfg.logits_via_embedding
  # The optimizer state is handed back, not dropped: one Adafactor entry per parameter.
  states = dict(_flat(ckpt.extras["param_states"]))
  assert {n.rsplit("/", 1)[0] for n in states} == set(target)
  assert {n.rsplit("/", 1)[1] for n in states} == {"m", "v", "v_row", "v_col"}
  # It runs, and computes what transformers computes with the same weights.
  m = t5forge.load(T5X_FIXTURE)
  enc, dec = random_batch(cfg.vocab_size, batch=2, enc_len=20, dec_len=9)
  logits = m.logits(enc, dec)
  assert logits.shape == (2, 9, 32128) and np.isfinite(logits).all()
  m.save_hf(str(tmp_path / "hf"))
  _, hf_logits = hf_forward(load_hf_model(str(tmp_path / "hf")), enc, dec)
  np.testing.assert_allclose(logits, hf_logits, rtol=1e-5, atol=1e-5)


def _ext_default(obj):
  if isinstance(obj, np.ndarray):
    return msgpack.ExtType(1, msgpack.packb((obj.shape, obj.dtype.name, obj.tobytes())))
  raise TypeError(type(obj))


def test_t5x_tensorstore_references_are_read(tmp_path):
  """T5X writes partitioned arrays as zarr next to the msgpack file, referenced by a
  TensorStore spec with a path relative to the checkpoint directory."""
  import tensorstore as ts
  raw = t5x.read_t5x_checkpoint(T5X_FIXTURE)
  ckpt_dir = tmp_path / "checkpoint_1000"
  ckpt_dir.mkdir()
  target = raw["optimizer"]["target"]
  originals = {}
  for path in (("token_embedder", "embedding"), ("encoder", "layers_1", "mlp", "wi_0", "kernel")):
    node = target
    for k in path[:-1]:
      node = node[k]
    arr = node[path[-1]]
    name = "target." + ".".join(path)
    spec = {"driver": "zarr", "dtype": "float32",
            "kvstore": {"driver": "file", "path": name},
            "metadata": {"compressor": {"id": "gzip"}, "shape": list(arr.shape),
                         "chunks": [max(1, arr.shape[0] // 4)] + list(arr.shape[1:])}}
    store = ts.open({**spec, "kvstore": {"driver": "file", "path": str(ckpt_dir / name)}},
                    create=True).result()
    store.write(arr).result()
    node[path[-1]] = spec
    originals["/".join(path)] = arr
  raw["optimizer"]["state"]["step"] = np.array(1000, np.int32)
  (ckpt_dir / "checkpoint").write_bytes(msgpack.packb(raw, default=_ext_default))
  loaded = load_checkpoint(str(ckpt_dir))
  assert loaded.step == 1000
  flat = dict(_flat(loaded.params))
  for name, arr in originals.items():
    np.testing.assert_array_equal(np.asarray(flat[name]), arr)
  shutil.rmtree(ckpt_dir / "target.token_embedder.embedding")
  with pytest.raises(UserError, match="target.token_embedder.embedding"):
    load_checkpoint(str(ckpt_dir))


def test_torch_bin_and_shards_read_without_torch(hf_dirs, tmp_path):
  import torch
  src = hf_dirs("flan")
  want = jax.tree.map(np.asarray, t5forge.load(src).params)
  model = load_hf_model(src)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  # One pytorch_model.bin.
  bin_dir = tmp_path / "bin"; bin_dir.mkdir()
  shutil.copy(os.path.join(src, "config.json"), bin_dir)
  torch.save(state, bin_dir / "pytorch_model.bin")
  # Two torch shards with an index; and sharded safetensors from save_pretrained.
  shard_dir = tmp_path / "bin_shards"; shard_dir.mkdir()
  shutil.copy(os.path.join(src, "config.json"), shard_dir)
  keys = sorted(state); half = len(keys) // 2
  weight_map = {}
  for i, part in enumerate((keys[:half], keys[half:])):
    fname = f"pytorch_model-0000{i + 1}-of-00002.bin"
    torch.save({k: state[k] for k in part}, shard_dir / fname)
    weight_map.update({k: fname for k in part})
  (shard_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
  st_dir = tmp_path / "st_shards"
  model.save_pretrained(st_dir, max_shard_size="20KB")
  assert (st_dir / "model.safetensors.index.json").exists()
  for d in (bin_dir, shard_dir, st_dir):
    got = jax.tree.map(np.asarray, t5forge.load(str(d)).params)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_bfloat16_weights_are_cast_to_float32(hf_dirs, tmp_path):
  model = load_hf_model(hf_dirs("t5_1_0"))
  out = tmp_path / "bf16"
  model.to(dtype=__import__("torch").bfloat16).save_pretrained(out)
  params = t5forge.load(str(out)).params
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_native_roundtrip_and_model_dir(hf_dirs, tmp_path):
  m = t5forge.load(hf_dirs("t5_1_0"))
  m.save(str(tmp_path / "mdir" / "checkpoint_7"))
  again = t5forge.load(str(tmp_path / "mdir"))  # a MODEL_DIR: the latest checkpoint
  assert again.config == m.config and again.checkpoint.step == 7
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               m.params, again.params)
  scanned = t5forge.load(str(tmp_path / "mdir"), scan_layers=True)
  enc, dec = random_batch(m.config.vocab_size, batch=1, enc_len=12, dec_len=5)
  np.testing.assert_allclose(scanned.logits(enc, dec), m.logits(enc, dec), rtol=1e-5, atol=1e-5)


def _cli(*args, env=None):
  """In a subprocess: huggingface_hub reads HF_HUB_OFFLINE when it is imported."""
  return subprocess.run([sys.executable, "-m", "t5forge", *args], capture_output=True,
                        text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.slow
def test_convert_cli_t5x_to_t5forge_to_hf(tmp_path):
  r = cli("convert", "--input", T5X_FIXTURE, "--output", str(tmp_path / "ours"), "--to", "t5forge")
  assert r.returncode == 0, r.stderr
  assert "optimizer state (208 arrays)" in r.stdout
  r = cli("convert", "--input", str(tmp_path / "ours"), "--output", str(tmp_path / "hf"), "--to", "hf")
  assert r.returncode == 0, r.stderr
  model = load_hf_model(str(tmp_path / "hf"))
  assert model.config.d_model == 8
  # Output directories are never half-written or overwritten.
  r = cli("convert", "--input", T5X_FIXTURE, "--output", str(tmp_path / "hf"), "--to", "hf")
  assert r.returncode == 2 and "not empty" in r.stderr


def _one_line_error(r):
  assert r.returncode == 2, (r.stdout, r.stderr)
  lines = [l for l in r.stderr.strip().splitlines() if l.startswith("t5forge: error:")]
  assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
  return lines[0]


@pytest.mark.slow
def test_bad_inputs_give_one_line(hf_dirs, tmp_path):
  empty = tmp_path / "empty"; empty.mkdir()
  (empty / "notes.txt").write_text("x")
  msg = _one_line_error(cli("convert", "--input", str(empty), "--output", str(tmp_path / "o"),
                             "--to", "hf"))
  assert "notes.txt" in msg and "config.json" in msg
  only_config = tmp_path / "only_config"; only_config.mkdir()
  shutil.copy(os.path.join(hf_dirs("flan"), "config.json"), only_config)
  msg = _one_line_error(cli("convert", "--input", str(only_config), "--output",
                             str(tmp_path / "o"), "--to", "hf"))
  assert "no weights" in msg and "model.safetensors" in msg
  # A weight of the wrong shape: name the weight, both shapes.
  from safetensors.numpy import load_file, save_file
  bad = tmp_path / "bad_shape"; shutil.copytree(hf_dirs("flan"), bad)
  state = load_file(str(bad / "model.safetensors"))
  state["encoder.block.1.layer.0.SelfAttention.q.weight"] = np.zeros((16, 32), np.float32)
  save_file(state, str(bad / "model.safetensors"))
  msg = _one_line_error(cli("convert", "--input", str(bad), "--output", str(tmp_path / "o"),
                             "--to", "hf"))
  assert "encoder.block.1.layer.0.SelfAttention.q.weight" in msg and "(16, 32)" in msg
  assert "(32, 32)" in msg
  # An unsupported architecture.
  arch = tmp_path / "bart"; shutil.copytree(hf_dirs("flan"), arch)
  cfg = json.loads((arch / "config.json").read_text())
  cfg.update(model_type="bart", architectures=["BartForConditionalGeneration"])
  (arch / "config.json").write_text(json.dumps(cfg))
  msg = _one_line_error(cli("convert", "--input", str(arch), "--output", str(tmp_path / "o"),
                             "--to", "hf"))
  assert "BartForConditionalGeneration" in msg and "T5ForConditionalGeneration" in msg
  assert not (tmp_path / "o").exists()


def test_hub_name_offline_says_what_to_do():
  r = _cli("convert", "--input", "google/flan-t5-base", "--output", "/tmp/never", "--to", "hf",
           env={"HF_HUB_OFFLINE": "1"})
  msg = _one_line_error(r)
  assert "google/flan-t5-base" in msg and "local directory" in msg
