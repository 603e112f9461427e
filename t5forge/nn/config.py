"""The one config a network needs: a frozen dataclass with T5X's field names.

Field names follow T5X's `network.T5Config` (`emb_dim`, `mlp_dim`, `head_dim`, ...) so
that a T5X model gin ports by renaming the class only. Only the top-level networks read
this config; layers take the few hyper-parameters they need.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from t5forge.errors import UserError

ENCODER_DECODER = "encoder_decoder"
DECODER_ONLY = "decoder_only"
ARCHITECTURES = (ENCODER_DECODER, DECODER_ONLY)
REMAT_POLICIES = ("none", "minimal", "full")
ACTIVATIONS = ("relu", "gelu", "gelu_exact", "silu", "linear")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and behaviour of a T5-family network.

  Attributes:
    vocab_size: rows of the token embedding (including sentinels and padding).
    emb_dim: model width (HF `d_model`).
    num_heads: attention heads.
    head_dim: width of one head (HF `d_kv`); heads * head_dim need not equal emb_dim.
    mlp_dim: hidden width of the feed-forward block (HF `d_ff`).
    num_encoder_layers: encoder depth (0 for decoder-only).
    num_decoder_layers: decoder depth.
    mlp_activations: ('relu',) for T5 1.0; ('gelu', 'linear') for a gated-GELU MLP
      (T5.1.1, Flan-T5, mT5, ByT5). Several activations mean a gated MLP whose
      branches are multiplied elementwise.
    logits_via_embedding: output layer tied to the token embedding (T5 1.0).
    scale_logits: multiply the decoder output by emb_dim**-0.5 before the output layer;
      None means "as logits_via_embedding" (T5X and HF 4.x behaviour).
    dropout_rate: dropout on embeddings, residual branches, attention weights and the
      MLP hidden layer (off when `enable_dropout=False`).
    layer_norm_epsilon: epsilon of the RMS norms.
    relative_attention_num_buckets / relative_attention_max_distance: T5's relative
      position buckets.
    architecture: 'encoder_decoder' or 'decoder_only'.
    dtype: compute dtype of the matmuls, 'float32' or 'bfloat16'. With 'bfloat16' the
      operands of every projection and attention product are rounded to bfloat16 and
      multiplied with float32 accumulation (XLA:CPU's AMX bf16 kernels); the residual
      stream, norms, softmax, activations and parameters stay float32, as under torch
      autocast. (XLA:CPU emulates bfloat16 elementwise arithmetic with conversions, so
      bfloat16 activations between the matmuls would be slower, not faster.)
    float32_attention_logits: compute attention logits and softmax in float32. With
      either dtype they are: bfloat16 q and k are multiplied with float32 accumulation.
      Kept for T5X configs that set it.
    scan_layers: run the layer stack with `nn.scan` (one compiled layer; parameters
      stacked on a leading 'layers' axis).
    remat_policy: 'none', 'minimal' (save matmul outputs) or 'full' (recompute all).
    weight_dtype: 'float32', or 'int8' for int8 weight-only projection kernels with
      per-channel scales (inference only; see `t5forge.nn.quant`). Set it when loading:
      `t5forge.load(path, weight_dtype='int8')` or `--weight_dtype int8`.
  """

  vocab_size: int
  emb_dim: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  num_encoder_layers: int
  num_decoder_layers: int
  mlp_activations: tuple[str, ...] = ("gelu", "linear")
  logits_via_embedding: bool = False
  scale_logits: bool | None = None
  dropout_rate: float = 0.1
  layer_norm_epsilon: float = 1e-6
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  architecture: str = ENCODER_DECODER
  dtype: str = "float32"
  float32_attention_logits: bool = True
  scan_layers: bool = False
  remat_policy: str = "none"
  weight_dtype: str = "float32"

  def __post_init__(self):
    # Gin and JSON hand us lists; keep the dataclass hashable.
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    problems = []
    for name in ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim", "num_decoder_layers"):
      if int(getattr(self, name)) <= 0:
        problems.append(f"{name} must be positive, got {getattr(self, name)}")
    if self.architecture not in ARCHITECTURES:
      problems.append(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
    if self.architecture == ENCODER_DECODER and self.num_encoder_layers <= 0:
      problems.append("an encoder-decoder needs num_encoder_layers > 0")
    if self.dtype not in ("float32", "bfloat16"):
      problems.append(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.weight_dtype not in ("float32", "int8"):
      problems.append(f"weight_dtype must be 'float32' or 'int8', got {self.weight_dtype!r}")
    if self.remat_policy not in REMAT_POLICIES:
      problems.append(f"remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
    bad = [a for a in self.mlp_activations if a not in ACTIVATIONS]
    if bad or not self.mlp_activations:
      problems.append(f"mlp_activations {self.mlp_activations} must be non-empty, from {ACTIVATIONS}")
    if not 0.0 <= self.dropout_rate < 1.0:
      problems.append(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
    if problems:
      raise UserError("invalid model config: " + "; ".join(problems))

  @property
  def is_encoder_decoder(self) -> bool:
    return self.architecture == ENCODER_DECODER

  @property
  def should_scale_logits(self) -> bool:
    return self.logits_via_embedding if self.scale_logits is None else self.scale_logits

  @property
  def activation_dtype(self) -> Any:
    return jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["mlp_activations"] = list(self.mlp_activations)
    return d

  @classmethod
  def from_dict(cls, d: dict, *, source: str = "config") -> "ModelConfig":
    """Builds a config from a dict, naming unknown or missing fields in the error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise UserError(f"{source}: unknown model config field(s) {unknown}; known: {sorted(fields)}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(d))
    if missing:
      raise UserError(f"{source}: missing model config field(s) {missing}")
    return cls(**d)
