"""Sampling filters in the order of transformers' `generate` and vLLM: the caller divides
the logits by the temperature, top-k keeps the k largest, then top-p keeps the smallest
set of top tokens whose probability, renormalised over what top-k kept, is >= p.

T5X refuses top-k with top-p; OpenAI-style clients and vLLM send both, so both apply.
Ties with the k-th token are kept (as transformers), and so are ties with the last token
top-p keeps (as T5X's binary search; transformers breaks those by sort order, which
differs only on exactly equal logits).

Shape letters: f rows, v vocabulary. Dropped tokens are -inf.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def topk_mask(logits: jax.Array, k: int) -> jax.Array:
  """The k largest logits per row and ties with the k-th: logits [f, v], static k in
  1..v -> [f, v]."""
  kth = lax.top_k(logits, k)[0][:, -1:]  # [f, 1]; O(v log k), no full sort
  return jnp.where(logits >= kth, logits, -jnp.inf)


def _topp_cutoff(sorted_logits: jax.Array, topp: jax.Array) -> jax.Array:
  """The smallest logit top-p keeps: sorted_logits [f, v] descending (-inf: already
  dropped, no mass), topp [f, 1] -> [f, 1]. The top token is always kept (topp -> 0 is
  greedy)."""
  probs = jax.nn.softmax(sorted_logits, axis=-1)  # renormalised over the finite logits
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  # A token is needed while the mass of the tokens above it is still short of topp.
  keep = (mass_before < topp) | (jnp.arange(sorted_logits.shape[-1]) == 0)
  return jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)


def filter_rows(logits: jax.Array, topk: jax.Array, topp: jax.Array) -> jax.Array:
  """Per-row top-k, then top-p over what top-k kept, with one sort: logits [f, v]
  (already divided by the temperature), topk [f] int (0: off), topp [f] float (outside
  (0, 1): off) -> [f, v]."""
  v = logits.shape[-1]
  sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
  kth = jnp.take_along_axis(sorted_logits, jnp.clip(topk - 1, 0, v - 1)[:, None], axis=-1)
  k_cut = jnp.where(topk[:, None] > 0, kth, -jnp.inf)  # [f, 1]
  # Masking the sorted row keeps it sorted: top-p's softmax then sees only top-k's tokens.
  by_k = jnp.where(sorted_logits >= k_cut, sorted_logits, -jnp.inf)
  p_cut = jnp.where(((topp > 0) & (topp < 1))[:, None],
                    _topp_cutoff(by_k, topp[:, None]), -jnp.inf)
  # max: if rounding leaves the kept mass short of topp, p's cut-off is -inf; k's holds.
  return jnp.where(logits >= jnp.maximum(k_cut, p_cut), logits, -jnp.inf)


def filter_static(logits: jax.Array, topk: int, topp: jax.Array, use_topp: bool) -> jax.Array:
  """`decoding.temperature_sample`'s filters: logits [f, v] (already divided by the
  temperature), static topk (0 or >= v: off), topp [] or [f] (outside (0, 1): off),
  static use_topp (False: no row uses top-p, so no sort is compiled) -> [f, v]."""
  f, v = logits.shape
  k = topk if 0 < topk < v else 0
  by_k = lambda: topk_mask(logits, k) if k else logits
  if not use_topp:
    return by_k()
  topp = jnp.broadcast_to(topp, (f,))
  # Sort only while some row uses top-p; the sort then serves top-k as well.
  return lax.cond(jnp.any((topp > 0) & (topp < 1)),
                  lambda: filter_rows(logits, jnp.full((f,), k, jnp.int32), topp), by_k)
