"""The "would not fit in accelerator memory" line (`t5forge.train.device_memory`):
checked once before the first step, from the compiled step's memory analysis
against the device's allocator limit; the device limit is injected here (CPU has none)."""
import jax
import jax.numpy as jnp
import pytest

from t5forge.cli import main as cli
from t5forge.errors import UserError
from t5forge.nn import ModelConfig
from t5forge.train import device_memory
from train_helpers import write_gin

CFG = ModelConfig(vocab_size=97, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                  num_encoder_layers=1, num_decoder_layers=1)


class _Device:
  """A device that reports an allocator limit, as a GPU or TPU does."""
  platform, id, device_kind = "gpu", 0, "Fake H100"

  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return {"bytes_limit": self.limit, "bytes_in_use": 0}


def _compiled_step():
  # A state updated in place (donated, as the training step's) and a temporary.
  step = jax.jit(lambda s, b: (s + jnp.outer(b, b).sum(), b * 2), donate_argnums=(0,))
  return step.lower(jnp.ones((1024,)), jnp.ones((256,))).compile()


def test_step_bytes_counts_donated_state_once():
  compiled = _compiled_step()
  m = compiled.memory_analysis()
  need = device_memory.step_bytes(compiled)
  assert m.alias_size_in_bytes == 4096  # the donated [1024] float32 state
  assert need == (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - 4096 + m.generated_code_size_in_bytes)


def test_cpu_reports_no_limit_and_is_not_checked():
  cpu = jax.local_devices(backend="cpu")[0]
  assert cpu.platform == "cpu" and device_memory.limit_bytes(cpu) is None
  device_memory.check_step_fits(_compiled_step(), device=cpu, batch_size=8, config=CFG,
                                num_microbatches=None)


def test_over_the_limit_is_one_line_naming_the_settings():
  compiled = _compiled_step()
  need = device_memory.step_bytes(compiled)
  device_memory.check_step_fits(compiled, device=_Device(need), batch_size=8, config=CFG,
                                num_microbatches=None)  # exactly fits: no error
  with pytest.raises(UserError) as err:
    device_memory.check_step_fits(compiled, device=_Device(need - 1), batch_size=8,
                                  config=CFG, num_microbatches=None)
  msg = str(err.value)
  assert "\n" not in msg and "Fake H100 gpu:0" in msg
  for setting in ("BATCH_SIZE (now 8)", "trainer.Trainer.num_microbatches (now 1)",
                  "network.ModelConfig.remat_policy = 'minimal' or 'full' (now 'none')",
                  "network.ModelConfig.scan_layers = True (now False)"):
    assert setting in msg
  with pytest.raises(UserError) as err:  # only the settings that are left to change
    device_memory.check_step_fits(compiled, device=_Device(need - 1), batch_size=8,
                                  config=CFG.replace(remat_policy="full", scan_layers=True),
                                  num_microbatches=2)
  assert "remat_policy" not in str(err.value) and "scan_layers" not in str(err.value)
  assert "num_microbatches (now 2)" in str(err.value)


def _train(tmp_path, capsys, monkeypatch, limit):
  """`t5forge train` in this process (tiny T5.1.1, 2 steps) on a device whose limit is
  `limit`; returns (exit status, stderr, compilations of the training step)."""
  monkeypatch.setattr(device_memory, "limit_bytes", lambda device: limit)
  compiles = []

  def on_event(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration" and "train_step" in str(
        kw.get("fun_name")):
      compiles.append(kw["fun_name"])

  jax.monitoring.register_event_duration_secs_listener(on_event)
  gin = write_gin(tmp_path / "run.gin", steps=2, period=2, stats_period=2)
  try:
    with pytest.raises(SystemExit) as exit_:
      cli.main(["train", f"--gin_file={gin}", f'--gin.MODEL_DIR="{tmp_path / "m"}"'])
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  return exit_.value.code, capsys.readouterr().err, compiles


@pytest.mark.slow  # a tiny `t5forge train` in process: ~20-45 s
def test_training_that_does_not_fit_stops_before_the_first_step(tmp_path, capsys,
                                                                  monkeypatch):
  code, err, _ = _train(tmp_path, capsys, monkeypatch, limit=1 << 20)  # 1 MiB
  assert code == 2, f"the run did not stop: {err[-500:]}"
  line = err.strip().splitlines()[-1]
  assert line.startswith("t5forge: error: the training step needs"), err
  assert "has 0.0 GiB" in line and "BATCH_SIZE (now 8)" in line
  assert "network.ModelConfig.remat_policy" in line and "scan_layers" in line
  assert not (tmp_path / "m" / "checkpoint_2").exists()


@pytest.mark.slow  # a tiny `t5forge train` in process: ~20-45 s
def test_training_that_fits_runs_with_one_compilation_of_the_step(tmp_path, capsys,
                                                                  monkeypatch):
  code, err, compiles = _train(tmp_path, capsys, monkeypatch, limit=1 << 50)
  assert code == 0, err
  assert (tmp_path / "m" / "checkpoint_2").exists()
  assert len(compiles) == 1, compiles  # the check's AOT compile is the one jit runs
