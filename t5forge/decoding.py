"""Decoding over a logits function and a KV cache: greedy, temperature / top-k / top-p
sampling, and beam search, with T5X's semantics (`t5x/decoding.py`), except that top-k
and top-p may both apply, in transformers' order (`t5forge.sampling`).

Every decode function has one contract:

    fn(inputs, cache, tokens_to_logits, eos_id, num_decodes, decode_rng, **kw)
        -> (decodes [b, n, l] int32, scores [b, n] float32)

Shape letters (docs/shapes.md): b batch, n num_decodes (samples or beams), l decode
length, v vocabulary; local to this module, f = b * n the flat batch the model sees, and
in `beam_search` k = n the beam count (the code's name for it).

- `inputs` [b, l] int32 are decoder input tokens: position 0 is BOS (always fed as 0);
  non-zero tokens at positions 1..p are a prompt that is forced, never overwritten and
  not scored; the zeros after it are decoded. The prompt must be contiguous.
- `decodes[:, j]` is the token at input position j + 1: the output is the inputs shifted
  left by one with the last position decoded too (T5X), so it holds the prompt, the new
  tokens, and zeros after the first generated EOS or after the step limit.
- Both axes n are sorted by increasing score: the best decode is `[:, -1]` (T5X).
- `cache` is any pytree. Every leaf with `ndim > cache_offset` has the batch b on axis
  `cache_offset` (0, or 1 for caches of `nn.scan`ned layers, [layers, b, ...]); it is
  repeated to f rows (the n copies of an example are adjacent: row e * n + j) and, in
  beam search, gathered by parent beam every step. Leaves with `ndim <= cache_offset`
  (a scalar cache index) are shared by all rows and passed through untouched; a shared
  leaf must be such a scalar, not a [1, ...] array (T5X's `cached_bias` would be one).
- `tokens_to_logits(DecodingState) -> (logits [f, v], new cache)`; the new cache must
  have the structure, shapes and dtypes of the old one (it is a loop carry).

Speed: each function is one `lax.while_loop` (no host round trip per token), jittable
as a whole. Shapes and `num_decodes`, `topk`, `max_decode_len`, `rescale_log_probs` and
`cache_offset` are static; `temperature`, `topp`, `alpha`, `max_decode_steps`,
`min_log_prob`, `initial_index`, `eos_id` and `decode_rng` may be traced, so callers can
change them without recompiling (`max_decode_steps` bounds each row's positions inside
the one loop; it never changes a shape). The cache is a loop carry that XLA updates in place; jit callers
can donate it.

Resumable sampling: `temperature_sample` is `sample_init` (a `SampleLoop` state pytree),
`sample_advance` (the loop, optionally bounded to a traced number of steps, so one
compiled function runs any chunk) and `sample_result`; a server streams by calling
`sample_advance` repeatedly on the returned state (`t5forge.generation`). The state also
records each generated token's log-prob and, optionally, the top-k log-probs.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from t5forge import sampling
from t5forge.errors import UserError

PyTree = Any

# "Effective negative infinity" for beam log-probs and scores (T5X's value). Finite, so
# that arithmetic on masked beams never produces NaN.
NEG_INF = -1.0e7
# Temperatures at or below this decode greedily: dividing by ~0 would overflow (T5X).
MIN_TEMPERATURE = 1e-4


@flax.struct.dataclass
class DecodingState:
  """What `tokens_to_logits` sees at each step (T5X's DecodingState).

  Attributes:
    cur_index: [f] int32 position of `cur_token` in `sequences`, per row. Rows that have
      finished keep their last index while others continue.
    sequences: [f, l] int32 decoder inputs so far (prompt and decoded tokens).
    cur_token: [f, 1] int32 the token to feed now.
    cache: the cache pytree with f rows.
  """
  cur_index: jax.Array
  sequences: jax.Array
  cur_token: jax.Array
  cache: PyTree


TokensToLogits = Callable[[DecodingState], tuple[jax.Array, PyTree]]


def is_eos(tokens: jax.Array, eos_id) -> jax.Array:
  """Which tokens end a decode (bool, the shape of tokens).

  Args:
    eos_id: one id (a Python int or a traced scalar): `tokens == eos_id`, as T5X; or a
      sequence / [e] array of ids, any of which ends it (instruction-tuned T5Gemma:
      (1, 107), <eos> and <end_of_turn>).
  """
  if np.ndim(eos_id) == 0:
    return tokens == eos_id
  ids = jnp.asarray(eos_id, jnp.int32).reshape(-1)
  return jnp.any(tokens[..., None] == ids, axis=-1)


def text_ids(ids: list[int], eos_id) -> list[int]:
  """The ids of a finished decode to detokenize (host side).

  With one EOS id, `ids` as they are (the vocabulary cuts at EOS and renders it as
  nothing). With several (`is_eos`; the first is the vocabulary's EOS), the ids before
  the first of them, plus that one only if it is the EOS: `<end_of_turn>` is a piece
  the vocabulary would render as text.
  """
  if np.ndim(eos_id) == 0:
    return ids
  stops = [int(i) for i in np.reshape(eos_id, -1)]
  at = next((j for j, t in enumerate(ids) if t in stops), None)
  if at is None:
    return ids
  return ids[:at + 1] if ids[at] == stops[0] else ids[:at]


def brevity_penalty(alpha, length):
  """T5X's length normaliser `((5 + length) / 6) ** alpha`; scores are log-prob / this."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def flat_batch_beam_expand(x: jax.Array, beam_size: int, offset: int = 0) -> jax.Array:
  """Repeats each example `beam_size` times along axis `offset`: [.., b, ..] -> [.., b*n, ..].

  Copies of one example are adjacent (row e * n + j), as T5X lays out beams.
  """
  return jnp.repeat(x, beam_size, axis=offset)


def _cache_map(fn: Callable[[jax.Array], jax.Array], cache: PyTree, offset: int) -> PyTree:
  """Applies fn to the cache leaves that have a batch axis; shared leaves pass through."""
  return jax.tree.map(lambda x: fn(x) if jnp.ndim(x) > offset else x, cache)


def _check_cache(cache: PyTree, batch: int, offset: int) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
    if jnp.ndim(x) > offset and jnp.shape(x)[offset] != batch:
      raise ValueError(f"cache leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(x)}: "
                       f"axis {offset} must be the batch ({batch}); make it a scalar if it "
                       "is shared by all examples")


def _take_beams(x: jax.Array, idx: jax.Array) -> jax.Array:
  """[b, m, ...] indexed by [b, n] along axis 1 -> [b, n, ...] (a batched gather)."""
  return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def _gather_cache_beams(cache: PyTree, parent: jax.Array, offset: int) -> PyTree:
  """Gives each of the f = b * k rows the cache of its parent beam.

  A gather batched over examples (not a gather over the flat f axis), so that the
  SPMD partitioner keeps a batch-sharded cache sharded; it moves k times fewer bytes
  than T5X's one-hot einsum.

  Args:
    cache: leaves [.., f, ...] with the flat batch on axis `offset`.
    parent: [b, k] int32 beam index (within its example) of each new beam.
  """
  b, k = parent.shape

  def gather(x):
    shape = x.shape
    # [.., b, k, ...]
    x = x.reshape(shape[:offset] + (b, k) + shape[offset + 1:])
    x = jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=offset), in_axes=(offset, 0),
                 out_axes=offset)(x, parent)
    return x.reshape(shape)

  return _cache_map(gather, cache, offset)


