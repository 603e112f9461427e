"""Dropout masks from Philox-2x32-10: Random123's known-answer vectors, and the
statistics a dropout mask needs (rate, independence across elements and seeds)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5forge.nn import philox


# Random123's kat_vectors, "philox2x32 10": counter (2 words), key -> output (2 words).
KAT = [
    ((0x00000000, 0x00000000), 0x00000000, (0xFF1DAE59, 0x6CD10DF2)),
    ((0xFFFFFFFF, 0xFFFFFFFF), 0xFFFFFFFF, (0x2C3F628B, 0xAB4FD7AD)),
    ((0x243F6A88, 0x85A308D3), 0x13198A2E, (0xDD7CE038, 0xF62A4C12)),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox2x32_10_matches_random123(counter, key, want):
  got = jax.jit(philox.philox2x32)(jnp.uint32(counter[0]), jnp.uint32(counter[1]),
                                   jnp.uint32(key))
  assert tuple(int(w) for w in got) == want


def test_mulhilo_is_the_64_bit_product():
  b = np.random.default_rng(0).integers(0, 2 ** 32, size=4096, dtype=np.uint64)
  for a in (0xD256D193, 0xFFFFFFFF, 1, 0x10001):
    hi, lo = philox._mulhilo(a, jnp.asarray(b.astype(np.uint32)))
    want = b * np.uint64(a)
    np.testing.assert_array_equal(np.asarray(hi), (want >> np.uint64(32)).astype(np.uint32))
    np.testing.assert_array_equal(np.asarray(lo), (want & np.uint64(2 ** 32 - 1)).astype(np.uint32))


def _mask(seed: int, shape=(4, 6, 64, 128), rate=0.1) -> np.ndarray:
  return np.asarray(philox.keep_mask(philox.seed_words(jax.random.key(seed)), shape, rate))


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_rate(rate):
  m = _mask(0, rate=rate)
  # The keep probability is a 16-bit fraction, within 2^-17 of 1 - rate.
  p = philox.keep_probability(rate)
  assert p == philox.keep_threshold(rate) / 65536 and abs(p - (1 - rate)) <= 2 ** -17
  sigma = np.sqrt(p * (1 - p) / m.size)
  assert abs(m.mean() - p) < 5 * sigma, (m.mean(), p)
  # Every row of every head gets its own draw (no repeated [q, k] blocks or rows).
  assert abs(m.mean(axis=(2, 3)) - p).max() < 6 * np.sqrt(p * (1 - p) / (64 * 128))
  assert len({r.tobytes() for r in m.reshape(-1, 128)}) == m.size // 128


def test_masks_are_independent_across_elements_and_seeds():
  p = 0.9
  a, b = _mask(0).astype(np.float64), _mask(1).astype(np.float64)
  n = a.size
  tol = 5 * np.sqrt(p * p * (1 - p * p) / n)
  # Neighbours along keys and along queries, and the same position under another seed,
  # are kept together with probability p^2, as independent draws would be.
  assert abs((a[..., 1:] * a[..., :-1]).mean() - p * p) < tol
  assert abs((a[..., 1:, :] * a[..., :-1, :]).mean() - p * p) < tol
  assert abs((a * b).mean() - p * p) < tol
  # And the same seed gives the same mask.
  np.testing.assert_array_equal(_mask(0), _mask(0))


@pytest.mark.slow
def test_mask_of_any_rank():
  for shape in [(1000,), (7, 9), (2, 3, 5, 7, 11)]:
    m = _mask(3, shape, 0.25)
    assert m.shape == shape and 0.6 < m.mean() < 0.9


def _numpy_keep_mask(seed, shape, rate) -> np.ndarray:
  """The documented counter assignment in numpy (uint64 products), element by element:
  element (..., i, c) of [..., m, n] reads 16-bit piece c % 4 (low/high half of word 0,
  then of word 1) of the call with counter = (i * ceil(n / 4) + c // 4, seed[1] +
  row-major index over the leading axes)."""
  seed = np.asarray(seed).astype(np.uint64)
  mask32 = np.uint64(2 ** 32 - 1)
  n = shape[-1]
  m = shape[-2] if len(shape) > 1 else 1
  n4 = -(-n // 4)
  index = np.indices(shape).reshape(len(shape), -1).astype(np.uint64)
  col = index[-1]
  row = index[-2] if len(shape) > 1 else np.zeros_like(col)
  lead = np.zeros_like(col)
  for axis in range(len(shape) - 2):
    lead = lead * np.uint64(shape[axis]) + index[axis]
  c0 = row * np.uint64(n4) + col // np.uint64(4)
  c1 = (lead + seed[1]) & mask32
  assert m * n4 <= 2 ** 32
  k = seed[0]
  for _ in range(philox.ROUNDS):
    prod = c0 * np.uint64(philox._MULTIPLIER)
    c0, c1 = ((prod >> np.uint64(32)) ^ k ^ c1) & mask32, prod & mask32
    k = (k + np.uint64(philox._KEY_INCREMENT)) & mask32
  piece = col % np.uint64(4)
  word = np.where(piece < 2, c0, c1)
  bits = (word >> (np.uint64(16) * (piece % np.uint64(2)))) & np.uint64(0xFFFF)
  return (bits < np.uint64(philox.keep_threshold(rate))).reshape(shape)


@pytest.mark.parametrize("shape", [(1000,), (7, 9), (3, 5, 8), (2, 3, 5, 7, 11), (2, 3, 4, 6)])
def test_mask_follows_the_documented_counters(shape):
  seed = philox.seed_words(jax.random.key(5))
  got = np.asarray(jax.jit(philox.keep_mask, static_argnums=(1, 2))(seed, shape, 0.3))
  np.testing.assert_array_equal(got, _numpy_keep_mask(seed, shape, 0.3))


def test_scanned_masks_hoist_no_mask_sized_arrays():
  """Inside a scan (over layers) XLA hoists loop-invariant work out of the loop; the
  mask's index arithmetic must not become full-size [b, h, q, k] arrays that every
  iteration reads back (what made a scanned training step slower than a loop)."""
  shape = (2, 3, 64, 128)

  def body(total, seed):
    keep = philox.keep_mask(seed, shape, 0.1)
    return total + jnp.where(keep, 1.0, 0.0).sum(), None

  seeds = jax.random.bits(jax.random.key(0), (4, 2), jnp.uint32)
  hlo = jax.jit(lambda s: jax.lax.scan(body, 0.0, s)[0]).lower(seeds).compile().as_text()
  loops = [line.split(" while(")[0] for line in hlo.splitlines() if " while(" in line]
  assert loops, "no while loop in the compiled scan"
  carried = "u32[" + ",".join(map(str, shape)) + "]"
  assert not any(carried in line for line in loops), loops


def test_every_piece_of_a_call_is_unbiased_and_independent():
  """The four decisions of one Philox call (columns 4j..4j+3) are kept with the same
  probability and independently of each other, as separate calls would be."""
  m = _mask(2, shape=(4, 6, 256, 256), rate=0.3).astype(np.float64)
  p = philox.keep_probability(0.3)
  pieces = m.reshape(*m.shape[:-1], -1, 4)  # [..., n/4, piece]
  sigma = np.sqrt(p * (1 - p) / pieces[..., 0].size)
  for j in range(4):
    assert abs(pieces[..., j].mean() - p) < 5 * sigma, (j, pieces[..., j].mean())
  tol = 5 * np.sqrt(p * p * (1 - p * p) / pieces[..., 0].size)
  for i in range(4):
    for j in range(i + 1, 4):
      assert abs((pieces[..., i] * pieces[..., j]).mean() - p * p) < tol, (i, j)


def test_packed_bits_are_computed_once_per_four_elements():
  """XLA keeps the packed decisions a separate uint8 [..., m, n/4] array: fused into the
  [..., m, n] consumer, each Philox call would run four times (philox docstring)."""
  shape = (2, 3, 64, 128)
  seed = philox.seed_words(jax.random.key(0))
  w = jnp.ones(shape, jnp.bfloat16)
  fn = jax.jit(lambda w, s: jnp.where(philox.keep_mask(s, shape, 0.1), w * 2, 0.0))
  hlo = fn.lower(w, seed).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  assert "u8[2,3,64,32]" in entry, entry
