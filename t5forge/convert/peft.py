"""LoRA adapters <-> Hugging Face peft's format, both ways, without torch.

peft saves a LoRA adapter as a directory of `adapter_config.json` and
`adapter_model.safetensors` whose keys are `base_model.model.<module>.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]), `<module>` the name of the adapted
`nn.Linear` in transformers' model (T5: `encoder.block.0.layer.0.SelfAttention.q`;
T5Gemma: `model.decoder.layers.0.cross_attn.v_proj`; T5Gemma 2:
`model.encoder.text_model.layers.0.mlp.up_proj`). Ours are `lora_a` = lora_A.T ([in, r])
and `lora_b` = lora_B.T ([r, out]) next to the kernel (`t5forge.nn.lora`).

The module names come from each family's HF name table (`hf.Family.name_table`, the
one HF <-> ours mapping), so every family the converter reads has adapters too.

Patterns do not translate between the two namings (peft matches `target_modules`,
`rank_pattern` and `alpha_pattern` against transformers' module names, we against our
module paths), so each direction resolves them to the set of adapted modules with
their ranks and alphas, and writes that set back compactly: a suffix list (`q`, `v`
for T5; `query,value` for us) when one describes it exactly, else the explicit names
(always, for the Gemma families, whose suffixes would also reach the vision tower
transformers builds); ranks and alphas that differ from the common one go in
`rank_pattern` / `alpha_pattern` as exact names.

What peft can express but t5forge cannot run (DoRA, biases, `modules_to_save`, ...)
is refused in one line naming the field.
"""
from __future__ import annotations

import collections
import math
import os
import re

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from t5forge import files
from t5forge.convert import hf, load_checkpoint, native, of_checkpoint, paths, relayout
from t5forge.convert.hf.config_files import CONFIG_FILE, read_json
from t5forge.convert.torch_pickle import load_torch_state_dict
from t5forge.data import vocab_io
from t5forge.errors import UserError
from t5forge.nn import abstract_params, adapters, lora
from t5forge.nn import prompt as prompt_lib
from t5forge.nn.config import ModelConfig
from t5forge.nn.stack import unstack_layers

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"  # peft with safe_serialization=False
PREFIX = "base_model.model."
TASK_TYPE = "SEQ_2_SEQ_LM"
PEFT_VERSION = "0.21.2"  # the peft these files are tested against (tests/test_peft_interop.py)

# peft fields t5forge cannot honour, with the value that means "not used". Anything
# else there is refused, naming the field.
_UNSUPPORTED = {
    "use_dora": "DoRA's magnitude vectors",
    "fan_in_fan_out": "Conv1D-style [in, out] weights (GPT-2's layers, not T5's)",
    "modules_to_save": "fully trained copies of whole modules",
    "layers_to_transform": "adapting a subset of layers by index",
    "layers_pattern": "adapting a subset of layers by index",
    "lora_bias": "a bias on lora_B",
    "use_qalora": "QA-LoRA's pooled inputs",
    "use_bdlora": "block-diagonal LoRA",
    "target_parameters": "LoRA on bare nn.Parameters",
    "trainable_token_indices": "trainable embedding rows",
    "layer_replication": "replicated layers",
    "alora_invocation_tokens": "activated LoRA",
    "arrow_config": "Arrow routing",
    "exclude_modules": "excluded modules",
}
# init_lora_weights values that also rewrite the base weights (residual inits): the
# adapter is only right on that changed base, which is not in the adapter file.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
# Hub-name words that identify a family: an adapter whose base is named for one family is
# refused on a base of another.
# ("t5gemma-2-270m-270m" is T5Gemma 2, "t5gemma-2b-2b-ul2" T5Gemma.)
_NAME_HINTS = (("t5gemma-2-", "T5Gemma 2"), ("t5gemma2", "T5Gemma 2"), ("t5gemma", "T5Gemma"),
               ("t5", "T5"))


def modules(config: ModelConfig) -> dict[str, str]:
  """Every projection LoRA can adapt in a model of `config`: {our module path (unscanned,
  '/'-joined, e.g. 'encoder/layers_0/attention/query'): transformers' module name
  (e.g. 'encoder.block.0.layer.0.SelfAttention.q')}, in the HF state dict's order. The
  output layer (`logits_dense`) is never one (peft's all-linear skips it too)."""
  family = hf.family_for(config)
  out = {}
  for path, key, _ in family.name_table(config):
    if path[-1] != "kernel" or "logits_dense" in path:
      continue
    name = key[:-len(".weight")]
    for saved, live in family.module_prefixes:
      if name.startswith(saved):
        name = live + name[len(saved):]
        break
    out["/".join(path[:-1])] = name
  return out


