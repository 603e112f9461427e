"""`infer` reuses earlier output only for the same work (inputs,
mode, decoding options, lengths, checkpoint), and `eval` skips a step only when a record
covers what it would evaluate (split, example count, lengths, decoding options)."""
import json
import os

import pytest

from train_helpers import cli, error_line, read_jsonl, train_in_process, write_gin

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

TASKS_PY = '''
import functools
from t5forge import metrics
from t5forge.data import preprocessors as pre, sources
from t5forge.data.bundled_tasks import OUTPUT_FEATURES
from t5forge.data.tasks import TaskRegistry

TaskRegistry.add(
    "fresh_tiny_en_es",
    source=sources.TsvDataSource({"validation": %r}, field_names=("en", "es")),
    preprocessors=[functools.partial(pre.translate, source_language="en",
                                     target_language="es"), pre.tokenize,
                   pre.append_eos_after_trim],
    output_features=OUTPUT_FEATURES, metric_fns=[metrics.bleu, metrics.chrf])
'''
VERSES = [("Jesus wept.", "Jesús lloró."), ("God is love.", "Dios es amor."),
          ("In the beginning was the Word.", "En el principio era el Verbo."),
          ("I am the light of the world.", "Yo soy la luz del mundo."),
          ("Love one another.", "Amaos unos a otros."),
          ("The truth will make you free.", "La verdad os hará libres.")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A tiny model trained 4 steps (checkpoint at step 4), and a user's tasks module with
  a six-example validation split, importable through PYTHONPATH as a T5X user's is."""
  d = tmp_path_factory.mktemp("fresh")
  gin = write_gin(d / "run.gin", steps=4, period=4)
  r = train_in_process(gin, d / "model")
  assert r.returncode == 0, r.stderr[-3000:]
  (d / "verses.tsv").write_text("".join(f"{en}\t{es}\n" for en, es in VERSES))
  (d / "user" / "fresh_tasks.py").parent.mkdir()
  (d / "user" / "fresh_tasks.py").write_text(TASKS_PY % str(d / "verses.tsv"))
  return d / "model"


def _cli(*args):
  """In this process, with the PYTHONPATH `user_path` sets on sys.path (train_helpers.cli)."""
  return cli(*args, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})


def _pairs(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(f"translate English to Spanish: {en}\t{es}\n" for en, es in rows))
  return path


def _infer(model_dir, src, out, *extra):
  return _cli("infer", "--checkpoint", str(model_dir), "--input", str(src), "--output_dir",
              str(out), "--max_decode_length", "4", *extra)


def test_infer_other_mode_is_refused_and_overwrite_replaces(model_dir, tmp_path):
  src, out = _pairs(tmp_path / "pairs.tsv", VERSES[:2]), tmp_path / "out"
  assert _infer(model_dir, src, out).returncode == 0
  assert "prediction" in read_jsonl(out / "pairs-4.jsonl")[0]
  msg = error_line(_infer(model_dir, src, out, "--mode", "score"))
  assert "pairs-4.jsonl was made with --mode predict, now score" in msg, msg
  assert "--overwrite" in msg
  assert "prediction" in read_jsonl(out / "pairs-4.jsonl")[0]  # refused: left as it was
  r = _infer(model_dir, src, out, "--mode", "score", "--overwrite")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "1 of 1 chunks computed now" in r.stdout
  rows = read_jsonl(out / "pairs-4.jsonl")
  assert len(rows) == 2 and all(isinstance(x["score"], float) and "prediction" not in x
                                for x in rows)


def test_infer_other_decoding_or_inputs_is_refused_same_work_resumes(model_dir, tmp_path):
  src, out = _pairs(tmp_path / "a" / "pairs.tsv", VERSES[:2]), tmp_path / "out"
  assert _infer(model_dir, src, out).returncode == 0
  merged = out / "pairs-4.jsonl"
  before = merged.read_bytes()
  msg = error_line(_infer(model_dir, src, out, "--beam_size", "4"))
  assert "--method greedy, now beam" in msg and "--num_decodes (--beam_size) 1, now 4" in msg
  other = _pairs(tmp_path / "b" / "pairs.tsv", VERSES[2:4])  # same basename, other verses
  msg = error_line(_infer(model_dir, other, out))
  assert "pairs-4.jsonl was made with other inputs" in msg and "--overwrite" in msg, msg
  r = _infer(model_dir, src, out)  # the same work again: the same file, nothing computed
  assert r.returncode == 0 and "0 of 1 chunks computed now" in r.stdout, r.stderr[-2000:]
  assert merged.read_bytes() == before


