"""`t5forge serve --adapter name=path`: one server holds a base model and two LoRA adapters
(different ranks, targets and scales; random non-zero `lora_b`, no training), one of
them also as HF peft saves it (`convert.peft.write_peft`). Requests
that alternate the three models, concurrently so that they share engine steps, get the
greedy texts of each model decoded alone in process from its MERGED weights (the outside
reference: no LoRA code in that forward pass), and the server compiles nothing after
start-up; beams (the static batcher) and /v1/embeddings (the adapter's encoder) pick the
adapter too; /v1/models lists the adapters with their parent; an unknown model is a 404;
bad --adapter flags and an adapter of another base are one-line start-up errors."""
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest

from t5forge import testing as sh
from train_helpers import ROOT

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

PROMPTS = ["translate English to Spanish: God is love.", "In the beginning God created",
           "The Lord is my shepherd; I shall not want.", "and the earth was without form"]
MAX_TOKENS = 8
LENGTH = 32
# Power-of-two scales (alpha / rank): folding the scale into lora_b is exact, so the
# stacked product differs from the plain one by accumulation order only. lora_b's spread:
# large enough to change the greedy texts; an update of every projection is kept
# smaller (at 0.5 its outputs grow so large that merged and unmerged differ by 5e-4).
ADAPTERS = {"qv4": (dict(rank=4, alpha=8.0, targets="qv"), 0.5),
            "all8": (dict(rank=8, alpha=32.0, targets="all-linear"), 0.1)}


def _adapter(base_model, cfg_kw: dict, std: float, seed: int):
  """A LoRA adapter of `base_model` with random lora_a (peft's init) and random non-zero
  lora_b: -> (ModelConfig with the LoRA, adapter params)."""
  import dataclasses

  import jax

  from t5forge import models
  from t5forge.nn import adapters, lora
  config = dataclasses.replace(base_model.config, lora=lora.LoraConfig(**cfg_kw))
  params = models.model_for(config).init_params(jax.random.key(seed))
  adapter, _ = adapters.split(params)
  rng = np.random.default_rng(seed)
  adapter = jax.tree_util.tree_map_with_path(
      lambda p, x: (rng.normal(0, std, x.shape).astype(np.float32)
                    if str(p[-1].key) == "lora_b" else np.asarray(x)), adapter)
  return config, adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(checkpoint, {adapter name: directory}, {model name: merged params}, base Model)."""
  import t5forge
  from t5forge.convert import peft
  from t5forge.nn import adapters, lora
  d = tmp_path_factory.mktemp("serve_adapters")
  ckpt = sh.tiny_checkpoint(str(d / "tiny"))
  base = t5forge.load(ckpt)
  fingerprint = adapters.fingerprint(base.params)
  dirs, merged = {}, {"tiny": base.params}
  for seed, (name, (kw, std)) in enumerate(ADAPTERS.items(), start=1):
    config, adapter = _adapter(base.model, kw, std, seed)
    path = str(d / name)
    adapters.save(path, adapter, model_config=config.to_dict(),
                  record={"base": ckpt, "fingerprint": fingerprint, "base_dtype": "float32"})
    dirs[name] = path
    merged[name] = lora.merge(adapters.join(adapter, base.params), config.lora)
    if name == "qv4":  # the same adapter as HF peft saves it
      dirs["qv4peft"] = str(d / "qv4peft")
      peft.write_peft(dirs["qv4peft"], config.lora, adapter, base.config, ckpt)
      merged["qv4peft"] = merged[name]
  return ckpt, dirs, merged, base


@pytest.fixture(scope="module")
def server(setup):
  ckpt, dirs, _, _ = setup
  srv = sh.Server(ckpt, "--model_name", "tiny", *sum((["--adapter", f"{n}={p}"]
                                                      for n, p in dirs.items()), []),
                  "--max_batch_size", "8", "--batch_buckets", "1,8", "--length_buckets",
                  str(LENGTH), "--decode_buckets", str(MAX_TOKENS), "--warmup", "greedy,embed")
  yield srv
  assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)


def _greedy(base, params, prompts, **kw) -> list[str]:
  """Each prompt alone through the Python API with `params` in place of the base's."""
  m = base
  saved, m.params = m.params, params
  try:
    out = []
    for p in prompts:
      ids = m.vocabulary.encode(p) + [m.vocabulary.eos_id]
      tokens, _ = m.predict(np.array([ids + [0] * (LENGTH - len(ids))], np.int32),
                            max_decode_length=MAX_TOKENS, **kw)
      out.append(m.vocabulary.decode(tokens[0].tolist()))
    return out
  finally:
    m.params = saved


@pytest.fixture(scope="module")
def reference(setup):
  _, _, merged, base = setup
  return {name: _greedy(base, params, PROMPTS) for name, params in merged.items()}


