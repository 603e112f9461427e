"""The train state: step, parameters and optimizer state, one pytree."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from t5forge.train.optim import set_step


@flax.struct.dataclass
class TrainState:
  """step: int32 scalar (the number of updates applied); params; opt_state."""

  step: jax.Array
  params: Any
  opt_state: Any


def create(params: Any, optimizer: optax.GradientTransformation, step: int = 0) -> TrainState:
  """A state at `step` with freshly initialised optimizer statistics."""
  opt_state = optimizer.init(params)
  if step:
    opt_state = set_step(opt_state, step)
  return TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state)
