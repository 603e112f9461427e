"""What other clients send to `t5forge serve` works: `ignore_eos` and `min_tokens` decode
what transformers' `generate` decodes on the same weights (an HF directory written by
`save_pretrained`, served as it is); the payloads of `vllm bench serve --backend openai`
and LiteLLM get 200; token-id prompts through the `openai` client; streamed logprobs
join to the unstreamed ones; neutral values of the fields we do not implement pass,
others are 400s naming the field; NaN, a body nested 100,000 deep and a lone surrogate
are 400s naming the field; /livez answers while compiling, /readyz once ready. One
server serves the module."""
import json
import time

import numpy as np
import openai
import pytest
import torch
import transformers

import t5forge
from t5forge import testing as sh

pytestmark = pytest.mark.slow  # servers in subprocesses: make test, not test-fast

VOCAB = 8100  # the model's embedding rows: the bundled vocabulary with 100 sentinels
PIECES = 8000  # the ids `--vocabulary spiece.model` knows (its pieces, no sentinels)
MAX = 16      # --decode_buckets: the most new tokens


def _generate(model, ids, **kw):
  """transformers' greedy `generate` of one prompt -> its new tokens (list)."""
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor([ids]), do_sample=False, num_beams=1,
                         decoder_start_token_id=0, pad_token_id=0, **kw)
  return out[0, 1:].tolist()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random-init T5 (tied, gated-gelu) over the bundled vocabulary whose EOS is 1.3 x
  the token greedy decoding picks most, so that rows end at many lengths (and min_tokens /
  ignore_eos change the output), written by `save_pretrained`. Weights are scaled up
  from transformers' init, whose tiny models repeat one token."""
  path = str(tmp_path_factory.mktemp("serve_compat") / "hf")
  torch.manual_seed(4)
  cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, num_heads=4, d_ff=64,
                              num_layers=2, num_decoder_layers=2, feed_forward_proj="gated-gelu",
                              decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
  model = transformers.T5ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "relative_attention_bias" in name:
        p.copy_(torch.randn_like(p))
      elif "shared" not in name:
        p.copy_(torch.randn_like(p) * 2.0 / p.shape[-1] ** 0.5)
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(8):
      seen += _generate(model, rng.integers(2, VOCAB, 10).tolist() + [1], max_new_tokens=MAX)
    common = np.bincount(seen, minlength=VOCAB)
    common[:2] = 0
    model.shared.weight[1] = model.shared.weight[int(common.argmax())] * 1.3
  model.save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def server(hf_dir):
  """The HF directory served on the engine; /livez and /readyz are read while it compiles."""
  srv = sh.Server(hf_dir, "--vocabulary", sh.BUNDLED_VOCABULARY, "--slots", "4",
                  "--max_batch_size", "4", "--batch_buckets", "1,4", "--length_buckets", "32",
                  "--decode_buckets", str(MAX), "--warmup", "greedy", "--model_name", "tiny",
                  wait=False)
  try:
    srv.early = None
    for _ in range(2000):  # the first answer of /livez, and /readyz at that moment
      if srv.proc.poll() is not None:
        break
      try:
        live = sh.request(srv.url, "/livez", timeout=5)
      except OSError:  # not listening yet
        time.sleep(0.05)
        continue
      srv.early = (live[0], live[2], sh.request(srv.url, "/readyz")[0], srv.ready_line)
      break
    srv.wait_ready()
    yield srv
  finally:
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _post(server, body, **kw):
  return sh.request(server.url, "/v1/completions", body, **kw)


def _events(server, body) -> list[dict]:
  """A streamed completion's parsed `data:` events (without [DONE], which must end it)."""
  status, _, text = _post(server, body)
  assert status == 200, text
  lines = [ln.removeprefix("data: ") for ln in text.split("\n") if ln.startswith("data: ")]
  assert lines[-1] == "[DONE]"
  return [json.loads(x) for x in lines[:-1]]


