"""`t5forge serve`'s POST /v1/embeddings against transformers' `T5EncoderModel`.

The checkpoint is a random T5 (gated-GELU, norms randomised) that transformers builds and
writes with save_pretrained, with the bundled SentencePiece model as its spiece.model;
the server reads those files, and transformers reads them again as the reference
(`T5EncoderModel`, `T5Tokenizer`). Embeddings are requested with the real `openai` client
(float and base64), several of different lengths at once, so that they share encoder
batches; `none` pooling is the encoder's last_hidden_state, and the Flux / SD3 convention
(ids padded to max_length, no attention mask) is T5EncoderModel run so. Bad input is a 400
naming the field. One server serves the module (a decoder-only one its own test).
"""
import base64
import shutil
import threading

import numpy as np
import openai
import pytest

from hf_reference import build_hf_dir
from t5forge import testing as sh

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

TEXTS = ["God is love.", "In the beginning God created the heaven and the earth.",
         "Amen.", "The Lord is my shepherd; I shall not want.", "Jesus wept.",
         "And God said, Let there be light: and there was light."]
MAX_LENGTH = 64  # the Flux / SD3 convention pads to 512; the largest bucket here
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = build_hf_dir("flan", str(tmp_path_factory.mktemp("embed_t5") / "hf"), seed=3,
                   vocab_size=8100)
  shutil.copy(sh.BUNDLED_VOCABULARY, f"{d}/spiece.model")
  return d


@pytest.fixture(scope="module")
def hf(hf_dir):
  """(transformers' T5EncoderModel, T5Tokenizer) of the same files."""
  import transformers
  return (transformers.T5EncoderModel.from_pretrained(hf_dir).eval(),
          transformers.T5Tokenizer.from_pretrained(hf_dir))


@pytest.fixture(scope="module")
def server(hf_dir):
  srv = sh.Server(hf_dir, "--max_batch_size", "8", "--batch_buckets", "1,8",
                  "--length_buckets", f"16,{MAX_LENGTH}", "--decode_buckets", "8",
                  "--warmup", "greedy,embed", "--max_wait_ms", "300", "--model_name", "tiny-t5",
                  "--max_prompt_tokens", "48")
  yield srv
  assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)


def _encode(model, ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
  """transformers' last_hidden_state [b, L, e] (float32 numpy)."""
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=None if mask is None else torch.tensor(mask, dtype=torch.long))
  return out.last_hidden_state.float().numpy()


