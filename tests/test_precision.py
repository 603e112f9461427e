"""The run's precision when it sets none (t5forge/precision.py): bf16 where the machine
multiplies bf16 natively, printed and recorded in config.gin; an explicit dtype is kept, and
bfloat16 asked for on a CPU without bf16 instructions gets a note."""
import os

import pytest

from t5forge import precision
from t5forge.cli import gin_flags
from train_helpers import ROOT, TINY_GIN

ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
        "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 avx512_vpopcntdq\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16\n")
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_fp16 amx_bf16 amx_tile amx_int8\n"
AVX2_ONLY = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"  # no x86 'flags' line
NO_BF16 = frozenset({"avx2"})
# A gin without a dtype anywhere (the model gins leave it to the run).
AUTO_GIN = TINY_GIN.replace("network.ModelConfig.dtype = 'float32'\n", "")


def test_cpu_flags_and_the_reason_for_bf16():
  assert "avx512_bf16" in precision.cpu_flags(ZEN4)
  assert precision.bf16_reason("cpu", precision.cpu_flags(ZEN4)) == "CPU has avx512_bf16"
  assert precision.bf16_reason("cpu", precision.cpu_flags(SAPPHIRE_RAPIDS)) == "CPU has amx_bf16"
  assert precision.bf16_reason("cpu", precision.cpu_flags(AVX2_ONLY)) is None
  assert precision.cpu_flags(ARM) == frozenset()
  assert precision.bf16_reason("gpu", frozenset()) == "GPU backend"
  assert precision.cpu_flags("") == frozenset()


@pytest.mark.parametrize("cpuinfo,want", [(ZEN4, "bfloat16"), (SAPPHIRE_RAPIDS, "bfloat16"),
                                          (AVX2_ONLY, "float32"), (ARM, "float32")])
def test_auto_choice_by_cpu(cpuinfo, want):
  c = precision.choose(None, platform="cpu", flags=precision.cpu_flags(cpuinfo))
  assert (c.dtype, c.auto, c.note) == (want, True, None)
  if want == "bfloat16":
    assert c.line.startswith("precision: bfloat16 matmuls, float32 parameters (auto: CPU has ")
    assert '--gin.network.ModelConfig.dtype=\\"float32\\" to change' in c.line
  else:
    assert c.line == "precision: float32 (auto: this CPU has no bf16 instructions)"


def test_explicit_dtype_is_kept_and_slow_bf16_gets_a_note():
  zen4 = precision.cpu_flags(ZEN4)
  c = precision.choose("float32", platform="cpu", flags=zen4)
  assert (c.dtype, c.auto, c.note) == ("float32", False, None)
  assert precision.choose("bfloat16", platform="cpu", flags=zen4).note is None
  c = precision.choose("bfloat16", platform="cpu", flags=NO_BF16, flag="--dtype {}")
  assert (c.dtype, c.auto) == ("bfloat16", False)  # it runs as asked
  assert c.note.startswith("t5forge: note: dtype 'bfloat16' asked for, but this CPU has no "
                           "bf16 instructions")
  assert "slower than float32" in c.note and c.note.endswith("--dtype float32 for the fast path")
  assert "\n" not in c.note


def _parse(tmp_path, gin_text, *bindings):
  path = tmp_path / "run.gin"
  path.write_text(gin_text.format(steps=2, period=2, eval_period=1, stats_period=1,
                                  model="t5_1_1/tiny"))
  gin_flags.parse([str(path)], [f'MODEL_DIR="{tmp_path / "m"}"', *bindings])


def _dtype_bindings():
  import gin
  return [l.strip() for l in gin.config_str().splitlines() if "ModelConfig.dtype" in l]


@pytest.mark.parametrize("flags,want", [(frozenset({"avx512_bf16"}), "bfloat16"),
                                        (NO_BF16, "float32")])
def test_unset_dtype_is_bound_to_the_choice(tmp_path, flags, want):
  _parse(tmp_path, AUTO_GIN)
  c = gin_flags.apply_precision(platform="cpu", flags=flags)
  assert (c.dtype, c.auto) == (want, True)
  import gin
  assert gin.query_parameter("network.ModelConfig.dtype") == want
  assert _dtype_bindings() == [f"network.ModelConfig.dtype = '{want}'"]


@pytest.mark.parametrize("where", ["gin", "flag"])
def test_a_dtype_the_run_sets_is_kept(tmp_path, where):
  if where == "gin":
    _parse(tmp_path, TINY_GIN)  # binds dtype = 'float32'
  else:
    _parse(tmp_path, AUTO_GIN, "network.ModelConfig.dtype='float32'")
  c = gin_flags.apply_precision(platform="cpu", flags=frozenset({"avx512_bf16"}))
  assert (c.dtype, c.auto, c.line) == ("float32", False, "precision: float32 (as the run asks)")
  import gin
  assert gin.query_parameter("network.ModelConfig.dtype") == "float32"


def test_bf16_asked_on_a_cpu_without_it_runs_with_a_note(tmp_path):
  _parse(tmp_path, AUTO_GIN, "network.ModelConfig.dtype='bfloat16'")
  c = gin_flags.apply_precision(platform="cpu", flags=NO_BF16)
  assert (c.dtype, c.auto) == ("bfloat16", False)
  assert "no bf16 instructions" in c.note and '--gin.network.ModelConfig.dtype=\\"float32\\"' in c.note


def test_model_gins_leave_the_dtype_to_the_run():
  models = os.path.join(ROOT, "t5forge", "configs", "models")
  for family in os.listdir(models):
    for name in os.listdir(os.path.join(models, family)):
      with open(os.path.join(models, family, name), encoding="utf-8") as f:
        assert "\n  dtype =" not in f.read(), f"{family}/{name}"


@pytest.mark.slow
def test_train_prints_the_choice_records_it_and_reports_held_out_loss(tmp_path, monkeypatch,
                                                                      capsys):
  """A 2-step run with no dtype on a (faked) bf16 CPU: the precision line, dtype in
  config.gin, and the held-out loss at every EVAL_PERIOD (1 here)."""
  from t5forge.cli import train
  monkeypatch.setattr(precision, "cpu_flags", lambda *_: frozenset({"avx512_bf16"}))
  monkeypatch.delenv("T5FORGE_PROGRESS", raising=False)
  path = tmp_path / "run.gin"
  path.write_text(AUTO_GIN.format(steps=2, period=2, eval_period=1, stats_period=1,
                                  model="t5_1_1/tiny"))
  assert train.main([f"--gin_file={path}", f'--gin.MODEL_DIR="{tmp_path / "m"}"']) == 0
  out = capsys.readouterr().out
  assert ("precision: bfloat16 matmuls, float32 parameters (auto: CPU has avx512_bf16; "
          '--gin.network.ModelConfig.dtype=\\"float32\\" to change)') in out.splitlines()
  held = [l for l in out.splitlines() if l.startswith("held-out at step ")]
  assert [l.split(":")[0] for l in held] == ["held-out at step 1", "held-out at step 2"], out
  assert all("bible_translate_en_es loss per target token " in l for l in held)
  config = (tmp_path / "m" / "config.gin").read_text()
  assert "network.ModelConfig.dtype = 'bfloat16'" in config.splitlines()
  # A resume reads the same gin files: the same machine makes the same choice.
  _parse(tmp_path, AUTO_GIN)
  assert gin_flags.apply_precision(platform="cpu", flags=frozenset({"avx512_bf16"})).dtype == "bfloat16"
