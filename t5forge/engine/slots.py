"""The device side of the engine: a fixed number of decode slots and the two compiled
functions that act on them.

    slots = Slots(model, params, num_slots=16, decode_length=128, input_buckets=(64, 256),
                  encode_sizes=(1, 4, 16), steps=4)
    slots.warmup()                      # compiles (and times) insert per size x bucket, and step
    slots.insert(rows, at=[3, 7])       # encode 2 prompts into slots 3 and 7
    out = slots.step()                  # `steps` decode steps for every slot

A slot holds one decode: the decoder's cache (its self-attention keys/values, the
encoder's keys/values projected once at insert, the encoder's padding mask, and its own
position), its last token, how many tokens it may still write, its sampling options and
its PRNG key, vLLM's decode controls (min_tokens, ignore_eos), and which LoRA adapter
it decodes with (a model of stacked adapters, `t5forge.nn.lora`; 0 is the base: its
encoder runs and its decoder steps pick that adapter's weights per row, so requests for
different adapters share one step and one compiled function). Everything is one
pytree (`SlotState`) that both functions take donated, so XLA updates it in place; with
a partitioner its slot axis is split over the data axes.

Each row is independent of the others: its position (T5's relative bias, RoPE, sliding
windows, T5Gemma 2's merged attention all read it per row), its temperature / top-k /
top-p, and its key: token j of a request with seed s and sample index i is drawn with
`fold_in(fold_in(key(s), i), j)`, so its text never depends on which requests share the
step.

Shape letters (docs/shapes.md): s slots, l the decode length (cache positions), i an
input bucket, I the largest, e rows of one insert, k steps per call, K top log-probs, v
vocabulary.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from t5forge import decoding, multihost, sampling
from t5forge.errors import UserError
from t5forge.nn import lora
from t5forge.sharding import Partitioner

TOP_LOGPROBS = 5  # top log-probs computed for every token (OpenAI's limit)


class SlotState(NamedTuple):
  """The engine's device state; every leaf but the cache's is [s, ...]."""
  cache: Any  # the decoder's cache for s rows; its "index" leaf is [s]
  token: jax.Array  # [s] int32 the token fed next (0: BOS)
  limit: jax.Array  # [s] int32 new tokens the row may write
  ended: jax.Array  # [s] bool: generated a stop id
  active: jax.Array  # [s] bool: holds a request
  temperature: jax.Array  # [s] float32 (<= 1e-4: greedy)
  top_k: jax.Array  # [s] int32 (0: off)
  top_p: jax.Array  # [s] float32 (0 or 1: off)
  key: jax.Array  # [s, 2] uint32 the row's key (`jax.random.key_data`)
  min_tokens: jax.Array  # [s] int32 stop ids cannot be drawn before this many new tokens
  ignore_eos: jax.Array  # [s] bool: a stop id does not end the row (it runs to its limit)
  adapter: jax.Array  # [s] int32 the row's LoRA adapter (0: the base; `lora.row_adapters`)


class StepOut(NamedTuple):
  """What one `step` call returns (numpy, on the host); position j of a row is its j-th
  decode step of this call, valid where `emitted` is set."""
  tokens: np.ndarray  # [s, k] int32
  logprobs: np.ndarray  # [s, k] float32 as sampled (T5X's rescale_log_probs)
  top_ids: np.ndarray  # [s, k, K] int32 most likely tokens (model's log-softmax)
  top_logprobs: np.ndarray  # [s, k, K] float32
  emitted: np.ndarray  # [s, k] bool


@dataclasses.dataclass(frozen=True)
class InsertRow:
  """One decode to place in a slot (host values, validated by the scheduler)."""
  ids: list[int]  # encoder tokens ending in EOS
  max_new_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  sample: int = 0  # which of a request's n samples
  min_tokens: int = 0  # stop ids are masked until this many new tokens (vLLM's min_tokens)
  ignore_eos: bool = False  # stop ids do not end the row (vLLM's ignore_eos)
  adapter: int = 0  # the stacked LoRA adapter it decodes with (0: the base)


def _leaf_name(path) -> str:
  last = path[-1]
  return str(getattr(last, "key", getattr(last, "name", last)))


def _axis_of_difference(a, b) -> int | None:
  """The one axis where two shapes differ, None if they agree."""
  diff = [d for d, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
  return diff[0] if diff else None


def sample_tokens(logits: jax.Array, lp: jax.Array, key: jax.Array, position: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  running: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token per row with its own options: [s, v] float32 logits (and their
  log-softmax `lp`) -> (token [s] int32, its log-prob [s]).

  Greedy rows (temperature <= 1e-4) take the argmax, scored by the model's log-softmax.
  Sampled rows divide by the temperature, keep their top_k tokens (ties with the k-th
  kept), then the smallest set whose mass among those is >= top_p (the top token
  always; transformers' and vLLM's order, `t5forge.sampling`), and draw with
  `fold_in(key, position)`; they are scored under the distribution drawn from.
  One sort per call, only when some running row filters.
  """
  greedy = temperature <= decoding.MIN_TEMPERATURE
  scaled = logits / jnp.maximum(temperature, decoding.MIN_TEMPERATURE)[:, None]
  needed = jnp.any(running & ~greedy & ((top_k > 0) | ((top_p > 0) & (top_p < 1))))
  scaled = lax.cond(needed, lambda: sampling.filter_rows(scaled, top_k, top_p), lambda: scaled)
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  pick = lambda x, t: jnp.take_along_axis(x, t[:, None], axis=-1)[:, 0]

  def draw():
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key), position)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    token = jnp.where(greedy, best, drawn)
    return token, jnp.where(greedy, pick(lp, token),
                            pick(jax.nn.log_softmax(scaled, axis=-1), token))

  # Random bits for [s, v] cost more than the model step of a small model: skip them
  # when every running row is greedy.
  return lax.cond(jnp.any(running & ~greedy), draw, lambda: (best, pick(lp, best)))