def _masked_mean(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
  m = mask[..., None].astype(np.float64)
  return (hidden * m).sum(axis=1) / m.sum(axis=1)


def _metric(url: str, name: str) -> float:
  _, _, text = sh.request(url, "/metrics")
  return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_openai_client_mean_equals_transformers_while_sharing_batches(server, client, hf):
  model, tok = hf
  enc = tok(TEXTS, padding="longest", return_tensors="np")
  want = _masked_mean(_encode(model, enc.input_ids, enc.attention_mask), enc.attention_mask)
  batches_before = _metric(server.url, "t5forge_batch_size_count")
  got, errors = {}, []

  def one(i: int, fmt: str):
    try:
      if fmt == "float":
        r = client.embeddings.create(model="tiny-t5", input=TEXTS[i], encoding_format="float")
        got[i, fmt] = np.array(r.data[0].embedding)
      elif fmt == "base64":
        r = client.embeddings.create(model="tiny-t5", input=TEXTS[i], encoding_format="base64")
        got[i, fmt] = np.frombuffer(base64.b64decode(r.data[0].embedding), "<f4")
      else:  # the client's default: it asks for base64 and decodes it itself
        r = client.embeddings.create(model="tiny-t5", input=TEXTS[i])
        got[i, fmt] = np.array(r.data[0].embedding)
      assert r.object == "list" and r.model == "tiny-t5" and r.data[0].index == 0
      assert r.usage.prompt_tokens == r.usage.total_tokens == int(enc.attention_mask[i].sum())
    except Exception as e:
      errors.append(e)

  jobs = [(i, fmt) for fmt in ("float", "base64", "default") for i in range(len(TEXTS))]
  threads = [threading.Thread(target=one, args=job) for job in jobs]
  for t in threads:
    t.start()
  for t in threads:
    t.join(300)
  assert not errors, errors[:3]
  for (i, fmt), vec in got.items():
    assert vec.shape == (model.config.d_model,)
    np.testing.assert_allclose(vec, want[i], atol=TOL, rtol=0, err_msg=f"{TEXTS[i]} {fmt}")
  # 18 requests of 4 to 15 tokens shared encoder calls; nothing compiled after ready.
  batches = _metric(server.url, "t5forge_batch_size_count") - batches_before
  assert batches < len(jobs) / 2, batches
  _, _, health = sh.request(server.url, "/health")
  assert health["compiles_since_ready"] == 0 and health["slots_in_use"] == 0, health
  # A list: every input in one request, each pooled over its own tokens; normalized.
  r = client.embeddings.create(model="tiny-t5", input=TEXTS, encoding_format="float",
                               extra_body={"normalize": True})
  got = np.array([d.embedding for d in r.data])
  np.testing.assert_allclose(got, want / np.linalg.norm(want, axis=1, keepdims=True),
                             atol=TOL, rtol=0)
  assert [d.index for d in r.data] == list(range(len(TEXTS)))


def test_none_first_last_and_token_ids_equal_last_hidden_state(server, client, hf):
  model, tok = hf
  enc = tok(TEXTS[:3], padding="longest", return_tensors="np")
  hidden = _encode(model, enc.input_ids, enc.attention_mask)
  r = client.embeddings.create(model="tiny-t5", input=TEXTS[:3], encoding_format="float",
                               extra_body={"pooling": "none"})
  got = np.array([d.embedding for d in r.data])
  assert got.shape == hidden.shape  # [3, L, e]: padded to the longest, as the tokenizer
  np.testing.assert_allclose(got, hidden, atol=TOL, rtol=0)
  n = enc.attention_mask.sum(axis=1)
  for pooling, want in (("first", hidden[:, 0]), ("last", hidden[np.arange(3), n - 1])):
    r = client.embeddings.create(model="tiny-t5", input=TEXTS[:3], encoding_format="float",
                                 extra_body={"pooling": pooling})
    np.testing.assert_allclose([d.embedding for d in r.data], want, atol=TOL, rtol=0)
  # Token ids as given (no EOS added), one list or several; base64 of [L, e] is flat.
  ids = [[5, 300, 8099, 0, 17], [42, 1]]
  r = client.embeddings.create(model="tiny-t5", input=ids, encoding_format="base64",
                               extra_body={"pooling": "none"})
  e = model.config.d_model
  for row, d in zip(ids, r.data):
    want = _encode(model, np.array([row]), np.ones((1, len(row))))[0]
    vec = np.frombuffer(base64.b64decode(d.embedding), "<f4").reshape(-1, e)
    np.testing.assert_allclose(vec[:len(row)], want, atol=TOL, rtol=0)
  r = client.embeddings.create(model="tiny-t5", input=ids[0], encoding_format="float")
  want = _encode(model, np.array([ids[0]]), np.ones((1, 5)))[0].mean(axis=0)
  np.testing.assert_allclose(r.data[0].embedding, want, atol=TOL, rtol=0)
  assert len(r.data) == 1 and r.usage.prompt_tokens == 5


def test_flux_convention_equals_unmasked_encoder_on_max_length_ids(server, client, hf):
  """Flux's text_encoder_2 and SD3: ids padded to max_length, run without a mask."""
  model, tok = hf
  enc = tok(TEXTS[:2], padding="max_length", max_length=MAX_LENGTH, return_tensors="np")
  want = _encode(model, enc.input_ids, None)
  body = {"pooling": "none", "padding": "max_length", "max_length": MAX_LENGTH,
          "attend_to_padding": True}
  r = client.embeddings.create(model="tiny-t5", input=TEXTS[:2], encoding_format="base64",
                               extra_body={**body, "embed_dtype": "float32"})
  got = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4").reshape(MAX_LENGTH, -1)
                  for d in r.data])
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  # The mask matters: with it every position differs (and equals the masked encoder).
  masked = client.embeddings.create(
      model="tiny-t5", input=TEXTS[:2], encoding_format="float",
      extra_body={**body, "attend_to_padding": False})
  masked = np.array([d.embedding for d in masked.data])
  np.testing.assert_allclose(masked, _encode(model, enc.input_ids, enc.attention_mask),
                             atol=TOL, rtol=0)
  assert np.abs(masked - got).max(axis=-1).min() > 1e-3
  # float16 / bfloat16 bytes: the float32 vector rounded (to 11 and 8 significant bits).
  import ml_dtypes
  for dtype, np_dtype, bits in (("float16", np.float16, 11), ("bfloat16", ml_dtypes.bfloat16, 8)):
    r = client.embeddings.create(model="tiny-t5", input=TEXTS[0], encoding_format="base64",
                                 extra_body={**body, "embed_dtype": dtype})
    half = np.frombuffer(base64.b64decode(r.data[0].embedding), np_dtype)
    assert half.shape == (got[0].size,)
    np.testing.assert_allclose(half.astype(np.float32), got[0].reshape(-1), rtol=2.0 ** -bits,
                               atol=TOL)


