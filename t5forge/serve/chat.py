"""POST /v1/chat/completions: OpenAI's chat completions on the completion machinery.

    request body -> checks -> messages rendered by the checkpoint's chat template
    (chat_template.py) -> the encoder's ids -> completions.run (the Plan, the engine's or
    the batcher's rows, streaming) -> `chat.completion`, or `chat.completion.chunk` SSE

The rendered messages are the encoder's input for an encoder-decoder (as transformers
feeds T5Gemma-it), tokenized as transformers' `apply_chat_template(...,
add_generation_prompt=True, tokenize=True)` does: no EOS is appended, the template writes
the turn marks. The stop ids the checkpoint declares (T5Gemma-it's <end_of_turn>) end an
answer without being part of it (`text.ChoiceText`).

Messages are `{"role", "content"[, "name"]}`; content is a string or a list of
`{"type": "text", "text"}` parts, joined with newlines (as vLLM joins them).
"""
from __future__ import annotations

import time

import fastapi
import pydantic

from t5forge.serve import api, completions
from t5forge.serve.chat_template import ROLES, TemplateError
from t5forge.serve.service import Service

NO_TEMPLATE = ("this checkpoint has no chat template (no chat_template.jinja, no "
               "chat_template in tokenizer_config.json); start the server with "
               "--chat_template FILE (a Jinja chat template), or use /v1/completions")


class ChatRequest(pydantic.BaseModel):
  """OpenAI's chat completions request, the fields this server implements (others are
  refused by name). Defaults are OpenAI's (temperature 1, top_p 1, n 1; max_tokens 16 or
  the server's limit if lower, as for completions)."""
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)

  model: str | None = None
  messages: list  # checked by `check_messages`, which names the message and field
  max_tokens: int | None = None
  max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # vLLM's extension, as for completions (0 or -1: off)
  n: int = 1
  seed: int | None = None
  stream: bool = False
  stream_options: api.StreamOptions | None = None
  stop: str | list[str] | None = None
  user: str | None = None
  priority: int = 0

  @pydantic.field_validator("temperature", "top_p", mode="before")
  @classmethod
  def _int_is_float(cls, v):
    # strict mode refuses 1 for a float field; JSON clients send 1 for 1.0.
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

  @pydantic.field_validator("top_k", mode="after")
  @classmethod
  def _minus_one_is_off(cls, v):
    return 0 if v == -1 else v  # vLLM's "off"


def _bad(message: str, param: str) -> api.ApiError:
  return api.ApiError(400, message, param=param, code="invalid_value")


def check_messages(messages, param: str = "messages") -> list[dict]:
  """OpenAI's messages -> the plain dicts the template sees; a 400 naming the message and
  field (messages[2].role) for anything else."""
  if not isinstance(messages, list) or not messages:
    raise _bad(f"{param} must be a non-empty list of {{\"role\", \"content\"}} objects",
               param)
  out = []
  for i, m in enumerate(messages):
    at = f"{param}[{i}]"
    if not isinstance(m, dict):
      raise _bad(f"{at} must be an object {{\"role\": ..., \"content\": ...}}, got "
                 f"{type(m).__name__}", at)
    unknown = sorted(set(m) - {"role", "content", "name"})
    if unknown:
      raise _bad(f"{at}.{unknown[0]} is not supported; a message has role, content and "
                 "name", f"{at}.{unknown[0]}")
    role = m.get("role")
    if role not in ROLES:
      raise _bad(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r:.40}",
                 f"{at}.role")
    content = m.get("content")
    if isinstance(content, list):
      parts = []
      for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
          raise _bad(f"{at}.content[{j}] must be {{\"type\": \"text\", \"text\": ...}}; this "
                     "server takes text only", f"{at}.content[{j}]")
        parts.append(part["text"])
      content = "\n".join(parts)
    if not isinstance(content, str):
      raise _bad(f"{at}.content must be a string, got "
                 f"{'nothing' if content is None else type(content).__name__}", f"{at}.content")
    if not content.strip():
      raise _bad(f"{at}.content must not be empty", f"{at}.content")
    msg = {"role": role, "content": content}
    if "name" in m:
      if not isinstance(m["name"], str):
        raise _bad(f"{at}.name must be a string", f"{at}.name")
      msg["name"] = m["name"]
    out.append(msg)
  return out


