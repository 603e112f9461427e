"""Named model shapes: T5X's model gin files and the public checkpoints, as configs only.

Names are `<family>.<size>`: `t5_1_0.small`, `t5_1_1.xl`, `flan_t5.base` (= t5_1_1),
`mt5.large`, `byt5.xxl`, `decoder_only.base`, and `<family>.tiny` for tests. Hugging
Face model names (`t5-small`, `google/flan-t5-base`, ...) are accepted as aliases.

    cfg = t5forge.presets.get("flan_t5.base")              # ModelConfig
    cfg = t5forge.presets.get("t5_1_1.tiny", vocab_size=512)  # with overrides
"""
from __future__ import annotations

import difflib

from t5forge.errors import UserError
from t5forge.nn.config import DECODER_ONLY, ModelConfig

T5_VOCAB = 32128  # 32000 SentencePiece pieces + 100 sentinels, padded to a multiple of 128
MT5_VOCAB = 250112
BYT5_VOCAB = 384  # 3 specials + 256 bytes + 125 extra ids, rounded up

RELU = ("relu",)
GATED_GELU = ("gelu", "linear")

# size: (emb_dim, num_heads, num_encoder_layers, num_decoder_layers, head_dim, mlp_dim)
_T5_1_0 = {
    "tiny": (64, 4, 2, 2, 16, 256),
    "small": (512, 8, 6, 6, 64, 2048),
    "base": (768, 12, 12, 12, 64, 3072),
    "large": (1024, 16, 24, 24, 64, 4096),
    "3B": (1024, 32, 24, 24, 128, 16384),
    "11B": (1024, 128, 24, 24, 128, 65536),
}
_T5_1_1 = {
    "tiny": (64, 4, 2, 2, 16, 128),
    "small": (512, 6, 8, 8, 64, 1024),
    "base": (768, 12, 12, 12, 64, 2048),
    "large": (1024, 16, 24, 24, 64, 2816),
    "xl": (2048, 32, 24, 24, 64, 5120),
    "xxl": (4096, 64, 24, 24, 64, 10240),
}
_BYT5 = {
    "tiny": (64, 4, 3, 1, 16, 128),
    "small": (1472, 6, 12, 4, 64, 3584),
    "base": (1536, 12, 18, 6, 64, 3968),
    "large": (1536, 16, 36, 12, 64, 3840),
    "xl": (2560, 32, 36, 12, 64, 6720),
    "xxl": (4672, 64, 36, 12, 64, 12352),
}
# Decoder-only sizes: T5.1.1 layer shapes, one stack (num_encoder_layers unused).
_DECODER_ONLY = {
    "tiny": (64, 4, 0, 2, 16, 128),
    "small": (512, 8, 0, 8, 64, 2048),
    "base": (768, 12, 0, 12, 64, 2048),
    "large": (1024, 16, 0, 24, 64, 2816),
    "xl": (2048, 32, 0, 24, 64, 5120),
}


def _make(shape, *, vocab_size, mlp_activations, logits_via_embedding, architecture="encoder_decoder"):
  emb, heads, enc, dec, head_dim, mlp = shape
  return ModelConfig(vocab_size=vocab_size, emb_dim=emb, num_heads=heads, head_dim=head_dim,
                     mlp_dim=mlp, num_encoder_layers=enc, num_decoder_layers=dec,
                     mlp_activations=mlp_activations, logits_via_embedding=logits_via_embedding,
                     architecture=architecture)


def _build_table() -> dict[str, ModelConfig]:
  table = {}
  for size, shape in _T5_1_0.items():
    table[f"t5_1_0.{size}"] = _make(shape, vocab_size=T5_VOCAB, mlp_activations=RELU,
                                    logits_via_embedding=True)
  for size, shape in _T5_1_1.items():
    cfg = _make(shape, vocab_size=T5_VOCAB, mlp_activations=GATED_GELU, logits_via_embedding=False)
    table[f"t5_1_1.{size}"] = cfg
    table[f"flan_t5.{size}"] = cfg
    table[f"mt5.{size}"] = cfg.replace(vocab_size=MT5_VOCAB)
  for size, shape in _BYT5.items():
    table[f"byt5.{size}"] = _make(shape, vocab_size=BYT5_VOCAB, mlp_activations=GATED_GELU,
                                  logits_via_embedding=False)
  for size, shape in _DECODER_ONLY.items():
    table[f"decoder_only.{size}"] = _make(shape, vocab_size=T5_VOCAB, mlp_activations=GATED_GELU,
                                          logits_via_embedding=False, architecture=DECODER_ONLY)
  return table


PRESETS: dict[str, ModelConfig] = _build_table()

# Hugging Face names of the public checkpoints -> presets.
_HF_ALIASES = {
    **{f"t5-{s}": f"t5_1_0.{s}" for s in ("small", "base", "large", "3B", "11B")},
    **{f"t5-v1_1-{s}": f"t5_1_1.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    **{f"flan-t5-{s}": f"flan_t5.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    **{f"mt5-{s}": f"mt5.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    **{f"byt5-{s}": f"byt5.{s}" for s in ("small", "base", "large", "xl", "xxl")},
}


def names() -> list[str]:
  """All preset names."""
  return sorted(PRESETS)


def get(name: str, **overrides) -> ModelConfig:
  """The config of a preset, with field overrides (e.g. vocab_size, dropout_rate, dtype).

  Raises:
    UserError: unknown name, listing the close matches and all names.
  """
  key = name.split("/")[-1]  # 'google/flan-t5-base' -> 'flan-t5-base'
  key = _HF_ALIASES.get(key, _HF_ALIASES.get(key.lower(), key))
  if key not in PRESETS:
    close = difflib.get_close_matches(name, list(PRESETS) + list(_HF_ALIASES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"unknown model preset {name!r}.{hint} Known presets: {', '.join(names())}")
  return PRESETS[key].replace(**overrides) if overrides else PRESETS[key]
