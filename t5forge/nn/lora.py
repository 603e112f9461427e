"""LoRA (Hu et al. 2021, arXiv 2106.09685): low-rank updates of frozen projection kernels.

A targeted kernel W [in, out] gains two parameters beside it, `lora_a` [in, r] and
`lora_b` [r, out], and its layer computes

    y = x @ W + scale * (dropout(x) @ lora_a) @ lora_b,   scale = alpha / r
                                                           (rsLoRA: alpha / sqrt(r)),

with `lora_b` initialised to zeros, so a fresh adapter leaves the model's outputs
unchanged. The layers (`t5forge.nn.layers.Kernel` / `Dense`) create the parameters and
`t5forge.nn.matmul` multiplies; this module holds the configuration (which kernels, what
rank), the merge W + scale * a @ b, and the list of adapted modules.

Module paths name a kernel's module as the unscanned parameter tree does, '/'-joined,
without the trailing `kernel`: `encoder/layers_0/attention/query`,
`decoder/layers_3/encoder_decoder_attention/value`, `decoder/layers_0/mlp/wo`. Under
`scan_layers` one module serves every layer: its path is matched as layer 0's.

Stacked adapters (`LoraConfig.stacked` = N, what `t5forge serve --adapter` runs): N
adapters on one base, one chosen per row. Every `lora_a` is [N, i, R] and every `lora_b`
[N, R, o] (after the scanned layers axis), each adapter's scale folded into its `lora_b`
and its rank zero-padded to the largest, R; adapter 0 is all zeros, the base itself.
`stack` builds them; `row_adapters(ids)`, entered inside the traced function, gives the
layers each row's adapter. The stacked weights and the ids are ordinary inputs of fixed
shapes, so any mix of adapters in a batch runs one compiled function.

Shape letters (docs/shapes.md): i input features, o output features, r rank, L layers,
N stacked adapters, R their padded rank, b rows.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5forge import sharding as ax
from t5forge.errors import UserError

ATTENTION = ("query", "key", "value", "out")
MLP = ("wi", "wi_0", "wi_1", "wo")
# peft's presets, in our module names: `qv` is peft's default for T5 (`q`, `v` of every
# attention), `all-linear` every projection but the output layer (as peft's).
PRESETS = {
    "qv": ("query", "value"),
    "attention": ATTENTION,
    "mlp": MLP,
    "all-linear": ATTENTION + MLP,
}
RANK_AXIS = ax.LORA_RANK  # the logical axis of the rank dimension
ADAPTERS_AXIS = ax.LORA_ADAPTERS  # the logical axis of stacked adapters
A, B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which kernels get a LoRA update, and its rank and scale.

  Attributes:
    rank: r, the default rank.
    alpha: the scale's numerator (peft's lora_alpha).
    dropout: dropout on the update's input x during training (peft's lora_dropout).
    rslora: scale alpha / sqrt(r) (Kalajdzievski 2023) instead of alpha / r.
    targets: a preset ('qv', 'attention', 'mlp', 'all-linear'); a comma-separated list of
      module names matched as path suffixes ('query,value,wo',
      'encoder_decoder_attention/query'); or 're:<regex>' fullmatched against the path.
    rank_pattern / alpha_pattern: (regex, value) pairs overriding rank / alpha for the
      targeted paths they match as suffixes (peft's semantics; the first match wins).
    stacked: N >= 2: N adapters stacked on a leading axis, chosen per row (`stack`,
      `row_adapters`); their scales are folded in (`scale_for` is 1). 0: one adapter.
  """

  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  rslora: bool = False
  targets: str = "qv"
  rank_pattern: tuple[tuple[str, int], ...] = ()
  alpha_pattern: tuple[tuple[str, float], ...] = ()
  stacked: int = 0

  def __post_init__(self):
    # Gin and JSON hand us lists and dicts; keep the dataclass hashable.
    for name in ("rank_pattern", "alpha_pattern"):
      value = getattr(self, name)
      pairs = value.items() if isinstance(value, dict) else value
      object.__setattr__(self, name, tuple((str(k), v) for k, v in pairs))
    problems = []
    ranks = [self.rank] + [r for _, r in self.rank_pattern]
    if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 1 for r in ranks):
      problems.append(f"rank {self.rank} (rank_pattern {dict(self.rank_pattern)}) must be a "
                      "positive integer, e.g. 8")
    if not 0.0 <= float(self.dropout) < 1.0:
      problems.append(f"dropout must be in [0, 1), got {self.dropout}")
    if isinstance(self.stacked, bool) or not isinstance(self.stacked, (int, np.integer)) or \
        self.stacked < 0 or self.stacked == 1:
      problems.append(f"stacked must be 0 (one adapter) or the number of stacked adapters "
                      f">= 2, got {self.stacked!r}")
    elif self.stacked and float(self.dropout):
      problems.append("stacked adapters are for inference: dropout must be 0")
    targets = str(self.targets)
    if targets.startswith("re:"):
      try:
        re.compile(targets[3:])
      except re.error as e:
        problems.append(f"targets regex {targets[3:]!r} does not compile ({e})")
    elif not self._names():
      problems.append(f"targets {targets!r} is empty; use a preset {sorted(PRESETS)}, module "
                      "names such as 'query,value', or 're:<regex>'")
    for name in ("rank_pattern", "alpha_pattern"):
      for pattern, _ in getattr(self, name):
        try:
          re.compile(pattern)
        except re.error as e:
          problems.append(f"{name} key {pattern!r} does not compile ({e})")
    if problems:
      raise UserError("invalid lora.LoraConfig: " + "; ".join(problems))

  def _names(self) -> tuple[str, ...]:
    if self.targets in PRESETS:
      return PRESETS[self.targets]
    return tuple(n.strip().strip("/") for n in str(self.targets).split(",") if n.strip())

  def is_target(self, path: str) -> bool:
    """Whether the kernel at module path `path` gets an update (see the module doc)."""
    path = canonical(path)
    if path.endswith("/logits_dense") or path == "logits_dense":
      return False
    if self.targets.startswith("re:"):
      return re.fullmatch(self.targets[3:], path) is not None
    return any(path == n or path.endswith("/" + n) for n in self._names())

  def rank_for(self, path: str) -> int:
    """The rank of path's update; 0 when the path is not a target."""
    if not self.is_target(path):
      return 0
    return int(_first_match(self.rank_pattern, canonical(path), self.rank))

  def scale_for(self, path: str) -> float:
    """alpha / r (rsLoRA: alpha / sqrt(r)) at path, after the patterns."""
    rank = self.rank_for(path)
    if self.stacked:
      return 1.0 if rank else 0.0  # folded into each adapter's lora_b by `stack`
    alpha = float(_first_match(self.alpha_pattern, canonical(path), self.alpha))
    return alpha / (math.sqrt(rank) if self.rslora else rank) if rank else 0.0

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["rank_pattern"] = dict(self.rank_pattern)
    d["alpha_pattern"] = dict(self.alpha_pattern)
    return d

  @classmethod
  def from_dict(cls, d: dict, *, source: str = "lora config") -> "LoraConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise UserError(f"{source}: unknown LoRA field(s) {unknown}; known: {sorted(fields)}")
    return cls(**d)


