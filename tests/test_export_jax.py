"""`t5forge export`: the jax.export artifact runs in a fresh process that
imports no t5forge network, model or training code and gives the live model's tokens; a
changed file is refused in one line; --format hf loads in transformers; bad flags are one
line each."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import pytest

import t5forge
from t5forge.data import bundled_tasks
from t5forge.data.vocab import SentencePieceVocabulary
from t5forge.export import loader as exported
from train_helpers import ROOT, error_line

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

SPM = os.path.join(os.path.dirname(bundled_tasks.__file__), "bundled", "bible_en_es_8k.model")
TEXTS = ["In the beginning God created the heaven and the earth.", "hello world", "a",
         "And God said, Let there be light: and there was light.", "Y dijo Dios"]
DECODE = 16
BEAMS = 3  # not the default 4: the flag must reach the compiled loop


def _cli(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "t5forge", *args], capture_output=True,
                        text=True, cwd=ROOT, timeout=timeout)


def _checkpoint(tmp_path_factory, preset: str) -> tuple[str, t5forge.Model]:
  vocab = SentencePieceVocabulary(SPM, extra_ids=100)
  model = t5forge.init(preset, vocab_size=8192, vocabulary=vocab, seed=3)
  path = str(tmp_path_factory.mktemp(preset) / "checkpoint")
  model.save(path)
  return path, model


def _export(ckpt: str, out: str, *flags) -> None:
  r = _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "jax", *flags)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "wrote" in r.stdout, r.stdout


# Runs in a fresh interpreter: loads the artifact through `how` and prints JSON.
_FRESH = r"""
import json, sys
import numpy as np
how, out, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if how == "copy":
  sys.path.insert(0, out)
  import load_exported as le
else:
  from t5forge.export import loader as le
m = le.ExportedModel(out)
texts = json.loads(sys.argv[4])
res = {"texts": m.generate(texts, max_new_tokens=%d),
       "tokens": m.generate(np.array(tokens, np.int32), max_new_tokens=%d).tolist(),
       "modules": sorted(k for k in sys.modules if k.startswith("t5forge"))}
