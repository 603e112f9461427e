"""The T5Gemma benchmark measures the released shape: bench/shapes.py's T5Gemma shapes,
as transformers configs read by t5forge's converter, equal the presets they name
(bench/ours.py checks the same in every run), and a differing field is named.

The case itself runs end to end with `python -m bench t5gemma --quick` (~90 s, AMD EPYC
2 cores), too slow for the suite."""
from __future__ import annotations

import json

import pytest

from bench import ours, shapes
from t5forge.convert.hf import t5gemma as hf_t5gemma


def _config_read_by_t5forge(shape: shapes.T5GemmaShape):
  from bench import hf_torch
  hf = json.loads(hf_torch.t5gemma_config(shape.hf_config()).to_json_string())
  return hf_t5gemma.config_from_hf(hf, source=f"{shape.name}/config.json")


@pytest.mark.parametrize("size", sorted(shapes.T5GEMMA_SHAPES))
def test_bench_t5gemma_shape_is_its_preset(size):
  shape = shapes.T5GEMMA_SHAPES[size]
  config = _config_read_by_t5forge(shape)
  ours.check_preset(config, shape.preset)  # raises on any differing field
  assert config.vocab_size == shape.vocab_size
  if size == "s-s":  # the released S-S: Gemma 2's vocabulary, window 4096, soft-caps 50 / 30
    assert (config.vocab_size, config.emb_dim, config.num_decoder_layers) == (256000, 512, 8)
    assert (config.sliding_window, config.attn_logit_softcapping,
            config.final_logit_softcapping) == (4096, 50.0, 30.0)


def test_check_preset_names_the_differing_field():
  shape = shapes.T5GEMMA_SHAPES["s-s"]
  config = _config_read_by_t5forge(shape).replace(sliding_window=512)
  with pytest.raises(AssertionError, match=r"sliding_window=512 \(preset 4096\)"):
    ours.check_preset(config, shape.preset)