def test_infer_never_reuses_output_or_chunks_it_cannot_vouch_for(model_dir, tmp_path):
  src, out = _pairs(tmp_path / "pairs.tsv", VERSES[:2]), tmp_path / "out"
  out.mkdir()
  # What the previous version left: a merged file and no fingerprint.
  (out / "pairs-4.jsonl").write_text('{"inputs": {}, "prediction": "stale"}\n')
  msg = error_line(_infer(model_dir, src, out, "--chunk_size", "1"))
  assert "pairs-4.jsonl has no record" in msg and "--overwrite" in msg, msg
  r = _infer(model_dir, src, out, "--chunk_size", "1", "--overwrite")
  assert r.returncode == 0 and "2 of 2 chunks computed now" in r.stdout, r.stderr[-2000:]
  good = read_jsonl(out / "pairs-4.jsonl")
  assert [x["inputs"]["inputs_pretokenized"] for x in good] == [
      f"translate English to Spanish: {en}" for en, _ in VERSES[:2]]
  # A finished-looking chunk of other work (an empty marker, as before) beside the
  # fingerprint of this work: recomputed, never merged in.
  (out / "pairs-4.jsonl").unlink()
  (out / "pairs-4.jsonl-00000-of-00002").write_text('{"prediction": "stale"}\n')
  (out / "pairs-4.jsonl-00000-of-00002.COMPLETED").write_text("")
  r = _infer(model_dir, src, out, "--chunk_size", "1")
  assert r.returncode == 0 and "2 of 2 chunks computed now" in r.stdout, r.stderr[-2000:]
  assert read_jsonl(out / "pairs-4.jsonl") == good


def _eval(model_dir, out, *extra):
  return _cli("eval", "--checkpoint", str(model_dir), "--task", "fresh_tiny_en_es",
              "--module", "fresh_tasks", "--output_dir", str(out), "--batch_size", "4",
              "--feature_lengths", "inputs=32,targets=4", *extra)


@pytest.fixture
def user_path(model_dir, monkeypatch):
  monkeypatch.setenv("PYTHONPATH", str(model_dir.parent / "user"))


def test_eval_partial_record_does_not_count_as_done(model_dir, tmp_path, user_path):
  out = tmp_path / "eval"
  r = _eval(model_dir, out, "--num_examples", "3")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "(3 examples)" in r.stdout, r.stdout
  r = _eval(model_dir, out)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "already evaluated" not in r.stdout, r.stdout
  assert "the example count (--num_examples) 3, now 6" in r.stdout, r.stdout
  assert "step 4: fresh_tiny_en_es/bleu = " in r.stdout and "(6 examples)" in r.stdout
  records = read_jsonl(out / "fresh_tiny_en_es-metrics.jsonl")
  assert [x["num_examples"] for x in records] == [3, 6]
  last = records[-1]["coverage"]
  assert last["split"] == "validation" and last["num_examples"] == 6
  assert last["feature_lengths"] == {"inputs": 32, "targets": 4}
  assert last["decode"]["method"] == "greedy" and last["checkpoint"]["step"] == 4
  assert len(read_jsonl(out / "fresh_tiny_en_es-4.jsonl")) == 6


def test_eval_skips_only_a_matching_record_and_force_redoes(model_dir, tmp_path, user_path):
  out = tmp_path / "eval"
  assert _eval(model_dir, out, "--num_examples", "2").returncode == 0
  r = _eval(model_dir, out, "--num_examples", "2")
  assert r.returncode == 0 and "already evaluated" in r.stdout, (r.stdout, r.stderr[-2000:])
  r = _eval(model_dir, out, "--num_examples", "2", "--force")
  assert r.returncode == 0 and "already evaluated" not in r.stdout, r.stdout
  metrics = out / "fresh_tiny_en_es-metrics.jsonl"
  assert len(read_jsonl(metrics)) == 2
  # A record written before coverage was recorded: not trusted, with a note.
  metrics.write_text(json.dumps({"step": 4, "bleu": 1.0, "chrf": 2.0}) + "\n")
  r = _eval(model_dir, out, "--num_examples", "2")
  assert r.returncode == 0 and "no record of what it covered" in r.stdout, r.stdout
  assert "already evaluated" not in r.stdout
  assert read_jsonl(metrics)[-1]["num_examples"] == 2


def test_eval_runtime_flags_take_effect(model_dir, tmp_path, user_path):
  """--weight_dtype / --dtype change what eval computes (they were once accepted and
  ignored); --scheduler static decodes greedy rows in padded batches, the same texts."""
  out = tmp_path / "eval"
  assert _eval(model_dir, out, "--num_examples", "2").returncode == 0
  r = _eval(model_dir, out, "--num_examples", "2", "--scheduler", "static")
  assert r.returncode == 0 and "already evaluated" in r.stdout, (r.stdout, r.stderr[-2000:])
  r = _eval(model_dir, out, "--num_examples", "2", "--scheduler", "static", "--force")
  assert r.returncode == 0, r.stderr[-2000:]
  first, again = read_jsonl(out / "fresh_tiny_en_es-metrics.jsonl")
  assert {k: v for k, v in first.items() if k != "coverage"} == {
      k: v for k, v in again.items() if k != "coverage"}
  (out / "fresh_tiny_en_es-metrics.jsonl").unlink()
  assert _eval(model_dir, out, "--num_examples", "2").returncode == 0
  r = _eval(model_dir, out, "--num_examples", "2", "--weight_dtype", "int8")
  assert r.returncode == 0 and "already evaluated" not in r.stdout, (r.stdout, r.stderr[-2000:])
  records = read_jsonl(out / "fresh_tiny_en_es-metrics.jsonl")
  assert [x["coverage"]["model"]["weight_dtype"] for x in records] == ["float32", "int8"]


