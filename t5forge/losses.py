"""T5X's losses: cross entropy with z-loss (stable custom gradient), label smoothing,
and the loss normalizing factor.

Shape letters (docs/shapes.md): b batch, t target length, v vocab.
"""
from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from t5forge.errors import UserError


class LossNormalizingFactor(enum.Enum):
  """Special values of LOSS_NORMALIZING_FACTOR (T5X's SpecialLossNormalizingFactor)."""

  NUM_REAL_TARGET_TOKENS = 1
  NUM_TOTAL_TARGET_TOKENS = 2
  AVERAGE_PER_SEQUENCE = 3


def parse_loss_normalizing_factor(value) -> float | LossNormalizingFactor | None:
  """None, a number, or a special mode (enum, or its name as a string)."""
  if value is None or isinstance(value, LossNormalizingFactor):
    return value
  if isinstance(value, str):
    name = value.split(".")[-1].upper()
    try:
      return LossNormalizingFactor[name]
    except KeyError:
      raise UserError(f"LOSS_NORMALIZING_FACTOR {value!r} is not a number or one of "
                      f"{[m.name for m in LossNormalizingFactor]}") from None
  if isinstance(value, (int, float)) and value > 0:
    return float(value)
  raise UserError(f"LOSS_NORMALIZING_FACTOR must be positive, None, or a mode name; got {value!r}")


@jax.custom_vjp
def cross_entropy_with_logits(logits: jax.Array, targets: jax.Array,
                              z_loss: float) -> tuple[jax.Array, jax.Array]:
  """Cross entropy against soft targets, plus z_loss * log(Z)^2 (PaLM's auxiliary loss).

  Args:
    logits: [b, t, v] float32.
    targets: [b, t, v] target distribution (one-hot or smoothed).
    z_loss: coefficient of the log-normaliser penalty.

  Returns:
    (loss [b, t] including the z-loss, z-loss [b, t]).
  """
  logits_sum = jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  log_softmax = logits - logits_sum
  loss = -jnp.sum(targets * log_softmax, axis=-1)
  log_z = jnp.squeeze(logits_sum, axis=-1)
  total_z_loss = z_loss * jax.lax.square(log_z)
  return loss + total_z_loss, total_z_loss


def _cross_entropy_fwd(logits, targets, z_loss):
  # Shift by the max once and reuse exp(shifted) in the backward pass: the gradient is
  # (1 + 2 z log Z) softmax - targets, computed without a second exp.
  max_logit = logits.max(axis=-1, keepdims=True)
  shifted = logits - max_logit
  exp_shifted = jnp.exp(shifted)
  sum_exp = jnp.sum(exp_shifted, axis=-1, keepdims=True)
  log_softmax = shifted - jnp.log(sum_exp)
  loss = -jnp.sum(targets * log_softmax, axis=-1)
  log_z = jnp.squeeze(jnp.log(sum_exp) + max_logit, axis=-1)
  total_z_loss = z_loss * jax.lax.square(log_z)
  return (loss + total_z_loss, total_z_loss), (targets, z_loss, exp_shifted, sum_exp,
                                               log_softmax, log_z)


def _cross_entropy_bwd(res, g):
  g = g[0]  # the z-loss output is for logging only
  targets, z_loss, exp_shifted, sum_exp, log_softmax, log_z = res
  deriv = jnp.expand_dims(1 + 2 * z_loss * log_z, -1) * exp_shifted / sum_exp - targets
  g_logits = jnp.expand_dims(g, -1) * deriv
  g_targets = -jnp.expand_dims(g, -1) * log_softmax
  return g_logits, g_targets.astype(targets.dtype), jnp.zeros_like(jnp.asarray(z_loss))


cross_entropy_with_logits.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def token_cross_entropy(logits: jax.Array, targets: jax.Array, z_loss: float,
                        confidence: float = 1.0, low_confidence: float = 0.0
                        ) -> tuple[jax.Array, jax.Array]:
  """`cross_entropy_with_logits` against integer targets, without a one-hot array.

  The soft target puts `confidence` on the target class and `low_confidence` on every
  other class (label smoothing); the loss and its gradient are computed from the
  target's logit and row statistics, so no [b, t, v] target array is ever built.

  Args:
    logits: [b, t, v] float32.
    targets: [b, t] int class indices.
    z_loss: coefficient of the log-normaliser penalty.
    confidence / low_confidence: soft-target mass on / off the target class.

  Returns:
    (loss [b, t] including the z-loss, z-loss [b, t]).
  """
  return _token_cross_entropy_fwd(logits, targets, z_loss, confidence, low_confidence)[0]


