"""Request bodies that no route can use are found where `api.parse` reads them, each
naming its field: non-finite numbers, nesting too deep (even too deep for Python's json),
lone surrogates in values and keys; and the decode controls are refused by name where
they cannot run (beam search, --scheduler static). No server: pure functions."""
import pytest

from t5forge.serve import api, body, compat


def _param(raw: bytes) -> str:
  with pytest.raises(api.ApiError) as e:
    api.parse(api.CompletionRequest, raw, "application/json")
  assert e.value.status == 400
  return e.value.param


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": -Infinity}', "temperature"),
    (b'{"prompt": "x", "top_p": 1e400}', "top_p"),
    (b'{"prompt": ["a", "b\\ud83d"]}', "prompt[1]"),
    (b'{"prompt": "x", "logit_bias": {"\\udc00": 1}}', "logit_bias"),
    (b'{"prompt": "x", "stop": ' + b"[" * 33 + b"]" * 33 + b"}", "stop"),
    (b'{"prompt": "x", "stop": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "stop"),
    (b"[" * 100_000 + b"]" * 100_000, "body"),
])
def test_unusable_bodies_name_their_field(raw, param):
  assert _param(raw) == param


def test_usable_bodies_pass():
  # A surrogate pair is valid Unicode; 32 levels and finite floats are fine.
  data = body.loads(b'{"a": "\\ud83d\\ude00", "b": 1.5e300, "c": ' + b"[" * 31 + b"]" * 31
                    + b"}")
  assert data["a"] == "\U0001F600" and data["b"] == 1.5e300
  req = api.parse(api.CompletionRequest, b'{"prompt": [[5, 6], [7]], "max_tokens": 3}',
                  "application/json")
  assert api.prompt_list(req.prompt) == [[5, 6], [7]]
  assert api.prompt_list([5, 6]) == [[5, 6]] and api.prompt_param([5, 6], 0) == "prompt"


def test_top_k_with_top_p_passes():
  # OpenAI-style clients and vLLM send both; top-p then applies to top-k's tokens.
  req = api.parse(api.CompletionRequest, b'{"prompt": "x", "top_k": 40, "top_p": 0.9}',
                  "application/json")
  api.check_completion(req, api.Limits())
  assert (req.top_k, req.top_p) == (40, 0.9)
  # vLLM's "off" is -1 (its clients send it by default); below that is refused.
  req = api.parse(api.CompletionRequest, b'{"prompt": "x", "top_k": -1}', "application/json")
  api.check_completion(req, api.Limits())
  assert req.top_k == 0
  req = api.parse(api.CompletionRequest, b'{"prompt": "x", "top_k": -2}', "application/json")
  with pytest.raises(api.ApiError, match=r"top_k must be in \[0, 1000\] \(0 or -1: off\)"):
    api.check_completion(req, api.Limits())


@pytest.mark.parametrize("extra, param", [
    ({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens"),
    ({"stream": True, "logprobs": 1}, "logprobs")])
def test_decode_controls_are_refused_off_the_engine(extra, param):
  req = api.CompletionRequest(prompt="x", max_tokens=4, **extra)
  compat.check(req, on_engine=True)
  with pytest.raises(api.ApiError) as e:
    compat.check(req, on_engine=False)
  assert e.value.param == param and "--scheduler static" in e.value.message


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": [1, 2, "x"]}', "prompt[2]"), (b'{"prompt": ["a", "b", 3]}', "prompt[2]"),
    (b'{"prompt": [[1], [2, "x"]]}', "prompt[1][1]"), (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "x", "stop": ["a", 3]}', "stop[1]")])
def test_a_wrong_item_is_named_in_the_list_the_client_meant(raw, param):
  assert _param(raw) == param
