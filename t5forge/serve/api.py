"""The HTTP API's request bodies, their checks, and OpenAI's error objects.

Every bad request becomes `ApiError` -> a 4xx with OpenAI's body
`{"error": {"message", "type", "param", "code"}}`, where `param` names the field. Bodies are
read by hand (not by FastAPI's body injection) so that the size limit, the content type,
malformed JSON and pydantic's checks all give that one shape.

Limits that depend on the server's flags (`Limits`) are checked after the types.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import pydantic

from t5forge.serve import body as body_lib


class ApiError(Exception):
  """A request the server refuses: HTTP status + OpenAI's error fields."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               type_: str = "invalid_request_error", code: str | None = None,
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.type, self.code, self.headers = type_, code, headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server accepts (from `t5forge serve`'s flags)."""
  max_body_bytes: int = 1 << 20
  max_prompt_tokens: int = 512      # per prompt, EOS included
  max_tokens: int = 128             # per completion
  max_n: int = 8                    # completions per prompt (n, and beams)
  max_prompts: int = 64             # prompts per request (a list prompt)
  max_top_k: int = 1000
  max_request_tokens: int | None = None  # prompts + n x max_tokens per request; None: no cap
  max_priority: int = 100           # priority in [-max_priority, max_priority]


_Strict = pydantic.ConfigDict(extra="forbid", strict=True)


class StreamOptions(pydantic.BaseModel):
  """OpenAI's `stream_options`: include_usage adds a last chunk with the usage."""
  model_config = _Strict

  include_usage: bool | None = None


class CompletionRequest(pydantic.BaseModel):
  """OpenAI's legacy completions request, plus T5 extensions (top_k, num_beams, alpha).

  Defaults are OpenAI's (max_tokens 16, temperature 1, top_p 1, n 1). Strict types: a
  string where a number belongs is refused rather than converted. Ints are accepted for
  float fields (JSON has one number type)."""
  model_config = _Strict

  model: str | None = None
  # text, texts, or token ids as the encoder takes them (one list, or one per prompt)
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = None    # default: OpenAI's 16, or the server's limit if lower
  temperature: float = 1.0
  top_p: float = 1.0
  n: int = 1
  seed: int | None = None
  stream: bool = False
  logprobs: int | None = None
  stop: str | list[str] | None = None
  user: str | None = None
  echo: Literal[False] = False        # echo=true is not supported: only false is accepted
  top_k: int = 0
  num_beams: int = 1
  alpha: float = 0.6
  min_log_prob: float | None = None   # beams only: stop once the best beam falls below (T5X)
  priority: int = 0                   # lower is served first (as vLLM); engine rows only
  # Client compatibility (serve/compat.py): vLLM's decode controls, OpenAI's stream options,
  # and fields accepted only at the value that changes nothing.
  ignore_eos: bool = False
  min_tokens: int = 0
  stream_options: StreamOptions | None = None
  best_of: int | None = None
  repetition_penalty: float | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict[str, float] | None = None
  suffix: str | None = None

  @pydantic.field_validator("temperature", "top_p", "alpha", "min_log_prob",
                            "repetition_penalty", "presence_penalty", "frequency_penalty",
                            mode="before")
  @classmethod
  def _int_is_float(cls, v):
    # strict mode refuses 1 for a float field; JSON clients send 1 for 1.0.
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

  @pydantic.field_validator("top_k", mode="after")
  @classmethod
  def _minus_one_is_off(cls, v):
    # vLLM's (and its clients') "off" is -1; ours is 0.
    return 0 if v == -1 else v


class ScoreRequest(pydantic.BaseModel):
  """`/v1/score` (extension, T5X's score mode): the summed log-likelihood of each target
  given its prompt. A string prompt with a list of targets scores each target against it."""
  model_config = _Strict

  model: str | None = None
  prompt: str | list[str]
  targets: str | list[str]
  user: str | None = None


def _is_member(part) -> bool:
  """Whether a location part is the union member pydantic tried ('list[int]'), not a field."""
  return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _closest(errors: list) -> dict:
  """The error to report: that of the union member with the fewest errors (the one the
  client meant: [1, 2, "x"] is a list of ints with one bad item), then the deepest."""
  key = lambda e: e["loc"][:2] if len(e["loc"]) > 1 and _is_member(e["loc"][1]) else e["loc"]
  counts: dict = {}
  for e in errors:
    counts[key(e)] = counts.get(key(e), 0) + 1
  return min(errors, key=lambda e: (counts[key(e)], -len(_param(e["loc"]) or "")))


def _param(loc: tuple) -> str | None:
  """pydantic's error location -> OpenAI's param ('stop', 'prompt[2]')."""
  out = ""
  for part in loc:
    if isinstance(part, int):
      out += f"[{part}]"
    elif _is_member(part):
      continue  # the union member pydantic tried, not a field
    else:
      out += ("." if out else "") + str(part)
  return out or None


def parse(model_cls, raw: bytes, content_type: str | None):
  """Request bytes -> a validated `model_cls`, or ApiError (415 / 400) naming the field."""
  media = (content_type or "").split(";")[0].strip().lower()
  if media != "application/json":
    raise ApiError(415, f"Content-Type must be application/json, got {content_type!r}",
                   param="Content-Type", code="unsupported_media_type")
  try:
    data = body_lib.loads(raw)
  except body_lib.BadBody as e:
    raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}", param="body",
                   code="invalid_json") from None
  if not isinstance(data, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                   param="body", code="invalid_json")
  try:
    return model_cls.model_validate(data)
  except pydantic.ValidationError as e:
    # For a union (prompt: str | list[str] | ...) the closest member's deepest location
    # is the useful one: prompt[1] of a list rather than "prompt is not a string".
    err = _closest(e.errors(include_url=False))
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
      known = ", ".join(model_cls.model_fields)
      msg = f"unknown field {param!r}; known fields: {known}"
      code = "unknown_field"
    elif err["type"] == "missing":
      msg, code = f"{param!r} is required", "missing_field"
    else:
      msg = f"{param!r}: {err['msg']} (got {err.get('input')!r:.80})"
      code = "invalid_type"
    raise ApiError(400, msg, param=param, code=code) from None


