"""T5Gemma: bad input is one clear line, and instruction-tuned stop tokens.

Bad input: an HF T5Gemma directory whose nested encoder/decoder configs
disagree with its weights, a tokenizer that is missing or of the wrong size, a sliding
window larger than the position limit, num_heads not a multiple of num_kv_heads — each
one `UserError` line naming the file and field and the fix, through `t5forge.load`,
`t5forge convert`, `t5forge infer` and `t5forge train` (INITIAL_CHECKPOINT_PATH), with
nothing written. (A T5 checkpoint given to a T5Gemma model gin: tests/test_t5gemma_train.py
and test_t5gemma_parity.py.)

Stop tokens: instruction-tuned T5Gemma lists eos_token_id [1, 107] (<eos>, <end_of_turn>)
in config.json / generation_config.json; decoding stops on either, as transformers'
generate does. The test model is the random 'gqa' model with two rows of its decoder
embedding (tied to the output layer) swapped, so that a token its greedy output first
produces mid-row is 107: the same network with two ids relabelled.
"""
import json
import os
import shutil

import jax
import numpy as np
import pytest

import t5forge
from hf_t5gemma_reference import (BOS, EOS, PAD, _english_lines, build_hf_dir, load_hf_model,
                                  read_config, write_config, write_sentencepiece,
                                  write_tokenizer_config)
from t5forge import decoding
from t5forge.errors import UserError
from train_helpers import cli, error_line

pytestmark = pytest.mark.slow  # subprocess runs or heavy compiles: make test, not test-fast

END_OF_TURN = 107
STEPS = 10


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """The 'mha' HF directory (no tokenizer) and SentencePiece models of 256 (the model's
  vocab_size), 200 and 300 ids."""
  root = tmp_path_factory.mktemp("t5gemma_errors")
  out = {"mha": build_hf_dir("mha", str(root / "mha"))}
  for n in (256, 200, 300):
    out[n] = write_sentencepiece(str(root / f"tok{n}.model"), n)
  return out


def _variant(files, tmp_path, edit=None, tokenizer: int | None = 256, name="d") -> str:
  """A copy of the mha directory with `edit` applied to its config.json and a
  tokenizer.model of `tokenizer` ids (None: no tokenizer files at all)."""
  d = str(tmp_path / name)
  shutil.copytree(files["mha"], d)
  if tokenizer is not None:
    shutil.copy(files[tokenizer], os.path.join(d, "tokenizer.model"))
    write_tokenizer_config(d)
  if edit is not None:
    cfg = read_config(d)
    edit(cfg)
    write_config(d, cfg)
  return d


def _one_line(err) -> str:
  msg = str(err.value)
  assert "\n" not in msg, msg
  return msg


def _cli(*args):
  return cli(*args)  # in this process (train_helpers.cli)


# ---------------------------------------------------------------------------------------
# Bad input.

