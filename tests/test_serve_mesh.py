"""A model served on 8 CPU devices with 2-D parameter rules (`--num_partitions 2
--parameter_partitioning_dims 2`: a (data 4, model 2) mesh, embed sharded over 'data')
gives the same completions and scores as the same checkpoint served on one device."""
import concurrent.futures

import pytest

from t5forge.testing import FAST_FLAGS, Server, request, tiny_checkpoint
from train_helpers import host_devices

PROMPTS = ["In the beginning God created the heavens and the earth.", "Jesus wept.",
           "The LORD is my shepherd; I shall not want.", "Love is patient and kind.",
           "And God said, Let there be light.", "Amen.", "Blessed are the meek.", "Hello."]


def _outputs(server: Server) -> dict:
  def one(prompt):
    status, _, body = request(server.url, "/v1/completions", {
        "model": "ckpt", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]

  # Concurrent: batches of several rows, split over the data axis on the mesh.
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    greedy = list(pool.map(one, PROMPTS))
  status, _, listed = request(server.url, "/v1/completions", {
      "model": "ckpt", "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0})
  assert status == 200, listed
  status, _, scored = request(server.url, "/v1/score", {
      "model": "ckpt", "prompt": PROMPTS[:2], "targets": ["Amen.", "Hello."]})
  assert status == 200, scored
  return {"greedy": greedy, "listed": [c["text"] for c in listed["choices"]],
          "scores": scored}


@pytest.mark.slow
def test_served_on_8_devices_with_2d_rules_equals_one_device(tmp_path):
  ckpt = tiny_checkpoint(str(tmp_path / "ckpt"))
  out = {}
  for devices, flags in ((1, []), (8, ["--num_partitions", "2",
                                       "--parameter_partitioning_dims", "2"])):
    server = Server(ckpt, *FAST_FLAGS, *flags, env=host_devices(devices))
    try:
      assert f"{devices} cpu device(s)" in server.ready_line, server.ready_line
      out[devices] = _outputs(server)
    finally:
      assert server.stop() == 0, server.output()[-2000:]
  assert out[8]["greedy"] == out[1]["greedy"] and any(out[1]["greedy"])
  assert out[8]["listed"] == out[1]["listed"]
  scores = lambda o: [s["log_likelihood"] for s in o["scores"]["data"]]
  assert scores(out[8]) == pytest.approx(scores(out[1]), rel=1e-5, abs=1e-4)
