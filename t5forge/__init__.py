"""t5forge: train, evaluate, score, run and export T5-family models on JAX + Flax.

    import t5forge
    m = t5forge.load("path/to/hf-or-t5x-or-t5forge-checkpoint")
    logits = m.logits(encoder_input_tokens, decoder_input_tokens)

The names below are imported on first use (PEP 562), so that `import t5forge.export.loader`
(the loader of an exported model) does not pull in the networks, models or trainer.
"""
import importlib

__version__ = "0.1.0"
__all__ = ["load", "init", "Model", "ModelConfig", "presets", "UserError"]  # noqa: F822 (lazy names: __getattr__, PEP 562)

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "load": ("t5forge.interactive", "load"),
    "init": ("t5forge.interactive", "init"),
    "Model": ("t5forge.interactive", "Model"),
    "ModelConfig": ("t5forge.nn.config", "ModelConfig"),
    "presets": ("t5forge.presets", None),
    "UserError": ("t5forge.errors", "UserError"),
}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module 't5forge' has no attribute {name!r}")
  module_name, attr = _LAZY[name]
  module = importlib.import_module(module_name)
  value = module if attr is None else getattr(module, attr)
  globals()[name] = value
  return value


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
