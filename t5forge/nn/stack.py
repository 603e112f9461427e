"""Runs a stack of identical layers: a Python loop, or `nn.scan`, with optional remat.

A loop gives parameters `layers_0`, `layers_1`, ... exactly as T5X and HF checkpoints
name them. A scan compiles one layer and stacks its parameters on a leading axis
named 'layers' (parameter path `layers/...`); `stack_layers` / `unstack_layers` below
(via `t5forge.convert.relayout`) convert between the two layouts. Layers return
`(x, None)` when scanned and `x` otherwise.
"""
from __future__ import annotations

import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from t5forge import sharding as ax

REMAT_POLICIES = {
    "none": None,
    # Save matmul outputs without a batch dimension (T5X's 'minimal').
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "full": jax.checkpoint_policies.nothing_saveable,
}

# What a scanned stack keeps for the backward pass under remat_policy 'none': what is
# expensive to recompute (matmuls, custom VJPs, reductions, random bits, transcendental
# activations), because a scan would otherwise carry every cheap intermediate that a loop
# of layers fuses away as a stacked array (docs/performance.md, "Scan over layers").
_SCAN_SAVED = frozenset({
    "dot_general", "custom_vjp_call", "custom_vjp_call_jaxpr", "conv_general_dilated",
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "cumsum",
    "cumlogsumexp", "cummax", "cummin", "sort", "gather", "scatter", "scatter-add",
    "threefry2x32", "random_bits", "random_seed", "random_fold_in", "random_split",
    "random_wrap", "random_unwrap", "tanh", "logistic", "erf"})


# The checkpoint name of values that a scanned stack keeps as well (see `keep`).
KEPT = "scan_kept"


def keep(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """Marks residuals of a hand-written VJP (e.g. attention's float32 probabilities
  [b, h, q, k]) as kept for the backward pass of a scanned stack. Only for residuals
  (values returned by a custom VJP's forward for its backward): a bfloat16 value's bits
  pass through an integer type, which autodiff does not differentiate through.

  A custom VJP's forward is traced inline, so its residuals are the outputs of ordinary
  primitives (elementwise ones for a softmax or a cast), which `scan_saveable` would
  recompute in the backward loop (with the softmax: from the saved logits, a pass over
  [b, h, q, k] more per layer, and the logits stacked across layers besides). A named
  value is kept as it is. Outside a scan this is the identity.

  bfloat16 values are kept as their uint16 bits: XLA:CPU writes a bfloat16 layer's
  slice into the stacked [layers, ...] array by converting the whole stack to float32
  and back (a pass over every layer's values, per layer), an integer slice in place.
  """
  return tuple(_kept(x) for x in xs)


def _kept(x: jax.Array) -> jax.Array:
  if x.dtype != jnp.bfloat16:
    return checkpoint_name(x, KEPT)
  bits = checkpoint_name(jax.lax.bitcast_convert_type(x, jnp.uint16), KEPT)
  return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def scan_saveable(prim, *_, **params) -> bool:
  """The remat policy of a scanned stack without remat (see `_SCAN_SAVED` and `keep`)."""
  if prim.name == "name":  # jax.ad_checkpoint.checkpoint_name
    return params.get("name") == KEPT
  return prim.name in _SCAN_SAVED


def layer_stack(layer_cls: type[nn.Module], *, num_layers: int, scan: bool, remat_policy: str,
                layer_kwargs: dict[str, Any], x: jax.Array, args: dict[str, Any],
                static: dict[str, Any], layer_flags: tuple[bool, ...] | None = None) -> jax.Array:
  """Applies `num_layers` layers of `layer_cls` to x; call from a compact method.

  Args:
    layer_cls: a module whose `__call__(x, [flag,] ...)` returns x (or (x, None) if
      scanned).
    layer_kwargs: constructor arguments of each layer (besides `name` and `scanned`).
    x: the carried activations [b, l, e].
    args: arguments broadcast to every layer, by the names of its `__call__`.
    static: the Python-valued arguments (e.g. `deterministic`, `decode`, `max_length`),
      by name: remat and scan treat them as static. `decode=True` means decoding with a
      cache: no remat (nothing is differentiated), and scanned caches are stacked on
      axis 1 so that axis 0 stays the batch (decoders expand and reorder caches along
      axis 0 for beams).
    layer_flags: one bool per layer (e.g. "uses the sliding window"), passed to layer i
      right after x: a Python bool in the loop, a traced bool scalar under scan (one
      compiled layer serves both kinds).
  """
  flagged = layer_flags is not None
  if flagged:
    assert len(layer_flags) == num_layers, (layer_flags, num_layers)
  values, static_argnums = _positional(layer_cls, 1 + flagged, args, static)
  if flagged and not scan:
    static_argnums = (1,) + static_argnums  # the flag: a Python bool in the loop
  decode = bool(static.get("decode", False))
  block = layer_cls
  policy = REMAT_POLICIES[remat_policy]
  if scan and remat_policy == "none":
    policy = scan_saveable  # no remat of what a loop would keep either (see above)
  if (remat_policy != "none" or scan) and not decode:
    # Flax's remat counts `self` as argument 0.
    block = nn.remat(block, policy=policy, prevent_cse=not scan,
                     static_argnums=tuple(i + 1 for i in static_argnums))
  if scan:
    if flagged:
      values = (jnp.asarray(layer_flags, bool),) + values
    scanned = nn.scan(
        block,
        variable_axes={"params": 0, "cache": 1},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0,) * flagged + (nn.broadcast,) * (len(values) - flagged),
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: ax.LAYERS},
    )
    x, _ = scanned(**layer_kwargs, scanned=True, name="layers")(x, *values)
    return x
  for i in range(num_layers):
    flag = (bool(layer_flags[i]),) if flagged else ()
    x = block(**layer_kwargs, scanned=False, name=f"layers_{i}")(x, *flag, *values)
  return x


