"""t5forge: train, evaluate, score, run and export T5-family models on JAX + Flax.

    import t5forge
    m = t5forge.load("path/to/hf-or-t5x-or-t5forge-checkpoint")
    logits = m.logits(encoder_input_tokens, decoder_input_tokens)
"""
from t5forge import presets
from t5forge.errors import UserError
from t5forge.interactive import Model, init, load
from t5forge.nn.config import ModelConfig

__version__ = "0.1.0"
__all__ = ["load", "init", "Model", "ModelConfig", "presets", "UserError"]
