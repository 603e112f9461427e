"""Named model shapes: T5X's model gin files and the public checkpoints, as configs only.

Names are `<family>.<size>`: `t5_1_0.small`, `t5_1_1.xl`, `flan_t5.base` (= t5_1_1),
`mt5.large`, `byt5.xxl`, `decoder_only.base`, `t5gemma.2b-2b` (encoder-decoder sizes
as Google names them: s-s, b-b, l-l, ml-ml, xl-xl, 2b-2b, 9b-2b, 9b-9b), and
`<family>.tiny` for tests (`t5gemma.tiny_gqa`: grouped-query attention and an encoder
wider than the decoder; `t5gemma2.tiny`: T5Gemma 2's text network). Hugging Face model
names (`t5-small`, `google/flan-t5-base`, `google/t5gemma-2b-2b-ul2-it`, ...) are
accepted as aliases.

    cfg = t5forge.presets.get("flan_t5.base")              # ModelConfig
    cfg = t5forge.presets.get("t5_1_1.tiny", vocab_size=512)  # with overrides
"""
from __future__ import annotations

import difflib

from t5forge.errors import UserError
from t5forge.nn.config import DECODER_ONLY, T5GEMMA, T5GEMMA2, ModelConfig

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


GEMMA_VOCAB = 256000  # Gemma 2's SentencePiece vocabulary (T5Gemma's HF configs)

# T5Gemma's encoder/decoder stacks (google-deepmind/gemma research/t5gemma/config.py,
# the HF configs): size: (emb_dim, num_heads, num_kv_heads, num_layers, head_dim, mlp_dim).
# The T5 sizes (s ... xl) were pretrained from scratch with Gemma 2 layers; 2b and 9b
# are Gemma 2 2B and 9B.
_GEMMA2_STACKS = {
    "tiny": (64, 4, 4, 2, 16, 128),
    "tiny_gqa": (64, 4, 2, 3, 16, 128),
    "tiny_gqa_encoder": (96, 6, 3, 2, 16, 192),
    "s": (512, 8, 8, 8, 64, 1024),
    "b": (768, 12, 12, 12, 64, 2048),
    "l": (1024, 16, 16, 24, 64, 2816),
    "ml": (1152, 4, 4, 26, 256, 6912),
    "xl": (2048, 32, 32, 24, 64, 5120),
    "2b": (2304, 8, 4, 26, 256, 9216),
    "9b": (3584, 16, 8, 42, 256, 14336),
}
# preset size: (encoder stack, decoder stack)
_T5GEMMA = {
    "tiny": ("tiny", "tiny"),
    "tiny_gqa": ("tiny_gqa_encoder", "tiny_gqa"),
    **{f"{s}-{s}": (s, s) for s in ("s", "b", "l", "ml", "xl", "2b", "9b")},
    "9b-2b": ("9b", "2b"),
}


def _make_t5gemma(encoder: str, decoder: str, *, tiny: bool) -> ModelConfig:
  """A T5Gemma config: Gemma 2's settings (soft-caps 50 / 30, window 4096 alternating
  local/global, queries scaled by head_dim**-0.5, tied decoder embedding, BOS 2).
  Tiny configs keep a T5-sized vocabulary and a window of 8 so that tests see local
  and global layers differ."""
  e_emb, e_heads, e_kv, e_layers, e_hd, e_mlp = _GEMMA2_STACKS[encoder]
  emb, heads, kv, layers, head_dim, mlp = _GEMMA2_STACKS[decoder]
  enc = {}  # the encoder_* fields: only where the encoder differs
  for name, mine, theirs in (("emb_dim", e_emb, emb), ("num_heads", e_heads, heads),
                             ("num_kv_heads", e_kv, kv), ("head_dim", e_hd, head_dim),
                             ("mlp_dim", e_mlp, mlp)):
    if mine != theirs:
      enc[f"encoder_{name}"] = mine
  if e_hd != head_dim:
    raise AssertionError("one query_pre_attn_scalar serves both stacks")
  return ModelConfig(vocab_size=T5_VOCAB if tiny else GEMMA_VOCAB, emb_dim=emb,
                     num_heads=heads, num_kv_heads=kv, head_dim=head_dim, mlp_dim=mlp,
                     num_encoder_layers=e_layers, num_decoder_layers=layers,
                     mlp_activations=GATED_GELU, logits_via_embedding=True, scale_logits=False,
                     architecture=T5GEMMA, query_pre_attn_scalar=head_dim,
                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                     sliding_window=8 if tiny else 4096, max_position_embeddings=8192,
                     decoder_start_token_id=2, **enc)


def _make_t5gemma2_tiny() -> ModelConfig:
  """A tiny T5Gemma 2 (text) for tests: Gemma 3's settings (5 local : 1 global layers,
  RoPE bases 10,000 / 1,000,000, no soft-caps, all embeddings tied, BOS 2) at width 64,
  a window of 8 and a T5-sized vocabulary. The released sizes (270m-270m, 1b-1b,
  4b-4b) are read from their HF directories (t5forge.convert.hf.t5gemma2)."""
  return ModelConfig(vocab_size=T5_VOCAB, emb_dim=64, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_dim=128, num_encoder_layers=6, num_decoder_layers=6,
                     mlp_activations=GATED_GELU, logits_via_embedding=True, scale_logits=False,
                     architecture=T5GEMMA2, query_pre_attn_scalar=16, rope_theta=1e6,
                     rope_local_theta=1e4, sliding_window=8, sliding_window_pattern=6,
                     max_position_embeddings=8192, decoder_start_token_id=2)


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
  for size, (encoder, decoder) in _T5GEMMA.items():
    table[f"t5gemma.{size}"] = _make_t5gemma(encoder, decoder, tiny=size.startswith("tiny"))
  table["t5gemma2.tiny"] = _make_t5gemma2_tiny()
  return table


PRESETS: dict[str, ModelConfig] = _build_table()

# Hugging Face names of the public checkpoints -> presets.
_HF_ALIASES = {
    **{f"t5-{s}": f"t5_1_0.{s}" for s in ("small", "base", "large", "3B", "11B")},
    **{f"t5-v1_1-{s}": f"t5_1_1.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    **{f"flan-t5-{s}": f"flan_t5.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    **{f"mt5-{s}": f"mt5.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    **{f"byt5-{s}": f"byt5.{s}" for s in ("small", "base", "large", "xl", "xxl")},
    # google/t5gemma-<size>-{prefixlm,ul2}[-it]: one shape per size.
    **{f"t5gemma-{s}-{objective}{it}": f"t5gemma.{s}"
       for s in _T5GEMMA if not s.startswith("tiny")
       for objective in ("prefixlm", "ul2") for it in ("", "-it")},
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
