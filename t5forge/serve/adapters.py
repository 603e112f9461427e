"""`t5forge serve --adapter name=path`: several LoRA adapters served on one base model.

    specs = adapters.parse(["fr=runs/lora-fr", "de=hub/peft-de"], base_name="flan")  # at once
    model, params, names = adapters.attach(opened, specs)   # after the base is open
    # names == {"fr": 1, "de": 2}: a request's `model` picks its row's adapter

Each adapter is read as it was written (`t5forge.convert.peft.read_adapter`): our format
(`adapter.json` + `adapter.safetensors`), an adapter training run's MODEL_DIR or
checkpoint, or HF peft's (`adapter_config.json` + `adapter_model.safetensors`). Ours
record their base, whose fingerprint must be the served checkpoint's
(`adapters.fingerprint`); every adapter's kernels must fit the base's. Then all of them become one model of stacked adapters
(`lora.stack`: adapter 0 is the all-zero base, adapter k the k-th `--adapter`): the
engine's slots and the batcher's rows carry each row's index, so rows for different
adapters share a batch, and the stacked weights are ordinary inputs of fixed shapes:
serving any mix of adapters compiles nothing after start-up.
"""
from __future__ import annotations

import dataclasses
import os
import re

from t5forge import storage
from t5forge.errors import UserError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


@dataclasses.dataclass(frozen=True)
class Spec:
  """One `--adapter name=path` (`local`: where it is read, a local copy of a bucket URL)."""
  name: str
  path: str
  local: str = ""


def parse(values: list[str], *, base_name: str) -> list[Spec]:
  """The --adapter values as Specs, checked before anything loads: `name=path` each, a
  name used once and not the base model's, a path that is a directory."""
  specs: list[Spec] = []
  for value in values:
    name, sep, path = value.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
      raise UserError(f"--adapter {value!r}: give name=path (the name clients send as "
                      "`model`, the adapter's directory), e.g. --adapter fr=ckpt/lora-fr")
    if not _NAME.fullmatch(name):
      raise UserError(f"--adapter {value!r}: the name {name!r} must start with a letter or "
                      "digit and hold only letters, digits and . _ : / -")
    if name == base_name:
      raise UserError(f"--adapter {value!r}: {name!r} is the base model's name (the "
                      "requests that send it get the base); name the adapter otherwise, or "
                      "set --model_name")
    if any(s.name == name for s in specs):
      raise UserError(f"--adapter {value!r}: the name {name!r} is given twice; give each "
                      "adapter its own name")
    local = path
    if storage.is_remote(path):  # a local copy, made once per object version
      try:
        local = storage.local_copy(path)
      except FileNotFoundError:
        local = ""
    if not os.path.isdir(local):
      raise UserError(f"--adapter {value!r}: {path} is not a directory; give an adapter "
                      "directory (adapter.json, or peft's adapter_config.json)")
    specs.append(Spec(name, path, local))
  return specs


def _read(spec: Spec, base_config, base_fingerprint: str, base: str):
  """One adapter directory -> (LoraConfig, unscanned adapter params), checked against the
  base (`convert.peft.read_adapter`: ours, an adapter training run's checkpoint, or
  peft's; the fingerprint where the adapter records one, the kernels' shapes always)."""
  from t5forge.convert import peft  # noqa: PLC0415 (the flags are checked before jax loads)
  try:
    config, params = peft.read_adapter(spec.local or spec.path, base_config.replace(scan_layers=False,
                                                                      lora=None),
                                       fingerprint=base_fingerprint, base_name=base)
  except UserError as e:
    raise UserError(f"--adapter {spec.name}={spec.path}: {e}") from None
  if "prompt" in params:
    raise UserError(f"--adapter {spec.name}={spec.path}: also holds a tuned prompt, which "
                    "--adapter cannot serve beside other adapters; serve it alone")
  return config, params


def _check_against(model, stacked: dict, spec_names: str) -> None:
  """The stacked adapter leaves must be exactly the ones the stacked model creates."""
  import jax  # noqa: PLC0415 (as above)

  from t5forge.nn import adapters  # noqa: PLC0415 (as above)
  want, _ = adapters.split(model.abstract_params())
  flat = lambda t: {jax.tree_util.keystr(p): tuple(x.shape)
                    for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
  want, got = flat(want), flat(stacked)
  for key in sorted(set(want) | set(got)):
    if want.get(key) != got.get(key):
      raise UserError(f"--adapter {spec_names}: the update at {key} has shape "
                      f"{got.get(key)} but the checkpoint's model needs {want.get(key)}; the "
                      "adapters do not fit this base")


def attach(opened, specs: list[Spec]) -> tuple:
  """The opened base with the adapters of `specs` stacked on it.

  Args:
    opened: `opener.Opened` (the served checkpoint, parameters placed).
    specs: `parse`'s.

  Returns:
    (model, params, {name: adapter index}): with no specs the base's own model and params
    and {}; else a model of stacked adapters (`lora.LoraConfig.stacked` = len(specs) + 1)
    and the base's params joined with the stacked adapter leaves (replicated: they are
    small), adapter k + 1 being specs[k].
  """
  if not specs:
    return opened.model, opened.params, {}
  import dataclasses  # noqa: PLC0415 (as above)

  import jax  # noqa: PLC0415 (as above)

  from t5forge import models  # noqa: PLC0415 (as above)
  from t5forge.nn import adapters, lora, stack  # noqa: PLC0415 (as above)
  base = opened.checkpoint.path
  if opened.config.lora is not None:
    raise UserError(f"{base} carries a LoRA update of its own; merge it into the base "
                    "first (t5forge convert --merge) to serve --adapter beside it")
  fingerprint = adapters.fingerprint(opened.params)
  config, stacked = lora.stack([_read(s, opened.config, fingerprint, base) for s in specs])
  if opened.config.scan_layers:
    try:
      stacked = stack.stack_layers(stacked)
    except (AssertionError, ValueError):
      raise UserError(f"--adapter: {base} scans its layers, and the adapters do not update "
                      "the same modules in every layer; serve it with scan_layers off") from None
  base_model = opened.model
  model = models.model_for(dataclasses.replace(opened.config, lora=config),
                           vocabulary=base_model.vocabulary, decode_fn=base_model.decode_fn,
                           decoder_params=base_model.decoder_params)
  _check_against(model, stacked, ", ".join(f"{s.name}={s.path}" for s in specs))
  placed = jax.device_put(stacked, opened.partitioner.replicated())
  return (model, adapters.join(placed, opened.params),
          {s.name: k for k, s in enumerate(specs, start=1)})