def _static(x) -> np.ndarray | None:
  """x as a numpy value when known at trace time (to validate it), else None."""
  if isinstance(x, jax.core.Tracer):
    return None
  return np.asarray(x)


def _per_row(x, name: str, batch: int, n: int) -> jax.Array:
  """A scalar, or one value per example [b] repeated to the flat batch [f]."""
  x = jnp.asarray(x, jnp.float32)
  if x.ndim == 0:
    return x
  if x.shape != (batch,):
    raise ValueError(f"{name} must be a scalar or have shape [{batch}], got {x.shape}")
  return jnp.repeat(x, n)


def _col(x: jax.Array) -> jax.Array:
  """Makes a scalar or [f] value broadcast against [f, v]."""
  return x[:, None] if x.ndim else x


def _check_num_decodes(num_decodes, what: str) -> int:
  if isinstance(num_decodes, bool) or not isinstance(num_decodes, (int, np.integer)) \
      or num_decodes < 1:
    raise UserError(f"num_decodes={num_decodes!r} is {what} and must be an integer >= 1; "
                    "set num_decodes to 1 or more")
  return int(num_decodes)


def _check_inputs(inputs) -> jax.Array:
  inputs = jnp.asarray(inputs)
  if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"inputs must be int tokens [batch, length], got {inputs.dtype}"
                     f"{list(inputs.shape)}")
  return inputs.astype(jnp.int32)


def _check_sampling_options(temperature, topk, topp, max_decode_steps, length: int) -> None:
  t = _static(temperature)
  if t is not None and np.any(t < 0):
    raise UserError(f"temperature={temperature} is negative; use 0 for greedy decoding or a "
                    "positive value to sample")
  if isinstance(topk, (jax.Array, np.ndarray)):  # per row, traced (sample_init's rows)
    k = _static(topk)
    if k is not None and np.any(k < 0):
      raise UserError(f"topk={k.tolist()} must be >= 0; use 0 to disable top-k")
  elif isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 0:
    raise UserError(f"topk={topk!r} must be a non-negative Python integer (it fixes a shape); "
                    "use 0 to disable top-k")
  p = _static(topp)
  if p is not None and np.any((p < 0) | (p > 1)):
    raise UserError(f"topp={topp} must be in [0, 1]; use 0 to disable nucleus sampling")
  _check_max_decode_steps(max_decode_steps, length)


def _check_max_decode_steps(max_decode_steps, length: int) -> None:
  s = _static(max_decode_steps) if max_decode_steps is not None else None
  if s is not None and np.any(s < 1):
    raise UserError(f"max_decode_steps={max_decode_steps} must be >= 1 (it counts new tokens "
                    "after the prompt); leave it None to decode the whole length")
  if s is not None and np.any(s > length):
    raise UserError(f"max_decode_steps={max_decode_steps} exceeds the decode length {length}; "
                    "lower max_decode_steps or lengthen the targets feature")


