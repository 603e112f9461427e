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
from t5forge.nn.lora import LoraConfig
from t5forge.nn.prompt import PromptConfig, as_config

ENCODER_DECODER = "encoder_decoder"
DECODER_ONLY = "decoder_only"
T5GEMMA = "t5gemma"
T5GEMMA2 = "t5gemma2"
ARCHITECTURES = (ENCODER_DECODER, DECODER_ONLY, T5GEMMA, T5GEMMA2)
GEMMA_ARCHITECTURES = (T5GEMMA, T5GEMMA2)
# Fields that only the T5Gemma network reads (the T5 networks refuse non-default values).
T5GEMMA_FIELDS = ("num_kv_heads", "encoder_emb_dim", "encoder_num_heads", "encoder_num_kv_heads",
                  "encoder_head_dim", "encoder_mlp_dim", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                  "max_position_embeddings")
# Fields that only the T5Gemma 2 network reads.
T5GEMMA2_FIELDS = ("rope_local_theta", "rope_scaling_factor", "eoi_token_id")
REMAT_POLICIES = ("none", "minimal", "full")
ATTENTION_KERNELS = ("auto", "xla", "cudnn")
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
    architecture: 'encoder_decoder' (T5), 'decoder_only' (T5-style LM), 't5gemma'
      (arXiv 2504.06225: Gemma 2 layers as an encoder-decoder; `t5forge.nn.t5gemma`) or
      't5gemma2' (arXiv 2512.14856: Gemma 3 layers, text only; `t5forge.nn.t5gemma2`:
      Q/K norms, merged self/cross attention in the decoder, one embedding for encoder,
      decoder and output, two RoPE bases; the t5gemma fields apply to it too).
      A T5Gemma network has RoPE in self-attention, "sandwich" RMS norms with a (1 + w)
      scale, embeddings multiplied by sqrt(width), separate encoder and decoder
      embeddings (the decoder's tied to the output layer when logits_via_embedding) and
      no relative position bias; the fields below configure the rest.
    num_kv_heads: key/value heads of grouped-query attention (t5gemma); None = num_heads.
      num_heads must be a multiple of it; the decoding cache holds only these heads.
    encoder_emb_dim, encoder_num_heads, encoder_num_kv_heads, encoder_head_dim,
      encoder_mlp_dim: the encoder's shape where it differs from the decoder's (t5gemma
      unbalanced sizes such as 9B-2B); None = the decoder's value. The cross-attention
      keys/values are projected from encoder_emb_dim (HF `cross_attention_hidden_size`).
    rope_theta: rotary embedding base (t5gemma self-attention; none in cross-attention).
    query_pre_attn_scalar: queries are scaled by query_pre_attn_scalar**-0.5 (t5gemma);
      None there means head_dim. T5 networks do not scale (T5 folds it into the init).
    attn_logit_softcapping: cap * tanh(logits / cap) on attention logits; None = off.
    final_logit_softcapping: the same on the output logits; None = off.
    sliding_window: window of the local attention layers (t5gemma); None = all global.
      An encoder query at i sees keys j with |i - j| <= window, a decoder query keys
      with 0 <= i - j < window (as transformers' T5Gemma masks).
    sliding_window_pattern: layer i is global iff (i + 1) % pattern == 0, else local
      (Gemma 2 / T5Gemma: 2, i.e. local, global, local, ...).
    max_position_embeddings: the longest sequence the model was trained for (t5gemma);
      only checked against sliding_window. None = no limit.
    rope_local_theta: RoPE base of the sliding-window layers (t5gemma2: 10,000, the
      global layers use rope_theta, 1,000,000); None = rope_theta.
    rope_scaling_factor: t5gemma2: linear RoPE scaling of the global layers (HF
      rope_parameters.full_attention {'rope_type': 'linear', 'factor': f}, as Gemma 3 4B
      has): their frequencies divided by f. None = 1.
    eoi_token_id: t5gemma2: the token (Gemma 3's end-of-image, 256000) whose input
      embedding is the separate vector `eoi_embedding`, unscaled, instead of its row of
      the table (as transformers' T5Gemma2TextScaledWordEmbedding); None = no such token.
    decoder_start_token_id: the first decoder input (T5: 0 = pad; T5Gemma: 2 = BOS),
      used when decoding starts.
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
    attention_kernel: 'auto' (default), 'xla' or 'cudnn': where T5's teacher-forcing
      attention runs. 'auto' takes cuDNN's fused attention (`t5forge.nn.fused_attention`)
      on a CUDA GPU for the calls it can run (bf16, no attention dropout), T5's own
      XLA attention elsewhere and always on CPU; 'xla' forces ours, 'cudnn' forces cuDNN
      (an error where it cannot run). T5Gemma's grouped attention always runs ours.
    weight_dtype: 'float32', or 'int8' for int8 weight-only projection kernels with
      per-channel scales (inference only; see `t5forge.nn.quant`). Set it when loading:
      `t5forge.load(path, weight_dtype='int8')` or `--weight_dtype int8`.
    prompt: a tuned prompt (`t5forge.nn.prompt`, gin `prompt.PromptConfig`): p learned
      vectors prepended to the embedded encoder input (encoder-decoders only); None = none.
      config.json holds it as a dict.
    eos_token_ids: the ids that end a decode, when more than the vocabulary's EOS does:
      instruction-tuned T5Gemma stops on <eos> 1 or <end_of_turn> 107, (1, 107), as its
      HF generation_config.json's eos_token_id list. None = the vocabulary's EOS alone.
      The vocabulary's EOS always ends a decode too.
    lora: a `t5forge.nn.lora.LoraConfig`: LoRA updates on the projections it targets
      (their parameters `lora_a` / `lora_b` beside each kernel; adapter training trains
      only them). None = none. config.json holds it as a dict.
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
  attention_kernel: str = "auto"
  weight_dtype: str = "float32"
  eos_token_ids: tuple[int, ...] | None = None
  num_kv_heads: int | None = None
  encoder_emb_dim: int | None = None
  encoder_num_heads: int | None = None
  encoder_num_kv_heads: int | None = None
  encoder_head_dim: int | None = None
  encoder_mlp_dim: int | None = None
  rope_theta: float = 10000.0
  query_pre_attn_scalar: float | None = None
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  sliding_window: int | None = None
  sliding_window_pattern: int = 2
  max_position_embeddings: int | None = None
  rope_local_theta: float | None = None
  rope_scaling_factor: float | None = None
  eoi_token_id: int | None = None
  decoder_start_token_id: int = 0
  lora: LoraConfig | None = None
  prompt: PromptConfig | None = None

  def __post_init__(self):
    # Gin and JSON hand us lists; keep the dataclass hashable.
    object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
    if isinstance(self.lora, dict):
      object.__setattr__(self, "lora", LoraConfig.from_dict(self.lora))
    object.__setattr__(self, "prompt", as_config(self.prompt))
    problems = []
    if self.prompt is not None and not self.is_encoder_decoder:
      problems.append("prompt applies to encoder-decoder architectures (it is prepended to "
                      f"the encoder input), not {self.architecture!r}; remove it")
    for name in ("vocab_size", "emb_dim", "num_heads", "head_dim", "mlp_dim", "num_decoder_layers"):
      if int(getattr(self, name)) <= 0:
        problems.append(f"{name} must be positive, got {getattr(self, name)}")
    if self.architecture not in ARCHITECTURES:
      problems.append(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
    if self.is_encoder_decoder and self.num_encoder_layers <= 0:
      problems.append("an encoder-decoder needs num_encoder_layers > 0")
    if self.architecture in GEMMA_ARCHITECTURES:
      problems += self._t5gemma_problems()
    else:
      set_fields = [n for n in T5GEMMA_FIELDS if getattr(self, n) is not None]
      if set_fields:
        problems.append(f"{', '.join(set_fields)} apply only to architecture 't5gemma'; remove "
                        "them or set architecture = 't5gemma'")
    if self.architecture == T5GEMMA2:
      problems += self._t5gemma2_problems()
    else:
      set_fields = [n for n in T5GEMMA2_FIELDS if getattr(self, n) is not None]
      if set_fields:
        problems.append(f"{', '.join(set_fields)} apply only to architecture 't5gemma2'; "
                        "remove them or set architecture = 't5gemma2'")
    if self.dtype not in ("float32", "bfloat16"):
      problems.append(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.weight_dtype not in ("float32", "int8"):
      problems.append(f"weight_dtype must be 'float32' or 'int8', got {self.weight_dtype!r}")
    if self.remat_policy not in REMAT_POLICIES:
      problems.append(f"remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
    if self.attention_kernel not in ATTENTION_KERNELS:
      problems.append(f"attention_kernel must be one of {ATTENTION_KERNELS}, got "
                      f"{self.attention_kernel!r}")
    elif self.attention_kernel == "cudnn" and self.architecture in GEMMA_ARCHITECTURES:
      problems.append("attention_kernel 'cudnn' applies to T5's attention only (T5Gemma's "
                      "grouped attention runs on XLA); use 'auto'")
    bad = [a for a in self.mlp_activations if a not in ACTIVATIONS]
    if bad or not self.mlp_activations:
      problems.append(f"mlp_activations {self.mlp_activations} must be non-empty, from {ACTIVATIONS}")
    if not 0.0 <= self.dropout_rate < 1.0:
      problems.append(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
    if self.eos_token_ids is not None:
      ids = self.eos_token_ids
      ids = (ids,) if isinstance(ids, int) else tuple(ids)
      if not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                            and 0 < i < int(self.vocab_size) for i in ids):
        problems.append(f"eos_token_ids {self.eos_token_ids!r} must be token ids in "
                        f"[1, vocab_size {self.vocab_size}), e.g. (1, 107), or None")
      else:
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in ids))
    if problems:
      raise UserError("invalid model config: " + "; ".join(problems))

  def _t5gemma_problems(self) -> list[str]:
    problems = []
    for name in T5GEMMA_FIELDS[:6] + ("sliding_window", "max_position_embeddings",
                                      "sliding_window_pattern"):
      value = getattr(self, name)
      if value is not None and int(value) <= 0:
        problems.append(f"{name} must be positive, got {value}")
    # (Not via self.encoder: that builds, and validates, another config.)
    sides = [("", self.num_heads, self.num_kv_heads)]
    if self.encoder_num_heads is not None or self.encoder_num_kv_heads is not None:
      sides.append(("encoder_", self.encoder_num_heads or self.num_heads,
                    self.encoder_num_kv_heads or self.num_kv_heads))
    for side, heads, kv in sides:  # (the encoder's only where set: else the same numbers)
      if kv is not None and kv > 0 and heads % kv:
        problems.append(f"{side}num_heads {heads} is not a multiple of {side}num_kv_heads {kv}; "
                        f"use a divisor of {heads}")
    if (self.sliding_window is not None and self.max_position_embeddings is not None
        and self.sliding_window > self.max_position_embeddings):
      problems.append(f"sliding_window {self.sliding_window} is larger than "
                      f"max_position_embeddings {self.max_position_embeddings}; use at most "
                      f"{self.max_position_embeddings}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and float(value) <= 0:
        problems.append(f"{name} must be positive or None, got {value}")
    return problems

  def _t5gemma2_problems(self) -> list[str]:
    problems = []
    if self.encoder_emb_dim is not None and self.encoder_emb_dim != self.emb_dim:
      problems.append(f"encoder_emb_dim {self.encoder_emb_dim} differs from emb_dim "
                      f"{self.emb_dim}; T5Gemma 2's merged attention projects the encoder "
                      "output with the decoder's key/value kernels, so remove encoder_emb_dim")
    if not self.logits_via_embedding:
      problems.append("logits_via_embedding must be True for t5gemma2 (T5Gemma 2 ties the "
                      "encoder, decoder and output embeddings)")
    if self.rope_local_theta is not None and float(self.rope_local_theta) <= 0:
      problems.append(f"rope_local_theta must be positive or None, got {self.rope_local_theta}")
    if self.rope_scaling_factor is not None and float(self.rope_scaling_factor) <= 0:
      problems.append(f"rope_scaling_factor must be positive or None, got "
                      f"{self.rope_scaling_factor}")
    if self.eoi_token_id is not None and not 0 <= self.eoi_token_id < self.vocab_size:
      problems.append(f"eoi_token_id {self.eoi_token_id} is outside the vocabulary "
                      f"[0, {self.vocab_size}); set it to None")
    return problems

  @property
  def is_encoder_decoder(self) -> bool:
    return self.architecture in (ENCODER_DECODER,) + GEMMA_ARCHITECTURES

  @property
  def kv_heads(self) -> int:
    """The decoder's key/value heads (num_heads unless grouped-query attention)."""
    return self.num_kv_heads or self.num_heads

  @property
  def encoder(self) -> "ModelConfig":
    """The encoder's layer shape: this config with the encoder_* fields applied
    (t5gemma; for T5 the config itself)."""
    changes = {name: getattr(self, f"encoder_{name}")
               for name in ("emb_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
               if getattr(self, f"encoder_{name}") is not None}
    if not changes:
      return self
    return dataclasses.replace(self, **changes, **{f"encoder_{n}": None for n in changes})

  def sliding_layers(self, num_layers: int) -> tuple[bool, ...]:
    """Which of num_layers layers use the sliding window (all False without one)."""
    if self.sliding_window is None:
      return (False,) * num_layers
    return tuple((i + 1) % self.sliding_window_pattern != 0 for i in range(num_layers))

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
    d["lora"] = None if self.lora is None else self.lora.to_dict()
    d["prompt"] = None if self.prompt is None else self.prompt.to_dict()
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
    try:
      return cls(**d)
    except UserError as err:
      raise UserError(f"{source}: {err}") from None
