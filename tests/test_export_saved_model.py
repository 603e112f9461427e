"""`t5forge export --format saved_model`: TensorFlow's own `tf.saved_model.load` runs the
exported signatures and gives the live model's greedy text for 8 prompts at several batch
sizes through one batch-polymorphic signature, and its beam text; the warm-up file parses as TF Serving's
PredictionLog and names real signatures; bad flags and a missing TensorFlow are one line;
`import t5forge` and the CLI's main do not import TensorFlow."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import t5forge
from t5forge.cli import export as export_cli
from t5forge.data import bundled_tasks
from t5forge.data.vocab import SentencePieceVocabulary
from t5forge.errors import UserError
from t5forge.export import loader
from t5forge.export import saved_model as sm
from t5forge.export import writer
from train_helpers import ROOT, error_line

pytestmark = pytest.mark.slow  # imports TensorFlow and converts six decode loops

SPM = os.path.join(os.path.dirname(bundled_tasks.__file__), "bundled", "bible_en_es_8k.model")
TEXTS = ["In the beginning God created the heaven and the earth.", "hello world", "a",
         "And God said, Let there be light: and there was light.", "Y dijo Dios",
         "And the evening and the morning were the first day.", "translate: water", "luz"]
DECODE = 16
BEAMS = 3  # not the default 4: the flag must reach the compiled loop
METHODS = ("greedy", "sample", "beam")
INPUT_LENGTHS = (24, 64)
# 3 and 8: the batch sizes the first test compiles greedy_i24_l16 at, so running that
# signature's warm-up requests here compiles nothing more.
WARMUP_BATCHES = (3, 8)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """The tiny checkpoint test_export_jax.py uses, exported once through the CLI's main and
  loaded once with tf.saved_model.load."""
  vocab = SentencePieceVocabulary(SPM, extra_ids=100)
  model = t5forge.init("flan_t5.tiny", vocab_size=8192, vocabulary=vocab, seed=3)
  ckpt = str(tmp_path_factory.mktemp("ckpt") / "checkpoint")
  model.save(ckpt)
  out = str(tmp_path_factory.mktemp("export") / "saved")
  assert export_cli.main([
      "--checkpoint", ckpt, "--output", out, "--format", "saved_model",
      "--input_lengths", ",".join(map(str, INPUT_LENGTHS)), "--decode_lengths", str(DECODE),
      "--batch_sizes", ",".join(map(str, WARMUP_BATCHES)), "--methods", ",".join(METHODS),
      "--num_beams", str(BEAMS)]) == 0
  import tensorflow as tf
  return types.SimpleNamespace(model=model, ckpt=ckpt, out=out, tf=tf,
                               loaded=tf.saved_model.load(out))


@pytest.fixture(scope="module")
def live(exported):
  """TEXTS as model-ready ids [8, 24], the live model's greedy tokens [8, DECODE] and text."""
  model = exported.model
  ids = loader.encode_rows(TEXTS, model.vocabulary, 1, True)
  assert ids.shape[1] <= INPUT_LENGTHS[0]
  x = np.zeros((len(TEXTS), INPUT_LENGTHS[0]), np.int32)
  x[:, :ids.shape[1]] = ids
  return x, model.predict(x, DECODE)[0], model.generate(TEXTS, max_decode_length=DECODE)


def _greedy(exported, name: str, x: np.ndarray) -> np.ndarray:
  tf = exported.tf
  out = exported.loaded.signatures[name](
      inputs=tf.constant(x), max_new_tokens=tf.constant(np.full(len(x), DECODE, np.int32)))
  assert sorted(out) == ["scores", "tokens"]
  return out["tokens"].numpy()


def _text(model, row) -> str:
  return model.vocabulary.decode(loader.text_ids(row, (1,), 1))


def test_tf_load_gives_live_greedy_text_at_two_batch_sizes(exported, live):
  x, tokens, texts = live
  model = exported.model
  assert len(set(texts)) == len(TEXTS)  # the rows differ: a mix-up would show
  whole = _greedy(exported, "greedy_i24_l16", x)  # batch 8
  np.testing.assert_array_equal(whole, tokens)
  assert [_text(model, r) for r in whole] == texts
  # The same signature at batch 3 (3 + 3 + 2 rows): the batch is symbolic.
  parts = np.concatenate([_greedy(exported, "greedy_i24_l16", x[s:s + 3]) for s in (0, 3, 6)])
  np.testing.assert_array_equal(parts, tokens)
  # serving_default is greedy at the largest input length: the same ids, padded to 64.
  wide = np.zeros((len(TEXTS), 64), np.int32)
  wide[:, :x.shape[1]] = x
  np.testing.assert_array_equal(_greedy(exported, "serving_default", wide), tokens)
  # Text in, text out, tokenised beside the graph.
  runner = sm.SavedModelRunner(exported.out)
  assert runner.generate(TEXTS, DECODE) == texts
  assert runner.generate(TEXTS[:2], 5) == model.generate(TEXTS[:2], max_decode_length=5)


