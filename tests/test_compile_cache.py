"""The suite's persistent JAX compilation cache (tests/conftest.py) and the compile counter.

The cache is what lets hundreds of processes compile the same tiny models once: here a
second process running t5forge's own jitted functions (a training step, greedy decoding)
reads every executable back instead of compiling it. And since the "nothing compiles after
ready" assertions rest on `t5forge.engine.compile_count`, it must count a deliberate
compile, a cache hit included: a counter that never counts would make them pass vacuously.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge.engine import compile_count
from t5forge.generation import CompiledFns
from t5forge.serve.metrics import Metrics
from train_helpers import ROOT

_SCRIPT = r"""
import json, jax, numpy as np
import t5forge
from t5forge.engine import compile_count
events = {"compiles": 0, "hits": 0}
def on(event, _d, **_k):
  if event == "/jax/core/compile/backend_compile_duration":
    events["compiles"] += 1
  elif event == "/jax/compilation_cache/compile_time_saved_sec":
    events["hits"] += 1
jax.monitoring.register_event_duration_secs_listener(on)
counted = compile_count()
m = t5forge.init("t5_1_1.tiny", vocab_size=64, seed=0)
x = np.zeros((2, 8), np.int32); x[:, :3] = [5, 6, 1]
m.predict(x, max_decode_length=4)
m.logits(x, x)
events["counted"] = compile_count() - counted
print(json.dumps(events))
"""


@pytest.mark.slow
def test_a_second_process_reads_t5forges_executables_from_the_cache(tmp_path):
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")}

  def run():
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])

  first, second = run(), run()
  n = first["compiles"]
  # (the first process reads back only what it compiled twice itself)
  assert n > 3 and first["hits"] < n // 4 and first["counted"] == n, first
  # Every executable read back, and each read counted as a compile.
  assert second == {"compiles": n, "hits": n, "counted": n}, (first, second)


def test_the_compile_counter_counts_a_deliberate_compile():
  @jax.jit
  def f(x):
    return jnp.tanh(x) * 3.25 + 0.5

  x = np.arange(7, dtype=np.float32)  # numpy inputs: no eager op compiles beside f's
  before = compile_count()
  f(x).block_until_ready()
  assert compile_count() == before + 1
  f(x + 1).block_until_ready()  # the same shapes: jit's own cache, nothing compiled
  assert compile_count() == before + 1
  f(np.arange(9, dtype=np.float32)).block_until_ready()  # a new shape compiles
  assert compile_count() == before + 2
  np.testing.assert_allclose(np.asarray(f(x)), np.tanh(x) * 3.25 + 0.5, rtol=1e-6)


def test_every_worker_counts_compiles_after_its_ready():
  """`compiles_since_ready` belongs to every queue worker: with `--scheduler static` the
  batcher is the last worker ready and /metrics reads it (it read 0 whatever compiled,
  as only the engine counted)."""
  from t5forge.engine import QueueWorker

  class Idle(QueueWorker):
    def _warmup(self):
      return 0

    def _serve(self):
      pass

  w = Idle(name="idle", max_queue=1)
  assert w.compiles_since_ready() == 0  # not ready: nothing counted yet
  w.start()
  assert w.ready.wait(60)
  assert w.compiles_since_ready() == 0
  jax.jit(lambda x: jnp.sin(x) * 1.75 - 0.25)(np.arange(5, dtype=np.float32)).block_until_ready()
  assert w.compiles_since_ready() == 1


def test_the_static_paths_compiled_functions_are_a_bounded_lru():
  """A server lives for weeks and its clients choose the keys (method, n, top_logprobs,
  length): past the limit the least recently used is dropped, counted, and shown on
  /metrics."""
  fns, made = CompiledFns(limit=2), []

  def make(key):
    return lambda: made.append(key) or key

  for key in ("a", "b", "a", "c", "a", "b"):
    assert fns.get(key, make(key)) == key
  # "b" was the least recently used when "c" came, and "c" when "b" came back.
  assert made == ["a", "b", "c", "b"] and len(fns) == 2 and fns.evictions == 2
  m = Metrics()
  m.watch_compile_cache(fns)
  body = m.render()[0].decode()
  assert "t5forge_compile_cache_entries 2.0" in body
  assert "t5forge_compile_cache_evictions_total 2.0" in body