print(json.dumps(res))
""" % (DECODE, DECODE)


def _fresh(how: str, out: str, tokens: np.ndarray) -> dict:
  # cwd outside the repository: `import t5forge` could only come from site-packages.
  r = subprocess.run([sys.executable, "-c", _FRESH, how, out, json.dumps(tokens.tolist()),
                      json.dumps(TEXTS)], capture_output=True, text=True, cwd=out,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def enc_dec(tmp_path_factory):
  ckpt, model = _checkpoint(tmp_path_factory, "flan_t5.tiny")
  out = str(tmp_path_factory.mktemp("export") / "enc_dec")
  _export(ckpt, out, "--batch_sizes", "1,4", "--input_lengths", "24,64", "--decode_lengths",
          str(DECODE), "--methods", "greedy,sample,beam", "--num_beams", str(BEAMS))
  return ckpt, model, out


@pytest.fixture(scope="module")
def live(enc_dec):
  """TEXTS as the live model encodes them [5, 32] and its greedy tokens [5, DECODE]."""
  _, model, _ = enc_dec
  tokens, _ = model._encode_texts(TEXTS, None)
  return tokens, model.predict(tokens, DECODE)[0]


def test_artifact_files_and_manifest(enc_dec):
  _, model, out = enc_dec
  with open(os.path.join(out, "manifest.json")) as f:
    manifest = json.load(f)
  shapes = sorted((f["method"], f["batch"], f["input_length"], f["decode_length"])
                  for f in manifest["functions"])
  assert shapes == sorted((m, b, i, DECODE) for m in ("greedy", "sample", "beam")
                          for b in (1, 4) for i in (24, 64))
  assert manifest["eos_id"] == 1 and manifest["pad_id"] == 0
  assert manifest["num_beams"] == BEAMS
  assert manifest["model"]["num_parameters"] == sum(
      int(np.prod(s["shape"])) for s in manifest["parameters"]["tree"].values())
  listed = set(manifest["sha256"]) | {"manifest.json"}
  on_disk = {os.path.relpath(os.path.join(d, n), out) for d, _, ns in os.walk(out) for n in ns}
  assert on_disk == listed
  with open(os.path.join(out, "load_exported.py")) as f, open(exported.__file__) as g:
    assert f.read() == g.read()
  assert not os.path.exists(out + ".tmp-t5forge")
  # The parameters are arguments, not constants: every function file is far smaller
  # than the weights.
  weights = os.path.getsize(os.path.join(out, "params.safetensors"))
  assert all(os.path.getsize(os.path.join(out, f["file"])) < weights / 10
             for f in manifest["functions"])


# Import name -> the distribution pip installs it from, for what the loader imports.
_DISTRIBUTIONS = {"jax": "jax", "numpy": "numpy", "safetensors": "safetensors",
                  "sentencepiece": "sentencepiece"}
# Needed at run time though the loader never names them: jaxlib is jax's compiled half (jax
# only bounds its version, so it is pinned beside jax); flatbuffers is imported by
# jax.export's serialization when a .jaxexp file is deserialized, and jax declares it as
# no requirement of its own, so a venv with only jax, numpy, safetensors and sentencepiece
# fails with "Please install 'flatbuffers' in order to use Exported serialization".
_ALSO_NEEDED = {"jaxlib", "flatbuffers"}


def _third_party_imports(path: str) -> set[str]:
  """Top-level names of every `import` in the file, at any depth (imports inside functions
  too), less the standard library and __future__."""
  names = set()
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module.split(".")[0])
  return {n for n in names if n != "__future__" and n not in sys.stdlib_module_names}


def _distribution(requirement: str) -> str:
  return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def test_artifact_requirements_cover_the_loader_at_pinned_versions(enc_dec):
  """requirements.txt lists every third-party package the loader imports (and what jax.export
  needs besides), each pinned as pyproject.toml pins it, and nothing else."""
  _, _, out = enc_dec
  imported = _third_party_imports(exported.__file__)
  assert "t5forge" not in imported, "the artifact's loader must not import t5forge"
  unmapped = imported - set(_DISTRIBUTIONS)
  assert not unmapped, f"the loader imports {unmapped}: add them to _DISTRIBUTIONS"
  needed = {_DISTRIBUTIONS[n] for n in imported} | _ALSO_NEEDED
  with open(os.path.join(out, "requirements.txt"), encoding="utf-8") as f:
    listed = {_distribution(line): line.strip() for line in f
              if line.strip() and not line.startswith("#")}
  assert set(listed) == needed, (sorted(listed), sorted(needed))
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    pins = {_distribution(r): r for r in tomllib.load(f)["project"]["dependencies"]}
  for name, line in listed.items():
    assert name in pins, f"{name} is not pinned in pyproject.toml's dependencies"
    assert line == pins[name], (line, pins[name])
  with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
    assert "requirements.txt" in json.load(f)["sha256"]


@pytest.mark.parametrize("how", ["copy", "package"])
def test_fresh_process_gives_live_tokens(enc_dec, live, how):
  """Five rows (> the largest exported batch, 4: split), texts and token arrays; the
  live model decodes the same padded arrays."""
  _, model, out = enc_dec
  tokens, greedy = live
  got = _fresh(how, out, tokens)
  for name in ("t5forge.nn", "t5forge.train", "t5forge.models", "t5forge.data",
               "t5forge.interactive"):
    assert name not in got["modules"], got["modules"]
  np.testing.assert_array_equal(np.array(got["tokens"]), greedy)
  assert got["texts"] == model.generate(TEXTS, max_decode_length=DECODE)


def test_sampling_matches_live_and_greedy_rows(enc_dec, live):
  """Exported sampling with one batch of the exported size (4) and the same seed draws
  what the live model draws; rows at temperature 0 are greedy."""
  _, model, out = enc_dec
  m = exported.ExportedModel(out)
  tokens, greedy = live[0][:4], live[1][:4]
  got, _ = m.run("sample", tokens, decode_length=DECODE, temperature=0.8, topp=0.9, seed=5)
  drawn, _ = model.predict(tokens, DECODE, method="sample", temperature=0.8, topp=0.9, seed=5)
  np.testing.assert_array_equal(got, drawn)
  mixed, _ = m.run("sample", tokens, decode_length=DECODE,
                   temperature=np.array([0, 1, 0, 1], np.float32), seed=5)
  np.testing.assert_array_equal(mixed[[0, 2]], greedy[[0, 2]])
  assert not np.array_equal(mixed[[1, 3]], greedy[[1, 3]])


def test_generator_interface_and_limits(enc_dec, live):
  _, _, out = enc_dec
  gen = exported.ExportedGenerator(out)
  Kind = exported.Kind

  tokens, greedy = live[0][:3], live[1][:3]
  chunks = []
  res = gen.generate(Kind(), tokens, decode_length=DECODE,
                     max_new_tokens=np.array([DECODE, 3, 5]), temperature=None, topp=None,
                     stream=True,
                     on_chunk=lambda *a: chunks.append(a))
  assert res.tokens.shape == (3, 1, DECODE) and len(chunks) == 1
  np.testing.assert_array_equal(res.tokens[0, 0], greedy[0])
  np.testing.assert_array_equal(res.tokens[1, 0, :3], greedy[1, :3])
  assert not res.tokens[1, 0, 3:].any() and not res.tokens[2, 0, 5:].any()
  assert res.lengths[:, 0].tolist() == [DECODE, 3, 5] and not res.finished.any()
  assert gen.warmup([Kind()], [1, 4], [24], [DECODE]) == 2
  # Without max_new_tokens: the largest exported decode length.
  np.testing.assert_array_equal(gen.exported.generate(tokens[:1]), greedy[:1])
  with pytest.raises(exported.ExportError, match="'contrastive' was not exported .* an export "
                     "runs greedy, sample or beam"):
    gen.exported.generate(tokens[:1], method="contrastive")
  for kind, word in ((Kind("beam", BEAMS), f"num_beams is not served from an exported model: "
                      f"its beam search \\(num_beams={BEAMS}\\) returns the best beam only"),
                     (Kind("sample", 2), "one decode"), (Kind(topk=5), "top_k"),
                     (Kind(top_logprobs=2), "logprobs")):
    with pytest.raises(exported.ExportError, match=word):
      gen.generate(kind, tokens, decode_length=DECODE, max_new_tokens=np.full(3, 4))
  with pytest.raises(exported.ExportError, match=r"no exported greedy shape fits input length 65"):
    gen.generate(Kind(), np.ones((1, 65), np.int32), decode_length=DECODE,
                 max_new_tokens=np.array([4]))
  with pytest.raises(exported.ExportError, match="decode length 17"):
    gen.exported.run("greedy", tokens, decode_length=DECODE + 1)


def test_beam_matches_live_beam(enc_dec, live):
  """The CLI's beam functions (3 beams) give the live model's beam text for five prompts
  (4 + 1 rows: split), and its tokens and scores; most rows differ from greedy."""
  _, model, out = enc_dec
  m = exported.ExportedModel(out)
  assert m.num_beams == BEAMS
  texts = m.generate(TEXTS, method="beam")
  assert texts == model.generate(TEXTS, max_decode_length=DECODE, method="beam",
                                 num_decodes=BEAMS)
  greedy = model.generate(TEXTS, max_decode_length=DECODE)
  assert sum(a != b for a, b in zip(texts, greedy)) >= 3
  tokens = live[0][:4]
  got, scores = m.run("beam", tokens, decode_length=DECODE, alpha=0.6)
  want, want_scores = model.predict(tokens, DECODE, method="beam", num_decodes=BEAMS)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


def test_beam_alpha_is_a_runtime_argument(enc_dec, tmp_path):
  """One exported beam function at two alphas gives the live beam text of each. The
  random model seldom ends a row, and alpha ranks finished beams only: its EOS logit is
  scaled up so that beams end at different lengths."""
  import jax
  from t5forge.export import writer as export
  _, live_model, _ = enc_dec
  params = jax.tree_util.tree_map(lambda x: x, live_model.params)  # a new tree, same arrays
  kernel = params["decoder"]["logits_dense"]["kernel"]
  params["decoder"]["logits_dense"]["kernel"] = kernel.at[:, 1].multiply(4.0)
  model = t5forge.Model(live_model.config, params, vocabulary=live_model.vocabulary)
  out = str(tmp_path / "beam")
  export.export_jax(model.model, model.params, model.vocabulary, out,
                    shapes=[export.Shape(4, 24, DECODE)], methods=("beam",), num_beams=BEAMS,
                    log=lambda _: None)
  m = exported.ExportedModel(out)
  got = {a: m.generate(TEXTS, method="beam", alpha=a) for a in (0.0, 2.0)}
  for a, texts in got.items():
    assert texts == model.generate(TEXTS, max_decode_length=DECODE, method="beam",
                                   num_decodes=BEAMS, alpha=a), a
  assert got[0.0] != got[2.0]


def test_portable_top_k_is_lax_top_k():
  """The SavedModel's beam search takes its top-k from reductions: the same values and
  indices as lax.top_k, ties (here every value twice, and -inf) lower index first."""
  import jax
  from t5forge import decoding
  x = np.random.default_rng(0).standard_normal((3, 4, 10)).astype(np.float32)
  x = np.concatenate([x, x, np.full((3, 4, 5), -np.inf, np.float32)], axis=-1)
  for k in (1, 7, 25):
    want, got = jax.lax.top_k(x, k), decoding.portable_top_k(x, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_changed_file_is_refused_in_one_line(enc_dec, tmp_path):
  _, _, out = enc_dec
  copy = str(tmp_path / "copy")
  shutil.copytree(out, copy)
  exported.ExportedModel(copy)  # intact
  name = "functions/greedy_b1_i24_l16.jaxexp"
  with open(os.path.join(copy, name), "r+b") as f:
    f.seek(100)
    byte = f.read(1)
    f.seek(100)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(exported.ExportError) as e:
    exported.ExportedModel(copy)
  assert str(e.value) == (f"{os.path.join(copy, name)}: sha256 differs from manifest.json (the "
                          "file was changed or damaged after export); re-export the model")
  os.remove(os.path.join(copy, "spiece.model"))
  with pytest.raises(exported.ExportError, match=r"spiece.model: missing"):
    exported.ExportedModel(copy)


def test_other_platform_and_bad_ids_are_one_line(enc_dec, tmp_path):
  """A function lowered for another backend (jax.export lowers for TPU on a CPU machine)
  and ids outside the vocabulary: ExportError, not XLA's error or silently clamped ids."""
  from t5forge.export import writer as export
  _, model, _ = enc_dec
  out = str(tmp_path / "tpu")
  export.export_jax(model.model, model.params, model.vocabulary, out,
                    shapes=[export.Shape(1, 8, 4)], platforms=("tpu",), log=lambda _: None)
  m = exported.ExportedModel(out)
  with pytest.raises(exported.ExportError, match=r"greedy_b1_i8_l4.jaxexp was exported for tpu, "
                     r"not this machine's cpu"):
    m.generate(np.array([[5, 1]]), max_new_tokens=4)
  with pytest.raises(exported.ExportError, match=r"ids outside \[0, 8192\): min 1, max 9000"):
    m.generate(np.array([[9000, 1]]), max_new_tokens=4)