class Slots:
  """The slot state of one encoder-decoder model and its compiled insert and step.

  Args:
    model: a `t5forge.models.EncoderDecoderModel`.
    params: its parameters, placed.
    num_slots: s, decodes in flight at most.
    decode_length: l, the most new tokens a row may ask for (its cache length).
    input_buckets: the encoder lengths insert is compiled for (the largest is I).
    encode_sizes: the row counts insert is compiled for (each <= num_slots).
    steps: k, decode steps per `step` call.
    partitioner: the mesh the parameters are on (default: one device); the slot axis is
      split over its data axes when s divides them.
  """

  def __init__(self, model, params, *, num_slots: int, decode_length: int,
               input_buckets: tuple[int, ...], encode_sizes: tuple[int, ...], steps: int = 4,
               partitioner=None):
    if not model.config.is_encoder_decoder:
      raise UserError("the slot engine runs encoder-decoder models; a decoder-only model is "
                      "served by the static batcher (--scheduler static)")
    self.model, self.params = model, params
    self.partitioner = partitioner or Partitioner()
    self.num_slots, self.decode_length = int(num_slots), int(decode_length)
    self.input_buckets = tuple(sorted(input_buckets))
    self.encode_sizes = tuple(sorted(encode_sizes))
    self.steps = int(steps)
    self.stop_ids = model.stop_ids
    self.eos_id = int(model.eos_id)
    self._axes = self._probe_axes()
    self._key_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    self.state_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                           for x in jax.tree.leaves(self._abstract_state()))
    # Explicit output shardings: the state keeps one layout, so each function compiles once.
    shardings = self._state_shardings()
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,), out_shardings=shardings)
    self._step = jax.jit(self._step_fn, donate_argnums=(1,),
                         out_shardings=(shardings, self.partitioner.replicated()))
    self.state = None
    # {input bucket: {row count: seconds of one insert call}}, timed by `warmup`.
    self.insert_seconds: dict[int, dict[int, float]] = {}
    self._plans: dict[tuple[int, int], tuple[int, ...]] = {}

  # -- layout -------------------------------------------------------------------------------
  def _new_cache(self, params, tokens, adapter=None):
    """The encoder run and a fresh decoder cache for tokens [e, i] (cache length l),
    each row with its adapter `adapter` [e] int32 (None: the base)."""
    if adapter is None:
      adapter = jnp.zeros(tokens.shape[:1], jnp.int32)
    with lora.row_adapters(adapter):
      return self.model.decode_setup(params, {"encoder_input_tokens": tokens},
                                     self.decode_length).cache

  def _probe_axes(self) -> dict:
    """{leaf path: (slot axis or None, encoder-length axis or None)} of the cache, read
    from the abstract caches of a few shapes (no family-specific knowledge)."""
    abstract = self.model.abstract_params()
    shape = lambda e, i: jax.eval_shape(self._new_cache, abstract,
                                        jax.ShapeDtypeStruct((e, i), jnp.int32))
    base, rows, longer = shape(1, 2), shape(2, 2), shape(1, 3)
    axes = {}
    for (path, a), b, c in zip(jax.tree_util.tree_flatten_with_path(base)[0],
                               jax.tree.leaves(rows), jax.tree.leaves(longer)):
      axes[jax.tree_util.keystr(path)] = (_axis_of_difference(a, b), _axis_of_difference(a, c))
    return axes

  def _abstract_state(self) -> SlotState:
    s = self.num_slots
    cache = jax.eval_shape(self._new_cache, self.model.abstract_params(),
                           jax.ShapeDtypeStruct((s, self.input_buckets[-1]), jnp.int32))
    cache = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((s,), jnp.int32) if x.ndim == 0 else x, cache)
    vec = lambda dtype: jax.ShapeDtypeStruct((s,), dtype)
    return SlotState(cache=cache, token=vec(jnp.int32), limit=vec(jnp.int32),
                     ended=vec(bool), active=vec(bool), temperature=vec(jnp.float32),
                     top_k=vec(jnp.int32), top_p=vec(jnp.float32),
                     key=jax.ShapeDtypeStruct((s,) + self._key_shape, jnp.uint32),
                     min_tokens=vec(jnp.int32), ignore_eos=vec(bool), adapter=vec(jnp.int32))

  def _state_shardings(self):
    """Slot axes split over the data axes when s divides them, else replicated."""
    p = self.partitioner
    split = self.num_slots % p.num_data_shards == 0 and p.data_axes

    def one(path, x):
      name = jax.tree_util.keystr(path)
      axis = 0
      if name.startswith(".cache"):
        axis = self._axes[name.removeprefix(".cache")][0]
        axis = 0 if axis is None else axis  # the index: [s] here, a scalar when probed
      if not split or x.ndim == 0:
        return p.replicated()
      spec = [None] * x.ndim
      spec[axis] = p.data_axes
      return jax.sharding.NamedSharding(p.mesh, jax.sharding.PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, self._abstract_state())

  def _context(self):
    return self.partitioner.activation_context()

  def reset(self) -> None:
    """Makes the state: every slot free."""
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), self._abstract_state())
    self.state = jax.device_put(zeros, self._state_shardings())

  def sound(self) -> bool:
    """Whether the state can be used: made, and none of its buffers consumed by a call
    that took them donated and then failed."""
    return self.state is not None and not any(
        x.is_deleted() for x in jax.tree.leaves(self.state))

  # -- compiled functions ---------------------------------------------------------------------
  def _insert_fn(self, params, state: SlotState, tokens, at, limit, temperature, top_k, top_p,
                 seed, sample, min_tokens, ignore_eos, adapter) -> SlotState:
    """Encodes tokens [e, i] and writes the rows into slots `at` [e] (an index >= s
    writes nothing: a padding row). The other arguments are [e]."""
    new = self._new_cache(params, tokens, adapter)
    e, i = tokens.shape
    big_i = self.input_buckets[-1]

    def put(path, old, fresh):
      slot_axis, enc_axis = self._axes[jax.tree_util.keystr(path)]
      if fresh.ndim == 0:  # the shared position index: one per row from now on
        fresh, slot_axis = jnp.zeros((e,), old.dtype), 0
      if enc_axis is not None and i < big_i:
        pad = [(0, 0)] * fresh.ndim
        pad[enc_axis] = (0, big_i - i)
        fresh = jnp.pad(fresh, pad)  # padded encoder keys are masked (encoder_valid False)
      index = (slice(None),) * slot_axis + (at,)
      return old.at[index].set(fresh.astype(old.dtype), mode="drop")

    cache = jax.tree_util.tree_map_with_path(put, state.cache, new)
    keys = jax.vmap(lambda s, j: jax.random.key_data(
        jax.random.fold_in(jax.random.key(s), j)))(seed, sample)
    set_ = lambda old, x: old.at[at].set(x.astype(old.dtype), mode="drop")
    return SlotState(cache=cache, token=set_(state.token, jnp.zeros((e,), jnp.int32)),
                     limit=set_(state.limit, limit),
                     ended=set_(state.ended, jnp.zeros((e,), bool)),
                     active=set_(state.active, jnp.ones((e,), bool)),
                     temperature=set_(state.temperature, temperature),
                     top_k=set_(state.top_k, top_k), top_p=set_(state.top_p, top_p),
                     key=set_(state.key, keys), min_tokens=set_(state.min_tokens, min_tokens),
                     ignore_eos=set_(state.ignore_eos, ignore_eos),
                     adapter=set_(state.adapter, adapter))

  def _index_of(self, cache):
    return next(x for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]
                if _leaf_name(path) == "index")

  def _mask_stops(self, logits, rows):
    """logits [s, v] with the stop ids' columns set to -inf in `rows` [s] bool: an
    update of [s, stops] in place, so a step where no row masks costs what it did."""
    stops = np.reshape(self.stop_ids, -1).astype(np.int32)
    cols = logits[:, stops]
    return logits.at[:, stops].set(jnp.where(rows[:, None], -jnp.inf, cols))

  def _step_fn(self, params, state: SlotState, free):
    """k decode steps of every running slot; `free` [s] bool marks slots to release
    first (their rows left). -> (state, (tokens, logprobs, top_ids, top_lps, emitted)
    each [s, k, ...])."""
    step = self.model.decode_step(params, self.decode_length)
    state = state._replace(active=state.active & ~free)

    def one(st: SlotState, _):
      pos = self._index_of(st.cache)  # [s] tokens written so far
      running = st.active & ~st.ended & (pos < st.limit)
      with lora.row_adapters(st.adapter):
        logits, cache = step(decoding.DecodingState(
            cur_index=pos, sequences=st.token[:, None], cur_token=st.token[:, None],
            cache=st.cache))
      logits = logits.astype(jnp.float32)
      # min_tokens: a row's stop ids get no mass before it wrote that many tokens (as
      # transformers' MinNewTokensLengthLogitsProcessor).
      logits = self._mask_stops(logits, running & (pos < st.min_tokens))
      lp = jax.nn.log_softmax(logits, axis=-1)
      token, token_lp = sample_tokens(logits, lp, st.key, pos, st.temperature, st.top_k,
                                      st.top_p, running)
      top_lp, top_ids = lax.top_k(lp, TOP_LOGPROBS)
      # Rows that do not run keep their position (the network advanced every row).
      cache = jax.tree_util.tree_map_with_path(
          lambda path, x: jnp.where(running, pos + 1, pos) if _leaf_name(path) == "index"
          else x, cache)
      ends = running & ~st.ignore_eos & decoding.is_eos(token, self.stop_ids)
      st = st._replace(cache=cache, token=jnp.where(running, token, st.token),
                       ended=st.ended | ends)
      return st, (token, token_lp, top_ids.astype(jnp.int32), top_lp, running)

    state, outs = lax.scan(one, state, None, length=self.steps)
    return state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)

  # -- host API -------------------------------------------------------------------------------
  def insert(self, rows: list[InsertRow], at: list[int]) -> None:
    """Encodes `rows` into the slots `at`: per input bucket, the compiled calls of
    `insert_plan`."""
    by_bucket: dict[int, list[tuple[InsertRow, int]]] = {}
    for r, slot in zip(rows, at):
      by_bucket.setdefault(self.input_bucket(len(r.ids)), []).append((r, slot))
    for width, group in sorted(by_bucket.items()):
      for size in self.insert_plan(width, len(group)):
        part, group = group[:size], group[size:]
        self._insert_call(width, size, part)

  def insert_plan(self, width: int, n: int) -> tuple[int, ...]:
    """The compiled row counts of the insert calls that encode n rows of input bucket
    `width` (the last call may hold padding rows).

    With `warmup`'s timings: the cover of n by compiled sizes whose calls took the least
    time in all. Where encoding costs per row (a CPU), 13 rows are 8 + 4 + 1 rather than
    16 with 3 padding rows; where a call costs about the same whatever its rows (an
    accelerator), they stay one call of 16. Without timings (warmup skipped, or several
    processes, which must all run the same calls): the smallest size that holds the rows,
    the largest while more are left.
    """
    key = (width, n)
    if key in self._plans:
      return self._plans[key]
    cost = self.insert_seconds.get(width)
    if not cost or n > self.num_slots:
      plan, left = [], n
      while left > 0:
        size = next((s for s in self.encode_sizes if s >= left), self.encode_sizes[-1])
        plan.append(size)
        left -= size
      return tuple(plan)
    # best[m]: (seconds, sizes) of the cheapest calls that hold m rows; each call also
    # counts a hundredth of the largest one, so that near ties (timing noise) go to
    # fewer calls.
    extra = 0.01 * cost[self.encode_sizes[-1]]
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for m in range(1, n + 1):
      best.append(min(((cost[s] + extra + best[max(0, m - s)][0],
                        (s,) + best[max(0, m - s)][1]) for s in self.encode_sizes),
                      key=lambda x: x[0]))
    # Largest call first: padding rows, if any, sit in the last one.
    self._plans[key] = plan = tuple(sorted(best[n][1], reverse=True))
    return plan

  def _insert_call(self, width: int, size: int, part) -> None:
    s = self.num_slots
    tokens = np.zeros((size, width), np.int32)
    tokens[:, 0] = self.eos_id  # padding rows: an empty input
    cols = {"at": np.full((size,), s, np.int32), "limit": np.ones((size,), np.int32),
            "temperature": np.zeros((size,), np.float32), "top_k": np.zeros((size,), np.int32),
            "top_p": np.ones((size,), np.float32), "seed": np.zeros((size,), np.uint32),
            "sample": np.zeros((size,), np.int32), "min_tokens": np.zeros((size,), np.int32),
            "ignore_eos": np.zeros((size,), bool), "adapter": np.zeros((size,), np.int32)}
    for j, (r, slot) in enumerate(part):
      tokens[j, :] = 0
      tokens[j, :len(r.ids)] = r.ids
      cols["at"][j], cols["limit"][j] = slot, r.max_new_tokens
      cols["temperature"][j], cols["top_k"][j], cols["top_p"][j] = (
          r.temperature, r.top_k, r.top_p)
      cols["seed"][j], cols["sample"][j] = np.uint32(r.seed % 2 ** 32), r.sample
      cols["min_tokens"][j], cols["ignore_eos"][j] = r.min_tokens, r.ignore_eos
      cols["adapter"][j] = r.adapter
    with self._context():
      self.state = self._insert(self.params, self.state, tokens, cols["at"], cols["limit"],
                                cols["temperature"], cols["top_k"], cols["top_p"],
                                cols["seed"], cols["sample"], cols["min_tokens"],
                                cols["ignore_eos"], cols["adapter"])

  def step(self, free: np.ndarray | None = None) -> StepOut:
    """Runs k steps (after releasing the slots marked in `free` [s]); blocks for the
    new tokens."""
    if free is None:
      free = np.zeros((self.num_slots,), bool)
    with self._context():
      self.state, outs = self._step(self.params, self.state, free)
    return StepOut(*(multihost.to_host(x) for x in outs))

  def input_bucket(self, length: int) -> int:
    for b in self.input_buckets:
      if b >= length:
        return b
    raise UserError(f"an input of {length} tokens is over the largest input bucket "
                    f"{self.input_buckets[-1]}")

  def warmup(self) -> int:
    """Compiles insert for every (row count, input bucket) and step, on a fresh state,
    then times each insert (the faster of two more calls: `insert_seconds`, read by
    `insert_plan`); -> the number of functions compiled."""
    self.reset()
    count = 0
    for width in self.input_buckets:
      for size in self.encode_sizes:
        self._insert_call(width, size, [])
        count += 1
    self.step()
    if jax.process_count() == 1:  # every process must choose the same calls
      self._plans.clear()
      for width in self.input_buckets:
        took = {}
        for size in self.encode_sizes:
          runs = []
          for _ in range(2):  # the faster of two: a busy host only ever adds time
            jax.block_until_ready(self.state)
            start = time.perf_counter()
            self._insert_call(width, size, [])
            jax.block_until_ready(self.state)
            runs.append(time.perf_counter() - start)
          took[size] = min(runs)
        # A call holds fewer rows as padded, so it costs at most what any larger one does.
        self.insert_seconds[width] = {
            size: min(t for n, t in took.items() if n >= size) for size in self.encode_sizes}
    self.reset()
    return count + 1


def free_memory_bytes(device=None) -> int | None:
  """Bytes free for the slot state: the accelerator's (its limit less what is in use),
  or on CPU the host's available memory; None when neither is known."""
  device = device or jax.devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def check_fits(slots: Slots, *, flags: str, free: int | None = None) -> None:
  """UserError when the slot state (the caches of every slot) would not fit in the free
  memory of a device, naming the bytes needed and the settings that size it."""
  free = free_memory_bytes() if free is None else free
  shards = slots.partitioner.num_data_shards if slots.num_slots % \
      slots.partitioner.num_data_shards == 0 else 1
  need = slots.state_bytes // shards
  if free is not None and need > 0.9 * free:
    per = slots.state_bytes // slots.num_slots
    raise UserError(f"{slots.num_slots} decode slots need {need / 2**30:.2f} GiB per device "
                    f"({per / 2**20:.1f} MiB each: cache of {slots.decode_length} positions and "
                    f"an input of {slots.input_buckets[-1]}), over the {free / 2**30:.2f} GiB "
                    f"free; lower {flags}")