BAD = [  # (what, body, param)
    ("pooling unknown", {"input": "x", "pooling": "max"}, "pooling"),
    ("encoding_format unknown", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("embed_dtype unknown", {"input": "x", "encoding_format": "base64", "embed_dtype": "fp8"},
     "embed_dtype"),
    ("embed_dtype with floats", {"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
    ("dimensions", {"input": "x", "dimensions": 16}, "dimensions"),
    ("empty list", {"input": []}, "input"),
    ("empty string", {"input": ""}, "input"),
    ("empty string in a list", {"input": ["a", " "]}, "input[1]"),
    ("empty token list", {"input": [[3], []]}, "input[1]"),
    ("id over the vocabulary", {"input": [[3, 4], [5, 8100]]}, "input[1][1]"),
    ("negative id", {"input": [7, -1]}, "input[1]"),
    ("too long", {"input": " ".join(["light"] * 80)}, "input"),
    ("token ids too long", {"input": [[5] * 49]}, "input[0]"),
    ("longer than max_length", {"input": ["a b c d e f g h", "a"], "padding": "max_length",
                                "max_length": 4}, "input[0]"),
    ("max_length with longest", {"input": "x", "max_length": 8}, "max_length"),
    ("max_length missing", {"input": "x", "padding": "max_length"}, "max_length"),
    ("max_length over the buckets", {"input": "x", "padding": "max_length",
                                     "max_length": 65}, "max_length"),
    ("padding unknown", {"input": "x", "padding": "right"}, "padding"),
    ("normalize not a bool", {"input": "x", "normalize": "yes"}, "normalize"),
    ("attend_to_padding not a bool", {"input": "x", "attend_to_padding": 1}, "attend_to_padding"),
    ("input a number", {"input": 5}, "input"),
    ("mixed list", {"input": ["a", 5]}, "input[1]"),
    ("float token", {"input": [[1, 2.5]]}, "input[0][1]"),
    ("lone surrogate", {"input": "\ud800"}, "input"),
    ("unknown field", {"input": "x", "truncate": True}, "truncate"),
    ("missing input", {"pooling": "mean"}, "input"),
    ("other model", {"input": "x", "model": "gpt-4"}, "model"),
]


@pytest.mark.parametrize("what,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_naming_the_field(server, what, body, param):
  status, _, got = sh.request(server.url, "/v1/embeddings", body)
  assert 400 <= status < 500, (status, got)
  assert got["error"]["param"] == param, got
  assert "\n" not in got["error"]["message"] and got["error"]["message"], got
  status, _, got = sh.request(server.url, "/v1/embeddings", {"input": "God is love."})
  assert status == 200 and len(got["data"][0]["embedding"]) == 32, got


def test_decoder_only_model_is_a_400(tmp_path):
  ckpt = sh.checkpoint_with_vocabulary(str(tmp_path / "dec"), "decoder_only.tiny", seed=1)
  with sh.Server(ckpt, "--max_batch_size", "1", "--batch_buckets", "1", "--length_buckets",
                 "8", "--decode_buckets", "4", "--warmup", "embed") as srv:
    status, _, got = sh.request(srv.url, "/v1/embeddings", {"input": "God is love."})
    assert srv.ready_line and "0 shapes compiled" in srv.ready_line, srv.ready_line
  assert status == 400 and got["error"]["param"] == "model", got
  assert "need an encoder" in got["error"]["message"], got
