"""The page `t5forge serve` shows at `/`, in a real headless browser:
Debian's chromium driven through chromedriver by selenium (`make test` installs both when
missing). A prompt typed into the page and run shows the server's own greedy completion, with
its score and latency, unstreamed and streamed, through the API key field; a bad option or a
wrong key shows the server's error message.
One server and one browser serve the whole module."""
import os
import re
import shutil

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from t5forge.testing import FAST_FLAGS, Server, request, tiny_checkpoint
from train_helpers import ROOT

PAGE = os.path.join(ROOT, "t5forge", "serve", "page.html")
PROMPT = "translate English to Spanish: ¿Quién es? God is love."
MAX_TOKENS = 6
KEY = "page-test-key"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
TURNS = ["God is love.", "Who is he?"]


def _complete(base: str, **body) -> dict:
  """The server's own answer, straight from the API (no browser)."""
  status, _, got = request(base, "/v1/completions", body,
                           headers={"Authorization": f"Bearer {KEY}"})
  assert status == 200, got
  return got


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """`t5forge serve` on a free 127.0.0.1 port over a tiny random T5 whose checkpoint carries
  the bundled SentencePiece vocabulary; few buckets so start-up compiles in seconds. It wants
  an API key, so the page's key field is exercised too, and chats with a plain template
  (--chat_template)."""
  d = tmp_path_factory.mktemp("page")
  ckpt = tiny_checkpoint(str(d / "tiny"))
  (d / "chat.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
  # A longer input bucket than FAST_FLAGS' (the last flag wins): a two-turn chat fits.
  srv = Server(ckpt, *FAST_FLAGS, "--length_buckets", "64", "--api_key", KEY,
               "--chat_template", str(d / "chat.jinja"))
  try:
    assert request(srv.url, "/health")[0] == 200, srv.output()[-3000:]
    yield srv.url
  finally:
    srv.stop()


@pytest.fixture(scope="module")
def browser():
  chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
  assert chromium and chromedriver, (
      "chromium and chromedriver must be on PATH: `make browser` installs Debian's chromium "
      "and chromium-driver")
  options = webdriver.ChromeOptions()
  for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,800"):
    options.add_argument(arg)
  options.binary_location = chromium  # given, so selenium never looks for (or fetches) one
  driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
  try:
    yield driver
  finally:
    driver.quit()


def _open(driver, base, key=KEY):
  """Loads the page and enters the API key; returns the model name it then shows."""
  driver.get(base + "/")
  # The page asks /v1/models for the model's name before it can send requests naming it; the
  # server refuses that until the key is given (Tab: the field's change event).
  WebDriverWait(driver, 20).until(lambda d: "401" in d.find_element(By.ID, "model").text)
  _set(driver, "api_key", key + Keys.TAB)
  WebDriverWait(driver, 20).until(
      lambda d: not d.find_element(By.ID, "model").text.startswith("("))
  return driver.find_element(By.ID, "model").text


def _set(driver, element_id, value):
  el = driver.find_element(By.ID, element_id)
  el.clear()
  el.send_keys(str(value))


def _run(driver, *, stream: bool, max_tokens=MAX_TOKENS):
  """Types the prompt, picks greedy, presses Run; returns the status the page ends in."""
  _set(driver, "prompt", PROMPT)
  _set(driver, "max_tokens", max_tokens)
  Select(driver.find_element(By.ID, "method")).select_by_value("greedy")
  box = driver.find_element(By.ID, "stream")
  if box.is_selected() != stream:
    box.click()
  status = driver.find_element(By.ID, "status")
  runs = int(status.get_attribute("data-runs"))
  driver.find_element(By.ID, "run").click()
  WebDriverWait(driver, 10).until(lambda d: int(status.get_attribute("data-runs")) == runs + 1)
  WebDriverWait(driver, 120).until(
      lambda d: d.find_element(By.ID, "status").get_attribute("data-state") in ("done", "error"))
  return driver.find_element(By.ID, "status").get_attribute("data-state")


def _shown(driver) -> tuple[str, str]:
  """The first output's exact text (textContent: no whitespace folding) and its meta line."""
  choice = driver.find_element(By.ID, "choice-0")
  return (choice.find_element(By.CLASS_NAME, "text").get_property("textContent"),
          choice.find_element(By.CLASS_NAME, "meta").text)


def _error(driver) -> str:
  return driver.find_element(By.ID, "error").text


@pytest.mark.slow
def test_page_is_served_self_contained(server):
  status, headers, body = request(server, "/")
  assert status == 200 and headers["content-type"].startswith("text/html")
  with open(PAGE, encoding="utf-8") as f:
    assert body == f.read()
  # Nothing fetched from elsewhere: the server may run where nothing else can be reached.
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", body)


@pytest.mark.slow
def test_page_shows_the_greedy_completion_score_and_latency(server, browser, tmp_path):
  want = _complete(server, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
  choice = want["choices"][0]
  assert choice["text"].strip(), want  # a random model still says something to compare
  assert _open(browser, server) == want["model"]
  state = _run(browser, stream=False)
  shot = tmp_path / "serve_page.png"
  browser.save_screenshot(str(shot))
  print(f"screenshot of the page: {shot}")
  assert state == "done", _error(browser)
  text, meta = _shown(browser)
  assert text == choice["text"]
  score = sum(choice["logprobs"]["token_logprobs"])
  assert f"score: {score:.4f}" in meta, meta
  assert f"finish_reason: {choice['finish_reason']}" in meta, meta
  assert re.fullmatch(r"latency \d+ ms", browser.find_element(By.ID, "latency").text)


def test_page_streams_the_same_completion(server, browser):
  want = _complete(server, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
  _open(browser, server)
  # The streamed path reads `data:` events until `data: [DONE]` (a plain JSON body would be
  # reported as a stream that ended early) and notes when the first one arrived.
  assert _run(browser, stream=True) == "done", _error(browser)
  text, meta = _shown(browser)
  assert text == want["choices"][0]["text"]
  # The server sends no log-probs in a stream (it refuses logprobs with stream=true).
  assert "score: (none reported)" in meta, meta
  assert f"finish_reason: {want['choices'][0]['finish_reason']}" in meta, meta
  assert re.fullmatch(r"latency \d+ ms \(first chunk \d+ ms\)",
                      browser.find_element(By.ID, "latency").text)


def test_page_shows_the_servers_error_message(server, browser):
  _open(browser, server)
  assert _run(browser, stream=False, max_tokens=0) == "error"
  assert "max_tokens" in _error(browser)
  assert not browser.find_elements(By.CSS_SELECTOR, "#output .choice")
  # The server keeps serving and the page recovers.
  assert _run(browser, stream=False) == "done", _error(browser)
  assert not browser.find_element(By.ID, "error").is_displayed()
  # A wrong key: the server's 401 message, shown as it is.
  _set(browser, "api_key", "not-the-key" + Keys.TAB)
  assert _run(browser, stream=False) == "error"
  assert "wrong API key" in _error(browser)


def _chat(base: str, messages: list[dict]) -> dict:
  status, _, got = request(base, "/v1/chat/completions",
                           {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
                           headers={"Authorization": f"Bearer {KEY}"})
  assert status == 200, got
  return got["choices"][0]["message"]["content"]


def test_chat_tab_streams_a_two_turn_conversation(server, browser):
  """The Chat tab sends the conversation so far and streams each answer into it: the
  page's answers are the server's own greedy chat answers to the same two turns."""
  first = _chat(server, [{"role": "user", "content": TURNS[0]}])
  second = _chat(server, [{"role": "user", "content": TURNS[0]},
                          {"role": "assistant", "content": first},
                          {"role": "user", "content": TURNS[1]}])
  assert first.strip() and second.strip()  # a random model still says something
  _open(browser, server)
  browser.find_element(By.ID, "tab-chat").click()
  assert browser.find_element(By.ID, "panel-chat").is_displayed()
  assert not browser.find_element(By.ID, "prompt").is_displayed()
  _set(browser, "max_tokens", MAX_TOKENS)
  Select(browser.find_element(By.ID, "method")).select_by_value("greedy")
  status = browser.find_element(By.ID, "status")
  for turn, want in zip(TURNS, (first, second)):
    runs = int(status.get_attribute("data-runs"))
    _set(browser, "chat-input", turn)
    browser.find_element(By.ID, "chat-send").click()
    WebDriverWait(browser, 10).until(lambda d: int(status.get_attribute("data-runs")) == runs + 1)
    WebDriverWait(browser, 120).until(
        lambda d: status.get_attribute("data-state") in ("done", "error"))
    assert status.get_attribute("data-state") == "done", _error(browser)
    shown = browser.find_elements(By.CSS_SELECTOR, "#chat-log .msg")
    assert shown[-1].get_attribute("class") == "msg assistant"
    assert shown[-1].get_property("textContent") == want
    assert shown[-1].get_attribute("data-finish-reason") in ("stop", "length")
  roles = [m.get_attribute("class") for m in browser.find_elements(By.CSS_SELECTOR,
                                                                    "#chat-log .msg")]
  assert roles == ["msg user", "msg assistant"] * 2
  texts = [m.get_property("textContent") for m in browser.find_elements(
      By.CSS_SELECTOR, "#chat-log .msg.user")]
  assert texts == TURNS
  # Streamed: the first chunk's time is shown, and the usage of the last turn.
  assert re.fullmatch(r"latency \d+ ms \(first chunk \d+ ms\)",
                      browser.find_element(By.ID, "latency").text)
  assert "prompt +" in browser.find_element(By.ID, "usage").text
  browser.find_element(By.ID, "tab-complete").click()
  assert browser.find_element(By.ID, "prompt").is_displayed()
