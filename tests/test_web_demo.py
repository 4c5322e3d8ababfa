"""The demo page the gateway serves, driven in headless Chromium against a real `pdrt up` on the tiny model.

A person's session, key by key: open the page (with an API key in the URL),
focus the input box (a warmup), type a prompt with a typo fixed and a
Shift+Enter line break (a draft, prefilled while typed), press Enter (the
answer streams in, with its TTFT), then a second turn after refocusing the box
(a warmup of the now known conversation). Each answer must equal the greedy
answer of the same conversation sent at once.
"""

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from pdrt.client import Client, SamplingParams
from pdrt.testing.node import Node, free_port

API_KEY = "web-demo-test-key"
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
FIRST = ("Write a function that parses the command line arguments of a small tool and returns",
         "a namespace with the options, or prints the usage message when an argument is wrong.")
SECOND = "Now add a --verbose flag."


def browser_paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    http_port = free_port()
    with Node(tmp_path_factory.mktemp("web-demo"), str(model_dirs["llama"]),
              extra={"gateway": {"http_port": http_port, "api_key": API_KEY},
                     "experimental": {"min_draft_chunk": 16}}) as running, \
            Client(running.address) as client:
        client.wait_ready(expected_workers=2, timeout_s=60)
        running.http_url = f"http://127.0.0.1:{http_port}"
        yield running


@pytest.fixture
def browser():
    paths = browser_paths()
    if paths is None:
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1000,800", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=paths[1]))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def status(node: Node):
    with Client(node.address) as client:
        return client.status()


def counter(node: Node, name: str) -> int:
    return status(node).counters.get(name, 0)


def load_of(node: Node, process_id: str):
    return next(w.load for w in status(node).workers if w.process_id == process_id)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what}: not met within {timeout_s} s")


def chat_completion(node: Node, messages: list[dict], key: str | None = API_KEY) -> tuple[int, dict]:
    """A non-streamed POST /v1/chat/completions: (status, JSON body)."""
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{node.http_url}/v1/chat/completions", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def text_of(driver, element) -> str:
    """The exact text of an element (WebElement.text would collapse its whitespace)."""
    return driver.execute_script("return arguments[0].textContent", element)


def last_answer(driver):
    """The last assistant entry once its stream has ended."""
    done = driver.find_elements(By.CSS_SELECTOR, "li.message.assistant[aria-busy='false']")
    return done[-1] if done else None


def send_and_read_answer(driver, node: Node, num_answers: int) -> tuple[str, int, str]:
    """Press Enter; returns the answer's text, its TTFT in ms and its meta line once it has streamed in."""
    driver.find_element(By.ID, "input").send_keys(Keys.ENTER)
    WebDriverWait(driver, 60).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "li.message.assistant[aria-busy='false']")) == num_answers,
        message=f"answer {num_answers} did not finish streaming; node log:\n{node.log_tail()}")
    answer = last_answer(driver)
    assert "error" not in answer.get_attribute("class"), answer.find_element(By.CLASS_NAME, "meta").text
    ttft_ms = answer.get_attribute("data-ttft-ms")
    assert ttft_ms is not None, "no TTFT recorded (no content chunk arrived)"
    meta = answer.find_element(By.CLASS_NAME, "meta").text
    return text_of(driver, answer.find_element(By.CLASS_NAME, "content")), int(ttft_ms), meta


def save_screenshot(driver, tmp_path: Path) -> Path:
    shot = tmp_path / "web_demo.png"
    assert driver.save_screenshot(str(shot)), "the screenshot was not written"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / "web_demo.png")
    return shot


def test_a_person_typing_in_the_page_is_prefilled_ahead_and_gets_the_greedy_answers_streamed(node, browser,
                                                                                              tmp_path):
    driver = browser
    driver.get(f"{node.http_url}/?key={API_KEY}&temperature=0&max_tokens={MAX_TOKENS}")
    page_status = driver.find_element(By.ID, "status")
    WebDriverWait(driver, 30).until(lambda d: "ready" in page_status.text, message="the model list did not load")
    assert f"key={API_KEY}" not in driver.current_url  # taken out of the address bar, kept in sessionStorage
    box = driver.find_element(By.ID, "input")
    assert driver.find_element(By.CSS_SELECTOR, "label[for='input']").text  # the box has a label

    # Focus: a warmup of a session the gateway has not seen yet.
    unknown_before = counter(node, "warmups_unknown_session")
    box.click()
    wait_for(lambda: counter(node, "warmups_unknown_session") > unknown_before, 10, "the warmup on focus")

    # Type the first message, with a typo erased and a Shift+Enter line break.
    updates_before = counter(node, "draft_updates")
    box.send_keys(FIRST[0][:40] + " argz")
    box.send_keys(Keys.BACKSPACE * 5)
    box.send_keys(FIRST[0][40:])
    box.send_keys(Keys.SHIFT, Keys.ENTER, Keys.NULL)
    box.send_keys(FIRST[1])
    first = "\n".join(FIRST)
    assert box.get_property("value") == first
    wait_for(lambda: counter(node, "draft_updates") > updates_before + 1, 10, "draft updates while typing")
    # A person pauses before Enter: long enough for the stable part of the draft to be prefilled.
    wait_for(lambda: load_of(node, "prefill-0").num_used_blocks > 0, 10, "the draft's prefill")

    answer, ttft_ms, meta = send_and_read_answer(driver, node, 1)
    messages = [{"role": "user", "content": first}]
    with Client(node.address) as client:
        assert answer == client.generate(messages=messages, params=GREEDY).text
    code, body = chat_completion(node, messages)
    assert code == 200 and answer == body["choices"][0]["message"]["content"]
    assert 0 <= ttft_ms < 60_000 and f"TTFT {ttft_ms} ms" in meta
    wait_for(lambda: load_of(node, "prefill-0").num_draft_tokens_ahead > 0, 10, "draft tokens prefilled ahead")
    assert box.get_property("value") == ""

    # Second turn: leave the box and come back (a warmup of the known conversation), then type and send.
    warmups_before = counter(node, "warmups")
    driver.find_element(By.TAG_NAME, "h1").click()
    time.sleep(1.1)  # the page sends at most one warmup a second
    box.click()
    wait_for(lambda: counter(node, "warmups") > warmups_before, 10, "the warmup of a known session")
    box.send_keys(SECOND)
    second_answer, _, _ = send_and_read_answer(driver, node, 2)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": SECOND}]
    with Client(node.address) as client:
        assert second_answer == client.generate(messages=messages, params=GREEDY).text

    # A message started and erased again: its draft is abandoned (and no update is sent after that).
    abandoned_before = counter(node, "drafts_abandoned")
    box.send_keys("Never mind")
    box.send_keys(Keys.BACKSPACE * len("Never mind"))
    wait_for(lambda: counter(node, "drafts_abandoned") > abandoned_before, 10, "the erased draft's abandon")
    time.sleep(0.5)  # a late update would show as a 404 in the browser's log

    shot = save_screenshot(driver, tmp_path)
    assert shot.stat().st_size > 1000
    severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe


def test_the_api_refuses_a_request_without_the_key_in_openais_error_shape(node):
    code, body = chat_completion(node, [{"role": "user", "content": "hi"}], key=None)
    assert code == 401 and body["error"]["message"] and body["error"]["code"]
