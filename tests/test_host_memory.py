"""host_memory.keep_freed_memory (T5FORGE_MALLOC=keep): a repeated XLA computation reuses
its freed temporaries instead of page-faulting fresh memory every run (counted with
getrusage, not timed); a bad value of the variable is a one-line CLI error."""
import os
import subprocess
import sys

import pytest

# Runs a jitted computation with a 100 MB temporary three times; prints the minor
# page faults of the last run.
SCRIPT = r"""
import resource, sys
from t5forge import host_memory
import t5forge.cli.main  # what the command line imports before it applies the setting
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "JAX started before the CLI's malloc setting"
applied = host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum((x @ x.T) @ x))  # the [5000, 5000] product is a temporary
x = jnp.ones((5000, 64), jnp.float32)
for _ in range(3):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults)
"""


def _run(env_value: str | None) -> tuple[bool, int]:
  env = dict(os.environ)
  env.pop("T5FORGE_MALLOC", None)
  if env_value:
    env["T5FORGE_MALLOC"] = env_value
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                       text=True, check=True).stdout.split()
  return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_freed_temporaries_are_reused_without_page_faults():
  applied, faults = _run("keep")
  default_applied, default_faults = _run(None)
  assert applied and not default_applied
  # 100 MB are ~24,000 pages: glibc's default maps them afresh every run.
  assert default_faults > 15_000, default_faults
  assert faults < 2_000, faults


def test_bad_malloc_setting_is_a_one_line_cli_error():
  env = dict(os.environ, T5FORGE_MALLOC="kept")
  proc = subprocess.run([sys.executable, "-m", "t5forge", "vocab", "--help"], env=env,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "t5forge: error: T5FORGE_MALLOC='kept': expected one of auto, hugepages, jemalloc, "
      "tcmalloc, keep, system or the path of a malloc library (auto: hugepages where the "
      "system allows, else jemalloc where installed)"]
