"""int8 weight-only kernels for inference (`ModelConfig.weight_dtype='int8'`).

Every projection kernel [..., in, out] (attention, MLP, the untied output layer) is
stored as int8 with one float32 scale per output channel: kernel ~= q * scale, with
scale = max|kernel[:, o]| / 127 (symmetric, per channel, as CTranslate2 and most
weight-only schemes do). Embeddings, norms and relative-position tables stay float.

At run time a matmul x @ kernel becomes (x_q @ q) * x_scale * scale, where x is
quantised per row (per token) on the fly: int8 x int8 products accumulate in int32,
which XLA:CPU runs with the VNNI dot instructions, and the weights are read at a
quarter of the float32 bytes, which is what bounds decoding at small batch.

`QArray` stands in for the kernel array in the parameter tree (it is a pytree, so jit,
scan over layers and device_put handle it); `matmul.dense` dispatches on it. Training
int8 weights is refused (`train.step.make_train_step`; saving too, in
`interactive.Model.save`/`save_hf`): this path is for decoding and scoring a trained model,
and (`exact`) for a frozen int8 base under adapter training.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


MIN_ROWS = 8


@flax.struct.dataclass
class QArray:
  """An int8 kernel with per-output-channel scales.

  Attributes:
    q: int8 [..., in, out] (the float kernel's layout, which Flax checks on apply).
    scale: float32 [..., out]; the kernel is q * scale[..., None, :].
    exact: static. False: `dense` below (activations rounded to int8 too, inference).
      True: `matmul.dense` multiplies float activations by q and rescales, exactly the
      dequantised kernel's product and gradient (a frozen int8 base under adapter
      training, where rounded activations would give a wrong derivative).
  """

  q: jax.Array
  scale: jax.Array
  exact: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  def astype(self, dtype: Any) -> "QArray":
    # Callers cast kernels to the activation dtype; int8 weights stay int8 (the matmul
    # decides the compute dtype).
    del dtype
    return self

  def dequantize(self) -> jax.Array:
    return self.q.astype(jnp.float32) * self.scale[..., None, :]


def quantize_kernel(kernel: np.ndarray | jax.Array, *, exact: bool = False) -> QArray:
  """float [..., in, out] -> QArray (symmetric per-output-channel int8)."""
  w = np.asarray(kernel, np.float32)
  amax = np.abs(w).max(axis=-2)  # [..., out]
  scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
  return QArray(q=jnp.asarray(q), scale=jnp.asarray(scale), exact=exact)


def quantize_params(params: dict, *, exact: bool = False) -> dict:
  """Replaces every projection kernel (a `kernel` leaf) of a parameter tree by a QArray."""
  out = {}
  for name, value in params.items():
    if isinstance(value, dict):
      out[name] = quantize_params(value, exact=exact)
    elif name == "kernel" and not isinstance(value, QArray):
      out[name] = quantize_kernel(value, exact=exact)
    else:
      out[name] = value
  return out


def concat(kernels: list[QArray]) -> QArray:
  """Concatenates QArrays along the output axis (fused q/k/v or gated-MLP kernels)."""
  return QArray(q=jnp.concatenate([k.q for k in kernels], axis=-1),
                scale=jnp.concatenate([k.scale for k in kernels], axis=-1),
                exact=kernels[0].exact)


def dense(x: jax.Array, kernel: QArray) -> jax.Array:
  """x [n, in] (float) @ int8 kernel [in, out] -> [n, out] in x's dtype.

  Each row of x is quantised to int8 with its own scale; the int32 accumulator is
  rescaled by both scales. Relative error is about 1% of the row's magnitude.
  """
  n = x.shape[0]
  if n < MIN_ROWS:
    # XLA:CPU runs an int8 matrix-vector product ~25x slower than a float one, but an
    # 8-row int8 product faster than the float one: pad tiny batches (greedy batch 1).
    x = jnp.pad(x, ((0, MIN_ROWS - n), (0, 0)))
  x32 = x.astype(jnp.float32)
  x_scale = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0  # [n, 1]
  x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
  xq = jnp.clip(jnp.round(x32 / x_scale), -127, 127).astype(jnp.int8)
  acc = jax.lax.dot_general(xq, kernel.q, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32)  # [n, out]
  return (acc.astype(jnp.float32) * x_scale * kernel.scale)[:n].astype(x.dtype)