def test_layout_and_manifest(exported):
  out, loaded = exported.out, exported.loaded
  names = [sm.signature_name(m, i, DECODE) for m in METHODS for i in INPUT_LENGTHS]
  assert sorted(loaded.signatures) == sorted(names + ["serving_default"])
  m = sm.SavedModelRunner(out).manifest
  assert m["default_signature"] == "greedy_i64_l16" and m["num_beams"] == BEAMS
  assert [s["name"] for s in m["signatures"]] == names
  with open(os.path.join(out, "assets", "spiece.model"), "rb") as f:
    assert f.read() == exported.model.vocabulary.processor.serialized_model_proto()
  # The weights are variables, stored once: not one constant copy per signature (the
  # graph, six decode loops, is smaller than one float32 copy of the weights).
  flat = writer.flatten_params(exported.model.params)
  assert sorted(loaded.params) == sorted(flat)
  assert all(isinstance(v, exported.tf.Variable) for v in loaded.params.values())
  assert os.path.getsize(os.path.join(out, "saved_model.pb")) < 4 * m["model"]["num_parameters"]
  assert not os.path.exists(out + ".tmp-t5forge")


def _prediction_log_class():
  """tensorflow.serving.PredictionLog built in a private descriptor pool from the field
  numbers of tensorflow_serving/apis/{prediction_log,predict,model}.proto, over TF's own
  TensorProto (tensorflow_serving itself is not installed)."""
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
  from tensorflow.core.framework import tensor_pb2
  pool = descriptor_pool.DescriptorPool()
  added = set()

  def add(fd):
    if fd.name in added:
      return
    for dep in fd.dependencies:
      add(dep)
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    pool.Add(proto)
    added.add(fd.name)

  add(tensor_pb2.DESCRIPTOR)
  F = descriptor_pb2.FieldDescriptorProto
  f = descriptor_pb2.FileDescriptorProto(name="serving_test.proto", package="tensorflow.serving",
                                         dependency=[tensor_pb2.DESCRIPTOR.name], syntax="proto3")

  def field(msg, name, number, type_, type_name=None, label=F.LABEL_OPTIONAL):
    msg.field.add(name=name, number=number, type=type_, label=label,
                  **({"type_name": type_name} if type_name else {}))

  spec = f.message_type.add(name="ModelSpec")
  field(spec, "name", 1, F.TYPE_STRING)
  field(spec, "signature_name", 3, F.TYPE_STRING)
  req = f.message_type.add(name="PredictRequest")
  entry = req.nested_type.add(name="InputsEntry")
  entry.options.map_entry = True
  field(entry, "key", 1, F.TYPE_STRING)
  field(entry, "value", 2, F.TYPE_MESSAGE, ".tensorflow.TensorProto")
  field(req, "model_spec", 1, F.TYPE_MESSAGE, ".tensorflow.serving.ModelSpec")
  field(req, "inputs", 2, F.TYPE_MESSAGE, ".tensorflow.serving.PredictRequest.InputsEntry",
        F.LABEL_REPEATED)
  log = f.message_type.add(name="PredictLog")
  field(log, "request", 1, F.TYPE_MESSAGE, ".tensorflow.serving.PredictRequest")
  plog = f.message_type.add(name="PredictionLog")
  field(plog, "predict_log", 6, F.TYPE_MESSAGE, ".tensorflow.serving.PredictLog")
  pool.Add(f)
  return message_factory.GetMessageClass(
      pool.FindMessageTypeByName("tensorflow.serving.PredictionLog"))


def test_warmup_requests_parse_with_tensorflow_and_run(exported):
  tf, loaded = exported.tf, exported.loaded
  PredictionLog = _prediction_log_class()
  path = os.path.join(exported.out, "assets.extra", "tf_serving_warmup_requests")
  seen = []
  for record in tf.data.TFRecordDataset(path):
    log = PredictionLog.FromString(record.numpy())
    assert log.HasField("predict_log")
    request = log.predict_log.request
    name = request.model_spec.signature_name
    fn = loaded.signatures[name]
    assert sorted(request.inputs) == sorted(fn.structured_input_signature[1])
    args = {k: tf.constant(tf.make_ndarray(v)) for k, v in request.inputs.items()}
    b = args["inputs"].shape[0]
    if name == "greedy_i24_l16":
      # What TF Serving does with it at load (one signature: each new shape compiles).
      assert fn(**args)["tokens"].shape == (b, DECODE)
    seen.append((name, b, args["inputs"].shape[1]))
  assert sorted(seen) == sorted(
      (sm.signature_name(m, i, DECODE), b, i) for m in METHODS
      for i in INPUT_LENGTHS for b in WARMUP_BATCHES)


