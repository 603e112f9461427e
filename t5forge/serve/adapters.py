"""`t5forge serve --adapter name=path`: several LoRA adapters served on one base model.

    specs = adapters.parse(["fr=ckpt/fr", "de=hf/peft-de"], base_name="flan")  # at once
    model, params, names = adapters.attach(opened, specs)   # after the base is open
    # names == {"fr": 1, "de": 2}: a request's `model` picks its row's adapter

Each adapter is read as it was written: our format (`adapter.json` +
`adapter.safetensors`, `t5forge.nn.adapters`) or HF peft's (`adapter_config.json` +
`adapter_model.safetensors`, `t5forge.convert.peft`). Its record of the base must match
the served checkpoint (`adapters.fingerprint`). Then all of them become one model of
stacked adapters (`lora.stack`: adapter 0 is the all-zero base, adapter k the k-th
`--adapter`): the engine's slots and the batcher's rows carry each row's index, so rows
for different adapters share a batch, and the stacked weights are ordinary inputs of
fixed shapes: serving any mix of adapters compiles nothing after start-up.
"""
from __future__ import annotations

import dataclasses
import os
import re

from t5forge.errors import UserError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


@dataclasses.dataclass(frozen=True)
class Spec:
  """One `--adapter name=path`."""
  name: str
  path: str


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
    if not os.path.isdir(path):
      raise UserError(f"--adapter {value!r}: {path} is not a directory; give an adapter "
                      "directory (adapter.json, or peft's adapter_config.json)")
    specs.append(Spec(name, path))
  return specs
