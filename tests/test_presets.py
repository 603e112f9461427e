"""Every preset's parameter tree via jax.eval_shape (no memory), counted against the
parameter count transformers gives for the same config (built on the meta device)."""
import jax
import pytest

from t5forge import presets
from t5forge.convert.hf import hf_config_from
from t5forge.errors import UserError
from t5forge.nn import abstract_params, count_params, logical_axes
from t5forge.sharding import PARAM_AXES

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

# T5 encoder-decoders; T5Gemma's counts are checked in tests/test_t5gemma_nn.py, T5Gemma
# 2's in tests/test_t5gemma2_parity.py.
ENC_DEC = [n for n in presets.names()
           if n.split(".")[0] not in ("decoder_only", "t5gemma", "t5gemma2")]


def _hf_count(cfg) -> int:
  import torch
  import transformers
  fields = hf_config_from(cfg)
  fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type",
                                                          "scale_decoder_outputs")}
  with torch.device("meta"):
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields))
  n = sum(p.numel() for p in model.parameters())  # shared weights counted once
  # transformers 5 always ties a freshly built T5; an untied checkpoint adds lm_head.
  if not cfg.logits_via_embedding:
    n += cfg.vocab_size * cfg.emb_dim
  return n


@pytest.mark.parametrize("name", ENC_DEC)
def test_parameter_count_equals_transformers(name):
  cfg = presets.get(name)
  assert count_params(abstract_params(cfg)) == _hf_count(cfg)


def test_known_public_counts():
  assert count_params(abstract_params(presets.get("t5-small"))) == 60_506_624
  assert count_params(abstract_params(presets.get("google/flan-t5-base"))) == 247_577_856
  xxl = count_params(abstract_params(presets.get("t5_1_1.xxl")))
  assert 11.0e9 < xxl < 11.2e9


@pytest.mark.parametrize("name", presets.names())
def test_every_parameter_has_known_logical_axes(name):
  cfg = presets.get(name)
  shapes = abstract_params(cfg)
  axes = logical_axes(cfg)
  for shape, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(
      axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
    assert len(spec) == len(shape.shape)
    assert all(a in PARAM_AXES for a in spec), spec


def test_scanned_presets_stack_layers_on_a_named_axis():
  cfg = presets.get("t5_1_1.xxl", scan_layers=True)
  shapes = abstract_params(cfg)
  q = shapes["encoder"]["layers"]["attention"]["query"]["kernel"]
  assert q.shape == (24, 4096, 4096)
  assert tuple(logical_axes(cfg)["encoder"]["layers"]["attention"]["query"]["kernel"]) == (
      "layers", "embed", "joined_kv")
  assert count_params(shapes) == count_params(abstract_params(presets.get("t5_1_1.xxl")))


def test_decoder_only_presets():
  shapes = abstract_params(presets.get("decoder_only.base"))
  assert set(shapes) == {"decoder"}
  assert "token_embedder" in shapes["decoder"] and "layers_11" in shapes["decoder"]


def test_unknown_preset_lists_the_names():
  with pytest.raises(UserError) as e:
    presets.get("t5_1_1.bsae")
  msg = str(e.value)
  assert "t5_1_1.base" in msg and "byt5.xxl" in msg and "\n" not in msg
