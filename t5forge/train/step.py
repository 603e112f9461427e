"""The pure training and evaluation steps (jitted by the caller with explicit shardings).

One step: dropout key = fold_in(key(seed), step); the loss normalisation is resolved
over the whole batch first, so that k microbatches (scanned, gradients accumulated in
float32) give the same update as one full batch.

Adapter training (`t5forge.nn.adapters`): the state's parameters are the adapter alone,
and the frozen base is the step's third argument, not donated and not differentiated:
gradients, their accumulators and the optimizer state cover only the adapter, and the
projections' backward passes compute no gradient for a frozen kernel (`matmul.dense`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from t5forge import losses
from t5forge.errors import UserError
from t5forge.models import BaseModel
from t5forge.nn import adapters
from t5forge.train.state import TrainState


def check_microbatches(batch_size: int, num_microbatches: int | None) -> int:
  k = num_microbatches or 1
  if k < 1 or batch_size % k:
    raise UserError(f"BATCH_SIZE {batch_size} is not divisible by num_microbatches {k}; "
                    "set num_microbatches to a divisor of the batch size")
  return k


def _split(x: jax.Array, k: int) -> jax.Array:
  # [b, ...] -> [k, b / k, ...]
  return x.reshape((k, x.shape[0] // k) + x.shape[1:])


def make_train_step(model: BaseModel, optimizer: optax.GradientTransformation, *,
                    learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None,
                    num_microbatches: int | None = None, seed: int = 0,
                    adapter: bool = False):
  """Returns `train_step(state, batch) -> (state, metric sums)`; with `adapter`,
  `train_step(state, batch, base)`: state.params is the adapter, `base` the frozen rest.

  Args:
    learning_rate_fn: only for reporting the learning rate (the optimizer applies it).
    num_microbatches: split the batch into this many sequential microbatches.
    seed: the run's seed; dropout keys derive from it and the step.
  """
  if model.config.weight_dtype != "float32":
    raise UserError(f"weight_dtype={model.config.weight_dtype!r} is for inference only; "
                    "train with float32 weights (load without weight_dtype)")
  k = num_microbatches or 1

  def grads_and_sums(params, batch, rng, base=None):
    factor, weights = losses.normalizing_factor_and_weights(model.loss_normalizing_factor, batch)
    if adapter:
      # Only the adapter is an argument of the differentiated function: the base is a
      # constant of it.
      loss_fn = lambda p, b, r, **kw: model.loss_fn(adapters.join(p, base), b, r, **kw)
    else:
      loss_fn = model.loss_fn
    if k == 1:
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      (_, sums), grads = grad_fn(params, batch, rng, normalization=(factor, weights))
      return grads, sums
    micro = {name: _split(x, k) for name, x in batch.items() if x is not None}
    if weights is not None:
      micro["__weights__"] = _split(weights, k)

    def one(carry, xs):
      acc_grads, acc_sums = carry
      i, mb = xs
      w = mb.get("__weights__")
      mb = {name: x for name, x in mb.items() if name != "__weights__"}
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      (_, sums), grads = grad_fn(params, mb, jax.random.fold_in(rng, i), normalization=(factor, w))
      acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
      acc_sums = jax.tree.map(jnp.add, acc_sums, sums)
      return (acc_grads, acc_sums), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first = {n: x[0] for n, x in micro.items() if n != "__weights__"}
    sums_shape = jax.eval_shape(
        lambda: loss_fn(params, first, rng, normalization=(
            factor, None if weights is None else micro["__weights__"][0]))[1])
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
    (grads, sums), _ = jax.lax.scan(one, (zeros, zero_sums), (jnp.arange(k), micro))
    return grads, sums

  def train_step(state: TrainState, batch: dict, base: dict | None = None
                 ) -> tuple[TrainState, dict]:
    if adapter and base is None:
      raise ValueError("adapter training: train_step(state, batch, base) needs the base")
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    grads, sums = grads_and_sums(state.params, batch, rng, base)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    sums = dict(sums)
    sums["steps"] = jnp.asarray(1.0, jnp.float32)
    # Checked by the loop one step later (no host sync on the hot path).
    sums["finite"] = jnp.isfinite(sums["loss"]) & jnp.isfinite(optax.tree.norm(grads))
    if learning_rate_fn is not None:
      # Summed over steps like everything else; the reporter divides by steps.
      sums["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), sums

  return train_step


def make_eval_step(model: BaseModel):
  """Returns `eval_step(params, batch) -> metric sums` (teacher forcing, no dropout)."""

  def eval_step(params, batch):
    _, sums = model.loss_fn(params, batch, None)
    sums = dict(sums)
    sums["steps"] = jnp.asarray(1.0, jnp.float32)
    return sums

  return eval_step
