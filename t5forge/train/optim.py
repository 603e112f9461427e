"""Optimizers as optax transformations: Adafactor with T5X's semantics, AdamW, and
T5X's learning-rate schedules built from string factors.

An optimizer here is an `optax.GradientTransformation` whose `update` returns the full
parameter delta (learning rate applied), so `optax.apply_updates(params, updates)` is
the new parameter tree. Any optax transformation can be used in its place.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5forge import sharding as ax
from t5forge.sharding import is_axes
from t5forge.errors import UserError

Schedule = Callable[[jax.Array], jax.Array]


# ---------------------------------------------------------------------------------------
# Learning-rate schedules.

_FACTORS = ("constant", "linear_warmup", "linear_decay", "rsqrt_decay", "rsqrt_normalized_decay",
            "decay_every", "cosine_decay")


def create_learning_rate_scheduler(factors: str = "constant * linear_warmup * rsqrt_decay",
                                   base_learning_rate: float = 0.5, warmup_steps: int = 1000,
                                   decay_factor: float = 0.5, steps_per_decay: int = 20000,
                                   steps_per_cycle: int = 100000, step_offset: int = 0,
                                   min_learning_rate: float = 1e-8) -> Schedule:
  """T5X's `utils.create_learning_rate_scheduler`: the product of named factors.

  Factors: constant (base_learning_rate), linear_warmup (min(1, step / warmup)),
  rsqrt_decay (1 / sqrt(max(step, warmup))), rsqrt_normalized_decay (the same times
  sqrt(warmup)), decay_every (decay_factor ** (step // steps_per_decay)), cosine_decay
  (half-cosine over steps_per_cycle after warmup, restarting), linear_decay (T5X's:
  base * min(step / warmup, 1 + decay_factor * (warmup - step))). Steps count from
  step_offset; the result is at least min_learning_rate.
  """
  names = [n.strip() for n in factors.split("*")]
  unknown = [n for n in names if n not in _FACTORS]
  if unknown:
    raise UserError(f"learning-rate factor(s) {unknown} unknown; use any product of {_FACTORS}")

  def schedule(step):
    step = jnp.maximum(0, jnp.asarray(step, jnp.float32) - step_offset)
    ret = jnp.asarray(1.0, jnp.float32)
    for name in names:
      if name == "constant":
        ret *= base_learning_rate
      elif name == "linear_warmup":
        ret *= jnp.minimum(1.0, step / warmup_steps)
      elif name == "linear_decay":
        ret *= base_learning_rate * jnp.minimum(step / warmup_steps,
                                                1.0 + decay_factor * (warmup_steps - step))
      elif name == "rsqrt_decay":
        ret /= jnp.sqrt(jnp.maximum(step, warmup_steps))
      elif name == "rsqrt_normalized_decay":
        ret *= np.sqrt(warmup_steps)
        ret /= jnp.sqrt(jnp.maximum(step, warmup_steps))
      elif name == "decay_every":
        ret *= decay_factor ** (step // steps_per_decay)
      elif name == "cosine_decay":
        progress = jnp.maximum(0.0, (step - warmup_steps) / float(steps_per_cycle))
        ret *= jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * (progress % 1.0))))
    return jnp.maximum(ret, min_learning_rate).astype(jnp.float32)

  return schedule


# ---------------------------------------------------------------------------------------
# Adafactor.

class FactorDim(enum.Enum):
  NONE = "none"  # not factored
  ROW = "row"
  COLUMN = "column"
  BATCH = "batch"  # a stacked axis (scanned layers): statistics are kept per slice


def standard_logical_factor_rules() -> dict[str, FactorDim]:
  """T5X's `adafactor.standard_logical_factor_rules`."""
  return {ax.VOCAB: FactorDim.COLUMN, ax.EMBED: FactorDim.ROW, ax.MLP: FactorDim.COLUMN,
          ax.HEADS: FactorDim.COLUMN, ax.KV: FactorDim.COLUMN, ax.JOINED_KV: FactorDim.COLUMN,
          ax.KV_HEADS: FactorDim.COLUMN, ax.RELPOS_BUCKETS: FactorDim.NONE, ax.LAYERS: FactorDim.BATCH,
          # LoRA's rank is small: its updates keep full (unfactored) statistics.
          ax.LORA_RANK: FactorDim.NONE,
          # A tuned prompt [p, e] is not factored (the prompt-tuning repo's factor rules).
          ax.PROMPT: FactorDim.NONE}


class _Plan(NamedTuple):
  """How one parameter is treated: averaging axes for its RMS, and factored axes."""

  averaging_dims: tuple[int, ...]
  row_dims: tuple[int, ...] | None  # dims kept in v_row's complement, i.e. reduced for v_col
  col_dims: tuple[int, ...] | None  # dims reduced for v_row


def _plan(shape: tuple[int, ...], axes: tuple[str, ...] | None, *, factored: bool,
          min_dim_size_to_factor: int, rules: dict[str, FactorDim] | None) -> _Plan:
  """T5X's factorisation choice for one parameter.

  As T5X's `Adafactor._parse_rule` / `_factored_dims`:

  * rank <= 2 without a BATCH (stacked) axis: the size heuristic, whatever the rule
    says: factor the two largest dims if the smaller is at least
    min_dim_size_to_factor (a [4, 8] kernel is not factored, a [128, 256] one is).
  * otherwise the logical rule decides, whatever the sizes: ROW dims are averaged
    out of v_col, COLUMN dims out of v_row, BATCH dims keep their own statistics,
    RMS scale and clipping (scanned layers). A [2, 4, 8] ("layers", "embed", "mlp")
    kernel is factored: v_row [2, 4], v_col [2, 8]. A rule without both a ROW and a
    COLUMN dim leaves the parameter unfactored; ROW and COLUMN next to a NONE dim is
    refused (T5X: "Incomplete adafactor spec").

  So a scanned model whose dims are below min_dim_size_to_factor keeps factored
  statistics where its unscanned twin keeps full ones, as in T5X.
  """
  ndim = len(shape)
  all_dims = tuple(range(ndim))
  if not factored:
    return _Plan(all_dims, None, None)
  rule = None
  if rules is not None and axes is not None:
    unknown = [a for a in axes if a not in rules]
    if unknown:
      raise UserError(f"Adafactor factor rules have no entry for logical axis {unknown[0]!r}")
    rule = tuple(rules[a] for a in axes)
    kinds = set(rule)
    if {FactorDim.ROW, FactorDim.COLUMN, FactorDim.NONE} <= kinds:
      raise UserError(f"Adafactor factor rules give logical axes {axes} ROW, COLUMN and NONE "
                      f"dims (an incomplete factorisation); map the NONE axes to ROW, COLUMN "
                      f"or BATCH")
  batched = tuple(i for i, r in enumerate(rule or ()) if r is FactorDim.BATCH)
  if ndim <= 2 and not batched:
    if ndim < 2:
      return _Plan(all_dims, None, None)
    order = np.argsort(shape, kind="stable")
    if shape[order[-2]] < min_dim_size_to_factor:
      return _Plan(all_dims, None, None)
    return _Plan(all_dims, (int(order[-2]),), (int(order[-1]),))
  averaging = tuple(i for i in all_dims if i not in batched)
  if rule is None:
    raise UserError(f"a parameter of rank {ndim} needs logical axes for Adafactor factoring")
  rows = tuple(i for i, r in enumerate(rule) if r is FactorDim.ROW)
  cols = tuple(i for i, r in enumerate(rule) if r is FactorDim.COLUMN)
  if not rows or not cols:
    return _Plan(averaging, None, None)
  # An explicit rule factors whatever the sizes (T5X applies min_dim_size_to_factor only
  # in its heuristic).
  return _Plan(averaging, rows, cols)


class AdafactorState(NamedTuple):
  """Per-parameter trees (same structure as the params) plus a step count.

  v_row / v_col hold the factored second moments (shape (1,) when unused), v the full
  one (shape (1,) when factored), m the momentum (shape (1,) without beta1), as T5X.
  """

  count: jax.Array
  v_row: Any
  v_col: Any
  v: Any
  m: Any


def adafactor(learning_rate: float | Schedule, *, param_axes: Any = None, factored: bool = True,
              multiply_by_parameter_scale: bool = True, beta1: float | None = None,
              decay_rate: float = 0.8, step_offset: int = 0,
              clipping_threshold: float | None = 1.0, weight_decay_rate: float | None = None,
              min_dim_size_to_factor: int = 128, epsilon1: float = 1e-30,
              epsilon2: float = 1e-3, max_parameter_scale: float | None = None,
              logical_factor_rules: dict[str, FactorDim] | None = None,
              global_norm_clip_threshold: float | None = None) -> optax.GradientTransformation:
  """Adafactor with T5X's semantics (t5x/adafactor.py), as an optax transformation.

  Second-moment decay 1 - (step - step_offset + 1) ** -decay_rate; updates clipped to
  RMS clipping_threshold; scaled by the parameter RMS (at least epsilon2) when
  multiply_by_parameter_scale; optional momentum beta1 and decoupled weight decay.

  Args:
    learning_rate: a float or a schedule step -> lr.
    param_axes: tree of logical axis tuples (or PartitionSpecs) like the params; needed
      for scanned (stacked) parameters. With it, factoring follows
      `logical_factor_rules` (default: T5X's standard rules).
  """
  rules = logical_factor_rules or standard_logical_factor_rules()
  lr_fn = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def plans(params):
    axes_tree = param_axes if param_axes is not None else jax.tree.map(lambda _: None, params)
    return jax.tree.map(
        lambda p, a: _plan(tuple(p.shape), None if a is None else tuple(a), factored=factored,
                           min_dim_size_to_factor=min_dim_size_to_factor, rules=rules),
        params, axes_tree, is_leaf=lambda x: x is None or isinstance(x, tuple))

  def init(params):
    ps = plans(params)
    one = lambda: jnp.zeros((1,), jnp.float32)
    is_plan = lambda x: isinstance(x, _Plan)

    def v_row(p, pl):
      return one() if pl.row_dims is None else jnp.zeros(np.delete(p.shape, pl.col_dims), jnp.float32)

    def v_col(p, pl):
      return one() if pl.row_dims is None else jnp.zeros(np.delete(p.shape, pl.row_dims), jnp.float32)

    def v(p, pl):
      return jnp.zeros(p.shape, jnp.float32) if pl.row_dims is None else one()

    m = lambda p: jnp.zeros(p.shape, jnp.float32) if beta1 is not None else one()
    return AdafactorState(
        count=jnp.zeros((), jnp.int32),
        v_row=jax.tree.map(v_row, params, ps, is_leaf=is_plan),
        v_col=jax.tree.map(v_col, params, ps, is_leaf=is_plan),
        v=jax.tree.map(v, params, ps, is_leaf=is_plan),
        m=jax.tree.map(m, params))

  def update(grads, state, params):
    if params is None:
      raise ValueError("adafactor needs params in update()")
    step = state.count
    lr = lr_fn(step)
    t = (step - step_offset).astype(jnp.float32) + 1.0
    decay = 1.0 - t ** (-decay_rate)
    mixing = 1.0 - decay
    if global_norm_clip_threshold:
      norm = optax.tree.norm(grads)
      scale = global_norm_clip_threshold * jnp.minimum(1.0 / global_norm_clip_threshold, 1.0 / norm)
      grads = jax.tree.map(lambda g: g * scale, grads)

    def one_param(p, g, pl, vr, vc, v, m):
      g = g.astype(jnp.float32)
      p32 = p.astype(jnp.float32)
      update_scale = lr
      if multiply_by_parameter_scale:
        scale = jnp.sqrt(jnp.mean(p32 * p32, axis=pl.averaging_dims, keepdims=True))
        scale = jnp.maximum(scale, epsilon2)
        if max_parameter_scale is not None:
          scale = jnp.minimum(scale, max_parameter_scale)
        update_scale = update_scale * scale
      g2 = g * g + epsilon1
      if pl.row_dims is not None:
        d1, d0 = pl.row_dims, pl.col_dims
        vr = decay * vr + mixing * jnp.mean(g2, axis=d0)
        vc = decay * vc + mixing * jnp.mean(g2, axis=d1)
        reduced_d1 = tuple(d - len([e for e in d0 if e < d]) for d in d1)
        row_col_mean = jnp.mean(vr, axis=reduced_d1, keepdims=True)
        row_factor = (vr / row_col_mean) ** -0.5
        col_factor = vc ** -0.5
        y = g * jnp.expand_dims(row_factor, d0) * jnp.expand_dims(col_factor, d1)
      else:
        v = decay * v + mixing * g2
        y = g * v ** -0.5
      if clipping_threshold is not None:
        denom = jnp.maximum(1.0, jnp.sqrt(jnp.mean(y * y, axis=pl.averaging_dims,
                                                   keepdims=True)) / clipping_threshold)
        y = y / denom
      subtrahend = update_scale * y
      if beta1 is not None:
        m = beta1 * m + (1.0 - beta1) * subtrahend
        subtrahend = m
      new_p = p32 - subtrahend
      if weight_decay_rate is not None:
        new_p = new_p - weight_decay_rate * p32
      return (new_p - p32).astype(p.dtype), vr, vc, v, m

    ps = plans(params)
    is_plan = lambda x: isinstance(x, _Plan)
    out = jax.tree.map(one_param, params, grads, ps, state.v_row, state.v_col, state.v, state.m,
                       is_leaf=lambda x: is_plan(x))
    is_out = lambda x: isinstance(x, tuple) and len(x) == 5 and not is_plan(x)
    pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=is_out)
    return pick(0), AdafactorState(step + 1, pick(1), pick(2), pick(3), pick(4))

  return optax.GradientTransformation(init, update)


def _by_path(tree: Any, is_leaf=None) -> dict[tuple, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return {tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path): leaf
          for path, leaf in flat}


def seed_second_moments(state: Any, state_axes: Any, param_axes: Any,
                        moments: dict[tuple, dict]) -> tuple[Any, int, list[str]]:
  """The Adafactor `state` with second moments another Adafactor kept (a Mesh TF
  checkpoint's slots: `convert.mtf.read_slots`), for each parameter this one factors the
  same way: both unfactored (`v`, the parameter's shape), or both factored with
  statistics keeping the same dims (`v_row` / `v_col`, matched through their logical
  axes in `state_axes`, so square matrices match too).

  Args:
    state: an `AdafactorState` (anything else: nothing is seeded).
    state_axes: its logical axes (`adafactor_state_axes`).
    param_axes: the parameters' logical axes.
    moments: {parameter path: {"v": array} or {"kept": {param dim: array}}}.

  Returns:
    (state, number of parameters seeded, '/'-joined paths of those left fresh).
  """
  if not isinstance(state, AdafactorState):
    return state, 0, sorted("/".join(p) for p in moments)
  trees = {f: _by_path(getattr(state, f)) for f in ("v_row", "v_col", "v")}
  ax_row, ax_col = (_by_path(getattr(state_axes, f), is_leaf=is_axes) for f in ("v_row", "v_col"))
  pax = _by_path(param_axes, is_leaf=is_axes)
  new: dict[str, dict] = {f: {} for f in trees}
  seeded, fresh = 0, []

  def fits(field, path, value):
    return tuple(trees[field][path].shape) == tuple(value.shape)

  for path, m in sorted(moments.items()):
    unfactored = path in ax_row and tuple(ax_row[path]) == (None,)
    if path not in trees["v"]:
      fresh.append("/".join(path))
    elif "v" in m and unfactored and fits("v", path, m["v"]):
      new["v"][path] = m["v"]
      seeded += 1
    elif "kept" in m and not unfactored:
      axes = tuple(pax[path])
      row = [i for i, a in enumerate(axes) if a in tuple(ax_row[path])]
      col = [i for i, a in enumerate(axes) if a in tuple(ax_col[path])]
      if (len(row) == len(col) == 1 and row != col and row[0] in m["kept"]
          and col[0] in m["kept"] and fits("v_row", path, m["kept"][row[0]])
          and fits("v_col", path, m["kept"][col[0]])):
        new["v_row"][path], new["v_col"][path] = m["kept"][row[0]], m["kept"][col[0]]
        seeded += 1
      else:
        fresh.append("/".join(path))
    else:
      fresh.append("/".join(path))

  def rebuilt(field):
    values = new[field]
    return jax.tree_util.tree_map_with_path(
        lambda p, leaf: values.get(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p),
                                   leaf), getattr(state, field))

  return state._replace(v_row=rebuilt("v_row"), v_col=rebuilt("v_col"), v=rebuilt("v")), \
      seeded, fresh


