"""`t5forge serve` speaks OpenAI's chat completions with the checkpoint's own chat template:
for a tiny T5 and a tiny T5Gemma written as Hugging Face directories whose
tokenizer_config.json carries Gemma's template, the encoder ids of 20 message lists
(/tokenize) equal transformers' `AutoTokenizer.apply_chat_template`; the real `openai`
client's chat answers (streamed and not) equal t5forge's greedy decode of those ids, cut
at T5Gemma's <end_of_turn>, which never shows; /detokenize inverts; and each bad input is
a 400 naming the field. One server per checkpoint serves the module."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import openai
import pytest

import t5forge
from t5forge import testing as sh

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

# Gemma's chat template, as google/gemma-2-2b-it's tokenizer_config.json has it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}"
    "{% endif %}")
MAX_TOKENS = 8
VOCAB = 512  # the T5Gemma's vocabulary
END_OF_TURN = 5
FLAGS = ["--max_batch_size", "4", "--batch_buckets", "1,4", "--length_buckets", "256",
         "--decode_buckets", "8", "--warmup", "greedy"]
TEXTS = ["God is love.", "In the beginning God created the heavens and the earth.",
         "¿Quién es?", "  Jesus wept.  ", "The Lord is my shepherd;\nI shall not want.",
         "Amen. <extra_id_0> and <pad> or <eos>", "tabs\tand   spaces", "¡Hola! ¿Qué tal?",
         "<start_of_turn>user\nnested<end_of_turn>", "1 2 3 4 5 6 7 8 9 10"]


def message_lists() -> list[list[dict]]:
  """20 conversations: one to five alternating turns over TEXTS, string or part content."""
  out = []
  for k in range(20):
    turns = 1 + 2 * (k % 3) if k % 4 else 2 + 2 * (k % 2)
    msgs = []
    for t in range(turns):
      text = TEXTS[(k + 3 * t) % len(TEXTS)]
      msgs.append({"role": "user" if t % 2 == 0 else "assistant", "content": text})
    if msgs[-1]["role"] == "assistant":
      msgs.append({"role": "user", "content": TEXTS[k % len(TEXTS)]})
    out.append(msgs)
  return out


def _add_template(d: str) -> str:
  path = os.path.join(d, "tokenizer_config.json")
  with open(path, encoding="utf-8") as f:
    cfg = json.load(f)
  cfg["chat_template"] = GEMMA_TEMPLATE
  with open(path, "w", encoding="utf-8") as f:
    json.dump(cfg, f, indent=2)
  return d


def _gemma_vocabulary(path: str):
  """A 512-piece SentencePiece model made as Gemma's is (BPE, byte fallback, no
  normalization, no dummy prefix, split digits; pad 0, eos 1, bos 2, unk 3) with Gemma's
  turn marks as user-defined pieces 4 and 5 and a newline piece."""
  import gzip

  import sentencepiece as spm

  from t5forge.data.vocab import SentencePieceVocabulary
  with gzip.open(os.path.join(os.path.dirname(sh.BUNDLED_VOCABULARY),
                              "english_web_bible.txt.gz"), "rt", encoding="utf-8") as f:
    lines = [line.strip() for _, line in zip(range(2000), f) if line.strip()]
  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=buf, vocab_size=VOCAB, model_type="bpe",
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
      bos_piece="<bos>", unk_piece="<unk>",
      user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "\n"], byte_fallback=True,
      normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True,
      num_threads=1, minloglevel=2, hard_vocab_limit=True)
  with open(path, "wb") as f:
    f.write(buf.getvalue())
  vocab = SentencePieceVocabulary(path)
  assert vocab.processor.piece_to_id("<end_of_turn>") == END_OF_TURN
  return vocab




def _t5gemma_dir(d: str) -> str:
  """A random t5gemma.tiny that declares <end_of_turn> a stop id, whose logit for it nearly
  copies the token its greedy decodes pick most (so answers end with it, as an -it model's
  do), written as an HF directory with Gemma's tokenizer files and chat template."""
  os.makedirs(d, exist_ok=True)
  vocab = _gemma_vocabulary(os.path.join(d, "source.model"))
  m = t5forge.init("t5gemma.tiny", vocabulary=vocab, vocab_size=VOCAB, seed=3,
                   eos_token_ids=(1, END_OF_TURN))
  x = np.zeros((4, 16), np.int32)
  x[:, :8] = np.random.default_rng(0).integers(7, VOCAB, (4, 8))
  tokens, _ = m.predict(x, max_decode_length=8)
  counts = np.bincount(tokens[:, 1:].ravel(), minlength=VOCAB)
  counts[:7] = 0
  params, frequent = m.params, int(counts.argmax())
  dec = params["decoder"]
  if "logits_dense" in dec:
    kernel = dec["logits_dense"]["kernel"]
    kernel = kernel.at[:, END_OF_TURN].set(kernel[:, frequent] * 1.01)
    m.params = {**params, "decoder": {**dec, "logits_dense": {"kernel": kernel}}}
  else:
    owner = dec if "token_embedder" in dec else params
    table = owner["token_embedder"]["embedding"]
    table = table.at[END_OF_TURN].set(table[frequent] * 1.01)
    owner = {**owner, "token_embedder": {"embedding": table}}
    m.params = ({**params, "decoder": owner} if "token_embedder" in dec
                else {**params, "token_embedder": owner["token_embedder"]})
  out = os.path.join(d, "hf")
  m.save_hf(out)
  return _add_template(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("serve_chat")
  vocab = sh.bundled_vocabulary()
  t5 = str(root / "t5")
  t5forge.init("t5_1_1.tiny", vocabulary=vocab, vocab_size=vocab.vocab_size, seed=1).save_hf(t5)
  return {"t5": _add_template(t5), "t5gemma": _t5gemma_dir(str(root / "t5gemma"))}


@pytest.fixture(scope="module", params=["t5", "t5gemma"])
def served(request, dirs):
  d = dirs[request.param]
  srv = sh.Server(d, *FLAGS, "--model_name", request.param)
  try:
    yield request.param, d, srv
  finally:
    assert srv.stop() == 0, srv.output()[-3000:]


def _post(srv, path, body):
  return sh.request(srv.url, path, body)


def test_tokenize_equals_transformers_apply_chat_template(served):
  name, d, srv = served
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(d)
  for msgs in message_lists():
    status, _, got = _post(srv, "/tokenize", {"model": name, "messages": msgs})
    assert status == 200, got
    want = tok.apply_chat_template(msgs, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert got["tokens"] == want, msgs
    assert got["count"] == len(want) and got["max_input_tokens"] == 256
  if name == "t5gemma":  # the turn marks are single ids, BOS comes from the template
    assert want[0] == 2 and want.count(END_OF_TURN) == len(msgs)
  # The prompt form is what /v1/completions encodes: pieces + EOS; /detokenize inverts it.
  status, _, got = _post(srv, "/tokenize", {"model": name, "prompt": "God is love."})
  assert status == 200 and got["tokens"][-1] == 1, got
  assert got["tokens"][:-1] == tok("God is love.", add_special_tokens=False)["input_ids"]
  status, _, back = _post(srv, "/detokenize", {"model": name, "tokens": got["tokens"]})
  assert status == 200 and back == {"prompt": "God is love."}


_LOADED = {}


def _greedy_answer(d: str, ids: list[int]) -> tuple[str, bool]:
  """t5forge's own greedy decode of the encoder ids, cut at the first stop id; -> (text,
  whether a stop id ended it)."""
  if d not in _LOADED:
    _LOADED[d] = t5forge.load(d)
  m = _LOADED[d]
  tokens, _ = m.predict(np.asarray([ids], np.int32), max_decode_length=MAX_TOKENS)
  row = [int(t) for t in tokens[0]]
  stops = set(m.config.eos_token_ids or ()) | {1}
  cut = next((i for i, t in enumerate(row) if t in stops), None)
  return m.vocabulary.decode(row if cut is None else row[:cut]), cut is not None


def test_openai_chat_equals_greedy_decode_of_the_ids(served):
  name, d, srv = served
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="not-needed", max_retries=0)
  ended = 0
  for msgs in message_lists()[:4]:
    ids = _post(srv, "/tokenize", {"messages": msgs})[2]["tokens"]
    want, stopped = _greedy_answer(d, ids)
    ended += stopped
    got = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert got.object == "chat.completion" and got.model == name
    c = got.choices[0]
    assert c.message.role == "assistant" and c.message.content == want
    assert c.finish_reason == ("stop" if stopped else "length")
    assert got.usage.prompt_tokens == len(ids)
    assert "<end_of_turn>" not in c.message.content
    # top_k (vLLM's extension) is applied: top_k=1 sampling is greedy.
    k1 = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_TOKENS,
                                        temperature=1.0, seed=5, extra_body={"top_k": 1})
    assert k1.choices[0].message.content == want
    pieces, reasons, roles, usage = [], [], [], None
    for chunk in client.chat.completions.create(
        model=name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}):
      assert chunk.object == "chat.completion.chunk"
      if not chunk.choices:
        usage = chunk.usage
        continue
      roles.append(chunk.choices[0].delta.role)
      pieces.append(chunk.choices[0].delta.content or "")
      reasons.append(chunk.choices[0].finish_reason)
    assert roles[0] == "assistant" and "".join(pieces) == want
    assert reasons[-1] == c.finish_reason and set(reasons[:-1]) == {None}
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == (
        got.usage.completion_tokens)
  if name == "t5gemma":
    assert ended, "no answer ended with <end_of_turn>: the stop id was not exercised"