def _positional(layer_cls: type[nn.Module], skip: int, args: dict[str, Any],
                static: dict[str, Any]) -> tuple[tuple, tuple[int, ...]]:
  """The named arguments of a layer call as the positional ones that remat and scan take.

  Returns (values in the order of `layer_cls.__call__`'s parameters after the first
  `skip` (x and the flag), up to the last one named; the indices of the static ones,
  counting x as 0). A parameter left out in between takes its default, as static.
  """
  assert not set(args) & set(static), sorted(set(args) & set(static))
  params = list(inspect.signature(layer_cls.__call__).parameters.values())[1 + skip:]
  names = [p.name for p in params]
  unknown = sorted((set(args) | set(static)) - set(names))
  assert not unknown, f"{layer_cls.__name__} takes no argument(s) {unknown}"
  given = [i for i, name in enumerate(names) if name in args or name in static]
  values, static_argnums = [], []
  for i, p in enumerate(params[:given[-1] + 1] if given else ()):
    if p.name in args:
      values.append(args[p.name])
      continue
    if p.name not in static:
      assert p.default is not inspect.Parameter.empty, f"{layer_cls.__name__} needs {p.name}"
    values.append(static.get(p.name, p.default))
    static_argnums.append(skip + i)
  return tuple(values), tuple(static_argnums)


def _layer_index(key: str) -> int | None:
  if key.startswith("layers_") and key[len("layers_"):].isdigit():
    return int(key[len("layers_"):])
  return None


def stack_layers(tree: dict, stack=None) -> dict:
  """Converts `layers_0..layers_{n-1}` subtrees into one `layers` subtree (scan layout).

  Args:
    tree: nested dict of arrays (parameters, or any tree shaped like them).
    stack: how to combine the n leaves; default `np.stack` on a new leading axis.
  """
  stack = stack or (lambda leaves: np.stack(leaves, axis=0))
  if not isinstance(tree, dict):
    return tree
  indices = sorted(i for i in map(_layer_index, tree) if i is not None)
  out = {k: stack_layers(v, stack) for k, v in tree.items() if _layer_index(k) is None}
  if indices:
    assert indices == list(range(len(indices))), f"layer indices not contiguous: {indices}"
    per_layer = [tree[f"layers_{i}"] for i in indices]
    out["layers"] = jax.tree.map(lambda *leaves: stack(list(leaves)), *per_layer)
  return out


def stack_owned(tree: dict) -> dict:
  """`stack_layers` for a tree nothing else holds: the per-layer leaves of each
  parameter are dropped as its stacked array is made, so the peak is the tree plus one
  stacked parameter, not two trees (a 44 GB base relaid out on load). `tree` is emptied.
  int8 kernels (`quant.QArray`) stack their `q` and `scale`."""
  indices = sorted(i for i in map(_layer_index, tree) if i is not None)
  out = {k: stack_owned(v) if isinstance(v, dict) else v
         for k, v in tree.items() if _layer_index(k) is None}
  if indices:
    assert indices == list(range(len(indices))), f"layer indices not contiguous: {indices}"
    flat = [jax.tree_util.tree_flatten(tree.pop(f"layers_{i}")) for i in indices]
    treedef = flat[0][1]
    columns = [leaves for leaves, _ in flat]
    del flat
    stacked = []
    for j in range(len(columns[0])):
      stacked.append(np.stack([leaves[j] for leaves in columns]))
      for leaves in columns:
        leaves[j] = None
    out["layers"] = jax.tree_util.tree_unflatten(treedef, stacked)
  tree.clear()
  return out


def unstack_layers(tree: dict) -> dict:
  """Inverse of `stack_layers`: a `layers` subtree with a leading axis -> `layers_<i>`."""
  if not isinstance(tree, dict):
    return tree
  out = {}
  for k, v in tree.items():
    if k == "layers" and isinstance(v, dict):
      n = jax.tree.leaves(v)[0].shape[0]
      for i in range(n):
        out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], v)
    else:
      out[k] = unstack_layers(v)
  return out
