"""How XLA:CPU lays out the attention's batched products (`attention._weighted_sum`)."""
import re

import jax
import jax.numpy as jnp
import pytest

from t5forge.nn import attention, philox

B, L, H, D = 2, 96, 3, 32


def _dot_outputs(dtype, dropout):
  """Output shapes of the dots in the compiled forward and backward pass."""
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, dout = (jax.random.normal(key, (B, L, H, D), dtype) for key in ks)
  bias = jnp.zeros((1, H, L, L), jnp.float32)
  mask = jnp.zeros((B, 1, 1, L), jnp.float32)
  seed = philox.seed_words(jax.random.key(1)) if dropout else None

  def f(q, k, v, bias, dout):
    out, vjp = jax.vjp(lambda *a: attention._attention(*a, mask, seed, dropout), q, k, v, bias)
    return out, vjp(dout)

  hlo = jax.jit(f).lower(q, k, v, bias, dout).compile().as_text()
  return re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} dot\(", hlo)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,dropout", [(jnp.bfloat16, 0.1), (jnp.bfloat16, 0.0),
                                           (jnp.float32, 0.1)])
def test_weighted_sums_are_row_major_products(dtype, dropout):
  # The attention output and the query gradient: [b, h, q, k] x [b, h, k, d] with a
  # [b, h, q, d] result. With an einsum XLA:CPU computed the transposed product
  # ([b, h, d, k] x [b, h, q, k] -> [b, h, d, q]), which YNNPACK runs ~1.3x slower.
  outs = _dot_outputs(dtype, dropout)
  acc = "f32"
  assert outs.count(f"{acc}[{B},{H},{L},{D}]") == 2, outs
  # Only the key and value gradients are still taken transposed ([b, h, d, k]): their
  # row-major form would need a transposed copy of the [b, h, q, k] array.
  assert outs.count(f"{acc}[{B},{H},{D},{L}]") == 2, outs