def test_ignore_eos_and_min_tokens_equal_transformers(server, hf_dir):
  hf = transformers.T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
  vocab = sh.bundled_vocabulary()
  rng = np.random.default_rng(7)
  # ignore_eos: transformers with no EOS at all (it fills an unset eos_token_id from the
  # model's configs, so both lose theirs).
  free = transformers.T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
  free.generation_config.eos_token_id = free.config.eos_token_id = None
  ended_early = changed = 0
  for i in range(16):
    ids = rng.integers(2, PIECES, int(rng.integers(4, 20))).tolist()
    plain = _generate(hf, ids + [1], max_new_tokens=MAX)
    ended_early += 1 in plain[:-1] or len(plain) < MAX
    if i % 2:
      n = int(rng.integers(2, MAX + 1))
      want = _generate(free, ids + [1], max_new_tokens=n, eos_token_id=None)
      assert len(want) == n
      body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    else:
      m = int(rng.integers(1, MAX))
      want = _generate(hf, ids + [1], max_new_tokens=MAX, min_new_tokens=m)
      want = want[:want.index(1) + 1] if 1 in want else want
      assert len(want) >= m
      body = {"prompt": ids, "max_tokens": MAX, "temperature": 0, "min_tokens": m}
    changed += want != plain[:len(want)]
    status, _, got = _post(server, body)
    assert status == 200, got
    assert got["usage"]["completion_tokens"] == len(want), (body, want)
    assert got["choices"][0]["text"] == vocab.decode([t for t in want if t != 1]), (body, want)
    assert got["choices"][0]["finish_reason"] == ("stop" if want[-1] == 1 and not i % 2
                                                  else "length")
  assert ended_early >= 4 and changed >= 4, (ended_early, changed)  # the options mattered
  assert sh.request(server.url, "/health")[2]["compiles_since_ready"] == 0


VLLM_BENCH = {  # vLLM benchmarks/backend_request_func.py, async_request_openai_completions
    "model": "tiny", "prompt": "In the beginning God created", "temperature": 0.0,
    "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None, "stream": True,
    "stream_options": {"include_usage": True}, "ignore_eos": True}
LITELLM = {  # LiteLLM's text-completion call (docs: /completions), and OpenAI's defaults
    "model": "tiny", "prompt": "Say this is a test", "max_tokens": 7}
LITELLM_FULL = {
    **LITELLM, "temperature": 1.0, "top_p": 1.0, "n": 1, "stream": False, "echo": False,
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
    "suffix": None, "user": "litellm-user", "stop": None, "seed": 3}


def test_vllm_bench_and_litellm_payloads(server):
  events = _events(server, VLLM_BENCH)
  *chunks, last = events
  assert last["choices"] == [] and all(c["usage"] is None for c in chunks)
  assert last["usage"]["completion_tokens"] == VLLM_BENCH["max_tokens"]
  assert last["usage"]["prompt_tokens"] > 0
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  for body in (LITELLM, LITELLM_FULL, {**LITELLM, "stream": True,
                                       "stream_options": {"include_usage": True}}):
    status, _, got = _post(server, body)
    assert status == 200, (body, got)
  # Without include_usage, no usage chunk (and no usage key).
  assert all("usage" not in e for e in _events(server, {**VLLM_BENCH, "stream_options": None}))


def test_token_id_prompts_through_the_openai_client(server, client):
  text = "The Lord is my shepherd"
  ids = sh.bundled_vocabulary().encode(text)
  by_text = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0)
  one = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
  with_eos = client.completions.create(model="tiny", prompt=ids + [1], max_tokens=8,
                                       temperature=0)
  two = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=8,
                                  temperature=0)
  want = by_text.choices[0].text
  assert one.choices[0].text == with_eos.choices[0].text == two.choices[0].text == want
  assert one.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids) + 1
  assert len(two.choices) == 2
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt=[ids, [5, PIECES]], max_tokens=4)
  assert e.value.body["param"] == "prompt[1][1]" and str(PIECES) in e.value.body["message"]
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt=[3, -1], max_tokens=4)
  assert e.value.body["param"] == "prompt[1]"
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="tiny", prompt=[ids, []], max_tokens=4)
  assert e.value.body["param"] == "prompt[1]"


@pytest.mark.parametrize("extra", [{}, {"stop": [" "]}, {"n": 2, "temperature": 0.9,
                                                          "seed": 5}])
