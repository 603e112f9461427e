"""The padded-batch decoder: batched decoding with per-row options, resumable in chunks,
prediction on feature batches and scoring. The server's static batcher, the Python API,
`t5forge infer`, eval and the benchmarks all decode through one `Generator` (the slot
engine, `t5forge.engine`, is the continuous-batching path beside it).

    g = Generator(model, params)
    out = g.generate(Kind("sample"), inputs, decode_length=64, max_new_tokens=steps,
                     temperature=temps, topp=topps, seed=0, stream=True, on_chunk=send)
    out.tokens  # [b, n, l] new tokens
    tokens, scores = g.predict(batch, DecodeOptions(method="beam", num_decodes=4))
    log_likelihoods = g.score_batch(batch)   # [b]

What changes compiled code in `generate` is the `Kind`'s method, num_decodes and
top_logprobs and the shapes (batch size, input length, decode length); everything per row
(temperature, top-k, top-p, max_new_tokens) and the seed are traced arrays, so requests of one Kind and shape
share one compiled start function and one compiled advance function whatever their
options. `predict` takes `predict.DecodeOptions` (validated once, when they are made):
the options that change shapes or code (method, num_decodes, topk, output length)
select a compiled function, the others (temperature, topp, alpha, max_decode_steps,
min_log_prob, seed) are traced, so changing them does not recompile. A streamed request runs the advance function once per `chunk_tokens` new
tokens (one host round trip per chunk, not per token); the cache is donated between
calls so XLA updates it in place.

A model of stacked LoRA adapters (`t5forge.nn.lora`, `LoraConfig.stacked`, what `t5forge
serve --adapter` runs) takes one more traced [b] int32 array, each row's adapter (0:
the base), given as `adapters=` to `generate`, `score` and `encode`: rows for different
adapters share a batch and a compiled function.

Shape letters (docs/shapes.md): b batch, n num_decodes, i input length, l decode length,
k top_logprobs.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import decoding, multihost
from t5forge.errors import UserError
from t5forge.nn import lora
from t5forge.predict import METHODS, DecodeOptions, features_from_tokens

MAX_TOP_LOGPROBS = 5  # OpenAI's limit for `logprobs`
# Bound on one whole-length advance call: the loop ends before it when every row is done.
_ALL_STEPS = 2 ** 30
# The feature of a score batch that holds each row's adapter [b] (stacked LoRA models).
ADAPTER_FEATURE = "adapter_ids"


@dataclasses.dataclass(frozen=True)
class Kind:
  """What a batch shares: requests of one Kind share batches. Its topk is traced in
  `Generator.generate` (no compile per value); the rest is compiled.

  Attributes:
    method: 'greedy' | 'sample' | 'beam'.
    num_decodes: n samples, or beams.
    topk: sample among the topk most likely tokens (0: off; top-p then applies to them).
    top_logprobs: 0..5: also return the k most likely tokens + log-probs per position.
  """
  method: str = "greedy"
  num_decodes: int = 1
  topk: int = 0
  top_logprobs: int = 0

  def __post_init__(self):
    if self.method not in METHODS:
      raise UserError(f"method {self.method!r} is not one of {METHODS}")
    for name in ("num_decodes", "topk", "top_logprobs"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UserError(f"{name}={value!r} must be an integer")
    if self.num_decodes < 1:
      raise UserError(f"num_decodes={self.num_decodes} must be >= 1")
    if self.method == "greedy" and self.num_decodes != 1:
      raise UserError(f"greedy decoding gives one decode, not num_decodes={self.num_decodes}; "
                      "use method 'sample' or 'beam'")
    if self.topk < 0 or (self.topk and self.method != "sample"):
      raise UserError(f"topk={self.topk} must be >= 0 and applies to method 'sample' only")
    if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
      raise UserError(f"top_logprobs={self.top_logprobs} must be in 0..{MAX_TOP_LOGPROBS}")


@dataclasses.dataclass
class Generated:
  """What `Generator.generate` returns (numpy; n sorted by score, best last).

  Attributes:
    tokens: [b, n, l] int32 new tokens only, 0 after EOS / the step limit.
    scores: [b, n] float32 summed log-probs of the new tokens (EOS included); beam
      search's are divided by its brevity penalty (T5X).
    token_logprobs: [b, n, l] float32 log-prob of each new token as scored (sampled
      tokens: under the distribution they were drawn from, T5X's rescale_log_probs;
      greedy and beams: the model's log-softmax), 0 after the end.
    top_ids: [b, n, l, k] int32 the k most likely tokens per position (model's
      log-softmax), or None when kind.top_logprobs is 0.
    top_logprobs: [b, n, l, k] float32 their log-probs, or None.
    lengths: [b, n] int32 new tokens incl. EOS.
    finished: [b, n] bool ended with EOS (else hit the step limit).
  """
  tokens: np.ndarray
  scores: np.ndarray
  token_logprobs: np.ndarray | None
  top_ids: np.ndarray | None
  top_logprobs: np.ndarray | None
  lengths: np.ndarray
  finished: np.ndarray


def _per_row(x, name: str, b: int, dtype) -> np.ndarray:
  x = np.asarray(x, dtype)
  if x.ndim == 0:
    x = np.full((b,), x, dtype)
  if x.shape != (b,):
    raise UserError(f"{name} must have one value per row, shape [{b}], got {list(x.shape)}")
  return x


class CompiledFns:
  """A Generator's jitted functions by key (a decode method with its n and top_logprobs,
  and a decode length), the least recently used dropped past `limit`. Requests choose the
  keys, within the server's limits; a server lives for weeks, so the set is bounded here
  too. `evictions` counts the drops (t5forge_compile_cache_evictions_total): a steady
  rise means the limit is too small for the traffic, and requests recompile."""

  def __init__(self, limit: int = 64):
    self.limit, self.evictions = limit, 0
    self._fns: collections.OrderedDict = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._fns)

  def get(self, key, make: Callable[[], Any]):
    """The function under key, made with make() the first time."""
    if key in self._fns:
      self._fns.move_to_end(key)
      return self._fns[key]
    fn = self._fns[key] = make()
    if len(self._fns) > self.limit:
      self._fns.popitem(last=False)
      self.evictions += 1
    return fn


class Generator:
  """Compiled generation, prediction and scoring for one model, one compile cache.

  Args:
    model: a `t5forge.models` model (`decode_setup` / `decode_step` / `score_batch` /
      `predict_batch_with_aux`).
    params: its parameters, already placed (e.g. by the opener with the partitioner's
      shardings), or None when every `predict` / `score_batch` call passes its own (the
      trainer's eval, a reassigned `Model.params`; same shapes compile nothing new).
    partitioner: optional `t5forge.sharding.Partitioner`; inputs are split over its data
      axes when the batch divides them (else replicated) and everything runs under its
      activation rules.
    param_shardings: with a partitioner, the parameters' shardings
      (`opener.Opened.param_shardings`): `predict` and `score_batch` are jitted with them
      as explicit input shardings and replicated outputs.
    chunk_tokens: new tokens per compiled call when streaming.
  """

  def __init__(self, model, params=None, *, partitioner=None, param_shardings=None,
               chunk_tokens: int = 8):
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) \
        or chunk_tokens < 1:
      raise UserError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1")
    self.model = model
    self.params = params
    self.partitioner = partitioner
    # jit arguments of the feature-batch functions: the parameters as placed; a batch's
    # sharding comes with its arrays (see _place).
    self._predict_jit: dict = {}
    self._score_jit: dict = {}
    if partitioner is not None and param_shardings is not None:
      self._predict_jit = {"in_shardings": (param_shardings, None, None, None),
                           "out_shardings": partitioner.replicated()}
      self._score_jit = {"in_shardings": (param_shardings, None),
                         "out_shardings": partitioner.replicated()}
    self.chunk_tokens = int(chunk_tokens)
    self.eos_id = int(model.eos_id)
    # The ids that end a row: eos_id, or several (ModelConfig.eos_token_ids).
    self.stop_ids = model.stop_ids
    self.is_encoder_decoder = bool(model.config.is_encoder_decoder)
    # N > 0: the model's LoRA weights are N stacked adapters, chosen per row.
    self.adapter_count = lora.stacked_count(model.config)
    self.compiled = CompiledFns()

  # -- compiled functions ------------------------------------------------------------------
  def _batch(self, inputs):
    key = "encoder_input_tokens" if self.is_encoder_decoder else "decoder_input_tokens"
    return {key: inputs}

  def _adapters(self, adapters, b: int) -> np.ndarray | None:
    """Each row's adapter [b] int32 (default 0, the base) for a model of stacked adapters;
    None for any other model, which has no adapters to choose."""
    if not self.adapter_count:
      if adapters is not None and np.any(np.asarray(adapters) != 0):
        raise UserError("adapters= chooses among stacked LoRA adapters; this model has none "
                        "(serve it with --adapter name=path)")
      return None
    ids = _per_row(0 if adapters is None else adapters, "adapters", b, np.int32)
    if np.any((ids < 0) | (ids >= self.adapter_count)):
      raise UserError(f"adapters must be in 0..{self.adapter_count - 1} (0: the base), got "
                      f"{ids.tolist()}")
    return ids

  def _sample_fns(self, kind: Kind, length: int):
    """(start, advance) jitted for one Kind and decode length (shapes key jax's cache).

    start(params, inputs [b, i], max_new [b], temperature [b], topp [b], topk [b], rng,
      adapters [b] | None) -> state
    advance(params, state (donated), steps [], adapters [b] | None) -> (state, view dict,
      all_done [])
    """
    # top-k is a traced per-row value (as temperature and top-p): not in the key, so a
    # client's top_k never compiles.
    key = ("sample", dataclasses.replace(kind, topk=0), length)
    return self.compiled.get(key, lambda: self._make_sample_fns(kind, length))

  def _make_sample_fns(self, kind: Kind, length: int):
    model, n, k = self.model, kind.num_decodes, kind.top_logprobs
    greedy = kind.method == "greedy"
    eos = self.stop_ids

    def start(params, inputs, max_new, temperature, topp, topk, rng, adapters):
      with lora.row_adapters(adapters):
        setup = model.decode_setup(params, self._batch(inputs), length)
      return decoding.sample_init(
          setup.inputs, setup.cache, decode_rng=rng, num_decodes=n,
          temperature=temperature, topk=topk, topp=topp,
          initial_index=setup.initial_index, max_decode_steps=max_new, top_logprobs=k)

    def advance(params, state, steps, adapters, input_length):
      cache_length, offset = model.decode_layout(input_length, length)
      # The adapters [b] are repeated to the n decodes of each row by the layers.
      with lora.row_adapters(adapters):
        state = decoding.sample_advance(
            state, model.decode_step(params, cache_length), eos_id=eos, topk=None,
            greedy_only=greedy, use_topp=not greedy, steps=steps)
      decodes, scores, aux = decoding.sample_result(state, n)
      window = slice(offset, offset + length)  # new token j is decodes[offset + j]
      view = {"tokens": decodes[:, :, window], "scores": scores,
              "token_logprobs": aux["token_log_probs"][:, :, window],
              "lengths": aux["lengths"], "finished": aux["finished"]}
      if k:
        view["top_ids"] = aux["top_ids"][:, :, window]
        view["top_logprobs"] = aux["top_log_probs"][:, :, window]
      return state, view, jnp.all(aux["done"])

    return (jax.jit(start),
            jax.jit(advance, donate_argnums=(1,), static_argnames=("input_length",)))

  def _beam_fn(self, kind: Kind, length: int):
    """beam(params, inputs [b, i], max_new [b], alpha [], min_log_prob [b], adapters [b] |
    None) -> (decodes
    [b, n, l], aux: scores [b, n], token_log_probs [b, n, l], top_ids / top_log_probs
    [b, n, l, k])."""
    return self.compiled.get(("beam", kind, length), lambda: self._make_beam_fn(kind, length))

  def _make_beam_fn(self, kind: Kind, length: int):
    model = self.model

    def beam(params, inputs, max_new, alpha, min_log_prob, adapters):
      # The layers repeat the adapters [b] to the flat beams (row e * n + j).
      with lora.row_adapters(adapters):
        return model.predict_batch_with_aux(
            params, self._batch(inputs), None,
            decoder_params={"alpha": alpha, "max_decode_steps": max_new,
                            "min_log_prob": min_log_prob, "log_probs": kind.top_logprobs},
            num_decodes=kind.num_decodes, return_all_decodes=True,
            max_decode_length=length, decode_fn=decoding.beam_search)

    return jax.jit(beam)

  # -- placement ----------------------------------------------------------------------------
  def _place(self, tree: dict) -> dict:
    """Host arrays [b, ...] -> device arrays split over the data axes when b divides them,
    else replicated (the Python API's odd batch sizes on a multi-device host). Arrays
    already on devices (eval's sharded global batches) and None are kept as they are."""
    p = self.partitioner
    out = {}
    for name, x in tree.items():
      if x is None or isinstance(x, jax.Array):
        out[name] = x
      elif p is None:
        out[name] = jnp.asarray(x)
      else:
        x = np.asarray(x)
        split = x.ndim and x.shape[0] % p.num_data_shards == 0
        out[name] = p.place(x, p.batch_sharding(x.ndim) if split else p.replicated())
    return out

  def _context(self):
    if self.partitioner is None:
      return contextlib.nullcontext()
    return self.partitioner.activation_context()

  # -- API ----------------------------------------------------------------------------------
  def generate(self, kind: Kind, inputs: np.ndarray, *, decode_length: int,
               max_new_tokens, temperature, topp, alpha: float = 0.6, seed: int = 0,
               min_log_prob=None, stream: bool = False,
               on_chunk: Callable[[np.ndarray, np.ndarray, np.ndarray], Any] | None = None,
               adapters=None) -> Generated:
    """Decodes new tokens for each row of `inputs`.

    Args:
      kind: the compiled setting (method, num_decodes, topk, top_logprobs).
      inputs: [b, i] int32. Encoder-decoder: encoder tokens ending in EOS, 0-padded.
        Decoder-only: [0 (BOS), prompt..., 0 padding] (`interactive.Model.predict`).
      decode_length: static output length l (a bucket).
      max_new_tokens: [b] int in 1..l, new tokens per row (later positions are 0).
      temperature: [b] float >= 0 (method 'sample'; rows <= 1e-4 decode greedily).
      topp: [b] float in [0, 1] (method 'sample'; 0 or 1: off), over what topk kept.
      alpha: beam search's brevity-penalty exponent.
      min_log_prob: beam search only: None, or [b] float (or one for all rows): stop a
        row once its best live beam's log-prob falls below it (T5X); -inf never stops.
      seed: sampling seed (`jax.random.key(seed)`).
      stream: decode in chunks of `chunk_tokens` new tokens per compiled call, calling
        on_chunk(tokens [b, n, l] so far, lengths [b, n], finished [b, n]) after each;
        False runs the whole loop in one call (on_chunk, if given, once at the end).
        Beam search always runs whole (on_chunk once).
      adapters: a model of stacked LoRA adapters: [b] int, each row's (0: the base;
        default all 0).

    Returns:
      a Generated (numpy arrays, n sorted by score, best last).
    """
    if not isinstance(kind, Kind):
      raise TypeError(f"kind must be a generation.Kind, got {type(kind).__name__}")
    inputs = np.asarray(inputs)
    if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.integer) or not inputs.size:
      raise UserError(f"inputs must be int tokens [batch, length], got {inputs.dtype}"
                      f"{list(inputs.shape)}")
    inputs = inputs.astype(np.int32)
    b = inputs.shape[0]
    if isinstance(decode_length, bool) or not isinstance(decode_length, (int, np.integer)) \
        or decode_length < 1:
      raise UserError(f"decode_length={decode_length!r} must be an integer >= 1")
    length = int(decode_length)
    max_new = _per_row(max_new_tokens, "max_new_tokens", b, np.int32)
    if np.any((max_new < 1) | (max_new > length)):
      raise UserError(f"max_new_tokens must be in 1..{length} (the decode length), got "
                      f"{max_new.tolist()}")
    if kind.method == "greedy":
      temperature, topp = np.zeros((b,), np.float32), np.zeros((b,), np.float32)
    temperature = _per_row(temperature, "temperature", b, np.float32)
    topp = _per_row(topp, "topp", b, np.float32)
    if np.any(~np.isfinite(temperature) | (temperature < 0)):
      raise UserError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if np.any(~(topp >= 0) | (topp > 1)):
      raise UserError(f"topp must be in [0, 1], got {topp.tolist()}")

    if min_log_prob is not None and kind.method != "beam":
      raise UserError(f"min_log_prob applies to beam search only, not method {kind.method!r}")
    min_lp = _per_row(-np.inf if min_log_prob is None else min_log_prob, "min_log_prob", b,
                      np.float32)
    if np.any(np.isnan(min_lp)):
      raise UserError(f"min_log_prob must be a number or -inf, got {min_lp.tolist()}")
    ids = self._adapters(adapters, b)
    with self._context():
      if kind.method == "beam":
        return self._beam(kind, inputs, length, max_new, alpha, min_lp, on_chunk, ids)
      start, advance = self._sample_fns(kind, length)
      placed = self._place({"inputs": inputs, "max_new": max_new, "temperature": temperature,
                            "topp": topp, "topk": np.full((b,), kind.topk, np.int32),
                            "adapters": ids})
      state = start(self.params, placed["inputs"], placed["max_new"], placed["temperature"],
                    placed["topp"], placed["topk"], jax.random.key(seed), placed["adapters"])
      steps = np.int32(self.chunk_tokens if stream else _ALL_STEPS)
      i = inputs.shape[1]
      while True:
        state, view, all_done = advance(self.params, state, steps, placed["adapters"],
                                        input_length=i)
        all_done = bool(multihost.to_host(all_done))
        if on_chunk is not None and (stream or all_done):
          on_chunk(multihost.to_host(view["tokens"]), multihost.to_host(view["lengths"]),
                   multihost.to_host(view["finished"]))
        if all_done:
          break
      del state  # its buffers (the cache) are freed here rather than with the next call's
      out = {name: multihost.to_host(x) for name, x in view.items()}
    return Generated(tokens=out["tokens"], scores=out["scores"],
                     token_logprobs=out["token_logprobs"], top_ids=out.get("top_ids"),
                     top_logprobs=out.get("top_logprobs"), lengths=out["lengths"],
                     finished=out["finished"])

  def _beam(self, kind, inputs, length, max_new, alpha, min_log_prob, on_chunk,
            adapters) -> Generated:
    placed = self._place({"inputs": inputs, "max_new": max_new, "min_log_prob": min_log_prob,
                          "adapters": adapters})
    decodes, aux = self._beam_fn(kind, length)(self.params, placed["inputs"],
                                               placed["max_new"], jnp.float32(alpha),
                                               placed["min_log_prob"], placed["adapters"])
    tokens = multihost.to_host(decodes)
    aux = {name: multihost.to_host(x) for name, x in aux.items()}
    is_eos = np.isin(tokens, self.stop_ids)
    finished = is_eos.any(axis=-1)
    # A beam without EOS ran to its step limit, stopped at min_log_prob, or is an empty
    # slot (no finished sequence to fill it): its length is through its last decoded
    # position (a decoded token, even id 0, has a log-prob; an undecoded position none).
    limit = np.minimum(max_new, length)[:, None]
    decoded = (tokens != 0) | (aux["token_log_probs"] != 0)
    written = np.where(decoded.any(-1), length - np.argmax(decoded[..., ::-1], -1), 0)
    lengths = np.where(finished, is_eos.argmax(axis=-1) + 1,
                       np.minimum(limit, written)).astype(np.int32)
    if on_chunk is not None:
      on_chunk(tokens, lengths, finished)
    k = kind.top_logprobs
    return Generated(tokens=tokens, scores=aux["scores"], token_logprobs=aux["token_log_probs"],
                     top_ids=aux["top_ids"] if k else None,
                     top_logprobs=aux["top_log_probs"] if k else None, lengths=lengths,
                     finished=finished)

  def score(self, inputs: np.ndarray, targets: np.ndarray, adapters=None) -> np.ndarray:
    """Summed log-likelihood of each target given its input.

    Args:
      inputs: [b, i] int32 as `generate` takes them; a decoder-only prompt is scored as
        given (`interactive.Model.score` appends EOS to its inputs first).
      targets: [b, t] int32 ending in EOS, 0-padded.
      adapters: as `generate`'s.

    Returns:
      [b] float32 (EOS included), as `interactive.Model.score`.
    """
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    if inputs.ndim != 2 or targets.ndim != 2 or inputs.shape[0] != targets.shape[0]:
      raise UserError(f"inputs [b, i] and targets [b, t] must have one row each, got "
                      f"{list(inputs.shape)} and {list(targets.shape)}")
    # Decoder-only inputs start with BOS 0, which the prefix-LM features add themselves.
    body = inputs if self.is_encoder_decoder else inputs[:, 1:]
    xs = [[int(t) for t in row if t] for row in body]
    ys = [[int(t) for t in row if t] for row in targets]
    batch = features_from_tokens(xs, ys, encoder_decoder=self.is_encoder_decoder,
                                 input_length=body.shape[1], target_length=targets.shape[1],
                                 eos=self.eos_id, rows=len(xs))
    ids = self._adapters(adapters, len(xs))
    if ids is not None:
      batch[ADAPTER_FEATURE] = ids
    return self.score_batch(batch)

  # -- feature batches (SeqIO's model features) ---------------------------------------------
  def _params(self, params):
    params = self.params if params is None else params
    if params is None:
      raise ValueError("this Generator was made without parameters; pass params=")
    return params

  def score_batch(self, batch: dict, *, params=None) -> np.ndarray:
    """Summed target log-likelihood per example [b] of a feature batch
    (`predict.features_from_tokens`' keys, host or device arrays [b, ...])."""
    model = self.model

    def score(params, batch):
      batch = dict(batch)
      with lora.row_adapters(batch.pop(ADAPTER_FEATURE, None)):
        return model.score_batch(params, batch)

    fn = self.compiled.get("score", lambda: jax.jit(score, **self._score_jit))
    with self._context():
      return multihost.to_host(fn(self._params(params), self._place(batch)))

  def _predict_fn(self, opts: DecodeOptions, length: int):
    key = ("predict", opts.method, opts.num_decodes, opts.topk, length,
           opts.return_all_decodes)
    model = self.model
    decode_fn = decoding.beam_search if opts.method == "beam" else decoding.temperature_sample

    def fn(params, batch, rng, traced):
      if opts.method == "beam":
        options = {"alpha": traced["alpha"], "max_decode_steps": traced["max_decode_steps"],
                   "min_log_prob": traced["min_log_prob"]}
      else:
        options = {"temperature": traced["temperature"], "topk": opts.topk,
                   "topp": traced["topp"], "max_decode_steps": traced["max_decode_steps"]}
      return model.predict_batch_with_aux(
          params, batch, rng, decoder_params=options, num_decodes=opts.num_decodes,
          return_all_decodes=opts.return_all_decodes, max_decode_length=length,
          decode_fn=decode_fn)

    return self.compiled.get(key, lambda: jax.jit(fn, **self._predict_jit))

  def predict(self, batch: dict, opts: DecodeOptions, *, params=None,
              max_decode_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decodes a feature batch as T5X's `predict_batch_with_aux` does.

    Args:
      batch: model features [b, ...] (`predict.features_from_tokens`, or eval's batches).
      opts: `predict.DecodeOptions`.
      params: parameters for this call (default: the Generator's).
      max_decode_length: output length l (default: the batch's decoder length).

    Returns:
      (tokens [b, l] or [b, n, l] with `opts.return_all_decodes`, scores [b] or [b, n])
      as numpy, n sorted by increasing score (best last).
    """
    if not isinstance(opts, DecodeOptions):
      raise TypeError(f"opts must be a predict.DecodeOptions, got {type(opts).__name__}")
    length = max_decode_length or batch["decoder_input_tokens"].shape[1]
    temperature = 0.0 if opts.method == "greedy" else opts.temperature
    traced = {"temperature": jnp.float32(temperature), "topp": jnp.float32(opts.topp),
              "alpha": jnp.float32(opts.alpha),
              "max_decode_steps": jnp.int32(min(opts.max_decode_steps or length, length)),
              # -inf: no live beam falls below it, so the stop never fires.
              "min_log_prob": jnp.float32(-np.inf if opts.min_log_prob is None
                                          else opts.min_log_prob)}
    with self._context():
      tokens, aux = self._predict_fn(opts, length)(self._params(params), self._place(batch),
                                                   jax.random.key(opts.seed), traced)
    return multihost.to_host(tokens), multihost.to_host(aux["scores"])

  def encode(self, inputs: np.ndarray, valid: np.ndarray, adapters=None) -> np.ndarray:
    """The encoder's last hidden states (what /v1/embeddings pools).

    Args:
      inputs: [b, i] int32 encoder tokens, 0-padded.
      valid: [b, i] bool, the positions attended to as keys: the real tokens, or also
        padding that is content (Flux / SD3's unmasked T5).
      adapters: as `generate`'s (each row's adapted encoder).

    Returns:
      [b, i, e] float32 numpy.
    """
    if not self.is_encoder_decoder:
      raise UserError("encode needs an encoder-decoder model")
    inputs, valid = np.asarray(inputs, np.int32), np.asarray(valid, bool)
    if inputs.ndim != 2 or valid.shape != inputs.shape:
      raise UserError(f"inputs and valid must be [batch, length] alike, got "
                      f"{list(inputs.shape)} and {list(valid.shape)}")
    ids = self._adapters(adapters, inputs.shape[0])
    model = self.model

    def encode(params, tokens, valid, adapters):
      with lora.row_adapters(adapters):
        return model.encode(params, tokens, valid)

    fn = self.compiled.get("encode", lambda: jax.jit(encode))
    with self._context():
      placed = self._place({"inputs": inputs, "valid": valid, "adapters": ids})
      out = multihost.to_host(fn(self.params, placed["inputs"], placed["valid"],
                                 placed["adapters"]))
    # A tuned prompt's positions come first (`nn.prompt`): the tokens' states are the last i.
    return out[:, out.shape[1] - inputs.shape[1]:]

  def warmup(self, kinds, batch_sizes, input_lengths, decode_lengths) -> int:
    """Compiles generation for every combination of the given Kinds and shapes (a run of
    one new token each, so the compiled start and advance functions, or the beam
    function, are cached). Returns the number of shapes compiled."""
    count = 0
    for kind in kinds:
      for b in batch_sizes:
        for i in input_lengths:
          inputs = np.zeros((b, i), np.int32)
          if self.is_encoder_decoder:
            inputs[:, 0] = self.eos_id  # an empty input: just EOS
          for length in decode_lengths:
            self.generate(kind, inputs, decode_length=length,
                          max_new_tokens=np.ones((b,), np.int32),
                          temperature=np.ones((b,), np.float32),
                          topp=np.zeros((b,), np.float32), stream=False)
            count += 1
    return count