def test_alternating_adapters_share_batches_and_match_merged(server, reference):
  names = list(reference)
  # The adapters change what the model says (else the test could not tell them apart).
  assert reference["qv4"] != reference["tiny"] and reference["all8"] != reference["tiny"]
  jobs = [(names[i % len(names)], PROMPTS[(i // len(names)) % len(PROMPTS)])
          for i in range(48)]
  results, errors = [None] * len(jobs), []

  def client_thread(k):
    for j in range(k, len(jobs), 12):
      model, prompt = jobs[j]
      status, _, body = sh.request(server.url, "/v1/completions", {
          "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
      if status != 200:
        errors.append((status, body))
      else:
        results[j] = (body["model"], body["choices"][0]["text"])

  threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(12)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(600)
  assert not errors, errors[:3]
  for (model, prompt), got in zip(jobs, results):
    assert got == (model, reference[model][PROMPTS.index(prompt)]), (model, prompt)
  _, _, metrics = sh.request(server.url, "/metrics")
  assert "t5forge_compiles_since_ready 0.0" in metrics  # alternating compiled nothing
  buckets = {line.split('le="')[1].split('"')[0]: float(line.split()[-1])
             for line in metrics.splitlines() if line.startswith("t5forge_batch_size_bucket")}
  total = float([line for line in metrics.splitlines()
                 if line.startswith("t5forge_batch_size_count")][0].split()[-1])
  assert total > buckets["1.0"], metrics  # some steps held several requests' rows


def test_completions_and_beams_pick_the_adapter(client, setup, reference):
  _, _, merged, base = setup
  got = client.completions.create(model="qv4", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                  temperature=0)
  assert got.model == "qv4" and [c.text for c in got.choices] == reference["qv4"][:2]
  # Beam search runs in the static batcher: its rows carry the adapter, repeated per beam.
  want = _greedy(base, merged["all8"], PROMPTS[:1], method="beam", num_decodes=2)
  beam = client.completions.create(model="all8", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                   extra_body={"num_beams": 2})
  assert beam.choices[0].text == want[0]


def test_embeddings_use_the_adapters_encoder(client, setup):
  _, _, merged, base = setup
  ids = base.vocabulary.encode(PROMPTS[0]) + [base.vocabulary.eos_id]
  vectors = {}
  for name in ("tiny", "qv4"):
    got = client.embeddings.create(model=name, input=PROMPTS[0], encoding_format="float")
    assert got.model == name
    vectors[name] = np.array(got.data[0].embedding)
    hidden = np.asarray(base.model.encode(merged[name], np.array([ids], np.int32)))[0]
    want = hidden.mean(axis=0)  # pooling "mean", not normalized: the server's defaults
    np.testing.assert_allclose(vectors[name], want, atol=1e-5)
  assert np.abs(vectors["tiny"] - vectors["qv4"]).max() > 1e-3


def test_models_lists_adapters_with_parent(client):
  cards = {m.id: m for m in client.models.list().data}
  assert set(cards) == {"tiny", "qv4", "all8", "qv4peft"}
  assert getattr(cards["tiny"], "parent", None) is None
  assert {cards[n].parent for n in ("qv4", "all8", "qv4peft")} == {"tiny"}


def test_unknown_adapter_is_404(client):
  with pytest.raises(openai.NotFoundError) as e:
    client.completions.create(model="nope", prompt="hi", max_tokens=2)
  assert e.value.body["code"] == "model_not_found"
  assert "'qv4'" in e.value.body["message"]  # the served names are listed


def _serve_error(ckpt, *flags) -> str:
  r = subprocess.run([sys.executable, "-m", "t5forge", "serve", "--checkpoint", ckpt,
                      "--port", "0", *flags], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode != 0
  lines = [line for line in r.stderr.splitlines() if line.startswith("t5forge: error:")]
  assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  return lines[0]


def test_bad_adapter_flags_are_one_line_errors(setup):
  ckpt, dirs, _, _ = setup
  assert "give name=path" in _serve_error(ckpt, "--adapter", dirs["qv4"])
  assert "given twice" in _serve_error(ckpt, "--adapter", f"a={dirs['qv4']}",
                                       "--adapter", f"a={dirs['all8']}")
  assert "base model's name" in _serve_error(ckpt, "--model_name", "tiny", "--adapter",
                                             f"tiny={dirs['qv4']}")


def test_adapter_of_another_base_is_refused(setup, tmp_path):
  import t5forge
  from t5forge.nn import adapters
  ckpt, dirs, _, base = setup
  other = t5forge.init("t5_1_1.tiny", vocab_size=base.config.vocab_size, seed=7)
  loaded, config, record = adapters.load(dirs["qv4"])
  path = str(tmp_path / "other")
  adapters.save(path, loaded, model_config=config,
                record={**record, "fingerprint": adapters.fingerprint(other.params)})
  line = _serve_error(ckpt, "--adapter", f"x={path}")
  assert "fingerprint" in line and adapters.fingerprint(base.params) in line


@pytest.mark.parametrize("scan", [False, True])
def test_stacked_rows_equal_each_merged_model(setup, scan):
  """In one batch, row r with adapter r gets the logits of adapter r's merged weights
  (fp32 within 1e-4), scanned layers or not; the base row is the base's."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from t5forge import models
  from t5forge.nn import adapters, lora, stack
  _, dirs, merged, base = setup
  items = []
  for name in ADAPTERS:
    tree, config, _ = adapters.load(dirs[name])
    items.append((lora.LoraConfig.from_dict(config["lora"]), tree))
  config, stacked = lora.stack(items)
  assert config.stacked == 3 and config.rank == 8
  params = adapters.join(stacked, jax.device_get(base.params))
  if scan:
    params = stack.stack_layers(params)
  model = models.model_for(dataclasses.replace(base.config, lora=config, scan_layers=scan))
  rng = np.random.default_rng(0)
  x = np.zeros((3, 12), np.int32)
  x[:, :8] = rng.integers(2, base.config.vocab_size, (3, 8))
  x[:, 8] = 1
  y = np.zeros((3, 6), np.int32)
  y[:, :5] = rng.integers(2, base.config.vocab_size, (3, 5))
  batch = {"encoder_input_tokens": x, "decoder_input_tokens": y, "decoder_target_tokens": y}

  def logits(params, ids):
    with lora.row_adapters(ids):
      return model.logits(params, batch)

  got = np.asarray(jax.jit(logits)(params, jnp.array([0, 1, 2], jnp.int32)))
  for r, name in enumerate(["tiny", *ADAPTERS]):
    want = np.asarray(base.model.logits(merged[name], batch))[r]
    np.testing.assert_allclose(got[r], want, atol=1e-4, rtol=0)
