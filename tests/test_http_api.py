"""The OpenAI-compatible HTTP front against a real `pdrt up` (tiny model), driven by the official `openai` client."""

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from pdrt.client import Client, SamplingParams
from pdrt.testing.node import Node, free_port
from tests.system_client import used_blocks, wait_for

KEY = "test-api-key"
MAX_OPEN = 4


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    http_port = free_port()
    with Node(tmp_path_factory.mktemp("http"), str(model_dirs["llama"]),
              extra={"gateway": {"http_port": http_port, "api_key": KEY, "max_open_requests": MAX_OPEN}}) as running:
        running.http = f"http://127.0.0.1:{http_port}"
        yield running


@pytest.fixture(scope="module")
def api(node):
    return openai.OpenAI(base_url=node.http + "/v1", api_key=KEY, max_retries=0, timeout=60)


def http(node, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(node.http + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


MESSAGES = [{"role": "user", "content": "Write a function that parses a list."}]


def test_chat_and_completions_streamed_and_not_agree_with_the_native_client(node, api):
    whole = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with Client(node.address) as client:
        native = client.generate(messages=MESSAGES, params=SamplingParams(temperature=0, max_tokens=12))
    assert whole.choices[0].message.content == streamed == native.text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == native.usage.prompt_tokens
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens  # the usage chunk of include_usage
    text = api.completions.create(model="tiny", prompt="def parse(text):", max_tokens=10, temperature=0)
    pieces = list(api.completions.create(model="tiny", prompt="def parse(text):", max_tokens=10, temperature=0,
                                         stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text
    assert text.usage.completion_tokens == 10


def test_stop_strings_seeds_and_usage(api):
    free = api.completions.create(model="tiny", prompt="import os\nimport", max_tokens=30, temperature=0)
    cut_at = free.choices[0].text[3:8]  # a stop string the greedy output is known to contain
    stopped = api.completions.create(model="tiny", prompt="import os\nimport", max_tokens=30, temperature=0,
                                     stop=[cut_at])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free.choices[0].text[: free.choices[0].text.index(cut_at)]
    runs = [api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=s)
            .choices[0].message.content for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_bad_parameters_and_overlong_prompts_raise_bad_request(api):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="tiny", messages=MESSAGES, top_p=0.0)
    assert "top_p" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="tiny", prompt="word " * 20_000, max_tokens=4)
    assert info.value.body["code"] == "prompt_too_long"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=[])


def test_an_api_key_is_required_and_models_health_and_metrics_answer(node):
    assert http(node, "GET", "/v1/models", key=None)[0] == 401
    assert http(node, "GET", "/v1/models", key="wrong")[0] == 401
    status, body = http(node, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "llama"
    status, body = http(node, "GET", "/health", key=None)
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = http(node, "GET", "/metrics", key=None)
    assert status == 200 and b"pdrt_" in body


def test_overload_answers_429_with_a_message_and_others_are_served_after(node, api):
    async def main() -> None:
        aapi = openai.AsyncOpenAI(base_url=node.http + "/v1", api_key=KEY, max_retries=0, timeout=60)
        streams = [await aapi.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3000,
                                                      temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True}) for _ in range(MAX_OPEN)]
        for stream in streams:
            await stream.__anext__()  # each is admitted and streaming
        with pytest.raises(openai.RateLimitError) as info:
            await aapi.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert "open requests" in info.value.body["message"]
        for stream in streams:
            await stream.close()  # the client disconnects: the server cancels and frees the KV
        await aapi.close()

    asyncio.run(main())
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)
    assert api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4).choices[0].message.content


def test_a_disconnected_stream_frees_its_kv(node, api):
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)
    stream = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3000, temperature=0,
                                         stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    wait_for(lambda: used_blocks(node).get("decode-0", 0) > 0, 5)
    stream.close()
    wait_for(lambda: set(used_blocks(node).values()) == {0}, 10)


def test_a_draft_typed_over_http_answers_like_the_chat_completion(node, api):
    status, body = http(node, "POST", "/v1/pdrt/drafts", {"messages": [], "session_id": "web"})
    assert status == 201
    draft_id = json.loads(body)["draft_id"]
    text = MESSAGES[0]["content"] * 8
    for end in range(1, len(text) + 1, 7):
        assert http(node, "PUT", f"/v1/pdrt/drafts/{draft_id}", {"text": text[:end] + "#"})[0] == 204
    assert http(node, "PUT", f"/v1/pdrt/drafts/{draft_id}", {"text": text})[0] == 204
    status, body = http(node, "POST", f"/v1/pdrt/drafts/{draft_id}/submit", {"max_tokens": 10, "temperature": 0})
    assert status == 200
    typed = json.loads(body)["choices"][0]["message"]["content"]
    once = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=10,
                                       temperature=0).choices[0].message.content
    assert typed == once
    assert http(node, "PUT", f"/v1/pdrt/drafts/{draft_id}", {"text": "x"})[0] == 404  # submitted: gone
    assert http(node, "POST", "/v1/pdrt/warmup", {"session_id": "web"})[0] == 204
