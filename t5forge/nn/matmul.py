"""Projections with a hand-written backward pass, shaped for XLA:CPU's matmul kernels.

`dense(x, kernel)` computes x @ kernel exactly as `jnp.dot` does; what differs is the
backward pass. Autodiff asks for the kernel gradient as x^T @ dy, a dot that contracts
the leading (token) axis of both operands. XLA:CPU's fast matmul library (YNNPACK)
takes a transposed right-hand side but not a transposed left-hand side, so XLA either
falls back to a slower kernel or copies the largest operand (often the [tokens, vocab]
logits gradient) into transposed layout. Here x is transposed explicitly in bfloat16
(see `_transposed` for how; in float32 the smaller of x and dy, by XLA), and every dot
is a plain [m, k] x [k, n] or [m, k] x [n, k] product.

`dense_multi(x, kernels)` applies several kernels to one input (query/key/value, the
two gated MLP branches) as one matmul on the concatenated kernels: one large product
keeps both cores busier than several small ones, and the backward pass needs one
transpose of x and one dx product instead of one per kernel.

The results equal those of `jnp.dot` up to float32 rounding (accumulation order).

bfloat16 operands are multiplied with float32 accumulation and a float32 result
(`preferred_element_type`), the only form XLA:CPU hands to its fast bf16 kernels
(docs/performance.md). The result is then rounded to the requested dtype. The
kernel may be float32 (the parameter itself): it is rounded to x's dtype inside, and its
gradient is the float32 product, not rounded to bfloat16 and converted back (one
conversion pass less per kernel, and a float32 gradient as under torch autocast).

Shape letters (local to this module, see docs/shapes.md): n tokens (all leading axes
flattened), i input features, o output features.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from t5forge.nn import lora as lora_lib
from t5forge.nn import quant, stack

# dense_multi concatenates the kernels only for products of at least this many rows.
FUSE_MIN_ROWS = 256
# bfloat16 products with fewer rows are padded to this many (see `dense`).
BF16_MIN_ROWS = 8
# Column block of the identity products that transpose bfloat16 operands (`_transposed`).
TRANSPOSE_BLOCK = 64


def accumulation_dtype(dtype) -> jnp.dtype | None:
  """The `preferred_element_type` for dots of this operand dtype: float32 for bfloat16
  (float32 accumulation, and XLA:CPU's fast bf16 kernels), else the default."""
  return jnp.float32 if dtype == jnp.bfloat16 else None


def _dot(a: jax.Array, b: jax.Array, a_axis: int, b_axis: int) -> jax.Array:
  """Contracts a's axis a_axis with b's axis b_axis (2-D operands); bf16 -> float32."""
  return lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((), ())),
                         preferred_element_type=accumulation_dtype(a.dtype))


