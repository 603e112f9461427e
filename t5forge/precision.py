"""The compute dtype a training run gets when it does not choose one.

`t5forge train` calls `cli.gin_flags.apply_precision()` after parsing the gin files
(`t5forge demo` calls `for_machine`): a
run that binds no `ModelConfig.dtype` (the model gins leave it unset) gets 'bfloat16'
mixed precision where the hardware multiplies bf16 natively -- bf16 matmul operands with
float32 accumulation; parameters, optimizer state, residual stream, norms and softmax
stay float32 (T5X's own default activation dtype is bfloat16) -- and 'float32'
elsewhere. The choice is bound into the gin config, so the run's config.gin carries it
and a resume or `t5forge eval` of that directory computes as the training did.

On a CPU, bf16 is fast only with bf16 dot-product instructions (AVX512_BF16 on Zen 4 /
Cooper Lake and later, AMX on Sapphire Rapids and later); without them XLA emulates
bf16 through float32 conversions and the step is slower than in float32. A run that
asks for bfloat16 there runs as asked, with a one-line note.
"""
from __future__ import annotations

import dataclasses

import jax

from t5forge import multihost

# /proc/cpuinfo flags that give XLA native bf16 matmuls on x86 (best first).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# How a run sets the dtype: `t5forge train`'s gin flag ({} is the value).
GIN_FLAG = '--gin.network.ModelConfig.dtype=\\"{}\\"'


@dataclasses.dataclass(frozen=True)
class Choice:
  """What a run computes in and why.

  dtype: 'float32' or 'bfloat16' (None: the model is not configured through
    ModelConfig in gin, e.g. loaded whole from a checkpoint: nothing is chosen).
  auto: the run set no dtype and `dtype` is this machine's default.
  line: the startup line ("precision: ...").
  note: a one-line warning for a choice this machine runs slowly, else None.
  """
  dtype: str | None
  auto: bool
  line: str
  note: str | None = None


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
  """The CPU feature flags of /proc/cpuinfo's first 'flags' line (or of `cpuinfo`, its
  text); empty where there is none (not Linux, or not x86)."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        cpuinfo = f.read()
    except OSError:
      return frozenset()
  for line in cpuinfo.splitlines():
    key, sep, value = line.partition(":")
    if sep and key.strip() == "flags":
      return frozenset(value.split())
  return frozenset()


def bf16_reason(platform: str, flags: frozenset[str]) -> str | None:
  """Why this machine runs bf16 matmuls natively ('CPU has avx512_bf16', 'GPU backend'),
  or None where it does not. `platform`: jax.default_backend() ('cpu', 'gpu', 'tpu')."""
  if platform != "cpu":
    return f"{platform.upper()} backend"
  for flag in BF16_CPU_FLAGS:
    if flag in flags:
      return f"CPU has {flag}"
  return None


def choose(requested: str | None, *, platform: str, flags: frozenset[str],
           configurable: bool = True, flag: str = GIN_FLAG) -> Choice:
  """The dtype for a run that asked for `requested` (None: it did not) on this machine.

  Args:
    requested: the run's ModelConfig.dtype binding, None where it has none (a value
      that is not a plain string, e.g. a macro, counts as asked: '?').
    platform: jax.default_backend().
    flags: cpu_flags().
    configurable: whether the gin config builds a ModelConfig at all.
    flag: how the user sets the dtype, '{}' standing for the value (the lines name it).
  """
  reason = bf16_reason(platform, flags)
  if not configurable:
    return Choice(None, False, "precision: as the model's own config says (no "
                  "network.ModelConfig in the gin files)")
  if requested is None:
    if reason:
      return Choice("bfloat16", True, f"precision: bfloat16 matmuls, float32 parameters (auto: "
                    f"{reason}; {flag.format('float32')} to change)")
    why = ("this CPU has no bf16 instructions" if platform == "cpu"
           else f"{platform} backend")
    return Choice("float32", True, f"precision: float32 (auto: {why})")
  if requested == "bfloat16":
    note = None
    if reason is None:
      note = (f"t5forge: note: dtype 'bfloat16' asked for, but this CPU has no bf16 "
              f"instructions ({' or '.join(BF16_CPU_FLAGS)}): it runs as asked, with bf16 "
              f"emulated through float32 conversions, slower than float32; "
              f"{flag.format('float32')} for the fast path")
    return Choice("bfloat16", False, "precision: bfloat16 matmuls, float32 parameters "
                  "(as the run asks)", note)
  if requested == "float32":
    return Choice("float32", False, "precision: float32 (as the run asks)")
  return Choice(None, False, "precision: as the run's ModelConfig.dtype binding says")


def for_machine(requested: str | None = None, *, flag: str = GIN_FLAG,
                platform: str | None = None, flags: frozenset[str] | None = None) -> Choice:
  """`choose` on this machine, for a command whose dtype is a flag (`t5forge demo --dtype`)."""
  platform, flags = machine(platform, flags)
  return choose(requested, platform=platform, flags=flags, flag=flag)


def machine(platform: str | None = None,
            flags: frozenset[str] | None = None) -> tuple[str, frozenset[str]]:
  """JAX's backend and the CPU flags; in a multi-process job, process 0's flags, so that
  every process compiles the same program even on mixed hosts."""
  platform = jax.default_backend() if platform is None else platform
  if flags is None:
    flags = frozenset(multihost.gather_json(sorted(cpu_flags()))[0])
  return platform, flags
