"""Mesh TensorFlow T5 checkpoints (TensorFlow V2 bundles) read without TensorFlow, checked
against TensorFlow itself: the fixture its Saver wrote (`testdata/mtf`: logits in float64,
the same weights as an HF directory), and bundles written here by `tf.compat.v1.train.Saver`
and `tf.train.Checkpoint` (TensorFlow is imported in this test module only, once)."""
import gzip
import json
import os
import shutil

import google_crc32c
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import t5forge
from conftest import SHARED
from hf_reference import build_hf_dir, hf_forward, load_hf_model, random_batch
from t5forge.convert import load_checkpoint, mtf, tf_bundle
from t5forge.errors import UserError
from train_helpers import cli

FIXTURE = os.path.join(SHARED, "testdata", "mtf", "t5_1_1_tiny")
PREFIX = os.path.join(FIXTURE, "model.ckpt-1000000")


@pytest.fixture(scope="module")
def tf():
  import tensorflow as tf  # slow: once for the module
  return tf


@pytest.fixture(scope="module")
def expected():
  with gzip.open(os.path.join(FIXTURE, "expected.json.gz")) as f:
    return json.load(f)


# ------------------------------------------------------------------ the fixture TF 2.21 wrote


@pytest.mark.parametrize("given", [PREFIX, PREFIX + ".index", FIXTURE],
                         ids=["prefix", "index", "directory"])
def test_fixture_gives_tensorflows_logits(given, expected):
  model = t5forge.load(given)
  assert model.checkpoint.format == "mtf" and model.checkpoint.step == 1000000
  assert model.checkpoint.extras["slots"] == 90  # Adafactor slots counted, not parameters
  logits = model.logits(np.array(expected["encoder_input_tokens"]),
                        np.array(expected["decoder_input_tokens"]))
  ref = np.array(expected["logits_float64"])
  # Reached: 2.7e-6 max abs error (|logits| up to 12.9), float32 on CPU.
  assert np.abs(logits - ref).max() < 2e-5


def test_convert_to_hf_is_bit_for_bit(tmp_path):
  r = cli("convert", "--input", PREFIX, "--output", str(tmp_path / "hf"), "--to", "hf")
  assert r.returncode == 0, r.stderr
  assert "Adafactor slots (90 arrays) and global_step 1000000" in r.stdout
  ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
  ref = load_file(os.path.join(FIXTURE, "hf", "model.safetensors"))
  for name, want in ref.items():
    assert ours[name].dtype == want.dtype and ours[name].tobytes() == want.tobytes(), name
  # transformers 5 wrote the reference tied (lm_head is shared.weight, unscaled); we write
  # the checkpoint's separate decoder/logits/kernel, which holds the same values.
  assert set(ours) - set(ref) == {"lm_head.weight"}
  assert ours["lm_head.weight"].tobytes() == ref["shared.weight"].tobytes()


def _damaged(tmp_path, how):
  d = tmp_path / how
  shutil.copytree(FIXTURE, d, ignore=shutil.ignore_patterns("hf", "*.gz"))
  for f in d.iterdir():
    f.chmod(0o644)
  data = d / "model.ckpt-1000000.data-00001-of-00002"
  if how == "flipped_byte":
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0x01
    data.write_bytes(bytes(raw))
  elif how == "missing_shard":
    data.unlink()
  elif how == "truncated_shard":
    data.write_bytes(data.read_bytes()[:50000])
  else:  # a byte of the index's first data block
    index = d / "model.ckpt-1000000.index"
    raw = bytearray(index.read_bytes())
    raw[40] ^= 0x10
    index.write_bytes(bytes(raw))
  return str(d)


@pytest.mark.parametrize("how,names", [
    ("flipped_byte", ["data-00001-of-00002", "crc32c", "tensor '"]),
    ("missing_shard", ["data-00001-of-00002: missing", "2 data shards"]),
    ("truncated_shard", ["data-00001-of-00002: truncated", "tensor '"]),
    ("bad_index", ["model.ckpt-1000000.index", "checksum"]),
])
def test_damaged_bundles_give_one_line(tmp_path, how, names):
  with pytest.raises(UserError) as e:
    load_checkpoint(_damaged(tmp_path, how))
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in names), msg


