"""`t5forge serve`'s POST /v1/embeddings of a T5Gemma checkpoint against transformers'
T5Gemma encoder (the encoder diffusers' PRX pipeline uses).

The checkpoint is tests/hf_t5gemma_reference.py's random 'mha' T5Gemma (sliding window
6, below the inputs' lengths) written by save_pretrained, with a SentencePiece
tokenizer.model of Gemma's id layout; transformers loads the same files as the
reference. Text is tokenized as the completion route does (pieces + EOS), which the test
checks against the sentencepiece library. One server serves the module.
"""
import base64
import threading

import numpy as np
import openai
import pytest

from hf_t5gemma_reference import (EOS, build_hf_dir, write_sentencepiece,
                                  write_tokenizer_config)
from t5forge import testing as sh

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

TEXTS = ["In the beginning God created the heaven and the earth.", "Jesus wept.",
         "And God said, Let there be light: and there was light.", "Amen."]
MAX_LENGTH = 32
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = build_hf_dir("mha", str(tmp_path_factory.mktemp("embed_t5gemma") / "hf"), seed=5)
  write_sentencepiece(f"{d}/tokenizer.model", 256)
  write_tokenizer_config(d)
  return d


@pytest.fixture(scope="module")
def hf(hf_dir):
  """(transformers' T5Gemma encoder, the pieces + EOS of a text by sentencepiece)."""
  import sentencepiece as spm
  import transformers
  model = transformers.T5GemmaForConditionalGeneration.from_pretrained(hf_dir).eval()
  sp = spm.SentencePieceProcessor(model_file=f"{hf_dir}/tokenizer.model")
  return model.get_encoder(), lambda text: sp.encode(text) + [EOS]


@pytest.fixture(scope="module")
def server(hf_dir):
  srv = sh.Server(hf_dir, "--max_batch_size", "4", "--batch_buckets", "1,4",
                  "--length_buckets", f"16,{MAX_LENGTH}", "--decode_buckets", "8",
                  "--warmup", "greedy,embed", "--max_wait_ms", "300",
                  "--model_name", "tiny-t5gemma")
  yield srv
  assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)


def _encode(encoder, ids, mask=None) -> np.ndarray:
  """transformers' last_hidden_state [b, L, e] (float32 numpy); no mask: ids != pad."""
  import torch
  with torch.no_grad():
    out = encoder(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
                  attention_mask=None if mask is None else torch.tensor(mask, dtype=torch.long))
  return out.last_hidden_state.float().numpy()


def test_mean_and_none_equal_the_t5gemma_encoder(server, client, hf):
  encoder, tokenize = hf
  ids = [tokenize(t) for t in TEXTS]
  assert max(len(x) for x in ids) > 6 * 2  # past the sliding window
  hidden = [_encode(encoder, [x])[0] for x in ids]  # each alone: no padding to mask
  got, errors = {}, []

  def one(i: int, fmt: str):
    try:
      r = client.embeddings.create(model="tiny-t5gemma", input=TEXTS[i], encoding_format=fmt)
      e = r.data[0].embedding
      got[i, fmt] = (np.array(e) if fmt == "float"
                     else np.frombuffer(base64.b64decode(e), "<f4"))
      assert r.usage.prompt_tokens == len(ids[i])
    except Exception as e:
      errors.append(e)

  threads = [threading.Thread(target=one, args=(i, fmt)) for fmt in ("float", "base64")
             for i in range(len(TEXTS))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(300)
  assert not errors, errors[:3]
  for (i, fmt), vec in got.items():
    np.testing.assert_allclose(vec, hidden[i].mean(axis=0), atol=TOL, rtol=0,
                               err_msg=f"{TEXTS[i]} {fmt}")
  # One request of all four, padded to the longest: each is pooled over its own tokens.
  r = client.embeddings.create(model="tiny-t5gemma", input=TEXTS, encoding_format="float")
  np.testing.assert_allclose([d.embedding for d in r.data], [h.mean(axis=0) for h in hidden],
                             atol=TOL, rtol=0)
  # none: the last hidden state, from text and from token ids.
  for i in (0, 1):
    for x in (TEXTS[i], ids[i]):
      r = client.embeddings.create(model="tiny-t5gemma", input=x, encoding_format="float",
                                   extra_body={"pooling": "none"})
      np.testing.assert_allclose(r.data[0].embedding, hidden[i], atol=TOL, rtol=0)
  _, _, health = sh.request(server.url, "/health")
  assert health["compiles_since_ready"] == 0, health


def test_padded_ids_without_a_mask_equal_the_unmasked_encoder(client, hf):
  encoder, tokenize = hf
  padded = np.zeros((2, MAX_LENGTH), np.int64)
  for row, text in enumerate(TEXTS[:2]):
    ids = tokenize(text)
    padded[row, :len(ids)] = ids
  # (transformers' T5Gemma masks pad ids when given no mask: an all-ones one attends them.)
  want = _encode(encoder, padded, np.ones_like(padded))
  r = client.embeddings.create(model="tiny-t5gemma", input=TEXTS[:2], encoding_format="float",
                               extra_body={"pooling": "none", "padding": "max_length",
                                           "max_length": MAX_LENGTH, "attend_to_padding": True})
  got = np.array([d.embedding for d in r.data])
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