def kernel_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
  """{our module path: its kernel's (in, out)} for every module of `modules(config)`."""
  plain = abstract_params(config.replace(scan_layers=False, lora=None, weight_dtype="float32"))
  plain = unstack_layers(plain)
  out = {}
  for path in modules(config):
    node = plain
    for k in path.split("/"):
      node = node[k]
    out[path] = tuple(node["kernel"].shape)
  return out


# ---------------------------------------------------------------------------------------
# Compact descriptions of a set of adapted modules, in either naming.

def _suffixes(chosen: list[str], every: list[str], sep: str) -> list[str] | None:
  """The last name components that select exactly `chosen` out of `every`, or None."""
  last = sorted({m.rsplit(sep, 1)[-1] for m in chosen})
  picked = [m for m in every if m.rsplit(sep, 1)[-1] in last]
  return last if sorted(picked) == sorted(chosen) else None


def _alternation(names: list[str]) -> str:
  return "(?:" + "|".join(re.escape(n) for n in names) + ")" if len(names) > 1 else re.escape(
      names[0])


def _common(values: dict[str, float]):
  """The most frequent value (ties: the smallest), and {key: value} of the others."""
  counts = collections.Counter(values.values())
  best = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0]
  return best, {k: v for k, v in values.items() if v != best}


def _grouped(others: dict[str, float]) -> list[tuple[str, float]]:
  """{name: value} -> [(exact-name alternation, value)], one pattern per value."""
  by_value: dict = collections.defaultdict(list)
  for name, value in others.items():
    by_value[value].append(name)
  return [(_alternation(names), value) for value, names in sorted(by_value.items())]


def _plain(x: float):
  return int(x) if float(x).is_integer() else float(x)


def _alpha(rank: int, scale: float, rslora: bool) -> float:
  """The alpha with `scale` = alpha / rank (alpha / sqrt(rank) for rsLoRA), rounded away
  from float noise (alphas are whole numbers in practice)."""
  alpha = scale * (math.sqrt(rank) if rslora else rank)
  return float(round(alpha)) if abs(alpha - round(alpha)) < 1e-6 * max(1.0, abs(alpha)) else alpha


# ---------------------------------------------------------------------------------------
# Ours -> peft.

def _flat_adapter(adapter_params: dict) -> dict[str, dict]:
  """Nested adapter parameters (either layout) -> {our module path: {'lora_a', 'lora_b'}}."""
  tree = unstack_layers(adapter_params) if _has_key(adapter_params, "layers") else adapter_params
  out: dict[str, dict] = {}

  def walk(node, path):
    if "lora_a" in node or "lora_b" in node:
      out["/".join(path)] = {k: np.asarray(node[k], np.float32) for k in ("lora_a", "lora_b")
                             if k in node}
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, path + (k,))

  walk(tree, ())
  return out


def _has_key(tree, name: str) -> bool:
  return isinstance(tree, dict) and any(k == name or _has_key(v, name) for k, v in tree.items())


def peft_config(lora_config: lora.LoraConfig, config: ModelConfig, adapted: dict[str, int],
                base_name: str) -> dict:
  """adapter_config.json for the modules `adapted` ({our module path: rank}) of `config`."""
  names = modules(config)
  live = {names[p]: r for p, r in adapted.items()}
  alphas = {names[p]: _alpha(r, lora_config.scale_for(p), lora_config.rslora)
            for p, r in adapted.items()}
  r, other_ranks = _common(live)
  alpha, other_alphas = _common(alphas)
  targets = None
  if config.architecture in hf.t5.FAMILY.architectures:  # T5's suffixes are unambiguous
    targets = _suffixes(list(live), list(names.values()), ".")
  return {
      "peft_type": "LORA",
      "task_type": TASK_TYPE,
      "auto_mapping": None,
      "base_model_name_or_path": base_name,
      "revision": None,
      "inference_mode": True,
      "r": int(r),
      "lora_alpha": _plain(alpha),
      "lora_dropout": float(lora_config.dropout),
      "use_rslora": bool(lora_config.rslora),
      "target_modules": targets or sorted(live),
      "rank_pattern": {k: int(v) for k, v in _grouped(other_ranks)},
      "alpha_pattern": {k: _plain(v) for k, v in _grouped(other_alphas)},
      "bias": "none",
      "fan_in_fan_out": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
      "use_dora": False,
      "peft_version": PEFT_VERSION,
  }