def test_damaged_footer_and_wrong_gin_give_one_line(tmp_path):
  d = tmp_path / "short"
  shutil.copytree(FIXTURE, d, ignore=shutil.ignore_patterns("hf", "*.gz"))
  (d / "model.ckpt-1000000.index").chmod(0o644)
  index = d / "model.ckpt-1000000.index"
  index.write_bytes(index.read_bytes()[:-3])
  with pytest.raises(UserError, match=r"\.index: not a TensorFlow checkpoint index"):
    load_checkpoint(str(d))
  d = tmp_path / "gin"
  shutil.copytree(FIXTURE, d, ignore=shutil.ignore_patterns("hf", "*.gz"))
  (d / "operative_config.gin").chmod(0o644)
  gin = (d / "operative_config.gin").read_text().replace("d_ff = 64", "d_ff = 128")
  (d / "operative_config.gin").write_text(gin)
  with pytest.raises(UserError, match=r"operative_config.gin: .*hidden_size = 128.* mlp_dim 64"):
    load_checkpoint(str(d / "model.ckpt-1000000"))


def test_gin_is_parsed_not_executed(tmp_path):
  gin = tmp_path / "operative_config.gin"
  gin.write_text("import os\nd_model = 8\nx/Unitransformer.d_model = %d_model\n"
                 "run.layout = \\\n    [@a.b,\n     @c.d]\nf = __import__('os').system('false')\n"
                 "act = ['gelu', 'linear']  # gated, '#' in a comment\nname = 'a#b'\n")
  got = mtf.gin_bindings(str(gin))
  assert got["x/Unitransformer.d_model"] == 8 and got["run.layout"] == "[@a.b, @c.d]"
  assert got["f"] == "__import__('os').system('false')"  # text, never evaluated
  assert got["act"] == ["gelu", "linear"] and got["name"] == "a#b"


# ------------------------------------------------------- bundles TensorFlow writes here


def test_reader_matches_tf_checkpoint_dtypes(tf, tmp_path):
  """tf.train.Checkpoint: float32, bfloat16, int64 and string variables (and the object
  graph, itself a string tensor), read back value for value and checksum checked."""
  rng = np.random.default_rng(0)
  values = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
            "bf16": rng.standard_normal((4, 2)).astype(tf.bfloat16.as_numpy_dtype),
            "i64": rng.integers(-2**40, 2**40, size=(7,)),
            "s": np.array([b"", b"mesh", b"tensorflow \xff"], dtype=object)}
  ckpt = tf.train.Checkpoint(**{k: tf.Variable(v) for k, v in values.items()})
  prefix = ckpt.write(str(tmp_path / "ckpt"))
  bundle = tf_bundle.Bundle(prefix)
  reader = tf.train.load_checkpoint(prefix)
  assert set(bundle.names()) == set(reader.get_variable_to_shape_map())
  for name in bundle.names():
    np.testing.assert_array_equal(bundle.read(name), reader.get_tensor(name))
  assert bundle.entry("bf16/.ATTRIBUTES/VARIABLE_VALUE").dtype == "bfloat16"
  assert bundle.entry("s/.ATTRIBUTES/VARIABLE_VALUE").dtype == "string"


