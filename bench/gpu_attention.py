"""T5 attention with its relative bias, fused (cuDNN) against ours: `python -m bench.gpu_attention`.

Times the forward + backward pass (the gradients of q, k, v and the relative bias, as in
training) of one attention layer at a T5.1.1 shape, in one process, alternating the
implementations for --rounds rounds (medians): `ours` (attention.dot_product_attention,
the CPU-tuned path with the hand-written VJP), `cudnn` (fused_attention with cuDNN; only
on a CUDA GPU) and `jax_xla` (the same wrapper on jax's own XLA attention). For each it
prints the compiled step's temporary bytes (XLA's memory analysis: the [b, h, q, k]
arrays a fused kernel never writes) and the attention TFLOP/s (12 b h q k d FLOPs: two
forward and four backward products). Masks: `padding` (the encoder's [b, 1, 1, k]: the
summed bias is [b, h, q, k]) and `causal` (the decoder's [1, 1, t, t]: [1, h, t, t]).
Writes bench/results/gpu_attention.json.

H100 session: `python -m bench.gpu_attention --batch 32 --length 512` (T5.1.1-base and
-large both have 64-wide heads: 12 and 16 heads); on CPU it runs the tiny default shape
without the cudnn row, as a smoke test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.prepare import RESULTS_DIR
from t5forge.nn import attention as attn
from t5forge.nn import fused_attention as fa


def _case(args, mask_kind):
  rng = np.random.default_rng(0)
  b, l, h, d = args.batch, args.length, args.heads, args.head_dim
  q, k, v = (jnp.asarray(rng.normal(size=(b, l, h, d)), args.dtype) for _ in range(3))
  bias = jnp.asarray(rng.normal(size=(1, h, l, l)), jnp.float32)
  valid = np.ones((b, l), bool)
  valid[:, l - l // 8:] = False  # an eighth of every row is padding
  mask = (attn.padding_mask(None, jnp.asarray(valid)) if mask_kind == "padding"
          else attn.causal_mask(l))
  return q, k, v, bias, attn.mask_to_bias(mask, args.dtype)


def _step(fn, mask_bias):
  def loss(q, k, v, bias):
    return jnp.sum(fn(q, k, v, bias, mask_bias).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


IMPLEMENTATIONS = {
    "ours": attn.dot_product_attention,
    "cudnn": lambda *a: fa.fused_attention(*a, implementation="cudnn"),
    "jax_xla": lambda *a: fa.fused_attention(*a, implementation="xla"),
}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--rounds", type=int, default=10)
  args = p.parse_args(argv)
  names = [n for n in IMPLEMENTATIONS if n != "cudnn" or fa.cuda_capability() is not None]
  if "cudnn" not in names:
    print(f"no cudnn row: the backend is {jax.default_backend()}, not a CUDA GPU")
  device = jax.devices()[0]
  flops = 12 * args.batch * args.heads * args.length ** 2 * args.head_dim
  rows = []
  for mask_kind in ("padding", "causal"):
    q, k, v, bias, mask_bias = _case(args, mask_kind)
    steps, times = {}, {n: [] for n in names}
    for n in names:
      compiled = _step(IMPLEMENTATIONS[n], mask_bias).lower(q, k, v, bias).compile()
      jax.block_until_ready(compiled(q, k, v, bias))  # warm-up
      steps[n] = compiled
    for _ in range(args.rounds):
      for n in names:
        t = time.perf_counter()
        jax.block_until_ready(steps[n](q, k, v, bias))
        times[n].append(time.perf_counter() - t)
    for n in names:
      median = statistics.median(times[n])
      temp = steps[n].memory_analysis().temp_size_in_bytes
      rows.append({"mask": mask_kind, "impl": n, "median_s": median,
                   "tflops": flops / median / 1e12, "temp_bytes": temp,
                   "vs_ours": statistics.median(times["ours"]) / median})
      print(f"{mask_kind:8s} {n:8s} {median * 1e3:9.3f} ms  {flops / median / 1e12:7.2f} "
            f"TFLOP/s  temp {temp / 2**20:9.1f} MiB  ours/this {rows[-1]['vs_ours']:.2f}x")
  result = {"device": f"{device.device_kind} ({device.platform})", "args": vars(args),
            "load": os.getloadavg()[0], "rows": rows}
  os.makedirs(RESULTS_DIR, exist_ok=True)
  with open(os.path.join(RESULTS_DIR, "gpu_attention.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(f"device {result['device']}, load {result['load']:.1f}")


if __name__ == "__main__":
  main()
