"""What OpenAI, vLLM and LiteLLM clients send to /v1/completions beyond our own fields,
checked after `api.check_completion`.

    check(req, on_engine)   a 400 naming the field for a value we cannot honour

Fields we do not implement are accepted at their neutral value only (the value that
changes nothing: what `vllm bench serve` and LiteLLM send by default) and refused at
any other, so that no field is silently ignored. `ignore_eos` and `min_tokens` run on
the continuous engine (engine/slots.py); beam search and --scheduler static refuse them.
"""
from __future__ import annotations

from t5forge.serve import api

# field -> (its neutral values, what to do instead)
NEUTRAL = {
    "best_of": ((None, 1), "use n for several completions"),
    "repetition_penalty": ((None, 1.0), "send 1.0 or leave it out"),
    "presence_penalty": ((None, 0.0), "send 0 or leave it out"),
    "frequency_penalty": ((None, 0.0), "send 0 or leave it out"),
    "logit_bias": ((None, {}), "send {} or null"),
    "suffix": ((None, ""), "send null: T5 completes a prompt, it does not insert text"),
}


def _bad(message: str, param: str) -> api.ApiError:
  return api.ApiError(400, message, param=param, code="unsupported")


def check(req: api.CompletionRequest, on_engine: bool) -> None:
  """Refuses non-neutral unimplemented fields, and the decode controls where the request
  does not run on the continuous engine (`on_engine` False: beams, --scheduler static)."""
  for field, (neutral, fix) in NEUTRAL.items():
    value = getattr(req, field)
    if value not in neutral:
      raise _bad(f"{field}={value!r:.60} is not supported by this server; {fix}", field)
  if req.min_tokens < 0 or req.min_tokens > req.max_tokens:
    raise api.ApiError(400, f"min_tokens must be in [0, max_tokens={req.max_tokens}], got "
                       f"{req.min_tokens}", param="min_tokens", code="invalid_value")
  if req.stream_options is not None and not req.stream:
    raise api.ApiError(400, "stream_options applies only with stream=true", param="stream_options",
                       code="invalid_value")
  if not on_engine:
    where = ("beam search (num_beams > 1)" if req.num_beams > 1
             else "the static scheduler (--scheduler static)")
    if req.ignore_eos:
      raise _bad(f"ignore_eos is not available with {where}; it runs on the continuous "
                 "engine", "ignore_eos")
    if req.min_tokens:
      raise _bad(f"min_tokens is not available with {where}; it runs on the continuous "
                 "engine", "min_tokens")
    if req.stream and req.logprobs is not None:
      raise _bad(f"logprobs are not streamed with {where}; ask without streaming",
                 "logprobs")