def _hf_to_mtf(state: dict, n_enc: int, n_dec: int, *, tied: bool) -> dict:
  """An HF T5 state dict under Mesh TF's names and layouts (kernels [in, out])."""
  out = {"shared/embedding": state["shared.weight"]}
  for stack, n, kinds in (("encoder", n_enc, ["SelfAttention", "DenseReluDense"]),
                          ("decoder", n_dec, ["SelfAttention", "EncDecAttention",
                                              "DenseReluDense"])):
    for i in range(n):
      for j, kind in enumerate(kinds):
        h, m = f"{stack}.block.{i}.layer.{j}", f"{stack}/block_{i:03d}/layer_{j:03d}"
        out[f"{m}/rms_norm/scale"] = state[f"{h}.layer_norm.weight"]
        for name, w in state.items():
          if name.startswith(f"{h}.{kind}.") and name.endswith(".weight"):
            part = name[len(f"{h}.{kind}."):-len(".weight")]
            if part == "relative_attention_bias":
              out[f"{m}/SelfAttention/relative_attention_bias"] = w.T  # [heads, buckets]
            elif kind == "DenseReluDense":
              out[f"{m}/DenseReluDense/{part}/kernel"] = w.T
            else:
              out[f"{m}/{kind}/{part}"] = w.T
    out[f"{stack}/rms_norm/scale"] = state[f"{stack}.final_layer_norm.weight"]
  if not tied:
    out["decoder/logits/kernel"] = state["lm_head.weight"].T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _slots(weights: dict, factored: bool) -> dict:
  """Adafactor slots as Mesh TF names them: vr/vc for matrices when factored, else v."""
  out = {}
  for name, w in weights.items():
    if factored and w.ndim == 2:
      out[name + "_slot_vr"] = np.abs(w).mean(axis=1)
      out[name + "_slot_vc"] = np.abs(w).mean(axis=0)
    else:
      out[name + "_slot_v"] = np.square(w)
  return out


def _saver_write(tf, tensors: dict, prefix: str, shards: int, step: int) -> str:
  """What Mesh TF's run does: tf.compat.v1.train.Saver(sharded=True) over variables spread
  across `shards` CPU devices, and a global_step."""
  graph = tf.Graph()
  with graph.as_default():
    variables = []
    for i, (name, value) in enumerate(sorted(tensors.items())):
      with tf.device(f"/cpu:{i % shards}"):
        variables.append(tf.compat.v1.Variable(value, name=name))
    with tf.device("/cpu:0"):
      variables.append(tf.compat.v1.Variable(np.int64(step), name="global_step"))
    saver = tf.compat.v1.train.Saver(variables, sharded=True)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": shards})
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      return saver.save(sess, prefix, global_step=step)


@pytest.fixture(scope="module")
def written(tf, tmp_path_factory):
  """name -> (Mesh TF prefix, HF directory of the same weights, number of slot tensors)."""
  out = {}
  for name, variant, tied, factored, shards in (
      ("t5_1_0", "t5_1_0", True, None, 3),
      ("factored", "flan_5x", False, True, 2),
      ("unfactored", "flan_5x", False, False, 1),
      ("mt5", "mt5", False, True, 2),  # MT5ForConditionalGeneration, vocabulary 300
      ("byt5", "byt5", False, False, 1)):  # a byte vocabulary (384), 4 + 2 layers
    root = tmp_path_factory.mktemp(name)
    hf_dir = build_hf_dir(variant, str(root / "hf"), seed=3)
    with open(os.path.join(hf_dir, "config.json")) as f:
      cfg = json.load(f)
    weights = _hf_to_mtf(load_file(os.path.join(hf_dir, "model.safetensors")),
                         cfg["num_layers"], cfg["num_decoder_layers"], tied=tied)
    slots = _slots(weights, factored) if factored is not None else {}
    weights.update(slots)
    os.makedirs(root / "mtf")
    prefix = _saver_write(tf, weights, str(root / "mtf" / "model.ckpt"), shards, step=250)
    out[name] = (prefix, hf_dir, len(slots))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("name,shards", [("t5_1_0", 3), ("factored", 2), ("unfactored", 1),
                                         ("mt5", 2), ("byt5", 1)])
def test_saver_bundles_match_transformers(written, name, shards):
  prefix, hf_dir, slots = written[name]
  assert prefix.endswith("model.ckpt-250")
  assert tf_bundle.Bundle(prefix).num_shards == shards
  ours = t5forge.load(os.path.dirname(prefix))  # the directory: its `checkpoint` state file
  assert ours.checkpoint.step == 250 and ours.checkpoint.extras["slots"] == slots
  assert ours.config.logits_via_embedding == (name == "t5_1_0")
  enc, dec = random_batch(ours.config.vocab_size, enc_len=40, dec_len=30)
  _, hf_logits = hf_forward(load_hf_model(hf_dir), enc, dec)
  np.testing.assert_allclose(ours.logits(enc, dec), hf_logits, rtol=1e-5, atol=1e-5)