def adafactor_state_axes(state: AdafactorState, params: Any, param_axes: Any, *,
                         factored: bool = True, min_dim_size_to_factor: int = 128,
                         logical_factor_rules: dict[str, FactorDim] | None = None):
  """Logical axes of every Adafactor leaf, so the partitioner can shard them.

  v and m share their parameter's axes; v_row drops the column dims and v_col the row
  dims (T5X replicates both; sharding them by the remaining axes saves memory on large
  embeddings); unused (1,) placeholders and the count are replicated.
  """
  rules = logical_factor_rules or standard_logical_factor_rules()
  is_axes = lambda x: isinstance(x, tuple)
  axes = jax.tree.map(lambda a: tuple(a), param_axes, is_leaf=lambda x: isinstance(
      x, (tuple, jax.sharding.PartitionSpec)))

  def plan(p, a):
    return _plan(tuple(p.shape), a, factored=factored,
                 min_dim_size_to_factor=min_dim_size_to_factor, rules=rules)

  plans = jax.tree.map(plan, params, axes, is_leaf=is_axes)
  is_plan = lambda x: isinstance(x, _Plan)
  none = (None,)

  def drop(a, pl, dims):
    return none if pl.row_dims is None else tuple(x for i, x in enumerate(a) if i not in dims)

  v_row = jax.tree.map(lambda a, pl: drop(a, pl, pl.col_dims or ()), axes, plans, is_leaf=is_axes)
  v_col = jax.tree.map(lambda a, pl: drop(a, pl, pl.row_dims or ()), axes, plans, is_leaf=is_axes)
  v = jax.tree.map(lambda a, pl: a if pl.row_dims is None else none, axes, plans, is_leaf=is_axes)
  m = jax.tree.map(lambda a, leaf: a if leaf.shape != (1,) else none, axes, state.m,
                   is_leaf=is_axes)
  del is_plan
  return AdafactorState(count=(), v_row=v_row, v_col=v_col, v=v, m=m)


