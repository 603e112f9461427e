"""t5forge's side of the benchmark (JAX); runs in an `ours` worker (see bench/worker.py).

Everything goes through the library's public pieces, as the trainer and the Python API
use them: `t5forge.load` (the HF reader) for the shared weights,
`models.EncoderDecoderModel` + `train.optim` + `train.state.create` +
`train.step.make_train_step` under `jax.jit(..., donate_argnums=(0,))` for training, and
`generation.Generator` for decoding.

EOS in decoding: t5forge has no minimum-length option, and a benchmark must decode
exactly `new_tokens` tokens on every side. `NoEosModel` reports eos_id -1, which no
token equals, so no row ever ends and the compiled loop runs exactly max_decode_length
steps. The network and its logits are untouched (token 1 may still be emitted as an
ordinary token, whereas HF and CTranslate2 forbid it until the minimum length); this is
the only benchmark-specific change.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import t5forge
from bench import shapes
from t5forge.models import EncoderDecoderModel
from t5forge.generation import Generator
from t5forge.predict import DecodeOptions
from t5forge.train import optim
from t5forge.train.state import create as create_state
from t5forge.train.step import make_train_step

OPTIMIZERS = {"adafactor": optim.Adafactor, "adamw": optim.AdamW}
LEARNING_RATE = 1e-3
# ModelConfig fields that an int8 weight-only path may add (checked when the bench runs).
INT8_FIELDS = ("weight_dtype", "quantize", "quantization", "weight_quantization")


class NoEosModel(EncoderDecoderModel):
  """The model with an end-of-sequence id no token has (benchmark only; see module doc)."""

  @property
  def eos_id(self) -> int:
    return -1


def int8_overrides() -> dict | None:
  """The `t5forge.load` override that selects int8 weights, or None if unsupported."""
  fields = {f.name for f in dataclasses.fields(t5forge.ModelConfig)}
  for name in INT8_FIELDS:
    if name in fields:
      return {name: "int8"}
  return None


def _cost_flops(compiled) -> float | None:
  """XLA's FLOP estimate of a compiled function (all ops, not only matmuls)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None