def test_importing_t5forge_and_its_cli_never_imports_tensorflow():
  import subprocess
  import sys
  code = ("import sys, t5forge, t5forge.cli, t5forge.convert.mtf, t5forge.convert.tf_bundle; "
          "t5forge.convert.mtf.load_mtf(sys.argv[1]); "
          "bad = [m for m in sys.modules if m == 'tensorflow' or m.startswith('tensorflow.')]; "
          "print(bad); sys.exit(1 if bad else 0)")
  r = subprocess.run([sys.executable, "-c", code, PREFIX], capture_output=True, text=True,
                     timeout=300, cwd=os.path.dirname(os.path.dirname(t5forge.__file__)))
  assert r.returncode == 0, r.stdout + r.stderr[-2000:]


# ------------------------------------------------------------ fine-tuning from the fixture

TASKS_PY = '''
import functools
from t5forge import data as seqio
from t5forge.data import bundled_tasks, preprocessors as pre

# ByT5's byte vocabulary (259 ids) fits the fixture's 512.
features = {"inputs": seqio.Feature(seqio.ByteVocabulary()),
            "targets": seqio.Feature(seqio.ByteVocabulary())}
seqio.TaskRegistry.add(
    "bible_bytes",
    seqio.TsvDataSource({"train": bundled_tasks.BIBLE_TRAIN,
                         "validation": bundled_tasks.BIBLE_VALIDATION}, field_names=("en", "es")),
    preprocessors=[functools.partial(pre.translate, source_language="en", target_language="es"),
                   pre.tokenize, seqio.CacheDatasetPlaceholder(), pre.append_eos_after_trim],
    output_features=features, metric_fns=[])
'''

FINETUNE_GIN = """
include 'runs/finetune.gin'
include 'models/t5_1_1/tiny.gin'
MIXTURE_OR_TASK_NAME = 'bible_bytes'
MIXTURE_OR_TASK_MODULE = 'mtf_tasks'
TASK_FEATURE_LENGTHS = {'inputs': 64, 'targets': 64}
TRAIN_STEPS = 1000020  # T5X's convention: the checkpoint's step + 20 fine-tuning steps
BATCH_SIZE = 8
DROPOUT_RATE = 0.0
EVAL_PERIOD = 1000
network.ModelConfig:
  vocab_size = 512
  emb_dim = 32
  num_heads = 2
  head_dim = 16
  mlp_dim = 64
  dtype = 'float32'
utils.create_learning_rate_scheduler.base_learning_rate = 0.01
utils.SaveCheckpointConfig.period = 20
adafactor.Adafactor.min_dim_size_to_factor = 32
train_script.train.stats_period = 5
"""


@pytest.mark.slow
def test_finetunes_from_the_fixture_as_initial_checkpoint(tmp_path):
  from train_helpers import ROOT, read_jsonl, train_in_process
  (tmp_path / "mtf_tasks.py").write_text(TASKS_PY)
  gin = tmp_path / "finetune.gin"
  gin.write_text(FINETUNE_GIN)
  model_dir = tmp_path / "model"
  r = train_in_process(str(gin), model_dir, f'INITIAL_CHECKPOINT_PATH="{PREFIX}"',
                       env={"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]),
                            "T5FORGE_CACHE": str(tmp_path / "cache")})
  assert r.returncode == 0, r.stderr[-3000:]
  log = r.stdout + r.stderr
  assert "initialised from" in log and "step 1000000" in log
  # The run's Adafactor factors as the checkpoint's (min_dim_size_to_factor 32 here): every
  # parameter's second moments come from its slots.
  assert "Adafactor second moments of 52 parameter(s) from the Mesh TF slots" in log, log
  assert "fresh second moments" not in log
  rows = [x for x in read_jsonl(model_dir / "metrics.jsonl") if x["split"] == "train"]
  assert rows[-1]["step"] == 1000020
  losses = [x["loss_per_nonpadding_target_token"] for x in rows]
  assert losses[-1] < losses[0] - 0.3, losses