def set_step(opt_state: Any, step: int | jax.Array) -> Any:
  """Sets every step counter (`count` fields of optax states) to `step`.

  Used when training starts from a checkpoint that records a step (T5X counts
  TRAIN_STEPS from step 0, so fine-tuning a 1M-step checkpoint continues at 1M).
  """
  def fix(node):
    if hasattr(node, "_fields") and "count" in node._fields:
      return node._replace(count=jnp.asarray(step, jnp.asarray(node.count).dtype))
    return node
  return jax.tree.map(fix, opt_state, is_leaf=lambda x: hasattr(x, "_fields") and "count" in x._fields)


def adamw(learning_rate: float | Schedule, *, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.0,
          global_norm_clip_threshold: float | None = None) -> optax.GradientTransformation:
  """optax AdamW, with optional gradient clipping by global norm first."""
  tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  if global_norm_clip_threshold:
    tx = optax.chain(optax.clip_by_global_norm(global_norm_clip_threshold), tx)
  return tx


# ---------------------------------------------------------------------------------------
# Optimizer specs: what a model gin binds (OPTIMIZER = @optim.Adafactor()), built into an
# optax transformation once the learning-rate schedule and parameter axes are known.

@dataclasses.dataclass(frozen=True)
class Adafactor:
  """Adafactor settings (T5X's defaults); `build` makes the optax transformation."""

  decay_rate: float = 0.8
  step_offset: int = 0
  beta1: float | None = None
  clipping_threshold: float | None = 1.0
  multiply_by_parameter_scale: bool = True
  weight_decay_rate: float | None = None
  min_dim_size_to_factor: int = 128
  epsilon1: float = 1e-30
  epsilon2: float = 1e-3
  factored: bool = True
  max_parameter_scale: float | None = None
  global_norm_clip_threshold: float | None = None
  # {logical axis: FactorDim} (None: T5X's standard_logical_factor_rules()).
  logical_factor_rules: dict[str, FactorDim] | None = None

  def build(self, learning_rate_fn: Schedule, param_axes: Any) -> optax.GradientTransformation:
    return adafactor(learning_rate_fn, param_axes=param_axes, **dataclasses.asdict(self))

  def state_axes(self, opt_state: Any, params: Any, param_axes: Any) -> Any:
    return adafactor_state_axes(opt_state, params, param_axes, factored=self.factored,
                                min_dim_size_to_factor=self.min_dim_size_to_factor,
                                logical_factor_rules=self.logical_factor_rules)