def test_streamed_logprobs_join_to_the_unstreamed(server, extra):
  body = {"prompt": ["In the beginning", "Jesus wept."], "max_tokens": MAX, "temperature": 0,
          "logprobs": 3, **extra}
  status, _, whole = _post(server, body)
  assert status == 200, whole
  joined: dict[int, dict] = {}
  pieces = 0  # chunks that carry tokens: the logprobs arrive as decoding runs
  for e in _events(server, {**body, "stream": True}):
    for c in e["choices"]:
      pieces += bool(c["logprobs"] and c["logprobs"]["tokens"])
      j = joined.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [],
                                         "top_logprobs": [], "text_offset": []})
      j["text"] += c["text"]
      for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        j[k] += (c["logprobs"] or {}).get(k) or []
  assert sorted(joined) == list(range(len(whole["choices"])))
  for c in whole["choices"]:
    j, lp = joined[c["index"]], c["logprobs"]
    assert j["text"] == c["text"]
    assert j["tokens"] == lp["tokens"] and j["text_offset"] == lp["text_offset"]
    np.testing.assert_allclose(j["token_logprobs"], lp["token_logprobs"], atol=1e-6)
    assert [list(t) for t in j["top_logprobs"]] == [list(t) for t in lp["top_logprobs"]]
    np.testing.assert_allclose([v for t in j["top_logprobs"] for v in t.values()],
                               [v for t in lp["top_logprobs"] for v in t.values()], atol=1e-6)
    assert len(lp["tokens"]) > 0
  if "stop" not in extra:  # (a stop sequence cuts these texts after a token or two)
    assert pieces > len(whole["choices"])


GOOD = {"prompt": "God is love.", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "God is love.", "temperature": NaN}', "temperature"),
    (b'{"prompt": "God is love.", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "God is love.", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "God", "stop": ["a", -Infinity]}', "stop[1]"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "prompt"),
    (b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "prompt"),
    (b'{"prompt": "God \\ud800 is love."}', "prompt"),
    (b'{"prompt": ["fine", "lone \\udfff"]}', "prompt[1]"),
])
def test_the_three_500s_are_400s_naming_the_field(server, raw, param):
  status, _, body = _post(server, None, raw=raw)
  assert status == 400, body
  assert body["error"]["param"] == param, body
  assert "\n" not in body["error"]["message"]
  assert _post(server, GOOD)[0] == 200


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1.0), ("best_of", 1), ("presence_penalty", 0),
    ("frequency_penalty", 0), ("logit_bias", {}), ("logit_bias", None), ("suffix", None),
    ("echo", False), ("user", "someone"), ("min_tokens", 0), ("ignore_eos", False)])
def test_neutral_values_pass(server, field, value):
  status, _, body = _post(server, {**GOOD, field: value})
  assert status == 200, body


@pytest.mark.parametrize("extra, param", [
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"), ({"logit_bias": {"5": -100}}, "logit_bias"),
    ({"suffix": "and then"}, "suffix"), ({"echo": True}, "echo"),
    ({"min_tokens": 5}, "min_tokens"),  # over max_tokens=4
    ({"min_tokens": -1}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"num_beams": 2, "ignore_eos": True}, "ignore_eos"),
    ({"num_beams": 2, "min_tokens": 2}, "min_tokens"),
])
def test_unsupported_values_are_400s_naming_the_field(server, extra, param):
  status, _, body = _post(server, {**GOOD, **extra})
  assert status == 400, body
  assert body["error"]["param"] == param, body
  assert param.split(".")[0] in body["error"]["message"]


def test_health_routes_models_and_version(server):
  live_status, live_body, ready_status, ready_line = server.early
  assert live_status == 200 and live_body == {"status": "alive"}
  assert ready_line is None and ready_status == 503  # read while it was still compiling
  assert sh.request(server.url, "/readyz")[0] == 200
  assert sh.request(server.url, "/health")[2]["status"] == "ok"
  assert sh.request(server.url, "/version")[2] == {"version": t5forge.__version__}
  model = sh.request(server.url, "/v1/models")[2]["data"][0]
  assert (model["max_input_tokens"], model["max_output_tokens"], model["max_model_len"]) == (
      32, MAX, 32)