def write_peft(path: str, lora_config: lora.LoraConfig, adapter_params: dict,
               base_config: ModelConfig, base_name: str) -> None:
  """Writes our LoRA adapter as peft saves one (`PeftModel.from_pretrained` loads it on
  transformers' model of `base_config`'s family).

  Args:
    path: the directory to create (appears whole or not at all).
    lora_config: the adapter's LoraConfig (its scales give peft's alphas).
    adapter_params: nested `lora_a` [in, r] / `lora_b` [r, out] leaves, either layout.
    base_config: the base model's config.
    base_name: recorded as `base_model_name_or_path` (a Hub name or a directory).
  """
  names, shapes = modules(base_config), kernel_shapes(base_config)
  flat = _flat_adapter(adapter_params)
  if not flat:
    raise UserError("the model has no LoRA parameters to write (no lora_a / lora_b leaves)")
  state, adapted = {}, {}
  for module, leaves in flat.items():
    if module not in names:
      raise UserError(f"LoRA parameters at {module!r} have no transformers module in a "
                      f"{hf.family_for(base_config).name} model; known: "
                      f"{', '.join(list(names)[:3])}, ...")
    a, b = leaves.get("lora_a"), leaves.get("lora_b")
    if a is None or b is None:
      raise UserError(f"{module}: LoRA needs both lora_a and lora_b; one is missing")
    fan_in, fan_out = shapes[module]
    if a.shape[0] != fan_in or b.shape[1] != fan_out or a.shape[1] != b.shape[0]:
      raise UserError(f"{module}: lora_a {a.shape} / lora_b {b.shape} do not fit the "
                      f"kernel [{fan_in}, {fan_out}] of the base")
    key = PREFIX + names[module]
    state[f"{key}.lora_A.weight"] = np.ascontiguousarray(a.T)
    state[f"{key}.lora_B.weight"] = np.ascontiguousarray(b.T)
    adapted[module] = int(a.shape[1])
  config = peft_config(lora_config, base_config, adapted, base_name)
  with files.staged_dir(path) as tmp:
    files.write_json(os.path.join(tmp, ADAPTER_CONFIG), config, sort_keys=True)
    save_file(state, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------
# peft -> ours.

def _check_supported(cfg: dict, source: str) -> None:
  peft_type = cfg.get("peft_type")
  if peft_type != "LORA":
    raise UserError(f"{source}: peft_type {peft_type!r} is not supported; t5forge reads "
                    "peft's LORA and PROMPT_TUNING adapters")
  for field, what in _UNSUPPORTED.items():
    if cfg.get(field):
      raise UserError(f"{source}: {field} = {cfg[field]!r} ({what}) is not supported by "
                      f"t5forge's LoRA; retrain the adapter without {field}")
  if cfg.get("bias", "none") != "none":
    raise UserError(f"{source}: bias = {cfg['bias']!r} is not supported (t5forge's LoRA "
                    "trains no biases); retrain the adapter with bias='none'")
  init = cfg.get("init_lora_weights")
  if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
    raise UserError(f"{source}: init_lora_weights = {init!r} changes the base weights as well, "
                    "and the adapter is only right on that changed base; convert it to a plain "
                    "LoRA first (peft's path_initial_model_for_weight_conversion)")
  task = cfg.get("task_type")
  if task not in (None, TASK_TYPE):
    raise UserError(f"{source}: task_type {task!r}; t5forge's models are sequence-to-sequence "
                    f"LMs (task_type {TASK_TYPE!r})")


def _base_family(cfg: dict) -> str | None:
  """The family an adapter names as its base (`auto_mapping`, a local directory's
  config.json, or a Hub name), or None when it names none t5forge can tell."""
  mapping = cfg.get("auto_mapping") or {}
  cls = mapping.get("base_model_class") if isinstance(mapping, dict) else None
  for family in hf.FAMILIES:
    if cls in family.hf_architectures:
      return family.name
  if cls:
    return cls
  name = cfg.get("base_model_name_or_path")
  if not isinstance(name, str) or not name:
    return None
  if os.path.isfile(os.path.join(name, CONFIG_FILE)):
    model_type = read_json(os.path.join(name, CONFIG_FILE), default={}).get("model_type")
    family = next((f for f in hf.FAMILIES if model_type in f.model_types), None)
    return family.name if family else f"model_type {model_type!r}"
  low = name.lower().rsplit("/", 1)[-1]
  return next((fam for word, fam in _NAME_HINTS if word in low), None)


def _peft_state(path: str) -> dict[str, np.ndarray]:
  weights = os.path.join(path, ADAPTER_WEIGHTS)
  if os.path.isfile(weights):
    try:
      with safe_open(weights, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 (safetensors raises its own SafetensorError)
      raise UserError(f"{weights}: cannot read safetensors file ({e})") from None
  if os.path.isfile(os.path.join(path, ADAPTER_BIN)):
    return load_torch_state_dict(os.path.join(path, ADAPTER_BIN))
  raise UserError(f"{path}: has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (or {ADAPTER_BIN})")


def _pattern_value(patterns: dict, module: str, default):
  """peft's rank_pattern / alpha_pattern lookup: the first key matching the module name
  as `(.*\\.)?(key)$`."""
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def _module_of(key: str, path: str) -> tuple[str, str]:
  """A peft weight name -> (transformers module name, 'lora_A' | 'lora_B')."""
  name = key[len(PREFIX):] if key.startswith(PREFIX) else key
  for part in ("lora_A", "lora_B"):
    for tail in (f".{part}.weight", f".{part}.default.weight"):
      if name.endswith(tail):
        return name[:-len(tail)], part
  raise UserError(f"{path}: weight {key!r} is not a LoRA Linear weight (lora_A / lora_B); "
                  "t5forge reads LoRA on the attention and MLP projections only")


def read_peft(path: str, base_config: ModelConfig) -> tuple[lora.LoraConfig, dict]:
  """A peft LoRA adapter directory -> (LoraConfig, nested float32 `lora_a` / `lora_b`
  parameters in our unscanned layout) for a base of `base_config`."""
  source = os.path.join(path, ADAPTER_CONFIG)
  cfg = read_json(source)
  if not isinstance(cfg, dict):
    raise UserError(f"{source}: not a JSON object")
  _check_supported(cfg, source)
  family = hf.family_for(base_config)
  named = _base_family(cfg)
  if named is not None and named != family.name:
    raise UserError(f"{source}: an adapter for a {named} base "
                    f"({cfg.get('base_model_name_or_path') or cfg.get('auto_mapping')}), but the "
                    f"base given is {family.name}; pass the checkpoint it was trained on")
  names, shapes = modules(base_config), kernel_shapes(base_config)
  ours = {v: k for k, v in names.items()}
  for saved, live in family.module_prefixes:  # files that name the saved weights' modules
    ours.update({saved + v[len(live):]: k for v, k in list(ours.items()) if v.startswith(live)})
  pairs: dict[str, dict] = collections.defaultdict(dict)
  foreign = []
  for key, value in _peft_state(path).items():
    module, part = _module_of(key, path)
    if family is hf.t5gemma2.FAMILY and module.startswith(hf.t5gemma2.VISION_PREFIXES):
      continue  # the vision tower, which t5forge's text model does not have (hf.t5gemma2)
    if module not in ours and module.rsplit(".", 1)[-1] in ("lm_head", "out_proj"):
      raise UserError(f"{path}: LoRA on the output layer ({module}) is not supported (peft's "
                      "all-linear leaves it out too); retrain without it in target_modules")
    if module not in ours:
      foreign.append(module)
      continue
    pairs[ours[module]][part] = np.asarray(value, np.float32)
  if foreign:
    raise UserError(f"{path}: {len(foreign)} adapted module(s) are not projections of this "
                    f"{family.name} base, e.g. {foreign[0]!r} (the base has e.g. "
                    f"{next(iter(names.values()))!r}); is the adapter for another architecture?")
  if not pairs:
    raise UserError(f"{path}: {ADAPTER_WEIGHTS} holds no LoRA weights")
  r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
  rslora = bool(cfg.get("use_rslora", False))
  params: dict = {}
  ranks, alphas = {}, {}
  for module in names:  # state dict order: messages name the first problem there
    if module not in pairs:
      continue
    a, b = pairs[module].get("lora_A"), pairs[module].get("lora_B")
    live = names[module]
    if a is None or b is None:
      raise UserError(f"{path}: {live} has only {'lora_A' if b is None else 'lora_B'}; an "
                      "adapter needs both")
    rank = int(_pattern_value(cfg.get("rank_pattern"), live, r))
    fan_in, fan_out = shapes[module]
    if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
      raise UserError(f"{path}: {live} has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                      f"but this base's kernel is [{fan_out}, {fan_in}] and r is {rank}; is the "
                      "adapter for a model of another size?")
    ranks[module] = rank
    alphas[module] = float(_pattern_value(cfg.get("alpha_pattern"), live, alpha))
    node = params
    for k in module.split("/"):
      node = node.setdefault(k, {})
    node["lora_a"], node["lora_b"] = a.T.copy(), b.T.copy()
  config = _lora_config(ranks, alphas, list(names), rslora=rslora,
                        dropout=float(cfg.get("lora_dropout", 0.0) or 0.0))
  return config, params


def _lora_config(ranks: dict[str, int], alphas: dict[str, float], every: list[str], *,
                 rslora: bool, dropout: float) -> lora.LoraConfig:
  """The LoraConfig that adapts exactly `ranks`' modules with those ranks and alphas."""
  suffixes = _suffixes(list(ranks), every, "/")
  targets = ",".join(suffixes) if suffixes else "re:" + _alternation(sorted(ranks))
  rank, other_ranks = _common(ranks)
  alpha, other_alphas = _common(alphas)
  return lora.LoraConfig(rank=int(rank), alpha=float(alpha), dropout=dropout, rslora=rslora,
                         targets=targets,
                         rank_pattern=tuple((k, int(v)) for k, v in _grouped(other_ranks)),
                         alpha_pattern=tuple((k, float(v)) for k, v in _grouped(other_alphas)))


def scan_mismatch(lora_config: lora.LoraConfig, config: ModelConfig) -> str | None:
  """The first module whose update (rank, scale, or none) differs from its stack's layer
  0's, or None. A scanned model has one module per stack, matched as layer 0
  (`lora.canonical`), so an adapter that treats layers differently runs unscanned only."""
  for path in modules(config):
    first = re.sub(r"/layers_\d+/", "/layers_0/", path)
    if (lora_config.rank_for(path), lora_config.scale_for(path)) != (
        lora_config.rank_for(first), lora_config.scale_for(first)):
      return path
  return None


def as_unscanned(lora_config: lora.LoraConfig, config: ModelConfig) -> lora.LoraConfig:
  """The LoraConfig that gives an unscanned model what `lora_config` gives the model of
  `config`: itself when unscanned or when its layers agree already (`scan_mismatch`),
  else (a scan matches every layer as layer 0) layer 0's rank and scale on every layer."""
  if not config.scan_layers or scan_mismatch(lora_config, config) is None:
    return lora_config
  ranks, alphas = {}, {}
  for path in modules(config):
    first = re.sub(r"/layers_\d+/", "/layers_0/", path)
    rank = lora_config.rank_for(first)
    if rank:
      ranks[path] = rank
      alphas[path] = _alpha(rank, lora_config.scale_for(first), lora_config.rslora)
  return _lora_config(ranks, alphas, list(modules(config)), rslora=lora_config.rslora,
                      dropout=float(lora_config.dropout))


# ---------------------------------------------------------------------------------------
# Either format.

def is_adapter_dir(path: str) -> bool:
  """Whether `path` is an adapter directory of either format."""
  return adapters.is_adapter_dir(path) or os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def _training_checkpoint(path: str) -> tuple[dict, dict, dict]:
  """An adapter training run's checkpoint (MODEL_DIR: its newest intact one) -> (adapter
  parameters, unscanned numpy; the model config dict; adapter.json's record)."""
  ckpt = paths.resolve(path).path
  record_path = os.path.join(ckpt, adapters.CONFIG_FILE)
  if not os.path.isfile(record_path):
    raise UserError(f"{ckpt}: a checkpoint without {adapters.CONFIG_FILE}, so not one of "
                    "adapter training; load it as the model itself, not as --adapter")
  record = read_json(record_path)
  config, _ = native.read_header(ckpt)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = adapters.split(abstract_params(config))[0]
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          abstract)
  params = jax.device_get(native.restore_params(ckpt, abstract))
  if config.scan_layers:
    params = unstack_layers(params)
    config = config.replace(scan_layers=False, lora=config.lora and as_unscanned(config.lora,
                                                                                 config))
  return params, config.to_dict(), {k: v for k, v in (record or {}).items()
                                    if k not in ("format", "model")}


def read_adapter(path: str, base_config: ModelConfig, *, fingerprint: str | None = None,
                 base_name: str = "this base") -> tuple[lora.LoraConfig, dict]:
  """An adapter directory of either format -> (LoraConfig, nested `lora_a` / `lora_b`
  parameters, unscanned layout, float32).

  Args:
    path: ours (`adapter.json` + `adapter.safetensors`, `nn.adapters.save`), an adapter
      training run's MODEL_DIR or checkpoint_<step> (the adapter alone + adapter.json), or
      peft's (`adapter_config.json` + `adapter_model.safetensors`).
    base_config: the config of the base the adapter is applied to.
    fingerprint: the base's `adapters.fingerprint`; checked against the one ours records
      (`adapters.check_base`), the base named `base_name` in the message.
  """
  if not os.path.isdir(path):
    raise UserError(f"adapter {path}: no such directory")
  if native.is_native_checkpoint(path) or paths.is_model_dir(path):
    params, model_config, record = _training_checkpoint(path)
  elif adapters.is_adapter_dir(path):
    params, model_config, record = adapters.load(path)
  else:
    params = None
  if params is not None:
    if fingerprint is not None:
      adapters.check_base(record, fingerprint, adapter=path, base=base_name)
    if not (model_config or {}).get("lora"):
      raise UserError(f"{path}: a t5forge adapter without LoRA (e.g. a prompt-tuning one); "
                      "this reads LoRA adapters")
    config = lora.LoraConfig.from_dict(model_config["lora"], source=path)
    shapes = kernel_shapes(base_config)
    for module, leaves in _flat_adapter(params).items():
      want = shapes.get(module)
      if want is None or leaves["lora_a"].shape[0] != want[0] or (
          leaves["lora_b"].shape[1] != want[1]):
        fit = "no such module" if want is None else f"its kernel is {list(want)}"
        raise UserError(f"{path}: LoRA at {module} (lora_a {list(leaves['lora_a'].shape)}) "
                        f"does not fit this base ({fit}); pass the checkpoint the adapter "
                        "was trained on")
    return config, params
  if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
    return read_peft(path, base_config)
  found = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
  raise UserError(f"{path}: not an adapter directory (found {found}); expected "
                  f"{adapters.CONFIG_FILE} + {adapters.WEIGHTS_FILE} "
                  f"(t5forge) or {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS} (peft)")


def read_any(path: str, base_config: ModelConfig, *, fingerprint: str | None = None,
             base_name: str = "this base") -> tuple[dict, dict]:
  """A LoRA or prompt-tuning adapter of either format -> (the ModelConfig changes it needs,
  {"lora": LoraConfig} or {"prompt": PromptConfig}; its parameters, unscanned).

  Prompts: ours (`adapter.json` whose model has a `prompt`, or a prompt-tuning run's
  MODEL_DIR / checkpoint) and peft's PROMPT_TUNING (`nn.prompt.from_peft`); the rest is
  `read_adapter`'s."""
  if os.path.isdir(path) and prompt_lib.is_peft_prompt(path):
    cfg, arr = prompt_lib.from_peft(path, base_config)
    return {"prompt": cfg}, prompt_lib.with_prompt({}, arr)
  ours = os.path.isdir(path) and (native.is_native_checkpoint(path) or paths.is_model_dir(path)
                                  or adapters.is_adapter_dir(path))
  if ours:
    params, model_config, record = (
        adapters.load(path) if adapters.is_adapter_dir(path) else _training_checkpoint(path))
    if (model_config or {}).get("prompt") and not model_config.get("lora"):
      if fingerprint is not None:
        adapters.check_base(record, fingerprint, adapter=path, base=base_name)
      cfg = prompt_lib.as_config(model_config["prompt"])
      arr = prompt_lib.get_prompt(params)
      want = (cfg.length, base_config.encoder.emb_dim)
      if arr.shape != want:
        raise UserError(f"{path}: its prompt is {list(arr.shape)} but this base needs "
                        f"{list(want)}; pass the checkpoint the prompt was tuned on")
      return {"prompt": cfg}, prompt_lib.with_prompt({}, arr)
  config, params = read_adapter(path, base_config, fingerprint=fingerprint, base_name=base_name)
  return {"lora": config}, params


def base_record(base_path: str, base_params: dict, base_config: ModelConfig) -> dict:
  """What our adapter format records of its base: the path, its fingerprint and how its
  kernels are stored."""
  return {"base": base_path, "fingerprint": adapters.fingerprint(base_params),
          "base_dtype": base_config.weight_dtype}


def convert_adapter(adapter: str | None, base: str | None, output: str, *, to: str,
                    merge: bool, input_given: str | None = None) -> list[str]:
  """`t5forge convert --adapter DIR --base BASE --to {peft,t5forge,hf} [--merge]`.

  Returns:
    The lines to tell the user.
  """
  if not adapter:
    raise UserError(f"--to {to}" + (" with --merge" if merge else "") + " needs --adapter DIR "
                    "(a LoRA adapter directory) and --base BASE (the checkpoint it applies to)")
  if input_given:
    raise UserError("--input with --adapter: name the adapter's base with --base BASE "
                    "instead")
  if not base:
    raise UserError("--adapter needs --base BASE: the checkpoint the adapter applies to "
                    "(any format t5forge reads)")
  if merge and to == "peft":
    raise UserError("--merge writes a full checkpoint: use --to t5forge or --to hf (without "
                    "--merge, --to peft rewrites the adapter alone)")
  if not merge and to == "hf":
    raise UserError("--to hf with --adapter needs --merge (a full HF checkpoint with the "
                    "adapter merged); --to peft writes the adapter for transformers")
  ckpt = load_checkpoint(base)
  plain = relayout(ckpt.params, scanned=ckpt.config.scan_layers, to_scanned=False)
  base_config = ckpt.config.replace(scan_layers=False)
  changes, params = read_any(adapter, base_config, fingerprint=adapters.fingerprint(plain),
                             base_name=base)
  if "prompt" in changes:
    return _convert_prompt(adapter, changes["prompt"], params, base, plain, base_config, output,
                           to=to, merge=merge)
  lora_config = changes["lora"]
  n = sum(int(np.size(x)) for m in _flat_adapter(params).values() for x in m.values())
  lines = [f"read LoRA adapter {adapter}: {len(_flat_adapter(params))} modules, {n:,} "
           f"parameters, rank {lora_config.rank}, on {ckpt.format} base {ckpt.path}"]
  config = base_config.replace(lora=lora_config)
  if to == "peft":
    write_peft(output, lora_config, params, base_config, base_name=base)
  elif to == "t5forge" and not merge:
    adapters.save(output, params, model_config=config.to_dict(),
                  record=base_record(base, plain, base_config))
  else:
    merged = lora.merge(adapters.join(params, plain), lora_config)
    vocab = of_checkpoint(ckpt)
    if to == "hf":
      lines += [f"note: {m}" for m in hf.save_hf(
          merged, base_config, output, vocabulary=vocab,
          tokenizer_dir=ckpt.path if ckpt.format == "hf" else None)]
    else:
      native.save(output, base_config, merged, extra_config={"vocabulary": vocab_io.to_spec(vocab)})
  what = "merged checkpoint" if merge else "adapter"
  return lines + [f"wrote {to} {what} to {output}"]


def _convert_prompt(adapter, cfg, params, base, plain, base_config, output, *, to, merge):
  """`convert --adapter` of a tuned prompt: to peft's PROMPT_TUNING or our format."""
  if merge:
    raise UserError(f"{adapter} is a tuned prompt: it has no weights to merge into the base's; "
                    "use --to peft or --to t5forge without --merge")
  arr = prompt_lib.get_prompt(params)
  lines = [f"read tuned prompt {adapter}: {arr.shape[0]} positions x {arr.shape[1]}"]
  config = base_config.replace(prompt=cfg)
  if to == "peft":
    prompt_lib.to_peft(output, arr, config, base_model_name_or_path=base)
  else:
    adapters.save(output, params, model_config=config.to_dict(),
                  record=base_record(base, plain, base_config))
  return lines + [f"wrote {to} adapter to {output}"]