def _transposed(a: jax.Array) -> jax.Array:
  """a.T [m, n] -> [n, m], materialised for bfloat16.

  XLA folds a plain transpose into the consuming dot, which then contracts the leading
  axis of its left operand; XLA:CPU has no bf16 kernel for that form and converts both
  operands to float32, several times slower (docs/performance.md). Neither an
  optimization barrier (XLA then copies the transpose but still multiplies in float32)
  nor an elementwise op, a bitcast or a float32 source in between survives XLA's
  simplifier, but a product with the identity does: exact (each output is one bf16 value
  times 1 summed with zeros). It is taken per block of TRANSPOSE_BLOCK columns,
  eye [b, b] x a [m, c, b] batched over the c = n / b blocks: 2 m n b FLOPs instead of
  the 2 m n^2 of one [n, n] identity; XLA lays the blocks out batch-first with a plain
  copy. In float32 XLA's own handling of the transposed operand
  is as fast as a copy, so the transpose is left to it.
  """
  if a.dtype != jnp.bfloat16:
    return a.T
  m, n = a.shape
  b = TRANSPOSE_BLOCK if n % TRANSPOSE_BLOCK == 0 else n
  eye = jnp.broadcast_to(jnp.eye(b, dtype=a.dtype), (n // b, b, b))
  out = lax.dot_general(eye, a.reshape(m, n // b, b), (((2,), (2,)), ((0,), (1,))),
                        preferred_element_type=jnp.float32)  # [c, b, m]
  return out.astype(a.dtype).reshape(n, m)


def _kernel_grad(x2: jax.Array, dy2: jax.Array) -> jax.Array:
  """x2^T @ dy2 for x2 [n, i], dy2 [n, o] -> [i, o] (float32 for bfloat16 operands).

  bfloat16: x2 is transposed explicitly (`_transposed`, whose cost is linear in its
  size), and the float32 product is the gradient, without a transpose after it that
  would have to be taken in bf16 (rounding the gradient). float32: XLA takes the
  transposes (with the smaller operand transposed, as before the bf16 path changed)."""
  if x2.dtype == jnp.bfloat16 or x2.shape[1] <= dy2.shape[1]:
    return _dot(_transposed(x2), dy2, 1, 0)  # [i, n] x [n, o]
  return _dot(dy2.T, x2, 1, 0).T  # ([o, n] x [n, i])^T


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense2d(x2: jax.Array, kernel: jax.Array, out_dtype) -> jax.Array:
  # [n, i] x [i, o] -> [n, o], the kernel rounded to x's dtype
  return _dot(x2, kernel.astype(x2.dtype), 1, 0).astype(out_dtype)


def _dense2d_fwd(x2, kernel, out_dtype):
  # symbolic_zeros: x2 and kernel arrive as CustomVJPPrimal, `.perturbed` False for what
  # is not differentiated. A frozen kernel (adapter training, an int8 base) has no
  # gradient to compute, so x2 is not kept for it either.
  x2, kernel, want_kernel = x2.value, kernel.value, kernel.perturbed
  y = _dense2d(x2, kernel, out_dtype)
  # (An empty array carries x's dtype: residuals must be arrays.)
  dtype_of_x = jnp.zeros((0,), x2.dtype)
  if not want_kernel:
    return y, (None, kernel, dtype_of_x)
  if x2.dtype == jnp.bfloat16:
    # A scanned stack keeps the bf16 operand as the loop does (a norm's or activation's
    # output, cast), rather than its float32 inputs and a bf16 copy of the norm's output
    # that XLA:CPU writes per layer through the whole stack (see stack.keep).
    return y, (*stack.keep(x2), kernel, dtype_of_x)
  return y, (x2, kernel, dtype_of_x)


def _dense2d_bwd(out_dtype, res, dy2):
  x2, kernel, dtype_of_x = res
  x_dtype = dtype_of_x.dtype
  if isinstance(dy2, jax.custom_derivatives.SymbolicZero):
    return None, None
  dy2 = dy2.astype(x_dtype)  # a float32 output (logits) still multiplies in x's dtype
  dx2 = _dot(dy2, kernel.astype(x_dtype), 1, 1).astype(x_dtype)  # [n, o] x [i, o] -> [n, i]
  if x2 is None:
    return dx2, None
  return dx2, _kernel_grad(x2, dy2).astype(kernel.dtype)


_dense2d.defvjp(_dense2d_fwd, _dense2d_bwd, symbolic_zeros=True)


class Lora(NamedTuple):
  """A kernel with its LoRA update (`t5forge.nn.lora`): x @ kernel + scale * (x' @ a) @ b,
  x' = x with dropout at `dropout_rate` (rng None: none).

  Attributes:
    kernel: [i, o] float (any float dtype) or an int8 `quant.QArray`.
    a: [i, r]; b: [r, o] (float32 parameters). Stacked adapters (`lora.stack`): a
      [N, i, R], b [N, R, o] with the scales folded in; each row takes its own adapter's
      (`lora.row_adapters`).
  """

  kernel: jax.Array | quant.QArray
  a: jax.Array
  b: jax.Array
  scale: float
  dropout_rate: float = 0.0
  rng: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.kernel.shape)


def _lora_delta(x: jax.Array, k: Lora, out_dtype) -> jax.Array:
  """scale * (dropout(x) @ a) @ b for x [..., i] -> [..., o] in out_dtype; both products in
  x's dtype (the rank-r intermediate rounded to it, as under torch autocast)."""
  if k.a.ndim == 3:
    return _stacked_delta(x, k, out_dtype)
  if k.rng is not None and k.dropout_rate > 0:
    keep = jax.random.bernoulli(k.rng, 1.0 - k.dropout_rate, x.shape)
    x = jnp.where(keep, x / (1.0 - k.dropout_rate), 0).astype(x.dtype)
  h = dense(x, k.a, out_dtype=x.dtype)  # [..., r]
  return (dense(h, k.b, out_dtype=jnp.float32) * jnp.float32(k.scale)).astype(out_dtype)


def _stacked_delta(x: jax.Array, k: Lora, out_dtype) -> jax.Array:
  """Each row's own update, x [b, ..., i] -> [b, ..., o] in out_dtype, for stacked a
  [N, i, R], b [N, R, o]: the rows' factors are gathered ([b, i, R], [b, R, o], small next
  to the kernel) rather than every adapter applied to every row (N times the FLOPs)."""
  ids = lora_lib.row_ids(x.shape[0])
  rows = x.reshape(x.shape[0], -1, x.shape[-1])  # [b, t, i]
  a = jnp.take(k.a, ids, axis=0).astype(x.dtype)  # [b, i, R]
  b = jnp.take(k.b, ids, axis=0).astype(x.dtype)  # [b, R, o]
  h = jnp.einsum("bti,bir->btr", rows, a,
                 preferred_element_type=accumulation_dtype(x.dtype)).astype(x.dtype)
  y = jnp.einsum("btr,bro->bto", h, b, preferred_element_type=jnp.float32)
  return y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype)


def dense(x: jax.Array, kernel: jax.Array | quant.QArray | Lora, out_dtype=None) -> jax.Array:
  """x [..., i] @ kernel [i, o] -> [..., o], in x's dtype (the compute dtype); a kernel
  in another float dtype (a float32 parameter) is rounded to it, and its gradient comes
  back in the kernel's dtype.

  The result is in `out_dtype`, by default the accumulation dtype: float32 for bfloat16
  operands (XLA:CPU emulates bfloat16 elementwise arithmetic with a conversion around
  every operation, so what follows a matmul is cheaper in float32), else x's dtype. An
  int8 `quant.QArray` kernel takes the int8 path: `quant.dense` (inference), or with
  `exact` the float-activation product (x @ q) * scale, whose gradient is
  (dy * scale) @ q^T (training adapters on an int8 base). A `Lora` kernel adds its update."""
  lead = x.shape[:-1]
  out_dtype = jnp.dtype(out_dtype or accumulation_dtype(x.dtype) or x.dtype)
  if isinstance(kernel, Lora):
    return dense(x, kernel.kernel, out_dtype) + _lora_delta(x, kernel, out_dtype)
  if isinstance(kernel, quant.QArray) and kernel.exact:
    y = dense(x, kernel.q, jnp.float32) * kernel.scale
    return y.astype(out_dtype)
  if isinstance(kernel, quant.QArray):
    y = quant.dense(x.reshape(-1, x.shape[-1]), kernel).astype(out_dtype)
  else:
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    # A symbolic n (a batch-polymorphic export) skips the padding: it is only speed.
    if x2.dtype == jnp.bfloat16 and isinstance(n, int) and n < BF16_MIN_ROWS:
      # A bf16 matrix-vector product (greedy batch 1) takes XLA:CPU's slow path; an
      # 8-row product runs on the fast kernels.
      x2 = jnp.pad(x2, ((0, BF16_MIN_ROWS - n), (0, 0)))
    y = _dense2d(x2, kernel, out_dtype)[:n]
  return y.reshape(*lead, kernel.shape[-1])


def dense_multi(x: jax.Array, kernels: Sequence[jax.Array]) -> list[jax.Array]:
  """[x @ k for k in kernels] as one matmul on the kernels concatenated along o."""
  rows = 1
  for n in x.shape[:-1]:
    rows *= n
  if len(kernels) == 1 or not isinstance(rows, int) or rows < FUSE_MIN_ROWS:
    # With few rows (a decoding step) the product is bound by reading the weights, and
    # concatenating them would copy every kernel once more per call. A symbolic row count
    # (a batch-polymorphic SavedModel) cannot be compared: it takes this, the exact path.
    return [dense(x, k) for k in kernels]
  sizes = [k.shape[-1] for k in kernels]
  base = [k.kernel if isinstance(k, Lora) else k for k in kernels]
  fused = (quant.concat(base) if isinstance(base[0], quant.QArray)
           else jnp.concatenate(base, axis=-1))
  y = dense(x, fused)  # [..., sum(o)]
  offsets = [0]
  for s in sizes:
    offsets.append(offsets[-1] + s)
  # The updates are added per branch: the base product stays one fused matmul.
  return [y[..., a:b] + _lora_delta(x, k, y.dtype) if isinstance(k, Lora) else y[..., a:b]
          for k, a, b in zip(kernels, offsets[:-1], offsets[1:])]
