"""`eval`, `infer`, `convert` and `export` write to `gs://` / `s3://` (real emulators on
127.0.0.1), `serve` runs an export read from a bucket, and each bad bucket input of the
command line (no bucket, no or refused credentials, no client package, an unknown scheme)
is one line naming what to fix.

Above `t5forge.storage` the two schemes take the same code, so the end-to-end commands run
on GCS, and `infer` + `eval` of a bucket MODEL_DIR on both (S3 reads a checkpoint through a
local copy, GCS in place); the storage layer itself is tested on both (test_storage.py,
test_bucket_checkpoints.py). The commands run in this process (`train_helpers.cli`) unless
the process is the point (a server; the environment at start-up)."""
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from t5forge import storage
from t5forge import testing as sh
from t5forge.testing import Emulator
from train_helpers import ROOT, cli, error_line

pytestmark = pytest.mark.slow  # subprocess runs and compiles: make test, not test-fast

TASKS_PY = '''
import functools
from t5forge import metrics
from t5forge.data import preprocessors as pre, sources
from t5forge.data.bundled_tasks import OUTPUT_FEATURES
from t5forge.data.tasks import TaskRegistry

TaskRegistry.add(
    "bucket_tiny_en_es",
    source=sources.TsvDataSource({"validation": %r}, field_names=("en", "es")),
    preprocessors=[functools.partial(pre.translate, source_language="en",
                                     target_language="es"), pre.tokenize,
                   pre.append_eos_after_trim],
    output_features=OUTPUT_FEATURES, metric_fns=[metrics.bleu])
'''
VERSES = [("Jesus wept.", "Jesús lloró."), ("God is love.", "Dios es amor."),
          ("Love one another.", "Amaos unos a otros.")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A tiny random checkpoint with the bundled vocabulary, and a tasks module beside it
  (importable through PYTHONPATH) with a three-example validation split."""
  d = tmp_path_factory.mktemp("bucket_outputs")
  (d / "verses.tsv").write_text("".join(f"{en}\t{es}\n" for en, es in VERSES))
  (d / "user").mkdir()
  (d / "user" / "bucket_tasks.py").write_text(TASKS_PY % str(d / "verses.tsv"))
  (d / "pairs.tsv").write_text("".join(f"translate English to Spanish: {en}\t{es}\n"
                                       for en, es in VERSES))
  return sh.tiny_checkpoint(str(d / "tiny" / "checkpoint_3"))  # a MODEL_DIR's step 3


def _cli(*args, env=None, timeout=600):
  """A subprocess `t5forge *args` with the environment `env` (whole)."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
  return subprocess.run([sys.executable, "-m", "t5forge", *args], capture_output=True,
                        text=True, cwd=ROOT, timeout=timeout, env=env)


GS_ONLY = pytest.mark.parametrize("bucket_env", ["gs"], indirect=True)


def _ok(r):
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
  return r.stdout


def _data_dir(ckpt):
  return os.path.dirname(os.path.dirname(ckpt))  # beside the MODEL_DIR


def _user_dir(ckpt):
  return os.path.join(_data_dir(ckpt), "user")


def _lines(url):
  return [json.loads(line) for line in storage.read_text(url).splitlines() if line.strip()]


@GS_ONLY
def test_infer_writes_merged_jsonl_to_the_bucket_and_refuses_other_work(bucket_env, ckpt):
  emu, bucket = bucket_env
  src = os.path.join(_data_dir(ckpt), "pairs.tsv")
  out = f"{bucket}/runs/infer/"  # a trailing slash is the same prefix
  base = ("infer", "--checkpoint", ckpt, "--input", src, "--output_dir", out,
          "--chunk_size", "1", "--batch_size", "1", "--max_decode_length", "4")
  stdout = _ok(cli(*base))
  assert "3 of 3 chunks computed now" in stdout, stdout
  path = stdout.split("lines to ")[1].split()[0]
  assert path.startswith(f"{bucket}/runs/infer/pairs-"), path
  name = storage.basename(path)
  # Chunks and their COMPLETED markers were merged and deleted: the merged file and its
  # fingerprint are all that is left.
  assert storage.listdir(f"{bucket}/runs/infer") == [name, name + ".fingerprint.json"]
  rows = _lines(path)
  assert [r["inputs"]["inputs_pretokenized"] for r in rows] == [
      f"translate English to Spanish: {en}" for en, _ in VERSES]
  assert all(isinstance(r["prediction"], str) for r in rows)
  # The same work again: the merged file is kept; other work is refused, naming the URL.
  assert "0 of 3 chunks computed now" in _ok(cli(*base))
  msg = error_line(cli(*base, "--mode", "score"))
  assert f"{path} was made with --mode predict, now score" in msg and "--overwrite" in msg
  _ok(cli(*base, "--mode", "score", "--overwrite"))
  assert all(r["score"] < 0 for r in _lines(path))
  assert storage.listdir(f"{bucket}/runs/infer") == [name, name + ".fingerprint.json"]


def _scalars(data: bytes) -> dict[str, list[float]]:
  """{tag: values} of a TensorBoard event file (TFRecords: length, crc, event, crc)."""
  from tensorboardX.proto import event_pb2
  out, at = {}, 0
  while at < len(data):
    n = int.from_bytes(data[at:at + 8], "little")
    event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
    for v in event.summary.value:
      out.setdefault(v.tag, []).append(v.simple_value)
    at += 12 + n + 4
  return out


def test_infer_survives_the_bucket_going_away_and_resumes(tmp_path, ckpt):
  """The GCS emulator killed mid-run: infer stops with one line naming an object, after
  a couple of tries; once it is back, a rerun computes only the chunks not committed.
  (GCS only: moto keeps no data across a restart, and a paused one is a minute-long
  timeout.)"""
  with sh.emulator("gs", str(tmp_path / "emu")) as emu:
    env = dict(os.environ, **emu.env(), T5FORGE_STORAGE_RETRIES="2")
    for k, v in emu.env().items():
      os.environ[k] = v
    storage.reset_clients()
    try:
      bucket = emu.make_bucket("outage")
      lines = [f"translate English to Spanish: verse number {i}." for i in range(60)]
      (tmp_path / "many.txt").write_text("\n".join(lines) + "\n")
      out = f"{bucket}/infer"
      cmd = [sys.executable, "-m", "t5forge", "infer", "--checkpoint", ckpt, "--input",
             str(tmp_path / "many.txt"), "--output_dir", out, "--chunk_size", "5",
             "--batch_size", "5", "--max_decode_length", "24"]
      proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
      try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
          if sum(n.endswith(".COMPLETED") for n in storage.listdir(out)) >= 2:
            emu.stop()
            break
          time.sleep(0.05)
        _, stderr = proc.communicate(timeout=300)
      finally:
        if proc.poll() is None:
          proc.kill()
      errors = [line for line in stderr.splitlines() if line.startswith("t5forge: error:")]
      # 75 (EX_TEMPFAIL): the outage may pass; the same command resumes (below)
      assert proc.returncode == 75 and len(errors) == 1, stderr[-3000:]
      assert f"{out}/many-3.jsonl-000" in errors[0] and "failed after 2 tries" in errors[0], (
          errors)  # names the chunk (or its marker) it was writing or reading
      assert "STORAGE_EMULATOR_HOST" in errors[0], errors
      emu.start()  # the same port, its data kept
      storage.reset_clients()
      names = storage.listdir(out)
      markers = [n for n in names if n.endswith(".COMPLETED")]
      done = len(markers)
      assert 2 <= done < 12 and "many-3.jsonl" not in names, names  # nothing merged
      assert all(n[:-len(".COMPLETED")] in names for n in markers), names  # chunks whole
      r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
      assert r.returncode == 0, r.stderr[-3000:]
      assert f"{12 - done} of 12 chunks computed now" in r.stdout, r.stdout
      assert [x["inputs"]["inputs_pretokenized"] for x in _lines(f"{out}/many-3.jsonl")] == lines
    finally:
      for k in emu.env():
        os.environ.pop(k, None)
      storage.reset_clients()


@GS_ONLY
def test_eval_writes_metrics_predictions_and_events_to_the_bucket(bucket_env, ckpt):
  emu, bucket = bucket_env
  out = f"{bucket}/runs/eval"
  args = ("eval", "--checkpoint", ckpt, "--task", "bucket_tiny_en_es", "--module",
          "bucket_tasks", "--batch_size", "3", "--feature_lengths", "inputs=32,targets=8",
          "--output_dir", out)
  env = {"PYTHONPATH": _user_dir(ckpt)}
  stdout = _ok(cli(*args, env=env))
  assert "bucket_tiny_en_es/bleu" in stdout and "(3 examples)" in stdout, stdout
  metrics = _lines(f"{out}/bucket_tiny_en_es-metrics.jsonl")
  assert len(metrics) == 1 and "bleu" in metrics[0] and metrics[0]["num_examples"] == 3
  step = metrics[0]["step"]
  rows = _lines(f"{out}/bucket_tiny_en_es-{step}.jsonl")
  assert [r["target"] for r in rows] == [es for _, es in VERSES]
  events = storage.listdir(f"{out}/bucket_tiny_en_es")
  assert len(events) == 1 and events[0].startswith("events.out.tfevents."), events
  assert _scalars(storage.read_bytes(f"{out}/bucket_tiny_en_es/{events[0]}"))[
      "bucket_tiny_en_es/num_examples"] == [3.0]
  # The record read back from the bucket covers this evaluation: skipped; --force
  # evaluates again and the metrics object gains a line.
  assert "already evaluated" in _ok(cli(*args, env=env))
  _ok(cli(*args, "--force", env=env))
  assert [m["step"] for m in _lines(f"{out}/bucket_tiny_en_es-metrics.jsonl")] == [step, step]


def _same_tree(local_dir: str, url: str) -> None:
  """The bucket prefix holds exactly the local directory's files, byte for byte."""
  local = storage.walk_files(local_dir)
  remote = storage.walk_files(url)
  assert sorted(remote) == sorted(local), (sorted(remote), sorted(local))
  for name in local:
    with open(os.path.join(local_dir, name), "rb") as f:
      assert storage.read_bytes(f"{url}/{name}") == f.read(), name


@GS_ONLY
def test_convert_writes_hf_and_t5forge_directories_to_the_bucket(bucket_env, ckpt, tmp_path):
  import jax

  import t5forge
  emu, bucket = bucket_env
  for to in ("hf", "t5forge"):
    url = f"{bucket}/converted/{to}"
    assert f"wrote {to} checkpoint to {url}" in _ok(cli("convert", "--input", ckpt,
                                                         "--output", url, "--to", to))
    local = str(tmp_path / to)
    _ok(cli("convert", "--input", ckpt, "--output", local, "--to", to))
    if to == "hf":
      _same_tree(local, url)
    else:  # Orbax names its data files at random (params/**/d/<hash>)
      def named(files):
        return sorted(n for n in files if "/d/" not in n)
      assert named(storage.walk_files(url)) == named(storage.walk_files(local))
      assert "t5forge_manifest.json" in storage.walk_files(url)
    want = t5forge.load(ckpt).params
    got = t5forge.load(storage.local_copy(url)).params
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # An output prefix that holds files is refused before anything is read or written.
  msg = error_line(cli("convert", "--input", ckpt, "--output", f"{bucket}/converted/hf",
                        "--to", "hf"))
  assert f"{bucket}/converted/hf: exists and is not empty" in msg, msg


@GS_ONLY
def test_export_to_the_bucket_is_served_from_it(bucket_env, ckpt):
  emu, bucket = bucket_env
  url = f"{bucket}/exported/tiny"
  _ok(cli("export", "--checkpoint", ckpt, "--output", url, "--format", "jax",
           "--batch_sizes", "1,2", "--input_lengths", "32", "--decode_lengths", "4"))
  manifest = json.loads(storage.read_text(f"{url}/manifest.json"))
  names = set(storage.walk_files(url))
  assert set(manifest["sha256"]) | {"manifest.json"} == names, names
  for name, digest in manifest["sha256"].items():
    assert hashlib.sha256(storage.read_bytes(f"{url}/{name}")).hexdigest() == digest, name
  srv = sh.Server(url, "--max_batch_size", "2", "--batch_buckets", "1,2")
  try:
    assert "model 'tiny'" in srv.ready_line and "2 shapes compiled" in srv.ready_line, (
        srv.ready_line)
    status, _, body = sh.request(srv.url, "/v1/completions", {
        "prompt": ["translate English to Spanish: God is love.", "Jesus wept."],
        "max_tokens": 4, "temperature": 0})
    assert status == 200 and len(body["choices"]) == 2, body
  finally:
    assert srv.stop() == 0, srv.output()[-3000:]
  from t5forge.export import loader
  m = loader.ExportedModel(storage.local_copy(url))
  texts = m.generate(["translate English to Spanish: God is love.", "Jesus wept."],
                     max_new_tokens=4)
  assert [c["text"] for c in body["choices"]] == texts


def test_infer_and_eval_read_a_bucket_model_dir_and_write_beside_it(bucket_env, ckpt):
  """A MODEL_DIR and an input file in the bucket: `infer` predicts what it does from the
  local copies, and `eval` writes MODEL_DIR/inference_eval in the bucket (not beside a
  local copy)."""
  emu, bucket = bucket_env
  run = f"{bucket}/run"
  storage.copy_tree(os.path.dirname(ckpt), run)
  src = os.path.join(_data_dir(ckpt), "pairs.tsv")
  storage.upload(src, f"{bucket}/data/pairs.tsv")
  preds = {}
  for where, checkpoint, inputs in (("local", ckpt, src),
                                    ("bucket", run, f"{bucket}/data/pairs.tsv")):
    out = f"{bucket}/infer-{where}"
    _ok(cli("infer", "--checkpoint", checkpoint, "--input", inputs, "--output_dir", out,
             "--max_decode_length", "4"))
    rows = _lines(f"{out}/pairs-3.jsonl")
    preds[where] = [r["prediction_tokens"] for r in rows]
  assert preds["bucket"] == preds["local"]
  fingerprint = json.loads(storage.read_text(f"{bucket}/infer-bucket/pairs-3.jsonl"
                                             ".fingerprint.json"))
  # the URL, also for s3:// (read through a local copy)
  assert fingerprint["checkpoint"]["path"] == f"{run}/checkpoint_3", fingerprint
  stdout = _ok(cli("eval", "--checkpoint", run, "--task", "bucket_tiny_en_es", "--module",
                   "bucket_tasks", "--batch_size", "3", env={"PYTHONPATH": _user_dir(ckpt)}))
  assert "step 3: bucket_tiny_en_es/bleu" in stdout, stdout
  names = storage.listdir(f"{run}/inference_eval")
  assert names == ["bucket_tiny_en_es", "bucket_tiny_en_es-3.jsonl",
                   "bucket_tiny_en_es-metrics.jsonl"], names
  record = _lines(f"{run}/inference_eval/bucket_tiny_en_es-metrics.jsonl")[0]
  assert record["coverage"]["checkpoint"]["path"] == f"{run}/checkpoint_3"


@GS_ONLY
def test_serve_and_export_read_a_bucket_checkpoint(bucket_env, ckpt, tmp_path):
  """`serve --checkpoint` a bucket MODEL_DIR answers as `infer` of it predicts; `export
  --checkpoint` reads one from the bucket."""
  emu, bucket = bucket_env
  run = f"{bucket}/run"
  storage.copy_tree(os.path.dirname(ckpt), run)
  prompts = ["translate English to Spanish: God is love.", "Jesus wept."]
  (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
  _ok(cli("infer", "--checkpoint", run, "--input", str(tmp_path / "prompts.txt"),
           "--output_dir", str(tmp_path / "out"), "--max_decode_length", "4"))
  want = [json.loads(line)["prediction"] for line in open(tmp_path / "out" / "prompts-3.jsonl")]
  srv = sh.Server(run, "--max_batch_size", "2", "--batch_buckets", "1,2", "--length_buckets",
                  "32", "--decode_buckets", "4", "--warmup", "greedy")
  try:
    assert "model 'run'" in srv.ready_line, srv.ready_line
    status, _, body = sh.request(srv.url, "/v1/completions", {
        "prompt": prompts, "max_tokens": 4, "temperature": 0})
    assert status == 200 and [c["text"] for c in body["choices"]] == want, (body, want)
  finally:
    assert srv.stop() == 0, srv.output()[-3000:]
  out = str(tmp_path / "exported")
  _ok(cli("export", "--checkpoint", run, "--output", out, "--format", "jax",
           "--batch_sizes", "2", "--input_lengths", "32", "--decode_lengths", "4"))
  manifest = json.load(open(os.path.join(out, "manifest.json")))
  assert manifest["source"]["step"] == 3, manifest["source"]
  assert manifest["source"]["path"] == f"{run}/checkpoint_3", manifest["source"]


@GS_ONLY
def test_adapter_converted_into_the_bucket_is_served_from_it(bucket_env, ckpt, tmp_path):
  """`convert --adapter ... --to peft --output <bucket>` uploads peft's directory (its
  adapter_config.json last); `serve --adapter name=<bucket URL>` reads it from there."""
  import dataclasses

  import jax

  import t5forge
  from t5forge import models
  from t5forge.nn import adapters, lora
  from t5forge.serve import adapters as serve_adapters
  emu, bucket = bucket_env
  base = t5forge.load(ckpt)
  config = dataclasses.replace(base.config, lora=lora.LoraConfig(rank=4, alpha=8.0,
                                                                 targets="qv"))
  adapter, _ = adapters.split(models.model_for(config).init_params(jax.random.key(1)))
  ours = str(tmp_path / "ours")
  adapters.save(ours, adapter, model_config=config.to_dict(), record={
      "base": ckpt, "fingerprint": adapters.fingerprint(base.params), "base_dtype": "float32"})
  url = f"{bucket}/adapters/qv"
  stdout = _ok(cli("convert", "--adapter", ours, "--base", ckpt, "--to", "peft",
                    "--output", url))
  assert url in stdout and "t5forge-upload-" not in stdout, stdout
  assert sorted(storage.walk_files(url)) == ["adapter_config.json", "adapter_model.safetensors"]
  (spec,) = serve_adapters.parse([f"qv={url}"], base_name="tiny")
  assert spec.path == url and os.path.isdir(spec.local)
  got = serve_adapters._read(spec, base.config, adapters.fingerprint(base.params), "tiny")[1]
  for a, b in zip(jax.tree.leaves(adapters.split(adapters.join(adapter, base.params))[0]),
                  jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(t5forge.UserError, match=r"/adapters/none is not a directory"):
    serve_adapters.parse([f"qv={bucket}/adapters/none"], base_name="tiny")


# --------------------------------------------------------------------------- bad input

def _without_clouds(tmp_path) -> dict:
  """This environment with no emulator, credentials or cloud configuration at all."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("AWS_", "GOOGLE_", "GCLOUD", "CLOUDSDK_", "STORAGE_EMULATOR",
                              "TENSORSTORE_GCS", "GCE_"))}
  home = tmp_path / "home"
  home.mkdir(exist_ok=True)
  env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
             # google-auth would otherwise wait on the GCE metadata server
             GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9",
             NO_GCE_CHECK="true",
             AWS_SHARED_CREDENTIALS_FILE=str(home / "no-credentials"),
             AWS_CONFIG_FILE=str(home / "no-config"), AWS_EC2_METADATA_DISABLED="true")
  return env


def _convert_to(url, env, tmp_path):
  return error_line(_cli("convert", "--input", str(tmp_path), "--output", url, "--to", "hf",
                         env=env, timeout=120))


def test_missing_bucket_is_one_line_for_every_command(bucket_env, ckpt, tmp_path):
  emu, bucket = bucket_env
  missing = f"{emu.scheme}://no-such-bucket-t5forge"
  want = f"{missing}: the bucket does not exist; create it or fix the name in {missing}/x"
  src = os.path.join(_data_dir(ckpt), "pairs.tsv")
  for args in (("convert", "--input", ckpt, "--output", f"{missing}/x", "--to", "hf"),
               ("export", "--checkpoint", ckpt, "--output", f"{missing}/x", "--format", "jax"),
               ("infer", "--checkpoint", ckpt, "--input", src, "--output_dir", f"{missing}/x"),
               ("eval", "--checkpoint", ckpt, "--task", "bucket_tiny_en_es", "--output_dir",
                f"{missing}/x"),
               ("serve", "--checkpoint", f"{missing}/x", "--port", "0")):
    msg = error_line(cli(*args))
    assert want in msg, (args[0], msg)


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_missing_credentials_name_the_variable(scheme, tmp_path):
  msg = _convert_to(f"{scheme}://some-bucket/out", _without_clouds(tmp_path), tmp_path)
  if scheme == "gs":
    assert "no Google Cloud credentials" in msg and "GOOGLE_APPLICATION_CREDENTIALS" in msg
  else:
    assert "no AWS credentials" in msg and "AWS_ACCESS_KEY_ID" in msg and "AWS_PROFILE" in msg


def test_refused_credentials_name_the_variable(tmp_path):
  key = tmp_path / "key.json"
  key.write_text("{not a key")
  env = dict(_without_clouds(tmp_path), GOOGLE_APPLICATION_CREDENTIALS=str(key))
  msg = _convert_to("gs://some-bucket/out", env, tmp_path)
  assert f"GOOGLE_APPLICATION_CREDENTIALS={key} was refused" in msg and "not a valid json" in msg
  # An S3 service that checks keys (moto with authentication on) refuses unknown ones.
  os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # the emulator process inherits it
  try:
    emu = Emulator("s3", str(tmp_path / "moto"))
    emu.start()
  finally:
    del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
  try:
    msg = _convert_to("s3://some-bucket/out", dict(_without_clouds(tmp_path), **emu.env()),
                      tmp_path)
  finally:
    emu.stop()
  assert "s3://some-bucket/out: list refused (The AWS Access Key Id" in msg, msg
  assert "check the credentials in AWS_PROFILE or AWS_ACCESS_KEY_ID" in msg, msg


@pytest.mark.parametrize("scheme,package,extra", [("gs", "gcsfs", "gcs"), ("s3", "s3fs", "s3")])
def test_missing_client_package_names_the_extra(scheme, package, extra, tmp_path):
  hide = tmp_path / "hide"
  hide.mkdir()
  (hide / f"{package}.py").write_text(f"raise ImportError('No module named {package}')\n")
  env = dict(os.environ, PYTHONPATH=str(hide))
  msg = _convert_to(f"{scheme}://some-bucket/out", env, tmp_path)
  assert f"{scheme}:// paths need the {package} package" in msg, msg
  assert f"pip install 't5forge[{extra}]'" in msg, msg


def test_unknown_scheme_is_named(ckpt, tmp_path):
  src = os.path.join(_data_dir(ckpt), "pairs.tsv")
  for args in (("convert", "--input", ckpt, "--output", "hdfs://x/y", "--to", "hf"),
               ("export", "--checkpoint", ckpt, "--output", "hdfs://x/y", "--format", "jax"),
               ("infer", "--checkpoint", ckpt, "--input", src, "--output_dir", "hdfs://x/y"),
               ("infer", "--checkpoint", ckpt, "--input", "hdfs://x/y.txt", "--output_dir",
                str(tmp_path / "o")),
               ("eval", "--checkpoint", "hdfs://x/y", "--task", "bucket_tiny_en_es"),
               ("serve", "--checkpoint", "hdfs://x/y", "--port", "0")):
    msg = error_line(cli(*args))
    assert "unknown storage scheme 'hdfs://'" in msg and "hdfs://x/y" in msg, (args[0], msg)
  assert not os.path.exists(os.path.join(ROOT, "hdfs:"))  # no local folder made of it


def test_status_codes_are_not_read_out_of_urls(monkeypatch):
  """gcsfs says a missing object with its URL; an emulator port or an object name with 403
  or 503 in it is not a refusal or an outage (a missing fingerprint read as 'refused'):
  statuses are read from the error's fields (`storage.status_of`), never its text."""
  monkeypatch.setenv("T5FORGE_STORAGE_RETRIES", "3")
  calls = []

  def missing():
    calls.append(1)
    raise FileNotFoundError("http://127.0.0.1:40373/download/storage/v1/b/x/o/step_4030.json")

  with pytest.raises(FileNotFoundError):
    storage.call("gs://x/step_4030.json", "read", missing)

  def bad():
    calls.append(1)
    raise ValueError("http://127.0.0.1:50312/b/x/o/run-503: 400 bad request")

  with pytest.raises(ValueError):
    storage.call("gs://x/run-503", "read", bad)
  assert len(calls) == 2  # neither was retried

  def refused():  # a 403 as the clients raise it: with its status (gcsfs's HttpError)
    from gcsfs.retry import HttpError
    raise HttpError({"code": 403, "message": "Forbidden: http://127.0.0.1:4000/b/x"})

  with pytest.raises(storage.StorageError, match=r"gs://x/y: read refused"):
    storage.call("gs://x/y", "read", refused)