def _token_cross_entropy_fwd(logits, targets, z_loss, confidence, low_confidence):
  # Two passes over [b, t, v] (max, then sum of exp); nothing of that size is written.
  # The backward pass recomputes exp(logits - max) instead of keeping it: that costs
  # an exp but saves writing and re-reading one [b, t, v] array.
  max_logit = logits.max(axis=-1, keepdims=True)
  shifted = logits - max_logit
  log_sum_exp = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))  # [b, t]
  target_shifted = jnp.take_along_axis(shifted, targets[..., None].astype(jnp.int32),
                                       axis=-1)[..., 0]
  # sum_v soft_v * log_softmax_v, split into the target term and the uniform term.
  loss = -(confidence - low_confidence) * (target_shifted - log_sum_exp)
  if low_confidence:
    vocab_size = logits.shape[-1]
    loss = loss - low_confidence * (jnp.sum(shifted, axis=-1) - vocab_size * log_sum_exp)
  log_z = log_sum_exp + max_logit[..., 0]
  total_z_loss = z_loss * jax.lax.square(log_z)
  return (loss + total_z_loss, total_z_loss), (logits, targets, max_logit, log_sum_exp, log_z)


def _token_cross_entropy_bwd(z_loss, confidence, low_confidence, res, g):
  g = g[0]  # the z-loss output is for logging only
  logits, targets, max_logit, log_sum_exp, log_z = res
  # (1 + 2 z log Z) softmax - soft targets, as `_cross_entropy_bwd`, in one fused pass.
  sum_exp = jnp.exp(log_sum_exp)[..., None]
  vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  soft = jnp.where(vocab_ids == targets[..., None].astype(jnp.int32),
                   jnp.float32(confidence), jnp.float32(low_confidence))
  deriv = (jnp.expand_dims(1 + 2 * z_loss * log_z, -1) * jnp.exp(logits - max_logit) / sum_exp
           - soft)
  return jnp.expand_dims(g, -1) * deriv, None


token_cross_entropy.defvjp(_token_cross_entropy_fwd, _token_cross_entropy_bwd)


def compute_weighted_cross_entropy(logits: jax.Array, targets: jax.Array,
                                   weights: jax.Array | None = None, *,
                                   label_smoothing: float = 0.0, z_loss: float = 0.0,
                                   loss_normalizing_factor: float | jax.Array | None = None
                                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """T5X's weighted, smoothed cross entropy.

  Args:
    logits: [b, t, v]; targets: [b, t] int; weights: [b, t] or None.
    label_smoothing: mass spread over the other v - 1 classes; the entropy of the
      smoothed target is subtracted so a perfect prediction has loss 0.
    loss_normalizing_factor: divide the summed loss by this (None: do not normalise).

  Returns:
    (total loss, total z-loss, sum of weights), scalars.
  """
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(confidence * np.log(confidence) + (vocab_size - 1) * low_confidence
                           * np.log(low_confidence + 1e-20))
  total_loss, total_z_loss = token_cross_entropy(logits, targets, float(z_loss),
                                                 float(confidence), float(low_confidence))
  total_loss = total_loss - normalizing_constant
  weight_sum = jnp.asarray(np.prod(targets.shape), jnp.float32)
  if weights is not None:
    total_loss = total_loss * weights
    total_z_loss = total_z_loss * weights
    weight_sum = jnp.sum(weights)
  if loss_normalizing_factor is not None:
    total_loss = total_loss / loss_normalizing_factor
    total_z_loss = total_z_loss / loss_normalizing_factor
  return jnp.sum(total_loss), jnp.sum(total_z_loss), weight_sum


def _sum_weights_per_segment(positions: jax.Array, segment_ids: jax.Array,
                             weights: jax.Array) -> jax.Array:
  """For packed rows: each token gets the total weight of its segment. [b, t] -> [b, t]."""
  del positions
  # [b, t, t]: same non-padding segment
  same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
  return jnp.einsum("bij,bj->bi", same.astype(weights.dtype), weights)


def normalizing_factor_and_weights(loss_normalizing_factor, batch: dict):
  """Resolves a loss normalizing factor for a batch, as T5X does.

  Args:
    loss_normalizing_factor: None, a number, or a LossNormalizingFactor.
    batch: model features; uses decoder_target_tokens, decoder_loss_weights and, when
      packed, decoder_segment_ids.

  Returns:
    (factor: None or scalar, weights [b, t] or None).
  """
  loss_normalizing_factor = parse_loss_normalizing_factor(loss_normalizing_factor)
  weights = batch.get("decoder_loss_weights")
  if loss_normalizing_factor is None or not isinstance(loss_normalizing_factor,
                                                       LossNormalizingFactor):
    return loss_normalizing_factor, weights
  targets = batch["decoder_target_tokens"]
  if weights is None:
    weights = (targets > 0).astype(jnp.float32)
  weights = jnp.asarray(weights, jnp.float32)
  mode = loss_normalizing_factor
  if mode is LossNormalizingFactor.NUM_REAL_TARGET_TOKENS:
    return jnp.sum(weights), weights
  if mode is LossNormalizingFactor.NUM_TOTAL_TARGET_TOKENS:
    return jnp.asarray(np.prod(targets.shape), jnp.float32), weights
  # AVERAGE_PER_SEQUENCE: each (packed) sequence contributes its mean token loss.
  if batch.get("decoder_segment_ids") is not None:
    norm = _sum_weights_per_segment(batch.get("decoder_positions"),
                                    batch["decoder_segment_ids"], weights)
  else:
    norm = jnp.sum(weights, axis=-1, keepdims=True)
  weights = jnp.nan_to_num(weights / norm, nan=0.0, posinf=0.0, neginf=0.0)
  return jnp.sum(weights), weights
