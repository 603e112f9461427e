"""`t5forge export --format jax`: a model as `jax.export` functions that run without t5forge.

    writer.py   writes the artifact directory (`export_jax`; the layout is in its docstring)
    loader.py   runs it (`ExportedModel`, and `ExportedGenerator` for `t5forge serve`); copied
                into every artifact as `load_exported.py`, so it imports only jax, numpy,
                safetensors, sentencepiece and the standard library, never t5forge

This file imports nothing: `from t5forge.export import loader` must not pull in the
writer's imports (t5forge.decoding and, through the model it is given, the networks).
"""
