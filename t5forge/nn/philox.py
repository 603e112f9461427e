"""Dropout masks from the Philox-2x32-10 counter-based generator, one call per element.

Why not `jax.random.bernoulli`: on XLA:CPU its threefry bits cost ~13 ns per element
(170 ms for one flan-t5-small encoder attention mask [8, 6, 512, 512] on an AMD EPYC),
and the attention masks of a training step hold ~130M elements: about a quarter of the
whole step. Philox-2x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC'11; the Random123 generator, also behind cuRAND's and PyTorch's GPU dropout) is a
handful of integer multiplies per element, which XLA fuses and vectorises: ~17 ms for
the same mask, and cheap enough to regenerate in the backward pass instead of storing
the mask (see `t5forge.nn.attention`).

Each element is its own counter (so no element's value depends on how XLA tiles or
fuses the computation, and any slice of the mask can be computed alone): for a mask of
shape [..., m, n], counter = (row-major index within the last two axes, seed[1] + index
over the leading axes) and key = seed[0], where `seed` is two 32-bit words drawn from a
JAX key. An element is kept when the first output word is below round(keep * 2^32).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Random123's Philox-2x32 constants: the round multiplier and the Weyl key increment.
_MULTIPLIER = 0xD256D193
_KEY_INCREMENT = 0x9E3779B9
ROUNDS = 10


def _mulhilo(a: int, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(high, low) 32-bit words of the 64-bit product a * b, for a constant a.

  JAX has no uint64 unless x64 is enabled, so the high word is assembled from 16-bit
  halves; the low word is the wrapping uint32 product."""
  a_hi, a_lo = jnp.uint32(a >> 16), jnp.uint32(a & 0xFFFF)
  b_hi, b_lo = b >> 16, b & jnp.uint32(0xFFFF)
  lo_lo, lo_hi, hi_lo = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
  carry = (lo_lo >> 16) + (lo_hi & 0xFFFF) + (hi_lo & 0xFFFF)
  high = a_hi * b_hi + (lo_hi >> 16) + (hi_lo >> 16) + (carry >> 16)
  return high, b * jnp.uint32(a)


def philox2x32(counter0: jax.Array, counter1: jax.Array, key: jax.Array,
               rounds: int = ROUNDS) -> tuple[jax.Array, jax.Array]:
  """Philox-2x32-R of Random123, elementwise over broadcastable uint32 arrays.

  Returns the two uint32 output words."""
  c0, c1 = counter0.astype(jnp.uint32), counter1.astype(jnp.uint32)
  k = key.astype(jnp.uint32)
  for _ in range(rounds):
    high, low = _mulhilo(_MULTIPLIER, c0)
    c0, c1 = high ^ k ^ c1, low
    k = k + jnp.uint32(_KEY_INCREMENT)
  return c0, c1


def seed_words(rng: jax.Array) -> jax.Array:
  """Two uint32 words [2] drawn from a JAX key: the mask's key and stream offset."""
  return jax.random.bits(rng, (2,), jnp.uint32)


def keep_threshold(rate: float) -> int:
  """The uint32 bound below which an element is kept: round((1 - rate) * 2^32)."""
  return min(int(round((1.0 - rate) * 2.0 ** 32)), 2 ** 32 - 1)


def keep_mask(seed: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """bool [shape]: True (keep) with probability 1 - rate, independently per element.

  Args:
    seed: uint32 [2] from `seed_words`.
    shape: the mask's shape; the last two axes may hold up to 2^32 elements together,
      as may the leading axes.
  """
  shape = tuple(int(n) for n in shape)
  inner_shape = shape[-2:]
  outer_shape = shape[:-2]
  inner, outer = math.prod(inner_shape), math.prod(outer_shape)
  if inner > 2 ** 32 or outer > 2 ** 32:
    raise ValueError(f"dropout mask {shape} too large for 32-bit Philox counters")
  # Row-major index within the last two axes ([1, .., m, n]) and over the leading ones
  # ([b, .., 1, 1]) as uint32 iotas of those shapes, which broadcast against each other
  # in the first Philox round (no [prod(shape)] reshape, which XLA would copy). Not
  # full-shape iotas: inside a scan over layers, XLA hoists every loop-invariant
  # expression out of the loop, and the first round's products of the full-shape
  # index became three [b, h, q, k] uint32 arrays that every layer's mask fusion
  # read from memory (3 x 50 MB per flan-t5-small encoder mask); at these shapes
  # what is hoisted is 1 MB.
  ndim = len(shape)

  def flat_index(axes: range) -> jax.Array:
    sub_shape = tuple(n if axis in axes else 1 for axis, n in enumerate(shape))
    index = jnp.zeros((), jnp.uint32)
    for axis in axes:
      iota = lax.broadcasted_iota(jnp.uint32, sub_shape, axis)
      index = index * jnp.uint32(shape[axis]) + iota
    return index

  counter0 = flat_index(range(max(ndim - 2, 0), ndim))
  counter1 = flat_index(range(0, max(ndim - 2, 0))) + seed[1].astype(jnp.uint32)
  word, _ = philox2x32(counter0, counter1, seed[0])
  return jnp.broadcast_to(word, shape) < jnp.uint32(keep_threshold(rate))
