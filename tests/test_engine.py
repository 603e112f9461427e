"""The continuous-batching engine (`t5forge.engine`) against decoding each request alone
(`t5forge.generation.Generator`, the static path), on tiny random-init T5, T5Gemma
(sliding window 8, shorter than the outputs) and T5Gemma 2 models whose EOS is boosted
so that rows end at different steps: requests arrive as a seeded Poisson stream while
others decode, and each completion must be token-identical to its request decoded alone.
Seeded sampling gives the same tokens whatever runs beside it; nothing compiles after
the engine is ready."""
import threading
import time

import numpy as np
import pytest

import t5forge
from t5forge import engine as engine_lib
from t5forge import testing as sh
from t5forge.errors import UserError
from t5forge.generation import Generator, Kind

VOCAB = 256
LENGTH = 128  # the decode length: max_tokens in [1, 128]
BUCKETS = (32, 128)  # input buckets: prompts of 8..120 tokens + EOS


def _requests(seed: int, count: int):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    n = int(rng.integers(8, 121))
    out.append((rng.integers(2, VOCAB, n).tolist() + [1], int(rng.integers(1, LENGTH + 1))))
  return out


def _engine(m, slots=8, steps=3, **kw):
  s = engine_lib.Slots(m.model, m.params, num_slots=slots, decode_length=LENGTH,
                       input_buckets=BUCKETS, encode_sizes=(1, 4, slots), steps=steps,
                       partitioner=m.partitioner)
  e = engine_lib.Engine(s, **kw)
  e.start()
  assert e.ready.wait(600) and e.failed is None, e.failed
  return e


def _alone(gen: Generator, ids, max_new) -> list[int]:
  x = np.zeros((1, BUCKETS[-1]), np.int32)
  x[0, :len(ids)] = ids
  g = gen.generate(Kind("greedy"), x, decode_length=LENGTH, max_new_tokens=[max_new],
                   temperature=0, topp=0)
  return g.tokens[0, 0, :g.lengths[0, 0]].tolist()


def _poisson(engine, rows, rate: float, seed: int) -> list:
  """Submits rows at seeded Poisson arrival times; -> their results in order."""
  results, left = [None] * len(rows), threading.Semaphore(0)
  gaps = np.random.default_rng(seed).exponential(1 / rate, len(rows))
  for i, (r, gap) in enumerate(zip(rows, gaps)):
    def done(res, i=i):
      results[i] = res
      left.release()
    r.done = done
    time.sleep(gap)
    engine.submit([r])
  for _ in rows:
    assert left.acquire(timeout=600)
  return results


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_1_1.tiny", "t5gemma.tiny", "t5gemma2.tiny"])
def test_poisson_greedy_equals_each_request_alone(name):
  m = sh.eos_prone(name)
  requests = _requests(seed=0, count=96)
  gen = Generator(m.model, m.params, partitioner=m.partitioner)
  # One compile, then ~7 ms a request on CPU: the references cost little beside the
  # compiles of the model and of the engine.
  expected = [_alone(gen, ids, mx) for ids, mx in requests]
  ends = sum(1 for t, (_, mx) in zip(expected, requests) if len(t) < mx)
  assert 10 < ends < 86, ends  # rows end by EOS and by max_tokens, at different steps
  e = _engine(m)
  try:
    out = _poisson(e, [engine_lib.Row(ids=ids, max_new_tokens=mx) for ids, mx in requests],
                   rate=200.0, seed=1)
    assert e.compiles_since_ready() == 0
  finally:
    e.close()
  for k, (o, want) in enumerate(zip(out, expected)):
    assert isinstance(o, engine_lib.RowOutput), o
    assert o.tokens == want, (k, o.tokens, want)
    assert o.finished == (bool(want) and want[-1] == 1)


def _sampled(seed_rows):
  return [engine_lib.Row(ids=ids, max_new_tokens=mx, temperature=0.9, top_k=tk, top_p=tp,
                         seed=seed, sample=j)
          for ids, mx, tk, tp, seed, j in seed_rows]