def _first_match(pairs, path: str, default):
  for pattern, value in pairs:
    if re.fullmatch(rf"(.*/)?(?:{pattern})", path):
      return value
  return default


def canonical(path: str | tuple[str, ...]) -> str:
  """A module path as the unscanned tree names it: a scanned stack's `layers` segment
  is read as layer 0's, `layers_0`."""
  parts = path.split("/") if isinstance(path, str) else list(path)
  return "/".join("layers_0" if p == "layers" else p for p in parts if p and p != "params")


def targets(params: Any, prefix: str = "") -> list[str]:
  """The module paths (as stored: scanned ones keep `layers`) that carry lora_a/lora_b."""
  out = []
  if isinstance(params, dict):
    if A in params and B in params:
      out.append(prefix)
    for name, sub in params.items():
      if isinstance(sub, dict):
        out += targets(sub, f"{prefix}/{name}" if prefix else name)
  return out


def kernel_paths(params: Any, prefix: str = "") -> list[str]:
  """The module paths of every projection kernel in a (possibly abstract) tree."""
  out = []
  if isinstance(params, dict):
    if "kernel" in params:
      out.append(prefix)
    for name, sub in params.items():
      if isinstance(sub, dict):
        out += kernel_paths(sub, f"{prefix}/{name}" if prefix else name)
  return out


def check_targets(config: LoraConfig, params: Any) -> None:
  """Refuses a LoRA config that adapts nothing in `params` (the model's, with the update
  parameters), naming a few paths that exist."""
  if targets(params):
    return
  paths = [canonical(p) for p in kernel_paths(params)]
  raise UserError(f"lora.LoraConfig.targets {config.targets!r} matches no projection of this "
                  f"model; its kernels are e.g. {', '.join(paths[:4])} (a preset {sorted(PRESETS)}, "
                  "module names such as 'query,value', or 're:<regex>' over such paths)")


