"""A frozen base read from a Hugging Face directory tensor by tensor, kept as bfloat16 or
int8 kernels as it is read (`base_dtype`, `nn.adapters.store_base`): the same values as the
float32 loader's, rounded, and no float32 copy of the model in memory on the way.

The reference is the float32 loader (itself checked against transformers' numerics in
tests/test_hf_parity.py) and the directories transformers' `save_pretrained` writes,
sharded with `max_shard_size`.
"""
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from t5forge import convert
from t5forge.convert import hf
from t5forge.errors import UserError
from t5forge.nn import quant

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _leaves(params) -> dict:
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}


def _save_sharded(src: str, out: str, max_shard_size: str) -> str:
  import transformers
  model = transformers.T5ForConditionalGeneration.from_pretrained(src)
  model.save_pretrained(out, max_shard_size=max_shard_size)
  for name in ("config.json",):  # the source's config (its 4.x tying flags), as written
    with open(os.path.join(src, name)) as f, open(os.path.join(out, name), "w") as g:
      g.write(f.read())
  return out


@pytest.fixture(scope="module")
def sharded(hf_dirs, tmp_path_factory):
  """(single-file directory, the same model as >= 2 safetensors shards + index)."""
  src = hf_dirs("flan")
  out = _save_sharded(src, str(tmp_path_factory.mktemp("sharded")), "40KB")
  shards = [n for n in os.listdir(out) if n.startswith("model-") and n.endswith(".safetensors")]
  assert len(shards) >= 2 and os.path.isfile(os.path.join(out, hf.SAFETENSORS_INDEX))
  return src, out


def test_sharded_reads_as_the_single_file(sharded):
  src, out = sharded
  one, many = convert.load_checkpoint(src), convert.load_checkpoint(out)
  a, b = _leaves(one.params), _leaves(many.params)
  assert a.keys() == b.keys()
  assert all(np.array_equal(a[k], b[k]) and b[k].dtype == np.float32 for k in a)


@pytest.mark.parametrize("scan", [False, True])
def test_bfloat16_base_is_the_float32_loader_rounded(sharded, scan):
  """Projection kernels: bitwise the float32 loader's kernels rounded to bfloat16 (as
  `jnp.astype` rounds); everything else float32 and unchanged."""
  _, out = sharded
  f32 = _leaves(convert.load_checkpoint(out, scan_layers=scan).params)
  ckpt = convert.load_checkpoint(out, scan_layers=scan, base_dtype="bfloat16")
  assert ckpt.config.scan_layers is scan
  bf16 = _leaves(ckpt.params)
  assert f32.keys() == bf16.keys()
  kernels = [k for k in f32 if k.endswith("['kernel']")]
  assert len(kernels) > 10 and any("logits_dense" in k for k in kernels)
  for k, want in f32.items():
    got = bf16[k]
    if k in kernels:
      assert got.dtype == ml_dtypes.bfloat16, k
      rounded = np.asarray(jax.numpy.asarray(want).astype(jax.numpy.bfloat16))
      assert np.array_equal(got.view(np.uint16), rounded.view(np.uint16)), k
    else:
      assert got.dtype == np.float32 and np.array_equal(got, want), k


def test_int8_base_is_the_float32_loader_quantised(sharded):
  _, out = sharded
  f32 = convert.load_checkpoint(out, scan_layers=True).params
  q = convert.load_checkpoint(out, scan_layers=True, base_dtype="int8").params
  kernel = f32["encoder"]["layers"]["attention"]["query"]["kernel"]  # [layers, in, out]
  got = q["encoder"]["layers"]["attention"]["query"]["kernel"]
  want = quant.quantize_kernel(kernel, exact=True)
  assert isinstance(got, quant.QArray) and got.exact and got.q.dtype == np.int8
  assert np.array_equal(got.q, want.q) and np.array_equal(got.scale, want.scale)
  assert q["token_embedder"]["embedding"].dtype == np.float32


def test_load_keeps_the_base_dtype_and_runs(sharded):
  """`t5forge.load(path, base_dtype=...)`: the placed kernels are bfloat16, and the logits
  are bitwise the float32-stored model's computing in bfloat16 (which casts each kernel to
  bfloat16 as it is used)."""
  import t5forge
  _, out = sharded
  m = t5forge.load(out, base_dtype="bfloat16", dtype="bfloat16")
  ref = t5forge.load(out, dtype="bfloat16")
  assert m.params["encoder"]["layers_0"]["mlp"]["wo"]["kernel"].dtype == jax.numpy.bfloat16
  enc = np.array([[5, 6, 7, 1, 0], [9, 3, 1, 0, 0]], np.int32)
  dec = np.array([[0, 9, 8, 1], [0, 4, 4, 2]], np.int32)
  got, want = m.logits(enc, dec), ref.logits(enc, dec)
  assert np.isfinite(got).all() and np.array_equal(got, want)


def test_bad_base_dtype_and_bad_file(sharded, tmp_path):
  _, out = sharded
  with pytest.raises(UserError, match=r"base_dtype 'float16' is not one of"):
    convert.load_checkpoint(out, base_dtype="float16")
  broken = tmp_path / "broken"
  broken.mkdir()
  first = sorted(n for n in os.listdir(out) if n.startswith("model-"))[0]
  for name in os.listdir(out):
    data = open(os.path.join(out, name), "rb").read()
    (broken / name).write_bytes(data[:-64] if name == first else data)  # a download cut short
  with pytest.raises(UserError, match=r"model-00001.*truncated"):
    convert.load_checkpoint(str(broken), base_dtype="bfloat16")


