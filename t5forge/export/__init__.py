"""`t5forge export --format jax`: a model as `jax.export` functions that run without t5forge;
`--format saved_model`: the same functions as a TensorFlow SavedModel.

    writer.py   writes the artifact directory (`export_jax`; the layout is in its docstring)
    loader.py   runs it (`ExportedModel`, and `ExportedGenerator` for `t5forge serve`); copied
                into every artifact as `load_exported.py`, so it imports only jax, numpy,
                safetensors, sentencepiece and the standard library, never t5forge
    saved_model.py  converts the writer's functions with jax2tf into a SavedModel
                (`export_saved_model`) and runs one (`SavedModelRunner`); the only module
                that imports tensorflow (the `[tf]` extra), on first use

This file imports nothing: `from t5forge.export import loader` must not pull in the
writer's imports (t5forge.decoding and, through the model it is given, the networks).
"""
