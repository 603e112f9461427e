"""POST /v1/embeddings: OpenAI's embeddings from the model's encoder.

    request body -> checks -> each input's ids, padded as `padding` says -> one batcher
    row per input (group EMBED: rows of any request and length share one encoder call)
    -> the encoder's last hidden states [L, e] per input -> pooled, normalized ->
    OpenAI's {"object": "list", "data": [{"object": "embedding", ...}], "usage"}

What each input becomes is what `T5EncoderModel(**tokenizer(inputs, padding=...))` gives
in transformers: text is tokenized as the completion route does (pieces + EOS for T5);
token-id lists are taken as given. The inputs of a request are padded to the longest of
them (`padding: longest`) or to `max_length`; the encoder attends to the real tokens
only, or also to the padding with `attend_to_padding` (Flux's `text_encoder_2` and SD3
run T5 on ids padded to 512 without an attention mask, which changes every position).
Rows never hold a decode slot: they run on the static `Batcher`, whose compiled encoder
is warmed up over the batch and length buckets (`--warmup embed`).

Pooling of one input's hidden states [L, e] (L its padded length, n <= L its tokens):
`mean` over its n tokens, `first` position 0, `last` its last token (EOS for text),
`none` all L positions [L, e]. `normalize` divides each vector by its L2 norm.
`encoding_format: base64` sends the little-endian bytes of the vector (flattened for
`none`) in `embed_dtype`, as OpenAI sends float32.

Shape letters (docs/shapes.md): L an input's padded length, e the encoder's width.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from typing import Literal

import fastapi
from fastapi import responses
import jax.numpy as jnp
import numpy as np
import pydantic

from t5forge.serve import api, batcher as batching
from t5forge.serve.service import Service, resolver

_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
           "bfloat16": np.dtype(jnp.bfloat16)}


class EmbeddingRequest(pydantic.BaseModel):
  """OpenAI's embeddings request (`dimensions` refused), plus pooling and padding.

  Strict types, as the completion request's: a string where a bool belongs is refused."""
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)

  model: str | None = None
  input: str | list[str] | list[int] | list[list[int]]
  encoding_format: Literal["float", "base64"] = "float"
  embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
  pooling: Literal["mean", "first", "last", "none"] = "mean"
  normalize: bool = False
  padding: Literal["longest", "max_length"] = "longest"
  max_length: int | None = None
  attend_to_padding: bool = False
  dimensions: int | None = None
  user: str | None = None

  @pydantic.field_validator("input", mode="before")
  @classmethod
  def _input_kind(cls, v):
    # The union's own message would name one member ("a valid string") only.
    if not isinstance(v, (str, list)):
      raise ValueError(f"input must be a string, a list of strings, a list of token ids or a "
                       f"list of token-id lists, got {type(v).__name__}")
    return v


@dataclasses.dataclass
class Inputs:
  """A request's inputs as the encoder takes them: each one's ids and token count."""
  ids: list[list[int]]    # padded to `length`
  counts: list[int]       # real tokens of each
  length: int             # L: the padded length of every input


def _bad(message: str, param: str) -> api.ApiError:
  return api.ApiError(400, message, param=param, code="invalid_value")


def check(req: EmbeddingRequest, s: Service) -> Inputs:
  """Value checks of a typed request and its inputs' ids; a 400 naming the field."""
  if not s.is_encoder_decoder:
    raise api.ApiError(400, f"embeddings need an encoder: {s.model_name!r} is a decoder-only "
                       "model; serve an encoder-decoder checkpoint (T5, T5Gemma) for "
                       "/v1/embeddings", param="model", code="unsupported")
  if not s.can_embed:
    raise api.ApiError(400, "embeddings are not available from an exported model (it holds "
                       "no encoder function); serve the checkpoint for /v1/embeddings",
                       param="input", code="unsupported")
  if req.dimensions is not None:
    raise _bad("dimensions is not supported: T5-family encoders are not Matryoshka-trained, "
               "so a truncated vector is not an embedding; drop dimensions", "dimensions")
  if req.embed_dtype != "float32" and req.encoding_format != "base64":
    raise _bad(f"embed_dtype {req.embed_dtype!r} applies to encoding_format 'base64' (float "
               "lists are float32); set encoding_format or drop embed_dtype", "embed_dtype")
  longest = s.batcher.buckets.length[-1]
  if req.padding == "longest" and req.max_length is not None:
    raise _bad("max_length applies to padding 'max_length'; set padding or drop max_length",
               "max_length")
  if req.padding == "max_length":
    if req.max_length is None:
      raise _bad("padding 'max_length' needs max_length (e.g. 512, as Flux and SD3 pad T5's "
                 "input)", "max_length")
    if not 1 <= req.max_length <= longest:
      raise _bad(f"max_length must be in [1, {longest}] (the largest --length_buckets), got "
                 f"{req.max_length}", "max_length")
  texts = [req.input] if isinstance(req.input, str) else req.input
  # A list of ints is one token-id input (OpenAI's shape), not several inputs.
  if texts and all(isinstance(x, int) for x in texts):
    texts = [texts]
  if not texts:
    raise _bad("input must not be an empty list", "input")
  if len(texts) > s.limits.max_prompts:
    raise _bad(f"at most {s.limits.max_prompts} inputs per request, got {len(texts)}", "input")
  single = isinstance(req.input, str) or isinstance(req.input[0], int)
  params = ["input" if single else f"input[{i}]" for i in range(len(texts))]
  vocab_size = s.batcher.generator.model.config.vocab_size
  most = min(s.limits.max_prompt_tokens, longest)
  cap, cost = s.limits.max_request_tokens, 0
  ids = []
  for x, param in zip(texts, params):
    ids.append(_ids(s, x, param, vocab_size, most))
    # The cap counts what the encoder runs, and is checked before the next input's
    # tokenization.
    cost += req.max_length if req.padding == "max_length" else len(ids[-1])
    if cap is not None and cost > cap:
      raise _bad(f"the inputs are over {cap} tokens (--max_request_tokens); send fewer",
                 "input")
  counts = [len(x) for x in ids]
  length = req.max_length if req.padding == "max_length" else max(counts)
  for n, param in zip(counts, params):
    if n > length:
      raise _bad(f"{param} is {n} tokens, longer than max_length {length} (inputs are not "
                 "truncated); raise max_length or shorten the input", param)
  return Inputs([x + [0] * (length - len(x)) for x in ids], counts, length)