_MEASURE = r"""
import json, resource, sys
import jax, ml_dtypes, numpy as np
import t5forge
from t5forge import convert
jax.devices()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
m = t5forge.load(sys.argv[1], base_dtype="bfloat16")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ours = {jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(m.params)}
del m
f32 = convert.load_checkpoint(sys.argv[1]).params
same = all(
    (np.array_equal(ours[k].view(np.uint16), np.asarray(v).astype(ml_dtypes.bfloat16).view(np.uint16))
     if k.endswith("['kernel']") else np.array_equal(ours[k], v))
    for k, v in ((jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_leaves_with_path(f32)))
print(json.dumps({"growth": peak - before, "same": bool(same), "leaves": len(ours)}))
"""


@pytest.mark.slow
def test_base_shaped_bfloat16_load_holds_no_float32_copy(tmp_path):
  """A flan-t5-base-shaped HF checkpoint (random init, 3 shards) loaded with base_dtype
  bfloat16 in a fresh process: its peak RSS grows by less than 0.7x the model's float32
  bytes (bf16 kernels + float32 embeddings are ~0.55x; reading the whole file, or a
  float32 copy, would be >= 1x), and every leaf is the float32 loader's, rounded."""
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.T5Config(feed_forward_proj="gated-gelu", d_model=768, d_kv=64, num_heads=12,
                              d_ff=2048, num_layers=12, num_decoder_layers=12, vocab_size=32128,
                              tie_word_embeddings=False)
  model = transformers.T5ForConditionalGeneration(cfg)
  float32_bytes = sum(p.numel() for p in model.parameters()) * 4
  model.save_pretrained(str(tmp_path), max_shard_size="400MB")
  del model
  with open(tmp_path / hf.SAFETENSORS_INDEX) as f:
    assert len(set(json.load(f)["weight_map"].values())) >= 2
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], env=env, check=True,
                       capture_output=True, text=True, timeout=600)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["same"] and result["leaves"] > 200
  assert result["growth"] < 0.7 * float32_bytes, (result["growth"] / 2**20, float32_bytes / 2**20)


ADAPTER_GIN = """
from __gin__ import dynamic_registration
from t5forge.nn import config as network
from t5forge.nn import lora
from t5forge.train import loop as train_script
include 'examples/finetune_from_hf.gin'
INITIAL_CHECKPOINT_PATH = '{path}'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 16}}
TRAIN_STEPS = 2
BATCH_SIZE = 2
EVAL_PERIOD = 1000
DROPOUT_RATE = 0.0
network.ModelConfig:
  emb_dim = 64
  head_dim = 16
  num_heads = 4
  mlp_dim = 128
  num_encoder_layers = 2
  num_decoder_layers = 2
  vocab_size = 8000
  lora = @lora.LoraConfig()
lora.LoraConfig.rank = 4
train_script.train.base_dtype = '{base_dtype}'
"""


@pytest.fixture(scope="module")
def tiny_flan_sharded(tmp_path_factory):
  """A flan-t5-shaped HF directory in 3+ safetensors shards, the bundled 8k vocabulary
  (the tokenizer of the example's task), written by transformers."""
  import shutil

  import torch
  import transformers
  from safetensors.torch import load_file, save_file

  from t5forge.data import bundled_tasks
  d = str(tmp_path_factory.mktemp("hf") / "tiny-flan")
  torch.manual_seed(0)
  config = transformers.T5Config(feed_forward_proj="gated-gelu", vocab_size=8000, d_model=64,
                                 d_kv=16, num_heads=4, d_ff=128, num_layers=2,
                                 num_decoder_layers=2, decoder_start_token_id=0)
  transformers.T5ForConditionalGeneration(config).save_pretrained(d, max_shard_size="1MB")
  # transformers 5 writes no lm_head here: add flan-t5's untied one to the last shard (and
  # the index), with its config's tie_word_embeddings = false.
  index_path = os.path.join(d, hf.SAFETENSORS_INDEX)
  with open(index_path) as f:
    index = json.load(f)
  last = sorted(set(index["weight_map"].values()))[-1]
  state = load_file(os.path.join(d, last))
  state["lm_head.weight"] = torch.randn(8000, 64) * 0.05
  save_file(state, os.path.join(d, last), metadata={"format": "pt"})
  index["weight_map"]["lm_head.weight"] = last
  with open(index_path, "w") as f:
    json.dump(index, f)
  with open(os.path.join(d, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["tie_word_embeddings"] = False
  hf_config.pop("scale_decoder_outputs", None)  # a transformers 5 field flan-t5's lacks
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(hf_config, f)
  shutil.copy(bundled_tasks.VOCAB_PATH, os.path.join(d, "spiece.model"))
  assert len([n for n in os.listdir(d) if n.startswith("model-")]) >= 2
  return d


@pytest.mark.slow
def test_adapter_training_reads_its_base_as_int8(tiny_flan_sharded, tmp_path):
  """`train_script.train.base_dtype = 'int8'` from a sharded HF directory through the
  CLI: the run trains and says so, and its checkpoint records the base, its dtype and the
  fingerprint of the float32 base."""
  from t5forge.nn import adapters
  from train_helpers import train_in_process
  gin = tmp_path / "lora.gin"
  gin.write_text(ADAPTER_GIN.format(path=tiny_flan_sharded, base_dtype="int8"))
  r = train_in_process(gin, tmp_path / "model")
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
  assert "frozen in int8" in r.stdout + r.stderr
  ckpt = tmp_path / "model" / "checkpoint_2"
  with open(ckpt / adapters.CONFIG_FILE) as f:
    record = json.load(f)
  assert record["base_dtype"] == "int8" and record["base"] == tiny_flan_sharded
  # The fingerprint is the float32 base's: the int8 read changed only the kernels.
  assert record["fingerprint"] == adapters.fingerprint(
      convert.load_checkpoint(tiny_flan_sharded, scan_layers=True).params)
