"""T5's attention with its relative position bias in cuDNN's fused (flash) kernel, on GPUs.

The GPU form of `attention.dot_product_attention` (teacher forcing, no dropout):
softmax(q.k + bias + mask_bias) v with no scaling of q.k, through
`jax.nn.dot_product_attention(..., implementation='cudnn')`. The [b, h, q, k] logits
and probabilities never reach memory, and cuDNN's backward pass returns the gradient of
the additive bias (dbias), which T5 needs: the relative position bias is a parameter.

What jax 0.10's `jax.nn.dot_product_attention` allows (jax/_src/nn/functions.py and
jax/_src/cudnn/fused_attention_stablehlo.py), and what this module does about it:
- dtypes: cuDNN runs float16 / bfloat16 q, k, v only (float32 raises); float32 models
  stay on our XLA path. Only bfloat16 is taken: T5's mask value -1e10 rounds to -inf in
  float16 (a fully masked row, e.g. an all-padding example, would give NaN), and
  ModelConfig's dtypes are float32 and bfloat16 anyway.
- head_dim: a multiple of 8, at most 128 (256 on Hopper, compute capability >= 9.0).
- with a bias, the training kernels need even query and key lengths.
- `scale`: None means 1 / sqrt(head_dim); T5 needs 1.0 (it folds the scaling into the
  query initialisation), so it is passed explicitly.
- bias and mask: the cuDNN branch adds a boolean `mask` into the bias
  (`combine_bias_and_mask`), so this module passes one additive bias: the relative bias
  plus `mask_bias`, summed in float32 (-1e10 + bias stays finite) and rounded to q's
  dtype, broadcast to [1 or b, 1 or h, q, k] (cuDNN wants the full q and k lengths).
  The relative bias's gradient is cuDNN's dbias of that sum, reduced over the batch by
  autodiff of the broadcast. The decoder's causal mask [1, 1, t, t] keeps the sum at
  [1, h, t, t], the shape whose dbias every cuDNN that XLA drives computes; a padding
  mask [b, 1, 1, k] makes it [b, h, q, k], whose dbias older XLA/cuDNN pairs did not
  compute (XLA's cuda_dnn.cc: "[b, h, s, s] ... not supported for dbias calculation").
  The GPU test in tests/test_fused_attention.py compares the bias gradient in both
  cases; it is the check that the installed XLA does it.
- `implementation=None` does not try cuDNN: it always runs jax's XLA attention. And
  'cudnn' on a shape it cannot run raises (NotImplementedError / ValueError) while
  tracing. So this module decides eligibility itself (`ineligible`) and asks for 'cudnn'
  only where it can run.
- dropout: the public function has none. With attention dropout on (training with
  `dropout_rate > 0`), T5's own path (`attention.dot_product_attention`, Philox masks)
  runs instead, on every backend; evaluation and dropout-free training take the fused
  kernel.

`network.ModelConfig.attention_kernel` chooses: 'auto' (default: cuDNN where the backend
is a CUDA GPU and the call is eligible, else ours; never cuDNN on CPU), 'xla' (always
ours) or 'cudnn' (cuDNN, and a one-line error where it cannot run).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from t5forge.errors import UserError

FIELD = "network.ModelConfig.attention_kernel"
# What `fused_attention` asks jax for. A module constant so that the CPU tests can run
# the whole dispatch with jax's XLA implementation of the same function.
IMPLEMENTATION = "cudnn"


def cuda_capability() -> tuple[int, int] | None:
  """The default backend's CUDA compute capability, e.g. (9, 0) for an H100; None when
  the backend is not a CUDA GPU (CPU, TPU, ROCm: no cuDNN there)."""
  if jax.default_backend() != "gpu":
    return None
  capability = getattr(jax.devices()[0], "compute_capability", None)
  if not capability:
    return None
  major, minor = str(capability).split(".")[:2]
  return int(major), int(minor)


def ineligible(q: jax.Array, k: jax.Array, bias: jax.Array | None,
               mask_bias: jax.Array | None, *, dropout: bool,
               capability: tuple[int, int] | None) -> str | None:
  """Why cuDNN's fused attention cannot run this call; None when it can.

  Args:
    q: [b, q, h, d]; k: [b, k, h, d]; bias, mask_bias: broadcastable to [b, h, q, k].
    dropout: attention dropout is on for this call.
    capability: `cuda_capability()`.
  """
  if capability is None:
    return "the backend is not a CUDA GPU"
  if capability < (8, 0):
    return f"compute capability {capability[0]}.{capability[1]} is below 8.0 (Ampere)"
  if dropout:
    return "attention dropout is on (jax.nn.dot_product_attention has no dropout)"
  if q.dtype != jnp.bfloat16:
    return f"q/k/v are {q.dtype}, not bfloat16 (cuDNN runs float16 and bfloat16, and T5's " \
           "-1e10 mask overflows float16)"
  d = q.shape[-1]
  d_max = 256 if capability >= (9, 0) else 128
  if d % 8 or d > d_max:
    return f"head_dim {d} is not a multiple of 8 up to {d_max}"
  if (bias is not None or mask_bias is not None) and (q.shape[1] % 2 or k.shape[1] % 2):
    return f"query/key lengths {q.shape[1]}/{k.shape[1]} are odd (cuDNN's bias kernels need even)"
  return None


def use_cudnn(setting: str, q: jax.Array, k: jax.Array, bias: jax.Array | None,
              mask_bias: jax.Array | None, *, dropout: bool) -> bool:
  """The dispatch: whether `attention_kernel = setting` runs this call on cuDNN.

  'auto' takes cuDNN exactly where `ineligible` finds no reason against it (so never on
  CPU); 'xla' never; 'cudnn' always, and raises a UserError where it cannot run.
  """
  if setting == "xla":
    return False
  reason = ineligible(q, k, bias, mask_bias, dropout=dropout, capability=cuda_capability())
  if setting == "cudnn" and reason is not None:
    raise UserError(f"{FIELD} = 'cudnn' cannot run this attention: {reason}; set it to "
                    "'auto' (cuDNN where it can run, T5's own attention elsewhere)")
  return reason is None


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                    mask_bias: jax.Array | None, *,
                    implementation: str | None = None) -> jax.Array:
  """softmax(q.k + bias + mask_bias) v through `jax.nn.dot_product_attention`.

  Args:
    q: [b, q, h, d]; k, v: [b, k, h, d] (bfloat16 for cuDNN).
    bias: relative position bias [1, h, q, k] (float32; a parameter: it gets a gradient),
      or None (cross-attention).
    mask_bias: additive mask [b or 1, 1, q or 1, k] (0 or attention.MASK_VALUE), or None.
    implementation: 'cudnn', or 'xla' (jax's own XLA attention: the CPU tests' reference
      for this very call); None = `IMPLEMENTATION`.

  Returns:
    [b, q, h, d] in q's dtype. No dropout (see the module docstring).
  """
  combined = None
  for x in (bias, mask_bias):
    if x is not None:
      x = x.astype(jnp.float32)
      combined = x if combined is None else combined + x
  if combined is not None:
    # cuDNN reads the bias with the full query and key lengths, in q's dtype.
    shape = (combined.shape[0], combined.shape[1], q.shape[1], k.shape[1])
    combined = jnp.broadcast_to(combined, shape).astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, bias=combined, scale=1.0,
                                      implementation=implementation or IMPLEMENTATION)
