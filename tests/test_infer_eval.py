"""`t5forge infer` and `t5forge eval` end to end: T5X's JSONL, resuming after a kill,
skipping evaluated checkpoints, the shortened demo, and bad input."""
import json
import signal
import subprocess
import sys
import time

import pytest

from train_helpers import ROOT, cli, error_line, train_in_process, write_gin

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast


def _cli(*args):
  return cli(*args)  # in this process; the killed run below is a subprocess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A tiny model trained 4 steps, with checkpoints at steps 2 and 4."""
  d = tmp_path_factory.mktemp("infer")
  gin = write_gin(d / "run.gin", steps=4, period=2)
  r = train_in_process(gin, d / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  return d / "model"


def test_infer_file_modes_write_t5x_jsonl(model_dir, tmp_path):
  src = tmp_path / "pairs.tsv"
  src.write_text("translate English to Spanish: Jesus wept.\tJesús lloró.\n"
                 "translate English to Spanish: God is love.\tDios es amor.\n")
  out = tmp_path / "out"
  for mode in ("predict", "predict_with_aux", "score"):
    r = _cli("infer", "--checkpoint", str(model_dir), "--input", str(src), "--mode", mode,
             "--output_dir", str(out / mode), "--max_decode_length", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(l) for l in open(out / mode / "pairs-4.jsonl")]
    assert [x["inputs"]["inputs_pretokenized"] for x in rows] == [
        "translate English to Spanish: Jesus wept.", "translate English to Spanish: God is love."]
    if mode == "score":
      assert all(isinstance(x["score"], float) and x["score"] < 0 for x in rows)
    else:
      assert all(isinstance(x["prediction"], str) and x["prediction_tokens"] for x in rows)
      assert ("aux" in rows[0]) == (mode == "predict_with_aux")
  assert not list((out / "predict").glob("*.COMPLETED"))  # merged and cleaned up


def test_infer_killed_in_the_middle_resumes_without_loss_or_repeat(model_dir, tmp_path):
  src = tmp_path / "many.txt"
  lines = [f"translate English to Spanish: verse number {i}." for i in range(60)]
  src.write_text("\n".join(lines) + "\n")
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "t5forge", "infer", "--checkpoint", str(model_dir), "--input",
         str(src), "--output_dir", str(out), "--chunk_size", "5", "--batch_size", "5",
         "--max_decode_length", "24"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
      if len(list(out.glob("*.COMPLETED"))) >= 3:
        proc.send_signal(signal.SIGKILL)
        break
      time.sleep(0.01)
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL, "infer finished before it could be killed"
  done_before = len(list(out.glob("*.COMPLETED")))
  assert 3 <= done_before < 12 and not (out / "many-4.jsonl").exists()
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  assert f"{12 - done_before} of 12 chunks computed now" in r.stdout
  rows = [json.loads(l) for l in open(out / "many-4.jsonl")]
  assert [x["inputs"]["inputs_pretokenized"] for x in rows] == lines


def test_eval_all_checkpoints_skips_finished_ones(model_dir, tmp_path):
  out = tmp_path / "eval"
  args = ("eval", "--checkpoint", str(model_dir), "--mode", "all", "--task",
          "bible_translate_en_es", "--num_examples", "8", "--batch_size", "8",
          "--output_dir", str(out))
  r = _cli(*args)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "step 2: bible_translate_en_es/bleu" in r.stdout and "step 4:" in r.stdout
  metrics = [json.loads(l) for l in open(out / "bible_translate_en_es-metrics.jsonl")]
  assert [m["step"] for m in metrics] == [2, 4] and {"bleu", "chrf"} <= set(metrics[0])
  rows = [json.loads(l) for l in open(out / "bible_translate_en_es-4.jsonl")]
  assert len(rows) == 8 and {"inputs", "prediction", "target"} <= set(rows[0])
  assert list((out / "bible_translate_en_es").glob("events.out.tfevents.*"))
  r = _cli(*args)
  assert r.returncode == 0 and r.stdout.count("already evaluated") == 2, r.stdout


def test_bad_input(model_dir, tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  base = ("infer", "--checkpoint", str(model_dir), "--output_dir", str(tmp_path / "o"))
  assert "empty" in error_line(_cli(*base, "--input", str(empty)))
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"fine line\n\xff\xfe broken\n")
  msg = error_line(_cli(*base, "--input", str(bad)))
  assert f"{bad}:2" in msg and "UTF-8" in msg
  long_in = tmp_path / "long.txt"
  long_in.write_text("word " * 200 + "\nshort\n")
  msg = error_line(_cli(*base, "--input", str(long_in), "--max_input_length", "16", "--strict"))
  assert f"{long_in}:1" in msg and "16" in msg
  r = _cli(*base, "--input", str(long_in), "--max_input_length", "16", "--max_decode_length", "4",
           "--topk", "5", "--topp", "0.9")  # both apply (top-p over top-k's tokens)
  assert r.returncode == 0 and "1 of 2 inputs were longer than 16 tokens" in r.stdout
  msg = error_line(_cli("infer", "--checkpoint", str(tmp_path), "--input", str(long_in),
                    "--output_dir", str(tmp_path / "o2")))
  assert "not a checkpoint" in msg and "long.txt" in msg  # says what it found instead
  msg = error_line(_cli(*base, "--input", str(long_in), "--beam_size", "0"))
  assert "num_decodes" in msg


def test_shortened_demo_runs(tmp_path):
  r = _cli("demo", "--model_dir", str(tmp_path / "demo"), "--steps", "4", "--eval_examples", "8",
           "--show", "2", "--eval_period", "2")
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  # The held-out (John) loss as it trains, and the precision chosen for this machine,
  # which config.gin records.
  held = [l for l in out.splitlines() if l.startswith("held-out at step ")]
  assert [l.split(":")[0] for l in held] == ["held-out at step 2", "held-out at step 4"], out
  assert all("bible_translate_en_es loss per target token " in l for l in held)
  line = next(l for l in out.splitlines() if l.startswith("precision: "))
  dtype = "bfloat16" if line.startswith("precision: bfloat16") else "float32"
  assert "(auto: " in line
  config = (tmp_path / "demo" / "config.gin").read_text().splitlines()
  assert f"network.ModelConfig.dtype = '{dtype}'" in config
  assert "Held-out Gospel of John: BLEU" in out and "REF" in out and "OUT" in out
  assert "checkpoints:" in out and "TensorBoard:" in out
  assert (tmp_path / "demo" / "inference_eval" / "bible_translate_en_es-4.jsonl").exists()


def test_t5x_style_gin_infer_and_eval(model_dir, tmp_path):
  common = ["--gin_file=models/t5_1_1/tiny.gin", f'--gin.CHECKPOINT_PATH="{model_dir}"',
            "--gin.MIXTURE_OR_TASK_NAME='bible_translate_en_es'",
            "--gin.network.ModelConfig.vocab_size=8000", "--gin.BATCH_SIZE=64"]
  r = _cli("infer", *common, "--gin_file=runs/infer.gin",
           f'--gin.INFER_OUTPUT_DIR="{tmp_path / "infer"}"',
           "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 4}")
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [json.loads(l) for l in open(tmp_path / "infer" / "bible_translate_en_es-4.jsonl")]
  assert len(rows) == 879 and rows[0]["inputs"]["inputs_pretokenized"].startswith("translate")
  r = _cli("eval", *common, "--gin_file=runs/eval.gin",
           f'--gin.EVAL_OUTPUT_DIR="{tmp_path / "eval"}"',
           "--gin.utils.RestoreCheckpointConfig.mode='all'",
           "--gin.eval_script.evaluate.num_examples=16")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "step 2:" in r.stdout and "step 4:" in r.stdout