def test_failed_export_leaves_nothing(enc_dec, tmp_path, monkeypatch):
  """Weights and vocabulary are written before the functions; a failure while exporting
  one leaves neither the output nor its temporary sibling."""
  import jax
  from t5forge.export import writer as export
  _, model, _ = enc_dec
  out = str(tmp_path / "half")

  def fail(*args, **kwargs):
    raise RuntimeError("lowering failed")

  monkeypatch.setattr(jax.export, "export", fail)
  with pytest.raises(RuntimeError, match="lowering failed"):
    export.export_jax(model.model, model.params, model.vocabulary, out,
                      shapes=[export.Shape(1, 8, 4)], log=lambda _: None)
  assert os.listdir(tmp_path) == []


def test_decoder_only_export(tmp_path_factory):
  ckpt, model = _checkpoint(tmp_path_factory, "decoder_only.tiny")
  out = str(tmp_path_factory.mktemp("export") / "dec")
  _export(ckpt, out, "--batch_sizes", "2", "--input_lengths", "32", "--decode_lengths",
          str(DECODE), "--methods", "greedy,beam")
  m = exported.ExportedModel(out)
  assert m.num_beams == 4  # --num_beams' default
  assert m.generate(TEXTS[:3], max_new_tokens=DECODE) == model.generate(
      TEXTS[:3], max_decode_length=DECODE)
  # Beam search continuing a prompt (forced tokens keep one beam alive, as T5X).
  assert m.generate(TEXTS[:3], method="beam", alpha=1.0) == model.generate(
      TEXTS[:3], max_decode_length=DECODE, method="beam", num_decodes=4, alpha=1.0)