def _step_limit(prompt: jax.Array, index0: jax.Array, max_decode_steps, batch: int,
                n: int) -> jax.Array:
  """[f] int32: the last position a row may write, for max_decode_steps (None: no limit).

  The steps count after the prompt: the non-zero tokens of prompt[:, 1:] (forced
  contiguously from position 1), or everything up to `index0` when the cache is
  prefilled (a right-aligned prompt has zeros before its BOS).

  Args:
    prompt: [f, l + 1] int32 BOS, prompt, zeros. index0: [f] int32 first fed position.
  """
  last = prompt.shape[1] - 1
  if max_decode_steps is None:
    return jnp.full(prompt.shape[:1], last, jnp.int32)
  prompt_end = jnp.maximum(jnp.sum(prompt[:, 1:] != 0, axis=1, dtype=jnp.int32), index0)
  steps = jnp.broadcast_to(jnp.asarray(max_decode_steps, jnp.int32), (batch,))
  return jnp.minimum(prompt_end + flat_batch_beam_expand(steps, n), last)


# ------------------------------------------------------------------------------------
# Temperature sampling
# ------------------------------------------------------------------------------------


def _token_log_prob(logits: jax.Array, token: jax.Array) -> jax.Array:
  """log_softmax(logits)[token] per row: [f, v], [f] -> [f]."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]


def _greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return token, _token_log_prob(logits, token)


def _sample(logits, key, temperature, topk, topp, use_topp: bool,
            rescale_log_probs: bool) -> tuple[jax.Array, jax.Array]:
  """topk: a static int, or a traced [] / [f] int32 (per row, no compile per value)."""
  scaled = logits / _col(jnp.maximum(temperature, MIN_TEMPERATURE))
  if isinstance(topk, jax.Array):
    f = scaled.shape[0]
    k_rows, p_rows = jnp.broadcast_to(topk, (f,)), jnp.broadcast_to(topp, (f,))
    # The sort runs only while some row filters.
    needed = jnp.any((k_rows > 0) | ((p_rows > 0) & (p_rows < 1)))
    scaled = lax.cond(needed, lambda: sampling.filter_rows(scaled, k_rows, p_rows),
                      lambda: scaled)
  else:
    scaled = sampling.filter_static(scaled, topk, topp, use_topp)
  token = jax.random.categorical(key, scaled).astype(jnp.int32)
  return token, _token_log_prob(scaled if rescale_log_probs else logits, token)


class SampleLoop(NamedTuple):
  """The state of the sampling loop between calls (`sample_init` / `sample_advance` /
  `sample_result`); a pytree, so it can be a jit argument (the cache donated) and result.

  Shape letters: f = b * n flat rows, l the decode length, k = top_logprobs.
  """
  step: jax.Array  # [] int32 loop steps run so far (the sampling key is folded with it)
  cur_index: jax.Array  # [f] int32 position of the token fed next
  sequences: jax.Array  # [f, l + 1] int32 BOS, prompt, decoded tokens, zeros
  cache: PyTree
  ended: jax.Array  # [f] bool: generated EOS
  log_prob: jax.Array  # [f] float32 summed log-probs of the generated tokens
  start: jax.Array  # [f] int32 last prompt position: new tokens are written after it
  limit: jax.Array  # [f] int32 rows write positions < limit
  temperature: jax.Array  # [] or [f] float32
  topp: jax.Array  # [] or [f] float32
  topk: jax.Array  # [] or [f] int32: per-row top-k (sample_advance's topk=None reads it)
  rng: jax.Array  # PRNG key
  token_log_probs: jax.Array  # [f, l + 1] float32 log-prob of each generated token (else 0)
  top_ids: jax.Array  # [f, l + 1, k] int32 the k most likely tokens at each generated position
  top_log_probs: jax.Array  # [f, l + 1, k] float32 their log-probs (model's log-softmax)


def sample_init(inputs: jax.Array, cache: PyTree, *, decode_rng: jax.Array | None = None,
                num_decodes: int = 1, temperature=1.0, topk: int = 0, topp=0.0,
                initial_index: jax.Array | None = None, max_decode_steps=None,
                cache_offset: int = 0, top_logprobs: int = 0) -> SampleLoop:
  """The sampling loop before its first step (arguments as `temperature_sample`).

  Args:
    topk: a static int (as `temperature_sample`), or an array [] / [b] of per-row values
      kept in the state, read by `sample_advance(topk=None)`: one compiled function
      serves every top-k.
    top_logprobs: static k >= 0; also record the k most likely tokens and their
      log-probs (the model's log-softmax) at every generated position.

  Returns:
    a SampleLoop with f = b * num_decodes rows (the cache repeated to f rows).
  """
  inputs = _check_inputs(inputs)
  n = _check_num_decodes(num_decodes, "the number of samples per example")
  b, l = inputs.shape
  _check_sampling_options(temperature, topk, topp, max_decode_steps, l)
  _check_cache(cache, b, cache_offset)
  if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) \
      or top_logprobs < 0:
    raise UserError(f"top_logprobs={top_logprobs!r} must be a non-negative Python integer")
  f = b * n

  # [f, l + 1]: one slot more than inputs because the output is the inputs shifted left
  # with the last position decoded as well.
  sequences = jnp.pad(flat_batch_beam_expand(inputs, n), ((0, 0), (0, 1)))
  if initial_index is None:
    sequences = sequences.at[:, 0].set(0)  # T5X feeds BOS = 0 whatever inputs[:, 0] is
    index0 = jnp.zeros((f,), jnp.int32)
  else:
    index0 = flat_batch_beam_expand(jnp.asarray(initial_index, jnp.int32).reshape(b), n)
  # Rows may write positions < limit: the prompt plus max_decode_steps new tokens.
  limit = _step_limit(sequences, index0, max_decode_steps, b, n) + 1
  start = jnp.maximum(jnp.sum(sequences[:, 1:] != 0, axis=1, dtype=jnp.int32), index0)
  k = int(top_logprobs)
  return SampleLoop(
      step=jnp.zeros((), jnp.int32), cur_index=index0, sequences=sequences,
      cache=_cache_map(lambda x: flat_batch_beam_expand(x, n, cache_offset), cache,
                       cache_offset),
      ended=jnp.zeros((f,), bool), log_prob=jnp.zeros((f,), jnp.float32), start=start,
      limit=limit, temperature=_per_row(temperature, "temperature", b, n),
      topp=_per_row(topp, "topp", b, n),
      topk=_per_row(topk if isinstance(topk, (jax.Array, np.ndarray)) else 0, "topk", b,
                    n).astype(jnp.int32),
      rng=jax.random.PRNGKey(0) if decode_rng is None else decode_rng,
      token_log_probs=jnp.zeros((f, l + 1), jnp.float32),
      top_ids=jnp.zeros((f, l + 1, k), jnp.int32),
      top_log_probs=jnp.zeros((f, l + 1, k), jnp.float32))


def sample_done(s: SampleLoop) -> jax.Array:
  """[f] bool: the row generated EOS or reached its step limit."""
  return s.ended | (s.cur_index + 1 >= s.limit)


def sample_advance(s: SampleLoop, tokens_to_logits: TokensToLogits, *, eos_id: int,
                   topk: int | None = 0, greedy_only: bool = False, use_topp: bool = True,
                   rescale_log_probs: bool = True, steps=None) -> SampleLoop:
  """Runs the loop until every row is done, or for at most `steps` more steps.

  One `lax.while_loop`; `steps` may be traced (one compiled function serves any chunk
  size), None runs to the end. Resuming from the returned state gives exactly the
  tokens of one uninterrupted run (the sampling key is folded with the global step).

  Args:
    s: the state from `sample_init` or an earlier call.
    tokens_to_logits: the model step; see `DecodingState`.
    eos_id: end-of-sequence id (traceable), or several (see `is_eos`).
    topk, rescale_log_probs: static; as `temperature_sample`. topk=None: each row's
      from the state (`sample_init` given an array).
    greedy_only: static; decode argmax only (no sampling work per step).
    use_topp: static; False skips top-p's sort (when no row has topp in (0, 1)).
    steps: optional [] int32 bound on the steps of this call.
  """
  f, l1 = s.sequences.shape
  l = l1 - 1
  k = s.top_ids.shape[-1]
  positions = jnp.arange(l1, dtype=jnp.int32)
  temperature, topp = s.temperature, s.topp

  def next_token(logits, step, rng):
    """[f, v] -> (token [f], log-prob [f]) before forcing the prompt."""
    if greedy_only:
      return _greedy(logits)
    key = jax.random.fold_in(rng, step)
    k = s.topk if topk is None else topk
    sample = lambda: _sample(logits, key, temperature, k, topp, use_topp, rescale_log_probs)
    if temperature.ndim == 0:
      # Skip the sampling work (and top-p's sort) when the temperature is ~0.
      return lax.cond(temperature > MIN_TEMPERATURE, sample, lambda: _greedy(logits))
    (g_tok, g_lp), (s_tok, s_lp) = _greedy(logits), sample()
    hot = temperature > MIN_TEMPERATURE
    return jnp.where(hot, s_tok, g_tok), jnp.where(hot, s_lp, g_lp)

  def body(s: SampleLoop) -> SampleLoop:
    active = ~sample_done(s)  # [f]
    cur_token = jnp.take_along_axis(s.sequences, s.cur_index[:, None], axis=1)  # [f, 1]
    logits, new_cache = tokens_to_logits(DecodingState(
        cur_index=s.cur_index, sequences=s.sequences[:, :l], cur_token=cur_token,
        cache=s.cache))
    logits = logits.astype(jnp.float32)
    token, token_lp = next_token(logits, s.step, s.rng)
    nxt = jnp.minimum(s.cur_index + 1, l)  # [f]; clamped only for rows that are done
    prompt_token = jnp.take_along_axis(s.sequences, nxt[:, None], axis=1)[:, 0]
    forced = prompt_token != 0
    token = jnp.where(forced, prompt_token, token)
    generated = active & ~forced
    # Finished rows are never written, so their tail keeps the zeros of inputs.
    write = active[:, None] & (positions == nxt[:, None])  # [f, l + 1]
    record = generated[:, None] & write
    top_ids, top_lps = s.top_ids, s.top_log_probs
    if k:
      t_lp, t_id = lax.top_k(jax.nn.log_softmax(logits), k)  # [f, k]
      top_ids = jnp.where(record[:, :, None], t_id[:, None, :].astype(jnp.int32), top_ids)
      top_lps = jnp.where(record[:, :, None], t_lp[:, None, :], top_lps)
    return s._replace(
        step=s.step + 1,
        cur_index=jnp.where(active, nxt, s.cur_index),
        sequences=jnp.where(write, token[:, None], s.sequences),
        cache=new_cache,
        ended=s.ended | (generated & is_eos(token, eos_id)),
        log_prob=s.log_prob + jnp.where(generated, token_lp, 0.0),
        token_log_probs=jnp.where(record, token_lp[:, None], s.token_log_probs),
        top_ids=top_ids, top_log_probs=top_lps)

  if steps is None:
    cond = lambda s: jnp.any(~sample_done(s))
  else:
    stop = s.step + jnp.asarray(steps, jnp.int32)
    cond = lambda s: jnp.any(~sample_done(s)) & (s.step < stop)
  return lax.while_loop(cond, body, s)


def sample_result(s: SampleLoop, num_decodes: int) -> tuple[jax.Array, jax.Array, dict]:
  """The decodes of a (possibly unfinished) loop, sorted by score (best last).

  Returns:
    decodes [b, n, l] int32, scores [b, n] float32 and a dict of
    token_log_probs [b, n, l] (0 at prompt and unwritten positions), top_ids [b, n, l, k],
    top_log_probs [b, n, l, k], lengths [b, n] int32 (new tokens after the prompt, EOS
    included), finished [b, n] bool (generated EOS), done [b, n] bool (EOS or limit);
    position j is input position j + 1, as decodes.
  """
  n = num_decodes
  f, l1 = s.sequences.shape
  b, l = f // n, l1 - 1
  k = s.top_ids.shape[-1]
  decodes = s.sequences[:, 1:].reshape(b, n, l)
  scores = s.log_prob.reshape(b, n)
  aux = {"token_log_probs": s.token_log_probs[:, 1:].reshape(b, n, l),
         "top_ids": s.top_ids[:, 1:].reshape(b, n, l, k),
         "top_log_probs": s.top_log_probs[:, 1:].reshape(b, n, l, k),
         "lengths": (s.cur_index - s.start).reshape(b, n),
         "finished": s.ended.reshape(b, n), "done": sample_done(s).reshape(b, n)}
  if n == 1:
    return decodes, scores, aux
  order = jnp.argsort(scores, axis=1)  # [b, n] increasing: best last
  aux = {name: _take_beams(x, order) for name, x in aux.items()}
  return _take_beams(decodes, order), jnp.take_along_axis(scores, order, axis=1), aux


def temperature_sample(inputs: jax.Array, cache: PyTree, tokens_to_logits: TokensToLogits,
                       eos_id: int, decode_rng: jax.Array | None = None, num_decodes: int = 1,
                       temperature=1.0, topk: int = 0, topp=0.0,
                       initial_index: jax.Array | None = None, max_decode_steps=None,
                       rescale_log_probs: bool = True,
                       cache_offset: int = 0) -> tuple[jax.Array, jax.Array]:
  """Greedy decoding and temperature / top-k / top-p sampling (T5X's temperature_sample).

  Every row decodes until it generates `eos_id` (or one of several; later positions stay
  0) or fills its length; the loop ends when all rows are done. It is `sample_init`, one unbounded
  `sample_advance` and `sample_result`.

  Args:
    inputs: [b, l] int32 decoder inputs: BOS at 0, an optional forced prompt, zeros.
    cache: the cache for b examples (see the module docstring).
    tokens_to_logits: the model step; see `DecodingState`.
    eos_id: end-of-sequence id, or a sequence of ids any of which ends a row (`is_eos`).
    decode_rng: PRNG key for sampling; None uses PRNGKey(0) (T5X). Unused if greedy.
    num_decodes: static; independent samples per example.
    temperature: scalar or [b] (traceable). <= 1e-4 is greedy (argmax); a Python 0
      compiles a greedy-only loop.
    topk: static; if > 0 sample among the topk largest logits (ties included).
    topp: scalar or [b] (traceable); if in (0, 1) sample from the smallest set of top
      tokens with probability >= topp, renormalised over what top-k kept (the order of
      transformers and vLLM; T5X refuses both); one sort per step while a row uses it.
    initial_index: optional [b] int32 position of the last token already in the cache
      (a prefilled decoder-only prompt): decoding feeds `inputs[e, initial_index[e]]`
      first and writes from the next position; positions up to it are kept.
    max_decode_steps: optional scalar or [b] (traceable): at most this many positions
      after the prompt are decoded (the prompt is the non-zero tokens of inputs[:, 1:],
      or the positions up to initial_index if that is later).
    rescale_log_probs: static; score sampled tokens with the distribution they were
      drawn from (after temperature, top-k, top-p) instead of the model's softmax.
    cache_offset: static; the batch axis of the cache leaves.

  Returns:
    decodes [b, n, l] int32 and scores [b, n] float32 (the summed log-probs of the
    decoded, non-prompt tokens incl. EOS), sorted by increasing score (best last).
    Greedy rows are scored with the model's log-softmax.
  """
  # Read static values before any jnp op: under jit those return tracers.
  t_static, p_static = _static(temperature), _static(topp)
  state = sample_init(inputs, cache, decode_rng=decode_rng, num_decodes=num_decodes,
                      temperature=temperature, topk=topk, topp=topp,
                      initial_index=initial_index, max_decode_steps=max_decode_steps,
                      cache_offset=cache_offset)
  greedy_only = t_static is not None and bool(np.all(t_static <= MIN_TEMPERATURE))
  use_topp = p_static is None or bool(np.any((p_static > 0) & (p_static < 1)))
  state = sample_advance(state, tokens_to_logits, eos_id=eos_id, topk=topk,
                         greedy_only=greedy_only, use_topp=use_topp,
                         rescale_log_probs=rescale_log_probs)
  decodes, scores, _ = sample_result(state, int(num_decodes))  # validated by sample_init
  return decodes, scores


# ------------------------------------------------------------------------------------
# Beam search
# ------------------------------------------------------------------------------------


class _BeamState(NamedTuple):
  cur_index: jax.Array  # [b] int32 position of the tokens fed next (same for all beams)
  live_log_probs: jax.Array  # [b, k] float32, increasing
  live_seqs: jax.Array  # [b, k, l + 1] int32
  finished_scores: jax.Array  # [b, k] float32, increasing
  finished_seqs: jax.Array  # [b, k, l + 1] int32
  finished_flags: jax.Array  # [b, k] bool: slot holds a real finished sequence
  cache: PyTree  # rows f = b * k
  # With log_probs: per position of live_seqs / finished_seqs, the token's log-prob
  # [b, k, l + 1] and the top alternatives' ids and log-probs [b, k, l + 1, K]; else None.
  live_tok: Any = None
  finished_tok: Any = None


def portable_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k`'s result from max and min reductions: the k largest values of x [..., n]
  (no NaN) and their indices [..., k] int32, ties lower index first as `lax.top_k`.

  For a consumer older than the StableHLO that `lax.top_k` serializes to (a `chlo.top_k`
  composite, which TensorFlow 2.21's XlaCallModule cannot read). k passes of two
  reductions each: for beam search's small k far cheaper than a sort of the n = beams x
  vocabulary candidates (on this Xeon's CPU, 4 x 32128 candidates, k = 8: a stable sort
  42 ms, this 1.1 ms, lax.top_k 0.2 ms).
  """
  n = x.shape[-1]
  index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  taken = jnp.zeros(x.shape, bool)
  values, indices = [], []
  for _ in range(k):
    best = jnp.max(jnp.where(taken, -jnp.inf, x), axis=-1, keepdims=True)
    # The lowest untaken index holding it (a taken -inf must not win a tie with -inf).
    at = jnp.min(jnp.where((x == best) & ~taken, index, n), axis=-1, keepdims=True)
    values.append(best[..., 0])
    indices.append(at[..., 0])
    taken = taken | (index == at)
  return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def beam_search(inputs: jax.Array, cache: PyTree, tokens_to_logits: TokensToLogits,
                eos_id: int, num_decodes: int = 4, alpha=0.6, max_decode_len: int | None = None,
                decode_rng: jax.Array | None = None, initial_index: jax.Array | None = None,
                max_decode_steps=None, min_log_prob=None,
                cache_offset: int = 0, log_probs: int | None = None, top_k=lax.top_k):
  """T5X's beam search: k live and k finished beams, top-2k candidates per step.

  A finished sequence (ending in EOS at position `length`, counted from 1 and including
  the prompt) scores `log_prob / brevity_penalty(alpha, length)`. An example stops when
  it is at the end, after `max_decode_steps` new tokens, when its best live log-prob
  falls below `min_log_prob`, or when no live beam, even at the most favourable length,
  can beat its worst finished one (that last stop never changes the result). Forced
  prompt tokens keep only the best beam alive and add nothing to its log-prob; a forced
  EOS ends that beam (score 0 / penalty) and so the example (T5X: its `newly_finished`
  does not tell forced from generated EOS; T5X's other beams of that example are
  continuations of dead fillers, ours stay fillers).

  Stopping is decided per example; T5X stops the whole batch at once for
  `max_decode_step` and `min_log_prob` (an example goes on while any other passes), so
  with batch size 1, or a limit every example reaches together, the results are T5X's,
  and ours do not depend on the other examples of a batch.

  Args:
    inputs: [b, l] int32 decoder inputs: BOS at 0, an optional forced prompt, zeros.
    cache: the cache for b examples (see the module docstring).
    tokens_to_logits: the model step; see `DecodingState`.
    eos_id: end-of-sequence id, or a sequence of ids any of which ends a row (`is_eos`).
    num_decodes: static; the beam size k.
    alpha: brevity-penalty exponent (traceable); 0 ranks by plain log-prob.
    max_decode_len: static; the output length (default l); inputs are cut or padded.
    decode_rng: unused (the contract's argument).
    initial_index: optional [b] int32 position of the last token already in the cache
      (a prefilled decoder-only prompt); decoding writes from the next position.
    max_decode_steps: optional scalar or [b] (traceable): decode at most this many new
      tokens after the prompt (its non-zero tokens of inputs[:, 1:], or the positions up
      to initial_index if that is later); later positions are 0. T5X's beam_search calls
      it `max_decode_step` and counts loop steps, which is the same with initial_index or
      without a prompt.
    min_log_prob: optional scalar or [b] (traceable): after the first step, stop an
      example when its best live beam's log-prob (the raw sum, no brevity penalty)
      is below this (T5X). What it returns is as at any stop: its finished beams if
      it has any, else its live ones.
    cache_offset: static; the batch axis of the cache leaves.
    log_probs: static; None, or K >= 0: also carry, with each beam, every token's
      log-prob under the model's log-softmax (0 for forced prompt tokens, which add
      nothing to a beam's log-prob) and the K most likely tokens per position.

  Returns:
    decodes [b, k, max_decode_len] int32 and scores [b, k] float32, increasing (best
    last). Slots without a finished sequence have scores <= NEG_INF / penalty; an
    example with no finished sequence at all returns its live beams and their
    unpenalised log-probs (T5X). With log_probs, a third value: a dict of
    `token_log_probs` [b, k, max_decode_len] float32 (0 after the end; their sum is the
    beam's log-prob, its score times the brevity penalty), `top_ids` int32 and
    `top_log_probs` float32 [b, k, max_decode_len, K].
    top_k: static; the k-largest function, `lax.top_k` or `portable_top_k` (the same
      result, for a TensorFlow SavedModel).
  """
  del decode_rng
  inputs = _check_inputs(inputs)
  k = _check_num_decodes(num_decodes, "the beam size")
  if log_probs is not None and (isinstance(log_probs, bool) or
                                not isinstance(log_probs, (int, np.integer)) or log_probs < 0):
    raise UserError(f"log_probs={log_probs!r} must be None or an integer >= 0 (top tokens "
                    "per position)")
  b, l = inputs.shape
  if max_decode_len is not None:
    if isinstance(max_decode_len, bool) or not isinstance(max_decode_len, (int, np.integer)) \
        or max_decode_len < 1:
      raise UserError(f"max_decode_len={max_decode_len!r} must be an integer >= 1; leave it "
                      "None to use the length of inputs")
    l = int(max_decode_len)
  _check_max_decode_steps(max_decode_steps, l)
  _check_cache(cache, b, cache_offset)
  f = b * k

  # [b, l + 1]: BOS, prompt, zeros, and the slot of the last prediction.
  prompt = jnp.pad(inputs, ((0, 0), (0, 1)))[:, :l + 1]
  prompt = jnp.pad(prompt, ((0, 0), (0, l + 1 - prompt.shape[1])))
  if initial_index is None:
    prompt = prompt.at[:, 0].set(0)
    index0 = jnp.zeros((b,), jnp.int32)
  else:
    index0 = jnp.asarray(initial_index, jnp.int32).reshape(b)
  alpha = jnp.asarray(alpha, jnp.float32)
  positions = jnp.arange(l + 1, dtype=jnp.int32)
  # [b] the last position an example may write.
  limit = _step_limit(prompt, index0, max_decode_steps, b, 1)
  min_lp = jnp.float32(-jnp.inf) if min_log_prob is None else _per_row(
      min_log_prob, "min_log_prob", b, 1)

  def done(s: _BeamState) -> jax.Array:
    """[b] bool: at its limit, below min_log_prob, or the finished set is final."""
    best_lp = jnp.max(s.live_log_probs, axis=1)
    # Log-probs only fall as tokens are added, so a live beam's best final score is its
    # log-prob over the largest penalty it can still reach (any sign of alpha).
    max_penalty = jnp.maximum(brevity_penalty(alpha, limit),
                              brevity_penalty(alpha, s.cur_index + 1))
    worst_finished = jnp.min(s.finished_scores, axis=1)
    hopeless = jnp.all(s.finished_flags, axis=1) & (worst_finished > best_lp / max_penalty)
    started = s.cur_index > index0
    # The prompt token just fed is EOS: its beam finished and only fillers live.
    ended_in_prompt = started & is_eos(
        jnp.take_along_axis(prompt, s.cur_index[:, None], axis=1)[:, 0], eos_id)
    return (s.cur_index >= limit) | hopeless | (started & (best_lp < min_lp)) | ended_in_prompt

  def body(s: _BeamState) -> _BeamState:
    active = ~done(s)  # [b]
    # [b, k, 1] -> [f, 1]
    cur_token = jnp.take_along_axis(s.live_seqs, s.cur_index[:, None, None], axis=2)
    logits, new_cache = tokens_to_logits(DecodingState(
        cur_index=flat_batch_beam_expand(s.cur_index, k),
        sequences=s.live_seqs[:, :, :l].reshape(f, l), cur_token=cur_token.reshape(f, 1),
        cache=s.cache))
    v = logits.shape[-1]
    token_lp = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(b, k, v)
    # [b, k, v]: log-prob of every one-token extension of every live beam.
    ext_lp = token_lp + s.live_log_probs[:, :, None]
    # Keep 2k candidates so that k survive even if k of them end with EOS: [b, 2k].
    cand_lp, flat_idx = top_k(ext_lp.reshape(b, k * v), 2 * k)
    cand_beam, cand_tok = flat_idx // v, (flat_idx % v).astype(jnp.int32)

    nxt = jnp.minimum(s.cur_index + 1, l)  # [b]
    prompt_token = jnp.take_along_axis(prompt, nxt[:, None], axis=1)  # [b, 1]
    forced = prompt_token != 0  # [b, 1]
    # Inside the prompt only the best beam continues, with the forced token and its
    # log-prob unchanged; the other candidates become fillers (T5X).
    best_beam = jnp.argmax(s.live_log_probs, axis=1)[:, None]
    prompt_lp = jnp.where(jnp.arange(2 * k) == 0, jnp.max(s.live_log_probs, axis=1)[:, None],
                          NEG_INF)
    cand_beam = jnp.where(forced, best_beam, cand_beam)
    cand_tok = jnp.where(forced, prompt_token, cand_tok)
    cand_lp = jnp.where(forced, prompt_lp, cand_lp)
    # [b, 2k, l + 1]
    at_nxt = positions == nxt[:, None, None]  # [b, 1, l + 1]
    cand_seqs = _take_beams(s.live_seqs, cand_beam)
    cand_seqs = jnp.where(at_nxt, cand_tok[:, :, None], cand_seqs)
    if tracked:
      # The new token's own log-prob (0 when forced) and its parent's top alternatives.
      own = jnp.where(forced, 0.0,
                      jnp.take_along_axis(token_lp.reshape(b, k * v), flat_idx, axis=1))
      top_lp, top_id = top_k(token_lp, top)  # [b, k, K]
      lp_seq, id_seq, tlp_seq = (_take_beams(x, cand_beam) for x in s.live_tok)
      cand_tok_arrays = (
          jnp.where(at_nxt, own[:, :, None], lp_seq),
          jnp.where(at_nxt[..., None], _take_beams(top_id, cand_beam)[:, :, None], id_seq),
          jnp.where(at_nxt[..., None], _take_beams(top_lp, cand_beam)[:, :, None], tlp_seq))
    # A forced EOS ends its beam too, as in T5X.
    cand_ended = is_eos(cand_tok, eos_id)

    # Live: the best k candidates that did not end. Increasing order, as T5X.
    live_lp = cand_lp + cand_ended * NEG_INF
    live_pick = jnp.flip(top_k(live_lp, k)[1], axis=1)  # [b, k]
    parent = jnp.take_along_axis(cand_beam, live_pick, axis=1)
    new_cache = _gather_cache_beams(new_cache, parent, cache_offset)

    # Finished: the best k of the old finished and the candidates that just ended.
    cand_scores = cand_lp / brevity_penalty(alpha, nxt)[:, None] + (~cand_ended) * NEG_INF
    all_scores = jnp.concatenate([s.finished_scores, cand_scores], axis=1)  # [b, 3k]
    fin_pick = jnp.flip(top_k(all_scores, k)[1], axis=1)
    # Live sequences carry the rest of the prompt; a finished one is 0 after its EOS.
    cand_done = jnp.where(positions <= nxt[:, None, None], cand_seqs, 0)
    all_seqs = jnp.concatenate([s.finished_seqs, cand_done], axis=1)
    all_flags = jnp.concatenate([s.finished_flags, cand_ended], axis=1)

    # Examples that are done keep their beams while the others continue.
    keep = lambda new, old: jnp.where(active.reshape((b,) + (1,) * (old.ndim - 1)), new, old)
    live_tok = finished_tok = None
    if tracked:
      ended_mask = positions <= nxt[:, None, None]
      done_arrays = (jnp.where(ended_mask, cand_tok_arrays[0], 0.0),
                     jnp.where(ended_mask[..., None], cand_tok_arrays[1], 0),
                     jnp.where(ended_mask[..., None], cand_tok_arrays[2], 0.0))
      live_tok = tuple(keep(_take_beams(x, live_pick), old)
                       for x, old in zip(cand_tok_arrays, s.live_tok))
      finished_tok = tuple(
          keep(_take_beams(jnp.concatenate([old, x], axis=1), fin_pick), old)
          for x, old in zip(done_arrays, s.finished_tok))
    return _BeamState(
        cur_index=jnp.where(active, nxt, s.cur_index),
        live_log_probs=keep(jnp.take_along_axis(live_lp, live_pick, axis=1), s.live_log_probs),
        live_seqs=keep(_take_beams(cand_seqs, live_pick), s.live_seqs),
        finished_scores=keep(jnp.take_along_axis(all_scores, fin_pick, axis=1),
                             s.finished_scores),
        finished_seqs=keep(_take_beams(all_seqs, fin_pick), s.finished_seqs),
        finished_flags=keep(jnp.take_along_axis(all_flags, fin_pick, axis=1),
                            s.finished_flags),
        cache=new_cache, live_tok=live_tok, finished_tok=finished_tok)

  tracked = log_probs is not None
  top = int(log_probs or 0)
  zeros_tok = None
  if tracked:
    zeros_tok = (jnp.zeros((b, k, l + 1), jnp.float32), jnp.zeros((b, k, l + 1, top), jnp.int32),
                 jnp.zeros((b, k, l + 1, top), jnp.float32))

  init = _BeamState(
      cur_index=index0,
      # Only beam 0 is real at first; the others are fillers that never win.
      live_log_probs=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
      live_seqs=jnp.broadcast_to(prompt[:, None, :], (b, k, l + 1)),
      finished_scores=jnp.full((b, k), NEG_INF, jnp.float32),
      finished_seqs=jnp.zeros((b, k, l + 1), jnp.int32),
      finished_flags=jnp.zeros((b, k), bool),
      cache=_cache_map(lambda x: flat_batch_beam_expand(x, k, cache_offset), cache,
                       cache_offset),
      live_tok=zeros_tok, finished_tok=zeros_tok)
  final = lax.while_loop(lambda s: jnp.any(~done(s)), body, init)

  any_finished = jnp.any(final.finished_flags, axis=1)  # [b]
  pick = lambda fin, live: jnp.where(
      any_finished.reshape((b,) + (1,) * (fin.ndim - 1)), fin, live)
  seqs = pick(final.finished_seqs, final.live_seqs)
  scores = pick(final.finished_scores, final.live_log_probs)
  if not tracked:
    return seqs[:, :, 1:], scores
  lp, ids, tlp = (pick(fin, live)[:, :, 1:] for fin, live in
                  zip(final.finished_tok, final.live_tok))
  return seqs[:, :, 1:], scores, {"token_log_probs": lp, "top_ids": ids, "top_log_probs": tlp}