# ---------------------------------------------------------------------------- in a bucket


def _upload_fixture(url: str) -> None:
  """The fixture's files (not its hf/ directory) under the bucket URL."""
  from t5forge import storage
  for name in os.listdir(FIXTURE):
    if os.path.isfile(os.path.join(FIXTURE, name)):
      storage.upload(os.path.join(FIXTURE, name), f"{url}/{name}")


@pytest.mark.slow  # the bucket emulators
def test_a_bucket_checkpoint_reads_as_the_local_one(bucket_env, cache):
  from t5forge import storage
  _, bucket = bucket_env
  url = bucket + "/pretrained_models/t5_1_1_tiny"
  _upload_fixture(url)
  storage.write_bytes(f"{url}/model.ckpt-5.data-00000-of-00001", b"an older step's shard")
  local = load_checkpoint(PREFIX)
  for given in (url + "/model.ckpt-1000000", url + "/model.ckpt-1000000.index", url):
    remote = load_checkpoint(given)
    assert remote.format == "mtf" and remote.step == 1000000
    for a, b in zip(*(jax.tree.leaves(c.params) for c in (remote, local))):
      np.testing.assert_array_equal(a, b)
  # Only this checkpoint's files (and its gin) were copied, not the older step's shard.
  copied = os.listdir(os.path.dirname(remote.extras["prefix"]))
  assert "operative_config.gin" in copied and "model.ckpt-5.data-00000-of-00001" not in copied
  # INITIAL_CHECKPOINT_PATH in the bucket: the parameters, the step and the slots.
  from t5forge import nn
  from t5forge.train import optim
  from t5forge.train.checkpoint import initial_params, initial_second_moments
  from t5forge.train.settings import RestoreCheckpointConfig
  restore = RestoreCheckpointConfig(path=url + "/model.ckpt-1000000")
  params, step, scratch, _ = initial_params(restore, nn.init_params(local.config, jax.random.key(0)),
                                            model_config=local.config)
  assert step == 1000000 and not scratch
  jax.tree.map(np.testing.assert_array_equal, params, local.params)
  axes, abstract = nn.logical_axes(local.config), nn.abstract_params(local.config)
  spec = optim.Adafactor(min_dim_size_to_factor=32)
  state = spec.build(lambda _: 0.01, axes).init(params)
  _, notes = initial_second_moments(restore, state, spec.state_axes(state, abstract, axes),
                                    axes, model_config=local.config)
  assert notes == [f"Adafactor second moments of 52 parameter(s) from the Mesh TF slots of "
                   f"{restore.path}"]


# ------------------------------------------------------------------- infer from the CLI


@pytest.fixture(scope="module")
def small_spm(tmp_path_factory):
  """A 400-piece SentencePiece model of bundled English text (+100 sentinels = 500 ids,
  within the fixture's 512)."""
  import itertools

  import sentencepiece as spm

  from t5forge.data import bundled_tasks
  with gzip.open(bundled_tasks.BIBLE_TRAIN, "rt") as f:
    lines = [line.split("\t")[0] for line in itertools.islice(f, 3000)]
  prefix = str(tmp_path_factory.mktemp("spm") / "en400")
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix,
                                 vocab_size=400, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
  return prefix + ".model"


