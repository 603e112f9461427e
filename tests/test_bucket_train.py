"""Training runs with MODEL_DIR on a bucket (gs:// and s3://, real emulators on 127.0.0.1).

`t5forge train --gin.MODEL_DIR="s3://runs/a"` used to train into a local folder
`./s3:/runs/a` and exit 0. A bucket MODEL_DIR now stays a URL: its bucket is checked,
config.gin and model-info.txt are single objects, the files a run appends to
(metrics.jsonl, TensorBoard events, batch fingerprints) are written in a local working copy
and uploaded at each checkpoint and at the end, and the lock is an object.
"""
import json
import os

import pytest

from t5forge import storage
from t5forge.errors import UserError
from t5forge.train import loop
from t5forge.train import metrics as metrics_lib


def _lines(url):
  return [json.loads(line) for line in storage.read_text(url).splitlines() if line.strip()]


# ------------------------------------------------------------------ in-process, fast


def test_a_bucket_model_dir_stays_a_url(bucket_env, tmp_path, monkeypatch):
  emu, bucket = bucket_env
  monkeypatch.chdir(tmp_path)
  assert loop._prepare_model_dir(bucket + "//runs/a/") == storage.join(bucket, "runs", "a")
  assert os.listdir(tmp_path) == []  # no local ./gs:/ or ./s3:/ folder
  assert storage.walk_files(bucket) == {}  # the write probe was deleted
  with pytest.raises(UserError) as e:
    loop._prepare_model_dir(f"{emu.scheme}://no-such-bucket-here/run")
  assert str(e.value) == (f"{emu.scheme}://no-such-bucket-here: the bucket does not exist; "
                          f"create it or fix the name in {emu.scheme}://no-such-bucket-here/run")


def test_appended_files_reach_the_bucket_at_sync_and_continue_on_resume(bucket_env, cache):
  emu, bucket = bucket_env
  url = storage.join(bucket, "run")
  mirror = storage.AppendMirror(url, name="process-0")
  assert mirror.root.startswith(str(cache))  # the working copy honours T5FORGE_CACHE
  writer = metrics_lib.MetricWriter(url, mirror=mirror)
  writer.write_scalars(1, {"loss": 2.0}, subdir="train")
  assert not storage.exists(storage.join(url, "metrics.jsonl"))  # nothing sent before a sync
  mirror.sync()
  assert _lines(storage.join(url, "metrics.jsonl")) == [{"step": 1, "split": "train",
                                                        "loss": 2.0}]
  events = [n for n in storage.walk_files(url) if n.startswith("train/events.out.tfevents.")]
  assert len(events) == 1
  version = storage.info(storage.join(url, "metrics.jsonl"))["version"]
  mirror.sync()  # unchanged files are not sent again
  assert storage.info(storage.join(url, "metrics.jsonl"))["version"] == version
  writer.write_scalars(2, {"loss": float("nan")}, subdir="train")
  writer.close()
  mirror.close()
  assert not os.path.exists(mirror.root)
  assert [r["step"] for r in _lines(storage.join(url, "metrics.jsonl"))] == [1, 2]
  # A resumed run continues the bucket's file; a killed run's unsent lines are dropped.
  with open(os.path.join(storage.AppendMirror(url, name="process-0").root, "stale"), "w") as f:
    f.write("left by a killed run")
  again = storage.AppendMirror(url, name="process-0")
  assert os.listdir(again.root) == []
  writer = metrics_lib.MetricWriter(url, mirror=again)
  writer.write_scalars(3, {"loss": 1.0}, subdir="training_eval/task")
  writer.close()
  again.close()
  rows = _lines(storage.join(url, "metrics.jsonl"))
  assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "train"),
                                                     (3, "training_eval/task")]
  assert rows[1]["loss"] == "nan"
  assert any(n.startswith("training_eval/task/events.out.tfevents.")
             for n in storage.walk_files(url))


def test_a_local_model_dir_is_written_in_place(tmp_path):
  mirror = storage.AppendMirror(str(tmp_path))
  assert mirror.path("metrics.jsonl", resume=True) == os.path.join(str(tmp_path), "metrics.jsonl")
  writer = metrics_lib.MetricWriter(str(tmp_path), mirror=mirror)
  writer.write_scalars(1, {"loss": 2.0})
  writer.close()
  mirror.close()
  assert os.path.isfile(tmp_path / "metrics.jsonl") and os.path.isdir(tmp_path / "train")
