"""Adafactor factor rules: T5X's `_parse_rule` / `_factored_dims`.

With an explicit logical rule (rank > 2, or a BATCH axis) T5X factors whatever the sizes;
rank <= 2 without a BATCH axis falls back to the size heuristic (min_dim_size_to_factor).
"""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5forge.errors import UserError
from t5forge.train import optim

RNG = np.random.default_rng(16)
F = optim.FactorDim


def _t5x_update(p, g, *, lr, step, row_dims=None, col_dims=None, batch_dims=(),
                decay_rate=0.8, eps1=1e-30, eps2=1e-3, clip=1.0):
  """T5X's apply_param_gradient from zero statistics, in float64 numpy.

  row_dims / col_dims: T5X's factored_dims (d1, d0); None for a full second moment.
  """
  avg = tuple(i for i in range(p.ndim) if i not in batch_dims)
  decay = 1.0 - (step + 1.0) ** -decay_rate
  mix = 1.0 - decay
  scale = np.maximum(np.sqrt(np.mean(p * p, axis=avg, keepdims=True)), eps2)
  g2 = g * g + eps1
  if row_dims is not None:
    d1, d0 = row_dims, col_dims
    v_row = mix * g2.mean(axis=d0)
    v_col = mix * g2.mean(axis=d1)
    reduced_d1 = tuple(d - len([e for e in d0 if e < d]) for d in d1)
    row_factor = (v_row / v_row.mean(axis=reduced_d1, keepdims=True)) ** -0.5
    col_factor = v_col ** -0.5
    y = g * np.expand_dims(row_factor, d0) * np.expand_dims(col_factor, d1)
  else:
    y = g * (mix * g2) ** -0.5
  y = y / np.maximum(1.0, np.sqrt(np.mean(y * y, axis=avg, keepdims=True)) / clip)
  return p - lr * scale * y


def _one_step(tx, p, g, step=3):
  params = {"w": jnp.asarray(p)}
  state = optim.set_step(tx.init(params), step)
  upd, new_state = tx.update({"w": jnp.asarray(g)}, state, params)
  return np.asarray(optax.apply_updates(params, upd)["w"]), new_state


def test_stacked_small_kernel_is_factored_by_its_rule():
  """[2, 4, 8] ('layers', 'embed', 'mlp'): BATCH, ROW, COLUMN; 4 and 8 are far below 128."""
  p = RNG.normal(size=(2, 4, 8)).astype(np.float32) * np.array([1.0, 3.0])[:, None, None]
  g = RNG.normal(size=(2, 4, 8)).astype(np.float32)
  tx = optim.adafactor(0.01, param_axes={"w": ("layers", "embed", "mlp")})
  got, st = _one_step(tx, p, g)
  assert st.v_row["w"].shape == (2, 4) and st.v_col["w"].shape == (2, 8)
  assert st.v["w"].shape == (1,)
  want = _t5x_update(p.astype(np.float64), g.astype(np.float64), lr=0.01, step=3,
                     row_dims=(1,), col_dims=(2,), batch_dims=(0,))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  # The unfactored update differs: the factored estimate is really used.
  full = _t5x_update(p.astype(np.float64), g.astype(np.float64), lr=0.01, step=3,
                     batch_dims=(0,))
  assert np.abs(got - full).max() > 1e-4
  # One layer alone, [4, 8] ('embed', 'mlp'): rank 2 without BATCH, so T5X ignores the
  # rule and its size heuristic keeps a full second moment; [128, 256] is factored.
  for axes in (None, {"w": ("embed", "mlp")}):
    st = optim.adafactor(0.01, param_axes=axes).init({"w": jnp.zeros((4, 8))})
    assert st.v["w"].shape == (4, 8) and st.v_row["w"].shape == (1,)
    st = optim.adafactor(0.01, param_axes=axes).init({"w": jnp.zeros((128, 256))})
    assert st.v_row["w"].shape == (128,) and st.v_col["w"].shape == (256,)
    assert st.v["w"].shape == (1,)


def test_rank3_attention_kernel_is_factored_by_its_rule():
  """[4, 2, 8] ('embed', 'heads', 'kv'): ROW, COLUMN, COLUMN without a stacked axis."""
  p = RNG.normal(size=(4, 2, 8)).astype(np.float32)
  g = RNG.normal(size=(4, 2, 8)).astype(np.float32)
  tx = optim.adafactor(0.01, param_axes={"w": ("embed", "heads", "kv")})
  got, st = _one_step(tx, p, g)
  assert st.v_row["w"].shape == (4,) and st.v_col["w"].shape == (2, 8)
  want = _t5x_update(p.astype(np.float64), g.astype(np.float64), lr=0.01, step=3,
                     row_dims=(0,), col_dims=(1, 2))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_state_axes_follow_the_rule_factoring():
  """opt_state shardings come from state_axes: they must agree with init's shapes."""
  params = {"stacked": jnp.zeros((2, 4, 8)), "attn": jnp.zeros((4, 2, 8)), "small": jnp.zeros((4, 8))}
  axes = {"stacked": ("layers", "embed", "mlp"), "attn": ("embed", "heads", "kv"),
          "small": ("embed", "mlp")}
  spec = optim.Adafactor()
  state = spec.build(lambda _: 0.01, axes).init(params)
  sa = spec.state_axes(state, params, axes)
  assert sa.v_row["stacked"] == ("layers", "embed") and sa.v_col["stacked"] == ("layers", "mlp")
  assert sa.v_row["attn"] == ("embed",) and sa.v_col["attn"] == ("heads", "kv")
  assert sa.v["stacked"] == (None,) and sa.v["small"] == ("embed", "mlp")
  for field in ("v_row", "v_col", "v"):
    for k in params:
      assert len(getattr(sa, field)[k]) == getattr(state, field)[k].ndim, (field, k)


def test_explicit_rules_on_the_optimizer_spec():
  """Adafactor(logical_factor_rules=...) reaches both init and state_axes."""
  rules = dict(optim.standard_logical_factor_rules(), mlp=F.NONE)
  spec = optim.Adafactor(logical_factor_rules=rules)
  params, axes = {"w": jnp.zeros((2, 4, 8))}, {"w": ("layers", "embed", "mlp")}
  state = spec.build(lambda _: 0.01, axes).init(params)
  # ROW without COLUMN: unfactored (T5X turns ROW/COLUMN into NONE), statistics per layer.
  assert state.v["w"].shape == (2, 4, 8) and state.v_row["w"].shape == (1,)
  assert spec.state_axes(state, params, axes).v["w"] == ("layers", "embed", "mlp")


def test_incomplete_rule_is_one_clear_error():
  """T5X refuses ROW + COLUMN + NONE in one parameter ('Incomplete adafactor spec')."""
  tx = optim.adafactor(0.01, param_axes={"w": ("embed", "relpos_buckets", "mlp")})
  with pytest.raises(UserError, match=r"relpos_buckets.*ROW, COLUMN and NONE"):
    tx.init({"w": jnp.zeros((4, 2, 8))})