def _role_in(message: str, messages: list[dict], param: str) -> str:
  """The field a template's refusal is about: the first system message's role when the
  template refuses system messages, else the messages."""
  if "system" in message.lower():
    for i, m in enumerate(messages):
      if m["role"] == "system":
        return f"{param}[{i}].role"
  if "role" in message.lower() or "alternate" in message.lower():
    return f"{param}[0].role" if len(messages) == 1 else param
  return param


def encode_messages(s: Service, messages, *, add_generation_prompt: bool = True,
                    param: str = "messages", check_length: bool = True) -> list[int]:
  """The encoder's ids for OpenAI messages: checked, rendered by the served chat template,
  tokenized (see the module doc); a 400 naming the field for what the template refuses
  and for a rendering over the prompt limit."""
  msgs = check_messages(messages, param)
  template = s.chat_template
  if template is None:
    raise api.ApiError(400, NO_TEMPLATE, param=param, code="no_chat_template")
  try:
    text = template.render(msgs, add_generation_prompt=add_generation_prompt)
  except TemplateError as e:
    raise api.ApiError(400, f"the chat template ({template.where}) refused the messages: {e}",
                       param=_role_in(str(e), msgs, param), code="chat_template_error") from None
  ids = template.encode(text)
  longest = s.max_input_tokens
  if check_length and len(ids) > longest:
    raise api.ApiError(400, f"{param} render to {len(ids)} tokens, over the limit of "
                       f"{longest} (--max_prompt_tokens / --length_buckets); send fewer or "
                       "shorter messages", param=param, code="prompt_too_long")
  if not ids:
    raise _bad(f"{param} render to no tokens with the chat template", param)
  return ids


def _as_completion(req: ChatRequest, s: Service) -> api.CompletionRequest:
  """The completion options of a chat request, checked as /v1/completions checks them."""
  max_tokens, param = req.max_tokens, "max_tokens"
  if req.max_completion_tokens is not None:
    if max_tokens is not None and max_tokens != req.max_completion_tokens:
      raise _bad(f"max_tokens={max_tokens} and max_completion_tokens="
                 f"{req.max_completion_tokens} disagree; send one of them",
                 "max_completion_tokens")
    max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
  if req.stream_options is not None and not req.stream:
    raise _bad("stream_options applies to stream=true only", "stream_options")
  # The messages are encoded already; `prompt` stands for them in the shared checks.
  out = api.CompletionRequest.model_construct(
      model=req.model, prompt="(messages)", max_tokens=max_tokens, temperature=req.temperature,
      top_p=req.top_p, top_k=req.top_k, n=req.n, seed=req.seed, stream=req.stream, stop=req.stop,
      user=req.user, priority=req.priority)
  try:
    api.check_completion(out, s.limits)
  except api.ApiError as e:
    if e.param == "max_tokens" and param != "max_tokens":
      e.param, e.message = param, e.message.replace("max_tokens", param, 1)
    raise
  return out


async def complete(s: Service, request: fastapi.Request):
  """Answers one POST /v1/chat/completions: the response dict, or a StreamingResponse."""
  start = time.monotonic()
  req = api.parse(ChatRequest, await s.read_body(request), request.headers.get("content-type"))
  adapter = s.check_model(req.model)
  creq = _as_completion(req, s)
  ids = encode_messages(s, req.messages)
  shape = completions.Shape(s.served_name(req.model), chat=True,
                            include_usage=bool(req.stream_options and
                                               req.stream_options.include_usage),
                            adapter=adapter)
  return await completions.run(s, request, creq, [ids], shape, start=start)

