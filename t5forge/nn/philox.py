"""Dropout masks from the Philox-2x32-10 counter-based generator, four elements per call.

Why not `jax.random.bernoulli`: on XLA:CPU its threefry bits are costly per element, and
a training step's attention masks hold a [b, h, q, k] element per weight, which made
them a large share of the step (docs/performance.md). Philox-2x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC'11; the Random123 generator, also behind cuRAND's and PyTorch's GPU dropout) is a
handful of integer multiplies per call, which XLA fuses and vectorises. The backward pass
reuses the forward's packed bits (`keep_bits`, an eighth of the mask's bytes; see
`t5forge.nn.attention`).

One call gives two 32-bit words, 64 bits: four 16-bit pieces, one keep decision each.
For a mask of shape [..., m, n], element (..., i, c) reads piece c % 4 of the call with
counter = (i * ceil(n / 4) + c // 4, seed[1] + row-major index over the leading axes)
and key = seed[0], where `seed` is two 32-bit words drawn from a JAX key; pieces 0 and 1
are the low and high halves of the first output word, 2 and 3 of the second. An element
is kept when its piece is below `keep_threshold(rate)` = round((1 - rate) * 2^16), so the
keep probability is exactly `keep_probability(rate)` = threshold / 2^16 (within 2^-17 of
1 - rate; 0.899994 for rate 0.1). Every element's bits depend only on its own index, not
on how XLA tiles or fuses the computation, and any slice of the mask can be computed
alone (what regenerating it in the backward pass needs).

Why four per call, and packed: the Philox rounds are almost all of the mask's cost, so
one call per four elements is a quarter of the arithmetic. But a fused elementwise loop
computes every operand once per *output* element, so XLA fusing the calls into the
[..., m, n] consumer would run each call four times. `keep_mask` therefore packs the
four decisions of a call into one uint8 ([..., m, ceil(n / 4)], an eighth of the
mask's bytes) and ends that array with an integer remainder: XLA:CPU does not fuse an
expensive op (a remainder is one) into a consumer that reads each of its elements
several times, so the packed bits are computed once and written out.
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
# Keep decisions per Philox call: 16 bits each from its two 32-bit output words.
PER_CALL = 4
_PIECE_BITS = 16


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
  """The 16-bit piece bound below which an element is kept: round((1 - rate) * 2^16),
  in [0, 2^16] (2^16 keeps every element)."""
  return min(max(int(round((1.0 - rate) * 2.0 ** _PIECE_BITS)), 0), 2 ** _PIECE_BITS)


def keep_probability(rate: float) -> float:
  """The exact probability that `keep_mask` keeps an element: keep_threshold / 2^16.
  Dropout scales kept values by its inverse, so the expectation is exactly unchanged."""
  return keep_threshold(rate) / 2.0 ** _PIECE_BITS


def keep_mask(seed: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """bool [shape]: True (keep) with probability `keep_probability(rate)`, independently
  per element.

  Args:
    seed: uint32 [2] from `seed_words`.
    shape: the mask's shape (rank >= 1); m * ceil(n / 4) for its last two axes [m, n]
      may be up to 2^32, as may the product of the leading axes.
  """
  return unpack_keep(keep_bits(seed, shape, rate), int(shape[-1]))


def keep_bits(seed: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """The packed keep decisions of `keep_mask(seed, shape, rate)`: uint8
  [..., m, ceil(n / 4)] for shape [..., m, n], bit j of element (..., i, c) deciding
  element (..., i, 4 c + j). An eighth of the mask's bytes: what a backward pass keeps
  (see `t5forge.nn.attention`) to unpack with `unpack_keep`."""
  shape = tuple(int(n) for n in shape)
  n = shape[-1]
  # One Philox call per PER_CALL consecutive elements of a row (the last block padded).
  calls = (*shape[:-1], -(-n // PER_CALL))
  inner, outer = math.prod(calls[-2:]), math.prod(calls[:-2])
  if inner > 2 ** 32 or outer > 2 ** 32:
    raise ValueError(f"dropout mask {shape} too large for 32-bit Philox counters")
  # Row-major index within the last two axes ([1, .., m, n/4]) and over the leading ones
  # ([b, .., 1, 1]) as uint32 iotas of those shapes, which broadcast against each other
  # in the first Philox round (no [prod(calls)] reshape, which XLA would copy). Not
  # full-shape iotas: inside a scan over layers, XLA hoists every loop-invariant
  # expression out of the loop, and the first round's products of a full-shape index
  # would become [b, h, q, k] uint32 arrays that every layer's mask fusion reads back.
  ndim = len(calls)

  def flat_index(axes: range) -> jax.Array:
    sub_shape = tuple(size if axis in axes else 1 for axis, size in enumerate(calls))
    index = jnp.zeros((), jnp.uint32)
    for axis in axes:
      iota = lax.broadcasted_iota(jnp.uint32, sub_shape, axis)
      index = index * jnp.uint32(calls[axis]) + iota
    return index

  counter0 = flat_index(range(max(ndim - 2, 0), ndim))
  counter1 = flat_index(range(0, max(ndim - 2, 0))) + seed[1].astype(jnp.uint32)
  word0, word1 = philox2x32(counter0, counter1, seed[0])
  threshold = jnp.uint32(keep_threshold(rate))
  low = jnp.uint32(2 ** _PIECE_BITS - 1)
  pieces = (word0 & low, word0 >> _PIECE_BITS, word1 & low, word1 >> _PIECE_BITS)
  packed = jnp.zeros((), jnp.uint8)
  for j, piece in enumerate(pieces):
    packed = packed | ((piece < threshold).astype(jnp.uint8) << jnp.uint8(j))
  # packed < 16, so the remainder by 17 is the identity: it is there to be an expensive
  # op, which XLA:CPU will not fuse into the 4x-reusing `unpack_keep` (module
  # docstring); tests/test_philox.py checks that the packed bits stay a separate array.
  return jnp.broadcast_to(packed, calls) % jnp.uint8(17)


def unpack_keep(packed: jax.Array, n: int) -> jax.Array:
  """bool [..., m, n] from the packed bits uint8 [..., m, ceil(n / 4)] of `keep_bits`."""
  calls = packed.shape
  spread = jnp.broadcast_to(packed[..., None], (*calls, PER_CALL))
  spread = spread.reshape(*calls[:-1], calls[-1] * PER_CALL)[..., :n]  # [..., m, n]
  piece_index = lax.broadcasted_iota(jnp.uint8, (n,), 0) & jnp.uint8(PER_CALL - 1)
  return ((spread >> piece_index) & jnp.uint8(1)) != 0