class Backend:
  """Jobs of the `ours` worker."""

  def __init__(self):
    self._decoders: dict[tuple, tuple] = {}  # (dir, dtype, int8) -> (params, generator, config)
    self._last_tokens: dict[str, np.ndarray] = {}

  # -- information -------------------------------------------------------------------
  def op_versions(self) -> dict:
    names = ("jax", "jaxlib", "flax", "optax", "t5forge")
    out = {n: importlib.metadata.version(n) for n in names}
    out["devices"] = [str(d) for d in jax.devices()]
    out["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    return out

  def op_capabilities(self) -> dict:
    ov = int8_overrides()
    return {"int8": ov, "int8_note": (
        f"t5forge.load(dir, **{ov})" if ov else
        f"t5forge.ModelConfig has none of the fields {list(INT8_FIELDS)}: no int8 "
        "weight-only path yet")}

  def op_tokens(self, tag: str) -> list:
    return self._last_tokens[tag].tolist()

  # -- matmul ------------------------------------------------------------------------
  def setup_matmul(self, n: int, dtype: str, seconds: float):
    """A jitted [n, n] x [n, n] product, repeated for about `seconds` per run."""
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dt)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dt)
    # bf16 as our models multiply it: float32 accumulation and result (the form XLA:CPU
    # runs on its AMX kernels; a bf16-result dot takes a ~5x slower path).
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, b).block_until_ready()  # compile
    reps = _calibrate(lambda: f(a, b).block_until_ready(), seconds)

    def run():
      for _ in range(reps):
        f(a, b).block_until_ready()

    return run, {"reps": reps, "flops_per_run": reps * 2 * n ** 3}

  # -- training ----------------------------------------------------------------------
  def setup_train(self, model_dir: str, dtype: str, optimizer: str, scan: bool, batch: int,
                  input_length: int, target_length: int, seed: int = 0, remat: str = "none",
                  z_loss: float | None = None, preset: str | None = None):
    """One training step (forward, backward, optimizer update) on a fixed random batch.

    The step is compiled ahead of time, so that the compile time is measured apart
    from the first execution. Each run returns the step's mean cross-entropy per target
    token (the first run's is reported: the loss of the shared initial weights).

    Args:
      z_loss: the model's z-loss coefficient (None: t5forge's default, T5X's 1e-4; 0 for
        the same loss as transformers').
      preset: a t5forge preset the loaded config must equal (shape and attention fields).
    """
    m = t5forge.load(model_dir, dtype=dtype, scan_layers=scan, remat_policy=remat)
    if preset:
      check_preset(m.config, preset)
    model = (EncoderDecoderModel(m.config) if z_loss is None
             else EncoderDecoderModel(m.config, z_loss=z_loss))
    tx = OPTIMIZERS[optimizer]().build(lambda _: LEARNING_RATE, model.logical_axes())
    state = create_state(m.params, tx)
    del m  # the state holds the parameters now (and donates them)
    feats = shapes.train_batch(model.config.vocab_size, batch, input_length, target_length, seed)
    feats = {k: jnp.asarray(v) for k, v in feats.items()}
    step = jax.jit(make_train_step(model, tx, seed=seed), donate_argnums=(0,))
    start = time.perf_counter()
    compiled = step.lower(state, feats).compile()
    compile_s = time.perf_counter() - start
    holder = [state]

    def run():
      holder[0], sums = compiled(holder[0], feats)
      jax.block_until_ready((holder[0], sums))
      return {"loss": float(sums["cross_ent_loss"]) / float(sums["weight_sum"])}

    info = {"compile_s": compile_s, "xla_flops": _cost_flops(compiled),
            "params": int(sum(x.size for x in jax.tree.leaves(state.params)))}
    return run, info

  # -- decoding ----------------------------------------------------------------------
  def _decoder(self, model_dir: str, dtype: str, int8: bool):
    key = (model_dir, dtype, int8)
    if key not in self._decoders:
      overrides = {"dtype": dtype}
      if int8:
        ov = int8_overrides()
        if ov is None:
          raise RuntimeError("t5forge has no int8 weight-only path (see op_capabilities)")
        overrides.update(ov)
      m = t5forge.load(model_dir, **overrides)
      self._decoders[key] = (m.params, Generator(NoEosModel(m.config)), m.config)
    return self._decoders[key]

  def setup_decode(self, tag: str, model_dir: str, dtype: str, method: str, batch: int,
                   beams: int, input_length: int, new_tokens: int, seed: int = 0,
                   int8: bool = False, preset: str | None = None):
    """Greedy or beam decoding of exactly `new_tokens` tokens from random inputs.

    Args:
      preset: a t5forge preset the loaded config must equal (see check_preset).
    """
    params, generator, config = self._decoder(model_dir, dtype, int8)
    if preset:
      check_preset(config, preset)
    tokens = shapes.random_tokens(seed, batch, input_length, config.vocab_size,
                                  end_with_eos=True)
    feats = {"encoder_input_tokens": jnp.asarray(tokens),
             "decoder_input_tokens": jnp.zeros((batch, new_tokens), jnp.int32)}
    opts = (DecodeOptions(method="beam", num_decodes=beams) if method == "beam"
            else DecodeOptions(method="greedy"))

    def run():
      out, _ = generator.predict(feats, opts, params=params, max_decode_length=new_tokens)
      if out.shape != (batch, new_tokens):
        raise AssertionError(f"decoded shape {out.shape}, expected {(batch, new_tokens)}")
      self._last_tokens[tag] = out

    return run, {}

  # -- data pipeline -----------------------------------------------------------------
  def op_data(self, num_batches: int, batch_size: int) -> list[dict]:
    """bench/data_pipeline.py's packed configurations, in this process."""
    from bench import data_pipeline
    return [data_pipeline.run(*cfg, batch_size=batch_size, num_batches=num_batches)
            for cfg in data_pipeline.CONFIGS if cfg[3] and cfg[4] == "first_fit"]


# Fields that a run sets or that do not change what the network computes.
_RUN_FIELDS = frozenset({"dtype", "scan_layers", "remat_policy", "weight_dtype", "dropout_rate",
                         "max_position_embeddings"})


def check_preset(config: t5forge.ModelConfig, preset: str) -> None:
  """Raises unless `config` (as t5forge.load read the shared HF directory) is the preset
  `preset` in every field that shapes the network: the benchmark measures the released
  shape, not a look-alike."""
  from t5forge import presets
  want = presets.get(preset)
  diff = {f.name: (getattr(config, f.name), getattr(want, f.name))
          for f in dataclasses.fields(config)
          if f.name not in _RUN_FIELDS and getattr(config, f.name) != getattr(want, f.name)}
  if diff:
    raise AssertionError(f"the benchmark's model is not preset {preset}: "
                         + ", ".join(f"{k}={a!r} (preset {b!r})" for k, (a, b) in diff.items()))


def _calibrate(fn, seconds: float) -> int:
  """How many calls of fn take about `seconds` (at least 1)."""
  start = time.perf_counter()
  fn()
  one = max(time.perf_counter() - start, 1e-6)
  return max(1, int(round(seconds / one)))