def test_sample_signature_matches_live_sampling(exported, live):
  tf = exported.tf
  x, tokens, _ = live
  x = x[:4]

  def sample(temperature, seed):
    out = exported.loaded.signatures["sample_i24_l16"](
        inputs=tf.constant(x), max_new_tokens=tf.constant(np.full(4, DECODE, np.int32)),
        temperature=tf.constant(np.asarray(temperature, np.float32)),
        topp=tf.constant(np.full(4, 0.9, np.float32)), seed=tf.constant(np.uint32(seed)))
    return out["tokens"].numpy()

  drawn, _ = exported.model.predict(x, DECODE, method="sample", temperature=0.8, topp=0.9,
                                    seed=5)
  np.testing.assert_array_equal(sample(np.full(4, 0.8), 5), drawn)
  mixed = sample([0, 1, 0, 1], 5)
  np.testing.assert_array_equal(mixed[[0, 2]], tokens[[0, 2]])
  assert not np.array_equal(mixed[[1, 3]], tokens[[1, 3]])


def test_beam_signature_matches_live_beam(exported, live):
  """The beam signature (3 beams, the CLI's --num_beams) at batch 8 gives the live model's
  beam tokens, scores and text; most rows differ from greedy."""
  tf, model = exported.tf, exported.model
  x, greedy, _ = live
  out = exported.loaded.signatures["beam_i24_l16"](
      inputs=tf.constant(x), max_new_tokens=tf.constant(np.full(len(x), DECODE, np.int32)),
      alpha=tf.constant(np.float32(0.6)))
  tokens, scores = model.predict(x, DECODE, method="beam", num_decodes=BEAMS, alpha=0.6)
  np.testing.assert_array_equal(out["tokens"].numpy(), tokens)
  np.testing.assert_allclose(out["scores"].numpy(), scores, rtol=1e-5, atol=1e-5)
  assert sum(not np.array_equal(a, b) for a, b in zip(tokens, greedy)) >= 4
  texts = model.generate(TEXTS, max_decode_length=DECODE, method="beam", num_decodes=BEAMS)
  assert sm.SavedModelRunner(exported.out).generate(TEXTS, DECODE, method="beam") == texts


def _main_error(*argv) -> str:
  with pytest.raises(UserError) as e:
    export_cli.main(list(argv))
  assert "\n" not in str(e.value)
  return str(e.value)