def test_hf_format_loads_in_transformers(enc_dec, live, tmp_path):
  import torch
  import transformers
  ckpt, model, _ = enc_dec
  out = str(tmp_path / "hf")
  r = _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "hf")
  assert r.returncode == 0, r.stderr[-3000:]
  hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
  tokens = live[0][:2]
  dec = np.zeros((2, 4), np.int32)
  with torch.no_grad():
    logits = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(tokens > 0, dtype=torch.long),
                decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits, model.logits(tokens, dec), rtol=1e-4, atol=1e-4)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok(TEXTS[0]).input_ids == model.vocabulary.encode(TEXTS[0]) + [1]


def test_bad_flags_one_line(enc_dec, tmp_path):
  ckpt, _, _ = enc_dec
  out = str(tmp_path / "x")
  missing = str(tmp_path / "nope")
  assert missing in error_line(_cli("export", "--checkpoint", missing, "--output", out,
                                    "--format", "jax"))
  assert "--format 'onnx': choose jax, saved_model or hf" in error_line(
      _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "onnx"))
  assert "--batch_sizes '1,x': give comma-separated integers" in error_line(
      _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "jax",
           "--batch_sizes", "1,x"))
  assert "--methods: unknown method 'topk'" in error_line(
      _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "jax",
           "--methods", "greedy,topk"))
  assert "--platforms: unknown platform(s) ['gpu']" in error_line(
      _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "jax",
           "--platforms", "cpu,gpu"))
  assert "--batch_sizes apply to --format jax and saved_model only" in error_line(
      _cli("export", "--checkpoint", ckpt, "--output", out, "--format", "hf",
           "--batch_sizes", "2"))
  assert not os.path.exists(out)