def test_trainers_partial_infer_eval_does_not_stand_for_the_split(model_dir, tmp_path,
                                                                   monkeypatch, user_path):
  """The issue's case: training's hook scored the first examples; `t5forge eval` then
  evaluates the whole split (it used to skip the step as "already evaluated"), and skips
  it only when asked for what the hook did."""
  import jax
  from t5forge import evaluate, models
  from t5forge.convert import load_checkpoint
  from t5forge.data import vocab_io
  from t5forge.train.settings import DatasetConfig
  monkeypatch.syspath_prepend(str(model_dir.parent / "user"))
  ckpt = load_checkpoint(str(model_dir))
  model = models.model_for(ckpt.config,
                           vocabulary=vocab_io.from_spec(ckpt.extras.get("vocabulary")))
  out = tmp_path / "inference_eval"
  hook = evaluate.InferenceEvaluator(  # as the trainer builds it: MODEL_DIR, no checkpoint
      model=model, model_dir=str(model_dir), output_dir=str(out), num_examples=3,
      dataset_cfg=DatasetConfig("fresh_tiny_en_es", {"inputs": 32, "targets": 4},
                                split="validation", batch_size=4, shuffle=False, pack=False,
                                module="fresh_tasks"))
  scalars = hook(jax.device_put(ckpt.params), 4)
  hook.close()
  assert scalars["inference_eval/fresh_tiny_en_es/num_examples"] == 3
  record = read_jsonl(out / "fresh_tiny_en_es-metrics.jsonl")[-1]
  assert record["num_examples"] == 3 and record["coverage"]["checkpoint"]["path"] == str(
      model_dir / "checkpoint_4")
  r = _eval(model_dir, out, "--num_examples", "3")  # what the hook did: done
  assert r.returncode == 0 and "already evaluated" in r.stdout, (r.stdout, r.stderr[-2000:])
  r = _eval(model_dir, out)  # the whole split: not done
  assert r.returncode == 0 and "already evaluated" not in r.stdout, r.stdout
  assert "(6 examples)" in r.stdout
  assert read_jsonl(out / "fresh_tiny_en_es-metrics.jsonl")[-1]["num_examples"] == 6


def test_eval_on_the_engine_equals_static_batches(model_dir, tmp_path, monkeypatch):
  """Greedy evaluation feeds the engine's slots; its predictions and metrics are those
  of the padded static batches."""
  import jax
  from t5forge import evaluate, models
  from t5forge.convert import load_checkpoint
  from t5forge.data import vocab_io
  from t5forge.engine import offline
  from t5forge.train.settings import DatasetConfig
  monkeypatch.syspath_prepend(str(model_dir.parent / "user"))
  ckpt = load_checkpoint(str(model_dir))
  model = models.model_for(ckpt.config,
                           vocabulary=vocab_io.from_spec(ckpt.extras.get("vocabulary")))
  params = jax.device_put(ckpt.params)
  cfg = DatasetConfig("fresh_tiny_en_es", {"inputs": 32, "targets": 12}, split="validation",
                      batch_size=4, shuffle=False, pack=False, module="fresh_tasks")
  got, calls = {}, []
  decode = offline.OfflineDecoder.decode
  monkeypatch.setattr(offline.OfflineDecoder, "decode",
                      lambda self, *a, **kw: calls.append(1) or decode(self, *a, **kw))
  for scheduler in ("continuous", "static"):
    out = tmp_path / scheduler
    hook = evaluate.InferenceEvaluator(model=model, output_dir=str(out), dataset_cfg=cfg,
                                       scheduler=scheduler)
    scalars = hook(params, 4)
    hook.close()
    assert bool(calls) == (scheduler == "continuous")
    calls.clear()
    got[scheduler] = (scalars, [(x["prediction"], x["prediction_tokens"])
                                for x in read_jsonl(out / "fresh_tiny_en_es-4.jsonl")])
  assert got["continuous"] == got["static"]
  assert got["static"][0]["inference_eval/fresh_tiny_en_es/num_examples"] == 6
  # A sampled evaluation names its scheduler: the slots draw other samples.
  from t5forge.errors import UserError
  from t5forge.predict import DecodeOptions
  sample = DecodeOptions(method="sample", seed=1)
  records = {s: evaluate.InferenceEvaluator(model=model, output_dir=str(tmp_path / "s"),
                                            dataset_cfg=cfg, decode_options=sample,
                                            scheduler=s).coverage("fresh_tiny_en_es", 4)
             for s in ("continuous", "static")}
  assert records["continuous"]["decode"]["scheduler"] == "continuous"
  assert "scheduler" not in records["static"]["decode"]
  with pytest.raises(UserError, match="--scheduler 'slots'"):
    evaluate.InferenceEvaluator(model=model, output_dir=str(tmp_path / "x"), dataset_cfg=cfg,
                                scheduler="slots")