@pytest.mark.slow
def test_infer_cli_decodes_as_transformers_generate(small_spm, tmp_path):
  import torch

  from t5forge.data.vocab import SentencePieceVocabulary
  texts = ["In the beginning God created the heavens", "and the earth"]
  (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
  r = cli("infer", "--checkpoint", PREFIX, "--input", str(tmp_path / "in.txt"),
          "--output_dir", str(tmp_path / "out"), "--vocabulary", small_spm,
          "--max_decode_length", "8")
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [json.loads(line) for line in (tmp_path / "out" / "in-1000000.jsonl").read_text().splitlines()]
  vocab = SentencePieceVocabulary(small_spm, extra_ids=100)
  hf_model = load_hf_model(os.path.join(FIXTURE, "hf"))
  for text, row in zip(texts, rows):
    ids = torch.tensor([list(vocab.encode(text)) + [1]])
    want = hf_model.generate(ids, max_new_tokens=8, do_sample=False, num_beams=1)[0, 1:].tolist()
    assert row["prediction_tokens"] == want and len(want) == 8, (row, want)


@pytest.mark.slow
def test_serve_answers_as_transformers_generate(small_spm):
  from serve_inprocess import InProcess
  from t5forge import testing
  from t5forge.data.vocab import SentencePieceVocabulary
  srv = InProcess("--checkpoint", PREFIX, "--vocabulary", small_spm, *testing.FAST_FLAGS)
  srv.start()
  try:
    status, _, body = srv.ask("/v1/completions", {"prompt": "and the earth", "max_tokens": 8,
                                                  "temperature": 0})
  finally:
    srv.close()
  assert status == 200, body
  import torch
  vocab = SentencePieceVocabulary(small_spm, extra_ids=100)
  ids = torch.tensor([list(vocab.encode("and the earth")) + [1]])
  want = load_hf_model(os.path.join(FIXTURE, "hf")).generate(
      ids, max_new_tokens=8, do_sample=False, num_beams=1)[0, 1:].tolist()
  assert body["choices"][0]["text"] == vocab.decode(want), (body, want)


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
    n >>= 7
    if not n:
      return bytes(out)


def _table(rows: list, blocks: int) -> bytes:
  """A LevelDB table of `rows` in `blocks` data blocks, the first Snappy-compressed (as
  TensorFlow's TableBuilder does with Options.compression = kSnappyCompression), keys
  written whole (no shared prefixes, one restart point per block)."""
  import pyarrow

  def block(entries, snappy):
    raw = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in entries)
    raw += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")
    body = pyarrow.compress(raw, codec="snappy", asbytes=True) if snappy else raw
    kind = bytes([1 if snappy else 0])
    crc = tf_bundle.masked_crc(kind, google_crc32c.value(body))
    return body + kind + crc.to_bytes(4, "little")

  out, index = b"", []
  for i in range(blocks):
    part = rows[i * len(rows) // blocks:(i + 1) * len(rows) // blocks]
    data = block(part, snappy=i == 0)
    index.append((part[-1][0], _varint(len(out)) + _varint(len(data) - 5)))
    out += data
  meta = block([], snappy=False)
  meta_handle = _varint(len(out)) + _varint(len(meta) - 5)
  out += meta
  index_block = block(index, snappy=False)
  footer = meta_handle + _varint(len(out)) + _varint(len(index_block) - 5)
  out += index_block
  return out + footer.ljust(40, b"\0") + (0xDB4775248B80FB57).to_bytes(8, "little")


def test_snappy_blocks_and_many_blocks_read(tmp_path, expected):
  d = tmp_path / "snappy"
  shutil.copytree(FIXTURE, d, ignore=shutil.ignore_patterns("hf", "*.gz"))
  index = d / "model.ckpt-1000000.index"
  index.chmod(0o644)
  index.write_bytes(_table(tf_bundle.read_table(str(index)), blocks=3))
  model = t5forge.load(str(d))
  logits = model.logits(np.array(expected["encoder_input_tokens"]),
                        np.array(expected["decoder_input_tokens"]))
  assert np.abs(logits - np.array(expected["logits_float64"])).max() < 2e-5


@pytest.mark.parametrize("min_dim,seeded", [(32, 52), (128, 14)])
def test_adafactor_slots_seed_the_runs_state_where_it_factors_alike(min_dim, seeded):
  from t5forge import nn
  from t5forge.train import optim
  from t5forge.train.checkpoint import initial_second_moments
  from t5forge.train.settings import RestoreCheckpointConfig
  config = load_checkpoint(PREFIX).config
  axes, abstract = nn.logical_axes(config), nn.abstract_params(config)
  spec = optim.Adafactor(min_dim_size_to_factor=min_dim)
  state = spec.build(lambda _: 0.01, axes).init(
      jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract))
  state_axes = spec.state_axes(state, abstract, axes)
  state, notes = initial_second_moments(RestoreCheckpointConfig(path=PREFIX), state,
                                        state_axes, axes, model_config=config)
  assert f"of {seeded} parameter(s)" in notes[0]
  assert (len(notes) == 2 and notes[1].startswith("38 parameter(s) start with fresh")) == (
      min_dim == 128)
  bundle = tf_bundle.Bundle(PREFIX)
  scale = state.v["encoder"]["layers_1"]["pre_mlp_layer_norm"]["scale"]
  np.testing.assert_array_equal(
      scale, bundle.read("encoder/block_001/layer_001/rms_norm/scale_slot_v"))
  if min_dim == 32:
    # o [heads*d_kv, d_model] is square: Mesh TF's vr keeps dim 1 (d0 is the first of the
    # largest), which is where our v_col keeps it (v_row keeps dim 0, the heuristic's rows).
    o = "decoder/block_001/layer_001/EncDecAttention/o"
    ours = state.v_col["decoder"]["layers_1"]["encoder_decoder_attention"]["out"]["kernel"]
    np.testing.assert_array_equal(ours, bundle.read(o + "_slot_vr"))
    emb = state.v_col["token_embedder"]["embedding"]  # [vocab 512, 32]: keeps the vocab dim
    np.testing.assert_array_equal(emb, bundle.read("shared/embedding_slot_vc"))