@pytest.mark.slow
def test_seeded_sampling_ignores_its_neighbours():
  m = sh.eos_prone("t5_1_1.tiny")
  rng = np.random.default_rng(3)
  spec = [(ids, mx, [0, 20][k % 2], [1.0, 1.0, 0.8][k % 3], 100 + k // 2, k % 2)
          for k, (ids, mx) in enumerate(_requests(seed=2, count=24))]
  e = _engine(m, slots=32, steps=4)
  try:
    one_by_one = [e.generate(_sampled([s]))[0].tokens for s in spec]
    together = [o.tokens for o in e.generate(_sampled(spec))]
    order = rng.permutation(len(spec))
    shuffled = e.generate(_sampled([spec[i] for i in order]))
    assert e.compiles_since_ready() == 0
  finally:
    e.close()
  assert together == one_by_one
  assert [shuffled[list(order).index(i)].tokens for i in range(len(spec))] == one_by_one
  # Different seeds (and samples) do differ.
  assert len({tuple(t) for t in one_by_one}) > len(spec) // 2


def test_no_compiles_after_ready_across_500_requests():
  m = t5forge.init("t5_1_1.tiny", vocab_size=VOCAB, seed=1)
  rng = np.random.default_rng(5)
  e = _engine(m, slots=8, steps=2, encode_budget=3, max_queue=500)
  try:
    rows = []
    for k in range(500):
      n = int(rng.integers(1, 128))
      rows.append(engine_lib.Row(
          ids=rng.integers(2, VOCAB, n).tolist() + [1], max_new_tokens=int(rng.integers(1, 9)),
          temperature=float(rng.choice([0.0, 0.5, 1.3])), top_k=int(rng.choice([0, 5])),
          top_p=float(rng.choice([1.0, 0.7])), seed=int(rng.integers(0, 2 ** 31)),
          priority=int(rng.integers(-2, 3))))
    out = _poisson(e, rows, rate=2000.0, seed=6)
    assert all(isinstance(o, engine_lib.RowOutput) for o in out)
    assert all(1 <= len(o.tokens) <= r.max_new_tokens for o, r in zip(out, rows))
    assert e.compiles_since_ready() == 0
  finally:
    e.close()


@pytest.mark.slow
def test_cancelled_rows_free_their_slots_and_queued_ones_never_start():
  m = t5forge.init("t5_1_1.tiny", vocab_size=VOCAB, seed=1)
  e = _engine(m, slots=2, steps=1)
  try:
    seen, results = [], {}
    first = engine_lib.Row(ids=[5, 6, 1], max_new_tokens=LENGTH,
                           on_tokens=lambda *a: seen.append(1))
    rows = [first] + [engine_lib.Row(ids=[7, 1], max_new_tokens=LENGTH) for _ in range(3)]
    for i, r in enumerate(rows):
      r.done = (lambda i: lambda res: results.__setitem__(i, res))(i)
    e.submit(rows)
    rows[3].cancel()  # queued behind two slots: never encoded
    sh.wait_for(lambda: seen, 60, "the first row's first tokens", interval=0.001)
    first.cancel()
    sh.wait_for(lambda: 0 in results, 60, "the cancelled row's result", interval=0.001)
    assert isinstance(results[0], engine_lib.Cancelled)
    assert len(first.out.tokens) < LENGTH
    sh.wait_for(lambda: len(results) == 4, 60, "every row's result")
    assert isinstance(results[3], engine_lib.Cancelled) and rows[3].out is None
    assert isinstance(results[1], engine_lib.RowOutput)
    assert isinstance(results[2], engine_lib.RowOutput)
  finally:
    e.close()


@pytest.mark.slow
def test_priority_then_arrival_and_queue_timeout():
  m = t5forge.init("t5_1_1.tiny", vocab_size=VOCAB, seed=1)
  e = _engine(m, slots=1, steps=8, max_queue_wait_s=0.5)
  try:
    order = []
    block = engine_lib.Row(ids=[5, 1], max_new_tokens=LENGTH)
    e.submit([block])
    sh.wait_for(lambda: block.out is not None, 60, "the blocking row to start",
                interval=0.001)
    rows = [engine_lib.Row(ids=[5, 1], max_new_tokens=1, priority=p) for p in (1, 0, -1, 0)]
    for i, r in enumerate(rows):
      r.done = (lambda i: lambda res: order.append((i, type(res).__name__)))(i)
    e.submit(rows)
    block.cancel()
    sh.wait_for(lambda: len(order) == 4, 60, "the four rows' results")
    assert [i for i, _ in order] == [2, 1, 3, 0]
    # Holds the one slot for >= 0.2 s per step (its callback runs on the worker thread).
    late = engine_lib.Row(ids=[5, 1], max_new_tokens=LENGTH,
                          on_tokens=lambda *a: time.sleep(0.2))
    waits = engine_lib.Row(ids=[5, 1], max_new_tokens=1)
    got = []
    waits.done = got.append
    e.submit([late])
    sh.wait_for(lambda: late.out is not None, 60, "the late row to start", interval=0.001)
    e.submit([waits])
    sh.wait_for(lambda: got, 60, "the waiting row's result")
    assert isinstance(got[0], engine_lib.QueueTimeout)
    late.cancel()
  finally:
    e.close()


@pytest.mark.slow
def test_drain_still_takes_rows_close_refuses_them():
  # SIGTERM starts the deadline while uvicorn still finishes requests it accepted before
  # the signal: their rows must reach a slot, not fail as if the server were closed.
  m = t5forge.init("t5_1_1.tiny", vocab_size=VOCAB, seed=1)
  e = _engine(m, slots=1, steps=1)
  try:
    e.drain(60)
    row = engine_lib.Row(ids=[5, 1], max_new_tokens=2)
    assert isinstance(e.generate([row])[0], engine_lib.RowOutput)
  finally:
    e.close()
  with pytest.raises(engine_lib.Closed):
    e.submit([engine_lib.Row(ids=[5, 1], max_new_tokens=2)])


def test_slots_that_do_not_fit_are_refused_with_the_bytes():
  m = t5forge.init("t5_1_1.tiny", vocab_size=VOCAB, seed=1)
  s = engine_lib.Slots(m.model, m.params, num_slots=64, decode_length=LENGTH,
                       input_buckets=BUCKETS, encode_sizes=(1,), partitioner=m.partitioner)
  with pytest.raises(UserError, match=r"64 decode slots need .* GiB .* over the 0.00 GiB free; "
                     r"lower --slots"):
    engine_lib.check_fits(s, flags="--slots", free=1000)
  engine_lib.check_fits(s, flags="--slots", free=10 * s.state_bytes)
  with pytest.raises(UserError, match="over the largest input bucket 128"):
    s.input_bucket(129)