def _layers(side, n):
  return lambda c: c[side].update(num_hidden_layers=n, layer_types=[
      "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])


@pytest.mark.parametrize("edit,says", [
    # config says hidden 32, the safetensors have 64
    (lambda c: c["decoder"].update(hidden_size=32),
     "/d: weight 'model.decoder.embed_tokens.weight' has shape (256, 64), but config.json "
     "implies (256, 32)"),
    (lambda c: [c[s].update(hidden_size=32) for s in ("encoder", "decoder")],
     "config.json: decoder.cross_attention_hidden_size 64 is not encoder.hidden_size 32"),
    (_layers("decoder", 3),
     "config.json: decoder.num_hidden_layers is 3, but the weights hold 2 decoder layers "
     "(model.decoder.layers.0..1); set it (and decoder.layer_types) to 2"),
    (_layers("encoder", 1),
     "config.json: encoder.num_hidden_layers is 1, but the weights hold 2 encoder layers"),
    (lambda c: c["decoder"].update(num_key_value_heads=2),
     "weight 'model.decoder.layers.0.self_attn.k_proj.weight' has shape (64, 64), but "
     "config.json implies (32, 64)"),
    (lambda c: [c[s].update(sliding_window=1024) for s in ("encoder", "decoder")],
     "config.json: encoder.sliding_window 1024 is larger than encoder.max_position_embeddings "
     "512; set a window of at most 512"),
    (lambda c: c["decoder"].update(num_key_value_heads=3),
     "config.json: decoder.num_attention_heads 4 is not a multiple of "
     "decoder.num_key_value_heads 3"),
])
def test_config_that_disagrees_with_the_weights_or_itself_is_one_line(files, tmp_path, edit,
                                                                       says):
  d = _variant(files, tmp_path, edit, tokenizer=None)
  with pytest.raises(UserError) as e:
    t5forge.load(d)
  assert says in _one_line(e), str(e.value)


def test_convert_and_infer_cli_say_one_line_and_write_nothing(files, tmp_path):
  heads = _variant(files, tmp_path, lambda c: c["encoder"].update(num_key_value_heads=3),
                   name="heads")
  out = tmp_path / "converted"
  line = error_line(_cli("convert", "--input", heads, "--output", str(out), "--to", "t5forge"))
  assert ("heads/config.json: encoder.num_attention_heads 4 is not a multiple of "
          "encoder.num_key_value_heads 3" in line), line
  assert not out.exists()
  wrong = _variant(files, tmp_path, tokenizer=200, name="wrong_tokenizer")
  (tmp_path / "in.txt").write_text("In the beginning\n")
  out = tmp_path / "inferred"
  line = error_line(_cli("infer", "--checkpoint", wrong, "--input", str(tmp_path / "in.txt"),
                         "--output_dir", str(out)))
  assert "wrong_tokenizer/tokenizer.model: 200 ids, but config.json's vocab_size is 256" in line
  assert not out.exists()


def test_tokenizer_missing_or_larger_than_the_model_is_one_line(files, tmp_path):
  from t5forge import opener
  from t5forge.infer import infer_task
  from t5forge.train.settings import RestoreCheckpointConfig
  bare = _variant(files, tmp_path, tokenizer=None)
  (tmp_path / "in.txt").write_text("In the beginning\n")
  with pytest.raises(UserError) as e:
    infer_task(restore_checkpoint_cfg=RestoreCheckpointConfig(path=bare),
               input_path=str(tmp_path / "in.txt"), output_dir=str(tmp_path / "out"))
  assert "no vocabulary saved with this hf checkpoint" in _one_line(e)
  assert "pass --vocabulary" in str(e.value)
  # --vocabulary with more ids than the embedding has rows (ids past it would be garbage)
  with pytest.raises(UserError) as e:
    opener.open_checkpoint(bare, vocabulary_path=files[300])
  assert (f"{files[300]}: 300 ids, more than the 256 embedding rows (vocab_size) of {bare}"
          in _one_line(e))
  # The right one is read without T5's 100 sentinels (Gemma's tokenizer has none).
  opened = opener.open_checkpoint(bare, vocabulary_path=files[256])
  assert opened.vocabulary.vocab_size == 256 and not opened.vocabulary.extra_ids


def test_saved_config_error_names_its_file():
  """A native checkpoint's saved config is read by ModelConfig.from_dict: its errors name
  the file, as an HF config.json's do."""
  from t5forge import presets
  from t5forge.nn.config import ModelConfig
  saved = {**presets.get("t5gemma.tiny").to_dict(), "num_kv_heads": 3}
  with pytest.raises(UserError) as e:
    ModelConfig.from_dict(saved, source="ckpt/checkpoint_10/config")
  assert _one_line(e).startswith("ckpt/checkpoint_10/config: invalid model config: num_heads 4 "
                                 "is not a multiple of num_kv_heads 3; use a divisor of 4")
  assert "encoder_num_heads" not in str(e.value)  # the encoder's are the same numbers


def test_train_from_a_bad_hf_dir_or_gin_is_one_line(files, tmp_path):
  """INITIAL_CHECKPOINT_PATH = a directory whose window exceeds its position limit; and
  a model gin whose window does: one line each, no checkpoint written."""
  window = _variant(files, tmp_path, lambda c: [c[s].update(sliding_window=600)
                                                for s in ("encoder", "decoder")],
                    tokenizer=None, name="window")
  gin = tmp_path / "ft.gin"
  gin.write_text("include 'runs/finetune.gin'\ninclude 'models/t5gemma/tiny.gin'\n"
                 "MIXTURE_OR_TASK_NAME = 'bible_translate_en_es'\n"
                 "TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 16}\n"
                 "TRAIN_STEPS = 1\nBATCH_SIZE = 2\nDROPOUT_RATE = 0.0\n"
                 "network.ModelConfig.vocab_size = 8000\n")
  model_dir = tmp_path / "m"
  args = ["train", f"--gin_file={gin}", f'--gin.MODEL_DIR="{model_dir}"']
  line = error_line(_cli(*args, f'--gin.INITIAL_CHECKPOINT_PATH="{window}"'))
  assert ("window/config.json: encoder.sliding_window 600 is larger than "
          "encoder.max_position_embeddings 512; set a window of at most 512") in line, line
  assert not [n for n in os.listdir(model_dir) if not n.startswith(".")]
  line = error_line(_cli(*args, f'--gin.INITIAL_CHECKPOINT_PATH="{files["mha"]}"',
                         "--gin.network.ModelConfig.sliding_window=9000"))
  assert ("sliding_window 9000 is larger than max_position_embeddings 8192; use at most 8192"
          in line), line


# ---------------------------------------------------------------------------------------
# Stop tokens.

def _hf_greedy(model, enc: np.ndarray, eos) -> np.ndarray:
  """transformers' greedy `generate` stopping on `eos` (an id or a list) -> [b, STEPS]."""
  import torch
  x = torch.tensor(enc, dtype=torch.long)
  with torch.no_grad():
    out = model.generate(input_ids=x, attention_mask=(x != PAD).long(), do_sample=False,
                         num_beams=1, max_new_tokens=STEPS, min_new_tokens=0,
                         decoder_start_token_id=BOS, eos_token_id=eos, pad_token_id=PAD)
  out = out[:, 1:].numpy()
  return np.pad(out, ((0, 0), (0, STEPS - out.shape[1])))


@pytest.fixture(scope="module")
def instruct(tmp_path_factory, files):
  """An 'instruction-tuned' directory: the gqa model, a 256-id tokenizer.model, decoder
  ids X and 107 swapped where X is the first token greedy decoding produces mid-row, and
  eos_token_id [1, 107] in config.json and generation_config.json.

  Returns a dict: dir, lines (the input texts), enc [b, i] (their tokens + EOS, padded),
  want (transformers' greedy tokens with eos [1, 107]), row, at (the row and position
  where 107 ends it), before (transformers' tokens stopping on 1 only).
  """
  from safetensors.numpy import load_file, save_file
  from t5forge.data.vocab import SentencePieceVocabulary
  d = build_hf_dir("gqa", str(tmp_path_factory.mktemp("instruct") / "it"))
  shutil.copy(files[256], os.path.join(d, "tokenizer.model"))
  write_tokenizer_config(d)
  vocab = SentencePieceVocabulary(files[256])
  lines = _english_lines(200)[100:116]
  ids = [vocab.encode(line) + [EOS] for line in lines]
  enc = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for r, x in enumerate(ids):
    enc[r, :len(x)] = x
  plain = _hf_greedy(load_hf_model(d), enc, EOS)
  # A token that first appears after position 0 of a row, not a special id.
  row, at = next((r, k) for r in range(len(plain)) for k in range(1, STEPS)
                 if plain[r, k] > 3 and plain[r, k] not in plain[r, :k])
  x = int(plain[row, at])
  assert END_OF_TURN not in plain[row, :at]
  keep = [row] + [r for r in range(len(lines)) if r != row][:2]  # 3 rows: faster below
  lines, enc, row = [lines[r] for r in keep], enc[keep], 0
  path = os.path.join(d, "model.safetensors")
  state = load_file(path)
  emb = state["model.decoder.embed_tokens.weight"]  # tied: also the output layer
  emb[[x, END_OF_TURN]] = emb[[END_OF_TURN, x]]
  save_file(state, path, metadata={"format": "pt"})
  cfg = read_config(d)
  cfg["eos_token_id"] = [EOS, END_OF_TURN]
  write_config(d, cfg)
  gen_path = os.path.join(d, "generation_config.json")
  with open(gen_path) as f:
    gen = json.load(f)
  with open(gen_path, "w") as f:
    json.dump({**gen, "eos_token_id": [EOS, END_OF_TURN]}, f)
  hf = load_hf_model(d)
  return {"dir": d, "lines": lines, "enc": enc, "row": row, "at": at,
          "want": _hf_greedy(hf, enc, [EOS, END_OF_TURN]), "before": _hf_greedy(hf, enc, EOS),
          "model": t5forge.load(d)}


def test_greedy_stops_on_end_of_turn_as_transformers(instruct):
  ours, enc, row, at = instruct["model"], instruct["enc"], instruct["row"], instruct["at"]
  want = instruct["want"]
  assert ours.config.eos_token_ids == (EOS, END_OF_TURN)
  assert want[row, at] == END_OF_TURN and not want[row, at + 1:].any()
  tokens, _ = ours.predict(enc, max_decode_length=STEPS)
  np.testing.assert_array_equal(tokens, want)
  # Without the list the same weights decode past 107, as transformers does with eos 1.
  plain = t5forge.Model(ours.config.replace(eos_token_ids=None), ours.params,
                        vocabulary=ours.vocabulary)
  tokens, _ = plain.predict(enc, max_decode_length=STEPS)
  np.testing.assert_array_equal(tokens, instruct["before"])
  assert tokens[row, at] == END_OF_TURN and tokens[row, at + 1:].all()


def test_beam_search_and_chunked_generation_stop_on_end_of_turn(instruct):
  from t5forge import generation
  ours, enc, row, at = instruct["model"], instruct["enc"], instruct["row"], instruct["at"]

  def ended_rows(model):
    beams, _ = model.predict(enc, max_decode_length=STEPS, method="beam", beam_size=3,
                             return_all_decodes=True)
    hits = beams == END_OF_TURN
    first = hits.argmax(-1)
    tail = np.arange(STEPS) > first[..., None]
    return hits.any(-1), (hits.any(-1)[..., None] & tail & (beams != 0)).any(-1)

  stopped, went_on = ended_rows(ours)
  assert stopped.any() and not went_on.any()  # some beam ends in 107, none goes past it
  plain = t5forge.Model(ours.config.replace(eos_token_ids=None), ours.params)
  assert ended_rows(plain)[1].any()
  gen = generation.Generator(ours.model, ours.params, chunk_tokens=2)
  b = len(enc)
  chunks = []
  out = gen.generate(generation.Kind("greedy"), enc, decode_length=STEPS,
                     max_new_tokens=np.full((b,), STEPS), temperature=np.zeros((b,)),
                     topp=np.zeros((b,)), stream=True,
                     on_chunk=lambda t, n, f: chunks.append(f[row, 0]))
  np.testing.assert_array_equal(out.tokens[:, 0], instruct["want"])
  assert out.finished[row, 0] and out.lengths[row, 0] == at + 1
  assert len(chunks) > 1 and chunks[-1]


def test_infer_cuts_at_end_of_turn_and_leaves_it_out_of_the_text(instruct, tmp_path):
  from t5forge.infer import infer_task
  from t5forge.train.settings import DatasetConfig, RestoreCheckpointConfig
  row, at, want = instruct["row"], instruct["at"], instruct["want"]
  src = tmp_path / "in.txt"
  src.write_text("\n".join(instruct["lines"]) + "\n")
  result = infer_task(restore_checkpoint_cfg=RestoreCheckpointConfig(path=instruct["dir"]),
                      dataset_cfg=DatasetConfig(None, {"targets": STEPS}, batch_size=32),
                      input_path=str(src), output_dir=str(tmp_path))
  with open(result.path) as f:
    rows = [json.loads(line) for line in f]
  got = rows[row]
  assert got["prediction_tokens"] == [int(t) for t in want[row, :at + 1]]
  vocab = instruct["model"].vocabulary
  assert got["prediction"] == vocab.decode(got["prediction_tokens"][:-1])
  assert vocab.decode(got["prediction_tokens"]) != got["prediction"]  # 107 is a piece here
  # t5forge.load(...).generate: the same text.
  assert instruct["model"].generate([instruct["lines"][row]], max_decode_length=STEPS) == [
      got["prediction"]]


def test_eos_list_survives_conversion_both_ways(instruct, tmp_path):
  import transformers
  from t5forge.cli import convert as convert_cli
  native_dir, hf_dir = str(tmp_path / "native"), str(tmp_path / "back")
  assert convert_cli.main(["--input", instruct["dir"], "--output", native_dir,
                           "--to", "t5forge"]) == 0
  assert t5forge.convert.load_checkpoint(native_dir).config.eos_token_ids == (EOS, END_OF_TURN)
  assert convert_cli.main(["--input", native_dir, "--output", hf_dir, "--to", "hf"]) == 0
  assert read_config(hf_dir)["eos_token_id"] == [EOS, END_OF_TURN]
  assert transformers.GenerationConfig.from_pretrained(hf_dir).eos_token_id == [EOS,
                                                                                 END_OF_TURN]
  again = t5forge.convert.load_checkpoint(hf_dir)
  assert again.config == instruct["model"].config
  for a, b in zip(jax.tree.leaves(instruct["model"].params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("value,says", [
    ([1, "<end_of_turn>"], "eos_token_id [1, '<end_of_turn>'] is not a token id"),
    ([1, 300], "in [1, vocab_size 256)"),
])
def test_bad_eos_list_is_one_line(files, tmp_path, value, says):
  d = _variant(files, tmp_path, tokenizer=None)
  with open(os.path.join(d, "generation_config.json")) as f:
    gen = json.load(f)
  with open(os.path.join(d, "generation_config.json"), "w") as f:
    json.dump({**gen, "eos_token_id": value}, f)
  with pytest.raises(UserError) as e:
    t5forge.load(d)
  assert "generation_config.json: " in _one_line(e) and says in str(e.value)


def _script_logits(script: list[int], vocab: int = 16):
  """tokens_to_logits that emits script[i] at decode step i (a one-hot logit)."""
  import jax.numpy as jnp
  table = jax.nn.one_hot(jnp.asarray(script + [0]), vocab) * 10.0

  def step(state):
    return table[jnp.minimum(state.cur_index, len(script))], state.cache

  return step


def test_decode_functions_stop_on_any_of_several_ids_and_t5_stays_one_id():
  """Constructed logits [5, 7, 9, 1, 4]: with eos 1 the decode ends at 1 (T5's single id,
  the same comparison as before), with (1, 7) at 7; beam search alike."""
  import jax.numpy as jnp
  inputs = jnp.zeros((1, 6), jnp.int32)
  step = _script_logits([5, 7, 9, 1, 4])
  cache = {"index": jnp.zeros((), jnp.int32)}
  for eos, want in ((1, [5, 7, 9, 1, 0, 0]), ((1, 7), [5, 7, 0, 0, 0, 0])):
    got, _ = decoding.temperature_sample(inputs, cache, step, eos_id=eos, temperature=0.0)
    assert got[0, 0].tolist() == want, (eos, got)
    got, _ = decoding.beam_search(inputs, cache, step, eos_id=eos, num_decodes=2)
    assert got[0, -1].tolist() == want, (eos, got)
  # A traced array of ids (jit callers): the same.
  got, _ = jax.jit(lambda e: decoding.temperature_sample(inputs, cache, step, eos_id=e,
                                                         temperature=0.0))(jnp.asarray([1, 7]))
  assert got[0, 0].tolist() == [5, 7, 0, 0, 0, 0]
  assert decoding.text_ids([5, 7, 9, 1], 1) == [5, 7, 9, 1]
  assert decoding.text_ids([5, 7, 0, 0], (1, 7)) == [5]
  assert decoding.text_ids([5, 1, 7, 0], (1, 7)) == [5, 1]
  from t5forge import models, presets
  t5 = models.model_for(presets.get("t5_1_1.tiny"))
  assert t5.stop_ids == 1 and isinstance(t5.stop_ids, int)  # no eos_token_ids: T5's path


def test_serve_stops_on_end_of_turn(instruct):
  """`t5forge serve` on the directory: the completion ends at 107 ("stop"), its text
  without it, the usage counting it; streamed deltas join to the same text."""
  from t5forge import testing as sh
  row, at, want = instruct["row"], instruct["at"], instruct["want"]
  vocab = instruct["model"].vocabulary
  srv = sh.Server(instruct["dir"], "--max_batch_size", "1", "--batch_buckets", "1",
                  "--length_buckets", "64", "--decode_buckets", "16", "--warmup", "greedy")
  try:
    body = {"prompt": instruct["lines"][row], "max_tokens": STEPS, "temperature": 0}
    status, _, got = sh.request(srv.url, "/v1/completions", body)
    assert status == 200, got
    choice = got["choices"][0]
    assert choice["text"] == vocab.decode([int(t) for t in want[row, :at]])
    assert choice["finish_reason"] == "stop" and got["usage"]["completion_tokens"] == at + 1
    status, _, events = sh.request(srv.url, "/v1/completions", {**body, "stream": True})
    deltas = [json.loads(e[len("data: "):]) for e in events.split("\n\n")
              if e.startswith("data: {")]
    assert "".join(d["choices"][0]["text"] for d in deltas) == choice["text"]
  finally:
    srv.stop()


def test_jax_export_stops_on_end_of_turn(instruct, tmp_path):
  """`t5forge export --format jax` of the directory: the manifest lists both stop ids, the
  exported loop ends the row at 107 as the live model does, and its text leaves 107 out."""
  from t5forge.export import loader as exported
  row, at, want, enc = instruct["row"], instruct["at"], instruct["want"], instruct["enc"]
  out = str(tmp_path / "export")
  r = _cli("export", "--checkpoint", instruct["dir"], "--output", out, "--format", "jax",
           "--batch_sizes", f"1,{len(enc)}", "--input_lengths", str(enc.shape[1]),
           "--decode_lengths", str(STEPS), "--methods", "greedy")
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(out, "manifest.json")) as f:
    assert json.load(f)["eos_ids"] == [EOS, END_OF_TURN]
  gen = exported.ExportedGenerator(out)
  assert gen.stop_ids == (EOS, END_OF_TURN)
  res = gen.generate(exported.Kind(), enc, decode_length=STEPS,
                     max_new_tokens=np.full(len(enc), STEPS), temperature=None, topp=None)
  np.testing.assert_array_equal(res.tokens[:, 0], want)
  assert res.finished[row, 0] and res.lengths[row, 0] == at + 1
  vocab = instruct["model"].vocabulary
  text = gen.exported.generate([instruct["lines"][row]], max_new_tokens=STEPS)[0]
  assert text == vocab.decode([int(t) for t in want[row, :at]])