def test_a_model_that_does_not_fit_the_checkpoint_is_one_line():
  from t5forge import nn
  from t5forge.train.checkpoint import initial_params
  from t5forge.train.settings import RestoreCheckpointConfig
  config = load_checkpoint(PREFIX).config.replace(mlp_dim=128)  # the user's model gin
  with pytest.raises(UserError) as e:
    fresh = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), nn.abstract_params(config))
    initial_params(RestoreCheckpointConfig(path=FIXTURE), fresh, model_config=config)
  msg = str(e.value)
  assert "\n" not in msg and "mlp/wi_0/kernel' has shape (32, 64)" in msg and "(32, 128)" in msg


@pytest.mark.slow
@pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)
def test_finetunes_from_a_checkpoint_in_a_gcs_bucket(bucket_env, tmp_path):
  from train_helpers import ROOT, read_jsonl, train_in_process
  _, bucket = bucket_env
  url = bucket + "/pretrained_models/t5_1_1_tiny"
  _upload_fixture(url)
  (tmp_path / "mtf_tasks.py").write_text(TASKS_PY)
  gin = tmp_path / "finetune.gin"
  gin.write_text(FINETUNE_GIN.replace("TRAIN_STEPS = 1000020", "TRAIN_STEPS = 1000010"))
  r = train_in_process(str(gin), tmp_path / "model", f'INITIAL_CHECKPOINT_PATH="{url}"',
                       env={"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]),
                            "T5FORGE_CACHE": str(tmp_path / "cache")})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Adafactor second moments of 52 parameter(s)" in r.stdout + r.stderr
  rows = [x for x in read_jsonl(tmp_path / "model" / "metrics.jsonl") if x["split"] == "train"]
  losses = [x["loss_per_nonpadding_target_token"] for x in rows]
  assert rows[-1]["step"] == 1000010 and losses[-1] < losses[0], losses


def test_a_partitioned_variable_is_refused_in_one_line(tf, tmp_path):
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.get_variable("shared/embedding", shape=[8, 4],
                              partitioner=tf.compat.v1.fixed_size_partitioner(2))
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      prefix = saver.save(sess, str(tmp_path / "model.ckpt"), global_step=1)
  with pytest.raises(UserError, match=r"\.index: tensor 'shared/embedding' is a partitioned "
                                      r"variable \(2 slices\).*save it unpartitioned"):
    load_checkpoint(prefix)