@dataclasses.dataclass(frozen=True)
class AdamW:
  """optax AdamW settings."""

  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  global_norm_clip_threshold: float | None = None

  def build(self, learning_rate_fn: Schedule, param_axes: Any) -> optax.GradientTransformation:
    del param_axes
    return adamw(learning_rate_fn, **dataclasses.asdict(self))

  def state_axes(self, opt_state: Any, params: Any, param_axes: Any) -> Any:
    return generic_state_axes(self, opt_state, params, param_axes)


@dataclasses.dataclass(frozen=True)
class Optax:
  """Any optax transformation: `factory(learning_rate=schedule, **kwargs)`.

  In gin: `OPTIMIZER = @optim.Optax()`, `optim.Optax.factory = @optax.lion` (a reference,
  not a call), `optim.Optax.kwargs = {'b1': 0.95}`.
  """

  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict | None = None

  def build(self, learning_rate_fn: Schedule, param_axes: Any) -> optax.GradientTransformation:
    del param_axes
    return self.factory(learning_rate=learning_rate_fn, **(self.kwargs or {}))

  def state_axes(self, opt_state: Any, params: Any, param_axes: Any) -> Any:
    return generic_state_axes(self, opt_state, params, param_axes)


def generic_state_axes(spec, opt_state: Any, params: Any, param_axes: Any) -> Any:
  """Axes for any optax state: leaves in a parameter's place (found by optax's
  tree_map_params) take its axes when the ranks agree; everything else is replicated."""
  del params
  tx = spec.build(lambda _: 0.0, param_axes)
  axes = jax.tree.map(tuple, param_axes,
                      is_leaf=lambda x: isinstance(x, (tuple, jax.sharding.PartitionSpec)))
  return optax.tree_utils.tree_map_params(
      tx, lambda leaf, a: a if len(a) == len(getattr(leaf, "shape", ())) else (),
      opt_state, axes, transform_non_params=lambda leaf: (None,) * len(getattr(leaf, "shape", ())),
      is_leaf=is_axes)