BAD = [  # (body, status, param)
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ""}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, 400,
     "messages[0].tool_calls"),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400,
     "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")}, 400,
     "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options":
      {"include_usage": True}}, 400, "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 5000}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "other"}, 404, "model"),
]


def test_bad_chat_requests_name_the_field(served):
  _, _, srv = served
  for body, status, param in BAD:
    got_status, _, got = _post(srv, "/v1/chat/completions", body)
    assert (got_status, got["error"]["param"]) == (status, param), (body, got)
    assert "\n" not in got["error"]["message"]
  status, _, got = _post(srv, "/v1/chat/completions", {
      "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
  assert "System role not supported" in got["error"]["message"]
  deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
  status, _, got = sh.request(srv.url, "/v1/chat/completions", raw=deep)
  assert (status, got["error"]["param"]) == (400, "messages"), got  # the field it nests in
  for body, param in (({"tokens": [5, 10 ** 6]}, "tokens[1]"), ({"tokens": [-1]}, "tokens[0]"),
                      ({"tokens": ["a"]}, "tokens[0]")):
    status, _, got = _post(srv, "/detokenize", body)
    assert (status, got["error"]["param"]) == (400, param), got
  for body, param in (({}, "prompt"), ({"prompt": "a", "messages": []}, "messages"),
                      ({"prompt": "\ud800"}, "prompt"),
                      ({"messages": [{"role": "user"}]}, "messages[0].content")):
    status, _, got = _post(srv, "/tokenize", body)
    assert (status, got["error"]["param"]) == (400, param), got


def test_no_template_is_a_400_that_says_how(tmp_path):
  """A checkpoint without a template: chat is a 400 naming --chat_template; given one,
  the same server chats."""
  ckpt = sh.tiny_checkpoint(str(tmp_path / "tiny"))
  with sh.Server(ckpt, *FLAGS) as srv:
    status, _, got = _post(srv, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}]})
    assert (status, got["error"]["param"]) == (400, "messages")
    assert "--chat_template" in got["error"]["message"]
  template = tmp_path / "chat.jinja"
  template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}", encoding="utf-8")
  with sh.Server(ckpt, *FLAGS, "--chat_template", str(template)) as srv:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    status, _, got = _post(srv, "/tokenize", {"messages": msgs})
    assert status == 200
    vocab = sh.bundled_vocabulary()
    assert got["tokens"] == vocab.encode("system: Be brief.\nuser: hi\nassistant:")
    status, _, got = _post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3})
    assert status == 200 and got["choices"][0]["message"]["role"] == "assistant"
  # A --chat_template that is not there: one line, before the model loads.
  r = subprocess.run([sys.executable, "-m", "t5forge", "serve", "--checkpoint", ckpt,
                      "--chat_template", str(tmp_path / "missing.jinja")],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and r.stderr.strip().splitlines() == [
      f"t5forge: error: --chat_template {tmp_path / 'missing.jinja'}: no such file; give a "
      "Jinja chat template file such as a model's chat_template.jinja"], r.stderr
