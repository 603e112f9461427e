"""POST /tokenize and POST /detokenize, in vLLM's shapes.

    {"model", "prompt"}                                   -> {"tokens", "count", "max_input_tokens"}
    {"model", "messages", "add_generation_prompt": true}  -> the same, for chat
    {"model", "tokens"}                                   -> {"prompt"}

`tokens` are exactly the ids the routes feed the encoder: a prompt's pieces and EOS
(encoder-decoder) as /v1/completions does (`Service.encode`), the chat template's
rendering as /v1/chat/completions does (`chat.encode_messages`). `max_input_tokens` is the
longest input the server takes; a longer one is the same 400 the other routes give.
"""
from __future__ import annotations

import fastapi
import pydantic

from t5forge.serve import api, chat
from t5forge.serve.service import Service


class TokenizeRequest(pydantic.BaseModel):
  """vLLM's /tokenize body: a `prompt`, or chat `messages`."""
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)

  model: str | None = None
  prompt: str | None = None
  messages: list | None = None
  add_generation_prompt: bool = True


class DetokenizeRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)

  model: str | None = None
  tokens: list[int]


async def tokenize(s: Service, request: fastapi.Request) -> dict:
  req = api.parse(TokenizeRequest, await s.read_body(request),
                  request.headers.get("content-type"))
  s.check_model(req.model)
  if (req.prompt is None) == (req.messages is None):
    raise api.ApiError(400, "give either prompt (a string) or messages (chat), not "
                       f"{'both' if req.prompt is not None else 'neither'}",
                       param="prompt" if req.prompt is None else "messages",
                       code="invalid_value")
  if req.prompt is not None:
    if not req.prompt.strip():
      raise api.ApiError(400, "prompt must not be empty", param="prompt",
                         code="invalid_value")
    ids = s.encode(req.prompt, "prompt")
  else:
    ids = chat.encode_messages(s, req.messages,
                               add_generation_prompt=req.add_generation_prompt)
  return {"tokens": ids, "count": len(ids), "max_input_tokens": s.max_input_tokens}


async def detokenize(s: Service, request: fastapi.Request) -> dict:
  req = api.parse(DetokenizeRequest, await s.read_body(request),
                  request.headers.get("content-type"))
  s.check_model(req.model)
  size = s.vocabulary.vocab_size
  for i, t in enumerate(req.tokens):
    if not 0 <= t < size:
      raise api.ApiError(400, f"tokens[{i}] = {t} is not a token id of this vocabulary "
                         f"(0 to {size - 1})", param=f"tokens[{i}]", code="invalid_value")
  return {"prompt": s.vocabulary.decode(req.tokens)}