def test_bad_flags_and_missing_tensorflow_are_one_line(exported, tmp_path, monkeypatch):
  ckpt = exported.ckpt
  out = str(tmp_path / "x")
  base = ["--checkpoint", ckpt, "--output", out]
  assert _main_error(*base, "--format", "saved_model", "--methods", "greedy,topk") == (
      "--methods: unknown method 'topk'; choose from greedy, sample, beam")
  assert _main_error(*base, "--format", "saved_model", "--num_beams", "3") == (
      "--num_beams 3 applies to beam search only; add beam to --methods or drop --num_beams")
  assert _main_error(*base, "--format", "jax", "--methods", "greedy,beam",
                     "--num_beams", "1") == (
      "--num_beams 1: beam search needs >= 2 beams (one beam is greedy: export --methods "
      "greedy)")
  assert _main_error(*base, "--format", "jax", "--methods", "beam", "--num_beams", "x") == (
      "--num_beams 'x': give an integer >= 2, e.g. --num_beams 4")
  assert _main_error(*base, "--format", "hf", "--num_beams", "4") == (
      "--num_beams apply to --format jax and saved_model only, not hf")
  assert _main_error(*base, "--format", "saved_model", "--input_lengths", "0").startswith(
      "--input_lengths '0': give integers >= 1")
  assert _main_error(*base, "--format", "tf").startswith(
      "--format 'tf': choose jax, saved_model or hf")
  assert _main_error(*base, "--format", "hf", "--decode_lengths", "4") == (
      "--decode_lengths apply to --format jax and saved_model only, not hf")
  assert _main_error(*base, "--format", "saved_model", "--batch_sizes", "1,2",
                     "--input_lengths", ",".join(map(str, range(2, 42))),
                     "--decode_lengths", ",".join(map(str, range(1, 26)))) == (
      "2000 warm-up requests (1000 signatures x 2 --batch_sizes); TF Serving reads at most "
      "1000: give fewer lengths or batch sizes")
  assert _main_error("--checkpoint", ckpt, "--output", exported.out,
                     "--format", "saved_model").endswith(
      "exists and is not empty; choose a new output directory")
  with pytest.raises(UserError, match=r"no greedy signature fits input length 70 and decode "
                     r"length 16; exported \(input, decode\) lengths: \[\(24, 16\), \(64, 16\)\]"):
    sm.SavedModelRunner(exported.out).run(np.ones((1, 70), np.int32), DECODE)
  runner = sm.SavedModelRunner(exported.out)
  with pytest.raises(UserError) as e:
    runner.generate(["a"], 4, method="contrastive")
  assert str(e.value) == ("method 'contrastive' was not exported (this SavedModel has beam, "
                          "greedy, sample); choose from greedy, sample, beam")
  with pytest.raises(UserError, match=r"ids outside \[0, 8192\): min 1, max 9000"):
    runner.run(np.array([[9000, 1]]), 4)
  with pytest.raises(UserError, match="max_new_tokens must be >= 1, got 0"):
    runner.run(np.array([[5, 1]]), 0)
  # Without TensorFlow (None in sys.modules makes `import tensorflow` raise ImportError).
  monkeypatch.setitem(sys.modules, "tensorflow", None)
  assert _main_error(*base, "--format", "saved_model") == (
      "--format saved_model needs TensorFlow: pip install 't5forge[tf]' (or "
      "tensorflow==2.21.0), or export --format jax")
  with pytest.raises(UserError, match="needs TensorFlow"):
    sm.SavedModelRunner(exported.out)
  assert not os.path.exists(out) and not os.path.exists(out + ".tmp-t5forge")


def test_failed_save_leaves_nothing(exported, tmp_path, monkeypatch):
  out = str(tmp_path / "half")

  def fail(*args, **kwargs):
    raise RuntimeError("disk full")

  monkeypatch.setattr(exported.tf.saved_model, "save", fail)
  with pytest.raises(RuntimeError, match="disk full"):
    sm.export_saved_model(exported.model.model, exported.model.params,
                          exported.model.vocabulary, out, input_lengths=[8],
                          decode_lengths=[4], warmup_batch_sizes=[1], log=lambda _: None)
  assert os.listdir(tmp_path) == []


def test_other_platform_is_one_line(exported, tmp_path):
  """A SavedModel lowered for TPU only (jax2tf lowers it on this CPU machine) refuses to run
  here in one line, not TF's multi-line graph error."""
  out = str(tmp_path / "tpu")
  sm.export_saved_model(exported.model.model, exported.model.params,
                        exported.model.vocabulary, out, input_lengths=[8], decode_lengths=[4],
                        warmup_batch_sizes=[1], platforms=("tpu",), log=lambda _: None)
  with pytest.raises(UserError) as e:
    sm.SavedModelRunner(out).generate(["a"], 4)
  assert str(e.value) == (f"{out}: exported for tpu, not this machine's; re-export with "
                          "--platforms naming it")


def test_cli_without_tensorflow_says_so_in_one_line(exported, tmp_path):
  """The command itself (`t5forge.cli.main`, as `python -m t5forge` runs it) in a process
  where TensorFlow cannot be imported: exit 2, one `t5forge: error:` line, nothing written."""
  out = str(tmp_path / "x")
  code = ("import sys\nsys.modules['tensorflow'] = None\nfrom t5forge.cli.main import main\n"
          f"main(['export', '--checkpoint', {exported.ckpt!r}, '--output', {out!r}, "
          "'--format', 'saved_model'])")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     timeout=120)
  assert error_line(r) == ("t5forge: error: --format saved_model needs TensorFlow: pip "
                           "install 't5forge[tf]' (or tensorflow==2.21.0), or export "
                           "--format jax")
  assert not os.path.exists(out)


def test_t5forge_and_its_cli_do_not_import_tensorflow():
  code = ("import sys, t5forge, t5forge.cli.main, t5forge.cli.export, "
          "t5forge.export.saved_model\n"
          "try:\n  t5forge.cli.main.main(['export', '--help'])\nexcept SystemExit:\n  pass\n"
          "print('TF' if 'tensorflow' in sys.modules else 'no TF')")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "--format jax and saved_model" in r.stdout
  assert r.stdout.strip().splitlines()[-1] == "no TF"