def _ids(s: Service, x, param: str, vocab_size: int, most: int) -> list[int]:
  """One input's ids: text as the completion route encodes it; token ids as given."""
  if isinstance(x, str):
    if not x.strip():
      raise _bad(f"{param} must not be empty (an empty prompt's encoding, as diffusers makes "
                 f"for a negative prompt, is the token ids [{s.eos_id}])", param)
    try:
      x.encode("utf-8")
    except UnicodeEncodeError as e:
      raise _bad(f"{param} is not valid Unicode text ({e.reason} at character {e.start}); "
                 "send UTF-8 text", param) from None
    return s.encode(x, param)
  if not x:
    raise _bad(f"{param} must not be an empty token list", param)
  bad = next((j for j, t in enumerate(x) if not 0 <= t < vocab_size), None)
  if bad is not None:
    raise _bad(f"{param}[{bad}] = {x[bad]} is outside the vocabulary [0, {vocab_size})",
               f"{param}[{bad}]")
  if len(x) > most:
    raise api.ApiError(400, f"{param} is {len(x)} tokens, over the limit of {most} "
                       "(--max_prompt_tokens / --length_buckets)", param=param,
                       code="prompt_too_long")
  return list(x)


def pool(hidden: np.ndarray, count: int, pooling: str, normalize: bool) -> np.ndarray:
  """One input's hidden states [L, e] and token count -> [e] ([L, e] for 'none')."""
  if pooling == "mean":
    out = hidden[:count].astype(np.float64).mean(axis=0)
  elif pooling == "first":
    out = hidden[0]
  elif pooling == "last":
    out = hidden[count - 1]
  else:
    out = hidden
  out = np.asarray(out, np.float32)
  if normalize:
    norm = np.linalg.norm(out.astype(np.float64), axis=-1, keepdims=True)
    out = (out / np.maximum(norm, 1e-12)).astype(np.float32)
  return out


def serialize(vector: np.ndarray, encoding_format: str, embed_dtype: str):
  """A float list (nested for [L, e]), or base64 of the flat little-endian bytes."""
  if encoding_format == "float":
    return vector.tolist()
  flat = np.ascontiguousarray(vector.reshape(-1).astype(_DTYPES[embed_dtype]))
  if embed_dtype == "bfloat16":  # numpy has no '<' for it: its uint16 bits, little-endian
    flat = flat.view(np.uint16).astype("<u2")
  return base64.b64encode(flat.tobytes()).decode("ascii")


async def create(s: Service, request: fastapi.Request) -> dict | responses.Response:
  """The route's body: parse, check, one EMBED row per input, await, pool, answer."""
  start = time.monotonic()
  req = api.parse(EmbeddingRequest, await s.read_body(request),
                  request.headers.get("content-type"))
  adapter = s.check_model(req.model)  # an adapter's encoder embeds
  inputs = check(req, s)
  loop = asyncio.get_running_loop()
  rows, futs = [], []
  for ids, n in zip(inputs.ids, inputs.counts):
    fut = loop.create_future()
    rows.append(batching.Row(group=batching.EMBED, ids=ids,
                             attended=inputs.length if req.attend_to_padding else n,
                             adapter=adapter, done=resolver(loop, fut)))
    futs.append(fut)
  s.submit(rows)
  tokens = sum(inputs.counts)
  s.metrics.prompt_tokens.inc(tokens)
  s.charge(request, tokens)  # the key's --tokens_per_minute
  results = await s.await_rows(request, futs, rows, start=start)
  if results is None:
    return responses.Response(status_code=499)  # nobody reads it: the client left
  data = [{"object": "embedding", "index": i,
           "embedding": serialize(pool(r.hidden, n, req.pooling, req.normalize),
                                  req.encoding_format, req.embed_dtype)}
          for i, (r, n) in enumerate(zip(results, inputs.counts))]
  return {"object": "list", "data": data, "model": s.served_name(req.model),
          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