def _bad(message: str, param: str) -> ApiError:
  return ApiError(400, message, param=param, code="invalid_value")


def as_list(x) -> list[str]:
  return [x] if isinstance(x, str) else list(x)


def prompt_list(prompt) -> list:
  """A completion's prompts: each a string or a token-id list (a flat list of ints is one
  prompt, as OpenAI reads it)."""
  if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
    return [prompt]
  return list(prompt)


def prompt_param(prompt, i: int) -> str:
  """The field that names prompt i: `prompt` when the request has one, else `prompt[i]`."""
  return "prompt" if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
      else f"prompt[{i}]"


def check_completion(req: CompletionRequest, limits: Limits) -> None:
  """Value checks of a typed completion request (ranges, combinations, limits)."""
  prompts = prompt_list(req.prompt)
  if not prompts:
    raise _bad("prompt must not be an empty list", "prompt")
  if len(prompts) > limits.max_prompts:
    raise _bad(f"at most {limits.max_prompts} prompts per request, got {len(prompts)}", "prompt")
  for i, p in enumerate(prompts):
    if not (p.strip() if isinstance(p, str) else p):
      param = prompt_param(req.prompt, i)
      raise _bad(f"{param} must not be empty", param)
  if req.max_tokens is None:
    req.max_tokens = min(16, limits.max_tokens)
  if req.max_tokens < 1:
    raise _bad(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
  if req.max_tokens > limits.max_tokens:
    raise _bad(f"max_tokens must be <= {limits.max_tokens} on this server (--max_tokens_limit), "
               f"got {req.max_tokens}", "max_tokens")
  if req.temperature < 0 or req.temperature > 2:
    raise _bad(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
  if not 0 < req.top_p <= 1:
    raise _bad(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
  if req.n < 1 or req.n > limits.max_n:
    raise _bad(f"n must be in [1, {limits.max_n}] on this server (--max_n), got {req.n}", "n")
  if req.num_beams < 1 or req.num_beams > limits.max_n:
    raise _bad(f"num_beams must be in [1, {limits.max_n}] on this server (--max_n), got "
               f"{req.num_beams}", "num_beams")
  if req.num_beams > 1 and req.n > req.num_beams:
    raise _bad(f"n={req.n} is more than num_beams={req.num_beams}: beam search returns at most "
               "num_beams completions", "n")
  if req.top_k < 0 or req.top_k > limits.max_top_k:
    raise _bad(f"top_k must be in [0, {limits.max_top_k}] (0 or -1: off), got {req.top_k}",
               "top_k")
  if req.logprobs is not None:
    if not 0 <= req.logprobs <= 5:
      raise _bad(f"logprobs must be in [0, 5], got {req.logprobs}", "logprobs")
  if req.alpha < 0:
    raise _bad(f"alpha (beam brevity penalty) must be >= 0, got {req.alpha}", "alpha")
  if req.min_log_prob is not None and not req.min_log_prob == req.min_log_prob:
    raise _bad("min_log_prob must be a number, got NaN", "min_log_prob")
  if req.min_log_prob is not None and req.num_beams == 1:
    raise _bad("min_log_prob stops beam search only; set num_beams > 1 or drop it",
               "min_log_prob")
  stops = [] if req.stop is None else as_list(req.stop)
  if len(stops) > 4:
    raise _bad(f"at most 4 stop sequences, got {len(stops)}", "stop")
  if any(not s for s in stops):
    raise _bad("stop sequences must not be empty strings", "stop")
  if abs(req.priority) > limits.max_priority:
    raise _bad(f"priority must be in [-{limits.max_priority}, {limits.max_priority}] (lower is "
               f"served first), got {req.priority}", "priority")
  if req.seed is not None and not 0 <= req.seed < 2 ** 31:
    raise _bad(f"seed must be in [0, 2**31), got {req.seed}", "seed")


def check_score(req: ScoreRequest, limits: Limits) -> tuple[list[str], list[str]]:
  """-> (prompts, targets) of equal length."""
  prompts, targets = as_list(req.prompt), as_list(req.targets)
  if not targets:
    raise _bad("targets must not be an empty list", "targets")
  if len(prompts) == 1 and len(targets) > 1:
    prompts = prompts * len(targets)
  if len(prompts) != len(targets):
    raise _bad(f"{len(prompts)} prompts but {len(targets)} targets; give one target per prompt "
               "or one prompt for all", "targets")
  if len(prompts) > limits.max_prompts:
    raise _bad(f"at most {limits.max_prompts} pairs per request, got {len(prompts)}", "prompt")
  for name, xs in (("prompt", prompts), ("targets", targets)):
    for i, x in enumerate(xs):
      if not x.strip():
        raise _bad(f"{name} must not be empty", name if len(xs) == 1 else f"{name}[{i}]")
  return prompts, targets