def merge(params: dict, config: LoraConfig) -> dict:
  """params with every update folded in: kernel + scale * lora_a @ lora_b in float32, the
  adapter leaves removed (scanned [L, i, o] kernels too). Returns a new tree of numpy
  arrays for the merged kernels; other leaves are passed through."""

  def walk(tree, path):
    if not isinstance(tree, dict):
      return tree
    out = {k: walk(v, f"{path}/{k}" if path else k) for k, v in tree.items()
           if k not in (A, B)}
    if A in tree and B in tree:
      if "kernel" not in tree:
        raise UserError(f"LoRA parameters at {path} have no kernel beside them")
      a = np.asarray(tree[A], np.float32)
      b = np.asarray(tree[B], np.float32)
      w = np.asarray(tree["kernel"], np.float32)
      delta = np.einsum("...ir,...ro->...io", a, b)
      out["kernel"] = (w + np.float32(config.scale_for(path)) * delta).astype(np.float32)
    return out

  return walk(params, "")



# -- stacked adapters: several adapters on one base, one chosen per row -----------------------
_ROWS: contextvars.ContextVar = contextvars.ContextVar("t5forge_lora_rows", default=None)


@contextlib.contextmanager
def row_adapters(ids):
  """While tracing, inside a jitted function: the layers of a model of stacked adapters
  take adapter ids[r] for row r of their inputs (0: the base).

  Args:
    ids: [b] int32 (traced), or None: no choice (a model without stacked adapters, which
      never reads it). Beams and samples are b * n rows, the n copies of a row adjacent
      (as `t5forge.decoding` lays them out): each id is repeated n times.
  """
  token = _ROWS.set(ids)
  try:
    yield
  finally:
    _ROWS.reset(token)


def row_ids(rows: int) -> jax.Array:
  """The adapter of each of `rows` rows [rows] int32, from the enclosing `row_adapters`;
  outside one (initialising, shape probes) every row takes adapter 0, the base."""
  ids = _ROWS.get()
  if ids is None:
    return jnp.zeros((rows,), jnp.int32)
  n = ids.shape[0]
  if rows == n:
    return ids
  if rows % n:
    raise ValueError(f"{rows} rows for {n} adapter ids: not a multiple of them")
  return jnp.repeat(ids, rows // n)


def stacked_count(config) -> int:
  """N, the stacked adapters (the base included) of a ModelConfig; 0: none stacked."""
  lc = getattr(config, "lora", None)
  return int(lc.stacked) if lc is not None else 0


def _node(tree: dict, path: str) -> dict:
  for part in path.split("/"):
    tree = tree[part]
  return tree


def stack(items: list[tuple[LoraConfig, dict]]) -> tuple[LoraConfig, dict]:
  """N - 1 adapters of one base as one model of N stacked adapters.

  Args:
    items: (LoraConfig, adapter params) per adapter, each an unscanned nested dict with
      `lora_a` [i, r] / `lora_b` [r, o] leaves (`adapters.load`'s layout); the adapters may
      differ in targets, ranks and scales.

  Returns:
    (the stacked LoraConfig: the union of the targets, rank R = the largest, `stacked`
    N = len(items) + 1; the stacked params: at every targeted path `lora_a` [N, i, R] and
    `lora_b` [N, R, o] float32 with adapter k = items[k - 1] (its lora_b times its scale,
    zeros where it has no update or past its rank) and adapter 0 zeros).
  """
  if not items:
    raise UserError("lora.stack needs at least one adapter")
  shapes: dict[str, tuple[int, int]] = {}
  for config, tree in items:
    for path in targets(tree):
      node = _node(tree, path)
      shapes.setdefault(path, (node[A].shape[0], node[B].shape[1]))
      if shapes[path] != (node[A].shape[0], node[B].shape[1]):
        raise UserError(f"the adapters' updates at {path} have different shapes "
                        f"{shapes[path]} and {(node[A].shape[0], node[B].shape[1])}: they "
                        "are not of one base")
  if not shapes:
    raise UserError("the adapters hold no LoRA parameters (lora_a / lora_b) to stack")
  rank = max(_node(tree, p)[A].shape[1] for _, tree in items for p in targets(tree))
  n = len(items) + 1
  out: dict = {}
  for path, (i, o) in sorted(shapes.items()):
    a = np.zeros((n, i, rank), np.float32)
    b = np.zeros((n, rank, o), np.float32)
    for k, (config, tree) in enumerate(items, start=1):
      try:
        node = _node(tree, path)
      except KeyError:
        continue  # this adapter leaves the module as the base has it
      r = node[A].shape[1]
      a[k, :, :r] = np.asarray(node[A], np.float32)
      b[k, :r, :] = np.asarray(node[B], np.float32) * np.float32(config.scale_for(path))
    parent = out
    for part in path.split("/"):
      parent = parent.setdefault(part, {})
    parent.update({A: a, B: b})
  union = "|".join(re.escape(canonical(p)) for p in sorted(shapes))
  return LoraConfig(rank=rank, alpha=float(rank), targets=f"re:(?:{union})", stacked=n), out
